//! The AMX units (`TDPBF16PS` on AMX-BF16, `TDPFP16PS` on AMX-FP16) through stable inline `asm!`
//! (Rust's AMX intrinsics and `is_x86_feature_detected!("amx-…")` are unstable).
//!
//! Tiles ([`super::tile`]): a one-block product uses `tmm0` = C, `tmm1` = A, `tmm2` = B; the
//! 2 × 2 product `tmm0..3` = C, `tmm4/5` = A, `tmm6/7` = B. One `ldtilecfg` of
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
use core::arch::x86_64::{__cpuid, __cpuid_count, _mm_prefetch, _MM_HINT_T0};

use super::model::Half16;
use super::tile::{LOWP_TILES, TILE_K, TILE_M, TILE_N};
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

/// One reduction step of a one-block product: A (row stride `$sa` bytes) into tmm1, B (64-byte
/// pair-rows) into tmm2 by `$ldb` (`tileloadd`, or `tileloaddt1` for a streamed B), `$op tmm0,
/// tmm1, tmm2`.
macro_rules! tdp_1x1 {
    ($op:literal, $ldb:literal, $a:expr, $sa:expr, $b:expr) => {
        asm!(
            "tileloadd tmm1, [{a} + {sa}*1]",
            concat!($ldb, " tmm2, [{b} + {sb}*1]"),
            concat!($op, " tmm0, tmm1, tmm2"),
            a = in(reg) $a, sa = in(reg) $sa, b = in(reg) $b, sb = in(reg) TILE_K * 2,
            options(nostack, readonly, preserves_flags)
        )
    };
}

/// One reduction step of a 2 × 2 product: A's row groups into tmm4/tmm5, B's panels into
/// tmm6/tmm7 (by `$ldb`, as in [`tdp_1x1`]), four products into tmm0..tmm3. Each load is issued
/// just before its first use so the first product starts after two loads, not four.
macro_rules! tdp_2x2 {
    ($op:literal, $ldb:literal, $a0:expr, $a1:expr, $sa:expr, $b0:expr, $b1:expr) => {
        asm!(
            "tileloadd tmm4, [{a0} + {sa}*1]",
            concat!($ldb, " tmm6, [{b0} + {sb}*1]"),
            concat!($op, " tmm0, tmm4, tmm6"),
            concat!($ldb, " tmm7, [{b1} + {sb}*1]"),
            concat!($op, " tmm1, tmm4, tmm7"),
            "tileloadd tmm5, [{a1} + {sa}*1]",
            concat!($op, " tmm2, tmm5, tmm6"),
            concat!($op, " tmm3, tmm5, tmm7"),
            a0 = in(reg) $a0, a1 = in(reg) $a1, sa = in(reg) $sa, b0 = in(reg) $b0, b1 = in(reg) $b1, sb = in(reg) TILE_K * 2,
            options(nostack, readonly, preserves_flags)
        )
    };
}

/// This core's `TDPBF16PS` rate in GFLOP/s (2·16·16·32 per instruction): four independent
/// accumulator chains on operands already in tiles, nothing else in the loop. `None` where
/// AMX-BF16 is not usable. The roof the lowp kernels are held against (`host_bench peak`).
pub(crate) fn tdp_peak_gflops(iters: u64) -> Option<f64> {
    if !detected().bf16 {
        return None;
    }
    let ones = vec![0x3F80u16; TILE_M * TILE_K];
    let t;
    // SAFETY: AMX-BF16 is usable (checked); the scope configures and releases the tiles; the
    // loads read 16 rows of 64 bytes from `ones` (1 KiB).
    unsafe {
        let _scope = super::unit::UnitScope::<Amx<false>>::enter();
        asm!(
            "tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3",
            "tileloadd tmm4, [{p} + {s}*1]", "tileloadd tmm5, [{p} + {s}*1]",
            "tileloadd tmm6, [{p} + {s}*1]", "tileloadd tmm7, [{p} + {s}*1]",
            p = in(reg) ones.as_ptr(), s = in(reg) 64usize, options(nostack, readonly, preserves_flags)
        );
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            asm!(
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                options(nostack, nomem, preserves_flags)
            );
        }
        t = t0.elapsed().as_secs_f64();
    }
    Some(iters as f64 * 4.0 * (2 * TILE_M * TILE_M * TILE_K) as f64 / t / 1e9)
}

/// `TDPBF16PS` (`F16 = false`) or `TDPFP16PS` (`F16 = true`).
pub(crate) struct Amx<const F16: bool>;

impl<const F16: bool> TileUnit for Amx<F16> {
    const ELEM: Half16 = if F16 { Half16::F16 } else { Half16::Bf16 };
    const STREAMS_B: bool = true;

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
        // of 64 bytes at the given strides, which the caller guarantees are in bounds; tmm0..7
        // are not registers the compiler allocates, so state carries between the blocks.
        if g.accumulate {
            asm!("tileloadd tmm0, [{c} + {s}*1]", c = in(reg) g.c, s = in(reg) g.ldc * 4, options(nostack, readonly, preserves_flags));
        } else {
            asm!("tilezero tmm0", options(nostack, nomem, preserves_flags));
        }
        for kb in 0..g.kblocks {
            let a = g.a.add(kb * TILE_K);
            let b = g.b.add(kb * TILE_M * TILE_K);
            match (F16, g.stream_b) {
                (true, false) => tdp_1x1!("tdpfp16ps", "tileloadd", a, g.lda * 2, b),
                (true, true) => tdp_1x1!("tdpfp16ps", "tileloaddt1", a, g.lda * 2, b),
                (false, false) => tdp_1x1!("tdpbf16ps", "tileloadd", a, g.lda * 2, b),
                (false, true) => tdp_1x1!("tdpbf16ps", "tileloaddt1", a, g.lda * 2, b),
            }
        }
        asm!("tilestored [{c} + {s}*1], tmm0", c = in(reg) g.c, s = in(reg) g.ldc * 4, options(nostack, preserves_flags));
    }

    unsafe fn gemm2x2(g: &TileGemm, panel: usize) {
        // C blocks (row group, panel): tmm0 = (0, 0), tmm1 = (0, 1), tmm2 = (1, 0), tmm3 = (1, 1).
        let (c0, c2) = (g.c, g.c.add(TILE_M * g.ldc));
        let (c1, c3) = (c0.add(TILE_N), c2.add(TILE_N));
        let sc = g.ldc * 4;
        // SAFETY: as in `gemm`, for the four blocks the trait method names.
        if g.accumulate {
            asm!(
                "tileloadd tmm0, [{c0} + {s}*1]",
                "tileloadd tmm1, [{c1} + {s}*1]",
                "tileloadd tmm2, [{c2} + {s}*1]",
                "tileloadd tmm3, [{c3} + {s}*1]",
                c0 = in(reg) c0, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, s = in(reg) sc,
                options(nostack, readonly, preserves_flags)
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3", options(nostack, nomem, preserves_flags));
        }
        let a1 = TILE_M * g.lda;
        for kb in 0..g.kblocks {
            let a = g.a.add(kb * TILE_K);
            let b = g.b.add(kb * TILE_M * TILE_K);
            if !g.prefetch.is_null() {
                // The next product's two B tiles of this step: 16 lines of 64 bytes each.
                let nb = g.prefetch.add(kb * TILE_M * TILE_K).cast::<i8>();
                for line in 0..TILE_M {
                    _mm_prefetch::<_MM_HINT_T0>(nb.add(line * 64));
                    _mm_prefetch::<_MM_HINT_T0>(nb.add(panel * 2 + line * 64));
                }
            }
            match (F16, g.stream_b) {
                (true, false) => tdp_2x2!("tdpfp16ps", "tileloadd", a, a.add(a1), g.lda * 2, b, b.add(panel)),
                (true, true) => tdp_2x2!("tdpfp16ps", "tileloaddt1", a, a.add(a1), g.lda * 2, b, b.add(panel)),
                (false, false) => tdp_2x2!("tdpbf16ps", "tileloadd", a, a.add(a1), g.lda * 2, b, b.add(panel)),
                (false, true) => tdp_2x2!("tdpbf16ps", "tileloaddt1", a, a.add(a1), g.lda * 2, b, b.add(panel)),
            }
        }
        asm!(
            "tilestored [{c0} + {s}*1], tmm0",
            "tilestored [{c1} + {s}*1], tmm1",
            "tilestored [{c2} + {s}*1], tmm2",
            "tilestored [{c3} + {s}*1], tmm3",
            c0 = in(reg) c0, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, s = in(reg) sc,
            options(nostack, preserves_flags)
        );
    }
}
