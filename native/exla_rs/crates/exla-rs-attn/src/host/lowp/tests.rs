//! `cargo test -p exla-rs-attn lowp`:
//! - the models against hand-checked values (pair order, RNE ties, DAZ, FTZ and x86's
//!   tininess-after-rounding, inf/NaN);
//! - the 16-bit forward and backward on each model unit against the float64 reference of
//!   `host/tests.rs`;
//! - where the CPU has a real unit, its tile products against the model (bit for bit for
//!   AVX512-BF16, within `model::amx_bound` for AMX) and its passes against the reference;
//!   without one they say so on stderr;
//! - the choice of unit from the environment and the detected hardware.

use half::{bf16, f16};

use super::super::tests::{cast, check, check_fully_masked_rows, check_lse, inputs, reference, Case, Rng};
use super::super::{available, dispatch, kernels, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement, Which};
use super::pack;
use super::model::{self, Half16, DEFAULT_NAN};
use super::tile::{LOWP_TILES, TILE_K, TILE_M, TILE_N};
#[cfg(target_arch = "x86_64")]
use super::probe::amx_bounds;
use super::probe::{agrees, tile_product};
use super::unit::{blocks, ModelAmx, ModelAvx512Bf16, TileGemm, TileUnit, UnitScope, Walk};
use super::{backward_with, forward_with, pick, Detected, Policy, Unit};
use crate::ElementType;

/// bf16 bits of a power of two (exact).
fn p2(e: i32) -> u16 {
    bf16::from_f32((e as f32).exp2()).to_bits()
}
const ONE: u16 = 0x3F80;

/// One lane of `VDPBF16PS`: `acc + a_hi·b_hi + a_lo·b_lo` (in the model's order).
fn vdp1(acc: f32, a: [u16; 2], b: [u16; 2]) -> f32 {
    let mut aa = [0u16; 32];
    let mut bb = [0u16; 32];
    aa[..2].copy_from_slice(&a);
    bb[..2].copy_from_slice(&b);
    let mut acc16 = [0f32; 16];
    acc16[0] = acc;
    model::vdpbf16ps(acc16, &aa, &bb)[0]
}

#[test]
fn lowp_vdpbf16ps_by_hand() {
    let bf = |x: f32| bf16::from_f32(x).to_bits();
    // 0.5 + 2·4 + 1·3.
    assert_eq!(vdp1(0.5, [bf(1.0), bf(2.0)], [bf(3.0), bf(4.0)]), 11.5);
    // Pair order: the upper element first. 1 + 2^24 ties to even (2^24), then + 1 ties again:
    // 2^24. Lower first would give 1 + 1 = 2, then 2^24 + 2 exactly.
    assert_eq!(vdp1(1.0, [ONE, p2(24)], [ONE, ONE]), 16_777_216.0);
    // RNE, not truncation: (2^24 + 2) + 1 is a tie between 2^24+2 (odd) and 2^24+4 (even).
    assert_eq!(vdp1(16_777_218.0, [ONE, 0], [ONE, 0]), 16_777_220.0);
    // DAZ: the smallest bf16 denormal (2^-133) reads as 0, so ·2^100 adds 0 (not 2^-33).
    assert_eq!(vdp1(0.0, [0x0001, 0], [p2(100), 0]).to_bits(), 0);
    // DAZ on the accumulator too: a denormal f32 accumulator reads as 0.
    assert_eq!(vdp1(f32::from_bits(1), [0, 0], [0, 0]).to_bits(), 0);
    // FTZ: 2^-70·2^-70 = 2^-140 is an f32 denormal: written as 0, keeping the sign.
    assert_eq!(vdp1(0.0, [p2(-70), 0], [p2(-70), 0]).to_bits(), 0);
    assert_eq!(vdp1(0.0, [p2(-70) | 0x8000, 0], [p2(-70), 0]).to_bits(), 0x8000_0000);
    // Tininess after rounding: 2^-126 - 2^-150 rounds onto the denormal grid to 2^-126, but
    // with an unbounded exponent it is representable below 2^-126, so x86 calls it tiny: 0.
    let min = f32::MIN_POSITIVE;
    assert_eq!(vdp1(min, [p2(-75) | 0x8000, 0], [p2(-75), 0]).to_bits(), 0);
    // 2^-126 - 2^-152 rounds to 2^-126 either way: kept.
    assert_eq!(vdp1(min, [p2(-76) | 0x8000, 0], [p2(-76), 0]), min);
    // Overflow: 2^127·2^127 is +inf.
    assert_eq!(vdp1(0.0, [p2(127), 0], [p2(127), 0]), f32::INFINITY);
    // inf·0 is invalid: the default NaN, which then propagates through the second FMA.
    let inf = 0x7F80;
    assert_eq!(vdp1(0.0, [ONE, inf], [ONE, 0]).to_bits(), DEFAULT_NAN);
    // inf + (-inf): the default NaN.
    assert_eq!(vdp1(f32::INFINITY, [0, inf | 0x8000], [0, ONE]).to_bits(), DEFAULT_NAN);
    // inf propagates.
    assert_eq!(vdp1(0.0, [ONE, inf], [ONE, ONE]), f32::INFINITY);
    // NaN priority (SDM table 5-1): src1 low beats src2 high, quieted (0x7F81 -> 0x7FC10000).
    assert_eq!(vdp1(0.0, [0x7F81, ONE], [ONE, 0x7FA0]).to_bits(), 0x7FC1_0000);
    // src2 high beats srcdest.
    assert_eq!(vdp1(f32::from_bits(0x7FC0_1234), [ONE, ONE], [ONE, 0x7FA0]).to_bits(), 0x7FE0_0000);
    // srcdest's NaN when the sources have none.
    assert_eq!(vdp1(f32::from_bits(0x7FC0_1234), [ONE, ONE], [ONE, ONE]).to_bits(), 0x7FC0_1234);
}

/// C (16×16) of one `TDP*PS` on tiles whose only nonzero entries are given:
/// `a[(row, element)]`, `b[(pair_row, column, element)]`.
fn tdp1(elem: Half16, c00: f32, a: &[((usize, usize), u16)], b: &[((usize, usize, usize), u16)]) -> f32 {
    let mut av = vec![0u16; TILE_M * TILE_K];
    let mut bv = vec![0u16; TILE_M * TILE_K];
    for &((r, p), x) in a {
        av[r * TILE_K + p] = x;
    }
    for &((k, n, e), x) in b {
        bv[k * TILE_K + 2 * n + e] = x;
    }
    let mut c = vec![0f32; TILE_M * TILE_N];
    c[0] = c00;
    model::tdp(elem, &LOWP_TILES, &mut c, TILE_N, &av, TILE_K, &bv, TILE_K);
    c[0]
}

#[test]
fn lowp_tdp_by_hand() {
    let bf = |x: f32| bf16::from_f32(x).to_bits();
    // 0.5 + (1·5 + 3·7) + (2·6 + 4·8).
    let a = [((0, 0), bf(1.0)), ((0, 1), bf(2.0)), ((0, 2), bf(3.0)), ((0, 3), bf(4.0))];
    let b = [((0, 0, 0), bf(5.0)), ((0, 0, 1), bf(6.0)), ((1, 0, 0), bf(7.0)), ((1, 0, 1), bf(8.0))];
    assert_eq!(tdp1(Half16::Bf16, 0.5, &a, &b), 70.5);
    // The SDM's order: even elements and odd elements summed apart over k, then added. Here
    // even = 2^24 + 0, odd = 1 + 1 = 2, so C = 2^24 + 2; summing the elements in sequence
    // (2^24, 1, 0, 1) would lose both 1s to ties-to-even and give 2^24.
    let a = [((0, 0), p2(24)), ((0, 1), ONE), ((0, 3), ONE)];
    let b = [((0, 0, 0), ONE), ((0, 0, 1), ONE), ((1, 0, 0), ONE), ((1, 0, 1), ONE)];
    assert_eq!(tdp1(Half16::Bf16, 0.0, &a, &b), 16_777_218.0);
    // Only row 0 / column 0 are touched: another column sees nothing.
    // bf16 denormal inputs are zero (DAZ) ...
    assert_eq!(tdp1(Half16::Bf16, 0.0, &[((0, 0), 0x0001)], &[((0, 0, 0), p2(100))]).to_bits(), 0);
    // ... f16 denormal inputs are not (AMX-FP16): 2^-24 · 2^10 = 2^-14.
    let h = |x: f32| f16::from_f32(x).to_bits();
    assert_eq!(tdp1(Half16::F16, 0.0, &[((0, 0), 0x0001)], &[((0, 0, 0), h(1024.0))]), (-14f32).exp2());
    // f16 inputs: 0.25 + 1.5·2 + 3·0.5.
    let a = [((0, 0), h(1.5)), ((0, 1), h(3.0))];
    let b = [((0, 0, 0), h(2.0)), ((0, 0, 1), h(0.5))];
    assert_eq!(tdp1(Half16::F16, 0.25, &a, &b), 4.75);
    // FTZ on the final sum: 2^-127 (denormal) from 2^-63.5-ish products is flushed; use
    // 2^-64·2^-63 = 2^-127 in bf16.
    assert_eq!(tdp1(Half16::Bf16, 0.0, &[((0, 0), p2(-64))], &[((0, 0, 0), p2(-63))]).to_bits(), 0);
    // inf·0: default NaN; NaN inputs propagate quieted.
    assert_eq!(tdp1(Half16::Bf16, 0.0, &[((0, 0), 0x7F80)], &[((0, 0, 0), 0)]).to_bits(), DEFAULT_NAN);
    assert_eq!(tdp1(Half16::Bf16, 1.0, &[((0, 0), 0x7F81)], &[((0, 0, 0), ONE)]).to_bits(), 0x7FC1_0000);
    assert_eq!(tdp1(Half16::F16, 1.0, &[((0, 1), 0x7C00)], &[((0, 0, 1), h(2.0))]), f32::INFINITY);
}

#[test]
fn lowp_tile_config_image() {
    let b = LOWP_TILES.bytes();
    assert_eq!(b[0], 1, "palette 1");
    for t in 0..8 {
        assert_eq!(u16::from_le_bytes([b[16 + 2 * t], b[17 + 2 * t]]), 64);
        assert_eq!(b[48 + t], 16);
    }
    assert!(b[2..16].iter().chain(&b[32..48]).chain(&b[56..]).all(|&x| x == 0), "reserved bytes are 0");
}

/// The 16-bit forward and backward on unit `U` for one case, checked like `host/tests.rs` checks the f32
/// path: against the f64 reference (which sees the same rounded inputs), lse `-inf`, `o = 0` and
/// `dq = 0` on fully masked rows.
fn run_case<T: HostElement, U: TileUnit>(which: Which, c: &Case, tol: f64, seed: u64) {
    let x = inputs::<T>(c, seed);
    let want = reference(c, &x);
    let (shape, opts) = (c.shape(), c.opts());
    let (q, k, v) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v));
    // Garbage first, so a missed write shows.
    let mut o = vec![T::from_f32(7.0); q.len()];
    let mut lse = vec![7.0f32; shape.lse_len()];
    forward_with::<T, U>(which, &shape, &opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start }, FwdOutputs { o: &mut o, lse: &mut lse });
    let tag = format!("{} {} {c:?}", std::any::type_name::<U>(), T::TYPE);
    let of: Vec<f32> = o.iter().map(|v| v.to_f32()).collect();
    check(&format!("o {tag}"), &of, &want.o, tol);
    check_lse(&format!("lse {tag}"), &lse, &want.lse, tol);

    // The backward from this forward's o and lse, as a training step runs them.
    let d_o = cast::<T>(&x.d_o);
    let mut dq = vec![T::from_f32(7.0); q.len()];
    let mut dk = vec![T::from_f32(7.0); k.len()];
    let mut dv = vec![T::from_f32(7.0); v.len()];
    backward_with::<T, U>(which, &shape, &opts, BwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start, o: &o, lse: &lse, d_o: &d_o }, BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv });
    let f = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    for (name, got, want) in [("dq", f(&dq), &want.dq), ("dk", f(&dk), &want.dk), ("dv", f(&dv), &want.dv)] {
        check(&format!("{name} {tag}"), &got, want, GRAD_TOL_FACTOR * tol);
    }
    check_fully_masked_rows(c, &want, &of, &f(&dq), &tag);
}

/// Small (the model is slow) shapes at the tiling's edges: Sq/Sk not multiples of 16/64, D from
/// 1 to 256 (padded to 32), causal, windows, softcap, kv_len < Sk (and 0: whole batch row
/// masked), q_start, GQA, rows fully masked by a window past kv_len.
fn cases() -> Vec<Case> {
    vec![
        Case::new(1, 37, 45, 4, 2, 32),
        Case::new(1, 70, 70, 2, 1, 64).win(-1, 0),
        Case::new(1, 33, 100, 2, 1, 80).win(-1, 0).qs(&[67]),
        Case::new(1, 20, 30, 1, 1, 128).cap(0.5),
        Case::new(2, 21, 40, 2, 2, 256).kv(&[0, 17]),
        Case::new(1, 40, 40, 1, 1, 8).win(0, 0).kv(&[20]),
        Case::new(1, 19, 23, 2, 1, 1),
        Case::new(1, 17, 70, 2, 2, 200).win(5, 7).cap(20.0),
    ]
}

/// Tolerances (max abs error over max |o|, as `host/tests.rs` measures), from P's rounding to
/// the input type (unit roundoff u: bf16 2^-9, f16 2^-12): each p moves by ≤ u·p, so `o` moves
/// by ≤ u·max|v| in the worst case (all errors one way) and by ~u·|v|·sqrt(Σp²) ≪ that for
/// independent roundings; `o`'s own rounding adds ≤ u·max|o|. These cases measure ≤ 1.6u
/// (bf16 2.0e-3..3.4e-3, f16 3.1e-4..6.2e-4); 4u keeps a margin and still fails on anything
/// larger than an output ulp (a packing or layout mistake is O(1)).
const TOL_BF16: f64 = 4.0 / 512.0;
const TOL_F16: f64 = 4.0 / 4096.0;
/// The gradients' tolerance over the forward's: they take a second rounding to the input type
/// (dX, besides P) and `o` in the input type; these cases measure ≤ 3.1u (bf16) and ≤ 3.8u
/// (f16), so 2x (8u), as `host/tests.rs` allows its gradients.
const GRAD_TOL_FACTOR: f64 = 2.0;

#[test]
fn lowp_fwd_bwd_model_amx_bf16() {
    for (n, c) in cases().iter().enumerate() {
        run_case::<bf16, ModelAmx<false>>(dispatch(), c, TOL_BF16, 5000 + n as u64);
    }
}

#[test]
fn lowp_fwd_bwd_model_amx_fp16() {
    for (n, c) in cases().iter().enumerate() {
        run_case::<f16, ModelAmx<true>>(dispatch(), c, TOL_F16, 6000 + n as u64);
    }
}

#[test]
fn lowp_fwd_bwd_model_avx512bf16() {
    for (n, c) in cases().iter().enumerate() {
        run_case::<bf16, ModelAvx512Bf16>(dispatch(), c, TOL_BF16, 7000 + n as u64);
    }
}

/// The model path runs the row pass of any family: the scalar one too.
#[test]
fn lowp_fwd_bwd_model_scalar_rows() {
    let c = Case::new(1, 30, 50, 2, 1, 48).win(-1, 0);
    run_case::<bf16, ModelAmx<false>>(Which::Scalar, &c, TOL_BF16, 8000);
}

/// An inf in V at a key some rows cannot see reaches only the rows that see it.
#[test]
fn lowp_forward_inf_in_v_stays_in_visible_rows() {
    let c = Case::new(1, 20, 20, 1, 1, 16).win(-1, 0);
    let x = inputs::<bf16>(&c, 9000);
    let (q, k, mut v) = (cast::<bf16>(&x.q), cast::<bf16>(&x.k), cast::<bf16>(&x.v));
    // Key 10, d 3: rows 0..10 (causal) never see it.
    v[10 * 16 + 3] = bf16::INFINITY;
    let mut o = vec![bf16::ZERO; q.len()];
    let mut lse = vec![0f32; 20];
    let (shape, opts) = (c.shape(), c.opts());
    forward_with::<bf16, ModelAmx<false>>(dispatch(), &shape, &opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start }, FwdOutputs { o: &mut o, lse: &mut lse });
    for i in 0..20 {
        let row = &o[i * 16..(i + 1) * 16];
        assert!(row.iter().all(|x| x.to_f32().is_finite()) == (i < 10), "row {i}: {row:?}");
    }
}

/// The forward's row pass against its definition on every family, in both elements: `P` is
/// `2^(s2 - m_new)` rounded (within an ulp of the input type: `exp2`'s last bits may tip a
/// rounding), 0 at hidden keys, the sum that of the `p`, and `m_new ≥ m_old`. Where the one pass
/// holds (AVX-512, a row's later steps) `m_new` may be the running max below the step's own with
/// the sum at most `ONE_PASS_SUM_MAX`; a score far above it must make it the true max instead,
/// and a first step is always against the true max. Visible ranges aligned, unaligned, within
/// one vector; a negative scale.
#[test]
fn lowp_forward_row_is_its_definition() {
    use super::rows::{fwd_row16, ONE_PASS_SUM_MAX};
    let mut rng = Rng(41);
    let n = 256;
    let spike = |at: usize, by: f32| move |j: usize, x: f32| if j == at { x + by } else { x };
    // (a, b, m_old, raw-score tweak, qscale, whether the result must be the true max)
    type Tweak = Box<dyn Fn(usize, f32) -> f32>;
    let cases: Vec<(usize, usize, f32, Tweak, f32, bool)> = vec![
        (0, n, f32::NEG_INFINITY, Box::new(|_, x| x), 0.3, false),
        (0, n, f32::NEG_INFINITY, Box::new(spike(200, 90.0)), 0.3, true),
        (0, n, 4.0, Box::new(|_, x| x), 0.3, false),
        (0, n, 0.5, Box::new(spike(37, 90.0)), 0.3, true),
        (5, 77, f32::NEG_INFINITY, Box::new(|_, x| x), 0.3, false),
        (5, 77, 1.0, Box::new(spike(70, 90.0)), 0.3, true),
        (16, 64, f32::NEG_INFINITY, Box::new(|_, x| x), 0.3, false),
        (3, 9, f32::NEG_INFINITY, Box::new(|_, x| x), 0.3, false),
        (0, n, f32::NEG_INFINITY, Box::new(|_, x| x), -0.3, true),
    ];
    for which in available() {
        for elem in [Half16::Bf16, Half16::F16] {
            for (a, b, m_old, tweak, qscale, true_max) in &cases {
                let raw: Vec<f32> = (0..n).map(|j| tweak(j, rng.uniform(8.0))).collect();
                let mut s = raw.clone();
                let mut out = vec![0xDEADu16; n];
                // SAFETY: s and out hold n (a multiple of 64) elements, a < b ≤ n; `which` runs here.
                let (m_new, sum) = with_isa!(which, K => unsafe { fwd_row16::<K>(elem, s.as_mut_ptr(), n, *a, *b, *qscale, 0.0, *m_old, out.as_mut_ptr()) });
                let tag = format!("{which:?} {elem:?} [{a}, {b}) m_old {m_old} qscale {qscale}");
                // qscale is the scale times log2(e) already (the caller's).
                let s2 = |j: usize| raw[j] as f64 * *qscale as f64;
                let max = (*a..*b).map(s2).fold(*m_old as f64, f64::max);
                assert!(m_new as f64 >= *m_old as f64 && m_new as f64 <= max + 1e-5 * max.abs().max(1.0), "{tag}: m_new {m_new}, true max {max}");
                // A row's first step (m_old = -inf) is always against its own max: a reference
                // below it left the largest p inexact (module docs of `rows`).
                if *true_max || *m_old == f32::NEG_INFINITY {
                    assert!((m_new as f64 - max).abs() <= 1e-5 * max.abs().max(1.0), "{tag}: m_new {m_new}, must be the true max {max}");
                }
                let mut want_sum = 0f64;
                for (j, &bits) in out.iter().enumerate() {
                    let got = pack::value(elem, bits) as f64;
                    if j < *a || j >= *b {
                        assert_eq!(bits, 0, "{tag}: hidden key {j} has P bits {bits:#x}");
                        continue;
                    }
                    let p = (s2(j) - m_new as f64).exp2();
                    want_sum += p;
                    // An ulp relative, and f16's subnormal spacing (2^-24) below its normals.
                    let (ulp, floor) = match elem {
                        Half16::Bf16 => (2f64.powi(-7), 1e-37),
                        Half16::F16 => (2f64.powi(-10), 2f64.powi(-24)),
                    };
                    assert!((got - p).abs() <= ulp * p + floor, "{tag}: key {j}: P {got:e}, 2^(s2 - m) = {p:e}");
                }
                // bf16's one pass takes `exp2_floor`, good to EXP2_FLOOR_REL (its `p` are rounded
                // to 2^-9 next); the other rows' `exp2` is f32-accurate.
                let sum_tol = match elem {
                    Half16::Bf16 => super::super::simd::EXP2_FLOOR_REL,
                    Half16::F16 => 1e-5,
                };
                assert!(((sum as f64 - want_sum) / want_sum).abs() < sum_tol, "{tag}: sum {sum}, want {want_sum}");
                assert!(*true_max || sum <= ONE_PASS_SUM_MAX, "{tag}: sum {sum}");
            }
        }
    }
}

/// The backward leaves calls with a non-finite operand to the f32 path.
#[test]
fn lowp_backward_takes_only_finite_operands() {
    let ok = [bf16::ONE; 4];
    let bad = [bf16::ONE, bf16::NAN, bf16::ONE, bf16::ONE];
    let lse = [0f32; 4];
    let take = |q: &[bf16], k: &[bf16], d_o: &[bf16]| super::backward_takes(&BwdInputs { q, k, v: &ok, kv_len: &[4], q_start: &[0], o: &ok, lse: &lse, d_o });
    assert!(take(&ok, &ok, &ok));
    assert!(!take(&bad, &ok, &ok));
    assert!(!take(&ok, &bad, &ok));
    assert!(!take(&ok, &ok, &[bf16::ONE, bf16::INFINITY, bf16::ONE, bf16::ONE]));
}

/// Random tiles with some specials: denormals, tiny and huge values (DAZ/FTZ paths).
fn random_tile_operands(rng: &mut Rng, elem: Half16, kblocks: usize) -> (Vec<u16>, Vec<u16>, Vec<f32>) {
    let mut gen = |n: usize| -> Vec<u16> {
        (0..n)
            .map(|i| {
                let x = rng.uniform(2.0);
                match i % 53 {
                    7 => 0x0003 | if x < 0.0 { 0x8000 } else { 0 },
                    19 => super::pack::bits(elem, x * 1e-30),
                    _ => super::pack::bits(elem, x),
                }
            })
            .collect()
    };
    let a = gen(TILE_M * kblocks * TILE_K);
    let b = gen(kblocks * TILE_M * TILE_K);
    let c = (0..TILE_M * TILE_N).map(|_| rng.uniform(4.0)).collect();
    (a, b, c)
}

/// Every model unit's tile block is the product its layout docs (`unit.rs`) describe: against
/// the exact (f64) `C + A·B` of the same operands, within the model's own rounding bound.
#[test]
fn lowp_model_units_compute_the_documented_product() {
    fn exact(elem: Half16, a: &[u16], b: &[u16], c0: &[f32], kblocks: usize) -> Vec<(f64, f64)> {
        let kk = kblocks * TILE_K;
        (0..TILE_M * TILE_N)
            .map(|i| {
                let (m, n) = (i / TILE_N, i % TILE_N);
                // B[p][n] sits at pair-row p / 2, column n, element p % 2 (VNNI).
                let terms: Vec<f64> = (0..kk).map(|p| model::elem_in(elem, a[m * kk + p]) as f64 * model::elem_in(elem, b[(p / 2) * TILE_K + 2 * n + p % 2]) as f64).collect();
                (c0[i] as f64 + terms.iter().sum::<f64>(), c0[i].abs() as f64 + terms.iter().map(|t| t.abs()).sum::<f64>())
            })
            .collect()
    }
    let mut rng = Rng(17);
    for kblocks in [1, 3] {
        for elem in [Half16::Bf16, Half16::F16] {
            let gen = |rng: &mut Rng, n: usize| (0..n).map(|_| super::pack::bits(elem, rng.uniform(2.0))).collect::<Vec<u16>>();
            let (a, b) = (gen(&mut rng, TILE_M * kblocks * TILE_K), gen(&mut rng, kblocks * TILE_M * TILE_K));
            let c0: Vec<f32> = (0..TILE_M * TILE_N).map(|_| rng.uniform(4.0)).collect();
            let want = exact(elem, &a, &b, &c0, kblocks);
            let mut got = vec![if elem == Half16::F16 { tile_product::<ModelAmx<true>>(&a, &b, &c0, kblocks) } else { tile_product::<ModelAmx<false>>(&a, &b, &c0, kblocks) }];
            if elem == Half16::Bf16 {
                got.push(tile_product::<ModelAvx512Bf16>(&a, &b, &c0, kblocks));
            }
            for g in &got {
                for (i, (x, (w, abs))) in g.iter().zip(&want).enumerate() {
                    // Each of the kk + kblocks roundings is ≤ 2^-24 of a partial sum ≤ abs.
                    let bound = (kblocks * (TILE_K + 1)) as f64 * (-24f64).exp2() * abs;
                    assert!((*x as f64 - w).abs() <= bound, "{elem:?} kblocks {kblocks} C[{i}]: {x:e} vs exact {w:e}");
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn lowp_real_avx512bf16_matches_model_bit_for_bit() {
    if !super::avx512bf16::detected() {
        eprintln!("SKIPPED lowp_real_avx512bf16_matches_model_bit_for_bit: this CPU has no AVX512-BF16");
        return;
    }
    let mut rng = Rng(11);
    for kblocks in [1, 2, 3] {
        let (a, b, c0) = random_tile_operands(&mut rng, Half16::Bf16, kblocks);
        let real = tile_product::<super::avx512bf16::Avx512Bf16>(&a, &b, &c0, kblocks);
        let model = tile_product::<ModelAvx512Bf16>(&a, &b, &c0, kblocks);
        for (i, (r, m)) in real.iter().zip(&model).enumerate() {
            assert!(r.to_bits() == m.to_bits() || (r.is_nan() && m.is_nan()), "C[{i}]: real {r:e} ({:#x}) model {m:e} ({:#x})", r.to_bits(), m.to_bits());
        }
    }
    // Two NaNs meeting in one product: which payload reaches C depends on the instruction's
    // operand order, which the model must share (avx512bf16.rs puts B's pair-row first).
    let (mut a, mut b, c0) = random_tile_operands(&mut rng, Half16::Bf16, 1);
    a[0] = 0x7FA1;
    b[0] = 0x7FB2;
    let real = tile_product::<super::avx512bf16::Avx512Bf16>(&a, &b, &c0, 1);
    let model = tile_product::<ModelAvx512Bf16>(&a, &b, &c0, 1);
    assert_eq!(real[0].to_bits(), model[0].to_bits(), "C[0] from two NaNs: real {:#x} model {:#x}", real[0].to_bits(), model[0].to_bits());
    for (n, c) in cases().iter().enumerate() {
        run_case::<bf16, super::avx512bf16::Avx512Bf16>(Which::Avx512, c, TOL_BF16, 7100 + n as u64);
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn lowp_real_amx_matches_model_within_bound() {
    let caps = super::amx::detected();
    for (f16_unit, have) in [(false, caps.bf16), (true, caps.fp16)] {
        let name = if f16_unit { "AMX-FP16" } else { "AMX-BF16" };
        if !have {
            eprintln!("SKIPPED lowp_real_amx_matches_model_within_bound for {name}: not on this CPU (or the OS did not grant the tile state)");
            continue;
        }
        let elem = if f16_unit { Half16::F16 } else { Half16::Bf16 };
        let mut rng = Rng(13);
        for kblocks in [1, 2, 3] {
            let (a, b, c0) = random_tile_operands(&mut rng, elem, kblocks);
            let (real, model) = if f16_unit {
                (tile_product::<super::amx::Amx<true>>(&a, &b, &c0, kblocks), tile_product::<ModelAmx<true>>(&a, &b, &c0, kblocks))
            } else {
                (tile_product::<super::amx::Amx<false>>(&a, &b, &c0, kblocks), tile_product::<ModelAmx<false>>(&a, &b, &c0, kblocks))
            };
            let bound = amx_bounds(elem, &a, &b, &c0, kblocks);
            let exact = real.iter().zip(&model).filter(|(r, m)| r.to_bits() == m.to_bits()).count();
            for (i, ((r, m), bd)) in real.iter().zip(&model).zip(&bound).enumerate() {
                assert!((*r as f64 - *m as f64).abs() <= *bd, "{name} C[{i}]: real {r:e} model {m:e} bound {bd:e}");
            }
            eprintln!("{name}, {kblocks} step(s): {exact}/256 entries bit-identical to the model, all within the bound");
        }
        for (n, c) in cases().iter().enumerate() {
            if f16_unit {
                run_case::<f16, super::amx::Amx<true>>(Which::Avx512, c, TOL_F16, 7200 + n as u64);
            } else {
                run_case::<bf16, super::amx::Amx<false>>(Which::Avx512, c, TOL_BF16, 7300 + n as u64);
            }
        }
    }
}

#[test]
fn lowp_choice_of_unit() {
    assert_eq!(Policy::parse(None, None), Policy::Real { amx: true, always: false });
    assert_eq!(Policy::parse(Some("AVX2"), None), Policy::Off);
    assert_eq!(Policy::parse(Some("avx512"), None), Policy::Off);
    assert_eq!(Policy::parse(Some("avx512bf16"), None), Policy::Real { amx: false, always: false });
    assert_eq!(Policy::parse(None, Some("off")), Policy::Off);
    assert_eq!(Policy::parse(Some("avx2"), Some("model-amx")), Policy::ModelAmx);
    assert_eq!(Policy::parse(None, Some("model-avx512bf16")), Policy::ModelAvx512Bf16);
    assert_eq!(Policy::parse(None, Some("always")), Policy::Real { amx: true, always: true });
    assert_eq!(Policy::parse(Some("avx512bf16"), Some("ALWAYS")), Policy::Real { amx: false, always: true });
    let none = Detected::default();
    let all = Detected { amx_bf16: true, amx_fp16: true, avx512bf16: true };
    let (bf, hf, f32t) = (ElementType::BF16, ElementType::F16, ElementType::F32);
    let w = dispatch();
    assert_eq!(pick(Policy::Real { amx: true, always: false }, w, bf, none), None);
    assert_eq!(pick(Policy::Off, w, bf, all), None);
    assert_eq!(pick(Policy::ModelAmx, w, bf, none), Some(Unit::ModelAmxBf16));
    assert_eq!(pick(Policy::ModelAmx, w, hf, none), Some(Unit::ModelAmxFp16));
    assert_eq!(pick(Policy::ModelAvx512Bf16, w, hf, none), None);
    assert_eq!(pick(Policy::ModelAmx, w, f32t, none), None);
    #[cfg(target_arch = "x86_64")]
    {
        let avx = Which::Avx512;
        assert_eq!(pick(Policy::Real { amx: true, always: false }, avx, bf, all), Some(Unit::AmxBf16));
        assert_eq!(pick(Policy::Real { amx: false, always: false }, avx, bf, all), Some(Unit::Avx512Bf16));
        assert_eq!(pick(Policy::Real { amx: true, always: false }, avx, hf, all), Some(Unit::AmxFp16));
        assert_eq!(pick(Policy::Real { amx: false, always: false }, avx, hf, all), None);
        assert_eq!(pick(Policy::Real { amx: true, always: false }, avx, hf, Detected { amx_fp16: false, ..all }), None);
        assert_eq!(pick(Policy::Real { amx: true, always: false }, avx, bf, Detected { amx_bf16: false, ..all }), Some(Unit::Avx512Bf16));
        assert_eq!(pick(Policy::Real { amx: true, always: false }, avx, f32t, all), None);
        // Another family asked for by name: its f32 path.
        assert_eq!(pick(Policy::Real { amx: true, always: false }, Which::Avx2, bf, all), None);
    }
}

/// A unit one ulp off its model in one C entry: the probe that gates the real units must refuse it.
struct OneUlpOff;

impl TileUnit for OneUlpOff {
    const ELEM: Half16 = Half16::Bf16;
    unsafe fn begin() {}
    unsafe fn end() {}
    unsafe fn gemm(g: &TileGemm) {
        ModelAvx512Bf16::gemm(g);
        let c = g.c.add(5 * g.ldc + 7);
        *c = f32::from_bits((*c).to_bits() + 1);
    }
}

#[test]
fn lowp_probe_refuses_a_unit_that_differs_from_its_model() {
    assert!(agrees::<ModelAvx512Bf16, ModelAvx512Bf16>(true));
    assert!(!agrees::<OneUlpOff, ModelAvx512Bf16>(true), "bit for bit: one ulp is a difference");
    // Within the AMX bound one ulp of a 2-step block passes; a unit that drops C's old value
    // does not.
    assert!(agrees::<OneUlpOff, ModelAvx512Bf16>(false));
    struct NoAccumulate;
    impl TileUnit for NoAccumulate {
        const ELEM: Half16 = Half16::Bf16;
        unsafe fn begin() {}
        unsafe fn end() {}
        unsafe fn gemm(g: &TileGemm) {
            ModelAmx::<false>::gemm(&TileGemm { accumulate: false, ..*g });
        }
    }
    assert!(!agrees::<NoAccumulate, ModelAmx<false>>(false));
    // On a CPU with the units, each passes its probe (or `offered` would silently drop it).
    #[cfg(target_arch = "x86_64")]
    {
        if super::avx512bf16::detected() {
            assert!(agrees::<super::avx512bf16::Avx512Bf16, ModelAvx512Bf16>(true));
        }
        let caps = super::amx::detected();
        if caps.bf16 {
            assert!(agrees::<super::amx::Amx<false>, ModelAmx<false>>(false));
        }
        if caps.fp16 {
            assert!(agrees::<super::amx::Amx<true>, ModelAmx<true>>(false));
        }
    }
}

/// The never-slower probe, on every machine: a model unit (hundreds of times slower than the f32
/// path) must lose its probe, forward and backward, and a decision must follow the timings.
#[test]
fn lowp_probe_keeps_a_slower_unit_off() {
    use super::choice::{probe, ProbeShape, Timing};
    use crate::Pass;
    let small = ProbeShape { seq: 64, heads: 1 };
    for pass in [Pass::Forward, Pass::Backward] {
        let t = probe::<bf16>(Unit::ModelAmxBf16, dispatch(), pass, 64, small);
        assert!(t.unit.is_finite() && t.f32_path.is_finite() && t.f32_path > 0.0, "{pass:?}: {t:?}");
        assert!(!t.unit_wins(), "{pass:?}: the model unit won its probe: {t:?}");
    }
    assert!(Timing { unit: 1.0, f32_path: 2.0 }.unit_wins());
    assert!(!Timing { unit: 2.0, f32_path: 1.0 }.unit_wins());
    // A tie keeps the f32 path.
    assert!(!Timing { unit: 1.0, f32_path: 1.0 }.unit_wins());
}

/// How much slower than the faster path the choice may time and still count as equal: CI's cores
/// are shared and other tests run beside this one.
const NOISE: f64 = 1.25;

/// The faster of the f32 path (`t[1]`) and the unit (`t[2]`, when there is one).
fn fastest(has_unit: bool, t: &[f64]) -> f64 {
    if has_unit { t[1].min(t[2]) } else { t[1] }
}

/// `choice::best_alternating` over (choice, f32 path, unit), measured again (up to four times) while
/// the choice looks slower than [`NOISE`] allows: a burst of other tests on the cores must not
/// fail the test, a choice that is really slower fails every attempt.
fn slowdown_of_choice(has_unit: bool, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    use super::choice::best_alternating;
    let mut t = best_alternating(7, fs);
    for _ in 0..3 {
        if t[0] <= NOISE * fastest(has_unit, &t) {
            break;
        }
        t = best_alternating(7, fs);
    }
    t
}

/// Issue 35 part 1, on every machine: a bf16 call as the handlers run it (whatever unit the
/// choice takes here, or none) is never slower than the f32 path, nor than the unit this CPU
/// offers, by more than noise (25%: CI's cores are shared), forward and backward, D = 64 and 128.
#[test]
fn lowp_bf16_choice_is_never_the_slower() {
    use super::choice::{f32_backward, f32_forward};
    use crate::host::{backward_on, forward_on};
    use crate::{AttnOptions, AttnShape, Extras};
    if matches!(Policy::from_env(), Policy::ModelAmx | Policy::ModelAvx512Bf16 | Policy::Real { always: true, .. }) {
        eprintln!("lowp_bf16_choice_is_never_the_slower: skipped, EXLA_RS_HOST_BF16 forces a unit");
        return;
    }
    let which = dispatch();
    let hw = Detected::get();
    let unit = pick(Policy::Real { amx: true, always: true }, which, ElementType::BF16, hw);
    eprintln!("lowp_bf16_choice_is_never_the_slower: family {which:?}, unit offered by the hardware: {unit:?}");
    for d in [64usize, 128] {
        let shape = AttnShape { batch: 1, seq_q: 384, seq_k: 384, heads: 2, kv_heads: 2, head_dim: d };
        let opts = AttnOptions { scale: (d as f32).powf(-0.5), softcap: 0.0, window_left: -1, window_right: -1 };
        let mut rng = Rng(0x35 + d as u64);
        let mut draw = |n: usize| (0..n).map(|_| bf16::from_f32(rng.uniform(1.0))).collect::<Vec<_>>();
        let (q, k, v, d_o) = (draw(shape.q_len()), draw(shape.kv_len()), draw(shape.kv_len()), draw(shape.q_len()));
        let (kv_len, q_start) = (vec![384], vec![0]);
        let fin = || FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start };
        let z = || vec![bf16::ZERO; shape.q_len()];
        let (mut o, mut lse) = (z(), vec![0f32; shape.lse_len()]);
        f32_forward(which, &shape, &opts, fin(), FwdOutputs { o: &mut o, lse: &mut lse });
        let (mut o1, mut l1) = (z(), vec![0f32; shape.lse_len()]);
        let (mut o2, mut l2) = (z(), vec![0f32; shape.lse_len()]);
        let (mut o3, mut l3) = (z(), vec![0f32; shape.lse_len()]);
        let mut chosen = || forward_on(which, &shape, &opts, fin(), &Extras::default(), FwdOutputs { o: &mut o1, lse: &mut l1 }, &mut []).unwrap();
        let mut f32p = || f32_forward(which, &shape, &opts, fin(), FwdOutputs { o: &mut o2, lse: &mut l2 });
        let mut on_unit = || {
            if let Some(u) = unit {
                super::forward(u, which, &shape, &opts, fin(), FwdOutputs { o: &mut o3, lse: &mut l3 })
            }
        };
        let t = slowdown_of_choice(unit.is_some(), &mut [&mut chosen, &mut f32p, &mut on_unit]);
        eprintln!("  D={d} fwd: chosen {:.2} ms ({:?}), f32 path {:.2} ms, unit {:.2} ms", t[0] * 1e3, super::offered::<bf16>(which, crate::Pass::Forward, d), t[1] * 1e3, t[2] * 1e3);
        assert!(t[0] <= NOISE * fastest(unit.is_some(), &t), "D={d} forward: the choice took {:.2} ms, the faster path {:.2} ms", t[0] * 1e3, fastest(unit.is_some(), &t) * 1e3);

        let bin = || BwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start, o: &o, lse: &lse, d_o: &d_o };
        let g = || (z(), z(), z());
        let ((mut a1, mut b1, mut c1), (mut a2, mut b2, mut c2), (mut a3, mut b3, mut c3)) = (g(), g(), g());
        let mut chosen = || backward_on(which, &shape, &opts, bin(), &Extras::default(), BwdOutputs { dq: &mut a1, dk: &mut b1, dv: &mut c1 }, None, &mut []).unwrap();
        let mut f32p = || f32_backward(which, &shape, &opts, bin(), BwdOutputs { dq: &mut a2, dk: &mut b2, dv: &mut c2 });
        let mut on_unit = || {
            if let Some(u) = unit {
                super::backward(u, which, &shape, &opts, bin(), BwdOutputs { dq: &mut a3, dk: &mut b3, dv: &mut c3 })
            }
        };
        let t = slowdown_of_choice(unit.is_some(), &mut [&mut chosen, &mut f32p, &mut on_unit]);
        eprintln!("  D={d} bwd: chosen {:.2} ms ({:?}), f32 path {:.2} ms, unit {:.2} ms", t[0] * 1e3, super::offered::<bf16>(which, crate::Pass::Backward, d), t[1] * 1e3, t[2] * 1e3);
        assert!(t[0] <= NOISE * fastest(unit.is_some(), &t), "D={d} backward: the choice took {:.2} ms, the faster path {:.2} ms", t[0] * 1e3, fastest(unit.is_some(), &t) * 1e3);
    }
}

/// A unit's 2 × 2 product is its four one-block products bit for bit (same products, same order
/// per C block), for both accumulate modes and with a prefetch pointer given: the real AMX unit
/// (four resident accumulators) where this CPU has it, and every model unit (the trait's
/// default, which the tiling of every other test relies on).
#[test]
fn lowp_2x2_product_is_four_one_block_products() {
    fn check_unit<U: TileUnit>(name: &str, rng: &mut Rng) {
        for (kblocks, stream_b) in [(1, false), (3, false), (3, true)] {
            for accumulate in [false, true] {
                // Two row groups of A (lda padded), two B panels `panel` apart, C 32 × (32 + pad).
                let (lda, ldc, panel) = (kblocks * TILE_K + 16, 2 * TILE_N + 8, kblocks * TILE_M * TILE_K + 64);
                let a: Vec<u16> = (0..2 * TILE_M * lda).map(|_| super::pack::bits(U::ELEM, rng.uniform(2.0))).collect();
                let b: Vec<u16> = (0..2 * panel).map(|_| super::pack::bits(U::ELEM, rng.uniform(2.0))).collect();
                let c0: Vec<f32> = (0..2 * TILE_M * ldc).map(|_| rng.uniform(1.0)).collect();
                let (mut c4, mut c1) = (c0.clone(), c0.clone());
                // SAFETY: every extent lies in a, b and the C buffers; `U` runs here (the caller's word).
                unsafe {
                    let _scope = UnitScope::<U>::enter();
                    let g = TileGemm { a: a.as_ptr(), lda, b: b.as_ptr(), c: c4.as_mut_ptr(), ldc, kblocks, accumulate, prefetch: b.as_ptr(), stream_b };
                    U::gemm2x2(&g, panel);
                    for (grp, p) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                        U::gemm(&TileGemm { a: a.as_ptr().add(grp * TILE_M * lda), b: b.as_ptr().add(p * panel), c: c1.as_mut_ptr().add(grp * TILE_M * ldc + p * TILE_N), prefetch: core::ptr::null(), ..g });
                    }
                }
                for (i, (x, y)) in c4.iter().zip(&c1).enumerate() {
                    assert_eq!(x.to_bits(), y.to_bits(), "{name}, {kblocks} step(s), accumulate {accumulate}, stream_b {stream_b}: C[{i}] {x:e} vs {y:e}");
                }
            }
        }
    }
    let mut rng = Rng(29);
    check_unit::<ModelAmx<false>>("model AMX-BF16", &mut rng);
    check_unit::<ModelAmx<true>>("model AMX-FP16", &mut rng);
    check_unit::<ModelAvx512Bf16>("model AVX512-BF16", &mut rng);
    #[cfg(target_arch = "x86_64")]
    {
        let caps = super::amx::detected();
        if caps.bf16 {
            check_unit::<super::amx::Amx<false>>("AMX-BF16", &mut rng);
        } else {
            eprintln!("SKIPPED the real AMX-BF16 part of lowp_2x2_product_is_four_one_block_products: not on this CPU");
        }
        if caps.fp16 {
            check_unit::<super::amx::Amx<true>>("AMX-FP16", &mut rng);
        }
    }
}

/// `blocks` in either walk (and each `Walk::Panels` with and without asking ahead) gives every C
/// block the one-block product, bit for bit: 2 × 2 blocks and the odd edges (one, two and three
/// row groups and panels), set and accumulated.
#[test]
fn lowp_blocks_walks_are_one_block_products() {
    fn check_unit<U: TileUnit>(name: &str, rng: &mut Rng) {
        let kblocks = 2;
        for (mg, np) in [(1, 1), (2, 2), (3, 2), (2, 3), (3, 3), (4, 4)] {
            let (lda, ldc, panel) = (kblocks * TILE_K + 16, np * TILE_N + 8, kblocks * TILE_M * TILE_K + 64);
            let a: Vec<u16> = (0..mg * TILE_M * lda).map(|_| super::pack::bits(U::ELEM, rng.uniform(2.0))).collect();
            let b: Vec<u16> = (0..np * panel).map(|_| super::pack::bits(U::ELEM, rng.uniform(2.0))).collect();
            let c0: Vec<f32> = (0..mg * TILE_M * ldc).map(|_| rng.uniform(1.0)).collect();
            for accumulate in [false, true] {
                let mut want = c0.clone();
                // SAFETY (both blocks): every extent lies in a, b and the C buffers; `U` runs here
                // (the caller's word).
                unsafe {
                    let _scope = UnitScope::<U>::enter();
                    for grp in 0..mg {
                        for p in 0..np {
                            let c = want.as_mut_ptr().add(grp * TILE_M * ldc + p * TILE_N);
                            U::gemm(&TileGemm { a: a.as_ptr().add(grp * TILE_M * lda), lda, b: b.as_ptr().add(p * panel), c, ldc, kblocks, accumulate, prefetch: core::ptr::null(), stream_b: false });
                        }
                    }
                }
                for walk in [Walk::Panels { ask_ahead: false }, Walk::Panels { ask_ahead: true }, Walk::Rows] {
                    let mut got = c0.clone();
                    unsafe {
                        let _scope = UnitScope::<U>::enter();
                        blocks::<U>(a.as_ptr(), lda, b.as_ptr(), panel, got.as_mut_ptr(), ldc, mg, np, kblocks, accumulate, walk);
                    }
                    for (i, (x, y)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(x.to_bits(), y.to_bits(), "{name}, {mg} x {np} blocks, {walk:?}, accumulate {accumulate}: C[{i}] {x:e} vs {y:e}");
                    }
                }
            }
        }
    }
    let mut rng = Rng(37);
    check_unit::<ModelAmx<false>>("model AMX-BF16", &mut rng);
    check_unit::<ModelAvx512Bf16>("model AVX512-BF16", &mut rng);
    #[cfg(target_arch = "x86_64")]
    {
        if super::amx::detected().bf16 {
            check_unit::<super::amx::Amx<false>>("AMX-BF16", &mut rng);
        } else {
            eprintln!("SKIPPED the real AMX-BF16 part of lowp_blocks_walks_are_one_block_products: not on this CPU");
        }
        if super::avx512bf16::detected() {
            check_unit::<super::avx512bf16::Avx512Bf16>("AVX512-BF16", &mut rng);
        }
    }
}

/// The packers against the layouts their docs define, entry by entry (padding included): odd key
/// counts, a head dim short of its padding, rows strided through a larger operand, and buffers
/// that start full of garbage (the forward's come from the pool). On an AVX-512 machine this
/// checks the fast packers, elsewhere the scalar ones.
#[test]
fn lowp_packers_write_the_documented_layouts() {
    use super::pack::{pack_kt, pack_vt, Rows};
    let mut rng = Rng(31);
    for (sk, skp, d, dp, stride) in [(37, 64, 46, 64, 3 * 46 + 2), (64, 64, 128, 128, 128), (1, 16, 2, 32, 4), (16, 32, 64, 64, 64 * 5)] {
        let src: Vec<bf16> = (0..(sk - 1) * stride + d).map(|_| bf16::from_f32(rng.uniform(2.0))).collect();
        let at = |j: usize, dd: usize| if j < sk && dd < d { src[j * stride + dd].to_bits() } else { 0 };
        let rows = Rows { base: &src[..], stride };
        let mut kt = vec![0xDEADu16; skp * dp + 7];
        pack_kt(Half16::Bf16, &mut kt, sk, skp, d, dp, rows);
        let mut vt = vec![0xBEEFu16; skp * dp + 7];
        pack_vt(Half16::Bf16, &mut vt, sk, skp, d, dp, rows);
        for j in 0..skp {
            for dd in 0..dp {
                // kt: panel j/16, pair-row dd/2, key j%16, element dd%2.
                let k_at = ((j / TILE_N * dp / 2 + dd / 2) * TILE_N + j % TILE_N) * 2 + dd % 2;
                assert_eq!(kt[k_at], at(j, dd), "kt, key {j}, column {dd} (sk {sk}, d {d})");
                // vt: panel dd/16, pair-row j/2, column dd%16, element j%2.
                let v_at = ((dd / TILE_N * skp / 2 + j / 2) * TILE_N + dd % TILE_N) * 2 + j % 2;
                assert_eq!(vt[v_at], at(j, dd), "vt, key {j}, column {dd} (sk {sk}, d {d})");
            }
        }
        assert!(kt[skp * dp..].iter().all(|&x| x == 0xDEAD) && vt[skp * dp..].iter().all(|&x| x == 0xBEEF), "nothing written past the pack");
    }
}

/// The packing helpers the backward's prologue and epilogue use: a block transposed through
/// 16 × 16 tiles (ragged edges, strides past the block) lands every element where the element-wise
/// definition puts it and writes nothing else; the row dot product is the f64 one within f32 noise.
#[test]
fn lowp_transpose_and_row_dot() {
    for (rows, cols) in [(1, 1), (16, 16), (17, 33), (128, 80), (40, 128)] {
        let (ld_src, ld_dst) = (cols + 5, rows + 3);
        let src: Vec<u32> = (0..rows * ld_src).map(|i| i as u32).collect();
        let mut dst = vec![u32::MAX; cols * ld_dst];
        pack::transpose(&src, ld_src, rows, cols, &mut dst, ld_dst);
        for c in 0..cols {
            for r in 0..ld_dst {
                let want = if r < rows { src[r * ld_src + c] } else { u32::MAX };
                assert_eq!(dst[c * ld_dst + r], want, "{rows}x{cols}: ({c}, {r})");
            }
        }
    }
    let mut rng = Rng(0x44);
    for d in [1usize, 16, 31, 64, 80, 128, 256] {
        let a: Vec<bf16> = (0..d).map(|_| bf16::from_f32(rng.uniform(2.0))).collect();
        let b: Vec<bf16> = (0..d).map(|_| bf16::from_f32(rng.uniform(2.0))).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| x.to_f64() * y.to_f64()).sum();
        let abs: f64 = a.iter().zip(&b).map(|(x, y)| (x.to_f64() * y.to_f64()).abs()).sum();
        for which in available() {
            let got = with_isa!(which, K => super::backward::row_dot::<bf16, K>(Half16::Bf16, &a, &b));
            assert!((got as f64 - want).abs() <= 1e-6 * abs, "D={d} {which:?}: {got} vs {want}");
        }
    }
}
