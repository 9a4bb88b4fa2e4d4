//! The kernels this build carries: per instantiation file its fatbin (when nvcc ran at build time)
//! and its self-contained source (always, for NVRTC). Also a reader for the fatbin container, so
//! tests and `kernel_build()` can say which GPU targets are really inside.

/// Which instantiation set a file belongs to; it fixes the targets it is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSet {
    /// `kernels/inst`: mma.sync kernels, every target of `EXLA_RS_CUDA_ARCHS`.
    MmaSync,
    /// `kernels/sm90/inst`: wgmma/TMA kernels, machine code for `sm_90a` only (built when the
    /// list has a 9.0 target); they run on compute capability 9.0 and nowhere else.
    Sm90a,
}

/// One `kernels/inst/*.cu` or `kernels/sm90/inst/*.cu` file.
#[derive(Debug)]
pub struct KernelFile {
    /// The file stem, e.g. `fwd_bf16_d128`, `sm90_fwd_bf16_d128`.
    pub name: &'static str,
    pub set: KernelSet,
    pub fatbin: Option<&'static [u8]>,
    /// The source with its headers inlined.
    pub source: &'static str,
}

include!(concat!(env!("OUT_DIR"), "/exla_rs_kernels.rs"));

pub fn find(name: &str) -> Option<&'static KernelFile> {
    KERNEL_FILES.iter().find(|k| k.name == name)
}

/// Magic number that starts a fatbin (`fatBinaryHeader` in CUDA's fatbinary_section.h).
pub const FATBIN_MAGIC: u32 = 0xBA55_ED50;

/// What one fatbin entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Image {
    /// Machine code for `sm_{arch}` (arch = 10 * major + minor).
    Sass(u32),
    /// PTX for `compute_{arch}`.
    Ptx(u32),
}

impl Image {
    pub fn name(&self) -> String {
        match self {
            Image::Sass(a) => format!("sm_{a}"),
            Image::Ptx(a) => format!("compute_{a}"),
        }
    }
}

/// Lists the images of a fatbin: header `{u32 magic, u16 version, u16 header_size, u64 size}`, then
/// entries `{u16 kind (1 PTX, 2 ELF), u16 flags, u32 header_size, u64 payload_size, ..., u32 arch
/// at offset 28}` each followed by its payload. Errors say where the container is malformed.
pub fn fatbin_images(bytes: &[u8]) -> Result<Vec<Image>, String> {
    let u16_at = |o: usize| bytes.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| bytes.get(o..o + 4).map(|b| u32::from_le_bytes(b.try_into().unwrap()));
    let u64_at = |o: usize| bytes.get(o..o + 8).map(|b| u64::from_le_bytes(b.try_into().unwrap()));
    let magic = u32_at(0).ok_or("fatbin shorter than its header")?;
    if magic != FATBIN_MAGIC {
        return Err(format!("not a fatbin: magic {magic:#010x}, expected {FATBIN_MAGIC:#010x}"));
    }
    let header = u16_at(6).unwrap() as usize;
    let size = u64_at(8).ok_or("truncated fatbin header")? as usize;
    let end = header.checked_add(size).filter(|&e| e <= bytes.len()).ok_or("fatbin size exceeds the data")?;
    let mut images = Vec::new();
    let mut at = header;
    while at < end {
        let kind = u16_at(at).ok_or("truncated entry")?;
        let eh = u32_at(at + 4).ok_or("truncated entry")? as usize;
        let payload = u64_at(at + 8).ok_or("truncated entry")? as usize;
        let arch = u32_at(at + 28).ok_or("truncated entry")?;
        images.push(match kind {
            1 => Image::Ptx(arch),
            2 => Image::Sass(arch),
            k => return Err(format!("unknown fatbin entry kind {k} at offset {at}")),
        });
        if eh == 0 {
            return Err(format!("zero-sized entry header at offset {at}"));
        }
        at = at.checked_add(eh).and_then(|a| a.checked_add(payload)).ok_or("entry size overflows")?;
    }
    if at != end {
        return Err(format!("entries end at {at}, the fatbin at {end}"));
    }
    Ok(images)
}
