//! The flash-attention function every exla_rs backend computes, as fixed by
//! `docs/flash-attention-contract.md`, and its Host (CPU) implementation.
//!
//! This crate knows nothing about XLA: it takes typed slices and plain parameters. The FFI
//! handlers (`exla-rs-xla`) decode XLA call frames into these types; the CUDA crate launches
//! its kernels with them.

pub mod dtype;
pub mod error;
pub mod extras;
pub mod host;
pub mod mask;
pub mod options;
pub mod philox;
pub mod random;
pub mod shape;

pub use dtype::ElementType;
pub use error::AttnError;
pub use extras::{Bias, BiasData, BiasGrad, Extras};
pub use mask::KeyRange;
pub use options::AttnOptions;
pub use shape::{AttnShape, Pass, Platform};
