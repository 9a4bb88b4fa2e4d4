//! The inner loops, written once and instantiated per ISA (AVX-512, AVX2+FMA, scalar) by
//! `isa_kernels!`, each instance compiled under its own `target_feature` so the primitives of
//! `simd.rs` inline into it. Drivers (`forward.rs`, `backward.rs`) reach them through [`Isa`].
//!
//! Three kernels:
//! - `gemm`: `C[m×n] (+)= A[m×k]·B[k×n]`, B and C row-major with `n` a multiple of the lane count,
//!   A addressed by two strides so a transposed `P` or `dS` needs no copy (A is only ever
//!   broadcast, one scalar at a time, so its layout costs nothing). Register-blocked
//!   `R × NV` micro-kernels, all accumulators in registers.
//! - `fwd_row`: one row of a score tile -> softcap, max, `exp2`, row sum (online softmax step).
//! - `bwd_row`: one row -> `P = exp(s - lse)` and `dX = P ∘ (dP - Δ) ∘ softcap'`.

/// Every `n` handed to [`Isa::gemm`] and every row stride is a multiple of this, which every
/// lane count divides.
pub(crate) const PAD: usize = 16;

pub(crate) const LOG2_E: f32 = std::f32::consts::LOG2_E;

/// One `C (+)= A·B` call. `A[i, p] = a[i·a_rs + p·a_cs]`, `B[p, j] = b[p·ldb + j]`,
/// `C[i, j] = c[i·ldc + j]`.
#[derive(Clone, Copy)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub a_rs: usize,
    pub a_cs: usize,
    pub b: *const f32,
    pub ldb: usize,
    pub c: *mut f32,
    pub ldc: usize,
    /// false: `C = A·B` (C's old contents ignored); true: `C += A·B`.
    pub accumulate: bool,
    /// Lines of some other array to ask the caches for while this product runs.
    pub pf: Prefetch,
}

/// `rows` runs of `lines` cache lines, `stride` bytes apart from `base`, which a [`Gemm`] asks the
/// caches for a few at a time, spread over its micro-kernel calls: data a later tile needs
/// arrives while this one computes, and the requests never pile up in a burst that stalls the
/// loads of the product itself (256 prefetches in a row did, measured).
#[derive(Clone, Copy)]
pub(crate) struct Prefetch {
    pub base: *const u8,
    pub stride: usize,
    pub rows: usize,
    pub lines: usize,
    /// Ask L2 alone for the lines (else L1 too): see [`super::prefetch::prefetch_line_l2`].
    pub l2: bool,
}

impl Prefetch {
    pub(crate) const NONE: Prefetch = Prefetch { base: core::ptr::null(), stride: 0, rows: 0, lines: 0, l2: false };

    /// A cursor that hands out this plan's requests over `calls` micro-kernel calls.
    #[inline(always)]
    fn spread(&self, calls: usize) -> PrefetchCursor {
        let total = self.rows * self.lines;
        let calls = calls.max(1);
        PrefetchCursor { row: self.base, line: 0, lines: self.lines, stride: self.stride, per_call: total / calls, rem: total % calls, err: 0, calls, l2: self.l2 }
    }
}

/// Walks a [`Prefetch`] plan in row-major order, `per_call` requests per micro-kernel call and one
/// more on `rem` of the `calls` (Bresenham): over exactly `calls` steps, which is what `gemm`
/// makes, that hands out the plan's `rows·lines` requests, no more. No division per request: with
/// a `l / lines`, `l % lines` per line and two per call, `gemm`'s own samples in an S = 2048
/// forward with a bias were 8.5% of the micro-kernels' (perf); with the cursor, 4.6% (1.4%
/// without a plan).
struct PrefetchCursor {
    row: *const u8,
    line: usize,
    lines: usize,
    stride: usize,
    per_call: usize,
    rem: usize,
    err: usize,
    calls: usize,
    l2: bool,
}

impl PrefetchCursor {
    /// The requests of one micro-kernel call. A hint: never faults.
    #[inline(always)]
    fn step(&mut self) {
        let mut n = self.per_call;
        self.err += self.rem;
        if self.err >= self.calls {
            self.err -= self.calls;
            n += 1;
        }
        for _ in 0..n {
            let p = self.row.wrapping_add(self.line * 64);
            if self.l2 {
                super::prefetch::prefetch_line_l2(p);
            } else {
                super::prefetch::prefetch_line(p);
            }
            self.line += 1;
            if self.line == self.lines {
                self.line = 0;
                self.row = self.row.wrapping_add(self.stride);
            }
        }
    }
}

/// What the optional operands add to one row of a score tile, in natural units (the kernels
/// scale by `log2(e)` themselves): `add[0..n]` (a bias row with hidden keys already `-inf`, or a
/// key-mask row of `0`/`-inf`; null = none) and the ALiBi term `alibi · |dist0 - c|` for column
/// `c` (`alibi = -slope·log2(e)`, already in exp2 units; 0 = none, which is exact since a zero slope
/// adds nothing).
#[derive(Clone, Copy)]
pub(crate) struct RowExtra {
    pub add: *const f32,
    pub alibi: f32,
    pub dist0: f32,
}

/// A row without extras.
pub(crate) const NO_EXT: RowExtra = RowExtra { add: core::ptr::null(), alibi: 0.0, dist0: 0.0 };

/// Column offsets within one vector, for the ALiBi distance.
pub(crate) static IOTA: [f32; 16] = [0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.];

/// The element type of a cache the decode kernels read in place, widened in registers (as
/// `const W: u8`: `SRC_F32`, `SRC_BF16`, `SRC_F16`).
pub(crate) const SRC_F32: u8 = 0;
pub(crate) const SRC_BF16: u8 = 1;
pub(crate) const SRC_F16: u8 = 2;

/// Where column `t` of a head row of `d` columns sits in the `q` rows of [`Isa::dec_scores`] and
/// the `o` rows of [`Isa::dec_pv`] when they read a `SRC_BF16` cache: each whole block of
/// `2·lanes` columns holds its even columns, then its odd ones (the order `load_bf16_pair` widens
/// a block in, with no shuffle), and a last block of `lanes` (`d` an odd number of vectors) keeps
/// its order. A dot product takes its terms in any order, so `q` is stored in this one, and `o`,
/// accumulated in it, is put back once at the end (`decode.rs`).
pub(crate) fn bf16_slot(t: usize, d: usize, lanes: usize) -> usize {
    let (block, at) = (t / (2 * lanes) * (2 * lanes), t % (2 * lanes));
    if block + 2 * lanes > d {
        t
    } else {
        block + at / 2 + (at % 2) * lanes
    }
}

/// A run of keys of a K or V cache, as [`Isa::dec_scores`] and [`Isa::dec_pv`] read it: key `j`'s
/// row for kv head `h` is the `d` elements (a multiple of the lane count) from element
/// `j·key_rs + h·head_rs` of `ptr`, of type `src` (`SRC_*`).
#[derive(Clone, Copy)]
pub(crate) struct Cache {
    pub ptr: *const u8,
    pub src: u8,
    pub key_rs: usize,
    pub head_rs: usize,
    pub d: usize,
}

impl Cache {
    /// Bytes per element.
    #[inline(always)]
    fn size(&self) -> usize {
        if self.src == SRC_F32 { 4 } else { 2 }
    }

    /// The same run for kv head `h` alone (as head 0).
    pub(crate) fn head(&self, h: usize) -> Cache {
        Cache { ptr: self.ptr.wrapping_add(h * self.head_rs * self.size()), ..*self }
    }
}

/// `heads` blocks of `rows` f32 rows: row `i` of head `h` starts at `ptr + h·hs + i·rs`.
#[derive(Clone, Copy)]
pub(crate) struct HeadRows {
    pub ptr: *mut f32,
    pub rs: usize,
    pub hs: usize,
}

/// The kernels of one instruction set.
///
/// # Safety
/// Callers guarantee every pointer/extent they pass is in bounds, and only use an
/// implementation whose CPU features were detected ([`super::dispatch`]).
pub(crate) trait Isa: Send + Sync + 'static {
    /// f32 lanes per vector: every `n` handed to [`Isa::gemm`] is a multiple of it (1 for the
    /// scalar family; the dropout generator follows it, `dropout::keep_tile_fn`).
    const LANES: usize;
    unsafe fn gemm(g: Gemm);
    /// Decode scores, for heads `h < heads`, rows `i < rows`, keys `j < n` of `k`:
    /// `out[h, i, j] = Σ_{t<d} q[h, i, t]·K_h[j, t]` (`q` and `out` as [`HeadRows`], `out` with its keys
    /// along the row). Keys are taken in order, every head's row of a key before the next key (the
    /// cache's own order), and each key vector is loaded once for up to 4 rows. `pf`'s lines are
    /// asked for along the way (the caller's next run). A `SRC_BF16` cache wants `q`'s columns in
    /// [`bf16_slot`] order.
    #[allow(clippy::too_many_arguments)]
    unsafe fn dec_scores(q: HeadRows, rows: usize, heads: usize, k: &Cache, n: usize, out: HeadRows, pf: Prefetch);
    /// Decode `P·V`, for heads `h < heads`, rows `i < rows`: `o[h, i, t] += Σ_{a≤j<e} p[h, i, j]·V_h[j, t]`
    /// for `t < v.d` (`p`, `o` as [`HeadRows`]). Keys in groups, in the cache's order as
    /// [`Isa::dec_scores`]; each V vector loaded once for up to 4 rows; `pf` as there. From a
    /// `SRC_BF16` cache, `o`'s columns are in [`bf16_slot`] order.
    #[allow(clippy::too_many_arguments)]
    unsafe fn dec_pv(p: HeadRows, rows: usize, heads: usize, v: &Cache, a: usize, e: usize, o: HeadRows, pf: Prefetch);
    /// `dst[0..n]` = the f16 (`f16 = true`) or bf16 values at `src` as f32.
    unsafe fn widen16(src: *const u16, f16: bool, dst: *mut f32, n: usize);
    /// `x[0..n] *= alpha` (the online softmax's rescale of an O row).
    unsafe fn scale_row(x: *mut f32, n: usize, alpha: f32);
    /// One row of a forward tile. `s[0..n]` holds `log2(e)·x`, `x = scale·q·k`; columns `[a, b)`
    /// (non-empty) are visible. Replaces `s` with `p = 2^(s2 - m_new)` (0 outside `[a, b)`), where
    /// `s2 = log2(e)·softcap(x)` and `m_new = max(m_old, max visible s2)`. Returns `(m_new, Σp)`.
    unsafe fn fwd_row(s: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32) -> (f32, f32);
    /// One row of a backward tile. `s[0..n]` holds `x`, `dp[0..n]` holds `dO·v`; columns `[a, b)`
    /// (non-empty) are visible; `lse2 = log2(e)·lse` is finite; `di = Σ dO∘O` of the row. Writes
    /// `p = 2^(s2 - lse2)` and replaces `s` with `dX = p·(dp - di)·(softcap ? 1 - (s/c)² : 1)`,
    /// both 0 outside `[a, b)`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn bwd_row(s: *mut f32, dp: *const f32, p: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32);
    /// [`Isa::fwd_row`] with the row's [`RowExtra`] added after the softcap. A row whose visible
    /// scores are all `-inf` (and `m_old = -inf`) comes back as zeros with `(-inf, 0)`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn fwd_row_ext(s: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32, ext: RowExtra) -> (f32, f32);
    /// [`Isa::bwd_row`] with the row's [`RowExtra`] added to the score before `p`; when `ds` is not
    /// null it also gets `dZ = p·(dp - di)` (the gradient w.r.t. the post-softcap score, i.e. the
    /// bias gradient), 0 outside `[a, b)`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn bwd_row_ext(s: *mut f32, dp: *const f32, p: *mut f32, ds: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: RowExtra);
    /// [`Isa::bwd_row_ext`] under dropout: `km[0..n]` holds the keep scales `M·s` of the row, and
    /// `p` gets `P ∘ M·s` (what dV needs) while `dZ = P ∘ (M·s·dP - di)`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn bwd_row_drop(s: *mut f32, dp: *const f32, p: *mut f32, ds: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: RowExtra, km: *const f32);
}

/// Calls `f::<LEAD.., ADD, ALIBI>(args)` with `ADD`/`ALIBI` the terms `ext` has (a non-null
/// additive row, a nonzero ALiBi multiplier), so the row kernels test them once per row, not
/// once per vector.
macro_rules! by_terms {
    ($ext:expr, $f:ident::<$($lead:literal),*>($($arg:expr),* $(,)?)) => {
        match (!$ext.add.is_null(), $ext.alibi != 0.0) {
            (true, false) => $f::<$($lead,)* true, false>($($arg),*),
            (false, true) => $f::<$($lead,)* false, true>($($arg),*),
            (true, true) => $f::<$($lead,)* true, true>($($arg),*),
            (false, false) => $f::<$($lead,)* false, false>($($arg),*),
        }
    };
}

macro_rules! isa_kernels {
    ($modname:ident, $ops:ident, $r_main:literal, $nv_main:literal $(, #[$feat:meta])?) => {
        pub(crate) mod $modname {
            use super::{Cache, Gemm, HeadRows, Isa, Prefetch, RowExtra, IOTA, LOG2_E, NO_EXT, SRC_BF16, SRC_F16, SRC_F32};
            use crate::host::simd::$ops as s;
            use s::{V, L};

            pub(crate) struct Kernels;

            /// Rows × vector-columns of the main micro-kernel: sized to fill the register file
            /// (AVX-512: 6×4 zmm accumulators + 4 B vectors + 1 broadcast of 32).
            const R_MAIN: usize = $r_main;
            const NV_MAIN: usize = $nv_main;
            // `dec_pv` reads bf16 a pair of vectors at a time from the start of each run.
            const _: () = assert!(NV_MAIN % 2 == 0);

            $(#[$feat])?
            #[inline]
            unsafe fn micro<const R: usize, const NV: usize>(g: &Gemm, i0: usize, j0: usize) {
                let mut acc: [[V; NV]; R] = [[s::zero(); NV]; R];
                let c = g.c.add(i0 * g.ldc + j0);
                if g.accumulate {
                    for r in 0..R {
                        for v in 0..NV {
                            acc[r][v] = s::load(c.add(r * g.ldc + v * L));
                        }
                    }
                }
                let a = g.a.add(i0 * g.a_rs);
                let mut b = g.b.add(j0);
                for p in 0..g.k {
                    let mut bv: [V; NV] = [s::zero(); NV];
                    for v in 0..NV {
                        bv[v] = s::load(b.add(v * L));
                    }
                    let ap = a.add(p * g.a_cs);
                    for r in 0..R {
                        let av = s::splat(*ap.add(r * g.a_rs));
                        for v in 0..NV {
                            acc[r][v] = s::fma(av, bv[v], acc[r][v]);
                        }
                    }
                    b = b.add(g.ldb);
                }
                for r in 0..R {
                    for v in 0..NV {
                        s::store(c.add(r * g.ldc + v * L), acc[r][v]);
                    }
                }
            }

            /// Picks the micro-kernel instance for an `r × nv` edge block.
            $(#[$feat])?
            #[inline]
            unsafe fn micro_dyn<const NV: usize>(g: &Gemm, r: usize, i0: usize, j0: usize) {
                match r {
                    1 => micro::<1, NV>(g, i0, j0),
                    2 => micro::<2, NV>(g, i0, j0),
                    3 => micro::<3, NV>(g, i0, j0),
                    4 => micro::<4, NV>(g, i0, j0),
                    5 => micro::<5, NV>(g, i0, j0),
                    _ => micro::<{ R_MAIN }, NV>(g, i0, j0),
                }
            }

            $(#[$feat])?
            #[allow(clippy::modulo_one)] // L = 1 in the scalar instance
            unsafe fn gemm(g: Gemm) {
                debug_assert!(g.n % L == 0);
                let nvec = g.n / L;
                let mut jv = 0;
                // The prefetch requests, spread evenly over the micro-kernel calls.
                let mut pf = g.pf.spread(g.m.div_ceil(R_MAIN) * nvec.div_ceil(NV_MAIN));
                // Column panels outermost: one panel of B (k × NV·L) stays in L1 while every
                // row group streams past it.
                while jv < nvec {
                    let nv = (nvec - jv).min(NV_MAIN);
                    let mut i = 0;
                    while i < g.m {
                        let r = (g.m - i).min(R_MAIN);
                        pf.step();
                        match nv {
                            1 => micro_dyn::<1>(&g, r, i, jv * L),
                            2 if NV_MAIN >= 2 => micro_dyn::<2>(&g, r, i, jv * L),
                            3 if NV_MAIN >= 3 => micro_dyn::<3>(&g, r, i, jv * L),
                            _ => micro_dyn::<{ NV_MAIN }>(&g, r, i, jv * L),
                        }
                        i += r;
                    }
                    jv += nv;
                }
            }

            /// One vector of a cache row at element `i` of `p`, as f32.
            $(#[$feat])?
            #[inline]
            unsafe fn load_src<const W: u8>(p: *const u8, i: usize) -> V {
                match W {
                    SRC_F32 => s::load((p as *const f32).add(i)),
                    SRC_BF16 => s::load_bf16((p as *const u16).add(i)),
                    _ => s::load_f16((p as *const u16).add(i)),
                }
            }

            /// [`Isa::dec_scores`] for one source type.
            $(#[$feat])?
            unsafe fn dec_scores<const W: u8>(q: HeadRows, rows: usize, heads: usize, k: &Cache, n: usize, out: HeadRows, pf: Prefetch) {
                let size = k.size();
                // The prefetch requests, spread evenly over the (step, head) pairs. (Spreading
                // them further, one per vector step inside the micro-kernels, measured no
                // faster for f32 and 5-10% slower for bf16.)
                let mut pf = pf.spread(n.div_ceil(4) * heads);
                let mut j = 0;
                while j < n {
                    let ky = if n - j >= 4 { 4 } else { 1 };
                    for h in 0..heads {
                        pf.step();
                        let kp = k.ptr.add((j * k.key_rs + h * k.head_rs) * size);
                        let mut i = 0;
                        while i < rows {
                            let (qp, sp) = (q.ptr.add(h * q.hs + i * q.rs) as *const f32, out.ptr.add(h * out.hs + i * out.rs + j));
                            let args = (qp, q.rs, kp, k.key_rs, k.d, sp, out.rs);
                            i += match (rows - i, ky) {
                                (1, 4) => dots_micro::<1, 4, W>(args),
                                (2 | 3, 4) => dots_micro::<2, 4, W>(args),
                                (_, 4) => {
                                    dots_micro::<4, 2, W>(args);
                                    dots_micro::<4, 2, W>((qp, q.rs, kp.add(2 * k.key_rs * size), k.key_rs, k.d, sp.add(2), out.rs))
                                }
                                (1, _) => dots_micro::<1, 1, W>(args),
                                (2 | 3, _) => dots_micro::<2, 1, W>(args),
                                _ => dots_micro::<4, 1, W>(args),
                            };
                        }
                    }
                    j += ky;
                }
            }

            /// `RW` query rows against `KY` keys (`k_rs` elements apart); returns `RW`.
            $(#[$feat])?
            #[inline]
            unsafe fn dots_micro<const RW: usize, const KY: usize, const W: u8>((q, q_rs, k, k_rs, d, out, out_rs): (*const f32, usize, *const u8, usize, usize, *mut f32, usize)) -> usize {
                let mut acc: [[V; KY]; RW] = [[s::zero(); KY]; RW];
                let mut t = 0;
                if W == SRC_BF16 {
                    // Whole blocks of 2L columns, widened as (even, odd) halves: q holds each
                    // block in that order (`bf16_slot`).
                    while t + 2 * L <= d {
                        let (mut ke, mut ko): ([V; KY], [V; KY]) = ([s::zero(); KY], [s::zero(); KY]);
                        for kk in 0..KY {
                            (ke[kk], ko[kk]) = s::load_bf16_pair((k as *const u16).add(kk * k_rs + t));
                        }
                        for rw in 0..RW {
                            let (qe, qo) = (s::load(q.add(rw * q_rs + t)), s::load(q.add(rw * q_rs + t + L)));
                            for kk in 0..KY {
                                acc[rw][kk] = s::fma(qo, ko[kk], s::fma(qe, ke[kk], acc[rw][kk]));
                            }
                        }
                        t += 2 * L;
                    }
                }
                // Any other type, and a last single vector of bf16, in order.
                for t in (t..d).step_by(L) {
                    let mut kv: [V; KY] = [s::zero(); KY];
                    for kk in 0..KY {
                        kv[kk] = load_src::<W>(k, kk * k_rs + t);
                    }
                    for rw in 0..RW {
                        let qv = s::load(q.add(rw * q_rs + t));
                        for kk in 0..KY {
                            acc[rw][kk] = s::fma(qv, kv[kk], acc[rw][kk]);
                        }
                    }
                }
                // One reduction for several sums where the shape allows (as many operations as
                // a single `hsum` for four).
                if RW == 4 && KY == 2 {
                    // SAFETY: the array is [[V; 2]; 4] when RW and KY say so.
                    s::store_hsum_4x2(&*(acc.as_ptr() as *const [[V; 2]; 4]), out, out_rs);
                } else if KY == 4 {
                    for rw in 0..RW {
                        // SAFETY: each row is [V; 4] when KY says so.
                        s::store_hsum4(&*(acc[rw].as_ptr() as *const [V; 4]), out.add(rw * out_rs));
                    }
                } else {
                    for rw in 0..RW {
                        for kk in 0..KY {
                            *out.add(rw * out_rs + kk) = s::hsum(acc[rw][kk]);
                        }
                    }
                }
                RW
            }

            /// Keys per group of [`dec_pv`]: the rows' accumulators are loaded and stored once
            /// per group, each head's V rows of the group read while they are in registers.
            const PV_KEYS: usize = 16;

            /// [`Isa::dec_pv`] for one source type.
            $(#[$feat])?
            #[allow(clippy::too_many_arguments)]
            unsafe fn dec_pv<const W: u8>(p: HeadRows, rows: usize, heads: usize, v: &Cache, a: usize, e: usize, o: HeadRows, pf: Prefetch) {
                let (size, nvec) = (v.size(), v.d / L);
                // The prefetch requests, spread evenly over the (group, head) pairs.
                let mut pf = pf.spread((e - a).div_ceil(PV_KEYS) * heads);
                let mut j0 = a;
                while j0 < e {
                    let j1 = (j0 + PV_KEYS).min(e);
                    for h in 0..heads {
                        pf.step();
                        let vp = v.ptr.add(h * v.head_rs * size);
                        let mut jv = 0;
                        while jv < nvec {
                            // Every run of columns but the last is NV_MAIN (even) vectors, so
                            // each starts on a bf16 block of two (`bf16_slot`).
                            let nv = (nvec - jv).min(NV_MAIN);
                            let mut i = 0;
                            while i < rows {
                                let r = (rows - i).min(4);
                                let args = (p.ptr.add(h * p.hs + i * p.rs) as *const f32, p.rs, vp, v.key_rs, j0, j1, jv * L, o.ptr.add(h * o.hs + i * o.rs + jv * L), o.rs);
                                match nv {
                                    1 => pv_rows::<1, W>(r, args),
                                    2 if NV_MAIN >= 2 => pv_rows::<2, W>(r, args),
                                    3 if NV_MAIN >= 3 => pv_rows::<3, W>(r, args),
                                    _ => pv_rows::<{ NV_MAIN }, W>(r, args),
                                }
                                i += r;
                            }
                            jv += nv;
                        }
                    }
                    j0 = j1;
                }
            }

            /// Arguments of one [`pv_micro`]: `p`, its row stride, V, its key stride, keys
            /// `j0..j1`, the first column, `o`, its row stride.
            type PvArgs = (*const f32, usize, *const u8, usize, usize, usize, usize, *mut f32, usize);

            $(#[$feat])?
            #[inline]
            unsafe fn pv_rows<const NV: usize, const W: u8>(r: usize, args: PvArgs) {
                match r {
                    1 => pv_micro::<1, NV, W>(args),
                    2 => pv_micro::<2, NV, W>(args),
                    3 => pv_micro::<3, NV, W>(args),
                    _ => pv_micro::<4, NV, W>(args),
                }
            }

            /// `R` rows × `NV` vectors of `o`, all in registers over the keys `j0..j1`.
            $(#[$feat])?
            #[inline]
            unsafe fn pv_micro<const R: usize, const NV: usize, const W: u8>((p, p_rs, v, v_rs, j0, j1, col, o, o_rs): PvArgs) {
                let mut acc: [[V; NV]; R] = [[s::zero(); NV]; R];
                for r in 0..R {
                    for c in 0..NV {
                        acc[r][c] = s::load(o.add(r * o_rs + c * L));
                    }
                }
                for j in j0..j1 {
                    let mut bv: [V; NV] = [s::zero(); NV];
                    let mut c = 0;
                    while c < NV {
                        if W == SRC_BF16 && c + 1 < NV {
                            // Two vectors' columns as (even, odd) halves: `o` holds them in that
                            // order (`bf16_slot`; `col` is a whole number of pairs, see dec_pv).
                            (bv[c], bv[c + 1]) = s::load_bf16_pair((v as *const u16).add(j * v_rs + col + c * L));
                            c += 2;
                        } else {
                            bv[c] = load_src::<W>(v, j * v_rs + col + c * L);
                            c += 1;
                        }
                    }
                    for r in 0..R {
                        let av = s::splat(*p.add(r * p_rs + j));
                        for c in 0..NV {
                            acc[r][c] = s::fma(av, bv[c], acc[r][c]);
                        }
                    }
                }
                for r in 0..R {
                    for c in 0..NV {
                        s::store(o.add(r * o_rs + c * L), acc[r][c]);
                    }
                }
            }

            $(#[$feat])?
            unsafe fn widen16(src: *const u16, f16: bool, dst: *mut f32, n: usize) {
                let mut i = 0;
                if f16 {
                    while i + L <= n {
                        s::store(dst.add(i), s::load_f16(src.add(i)));
                        i += L;
                    }
                } else {
                    while i + L <= n {
                        s::store(dst.add(i), s::load_bf16(src.add(i)));
                        i += L;
                    }
                }
                // The tail one element at a time, by the scalar family's own conversions.
                use crate::host::simd::scalar::{load_bf16, load_f16};
                for i in i..n {
                    *dst.add(i) = if f16 { load_f16(src.add(i)) } else { load_bf16(src.add(i)) };
                }
            }

            /// `tanh(y) = (e - 1) / (e + 1)`, `e = 2^(2·log2(e)·y)`; the exponent clamped to
            /// `EXP2_HI` (e finite: inf/inf would be NaN) and `exp2`'s 0 far below make both
            /// tails exact (±1). Absolute error ~1e-7, which is what the scores need.
            $(#[$feat])?
            #[inline]
            unsafe fn tanh(y: V) -> V {
                let e = s::exp2(s::min(s::mul(y, s::splat(2.0 * LOG2_E)), s::splat(crate::host::simd::EXP2_HI)));
                s::div(s::sub(e, s::splat(1.0)), s::add(e, s::splat(1.0)))
            }

            /// `x + log2(e)·add[j..] + alibi·|dist0 - (j..)|` for the vector at column `j`. `ADD`
            /// and `ALIBI` say which terms the row has ([`by_terms`]): testing `ext` per vector
            /// cost 2-4 CPU ms of an S = 2048 forward with a bias, a key mask or ALiBi (measured;
            /// ~3% of it).
            $(#[$feat])?
            #[inline]
            unsafe fn add_ext<const ADD: bool, const ALIBI: bool>(x: V, j: usize, ext: &RowExtra) -> V {
                let mut x = x;
                if ADD {
                    x = s::fma(s::load(ext.add.add(j)), s::splat(LOG2_E), x);
                }
                if ALIBI {
                    let dist = s::sub(s::splat(ext.dist0), s::add(s::load(IOTA.as_ptr()), s::splat(j as f32)));
                    let abs = s::max(dist, s::sub(s::zero(), dist));
                    x = s::fma(abs, s::splat(ext.alibi), x);
                }
                x
            }

            /// `EXT = false` is the original row kernel exactly (the extras compile out), so
            /// calls without optional operands pay nothing for them.
            $(#[$feat])?
            #[inline]
            unsafe fn fwd_row_impl<const EXT: bool, const ADD: bool, const ALIBI: bool>(sp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32, ext: &RowExtra) -> (f32, f32) {
                // The forward packs q with scale·log2(e), so `s` is already `s2` without softcap.
                if softcap > 0.0 {
                    // s2 = c·log2(e)·tanh(x / c) with x = s / log2(e).
                    let inv = s::splat(1.0 / (softcap * LOG2_E));
                    let c2 = s::splat(softcap * LOG2_E);
                    for j in (0..n).step_by(L) {
                        let x = s::load(sp.add(j));
                        let y = s::mul(c2, tanh(s::mul(x, inv)));
                        s::store(sp.add(j), if EXT { add_ext::<ADD, ALIBI>(y, j, ext) } else { y });
                    }
                } else if EXT && a == 0 && b == n && n % (2 * L) == 0 {
                    // A whole row (the common case): the extras' add and the row max in one
                    // pass, so the row is read and written once before the exp2 pass.
                    let (mut m0, mut m1) = (s::splat(f32::NEG_INFINITY), s::splat(f32::NEG_INFINITY));
                    for j in (0..n).step_by(2 * L) {
                        let x0 = add_ext::<ADD, ALIBI>(s::load(sp.add(j)), j, ext);
                        let x1 = add_ext::<ADD, ALIBI>(s::load(sp.add(j + L)), j + L, ext);
                        s::store(sp.add(j), x0);
                        s::store(sp.add(j + L), x1);
                        m0 = s::max(m0, x0);
                        m1 = s::max(m1, x1);
                    }
                    return fwd_row_exp(sp, n, s::hmax(s::max(m0, m1)).max(m_old));
                } else if EXT {
                    for j in (0..n).step_by(L) {
                        s::store(sp.add(j), add_ext::<ADD, ALIBI>(s::load(sp.add(j)), j, ext));
                    }
                }
                // Mask after the softcap (tanh(-inf) would be finite).
                for j in (0..a).chain(b..n) {
                    *sp.add(j) = f32::NEG_INFINITY;
                }
                // Row max; two accumulators halve the dependency chain.
                let (mut m0, mut m1) = (s::splat(f32::NEG_INFINITY), s::splat(f32::NEG_INFINITY));
                let mut j = 0;
                while j + 2 * L <= n {
                    m0 = s::max(m0, s::load(sp.add(j)));
                    m1 = s::max(m1, s::load(sp.add(j + L)));
                    j += 2 * L;
                }
                if j < n {
                    m0 = s::max(m0, s::load(sp.add(j)));
                }
                let m_new = s::hmax(s::max(m0, m1)).max(m_old);
                if EXT {
                    fwd_row_exp(sp, n, m_new)
                } else {
                    fwd_row_exp_finite(sp, n, m_new)
                }
            }

            /// The end of [`fwd_row_impl`] with extras: a row whose every score so far is `-inf`
            /// (key mask, `-inf` bias) gets no weight (and no `-inf - -inf` NaN).
            $(#[$feat])?
            #[inline]
            unsafe fn fwd_row_exp(sp: *mut f32, n: usize, m_new: f32) -> (f32, f32) {
                if m_new == f32::NEG_INFINITY {
                    // Everything seen so far is -inf (key mask, -inf bias): no weight, and no
                    // `-inf - -inf` NaN below.
                    for j in 0..n {
                        *sp.add(j) = 0.0;
                    }
                    return (f32::NEG_INFINITY, 0.0);
                }
                fwd_row_exp_finite(sp, n, m_new)
            }

            /// `p = 2^(s2 - m)` in place (masked: 2^-inf -> exactly 0), and `(m, Σp)`.
            $(#[$feat])?
            #[inline]
            unsafe fn fwd_row_exp_finite(sp: *mut f32, n: usize, m_new: f32) -> (f32, f32) {
                // p = 2^(s2 - m) (masked: 2^-inf -> exactly 0) and its sum.
                let mneg = s::splat(m_new);
                let mut sum = s::zero();
                for j in (0..n).step_by(L) {
                    let p = s::exp2(s::sub(s::load(sp.add(j)), mneg));
                    sum = s::add(sum, p);
                    s::store(sp.add(j), p);
                }
                (m_new, s::hsum(sum))
            }

            $(#[$feat])?
            #[inline]
            #[allow(clippy::too_many_arguments)]
            unsafe fn bwd_row_impl<const EXT: bool, const DROP: bool, const ADD: bool, const ALIBI: bool>(sp: *mut f32, dp: *const f32, pp: *mut f32, dsp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: &RowExtra, km: *const f32) {
                let l2 = s::splat(lse2);
                let dv = s::splat(di);
                // A key hidden by the extras has z2 = -inf: exp2 clamps it to exactly 0, so p,
                // ds and dx are 0 there with no NaN.
                if softcap > 0.0 {
                    let inv = s::splat(1.0 / softcap);
                    let c2 = s::splat(softcap * LOG2_E);
                    let one = s::splat(1.0);
                    for j in (0..n).step_by(L) {
                        let t = tanh(s::mul(s::load(sp.add(j)), inv));
                        let z2 = s::mul(c2, t);
                        let p = s::exp2(s::sub(if EXT { add_ext::<ADD, ALIBI>(z2, j, ext) } else { z2 }, l2));
                        let (p, ds) = if DROP { drop_ds(p, s::load(km.add(j)), s::load(dp.add(j)), dv) } else { (p, s::mul(p, s::sub(s::load(dp.add(j)), dv))) };
                        if EXT && !dsp.is_null() {
                            s::store(dsp.add(j), ds);
                        }
                        // ds/dx = 1 - (s/c)² = 1 - t².
                        let dx = s::mul(ds, s::sub(one, s::mul(t, t)));
                        s::store(pp.add(j), p);
                        s::store(sp.add(j), dx);
                    }
                } else {
                    let l2e = s::splat(LOG2_E);
                    for j in (0..n).step_by(L) {
                        let z2 = s::mul(s::load(sp.add(j)), l2e);
                        let p = s::exp2(s::sub(if EXT { add_ext::<ADD, ALIBI>(z2, j, ext) } else { z2 }, l2));
                        let (p, ds) = if DROP { drop_ds(p, s::load(km.add(j)), s::load(dp.add(j)), dv) } else { (p, s::mul(p, s::sub(s::load(dp.add(j)), dv))) };
                        if EXT && !dsp.is_null() {
                            s::store(dsp.add(j), ds);
                        }
                        s::store(pp.add(j), p);
                        s::store(sp.add(j), ds);
                    }
                }
                for j in (0..a).chain(b..n) {
                    *pp.add(j) = 0.0;
                    *sp.add(j) = 0.0;
                    if EXT && !dsp.is_null() {
                        *dsp.add(j) = 0.0;
                    }
                }
            }

            /// Under dropout: `(P ∘ km, P ∘ (km·dP - di))` with `km = M·s` (a dropped entry keeps
            /// its softmax gradient `-P·di`).
            $(#[$feat])?
            #[inline]
            unsafe fn drop_ds(p: V, km: V, dpv: V, di: V) -> (V, V) {
                let pk = s::mul(p, km);
                (pk, s::sub(s::mul(pk, dpv), s::mul(p, di)))
            }

            $(#[$feat])?
            unsafe fn fwd_row(sp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32) -> (f32, f32) {
                fwd_row_impl::<false, false, false>(sp, n, a, b, softcap, m_old, &NO_EXT)
            }

            $(#[$feat])?
            #[allow(clippy::too_many_arguments)]
            unsafe fn fwd_row_ext(sp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32, ext: RowExtra) -> (f32, f32) {
                by_terms!(ext, fwd_row_impl::<true>(sp, n, a, b, softcap, m_old, &ext))
            }

            $(#[$feat])?
            #[allow(clippy::too_many_arguments)]
            unsafe fn bwd_row(sp: *mut f32, dp: *const f32, pp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32) {
                bwd_row_impl::<false, false, false, false>(sp, dp, pp, core::ptr::null_mut(), n, a, b, softcap, lse2, di, &NO_EXT, core::ptr::null())
            }

            $(#[$feat])?
            #[allow(clippy::too_many_arguments)]
            unsafe fn bwd_row_ext(sp: *mut f32, dp: *const f32, pp: *mut f32, dsp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: RowExtra) {
                by_terms!(ext, bwd_row_impl::<true, false>(sp, dp, pp, dsp, n, a, b, softcap, lse2, di, &ext, core::ptr::null()))
            }

            $(#[$feat])?
            unsafe fn scale_row(x: *mut f32, n: usize, alpha: f32) {
                let a = s::splat(alpha);
                let mut j = 0;
                while j + L <= n {
                    s::store(x.add(j), s::mul(s::load(x.add(j)), a));
                    j += L;
                }
                for j in j..n {
                    *x.add(j) *= alpha;
                }
            }

            $(#[$feat])?
            #[allow(clippy::too_many_arguments)]
            unsafe fn bwd_row_drop(sp: *mut f32, dp: *const f32, pp: *mut f32, dsp: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: RowExtra, km: *const f32) {
                by_terms!(ext, bwd_row_impl::<true, true>(sp, dp, pp, dsp, n, a, b, softcap, lse2, di, &ext, km))
            }

            impl Isa for Kernels {
                const LANES: usize = L;
                unsafe fn gemm(g: Gemm) {
                    gemm(g)
                }
                #[allow(clippy::too_many_arguments)]
                unsafe fn dec_scores(q: HeadRows, rows: usize, heads: usize, k: &Cache, n: usize, out: HeadRows, pf: Prefetch) {
                    match k.src {
                        SRC_F32 => dec_scores::<SRC_F32>(q, rows, heads, k, n, out, pf),
                        SRC_BF16 => dec_scores::<SRC_BF16>(q, rows, heads, k, n, out, pf),
                        _ => dec_scores::<SRC_F16>(q, rows, heads, k, n, out, pf),
                    }
                }
                #[allow(clippy::too_many_arguments)]
                unsafe fn dec_pv(p: HeadRows, rows: usize, heads: usize, v: &Cache, a: usize, e: usize, o: HeadRows, pf: Prefetch) {
                    match v.src {
                        SRC_F32 => dec_pv::<SRC_F32>(p, rows, heads, v, a, e, o, pf),
                        SRC_BF16 => dec_pv::<SRC_BF16>(p, rows, heads, v, a, e, o, pf),
                        _ => dec_pv::<SRC_F16>(p, rows, heads, v, a, e, o, pf),
                    }
                }
                unsafe fn widen16(src: *const u16, f16: bool, dst: *mut f32, n: usize) {
                    widen16(src, f16, dst, n)
                }
                unsafe fn scale_row(x: *mut f32, n: usize, alpha: f32) {
                    scale_row(x, n, alpha)
                }
                unsafe fn fwd_row(s: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32) -> (f32, f32) {
                    fwd_row(s, n, a, b, softcap, m_old)
                }
                #[allow(clippy::too_many_arguments)]
                unsafe fn bwd_row(s: *mut f32, dp: *const f32, p: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32) {
                    bwd_row(s, dp, p, n, a, b, softcap, lse2, di)
                }
                #[allow(clippy::too_many_arguments)]
                unsafe fn fwd_row_ext(s: *mut f32, n: usize, a: usize, b: usize, softcap: f32, m_old: f32, ext: RowExtra) -> (f32, f32) {
                    fwd_row_ext(s, n, a, b, softcap, m_old, ext)
                }
                #[allow(clippy::too_many_arguments)]
                unsafe fn bwd_row_ext(s: *mut f32, dp: *const f32, p: *mut f32, ds: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: RowExtra) {
                    bwd_row_ext(s, dp, p, ds, n, a, b, softcap, lse2, di, ext)
                }
                #[allow(clippy::too_many_arguments)]
                unsafe fn bwd_row_drop(s: *mut f32, dp: *const f32, p: *mut f32, ds: *mut f32, n: usize, a: usize, b: usize, softcap: f32, lse2: f32, di: f32, ext: RowExtra, km: *const f32) {
                    bwd_row_drop(s, dp, p, ds, n, a, b, softcap, lse2, di, ext, km)
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
isa_kernels!(avx512, avx512, 6, 4, #[target_feature(enable = "avx512f")]);
#[cfg(target_arch = "x86_64")]
isa_kernels!(avx2, avx2, 6, 2, #[target_feature(enable = "avx2,fma,f16c")]);
isa_kernels!(scalar, scalar, 4, 4);
