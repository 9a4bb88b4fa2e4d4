//! The wrapper every exported handler runs its body through: answers the metadata probe,
//! decodes the frame, and turns `Err`s and Rust panics into `XLA_FFI_Error`s. A handler built on
//! it never unwinds into XLA and never aborts the process.

use std::panic::{catch_unwind, AssertUnwindSafe};

use xla_ffi_sys as sys;

use crate::{metadata, ApiVersion, CallFrame, FfiError, Stage};

/// What a handler reports at registration, and its name for messages.
#[derive(Clone, Copy, Debug)]
pub struct HandlerInfo {
    /// Target name, e.g. `exla_rs_flash_attn_fwd`.
    pub target: &'static str,
    /// FFI API version reported to the metadata probe.
    pub version: ApiVersion,
    /// `XLA_FFI_Handler_Traits` reported to the metadata probe.
    pub traits: sys::XLA_FFI_Handler_Traits,
}

/// Runs `body` for an EXECUTE-stage call of the handler described by `info`.
///
/// # Safety
/// `frame` must be NULL or the call frame XLA passed to the handler.
pub unsafe fn run_handler<F>(frame: *mut sys::XLA_FFI_CallFrame, info: &HandlerInfo, body: F) -> *mut sys::XLA_FFI_Error
where
    F: FnOnce(&CallFrame<'_>) -> Result<(), FfiError>,
{
    let Some(raw) = frame.as_ref() else {
        return std::ptr::null_mut();
    };
    if metadata::answer_probe(raw, info.version, info.traits) {
        return std::ptr::null_mut();
    }
    let cf = match CallFrame::from_raw(raw, info.target) {
        Ok(cf) => cf,
        Err(e) => {
            // Without an API table there is no way to create an XLA error; no runtime calls a
            // handler this way outside the probe, so say so loudly rather than abort.
            eprintln!("exla_rs: {e}");
            return std::ptr::null_mut();
        }
    };
    // We register only an execute handler; other stages have nothing to do.
    if cf.stage() != Stage::Execute {
        return std::ptr::null_mut();
    }
    let outcome = catch_unwind(AssertUnwindSafe(|| body(&cf)));
    let err = match outcome {
        Ok(Ok(())) => return std::ptr::null_mut(),
        Ok(Err(e)) => e,
        Err(panic) => FfiError::internal(format!("{}: internal error (Rust panic: {})", info.target, panic_message(&panic))),
    };
    err.into_raw(cf.api())
}

/// The message of a caught panic payload.
pub fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
