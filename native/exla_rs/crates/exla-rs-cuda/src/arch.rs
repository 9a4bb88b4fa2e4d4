//! GPU targets for the embedded kernels, as `EXLA_RS_CUDA_ARCHS` names them. Shared with build.rs
//! (included there with `#[path]`), so the parser the build uses is the one the tests check.

/// One nvcc target: machine code (`sm_90`) or PTX for JIT on newer GPUs (`compute_90`). The `a`
/// suffix (`sm_90a`) selects architecture-specific instructions (wgmma, setmaxnreg) that run only
/// on that exact architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Sass { major: u32, minor: u32, arch_specific: bool },
    Ptx { major: u32, minor: u32, arch_specific: bool },
}

/// Machine code for Ampere (sm_80) and Hopper (sm_90), plus compute_90 PTX that the driver
/// JIT-compiles on anything newer (Blackwell). sm_86 (A10/RTX 30) and sm_89 (L4/RTX 40) run the
/// sm_80 images: SASS of one major version runs on its later minor versions, and flash-attention
/// ships the same two. Building them as well would double the nvcc time of the kernel set, which
/// has one instantiation per feature set (config.rs FeatureSet); name them in `EXLA_RS_CUDA_ARCHS`
/// to have them tuned for. CUDA 13's nvcc no longer targets anything before sm_75, and the kernels
/// need sm_80.
pub const DEFAULT_ARCHS: &str = "sm_80,sm_90,compute_90";

/// The oldest architecture the kernels support (cp.async, bf16 mma.sync).
pub const MIN_ARCH: (u32, u32) = (8, 0);

impl Target {
    pub fn version(&self) -> (u32, u32) {
        match *self {
            Target::Sass { major, minor, .. } | Target::Ptx { major, minor, .. } => (major, minor),
        }
    }

    fn suffix(arch_specific: bool) -> &'static str {
        if arch_specific {
            "a"
        } else {
            ""
        }
    }

    /// The name as written in `EXLA_RS_CUDA_ARCHS`: `sm_90a`, `compute_90`.
    pub fn name(&self) -> String {
        match *self {
            Target::Sass { major, minor, arch_specific } => format!("sm_{major}{minor}{}", Self::suffix(arch_specific)),
            Target::Ptx { major, minor, arch_specific } => {
                format!("compute_{major}{minor}{}", Self::suffix(arch_specific))
            }
        }
    }

    /// The nvcc `-gencode` value.
    pub fn gencode(&self) -> String {
        match *self {
            Target::Sass { major, minor, arch_specific } => {
                let s = Self::suffix(arch_specific);
                format!("arch=compute_{major}{minor}{s},code=sm_{major}{minor}{s}")
            }
            Target::Ptx { major, minor, arch_specific } => {
                let s = Self::suffix(arch_specific);
                format!("arch=compute_{major}{minor}{s},code=compute_{major}{minor}{s}")
            }
        }
    }
}

/// Parses `sm_80,sm_90a,compute_90` (commas or spaces). Errors name the offending entry.
pub fn parse_arch_list(list: &str) -> Result<Vec<Target>, String> {
    let mut out: Vec<Target> = Vec::new();
    for item in list.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()) {
        let t = parse_target(item)?;
        if !out.contains(&t) {
            out.push(t);
        }
    }
    if out.is_empty() {
        return Err(format!("no CUDA architecture in {list:?} (expected e.g. {DEFAULT_ARCHS:?})"));
    }
    Ok(out)
}

fn parse_target(item: &str) -> Result<Target, String> {
    let bad = |why: &str| {
        format!("bad CUDA architecture {item:?} in EXLA_RS_CUDA_ARCHS: {why} (expected sm_XY, sm_XYa or compute_XY, e.g. {DEFAULT_ARCHS:?})")
    };
    let (ptx, rest) = if let Some(r) = item.strip_prefix("sm_") {
        (false, r)
    } else if let Some(r) = item.strip_prefix("compute_") {
        (true, r)
    } else {
        return Err(bad("unknown prefix"));
    };
    let (digits, arch_specific) = match rest.strip_suffix('a') {
        Some(d) => (d, true),
        None => (rest, false),
    };
    if digits.len() < 2 || digits.len() > 3 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad("the version must be 2 or 3 digits"));
    }
    let n: u32 = digits.parse().map_err(|_| bad("not a number"))?;
    let (major, minor) = (n / 10, n % 10);
    if (major, minor) < MIN_ARCH {
        return Err(bad("the kernels need sm_80 or newer (cp.async, bf16 tensor cores)"));
    }
    Ok(if ptx { Target::Ptx { major, minor, arch_specific } } else { Target::Sass { major, minor, arch_specific } })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_list_parses_to_sass_and_ptx() {
        let t = parse_arch_list(DEFAULT_ARCHS).unwrap();
        let names: Vec<String> = t.iter().map(|t| t.name()).collect();
        assert_eq!(names, ["sm_80", "sm_90", "compute_90"]);
        assert_eq!(t[1].gencode(), "arch=compute_90,code=sm_90");
        assert_eq!(t[2].gencode(), "arch=compute_90,code=compute_90");
    }

    #[test]
    fn arch_specific_and_three_digit_versions() {
        let t = parse_arch_list("sm_90a sm_100,compute_120,sm_90a").unwrap();
        assert_eq!(t.len(), 3, "duplicates are dropped");
        assert_eq!(t[0], Target::Sass { major: 9, minor: 0, arch_specific: true });
        assert_eq!(t[0].gencode(), "arch=compute_90a,code=sm_90a");
        assert_eq!(t[1], Target::Sass { major: 10, minor: 0, arch_specific: false });
        assert_eq!(t[2].name(), "compute_120");
    }

    #[test]
    fn bad_entries_are_named() {
        for bad in ["sm_75", "sm_8", "gfx90a", "sm_9x", "compute_", ""] {
            let e = parse_arch_list(bad).unwrap_err();
            assert!(e.contains("EXLA_RS_CUDA_ARCHS") || e.contains("no CUDA architecture"), "{bad}: {e}");
        }
        assert!(parse_arch_list("sm_70").unwrap_err().contains("sm_70"));
    }
}
