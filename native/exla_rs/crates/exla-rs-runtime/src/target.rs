//! What gets registered: a target name, a platform, and the handler function.

use xla_ffi::ApiVersion;
use xla_ffi_sys as sys;

/// One handler to register under `name` for `platform` (`"Host"` or `"CUDA"`).
#[derive(Clone, Copy)]
pub struct HandlerTarget {
    pub name: &'static str,
    pub platform: &'static str,
    pub handler: sys::XLA_FFI_Handler,
}

impl std::fmt::Debug for HandlerTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.platform)
    }
}

/// Everything a registration pass needs to know about our handlers.
#[derive(Clone, Debug)]
pub struct HandlerSet {
    pub targets: Vec<HandlerTarget>,
    /// The FFI API version the handlers report in XLA's metadata probe.
    pub api_version: ApiVersion,
}

impl HandlerSet {
    pub fn is_cuda(platform: &str) -> bool {
        platform.eq_ignore_ascii_case("cuda") || platform.eq_ignore_ascii_case("gpu")
    }
}
