//! Decode: a few query rows per sequence against a long key cache (text generation runs one row
//! per token). The prefill forward (`forward.rs`) packs every K and V to f32 tiles once per call
//! and gives each query head its own task, so a one-row call reads the cache `g` times (GQA) and
//! writes a converted copy of it first: bound by that copy, not by the one read the work needs.
//!
//! Here the cache is read once, in place and in its own type, as close to the machine's read
//! bandwidth as the kernels get (issue 35 part 4; on a 2-core Zen 3, 60-66% of it for f32 and
//! 50-57% for bf16, where the old path read 39-55% and 29-38%: bench/RESULTS.md):
//! - A task is (batch, chunk of keys) (flash-decoding's split over the keys, so a batch of one
//!   still fills every core), every kv head and the `R = g·Sq` query rows that read each.
//! - A chunk's K (and V) rows of every kv head are one contiguous run of the cache. Per
//!   sub-block of keys (`SUB_CACHE_BYTES` of K and V together, at most [`SUB`] keys) the scores
//!   ([`Isa::dec_scores`]) and then `P·V` ([`Isa::dec_pv`], into the task's f32 rows) read that
//!   run in place, in order (a key's row of every head before the next key), f16/bf16 widened in
//!   registers: no converted copy is written and read back, and each key vector is loaded once
//!   for up to 4 query rows (Q pre-scaled by `scale·log2(e)`). Between them the online-softmax
//!   row kernel runs on each row.
//! - bf16 is widened two vectors per load with no shuffle, its columns split even/odd
//!   ([`bf16_slot`]): Q is stored in that order, `o` is accumulated in it and put back by the
//!   merge. Half the widening operations, on the ports the FMAs use; with the scores' sums
//!   folded together (`store_hsum_4x2`) and the hints below into L2, bf16 decode went from
//!   8.1 / 38.7 ms to 6.8 / 27.3 ms at Sk = 4096 / 16384 (`host_bench decode`, best of 12
//!   alternated rounds on the 2-vCPU Emerald Rapids: 73% / 61% of the read bandwidth measured
//!   in the same minutes, 22.8 GB/s, to 87% / 86%).
//! - Each phase asks for the rows the next one reads (cache hints into L2, spread over its
//!   steps): V while the scores run, the next sub-block's K while `P·V` does. The hardware
//!   prefetchers alone stop at every 4 KiB page (a key of every head is one page at D = 128,
//!   f32) and run too little ahead for a core that also computes: without the hints the same
//!   code took 15% (f32) to 35% (bf16) longer here (2-core Zen 3).
//! - A head dim the vectors do not divide (D = 1, 8 on AVX-512, ...) is widened into padded f32
//!   scratch a sub-block at a time instead, and read from there by the same kernels.
//! - A second pass merges each row's chunks: `m = max m_c`, `l = Σ l_c·2^(m_c - m)`,
//!   `o = Σ o_c·2^(m_c - m) / l`, `lse = (m + log2 l)·ln 2`. A row that sees no key anywhere gets
//!   `o = 0`, `lse = -inf` (the contract's fully-masked row).
//!
//! Used for calls whose `Sq <= DECODE_MAX_ROWS`, without bias, ALiBi or dropout (a key mask is fine).

use rayon::prelude::*;

use super::kernels::{bf16_slot, Cache, HeadRows, Isa, Prefetch, RowExtra, LOG2_E, NO_EXT, PAD, SRC_BF16, SRC_F16, SRC_F32};
use super::{finish_row, online_update, round_up, FwdInputs, FwdOutputs, HostElement, SyncPtr};
use crate::{AttnOptions, AttnShape, ElementType, KeyRange};

/// Calls with at most this many query rows per sequence take the decode path.
pub(crate) const DECODE_MAX_ROWS: usize = 16;
/// Most keys per sub-block (a multiple of `PAD`; the score rows' stride): one online-softmax step
/// per row and sub-block, so its per-row costs (max, rescale) spread over this many keys.
const SUB: usize = 64;
/// Bytes of widened K (and as many of V) per sub-block where the cache is copied (a head dim
/// the vectors do not divide): both together stay well inside a 512 KiB L2.
const SUB_BYTES: usize = 128 << 10;
/// The smallest chunk of keys one task takes (shorter chunks spend more on merging than they save).
const MIN_CHUNK: usize = 256;
/// Bytes of K and V together per sub-block where the cache is read in place: the kernels ask for
/// the next phase's rows (V while the scores run, the next K while `P·V` does), so one sub-block's
/// K and V are in L2 at once (512 KiB on the smallest L2 we target). 128 KiB measured the same
/// here, 512 KiB slower.
const SUB_CACHE_BYTES: usize = 256 << 10;

/// The `SRC_*` of an element type.
fn src_of(t: ElementType) -> u8 {
    match t {
        ElementType::F32 => SRC_F32,
        ElementType::BF16 => SRC_BF16,
        ElementType::F16 => SRC_F16,
    }
}

/// Widens consecutive cache rows of `d` elements into rows of `dp` f32 (padding untouched, so 0).
fn widen_rows<T: HostElement, K: Isa>(src: &[T], dst: &mut [f32], d: usize, dp: usize) {
    let one = |s: &[T], o: &mut [f32]| {
        debug_assert!(o.len() >= s.len());
        match T::TYPE {
            // SAFETY: f16/bf16 are 16-bit `repr(transparent)` floats; o holds s.len() values.
            ElementType::F16 | ElementType::BF16 => unsafe { K::widen16(s.as_ptr() as *const u16, T::TYPE == ElementType::F16, o.as_mut_ptr(), s.len()) },
            // SAFETY: T is f32 when its TYPE says so; o holds s.len() values and is another buffer.
            ElementType::F32 => unsafe { std::ptr::copy_nonoverlapping(s.as_ptr() as *const f32, o.as_mut_ptr(), s.len()) },
        }
    };
    for (s, o) in src.chunks_exact(d).zip(dst.chunks_exact_mut(dp)) {
        one(s, &mut o[..d]);
    }
}

/// Whether any of `xs` is inf or NaN (every exponent bit set): on the bits, with no early exit,
/// so the loop vectorizes whatever the element type.
fn any_nonfinite<T: HostElement>(xs: &[T]) -> bool {
    let test16 = |exp: u16| {
        // SAFETY: f16/bf16 are 16-bit `repr(transparent)` floats.
        let bits = unsafe { std::slice::from_raw_parts(xs.as_ptr() as *const u16, xs.len()) };
        bits.iter().fold(false, |acc, &x| acc | (x & exp == exp))
    };
    match T::TYPE {
        ElementType::F16 => test16(0x7c00),
        ElementType::BF16 => test16(0x7f80),
        ElementType::F32 => {
            // SAFETY: T is f32 when its TYPE says so.
            let bits = unsafe { std::slice::from_raw_parts(xs.as_ptr() as *const u32, xs.len()) };
            bits.iter().fold(false, |acc, &x| acc | (x & 0x7f80_0000 == 0x7f80_0000))
        }
    }
}

/// Whether a forward call takes this path: few query rows, keys to read, no bias/ALiBi/dropout.
pub(super) fn takes(shape: &AttnShape, ex: &crate::Extras<'_>) -> bool {
    let plain = ex.bias.is_none() && ex.alibi_slopes.is_none() && ex.dropout.is_none();
    plain && shape.batch > 0 && shape.seq_q > 0 && shape.seq_q <= DECODE_MAX_ROWS && shape.seq_k > 0
}

/// Per-thread scratch, reused across tasks.
struct Scratch {
    /// The query rows of each kv head, `Hkv × r × dp`, scaled by `scale·log2(e)`, padding 0.
    qs: Vec<f32>,
    /// Where the cache is copied (see `in_place`): widened K and V rows of the sub-block, every kv
    /// head, `sub × Hkv × dp`, padding columns 0. Empty otherwise.
    kf: Vec<f32>,
    vf: Vec<f32>,
    /// `S`, then `P`, of every kv head: `Hkv × r × SUB`.
    s: Vec<f32>,
    /// The key mask of the sub-block as a score addition, 0 or -inf (`SUB`).
    mask_add: Vec<f32>,
}

/// `key_mask` (`[B, Sk]`, nonzero = visible) is the one optional operand this path takes: padded
/// batches of a generation step carry one.
pub(super) fn run<T: HostElement, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, key_mask: Option<&[u8]>, out: FwdOutputs<'_, T>) {
    let AttnShape { batch, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d } = *shape;
    debug_assert!(sq <= DECODE_MAX_ROWS && sk > 0 && batch > 0 && sq > 0);
    let g = shape.group();
    let r = g * sq; // query rows per kv head: row = hh·sq + i reads head kvh·g + hh, query i
    let dp = round_up(d, PAD);
    let row_elems = hkv * d; // one key's K (or V) row of every kv head, contiguous in the cache
    // The kernels read whole vectors: a head dim they divide is read in place, in the cache's own
    // type; any other is widened into padded f32 scratch a sub-block at a time.
    let in_place = d % K::LANES == 0;
    // Where column t of q and o sits in the task's f32 rows: a bf16 cache read in place is
    // widened a block of two vectors at a time with their columns split even/odd
    // (`bf16_slot`), so q is stored that way and o comes back that way, put in order by the merge.
    let slot: Vec<usize> = (0..d).map(|t| if in_place && T::TYPE == ElementType::BF16 { bf16_slot(t, d, K::LANES) } else { t }).collect();
    let slot = &slot[..];
    let sub = if in_place { SUB_CACHE_BYTES / (2 * row_elems * std::mem::size_of::<T>()) } else { SUB_BYTES / (hkv * dp * 4) };
    let sub = (sub / PAD * PAD).clamp(PAD, SUB);
    let threads = rayon::current_num_threads().max(1);
    // Enough tasks for every core to get several (balance), chunks no shorter than MIN_CHUNK.
    let want_chunks = (4 * threads).div_ceil(batch).max(1);
    let chunk = round_up(sk.div_ceil(want_chunks), sub).max(MIN_CHUNK);
    let nch = sk.div_ceil(chunk);
    let ntask = batch * nch;
    // Per task, kv head and row: the chunk's unnormalised o (dp), its max m and sum l (exp2 units).
    let mut part_o = vec![0f32; ntask * hkv * r * dp];
    let mut part_ml = vec![(f32::NEG_INFINITY, 0f32); ntask * hkv * r];
    let qscale = opts.scale * LOG2_E;
    // Visibility depends on the query row i alone, so it is shared by every head.
    let row_range = |b: usize, i: usize| KeyRange::for_row(opts, sk, inp.kv_len[b], inp.q_start[b], i);
    let key_bytes = row_elems * std::mem::size_of::<T>();
    // Cache hints for keys j..e of x (every head's rows: one contiguous span), none for the copy.
    let plan = |x: &[T], j: usize, e: usize| {
        if !in_place || j >= e {
            return Prefetch::NONE;
        }
        Prefetch { base: x[j * row_elems..].as_ptr() as *const u8, stride: 0, rows: 1, lines: ((e - j) * key_bytes).div_ceil(64), l2: true }
    };

    part_o.par_chunks_mut(hkv * r * dp).zip(part_ml.par_chunks_mut(hkv * r)).enumerate().for_each_init(
        || Scratch {
            qs: vec![0.0; hkv * r * dp],
            kf: if in_place { Vec::new() } else { vec![0.0; sub * hkv * dp] },
            vf: if in_place { Vec::new() } else { vec![0.0; sub * hkv * dp] },
            s: vec![0.0; hkv * r * SUB],
            mask_add: vec![0.0; SUB],
        },
        |scr, (task, (o, ml))| {
            let (b, c) = (task / nch, task % nch);
            let (c0, c1) = (c * chunk, ((c + 1) * chunk).min(sk));
            // The keys any row sees in this chunk.
            let ranges: Vec<KeyRange> = (0..r).map(|row| row_range(b, row % sq)).collect();
            let lo = ranges.iter().filter(|x| !x.is_empty()).map(|x| x.start.max(c0)).min().unwrap_or(c1);
            let hi = ranges.iter().filter(|x| !x.is_empty()).map(|x| x.end.min(c1)).max().unwrap_or(c0);
            if lo >= hi {
                return;
            }
            for kvh in 0..hkv {
                for row in 0..r {
                    let (hh, i) = (row / sq, row % sq);
                    let src = ((b * sq + i) * h + kvh * g + hh) * d;
                    let dst = &mut scr.qs[(kvh * r + row) * dp..(kvh * r + row) * dp + d];
                    for (&at, x) in slot.iter().zip(&inp.q[src..src + d]) {
                        dst[at] = qscale * x.to_f32();
                    }
                }
            }
            let (qrows, srows) = (HeadRows { ptr: scr.qs.as_mut_ptr(), rs: dp, hs: r * dp }, HeadRows { ptr: scr.s.as_mut_ptr(), rs: SUB, hs: r * SUB });
            let orows = HeadRows { ptr: o.as_mut_ptr(), rs: dp, hs: r * dp };
            let mut j0 = lo;
            while j0 < hi {
                let n = sub.min(hi - j0);
                let nw = round_up(n, K::LANES);
                let mut partial = false;
                if let Some(km) = key_mask {
                    let km = &km[b * sk + j0..b * sk + j0 + n];
                    if km.iter().all(|&x| x == 0) {
                        j0 += n;
                        continue;
                    }
                    partial = km.contains(&0);
                    for (a, &x) in scr.mask_add.iter_mut().zip(km) {
                        *a = if x != 0 { 0.0 } else { f32::NEG_INFINITY };
                    }
                }
                // Rows see [a, e) of this sub-block; columns n..nw are padding (masked).
                let spans: Vec<(usize, usize)> = ranges.iter().map(|rg| (rg.start.clamp(j0, j0 + n) - j0, rg.end.clamp(j0, j0 + n) - j0)).collect();
                let (clo, chi) = spans.iter().filter(|(a, e)| a < e).fold((nw, 0), |(lo, hi), &(a, e)| (lo.min(a), hi.max(e)));
                partial |= spans.iter().any(|&(a, e)| a >= e || a > 0 || e < n);
                if clo >= chi {
                    j0 += n;
                    continue;
                }
                // The sub-block's keys are one contiguous run of the cache (every kv head), as
                // are the chunk's: the kernels read it in order, asking for the keys ahead of it.
                let base = (b * sk + j0) * row_elems;
                let (kc, vc) = if in_place {
                    let cache = |x: &[T]| Cache {
                        // SAFETY: base is within the cache; the kernels read keys < n of it.
                        ptr: unsafe { x.as_ptr().add(base) } as *const u8,
                        src: src_of(T::TYPE),
                        key_rs: row_elems,
                        head_rs: d,
                        d,
                    };
                    (cache(inp.k), cache(inp.v))
                } else {
                    widen_rows::<T, K>(&inp.k[base..base + n * row_elems], &mut scr.kf, d, dp);
                    widen_rows::<T, K>(&inp.v[base..base + n * row_elems], &mut scr.vf, d, dp);
                    let cache = |x: &[f32]| Cache { ptr: x.as_ptr() as *const u8, src: SRC_F32, key_rs: hkv * dp, head_rs: dp, d: dp };
                    (cache(&scr.kf), cache(&scr.vf))
                };
                // SAFETY: qs and s hold Hkv blocks of r rows (dp, SUB ≥ n columns); the cache run
                // holds n keys of Hkv rows of kc.d elements at the strides it names.
                // While the scores run, ask for the V rows P·V reads next.
                let pf_v = plan(inp.v, b * sk + j0 + clo, b * sk + j0 + chi);
                unsafe { K::dec_scores(qrows, r, hkv, &kc, n, srows, pf_v) };
                // While P·V runs, ask for the next sub-block's K.
                let pf_k = plan(inp.k, b * sk + j0 + n, b * sk + (j0 + 2 * n).min(hi));
                for kvh in 0..hkv {
                    let ml = &mut ml[kvh * r..(kvh + 1) * r];
                    let o = &mut o[kvh * r * dp..(kvh + 1) * r * dp];
                    for (row, &(a, e)) in spans.iter().enumerate() {
                        let srow = &mut scr.s[(kvh * r + row) * SUB..(kvh * r + row) * SUB + nw];
                        if a >= e {
                            srow.fill(0.0);
                            continue;
                        }
                        let (m_old, l_old) = &mut ml[row];
                        // SAFETY: srow has nw ≥ e elements, a < e; mask_add has SUB ≥ nw.
                        let (m_new, sum) = unsafe {
                            if key_mask.is_some() {
                                K::fwd_row_ext(srow.as_mut_ptr(), nw, a, e, opts.softcap, *m_old, RowExtra { add: scr.mask_add.as_ptr(), ..NO_EXT })
                            } else {
                                K::fwd_row(srow.as_mut_ptr(), nw, a, e, opts.softcap, *m_old)
                            }
                        };
                        if m_new == f32::NEG_INFINITY {
                            // Every key this row has seen so far is masked: srow is zeros.
                            continue;
                        }
                        online_update::<K>(&mut o[row * dp..(row + 1) * dp], m_old, l_old, m_new, sum);
                    }
                }
                // 0·inf = NaN: where a row sees only part of the block and a head's V holds an
                // inf or NaN there, each of its rows multiplies only its own keys (as the prefill
                // forward does).
                let v_bad: Vec<bool> = (0..hkv).map(|kvh| partial && (clo..chi).any(|jj| any_nonfinite(&inp.v[base + jj * row_elems + kvh * d..][..d]))).collect();
                if !v_bad.contains(&true) {
                    // SAFETY: s and o hold Hkv blocks of r rows (SUB ≥ chi, dp ≥ vc.d columns);
                    // the run holds keys clo..chi of every head.
                    unsafe { K::dec_pv(srows, r, hkv, &vc, clo, chi, orows, pf_k) };
                } else {
                    // Row `row` of head `kvh` alone (all r rows where row is None).
                    let at = |x: HeadRows, kvh: usize, row: usize| HeadRows { ptr: x.ptr.wrapping_add(kvh * x.hs + row * x.rs), ..x };
                    for (kvh, &bad) in v_bad.iter().enumerate() {
                        let vh = vc.head(kvh);
                        if !bad {
                            // SAFETY: as above, for one head.
                            unsafe { K::dec_pv(at(srows, kvh, 0), r, 1, &vh, clo, chi, at(orows, kvh, 0), Prefetch::NONE) };
                            continue;
                        }
                        for (row, &(a, e)) in spans.iter().enumerate().filter(|(_, (a, e))| a < e) {
                            // SAFETY: as above, for one row of one head, keys a..e ⊆ clo..chi.
                            unsafe { K::dec_pv(at(srows, kvh, row), 1, 1, &vh, a, e, at(orows, kvh, row), Prefetch::NONE) };
                        }
                    }
                }
                j0 += n;
            }
        },
    );

    // Merge each row's chunks into o and lse.
    let o_ptr = SyncPtr(out.o.as_mut_ptr());
    let lse_ptr = SyncPtr(out.lse.as_mut_ptr());
    let (part_o, part_ml) = (&part_o[..], &part_ml[..]);
    (0..batch * hkv * r).into_par_iter().with_min_len(8).for_each(|x| {
        let (bkv, row) = (x / r, x % r);
        let (b, kvh) = (bkv / hkv, bkv % hkv);
        let (hh, i) = (row / sq, row % sq);
        let hq = kvh * g + hh;
        let parts = |c: usize| ((b * nch + c) * hkv + kvh) * r + row;
        let m = (0..nch).map(|c| part_ml[parts(c)].0).fold(f32::NEG_INFINITY, f32::max);
        let mut acc = [0f32; crate::AttnShape::MAX_HEAD_DIM];
        let mut l = 0f32;
        if m != f32::NEG_INFINITY {
            for c in 0..nch {
                let (mc, lc) = part_ml[parts(c)];
                if lc == 0.0 {
                    continue;
                }
                let w = (mc - m).exp2();
                l += lc * w;
                // Back in column order (`slot`).
                let part = &part_o[parts(c) * dp..parts(c) * dp + d];
                for (a, &at) in acc[..d].iter_mut().zip(slot) {
                    *a += w * part[at];
                }
            }
        }
        // SAFETY: (b, hq, i) is written by this item alone; indices are within the checked lengths.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(o_ptr.get().add(((b * sq + i) * h + hq) * d), d);
            finish_row(dst, &mut *lse_ptr.get().add((b * h + hq) * sq + i), &acc[..d], m, l);
        }
    });
}
