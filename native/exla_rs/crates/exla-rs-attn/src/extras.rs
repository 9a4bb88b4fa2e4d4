//! The contract's optional operands: `key_mask`, `bias` (and the backward's `dbias`),
//! `alibi_slopes`, and dropout (docs/flash-attention-contract.md). Kept apart from [`crate::AttnOptions`],
//! which stays the four attributes every backend (CUDA included) takes.

use half::{bf16, f16};

use crate::philox::Dropout;
use crate::{AttnError, AttnShape, ElementType};

/// The bias's values, in the element type it arrived in (it need not be the type of `q`).
#[derive(Clone, Copy, Debug)]
pub enum BiasData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl BiasData<'_> {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::F16(x) => x.len(),
            Self::BF16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> ElementType {
        match self {
            Self::F32(_) => ElementType::F32,
            Self::F16(_) => ElementType::F16,
            Self::BF16(_) => ElementType::BF16,
        }
    }
}

/// An additive bias `[Bb, Hb, Sqb, Skb]`, each dimension 1 (broadcast) or the full
/// `B`, `H`, `Sq`, `Sk`.
#[derive(Clone, Copy, Debug)]
pub struct Bias<'a> {
    pub data: BiasData<'a>,
    pub dims: [usize; 4],
}

/// The backward's `dbias` result, shaped and typed like the bias.
#[derive(Debug)]
pub enum BiasGrad<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

impl BiasGrad<'_> {
    pub fn len(&self) -> usize {
        match self {
            Self::F32(x) => x.len(),
            Self::F16(x) => x.len(),
            Self::BF16(x) => x.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn dtype(&self) -> ElementType {
        match self {
            Self::F32(_) => ElementType::F32,
            Self::F16(_) => ElementType::F16,
            Self::BF16(_) => ElementType::BF16,
        }
    }
}

/// The optional operands of one call; `Extras::default()` is a call without any.
#[derive(Clone, Copy, Debug, Default)]
pub struct Extras<'a> {
    /// `[B, Sk]`, nonzero = visible. The handlers normalise any integer/pred mask to bytes.
    pub key_mask: Option<&'a [u8]>,
    pub bias: Option<Bias<'a>>,
    /// `f32[H]`: the score gets `-slope[h] · |q_start[b] + i - j|`.
    pub alibi_slopes: Option<&'a [f32]>,
    /// Attention dropout (`has_dropout`): the key (read from the `dropout_key` operand), the
    /// keep threshold and scale.
    pub dropout: Option<Dropout>,
}

impl Extras<'_> {
    pub fn is_none(&self) -> bool {
        !self.changes_scores() && self.dropout.is_none()
    }

    /// Whether some operand adds to the scores (key mask, bias, ALiBi); dropout does not, it
    /// scales the probabilities after the softmax.
    pub fn changes_scores(&self) -> bool {
        self.key_mask.is_some() || self.bias.is_some() || self.alibi_slopes.is_some()
    }

    /// Lengths and bias dims against the call's shape (the handlers name operands themselves
    /// before this; this guards direct callers of the kernels).
    pub fn validate(&self, s: &AttnShape) -> Result<(), AttnError> {
        if let Some(m) = self.key_mask {
            let want = s.batch.checked_mul(s.seq_k).ok_or_else(|| AttnError::invalid("key_mask: [B, Sk] too large"))?;
            if m.len() != want {
                return Err(AttnError::invalid(format!("key_mask: expected {want} elements ([B, Sk] = [{}, {}]), got {}", s.batch, s.seq_k, m.len())));
            }
        }
        if let Some(b) = self.bias {
            bias_dims_ok(s, &b.dims).map_err(|m| AttnError::invalid(format!("bias: {m}")))?;
            let want = bias_len(&b.dims).ok_or_else(|| AttnError::invalid("bias: too large"))?;
            if b.data.len() != want {
                return Err(AttnError::invalid(format!("bias: expected {want} elements for dims {:?}, got {}", b.dims, b.data.len())));
            }
        }
        if let Some(d) = self.dropout {
            if !(d.rate > 0.0 && d.rate < 1.0) || d.threshold != crate::philox::dropout_threshold(d.rate) {
                return Err(AttnError::invalid(format!("dropout: rate {} must be in (0, 1) with threshold floor(rate·2^32), got threshold {}", d.rate, d.threshold)));
            }
        }
        if let Some(a) = self.alibi_slopes {
            if a.len() != s.heads {
                return Err(AttnError::invalid(format!("alibi_slopes: expected f32[{}] (one slope per query head), got {} elements", s.heads, a.len())));
            }
        }
        Ok(())
    }
}

/// Each bias dimension must be 1 or the full `[B, H, Sq, Sk]`; the error says which is not.
pub fn bias_dims_ok(s: &AttnShape, dims: &[usize; 4]) -> Result<(), String> {
    let full = [s.batch, s.heads, s.seq_q, s.seq_k];
    let names = ["B", "H", "Sq", "Sk"];
    for n in 0..4 {
        if dims[n] != 1 && dims[n] != full[n] {
            return Err(format!(
                "dimension {n} is {}, must be 1 or {} = {} (bias broadcasts to [B, H, Sq, Sk] = {full:?}, got {dims:?})",
                dims[n], names[n], full[n]
            ));
        }
    }
    Ok(())
}

pub fn bias_len(dims: &[usize; 4]) -> Option<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}
