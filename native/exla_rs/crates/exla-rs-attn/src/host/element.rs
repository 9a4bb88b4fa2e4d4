//! The element types of `q`, `k`, `v`, `o`, `do`: f32, f16, bf16. Kernels convert to f32 once,
//! while packing tiles, and accumulate in f32 throughout.

use half::slice::HalfFloatSliceExt;

use crate::ElementType;

/// A Host input/output element type.
pub trait HostElement: Copy + Send + Sync + 'static {
    const TYPE: ElementType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// `dst[i] = src[i] as f32` (lengths equal): a vectorised conversion for f16/bf16 (F16C where
    /// the CPU has it), used where a pass streams whole rows (the decode path).
    fn widen(src: &[Self], dst: &mut [f32]);
}

impl HostElement for f32 {
    const TYPE: ElementType = ElementType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
}

impl HostElement for half::f16 {
    const TYPE: ElementType = ElementType::F16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
}

impl HostElement for half::bf16 {
    const TYPE: ElementType = ElementType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn widen(src: &[Self], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift, which the compiler vectorises (half's slice
        // conversion goes element by element, 8x slower here, measured).
        for (o, x) in dst.iter_mut().zip(src) {
            *o = f32::from_bits(u32::from(x.to_bits()) << 16);
        }
    }
}
