//! `status`: what the driver and its devices offer, and which forward path runs on them, without
//! creating contexts or loading kernels (`ExlaRs.status()` shows it).

use crate::driver::{check, compute_capability, guard, init, CUdevice};
use crate::sm90::{forward_path_summary, PathOverride};
use cudarc::driver::sys;
use std::ffi::CStr;

/// One visible CUDA device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    pub ordinal: i32,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory_bytes: u64,
}

/// What the driver says, without creating contexts or loading kernels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaStatus {
    /// A driver and at least one device with compute capability >= 8.0.
    pub available: bool,
    /// Why not, when not available.
    pub reason: Option<String>,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: Option<i32>,
    pub devices: Vec<CudaDevice>,
    /// Which kernel set runs forward calls on these devices under `EXLA_RS_CUDA_PATH`, and why
    /// (sm90.rs `forward_path_summary`).
    pub forward_path: String,
}

pub fn status() -> CudaStatus {
    let mut st = CudaStatus { available: false, reason: None, driver_version: None, devices: Vec::new(), forward_path: String::new() };
    let r = guard("status", || {
        init()?;
        let mut v = 0;
        // SAFETY: plain queries into locals after cuInit.
        check(unsafe { sys::cuDriverGetVersion(&mut v) }, "cuDriverGetVersion")?;
        st.driver_version = Some(v);
        let mut n = 0;
        check(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
        for ordinal in 0..n {
            let mut dev: CUdevice = 0;
            check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) }, "cuDeviceGet")?;
            let mut name = [0 as std::ffi::c_char; 256];
            check(unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) }, "cuDeviceGetName")?;
            let mut mem = 0usize;
            check(unsafe { sys::cuDeviceTotalMem_v2(&mut mem, dev) }, "cuDeviceTotalMem")?;
            st.devices.push(CudaDevice {
                ordinal,
                // SAFETY: the driver NUL-terminates within the buffer.
                name: unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned(),
                compute_capability: compute_capability(dev)?,
                total_memory_bytes: mem as u64,
            });
        }
        Ok(())
    });
    let ccs: Vec<(i32, i32)> = st.devices.iter().map(|d| d.compute_capability).collect();
    st.forward_path = forward_path_summary(PathOverride::from_env(), &ccs);
    // Decode calls (issue 34): which run the split-KV kernels (src/split.rs), and the setting.
    st.forward_path = format!("{}; {}", st.forward_path, crate::split::summary(crate::split::SplitSetting::from_env()));
    st.forward_path = format!("{}; {}", st.forward_path, crate::sm90_bwd::backward_path_summary(PathOverride::from_env()));
    st.forward_path = format!("{}; {}", st.forward_path, crate::determinism::summary());
    match r {
        Err(e) => st.reason = Some(e.to_string()),
        Ok(()) if st.devices.is_empty() => st.reason = Some("the CUDA driver reports no device".into()),
        Ok(()) => {
            let min = crate::arch::MIN_ARCH;
            let ok = st.devices.iter().any(|d| d.compute_capability >= (min.0 as i32, min.1 as i32));
            st.available = ok;
            if !ok {
                st.reason = Some(format!(
                    "no device with compute capability >= {}.{} (the kernels need sm_80: cp.async, bf16 tensor cores)",
                    min.0, min.1
                ));
            }
        }
    }
    st
}
