//! The dropout mask of one tile row, as the Host kernels apply it: `keep_scale[c]` = `scale` where
//! entry `(b, h, i, j0 + c)` is kept and `0` where it is dropped (`crate::philox` defines the
//! bits; this only computes them fast).
//!
//! Cost is what matters here. An entry's draw is `half(x)·2^16 + half(y)` (two Philox streams,
//! see the contract), but `draw >= T` is decided by the upper half `half(x)` alone unless it
//! equals `T >> 16`, which happens with probability 2^-16. So the generators compute `x` (one
//! Philox4x32-10 call per eight keys) and draw `y` only for a group of keys where an upper half
//! ties. The AVX2 generator runs eight Philox calls at once (64 consecutive keys of one row, so
//! their counters differ only in word 0), compares the 16-bit halves with the threshold's upper
//! half without a branch, and widens the 16-bit masks to the row's floats; a 64-key step with a
//! tie goes through the scalar generator, which is the reference for it (see the tests).

use crate::philox::{dropout_lower8, dropout_upper8, half, Dropout};

/// The `Dropout` the kernels carry when there is none (never read then: the instances without
/// dropout do not look at it).
pub(crate) const NO_DROPOUT: Dropout = Dropout { key: [0, 0], rate: 0.0, threshold: 0, scale: 1.0 };

/// Writes the keep scale of keys `j0 .. j0 + n` of row `(b, h, i)` to `out[0..n]` (the `STORE`
/// instances), or multiplies `out[0..n]` by it in place (the `MUL` instances: the forward scales
/// its probability row without a scratch pass). `j0` and `n` are multiples of 4 (tiles start on
/// key quads and are padded to whole quads).
#[cfg(test)]
pub(crate) type KeepRowFn = unsafe fn(out: *mut f32, d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize);

/// [`KeepRowFn`] over the rows of a tile: row `r` (query row `i0 + r`, at `s + r·ld`) gets keys
/// `j0 + a .. j0 + e` in its columns `a .. e`, `(a, e) = spans[r]` (multiples of 4; `a >= e`:
/// nothing). One call per tile lets the generator set up once and run two rows side by side.
pub(crate) type KeepTileFn = unsafe fn(s: *mut f32, ld: usize, spans: &[(usize, usize)], d: &Dropout, b: u32, h: u32, i0: u32, j0: usize);

/// What a generator does with the keep scales.
pub(crate) const STORE: bool = false;
pub(crate) const MUL: bool = true;

/// Writes (`STORE`) or applies (`MUL`) keep scale `k` to `*o`.
#[inline(always)]
unsafe fn put_scalar<const MULTIPLY: bool>(o: *mut f32, k: f32) {
    *o = if MULTIPLY { *o * k } else { k };
}

/// The scalar generator: one Philox call per eight-key group, and the lower-half call only for a
/// group where some upper half ties with the threshold's.
///
/// # Safety
/// `out` holds `n` floats.
pub(crate) unsafe fn keep_row_scalar<const MULTIPLY: bool>(out: *mut f32, d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize) {
    debug_assert!(j0.is_multiple_of(4) && n.is_multiple_of(4));
    let (t_hi, t_lo) = (d.threshold >> 16, d.threshold & 0xFFFF);
    let mut c = 0;
    while c < n {
        let j = j0 + c;
        let oct = (j >> 3) as u32;
        let group_end = ((j | 7) + 1 - j0).min(n);
        let x = dropout_upper8(d.key, b, h, i, oct);
        let mut y = None;
        for cc in c..group_end {
            let lane = (j0 + cc) & 7;
            let upper = half(&x, lane);
            let kept = if upper != t_hi {
                upper > t_hi
            } else {
                half(y.get_or_insert_with(|| dropout_lower8(d.key, b, h, i, oct)), lane) >= t_lo
            };
            put_scalar::<MULTIPLY>(out.add(cc), if kept { d.scale } else { 0.0 });
        }
        c = group_end;
    }
}

/// The scalar tile generator: [`keep_row_scalar`] row by row.
///
/// # Safety
/// Row `r` of `s` (`ld` floats apart) holds `spans[r].1` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn keep_tile_scalar<const MULTIPLY: bool>(s: *mut f32, ld: usize, spans: &[(usize, usize)], d: &Dropout, b: u32, h: u32, i0: u32, j0: usize) {
    for (r, &(a, e)) in spans.iter().enumerate() {
        if a < e {
            keep_row_scalar::<MULTIPLY>(s.add(r * ld + a), d, b, h, i0 + r as u32, j0 + a, e - a);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use crate::philox::{mulhilo as mulhilo1, Dropout, M0, M1, W0, W1};

    /// `(hi, lo)` of the eight 32×32-bit products `a·m` (`m` splatted). `_mm256_mul_epu32`
    /// multiplies the even 32-bit lanes into 64 bits, so odd lanes go through a shifted copy.
    /// (Keeping the state in 64-bit lanes instead, four calls per register, measured slower.)
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn mulhilo(a: __m256i, m: __m256i) -> (__m256i, __m256i) {
        let even = _mm256_mul_epu32(a, m);
        let odd = _mm256_mul_epu32(_mm256_srli_epi64::<32>(a), m);
        let lo = _mm256_blend_epi32::<0b1010_1010>(even, _mm256_slli_epi64::<32>(odd));
        let hi = _mm256_blend_epi32::<0b1010_1010>(_mm256_srli_epi64::<32>(even), odd);
        (hi, lo)
    }

    /// Philox4x32-10 of the counters `(oct0 + lane, i[r], h, b)`, lanes 0..8, for `R` rows at
    /// once: per row the output words `(x0, x1, x2, x3)` of eight eight-key groups, lane `l`
    /// belonging to keys `8·(oct0 + l) ..`. The rows' rounds are independent chains of
    /// multiply latency, so running two side by side keeps the multipliers busy; the round keys
    /// are splatted once for all rows.
    ///
    /// Words 2-3 of the counter are the same in every lane (word 1 too, within a row), so round
    /// 0's second product and round 1's first are lane-independent and done once in scalar.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn philox8<const R: usize>(key: [u32; 2], b: u32, h: u32, i: [u32; R], oct0: u32) -> [[__m256i; 4]; R] {
        let (m0, m1) = (_mm256_set1_epi32(M0 as i32), _mm256_set1_epi32(M1 as i32));
        let c0 = _mm256_add_epi32(_mm256_set1_epi32(oct0 as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let [mut k0, mut k1] = key;
        // Round 0: c = (oct, i, h, b); its products are the same for every row.
        let (hi0, lo0) = mulhilo(c0, m0);
        let (hi1, lo1) = mulhilo1(M1, h);
        let c2 = _mm256_xor_si256(hi0, _mm256_set1_epi32((b ^ k1) as i32));
        let c3 = lo0;
        // Round 1: the product of word 0 is lane-independent (c0 = hi1 ^ i ^ k0 per row).
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
        let (hi1r, lo1r) = mulhilo(c2, m1);
        let mut c = [[_mm256_setzero_si256(); 4]; R];
        for (c, &i) in c.iter_mut().zip(&i) {
            let (hi0s, lo0s) = mulhilo1(M0, hi1 ^ i ^ key[0]);
            *c = [
                _mm256_xor_si256(hi1r, _mm256_set1_epi32((lo1 ^ k0) as i32)),
                lo1r,
                _mm256_xor_si256(c3, _mm256_set1_epi32((hi0s ^ k1) as i32)),
                _mm256_set1_epi32(lo0s as i32),
            ];
        }
        for _ in 2..10 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
            let (sk0, sk1) = (_mm256_set1_epi32(k0 as i32), _mm256_set1_epi32(k1 as i32));
            for c in c.iter_mut() {
                let (hi0, lo0) = mulhilo(c[0], m0);
                let (hi1, lo1) = mulhilo(c[2], m1);
                *c = [_mm256_xor_si256(_mm256_xor_si256(hi1, c[1]), sk0), lo1, _mm256_xor_si256(_mm256_xor_si256(hi0, c[3]), sk1), lo0];
            }
        }
        c
    }

    /// The keep scales of the 64 keys `8·oct0 .. 8·oct0 + 64` of `R` rows `(b, h, i[r])`, as
    /// eight vectors of eight consecutive keys per row; `None` when an upper half of one of the
    /// rows ties with the threshold's (`t_hi`, splatted to 16-bit lanes): then only the lower
    /// halves decide, and the caller takes the scalar generator, which draws them.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn keep64<const R: usize>(d: &Dropout, t_hi: __m256i, scale: __m256, b: u32, h: u32, i: [u32; R], oct0: u32) -> Option<[[__m256; 8]; R]> {
        let x = philox8::<R>(d.key, b, h, i, oct0);
        let mut keep = [[_mm256_setzero_ps(); 8]; R];
        let mut tie = _mm256_setzero_si256();
        for ([x0, x1, x2, x3], keep) in x.into_iter().zip(keep.iter_mut()) {
            // 4×8 transpose: afterwards each 128-bit half holds one call's four words in order,
            // i.e. (little-endian u16) the upper halves of its eight keys in key order.
            let t0 = _mm256_unpacklo_epi32(x0, x1);
            let t1 = _mm256_unpackhi_epi32(x0, x1);
            let t2 = _mm256_unpacklo_epi32(x2, x3);
            let t3 = _mm256_unpackhi_epi32(x2, x3);
            let u = [
                _mm256_unpacklo_epi64(t0, t2), // keys 0-7 | 32-39
                _mm256_unpackhi_epi64(t0, t2), // keys 8-15 | 40-47
                _mm256_unpacklo_epi64(t1, t3), // keys 16-23 | 48-55
                _mm256_unpackhi_epi64(t1, t3), // keys 24-31 | 56-63
            ];
            // Kept iff upper half >= t_hi, unsigned (max(x, t) == x), as 16-bit masks that
            // widen (sign-extend) to the 32-bit masks of the keys' floats; exact unless a tie.
            let widen = |m: __m128i| _mm256_and_ps(_mm256_castsi256_ps(_mm256_cvtepi16_epi32(m)), scale);
            for (k, &u) in u.iter().enumerate() {
                tie = _mm256_or_si256(tie, _mm256_cmpeq_epi16(u, t_hi));
                let m = _mm256_cmpeq_epi16(_mm256_max_epu16(u, t_hi), u);
                keep[k] = widen(_mm256_castsi256_si128(m));
                keep[k + 4] = widen(_mm256_extracti128_si256::<1>(m));
            }
        }
        (_mm256_testz_si256(tie, tie) != 0).then_some(keep)
    }

    /// Writes (`STORE`) or applies (`MUL`) the keep scales of 64 consecutive keys at `out`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn put64<const MULTIPLY: bool>(out: *mut f32, keep: &[__m256; 8]) {
        for (k, &v) in keep.iter().enumerate() {
            let o = out.add(8 * k);
            _mm256_storeu_ps(o, if MULTIPLY { _mm256_mul_ps(_mm256_loadu_ps(o), v) } else { v });
        }
    }

    /// The AVX2 generator: [`super::KeepRowFn`] in steps of 64 keys aligned to eight-key groups.
    ///
    /// # Safety
    /// `out` holds `n` floats; the CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn keep_row<const MULTIPLY: bool>(out: *mut f32, d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize) {
        debug_assert!(j0.is_multiple_of(4) && n.is_multiple_of(4));
        let t_hi = _mm256_set1_epi16((d.threshold >> 16) as u16 as i16);
        let scale = _mm256_set1_ps(d.scale);
        let end = j0 + n;
        let mut g = j0 & !7;
        while g < end {
            if g >= j0 && g + 64 <= end {
                // The whole step is in the span (every step of a full tile row).
                match keep64::<1>(d, t_hi, scale, b, h, [i], (g >> 3) as u32) {
                    Some([keep]) => put64::<MULTIPLY>(out.add(g - j0), &keep),
                    None => super::keep_row_scalar::<MULTIPLY>(out.add(g - j0), d, b, h, i, g, 64),
                }
            } else {
                keep_part::<MULTIPLY>(out, d, t_hi, scale, b, h, i, j0, end, g);
            }
            g += 64;
        }
    }

    /// The AVX2 tile generator ([`super::KeepTileFn`]): two rows at a time where both see a
    /// whole aligned 64-key step (every row of a full tile), the rest row by row.
    ///
    /// # Safety
    /// Row `r` of `s` (`ld` floats apart) holds `spans[r].1` floats; the CPU has AVX2.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn keep_tile<const MULTIPLY: bool>(s: *mut f32, ld: usize, spans: &[(usize, usize)], d: &Dropout, b: u32, h: u32, i0: u32, j0: usize) {
        let t_hi = _mm256_set1_epi16((d.threshold >> 16) as u16 as i16);
        let scale = _mm256_set1_ps(d.scale);
        let whole = |r: usize| j0.is_multiple_of(8) && spans.get(r) == Some(&(0, 64));
        let mut r = 0;
        while r < spans.len() {
            let i = i0 + r as u32;
            if whole(r) && whole(r + 1) {
                if let Some(keep) = keep64::<2>(d, t_hi, scale, b, h, [i, i + 1], (j0 >> 3) as u32) {
                    for (rr, keep) in keep.iter().enumerate() {
                        put64::<MULTIPLY>(s.add((r + rr) * ld), keep);
                    }
                } else {
                    // A tie in one of the two rows: each row on its own (the tie path is exact).
                    keep_row::<MULTIPLY>(s.add(r * ld), d, b, h, i, j0, 64);
                    keep_row::<MULTIPLY>(s.add((r + 1) * ld), d, b, h, i + 1, j0, 64);
                }
                r += 2;
                continue;
            }
            let (a, e) = spans[r];
            if a < e {
                keep_row::<MULTIPLY>(s.add(r * ld + a), d, b, h, i, j0 + a, e - a);
            }
            r += 1;
        }
    }

    /// A step that covers only part of the span `j0..end` (its ends: a row that sees part of a
    /// tile): the 64 keys from `g` through a stack buffer, or the scalar generator on a tie.
    /// Kept out of line so that the full steps' loop stays small.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2")]
    unsafe fn keep_part<const MULTIPLY: bool>(out: *mut f32, d: &Dropout, t_hi: __m256i, scale: __m256, b: u32, h: u32, i: u32, j0: usize, end: usize, g: usize) {
        // This step's keys inside the span: lo..hi (multiples of 4, as the scalar path needs).
        let (lo, hi) = (j0.max(g), end.min(g + 64));
        let Some([keep]) = keep64::<1>(d, t_hi, scale, b, h, [i], (g >> 3) as u32) else {
            return super::keep_row_scalar::<MULTIPLY>(out.add(lo - j0), d, b, h, i, lo, hi - lo);
        };
        let mut buf = [0f32; 64];
        for (k, &v) in keep.iter().enumerate() {
            _mm256_storeu_ps(buf.as_mut_ptr().add(8 * k), v);
        }
        for j in lo..hi {
            super::put_scalar::<MULTIPLY>(out.add(j - j0), buf[j - g]);
        }
    }
}

/// The AVX-512 tile generator: sixteen Philox calls per register, two rows side by side (lanes
/// 0-7 one row's eight eight-key groups, lanes 8-15 the next row's), and two such pairs at once
/// for the multipliers' latency: four rows of a 64-key tile per step where the AVX2 generator
/// runs two. The comparison with the threshold's upper half gives mask registers, and each keep
/// vector is the scale under a 16-key mask (no widening of 16-bit masks). Rows that are not
/// whole, and steps with a tie, go through the AVX2 row generator (exact, the reference's order).
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    use crate::philox::{mulhilo as mulhilo1, Dropout, M0, M1, W0, W1};

    /// `(hi, lo)` of the sixteen 32×32-bit products `a·m` (as the AVX2 `mulhilo`).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn mulhilo(a: __m512i, m: __m512i) -> (__m512i, __m512i) {
        let even = _mm512_mul_epu32(a, m);
        let odd = _mm512_mul_epu32(_mm512_srli_epi64::<32>(a), m);
        let lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64::<32>(odd));
        let hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64::<32>(even), odd);
        (hi, lo)
    }

    /// `x` in lanes 0-7, `y` in lanes 8-15.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn halves(x: u32, y: u32) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_set1_epi32(x as i32), _mm256_set1_epi32(y as i32))
    }

    /// Philox4x32-10 of the counters `(oct0 + l % 8, i[p] + l / 8, h, b)` for lanes `l` 0..16 of
    /// each of `P` row pairs: the AVX2 `philox8` with the second row in the upper lanes, so the
    /// lane-independent products of rounds 0 and 1 are per half.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn philox16<const P: usize>(key: [u32; 2], b: u32, h: u32, i: [u32; P], oct0: u32) -> [[__m512i; 4]; P] {
        let (m0, m1) = (_mm512_set1_epi32(M0 as i32), _mm512_set1_epi32(M1 as i32));
        let c0 = _mm512_add_epi32(_mm512_set1_epi32(oct0 as i32), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7));
        let [mut k0, mut k1] = key;
        let (hi0, lo0) = mulhilo(c0, m0);
        let (hi1, lo1) = mulhilo1(M1, h);
        let c2 = _mm512_xor_si512(hi0, _mm512_set1_epi32((b ^ k1) as i32));
        let c3 = lo0;
        k0 = k0.wrapping_add(W0);
        k1 = k1.wrapping_add(W1);
        let (hi1r, lo1r) = mulhilo(c2, m1);
        let mut c = [[_mm512_setzero_si512(); 4]; P];
        for (c, &i) in c.iter_mut().zip(&i) {
            let (hi_a, lo_a) = mulhilo1(M0, hi1 ^ i ^ key[0]);
            let (hi_b, lo_b) = mulhilo1(M0, hi1 ^ i.wrapping_add(1) ^ key[0]);
            *c = [_mm512_xor_si512(hi1r, _mm512_set1_epi32((lo1 ^ k0) as i32)), lo1r, _mm512_xor_si512(c3, halves(hi_a ^ k1, hi_b ^ k1)), halves(lo_a, lo_b)];
        }
        for _ in 2..10 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
            let (sk0, sk1) = (_mm512_set1_epi32(k0 as i32), _mm512_set1_epi32(k1 as i32));
            for c in c.iter_mut() {
                let (hi0, lo0) = mulhilo(c[0], m0);
                let (hi1, lo1) = mulhilo(c[2], m1);
                *c = [_mm512_xor_si512(_mm512_xor_si512(hi1, c[1]), sk0), lo1, _mm512_xor_si512(_mm512_xor_si512(hi0, c[3]), sk1), lo0];
            }
        }
        c
    }

    /// The 16-key keep masks of the 64 keys `8·oct0 ..` of `2·P` rows (`[pair][row of the pair]
    /// [16-key vector]`), or `None` when an upper half ties with the threshold's (`t_hi` in
    /// every 16-bit lane).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn keep_masks<const P: usize>(d: &Dropout, t_hi: __m512i, b: u32, h: u32, i: [u32; P], oct0: u32) -> Option<[[[u16; 4]; 2]; P]> {
        let x = philox16::<P>(d.key, b, h, i, oct0);
        let mut out = [[[0u16; 4]; 2]; P];
        let mut tie: u32 = 0;
        for ([x0, x1, x2, x3], out) in x.into_iter().zip(out.iter_mut()) {
            // Per 128-bit lane, one call's four words in order (as in the AVX2 transpose): u[k]'s
            // lane g holds call k + 4·(g % 2) of row g / 2, i.e. its eight keys' upper halves.
            let t0 = _mm512_unpacklo_epi32(x0, x1);
            let t1 = _mm512_unpackhi_epi32(x0, x1);
            let t2 = _mm512_unpacklo_epi32(x2, x3);
            let t3 = _mm512_unpackhi_epi32(x2, x3);
            let u = [_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2), _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)];
            let mut kept = [0u32; 4];
            for (k, &u) in u.iter().enumerate() {
                tie |= _mm512_cmpeq_epu16_mask(u, t_hi);
                kept[k] = _mm512_cmpge_epu16_mask(u, t_hi);
            }
            // Call c of row ρ: the byte of `kept[c % 4]` at lane 2ρ + c / 4; vector v holds
            // calls 2v (low byte) and 2v + 1.
            let byte = |c: usize, rho: usize| (kept[c % 4] >> (8 * (2 * rho + c / 4))) & 0xFF;
            for (rho, row) in out.iter_mut().enumerate() {
                for (v, m) in row.iter_mut().enumerate() {
                    *m = (byte(2 * v, rho) | byte(2 * v + 1, rho) << 8) as u16;
                }
            }
        }
        (tie == 0).then_some(out)
    }

    /// Writes (`STORE`) or applies (`MUL`) the keep scales under `masks` to the 64 floats at `o`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn put64<const MULTIPLY: bool>(o: *mut f32, masks: &[u16; 4], scale: __m512) {
        for (v, &m) in masks.iter().enumerate() {
            let p = o.add(16 * v);
            let keep = _mm512_maskz_mov_ps(m, scale);
            _mm512_storeu_ps(p, if MULTIPLY { _mm512_mul_ps(_mm512_loadu_ps(p), keep) } else { keep });
        }
    }

    /// [`super::KeepTileFn`] on AVX-512 (see the module docs).
    ///
    /// # Safety
    /// Row `r` of `s` (`ld` floats apart) holds `spans[r].1` floats; the CPU has AVX-512 F/BW
    /// (and so AVX2).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    pub(crate) unsafe fn keep_tile<const MULTIPLY: bool>(s: *mut f32, ld: usize, spans: &[(usize, usize)], d: &Dropout, b: u32, h: u32, i0: u32, j0: usize) {
        let t_hi = _mm512_set1_epi16((d.threshold >> 16) as u16 as i16);
        let scale = _mm512_set1_ps(d.scale);
        let whole = |r: usize| j0.is_multiple_of(8) && spans.get(r) == Some(&(0, 64));
        let oct0 = (j0 >> 3) as u32;
        let row_by_row = |r: usize, n: usize| {
            for rr in r..r + n {
                super::avx2::keep_row::<MULTIPLY>(s.add(rr * ld), d, b, h, i0 + rr as u32, j0, 64);
            }
        };
        let mut r = 0;
        while r < spans.len() {
            let i = i0 + r as u32;
            if (0..4).all(|k| whole(r + k)) {
                match keep_masks::<2>(d, t_hi, b, h, [i, i + 2], oct0) {
                    Some(m) => {
                        for (k, masks) in m.iter().flatten().enumerate() {
                            put64::<MULTIPLY>(s.add((r + k) * ld), masks, scale);
                        }
                    }
                    None => row_by_row(r, 4),
                }
                r += 4;
                continue;
            }
            if whole(r) && whole(r + 1) {
                match keep_masks::<1>(d, t_hi, b, h, [i], oct0) {
                    Some([m]) => {
                        put64::<MULTIPLY>(s.add(r * ld), &m[0], scale);
                        put64::<MULTIPLY>(s.add((r + 1) * ld), &m[1], scale);
                    }
                    None => row_by_row(r, 2),
                }
                r += 2;
                continue;
            }
            let (a, e) = spans[r];
            if a < e {
                super::avx2::keep_row::<MULTIPLY>(s.add(r * ld + a), d, b, h, i, j0 + a, e - a);
            }
            r += 1;
        }
    }
}

/// The row generator for this CPU (the tests': the kernels take whole tiles, [`keep_tile_fn`],
/// whose AVX2 instance runs two rows side by side): AVX2 where there is AVX2, else scalar. `scalar` forces the scalar
/// one (the Scalar kernel family, so its tests exercise it). `MULTIPLY` picks [`MUL`] or [`STORE`].
#[cfg(test)]
pub(crate) fn keep_row_fn<const MULTIPLY: bool>(scalar: bool) -> KeepRowFn {
    #[cfg(target_arch = "x86_64")]
    if !scalar && is_x86_feature_detected!("avx2") {
        return avx2::keep_row::<MULTIPLY>;
    }
    let _ = scalar;
    keep_row_scalar::<MULTIPLY>
}

/// The tile generator for kernels of `lanes`-wide vectors (`Isa::LANES`): AVX-512 (F and BW) for
/// 16 where the CPU has it, AVX2 for 8 or more, else scalar. Following the row kernels' family,
/// not the widest the CPU has, keeps `EXLA_RS_HOST_ISA=avx2` what an AVX2-only machine runs,
/// dropout included.
pub(crate) fn keep_tile_fn<const MULTIPLY: bool>(lanes: usize) -> KeepTileFn {
    #[cfg(target_arch = "x86_64")]
    if lanes >= 16 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx2") {
        return avx512::keep_tile::<MULTIPLY>;
    }
    #[cfg(target_arch = "x86_64")]
    if lanes >= 8 && is_x86_feature_detected!("avx2") {
        return avx2::keep_tile::<MULTIPLY>;
    }
    let _ = lanes;
    keep_tile_scalar::<MULTIPLY>
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::philox::{dropout_draw, dropout_keep};

    /// Both generators, STORE and MUL, against the definition over keys `j0 .. j0 + n`.
    fn check(d: &Dropout, b: u32, h: u32, i: u32, j0: usize, n: usize) {
        for scalar in [true, false] {
            let mut out = vec![f32::NAN; n];
            // Random non-zero values the MUL generator scales in place.
            let row: Vec<f32> = (0..n).map(|c| 0.5 + ((c * 37 + 11) % 97) as f32 / 97.0).collect();
            let mut scaled = row.clone();
            // SAFETY: n floats each.
            unsafe {
                keep_row_fn::<STORE>(scalar)(out.as_mut_ptr(), d, b, h, i, j0, n);
                keep_row_fn::<MUL>(scalar)(scaled.as_mut_ptr(), d, b, h, i, j0, n);
            }
            for (c, &x) in out.iter().enumerate() {
                let want = if dropout_keep(d.key, d.threshold, b, h, i, (j0 + c) as u64) { d.scale } else { 0.0 };
                assert_eq!(x, want, "scalar {scalar} b {b} h {h} i {i} key {} (span {j0}+{n}, T {:#x})", j0 + c, d.threshold);
                assert_eq!(scaled[c], row[c] * want, "MUL: scalar {scalar} b {b} h {h} i {i} key {}", j0 + c);
            }
        }
    }

    #[test]
    fn generators_match_the_definition() {
        let d = Dropout::from_attributes(0.3, Some([0xdead_beef, 0x1234_5678])).unwrap().unwrap();
        let edge = Dropout::from_attributes(1.0 - f32::EPSILON / 2.0, Some([u32::MAX, u32::MAX])).unwrap().unwrap();
        for (d, b, h, i, j0) in [(d, 0, 0, 0, 0), (d, 3, 7, 129, 64), (d, u32::MAX, u32::MAX, u32::MAX, (1usize << 34) - 256), (edge, 1, 2, 3, 4)] {
            check(&d, b, h, i, j0, 100);
        }
        // Spans that start in the middle of an eight-key group, end inside a 64-key step, or
        // are shorter than one step (the forward's partially visible rows).
        for (j0, n) in [(4, 4), (4, 12), (12, 60), (0, 64), (8, 64), (60, 68), (100, 132), (4, 188)] {
            check(&d, 1, 2, 3, j0, n);
        }
    }

    #[test]
    fn ties_of_the_upper_half_are_decided_by_the_lower_stream() {
        // A threshold equal to one entry's draw (kept: draw >= T) and one above it (dropped):
        // that entry's upper half ties with T's, so the lower-half call decides. The other
        // entries of the span, in the same 64-key step, must still be right.
        let key = [0x243f_6a88, 0x85a3_08d3];
        let (b, h, i) = (2, 5, 77);
        for target in [0u64, 13, 64 + 7, 130] {
            let draw = dropout_draw(key, b, h, i, target);
            for (threshold, kept) in [(draw, true), (draw.wrapping_add(1), false)] {
                if threshold == 0 {
                    continue;
                }
                let d = Dropout { key, rate: threshold as f32 / 4_294_967_296.0, threshold, scale: 1.25 };
                assert_eq!(dropout_keep(key, threshold, b, h, i, target), kept);
                check(&d, b, h, i, 0, 192);
                check(&d, b, h, i, (target as usize & !3).saturating_sub(4), 12);
            }
        }
    }

    /// Every tile generator this CPU runs, by name: the scalar one, and AVX2 and AVX-512 where
    /// present (so a machine with AVX-512 still checks the AVX2 one its peers without it run).
    fn tile_generators<const MULTIPLY: bool>() -> Vec<(&'static str, KeepTileFn)> {
        let mut g: Vec<(&'static str, KeepTileFn)> = vec![("scalar", keep_tile_scalar::<MULTIPLY>)];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") {
                g.push(("avx2", avx2::keep_tile::<MULTIPLY>));
            }
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx2") {
                g.push(("avx512", avx512::keep_tile::<MULTIPLY>));
            }
        }
        g
    }

    #[test]
    fn tile_generators_match_the_definition() {
        // Rows of a 64-key tile: whole rows (in runs of four, pairs and alone), partial spans,
        // empty rows, and a tile that does not start on an eight-key group; thresholds with and
        // without a tie (in a pair's second row, and in a run of four).
        let key = [0x0123_4567, 0x89ab_cdef];
        let (b, h, i0) = (1, 3, 200);
        let w = (0, 64);
        let span_sets: [&[(usize, usize)]; 2] = [
            &[w, w, w, (4, 64), w, (0, 0), w, w, (8, 20), w, (32, 36), w],
            &[w, w, w, w, w, (4, 64), w, w, w, w, w, w, (0, 0), w],
        ];
        let tie_draw = dropout_draw(key, b, h, i0 + 7, 64 + 9); // row 7, key 9
        for spans in span_sets {
            for (threshold, j0) in [(0x1999_99a0, 64), (0xe000_0000, 128), (tie_draw, 64), (tie_draw + 1, 64), (0x4000_0000, 4)] {
                let d = Dropout { key, rate: threshold as f32 / 4_294_967_296.0, threshold, scale: 1.5 };
                for ((name, store), (_, mul)) in tile_generators::<STORE>().into_iter().zip(tile_generators::<MUL>()) {
                    let ld = 70;
                    let tile: Vec<f32> = (0..spans.len() * ld).map(|c| 0.25 + ((c * 53 + 7) % 89) as f32 / 89.0).collect();
                    let (mut stored, mut scaled) = (tile.clone(), tile.clone());
                    // SAFETY: every row has ld >= 64 floats; the generators listed run here.
                    unsafe {
                        store(stored.as_mut_ptr(), ld, spans, &d, b, h, i0, j0);
                        mul(scaled.as_mut_ptr(), ld, spans, &d, b, h, i0, j0);
                    }
                    for (r, &(a, e)) in spans.iter().enumerate() {
                        for c in 0..ld {
                            let x = r * ld + c;
                            if c < a || c >= e {
                                assert_eq!((stored[x], scaled[x]), (tile[x], tile[x]), "{name}: untouched: row {r} col {c}");
                                continue;
                            }
                            let i = i0 + r as u32;
                            let want = if dropout_keep(key, threshold, b, h, i, (j0 + c) as u64) { d.scale } else { 0.0 };
                            assert_eq!(stored[x], want, "{name} row {r} key {} T {threshold:#x}", j0 + c);
                            assert_eq!(scaled[x], tile[x] * want, "MUL: {name} row {r} key {}", j0 + c);
                        }
                    }
                }
            }
        }
    }
}


