//! 16-bit forward on the CPU's dot-product units: AMX (`TDPBF16PS`, `TDPFP16PS`) and
//! AVX512-BF16 (`VDPBF16PS`), picked at run time, with software models of each unit so the
//! same tiling runs, and is tested, on every machine.
//!
//! - `tile.rs`: the AMX tile configuration (palette 1) and the tile sizes everything uses.
//! - `model.rs`: the instructions' definitions in software (DAZ/FTZ, RNE, pair order).
//! - `unit.rs`: [`unit::TileUnit`], the one tile-block product the tiling asks for, and the
//!   model units; `amx.rs`, `avx512bf16.rs`: the real units and their detection.
//! - `probe.rs`: a real unit is offered only after it reproduced its model on one block.
//! - `choice.rs`: ... and only where it beat the f32 path on this machine (never slower).
//! - `pack.rs`: operands into the units' VNNI layouts (AVX-512 gathers and interleaves where
//!   the inputs already are the unit's type); `rows.rs`: the forward's row pass and the rounding
//!   of P / dX to 16 bits; `forward.rs`, `backward.rs`: the passes (the backward's five products
//!   all on the unit).
//! - `peak.rs`: the units' measured rates (`host_bench peak`), the roofs the passes are held to.
//!
//! Which unit (forward and backward alike): bf16 on AMX-BF16, else AVX512-BF16; f16 only on AMX-FP16 (AVX512-FP16 multiplies
//! in f16, which would break the contract's f32 accumulation); anything else, and calls with
//! optional operands or dropout (and backward calls with a non-finite input), stay on the f32
//! path. `EXLA_RS_HOST_ISA` set to anything but
//! `amx` / `avx512bf16` (e.g. `avx512`, `avx2`) turns the units off, `avx512bf16` skips AMX;
//! `EXLA_RS_HOST_BF16=off|model-amx|model-avx512bf16` turns them off or forces a model unit
//! (slow: for tests and benchmarks of the tiling), `always` takes a real unit without asking
//! `choice.rs`, which otherwise keeps a unit only where it timed faster than the f32 path.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512bf16;
mod backward;
mod choice;
mod forward;
mod model;
mod pack;
pub(crate) mod peak;
mod probe;
mod rows;
#[cfg(test)]
mod tests;
mod tile;
mod unit;

use std::sync::OnceLock;

use super::{kernels, BwdInputs, BwdOutputs, FwdInputs, FwdOutputs, HostElement, Which};
use crate::{AttnOptions, AttnShape, ElementType, Pass};
use unit::{ModelAmx, ModelAvx512Bf16, TileUnit};

/// A unit the forward can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    #[cfg(target_arch = "x86_64")]
    AmxBf16,
    #[cfg(target_arch = "x86_64")]
    AmxFp16,
    #[cfg(target_arch = "x86_64")]
    Avx512Bf16,
    ModelAmxBf16,
    ModelAmxFp16,
    ModelAvx512Bf16,
}

impl Unit {
    /// A software model: asked for by name (tests, benchmarks of the tiling), never chosen.
    pub(crate) fn is_model(self) -> bool {
        matches!(self, Unit::ModelAmxBf16 | Unit::ModelAmxFp16 | Unit::ModelAvx512Bf16)
    }
}

/// What the environment allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Policy {
    Off,
    /// Real units as detected; `amx: false` skips AMX; `always`: without the timing probe
    /// ([`choice`]), wherever they run.
    Real { amx: bool, always: bool },
    /// A model unit: AMX's (bf16 and f16) or AVX512-BF16's (bf16).
    ModelAmx,
    ModelAvx512Bf16,
}

impl Policy {
    fn parse(isa: Option<&str>, bf16: Option<&str>) -> Policy {
        let lower = |s: Option<&str>| s.map(str::to_ascii_lowercase);
        let always = match lower(bf16).as_deref() {
            Some("off") => return Policy::Off,
            Some("model-amx") => return Policy::ModelAmx,
            Some("model-avx512bf16") => return Policy::ModelAvx512Bf16,
            Some("always") => true,
            _ => false,
        };
        match lower(isa).as_deref() {
            None | Some("") | Some("amx") => Policy::Real { amx: true, always },
            Some("avx512bf16") => Policy::Real { amx: false, always },
            // A narrower family asked for by name (avx512, avx2, scalar): f32 path only.
            Some(_) => Policy::Off,
        }
    }

    fn from_env() -> Policy {
        static P: OnceLock<Policy> = OnceLock::new();
        *P.get_or_init(|| Policy::parse(std::env::var("EXLA_RS_HOST_ISA").ok().as_deref(), std::env::var("EXLA_RS_HOST_BF16").ok().as_deref()))
    }
}

/// The real units this process may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Detected {
    amx_bf16: bool,
    amx_fp16: bool,
    avx512bf16: bool,
}

impl Detected {
    /// Once per process: what the CPU and OS offer, each unit kept only if it reproduces its
    /// model on a probe block ([`probe`]).
    fn get() -> Detected {
        static HW: OnceLock<Detected> = OnceLock::new();
        *HW.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                let amx = amx::detected();
                Detected {
                    amx_bf16: amx.bf16 && probe::agrees::<amx::Amx<false>, ModelAmx<false>>(false),
                    amx_fp16: amx.fp16 && probe::agrees::<amx::Amx<true>, ModelAmx<true>>(false),
                    avx512bf16: avx512bf16::detected() && probe::agrees::<avx512bf16::Avx512Bf16, ModelAvx512Bf16>(true),
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            Detected::default()
        })
    }
}

/// The unit for a plain forward of `dtype` run with the `which` row kernels, if any. Real
/// units go with the AVX-512 family only (their row pass is AVX-512, and a test or benchmark
/// that asks for another family means that family's f32 path).
fn pick(policy: Policy, which: Which, dtype: ElementType, hw: Detected) -> Option<Unit> {
    let (bf16, f16) = (dtype == ElementType::BF16, dtype == ElementType::F16);
    match policy {
        Policy::Off => None,
        Policy::ModelAmx if bf16 => Some(Unit::ModelAmxBf16),
        Policy::ModelAmx if f16 => Some(Unit::ModelAmxFp16),
        Policy::ModelAvx512Bf16 if bf16 => Some(Unit::ModelAvx512Bf16),
        Policy::ModelAmx | Policy::ModelAvx512Bf16 => None,
        #[cfg(target_arch = "x86_64")]
        Policy::Real { amx, .. } if which == Which::Avx512 => match (bf16, f16) {
            (true, _) if amx && hw.amx_bf16 => Some(Unit::AmxBf16),
            (true, _) if hw.avx512bf16 => Some(Unit::Avx512Bf16),
            (_, true) if amx && hw.amx_fp16 => Some(Unit::AmxFp16),
            _ => None,
        },
        // Another family, or no real unit on this architecture (where `which`/`hw` go unread).
        Policy::Real { .. } => {
            let _ = (which, hw);
            None
        }
    }
}

/// The unit `forward_on` / `backward_on` should run a plain (no extras, no dropout) `pass` of
/// `T` at `head_dim` on: one this CPU has, that the environment allows, and that beat the f32
/// path here at this pass and head dim ([`choice`]: timed at the first such call).
pub(super) fn offered<T: HostElement>(which: Which, pass: Pass, head_dim: usize) -> Option<Unit> {
    let policy = Policy::from_env();
    let unit = match policy {
        Policy::Off => None,
        p => pick(p, which, T::TYPE, Detected::get()),
    }?;
    let always = matches!(policy, Policy::Real { always: true, .. });
    choice::unit_pays::<T>(unit, which, pass, head_dim, always).then_some(unit)
}

/// Evaluates `$body` with `$U` naming the [`TileUnit`] type `$unit` stands for.
macro_rules! with_unit {
    ($unit:expr, $U:ident => $body:expr) => {
        match $unit {
            #[cfg(target_arch = "x86_64")]
            Unit::AmxBf16 => {
                type $U = amx::Amx<false>;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Unit::AmxFp16 => {
                type $U = amx::Amx<true>;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Unit::Avx512Bf16 => {
                type $U = avx512bf16::Avx512Bf16;
                $body
            }
            Unit::ModelAmxBf16 => {
                type $U = ModelAmx<false>;
                $body
            }
            Unit::ModelAmxFp16 => {
                type $U = ModelAmx<true>;
                $body
            }
            Unit::ModelAvx512Bf16 => {
                type $U = ModelAvx512Bf16;
                $body
            }
        }
    };
}

/// The forward on `unit`, with `which`'s row kernels. The caller checked the operands.
pub(super) fn forward<T: HostElement>(unit: Unit, which: Which, shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, out: FwdOutputs<'_, T>) {
    with_unit!(unit, U => forward_with::<T, U>(which, shape, opts, inp, out))
}

fn forward_with<T: HostElement, U: TileUnit>(which: Which, shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, out: FwdOutputs<'_, T>) {
    with_isa!(which, K => forward::run::<T, U, K>(shape, opts, inp, out))
}

/// Whether the lowp backward takes these operands (see `backward::takes`).
pub(super) fn backward_takes<T: HostElement>(inp: &BwdInputs<'_, T>) -> bool {
    backward::takes(inp)
}

/// The backward on `unit`, with `which`'s row kernels. The caller checked the operands.
pub(super) fn backward<T: HostElement>(unit: Unit, which: Which, shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>) {
    with_unit!(unit, U => backward_with::<T, U>(which, shape, opts, inp, out))
}

fn backward_with<T: HostElement, U: TileUnit>(which: Which, shape: &AttnShape, opts: &AttnOptions, inp: BwdInputs<'_, T>, out: BwdOutputs<'_, T>) {
    with_isa!(which, K => backward::run::<T, U, K>(shape, opts, inp, out))
}
