//! The GPU-on-CPU executor ("gpusim"): exla_rs's CUDA kernels (`native/exla_rs/kernels`, both the
//! mma.sync and the sm90 sets) compiled as host C++ and run on the CPU with the GPU's semantics,
//! one fiber per CUDA thread (`kernels/cpu/exec.h` is the C ABI). This crate builds that library
//! and wraps it:
//!
//! - [`launch`] / [`has_kernel`]: what `cuLaunchKernel` / `cuModuleGetFunction` do on a GPU;
//! - [`encode_tensor_map`]: `cuTensorMapEncodeTiled` with the same arguments;
//! - [`stats_json`] / [`stats_reset`]: shared-memory bank statistics of the launches so far;
//! - [`DeviceAlloc`]: an exactly-sized host allocation standing in for a device buffer, so
//!   AddressSanitizer sees the bounds a GPU allocation would have.
//!
//! `exla-rs-cuda` (feature `gpu-on-cpu`) drives it from its unchanged launch code.

mod ffi;
mod launch;
mod memory;
mod stats;
mod tensor_map;

pub use launch::{has_kernel, launch, Dim3};
pub use memory::DeviceAlloc;
pub use stats::{stats_json, stats_reset};
pub use tensor_map::{encode_tensor_map, TensorMap, TiledMapArgs};

/// The instrumentation this build of the executor has (`EXLA_RS_GPUSIM_SANITIZE` at build time):
/// `"thread"`, `"address"`, `"stats"` (bank statistics of plain shared-memory loads and stores) or
/// None.
pub const SANITIZER: Option<&str> = option_env!("EXLA_RS_GPUSIM_SANITIZE_BUILT");
