//! The optional operands (key_mask, bias + dbias, alibi_slopes) through the exported handlers on
//! hand-built frames: the operand layout the presence attributes announce, the semantics against
//! a direct float64 evaluation, every validation error naming its operand, and CUDA answering
//! UNIMPLEMENTED for what its kernels lack.

use exla_rs_xla::*;
use xla_ffi::sys;
use xla_ffi::testing::*;
use xla_ffi::ApiVersion;

fn api() -> &'static sys::XLA_FFI_Api {
    fake_api(ApiVersion::new(0, 2))
}

const B: usize = 2;
const SQ: usize = 5;
const SK: usize = 9;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 3;
const SCALE: f32 = 0.7;

struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    kv_len: [i32; B],
    q_start: [i32; B],
    /// Left padding on batch 1, a hole on batch 0.
    mask: Vec<i64>,
    bias_dims: [usize; 4],
    bias: Vec<f32>,
    slopes: Vec<f32>,
    d_o: Vec<f32>,
}

fn data() -> Data {
    let bias_dims = [1, H, SQ, SK];
    let mut mask = vec![1i64; B * SK];
    mask[4] = 0;
    for j in 0..3 {
        mask[SK + j] = 0;
    }
    Data {
        q: randn(B * SQ * H * D, 1),
        k: randn(B * SK * HKV * D, 2),
        v: randn(B * SK * HKV * D, 3),
        kv_len: [9, 8],
        q_start: [4, 4],
        mask,
        bias_dims,
        bias: randn(bias_dims.iter().product(), 4),
        slopes: vec![0.5, -0.25, 0.125, 1.0],
        d_o: randn(B * SQ * H * D, 5),
    }
}

/// float64 o and lse of the contract with the extras on (causal).
fn reference(x: &Data) -> (Vec<f64>, Vec<f64>) {
    let mut o = vec![0.0; B * SQ * H * D];
    let mut lse = vec![f64::NEG_INFINITY; B * H * SQ];
    for b in 0..B {
        for h in 0..H {
            let kh = h / (H / HKV);
            for i in 0..SQ {
                let pos = x.q_start[b] as i64 + i as i64;
                let vis: Vec<usize> = (0..SK).filter(|&j| (j as i32) < x.kv_len[b] && j as i64 <= pos && x.mask[b * SK + j] != 0).collect();
                let z: Vec<f64> = vis
                    .iter()
                    .map(|&j| {
                        let dot: f64 = (0..D).map(|t| x.q[((b * SQ + i) * H + h) * D + t] as f64 * x.k[((b * SK + j) * HKV + kh) * D + t] as f64).sum();
                        dot * SCALE as f64 + x.bias[(h * SQ + i) * SK + j] as f64 - x.slopes[h] as f64 * (pos - j as i64).abs() as f64
                    })
                    .collect();
                if z.is_empty() {
                    continue;
                }
                let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = z.iter().map(|v| (v - m).exp()).sum();
                lse[(b * H + h) * SQ + i] = m + l.ln();
                for t in 0..D {
                    o[((b * SQ + i) * H + h) * D + t] = vis.iter().zip(&z).map(|(&j, zj)| (zj - m).exp() / l * x.v[((b * SK + j) * HKV + kh) * D + t] as f64).sum();
                }
            }
        }
    }
    (o, lse)
}

fn base_attrs(fb: FrameBuilder) -> FrameBuilder {
    fb.attr("scale", AttrValue::F32(SCALE))
        .attr("softcap", AttrValue::F32(0.0))
        .attr("window_left", AttrValue::I64(-1))
        .attr("window_right", AttrValue::I64(0))
}

fn dims4(d: [usize; 4]) -> Vec<i64> {
    d.iter().map(|&x| x as i64).collect()
}

/// The forward frame with `extra` operands after the five fixed ones and `flags` as attributes.
fn fwd_frame_with(x: &Data, extra: Vec<OwnedBuffer>, flags: Vec<(&str, AttrValue)>) -> FrameBuilder {
    let q_dims = [B as i64, SQ as i64, H as i64, D as i64];
    let k_dims = [B as i64, SK as i64, HKV as i64, D as i64];
    let mut fb = base_attrs(FrameBuilder::new())
        .arg(f32_buf(&q_dims, &x.q))
        .arg(f32_buf(&k_dims, &x.k))
        .arg(f32_buf(&k_dims, &x.v))
        .arg(i32_buf(&x.kv_len))
        .arg(i32_buf(&x.q_start));
    for a in extra {
        fb = fb.arg(a);
    }
    for (n, v) in flags {
        fb = fb.attr(n, v);
    }
    fb.ret(f32_buf(&q_dims, &vec![f32::NAN; B * SQ * H * D])).ret(f32_buf(&[B as i64, H as i64, SQ as i64], &[f32::NAN; B * H * SQ]))
}

fn mask_buf(x: &Data) -> OwnedBuffer {
    OwnedBuffer::new(sys::XLA_FFI_DataType_S64, &[B as i64, SK as i64], &bytes(&x.mask))
}

/// key_mask (s64), bias, alibi_slopes, in contract order.
fn all_extras(x: &Data) -> Vec<OwnedBuffer> {
    vec![mask_buf(x), f32_buf(&dims4(x.bias_dims), &x.bias), f32_buf(&[H as i64], &x.slopes)]
}

fn all_flags() -> Vec<(&'static str, AttrValue)> {
    // An s64 0/1 is accepted as well as a pred.
    vec![("has_key_mask", AttrValue::Pred(true)), ("has_bias", AttrValue::Pred(true)), ("has_alibi", AttrValue::I64(1))]
}

fn fwd_frame(x: &Data) -> FrameBuilder {
    fwd_frame_with(x, all_extras(x), all_flags())
}

fn run_fwd(fb: FrameBuilder) -> Result<Box<FrameBuilder>, FakeError> {
    let mut fb = fb.build(api());
    match unsafe { take_fake_error(exla_rs_flash_attn_fwd_host(fb.frame())) } {
        None => Ok(fb),
        Some(e) => Err(e),
    }
}

#[test]
fn forward_with_every_extra_computes_the_contract() {
    let x = data();
    let fb = run_fwd(fwd_frame(&x)).unwrap_or_else(|e| panic!("{}", e.message));
    let (o, lse) = (fb.rets[0].view::<f32>(), fb.rets[1].view::<f32>());
    let (ro, rl) = reference(&x);
    for (n, (g, w)) in lse.iter().zip(&rl).enumerate() {
        if w.is_finite() {
            assert!((*g as f64 - w).abs() < 1e-5, "lse[{n}]: {g} vs {w}");
        } else {
            assert_eq!(*g, f32::NEG_INFINITY, "lse[{n}]");
        }
    }
    for (n, (g, w)) in o.iter().zip(&ro).enumerate() {
        assert!((*g as f64 - w).abs() < 1e-5, "o[{n}]: {g} vs {w}");
    }
}

fn bwd_frame_with(x: &Data, o: &[f32], lse: &[f32], extra: Vec<OwnedBuffer>, flags: Vec<(&str, AttrValue)>, dbias_dims: Option<[usize; 4]>) -> FrameBuilder {
    let q_dims = [B as i64, SQ as i64, H as i64, D as i64];
    let k_dims = [B as i64, SK as i64, HKV as i64, D as i64];
    let mut fb = base_attrs(FrameBuilder::new())
        .arg(f32_buf(&q_dims, &x.q))
        .arg(f32_buf(&k_dims, &x.k))
        .arg(f32_buf(&k_dims, &x.v))
        .arg(i32_buf(&x.kv_len))
        .arg(i32_buf(&x.q_start))
        .arg(f32_buf(&q_dims, o))
        .arg(f32_buf(&[B as i64, H as i64, SQ as i64], lse))
        .arg(f32_buf(&q_dims, &x.d_o));
    for a in extra {
        fb = fb.arg(a);
    }
    for (n, v) in flags {
        fb = fb.attr(n, v);
    }
    fb = fb
        .ret(f32_buf(&q_dims, &vec![f32::NAN; B * SQ * H * D]))
        .ret(f32_buf(&k_dims, &vec![f32::NAN; B * SK * HKV * D]))
        .ret(f32_buf(&k_dims, &vec![f32::NAN; B * SK * HKV * D]));
    if let Some(d) = dbias_dims {
        fb = fb.ret(f32_buf(&dims4(d), &vec![f32::NAN; d.iter().product()]));
    }
    fb
}

fn bwd_frame(x: &Data, o: &[f32], lse: &[f32], with_dbias: bool) -> FrameBuilder {
    let mut flags = all_flags();
    flags.push(("bias_grad", AttrValue::Pred(with_dbias)));
    bwd_frame_with(x, o, lse, all_extras(x), flags, with_dbias.then_some(x.bias_dims))
}

/// `Σ o·do` of the forward handler at this bias, in f64.
fn loss(x: &Data) -> f64 {
    let fb = run_fwd(fwd_frame(x)).unwrap_or_else(|e| panic!("{}", e.message));
    fb.rets[0].view::<f32>().iter().zip(&x.d_o).map(|(a, b)| *a as f64 * *b as f64).sum()
}

#[test]
fn backward_returns_dbias_after_dv() {
    let x = data();
    let fwd = run_fwd(fwd_frame(&x)).unwrap_or_else(|e| panic!("{}", e.message));
    let (o, lse) = (fwd.rets[0].view::<f32>(), fwd.rets[1].view::<f32>());
    let mut fb = bwd_frame(&x, &o, &lse, true).build(api());
    let err = unsafe { take_fake_error(exla_rs_flash_attn_bwd_host(fb.frame())) };
    assert!(err.is_none(), "{:?}", err.map(|e| e.message));
    let dbias = fb.rets[3].view::<f32>();
    assert!(fb.rets.iter().take(4).all(|r| r.view::<f32>().iter().all(|v| v.is_finite())));
    // Central differences of the forward handler itself (f32, so a loose bar), on a few entries.
    let eps = 1e-2f32;
    for idx in [0, 7, 31, 100, 179] {
        let (mut xp, mut xm) = (data(), data());
        xp.bias[idx] += eps;
        xm.bias[idx] -= eps;
        let fd = (loss(&xp) - loss(&xm)) / (2.0 * eps as f64);
        assert!((fd - dbias[idx] as f64).abs() < 2e-3, "dbias[{idx}]: fd {fd} vs {}", dbias[idx]);
    }
    // Without bias_grad the same call has three results, and the same dq.
    let mut fb2 = bwd_frame(&x, &o, &lse, false).build(api());
    let err = unsafe { take_fake_error(exla_rs_flash_attn_bwd_host(fb2.frame())) };
    assert!(err.is_none(), "{:?}", err.map(|e| e.message));
    assert_eq!(fb2.rets[0].view::<f32>(), fb.rets[0].view::<f32>());
}

fn fwd_err(fb: FrameBuilder) -> String {
    let e = run_fwd(fb).err().expect("expected an error");
    assert_eq!(e.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT, "{}", e.message);
    e.message
}

/// The forward frame with every extra, after `f` edits the optional operands and `attrs`
/// overrides presence attributes.
fn with_args(x: &Data, f: impl FnOnce(Vec<OwnedBuffer>) -> Vec<OwnedBuffer>, attrs: Vec<(&'static str, AttrValue)>) -> FrameBuilder {
    let mut flags = all_flags();
    for (n, v) in attrs {
        flags.retain(|(m, _)| *m != n);
        flags.push((n, v));
    }
    fwd_frame_with(x, f(all_extras(x)), flags)
}

#[test]
fn malformed_extras_are_invalid_argument_naming_the_operand() {
    let x = data();
    let keep = |v: Vec<OwnedBuffer>| v;
    // Operand count against the presence attributes.
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v.pop();
            v
        },
        vec![],
    ));
    assert!(m.contains("expected 8 operands (q, k, v, kv_len, q_start, key_mask, bias, alibi_slopes)"), "{m}");
    let m = fwd_err(with_args(&x, keep, vec![("has_bias", AttrValue::Pred(false))]));
    assert!(m.contains("expected 7 operands") && m.contains("got 8"), "{m}");
    // Presence attribute types.
    let m = fwd_err(with_args(&x, keep, vec![("has_bias", AttrValue::F32(1.0))]));
    assert!(m.contains("attribute `has_bias` must be a pred"), "{m}");
    let m = fwd_err(with_args(&x, keep, vec![("has_alibi", AttrValue::I64(2))]));
    assert!(m.contains("attribute `has_alibi` must be true/false"), "{m}");
    // key_mask: shape, type.
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v[0] = OwnedBuffer::new(sys::XLA_FFI_DataType_U8, &[B as i64, SK as i64 - 1], &[1u8; B * (SK - 1)]);
            v
        },
        vec![],
    ));
    assert!(m.contains("operand 5 `key_mask` must be [B, Sk] = [2, 9]"), "{m}");
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v[0] = f32_buf(&[B as i64, SK as i64], &[1.0; B * SK]);
            v
        },
        vec![],
    ));
    assert!(m.contains("operand 5 `key_mask`") && m.contains("integer or pred"), "{m}");
    // bias: rank, a dim neither 1 nor full, type.
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v[1] = f32_buf(&[H as i64, SQ as i64, SK as i64], &vec![0.0; H * SQ * SK]);
            v
        },
        vec![],
    ));
    assert!(m.contains("operand 6 `bias` must have rank 4"), "{m}");
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v[1] = f32_buf(&[1, 2, SQ as i64, SK as i64], &vec![0.0; 2 * SQ * SK]);
            v
        },
        vec![],
    ));
    assert!(m.contains("operand 6 `bias`: dimension 1 is 2, must be 1 or H = 4"), "{m}");
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v[1] = OwnedBuffer::new(sys::XLA_FFI_DataType_S32, &[1, 1, 1, 1], &bytes(&[0i32]));
            v
        },
        vec![],
    ));
    assert!(m.contains("operand 6 `bias` must be f32, f16 or bf16"), "{m}");
    // alibi_slopes: length, type; and its index moves with the operands before it.
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v[2] = f32_buf(&[H as i64 - 1], &[0.5; H - 1]);
            v
        },
        vec![],
    ));
    assert!(m.contains("operand 7 `alibi_slopes` must be f32[4]"), "{m}");
    let m = fwd_err(with_args(
        &x,
        |mut v| {
            v.remove(0);
            v[1] = OwnedBuffer::new(sys::XLA_FFI_DataType_F64, &[H as i64], &bytes(&[0.5f64; H]));
            v
        },
        vec![("has_key_mask", AttrValue::Pred(false))],
    ));
    assert!(m.contains("operand 6 `alibi_slopes` must be f32[4]"), "{m}");
}

fn bwd_err(fb: FrameBuilder) -> String {
    let mut fb = fb.build(api());
    let e = unsafe { take_fake_error(exla_rs_flash_attn_bwd_host(fb.frame())) }.expect("an error");
    assert_eq!(e.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT, "{}", e.message);
    e.message
}

#[test]
fn malformed_bias_gradients_are_invalid_argument() {
    let x = data();
    let o = vec![0.1f32; B * SQ * H * D];
    let lse = vec![0.0f32; B * H * SQ];
    // bias_grad without a bias.
    let m = bwd_err(bwd_frame_with(&x, &o, &lse, vec![], vec![("bias_grad", AttrValue::Pred(true))], Some(x.bias_dims)));
    assert!(m.contains("`bias_grad` asks for dbias but the call has no bias"), "{m}");
    // dbias shaped unlike the bias.
    let mut flags = all_flags();
    flags.push(("bias_grad", AttrValue::Pred(true)));
    let m = bwd_err(bwd_frame_with(&x, &o, &lse, all_extras(&x), flags, Some([1, 1, SQ, SK])));
    assert!(m.contains("result 3 `dbias` must be f32[1,4,5,9]"), "{m}");
    // dbias missing: three results where four are announced.
    let mut flags = all_flags();
    flags.push(("bias_grad", AttrValue::Pred(true)));
    let m = bwd_err(bwd_frame_with(&x, &o, &lse, all_extras(&x), flags, None));
    assert!(m.contains("expected 4 results (dq, dk, dv, dbias"), "{m}");
}

#[test]
fn cuda_runs_the_extras() {
    assert_eq!(exla_rs_flash_attn_features(0), 31);
    assert_eq!(exla_rs_flash_attn_features(1), 31);
    assert_eq!(exla_rs_flash_attn_features(2), -1);
    // A shape the CUDA kernels run (D=64) with every extra: it gets past decode and the feature
    // check, and fails only where a GPU is needed (the fake frame has no stream).
    let (b, s, h, d) = (1usize, 64usize, 2usize, 64usize);
    let dims = [b as i64, s as i64, h as i64, d as i64];
    let n = b * s * h * d;
    let mut fb = base_attrs(FrameBuilder::new())
        .arg(f32_buf(&dims, &randn(n, 1)))
        .arg(f32_buf(&dims, &randn(n, 2)))
        .arg(f32_buf(&dims, &randn(n, 3)))
        .arg(i32_buf(&[s as i32]))
        .arg(i32_buf(&[0]))
        .arg(OwnedBuffer::new(sys::XLA_FFI_DataType_U8, &[b as i64, s as i64], &vec![1u8; s]))
        .arg(f32_buf(&[1, h as i64, s as i64, s as i64], &randn(h * s * s, 4)))
        .arg(f32_buf(&[h as i64], &[0.5, 0.25]))
        .attr("has_key_mask", AttrValue::Pred(true))
        .attr("has_bias", AttrValue::Pred(true))
        .attr("has_alibi", AttrValue::Pred(true))
        .ret(f32_buf(&dims, &vec![0.0; n]))
        .ret(f32_buf(&[b as i64, h as i64, s as i64], &vec![0.0; b * h * s]));
    let ws = exla_rs_flash_attn_workspace_bytes(0, 1, 11, b as i64, s as i64, s as i64, h as i64, h as i64, d as i64);
    if ws > 0 {
        fb = fb.ret(OwnedBuffer::zeroed(sys::XLA_FFI_DataType_U8, &[ws], ws as usize));
    }
    let mut fb = fb.build(api());
    let e = unsafe { take_fake_error(exla_rs_flash_attn_fwd_cuda(fb.frame())) }.expect("an error: no stream here");
    assert!(!e.message.contains("not supported on Cuda"), "{}", e.message);
}
