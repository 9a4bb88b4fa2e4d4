#!/usr/bin/env python3
"""Flash attention on one CUDA GPU, in one process: exla_rs's CUDA targets through XLA against
cuDNN (jax.nn.dot_product_attention(implementation="cudnn")), XLA's own attention
(implementation="xla") and PyTorch SDPA's FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION
backends. bf16, H=16, B*S=16384, S=1024..16384, D in {64, 128, 256}, causal and not. XLA's
unfused attention runs only up to S=4096 (beyond it, its S x S matrices are the whole story).
Decode rows: Sq=1, 32 query heads over 8 KV heads, D=128, B=8, Sk=32k, reported as TB/s of K/V
read (2 * B * Sk * Hkv * D * 2 bytes per call).

TFLOP/s: forward 4*B*H*S^2*D (halved when causal), backward 2.5x that; backward time is
(forward + backward) - forward for every implementation, so all pay the same. Memory: bytes a call
needs beyond its inputs (XLA: compiled temp + outputs; PyTorch: peak allocated minus inputs).

    python3 bench/bench_cuda.py [--seqs 1024,4096] [--dims 128] [--no-decode] [--results FILE]
    python3 bench/bench_cuda.py --selftest     (no GPU: the report from made-up numbers)
    python3 bench/bench_cuda.py --paths auto   (only the default kernel choice; default: auto,mma)

Our forward has two kernel sets (issue 14): on an H100 the default (`auto`) runs the sm90
(wgmma/TMA) forward where it applies, `mma` forces the mma.sync kernels. With --paths auto,mma
both are timed side by side on the same inputs (EXLA_RS_CUDA_PATH is read at every call, so the
benchmark switches it between runs); the bar is judged on `auto`, and a table gives mma / auto.

Every run is appended to bench/RESULTS.md (--results) with the GPU, date and versions. The bar
(issue 13, H100): ours >= 1.0x FA2 forward and backward at D = 64, 128, 256, S >= 1024;
forward+backward >= 2x XLA's attention at S >= 1024 (where XLA runs); decode >= 2 TB/s. The
summary at the end of the run says which hold.
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
XLA_MAX_S = 4096  # XLA's unfused attention only up to here
# Decode: one query row against a long KV cache, GQA 32/8.
DEC_B, DEC_SK, DEC_H, DEC_HKV, DEC_D = 8, 32768, 32, 8, 128
OURS, FA2, XLA = "exla_rs (XLA FFI)", "PyTorch FLASH (FA2)", "XLA (jax)"
# The same custom call with EXLA_RS_CUDA_PATH=mma: the mma.sync kernels, for the sm90 comparison.
OURS_MMA = "exla_rs mma.sync (EXLA_RS_CUDA_PATH=mma)"
PATH_NAMES = {"auto": OURS, "mma": OURS_MMA}


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

    return {OURS: ours, "cuDNN (jax)": cudnn, XLA: xla}


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


def kv_bytes_decode():
    return 2 * DEC_B * DEC_SK * DEC_HKV * DEC_D * 2  # K and V, bf16


def bench_decode(iters):
    """{implementation: seconds per call or an error string} for the decode shape (forward only)."""
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    mk = lambda *sh: jax.device_put(jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16), gpu)
    q, k, v = mk(DEC_B, 1, DEC_H, DEC_D), mk(DEC_B, DEC_SK, DEC_HKV, DEC_D), mk(DEC_B, DEC_SK, DEC_HKV, DEC_D)
    kv = jax.device_put(np.full(DEC_B, DEC_SK, np.int32), gpu)
    qs = jax.device_put(np.full(DEC_B, DEC_SK - 1, np.int32), gpu)  # the new token sits last
    scale = 1.0 / np.sqrt(DEC_D)
    impls = {
        OURS: lambda q, k, v: ex.flash_attn_fwd(q, k, v, kv, qs, scale=scale, platform="cuda")[0],
        "cuDNN (jax)": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn"),
        XLA: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="xla"),
    }
    res = {}
    for name, fn in impls.items():
        try:
            res[name] = time_jax(jax.jit(fn), (q, k, v), iters)
        except Exception as e:
            res[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    if torch is not None:
        qt, kt, vt = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v))
        for name, backend in ((FA2, SDPBackend.FLASH_ATTENTION), ("PyTorch cuDNN", SDPBackend.CUDNN_ATTENTION)):
            try:
                step = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
                with torch.no_grad(), sdpa_kernel(backend):
                    step(), step()
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(iters):
                        step()
                    b.record()
                    torch.cuda.synchronize()
                    res[name] = a.elapsed_time(b) / 1e3 / iters
            except Exception as e:
                res[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return res


def fmt(r, digits=1):
    return r if isinstance(r, str) else f"{r:.{digits}f}"


def report(meta, rows, decode):
    """Markdown for one run. rows: (d, causal, s, b, name, result) with result (tf, tb, mf, mb)
    seconds/bytes or a string; decode: {name: seconds or string} or None. Pure: --selftest runs it."""
    lines = [f"## CUDA run {meta['date']} on {meta['gpu']}", "",
             f"`bench/bench_cuda.py`; {meta['versions']}. bf16, H={H}, B*S={TOKENS}; TFLOP/s (higher is better), "
             f"memory beyond inputs in MiB; XLA's unfused attention only up to S={XLA_MAX_S}.", "",
             "| D | causal | S | B | implementation | fwd TFLOP/s | bwd TFLOP/s | fwd MiB | fwd+bwd MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {}
    for d, causal, s, b, name, r in rows:
        by[(d, causal, s, name)] = r
        if isinstance(r, str):
            lines.append(f"| {d} | {causal} | {s} | {b} | {name} | {r} | | | |")
        else:
            tf, tb, mf, mb = r
            lines.append(f"| {d} | {causal} | {s} | {b} | {name} | {flops(b, s, d, causal) / tf / 1e12:.1f} | "
                         f"{flops(b, s, d, causal, True) / tb / 1e12:.1f} | {mf / 2**20:.0f} | {mb / 2**20:.0f} |")
    # The bar, from the rows that have both sides.
    fa2_rat, xla_rat = [], []
    for (d, causal, s, name), r in by.items():
        if name != OURS or isinstance(r, str) or s < 1024:
            continue
        f = by.get((d, causal, s, FA2))
        if f is not None and not isinstance(f, str):
            fa2_rat.append((d, causal, s, f[0] / r[0], f[1] / r[1]))
        x = by.get((d, causal, s, XLA))
        if x is not None and not isinstance(x, str):
            xla_rat.append((d, causal, s, (x[0] + x[1]) / (r[0] + r[1])))
    mma_rat = []
    for (d, causal, s, name), r in by.items():
        m = by.get((d, causal, s, OURS_MMA))
        if name == OURS and not isinstance(r, str) and m is not None and not isinstance(m, str):
            mma_rat.append((d, causal, s, m[0] / r[0], m[1] / r[1]))
    if mma_rat:
        lines += ["", "mma.sync time / default path (on H100 the default forward is sm90; the backward is "
                  "mma.sync in both, so bwd ~ 1.0):", "", "| D | causal | S | fwd | bwd |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {d} | {c} | {s} | {f:.2f} | {bw:.2f} |" for d, c, s, f, bw in sorted(mma_rat)]
    verdicts = []
    if fa2_rat:
        lines += ["", "FlashAttention-2 time / ours (bar: >= 1.0 forward and backward, S >= 1024):", "",
                  "| D | causal | S | fwd | bwd |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {d} | {c} | {s} | {f:.2f} | {bw:.2f} |" for d, c, s, f, bw in sorted(fa2_rat)]
        verdicts.append(("ours >= FA2", all(f >= 1.0 and bw >= 1.0 for *_, f, bw in fa2_rat)))
    if xla_rat:
        lines += ["", "XLA fwd+bwd time / ours (bar: >= 2.0, S >= 1024):", "", "| D | causal | S | XLA / ours |", "| --- | --- | --- | --- |"]
        lines += [f"| {d} | {c} | {s} | {x:.2f} |" for d, c, s, x in sorted(xla_rat)]
        verdicts.append(("fwd+bwd >= 2x XLA", all(x >= 2.0 for *_, x in xla_rat)))
    if decode is not None:
        gb = kv_bytes_decode()
        lines += ["", f"Decode: Sq=1, H={DEC_H} over Hkv={DEC_HKV}, D={DEC_D}, B={DEC_B}, Sk={DEC_SK}, bf16; "
                  f"{gb / 1e9:.2f} GB of K/V per call.", "", "| implementation | ms | TB/s of K/V |", "| --- | --- | --- |"]
        for name, t in decode.items():
            lines.append(f"| {name} | {t} | |" if isinstance(t, str) else f"| {name} | {t * 1e3:.3f} | {gb / t / 1e12:.2f} |")
        ours = decode.get(OURS)
        verdicts.append(("decode >= 2 TB/s", not isinstance(ours, str) and ours is not None and gb / ours / 1e12 >= 2.0))
    if verdicts:
        lines += ["", "Bar: " + "; ".join(f"{n}: {'met' if ok else 'NOT met'}" for n, ok in verdicts) + "."]
    return "\n".join(lines) + "\n"


def append_results(path, text):
    p = Path(path)
    old = p.read_text() if p.exists() else "# Benchmark results\n"
    p.write_text(old.rstrip("\n") + "\n\n" + text)


def versions():
    v = [f"jax {jax.__version__}"]
    try:
        import jaxlib
        v.append(f"jaxlib {jaxlib.__version__}")
    except Exception:
        pass
    if torch is not None:
        v.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
    try:
        import subprocess
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
        if drv:
            v.append(f"driver {drv.splitlines()[0]}")
    except Exception:
        pass
    v.append(f"exla_rs {os.popen(f'git -C {ROOT} rev-parse --short HEAD 2>/dev/null').read().strip() or '?'}")
    return ", ".join(v)


def selftest():
    """The report's logic on made-up numbers: no GPU, no jax devices."""
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for s in (1024, 8192):
                b = TOKENS // s
                t = flops(b, s, d, causal) / 300e12
                rows.append((d, causal, s, b, OURS, (t, 2.5 * t, 2**20, 2**21)))
                rows.append((d, causal, s, b, FA2, (1.1 * t, 2.4 * t, 2**20, 2**21)))
                rows.append((d, causal, s, b, OURS_MMA, (2 * t, 2.5 * t, 2**20, 2**21)))
                rows.append((d, causal, s, b, XLA, (3 * t, 6 * t, 2**30, 2**31) if s <= XLA_MAX_S else "skipped (S > 4096)"))
    text = report({"date": "2026-01-01", "gpu": "selftest", "versions": "none"}, rows,
                  {OURS: kv_bytes_decode() / 2.5e12, FA2: kv_bytes_decode() / 3.0e12, XLA: "OOM"})
    assert "| 128 | True | 8192 | 2.00 | 1.00 |" in text, text
    assert "skipped" in text and "Bar: ours >= FA2: NOT met; fwd+bwd >= 2x XLA: met; decode >= 2 TB/s: met." in text, text
    print(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(ROOT / "bench/RESULTS.md"), help="markdown file every run is appended to")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    ap.add_argument("--dims", default="64,128,256")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--paths", default="auto,mma", help="our kernel choices to time: auto (default choice), mma")
    ap.add_argument("--selftest", action="store_true", help="check the report logic without a GPU")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    gpu = jax.devices("gpu")[0]
    ex.load("cuda")
    rows = []
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
                res = {}
                for name, fn in jax_impls(causal, scale).items():
                    skip = name == XLA and s > XLA_MAX_S
                    if name == OURS:
                        for path in a.paths.split(","):
                            os.environ["EXLA_RS_CUDA_PATH"] = path
                            res[PATH_NAMES[path]] = bench_jax(name, fn, q, k, v, kv, qs, do, a.iters)
                        os.environ.pop("EXLA_RS_CUDA_PATH", None)
                        continue
                    res[name] = f"skipped (S > {XLA_MAX_S})" if skip else bench_jax(name, fn, q, k, v, kv, qs, do, a.iters)
                if torch is not None:
                    res[FA2] = bench_torch(SDPBackend.FLASH_ATTENTION, q, k, v, do, causal, scale, a.iters)
                    res["PyTorch cuDNN"] = bench_torch(SDPBackend.CUDNN_ATTENTION, q, k, v, do, causal, scale, a.iters)
                for name, r in res.items():
                    rows.append((d, causal, s, b, name, r))
                    print(d, causal, s, b, name, r, flush=True)
    decode = None if a.no_decode else bench_decode(a.iters)
    if decode:
        print("decode", decode, flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu.device_kind, "versions": versions()}
    text = report(meta, rows, decode)
    append_results(a.results, text)
    print(text)
    print(f"appended to {a.results}")


if __name__ == "__main__":
    main()
