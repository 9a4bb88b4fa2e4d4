//! The CUDA driver, loaded at first use. cudarc's dynamic loader panics when libcuda (or one of its
//! symbols) is missing, so every entry goes through `guard`, which checks the library is there
//! first and turns any panic into an error: nothing here may unwind into XLA.

use cudarc::driver::sys;
use exla_rs_attn::AttnError;
use std::ffi::CStr;
use std::sync::OnceLock;

pub use sys::{CUcontext, CUdevice, CUfunction, CUmodule, CUresult, CUstream};

/// Runs `f` with panics turned into `AttnError::Internal`.
pub fn guard<R>(what: &str, f: impl FnOnce() -> Result<R, AttnError>) -> Result<R, AttnError> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(AttnError::internal(format!("{what}: panic in the CUDA layer: {msg}")))
        }
    }
}

/// libcuda loaded and `cuInit` done, or why not (cached: both are process-wide).
pub fn init() -> Result<(), AttnError> {
    static INIT: OnceLock<Result<(), String>> = OnceLock::new();
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver (libcuda.so not found): install the NVIDIA driver or add its directory to LD_LIBRARY_PATH".into());
        }
        let r = guard("cuInit", || {
            // SAFETY: cuInit takes flags 0 and may be called any number of times.
            check(unsafe { sys::cuInit(0) }, "cuInit")
        });
        r.map_err(|e| format!("CUDA driver present but unusable: {e}"))
    })
    .clone()
    .map_err(AttnError::unimplemented)
}

/// The driver's name for an error code, e.g. `CUDA_ERROR_NO_BINARY_FOR_GPU`.
pub fn error_name(r: CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a pointer to a static string or fails.
    let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

/// Ok for CUDA_SUCCESS, else Internal naming the call.
/// `call` is only formatted on failure: pass `format_args!` on per-launch paths.
pub fn check(r: CUresult, call: impl std::fmt::Display) -> Result<(), AttnError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(AttnError::internal(format!("{call} failed: {}", error_name(r))))
    }
}

pub fn device_attr(dev: CUdevice, attr: sys::CUdevice_attribute, what: &str) -> Result<i32, AttnError> {
    let mut v = 0;
    // SAFETY: plain query into a local.
    check(unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) }, what)?;
    Ok(v)
}

pub fn compute_capability(dev: CUdevice) -> Result<(i32, i32), AttnError> {
    use sys::CUdevice_attribute::*;
    Ok((
        device_attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cuDeviceGetAttribute(cc major)")?,
        device_attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cuDeviceGetAttribute(cc minor)")?,
    ))
}

/// Makes the context that owns XLA's stream current for the life of the value (kernels and
/// modules belong to a context; XLA's thread may have another one, or none, current).
pub struct StreamContext {
    pub ctx: CUcontext,
    pub device: CUdevice,
    pushed: bool,
}

impl StreamContext {
    /// # Safety
    /// `stream` must be a live CUstream (or null for the current context's default stream).
    pub unsafe fn enter(stream: CUstream) -> Result<Self, AttnError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        check(sys::cuStreamGetCtx(stream, &mut ctx), "cuStreamGetCtx(XLA's stream)")?;
        if ctx.is_null() {
            return Err(AttnError::internal("XLA's stream belongs to no CUDA context"));
        }
        let mut current: CUcontext = std::ptr::null_mut();
        check(sys::cuCtxGetCurrent(&mut current), "cuCtxGetCurrent")?;
        let pushed = current != ctx;
        if pushed {
            check(sys::cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")?;
        }
        let mut this = Self { ctx, device: 0, pushed };
        check(sys::cuCtxGetDevice(&mut this.device), "cuCtxGetDevice")?;
        Ok(this)
    }
}

impl Drop for StreamContext {
    fn drop(&mut self) {
        if self.pushed {
            let mut popped: CUcontext = std::ptr::null_mut();
            // SAFETY: pops exactly what `enter` pushed on this thread. A failure leaves the
            // context current, which is harmless for XLA (it sets its own before each use).
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }));
        }
    }
}
