//! Finds the XLA runtimes loaded in this process and registers FFI handlers into them, with
//! a reason for every failure. No Rustler here: the NIF (`exla-rs-nif`) is thin glue over this.
//!
//! - [`proc_maps`]: the shared objects mapped into the process.
//! - [`dylib`]: `dlopen` with `RTLD_NOLOAD` (look, never load) and plugin loading.
//! - [`xla_extension`]: EXLA's `libxla_extension.so` via `xla::ffi::GetXlaFfiApi()`.
//! - [`pjrt`]: PJRT plugins via `GetPjrtApi` and their FFI / GPU custom-call extensions.
//! - [`api_capture`]: the registration probe that yields a PJRT plugin's `XLA_FFI_Api`.
//! - [`ffi_api`], [`version_policy`]: `XLA_FFI_Handler_Register` and which versions accept us.
//! - [`registry`]: process-wide state, passes, counters; [`report`]: what a pass found and did.

pub mod api_capture;
pub mod dylib;
pub mod ffi_api;
pub mod pjrt;
pub mod proc_maps;
pub mod registry;
pub mod report;
pub mod target;
pub mod version_policy;
pub mod xla_extension;

pub use registry::{Candidate, Counters, LoadedPlugin};
pub use report::{Registration, RuntimeKind, RuntimeReport};
pub use target::{HandlerSet, HandlerTarget};
pub use xla_ffi::ApiVersion;
