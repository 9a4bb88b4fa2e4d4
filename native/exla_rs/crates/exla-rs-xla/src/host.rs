//! Host (CPU) handlers: decode, view the buffers as typed slices, run `exla_rs_attn::host`.

use exla_rs_attn::host::{self as kernel, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement};
use exla_rs_attn::{ElementType, Pass, Platform};
use half::{bf16, f16};
use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};
use xla_ffi::{run_handler, Buffer, CallFrame, FfiError};

use crate::decode::{self, attn_error, BwdCall, Common, FwdCall};
use crate::targets::{BWD_INFO, FWD_INFO};

pub(crate) unsafe fn forward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &FWD_INFO, forward)
}

pub(crate) unsafe fn backward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &BWD_INFO, backward)
}

fn forward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let call = decode::forward(frame.target(), frame, Platform::Host)?;
    match call.common.dtype {
        ElementType::F32 => run_forward::<f32>(frame.target(), &call),
        ElementType::F16 => run_forward::<f16>(frame.target(), &call),
        ElementType::BF16 => run_forward::<bf16>(frame.target(), &call),
    }
}

fn backward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let call = decode::backward(frame.target(), frame, Platform::Host)?;
    match call.common.dtype {
        ElementType::F32 => run_backward::<f32>(frame.target(), &call),
        ElementType::F16 => run_backward::<f16>(frame.target(), &call),
        ElementType::BF16 => run_backward::<bf16>(frame.target(), &call),
    }
}

/// The first `need` bytes of the workspace result: decode accepted one at least that large
/// (or none when `need` is 0), and the kernel takes exactly what it asked for.
fn workspace_slice<'a>(ws: &Option<Buffer<'a>>, pass: Pass, c: &Common<'_>) -> Result<&'a mut [u8], FfiError> {
    let need = kernel::workspace_bytes(pass, c.dtype, &c.shape);
    match ws {
        // SAFETY: XLA's result buffer, host memory, exclusively ours for the call.
        Some(w) => Ok(&mut unsafe { w.as_mut_slice::<u8>() }?[..need]),
        None => Ok(&mut []),
    }
}

fn run_forward<T: HostElement>(target: &str, call: &FwdCall<'_>) -> Result<(), FfiError> {
    let c = &call.common;
    // SAFETY: decode checked every dtype and shape against T and the contract; XLA's CPU buffers
    // are host memory, results distinct from arguments.
    let (inp, out) = unsafe {
        (
            FwdInputs { q: c.q.as_slice::<T>()?, k: c.k.as_slice::<T>()?, v: c.v.as_slice::<T>()?, kv_len: c.kv_len.as_slice()?, q_start: c.q_start.as_slice()? },
            FwdOutputs { o: call.o.as_mut_slice::<T>()?, lse: call.lse.as_mut_slice::<f32>()? },
        )
    };
    kernel::forward(&c.shape, &c.opts, inp, out, workspace_slice(&call.workspace, Pass::Forward, c)?).map_err(|e| attn_error(target, e))
}

fn run_backward<T: HostElement>(target: &str, call: &BwdCall<'_>) -> Result<(), FfiError> {
    let c = &call.common;
    // SAFETY: as in run_forward.
    let (inp, out) = unsafe {
        (
            BwdInputs {
                q: c.q.as_slice::<T>()?,
                k: c.k.as_slice::<T>()?,
                v: c.v.as_slice::<T>()?,
                kv_len: c.kv_len.as_slice()?,
                q_start: c.q_start.as_slice()?,
                o: call.o.as_slice::<T>()?,
                lse: call.lse.as_slice::<f32>()?,
                d_o: call.d_o.as_slice::<T>()?,
            },
            BwdOutputs { dq: call.dq.as_mut_slice::<T>()?, dk: call.dk.as_mut_slice::<T>()?, dv: call.dv.as_mut_slice::<T>()? },
        )
    };
    kernel::backward(&c.shape, &c.opts, inp, out, workspace_slice(&call.workspace, Pass::Backward, c)?).map_err(|e| attn_error(target, e))
}
