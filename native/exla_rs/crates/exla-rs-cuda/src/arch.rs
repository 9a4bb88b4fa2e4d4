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

/// Machine code for Ampere (sm_80) and Hopper (sm_90), plus compute_80 PTX that the driver
/// JIT-compiles on anything newer (Blackwell). sm_86 (A10/RTX 30) and sm_89 (L4/RTX 40) run the
/// sm_80 images: SASS of one major version runs on its later minor versions, and flash-attention
/// ships the same two. Building them as well would double the nvcc time of the kernel set, which
/// has one instantiation per feature set (config.rs FeatureSet); name them in `EXLA_RS_CUDA_ARCHS`
/// to have them tuned for. CUDA 13's nvcc no longer targets anything before sm_75, and the kernels
/// need sm_80.
///
/// The PTX is compute_80, not compute_90: all three images then come from one front-end (cicc)
/// pass, the larger half of nvcc's time per file (see [`gencodes`]). The mma.sync kernels use
/// nothing past sm_80 (no `__CUDA_ARCH__` test anywhere in `kernels/`), so the sm_90 machine code
/// ptxas makes from compute_80 PTX runs the same instructions, and so does a JIT of it.
pub const DEFAULT_ARCHS: &str = "sm_80,sm_90,compute_80";

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

/// nvcc's `-gencode` values for a list of targets, with as few front-end (cicc) passes as the list
/// allows: nvcc runs cicc once per virtual architecture (`arch=compute_XY`), and ptxas once per
/// machine-code image. Machine code of every plain target is assembled from the PTX of the lowest
/// plain architecture in the list (ptxas takes older PTX for newer GPUs), with that PTX embedded
/// when the list asks for it; a PTX target above it, and each arch-specific (`a`) target, needs
/// its own pass. `sm_80,sm_90,compute_80` is one pass:
/// `arch=compute_80,code=[sm_80,sm_90,compute_80]`.
#[allow(dead_code)] // build.rs's (this file is included there); the library only reports targets
pub fn gencodes(targets: &[Target]) -> Vec<String> {
    let plain = |t: &&Target| !matches!(t, Target::Sass { arch_specific: true, .. } | Target::Ptx { arch_specific: true, .. });
    let mut out = Vec::new();
    if let Some(base) = targets.iter().filter(plain).map(|t| t.version()).min() {
        let ptx_base = Target::Ptx { major: base.0, minor: base.1, arch_specific: false };
        let codes: Vec<String> = targets
            .iter()
            .filter(plain)
            .filter(|t| matches!(t, Target::Sass { .. }) || **t == ptx_base)
            .map(|t| t.name())
            .collect();
        out.push(format!("arch={},code=[{}]", ptx_base.name(), codes.join(",")));
        for t in targets.iter().filter(plain).filter(|t| matches!(t, Target::Ptx { .. }) && **t != ptx_base) {
            out.push(t.gencode());
        }
    }
    out.extend(targets.iter().filter(|t| !plain(t)).map(|t| t.gencode()));
    out
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
        assert_eq!(names, ["sm_80", "sm_90", "compute_80"]);
        assert_eq!(t[1].gencode(), "arch=compute_90,code=sm_90");
        assert_eq!(t[2].gencode(), "arch=compute_80,code=compute_80");
        // One front-end pass makes all three images.
        assert_eq!(gencodes(&t), ["arch=compute_80,code=[sm_80,sm_90,compute_80]"]);
    }

    #[test]
    fn gencodes_share_a_front_end_pass_where_the_list_allows() {
        let g = |list: &str| gencodes(&parse_arch_list(list).unwrap());
        // PTX above the lowest machine code needs its own pass; arch-specific targets always do.
        assert_eq!(g("sm_80,sm_90,compute_90"), ["arch=compute_80,code=[sm_80,sm_90]", "arch=compute_90,code=compute_90"]);
        assert_eq!(g("sm_90a"), ["arch=compute_90a,code=sm_90a"]);
        assert_eq!(g("sm_90,sm_90a,compute_90"), ["arch=compute_90,code=[sm_90,compute_90]", "arch=compute_90a,code=sm_90a"]);
        // The lowest plain architecture sets the pass even when it is PTX only.
        assert_eq!(g("compute_80,sm_86,sm_89"), ["arch=compute_80,code=[compute_80,sm_86,sm_89]"]);
        assert_eq!(g("sm_100"), ["arch=compute_100,code=[sm_100]"]);
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
