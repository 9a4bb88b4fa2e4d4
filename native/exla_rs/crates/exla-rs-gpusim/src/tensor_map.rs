//! TMA tensor maps: the executor's `cuTensorMapEncodeTiled`, taking the driver's arguments
//! unchanged (enums as their integer values), so a map is produced from exactly what the Rust
//! launcher would hand the driver.

use crate::ffi;
use std::ffi::c_void;

/// A `CUtensorMap`: 128 bytes, 64-byte aligned, read by the executor's TMA.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMap(pub [u64; 16]);

/// `cuTensorMapEncodeTiled`'s arguments, in its order. The slices carry `rank` entries
/// (`global_strides`: `rank - 1`, the stride of dimension 0 being the element size).
#[derive(Clone, Copy, Debug)]
pub struct TiledMapArgs<'a> {
    /// `CUtensorMapDataType`.
    pub data_type: i32,
    pub rank: u32,
    pub global_address: *mut c_void,
    pub global_dim: &'a [u64],
    /// Bytes, dimensions 1 .. rank.
    pub global_strides: &'a [u64],
    pub box_dim: &'a [u32],
    pub element_strides: &'a [u32],
    /// `CUtensorMapInterleave`.
    pub interleave: i32,
    /// `CUtensorMapSwizzle`.
    pub swizzle: i32,
    /// `CUtensorMapL2promotion`.
    pub l2_promotion: i32,
    /// `CUtensorMapFloatOOBfill`.
    pub oob_fill: i32,
}

/// The map the driver would encode, or the driver's refusal (`CUDA_ERROR_INVALID_VALUE` where
/// `cuTensorMapEncodeTiled` rejects the arguments).
pub fn encode_tensor_map(a: &TiledMapArgs<'_>) -> Result<TensorMap, String> {
    let rank = a.rank as usize;
    let lens = [a.global_dim.len(), a.global_strides.len() + 1, a.box_dim.len(), a.element_strides.len()];
    if !(1..=5).contains(&rank) || lens.iter().any(|&n| n != rank) {
        return Err(format!(
            "rank {rank} with {} dims, {} strides, {} box dims, {} element strides (CUDA_ERROR_INVALID_VALUE)",
            lens[0],
            lens[1] - 1,
            lens[2],
            lens[3]
        ));
    }
    let mut map = TensorMap([0; 16]);
    // SAFETY: the slices hold `rank` (strides `rank - 1`) entries, checked above; the map is 128
    // writable bytes. The executor reads global_address only when a kernel issues a TMA load.
    let rc = unsafe {
        ffi::exla_rs_gpusim_tensor_map_encode_tiled(
            (&mut map as *mut TensorMap).cast(),
            a.data_type,
            a.rank,
            a.global_address,
            a.global_dim.as_ptr(),
            a.global_strides.as_ptr(),
            a.box_dim.as_ptr(),
            a.element_strides.as_ptr(),
            a.interleave,
            a.swizzle,
            a.l2_promotion,
            a.oob_fill,
        )
    };
    match rc {
        0 => Ok(map),
        1 => Err("CUDA_ERROR_INVALID_VALUE".into()),
        other => Err(format!("error code {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_lists_must_match_the_rank() {
        let dims = [64u64, 300, 8, 2];
        let strides = [2048u64, 128, 614_400];
        let boxes = [64u32, 128, 1, 1];
        let ones = [1u32; 4];
        let args = TiledMapArgs {
            data_type: 10,
            rank: 4,
            global_address: std::ptr::null_mut(),
            global_dim: &dims,
            global_strides: &strides[..2],
            box_dim: &boxes,
            element_strides: &ones,
            interleave: 0,
            swizzle: 3,
            l2_promotion: 2,
            oob_fill: 0,
        };
        let e = encode_tensor_map(&args).unwrap_err();
        assert!(e.contains("2 strides") && e.contains("INVALID_VALUE"), "{e}");
        assert!(encode_tensor_map(&TiledMapArgs { rank: 0, ..args }).is_err());
    }
}
