//! The dot-product units' rates on one core, measured: the roofs `host_bench peak` prints
//! beside the f32 FMA roof, and the lowp kernels' key loops are held against.
//!
//! Two figures per unit: the instruction alone (operands in registers/tiles, independent
//! accumulators: what the unit can do) and the block product the kernels call, on operands in
//! L1 at the kernels' reduction length (what the loads around it leave of that).

use std::time::Instant;

use super::super::lines::{Lines, LINE};
use super::tile::{TILE_K, TILE_M, TILE_N};
use super::unit::{TileGemm, TileUnit, UnitScope};

/// One measured rate.
#[derive(Clone, Debug)]
pub struct UnitRate {
    pub what: &'static str,
    pub gflops: f64,
}

/// Best GFLOP/s of `U`'s 2 × 2 block product over a `kblocks`-step reduction on operands that
/// stay in L1 (best of 5 runs of `reps` calls), A and B starting `skew` bytes past a cache line
/// (a multiple of 2; the kernels' own buffers start on one: [`super::super::lines`]).
fn block_rate<U: TileUnit>(kblocks: usize, reps: usize, accumulate: bool, skew: usize) -> f64 {
    let (alen, blen) = (2 * TILE_M * kblocks * TILE_K, 2 * kblocks * TILE_M * TILE_K);
    let pad = LINE / 2;
    let mut a = Lines::<u16>::zeroed(alen + pad);
    let mut b = Lines::<u16>::zeroed(blen + pad);
    let (a, b) = (&mut a[skew / 2..][..alen], &mut b[skew / 2..][..blen]);
    a.iter_mut().enumerate().for_each(|(i, x)| *x = 0x3F80 + (i % 7) as u16);
    b.iter_mut().enumerate().for_each(|(i, x)| *x = 0x3F00 + (i % 5) as u16);
    let mut c = Lines::<f32>::zeroed(2 * TILE_M * 2 * TILE_N);
    let panel = kblocks * TILE_M * TILE_K;
    let g = TileGemm { a: a.as_ptr(), lda: kblocks * TILE_K, b: b.as_ptr(), c: c.as_mut_ptr(), ldc: 2 * TILE_N, kblocks, accumulate, prefetch: core::ptr::null(), stream_b: false };
    let flops = (reps * 4 * kblocks * 2 * TILE_M * TILE_N * TILE_K) as f64;
    (0..5)
        .map(|_| {
            // SAFETY: the caller checked U runs here; every extent lies in a, b, c above.
            let t = unsafe {
                let _scope = UnitScope::<U>::enter();
                let t0 = Instant::now();
                for _ in 0..reps {
                    U::gemm2x2(&g, panel);
                }
                t0.elapsed().as_secs_f64()
            };
            flops / t / 1e9
        })
        .fold(0.0, f64::max)
}

/// Whether the TMUL and the vector ports overlap: the same work three ways, in ms (best of 5).
#[derive(Clone, Debug)]
pub struct Overlap {
    /// `n` AMX 2 × 2 block products (C = A·B, k = 128, operands in L1), back to back.
    pub products: f64,
    /// `n` forward row passes (256 scores: scale, max, `exp2`, sum, bf16 P; AVX-512), back to back.
    pub rows: f64,
    /// The same, one row pass after each product: what a key loop that hides its row pass behind
    /// the next step's products would run. At or above `products + rows`: no overlap.
    pub interleaved: f64,
}

/// [`Overlap`] with `n` of each, where AMX-BF16 and AVX-512 run (None elsewhere).
pub fn overlap(n: usize) -> Option<Overlap> {
    #[cfg(target_arch = "x86_64")]
    {
        use super::super::kernels::avx512::Kernels;
        use super::amx::{self, Amx};
        use super::model::Half16;
        use super::rows::fwd_row16;
        if !amx::detected().bf16 {
            return None;
        }
        const KEYS: usize = 256;
        let kblocks = 4;
        let mut a = Lines::<u16>::zeroed(2 * TILE_M * kblocks * TILE_K);
        a.iter_mut().enumerate().for_each(|(i, x)| *x = 0x3F80 + (i % 7) as u16);
        let mut b = Lines::<u16>::zeroed(2 * kblocks * TILE_M * TILE_K);
        b.iter_mut().enumerate().for_each(|(i, x)| *x = 0x3F00 + (i % 5) as u16);
        let mut c = Lines::<f32>::zeroed(2 * TILE_M * 2 * TILE_N);
        let panel = kblocks * TILE_M * TILE_K;
        let g = TileGemm { a: a.as_ptr(), lda: kblocks * TILE_K, b: b.as_ptr(), c: c.as_mut_ptr(), ldc: 2 * TILE_N, kblocks, accumulate: false, prefetch: core::ptr::null(), stream_b: false };
        let scores: Vec<f32> = (0..16 * KEYS).map(|i| ((i * 37) % 101) as f32 * 0.05).collect();
        let mut s = scores.clone();
        let mut p = vec![0u16; KEYS];
        let mut m = 0f32;
        // SAFETY (all three): AMX-BF16 is usable (checked above) and implies AVX-512F (`detected`);
        // the products' extents lie in a, b, c; each row pass reads one 256-score row of s and
        // writes 256 entries of p.
        let mut row = |i: usize| unsafe {
            let r = &mut s[(i % 16) * KEYS..][..KEYS];
            r.copy_from_slice(&scores[(i % 16) * KEYS..][..KEYS]);
            m += fwd_row16::<Kernels>(Half16::Bf16, r.as_mut_ptr(), KEYS, 0, KEYS, 0.125, 0.0, f32::NEG_INFINITY, p.as_mut_ptr()).1;
        };
        let best = |f: &mut dyn FnMut()| {
            (0..5)
                .map(|_| {
                    let t0 = Instant::now();
                    f();
                    t0.elapsed().as_secs_f64() * 1e3
                })
                .fold(f64::INFINITY, f64::min)
        };
        let products = best(&mut || unsafe {
            let _scope = UnitScope::<Amx<false>>::enter();
            for _ in 0..n {
                Amx::<false>::gemm2x2(&g, panel);
            }
        });
        let rows = best(&mut || (0..n).for_each(&mut row));
        let interleaved = best(&mut || unsafe {
            let _scope = UnitScope::<Amx<false>>::enter();
            for i in 0..n {
                Amx::<false>::gemm2x2(&g, panel);
                row(i);
            }
        });
        std::hint::black_box((m, &p, &c));
        Some(Overlap { products, rows, interleaved })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = n;
        None
    }
}

/// The rates of the units this CPU has (empty elsewhere). Takes about a second.
pub fn unit_rates() -> Vec<UnitRate> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use super::{amx, avx512bf16};
        if let Some(g) = (0..5).filter_map(|_| amx::tdp_peak_gflops(20_000_000)).reduce(f64::max) {
            out.push(UnitRate { what: "AMX TDPBF16PS alone (4 accumulators, operands in tiles)", gflops: g });
            out.push(UnitRate { what: "AMX 2x2 block product, C += A·B, k = 128, operands in L1", gflops: block_rate::<amx::Amx<false>>(4, 200_000, true, 0) });
            out.push(UnitRate { what: "AMX 2x2 block product, C = A·B, k = 128, operands in L1", gflops: block_rate::<amx::Amx<false>>(4, 200_000, false, 0) });
            out.push(UnitRate { what: "AMX 2x2 block product, C = A·B, k = 128, operands in L1, 16 bytes off a cache line", gflops: block_rate::<amx::Amx<false>>(4, 200_000, false, 16) });
            out.push(UnitRate { what: "AMX 2x2 block product, C = A·B, k = 512, operands in L1", gflops: block_rate::<amx::Amx<false>>(16, 50_000, false, 0) });
            out.push(UnitRate { what: "AMX 2x2 block product, C += A·B, k = 64, operands in L1", gflops: block_rate::<amx::Amx<false>>(2, 400_000, true, 0) });
        }
        if let Some(g) = (0..5).filter_map(|_| avx512bf16::vdp_peak_gflops(10_000_000)).reduce(f64::max) {
            out.push(UnitRate { what: "AVX512-BF16 VDPBF16PS zmm alone (16 accumulators, operands in registers)", gflops: g });
            out.push(UnitRate { what: "AVX512-BF16 VDPBF16PS 2x2 block product, k = 128, operands in L1", gflops: block_rate::<avx512bf16::Avx512Bf16>(4, 20_000, true, 0) });
        }
    }
    out
}

