//! Where a call's launches go: [`Stream::Cuda`], XLA's stream on the CUDA driver (this module's
//! [`CudaStream`] target), or [`Stream::Target`], any other [`LaunchTarget`] (the GPU-on-CPU
//! executor of crates/exla-rs-gpusim, for tests and sanitizers without a GPU).

use crate::driver::{self, check, CUfunction, CUstream, StreamContext};
use crate::modules;
use crate::target::{KernelHandle, LaunchTarget};
use crate::tensor_map::{TensorMap, TiledMapArgs};
use cudarc::driver::sys;
use exla_rs_attn::AttnError;
use std::ffi::c_void;

/// The execution target of a `forward` / `backward` call.
#[derive(Clone, Copy)]
pub enum Stream<'a> {
    /// XLA's `CUstream`: launches are enqueued there, asynchronously.
    Cuda(*mut c_void),
    /// Another target: the launches go to it (the GPU-on-CPU executor runs each to completion on
    /// the calling thread, and every pointer of the call is host memory standing in for device
    /// memory).
    Target(&'a dyn LaunchTarget),
}

impl std::fmt::Debug for Stream<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stream::Cuda(s) => write!(f, "Stream::Cuda({s:?})"),
            Stream::Target(_) => f.write_str("Stream::Target(..)"),
        }
    }
}

/// XLA's stream with its context made current for the call (restored on drop).
pub(crate) struct CudaStream {
    stream: CUstream,
    ctx: StreamContext,
}

/// An entered `Stream`: the target the call's launches go to, alive for the call.
pub(crate) enum Entered<'a> {
    Cuda(CudaStream),
    Target(&'a dyn LaunchTarget),
}

impl Entered<'_> {
    pub fn target(&self) -> &dyn LaunchTarget {
        match self {
            Entered::Cuda(s) => s,
            Entered::Target(t) => *t,
        }
    }
}

/// Loads the driver and makes the stream's context current (`Stream::Cuda`), or takes the target.
///
/// # Safety
/// A `Stream::Cuda` holds a live CUstream (or null for the current context's default stream).
pub(crate) unsafe fn enter(stream: Stream<'_>) -> Result<Entered<'_>, AttnError> {
    match stream {
        Stream::Cuda(s) => {
            driver::init()?;
            let stream = s as CUstream;
            Ok(Entered::Cuda(CudaStream { stream, ctx: StreamContext::enter(stream)? }))
        }
        Stream::Target(t) => Ok(Entered::Target(t)),
    }
}

impl LaunchTarget for CudaStream {
    fn compute_capability(&self) -> Result<(i32, i32), AttnError> {
        driver::compute_capability(self.ctx.device)
    }

    fn sm_count(&self) -> Result<u32, AttnError> {
        driver::device_attr(
            self.ctx.device,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "cuDeviceGetAttribute(multiprocessor count)",
        )
        .map(|n| n as u32)
    }

    /// The module is loaded on first use (modules.rs).
    unsafe fn function(&self, file: &'static str, kernel: &'static str, smem: u32) -> Result<KernelHandle, AttnError> {
        let f = modules::get(self.ctx.ctx, self.ctx.device, file)?.function(kernel, smem, self.ctx.device)?;
        Ok(KernelHandle(f as usize))
    }

    unsafe fn launch(&self, f: KernelHandle, kernel: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut [*mut c_void]) -> Result<(), AttnError> {
        check(
            sys::cuLaunchKernel(f.0 as CUfunction, grid.0, grid.1, grid.2, block, 1, 1, smem, self.stream, args.as_mut_ptr(), std::ptr::null_mut()),
            format_args!("cuLaunchKernel({kernel}, grid {grid:?}, block {block}, smem {smem})"),
        )
    }

    unsafe fn encode_tiled(&self, a: &TiledMapArgs) -> Result<TensorMap, AttnError> {
        let what = || format!("cuTensorMapEncodeTiled(dims {:?}, strides {:?}, box {:?})", a.global_dim, a.global_strides, a.box_dim);
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
}
