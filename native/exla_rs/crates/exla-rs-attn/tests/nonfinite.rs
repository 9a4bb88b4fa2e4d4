//! The contract's "no NaN" promises on the Host kernels, with poisoned inputs (issue 13, part 1):
//! an inf/NaN in k or v at a position some rows must not see reaches none of their outputs; the
//! `do` (and `q`) of a fully masked row reaches nothing; a window near i64::MAX is unbounded.
//! Each poisoned run is compared with the same call on poison-free inputs (the poison replaced by
//! 0), on every output a row or key that does not see the poison produces. The CUDA kernels are
//! checked on the same cases by test/gpu/test_cuda_xla.py (on a GPU, or on the CPU by the
//! GPU-on-CPU executor).

use exla_rs_attn::host::{backward, forward, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs};
use exla_rs_attn::{AttnOptions, AttnShape, KeyRange};

struct Run {
    o: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

#[allow(clippy::too_many_arguments)]
fn run(s: &AttnShape, opts: &AttnOptions, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32], kv_len: &[i32], q_start: &[i32]) -> Run {
    let mut o = vec![0f32; q.len()];
    let mut lse = vec![0f32; s.batch * s.heads * s.seq_q];
    forward(s, opts, FwdInputs { q, k, v, kv_len, q_start }, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0f32; q.len()], vec![0f32; k.len()], vec![0f32; v.len()]);
    backward(
        s,
        opts,
        BwdInputs { q, k, v, kv_len, q_start, o: &o, lse: &lse, d_o },
        BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv },
        &mut [],
    )
    .unwrap();
    Run { o, lse, dq, dk, dv }
}

fn input(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn close(what: &str, got: f32, want: f32) {
    assert!(got.is_finite(), "{what}: {got} (want {want})");
    assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "{what}: {got} vs {want}");
}

/// Poison (k/v elements as (b, key, kv head, col, value); q/do rows as (b, query)) and check.
#[allow(clippy::too_many_arguments)]
fn check(s: AttnShape, wl: i64, wr: i64, kv_len: &[i32], q_start: &[i32], kv: &[(usize, usize, usize, usize, f32)], rows: &[(usize, usize)], on_v: bool) {
    let opts = AttnOptions { scale: 0.3, softcap: 0.0, window_left: wl, window_right: wr };
    let (b, sq, sk, h, hkv, d) = (s.batch, s.seq_q, s.seq_k, s.heads, s.kv_heads, s.head_dim);
    let (q, k, v, d_o) = (input(b * sq * h * d, 1), input(b * sk * hkv * d, 2), input(b * sk * hkv * d, 3), input(b * sq * h * d, 4));
    let clean = |x: &[f32]| x.iter().map(|&y| if y.is_finite() { y } else { 0.0 }).collect::<Vec<_>>();
    let (mut qp, mut kp, mut vp, mut dop) = (q.clone(), k.clone(), v.clone(), d_o.clone());
    for &(bb, j, hh, c, val) in kv {
        let t = if on_v { &mut vp } else { &mut kp };
        t[((bb * sk + j) * hkv + hh) * d + c] = val;
    }
    for &(bb, i) in rows {
        for hh in 0..h {
            for c in 0..d {
                qp[((bb * sq + i) * h + hh) * d + c] = f32::NAN;
                dop[((bb * sq + i) * h + hh) * d + c] = f32::NAN;
            }
        }
    }
    let got = run(&s, &opts, &qp, &kp, &vp, &dop, kv_len, q_start);
    let want = run(&s, &opts, &clean(&qp), &clean(&kp), &clean(&vp), &clean(&dop), kv_len, q_start);
    // A (batch, kv head, key) is poisoned if any element is; a query row seeing one is "dirty".
    let bad = |bb: usize, hh: usize, j: usize| kv.iter().any(|&(b2, j2, h2, _, _)| (b2, h2, j2) == (bb, hh, j));
    let range = |bb: usize, i: usize| KeyRange::for_row(&opts, sk, kv_len[bb], q_start[bb], i);
    let dirty = |bb: usize, hq: usize, i: usize| {
        let r = range(bb, i);
        (r.start..r.end).any(|j| bad(bb, hq / (h / hkv), j))
    };
    let mut checked = 0;
    for bb in 0..b {
        for i in 0..sq {
            for hq in 0..h {
                if dirty(bb, hq, i) {
                    continue;
                }
                let n = (bb * h + hq) * sq + i;
                assert!(got.lse[n] == want.lse[n] || (got.lse[n] - want.lse[n]).abs() < 1e-5, "lse {bb},{hq},{i}");
                for c in 0..d {
                    let n = ((bb * sq + i) * h + hq) * d + c;
                    close(&format!("o[{bb},{i},{hq},{c}]"), got.o[n], want.o[n]);
                    close(&format!("dq[{bb},{i},{hq},{c}]"), got.dq[n], want.dq[n]);
                    checked += 2;
                }
            }
        }
        for j in 0..sk {
            for hh in 0..hkv {
                // dK/dV of a key are clean when no dirty row of its group sees it.
                let seen_by_dirty = (0..sq).any(|i| {
                    let r = range(bb, i);
                    r.start <= j && j < r.end && (hh * (h / hkv)..(hh + 1) * (h / hkv)).any(|hq| dirty(bb, hq, i))
                });
                if seen_by_dirty {
                    continue;
                }
                for c in 0..d {
                    let n = ((bb * sk + j) * hkv + hh) * d + c;
                    close(&format!("dk[{bb},{j},{hh},{c}]"), got.dk[n], want.dk[n]);
                    close(&format!("dv[{bb},{j},{hh},{c}]"), got.dv[n], want.dv[n]);
                    checked += 2;
                }
            }
        }
    }
    assert!(checked > 0);
}

fn shape(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> AttnShape {
    AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d }
}

#[test]
fn hidden_nonfinite_values_reach_no_row_that_does_not_see_them() {
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    for on_v in [false, true] {
        // A sliding window: key 3 is seen by rows 3..=10 only, inside the same tiles as rows 11+.
        check(shape(1, 80, 80, 2, 1, 32), 7, 0, &[80], &[0], &[(0, 3, 0, 5, inf), (0, 60, 0, 1, nan)], &[], on_v);
        // Causal with a KV cache: keys past each row's position (and past the last row) hold garbage.
        check(shape(2, 40, 70, 4, 2, 64), -1, 0, &[70, 70], &[30, 25], &[(0, 65, 1, 0, nan), (0, 35, 0, 7, -inf), (1, 69, 0, 2, inf)], &[], on_v);
        // Decode (few query rows, the decode path): a window and causal over a cache whose
        // unwritten tail holds garbage, rows of one kv head seeing different parts of a sub-block.
        check(shape(2, 3, 300, 4, 2, 64), 40, 0, &[300, 290], &[297, 150], &[(0, 299, 1, 0, nan), (0, 250, 0, 7, inf), (1, 170, 1, 3, -inf), (1, 295, 0, 0, nan)], &[], on_v);
    }
}

#[test]
fn fully_masked_rows_take_nothing_from_their_q_and_do() {
    // Rows 0..10 of batch 0 sit before key 0 under causal; batch 1 has kv_len 0.
    let rows: Vec<(usize, usize)> = (0..10).map(|i| (0, i)).chain((0..40).map(|i| (1, i))).collect();
    check(shape(2, 40, 30, 2, 1, 32), -1, 0, &[30, 0], &[-10, 0], &[], &rows, false);
}

#[test]
fn windows_near_i64_max_are_unbounded() {
    let s = shape(2, 20, 30, 2, 1, 16);
    let (q, k, v, d_o) = (input(2 * 20 * 2 * 16, 5), input(2 * 30 * 16, 6), input(2 * 30 * 16, 7), input(2 * 20 * 2 * 16, 8));
    for (wl, wr) in [(i64::MAX, i64::MAX), (i64::MAX, 0), (i64::MAX - 1, -1), (3, i64::MAX)] {
        for q_start in [[i32::MIN, 5], [0, i32::MAX - 20]] {
            let opts = |l: i64, r: i64| AttnOptions { scale: 0.25, softcap: 0.0, window_left: l, window_right: r };
            let unb = |w: i64| if w > i64::MAX / 2 { -1 } else { w };
            let got = run(&s, &opts(wl, wr), &q, &k, &v, &d_o, &[30, 17], &q_start);
            let want = run(&s, &opts(unb(wl), unb(wr)), &q, &k, &v, &d_o, &[30, 17], &q_start);
            assert_eq!(got.o, want.o, "o, window ({wl}, {wr}), q_start {q_start:?}");
            assert_eq!(got.lse, want.lse);
            assert_eq!((got.dq, got.dk, got.dv), (want.dq, want.dk, want.dv));
        }
    }
}
