//! Feature `gpu-on-cpu`: the `_cuda_on_cpu` handlers on hand-built call frames. They decode as
//! the CUDA handlers do (CUDA's head dims and workspace), run the CUDA kernels on the GPU-on-CPU
//! executor and write XLA's result buffers; the Host handlers on the same frame are the reference.
#![cfg(feature = "gpu-on-cpu")]

use exla_rs_xla::*;
use xla_ffi::sys;
use xla_ffi::testing::*;
use xla_ffi::ApiVersion;

fn api() -> &'static sys::XLA_FFI_Api {
    fake_api(ApiVersion::new(0, 2))
}

const B: usize = 2;
const SQ: usize = 37;
const SK: usize = 45;
const H: usize = 4;
const HKV: usize = 2;
const D: usize = 64;

fn dims4(a: usize, b: usize, c: usize, d: usize) -> [i64; 4] {
    [a as i64, b as i64, c as i64, d as i64]
}

type Handler = unsafe extern "C" fn(*mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error;

/// A causal f32 forward with a key mask and a `[1, H, Sq, Sk]` bias; results start as NaN.
fn forward_frame(d: usize) -> Box<FrameBuilder> {
    forward_frame_ws(d, 0)
}

/// The same with a trailing `u8[workspace]` result (0 = none), poisoned with 0xFF.
fn forward_frame_ws(d: usize, workspace: usize) -> Box<FrameBuilder> {
    let mask: Vec<u8> = (0..B * SK).map(|e| u8::from(e % 7 != 3)).collect();
    let fb = FrameBuilder::new()
        .attr("scale", AttrValue::F32(0.125))
        .attr("softcap", AttrValue::F32(0.0))
        .attr("window_left", AttrValue::I64(-1))
        .attr("window_right", AttrValue::I64(0))
        .attr("has_key_mask", AttrValue::Pred(true))
        .attr("has_bias", AttrValue::Pred(true))
        .arg(f32_buf(&dims4(B, SQ, H, d), &randn(B * SQ * H * d, 1)))
        .arg(f32_buf(&dims4(B, SK, HKV, d), &randn(B * SK * HKV * d, 2)))
        .arg(f32_buf(&dims4(B, SK, HKV, d), &randn(B * SK * HKV * d, 3)))
        .arg(i32_buf(&[SK as i32, 30]))
        .arg(i32_buf(&[SK as i32 - SQ as i32, 0]))
        .arg(OwnedBuffer::new(sys::XLA_FFI_DataType_U8, &[B as i64, SK as i64], &mask))
        .arg(f32_buf(&dims4(1, H, SQ, SK), &randn(H * SQ * SK, 4)))
        .ret(f32_buf(&dims4(B, SQ, H, d), &vec![f32::NAN; B * SQ * H * d]))
        .ret(f32_buf(&[B as i64, H as i64, SQ as i64], &vec![f32::NAN; B * H * SQ]));
    let fb = if workspace > 0 { fb.ret(OwnedBuffer::new(sys::XLA_FFI_DataType_U8, &[workspace as i64], &vec![0xFF; workspace])) } else { fb };
    fb.build(api())
}

fn run(handler: Handler, fb: &mut FrameBuilder) -> Result<(), FakeError> {
    match unsafe { take_fake_error(handler(fb.frame())) } {
        None => Ok(()),
        Some(e) => Err(e),
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() }).fold(0.0, f32::max)
}

#[test]
fn the_cuda_kernels_on_the_cpu_match_the_host_handler() {
    let (mut sim, mut host) = (forward_frame(D), forward_frame(D));
    run(exla_rs_flash_attn_fwd_cuda_on_cpu, &mut sim).unwrap_or_else(|e| panic!("{}", e.message));
    run(exla_rs_flash_attn_fwd_host, &mut host).unwrap_or_else(|e| panic!("{}", e.message));
    for r in 0..2 {
        let (got, want) = (sim.rets[r].view::<f32>(), host.rets[r].view::<f32>());
        assert!(got.iter().all(|x| !x.is_nan()), "result {r}: unwritten (NaN) elements");
        assert!(max_diff(&got, &want) < 1e-4, "result {r}: {}", max_diff(&got, &want));
    }
    let counts = unsafe {
        let n = exla_rs_cuda_on_cpu_launch_counts_json(std::ptr::null_mut(), 0);
        let mut buf = vec![0u8; n + 1];
        exla_rs_cuda_on_cpu_launch_counts_json(buf.as_mut_ptr().cast(), buf.len());
        String::from_utf8(buf[..n].to_vec()).unwrap()
    };
    assert!(counts.contains("\"exla_rs_fwd_f32_d64\": "), "{counts}");
}

#[test]
fn a_head_dim_without_a_kernel_runs_padded_and_matches_the_host_handler() {
    // Issue 33, part 4: D = 80 (and an odd 7) on the next kernel head dim with zero-padded copies.
    for d in [80, 7] {
        let need = exla_rs_flash_attn_workspace_bytes(0, 1, sys::XLA_FFI_DataType_F32 as i32, B as i64, SQ as i64, SK as i64, H as i64, HKV as i64, d as i64);
        assert!(need > 0, "{need}");
        let (mut sim, mut host) = (forward_frame_ws(d, need as usize), forward_frame(d));
        run(exla_rs_flash_attn_fwd_cuda_on_cpu, &mut sim).unwrap_or_else(|e| panic!("D={d}: {}", e.message));
        run(exla_rs_flash_attn_fwd_host, &mut host).unwrap_or_else(|e| panic!("{}", e.message));
        for r in 0..2 {
            let (got, want) = (sim.rets[r].view::<f32>(), host.rets[r].view::<f32>());
            assert!(got.iter().all(|x| !x.is_nan()), "D={d} result {r}: unwritten (NaN) elements");
            assert!(max_diff(&got, &want) < 1e-4, "D={d} result {r}: {}", max_diff(&got, &want));
        }
    }
}

#[test]
fn calls_are_decoded_with_the_cuda_rules() {
    // D = 80 has no kernel: it runs padded to D = 96, through copies in a workspace the forward
    // then needs (CUDA's rule, not the Host's, which needs none): without one, INVALID_ARGUMENT
    // naming the size, as from the CUDA handler.
    let need = exla_rs_flash_attn_workspace_bytes(0, 1, sys::XLA_FFI_DataType_F32 as i32, B as i64, SQ as i64, SK as i64, H as i64, HKV as i64, 80);
    assert!(need > 0, "{need}");
    let mut fb = forward_frame(80);
    let e = run(exla_rs_flash_attn_fwd_cuda_on_cpu, &mut fb).expect_err("D=80 needs a workspace on CUDA");
    assert_eq!(e.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT, "{}", e.message);
    assert!(e.message.contains(&format!("workspace u8[{need}]")), "{}", e.message);
    // The metadata probe answers like every other export.
    for h in [exla_rs_flash_attn_fwd_cuda_on_cpu as Handler, exla_rs_flash_attn_bwd_cuda_on_cpu] {
        let mut probe = ProbeFrame::new(api());
        assert!(unsafe { h(probe.frame()) }.is_null());
        assert_eq!((probe.metadata.api_version.major_version, probe.metadata.api_version.minor_version), (0, 1));
    }
}
