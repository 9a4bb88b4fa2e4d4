//! The 16-bit backward on a dot-product unit, for plain calls (no optional operands, no
//! dropout) with finite inputs: `backward.rs`'s FlashAttention-2 order with group 1, i.e. one
//! rayon task per (batch, kv head, key tile of [`BK`] keys) owning its dK/dV rows, looping over
//! the query heads of its GQA group and the query blocks ([`BR`] rows) that see the tile; dQ is
//! summed per (batch, head, query block) under a mutex.
//!
//! The five products run on the unit, none of them on a transposed per-tile operand:
//! `S = Q·Kᵀ`, `dP = dO·Vᵀ` (reduction over d; A = Q, dO row-major), `dVᵀ += dOᵀ·P`,
//! `dKᵀ += Qᵀ·dX` (reduction over the block's query rows; A = Qᵀ, dOᵀ packed once per call, B = P
//! and dX interleaved by row pairs, [`pack::vnni_rows`]: one vector op per 16 entries where a
//! transposed P would be a scatter) and `dQ += dX·K` (reduction over the tile's keys; A = dX
//! row-major). dK and dV are kept transposed (d × keys, f32) per task and written out
//! transposed once. `P` and `dX` are rounded to the input type before they are multiplied (as
//! the CUDA tensor-core kernels do); the row pass (`P`, `dX` from `lse`, `Δ`, softcap) is the
//! f32 `Isa::bwd_row`; accumulation is f32. `scale` is applied in f32: to S before the row
//! pass, to dK and dQ when they are written (their operands are the raw inputs, which a
//! pre-scaled 16-bit copy would round again).
//!
//! Packed operands ([`super::pack`] layouts; a query block is padded to [`BR`] rows):
//! - per call, per (batch, head): Q and dO row-major (A of `S`, `dP`), and per query block
//!   transposed, `dp × BR` (A of `dKᵀ`, `dVᵀ`);
//! - per task: K and V as the B of `S`, `dP` (`pack_kt`), K in VNNI pairs along the keys (B of
//!   `dQ`, `pack_vt`).

use std::sync::Mutex;

use rayon::prelude::*;

use super::super::kernels::{Isa, LOG2_E};
use super::super::lines::Lines;
use super::super::{pool, BwdInputs, BwdOutputs, HostElement, SyncPtr};
use super::pack::{self, padded_dim};
use super::tile::{TILE_K, TILE_M, TILE_N};
use super::model::Half16;
use super::rows::{bwd_row16, store_scaled};
use super::unit::{blocks, TileUnit, UnitScope, Walk};
use crate::{AttnOptions, AttnShape, KeyRange};

/// Query rows per block (the reduction of `dKᵀ`, `dVᵀ`: a multiple of [`TILE_K`]).
///
/// Three of the five products accumulate into f32 sums kept in memory (`dKᵀ`, `dVᵀ`, `dQ`), so
/// each unit call loads and stores its C tiles once per reduction of `BR` (or [`BK`]) elements:
/// at 64 (two `TDP*` steps per C load and store) AMX ran that product at 666 GFLOP/s from L1
/// against 919 at 128 (`host_bench peak`). 128 × 128 took 6-15% off the backward (D = 64/128,
/// causal or not, Emerald Rapids, bench/RESULTS.md); 256 rows, or 256 keys, were no faster.
const BR: usize = 128;
/// Keys per task (the reduction of `dQ`: a multiple of [`TILE_K`]).
const BK: usize = 128;
const _: () = assert!(BR.is_multiple_of(TILE_K) && BK.is_multiple_of(TILE_K));

/// Whether the lowp backward takes these operands: all finite. A NaN/inf needs the f32 path's
/// row-by-row products, which keep it away from the keys/rows that do not see it.
pub(crate) fn takes<T: HostElement>(inp: &BwdInputs<'_, T>) -> bool {
    [inp.q, inp.k, inp.v, inp.o, inp.d_o].iter().all(|x| pack::all_finite(x))
}

/// One (batch, head)'s packed query-side operands (views of one pooled buffer).
struct QueryPacks<'a> {
    /// Q, dO row-major, `nqb·BR × dp` (rows past Sq are 0).
    qa: &'a [u16],
    doa: &'a [u16],
    /// Q, dO per query block transposed: `nqb × (dp × BR)` (rows past Sq, d past D are 0).
    qt: &'a [u16],
    dot: &'a [u16],
}

/// Per-thread scratch; the unit's operands start on cache lines ([`super::super::lines`]), and
/// every row stride is whole lines.
struct Scratch {
    /// The task's key tile: K, V as B of S, dP; K as B of dQ.
    kt: Lines<u16>,
    vt: Lines<u16>,
    kv: Lines<u16>,
    /// dKᵀ, dVᵀ of the task's keys: `dp × BK` f32.
    dkt: Lines<f32>,
    dvt: Lines<f32>,
    s: Lines<f32>,
    dp: Lines<f32>,
    p: Lines<f32>,
    /// P and dX rounded, row-major `BR × BK` (dX: the A of dQ).
    pa: Lines<u16>,
    dxa: Lines<u16>,
    /// P and dX as B operands along the query rows ([`pack::vnni_rows`]).
    pv: Lines<u16>,
    dxv: Lines<u16>,
    ranges: Vec<KeyRange>,
    /// 16 keys' dK (or dV) rows, transposed back from `dkt`/`dvt`: `TILE_N × dp` f32.
    rows_out: Lines<f32>,
    /// One output row rounded to 16 bits: `dp`.
    bits: Lines<u16>,
}

/// `Σ a∘b` in f32 over one row of 16-bit inputs, 16 lanes wide (as `Isa` widens them): a scalar
/// sum through `to_f32` per element was a quarter of the packing before the key loop.
pub(super) fn row_dot<T: HostElement, K: Isa>(elem: Half16, a: &[T], b: &[T]) -> f32 {
    const W: usize = 32;
    let mut acc = [0f32; 16];
    let (mut wa, mut wb) = ([0f32; W], [0f32; W]);
    for (ca, cb) in a.chunks(W).zip(b.chunks(W)) {
        let n = ca.len();
        if pack::is_elem::<T>(elem) {
            // SAFETY: T is elem's 16-bit type (checked): n elements of bits each; `wa`/`wb`
            // hold W ≥ n; K's features were detected by the dispatcher.
            unsafe {
                K::widen16(ca.as_ptr().cast(), elem == Half16::F16, wa.as_mut_ptr(), n);
                K::widen16(cb.as_ptr().cast(), elem == Half16::F16, wb.as_mut_ptr(), n);
            }
        } else {
            ca.iter().zip(&mut wa).for_each(|(x, w)| *w = x.to_f32());
            cb.iter().zip(&mut wb).for_each(|(x, w)| *w = x.to_f32());
        }
        wa[n..].fill(0.0);
        wb[n..].fill(0.0);
        for k in 0..W {
            acc[k % 16] += wa[k] * wb[k];
        }
    }
    acc.iter().sum()
}

pub(crate) fn run<T: HostElement, U: TileUnit, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>) {
    let AttnShape { batch, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d } = *shape;
    if batch == 0 || sk == 0 || sq == 0 {
        // Nothing is visible anywhere: all gradients are 0.
        out.dq.fill(T::from_f32(0.0));
        out.dk.fill(T::from_f32(0.0));
        out.dv.fill(T::from_f32(0.0));
        return;
    }
    let elem = U::ELEM;
    let g = shape.group();
    let dp = padded_dim(d);
    let nqb = sq.div_ceil(BR);
    let nkb = sk.div_ceil(BK);
    let sqp = nqb * BR;

    // Δ = rowsum(dO∘O) and lse·log2(e) per row; the query-side packs per (batch, head), four
    // regions of `per` elements each, in one pooled buffer (pages already mapped from the last
    // call; the packers write every element).
    let mut di = vec![0f32; batch * h * sq];
    let mut lse2 = vec![0f32; batch * h * sq];
    let per = sqp * dp;
    let mut packed = pool::take(batch * h * 4 * per / 2);
    packed.as_u16_mut().par_chunks_mut(4 * per).zip(di.par_chunks_mut(sq).zip(lse2.par_chunks_mut(sq))).enumerate().for_each(|(bhq, (pk, (di, lse2)))| {
        let (b, hq) = (bhq / h, bhq % h);
        let (qa, rest) = pk.split_at_mut(per);
        let (doa, rest) = rest.split_at_mut(per);
        let (qt, dot) = rest.split_at_mut(per);
        for i in 0..sqp {
            let (qrow, dorow) = (&mut qa[i * dp..(i + 1) * dp], &mut doa[i * dp..(i + 1) * dp]);
            if i >= sq {
                qrow.fill(0);
                dorow.fill(0);
                continue;
            }
            let src = ((b * sq + i) * h + hq) * d;
            pack::row_bits(elem, &inp.q[src..src + d], &mut qrow[..d]);
            pack::row_bits(elem, &inp.d_o[src..src + d], &mut dorow[..d]);
            qrow[d..].fill(0);
            dorow[d..].fill(0);
            lse2[i] = inp.lse[bhq * sq + i] * LOG2_E;
            di[i] = row_dot::<T, K>(elem, &inp.d_o[src..src + d], &inp.o[src..src + d]);
        }
        // Block by block, the transposes: column i % BR of block i / BR holds row i.
        for blk in (0..per).step_by(BR * dp) {
            pack::transpose(&qa[blk..], dp, BR, dp, &mut qt[blk..], BR);
            pack::transpose(&doa[blk..], dp, BR, dp, &mut dot[blk..], BR);
        }
    });
    let packs: Vec<QueryPacks<'_>> = packed.as_u16()[..batch * h * 4 * per].chunks(4 * per).map(|c| QueryPacks { qa: &c[..per], doa: &c[per..2 * per], qt: &c[2 * per..3 * per], dot: &c[3 * per..] }).collect();
    // dQ's f32 sums per (batch, head, query block), pooled too: zeroed here.
    let mut dq_sums = pool::take(batch * h * nqb * BR * dp);
    dq_sums.par_chunks_mut(BR * dp).for_each(|c| c.fill(0.0));
    let dq_acc: Vec<Mutex<&mut [f32]>> = dq_sums.chunks_mut(BR * dp).map(Mutex::new).collect();

    let dk_ptr = SyncPtr(out.dk.as_mut_ptr());
    let dv_ptr = SyncPtr(out.dv.as_mut_ptr());
    let (packs, di, lse2, dq_acc) = (&packs[..], &di[..], &lse2[..], &dq_acc[..]);
    (0..batch * hkv * nkb).into_par_iter().for_each_init(
        || Scratch {
            kt: Lines::zeroed(BK * dp),
            vt: Lines::zeroed(BK * dp),
            kv: Lines::zeroed(BK * dp),
            dkt: Lines::zeroed(dp * BK),
            dvt: Lines::zeroed(dp * BK),
            s: Lines::zeroed(BR * BK),
            dp: Lines::zeroed(BR * BK),
            p: Lines::zeroed(BR * BK),
            pa: Lines::zeroed(BR * BK),
            dxa: Lines::zeroed(BR * BK),
            pv: Lines::zeroed(BR * BK),
            dxv: Lines::zeroed(BR * BK),
            ranges: Vec::with_capacity(BR),
            rows_out: Lines::zeroed(TILE_N * dp),
            bits: Lines::zeroed(dp),
        },
        |scr, task| {
            let (bkv, kb) = (task / nkb, task % nkb);
            let (b, kvh) = (bkv / hkv, bkv % hkv);
            let j0 = kb * BK;
            let cols = BK.min(sk - j0);
            let at = |j: usize| ((b * sk + j0 + j) * hkv + kvh) * d;
            // The packers write every element (keys past `cols` as zeros).
            let (krows, vrows) = (pack::Rows { base: &inp.k[at(0)..], stride: hkv * d }, pack::Rows { base: &inp.v[at(0)..], stride: hkv * d });
            pack::pack_kt(elem, &mut scr.kt, cols, BK, d, dp, krows);
            pack::pack_kt(elem, &mut scr.vt, cols, BK, d, dp, vrows);
            pack::pack_vt(elem, &mut scr.kv, cols, BK, d, dp, krows);
            scr.dkt.fill(0.0);
            scr.dvt.fill(0.0);
            let (kvl, qst) = (inp.kv_len[b], inp.q_start[b]);
            // SAFETY: the dispatcher offers U only where it runs; the scope ends before return.
            let _unit = unsafe { UnitScope::<U>::enter() };
            for hq in kvh * g..(kvh + 1) * g {
                let bhq = b * h + hq;
                // Query blocks from this tile's own offset on, wrapping: tasks of one head that run
                // at once then want different blocks' dQ locks, not each other's.
                for qb in (kb % nqb..nqb).chain(0..kb % nqb) {
                    let (i0, rows) = (qb * BR, BR.min(sq - qb * BR));
                    let block = KeyRange::for_rows(opts, sk, kvl, qst, i0, i0 + rows);
                    if block.is_empty() || block.end <= j0 || block.start >= j0 + cols {
                        continue;
                    }
                    scr.ranges.clear();
                    scr.ranges.extend((0..rows).map(|r| KeyRange::for_row(opts, sk, kvl, qst, i0 + r)));
                    let rowsl = bhq * sq + i0..bhq * sq + i0 + rows;
                    if tile::<U, K>(scr, opts, &packs[bhq], qb, rows, j0, cols, dp, &lse2[rowsl.clone()], &di[rowsl]) {
                        // dQ += dX·K straight into the block's sum (the unit adds as it
                        // multiplies: a separate f32 add of every product was 10% of the pass).
                        let mut acc = dq_acc[bhq * nqb + qb].lock().unwrap_or_else(|e| e.into_inner());
                        // SAFETY: dxa is BR × BK (mg groups, BK/32 steps), kv dp/16 panels of
                        // BK·16, acc BR × dp.
                        unsafe { blocks::<U>(scr.dxa.as_ptr(), BK, scr.kv.as_ptr(), BK * TILE_N, acc.as_mut_ptr(), dp, rows.div_ceil(TILE_M), dp / TILE_N, BK / TILE_K, true, Walk::Panels { ask_ahead: true }) };
                    }
                }
            }
            // 16 keys at a time: their columns of dKᵀ (dVᵀ) transposed to rows, each row scaled
            // and rounded 16 lanes at a time (element by element through a strided read this was
            // a sixth of the backward).
            for c0 in (0..cols).step_by(TILE_N) {
                let kc = TILE_N.min(cols - c0);
                for (sums, ptr, scale) in [(&scr.dkt, dk_ptr, opts.scale), (&scr.dvt, dv_ptr, 1.0)] {
                    pack::transpose(&sums[c0..], BK, dp, kc, &mut scr.rows_out, dp);
                    for k in 0..kc {
                        // SAFETY: task (b, kvh, kb) alone writes keys j0..j0+cols of kv head kvh
                        // in batch b; rows_out holds kc rows of dp f32; K's features were detected.
                        unsafe { store_scaled::<T, K>(elem, &scr.rows_out[k * dp..(k + 1) * dp], scale, &mut scr.bits, std::slice::from_raw_parts_mut(ptr.get().add(at(c0 + k)), d)) };
                    }
                }
            }
        },
    );

    let dq_ptr = SyncPtr(out.dq.as_mut_ptr());
    (0..batch * h * nqb).into_par_iter().for_each_init(
        || Lines::<u16>::zeroed(dp),
        |bits, t| {
            let (bhq, qb) = (t / nqb, t % nqb);
            let (b, hq) = (bhq / h, bhq % h);
            let rows = BR.min(sq - qb * BR);
            let acc = dq_acc[t].lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: block (b, hq, qb) alone writes dq[b, qb·BR.., hq, :]; acc rows hold dp
            // f32; K's features were detected.
            unsafe {
                for r in 0..rows {
                    let dst = std::slice::from_raw_parts_mut(dq_ptr.get().add(((b * sq + qb * BR + r) * h + hq) * d), d);
                    store_scaled::<T, K>(elem, &acc[r * dp..(r + 1) * dp], opts.scale, bits, dst);
                }
            }
        },
    );
}

/// One key tile against one query block: four of the five products. Adds to the tile's
/// dKᵀ/dVᵀ and leaves dX (the A of `dQ += dX·K`, which the caller runs into the block's dQ sum)
/// in `scr.dxa`. Returns whether any row saw a key of the tile.
#[allow(clippy::too_many_arguments)]
fn tile<U: TileUnit, K: Isa>(scr: &mut Scratch, opts: &AttnOptions, qp: &QueryPacks, qb: usize, rows: usize, j0: usize, cols: usize, dp: usize, lse2: &[f32], di: &[f32]) -> bool {
    let elem = U::ELEM;
    let mg = rows.div_ceil(TILE_M);
    let blk = qb * BR * dp..(qb + 1) * BR * dp;
    let (qa, doa, qt, dot) = (&qp.qa[blk.clone()], &qp.doa[blk.clone()], &qp.qt[blk.clone()], &qp.dot[blk]);
    // SAFETY: qa/doa hold BR ≥ 16·mg rows of dp; kt/vt BK/16 panels of dp·16; s/dp BR × BK.
    unsafe {
        blocks::<U>(qa.as_ptr(), dp, scr.kt.as_ptr(), dp * TILE_N, scr.s.as_mut_ptr(), BK, mg, BK / TILE_N, dp / TILE_K, false, Walk::Panels { ask_ahead: true });
        blocks::<U>(doa.as_ptr(), dp, scr.vt.as_ptr(), dp * TILE_N, scr.dp.as_mut_ptr(), BK, mg, BK / TILE_N, dp / TILE_K, false, Walk::Panels { ask_ahead: true });
    }
    let mut any = false;
    for r in 0..BR {
        let (pa, dxa) = (&mut scr.pa[r * BK..(r + 1) * BK], &mut scr.dxa[r * BK..(r + 1) * BK]);
        // The row's visible columns; none past the block or on a row the forward found fully
        // masked.
        let (a, e) = match scr.ranges.get(r) {
            Some(rg) if lse2[r].is_finite() => (rg.start.saturating_sub(j0).min(cols), rg.end.saturating_sub(j0).min(cols)),
            _ => (0, 0),
        };
        if a >= e {
            // Masked in this tile, past the block, or a row the forward found fully masked:
            // P and dX are 0.
            pa.fill(0);
            dxa.fill(0);
            continue;
        }
        let (srow, prow) = (&mut scr.s[r * BK..(r + 1) * BK], &mut scr.p[r * BK..(r + 1) * BK]);
        // SAFETY: rows of BK elements (a multiple of 32); a < e ≤ cols ≤ BK; K's features
        // were detected by the dispatcher.
        unsafe { bwd_row16::<K>(elem, srow.as_mut_ptr(), scr.dp[r * BK..].as_ptr(), prow.as_mut_ptr(), BK, a, e, opts.scale, opts.softcap, lse2[r], di[r], pa.as_mut_ptr(), dxa.as_mut_ptr()) };
        any = true;
    }
    if !any {
        return false;
    }
    pack::vnni_rows(&scr.pa, BK, BR, BK, &mut scr.pv);
    pack::vnni_rows(&scr.dxa, BK, BR, BK, &mut scr.dxv);
    // SAFETY: dot/qt are dp × BR (dp/16 row groups, BR/32 steps), pv/dxv BK/16 panels of BR·16,
    // dvt/dkt dp × BK.
    unsafe {
        blocks::<U>(dot.as_ptr(), BR, scr.pv.as_ptr(), BR * TILE_N, scr.dvt.as_mut_ptr(), BK, dp / TILE_M, BK / TILE_N, BR / TILE_K, true, Walk::Panels { ask_ahead: true });
        blocks::<U>(qt.as_ptr(), BR, scr.dxv.as_ptr(), BR * TILE_N, scr.dkt.as_mut_ptr(), BK, dp / TILE_M, BK / TILE_N, BR / TILE_K, true, Walk::Panels { ask_ahead: true });
    }
    true
}
