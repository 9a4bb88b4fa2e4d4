//! Registering through a plugin's FFI extension (`PJRT_Extension_Type_FFI`, type 5).
//!
//! `PJRT_FFI_Register_Handler_Args` has had three layouts, none signalled by a version number
//! (see [`RegisterLayout`]). Every implementation checks `args->struct_size` against its own
//! counted size and refuses smaller ones with INVALID_ARGUMENT ("Unexpected ... size: expected
//! N, got M") before reading anything else. So we offer the layouts smallest first: the first
//! one a plugin accepts has exactly the size it expects, hence its layout. The answer is cached
//! per plugin by the caller.

use std::ffi::c_void;

use xla_ffi_sys as sys;

use super::abi::*;
use super::api::{PjrtApi, PjrtError};

/// The `PJRT_FFI_Register_Handler_Args` layouts, in the order we try them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterLayout {
    /// `{struct_size, target_name, target_name_size, api_version, handler, platform_name,
    /// platform_name_size}`, counted size 40 (the header named `handler` the last field).
    ApiVersion40,
    /// `{struct_size, target_name, target_name_size, handler, platform_name, platform_name_size,
    /// traits}`, counted size 52: typed handlers only. PJRT 0.115 (jaxlib 0.11).
    TypedOnly52,
    /// The 40-byte layout plus `traits`, counted size 60.
    ApiVersionTraits60,
}

impl RegisterLayout {
    pub const ALL: [RegisterLayout; 3] = [Self::ApiVersion40, Self::TypedOnly52, Self::ApiVersionTraits60];

    pub fn struct_size(self) -> usize {
        match self {
            Self::ApiVersion40 => 40,
            Self::TypedOnly52 => 52,
            Self::ApiVersionTraits60 => 60,
        }
    }
}

/// A plugin's FFI extension with a `register_handler` entry.
#[derive(Clone, Copy)]
pub struct FfiExtension {
    api: PjrtApi,
    register: PJRT_FFI_Register_Handler,
}

impl FfiExtension {
    /// The plugin's FFI extension, or why it cannot register handlers.
    pub fn find(api: PjrtApi) -> Result<Self, String> {
        let base = api.extension(PJRT_Extension_Type_FFI).ok_or("the plugin has no PJRT FFI extension")?;
        if base.struct_size < PJRT_FFI_Extension_STRUCT_SIZE {
            return Err(format!(
                "the plugin's PJRT FFI extension is {} bytes, too old to have register_handler ({PJRT_FFI_Extension_STRUCT_SIZE})",
                base.struct_size
            ));
        }
        // SAFETY: struct_size covers `register_handler`; the extension is static plugin data.
        let ext = unsafe { &*(base as *const PJRT_Extension_Base as *const PJRT_FFI_Extension) };
        let register = ext.register_handler.ok_or("the plugin's PJRT FFI extension has no register_handler")?;
        Ok(Self { api, register })
    }

    /// Registers with a known layout.
    pub fn register(&self, layout: RegisterLayout, target: &str, platform: &str, handler: sys::XLA_FFI_Handler) -> Result<(), PjrtError> {
        let handler = handler as *mut c_void;
        let err = match layout {
            RegisterLayout::ApiVersion40 | RegisterLayout::ApiVersionTraits60 => {
                let mut args = PJRT_FFI_Register_Handler_Args_WithApiVersion {
                    struct_size: layout.struct_size(),
                    target_name: target.as_ptr() as *const _,
                    target_name_size: target.len(),
                    api_version: 1, // typed FFI
                    handler,
                    platform_name: platform.as_ptr() as *const _,
                    platform_name_size: platform.len(),
                    traits: 0,
                };
                // SAFETY: args is initialised, outlives the call, and is at least struct_size bytes.
                unsafe { (self.register)(&mut args as *mut _ as *mut c_void) }
            }
            RegisterLayout::TypedOnly52 => {
                let mut args = PJRT_FFI_Register_Handler_Args_TypedOnly {
                    struct_size: layout.struct_size(),
                    target_name: target.as_ptr() as *const _,
                    target_name_size: target.len(),
                    handler,
                    platform_name: platform.as_ptr() as *const _,
                    platform_name_size: platform.len(),
                    traits: 0,
                };
                // SAFETY: as above.
                unsafe { (self.register)(&mut args as *mut _ as *mut c_void) }
            }
        };
        self.api.check(err)
    }

    /// Registers trying each layout smallest first; returns the layout the plugin took.
    pub fn register_discovering(&self, target: &str, platform: &str, handler: sys::XLA_FFI_Handler) -> Result<RegisterLayout, String> {
        let mut refusals = Vec::new();
        for layout in RegisterLayout::ALL {
            match self.register(layout, target, platform, handler) {
                Ok(()) => return Ok(layout),
                Err(e) if is_size_refusal(&e) => refusals.push(format!("{} bytes: {}", layout.struct_size(), e.message)),
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("the plugin refused every known PJRT_FFI_Register_Handler_Args layout ({})", refusals.join("; ")))
    }
}

/// INVALID_ARGUMENT (3) naming a size: PJRT's `ActualStructSizeIsGreaterOrEqual` refusal.
fn is_size_refusal(e: &PjrtError) -> bool {
    e.code.is_none_or(|c| c == 3) && e.message.contains("size")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    // A fake plugin: a PJRT_Api head, error functions, and an FFI extension whose register
    // function behaves like XLA's for a configurable expected size and layout.
    struct FakeError {
        code: i32,
        message: String,
    }

    static EXPECTED: AtomicUsize = AtomicUsize::new(0);
    static SEEN: Mutex<Vec<(usize, String, String, usize)>> = Mutex::new(Vec::new());
    static LOCK: Mutex<()> = Mutex::new(());

    unsafe extern "C" fn fake_register(args: *mut c_void) -> *mut PJRT_Error {
        let size = *(args as *const usize);
        let expected = EXPECTED.load(Ordering::SeqCst);
        if size < expected {
            let e = Box::new(FakeError {
                code: 3,
                message: format!("Unexpected PJRT_FFI_Register_Handler_Args size: expected {expected}, got {size}."),
            });
            return Box::into_raw(e) as *mut PJRT_Error;
        }
        // Read with the layout this fake plugin was "built" with.
        let (name, platform, handler) = if expected == 52 {
            let a = &*(args as *const PJRT_FFI_Register_Handler_Args_TypedOnly);
            (span(a.target_name, a.target_name_size), span(a.platform_name, a.platform_name_size), a.handler as usize)
        } else {
            let a = &*(args as *const PJRT_FFI_Register_Handler_Args_WithApiVersion);
            assert_eq!(a.api_version, 1);
            (span(a.target_name, a.target_name_size), span(a.platform_name, a.platform_name_size), a.handler as usize)
        };
        SEEN.lock().unwrap().push((size, name, platform, handler));
        std::ptr::null_mut()
    }

    unsafe fn span(p: *const std::ffi::c_char, n: usize) -> String {
        String::from_utf8(std::slice::from_raw_parts(p as *const u8, n).to_vec()).unwrap()
    }

    unsafe extern "C" fn fake_message(args: *mut PJRT_Error_Message_Args) {
        let e = &*((*args).error as *const FakeError);
        (*args).message = e.message.as_ptr() as *const _;
        (*args).message_size = e.message.len();
    }
    unsafe extern "C" fn fake_code(args: *mut PJRT_Error_GetCode_Args) -> *mut PJRT_Error {
        (*args).code = (*((*args).error as *const FakeError)).code;
        std::ptr::null_mut()
    }
    unsafe extern "C" fn fake_destroy(args: *mut PJRT_Error_Destroy_Args) {
        drop(Box::from_raw((*args).error as *mut FakeError));
    }

    unsafe extern "C" fn dummy_handler(_: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
        std::ptr::null_mut()
    }

    fn fake_api(ext_size: usize) -> &'static PJRT_Api_Head {
        let ext = Box::leak(Box::new(PJRT_FFI_Extension {
            base: PJRT_Extension_Base { struct_size: ext_size, type_: PJRT_Extension_Type_FFI, next: std::ptr::null() },
            type_id_register: std::ptr::null(),
            user_data_add: std::ptr::null(),
            register_handler: Some(fake_register),
        }));
        let other = Box::leak(Box::new(PJRT_Extension_Base { struct_size: 40, type_: 19, next: &ext.base }));
        Box::leak(Box::new(PJRT_Api_Head {
            struct_size: 1144,
            extension_start: other,
            pjrt_api_version: PJRT_Api_Version { struct_size: 24, extension_start: std::ptr::null(), major_version: 0, minor_version: 115 },
            PJRT_Error_Destroy: Some(fake_destroy),
            PJRT_Error_Message: Some(fake_message),
            PJRT_Error_GetCode: Some(fake_code),
            PJRT_Plugin_Initialize: None,
        }))
    }

    #[test]
    fn discovers_each_layout_by_its_size() {
        let _guard = LOCK.lock().unwrap();
        for (expected, layout) in [(40, RegisterLayout::ApiVersion40), (52, RegisterLayout::TypedOnly52), (60, RegisterLayout::ApiVersionTraits60)] {
            EXPECTED.store(expected, Ordering::SeqCst);
            SEEN.lock().unwrap().clear();
            let api = unsafe { PjrtApi::from_ptr(fake_api(48)) }.unwrap();
            let ext = FfiExtension::find(api).unwrap();
            assert_eq!(ext.register_discovering("my_target", "Host", dummy_handler), Ok(layout));
            let seen = SEEN.lock().unwrap().clone();
            assert_eq!(seen, vec![(expected, "my_target".to_string(), "Host".to_string(), dummy_handler as *const () as usize)]);
        }
    }

    #[test]
    fn reports_a_plugin_that_wants_more_than_we_know() {
        let _guard = LOCK.lock().unwrap();
        EXPECTED.store(72, Ordering::SeqCst);
        let api = unsafe { PjrtApi::from_ptr(fake_api(48)) }.unwrap();
        let err = FfiExtension::find(api).unwrap().register_discovering("t", "Host", dummy_handler).unwrap_err();
        assert!(err.contains("refused every known") && err.contains("expected 72, got 60"), "{err}");
    }

    #[test]
    fn refuses_an_extension_without_register_handler() {
        let api = unsafe { PjrtApi::from_ptr(fake_api(40)) }.unwrap();
        let err = FfiExtension::find(api).err().unwrap();
        assert!(err.contains("too old to have register_handler"), "{err}");
    }

    #[test]
    fn checks_the_api_version() {
        let api = fake_api(48) as *const PJRT_Api_Head as *mut PJRT_Api_Head;
        unsafe { (*api).pjrt_api_version.minor_version = 30 };
        let err = unsafe { PjrtApi::from_ptr(api) }.err().unwrap();
        assert!(err.contains("0.30 is not supported"), "{err}");
        assert!(unsafe { PjrtApi::from_ptr(std::ptr::null()) }.is_err());
    }
}
