//! Times the Host kernels without XLA: `cargo run --release -p exla-rs-attn --example host_bench
//! [S] [reps] [D]`. B=1, H=8, D=64 by default, f32, causal and not. `EXLA_RS_HOST_ISA=avx2|scalar` narrows the ISA.
//! `host_bench decode [Sk] [reps]`: one query row per sequence, B=8, 32 query heads on 8 kv heads,
//! D=128, f32 and bf16 (or the one named after the numbers), in GB/s of K+V read.
//! `host_bench fwd [S] [reps] [D]`: the forward alone. A `bf16` or `f16` anywhere in the arguments
//! times that input type instead of f32 (the same random values, rounded).
//! `host_bench peak`: this core's f32 FMA peak (independent AVX2 and AVX-512 FMA chains,
//! registers only), the roofline the f32 kernels are held against, and the dot-product units'
//! rates (`exla_rs_attn::host::unit_rates`: AMX, AVX512-BF16) the 16-bit kernels are held against,
//! and whether AMX products and AVX-512 row passes overlap (`exla_rs_attn::host::overlap`).
//! `host_bench bandwidth [MiB] [reps]`: this machine's read bandwidth, every core summing its share
//! of one f32 buffer (1 GiB by default, far past the caches): the roof decode is held against.

use exla_rs_attn::host::{backward, forward, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement};
use exla_rs_attn::{AttnOptions, AttnShape};
use std::time::Instant;

/// Process CPU seconds (user + system) from /proc/self/stat: with other jobs sharing the cores,
/// CPU time tells kernel changes apart where wall time is noise.
fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = after.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    // Fields after the command: state(skipped: not numeric) ppid.. utime is field 14 overall.
    if f.len() > 12 { (f[10] + f[11]) / 100.0 } else { 0.0 }
}

fn decode(sk: usize, reps: usize, only: Option<&str>) {
    use half::bf16;
    let shape = AttnShape { batch: 8, seq_q: 1, seq_k: sk, heads: 32, kv_heads: 8, head_dim: 128 };
    let opts = AttnOptions { scale: 128f32.powf(-0.5), softcap: 0.0, window_left: -1, window_right: 0 };
    let (kv_len, q_start) = (vec![sk as i32; 8], vec![sk as i32 - 1; 8]);
    let f = |n: usize, seed: u64| exla_rs_attn::random::uniform_pm1(n, seed);
    let (q, k, v) = (f(shape.q_len(), 1), f(shape.kv_len(), 2), f(shape.kv_len(), 3));
    let time = |run: &mut dyn FnMut()| {
        run();
        (0..reps).map(|_| { let t = Instant::now(); run(); t.elapsed().as_secs_f64() }).fold(f64::INFINITY, f64::min)
    };
    let bytes = 2.0 * k.len() as f64;
    let mut lse = vec![0f32; shape.lse_len()];
    let mut line = format!("decode Sk={sk}:");
    if only != Some("bf16") {
        let mut o = vec![0f32; q.len()];
        let t = time(&mut || forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap());
        line += &format!(" f32 {:.2} ms ({:.1} GB/s)", t * 1e3, bytes * 4.0 / t / 1e9);
    }
    if only != Some("f32") {
        let b = |x: &[f32]| x.iter().map(|&y| bf16::from_f32(y)).collect::<Vec<_>>();
        let (qb, kb, vb) = (b(&q), b(&k), b(&v));
        let mut ob = vec![bf16::ZERO; q.len()];
        let t = time(&mut || forward(&shape, &opts, FwdInputs { q: &qb, k: &kb, v: &vb, kv_len: &kv_len, q_start: &q_start }, FwdOutputs { o: &mut ob, lse: &mut lse }, &mut []).unwrap());
        line += &format!(" bf16 {:.2} ms ({:.1} GB/s)", t * 1e3, bytes * 2.0 / t / 1e9);
    }
    println!("{line}");
}

/// GFLOP/s of one core running nothing but independent 8-lane FMAs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_peak() -> f64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(0.0); 12];
    let (a, b) = (_mm256_set1_ps(std::hint::black_box(0.999_999)), _mm256_set1_ps(std::hint::black_box(1e-7)));
    let iters = 50_000_000u64;
    let t = Instant::now();
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm256_fmadd_ps(*x, a, b);
        }
    }
    let s = t.elapsed().as_secs_f64();
    std::hint::black_box(acc);
    (iters * 12 * 16) as f64 / s / 1e9
}

/// GFLOP/s of one core running nothing but independent 16-lane FMAs (16 chains: two FMA ports
/// of 4-cycle latency need 8, more cost nothing).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_peak_avx512() -> f64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(0.0); 16];
    let (a, b) = (_mm512_set1_ps(std::hint::black_box(0.999_999)), _mm512_set1_ps(std::hint::black_box(1e-7)));
    let iters = 25_000_000u64;
    let t = Instant::now();
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_fmadd_ps(*x, a, b);
        }
    }
    let s = t.elapsed().as_secs_f64();
    std::hint::black_box(acc);
    (iters * 16 * 32) as f64 / s / 1e9
}

/// The sum of `x`, eight independent AVX2 accumulators (a read loop no core's FP latency limits).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_ps(); 8];
    let chunks = x.chunks_exact(64);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (i, a) in acc.iter_mut().enumerate() {
            *a = _mm256_add_ps(*a, _mm256_loadu_ps(c.as_ptr().add(8 * i)));
        }
    }
    let mut lanes = [0f32; 8];
    _mm256_storeu_ps(lanes.as_mut_ptr(), acc.iter().fold(_mm256_setzero_ps(), |s, &a| _mm256_add_ps(s, a)));
    lanes.iter().sum::<f32>() + tail
}

/// GB/s of every core reading its share of a `mib` MiB buffer once (best of `reps`).
fn bandwidth(mib: usize, reps: usize) {
    use rayon::prelude::*;
    let buf = vec![1f32; (mib << 20) / 4];
    let threads = rayon::current_num_threads();
    let share = buf.len().div_ceil(threads);
    let sum = |x: &[f32]| -> f32 {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked).
            return unsafe { sum_avx2(x) };
        }
        x.iter().sum()
    };
    let best = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            let s: f32 = buf.par_chunks(share).map(sum).sum();
            std::hint::black_box(s);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    println!("read bandwidth: {:.1} GB/s ({mib} MiB, {threads} threads, best of {reps})", (mib << 20) as f64 / best / 1e9);
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("bandwidth") {
        let args: Vec<usize> = std::env::args().skip(2).filter_map(|a| a.parse().ok()).collect();
        bandwidth(args.first().copied().unwrap_or(1024), args.get(1).copied().unwrap_or(10));
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::env::args().nth(1).as_deref() == Some("peak") {
        // SAFETY: only called where the CPU has AVX2 and FMA.
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let best = (0..5).map(|_| unsafe { fma_peak() }).fold(0.0, f64::max);
            println!("f32 FMA peak: {best:.1} GFLOP/s per core (AVX2, 12 chains)");
        }
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: only called where the CPU has AVX-512F.
            let best = (0..5).map(|_| unsafe { fma_peak_avx512() }).fold(0.0, f64::max);
            println!("f32 FMA peak: {best:.1} GFLOP/s per core (AVX-512, 16 chains)");
        }
        for r in exla_rs_attn::host::gemm_rates().into_iter().chain(exla_rs_attn::host::unit_rates()) {
            println!("{}: {:.1} GFLOP/s per core", r.what, r.gflops);
        }
        if let Some(o) = exla_rs_attn::host::overlap(200_000) {
            println!(
                "AMX beside AVX-512, 200000 of each: products {:.1} ms, row passes {:.1} ms, interleaved {:.1} ms (sum {:.1}, max {:.1})",
                o.products,
                o.rows,
                o.interleaved,
                o.products + o.rows,
                o.products.max(o.rows)
            );
        }
        return;
    }
    if std::env::args().nth(1).as_deref() == Some("decode") {
        let args: Vec<usize> = std::env::args().skip(2).filter_map(|a| a.parse().ok()).collect();
        let only = std::env::args().skip(2).find(|a| a == "f32" || a == "bf16");
        decode(args.first().copied().unwrap_or(4096), args.get(1).copied().unwrap_or(10), only.as_deref());
        return;
    }
    // `host_bench fwd ...`: the forward alone (a profile of it without the backward's samples).
    let fwd_only = std::env::args().nth(1).as_deref() == Some("fwd");
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let s = args.first().copied().unwrap_or(2048);
    let reps = args.get(1).copied().unwrap_or(5);
    let d = args.get(2).copied().unwrap_or(64);
    match std::env::args().skip(1).find(|a| a == "bf16" || a == "f16").as_deref() {
        Some("bf16") => time_calls::<half::bf16>(s, reps, d, fwd_only),
        Some(_) => time_calls::<half::f16>(s, reps, d, fwd_only),
        None => time_calls::<f32>(s, reps, d, fwd_only),
    }
}

/// Times forward (and backward unless `fwd_only`) of B=1, H=8, S×S, head dim `d` in `T`,
/// causal and not: best wall time of `reps` calls, and the mean CPU time per call.
fn time_calls<T: HostElement>(s: usize, reps: usize, d: usize, fwd_only: bool) {
    let shape = AttnShape { batch: 1, seq_q: s, seq_k: s, heads: 8, kv_heads: 8, head_dim: d };
    // Successive inputs from successive seeds.
    let mut seed = 0x1234_5678u64;
    let mut rnd = |n: usize| {
        seed += 1;
        exla_rs_attn::random::uniform_pm1(n, seed).into_iter().map(T::from_f32).collect::<Vec<T>>()
    };
    let (q, k, v, d_o) = (rnd(shape.q_len()), rnd(shape.kv_len()), rnd(shape.kv_len()), rnd(shape.q_len()));
    let kv_len = [s as i32];
    let q_start = [0];
    let zeros = |n: usize| vec![T::from_f32(0.0); n];
    for causal in [false, true] {
        let opts = AttnOptions { scale: (d as f32).powf(-0.5), softcap: 0.0, window_left: -1, window_right: if causal { 0 } else { -1 } };
        let mut o = zeros(q.len());
        let mut lse = vec![0f32; shape.lse_len()];
        let (mut dq, mut dk, mut dv) = (zeros(q.len()), zeros(k.len()), zeros(v.len()));
        let (mut tf, mut tb) = (f64::INFINITY, f64::INFINITY);
        let (mut cf, mut cb) = (0.0, 0.0);
        for _ in 0..reps {
            let c0 = cpu_secs();
            let t = Instant::now();
            forward(&shape, &opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
            tf = tf.min(t.elapsed().as_secs_f64());
            let c1 = cpu_secs();
            cf += c1 - c0;
            if fwd_only {
                continue;
            }
            let t = Instant::now();
            backward(
                &shape,
                &opts,
                BwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start, o: &o, lse: &lse, d_o: &d_o },
                BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
                &mut [],
            )
            .unwrap();
            tb = tb.min(t.elapsed().as_secs_f64());
            cb += cpu_secs() - c1;
        }
        let flops = 4.0 * (s * s * 8 * d) as f64 / if causal { 2.0 } else { 1.0 };
        println!(
            "{} S={s} D={d} causal={causal}: fwd {:.1} ms ({:.1} GFLOP/s), bwd {:.1} ms ({:.1} GFLOP/s), fwd+bwd {:.1} ms",
            std::any::type_name::<T>().rsplit("::").next().unwrap_or("?"),
            tf * 1e3,
            flops / tf / 1e9,
            tb * 1e3,
            2.5 * flops / tb / 1e9,
            (tf + tb) * 1e3
        );
        println!("    cpu time per call: fwd {:.0} ms, bwd {:.0} ms", cf / reps as f64 * 1e3, cb / reps as f64 * 1e3);
    }
}
