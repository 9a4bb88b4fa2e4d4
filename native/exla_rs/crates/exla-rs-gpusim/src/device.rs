//! The GPU the executor stands in for, as exla-rs-cuda's launch code sees it: [`SimDevice`]
//! implements `exla_rs_cuda::LaunchTarget` (pass `Stream::Target(&device)` to `forward` /
//! `backward`) with what the driver would report and refuse for the GPU being modelled, and hands
//! each launch to the executor.
//!
//! - `EXLA_RS_GPUSIM_CC` (default `9.0`, an H100): the compute capability the launcher sees, so
//!   the kernel choice (sm90 or mma.sync) and the shared-memory limit are those of that GPU.
//! - `EXLA_RS_GPUSIM_SMS` (default 132, an H100 SXM): the multiprocessor count, which sizes the
//!   sm90 forward's persistent grid.
//!
//! Both are read at every call, like `EXLA_RS_CUDA_PATH`.

use exla_rs_attn::AttnError;
use exla_rs_cuda::embedded::{self, KernelSet};
use exla_rs_cuda::{check_min_arch, check_smem, KernelHandle, LaunchTarget, TensorMap, TiledMapArgs};
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// The H100 SXM: compute capability 9.0, 132 SMs.
pub const DEFAULT_CC: (i32, i32) = (9, 0);
pub const DEFAULT_SMS: u32 = 132;

/// The emulated GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimDevice {
    pub cc: (i32, i32),
    pub sms: u32,
}

/// `CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN` by compute capability (CUDA C++
/// Programming Guide, "Technical Specifications per Compute Capability").
const SMEM_OPTIN: [((i32, i32), u32); 7] = [
    ((8, 0), 163 * 1024),
    ((8, 6), 99 * 1024),
    ((8, 7), 163 * 1024),
    ((8, 9), 99 * 1024),
    ((9, 0), 227 * 1024),
    ((10, 0), 227 * 1024),
    ((12, 0), 99 * 1024),
];

/// `EXLA_RS_GPUSIM_CC`: `major.minor`, one the table above knows (or older than the kernels
/// support, which the launch then refuses as the driver path would).
pub fn parse_cc(value: Option<&str>) -> Result<(i32, i32), String> {
    let Some(v) = value.map(str::trim).filter(|v| !v.is_empty()) else { return Ok(DEFAULT_CC) };
    let bad = || {
        let known: Vec<String> = SMEM_OPTIN.iter().map(|((a, b), _)| format!("{a}.{b}")).collect();
        format!("EXLA_RS_GPUSIM_CC={v:?}: expected a compute capability major.minor, one of {}", known.join(", "))
    };
    let (a, b) = v.split_once('.').ok_or_else(bad)?;
    let cc = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
    if check_min_arch(cc).is_ok() && !SMEM_OPTIN.iter().any(|(c, _)| *c == cc) {
        return Err(bad());
    }
    Ok(cc)
}

/// `EXLA_RS_GPUSIM_SMS`: a positive count.
pub fn parse_sms(value: Option<&str>) -> Result<u32, String> {
    match value.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(DEFAULT_SMS),
        Some(v) => v.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| format!("EXLA_RS_GPUSIM_SMS={v:?}: expected a positive integer")),
    }
}

impl SimDevice {
    /// The device `EXLA_RS_GPUSIM_CC` / `EXLA_RS_GPUSIM_SMS` describe (read at every call).
    pub fn from_env() -> Result<Self, AttnError> {
        let cc = parse_cc(std::env::var("EXLA_RS_GPUSIM_CC").ok().as_deref()).map_err(AttnError::invalid)?;
        let sms = parse_sms(std::env::var("EXLA_RS_GPUSIM_SMS").ok().as_deref()).map_err(AttnError::invalid)?;
        Ok(Self { cc, sms })
    }

    fn smem_optin(&self) -> u32 {
        // parse_cc admits only known capabilities (or ones check_min_arch refuses first).
        SMEM_OPTIN.iter().find(|(c, _)| *c == self.cc).map_or(0, |(_, n)| *n)
    }
}

impl LaunchTarget for SimDevice {
    fn compute_capability(&self) -> Result<(i32, i32), AttnError> {
        Ok(self.cc)
    }

    fn sm_count(&self) -> Result<u32, AttnError> {
        Ok(self.sms)
    }

    /// What `cuModuleLoadData` + `cuModuleGetFunction` + the shared-memory opt-in would say. The
    /// executor resolves kernels by name at launch: the handle carries nothing.
    unsafe fn function(&self, file: &'static str, kernel: &'static str, smem: u32) -> Result<KernelHandle, AttnError> {
        let k = embedded::find(file).ok_or_else(|| AttnError::internal(format!("kernel file {file} is not embedded")))?;
        check_min_arch(self.cc)?;
        if k.set == KernelSet::Sm90a && self.cc != (9, 0) {
            // The sm_90a images run on compute capability 9.0 only.
            return Err(AttnError::unimplemented(format!("no kernel image for sm_{}{}: {file} is sm_90a code", self.cc.0, self.cc.1)));
        }
        if !crate::has_kernel(kernel) {
            return Err(AttnError::internal(format!("cuModuleGetFunction({kernel}): the GPU-on-CPU executor has no such kernel")));
        }
        if smem > 48 * 1024 {
            check_smem(kernel, smem, self.smem_optin() as i64)?;
        }
        Ok(KernelHandle(0))
    }

    /// Runs the launch to completion on this thread; every pointer in `args` is host memory.
    unsafe fn launch(&self, _f: KernelHandle, kernel: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &mut [*mut c_void]) -> Result<(), AttnError> {
        record_launch(kernel);
        crate::launch(kernel, [grid.0, grid.1, grid.2], [block, 1, 1], smem, args)
            .map_err(|e| AttnError::internal(format!("GPU-on-CPU launch({kernel}, grid {grid:?}, block {block}, smem {smem}) failed: {e}")))
    }

    /// The executor's `cuTensorMapEncodeTiled`, from the arguments the driver would get.
    unsafe fn encode_tiled(&self, a: &TiledMapArgs) -> Result<TensorMap, AttnError> {
        let what = || format!("cuTensorMapEncodeTiled(dims {:?}, strides {:?}, box {:?})", a.global_dim, a.global_strides, a.box_dim);
        let map = crate::encode_tensor_map(&crate::TiledMapArgs {
            data_type: a.data_type as i32,
            rank: TiledMapArgs::RANK,
            global_address: a.global_address,
            global_dim: &a.global_dim,
            global_strides: &a.global_strides,
            box_dim: &a.box_dim,
            element_strides: &a.element_strides,
            interleave: a.interleave as i32,
            swizzle: a.swizzle as i32,
            l2_promotion: a.l2_promotion as i32,
            oob_fill: a.oob_fill as i32,
        })
        .map_err(|e| AttnError::internal(format!("{} failed: {e}", what())))?;
        Ok(TensorMap(map.0))
    }
}

static LAUNCHES: Mutex<BTreeMap<String, u64>> = Mutex::new(BTreeMap::new());

fn record_launch(kernel: &str) {
    *LAUNCHES.lock().unwrap_or_else(|e| e.into_inner()).entry(kernel.to_string()).or_insert(0) += 1;
}

/// Launches per kernel on the GPU-on-CPU executor since the last reset: lets tests check that a
/// run reached every kernel it should (the sm90 forward when opted in, every instantiation).
pub fn launch_counts() -> BTreeMap<String, u64> {
    LAUNCHES.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

pub fn reset_launch_counts() {
    LAUNCHES.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

#[cfg(test)]
mod tests {
    use super::*;
    use exla_rs_attn::{AttnShape, ElementType};
    use exla_rs_cuda::FeatureSet;

    #[test]
    fn compute_capability_and_sm_count_default_to_an_h100() {
        assert_eq!(parse_cc(None), Ok((9, 0)));
        assert_eq!(parse_cc(Some(" ")), Ok((9, 0)));
        assert_eq!(parse_cc(Some("8.0")), Ok((8, 0)));
        assert_eq!(parse_cc(Some("8.9")), Ok((8, 9)));
        // Older than the kernels support: accepted here, refused at launch like on a real GPU.
        assert_eq!(parse_cc(Some("7.5")), Ok((7, 5)));
        for bad in ["9", "nine", "9.x", "11.0"] {
            let e = parse_cc(Some(bad)).unwrap_err();
            assert!(e.contains("EXLA_RS_GPUSIM_CC") && e.contains("9.0"), "{e}");
        }
        assert_eq!(parse_sms(None), Ok(132));
        assert_eq!(parse_sms(Some("8")), Ok(8));
        assert!(parse_sms(Some("0")).unwrap_err().contains("positive"));
    }

    #[test]
    fn the_driver_checks_apply_to_the_emulated_device() {
        // SAFETY (function): the simulated device holds no handle.
        unsafe { driver_checks() }
    }

    unsafe fn driver_checks() {
        let h100 = SimDevice { cc: (9, 0), sms: 132 };
        let a100 = SimDevice { cc: (8, 0), sms: 108 };
        let ada = SimDevice { cc: (8, 9), sms: 128 };
        let turing = SimDevice { cc: (7, 5), sms: 40 };
        // sm_90a code runs on 9.0 only.
        let e = a100.function("sm90_fwd_bf16_d128", "exla_rs_sm90_fwd_bf16_d128", 1024).unwrap_err();
        assert!(matches!(&e, AttnError::Unimplemented(m) if m.contains("sm_80") && m.contains("sm_90a")), "{e:?}");
        // The opt-in shared-memory limit of the modelled GPU: 99 KiB on Ada, 227 KiB on Hopper.
        let e = ada.function("fwd_bf16_d128", "exla_rs_fwd_bf16_d128", 100 * 1024).unwrap_err();
        assert!(matches!(&e, AttnError::Unimplemented(m) if m.contains("101376")), "{e:?}");
        let e = h100.function("fwd_bf16_d128", "exla_rs_fwd_bf16_d128", 228 * 1024).unwrap_err();
        assert!(matches!(&e, AttnError::Unimplemented(m) if m.contains("232448")), "{e:?}");
        let e = turing.function("fwd_bf16_d128", "exla_rs_fwd_bf16_d128", 1024).unwrap_err();
        assert!(matches!(&e, AttnError::Unimplemented(m) if m.contains("7.5")), "{e:?}");
        // Every kernel the plans name exists in the executor.
        let s = AttnShape { batch: 1, seq_q: 128, seq_k: 128, heads: 1, kv_heads: 1, head_dim: 128 };
        let l = exla_rs_cuda::forward_plan(ElementType::BF16, &s, FeatureSet::PLAIN);
        assert_eq!(h100.function(l.file, l.kernel, l.smem), Ok(KernelHandle(0)));
        let sm90 = exla_rs_cuda::sm90_forward_kernel(ElementType::F16, 64).unwrap();
        assert_eq!(h100.function("sm90_fwd_f16_d64", sm90, 1024), Ok(KernelHandle(0)));
        let e = h100.function("aux", "exla_rs_no_such_kernel", 0).unwrap_err();
        assert!(matches!(&e, AttnError::Internal(m) if m.contains("exla_rs_no_such_kernel")), "{e:?}");
    }
}
