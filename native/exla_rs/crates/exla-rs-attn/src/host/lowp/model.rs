//! Software models of the dot-product instructions, written from Intel's definitions (SDM,
//! instruction pages `VDPBF16PS`, `TDPBF16PS`, `TDPFP16PS`), so the tiling that drives them runs
//! (slowly) on any machine and the real units can be checked against them.
//!
//! Common rules of the three instructions (SDM): every accumulation is an FP32 FMA rounded to
//! nearest even whatever MXCSR says; denormal inputs read as 0 (DAZ; not for the FP16 inputs of
//! `TDPFP16PS`, which AMX-FP16 honours), denormal results are written as 0 (FTZ); no exceptions.
//!
//! - `VDPBF16PS` (AVX512_BF16), per f32 lane `i`: `acc += a[2i+1]·b[2i+1]`, then
//!   `acc += a[2i]·b[2i]`: the odd (upper) pair element first, two FMAs, two roundings.
//! - `TDPBF16PS` / `TDPFP16PS` (AMX), per row `m` of C: two temporaries per column, `even[n]` and
//!   `odd[n]`, start at +0; for each pair `k`, for each column `n`:
//!   `even[n] += A[m][2k]·B[k][2n]`, `odd[n] += A[m][2k+1]·B[k][2n+1]` (FMAs); then
//!   `C[m][n] += (even[n] + odd[n])`. That is the pseudo-code's order, and what [`tdp`] does.
//!   The hardware is only required to give "the" dot product with those rounding rules; its
//!   internal order and width are not architectural, so real AMX results are compared with this
//!   model within [`amx_bound`], not bit for bit.
//!
//! bf16 × bf16 and f16 × f16 products are exact in f64 (8 + 8, 11 + 11 significand bits), which
//! the FTZ rule below uses; in f32 a bf16 product can still overflow or underflow, so each step
//! is a real fused multiply-add ([`f32::mul_add`], correctly rounded), not a product then a sum.

/// The 16-bit element type a unit multiplies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Half16 {
    Bf16,
    F16,
}

/// The x86 "QNaN floating-point indefinite": what an invalid operation (`inf·0`, `inf - inf`)
/// returns when no operand is a NaN.
pub(crate) const DEFAULT_NAN: u32 = 0xFFC0_0000;
const SIGN: u32 = 0x8000_0000;
const QUIET: u32 = 0x0040_0000;

/// Denormals-are-zero: a denormal reads as a zero of its sign.
#[inline]
pub(crate) fn daz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & SIGN)
    } else {
        x
    }
}

/// `make_fp32` of the SDM: the bf16 bits as the upper half of an f32 (exact), then DAZ.
#[inline]
pub(crate) fn bf16_in(x: u16) -> f32 {
    daz(f32::from_bits((x as u32) << 16))
}

/// An f16 as f32, exactly (denormals kept: AMX-FP16 does not flush its FP16 inputs); a NaN
/// keeps its payload in the upper bits, like `make_fp32` does for bf16.
#[inline]
pub(crate) fn f16_in(x: u16) -> f32 {
    let sign = ((x as u32) & 0x8000) << 16;
    let exp = ((x >> 10) & 0x1F) as u32;
    let man = (x & 0x3FF) as u32;
    let mag = match exp {
        0 => (man as f32) * (-24f32).exp2(),
        31 => f32::from_bits(0x7F80_0000 | (man << 13)),
        _ => f32::from_bits(((exp + 127 - 15) << 23) | (man << 13)),
    };
    f32::from_bits(mag.to_bits() | sign)
}

/// One input element of `elem` as the instruction reads it.
#[inline]
pub(crate) fn elem_in(elem: Half16, x: u16) -> f32 {
    match elem {
        Half16::Bf16 => bf16_in(x),
        Half16::F16 => f16_in(x),
    }
}

/// `2^-126 - 2^-151`: an exact result below this rounds (to 24 bits, exponent unbounded) to
/// less than the smallest normal, which is when x86 calls a result tiny (it detects tininess
/// after rounding) and FTZ writes 0.
const TINY_BELOW: f64 = f64::from_bits(0x3810_0000_0000_0000) - f64::from_bits(0x3680_0000_0000_0000);

/// Flush-to-zero of a correctly rounded result `r` whose exact value is `exact`.
///
/// `r` is rounded onto the denormal grid, so `r` = ±2^-126 can come from an exact value in
/// `[2^-126 - 2^-150, 2^-126 - 2^-151)` that x86 nevertheless calls tiny; `exact` (f64) tells
/// those apart. It is exact there: the operands' bits lie within 53 bits of 2^-126 whenever
/// the rounded sum is ±2^-126 (products have 16/22 significant bits and are ≥ 2^-252 / 2^-48;
/// the accumulator, DAZ'd, is 0 or a multiple of 2^-149).
#[inline]
fn ftz(r: f32, exact: f64) -> f32 {
    let tiny = r.is_subnormal() || (r.abs() == f32::MIN_POSITIVE && exact.abs() < TINY_BELOW);
    if tiny {
        f32::from_bits(r.to_bits() & SIGN)
    } else {
        r
    }
}

/// The NaN an operation returns: the first NaN operand (in the instruction's priority order),
/// quieted; the default NaN if the operation itself was invalid.
#[inline]
fn nan_of(ops: &[f32]) -> f32 {
    ops.iter().find(|x| x.is_nan()).map_or(f32::from_bits(DEFAULT_NAN), |x| f32::from_bits(x.to_bits() | QUIET))
}

/// `acc + a·b` as the units' FMA: one RNE rounding, DAZ on `acc` (`a`, `b` come from
/// [`elem_in`]), FTZ on the result. NaN priority: `a`, then `b`, then `acc`.
#[inline]
pub(crate) fn fma_step(acc: f32, a: f32, b: f32) -> f32 {
    let acc = daz(acc);
    let r = a.mul_add(b, acc);
    if r.is_nan() {
        return nan_of(&[a, b, acc]);
    }
    ftz(r, acc as f64 + a as f64 * b as f64)
}

/// `x + y` with DAZ on both, RNE, FTZ. NaN priority: `x`, then `y`.
#[inline]
pub(crate) fn add_step(x: f32, y: f32) -> f32 {
    let (x, y) = (daz(x), daz(y));
    let r = x + y;
    if r.is_nan() {
        return nan_of(&[x, y]);
    }
    ftz(r, x as f64 + y as f64)
}

/// `VDPBF16PS zmm` (512 bits): 16 f32 lanes, each fed by one bf16 pair of `a` and of `b`.
pub(crate) fn vdpbf16ps(acc: [f32; 16], a: &[u16; 32], b: &[u16; 32]) -> [f32; 16] {
    let mut out = acc;
    for (i, o) in out.iter_mut().enumerate() {
        // Upper element of the pair first (SDM), so a NaN there is overridden by one in the
        // lower element: that is the priority table (src1 low, src2 low, src1 high, ...).
        let t = fma_step(*o, bf16_in(a[2 * i + 1]), bf16_in(b[2 * i + 1]));
        *o = fma_step(t, bf16_in(a[2 * i]), bf16_in(b[2 * i]));
    }
    out
}

/// One `TDPBF16PS`/`TDPFP16PS tmm_c, tmm_a, tmm_b` under `cfg` (shapes of tiles
/// [`super::tile::TMM_C`], `TMM_A`, `TMM_B`): `C[M × N] += A[M × 2K]·B`, with B in VNNI layout
/// (`B[k][2n + e]` = element `2k + e` of the reduction for column `n`). Tiles are addressed like
/// `tileloadd` does: row `r` of A starts at `a[r·lda]` (strides in elements).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tdp(elem: Half16, cfg: &super::tile::TileConfig, c: &mut [f32], ldc: usize, a: &[u16], lda: usize, b: &[u16], ldb: usize) {
    use super::tile::{TMM_A, TMM_B, TMM_C};
    let (m_rows, c_colsb) = cfg.shape(TMM_C);
    let (_, a_colsb) = cfg.shape(TMM_A);
    let (b_rows, b_colsb) = cfg.shape(TMM_B);
    let (n_cols, k_pairs) = (c_colsb / 4, a_colsb / 4);
    // The instruction's own #UD conditions, as asserts: the kernels never break them.
    assert!(m_rows <= 16 && c_colsb <= 64 && a_colsb <= 64 && b_colsb == c_colsb && b_rows == k_pairs, "tile shapes {cfg:?}");
    let mut even = [0f32; 16];
    let mut odd = [0f32; 16];
    for m in 0..m_rows {
        even.fill(0.0);
        odd.fill(0.0);
        let arow = &a[m * lda..m * lda + 2 * k_pairs];
        for k in 0..k_pairs {
            let (a0, a1) = (elem_in(elem, arow[2 * k]), elem_in(elem, arow[2 * k + 1]));
            let brow = &b[k * ldb..k * ldb + 2 * n_cols];
            for n in 0..n_cols {
                even[n] = fma_step(even[n], a0, elem_in(elem, brow[2 * n]));
                odd[n] = fma_step(odd[n], a1, elem_in(elem, brow[2 * n + 1]));
            }
        }
        let crow = &mut c[m * ldc..m * ldc + n_cols];
        for n in 0..n_cols {
            crow[n] = add_step(crow[n], add_step(even[n], odd[n]));
        }
    }
}

/// How far a real AMX result may be from [`tdp`]'s for one C entry: both are the exact
/// `c + Σ_{i<2K} a_i·b_i` up to roundings. The model rounds each of its 2K + 1 additions
/// (relative error ≤ u = 2^-24 each), so it is within `2K·u·(|c| + Σ|a_i·b_i|)` of the exact
/// value (first order); hardware that adds in any order with f32 or wider intermediates is
/// within the same, so the two differ by at most twice that, plus 2^-125 for values either
/// side may have flushed (FTZ). `abs_sum` = `|c| + Σ|a_i·b_i|`, `k_elems` = 2K.
pub(crate) fn amx_bound(abs_sum: f64, k_elems: usize) -> f64 {
    2.0 * (k_elems as f64 + 1.0) * (-24f64).exp2() * abs_sum + (-125f64).exp2()
}
