#!/usr/bin/env python3
"""Shared-memory bank conflicts of the CUDA kernels, counted by the GPU-on-CPU executor (issue 22,
part 7): a performance signal without a GPU.

Runs the CUDA handlers on the executor (the gpu-on-cpu library, scripts/gpu_on_cpu.sh builds it)
through jax's cpu device for each head dim, forward (mma.sync and the opted-in sm90 forward) and
backward, on fresh random bf16 inputs with whole tiles (no causal mask: every key tile of every
block is computed), and reads the executor's per-kernel statistics: every warp-wide ldmatrix and
every set of 32 lanes' cp.async, served in 128-byte phases, one distinct 4-byte word per bank per
wavefront (crates/exla-rs-gpusim/executor/README.md). Conflicts = wavefronts beyond one per phase.

Per kernel it prints accesses, conflicts per access, and conflicts per key tile (a block's step
over one key tile: the forward's inner loop, the backward's (query head, query tile) step; the
sm90 forward's per consumer-tile), then scales the per-tile figure to the shape of the
2026-11-23 ncu run (D=128, S=4096, B=4, H=16, bf16; ours 14.7 M shared-load bank conflicts in the
backward, FA2 0.64 M) so the two can be set side by side. ncu also counts plain ld.shared, which
the executor does not see (crates/exla-rs-gpusim/executor/README.md).

    EXLA_RS_XLA_LIB=native/exla_rs/target/gpu_on_cpu/release/libexla_rs_xla.so \\
        .venv/jax-0.10.2/bin/python bench/bank_conflicts.py [--seq 512] [--markdown]
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test" / "xla"))
os.environ.setdefault("EXLA_RS_XLA_LIB", str(ROOT / "native/exla_rs/target/gpu_on_cpu/release/libexla_rs_xla.so"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import exla_rs_jax as ex  # noqa: E402

NCU = dict(b=4, s=4096, h=16, d=128)  # the 2026-11-23 ncu run's shape


def tiles(d: int) -> dict:
    """Block shapes per kernel, mirrored from crates/exla-rs-cuda/src/config.rs and sm90.rs."""
    fwd_warps = 8 if d <= 192 else 4
    bwd_warps, split = (4 if d <= 192 else 8), (1 if d <= 128 else 2 if d <= 192 else 4)
    return {
        "fwd": (16 * fwd_warps, 64 if d <= 128 else 32),   # (BM, BN)
        "bwd": (64 if d <= 96 else 32, 16 * bwd_warps // split),
        "sm90": (128, 128 if d <= 128 else 64) if d in (64, 128, 256) else None,
    }


def key_tile_steps(kind: str, d: int, b: int, sq: int, sk: int, h: int) -> int:
    """Block x key-tile iterations of one call without masking (H = Hkv)."""
    bm, bn = tiles(d)[kind]
    return math.ceil(sq / bm) * math.ceil(sk / bn) * h * b


def run(d: int, seq: int, heads: int, rng) -> dict:
    b = 1
    shape = (b, seq, heads, d)
    q, k, v, do = (jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype=jnp.bfloat16) for _ in range(4))
    kv_len = jnp.full((b,), seq, jnp.int32)
    q_start = jnp.zeros((b,), jnp.int32)
    scale = 1.0 / math.sqrt(d)
    out = {}
    for path in ("mma", "sm90"):
        if path == "sm90" and tiles(d)["sm90"] is None:
            continue
        os.environ["EXLA_RS_CUDA_PATH"] = path
        ex.gpusim_stats_reset()
        o, lse = ex.flash_attn_fwd(q, k, v, kv_len, q_start, scale=scale, platform="cuda-on-cpu")
        jax.block_until_ready(o)
        out[f"fwd_{path}"] = ex.gpusim_bank_stats()
        if path == "mma":
            ex.gpusim_stats_reset()
            jax.block_until_ready(ex.flash_attn_bwd(q, k, v, kv_len, q_start, o, lse, do, scale=scale, platform="cuda-on-cpu"))
            out["bwd"] = ex.gpusim_bank_stats()
    os.environ.pop("EXLA_RS_CUDA_PATH", None)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=512, help="Sq = Sk (whole tiles: a multiple of 128)")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--markdown", action="store_true", help="print the RESULTS.md table")
    args = ap.parse_args()
    rng = np.random.default_rng()
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        stats = run(d, args.seq, args.heads, rng)
        for label, kind in (("fwd_mma", "fwd"), ("fwd_sm90", "sm90"), ("bwd", "bwd")):
            if label not in stats:
                continue
            steps = key_tile_steps(kind, d, 1, args.seq, args.seq, args.heads)
            ncu_steps = key_tile_steps(kind, d, NCU["b"], NCU["s"], NCU["s"], NCU["h"])
            for kernel, kinds in sorted(stats[label].items()):
                if kernel.startswith("exla_rs_bwd_pre") or kernel.startswith("exla_rs_bwd_convert"):
                    continue
                for instr, st in sorted(kinds.items()):
                    per_tile = st["conflicts"] / steps
                    rows.append((kernel, instr, st["accesses"], st["conflicts"], st["conflicts"] / max(1, st["accesses"]),
                                 per_tile, per_tile * ncu_steps if d == NCU["d"] else None))
    if args.markdown:
        print("| kernel | instruction | warp accesses | conflicts | per access | per key tile | at the ncu shape (D=128) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for k, i, a, c, pa, pt, nc in rows:
            print(f"| {k} | {i} | {a} | {c} | {pa:.2f} | {pt:.1f} | {'' if nc is None else f'{nc / 1e6:.2f} M'} |")
    else:
        for k, i, a, c, pa, pt, nc in rows:
            extra = "" if nc is None else f", {nc / 1e6:.2f} M at B4 H16 S4096"
            print(f"{k:32} {i:9} {a:9} accesses {c:9} conflicts ({pa:.2f} per access, {pt:.1f} per key tile{extra})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
