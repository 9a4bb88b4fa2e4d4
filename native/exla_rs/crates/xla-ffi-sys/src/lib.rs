//! Raw `#[repr(C)]` mirror of the parts of XLA's FFI C API (`xla/ffi/api/c_api.h`) that exla_rs
//! uses, written from the published header (FFI API 0.1 to 0.4; jaxlib ships it under
//! `jaxlib/include/xla/ffi/api/c_api.h`).
//!
//! Like `pyo3-ffi` next to `pyo3`, this crate is only declarations: no logic, no safety. The safe
//! layer is the `xla-ffi` crate. C enums are mirrored as `i32` aliases plus constants, never as Rust
//! enums, because XLA may hand us values a newer header added and an unknown Rust enum
//! discriminant would be undefined behaviour.
//!
//! `*_STRUCT_SIZE` constants are XLA's *counted* sizes (`offsetof(last field) + sizeof(last
//! field)`, the `XLA_FFI_STRUCT_SIZE` macro), not Rust's padded `size_of`. `tests/c_layout.rs`
//! compiles a C program against the real header and compares every size and offset used here.
#![allow(non_camel_case_types, non_snake_case, non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_void};

/// `XLA_FFI_STRUCT_SIZE(T, field)`: offset of the last field plus its size.
#[macro_export]
macro_rules! counted_size {
    ($ty:ty, $field:ident: $fty:ty) => {
        ::core::mem::offset_of!($ty, $field) + ::core::mem::size_of::<$fty>()
    };
}

// ---------------------------------------------------------------------------------------------
// Versions and extensions
// ---------------------------------------------------------------------------------------------

pub type XLA_FFI_Extension_Type = c_int;
pub const XLA_FFI_Extension_Metadata: XLA_FFI_Extension_Type = 1;

#[repr(C)]
#[derive(Debug)]
pub struct XLA_FFI_Extension_Base {
    pub struct_size: usize,
    pub type_: XLA_FFI_Extension_Type,
    pub next: *mut XLA_FFI_Extension_Base,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct XLA_FFI_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub major_version: c_int,
    pub minor_version: c_int,
}
pub const XLA_FFI_Api_Version_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Api_Version, minor_version: c_int);

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// Opaque: owned by the XLA runtime that created it.
#[repr(C)]
pub struct XLA_FFI_Error {
    _private: [u8; 0],
}

pub type XLA_FFI_Error_Code = c_int;
pub const XLA_FFI_Error_Code_OK: XLA_FFI_Error_Code = 0;
pub const XLA_FFI_Error_Code_CANCELLED: XLA_FFI_Error_Code = 1;
pub const XLA_FFI_Error_Code_UNKNOWN: XLA_FFI_Error_Code = 2;
pub const XLA_FFI_Error_Code_INVALID_ARGUMENT: XLA_FFI_Error_Code = 3;
pub const XLA_FFI_Error_Code_NOT_FOUND: XLA_FFI_Error_Code = 5;
pub const XLA_FFI_Error_Code_ALREADY_EXISTS: XLA_FFI_Error_Code = 6;
pub const XLA_FFI_Error_Code_RESOURCE_EXHAUSTED: XLA_FFI_Error_Code = 8;
pub const XLA_FFI_Error_Code_FAILED_PRECONDITION: XLA_FFI_Error_Code = 9;
pub const XLA_FFI_Error_Code_UNIMPLEMENTED: XLA_FFI_Error_Code = 12;
pub const XLA_FFI_Error_Code_INTERNAL: XLA_FFI_Error_Code = 13;
pub const XLA_FFI_Error_Code_UNAVAILABLE: XLA_FFI_Error_Code = 14;

#[repr(C)]
pub struct XLA_FFI_Error_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub message: *const c_char,
    pub errc: XLA_FFI_Error_Code,
}
pub const XLA_FFI_Error_Create_Args_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Error_Create_Args, errc: XLA_FFI_Error_Code);

#[repr(C)]
pub struct XLA_FFI_Error_GetMessage_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub error: *mut XLA_FFI_Error,
    pub message: *const c_char,
}
pub const XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE: usize =
    counted_size!(XLA_FFI_Error_GetMessage_Args, message: *const c_char);

#[repr(C)]
pub struct XLA_FFI_Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub error: *mut XLA_FFI_Error,
}
pub const XLA_FFI_Error_Destroy_Args_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Error_Destroy_Args, error: *mut XLA_FFI_Error);

pub type XLA_FFI_Error_Create = unsafe extern "C" fn(args: *mut XLA_FFI_Error_Create_Args) -> *mut XLA_FFI_Error;
pub type XLA_FFI_Error_GetMessage = unsafe extern "C" fn(args: *mut XLA_FFI_Error_GetMessage_Args);
pub type XLA_FFI_Error_Destroy = unsafe extern "C" fn(args: *mut XLA_FFI_Error_Destroy_Args);

// ---------------------------------------------------------------------------------------------
// Data types, buffers, attributes
// ---------------------------------------------------------------------------------------------

pub type XLA_FFI_DataType = c_int;
pub const XLA_FFI_DataType_INVALID: XLA_FFI_DataType = 0;
pub const XLA_FFI_DataType_PRED: XLA_FFI_DataType = 1;
pub const XLA_FFI_DataType_S8: XLA_FFI_DataType = 2;
pub const XLA_FFI_DataType_S16: XLA_FFI_DataType = 3;
pub const XLA_FFI_DataType_S32: XLA_FFI_DataType = 4;
pub const XLA_FFI_DataType_S64: XLA_FFI_DataType = 5;
pub const XLA_FFI_DataType_U8: XLA_FFI_DataType = 6;
pub const XLA_FFI_DataType_U16: XLA_FFI_DataType = 7;
pub const XLA_FFI_DataType_U32: XLA_FFI_DataType = 8;
pub const XLA_FFI_DataType_U64: XLA_FFI_DataType = 9;
pub const XLA_FFI_DataType_F16: XLA_FFI_DataType = 10;
pub const XLA_FFI_DataType_F32: XLA_FFI_DataType = 11;
pub const XLA_FFI_DataType_F64: XLA_FFI_DataType = 12;
pub const XLA_FFI_DataType_C64: XLA_FFI_DataType = 15;
pub const XLA_FFI_DataType_BF16: XLA_FFI_DataType = 16;
pub const XLA_FFI_DataType_TOKEN: XLA_FFI_DataType = 17;
pub const XLA_FFI_DataType_C128: XLA_FFI_DataType = 18;

/// A dense row-major array (XLA FFI buffers carry no strides).
#[repr(C)]
pub struct XLA_FFI_Buffer {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub dtype: XLA_FFI_DataType,
    pub data: *mut c_void,
    pub rank: i64,
    pub dims: *mut i64,
}
pub const XLA_FFI_Buffer_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Buffer, dims: *mut i64);

pub type XLA_FFI_ArgType = c_int;
pub const XLA_FFI_ArgType_BUFFER: XLA_FFI_ArgType = 1;
pub type XLA_FFI_RetType = c_int;
pub const XLA_FFI_RetType_BUFFER: XLA_FFI_RetType = 1;

pub type XLA_FFI_AttrType = c_int;
pub const XLA_FFI_AttrType_ARRAY: XLA_FFI_AttrType = 1;
pub const XLA_FFI_AttrType_DICTIONARY: XLA_FFI_AttrType = 2;
pub const XLA_FFI_AttrType_SCALAR: XLA_FFI_AttrType = 3;
pub const XLA_FFI_AttrType_STRING: XLA_FFI_AttrType = 4;

/// Bytes with a length; attribute names are *not* NUL-terminated.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct XLA_FFI_ByteSpan {
    pub ptr: *const c_char,
    pub len: usize,
}

#[repr(C)]
pub struct XLA_FFI_Scalar {
    pub dtype: XLA_FFI_DataType,
    pub value: *mut c_void,
}

#[repr(C)]
pub struct XLA_FFI_Array {
    pub dtype: XLA_FFI_DataType,
    pub size: usize,
    pub data: *mut c_void,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct XLA_FFI_TypeId {
    pub type_id: i64,
}

// ---------------------------------------------------------------------------------------------
// Call frame
// ---------------------------------------------------------------------------------------------

/// Opaque per-call context owned by XLA.
#[repr(C)]
pub struct XLA_FFI_ExecutionContext {
    _private: [u8; 0],
}

/// Opaque; only used by asynchronous handlers, which ours are not.
#[repr(C)]
pub struct XLA_FFI_Future {
    _private: [u8; 0],
}

pub type XLA_FFI_ExecutionStage = c_int;
pub const XLA_FFI_ExecutionStage_INSTANTIATE: XLA_FFI_ExecutionStage = 0;
pub const XLA_FFI_ExecutionStage_PREPARE: XLA_FFI_ExecutionStage = 1;
pub const XLA_FFI_ExecutionStage_INITIALIZE: XLA_FFI_ExecutionStage = 2;
pub const XLA_FFI_ExecutionStage_EXECUTE: XLA_FFI_ExecutionStage = 3;

#[repr(C)]
pub struct XLA_FFI_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut XLA_FFI_ArgType,
    pub args: *mut *mut c_void,
}
pub const XLA_FFI_Args_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Args, args: *mut *mut c_void);

#[repr(C)]
pub struct XLA_FFI_Rets {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut XLA_FFI_RetType,
    pub rets: *mut *mut c_void,
}
pub const XLA_FFI_Rets_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Rets, rets: *mut *mut c_void);

/// Attributes sorted by name (byte order), the order XLA guarantees.
#[repr(C)]
pub struct XLA_FFI_Attrs {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub size: i64,
    pub types: *mut XLA_FFI_AttrType,
    pub names: *mut *mut XLA_FFI_ByteSpan,
    pub attrs: *mut *mut c_void,
}
pub const XLA_FFI_Attrs_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Attrs, attrs: *mut *mut c_void);

#[repr(C)]
pub struct XLA_FFI_CallFrame {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    /// NULL during the metadata probe on older runtimes.
    pub api: *const XLA_FFI_Api,
    pub ctx: *mut XLA_FFI_ExecutionContext,
    pub stage: XLA_FFI_ExecutionStage,
    pub args: XLA_FFI_Args,
    pub rets: XLA_FFI_Rets,
    pub attrs: XLA_FFI_Attrs,
    /// Out: set by asynchronous handlers only. Not part of the counted size.
    pub future: *mut XLA_FFI_Future,
}
pub const XLA_FFI_CallFrame_STRUCT_SIZE: usize = counted_size!(XLA_FFI_CallFrame, attrs: XLA_FFI_Attrs);

/// A handler: `XLA_FFI_Error* f(XLA_FFI_CallFrame*)`; NULL means success.
pub type XLA_FFI_Handler = unsafe extern "C" fn(call_frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------

/// Handlers per execution stage, FFI API 0.1 to 0.3.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct XLA_FFI_Handler_Bundle {
    pub instantiate: Option<XLA_FFI_Handler>,
    pub prepare: Option<XLA_FFI_Handler>,
    pub initialize: Option<XLA_FFI_Handler>,
    pub execute: Option<XLA_FFI_Handler>,
}

/// FFI API 0.4 and later append a `record` stage (command-buffer recording) after `execute`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct XLA_FFI_Handler_Bundle_V0_4 {
    pub instantiate: Option<XLA_FFI_Handler>,
    pub prepare: Option<XLA_FFI_Handler>,
    pub initialize: Option<XLA_FFI_Handler>,
    pub execute: Option<XLA_FFI_Handler>,
    pub record: Option<XLA_FFI_Handler>,
}

pub type XLA_FFI_Handler_Traits = u32;
pub const XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE: XLA_FFI_Handler_Traits = 1 << 0;

/// `XLA_FFI_Handler_Register_Args` as FFI API 0.1 to 0.3 lay it out (counted size 84).
#[repr(C)]
pub struct XLA_FFI_Handler_Register_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub name: XLA_FFI_ByteSpan,
    pub platform: XLA_FFI_ByteSpan,
    pub bundle: XLA_FFI_Handler_Bundle,
    pub traits: XLA_FFI_Handler_Traits,
}
pub const XLA_FFI_Handler_Register_Args_STRUCT_SIZE: usize =
    counted_size!(XLA_FFI_Handler_Register_Args, traits: XLA_FFI_Handler_Traits);

/// `XLA_FFI_Handler_Register_Args` as FFI API 0.4 and later lay it out (counted size 92).
#[repr(C)]
pub struct XLA_FFI_Handler_Register_Args_V0_4 {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub name: XLA_FFI_ByteSpan,
    pub platform: XLA_FFI_ByteSpan,
    pub bundle: XLA_FFI_Handler_Bundle_V0_4,
    pub traits: XLA_FFI_Handler_Traits,
}
pub const XLA_FFI_Handler_Register_Args_V0_4_STRUCT_SIZE: usize =
    counted_size!(XLA_FFI_Handler_Register_Args_V0_4, traits: XLA_FFI_Handler_Traits);

pub type XLA_FFI_Handler_Register =
    unsafe extern "C" fn(args: *mut XLA_FFI_Handler_Register_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Stream, thread pool
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub struct XLA_FFI_Stream_Get_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub ctx: *mut XLA_FFI_ExecutionContext,
    /// Out: the platform stream (a `CUstream` on CUDA).
    pub stream: *mut c_void,
}
pub const XLA_FFI_Stream_Get_Args_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Stream_Get_Args, stream: *mut c_void);

pub type XLA_FFI_Stream_Get = unsafe extern "C" fn(args: *mut XLA_FFI_Stream_Get_Args) -> *mut XLA_FFI_Error;

#[repr(C)]
pub struct XLA_FFI_DeviceOrdinal_Get_Args {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub ctx: *mut XLA_FFI_ExecutionContext,
    pub device_ordinal: i32,
}
pub const XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE: usize =
    counted_size!(XLA_FFI_DeviceOrdinal_Get_Args, device_ordinal: i32);

pub type XLA_FFI_DeviceOrdinal_Get =
    unsafe extern "C" fn(args: *mut XLA_FFI_DeviceOrdinal_Get_Args) -> *mut XLA_FFI_Error;

// ---------------------------------------------------------------------------------------------
// Metadata probe
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub struct XLA_FFI_Metadata {
    pub struct_size: usize,
    pub api_version: XLA_FFI_Api_Version,
    pub traits: XLA_FFI_Handler_Traits,
    /// Present in the struct, outside the counted size.
    pub state_type_id: XLA_FFI_TypeId,
}
pub const XLA_FFI_Metadata_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Metadata, traits: XLA_FFI_Handler_Traits);

#[repr(C)]
pub struct XLA_FFI_Metadata_Extension {
    pub extension_base: XLA_FFI_Extension_Base,
    pub metadata: *mut XLA_FFI_Metadata,
}
pub const XLA_FFI_Metadata_Extension_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Metadata_Extension, metadata: *mut XLA_FFI_Metadata);

// ---------------------------------------------------------------------------------------------
// The API table
// ---------------------------------------------------------------------------------------------

/// Opaque.
#[repr(C)]
pub struct XLA_FFI_InternalApi {
    _private: [u8; 0],
}

/// A slot we never call, kept so the slots after it sit at their real offsets.
pub type XLA_FFI_OpaqueFn = unsafe extern "C" fn(args: *mut c_void) -> *mut XLA_FFI_Error;

/// The function table every XLA runtime hands out. It only grows: check `struct_size` before
/// touching a slot a later API version added (`api_has_slot!` in `xla-ffi`).
#[repr(C)]
pub struct XLA_FFI_Api {
    pub struct_size: usize,
    pub extension_start: *mut XLA_FFI_Extension_Base,
    pub api_version: XLA_FFI_Api_Version,
    pub internal_api: *const XLA_FFI_InternalApi,
    pub XLA_FFI_Error_Create: Option<XLA_FFI_Error_Create>,
    pub XLA_FFI_Error_GetMessage: Option<XLA_FFI_Error_GetMessage>,
    pub XLA_FFI_Error_Destroy: Option<XLA_FFI_Error_Destroy>,
    pub XLA_FFI_Handler_Register: Option<XLA_FFI_Handler_Register>,
    pub XLA_FFI_Stream_Get: Option<XLA_FFI_Stream_Get>,
    pub XLA_FFI_Type_Register: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_ExecutionContext_Get: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_State_Set: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_State_Get: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_DeviceMemory_Allocate: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_DeviceMemory_Free: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_ThreadPool_Schedule: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_ThreadPool_NumThreads: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_Future_Create: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_Future_SetAvailable: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_Future_SetError: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_RunId_Get: Option<XLA_FFI_OpaqueFn>,
    pub XLA_FFI_DeviceOrdinal_Get: Option<XLA_FFI_DeviceOrdinal_Get>,
}
pub const XLA_FFI_Api_STRUCT_SIZE: usize = counted_size!(XLA_FFI_Api, XLA_FFI_DeviceOrdinal_Get: Option<XLA_FFI_DeviceOrdinal_Get>);

#[cfg(test)]
mod tests {
    use super::*;

    /// The counted sizes XLA checks (facts.md); the C-header comparison is in tests/c_layout.rs.
    #[test]
    fn counted_sizes_match_xla() {
        assert_eq!(XLA_FFI_CallFrame_STRUCT_SIZE, 168);
        assert_eq!(XLA_FFI_Error_Create_Args_STRUCT_SIZE, 28);
        assert_eq!(XLA_FFI_Stream_Get_Args_STRUCT_SIZE, 32);
        assert_eq!(XLA_FFI_Handler_Register_Args_STRUCT_SIZE, 84);
        assert_eq!(XLA_FFI_Handler_Register_Args_V0_4_STRUCT_SIZE, 92);
        assert_eq!(XLA_FFI_Metadata_STRUCT_SIZE, 36);
        assert_eq!(XLA_FFI_Api_Version_STRUCT_SIZE, 24);
        assert_eq!(XLA_FFI_Buffer_STRUCT_SIZE, 48);
    }
}
