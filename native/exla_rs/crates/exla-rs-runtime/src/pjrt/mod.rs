//! PJRT plugins: shared objects exporting `GetPjrtApi` (EXLA's `:pjrt_plugin` client, JAX's
//! plugins, the PyPI CPU plugins).
//!
//! Route, per plugin:
//! 1. `GetPjrtApi()`; PJRT 0.45 or later (see `api`).
//! 2. FFI extension (type 5): register the capture probe (`api_capture`) for `Host`, finding the
//!    `PJRT_FFI_Register_Handler_Args` layout on the way. If XLA's probe handed us its
//!    `XLA_FFI_Api`, register every target with `XLA_FFI_Handler_Register` there (XLA's own
//!    answers: `verified`). Otherwise register every target through the extension, whose answer
//!    is the plugin's only.
//! 3. No usable FFI extension: the GPU custom-call extension (type 0), CUDA targets only.

pub mod abi;
pub mod api;
pub mod ffi_extension;
pub mod gpu_extension;

use std::path::Path;

use xla_ffi_sys as sys;

use crate::api_capture::{self, Captured};
use crate::dylib::Library;
use crate::ffi_api;
use crate::report::{Registration, RuntimeKind, RuntimeReport};
use crate::target::HandlerSet;
use api::PjrtApi;
use ffi_extension::{FfiExtension, RegisterLayout};
use gpu_extension::GpuCustomCallExtension;

/// The symbol every PJRT plugin exports.
pub const GET_PJRT_API: &str = "GetPjrtApi";

/// What we learnt about a plugin, kept between passes so later ones skip the discovery.
#[derive(Clone, Copy, Debug, Default)]
pub struct PluginMemo {
    pub ffi_layout: Option<RegisterLayout>,
    pub ffi_api: Option<usize>,
}

/// The plugin's `PJRT_Api`, from a handle on it.
pub fn pjrt_api(lib: &Library, path: &Path) -> Result<PjrtApi, String> {
    let sym = lib.symbol(GET_PJRT_API).ok_or_else(|| format!("{} does not export {GET_PJRT_API}", path.display()))?;
    // SAFETY: GetPjrtApi is `const PJRT_Api* GetPjrtApi(void)` in every plugin.
    let get: abi::PJRT_GetPjrtApi = unsafe { std::mem::transmute(sym) };
    unsafe { PjrtApi::from_ptr(get()) }
}

/// Registers `handlers` (minus those `skip` names) into the already-loaded plugin at `path`.
pub fn register(path: &Path, handlers: &HandlerSet, memo: &mut PluginMemo, skip: impl Fn(&str, &str) -> bool) -> RuntimeReport {
    let mut report = RuntimeReport::new(RuntimeKind::PjrtPlugin, path.display().to_string());
    let lib = match Library::open_loaded(path) {
        Ok(lib) => lib,
        Err(e) => return report.failed(e),
    };
    let api = match pjrt_api(&lib, path) {
        Ok(api) => api,
        Err(e) => return report.failed(e),
    };
    report.pjrt_api_version = Some(api.version());
    register_into(api, report, handlers, memo, skip)
}

/// Everything after `GetPjrtApi`, separate so tests can hand in a fake table.
pub fn register_into(
    api: PjrtApi,
    mut report: RuntimeReport,
    handlers: &HandlerSet,
    memo: &mut PluginMemo,
    skip: impl Fn(&str, &str) -> bool,
) -> RuntimeReport {
    let ffi = match FfiExtension::find(api) {
        Ok(ffi) => ffi,
        Err(ffi_err) => return register_through_gpu_extension(api, report, handlers, skip, &ffi_err),
    };

    if memo.ffi_api.is_none() {
        api_capture::reset();
        let layout = match memo.ffi_layout {
            Some(layout) => ffi
                .register(layout, api_capture::PROBE_TARGET, "Host", api_capture::probe_handler)
                .map(|_| layout)
                .map_err(|e| e.to_string()),
            None => ffi.register_discovering(api_capture::PROBE_TARGET, "Host", api_capture::probe_handler),
        };
        match layout {
            Ok(layout) => memo.ffi_layout = Some(layout),
            Err(e) => return report.failed(format!("the PJRT FFI extension refused our registration: {e}")),
        }
        if let Captured::Api(p) = api_capture::take() {
            memo.ffi_api = Some(p as usize);
        }
    }
    let layout = memo.ffi_layout.expect("set above");

    if let Some(ffi_api_ptr) = memo.ffi_api {
        let ffi_api_ptr = ffi_api_ptr as *const sys::XLA_FFI_Api;
        report.route = Some(format!(
            "PJRT FFI extension ({}-byte register args) -> XLA_FFI_Api from the registration probe -> XLA_FFI_Handler_Register",
            layout.struct_size()
        ));
        // SAFETY: the pointer is the plugin's static FFI table, alive while the plugin is loaded.
        report.ffi_api_version = unsafe { ffi_api::version_of(ffi_api_ptr) };
        match unsafe { ffi_api::register_all(ffi_api_ptr, handlers, skip) } {
            Ok((_, registrations)) => {
                report.verified = true;
                report.registrations = registrations;
            }
            Err(e) => report.error = Some(e),
        }
        return report;
    }

    report.route = Some(format!(
        "PJRT FFI extension ({}-byte register args); XLA did not expose its FFI API in the probe, so only the plugin's answer is known",
        layout.struct_size()
    ));
    report.registrations = handlers
        .targets
        .iter()
        .filter(|t| !skip(t.name, t.platform))
        .map(|t| Registration {
            target: t.name.into(),
            platform: t.platform.into(),
            result: ffi.register(layout, t.name, t.platform, t.handler).map_err(|e| e.to_string()),
        })
        .collect();
    report
}

fn register_through_gpu_extension(
    api: PjrtApi,
    mut report: RuntimeReport,
    handlers: &HandlerSet,
    skip: impl Fn(&str, &str) -> bool,
    ffi_err: &str,
) -> RuntimeReport {
    let gpu = match GpuCustomCallExtension::find(api) {
        Ok(gpu) => gpu,
        Err(gpu_err) => return report.failed(format!("{ffi_err}; {gpu_err}")),
    };
    let mut size = None;
    for t in handlers.targets.iter().filter(|t| HandlerSet::is_cuda(t.platform) && !skip(t.name, t.platform)) {
        let result = match size {
            Some(s) => gpu.register(s, t.name, t.handler).map_err(|e| e.to_string()),
            None => gpu.register_discovering(t.name, t.handler).map(|s| size = Some(s)),
        };
        report.registrations.push(Registration { target: t.name.into(), platform: t.platform.into(), result });
    }
    report.route = Some(format!(
        "PJRT GPU custom-call extension ({}), CUDA targets only ({ffi_err})",
        size.map_or("no layout accepted".to_string(), |s| format!("{s}-byte args"))
    ));
    report
}
