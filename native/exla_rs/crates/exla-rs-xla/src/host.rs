//! Host (CPU) handlers: decode, view the buffers as typed slices, run `exla_rs_attn::host`.

use std::borrow::Cow;

use exla_rs_attn::host::{self as kernel, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement};
use exla_rs_attn::philox::Dropout;
use exla_rs_attn::{Bias, BiasData, BiasGrad, ElementType, Pass, Platform};
use half::{bf16, f16};
use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};
use xla_ffi::{run_handler, Buffer, CallFrame, FfiError};

use crate::decode::{self, attn_error, BwdCall, Common, DropoutOperand, Extras, FwdCall};
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

/// The key mask as bytes (nonzero = visible): 1-byte types are used in place, wider integers
/// are narrowed once (B·Sk bytes) so the kernel reads one layout.
///
/// # Safety
/// `m` is a host buffer of the validated `[B, Sk]` integer/pred type.
unsafe fn mask_bytes<'a>(m: &Buffer<'a>) -> Result<Cow<'a, [u8]>, FfiError> {
    Ok(match m.dtype.size_bytes() {
        Some(2) => Cow::Owned(m.as_slice::<u16>()?.iter().map(|&x| u8::from(x != 0)).collect()),
        Some(4) => Cow::Owned(m.as_slice::<u32>()?.iter().map(|&x| u8::from(x != 0)).collect()),
        Some(8) => Cow::Owned(m.as_slice::<u64>()?.iter().map(|&x| u8::from(x != 0)).collect()),
        _ => Cow::Borrowed(m.as_slice::<u8>()?),
    })
}

/// The bias operand as the kernels take it.
///
/// # Safety
/// `b` is a host buffer of the validated rank-4 f32/f16/bf16 bias.
unsafe fn bias_view<'a>(b: &Buffer<'a>) -> Result<Bias<'a>, FfiError> {
    let dims = [b.dims[0] as usize, b.dims[1] as usize, b.dims[2] as usize, b.dims[3] as usize];
    let data = match ElementType::from_xla_code(b.dtype.0) {
        Some(ElementType::F16) => BiasData::F16(b.as_slice()?),
        Some(ElementType::BF16) => BiasData::BF16(b.as_slice()?),
        _ => BiasData::F32(b.as_slice()?),
    };
    Ok(Bias { data, dims })
}

/// # Safety
/// `r` is the validated `dbias` result, host memory exclusively ours for the call.
unsafe fn bias_grad<'a>(r: &Buffer<'a>) -> Result<BiasGrad<'a>, FfiError> {
    Ok(match ElementType::from_xla_code(r.dtype.0) {
        Some(ElementType::F16) => BiasGrad::F16(r.as_mut_slice()?),
        Some(ElementType::BF16) => BiasGrad::BF16(r.as_mut_slice()?),
        _ => BiasGrad::F32(r.as_mut_slice()?),
    })
}

/// The dropout the kernels run: the decoded rate with the key read from its (host) buffer.
///
/// # Safety
/// `d.key` is the validated `u32[2]` host buffer.
unsafe fn dropout(d: &DropoutOperand<'_>) -> Result<Dropout, FfiError> {
    let k = d.key.as_slice::<u32>()?;
    Ok(d.rate.with_key([k[0], k[1]]))
}

/// The kernels' view of the optional operands; `mask` keeps a narrowed key mask alive.
///
/// # Safety
/// As for the helpers above.
unsafe fn kernel_extras<'a>(ex: &Extras<'a>, mask: &'a Option<Cow<'a, [u8]>>) -> Result<exla_rs_attn::Extras<'a>, FfiError> {
    Ok(exla_rs_attn::Extras {
        key_mask: mask.as_deref(),
        bias: ex.bias.as_ref().map(|b| bias_view(b)).transpose()?,
        alibi_slopes: ex.alibi_slopes.as_ref().map(|a| a.as_slice::<f32>()).transpose()?,
        dropout: ex.dropout.as_ref().map(|d| dropout(d)).transpose()?,
    })
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
    if c.extras.is_none() {
        return kernel::forward(&c.shape, &c.opts, inp, out, workspace_slice(&call.workspace, Pass::Forward, c)?).map_err(|e| attn_error(target, e));
    }
    // SAFETY: decode validated the optional operands' types and shapes; host memory.
    let mask = c.extras.key_mask.as_ref().map(|m| unsafe { mask_bytes(m) }).transpose()?;
    let ex = unsafe { kernel_extras(&c.extras, &mask) }?;
    kernel::forward_ext(&c.shape, &c.opts, inp, &ex, out, workspace_slice(&call.workspace, Pass::Forward, c)?).map_err(|e| attn_error(target, e))
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
    if c.extras.is_none() {
        return kernel::backward(&c.shape, &c.opts, inp, out, workspace_slice(&call.workspace, Pass::Backward, c)?).map_err(|e| attn_error(target, e));
    }
    // SAFETY: as above; dbias is a validated result buffer.
    let mask = c.extras.key_mask.as_ref().map(|m| unsafe { mask_bytes(m) }).transpose()?;
    let ex = unsafe { kernel_extras(&c.extras, &mask) }?;
    let dbias = call.dbias.as_ref().map(|r| unsafe { bias_grad(r) }).transpose()?;
    kernel::backward_ext(&c.shape, &c.opts, inp, &ex, out, dbias, workspace_slice(&call.workspace, Pass::Backward, c)?).map_err(|e| attn_error(target, e))
}
