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

/// One visible CUDA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: i32,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: u64,
}

/// What the driver says, without creating contexts or loading kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaStatus {
    /// A driver and at least one device with compute capability >= 8.0.
    pub available: bool,
    /// Why not, when not available.
    pub reason: Option<String>,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: Option<i32>,
    pub devices: Vec<CudaDevice>,
    /// Which kernel set runs forward calls on these devices under `EXLA_RS_CUDA_PATH`, and why
    /// (sm90.rs `forward_path_summary`).
    pub forward_path: String,
}

pub fn status() -> CudaStatus {
    let mut st = CudaStatus { available: false, reason: None, driver_version: None, devices: Vec::new(), forward_path: String::new() };
    let r = guard("status", || {
        init()?;
        let mut v = 0;
        // SAFETY: plain queries into locals after cuInit.
        check(unsafe { sys::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
        st.driver_version = Some(v);
        let mut n = 0;
        check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        for ordinal in 0..n {
            let mut dev: CUdevice = 0;
            check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
            let mut name = [0 as std::ffi::c_char; 256];
            check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) }, "cuDeviceGetName")?;
            let mut mem = 0usize;
            check(unsafe { sys::cuDeviceTotalMem_v2(&mut mem, dev) }, "cuDeviceTotalMem")?;
            st.devices.push(CudaDevice {
                ordinal,
                // SAFETY: the driver NUL-terminates within the buffer.
                name: unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned(),
                compute_capability: compute_capability(dev)?,
                total_memory_bytes: mem as u64,
            });
        }
        Ok(())
    });
    let ccs: Vec<(i32, i32)> = st.devices.iter().map(|d| d.compute_capability).collect();
    st.forward_path = crate::sm90::forward_path_summary(crate::sm90::PathOverride::from_env(), &ccs);
    match r {
        Err(e) => st.reason = Some(e.to_string()),
        Ok(()) if st.devices.is_empty() => st.reason = Some("the CUDA driver reports no device".into()),
        Ok(()) => {
            let min = crate::arch::MIN_ARCH;
            let ok = st.devices.iter().any(|d| d.compute_capability >= (min.0 as i32, min.1 as i32));
            st.available = ok;
            if !ok {
                st.reason = Some(format!(
                    "no device with compute capability >= {}.{} (the kernels need sm_80: cp.async, bf16 tensor cores)",
                    min.0, min.1
                ));
            }
        }
    }
    st
}
