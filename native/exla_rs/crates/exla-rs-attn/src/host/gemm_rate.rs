//! The f32 GEMM's rate at the shapes the key loops call it with, operands as the loops hold them:
//! what `host_bench peak` prints beside the AVX-512 FMA roof.

use std::time::Instant;

use super::kernels::{Gemm, Isa, Prefetch};
use super::lines::Lines;
use super::forward::S_LD;
use super::tiles::{BC, BR};
use super::UnitRate;

/// Best GFLOP/s of `reps` calls `C (+)= A·B` (m × n, reduction k), A row-major (`a_rs = k`), B
/// row-major n wide, C row-major: best of 5 runs.
fn rate<K: Isa>(m: usize, n: usize, k: usize, accumulate: bool, reps: usize) -> f64 {
    let mut a = Lines::<f32>::zeroed(m * k);
    let mut b = Lines::<f32>::zeroed(k * n);
    let mut c = Lines::<f32>::zeroed(m * n);
    a.iter_mut().enumerate().for_each(|(i, x)| *x = 1.0 + (i % 7) as f32 * 1e-3);
    b.iter_mut().enumerate().for_each(|(i, x)| *x = 0.5 - (i % 5) as f32 * 1e-3);
    let g = Gemm { m, n, k, a: a.as_ptr(), a_rs: k, a_cs: 1, b: b.as_ptr(), ldb: n, c: c.as_mut_ptr(), ldc: n, accumulate, pf: Prefetch::NONE };
    let flops = (2 * m * n * k * reps) as f64;
    let best = (0..5)
        .map(|_| {
            let t0 = Instant::now();
            for _ in 0..reps {
                // SAFETY: every extent lies in a, b, c above; the caller checked K runs here.
                unsafe { K::gemm(Gemm { ..g }) };
            }
            flops / t0.elapsed().as_secs_f64() / 1e9
        })
        .fold(0.0, f64::max);
    std::hint::black_box(&c);
    best
}

/// The AVX-512 f32 GEMM at the forward's two products (D = 64 and 128; the plain instance's
/// `P·V` runs over a step of [`S_LD`] keys), where AVX-512 runs. Against the FMA roof they say how
/// much of a forward's distance from it the GEMM itself accounts for (on the Emerald Rapids
/// guest, 94-98% of the roof in a quiet minute).
pub fn gemm_rates() -> Vec<UnitRate> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("fma") {
        use super::kernels::avx512::Kernels;
        const _: () = assert!(BR == 64 && BC == 64 && S_LD == 256, "the labels below");
        let shapes: [(&'static str, usize, usize, usize, bool); 4] = [
            ("f32 GEMM S = Q·Kᵀ, 64 x 64, k = 64", BR, BC, 64, false),
            ("f32 GEMM O += P·V, 64 x 64, k = 256", BR, 64, S_LD, true),
            ("f32 GEMM S = Q·Kᵀ, 64 x 64, k = 128", BR, BC, 128, false),
            ("f32 GEMM O += P·V, 64 x 128, k = 256", BR, 128, S_LD, true),
        ];
        for (what, m, n, k, accumulate) in shapes {
            out.push(UnitRate { what, gflops: rate::<Kernels>(m, n, k, accumulate, 500_000_000 / (m * n * k)) });
        }
    }
    out
}
