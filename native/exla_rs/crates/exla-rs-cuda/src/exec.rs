//! Where a call's launches go: the CUDA driver on XLA's stream, or (feature `gpu-on-cpu`) the
//! GPU-on-CPU executor. Everything above this module (kernel choice, grids, blocks, dynamic shared
//! memory, parameter blocks, tensor-map arguments) is the same code for both; only the device
//! queries, the kernel lookup, the tensor-map encoding and the final launch differ.

use crate::driver::{self, check, CUfunction, CUstream, StreamContext};
use crate::modules;
use crate::sm90::{TensorMap, TiledMapArgs};
use cudarc::driver::sys;
use exla_rs_attn::AttnError;
use std::ffi::c_void;

/// The execution target of a `forward` / `backward` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    /// XLA's `CUstream`: launches are enqueued there, asynchronously.
    Cuda(*mut c_void),
    /// The GPU-on-CPU executor: the same launches run to completion on the calling thread, and
    /// every pointer in the call is host memory standing in for device memory.
    #[cfg(feature = "gpu-on-cpu")]
    GpuSim,
}

/// An entered execution target.
pub(crate) enum Device {
    Cuda { stream: CUstream, ctx: StreamContext },
    #[cfg(feature = "gpu-on-cpu")]
    Sim(crate::sim::SimDevice),
}

/// A resolved kernel.
pub(crate) enum Function {
    Cuda(CUfunction),
    /// The executor resolves kernels by name at launch.
    #[cfg(feature = "gpu-on-cpu")]
    Sim,
}

impl Device {
    /// Loads the driver and makes the stream's context current (CUDA), or reads the emulated
    /// device's properties (GpuSim).
    ///
    /// # Safety
    /// A `Stream::Cuda` holds a live CUstream (or null for the current context's default stream).
    pub unsafe fn enter(stream: Stream) -> Result<Self, AttnError> {
        match stream {
            Stream::Cuda(s) => {
                driver::init()?;
                let stream = s as CUstream;
                Ok(Device::Cuda { stream, ctx: StreamContext::enter(stream)? })
            }
            #[cfg(feature = "gpu-on-cpu")]
            Stream::GpuSim => Ok(Device::Sim(crate::sim::SimDevice::from_env()?)),
        }
    }

    pub fn compute_capability(&self) -> Result<(i32, i32), AttnError> {
        match self {
            Device::Cuda { ctx, .. } => driver::compute_capability(ctx.device),
            #[cfg(feature = "gpu-on-cpu")]
            Device::Sim(d) => Ok(d.cc),
        }
    }

    pub fn sm_count(&self) -> Result<u32, AttnError> {
        match self {
            Device::Cuda { ctx, .. } => driver::device_attr(
                ctx.device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "cuDeviceGetAttribute(multiprocessor count)",
            )
            .map(|n| n as u32),
            #[cfg(feature = "gpu-on-cpu")]
            Device::Sim(d) => Ok(d.sms),
        }
    }

    /// The kernel `kernel` of instantiation file `file`, allowed `smem` bytes of dynamic shared
    /// memory; the module is loaded on first use.
    ///
    /// # Safety
    /// Called between `enter` and drop, on the entering thread.
    pub unsafe fn function(&self, file: &'static str, kernel: &'static str, smem: u32) -> Result<Function, AttnError> {
        match self {
            Device::Cuda { ctx, .. } => Ok(Function::Cuda(modules::get(ctx.ctx, ctx.device, file)?.function(kernel, smem, ctx.device)?)),
            #[cfg(feature = "gpu-on-cpu")]
            Device::Sim(d) => d.function(file, kernel, smem).map(|()| Function::Sim),
        }
    }

    /// Launches `f` (named `kernel`, for messages and the executor) with cuLaunchKernel's
    /// arguments: a 1-D block of `block` threads, `args` one pointer per kernel parameter.
    ///
    /// # Safety
    /// `args` matches the kernel's parameters; their pointers are memory of this device.
    pub unsafe fn launch(&self, f: &Function, kernel: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut [*mut c_void]) -> Result<(), AttnError> {
        match (self, f) {
            (Device::Cuda { stream, .. }, Function::Cuda(func)) => check(
                sys::cuLaunchKernel(*func, grid.0, grid.1, grid.2, block, 1, 1, smem, *stream, args.as_mut_ptr(), std::ptr::null_mut()),
                format_args!("cuLaunchKernel({kernel}, grid {grid:?}, block {block}, smem {smem})"),
            ),
            #[cfg(feature = "gpu-on-cpu")]
            (Device::Sim(d), Function::Sim) => d.launch(kernel, grid, block, smem, args),
            #[cfg(feature = "gpu-on-cpu")]
            _ => Err(AttnError::internal(format!("{kernel}: a function resolved on one device was launched on another"))),
        }
    }

    /// `cuTensorMapEncodeTiled` of `a`.
    ///
    /// # Safety
    /// `a.global_address` is memory of this device.
    pub unsafe fn encode_tiled(&self, a: &TiledMapArgs) -> Result<TensorMap, AttnError> {
        let what = || format!("cuTensorMapEncodeTiled(dims {:?}, strides {:?}, box {:?})", a.global_dim, a.global_strides, a.box_dim);
        match self {
            Device::Cuda { .. } => {
                let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
                check(
                    sys::cuTensorMapEncodeTiled(
                        map.as_mut_ptr(),
                        a.data_type,
                        TiledMapArgs::RANK,
                        a.global_address,
                        a.global_dim.as_ptr(),
                        a.global_strides.as_ptr(),
                        a.box_dim.as_ptr(),
                        a.element_strides.as_ptr(),
                        a.interleave,
                        a.swizzle,
                        a.l2_promotion,
                        a.oob_fill,
                    ),
                    what(),
                )?;
                Ok(std::mem::transmute_copy::<sys::CUtensorMap, TensorMap>(&map.assume_init()))
            }
            #[cfg(feature = "gpu-on-cpu")]
            Device::Sim(_) => crate::sim::encode_tiled(a).map_err(|e| AttnError::internal(format!("{} failed: {e}", what()))),
        }
    }
}
