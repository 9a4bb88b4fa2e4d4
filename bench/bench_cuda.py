#!/usr/bin/env python3
"""Flash attention on one CUDA GPU, in one process: exla_rs's CUDA targets through XLA against
cuDNN (jax.nn.dot_product_attention(implementation="cudnn")), XLA's own attention
(implementation="xla") and PyTorch SDPA's FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION
backends. bf16, H=16, B*S=16384, S=1024..16384, D in {64, 128}, causal and not.

TFLOP/s: forward 4*B*H*S^2*D (halved when causal), backward 2.5x that; backward time is
(forward + backward) - forward for every implementation, so all pay the same. Memory: bytes a call
needs beyond its inputs (XLA: compiled temp + outputs; PyTorch: peak allocated minus inputs).

    python3 bench/bench_cuda.py [--out bench/results_cuda.md] [--seqs 1024,4096] [--dims 128]

The bar (H100): ours >= 0.8x FA2 forward and >= 0.6x FA2 backward at S >= 4096, D = 128; the
summary at the end of the table says whether it holds.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with PyTorch
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test/xla"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import exla_rs_jax as ex  # noqa: E402

try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # the table then has no PyTorch columns
    torch = None

H, TOKENS = 16, 16384


def flops(b, s, d, causal, bwd=False):
    f = 4 * b * H * s * s * d / (2 if causal else 1)
    return f * (2.5 if bwd else 1.0)


def time_jax(f, args, iters):
    jax.block_until_ready(f(*args))  # compile + warm up
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def jax_mem(f, args):
    m = f.lower(*args).compile().memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes) if m is not None else float("nan")


def jax_impls(causal, scale):
    wl, wr = ex.window(causal)

    def ours(q, k, v, kv, qs):
        return ex.attention(q, k, v, kv, qs, scale, 0.0, wl, wr, "cuda")

    def cudnn(q, k, v, kv, qs):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="cudnn")

    def xla(q, k, v, kv, qs):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="xla")

    return {"exla_rs (XLA FFI)": ours, "cuDNN (jax)": cudnn, "XLA (jax)": xla}


def bench_jax(name, fn, q, k, v, kv, qs, do, iters):
    fwd = jax.jit(fn)
    args = (q, k, v, kv, qs)

    def loss(q, k, v, kv, qs, do):
        return jnp.sum(fn(q, k, v, kv, qs).astype(jnp.float32) * do.astype(jnp.float32))

    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    try:
        tf = time_jax(fwd, args, iters)
        tb = time_jax(both, args + (do,), iters)
        return tf, max(tb - tf, 1e-9), jax_mem(fwd, args), jax_mem(both, args + (do,))
    except Exception as e:  # an implementation that refuses a size (memory, cuDNN limits)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"


def bench_torch(backend, q, k, v, do, causal, scale, iters):
    qt, kt, vt, dot = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v, do))  # [B,H,S,D]
    qt.requires_grad_(True), kt.requires_grad_(True), vt.requires_grad_(True)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    def timed(step):
        with sdpa_kernel(backend):
            step(), step()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(iters):
                    step()
                b.record()
                torch.cuda.synchronize()
                best = min(best, a.elapsed_time(b) / 1e3 / iters)
            return best

    def peak(step):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with sdpa_kernel(backend):
            step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def fwd_step():
        with torch.no_grad():
            f()

    def both_step():
        qt.grad = kt.grad = vt.grad = None
        f().backward(dot)

    try:
        tf, tb = timed(fwd_step), timed(both_step)
        return tf, max(tb - tf, 1e-9), peak(fwd_step), peak(both_step)
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench/results_cuda.md"))
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--iters", type=int, default=10)
    a = ap.parse_args()
    gpu = jax.devices("gpu")[0]
    ex.load("cuda")
    rows, ratios = [], []
    for d in map(int, a.dims.split(",")):
        for causal in (False, True):
            for s in map(int, a.seqs.split(",")):
                b = max(1, TOKENS // s)
                scale = 1.0 / np.sqrt(d)
                rng = np.random.default_rng(0)
                mk = lambda *sh: jax.device_put(jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16), gpu)
                q, k, v, do = mk(b, s, H, d), mk(b, s, H, d), mk(b, s, H, d), mk(b, s, H, d)
                kv = jax.device_put(np.full(b, s, np.int32), gpu)
                qs = jax.device_put(np.zeros(b, np.int32), gpu)
                res = {name: bench_jax(name, fn, q, k, v, kv, qs, do, a.iters) for name, fn in jax_impls(causal, scale).items()}
                if torch is not None:
                    res["PyTorch FLASH (FA2)"] = bench_torch(SDPBackend.FLASH_ATTENTION, q, k, v, do, causal, scale, a.iters)
                    res["PyTorch cuDNN"] = bench_torch(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal, scale, a.iters)
                for name, r in res.items():
                    if isinstance(r, str):
                        rows.append((d, causal, s, b, name, r, "", "", ""))
                        continue
                    tf, tb, mf, mb = r
                    rows.append((d, causal, s, b, name, f"{flops(b, s, d, causal) / tf / 1e12:.1f}",
                                 f"{flops(b, s, d, causal, True) / tb / 1e12:.1f}", f"{mf / 2**20:.0f}", f"{mb / 2**20:.0f}"))
                ours, fa2 = res.get("exla_rs (XLA FFI)"), res.get("PyTorch FLASH (FA2)")
                if d == 128 and s >= 4096 and not isinstance(ours, str) and fa2 is not None and not isinstance(fa2, str):
                    ratios.append((causal, s, fa2[0] / ours[0], fa2[1] / ours[1]))
                print(*rows[-len(res):], sep="\n", flush=True)
    dev = f"{gpu.device_kind}"
    lines = [f"# Flash attention, bf16, H={H}, B*S={TOKENS}, on {dev}", "",
             f"jax {jax.__version__}" + (f", torch {torch.__version__}" if torch else "") + "; TFLOP/s (higher is better), memory beyond inputs in MiB.", "",
             "| D | causal | S | B | implementation | fwd TFLOP/s | bwd TFLOP/s | fwd MiB | fwd+bwd MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    if ratios:
        lines += ["", "## Against FlashAttention-2 (PyTorch FLASH_ATTENTION), D=128, S >= 4096", "",
                  "| causal | S | fwd ours/FA2 (bar 0.8) | bwd ours/FA2 (bar 0.6) |", "| --- | --- | --- | --- |"]
        lines += [f"| {c} | {s} | {f:.2f} | {bw:.2f} |" for c, s, f, bw in ratios]
        ok = all(f >= 0.8 and bw >= 0.6 for _, _, f, bw in ratios)
        lines += ["", f"Bar {'met' if ok else 'NOT met'}."]
    Path(a.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
