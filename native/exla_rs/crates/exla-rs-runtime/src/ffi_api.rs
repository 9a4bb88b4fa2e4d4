//! Registering our handlers straight into a runtime's `XLA_FFI_Api` with
//! `XLA_FFI_Handler_Register`: the route whose answers are XLA's own.

use xla_ffi::{Api, ApiVersion};
use xla_ffi_sys as sys;

use crate::report::Registration;
use crate::target::HandlerSet;
use crate::version_policy;

/// Reads the runtime's FFI API version, checks it accepts our handlers, and registers every
/// target in `handlers` that `skip` does not name. Traits are 0 at registration (a CUDA plugin
/// refuses others); handlers report theirs in the metadata probe.
///
/// # Safety
/// `api` must be NULL or a live `XLA_FFI_Api` that outlives the process' use of the handlers.
pub unsafe fn register_all(
    api: *const sys::XLA_FFI_Api,
    handlers: &HandlerSet,
    skip: impl Fn(&str, &str) -> bool,
) -> Result<(ApiVersion, Vec<Registration>), String> {
    let api = Api::from_ptr(api).ok_or("the runtime returned a NULL XLA_FFI_Api")?;
    let version = api.version();
    version_policy::check(version, handlers.api_version)?;
    let registrations = handlers
        .targets
        .iter()
        .filter(|t| !skip(t.name, t.platform))
        .map(|t| Registration {
            target: t.name.to_string(),
            platform: t.platform.to_string(),
            result: xla_ffi::register::register_handler(api, t.name, t.platform, t.handler, 0).map_err(|e| e.to_string()),
        })
        .collect();
    Ok((version, registrations))
}

/// The FFI API version a table reports, if the pointer is not NULL.
///
/// # Safety
/// As for [`register_all`].
pub unsafe fn version_of(api: *const sys::XLA_FFI_Api) -> Option<ApiVersion> {
    Api::from_ptr(api).map(|a| a.version())
}
