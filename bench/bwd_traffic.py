#!/usr/bin/env python3
"""Global-memory traffic of the f16/bf16 backward, counted by the GPU-on-CPU executor (issue 33,
part 2): bytes each kernel reads, writes and adds atomically, against what the FA2 schedule moves
with our tiling (flash_bwd.cuh BwdTraits: a CTA = kBlockN keys of one kv head, a step = kBlockM
query rows of one query head of the group):

- bwd_pre: reads O and dO once, writes delta (f32 per row) and zeroes the f32 dQ accumulator.
- bwd main: reads K and V once per key block (keys past kv_len are zero-filled, not read); per
  visible (query block, key block) pair reads Q, dO (rows < Sq) and lse, delta (f32 per row) once
  and adds dQ (f32) once; writes dK, dV once.
- bwd_convert: reads the f32 dQ accumulator once, writes dQ.

"Visible pairs" are the steps the kernel sweeps: per key block, the query tiles of every head of
the GQA group from the tile holding its first visible row to the last (a causal call sweeps about
half). Beside the model, the main kernel reads scalars per thread that the executor counts per
load instruction (on a GPU a warp's identical loads are one L1 broadcast): kv_len[b] and
q_start[b] (8 bytes per thread, Mask::make), and the lse of a row once per 16-byte Q/dO chunk that
a thread loads (the skip test for rows with lse = -inf: D / 8 loads of 4 bytes per row and step).
They are subtracted in the "main read - scalars" column, which should equal the model exactly.

The last columns give the FA2 reference: the Q/dO/lse/delta reads and dQ atomics FA2's own
sm80 tiles would move for the same call (flash_bwd_launch_template.h: kBlockN = 128 keys for
D = 64 and 128, 64 for D = 256), i.e. how much the size of our key block costs.

Runs the CUDA handlers on the executor's statistics build (scripts/gpu_on_cpu.sh stats builds it)
through jax's cpu device; o and lse come from a float64 reference (only lse = -inf rows change the
traffic, and there are none here).

    EXLA_RS_XLA_LIB=native/exla_rs/target/gpu_on_cpu_stats/gpusim/libexla_rs_xla.so \\
        .venv/jax-0.10.2/bin/python bench/bwd_traffic.py [--markdown]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test" / "xla"))
os.environ.setdefault("EXLA_RS_XLA_LIB", str(ROOT / "native/exla_rs/target/gpu_on_cpu_stats/gpusim/libexla_rs_xla.so"))
os.environ["EXLA_RS_CUDA_PATH"] = "mma"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import exla_rs_jax as ex  # noqa: E402

# (name, B, S, H, Hkv, D, causal): several query and key blocks at every head dim (S = 512: 8 key
# blocks of 64 at D <= 128, 16 of 32 at D = 256), GQA, and a ragged length (not a tile multiple).
SHAPES = [
    ("d64", 1, 512, 4, 4, 64, False),
    ("d64 causal", 1, 512, 4, 4, 64, True),
    ("d128", 1, 512, 4, 4, 128, False),
    ("d128 causal", 1, 512, 4, 4, 128, True),
    ("d128 gqa4/2 causal", 1, 512, 4, 2, 128, True),
    ("d128 S=500 causal", 1, 500, 4, 4, 128, True),
    ("d256", 1, 512, 4, 4, 256, False),
    ("d256 causal", 1, 512, 4, 4, 256, True),
    ("d256 gqa4/2 causal", 1, 512, 4, 2, 256, True),
]
DTYPES = {"bf16": jnp.bfloat16, "f16": np.float16}
# FA2's sm80 backward tiles (kBlockM, kBlockN), flash_bwd_launch_template.h.
FA2_TILES = {64: (128, 128), 128: (64, 128), 256: (64, 64)}


def bwd_traits(d):
    """(warps, kBlockM, kBlockN): BwdTraits in kernels/flash_bwd.cuh (config.rs bwd_tc_traits)."""
    warps = 8 if d in (64, 128) else (4 if d <= 192 else 8)
    split = 1 if d <= 128 else (2 if d <= 192 else 4)
    return warps, (64 if d <= 96 else 32), 16 * warps // split


def model(b, s, h, hkv, d, causal, bm, bn, e=2):
    """Bytes the FA2 schedule moves with tiles (bm, bn): Sq = Sk = s, q_start = 0."""
    group = h // hkv
    kv = qdo = lsed = dq = pairs = ctas = 0
    for n0 in range(0, s, bn):
        q_lo = n0 if causal else 0  # first row that sees a key of the block (causal: q_start = 0)
        m_first = q_lo // bm * bm
        rows = sum(min(bm, s - m0) for m0 in range(m_first, s, bm))
        tiles = len(range(m_first, s, bm))
        per = b * hkv
        ctas += per
        kv += per * 2 * min(bn, s - n0) * d * e
        pairs += per * group * tiles
        qdo += per * group * rows * 2 * d * e
        lsed += per * group * rows * 8
        dq += per * group * rows * d * 4
    return dict(kv=kv, qdo=qdo, lsed=lsed, dq=dq, pairs=pairs, ctas=ctas)


def run(shape, dtype):
    name, b, s, h, hkv, d, causal = shape
    rng = np.random.default_rng(0)
    f = lambda shp: rng.standard_normal(shp).astype(np.float32).astype(DTYPES[dtype])
    q, k, v, do = f((b, s, h, d)), f((b, s, hkv, d)), f((b, s, hkv, d)), f((b, s, h, d))
    scale = d**-0.5
    # o and lse from a float64 reference.
    qf = q.astype(np.float64).transpose(0, 2, 1, 3)
    kf = np.repeat(k.astype(np.float64).transpose(0, 2, 1, 3), h // hkv, axis=1)
    vf = np.repeat(v.astype(np.float64).transpose(0, 2, 1, 3), h // hkv, axis=1)
    sc = qf @ kf.transpose(0, 1, 3, 2) * scale
    if causal:
        sc = np.where(np.tril(np.ones((s, s), bool)), sc, -np.inf)
    mx = sc.max(-1, keepdims=True)
    p = np.exp(sc - mx)
    l = p.sum(-1, keepdims=True)
    lse = (mx + np.log(l))[..., 0].astype(np.float32)  # [B, H, Sq]
    o = (p / l @ vf).transpose(0, 2, 1, 3).astype(q.dtype)
    kv_len = np.full((b,), s, np.int32)
    q_start = np.zeros((b,), np.int32)
    dev = jax.devices("cpu")[0]
    args = [jax.device_put(x, dev) for x in (q, k, v, kv_len, q_start, o, lse, do)]
    ex.gpusim_stats_reset()
    res = ex.flash_attn_bwd(*args, scale=scale, window_left=-1, window_right=0 if causal else -1, platform="cuda-on-cpu")
    jax.block_until_ready(res)
    return ex.gpusim_traffic(), ex.gpusim_launch_counts()


def pick(traffic, part):
    names = [n for n in traffic if part in n]
    if len(names) != 1:
        raise SystemExit(f"expected one kernel matching {part!r} in {sorted(traffic)}")
    return traffic[names[0]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--dtypes", default="bf16,f16", help="comma-separated: bf16, f16 (the tensor-core kernels)")
    ap.add_argument("--only", default="", help="run only the shapes whose name contains this")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every kernel's bytes equal the model (main read after the per-thread scalars)")
    a = ap.parse_args()
    rows = []
    for dtype in a.dtypes.split(","):
        for shape in SHAPES:
            if a.only and a.only not in shape[0]:
                continue
            if dtype == "f16" and shape[0] not in ("d128 causal",):
                continue  # same kernels as bf16 but for the element type: one f16 row shows it
            traffic, launches = run(shape, dtype)
            if not traffic:
                raise SystemExit("no traffic counted: EXLA_RS_XLA_LIB must be the statistics build (scripts/gpu_on_cpu.sh stats)")
            print(f"# {dtype} {shape[0]}: {traffic} {launches}", file=sys.stderr)
            _, b, s, h, hkv, d, causal = shape
            warps, bm, bn = bwd_traits(d)
            m = model(b, s, h, hkv, d, causal, bm, bn)
            fa2 = model(b, s, h, hkv, d, causal, *FA2_TILES[d])
            qd = b * s * h * d  # elements of q / o / do / dq
            pre, main_k, conv = pick(traffic, "bwd_pre"), pick(traffic, "exla_rs_bwd_" + dtype + "_d"), pick(traffic, "bwd_convert")
            others = {n: t for n, t in traffic.items() if not any(x in n for x in ("bwd_pre", "exla_rs_bwd_" + dtype + "_d", "bwd_convert"))}
            # Per-thread scalars the executor counts per instruction (see the docstring).
            scalars = m["ctas"] * 32 * warps * 8 + (m["lsed"] // 8) * (d // 8) * 4
            rows.append(dict(
                name=f"{dtype} {shape[0]}", d=d, bm=bm, bn=bn, pairs=m["pairs"], m=m, fa2=fa2,
                pre=(pre["read"], pre["written"], pre["atomic"]), pre_ideal=(2 * qd * 2, b * h * s * 4 + qd * 4, 0),
                main=(main_k["read"], main_k["written"], main_k["atomic"]),
                main_ideal=(m["kv"] + m["qdo"] + m["lsed"], 2 * b * s * hkv * d * 2, m["dq"]), scalars=scalars,
                conv=(conv["read"], conv["written"], conv["atomic"]), conv_ideal=(qd * 4, qd * 2, 0), others=others))
    if a.markdown:
        print("| dtype, shape (B = 1, Sq = Sk) | kBlockM x kBlockN | visible pairs | kernel | read | written | atomic | model read / written / atomic | actual / model (read, written, atomic) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            for kern, act, ide in (("bwd_pre", r["pre"], r["pre_ideal"]), ("bwd main", r["main"], r["main_ideal"]), ("bwd_convert", r["conv"], r["conv_ideal"])):
                ratio = ", ".join(f"{x / y:.4f}" if y else ("-" if x == 0 else "inf") for x, y in zip(act, ide))
                print(f"| {r['name']} | {r['bm']} x {r['bn']} | {r['pairs']} | {kern} | {act[0]} | {act[1]} | {act[2]} | {ide[0]} / {ide[1]} / {ide[2]} | {ratio} |")
        print()
        print("| dtype, shape | main read | K/V (model) | Q/dO (model) | lse/delta (model) | per-thread scalars | main read - scalars - model | dQ atomic / model | Q/dO/lse/delta read + dQ atomic: ours | FA2 tiles | ours / FA2 |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            m, fa2 = r["m"], r["fa2"]
            ours = m["qdo"] + m["lsed"] + m["dq"]
            theirs = fa2["qdo"] + fa2["lsed"] + fa2["dq"]
            print(f"| {r['name']} | {r['main'][0]} | {m['kv']} | {m['qdo']} | {m['lsed']} | {r['scalars']} | {r['main'][0] - r['scalars'] - r['main_ideal'][0]} | "
                  f"{r['main'][2] / m['dq']:.4f} | {ours} | {theirs} | {ours / theirs:.3f} |")
    else:
        for r in rows:
            print(f"{r['name']:24} tiles {r['bm']}x{r['bn']} pairs {r['pairs']}")
            for kern, act, ide in (("bwd_pre", r["pre"], r["pre_ideal"]), ("bwd main", r["main"], r["main_ideal"]), ("bwd_convert", r["conv"], r["conv_ideal"])):
                print(f"  {kern:12} read {act[0]:>10} written {act[1]:>9} atomic {act[2]:>9}   model {ide[0]:>10} {ide[1]:>9} {ide[2]:>9}")
            print(f"  main read - per-thread scalars ({r['scalars']}) - model = {r['main'][0] - r['scalars'] - r['main_ideal'][0]}; "
                  f"FA2 tiles {FA2_TILES[r['d']]}: Q/dO/lse/delta + dQ {r['fa2']['qdo'] + r['fa2']['lsed'] + r['fa2']['dq']} vs ours {r['m']['qdo'] + r['m']['lsed'] + r['m']['dq']}")
            if r["others"]:
                print(f"  other kernels: {r['others']}")
    if a.check:
        bad = [r["name"] for r in rows
               if r["pre"] != r["pre_ideal"] or r["conv"] != r["conv_ideal"] or r["others"]
               or (r["main"][0] - r["scalars"], r["main"][1], r["main"][2]) != r["main_ideal"]]
        if bad:
            raise SystemExit(f"bwd_traffic: bytes differ from the model in {bad}")
        print(f"# bwd_traffic: {len(rows)} calls, every kernel's bytes equal the model", file=sys.stderr)


if __name__ == "__main__":
    main()
