//! Times the Host kernels with the optional operands against the same call without them, no XLA:
//! `cargo run --release -p exla-rs-attn --example extras_bench [S] [reps] [configs, e.g. 0,3] [fwd]` (B=1, H=8,
//! D=64, f32).
//! Reports the best wall time and process CPU time of each configuration, run round-robin.
//! `FRESH=1` hands the backward a newly allocated `dbias` every call, as XLA does; `CAUSAL=1` makes
//! every configuration causal.

use exla_rs_attn::host::{backward_ext, forward_ext, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs};
use exla_rs_attn::{AttnOptions, AttnShape, Bias, BiasData, BiasGrad, Extras};
use std::time::Instant;

/// Process CPU time (all threads) in seconds, at nanosecond resolution: the sum of each thread's
/// run time from `/proc/self/task/*/schedstat` (`/proc/self/stat` counts 10 ms ticks). Rayon's
/// workers live as long as the process, so the sum only ever grows between two reads.
fn cpu_secs() -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return 0.0 };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .sum::<f64>()
        * 1e-9
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let s = args.first().copied().unwrap_or(2048);
    let reps = args.get(1).copied().unwrap_or(3);
    let (h, d) = (8usize, 64usize);
    let shape = AttnShape { batch: 1, seq_q: s, seq_k: s, heads: h, kv_heads: h, head_dim: d };
    // Successive inputs from successive seeds.
    let mut seed = 0x9E37_79B9u64;
    let mut rnd = |n: usize| {
        seed += 1;
        exla_rs_attn::random::uniform_pm1(n, seed)
    };
    let n = s * h * d;
    let (q, k, v, d_o) = (rnd(n), rnd(n), rnd(n), rnd(n));
    let bias = rnd(h * s * s);
    let mask = vec![1u8; s];
    let slopes: Vec<f32> = (0..h).map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32)).collect();
    let kv_len = [s as i32];
    let q_start = [0i32];
    // CAUSAL=1: every configuration causal (for ALiBi causal against causal).
    let causal = std::env::var("CAUSAL").is_ok_and(|v| v == "1");
    let opts = AttnOptions { scale: 0.125, softcap: 0.0, window_left: -1, window_right: if causal { 0 } else { -1 } };
    let configs: Vec<(&str, Extras, bool)> = vec![
        ("kv_len only", Extras::default(), false),
        ("key_mask", Extras { key_mask: Some(&mask), ..Default::default() }, false),
        ("alibi", Extras { alibi_slopes: Some(&slopes), ..Default::default() }, false),
        ("bias (no dbias)", Extras { bias: Some(Bias { data: BiasData::F32(&bias), dims: [1, h, s, s] }), ..Default::default() }, false),
        ("bias + dbias", Extras { bias: Some(Bias { data: BiasData::F32(&bias), dims: [1, h, s, s] }), ..Default::default() }, true),
        // Smaller biases, for telling memory traffic from compute: one row per head ({1,H,1,S}, in
        // cache) and one plane for all heads ({1,1,S,S}, 1/H of the bytes).
        ("bias {1,H,1,S}", Extras { bias: Some(Bias { data: BiasData::F32(&bias[..h * s]), dims: [1, h, 1, s] }), ..Default::default() }, false),
        ("bias {1,1,S,S}", Extras { bias: Some(Bias { data: BiasData::F32(&bias[..s * s]), dims: [1, 1, s, s] }), ..Default::default() }, false),
    ];
    // An optional third argument (`3`, or a list like `0,3,4`) runs only those configurations
    // (for profilers); `fwd` anywhere in the arguments skips the backward.
    let only: Option<Vec<usize>> = std::env::args().nth(3).filter(|a| a != "fwd").map(|a| a.split(',').filter_map(|x| x.parse().ok()).collect());
    let fwd_only = std::env::args().any(|a| a == "fwd");
    let fresh = std::env::var("FRESH").is_ok_and(|v| v == "1");
    let configs: Vec<_> = configs.into_iter().enumerate().filter(|(i, _)| only.as_ref().is_none_or(|o| o.contains(i))).map(|(_, c)| c).collect();
    let mut o = vec![0f32; n];
    let mut lse = vec![0f32; h * s];
    let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let mut dbias = vec![0f32; h * s * s + 16];
    // Every rep's times [fwd wall, fwd cpu, bwd wall, bwd cpu] per configuration: the best of
    // each, and the paired differences against the first configuration.
    let mut all: Vec<Vec<[f64; 4]>> = vec![Vec::with_capacity(reps); configs.len()];
    for _ in 0..reps {
        for (c, (_, ex, want_db)) in configs.iter().enumerate() {
            let (t, cpu) = (Instant::now(), cpu_secs());
            forward_ext(&shape, &opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start }, ex, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
            let (tf, cf) = (t.elapsed().as_secs_f64(), cpu_secs() - cpu);
            if fwd_only {
                all[c].push([tf, cf, f64::INFINITY, f64::INFINITY]);
                continue;
            }
            let (t, cpu) = (Instant::now(), cpu_secs());
            // FRESH=1: a new dbias every call, as XLA hands out (its pages are first touched by
            // the kernel), instead of one buffer reused.
            if fresh && *want_db {
                dbias = vec![0f32; h * s * s + 16];
            }
            // 64-byte aligned, as XLA's buffers are (malloc's large blocks are not).
            let at = (dbias.as_ptr() as usize).next_multiple_of(64) - dbias.as_ptr() as usize;
            let db = if *want_db { &mut dbias[at / 4..at / 4 + h * s * s] } else { &mut [][..] };
            backward_ext(
                &shape,
                &opts,
                BwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start, o: &o, lse: &lse, d_o: &d_o },
                ex,
                BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
                want_db.then_some(BiasGrad::F32(db)),
                &mut [],
            )
            .unwrap();
            let (tb, cb) = (t.elapsed().as_secs_f64(), cpu_secs() - cpu);
            all[c].push([tf, cf, tb, cb]);
        }
    }
    // The yardsticks of the bias bar: one plain read of the bias (a sum, one thread, like XLA's
    // `jnp.sum(bias)`) and one plain write of `dbias` (a fill), best of `reps`.
    let (mut read, mut write) = ([f64::INFINITY; 2], [f64::INFINITY; 2]);
    for _ in 0..reps {
        let (t, cpu) = (Instant::now(), cpu_secs());
        let sum: f32 = bias.chunks(16).map(|c| c.iter().sum::<f32>()).sum();
        std::hint::black_box(sum);
        read = [read[0].min(t.elapsed().as_secs_f64()), read[1].min(cpu_secs() - cpu)];
        let (t, cpu) = (Instant::now(), cpu_secs());
        dbias.fill(std::hint::black_box(0.5));
        std::hint::black_box(&dbias);
        write = [write[0].min(t.elapsed().as_secs_f64()), write[1].min(cpu_secs() - cpu)];
    }
    println!("S={s} B=1 H={h} D={d} f32, best of {reps}: fwd wall/cpu ms, bwd wall/cpu ms");
    println!("one read of the bias  {:7.1} {:7.1}   one write of dbias {:7.1} {:7.1}", read[0] * 1e3, read[1] * 1e3, write[0] * 1e3, write[1] * 1e3);
    for ((name, _, _), reps) in configs.iter().zip(&all) {
        let b: [f64; 4] = std::array::from_fn(|f| reps.iter().map(|x| x[f]).fold(f64::INFINITY, f64::min));
        println!("{name:18} fwd {:7.1} {:7.1}   bwd {:7.1} {:7.1}", b[0] * 1e3, b[1] * 1e3, b[2] * 1e3, b[3] * 1e3);
    }
    // The machine's speed drifts (a shared VM): two calls of the same rep, timed back to back,
    // see the same speed, so the median of their difference is steadier than best minus best.
    println!("paired: median over reps of (configuration - {}) in the same rep, ms", configs[0].0);
    for ((name, _, _), reps) in configs.iter().zip(&all).skip(1) {
        let med = |f: usize| {
            let mut d: Vec<f64> = reps.iter().zip(&all[0]).map(|(x, y)| x[f] - y[f]).collect();
            d.sort_by(f64::total_cmp);
            d[d.len() / 2] * 1e3
        };
        println!("{name:18} fwd {:+7.1} {:+7.1}   bwd {:+7.1} {:+7.1}", med(0), med(1), med(2), med(3));
    }
}
