//! Dense row-major buffers (arguments and results) as XLA passes them.

use std::ffi::c_void;

use xla_ffi_sys as sys;

use crate::FfiError;

/// An `XLA_FFI_DataType` code with a readable name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DataType(pub i32);

impl DataType {
    pub const PRED: Self = Self(sys::XLA_FFI_DataType_PRED);
    pub const S32: Self = Self(sys::XLA_FFI_DataType_S32);
    pub const S64: Self = Self(sys::XLA_FFI_DataType_S64);
    pub const U8: Self = Self(sys::XLA_FFI_DataType_U8);
    pub const F16: Self = Self(sys::XLA_FFI_DataType_F16);
    pub const F32: Self = Self(sys::XLA_FFI_DataType_F32);
    pub const F64: Self = Self(sys::XLA_FFI_DataType_F64);
    pub const BF16: Self = Self(sys::XLA_FFI_DataType_BF16);

    pub fn name(self) -> String {
        let known = match self.0 {
            0 => "invalid",
            1 => "pred",
            2 => "s8",
            3 => "s16",
            4 => "s32",
            5 => "s64",
            6 => "u8",
            7 => "u16",
            8 => "u32",
            9 => "u64",
            10 => "f16",
            11 => "f32",
            12 => "f64",
            15 => "c64",
            16 => "bf16",
            17 => "token",
            18 => "c128",
            _ => return format!("dtype#{}", self.0),
        };
        known.to_string()
    }

    /// Bytes per element for the fixed-width types we may read; None for the rest.
    pub fn size_bytes(self) -> Option<usize> {
        match self.0 {
            1 | 2 | 6 => Some(1),
            3 | 7 | 10 | 16 => Some(2),
            4 | 8 | 11 => Some(4),
            5 | 9 | 12 | 15 => Some(8),
            18 => Some(16),
            _ => None,
        }
    }
}

impl std::fmt::Display for DataType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// One argument or result buffer. `dims` borrows XLA's array for the call's duration.
#[derive(Clone, Copy, Debug)]
pub struct Buffer<'a> {
    pub dtype: DataType,
    pub data: *mut c_void,
    pub dims: &'a [i64],
}

impl<'a> Buffer<'a> {
    /// # Safety
    /// `raw` must point to a live `XLA_FFI_Buffer` whose `dims` has `rank` entries for `'a`.
    pub unsafe fn from_raw(raw: *const sys::XLA_FFI_Buffer) -> Result<Self, FfiError> {
        let b = raw.as_ref().ok_or_else(|| FfiError::internal("XLA passed a NULL buffer"))?;
        if b.rank < 0 {
            return Err(FfiError::internal(format!("XLA passed a buffer of rank {}", b.rank)));
        }
        let dims: &[i64] = if b.rank == 0 {
            &[]
        } else if b.dims.is_null() {
            return Err(FfiError::internal("XLA passed a buffer with NULL dims"));
        } else {
            std::slice::from_raw_parts(b.dims, b.rank as usize)
        };
        Ok(Self { dtype: DataType(b.dtype), data: b.data, dims })
    }

    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Number of elements (the product of the dims; 1 for a scalar).
    pub fn element_count(&self) -> usize {
        self.dims.iter().map(|&d| d.max(0) as usize).product()
    }

    /// Size in bytes, when the dtype has a fixed width.
    pub fn size_bytes(&self) -> Option<usize> {
        self.dtype.size_bytes().map(|s| s * self.element_count())
    }

    /// `"f32[2,128,8,64]"`, for error messages.
    pub fn describe(&self) -> String {
        let dims: Vec<String> = self.dims.iter().map(|d| d.to_string()).collect();
        format!("{}[{}]", self.dtype, dims.join(","))
    }

    /// The host data as `&[T]`. `T` must be the buffer's element type (the caller checked
    /// `dtype`); fails on a misaligned or NULL non-empty buffer instead of invoking UB.
    ///
    /// # Safety
    /// The buffer must be host memory readable for the call's duration and hold `T`s.
    pub unsafe fn as_slice<T>(&self) -> Result<&'a [T], FfiError> {
        let n = self.element_count();
        if n == 0 {
            return Ok(&[]);
        }
        self.check_ptr::<T>()?;
        Ok(std::slice::from_raw_parts(self.data as *const T, n))
    }

    /// Like [`Buffer::as_slice`], mutable. Results never alias each other or the arguments
    /// unless the program asked XLA for aliasing, which our targets never do.
    ///
    /// # Safety
    /// As `as_slice`, plus: no other live reference to this memory.
    pub unsafe fn as_mut_slice<T>(&self) -> Result<&'a mut [T], FfiError> {
        let n = self.element_count();
        if n == 0 {
            return Ok(&mut []);
        }
        self.check_ptr::<T>()?;
        Ok(std::slice::from_raw_parts_mut(self.data as *mut T, n))
    }

    fn check_ptr<T>(&self) -> Result<(), FfiError> {
        if self.data.is_null() {
            return Err(FfiError::internal(format!("XLA passed a NULL data pointer for a {} buffer", self.describe())));
        }
        if (self.data as usize) % std::mem::align_of::<T>() != 0 {
            return Err(FfiError::internal(format!(
                "buffer {} at {:p} is not aligned to {} bytes",
                self.describe(),
                self.data,
                std::mem::align_of::<T>()
            )));
        }
        Ok(())
    }
}
