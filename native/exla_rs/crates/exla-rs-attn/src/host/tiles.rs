//! The tile sizes every f32 driver shares: the forward's and the backward's blocks, and the bias
//! panels built for them (extra.rs), so a panel row is exactly one block's rows.

/// Query rows per task.
pub(crate) const BR: usize = 64;
/// Keys per tile (a multiple of `kernels::PAD`).
pub(crate) const BC: usize = 64;
