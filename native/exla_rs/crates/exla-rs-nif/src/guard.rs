//! Every NIF body runs inside `guarded`: a Rust panic becomes `Err(reason)` (and the NIF answers
//! `{:error, reason}` or raises), never an unwinding across the C boundary into the BEAM.

use std::panic::{catch_unwind, AssertUnwindSafe};

pub fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic payload".into());
        format!("exla_rs internal error in {what}: {msg}")
    })
}
