//! Host-side TMA descriptors: `cuTensorMapEncodeTiled`'s arguments for the sm90 forward's maps and
//! the 128 opaque bytes it returns. Every launch target encodes exactly these arguments (the driver,
//! or the GPU-on-CPU executor's model), so a simulated TMA reads the map a GPU would.

use cudarc::driver::sys;
use exla_rs_attn::ElementType;
use std::ffi::c_void;

/// A `CUtensorMap` (`sm90::TensorMap` on the device): 128 opaque bytes.
#[repr(C, align(128))]
#[derive(Clone, Copy)]
pub struct TensorMap(pub [u64; 16]);

/// The TMA view of a `[B, S, H, D]` row-major tensor: dims innermost first (D, S, H, B), boxes of
/// 64 elements (one 128-byte swizzle row) x `box_rows` rows of one head of one batch row.
/// Returns (dims, byte strides of dims 1..3, box).
pub fn tensor_map_geometry(batch: usize, seq: usize, heads: usize, d: usize, box_rows: usize) -> ([u64; 4], [u64; 3], [u32; 4]) {
    let e = 2u64; // f16 / bf16
    let (b, s, h, d) = (batch as u64, seq as u64, heads as u64, d as u64);
    ([d, s, h, b], [h * d * e, d * e, s * h * d * e], [64, box_rows as u32, 1, 1])
}

/// `cuTensorMapEncodeTiled`'s arguments for one of the forward's maps. Every launch target is given
/// exactly these (target.rs `LaunchTarget::encode_tiled`).
#[derive(Clone, Copy, Debug)]
pub struct TiledMapArgs {
    pub data_type: sys::CUtensorMapDataType,
    pub global_address: *mut c_void,
    pub global_dim: [u64; 4],
    pub global_strides: [u64; 3],
    pub box_dim: [u32; 4],
    pub element_strides: [u32; 4],
    pub interleave: sys::CUtensorMapInterleave,
    pub swizzle: sys::CUtensorMapSwizzle,
    pub l2_promotion: sys::CUtensorMapL2promotion,
    pub oob_fill: sys::CUtensorMapFloatOOBfill,
}

impl TiledMapArgs {
    pub const RANK: u32 = 4;
}

/// The map of `ptr` viewed as `[batch, seq, heads, d]` with boxes of `box_rows` rows.
pub fn tiled_map_args(dtype: ElementType, ptr: u64, batch: usize, seq: usize, heads: usize, d: usize, box_rows: usize) -> TiledMapArgs {
    use sys::*;
    let (global_dim, global_strides, box_dim) = tensor_map_geometry(batch, seq, heads, d, box_rows);
    TiledMapArgs {
        data_type: match dtype {
            ElementType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        },
        global_address: ptr as *mut c_void,
        global_dim,
        global_strides,
        box_dim,
        element_strides: [1; 4],
        interleave: CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
        swizzle: CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        l2_promotion: CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        // Out-of-bounds elements (rows past S) arrive as zeros.
        oob_fill: CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    }
}
