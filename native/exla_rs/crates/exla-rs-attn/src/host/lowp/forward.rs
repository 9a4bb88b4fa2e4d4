//! The 16-bit forward on a dot-product unit: `forward.rs`'s task split and online softmax, with
//! the two products on the unit.
//!
//! - Once per call: K and V of every (batch, kv head) packed into the unit's B layouts
//!   ([`super::pack`]), in the input type (no rounding: they already are that type).
//! - One rayon task per (batch, head, block of [`BR`] query rows): Q's rows as the A operand
//!   (raw, unscaled: scaling before rounding to 16 bits would round twice), then per visible
//!   key tile: `S = Q·Kᵀ` on the unit, `S ·= scale·log2(e)` and the f32 row pass of the
//!   `Isa` family `K` (softcap, mask, max, `exp2`, sum), `P` rounded to the input type (as the
//!   CUDA tensor-core kernels do) and `O += P·V` on the unit, f32 accumulation throughout.
//!
//! The unit always multiplies whole 16-row groups; rows past a block's end are zeros in Q and
//! P, and their results are never read.

use rayon::prelude::*;

use super::super::kernels::{Isa, LOG2_E};
use super::super::forward::{finished_without_keys, QueryBlock};
use super::super::{finish_row, online_update, FwdInputs, FwdOutputs, HostElement, SyncPtr};
use super::pack::{self, padded_dim, BC};
use super::tile::{TILE_K, TILE_M, TILE_N};
use super::unit::{blocks, TileUnit, UnitScope};
use crate::{AttnOptions, AttnShape, KeyRange};

/// Query rows per task (a multiple of [`TILE_M`]).
pub(crate) const BR: usize = 64;

/// Per-thread scratch, reused across tasks.
struct Scratch {
    /// Q rows as A: `BR × dp`.
    qa: Vec<u16>,
    /// Scores, then probabilities: `BR × BC` f32.
    s: Vec<f32>,
    /// P rounded, as A: `BR × BC`.
    pa: Vec<u16>,
    /// Unnormalised output: `BR × dp` f32.
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    ranges: Vec<KeyRange>,
}

/// The packed K and V of one (batch, kv head) and the per-tile "V holds an inf/NaN" flags.
struct KvHead<'a> {
    kt: &'a [u16],
    vt: &'a [u16],
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
    let per_head = ntk * BC * dp;

    let mut kt = vec![0u16; batch * hkv * per_head];
    let mut vt = vec![0u16; batch * hkv * per_head];
    kt.par_chunks_mut(per_head).zip(vt.par_chunks_mut(per_head)).enumerate().for_each(|(bh, (kt, vt))| {
        let (b, kvh) = (bh / hkv, bh % hkv);
        let at = |j: usize| ((b * sk + j) * hkv + kvh) * d;
        pack::pack_kt(elem, kt, sk, d, dp, |j| &inp.k[at(j)..at(j) + d]);
        pack::pack_vt(elem, vt, sk, d, dp, |j| &inp.v[at(j)..at(j) + d]);
    });
    // Per (batch·kv head, key tile): an inf/NaN in V? Then P's exact zeros (masked keys) must
    // not meet it (0·inf = NaN), and that tile's P·V goes row by row over visible keys only.
    let vbad: Vec<bool> = vt.par_chunks(BC * dp).map(|t| t.iter().any(|&x| !pack::value(elem, x).is_finite())).collect();

    let nqb = sq.div_ceil(BR);
    let o_ptr = SyncPtr(out.o.as_mut_ptr());
    let lse_ptr = SyncPtr(out.lse.as_mut_ptr());
    let (kt, vt, vbad) = (&kt[..], &vt[..], &vbad[..]);
    (0..batch * h * nqb).into_par_iter().for_each_init(
        || Scratch { qa: vec![0; BR * dp], s: vec![0.0; BR * BC], pa: vec![0; BR * BC], o: vec![0.0; BR * dp], m: vec![0.0; BR], l: vec![0.0; BR], ranges: Vec::with_capacity(BR) },
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
                scr.pa[..groups * TILE_M * BC].fill(0);
                for r in 0..rows {
                    let src = ((b * sq + i0 + r) * h + hq) * d;
                    for (a, x) in scr.qa[r * dp..r * dp + d].iter_mut().zip(&inp.q[src..src + d]) {
                        *a = pack::bits(elem, x.to_f32());
                    }
                }
                scr.o[..groups * TILE_M * dp].fill(0.0);
                let kv = KvHead { kt: &kt[bkv * per_head..(bkv + 1) * per_head], vt: &vt[bkv * per_head..(bkv + 1) * per_head], vbad: &vbad[bkv * ntk..(bkv + 1) * ntk] };
                // SAFETY: the dispatcher offers U only where it runs (`lowp::offered`); the
                // scope ends (AMX: tilerelease) before this task returns or unwinds.
                let _unit = unsafe { UnitScope::<U>::enter() };
                for tile in block.start / BC..block.end.div_ceil(BC) {
                    step::<U, K>(scr, opts, rows, dp, d, tile, &kv);
                }
            }

            // SAFETY: task (b, hq, qb) alone writes o[b, i0..i0+rows, hq, :] and
            // lse[b, hq, i0..i0+rows]; all indices are < the checked lengths.
            unsafe {
                for r in 0..rows {
                    let dst = std::slice::from_raw_parts_mut(o_ptr.get().add(((b * sq + i0 + r) * h + hq) * d), d);
                    let lse = &mut *lse_ptr.get().add((b * h + hq) * sq + i0 + r);
                    finish_row(dst, lse, &scr.o[r * dp..r * dp + d], scr.m[r], scr.l[r]);
                }
            }
        },
    );
}

/// One key tile for one block of query rows: `S = Q·Kᵀ` on the unit, the online-softmax update
/// of every row in f32, `P` rounded, `O += P·V` on the unit.
fn step<U: TileUnit, K: Isa>(scr: &mut Scratch, opts: &AttnOptions, rows: usize, dp: usize, d: usize, tile: usize, kv: &KvHead<'_>) {
    let elem = U::ELEM;
    let j0 = tile * BC;
    let groups = rows.div_ceil(TILE_M);
    let kt = &kv.kt[tile * BC * dp..(tile + 1) * BC * dp];
    let vt = &kv.vt[tile * BC * dp..(tile + 1) * BC * dp];
    // SAFETY: qa holds `groups` 16-row groups of dp elements (dp/32 steps), kt BC/16 panels of
    // dp/2 pair-rows, s the groups' rows of BC f32: all inside the buffers.
    unsafe { blocks::<U>(scr.qa.as_ptr(), dp, kt.as_ptr(), dp * TILE_N, scr.s.as_mut_ptr(), BC, groups, BC / TILE_N, dp / TILE_K, false) };
    // Scores in exp2 units, as the row kernels take them.
    let qscale = opts.scale * LOG2_E;
    let mut any = false;
    for r in 0..rows {
        let rg = scr.ranges[r];
        let a = rg.start.saturating_sub(j0).min(BC);
        let b = rg.end.saturating_sub(j0).min(BC);
        let srow = &mut scr.s[r * BC..(r + 1) * BC];
        let prow = &mut scr.pa[r * BC..(r + 1) * BC];
        if a >= b {
            // Nothing visible in this tile: the row adds nothing to O.
            prow.fill(0);
            continue;
        }
        for x in srow.iter_mut() {
            *x *= qscale;
        }
        // SAFETY: srow has BC elements, a < b ≤ BC.
        let (m_new, sum) = unsafe { K::fwd_row(srow.as_mut_ptr(), BC, a, b, opts.softcap, scr.m[r]) };
        online_update(&mut scr.o[r * dp..(r + 1) * dp], &mut scr.m[r], &mut scr.l[r], m_new, sum);
        for (pb, &p) in prow.iter_mut().zip(srow.iter()) {
            *pb = pack::bits(elem, p);
        }
        any = true;
    }
    if !any {
        return;
    }
    if kv.vbad[tile] {
        // Each row multiplies only the keys it sees, so a masked key's inf/NaN in V reaches
        // no row (a visible one reaches the rows that see it, as it should).
        for r in 0..rows {
            let rg = scr.ranges[r];
            let (a, b) = (rg.start.saturating_sub(j0).min(BC), rg.end.saturating_sub(j0).min(BC));
            let orow = &mut scr.o[r * dp..r * dp + d];
            for jt in a..b {
                let p = pack::value(elem, scr.pa[r * BC + jt]);
                for (dd, o) in orow.iter_mut().enumerate() {
                    *o += p * pack::value(elem, pack::vt_at(vt, jt, dd));
                }
            }
        }
        return;
    }
    // SAFETY: pa holds `groups` 16-row groups of BC elements (BC/32 steps), vt dp/16 panels of
    // BC/2 pair-rows, o the groups' rows of dp f32: all inside the buffers.
    unsafe { blocks::<U>(scr.pa.as_ptr(), BC, vt.as_ptr(), BC * TILE_N, scr.o.as_mut_ptr(), dp, groups, dp / TILE_N, BC / TILE_K, true) };
}
