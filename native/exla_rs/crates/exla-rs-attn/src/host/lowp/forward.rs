//! The 16-bit forward on a dot-product unit: `forward.rs`'s task split and online softmax, with
//! the two products on the unit.
//!
//! - Once per call: K and V of every (batch, kv head) packed into the unit's B layouts
//!   ([`super::pack`]; V panel-major over all keys), in the input type (no rounding: they
//!   already are that type), into buffers kept between calls ([`super::super::pool`]).
//! - One rayon task per (batch, head, block of [`BR`] query rows): Q's rows as the A operand
//!   (raw, unscaled: scaling before rounding to 16 bits would round twice), then per step of up
//!   to [`STEP`] visible keys: `S = Q·Kᵀ` on the unit, the row pass ([`super::rows`]: scale,
//!   mask, max, `exp2`, sum, `P` rounded to the input type as the CUDA tensor-core kernels do;
//!   mostly one pass against the row's running max, which then needs no rescale of O), the
//!   online-softmax rescale of O where the max moved, and `O += P·V` on the unit, f32
//!   accumulation throughout.
//!   A step of 512 keys gives each O tile 16 products per load and store of it (one per 64-key
//!   tile halved the unit's rate: `host_bench peak`), and the per-row costs (the row call, its
//!   max and sum reductions, the rescale of O) an eighth as often as 64-key steps would. Those
//!   costs are what 512 saves over 256: the row pass took 34 → 28 M cycles of an S = 2048,
//!   D = 128 forward (one thread, Emerald Rapids), 128 keys took 43 M; 32-row tasks (their scores
//!   in L1) were no faster.
//!
//! A step runs each phase over all 64 rows. Run per pair of 16-row groups (`S`, rows and `P·V` for
//! 32 rows, a 64 KiB score block), the step took as long (one thread, D = 128: `S` 15.2k TSC
//! cycles per step against 14.0k, since K's panels then pass twice; the row pass the same), and
//! per single group (a 32 KiB score block in L1, one-block products) 18% longer: the row pass is
//! not waiting on its scores (bench/RESULTS.md).
//!
//! The row pass runs after a step's products, not beside the next step's: on the one AMX machine
//! measured (an Emerald Rapids KVM guest), a row pass after each 2 × 2 product took as long as the
//! two apart or longer (`host::overlap`, `host_bench peak`), and a forward that interleaved the
//! next step's `S` products with the row pass was 5-10% slower (bench/RESULTS.md).
//!
//! The unit always multiplies whole 16-row groups; rows past a block's end are zeros in Q and
//! P, and their results are never read.

use rayon::prelude::*;

use super::super::forward::{finished_without_keys, QueryBlock, TaskRows};
use super::super::kernels::{Isa, LOG2_E};
use super::super::lines::Lines;
use super::super::{finish_row, online_update, pool, row_lse, FwdInputs, FwdOutputs, HostElement, SyncPtr};
use super::pack::{self, padded_dim, BC};
use super::rows::{fwd_row16, store_scaled};
use super::tile::{TILE_K, TILE_M, TILE_N};
use super::unit::{blocks, TileUnit, UnitScope, Walk};
use crate::{AttnOptions, AttnShape, KeyRange};

/// Query rows per task (a multiple of [`TILE_M`]).
pub(crate) const BR: usize = 64;

/// Keys per step at most: whole [`BC`] tiles (so [`TILE_K`]- and [`TILE_N`]-aligned).
pub(crate) const STEP: usize = 8 * BC;
const _: () = assert!(STEP.is_multiple_of(BC) && BC.is_multiple_of(TILE_K) && BC.is_multiple_of(2 * TILE_N));

/// Row strides of the score, P and O scratch: a row of each is padded by one cache line so the
/// 16 rows a tile load or store touches do not share a handful of L1 sets (at 1 KiB strides
/// they would fall in 4 of its 64).
const S_LD: usize = STEP + 16;
const P_LD: usize = STEP + 32;
fn o_ld(dp: usize) -> usize {
    dp + 16
}

/// Per-thread scratch, reused across tasks; the unit's operands start on cache lines
/// ([`super::super::lines`]) and every row stride above is whole lines.
struct Scratch {
    /// Q rows as A: `BR × dp`.
    qa: Lines<u16>,
    /// Scores: `BR` rows of [`S_LD`] f32.
    s: Lines<f32>,
    /// P rounded, as A: `BR` rows of [`P_LD`].
    pa: Lines<u16>,
    /// Unnormalised output: `BR` rows of [`o_ld`] f32.
    o: Lines<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    ranges: Vec<KeyRange>,
}

/// The packed K and V of one (batch, kv head), the padded key count and the per-tile "V holds
/// an inf/NaN" flags.
struct KvHead<'a> {
    kt: &'a [u16],
    vt: &'a [u16],
    skp: usize,
    vbad: &'a [bool],
}

pub(crate) fn run<T: HostElement, U: TileUnit, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, mut out: FwdOutputs<'_, T>) {
    let AttnShape { batch, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d } = *shape;
    if finished_without_keys(shape, &mut out) {
        return;
    }
    let elem = U::ELEM;
    let dp = padded_dim(d);
    let ntk = sk.div_ceil(BC);
    let skp = ntk * BC;
    let per_head = skp * dp;

    // Both packs in one pooled buffer (16-bit view): K's then V's, per (batch, kv head).
    let mut packed = pool::take(batch * hkv * per_head);
    let (kt, vt) = packed.as_u16_mut().split_at_mut(batch * hkv * per_head);
    kt.par_chunks_mut(per_head).zip(vt.par_chunks_mut(per_head)).enumerate().for_each(|(bh, (kt, vt))| {
        let (b, kvh) = (bh / hkv, bh % hkv);
        // Key j of this head at ((b·Sk + j)·Hkv + kvh)·D. The packers write every element
        // (padding as zeros): the pooled buffer holds an earlier call's data.
        let first = (b * sk * hkv + kvh) * d;
        pack::pack_kt(elem, kt, sk, skp, d, dp, pack::Rows { base: &inp.k[first..], stride: hkv * d });
        pack::pack_vt(elem, vt, sk, skp, d, dp, pack::Rows { base: &inp.v[first..], stride: hkv * d });
    });
    // Per (batch·kv head, key tile): an inf/NaN in V? Then P's exact zeros (masked keys) must
    // not meet it (0·inf = NaN), and a step holding that tile goes row by row over visible keys.
    let vbad: Vec<bool> = (0..batch * hkv * ntk)
        .into_par_iter()
        .map(|i| {
            let (bh, t) = (i / ntk, i % ntk);
            let (b, kvh) = (bh / hkv, bh % hkv);
            (t * BC..sk.min((t + 1) * BC)).any(|j| !pack::all_finite(&inp.v[((b * sk + j) * hkv + kvh) * d..][..d]))
        })
        .collect();

    let nqb = sq.div_ceil(BR);
    let o_ptr = SyncPtr(out.o.as_mut_ptr());
    let lse_ptr = SyncPtr(out.lse.as_mut_ptr());
    let (kt, vt, vbad) = (&kt[..], &vt[..], &vbad[..]);
    (0..batch * h * nqb).into_par_iter().for_each_init(
        || Scratch { qa: Lines::zeroed(BR * dp), s: Lines::zeroed(BR * S_LD), pa: Lines::zeroed(BR * P_LD), o: Lines::zeroed(BR * o_ld(dp)), m: vec![0.0; BR], l: vec![0.0; BR], ranges: Vec::with_capacity(BR) },
        |scr, task| {
            let qblock = QueryBlock::of(task, BR, shape);
            let block = qblock.ranges(opts, shape, inp.kv_len, inp.q_start, &mut scr.ranges);
            let QueryBlock { b, hq, bkv, i0, rows } = qblock;
            scr.m[..rows].fill(f32::NEG_INFINITY);
            scr.l[..rows].fill(0.0);
            if !block.is_empty() {
                let groups = rows.div_ceil(TILE_M);
                // Rows past `rows` (up to the 16-row group) and columns past d stay 0.
                scr.qa[..groups * TILE_M * dp].fill(0);
                for r in 0..rows {
                    let src = ((b * sq + i0 + r) * h + hq) * d;
                    pack::row_bits(elem, &inp.q[src..src + d], &mut scr.qa[r * dp..r * dp + d]);
                }
                scr.o[..groups * TILE_M * o_ld(dp)].fill(0.0);
                let kv = KvHead { kt: &kt[bkv * per_head..(bkv + 1) * per_head], vt: &vt[bkv * per_head..(bkv + 1) * per_head], skp, vbad: &vbad[bkv * ntk..(bkv + 1) * ntk] };
                // SAFETY: the dispatcher offers U only where it runs (`lowp::offered`); the
                // scope ends (AMX: tilerelease) before this task returns or unwinds.
                let _unit = unsafe { UnitScope::<U>::enter() };
                // Steps of up to STEP keys over the block's visible tiles.
                let (t0, t1) = (block.start / BC, block.end.div_ceil(BC));
                // The last step's row pass asks L2, a row per row, for the rows the next moments
                // touch: this task's output rows and the next task's Q (rayon walks a thread's run
                // of tasks in order). Each row of a [B, S, H, D] array sits a page from the next for
                // common shapes, where the hardware prefetchers stop.
                let tail = TaskRows::of(inp.q.as_ptr(), o_ptr.get(), shape, task, BR, batch * h * nqb);
                let mut t = t0;
                while t < t1 {
                    let tiles = (t1 - t).min(STEP / BC);
                    let last = t + tiles == t1;
                    step::<U, K>(scr, opts, rows, dp, d, t * BC, tiles * BC, &kv, last.then_some(&tail));
                    t += tiles;
                }
            }

            // SAFETY: task (b, hq, qb) alone writes o[b, i0..i0+rows, hq, :] and
            // lse[b, hq, i0..i0+rows]; all indices are < the checked lengths.
            unsafe {
                for r in 0..rows {
                    let dst = std::slice::from_raw_parts_mut(o_ptr.get().add(((b * sq + i0 + r) * h + hq) * d), d);
                    let lse = &mut *lse_ptr.get().add((b * h + hq) * sq + i0 + r);
                    let (m, l) = (scr.m[r], scr.l[r]);
                    let orow = &scr.o[r * o_ld(dp)..r * o_ld(dp) + dp];
                    if l > 0.0 {
                        // finish_row's `o = acc / l` rounded to T, 16 lanes at a time (its
                        // per-element conversion was 2-3% of the forward).
                        store_scaled::<T, K>(elem, orow, 1.0 / l, &mut scr.pa[..dp], dst);
                        *lse = row_lse(m, l);
                    } else {
                        finish_row(dst, lse, &orow[..d], m, l);
                    }
                }
            }
        },
    );
}

/// One step of `n` keys from key `j0` (whole tiles) for one block of query rows: `S = Q·Kᵀ` on
/// the unit, the online-softmax update of every row in f32, `P` rounded, `O += P·V` on the unit.
#[allow(clippy::too_many_arguments)]
fn step<U: TileUnit, K: Isa>(scr: &mut Scratch, opts: &AttnOptions, rows: usize, dp: usize, d: usize, j0: usize, n: usize, kv: &KvHead<'_>, tail: Option<&TaskRows>) {
    let elem = U::ELEM;
    let groups = rows.div_ceil(TILE_M);
    // K's panels of these keys: 16 keys × dp each, consecutive.
    let kt = &kv.kt[j0 * dp..(j0 + n) * dp];
    // SAFETY: qa holds `groups` 16-row groups of dp elements (dp/32 steps), kt n/16 panels of
    // dp/2 pair-rows, s the groups' rows of S_LD ≥ n f32: all inside the buffers.
    // Q's rows (A, BR × dp) stay in L1; each pair of K's panels is read once. Not asking for the
    // next pair ahead: here that took the products 9% longer (bench/RESULTS.md).
    unsafe { blocks::<U>(scr.qa.as_ptr(), dp, kt.as_ptr(), dp * TILE_N, scr.s.as_mut_ptr(), S_LD, groups, n / TILE_N, dp / TILE_K, false, Walk::Panels { ask_ahead: false }) };
    // Scores in exp2 units, as the row kernels take them.
    let qscale = opts.scale * LOG2_E;
    // Rows past the block's end in its last 16-row group multiply as zeros.
    for r in rows..groups * TILE_M {
        scr.pa[r * P_LD..r * P_LD + n].fill(0);
    }
    let mut any = false;
    for r in 0..rows {
        if let Some(tail) = tail {
            tail.prefetch_row(r);
        }
        let rg = scr.ranges[r];
        let a = rg.start.saturating_sub(j0).min(n);
        let b = rg.end.saturating_sub(j0).min(n);
        let prow = &mut scr.pa[r * P_LD..r * P_LD + n];
        if a >= b {
            // Nothing visible in this step: the row adds nothing to O.
            prow.fill(0);
            continue;
        }
        // SAFETY: the row of s and of pa hold n elements, n a multiple of 16, a < b ≤ n; K's
        // features were detected by the dispatcher.
        let (m_new, sum) = unsafe { fwd_row16::<K>(elem, scr.s[r * S_LD..].as_mut_ptr(), n, a, b, qscale, opts.softcap, scr.m[r], prow.as_mut_ptr()) };
        online_update::<K>(&mut scr.o[r * o_ld(dp)..r * o_ld(dp) + dp], &mut scr.m[r], &mut scr.l[r], m_new, sum);
        any = true;
    }
    if !any {
        return;
    }
    if kv.vbad[j0 / BC..(j0 + n) / BC].iter().any(|&bad| bad) {
        // Each row multiplies only the keys it sees, so a masked key's inf/NaN in V reaches
        // no row (a visible one reaches the rows that see it, as it should).
        for r in 0..rows {
            let rg = scr.ranges[r];
            let (a, b) = (rg.start.saturating_sub(j0).min(n), rg.end.saturating_sub(j0).min(n));
            let orow = &mut scr.o[r * o_ld(dp)..r * o_ld(dp) + d];
            for jt in a..b {
                let p = pack::value(elem, scr.pa[r * P_LD + jt]);
                for (dd, o) in orow.iter_mut().enumerate() {
                    *o += p * pack::value(elem, pack::vt_at(kv.vt, kv.skp, j0 + jt, dd));
                }
            }
        }
        return;
    }
    // V's pair-rows of these keys start at pair-row j0/2 of every panel (panels skp·16 apart).
    // Where the unit can stream V (AMX), P's rows by pairs of row groups (32 KiB each at 512
    // keys, kept in L1) with V passing by: walked by panels, P and V both came from L2 at every
    // product (15.3k → 12.1k cycles per 512-key step, bench/RESULTS.md).
    let walk = if U::STREAMS_B { Walk::Rows } else { Walk::Panels { ask_ahead: true } };
    // SAFETY: pa holds `groups` 16-row groups of P_LD ≥ n elements (n/32 steps), vt dp/16
    // panels of skp/2 pair-rows (j0 + n ≤ skp), o the groups' rows of o_ld(dp) f32.
    unsafe { blocks::<U>(scr.pa.as_ptr(), P_LD, kv.vt[j0 * TILE_N..].as_ptr(), kv.skp * TILE_N, scr.o.as_mut_ptr(), o_ld(dp), groups, dp / TILE_N, n / TILE_K, true, walk) };
}
