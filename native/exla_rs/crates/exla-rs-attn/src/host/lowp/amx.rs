//! The AMX units (`TDPBF16PS` on AMX-BF16, `TDPFP16PS` on AMX-FP16) through stable inline `asm!`
//! (Rust's AMX intrinsics and `is_x86_feature_detected!("amx-…")` are unstable).
//!
//! Tiles: `tmm0` = C, `tmm1` = A, `tmm2` = B ([`super::tile`]); one `ldtilecfg` of
//! [`LOWP_TILES`] per task ([`TileUnit::begin`]) and a `tilerelease` when the task ends
//! ([`TileUnit::end`], also on unwinding through [`super::unit::UnitScope`]). The tile state is
//! per thread; configuring per task rather than once per rayon worker costs one `ldtilecfg`
//! per (batch, head, 64 query rows) and leaves no worker holding configured tiles, which would
//! make the kernel save 8 KiB of tile data on every context switch of that thread, keep the
//! core out of its deeper idle states, and surprise other AMX code sharing the thread.
//!
//! Linux hands out AMX's tile data state only on request: `arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`, once per process ([`detected`]). Where that fails (another OS, an old
//! kernel, a seccomp filter), the units are simply not offered and the next one is used.

use std::sync::OnceLock;

use core::arch::asm;
use core::arch::x86_64::{__cpuid, __cpuid_count};

use super::model::Half16;
use super::tile::{LOWP_TILES, TILE_K, TILE_M};
use super::unit::{TileGemm, TileUnit};

/// Which AMX units this process may use (CPU has them and the OS granted the tile state).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AmxCaps {
    pub bf16: bool,
    pub fp16: bool,
}

pub(crate) fn detected() -> AmxCaps {
    static CAPS: OnceLock<AmxCaps> = OnceLock::new();
    *CAPS.get_or_init(|| {
        let (tile, bf16, fp16) = cpuid_bits();
        // The row kernels next to the unit are the AVX-512 ones.
        if !(tile && bf16 && is_x86_feature_detected!("avx512f") && os_grants_tiles()) {
            return AmxCaps::default();
        }
        AmxCaps { bf16, fp16 }
    })
}

/// (AMX-TILE, AMX-BF16, AMX-FP16) from CPUID leaf 7: sub-leaf 0 EDX bits 24 and 22, sub-leaf 1
/// EAX bit 21.
fn cpuid_bits() -> (bool, bool, bool) {
    // Leaf 7 only if the CPU has it (sub-leaf 1 only if leaf 7 says it has one).
    if __cpuid(0).eax < 7 {
        return (false, false, false);
    }
    let l0 = __cpuid_count(7, 0);
    let fp16 = l0.eax >= 1 && __cpuid_count(7, 1).eax & (1 << 21) != 0;
    (l0.edx & (1 << 24) != 0, l0.edx & (1 << 22) != 0, fp16)
}

#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permitted xsave
    // features; it writes no memory of ours.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// `TDPBF16PS` (`F16 = false`) or `TDPFP16PS` (`F16 = true`).
pub(crate) struct Amx<const F16: bool>;

impl<const F16: bool> TileUnit for Amx<F16> {
    const ELEM: Half16 = if F16 { Half16::F16 } else { Half16::Bf16 };

    unsafe fn begin() {
        let cfg = LOWP_TILES.bytes();
        // SAFETY: a valid palette-1 configuration (64 bytes, read only); AMX is detected.
        asm!("ldtilecfg [{}]", in(reg) cfg.as_ptr(), options(nostack, readonly, preserves_flags));
    }

    unsafe fn end() {
        // SAFETY: returns the tiles to their init state; touches nothing else.
        asm!("tilerelease", options(nostack, nomem, preserves_flags));
    }

    unsafe fn gemm(g: &TileGemm) {
        // SAFETY (all blocks): tiles are configured (`begin`), every load/store covers 16 rows
        // of 64 bytes at the given strides, which the caller guarantees are in bounds; tmm0..2
        // are not registers the compiler allocates, so state carries between the blocks.
        if g.accumulate {
            asm!("tileloadd tmm0, [{c} + {s}*1]", c = in(reg) g.c, s = in(reg) g.ldc * 4, options(nostack, readonly, preserves_flags));
        } else {
            asm!("tilezero tmm0", options(nostack, nomem, preserves_flags));
        }
        for kb in 0..g.kblocks {
            let a = g.a.add(kb * TILE_K);
            let b = g.b.add(kb * TILE_M * TILE_K);
            if F16 {
                asm!(
                    "tileloadd tmm1, [{a} + {sa}*1]",
                    "tileloadd tmm2, [{b} + {sb}*1]",
                    "tdpfp16ps tmm0, tmm1, tmm2",
                    a = in(reg) a, sa = in(reg) g.lda * 2, b = in(reg) b, sb = in(reg) TILE_K * 2,
                    options(nostack, readonly, preserves_flags)
                );
            } else {
                asm!(
                    "tileloadd tmm1, [{a} + {sa}*1]",
                    "tileloadd tmm2, [{b} + {sb}*1]",
                    "tdpbf16ps tmm0, tmm1, tmm2",
                    a = in(reg) a, sa = in(reg) g.lda * 2, b = in(reg) b, sb = in(reg) TILE_K * 2,
                    options(nostack, readonly, preserves_flags)
                );
            }
        }
        asm!("tilestored [{c} + {s}*1], tmm0", c = in(reg) g.c, s = in(reg) g.ldc * 4, options(nostack, preserves_flags));
    }
}
