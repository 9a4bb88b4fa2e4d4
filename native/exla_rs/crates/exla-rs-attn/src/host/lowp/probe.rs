//! A real unit is offered only after it reproduced its model on one tile block at first use:
//! bit for bit for AVX512-BF16 (its definition is exact), within [`model::amx_bound`] for AMX.
//! The units have been written from Intel's manuals without one to run on; should a CPU (or a
//! hypervisor hiding part of its state) compute something else, calls stay on the f32 path
//! instead of returning wrong numbers. The tests compare the units more widely
//! (`lowp_real_*`), so a disagreement still fails CI on such a machine.

use super::model::{self, Half16};
use super::pack;
use super::tile::{TILE_K, TILE_M, TILE_N};
use super::unit::{TileGemm, TileUnit, UnitScope};

/// `C` after `U::gemm` accumulating onto `c0`: A is 16 × `kblocks·32`, B `kblocks·16` pair-rows
/// of 32 (VNNI), C 16 × 16. The caller checked `U` runs on this CPU.
pub(crate) fn tile_product<U: TileUnit>(a: &[u16], b: &[u16], c0: &[f32], kblocks: usize) -> Vec<f32> {
    assert!(a.len() == TILE_M * kblocks * TILE_K && b.len() == kblocks * TILE_M * TILE_K && c0.len() == TILE_M * TILE_N, "tile operand sizes");
    let mut c = c0.to_vec();
    // SAFETY: the extents of TileGemm, checked above; `U` runs here (the caller's word).
    unsafe {
        let _scope = UnitScope::<U>::enter();
        U::gemm(&TileGemm { a: a.as_ptr(), lda: kblocks * TILE_K, b: b.as_ptr(), c: c.as_mut_ptr(), ldc: TILE_N, kblocks, accumulate: true, prefetch: core::ptr::null(), stream_b: false });
    }
    c
}

/// How far a real AMX result may be from the model's, per C entry, for these operands: one
/// [`model::amx_bound`] per instruction (`kblocks` of them add into C).
pub(crate) fn amx_bounds(elem: Half16, a: &[u16], b: &[u16], c0: &[f32], kblocks: usize) -> Vec<f64> {
    let kk = kblocks * TILE_K;
    (0..TILE_M * TILE_N)
        .map(|i| {
            let (m, n) = (i / TILE_N, i % TILE_N);
            // B[p][n] sits at pair-row p / 2, column n, element p % 2 (VNNI).
            let s: f64 = (0..kk).map(|p| (model::elem_in(elem, a[m * kk + p]) as f64 * model::elem_in(elem, b[(p / 2) * TILE_K + 2 * n + p % 2]) as f64).abs()).sum();
            kblocks as f64 * model::amx_bound(s + c0[i].abs() as f64, TILE_K)
        })
        .collect()
}

/// Whether the real unit `R` computes what its model `M` does on a fixed block (mixed signs,
/// magnitudes from 2^-5 to 2, two instructions' worth of reduction): bit for bit when `exact`.
pub(crate) fn agrees<R: TileUnit, M: TileUnit>(exact: bool) -> bool {
    let kblocks = 2;
    let elem = R::ELEM;
    let val = |i: usize, mul: usize, m: usize| ((i * mul) % m) as f32 / m as f32 * 4.0 - 2.0;
    let a: Vec<u16> = (0..TILE_M * kblocks * TILE_K).map(|i| pack::bits(elem, val(i, 37, 101))).collect();
    let b: Vec<u16> = (0..kblocks * TILE_M * TILE_K).map(|i| pack::bits(elem, val(i, 53, 97))).collect();
    let c0: Vec<f32> = (0..TILE_M * TILE_N).map(|i| val(i, 11, 13)).collect();
    let (real, model) = (tile_product::<R>(&a, &b, &c0, kblocks), tile_product::<M>(&a, &b, &c0, kblocks));
    if exact {
        return real.iter().zip(&model).all(|(r, m)| r.to_bits() == m.to_bits());
    }
    let bounds = amx_bounds(elem, &a, &b, &c0, kblocks);
    real.iter().zip(&model).zip(&bounds).all(|((r, m), bd)| (*r as f64 - *m as f64).abs() <= *bd)
}
