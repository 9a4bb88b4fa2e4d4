//! The PJRT route against a real XLA CPU plugin from PyPI (`EXLA_RS_PJRT_PLUGIN`, set by
//! scripts/env.sh). Without it the test says so and passes vacuously.

use std::path::PathBuf;

use exla_rs_runtime::{ffi_api, registry, ApiVersion, HandlerSet, HandlerTarget, RuntimeKind};
use xla_ffi_sys as sys;

unsafe extern "C" fn handler_a(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    xla_ffi::metadata::answer_probe(&*frame, ApiVersion::new(0, 1), 0);
    std::ptr::null_mut()
}
/// Must differ from `handler_a` in its body: release builds fold identical functions into one
/// address, and XLA would then (rightly) see the same handler registered twice.
unsafe extern "C" fn handler_b(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    xla_ffi::metadata::answer_probe(&*frame, ApiVersion::new(0, 1), std::hint::black_box(0));
    std::hint::black_box(std::ptr::null_mut())
}
unsafe extern "C" fn handler_0_0(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    xla_ffi::metadata::answer_probe(&*frame, ApiVersion::new(0, 0), 0);
    std::ptr::null_mut()
}

fn plugin() -> Option<PathBuf> {
    match std::env::var_os("EXLA_RS_PJRT_PLUGIN") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            eprintln!("EXLA_RS_PJRT_PLUGIN is unset (source scripts/env.sh): skipping the real-plugin test");
            None
        }
    }
}

#[test]
fn registers_into_a_real_cpu_plugin_and_reads_xlas_answers() {
    let Some(path) = plugin() else { return };
    let loaded = registry::load_pjrt_plugin(&path).expect("load the plugin");
    assert!(loaded.newly_loaded);
    assert!(loaded.extension_types.contains(&5), "FFI extension: {:?}", loaded.extension_types);
    assert!(!registry::load_pjrt_plugin(&path).unwrap().newly_loaded, "initialised once");

    let handlers = HandlerSet {
        targets: vec![
            HandlerTarget { name: "exla_rs_test_fwd", platform: "Host", handler: handler_a },
            HandlerTarget { name: "exla_rs_test_bwd", platform: "Host", handler: handler_a },
        ],
        api_version: ApiVersion::new(0, 1),
    };
    let reports = registry::register(&handlers, &[], false);
    let report = reports.iter().find(|r| r.kind == RuntimeKind::PjrtPlugin).expect("the plugin is found in /proc/self/maps");
    eprintln!("{report:#?}");
    assert_eq!(report.state(), "registered", "{report:?}");
    assert!(report.verified, "XLA's own answers through the probe's XLA_FFI_Api");
    let ffi = report.ffi_api_version.expect("FFI API version");
    assert!(ffi >= ApiVersion::new(0, 2), "{ffi}");
    assert!(report.pjrt_api_version.unwrap() >= ApiVersion::new(0, 45));

    // XLA's answers, straight from its registry via the captured table.
    let (found, _) = registry::discover(&[]);
    assert!(found.iter().any(|c| c.kind == RuntimeKind::PjrtPlugin));
    let api = captured_api(&path);
    // Same handler again: XLA accepts (idempotent).
    let same = HandlerSet { targets: vec![handlers.targets[0]], ..handlers.clone() };
    let (_, regs) = unsafe { ffi_api::register_all(api, &same, |_, _| false) }.unwrap();
    assert_eq!(regs[0].result, Ok(()));
    // Another handler under our name: XLA refuses.
    assert_ne!(handler_a as usize, handler_b as usize, "the two test handlers were folded into one");
    let other = HandlerSet { targets: vec![HandlerTarget { name: "exla_rs_test_fwd", platform: "Host", handler: handler_b }], ..handlers.clone() };
    let (_, regs) = unsafe { ffi_api::register_all(api, &other, |_, _| false) }.unwrap();
    let err = regs[0].result.clone().unwrap_err();
    eprintln!("XLA on a conflicting handler: {err}");
    assert!(err.to_lowercase().contains("exla_rs_test_fwd"), "{err}");
    // A handler reporting FFI 0.0: XLA refuses in its probe.
    let old = HandlerSet { targets: vec![HandlerTarget { name: "exla_rs_test_old", platform: "Host", handler: handler_0_0 }], ..handlers.clone() };
    let (_, regs) = unsafe { ffi_api::register_all(api, &old, |_, _| false) }.unwrap();
    eprintln!("XLA on a 0.0 handler: {:?}", regs[0].result);
    assert!(regs[0].result.is_err());
    // A CUDA target in a CPU-only XLA.
    let cuda = HandlerSet { targets: vec![HandlerTarget { name: "exla_rs_test_fwd", platform: "CUDA", handler: handler_a }], ..handlers.clone() };
    let (_, regs) = unsafe { ffi_api::register_all(api, &cuda, |_, _| false) }.unwrap();
    eprintln!("XLA on a CUDA target: {:?}", regs[0].result);
}

/// The plugin's XLA_FFI_Api, captured again through its FFI extension.
fn captured_api(path: &std::path::Path) -> *const sys::XLA_FFI_Api {
    use exla_rs_runtime::api_capture;
    use exla_rs_runtime::dylib::Library;
    use exla_rs_runtime::pjrt::{self, ffi_extension::FfiExtension};
    let lib = Library::open_loaded(path).unwrap();
    let api = pjrt::pjrt_api(&lib, path).unwrap();
    api_capture::reset();
    FfiExtension::find(api).unwrap().register_discovering(api_capture::PROBE_TARGET, "Host", api_capture::probe_handler).unwrap();
    match api_capture::take() {
        api_capture::Captured::Api(p) => p,
        other => panic!("no api captured: {other:?}"),
    }
}
