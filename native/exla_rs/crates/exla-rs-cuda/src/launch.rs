//! `forward` and `backward`: enqueue the kernels on XLA's stream (or run them on the GPU-on-CPU
//! executor: any `LaunchTarget`, stream.rs). No synchronisation, no host round trip, no allocation beyond XLA's buffers
//! (scratch lives in the workspace result).

use crate::config::{self, FeatureSet, Launch};
use crate::determinism;
use crate::split;
use crate::driver::guard;
use crate::stream::{self, Stream};
use crate::target::LaunchTarget;
use crate::workspace;
use crate::params::{extra_params, kernel_window, softcap_inv, BwdParams, FwdParams, PadParams};
use crate::{BwdBuffers, ExtraBuffers, FwdBuffers};
use exla_rs_attn::{AttnError, AttnOptions, AttnShape, ElementType, Pass};
use std::ffi::c_void;

/// Checks the call has a kernel and enough workspace; returns the base workspace size, which is
/// where the dbias accumulator starts when `dbias_elems` is given.
fn supported(pass: Pass, dtype: ElementType, shape: &AttnShape, workspace_bytes: usize, dbias_elems: Option<usize>) -> Result<usize, AttnError> {
    let base = workspace::workspace_requirement(pass, dtype, shape).map_err(AttnError::unimplemented)?;
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
unsafe fn run<P>(dev: &dyn LaunchTarget, launches: &[Launch], params: &P) -> Result<(), AttnError> {
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
        dev.launch(f, l.kernel, l.grid, l.block, l.smem, &mut args)?;
    }
    Ok(())
}

/// The tensor-core backward's main kernel in the deterministic mode (determinism.rs): launch `r`
/// runs key block `r` of every (kv head, batch), in key-block order on the stream. Its grid
/// keeps `blockIdx.x` = the key block (`r + 1` blocks wide, the first `r` returning at once,
/// `kb_first`), so the kernel's code is the default mode's.
unsafe fn run_key_block_by_key_block(dev: &dyn LaunchTarget, main: &Launch, p: &mut BwdParams) -> Result<(), AttnError> {
    for kb in 0..main.grid.0 {
        // The launch copies the parameter block when it is enqueued.
        p.kb_first = kb as i32;
        let upto = Launch { grid: (kb + 1, main.grid.1, main.grid.2), ..*main };
        run(dev, std::slice::from_ref(&upto), p)?;
    }
    p.kb_first = 0;
    Ok(())
}

/// One pad-kernel pass (kernels/pad.cuh): `rows` rows of `src_cols` elements at `src` into rows
/// of `dst_cols` elements at `dst`, the first `min(src_cols, dst_cols)` columns copied and the
/// rest zeroed. Head dims without a kernel copy their operands in (D -> Dk) and their results out
/// (Dk -> D) with it.
unsafe fn pad_copy(dev: &dyn LaunchTarget, dtype: ElementType, rows: usize, src: u64, src_cols: usize, dst: u64, dst_cols: usize) -> Result<(), AttnError> {
    let p = PadParams {
        src: src as *const c_void,
        dst: dst as *mut c_void,
        rows: rows as i64,
        src_cols: src_cols as i32,
        dst_cols: dst_cols as i32,
        copy_cols: src_cols.min(dst_cols) as i32,
        unused: 0,
    };
    run(dev, &[config::pad_launch(dtype.size_bytes(), rows)], &p)
}

/// The shape the kernels run: the call's, with a head dim without a kernel replaced by the next
/// kernel head dim (its operands and results then go through the copies of `pad`).
fn kernel_shape(shape: &AttnShape, pad: Option<&config::PadLayout>) -> AttnShape {
    pad.map_or(*shape, |l| AttnShape { head_dim: l.head_dim, ..*shape })
}

fn dims(shape: &AttnShape) -> [i32; 6] {
    // check_supported bounds every product the kernels index with 32 bits.
    [shape.batch, shape.seq_q, shape.seq_k, shape.heads, shape.kv_heads, shape.head_dim].map(|v| v as i32)
}

/// # Safety
/// `stream` is XLA's CUstream (or the GPU-on-CPU executor); the buffers are device pointers of
/// that target of the sizes the contract implies.
pub unsafe fn forward(
    stream: Stream<'_>,
    dtype: ElementType,
    shape: &AttnShape,
    opts: &AttnOptions,
    bufs: &FwdBuffers,
) -> Result<(), AttnError> {
    guard("exla_rs_flash_attn_fwd_cuda", || {
        supported(Pass::Forward, dtype, shape, bufs.workspace_bytes, None)?;
        let entered = stream::enter(stream)?;
        let dev = entered.target();
        // A head dim without a kernel: the kernels run `ks` on zero-padded copies (config.rs PadLayout).
        let pad = config::pad_layout(Pass::Forward, dtype, shape);
        let ks = kernel_shape(shape, pad.as_ref());
        let [batch, seq_q, seq_k, heads, kv_heads, head_dim] = dims(&ks);
        let mut p = FwdParams {
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
        let (d, ws) = (shape.head_dim, bufs.workspace);
        let (q_rows, kv_rows) = (shape.batch * shape.seq_q * shape.heads, shape.batch * shape.seq_k * shape.kv_heads);
        if let Some(l) = &pad {
            // Stream order: the copies, the kernels on them, o copied back.
            let dk = l.head_dim;
            pad_copy(dev, dtype, q_rows, bufs.q, d, ws + l.q as u64, dk)?;
            pad_copy(dev, dtype, kv_rows, bufs.k, d, ws + l.k as u64, dk)?;
            pad_copy(dev, dtype, kv_rows, bufs.v, d, ws + l.v as u64, dk)?;
            (p.q, p.k, p.v) = ((ws + l.q as u64) as *const c_void, (ws + l.k as u64) as *const c_void, (ws + l.v as u64) as *const c_void);
            p.o = (ws + l.o as u64) as *mut c_void;
        }
        let kernels = || -> Result<(), AttnError> {
            // Decode, and calls that leave SMs idle: the split-KV kernels (src/split.rs), on every
            // architecture (Hopper included: they read each K/V byte once, the sm90 forward once per head).
            let features = FeatureSet::of(&p.x, false);
            let setting = split::SplitSetting::from_env().map_err(AttnError::invalid)?;
            if let Some(splits) = split::choose(dtype, &ks, features, dev.sm_count()?, setting) {
                let at = workspace::split_workspace_offset(dtype, shape);
                let sp = split::params(dtype, &p, &ks, splits, bufs.workspace + at as u64, bufs.workspace_bytes.saturating_sub(at))?;
                return run(dev, &split::plan(dtype, &ks, features, splits), &sp);
            }
            // Hopper: the sm90 forward (src/sm90.rs) when the setting, the device and the call allow it.
            if crate::sm90::forward(dev, dtype, &ks, &p)? {
                return Ok(());
            }
            run(dev, &[config::forward_plan(dtype, &ks, features)], &p)
        };
        kernels()?;
        if let Some(l) = &pad {
            pad_copy(dev, dtype, q_rows, ws + l.o as u64, l.head_dim, bufs.o, d)?;
        }
        Ok(())
    })
}

/// # Safety
/// As for `forward`; `workspace` holds `workspace_bytes(Backward, ..)` bytes.
pub unsafe fn backward(
    stream: Stream<'_>,
    dtype: ElementType,
    shape: &AttnShape,
    opts: &AttnOptions,
    bufs: &BwdBuffers,
) -> Result<(), AttnError> {
    guard("exla_rs_flash_attn_bwd_cuda", || {
        let dbias_elems = dbias_elems(&bufs.extras, bufs.dbias)?;
        let base = supported(Pass::Backward, dtype, shape, bufs.workspace_bytes, dbias_elems)?;
        let deterministic = determinism::enabled()?;
        if let (true, Some(bias), Some(_)) = (deterministic, &bufs.extras.bias, dbias_elems) {
            determinism::check_dbias(bias, shape)?;
        }
        let entered = stream::enter(stream)?;
        let dev = entered.target();
        // A head dim without a kernel: the kernels run `ks` on zero-padded copies, after their own
        // scratch (delta, dq accumulator) sized for `ks` (config.rs PadLayout).
        let pad = config::pad_layout(Pass::Backward, dtype, shape);
        let ks = kernel_shape(shape, pad.as_ref());
        let [batch, seq_q, seq_k, heads, kv_heads, head_dim] = dims(&ks);
        let (delta_bytes, accum_bytes) = config::bwd_workspace_layout(dtype, &ks);
        let ws = bufs.workspace;
        let mut p = BwdParams {
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
            kb_first: 0,
            unused: 0,
        };
        let d = shape.head_dim;
        let (q_rows, kv_rows) = (shape.batch * shape.seq_q * shape.heads, shape.batch * shape.seq_k * shape.kv_heads);
        let at = |off: usize| ws + off as u64;
        if let Some(l) = &pad {
            let dk = l.head_dim;
            for (rows, src, dst) in [(q_rows, bufs.q, l.q), (kv_rows, bufs.k, l.k), (kv_rows, bufs.v, l.v), (q_rows, bufs.o, l.o), (q_rows, bufs.d_o, l.d_o)] {
                pad_copy(dev, dtype, rows, src, d, at(dst), dk)?;
            }
            (p.q, p.k, p.v, p.o, p.d_o) = (at(l.q) as _, at(l.k) as _, at(l.v) as _, at(l.o) as _, at(l.d_o) as _);
            (p.dq, p.dk, p.dv) = (at(l.dq) as _, at(l.dk) as _, at(l.dv) as _);
        }
        let features = FeatureSet::of(&p.x, dbias_elems.is_some());
        let plan = config::backward_plan(dtype, &ks, features, dbias_elems);
        // Hopper, opted in (src/sm90_bwd.rs): the sm90 main kernel in place of the mma.sync one, the
        // passes around it (dbias zero, pre; convert, dbias round) unchanged.
        match plan.iter().position(|l| l.file.starts_with("bwd_")) {
            // EXLA_RS_DETERMINISTIC (determinism.rs): the mma.sync kernel a key block at a time.
            Some(i) if deterministic => {
                run(dev, &plan[..i], &p)?;
                run_key_block_by_key_block(dev, &plan[i], &mut p)?;
                run(dev, &plan[i + 1..], &p)?;
            }
            Some(i) if crate::sm90_bwd::takes(dev, dtype, &ks)? => {
                run(dev, &plan[..i], &p)?;
                crate::sm90_bwd::launch(dev, dtype, &ks, features, &p)?;
                run(dev, &plan[i + 1..], &p)?;
            }
            _ => run(dev, &plan, &p)?,
        }
        if let Some(l) = &pad {
            for (rows, src, dst) in [(q_rows, l.dq, bufs.dq), (kv_rows, l.dk, bufs.dk), (kv_rows, l.dv, bufs.dv)] {
                pad_copy(dev, dtype, rows, at(src), l.head_dim, dst, d)?;
            }
        }
        Ok(())
    })
}
