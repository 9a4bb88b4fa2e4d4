//! Registering CUDA handlers through a plugin's GPU custom-call extension
//! (`PJRT_Extension_Type_Gpu_Custom_Call`, type 0): the route when a GPU plugin has no usable
//! FFI extension. It registers for the plugin's own platform, so only CUDA targets go this way.
//!
//! `PJRT_Gpu_Register_Custom_Call_Args` grew from 40 bytes (version 1: one
//! `custom_call_function`) to 64 (version 2: four stage handlers) and 68 (version 3: `traits`).
//! As with the FFI extension, implementations refuse a `struct_size` below their own, so we
//! offer 40, 64, 68 in turn. (Version 0, 32 bytes without `api_version`, predates the
//! `struct_size`-carrying extension base that PJRT 0.45 introduced, which `PjrtApi` requires.)

use std::ffi::c_void;

use xla_ffi_sys as sys;

use super::abi::*;
use super::api::{PjrtApi, PjrtError};

/// The argument sizes we offer, smallest first.
pub const SIZES: [usize; 3] = [40, 64, 68];

#[derive(Clone, Copy)]
pub struct GpuCustomCallExtension {
    api: PjrtApi,
    register: PJRT_Gpu_Register_Custom_Call,
}

impl GpuCustomCallExtension {
    pub fn find(api: PjrtApi) -> Result<Self, String> {
        let base = api.extension(PJRT_Extension_Type_Gpu_Custom_Call).ok_or("the plugin has no PJRT GPU custom-call extension")?;
        if base.struct_size < PJRT_Gpu_Custom_Call_STRUCT_SIZE {
            return Err(format!("the plugin's GPU custom-call extension is only {} bytes", base.struct_size));
        }
        // SAFETY: struct_size covers `custom_call`; static plugin data.
        let ext = unsafe { &*(base as *const PJRT_Extension_Base as *const PJRT_Gpu_Custom_Call) };
        let register = ext.custom_call.ok_or("the plugin's GPU custom-call extension has no custom_call")?;
        Ok(Self { api, register })
    }

    /// Registers `handler` as a typed (api_version 1) custom call with an args size of `size`.
    pub fn register(&self, size: usize, target: &str, handler: sys::XLA_FFI_Handler) -> Result<(), PjrtError> {
        let h = handler as *mut c_void;
        let v1 = size < 64;
        let mut args = PJRT_Gpu_Register_Custom_Call_Args {
            struct_size: size,
            function_name: target.as_ptr() as *const _,
            function_name_size: target.len(),
            api_version: 1,
            handler_instantiate_or_v1_function: if v1 { h } else { std::ptr::null_mut() },
            handler_prepare: std::ptr::null_mut(),
            handler_initialize: std::ptr::null_mut(),
            handler_execute: if v1 { std::ptr::null_mut() } else { h },
            traits: 0,
        };
        // SAFETY: args is initialised, 68 bytes, and outlives the call.
        self.api.check(unsafe { (self.register)(&mut args as *mut _ as *mut c_void) })
    }

    /// Registers trying each size smallest first; returns the size the plugin took.
    pub fn register_discovering(&self, target: &str, handler: sys::XLA_FFI_Handler) -> Result<usize, String> {
        let mut refusals = Vec::new();
        for size in SIZES {
            match self.register(size, target, handler) {
                Ok(()) => return Ok(size),
                Err(e) if e.code.is_none_or(|c| c == 3) && e.message.contains("size") => {
                    refusals.push(format!("{size} bytes: {}", e.message))
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        Err(format!("the plugin refused every known PJRT_Gpu_Register_Custom_Call_Args layout ({})", refusals.join("; ")))
    }
}
