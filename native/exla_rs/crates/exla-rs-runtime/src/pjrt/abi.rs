//! `#[repr(C)]` mirrors of the few PJRT C API structs we touch, from openxla/xla
//! `xla/pjrt/c/pjrt_c_api.h`, `pjrt_c_api_ffi_extension.h` and `pjrt_c_api_gpu_extension.h`.
//!
//! Only the head of `PJRT_Api` is mirrored: the table only grows, and we use nothing past
//! `PJRT_Plugin_Attributes`. Sizes are PJRT's *counted* sizes (`PJRT_STRUCT_SIZE`: offset of
//! the last field plus its size), which is what implementations compare `struct_size` against.

#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void};

/// Opaque `PJRT_Error`.
#[repr(C)]
pub struct PJRT_Error {
    _private: [u8; 0],
}

/// `PJRT_Extension_Base` (PJRT 0.45 and later: `struct_size` first).
#[repr(C)]
pub struct PJRT_Extension_Base {
    pub struct_size: usize,
    pub type_: c_int,
    pub next: *const PJRT_Extension_Base,
}

pub const PJRT_Extension_Type_Gpu_Custom_Call: c_int = 0;
pub const PJRT_Extension_Type_FFI: c_int = 5;

#[repr(C)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *const PJRT_Extension_Base,
    pub major_version: c_int,
    pub minor_version: c_int,
}

#[repr(C)]
pub struct PJRT_Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *const PJRT_Extension_Base,
    pub error: *mut PJRT_Error,
}
pub const PJRT_Error_Destroy_Args_STRUCT_SIZE: usize = 24;

#[repr(C)]
pub struct PJRT_Error_Message_Args {
    pub struct_size: usize,
    pub extension_start: *const PJRT_Extension_Base,
    pub error: *const PJRT_Error,
    pub message: *const c_char,
    pub message_size: usize,
}
pub const PJRT_Error_Message_Args_STRUCT_SIZE: usize = 40;

#[repr(C)]
pub struct PJRT_Error_GetCode_Args {
    pub struct_size: usize,
    pub extension_start: *const PJRT_Extension_Base,
    pub error: *const PJRT_Error,
    pub code: c_int,
}
pub const PJRT_Error_GetCode_Args_STRUCT_SIZE: usize = 28;

#[repr(C)]
pub struct PJRT_Plugin_Initialize_Args {
    pub struct_size: usize,
    pub extension_start: *const PJRT_Extension_Base,
}
pub const PJRT_Plugin_Initialize_Args_STRUCT_SIZE: usize = 16;

pub type PJRT_Error_Destroy = unsafe extern "C" fn(*mut PJRT_Error_Destroy_Args);
pub type PJRT_Error_Message = unsafe extern "C" fn(*mut PJRT_Error_Message_Args);
pub type PJRT_Error_GetCode = unsafe extern "C" fn(*mut PJRT_Error_GetCode_Args) -> *mut PJRT_Error;
pub type PJRT_Plugin_Initialize = unsafe extern "C" fn(*mut PJRT_Plugin_Initialize_Args) -> *mut PJRT_Error;

/// The head of `PJRT_Api`, up to `PJRT_Plugin_Initialize`.
#[repr(C)]
pub struct PJRT_Api_Head {
    pub struct_size: usize,
    pub extension_start: *const PJRT_Extension_Base,
    pub pjrt_api_version: PJRT_Api_Version,
    pub PJRT_Error_Destroy: Option<PJRT_Error_Destroy>,
    pub PJRT_Error_Message: Option<PJRT_Error_Message>,
    pub PJRT_Error_GetCode: Option<PJRT_Error_GetCode>,
    pub PJRT_Plugin_Initialize: Option<PJRT_Plugin_Initialize>,
}
/// Counted size of the part of `PJRT_Api` mirrored above.
pub const PJRT_Api_Head_STRUCT_SIZE: usize = 72;

pub type PJRT_GetPjrtApi = unsafe extern "C" fn() -> *const PJRT_Api_Head;

// --------------------------------------------------------------------------------------------
// FFI extension (type 5)
// --------------------------------------------------------------------------------------------

pub type PJRT_FFI_Register_Handler = unsafe extern "C" fn(args: *mut c_void) -> *mut PJRT_Error;

/// `PJRT_FFI_Extension`. `register_handler` was added after the first version; check the
/// extension's `struct_size` (>= [`PJRT_FFI_Extension_STRUCT_SIZE`]) before reading it.
#[repr(C)]
pub struct PJRT_FFI_Extension {
    pub base: PJRT_Extension_Base,
    pub type_id_register: *const c_void,
    pub user_data_add: *const c_void,
    pub register_handler: Option<PJRT_FFI_Register_Handler>,
}
pub const PJRT_FFI_Extension_STRUCT_SIZE: usize = 48;

/// `PJRT_FFI_Register_Handler_Args` with `api_version` (0 untyped, 1 typed), in XLA until 2025.
/// Counted size 40 while the header named `handler` as the last field, 60 once `traits` came.
#[repr(C)]
pub struct PJRT_FFI_Register_Handler_Args_WithApiVersion {
    pub struct_size: usize,
    pub target_name: *const c_char,
    pub target_name_size: usize,
    pub api_version: c_int,
    pub handler: *mut c_void,
    pub platform_name: *const c_char,
    pub platform_name_size: usize,
    pub traits: u32,
}

/// `PJRT_FFI_Register_Handler_Args` without `api_version` (typed handlers only): counted size 52.
/// What the PJRT 0.115 CPU plugin (jaxlib 0.11 era) expects.
#[repr(C)]
pub struct PJRT_FFI_Register_Handler_Args_TypedOnly {
    pub struct_size: usize,
    pub target_name: *const c_char,
    pub target_name_size: usize,
    pub handler: *mut c_void,
    pub platform_name: *const c_char,
    pub platform_name_size: usize,
    pub traits: u32,
}

// --------------------------------------------------------------------------------------------
// GPU custom-call extension (type 0)
// --------------------------------------------------------------------------------------------

pub type PJRT_Gpu_Register_Custom_Call = unsafe extern "C" fn(args: *mut c_void) -> *mut PJRT_Error;

#[repr(C)]
pub struct PJRT_Gpu_Custom_Call {
    pub base: PJRT_Extension_Base,
    pub custom_call: Option<PJRT_Gpu_Register_Custom_Call>,
}
pub const PJRT_Gpu_Custom_Call_STRUCT_SIZE: usize = 32;

/// `PJRT_Gpu_Register_Custom_Call_Args`: extension version 1 ends at `custom_call_function`
/// (counted size 40); version 2 replaced it by four stage handlers (64); version 3 added `traits`
/// (68). Version 1's `custom_call_function` sits where version 2 has `handler_instantiate`.
#[repr(C)]
pub struct PJRT_Gpu_Register_Custom_Call_Args {
    pub struct_size: usize,
    pub function_name: *const c_char,
    pub function_name_size: usize,
    pub api_version: c_int,
    pub handler_instantiate_or_v1_function: *mut c_void,
    pub handler_prepare: *mut c_void,
    pub handler_initialize: *mut c_void,
    pub handler_execute: *mut c_void,
    pub traits: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    /// Offsets and counted sizes, field by field, as the headers define them.
    #[test]
    fn layouts_match_the_headers() {
        assert_eq!(offset_of!(PJRT_Api_Head, pjrt_api_version), 16);
        assert_eq!(offset_of!(PJRT_Api_Head, PJRT_Error_Destroy), 40);
        assert_eq!(offset_of!(PJRT_Api_Head, PJRT_Plugin_Initialize), 64);
        assert_eq!(offset_of!(PJRT_Api_Head, PJRT_Plugin_Initialize) + 8, PJRT_Api_Head_STRUCT_SIZE);
        assert_eq!(offset_of!(PJRT_Api_Version, minor_version), 20);
        assert_eq!(offset_of!(PJRT_Error_Message_Args, message_size) + 8, PJRT_Error_Message_Args_STRUCT_SIZE);
        assert_eq!(offset_of!(PJRT_Error_GetCode_Args, code) + 4, PJRT_Error_GetCode_Args_STRUCT_SIZE);
        assert_eq!(offset_of!(PJRT_FFI_Extension, register_handler) + 8, PJRT_FFI_Extension_STRUCT_SIZE);

        type A = PJRT_FFI_Register_Handler_Args_WithApiVersion;
        assert_eq!(offset_of!(A, api_version), 24);
        assert_eq!(offset_of!(A, handler) + 8, 40);
        assert_eq!(offset_of!(A, traits) + 4, 60);
        type B = PJRT_FFI_Register_Handler_Args_TypedOnly;
        assert_eq!(offset_of!(B, handler), 24);
        assert_eq!(offset_of!(B, platform_name_size), 40);
        assert_eq!(offset_of!(B, traits) + 4, 52);

        type G = PJRT_Gpu_Register_Custom_Call_Args;
        assert_eq!(offset_of!(G, handler_instantiate_or_v1_function) + 8, 40);
        assert_eq!(offset_of!(G, handler_execute) + 8, 64);
        assert_eq!(offset_of!(G, traits) + 4, 68);
        assert_eq!(offset_of!(PJRT_Gpu_Custom_Call, custom_call) + 8, PJRT_Gpu_Custom_Call_STRUCT_SIZE);
    }
}
