//! A decoded `XLA_FFI_CallFrame`: stage, arguments, results, attributes, stream.

use std::ffi::c_void;

use xla_ffi_sys as sys;

use crate::{api_slot, Api, Attrs, Buffer, ErrorCode, FfiError};

/// The execution stage XLA calls a handler in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Instantiate,
    Prepare,
    Initialize,
    Execute,
    Other(i32),
}

impl Stage {
    pub fn from_raw(raw: sys::XLA_FFI_ExecutionStage) -> Self {
        match raw {
            sys::XLA_FFI_ExecutionStage_INSTANTIATE => Self::Instantiate,
            sys::XLA_FFI_ExecutionStage_PREPARE => Self::Prepare,
            sys::XLA_FFI_ExecutionStage_INITIALIZE => Self::Initialize,
            sys::XLA_FFI_ExecutionStage_EXECUTE => Self::Execute,
            other => Self::Other(other),
        }
    }
}

/// A call frame with a non-NULL API table, for the duration of one handler call.
pub struct CallFrame<'a> {
    raw: &'a sys::XLA_FFI_CallFrame,
    api: Api<'a>,
    target: &'a str,
}

impl<'a> CallFrame<'a> {
    /// # Safety
    /// `raw` must be the live call frame XLA passed to the handler, with a non-NULL `api`.
    /// `target` names the handler in error messages.
    pub unsafe fn from_raw(raw: &'a sys::XLA_FFI_CallFrame, target: &'a str) -> Result<Self, FfiError> {
        let api = Api::from_ptr(raw.api).ok_or_else(|| FfiError::internal(format!("{target}: call frame without an API table")))?;
        if raw.struct_size < sys::XLA_FFI_CallFrame_STRUCT_SIZE {
            return Err(FfiError::internal(format!(
                "{target}: call frame of {} bytes, expected at least {}",
                raw.struct_size,
                sys::XLA_FFI_CallFrame_STRUCT_SIZE
            )));
        }
        Ok(Self { raw, api, target })
    }

    pub fn api(&self) -> Api<'a> {
        self.api
    }

    pub fn target(&self) -> &'a str {
        self.target
    }

    pub fn stage(&self) -> Stage {
        Stage::from_raw(self.raw.stage)
    }

    pub fn arg_count(&self) -> usize {
        self.raw.args.size.max(0) as usize
    }

    pub fn ret_count(&self) -> usize {
        self.raw.rets.size.max(0) as usize
    }

    /// Argument `i`, which must be a buffer (the only argument kind the C API has).
    pub fn arg(&self, i: usize) -> Result<Buffer<'a>, FfiError> {
        let a = &self.raw.args;
        if i >= self.arg_count() {
            return Err(FfiError::invalid_argument(format!("{}: missing operand {i} (the call has {})", self.target, self.arg_count())));
        }
        // SAFETY: XLA provides `size` entries in `types` and `args`.
        unsafe {
            let ty = *a.types.add(i);
            if ty != sys::XLA_FFI_ArgType_BUFFER {
                return Err(FfiError::invalid_argument(format!("{}: operand {i} is not a buffer (type {ty})", self.target)));
            }
            Buffer::from_raw(*a.args.add(i) as *const sys::XLA_FFI_Buffer)
        }
    }

    /// Result `i`, which must be a buffer.
    pub fn ret(&self, i: usize) -> Result<Buffer<'a>, FfiError> {
        let r = &self.raw.rets;
        if i >= self.ret_count() {
            return Err(FfiError::invalid_argument(format!("{}: missing result {i} (the call has {})", self.target, self.ret_count())));
        }
        // SAFETY: XLA provides `size` entries in `types` and `rets`.
        unsafe {
            let ty = *r.types.add(i);
            if ty != sys::XLA_FFI_RetType_BUFFER {
                return Err(FfiError::invalid_argument(format!("{}: result {i} is not a buffer (type {ty})", self.target)));
            }
            Buffer::from_raw(*r.rets.add(i) as *const sys::XLA_FFI_Buffer)
        }
    }

    pub fn attrs(&self) -> Attrs<'a> {
        // SAFETY: the frame's attrs describe `size` live entries for the call.
        unsafe { Attrs::from_raw(&self.raw.attrs) }
    }

    /// The platform stream (`CUstream` on CUDA). The CPU runtime answers UNIMPLEMENTED.
    pub fn stream(&self) -> Result<*mut c_void, FfiError> {
        let get = api_slot!(self.api, XLA_FFI_Stream_Get)
            .ok_or_else(|| FfiError::internal(format!("{}: the runtime has no XLA_FFI_Stream_Get", self.target)))?;
        let mut args = sys::XLA_FFI_Stream_Get_Args {
            struct_size: sys::XLA_FFI_Stream_Get_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            ctx: self.raw.ctx,
            stream: std::ptr::null_mut(),
        };
        // SAFETY: `args` is initialised; `ctx` is the frame's live context.
        let err = unsafe { get(&mut args) };
        if !err.is_null() {
            // SAFETY: `err` came from this runtime.
            let e = unsafe { FfiError::take_raw(self.api, err, ErrorCode::Internal) };
            return Err(FfiError::internal(format!("{}: XLA_FFI_Stream_Get failed: {}", self.target, e.message)));
        }
        Ok(args.stream)
    }
}
