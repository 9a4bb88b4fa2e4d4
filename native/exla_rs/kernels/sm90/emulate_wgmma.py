#!/usr/bin/env python3
"""Emulates the sm90 forward (flash_fwd_sm90.cuh) on the CPU, lane by lane, against float64.

What is modelled from the PTX ISA, with index functions written as in the kernel and hopper.cuh:
- the TMA box layout with SWIZZLE_128B (64-element, 128-byte rows; 16-byte chunks XOR the row
  mod 8) and zero fill outside the tensor, into the kernel's shared-memory offsets;
- the shared-memory matrix descriptors (start >> 4, LBO, SBO, 128-byte swizzle), decoded the way
  the tensor core reads them: K-major (Q, K: k-steps of 32 bytes inside a swizzled row, column
  blocks every 4 k-steps) and MN-major for V (transposed B: LBO between 64-column blocks, SBO
  between 8-key groups);
- the wgmma m64nNk16 accumulator fragment (warp w: rows 16w + lane/4 (+8), columns
  8 * (e / 4) + 2 * (lane % 4) + e % 2) and the RS register A fragment re-packed from it;
- the persistent heaviest-first tile order, masks on straddling tiles only, online softmax in the
  exp2 domain with the quad shuffles, the producer zeroing V rows past kv_len, the epilogue.
Run: python3 kernels/sm90/emulate_wgmma.py (about a minute; exits non-zero on any mismatch)."""
import itertools
import sys

import numpy as np

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
ROW_BYTES, ATOM_BYTES = 128, 1024


def traits(d):
    bn = 128 if d <= 128 else 64
    stages = 3 if d <= 64 else 2
    return dict(D=d, BM=128, BN=bn, stages=stages, cols=d // 64, q_bytes=128 * d * 2, kv_bytes=bn * d * 2)


# ---------------------------------------------------------------- rounding to the input type
def round_bf16(x):
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    out = u.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), x, out)


def round_type(x, dt):
    return round_bf16(x) if dt == "bf16" else np.asarray(x, np.float32).astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------- swizzle, TMA, descriptors
def swizzle128(addr):
    """SWIZZLE_128B on a byte address: chunk bits [4:6] ^= row bits [7:9] (1024-byte atoms)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def tma_box(smem, dst, tensor, c0, row0, box_rows):
    """One box of 64 columns x box_rows rows of tensor[rows, D] (one head of one batch row) at
    smem byte offset dst; rows/columns outside the tensor arrive as zeros."""
    rows, d = tensor.shape
    for r in range(box_rows):
        for c in range(64):
            gr, gc = row0 + r, c0 + c
            v = tensor[gr, gc] if gr < rows and gc < d else np.float32(0)
            a = swizzle128(dst + r * ROW_BYTES + c * 2)
            smem[a // 2] = v  # smem modelled as an array of 16-bit slots holding the value


def smem_desc(addr, lbo, sbo):  # hopper.cuh smem_desc
    d = ((addr & 0x3FFFF) >> 4)
    d |= ((lbo & 0x3FFFF) >> 4) << 16
    d |= ((sbo & 0x3FFFF) >> 4) << 32
    d |= 1 << 62
    return d


def desc_fields(desc):
    assert desc >> 62 == 1, "128-byte swizzle"
    assert (desc >> 49) & 7 == 0, "base offset"
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4


def read_kmajor(smem, desc, rows):
    """A (rows=64) or B (rows=N) K-major operand of one k16 step: element (m, k) at start +
    (m // 8) * SBO + (m % 8) * 128 + 2k, swizzled. LBO is unused for swizzled K-major."""
    start, _, sbo = desc_fields(desc)
    out = np.zeros((rows, 16), np.float32)
    for m in range(rows):
        for k in range(16):
            out[m, k] = smem[swizzle128(start + (m // 8) * sbo + (m % 8) * ROW_BYTES + 2 * k) // 2]
    return out


def read_mnmajor(smem, desc, n):
    """Transposed B (V): element (k, n) at start + (n // 64) * LBO + (k // 8) * SBO + (k % 8) * 128
    + 2 (n % 64), swizzled: 64 contiguous head-dim elements per 128-byte row, a row per key."""
    start, lbo, sbo = desc_fields(desc)
    out = np.zeros((16, n), np.float32)
    for k in range(16):
        for j in range(n):
            out[k, j] = smem[swizzle128(start + (j // 64) * lbo + (k // 8) * sbo + (k % 8) * ROW_BYTES + 2 * (j % 64)) // 2]
    return out


# kernel: kmajor_kstep_offset, v_kstep_offset
def kmajor_kstep_offset(kk, rows_in_block):
    return (kk // 4) * rows_in_block * ROW_BYTES + (kk % 4) * 32


def v_desc(t, v_stage_addr, kk):
    return smem_desc(v_stage_addr + kk * 16 * ROW_BYTES, t["BN"] * ROW_BYTES, ATOM_BYTES)


# ---------------------------------------------------------------- fragments
def acc_row_col(tid, e):
    warp, lane = tid // 32, tid % 32
    return 16 * warp + lane // 4 + 8 * ((e // 2) % 2), 8 * (e // 4) + 2 * (lane % 4) + e % 2


def to_acc(mat, n):
    """A 64 x n product as 128 threads' accumulator registers."""
    acc = np.zeros((128, n // 2), np.float32)
    for tid in range(128):
        for e in range(n // 2):
            r, c = acc_row_col(tid, e)
            acc[tid, e] = mat[r, c]
    return acc


def a_frag_matrix(pf, kk):
    """The RS A operand (64 x 16) that the four registers per thread of k-step kk hold: register j
    is rows lane/4 + 8 (j % 2), columns 2 (lane % 4) + 8 (j / 2) + {0, 1}."""
    a = np.zeros((64, 16), np.float32)
    for tid in range(128):
        warp, lane = tid // 32, tid % 32
        for j in range(4):
            r = 16 * warp + lane // 4 + 8 * (j % 2)
            c = 2 * (lane % 4) + 8 * (j // 2)
            a[r, c], a[r, c + 1] = pf[tid, kk, j]
    return a


def quad_reduce(x, op):
    q = x.reshape(32, 4)
    return np.repeat(op(q, axis=1), 4)


# ---------------------------------------------------------------- the kernel, one CTA's tiles
def key_lo(pos, wl, kv):
    return 0 if wl < 0 else int(min(max(pos - wl, 0), kv))


def key_hi(pos, wr, kv):
    return kv if wr < 0 else int(min(max(pos + wr + 1, 0), kv))


def work_tile(t, m_blocks, heads, batch):
    hb = heads * batch
    rest = t % hb
    return m_blocks - 1 - t // hb, rest % heads, rest // heads


def run_kernel(dt, q, k, v, kv_len, q_start, scale, softcap, wl, wr, grid):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    t = traits(D)
    BM, BN = t["BM"], t["BN"]
    o = np.full(q.shape, np.nan, np.float32)
    lse = np.full((B, H, Sq), np.nan, np.float32)
    m_blocks = -(-Sq // BM)
    tiles = m_blocks * H * B
    seen = set()
    k_off = t["q_bytes"]
    v_off = k_off + t["stages"] * t["kv_bytes"]
    smem = np.zeros((v_off + t["stages"] * t["kv_bytes"]) // 2, np.float32)
    kv_iter = 0
    for cta in range(grid):
        for tile in range(cta, tiles, grid):
            mb, h, b = work_tile(tile, m_blocks, H, B)
            assert (mb, h, b) not in seen
            seen.add((mb, h, b))
            m0 = mb * BM
            kv = max(0, min(int(kv_len[b]), Sk))
            pos0 = int(q_start[b]) + m0
            valid = min(BM, Sq - m0)
            lo, hi = key_lo(pos0, wl, kv), key_hi(pos0 + valid - 1, wr, kv)
            first, count = (lo // BN, -(-hi // BN) - lo // BN) if hi > lo else (0, 0)
            kvh = h // (H // Hkv)
            if count:
                for c in range(t["cols"]):
                    tma_box(smem, c * BM * ROW_BYTES, q[b, :, h, :], c * 64, m0, BM)
            outs = []
            for consumer in range(2):
                outs.append(Consumer(t, dt, consumer, m0, valid, pos0, wl, wr, kv, scale, softcap))
            for i in range(count):
                n0 = (first + count - 1 - i) * BN
                stage = kv_iter % t["stages"]
                kd, vd = k_off + stage * t["kv_bytes"], v_off + stage * t["kv_bytes"]
                for c in range(t["cols"]):
                    tma_box(smem, kd + c * BN * ROW_BYTES, k[b, :, kvh, :], c * 64, n0, BN)
                    tma_box(smem, vd + c * BN * ROW_BYTES, v[b, :, kvh, :], c * 64, n0, BN)
                pad_from = kv - n0
                if pad_from < BN and kv < Sk:  # producer: zero whole 128-byte rows past kv_len
                    for c in range(t["cols"]):
                        base = vd + c * BN * ROW_BYTES
                        smem[(base + max(pad_from, 0) * ROW_BYTES) // 2:(base + BN * ROW_BYTES) // 2] = 0
                for cons in outs:
                    cons.step(smem, i, n0, kd, vd)
                kv_iter += 1
            for cons in outs:
                cons.tail(smem)
                finish_consumer(cons, o, lse, b, h)
    assert len(seen) == tiles
    return o, lse


class Consumer:
    def __init__(self, t, dt, consumer, m0, valid, pos0, wl, wr, kv, scale, softcap):
        self.t, self.dt, self.c, self.m0, self.valid = t, dt, consumer, m0, valid
        D, BN = t["D"], t["BN"]
        tid = np.arange(128)
        self.row = consumer * 64 + (tid // 32) * 16 + (tid % 32) // 4  # row_in_tile, and + 8
        r = [np.minimum(self.row, valid - 1), np.minimum(self.row + 8, valid - 1)]
        self.lo = [np.array([key_lo(pos0 + x, wl, kv) for x in rr]) for rr in r]
        self.hi = [np.array([key_hi(pos0 + x, wr, kv) for x in rr]) for rr in r]
        wg_first = min(consumer * 64, valid - 1)
        wg_last = min(consumer * 64 + 63, valid - 1)
        self.wg_lo_max, self.wg_hi_min = key_lo(pos0 + wg_last, wl, kv), key_hi(pos0 + wg_first, wr, kv)
        self.o = np.zeros((128, D // 2), np.float32)
        self.m = [np.full(128, -np.inf, np.float32) for _ in range(2)]
        self.l = [np.zeros(128, np.float32) for _ in range(2)]
        self.pf = None
        self.prev_v = None
        self.scale_log2 = np.float32(scale * LOG2E)
        self.softcap = softcap
        self.cap_in = np.float32(scale * (1.0 / softcap if softcap > 0 else 0.0))
        self.cap_out = np.float32(softcap * LOG2E)

    def pv(self, smem, vd):
        t = self.t
        prod = np.zeros((64, t["D"]), np.float32)
        for kk in range(t["BN"] // 16):
            prod += a_frag_matrix(self.pf, kk) @ read_mnmajor(smem, v_desc(t, vd, kk), t["D"])
        self.o += to_acc(prod, t["D"])

    def step(self, smem, i, n0, kd, vd):
        t = self.t
        D, BN = t["D"], t["BN"]
        q_addr = self.c * 64 * ROW_BYTES
        s_mat = np.zeros((64, BN), np.float32)
        for kk in range(D // 16):
            da = smem_desc(q_addr + kmajor_kstep_offset(kk, t["BM"]), 16, ATOM_BYTES)
            db = smem_desc(kd + kmajor_kstep_offset(kk, BN), 16, ATOM_BYTES)
            with np.errstate(invalid="ignore"):
                s_mat += read_kmajor(smem, da, 64) @ read_kmajor(smem, db, BN).T
        if i > 0:  # the previous tile's P V, issued in the same turn
            self.pv(smem, self.prev_v)
        s = to_acc(s_mat, BN)
        if self.softcap > 0:
            s = np.tanh(s * self.cap_in).astype(np.float32) * self.cap_out
        else:
            s = s * self.scale_log2
        if not (n0 >= self.wg_lo_max and n0 + BN <= self.wg_hi_min):
            for e in range(BN // 2):
                col = (e // 4) * 8 + 2 * (np.arange(128) % 4) + e % 2
                up = (e // 2) % 2
                a, b = self.lo[up] - n0, self.hi[up] - n0
                s[:, e] = np.where((col < a) | (col >= b), -np.inf, s[:, e])
        corr = [None, None]
        for h in range(2):
            cols = [e for e in range(BN // 2) if (e // 2) % 2 == h]
            mx = np.maximum(self.m[h], s[:, cols].max(axis=1))
            mx = quad_reduce(mx, np.max)
            use = np.where(mx == -np.inf, 0, mx).astype(np.float32)
            corr[h] = np.exp2(self.m[h] - use).astype(np.float32)
            self.m[h] = mx
            s[:, cols] = np.exp2(s[:, cols] - use[:, None])
            self.l[h] = self.l[h] * corr[h] + s[:, cols].sum(axis=1)
        for e in range(D // 2):
            self.o[:, e] *= corr[(e // 2) % 2]
        pr = round_type(s, self.dt)
        self.pf = np.zeros((128, BN // 16, 4, 2), np.float32)
        for kk in range(BN // 16):
            for j in range(4):
                self.pf[:, kk, j, 0], self.pf[:, kk, j, 1] = pr[:, 8 * kk + 2 * j], pr[:, 8 * kk + 2 * j + 1]
        self.prev_v = vd

    # The last tile's P V, issued alone in a final turn.
    def tail(self, smem):
        if self.pf is not None:
            self.pv(smem, self.prev_v)
            self.pf = None


def finish_consumer(cons, o, lse, b, h):
    D = cons.t["D"]
    for hh in range(2):
        l = quad_reduce(cons.l[hh], np.sum)
        m = np.where(cons.m[hh] == -np.inf, 0, cons.m[hh])
        inv = np.where(l > 0, 1 / np.where(l > 0, l, 1), 0)
        ls = np.where(l > 0, (m + np.log2(np.where(l > 0, l, 1))) * LN2, -np.inf)
        for tid in range(128):
            row = cons.row[tid] + 8 * hh
            if row >= cons.valid:
                continue
            i = cons.m0 + row
            for g in range(D // 8):
                col = 8 * g + 2 * (tid % 4)
                vals = cons.o[tid, [4 * g + 2 * hh, 4 * g + 2 * hh + 1]] * inv[tid]
                o[b, i, h, col:col + 2] = round_type(vals, cons.dt)
            if tid % 4 == 0:
                lse[b, h, i] = ls[tid]




# ---------------------------------------------------------------- float64 reference (the contract)
def reference(q, k, v, kv_len, q_start, scale, softcap, wl, wr):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    o = np.zeros(q.shape)
    lse = np.full((B, H, Sq), -np.inf)
    for b, h in itertools.product(range(B), range(H)):
        kh = h // (H // Hkv)
        x = scale * (q[b, :, h].astype(np.float64) @ np.nan_to_num(k[b, :, kh].astype(np.float64)).T)
        s = softcap * np.tanh(x / softcap) if softcap > 0 else x
        pos = q_start[b] + np.arange(Sq)[:, None]
        j = np.arange(Sk)[None, :]
        vis = (j < kv_len[b]) & ((wl < 0) | (j >= pos - wl)) & ((wr < 0) | (j <= pos + wr))
        s = np.where(vis, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0)
        p = np.exp(s - m)
        l = p.sum(axis=1, keepdims=True)
        vv = np.where(vis.any(axis=0)[:, None], v[b, :, kh].astype(np.float64), 0)
        o[b, :, h] = np.where(l > 0, (p @ np.nan_to_num(vv)) / np.where(l > 0, l, 1), 0)
        lse[b, h] = np.where(l[:, 0] > 0, m[:, 0] + np.log(np.where(l[:, 0] > 0, l[:, 0], 1)), -np.inf)
    return o, lse


def case(name, dt, d, B, Sq, Sk, H, Hkv, kv_len, q_start, softcap=0.0, wl=-1, wr=-1, grid=3, seed=0):
    rng = np.random.default_rng(seed)
    q = round_type(rng.standard_normal((B, Sq, H, d)), dt)
    k = round_type(rng.standard_normal((B, Sk, Hkv, d)), dt)
    v = round_type(rng.standard_normal((B, Sk, Hkv, d)), dt)
    for b in range(B):  # padding past kv_len may hold anything: NaN must not leak
        k[b, kv_len[b]:] = np.nan
        v[b, kv_len[b]:] = np.nan
    scale = 1 / np.sqrt(d)
    o, lse = run_kernel(dt, q, k, v, kv_len, q_start, scale, softcap, wl, wr, grid)
    ro, rl = reference(q, k, v, kv_len, q_start, scale, softcap, wl, wr)
    tol = 3e-2 if dt == "bf16" else 4e-3
    ok = np.isfinite(o).all() and np.allclose(o, ro, atol=tol, rtol=tol)
    ok &= np.array_equal(np.isneginf(lse), np.isneginf(rl))
    fin = np.isfinite(rl)
    ok &= np.allclose(lse[fin], rl[fin], atol=2e-3, rtol=1e-4)
    err = np.abs(o - ro).max()
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {dt} d{d} B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv} max|o-ref| {err:.2e}, "
          f"{int((~fin).sum())} fully masked rows")
    return ok


def self_checks():
    # The accumulator layout covers the 64 x N tile exactly once; the A fragment re-pack of an
    # accumulator is the same matrix (this is what lets P stay in registers).
    for n in (64, 128, 256):
        hits = np.zeros((64, n), int)
        for tid in range(128):
            for e in range(n // 2):
                r, c = acc_row_col(tid, e)
                hits[r, c] += 1
        assert (hits == 1).all(), n
    m = np.arange(64 * 128, dtype=np.float32).reshape(64, 128)
    acc = to_acc(m, 128)
    pf = np.zeros((128, 8, 4, 2), np.float32)
    for kk in range(8):
        for j in range(4):
            pf[:, kk, j, 0], pf[:, kk, j, 1] = acc[:, 8 * kk + 2 * j], acc[:, 8 * kk + 2 * j + 1]
    for kk in range(8):
        assert (a_frag_matrix(pf, kk) == m[:, 16 * kk:16 * kk + 16]).all()
    # Descriptor round trip and TMA/descriptor agreement on a swizzled tile.
    d = smem_desc(0x1A400 + 96, 16384, 1024)
    assert desc_fields(d) == (0x1A400 + 96, 16384, 1024)
    smem = np.zeros(64 * 1024, np.float32)
    tile = np.arange(128 * 128, dtype=np.float32).reshape(128, 128)
    for c in range(2):
        tma_box(smem, 8192 + c * 128 * ROW_BYTES, tile, c * 64, 0, 128)
    for kk in range(8):
        got = read_kmajor(smem, smem_desc(8192 + kmajor_kstep_offset(kk, 128), 16, 1024), 128)
        assert (got == tile[:, 16 * kk:16 * kk + 16]).all(), kk
    t = traits(128)
    for kk in range(t["BN"] // 16):
        got = read_mnmajor(smem, v_desc(t, 8192, kk), 128)
        assert (got == tile[16 * kk:16 * kk + 16, :]).all(), kk
    print("ok   fragment layouts, descriptors, TMA swizzle")


def main():
    self_checks()
    ok = True
    ok &= case("causal, kv_len padding (NaN), q_start", "bf16", 64, 2, 150, 300, 2, 1, [300, 211], [150, 0], wr=0)
    ok &= case("sliding window + kv_len, GQA", "f16", 128, 1, 200, 260, 4, 2, [245], [60], wl=70, wr=5)
    ok &= case("softcap, unmasked", "bf16", 128, 1, 130, 140, 2, 2, [140], [0], softcap=20.0)
    ok &= case("d256, causal, fully masked rows", "bf16", 256, 1, 140, 90, 2, 1, [70], [-100], wr=0, grid=2)
    ok &= case("d256 f16, window right only", "f16", 256, 1, 64, 200, 1, 1, [200], [10], wl=-1, wr=30, grid=1)
    ok &= case("d64 MQA, no keys at all (kv_len 0)", "f16", 64, 2, 40, 70, 3, 1, [0, 70], [0, 0])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
