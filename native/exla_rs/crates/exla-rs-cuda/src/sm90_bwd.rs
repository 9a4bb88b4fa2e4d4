//! The Hopper backward (`kernels/sm90/flash_bwd_sm90.cuh`, sm_90a: wgmma for all five products,
//! TMA loads of K/V and of Q/dO per query tile on an mbarrier ring, a producer warp and two consumer
//! warpgroups with setmaxnreg): which calls take it, its tiles (the Rust mirror of
//! `sm90::BwdTraits90<D, F>`: change both) and the launch. The mma.sync backward's pre pass (delta,
//! dq_accum zeroed) and convert pass (dq = scale * dq_accum) run around it unchanged, and so do the
//! dbias passes (zero the f32 accumulator, round it into dbias) of a call with `bias_grad`.
//!
//! Opt-in only: `EXLA_RS_CUDA_PATH=sm90` runs it on compute capability 9.0 for f16/bf16 calls with
//! D = 64, 128 or 256, in every feature set ([`FeatureSet`]: key_mask, bias with dbias, ALiBi, dropout,
//! one instantiation each, as the mma.sync backward has); `auto` and `mma` keep every backward on
//! mma.sync until it has passed `test/gpu` and the sanitizers on Hopper. The feature sets
//! (issue 32, part 3) and D = 256 have run only on the GPU-on-CPU executor so far.
//! On an H200 (2026-11-28) the plain set at D = 64 and 128 passed `test/gpu` and memcheck, synccheck and initcheck, and ran
//! 1.50-1.57x the mma.sync backward at D = 128 (0.95-0.99x FlashAttention-2) but 0.82-0.88x at
//! D = 64. racecheck reported the lse / delta stage rows (one lane per warp arrived on the stage
//! barriers); every thread now arrives itself. `auto` waits for a clean racecheck run of that, and
//! would then take D = 128 only.

use crate::config::FeatureSet;
use crate::params::BwdParams;
use crate::sm90::{check_sm90a_device, check_tma_strides, PathOverride};
use crate::target::LaunchTarget;
use crate::tensor_map::{tiled_map_args, TensorMap};
use exla_rs_attn::{AttnError, AttnShape, ElementType};
use std::ffi::c_void;
use std::sync::OnceLock;

/// Head dims with an sm90 backward instantiation (kernels/sm90/generate.py BWD_HEAD_DIMS).
pub const SM90_BWD_HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// `BwdTraits90<D>::kBlockN`: keys per block. D = 256: 64 (both consumers take the same keys,
/// half the dK / dV columns each: 64 x 256 columns of dK and dV do not fit one consumer's registers).
pub fn block_n(d: usize) -> usize {
    if d == 256 {
        64
    } else {
        128
    }
}

/// `BwdTraits90<D, F>`: query rows per step, stages, threads.
pub const BLOCK_M: usize = 64;
pub const STAGES: usize = 2;
pub const THREADS: u32 = 384;

/// `BwdTraits90<D, F>::kSmemBytes`: K, V, the Q and dO stages, two dS buffers, the lse and delta
/// stages, the per-key flags, the mbarriers, (feature sets) each key's visible query rows, 1 KiB to
/// align the atoms.
pub fn bwd_smem_bytes(d: usize, features: FeatureSet) -> u32 {
    let n = block_n(d);
    let kv = n * d * 2;
    let q = BLOCK_M * d * 2;
    let ds = BLOCK_M * n * 2;
    let barriers = 2 + 2 * STAGES;
    let key_rows = if features == FeatureSet::PLAIN { 0 } else { 2 * n * 4 };
    (2 * kv + 2 * STAGES * q + 2 * ds + 2 * STAGES * BLOCK_M * 4 + n * 4 + barriers * 8 + key_rows + 1024) as u32
}

/// Why the sm90 backward cannot run this call, or Ok. Every feature set has an image at D = 64, 128
/// and 256 (kernels/sm90/generate.py), spill-free within the register split (sass_stats.py
/// --check-spills --check-regpool).
pub fn sm90_bwd_supports(cc: (i32, i32), dtype: ElementType, shape: &AttnShape) -> Result<(), String> {
    check_sm90a_device(cc)?;
    if dtype == ElementType::F32 {
        return Err("the sm90 backward runs f16 and bf16".into());
    }
    if !SM90_BWD_HEAD_DIMS.contains(&shape.head_dim) {
        return Err(format!("the sm90 backward has head dims {SM90_BWD_HEAD_DIMS:?}, not {}", shape.head_dim));
    }
    if shape.seq_q == 0 || shape.seq_k == 0 || shape.batch == 0 {
        return Err("an empty call (no tensor map describes an empty tensor)".into());
    }
    check_tma_strides(shape)
}

/// Whether the backward of this call runs on the sm90 kernel: only under `EXLA_RS_CUDA_PATH=sm90`,
/// whatever its feature set (`auto` takes none of them yet, the plain set included).
pub fn choose_backward(cc: (i32, i32), dtype: ElementType, shape: &AttnShape, setting: PathOverride) -> bool {
    setting == PathOverride::OptInSm90 && sm90_bwd_supports(cc, dtype, shape).is_ok()
}

/// What `status()` adds about the backward.
pub fn backward_path_summary(setting: Result<PathOverride, String>) -> String {
    match setting {
        Ok(PathOverride::OptInSm90) => "backward: sm90 (wgmma/TMA, EXLA_RS_CUDA_PATH=sm90: the plain set passed test/gpu on an H200 and awaits a clean \
                                        racecheck run there before auto takes it; the key_mask/bias/dbias/ALiBi/dropout sets have run only on \
                                        the GPU-on-CPU executor; D = 256 too) on compute capability 9.0 for f16/bf16 calls with D = 64, 128 or 256, \
                                        optional operands included; mma.sync for every other backward"
            .into(),
        _ => "backward: mma.sync (EXLA_RS_CUDA_PATH=sm90 opts in to the sm90 backward at D = 64/128/256 on compute capability 9.0)".into(),
    }
}

fn kernel_name(dtype: ElementType, d: usize, features: FeatureSet) -> (&'static str, &'static str) {
    // Interned like sm90.rs's names: the module cache keys on &'static str.
    type Name = (ElementType, usize, FeatureSet, &'static str, &'static str);
    static NAMES: OnceLock<Vec<Name>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        let mut v = Vec::new();
        for dt in [ElementType::F16, ElementType::BF16] {
            for d in SM90_BWD_HEAD_DIMS {
                for f in FeatureSet::ALL {
                    let file: &'static str = Box::leak(format!("sm90_bwd_{}_d{d}{}", dt.name(), f.suffix()).into_boxed_str());
                    let kernel: &'static str = Box::leak(format!("exla_rs_{file}").into_boxed_str());
                    v.push((dt, d, f, file, kernel));
                }
            }
        }
        v
    });
    let &(.., file, kernel) = names.iter().find(|(t, e, f, ..)| *t == dtype && *e == d && *f == features).expect("checked by sm90_bwd_supports");
    (file, kernel)
}

/// The sm90 backward's (file, kernel) for a dtype, head dim and feature set (None where there is no
/// instantiation).
pub fn sm90_backward_kernel(dtype: ElementType, d: usize, features: FeatureSet) -> Option<(&'static str, &'static str)> {
    (dtype != ElementType::F32 && SM90_BWD_HEAD_DIMS.contains(&d)).then(|| kernel_name(dtype, d, features))
}

/// Whether this backward call takes the sm90 kernel (the caller then runs the passes before the
/// mma.sync main kernel, [`launch`] in its place, and the passes after it).
pub fn takes(dev: &dyn LaunchTarget, dtype: ElementType, shape: &AttnShape) -> Result<bool, AttnError> {
    let setting = PathOverride::from_env().map_err(AttnError::invalid)?;
    if setting != PathOverride::OptInSm90 {
        return Ok(false);
    }
    Ok(choose_backward(dev.compute_capability()?, dtype, shape, setting))
}

/// Launches the sm90 backward's main kernel (between the pre and convert passes).
///
/// # Safety
/// As `launch::backward`: `p` holds device pointers (of `dev`) of the sizes the contract implies,
/// `p.dq_accum` zeroed by the pre pass (and `p.dbias_accum`, when set, by the dbias zero pass);
/// `features` is the call's set (`FeatureSet::of(&p.x, dbias)`).
pub unsafe fn launch(dev: &dyn LaunchTarget, dtype: ElementType, shape: &AttnShape, features: FeatureSet, p: &BwdParams) -> Result<(), AttnError> {
    let d = shape.head_dim;
    let tq = dev.encode_tiled(&tiled_map_args(dtype, p.q as u64, shape.batch, shape.seq_q, shape.heads, d, BLOCK_M))?;
    let tdo = dev.encode_tiled(&tiled_map_args(dtype, p.d_o as u64, shape.batch, shape.seq_q, shape.heads, d, BLOCK_M))?;
    let tk = dev.encode_tiled(&tiled_map_args(dtype, p.k as u64, shape.batch, shape.seq_k, shape.kv_heads, d, block_n(d)))?;
    let tv = dev.encode_tiled(&tiled_map_args(dtype, p.v as u64, shape.batch, shape.seq_k, shape.kv_heads, d, block_n(d)))?;
    let smem = bwd_smem_bytes(d, features);
    let (file, kernel) = kernel_name(dtype, d, features);
    let f = dev.function(file, kernel, smem)?;
    let mut args = [
        p as *const BwdParams as *mut c_void,
        &tq as *const TensorMap as *mut c_void,
        &tk as *const TensorMap as *mut c_void,
        &tv as *const TensorMap as *mut c_void,
        &tdo as *const TensorMap as *mut c_void,
    ];
    let grid = (shape.seq_k.div_ceil(block_n(d)) as u32, shape.kv_heads as u32, shape.batch as u32);
    dev.launch(f, kernel, grid, THREADS, smem, &mut args)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(d: usize) -> AttnShape {
        AttnShape { batch: 2, seq_q: 300, seq_k: 517, heads: 8, kv_heads: 2, head_dim: d }
    }
    const H100: (i32, i32) = (9, 0);

    #[test]
    fn only_the_opt_in_takes_the_sm90_backward() {
        for dt in [ElementType::F16, ElementType::BF16] {
            for d in SM90_BWD_HEAD_DIMS {
                assert!(choose_backward(H100, dt, &shape(d), PathOverride::OptInSm90), "{dt} d{d}");
                assert!(!choose_backward(H100, dt, &shape(d), PathOverride::Auto));
                assert!(!choose_backward(H100, dt, &shape(d), PathOverride::ForceMma));
                assert!(!choose_backward((8, 0), dt, &shape(d), PathOverride::OptInSm90));
                assert!(!choose_backward(H100, dt, &AttnShape { seq_q: 0, ..shape(d) }, PathOverride::OptInSm90));
            }
            for d in [32, 96, 192] {
                assert!(!choose_backward(H100, dt, &shape(d), PathOverride::OptInSm90), "{dt} d{d}");
            }
        }
        assert!(!choose_backward(H100, ElementType::F32, &shape(64), PathOverride::OptInSm90));
    }

    #[test]
    fn every_feature_set_has_its_own_image_and_auto_takes_none() {
        // One image per (dtype, head dim, set), named as generate.py names them; the status line
        // says auto keeps every backward on mma.sync.
        let mut kernels = std::collections::HashSet::new();
        for dt in [ElementType::F16, ElementType::BF16] {
            for d in SM90_BWD_HEAD_DIMS {
                for f in FeatureSet::ALL {
                    let (file, kernel) = sm90_backward_kernel(dt, d, f).unwrap();
                    assert_eq!(file, format!("sm90_bwd_{}_d{d}{}", dt.name(), f.suffix()));
                    assert!(kernels.insert(kernel), "{kernel} twice");
                }
            }
            assert!(sm90_backward_kernel(dt, 192, FeatureSet::PLAIN).is_none());
        }
        assert!(sm90_backward_kernel(ElementType::F32, 64, FeatureSet::PLAIN).is_none());
        assert_eq!(kernels.len(), 24);
        assert!(backward_path_summary(Ok(PathOverride::Auto)).starts_with("backward: mma.sync"));
        assert!(backward_path_summary(Ok(PathOverride::OptInSm90)).contains("optional operands included"));
    }

    #[test]
    fn smem_mirrors_the_kernel_traits_and_fits_an_h100_block() {
        const P: FeatureSet = FeatureSet::PLAIN;
        assert_eq!(bwd_smem_bytes(128, P), 2 * 32768 + 4 * 16384 + 2 * 16384 + 4 * 256 + 512 + 6 * 8 + 1024);
        // D = 256: 64-key blocks; K, V (32 KiB each), 2 stages of Q and dO (32 KiB each), 2 dS (8 KiB).
        assert_eq!(bwd_smem_bytes(256, P), 2 * 32768 + 4 * 32768 + 2 * 8192 + 4 * 256 + 256 + 6 * 8 + 1024);
        assert_eq!((block_n(64), block_n(128), block_n(256)), (128, 128, 64));
        for d in SM90_BWD_HEAD_DIMS {
            for f in FeatureSet::ALL {
                // The feature sets add each key's query rows (two i32 per key).
                let rows = if f == P { 0 } else { 8 * block_n(d) as u32 };
                assert_eq!(bwd_smem_bytes(d, f), bwd_smem_bytes(d, P) + rows);
                assert!(bwd_smem_bytes(d, f) <= 227 * 1024, "d{d} {f:?}");
            }
        }
        let src = crate::embedded::find("sm90_bwd_bf16_d128").unwrap().source;
        for needle in [
            "kBlockN = kSharedKeys ? kKeysPerConsumer : kKeysPerConsumer * kConsumers",
            "kSharedKeys = D == 256",
            "kKeyRowsBytes = F != 0 ? 2 * kBlockN * 4 : 0",
            "kSmemBytes = kKeyRowsOffset + kKeyRowsBytes + 1024",
            "kKeysPerConsumer = 64",
            "kBlockM = 64",
            "kStages = 2",
            "kBarriers = 2 + 2 * kStages",
            "kKbadOffset = kDeltaOffset + kStages * kBlockM * 4",
        ] {
            assert!(src.contains(needle), "BwdTraits90 changed ({needle}): update sm90_bwd.rs");
        }
    }

    #[test]
    fn every_sm90_backward_kernel_is_embedded_in_the_sm90a_set() {
        for dt in [ElementType::F16, ElementType::BF16] {
            for d in SM90_BWD_HEAD_DIMS {
                for f in FeatureSet::ALL {
                    let (file, kernel) = kernel_name(dt, d, f);
                    let k = crate::embedded::find(file).unwrap_or_else(|| panic!("{file} not embedded"));
                    assert_eq!(k.set, crate::embedded::KernelSet::Sm90a);
                    assert!(k.source.contains(&format!("{kernel}(")), "{file} does not define {kernel}");
                }
            }
        }
    }
}
