//! One case of the GPU-on-CPU check: a call run through `exla_rs_cuda::forward` / `backward` on
//! `Stream::Target(&SimDevice)` (the launch code the GPU runs, the CUDA kernels on the CPU executor) and
//! through the Host kernels (`exla_rs_attn::host`), compared output by output.
//!
//! Every buffer the kernels see is its own exactly-sized `DeviceAlloc` (inputs copied in, results
//! and the workspace poisoned with 0xFF = NaN), so AddressSanitizer bounds each tensor as
//! memcheck would, and an element no kernel writes shows up as NaN. Shared by the harness
//! (main.rs) and the crate's `tests/gpu_on_cpu.rs`.

use exla_rs_attn::host::{self, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement};
use exla_rs_attn::philox::Dropout;
use exla_rs_attn::random::uniform_pm1;
use exla_rs_attn::{AttnOptions, AttnShape, Bias, BiasData, BiasGrad, ElementType, Extras, Pass};
use exla_rs_cuda::{BiasBuffer, BwdBuffers, DropoutBuffer, ExtraBuffers, FwdBuffers, Stream};
use exla_rs_gpusim::{DeviceAlloc, SimDevice};
use half::{bf16, f16};

/// The byte results and the workspace start as (NaN in every float type).
const POISON: u8 = 0xFF;

/// One call: shape, options, optional operands, which forward path, which passes.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: String,
    pub dtype: ElementType,
    pub shape: AttnShape,
    pub window: (i64, i64),
    pub softcap: f32,
    /// Per batch row; None = every key.
    pub kv_len: Option<Vec<i32>>,
    /// Per batch row; None = `Sk - Sq`.
    pub q_start: Option<Vec<i32>>,
    /// A `[B, Sk]` byte mask with holes.
    pub key_mask: bool,
    /// The bias's dims (1 = broadcast) and element type.
    pub bias: Option<([usize; 4], ElementType)>,
    /// The backward also returns dbias (needs `bias`).
    pub dbias: bool,
    pub alibi: bool,
    /// 0 = none.
    pub dropout: f32,
    /// `EXLA_RS_CUDA_PATH` for the forward and the backward (None = unset: auto). `Case::new` says `mma`: the
    /// executor is a 9.0 device, where auto would run some f16/bf16 calls on sm90 and leave their
    /// mma.sync forward images unchecked; the sm90 cases opt in with `sm90`.
    pub path: Option<&'static str>,
    /// `EXLA_RS_GPUSIM_SMS` for the forward (None = the default, 132).
    pub sms: Option<u32>,
    /// `EXLA_RS_CUDA_SPLITS` for the forward (None = unset: auto; decode calls take the split-KV
    /// kernels then, with the split count the launcher picks).
    pub splits: Option<&'static str>,
    pub backward: bool,
    /// The backward with `EXLA_RS_DETERMINISTIC=1` (exla-rs-cuda's determinism.rs).
    pub deterministic: bool,
    /// Allocate the forward's `o` one element short (the harness's `--short-o`): the kernels'
    /// last store lands past it, which AddressSanitizer must report.
    pub short_o: bool,
}

impl Case {
    pub fn new(name: impl Into<String>, dtype: ElementType, shape: AttnShape) -> Self {
        Case {
            name: name.into(),
            dtype,
            shape,
            window: (-1, -1),
            softcap: 0.0,
            kv_len: None,
            q_start: None,
            key_mask: false,
            bias: None,
            dbias: false,
            alibi: false,
            dropout: 0.0,
            path: Some("mma"),
            sms: None,
            splits: None,
            backward: true,
            deterministic: false,
            short_o: false,
        }
    }

    fn opts(&self) -> AttnOptions {
        AttnOptions { scale: 1.0 / (self.shape.head_dim as f32).sqrt(), softcap: self.softcap, window_left: self.window.0, window_right: self.window.1 }
    }
}

/// The largest error of each compared output, relative to the reference's largest magnitude.
#[derive(Debug, Default)]
pub struct Report {
    pub errors: Vec<(&'static str, f64)>,
    /// The backward's dq, dk and dv as the kernels wrote them (empty without a backward): two
    /// runs compare bit for bit.
    pub grads: Vec<u8>,
}

/// `TOL` of test/xla/cases.py: relative to the reference's largest magnitude. The Host kernels
/// and the CUDA kernels both round to the element type, in different orders.
fn tolerance(dtype: ElementType) -> f64 {
    match dtype {
        ElementType::F32 => 1e-4,
        ElementType::F16 => 5e-3,
        ElementType::BF16 => 3e-2,
    }
}

fn bytes<T>(v: &[T]) -> &[u8] {
    // SAFETY: plain numbers (f32, f16, bf16, i32, u32, u8) viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

fn from_bytes<T: Copy>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    // SAFETY: `n` Ts fit in `b`; read_unaligned makes no alignment assumption.
    (0..n).map(|i| unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>().add(i)) }).collect()
}

fn dev(b: &[u8]) -> Result<DeviceAlloc, String> {
    DeviceAlloc::copy_of(b)
}

fn poisoned(n: usize) -> Result<DeviceAlloc, String> {
    DeviceAlloc::filled(n, POISON)
}

/// `max |got - want| / max(max |want|, 0.1)` over the reference's finite entries; an error when
/// the two disagree on which entries are non-finite (a NaN from poison, a -inf lse).
fn compare(what: &'static str, got: &[f32], want: &[f32]) -> Result<f64, String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} values, reference has {}", got.len(), want.len()));
    }
    let (mut diff, mut scale) = (0f64, 0.1f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !w.is_finite() {
            if g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()) {
                return Err(format!("{what}[{i}] = {g}, reference {w}"));
            }
            continue;
        }
        if !g.is_finite() {
            return Err(format!("{what}[{i}] = {g} (unwritten or non-finite), reference {w}"));
        }
        diff = diff.max((g as f64 - w as f64).abs());
        scale = scale.max((w as f64).abs());
    }
    Ok(diff / scale)
}

/// Host-side inputs of a case, in the element type `T`.
struct Inputs<T> {
    q: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    d_o: Vec<T>,
    kv_len: Vec<i32>,
    q_start: Vec<i32>,
    mask: Option<Vec<u8>>,
    bias: Option<BiasInput>,
    slopes: Option<Vec<f32>>,
    dropout: Option<Dropout>,
}

/// The bias's values in its own element type (the Host kernels take typed slices).
enum BiasValues {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

struct BiasInput {
    values: BiasValues,
    dims: [usize; 4],
    dtype: ElementType,
}

impl BiasInput {
    fn new(vals: Vec<f32>, dims: [usize; 4], dtype: ElementType) -> Self {
        let values = match dtype {
            ElementType::F32 => BiasValues::F32(vals),
            ElementType::F16 => BiasValues::F16(vals.iter().map(|&x| f16::from_f32(x)).collect()),
            ElementType::BF16 => BiasValues::BF16(vals.iter().map(|&x| bf16::from_f32(x)).collect()),
        };
        BiasInput { values, dims, dtype }
    }

    fn bytes(&self) -> &[u8] {
        match &self.values {
            BiasValues::F32(v) => bytes(v),
            BiasValues::F16(v) => bytes(v),
            BiasValues::BF16(v) => bytes(v),
        }
    }

    fn host(&self) -> Bias<'_> {
        let data = match &self.values {
            BiasValues::F32(v) => BiasData::F32(v),
            BiasValues::F16(v) => BiasData::F16(v),
            BiasValues::BF16(v) => BiasData::BF16(v),
        };
        Bias { data, dims: self.dims }
    }
}

fn cast<T: HostElement>(v: Vec<f32>) -> Vec<T> {
    v.into_iter().map(T::from_f32).collect()
}

fn make_inputs<T: HostElement>(c: &Case, seed: u64) -> Inputs<T> {
    let s = c.shape;
    let (ql, kl) = (s.q_len(), s.kv_len());
    // Scaled so the softmax is far from uniform; distinct streams per tensor.
    let gen = |n: usize, k: u64| cast::<T>(uniform_pm1(n, seed * 16 + k).into_iter().map(|x| 2.0 * x).collect());
    let bias = c.bias.map(|(dims, dt)| BiasInput::new(uniform_pm1(dims.iter().product(), seed * 16 + 7), dims, dt));
    let dropout = (c.dropout > 0.0).then(|| Dropout::from_attributes(c.dropout, Some([0x243F_6A88, seed as u32])).unwrap().unwrap());
    Inputs {
        q: gen(ql, 1),
        k: gen(kl, 2),
        v: gen(kl, 3),
        d_o: gen(ql, 4),
        kv_len: c.kv_len.clone().unwrap_or_else(|| vec![s.seq_k as i32; s.batch]),
        q_start: c.q_start.clone().unwrap_or_else(|| vec![s.seq_k as i32 - s.seq_q as i32; s.batch]),
        // Holes every 5th and 7th key, one batch row fully masked when there are two.
        mask: c.key_mask.then(|| (0..s.batch * s.seq_k).map(|e| u8::from(e / s.seq_k != 1 && e % 5 != 2 && e % 7 != 3)).collect()),
        bias,
        slopes: c.alibi.then(|| (0..s.heads).map(|h| 2f32.powf(-8.0 * (h + 1) as f32 / s.heads as f32)).collect()),
        dropout,
    }
}

/// The Host reference: forward on the case's inputs; backward on the given o / lse.
struct HostRef {
    o: Vec<f32>,
    lse: Vec<f32>,
}

fn host_forward<T: HostElement>(c: &Case, x: &Inputs<T>) -> Result<HostRef, String> {
    let s = c.shape;
    let mut o = vec![T::from_f32(0.0); s.q_len()];
    let mut lse = vec![0f32; s.lse_len()];
    let ex = Extras { key_mask: x.mask.as_deref(), bias: x.bias.as_ref().map(BiasInput::host), alibi_slopes: x.slopes.as_deref(), dropout: x.dropout };
    let inp = FwdInputs { q: &x.q, k: &x.k, v: &x.v, kv_len: &x.kv_len, q_start: &x.q_start };
    host::forward_ext(&s, &c.opts(), inp, &ex, FwdOutputs { o: &mut o, lse: &mut lse }, &mut []).map_err(|e| format!("host forward: {e}"))?;
    Ok(HostRef { o: o.into_iter().map(T::to_f32).collect(), lse })
}

/// Host backward on the device forward's o / lse; returns dq, dk, dv, dbias (as f32).
fn host_backward<T: HostElement>(c: &Case, x: &Inputs<T>, o: &[T], lse: &[f32]) -> Result<[Vec<f32>; 4], String> {
    let s = c.shape;
    let (mut dq, mut dk, mut dv) = (vec![T::from_f32(0.0); s.q_len()], vec![T::from_f32(0.0); s.kv_len()], vec![T::from_f32(0.0); s.kv_len()]);
    let bias = x.bias.as_ref().map(BiasInput::host);
    let n_bias = x.bias.as_ref().map_or(0, |b| b.dims.iter().product());
    let (mut g32, mut g16, mut gb16) = (vec![0f32; n_bias], vec![f16::ZERO; n_bias], vec![bf16::ZERO; n_bias]);
    let dbias = match (c.dbias, x.bias.as_ref().map(|b| b.dtype)) {
        (true, Some(ElementType::F32)) => Some(BiasGrad::F32(&mut g32)),
        (true, Some(ElementType::F16)) => Some(BiasGrad::F16(&mut g16)),
        (true, Some(ElementType::BF16)) => Some(BiasGrad::BF16(&mut gb16)),
        _ => None,
    };
    let ex = Extras { key_mask: x.mask.as_deref(), bias, alibi_slopes: x.slopes.as_deref(), dropout: x.dropout };
    let inp = BwdInputs { q: &x.q, k: &x.k, v: &x.v, kv_len: &x.kv_len, q_start: &x.q_start, o, lse, d_o: &x.d_o };
    let out = BwdOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
    host::backward_ext(&s, &c.opts(), inp, &ex, out, dbias, &mut []).map_err(|e| format!("host backward: {e}"))?;
    let db = match x.bias.as_ref().map(|b| b.dtype) {
        Some(ElementType::F16) => g16.iter().map(|v| v.to_f32()).collect(),
        Some(ElementType::BF16) => gb16.iter().map(|v| v.to_f32()).collect(),
        _ => g32,
    };
    let f = |v: Vec<T>| v.into_iter().map(T::to_f32).collect();
    Ok([f(dq), f(dk), f(dv), if c.dbias { db } else { vec![] }])
}

/// The operands in simulated device memory.
struct DeviceInputs {
    q: DeviceAlloc,
    k: DeviceAlloc,
    v: DeviceAlloc,
    kv_len: DeviceAlloc,
    q_start: DeviceAlloc,
    mask: Option<DeviceAlloc>,
    bias: Option<(DeviceAlloc, [usize; 4], ElementType)>,
    slopes: Option<DeviceAlloc>,
    key: Option<(DeviceAlloc, Dropout)>,
}

impl DeviceInputs {
    fn new<T>(x: &Inputs<T>) -> Result<Self, String> {
        Ok(DeviceInputs {
            q: dev(bytes(&x.q))?,
            k: dev(bytes(&x.k))?,
            v: dev(bytes(&x.v))?,
            kv_len: dev(bytes(&x.kv_len))?,
            q_start: dev(bytes(&x.q_start))?,
            mask: x.mask.as_deref().map(dev).transpose()?,
            bias: x.bias.as_ref().map(|b| Ok::<_, String>((dev(b.bytes())?, b.dims, b.dtype))).transpose()?,
            slopes: x.slopes.as_deref().map(|s| dev(bytes(s))).transpose()?,
            key: x.dropout.map(|d| Ok::<_, String>((dev(bytes(&d.key))?, d))).transpose()?,
        })
    }

    fn extras(&self) -> ExtraBuffers {
        ExtraBuffers {
            key_mask: self.mask.as_ref().map_or(0, DeviceAlloc::addr),
            key_mask_bytes: if self.mask.is_some() { 1 } else { 0 },
            bias: self.bias.as_ref().map(|(b, dims, dt)| BiasBuffer { ptr: b.addr(), dtype: *dt, dims: *dims }),
            alibi_slopes: self.slopes.as_ref().map_or(0, DeviceAlloc::addr),
            dropout: self.key.as_ref().map(|(k, d)| DropoutBuffer { key: k.addr(), threshold: d.threshold, scale: d.scale }),
        }
    }
}

/// Sets (or unsets) an environment variable the launcher reads at every call. Callers run the
/// cases on one thread.
fn set_env(name: &str, value: Option<String>) {
    match value {
        Some(v) => std::env::set_var(name, v),
        None => std::env::remove_var(name),
    }
}

/// Runs one case; Err names the first output out of tolerance or the failed launch.
pub fn run(c: &Case, seed: u64) -> Result<Report, String> {
    match c.dtype {
        ElementType::F32 => run_typed::<f32>(c, seed),
        ElementType::F16 => run_typed::<f16>(c, seed),
        ElementType::BF16 => run_typed::<bf16>(c, seed),
    }
}

fn run_typed<T: HostElement>(c: &Case, seed: u64) -> Result<Report, String> {
    let s = c.shape;
    let es = std::mem::size_of::<T>();
    let x = make_inputs::<T>(c, seed);
    let d = DeviceInputs::new(&x)?;
    let tol = tolerance(c.dtype);
    let mut report = Report::default();
    let mut check = |what: &'static str, got: &[f32], want: &[f32], bar: f64| -> Result<(), String> {
        let e = compare(what, got, want)?;
        report.errors.push((what, e));
        if e > bar {
            return Err(format!("{what}: relative error {e:.2e} > {bar:.0e}"));
        }
        Ok(())
    };

    // Forward.
    let fwd_ws = exla_rs_cuda::workspace_bytes(Pass::Forward, c.dtype, &s).ok_or("no CUDA kernel for this call")?;
    let o_len = if c.short_o { s.q_len() - 1 } else { s.q_len() };
    let (o, lse, ws) = (poisoned(o_len * es)?, poisoned(s.lse_len() * 4)?, poisoned(fwd_ws)?);
    let fb = FwdBuffers {
        q: d.q.addr(),
        k: d.k.addr(),
        v: d.v.addr(),
        kv_len: d.kv_len.addr(),
        q_start: d.q_start.addr(),
        o: o.addr(),
        lse: lse.addr(),
        extras: d.extras(),
        workspace: if fwd_ws > 0 { ws.addr() } else { 0 },
        workspace_bytes: fwd_ws,
    };
    set_env("EXLA_RS_CUDA_PATH", c.path.map(str::to_string));
    set_env("EXLA_RS_GPUSIM_SMS", c.sms.map(|n| n.to_string()));
    set_env("EXLA_RS_CUDA_SPLITS", c.splits.map(str::to_string));
    // The modelled GPU as the case's environment describes it.
    let r = SimDevice::from_env().and_then(|device| {
        // SAFETY: every pointer is a live, exactly-sized allocation of the shape's buffers.
        unsafe { exla_rs_cuda::forward(Stream::Target(&device), c.dtype, &s, &c.opts(), &fb) }
    });
    set_env("EXLA_RS_CUDA_PATH", None);
    set_env("EXLA_RS_GPUSIM_SMS", None);
    set_env("EXLA_RS_CUDA_SPLITS", None);
    r.map_err(|e| format!("forward: {e}"))?;
    let want = host_forward(c, &x)?;
    let o_t: Vec<T> = from_bytes(o.as_slice());
    let lse_v: Vec<f32> = from_bytes(lse.as_slice());
    check("o", &o_t.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), &want.o, tol)?;
    check("lse", &lse_v, &want.lse, tol.max(1e-4))?;
    if !c.backward {
        return Ok(report);
    }

    // Backward, on the device forward's o and lse (as the contract's backward takes them).
    let d_o = dev(bytes(&x.d_o))?;
    let n_bias = d.bias.as_ref().map_or(0, |b| b.1.iter().product::<usize>());
    let dbias_es = d.bias.as_ref().map_or(4, |b| b.2.size_bytes());
    let base = exla_rs_cuda::workspace_bytes(Pass::Backward, c.dtype, &s).ok_or("no CUDA kernel for this call")?;
    let bwd_ws = base + if c.dbias { exla_rs_cuda::dbias_workspace_bytes(d.bias.as_ref().unwrap().1.map(|v| v as i64)).unwrap() } else { 0 };
    let (dq, dk, dv) = (poisoned(s.q_len() * es)?, poisoned(s.kv_len() * es)?, poisoned(s.kv_len() * es)?);
    let dbias = poisoned(if c.dbias { n_bias * dbias_es } else { 0 })?;
    let ws = poisoned(bwd_ws)?;
    let bb = BwdBuffers {
        q: d.q.addr(),
        k: d.k.addr(),
        v: d.v.addr(),
        kv_len: d.kv_len.addr(),
        q_start: d.q_start.addr(),
        o: o.addr(),
        lse: lse.addr(),
        d_o: d_o.addr(),
        dq: dq.addr(),
        dk: dk.addr(),
        dv: dv.addr(),
        extras: d.extras(),
        dbias: if c.dbias { dbias.addr() } else { 0 },
        workspace: if bwd_ws > 0 { ws.addr() } else { 0 },
        workspace_bytes: bwd_ws,
    };
    let device = SimDevice::from_env().map_err(|e| format!("backward: {e}"))?;
    // The case's path for the backward too (sm90: the sm90 backward where it applies).
    set_env("EXLA_RS_CUDA_PATH", c.path.map(str::to_string));
    set_env("EXLA_RS_DETERMINISTIC", c.deterministic.then(|| "1".to_string()));
    // SAFETY: as for the forward.
    let r = unsafe { exla_rs_cuda::backward(Stream::Target(&device), c.dtype, &s, &c.opts(), &bb) };
    set_env("EXLA_RS_CUDA_PATH", None);
    set_env("EXLA_RS_DETERMINISTIC", None);
    r.map_err(|e| format!("backward: {e}"))?;
    let [rq, rk, rv, rdb] = host_backward(c, &x, &o_t, &lse_v)?;
    let as_f32 = |a: &DeviceAlloc| from_bytes::<T>(a.as_slice()).iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    check("dq", &as_f32(&dq), &rq, tol)?;
    check("dk", &as_f32(&dk), &rk, tol)?;
    check("dv", &as_f32(&dv), &rv, tol)?;
    if c.dbias {
        let got: Vec<f32> = match d.bias.as_ref().unwrap().2 {
            ElementType::F32 => from_bytes(dbias.as_slice()),
            ElementType::F16 => from_bytes::<f16>(dbias.as_slice()).iter().map(|v| v.to_f32()).collect(),
            ElementType::BF16 => from_bytes::<bf16>(dbias.as_slice()).iter().map(|v| v.to_f32()).collect(),
        };
        check("dbias", &got, &rdb, 2.0 * tol)?;
    }
    report.grads = [dq.as_slice(), dk.as_slice(), dv.as_slice()].concat();
    Ok(report)
}
