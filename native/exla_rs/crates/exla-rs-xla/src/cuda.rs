//! CUDA handlers: decode, take XLA's stream, enqueue the kernels through `exla_rs_cuda`. No
//! synchronisation and no allocation here: scratch is the contract's trailing workspace result.

use exla_rs_attn::{ElementType, Platform};
use exla_rs_cuda::{BiasBuffer, BwdBuffers, DropoutBuffer, ExtraBuffers, FwdBuffers, Stream};
use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};
use xla_ffi::{run_handler, Buffer, CallFrame, FfiError};

use crate::decode::{self, attn_error, BwdCall, Extras, FwdCall};
use crate::targets::{BWD_INFO, FWD_INFO};

pub(crate) unsafe fn forward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &FWD_INFO, forward)
}

pub(crate) unsafe fn backward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &BWD_INFO, backward)
}

/// How the launcher gets a device pointer for each decoded buffer: XLA's own pointer on CUDA
/// ([`XlaPointers`]); a copy in simulated device memory for the GPU-on-CPU handlers
/// (`cuda_on_cpu.rs`). The rest of the plumbing is shared, so both hand the launcher the same call.
pub(crate) trait DeviceMemory<'a> {
    /// An operand the kernels read.
    fn input(&mut self, b: &Buffer<'a>) -> Result<u64, FfiError>;
    /// A result the kernels write (the workspace included).
    fn output(&mut self, b: &Buffer<'a>) -> Result<u64, FfiError>;
}

/// XLA's device pointers, as the driver API takes them.
pub(crate) struct XlaPointers;

impl<'a> DeviceMemory<'a> for XlaPointers {
    fn input(&mut self, b: &Buffer<'a>) -> Result<u64, FfiError> {
        Ok(b.data as usize as u64)
    }
    fn output(&mut self, b: &Buffer<'a>) -> Result<u64, FfiError> {
        Ok(b.data as usize as u64)
    }
}

/// The decoded optional operands as the CUDA launcher takes them: device pointers, the key
/// mask's element size, the bias's type and dims (the launcher derives the broadcast strides),
/// and dropout's threshold and scale (the key stays in device memory: no host round trip).
pub fn extra_buffers(ex: &Extras<'_>) -> ExtraBuffers {
    match extra_buffers_in(ex, &mut XlaPointers) {
        Ok(x) => x,
        Err(_) => unreachable!("XLA's own pointers need no allocation"),
    }
}

fn extra_buffers_in<'a>(ex: &Extras<'a>, mem: &mut impl DeviceMemory<'a>) -> Result<ExtraBuffers, FfiError> {
    Ok(ExtraBuffers {
        key_mask: ex.key_mask.as_ref().map(|m| mem.input(m)).transpose()?.unwrap_or(0),
        // decode accepted only integer/pred types, whose sizes are 1, 2, 4 or 8.
        key_mask_bytes: ex.key_mask.as_ref().map_or(0, |m| m.dtype.size_bytes().unwrap_or(1)),
        bias: ex
            .bias
            .as_ref()
            .map(|b| -> Result<BiasBuffer, FfiError> {
                Ok(BiasBuffer {
                    ptr: mem.input(b)?,
                    // decode accepted only f32/f16/bf16 biases of rank 4 with non-negative dims.
                    dtype: ElementType::from_xla_code(b.dtype.0).unwrap_or(ElementType::F32),
                    dims: [0, 1, 2, 3].map(|a| b.dims[a] as usize),
                })
            })
            .transpose()?,
        alibi_slopes: ex.alibi_slopes.as_ref().map(|a| mem.input(a)).transpose()?.unwrap_or(0),
        dropout: ex
            .dropout
            .as_ref()
            .map(|d| -> Result<DropoutBuffer, FfiError> { Ok(DropoutBuffer { key: mem.input(&d.key)?, threshold: d.rate.threshold, scale: d.rate.scale }) })
            .transpose()?,
    })
}

/// The workspace result's pointer and size (0, 0 without one).
fn workspace<'a>(ws: &Option<Buffer<'a>>, mem: &mut impl DeviceMemory<'a>) -> Result<(u64, usize), FfiError> {
    ws.as_ref().map_or(Ok((0, 0)), |w| Ok((mem.output(w)?, w.element_count())))
}

/// A validated forward call's buffers, placed by `mem`.
pub(crate) fn forward_buffers<'a>(call: &FwdCall<'a>, mem: &mut impl DeviceMemory<'a>) -> Result<FwdBuffers, FfiError> {
    let c = &call.common;
    let (workspace, workspace_bytes) = workspace(&call.workspace, mem)?;
    Ok(FwdBuffers {
        q: mem.input(&c.q)?,
        k: mem.input(&c.k)?,
        v: mem.input(&c.v)?,
        kv_len: mem.input(&c.kv_len)?,
        q_start: mem.input(&c.q_start)?,
        o: mem.output(&call.o)?,
        lse: mem.output(&call.lse)?,
        extras: extra_buffers_in(&c.extras, mem)?,
        workspace,
        workspace_bytes,
    })
}

/// A validated backward call's buffers, placed by `mem`.
pub(crate) fn backward_buffers<'a>(call: &BwdCall<'a>, mem: &mut impl DeviceMemory<'a>) -> Result<BwdBuffers, FfiError> {
    let c = &call.common;
    let (workspace, workspace_bytes) = workspace(&call.workspace, mem)?;
    Ok(BwdBuffers {
        q: mem.input(&c.q)?,
        k: mem.input(&c.k)?,
        v: mem.input(&c.v)?,
        kv_len: mem.input(&c.kv_len)?,
        q_start: mem.input(&c.q_start)?,
        o: mem.input(&call.o)?,
        lse: mem.input(&call.lse)?,
        d_o: mem.input(&call.d_o)?,
        dq: mem.output(&call.dq)?,
        dk: mem.output(&call.dk)?,
        dv: mem.output(&call.dv)?,
        extras: extra_buffers_in(&c.extras, mem)?,
        dbias: call.dbias.as_ref().map(|r| mem.output(r)).transpose()?.unwrap_or(0),
        workspace,
        workspace_bytes,
    })
}

fn forward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let target = frame.target();
    let call = decode::forward(target, frame, Platform::Cuda)?;
    let stream = frame.stream()?;
    let c = &call.common;
    let bufs = forward_buffers(&call, &mut XlaPointers)?;
    // SAFETY: device buffers of the validated shapes on the stream XLA gave this call.
    unsafe { exla_rs_cuda::forward(Stream::Cuda(stream), c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))
}

fn backward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let target = frame.target();
    let call = decode::backward(target, frame, Platform::Cuda)?;
    let stream = frame.stream()?;
    let c = &call.common;
    let bufs = backward_buffers(&call, &mut XlaPointers)?;
    // SAFETY: as in forward.
    unsafe { exla_rs_cuda::backward(Stream::Cuda(stream), c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))
}
