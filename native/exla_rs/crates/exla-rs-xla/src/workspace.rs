//! `exla_rs_flash_attn_workspace_bytes`: what trailing workspace a call takes on a platform.

use exla_rs_attn::{AttnShape, ElementType, Pass, Platform};

/// -1 when the codes, dims or platform support say no; else the workspace size in bytes.
#[allow(clippy::too_many_arguments)]
pub fn workspace_bytes(pass: i32, platform: i32, dtype: i32, b: i64, sq: i64, sk: i64, h: i64, hkv: i64, d: i64) -> i64 {
    let (Some(pass), Some(platform), Some(dtype)) = (Pass::from_code(pass), Platform::from_code(platform), ElementType::from_xla_code(dtype))
    else {
        return -1;
    };
    if [b, sq, sk, h, hkv, d].iter().any(|&x| x < 0) {
        return -1;
    }
    let shape = AttnShape {
        batch: b as usize,
        seq_q: sq as usize,
        seq_k: sk as usize,
        heads: h as usize,
        kv_heads: hkv as usize,
        head_dim: d as usize,
    };
    platform_workspace(pass, platform, dtype, &shape).map_or(-1, |n| n as i64)
}

/// The workspace a valid shape needs on `platform`, or why it is not supported there.
pub fn platform_workspace(pass: Pass, platform: Platform, dtype: ElementType, shape: &AttnShape) -> Result<usize, String> {
    shape.validate().map_err(|e| e.to_string())?;
    match platform {
        Platform::Host => Ok(exla_rs_attn::host::workspace_bytes(pass, dtype, shape)),
        Platform::Cuda => exla_rs_cuda::workspace_requirement(pass, dtype, shape),
    }
}

/// Bytes a backward with `bias_grad` appends to the base workspace (`workspace_bytes`) for a bias
/// of dims `[bb, hb, sqb, skb]`: the whole workspace is then at least base + this, and the extra
/// part starts at offset base. 0 = none (the Host allocates its own dbias scratch); -1 for an
/// unknown platform code or dims that are not a bias (negative, or a byte count past i64).
pub fn dbias_workspace_bytes(platform: i32, bb: i64, hb: i64, sqb: i64, skb: i64) -> i64 {
    let Some(platform) = Platform::from_code(platform) else {
        return -1;
    };
    let Some(bytes) = exla_rs_cuda::dbias_workspace_bytes([bb, hb, sqb, skb]) else {
        return -1;
    };
    match platform {
        Platform::Host => 0,
        Platform::Cuda => bytes as i64,
    }
}

/// The C export of [`dbias_workspace_bytes`] (docs/flash-attention-contract.md, "The workspace
/// rule"): kept beside the rule it extends rather than in lib.rs's list of exports.
#[no_mangle]
pub extern "C" fn exla_rs_flash_attn_dbias_workspace_bytes(platform: i32, bb: i64, hb: i64, sqb: i64, skb: i64) -> i64 {
    // Never unwind into C.
    std::panic::catch_unwind(|| dbias_workspace_bytes(platform, bb, hb, sqb, skb)).unwrap_or(-1)
}

/// Feature bits of `exla_rs_flash_attn_features` (docs/flash-attention-contract.md).
pub const FEATURE_KEY_MASK: u32 = 1;
pub const FEATURE_BIAS: u32 = 2;
pub const FEATURE_ALIBI: u32 = 4;
pub const FEATURE_BIAS_GRAD: u32 = 8;
pub const FEATURE_DROPOUT: u32 = 16;

/// The optional features `platform`'s handlers run. Both run all of them: on CUDA the f32 SIMT
/// kernels (kernels/simt.cuh) and the f16/bf16 tensor-core kernels (flash_fwd.cuh, flash_bwd.cuh)
/// take the key mask, bias (with dbias), ALiBi and dropout; the sm90 forward declines calls with
/// optional operands, which then run on the mma.sync forward.
pub fn features(platform: Platform) -> u32 {
    let all = FEATURE_KEY_MASK | FEATURE_BIAS | FEATURE_ALIBI | FEATURE_BIAS_GRAD | FEATURE_DROPOUT;
    match platform {
        Platform::Host => all,
        Platform::Cuda => all,
    }
}
