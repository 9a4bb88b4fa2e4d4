//! Where the backward's bias gradient goes. A backward task owns a group of consecutive key
//! blocks; for each (query head, query block) it leaves `dZ` of those rows over the group's keys
//! in a per-thread panel (`rows × width` floats), and [`DbiasOut`] moves the panel into `dbias`
//! one bias row segment at a time (runs of KiBs, not 256-byte pieces one bias row apart).
//!
//! Two modes, fixed per call:
//! - owned: the bias broadcasts over nothing (`[B or 1 = B, H or 1 = H, Sq, Sk]`), so every `dbias`
//!   entry is one (batch, head, query, key) and exactly one task writes it, once: stored, not
//!   added, with no zero fill first. Entries no tile computes (query blocks a mask or causality
//!   keeps away from the group, tiles the key mask hides) are written as zeros by the same task.
//!   A large f32 `dbias` is written with streaming stores, so writing it costs one write and no
//!   read of the old contents; its pages are mapped first, huge where the kernel grants them
//!   (`pages.rs`: XLA hands out a fresh result, and faulting it in 4 KiB at a time cost more than
//!   the write).
//! - summed: a broadcast bias sums `dZ` over the broadcast dims into an f32 accumulator (`dbias`
//!   itself when f32, else a copy rounded at the end), zeroed first, each region under its lock.

use std::sync::Mutex;

use rayon::prelude::*;

use super::{pages, HostElement, SyncPtr};
use crate::{AttnShape, BiasGrad};

/// At least this many bytes of f32 `dbias` are written with streaming (non-temporal) stores: far
/// more than the caches hold, so nothing is lost by bypassing them.
const STREAM_BYTES: usize = 8 << 20;

/// The `dbias` result as the tasks write it.
pub(super) struct DbiasOut<'g> {
    grad: BiasGrad<'g>,
    /// Owned mode: `grad`'s storage, written through by the tasks.
    dst: Dst,
    dims: [usize; 4],
    /// The bias has a row per query (`Sqb = Sq`) / a column per key (`Skb = Sk`).
    q_full: bool,
    k_full: bool,
    owned: bool,
    stream: bool,
    /// Summed mode: the f32 accumulator (`grad` itself when f32, else `tmp`).
    acc: SyncPtr<f32>,
    tmp: Vec<f32>,
    /// Summed mode: one lock per (bias batch·head, query block or 0, key group or 0). The regions
    /// they guard are disjoint, and tasks that add into the same entries take the same lock.
    locks: Vec<Mutex<()>>,
    nql: usize,
    nkl: usize,
}

impl<'g> DbiasOut<'g> {
    /// `dims` are the bias's; key groups are `groups` runs of consecutive key blocks, the same
    /// for every task. Summed mode zeroes its accumulator here; owned mode touches nothing yet.
    pub(super) fn new(mut grad: BiasGrad<'g>, dims: [usize; 4], shape: &AttnShape, nqb: usize, groups: usize) -> Self {
        let (q_full, k_full) = (dims[2] == shape.seq_q, dims[3] == shape.seq_k);
        let owned = dims[0] == shape.batch && dims[1] == shape.heads && q_full && k_full;
        let stream = matches!(grad, BiasGrad::F32(_)) && grad.len() * 4 >= STREAM_BYTES;
        let dst = match &mut grad {
            BiasGrad::F32(x) => Dst::F32(SyncPtr(x.as_mut_ptr())),
            BiasGrad::F16(x) => Dst::F16(SyncPtr(x.as_mut_ptr())),
            BiasGrad::BF16(x) => Dst::BF16(SyncPtr(x.as_mut_ptr())),
        };
        if stream {
            // Likely a fresh result: map its pages before the tasks (or the zero fill) touch them.
            if let Dst::F32(p) = dst {
                pages::populate(p.get() as *mut u8, grad.len() * 4);
            }
        }
        let mut tmp = Vec::new();
        let mut acc = SyncPtr(std::ptr::null_mut());
        let (mut locks, mut nql, mut nkl) = (Vec::new(), 0, 0);
        if !owned {
            acc = match &mut grad {
                BiasGrad::F32(x) => {
                    // In parallel: this may be the buffer's first touch.
                    x.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
                    SyncPtr(x.as_mut_ptr())
                }
                g => {
                    tmp = vec![0.0; g.len()];
                    SyncPtr(tmp.as_mut_ptr())
                }
            };
            (nql, nkl) = (if q_full { nqb } else { 1 }, if k_full { groups } else { 1 });
            locks = (0..dims[0] * dims[1] * nql * nkl).map(|_| Mutex::new(())).collect();
        }
        Self { grad, dst, dims, q_full, k_full, owned, stream, acc, tmp, locks, nql, nkl }
    }

    /// Index of the bias's (batch, head) plane that query head `hq` of batch row `b` reads.
    fn plane(&self, b: usize, hq: usize) -> usize {
        let [bb, hb, _, _] = self.dims;
        (if bb == 1 { 0 } else { b }) * hb + if hb == 1 { 0 } else { hq }
    }

    /// Query block `qb` (rows `i0..i0 + rows`) of head `hq` sees nothing of key group `grp`
    /// (keys `g0..g1`): in owned mode its entries there are 0; a sum gets nothing.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn skip(&self, b: usize, hq: usize, i0: usize, rows: usize, g0: usize, g1: usize) {
        if self.owned {
            self.store_rows(b, hq, i0, rows, g0, g1, &[], 0, g0, g0);
        }
    }

    /// `dz` (row `r` at `dz[r·width..]`, key `g0 + c` at column `c`) holds the gradient of query
    /// block `qb` (rows `i0..i0 + rows`) of head `hq` over keys `lo..hi` of key group `grp`
    /// (keys `g0..g1`); keys of the group outside `lo..hi` were not computed (nothing there is
    /// visible). Stores it (owned) or adds it (summed).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn put(&self, dz: &[f32], width: usize, b: usize, hq: usize, qb: usize, i0: usize, rows: usize, grp: usize, (g0, g1): (usize, usize), (lo, hi): (usize, usize)) {
        if self.owned {
            self.store_rows(b, hq, i0, rows, g0, g1, dz, width, lo, hi);
        } else {
            self.add_rows(dz, width, b, hq, qb, i0, rows, grp, g0, lo, hi);
        }
    }

    /// Owned mode: row `i0 + r`'s keys `g0..g1` = `dz` row `r` on `lo..hi`, 0 elsewhere.
    #[allow(clippy::too_many_arguments)]
    fn store_rows(&self, b: usize, hq: usize, i0: usize, rows: usize, g0: usize, g1: usize, dz: &[f32], width: usize, lo: usize, hi: usize) {
        let [_, _, sqb, skb] = self.dims;
        let base = self.plane(b, hq) * sqb;
        for r in 0..rows {
            let at = (base + i0 + r) * skb;
            let src = if hi > lo { &dz[r * width + (lo - g0)..r * width + (hi - g0)] } else { &[][..] };
            // SAFETY: owned mode: this task alone writes row i0 + r of plane (b, hq) on keys
            // g0..g1 (it owns the key group and loops over every query block of its heads);
            // at + g1 ≤ the checked length of dbias.
            unsafe {
                match self.dst {
                    Dst::F32(p) => store_run(p.get().add(at), g0, g1, lo, src, self.stream),
                    Dst::F16(p) => store_run(p.get().add(at), g0, g1, lo, src, false),
                    Dst::BF16(p) => store_run(p.get().add(at), g0, g1, lo, src, false),
                }
            }
        }
        if self.stream {
            fence();
        }
    }

    /// Summed mode: adds `dz` rows over keys `lo..hi` into the accumulator, summing over the
    /// bias's broadcast dims, under the lock of the region.
    #[allow(clippy::too_many_arguments)]
    fn add_rows(&self, dz: &[f32], width: usize, b: usize, hq: usize, qb: usize, i0: usize, rows: usize, grp: usize, g0: usize, lo: usize, hi: usize) {
        if lo >= hi {
            return;
        }
        let [_, _, sqb, skb] = self.dims;
        let bh = self.plane(b, hq);
        let lock = (bh * self.nql + if self.q_full { qb } else { 0 }) * self.nkl + if self.k_full { grp } else { 0 };
        let _guard = self.locks[lock].lock().unwrap_or_else(|e| e.into_inner());
        for r in 0..rows {
            let src = &dz[r * width + (lo - g0)..r * width + (hi - g0)];
            let row = (bh * sqb + if self.q_full { i0 + r } else { 0 }) * skb;
            // SAFETY: row + hi ≤ Bb·Hb·Sqb·Skb (hi ≤ Sk = Skb when k_full); the lock held is the
            // only one guarding this (plane, query block or 0, key group or 0) region.
            unsafe {
                if self.k_full {
                    let dst = std::slice::from_raw_parts_mut(self.acc.get().add(row + lo), hi - lo);
                    for (o, x) in dst.iter_mut().zip(src) {
                        *o += *x;
                    }
                } else {
                    *self.acc.get().add(row) += src.iter().sum::<f32>();
                }
            }
        }
    }

    /// Summed mode of an f16/bf16 `dbias`: rounds the accumulator into it.
    pub(super) fn finish(self) {
        if self.owned {
            return;
        }
        match self.grad {
            BiasGrad::F16(x) => x.par_iter_mut().zip(&self.tmp).for_each(|(o, v)| *o = half::f16::from_f32(*v)),
            BiasGrad::BF16(x) => x.par_iter_mut().zip(&self.tmp).for_each(|(o, v)| *o = half::bf16::from_f32(*v)),
            BiasGrad::F32(_) => {}
        }
    }
}

/// `dbias`'s storage in its own type.
#[derive(Clone, Copy)]
enum Dst {
    F32(SyncPtr<f32>),
    F16(SyncPtr<half::f16>),
    BF16(SyncPtr<half::bf16>),
}

/// Zeroes a whole `dbias` (a call that computes no tile at all).
pub(super) fn zero(grad: Option<BiasGrad<'_>>) {
    match grad {
        Some(BiasGrad::F32(x)) => x.fill(0.0),
        Some(BiasGrad::F16(x)) => x.fill(half::f16::ZERO),
        Some(BiasGrad::BF16(x)) => x.fill(half::bf16::ZERO),
        None => {}
    }
}

/// `row[g0..g1]` = `src` on `lo..lo + src.len()`, 0 elsewhere.
///
/// # Safety
/// `row[g0..g1]` is valid for writes and no other thread touches it.
unsafe fn store_run<E: HostElement>(row: *mut E, g0: usize, g1: usize, lo: usize, src: &[f32], stream: bool) {
    let hi = lo + src.len();
    debug_assert!(g0 <= lo && hi <= g1 || src.is_empty());
    let (lo, hi) = if src.is_empty() { (g0, g0) } else { (lo, hi) };
    if stream && E::TYPE == crate::ElementType::F32 {
        let row = row as *mut f32;
        stream_f32(row.add(g0), lo - g0, None);
        stream_f32(row.add(lo), hi - lo, Some(src));
        stream_f32(row.add(hi), g1 - hi, None);
        return;
    }
    let zero = E::from_f32(0.0);
    for c in g0..lo {
        *row.add(c) = zero;
    }
    for (c, x) in (lo..hi).zip(src) {
        *row.add(c) = E::from_f32(*x);
    }
    for c in hi..g1 {
        *row.add(c) = zero;
    }
}

/// Writes `n` floats at `dst`: `src` (or zeros when `None`) with non-temporal stores, which do not
/// read the destination's lines first nor keep them in cache (the ends that are not 16-byte
/// aligned are stored normally).
///
/// # Safety
/// `dst[..n]` is valid for writes; `src`, when given, holds `n` floats.
unsafe fn stream_f32(dst: *mut f32, n: usize, src: Option<&[f32]>) {
    let get = |i: usize| src.map_or(0.0, |s| s[i]);
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_loadu_ps, _mm_setzero_ps, _mm_stream_ps};
        while i < n && !(dst.add(i) as usize).is_multiple_of(16) {
            *dst.add(i) = get(i);
            i += 1;
        }
        while i + 4 <= n {
            // SAFETY: dst + i is 16-byte aligned, i + 4 ≤ n (and ≤ src.len()).
            let v = match src {
                Some(s) => _mm_loadu_ps(s.as_ptr().add(i)),
                None => _mm_setzero_ps(),
            };
            _mm_stream_ps(dst.add(i), v);
            i += 4;
        }
    }
    while i < n {
        *dst.add(i) = get(i);
        i += 1;
    }
}

/// Orders this thread's streaming stores before whatever it does next (they are weakly
/// ordered; rayon's completion signal would not cover them).
fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions.
    unsafe {
        std::arch::x86_64::_mm_sfence();
    }
}
