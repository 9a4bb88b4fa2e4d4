//! Element types the attention accepts for `q`, `k`, `v`, `o`, `do`.

/// A floating-point input type. Accumulation is always f32, whatever the input type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    F32,
    F16,
    BF16,
}

impl ElementType {
    /// XLA FFI `XLA_FFI_DataType` codes (xla/ffi/api/c_api.h).
    pub const XLA_F16: i32 = 10;
    pub const XLA_F32: i32 = 11;
    pub const XLA_BF16: i32 = 16;

    pub fn from_xla_code(code: i32) -> Option<Self> {
        match code {
            Self::XLA_F32 => Some(Self::F32),
            Self::XLA_F16 => Some(Self::F16),
            Self::XLA_BF16 => Some(Self::BF16),
            _ => None,
        }
    }

    pub fn xla_code(self) -> i32 {
        match self {
            Self::F32 => Self::XLA_F32,
            Self::F16 => Self::XLA_F16,
            Self::BF16 => Self::XLA_BF16,
        }
    }

    pub fn size_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
        }
    }
}

impl std::fmt::Display for ElementType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
