//! Compiles the GPU-on-CPU executor into `libexla_rs_gpusim.a`: every `executor/*.cpp` (the
//! runtime, the PTX models, the generated kernel table) and every kernel instantiation file
//! (`kernels/inst/*.cu`, `kernels/sm90/inst/*.cu`) as host C++ with `EXLA_RS_CPU` defined, so the
//! kernels under test are the same text nvcc compiles.
//!
//! Objects are rebuilt only when their source, one of the headers it included (`-MMD`) or the
//! command line changed, on `NUM_JOBS` threads: the kernel headers are heavy templates and an
//! edit to the runtime should not recompile 37 kernel files.
//!
//! Environment: `CXX` (default `g++`), `AR` (default `ar`), `EXLA_RS_GPUSIM_CXXFLAGS` (extra flags,
//! appended), `EXLA_RS_GPUSIM_SANITIZE` (see [`Mode`]): `thread` / `address` (every unit gets
//! `-DEXLA_RS_GPUSIM_TSAN` / `-DEXLA_RS_GPUSIM_ASAN`, all but the [`UNINSTRUMENTED`] core
//! `-fsanitize=`; final binaries must link with `-fsanitize=` too: dependents read
//! `DEP_EXLA_RS_GPUSIM_SANITIZE`), or `stats` (the statistics build: the kernels' units get
//! ThreadSanitizer's instrumentation, routed by `executor/stats/*.cpp` to the executor's
//! shared-memory bank statistics instead of libtsan; nothing is checked).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

/// What every translation unit is compiled with. `-fno-strict-aliasing`: the kernels reinterpret
/// registers and shared memory the way CUDA code does; `-Wno-psabi`: GCC's note that passing
/// 128-byte-aligned parameters (the sm90 tensor maps) changed ABI in GCC 4.6 concerns mixing
/// compilers, and every caller here is built by the same one. The sanitizer modes add `-g1` (line
/// tables for their reports, [`Mode::flags`]); the plain build's failures are the executor's own
/// messages, and line tables cost it a third of its compile time (bwd d128: 1.7 s, 1.2 s without).
const BASE_FLAGS: [&str; 6] = ["-O2", "-std=c++17", "-DEXLA_RS_CPU", "-fno-strict-aliasing", "-fPIC", "-Wno-psabi"];

/// `executor/` files compiled without sanitizer instrumentation: the executor core. Its
/// bookkeeping and the fibers' stacks are shared by every fiber and ordered by the scheduler, not
/// by GPU rules (executor/README.md, "Sanitizers"), so ThreadSanitizer must not judge them; the
/// core reports the memory effects it performs for a kernel to the sanitizers itself.
const UNINSTRUMENTED: [&str; 2] = ["runtime.cpp", "fiber.cpp"];

/// What `EXLA_RS_GPUSIM_SANITIZE` asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Plain,
    Thread,
    Address,
    Stats,
}

impl Mode {
    fn from_env() -> Result<Mode, String> {
        match std::env::var("EXLA_RS_GPUSIM_SANITIZE").as_deref().map(str::trim) {
            Err(_) | Ok("") | Ok("none") => Ok(Mode::Plain),
            Ok("thread") => Ok(Mode::Thread),
            Ok("address") => Ok(Mode::Address),
            Ok("stats") => Ok(Mode::Stats),
            Ok(other) => Err(format!("EXLA_RS_GPUSIM_SANITIZE={other:?}: expected thread, address, stats or none")),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Plain => "none",
            Mode::Thread => "thread",
            Mode::Address => "address",
            Mode::Stats => "stats",
        }
    }

    /// Flags of every unit: the switch the core keys its sanitizer calls on.
    fn flags(self) -> &'static [&'static str] {
        match self {
            // -fno-omit-frame-pointer: whole stacks in sanitizer reports.
            Mode::Thread => &["-DEXLA_RS_GPUSIM_TSAN", "-fno-omit-frame-pointer", "-g1"],
            Mode::Address => &["-DEXLA_RS_GPUSIM_ASAN", "-fno-omit-frame-pointer", "-g1"],
            Mode::Plain | Mode::Stats => &[],
        }
    }

    /// The instrumentation a unit gets: the sanitizers instrument everything but the core; the
    /// statistics build only the kernels (the models report their own accesses).
    ///
    /// AddressSanitizer's units are compiled at -O0 (after BASE_FLAGS' -O2, so it wins): the build
    /// compiles every kernel to run each harness case once, and its compile was most of the asan
    /// step (a heavy unit, bwd d128: 6.0 s at -O2, 3.5 s at -O1, 0.5 s at -O0); the run, about
    /// 30 s a shard at -O0, costs less than the compile saves. -O0 checks every load and store
    /// the source makes; an optimiser may only remove some. The uninstrumented core keeps -O2:
    /// its scheduler is the run's own overhead.
    fn instrument(self, u: &Unit) -> &'static [&'static str] {
        match self {
            Mode::Thread if u.instrumentable => &["-fsanitize=thread"],
            Mode::Address if u.instrumentable => &["-fsanitize=address", "-O0"],
            Mode::Stats if u.cuda => &["-fsanitize=thread"],
            _ => &[],
        }
    }

    /// The sanitizer runtime binaries must link.
    fn runtime(self) -> Option<&'static str> {
        match self {
            Mode::Thread => Some("tsan"),
            Mode::Address => Some("asan"),
            Mode::Plain | Mode::Stats => None,
        }
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels").canonicalize().expect("native/exla_rs/kernels is missing");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    // The executor's C++ (this crate's executor/) and the kernels it runs (native/exla_rs/kernels),
    // which include the executor's headers as "executor/....hpp": both directories are on the path.
    let executor = manifest.join("executor");
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", executor.display());
    for v in ["CXX", "AR", "EXLA_RS_GPUSIM_SANITIZE", "EXLA_RS_GPUSIM_CXXFLAGS"] {
        println!("cargo:rerun-if-env-changed={v}");
    }

    let mode = Mode::from_env().unwrap_or_else(|e| panic!("{e}"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let mut flags: Vec<String> = BASE_FLAGS.iter().map(|s| s.to_string()).collect();
    flags.push(format!("-I{}", kernels.display()));
    flags.push(format!("-I{}", manifest.display()));
    flags.extend(mode.flags().iter().map(|s| s.to_string()));
    // Last on every command line, so that they win over the mode's and the unit's.
    let extra: Vec<String> = std::env::var("EXLA_RS_GPUSIM_CXXFLAGS").unwrap_or_default().split_whitespace().map(str::to_string).collect();

    let units = sources(&kernels, &executor, mode);
    // One object directory per mode: switching EXLA_RS_GPUSIM_SANITIZE in one target dir
    // (scripts/gpu_on_cpu.sh) re-archives that mode's objects instead of recompiling them.
    let obj_dir = out.join(format!("obj-{}", mode.name()));
    std::fs::create_dir_all(&obj_dir).unwrap();
    let objects = compile_all(&cxx, &flags, &extra, mode, &units, &obj_dir);
    archive(&objects, &out.join("libexla_rs_gpusim.a"));

    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=exla_rs_gpusim");
    if let Some(rt) = mode.runtime() {
        // The runtime the instrumented objects call into, named before libstdc++: AddressSanitizer
        // refuses to start unless its runtime comes first in the executable's library list. A
        // final executable must also be linked with -fsanitize= (dependents learn the mode here).
        println!("cargo:rustc-link-lib=dylib={rt}");
        println!("cargo:sanitize={}", mode.name());
        // This crate's own harness and tests are such executables.
        println!("cargo:rustc-link-arg-examples=-fsanitize={}", mode.name());
        println!("cargo:rustc-link-arg-tests=-fsanitize={}", mode.name());
    }
    if mode != Mode::Plain {
        println!("cargo:rustc-env=EXLA_RS_GPUSIM_SANITIZE_BUILT={}", mode.name());
    }
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

/// One translation unit: its source, whether it is CUDA text (`.cu`, compiled with `-x c++`),
/// whether a sanitizer may instrument it (all but the core), and its object's name (the set as a
/// prefix: stems repeat across directories).
struct Unit {
    src: PathBuf,
    cuda: bool,
    instrumentable: bool,
    obj: String,
}

fn sources(kernels: &Path, executor: &Path, mode: Mode) -> Vec<Unit> {
    let list = |root: &Path, dir: &str, ext: &str| -> Vec<PathBuf> {
        let path = root.join(dir);
        let mut v: Vec<PathBuf> = std::fs::read_dir(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .collect();
        v.sort();
        v
    };
    // (root, directory, extension, object prefix, CUDA text)
    let mut sets = vec![(executor, ".", "cpp", "executor_", false), (kernels, "inst", "cu", "inst_", true), (kernels, "sm90/inst", "cu", "sm90_", true)];
    if mode == Mode::Stats {
        // The instrumentation's entry points, performed by the executor instead of libtsan.
        sets.push((executor, "stats", "cpp", "stats_", false));
    }
    let mut units = Vec::new();
    for (root, dir, ext, prefix, cuda) in sets {
        let files = list(root, dir, ext);
        assert!(!files.is_empty(), "no *.{ext} in {}", root.join(dir).display());
        for src in files {
            let stem = src.file_stem().unwrap().to_str().unwrap().to_string();
            let instrumentable = cuda || !UNINSTRUMENTED.contains(&src.file_name().unwrap().to_str().unwrap());
            units.push(Unit { src, cuda, instrumentable, obj: format!("{prefix}{stem}.o") });
        }
    }
    units
}

/// The compiler's command line for one unit (also its staleness stamp).
fn command_line(cxx: &str, flags: &[String], extra: &[String], mode: Mode, u: &Unit, obj: &Path) -> Vec<String> {
    let mut args = vec![cxx.to_string()];
    args.extend(flags.iter().cloned());
    args.extend(mode.instrument(u).iter().map(|s| s.to_string()));
    args.extend(extra.iter().cloned());
    args.extend(["-MMD".into(), "-MF".into(), obj.with_extension("d").display().to_string(), "-c".into()]);
    if u.cuda {
        args.extend(["-x".into(), "c++".into()]);
    }
    args.push(u.src.display().to_string());
    args.extend(["-o".into(), obj.display().to_string()]);
    args
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Whether `obj` is missing or older than its command line or any file its last compile read.
fn stale(obj: &Path, cmd: &str) -> bool {
    let (Some(built), Ok(stamp), Ok(deps)) = (
        mtime(obj),
        std::fs::read_to_string(obj.with_extension("cmd")),
        std::fs::read_to_string(obj.with_extension("d")),
    ) else {
        return true;
    };
    if stamp != cmd {
        return true;
    }
    // "x.o: a.cu b.cuh \\\n c.hpp": every token after the target is an input (our paths have no
    // spaces; a vanished header makes the object stale too).
    deps.split_whitespace()
        .skip(1)
        .filter(|t| *t != "\\")
        .any(|dep| match mtime(Path::new(dep)) {
            Some(t) => t > built,
            None => true,
        })
}

/// Compiles the stale units on `NUM_JOBS` threads; returns every object, in unit order.
fn compile_all(cxx: &str, flags: &[String], extra: &[String], mode: Mode, units: &[Unit], obj_dir: &Path) -> Vec<PathBuf> {
    let jobs: usize = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2))
        .max(1);
    let mut todo = Vec::new();
    for u in units {
        let obj = obj_dir.join(&u.obj);
        let cmd = command_line(cxx, flags, extra, mode, u, &obj);
        if stale(&obj, &cmd.join(" ")) {
            todo.push((obj, cmd));
        }
    }
    let count = todo.len();
    let queue = Mutex::new(todo);
    let failures = Mutex::new(Vec::<String>::new());
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.min(count) {
            s.spawn(|| loop {
                let Some((obj, cmd)) = queue.lock().unwrap().pop() else { break };
                if let Err(e) = compile_one(&obj, &cmd) {
                    failures.lock().unwrap().push(e);
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    if !failures.is_empty() {
        panic!("{cxx} failed on {} of {count} file(s):\n{}", failures.len(), failures.join("\n"));
    }
    if count > 0 {
        println!(
            "cargo:warning=exla-rs-gpusim: {cxx} compiled {count} of {} files in {:.0?} ({jobs} jobs)",
            units.len(),
            started.elapsed()
        );
    }
    units.iter().map(|u| obj_dir.join(&u.obj)).collect()
}

fn compile_one(obj: &Path, cmd: &[String]) -> Result<(), String> {
    let stamp = obj.with_extension("cmd");
    // A failed or interrupted compile must not leave a stamp that reads as up to date.
    let _ = std::fs::remove_file(&stamp);
    let o = Command::new(&cmd[0]).args(&cmd[1..]).output().map_err(|e| format!("{}: cannot run: {e}", cmd[0]))?;
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if !o.status.success() {
        return Err(format!("--- {}\n{log}", cmd.join(" ")));
    }
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning=exla-rs-gpusim: {line}");
    }
    std::fs::write(&stamp, cmd.join(" ")).map_err(|e| format!("{}: {e}", stamp.display()))
}

/// A fresh archive of exactly `objects` (objects of deleted sources must not linger in it).
fn archive(objects: &[PathBuf], lib: &Path) {
    let ar = std::env::var("AR").unwrap_or_else(|_| "ar".into());
    let _ = std::fs::remove_file(lib);
    let o = Command::new(&ar)
        .arg("crs")
        .arg(lib)
        .args(objects)
        .output()
        .unwrap_or_else(|e| panic!("{ar}: cannot run: {e}"));
    assert!(o.status.success(), "{ar} crs {} failed: {}", lib.display(), String::from_utf8_lossy(&o.stderr));
}
