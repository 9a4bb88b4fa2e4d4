//! The optional operands as the tile loops consume them: per-call precomputation of the key
//! mask (an additive `0`/`-inf` row per batch and a "does this key tile show anything" bit per
//! (batch, tile)), and the additive row of one (query row, key tile) for the row kernels.
//!
//! Nothing here is S×S: the mask rows are `B·Sk` floats, the bias is copied a block of query rows
//! at a time into a per-thread [`BiasPanel`] (`BR` rows of up to 16 tiles), ALiBi is computed in
//! the row kernel.

use super::forward::{BC, BR};
use super::kernels::{RowExtra, LOG2_E};
use super::HostElement;
use crate::{AttnShape, Bias, BiasData, Extras};

/// The most key tiles one bias panel covers: rows are copied in runs of up to 16·64 keys (4 KiB
/// of f32: a page, which the hardware prefetchers stream), and a panel of `BR` such rows (256 KiB)
/// stays in a core's L2 while its tiles are computed.
pub(crate) const PANEL_TILES: usize = 16;

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

    /// Whether the call has a bias (then the row kernels read it from a [`BiasPanel`]).
    #[inline]
    pub(crate) fn has_bias(&self) -> bool {
        self.bias.is_some()
    }

    /// `-slope[h]·log2(e)`: the ALiBi multiplier in the kernels' exp2 units (0 without ALiBi).
    #[inline]
    pub(crate) fn alibi2(&self, hq: usize) -> f32 {
        self.slopes.map_or(0.0, |s| -s[hq] * LOG2_E)
    }

    /// Makes `panel` hold the bias of `span` as the row kernels read it: f32, what the key mask
    /// hides `-inf`, keys past `Sk` 0.
    ///
    /// Why a copy: a tile alone reads 64 rows of 64 keys one bias row (`Sk` floats, 8 KiB at
    /// Sk = 2048) apart, a new page every 256 bytes, which neither the hardware prefetchers nor
    /// the TLB follow, and the row loop waits on memory. Here each bias row is read as one run of
    /// the span's keys (KiBs, which the prefetchers stream), and the tiles then read the panel
    /// from cache. The callers also [`Prep::prefetch_part`] the next span while they compute on
    /// this one (measured: it takes ~1/3 off the backward's extra time; little in the forward).
    pub(crate) fn fill_panel(&self, panel: &mut BiasPanel, span: &PanelSpan) {
        let Some(bias) = &self.bias else { return };
        let PanelSpan { b, t0, t1, .. } = *span;
        debug_assert!(t0 < t1 && (t1 - t0) * BC <= panel.width && span.rows <= BR);
        let (k0, k1) = (t0 * BC, (t1 * BC).min(self.sk));
        let per_key = bias.dims[3] == self.sk;
        (panel.t0, panel.t1) = (t0, t1);
        let mb = b * self.ntk * BC;
        let mask = if self.key_mask { &self.mask_add[mb + k0..mb + t1 * BC] } else { &[][..] };
        let nrows = self.span_rows(span);
        for r in 0..nrows {
            if r + 1 < nrows {
                // The next row's run starts on another page, where the hardware prefetchers
                // start over: ask for it while this one is copied.
                self.prefetch_rows(span, r + 1, r + 2);
            }
            let off = self.row_offset(span, r);
            let dst = &mut panel.buf[r * panel.width..r * panel.width + (t1 - t0) * BC];
            match bias.data {
                BiasData::F32(x) => fill(dst, x, off, per_key, k0, k1, mask),
                BiasData::F16(x) => fill(dst, x, off, per_key, k0, k1, mask),
                BiasData::BF16(x) => fill(dst, x, off, per_key, k0, k1, mask),
            }
        }
        // A bias with one row for every query (Sqb = 1) is copied once and read with stride 0.
        panel.stride = if bias.dims[2] == 1 { 0 } else { panel.width };
    }

    /// Asks the caches for the bias rows `r0..r1` of `span` (clamped to its rows) that
    /// [`Prep::fill_panel`] will read. Callers spread a span's rows over the tiles they compute
    /// before filling it, a few rows per tile, so the loads overlap with the GEMMs and never
    /// crowd them.
    pub(crate) fn prefetch_rows(&self, span: &PanelSpan, r0: usize, r1: usize) {
        let Some(bias) = &self.bias else { return };
        if bias.dims[3] != self.sk {
            return; // one value per row: nothing worth prefetching
        }
        let (ptr, size) = raw_bytes(&bias.data);
        let (k0, k1) = (span.t0 * BC, (span.t1 * BC).min(self.sk));
        for r in r0..r1.min(self.span_rows(span)) {
            prefetch_span(ptr, (self.row_offset(span, r) + k0) * size, (k1 - k0) * size);
        }
    }

    /// Part `k` of `n` of [`Prep::prefetch_rows`] over all of `span`'s rows: the caller computes
    /// `n` tiles before it fills `span`, and asks for part `k` at its `k`-th.
    #[inline]
    pub(crate) fn prefetch_part(&self, span: &PanelSpan, k: usize, n: usize) {
        let rows = self.span_rows(span);
        self.prefetch_rows(span, k * rows / n, (k + 1) * rows / n);
    }

    /// The bias rows a span reads: 1 for a bias shared by all queries, else its query rows.
    pub(crate) fn span_rows(&self, span: &PanelSpan) -> usize {
        match &self.bias {
            Some(bias) if bias.dims[2] != 1 => span.rows,
            Some(_) => 1,
            None => 0,
        }
    }

    /// Element offset in the bias of key 0 of the bias row that row `r` of `span` reads.
    fn row_offset(&self, span: &PanelSpan, r: usize) -> usize {
        let Some(bias) = &self.bias else { return 0 };
        let [bb, hb, sqb, skb] = bias.dims;
        let bh = (if bb == 1 { 0 } else { span.b }) * hb + if hb == 1 { 0 } else { span.hq };
        (bh * sqb + if sqb == 1 { 0 } else { span.i0 + r }) * skb
    }

    /// The additive row of row `r` of the query block (query row `i`, at key position `pos`) of
    /// batch `b` against key tile `tile`: the bias from `panel` (which must hold the tile), else
    /// the key-mask row, else none; ALiBi's term is computed by the row kernel itself.
    #[inline]
    pub(crate) fn row(&self, panel: &BiasPanel, b: usize, r: usize, pos: i64, tile: usize, alibi2: f32) -> RowExtra {
        let j0 = tile * BC;
        let add = if self.bias.is_some() {
            debug_assert!(panel.holds(tile));
            panel.row(r, tile)
        } else if self.key_mask {
            self.mask_add[b * self.ntk * BC + j0..].as_ptr()
        } else {
            std::ptr::null()
        };
        RowExtra { add, alibi: alibi2, dist0: (pos - j0 as i64) as f32 }
    }
}

/// Query rows `i0..i0 + rows` of batch `b`, head `hq`, over key tiles `t0..t1`: what one
/// [`BiasPanel`] fill covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PanelSpan {
    pub b: usize,
    pub hq: usize,
    pub i0: usize,
    pub rows: usize,
    pub t0: usize,
    pub t1: usize,
}

/// The bias of one block of query rows over a run of key tiles `t0..t1`, as the row kernels read
/// it ([`Prep::fill_panel`]): row `r`, tile `t` starts at `buf[r·stride + (t - t0)·BC]`. Per
/// thread, `BR × width` floats (256 KiB at 16 tiles), allocated only when there is a bias.
pub(crate) struct BiasPanel {
    buf: Vec<f32>,
    /// Floats per row: the most tiles one fill may cover, times `BC`.
    width: usize,
    /// `width`, or 0 when all rows share one bias row.
    stride: usize,
    t0: usize,
    t1: usize,
}

impl BiasPanel {
    /// A panel for runs of up to `tiles` key tiles, or an empty one when `prep` has no bias.
    pub(crate) fn new(prep: &Prep<'_>, tiles: usize) -> Self {
        let width = if prep.has_bias() { tiles * BC } else { 0 };
        Self { buf: vec![0.0; BR * width], width, stride: 0, t0: 0, t1: 0 }
    }

    /// Whether the panel holds key tile `tile` (of the block it was last filled for).
    #[inline]
    pub(crate) fn holds(&self, tile: usize) -> bool {
        self.t0 <= tile && tile < self.t1
    }

    /// The key tiles the panel holds.
    #[inline]
    pub(crate) fn tiles(&self) -> std::ops::Range<usize> {
        self.t0..self.t1
    }

    /// Forgets what the panel holds (a new block of query rows starts).
    #[inline]
    pub(crate) fn clear(&mut self) {
        (self.t0, self.t1) = (0, 0);
    }

    /// The `BC` bias values of row `r` over key tile `tile` (which the panel holds).
    #[inline]
    fn row(&self, r: usize, tile: usize) -> *const f32 {
        let at = r * self.stride + (tile - self.t0) * BC;
        self.buf[at..at + BC].as_ptr()
    }
}

/// The bias's storage as bytes, and the size of one element.
fn raw_bytes(data: &BiasData<'_>) -> (*const u8, usize) {
    match data {
        BiasData::F32(x) => (x.as_ptr() as *const u8, 4),
        BiasData::F16(x) => (x.as_ptr() as *const u8, 2),
        BiasData::BF16(x) => (x.as_ptr() as *const u8, 2),
    }
}

/// Converts one bias row's keys `k0..k1` into `dst` (the rest of `dst`, past `Sk`, becomes 0: the
/// kernels mask those columns anyway), hiding what the key mask hides. A select, not an add, so
/// a NaN or infinite bias under a hidden key stays out of the result.
#[inline]
fn fill<E: HostElement>(dst: &mut [f32], x: &[E], off: usize, per_key: bool, k0: usize, k1: usize, mask: &[f32]) {
    let n = k1 - k0;
    if per_key {
        for (o, v) in dst[..n].iter_mut().zip(&x[off + k0..off + k1]) {
            *o = v.to_f32();
        }
    } else {
        dst[..n].fill(x[off].to_f32());
    }
    dst[n..].fill(0.0);
    if !mask.is_empty() {
        for (o, &m) in dst[..n].iter_mut().zip(mask) {
            if m != 0.0 {
                *o = f32::NEG_INFINITY;
            }
        }
    }
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
