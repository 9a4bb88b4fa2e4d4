//! `exla_rs_flash_attn_{fwd,bwd}_cuda_on_cpu` (feature `gpu-on-cpu`): the CUDA handlers' whole
//! code path, run on XLA's CPU platform. A call is decoded exactly as the CUDA handlers decode it
//! (the CUDA platform's support rules, feature bits and workspace sizes), its buffers are placed
//! in simulated device memory, and `exla_rs_cuda` launches the CUDA kernels on the GPU-on-CPU
//! executor (`Stream::Target(&SimDevice)`) with the launch code the GPU runs.
//!
//! Simulated device memory: every buffer gets its own exactly-sized allocation (inputs copied in,
//! so AddressSanitizer bounds an access at the tensor's own end, as memcheck would), and every
//! result and the workspace start as 0xFF bytes (NaN in every float type: an element a kernel
//! forgets to write fails the tests, as test/gpu's poisoned GPU buffers do). Results are copied
//! back to XLA's buffers after the launches succeed.

use exla_rs_attn::Platform;
use exla_rs_cuda::Stream;
use exla_rs_gpusim::{DeviceAlloc, SimDevice};
use xla_ffi::sys::{XLA_FFI_CallFrame, XLA_FFI_Error};
use xla_ffi::{run_handler, Buffer, CallFrame, FfiError};

use crate::cuda::{backward_buffers, forward_buffers, DeviceMemory};
use crate::decode::{self, attn_error};
use crate::targets::{BWD_INFO, FWD_INFO};

/// The byte every result starts as: 0xFFFF.. is a NaN in f32, f16 and bf16.
pub const POISON: u8 = 0xFF;

pub(crate) unsafe fn forward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &FWD_INFO, forward)
}

pub(crate) unsafe fn backward_handler(frame: *mut XLA_FFI_CallFrame) -> *mut XLA_FFI_Error {
    run_handler(frame, &BWD_INFO, backward)
}

/// One call's simulated device memory.
#[derive(Default)]
struct SimMemory<'a> {
    inputs: Vec<DeviceAlloc>,
    /// Each result with its device copy, written back after the launches.
    outputs: Vec<(Buffer<'a>, DeviceAlloc)>,
}

/// The host bytes of an XLA CPU buffer.
///
/// # Safety
/// `b` is a buffer of the call XLA is running (host memory on the CPU platform).
unsafe fn host_bytes<'a>(b: &Buffer<'a>) -> Result<&'a mut [u8], FfiError> {
    let n = b.size_bytes().ok_or_else(|| FfiError::internal(format!("{}: no fixed element size", b.describe())))?;
    if n == 0 {
        return Ok(&mut []);
    }
    if b.data.is_null() {
        return Err(FfiError::internal(format!("XLA passed a NULL data pointer for a {} buffer", b.describe())));
    }
    Ok(std::slice::from_raw_parts_mut(b.data.cast::<u8>(), n))
}

fn alloc_error(e: String) -> FfiError {
    FfiError::internal(format!("simulated device memory: {e}"))
}

impl<'a> DeviceMemory<'a> for SimMemory<'a> {
    fn input(&mut self, b: &Buffer<'a>) -> Result<u64, FfiError> {
        // SAFETY: an operand of the running call.
        let a = DeviceAlloc::copy_of(unsafe { host_bytes(b) }?).map_err(alloc_error)?;
        let addr = a.addr();
        self.inputs.push(a);
        Ok(addr)
    }

    fn output(&mut self, b: &Buffer<'a>) -> Result<u64, FfiError> {
        let n = b.size_bytes().ok_or_else(|| FfiError::internal(format!("{}: no fixed element size", b.describe())))?;
        let a = DeviceAlloc::filled(n, POISON).map_err(alloc_error)?;
        let addr = a.addr();
        self.outputs.push((*b, a));
        Ok(addr)
    }
}

impl SimMemory<'_> {
    /// Copies every result to XLA's buffer.
    fn copy_back(self) -> Result<(), FfiError> {
        for (b, a) in &self.outputs {
            // SAFETY: a result of the running call, host memory exclusively ours; same size.
            unsafe { host_bytes(b) }?.copy_from_slice(a.as_slice());
        }
        Ok(())
    }
}

fn forward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let target = frame.target();
    let call = decode::forward(target, frame, Platform::Cuda)?;
    let c = &call.common;
    let mut mem = SimMemory::default();
    let bufs = forward_buffers(&call, &mut mem)?;
    let device = SimDevice::from_env().map_err(|e| attn_error(target, e))?;
    // SAFETY: every pointer is a live simulated allocation of the validated size.
    unsafe { exla_rs_cuda::forward(Stream::Target(&device), c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))?;
    mem.copy_back()
}

fn backward(frame: &CallFrame<'_>) -> Result<(), FfiError> {
    let target = frame.target();
    let call = decode::backward(target, frame, Platform::Cuda)?;
    let c = &call.common;
    let mut mem = SimMemory::default();
    let bufs = backward_buffers(&call, &mut mem)?;
    let device = SimDevice::from_env().map_err(|e| attn_error(target, e))?;
    // SAFETY: as in forward.
    unsafe { exla_rs_cuda::backward(Stream::Target(&device), c.dtype, &c.shape, &c.opts, &bufs) }.map_err(|e| attn_error(target, e))?;
    mem.copy_back()
}

/// `{"kernel": launches, ...}` since the last reset.
pub fn launch_counts_json() -> String {
    let items: Vec<String> = exla_rs_gpusim::launch_counts().iter().map(|(k, n)| format!("\"{k}\": {n}")).collect();
    format!("{{{}}}", items.join(", "))
}

/// Writes `text` NUL-terminated into `buf` when it fits; returns its full length (C convention of
/// the exports: call with len 0 to size the buffer).
///
/// # Safety
/// `buf` is valid for `len` bytes (or null with len 0).
pub unsafe fn write_c_string(text: &str, buf: *mut std::ffi::c_char, len: usize) -> usize {
    if !buf.is_null() && len > 0 {
        let n = text.len().min(len - 1);
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), n);
        *buf.add(n) = 0;
    }
    text.len()
}
