//! Errors a backend reports. The FFI layer maps them onto XLA error codes:
//! `InvalidArgument` -> INVALID_ARGUMENT (3), `Unimplemented` -> UNIMPLEMENTED (12),
//! `Internal` -> INTERNAL (13).

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttnError {
    /// A malformed call: wrong rank, mismatched dtypes or dims, bad attribute. Names the operand.
    #[error("{0}")]
    InvalidArgument(String),
    /// A valid call this platform cannot run (a head dim with no kernel, no GPU, no compiler).
    #[error("{0}")]
    Unimplemented(String),
    /// Something that should not happen (a driver failure, a caught panic).
    #[error("{0}")]
    Internal(String),
}

impl AttnError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::InvalidArgument(msg.into())
    }
    pub fn unimplemented(msg: impl Into<String>) -> Self {
        Self::Unimplemented(msg.into())
    }
    pub fn internal(msg: impl Into<String>) -> Self {
        Self::Internal(msg.into())
    }
}
