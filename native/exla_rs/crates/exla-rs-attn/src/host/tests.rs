//! Host kernels against a naive float64 reference that evaluates the contract's visibility
//! predicate directly (not `KeyRange`), on every kernel family the CPU has, all three dtypes.

use super::*;
use half::{bf16, f16};

/// splitmix64: a tiny seeded PRNG, enough for test inputs.
struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-amp, amp).
    fn uniform(&mut self, amp: f32) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
    }
}

#[derive(Clone, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hkv: usize,
    d: usize,
    wl: i64,
    wr: i64,
    softcap: f32,
    kv_len: Vec<i32>,
    q_start: Vec<i32>,
}

impl Case {
    fn new(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> Self {
        Self { b, sq, sk, h, hkv, d, wl: -1, wr: -1, softcap: 0.0, kv_len: vec![sk as i32; b], q_start: vec![0; b] }
    }
    fn win(mut self, wl: i64, wr: i64) -> Self {
        (self.wl, self.wr) = (wl, wr);
        self
    }
    fn cap(mut self, c: f32) -> Self {
        self.softcap = c;
        self
    }
    fn kv(mut self, kv: &[i32]) -> Self {
        self.kv_len = kv.to_vec();
        self
    }
    fn qs(mut self, qs: &[i32]) -> Self {
        self.q_start = qs.to_vec();
        self
    }
    fn shape(&self) -> AttnShape {
        AttnShape { batch: self.b, seq_q: self.sq, seq_k: self.sk, heads: self.h, kv_heads: self.hkv, head_dim: self.d }
    }
    fn opts(&self) -> AttnOptions {
        AttnOptions { scale: 1.0 / (self.d as f32).sqrt(), softcap: self.softcap, window_left: self.wl, window_right: self.wr }
    }
    fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        let (j, p) = (j as i64, self.q_start[b] as i64 + i as i64);
        j < self.kv_len[b] as i64 && (self.wl < 0 || j >= p - self.wl) && (self.wr < 0 || j <= p + self.wr)
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
    ]
}

struct Inputs {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    d_o: Vec<f64>,
}

/// Random inputs, already rounded to `T` so the reference sees exactly what the kernel sees.
fn inputs<T: HostElement>(c: &Case, seed: u64) -> Inputs {
    let mut rng = Rng(seed);
    let s = c.shape();
    let mut gen = |n: usize, amp: f32| -> Vec<f64> { (0..n).map(|_| T::from_f32(rng.uniform(amp)).to_f32() as f64).collect() };
    Inputs { q: gen(s.q_len(), 2.0), k: gen(s.kv_len(), 2.0), v: gen(s.kv_len(), 1.0), d_o: gen(s.q_len(), 1.0) }
}

fn cast<T: HostElement>(x: &[f64]) -> Vec<T> {
    x.iter().map(|&v| T::from_f32(v as f32)).collect()
}

/// Naive float64 forward and analytic backward of the contract.
struct Reference {
    o: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference(c: &Case, x: &Inputs) -> Reference {
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
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = m + s.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
                r.lse[(b * h + hh) * sq + i] = lse;
                let p: Vec<f64> = s.iter().map(|v| (v - lse).exp()).collect();
                let dov = &x.d_o[qi(b, i, hh)..qi(b, i, hh) + d];
                let mut o = vec![0.0; d];
                let mut dpv = vec![0.0; js.len()];
                for (n, &j) in js.iter().enumerate() {
                    let vv = &x.v[ki(b, j, kh)..ki(b, j, kh) + d];
                    for t in 0..d {
                        o[t] += p[n] * vv[t];
                        dpv[n] += dov[t] * vv[t];
                    }
                }
                let delta: f64 = (0..d).map(|t| o[t] * dov[t]).sum();
                r.o[qi(b, i, hh)..qi(b, i, hh) + d].copy_from_slice(&o);
                for (n, &j) in js.iter().enumerate() {
                    let ds = p[n] * (dpv[n] - delta);
                    let dx = if cap > 0.0 { ds * (1.0 - (s[n] / cap).powi(2)) } else { ds };
                    for t in 0..d {
                        r.dq[qi(b, i, hh) + t] += scale * dx * x.k[ki(b, j, kh) + t];
                        r.dk[ki(b, j, kh) + t] += scale * dx * q[t];
                        r.dv[ki(b, j, kh) + t] += p[n] * dov[t];
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
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |a, &w| a.max(w.abs())).max(1e-2);
    got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs()).fold(0.0, f64::max) / scale
}

fn check(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert!(got.iter().all(|v| !v.is_nan()), "{what}: NaN in output");
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
}

fn check_lse(what: &str, got: &[f32], want: &[f64], tol: f64) {
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

fn run_case<T: HostElement>(which: Which, c: &Case, tol: f64, seed: u64) {
    let x = inputs::<T>(c, seed);
    let want = reference(c, &x);
    let (shape, opts) = (c.shape(), c.opts());
    let (q, k, v, d_o) = (cast::<T>(&x.q), cast::<T>(&x.k), cast::<T>(&x.v), cast::<T>(&x.d_o));
    // Outputs start as garbage so a missed write shows.
    let mut o = vec![T::from_f32(7.0); q.len()];
    let mut lse = vec![7.0f32; shape.lse_len()];
    forward_on(
        which,
        &shape,
        &opts,
        FwdInputs { q: &q, k: &k, v: &v, kv_len: &c.kv_len, q_start: &c.q_start },
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
        BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
        &mut [],
    )
    .unwrap();
    let f = |x: &[T]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    // Gradients go through one more rounding (o is T) and a longer chain: allow 2x.
    check(&format!("dq {tag}"), &f(&dq), &want.dq, 2.0 * tol);
    check(&format!("dk {tag}"), &f(&dk), &want.dk, 2.0 * tol);
    check(&format!("dv {tag}"), &f(&dv), &want.dv, 2.0 * tol);
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
            let mut xp = Inputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), d_o: x.d_o.clone() };
            let mut xm = Inputs { q: x.q.clone(), k: x.k.clone(), v: x.v.clone(), d_o: x.d_o.clone() };
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
    use super::kernels::{Gemm, Isa};
    let (m, n, k) = (64, 64, 64);
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut c = vec![0f32; m * n];
    let reps = 20000;
    let g = Gemm { m, n, k, a: a.as_ptr(), a_rs: k, a_cs: 1, b: b.as_ptr(), ldb: n, c: c.as_mut_ptr(), ldc: n, accumulate: true };
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
        let ulps = match which {
            #[cfg(target_arch = "x86_64")]
            Which::Avx512 => exp2_ulps::<super::kernels::avx512::Kernels>(),
            #[cfg(target_arch = "x86_64")]
            Which::Avx2 => exp2_ulps::<super::kernels::avx2::Kernels>(),
            Which::Scalar => exp2_ulps::<super::kernels::scalar::Kernels>(),
        };
        println!("{which:?}: exp2 max error {ulps:.2} ulp");
        assert!(ulps < 3.0, "{which:?}: exp2 error {ulps} ulp");
    }
}
