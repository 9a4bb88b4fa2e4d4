//! The AVX512-BF16 unit: `VDPBF16PS zmm` (`_mm512_dpbf16_ps`, stable), one C row (16 f32
//! lanes) at a time, A's pair broadcast to every lane, B's VNNI pair-row as the other operand.
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

#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn gemm(g: &TileGemm) {
    for r in 0..TILE_M {
        let c = g.c.add(r * g.ldc);
        let a = g.a.add(r * g.lda);
        let mut acc = if g.accumulate { _mm512_loadu_ps(c) } else { _mm512_setzero_ps() };
        for p in 0..g.kblocks * TILE_K / 2 {
            // One pair of A (32 bits) in every lane; B's pair-row p (64 bytes).
            let av = _mm512_set1_epi32((a.add(2 * p) as *const i32).read_unaligned());
            let bv = _mm512_loadu_si512(g.b.add(p * TILE_K) as *const __m512i);
            acc = _mm512_dpbf16_ps(acc, core::mem::transmute::<__m512i, __m512bh>(av), core::mem::transmute::<__m512i, __m512bh>(bv));
        }
        _mm512_storeu_ps(c, acc);
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
