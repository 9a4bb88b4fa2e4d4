//! Run-time compilation with NVRTC: used when the build had no nvcc, or its fatbins hold no image
//! the GPU can run. Results are cached per (file, architecture) for the life of the process.

use crate::driver::guard;
use crate::embedded::{KernelFile, KernelSet};
use cudarc::nvrtc::sys;
use exla_rs_attn::AttnError;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// libnvrtc is often not on the loader path (pip wheels, CUDA_HOME/lib): open it by full path
/// first (RTLD_GLOBAL), so cudarc's later open by soname finds the already loaded copy.
fn preload() {
    let mut candidates: Vec<std::path::PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("EXLA_RS_NVRTC") {
        candidates.push(p.into());
    }
    for v in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(v) {
            let home = std::path::PathBuf::from(home);
            for lib in ["lib/libnvrtc.so.13", "lib64/libnvrtc.so.13", "lib/libnvrtc.so", "lib64/libnvrtc.so"] {
                candidates.push(home.join(lib));
            }
        }
    }
    let open = |p: &std::path::Path| -> bool {
        let Ok(path) = CString::new(p.as_os_str().as_encoded_bytes()) else { return false };
        // SAFETY: dlopen of a library path; the handle is kept open for the process lifetime.
        !unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
    };
    for c in candidates.iter().filter(|c| c.is_file()) {
        // NVRTC dlopens its builtins library by soname at compile time; outside the loader path
        // that fails ("failed to open libnvrtc-builtins.so.13.0") unless it is already loaded.
        if let Some(dir) = c.parent() {
            let mut builtins: Vec<_> = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    let n = p.file_name().unwrap_or_default().to_string_lossy();
                    n.starts_with("libnvrtc-builtins.so") && !n.contains(".alt.")
                })
                .collect();
            builtins.sort();
            for b in builtins.iter().rev() {
                if open(b) {
                    break;
                }
            }
        }
        if open(c) {
            return;
        }
    }
}

/// NVRTC usable, or why not.
pub fn available() -> Result<(), String> {
    static AVAIL: OnceLock<Result<(), String>> = OnceLock::new();
    AVAIL
        .get_or_init(|| {
            preload();
            // SAFETY: only probes whether the library can be opened.
            if unsafe { sys::is_culib_present() } {
                Ok(())
            } else {
                Err("libnvrtc not found (install CUDA's NVRTC, e.g. pip nvidia-cuda-nvrtc, and set EXLA_RS_NVRTC to libnvrtc.so.13 or CUDA_HOME)".into())
            }
        })
        .clone()
}

type Cache = Mutex<HashMap<(&'static str, (i32, i32)), Result<Arc<Vec<u8>>, AttnError>>>;

/// A cubin of `file` for compute capability `cc`.
pub fn compile(file: &'static KernelFile, cc: (i32, i32)) -> Result<Arc<Vec<u8>>, AttnError> {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Held while compiling: concurrent first calls wait instead of compiling twice.
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry((file.name, cc))
        .or_insert_with(|| {
            available().map_err(AttnError::unimplemented)?;
            guard("NVRTC", || compile_uncached(file, cc)).map(Arc::new)
        })
        .clone()
}

fn nvrtc_error(r: sys::nvrtcResult) -> String {
    // SAFETY: returns a static string.
    let p = unsafe { sys::nvrtcGetErrorString(r) };
    if p.is_null() {
        format!("{r:?}")
    } else {
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

fn compile_uncached(file: &KernelFile, cc: (i32, i32)) -> Result<Vec<u8>, AttnError> {
    use sys::nvrtcResult::NVRTC_SUCCESS;
    let fail = |what: &str, r: sys::nvrtcResult| AttnError::internal(format!("NVRTC {what} ({}): {}", file.name, nvrtc_error(r)));
    let src = CString::new(file.source).map_err(|_| AttnError::internal("kernel source contains NUL"))?;
    let name = CString::new(format!("{}.cu", file.name)).unwrap();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers (the sources are self-contained).
    let r = unsafe { sys::nvrtcCreateProgram(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) };
    if r != NVRTC_SUCCESS {
        return Err(fail("nvrtcCreateProgram", r));
    }
    // The sm_90a set uses wgmma/setmaxnreg: architecture-specific code, for 9.0 only.
    let arch = match file.set {
        KernelSet::MmaSync => format!("sm_{}{}", cc.0, cc.1),
        KernelSet::Sm90a if cc == (9, 0) => "sm_90a".to_string(),
        KernelSet::Sm90a => {
            return Err(AttnError::unimplemented(format!(
                "{} is sm_90a code; this device has compute capability {}.{}",
                file.name, cc.0, cc.1
            )))
        }
    };
    let opts: Vec<CString> = [format!("--gpu-architecture={arch}"), "-std=c++17".into(), "-lineinfo".into()]
        .into_iter()
        .map(|s| CString::new(s).unwrap())
        .collect();
    let ptrs: Vec<*const std::ffi::c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: prog is live until destroyed below; options outlive the call.
    let result = unsafe {
        let r = sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
        let out = if r != NVRTC_SUCCESS {
            let mut n = 0usize;
            sys::nvrtcGetProgramLogSize(prog, &mut n);
            let mut log = vec![0u8; n.max(1)];
            sys::nvrtcGetProgramLog(prog, log.as_mut_ptr().cast());
            let log = String::from_utf8_lossy(&log).trim_end_matches('\0').to_string();
            Err(AttnError::internal(format!(
                "NVRTC could not compile {} for sm_{}{}: {}\n{log}",
                file.name,
                cc.0,
                cc.1,
                nvrtc_error(r)
            )))
        } else {
            let mut n = 0usize;
            let r = sys::nvrtcGetCUBINSize(prog, &mut n);
            if r != NVRTC_SUCCESS {
                Err(fail("nvrtcGetCUBINSize", r))
            } else {
                let mut cubin = vec![0u8; n];
                let r = sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
                if r != NVRTC_SUCCESS {
                    Err(fail("nvrtcGetCUBIN", r))
                } else {
                    Ok(cubin)
                }
            }
        };
        sys::nvrtcDestroyProgram(&mut prog);
        out
    };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles real kernels with NVRTC (no GPU needed) when libnvrtc can be found: the run-time
    /// path of builds without nvcc. With scripts/env.sh sourced, CUDA_HOME points at the pip NVRTC.
    #[test]
    fn nvrtc_compiles_the_embedded_sources_or_says_why_not() {
        if let Err(why) = available() {
            assert!(why.contains("libnvrtc"), "{why}");
            eprintln!("skipping the NVRTC compile: {why}");
            return;
        }
        for (file, cc) in [
            ("aux", (8, 0)),
            ("fwd_bf16_d64", (9, 0)),
            ("bwd_f16_d96", (8, 6)),
            ("f32_d32", (8, 0)),
            ("sm90_fwd_bf16_d128", (9, 0)),
            ("sm90_bwd_f16_d64", (9, 0)),
        ] {
            let k = crate::embedded::find(file).unwrap();
            let cubin = compile(k, cc).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(&cubin[..4], b"\x7fELF", "{file} sm_{}{}: not a cubin", cc.0, cc.1);
            let again = compile(k, cc).unwrap();
            assert!(Arc::ptr_eq(&cubin, &again), "compiled twice");
        }
        // sm_90a code is refused for any other device, before NVRTC runs.
        let k = crate::embedded::find("sm90_fwd_f16_d64").unwrap();
        let e = compile(k, (8, 9)).unwrap_err().to_string();
        assert!(e.contains("sm_90a") && e.contains("8.9"), "{e}");
    }
}
