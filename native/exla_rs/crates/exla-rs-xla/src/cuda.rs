//! CUDA handlers: decode, take XLA's stream, enqueue the kernels through `exla_rs_cuda`. No
//! synchronisation and no allocation here: scratch is the contract's trailing workspace result.

use exla_rs_attn::Platform;
use exla_rs_cuda::{BwdBuffers, FwdBuffers};
use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};
use xla_ffi::{run_handler, Buffer, CallFrame, FfiError};

use crate::decode::{self, attn_error};
use crate::targets::{BWD_INFO, FWD_INFO};

pub(crate) unsafe fn forward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &FWD_INFO, forward)
}

pub(crate) unsafe fn backward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &BWD_INFO, backward)
}

/// A device pointer as the driver API takes it.
fn dptr(b: &Buffer<'_>) -> u64 {
    b.data as usize as u64
}

fn workspace(ws: &Option<Buffer<'_>>) -> (u64, usize) {
    ws.as_ref().map_or((0, 0), |w| (dptr(w), w.element_count()))
}

fn forward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let target = frame.target();
    let call = decode::forward(target, frame, Platform::Cuda)?;
    let stream = frame.stream()?;
    let c = &call.common;
    let (ws, ws_bytes) = workspace(&call.workspace);
    let bufs = FwdBuffers {
        q: dptr(&c.q),
        k: dptr(&c.k),
        v: dptr(&c.v),
        kv_len: dptr(&c.kv_len),
        q_start: dptr(&c.q_start),
        o: dptr(&call.o),
        lse: dptr(&call.lse),
        workspace: ws,
        workspace_bytes: ws_bytes,
    };
    // SAFETY: device buffers of the validated shapes on the stream XLA gave this call.
    unsafe { exla_rs_cuda::forward(stream, c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))
}

fn backward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let target = frame.target();
    let call = decode::backward(target, frame, Platform::Cuda)?;
    let stream = frame.stream()?;
    let c = &call.common;
    let (ws, ws_bytes) = workspace(&call.workspace);
    let bufs = BwdBuffers {
        q: dptr(&c.q),
        k: dptr(&c.k),
        v: dptr(&c.v),
        kv_len: dptr(&c.kv_len),
        q_start: dptr(&c.q_start),
        o: dptr(&call.o),
        lse: dptr(&call.lse),
        d_o: dptr(&call.d_o),
        dq: dptr(&call.dq),
        dk: dptr(&call.dk),
        dv: dptr(&call.dv),
        workspace: ws,
        workspace_bytes: ws_bytes,
    };
    // SAFETY: as in forward.
    unsafe { exla_rs_cuda::backward(stream, c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))
}
