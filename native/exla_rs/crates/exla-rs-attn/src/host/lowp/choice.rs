//! Never slower: a real unit runs a call only where it beat the f32 path on this machine.
//!
//! Whether a dot-product unit pays depends on more than its presence: AVX512-BF16 on a Xeon took
//! 1.5-1.85x the f32 path's time (issue 35), and how AMX compares depends on the head dim and the
//! pass. No throughput table written on one machine holds on the next (clocks, cores sharing a
//! unit, a hypervisor's view of the tile state), so the choice is measured where it is made: at
//! the first call per (unit, row-kernel family, pass, head dim), a probe times both paths on one
//! representative call ([`ProbeShape::DEFAULT`], random operands, both paths alternately, best of
//! [`ROUNDS`]) and keeps the unit only if it was faster. The answer is kept for the process; the
//! probe costs tens of milliseconds once per head dim and pass.
//!
//! `EXLA_RS_HOST_BF16=always` skips the probe (benchmarks of the unit itself); the model units
//! (`model-amx`, `model-avx512bf16`) are always taken, being asked for by name.

use std::sync::Mutex;
use std::time::Instant;

use super::{Unit, Which};
use crate::host::kernels;
use crate::host::{BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement};
use crate::{AttnOptions, AttnShape, Extras, Pass};

/// Rounds of the probe: each times the unit, then the f32 path, once (after one warm-up each:
/// [`best_alternating`]). Seven, not three: on a shared 2-vCPU Xeon whose AMX another tenant
/// slowed in bursts, best-of-3 kept the f32 path for an AMX forward 1.75x faster than it, and
/// the answer stays for the life of the process.
const ROUNDS: usize = 7;

/// The call a probe times: long enough that the key loop dominates (tile setup and packing are
/// a few percent of it), short enough that the f32 backward at D = 256 stays near 50 ms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ProbeShape {
    pub seq: usize,
    pub heads: usize,
}

impl ProbeShape {
    pub(crate) const DEFAULT: ProbeShape = ProbeShape { seq: 512, heads: 2 };
}

/// What one probe measured, in seconds (best round of each path).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Timing {
    pub unit: f64,
    pub f32_path: f64,
}

impl Timing {
    /// The unit is taken only when it was strictly faster: a tie keeps the f32 path, which every
    /// machine runs the same way.
    pub(crate) fn unit_wins(&self) -> bool {
        self.unit < self.f32_path
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Key {
    unit: Unit,
    which: Which,
    pass: Pass,
    head_dim: usize,
}

/// Probe answers of this process (a handful of entries: a linear scan is the cheap lookup).
static DECISIONS: Mutex<Vec<(Key, Timing)>> = Mutex::new(Vec::new());

/// Whether `unit` should run this `pass` at `head_dim` with `which`'s row kernels: its probe's
/// answer, measured now when this is the first such call.
pub(crate) fn unit_pays<T: HostElement>(unit: Unit, which: Which, pass: Pass, head_dim: usize, always: bool) -> bool {
    if always || unit.is_model() {
        return true;
    }
    let key = Key { unit, which, pass, head_dim };
    if let Some(t) = lookup(key) {
        return t.unit_wins();
    }
    // Two threads may probe the same key at once; both measure the same thing and the second
    // answer replaces nothing (lookup first). Holding the lock while timing would serialise
    // calls of other head dims behind a probe for no gain.
    let t = probe::<T>(unit, which, pass, head_dim, ProbeShape::DEFAULT);
    let mut d = DECISIONS.lock().unwrap_or_else(|e| e.into_inner());
    if !d.iter().any(|(k, _)| *k == key) {
        d.push((key, t));
    }
    t.unit_wins()
}

fn lookup(key: Key) -> Option<Timing> {
    DECISIONS.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(k, _)| *k == key).map(|(_, t)| *t)
}

/// Times `unit` against the f32 path on one call of `ps`'s shape (not causal: the key loop of a
/// causal call is the same loop on fewer tiles).
pub(crate) fn probe<T: HostElement>(unit: Unit, which: Which, pass: Pass, head_dim: usize, ps: ProbeShape) -> Timing {
    let shape = AttnShape { batch: 1, seq_q: ps.seq, seq_k: ps.seq, heads: ps.heads, kv_heads: ps.heads, head_dim };
    let opts = AttnOptions { scale: (head_dim as f32).powf(-0.5), softcap: 0.0, window_left: -1, window_right: -1 };
    let draw = |n: usize, seed: u64| crate::random::uniform_pm1(n, seed).into_iter().map(T::from_f32).collect::<Vec<T>>();
    let (q, k, v) = (draw(shape.q_len(), 0x51), draw(shape.kv_len(), 0x52), draw(shape.kv_len(), 0x53));
    let (kv_len, q_start) = (vec![ps.seq as i32], vec![0i32]);
    let fwd_in = || FwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start };
    let mut o = vec![T::from_f32(0.0); shape.q_len()];
    let mut lse = vec![0f32; shape.lse_len()];
    let t = match pass {
        Pass::Forward => {
            let mut on_unit = || super::forward(unit, which, &shape, &opts, fwd_in(), FwdOutputs { o: &mut o, lse: &mut lse });
            let mut o2 = vec![T::from_f32(0.0); shape.q_len()];
            let mut lse2 = vec![0f32; shape.lse_len()];
            let mut on_f32 = || f32_forward(which, &shape, &opts, fwd_in(), FwdOutputs { o: &mut o2, lse: &mut lse2 });
            best_alternating(ROUNDS, &mut [&mut on_unit, &mut on_f32])
        }
        Pass::Backward => {
            f32_forward(which, &shape, &opts, fwd_in(), FwdOutputs { o: &mut o, lse: &mut lse });
            let d_o = draw(shape.q_len(), 0x54);
            let bwd_in = || BwdInputs { q: &q, k: &k, v: &v, kv_len: &kv_len, q_start: &q_start, o: &o, lse: &lse, d_o: &d_o };
            if !super::backward_takes(&bwd_in()) {
                // Random finite operands always qualify; should that change, the unit loses.
                return Timing { unit: f64::INFINITY, f32_path: 0.0 };
            }
            let zeros = |n: usize| vec![T::from_f32(0.0); n];
            let (mut dq, mut dk, mut dv) = (zeros(shape.q_len()), zeros(shape.kv_len()), zeros(shape.kv_len()));
            let (mut dq2, mut dk2, mut dv2) = (zeros(shape.q_len()), zeros(shape.kv_len()), zeros(shape.kv_len()));
            let mut on_unit = || super::backward(unit, which, &shape, &opts, bwd_in(), BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv });
            let mut on_f32 = || f32_backward(which, &shape, &opts, bwd_in(), BwdOutputs { dq: &mut dq2, dk: &mut dk2, dv: &mut dv2 });
            best_alternating(ROUNDS, &mut [&mut on_unit, &mut on_f32])
        }
    };
    Timing { unit: t[0], f32_path: t[1] }
}

/// Best seconds of each closure over `rounds` rounds that run them one after another (a load
/// spike hits all of them), after one warm-up run each.
pub(crate) fn best_alternating(rounds: usize, fs: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    for f in fs.iter_mut() {
        f();
    }
    let mut best = vec![f64::INFINITY; fs.len()];
    for _ in 0..rounds {
        for (b, f) in best.iter_mut().zip(fs.iter_mut()) {
            let t = Instant::now();
            f();
            *b = b.min(t.elapsed().as_secs_f64());
        }
    }
    best
}

/// The f32 path of a plain forward: what a call runs when no unit is taken.
pub(crate) fn f32_forward<T: HostElement>(which: Which, shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, out: FwdOutputs<'_, T>) {
    with_isa!(which, K => crate::host::forward::run::<T, K>(shape, opts, inp, out, &Extras::default()))
}

/// The f32 path of a plain backward.
pub(crate) fn f32_backward<T: HostElement>(which: Which, shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>) {
    with_isa!(which, K => crate::host::backward::run::<T, K>(shape, opts, inp, out, &Extras::default(), None))
}
