//! A plugin's `PJRT_Api` table: version, errors, initialisation, the extension chain.

use std::ffi::c_int;

use xla_ffi::ApiVersion;

use super::abi::*;

/// The newest PJRT major version whose table head we know.
pub const SUPPORTED_MAJOR: i32 = 0;
/// `PJRT_Extension_Base.struct_size` exists from PJRT 0.45 on; older extension chains are unsafe
/// to walk with this layout.
pub const MIN_MINOR: i32 = 45;
/// Extension chains are short (six in the 0.115 CPU plugin); stop at this many in case of a cycle.
const MAX_EXTENSIONS: usize = 64;

/// A borrowed `PJRT_Api`, checked to be one we can read.
#[derive(Clone, Copy)]
pub struct PjrtApi {
    raw: &'static PJRT_Api_Head,
}

// SAFETY: the table is immutable static data of a loaded plugin.
unsafe impl Send for PjrtApi {}

/// An error a PJRT call returned, read and destroyed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PjrtError {
    /// The absl status code (`PJRT_Error_Code`), when the plugin tells.
    pub code: Option<i32>,
    pub message: String,
}

impl std::fmt::Display for PjrtError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.code {
            Some(c) => write!(f, "PJRT error (code {c}): {}", self.message),
            None => write!(f, "PJRT error: {}", self.message),
        }
    }
}

impl PjrtApi {
    /// Checks `ptr` (what `GetPjrtApi()` returned) and wraps it.
    ///
    /// # Safety
    /// `ptr` must be NULL or point to a plugin's `PJRT_Api`, alive for the rest of the process.
    pub unsafe fn from_ptr(ptr: *const PJRT_Api_Head) -> Result<Self, String> {
        let raw = ptr.as_ref().ok_or("GetPjrtApi() returned NULL")?;
        let api = Self { raw };
        let v = api.version();
        if raw.struct_size < PJRT_Api_Head_STRUCT_SIZE {
            return Err(format!("PJRT_Api is only {} bytes (PJRT {v}); expected at least {PJRT_Api_Head_STRUCT_SIZE}", raw.struct_size));
        }
        if v.major != SUPPORTED_MAJOR || v.minor < MIN_MINOR {
            return Err(format!("PJRT C API {v} is not supported (exla_rs reads 0.{MIN_MINOR} and later 0.x)"));
        }
        Ok(api)
    }

    pub fn version(&self) -> ApiVersion {
        ApiVersion::new(self.raw.pjrt_api_version.major_version, self.raw.pjrt_api_version.minor_version)
    }

    pub fn as_ptr(&self) -> *const PJRT_Api_Head {
        self.raw
    }

    /// `PJRT_Plugin_Initialize`: once, by whoever loaded the plugin, before other calls.
    pub fn initialize(&self) -> Result<(), PjrtError> {
        let Some(init) = self.raw.PJRT_Plugin_Initialize else { return Ok(()) };
        let mut args = PJRT_Plugin_Initialize_Args {
            struct_size: PJRT_Plugin_Initialize_Args_STRUCT_SIZE,
            extension_start: std::ptr::null(),
        };
        // SAFETY: args is initialised and outlives the call.
        self.check(unsafe { init(&mut args) })
    }

    /// `Ok` for NULL, otherwise the error's code and message (the error is destroyed).
    pub fn check(&self, err: *mut PJRT_Error) -> Result<(), PjrtError> {
        if err.is_null() {
            return Ok(());
        }
        let mut message = String::from("(the plugin gave no message)");
        let mut code = None;
        // SAFETY: err is a live error of this plugin; each args struct outlives its call.
        unsafe {
            if let Some(get_message) = self.raw.PJRT_Error_Message {
                let mut args = PJRT_Error_Message_Args {
                    struct_size: PJRT_Error_Message_Args_STRUCT_SIZE,
                    extension_start: std::ptr::null(),
                    error: err,
                    message: std::ptr::null(),
                    message_size: 0,
                };
                get_message(&mut args);
                if !args.message.is_null() {
                    let bytes = std::slice::from_raw_parts(args.message as *const u8, args.message_size);
                    message = String::from_utf8_lossy(bytes).into_owned();
                }
            }
            if let Some(get_code) = self.raw.PJRT_Error_GetCode {
                let mut args = PJRT_Error_GetCode_Args {
                    struct_size: PJRT_Error_GetCode_Args_STRUCT_SIZE,
                    extension_start: std::ptr::null(),
                    error: err,
                    code: 0,
                };
                if get_code(&mut args).is_null() {
                    code = Some(args.code);
                }
            }
            if let Some(destroy) = self.raw.PJRT_Error_Destroy {
                let mut args = PJRT_Error_Destroy_Args {
                    struct_size: PJRT_Error_Destroy_Args_STRUCT_SIZE,
                    extension_start: std::ptr::null(),
                    error: err,
                };
                destroy(&mut args);
            }
        }
        Err(PjrtError { code, message })
    }

    /// The first extension of `type_` in the chain, with its declared `struct_size`.
    pub fn extension(&self, type_: c_int) -> Option<&'static PJRT_Extension_Base> {
        let mut next = self.raw.extension_start;
        for _ in 0..MAX_EXTENSIONS {
            // SAFETY: the chain is the plugin's static data, NULL-terminated.
            let ext = unsafe { next.as_ref()? };
            if ext.type_ == type_ {
                return Some(ext);
            }
            next = ext.next;
        }
        None
    }

    /// The types in the extension chain, in order (for status).
    pub fn extension_types(&self) -> Vec<i32> {
        let mut out = Vec::new();
        let mut next = self.raw.extension_start;
        while out.len() < MAX_EXTENSIONS {
            // SAFETY: as in `extension`.
            let Some(ext) = (unsafe { next.as_ref() }) else { break };
            out.push(ext.type_);
            next = ext.next;
        }
        out
    }
}
