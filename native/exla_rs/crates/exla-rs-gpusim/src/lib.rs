//! The GPU-on-CPU executor ("gpusim"): exla_rs's CUDA kernels (`native/exla_rs/kernels`, both the
//! mma.sync and the sm90 sets) compiled as host C++ and run on the CPU with the GPU's semantics,
//! one fiber per CUDA thread. Everything of it lives in this crate:
//!
//! - `executor/`: the C++ (runtime, fibers, PTX and sm90 instruction models, the kernel table,
//!   `exec.h` its C ABI; `executor/README.md` says how it works) and its own tests;
//! - `build.rs`: compiles it with every kernel instantiation file, plain or under a sanitizer;
//! - this Rust face:
//! - [`SimDevice`]: the modelled GPU, an `exla_rs_cuda::LaunchTarget` (the one seam: pass
//!   `exla_rs_cuda::Stream::Target(&device)` to `forward` / `backward`), with [`launch_counts`];
//! - [`launch`] / [`has_kernel`]: what `cuLaunchKernel` / `cuModuleGetFunction` do on a GPU;
//! - [`encode_tensor_map`]: `cuTensorMapEncodeTiled` with the same arguments;
//! - [`stats_json`] / [`stats_reset`]: shared-memory bank statistics of the launches so far;
//!   [`traffic_json`]: their global-memory bytes (the statistics build);
//! - [`DeviceAlloc`]: an exactly-sized host allocation standing in for a device buffer, so
//!   AddressSanitizer sees the bounds a GPU allocation would have.
//! - `examples/gpu_on_cpu_check`: every kernel image under the sanitizers, against the Host
//!   kernels; `tests/`: the launch code on the executor.
//!
//! exla-rs-cuda knows none of this; exla-rs-xla's `gpu-on-cpu` feature links it into the test
//! handler library (scripts/gpu_on_cpu.sh). Release libraries carry none of it.

mod device;
mod ffi;
mod launch;
mod memory;
mod stats;
mod tensor_map;

pub use device::{launch_counts, parse_cc, parse_sms, reset_launch_counts, SimDevice, DEFAULT_CC, DEFAULT_SMS};
pub use launch::{has_kernel, launch, Dim3};
pub use memory::DeviceAlloc;
pub use stats::{stats_json, stats_reset, traffic_json};
pub use tensor_map::{encode_tensor_map, TensorMap, TiledMapArgs};

/// The instrumentation this build of the executor has (`EXLA_RS_GPUSIM_SANITIZE` at build time):
/// `"thread"`, `"address"`, `"stats"` (bank statistics of plain shared-memory loads and stores) or
/// None.
pub const SANITIZER: Option<&str> = option_env!("EXLA_RS_GPUSIM_SANITIZE_BUILT");
