//! Dropout's operand and attributes through the exported handlers on hand-built frames
//! (docs/flash-attention-contract.md, "Dropout"): `dropout_key` is the last optional operand,
//! every malformed combination is INVALID_ARGUMENT naming the operand or attribute (on both
//! platforms, before any feature check), and a platform without the `dropout` feature bit answers
//! UNIMPLEMENTED for a valid call.

use exla_rs_xla::*;
use xla_ffi::sys;
use xla_ffi::testing::*;
use xla_ffi::ApiVersion;

fn api() -> &'static sys::XLA_FFI_Api {
    fake_api(ApiVersion::new(0, 2))
}

// D = 64 so the same frame is one the CUDA kernels take (the CUDA answer is then about dropout).
const B: usize = 1;
const S: usize = 64;
const H: usize = 2;
const D: usize = 64;
const N: usize = B * S * H * D;

fn dims() -> [i64; 4] {
    [B as i64, S as i64, H as i64, D as i64]
}

/// A forward frame: q, k, v, kv_len, q_start, then `extra`, with `attrs` beside the base ones.
fn fwd_frame(extra: Vec<OwnedBuffer>, attrs: Vec<(&str, AttrValue)>, platform: i32) -> FrameBuilder {
    let mut fb = FrameBuilder::new()
        .attr("scale", AttrValue::F32(0.125))
        .attr("softcap", AttrValue::F32(0.0))
        .attr("window_left", AttrValue::I64(-1))
        .attr("window_right", AttrValue::I64(-1))
        .arg(f32_buf(&dims(), &randn(N, 1)))
        .arg(f32_buf(&dims(), &randn(N, 2)))
        .arg(f32_buf(&dims(), &randn(N, 3)))
        .arg(i32_buf(&[S as i32]))
        .arg(i32_buf(&[0]));
    for a in extra {
        fb = fb.arg(a);
    }
    for (n, v) in attrs {
        fb = fb.attr(n, v);
    }
    fb = fb.ret(f32_buf(&dims(), &vec![0.0; N])).ret(f32_buf(&[B as i64, H as i64, S as i64], &vec![0.0; B * H * S]));
    let ws = exla_rs_flash_attn_workspace_bytes(0, platform, 11, B as i64, S as i64, S as i64, H as i64, H as i64, D as i64);
    if ws > 0 {
        fb = fb.ret(OwnedBuffer::zeroed(sys::XLA_FFI_DataType_U8, &[ws], ws as usize));
    }
    fb
}

fn dropout_attrs(rate: f32) -> Vec<(&'static str, AttrValue)> {
    vec![("has_dropout", AttrValue::Pred(true)), ("dropout_rate", AttrValue::F32(rate))]
}

/// Runs the forward on `platform` (0 Host, 1 CUDA); the error, if any.
fn run(fb: FrameBuilder, platform: i32) -> Option<FakeError> {
    let mut fb = fb.build(api());
    // SAFETY: a frame the fake runtime built for this call.
    unsafe {
        let err = if platform == 0 { exla_rs_flash_attn_fwd_host(fb.frame()) } else { exla_rs_flash_attn_fwd_cuda(fb.frame()) };
        take_fake_error(err)
    }
}

fn invalid(fb: FrameBuilder, platform: i32) -> String {
    let e = run(fb, platform).expect("an error");
    assert_eq!(e.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT, "{}", e.message);
    e.message
}

#[test]
fn malformed_dropout_is_invalid_argument_on_both_platforms() {
    for p in [0, 1] {
        // A rate without the key (no has_dropout).
        let m = invalid(fwd_frame(vec![], vec![("dropout_rate", AttrValue::F32(0.1))], p), p);
        assert!(m.contains("attribute `dropout_rate` is 0.1 but `has_dropout` is false"), "{m}");
        // has_dropout with rate 0 (absent) and with an explicit 0.
        let m = invalid(fwd_frame(vec![u32_buf(&[2], &[1, 2])], vec![("has_dropout", AttrValue::Pred(true))], p), p);
        assert!(m.contains("`has_dropout` is true but attribute `dropout_rate` is 0"), "{m}");
        let m = invalid(fwd_frame(vec![u32_buf(&[2], &[1, 2])], dropout_attrs(0.0), p), p);
        assert!(m.contains("`dropout_rate` is 0"), "{m}");
        // Rates outside [0, 1) or NaN.
        for bad in [1.0f32, 1.5, -0.25, f32::NAN] {
            let m = invalid(fwd_frame(vec![u32_buf(&[2], &[1, 2])], dropout_attrs(bad), p), p);
            assert!(m.contains("attribute `dropout_rate`: expected a rate in [0, 1)"), "{bad}: {m}");
        }
        // A rate of another type.
        let m = invalid(fwd_frame(vec![u32_buf(&[2], &[1, 2])], vec![("has_dropout", AttrValue::Pred(true)), ("dropout_rate", AttrValue::F64(0.5))], p), p);
        assert!(m.contains("attribute `dropout_rate` must be a f32 scalar"), "{m}");
        // Keys that are not u32[2].
        for key in [u32_buf(&[3], &[1, 2, 3]), u32_buf(&[1, 2], &[1, 2]), OwnedBuffer::new(sys::XLA_FFI_DataType_S32, &[2], &bytes(&[1i32, 2]))] {
            let m = invalid(fwd_frame(vec![key], dropout_attrs(0.5), p), p);
            assert!(m.contains("operand 5 `dropout_key` must be u32[2]"), "{m}");
        }
        // has_dropout announces the key: without it the operand count is off.
        let m = invalid(fwd_frame(vec![], dropout_attrs(0.5), p), p);
        assert!(m.contains("expected 6 operands (q, k, v, kv_len, q_start, dropout_key), got 5"), "{m}");
        // The key is the last optional operand: after the ALiBi slopes, at index 6.
        let mut attrs = dropout_attrs(0.5);
        attrs.push(("has_alibi", AttrValue::Pred(true)));
        let m = invalid(fwd_frame(vec![f32_buf(&[H as i64], &[0.5; H]), u32_buf(&[3], &[1, 2, 3])], attrs, p), p);
        assert!(m.contains("operand 6 `dropout_key` must be u32[2]"), "{m}");
    }
}

#[test]
fn the_dropout_feature_bit_is_set_on_cuda() {
    assert_eq!(exla_rs_flash_attn_features(1) & 16, 16);
    // A valid dropout call gets past decode and the feature check: with no GPU (a fake frame has
    // no stream) it fails after them, never as "not supported".
    let e = run(fwd_frame(vec![u32_buf(&[2], &[1, 2])], dropout_attrs(0.5), 1), 1).expect("an error: no stream here");
    assert!(!e.message.contains("not supported on Cuda"), "{}", e.message);
}

#[test]
fn the_host_runs_dropout_with_the_contract_mask() {
    assert_eq!(exla_rs_flash_attn_features(0) & 16, 16);
    // q = 0 (P = 1/Sk on every key) and V the identity over keys (D = Sk): o[i, h, j] = M·s / Sk,
    // M from the scalar definition; lse = log(Sk), untouched by dropout.
    let (rate, key) = (0.25f32, [0x1234_5678u32, 0x9abc_def0u32]);
    let mut v = vec![0f32; N];
    for j in 0..S {
        for h in 0..H {
            v[(j * H + h) * D + j] = 1.0;
        }
    }
    let mut fb = FrameBuilder::new()
        .attr("scale", AttrValue::F32(0.125))
        .attr("softcap", AttrValue::F32(0.0))
        .attr("window_left", AttrValue::I64(-1))
        .attr("window_right", AttrValue::I64(-1))
        .attr("has_dropout", AttrValue::Pred(true))
        .attr("dropout_rate", AttrValue::F32(rate))
        .arg(f32_buf(&dims(), &vec![0.0; N]))
        .arg(f32_buf(&dims(), &randn(N, 2)))
        .arg(f32_buf(&dims(), &v))
        .arg(i32_buf(&[S as i32]))
        .arg(i32_buf(&[0]))
        .arg(u32_buf(&[2], &key))
        .ret(f32_buf(&dims(), &vec![f32::NAN; N]))
        .ret(f32_buf(&[B as i64, H as i64, S as i64], &vec![f32::NAN; B * H * S]))
        .build(api());
    // SAFETY: a frame the fake runtime built for this call.
    let err = unsafe { take_fake_error(exla_rs_flash_attn_fwd_host(fb.frame())) };
    assert!(err.is_none(), "{}", err.unwrap().message);
    let (o, lse) = (fb.rets[0].view::<f32>(), fb.rets[1].view::<f32>());
    let t = exla_rs_attn::philox::dropout_threshold(rate);
    let mut dropped = 0;
    for i in 0..S {
        for h in 0..H {
            for j in 0..S {
                let keep = exla_rs_attn::philox::dropout_keep(key, t, 0, h as u32, i as u32, j as u64);
                let want = if keep { 1.0 / (1.0 - rate) / S as f32 } else { 0.0 };
                assert!((o[(i * H + h) * D + j] - want).abs() <= 1e-6, "o[{i},{h},{j}]");
                dropped += usize::from(!keep);
            }
            assert!((lse[h * S + i] - (S as f32).ln()).abs() < 1e-5);
        }
    }
    assert!(dropped > 0);
}
