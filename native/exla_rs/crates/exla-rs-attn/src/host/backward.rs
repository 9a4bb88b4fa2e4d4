//! Backward pass (FlashAttention-2 order): one rayon task per (batch, kv head, block of `BC`
//! keys). A task owns its dK/dV rows outright, loops over the query heads of its GQA group and
//! the query blocks that can see its keys, recomputes `P` from the saved `lse`, and adds its
//! share of dQ into an f32 accumulator per (batch, head, query block) under that block's mutex.
//! This keeps both cores busy even for B·Hkv = 1 (Sk/BC tasks) with no S×S buffer; a lock is
//! held for `BR·D` additions against `~5·BR·BC·D` FMAs of work, so contention is negligible.
//!
//! Scores are taken w.r.t. `x = qs·k` with `qs = scale·q` packed once, so `dK = dXᵀ·qs` and
//! `dQ = dX·(scale·k)` need no extra scaling pass.

use std::sync::Mutex;

use rayon::prelude::*;

use super::dropout::{keep_row_fn, NO_DROPOUT, STORE};
use super::extra::{prefetch_span, Prep};
use super::forward::{BC, BR};
use super::kernels::{Gemm, Isa, LOG2_E, NO_EXT, PAD};
use super::{round_up, BwdInputs, BwdOutputs, HostElement, SyncPtr};
use crate::{AttnOptions, AttnShape, BiasGrad, Extras, KeyRange};

struct Scratch {
    kt: Vec<f32>,
    vt: Vec<f32>,
    ks: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    s: Vec<f32>,
    dp: Vec<f32>,
    p: Vec<f32>,
    tmp: Vec<f32>,
    ranges: Vec<KeyRange>,
    /// The extras' additive row (bias conversion, bias + key mask).
    e: Vec<f32>,
    /// dZ of the tile, when the bias gradient is wanted and the softcap makes dX differ from it.
    ds: Vec<f32>,
    /// The dropout keep scales of one tile row (`scale` or 0), regenerated from the key.
    km: Vec<f32>,
}

/// The f32 accumulator of `dbias` (the result itself when it is f32) and the locks that make
/// tasks sharing a broadcast bias entry add into it one at a time.
struct BiasAcc {
    ptr: SyncPtr<f32>,
    dims: [usize; 4],
    /// The bias has a row per query (`Sqb = Sq`) / a column per key (`Skb = Sk`).
    q_full: bool,
    k_full: bool,
    /// One lock per (bias batch·head, query block or 0, key block or 0): the regions they guard
    /// are disjoint, and tasks that write the same entries (a broadcast batch, head or sequence
    /// dim) take the same lock.
    locks: Vec<Mutex<()>>,
    nql: usize,
    nkl: usize,
}

pub(super) fn run<T: HostElement, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>, ex: &Extras<'_>, dbias: Option<BiasGrad<'_>>) {
    // One instance per combination: without optional operands the tile loop is exactly the
    // original one, and without dropout (rate 0) no generator code is in it.
    match (ex.changes_scores(), ex.dropout.is_some()) {
        (false, false) => run_impl::<T, K, false, false>(shape, opts, inp, out, ex, None),
        (true, false) => run_impl::<T, K, true, false>(shape, opts, inp, out, ex, dbias),
        (false, true) => run_impl::<T, K, false, true>(shape, opts, inp, out, ex, None),
        (true, true) => run_impl::<T, K, true, true>(shape, opts, inp, out, ex, dbias),
    }
}

fn run_impl<T: HostElement, K: Isa, const EXT: bool, const DROP: bool>(shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>, ex: &Extras<'_>, mut dbias: Option<BiasGrad<'_>>) {
    let AttnShape { batch, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d } = *shape;
    // dbias is a sum: zero first, so every early return below leaves it right.
    let mut dbias_tmp: Vec<f32> = Vec::new();
    let dbias_ptr: Option<*mut f32> = match dbias.as_mut() {
        None => None,
        Some(BiasGrad::F32(x)) => {
            // In parallel: a full bias is S²·H floats, and this is its first touch.
            x.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
            Some(x.as_mut_ptr())
        }
        Some(g) => {
            dbias_tmp = vec![0.0; g.len()];
            Some(dbias_tmp.as_mut_ptr())
        }
    };
    if batch == 0 {
        finish_dbias(dbias, &dbias_tmp);
        return;
    }
    if sk == 0 || sq == 0 {
        finish_dbias(dbias, &dbias_tmp);
        // Nothing is visible anywhere: all gradients are 0.
        out.dq.fill(T::from_f32(0.0));
        out.dk.fill(T::from_f32(0.0));
        out.dv.fill(T::from_f32(0.0));
        return;
    }
    let g = shape.group();
    let dp = round_up(d, PAD);
    let nqb = sq.div_ceil(BR);
    let nkb = sk.div_ceil(BC);

    // Per (b, head) packs: qs = scale·q and dO as padded f32 rows; Δ = rowsum(dO∘O); lse·log2(e).
    let mut qs = vec![0f32; batch * h * sq * dp];
    let mut dop = vec![0f32; batch * h * sq * dp];
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
                if lse2[i] == f32::NEG_INFINITY {
                    // A row the forward found fully masked contributes nothing: its q and dO stay
                    // 0 here, so a NaN/inf in them cannot reach dK/dV through the gemms' P = 0.
                    continue;
                }
                for (o, x) in qs[i * dp..i * dp + d].iter_mut().zip(&inp.q[src..src + d]) {
                    *o = opts.scale * x.to_f32();
                }
                let mut acc = 0f32;
                for ((o, x), y) in dop[i * dp..i * dp + d].iter_mut().zip(&inp.d_o[src..src + d]).zip(&inp.o[src..src + d]) {
                    *o = x.to_f32();
                    acc += *o * y.to_f32();
                }
                di[i] = acc;
            }
        });
    let dq_acc: Vec<Mutex<Vec<f32>>> =
        (0..batch * h * nqb).map(|t| Mutex::new(vec![0f32; BR.min(sq - (t % nqb) * BR) * dp])).collect();

    let prep = if EXT { Prep::new(shape, ex) } else { Prep::new(shape, &Extras::default()) };
    let prep = &prep;
    let dropout = ex.dropout.unwrap_or(NO_DROPOUT);
    let keep_row = keep_row_fn::<STORE>(K::SCALAR);
    let acc = match (dbias_ptr, ex.bias) {
        (Some(ptr), Some(bias)) => {
            let dims = bias.dims;
            let (q_full, k_full) = (dims[2] == sq, dims[3] == sk);
            let (nql, nkl) = (if q_full { nqb } else { 1 }, if k_full { nkb } else { 1 });
            let locks = (0..dims[0] * dims[1] * nql * nkl).map(|_| Mutex::new(())).collect();
            Some(BiasAcc { ptr: SyncPtr(ptr), dims, q_full, k_full, locks, nql, nkl })
        }
        _ => None,
    };
    let acc = acc.as_ref();
    // With a softcap the kernel's dX is dZ·tanh'; dbias needs dZ itself, kept in its own tile.
    let ds_apart = acc.is_some() && opts.softcap > 0.0;

    let dk_ptr = SyncPtr(out.dk.as_mut_ptr());
    let dv_ptr = SyncPtr(out.dv.as_mut_ptr());
    let (qs, dop, di, lse2, dq_acc) = (&qs[..], &dop[..], &di[..], &lse2[..], &dq_acc[..]);
    (0..batch * hkv * nkb).into_par_iter().for_each_init(
        || Scratch {
            kt: vec![0.0; d * BC],
            vt: vec![0.0; d * BC],
            ks: vec![0.0; BC * dp],
            dk: vec![0.0; BC * dp],
            dv: vec![0.0; BC * dp],
            s: vec![0.0; BR * BC],
            dp: vec![0.0; BR * BC],
            p: vec![0.0; BR * BC],
            tmp: vec![0.0; BR * dp],
            ranges: Vec::with_capacity(BR),
            e: if EXT { vec![0.0; BC] } else { Vec::new() },
            ds: if ds_apart { vec![0.0; BR * BC] } else { Vec::new() },
            km: if DROP { vec![0.0; BC] } else { Vec::new() },
        },
        |scr, task| {
            let (bkv, kb) = (task / nkb, task % nkb);
            let (b, kvh) = (bkv / hkv, bkv % hkv);
            let j0 = kb * BC;
            let cols = BC.min(sk - j0);
            let (kvl, qst) = (inp.kv_len[b], inp.q_start[b]);

            // Pack this key block: K^T and V^T (B operands of S and dP) and scale·K (of dQ).
            // Columns/rows past `cols` are zeroed: the scratch may hold a previous task's tile.
            scr.kt.fill(0.0);
            scr.vt.fill(0.0);
            scr.ks.fill(0.0);
            for c in 0..cols {
                let src = ((b * sk + j0 + c) * hkv + kvh) * d;
                let (kt, vt) = (&mut scr.kt[c..], &mut scr.vt[c..]);
                let ks = &mut scr.ks[c * dp..c * dp + d];
                for (dd, ((x, y), o)) in inp.k[src..src + d].iter().zip(&inp.v[src..src + d]).zip(ks).enumerate() {
                    let kv = x.to_f32();
                    kt[dd * BC] = kv;
                    vt[dd * BC] = y.to_f32();
                    *o = opts.scale * kv;
                }
            }
            scr.dk.fill(0.0);
            scr.dv.fill(0.0);
            // An inf/NaN in this block's K: dQ = dX·(scale·K) then goes row by row over the keys each
            // row sees, since dX's exact zeros at hidden keys times inf would be NaN.
            let k_bad = scr.ks[..cols * dp].iter().any(|x| !x.is_finite());

            // key_mask hides every key of this block from batch row b: dK = dV = 0 here.
            let heads = if EXT && !prep.tile_visible(b, kb) { 0..0 } else { kvh * g..(kvh + 1) * g };
            for hq in heads {
                let alibi2 = if EXT { prep.alibi2(hq) } else { 0.0 };
                let bhq = b * h + hq;
                for qb in 0..nqb {
                    let i0 = qb * BR;
                    let rows = BR.min(sq - i0);
                    let block = KeyRange::for_rows(opts, sk, kvl, qst, i0, i0 + rows);
                    if block.is_empty() || block.end <= j0 || block.start >= j0 + cols {
                        continue;
                    }
                    let row0 = bhq * sq + i0;
                    if EXT {
                        // The tile's bias rows (and dbias rows) load while the GEMMs run.
                        prep.prefetch_bias(b, hq, i0, rows, j0);
                        if let Some(acc) = acc {
                            prefetch_dbias(acc, b, hq, i0, rows, j0, cols);
                        }
                    }
                    scr.ranges.clear();
                    scr.ranges.extend((0..rows).map(|r| KeyRange::for_row(opts, sk, kvl, qst, i0 + r)));
                    let qblk = &qs[row0 * dp..(row0 + rows) * dp];
                    let doblk = &dop[row0 * dp..(row0 + rows) * dp];
                    // SAFETY (all gemms below): extents match the buffers sized above.
                    unsafe {
                        K::gemm(Gemm { m: rows, n: BC, k: d, a: qblk.as_ptr(), a_rs: dp, a_cs: 1, b: scr.kt.as_ptr(), ldb: BC, c: scr.s.as_mut_ptr(), ldc: BC, accumulate: false });
                        K::gemm(Gemm { m: rows, n: BC, k: d, a: doblk.as_ptr(), a_rs: dp, a_cs: 1, b: scr.vt.as_ptr(), ldb: BC, c: scr.dp.as_mut_ptr(), ldc: BC, accumulate: false });
                    }
                    let (mut clo, mut chi) = (BC, 0);
                    for r in 0..rows {
                        let rg = scr.ranges[r];
                        let a = rg.start.saturating_sub(j0).min(cols);
                        let e = rg.end.saturating_sub(j0).min(cols);
                        let l2 = lse2[row0 + r];
                        let (srow, prow) = (&mut scr.s[r * BC..(r + 1) * BC], &mut scr.p[r * BC..(r + 1) * BC]);
                        if a >= e || !l2.is_finite() {
                            // Masked in this tile, or a row the forward found fully masked.
                            srow.fill(0.0);
                            prow.fill(0.0);
                            if ds_apart {
                                scr.ds[r * BC..(r + 1) * BC].fill(0.0);
                            }
                            continue;
                        }
                        if DROP {
                            // The forward's mask, regenerated: M of (b, hq, i, j0..j0+BC).
                            let i = i0 + r;
                            let ext = if EXT { prep.row(&mut scr.e, b, hq, i, qst as i64 + i as i64, j0, cols, alibi2) } else { NO_EXT };
                            let dsp = if ds_apart { scr.ds[r * BC..].as_mut_ptr() } else { std::ptr::null_mut() };
                            // SAFETY: km and the rows hold BC floats; j0 is a multiple of BC (so of 4);
                            // a < e ≤ cols ≤ BC.
                            unsafe {
                                keep_row(scr.km.as_mut_ptr(), &dropout, b as u32, hq as u32, i as u32, j0, BC);
                                K::bwd_row_drop(srow.as_mut_ptr(), scr.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), dsp, BC, a, e, opts.softcap, l2, di[row0 + r], ext, scr.km.as_ptr());
                            }
                        } else if EXT {
                            let i = i0 + r;
                            let ext = prep.row(&mut scr.e, b, hq, i, qst as i64 + i as i64, j0, cols, alibi2);
                            let dsp = if ds_apart { scr.ds[r * BC..].as_mut_ptr() } else { std::ptr::null_mut() };
                            // SAFETY: rows of BC elements (the extras' row too); a < e ≤ cols ≤ BC.
                            unsafe {
                                K::bwd_row_ext(srow.as_mut_ptr(), scr.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), dsp, BC, a, e, opts.softcap, l2, di[row0 + r], ext);
                            }
                        } else {
                            // SAFETY: rows of BC elements; a < e ≤ cols ≤ BC.
                            unsafe {
                                K::bwd_row(srow.as_mut_ptr(), scr.dp[r * BC..].as_ptr(), prow.as_mut_ptr(), BC, a, e, opts.softcap, l2, di[row0 + r]);
                            }
                        }
                        clo = clo.min(a);
                        chi = chi.max(e);
                    }
                    if clo >= chi {
                        continue;
                    }
                    let kw = chi - clo;
                    unsafe {
                        // dV[clo..chi] += Pᵀ·dO (P ∘ M·s under dropout); dK[clo..chi] += dXᵀ·qs (A transposed by strides).
                        K::gemm(Gemm { m: kw, n: dp, k: rows, a: scr.p.as_ptr().add(clo), a_rs: 1, a_cs: BC, b: doblk.as_ptr(), ldb: dp, c: scr.dv.as_mut_ptr().add(clo * dp), ldc: dp, accumulate: true });
                        K::gemm(Gemm { m: kw, n: dp, k: rows, a: scr.s.as_ptr().add(clo), a_rs: 1, a_cs: BC, b: qblk.as_ptr(), ldb: dp, c: scr.dk.as_mut_ptr().add(clo * dp), ldc: dp, accumulate: true });
                        // This block's share of dQ = dX·(scale·K), added under the block's lock.
                        if !k_bad {
                            K::gemm(Gemm { m: rows, n: dp, k: kw, a: scr.s.as_ptr().add(clo), a_rs: BC, a_cs: 1, b: scr.ks.as_ptr().add(clo * dp), ldb: dp, c: scr.tmp.as_mut_ptr(), ldc: dp, accumulate: false });
                        }
                    }
                    if k_bad {
                        for r in 0..rows {
                            let rg = scr.ranges[r];
                            let a = rg.start.saturating_sub(j0).min(cols);
                            let e = rg.end.saturating_sub(j0).min(cols);
                            scr.tmp[r * dp..(r + 1) * dp].fill(0.0);
                            if a >= e || !lse2[row0 + r].is_finite() {
                                continue;
                            }
                            // SAFETY: s row r columns a..e < BC; ks rows a..e; tmp row r.
                            unsafe {
                                K::gemm(Gemm { m: 1, n: dp, k: e - a, a: scr.s.as_ptr().add(r * BC + a), a_rs: BC, a_cs: 1, b: scr.ks.as_ptr().add(a * dp), ldb: dp, c: scr.tmp.as_mut_ptr().add(r * dp), ldc: dp, accumulate: false });
                            }
                        }
                    }
                    if let Some(acc) = acc {
                        let dz = if ds_apart { &scr.ds[..] } else { &scr.s[..] };
                        add_dbias(acc, dz, b, hq, qb, kb, i0, rows, j0, clo, chi);
                    }
                    let mut acc = dq_acc[bhq * nqb + qb].lock().unwrap_or_else(|e| e.into_inner());
                    for (x, y) in acc.iter_mut().zip(&scr.tmp[..rows * dp]) {
                        *x += *y;
                    }
                }
            }

            // SAFETY: task (b, kvh, kb) alone writes rows j0..j0+cols of kv head kvh in batch b.
            unsafe {
                for c in 0..cols {
                    let dst = ((b * sk + j0 + c) * hkv + kvh) * d;
                    let dk = std::slice::from_raw_parts_mut(dk_ptr.get().add(dst), d);
                    let dv = std::slice::from_raw_parts_mut(dv_ptr.get().add(dst), d);
                    for (o, x) in dk.iter_mut().zip(&scr.dk[c * dp..c * dp + d]) {
                        *o = T::from_f32(*x);
                    }
                    for (o, x) in dv.iter_mut().zip(&scr.dv[c * dp..c * dp + d]) {
                        *o = T::from_f32(*x);
                    }
                }
            }
        },
    );

    finish_dbias(dbias, &dbias_tmp);

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

/// Adds one tile's dZ (rows `0..rows`, columns `clo..chi`; 0 elsewhere) into the bias entries
/// it reads, summing over the bias's broadcast dimensions.
#[allow(clippy::too_many_arguments)]
fn add_dbias(acc: &BiasAcc, dz: &[f32], b: usize, hq: usize, qb: usize, kb: usize, i0: usize, rows: usize, j0: usize, clo: usize, chi: usize) {
    let [bb, hb, sqb, skb] = acc.dims;
    let bh = (if bb == 1 { 0 } else { b }) * hb + if hb == 1 { 0 } else { hq };
    let lock = (bh * acc.nql + if acc.q_full { qb } else { 0 }) * acc.nkl + if acc.k_full { kb } else { 0 };
    let _guard = acc.locks[lock].lock().unwrap_or_else(|e| e.into_inner());
    let base = bh * sqb * skb;
    for r in 0..rows {
        let src = &dz[r * BC + clo..r * BC + chi];
        let row = base + if acc.q_full { (i0 + r) * skb } else { 0 };
        // SAFETY: row < Bb·Hb·Sqb·Skb entries and, per key, j0 + chi ≤ Sk = Skb; the lock held
        // is the only one guarding this (bias batch·head, query block, key block) region.
        unsafe {
            if acc.k_full {
                let dst = std::slice::from_raw_parts_mut(acc.ptr.get().add(row + j0 + clo), chi - clo);
                for (o, x) in dst.iter_mut().zip(src) {
                    *o += *x;
                }
            } else {
                *acc.ptr.get().add(row) += src.iter().sum::<f32>();
            }
        }
    }
}

/// The dbias rows [`add_dbias`] will update for this tile, requested ahead (see
/// [`Prep::prefetch_bias`]).
#[allow(clippy::too_many_arguments)]
fn prefetch_dbias(acc: &BiasAcc, b: usize, hq: usize, i0: usize, rows: usize, j0: usize, cols: usize) {
    let [bb, hb, sqb, skb] = acc.dims;
    if !acc.k_full {
        return;
    }
    let bh = (if bb == 1 { 0 } else { b }) * hb + if hb == 1 { 0 } else { hq };
    let nrows = if acc.q_full { rows } else { 1 };
    for r in 0..nrows {
        let row = bh * sqb * skb + if acc.q_full { (i0 + r) * skb } else { 0 };
        prefetch_span(acc.ptr.get() as *const u8, (row + j0) * 4, cols * 4);
    }
}

/// Rounds the f32 accumulator into an f16/bf16 `dbias` (an f32 one was accumulated in place).
fn finish_dbias(dbias: Option<BiasGrad<'_>>, tmp: &[f32]) {
    match dbias {
        Some(BiasGrad::F16(x)) => x.iter_mut().zip(tmp).for_each(|(o, v)| *o = half::f16::from_f32(*v)),
        Some(BiasGrad::BF16(x)) => x.iter_mut().zip(tmp).for_each(|(o, v)| *o = half::bf16::from_f32(*v)),
        _ => {}
    }
}
