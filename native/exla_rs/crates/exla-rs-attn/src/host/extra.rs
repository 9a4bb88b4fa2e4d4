//! The optional operands as the tile loops consume them: per-call precomputation of the key
//! mask (an additive `0`/`-inf` row per batch and a "does this key tile show anything" bit per
//! (batch, tile)), and the additive row of one (query row, key tile) for the row kernels.
//!
//! Nothing here is S×S: the mask rows are `B·Sk` floats, a bias row is read straight from the
//! operand (or converted into one `BC`-float scratch row), ALiBi is computed in the row kernel.

use super::forward::BC;
use super::kernels::{RowExtra, LOG2_E};
use super::HostElement;
use crate::{AttnShape, Bias, BiasData, Extras};

pub(crate) struct Prep<'a> {
    key_mask: bool,
    /// `[B, ntk·BC]`: 0 where `key_mask` shows the key, `-inf` where it hides it (and past `Sk`).
    mask_add: Vec<f32>,
    /// `[B, ntk]`: some key of the tile is shown.
    tile_any: Vec<bool>,
    bias: Option<Bias<'a>>,
    slopes: Option<&'a [f32]>,
    sk: usize,
    ntk: usize,
}

impl<'a> Prep<'a> {
    pub(crate) fn new(shape: &AttnShape, ex: &Extras<'a>) -> Self {
        let (b, sk) = (shape.batch, shape.seq_k);
        let ntk = sk.div_ceil(BC);
        let (mut mask_add, mut tile_any) = (Vec::new(), Vec::new());
        if let Some(m) = ex.key_mask {
            mask_add = vec![f32::NEG_INFINITY; b * ntk * BC];
            tile_any = vec![false; b * ntk];
            for bb in 0..b {
                for j in 0..sk {
                    if m[bb * sk + j] != 0 {
                        mask_add[bb * ntk * BC + j] = 0.0;
                        tile_any[bb * ntk + j / BC] = true;
                    }
                }
            }
        }
        Self { key_mask: ex.key_mask.is_some(), mask_add, tile_any, bias: ex.bias, slopes: ex.alibi_slopes, sk, ntk }
    }

    /// Whether key tile `tile` of batch row `b` can contribute (false only when `key_mask`
    /// hides all of its keys): such tiles are skipped like those past `kv_len`.
    #[inline]
    pub(crate) fn tile_visible(&self, b: usize, tile: usize) -> bool {
        !self.key_mask || self.tile_any[b * self.ntk + tile]
    }

    /// Asks the caches for the bias rows a tile will read (rows `i0..i0 + rows` of batch `b`,
    /// head `hq`, keys `j0..j0 + BC`). Called before the tile's GEMMs, so the loads overlap with
    /// them: a tile reads 64 rows one bias row (`Sk` floats) apart, a pattern the hardware
    /// prefetchers do not follow, and without this the row loop waits on memory latency.
    #[inline]
    pub(crate) fn prefetch_bias(&self, b: usize, hq: usize, i0: usize, rows: usize, j0: usize) {
        let Some(bias) = &self.bias else { return };
        let [bb, hb, sqb, skb] = bias.dims;
        if skb != self.sk {
            return; // a broadcast row is a single value: nothing worth prefetching
        }
        let (ptr, size) = match bias.data {
            BiasData::F32(x) => (x.as_ptr() as *const u8, 4),
            BiasData::F16(x) => (x.as_ptr() as *const u8, 2),
            BiasData::BF16(x) => (x.as_ptr() as *const u8, 2),
        };
        let base = (if bb == 1 { 0 } else { b }) * hb + if hb == 1 { 0 } else { hq };
        let nrows = if sqb == 1 { 1 } else { rows };
        let cols = BC.min(self.sk - j0);
        for r in 0..nrows {
            let row = base * sqb + if sqb == 1 { 0 } else { i0 + r };
            let start = (row * skb + j0) * size;
            prefetch_span(ptr, start, cols * size);
        }
    }

    /// `-slope[h]·log2(e)`: the ALiBi multiplier in the kernels' exp2 units (0 without ALiBi).
    #[inline]
    pub(crate) fn alibi2(&self, hq: usize) -> f32 {
        self.slopes.map_or(0.0, |s| -s[hq] * LOG2_E)
    }

    /// The additive row of query row `i` (at key position `pos = q_start[b] + i`) of batch `b`,
    /// head `hq`, against the key tile starting at `j0` with `cols` real keys. `buf` (`BC`
    /// floats) holds the row when it has to be built.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn row(&self, buf: &mut [f32], b: usize, hq: usize, i: usize, pos: i64, j0: usize, cols: usize, alibi2: f32) -> RowExtra {
        let mask = if self.key_mask { &self.mask_add[b * self.ntk * BC + j0..b * self.ntk * BC + j0 + BC] } else { &[][..] };
        let add = match &self.bias {
            None if self.key_mask => mask.as_ptr(),
            None => std::ptr::null(),
            Some(bias) => {
                let [bb, hb, sqb, skb] = bias.dims;
                let row = ((if bb == 1 { 0 } else { b }) * hb + if hb == 1 { 0 } else { hq }) * sqb + if sqb == 1 { 0 } else { i };
                let off = row * skb;
                match bias.data {
                    // The common case reads the operand in place: a full f32 row, a whole tile.
                    BiasData::F32(x) if skb == self.sk && cols == BC && !self.key_mask => x[off + j0..off + j0 + BC].as_ptr(),
                    BiasData::F32(x) => fill(buf, x, off, skb == self.sk, j0, cols, mask),
                    BiasData::F16(x) => fill(buf, x, off, skb == self.sk, j0, cols, mask),
                    BiasData::BF16(x) => fill(buf, x, off, skb == self.sk, j0, cols, mask),
                }
            }
        };
        RowExtra { add, alibi: alibi2, dist0: (pos - j0 as i64) as f32 }
    }
}

/// Converts one bias row segment into `buf` (columns `cols..BC`, past the keys, become 0; the
/// kernels mask them anyway), hiding what the key mask hides. A select, not an add, so a NaN or
/// infinite bias under a hidden key stays out of the result.
#[inline]
fn fill<E: HostElement>(buf: &mut [f32], x: &[E], off: usize, per_key: bool, j0: usize, cols: usize, mask: &[f32]) -> *const f32 {
    let buf = &mut buf[..BC];
    if per_key {
        for (o, v) in buf[..cols].iter_mut().zip(&x[off + j0..off + j0 + cols]) {
            *o = v.to_f32();
        }
    } else {
        buf[..cols].fill(x[off].to_f32());
    }
    buf[cols..].fill(0.0);
    if !mask.is_empty() {
        for (o, &m) in buf[..cols].iter_mut().zip(mask) {
            if m != 0.0 {
                *o = f32::NEG_INFINITY;
            }
        }
    }
    buf.as_ptr()
}

/// Prefetches bytes `[start, start + len)` of the allocation at `base` into L2, one request per
/// cache line. A hint only: never faults, and a no-op off x86-64.
#[inline]
pub(crate) fn prefetch_span(base: *const u8, start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut off = start & !63;
        while off < start + len {
            // SAFETY: prefetch never dereferences; `wrapping_add` keeps the pointer arithmetic
            // defined even at the span's end.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(off) as *const i8) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (base, start, len);
}
