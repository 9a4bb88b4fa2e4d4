//! Operand shapes and the two enumerations of `exla_rs_flash_attn_workspace_bytes`.

use crate::AttnError;

/// The dimensions of one call: `q [B, Sq, H, D]`, `k`/`v` `[B, Sk, Hkv, D]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttnShape {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    /// The largest head dim any backend accepts.
    pub const MAX_HEAD_DIM: usize = 256;

    /// Query heads per key/value head: query head `h` reads kv head `h / group()`.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    pub fn q_len(&self) -> usize {
        self.batch * self.seq_q * self.heads * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.batch * self.seq_k * self.kv_heads * self.head_dim
    }
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.seq_q
    }

    /// Checks what the contract requires of the dimensions themselves.
    pub fn validate(&self) -> Result<(), AttnError> {
        if self.kv_heads == 0 || self.heads == 0 {
            return Err(AttnError::invalid(format!(
                "heads must be >= 1: q has H={}, k/v have Hkv={}",
                self.heads, self.kv_heads
            )));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(AttnError::invalid(format!(
                "q heads H={} must be a multiple of k/v heads Hkv={}",
                self.heads, self.kv_heads
            )));
        }
        if self.head_dim == 0 || self.head_dim > Self::MAX_HEAD_DIM {
            return Err(AttnError::invalid(format!(
                "head dim D={} must be in 1..={}",
                self.head_dim,
                Self::MAX_HEAD_DIM
            )));
        }
        Ok(())
    }
}

/// Forward (0) or backward (1), as `exla_rs_flash_attn_workspace_bytes` numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pass {
    Forward,
    Backward,
}

impl Pass {
    pub fn from_code(code: i32) -> Option<Self> {
        match code {
            0 => Some(Self::Forward),
            1 => Some(Self::Backward),
            _ => None,
        }
    }
}

/// Host (0) or CUDA (1), as `exla_rs_flash_attn_workspace_bytes` numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Platform {
    Host,
    Cuda,
}

impl Platform {
    pub fn from_code(code: i32) -> Option<Self> {
        match code {
            0 => Some(Self::Host),
            1 => Some(Self::Cuda),
            _ => None,
        }
    }
}
