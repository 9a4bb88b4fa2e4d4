//! The exported handlers on hand-built call frames and a fake runtime: the metadata probe,
//! a real Host computation checked against a direct float64 evaluation, contract validation,
//! and the CUDA handlers failing cleanly where there is no stream or GPU.

use exla_rs_xla::*;
use xla_ffi::sys;
use xla_ffi::testing::*;
use xla_ffi::ApiVersion;

fn api() -> &'static sys::XLA_FFI_Api {
    fake_api(ApiVersion::new(0, 2))
}

fn attrs(fb: FrameBuilder, scale: f32, wl: i64, wr: i64) -> FrameBuilder {
    fb.attr("scale", AttrValue::F32(scale))
        .attr("softcap", AttrValue::F32(0.0))
        .attr("window_left", AttrValue::I64(wl))
        .attr("window_right", AttrValue::I64(wr))
}

#[test]
fn every_export_answers_the_metadata_probe_with_0_1() {
    for t in TARGETS {
        for api_ptr in [std::ptr::null(), api() as *const _] {
            let mut probe = ProbeFrame::new(api_ptr);
            let err = unsafe { (t.handler)(probe.frame()) };
            assert!(err.is_null(), "{} {}", t.name, t.platform);
            let v = &probe.metadata.api_version;
            assert_eq!((v.major_version, v.minor_version), (0, 1), "{}", t.symbol);
            assert_eq!(probe.metadata.traits, 0);
        }
    }
    let names: Vec<_> = TARGETS.iter().map(|t| (t.name, t.platform)).collect();
    assert_eq!(
        names,
        [
            ("exla_rs_flash_attn_fwd", "Host"),
            ("exla_rs_flash_attn_bwd", "Host"),
            ("exla_rs_flash_attn_fwd", "CUDA"),
            ("exla_rs_flash_attn_bwd", "CUDA")
        ]
    );
}

/// Causal GQA forward, B=2, Sq=5, Sk=7, H=4, Hkv=2, D=3, with kv_len padding on batch 1.
#[test]
fn host_forward_computes_the_contract() {
    let (b, sq, sk, h, hkv, d) = (2usize, 5usize, 7usize, 4usize, 2usize, 3usize);
    let q = randn(b * sq * h * d, 1);
    let k = randn(b * sk * hkv * d, 2);
    let v = randn(b * sk * hkv * d, 3);
    let kv_len = [7, 4];
    let q_start = [2, 2];
    let scale = 0.7f32;
    let ws = exla_rs_flash_attn_workspace_bytes(0, 0, 11, b as i64, sq as i64, sk as i64, h as i64, hkv as i64, d as i64);
    assert!(ws >= 0);
    let mut fb = FrameBuilder::new()
        .arg(f32_buf(&[b as i64, sq as i64, h as i64, d as i64], &q))
        .arg(f32_buf(&[b as i64, sk as i64, hkv as i64, d as i64], &k))
        .arg(f32_buf(&[b as i64, sk as i64, hkv as i64, d as i64], &v))
        .arg(i32_buf(&kv_len))
        .arg(i32_buf(&q_start))
        .ret(f32_buf(&[b as i64, sq as i64, h as i64, d as i64], &vec![f32::NAN; b * sq * h * d]))
        .ret(f32_buf(&[b as i64, h as i64, sq as i64], &vec![f32::NAN; b * h * sq]));
    // Larger than the Host needs, as the Elixir layer sizes it for the most demanding platform.
    let ws = ws + 64;
    fb = fb.ret(OwnedBuffer::zeroed(sys::XLA_FFI_DataType_U8, &[ws], ws as usize));
    let mut fb = attrs(fb, scale, -1, 0).build(api());
    let err = unsafe { exla_rs_flash_attn_fwd_host(fb.frame()) };
    assert!(err.is_null(), "{:?}", unsafe { take_fake_error(err) });
    let o = fb.rets[0].view::<f32>();
    let lse = fb.rets[1].view::<f32>();
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / hkv);
            for i in 0..sq {
                let vis: Vec<usize> = (0..sk).filter(|&j| (j as i32) < kv_len[bi] && j as i64 <= q_start[bi] as i64 + i as i64).collect();
                let s: Vec<f64> = vis
                    .iter()
                    .map(|&j| (0..d).map(|x| q[((bi * sq + i) * h + hi) * d + x] as f64 * k[((bi * sk + j) * hkv + kh) * d + x] as f64).sum::<f64>() * scale as f64)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let got_lse = lse[(bi * h + hi) * sq + i] as f64;
                assert!((got_lse - (l.ln() + m)).abs() < 1e-5, "lse b{bi} h{hi} i{i}: {got_lse} vs {}", l.ln() + m);
                for x in 0..d {
                    let want: f64 = vis.iter().zip(&s).map(|(&j, sj)| (sj - m).exp() / l * v[((bi * sk + j) * hkv + kh) * d + x] as f64).sum();
                    let got = o[((bi * sq + i) * h + hi) * d + x] as f64;
                    assert!((got - want).abs() < 1e-5, "o b{bi} h{hi} i{i} x{x}: {got} vs {want}");
                }
            }
        }
    }
}

fn fwd_error(fb: FrameBuilder) -> FakeError {
    let mut fb = fb.build(api());
    unsafe { take_fake_error(exla_rs_flash_attn_fwd_host(fb.frame())) }.expect("expected an error")
}

fn good_fwd(q_dims: [i64; 4], k_dims: [i64; 4]) -> FrameBuilder {
    let n = |d: &[i64]| d.iter().product::<i64>() as usize;
    FrameBuilder::new()
        .arg(f32_buf(&q_dims, &randn(n(&q_dims), 4)))
        .arg(f32_buf(&k_dims, &randn(n(&k_dims), 5)))
        .arg(f32_buf(&k_dims, &randn(n(&k_dims), 6)))
        .arg(i32_buf(&vec![k_dims[1] as i32; q_dims[0] as usize]))
        .arg(i32_buf(&vec![0; q_dims[0] as usize]))
        .ret(f32_buf(&q_dims, &vec![0.0; n(&q_dims)]))
        .ret(f32_buf(&[q_dims[0], q_dims[2], q_dims[1]], &vec![0.0; (q_dims[0] * q_dims[2] * q_dims[1]) as usize]))
}

#[test]
fn malformed_calls_are_invalid_argument_naming_the_operand() {
    let e = fwd_error(attrs(good_fwd([1, 4, 6, 8], [1, 4, 4, 8]), 1.0, -1, -1));
    assert_eq!(e.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT);
    assert!(e.message.contains("H=6 must be a multiple of k/v heads Hkv=4"), "{}", e.message);

    let e = fwd_error(good_fwd([1, 4, 2, 8], [1, 4, 2, 8]).attr("scale", AttrValue::F32(1.0)));
    assert!(e.message.contains("missing attribute `softcap`"), "{}", e.message);

    let e = fwd_error(attrs(good_fwd([1, 4, 2, 8], [1, 4, 2, 8]), 1.0, -1, -1).ret(f32_buf(&[2], &[0.0, 0.0])));
    assert!(e.message.contains("result 2 `workspace` must be u8[N] with N >= 0, got f32[2]"), "{}", e.message);

    let e = fwd_error(attrs(good_fwd([1, 4, 2, 8], [1, 4, 2, 8]), 1.0, -1, -1).ret(f32_buf(&[2], &[0.0; 2])).ret(f32_buf(&[2], &[0.0; 2])));
    assert!(e.message.contains("expected 2 results (o, lse and an optional u8 workspace), got 4"), "{}", e.message);

    let e = fwd_error(attrs(good_fwd([1, 4, 2, 8], [2, 4, 2, 8]), 1.0, -1, -1));
    assert!(e.message.contains("operand 1 `k` batch 2 differs from `q` batch 1"), "{}", e.message);

    let e = fwd_error(attrs(good_fwd([1, 4, 2, 8], [1, 4, 2, 8]), f32::NAN, -1, -1));
    assert!(e.message.contains("attribute `scale` must be a finite f32"), "{}", e.message);
}

#[test]
fn cuda_handlers_fail_cleanly_without_a_stream() {
    // The fake runtime, like XLA's CPU runtime, has no stream: a clean error, no panic.
    let mut fb = attrs(good_fwd([1, 64, 2, 64], [1, 64, 2, 64]), 0.125, -1, -1);
    let ws = exla_rs_flash_attn_workspace_bytes(0, 1, 11, 1, 64, 64, 2, 2, 64);
    if ws > 0 {
        fb = fb.ret(OwnedBuffer::zeroed(sys::XLA_FFI_DataType_U8, &[ws], ws as usize));
    }
    let mut fb = fb.build(api());
    let err = unsafe { take_fake_error(exla_rs_flash_attn_fwd_cuda(fb.frame())) }.expect("an error");
    if ws >= 0 {
        assert_eq!(err.code, sys::XLA_FFI_Error_Code_INTERNAL, "{}", err.message);
        assert!(err.message.contains("XLA_FFI_Stream_Get failed"), "{}", err.message);
    } else {
        assert_eq!(err.code, sys::XLA_FFI_Error_Code_UNIMPLEMENTED, "{}", err.message);
    }
}

#[test]
fn workspace_bytes_rejects_what_the_contract_rejects() {
    let f = exla_rs_flash_attn_workspace_bytes;
    assert!(f(0, 0, 11, 1, 128, 128, 8, 8, 64) >= 0);
    assert!(f(1, 0, 16, 2, 33, 65, 8, 2, 256) >= 0);
    assert_eq!(f(0, 0, 11, 1, 8, 8, 6, 4, 64), -1);
    assert_eq!(f(0, 0, 11, 1, 8, 8, 4, 4, 257), -1);
    assert_eq!(f(0, 0, 11, 1, 8, 8, 4, 0, 64), -1);
    assert_eq!(f(0, 0, 11, -1, 8, 8, 4, 4, 64), -1);
    assert_eq!(f(0, 0, 5, 1, 8, 8, 4, 4, 64), -1);
    assert_eq!(f(3, 0, 11, 1, 8, 8, 4, 4, 64), -1);
    assert_eq!(f(0, 2, 11, 1, 8, 8, 4, 4, 64), -1);
}

#[test]
fn cuda_unsupported_configurations_say_why() {
    // The reason comes from the CUDA kernels' own support check, whichever limit it is.
    // (Every head dim the contract admits, 1..=256, has a kernel or runs padded: the grid limit
    // is what CUDA alone refuses.)
    for (q, k, why) in [([70_000, 1, 1, 64], [70_000, 1, 1, 64], "65535")] {
        let mut fb = attrs(good_fwd(q, k), 0.125, -1, -1).build(api());
        let err = unsafe { take_fake_error(exla_rs_flash_attn_fwd_cuda(fb.frame())) }.expect("an error");
        assert_eq!(err.code, sys::XLA_FFI_Error_Code_UNIMPLEMENTED, "{}", err.message);
        assert!(err.message.contains("not supported on Cuda") && err.message.contains(why), "{}", err.message);
    }
}
