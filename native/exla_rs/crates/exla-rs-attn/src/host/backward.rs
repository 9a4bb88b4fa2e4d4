//! Backward pass (FlashAttention-2 order): one rayon task per (batch, kv head, group of
//! consecutive blocks of `BC` keys; see [`key_group`]). A task owns its dK/dV rows outright,
//! loops over the query heads of its GQA group and the query blocks that can see its keys (for
//! each, over the group's tiles), recomputes `P` from the saved `lse`, and adds its share of dQ
//! into an f32 accumulator per (batch, head, query block) under that block's mutex. This keeps
//! both cores busy even for B·Hkv = 1 (Sk/BC tasks) with no S×S buffer; a lock is held for
//! `BR·D` additions against `~5·BR·BC·D` FMAs of work per tile of the group, so contention is
//! negligible.
//!
//! With a bias, a (head, query block) reads its bias rows over the whole group (in place, each
//! tile prefetched a few tiles ahead, see [`Prep::in_place`]; else into a panel, runs of KiBs,
//! [`Prep::fill_panel`]) and leaves dZ over the group in another panel, which [`DbiasOut`] writes
//! out in runs of KiBs: no strided 256-byte pieces of `dbias`. Groups also keep an in-place
//! read on the same pages for 16 tiles (one block a task touched 64 new pages per tile, +70 ms
//! at S = 2048, measured).
//!
//! Scores are taken w.r.t. `x = qs·k` with `qs = scale·q` packed once, so `dK = dXᵀ·qs` and
//! `dQ = dX·(scale·k)` need no extra scaling pass.

use std::sync::Mutex;

use rayon::prelude::*;

use super::dbias::{self, DbiasOut};
use super::dropout::{keep_tile_fn, KeepTileFn, NO_DROPOUT, STORE};
use super::extra::{BiasPanel, PanelSpan, Prep, PANEL_TILES};
use super::tiles::{BC, BR};
use super::kernels::{Gemm, Isa, Prefetch, LOG2_E, NO_EXT, PAD};
use super::lines::Lines;
use super::pool;
use super::{round_up, BwdInputs, BwdOutputs, HostElement, SyncPtr};
use crate::philox::Dropout;
use crate::{AttnOptions, AttnShape, BiasGrad, Extras, KeyRange};

/// One key block's packed operands and the gradient rows its task accumulates.
struct KeyBlock {
    /// `K^T`, `V^T` (the B operands of `S` and `dP`) and `scale·K` (of `dQ`).
    kt: Lines<f32>,
    vt: Lines<f32>,
    ks: Lines<f32>,
    dk: Lines<f32>,
    dv: Lines<f32>,
    /// An inf/NaN in this block's K: dQ then goes row by row over the keys each row sees, since
    /// dX's exact zeros at hidden keys times inf would be NaN.
    k_bad: bool,
}

/// Per-thread scratch, reused across tasks: the task's key blocks and one tile's work buffers.
struct Scratch {
    blocks: Vec<KeyBlock>,
    /// Per query block, the group's key tiles it sees.
    seen: Vec<std::ops::Range<usize>>,
    work: Work,
}

struct Work {
    s: Lines<f32>,
    dp: Lines<f32>,
    p: Lines<f32>,
    /// This (head, query block)'s share of dQ, summed over the group's tiles.
    tmp: Lines<f32>,
    ranges: Vec<KeyRange>,
    /// The bias of the (head, query block) over the group's visible tiles (empty without one).
    panel: BiasPanel,
    /// dZ of the (head, query block) over the group's keys (`BR × group·BC`), when `dbias` is wanted.
    dz: Vec<f32>,
    /// The dropout keep scales of a tile (`BR × BC`: `scale` or 0), regenerated from the key.
    km: Vec<f32>,
}

/// What every tile of one (batch, query head, query block) shares.
struct RowsCtx<'a> {
    b: usize,
    hq: usize,
    i0: usize,
    rows: usize,
    qst: i64,
    alibi2: f32,
    qblk: &'a [f32],
    doblk: &'a [f32],
    /// `lse·log2(e)` and `Δ` of the block's rows.
    lse2: &'a [f32],
    di: &'a [f32],
}

/// What every tile of the call shares.
struct CallCtx<'a, 'p> {
    opts: &'a AttnOptions,
    prep: &'p Prep<'a>,
    sk: usize,
    d: usize,
    dp: usize,
    dropout: Dropout,
    keep_tile: KeepTileFn,
    /// `dbias` is wanted: the row kernels store dZ into `Work::dz` (row stride `dz_w`).
    want_dz: bool,
    dz_w: usize,
}

/// Key blocks per task without a bias, at most (see [`key_group`]).
const PLAIN_GROUP: usize = 4;

pub(super) fn run<T: HostElement, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>, ex: &Extras<'_>, dbias: Option<BiasGrad<'_>>) {
    let group = key_group(shape, ex.bias.is_some());
    run_grouped::<T, K>(shape, opts, inp, out, ex, dbias, group);
}

/// Key blocks per task. Without a bias up to [`PLAIN_GROUP`]: a query block's dQ share is summed
/// over the group's tiles in the task's scratch and added to the shared accumulator once per
/// group, not once per tile (that add reads and writes `BR·D` f32 of an array too large for L2:
/// one-block groups took 3-9% longer, S = 2048 one thread, bench/RESULTS.md). With a bias up to
/// [`PANEL_TILES`], so each bias (and `dbias`) row segment a task reads (writes) for a query block
/// is a run of KiBs instead of 256 bytes one bias row apart. Groups shrink until there are at
/// least 4 tasks per thread, for the load balance.
fn key_group(shape: &AttnShape, has_bias: bool) -> usize {
    let nkb = shape.seq_k.div_ceil(BC);
    if nkb == 0 {
        return 1;
    }
    let want = 4 * rayon::current_num_threads();
    let mut group = if has_bias { PANEL_TILES } else { PLAIN_GROUP }.min(nkb);
    while group > 1 && shape.batch * shape.kv_heads * nkb.div_ceil(group) < want {
        group = group.div_ceil(2);
    }
    group
}

/// [`run`] with tasks of `group` key blocks (tests try several).
#[allow(clippy::too_many_arguments)]
pub(super) fn run_grouped<T: HostElement, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>, ex: &Extras<'_>, dbias: Option<BiasGrad<'_>>, group: usize) {
    // One instance per combination: without optional operands the tile loop is exactly the
    // original one, and without dropout (rate 0) no generator code is in it.
    let group = group.clamp(1, PANEL_TILES);
    match (ex.changes_scores(), ex.dropout.is_some()) {
        (false, false) => run_impl::<T, K, false, false>(shape, opts, inp, out, ex, None, group),
        (true, false) => run_impl::<T, K, true, false>(shape, opts, inp, out, ex, dbias, group),
        (false, true) => run_impl::<T, K, false, true>(shape, opts, inp, out, ex, None, group),
        (true, true) => run_impl::<T, K, true, true>(shape, opts, inp, out, ex, dbias, group),
    }
}

#[allow(clippy::too_many_arguments)]
fn run_impl<T: HostElement, K: Isa, const EXT: bool, const DROP: bool>(shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>, ex: &Extras<'_>, dbias: Option<BiasGrad<'_>>, group: usize) {
    let AttnShape { batch, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d } = *shape;
    if batch == 0 || sk == 0 || sq == 0 {
        // Nothing is visible anywhere: all gradients are 0.
        dbias::zero(dbias);
        out.dq.fill(T::from_f32(0.0));
        out.dk.fill(T::from_f32(0.0));
        out.dv.fill(T::from_f32(0.0));
        return;
    }
    let g = shape.group();
    let dp = round_up(d, PAD);
    let nqb = sq.div_ceil(BR);
    let nkb = sk.div_ceil(BC);
    let ngrp = nkb.div_ceil(group);

    // Per (b, head) packs: qs = scale·q and dO as padded f32 rows; Δ = rowsum(dO∘O); lse·log2(e).
    // qs and dO from the pool (pages mapped by an earlier call): every element is written below.
    let mut qs = pool::take(batch * h * sq * dp);
    let mut dop = pool::take(batch * h * sq * dp);
    let mut di = vec![0f32; batch * h * sq];
    let mut lse2 = vec![0f32; batch * h * sq];
    qs.par_chunks_mut(sq * dp)
        .zip(dop.par_chunks_mut(sq * dp))
        .zip(di.par_chunks_mut(sq).zip(lse2.par_chunks_mut(sq)))
        .enumerate()
        .for_each(|(bhq, ((qs, dop), (di, lse2)))| {
            let (b, hq) = (bhq / h, bhq % h);
            for i in 0..sq {
                let src = ((b * sq + i) * h + hq) * d;
                lse2[i] = inp.lse[bhq * sq + i] * LOG2_E;
                let (qrow, qpad) = qs[i * dp..(i + 1) * dp].split_at_mut(d);
                let (dorow, dopad) = dop[i * dp..(i + 1) * dp].split_at_mut(d);
                // Padding columns are zeros: the products multiply them.
                qpad.fill(0.0);
                dopad.fill(0.0);
                if lse2[i] == f32::NEG_INFINITY {
                    // A row the forward found fully masked contributes nothing: its q and dO are
                    // 0 here, so a NaN/inf in them cannot reach dK/dV through the gemms' P = 0.
                    qrow.fill(0.0);
                    dorow.fill(0.0);
                    continue;
                }
                for (o, x) in qrow.iter_mut().zip(&inp.q[src..src + d]) {
                    *o = opts.scale * x.to_f32();
                }
                let mut acc = 0f32;
                for ((o, x), y) in dorow.iter_mut().zip(&inp.d_o[src..src + d]).zip(&inp.o[src..src + d]) {
                    *o = x.to_f32();
                    acc += *o * y.to_f32();
                }
                di[i] = acc;
            }
        });
    let dq_acc: Vec<Mutex<Vec<f32>>> =
        (0..batch * h * nqb).map(|t| Mutex::new(vec![0f32; BR.min(sq - (t % nqb) * BR) * dp])).collect();

    let prep = if EXT { Prep::new(shape, ex) } else { Prep::new(shape, &Extras::default()) };
    let dbias = match (dbias, ex.bias) {
        (Some(grad), Some(bias)) if EXT => Some(DbiasOut::new(grad, bias.dims, shape, nqb, ngrp)),
        _ => None,
    };
    let dz_w = group * BC;
    let call = CallCtx {
        opts,
        prep: &prep,
        sk,
        d,
        dp,
        dropout: ex.dropout.unwrap_or(NO_DROPOUT),
        keep_tile: keep_tile_fn::<STORE>(K::LANES),
        want_dz: dbias.is_some(),
        dz_w,
    };
    let (call, dbias_out) = (&call, dbias.as_ref());

    let dk_ptr = SyncPtr(out.dk.as_mut_ptr());
    let dv_ptr = SyncPtr(out.dv.as_mut_ptr());
    let (qs, dop, di, lse2, dq_acc) = (&qs[..], &dop[..], &di[..], &lse2[..], &dq_acc[..]);
    (0..batch * hkv * ngrp).into_par_iter().for_each_init(
        || Scratch {
            blocks: (0..group)
                .map(|_| KeyBlock { kt: Lines::zeroed(d * BC), vt: Lines::zeroed(d * BC), ks: Lines::zeroed(BC * dp), dk: Lines::zeroed(BC * dp), dv: Lines::zeroed(BC * dp), k_bad: false })
                .collect(),
            seen: Vec::with_capacity(nqb),
            work: Work {
                s: Lines::zeroed(BR * BC),
                dp: Lines::zeroed(BR * BC),
                p: Lines::zeroed(BR * BC),
                tmp: Lines::zeroed(BR * dp),
                ranges: Vec::with_capacity(BR),
                panel: BiasPanel::new(call.prep, group),
                dz: if call.want_dz { vec![0.0; BR * dz_w] } else { Vec::new() },
                km: if DROP { vec![0.0; BR * BC] } else { Vec::new() },
            },
        },
        |scr, task| {
            let (bkv, grp) = (task / ngrp, task % ngrp);
            let (b, kvh) = (bkv / hkv, bkv % hkv);
            let (kb0, kb1) = (grp * group, ((grp + 1) * group).min(nkb));
            let keys = (kb0 * BC, (kb1 * BC).min(sk));
            let (kvl, qst) = (inp.kv_len[b], inp.q_start[b]);
            for kb in kb0..kb1 {
                pack_block(&mut scr.blocks[kb - kb0], &inp, opts.scale, b, kvh, hkv, sk, d, dp, kb * BC);
            }

            // The group's tiles each query block sees: those its rows' key ranges reach, less those
            // the key mask hides entirely at either end (empty: the block skips the group).
            let seen = &mut scr.seen;
            seen.clear();
            seen.extend((0..nqb).map(|qb| {
                let i0 = qb * BR;
                let block = KeyRange::for_rows(opts, sk, kvl, qst, i0, i0 + BR.min(sq - i0));
                let (mut lo, mut hi) = if block.is_empty() { (kb0, kb0) } else { (kb0.max(block.start / BC), kb1.min(block.end.div_ceil(BC))) };
                while EXT && lo < hi && !call.prep.tile_visible(b, lo) {
                    lo += 1;
                }
                while EXT && lo < hi && !call.prep.tile_visible(b, hi - 1) {
                    hi -= 1;
                }
                lo..hi.max(lo)
            }));
            // (query head, query block) pairs in order: p = (hq - kvh·g)·nqb + qb.
            let pairs = g * nqb;
            let span_of = |p: usize| {
                let (hq, qb) = (kvh * g + p / nqb, p % nqb);
                let i0 = qb * BR;
                PanelSpan { b, hq, i0, rows: BR.min(sq - i0), t0: seen[qb].start, t1: seen[qb].end }
            };
            for p in 0..pairs {
                let span = span_of(p);
                let PanelSpan { hq, i0, rows, t0: lo, t1: hi, .. } = span;
                let qb = p % nqb;
                if lo >= hi {
                    if let Some(out) = dbias_out {
                        out.skip(b, hq, i0, rows, keys.0, keys.1);
                    }
                    continue;
                }
                let w = &mut scr.work;
                // The next pair that computes anything: its bias is prefetched during this one.
                let next = if EXT && call.prep.has_bias() { (p + 1..pairs).find(|&n| !seen[n % nqb].is_empty()).map(span_of) } else { None };
                if EXT && call.prep.uses_panel() {
                    call.prep.fill_panel(&mut w.panel, &span);
                }
                let bhq = b * h + hq;
                let row0 = bhq * sq + i0;
                w.ranges.clear();
                w.ranges.extend((0..rows).map(|r| KeyRange::for_row(opts, sk, kvl, qst, i0 + r)));
                let ctx = RowsCtx {
                    b,
                    hq,
                    i0,
                    rows,
                    qst: qst as i64,
                    alibi2: if EXT { call.prep.alibi2(hq) } else { 0.0 },
                    qblk: &qs[row0 * dp..(row0 + rows) * dp],
                    doblk: &dop[row0 * dp..(row0 + rows) * dp],
                    lse2: &lse2[row0..row0 + rows],
                    di: &di[row0..row0 + rows],
                };
                let mut dq_started = false;
                for kb in lo..hi {
                    if let Some(next) = next.as_ref().filter(|_| call.prep.uses_panel()) {
                        call.prep.prefetch_part(next, kb - lo, hi - lo);
                    }
                    // In-place bias: the tile PREFETCH_TILES ahead (in this task's order) is
                    // asked for during this one's score product.
                    let pf = if EXT { call.prep.prefetch_ahead(&span, next.as_ref(), kb) } else { Prefetch::NONE };
                    let dz_col = (kb - kb0) * BC;
                    if EXT && !call.prep.tile_visible(b, kb) {
                        // key_mask hides every key of this tile from batch row b.
                        if call.want_dz {
                            zero_cols(&mut w.dz, dz_w, rows, dz_col);
                        }
                        continue;
                    }
                    dq_started |= tile::<K, EXT, DROP>(w, &mut scr.blocks[kb - kb0], call, &ctx, kb, dz_col, dq_started, pf);
                }
                if let Some(out) = dbias_out {
                    out.put(&w.dz, dz_w, b, hq, qb, i0, rows, grp, keys, (lo * BC, (hi * BC).min(sk)));
                }
                if dq_started {
                    let mut acc = dq_acc[bhq * nqb + qb].lock().unwrap_or_else(|e| e.into_inner());
                    for (x, y) in acc.iter_mut().zip(&w.tmp[..rows * dp]) {
                        *x += *y;
                    }
                }
            }

            // SAFETY: task (b, kvh, grp) alone writes rows kb0·BC.. of kv head kvh in batch b.
            for kb in kb0..kb1 {
                let (blk, j0) = (&scr.blocks[kb - kb0], kb * BC);
                unsafe {
                    for c in 0..BC.min(sk - j0) {
                        let dst = ((b * sk + j0 + c) * hkv + kvh) * d;
                        let dk = std::slice::from_raw_parts_mut(dk_ptr.get().add(dst), d);
                        let dv = std::slice::from_raw_parts_mut(dv_ptr.get().add(dst), d);
                        for (o, x) in dk.iter_mut().zip(&blk.dk[c * dp..c * dp + d]) {
                            *o = T::from_f32(*x);
                        }
                        for (o, x) in dv.iter_mut().zip(&blk.dv[c * dp..c * dp + d]) {
                            *o = T::from_f32(*x);
                        }
                    }
                }
            }
        },
    );

    if let Some(out) = dbias {
        out.finish();
    }

    let dq_ptr = SyncPtr(out.dq.as_mut_ptr());
    (0..batch * h * nqb).into_par_iter().for_each(|t| {
        let (bhq, qb) = (t / nqb, t % nqb);
        let (b, hq) = (bhq / h, bhq % h);
        let acc = dq_acc[t].lock().unwrap_or_else(|e| e.into_inner());
        let rows = acc.len() / dp;
        // SAFETY: block (b, hq, qb) alone writes dq[b, qb·BR.., hq, :].
        unsafe {
            for r in 0..rows {
                let dst = std::slice::from_raw_parts_mut(dq_ptr.get().add(((b * sq + qb * BR + r) * h + hq) * d), d);
                for (o, x) in dst.iter_mut().zip(&acc[r * dp..r * dp + d]) {
                    *o = T::from_f32(*x);
                }
            }
        }
    });
}

/// Packs key block `j0..` of kv head `kvh` in batch row `b`: `K^T`, `V^T` and `scale·K`, with
/// columns/rows past `Sk` zeroed (the scratch may hold a previous task's block), and a zero dK/dV.
#[allow(clippy::too_many_arguments)]
fn pack_block<T: HostElement>(blk: &mut KeyBlock, inp: &BwdInputs<'_, T>, scale: f32, b: usize, kvh: usize, hkv: usize, sk: usize, d: usize, dp: usize, j0: usize) {
    let cols = BC.min(sk - j0);
    blk.kt.fill(0.0);
    blk.vt.fill(0.0);
    blk.ks.fill(0.0);
    for c in 0..cols {
        let src = ((b * sk + j0 + c) * hkv + kvh) * d;
        let (kt, vt) = (&mut blk.kt[c..], &mut blk.vt[c..]);
        let ks = &mut blk.ks[c * dp..c * dp + d];
        for (dd, ((x, y), o)) in inp.k[src..src + d].iter().zip(&inp.v[src..src + d]).zip(ks).enumerate() {
            let kv = x.to_f32();
            kt[dd * BC] = kv;
            vt[dd * BC] = y.to_f32();
            *o = scale * kv;
        }
    }
    blk.dk.fill(0.0);
    blk.dv.fill(0.0);
    blk.k_bad = blk.ks[..cols * dp].iter().any(|x| !x.is_finite());
}

/// Zeroes columns `col..col + BC` of the first `rows` rows of a `dz` panel (row stride `w`).
fn zero_cols(dz: &mut [f32], w: usize, rows: usize, col: usize) {
    for r in 0..rows {
        dz[r * w + col..r * w + col + BC].fill(0.0);
    }
}

/// One tile: key block `kb` (packed in `blk`) against the query block of `ctx`. Adds to the
/// block's dK/dV, adds its share of dQ into `w.tmp` (stores it there when `!dq_started`), and
/// when `dbias` is wanted leaves dZ in `w.dz` at column `dz_col` (every row of the block; 0 where
/// nothing is visible). Returns whether it gave dQ a share.
#[allow(clippy::too_many_arguments)]
fn tile<K: Isa, const EXT: bool, const DROP: bool>(w: &mut Work, blk: &mut KeyBlock, call: &CallCtx<'_, '_>, ctx: &RowsCtx<'_>, kb: usize, dz_col: usize, dq_started: bool, pf: Prefetch) -> bool {
    let (rows, d, dp, opts) = (ctx.rows, call.d, call.dp, call.opts);
    let j0 = kb * BC;
    let cols = BC.min(call.sk - j0);
    let (qblk, doblk) = (ctx.qblk, ctx.doblk);
    // SAFETY (all gemms below): extents match the buffers sized in run_impl.
    unsafe {
        K::gemm(Gemm { m: rows, n: BC, k: d, a: qblk.as_ptr(), a_rs: dp, a_cs: 1, b: blk.kt.as_ptr(), ldb: BC, c: w.s.as_mut_ptr(), ldc: BC, accumulate: false, pf });
        K::gemm(Gemm { m: rows, n: BC, k: d, a: doblk.as_ptr(), a_rs: dp, a_cs: 1, b: blk.vt.as_ptr(), ldb: BC, c: w.dp.as_mut_ptr(), ldc: BC, accumulate: false, pf: Prefetch::NONE });
    }
    if DROP {
        // The forward's mask, regenerated for the whole tile before the rows: M·s of (b, hq,
        // i0 + r, j0..j0+BC) into row r of km, two rows per generator call where both have
        // anything visible (whole rows: the generator's fast path; keys a row does not see get
        // a finite scale that multiplies its zeros). Rows that see nothing get no draw.
        let mut spans = [(0usize, 0usize); BR];
        for (r, span) in spans[..rows].iter_mut().enumerate() {
            let rg = w.ranges[r];
            let visible = rg.start.saturating_sub(j0).min(cols) < rg.end.saturating_sub(j0).min(cols) && ctx.lse2[r].is_finite();
            *span = if visible { (0, BC) } else { (0, 0) };
        }
        // SAFETY: km is BR × BC; spans end at BC (a multiple of 4); j0 is a multiple of BC.
        unsafe { (call.keep_tile)(w.km.as_mut_ptr(), BC, &spans[..rows], &call.dropout, ctx.b as u32, ctx.hq as u32, ctx.i0 as u32, j0) };
    }
    let (mut clo, mut chi) = (BC, 0);
    for r in 0..rows {
        let rg = w.ranges[r];
        let a = rg.start.saturating_sub(j0).min(cols);
        let e = rg.end.saturating_sub(j0).min(cols);
        let l2 = ctx.lse2[r];
        let (srow, prow) = (&mut w.s[r * BC..(r + 1) * BC], &mut w.p[r * BC..(r + 1) * BC]);
        let dsp = if call.want_dz { w.dz[r * call.dz_w + dz_col..].as_mut_ptr() } else { std::ptr::null_mut() };
        if a >= e || !l2.is_finite() {
            // Masked in this tile, or a row the forward found fully masked.
            srow.fill(0.0);
            prow.fill(0.0);
            if call.want_dz {
                w.dz[r * call.dz_w + dz_col..r * call.dz_w + dz_col + BC].fill(0.0);
            }
            continue;
        }
        let i = ctx.i0 + r;
        if DROP {
            let ext = if EXT { call.prep.row(&w.panel, ctx.b, ctx.hq, r, i, ctx.qst + i as i64, kb, ctx.alibi2) } else { NO_EXT };
            // SAFETY: km's row r and the rows hold BC floats (dz too, from dz_col); a < e ≤ cols ≤ BC.
            unsafe {
                K::bwd_row_drop(srow.as_mut_ptr(), w.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), dsp, BC, a, e, opts.softcap, l2, ctx.di[r], ext, w.km[r * BC..].as_ptr());
            }
        } else if EXT {
            let ext = call.prep.row(&w.panel, ctx.b, ctx.hq, r, i, ctx.qst + i as i64, kb, ctx.alibi2);
            // SAFETY: rows of BC elements (the extras' row and dz too); a < e ≤ cols ≤ BC.
            unsafe {
                K::bwd_row_ext(srow.as_mut_ptr(), w.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), dsp, BC, a, e, opts.softcap, l2, ctx.di[r], ext);
            }
        } else {
            // SAFETY: rows of BC elements; a < e ≤ cols ≤ BC.
            unsafe {
                K::bwd_row(srow.as_mut_ptr(), w.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), BC, a, e, opts.softcap, l2, ctx.di[r]);
            }
        }
        clo = clo.min(a);
        chi = chi.max(e);
    }
    if clo >= chi {
        return false;
    }
    let kw = chi - clo;
    unsafe {
        // dV[clo..chi] += Pᵀ·dO (P ∘ M·s under dropout); dK[clo..chi] += dXᵀ·qs (A transposed by strides).
        K::gemm(Gemm { m: kw, n: dp, k: rows, a: w.p.as_ptr().add(clo), a_rs: 1, a_cs: BC, b: doblk.as_ptr(), ldb: dp, c: blk.dv.as_mut_ptr().add(clo * dp), ldc: dp, accumulate: true, pf: Prefetch::NONE });
        K::gemm(Gemm { m: kw, n: dp, k: rows, a: w.s.as_ptr().add(clo), a_rs: 1, a_cs: BC, b: qblk.as_ptr(), ldb: dp, c: blk.dk.as_mut_ptr().add(clo * dp), ldc: dp, accumulate: true, pf: Prefetch::NONE });
        // This tile's share of dQ = dX·(scale·K).
        if !blk.k_bad {
            K::gemm(Gemm { m: rows, n: dp, k: kw, a: w.s.as_ptr().add(clo), a_rs: BC, a_cs: 1, b: blk.ks.as_ptr().add(clo * dp), ldb: dp, c: w.tmp.as_mut_ptr(), ldc: dp, accumulate: dq_started, pf: Prefetch::NONE });
        }
    }
    if blk.k_bad {
        for r in 0..rows {
            let rg = w.ranges[r];
            let a = rg.start.saturating_sub(j0).min(cols);
            let e = rg.end.saturating_sub(j0).min(cols);
            if !dq_started {
                w.tmp[r * dp..(r + 1) * dp].fill(0.0);
            }
            if a >= e || !ctx.lse2[r].is_finite() {
                continue;
            }
            // SAFETY: s row r columns a..e < BC; ks rows a..e; tmp row r.
            unsafe {
                K::gemm(Gemm { m: 1, n: dp, k: e - a, a: w.s.as_ptr().add(r * BC + a), a_rs: BC, a_cs: 1, b: blk.ks.as_ptr().add(a * dp), ldb: dp, c: w.tmp.as_mut_ptr().add(r * dp), ldc: dp, accumulate: true, pf: Prefetch::NONE });
            }
        }
    }
    true
}
