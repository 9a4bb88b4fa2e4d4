//! Safe layer over XLA's FFI C API (the raw mirror is `xla-ffi-sys`).
//!
//! - [`frame`]: decode a `XLA_FFI_CallFrame` into typed buffers, attributes, stage, stream.
//! - [`attrs`]: attributes looked up by name (sorted by XLA, names not NUL-terminated).
//! - [`error`]: error codes, `XLA_FFI_Error` creation and reading.
//! - [`metadata`]: the probe XLA sends at registration.
//! - [`handler`]: the panic-catching wrapper every exported handler goes through.
//! - [`register`]: registering a handler into a given `XLA_FFI_Api`, in the layout its version expects.

pub mod api;
pub mod attrs;
pub mod buffer;
pub mod error;
pub mod frame;
pub mod handler;
pub mod metadata;
pub mod register;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
#[cfg(test)]
mod tests;

pub use api::{Api, ApiVersion};
pub use attrs::{Attr, Attrs};
pub use buffer::{Buffer, DataType};
pub use error::{ErrorCode, FfiError};
pub use frame::{CallFrame, Stage};
pub use handler::{run_handler, HandlerInfo};
pub use xla_ffi_sys as sys;
