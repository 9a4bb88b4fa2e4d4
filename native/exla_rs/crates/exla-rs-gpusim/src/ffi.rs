//! `executor/exec.h`, declared for Rust. Keep in step with the header.

use std::ffi::{c_char, c_int, c_void};

extern "C" {
    pub fn exla_rs_gpusim_launch(
        kernel: *const c_char,
        grid: *const u32,
        block: *const u32,
        dynamic_smem_bytes: u32,
        args: *mut *mut c_void,
        err: *mut c_char,
        err_len: usize,
    ) -> c_int;

    pub fn exla_rs_gpusim_has_kernel(kernel: *const c_char) -> c_int;

    #[allow(clippy::too_many_arguments)] // cuTensorMapEncodeTiled's own signature
    pub fn exla_rs_gpusim_tensor_map_encode_tiled(
        tensor_map: *mut c_void,
        data_type: c_int,
        rank: u32,
        global_address: *mut c_void,
        global_dim: *const u64,
        global_strides: *const u64,
        box_dim: *const u32,
        element_strides: *const u32,
        interleave: c_int,
        swizzle: c_int,
        l2_promotion: c_int,
        oob_fill: c_int,
    ) -> c_int;

    pub fn exla_rs_gpusim_stats_json(buf: *mut c_char, len: usize) -> usize;

    pub fn exla_rs_gpusim_stats_reset();

    pub fn exla_rs_gpusim_traffic_json(buf: *mut c_char, len: usize) -> usize;

    pub fn exla_rs_gpusim_register_alloc(p: *const c_void, len: usize);

    pub fn exla_rs_gpusim_unregister_alloc(p: *const c_void);
}
