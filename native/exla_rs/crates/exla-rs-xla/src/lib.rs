//! exla_rs's XLA FFI handlers and the plain handler library `libexla_rs_xla.so`.
//!
//! Layers: [`decode`] checks a call frame against the custom-call contract
//! (`docs/flash-attention-contract.md`) and names the offending operand; [`host`] and
//! [`cuda`] run the validated call on their platform; [`targets`] lists what we register;
//! [`workspace`] answers `exla_rs_flash_attn_workspace_bytes`. The `#[no_mangle]` exports below
//! are the library's whole C surface; the NIF links this crate as an rlib and registers the same
//! functions through [`TARGETS`].

pub mod cuda;
#[cfg(feature = "gpu-on-cpu")]
pub mod cuda_on_cpu;
pub mod decode;
pub mod host;
pub mod targets;
pub mod workspace;

pub use targets::{Target, FFI_API_VERSION, TARGETS};
pub use workspace::{features, workspace_bytes};

use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};

/// Flash-attention forward on the Host (CPU) platform.
///
/// # Safety
/// Called by XLA with a valid call frame (or a metadata probe).
#[no_mangle]
pub unsafe extern "C" fn exla_rs_flash_attn_fwd_host(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    host::forward_handler(frame)
}

/// Flash-attention backward on the Host (CPU) platform.
///
/// # Safety
/// Called by XLA with a valid call frame (or a metadata probe).
#[no_mangle]
pub unsafe extern "C" fn exla_rs_flash_attn_bwd_host(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    host::backward_handler(frame)
}

/// Flash-attention forward on the CUDA platform.
///
/// # Safety
/// Called by XLA with a valid call frame (or a metadata probe).
#[no_mangle]
pub unsafe extern "C" fn exla_rs_flash_attn_fwd_cuda(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    cuda::forward_handler(frame)
}

/// Flash-attention backward on the CUDA platform.
///
/// # Safety
/// Called by XLA with a valid call frame (or a metadata probe).
#[no_mangle]
pub unsafe extern "C" fn exla_rs_flash_attn_bwd_cuda(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    cuda::backward_handler(frame)
}

/// Feature `gpu-on-cpu` (never in the release library): the CUDA forward handler's code path on
/// XLA's CPU platform, the kernels run by the GPU-on-CPU executor (`cuda_on_cpu.rs`).
///
/// # Safety
/// Called by XLA with a valid call frame (or a metadata probe).
#[cfg(feature = "gpu-on-cpu")]
#[no_mangle]
pub unsafe extern "C" fn exla_rs_flash_attn_fwd_cuda_on_cpu(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    cuda_on_cpu::forward_handler(frame)
}

/// Feature `gpu-on-cpu`: the CUDA backward handler's code path on XLA's CPU platform.
///
/// # Safety
/// Called by XLA with a valid call frame (or a metadata probe).
#[cfg(feature = "gpu-on-cpu")]
#[no_mangle]
pub unsafe extern "C" fn exla_rs_flash_attn_bwd_cuda_on_cpu(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    cuda_on_cpu::backward_handler(frame)
}

/// Feature `gpu-on-cpu`: launches per kernel on the GPU-on-CPU executor since the last reset, as
/// JSON `{"kernel": n, ...}`, written NUL-terminated into `buf` when it fits; returns the full
/// length (call with len 0 to size the buffer).
///
/// # Safety
/// `buf` is valid for `len` bytes (or null with len 0).
#[cfg(feature = "gpu-on-cpu")]
#[no_mangle]
pub unsafe extern "C" fn exla_rs_cuda_on_cpu_launch_counts_json(buf: *mut std::ffi::c_char, len: usize) -> usize {
    std::panic::catch_unwind(cuda_on_cpu::launch_counts_json)
        .map_or(0, |text| cuda_on_cpu::write_c_string(&text, buf, len))
}

/// Feature `gpu-on-cpu`: the executor's shared-memory bank statistics since the last reset
/// (crates/exla-rs-gpusim/executor/README.md describes the JSON), written as for the launch counts.
///
/// # Safety
/// As for `exla_rs_cuda_on_cpu_launch_counts_json`.
#[cfg(feature = "gpu-on-cpu")]
#[no_mangle]
pub unsafe extern "C" fn exla_rs_cuda_on_cpu_bank_stats_json(buf: *mut std::ffi::c_char, len: usize) -> usize {
    std::panic::catch_unwind(exla_rs_gpusim::stats_json).map_or(0, |text| cuda_on_cpu::write_c_string(&text, buf, len))
}

/// Feature `gpu-on-cpu`: the executor's global-memory traffic per kernel since the last reset
/// (bytes read, written, atomically added; the statistics build counts, others answer `{}`),
/// written as for the launch counts.
///
/// # Safety
/// As for `exla_rs_cuda_on_cpu_launch_counts_json`.
#[cfg(feature = "gpu-on-cpu")]
#[no_mangle]
pub unsafe extern "C" fn exla_rs_cuda_on_cpu_traffic_json(buf: *mut std::ffi::c_char, len: usize) -> usize {
    std::panic::catch_unwind(exla_rs_gpusim::traffic_json).map_or(0, |text| cuda_on_cpu::write_c_string(&text, buf, len))
}

/// Feature `gpu-on-cpu`: forgets the launch counts, the bank statistics and the traffic.
#[cfg(feature = "gpu-on-cpu")]
#[no_mangle]
pub extern "C" fn exla_rs_cuda_on_cpu_stats_reset() {
    let _ = std::panic::catch_unwind(|| {
        exla_rs_gpusim::reset_launch_counts();
        exla_rs_gpusim::stats_reset();
    });
}

/// Bytes of the trailing `u8[N]` workspace result a call takes: N > 0, 0 for none, -1 when the
/// configuration is not supported on that platform. pass: 0 forward, 1 backward; platform:
/// 0 Host, 1 CUDA; dtype: `XLA_FFI_DataType` code of q/k/v.
#[no_mangle]
pub extern "C" fn exla_rs_flash_attn_workspace_bytes(
    pass: i32,
    platform: i32,
    dtype: i32,
    b: i64,
    sq: i64,
    sk: i64,
    h: i64,
    hkv: i64,
    d: i64,
) -> i64 {
    // Never unwind into C: a panic here (there should be none) reads as "unsupported".
    std::panic::catch_unwind(|| workspace_bytes(pass, platform, dtype, b, sq, sk, h, hkv, d)).unwrap_or(-1)
}

/// The optional features (bit 0 key_mask, 1 bias, 2 alibi_slopes, 3 bias_grad, 4 dropout) the handlers of
/// `platform` (0 Host, 1 CUDA) run; -1 for an unknown platform code.
#[no_mangle]
pub extern "C" fn exla_rs_flash_attn_features(platform: i32) -> i32 {
    exla_rs_attn::Platform::from_code(platform).map_or(-1, |p| features(p) as i32)
}
