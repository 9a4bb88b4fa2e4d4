//! The executor's shared-memory bank statistics (per kernel, per instruction kind: warp accesses,
//! wavefronts, bank conflicts), gathered across launches until reset.

use crate::ffi;

/// The statistics since the last reset, as the executor's JSON text.
pub fn stats_json() -> String {
    json_of(ffi::exla_rs_gpusim_stats_json)
}

/// Global-memory traffic since the last reset, per kernel: bytes read, written and atomically
/// added in [`crate::DeviceAlloc`] buffers, as JSON (`{"kernel": {"read": N, "written": N,
/// "atomic": N}}`). Counted by the statistics build only (`SANITIZER == Some("stats")`): `{}` in
/// the others.
pub fn traffic_json() -> String {
    json_of(ffi::exla_rs_gpusim_traffic_json)
}

fn json_of(f: unsafe extern "C" fn(*mut std::ffi::c_char, usize) -> usize) -> String {
    // SAFETY: a zero-length call only returns the length.
    let mut need = unsafe { f(std::ptr::null_mut(), 0) };
    loop {
        let mut buf = vec![0u8; need + 1];
        // SAFETY: `buf` has buf.len() writable bytes.
        let full = unsafe { f(buf.as_mut_ptr().cast(), buf.len()) };
        if full < buf.len() {
            buf.truncate(full);
            return String::from_utf8_lossy(&buf).into_owned();
        }
        // A launch on another thread grew the statistics in between: ask again.
        need = full;
    }
}

/// Forgets the statistics (bank statistics and traffic) gathered so far.
pub fn stats_reset() {
    // SAFETY: no arguments; the executor serialises access to its counters.
    unsafe { ffi::exla_rs_gpusim_stats_reset() }
}
