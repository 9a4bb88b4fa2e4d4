//! Errors in both directions: ours turned into `XLA_FFI_Error*` for XLA, and XLA's read back
//! (registration answers).

use std::ffi::{CStr, CString};

use xla_ffi_sys as sys;

use crate::{api_slot, Api};

/// The absl status codes XLA uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    Cancelled,
    Unknown,
    InvalidArgument,
    NotFound,
    AlreadyExists,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    /// Any other code a runtime reports.
    Other(i32),
}

impl ErrorCode {
    pub fn to_raw(self) -> sys::XLA_FFI_Error_Code {
        match self {
            Self::Cancelled => sys::XLA_FFI_Error_Code_CANCELLED,
            Self::Unknown => sys::XLA_FFI_Error_Code_UNKNOWN,
            Self::InvalidArgument => sys::XLA_FFI_Error_Code_INVALID_ARGUMENT,
            Self::NotFound => sys::XLA_FFI_Error_Code_NOT_FOUND,
            Self::AlreadyExists => sys::XLA_FFI_Error_Code_ALREADY_EXISTS,
            Self::ResourceExhausted => sys::XLA_FFI_Error_Code_RESOURCE_EXHAUSTED,
            Self::FailedPrecondition => sys::XLA_FFI_Error_Code_FAILED_PRECONDITION,
            Self::Unimplemented => sys::XLA_FFI_Error_Code_UNIMPLEMENTED,
            Self::Internal => sys::XLA_FFI_Error_Code_INTERNAL,
            Self::Unavailable => sys::XLA_FFI_Error_Code_UNAVAILABLE,
            Self::Other(c) => c,
        }
    }

    pub fn from_raw(code: sys::XLA_FFI_Error_Code) -> Self {
        match code {
            sys::XLA_FFI_Error_Code_CANCELLED => Self::Cancelled,
            sys::XLA_FFI_Error_Code_UNKNOWN => Self::Unknown,
            sys::XLA_FFI_Error_Code_INVALID_ARGUMENT => Self::InvalidArgument,
            sys::XLA_FFI_Error_Code_NOT_FOUND => Self::NotFound,
            sys::XLA_FFI_Error_Code_ALREADY_EXISTS => Self::AlreadyExists,
            sys::XLA_FFI_Error_Code_RESOURCE_EXHAUSTED => Self::ResourceExhausted,
            sys::XLA_FFI_Error_Code_FAILED_PRECONDITION => Self::FailedPrecondition,
            sys::XLA_FFI_Error_Code_UNIMPLEMENTED => Self::Unimplemented,
            sys::XLA_FFI_Error_Code_INTERNAL => Self::Internal,
            sys::XLA_FFI_Error_Code_UNAVAILABLE => Self::Unavailable,
            other => Self::Other(other),
        }
    }

    pub fn name(self) -> String {
        match self {
            Self::Cancelled => "CANCELLED".into(),
            Self::Unknown => "UNKNOWN".into(),
            Self::InvalidArgument => "INVALID_ARGUMENT".into(),
            Self::NotFound => "NOT_FOUND".into(),
            Self::AlreadyExists => "ALREADY_EXISTS".into(),
            Self::ResourceExhausted => "RESOURCE_EXHAUSTED".into(),
            Self::FailedPrecondition => "FAILED_PRECONDITION".into(),
            Self::Unimplemented => "UNIMPLEMENTED".into(),
            Self::Internal => "INTERNAL".into(),
            Self::Unavailable => "UNAVAILABLE".into(),
            Self::Other(c) => format!("code {c}"),
        }
    }
}

/// An error with an XLA status code and a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FfiError {
    pub code: ErrorCode,
    pub message: String,
}

impl FfiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self { code, message: message.into() }
    }
    pub fn invalid_argument(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidArgument, message)
    }
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Unimplemented, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    /// Hands the error to XLA as a new `XLA_FFI_Error*` (XLA copies the message and owns the
    /// result). Returns NULL only when the runtime has no `XLA_FFI_Error_Create`, which no
    /// released XLA lacks.
    pub fn into_raw(self, api: Api<'_>) -> *mut sys::XLA_FFI_Error {
        let Some(create) = api_slot!(api, XLA_FFI_Error_Create) else {
            return std::ptr::null_mut();
        };
        // Interior NULs would cut the message short in C; replace them rather than fail.
        let msg = CString::new(self.message.replace('\0', "\\0")).unwrap_or_default();
        let mut args = sys::XLA_FFI_Error_Create_Args {
            struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            message: msg.as_ptr(),
            errc: self.code.to_raw(),
        };
        // SAFETY: `args` is fully initialised and outlives the call; the runtime copies `message`.
        unsafe { create(&mut args) }
    }

    /// Reads and destroys an error a runtime returned (e.g. from `XLA_FFI_Handler_Register`).
    ///
    /// # Safety
    /// `err` must be a live error created by `api`'s runtime; it is destroyed here.
    pub unsafe fn take_raw(api: Api<'_>, err: *mut sys::XLA_FFI_Error, code_hint: ErrorCode) -> Self {
        let mut message = String::from("(the runtime gave no message)");
        if let Some(get) = api_slot!(api, XLA_FFI_Error_GetMessage) {
            let mut args = sys::XLA_FFI_Error_GetMessage_Args {
                struct_size: sys::XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                error: err,
                message: std::ptr::null(),
            };
            get(&mut args);
            if !args.message.is_null() {
                message = CStr::from_ptr(args.message).to_string_lossy().into_owned();
            }
        }
        if let Some(destroy) = api_slot!(api, XLA_FFI_Error_Destroy) {
            let mut args = sys::XLA_FFI_Error_Destroy_Args {
                struct_size: sys::XLA_FFI_Error_Destroy_Args_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                error: err,
            };
            destroy(&mut args);
        }
        // The C API has no accessor for an error's code, so the caller names the likely one.
        Self::new(code_hint, message)
    }
}

impl std::fmt::Display for FfiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.name(), self.message)
    }
}

impl std::error::Error for FfiError {}
