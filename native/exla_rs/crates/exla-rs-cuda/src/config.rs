//! Which configurations have a CUDA kernel, how each is launched (the Rust mirror of the kernels'
//! traits: change both together), and how much workspace a call needs.

use crate::params::ExtraParams;
use exla_rs_attn::{AttnShape, ElementType, Pass};

/// Head dims with a kernel instantiation (kernels/generate.py).
pub const HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

/// Grid y and z hold heads and batch: the hardware caps both at 65535.
const MAX_GRID_YZ: usize = 65_535;

/// One kernel launch: function, grid, block, dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// The instantiation file (module) holding the kernel.
    pub file: &'static str,
    pub kernel: &'static str,
    pub grid: (u32, u32, u32),
    pub block: u32,
    pub smem: u32,
}

/// Why a valid call has no CUDA kernel, or Ok.
pub fn check_supported(dtype: ElementType, shape: &AttnShape) -> Result<(), String> {
    if !HEAD_DIMS.contains(&shape.head_dim) {
        return Err(format!(
            "no CUDA kernel for head dim D={} ({}); CUDA kernels exist for D in {:?}",
            shape.head_dim, dtype, HEAD_DIMS
        ));
    }
    if shape.heads > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(format!(
            "CUDA kernels take at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries, got H={} B={}",
            shape.heads, shape.batch
        ));
    }
    let i32_max = i32::MAX as usize;
    if shape.seq_q > i32_max || shape.seq_k > i32_max || shape.batch * shape.seq_q * shape.heads > i32_max {
        return Err(format!(
            "CUDA kernels index rows with 32-bit integers: Sq={} Sk={} B*Sq*H={} is too large",
            shape.seq_q,
            shape.seq_k,
            shape.batch * shape.seq_q * shape.heads
        ));
    }
    Ok(())
}

fn div_up(a: usize, b: usize) -> u32 {
    a.div_ceil(b) as u32
}

fn align256(n: usize) -> usize {
    n.div_ceil(256) * 256
}

/// Backward scratch, in this order: delta f32 [B,H,Sq], then (f16/bf16) dq_accum f32 [B,Sq,H,D].
pub fn bwd_workspace_layout(dtype: ElementType, shape: &AttnShape) -> (usize, usize) {
    let delta = align256(shape.batch * shape.heads * shape.seq_q * 4);
    let accum = match dtype {
        ElementType::F32 => 0,
        _ => shape.q_len() * 4,
    };
    (delta, accum)
}

/// Bytes of the trailing workspace result, or why CUDA has no kernel for the configuration.
pub fn workspace_requirement(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Result<usize, String> {
    check_supported(dtype, shape)?;
    Ok(match pass {
        Pass::Forward => 0,
        // With no query rows both parts are 0: the kernels never touch scratch then.
        Pass::Backward => {
            let (delta, accum) = bwd_workspace_layout(dtype, shape);
            delta + accum
        }
    })
}

/// Bytes the backward appends to its base workspace (at offset `workspace_requirement`) when it
/// returns `dbias`: the f32 accumulator, one element per bias element (dense, like the bias).
/// None when the dims are not a bias (a negative or overflowing count).
pub fn dbias_workspace_bytes(bias_dims: [i64; 4]) -> Option<usize> {
    bias_dims
        .iter()
        .try_fold(4usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
        .filter(|&n| n <= i64::MAX as usize)
}

/// [`workspace_requirement`] without the reason: None when unsupported.
pub fn workspace_bytes(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Option<usize> {
    workspace_requirement(pass, dtype, shape).ok()
}

fn dt(dtype: ElementType) -> &'static str {
    dtype.name()
}

/// Interned names: the kernels are `extern "C"` symbols named after dtype and head dim.
fn name(parts: &[&str]) -> &'static str {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let s = parts.concat();
    let mut set = NAMES.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&n) = set.get(s.as_str()) {
        return n;
    }
    let leaked: &'static str = Box::leak(s.into_boxed_str());
    set.insert(leaked);
    leaked
}

/// The tensor-core kernels' compile-time feature sets (`F` in kernels/flash_fwd.cuh and
/// flash_bwd.cuh, FEATURE_SETS in kernels/generate.py): each (pass, dtype, head dim) has one
/// instantiation per set, and a call runs the smallest set that covers its optional operands, so
/// the common call (no optional operand) runs a kernel with none of their code. The f32 SIMT
/// kernels and the sm90 forward have one set each (the sm90 forward takes plain calls only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FeatureSet {
    /// key_mask, bias, ALiBi or dbias: the masks and additive terms.
    pub masks: bool,
    pub dropout: bool,
}

impl FeatureSet {
    pub const PLAIN: FeatureSet = FeatureSet { masks: false, dropout: false };
    pub const ALL: [FeatureSet; 4] = [
        FeatureSet::PLAIN,
        FeatureSet { masks: true, dropout: false },
        FeatureSet { masks: false, dropout: true },
        FeatureSet { masks: true, dropout: true },
    ];

    /// The set a call with these optional operands needs (`dbias`: the backward returns dbias).
    pub fn of(x: &ExtraParams, dbias: bool) -> FeatureSet {
        FeatureSet {
            masks: !x.key_mask.is_null() || !x.bias.is_null() || !x.alibi_slopes.is_null() || dbias,
            dropout: !x.dropout_key.is_null(),
        }
    }

    /// The kernel and file name suffix (generate.py's FEATURE_SETS keys).
    pub fn suffix(self) -> &'static str {
        match (self.masks, self.dropout) {
            (false, false) => "",
            (true, false) => "_mask",
            (false, true) => "_drop",
            (true, true) => "_mask_drop",
        }
    }
}

/// Tensor-core forward tiles (FwdTraits in kernels/flash_fwd.cuh).
fn fwd_tc_traits(d: usize) -> (usize, usize, usize) {
    let warps = if d <= 192 { 8 } else { 4 };
    let block_m = 16 * warps;
    let block_n = if d <= 128 { 64 } else { 32 };
    (warps, block_m, block_n)
}

pub fn fwd_smem_bytes(d: usize) -> usize {
    let (_, bm, bn) = fwd_tc_traits(d);
    (bm * d + 4 * bn * d) * 2
}

/// Tensor-core backward tiles (BwdTraits in kernels/flash_bwd.cuh): (warps, block_m, block_n).
fn bwd_tc_traits(d: usize) -> (usize, usize, usize) {
    let warps = if d <= 192 { 4 } else { 8 };
    let split = if d <= 128 { 1 } else if d <= 192 { 2 } else { 4 };
    let block_n = 16 * warps / split;
    let block_m = if d <= 96 { 64 } else { 32 };
    (warps, block_m, block_n)
}

pub fn bwd_smem_bytes(d: usize) -> usize {
    let (_, bm, bn) = bwd_tc_traits(d);
    // + bn * 4: the per-key "K row held an inf/NaN" flags (flash_bwd.cuh, sKbad).
    (2 * bn * d + 2 * bm * d + bn * bm) * 2 + 2 * bm * 4 + bn * 4
}

/// Rows per block of the f32 (SIMT) kernels and the backward preprocess: one warp per row.
const SIMT_WARPS: usize = 4;
const AUX_WARPS: usize = 8;

/// The forward's single launch; `f` picks the tensor-core instantiation (f32 has one kernel).
pub fn forward_plan(dtype: ElementType, s: &AttnShape, f: FeatureSet) -> Launch {
    let d = s.head_dim;
    let ds = d.to_string();
    match dtype {
        ElementType::F32 => Launch {
            file: name(&["f32_d", &ds]),
            kernel: name(&["exla_rs_fwd_f32_d", &ds]),
            grid: (div_up(s.seq_q, SIMT_WARPS), s.heads as u32, s.batch as u32),
            block: (32 * SIMT_WARPS) as u32,
            smem: 0,
        },
        _ => {
            let (warps, bm, _) = fwd_tc_traits(d);
            Launch {
                file: name(&["fwd_", dt(dtype), "_d", &ds, f.suffix()]),
                kernel: name(&["exla_rs_fwd_", dt(dtype), "_d", &ds, f.suffix()]),
                grid: (div_up(s.seq_q, bm), s.heads as u32, s.batch as u32),
                block: (32 * warps) as u32,
                smem: fwd_smem_bytes(d) as u32,
            }
        }
    }
}

/// Threads per block of the grid-stride element kernels (dq conversion, dbias passes).
const ELEMWISE_THREADS: usize = 256;

/// A grid-stride pass over `n` elements: enough blocks to fill any GPU, capped to stay in range;
/// an empty grid (skipped at launch) when there is nothing to do.
fn elementwise(file: &'static str, kernel: &'static str, n: usize) -> Launch {
    let blocks = if n == 0 { 0 } else { div_up(n, ELEMWISE_THREADS).clamp(1, 65_535 * 8) };
    Launch { file, kernel, grid: (blocks, 1, 1), block: ELEMWISE_THREADS as u32, smem: 0 }
}

/// The backward's launches, in stream order. With `dbias_elems` (a call with `bias_grad`, the
/// bias's element count) the dbias accumulator is zeroed first and rounded into `dbias` last
/// (kernels/dbias.cuh); in between: preprocess (delta, zero dq_accum), the main kernel(s), and for
/// f16/bf16 the dq conversion. `f` picks the tensor-core instantiation.
pub fn backward_plan(dtype: ElementType, s: &AttnShape, f: FeatureSet, dbias_elems: Option<usize>) -> Vec<Launch> {
    let mut plan = Vec::with_capacity(5);
    if let Some(n) = dbias_elems {
        plan.push(elementwise("aux", "exla_rs_dbias_zero", n));
    }
    plan.extend(backward_main(dtype, s, f));
    if let Some(n) = dbias_elems {
        plan.push(elementwise("aux", "exla_rs_dbias_round", n));
    }
    plan
}

fn backward_main(dtype: ElementType, s: &AttnShape, f: FeatureSet) -> Vec<Launch> {
    let d = s.head_dim;
    let ds = d.to_string();
    let rows = s.batch * s.seq_q * s.heads;
    let pre = Launch {
        file: "aux",
        kernel: name(&["exla_rs_bwd_pre_", dt(dtype)]),
        grid: (div_up(rows, AUX_WARPS), 1, 1),
        block: (32 * AUX_WARPS) as u32,
        smem: 0,
    };
    match dtype {
        ElementType::F32 => vec![
            pre,
            Launch {
                file: name(&["f32_d", &ds]),
                kernel: name(&["exla_rs_bwd_dq_f32_d", &ds]),
                grid: (div_up(s.seq_q, SIMT_WARPS), s.heads as u32, s.batch as u32),
                block: (32 * SIMT_WARPS) as u32,
                smem: 0,
            },
            Launch {
                file: name(&["f32_d", &ds]),
                kernel: name(&["exla_rs_bwd_dkdv_f32_d", &ds]),
                grid: (div_up(s.seq_k, SIMT_WARPS), s.kv_heads as u32, s.batch as u32),
                block: (32 * SIMT_WARPS) as u32,
                smem: 0,
            },
        ],
        _ => {
            let (warps, _, bn) = bwd_tc_traits(d);
            vec![
                pre,
                Launch {
                    file: name(&["bwd_", dt(dtype), "_d", &ds, f.suffix()]),
                    kernel: name(&["exla_rs_bwd_", dt(dtype), "_d", &ds, f.suffix()]),
                    grid: (div_up(s.seq_k, bn), s.kv_heads as u32, s.batch as u32),
                    block: (32 * warps) as u32,
                    smem: bwd_smem_bytes(d) as u32,
                },
                elementwise("aux", name(&["exla_rs_bwd_convert_", dt(dtype)]), s.q_len()),
            ]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> AttnShape {
        AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d }
    }

    #[test]
    fn every_listed_head_dim_and_dtype_is_supported_and_others_are_not() {
        for dtype in [ElementType::F32, ElementType::F16, ElementType::BF16] {
            for d in 1..=256 {
                let s = shape(2, 100, 130, 4, 2, d);
                let fwd = workspace_bytes(Pass::Forward, dtype, &s);
                let bwd = workspace_bytes(Pass::Backward, dtype, &s);
                if HEAD_DIMS.contains(&d) {
                    assert_eq!(fwd, Some(0), "{dtype} d={d}");
                    let (delta, accum) = bwd_workspace_layout(dtype, &s);
                    assert_eq!(delta, (2 * 4 * 100 * 4usize).div_ceil(256) * 256);
                    assert_eq!(bwd, Some(delta + accum));
                    let want_accum = if dtype == ElementType::F32 { 0 } else { 2 * 100 * 4 * d * 4 };
                    assert_eq!(accum, want_accum);
                } else {
                    assert_eq!((fwd, bwd), (None, None), "{dtype} d={d}");
                    let e = check_supported(dtype, &s).unwrap_err();
                    assert!(e.contains(&format!("D={d}")) && e.contains("[32, 64, 96, 128, 192, 256]"), "{e}");
                }
            }
        }
    }

    #[test]
    fn grid_limits_are_unsupported_not_errors_at_launch() {
        let s = shape(70_000, 1, 1, 1, 1, 64);
        assert_eq!(workspace_bytes(Pass::Forward, ElementType::BF16, &s), None);
        assert!(check_supported(ElementType::BF16, &s).unwrap_err().contains("65535"));
    }

    #[test]
    fn empty_queries_need_no_workspace() {
        let s = shape(2, 0, 16, 4, 4, 64);
        assert_eq!(workspace_bytes(Pass::Backward, ElementType::F16, &s), Some(0));
    }

    #[test]
    fn shared_memory_fits_every_target_architecture() {
        // sm_86 / sm_89 allow 99 KiB per block; the kernels stay within 96 KiB.
        for d in HEAD_DIMS {
            assert!(fwd_smem_bytes(d) <= 96 * 1024, "fwd d={d}: {}", fwd_smem_bytes(d));
            assert!(bwd_smem_bytes(d) <= 96 * 1024, "bwd d={d}: {}", bwd_smem_bytes(d));
        }
        assert_eq!(fwd_smem_bytes(128), (128 * 128 + 4 * 64 * 128) * 2);
    }

    #[test]
    fn plans_name_kernels_that_exist_in_the_embedded_files() {
        let s = shape(3, 1000, 777, 8, 2, 0);
        for d in HEAD_DIMS {
            let s = AttnShape { head_dim: d, ..s };
            for dtype in [ElementType::F32, ElementType::F16, ElementType::BF16] {
                let mut launches = Vec::new();
                for f in FeatureSet::ALL {
                    launches.push(forward_plan(dtype, &s, f));
                    launches.extend(backward_plan(dtype, &s, f, None));
                    launches.extend(backward_plan(dtype, &s, f, Some(8 * 1000 * 777)));
                }
                for l in launches {
                    let f = crate::embedded::find(l.file).unwrap_or_else(|| panic!("no file {}", l.file));
                    assert!(
                        f.source.contains(&format!("{}(", l.kernel)),
                        "{} does not define {}",
                        l.file,
                        l.kernel
                    );
                    assert!(l.grid.0 > 0 && l.grid.1 > 0 && l.grid.2 > 0 && l.block % 32 == 0);
                }
            }
        }
        let f = forward_plan(ElementType::BF16, &AttnShape { head_dim: 128, ..s }, FeatureSet::PLAIN);
        assert_eq!((f.grid, f.block), ((8, 8, 3), 256));
        let b = backward_plan(ElementType::F16, &AttnShape { head_dim: 64, ..s }, FeatureSet::PLAIN, None);
        assert_eq!(b[1].grid, (13, 2, 3)); // ceil(777 / 64) key tiles x Hkv x B
    }

    #[test]
    fn dbias_passes_wrap_the_backward_only_with_bias_grad() {
        let s = shape(3, 100, 77, 8, 2, 64);
        for dtype in [ElementType::F32, ElementType::F16, ElementType::BF16] {
            let mask = FeatureSet { masks: true, dropout: false };
            let base = backward_plan(dtype, &s, mask, None);
            assert!(base.iter().all(|l| !l.kernel.contains("dbias")), "{dtype}: {base:?}");
            // {1, H, Sq, Sk}: 8 * 100 * 77 elements.
            let n = 8 * 100 * 77;
            let with = backward_plan(dtype, &s, mask, Some(n));
            assert_eq!(with.len(), base.len() + 2);
            assert_eq!(with[0].kernel, "exla_rs_dbias_zero", "zeroed before anything accumulates");
            assert_eq!(with[with.len() - 1].kernel, "exla_rs_dbias_round", "rounded after every accumulation");
            assert_eq!(&with[1..with.len() - 1], &base[..]);
            for l in [with[0], with[with.len() - 1]] {
                assert_eq!((l.file, l.block, l.grid.1, l.grid.2), ("aux", 256, 1, 1));
                assert_eq!(l.grid.0 as usize, n.div_ceil(256));
            }
            // A 1-element bias still gets one block; an empty one none (skipped at launch).
            assert_eq!(backward_plan(dtype, &s, mask, Some(1))[0].grid.0, 1);
            assert_eq!(backward_plan(dtype, &s, mask, Some(0))[0].grid.0, 0);
        }
    }

    #[test]
    fn each_call_runs_the_smallest_feature_set_that_covers_it() {
        let s = shape(2, 100, 130, 4, 2, 128);
        let some = 0x1000 as *const std::ffi::c_void;
        let none = ExtraParams::NONE;
        let cases: [(ExtraParams, bool, &str); 8] = [
            (none, false, ""),
            (ExtraParams { key_mask: some, key_mask_bytes: 1, ..none }, false, "_mask"),
            (ExtraParams { bias: some, ..none }, false, "_mask"),
            (ExtraParams { alibi_slopes: some.cast(), ..none }, false, "_mask"),
            (ExtraParams { bias: some, ..none }, true, "_mask"),
            (ExtraParams { dropout_key: some.cast(), ..none }, false, "_drop"),
            (ExtraParams { key_mask: some, dropout_key: some.cast(), ..none }, false, "_mask_drop"),
            (ExtraParams { alibi_slopes: some.cast(), dropout_key: some.cast(), ..none }, false, "_mask_drop"),
        ];
        for (x, dbias, suffix) in cases {
            let f = FeatureSet::of(&x, dbias);
            assert_eq!(f.suffix(), suffix, "{x:?} dbias={dbias}");
            for dtype in [ElementType::F16, ElementType::BF16] {
                let want = format!("exla_rs_fwd_{dtype}_d128{suffix}");
                assert_eq!(forward_plan(dtype, &s, f).kernel, want);
                let bwd = backward_plan(dtype, &s, f, dbias.then_some(8));
                assert!(bwd.iter().any(|l| l.kernel == format!("exla_rs_bwd_{dtype}_d128{suffix}")), "{bwd:?}");
            }
            // f32 runs its SIMT kernels whatever the set.
            assert_eq!(forward_plan(ElementType::F32, &s, f).kernel, "exla_rs_fwd_f32_d128");
        }
        // The suffixes are generate.py's FEATURE_SETS keys.
        let gen = include_str!("../../../kernels/generate.py");
        assert!(gen.contains(r#"FEATURE_SETS = {"": 0, "_mask": 1, "_drop": 2, "_mask_drop": 3}"#));
    }

    #[test]
    fn dbias_workspace_is_one_f32_per_bias_element() {
        assert_eq!(dbias_workspace_bytes([1, 8, 100, 77]), Some(4 * 8 * 100 * 77));
        assert_eq!(dbias_workspace_bytes([3, 1, 1, 77]), Some(4 * 3 * 77));
        assert_eq!(dbias_workspace_bytes([1, 1, 1, 1]), Some(4));
        assert_eq!(dbias_workspace_bytes([0, 1, 1, 1]), Some(0));
        assert_eq!(dbias_workspace_bytes([1, -1, 1, 1]), None);
        assert_eq!(dbias_workspace_bytes([i64::MAX, 2, 1, 1]), None);
        assert_eq!(dbias_workspace_bytes([1 << 31, 1 << 31, 1, 1]), None, "2^64 bytes overflow");
    }

    #[test]
    fn traits_match_the_kernel_headers() {
        // The kernels trap when launched with another block size; this keeps the two tables in step.
        let fwd = include_str!("../../../kernels/flash_fwd.cuh");
        assert!(fwd.contains("kWarps = D <= 192 ? 8 : 4"));
        assert!(fwd.contains("kBlockN = D <= 128 ? 64 : 32"));
        assert!(fwd.contains("kSmemBytes = (kBlockM * D + 4 * kBlockN * D) * 2"));
        let bwd = include_str!("../../../kernels/flash_bwd.cuh");
        assert!(bwd.contains("kWarps = D <= 192 ? 4 : 8;"));
        assert!(bwd.contains("kDSplit = D <= 128 ? 1 : (D <= 192 ? 2 : 4);"));
        assert!(bwd.contains("kBlockM = D <= 96 ? 64 : 32"));
        assert!(bwd.contains("(2 * kBlockN * D + 2 * kBlockM * D + kBlockN * kBlockM) * 2 + 2 * kBlockM * 4 + kBlockN * 4;"));
        let simt = include_str!("../../../kernels/simt.cuh");
        assert!(simt.contains(&format!("kWarps = {SIMT_WARPS};")));
    }
}
