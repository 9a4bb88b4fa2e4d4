//! What the lowp tiling asks of a dot-product unit ([`TileUnit`]), and the model units that
//! answer it with `model.rs` on any CPU.
//!
//! One call is one C block of [`TILE_M`] × [`TILE_N`] f32: `C (+)= A·B` over `kblocks` steps of
//! [`TILE_K`] 16-bit elements, with
//! - A row-major: row `r`, element `p` at `a[r·lda + p]` (pairs are consecutive elements);
//! - B one VNNI panel of 16 columns: step `kb`, pair-row `k`, column `n`, element `e` at
//!   `b[((kb·16 + k)·16 + n)·2 + e]` = B[kb·32 + 2k + e][n] (64 bytes per pair-row);
//! - C row-major with `ldc` (f32).
//!
//! Each real unit runs the block as its instructions do; its model runs the same instructions'
//! definitions in the same order, so a model run is what that unit computes (bit for bit for
//! AVX512-BF16, within [`super::model::amx_bound`] for AMX).

use super::model::{self, Half16};
use super::tile::{LOWP_TILES, TILE_K, TILE_M, TILE_N};

/// One tile-block product (see the module docs for the layouts).
#[derive(Clone, Copy)]
pub(crate) struct TileGemm {
    pub a: *const u16,
    pub lda: usize,
    pub b: *const u16,
    pub c: *mut f32,
    pub ldc: usize,
    pub kblocks: usize,
    /// false: `C = A·B` (old C ignored); true: `C += A·B`.
    pub accumulate: bool,
    /// The B operand of the product that follows (same layout and panel stride), or null: a
    /// unit whose loads stall on memory asks for it during this product (AMX: its tile loads
    /// cannot run ahead of the products still reading the previous tile).
    pub prefetch: *const u16,
    /// B is read once here and not again soon: a unit with a streaming load uses it (AMX:
    /// `TILELOADDT1`), so B passes through without displacing A from L1. Results are the same.
    pub stream_b: bool,
}

/// A 16-bit dot-product unit.
///
/// # Safety
/// Callers pass pointers valid for the extents of [`TileGemm`] (16 rows of A and C, `kblocks`
/// steps), call [`TileUnit::gemm`] only between [`TileUnit::begin`] and [`TileUnit::end`] on
/// the same thread, and use a real unit only when `lowp::offered` detected it.
pub(crate) trait TileUnit: Send + Sync + 'static {
    /// The element type its A and B hold.
    const ELEM: Half16;
    /// Whether its B loads can pass L1 by ([`TileGemm::stream_b`] does something): then
    /// [`Walk::Rows`] pays for a long reduction. AMX (`TILELOADDT1`) and its model, which runs the
    /// same walks so that tests cover them. The AVX512-BF16 unit's vector loads have no such
    /// hint: walked by rows, its forward took 6% longer (bench/RESULTS.md).
    const STREAMS_B: bool = false;
    /// Readies this thread's unit (AMX: `ldtilecfg`).
    unsafe fn begin();
    /// Leaves the thread as it found it (AMX: `tilerelease`).
    unsafe fn end();
    unsafe fn gemm(g: &TileGemm);

    /// Four blocks at once: A's row groups `g.a` and `g.a + 16·lda`, B's panels `g.b` and
    /// `g.b + panel`, C blocks (row group, panel) at `g.c + 16·(row group·ldc + panel)`. Each
    /// C block gets the products [`TileUnit::gemm`] would give it, in the same order, so the
    /// result is the four one-block results bit for bit; a unit overrides this only to run them
    /// faster (AMX: four accumulators resident, each A/B tile load feeding two products).
    unsafe fn gemm2x2(g: &TileGemm, panel: usize) {
        for (grp, p) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            Self::gemm(&TileGemm { a: g.a.add(grp * TILE_M * g.lda), b: g.b.add(p * panel), c: g.c.add(grp * TILE_M * g.ldc + p * TILE_N), prefetch: core::ptr::null(), ..*g });
        }
    }
}

/// [`TileUnit::begin`] .. [`TileUnit::end`] as a scope: `end` runs even if a task unwinds.
pub(crate) struct UnitScope<U: TileUnit>(core::marker::PhantomData<U>);

impl<U: TileUnit> UnitScope<U> {
    /// # Safety
    /// `U` must be usable on this CPU (see [`TileUnit`]).
    pub(crate) unsafe fn enter() -> Self {
        U::begin();
        Self(core::marker::PhantomData)
    }
}

impl<U: TileUnit> Drop for UnitScope<U> {
    fn drop(&mut self) {
        // SAFETY: paired with the `begin` of `enter` on this thread.
        unsafe { U::end() }
    }
}

/// The order [`blocks`] takes its 2 × 2 blocks in, for where its operands fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Walk {
    /// Panel pairs outermost: a pair of B panels is read from L2 or memory once and feeds every
    /// row group from L1, while A stays in L1 throughout; for an A of a few KiB (a block's Q
    /// rows). With `ask_ahead` the first row-group pair of each panel pair asks for the next
    /// pair's panels ([`TileGemm::prefetch`]).
    Panels { ask_ahead: bool },
    /// Row-group pairs outermost, B streamed ([`TileGemm::stream_b`]): one row-group pair's A
    /// over the whole reduction stays in L1 while every panel passes by once per pair; for a
    /// long reduction where neither operand fits L1 beside the other (`O += P·V` over 512
    /// keys: 32 KiB of P per pair, 128 KiB of V). Walked by panels, both came from L2 at every
    /// product.
    Rows,
}

/// `C (+)= A·B` over whole 16×16 blocks: `mg` row groups of A/C, `np` column panels of B/C.
/// A row-major (`lda`), B panels `panel` elements apart, C row-major (`ldc`); 2 × 2 blocks where
/// both counts allow, single blocks on an odd edge, in `walk`'s order.
///
/// # Safety
/// The extents (16·mg rows of A and C, np panels of B, kblocks steps) lie inside the buffers.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn blocks<U: TileUnit>(a: *const u16, lda: usize, b: *const u16, panel: usize, c: *mut f32, ldc: usize, mg: usize, np: usize, kblocks: usize, accumulate: bool, walk: Walk) {
    let stream_b = walk == Walk::Rows;
    let at = |grp: usize, p: usize| TileGemm { a: a.add(grp * TILE_M * lda), lda, b: b.add(p * panel), c: c.add(grp * TILE_M * ldc + p * TILE_N), ldc, kblocks, accumulate, prefetch: core::ptr::null(), stream_b };
    match walk {
        Walk::Panels { ask_ahead } => {
            for p in (0..np & !1).step_by(2) {
                for grp in (0..mg & !1).step_by(2) {
                    let next = if ask_ahead && grp == 0 && p + 3 < np { b.add((p + 2) * panel) } else { core::ptr::null() };
                    U::gemm2x2(&TileGemm { prefetch: next, ..at(grp, p) }, panel);
                }
                if mg % 2 == 1 {
                    U::gemm(&at(mg - 1, p));
                    U::gemm(&at(mg - 1, p + 1));
                }
            }
            if np % 2 == 1 {
                for grp in 0..mg {
                    U::gemm(&at(grp, np - 1));
                }
            }
        }
        Walk::Rows => {
            for grp in (0..mg & !1).step_by(2) {
                for p in (0..np & !1).step_by(2) {
                    U::gemm2x2(&at(grp, p), panel);
                }
                if np % 2 == 1 {
                    U::gemm(&at(grp, np - 1));
                    U::gemm(&at(grp + 1, np - 1));
                }
            }
            if mg % 2 == 1 {
                for p in 0..np {
                    U::gemm(&at(mg - 1, p));
                }
            }
        }
    }
}

/// The AMX unit's model: one [`model::tdp`] per step of 32 elements, as the real unit issues one
/// `TDPBF16PS`/`TDPFP16PS` per step (`F16` says which).
pub(crate) struct ModelAmx<const F16: bool>;

impl<const F16: bool> TileUnit for ModelAmx<F16> {
    const ELEM: Half16 = if F16 { Half16::F16 } else { Half16::Bf16 };
    const STREAMS_B: bool = true;
    unsafe fn begin() {}
    unsafe fn end() {}
    unsafe fn gemm(g: &TileGemm) {
        // SAFETY: the caller's extents (trait docs): C is 16 rows of ldc, A 16 rows of lda with
        // kblocks·32 elements each, B kblocks·16 pair-rows of 32 elements.
        let c = std::slice::from_raw_parts_mut(g.c, (TILE_M - 1) * g.ldc + TILE_N);
        let a = std::slice::from_raw_parts(g.a, (TILE_M - 1) * g.lda + g.kblocks * TILE_K);
        let b = std::slice::from_raw_parts(g.b, g.kblocks * TILE_M * TILE_K);
        if !g.accumulate {
            for r in 0..TILE_M {
                c[r * g.ldc..r * g.ldc + TILE_N].fill(0.0);
            }
        }
        for kb in 0..g.kblocks {
            model::tdp(Self::ELEM, &LOWP_TILES, c, g.ldc, &a[kb * TILE_K..], g.lda, &b[kb * TILE_M * TILE_K..], TILE_K);
        }
    }
}

/// The AVX512-BF16 unit's model: per C row, one `VDPBF16PS` per pair of the reduction, with
/// the pair-row of B and that pair of A broadcast to all 16 lanes, in the real unit's order.
pub(crate) struct ModelAvx512Bf16;

impl TileUnit for ModelAvx512Bf16 {
    const ELEM: Half16 = Half16::Bf16;
    unsafe fn begin() {}
    unsafe fn end() {}
    unsafe fn gemm(g: &TileGemm) {
        for r in 0..TILE_M {
            // SAFETY: row r of C (16 f32) and of A (kblocks·32 elements), B's kblocks·16
            // pair-rows, per the trait's extents.
            let crow = std::slice::from_raw_parts_mut(g.c.add(r * g.ldc), TILE_N);
            let arow = std::slice::from_raw_parts(g.a.add(r * g.lda), g.kblocks * TILE_K);
            let b = std::slice::from_raw_parts(g.b, g.kblocks * TILE_M * TILE_K);
            let mut acc = [0f32; 16];
            if g.accumulate {
                acc.copy_from_slice(crow);
            }
            for (p, bpair) in b.chunks_exact(TILE_K).enumerate() {
                let mut abc = [0u16; 32];
                for lane in abc.chunks_exact_mut(2) {
                    lane.copy_from_slice(&arow[2 * p..2 * p + 2]);
                }
                let bpair: &[u16; 32] = bpair.try_into().expect("chunks of 32");
                // The real unit's operand order (B's pair-row first: `avx512bf16.rs`), which
                // decides which of two NaNs reaches C.
                acc = model::vdpbf16ps(acc, bpair, &abc);
            }
            crow.copy_from_slice(&acc);
        }
    }
}
