//! The CUDA handler's plumbing without a GPU: a call frame decoded by `decode` becomes the kernels'
//! `ExtraParams` (pointers, bias strides for every broadcast pattern, key-mask element sizes,
//! dropout threshold and scale), the dbias workspace rule, and UNIMPLEMENTED for the feature bits
//! CUDA leaves clear.

use exla_rs_attn::philox::{dropout_keep_scale, dropout_threshold};
use exla_rs_attn::Platform;
use exla_rs_cuda::{extra_params, ExtraParams};
use exla_rs_xla::workspace::{exla_rs_flash_attn_dbias_workspace_bytes, features, FEATURE_ALIBI, FEATURE_BIAS, FEATURE_BIAS_GRAD, FEATURE_DROPOUT, FEATURE_KEY_MASK};
use exla_rs_xla::*;
use xla_ffi::sys;
use xla_ffi::testing::*;
use xla_ffi::{ApiVersion, CallFrame};

fn api() -> &'static sys::XLA_FFI_Api {
    fake_api(ApiVersion::new(0, 2))
}

const B: usize = 3;
const SQ: usize = 5;
const SK: usize = 7;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 64;

fn zeros(dtype: i32, dims: &[usize], elem: usize) -> OwnedBuffer {
    let d: Vec<i64> = dims.iter().map(|&x| x as i64).collect();
    OwnedBuffer::zeroed(dtype, &d, dims.iter().product::<usize>() * elem)
}

/// One optional operand: its buffer and presence attribute.
struct Opt {
    buf: OwnedBuffer,
    attr: &'static str,
}

fn mask(dtype: i32, elem: usize) -> Opt {
    Opt { buf: zeros(dtype, &[B, SK], elem), attr: "has_key_mask" }
}
fn bias(dtype: i32, elem: usize, dims: [usize; 4]) -> Opt {
    Opt { buf: zeros(dtype, &dims, elem), attr: "has_bias" }
}
fn slopes() -> Opt {
    Opt { buf: zeros(sys::XLA_FFI_DataType_F32, &[H], 4), attr: "has_alibi" }
}
fn key() -> Opt {
    Opt { buf: zeros(sys::XLA_FFI_DataType_U32, &[2], 4), attr: "has_dropout" }
}

/// A forward frame of f32 q/k/v with the given optional operands (in contract order).
fn fwd_frame(opts: Vec<Opt>, rate: Option<f32>) -> Box<FrameBuilder> {
    let f32t = sys::XLA_FFI_DataType_F32;
    let mut fb = FrameBuilder::new()
        .attr("scale", AttrValue::F32(0.125))
        .attr("softcap", AttrValue::F32(0.0))
        .attr("window_left", AttrValue::I64(-1))
        .attr("window_right", AttrValue::I64(0))
        .arg(zeros(f32t, &[B, SQ, H, D], 4))
        .arg(zeros(f32t, &[B, SK, HKV, D], 4))
        .arg(zeros(f32t, &[B, SK, HKV, D], 4))
        .arg(zeros(sys::XLA_FFI_DataType_S32, &[B], 4))
        .arg(zeros(sys::XLA_FFI_DataType_S32, &[B], 4));
    for o in opts {
        fb = fb.arg(o.buf).attr(o.attr, AttrValue::Pred(true));
    }
    if let Some(r) = rate {
        fb = fb.attr("dropout_rate", AttrValue::F32(r));
    }
    fb.ret(zeros(f32t, &[B, SQ, H, D], 4)).ret(zeros(f32t, &[B, H, SQ], 4)).build(api())
}

/// Decodes the frame (as the Host, which runs every feature, so the decode itself succeeds) and
/// returns what the CUDA handler would hand its kernels, with the frame's operand pointers.
fn params_of(fb: &mut FrameBuilder) -> (ExtraParams, Vec<u64>) {
    let raw = fb.frame();
    // SAFETY: the builder's frame outlives this function's use of it.
    let frame = unsafe { CallFrame::from_raw(&*raw, "exla_rs_flash_attn_fwd") }.expect("frame");
    let call = decode::forward("exla_rs_flash_attn_fwd", &frame, Platform::Host).unwrap_or_else(|e| panic!("{e:?}"));
    let ptrs = (0..frame.arg_count()).map(|i| frame.arg(i).unwrap().data as usize as u64).collect();
    (extra_params(&cuda::extra_buffers(&call.common.extras)), ptrs)
}

#[test]
fn a_call_without_extras_passes_none() {
    let (p, _) = params_of(&mut fwd_frame(vec![], None));
    assert!(p.key_mask.is_null() && p.bias.is_null() && p.alibi_slopes.is_null() && p.dropout_key.is_null());
    assert_eq!((p.key_mask_bytes, p.dropout_threshold, p.dropout_scale), (0, 0, 1.0));
}

#[test]
fn key_mask_pointer_and_element_size_for_every_integer_type() {
    let types = [
        (sys::XLA_FFI_DataType_PRED, 1),
        (sys::XLA_FFI_DataType_S8, 1),
        (sys::XLA_FFI_DataType_U8, 1),
        (sys::XLA_FFI_DataType_S16, 2),
        (sys::XLA_FFI_DataType_U16, 2),
        (sys::XLA_FFI_DataType_S32, 4),
        (sys::XLA_FFI_DataType_U32, 4),
        (sys::XLA_FFI_DataType_S64, 8),
        (sys::XLA_FFI_DataType_U64, 8),
    ];
    for (dtype, elem) in types {
        let (p, ptrs) = params_of(&mut fwd_frame(vec![mask(dtype, elem)], None));
        assert_eq!(p.key_mask as u64, ptrs[5], "dtype {dtype}");
        assert_eq!(p.key_mask_bytes, elem as i32, "dtype {dtype}");
        assert!(p.bias.is_null() && p.alibi_slopes.is_null() && p.dropout_key.is_null());
    }
}

#[test]
fn bias_strides_for_every_broadcast_pattern_and_dtype() {
    let full = [B, H, SQ, SK];
    for pattern in 0..16u32 {
        let dims: [usize; 4] = std::array::from_fn(|a| if pattern & (1 << a) != 0 { 1 } else { full[a] });
        // Dense row-major strides of `dims`, zeroed on the broadcast ones.
        let dense = [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1];
        let want: [i64; 4] = std::array::from_fn(|a| if dims[a] == 1 { 0 } else { dense[a] as i64 });
        for (dtype, elem, code) in [(sys::XLA_FFI_DataType_F32, 4, 0), (sys::XLA_FFI_DataType_F16, 2, 1), (sys::XLA_FFI_DataType_BF16, 2, 2)] {
            // With a key mask before it, so the bias is operand 6.
            let (p, ptrs) = params_of(&mut fwd_frame(vec![mask(sys::XLA_FFI_DataType_U8, 1), bias(dtype, elem, dims)], None));
            assert_eq!(p.bias as u64, ptrs[6], "{dims:?}");
            assert_eq!([p.bias_stride_b, p.bias_stride_h, p.bias_stride_q, p.bias_stride_k], want, "{dims:?}");
            assert_eq!(p.bias_dtype, code, "{dims:?} dtype {dtype}");
        }
    }
    // The patterns the contract names, spelled out.
    let strides = |d: [usize; 4]| {
        let (p, _) = params_of(&mut fwd_frame(vec![bias(sys::XLA_FFI_DataType_F32, 4, d)], None));
        [p.bias_stride_b, p.bias_stride_h, p.bias_stride_q, p.bias_stride_k]
    };
    assert_eq!(strides([1, H, SQ, SK]), [0, 35, 7, 1]);
    assert_eq!(strides([B, 1, SQ, SK]), [35, 0, 7, 1]);
    assert_eq!(strides([1, 1, SQ, SK]), [0, 0, 7, 1]);
    assert_eq!(strides([B, H, SQ, SK]), [140, 35, 7, 1]);
    assert_eq!(strides([B, 1, 1, SK]), [7, 0, 0, 1]);
    assert_eq!(strides([B, H, SQ, 1]), [20, 5, 1, 0]);
}

#[test]
fn alibi_and_dropout_with_every_extra() {
    for rate in [0.1f32, 0.5, 2f32.powi(-9), 0.999, 1e-7] {
        let opts = vec![mask(sys::XLA_FFI_DataType_S32, 4), bias(sys::XLA_FFI_DataType_BF16, 2, [B, 1, 1, SK]), slopes(), key()];
        let (p, ptrs) = params_of(&mut fwd_frame(opts, Some(rate)));
        assert_eq!(p.key_mask as u64, ptrs[5]);
        assert_eq!(p.bias as u64, ptrs[6]);
        assert_eq!(p.alibi_slopes as u64, ptrs[7]);
        assert_eq!(p.dropout_key as u64, ptrs[8], "the key stays a device pointer");
        assert_eq!(p.dropout_threshold, dropout_threshold(rate), "rate {rate}");
        assert_eq!(p.dropout_threshold, (rate as f64 * 2f64.powi(32)).floor() as u32, "rate {rate}");
        assert_eq!(p.dropout_scale.to_bits(), dropout_keep_scale(rate).to_bits(), "rate {rate}");
        assert_eq!(p.dropout_scale, 1.0 / (1.0 - rate), "rate {rate}");
        assert_eq!((p.key_mask_bytes, p.bias_dtype), (4, 2));
        assert_eq!([p.bias_stride_b, p.bias_stride_h, p.bias_stride_q, p.bias_stride_k], [7, 0, 0, 1]);
    }
}

#[test]
fn dbias_workspace_rule() {
    // CUDA: one f32 per bias element, appended after the base workspace; the Host needs none.
    for dims in [[1, H, SQ, SK], [B, 1, SQ, SK], [1, 1, SQ, SK], [B, H, SQ, SK], [B, 1, 1, SK], [1, 1, 1, 1]] {
        let [bb, hb, sqb, skb] = dims.map(|x| x as i64);
        assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(1, bb, hb, sqb, skb), 4 * bb * hb * sqb * skb, "{dims:?}");
        assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(0, bb, hb, sqb, skb), 0, "{dims:?}");
    }
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(2, 1, 1, 1, 1), -1, "unknown platform");
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(1, 1, -1, 1, 1), -1, "negative dim");
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(0, 1, -1, 1, 1), -1, "negative dim on the Host too");
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(1, i64::MAX, 2, 1, 1), -1, "overflow");
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(1, 1 << 30, 1 << 30, 1 << 3, 1), -1, "past u64");
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(1, 1 << 30, 1 << 30, 2, 1), -1, "2^63 bytes: past i64");
    assert_eq!(exla_rs_flash_attn_dbias_workspace_bytes(1, 1 << 30, 1 << 30, 1, 1), 1 << 62);
}

/// The bits the contract defines, by name.
const BITS: [(u32, &str); 5] =
    [(FEATURE_KEY_MASK, "key_mask"), (FEATURE_BIAS, "bias"), (FEATURE_ALIBI, "alibi_slopes"), (FEATURE_BIAS_GRAD, "bias_grad"), (FEATURE_DROPOUT, "dropout")];

#[test]
fn every_clear_cuda_bit_answers_unimplemented_and_every_set_one_gets_past_decode() {
    let cuda = features(Platform::Cuda);
    assert_eq!(exla_rs_flash_attn_features(1), cuda as i32);
    assert_eq!(cuda & !(FEATURE_KEY_MASK | FEATURE_BIAS | FEATURE_ALIBI | FEATURE_BIAS_GRAD | FEATURE_DROPOUT), 0);
    // bias_grad needs the bias kernels.
    assert!(cuda & FEATURE_BIAS_GRAD == 0 || cuda & FEATURE_BIAS != 0);
    for (bit, name) in BITS.iter().filter(|(b, _)| *b != FEATURE_BIAS_GRAD) {
        let (opt, rate) = match *bit {
            FEATURE_KEY_MASK => (mask(sys::XLA_FFI_DataType_U8, 1), None),
            FEATURE_BIAS => (bias(sys::XLA_FFI_DataType_F16, 2, [1, H, SQ, SK]), None),
            FEATURE_ALIBI => (slopes(), None),
            _ => (key(), Some(0.25)),
        };
        let mut fb = fwd_frame(vec![opt], rate);
        let err = unsafe { take_fake_error(exla_rs_flash_attn_fwd_cuda(fb.frame())) }.expect("an error: no GPU here");
        if cuda & bit == 0 {
            assert_eq!(err.code, sys::XLA_FFI_Error_Code_UNIMPLEMENTED, "{name}: {}", err.message);
            assert!(err.message.contains(&format!("{name} not supported on Cuda")), "{name}: {}", err.message);
        } else {
            // Past decode and the feature check: what fails is the missing stream/driver.
            assert!(!err.message.contains("not supported on Cuda"), "{name}: {}", err.message);
        }
    }
}
