//! Per-ISA vector primitives: the same small set of operations on `f32` lanes for AVX-512,
//! AVX2+FMA and plain scalar code. `kernels.rs` writes every kernel once against these names and
//! instantiates it per module, under that module's `target_feature`, so the primitives inline.
//!
//! `exp2` is a Cephes-style polynomial (range reduction to `[-0.5, 0.5]`, degree-5 polynomial,
//! then the exponent: built in integer bits on AVX2 and scalar, `VSCALEFPS` on AVX-512): ~2 ulp
//! over the range we use, branch-free, and exactly 0 for inputs <= -127 (AVX2, scalar) or < -126
//! (AVX-512), so masked `-inf` scores contribute nothing, with no denormals on the way. Between
//! the families the results agree bit for bit on `[-126, 127]`, and are below 2^-125 beneath it.
//! Above 127 (never an attention score: they are `≤ 0` after the max) AVX-512 gives the true power
//! up to inf, the others 2^127·2^f; a NaN stays NaN on AVX-512.

/// `2^f ≈ 1 + f·P(f)` on `[-0.5, 0.5]`, `P` of degree 4 (highest first): a relative-error
/// minimax fit, 1.1e-7 with these f32 coefficients, i.e. as close as f32 evaluation gets (the
/// degree-5 Cephes `P` this replaced was 1.6e-8 in exact arithmetic, no better once evaluated in
/// f32, and one FMA more in every row pass).
#[allow(clippy::excessive_precision)]
pub(crate) const EXP2_P: [f32; 5] = [1.326_470_985e-3, 9.671_507_403e-3, 5.550_733_581e-2, 2.402_224_243e-1, 6.931_470_037e-1];
/// `2^f ≈ 1 + f·Q(f)` on `[0, 1)`, `Q` of degree 2 (highest first), for the bf16 rows' `p`
/// only: a relative fit (Lawson's minimax) to [`EXP2_FLOOR_REL`] once evaluated in f32, with a
/// mean signed error of 7e-6 over uniform `f`. Those `p` are rounded to bf16 next, an error of up
/// to 2^-8 relative (2^-9 typically), 2^4.5 above the fit's. `o`'s error against float64 measured
/// the same to two digits as with the degree-3 `Q` before it in 11 of 12 cases and lower in the
/// 12th (S = 2048). Each degree is an FMA in a loop bound by the two vector ports: degree 3 → 2
/// took the row loop alone about 10% less and the bf16 forward 2-5% (one thread, Emerald Rapids;
/// bench/RESULTS.md). `VSCALEFPS` takes `floor(x)` of its exponent operand itself, so with this
/// reduction `x` goes in as it is: [`avx512::exp2_floor`] is also a µop shorter than
/// [`avx512::exp2_dq`] (no `n = x - f`).
#[allow(clippy::excessive_precision)]
pub(crate) const EXP2_FLOOR_Q: [f32; 3] = [7.706_642_818e-2, 2.276_456_599e-1, 6.951_166_359e-1];
/// A bound on [`EXP2_FLOOR_Q`]'s relative error in f32 over `[0, 1)` (8.57e-5 at its worst:
/// 2^-13.5), and so on `exp2_floor`'s (`tests.rs`).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const EXP2_FLOOR_REL: f64 = 8.7e-5;
/// Inputs are clamped to `[EXP2_LO, EXP2_HI]`; `2^-127` is built as the all-zero bit pattern, i.e. 0.
pub(crate) const EXP2_LO: f32 = -127.0;
pub(crate) const EXP2_HI: f32 = 127.0;
/// AVX-512 `exp2` is 0 below this: from it up, `n ≥ -126` with `f ≥ 0` wherever `n = -126`, so
/// every nonzero result is a normal number (a denormal would cost a microcode assist in the sums).
pub(crate) const EXP2_ZERO_BELOW: f32 = -126.0;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{EXP2_FLOOR_Q, EXP2_P, EXP2_ZERO_BELOW};
    use core::arch::x86_64::*;

    pub type V = __m512;
    pub const L: usize = 16;

    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn zero() -> V {
        _mm512_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn splat(x: f32) -> V {
        _mm512_set1_ps(x)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn load(p: *const f32) -> V {
        _mm512_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store(p: *mut f32, v: V) {
        _mm512_storeu_ps(p, v)
    }
    /// 16 bf16 (the top halves of f32s) widened.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn load_bf16(p: *const u16) -> V {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))))
    }
    /// 32 bf16 widened with no shuffle: each 32-bit lane holds two of them, the even-indexed one
    /// in its low half (shifted up) and the odd one in its high half (masked), so the result is
    /// `(even-indexed, odd-indexed)` elements. `vpmovzxwd` (what [`load_bf16`] takes) runs on
    /// the one shuffle port the 512-bit FMAs share, and needs a shift after it, per 16.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn load_bf16_pair(p: *const u16) -> (V, V) {
        let x = _mm512_loadu_si512(p as *const __m512i);
        let even = _mm512_slli_epi32::<16>(x);
        let odd = _mm512_and_si512(x, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
        (_mm512_castsi512_ps(even), _mm512_castsi512_ps(odd))
    }
    /// 16 f16 widened (exact).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn load_f16(p: *const u16) -> V {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    /// `a * b + c`
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma(a: V, b: V, c: V) -> V {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn add(a: V, b: V) -> V {
        _mm512_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn sub(a: V, b: V) -> V {
        _mm512_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn mul(a: V, b: V) -> V {
        _mm512_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn div(a: V, b: V) -> V {
        _mm512_div_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn max(a: V, b: V) -> V {
        _mm512_max_ps(a, b)
    }
    /// `a < b ? a : b`: `b` where either is NaN (`VMINPS`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn min(a: V, b: V) -> V {
        _mm512_min_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn hmax(a: V) -> f32 {
        _mm512_reduce_max_ps(a)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn hsum(a: V) -> f32 {
        _mm512_reduce_add_ps(a)
    }
    // Several sums at once: the vectors are folded together, each step halving their width and
    // packing two into one register, so one shuffle pair and one add serve two sums at every step.
    // A lone `hsum` takes 8 operations (the decode scores take one per query row and key: as many
    // as their FMAs at D = 128); eight of them folded take 25, four take 15.

    /// `[x.lo + x.hi, y.lo + y.hi]` (256-bit halves).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold_halves(x: V, y: V) -> V {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(x, y), _mm512_shuffle_f32x4::<0xEE>(x, y))
    }
    /// Two [`fold_halves`] results `[a, b]` and `[c, d]` folded once more: 128-bit quarters
    /// `[a, b, c, d]`, each with the four lanes that sum to its vector.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold_quarters(x: V, y: V) -> V {
        _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(x, y), _mm512_shuffle_f32x4::<0xDD>(x, y))
    }
    /// Quarter `k` of `u` and of `w` ([`fold_quarters`] results) summed within: quarter `k` of
    /// the result is `[u_k, u_k, w_k, w_k]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn quarter_sums(u: V, w: V) -> V {
        let r = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(u, w), _mm512_shuffle_ps::<0xEE>(u, w));
        _mm512_add_ps(r, _mm512_permute_ps::<0xB1>(r))
    }
    /// `out[0..4]` = the sums of `v[0..4]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_hsum4(v: &[V; 4], out: *mut f32) {
        let u = fold_quarters(fold_halves(v[0], v[1]), fold_halves(v[2], v[3]));
        let s = quarter_sums(u, u);
        // Lane 0 of each quarter.
        let at = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(at, s)));
    }
    /// `out[i·rs + k]` = the sum of `acc[i][k]`: each row's two sums in one 8-byte store.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_hsum_4x2(acc: &[[V; 2]; 4], out: *mut f32, rs: usize) {
        // Quarter i of u (w) sums to acc[i][0] (acc[i][1]).
        let u = fold_quarters(fold_halves(acc[0][0], acc[1][0]), fold_halves(acc[2][0], acc[3][0]));
        let w = fold_quarters(fold_halves(acc[0][1], acc[1][1]), fold_halves(acc[2][1], acc[3][1]));
        // Lanes 0 and 2 of each quarter: row 0's two sums, row 1's, ...
        let at = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        let s = _mm512_permutexvar_ps(at, quarter_sums(u, w));
        let (lo, hi) = (_mm_castps_pd(_mm512_castps512_ps128(s)), _mm_castps_pd(_mm512_extractf32x4_ps::<1>(s)));
        _mm_storel_pd(out as *mut f64, lo);
        _mm_storeh_pd(out.add(rs) as *mut f64, lo);
        _mm_storel_pd(out.add(2 * rs) as *mut f64, hi);
        _mm_storeh_pd(out.add(3 * rs) as *mut f64, hi);
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp2(x: V) -> V {
        // `VSCALEFPS` puts n into the exponent with the range handled (overflow to inf), where
        // building the bits takes a clamp, a conversion, an add, a shift and a multiply; lanes
        // below EXP2_ZERO_BELOW are zeroed by its mask, which also covers -inf (whose f is
        // NaN). 11 µops where the bit-built form took 15: the forward's row pass is mostly this.
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        exp2_of(x, n, _mm512_sub_ps(x, n))
    }

    /// [`exp2`] with AVX512-DQ: `VREDUCEPS` gives `f = x - round(x)` in one µop where
    /// `VRNDSCALEPS` takes two, and `n = x - f` is `round(x)` exactly, so the results are
    /// [`exp2`]'s bit for bit. For kernels compiled with DQ (the lowp rows next to AVX512-BF16,
    /// which every CPU with it also has).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn exp2_dq(x: V) -> V {
        let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        exp2_of(x, _mm512_sub_ps(x, f), f)
    }

    /// `2^x` reduced to `f = x - floor(x)` in `[0, 1)` by `VREDUCEPS` (rounding down) and
    /// [`EXP2_FLOOR_Q`], then `VSCALEFPS` by `x` itself (it scales by `2^floor(x)`): 8 µops to
    /// [`exp2_dq`]'s 11, for the lowp forward's one-pass bf16 rows. To [`super::EXP2_FLOOR_REL`]
    /// relative, not [`exp2`]'s 1.7e-7 (`tests.rs`), and the same at the edges: 0 below
    /// [`EXP2_ZERO_BELOW`] and for `-inf`, inf for `+inf`, NaN for NaN, every nonzero result
    /// normal; `x` above 0 (a lowp row above its reference max) is good up to inf.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq")]
    pub unsafe fn exp2_floor(x: V) -> V {
        let f = _mm512_reduce_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(x);
        poly_scalef(&EXP2_FLOOR_Q, x, x, f)
    }

    /// `2^x` from `n = round(x)` and `f = x - n`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp2_of(x: V, n: V, f: V) -> V {
        poly_scalef(&EXP2_P, x, n, f)
    }

    /// `(1 + f·q(f))·2^floor(n)`, `q` the polynomial `coef` (highest first), 0 where
    /// `x` is below [`EXP2_ZERO_BELOW`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn poly_scalef<const N: usize>(coef: &[f32; N], x: V, n: V, f: V) -> V {
        let mut y = splat(coef[0]);
        for &c in &coef[1..] {
            y = fma(y, f, splat(c));
        }
        y = fma(y, f, splat(1.0));
        // Not < (so NaN lanes keep their NaN).
        let live = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, splat(EXP2_ZERO_BELOW));
        _mm512_maskz_scalef_ps(live, y, n)
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{EXP2_HI, EXP2_LO, EXP2_P};
    use core::arch::x86_64::*;

    pub type V = __m256;
    pub const L: usize = 8;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn zero() -> V {
        _mm256_setzero_ps()
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn splat(x: f32) -> V {
        _mm256_set1_ps(x)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn load(p: *const f32) -> V {
        _mm256_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn store(p: *mut f32, v: V) {
        _mm256_storeu_ps(p, v)
    }
    /// 8 bf16 (the top halves of f32s) widened.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn load_bf16(p: *const u16) -> V {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
    }
    /// 16 bf16 as `(even-indexed, odd-indexed)` elements widened, with no shuffle (see the
    /// AVX-512 `load_bf16_pair`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn load_bf16_pair(p: *const u16) -> (V, V) {
        let x = _mm256_loadu_si256(p as *const __m256i);
        let even = _mm256_slli_epi32::<16>(x);
        let odd = _mm256_and_si256(x, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
        (_mm256_castsi256_ps(even), _mm256_castsi256_ps(odd))
    }
    /// 8 f16 widened (exact; F16C, which every AVX2 CPU has and `available()` checks).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn load_f16(p: *const u16) -> V {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma(a: V, b: V, c: V) -> V {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn add(a: V, b: V) -> V {
        _mm256_add_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn sub(a: V, b: V) -> V {
        _mm256_sub_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn mul(a: V, b: V) -> V {
        _mm256_mul_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn div(a: V, b: V) -> V {
        _mm256_div_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn max(a: V, b: V) -> V {
        _mm256_max_ps(a, b)
    }
    /// `a < b ? a : b`: `b` where either is NaN (`VMINPS`).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn min(a: V, b: V) -> V {
        _mm256_min_ps(a, b)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hmax(a: V) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn hsum(a: V) -> f32 {
        let m = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let m = _mm_add_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_add_ss(m, _mm_shuffle_ps::<1>(m, m));
        _mm_cvtss_f32(m)
    }
    /// The sums of `a`, `b`, `c`, `d` in one vector: three `hadd`s and one add reduce all four,
    /// where four [`hsum`]s take six operations each.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum4v(a: V, b: V, c: V, d: V) -> __m128 {
        let t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
    }
    /// `out[0..4]` = the sums of `v[0..4]`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn store_hsum4(v: &[V; 4], out: *mut f32) {
        _mm_storeu_ps(out, hsum4v(v[0], v[1], v[2], v[3]));
    }
    /// `out[i·rs + k]` = the sum of `acc[i][k]`: each row's two sums in one 8-byte store.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn store_hsum_4x2(acc: &[[V; 2]; 4], out: *mut f32, rs: usize) {
        let k0 = hsum4v(acc[0][0], acc[1][0], acc[2][0], acc[3][0]);
        let k1 = hsum4v(acc[0][1], acc[1][1], acc[2][1], acc[3][1]);
        let (lo, hi) = (_mm_castps_pd(_mm_unpacklo_ps(k0, k1)), _mm_castps_pd(_mm_unpackhi_ps(k0, k1)));
        _mm_storel_pd(out as *mut f64, lo);
        _mm_storeh_pd(out.add(rs) as *mut f64, lo);
        _mm_storel_pd(out.add(2 * rs) as *mut f64, hi);
        _mm_storeh_pd(out.add(3 * rs) as *mut f64, hi);
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp2(x: V) -> V {
        let x = _mm256_max_ps(_mm256_min_ps(x, splat(EXP2_HI)), splat(EXP2_LO));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm256_sub_ps(x, n);
        let mut y = splat(EXP2_P[0]);
        for &c in &EXP2_P[1..] {
            y = fma(y, f, splat(c));
        }
        y = fma(y, f, splat(1.0));
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(y, _mm256_castsi256_ps(bits))
    }
}

/// Portable fallback (one lane). Same polynomial, so results match the SIMD paths closely.
pub(crate) mod scalar {
    use super::{EXP2_HI, EXP2_LO, EXP2_P};

    pub type V = f32;
    pub const L: usize = 1;

    #[inline(always)]
    pub unsafe fn zero() -> V {
        0.0
    }
    #[inline(always)]
    pub unsafe fn splat(x: f32) -> V {
        x
    }
    #[inline(always)]
    pub unsafe fn load(p: *const f32) -> V {
        *p
    }
    #[inline(always)]
    pub unsafe fn store(p: *mut f32, v: V) {
        *p = v
    }
    #[inline(always)]
    pub unsafe fn load_bf16(p: *const u16) -> V {
        f32::from_bits(u32::from(*p) << 16)
    }
    /// Two bf16 as `(even-indexed, odd-indexed)`: with one lane, the elements in order.
    #[inline(always)]
    pub unsafe fn load_bf16_pair(p: *const u16) -> (V, V) {
        (load_bf16(p), load_bf16(p.add(1)))
    }
    #[inline(always)]
    pub unsafe fn load_f16(p: *const u16) -> V {
        half::f16::from_bits(*p).to_f32()
    }
    #[inline(always)]
    pub unsafe fn fma(a: V, b: V, c: V) -> V {
        // Plain multiply-add: `mul_add` would call libm's fmaf on targets without FMA.
        a * b + c
    }
    #[inline(always)]
    pub unsafe fn add(a: V, b: V) -> V {
        a + b
    }
    #[inline(always)]
    pub unsafe fn sub(a: V, b: V) -> V {
        a - b
    }
    #[inline(always)]
    pub unsafe fn mul(a: V, b: V) -> V {
        a * b
    }
    #[inline(always)]
    pub unsafe fn div(a: V, b: V) -> V {
        a / b
    }
    #[inline(always)]
    pub unsafe fn max(a: V, b: V) -> V {
        a.max(b)
    }
    /// `a < b ? a : b`: `b` where either is NaN, as `VMINPS`.
    #[inline(always)]
    pub unsafe fn min(a: V, b: V) -> V {
        if a < b {
            a
        } else {
            b
        }
    }
    #[inline(always)]
    pub unsafe fn hmax(a: V) -> f32 {
        a
    }
    #[inline(always)]
    pub unsafe fn hsum(a: V) -> f32 {
        a
    }
    #[inline(always)]
    pub unsafe fn store_hsum4(v: &[V; 4], out: *mut f32) {
        for (k, &x) in v.iter().enumerate() {
            *out.add(k) = x;
        }
    }
    #[inline(always)]
    pub unsafe fn store_hsum_4x2(acc: &[[V; 2]; 4], out: *mut f32, rs: usize) {
        for (i, row) in acc.iter().enumerate() {
            for (k, &x) in row.iter().enumerate() {
                *out.add(i * rs + k) = x;
            }
        }
    }
    #[inline(always)]
    pub unsafe fn exp2(x: V) -> V {
        let x = x.clamp(EXP2_LO, EXP2_HI);
        let n = x.round();
        let f = x - n;
        let mut y = EXP2_P[0];
        for &c in &EXP2_P[1..] {
            y = y * f + c;
        }
        y = y * f + 1.0;
        y * f32::from_bits(((n as i32 + 127) as u32) << 23)
    }
}
