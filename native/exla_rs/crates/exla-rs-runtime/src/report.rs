//! What a registration pass found and did, per runtime: the data `ExlaRs.status/0` shows.

use xla_ffi::ApiVersion;

/// The two kinds of XLA runtime we can register into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuntimeKind {
    /// EXLA's `libxla_extension.so` (EXLA's `:host` and `:cuda` clients).
    XlaExtension,
    /// A PJRT plugin: a shared object exporting `GetPjrtApi`.
    PjrtPlugin,
}

impl RuntimeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::XlaExtension => "xla_extension",
            Self::PjrtPlugin => "pjrt_plugin",
        }
    }
}

/// The outcome for one target on one platform.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub target: String,
    pub platform: String,
    /// `Ok` when XLA accepted it (or, where `RuntimeReport::verified` is false, when the route
    /// we used reported no error); otherwise the runtime's or our reason.
    pub result: Result<(), String>,
}

/// One XLA runtime in the process and what we did there.
#[derive(Clone, Debug)]
pub struct RuntimeReport {
    pub kind: RuntimeKind,
    pub path: String,
    /// The runtime's own XLA FFI API version, when we could read it.
    pub ffi_api_version: Option<ApiVersion>,
    /// PJRT plugins: the plugin's PJRT C API version.
    pub pjrt_api_version: Option<ApiVersion>,
    /// How we registered (symbol, extension, argument layout), for humans.
    pub route: Option<String>,
    /// Whether the results are XLA's own answers (`XLA_FFI_Handler_Register`) rather than only
    /// a PJRT wrapper's, which may discard XLA's error.
    pub verified: bool,
    pub registrations: Vec<Registration>,
    /// Set when nothing could be registered in this runtime at all.
    pub error: Option<String>,
}

impl RuntimeReport {
    pub fn new(kind: RuntimeKind, path: impl Into<String>) -> Self {
        Self {
            kind,
            path: path.into(),
            ffi_api_version: None,
            pjrt_api_version: None,
            route: None,
            verified: false,
            registrations: Vec::new(),
            error: None,
        }
    }

    pub fn failed(mut self, error: impl Into<String>) -> Self {
        self.error = Some(error.into());
        self
    }

    /// `"registered"` (every target accepted), `"partial"`, `"failed"`, or `"found"` (not tried).
    pub fn state(&self) -> &'static str {
        let ok = self.registrations.iter().filter(|r| r.result.is_ok()).count();
        if self.error.is_some() || (ok == 0 && !self.registrations.is_empty()) {
            "failed"
        } else if self.registrations.is_empty() {
            "found"
        } else if ok == self.registrations.len() {
            "registered"
        } else {
            "partial"
        }
    }

    pub fn registered(&self, target: &str, platform: &str) -> bool {
        self.registrations.iter().any(|r| r.target == target && r.platform == platform && r.result.is_ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(ok: bool) -> Registration {
        Registration { target: "t".into(), platform: "Host".into(), result: if ok { Ok(()) } else { Err("no".into()) } }
    }

    #[test]
    fn states() {
        let mut r = RuntimeReport::new(RuntimeKind::PjrtPlugin, "/x.so");
        assert_eq!(r.state(), "found");
        r.registrations = vec![reg(true), reg(true)];
        assert_eq!(r.state(), "registered");
        assert!(r.registered("t", "Host"));
        r.registrations = vec![reg(true), reg(false)];
        assert_eq!(r.state(), "partial");
        r.registrations = vec![reg(false)];
        assert_eq!(r.state(), "failed");
        assert_eq!(RuntimeReport::new(RuntimeKind::XlaExtension, "/y.so").failed("boom").state(), "failed");
    }
}
