//! The attributes of both targets: `scale`, `softcap`, `window_left`, `window_right`.

use crate::AttnError;

/// Attention options exactly as the custom call's attributes carry them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnOptions {
    /// Multiplies `dot(q, k)` before the softcap.
    pub scale: f32,
    /// `s = softcap * tanh(x / softcap)` when > 0; 0 turns it off.
    pub softcap: f32,
    /// Keys more than `window_left` positions before the query's position are hidden; -1 = unbounded.
    pub window_left: i64,
    /// Keys more than `window_right` positions after it are hidden; -1 = unbounded, 0 = causal.
    pub window_right: i64,
}

impl AttnOptions {
    /// Checks the values the contract allows (negative windows other than -1 mean "unbounded"
    /// too, but a NaN scale or a negative softcap is a caller bug worth naming).
    pub fn validate(&self) -> Result<(), AttnError> {
        if !self.scale.is_finite() {
            return Err(AttnError::invalid(format!(
                "attribute `scale` must be a finite f32, got {}",
                self.scale
            )));
        }
        if !(self.softcap.is_finite() && self.softcap >= 0.0) {
            return Err(AttnError::invalid(format!(
                "attribute `softcap` must be a finite f32 >= 0 (0 = off), got {}",
                self.softcap
            )));
        }
        Ok(())
    }

    pub fn causal(&self) -> bool {
        self.window_right == 0
    }
}
