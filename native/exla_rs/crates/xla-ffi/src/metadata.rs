//! The metadata probe. At registration XLA calls the handler once with an extension of type
//! `XLA_FFI_Extension_Metadata` holding an `XLA_FFI_Metadata*` to fill: the FFI API version the
//! handler was built against and its traits. The frame has no arguments, results or attributes,
//! `ctx` is NULL and, on older runtimes, so is `api`.

use xla_ffi_sys as sys;

use crate::ApiVersion;

/// If `frame` is a metadata probe, fills it and returns true; otherwise leaves it alone.
///
/// # Safety
/// `frame` must be the live call frame XLA passed to the handler.
pub unsafe fn answer_probe(frame: &sys::XLA_FFI_CallFrame, version: ApiVersion, traits: sys::XLA_FFI_Handler_Traits) -> bool {
    let mut ext = frame.extension_start;
    while let Some(base) = ext.as_ref() {
        if base.type_ == sys::XLA_FFI_Extension_Metadata {
            let meta_ext = &*(ext as *const sys::XLA_FFI_Metadata_Extension);
            if let Some(meta) = meta_ext.metadata.as_mut() {
                meta.api_version = sys::XLA_FFI_Api_Version {
                    struct_size: sys::XLA_FFI_Api_Version_STRUCT_SIZE,
                    extension_start: std::ptr::null_mut(),
                    major_version: version.major,
                    minor_version: version.minor,
                };
                meta.traits = traits;
            }
            return true;
        }
        ext = base.next;
    }
    false
}
