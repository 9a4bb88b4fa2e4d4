//! `forward` and `backward`: enqueue the kernels on XLA's stream (or run them on the GPU-on-CPU
//! executor: exec.rs). No synchronisation, no host round trip, no allocation beyond XLA's buffers
//! (scratch lives in the workspace result).

use crate::config::{self, FeatureSet, Launch};
use crate::driver::guard;
use crate::exec::{Device, Stream};
use crate::params::{extra_params, kernel_window, softcap_inv, BwdParams, FwdParams};
use crate::{BwdBuffers, ExtraBuffers, FwdBuffers};
use exla_rs_attn::{AttnError, AttnOptions, AttnShape, ElementType, Pass};
use std::ffi::c_void;

/// Checks the call has a kernel and enough workspace; returns the base workspace size, which is
/// where the dbias accumulator starts when `dbias_elems` is given.
fn supported(pass: Pass, dtype: ElementType, shape: &AttnShape, workspace_bytes: usize, dbias_elems: Option<usize>) -> Result<usize, AttnError> {
    let base = config::workspace_requirement(pass, dtype, shape).map_err(AttnError::unimplemented)?;
    let dbias = dbias_elems.map_or(0, |n| n * 4);
    if workspace_bytes < base + dbias {
        let why = if dbias > 0 {
            format!("{base} (exla_rs_flash_attn_workspace_bytes) + {dbias} for the dbias accumulator (exla_rs_flash_attn_dbias_workspace_bytes)")
        } else {
            format!("{base} (exla_rs_flash_attn_workspace_bytes)")
        };
        return Err(AttnError::invalid(format!("workspace result has {workspace_bytes} bytes; this call needs {why}")));
    }
    Ok(base)
}

/// The bias's element count when the backward returns dbias.
fn dbias_elems(extras: &ExtraBuffers, dbias: u64) -> Result<Option<usize>, AttnError> {
    match (&extras.bias, dbias) {
        (_, 0) => Ok(None),
        (Some(b), _) => Ok(Some(b.dims.iter().product())),
        (None, _) => Err(AttnError::invalid("a dbias result needs a bias operand")),
    }
}

/// Enqueues each launch with the same parameter block; empty grids are skipped.
unsafe fn run<P>(dev: &Device, launches: &[Launch], params: &P) -> Result<(), AttnError> {
    // Resolve every function before enqueuing anything, so a missing kernel leaves the stream alone.
    let mut funcs = Vec::with_capacity(launches.len());
    for l in launches {
        funcs.push(dev.function(l.file, l.kernel, l.smem)?);
    }
    for (l, f) in launches.iter().zip(funcs) {
        if l.grid.0 == 0 || l.grid.1 == 0 || l.grid.2 == 0 {
            continue;
        }
        let mut args = [params as *const P as *mut c_void];
        dev.launch(&f, l.kernel, l.grid, l.block, l.smem, &mut args)?;
    }
    Ok(())
}

fn dims(shape: &AttnShape) -> [i32; 6] {
    // check_supported bounds every product the kernels index with 32 bits.
    [shape.batch, shape.seq_q, shape.seq_k, shape.heads, shape.kv_heads, shape.head_dim].map(|v| v as i32)
}

/// # Safety
/// `stream` is XLA's CUstream (or the GPU-on-CPU executor); the buffers are device pointers of
/// that target of the sizes the contract implies.
pub unsafe fn forward(
    stream: Stream,
    dtype: ElementType,
    shape: &AttnShape,
    opts: &AttnOptions,
    bufs: &FwdBuffers,
) -> Result<(), AttnError> {
    guard("exla_rs_flash_attn_fwd_cuda", || {
        supported(Pass::Forward, dtype, shape, bufs.workspace_bytes, None)?;
        let dev = Device::enter(stream)?;
        let [batch, seq_q, seq_k, heads, kv_heads, head_dim] = dims(shape);
        let p = FwdParams {
            q: bufs.q as *const c_void,
            k: bufs.k as *const c_void,
            v: bufs.v as *const c_void,
            kv_len: bufs.kv_len as *const i32,
            q_start: bufs.q_start as *const i32,
            o: bufs.o as *mut c_void,
            lse: bufs.lse as *mut f32,
            batch,
            seq_q,
            seq_k,
            heads,
            kv_heads,
            head_dim,
            scale: opts.scale,
            softcap: opts.softcap,
            window_left: kernel_window(opts.window_left),
            window_right: kernel_window(opts.window_right),
            softcap_inv: softcap_inv(opts.softcap),
            x: extra_params(&bufs.extras),
        };
        // Hopper: the sm90 forward (src/sm90.rs) when the setting, the device and the call allow it.
        if crate::sm90::forward(&dev, dtype, shape, &p)? {
            return Ok(());
        }
        run(&dev, &[config::forward_plan(dtype, shape, FeatureSet::of(&p.x, false))], &p)
    })
}

/// # Safety
/// As for `forward`; `workspace` holds `workspace_bytes(Backward, ..)` bytes.
pub unsafe fn backward(
    stream: Stream,
    dtype: ElementType,
    shape: &AttnShape,
    opts: &AttnOptions,
    bufs: &BwdBuffers,
) -> Result<(), AttnError> {
    guard("exla_rs_flash_attn_bwd_cuda", || {
        let dbias_elems = dbias_elems(&bufs.extras, bufs.dbias)?;
        let base = supported(Pass::Backward, dtype, shape, bufs.workspace_bytes, dbias_elems)?;
        let dev = Device::enter(stream)?;
        let [batch, seq_q, seq_k, heads, kv_heads, head_dim] = dims(shape);
        let (delta_bytes, accum_bytes) = config::bwd_workspace_layout(dtype, shape);
        let ws = bufs.workspace;
        let p = BwdParams {
            q: bufs.q as *const c_void,
            k: bufs.k as *const c_void,
            v: bufs.v as *const c_void,
            kv_len: bufs.kv_len as *const i32,
            q_start: bufs.q_start as *const i32,
            o: bufs.o as *const c_void,
            lse: bufs.lse as *const f32,
            d_o: bufs.d_o as *const c_void,
            dq: bufs.dq as *mut c_void,
            dk: bufs.dk as *mut c_void,
            dv: bufs.dv as *mut c_void,
            delta: ws as *mut f32,
            dq_accum: if accum_bytes == 0 { std::ptr::null_mut() } else { (ws + delta_bytes as u64) as *mut f32 },
            batch,
            seq_q,
            seq_k,
            heads,
            kv_heads,
            head_dim,
            scale: opts.scale,
            softcap: opts.softcap,
            window_left: kernel_window(opts.window_left),
            window_right: kernel_window(opts.window_right),
            softcap_inv: softcap_inv(opts.softcap),
            x: extra_params(&bufs.extras),
            // The accumulator follows the base workspace (the contract's dbias workspace rule).
            dbias_accum: if dbias_elems.is_some() { (ws + base as u64) as *mut f32 } else { std::ptr::null_mut() },
            dbias: bufs.dbias as *mut c_void,
            dbias_elems: dbias_elems.unwrap_or(0) as i64,
        };
        let features = FeatureSet::of(&p.x, dbias_elems.is_some());
        run(&dev, &config::backward_plan(dtype, shape, features, dbias_elems), &p)
    })
}
