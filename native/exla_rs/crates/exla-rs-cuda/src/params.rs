//! The kernels' argument blocks, field for field `kernels/params.cuh` (one struct passed by value).

use std::ffi::c_void;

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FwdParams {
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    pub kv_len: *const i32,
    pub q_start: *const i32,
    pub o: *mut c_void,
    pub lse: *mut f32,
    pub batch: i32,
    pub seq_q: i32,
    pub seq_k: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub softcap: f32,
    pub window_left: i64,
    pub window_right: i64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BwdParams {
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    pub kv_len: *const i32,
    pub q_start: *const i32,
    pub o: *const c_void,
    pub lse: *const f32,
    pub d_o: *const c_void,
    pub dq: *mut c_void,
    pub dk: *mut c_void,
    pub dv: *mut c_void,
    pub delta: *mut f32,
    pub dq_accum: *mut f32,
    pub batch: i32,
    pub seq_q: i32,
    pub seq_k: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub softcap: f32,
    pub window_left: i64,
    pub window_right: i64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_params_cuh() {
        // 7 pointers, 6 ints, 2 floats, 2 int64: the C++ compiler lays out the same sizes.
        assert_eq!(offset_of!(FwdParams, batch), 56);
        assert_eq!(offset_of!(FwdParams, scale), 80);
        assert_eq!(offset_of!(FwdParams, window_left), 88);
        assert_eq!(size_of::<FwdParams>(), 104);
        assert_eq!(offset_of!(BwdParams, batch), 104);
        assert_eq!(offset_of!(BwdParams, scale), 128);
        assert_eq!(offset_of!(BwdParams, window_right), 144);
        assert_eq!(size_of::<BwdParams>(), 152);
        let cuh = include_str!("../../../kernels/params.cuh");
        for f in ["const void* q;", "float* lse;", "int batch, seq_q, seq_k, heads, kv_heads, head_dim;", "float* dq_accum;"] {
            assert!(cuh.contains(f), "params.cuh changed: {f}");
        }
    }
}
