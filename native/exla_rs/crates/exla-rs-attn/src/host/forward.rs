//! Forward pass: tiled online softmax (FlashAttention-2 order: each task owns a block of query
//! rows and streams the key tiles its rows can see).
//!
//! Layout of the packed operands (f32, built once per call, O(B·Hkv·Sk·D)):
//! - `kt[b, kvh, tile, d, c]` = `k[b, tile·BC + c, kvh, d]`: each tile is `K^T`, so `S = Q·K^T`
//!   runs with K as the row-major B operand of the GEMM; keys past `Sk` are 0.
//! - `vp[b, kvh, j, d]` = `v[b, j, kvh, d]`, rows padded to `dp` (a multiple of `PAD`).
//!
//! Query rows are packed per task, pre-multiplied by `scale·log2(e)` (scores in exp2 units).

use rayon::prelude::*;

use super::dropout::{keep_tile_fn, KeepTileFn, MUL, NO_DROPOUT};
use super::extra::{BiasPanel, PanelSpan, Prep, PANEL_TILES};
use super::kernels::{Gemm, Isa, Prefetch, RowExtra, LOG2_E, PAD};
use super::lines::Lines;
use super::pool;
use super::prefetch::prefetch_span;
use super::tiles::{BC, BR};
use super::{finish_row, online_update, round_up, FwdInputs, FwdOutputs, HostElement, SyncPtr};
use crate::philox::Dropout;
use crate::{AttnOptions, AttnShape, Extras, KeyRange};


/// Whether the call is done before any tile: nothing to compute (no batch or query rows), or no
/// keys at all, where every row is fully masked (written here: o = 0, lse = -inf).
pub(crate) fn finished_without_keys<T: HostElement>(shape: &AttnShape, out: &mut FwdOutputs<'_, T>) -> bool {
    if shape.batch == 0 || shape.seq_q == 0 {
        return true;
    }
    if shape.seq_k == 0 {
        out.o.fill(T::from_f32(0.0));
        out.lse.fill(f32::NEG_INFINITY);
        return true;
    }
    false
}

/// Where task `task` of a forward sits: one (batch, head, block of `br` query rows), tasks
/// numbered block-fastest, then head, then batch.
pub(crate) struct QueryBlock {
    pub b: usize,
    pub hq: usize,
    /// `b·Hkv + hq / g`: the (batch, kv head) whose keys the block reads.
    pub bkv: usize,
    pub i0: usize,
    pub rows: usize,
}

impl QueryBlock {
    pub(crate) fn of(task: usize, br: usize, shape: &AttnShape) -> Self {
        let nqb = shape.seq_q.div_ceil(br);
        let (bhq, qb) = (task / nqb, task % nqb);
        let (b, hq) = (bhq / shape.heads, bhq % shape.heads);
        let i0 = qb * br;
        Self { b, hq, bkv: b * shape.kv_heads + hq / shape.group(), i0, rows: br.min(shape.seq_q - i0) }
    }

    /// Each row's visible keys into `ranges` (cleared first); returns the block's.
    pub(crate) fn ranges(&self, opts: &AttnOptions, shape: &AttnShape, kv_len: &[i32], q_start: &[i32], ranges: &mut Vec<KeyRange>) -> KeyRange {
        let (kvl, qst, sk) = (kv_len[self.b], q_start[self.b], shape.seq_k);
        ranges.clear();
        ranges.extend((0..self.rows).map(|r| KeyRange::for_row(opts, sk, kvl, qst, self.i0 + r)));
        KeyRange::for_rows(opts, sk, kvl, qst, self.i0, self.i0 + self.rows)
    }
}

/// Key tiles per step of the plain instance (no extras, no dropout): its row pass and O's
/// rescale run once per row per step, its `P·V` loads and stores each O tile once per step. At
/// one tile (64 keys) a row's fixed costs (the call, the max and sum reductions, `exp2` of the
/// rescale, O's 128 products) were set against 4 vectors of scores. Dropout steps the same way,
/// its generator called once per tile of the step. The extras keep one tile per step: their
/// per-row inputs (bias panels, ALiBi's positions) are per tile.
const STEP_TILES: usize = 4;
/// The score scratch's row stride.
pub(super) const S_LD: usize = STEP_TILES * BC;

/// Key tiles at the end of a task over which it asks L2 for the rows the next moments touch: the
/// next task's Q rows and this task's output rows. In `[B, S, H, D]` arrays each row of a head
/// sits `H·D` elements from the next, a page apart for common shapes, where the hardware
/// prefetchers stop: unasked, the Q copy and the output rows cost about 4 ms each per call of a
/// one-thread S = 2048, D = 128 forward (160 ms), in cache-miss latency.
const TAIL_TILES: usize = 4;

/// The rows of one (batch, head, query block) in a `[B, S, H, D]` array of `T`.
#[derive(Clone, Copy)]
pub(crate) struct BlockRows {
    base: *const u8,
    stride: usize,
    rows: usize,
    /// Bytes per row.
    bytes: usize,
}

impl BlockRows {
    /// The block `qb` of the array at `x` (addresses only: nothing is read through it here).
    fn of<T>(x: *const T, shape: &AttnShape, qb: &QueryBlock) -> Self {
        let size = std::mem::size_of::<T>();
        let first = ((qb.b * shape.seq_q + qb.i0) * shape.heads + qb.hq) * shape.head_dim;
        Self { base: x.wrapping_add(first) as *const u8, stride: shape.heads * shape.head_dim * size, rows: qb.rows, bytes: shape.head_dim * size }
    }

    /// Parts `ks` of `parts` (rows split evenly), as a plan a [`Gemm`] spreads over its calls.
    fn parts(&self, ks: std::ops::Range<usize>, parts: usize) -> Prefetch {
        let (r0, r1) = (ks.start * self.rows / parts, ks.end * self.rows / parts);
        // One line more than a row's bytes: a row need not start on a line.
        Prefetch { base: self.base.wrapping_add(r0 * self.stride), stride: self.stride, rows: r1 - r0, lines: self.bytes.div_ceil(64) + 1, l2: true }
    }

    /// Asks L2 for row `r`'s lines now (nothing past the block's rows). A hint: never faults.
    fn prefetch_row(&self, r: usize) {
        if r < self.rows {
            prefetch_span(self.base, r * self.stride, self.bytes);
        }
    }
}

/// The rows a task asks L2 for as it ends (see [`TAIL_TILES`]): the next task's Q rows (rayon
/// walks a thread's run of tasks in order) and its own output rows.
pub(crate) struct TaskRows {
    next_q: Option<BlockRows>,
    out: BlockRows,
}

impl TaskRows {
    /// For task `task` of `tasks` (blocks of `br` query rows), `q` and `o` the call's arrays.
    pub(crate) fn of<T>(q: *const T, o: *const T, shape: &AttnShape, task: usize, br: usize, tasks: usize) -> Self {
        let next_q = (task + 1 < tasks).then(|| BlockRows::of(q, shape, &QueryBlock::of(task + 1, br, shape)));
        Self { next_q, out: BlockRows::of(o, shape, &QueryBlock::of(task, br, shape)) }
    }

    /// Asks L2 for row `r` of both now.
    pub(crate) fn prefetch_row(&self, r: usize) {
        self.out.prefetch_row(r);
        if let Some(q) = &self.next_q {
            q.prefetch_row(r);
        }
    }
}

/// What a task asks for over its last [`TAIL_TILES`] key tiles (see there).
struct TailPlan {
    rows: TaskRows,
    /// The first tile of the tail, and how many tiles it has.
    from: usize,
    parts: usize,
}

impl TailPlan {
    /// The plans of key tiles `tiles`: (the next task's Q, this task's output), their share of the
    /// tail's rows (none before the tail).
    fn at(&self, tiles: std::ops::Range<usize>) -> (Prefetch, Prefetch) {
        if tiles.end <= self.from {
            return (Prefetch::NONE, Prefetch::NONE);
        }
        let ks = tiles.start.max(self.from) - self.from..tiles.end - self.from;
        (self.rows.next_q.map_or(Prefetch::NONE, |q| q.parts(ks.clone(), self.parts)), self.rows.out.parts(ks, self.parts))
    }
}

/// Per-thread scratch, reused across tasks.
struct Scratch {
    qs: Lines<f32>,
    s: Lines<f32>,
    o: Lines<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    ranges: Vec<KeyRange>,
    /// The block's bias over the current run of key tiles (empty without a bias).
    panel: BiasPanel,
}

/// Where the current (batch, head, query block) sits, for the extras' rows.
struct RowCtx<'p, 'a> {
    prep: &'p Prep<'a>,
    b: usize,
    hq: usize,
    i0: usize,
    q_start: i64,
    alibi2: f32,
    /// Dropout and its generator (read only in the `DROP` instances).
    dropout: Dropout,
    keep_tile: KeepTileFn,
    /// In-place bias: this task's block over its key tiles, and the next task's (whose first
    /// tiles are prefetched while this one computes its last).
    block: PanelSpan,
    next: Option<PanelSpan>,
    tail: TailPlan,
}

pub(super) fn run<T: HostElement, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, out: FwdOutputs<'_, T>, ex: &Extras<'_>) {
    run_panels::<T, K>(shape, opts, inp, out, ex, PANEL_TILES);
}

/// [`run`] copying the bias `panel_tiles` key tiles at a time (tests try short runs).
pub(super) fn run_panels<T: HostElement, K: Isa>(shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, out: FwdOutputs<'_, T>, ex: &Extras<'_>, panel_tiles: usize) {
    // One instance per combination: without optional operands the tile loop is exactly the
    // original one, and without dropout (rate 0) no generator code is in it.
    let pt = panel_tiles.max(1);
    match (ex.changes_scores(), ex.dropout.is_some()) {
        (false, false) => run_impl::<T, K, false, false>(shape, opts, inp, out, ex, pt),
        (true, false) => run_impl::<T, K, true, false>(shape, opts, inp, out, ex, pt),
        (false, true) => run_impl::<T, K, false, true>(shape, opts, inp, out, ex, pt),
        (true, true) => run_impl::<T, K, true, true>(shape, opts, inp, out, ex, pt),
    }
}

fn run_impl<T: HostElement, K: Isa, const EXT: bool, const DROP: bool>(shape: &AttnShape, opts: &AttnOptions, inp: FwdInputs<'_, T>, mut out: FwdOutputs<'_, T>, ex: &Extras<'_>, panel_tiles: usize) {
    let AttnShape { batch, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d } = *shape;
    if finished_without_keys(shape, &mut out) {
        return;
    }
    let dp = round_up(d, PAD);
    let ntk = sk.div_ceil(BC);

    // Pages already mapped from an earlier call (see pool.rs); every element is written here.
    let mut kt = pool::take(batch * hkv * ntk * d * BC);
    let mut vp = pool::take(batch * hkv * ntk * BC * dp);
    kt.par_chunks_mut(ntk * d * BC)
        .zip(vp.par_chunks_mut(ntk * BC * dp))
        .enumerate()
        .for_each(|(bh, (kt, vp))| {
            let (b, kvh) = (bh / hkv, bh % hkv);
            // Keys past Sk (in the last tile) and V's padding columns are zeros: the products
            // multiply them.
            kt[(ntk - 1) * d * BC..].fill(0.0);
            vp[sk * dp..].fill(0.0);
            for j in 0..sk {
                let src = ((b * sk + j) * hkv + kvh) * d;
                let (tile, c) = (j / BC, j % BC);
                let kt = &mut kt[tile * d * BC + c..];
                for (dd, x) in inp.k[src..src + d].iter().enumerate() {
                    kt[dd * BC] = x.to_f32();
                }
                let (row, pad) = vp[j * dp..(j + 1) * dp].split_at_mut(d);
                for (o, x) in row.iter_mut().zip(&inp.v[src..src + d]) {
                    *o = x.to_f32();
                }
                pad.fill(0.0);
            }
        });

    let prep = if EXT { Prep::new(shape, ex) } else { Prep::new(shape, &Extras::default()) };
    let prep = &prep;
    let dropout = ex.dropout.unwrap_or(NO_DROPOUT);
    let keep_tile = keep_tile_fn::<MUL>(K::LANES);
    // Per (batch·kv head, key tile): does V hold an inf/NaN there? Once here, so the tile loop
    // asks a bit instead of scanning BC·dp values for every (query block, tile).
    let vbad: Vec<bool> = vp.par_chunks(BC * dp).map(|t| t.iter().any(|x| !x.is_finite())).collect();
    let nqb = sq.div_ceil(BR);
    // The first bias span of a task (batch, head, query block): what the thread that runs the
    // task before it prefetches while it computes its last span.
    let first_span = |task: usize| -> Option<PanelSpan> {
        if task >= batch * h * nqb {
            return None;
        }
        let QueryBlock { b, hq, i0, rows, .. } = QueryBlock::of(task, BR, shape);
        let block = KeyRange::for_rows(opts, sk, inp.kv_len[b], inp.q_start[b], i0, i0 + rows);
        let t0 = block.start / BC;
        (!block.is_empty()).then(|| PanelSpan { b, hq, i0, rows, t0, t1: (t0 + panel_tiles).min(block.end.div_ceil(BC)) })
    };
    let o_ptr = SyncPtr(out.o.as_mut_ptr());
    let lse_ptr = SyncPtr(out.lse.as_mut_ptr());
    let (kt, vp) = (&kt[..], &vp[..]);
    (0..batch * h * nqb).into_par_iter().for_each_init(
        || Scratch {
            qs: Lines::zeroed(BR * dp),
            s: Lines::zeroed(BR * S_LD),
            o: Lines::zeroed(BR * dp),
            m: vec![0.0; BR],
            l: vec![0.0; BR],
            ranges: Vec::with_capacity(BR),
            panel: BiasPanel::new(prep, panel_tiles),
        },
        |scr, task| {
            let qblock = QueryBlock::of(task, BR, shape);
            let block = qblock.ranges(opts, shape, inp.kv_len, inp.q_start, &mut scr.ranges);
            let QueryBlock { b, hq, bkv, i0, rows } = qblock;
            let qst = inp.q_start[b];

            scr.m[..rows].fill(f32::NEG_INFINITY);
            scr.l[..rows].fill(0.0);
            if !block.is_empty() {
                // log2(e) folded in: scores come out of the GEMM ready for exp2.
                let qscale = opts.scale * LOG2_E;
                for r in 0..rows {
                    let src = ((b * sq + i0 + r) * h + hq) * d;
                    // Padding columns d..dp are never written, so they stay 0.
                    for (o, x) in scr.qs[r * dp..r * dp + d].iter_mut().zip(&inp.q[src..src + d]) {
                        *o = qscale * x.to_f32();
                    }
                }
                scr.o[..rows * dp].fill(0.0);
                let kt = &kt[bkv * ntk * d * BC..(bkv + 1) * ntk * d * BC];
                let vp = &vp[bkv * ntk * BC * dp..(bkv + 1) * ntk * BC * dp];
                let vbad = &vbad[bkv * ntk..(bkv + 1) * ntk];
                let tiles = block.start / BC..block.end.div_ceil(BC);
                let next_block = if EXT && prep.in_place() { first_span(task + 1) } else { None };
                let tail = TailPlan {
                    rows: TaskRows::of(inp.q.as_ptr(), o_ptr.get(), shape, task, BR, batch * h * nqb),
                    from: tiles.end.saturating_sub(TAIL_TILES).max(tiles.start),
                    parts: tiles.len().min(TAIL_TILES),
                };
                let ctx = RowCtx { prep, b, hq, i0, q_start: qst as i64, alibi2: if EXT { prep.alibi2(hq) } else { 0.0 }, dropout, keep_tile, block: PanelSpan { b, hq, i0, rows, t0: tiles.start, t1: tiles.end }, next: next_block, tail };
                scr.panel.clear();
                // The span the panel is filled with after the current one.
                let mut next: Option<PanelSpan> = None;
                let per_step = if EXT { 1 } else { STEP_TILES };
                let mut t1 = tiles.start;
                while t1 < tiles.end {
                    let tile = t1;
                    t1 = (tile + per_step).min(tiles.end);
                    if EXT && !prep.tile_visible(b, tile) {
                        // key_mask hides every key of this tile from this batch row.
                        continue;
                    }
                    if EXT && prep.uses_panel() {
                        if !scr.panel.holds(tile) {
                            // The bias of this tile and the next ones, copied in runs of KiBs.
                            let span = PanelSpan { b, hq, i0, rows, t0: tile, t1: (tile + panel_tiles).min(tiles.end) };
                            prep.fill_panel(&mut scr.panel, &span);
                            next = if span.t1 < tiles.end { Some(PanelSpan { t0: span.t1, t1: (span.t1 + panel_tiles).min(tiles.end), ..span }) } else { first_span(task + 1) };
                        }
                        if let Some(next) = &next {
                            let held = scr.panel.tiles();
                            prep.prefetch_part(next, tile - held.start, held.len());
                        }
                    }
                    step::<K, EXT, DROP>(scr, opts, rows, d, dp, tile..t1, kt, vp, vbad[tile..t1].contains(&true), &ctx);
                }
            }

            // SAFETY: task (b, hq, qb) alone writes o[b, i0..i0+rows, hq, :] and
            // lse[b, hq, i0..i0+rows]; all indices are < the checked lengths.
            unsafe {
                for r in 0..rows {
                    let dst = std::slice::from_raw_parts_mut(o_ptr.get().add(((b * sq + i0 + r) * h + hq) * d), d);
                    let lse = &mut *lse_ptr.get().add((b * h + hq) * sq + i0 + r);
                    finish_row(dst, lse, &scr.o[r * dp..r * dp + d], scr.m[r], scr.l[r]);
                }
            }
        },
    );
}

/// One step of key tiles (one unless the plain instance) for one block of query rows:
/// `S = Qs·K^T`, the online-softmax update of every row, then `O += P·V` over the step's columns
/// that any row sees.
#[allow(clippy::too_many_arguments)]
fn step<K: Isa, const EXT: bool, const DROP: bool>(scr: &mut Scratch, opts: &AttnOptions, rows: usize, d: usize, dp: usize, tiles: std::ops::Range<usize>, kt: &[f32], vp: &[f32], v_bad: bool, ctx: &RowCtx<'_, '_>) {
    let (tile, n) = (tiles.start, tiles.len() * BC);
    let j0 = tile * BC;
    debug_assert!(n <= S_LD && (tiles.len() == 1 || !EXT));
    let (next_q, out_rows) = ctx.tail.at(tiles.clone());
    // The output rows ride on S's product unless the in-place bias asks for its own lines there.
    let bias_pf = if EXT { ctx.prep.prefetch_ahead(&ctx.block, ctx.next.as_ref(), tile) } else { Prefetch::NONE };
    let mut pf = if bias_pf.rows > 0 { bias_pf } else { out_rows };
    for (t, kt_tile) in kt[j0 * d..(j0 + n) * d].chunks_exact(d * BC).enumerate() {
        // SAFETY: qs is rows×dp (k = d ≤ dp columns read), kt_tile is d×BC, s is BR×S_LD and
        // this tile's columns t·BC.. t·BC + BC ≤ n ≤ S_LD.
        unsafe {
            K::gemm(Gemm {
                m: rows,
                n: BC,
                k: d,
                a: scr.qs.as_ptr(),
                a_rs: dp,
                a_cs: 1,
                b: kt_tile.as_ptr(),
                ldb: BC,
                c: scr.s.as_mut_ptr().add(t * BC),
                ldc: S_LD,
                accumulate: false,
                pf: std::mem::replace(&mut pf, Prefetch::NONE),
            });
        }
    }
    let (mut clo, mut chi) = (n, 0);
    // Whether some row of the block sees only part of [clo, chi) (or nothing of it): then P has
    // exact zeros at keys those rows must not see, and the block gemm would multiply them by V.
    let mut partial = EXT;
    // Under dropout: the columns of each row the generator scales (none for a row that adds
    // nothing), applied to the whole tile after the loop.
    let mut drop_spans = [(0usize, 0usize); BR];
    for (r, drop_span) in drop_spans[..rows].iter_mut().enumerate() {
        let rg = scr.ranges[r];
        let (a, b) = (rg_a(&rg, j0, n), rg_b(&rg, j0, n));
        partial |= r > 0 && (a, b) != (rg_a(&scr.ranges[0], j0, n), rg_b(&scr.ranges[0], j0, n));
        let srow = &mut scr.s[r * S_LD..r * S_LD + n];
        if a >= b {
            // Nothing visible in this tile: the row adds nothing to O.
            srow.fill(0.0);
            continue;
        }
        let (m_new, sum) = if EXT {
            let i = ctx.i0 + r;
            let ext: RowExtra = ctx.prep.row(&scr.panel, ctx.b, ctx.hq, r, i, ctx.q_start + i as i64, tile, ctx.alibi2);
            // SAFETY: srow and the extras' row have BC = n elements, a < b ≤ BC.
            let (m_new, sum) = unsafe { K::fwd_row_ext(srow.as_mut_ptr(), n, a, b, opts.softcap, scr.m[r], ext) };
            if m_new == f32::NEG_INFINITY {
                // Every key seen so far is hidden (key mask / -inf bias): srow is zeros.
                continue;
            }
            (m_new, sum)
        } else {
            // SAFETY: srow has n elements, a < b ≤ n.
            unsafe { K::fwd_row(srow.as_mut_ptr(), n, a, b, opts.softcap, scr.m[r]) }
        };
        online_update::<K>(&mut scr.o[r * dp..(r + 1) * dp], &mut scr.m[r], &mut scr.l[r], m_new, sum);
        if DROP {
            // Only the row's visible keys a..b (widened to whole quads) carry weight; the rest of
            // srow is 0 and stays 0.
            *drop_span = (a & !3, (b + 3) & !3);
        }
        clo = clo.min(a);
        chi = chi.max(b);
    }
    if DROP {
        // o takes P ∘ M · s; l (so lse) keeps the undropped sum: the softmax precedes dropout.
        // The generator scales the rows in place a tile at a time (its whole-tile path runs four
        // rows side by side), each row's span cut to the tile.
        let mut spans = [(0usize, 0usize); BR];
        for t in 0..tiles.len() {
            let (lo, hi) = (t * BC, (t + 1) * BC);
            for (span, &(a, b)) in spans[..rows].iter_mut().zip(&drop_spans[..rows]) {
                *span = if a.max(lo) < b.min(hi) { (a.max(lo) - lo, b.min(hi) - lo) } else { (0, 0) };
            }
            // SAFETY: s is BR×S_LD and this tile's columns lo..hi ≤ n ≤ S_LD; every span lies
            // in 0..BC in multiples of 4 (a quad-aligned, b rounded up to a quad, BC too), and
            // j0 + lo is a multiple of BC.
            unsafe { (ctx.keep_tile)(scr.s.as_mut_ptr().add(lo), S_LD, &spans[..rows], &ctx.dropout, ctx.b as u32, ctx.hq as u32, ctx.i0 as u32, j0 + lo) };
        }
    }
    // 0 * inf = NaN: when such a tile's V holds an inf/NaN, each row multiplies only the keys it
    // sees (a row that sees one gets the non-finite result it should), so none reaches the others.
    if clo < chi && partial && v_bad && vp[(j0 + clo) * dp..(j0 + chi) * dp].iter().any(|x| !x.is_finite()) {
        for r in 0..rows {
            let (a, b) = (rg_a(&scr.ranges[r], j0, n), rg_b(&scr.ranges[r], j0, n));
            if a >= b || scr.m[r] == f32::NEG_INFINITY {
                continue;
            }
            // SAFETY: s row r columns a..b < n; vp rows j0+a..j0+b inside the step; o row r.
            unsafe {
                K::gemm(Gemm {
                    m: 1,
                    n: dp,
                    k: b - a,
                    a: scr.s.as_ptr().add(r * S_LD + a),
                    a_rs: S_LD,
                    a_cs: 1,
                    b: vp.as_ptr().add((j0 + a) * dp),
                    ldb: dp,
                    c: scr.o.as_mut_ptr().add(r * dp),
                    ldc: dp,
                    accumulate: true,
                    pf: Prefetch::NONE,
                });
            }
        }
    } else if clo < chi {
        // SAFETY: s columns clo..chi ≤ n; vp rows j0+clo..j0+chi lie inside the padded tiles.
        unsafe {
            K::gemm(Gemm {
                m: rows,
                n: dp,
                k: chi - clo,
                a: scr.s.as_ptr().add(clo),
                a_rs: S_LD,
                a_cs: 1,
                b: vp.as_ptr().add((j0 + clo) * dp),
                ldb: dp,
                c: scr.o.as_mut_ptr(),
                ldc: dp,
                accumulate: true,
                pf: next_q,
            });
        }
    }
}

/// A row's visible keys within the `n` keys from key j0, as step columns [rg_a, rg_b).
fn rg_a(rg: &KeyRange, j0: usize, n: usize) -> usize {
    rg.start.saturating_sub(j0).min(n)
}
fn rg_b(rg: &KeyRange, j0: usize, n: usize) -> usize {
    rg.end.saturating_sub(j0).min(n)
}
