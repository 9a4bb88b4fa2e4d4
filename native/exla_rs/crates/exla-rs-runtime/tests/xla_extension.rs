//! The libxla_extension route against a stand-in library (tests/fixtures/fake_xla_extension.c,
//! compiled here with the system C compiler) that exports `xla::ffi::GetXlaFfiApi()` and
//! behaves like XLA's registration: struct_size by version, metadata probe, version check.

use std::ffi::{c_char, c_int, CStr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use exla_rs_runtime::dylib::Library;
use exla_rs_runtime::{registry, xla_extension, ApiVersion, HandlerSet, HandlerTarget, RuntimeKind};
use xla_ffi_sys as sys;

static LOCK: Mutex<()> = Mutex::new(());

/// Builds the fixture once, named like EXLA's library, and loads it (as EXLA's NIF would).
fn fixture() -> &'static (PathBuf, Library) {
    static LIB: OnceLock<(PathBuf, Library)> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("exla_rs_runtime_test_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let so = dir.join("libxla_extension.so");
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fake_xla_extension.c");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let status = Command::new(&cc).args(["-shared", "-fPIC", "-O1", "-o"]).arg(&so).arg(&src).status().expect("a C compiler (cc) is needed to build the fixture");
        assert!(status.success(), "compiling {}", src.display());
        let lib = Library::load(&so).unwrap();
        (so, lib)
    })
}

fn control<T>(name: &str) -> T {
    let sym = fixture().1.symbol(name).unwrap_or_else(|| panic!("fixture lacks {name}"));
    unsafe { std::mem::transmute_copy(&sym) }
}

fn set_version(major: i32, minor: i32) {
    let f: extern "C" fn(c_int, c_int) = control("fake_xla_set_version");
    f(major, minor);
    let reset: extern "C" fn() = control("fake_xla_reset");
    reset();
}

fn registered() -> Vec<String> {
    let count: extern "C" fn() -> c_int = control("fake_xla_registered_count");
    let get: extern "C" fn(c_int) -> *const c_char = control("fake_xla_registered");
    (0..count()).map(|i| unsafe { CStr::from_ptr(get(i)) }.to_string_lossy().into_owned()).collect()
}

unsafe extern "C" fn handler(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    xla_ffi::metadata::answer_probe(&*frame, ApiVersion::new(0, 1), 0);
    std::ptr::null_mut()
}

fn handlers() -> HandlerSet {
    HandlerSet {
        targets: vec![
            HandlerTarget { name: "t_fwd", platform: "Host", handler },
            HandlerTarget { name: "t_fwd", platform: "CUDA", handler },
        ],
        api_version: ApiVersion::new(0, 1),
    }
}

#[test]
fn registers_with_the_layout_each_version_expects() {
    let _g = LOCK.lock().unwrap();
    let (path, _) = fixture();
    for minor in [1, 2, 3, 4, 5] {
        set_version(0, minor);
        let report = xla_extension::register(path, &handlers(), |_, _| false);
        assert_eq!(report.error, None, "0.{minor}");
        assert!(report.verified);
        assert_eq!(report.ffi_api_version, Some(ApiVersion::new(0, minor)));
        assert_eq!(report.state(), "registered", "0.{minor}: {report:?}");
        assert_eq!(registered(), ["t_fwd@Host", "t_fwd@CUDA"], "0.{minor}");
    }
}

#[test]
fn refuses_unknown_versions_before_calling_xla() {
    let _g = LOCK.lock().unwrap();
    let (path, _) = fixture();
    set_version(1, 0);
    let report = xla_extension::register(path, &handlers(), |_, _| false);
    assert_eq!(report.state(), "failed");
    assert!(report.error.as_deref().unwrap().contains("XLA FFI API 1.0 is not one exla_rs knows"), "{report:?}");
    assert!(registered().is_empty());
}

#[test]
fn passes_on_xla_refusals() {
    let _g = LOCK.lock().unwrap();
    let (path, _) = fixture();
    set_version(0, 2);
    let hs = HandlerSet { api_version: ApiVersion::new(0, 1), targets: handlers().targets };
    // A handler claiming a newer version than the runtime: XLA (the fixture) refuses it.
    unsafe extern "C" fn too_new(frame: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
        xla_ffi::metadata::answer_probe(&*frame, ApiVersion::new(0, 9), 0);
        std::ptr::null_mut()
    }
    let hs = HandlerSet { targets: vec![HandlerTarget { name: "t_bad", platform: "Host", handler: too_new }, hs.targets[0]], ..hs };
    let report = xla_extension::register(path, &hs, |_, _| false);
    assert_eq!(report.state(), "partial", "{report:?}");
    let bad = &report.registrations[0];
    assert!(bad.result.as_ref().unwrap_err().contains("not supported by this runtime"), "{bad:?}");
    assert!(report.registrations[1].result.is_ok());
}

#[test]
fn discovery_finds_it_by_name_and_registry_is_idempotent() {
    let _g = LOCK.lock().unwrap();
    let (path, _) = fixture();
    set_version(0, 3);
    let (found, missing) = registry::discover(&[]);
    assert!(missing.is_empty());
    assert!(found.iter().any(|c| c.kind == RuntimeKind::XlaExtension && &c.path == path), "{found:?}");

    let first = registry::register(&handlers(), &[], false);
    let mine = first.iter().find(|r| Path::new(&r.path) == path).unwrap();
    assert_eq!(mine.state(), "registered", "{mine:?}");
    assert_eq!(registered().len(), 2);
    let attempted = registry::counters().attempted;

    let again = registry::register(&handlers(), &[], false);
    assert_eq!(again.iter().find(|r| Path::new(&r.path) == path).unwrap().state(), "registered");
    assert_eq!(registered().len(), 2, "nothing sent to XLA twice");
    assert_eq!(registry::counters().attempted, attempted);
}

#[test]
fn a_path_that_is_not_loaded_is_a_clear_error() {
    let report = xla_extension::register(Path::new("/nonexistent/libxla_extension.so"), &handlers(), |_, _| false);
    let err = report.error.unwrap();
    assert!(err.contains("is not loaded in this process") && err.contains("start :exla"), "{err}");
}
