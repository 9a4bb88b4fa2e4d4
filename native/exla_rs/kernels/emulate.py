#!/usr/bin/env python3
"""Runs the tensor-core kernels (flash_fwd.cuh, flash_bwd.cuh) on the CPU at the level of warp
fragments: ldmatrix (.trans), mma.sync m16n8k16, the swizzled shared-memory layout, cp.async zero
fill and the mask tests, each emulated as the PTX ISA defines it, driven by the same lane-address
and fragment formulas as the .cuh files (transcribed line for line; keep them in step). Then
compares with float64 references. It cannot find scheduling bugs (races, barriers: that is
compute-sanitizer's job on a GPU) but it does check every index formula without one.

    python3 native/exla_rs/kernels/emulate.py        (needs numpy; ~1 min)
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "test/xla"))
import philox_ref  # noqa: E402  (test/xla: the contract's Philox in numpy)

# Counters the checks read to make sure a case exercised the path it names.
STATS = {"tiles_skipped": 0, "blocks_skipped": 0, "dbias_red": 0, "dropout_ties": 0}

LANES = np.arange(32)
G, TIG = LANES >> 2, LANES & 3


def bf16(x):
    """Round to bfloat16 (nearest even), kept in float32: the kernels' operand precision."""
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def f16(x):
    """Round to IEEE half (nearest even), kept in float32."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


ROUND = [bf16]  # the kernels' operand type T: bf16 or f16 (P, dS, o, dk, dv are rounded to it)


def rnd(x):
    return ROUND[0](x)


USED_EXPRS: set[tuple[str, str]] = set()


def at(sw, expr, header, **env):
    """Offsets of `expr` ("row, col" exactly as written in `header`, e.g. flash_fwd.cuh) for all
    32 lanes: evaluating the kernel's own text keeps this emulator honest (check_sources)."""
    USED_EXPRS.add((header, expr))
    row, col = eval(expr, {}, {"lane": LANES, **env})
    return sw(row, col)


def check_sources():
    """Every address expression the emulator ran appears verbatim in its header."""
    here = Path(__file__).resolve().parent
    for header, expr in sorted(USED_EXPRS):
        text = " ".join((here / header).read_text().split())
        assert " ".join(expr.split()) in text, f"{header} no longer contains `{expr}`: update emulate.py"


# ---------------------------------------------------------------------------------------------
# PTX semantics


def swz(rows, cols):
    """Swz<ROWS, COLS>::off from common.cuh (vectorised over numpy arrays)."""
    w = 64 if cols % 64 == 0 else 32

    def off(row, col):
        row, col = np.asarray(row), np.asarray(col)
        blk, c, e = col // w, (col % w) >> 3, col & 7
        cs = (c ^ (row & 7)) if w == 64 else (c ^ ((row >> 1) & 3))
        return blk * (rows * w) + row * w + (cs << 3) + e

    return off


def ldmatrix_x4(smem, addr):
    """addr[32]: lane l gives row (l & 7) of matrix l >> 3. Returns r[4][32][2]: lane t gets
    row t // 4, elements 2 (t % 4) + {0, 1} of each matrix."""
    r = np.empty((4, 32, 2), np.float32)
    for i in range(4):
        base = addr[8 * i + (LANES >> 2)]
        for h in range(2):
            r[i, :, h] = smem[base + 2 * TIG + h]
    return r


def ldmatrix_x4_trans(smem, addr):
    """.trans: lane t gets rows 2 (t % 4) + {0, 1}, column t // 4 of each stored matrix."""
    r = np.empty((4, 32, 2), np.float32)
    for i in range(4):
        for h in range(2):
            r[i, :, h] = smem[addr[8 * i + 2 * TIG + h] + G]
    return r


def mma(c, a, b0, b1):
    """c[32][4] += A[16x16] B[16x8] with the m16n8k16 fragment layouts (row.col)."""
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    C = np.zeros((16, 8), np.float64)
    for h in range(2):
        A[G, 2 * TIG + h] = a[0][:, h]
        A[G + 8, 2 * TIG + h] = a[1][:, h]
        A[G, 8 + 2 * TIG + h] = a[2][:, h]
        A[G + 8, 8 + 2 * TIG + h] = a[3][:, h]
        B[2 * TIG + h, G] = b0[:, h]
        B[8 + 2 * TIG + h, G] = b1[:, h]
        C[G, 2 * TIG + h] = c[:, h]
        C[G + 8, 2 * TIG + h] = c[:, 2 + h]
    D = A @ B + C
    out = np.empty_like(c)
    for h in range(2):
        out[:, h] = D[G, 2 * TIG + h]
        out[:, 2 + h] = D[G + 8, 2 * TIG + h]
    return out


def pack2(lo, hi):
    return np.stack([rnd(lo), rnd(hi)], -1)  # [32][2]


def load_tile(smem, base, rows, d, g, row0, limit):
    """load_tile_async: rows >= limit are zero filled. g: [S, D] (one head's rows)."""
    off = swz(rows, d)
    for r in range(rows):
        gr = row0 + r
        for c0 in range(0, d, 8):
            vals = g[gr, c0:c0 + 8] if gr < limit else np.zeros(8, np.float32)
            smem[base + off(r, np.arange(c0, c0 + 8))] = vals


WINDOW_CAP = 1 << 40  # kWindowCap in common.cuh


def w64(x):
    """x as the device's 64-bit two's-complement sum gives it (wraps on overflow)."""
    if isinstance(x, np.ndarray):
        return x  # int64 array arithmetic already wraps like the device's
    return ((int(x) + (1 << 63)) % (1 << 64)) - (1 << 63)


class Mask:
    """Mask of common.cuh, every i64 sum wrapped as on the device; clamp=False drops
    clamp_window (to show the check has teeth)."""

    def __init__(self, sq, sk, kv_len, q_start, wl, wr, clamp=True):
        self.sq, self.sk = sq, sk
        self.kv_end = int(min(max(kv_len, 0), sk))
        c = (lambda w: min(w, WINDOW_CAP)) if clamp else (lambda w: w)
        self.qs, self.wl, self.wr = int(q_start), c(int(wl)), c(int(wr))

    def visible(self, i, j):
        p = w64(self.qs + i)
        return (j < self.kv_end) & ((self.wl < 0) | (j >= w64(p - self.wl))) & ((self.wr < 0) | (j <= w64(p + self.wr)))

    def row_keys(self, i):
        p = w64(self.qs + int(i))
        a = 0 if self.wl < 0 else w64(p - self.wl)
        b = self.kv_end if self.wr < 0 else w64(w64(p + self.wr) + 1)
        a, b = max(a, 0), min(b, self.kv_end)
        return (a, b) if a < b else (0, 0)

    def rows_keys(self, r0, r1):
        """common.cuh's O(1) form."""
        i0, i1 = r0, r1
        if self.wl >= 0 and w64(w64(self.kv_end + self.wl) - self.qs) < i1:
            i1 = w64(w64(self.kv_end + self.wl) - self.qs)
        if self.wr >= 0 and w64(-self.wr - self.qs) > i0:
            i0 = w64(-self.wr - self.qs)
        if self.kv_end <= 0 or i0 >= i1:
            return 0, 0
        return self.row_keys(i0)[0], self.row_keys(i1 - 1)[1]

    def rows_keys_loop(self, r0, r1):
        """The union row by row: what rows_keys must cover (check_rows_keys)."""
        lo, hi = 1 << 31, 0
        for r in range(r0, r1):
            a, b = self.row_keys(r)
            if a < b:
                lo, hi = min(lo, a), max(hi, b)
        return (lo, hi) if lo < hi else (0, 0)

    def keys_rows(self, n0, n1):
        n1 = min(n1, self.kv_end)
        if n0 >= n1:
            return 0, 0
        a = 0 if self.wr < 0 else w64(w64(n0 - self.qs) - self.wr)
        b = self.sq if self.wl < 0 else w64(w64(w64((n1 - 1) - self.qs) + self.wl) + 1)
        a, b = max(a, 0), min(b, self.sq)
        return (a, b) if a < b else (0, 0)

    def tile_full(self, r0, r1, n0, n1):
        return n1 <= self.kv_end and (self.wl < 0 or n0 >= w64(w64(self.qs + (r1 - 1)) - self.wl)) and (self.wr < 0 or n1 - 1 <= w64(w64(self.qs + r0) + self.wr))


def score(x, scale, softcap):
    x = x * scale
    return softcap * np.tanh(x * np.float32(1 / softcap)) if softcap > 0 else x  # softcap_inv, as the kernels


# ---------------------------------------------------------------------------------------------
# The optional features (extras.cuh): key mask, bias, ALiBi, dropout, dbias


L2E = math.log2(math.e)
ALIBI_CAP = 1 << 30  # alibi_rel's clamp


class Extras:
    """The kernels' ExtraParams (+ the backward's dbias_accum) for one call. bias: array of rank 4
    [Bb, Hb, Sqb, Skb] (values already rounded to its dtype), read through dense strides that are 0
    on the broadcast dims, as the launcher fills them; dropout: (k0, k1, rate) or None, or
    (k0, k1, rate, threshold) to force the threshold onto a draw so that the tie path runs (the
    scale still comes from rate)."""

    def __init__(self, key_mask=None, bias=None, alibi=None, dropout=None, dbias=False):
        self.key_mask, self.alibi = key_mask, alibi
        self.bias = None if bias is None else np.asarray(bias, np.float32)
        if bias is not None:
            shape = self.bias.shape
            dense = [int(np.prod(shape[i + 1:])) for i in range(4)]
            self.strides = [0 if shape[i] == 1 else dense[i] for i in range(4)]  # sb, sh, sq, sk
            self.flat = self.bias.ravel()
        self.drop = None
        if dropout is not None:
            k0, k1, rate = dropout[:3]
            thr = dropout[3] if len(dropout) > 3 else philox_ref.threshold(rate)
            self.drop = (k0, k1, thr, float(philox_ref.keep_scale(rate)), rate)
        self.dbias = np.zeros(self.bias.size, np.float32) if dbias else None

    def bias_at(self, off, ok):
        """BT::load at offsets `off` where ok (0 elsewhere: the kernels do not read there)."""
        return np.where(ok, self.flat[np.where(ok, off, 0)], 0).astype(np.float32)

    def bias_offset(self, b, h, i, j):
        sb, sh, sq, sk = self.strides
        return b * sb + h * sh + np.asarray(i, np.int64) * sq + np.asarray(j, np.int64) * sk


def ballot(pred):
    return int(sum(1 << l for l in range(32) if pred[l]))


ALL64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def bit_range(a, z):
    """common.cuh bit_range, per lane: bits [a, z) of a u64, a and z clamped to [0, 64]."""
    lo, hi = np.maximum(a, 0), np.minimum(z, 64)
    below_hi = np.where(hi >= 64, ALL64, (np.uint64(1) << np.clip(hi, 0, 63).astype(np.uint64)) - np.uint64(1))
    return np.where(lo >= hi, np.uint64(0), below_hi & (ALL64 << np.clip(lo, 0, 63).astype(np.uint64)))


def bit_of(bits, c):
    """Bit c (an int) of each lane's u64 mask, as bools."""
    return ((bits >> np.uint64(c)) & np.uint64(1)) == 1


def key_mask_tile_bits(ex, b, n0, sk, bn):
    """extras.cuh key_mask_tile_bits: each lane reads keys n0 + half * 32 + lane, one ballot per half."""
    bits = 0
    for half in range(bn // 32):
        key = n0 + half * 32 + LANES
        vis = (key < sk) & (ex.key_mask[b, np.minimum(key, sk - 1)] != 0)
        bits |= ballot(vis) << (32 * half)
    return bits


U32 = 0xFFFFFFFF


def philox(c, k0, k1):
    return [x.astype(np.uint64) for x in philox_ref.philox4x32_10([np.asarray(x, np.uint64) & np.uint64(U32) for x in c], (k0, k1))]


def transpose4_lanes(a, w, stride):
    """extras.cuh transpose4_lanes<kStride>: a[k] (4 arrays over the 32 lanes), w = (lane / stride) & 3."""
    a = list(a)
    w1, w2 = (w & 1) != 0, (w & 2) != 0
    for t in range(2):
        got = np.where(w1, a[2 * t], a[2 * t + 1])[LANES ^ stride]
        a[2 * t], a[2 * t + 1] = np.where(w1, got, a[2 * t]), np.where(w1, a[2 * t + 1], got)
    for t in range(2):
        got = np.where(w2, a[t], a[t + 2])[LANES ^ (2 * stride)]
        a[t], a[t + 2] = np.where(w2, got, a[t]), np.where(w2, a[t + 2], got)
    return a


def check_transpose4():
    """Lane w leaves with word w of call e in a[e], for every group of 4 lanes and each stride."""
    A = np.arange(32 * 4).reshape(32, 4) * 7 + 3  # lane l holds words A[l, k]
    for stride in (1, 2, 4, 8):
        w = (LANES // stride) & 3
        out = transpose4_lanes([A[:, k] for k in range(4)], w, stride)
        for lane in range(32):
            for e in range(4):
                src = (lane & ~(3 * stride)) | (e * stride)  # the group lane that computed call e
                assert out[e][lane] == A[src, w[lane]], (stride, lane, e)


def philox_word(words, w):
    """extras.cuh philox_word: word w (per lane) of a call."""
    return np.choose(np.asarray(w, np.int64), words)


def half16(word, hh):
    return (np.asarray(word, np.uint64) >> np.uint64(16 * hh)) & np.uint64(0xFFFF)


def tie_keep(drop, b, h, i, octv, w, hh):
    """Dropout::tie_keep: half hh of word w of y (counter (2^31 + oct, i, h, b)) >= T & 0xFFFF."""
    k0, k1, thr = drop[:3]
    y = philox([np.asarray(octv, np.uint64) + np.uint64(1 << 31), i, h, b], k0, k1)
    return half16(philox_word(y, w), hh) >= np.uint64(thr & 0xFFFF)


def entry_keep(drop, b, h, i, j):
    """Dropout::keep(b, h, i, j): x's upper half against T >> 16, y only on a tie (k0, k1, T may
    be arrays too, one per entry)."""
    k0, k1, thr = drop[:3]
    thr = np.asarray(thr, np.uint64)
    j = np.asarray(j, np.uint64)
    octv, w, hh = j >> np.uint64(3), ((j >> np.uint64(1)) & np.uint64(3)).astype(np.int64), (j & np.uint64(1)).astype(np.int64)
    sh = np.uint64(16) * hh.astype(np.uint64)
    up = (philox_word(philox([octv, i, h, b], k0, k1), w) >> sh) & np.uint64(0xFFFF)
    t = thr >> np.uint64(16)
    low = (philox_word(philox([octv + np.uint64(1 << 31), i, h, b], k0, k1), w) >> sh) & np.uint64(0xFFFF)
    return np.where(up == t, low >= (thr & np.uint64(0xFFFF)), up > t)


def keep8(drop, a, w, oct0, i0, i_step, b, h):
    """Dropout::keep8 over the lanes: bit 2c + hh is half hh of a[c] (word w of x of counter
    (oct0 + (c >> 1), i0 + (c & 1) * i_step, h, b)); y only for the lanes whose half ties."""
    thr = drop[2]
    t = np.uint64(thr >> 16)
    bits = np.zeros(32, np.uint64)
    tie = np.zeros(32, np.uint64)
    for c in range(4):
        for hh in range(2):
            up = half16(a[c], hh)
            bits |= (up > t).astype(np.uint64) << np.uint64(2 * c + hh)
            tie |= (up == t).astype(np.uint64) << np.uint64(2 * c + hh)
    for k in range(8):  # the kernel's while loop over the set tie bits (order does not matter)
        lanes = ((tie >> np.uint64(k)) & np.uint64(1)) != 0
        if not lanes.any():
            continue
        c = k >> 1
        STATS["dropout_ties"] += int(lanes.sum())
        kept = tie_keep(drop, b, h, np.asarray(i0, np.uint64) + np.uint64((c & 1) * i_step), np.asarray(oct0, np.uint64) + np.uint64(c >> 1), w, k & 1)
        bits |= (lanes & kept).astype(np.uint64) << np.uint64(k)
    return bits


def fwd_dropout_bits(drop, b, h, row_a, n0, bn):
    """flash_fwd.cuh dropout_tile's keep bits: bit 4j + e of lane (g, tig) = element (j, e), row
    row_a + 8 (e >> 1), key n0 + 8j + 2tig + (e & 1)."""
    k0, k1 = drop[:2]
    nj = bn // 8
    oct0 = n0 >> 3
    bits = np.zeros(32, np.uint64)
    for jp in range((nj + 1) // 2):
        r = philox([oct0 + 2 * jp + (TIG >> 1), np.asarray(row_a) + 8 * (TIG & 1), h, b], k0, k1)
        a = transpose4_lanes(r, TIG, 1)
        bits |= keep8(drop, a, TIG, oct0 + 2 * jp, row_a, 8, b, h) << np.uint64(8 * jp)
    return bits


def even_bits4(v):
    one = np.uint64(1)
    return (v & one) | ((v >> one) & np.uint64(2)) | ((v >> np.uint64(2)) & np.uint64(4)) | ((v >> np.uint64(3)) & np.uint64(8))


def bwd_dropout_bits(drop, b, h, m0, key_warp0, bm):
    """flash_bwd.cuh dropout_keep_bits_t: bit 4j + e of lane (g, tig) = element (j, e), query
    m0 + 8j + 2tig + (e & 1), key key_warp0 + g + 8 (e >> 1)."""
    k0, k1 = drop[:2]
    nj = bm // 8
    w, p = G >> 1, G & 1
    oct0 = key_warp0 >> 3
    bits = np.zeros(32, np.uint64)
    for jp in range((nj + 1) // 2):
        j = 2 * jp + p
        q0 = m0 + j * 8 + TIG * 2
        r = philox([oct0 + (w >> 1), q0 + (w & 1), h, b], k0, k1)
        a = transpose4_lanes(r, w, 8)
        k8 = keep8(drop, a, w, oct0, q0, 1, b, h)
        mine4, give4 = even_bits4(k8 >> p.astype(np.uint64)), even_bits4(k8 >> (p ^ 1).astype(np.uint64))
        got4 = give4[LANES ^ 4]
        bits |= (mine4 << (4 * j).astype(np.uint64)) | (got4 << (4 * (j ^ 1)).astype(np.uint64))
    return bits


def check_dropout_fragments():
    """The fragment keep bits of both kernels (and Dropout::keep) equal the contract's mask
    draw >= T from philox_ref, for random thresholds and for thresholds forced onto the draws of
    entries the tile covers (T = draw and draw + 1, and T = draw's upper half with lower half 0 or
    0xFFFF): there half(x) ties with T >> 16 and the y path decides. Odd n-tile counts (a tail
    pair with one n-tile) are run as well."""
    rng = np.random.default_rng(11)
    ties0 = STATS["dropout_ties"]
    n_checked = 0

    def expected(key, thr, b, h, rows, keys):
        return philox_ref.dropout_draw(key, b, h, rows, keys).astype(np.uint64) >= np.uint64(thr)

    def thresholds(key, b, h, rows, keys):
        """A random threshold, then forced ones at a few covered entries (lane, j, e)."""
        out = [int(rng.integers(0, 2**32 - 256))]
        draws = philox_ref.dropout_draw(key, b, h, rows, keys)  # [32, NJ, 4]
        picks = [(0, 0, 0), (31, draws.shape[1] - 1, 3), (int(rng.integers(32)), int(rng.integers(draws.shape[1])), 1),
                 (int(rng.integers(32)), int(rng.integers(draws.shape[1])), 2)]
        for l, j, e in picks:
            d = int(draws[l, j, e])
            out += [d, d + 1, d & 0xFFFF0000, d | 0xFFFF]
        return [t for t in out if t <= 2**32 - 256]

    # The tile geometry: (b, h, row base, n0 / key_warp0, m0, BN / BM)
    geoms = [(0, 0, 0, 0, 0, 64), (1, 3, 16, 128, 32, 32), (0xFFFFFFFF, 0xFFFFFFFF, 2**31 - 100, 2**31 - 64, 2**31 - 80, 64),
             (2, 1, 48, 64, 0, 24), (5, 2, 7, 2**30, 2**30 + 8, 40)]
    for gi, (b, h, rbase, n0, m0, nn) in enumerate(geoms):
        key = (int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32)))
        nj = nn // 8
        jj, ee = np.arange(nj)[None, :, None], np.arange(4)[None, None, :]
        ln_g, ln_t = G[:, None, None], TIG[:, None, None]
        # forward: lane (g, tig), element (j, e): row rbase + g + 8 (e >> 1), key n0 + 8j + 2tig + (e & 1)
        f_rows = np.broadcast_to(rbase + ln_g + 8 * (ee >> 1), (32, nj, 4))
        f_keys = np.broadcast_to(n0 + 8 * jj + 2 * ln_t + (ee & 1), (32, nj, 4))
        # backward: query m0 + 8j + 2tig + (e & 1), key key_warp0 + g + 8 (e >> 1)
        b_rows = np.broadcast_to(m0 + 8 * jj + 2 * ln_t + (ee & 1), (32, nj, 4))
        b_keys = np.broadcast_to(n0 + ln_g + 8 * (ee >> 1), (32, nj, 4))
        for kind, rows, keys in (("fwd", f_rows, f_keys), ("bwd", b_rows, b_keys)):
            for thr in thresholds(key, b, h, rows, keys):
                drop = (key[0], key[1], thr, 1.0, 0.0)
                if kind == "fwd":
                    bits = fwd_dropout_bits(drop, b, h, rbase + G, n0, nn)
                else:
                    bits = bwd_dropout_bits(drop, b, h, m0, n0, nn)
                got = ((bits[:, None, None] >> (4 * jj + ee).astype(np.uint64)) & np.uint64(1)) != 0
                want = expected(key, thr, b, h, rows, keys)
                assert np.array_equal(got, want), f"{kind} dropout bits differ: geometry {gi} threshold {thr:#x} at {np.argwhere(got != want)[:4].tolist()}"
                assert np.array_equal(entry_keep(drop, b, h, rows, keys), want), f"Dropout::keep differs: {kind} geometry {gi} threshold {thr:#x}"
                n_checked += want.size
    ties = STATS["dropout_ties"] - ties0
    assert ties > 100, f"the tie path ran only {ties} times"
    print(f"dropout fragments: {n_checked} entries, {ties} ties resolved by y", flush=True)


def ref_extras(q, k, v, do, kv_len, qs, scale, cap, wl, wr, ex):
    """float64 reference of the contract with the optional features (written from its Semantics,
    Backward and Dropout sections): o, lse, dq, dk, dv, dbias (summed over broadcast dims)."""
    import exla_rs_jax as xj
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    g = H // Hkv
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    kk, vv = k64.repeat(g, 2), v64.repeat(g, 2)
    x = scale * np.einsum("bihd,bjhd->bhij", q64, kk)
    s = cap * np.tanh(x / cap) if cap > 0 else x
    vis = np.broadcast_to(xj.visible_mask(B, Sq, Sk, kv_len, qs, wl, wr, ex.key_mask)[:, None], s.shape)
    z = s.copy()
    if ex.bias is not None:
        z = z + np.broadcast_to(ex.bias.astype(np.float64), s.shape)
    if ex.alibi is not None:
        pos = qs.astype(np.int64)[:, None, None, None] + np.arange(Sq)[None, None, :, None]
        z = z - ex.alibi.astype(np.float64)[None, :, None, None] * np.abs(pos - np.arange(Sk)[None, None, None, :])
    with np.errstate(invalid="ignore"):
        vis = vis & (np.where(vis, z, 0) > -np.inf)  # a bias of -inf hides the entry
    zm = np.where(vis, z, -np.inf)
    mx = zm.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    l = np.exp(zm - mx).sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, mx + np.log(np.where(l > 0, l, 1)), -np.inf)
    P = np.where(vis, np.exp(zm - np.where(np.isfinite(lse), lse, 0)), 0)
    if ex.drop is not None:
        k0, k1, thr, _, rate = ex.drop
        bb, hh, ii, jj = np.meshgrid(np.arange(B), np.arange(H), np.arange(Sq), np.arange(Sk), indexing="ij")
        keep = philox_ref.dropout_draw((k0, k1), bb, hh, ii, jj) >= np.uint32(thr)  # philox_ref.mask with the stored T
        Ms = keep * (1 / (1 - np.float64(np.float32(rate))))
    else:
        Ms = np.ones_like(P)
    o = np.einsum("bhij,bjhd->bihd", P * Ms, vv)
    dP = np.einsum("bihd,bjhd->bhij", do64, vv)
    delta = np.einsum("bihd,bihd->bhi", do64, o)[..., None]
    dZ = P * (Ms * dP - delta)
    dX = dZ * ((1 - (s / cap) ** 2) if cap > 0 else 1)
    dq = scale * np.einsum("bhij,bjhd->bihd", dX, kk)
    dk = (scale * np.einsum("bhij,bihd->bjhd", dX, q64)).reshape(B, Sk, Hkv, g, D).sum(3)
    dv = np.einsum("bhij,bihd->bjhd", P * Ms, do64).reshape(B, Sk, Hkv, g, D).sum(3)
    dbias = dbias_mag = None
    if ex.bias is not None:
        axes = tuple(i for i in range(4) if ex.bias.shape[i] == 1)
        dbias = dZ.sum(axis=axes, keepdims=True)
        # The scale an entry's sum is computed at: a row sum of dZ cancels to ~0 without dropout
        # (softmax shift invariance), so errors are measured against the sum of |dZ|.
        dbias_mag = np.abs(dZ).sum(axis=axes, keepdims=True)
    return o, lse[..., 0], dq, dk, dv, (dbias, dbias_mag)


# ---------------------------------------------------------------------------------------------
# flash_fwd.cuh


def fwd_traits(d):
    warps = 8 if d <= 192 else 4
    return warps, 16 * warps, 64 if d <= 128 else 32


def flash_fwd(q, k, v, kv_len, q_start, scale, softcap, wl, wr, ex=None):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    NW, BM, BN = fwd_traits(D)
    swq, swk = swz(BM, D), swz(BN, D)
    o = np.full(q.shape, np.nan, np.float32)
    lse = np.full((B, H, Sq), np.nan, np.float32)
    for b in range(B):
        for h in range(H):
            hk = h // (H // Hkv)
            mask = Mask(Sq, Sk, kv_len[b], q_start[b], wl, wr)
            for m0 in range(0, Sq, BM):
                sQ = np.full(BM * D, np.nan, np.float32)
                k_lo, k_hi = mask.rows_keys(m0, min(m0 + BM, Sq))
                n_first, n_last = k_lo // BN, (k_hi + BN - 1) // BN
                all_keys = (1 << BN) - 1

                def next_tile(n):  # flash_fwd.cuh next_tile: key_mask-hidden tiles are never loaded
                    if ex is None or ex.key_mask is None:
                        return n, all_keys
                    while n < n_last:
                        bits = key_mask_tile_bits(ex, b, n * BN, Sk, BN)
                        if bits:
                            return n, bits
                        n += 1
                    return n_last, 0

                tiles = []
                n, bits = next_tile(n_first)
                while n < n_last:
                    tiles.append((n, bits))
                    n, bits = next_tile(n + 1)
                if ex is not None and ex.key_mask is not None:
                    STATS["tiles_skipped"] += (n_last - n_first) - len(tiles)
                if tiles:
                    load_tile(sQ, 0, BM, D, q[b, :, h], m0, Sq)
                for warp in range(NW):
                    acc = np.zeros((D // 8, 32, 4), np.float32)
                    rmax = np.full((2, 32), -np.inf, np.float32)
                    rsum = np.zeros((2, 32), np.float32)
                    row_a = m0 + warp * 16 + G
                    # lo_r/hi_r: each lane's two rows' key intervals, found once per kernel
                    lo_r = np.array([[mask.row_keys(row_a[l] + 8 * r)[0] for l in range(32)] for r in range(2)])
                    hi_r = np.array([[mask.row_keys(row_a[l] + 8 * r)[1] for l in range(32)] for r in range(2)])
                    for n, km_bits in tiles:
                        sK = np.full(BN * D, np.nan, np.float32)
                        sV = np.full(BN * D, np.nan, np.float32)
                        load_tile(sK, 0, BN, D, k[b, :, hk], n * BN, mask.kv_end)
                        load_tile(sV, 0, BN, D, v[b, :, hk], n * BN, mask.kv_end)
                        s = np.zeros((BN // 8, 32, 4), np.float32)
                        for kk in range(D // 16):
                            a = ldmatrix_x4(sQ, at(swq, "warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8", "flash_fwd.cuh", warp=warp, kk=kk))
                            for nt in range(BN // 16):
                                bf = ldmatrix_x4(sK, at(swk, "nt * 16 + (lane & 7) + (lane >> 4) * 8, kk * 16 + ((lane >> 3) & 1) * 8", "flash_fwd.cuh", nt=nt, kk=kk))
                                s[2 * nt] = mma(s[2 * nt], a, bf[0], bf[1])
                                s[2 * nt + 1] = mma(s[2 * nt + 1], a, bf[2], bf[3])
                        n0 = n * BN
                        full = mask.tile_full(m0, m0 + BM, n0, n0 + BN) and km_bits == all_keys
                        s = score(s, scale, softcap) * math.log2(math.e)
                        if ex is not None and ex.bias is not None:  # add_bias_tile
                            k_lim = mask.kv_end - n0 - TIG * 2
                            for r in range(2):
                                row = row_a + 8 * r
                                base = ex.bias_offset(b, h, row, n0 + TIG * 2)
                                for j in range(BN // 8):
                                    for hh in range(2):
                                        ok = (row < Sq) & (j * 8 + hh < k_lim)
                                        s[j, :, 2 * r + hh] += ex.bias_at(base + (j * 8 + hh) * ex.strides[3], ok) * np.float32(L2E)
                        if ex is not None and ex.alibi is not None:  # add_alibi_tile
                            slope_l2 = np.float32(-ex.alibi[h] * np.float32(L2E))
                            for r in range(2):
                                rel = np.clip(int(mask.qs) + row_a + 8 * r - (n0 + TIG * 2), -ALIBI_CAP, ALIBI_CAP)
                                for j in range(BN // 8):
                                    for hh in range(2):
                                        s[j, :, 2 * r + hh] += slope_l2 * np.abs(rel - (j * 8 + hh)).astype(np.float32)
                        if not full:
                            km_mine = np.uint64(km_bits) >> (TIG * 2).astype(np.uint64)
                            for r in range(2):
                                vis = bit_range(lo_r[r] - n0 - TIG * 2, hi_r[r] - n0 - TIG * 2) & km_mine
                                for j in range(BN // 8):
                                    for e1 in range(2):
                                        hid = ~bit_of(vis, j * 8 + e1)
                                        s[j, :, 2 * r + e1] = np.where(hid, -np.inf, s[j, :, 2 * r + e1])
                        has_bias = ex is not None and ex.bias is not None
                        if (not full or has_bias) and not np.isfinite(sV).all():
                            # The rare path of flash_fwd.cuh: NaN where a visible key's V is
                            # non-finite, then the tile's non-finite V elements become +0.
                            # Vectorised over the lanes: lane l takes key `key` iff it lies in its
                            # row's [lo, hi) and neither key_mask nor a -inf bias hides it.
                            for r in range(2):
                                lo, hi = np.maximum(lo_r[r], n0), np.minimum(hi_r[r], n0 + BN)
                                row = row_a + 8 * r
                                for key in range(int(lo.min()), int(hi.max())):
                                    sees = (lo <= key) & (key < hi)
                                    if not (km_bits >> (key - n0)) & 1:
                                        continue
                                    if has_bias:
                                        ok = row < Sq
                                        sees &= ~(ok & (ex.bias_at(ex.bias_offset(b, h, row, key), ok) == -np.inf))
                                    if not sees.any():
                                        continue
                                    for c in range(D // 4):
                                        off = at(swk, "key - n0, (c >> 1) * 8 + tig * 2 + (c & 1)", "flash_fwd.cuh", key=key, n0=n0, c=c, tig=TIG)
                                        hit = sees & ~np.isfinite(sV[off])
                                        acc[c >> 1, hit, 2 * r + (c & 1)] = np.nan
                            sV[~np.isfinite(sV)] = 0
                        for r in range(2):
                            mx = np.maximum(rmax[r], np.max(s[:, :, 2 * r:2 * r + 2], axis=(0, 2)))
                            mx = np.maximum(mx, mx[LANES ^ 1])
                            mx = np.maximum(mx, mx[LANES ^ 2])
                            base = np.where(mx == -np.inf, 0, mx)
                            alpha = np.exp2(rmax[r] - base)
                            rmax[r] = mx
                            s[:, :, 2 * r:2 * r + 2] = np.exp2(s[:, :, 2 * r:2 * r + 2] - base[None, :, None])
                            rsum[r] = rsum[r] * alpha + s[:, :, 2 * r:2 * r + 2].sum(axis=(0, 2))
                            acc[:, :, 2 * r:2 * r + 2] *= alpha[None, :, None]
                        if ex is not None and ex.drop is not None:  # dropout_tile
                            bits = fwd_dropout_bits(ex.drop, b, h, row_a, n0, BN)
                            for j in range(BN // 8):
                                for e in range(4):
                                    s[j, :, e] = np.where((bits >> np.uint64(4 * j + e)) & np.uint64(1), s[j, :, e], 0)
                        for kk in range(BN // 16):
                            a = [pack2(s[2 * kk][:, 0], s[2 * kk][:, 1]), pack2(s[2 * kk][:, 2], s[2 * kk][:, 3]),
                                 pack2(s[2 * kk + 1][:, 0], s[2 * kk + 1][:, 1]), pack2(s[2 * kk + 1][:, 2], s[2 * kk + 1][:, 3])]
                            for dt in range(D // 16):
                                bf = ldmatrix_x4_trans(sV, at(swk, "kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dt * 16 + (lane >> 4) * 8", "flash_fwd.cuh", kk=kk, dt=dt))
                                acc[2 * dt] = mma(acc[2 * dt], a, bf[0], bf[1])
                                acc[2 * dt + 1] = mma(acc[2 * dt + 1], a, bf[2], bf[3])
                    inv, ls = [], []
                    o_scale = ex.drop[3] if ex is not None and ex.drop is not None else 1.0
                    for r in range(2):
                        l = rsum[r] + rsum[r][LANES ^ 1]
                        l = l + l[LANES ^ 2]
                        with np.errstate(divide="ignore"):
                            inv.append(np.where(l > 0, o_scale / np.where(l > 0, l, 1), 0))
                            ls.append(np.where(l > 0, (rmax[r] + np.log2(np.where(l > 0, l, 1))) * math.log(2), -np.inf))
                    for lane in LANES[TIG == 0]:
                        for r in range(2):
                            row = row_a[lane] + 8 * r
                            if row < Sq:
                                lse[b, h, row] = ls[r][lane]
                    # Staged through sQ with the same offsets, then copied out by rows.
                    sO = sQ
                    for dt in range(D // 8):
                        col = dt * 8 + TIG * 2
                        ra = warp * 16 + G
                        for r in range(2):
                            sO[swq(ra + 8 * r, col)] = rnd(acc[dt, :, 2 * r] * inv[r])
                            sO[swq(ra + 8 * r, col + 1)] = rnd(acc[dt, :, 2 * r + 1] * inv[r])
                    for r in range(16):
                        row = m0 + warp * 16 + r
                        if row < Sq:
                            o[b, row, h] = sO[swq(warp * 16 + r, np.arange(D))]
    return o, lse


# ---------------------------------------------------------------------------------------------
# flash_bwd.cuh


def bwd_traits(d):
    warps = 4 if d <= 192 else 8
    split = 1 if d <= 128 else (2 if d <= 192 else 4)
    return warps, split, 16 * warps // split, (64 if d <= 96 else 32), d // split


def bwd_extras_step(ex, st, dpt, dbias_keys, b, h, hk, t, group, m_tiles, m0, n0, ks, dpart, key_a, kbad, qa, qz, full, sLse, sDelta,
                    mask, Sq, BM, scale, softcap):
    """flash_bwd.cuh's `if (extras)` step for one warp (st, dpt, dbias_keys updated in place)."""
    keep_bits = np.full(32, 0xFFFFFFFF, np.uint64)
    drop_scale = np.float32(1)
    if ex.drop is not None:  # dropout_keep_bits_t
        drop_scale = ex.drop[3]
        keep_bits = bwd_dropout_bits(ex.drop, b, h, m0, n0 + ks * 16, BM)
    slope_l2 = np.float32(-ex.alibi[h] * np.float32(L2E)) if ex.alibi is not None else 0
    rel = np.clip(int(mask.qs) + m0 + TIG * 2 - key_a, -ALIBI_CAP, ALIBI_CAP)
    q_lim, k_lim = Sq - m0 - TIG * 2, mask.kv_end - key_a
    dbias = ex.dbias if dpart == 0 else None
    if ex.bias is not None:
        bias_base = ex.bias_offset(b, h, m0 + TIG * 2, key_a)
        bsq, bsk = ex.strides[2], ex.strides[3]
    for j in range(BM // 8):
        dz4 = []
        for e in range(4):
            ql = j * 8 + TIG * 2 + (e & 1)
            qc, kc = j * 8 + (e & 1), (e >> 1) * 8
            l2 = sLse[ql]
            s = np.where(kbad[ks * 16 + G + 8 * (e >> 1)], np.nan, score(st[j, :, e], scale, softcap)).astype(np.float32)
            z2 = s * np.float32(L2E)
            if ex.bias is not None:
                ok = (qc < q_lim) & (kc < k_lim)
                z2 = z2 + ex.bias_at(bias_base + qc * bsq + kc * bsk, ok) * np.float32(L2E)
            if ex.alibi is not None:
                z2 = z2 + slope_l2 * np.abs(rel + qc - kc).astype(np.float32)
            vis = (l2 != -np.inf) & (full | ((qc >= qa[e >> 1]) & (qc < qz[e >> 1]))) & (z2 != -np.inf)
            pr = np.where(vis, np.exp2(z2 - l2), 0).astype(np.float32)
            pm = np.where((keep_bits >> np.uint64(j * 4 + e)) & np.uint64(1), drop_scale, 0).astype(np.float32)
            st[j, :, e] = pr * pm
            dz = np.where(vis, pr * (pm * dpt[j, :, e] - sDelta[ql]), 0).astype(np.float32)
            dz4.append(dz)
            grad = 1 - (s * np.float32(1 / softcap)) ** 2 if softcap > 0 else 1
            dpt[j, :, e] = dz * grad
        if dbias is not None:
            if bsq == 0:
                dbias_keys[0] += dz4[0] + dz4[1]
                dbias_keys[1] += dz4[2] + dz4[3]
            elif bsk == 0:
                for c in range(2):
                    vsum = dz4[c] + dz4[c + 2]
                    for x in (4, 8, 16):
                        vsum = vsum + vsum[LANES ^ x]
                    red(dbias, bias_base + (j * 8 + c) * bsq, vsum, (G == 0) & (vsum != 0))
            else:
                for e in range(4):
                    red(dbias, bias_base + (j * 8 + (e & 1)) * bsq + (e >> 1) * 8 * bsk, dz4[e], dz4[e] != 0)
    if dbias is not None and bsq == 0:  # flushed every step
        base = ex.bias_offset(b, h, 0, key_a)
        if bsk == 0:
            vsum = dbias_keys[0] + dbias_keys[1]
            for x in (16, 8, 4, 2, 1):  # warp_sum
                vsum = vsum + vsum[LANES ^ x]
            red(dbias, base, vsum, (LANES == 0) & (vsum != 0))
        else:
            for r in range(2):
                dbias_keys[r] += dbias_keys[r][LANES ^ 1]
                dbias_keys[r] += dbias_keys[r][LANES ^ 2]
            for r in range(2):
                red(dbias, base + r * 8 * bsk, dbias_keys[r], (TIG == 0) & (dbias_keys[r] != 0))
        dbias_keys[:] = 0


def red(buf, off, val, ok):
    """red.global.add.f32 by the lanes where ok (off must be in range there)."""
    off = np.broadcast_to(off, (32,))
    assert ((off[ok] >= 0) & (off[ok] < buf.size)).all(), "dbias atomic out of range"
    np.add.at(buf, off[ok], val[ok])
    STATS["dbias_red"] += int(ok.sum())


def flash_bwd(q, k, v, kv_len, q_start, o, lse, do, scale, softcap, wl, wr, ex=None):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    NW, SPLIT, BN, BM, DW = bwd_traits(D)
    group = H // Hkv
    swkv, swq, sws = swz(BN, D), swz(BM, D), swz(BN, BM)
    L2E = math.log2(math.e)
    delta = np.einsum("bihd,bihd->bhi", do.astype(np.float32), o.astype(np.float32))
    dq_acc = np.zeros(q.shape, np.float32)
    dk = np.full(k.shape, np.nan, np.float32)
    dv = np.full(v.shape, np.nan, np.float32)
    for b in range(B):
        mask = Mask(Sq, Sk, kv_len[b], q_start[b], wl, wr)
        for hk in range(Hkv):
            for n0 in range(0, Sk, BN):
                acc_dk = np.zeros((NW, DW // 8, 32, 4), np.float32)
                acc_dv = np.zeros((NW, DW // 8, 32, 4), np.float32)
                q_lo, q_hi = mask.keys_rows(n0, n0 + BN)
                all_keys = (1 << BN) - 1
                km_bits = all_keys
                if ex is not None and ex.key_mask is not None:
                    km_bits = key_mask_tile_bits(ex, b, n0, Sk, BN)
                    if km_bits == 0:
                        STATS["blocks_skipped"] += q_lo < q_hi
                        q_lo = q_hi = 0
                km_full = km_bits == all_keys
                extras = ex is not None and (ex.bias is not None or ex.alibi is not None or ex.drop is not None or ex.dbias is not None)
                sK = np.full(BN * D, np.nan, np.float32)
                sV = np.full(BN * D, np.nan, np.float32)
                kbad = np.zeros(BN, bool)
                if q_lo < q_hi:
                    load_tile(sK, 0, BN, D, k[b, :, hk], n0, mask.kv_end)
                    load_tile(sV, 0, BN, D, v[b, :, hk], n0, mask.kv_end)
                    for r in range(BN):  # the first step's scan: flag and zero non-finite K rows
                        offs = at(swkv, "r, c * 8", "flash_bwd.cuh", r=r, c=np.arange(D // 8)[:, None]) + np.arange(8)
                        kbad[r] = not np.isfinite(sK[offs]).all()
                        sK[offs] = np.where(np.isfinite(sK[offs]), sK[offs], 0)
                m_first = (q_lo // BM) * BM
                m_tiles = (q_hi - m_first + BM - 1) // BM if q_lo < q_hi else 0
                for t in range(group * m_tiles):
                    h, m0 = hk * group + t // m_tiles, m_first + (t % m_tiles) * BM
                    if True:
                        sQ = np.full(BM * D, np.nan, np.float32)
                        sdO = np.full(BM * D, np.nan, np.float32)
                        sdS = np.full(BN * BM, np.nan, np.float32)
                        # Rows with lse = -inf are zero-filled like rows past Sq.
                        live = lse[b, h] != -np.inf
                        load_tile(sQ, 0, BM, D, np.where(live[:, None], q[b, :, h], 0), m0, Sq)
                        load_tile(sdO, 0, BM, D, np.where(live[:, None], do[b, :, h], 0), m0, Sq)
                        rows = m0 + np.arange(BM)
                        sLse = np.where(rows < Sq, lse[b, h, np.minimum(rows, Sq - 1)], -np.inf) * L2E
                        sDelta = np.where(rows < Sq, delta[b, h, np.minimum(rows, Sq - 1)], 0)
                        full = km_full and mask.tile_full(m0, m0 + BM, n0, n0 + BN)
                        for warp in range(NW):
                            ks, dpart = warp // SPLIT, warp % SPLIT
                            key_a = n0 + ks * 16 + G
                            # qlo/qhi: the queries that see each of the lane's two keys (once per block)
                            qlo = np.array([[mask.keys_rows(key_a[l] + 8 * r, key_a[l] + 8 * r + 1)[0] for l in range(32)] for r in range(2)])
                            qhi = np.array([[mask.keys_rows(key_a[l] + 8 * r, key_a[l] + 8 * r + 1)[1] for l in range(32)] for r in range(2)])
                            for r in range(2):  # keys hidden by key_mask: empty query interval
                                hidden = ((np.uint64(km_bits) >> (key_a + 8 * r - n0).astype(np.uint64)) & np.uint64(1)) == 0
                                qlo[r], qhi[r] = np.where(hidden, 0, qlo[r]), np.where(hidden, 0, qhi[r])
                            qa, qz = qlo - m0 - TIG * 2, qhi - m0 - TIG * 2
                            # flash_bwd.cuh qvis: each key's visible queries of the step as bits (all on a full step)
                            qvis = [np.full(32, ALL64) if full else bit_range(qa[r], qz[r]) for r in range(2)]
                            st = np.zeros((BM // 8, 32, 4), np.float32)
                            dpt = np.zeros((BM // 8, 32, 4), np.float32)
                            for kk in range(D // 16):
                                a_off = at(swkv, "ks * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8", "flash_bwd.cuh", ks=ks, kk=kk)
                                ak, av = ldmatrix_x4(sK, a_off), ldmatrix_x4(sV, a_off)
                                for nt in range(BM // 16):
                                    b_off = at(swq, "nt * 16 + (lane & 7) + (lane >> 4) * 8, kk * 16 + ((lane >> 3) & 1) * 8", "flash_bwd.cuh", nt=nt, kk=kk)
                                    bq, bo = ldmatrix_x4(sQ, b_off), ldmatrix_x4(sdO, b_off)
                                    st[2 * nt] = mma(st[2 * nt], ak, bq[0], bq[1])
                                    st[2 * nt + 1] = mma(st[2 * nt + 1], ak, bq[2], bq[3])
                                    dpt[2 * nt] = mma(dpt[2 * nt], av, bo[0], bo[1])
                                    dpt[2 * nt + 1] = mma(dpt[2 * nt + 1], av, bo[2], bo[3])
                            if extras:
                                dbias_keys = np.zeros((2, 32), np.float32)  # the step's Sqb = 1 sums of the lanes' keys
                                bwd_extras_step(ex, st, dpt, dbias_keys, b, h, hk, t, group, m_tiles, m0, n0, ks, dpart, key_a, kbad, qa, qz,
                                                full, sLse, sDelta, mask, Sq, BM, scale, softcap)
                            for j in range(BM // 8 if not extras else 0):
                                for e in range(4):
                                    ql = j * 8 + TIG * 2 + (e & 1)
                                    key = key_a + (e >> 1) * 8
                                    l2 = sLse[ql]
                                    with np.errstate(invalid="ignore", over="ignore"):
                                        s = np.where(kbad[ks * 16 + G + 8 * (e >> 1)], np.nan, score(st[j, :, e], scale, softcap))
                                        qc = j * 8 + (e & 1)
                                        vis = (l2 != -np.inf) & bit_of(qvis[e >> 1], qc)
                                        pr = np.where(vis, np.exp2(s * L2E - l2), 0)
                                        grad = 1 - (s * np.float32(1 / softcap)) ** 2 if softcap > 0 else 1
                                        st[j, :, e] = pr
                                        dpt[j, :, e] = np.where(vis, pr * (dpt[j, :, e] - sDelta[ql]) * grad, 0)
                            for kq in range(BM // 16):
                                ap = [pack2(st[2 * kq][:, 0], st[2 * kq][:, 1]), pack2(st[2 * kq][:, 2], st[2 * kq][:, 3]),
                                      pack2(st[2 * kq + 1][:, 0], st[2 * kq + 1][:, 1]), pack2(st[2 * kq + 1][:, 2], st[2 * kq + 1][:, 3])]
                                as_ = [pack2(dpt[2 * kq][:, 0], dpt[2 * kq][:, 1]), pack2(dpt[2 * kq][:, 2], dpt[2 * kq][:, 3]),
                                       pack2(dpt[2 * kq + 1][:, 0], dpt[2 * kq + 1][:, 1]), pack2(dpt[2 * kq + 1][:, 2], dpt[2 * kq + 1][:, 3])]
                                for dt in range(DW // 16):
                                    b_off = at(swq, "kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dpart * DW + dt * 16 + (lane >> 4) * 8", "flash_bwd.cuh", kq=kq, dpart=dpart, DW=DW, dt=dt)
                                    bo, bq = ldmatrix_x4_trans(sdO, b_off), ldmatrix_x4_trans(sQ, b_off)
                                    acc_dv[warp, 2 * dt] = mma(acc_dv[warp, 2 * dt], ap, bo[0], bo[1])
                                    acc_dv[warp, 2 * dt + 1] = mma(acc_dv[warp, 2 * dt + 1], ap, bo[2], bo[3])
                                    acc_dk[warp, 2 * dt] = mma(acc_dk[warp, 2 * dt], as_, bq[0], bq[1])
                                    acc_dk[warp, 2 * dt + 1] = mma(acc_dk[warp, 2 * dt + 1], as_, bq[2], bq[3])
                            if dpart == 0:
                                for j in range(BM // 8):
                                    col = j * 8 + TIG * 2
                                    for r in range(2):
                                        sdS[sws(ks * 16 + G + 8 * r, col)] = rnd(dpt[j, :, 2 * r])
                                        sdS[sws(ks * 16 + G + 8 * r, col + 1)] = rnd(dpt[j, :, 2 * r + 1])
                        # (__syncthreads) dQ += dS K over (row tile, 32-column chunk) items.
                        row_tiles = BM // 16
                        for item in range(row_tiles * (D // 32)):
                            rt, dc = item % row_tiles, item // row_tiles
                            acc = np.zeros((4, 32, 4), np.float32)
                            for kk in range(BN // 16):
                                mi = LANES >> 3
                                a = ldmatrix_x4_trans(sdS, at(sws, "kk * 16 + (lane & 7) + (mi >> 1) * 8, rt * 16 + (mi & 1) * 8", "flash_bwd.cuh", kk=kk, mi=mi, rt=rt))
                                for dt in range(2):
                                    bk = ldmatrix_x4_trans(sK, at(swkv, "kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dc * 32 + dt * 16 + (lane >> 4) * 8", "flash_bwd.cuh", kk=kk, dc=dc, dt=dt))
                                    acc[2 * dt] = mma(acc[2 * dt], a, bk[0], bk[1])
                                    acc[2 * dt + 1] = mma(acc[2 * dt + 1], a, bk[2], bk[3])
                            for r in range(2):
                                row = m0 + rt * 16 + G + r * 8
                                ok = row < Sq
                                dst = dc * 32 + TIG * 2  # the row's column base; then + nt * 8 + (e & 1)
                                for nt in range(4):
                                    for e1 in range(2):
                                        np.add.at(dq_acc[b, :, h, :], (row[ok], (dst + nt * 8 + e1)[ok]), acc[nt, ok, 2 * r + e1])
                for warp in range(NW):
                    ks, dpart = warp // SPLIT, warp % SPLIT
                    key_a = n0 + ks * 16 + G
                    for dt in range(DW // 8):
                        col = dpart * DW + dt * 8 + TIG * 2
                        for r in range(2):
                            key = key_a + 8 * r
                            ok = key < Sk
                            for h2 in range(2):
                                dk[b, key[ok], hk, col[ok] + h2] = rnd(acc_dk[warp, dt, ok, 2 * r + h2] * scale)
                                dv[b, key[ok], hk, col[ok] + h2] = rnd(acc_dv[warp, dt, ok, 2 * r + h2])
    return rnd(dq_acc * scale), dk, dv


# ---------------------------------------------------------------------------------------------


def check_tile_loaders():
    """load_tile_async's strided form (common.cuh: one column per thread, rows stepped by
    kStep, smem and global offsets advanced by constants) writes exactly the chunks of the plain
    loop, each once, at Swz offsets, for every tile shape the kernels load with it."""
    shapes = set()
    for d in (32, 64, 96, 128, 192, 256):
        nw, bm, bn = fwd_traits(d)
        shapes |= {(bm, d, 32 * nw), (bn, d, 32 * nw)}
        nwb, _, bnb, _, _ = bwd_traits(d)
        shapes.add((bnb, d, 32 * nwb))
    for rows, d, nt in sorted(shapes):
        chunks = d // 8
        sw = swz(rows, d)
        want = {(int(sw(r, c * 8)), r, c * 8) for r in range(rows) for c in range(chunks)}
        if nt % chunks or rows % (nt // chunks):
            continue  # the plain loop runs: nothing new to check
        step, w = nt // chunks, (64 if d % 64 == 0 else 32)
        got = []
        for tid in range(nt):
            r0, col = tid // chunks, (tid % chunks) * 8
            dst0 = int(sw(r0, col))
            for i in range(rows // step):
                dst = dst0 + i * step * w if step % 8 == 0 else int(sw(r0 + i * step, col))
                got.append((dst, r0 + i * step, col))
        assert len(got) == len(want) and set(got) == want, f"tile loader ROWS={rows} D={d} NT={nt}"


def check_rows_keys():
    """The O(1) rows_keys gives exactly the row-by-row union, over windows, q_start, kv_len."""
    M = (1 << 63) - 1
    for wl in (-1, 0, 1, 5, 40, M):
        for wr in (-1, 0, 2, 33, M):
            for qs in (-(1 << 31), -50, -7, 0, 9, 60, (1 << 31) - 40):
                for kv in (-2, 0, 1, 17, 64):
                    m = Mask(40, 64, kv, qs, wl, wr)
                    for r0, r1 in ((0, 40), (0, 16), (16, 32), (5, 6), (39, 40), (7, 7)):
                        assert m.rows_keys(r0, r1) == m.rows_keys_loop(r0, r1), (wl, wr, qs, kv, r0, r1)


def check_window_saturation():
    """Windows near i64::MAX: the clamped device mask equals the contract's (unbounded) one, and the
    unclamped one, wrapping, does not: the clamp is what fixes it."""
    M = (1 << 63) - 1
    wrong = False
    for wl, wr in [(M, M), (M, 0), (0, M), (1 << 62, 3), (2, M - 1)]:
        for qs in [-(1 << 31), -3, 0, (1 << 31) - 9]:
            for clamp in (True, False):
                m = Mask(9, 11, 11, qs, wl, wr, clamp)
                ref = Mask(9, 11, 11, qs, -1 if wl >= WINDOW_CAP else wl, -1 if wr >= WINDOW_CAP else wr)
                same = all(m.row_keys(i) == ref.row_keys(i) for i in range(9))
                same &= all(m.keys_rows(n, n + 1) == ref.keys_rows(n, n + 1) for n in range(11))
                same &= all(bool(m.visible(i, j)) == bool(ref.visible(i, j)) for i in range(9) for j in range(11))
                if clamp:
                    assert same, f"clamped window ({wl}, {wr}) q_start {qs} differs from unbounded"
                wrong |= not same
    assert wrong, "the unclamped mask never wrapped: the check has no teeth"


def check_extras(rng):
    """The optional features (key_mask, bias of every dtype and several broadcast patterns, ALiBi,
    dropout, dbias) through both kernels' fragment math against ref_extras (float64), f16 and bf16,
    with GQA, causal/windows, kv_len, q_start, hidden 64-key tiles and fully masked rows."""
    NAN = float("nan")
    # (dtype, B, Sq, Sk, H, Hkv, D, wl, wr, cap, kv_len, q_start, key_mask (b -> list of hidden key
    # ranges), bias (shape, dtype, specials), alibi, dropout rate (or (rate, (b, h, i, j)): the
    # threshold forced onto that entry's draw), dbias[, v poison (b, key, kv head,
    # col, value) at keys no row may see: hidden by key_mask or by a -inf bias column])
    cases = [
        # u8 mask with holes and a hidden 64-key tile, full f32 bias with a -inf entry and NaN on a hidden key, causal
        ("bf16", 2, 40, 200, 2, 1, 64, -1, 0, 0.0, [200, 150], [160, 110], ("u1", {0: [(64, 128), (170, 171)], 1: [(5, 9)]}),
         ("B,H,Sq,Sk", "f32", [((0, 1, 10, 165), -np.inf), ((1, 0, 3, 7), NAN)]), False, 0.0, True,
         [(0, 170, 0, 3, NAN), (1, 6, 0, 0, float("inf"))]),
        # GQA, Sqb = 1 bf16 bias, ALiBi, window, negative q_start, Sqb = 1 dbias summed per key in registers
        ("bf16", 1, 33, 70, 4, 2, 128, 5, 3, 0.0, [66], [-3], None, ("1,H,1,Sk", "bf16", []), True, 0.0, True),
        # Hb = Skb = 1 f16 bias (dbias summed over the warp's keys), dropout, causal, f16 operands
        ("f16", 2, 45, 50, 2, 1, 32, -1, 0, 0.0, [50, 41], [5, 0], None, ("B,1,Sq,1", "f16", []), False, 0.3, True),
        # D = 192 (two warps per key slice: dbias from one), u16 key mask, dropout, Sqb = Skb = 1 f32 bias
        ("bf16", 1, 24, 45, 2, 1, 192, -1, -1, 0.0, [45], [0], ("u2", {0: [(3, 7), (30, 33)]}),
         ("1,1,1,1", "f32", []), False, 0.2, True),
        # D = 256: a batch row whose keys are all hidden (lse = -inf, o = 0), [1,1,Sq,Sk] bias, ALiBi,
        # dropout, softcap; u32 mask
        ("f16", 2, 20, 37, 2, 2, 256, -1, -1, 5.0, [37, 37], [0, 3], ("u4", {1: [(0, 37)], 0: [(10, 12)]}),
         ("1,1,Sq,Sk", "bf16", [((0, 0, 2, 5), -np.inf), ((0, 0, slice(None), 20), -np.inf)]), True, 0.1, True,
         [(0, 20, 1, 7, NAN), (0, 11, 0, 2, -float("inf"))]),
        # D = 96, u64 mask hiding a whole 64-key block in the backward, every key of one query
        # hidden by a -inf bias entry, f16 bias [B,H,Sq,1]
        ("bf16", 1, 30, 140, 2, 1, 96, -1, -1, 0.0, [140], [0], ("u8", {0: [(0, 64)]}),
         ("B,H,Sq,1", "f16", [((0, 1, 4, 0), -np.inf)]), False, 0.0, True),
        # dropout with the threshold forced onto the draw of entry (b, h, i, j) = (1, 1, 37, 45): its
        # upper half ties in both kernels and y decides (kept); GQA, odd Sq/Sk tails, D = 64
        ("f16", 2, 41, 77, 2, 1, 64, -1, -1, 0.0, [77, 70], [0, 0], None, None, False, (0.5, (1, 1, 37, 45)), False),
    ]
    worst = 0.0
    dims_of = {"B": 0, "H": 1, "Sq": 2, "Sk": 3}
    for case in cases:
        (dt, b, sq, sk, h, hkv, d, wl, wr, cap, kv_len, qs, km, bias_spec, alibi, rate, want_dbias) = case[:17]
        poison_v = case[17] if len(case) > 17 else []
        ROUND[0] = bf16 if dt == "bf16" else f16
        q, k, v, do = (rnd(rng.standard_normal(sh, np.float32)) for sh in [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)])
        v_ref = v.copy()  # the reference reads zeros there: no row sees those keys
        for (bb, j, hh, c, val) in poison_v:
            v[bb, j, hh, c], v_ref[bb, j, hh, c] = val, 0
        kv_len, qs = np.array(kv_len, np.int32), np.array(qs, np.int32)
        key_mask = None
        if km is not None:
            key_mask = (rng.integers(1, 200, (b, sk))).astype(np.dtype(km[0]))
            for bb, ranges in km[1].items():
                for lo, hi in ranges:
                    key_mask[bb, lo:hi] = 0
        bias = None
        if bias_spec is not None:
            full = {"B": b, "H": h, "Sq": sq, "Sk": sk}
            shape = tuple(full.get(x, 1) for x in bias_spec[0].split(","))
            bias = rng.standard_normal(shape).astype(np.float32)
            bias = {"f32": lambda x: x, "f16": f16, "bf16": bf16}[bias_spec[1]](bias)
            for idx, val in bias_spec[2]:
                bias[tuple(i if shape[a] > 1 else 0 for a, i in enumerate(idx))] = val
        slopes = (rng.uniform(-0.3, 0.6, h).astype(np.float32)) if alibi else None
        tie_at = None
        if isinstance(rate, tuple):
            rate, tie_at = rate
        drop = (int(rng.integers(0, 2**32)), int(rng.integers(0, 2**32)), rate) if rate > 0 else None
        if tie_at is not None:  # T = draw(entry): its upper half ties with T >> 16 (y path, kept)
            drop += (int(philox_ref.dropout_draw(drop[:2], *tie_at)),)
        ties0 = STATS["dropout_ties"]
        ex = Extras(key_mask=key_mask, bias=bias, alibi=slopes, dropout=drop, dbias=want_dbias)
        scale = 1 / math.sqrt(d)
        ro, rl, rdq, rdk, rdv, rdb = ref_extras(q, k, v_ref, do, kv_len, qs, scale, cap, wl, wr, ex)
        o, lse = flash_fwd(q, k, v, kv_len, qs, scale, cap, wl, wr, ex)
        assert np.isfinite(o).all() and not np.isnan(lse).any(), "NaN/inf in the forward with extras"
        assert np.array_equal(np.isneginf(lse), np.isneginf(rl)), "fully masked rows differ"
        e_o = np.abs(o - ro).max() / np.abs(ro).max()
        fin = np.isfinite(rl)
        e_l = np.abs(lse[fin] - rl[fin]).max(initial=0)
        dq, dk, dv = flash_bwd(q, k, v, kv_len, qs, o, lse, do, scale, cap, wl, wr, ex)
        assert all(np.isfinite(x).all() for x in (dq, dk, dv)), "NaN/inf in the backward with extras"
        errs = [np.abs(gg - r).max() / max(np.abs(r).max(), 1e-2) for gg, r in ((dq, rdq), (dk, rdk), (dv, rdv))]
        if want_dbias:
            db = ex.dbias.reshape(bias.shape)
            assert np.isfinite(db).all(), "NaN in dbias"
            rdb, rdb_mag = rdb
            errs.append(np.abs(db - rdb).max() / max(rdb_mag.max(), 1e-2))
        print(f"extras {dt} D={d:3d} B={b} Sq={sq} Sk={sk} H={h}/{hkv} w=({wl},{wr}) cap={cap} mask={km and km[0]} "
              f"bias={bias_spec and bias_spec[:2]} alibi={alibi} rate={rate}: o {e_o:.1e} lse {e_l:.1e} "
              f"dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}" + (f" dbias {errs[3]:.1e}" if want_dbias else "") +
              (f" v poison at {len(poison_v)} hidden keys" if poison_v else ""), flush=True)
        worst = max(worst, e_o, e_l, *errs)
        if tie_at is not None:  # once per row in the forward, once per step and key slice in the backward
            assert STATS["dropout_ties"] - ties0 >= 2, "the forced tie did not reach the y path"
    ROUND[0] = bf16
    assert STATS["tiles_skipped"] > 0 and STATS["blocks_skipped"] > 0, f"no key_mask tile skip exercised: {STATS}"
    assert STATS["dbias_red"] > 0
    return worst


def check_dropout_vectors():
    """The kernels' transcription of the mask (x's and y's halves, Dropout::keep) agrees with the
    contract's table (test/data/dropout_vectors.txt)."""
    rows = [[int(x, 16) for x in line.split()[1:]] for line in philox_ref.VECTORS.read_text().splitlines()
            if line.split()[:1] == ["draw"]]
    assert rows
    k0s, k1s, bb, hh, ii, jj, val = (np.array(c, np.uint64) for c in zip(*rows))
    octv, w, hf = jj >> np.uint64(3), ((jj >> np.uint64(1)) & np.uint64(3)).astype(np.int64), (jj & np.uint64(1)).astype(np.int64)
    x = philox([octv, ii, hh, bb], k0s, k1s)
    y = philox([octv + np.uint64(1 << 31), ii, hh, bb], k0s, k1s)
    sh = np.uint64(16) * hf.astype(np.uint64)
    draw = (((philox_word(x, w) >> sh) & np.uint64(0xFFFF)) << np.uint64(16)) | ((philox_word(y, w) >> sh) & np.uint64(0xFFFF))
    bad = np.flatnonzero(draw != val)
    assert bad.size == 0, f"draw differs from the table at {[rows[i] for i in bad[:3]]}"
    # Dropout::keep at thresholds on the draws: the upper halves tie and y decides.
    for thr, want in ((val, np.ones(val.shape, bool)), (val + np.uint64(1), np.zeros(val.shape, bool)),
                      (val & np.uint64(0xFFFF0000), np.ones(val.shape, bool)), (val | np.uint64(0xFFFF), (val & np.uint64(0xFFFF)) == np.uint64(0xFFFF))):
        ok = thr <= np.uint64(U32)
        got = entry_keep((k0s, k1s, np.minimum(thr, np.uint64(U32))), bb, hh, ii, jj)
        assert np.array_equal(got[ok], want[ok]), "Dropout::keep on a tied threshold differs from the table"


def main():
    import exla_rs_jax as ex

    np.seterr(over="ignore", invalid="ignore")  # wrapped i64 sums and NaN poison are intended here
    check_window_saturation()
    check_tile_loaders()
    check_rows_keys()
    check_transpose4()
    check_dropout_vectors()
    check_dropout_fragments()
    rng = np.random.default_rng(1)
    worst_extras = check_extras(np.random.default_rng(7))
    M = (1 << 63) - 1
    # (B, Sq, Sk, H, Hkv, D, wl, wr, softcap, kv_len, q_start[, poison]): every head dim, ragged
    # tiles, GQA, windows, softcap, padded and fully masked batch rows, negative q_start, windows
    # near i64::MAX, and poison: inf/NaN written into k/v elements (b, key, kv head, col) or whole
    # q/do rows (b, query), which must reach no output of a row that does not see them.
    NAN, INF = float("nan"), float("inf")
    cases = [
        (1, 70, 90, 2, 1, 32, -1, 0, 0.0, [90], [20]),
        (2, 40, 75, 2, 2, 64, -1, -1, 0.0, [0, 60], [35, 35]),
        (1, 50, 50, 2, 2, 96, 7, 0, 10.0, [50], [0]),
        (1, 33, 40, 4, 2, 128, 5, 3, 0.0, [37], [-3]),
        (1, 20, 45, 2, 1, 192, -1, 0, 0.0, [45], [25]),
        (1, 24, 37, 1, 1, 256, -1, -1, 4.0, [30], [13]),
        # windows near i64::MAX (unbounded in effect), with extreme q_start
        (2, 40, 50, 2, 1, 64, M, M, 0.0, [50, 33], [-(1 << 31), 5]),
        (2, 30, 40, 2, 2, 32, M, 0, 0.0, [40, 40], [10, (1 << 31) - 40]),
        (1, 30, 40, 2, 1, 32, 3, M - 1, 0.0, [40], [-5]),
        # non-finite keys/values that some rows of a straddling tile must not see
        (1, 80, 80, 2, 1, 64, 7, 0, 0.0, [80], [0],
         dict(k=[(0, 3, 0, 5, INF)], v=[(0, 5, 0, 3, NAN), (0, 60, 0, 10, -INF), (0, 79, 0, 0, INF)])),
        (1, 40, 70, 2, 2, 128, -1, 0, 3.0, [70], [30],
         dict(k=[(0, 65, 1, 0, NAN), (0, 35, 0, 7, -INF)], v=[(0, 66, 0, 1, INF), (0, 40, 1, 9, NAN)])),
        # NaN q and do on fully masked rows (q_start < 0 under causal; a batch entry with kv_len 0)
        (2, 40, 30, 2, 1, 128, -1, 0, 0.0, [30, 0], [-10, 0],
         dict(q=[(0, i) for i in range(10)] + [(1, i) for i in range(40)], do=[(0, i) for i in range(10)] + [(1, 3)])),
        (1, 36, 40, 2, 1, 256, 4, 0, 0.0, [40], [-6], dict(do=[(0, 0), (0, 5)], q=[(0, 1)], v=[(0, 39, 0, 2, NAN)])),
    ]
    worst = 0.0
    for case in cases:
        (b, sq, sk, h, hkv, d, wl, wr, cap, kv_len, qs), poison = case[:11], (case[11] if len(case) > 11 else {})
        q, k, v, do = (bf16(rng.standard_normal(s, np.float32)) for s in [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)])
        kv_len, qs = np.array(kv_len, np.int32), np.array(qs, np.int32)
        scale = 1 / math.sqrt(d)
        rwl, rwr = (-1 if w >= WINDOW_CAP else w for w in (wl, wr))  # what the reference can take
        ref_in = [x.copy() for x in (q, k, v, do)]  # poison-free (zeros): equal where no row sees it
        for (bb, j, hh, c, val) in poison.get("k", []):
            k[bb, j, hh, c] = val
        for (bb, j, hh, c, val) in poison.get("v", []):
            v[bb, j, hh, c] = val
        for (bb, i) in poison.get("q", []):
            q[bb, i] = NAN
        for (bb, i) in poison.get("do", []):
            do[bb, i] = NAN
        for x, r in zip((q, k, v, do), ref_in):
            r[~np.isfinite(x)] = 0
        # Rows that see a poisoned k/v key ("dirty") may be non-finite; everything else must match.
        vis = ex.visible_mask(b, sq, sk, kv_len, qs, rwl, rwr)  # [B, Sq, Sk]
        bad_key = ~np.isfinite(k).all(-1) | ~np.isfinite(v).all(-1)  # [B, Sk, Hkv]
        g = h // hkv
        dirty = np.einsum("bij,bjh->bhi", vis.astype(np.int64), bad_key.astype(np.int64)).repeat(g, 1) > 0  # [B, H, Sq]
        clean_row = ~dirty.transpose(0, 2, 1)[..., None]  # [B, Sq, H, 1]
        seen_by_dirty = np.einsum("bij,bhi->bjh", vis.astype(np.int64), dirty.reshape(b, hkv, g, sq).any(2).astype(np.int64)) > 0
        clean_key = ~seen_by_dirty[..., None]  # [B, Sk, Hkv, 1]

        o, lse = flash_fwd(q, k, v, kv_len, qs, scale, cap, wl, wr)
        ref_o, ref_lse = ex.reference_fwd(*ref_in[:3], kv_len, qs, scale=scale, softcap=cap, window_left=rwl, window_right=rwr)
        co = np.broadcast_to(clean_row, o.shape)
        assert np.isfinite(o[co]).all() and not np.isnan(lse[~dirty]).any(), "NaN/inf or unwritten forward output on a clean row"
        e_o = np.abs(o[co] - ref_o[co]).max() / np.abs(ref_o[co]).max()
        fin = np.isfinite(ref_lse) & ~dirty
        assert np.array_equal(np.isneginf(lse[~dirty]), ~np.isfinite(ref_lse[~dirty]))
        e_l = np.abs(lse[fin] - ref_lse[fin]).max(initial=0)
        dq, dk, dv = flash_bwd(q, k, v, kv_len, qs, o, lse, do, scale, cap, wl, wr)
        cq, ck = np.broadcast_to(clean_row, dq.shape), np.broadcast_to(clean_key, dk.shape)
        assert np.isfinite(dq[cq]).all() and np.isfinite(dk[ck]).all() and np.isfinite(dv[ck]).all(), \
            "NaN/inf or unwritten backward output on a clean row/key"
        refs = ex.reference_bwd(*ref_in[:3], kv_len, qs, ref_in[3], scale=scale, softcap=cap, window_left=rwl, window_right=rwr)
        errs = [np.abs(gg[c] - r[c]).max(initial=0) / max(np.abs(r[c]).max(initial=0), 1e-2) for gg, r, c in zip((dq, dk, dv), refs, (cq, ck, ck))]
        tag = f" poison {sorted(poison)} dirty rows {int(dirty.sum())}" if poison else ""
        print(f"D={d:3d} B={b} Sq={sq} Sk={sk} H={h}/{hkv} w=({wl},{wr}) cap={cap}: o {e_o:.1e} lse {e_l:.1e} "
              f"dq {errs[0]:.1e} dk {errs[1]:.1e} dv {errs[2]:.1e}{tag}", flush=True)
        worst = max(worst, e_o, e_l, *errs)
    check_sources()
    worst = max(worst, worst_extras)
    assert worst < 3e-2, f"worst relative error {worst:.2e} exceeds the bf16 bar 3e-2"
    print(f"ok: worst {worst:.1e} (bf16 bar 3e-2)")


if __name__ == "__main__":
    main()
