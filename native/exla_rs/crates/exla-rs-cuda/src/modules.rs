//! Kernel modules, loaded once per (CUDA context, instantiation file): from the embedded fatbin
//! when it has an image for the device, else from an NVRTC compile of the embedded source.

use crate::driver::{self, check, guard, CUcontext, CUdevice, CUfunction, CUmodule};
use crate::embedded;
use crate::target::{check_min_arch, check_smem};
use cudarc::driver::sys;
use exla_rs_attn::AttnError;
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex, OnceLock};

/// A loaded module; its functions are looked up (and given their shared-memory limit) once.
pub struct Module {
    module: CUmodule,
    functions: Mutex<HashMap<&'static str, usize>>, // CUfunction as usize (Send)
}

// SAFETY: CUmodule / CUfunction are driver handles usable from any thread.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// The kernel `name`, allowed `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// The module's context must be current.
    pub unsafe fn function(&self, name: &'static str, smem: u32, device: CUdevice) -> Result<CUfunction, AttnError> {
        let mut f = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&h) = f.get(name) {
            return Ok(h as CUfunction);
        }
        let cname = CString::new(name).unwrap();
        let mut func: CUfunction = std::ptr::null_mut();
        check(sys::cuModuleGetFunction(&mut func, self.module, cname.as_ptr()), format_args!("cuModuleGetFunction({name})"))?;
        if smem > 48 * 1024 {
            // Above 48 KiB a kernel must opt in, up to what the device allows.
            let limit = driver::device_attr(
                device,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "cuDeviceGetAttribute(max shared memory per block)",
            )?;
            check_smem(name, smem, limit as i64)?;
            check(
                sys::cuFuncSetAttribute(
                    func,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                ),
                format!("cuFuncSetAttribute({name}, max dynamic shared memory {smem})"),
            )?;
        }
        f.insert(name, func as usize);
        Ok(func)
    }
}

type Key = (usize, &'static str); // (CUcontext, file)
type Cache = Mutex<HashMap<Key, Result<Arc<Module>, AttnError>>>;

/// The module for `file` in the current context `ctx` (on `device`), loading it on first use.
/// Failures are cached too: a missing image does not trigger a compile per call.
///
/// # Safety
/// `ctx` must be current on this thread.
pub unsafe fn get(ctx: CUcontext, device: CUdevice, file: &'static str) -> Result<Arc<Module>, AttnError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry((ctx as usize, file))
        .or_insert_with(|| guard("loading CUDA kernels", || load(device, file)).map(Arc::new))
        .clone()
}

unsafe fn load(device: CUdevice, file: &'static str) -> Result<Module, AttnError> {
    let k = embedded::find(file).ok_or_else(|| AttnError::internal(format!("kernel file {file} is not embedded")))?;
    let cc = driver::compute_capability(device)?;
    check_min_arch(cc)?;
    let mut fatbin_error = None;
    if let Some(fatbin) = k.fatbin {
        let mut m: CUmodule = std::ptr::null_mut();
        let r = sys::cuModuleLoadData(&mut m, fatbin.as_ptr().cast());
        if r == sys::CUresult::CUDA_SUCCESS {
            return Ok(Module { module: m, functions: Default::default() });
        }
        use sys::CUresult::*;
        // No matching SASS and PTX the driver cannot JIT: try NVRTC; anything else is a failure.
        if !matches!(r, CUDA_ERROR_NO_BINARY_FOR_GPU | CUDA_ERROR_UNSUPPORTED_PTX_VERSION | CUDA_ERROR_INVALID_PTX | CUDA_ERROR_INVALID_IMAGE) {
            return Err(AttnError::internal(format!("cuModuleLoadData({file}) failed: {}", driver::error_name(r))));
        }
        fatbin_error = Some(driver::error_name(r));
    }
    let built = if embedded::TARGETS.is_empty() {
        format!("this build has no nvcc kernels ({})", embedded::BUILD_NOTE.unwrap_or("nvcc absent"))
    } else {
        format!("built for {}: {}", embedded::TARGETS.join(","), fatbin_error.as_deref().unwrap_or("?"))
    };
    let cubin = crate::nvrtc::compile(k, cc).map_err(|e| match e {
        AttnError::Unimplemented(why) => AttnError::unimplemented(format!(
            "no kernel image for sm_{}{} ({built}); NVRTC unavailable: {why}",
            cc.0, cc.1
        )),
        other => other,
    })?;
    let mut m: CUmodule = std::ptr::null_mut();
    check(sys::cuModuleLoadData(&mut m, cubin.as_ptr().cast()), format_args!("cuModuleLoadData({file}, NVRTC cubin)"))?;
    Ok(Module { module: m, functions: Default::default() })
}
