//! Times the Host kernels with the optional operands against the same call without them, no XLA:
//! `cargo run --release -p exla-rs-attn --example extras_bench [S] [reps]` (B=1, H=8, D=64, f32).
//! Reports the best wall time and process CPU time of each configuration, run round-robin.

use exla_rs_attn::host::{backward_ext, forward_ext, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs};
use exla_rs_attn::{AttnOptions, AttnShape, Bias, BiasData, BiasGrad, Extras};
use std::time::Instant;

fn cpu_secs() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<f64> = after.split_whitespace().filter_map(|x| x.parse().ok()).collect();
    if f.len() > 12 { (f[10] + f[11]) / 100.0 } else { 0.0 }
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let s = args.first().copied().unwrap_or(2048);
    let reps = args.get(1).copied().unwrap_or(3);
    let (h, d) = (8usize, 64usize);
    let shape = AttnShape { batch: 1, seq_q: s, seq_k: s, heads: h, kv_heads: h, head_dim: d };
    let mut seed = 0x9E37_79B9u64;
    let mut rnd = |n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    };
    let n = s * h * d;
    let (q, k, v, d_o) = (rnd(n), rnd(n), rnd(n), rnd(n));
    let bias = rnd(h * s * s);
    let mask = vec![1u8; s];
    let slopes: Vec<f32> = (0..h).map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32)).collect();
    let kv_len = [s as i32];
    let q_start = [0i32];
    let opts = AttnOptions { scale: 0.125, softcap: 0.0, window_left: -1, window_right: -1 };
    let configs: Vec<(&str, Extras, bool)> = vec![
        ("kv_len only", Extras::default(), false),
        ("key_mask", Extras { key_mask: Some(&mask), ..Default::default() }, false),
        ("alibi", Extras { alibi_slopes: Some(&slopes), ..Default::default() }, false),
        ("bias (no dbias)", Extras { bias: Some(Bias { data: BiasData::F32(&bias), dims: [1, h, s, s] }), ..Default::default() }, false),
        ("bias + dbias", Extras { bias: Some(Bias { data: BiasData::F32(&bias), dims: [1, h, s, s] }), ..Default::default() }, true),
    ];
    // An optional third argument runs only that configuration (for profilers).
    let only = args.get(2).copied();
    let configs: Vec<_> = configs.into_iter().enumerate().filter(|(i, _)| only.is_none_or(|o| o == *i)).map(|(_, c)| c).collect();
    let mut o = vec![0f32; n];
    let mut lse = vec![0f32; h * s];
    let (mut dq, mut dk, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let mut dbias = vec![0f32; h * s * s];
    let mut best = vec![[f64::INFINITY; 4]; configs.len()];
    for _ in 0..reps {
        for (c, (_, ex, want_db)) in configs.iter().enumerate() {
            let (t, cpu) = (Instant::now(), cpu_secs());
            forward_ext(&shape, &opts, FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start }, ex, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
            let (tf, cf) = (t.elapsed().as_secs_f64(), cpu_secs() - cpu);
            let (t, cpu) = (Instant::now(), cpu_secs());
            backward_ext(
                &shape,
                &opts,
                BwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start, o: &o, lse: &lse, d_o: &d_o },
                ex,
                BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
                want_db.then(|| BiasGrad::F32(&mut dbias)),
                &mut [],
            )
            .unwrap();
            let (tb, cb) = (t.elapsed().as_secs_f64(), cpu_secs() - cpu);
            for (x, y) in best[c].iter_mut().zip([tf, cf, tb, cb]) {
                *x = x.min(y);
            }
        }
    }
    println!("S={s} B=1 H={h} D={d} f32, best of {reps}: fwd wall/cpu ms, bwd wall/cpu ms");
    for ((name, _, _), b) in configs.iter().zip(&best) {
        println!("{name:18} fwd {:7.1} {:7.1}   bwd {:7.1} {:7.1}", b[0] * 1e3, b[1] * 1e3, b[2] * 1e3, b[3] * 1e3);
    }
}
