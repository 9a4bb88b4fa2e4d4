//! EXLA's `libxla_extension.so` (EXLA's `:host` and `:cuda` clients).
//!
//! What this path assumes, all checked at run time with a clear reason when it does not hold:
//! - EXLA has loaded `libxla_extension*.so` into the BEAM already (EXLA's NIF links it). We
//!   never load it: `dlopen(path, RTLD_NOW | RTLD_NOLOAD)` only returns the loaded copy.
//! - It exports XLA's C++ getter `xla::ffi::GetXlaFfiApi()`, Itanium-mangled
//!   `_ZN3xla3ffi12GetXlaFfiApiEv`, taking nothing and returning `const XLA_FFI_Api*` (so it is
//!   callable as `extern "C" fn() -> *const XLA_FFI_Api`).
//! - The table's `api_version` is 0.1 or later 0.x; our handlers report 0.1 (see
//!   `version_policy`). `XLA_FFI_Handler_Register` then takes the 84-byte args for 0.1 to 0.3 and
//!   the 92-byte args (with the `record` slot) from 0.4 (`xla_ffi::register`).
//! - Its registry is the one EXLA's clients compile against: handlers registered here for
//!   `Host` and `CUDA` are found when EXLA lowers `stablehlo.custom_call` (api_version 4).

use std::path::Path;

use xla_ffi_sys as sys;

use crate::dylib::Library;
use crate::ffi_api;
use crate::report::{RuntimeKind, RuntimeReport};
use crate::target::HandlerSet;

/// `xla::ffi::GetXlaFfiApi()`, Itanium-mangled.
pub const GETTER_SYMBOL: &str = "_ZN3xla3ffi12GetXlaFfiApiEv";

type GetXlaFfiApi = unsafe extern "C" fn() -> *const sys::XLA_FFI_Api;

/// `libxla_extension.so`, `libxla_extension.so.0`, `libxla_extension-0.9.1.so`, ...
pub fn is_xla_extension(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("libxla_extension"))
}

/// The runtime's `XLA_FFI_Api`, or why we cannot get it.
pub fn ffi_api(lib: &Library, path: &Path) -> Result<*const sys::XLA_FFI_Api, String> {
    let sym = lib.symbol(GETTER_SYMBOL).ok_or_else(|| {
        format!("{} does not export xla::ffi::GetXlaFfiApi() ({GETTER_SYMBOL}); this XLA build cannot take FFI handlers from outside", path.display())
    })?;
    // SAFETY: the symbol is XLA's getter (assumption documented above): no arguments, returns a pointer.
    let getter: GetXlaFfiApi = unsafe { std::mem::transmute(sym) };
    let api = unsafe { getter() };
    if api.is_null() {
        return Err("xla::ffi::GetXlaFfiApi() returned NULL".into());
    }
    Ok(api)
}

/// Registers `handlers` (minus those `skip` names) into the already-loaded library at `path`.
pub fn register(path: &Path, handlers: &HandlerSet, skip: impl Fn(&str, &str) -> bool) -> RuntimeReport {
    let report = RuntimeReport::new(RuntimeKind::XlaExtension, path.display().to_string());
    let lib = match Library::open_loaded(path) {
        Ok(lib) => lib,
        Err(e) => return report.failed(format!("{e}: start :exla (and create a client) first")),
    };
    let api = match ffi_api(&lib, path) {
        Ok(api) => api,
        Err(e) => return report.failed(e),
    };
    register_into(api, report, handlers, skip)
}

/// The part after the symbol lookup. `api` is what the runtime's getter returned (non-NULL).
fn register_into(api: *const sys::XLA_FFI_Api, mut report: RuntimeReport, handlers: &HandlerSet, skip: impl Fn(&str, &str) -> bool) -> RuntimeReport {
    report.route = Some(format!("{GETTER_SYMBOL} -> XLA_FFI_Handler_Register"));
    // SAFETY: api came from the runtime's getter and lives as long as the library.
    report.ffi_api_version = unsafe { ffi_api::version_of(api) };
    match unsafe { ffi_api::register_all(api, handlers, skip) } {
        Ok((_, registrations)) => {
            report.verified = true;
            report.registrations = registrations;
            report
        }
        Err(e) => report.failed(e),
    }
}
