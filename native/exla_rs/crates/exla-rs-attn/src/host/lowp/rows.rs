//! The forward's row pass on the lowp path: scores (f32, raw `q·k`) in, `P` in the unit's
//! 16-bit type out, with the row's new max and sum.
//!
//! On the AVX-512 family without softcap this is one fused kernel: scale, `exp2`, sum and the
//! rounding to 16 bits in one pass over the score row, against a reference max (below), so a
//! score row is read once or twice, never written, and P written once (a scale ≤ 0, which turns
//! the max around, scales the row first). Every other case (softcap, the AVX2 and scalar families
//! the model units run with) takes the f32 path's own row kernel and rounds after it; both
//! compute the contract's `p = 2^(s2 - m_new)`.
//!
//! The reference: a row past its first step takes **the running max it already has**
//! (FlashAttention-4's conditional rescaling): `p = 2^(s2 - m_old)` for every visible key, summed;
//! when the sum is at most [`ONE_PASS_SUM_MAX`] the step keeps `m_old`, so `O` needs no rescale,
//! and the max pass (a read of the row, and the reduction's latency before the first `exp2`) is
//! gone. Otherwise (a score far above it, an inf or a NaN: the sum is then large, inf or NaN), and
//! in a row's first step, the reference is the row's own max (one max pass, four accumulators) and
//! the same loop runs once more. The function is the contract's either way: `o = Σp·v / Σp` and
//! `lse = m + log2 Σp` do not depend on which `m` the `p` are taken against. Only the rounding
//! does: against the true max the largest `p` is 1, exact in any type, which is why a first step
//! takes its own; against an estimate (the largest of its first 16 scores) `o`'s error against
//! float64 was 35% larger at S = 256, where one step is the whole row (and 4% faster at S =
//! 2048). Later steps against the running max measured within 10% of the two passes' error at
//! S = 2048. In bf16 the loop's `exp2` is `exp2_floor`: it reduces by `floor` (a µop shorter) and
//! its polynomial is two degrees shorter, good to 2^-13.5 relative where `p` is rounded to 2^-9
//! next (`simd::EXP2_FLOOR_Q`, where the measurements are). One thread, bf16 S = 2048, D = 128,
//! Emerald Rapids: a 512-key step's row pass took 21.1k → 15.6k TSC cycles with the one pass.

use super::super::kernels::Isa;
use super::super::HostElement;
use super::model::Half16;
use super::pack;

/// The most a one-pass row's sum may be (see the module docs), so every `p` of it too: `2^12`.
/// A step of 512 keys whose every `p` is at most 8 passes, and no `p` comes near the 16-bit
/// types' ranges (f16's largest is 65504).
pub(crate) const ONE_PASS_SUM_MAX: f32 = 4096.0;

/// One row: `s[0..n]` holds `q·k`; columns `[a, b)` (non-empty) are visible. Writes
/// `p = 2^(s2 - m_new)` rounded to `elem` into `out[0..n]` (0 outside `[a, b)`), where
/// `s2 = log2(e)·softcap(scale·q·k)` and `m_new = max(m_old, max visible s2)`, or, where the
/// one pass holds (module docs; AVX-512 without softcap, `m_old` finite), `m_new = m_old` with
/// `Σp ≤` [`ONE_PASS_SUM_MAX`]. `m_new ≥ m_old` either way. `s` may be clobbered.
/// Returns `(m_new, Σp)` (the sum of the unrounded `p`, as the f32 path sums).
///
/// # Safety
/// `s` and `out` hold `n` elements, `n` a multiple of 64 (whole key tiles), `a < b ≤ n`; `K`'s CPU features are
/// present (the dispatcher's word).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn fwd_row16<K: Isa>(elem: Half16, s: *mut f32, n: usize, a: usize, b: usize, qscale: f32, softcap: f32, m_old: f32, out: *mut u16) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if K::LANES == 16 && softcap == 0.0 {
        // SAFETY: LANES = 16 is the AVX-512 family, whose features the dispatcher detected.
        return avx512::fwd_row16(elem == Half16::F16, s, n, a, b, qscale, m_old, out);
    }
    for j in 0..n {
        *s.add(j) *= qscale;
    }
    let (m_new, sum) = K::fwd_row(s, n, a, b, softcap, m_old);
    narrow16::<K>(elem, s, out, n);
    (m_new, sum)
}

/// One row of the backward's tile: `s[0..n]` holds `q·k` (raw), `dp[0..n]` `dO·v`; columns
/// `[a, b)` (non-empty) are visible; `lse2 = log2(e)·lse`, `di = Σ dO∘O`. Writes `P` and
/// `dX = P·(dP - di)·(softcap ? 1 - (x/c)² : 1)` rounded to `elem` into `pa[0..n]`, `dxa[0..n]` (0
/// outside `[a, b)`): the operands of the next three products. `s` and `p` (`n` f32) may be
/// clobbered.
///
/// On AVX-512 without softcap one pass: `2^(s·scale·log2(e) - lse2)` by one FMA and `exp2`, `dX`,
/// and both rounded 32 lanes per instruction, with no f32 row written. Before it the row was
/// scaled in one pass, run through the f32 path's kernel (P and dX stored as f32), and each
/// narrowed in another: 49 M of a D = 128 backward's ~270 M TSC cycles (one thread); fused, the
/// backward took 11-21% less (bench/RESULTS.md). Elsewhere that
/// sequence, which computes the same function.
///
/// # Safety
/// All rows hold `n` elements, `n` a multiple of 32, `a < b ≤ n`; `K`'s CPU features are present.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn bwd_row16<K: Isa>(elem: Half16, s: *mut f32, dp: *const f32, p: *mut f32, n: usize, a: usize, b: usize, scale: f32, softcap: f32, lse2: f32, di: f32, pa: *mut u16, dxa: *mut u16) {
    #[cfg(target_arch = "x86_64")]
    if K::LANES == 16 && softcap == 0.0 {
        // SAFETY: LANES = 16 is the AVX-512 family, whose features the dispatcher detected.
        return avx512::bwd_row16(elem == Half16::F16, s, dp, n, a, b, scale * super::super::kernels::LOG2_E, lse2, di, pa, dxa);
    }
    for j in 0..n {
        *s.add(j) *= scale;
    }
    K::bwd_row(s, dp, p, n, a, b, softcap, lse2, di);
    narrow16::<K>(elem, p, pa, n);
    narrow16::<K>(elem, s, dxa, n);
}

/// `dst[0..n] = src[0..n]` rounded to `elem` (nearest even), `n` a multiple of 16.
///
/// # Safety
/// `src` and `dst` hold `n` elements; `K`'s CPU features are present.
unsafe fn narrow16<K: Isa>(elem: Half16, src: *const f32, dst: *mut u16, n: usize) {
    narrow16_scaled::<K>(elem, src, 1.0, dst, n)
}

/// `dst[0..n] = src[0..n]·scale` rounded to `elem` (the product in f32, then nearest even), `n` a
/// multiple of 16. Scaling here rather than in a pass before it also spares the load a store it
/// cannot forward from (narrower stores of the same line: a 4% stall in the forward's finish).
///
/// # Safety
/// As [`narrow16`].
unsafe fn narrow16_scaled<K: Isa>(elem: Half16, src: *const f32, scale: f32, dst: *mut u16, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if K::LANES == 16 {
        // SAFETY: LANES = 16 is the AVX-512 family, whose features the dispatcher detected.
        return avx512::narrow16(elem == Half16::F16, src, scale, dst, n);
    }
    for j in 0..n {
        *dst.add(j) = pack::bits(elem, *src.add(j) * scale);
    }
}

/// An output row: `dst[j] = T(src[j]·scale)` (the f32 product rounded to `T`, nearest even) for
/// `j < dst.len()`. Where `T` is `elem` (every real call) 16 lanes at a time through `bits`, else
/// element by element: the same values either way. `src` and `bits` hold `dst.len()` rounded up to
/// a multiple of 16 (the padded width). The forward's `o`, the backward's dQ, dK and dV.
///
/// # Safety
/// `K`'s CPU features are present.
pub(crate) unsafe fn store_scaled<T: HostElement, K: Isa>(elem: Half16, src: &[f32], scale: f32, bits: &mut [u16], dst: &mut [T]) {
    let n = dst.len().div_ceil(16) * 16;
    assert!(src.len() >= n && bits.len() >= n);
    if pack::is_elem::<T>(elem) {
        narrow16_scaled::<K>(elem, src.as_ptr(), scale, bits.as_mut_ptr(), n);
        pack::store_bits(elem, &bits[..dst.len()], dst);
    } else {
        for (o, x) in dst.iter_mut().zip(src) {
            *o = T::from_f32(x * scale);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use crate::host::simd::avx512 as s;
    use core::arch::x86_64::*;

    /// `x` rounded to bf16 (nearest even; a NaN stays a quiet NaN: `half::bf16::from_f32`'s
    /// rule) in the low 16 bits of each lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn to_bf16(x: __m512) -> __m512i {
        let xi = _mm512_castps_si512(x);
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(xi), _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(xi, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32::<16>(xi), _mm512_set1_epi32(0x40))
    }

    /// 16 zeros (either 16-bit type's +0) at `out`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn zero16(out: *mut u16) {
        _mm256_storeu_si256(out.cast(), _mm256_setzero_si256());
    }

    /// 16 lanes of `p` as `f16` (`F16`) or bf16 at `out`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store16(f16: bool, out: *mut u16, p: __m512) {
        let h = if f16 { _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p) } else { _mm512_cvtepi32_epi16(to_bf16(p)) };
        _mm256_storeu_si256(out.cast(), h);
    }

    /// [`super::narrow16_scaled`] on AVX-512.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn narrow16(f16: bool, src: *const f32, scale: f32, dst: *mut u16, n: usize) {
        let sc = s::splat(scale);
        for j in (0..n).step_by(16) {
            store16(f16, dst.add(j), s::mul(s::load(src.add(j)), sc));
        }
    }

    /// 16 lanes of `p` as bf16 with `VCVTNEPS2BF16` (nearest even; it reads denormals as 0, and
    /// `p` is never one: `exp2` gives 0 or a normal number).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn store_bf16_native(out: *mut u16, p: __m512) {
        _mm256_storeu_si256(out.cast(), core::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(p)));
    }

    /// 32 lanes, `p0` then `p1`, as bf16 with one `VCVTNE2PS2BF16` (the same rounding as
    /// [`store_bf16_native`]; one instruction for 32 where that takes one per 16, and it is
    /// the row pass's slowest: about 1.5 cycles each on Emerald Rapids).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn store2_bf16_native(out: *mut u16, p0: __m512, p1: __m512) {
        _mm512_storeu_si512(out.cast(), core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
    }

    /// The largest of `s[a..b]` (non-empty; -inf if all are, a NaN may be skipped): four
    /// accumulators over the vectors inside, the one or two at a bound masked.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn visible_max(sp: *const f32, a: usize, b: usize) -> f32 {
        let ninf = s::splat(f32::NEG_INFINITY);
        let (va, vb) = (a & !15, (b + 15) & !15);
        let mut m = [ninf; 4];
        let mut j = va;
        if a > va || b < va + 16 {
            m[0] = _mm512_mask_blend_ps(visible(va, a, b), ninf, s::load(sp.add(va)));
            j += 16;
        }
        let inner = b & !15;
        while j + 64 <= inner {
            for (k, acc) in m.iter_mut().enumerate() {
                *acc = s::max(*acc, s::load(sp.add(j + 16 * k)));
            }
            j += 64;
        }
        while j < vb {
            m[1] = s::max(m[1], _mm512_mask_blend_ps(visible(j, a, b), ninf, s::load(sp.add(j))));
            j += 16;
        }
        s::hmax(s::max(s::max(m[0], m[1]), s::max(m[2], m[3])))
    }

    /// Lanes `j..j+16` that lie in `[a, b)`.
    #[inline]
    fn visible(j: usize, a: usize, b: usize) -> __mmask16 {
        let lo = a.saturating_sub(j).min(16);
        let hi = b.saturating_sub(j).min(16);
        if lo >= hi {
            return 0;
        }
        let upto = |k: usize| if k >= 16 { 0xFFFFu32 } else { (1u32 << k) - 1 };
        (upto(hi) & !upto(lo)) as __mmask16
    }

    /// The row kernel's body, instantiated per target-feature set (`$exp2`: the negative-scale
    /// path's; `$exp2_one`: the one pass's; `$store`: how 16 lanes of P become 16 bits;
    /// `$store2`: 32, from two vectors). Two accumulators for the sum halve its chain.
    ///
    /// With `qscale > 0` the scores are never scaled and stored: the max of the raw scores
    /// times `qscale` is the max of the scaled ones (rounding is monotone), and the pass forms
    /// `s·qscale - m` in one FMA.
    macro_rules! row_body {
        ($exp2:path, $exp2_one:path, $sp:ident, $n:ident, $a:ident, $b:ident, $qscale:ident, $m_old:ident, $out:ident, $store:expr, $store2:expr) => {{
            let ninf = s::splat(f32::NEG_INFINITY);
            if $qscale > 0.0 {
                // The one pass (module docs), against a positive scale (so the raw scores' order
                // is the scaled ones'). `p = 2^(s·qscale - m_ref)` for the visible keys: vectors
                // wholly inside [a, b) unmasked, the one or two that hold a bound masked, those
                // outside it P = 0 without an exp2. Returns Σp.
                let (va, vb, inner) = ($a & !15, ($b + 15) & !15, $b & !15);
                let pass = move |m_ref: f32| -> f32 {
                    // Copies in registers: read through the closure's captures, the loop reloaded
                    // three pointers at every step (P's stores might have changed them).
                    let ($sp, $out, $a, $b) = ($sp, $out, $a, $b);
                    let (sc, neg_m) = (s::splat($qscale), s::splat(-m_ref));
                    let (mut sum0, mut sum1) = (s::zero(), s::zero());
                    let masked = |j: usize| _mm512_maskz_mov_ps(visible(j, $a, $b), $exp2_one(s::fma(s::load($sp.add(j)), sc, neg_m)));
                    let mut j = 0;
                    while j < va {
                        zero16($out.add(j));
                        j += 16;
                    }
                    if $a > va {
                        let p = masked(j);
                        sum1 = s::add(sum1, p);
                        $store($out.add(j), p);
                        j += 16;
                    }
                    while j + 32 <= inner {
                        let p0 = $exp2_one(s::fma(s::load($sp.add(j)), sc, neg_m));
                        let p1 = $exp2_one(s::fma(s::load($sp.add(j + 16)), sc, neg_m));
                        sum0 = s::add(sum0, p0);
                        sum1 = s::add(sum1, p1);
                        $store2($out.add(j), p0, p1);
                        j += 32;
                    }
                    while j < vb {
                        let p = if j < inner { $exp2_one(s::fma(s::load($sp.add(j)), sc, neg_m)) } else { masked(j) };
                        sum0 = s::add(sum0, p);
                        $store($out.add(j), p);
                        j += 16;
                    }
                    while j < $n {
                        zero16($out.add(j));
                        j += 16;
                    }
                    s::hsum(s::add(sum0, sum1))
                };
                if $m_old.is_finite() {
                    // A later step against the running max; kept where the sum allows (not `>`:
                    // a NaN sum redoes the row).
                    let sum = pass($m_old);
                    if sum <= super::ONE_PASS_SUM_MAX {
                        return ($m_old, sum);
                    }
                }
                // A first step, or a later one the running max did not hold (a score far above
                // it, an inf, a NaN): against its own max, whatever the sum. Every `p` is then at
                // most 1 and the row's largest exactly 1; an inf or NaN score gives the row the
                // NaN the contract asks for. Never below the running max.
                let m_new = (visible_max($sp, $a, $b) * $qscale).max($m_old);
                return (m_new, pass(m_new));
            }
            // Not `qscale > 0` (NaN included): scale first (a negative scale turns the max
            // around), hidden lanes -inf.
            let sc = s::splat($qscale);
            let mut m0 = ninf;
            let mut j = 0;
            while j < $n {
                let x = _mm512_mask_blend_ps(visible(j, $a, $b), ninf, s::mul(s::load($sp.add(j)), sc));
                s::store($sp.add(j), x);
                m0 = s::max(m0, x);
                j += 16;
            }
            let m_new = s::hmax(m0).max($m_old);
            let mv = s::splat(m_new);
            let mut sum0 = s::zero();
            let mut j = 0;
            while j < $n {
                let p = $exp2(s::sub(s::load($sp.add(j)), mv));
                sum0 = s::add(sum0, p);
                $store($out.add(j), p);
                j += 16;
            }
            (m_new, s::hsum(sum0))
        }};
    }

    /// The backward row's body ([`super::bwd_row16`]), per target-feature set as `row_body`.
    macro_rules! bwd_body {
        ($exp2:path, $sp:ident, $dp:ident, $n:ident, $a:ident, $b:ident, $qs:ident, $lse2:ident, $di:ident, $pa:ident, $dxa:ident, $store2:expr) => {{
            let (qs, nl2, div) = (s::splat($qs), s::splat(-$lse2), s::splat($di));
            let full = $a == 0 && $b == $n;
            let mut j = 0;
            while j < $n {
                let mut p0 = $exp2(s::fma(s::load($sp.add(j)), qs, nl2));
                let mut p1 = $exp2(s::fma(s::load($sp.add(j + 16)), qs, nl2));
                if !full {
                    p0 = _mm512_maskz_mov_ps(visible(j, $a, $b), p0);
                    p1 = _mm512_maskz_mov_ps(visible(j + 16, $a, $b), p1);
                }
                let d0 = s::mul(p0, s::sub(s::load($dp.add(j)), div));
                let d1 = s::mul(p1, s::sub(s::load($dp.add(j + 16)), div));
                $store2($pa.add(j), p0, p1);
                $store2($dxa.add(j), d0, d1);
                j += 32;
            }
        }};
    }

    /// 32 lanes, `p0` then `p1`, as f16 (`F16`) or bf16 at `out`, 16 per [`store16`].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store2<const F16: bool>(out: *mut u16, p0: __m512, p1: __m512) {
        store16(F16, out, p0);
        store16(F16, out.add(16), p1)
    }

    /// The backward's row in f16 (`F16`) or in bf16 without AVX512-BF16.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn bwd_plain<const F16: bool>(sp: *const f32, dp: *const f32, n: usize, a: usize, b: usize, qs: f32, lse2: f32, di: f32, pa: *mut u16, dxa: *mut u16) {
        bwd_body!(s::exp2, sp, dp, n, a, b, qs, lse2, di, pa, dxa, |o: *mut u16, p0, p1| store2::<F16>(o, p0, p1))
    }

    /// `VCVTNE2PS2BF16` reads denormals as 0: the same as the units do with a denormal bf16
    /// operand (`TDPBF16PS`, `VDPBF16PS`), so the products come out as from [`bwd_plain`].
    #[target_feature(enable = "avx512f,avx512bf16,avx512dq")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn bwd_bf16_native(sp: *const f32, dp: *const f32, n: usize, a: usize, b: usize, qs: f32, lse2: f32, di: f32, pa: *mut u16, dxa: *mut u16) {
        bwd_body!(s::exp2_dq, sp, dp, n, a, b, qs, lse2, di, pa, dxa, |o: *mut u16, p0, p1| store2_bf16_native(o, p0, p1))
    }

    /// [`super::bwd_row16`] without softcap (`n` a multiple of 32).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn bwd_row16(f16: bool, sp: *const f32, dp: *const f32, n: usize, a: usize, b: usize, qs: f32, lse2: f32, di: f32, pa: *mut u16, dxa: *mut u16) {
        debug_assert!(n.is_multiple_of(32));
        if f16 {
            bwd_plain::<true>(sp, dp, n, a, b, qs, lse2, di, pa, dxa)
        } else if std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512dq") {
            bwd_bf16_native(sp, dp, n, a, b, qs, lse2, di, pa, dxa)
        } else {
            bwd_plain::<false>(sp, dp, n, a, b, qs, lse2, di, pa, dxa)
        }
    }

    /// The forward's row in f16 (`F16`) or in bf16 without AVX512-BF16.
    #[target_feature(enable = "avx512f")]
    unsafe fn row_plain<const F16: bool>(sp: *mut f32, n: usize, a: usize, b: usize, qscale: f32, m_old: f32, out: *mut u16) -> (f32, f32) {
        row_body!(s::exp2, s::exp2, sp, n, a, b, qscale, m_old, out, |o: *mut u16, p| store16(F16, o, p), |o: *mut u16, p0, p1| store2::<F16>(o, p0, p1))
    }

    #[target_feature(enable = "avx512f,avx512bf16,avx512dq")]
    unsafe fn row_bf16_native(sp: *mut f32, n: usize, a: usize, b: usize, qscale: f32, m_old: f32, out: *mut u16) -> (f32, f32) {
        row_body!(s::exp2_dq, s::exp2_floor, sp, n, a, b, qscale, m_old, out, |o: *mut u16, p| store_bf16_native(o, p), |o: *mut u16, p0, p1| store2_bf16_native(o, p0, p1))
    }

    /// [`super::fwd_row16`] without softcap (`n` a multiple of 64: whole key tiles).
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn fwd_row16(f16: bool, sp: *mut f32, n: usize, a: usize, b: usize, qscale: f32, m_old: f32, out: *mut u16) -> (f32, f32) {
        debug_assert!(n.is_multiple_of(64));
        if f16 {
            row_plain::<true>(sp, n, a, b, qscale, m_old, out)
        } else if std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512dq") {
            row_bf16_native(sp, n, a, b, qscale, m_old, out)
        } else {
            row_plain::<false>(sp, n, a, b, qscale, m_old, out)
        }
    }
}
