//! Getting hold of a PJRT plugin's `XLA_FFI_Api`.
//!
//! A PJRT plugin exports only `GetPjrtApi`; its FFI extension registers handlers but (in the
//! plugins checked, PJRT 0.115) drops XLA's answer on the floor. XLA, though, calls every handler
//! once at registration with a metadata probe, and modern runtimes put their `XLA_FFI_Api*` in
//! that call frame. So we register a tiny probe target through the extension first: its handler
//! answers the probe and records the `api` pointer, and the real targets then go through
//! `XLA_FFI_Handler_Register` on that table, where errors come back.
//!
//! Callers serialize captures (the registry lock); the statics hold the last capture only.

use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use xla_ffi::{Api, ApiVersion, FfiError};
use xla_ffi_sys as sys;

/// The target the probe handler is registered under (Host platform).
pub const PROBE_TARGET: &str = "exla_rs_runtime_api_probe";
/// What the probe handler reports: the oldest version, accepted by every runtime.
pub const PROBE_API_VERSION: ApiVersion = ApiVersion::new(0, 1);

static CALLED: AtomicBool = AtomicBool::new(false);
static API: AtomicPtr<sys::XLA_FFI_Api> = AtomicPtr::new(std::ptr::null_mut());

/// What the last probe saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Captured {
    /// XLA never called the probe handler (an old runtime, or the registration went nowhere).
    NotCalled,
    /// XLA probed but left `api` NULL (runtimes before mid-2025 do).
    CalledWithoutApi,
    Api(*const sys::XLA_FFI_Api),
}

/// Forgets the previous capture; call right before registering the probe.
pub fn reset() {
    CALLED.store(false, Ordering::SeqCst);
    API.store(std::ptr::null_mut(), Ordering::SeqCst);
}

pub fn take() -> Captured {
    let called = CALLED.swap(false, Ordering::SeqCst);
    let api = API.swap(std::ptr::null_mut(), Ordering::SeqCst);
    match (called, api.is_null()) {
        (false, _) => Captured::NotCalled,
        (true, true) => Captured::CalledWithoutApi,
        (true, false) => Captured::Api(api),
    }
}

/// The probe target's handler. Answers the metadata probe and records the frame's `api`; any
/// real call (a program naming this target) is refused with INVALID_ARGUMENT.
///
/// # Safety
/// Called by XLA with a live call frame.
pub unsafe extern "C" fn probe_handler(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    let outcome = std::panic::catch_unwind(|| {
        let Some(frame) = frame.as_ref() else { return std::ptr::null_mut() };
        if xla_ffi::metadata::answer_probe(frame, PROBE_API_VERSION, 0) {
            API.store(frame.api as *mut _, Ordering::SeqCst);
            CALLED.store(true, Ordering::SeqCst);
            return std::ptr::null_mut();
        }
        match Api::from_ptr(frame.api) {
            Some(api) => FfiError::invalid_argument(format!("{PROBE_TARGET} only answers XLA's registration probe; it computes nothing"))
                .into_raw(api),
            None => std::ptr::null_mut(),
        }
    });
    outcome.unwrap_or(std::ptr::null_mut())
}
