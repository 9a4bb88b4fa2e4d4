//! Packing the operands into the units' layouts ([`super::unit`]): 16-bit elements, the
//! reduction padded with zeros to a multiple of [`TILE_K`], B operands in VNNI panels.
//!
//! Per (batch, kv head), for key tiles of [`BC`] keys and head dim padded to `dp`:
//! - `kt` (B of `S = Q·Kᵀ`, reduction over d): tile `t`, key panel `p` (16 keys), pair-row `r`
//!   (d = 2r, 2r+1), key `n` of the panel, element `e`:
//!   `kt[(((t·BC/16 + p)·dp/2 + r)·16 + n)·2 + e] = k[t·BC + 16p + n][2r + e]`.
//! - `vt` (B of `O += P·V`, reduction over keys), for `skp` keys (`Sk` padded to whole tiles):
//!   d panel `p` (16 columns of d) holding every key, pair-row `r` (keys 2r, 2r+1), column `n`,
//!   element `e`: `vt[((p·skp/2 + r)·16 + n)·2 + e] = v[2r + e][16p + n]`. A product over any run
//!   of whole tiles is then one contiguous reduction per panel (the forward's key steps); with
//!   `skp = BC` it is one tile's panel (the backward's per-tile packs).
//!
//! Keys past `Sk` and d past `D` are 0, so they add nothing (0·0) to any product.

use super::super::HostElement;
use super::model::Half16;
use super::tile::{TILE_K, TILE_N};

/// Keys per tile: a multiple of [`TILE_K`] (P·V's reduction) and of [`TILE_N`] (S's columns).
pub(crate) const BC: usize = 64;

/// `x` (a value of type `elem`, or any f32 for P) as `elem`'s bits, rounded to nearest even.
#[inline]
pub(crate) fn bits(elem: Half16, x: f32) -> u16 {
    match elem {
        Half16::Bf16 => half::bf16::from_f32(x).to_bits(),
        Half16::F16 => half::f16::from_f32(x).to_bits(),
    }
}

/// `x` as `elem`'s bits: the input's own bits when it already is `elem` (every real call: the
/// unit's type is the call's), else rounded from its f32 value.
#[inline(always)]
pub(crate) fn src_bits<T: HostElement>(elem: Half16, x: T) -> u16 {
    if is_elem::<T>(elem) {
        // SAFETY: T is a 2-byte 16-bit float type (checked), every bit pattern of which is a u16.
        unsafe { std::mem::transmute_copy::<T, u16>(&x) }
    } else {
        bits(elem, x.to_f32())
    }
}

/// `src` as `elem`'s bits into `dst` (the same length): a copy of the bits when `T` is `elem`
/// (every real call), else rounded from f32. Per element through [`src_bits`] this was a
/// scalar loop testing the type on every element: 8% of a bf16 forward's samples, for Q alone.
pub(crate) fn row_bits<T: HostElement>(elem: Half16, src: &[T], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    if is_elem::<T>(elem) {
        // SAFETY: T is a 2-byte 16-bit float type (checked), every bit pattern of which is a u16.
        dst.copy_from_slice(unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u16>(), src.len()) });
    } else {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = bits(elem, x.to_f32());
        }
    }
}

/// `src` (bits of `elem`) into `dst` as `T`, where `T` is `elem` ([`is_elem`]; asserted).
pub(crate) fn store_bits<T: HostElement>(elem: Half16, src: &[u16], dst: &mut [T]) {
    assert!(is_elem::<T>(elem) && src.len() == dst.len());
    // SAFETY: T is a 2-byte 16-bit float type (asserted), every u16 of which is a value of it.
    unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u16>(), dst.len()) }.copy_from_slice(src);
}

/// Whether `T` is `elem` itself (a 2-byte type whose bits the units read as they are).
#[inline(always)]
pub(crate) fn is_elem<T: HostElement>(elem: Half16) -> bool {
    let same = matches!((T::TYPE, elem), (crate::ElementType::BF16, Half16::Bf16) | (crate::ElementType::F16, Half16::F16));
    same && std::mem::size_of::<T>() == 2
}

/// Whether every element of `x` is finite. For the 16-bit types a test of the exponent bits that
/// compiles to vector code (no early exit inside a chunk): checked per element through f32 with
/// an early exit, this was 4% of a bf16 backward.
pub(crate) fn all_finite<T: HostElement>(x: &[T]) -> bool {
    let exp = match T::TYPE {
        crate::ElementType::BF16 => 0x7F80u16,
        crate::ElementType::F16 => 0x7C00u16,
        _ => return x.iter().all(|v| v.to_f32().is_finite()),
    };
    assert_eq!(std::mem::size_of::<T>(), 2);
    // SAFETY: T is a 2-byte float type (asserted); every bit pattern is a u16.
    let bits = unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u16>(), x.len()) };
    bits.chunks(4096).all(|c| !c.iter().fold(false, |bad, &b| bad | (b & exp == exp)))
}

/// The value of `elem`'s bits, exactly (no flushing: this is the input, not a unit's view).
#[inline]
pub(crate) fn value(elem: Half16, x: u16) -> f32 {
    match elem {
        Half16::Bf16 => half::bf16::from_bits(x).to_f32(),
        Half16::F16 => half::f16::from_bits(x).to_f32(),
    }
}

/// Head dim padded to the units' reduction step (also a multiple of [`TILE_N`]).
pub(crate) fn padded_dim(d: usize) -> usize {
    d.div_ceil(TILE_K) * TILE_K
}

/// Rows of one operand: row `j` is `base[j·stride..j·stride + d]`.
#[derive(Clone, Copy)]
pub(crate) struct Rows<'a, T> {
    pub base: &'a [T],
    pub stride: usize,
}

impl<'a, T> Rows<'a, T> {
    fn row(&self, j: usize, d: usize) -> &'a [T] {
        &self.base[j * self.stride..j * self.stride + d]
    }
}

/// `K`'s `sk` rows into `kt` (`skp·dp` elements, `sk ≤ skp`, `skp` a multiple of 16): every
/// element written, keys past `sk` and columns past `d` as zeros.
pub(crate) fn pack_kt<T: HostElement>(elem: Half16, kt: &mut [u16], sk: usize, skp: usize, d: usize, dp: usize, rows: Rows<'_, T>) {
    assert!(sk <= skp && skp.is_multiple_of(TILE_N) && kt.len() >= skp * dp && (sk == 0 || rows.base.len() >= (sk - 1) * rows.stride + d));
    #[cfg(target_arch = "x86_64")]
    if fast::usable::<T>(elem, d) {
        // SAFETY: the CPU features are present (`usable`); extents asserted above.
        return unsafe { fast::pack_kt(kt, sk, skp, d, dp, rows) };
    }
    kt[..skp * dp].fill(0);
    // Key j's panel is j / 16 (tiles hold whole panels): t·BC/16 + p of the layout above.
    for j in 0..sk {
        let n = j % TILE_N;
        let panel = &mut kt[(j / TILE_N) * dp * TILE_N..][..dp * TILE_N];
        for (dd, &x) in rows.row(j, d).iter().enumerate() {
            panel[((dd / 2) * TILE_N + n) * 2 + dd % 2] = src_bits(elem, x);
        }
    }
}

/// `V`'s `sk` rows into `vt` (`skp·dp` elements, `sk ≤ skp`, `skp` even): every element
/// written, keys past `sk` and columns past `d` as zeros.
pub(crate) fn pack_vt<T: HostElement>(elem: Half16, vt: &mut [u16], sk: usize, skp: usize, d: usize, dp: usize, rows: Rows<'_, T>) {
    assert!(sk <= skp && skp.is_multiple_of(2) && vt.len() >= skp * dp && (sk == 0 || rows.base.len() >= (sk - 1) * rows.stride + d));
    #[cfg(target_arch = "x86_64")]
    if fast::usable::<T>(elem, d) {
        // SAFETY: the CPU features are present (`usable`); extents asserted above.
        return unsafe { fast::pack_vt(vt, sk, skp, d, dp, rows) };
    }
    vt[..skp * dp].fill(0);
    for j in 0..sk {
        let (r, e) = (j / 2, j % 2);
        for (dd, &x) in rows.row(j, d).iter().enumerate() {
            let (p, n) = (dd / TILE_N, dd % TILE_N);
            vt[((p * skp / 2 + r) * TILE_N + n) * 2 + e] = src_bits(elem, x);
        }
    }
}

/// `dst[c·ld_dst + r] = src[r·ld_src + c]` for `r < rows`, `c < cols`: a block transposed, 16 × 16
/// at a time so that both sides stay in a few dozen lines (element by element over whole rows,
/// the backward's operand packing wrote one line per element and was a fifth of its time).
pub(crate) fn transpose<X: Copy>(src: &[X], ld_src: usize, rows: usize, cols: usize, dst: &mut [X], ld_dst: usize) {
    if rows == 0 || cols == 0 {
        return;
    }
    assert!(src.len() >= (rows - 1) * ld_src + cols && dst.len() >= (cols - 1) * ld_dst + rows);
    const T: usize = 16;
    for r0 in (0..rows).step_by(T) {
        for c0 in (0..cols).step_by(T) {
            for c in c0..cols.min(c0 + T) {
                let out = &mut dst[c * ld_dst..];
                for r in r0..rows.min(r0 + T) {
                    out[r] = src[r * ld_src + c];
                }
            }
        }
    }
}

/// A 16-bit row-major block (`rows` × `cols`, row stride `ld`, `rows` even, `cols` a multiple of
/// 16) as B operand panels with the reduction along its rows: `dst[((p·rows/2 + r)·16 + n)·2 + e]
/// = src[(2r + e)·ld + 16p + n]` (the `vt` layout with rows for keys and columns for d). This
/// is how the backward's P and dS become the B of `dVᵀ += dOᵀ·P` and `dKᵀ += Qᵀ·dS`.
pub(crate) fn vnni_rows(src: &[u16], ld: usize, rows: usize, cols: usize, dst: &mut [u16]) {
    assert!(rows.is_multiple_of(2) && cols.is_multiple_of(TILE_N) && cols <= ld && src.len() >= (rows - 1) * ld + cols && dst.len() >= rows * cols);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F present; extents asserted above.
        return unsafe { fast::vnni_rows(src, ld, rows, cols, dst) };
    }
    for r in 0..rows / 2 {
        for c in 0..cols {
            let (p, n) = (c / TILE_N, c % TILE_N);
            for e in 0..2 {
                dst[((p * rows / 2 + r) * TILE_N + n) * 2 + e] = src[(2 * r + e) * ld + c];
            }
        }
    }
}

/// The packers with AVX-512 for inputs already of the unit's type (every real call): K by
/// 16-key gathers of 32-bit pairs, one 64-byte pair-row per gather; V by widening two key rows
/// and interleaving them, one 64-byte pair-row per 16 columns. The scalar loops spent 2.5 ns an
/// element, 14% of an S = 2048 bf16 forward on AMX.
#[cfg(target_arch = "x86_64")]
mod fast {
    use super::super::super::HostElement;
    use super::super::model::Half16;
    use super::{Rows, TILE_N};
    use core::arch::x86_64::*;

    /// Whether the fast packers apply: 16-bit inputs of `elem`'s type, pairs whole (`d` even),
    /// AVX-512 F/BW/VL present.
    pub(super) fn usable<T: HostElement>(elem: Half16, d: usize) -> bool {
        super::is_elem::<T>(elem) && d.is_multiple_of(2) && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")
    }

    /// # Safety
    /// As [`super::pack_kt`]'s assertions; AVX-512 F/BW/VL present; `T` 16-bit, `d` even.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_kt<T: HostElement>(kt: &mut [u16], sk: usize, skp: usize, d: usize, dp: usize, rows: Rows<'_, T>) {
        let base = rows.base.as_ptr().cast::<u8>();
        // Key n of a panel is `n·stride` elements, i.e. n·stride/2 pairs, from the panel's first.
        let lane = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32((rows.stride * 2) as i32));
        let out = kt.as_mut_ptr();
        for panel in 0..skp / TILE_N {
            let j0 = panel * TILE_N;
            let keys = sk.saturating_sub(j0).min(TILE_N);
            let mask: __mmask16 = ((1u32 << keys) - 1) as __mmask16;
            let first = base.add(j0.min(sk.saturating_sub(1)) * rows.stride * 2);
            for pr in 0..dp / 2 {
                let dst = out.add((panel * dp / 2 + pr) * TILE_N * 2).cast::<__m512i>();
                let v = if 2 * pr < d && mask != 0 { _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, lane, first.add(4 * pr).cast()) } else { _mm512_setzero_si512() };
                _mm512_storeu_si512(dst, v);
            }
        }
    }

    /// # Safety
    /// As [`super::vnni_rows`]'s assertions; AVX-512F present.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn vnni_rows(src: &[u16], ld: usize, rows: usize, cols: usize, dst: &mut [u16]) {
        let (s, out) = (src.as_ptr(), dst.as_mut_ptr());
        for r in 0..rows / 2 {
            for p in 0..cols / TILE_N {
                let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(s.add(2 * r * ld + p * TILE_N).cast()));
                let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(s.add((2 * r + 1) * ld + p * TILE_N).cast()));
                _mm512_storeu_si512(out.add((p * rows / 2 + r) * TILE_N * 2).cast(), _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi)));
            }
        }
    }

    /// # Safety
    /// As [`super::pack_vt`]'s assertions; AVX-512 F/BW/VL present; `T` 16-bit, `d` even.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_vt<T: HostElement>(vt: &mut [u16], sk: usize, skp: usize, d: usize, dp: usize, rows: Rows<'_, T>) {
        let base = rows.base.as_ptr().cast::<u16>();
        let out = vt.as_mut_ptr();
        let load = |j: usize, col: usize| -> __m512i {
            if j >= sk || col >= d {
                return _mm512_setzero_si512();
            }
            let m: __mmask16 = ((1u32 << (d - col).min(16)) - 1) as __mmask16;
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, base.add(j * rows.stride + col).cast()))
        };
        for r in 0..skp / 2 {
            for p in 0..dp / TILE_N {
                let (lo, hi) = (load(2 * r, p * TILE_N), load(2 * r + 1, p * TILE_N));
                let pair = _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi));
                _mm512_storeu_si512(out.add((p * skp / 2 + r) * TILE_N * 2).cast(), pair);
            }
        }
    }
}

/// Element (key `j`, column `dd`) of a packed V of `skp` keys.
#[inline]
pub(crate) fn vt_at(vt: &[u16], skp: usize, j: usize, dd: usize) -> u16 {
    let (p, n, r, e) = (dd / TILE_N, dd % TILE_N, j / 2, j % 2);
    vt[((p * skp / 2 + r) * TILE_N + n) * 2 + e]
}
