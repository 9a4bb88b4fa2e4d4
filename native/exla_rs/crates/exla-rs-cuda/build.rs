//! Compiles `kernels/inst/*.cu` (one kernel instantiation per file) to fatbins with nvcc when one is
//! found, in parallel, and writes `$OUT_DIR/exla_rs_kernels.rs`: for every file its fatbin (or
//! none) and its source with the headers inlined, which NVRTC compiles at first use when the
//! fatbin has no image for the GPU (or nvcc was absent at build time).
//!
//! Two instantiation sets: `kernels/inst` (mma.sync, every target of the list) and
//! `kernels/sm90/inst` (wgmma/TMA/setmaxnreg, machine code for `sm_90a` only, built whenever the
//! list has a compute capability 9.0 target; `-gencode arch=compute_90a,code=sm_90a`, the form
//! nvcc 13.0 assembles). The table records each file's set so the loader and NVRTC pick its arch.
//!
//! Environment: `EXLA_RS_CUDA_ARCHS` (targets, default in src/arch.rs), `EXLA_RS_CUDA_NVCC=0`
//! (skip nvcc: NVRTC only), `NVCC` (the compiler), `CUDA_HOME` / `CUDA_PATH` (`$X/bin/nvcc`), PATH,
//! `EXLA_RS_CUDA_CACHE` (a directory of fatbins keyed by what nvcc is given: the file with its
//! headers inlined, nvcc's version, the flags and targets; every profile and feature set of a
//! checkout then compiles each kernel once: scripts/env.sh sets it under target/).
//! With nvcc present, a kernel that fails to compile fails the build: CI must see it.

#[path = "src/arch.rs"]
#[allow(dead_code)]
mod arch;

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
    let kernels = manifest.join("../../kernels").canonicalize().expect("native/exla_rs/kernels is missing");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed=src/arch.rs");
    for v in ["EXLA_RS_CUDA_ARCHS", "EXLA_RS_CUDA_NVCC", "NVCC", "CUDA_HOME", "CUDA_PATH", "EXLA_RS_CUDA_CACHE"] {
        println!("cargo:rerun-if-env-changed={v}");
    }

    let arch_list = std::env::var("EXLA_RS_CUDA_ARCHS").unwrap_or_else(|_| arch::DEFAULT_ARCHS.to_string());
    let targets = arch::parse_arch_list(&arch_list).unwrap_or_else(|e| panic!("{e}"));

    let list_cu = |dir: PathBuf| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        v.sort();
        assert!(!v.is_empty(), "no kernels in {}", dir.display());
        v
    };
    let mma_files = list_cu(kernels.join("inst"));
    let sm90_files = list_cu(kernels.join("sm90/inst"));
    let files: Vec<PathBuf> = mma_files.iter().chain(&sm90_files).cloned().collect();
    // The sm_90a set is built when the list targets compute capability 9.0 machine code.
    let sm90_target = arch::Target::Sass { major: 9, minor: 0, arch_specific: true };
    let build_sm90 = targets.iter().any(|t| matches!(t, arch::Target::Sass { .. }) && t.version() == (9, 0));

    // Sources with their includes inlined: NVRTC then needs no include path or header list.
    let flat_dir = out.join("flat");
    std::fs::create_dir_all(&flat_dir).unwrap();
    for f in &files {
        let mut seen = HashSet::new();
        let text = flatten(f, &mut seen);
        std::fs::write(flat_dir.join(f.file_name().unwrap()), text).unwrap();
    }

    let disabled = matches!(std::env::var("EXLA_RS_CUDA_NVCC").as_deref(), Ok("0" | "off" | "false" | "no"));
    let nvcc = if disabled { None } else { find_nvcc() };
    let (nvcc_version, note) = match (&nvcc, disabled) {
        (Some(n), _) => (Some(nvcc_version(n)), None),
        (None, true) => (None, Some("nvcc disabled by EXLA_RS_CUDA_NVCC".to_string())),
        (None, false) => {
            let why = "nvcc not found (NVCC, CUDA_HOME, CUDA_PATH, PATH)".to_string();
            println!("cargo:warning=exla-rs-cuda: {why}: embedding kernel sources only; they are compiled with NVRTC at first use");
            (None, Some(why))
        }
    };
    let mut jobs: Vec<(&PathBuf, Vec<arch::Target>)> = mma_files.iter().map(|f| (f, targets.clone())).collect();
    if build_sm90 {
        jobs.extend(sm90_files.iter().map(|f| (f, vec![sm90_target])));
    }
    if let (Some(nvcc), Some(version)) = (&nvcc, &nvcc_version) {
        let cache = std::env::var_os("EXLA_RS_CUDA_CACHE").filter(|d| !d.is_empty()).map(PathBuf::from);
        compile_all(&Nvcc { path: nvcc, version, cache: cache.as_deref() }, &jobs, &out, &kernels, &flat_dir);
    }

    // Feature gpu-on-cpu with the executor built under a sanitizer (exla-rs-gpusim's `links`
    // metadata): the harness and the tests link the sanitizer's runtime the way -fsanitize= links
    // it (first in the library list, which AddressSanitizer insists on).
    println!("cargo:rerun-if-env-changed=DEP_EXLA_RS_GPUSIM_SANITIZE");
    if let Ok(s) = std::env::var("DEP_EXLA_RS_GPUSIM_SANITIZE") {
        println!("cargo:rustc-link-arg-examples=-fsanitize={s}");
        println!("cargo:rustc-link-arg-tests=-fsanitize={s}");
    }

    // The generated table.
    let mut g = String::new();
    writeln!(g, "// Generated by build.rs.").unwrap();
    writeln!(g, "pub const NVCC_VERSION: Option<&str> = {:?};", nvcc_version).unwrap();
    writeln!(g, "pub const BUILD_NOTE: Option<&str> = {:?};", note).unwrap();
    let names: Vec<String> = targets.iter().map(|t| t.name()).collect();
    let archs = if nvcc.is_some() { names } else { Vec::new() };
    writeln!(g, "pub const TARGETS: &[&str] = &{:?};", archs).unwrap();
    writeln!(g, "pub static KERNEL_FILES: &[KernelFile] = &[").unwrap();
    for f in &files {
        let stem = f.file_stem().unwrap().to_str().unwrap();
        let sm90 = sm90_files.contains(f);
        let set = if sm90 { "KernelSet::Sm90a" } else { "KernelSet::MmaSync" };
        let fatbin = if nvcc.is_some() && (!sm90 || build_sm90) {
            format!("Some(include_bytes!({:?}))", out.join(format!("{stem}.fatbin")).display().to_string())
        } else {
            "None".to_string()
        };
        let src = flat_dir.join(f.file_name().unwrap()).display().to_string();
        writeln!(g, "    KernelFile {{ name: {stem:?}, set: {set}, fatbin: {fatbin}, source: include_str!({src:?}) }},").unwrap();
    }
    writeln!(g, "];").unwrap();
    std::fs::write(out.join("exla_rs_kernels.rs"), g).unwrap();
}

/// `#include "x"` lines replaced by the file's text (once per file, like `#pragma once`).
fn flatten(path: &Path, seen: &mut HashSet<PathBuf>) -> String {
    let path = path.canonicalize().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    if !seen.insert(path.clone()) {
        return String::new();
    }
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t == "#pragma once" {
            continue;
        }
        if let Some(rest) = t.strip_prefix("#include \"") {
            let inc = rest.trim_end_matches('"');
            out.push_str(&flatten(&path.parent().unwrap().join(inc), seen));
            continue;
        }
        assert!(!t.starts_with("#include <"), "{}: kernels must not include system headers (NVRTC): {t}", path.display());
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn find_nvcc() -> Option<PathBuf> {
    let exe = |p: PathBuf| if p.is_file() { Some(p) } else { None };
    if let Some(p) = std::env::var_os("NVCC") {
        return exe(PathBuf::from(p));
    }
    for v in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(v) {
            if let Some(p) = exe(PathBuf::from(home).join("bin/nvcc")) {
                return Some(p);
            }
        }
    }
    std::env::split_paths(&std::env::var_os("PATH")?).find_map(|d| exe(d.join("nvcc")))
}

fn nvcc_version(nvcc: &Path) -> String {
    let o = Command::new(nvcc).arg("--version").output().unwrap_or_else(|e| panic!("{}: {e}", nvcc.display()));
    let text = String::from_utf8_lossy(&o.stdout);
    // "Cuda compilation tools, release 13.0, V13.0.88"
    text.lines().find(|l| l.contains("release")).unwrap_or("unknown").trim().to_string()
}

/// The compiler, its version, and the fatbin cache if one is set.
struct Nvcc<'a> {
    path: &'a Path,
    version: &'a str,
    cache: Option<&'a Path>,
}

/// Every kernel's nvcc flags, beside its `-gencode` targets.
const NVCC_FLAGS: [&str; 6] = ["-std=c++17", "-O3", "-lineinfo", "-fatbin", "-Xfatbin=-compress-all", "-Xptxas=-warn-spills"];

/// Compiles every file on as many threads as cargo gives this build (NUM_JOBS).
fn compile_all(nvcc: &Nvcc, files: &[(&PathBuf, Vec<arch::Target>)], out: &Path, kernels: &Path, flat_dir: &Path) {
    let jobs: usize = std::env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2))
        .max(1);
    let queue = Mutex::new(files.iter().collect::<Vec<_>>());
    let failures = Mutex::new(Vec::<String>::new());
    let cached = std::sync::atomic::AtomicUsize::new(0);
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        for _ in 0..jobs.min(files.len()) {
            s.spawn(|| loop {
                let Some((f, targets)) = queue.lock().unwrap().pop() else { break };
                match compile_cached(nvcc, f, targets, out, kernels, flat_dir) {
                    Ok(true) => _ = cached.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                    Ok(false) => {}
                    Err(e) => failures.lock().unwrap().push(e),
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    if !failures.is_empty() {
        panic!("nvcc failed on {} kernel file(s):\n{}", failures.len(), failures.join("\n"));
    }
    let mut sets: Vec<String> = files.iter().map(|(_, t)| t.iter().map(|t| t.name()).collect::<Vec<_>>().join(",")).collect();
    sets.dedup();
    let cached = cached.into_inner();
    println!(
        "cargo:warning=exla-rs-cuda: nvcc compiled {} kernel files for {} in {:.0?} ({jobs} jobs){}",
        files.len() - cached,
        sets.join(" + "),
        started.elapsed(),
        if cached > 0 { format!("; {cached} more from the cache") } else { String::new() }
    );
}

/// 128-bit FNV-1a of the parts (two 64-bit lanes with different offsets), as hex: the cache key.
fn fnv128(parts: &[&[u8]]) -> String {
    let mut h = [0xcbf2_9ce4_8422_2325u64, 0x6c62_272e_07bb_0142u64];
    for part in parts {
        for &b in part.iter().chain(&[0xffu8]) {
            for x in h.iter_mut() {
                *x = (*x ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
    }
    format!("{:016x}{:016x}", h[0], h[1])
}

/// The file's fatbin in `out`, from the cache when it holds one for exactly this input, else from
/// nvcc (then stored there, atomically: parallel builds share the directory). Ok(true) = cached.
fn compile_cached(nvcc: &Nvcc, file: &Path, targets: &[arch::Target], out: &Path, kernels: &Path, flat_dir: &Path) -> Result<bool, String> {
    let stem = file.file_stem().unwrap().to_str().unwrap();
    let dst = out.join(format!("{stem}.fatbin"));
    let Some(cache) = nvcc.cache else {
        return compile_one(nvcc, file, targets, &dst, kernels).map(|_| false);
    };
    let flat = std::fs::read(flat_dir.join(file.file_name().unwrap())).map_err(|e| format!("{stem}: {e}"))?;
    let gencodes: Vec<String> = targets.iter().map(|t| t.gencode()).collect();
    let key = fnv128(&[&flat, nvcc.version.as_bytes(), NVCC_FLAGS.join(" ").as_bytes(), gencodes.join(" ").as_bytes()]);
    let entry = cache.join(format!("{stem}-{key}.fatbin"));
    if std::fs::copy(&entry, &dst).is_ok() {
        return Ok(true);
    }
    compile_one(nvcc, file, targets, &dst, kernels)?;
    let tmp = cache.join(format!(".{stem}-{key}.{}", std::process::id()));
    std::fs::create_dir_all(cache)
        .and_then(|_| std::fs::copy(&dst, &tmp))
        .and_then(|_| std::fs::rename(&tmp, &entry))
        .map_err(|e| format!("{stem}: cannot store its fatbin in {}: {e}", cache.display()))?;
    Ok(false)
}

fn compile_one(nvcc: &Nvcc, file: &Path, targets: &[arch::Target], dst: &Path, kernels: &Path) -> Result<(), String> {
    let stem = file.file_stem().unwrap().to_str().unwrap();
    let mut cmd = Command::new(nvcc.path);
    // -lineinfo: compute-sanitizer and profilers map SASS back to the .cuh lines (no speed cost).
    // -compress-all: the driver inflates images at load; the library shrinks from ~30 to ~8 MB.
    cmd.args(NVCC_FLAGS);
    for t in targets {
        cmd.arg("-gencode").arg(t.gencode());
    }
    cmd.arg("-I").arg(kernels).arg("-o").arg(dst).arg(file);
    let o = cmd.output().map_err(|e| format!("{}: cannot run: {e}", nvcc.path.display()))?;
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    if !o.status.success() {
        return Err(format!("--- {}: {:?}\n{log}", file.display(), cmd));
    }
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning=exla-rs-cuda: {stem}: {line}");
    }
    Ok(())
}
