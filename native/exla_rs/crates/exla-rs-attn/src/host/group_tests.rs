//! The bias panels' run lengths and the backward's key groups change only the order of work,
//! never a result: a forward copying its bias 1, 2 or 3 tiles at a time agrees bit for bit with
//! one copying 16, and a backward whose tasks own 2, 3 or 16 key blocks agrees with one-block
//! tasks (bit for bit on dK, dV and an owned `dbias`; to rounding where sums change order: dQ and
//! a broadcast `dbias`). One-block tasks are what `tests.rs` checks against the float64
//! reference at its small sizes; the shapes here have several key blocks and query blocks, with
//! masks, causality and windows that leave whole tiles and query blocks out of a group.

use super::backward::run_grouped;
use super::forward::run_panels;
use super::kernels::{self, Isa};
use super::{BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement};
use crate::philox::Dropout;
use crate::random::uniform_pm1 as rand;
use crate::{AttnOptions, AttnShape, Bias, BiasData, BiasGrad, Extras};
use half::{bf16, f16};

struct Case {
    shape: AttnShape,
    opts: AttnOptions,
    kv_len: Vec<i32>,
    q_start: Vec<i32>,
    /// `[0; 4]`: no bias.
    bias_dims: [usize; 4],
    mask: Option<Vec<u8>>,
    /// Every 7th bias entry is -inf.
    neg_inf: bool,
    dropout: Option<Dropout>,
}

fn case(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize, bias_dims: [usize; 4]) -> Case {
    Case {
        shape: AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d },
        opts: AttnOptions { scale: 1.0 / (d as f32).sqrt(), softcap: 0.0, window_left: -1, window_right: -1 },
        kv_len: vec![sk as i32; b],
        q_start: vec![(sk - sq) as i32; b],
        bias_dims,
        mask: None,
        neg_inf: false,
        dropout: None,
    }
}

fn cases() -> Vec<Case> {
    let (b, sq, sk, h, hkv, d) = (2, 130, 300, 4, 2, 16);
    // Batch 0 hides keys 64..200 (tiles 1 and 2 entirely), batch 1 shows every third key.
    let mask: Vec<u8> = (0..b * sk).map(|n| u8::from(if n < sk { !(64..200).contains(&n) } else { n % 3 == 0 })).collect();
    let mut v = vec![
        // Owned: causal with q_start, a key mask hiding whole tiles, softcap, kv_len < Sk.
        Case { mask: Some(mask.clone()), opts: AttnOptions { softcap: 4.0, window_right: 0, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, kv_len: vec![280, 300], ..case(b, sq, sk, h, hkv, d, [b, h, sq, sk]) },
        // Owned, -inf entries and a window that leaves query blocks out of whole groups.
        Case { neg_inf: true, opts: AttnOptions { window_left: 40, window_right: 10, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, ..case(b, sq, sk, h, hkv, d, [b, h, sq, sk]) },
        // Broadcast over the batch (summed), causal.
        Case { opts: AttnOptions { window_right: 0, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, ..case(b, sq, sk, h, hkv, d, [1, h, sq, sk]) },
        // Over the heads, with the key mask.
        Case { mask: Some(mask.clone()), ..case(b, sq, sk, h, hkv, d, [b, 1, sq, sk]) },
        // Over the queries (one bias row), and over the keys (one value per row).
        case(b, sq, sk, h, hkv, d, [1, 1, 1, sk]),
        Case { opts: AttnOptions { softcap: 2.0, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, ..case(b, sq, sk, h, hkv, d, [b, h, sq, 1]) },
        // Batch 1, one kv head: the owned mode with B = Bb = 1.
        case(1, 70, 1000, 2, 1, 8, [1, 2, 70, 1000]),
        // Whole key tiles, no key mask: an f32 bias is read in place (owned, and summed).
        case(2, 130, 320, 2, 2, 8, [2, 2, 130, 320]),
        Case { opts: AttnOptions { window_right: 0, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, ..case(2, 130, 256, 4, 2, 8, [1, 4, 130, 256]) },
    ];
    // Dropout with an owned bias and the key mask.
    let key = [0x1234_5678, 42];
    v.push(Case { dropout: Dropout::from_attributes(0.3, Some(key)).unwrap(), mask: Some(mask), ..case(b, sq, sk, h, hkv, d, [b, h, sq, sk]) });
    // No extras (the groups every plain backward runs with, `key_group`): causal with q_start, a
    // window with kv_len < Sk, and dropout alone.
    v.push(Case { opts: AttnOptions { window_right: 0, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, ..case(b, sq, sk, h, hkv, d, [0; 4]) });
    v.push(Case { opts: AttnOptions { window_left: 40, window_right: 10, ..case(b, sq, sk, h, hkv, d, [0; 4]).opts }, kv_len: vec![280, 300], ..case(b, sq, sk, h, hkv, d, [0; 4]) });
    v.push(Case { dropout: Dropout::from_attributes(0.3, Some(key)).unwrap(), ..case(b, sq, sk, h, hkv, d, [0; 4]) });
    v
}

/// o, lse, dq, dk, dv, dbias (as f32) of one case, bias copied `panel` tiles at a time in the
/// forward and key groups of `group` blocks in the backward.
struct Out {
    o: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    dbias: Vec<f32>,
}

trait Elem: HostElement {
    fn data(x: &[Self]) -> BiasData<'_>;
    fn grad(x: &mut [Self]) -> BiasGrad<'_>;
}
impl Elem for f32 {
    fn data(x: &[Self]) -> BiasData<'_> {
        BiasData::F32(x)
    }
    fn grad(x: &mut [Self]) -> BiasGrad<'_> {
        BiasGrad::F32(x)
    }
}
impl Elem for f16 {
    fn data(x: &[Self]) -> BiasData<'_> {
        BiasData::F16(x)
    }
    fn grad(x: &mut [Self]) -> BiasGrad<'_> {
        BiasGrad::F16(x)
    }
}
impl Elem for bf16 {
    fn data(x: &[Self]) -> BiasData<'_> {
        BiasData::BF16(x)
    }
    fn grad(x: &mut [Self]) -> BiasGrad<'_> {
        BiasGrad::BF16(x)
    }
}

fn run<T: Elem, K: Isa>(c: &Case, panel: usize, group: usize) -> Out {
    let s = c.shape;
    let (nq, nk) = (s.batch * s.seq_q * s.heads * s.head_dim, s.batch * s.seq_k * s.kv_heads * s.head_dim);
    let cast = |x: Vec<f32>| x.into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (q, k, v, d_o) = (cast(rand(nq, 1)), cast(rand(nk, 2)), cast(rand(nk, 3)), cast(rand(nq, 4)));
    let mut bias = rand(c.bias_dims.iter().product(), 5);
    if c.neg_inf {
        bias.iter_mut().step_by(7).for_each(|x| *x = f32::NEG_INFINITY);
    }
    let bias = cast(bias.into_iter().map(|x| 3.0 * x).collect());
    let has_bias = c.bias_dims != [0; 4];
    let ex = Extras { key_mask: c.mask.as_deref(), bias: has_bias.then(|| Bias { data: T::data(&bias), dims: c.bias_dims }), alibi_slopes: None, dropout: c.dropout };
    // Outputs start as garbage so a missed write shows.
    let (mut o, mut lse) = (vec![T::from_f32(7.0); nq], vec![7.0f32; s.lse_len()]);
    run_panels::<T, K>(&s, &c.opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start }, FwdOutputs { o: &mut o, lse: &mut lse }, &ex, panel);
    let (mut dq, mut dk, mut dv) = (vec![T::from_f32(7.0); nq], vec![T::from_f32(7.0); nk], vec![T::from_f32(7.0); nk]);
    let mut dbias = vec![T::from_f32(7.0); bias.len()];
    run_grouped::<T, K>(
        &s,
        &c.opts,
        BwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start, o: &o, lse: &lse, d_o: &d_o },
        BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
        &ex,
        has_bias.then(|| T::grad(&mut dbias)),
        group,
    );
    let f = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    Out { o: f(&o), lse, dq: f(&dq), dk: f(&dk), dv: f(&dv), dbias: f(&dbias) }
}

/// `got` equals `want` bit for bit (`tol` = 0), or within `tol` of the largest magnitude (at
/// least `floor`).
fn same(what: &str, got: &[f32], want: &[f32], tol: f32, floor: f32) {
    let scale = want.iter().filter(|x| x.is_finite()).fold(floor, |m, x| m.max(x.abs())).max(1e-30);
    for (n, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if tol == 0.0 { g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()) } else { (g - w).abs() <= tol * scale || g == w };
        assert!(ok, "{what}[{n}]: {g} vs {w}");
    }
}

fn check<T: Elem, K: Isa>(tol: f32) {
    for (n, c) in cases().iter().enumerate() {
        let want = run::<T, K>(c, 16, 1);
        assert!(want.dbias.iter().all(|x| x.is_finite()), "case {n}: dbias must be finite");
        let owned = c.bias_dims == [c.shape.batch, c.shape.heads, c.shape.seq_q, c.shape.seq_k];
        for (panel, group) in [(1, 2), (2, 3), (3, 16), (16, 16)] {
            let got = run::<T, K>(c, panel, group);
            let tag = format!("{} case {n} panel {panel} group {group}", T::TYPE);
            same(&format!("o {tag}"), &got.o, &want.o, 0.0, 0.0);
            same(&format!("lse {tag}"), &got.lse, &want.lse, 0.0, 0.0);
            same(&format!("dk {tag}"), &got.dk, &want.dk, 0.0, 0.0);
            same(&format!("dv {tag}"), &got.dv, &want.dv, 0.0, 0.0);
            same(&format!("dq {tag}"), &got.dq, &want.dq, tol, 0.0);
            // A bias shared by all keys has dbias = Σ_j dZ = 0 analytically: judge the rounding
            // of that cancellation against the scale of the terms (dZ ~ 1 here), not the results.
            let floor = if c.bias_dims[3] == 1 { 1.0 } else { 0.0 };
            same(&format!("dbias {tag}"), &got.dbias, &want.dbias, if owned { 0.0 } else { tol }, floor);
        }
    }
}

#[test]
fn panels_and_key_groups_do_not_change_results() {
    check::<f32, kernels::scalar::Kernels>(1e-5);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        check::<f32, kernels::avx2::Kernels>(1e-5);
        check::<f16, kernels::avx2::Kernels>(2e-3);
        check::<bf16, kernels::avx2::Kernels>(1e-2);
    }
}
