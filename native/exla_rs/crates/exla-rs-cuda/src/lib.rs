//! exla_rs flash attention on CUDA: the kernels of `native/exla_rs/kernels` (compiled by nvcc at
//! build time, or by NVRTC at first use) launched with cudarc on the stream XLA hands an FFI
//! handler. Loads and answers cleanly with no GPU, driver or compiler present.
//!
//! - `workspace_bytes`: the support table and scratch size (None = no kernel: -1 in the C API).
//! - `forward` / `backward`: enqueue on XLA's stream, no sync, no allocation.
//! - `status` / `kernel_build`: what the driver and this build offer, and which forward runs.
//!
//! `Stream::Target` runs the same launches (same kernels, grids, blocks, shared memory, parameter
//! blocks and tensor maps) on any other [`LaunchTarget`]: the GPU-on-CPU executor
//! (crates/exla-rs-gpusim) implements it for tests and sanitizers without a GPU. This crate knows
//! nothing else of the executor: release libraries carry none of it.

mod arch;
mod config;
pub mod determinism;
mod driver;
pub mod embedded;
mod launch;
mod launch_table;
mod modules;
mod nvrtc;
mod params;
mod sm90;
mod sm90_bwd;
mod split;
mod status;
mod stream;
mod target;
mod tensor_map;
mod workspace;

pub use arch::{parse_arch_list, Target, DEFAULT_ARCHS};
pub use config::{backward_plan, dbias_workspace_bytes, forward_plan, FeatureSet, Launch, HEAD_DIMS};
pub use config::{head_dims_summary, kernel_head_dim, pad_layout, PadLayout, MAX_PADDED_HEAD_DIM};
pub use status::{status, CudaDevice, CudaStatus};
pub use stream::Stream;
pub use target::{check_min_arch, check_smem, KernelHandle, LaunchTarget};
pub use tensor_map::{TensorMap, TiledMapArgs};
pub use launch::{backward, forward};
pub use launch_table::{every_launch, KernelLaunch};
pub use params::{bias_strides, extra_params, ExtraParams};
pub use sm90::{forward_path_summary, sm90_forward_kernel, sm90_forward_kernel_for, PathOverride, AUTO_SM90_VERIFIED, AUTO_SM90_VERIFIED_SETS, SM90_HEAD_DIMS};

use exla_rs_attn::{AttnShape, ElementType, Pass};

/// The bias operand: its device pointer, element type and `[Bb, Hb, Sqb, Skb]` dims (each 1 =
/// broadcast, or the full size).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BiasBuffer {
    pub ptr: u64,
    pub dtype: ElementType,
    pub dims: [usize; 4],
}

/// The dropout operand and attributes: the key stays in device memory (the kernels read it
/// through `key`), threshold and scale come from `exla_rs_attn::philox`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutBuffer {
    /// `u32[2]`, the Philox key.
    pub key: u64,
    /// Keep iff draw >= threshold.
    pub threshold: u32,
    /// `1 / (1 - rate)`.
    pub scale: f32,
}

/// The contract's optional operands of one call (both passes); 0 / None = absent.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExtraBuffers {
    /// `[B, Sk]` integer mask, nonzero = visible.
    pub key_mask: u64,
    /// Its element size in bytes: 1, 2, 4 or 8 (0 without a mask).
    pub key_mask_bytes: usize,
    pub bias: Option<BiasBuffer>,
    /// `f32[H]`.
    pub alibi_slopes: u64,
    pub dropout: Option<DropoutBuffer>,
}

/// Device pointers (CUdeviceptr values) of one forward call, as XLA passes them.
#[derive(Clone, Debug, Default)]
pub struct FwdBuffers {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub kv_len: u64,
    pub q_start: u64,
    pub o: u64,
    pub lse: u64,
    pub extras: ExtraBuffers,
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// Device pointers of one backward call.
#[derive(Clone, Debug, Default)]
pub struct BwdBuffers {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub kv_len: u64,
    pub q_start: u64,
    pub o: u64,
    pub lse: u64,
    pub d_o: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
    pub extras: ExtraBuffers,
    /// The `dbias` result (shaped and typed like the bias) when the call has `bias_grad`, else 0.
    /// Its f32 accumulator follows the base workspace (see [`dbias_workspace_bytes`]).
    pub dbias: u64,
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// None = this configuration is not supported on CUDA (-1 in the C API); Some(0) = no workspace.
pub fn workspace_bytes(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Option<usize> {
    workspace::workspace_bytes(pass, dtype, shape)
}

/// Like [`workspace_bytes`], with the reason when the configuration is not supported on CUDA.
pub fn workspace_requirement(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Result<usize, String> {
    workspace::workspace_requirement(pass, dtype, shape)
}

/// What this build embeds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelBuildInfo {
    /// Machine-code targets in the fatbins, e.g. `["sm_80", "sm_90"]`; empty
    /// when nvcc was absent at build time.
    pub embedded_archs: Vec<String>,
    /// The PTX target embedded for JIT on newer GPUs, e.g. `compute_80`.
    pub ptx_arch: Option<String>,
    /// `nvcc --version`'s release line, when nvcc compiled the kernels.
    pub nvcc_version: Option<String>,
    /// The kernel sources are embedded, so NVRTC can compile them at first use (always true).
    pub nvrtc_fallback: bool,
    /// Whether libnvrtc can be loaded in this process now.
    pub nvrtc_available: bool,
    /// Instantiation files (modules) embedded.
    pub kernel_files: usize,
    /// Why no fatbins were built, when none were.
    pub note: Option<String>,
}

pub fn kernel_build() -> KernelBuildInfo {
    let targets: Vec<Target> = parse_arch_list(&embedded::TARGETS.join(",")).unwrap_or_default();
    KernelBuildInfo {
        embedded_archs: targets.iter().filter(|t| matches!(t, Target::Sass { .. })).map(Target::name).collect(),
        ptx_arch: targets.iter().filter(|t| matches!(t, Target::Ptx { .. })).map(Target::name).next_back(),
        nvcc_version: embedded::NVCC_VERSION.map(str::to_string),
        nvrtc_fallback: embedded::KERNEL_FILES.iter().all(|k| !k.source.is_empty()),
        nvrtc_available: std::panic::catch_unwind(nvrtc::available).map(|r| r.is_ok()).unwrap_or(false),
        kernel_files: embedded::KERNEL_FILES.len(),
        note: embedded::BUILD_NOTE.map(str::to_string),
    }
}
