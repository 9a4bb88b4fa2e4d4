//! Kernel launches: the executor's `cuLaunchKernel`, and the kernel lookup that stands in for
//! `cuModuleGetFunction`.

use crate::ffi;
use std::ffi::{c_void, CString};

/// `gridDim` / `blockDim`: x, y, z.
pub type Dim3 = [u32; 3];

/// Room for the executor's failure report (the failed check, the block, the threads involved).
const REPORT_BYTES: usize = 64 * 1024;

/// Whether this build of the executor has the kernel `name` (an `extern "C" __global__` symbol of
/// kernels/inst or kernels/sm90/inst).
pub fn has_kernel(name: &str) -> bool {
    match CString::new(name) {
        // SAFETY: a NUL-terminated string; the executor only reads it.
        Ok(c) => unsafe { ffi::exla_rs_gpusim_has_kernel(c.as_ptr()) != 0 },
        Err(_) => false,
    }
}

/// Runs one launch to completion on this thread, with the GPU's semantics. `args` is
/// `cuLaunchKernel`'s `kernelParams`: one pointer per kernel parameter, to a value of the
/// parameter's exact type. Err carries the executor's report (deadlock, lanes of a collective
/// disagreeing, an out-of-bounds shared-memory access, `__trap`, ...).
///
/// # Safety
/// `args` must match the kernel's parameter list, and every pointer inside the parameters must be
/// valid for the accesses the kernel makes (host memory standing in for device memory).
pub unsafe fn launch(kernel: &str, grid: Dim3, block: Dim3, dynamic_smem_bytes: u32, args: &mut [*mut c_void]) -> Result<(), String> {
    let name = CString::new(kernel).map_err(|_| format!("kernel name {kernel:?} contains a NUL byte"))?;
    let mut report = vec![0u8; REPORT_BYTES];
    let rc = ffi::exla_rs_gpusim_launch(
        name.as_ptr(),
        grid.as_ptr(),
        block.as_ptr(),
        dynamic_smem_bytes,
        args.as_mut_ptr(),
        report.as_mut_ptr().cast(),
        report.len(),
    );
    if rc == 0 {
        return Ok(());
    }
    Err(report_text(&report, rc))
}

/// The NUL-terminated report, or a note that the executor gave none.
fn report_text(report: &[u8], rc: i32) -> String {
    let end = report.iter().position(|&b| b == 0).unwrap_or(report.len());
    let text = String::from_utf8_lossy(&report[..end]).trim().to_string();
    if text.is_empty() {
        format!("the executor failed (code {rc}) without a report")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_cut_at_the_nul_and_never_empty() {
        assert_eq!(report_text(b"deadlock in block (1,0,0)\0garbage", 1), "deadlock in block (1,0,0)");
        assert_eq!(report_text(b"\0", 3), "the executor failed (code 3) without a report");
        assert_eq!(report_text(b"no terminator", 1), "no terminator");
    }
}
