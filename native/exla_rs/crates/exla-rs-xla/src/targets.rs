//! The custom-call targets this library provides, as registration sees them.

use xla_ffi::sys::XLA_FFI_Handler;
use xla_ffi::{ApiVersion, HandlerInfo};

/// What every handler reports to XLA's metadata probe. 0.1 is accepted by every XLA from
/// mid-2025 on: FFI 0.1 runtimes demand an exact match, 0.2+ accept any version from 0.1 up.
pub const FFI_API_VERSION: ApiVersion = ApiVersion::new(0, 1);

pub const FWD_TARGET: &str = "exla_rs_flash_attn_fwd";
pub const BWD_TARGET: &str = "exla_rs_flash_attn_bwd";

/// No traits: our CUDA handlers may load modules (NVRTC at first use), which must not happen
/// inside command-buffer capture, and JAX's CUDA plugin refuses traits passed at registration.
pub const TRAITS: u32 = 0;

pub(crate) const FWD_INFO: HandlerInfo = HandlerInfo { target: FWD_TARGET, version: FFI_API_VERSION, traits: TRAITS };
pub(crate) const BWD_INFO: HandlerInfo = HandlerInfo { target: BWD_TARGET, version: FFI_API_VERSION, traits: TRAITS };

/// One (target, platform) registration and the exported symbol that implements it.
#[derive(Clone, Copy, Debug)]
pub struct Target {
    /// The custom-call target name (`exla_rs_flash_attn_fwd` / `_bwd`).
    pub name: &'static str,
    /// XLA platform name: `"Host"` or `"CUDA"`.
    pub platform: &'static str,
    /// The symbol `libexla_rs_xla.so` exports for it.
    pub symbol: &'static str,
    pub handler: XLA_FFI_Handler,
}

pub const TARGETS: &[Target] = &[
    Target { name: FWD_TARGET, platform: "Host", symbol: "exla_rs_flash_attn_fwd_host", handler: crate::exla_rs_flash_attn_fwd_host },
    Target { name: BWD_TARGET, platform: "Host", symbol: "exla_rs_flash_attn_bwd_host", handler: crate::exla_rs_flash_attn_bwd_host },
    Target { name: FWD_TARGET, platform: "CUDA", symbol: "exla_rs_flash_attn_fwd_cuda", handler: crate::exla_rs_flash_attn_fwd_cuda },
    Target { name: BWD_TARGET, platform: "CUDA", symbol: "exla_rs_flash_attn_bwd_cuda", handler: crate::exla_rs_flash_attn_bwd_cuda },
];
