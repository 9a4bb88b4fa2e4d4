//! Host (CPU) flash attention, forward and backward.
//!
//! - `forward.rs`: tiled online softmax, one rayon task per (batch, head, block of query rows);
//!   K is pre-packed once as f32 transposed tiles and V as padded f32 rows, so tasks only run
//!   register-blocked GEMMs and the `exp2` row pass. Key tiles outside a block's visible range
//!   (`KeyRange::for_rows`) are never touched: that is where causal and windows win.
//! - `backward.rs`: FlashAttention-2 backward, one task per (batch, kv head, block of keys; a
//!   group of consecutive blocks when there is a bias) owning its dK/dV rows; dQ is accumulated
//!   in f32 per query block behind a mutex. `dbias.rs` writes the bias gradient.
//! - `kernels.rs` + `simd.rs`: the inner loops, instantiated for AVX-512, AVX2+FMA(+F16C) and scalar,
//!   picked at run time ([`dispatch`]); no `-C target-cpu` needed.
//!
//! - `dropout.rs`: the dropout keep scales of a tile row (vectorised Philox); a call without
//!   dropout runs instances with no generator in them (`const DROP: bool`).
//! - `extra.rs`: the optional operands (key mask, bias, ALiBi) as per-row additions; a call
//!   without them runs the original tile loops (a `const EXT: bool` instance each), so it pays
//!   nothing for them.
//!
//! Scratch is allocated here (O(B·H·S·D) + O(B·Sk), plus an f32 copy of `dbias` when it is
//! f16/bf16; never S×S beyond what the bias itself holds), so [`workspace_bytes`] is 0.

/// Evaluates `$body` with `$K` naming the kernel family `$which` ([`Which`]) stands for: the one
/// place a run-time family choice becomes a compile-time `Isa` type.
macro_rules! with_isa {
    ($which:expr, $K:ident => $body:expr) => {
        match $which {
            #[cfg(target_arch = "x86_64")]
            Which::Avx512 => {
                type $K = kernels::avx512::Kernels;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Which::Avx2 => {
                type $K = kernels::avx2::Kernels;
                $body
            }
            Which::Scalar => {
                type $K = kernels::scalar::Kernels;
                $body
            }
        }
    };
}

mod backward;
mod dbias;
mod decode;
mod dropout;
mod element;
mod extra;
mod forward;
mod gemm_rate;
#[cfg(test)]
mod group_tests;
mod kernels;
mod lines;
mod lowp;
mod pages;
mod pool;
mod prefetch;
mod simd;
mod tiles;
#[cfg(test)]
mod tests;

pub use element::HostElement;
pub use gemm_rate::gemm_rates;
pub use lowp::peak::{overlap, unit_rates, Overlap, UnitRate};

use kernels::Isa;
use crate::{AttnError, AttnOptions, AttnShape, BiasGrad, ElementType, Extras, Pass};

/// Forward operands: `q [B, Sq, H, D]`, `k`/`v` `[B, Sk, Hkv, D]`, `kv_len`/`q_start` `s32[B]`.
pub struct FwdInputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub kv_len: &'a [i32],
    pub q_start: &'a [i32],
}

/// Forward results: `o [B, Sq, H, D]`, `lse f32[B, H, Sq]`.
pub struct FwdOutputs<'a, T> {
    pub o: &'a mut [T],
    pub lse: &'a mut [f32],
}

/// Backward operands: the forward's operands plus its `o`, `lse` and the cotangent `d_o`.
pub struct BwdInputs<'a, T> {
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub kv_len: &'a [i32],
    pub q_start: &'a [i32],
    pub o: &'a [T],
    pub lse: &'a [f32],
    pub d_o: &'a [T],
}

/// Backward results, shaped like `q`, `k`, `v`.
pub struct BwdOutputs<'a, T> {
    pub dq: &'a mut [T],
    pub dk: &'a mut [T],
    pub dv: &'a mut [T],
}

/// Bytes of the trailing `u8[N]` workspace result XLA allocates for this call (0 = none).
/// The Host kernels allocate their own bounded scratch, so they take none.
pub fn workspace_bytes(_pass: Pass, _dtype: ElementType, _shape: &AttnShape) -> usize {
    0
}

/// `o, lse = attention(q, k, v)` as the contract defines it.
pub fn forward<T: HostElement>(
    shape: &AttnShape,
    opts: &AttnOptions,
    inp: FwdInputs<'_, T>,
    out: FwdOutputs<'_, T>,
    workspace: &mut [u8],
) -> Result<(), AttnError> {
    T::run_forward(shape, opts, inp, &Extras::default(), out, workspace)
}

/// [`forward`] with the contract's optional operands (key mask, bias, ALiBi slopes).
pub fn forward_ext<T: HostElement>(
    shape: &AttnShape,
    opts: &AttnOptions,
    inp: FwdInputs<'_, T>,
    ex: &Extras<'_>,
    out: FwdOutputs<'_, T>,
    workspace: &mut [u8],
) -> Result<(), AttnError> {
    T::run_forward(shape, opts, inp, ex, out, workspace)
}

/// [`forward`] on a given kernel family (tests run every family the CPU has).
pub(crate) fn forward_on<T: HostElement>(
    which: Which,
    shape: &AttnShape,
    opts: &AttnOptions,
    inp: FwdInputs<'_, T>,
    ex: &Extras<'_>,
    out: FwdOutputs<'_, T>,
    workspace: &mut [u8],
) -> Result<(), AttnError> {
    check_common::<T>(shape, opts, inp.kv_len, inp.q_start, workspace, Pass::Forward)?;
    ex.validate(shape)?;
    let (ql, kl, ll) = lens(shape)?;
    check_len("q", inp.q.len(), ql)?;
    check_len("k", inp.k.len(), kl)?;
    check_len("v", inp.v.len(), kl)?;
    check_len("o", out.o.len(), ql)?;
    check_len("lse", out.lse.len(), ll)?;
    if decode::takes(shape, ex) {
        with_isa!(which, K => decode::run::<T, K>(shape, opts, inp, ex.key_mask, out));
        return Ok(());
    }
    // bf16 (f16 on AMX-FP16) without extras: on the CPU's dot-product unit when it has one.
    if let Some(unit) = ex.is_none().then(|| lowp::offered::<T>(which, Pass::Forward, shape.head_dim)).flatten() {
        lowp::forward(unit, which, shape, opts, inp, out);
        return Ok(());
    }
    with_isa!(which, K => forward::run::<T, K>(shape, opts, inp, out, ex));
    Ok(())
}

/// `dq, dk, dv` = gradients of `Σ o·do` with respect to `q`, `k`, `v`.
pub fn backward<T: HostElement>(
    shape: &AttnShape,
    opts: &AttnOptions,
    inp: BwdInputs<'_, T>,
    out: BwdOutputs<'_, T>,
    workspace: &mut [u8],
) -> Result<(), AttnError> {
    T::run_backward(shape, opts, inp, &Extras::default(), out, None, workspace)
}

/// [`backward`] with the optional operands; `dbias` (shaped and typed like `ex.bias`) receives
/// the bias gradient, summed over the bias's broadcast dimensions, when given.
pub fn backward_ext<T: HostElement>(
    shape: &AttnShape,
    opts: &AttnOptions,
    inp: BwdInputs<'_, T>,
    ex: &Extras<'_>,
    out: BwdOutputs<'_, T>,
    dbias: Option<BiasGrad<'_>>,
    workspace: &mut [u8],
) -> Result<(), AttnError> {
    T::run_backward(shape, opts, inp, ex, out, dbias, workspace)
}

/// [`backward`] on a given kernel family.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward_on<T: HostElement>(
    which: Which,
    shape: &AttnShape,
    opts: &AttnOptions,
    inp: BwdInputs<'_, T>,
    ex: &Extras<'_>,
    out: BwdOutputs<'_, T>,
    dbias: Option<BiasGrad<'_>>,
    workspace: &mut [u8],
) -> Result<(), AttnError> {
    check_common::<T>(shape, opts, inp.kv_len, inp.q_start, workspace, Pass::Backward)?;
    ex.validate(shape)?;
    if let Some(g) = &dbias {
        let Some(bias) = ex.bias else {
            return Err(AttnError::invalid("dbias: a bias gradient was asked for without a bias"));
        };
        if g.dtype() != bias.data.dtype() {
            return Err(AttnError::invalid(format!("dbias: must have the bias's type {}, got {}", bias.data.dtype(), g.dtype())));
        }
        check_len("dbias", g.len(), bias.data.len())?;
    }
    let (ql, kl, ll) = lens(shape)?;
    check_len("q", inp.q.len(), ql)?;
    check_len("k", inp.k.len(), kl)?;
    check_len("v", inp.v.len(), kl)?;
    check_len("o", inp.o.len(), ql)?;
    check_len("lse", inp.lse.len(), ll)?;
    check_len("do", inp.d_o.len(), ql)?;
    check_len("dq", out.dq.len(), ql)?;
    check_len("dk", out.dk.len(), kl)?;
    check_len("dv", out.dv.len(), kl)?;
    // bf16 (f16 on AMX-FP16), no extras, finite inputs: the five products on the CPU's unit. The
    // unit is asked first: the finiteness scan reads all five inputs (1.8% of an f32 backward,
    // which no unit takes).
    if let Some(unit) = ex.is_none().then(|| lowp::offered::<T>(which, Pass::Backward, shape.head_dim)).flatten().filter(|_| lowp::backward_takes(&inp)) {
        lowp::backward(unit, which, shape, opts, inp, out);
        return Ok(());
    }
    with_isa!(which, K => backward::run::<T, K>(shape, opts, inp, out, ex, dbias));
    Ok(())
}

/// The kernel family in use: the widest the CPU supports, unless `EXLA_RS_HOST_ISA`
/// (`avx512`, `avx2`, `scalar`) asks for a narrower one (benchmarks, debugging).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Which {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Scalar,
}

pub(crate) fn available() -> Vec<Which> {
    let mut v = vec![Which::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
            v.push(Which::Avx2);
        }
        if is_x86_feature_detected!("avx512f") {
            v.push(Which::Avx512);
        }
    }
    v
}

pub(crate) fn dispatch() -> Which {
    static CHOICE: std::sync::OnceLock<Which> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        let avail = available();
        let best = *avail.last().unwrap_or(&Which::Scalar);
        let wanted = std::env::var("EXLA_RS_HOST_ISA").ok();
        avail
            .iter()
            .copied()
            .find(|w| wanted.as_deref().is_some_and(|s| format!("{w:?}").eq_ignore_ascii_case(s)))
            .unwrap_or(best)
    })
}

fn check_common<T: HostElement>(
    shape: &AttnShape,
    opts: &AttnOptions,
    kv_len: &[i32],
    q_start: &[i32],
    workspace: &[u8],
    pass: Pass,
) -> Result<(), AttnError> {
    shape.validate()?;
    opts.validate()?;
    check_len("kv_len", kv_len.len(), shape.batch)?;
    check_len("q_start", q_start.len(), shape.batch)?;
    let want = workspace_bytes(pass, T::TYPE, shape);
    if workspace.len() != want {
        return Err(AttnError::invalid(format!(
            "workspace: expected u8[{want}] for the Host {pass:?} pass, got {} bytes",
            workspace.len()
        )));
    }
    Ok(())
}

/// Element counts of q-like, k-like and lse operands, refusing shapes whose sizes overflow.
fn lens(s: &AttnShape) -> Result<(usize, usize, usize), AttnError> {
    let prod = |xs: &[usize]| xs.iter().try_fold(1usize, |acc, &x| acc.checked_mul(x));
    match (
        prod(&[s.batch, s.seq_q, s.heads, s.head_dim]),
        prod(&[s.batch, s.seq_k, s.kv_heads, s.head_dim]),
        prod(&[s.batch, s.heads, s.seq_q]),
    ) {
        (Some(q), Some(k), Some(l)) => Ok((q, k, l)),
        _ => Err(AttnError::invalid(format!("shape {s:?} is too large to address"))),
    }
}

fn check_len(name: &str, got: usize, want: usize) -> Result<(), AttnError> {
    if got != want {
        return Err(AttnError::invalid(format!("{name}: expected {want} elements, got {got}")));
    }
    Ok(())
}

/// A raw output pointer shared by tasks that write provably disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr<T>(pub *mut T);
// SAFETY: each user documents why its tasks' writes never overlap.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// Through a method, so closures capture the whole (Sync) wrapper, not its raw field.
    #[inline(always)]
    pub(crate) fn get(&self) -> *mut T {
        self.0
    }
}

/// The online-softmax update of one row after a key tile: its running output `o` and sum `l`
/// scaled by `2^(m - m_new)`, the tile's `sum` added, `m` set to `m_new` (exp2 units).
pub(crate) fn online_update<K: Isa>(o: &mut [f32], m: &mut f32, l: &mut f32, m_new: f32, sum: f32) {
    if m_new == *m && m_new.is_finite() {
        // alpha = 2^0 = 1 exactly: the same l, without the scalar exp2 call (a lowp one-pass
        // row keeps its m in most steps).
        *l += sum;
        return;
    }
    if *m == f32::NEG_INFINITY {
        // The row's first visible keys: nothing seen before, so `l` is 0 and `o` holds only 0·V
        // (zeros; NaN where a masked key's V was not finite), which `alpha = 2^-inf = 0` leaves
        // as they are. Skipping the scalar `exp2` call and the pass over `o`: a lowp task's first
        // row pass took about 19.5k → 17.5k TSC cycles (64 rows, bench/RESULTS.md).
        *l = sum;
        *m = m_new;
        return;
    }
    let alpha = (*m - m_new).exp2();
    if alpha != 1.0 {
        // SAFETY: o's n elements; K's features were detected by the dispatcher (every caller
        // runs under it).
        unsafe { K::scale_row(o.as_mut_ptr(), o.len(), alpha) };
    }
    *l = *l * alpha + sum;
    *m = m_new;
}

/// A row's `lse` (natural log) from its running max `m` (exp2 units) and sum `l > 0`.
pub(crate) fn row_lse(m: f32, l: f32) -> f32 {
    (m + l.log2()) * std::f32::consts::LN_2
}

/// Writes one finished query row: `o = acc / l` in `T` and `lse = (m + log2 l)·ln 2` (`m`, `l` in
/// exp2 units), or the contract's fully masked row (`o = 0`, `lse = -inf`) when `l` is 0.
pub(crate) fn finish_row<T: HostElement>(o: &mut [T], lse: &mut f32, acc: &[f32], m: f32, l: f32) {
    if l > 0.0 {
        let inv = 1.0 / l;
        for (o, x) in o.iter_mut().zip(acc) {
            *o = T::from_f32(x * inv);
        }
        *lse = row_lse(m, l);
    } else {
        o.fill(T::from_f32(0.0));
        *lse = f32::NEG_INFINITY;
    }
}

pub(crate) fn round_up(x: usize, m: usize) -> usize {
    x.div_ceil(m) * m
}
