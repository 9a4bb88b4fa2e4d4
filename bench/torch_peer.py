"""Our Host handlers side by side with PyTorch's CPU flash attention (`bench_host.py --torch`).

    scripts/setup.sh --bench                     # .venv/bench: jax 0.10.2 + torch (never in the test path)
    .venv/bench/bin/python bench/bench_host.py --torch                      # the whole table, appended to RESULTS.md
    .venv/bench/bin/python bench/bench_host.py --torch --sizes 2048 --no-write --dims 64

Peer: `torch.nn.functional.scaled_dot_product_attention` on CPU (its flash kernel for f32/bf16),
`torch.set_num_threads` to the cores this process may run on (`taskset -c 0 ...` runs both
sides on one core, as rayon follows the same affinity); ours: `exla_rs_jax.attention` under `jax.jit` (the
`exla_rs_flash_attn_fwd/bwd` targets; `jax.grad` runs our backward). One process, the same numbers
(fresh standard-normal draws per configuration), each side in its own contiguous layout
(ours `[B, S, H, D]`, PyTorch `[B, H, S, D]`). The two sides alternate in blocks of reps, so load from
the rest of the machine lands on both; a table cell is the best rep (median in brackets).

Prefill: B=1, H=8, D in {64, 128}, S in {512 .. 8192}, f32 and bf16, causal and not, fwd and
fwd+bwd (`grad` of `sum(o·do)` w.r.t. q, k, v; PyTorch: `o.backward(do)`).
Decode: one query row per sequence against a key cache of Sk (what text generation runs per
token), B=8, 32 query heads on 8 kv heads (GQA), D=128. Its GB/s is K+V bytes over the time, set
against the machine's read bandwidth measured here (PyTorch's `sum` over a 1 GiB array, every core).
"""
from __future__ import annotations

import datetime as dt
import os
import time

import numpy as np

PREFILL_B, PREFILL_H = 1, 8
DECODE_B, DECODE_HQ, DECODE_HKV, DECODE_D = 8, 32, 8, 128


def _torch():
    import torch

    torch.set_num_threads(cores())
    return torch


def cores() -> int:
    """The cores this process may run on (its affinity), which is what rayon's pool takes too."""
    return len(os.sched_getaffinity(0))


def _dtypes(name: str):
    import jax.numpy as jnp

    torch = _torch()
    return {"f32": (jnp.float32, torch.float32), "bf16": (jnp.bfloat16, torch.bfloat16)}[name]


class Case:
    """One configuration's inputs on both sides, from the same draw."""

    def __init__(self, b, sq, sk, h, hkv, d, dtype, causal, seed):
        import jax.numpy as jnp
        import ml_dtypes

        torch = _torch()
        jdt, tdt = _dtypes(dtype)
        rng = np.random.default_rng(seed)
        draw = lambda s, hh: rng.standard_normal((b, s, hh, d), dtype=np.float32)
        q, k, v, do = draw(sq, h), draw(sk, hkv), draw(sk, hkv), draw(sq, h)
        if dtype == "bf16":
            # Round once, so both sides see exactly the same bf16 numbers.
            q, k, v, do = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v, do))
        self.np = (q, k, v, do)
        self.jax = tuple(jnp.asarray(x, jdt) for x in (q, k, v, do))
        # PyTorch's layout: [B, H, S, D], contiguous.
        self.torch = tuple(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))).to(tdt) for x in (q, k, v, do))
        self.b, self.sq, self.sk, self.h, self.hkv, self.d, self.causal = b, sq, sk, h, hkv, d, causal
        self.scale = 1.0 / d**0.5
        self.gqa = h != hkv


def ours_fn(c: Case, pass_: str):
    import jax
    import jax.numpy as jnp
    import exla_rs_jax as ex

    kv_len = jnp.full((c.b,), c.sk, jnp.int32)
    # Decode: the one row sits at the end of the cache (q_start = Sk - Sq), so causal sees it all.
    q_start = jnp.full((c.b,), c.sk - c.sq, jnp.int32)
    wl, wr = ex.window(c.causal)
    attn = lambda q, k, v: ex.attention(q, k, v, kv_len, q_start, c.scale, 0.0, wl, wr, "cpu")
    q, k, v, do = c.jax
    if pass_ == "fwd":
        f = jax.jit(attn)
        return lambda: f(q, k, v).block_until_ready()
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum((attn(q, k, v) * do).astype(jnp.float32)), argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(g(q, k, v))


def torch_fn(c: Case, pass_: str):
    torch = _torch()
    F = torch.nn.functional
    q, k, v, do = c.torch
    # PyTorch's is_causal is top-left aligned; with one query row at the end of the cache it must
    # see every key, i.e. no mask, which is what ours computes for q_start = Sk - 1.
    causal = c.causal and c.sq == c.sk
    kw = dict(is_causal=causal, scale=c.scale, enable_gqa=c.gqa)
    if pass_ == "fwd":

        def run():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, **kw)

        return run
    qg, kg, vg = (x.detach().clone().requires_grad_(True) for x in (q, k, v))

    def run():
        for x in (qg, kg, vg):
            x.grad = None
        F.scaled_dot_product_attention(qg, kg, vg, **kw).backward(do)

    return run


def check(c: Case, pass_: str) -> dict:
    """Max |a - ref| / max |ref| of each side's o (and grads) against the float64 reference."""
    import jax
    import jax.numpy as jnp
    import exla_rs_jax as ex

    torch = _torch()
    q, k, v, do = c.np
    kv_len = np.full((c.b,), c.sk, np.int32)
    q_start = np.full((c.b,), c.sk - c.sq, np.int32)
    wl, wr = ex.window(c.causal)
    kw = dict(scale=c.scale, window_left=wl, window_right=wr)
    rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())
    from_torch = lambda x: x.float().numpy().transpose(0, 2, 1, 3)
    ref_o, _ = ex.reference_fwd(q, k, v, kv_len, q_start, **kw)
    attn = lambda a, b_, v_: ex.attention(a, b_, v_, jnp.asarray(kv_len), jnp.asarray(q_start), c.scale, 0.0, wl, wr, "cpu")
    tkw = dict(is_causal=c.causal and c.sq == c.sk, scale=c.scale, enable_gqa=c.gqa)
    with torch.no_grad():
        o_t = torch.nn.functional.scaled_dot_product_attention(*c.torch[:3], **tkw)
    out = {"o ours": rel(attn(*c.jax[:3]).astype(jnp.float32), ref_o), "o torch": rel(from_torch(o_t), ref_o)}
    if pass_ != "fwd":
        gref = ex.reference_bwd(q, k, v, kv_len, q_start, do, **kw)
        g = jax.grad(lambda a, b_, v_: jnp.sum((attn(a, b_, v_) * c.jax[3]).astype(jnp.float32)), argnums=(0, 1, 2))(*c.jax[:3])
        tg = [x.detach().clone().requires_grad_(True) for x in c.torch[:3]]
        torch.nn.functional.scaled_dot_product_attention(*tg, **tkw).backward(c.torch[3])
        for n, a, t_, r in zip(("dq", "dk", "dv"), g, tg, gref):
            out[f"{n} ours"] = rel(jnp.asarray(a, jnp.float32), r)
            out[f"{n} torch"] = rel(from_torch(t_.grad), r)
    return out


def time_pair(c: Case, pass_: str, reps: int, rounds: int) -> dict:
    fns = {"ours": ours_fn(c, pass_), "torch": torch_fn(c, pass_)}
    times = {n: [] for n in fns}
    for f in fns.values():  # compile, first-touch, thread pools up
        f()
        f()
    for _ in range(rounds):
        for n, f in fns.items():
            for _ in range(reps):
                t = time.perf_counter()
                f()
                times[n].append(1e3 * (time.perf_counter() - t))
    return {n: (min(t), sorted(t)[len(t) // 2]) for n, t in times.items()}


def read_bandwidth_gbs() -> float:
    """The machine's read bandwidth, every core: PyTorch's sum over a 1 GiB f32 array, best of 5."""
    torch = _torch()
    x = torch.randn(1 << 28)
    best = float("inf")
    for _ in range(6):
        t = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def run(args, machine: str, append_section) -> None:
    torch = _torch()
    import jax

    sizes = [int(s) for s in (args.sizes or "512,1024,2048,4096,8192").split(",")]
    dims = [int(d) for d in args.dims.split(",")]
    dtypes = args.dtypes.split(",")
    seed = args.seed
    rows, checks = [], {}
    print(f"seed {seed}; torch {torch.__version__}, {torch.get_num_threads()} threads; jax {jax.__version__}", flush=True)
    if not args.decode_only:
        for d in dims:
            for dtype in dtypes:
                # Both sides against float64 at S=256, causal and not, fwd and grads.
                for causal in (False, True):
                    c = Case(PREFILL_B, 256, 256, PREFILL_H, PREFILL_H, d, dtype, causal, seed)
                    checks[f"D={d} {dtype} {'causal' if causal else 'full'} S=256"] = check(c, "bwd")
                for s in sizes:
                    for causal in (False, True):
                        c = Case(PREFILL_B, s, s, PREFILL_H, PREFILL_H, d, dtype, causal, seed + s)
                        for pass_ in ("fwd", "bwd"):
                            reps = max(2, args.reps if s <= 2048 else args.reps // 2)
                            t = time_pair(c, pass_, reps, args.rounds)
                            row = (f"{s}", d, dtype, "causal" if causal else "none", "fwd" if pass_ == "fwd" else "fwd+bwd", t)
                            rows.append(row)
                            print(fmt_row(row), flush=True)
    bw = read_bandwidth_gbs()
    dec = []
    for dtype in dtypes:
        for sk in (1024, 4096, 16384):
            c = Case(DECODE_B, 1, sk, DECODE_HQ, DECODE_HKV, DECODE_D, dtype, True, seed + sk)
            checks[f"decode {dtype} Sk={sk}"] = check(c, "fwd")
            t = time_pair(c, "fwd", args.reps * 2, args.rounds)
            kv_bytes = 2 * DECODE_B * sk * DECODE_HKV * DECODE_D * (4 if dtype == "f32" else 2)
            dec.append((sk, dtype, t, kv_bytes))
            print(f"decode {dtype} Sk={sk}: ours {t['ours'][0]:.2f} ms ({kv_bytes / t['ours'][0] / 1e6:.1f} GB/s), torch {t['torch'][0]:.2f} ms ({kv_bytes / t['torch'][0] / 1e6:.1f} GB/s)", flush=True)
    for k, r in checks.items():
        print(k, " ".join(f"{n}={e:.1e}" for n, e in r.items()), flush=True)

    lines = [
        f"### Run {dt.date.today().isoformat()}: {machine}",
        "",
        f"`bench/bench_host.py --torch` (seed {seed}), torch {torch.__version__} with {torch.get_num_threads()} threads, jax {jax.__version__}, "
        f"load average {os.getloadavg()[0]:.1f} at the end. ms: best of {args.rounds} blocks of reps, median in brackets; ratio = PyTorch / ours (> 1: ours faster).",
        "",
    ]
    if rows:
        lines += ["| S | D | dtype | mask | pass | ours ms | PyTorch ms | ratio |", "|---:|---:|---|---|---|---:|---:|---:|"]
        for s, d, dtype, mask, p, t in rows:
            (ob, om), (tb, tm) = t["ours"], t["torch"]
            lines.append(f"| {s} | {d} | {dtype} | {mask} | {p} | {ob:.1f} ({om:.1f}) | {tb:.1f} ({tm:.1f}) | {tb / ob:.2f} |")
        lines.append("")
    lines += [
        f"Decode: one query row per sequence, B={DECODE_B}, {DECODE_HQ} query heads on {DECODE_HKV} kv heads, D={DECODE_D}; GB/s = K+V bytes / time; "
        f"the machine's read bandwidth (PyTorch `sum` over 1 GiB, {cores()} threads): {bw:.1f} GB/s.",
        "",
        "| Sk | dtype | K+V MiB | ours ms | ours GB/s | PyTorch ms | PyTorch GB/s | ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for sk, dtype, t, nbytes in dec:
        (ob, om), (tb, tm) = t["ours"], t["torch"]
        lines.append(f"| {sk} | {dtype} | {nbytes / 2**20:.0f} | {ob:.2f} ({om:.2f}) | {nbytes / ob / 1e6:.1f} | {tb:.2f} ({tm:.2f}) | {nbytes / tb / 1e6:.1f} | {tb / ob:.2f} |")
    lines += ["", "Agreement with float64 (max abs error / max abs of the reference):", ""]
    for k, r in checks.items():
        lines.append(f"- {k}: " + ", ".join(f"{n} {e:.1e}" for n, e in r.items()))
    section = "\n".join(lines) + "\n"
    print(section)
    if not (args.no_write or args.quick):
        append_section(section)


def fmt_row(row) -> str:
    s, d, dtype, mask, p, t = row
    (ob, om), (tb, tm) = t["ours"], t["torch"]
    return f"S={s} D={d} {dtype:4s} {mask:6s} {p:7s}  ours {ob:8.1f} ({om:8.1f}) ms  torch {tb:8.1f} ({tm:8.1f}) ms  torch/ours {tb / ob:5.2f}"
