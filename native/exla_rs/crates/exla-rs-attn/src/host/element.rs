//! The element types of `q`, `k`, `v`, `o`, `do`: f32, f16, bf16. Kernels convert to f32 once,
//! while packing tiles, and accumulate in f32 throughout.

use crate::ElementType;

/// A Host input/output element type.
pub trait HostElement: Copy + Send + Sync + 'static {
    const TYPE: ElementType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
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
}
