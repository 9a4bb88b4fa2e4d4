//! CUDA driver/device status and how the kernels were built, as maps. Only called from the
//! `cuda_status` / `kernel_build` NIFs (dirty schedulers), never at load: querying the driver
//! initialises CUDA.

use rustler::{Encoder, Env, Term};

use crate::terms::make_map as map;

pub fn status(env: Env<'_>) -> Term<'_> {
    let s = exla_rs_cuda::status();
    let devices: Vec<Term<'_>> = s
        .devices
        .iter()
        .map(|d| {
            map(
                env,
                vec![
                    ("ordinal", d.ordinal.encode(env)),
                    ("name", d.name.encode(env)),
                    ("compute_capability", d.compute_capability.encode(env)),
                    ("total_memory_bytes", d.total_memory_bytes.encode(env)),
                ],
            )
        })
        .collect();
    map(
        env,
        vec![
            ("available", s.available.encode(env)),
            ("reason", s.reason.encode(env)),
            ("driver_version", s.driver_version.encode(env)),
            ("devices", devices.encode(env)),
            ("forward_path", s.forward_path.encode(env)),
        ],
    )
}

pub fn kernels(env: Env<'_>) -> Term<'_> {
    let k = exla_rs_cuda::kernel_build();
    map(
        env,
        vec![
            ("embedded_archs", k.embedded_archs.encode(env)),
            ("ptx_arch", k.ptx_arch.encode(env)),
            ("nvcc_version", k.nvcc_version.encode(env)),
            ("nvrtc_fallback", k.nvrtc_fallback.encode(env)),
            ("nvrtc_available", k.nvrtc_available.encode(env)),
            ("kernel_files", k.kernel_files.encode(env)),
            ("note", k.note.encode(env)),
            // Which head dims run natively and which padded (issue 33, part 4).
            ("head_dims", exla_rs_cuda::head_dims_summary().encode(env)),
        ],
    )
}
