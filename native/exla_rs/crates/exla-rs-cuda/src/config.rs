//! Which configurations have a CUDA kernel, how each is launched (the Rust mirror of the kernels'
//! traits: change both together), and how much workspace a call needs.

use crate::params::ExtraParams;
use exla_rs_attn::{AttnShape, ElementType, Pass};

/// Head dims with a kernel instantiation (kernels/generate.py).
pub const HEAD_DIMS: [usize; 6] = [32, 64, 96, 128, 192, 256];

/// Every head dim up to this one runs: natively when it is in [`HEAD_DIMS`], else padded.
pub const MAX_PADDED_HEAD_DIM: usize = 256;

/// The kernel head dim a call of head dim `d` runs on: `d` itself when it is one of [`HEAD_DIMS`],
/// else the next one up, with the operands and results copied through zero-padded workspace
/// buffers (kernels/pad.cuh, [`PadLayout`]); None for 0 and past 256.
pub fn kernel_head_dim(d: usize) -> Option<usize> {
    if d == 0 {
        return None;
    }
    HEAD_DIMS.iter().copied().find(|&k| k >= d)
}

/// What `status()` and the contract say about head dims: which run natively, which padded.
pub fn head_dims_summary() -> String {
    let native: Vec<String> = HEAD_DIMS.iter().map(|d| d.to_string()).collect();
    format!(
        "native: D = {}; padded: every other D in 1..={MAX_PADDED_HEAD_DIM} runs on the next native D \
         (operands copied into zero-padded workspace buffers, results copied back; the caller's scale)",
        native.join(", ")
    )
}

/// Where a padded call (head dim D without a kernel, run on Dk = [`kernel_head_dim`]) keeps its
/// zero-padded `[rows, Dk]` copies: byte offsets into the workspace, each 256-aligned, after the
/// kernels' own scratch (the backward's delta and dq accumulator, sized for Dk). The forward pads
/// q, k, v and writes o there; the backward pads q, k, v, o, do and writes dq, dk, dv there. The
/// copies keep the kernels' alignment rules: every row is Dk elements (>= 64 bytes, a multiple of
/// 16), every buffer starts on a 256-byte boundary of the workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PadLayout {
    /// Dk, the kernel head dim.
    pub head_dim: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub o: usize,
    /// Backward only (0 in the forward).
    pub d_o: usize,
    pub dq: usize,
    pub dk: usize,
    pub dv: usize,
    /// The end of the last buffer: the base workspace of the padded call.
    pub end: usize,
}

/// The call's pad layout, or None when D has a kernel (or none at all).
pub fn pad_layout(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Option<PadLayout> {
    let dk = kernel_head_dim(shape.head_dim).filter(|&k| k != shape.head_dim)?;
    let padded = AttnShape { head_dim: dk, ..*shape };
    let e = dtype.size_bytes();
    let q_bytes = align256(shape.batch * shape.seq_q * shape.heads * dk * e);
    let kv_bytes = align256(shape.batch * shape.seq_k * shape.kv_heads * dk * e);
    let mut at = match pass {
        Pass::Forward => 0,
        Pass::Backward => {
            let (delta, accum) = bwd_workspace_layout(dtype, &padded);
            align256(delta + accum)
        }
    };
    let mut take = |n: usize| {
        let start = at;
        at += n;
        start
    };
    let (q, k, v, o) = (take(q_bytes), take(kv_bytes), take(kv_bytes), take(q_bytes));
    let (d_o, dq, dk_at, dv) = match pass {
        Pass::Forward => (0, 0, 0, 0),
        Pass::Backward => (take(q_bytes), take(q_bytes), take(kv_bytes), take(kv_bytes)),
    };
    Some(PadLayout { head_dim: dk, q, k, v, o, d_o, dq, dk: dk_at, dv, end: at })
}

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
    if kernel_head_dim(shape.head_dim).is_none() {
        return Err(format!(
            "no CUDA kernel for head dim D={} ({}): the kernels run D in {:?} natively and every other D in 1..={} padded",
            shape.head_dim, dtype, HEAD_DIMS, MAX_PADDED_HEAD_DIM
        ));
    }
    if shape.heads > MAX_GRID_YZ || shape.batch > MAX_GRID_YZ {
        return Err(format!(
            "CUDA kernels take at most {MAX_GRID_YZ} heads and {MAX_GRID_YZ} batch entries, got H={} B={}",
            shape.heads, shape.batch
        ));
    }
    let i32_max = i32::MAX as usize;
    // A padded call copies K and V rows too (kernels/pad.cuh): bound them as the query rows are.
    let kv_rows = shape.batch.checked_mul(shape.seq_k).and_then(|n| n.checked_mul(shape.kv_heads));
    if kernel_head_dim(shape.head_dim) != Some(shape.head_dim) && kv_rows.is_none_or(|n| n > i32_max) {
        return Err(format!(
            "a padded head dim (D={}) copies K/V rows with 32-bit row counts: B*Sk*Hkv is too large",
            shape.head_dim
        ));
    }
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

/// Bytes the backward appends to its base workspace (at offset `workspace_requirement`) when it
/// returns `dbias`: the f32 accumulator, one element per bias element (dense, like the bias).
/// None when the dims are not a bias (a negative or overflowing count).
pub fn dbias_workspace_bytes(bias_dims: [i64; 4]) -> Option<usize> {
    bias_dims
        .iter()
        .try_fold(4usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
        .filter(|&n| n <= i64::MAX as usize)
}

fn dt(dtype: ElementType) -> &'static str {
    dtype.name()
}

/// Interned names: the kernels are `extern "C"` symbols named after dtype and head dim.
pub(crate) fn name(parts: &[&str]) -> &'static str {
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
/// kernels have one set; the sm90 forward has these four too (kernels/sm90/generate.py).
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

/// Tensor-core forward tiles (FwdTraits in kernels/flash_fwd.cuh): (warps, block_m, block_n).
/// Up to D = 64 a warp owns 32 query rows (two m16 fragments), above it 16.
fn fwd_tc_traits(d: usize) -> (usize, usize, usize) {
    let row_frags = if d <= 64 { 2 } else { 1 };
    let warps = if d <= 64 { 4 } else if d <= 192 { 8 } else { 4 };
    let block_m = 16 * row_frags * warps;
    let block_n = if d <= 128 { 64 } else { 32 };
    (warps, block_m, block_n)
}

pub fn fwd_smem_bytes(d: usize) -> usize {
    let (_, bm, bn) = fwd_tc_traits(d);
    (bm * d + 4 * bn * d) * 2
}

/// Tensor-core backward tiles (BwdTraits in kernels/flash_bwd.cuh): (warps, block_m, block_n).
fn bwd_tc_traits(d: usize) -> (usize, usize, usize) {
    // D = 64, 128: 8 warps, 128 keys per block (issue 33: Q, dO, lse, delta and the dQ atomics
    // once per 128 keys instead of 64).
    let warps = if d == 64 || d == 128 { 8 } else if d <= 192 { 4 } else { 8 };
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

/// Dynamic shared memory of the f32 (SIMT) kernels (`SimtTraits::smem_bytes` in kernels/simt.cuh):
/// per warp two head-dim rows and two 32-entry weight vectors, in f32.
pub fn simt_smem_bytes(d: usize) -> usize {
    SIMT_WARPS * (2 * d + 64) * 4
}
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
            smem: simt_smem_bytes(d) as u32,
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

/// Warps (one per row) per block of the pad kernel (kernels/pad.cuh).
const PAD_WARPS: usize = 8;

/// The pad kernel over `rows` rows of `elem_bytes`-byte elements (2 or 4): grid-stride over rows,
/// one warp per row; an empty grid (skipped at launch) when there are no rows.
pub fn pad_launch(elem_bytes: usize, rows: usize) -> Launch {
    let kernel = if elem_bytes == 4 { "exla_rs_pad_rows_b32" } else { "exla_rs_pad_rows_b16" };
    let blocks = if rows == 0 { 0 } else { div_up(rows, PAD_WARPS).clamp(1, 65_535 * 8) };
    Launch { file: "aux", kernel, grid: (blocks, 1, 1), block: (32 * PAD_WARPS) as u32, smem: 0 }
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
                smem: simt_smem_bytes(d) as u32,
            },
            Launch {
                file: name(&["f32_d", &ds]),
                kernel: name(&["exla_rs_bwd_dkdv_f32_d", &ds]),
                grid: (div_up(s.seq_k, SIMT_WARPS), s.kv_heads as u32, s.batch as u32),
                block: (32 * SIMT_WARPS) as u32,
                smem: simt_smem_bytes(d) as u32,
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
    fn pad_launches_cover_their_rows() {
        for (e, k) in [(2, "exla_rs_pad_rows_b16"), (4, "exla_rs_pad_rows_b32")] {
            let l = pad_launch(e, 1000);
            assert_eq!((l.file, l.kernel, l.grid, l.block, l.smem), ("aux", k, (125, 1, 1), 256, 0));
            assert_eq!(pad_launch(e, 0).grid.0, 0);
            assert_eq!(pad_launch(e, 1).grid.0, 1);
            assert_eq!(pad_launch(e, i32::MAX as usize).grid.0, 65_535 * 8, "grid-stride beyond the cap");
            let f = crate::embedded::find(l.file).unwrap();
            assert!(f.source.contains(&format!("{k}(")), "aux does not define {k}");
        }
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
        assert_eq!(b[1].grid, (7, 2, 3)); // ceil(777 / 128) key tiles x Hkv x B
        assert_eq!(b[1].block, 256);
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
        assert!(fwd.contains("kRowFrags = D <= 64 ? 2 : 1;"));
        assert!(fwd.contains("kWarps = D <= 64 ? 4 : (D <= 192 ? 8 : 4);"));
        assert!(fwd.contains("kBlockM = 16 * kRowFrags * kWarps;"));
        assert!(fwd.contains("kBlockN = D <= 128 ? 64 : 32"));
        assert!(fwd.contains("kSmemBytes = (kBlockM * D + 4 * kBlockN * D) * 2"));
        let bwd = include_str!("../../../kernels/flash_bwd.cuh");
        assert!(bwd.contains("kWarps = (D == 64 || D == 128) ? 8 : (D <= 192 ? 4 : 8);"));
        assert!(bwd.contains("kDSplit = D <= 128 ? 1 : (D <= 192 ? 2 : 4);"));
        assert!(bwd.contains("kBlockM = D <= 96 ? 64 : 32"));
        assert!(bwd.contains("(2 * kBlockN * D + 2 * kBlockM * D + kBlockN * kBlockM) * 2 + 2 * kBlockM * 4 + kBlockN * 4;"));
        let simt = include_str!("../../../kernels/simt.cuh");
        assert!(simt.contains(&format!("kWarps = {SIMT_WARPS};")));
        assert!(simt.contains("smem_bytes(int d) { return kWarps * (2 * d + 64) * 4; }"));
        let s = AttnShape { batch: 1, seq_q: 9, seq_k: 9, heads: 1, kv_heads: 1, head_dim: 256 };
        assert_eq!(forward_plan(ElementType::F32, &s, FeatureSet::PLAIN).smem, 9216);
        for l in backward_plan(ElementType::F32, &s, FeatureSet::PLAIN, None).iter().filter(|l| l.file.starts_with("f32")) {
            assert_eq!(l.smem, 9216, "{}", l.kernel);
        }
    }
}
