//! The seam between the launch code and what runs the kernels. [`LaunchTarget`] is everything a
//! call needs from a device: its compute capability and SM count, a kernel by name with its
//! shared-memory opt-in, a launch, a TMA descriptor. Everything above it (kernel choice, grids,
//! blocks, shared memory, parameter blocks, tensor-map arguments: launch.rs, sm90.rs, config.rs)
//! is one code for every target. Two implement it: the CUDA driver on XLA's stream (stream.rs),
//! and the GPU-on-CPU executor (crates/exla-rs-gpusim), which this crate never sees otherwise.

use crate::tensor_map::{TensorMap, TiledMapArgs};
use exla_rs_attn::AttnError;
use std::ffi::c_void;

/// A resolved kernel, opaque to the launch code: a `CUfunction` on the driver, whatever the
/// target likes elsewhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelHandle(pub usize);

/// A device the launch code can run a call on.
pub trait LaunchTarget {
    fn compute_capability(&self) -> Result<(i32, i32), AttnError>;

    fn sm_count(&self) -> Result<u32, AttnError>;

    /// The kernel `kernel` of instantiation file `file` (an entry of `embedded::KERNEL_FILES`),
    /// allowed `smem` bytes of dynamic shared memory: `cuModuleLoadData` + `cuModuleGetFunction`
    /// + the opt-in, with the driver's refusals ([`check_min_arch`], [`check_smem`]).
    ///
    /// # Safety
    /// Called on the thread that holds the target, between its creation and drop.
    unsafe fn function(&self, file: &'static str, kernel: &'static str, smem: u32) -> Result<KernelHandle, AttnError>;

    /// Launches `f` (named `kernel`, for messages) with cuLaunchKernel's arguments: a 1-D block of
    /// `block` threads, `args` one pointer per kernel parameter.
    ///
    /// # Safety
    /// `f` came from this target's `function`; `args` matches the kernel's parameters; their
    /// pointers are memory of this device.
    unsafe fn launch(&self, f: KernelHandle, kernel: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut [*mut c_void]) -> Result<(), AttnError>;

    /// `cuTensorMapEncodeTiled` of `a`.
    ///
    /// # Safety
    /// `a.global_address` is memory of this device.
    unsafe fn encode_tiled(&self, a: &TiledMapArgs) -> Result<TensorMap, AttnError>;
}

/// UNIMPLEMENTED when a device of compute capability `cc` is older than the kernels support.
pub fn check_min_arch(cc: (i32, i32)) -> Result<(), AttnError> {
    let min = crate::arch::MIN_ARCH;
    if cc < (min.0 as i32, min.1 as i32) {
        return Err(AttnError::unimplemented(format!(
            "CUDA device has compute capability {}.{}; the kernels need {}.{} or newer",
            cc.0, cc.1, min.0, min.1
        )));
    }
    Ok(())
}

/// UNIMPLEMENTED when kernel `name` needs more dynamic shared memory than the device's opt-in
/// limit per block.
pub fn check_smem(name: &str, smem: u32, limit: i64) -> Result<(), AttnError> {
    if smem as i64 > limit {
        return Err(AttnError::unimplemented(format!("{name} needs {smem} bytes of shared memory per block; this device allows {limit}")));
    }
    Ok(())
}
