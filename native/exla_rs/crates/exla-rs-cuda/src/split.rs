//! The split-KV forward (issue 34; kernels/flash_fwd_split.cuh): which calls take it, how many
//! splits, its workspace, its launches.
//!
//! A decode call (Sq <= 16 query rows per sequence) always takes it: one CTA holds every query
//! head of a KV head's GQA group and every query row ("packed" rows, 64 per CTA for f16/bf16, 8
//! per one-warp CTA for f32: kernels/simt.cuh's `simt_fwd_split`), so each K/V byte is read once
//! per call (f32: once per 8 packed rows); the key range is split across CTAs when that fills the
//! GPU better, and a combine pass merges the splits' f32 partials. A longer f16/bf16 call whose FA2
//! grid (query blocks x heads x batch) leaves SMs idle takes it too when it has at least
//! [`MIN_TILES_LONG`] key tiles and the choice gives 2 splits or more. Not here: dropout (its
//! Philox counters are per (row, head) and the kernels' keep-bit exchange assumes the two rows of
//! a thread share a head: such calls run the non-split forward).
//!
//! `EXLA_RS_CUDA_SPLITS` (read at every forward call): `auto` (default) = the rules above; `off` =
//! never; `N` (1..=128) = every call the workspace allows takes the split path with N splits
//! (clamped to [`split_limit`]): tests force many splits with it.
//!
//! The workspace is shape-only (the contract's rule: it cannot depend on the SM count), so it is
//! sized for the most splits any GPU would get: [`split_limit`].

use crate::config::{self, FeatureSet, Launch};
use crate::params::{FwdParams, SplitParams};
use exla_rs_attn::{AttnError, AttnShape, ElementType};

/// Packed rows per CTA (`SplitTraits::kBlockM`).
pub const BLOCK_M: usize = 64;
/// Threads per CTA of the split kernel (`SplitTraits::kThreads`) and of the combine pass.
pub const THREADS: usize = 128;
const COMBINE_WARPS: usize = 4;
/// At most this many splits.
pub const MAX_SPLITS: usize = 128;
/// Query rows per sequence up to which a call is a decode call.
pub const DECODE_MAX_SQ: usize = 16;
/// A longer call splits only over at least this many key tiles.
pub const MIN_TILES_LONG: usize = 8;
/// Shape-only bounds (the workspace): splits x row-block CTAs stay within this many CTAs, and a
/// longer call is eligible only while its FA2 grid is below this many CTAs (more SMs than any GPU).
const CTA_BUDGET: usize = 1024;
const MAX_SMS: usize = 256;
/// CTAs of the split kernel one SM holds at once (registers: 128 threads x up to 255 registers).
const CTAS_PER_SM: usize = 2;
/// f32 (`SimtSplitTraits`): packed rows per one-warp CTA, keys per chunk, and for the choice the
/// CTAs one SM holds at once (32 threads x up to 248 registers: 8 in a 64K register file) and the
/// most CTAs of all splits.
pub const SIMT_ROWS: usize = 8;
const SIMT_KEYS: usize = 32;
const SIMT_THREADS: usize = 32;
const SIMT_CTAS_PER_SM: usize = 8;
const SIMT_CTA_BUDGET: usize = 4096;

/// One dtype's split kernel: packed rows per CTA, keys per tile (f32: per 32-key chunk), threads
/// per CTA, CTAs per SM at once, and the most CTAs the splits of one call may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Geometry {
    rows: usize,
    keys: usize,
    threads: usize,
    ctas_per_sm: usize,
    cta_budget: usize,
}

fn geometry(dtype: ElementType, d: usize) -> Geometry {
    if dtype == ElementType::F32 {
        Geometry { rows: SIMT_ROWS, keys: SIMT_KEYS, threads: SIMT_THREADS, ctas_per_sm: SIMT_CTAS_PER_SM, cta_budget: SIMT_CTA_BUDGET }
    } else {
        Geometry { rows: BLOCK_M, keys: block_n(d), threads: THREADS, ctas_per_sm: CTAS_PER_SM, cta_budget: CTA_BUDGET }
    }
}

/// Key tile (`SplitTraits::kBlockN`).
pub fn block_n(d: usize) -> usize {
    if d <= 128 {
        64
    } else {
        32
    }
}

pub fn smem_bytes(dtype: ElementType, d: usize) -> usize {
    if dtype == ElementType::F32 {
        SIMT_ROWS * (d + 32) * 4 // the rows' q and each row's weights of 32 keys, in f32
    } else {
        (BLOCK_M * d + 4 * block_n(d) * d) * 2
    }
}

/// The `EXLA_RS_CUDA_SPLITS` setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitSetting {
    Auto,
    Off,
    Force(usize),
}

impl SplitSetting {
    pub fn parse(value: Option<&str>) -> Result<Self, String> {
        match value.map(str::trim) {
            None | Some("") | Some("auto") => Ok(SplitSetting::Auto),
            Some("off") => Ok(SplitSetting::Off),
            Some(v) => match v.parse::<usize>() {
                Ok(n) if (1..=MAX_SPLITS).contains(&n) => Ok(SplitSetting::Force(n)),
                _ => Err(format!("EXLA_RS_CUDA_SPLITS={v:?}: expected auto, off or a split count in 1..={MAX_SPLITS}")),
            },
        }
    }

    pub fn from_env() -> Result<Self, String> {
        SplitSetting::parse(std::env::var("EXLA_RS_CUDA_SPLITS").ok().as_deref())
    }
}

/// The split kernel's geometry of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitShape {
    /// g * Sq packed rows per (kv head, batch row), in `row_blocks` CTAs of [`BLOCK_M`] (f32:
    /// [`SIMT_ROWS`]).
    pub row_blocks: usize,
    /// row_blocks x Hkv x B: the CTAs of one split.
    pub base_ctas: usize,
    pub key_tiles: usize,
    pub decode: bool,
    /// The non-split forward's CTAs (config::forward_plan's grid).
    pub fwd_ctas: usize,
}

pub fn split_shape(dtype: ElementType, s: &AttnShape) -> SplitShape {
    let geo = geometry(dtype, s.head_dim);
    let g = s.heads / s.kv_heads.max(1);
    let row_blocks = (g * s.seq_q).div_ceil(geo.rows);
    let fwd_bm = if s.head_dim <= 192 { 128 } else { 64 };
    SplitShape {
        row_blocks,
        base_ctas: row_blocks * s.kv_heads * s.batch,
        key_tiles: s.seq_k.div_ceil(geo.keys),
        decode: s.seq_q <= DECODE_MAX_SQ,
        fwd_ctas: s.seq_q.div_ceil(fwd_bm) * s.heads * s.batch,
    }
}

/// The most splits a call of this shape may take (the workspace holds that many partials); 0 when
/// the shape never takes the split path. Shape-only, like the workspace rule.
pub fn split_limit(dtype: ElementType, s: &AttnShape) -> usize {
    let empty = s.batch == 0 || s.seq_q == 0 || s.seq_k == 0 || s.heads == 0 || s.kv_heads == 0;
    if empty || !config::HEAD_DIMS.contains(&s.head_dim) || s.heads % s.kv_heads != 0 {
        return 0;
    }
    let sh = split_shape(dtype, s);
    let limit = MAX_SPLITS.min(sh.key_tiles).min((geometry(dtype, s.head_dim).cta_budget / sh.base_ctas).max(1));
    if sh.decode {
        limit
    } else if dtype != ElementType::F32 && sh.key_tiles >= MIN_TILES_LONG && sh.fwd_ctas < MAX_SMS && limit >= 2 {
        limit
    } else {
        0
    }
}

/// Byte sizes of the partials for `splits` splits: (o_part f32 [S, B, H, Sq, D], lse_part f32
/// [S, B, H, Sq]), each 256-aligned; (0, 0) for one split (the kernel writes o / lse itself).
pub fn partials_bytes(s: &AttnShape, splits: usize) -> (usize, usize) {
    if splits < 2 {
        return (0, 0);
    }
    let rows = splits * s.batch * s.heads * s.seq_q;
    let a = |n: usize| n.div_ceil(256) * 256;
    (a(rows * s.head_dim * 4), a(rows * 4))
}

/// The forward's workspace for the split path (0 when it never needs one).
pub fn workspace_bytes(dtype: ElementType, s: &AttnShape) -> usize {
    let (o, l) = partials_bytes(s, split_limit(dtype, s));
    o + l
}

/// Splits for a call of `base_ctas` CTAs per split over `tiles` key tiles on `sms` SMs holding
/// `ctas_per_sm` CTAs each: the count in 1..=limit that minimises (waves of CTAs) x (key tiles each
/// CTA walks), the fewest on a tie (each split adds partials to write and combine).
pub fn choose_splits(base_ctas: usize, tiles: usize, sms: usize, ctas_per_sm: usize, limit: usize) -> usize {
    let slots = (sms * ctas_per_sm).max(1);
    if base_ctas >= slots || limit <= 1 {
        return 1;
    }
    let cost = |s: usize| (base_ctas * s).div_ceil(slots) * tiles.div_ceil(s);
    let mut best = 1;
    for s in 2..=limit {
        if cost(s) < cost(best) {
            best = s;
        }
    }
    best
}

/// The split count when this call takes the split path, None when it runs the non-split forward.
pub fn choose(dtype: ElementType, s: &AttnShape, f: FeatureSet, sms: u32, setting: SplitSetting) -> Option<usize> {
    let limit = split_limit(dtype, s);
    if f.dropout || limit == 0 {
        return None;
    }
    let sh = split_shape(dtype, s);
    let per_sm = geometry(dtype, s.head_dim).ctas_per_sm;
    match setting {
        SplitSetting::Off => None,
        SplitSetting::Force(n) => Some(n.min(limit)),
        SplitSetting::Auto if sh.decode => Some(choose_splits(sh.base_ctas, sh.key_tiles, sms as usize, per_sm, limit)),
        SplitSetting::Auto => {
            if sh.fwd_ctas >= sms as usize {
                return None;
            }
            Some(choose_splits(sh.base_ctas, sh.key_tiles, sms as usize, per_sm, limit)).filter(|&n| n >= 2)
        }
    }
}

/// The launches: the split kernel, then (more than one split) the combine pass.
pub fn plan(dtype: ElementType, s: &AttnShape, f: FeatureSet, splits: usize) -> Vec<Launch> {
    let d = s.head_dim;
    let ds = d.to_string();
    let sh = split_shape(dtype, s);
    let geo = geometry(dtype, d);
    // f32: one SIMT kernel whatever the features (in the file of the other f32 kernels); f16/bf16:
    // the plain or the masks-and-terms set.
    let (file, set) = match (dtype, f.masks) {
        (ElementType::F32, _) => (config::name(&["f32_d", &ds]), ""),
        (_, masks) => {
            let set = if masks { "_mask" } else { "" };
            (config::name(&["fwd_split_", dtype.name(), "_d", &ds, set]), set)
        }
    };
    let mut plan = vec![Launch {
        file,
        kernel: config::name(&["exla_rs_fwd_split_", dtype.name(), "_d", &ds, set]),
        grid: ((sh.row_blocks * splits) as u32, s.kv_heads as u32, s.batch as u32),
        block: geo.threads as u32,
        smem: smem_bytes(dtype, d) as u32,
    }];
    if splits > 1 {
        plan.push(Launch {
            file: "fwd_combine",
            kernel: config::name(&["exla_rs_fwd_combine_", dtype.name(), "_d", &ds]),
            grid: ((s.batch * s.heads * s.seq_q).div_ceil(COMBINE_WARPS) as u32, 1, 1),
            block: (32 * COMBINE_WARPS) as u32,
            smem: 0,
        });
    }
    plan
}

/// The kernels' parameter block: the call's `p`, the split count and the partials at `workspace`
/// (device address of the split path's part of the workspace, `avail` bytes).
pub fn params(dtype: ElementType, p: &FwdParams, s: &AttnShape, splits: usize, workspace: u64, avail: usize) -> Result<SplitParams, AttnError> {
    let (o_bytes, l_bytes) = partials_bytes(s, splits);
    if o_bytes + l_bytes > avail {
        return Err(AttnError::internal(format!(
            "split-KV forward: {splits} splits need {} workspace bytes, {avail} left",
            o_bytes + l_bytes
        )));
    }
    let (o_part, lse_part) = if splits > 1 {
        (workspace as *mut f32, (workspace + o_bytes as u64) as *mut f32)
    } else {
        (std::ptr::null_mut(), std::ptr::null_mut())
    };
    Ok(SplitParams { f: *p, o_part, lse_part, num_splits: splits as i32, row_blocks: split_shape(dtype, s).row_blocks as i32 })
}

/// What `status()` says about the split path.
pub fn summary(setting: Result<SplitSetting, String>) -> String {
    let rules = format!(
        "split-KV (flash_fwd_split; f32: simt_fwd_split) for calls without dropout: every decode call (Sq <= \
         {DECODE_MAX_SQ}: all heads of a GQA group per CTA, K/V read once) and f16/bf16 calls whose grid leaves SMs \
         idle over >= {MIN_TILES_LONG} key tiles; splits from the SM count (at most {MAX_SPLITS}), partials merged \
         by a combine pass"
    );
    match setting {
        Ok(SplitSetting::Auto) => format!("{rules} (EXLA_RS_CUDA_SPLITS=auto)"),
        Ok(SplitSetting::Off) => "split-KV off: every call runs the non-split forward (EXLA_RS_CUDA_SPLITS=off)".into(),
        Ok(SplitSetting::Force(n)) => format!("split-KV forced: {n} splits wherever the workspace allows (EXLA_RS_CUDA_SPLITS={n})"),
        Err(e) => format!("split-KV: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> AttnShape {
        AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d }
    }
    const BF: ElementType = ElementType::BF16;
    const PLAIN: FeatureSet = FeatureSet::PLAIN;

    #[test]
    fn decode_takes_the_split_path_and_fills_the_gpu() {
        // Issue 34's rows: GQA 32/8, D = 128, bf16, H100 (132 SMs).
        let s = shape(8, 1, 32768, 32, 8, 128);
        let sh = split_shape(BF, &s);
        assert_eq!((sh.row_blocks, sh.base_ctas, sh.key_tiles), (1, 64, 512));
        let n = choose(BF, &s, PLAIN, 132, SplitSetting::Auto).unwrap();
        assert!(n >= 4 && 64 * n <= 2 * 132, "{n} splits");
        // B = 64: 512 CTAs already fill it: one split, no combine, and still K/V read once.
        let s64 = shape(64, 1, 4096, 32, 8, 128);
        assert_eq!(choose(BF, &s64, PLAIN, 132, SplitSetting::Auto), Some(1));
        assert_eq!(plan(BF, &s64, PLAIN, 1).len(), 1);
        // One sequence, long cache: many splits.
        let s1 = shape(1, 1, 16384, 32, 8, 128);
        assert!(choose(BF, &s1, PLAIN, 132, SplitSetting::Auto).unwrap() >= 16);
        // f32 decode: one-warp CTAs of 8 packed rows (the group's 4 heads), 32-key chunks.
        let sh = split_shape(ElementType::F32, &s);
        assert_eq!((sh.row_blocks, sh.base_ctas, sh.key_tiles), (1, 64, 1024));
        let n = choose(ElementType::F32, &s, PLAIN, 132, SplitSetting::Auto).unwrap();
        assert!((16..=64).contains(&n), "{n} splits"); // 64 CTAs of one warp: a few per SM at least
        // f32 beyond decode, dropout and empty calls: the non-split forward.
        assert_eq!(split_limit(ElementType::F32, &shape(1, 1030, 1030, 2, 2, 128)), 0);
        assert_eq!(choose(BF, &s, FeatureSet { masks: false, dropout: true }, 132, SplitSetting::Auto), None);
        assert_eq!(choose(ElementType::F32, &s, FeatureSet { masks: false, dropout: true }, 132, SplitSetting::Auto), None);
        assert_eq!(choose(BF, &shape(8, 0, 32, 4, 4, 64), PLAIN, 132, SplitSetting::Auto), None);
        assert_eq!(choose(BF, &s, PLAIN, 132, SplitSetting::Off), None);
    }

    #[test]
    fn long_calls_split_only_when_the_grid_leaves_sms_idle() {
        let s = shape(1, 1030, 1030, 2, 2, 128); // 18 FA2 CTAs, 17 key tiles
        assert!(choose(BF, &s, PLAIN, 132, SplitSetting::Auto).unwrap() >= 2);
        // Few key tiles: no split path (and no workspace).
        let short = shape(2, 100, 120, 8, 2, 128);
        assert_eq!(split_limit(BF, &short), 0);
        assert_eq!(workspace_bytes(BF, &short), 0);
        // A full grid: the non-split forward.
        let big = shape(8, 2048, 2048, 16, 16, 128);
        assert_eq!(choose(BF, &big, PLAIN, 132, SplitSetting::Auto), None);
    }

    #[test]
    fn the_workspace_holds_the_most_splits_the_choice_can_take() {
        for s in [shape(8, 1, 32768, 32, 8, 128), shape(1, 16, 300, 4, 1, 64), shape(3, 5, 4000, 6, 2, 256), shape(1, 1030, 1030, 2, 2, 128)] {
            for dtype in [BF, ElementType::F32] {
                let limit = split_limit(dtype, &s);
                if dtype == ElementType::F32 && s.seq_q > DECODE_MAX_SQ {
                    assert_eq!((limit, workspace_bytes(dtype, &s)), (0, 0));
                    continue;
                }
                assert!(limit >= 2, "{s:?}");
                for sms in [1, 8, 108, 132, 148, 170, 256, 1000] {
                    for setting in [SplitSetting::Auto, SplitSetting::Force(MAX_SPLITS)] {
                        if let Some(n) = choose(dtype, &s, PLAIN, sms, setting) {
                            assert!(n >= 1 && n <= limit, "{dtype} {s:?} sms={sms}: {n} > {limit}");
                            let (o, l) = partials_bytes(&s, n);
                            assert!(o + l <= workspace_bytes(dtype, &s));
                        }
                    }
                }
            }
        }
        let s = shape(2, 1, 200, 4, 2, 64); // 4 key tiles
        assert_eq!(split_limit(BF, &s), 4);
        assert_eq!(partials_bytes(&s, 4), ((4 * 2 * 4 * 64 * 4usize).div_ceil(256) * 256, 256));
        assert_eq!(choose(BF, &s, PLAIN, 132, SplitSetting::Force(7)), Some(4), "clamped to the workspace");
        // Decode with a single key tile needs no workspace.
        assert_eq!(workspace_bytes(BF, &shape(2, 1, 64, 4, 2, 64)), 0);
    }

    #[test]
    fn settings_parse() {
        assert_eq!(SplitSetting::parse(None), Ok(SplitSetting::Auto));
        assert_eq!(SplitSetting::parse(Some(" off ")), Ok(SplitSetting::Off));
        assert_eq!(SplitSetting::parse(Some("16")), Ok(SplitSetting::Force(16)));
        assert!(SplitSetting::parse(Some("0")).is_err());
        assert!(SplitSetting::parse(Some("129")).unwrap_err().contains("EXLA_RS_CUDA_SPLITS"));
        assert!(summary(Ok(SplitSetting::Auto)).contains("split-KV"));
    }

    #[test]
    fn plans_name_kernels_that_exist_and_match_the_header() {
        let s = shape(3, 3, 777, 8, 2, 0);
        for d in config::HEAD_DIMS {
            let s = AttnShape { head_dim: d, ..s };
            for dtype in [ElementType::F16, ElementType::BF16, ElementType::F32] {
                for f in [FeatureSet::PLAIN, FeatureSet { masks: true, dropout: false }] {
                    let p = plan(dtype, &s, f, 5);
                    assert_eq!(p.len(), 2);
                    // 12 packed rows: one row block of 64, or two of 8 for f32.
                    let blocks = if dtype == ElementType::F32 { 10 } else { 5 };
                    assert_eq!(p[0].grid, (blocks, 2, 3));
                    assert_eq!(p[1].grid, ((3 * 8 * 3usize).div_ceil(4) as u32, 1, 1));
                    for l in p {
                        let file = crate::embedded::find(l.file).unwrap_or_else(|| panic!("no file {}", l.file));
                        assert!(file.source.contains(&format!("{}(", l.kernel)), "{} lacks {}", l.file, l.kernel);
                    }
                }
            }
        }
        let h = include_str!("../../../kernels/flash_fwd_split.cuh");
        assert!(h.contains("kWarps = 4;") && h.contains("kBlockN = D <= 128 ? 64 : 32;"));
        assert!(h.contains("kSmemBytes = (kBlockM * D + 4 * kBlockN * D) * 2;"));
        let simt = include_str!("../../../kernels/simt.cuh");
        assert!(simt.contains(&format!("kRows = {SIMT_ROWS};")) && simt.contains(&format!("kThreads = {SIMT_THREADS};")));
        assert!(simt.contains("smem_bytes(int d) { return kRows * (d + 32) * 4; }"));
    }
}
