//! Which runtimes accept our handlers, by XLA FFI API version.
//!
//! XLA checks the version a handler reports in the metadata probe: FFI 0.1 runtimes (jaxlib 0.4.38
//! to 0.8.0) demand an exact match; from 0.2 on a runtime accepts any 0.x from 0.1 to its own.
//! Checking here first turns XLA's refusal into a reason that says what to upgrade.

use xla_ffi::ApiVersion;

/// `Ok` when a runtime at `runtime` accepts handlers reporting `handlers`, else why not.
pub fn check(runtime: ApiVersion, handlers: ApiVersion) -> Result<(), String> {
    if runtime.major != 0 || runtime.minor < 1 {
        return Err(format!(
            "XLA FFI API {runtime} is not one exla_rs knows (it supports 0.1 and later 0.x)"
        ));
    }
    if runtime.minor == 1 && handlers != runtime {
        return Err(format!("XLA FFI API 0.1 runtimes require handlers reporting exactly 0.1; ours report {handlers}"));
    }
    if handlers > runtime {
        return Err(format!("our handlers report XLA FFI API {handlers}, newer than this runtime's {runtime}"));
    }
    if handlers.major != 0 || handlers.minor < 1 {
        return Err(format!("our handlers report XLA FFI API {handlers}, which no runtime accepts"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    const V01: ApiVersion = ApiVersion::new(0, 1);

    #[test]
    fn accepts_every_runtime_from_0_1() {
        for minor in 1..=9 {
            assert_eq!(check(ApiVersion::new(0, minor), V01), Ok(()), "0.{minor}");
        }
    }

    #[test]
    fn refuses_unknown_and_too_old_runtimes() {
        assert!(check(ApiVersion::new(0, 0), V01).unwrap_err().contains("0.0"));
        assert!(check(ApiVersion::new(1, 0), V01).unwrap_err().contains("1.0"));
    }

    #[test]
    fn exact_match_on_0_1_and_range_after() {
        assert!(check(V01, ApiVersion::new(0, 2)).unwrap_err().contains("exactly 0.1"));
        assert_eq!(check(ApiVersion::new(0, 3), ApiVersion::new(0, 2)), Ok(()));
        assert!(check(ApiVersion::new(0, 2), ApiVersion::new(0, 3)).unwrap_err().contains("newer"));
    }
}
