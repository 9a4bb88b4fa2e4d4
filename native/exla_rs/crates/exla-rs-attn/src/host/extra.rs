//! The optional operands as the tile loops consume them: per-call precomputation of the key
//! mask (an additive `0`/`-inf` row per batch and a "does this key tile show anything" bit per
//! (batch, tile)), and the additive row of one (query row, key tile) for the row kernels.
//!
//! Nothing here is S×S: the mask rows are `B·Sk` floats; an f32 bias over whole key tiles without
//! a key mask is read where it lies, each tile prefetched a few tiles ahead by the score product
//! ([`Prep::in_place`]); any other bias is copied a block of query rows at a time into a per-thread
//! [`BiasPanel`] (`BR` rows of up to 16 tiles); ALiBi is computed in the row kernel.

use super::kernels::{Prefetch, RowExtra, LOG2_E};
use super::prefetch::prefetch_span;
use super::tiles::{BC, BR};
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
    /// The row kernels read the bias where it lies ([`Prep::in_place`]), no panel.
    in_place: bool,
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
        let in_place = ex.bias.is_some_and(|x| matches!(x.data, BiasData::F32(_)) && x.dims[3] == sk && sk % BC == 0) && ex.key_mask.is_none();
        Self { key_mask: ex.key_mask.is_some(), mask_add, tile_any, bias: ex.bias, in_place, slopes: ex.alibi_slopes, sk, ntk }
    }

    /// Whether the row kernels read the bias where it lies: an f32 bias with a value per key,
    /// no key mask to merge into it, and whole key tiles (a row's `BC` values never run past
    /// the bias's end). The tile loops then have each tile's bias prefetched a few tiles ahead
    /// by the score product ([`Prep::prefetch_ahead`]), so the bias is read once, from cache,
    /// with no copy: measured at S = 2048, the forward's extra is 0.6-0.8 of one plain read of
    /// the bias by XLA (paired CPU time), where the panel's copy cost 2.7 (bench/RESULTS.md).
    /// Otherwise (f16/bf16, a key mask, odd `Sk`, one value per row) the bias goes through a
    /// [`BiasPanel`], converted and masked.
    #[inline]
    pub(crate) fn in_place(&self) -> bool {
        self.in_place
    }

    /// Whether the tile loops must fill a [`BiasPanel`] before they read the bias.
    #[inline]
    pub(crate) fn uses_panel(&self) -> bool {
        self.bias.is_some() && !self.in_place
    }

    /// What a tile loop working on key tile `tile` of `span` (its block's tiles end at `span.t1`)
    /// prefetches: in in-place mode the bias [`PREFETCH_TILES`] tiles ahead, past the block's last
    /// tile the first tiles of `next` (the block the loop computes next, if any); else nothing.
    #[inline]
    pub(crate) fn prefetch_ahead(&self, span: &PanelSpan, next: Option<&PanelSpan>, tile: usize) -> Prefetch {
        if !self.in_place {
            return Prefetch::NONE;
        }
        let ahead = tile + PREFETCH_TILES;
        if ahead < span.t1 {
            return self.tile_prefetch(span.b, span.hq, span.i0, span.rows, ahead);
        }
        match next {
            Some(n) if n.t0 + (ahead - span.t1) < n.t1 => self.tile_prefetch(n.b, n.hq, n.i0, n.rows, n.t0 + (ahead - span.t1)),
            _ => Prefetch::NONE,
        }
    }

    /// In-place mode: the bias lines of query rows `i0..i0 + rows` of head `hq` in batch row `b`
    /// over key tile `tile`, for a [`Gemm`](super::kernels::Gemm) to prefetch.
    #[inline]
    pub(crate) fn tile_prefetch(&self, b: usize, hq: usize, i0: usize, rows: usize, tile: usize) -> Prefetch {
        let Some(Bias { data: BiasData::F32(x), dims }) = &self.bias else { return Prefetch::NONE };
        let off = bias_row(dims, b, hq, i0) + tile * BC;
        let per_query = dims[2] != 1;
        Prefetch { base: x.as_ptr().wrapping_add(off) as *const u8, stride: dims[3] * 4, rows: if per_query { rows } else { 1 }, lines: BC * 4 / 64, l2: false }
    }

    /// Whether key tile `tile` of batch row `b` can contribute (false only when `key_mask`
    /// hides all of its keys): such tiles are skipped like those past `kv_len`.
    #[inline]
    pub(crate) fn tile_visible(&self, b: usize, tile: usize) -> bool {
        !self.key_mask || self.tile_any[b * self.ntk + tile]
    }

    /// Whether the call has a bias.
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
        let Some(bias) = self.bias.as_ref().filter(|_| !self.in_place) else { return };
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
        self.bias.as_ref().map_or(0, |bias| bias_row(&bias.dims, span.b, span.hq, span.i0 + r))
    }

    /// The additive row of row `r` of the query block (query row `i` of head `hq`, at key
    /// position `pos`) of batch `b` against key tile `tile`: the bias (in place, or from `panel`,
    /// which must then hold the tile), else the key-mask row, else none; ALiBi's term is computed
    /// by the row kernel itself.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn row(&self, panel: &BiasPanel, b: usize, hq: usize, r: usize, i: usize, pos: i64, tile: usize, alibi2: f32) -> RowExtra {
        let j0 = tile * BC;
        let add = if let (true, Some(Bias { data: BiasData::F32(x), dims })) = (self.in_place, &self.bias) {
            // In range: in-place mode has whole tiles, so j0 + BC ≤ Sk.
            x[bias_row(dims, b, hq, i) + j0..][..BC].as_ptr()
        } else if self.bias.is_some() {
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

/// How many key tiles ahead of the one computed an in-place bias is prefetched (measured at
/// S = 2048 on a 2-core EPYC: 1 is too late, 2 to 6 all about as good).
pub(crate) const PREFETCH_TILES: usize = 4;

/// Element offset of key 0 of the bias row that query row `i` of head `hq` in batch row `b`
/// reads (a broadcast dimension of the bias contributes 0).
#[inline]
fn bias_row(dims: &[usize; 4], b: usize, hq: usize, i: usize) -> usize {
    let [bb, hb, sqb, skb] = *dims;
    let bh = (if bb == 1 { 0 } else { b }) * hb + if hb == 1 { 0 } else { hq };
    (bh * sqb + if sqb == 1 { 0 } else { i }) * skb
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
    /// A panel for runs of up to `tiles` key tiles, or an empty one when `prep` needs none.
    pub(crate) fn new(prep: &Prep<'_>, tiles: usize) -> Self {
        let width = if prep.uses_panel() { tiles * BC } else { 0 };
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
