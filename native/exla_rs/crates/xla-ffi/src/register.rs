//! Registering a handler into a runtime's `XLA_FFI_Api`, in the argument layout that API's
//! version expects: FFI 0.1 to 0.3 take a 4-slot handler bundle (counted size 84), 0.4 and later
//! a 5-slot bundle with `record` after `execute` (92). A runtime reads only `struct_size` bytes,
//! so sending the wrong layout would shift `traits` into the bundle.

use xla_ffi_sys as sys;

use crate::{api_slot, Api, ApiVersion, ErrorCode, FfiError};

/// The first API version whose `XLA_FFI_Handler_Register_Args` has the `record` slot.
pub const RECORD_SLOT_SINCE: ApiVersion = ApiVersion::new(0, 4);

fn span(s: &str) -> sys::XLA_FFI_ByteSpan {
    sys::XLA_FFI_ByteSpan { ptr: s.as_ptr() as *const _, len: s.len() }
}

/// Registers `handler` as the execute handler of `target` on `platform` (`"Host"`, `"CUDA"`;
/// XLA matches platforms case-insensitively).
///
/// # Safety
/// `api` must be a live runtime API table; `handler` must stay loaded as long as the runtime.
pub unsafe fn register_handler(
    api: Api<'_>,
    target: &str,
    platform: &str,
    handler: sys::XLA_FFI_Handler,
    traits: sys::XLA_FFI_Handler_Traits,
) -> Result<(), FfiError> {
    let version = api.version();
    if version.major != 0 || version.minor < 1 {
        return Err(FfiError::new(
            ErrorCode::FailedPrecondition,
            format!("unsupported XLA FFI API version {version} (exla_rs knows 0.1 and later 0.x)"),
        ));
    }
    let register = api_slot!(api, XLA_FFI_Handler_Register)
        .ok_or_else(|| FfiError::new(ErrorCode::FailedPrecondition, "the runtime's API table has no XLA_FFI_Handler_Register"))?;

    let err = if version >= RECORD_SLOT_SINCE {
        let mut args = sys::XLA_FFI_Handler_Register_Args_V0_4 {
            struct_size: sys::XLA_FFI_Handler_Register_Args_V0_4_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            name: span(target),
            platform: span(platform),
            bundle: sys::XLA_FFI_Handler_Bundle_V0_4 {
                instantiate: None,
                prepare: None,
                initialize: None,
                execute: Some(handler),
                record: None,
            },
            traits,
        };
        register(&mut args as *mut _ as *mut sys::XLA_FFI_Handler_Register_Args)
    } else {
        let mut args = sys::XLA_FFI_Handler_Register_Args {
            struct_size: sys::XLA_FFI_Handler_Register_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            name: span(target),
            platform: span(platform),
            bundle: sys::XLA_FFI_Handler_Bundle { instantiate: None, prepare: None, initialize: None, execute: Some(handler) },
            traits,
        };
        register(&mut args)
    };
    if err.is_null() {
        Ok(())
    } else {
        Err(FfiError::take_raw(api, err, ErrorCode::Unknown))
    }
}
