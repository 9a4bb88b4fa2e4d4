//! What can be checked with no GPU: the embedded kernels, and that every entry point answers
//! with a clean error (never a panic) when the driver or the kernel is missing.

use exla_rs_attn::{AttnError, AttnOptions, AttnShape, ElementType, Pass};
use exla_rs_cuda::embedded::{self, fatbin_images, Image, FATBIN_MAGIC};
use exla_rs_cuda::{backward, forward, kernel_build, parse_arch_list, status, workspace_bytes, BwdBuffers, FwdBuffers, Stream, Target};

fn shape(d: usize) -> AttnShape {
    AttnShape { batch: 2, seq_q: 33, seq_k: 47, heads: 4, kv_heads: 2, head_dim: d }
}
const OPTS: AttnOptions = AttnOptions { scale: 0.125, softcap: 0.0, window_left: -1, window_right: 0 };

fn driver_present() -> bool {
    // The same probe the crate uses: libcuda loadable by name.
    ["libcuda.so", "libcuda.so.1"].iter().any(|n| {
        let c = std::ffi::CString::new(*n).unwrap();
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        let h = if h.is_null() { unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY) } } else { h };
        !h.is_null()
    })
}

#[test]
fn every_kernel_file_is_embedded_with_a_self_contained_source() {
    let files = embedded::KERNEL_FILES;
    // kernels/generate.py writes 128 files to kernels/inst (aux, 6 f32, 96 tensor-core files: 2
    // passes x 2 dtypes x 6 head dims x 4 feature sets, and the split-KV decode's 24: 2 dtypes x 6
    // head dims x 2 feature sets, plus its combine), all embedded; the Hopper set
    // (kernels/sm90/inst, its own generate.py) is embedded by builds that know it.
    let stems = |dir: &str| -> Vec<String> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels").join(dir);
        std::fs::read_dir(path).map_or_else(|_| Vec::new(), |d| {
            d.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cu"))
                .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
                .collect()
        })
    };
    let inst = stems("inst");
    assert_eq!(inst.len(), 128, "kernels/generate.py writes 128 files");
    let sm90 = stems("sm90/inst");
    for name in &inst {
        assert!(files.iter().any(|k| k.name == name.as_str()), "{name} is not embedded");
    }
    for k in files {
        assert!(inst.iter().chain(&sm90).any(|n| n == k.name), "{} is embedded but is no kernels/inst or sm90/inst file", k.name);
    }
    for k in files {
        assert!(k.source.contains("extern \"C\" __global__"), "{}", k.name);
        // Every include is inlined for NVRTC; the ones left are the GPU-on-CPU executor's headers,
        // named through an EXLA_RS_CPU_* macro defined inside `#if defined(EXLA_RS_CPU)` (common.cuh,
        // sm90/hopper.cuh), which NVRTC never sees.
        for line in k.source.lines().map(str::trim).filter(|l| l.starts_with("#include")) {
            let mac = line.strip_prefix("#include EXLA_RS_CPU_").map(|m| format!("#define EXLA_RS_CPU_{m} "));
            assert!(mac.is_some_and(|m| k.source.contains(&m)), "{}: includes must be inlined for NVRTC: {line}", k.name);
        }
    }
}

#[test]
fn fatbins_hold_exactly_the_configured_targets() {
    let info = kernel_build();
    assert!(info.nvrtc_fallback);
    // CI sources scripts/env.sh (CUDA_HOME = pip nvcc): then every kernel must have been compiled.
    // build.rs reruns when CUDA_HOME changes, so this test never sees a stale source-only build.
    let nvcc_expected = std::env::var_os("CUDA_HOME").is_some_and(|h| std::path::Path::new(&h).join("bin/nvcc").is_file())
        && !matches!(std::env::var("EXLA_RS_CUDA_NVCC").as_deref(), Ok("0" | "off" | "false" | "no"))
        && std::env::var_os("NVCC").is_none();
    if nvcc_expected {
        assert!(info.nvcc_version.is_some(), "CUDA_HOME has nvcc but the build embedded no fatbins: {:?}", info.note);
    }
    if info.nvcc_version.is_none() {
        // Built without nvcc: nothing embedded but sources, and kernel_build says why.
        assert!(embedded::KERNEL_FILES.iter().all(|k| k.fatbin.is_none()));
        assert!(info.embedded_archs.is_empty() && info.note.is_some());
        return;
    }
    let targets = parse_arch_list(&embedded::TARGETS.join(",")).unwrap();
    let want: Vec<Image> = targets
        .iter()
        .map(|t| match *t {
            Target::Sass { major, minor, .. } => Image::Sass(major * 10 + minor),
            Target::Ptx { major, minor, .. } => Image::Ptx(major * 10 + minor),
        })
        .collect();
    assert!(!info.embedded_archs.is_empty());
    // The sm_90a set: exactly sm_90a machine code (the fatbin records arch 90), built whenever
    // the list has a 9.0 machine-code target, absent otherwise.
    let sm90_built = targets.iter().any(|t| matches!(t, Target::Sass { .. }) && t.version() == (9, 0));
    for k in embedded::KERNEL_FILES.iter().filter(|k| k.set == embedded::KernelSet::Sm90a) {
        match (k.fatbin, sm90_built) {
            (Some(fb), true) => assert_eq!(fatbin_images(fb).unwrap(), [Image::Sass(90)], "{}", k.name),
            (None, false) => {}
            (fb, _) => panic!("{}: fatbin present = {}, sm_90 in the list = {sm90_built}", k.name, fb.is_some()),
        }
    }
    for k in embedded::KERNEL_FILES.iter().filter(|k| k.set == embedded::KernelSet::MmaSync) {
        let fb = k.fatbin.unwrap_or_else(|| panic!("{} has no fatbin", k.name));
        assert_eq!(u32::from_le_bytes(fb[..4].try_into().unwrap()), FATBIN_MAGIC, "{}", k.name);
        let mut got = fatbin_images(fb).unwrap_or_else(|e| panic!("{}: {e}", k.name));
        let mut want = want.clone();
        got.sort_by_key(|i| format!("{i:?}"));
        want.sort_by_key(|i| format!("{i:?}"));
        assert_eq!(got, want, "{}", k.name);
    }
    // The default build carries Ampere (also run by Ada) and Hopper machine code plus PTX for newer GPUs.
    if std::env::var("EXLA_RS_CUDA_ARCHS").is_err() {
        assert_eq!(info.embedded_archs, ["sm_80", "sm_90"]);
        assert_eq!(info.ptx_arch.as_deref(), Some("compute_80"));
    }
}

#[test]
fn fatbin_reader_rejects_garbage() {
    assert!(fatbin_images(b"\x7fELF....").unwrap_err().contains("not a fatbin"));
    let mut fake = FATBIN_MAGIC.to_le_bytes().to_vec();
    fake.extend_from_slice(&[1, 0, 16, 0]);
    fake.extend_from_slice(&1000u64.to_le_bytes());
    assert!(fatbin_images(&fake).unwrap_err().contains("exceeds"));
}

#[test]
fn status_never_panics_and_explains_itself() {
    let st = status();
    if st.available {
        assert!(!st.devices.is_empty() && st.reason.is_none());
    } else {
        let why = st.reason.expect("unavailable without a reason");
        assert!(!why.is_empty());
        if !driver_present() {
            assert!(why.contains("libcuda"), "{why}");
            assert!(st.devices.is_empty() && st.driver_version.is_none());
        }
    }
    assert_eq!(status(), status(), "stable across calls");
}

#[test]
fn forward_and_backward_without_a_driver_are_clean_errors() {
    if driver_present() {
        return; // exercised by test/gpu on a GPU machine
    }
    for dtype in [ElementType::F32, ElementType::F16, ElementType::BF16] {
        let s = shape(64);
        let f = unsafe { forward(Stream::Cuda(std::ptr::null_mut()), dtype, &s, &OPTS, &FwdBuffers::default()) };
        match f {
            Err(AttnError::Unimplemented(m)) => assert!(m.contains("no CUDA driver"), "{m}"),
            other => panic!("forward: {other:?}"),
        }
        let ws = workspace_bytes(Pass::Backward, dtype, &s).unwrap();
        let bufs = BwdBuffers { workspace_bytes: ws, ..Default::default() };
        match unsafe { backward(Stream::Cuda(std::ptr::null_mut()), dtype, &s, &OPTS, &bufs) } {
            Err(AttnError::Unimplemented(m)) => assert!(m.contains("libcuda"), "{m}"),
            other => panic!("backward: {other:?}"),
        }
    }
}

#[test]
fn unsupported_head_dim_is_unimplemented_before_touching_the_driver() {
    // Every D in 1..=256 runs (natively or padded); past that, nothing.
    let s = shape(300);
    assert_eq!(workspace_bytes(Pass::Forward, ElementType::BF16, &s), None);
    match unsafe { forward(Stream::Cuda(std::ptr::null_mut()), ElementType::BF16, &s, &OPTS, &FwdBuffers::default()) } {
        Err(AttnError::Unimplemented(m)) => assert!(m.contains("D=300"), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_padded_head_dim_needs_its_workspace_before_touching_the_driver() {
    // D = 80 runs on D = 96 through zero-padded copies in the workspace, the forward's included.
    let s = shape(80);
    let need = workspace_bytes(Pass::Forward, ElementType::BF16, &s).unwrap();
    assert!(need > 0);
    match unsafe { forward(Stream::Cuda(std::ptr::null_mut()), ElementType::BF16, &s, &OPTS, &FwdBuffers::default()) } {
        Err(AttnError::InvalidArgument(m)) => assert!(m.contains(&need.to_string()), "{m}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_short_workspace_is_an_invalid_argument() {
    let s = shape(128);
    let need = workspace_bytes(Pass::Backward, ElementType::F16, &s).unwrap();
    assert!(need > 0);
    let bufs = BwdBuffers { workspace_bytes: need - 1, ..Default::default() };
    match unsafe { backward(Stream::Cuda(std::ptr::null_mut()), ElementType::F16, &s, &OPTS, &bufs) } {
        Err(AttnError::InvalidArgument(m)) => assert!(m.contains(&need.to_string()), "{m}"),
        other => panic!("{other:?}"),
    }
}
