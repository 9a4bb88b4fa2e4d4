//! The AVX512-BF16 unit: `VDPBF16PS zmm` (`_mm512_dpbf16_ps`, stable), a C row (16 f32 lanes)
//! per accumulator, eight rows at a time, A's pair broadcast to every lane, B's VNNI pair-row as
//! the other operand.
//! The order is [`super::unit::ModelAvx512Bf16`]'s, and the instruction is exactly defined,
//! so the two agree bit for bit.

use core::arch::x86_64::*;

use super::model::Half16;
use super::tile::{TILE_K, TILE_M};
use super::unit::{TileGemm, TileUnit};

/// Whether the CPU has AVX512-BF16 (and AVX-512F, which the row kernels next to it need).
pub(crate) fn detected() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
}

pub(crate) struct Avx512Bf16;

/// This core's `VDPBF16PS zmm` rate in GFLOP/s (2·32 per instruction): sixteen independent
/// accumulator chains on operands in registers, nothing else in the loop. `None` where
/// AVX512-BF16 is not usable. The roof the unit's block product is held against (`host_bench
/// peak`): one per cycle on a Zen 4, twice its FMA rate; one per two on an Emerald Rapids.
pub(crate) fn vdp_peak_gflops(iters: u64) -> Option<f64> {
    if !detected() {
        return None;
    }
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn chains(iters: u64) -> f64 {
        // Values that stay finite and normal: 1.0·0.5 pairs added to accumulators starting at 0.
        let a: __m512bh = core::mem::transmute(_mm512_set1_epi32(std::hint::black_box(0x3F80_3F80)));
        let b: __m512bh = core::mem::transmute(_mm512_set1_epi32(std::hint::black_box(0x3F00_3F00)));
        let mut acc = [_mm512_setzero_ps(); 16];
        let t0 = std::time::Instant::now();
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, a, b);
            }
        }
        let t = t0.elapsed().as_secs_f64();
        std::hint::black_box(acc);
        t
    }
    // SAFETY: AVX512-BF16 and AVX-512F are usable (checked).
    let t = unsafe { chains(iters) };
    Some(iters as f64 * 16.0 * 64.0 / t / 1e9)
}

/// C rows in flight at once: `VDPBF16PS` has a latency of several cycles, so one row's chain of
/// dependent instructions would leave the unit idle; eight rows give eight independent chains
/// that share each load of B's pair-row. Each lane's own order (pairs in sequence) is the
/// model's, so the results stay bit-identical to it.
const ROWS: usize = 8;

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn gemm(g: &TileGemm) {
    for r0 in (0..TILE_M).step_by(ROWS) {
        let mut acc = [_mm512_setzero_ps(); ROWS];
        if g.accumulate {
            for (i, acc) in acc.iter_mut().enumerate() {
                *acc = _mm512_loadu_ps(g.c.add((r0 + i) * g.ldc));
            }
        }
        for p in 0..g.kblocks * TILE_K / 2 {
            // B's pair-row p (64 bytes), then per row one pair of A (32 bits) in every lane.
            let bv: __m512bh = core::mem::transmute(_mm512_loadu_si512(g.b.add(p * TILE_K) as *const __m512i));
            for (i, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_epi32((g.a.add((r0 + i) * g.lda + 2 * p) as *const i32).read_unaligned());
                // The broadcast pair goes last: only the last source can be a memory operand, so
                // LLVM folds the load and broadcast into `VDPBF16PS zmm, zmm, m32bcst`. As the
                // first source it took a separate `VBROADCASTSS` per row, and the block product
                // ran at 2/3 of the instruction's rate on a Zen 4 (1.0 with the fold:
                // bench/RESULTS.md). The sum is symmetric in the two sources; only which NaN
                // wins depends on their order, and the model takes them in this one.
                *acc = _mm512_dpbf16_ps(*acc, bv, core::mem::transmute::<__m512i, __m512bh>(av));
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            _mm512_storeu_ps(g.c.add((r0 + i) * g.ldc), *acc);
        }
    }
}

impl TileUnit for Avx512Bf16 {
    const ELEM: Half16 = Half16::Bf16;
    unsafe fn begin() {}
    unsafe fn end() {}
    unsafe fn gemm(g: &TileGemm) {
        // SAFETY: the caller checked `detected()` (trait contract) and passes in-bounds extents.
        gemm(g)
    }
}
