//! The dropout mask of one tile row, as the Host kernels apply it: `keep_scale[c]` = `scale` where
//! entry `(b, h, i, j0 + c)` is kept and `0` where it is dropped (`crate::philox` defines the
//! bits; this only computes them fast).
//!
//! Cost is what matters here: a tile row of `BC` keys takes `BC / 4` Philox4x32-10 calls, about as
//! much integer work as the row's share of the score GEMM. The AVX2 generator runs eight Philox
//! calls at once (eight consecutive key quads of one row, so their counters differ only in word
//! 0), compares the draws with the threshold without a branch and transposes the four output
//! words into key order. The scalar generator is the reference for it (see the tests).

use crate::philox::{dropout_draws4, Dropout};

/// The `Dropout` the kernels carry when there is none (never read then: the instances without
/// dropout do not look at it).
pub(crate) const NO_DROPOUT: Dropout = Dropout { key: [0, 0], rate: 0.0, threshold: 0, scale: 1.0 };

/// Writes the keep scale of keys `j0 .. j0 + n` of row `(b, h, i)` to `out[0..n]` (the `STORE`
/// instances), or multiplies `out[0..n]` by it in place (the `MUL` instances: the forward scales
/// its probability row without a scratch pass). `j0` and `n` are multiples of 4 (tiles start on
/// key quads and are padded to whole quads).
pub(crate) type KeepRowFn = unsafe fn(out: *mut f32, d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize);

/// What a generator does with the keep scales.
pub(crate) const STORE: bool = false;
pub(crate) const MUL: bool = true;

/// The scalar generator: one Philox call per key quad.
///
/// # Safety
/// `out` holds `n` floats.
pub(crate) unsafe fn keep_row_scalar<const MULTIPLY: bool>(out: *mut f32, d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize) {
    debug_assert!(j0 % 4 == 0 && n % 4 == 0);
    for q in 0..n / 4 {
        let x = dropout_draws4(d.key, b, h, i, ((j0 >> 2) + q) as u32);
        for (w, &draw) in x.iter().enumerate() {
            let k = if draw >= d.threshold { d.scale } else { 0.0 };
            let o = out.add(4 * q + w);
            *o = if MULTIPLY { *o * k } else { k };
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use crate::philox::{Dropout, M0, M1, W0, W1};

    /// `(hi, lo)` of the eight 32×32-bit products `a·m` (`m` splatted). `_mm256_mul_epu32`
    /// multiplies the even 32-bit lanes into 64 bits, so odd lanes go through a shifted copy.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn mulhilo(a: __m256i, m: __m256i) -> (__m256i, __m256i) {
        let even = _mm256_mul_epu32(a, m);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), m);
        let lo = _mm256_blend_epi32::<0b1010_1010>(even, _mm256_slli_epi64::<32>(odd));
        let hi = _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(even), odd);
        (hi, lo)
    }

    #[inline]
    fn mulhilo1(a: u32, b: u32) -> (u32, u32) {
        let p = u64::from(a) * u64::from(b);
        ((p >> 32) as u32, p as u32)
    }

    /// Philox4x32-10 of the counters `(q0 + lane, i, h, b)`, lanes 0..8: the output words
    /// `(x0, x1, x2, x3)`, lane `l` of `x_w` being the draw of key `4·(q0 + l) + w`.
    ///
    /// Words 1-3 of the counter are the same in every lane, so round 0's second product and
    /// round 1's first are lane-independent and done once in scalar.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn philox8(key: [u32; 2], b: u32, h: u32, i: u32, q0: u32) -> [__m256i; 4] {
        let (m0, m1) = (_mm256_set1_epi32(M0 as i32), _mm256_set1_epi32(M1 as i32));
        let c0 = _mm256_add_epi32(_mm256_set1_epi32(q0 as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let [mut k0, mut k1] = key;
        // Round 0: c = (q, i, h, b).
        let (hi0, lo0) = mulhilo(c0, m0);
        let (hi1, lo1) = mulhilo1(M1, h);
        let c0s = hi1 ^ i ^ k0; // lane-independent
        let c1s = lo1;
        let c2 = _mm256_xor_si256(hi0, _mm256_set1_epi32((b ^ k1) as i32));
        let c3 = lo0;
        // Round 1: the product of word 0 is lane-independent.
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
        let (hi0s, lo0s) = mulhilo1(M0, c0s);
        let (hi1, lo1) = mulhilo(c2, m1);
        let mut c = [
            _mm256_xor_si256(hi1, _mm256_set1_epi32((c1s ^ k0) as i32)),
            lo1,
            _mm256_xor_si256(c3, _mm256_set1_epi32((hi0s ^ k1) as i32)),
            _mm256_set1_epi32(lo0s as i32),
        ];
        for _ in 2..10 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
            let (hi0, lo0) = mulhilo(c[0], m0);
            let (hi1, lo1) = mulhilo(c[2], m1);
            c = [
                _mm256_xor_si256(_mm256_xor_si256(hi1, c[1]), _mm256_set1_epi32(k0 as i32)),
                lo1,
                _mm256_xor_si256(_mm256_xor_si256(hi0, c[3]), _mm256_set1_epi32(k1 as i32)),
                lo0,
            ];
        }
        c
    }

    /// The AVX2 generator: [`super::KeepRowFn`] eight key quads (32 keys) per step.
    ///
    /// # Safety
    /// `out` holds `n` floats; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn keep_row<const MULTIPLY: bool>(out: *mut f32, d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize) {
        debug_assert!(j0 % 4 == 0 && n % 4 == 0);
        // keep iff draw >= T, unsigned: max(draw, T) == draw.
        let t = _mm256_set1_epi32(d.threshold as i32);
        let scale = _mm256_set1_ps(d.scale);
        let keep = |x: __m256i| _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_max_epu32(x, t), x)), scale);
        let put = |o: *mut f32, k: __m256| {
            let v = if MULTIPLY { _mm256_mul_ps(_mm256_loadu_ps(o), k) } else { k };
            _mm256_storeu_ps(o, v)
        };
        let mut c = 0;
        while c + 32 <= n {
            let [x0, x1, x2, x3] = philox8(d.key, b, h, i, ((j0 + c) >> 2) as u32);
            // 4×8 transpose into key order (see the module comment): after the unpacks each
            // 128-bit half holds four consecutive keys' words.
            let t0 = _mm256_unpacklo_epi32(x0, x1);
            let t1 = _mm256_unpackhi_epi32(x0, x1);
            let t2 = _mm256_unpacklo_epi32(x2, x3);
            let t3 = _mm256_unpackhi_epi32(x2, x3);
            let u0 = _mm256_unpacklo_epi64(t0, t2); // keys 0-3 | 16-19
            let u1 = _mm256_unpackhi_epi64(t0, t2); // keys 4-7 | 20-23
            let u2 = _mm256_unpacklo_epi64(t1, t3); // keys 8-11 | 24-27
            let u3 = _mm256_unpackhi_epi64(t1, t3); // keys 12-15 | 28-31
            let o = out.add(c);
            put(o, keep(_mm256_permute2x128_si256::<0x20>(u0, u1)));
            put(o.add(8), keep(_mm256_permute2x128_si256::<0x20>(u2, u3)));
            put(o.add(16), keep(_mm256_permute2x128_si256::<0x31>(u0, u1)));
            put(o.add(24), keep(_mm256_permute2x128_si256::<0x31>(u2, u3)));
            c += 32;
        }
        if c < n {
            super::keep_row_scalar::<MULTIPLY>(out.add(c), d, b, h, i, j0 + c, n - c);
        }
    }
}

/// The generator for this CPU: AVX2 where there is AVX2, else scalar. `scalar` forces the scalar
/// one (the Scalar kernel family, so its tests exercise it). `MULTIPLY` picks [`MUL`] or [`STORE`].
pub(crate) fn keep_row_fn<const MULTIPLY: bool>(scalar: bool) -> KeepRowFn {
    #[cfg(target_arch = "x86_64")]
    if !scalar && is_x86_feature_detected!("avx2") {
        return avx2::keep_row::<MULTIPLY>;
    }
    let _ = scalar;
    keep_row_scalar::<MULTIPLY>
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::philox::dropout_keep;

    #[test]
    fn generators_match_the_definition() {
        let d = Dropout::from_attributes(0.3, Some([0xdead_beef, 0x1234_5678])).unwrap().unwrap();
        let edge = Dropout::from_attributes(1.0 - f32::EPSILON / 2.0, Some([u32::MAX, u32::MAX])).unwrap().unwrap();
        for (d, b, h, i, j0) in [(d, 0, 0, 0, 0), (d, 3, 7, 129, 64), (d, u32::MAX, u32::MAX, u32::MAX, (1usize << 34) - 256), (edge, 1, 2, 3, 4)] {
            for scalar in [true, false] {
                let mut out = vec![f32::NAN; 100];
                // Random non-zero values the MUL generator scales in place.
                let row: Vec<f32> = (0..100).map(|c| 0.5 + ((c * 37 + 11) % 97) as f32 / 97.0).collect();
                let mut scaled = row.clone();
                // SAFETY: 100 floats each.
                unsafe {
                    keep_row_fn::<STORE>(scalar)(out.as_mut_ptr(), &d, b, h, i, j0, 100);
                    keep_row_fn::<MUL>(scalar)(scaled.as_mut_ptr(), &d, b, h, i, j0, 100);
                }
                for (c, &x) in out.iter().enumerate() {
                    let want = if dropout_keep(d.key, d.threshold, b, h, i, (j0 + c) as u64) { d.scale } else { 0.0 };
                    assert_eq!(x, want, "scalar {scalar} b {b} h {h} i {i} key {}", j0 + c);
                    assert_eq!(scaled[c], row[c] * want, "MUL: scalar {scalar} b {b} h {h} i {i} key {}", j0 + c);
                }
            }
        }
    }
}
