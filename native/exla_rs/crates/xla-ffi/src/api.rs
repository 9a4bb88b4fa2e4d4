//! A borrowed `XLA_FFI_Api` table and its version.

use xla_ffi_sys as sys;

/// `major.minor` of an FFI API, ordered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ApiVersion {
    pub major: i32,
    pub minor: i32,
}

impl ApiVersion {
    pub const fn new(major: i32, minor: i32) -> Self {
        Self { major, minor }
    }
}

impl std::fmt::Display for ApiVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// A runtime's function table. The table only grows between versions, so a slot is usable only
/// when `struct_size` reaches past it (see [`Api::has_slot`]).
#[derive(Clone, Copy)]
pub struct Api<'a> {
    raw: &'a sys::XLA_FFI_Api,
}

impl<'a> Api<'a> {
    /// # Safety
    /// `ptr` must be NULL or point to a live `XLA_FFI_Api` for `'a`.
    pub unsafe fn from_ptr(ptr: *const sys::XLA_FFI_Api) -> Option<Self> {
        ptr.as_ref().map(|raw| Self { raw })
    }

    pub fn raw(&self) -> &'a sys::XLA_FFI_Api {
        self.raw
    }

    pub fn as_ptr(&self) -> *const sys::XLA_FFI_Api {
        self.raw as *const _
    }

    pub fn version(&self) -> ApiVersion {
        ApiVersion::new(self.raw.api_version.major_version, self.raw.api_version.minor_version)
    }

    /// Whether the runtime's table is long enough to hold the slot at `offset` (of `size` bytes).
    pub fn has_slot(&self, offset: usize, size: usize) -> bool {
        self.raw.struct_size >= offset + size
    }
}

/// `api.has_slot` for a named field of `XLA_FFI_Api`, returning the slot's value when present.
#[macro_export]
macro_rules! api_slot {
    ($api:expr, $field:ident) => {{
        let api: $crate::Api<'_> = $api;
        if api.has_slot(
            ::core::mem::offset_of!($crate::sys::XLA_FFI_Api, $field),
            ::core::mem::size_of::<usize>(),
        ) {
            api.raw().$field
        } else {
            None
        }
    }};
}
