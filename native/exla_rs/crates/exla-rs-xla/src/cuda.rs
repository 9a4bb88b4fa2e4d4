//! CUDA handlers: decode, take XLA's stream, enqueue the kernels through `exla_rs_cuda`. No
//! synchronisation and no allocation here: scratch is the contract's trailing workspace result.

use exla_rs_attn::{ElementType, Platform};
use exla_rs_cuda::{BiasBuffer, BwdBuffers, DropoutBuffer, ExtraBuffers, FwdBuffers};
use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};
use xla_ffi::{run_handler, Buffer, CallFrame, FfiError};

use crate::decode::{self, attn_error, Extras};
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

/// The decoded optional operands as the CUDA launcher takes them: device pointers, the key
/// mask's element size, the bias's type and dims (the launcher derives the broadcast strides),
/// and dropout's threshold and scale (the key stays in device memory: no host round trip).
pub fn extra_buffers(ex: &Extras<'_>) -> ExtraBuffers {
    ExtraBuffers {
        key_mask: ex.key_mask.as_ref().map_or(0, dptr),
        // decode accepted only integer/pred types, whose sizes are 1, 2, 4 or 8.
        key_mask_bytes: ex.key_mask.as_ref().map_or(0, |m| m.dtype.size_bytes().unwrap_or(1)),
        bias: ex.bias.as_ref().map(|b| BiasBuffer {
            ptr: dptr(b),
            // decode accepted only f32/f16/bf16 biases of rank 4 with non-negative dims.
            dtype: ElementType::from_xla_code(b.dtype.0).unwrap_or(ElementType::F32),
            dims: [0, 1, 2, 3].map(|a| b.dims[a] as usize),
        }),
        alibi_slopes: ex.alibi_slopes.as_ref().map_or(0, dptr),
        dropout: ex.dropout.as_ref().map(|d| DropoutBuffer { key: dptr(&d.key), threshold: d.rate.threshold, scale: d.rate.scale }),
    }
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
        extras: extra_buffers(&c.extras),
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
        extras: extra_buffers(&c.extras),
        dbias: call.dbias.as_ref().map_or(0, dptr),
        workspace: ws,
        workspace_bytes: ws_bytes,
    };
    // SAFETY: as in forward.
    unsafe { exla_rs_cuda::backward(stream, c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))
}
