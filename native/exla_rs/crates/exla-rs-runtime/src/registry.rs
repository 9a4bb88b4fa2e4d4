//! The process-wide record of runtimes and registrations, and the passes that update it.
//!
//! One lock serializes every pass, so `register` is safe from any number of threads (BEAM
//! processes on dirty schedulers) at once, and idempotent: a target accepted by a runtime is
//! never sent there again, and a runtime that failed is retried only on request.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::dylib::{self, Library};
use crate::pjrt::{self, PluginMemo};
use crate::report::{Registration, RuntimeKind, RuntimeReport};
use crate::target::HandlerSet;
use crate::{proc_maps, xla_extension};

/// A runtime found in the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub kind: RuntimeKind,
    pub path: PathBuf,
}

/// Totals since the library was loaded, for telemetry-style introspection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub passes: u64,
    /// Target registrations attempted, and how they ended.
    pub attempted: u64,
    pub succeeded: u64,
    pub failed: u64,
    /// Runtimes where nothing could be registered at all.
    pub runtime_failures: u64,
}

struct Record {
    report: RuntimeReport,
    memo: PluginMemo,
}

#[derive(Default)]
struct State {
    records: Vec<Record>,
    counters: Counters,
    loaded_plugins: Vec<PathBuf>,
}

static STATE: Mutex<State> = Mutex::new(State { records: Vec::new(), counters: Counters { passes: 0, attempted: 0, succeeded: 0, failed: 0, runtime_failures: 0 }, loaded_plugins: Vec::new() });

fn state() -> MutexGuard<'static, State> {
    // A panic while holding the lock leaves consistent data (records are replaced whole).
    STATE.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The runtimes loaded in this process: `libxla_extension*.so` by name, PJRT plugins by their
/// own `GetPjrtApi` export. `extra` paths (e.g. under EXLA's priv dir) are looked at too; one
/// that is not loaded comes back in the second list with the reason.
pub fn discover(extra: &[PathBuf]) -> (Vec<Candidate>, Vec<(PathBuf, String)>) {
    let mut found: Vec<Candidate> = Vec::new();
    let mut missing = Vec::new();
    let mapped = proc_maps::current_process().unwrap_or_default();
    for path in &mapped {
        if let Some(kind) = classify_loaded(path) {
            found.push(Candidate { kind, path: path.clone() });
        }
    }
    for path in extra {
        let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.clone());
        if found.iter().any(|c| dylib::same_file(&c.path, &real)) {
            continue;
        }
        match Library::open_loaded(&real) {
            Err(e) => missing.push((path.clone(), e)),
            Ok(_) => match classify_loaded(&real) {
                Some(kind) => found.push(Candidate { kind, path: real }),
                None => missing.push((path.clone(), format!("{} is neither libxla_extension nor a PJRT plugin (no GetPjrtApi)", path.display()))),
            },
        }
    }
    (found, missing)
}

fn classify_loaded(path: &Path) -> Option<RuntimeKind> {
    if xla_extension::is_xla_extension(path) {
        return Some(RuntimeKind::XlaExtension);
    }
    let lib = Library::open_loaded(path).ok()?;
    lib.defines(pjrt::GET_PJRT_API, path).then_some(RuntimeKind::PjrtPlugin)
}

/// One registration pass over every runtime found now. Returns the report of each runtime
/// found (and of each `extra` path that is not loaded), after the pass.
pub fn register(handlers: &HandlerSet, extra: &[PathBuf], retry_failed: bool) -> Vec<RuntimeReport> {
    let (found, missing) = discover(extra);
    let mut st = state();
    st.counters.passes += 1;
    let mut out = Vec::new();
    for cand in found {
        let path_str = cand.path.display().to_string();
        let idx = match st.records.iter().position(|r| r.report.path == path_str) {
            Some(i) => i,
            None => {
                st.records.push(Record { report: RuntimeReport::new(cand.kind, path_str.clone()), memo: PluginMemo::default() });
                st.records.len() - 1
            }
        };
        let previous = st.records[idx].report.clone();
        let tried = previous.state() != "found";
        let complete = handlers.targets.iter().all(|t| previous.registered(t.name, t.platform) || !applies(&previous, t.platform));
        if tried && (complete || !retry_failed) {
            out.push(previous);
            continue;
        }
        let skip = |name: &str, platform: &str| previous.registered(name, platform);
        let mut memo = st.records[idx].memo;
        let fresh = match cand.kind {
            RuntimeKind::XlaExtension => xla_extension::register(&cand.path, handlers, skip),
            RuntimeKind::PjrtPlugin => pjrt::register(&cand.path, handlers, &mut memo, skip),
        };
        count(&mut st.counters, &fresh);
        let merged = merge(previous, fresh);
        st.records[idx] = Record { report: merged.clone(), memo };
        out.push(merged);
    }
    for (path, reason) in missing {
        let kind = if xla_extension::is_xla_extension(&path) { RuntimeKind::XlaExtension } else { RuntimeKind::PjrtPlugin };
        out.push(RuntimeReport::new(kind, path.display().to_string()).failed(reason));
    }
    out
}

/// The GPU custom-call route registers CUDA targets only; a Host target there is not missing.
fn applies(report: &RuntimeReport, platform: &str) -> bool {
    let gpu_route = report.route.as_deref().is_some_and(|r| r.contains("GPU custom-call"));
    !gpu_route || HandlerSet::is_cuda(platform)
}

fn count(c: &mut Counters, fresh: &RuntimeReport) {
    for r in &fresh.registrations {
        c.attempted += 1;
        if r.result.is_ok() {
            c.succeeded += 1;
        } else {
            c.failed += 1;
        }
    }
    if fresh.error.is_some() {
        c.runtime_failures += 1;
    }
}

/// Keeps what succeeded before, adds what this pass did.
fn merge(previous: RuntimeReport, mut fresh: RuntimeReport) -> RuntimeReport {
    let mut registrations: Vec<Registration> = previous.registrations.into_iter().filter(|r| r.result.is_ok()).collect();
    for r in fresh.registrations.drain(..) {
        registrations.retain(|p| !(p.target == r.target && p.platform == r.platform));
        registrations.push(r);
    }
    fresh.registrations = registrations;
    fresh.ffi_api_version = fresh.ffi_api_version.or(previous.ffi_api_version);
    fresh.pjrt_api_version = fresh.pjrt_api_version.or(previous.pjrt_api_version);
    fresh.verified |= previous.verified && fresh.route == previous.route;
    fresh
}

/// Every runtime known (registered into or merely found now), without registering anything.
pub fn snapshot(extra: &[PathBuf]) -> (Vec<RuntimeReport>, Counters) {
    let (found, missing) = discover(extra);
    let st = state();
    let mut out: Vec<RuntimeReport> = st.records.iter().map(|r| r.report.clone()).collect();
    for cand in found {
        let path = cand.path.display().to_string();
        if !out.iter().any(|r| r.path == path) {
            let mut report = RuntimeReport::new(cand.kind, path);
            if cand.kind == RuntimeKind::PjrtPlugin {
                report.pjrt_api_version = Library::open_loaded(&cand.path).ok().and_then(|l| pjrt::pjrt_api(&l, &cand.path).ok()).map(|a| a.version());
            }
            out.push(report);
        }
    }
    for (path, reason) in missing {
        let kind = if xla_extension::is_xla_extension(&path) { RuntimeKind::XlaExtension } else { RuntimeKind::PjrtPlugin };
        out.push(RuntimeReport::new(kind, path.display().to_string()).failed(reason));
    }
    (out, st.counters)
}

/// What loading a PJRT plugin did.
#[derive(Clone, Debug)]
pub struct LoadedPlugin {
    pub path: String,
    pub pjrt_api_version: xla_ffi::ApiVersion,
    /// False when the plugin was in the process already (someone else initialised it).
    pub newly_loaded: bool,
    pub extension_types: Vec<i32>,
}

/// Loads the PJRT plugin at `path` into this process for good and runs
/// `PJRT_Plugin_Initialize` once, unless it was loaded already. Registration is a separate step.
pub fn load_pjrt_plugin(path: &Path) -> Result<LoadedPlugin, String> {
    let real = std::fs::canonicalize(path).map_err(|e| format!("cannot load {}: {e}", path.display()))?;
    let mut st = state();
    let already = Library::open_loaded(&real).is_ok();
    let lib = Library::load(&real)?;
    let api = pjrt::pjrt_api(&lib, &real)?; // dropping `lib` on error unloads a non-plugin we loaded
    let newly_loaded = !already && !st.loaded_plugins.contains(&real);
    if newly_loaded {
        api.initialize().map_err(|e| format!("PJRT_Plugin_Initialize failed for {}: {e}", real.display()))?;
        st.loaded_plugins.push(real.clone());
    }
    lib.keep_loaded();
    Ok(LoadedPlugin { path: real.display().to_string(), pjrt_api_version: api.version(), newly_loaded, extension_types: api.extension_types() })
}

/// Totals so far.
pub fn counters() -> Counters {
    state().counters
}
