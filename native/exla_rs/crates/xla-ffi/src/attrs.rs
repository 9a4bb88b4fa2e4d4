//! Attributes of a call, looked up by name. XLA sorts them by name (byte order) and does not
//! NUL-terminate the names, so lookup is a binary search over byte slices.

use std::ffi::c_void;

use xla_ffi_sys as sys;

use crate::{DataType, FfiError};

/// One decoded attribute value.
#[derive(Clone, Copy, Debug)]
pub enum Attr<'a> {
    Scalar { dtype: DataType, value: *const c_void },
    Array { dtype: DataType, size: usize, data: *const c_void },
    String(&'a [u8]),
    Dictionary(*const sys::XLA_FFI_Attrs),
    Unknown(i32),
}

impl Attr<'_> {
    pub fn kind(&self) -> String {
        match self {
            Attr::Scalar { dtype, .. } => format!("{dtype} scalar"),
            Attr::Array { dtype, size, .. } => format!("{dtype}[{size}] array"),
            Attr::String(_) => "string".into(),
            Attr::Dictionary(_) => "dictionary".into(),
            Attr::Unknown(t) => format!("attribute of unknown type {t}"),
        }
    }
}

/// The attributes of one call frame (or of a nested dictionary).
#[derive(Clone, Copy)]
pub struct Attrs<'a> {
    names: &'a [*mut sys::XLA_FFI_ByteSpan],
    types: &'a [sys::XLA_FFI_AttrType],
    values: &'a [*mut c_void],
}

impl<'a> Attrs<'a> {
    /// # Safety
    /// `raw` must describe `size` live entries for `'a`.
    pub unsafe fn from_raw(raw: &'a sys::XLA_FFI_Attrs) -> Self {
        let n = raw.size.max(0) as usize;
        if n == 0 || raw.names.is_null() || raw.types.is_null() || raw.attrs.is_null() {
            return Self { names: &[], types: &[], values: &[] };
        }
        Self {
            names: std::slice::from_raw_parts(raw.names, n),
            types: std::slice::from_raw_parts(raw.types, n),
            values: std::slice::from_raw_parts(raw.attrs, n),
        }
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    fn name_at(&self, i: usize) -> &'a [u8] {
        // SAFETY: XLA hands `size` valid ByteSpan pointers for the call's duration.
        unsafe {
            match self.names[i].as_ref() {
                Some(span) if !span.ptr.is_null() => std::slice::from_raw_parts(span.ptr as *const u8, span.len),
                _ => &[],
            }
        }
    }

    /// All names, in XLA's (sorted) order.
    pub fn names(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.len()).map(|i| String::from_utf8_lossy(self.name_at(i)).into_owned())
    }

    /// The attribute called `name`. Binary search relies on XLA's byte-order sort; a linear scan
    /// backs it up so an unsorted frame (hand-built, or a future runtime) still decodes.
    pub fn get(&self, name: &str) -> Option<Attr<'a>> {
        let key = name.as_bytes();
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            match self.name_at(mid).cmp(key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.decode(mid)),
            }
        }
        (0..self.len()).find(|&i| self.name_at(i) == key).map(|i| self.decode(i))
    }

    fn decode(&self, i: usize) -> Attr<'a> {
        let v = self.values[i];
        // SAFETY: the value pointer's type is given by `types[i]`, per the C API.
        unsafe {
            match self.types[i] {
                sys::XLA_FFI_AttrType_SCALAR => match (v as *const sys::XLA_FFI_Scalar).as_ref() {
                    Some(s) => Attr::Scalar { dtype: DataType(s.dtype), value: s.value },
                    None => Attr::Unknown(sys::XLA_FFI_AttrType_SCALAR),
                },
                sys::XLA_FFI_AttrType_ARRAY => match (v as *const sys::XLA_FFI_Array).as_ref() {
                    Some(a) => Attr::Array { dtype: DataType(a.dtype), size: a.size, data: a.data },
                    None => Attr::Unknown(sys::XLA_FFI_AttrType_ARRAY),
                },
                sys::XLA_FFI_AttrType_STRING => match (v as *const sys::XLA_FFI_ByteSpan).as_ref() {
                    Some(s) if !s.ptr.is_null() => Attr::String(std::slice::from_raw_parts(s.ptr as *const u8, s.len)),
                    _ => Attr::String(&[]),
                },
                sys::XLA_FFI_AttrType_DICTIONARY => Attr::Dictionary(v as *const sys::XLA_FFI_Attrs),
                other => Attr::Unknown(other),
            }
        }
    }

    /// `want` describes the expected attribute in the error (built only on failure).
    fn required(&self, target: &str, name: &str, want: impl std::fmt::Display) -> Result<Attr<'a>, FfiError> {
        self.get(name).ok_or_else(|| {
            let have: Vec<String> = self.names().collect();
            FfiError::invalid_argument(format!(
                "{target}: missing attribute `{name}` ({want}); the call has [{}]",
                have.join(", ")
            ))
        })
    }

    /// A required scalar of exactly type `dtype`, read as `T`.
    fn scalar<T: Copy>(&self, target: &str, name: &str, dtype: DataType) -> Result<T, FfiError> {
        let want = format_args!("{dtype} scalar");
        match self.required(target, name, want)? {
            Attr::Scalar { dtype: d, value } if d == dtype && !value.is_null() => {
                // SAFETY: XLA stores a scalar of `dtype` at `value`; read_unaligned needs no alignment.
                Ok(unsafe { std::ptr::read_unaligned(value as *const T) })
            }
            other => Err(FfiError::invalid_argument(format!(
                "{target}: attribute `{name}` must be a {want}, got a {}",
                other.kind()
            ))),
        }
    }

    pub fn f32(&self, target: &str, name: &str) -> Result<f32, FfiError> {
        self.scalar::<f32>(target, name, DataType::F32)
    }

    pub fn i64(&self, target: &str, name: &str) -> Result<i64, FfiError> {
        self.scalar::<i64>(target, name, DataType::S64)
    }

    pub fn string(&self, target: &str, name: &str) -> Result<String, FfiError> {
        match self.required(target, name, "string")? {
            Attr::String(b) => Ok(String::from_utf8_lossy(b).into_owned()),
            other => Err(FfiError::invalid_argument(format!(
                "{target}: attribute `{name}` must be a string, got a {}",
                other.kind()
            ))),
        }
    }
}
