//! The element types of `q`, `k`, `v`, `o`, `do`: f32, f16, bf16. Kernels convert to f32 once,
//! while packing tiles, and accumulate in f32 throughout.
//!
//! Each type's entry points (`run_forward`, `run_backward`) are plain functions of this crate:
//! the public generic [`super::forward_ext`] and [`super::backward_ext`] only call them. An
//! optimised build instantiates a generic function in every crate that calls it (it does not
//! share instantiations across crates), and the kernels under `forward_on`/`backward_on` are most
//! of this crate's code: without this, every caller (the handlers, the NIF, each test binary and
//! the sanitizer harness in each of its builds) compiled all of them again.

use super::{BwdInputs, BwdOutputs, FwdInputs, FwdOutputs};
use crate::{AttnError, AttnOptions, AttnShape, BiasGrad, ElementType, Extras};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A Host input/output element type: f32, f16 or bf16 (sealed).
pub trait HostElement: Copy + Send + Sync + 'static + sealed::Sealed {
    const TYPE: ElementType;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;

    /// [`super::forward_ext`] for this type, compiled once, in this crate.
    #[doc(hidden)]
    fn run_forward(
        shape: &AttnShape,
        opts: &AttnOptions,
        inp: FwdInputs<'_, Self>,
        ex: &Extras<'_>,
        out: FwdOutputs<'_, Self>,
        workspace: &mut [u8],
    ) -> Result<(), AttnError>;

    /// [`super::backward_ext`] for this type, compiled once, in this crate.
    #[doc(hidden)]
    #[allow(clippy::too_many_arguments)]
    fn run_backward(
        shape: &AttnShape,
        opts: &AttnOptions,
        inp: BwdInputs<'_, Self>,
        ex: &Extras<'_>,
        out: BwdOutputs<'_, Self>,
        dbias: Option<BiasGrad<'_>>,
        workspace: &mut [u8],
    ) -> Result<(), AttnError>;
}

/// The entry points of one type: non-generic, so codegen happens here only.
macro_rules! entry_points {
    () => {
        #[inline(never)]
        fn run_forward(
            shape: &AttnShape,
            opts: &AttnOptions,
            inp: FwdInputs<'_, Self>,
            ex: &Extras<'_>,
            out: FwdOutputs<'_, Self>,
            workspace: &mut [u8],
        ) -> Result<(), AttnError> {
            super::forward_on(super::dispatch(), shape, opts, inp, ex, out, workspace)
        }

        #[inline(never)]
        fn run_backward(
            shape: &AttnShape,
            opts: &AttnOptions,
            inp: BwdInputs<'_, Self>,
            ex: &Extras<'_>,
            out: BwdOutputs<'_, Self>,
            dbias: Option<BiasGrad<'_>>,
            workspace: &mut [u8],
        ) -> Result<(), AttnError> {
            super::backward_on(super::dispatch(), shape, opts, inp, ex, out, dbias, workspace)
        }
    };
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
    entry_points!();
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
    entry_points!();
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
    entry_points!();
}
