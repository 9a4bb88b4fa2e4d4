//! Per-ISA vector primitives: the same small set of operations on `f32` lanes for AVX-512,
//! AVX2+FMA and plain scalar code. `kernels.rs` writes every kernel once against these names and
//! instantiates it per module, under that module's `target_feature`, so the primitives inline.
//!
//! `exp2` is a Cephes-style polynomial (range reduction to `[-0.5, 0.5]`, degree-6 polynomial,
//! exponent built in integer bits): ~2 ulp over the range we use, branch-free, and exactly 0 for
//! inputs <= -127 (so masked `-inf` scores contribute nothing, with no denormals on the way).

/// Cephes `exp2f` coefficients: `2^f ≈ 1 + f·P(f)` on `[-0.5, 0.5]` (kept as published).
#[allow(clippy::excessive_precision)]
pub(crate) const EXP2_P: [f32; 6] = [
    1.535_336_2e-4,
    1.339_887_4e-3,
    9.618_437_4e-3,
    5.550_332_5e-2,
    2.402_264_8e-1,
    6.931_472e-1,
];
/// Inputs are clamped to `[EXP2_LO, EXP2_HI]`; `2^-127` is built as the all-zero bit pattern, i.e. 0.
pub(crate) const EXP2_LO: f32 = -127.0;
pub(crate) const EXP2_HI: f32 = 127.0;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use super::{EXP2_HI, EXP2_LO, EXP2_P};
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
    /// `out[0..4]` = the sums of `v[0..4]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_hsum4(v: &[V; 4], out: *mut f32) {
        for (k, &x) in v.iter().enumerate() {
            *out.add(k) = hsum(x);
        }
    }
    /// `out[i·rs + k]` = the sum of `acc[i][k]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn store_hsum_4x2(acc: &[[V; 2]; 4], out: *mut f32, rs: usize) {
        for (i, row) in acc.iter().enumerate() {
            for (k, &x) in row.iter().enumerate() {
                *out.add(i * rs + k) = hsum(x);
            }
        }
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp2(x: V) -> V {
        let x = _mm512_max_ps(_mm512_min_ps(x, splat(EXP2_HI)), splat(EXP2_LO));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x);
        let f = _mm512_sub_ps(x, n);
        let mut y = splat(EXP2_P[0]);
        for &c in &EXP2_P[1..] {
            y = fma(y, f, splat(c));
        }
        y = fma(y, f, splat(1.0));
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(bits))
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
