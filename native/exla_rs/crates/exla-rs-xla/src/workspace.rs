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

/// Feature bits of `exla_rs_flash_attn_features` (docs/flash-attention-contract.md).
pub const FEATURE_KEY_MASK: u32 = 1;
pub const FEATURE_BIAS: u32 = 2;
pub const FEATURE_ALIBI: u32 = 4;
pub const FEATURE_BIAS_GRAD: u32 = 8;
pub const FEATURE_DROPOUT: u32 = 16;

/// The optional features `platform`'s handlers run. CUDA has none yet: its kernels take only the
/// base contract, so a call with a key mask, bias or ALiBi answers UNIMPLEMENTED there and the
/// Elixir layer keeps such calls on the Nx fallback.
pub fn features(platform: Platform) -> u32 {
    match platform {
        Platform::Host => FEATURE_KEY_MASK | FEATURE_BIAS | FEATURE_ALIBI | FEATURE_BIAS_GRAD,
        Platform::Cuda => 0,
    }
}
