//! Host kernels against a naive float64 reference that evaluates the contract's visibility
//! predicate directly (not `KeyRange`), on every kernel family the CPU has, all three dtypes.
//! The case builder, inputs, reference and checks are `pub(super)`: `lowp/tests.rs` uses them.

use super::*;
use crate::philox::{dropout_keep, Dropout};
use crate::{Bias, BiasData};
use half::{bf16, f16};

/// splitmix64: a tiny seeded PRNG, enough for test inputs.
pub(super) struct Rng(pub(super) u64);
impl Rng {
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-amp, amp).
    pub(super) fn uniform(&mut self, amp: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
    }
}

#[derive(Clone, Debug)]
pub(super) struct Case {
    pub(super) b: usize,
    pub(super) sq: usize,
    pub(super) sk: usize,
    pub(super) h: usize,
    pub(super) hkv: usize,
    pub(super) d: usize,
    pub(super) wl: i64,
    pub(super) wr: i64,
    pub(super) softcap: f32,
    pub(super) kv_len: Vec<i32>,
    pub(super) q_start: Vec<i32>,
    /// `[B, Sk]`, nonzero = visible.
    pub(super) key_mask: Option<Vec<u8>>,
    /// The bias's dims (each 1 or full); values come from the inputs' seed.
    pub(super) bias: Option<[usize; 4]>,
    /// Put `-inf` into the bias: a whole query row of batch 0 / head 0 (fully masked by the bias)
    /// and a scatter of single entries.
    pub(super) bias_neg_inf: bool,
    pub(super) alibi: bool,
    pub(super) dropout: Option<Dropout>,
}

impl Case {
    pub(super) fn new(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> Self {
        Self {
            b,
            sq,
            sk,
            h,
            hkv,
            d,
            wl: -1,
            wr: -1,
            softcap: 0.0,
            kv_len: vec![sk as i32; b],
            q_start: vec![0; b],
            key_mask: None,
            bias: None,
            bias_neg_inf: false,
            alibi: false,
            dropout: None,
        }
    }
    /// Dropout at `rate` with key `key`.
    fn drop(mut self, rate: f32, key: [u32; 2]) -> Self {
        self.dropout = Dropout::from_attributes(rate, Some(key)).unwrap();
        self
    }
    /// `M·s` of entry (b, h, i, j), from the scalar definition (`crate::philox`); 1 without dropout.
    fn keep_scale(&self, b: usize, h: usize, i: usize, j: usize) -> f64 {
        self.dropout.map_or(1.0, |d| if dropout_keep(d.key, d.threshold, b as u32, h as u32, i as u32, j as u64) { d.scale as f64 } else { 0.0 })
    }
    fn mask(mut self, m: Vec<u8>) -> Self {
        assert_eq!(m.len(), self.b * self.sk);
        self.key_mask = Some(m);
        self
    }
    /// Left padding: batch row `b` hides its first `pad[b]` keys.
    fn left_pad(self, pad: &[usize]) -> Self {
        let sk = self.sk;
        let m = pad.iter().flat_map(|&p| (0..sk).map(move |j| u8::from(j >= p))).collect();
        self.mask(m)
    }
    fn bias(mut self, dims: [usize; 4]) -> Self {
        self.bias = Some(dims);
        self
    }
    fn neg_inf(mut self) -> Self {
        self.bias_neg_inf = true;
        self
    }
    fn alibi(mut self) -> Self {
        self.alibi = true;
        self
    }

    pub(super) fn win(mut self, wl: i64, wr: i64) -> Self {
        (self.wl, self.wr) = (wl, wr);
        self
    }
    pub(super) fn cap(mut self, c: f32) -> Self {
        self.softcap = c;
        self
    }
    pub(super) fn kv(mut self, kv: &[i32]) -> Self {
        self.kv_len = kv.to_vec();
        self
    }
    pub(super) fn qs(mut self, qs: &[i32]) -> Self {
        self.q_start = qs.to_vec();
        self
    }
    pub(super) fn shape(&self) -> AttnShape {
        AttnShape { batch: self.b, seq_q: self.sq, seq_k: self.sk, heads: self.h, kv_heads: self.hkv, head_dim: self.d }
    }
    pub(super) fn opts(&self) -> AttnOptions {
        AttnOptions { scale: 1.0 / (self.d as f32).sqrt(), softcap: self.softcap, window_left: self.wl, window_right: self.wr }
    }
    fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        let (j, p) = (j as i64, self.q_start[b] as i64 + i as i64);
        j < self.kv_len[b] as i64
            && (self.wl < 0 || j >= p - self.wl)
            && (self.wr < 0 || j <= p + self.wr)
            && self.key_mask.as_ref().is_none_or(|m| m[b * self.sk + j as usize] != 0)
    }
    /// Index into the bias (and dbias) of score (b, h, i, j).
    fn bias_index(&self, b: usize, h: usize, i: usize, j: usize) -> usize {
        let [bb, hb, sqb, skb] = self.bias.unwrap();
        let pick = |n: usize, x: usize| if n == 1 { 0 } else { x };
        ((pick(bb, b) * hb + pick(hb, h)) * sqb + pick(sqb, i)) * skb + pick(skb, j)
    }
}

fn cases() -> Vec<Case> {
    vec![
        Case::new(2, 37, 45, 4, 2, 8),
        Case::new(1, 70, 70, 2, 2, 64).win(-1, 0),
        Case::new(1, 33, 100, 2, 1, 64).win(-1, 0).qs(&[67]),
        Case::new(1, 90, 90, 2, 2, 80).win(10, 0),
        Case::new(1, 50, 77, 3, 3, 16).win(5, 7),
        Case::new(1, 66, 66, 2, 1, 64).win(-1, 0).cap(5.0),
        Case::new(1, 20, 30, 2, 2, 8).cap(0.5),
        Case::new(3, 21, 40, 2, 2, 8).kv(&[0, 17, 200]),
        Case::new(2, 40, 40, 2, 2, 8).win(-1, 0).qs(&[-10, 25]),
        Case::new(1, 30, 50, 6, 2, 8),
        Case::new(1, 30, 50, 4, 1, 8).win(3, 0),
        Case::new(1, 1, 1, 1, 1, 8),
        Case::new(1, 1, 130, 2, 2, 8),
        Case::new(1, 130, 1, 2, 2, 8),
        Case::new(1, 19, 23, 2, 1, 1),
        Case::new(1, 17, 70, 2, 2, 256).win(-1, 0).qs(&[50]).cap(20.0),
        // Windows that leave rows empty in the middle of the sequence / past kv_len.
        Case::new(1, 40, 40, 1, 1, 8).win(0, 0).kv(&[20]),
        Case::new(1, 200, 210, 2, 2, 8).win(-1, 0).qs(&[5]).kv(&[190]),
        // More keys than one step of the f32 forward's plain instance (4 tiles of 64): the
        // online rescale across steps, a causal edge and a window that starts mid-step.
        Case::new(1, 70, 530, 2, 1, 16).win(-1, 0).qs(&[460]),
        Case::new(1, 40, 400, 2, 2, 8).win(150, 30),
    ]
}

pub(super) struct Inputs {
    pub(super) q: Vec<f64>,
    pub(super) k: Vec<f64>,
    pub(super) v: Vec<f64>,
    pub(super) d_o: Vec<f64>,
    pub(super) bias: Vec<f64>,
    pub(super) slopes: Vec<f32>,
}

/// Random inputs, already rounded to `T` so the reference sees exactly what the kernel sees.
pub(super) fn inputs<T: HostElement>(c: &Case, seed: u64) -> Inputs {
    let mut rng = Rng(seed);
    let s = c.shape();
    let mut gen = |n: usize, amp: f32| -> Vec<f64> { (0..n).map(|_| T::from_f32(rng.uniform(amp)).to_f32() as f64).collect() };
    let (q, k, v, d_o) = (gen(s.q_len(), 2.0), gen(s.kv_len(), 2.0), gen(s.kv_len(), 1.0), gen(s.q_len(), 1.0));
    let mut bias = c.bias.map_or(Vec::new(), |dims| gen(dims.iter().product(), 2.0));
    if c.bias_neg_inf && !bias.is_empty() {
        // Row 0 of (batch 0, head 0) sees only -inf, plus every 7th entry.
        for j in 0..c.sk {
            let n = c.bias_index(0, 0, 0, j);
            bias[n] = f64::NEG_INFINITY;
        }
        for n in (3..bias.len()).step_by(7) {
            bias[n] = f64::NEG_INFINITY;
        }
    }
    // Slopes of both signs, and a zero one (head 2): the row kernels then add no ALiBi term there,
    // which is a separate instance of them when nothing else is added.
    let slopes = if c.alibi { (0..c.h).map(|h| 0.5f32.powi(h as i32 + 1) * match h { 1 => -1.0, 2 => 0.0, _ => 1.0 }).collect() } else { Vec::new() };
    Inputs { q, k, v, d_o, bias, slopes }
}

pub(super) fn cast<T: HostElement>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v as f32)).collect()
}

/// Naive float64 forward and analytic backward of the contract.
pub(super) struct Reference {
    pub(super) o: Vec<f64>,
    pub(super) lse: Vec<f64>,
    pub(super) dq: Vec<f64>,
    pub(super) dk: Vec<f64>,
    pub(super) dv: Vec<f64>,
    pub(super) dbias: Vec<f64>,
}

pub(super) fn reference(c: &Case, x: &Inputs) -> Reference {
    let (h, hkv, d, sq, sk) = (c.h, c.hkv, c.d, c.sq, c.sk);
    let g = h / hkv;
    let scale = c.opts().scale as f64;
    let cap = c.softcap as f64;
    let qi = |b: usize, i: usize, hh: usize| ((b * sq + i) * h + hh) * d;
    let ki = |b: usize, j: usize, hh: usize| ((b * sk + j) * hkv + hh) * d;
    let mut r = Reference {
        o: vec![0.0; x.q.len()],
        lse: vec![f64::NEG_INFINITY; c.b * h * sq],
        dq: vec![0.0; x.q.len()],
        dk: vec![0.0; x.k.len()],
        dv: vec![0.0; x.k.len()],
        dbias: vec![0.0; x.bias.len()],
    };
    for b in 0..c.b {
        for hh in 0..h {
            let kh = hh / g;
            for i in 0..sq {
                let js: Vec<usize> = (0..sk).filter(|&j| c.visible(b, i, j)).collect();
                if js.is_empty() {
                    continue;
                }
                let q = &x.q[qi(b, i, hh)..qi(b, i, hh) + d];
                let s: Vec<f64> = js
                    .iter()
                    .map(|&j| {
                        let xv = scale * (0..d).map(|t| q[t] * x.k[ki(b, j, kh) + t]).sum::<f64>();
                        if cap > 0.0 { cap * (xv / cap).tanh() } else { xv }
                    })
                    .collect();
                // z = s + bias + alibi (after the softcap).
                let z: Vec<f64> = js
                    .iter()
                    .zip(&s)
                    .map(|(&j, &sv)| {
                        let bias = if c.bias.is_some() { x.bias[c.bias_index(b, hh, i, j)] } else { 0.0 };
                        let pos = c.q_start[b] as f64 + i as f64;
                        let alibi = if c.alibi { -(x.slopes[hh] as f64) * (pos - j as f64).abs() } else { 0.0 };
                        sv + bias + alibi
                    })
                    .collect();
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue;
                }
                let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                r.lse[(b * h + hh) * sq + i] = lse;
                let p: Vec<f64> = z.iter().map(|v| (v - lse).exp()).collect();
                let dov = &x.d_o[qi(b, i, hh)..qi(b, i, hh) + d];
                let mut o = vec![0.0; d];
                let mut dpv = vec![0.0; js.len()];
                // Dropout: o and dv take P ∘ M·s; lse and the softmax's Jacobian do not.
                let ms: Vec<f64> = js.iter().map(|&j| c.keep_scale(b, hh, i, j)).collect();
                for (n, &j) in js.iter().enumerate() {
                    let vv = &x.v[ki(b, j, kh)..ki(b, j, kh) + d];
                    for t in 0..d {
                        o[t] += p[n] * ms[n] * vv[t];
                        dpv[n] += dov[t] * vv[t];
                    }
                }
                let delta: f64 = (0..d).map(|t| o[t] * dov[t]).sum();
                r.o[qi(b, i, hh)..qi(b, i, hh) + d].copy_from_slice(&o);
                for (n, &j) in js.iter().enumerate() {
                    let ds = p[n] * (ms[n] * dpv[n] - delta);
                    if c.bias.is_some() {
                        r.dbias[c.bias_index(b, hh, i, j)] += ds;
                    }
                    let dx = if cap > 0.0 { ds * (1.0 - (s[n] / cap).powi(2)) } else { ds };
                    for t in 0..d {
                        r.dq[qi(b, i, hh) + t] += scale * dx * x.k[ki(b, j, kh) + t];
                        r.dk[ki(b, j, kh) + t] += scale * dx * q[t];
                        r.dv[ki(b, j, kh) + t] += p[n] * ms[n] * dov[t];
                    }
                }
            }
        }
    }
    r
}

/// Max abs error relative to the reference's max abs value. The floor matters only for tensors
/// that are analytically 0 (dq, dk with a single key: `dP - Δ` cancels exactly): inputs are
/// O(1), so any f32 kernel leaves ~1e-7-per-term noise there, summed over up to 200 rows; 1e-2
/// keeps that from reading as "relative error 1" while normal gradients are O(0.1..1).
pub(super) fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |a, &w| a.max(w.abs())).max(1e-2);
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

pub(super) fn check(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert!(got.iter().all(|v| !v.is_nan()), "{what}: NaN in output");
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

pub(super) fn check_lse(what: &str, got: &[f32], want: &[f64], tol: f64) {
    for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w == f64::NEG_INFINITY {
            assert_eq!(g, f32::NEG_INFINITY, "{what}: lse[{n}] should be -inf (fully masked row)");
        } else {
            assert!(g.is_finite(), "{what}: lse[{n}] = {g}, want {w}");
        }
    }
    let fin: (Vec<f32>, Vec<f64>) = got.iter().zip(want).filter(|(_, w)| w.is_finite()).map(|(g, w)| (*g, *w)).unzip();
    if !fin.1.is_empty() {
        check(what, &fin.0, &fin.1, tol);
    }
}

fn run_case<T: BiasOf>(which: Which, c: &Case, tol: f64, seed: u64) {
    let x = inputs::<T>(c, seed);
    let want = reference(c, &x);
    let (shape, opts) = (c.shape(), c.opts());
    let (q, k, v, d_o) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v), cast::<T>(&x.d_o));
    // The bias in the kernel's type (rounded like the inputs); dbias starts as garbage.
    let bias_t: Vec<T> = cast::<T>(&x.bias);
    let ex = Extras {
        key_mask: c.key_mask.as_deref(),
        bias: c.bias.map(|dims| Bias { data: T::bias_data(&bias_t), dims }),
        alibi_slopes: if c.alibi { Some(&x.slopes[..]) } else { None },
        dropout: c.dropout,
    };
    let mut dbias = vec![T::from_f32(7.0); bias_t.len()];
    // Outputs start as garbage so a missed write shows.
    let mut o = vec![T::from_f32(7.0); q.len()];
    let mut lse = vec![7.0f32; shape.lse_len()];
    forward_on(
        which,
        &shape,
        &opts,
        FwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start },
        &ex,
        FwdOutputs { o: &mut o, lse: &mut lse },
        &mut [],
    )
    .unwrap();
    let tag = format!("{which:?} {} {c:?}", T::TYPE);
    let of: Vec<f32> = o.iter().map(|v| v.to_f32()).collect();
    check(&format!("o {tag}"), &of, &want.o, tol);
    check_lse(&format!("lse {tag}"), &lse, &want.lse, tol);

    let mut dq = vec![T::from_f32(7.0); q.len()];
    let mut dk = vec![T::from_f32(7.0); k.len()];
    let mut dv = vec![T::from_f32(7.0); v.len()];
    backward_on(
        which,
        &shape,
        &opts,
        BwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start, o: &o, lse: &lse, d_o: &d_o },
        &ex,
        BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
        c.bias.map(|_| T::bias_grad(&mut dbias)),
        &mut [],
    )
    .unwrap();
    let f = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    // Gradients go through one more rounding (o is T) and a longer chain: allow 2x.
    check(&format!("dq {tag}"), &f(&dq), &want.dq, 2.0 * tol);
    check(&format!("dk {tag}"), &f(&dk), &want.dk, 2.0 * tol);
    check(&format!("dv {tag}"), &f(&dv), &want.dv, 2.0 * tol);
    if let Some([_, _, _, skb]) = c.bias {
        // Sums over broadcast dims add up more rounding: allow 4x. A bias shared by all keys
        // (Skb = 1) has dbias = Σ_j dZ = 0 analytically (softmax ignores a per-row shift), so
        // what the kernel returns there is the rounding of that many rows' cancellation: judge
        // it against a floor that grows with the rows summed into each entry.
        let got = f(&dbias);
        if skb == 1 {
            let rows = c.b * c.h * c.sq / (want.dbias.len() / c.bias.unwrap()[3]).max(1);
            let err = got.iter().zip(&want.dbias).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max);
            assert!(err <= 4.0 * tol * 1e-2 * rows as f64, "dbias {tag}: abs error {err:e} over {rows} rows");
        } else {
            check(&format!("dbias {tag}"), &got, &want.dbias, 4.0 * tol);
        }
    }
    check_fully_masked_rows(c, &want, &of, &f(&dq), &tag);
}

/// Fully masked rows (reference lse -inf): o and dq exactly 0.
pub(super) fn check_fully_masked_rows(c: &Case, want: &Reference, o: &[f32], dq: &[f32], tag: &str) {
    for b in 0..c.b {
        for hh in 0..c.h {
            for i in 0..c.sq {
                if want.lse[(b * c.h + hh) * c.sq + i] == f64::NEG_INFINITY {
                    let at = ((b * c.sq + i) * c.h + hh) * c.d;
                    assert!(o[at..at + c.d].iter().all(|&v| v == 0.0), "o of a fully masked row {tag}");
                    assert!(dq[at..at + c.d].iter().all(|&v| v == 0.0), "dq of a fully masked row {tag}");
                }
            }
        }
    }
}

/// Ties the test's element type to the bias views of the same type.
trait BiasOf: HostElement {
    fn bias_data(x: &[Self]) -> BiasData<'_>;
    fn bias_grad(x: &mut [Self]) -> BiasGrad<'_>;
}
impl BiasOf for f32 {
    fn bias_data(x: &[Self]) -> BiasData<'_> {
        BiasData::F32(x)
    }
    fn bias_grad(x: &mut [Self]) -> BiasGrad<'_> {
        BiasGrad::F32(x)
    }
}
impl BiasOf for f16 {
    fn bias_data(x: &[Self]) -> BiasData<'_> {
        BiasData::F16(x)
    }
    fn bias_grad(x: &mut [Self]) -> BiasGrad<'_> {
        BiasGrad::F16(x)
    }
}
impl BiasOf for bf16 {
    fn bias_data(x: &[Self]) -> BiasData<'_> {
        BiasData::BF16(x)
    }
    fn bias_grad(x: &mut [Self]) -> BiasGrad<'_> {
        BiasGrad::BF16(x)
    }
}

/// Cases with the optional operands, alone and with every older option.
fn ext_cases() -> Vec<Case> {
    let holes = |b: usize, sk: usize| (0..b * sk).map(|n| u8::from(n % 5 != 2 && n % 11 != 0)).collect::<Vec<u8>>();
    vec![
        // key_mask: left padding (batch 1 hides 70 of 100 keys: whole tiles skipped), holes, with causal / window / kv_len / GQA.
        Case::new(2, 37, 100, 4, 2, 8).left_pad(&[3, 70]),
        Case::new(2, 70, 70, 2, 2, 64).win(-1, 0).mask(holes(2, 70)),
        Case::new(3, 21, 140, 2, 2, 8).kv(&[0, 130, 140]).left_pad(&[0, 65, 139]).win(20, 3).qs(&[100, 110, 115]),
        // An all-zero mask row: batch 1 fully masked.
        Case::new(2, 9, 30, 2, 1, 16).mask((0..60).map(|n| u8::from(n < 30 && n % 2 == 0)).collect()),
        // bias: every broadcast pattern, Sq != Sk, GQA, softcap.
        Case::new(2, 33, 45, 4, 2, 8).bias([2, 4, 33, 45]),
        Case::new(2, 33, 70, 4, 2, 8).bias([1, 4, 33, 70]).cap(3.0),
        Case::new(2, 33, 70, 4, 1, 8).bias([2, 1, 33, 70]).win(-1, 0).qs(&[37, 37]),
        Case::new(2, 65, 66, 2, 2, 64).bias([1, 1, 65, 66]),
        Case::new(2, 20, 40, 2, 2, 8).bias([1, 2, 1, 40]),
        Case::new(2, 20, 40, 2, 2, 8).bias([2, 1, 20, 1]).cap(2.0),
        Case::new(1, 20, 40, 3, 3, 8).bias([1, 1, 1, 1]),
        // f32 biases read in place (whole key tiles, no key mask): every pattern the in-place
        // reads take, with causal / q_start, window, softcap, ALiBi, kv_len, -inf entries.
        Case::new(2, 70, 128, 4, 2, 16).bias([2, 4, 70, 128]).win(-1, 0).qs(&[58, 10]),
        Case::new(2, 65, 192, 2, 2, 8).bias([1, 2, 65, 192]).cap(3.0).kv(&[192, 150]),
        Case::new(2, 33, 128, 4, 1, 8).bias([2, 1, 33, 128]).win(30, 40).alibi(),
        Case::new(1, 20, 64, 2, 2, 8).bias([1, 1, 1, 64]),
        Case::new(1, 130, 256, 2, 1, 32).bias([1, 2, 130, 256]).neg_inf(),
        // -inf bias: a row fully masked by the bias, scattered -inf entries.
        Case::new(2, 30, 50, 2, 2, 8).bias([1, 2, 30, 50]).neg_inf(),
        Case::new(1, 30, 50, 2, 1, 8).bias([1, 1, 30, 50]).neg_inf().win(-1, 0).qs(&[20]).cap(4.0),
        // ALiBi (slopes of both signs and zero), with causal, q_start, window, softcap, GQA.
        Case::new(1, 40, 40, 4, 2, 8).alibi(),
        Case::new(2, 33, 100, 4, 1, 32).alibi().win(-1, 0).qs(&[67, -3]),
        Case::new(1, 66, 90, 2, 2, 64).alibi().win(10, 5).cap(5.0).kv(&[80]),
        // Everything at once.
        Case::new(3, 50, 131, 6, 2, 16).left_pad(&[0, 40, 130]).bias([1, 6, 50, 131]).alibi().win(64, 0).cap(10.0).kv(&[131, 120, 100]).qs(&[81, 70, 60]),
        Case::new(2, 17, 70, 4, 2, 256).mask(holes(2, 70)).bias([2, 1, 1, 70]).neg_inf().alibi().win(-1, 0).qs(&[53, 10]),
    ]
}

#[test]
fn extras_f32_every_isa() {
    for which in available() {
        for (n, c) in ext_cases().iter().enumerate() {
            run_case::<f32>(which, c, 1e-4, 5000 + n as u64);
        }
    }
}

/// A `dbias` of 8 MiB or more takes other paths: its pages are populated first (huge pages where
/// the kernel grants them), an owned one is written with streaming stores, a summed one zeroed
/// after populating. One owned and one summed case past that size, causal and kv_len leaving
/// zeros to stream.
#[test]
fn large_dbias() {
    let cases = [
        Case::new(1, 1040, 1088, 2, 1, 8).bias([1, 2, 1040, 1088]).win(-1, 0).qs(&[48]).kv(&[1000]),
        Case::new(2, 1040, 1088, 2, 2, 8).bias([2, 1, 1040, 1088]).neg_inf(),
    ];
    for (n, c) in cases.iter().enumerate() {
        let dims = c.bias.unwrap();
        assert!(dims.iter().product::<usize>() * 4 >= 8 << 20);
        run_case::<f32>(dispatch(), c, 1e-4, 9000 + n as u64);
    }
}

/// Few query rows against long caches (`decode.rs`): GQA/MHA, rows at different cache positions,
/// windows and softcap, kv_len (0 too), key masks (left padding, holes, a fully masked batch row,
/// a masked whole chunk), keys split over several chunks, D from 1 to 256 (48 and 80: an odd
/// number of AVX-512 vectors, which a bf16 cache read in place takes as pairs and one more).
fn decode_cases() -> Vec<Case> {
    let holes = |b: usize, sk: usize| (0..b * sk).map(|n| u8::from(n % 7 != 3 && n % 13 != 0)).collect::<Vec<u8>>();
    vec![
        Case::new(3, 1, 1000, 8, 2, 64).win(-1, 0).qs(&[999, 500, 10]).kv(&[1000, 600, 11]),
        Case::new(2, 4, 700, 4, 4, 128).win(-1, 0).qs(&[696, 300]),
        Case::new(1, 16, 300, 4, 1, 80).win(32, 0).qs(&[284]).cap(5.0),
        Case::new(2, 1, 2000, 2, 1, 256).kv(&[1500, 2000]),
        Case::new(1, 3, 5, 2, 2, 1),
        Case::new(2, 2, 100, 2, 2, 8).kv(&[0, 100]),
        Case::new(2, 1, 600, 4, 2, 64).left_pad(&[0, 300]).win(-1, 0).qs(&[599, 599]),
        Case::new(2, 2, 600, 4, 2, 32).mask(holes(2, 600)).win(-1, 0).qs(&[598, 400]),
        Case::new(2, 1, 600, 2, 1, 16).mask((0..1200).map(|n| u8::from(n < 600)).collect()),
        Case::new(1, 1, 1200, 2, 2, 16).left_pad(&[1100]),
        Case::new(2, 1, 900, 8, 2, 48).win(-1, 0).qs(&[899, 450]),
    ]
}

#[test]
fn decode_every_isa_and_dtype() {
    for (n, c) in decode_cases().iter().enumerate() {
        assert!(super::decode::takes(&c.shape(), &Extras { key_mask: c.key_mask.as_deref(), ..Extras::default() }), "{c:?} takes the decode path");
        for which in available() {
            run_case::<f32>(which, c, 1e-4, 8000 + n as u64);
            run_case::<f16>(which, c, 5e-3, 8100 + n as u64);
            run_case::<bf16>(which, c, 3e-2, 8200 + n as u64);
        }
    }
}

/// A bf16 cache read in place is widened two vectors at a time with their columns split even/odd,
/// and `o` is accumulated in that order until the merge puts it back (`kernels::bf16_slot`).
/// With every key's V the same row of distinct values, `o` is that row exactly whatever the
/// weights, so a column out of place shows as a wrong value, not as rounding. D = 8..256: whole
/// pairs, pairs and one more vector, one vector, and the widened copy, on every ISA.
#[test]
fn decode_bf16_columns_in_order() {
    for d in [8, 16, 48, 80, 128, 256] {
        let shape = AttnShape { batch: 2, seq_q: 1, seq_k: 700, heads: 8, kv_heads: 2, head_dim: d };
        let opts = AttnOptions { scale: 1.0 / (d as f32).sqrt(), softcap: 0.0, window_left: -1, window_right: -1 };
        let mut rng = Rng(d as u64);
        let mut rand = |n: usize| (0..n).map(|_| bf16::from_f32(rng.uniform(2.0))).collect::<Vec<_>>();
        let (q, k) = (rand(shape.q_len()), rand(shape.kv_len()));
        // Column t of kv head h: multiples of 1/64 in [-2, 2) (exact in bf16), distinct along the
        // row and between the heads.
        let value = |h: usize, t: usize| ((t + 37 * h) % 256) as f32 / 64.0 - 2.0;
        let v: Vec<bf16> = (0..shape.kv_len()).map(|x| bf16::from_f32(value(x / d % 2, x % d))).collect();
        let (kv_len, q_start) = (vec![700; 2], vec![0; 2]);
        assert!(super::decode::takes(&shape, &Extras::default()));
        for which in available() {
            let mut o = vec![bf16::from_f32(7.0); shape.q_len()];
            let mut lse = vec![0f32; shape.lse_len()];
            let inp = FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start };
            forward_on(which, &shape, &opts, inp, &Extras::default(), FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
            for (x, got) in o.iter().enumerate() {
                let (hq, t) = (x / d % 8, x % d);
                assert_eq!(got.to_f32(), value(hq / 4, t), "{which:?} D = {d}: o[{x}] (query head {hq}, column {t})");
            }
        }
    }
}

#[test]
fn extras_f16_bf16() {
    for (n, c) in ext_cases().iter().enumerate() {
        run_case::<f16>(dispatch(), c, 5e-3, 6000 + n as u64);
        run_case::<bf16>(dispatch(), c, 3e-2, 7000 + n as u64);
    }
}

/// The reference's dbias (and, with the extras on, dq/dk/dv) against finite differences.
#[test]
fn reference_bias_gradient_matches_finite_differences() {
    for c in [
        Case::new(1, 5, 7, 4, 2, 3).win(3, 1).cap(2.0).qs(&[1]).kv(&[6]).bias([1, 4, 5, 7]).alibi().mask(vec![1, 0, 1, 1, 1, 1, 1]),
        Case::new(2, 4, 6, 2, 1, 3).bias([2, 1, 1, 6]).cap(1.5),
        Case::new(2, 4, 6, 2, 2, 3).bias([1, 2, 4, 1]),
    ] {
        let x = inputs::<f32>(&c, 9);
        let r = reference(&c, &x);
        let loss = |bias: &[f64]| -> f64 {
            let y = Inputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), d_o: x.d_o.clone(), bias: bias.to_vec(), slopes: x.slopes.clone() };
            reference(&c, &y).o.iter().zip(&x.d_o).map(|(a, b)| a * b).sum()
        };
        let eps = 1e-6;
        for idx in 0..x.bias.len() {
            let (mut bp, mut bm) = (x.bias.clone(), x.bias.clone());
            bp[idx] += eps;
            bm[idx] -= eps;
            let fd = (loss(&bp) - loss(&bm)) / (2.0 * eps);
            assert!((fd - r.dbias[idx]).abs() < 1e-6 * (1.0 + fd.abs()), "{c:?} dbias[{idx}]: fd {fd} analytic {}", r.dbias[idx]);
        }
    }
}

#[test]
fn extras_are_validated() {
    let c = Case::new(2, 8, 9, 4, 2, 8);
    let (shape, opts) = (c.shape(), c.opts());
    let q = vec![0.5f32; shape.q_len()];
    let k = vec![0.5f32; shape.kv_len()];
    let mut o = vec![0f32; shape.q_len()];
    let mut lse = vec![0f32; shape.lse_len()];
    let bias = vec![0f32; 2 * 4 * 8 * 9];
    let mask = vec![1u8; 2 * 9];
    let slopes = vec![0.5f32; 4];
    let mut run = |ex: Extras<'_>| forward_ext(&shape, &opts, FwdInputs { q: &q, k: &k, v: &k, kv_len: &c.kv_len, q_start: &c.q_start }, &ex, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []);
    let expect = |r: Result<(), AttnError>, name: &str| match r {
        Err(AttnError::InvalidArgument(m)) => assert!(m.contains(name), "{m:?} should name {name}"),
        other => panic!("expected InvalidArgument naming {name}, got {other:?}"),
    };
    expect(run(Extras { key_mask: Some(&mask[1..]), ..Default::default() }), "key_mask");
    expect(run(Extras { alibi_slopes: Some(&slopes[1..]), ..Default::default() }), "alibi_slopes");
    expect(run(Extras { bias: Some(Bias { data: BiasData::F32(&bias), dims: [2, 4, 8, 3] }), ..Default::default() }), "bias");
    expect(run(Extras { bias: Some(Bias { data: BiasData::F32(&bias[1..]), dims: [2, 4, 8, 9] }), ..Default::default() }), "bias");
    run(Extras { key_mask: Some(&mask), bias: Some(Bias { data: BiasData::F32(&bias), dims: [2, 4, 8, 9] }), alibi_slopes: Some(&slopes), dropout: None }).unwrap();
}

#[test]
fn f32_every_case_every_isa() {
    for which in available() {
        for (n, c) in cases().iter().enumerate() {
            run_case::<f32>(which, c, 1e-4, 1000 + n as u64);
        }
    }
}

#[test]
fn f16_every_case() {
    for (n, c) in cases().iter().enumerate() {
        run_case::<f16>(dispatch(), c, 5e-3, 2000 + n as u64);
    }
}

#[test]
fn bf16_every_case() {
    for (n, c) in cases().iter().enumerate() {
        run_case::<bf16>(dispatch(), c, 3e-2, 3000 + n as u64);
    }
}

#[test]
fn public_entry_points_agree_with_the_reference() {
    let c = Case::new(1, 129, 129, 4, 2, 64).win(-1, 0);
    run_case::<f32>(dispatch(), &c, 1e-4, 42);
    assert_eq!(workspace_bytes(Pass::Forward, ElementType::F32, &c.shape()), 0);
}

/// The analytic f64 backward the kernels are checked against is itself checked against central
/// finite differences of the f64 forward, with softcap, a window, GQA and q_start all on.
#[test]
fn reference_backward_matches_finite_differences() {
    let c = Case::new(1, 5, 7, 4, 2, 3).win(3, 1).cap(2.0).qs(&[1]).kv(&[6]);
    let x = inputs::<f32>(&c, 7);
    let r = reference(&c, &x);
    let loss = |x: &Inputs| -> f64 { reference(&c, x).o.iter().zip(&x.d_o).map(|(a, b)| a * b).sum() };
    let eps = 1e-6;
    for which in 0..3 {
        let n = if which == 0 { x.q.len() } else { x.k.len() };
        for idx in 0..n {
            let mut xp = Inputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), d_o: x.d_o.clone(), bias: x.bias.clone(), slopes: x.slopes.clone() };
            let mut xm = Inputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), d_o: x.d_o.clone(), bias: x.bias.clone(), slopes: x.slopes.clone() };
            let (vp, vm, an) = match which {
                0 => (&mut xp.q, &mut xm.q, r.dq[idx]),
                1 => (&mut xp.k, &mut xm.k, r.dk[idx]),
                _ => (&mut xp.v, &mut xm.v, r.dv[idx]),
            };
            vp[idx] += eps;
            vm[idx] -= eps;
            let fd = (loss(&xp) - loss(&xm)) / (2.0 * eps);
            assert!((fd - an).abs() < 1e-6 * (1.0 + an.abs()), "operand {which} idx {idx}: fd {fd} analytic {an}");
        }
    }
}

#[test]
fn bad_lengths_are_invalid_arguments() {
    let c = Case::new(2, 8, 9, 4, 2, 8);
    let (shape, opts) = (c.shape(), c.opts());
    let q = vec![0.5f32; shape.q_len()];
    let k = vec![0.5f32; shape.kv_len()];
    let mut o = vec![0f32; shape.q_len()];
    let mut lse = vec![0f32; shape.lse_len()];
    let kv = [9, 9];
    let qs = [0, 0];
    let expect = |r: Result<(), AttnError>, name: &str| match r {
        Err(AttnError::InvalidArgument(m)) => assert!(m.contains(name), "{m:?} should name {name}"),
        other => panic!("expected InvalidArgument naming {name}, got {other:?}"),
    };
    expect(
        forward(&shape, &opts, FwdInputs { q: &q[1..], k: &k, v: &k, kv_len: &kv, q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []),
        "q",
    );
    expect(
        forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &k[1..], kv_len: &kv, q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []),
        "v",
    );
    expect(
        forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &k, kv_len: &kv[..1], q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []),
        "kv_len",
    );
    expect(
        forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &k, kv_len: &kv, q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse[1..] }, &mut []),
        "lse",
    );
    expect(
        forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &k, kv_len: &kv, q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut [0u8; 4]),
        "workspace",
    );
    let bad = AttnShape { kv_heads: 3, ..shape };
    assert!(matches!(
        forward(&bad, &opts, FwdInputs { q: &q, k: &k, v: &k, kv_len: &kv, q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []),
        Err(AttnError::InvalidArgument(_))
    ));
    let nan = AttnOptions { scale: f32::NAN, ..opts };
    assert!(matches!(
        forward(&shape, &nan, FwdInputs { q: &q, k: &k, v: &k, kv_len: &kv, q_start: &qs }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []),
        Err(AttnError::InvalidArgument(_))
    ));
    let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; k.len()]);
    let lse_in = vec![0f32; shape.lse_len()];
    expect(
        backward(
            &shape,
            &opts,
            BwdInputs { q: &q, k: &k, v: &k, kv_len: &kv, q_start: &qs, o: &q, lse: &lse_in, d_o: &q[2..] },
            BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
            &mut [],
        ),
        "do",
    );
    expect(
        backward(
            &shape,
            &opts,
            BwdInputs { q: &q, k: &k, v: &k, kv_len: &kv, q_start: &qs, o: &q, lse: &lse_in, d_o: &q },
            BwdOutputs { dq: &mut dq, dk: &mut dk[1..], dv: &mut dv },
            &mut [],
        ),
        "dk",
    );
}

/// Empty dimensions are valid calls: no panic, masked results.
#[test]
fn empty_sequences() {
    for (sq, sk) in [(0, 5), (5, 0), (0, 0)] {
        let c = Case::new(1, sq, sk, 2, 1, 4);
        let (shape, opts) = (c.shape(), c.opts());
        let q = vec![0.25f32; shape.q_len()];
        let k = vec![0.25f32; shape.kv_len()];
        let mut o = vec![7f32; shape.q_len()];
        let mut lse = vec![7f32; shape.lse_len()];
        forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &k, kv_len: &c.kv_len, q_start: &c.q_start }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
        assert!(o.iter().all(|&v| v == 0.0) && lse.iter().all(|&v| v == f32::NEG_INFINITY));
        let (mut dq, mut dk, mut dv) = (vec![7f32; q.len()], vec![7f32; k.len()], vec![7f32; k.len()]);
        backward(
            &shape,
            &opts,
            BwdInputs { q: &q, k: &k, v: &k, kv_len: &c.kv_len, q_start: &c.q_start, o: &o, lse: &lse, d_o: &q },
            BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
            &mut [],
        )
        .unwrap();
        assert!(dq.iter().chain(&dk).chain(&dv).all(|&v| v == 0.0));
    }
}

/// `cargo test --release -p exla-rs-attn -- --ignored gemm_peak --nocapture`: the GEMM kernel's
/// throughput on one forward-sized tile product, to compare against the whole kernel.
#[test]
#[ignore]
fn gemm_peak() {
    use super::kernels::{Gemm, Isa, Prefetch};
    let (m, n, k) = (64, 64, 64);
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut c = vec![0f32; m * n];
    let reps = 20000;
    let g = Gemm { m, n, k, a: a.as_ptr(), a_rs: k, a_cs: 1, b: b.as_ptr(), ldb: n, c: c.as_mut_ptr(), ldc: n, accumulate: true, pf: Prefetch::NONE };
    let t = std::time::Instant::now();
    for _ in 0..reps {
        unsafe { super::kernels::avx512::Kernels::gemm(g) };
    }
    let s = t.elapsed().as_secs_f64();
    println!("avx512 gemm {m}x{n}x{k}: {:.1} GFLOP/s", 2.0 * (m * n * k * reps) as f64 / s / 1e9);
    let src: Vec<f32> = (0..64 * 64).map(|i| (i % 17) as f32 * 0.1).collect();
    let mut tile = src.clone();
    let t = std::time::Instant::now();
    for _ in 0..reps {
        tile.copy_from_slice(&src);
        for r in 0..64 {
            unsafe { super::kernels::avx512::Kernels::fwd_row(tile[r * 64..].as_mut_ptr(), 64, 0, 64, 0.0, 0.0) };
        }
    }
    let s = t.elapsed().as_secs_f64();
    println!("avx512 fwd_row: {:.2} ns/element", s / (reps * 64 * 64) as f64 * 1e9);
}

/// Max relative error (in f32 ulps at 1.0, i.e. units of 2^-23) of the row kernel's `exp2` over
/// `[-125, 0]`, plus the masked case: a `-inf` score must give exactly 0.
fn exp2_ulps<K: super::kernels::Isa>() -> f64 {
    let mut worst = 0f64;
    for chunk in 0..200 {
        // s[0] = 0 is the row max, so p[j] = 2^s[j].
        let mut row: Vec<f32> = (0..64).map(|j| if j == 0 { 0.0 } else { -125.0 * ((chunk * 63 + j) as f32 / (200.0 * 63.0)) }).collect();
        let src = row.clone();
        let (m, _) = unsafe { K::fwd_row(row.as_mut_ptr(), 64, 0, 64, 0.0, f32::NEG_INFINITY) };
        assert_eq!(m, 0.0);
        for (p, x) in row.iter().zip(&src) {
            let want = (*x as f64).exp2();
            worst = worst.max(((*p as f64 - want) / want).abs() / f32::EPSILON as f64);
        }
    }
    let mut row = vec![1.0f32; 16];
    let (_, sum) = unsafe { K::fwd_row(row.as_mut_ptr(), 16, 0, 1, 0.0, f32::NEG_INFINITY) };
    assert_eq!(sum, 1.0, "masked columns must contribute exactly 0");
    assert!(row[1..].iter().all(|&p| p == 0.0));
    worst
}

#[test]
fn exp2_is_accurate_on_every_isa() {
    for which in available() {
        let ulps = with_isa!(which, K => exp2_ulps::<K>());
        println!("{which:?}: exp2 max error {ulps:.2} ulp");
        assert!(ulps < 3.0, "{which:?}: exp2 error {ulps} ulp");
    }
}

/// `exp2_dq` (range reduction by `VREDUCEPS`, the lowp rows beside AVX512-BF16) is `exp2` bit for
/// bit: over the whole range the kernels use, its edges, both infinities and NaN.
#[test]
fn exp2_dq_is_exp2_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
        use super::simd::avx512 as s;
        let edges = [f32::NEG_INFINITY, f32::INFINITY, f32::NAN, 0.0, -0.0, 0.5, -0.5, 1.5, -126.0, -125.5, -126.5, 127.0, 128.0, 200.0];
        let xs: Vec<f32> = (0..40_000).map(|i| -150.0 + i as f32 * 0.00731).chain(edges).collect();
        for chunk in xs.chunks(16) {
            let mut a = [0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let (mut want, mut got) = ([0f32; 16], [0f32; 16]);
            // SAFETY: AVX-512 F and DQ are present (checked); 16-lane arrays.
            unsafe {
                let v = s::load(a.as_ptr());
                s::store(want.as_mut_ptr(), s::exp2(v));
                s::store(got.as_mut_ptr(), s::exp2_dq(v));
            }
            for ((x, w), g) in a.iter().zip(want).zip(got) {
                assert_eq!(w.to_bits(), g.to_bits(), "exp2({x}): {w} vs {g}");
            }
        }
    }
}

/// `exp2_floor` (the lowp forward's bf16 rows): within `EXP2_FLOOR_REL` of `2^x` over every `x` a row
/// can give it (its reference max may lie below a score: `x` up to 12), 0 below -126 and for
/// `-inf`, every nonzero result normal, inf for inf, NaN for NaN.
#[test]
fn exp2_floor_is_accurate() {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
        use super::simd::avx512 as s;
        let edges = [f32::NEG_INFINITY, f32::INFINITY, f32::NAN, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, -126.0, -125.999, -126.001, -127.0, -200.0, 12.0, 11.999];
        let xs: Vec<f32> = (0..40_000).map(|i| -130.0 + i as f32 * 0.003_57).chain(edges).collect();
        let mut worst = 0f64;
        for chunk in xs.chunks(16) {
            let mut a = [0f32; 16];
            a[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0f32; 16];
            // SAFETY: AVX-512 F and DQ are present (checked); 16-lane arrays.
            unsafe { s::store(got.as_mut_ptr(), s::exp2_floor(s::load(a.as_ptr()))) };
            for (&x, g) in a.iter().zip(got) {
                if x.is_nan() {
                    assert!(g.is_nan(), "exp2_floor(NaN) = {g}");
                } else if x == f32::INFINITY {
                    assert_eq!(g, f32::INFINITY, "exp2_floor(inf)");
                } else if x < -126.0 {
                    assert_eq!(g.to_bits(), 0, "exp2_floor({x}) = {g}, not +0");
                } else {
                    let want = (x as f64).exp2();
                    assert!(g.is_normal(), "exp2_floor({x}) = {g}");
                    worst = worst.max(((g as f64 - want) / want).abs());
                }
            }
        }
        println!("exp2_floor max relative error {worst:.3e}");
        assert!(worst <= super::simd::EXP2_FLOOR_REL, "exp2_floor relative error {worst:e}");
    }
}

/// The softcap's tanh at scores far past the cap: exactly ±cap on every ISA (its `exp2` overflowing
/// to inf would make inf/inf = NaN, as AVX-512's exact-range `exp2` did before the clamp).
#[test]
fn softcap_tails_are_exact_on_every_isa() {
    use super::kernels::{Isa, LOG2_E};
    let cap = 2.0f32;
    for which in available() {
        // log2(e)·x for x = ±1e4, ±500, ±60 and 0: tanh(x / cap) is ±1 to f32 but for 0.
        let xs = [1e4f32, -1e4, 500.0, -500.0, 60.0, -60.0, 0.0, 0.0];
        let mut row: Vec<f32> = (0..16).map(|j| xs[j % 8] * LOG2_E).collect();
        let (m, sum) = with_isa!(which, K => unsafe { K::fwd_row(row.as_mut_ptr(), 16, 0, 16, cap, f32::NEG_INFINITY) });
        // The capped scores are cap·log2(e)·{1, -1, 1, -1, 1, -1, 0, 0}: max cap·log2(e).
        assert!((m - cap * LOG2_E).abs() <= 1e-6 * m.abs(), "{which:?}: max {m}");
        let low = (-2.0 * cap * LOG2_E).exp2();
        let mid = (-cap * LOG2_E).exp2();
        let want = 2.0 * (3.0 + 3.0 * low + 2.0 * mid);
        assert!(sum.is_finite() && (sum - want).abs() <= 1e-5 * want, "{which:?}: sum {sum}, want {want}");
    }
}

/// Dropout alone and with every other option; rates low and high, keys at the u32 limits.
fn dropout_cases() -> Vec<Case> {
    let holes = |b: usize, sk: usize| (0..b * sk).map(|n| u8::from(n % 5 != 2 && n % 11 != 0)).collect::<Vec<u8>>();
    vec![
        Case::new(2, 37, 45, 4, 2, 8).drop(0.5, [1, 2]),
        Case::new(1, 70, 130, 2, 2, 64).drop(0.1, [0xdead_beef, 7]),
        Case::new(1, 70, 70, 2, 2, 64).win(-1, 0).drop(0.9, [u32::MAX, u32::MAX]),
        Case::new(1, 90, 90, 2, 1, 32).win(10, 3).qs(&[4]).cap(5.0).drop(0.25, [3, 0]),
        Case::new(3, 21, 140, 4, 2, 8).kv(&[0, 130, 140]).left_pad(&[0, 65, 139]).win(20, 3).qs(&[100, 110, 115]).drop(0.3, [5, 6]),
        Case::new(2, 33, 70, 4, 2, 8).bias([1, 4, 33, 70]).cap(3.0).drop(0.2, [9, 9]),
        Case::new(2, 30, 50, 2, 2, 8).bias([1, 2, 30, 50]).neg_inf().drop(0.6, [11, 12]),
        Case::new(2, 33, 100, 4, 1, 32).alibi().win(-1, 0).qs(&[67, -3]).drop(0.4, [13, 14]),
        Case::new(3, 50, 131, 6, 2, 16).left_pad(&[0, 40, 130]).bias([1, 6, 50, 131]).alibi().win(64, 0).cap(10.0).kv(&[131, 120, 100]).qs(&[81, 70, 60]).drop(0.15, [15, 16]),
        Case::new(2, 17, 70, 4, 2, 256).mask(holes(2, 70)).bias([2, 1, 1, 70]).neg_inf().alibi().win(-1, 0).qs(&[53, 10]).drop(0.5, [17, 18]),
        // Steps of several key tiles (the plain instance's), whole and cut by the causal edge.
        Case::new(1, 40, 600, 2, 2, 16).drop(0.2, [21, 22]),
        Case::new(1, 300, 300, 2, 1, 16).win(-1, 0).drop(0.3, [23, 24]),
        // A fully masked batch row (all-zero key mask): lse -inf, o = 0 under dropout too.
        Case::new(2, 9, 30, 2, 1, 16).mask((0..60).map(|n| u8::from(n < 30 && n % 2 == 0)).collect()).drop(0.5, [19, 20]),
    ]
}

#[test]
fn dropout_f32_every_isa() {
    for which in available() {
        for (n, c) in dropout_cases().iter().enumerate() {
            run_case::<f32>(which, c, 1e-4, 8000 + n as u64);
        }
    }
}

#[test]
fn dropout_f16_bf16() {
    for (n, c) in dropout_cases().iter().enumerate() {
        run_case::<f16>(dispatch(), c, 5e-3, 9000 + n as u64);
        run_case::<bf16>(dispatch(), c, 3e-2, 9500 + n as u64);
    }
}

/// The mask the kernels apply, observed directly: with q = 0 every visible key has P = 1/Sk,
/// and with V the identity over keys (D = Sk) o[i, h, j] = M·s / Sk exactly.
#[test]
fn dropout_mask_is_the_definition() {
    let c = Case::new(2, 70, 72, 3, 3, 72).drop(0.3, [0x243f_6a88, 0x85a3_08d3]);
    let s = c.shape();
    let q = vec![0f32; s.q_len()];
    let k: Vec<f32> = { let mut r = Rng(5); (0..s.kv_len()).map(|_| r.uniform(1.0)).collect() };
    let mut v = vec![0f32; s.kv_len()];
    for b in 0..c.b {
        for j in 0..c.sk {
            for hh in 0..c.hkv {
                v[((b * c.sk + j) * c.hkv + hh) * c.d + j] = 1.0;
            }
        }
    }
    for which in available() {
        let mut o = vec![7f32; s.q_len()];
        let mut lse = vec![7f32; s.lse_len()];
        let ex = Extras { dropout: c.dropout, ..Default::default() };
        forward_on(which, &s, &c.opts(), FwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start }, &ex, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
        let mut kept = 0usize;
        for b in 0..c.b {
            for i in 0..c.sq {
                for hh in 0..c.h {
                    for j in 0..c.sk {
                        let want = c.keep_scale(b, hh, i, j) / c.sk as f64;
                        let got = o[((b * c.sq + i) * c.h + hh) * c.d + j] as f64;
                        assert!((got - want).abs() <= 1e-6 * want.max(1e-3), "{which:?} o[{b},{i},{hh},{j}] = {got}, want {want}");
                        kept += usize::from(want > 0.0);
                    }
                    // lse is the undropped one: log(Sk).
                    let l = lse[(b * c.h + hh) * c.sq + i] as f64;
                    assert!((l - (c.sk as f64).ln()).abs() < 1e-5, "{which:?} lse {l}");
                }
            }
        }
        let n = c.b * c.sq * c.h * c.sk;
        assert!(kept > 0 && kept < n, "{which:?}: kept {kept} of {n}");
    }
}

/// The packed operands come from a pool that keeps what earlier calls wrote (pool.rs): with every
/// buffer taken full of NaN, the results must be those of fresh zeroed memory (padding columns,
/// keys past Sk, rows that see nothing beside rows that do: each is written before it is read).
#[test]
fn pooled_scratch_keeps_nothing_of_the_call_before() {
    let cases = [
        Case::new(2, 37, 45, 4, 2, 8),
        Case::new(1, 90, 90, 2, 2, 80).win(10, 0),
        Case::new(3, 21, 40, 2, 2, 8).kv(&[0, 17, 200]),
        Case::new(1, 17, 70, 2, 2, 40).win(-1, 0).qs(&[50]),
        Case::new(1, 40, 40, 1, 1, 8).win(0, 0).kv(&[20]),
        Case::new(2, 40, 40, 2, 2, 8).win(-1, 0).qs(&[-10, 25]),
    ];
    super::pool::POISON.with(|p| p.set(true));
    for (n, c) in cases.iter().enumerate() {
        run_case::<f32>(dispatch(), c, 1e-4, 5000 + n as u64);
        run_case::<bf16>(dispatch(), c, 3e-2, 5100 + n as u64);
    }
    super::pool::POISON.with(|p| p.set(false));
}
