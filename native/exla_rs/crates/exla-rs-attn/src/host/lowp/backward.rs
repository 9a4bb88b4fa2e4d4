//! The 16-bit backward on a dot-product unit, for plain calls (no optional operands, no
//! dropout) with finite inputs: `backward.rs`'s FlashAttention-2 order with group 1, i.e. one
//! rayon task per (batch, kv head, key tile) owning its dK/dV rows, looping over the query heads
//! of its GQA group and the query blocks that see the tile; dQ is summed per (batch, head, query
//! block) under a mutex.
//!
//! The five products run on the unit: `S = Q·Kᵀ`, `dP = dO·Vᵀ` (reduction over d),
//! `dV += Pᵀ·dO`, `dK += dXᵀ·Q` (reduction over the block's query rows), `dQ += dX·K`
//! (reduction over the tile's keys). `P` and `dX` are rounded to the input type before they
//! are multiplied (as the CUDA tensor-core kernels do); the row pass (`P`, `dX` from `lse`, `Δ`,
//! softcap) is the f32 `Isa::bwd_row`; accumulation is f32. `scale` is applied in f32: to S
//! before the row pass, to dK and dQ when they are written (their operands are the raw inputs,
//! which a pre-scaled 16-bit copy would round again).
//!
//! Packed operands ([`super::pack`] layouts; a query block is padded to [`BR`] rows, which is
//! also [`BC`], so the key-tile packers serve query blocks too):
//! - per call, per (batch, head): Q and dO row-major (A of `S`, `dP`), and per query block in
//!   VNNI pairs along the rows (B of `dK`, `dV`);
//! - per task: K and V as the B of `S`, `dP` (`pack_kt`), K in VNNI pairs along the keys (B of
//!   `dQ`, `pack_vt`).

use std::sync::Mutex;

use rayon::prelude::*;

use super::super::kernels::{Isa, LOG2_E};
use super::super::{BwdInputs, BwdOutputs, HostElement, SyncPtr};
use super::forward::BR;
use super::pack::{self, padded_dim, BC};
use super::tile::{TILE_K, TILE_M, TILE_N};
use super::unit::{blocks, TileUnit, UnitScope};
use crate::{AttnOptions, AttnShape, KeyRange};

// Query blocks reuse the key-tile packers and tile loops.
const _: () = assert!(BR == BC && BR.is_multiple_of(TILE_K));

/// Whether the lowp backward takes these operands: all finite. A NaN/inf needs the f32 path's
/// row-by-row products, which keep it away from the keys/rows that do not see it.
pub(crate) fn takes<T: HostElement>(inp: &BwdInputs<'_, T>) -> bool {
    [inp.q, inp.k, inp.v, inp.o, inp.d_o].iter().all(|x| x.iter().all(|v| v.to_f32().is_finite()))
}

/// One (batch, head)'s packed query-side operands.
struct QueryPacks {
    /// Q, dO row-major, `nqb·BR × dp` (rows past Sq are 0).
    qa: Vec<u16>,
    doa: Vec<u16>,
    /// Q, dO per query block in VNNI pairs along the rows: `nqb × BR·dp`.
    qv: Vec<u16>,
    dov: Vec<u16>,
}

/// Per-thread scratch.
struct Scratch {
    /// The task's key tile: K, V as B of S, dP; K as B of dQ.
    kt: Vec<u16>,
    vt: Vec<u16>,
    kv: Vec<u16>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    s: Vec<f32>,
    dp: Vec<f32>,
    p: Vec<f32>,
    /// Pᵀ, dXᵀ (A of dV, dK: `BC × BR`) and dX (A of dQ: `BR × BC`), rounded.
    pt: Vec<u16>,
    dxt: Vec<u16>,
    dxa: Vec<u16>,
    /// This (head, query block)'s share of dQ.
    dq: Vec<f32>,
    ranges: Vec<KeyRange>,
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
    let nkb = sk.div_ceil(BC);
    let sqp = nqb * BR;

    // Δ = rowsum(dO∘O) and lse·log2(e) per row; the query-side packs per (batch, head).
    let mut di = vec![0f32; batch * h * sq];
    let mut lse2 = vec![0f32; batch * h * sq];
    let mut packs: Vec<QueryPacks> = (0..batch * h).map(|_| QueryPacks { qa: vec![0; sqp * dp], doa: vec![0; sqp * dp], qv: vec![0; sqp * dp], dov: vec![0; sqp * dp] }).collect();
    packs.par_iter_mut().zip(di.par_chunks_mut(sq).zip(lse2.par_chunks_mut(sq))).enumerate().for_each(|(bhq, (pk, (di, lse2)))| {
        let (b, hq) = (bhq / h, bhq % h);
        let at = |i: usize| ((b * sq + i) * h + hq) * d;
        for i in 0..sq {
            lse2[i] = inp.lse[bhq * sq + i] * LOG2_E;
            let src = at(i);
            di[i] = inp.d_o[src..src + d].iter().zip(&inp.o[src..src + d]).map(|(x, y)| x.to_f32() * y.to_f32()).sum();
            for dd in 0..d {
                pk.qa[i * dp + dd] = pack::bits(elem, inp.q[src + dd].to_f32());
                pk.doa[i * dp + dd] = pack::bits(elem, inp.d_o[src + dd].to_f32());
            }
        }
        // The block-of-rows VNNI packs: block qb's rows play the keys of one tile.
        for qb in 0..nqb {
            let (i0, rows) = (qb * BR, BR.min(sq - qb * BR));
            let blk = qb * BR * dp..(qb + 1) * BR * dp;
            pack::pack_vt(elem, &mut pk.qv[blk.clone()], rows, d, dp, |r| &inp.q[at(i0 + r)..at(i0 + r) + d]);
            pack::pack_vt(elem, &mut pk.dov[blk], rows, d, dp, |r| &inp.d_o[at(i0 + r)..at(i0 + r) + d]);
        }
    });
    let dq_acc: Vec<Mutex<Vec<f32>>> = (0..batch * h * nqb).map(|_| Mutex::new(vec![0f32; BR * dp])).collect();

    let dk_ptr = SyncPtr(out.dk.as_mut_ptr());
    let dv_ptr = SyncPtr(out.dv.as_mut_ptr());
    let (packs, di, lse2, dq_acc) = (&packs[..], &di[..], &lse2[..], &dq_acc[..]);
    (0..batch * hkv * nkb).into_par_iter().for_each_init(
        || Scratch {
            kt: vec![0; BC * dp],
            vt: vec![0; BC * dp],
            kv: vec![0; BC * dp],
            dk: vec![0.0; BC * dp],
            dv: vec![0.0; BC * dp],
            s: vec![0.0; BR * BC],
            dp: vec![0.0; BR * BC],
            p: vec![0.0; BR * BC],
            pt: vec![0; BC * BR],
            dxt: vec![0; BC * BR],
            dxa: vec![0; BR * BC],
            dq: vec![0.0; BR * dp],
            ranges: Vec::with_capacity(BR),
        },
        |scr, task| {
            let (bkv, kb) = (task / nkb, task % nkb);
            let (b, kvh) = (bkv / hkv, bkv % hkv);
            let j0 = kb * BC;
            let cols = BC.min(sk - j0);
            let at = |j: usize| ((b * sk + j0 + j) * hkv + kvh) * d;
            for buf in [&mut scr.kt, &mut scr.vt, &mut scr.kv] {
                buf.fill(0);
            }
            pack::pack_kt(elem, &mut scr.kt, cols, d, dp, |j| &inp.k[at(j)..at(j) + d]);
            pack::pack_kt(elem, &mut scr.vt, cols, d, dp, |j| &inp.v[at(j)..at(j) + d]);
            pack::pack_vt(elem, &mut scr.kv, cols, d, dp, |j| &inp.k[at(j)..at(j) + d]);
            scr.dk.fill(0.0);
            scr.dv.fill(0.0);
            let (kvl, qst) = (inp.kv_len[b], inp.q_start[b]);
            // SAFETY: the dispatcher offers U only where it runs; the scope ends before return.
            let _unit = unsafe { UnitScope::<U>::enter() };
            for hq in kvh * g..(kvh + 1) * g {
                let bhq = b * h + hq;
                for qb in 0..nqb {
                    let (i0, rows) = (qb * BR, BR.min(sq - qb * BR));
                    let block = KeyRange::for_rows(opts, sk, kvl, qst, i0, i0 + rows);
                    if block.is_empty() || block.end <= j0 || block.start >= j0 + cols {
                        continue;
                    }
                    scr.ranges.clear();
                    scr.ranges.extend((0..rows).map(|r| KeyRange::for_row(opts, sk, kvl, qst, i0 + r)));
                    let rowsl = bhq * sq + i0..bhq * sq + i0 + rows;
                    if tile::<U, K>(scr, opts, &packs[bhq], qb, rows, j0, cols, dp, &lse2[rowsl.clone()], &di[rowsl]) {
                        let mut acc = dq_acc[bhq * nqb + qb].lock().unwrap_or_else(|e| e.into_inner());
                        for (x, y) in acc.iter_mut().zip(&scr.dq[..rows * dp]) {
                            *x += *y;
                        }
                    }
                }
            }
            // SAFETY: task (b, kvh, kb) alone writes keys j0..j0+cols of kv head kvh in batch b.
            unsafe {
                for c in 0..cols {
                    let dst = at(c);
                    let dk = std::slice::from_raw_parts_mut(dk_ptr.get().add(dst), d);
                    let dv = std::slice::from_raw_parts_mut(dv_ptr.get().add(dst), d);
                    for (o, x) in dk.iter_mut().zip(&scr.dk[c * dp..c * dp + d]) {
                        *o = T::from_f32(opts.scale * x);
                    }
                    for (o, x) in dv.iter_mut().zip(&scr.dv[c * dp..c * dp + d]) {
                        *o = T::from_f32(*x);
                    }
                }
            }
        },
    );

    let dq_ptr = SyncPtr(out.dq.as_mut_ptr());
    (0..batch * h * nqb).into_par_iter().for_each(|t| {
        let (bhq, qb) = (t / nqb, t % nqb);
        let (b, hq) = (bhq / h, bhq % h);
        let rows = BR.min(sq - qb * BR);
        let acc = dq_acc[t].lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: block (b, hq, qb) alone writes dq[b, qb·BR.., hq, :].
        unsafe {
            for r in 0..rows {
                let dst = std::slice::from_raw_parts_mut(dq_ptr.get().add(((b * sq + qb * BR + r) * h + hq) * d), d);
                for (o, x) in dst.iter_mut().zip(&acc[r * dp..r * dp + d]) {
                    *o = T::from_f32(opts.scale * x);
                }
            }
        }
    });
}

/// One key tile against one query block: the five products. Adds to the tile's dK/dV, leaves
/// the block's dQ share (unscaled) in `scr.dq`. Returns whether any row saw a key of the tile.
#[allow(clippy::too_many_arguments)]
fn tile<U: TileUnit, K: Isa>(scr: &mut Scratch, opts: &AttnOptions, qp: &QueryPacks, qb: usize, rows: usize, j0: usize, cols: usize, dp: usize, lse2: &[f32], di: &[f32]) -> bool {
    let elem = U::ELEM;
    let mg = rows.div_ceil(TILE_M);
    let (qa, doa) = (&qp.qa[qb * BR * dp..(qb + 1) * BR * dp], &qp.doa[qb * BR * dp..(qb + 1) * BR * dp]);
    let (qv, dov) = (&qp.qv[qb * BR * dp..(qb + 1) * BR * dp], &qp.dov[qb * BR * dp..(qb + 1) * BR * dp]);
    // SAFETY: qa/doa hold BR ≥ 16·mg rows of dp; kt/vt BC/16 panels of dp·16; s/dp BR × BC.
    unsafe {
        blocks::<U>(qa.as_ptr(), dp, scr.kt.as_ptr(), dp * TILE_N, scr.s.as_mut_ptr(), BC, mg, BC / TILE_N, dp / TILE_K, false);
        blocks::<U>(doa.as_ptr(), dp, scr.vt.as_ptr(), dp * TILE_N, scr.dp.as_mut_ptr(), BC, mg, BC / TILE_N, dp / TILE_K, false);
    }
    scr.pt.fill(0);
    scr.dxt.fill(0);
    scr.dxa.fill(0);
    let mut any = false;
    for r in 0..rows {
        let rg = scr.ranges[r];
        let a = rg.start.saturating_sub(j0).min(cols);
        let e = rg.end.saturating_sub(j0).min(cols);
        if a >= e || !lse2[r].is_finite() {
            // Masked in this tile, or a row the forward found fully masked: zeros (as filled).
            continue;
        }
        let (srow, prow) = (&mut scr.s[r * BC..(r + 1) * BC], &mut scr.p[r * BC..(r + 1) * BC]);
        for x in srow.iter_mut() {
            *x *= opts.scale;
        }
        // SAFETY: rows of BC elements; a < e ≤ cols ≤ BC.
        unsafe { K::bwd_row(srow.as_mut_ptr(), scr.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), BC, a, e, opts.softcap, lse2[r], di[r]) };
        for c in a..e {
            let (pb, xb) = (pack::bits(elem, prow[c]), pack::bits(elem, srow[c]));
            scr.pt[c * BR + r] = pb;
            scr.dxt[c * BR + r] = xb;
            scr.dxa[r * BC + c] = xb;
        }
        any = true;
    }
    if !any {
        return false;
    }
    // SAFETY: pt/dxt are BC × BR (BC/16 row groups, BR/32 steps), qv/dov dp/16 panels of
    // BR·16, dk/dv BC × dp; dxa BR × BC (mg groups, BC/32 steps), kv dp/16 panels of BC·16,
    // dq BR × dp.
    unsafe {
        blocks::<U>(scr.pt.as_ptr(), BR, dov.as_ptr(), BR * TILE_N, scr.dv.as_mut_ptr(), dp, BC / TILE_M, dp / TILE_N, BR / TILE_K, true);
        blocks::<U>(scr.dxt.as_ptr(), BR, qv.as_ptr(), BR * TILE_N, scr.dk.as_mut_ptr(), dp, BC / TILE_M, dp / TILE_N, BR / TILE_K, true);
        blocks::<U>(scr.dxa.as_ptr(), BC, scr.kv.as_ptr(), BC * TILE_N, scr.dq.as_mut_ptr(), dp, mg, dp / TILE_N, BC / TILE_K, false);
    }
    true
}
