#!/usr/bin/env python3
"""Global-memory traffic of decode calls, counted by the GPU-on-CPU executor (issue 34, part 3): a
decode call should read each K/V byte once (the split-KV kernels hold every query head of a GQA
group in one CTA; f32's simt_fwd_split up to 8 packed rows per one-warp CTA, so once per 8 query
rows x heads of a group), where the non-split forward reads it once per query head.

Runs the CUDA handlers on the executor's statistics build (scripts/gpu_on_cpu.sh stats builds it:
every kernel load and store is instrumented there, cp.async and TMA sources and atomics are
counted by their models) through jax's cpu device, and reads the bytes each kernel read, wrote and
added atomically inside the call's device buffers (crates/exla-rs-gpusim/executor/exec.h,
exla_rs_gpusim_traffic_json). For each shape: the split path (auto: the split count the launcher
picks on the modelled GPU, 132 SMs by default) and the non-split mma.sync forward
(EXLA_RS_CUDA_SPLITS=off, EXLA_RS_CUDA_PATH=mma), against the K/V cache's size (the visible part:
keys past kv_len are never read).

    EXLA_RS_XLA_LIB=native/exla_rs/target/gpu_on_cpu_stats/gpusim/libexla_rs_xla.so \\
        .venv/jax-0.10.2/bin/python bench/decode_traffic.py [--markdown]
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import exla_rs_jax as ex  # noqa: E402

# (name, B, Sq, Sk, H, Hkv, D, kv_len): issue 34's decode row (GQA 32/8, D = 128) at executor
# sizes, a ragged cache, MQA, small Sq, D = 256.
SHAPES = [
    ("gqa32/8 d128", 2, 1, 2048, 32, 8, 128, None),
    ("gqa32/8 d128 ragged", 2, 1, 2048, 32, 8, 128, [2048, 700]),
    ("mqa8/1 d64", 4, 1, 1024, 8, 1, 64, None),
    ("gqa8/2 d128 sq4", 2, 4, 1024, 8, 2, 128, None),
    ("gqa16/4 d256", 1, 1, 1024, 16, 4, 256, None),
]


DTYPES = {"bf16": jnp.bfloat16, "f32": np.float32}


def run(shape, dtype, settings):
    name, b, sq, sk, h, hkv, d, kv = shape
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32).astype(DTYPES[dtype]) for s in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    kv_len = np.array(kv if kv else [sk] * b, np.int32)
    q_start = kv_len - sq
    dev = jax.devices("cpu")[0]
    args = [jax.device_put(x, dev) for x in (q, k, v, kv_len, q_start)]
    old = {n: os.environ.get(n) for n in settings}
    os.environ.update(settings)
    try:
        ex.gpusim_stats_reset()
        o, lse = ex.flash_attn_fwd(*args, scale=d**-0.5, window_left=-1, window_right=0, platform="cuda-on-cpu")
        jax.block_until_ready((o, lse))
        traffic, launches = ex.gpusim_traffic(), ex.gpusim_launch_counts()
    finally:
        for n, x in old.items():
            if x is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = x
    kv_bytes = 2 * int(kv_len.sum()) * hkv * d * k.dtype.itemsize  # K and V, visible keys
    small = q.nbytes + 8 * b  # q, kv_len, q_start
    return kv_bytes, small, traffic, launches


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--dtypes", default="bf16,f32", help="comma-separated: bf16 (the tensor-core kernels), f32 (the SIMT ones)")
    a = ap.parse_args()
    if not ex.gpusim_traffic.__doc__:
        raise SystemExit("exla_rs_jax lacks gpusim_traffic")
    rows = []
    for dtype, shape in ((dt, sh) for dt in a.dtypes.split(",") for sh in SHAPES):
        for path, settings in (("split-KV", {"EXLA_RS_CUDA_SPLITS": "auto", "EXLA_RS_CUDA_PATH": "mma"}),
                               ("non-split", {"EXLA_RS_CUDA_SPLITS": "off", "EXLA_RS_CUDA_PATH": "mma"})):
            kv_bytes, small, traffic, launches = run(shape, dtype, settings)
            if not traffic:
                raise SystemExit("no traffic counted: EXLA_RS_XLA_LIB must be the statistics build (scripts/gpu_on_cpu.sh stats)")
            main_kernel = max(traffic, key=lambda k: traffic[k]["read"])
            read = sum(t["read"] for t in traffic.values())
            kernel_read = traffic[main_kernel]["read"]
            # What the main kernel reads besides K/V, counted per instruction as the executor does
            # (on a GPU these hit L1/L2): each CTA's valid q rows, and every thread's kv_len[b] and
            # q_start[b] (8 bytes). The split kernel's CTAs: row blocks x splits x Hkv x B, the
            # splits read back from the partials it wrote (S x B x H x Sq x (D + 1) x 4 bytes).
            _, b, sq, sk, h, hkv, d, kv = shape
            if "split" in main_kernel and dtype == "f32":
                # simt_fwd_split: one-warp CTAs of 8 packed rows; every CTA stages its rows' q
                # (an empty split too) and each thread reads kv_len[b], q_start[b].
                part = b * h * sq * (d + 1) * 4
                splits = traffic[main_kernel]["written"] // part if any("combine" in k for k in traffic) else 1
                ctas = -(-(h // hkv) * sq // 8) * splits * hkv * b
                other = splits * b * sq * h * d * 4 + ctas * 32 * 8
            elif dtype == "f32":
                # simt_fwd: a warp per (query row, head) reads its q row, and each of its threads
                # kv_len[b] and q_start[b] twice (the mask and the row's ALiBi position): 12 bytes.
                splits = 0
                other = b * sq * h * d * 4 + b * sq * h * 32 * 12
            elif "split" in main_kernel:
                part = b * h * sq * (d + 1) * 4
                splits = traffic[main_kernel]["written"] // part if any("combine" in k for k in traffic) else 1
                ctas = -(-(h // hkv) * sq // 64) * splits * hkv * b
                # A split with no key tile (a short row: fewer tiles than splits) loads no q.
                tiles = [-(-n // (64 if d <= 128 else 32)) for n in (kv or [sk] * b)]
                q_loads = sum(min(splits, t) for t in tiles) * sq * h * d * 2
                other = q_loads + ctas * 128 * 8
            else:
                splits, threads = 0, 256 if d <= 192 else 128
                ctas = -(-sq // (16 * threads // 32)) * h * b
                other = b * sq * h * d * 2 + ctas * threads * 8
            rows.append((f"{dtype} {shape[0]}", path, ", ".join(f"{k.removeprefix('exla_rs_')}" for k in sorted(launches)), kv_bytes, small,
                         kernel_read, read, sum(t["written"] for t in traffic.values()), sum(t["atomic"] for t in traffic.values()),
                         splits, kernel_read - other))
            print(f"# {shape[0]} {path}: {traffic}", file=sys.stderr)
    if a.markdown:
        print("| dtype, shape (causal, q at the end) | path | splits | K/V bytes (visible) | main kernel read | read / K/V | main kernel read - q per CTA - 8 B per thread | = K/V x | all kernels read | written | atomic |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for name, path, kernels, kv, small, kr, rd, wr, at, sp, kvpart in rows:
            print(f"| {name} | {path} | {sp or '-'} | {kv} | {kr} | {kr / kv:.4f} | {kvpart} | {kvpart / kv:.4f} | {rd} | {wr} | {at} |")
    else:
        for name, path, kernels, kv, small, kr, rd, wr, at, sp, kvpart in rows:
            print(f"{name:27} {path:10} splits {sp:>3}  K/V {kv:>10}  main kernel read {kr:>10} ({kr / kv:.4f} x K/V; without q and kv_len/q_start: "
                  f"{kvpart} = {kvpart / kv:.4f} x K/V)  all read {rd:>10} written {wr:>9} atomic {at}  [{kernels}]")


if __name__ == "__main__":
    main()
