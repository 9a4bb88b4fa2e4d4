#!/usr/bin/env python3
"""Flash attention on one CUDA GPU, in one process: exla_rs's CUDA targets through XLA against
cuDNN (jax.nn.dot_product_attention(implementation="cudnn")), XLA's own attention
(implementation="xla") and PyTorch SDPA's FLASH_ATTENTION (FlashAttention-2) and CUDNN_ATTENTION
backends. bf16, H=16, B*S=16384, S=1024..16384, D in {64, 128, 256}, causal and not. XLA's
unfused attention runs only up to S=4096 (beyond it, its S x S matrices are the whole story).
Decode rows: Sq=1, 32 query heads over 8 KV heads, D=128, B=8, Sk=4096 and 32768 (--decode-sk),
reported as TB/s of K/V read (2 * B * Sk * Hkv * D * 2 bytes per call), XLA's attention included.

TFLOP/s: forward 4*B*H*S^2*D (halved when causal), backward 2.5x that; backward time is
(forward + backward) - forward for every implementation, so all pay the same. Memory: bytes a call
needs beyond its inputs (XLA: compiled temp + outputs; PyTorch: peak allocated minus inputs).
Timing: jax by block_until_ready + perf_counter, PyTorch by CUDA events; two warm-up calls (and
the compile) excluded, best of --reps runs of --iters calls. Inputs are fresh random normals.

    python3 bench/bench_cuda.py [--seqs 1024,4096] [--dims 128] [--no-decode] [--results FILE]
    python3 bench/bench_cuda.py --quick [--results FILE]   (about 2 minutes on an H100/H200, below)
    python3 bench/bench_cuda.py --selftest     (no GPU: the reports from made-up numbers)
    python3 bench/bench_cuda.py --paths auto   (only the default kernel choice; default: auto,mma)
    python3 bench/bench_cuda.py --deadline 500 (rows not started by then: "skipped (deadline)")

Our forward has two kernel sets (issues 14, 22): `mma` = the mma.sync kernels, `sm90` = the Hopper
(wgmma/TMA) forward wherever it applies; `auto` (the default) runs sm90 for the (dtype, head dim)
pairs verified on Hopper hardware (AUTO_SM90_VERIFIED in crates/exla-rs-cuda/src/sm90.rs) and
mma.sync for the rest. The backward is mma.sync under
every setting. --paths times the chosen settings side by side on the same inputs (EXLA_RS_CUDA_PATH
is read at every call, so the benchmark switches it between runs); the bar is judged on `auto`, and
a table gives each other path's time / auto. --sm90-dims limits the head dims the sm90 path is
timed at (D=256 hung before its register split was fixed: bench/RESULTS.md, 2026-11-27).

--quick (issue 31): bf16, D 64 and 128, S 4096 and 16384, causal and not, forward and backward;
ours with EXLA_RS_CUDA_PATH=mma and =sm90 beside PyTorch FA2, PyTorch cuDNN and jax cuDNN (no XLA
prefill); decode at Sk 4096 and 32768 with XLA's attention too; 5 iterations, best of 2; a
deadline of 110 s from the start (--deadline), after which the remaining rows read
"skipped (deadline)". Its report adds "ours / best peer" (the fastest of FA2, PyTorch cuDNN and jax
cuDNN, per row and direction: peer time / ours, > 1 = ours faster) for each of our paths. Every row
is printed as it is measured; every failure is caught and shown as a string in its row; a watchdog
writes the report with the rows so far and exits (code 3) if one measurement hangs 10 s past the
deadline (a hung kernel does not answer signals).

--key-mask: the prefill rows as a Bumblebee model calls us: every call carries a key mask (batch row
b keeps its first lens[b] keys, lens drawn in [S/2, S], the padding of a batch of unequal
sequences). Ours pass it as key_mask (on Hopper the sm90 forward's mask set with
EXLA_RS_CUDA_PATH=sm90); jax cuDNN gets the same lengths as key_value_seq_lengths; PyTorch's FLASH
backend takes no mask and is left out. FLOPs count the full S x S, as for the other rows.

Every run is appended to bench/RESULTS.md (--results) with the GPU, driver, date and versions. The
bar (issue 13, H100): ours >= 1.0x FA2 forward and backward at D = 64, 128, 256, S >= 1024;
forward+backward >= 2x XLA's attention at S >= 1024 (where XLA runs); decode >= 2 TB/s (B=8,
Sk=32768). The summary at the end of a full run says which hold.
"""
from __future__ import annotations

import time

T0 = time.monotonic()  # --deadline counts from here (the imports included)

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

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
except Exception:  # the table then has no PyTorch columns
    torch = None

H, TOKENS = 16, 16384
XLA_MAX_S = 4096  # XLA's unfused attention only up to here
# Decode: one query row against a long KV cache, GQA 32/8; B and Sk are arguments (--decode-sk).
DEC_B, DEC_SK, DEC_H, DEC_HKV, DEC_D = 8, 32768, 32, 8, 128  # DEC_B, DEC_SK: the bar's shape
OURS, FA2, XLA = "exla_rs (XLA FFI)", "PyTorch FLASH (FA2)", "XLA (jax)"
TORCH_CUDNN, JAX_CUDNN = "PyTorch cuDNN", "cuDNN (jax)"
PEERS = (FA2, TORCH_CUDNN, JAX_CUDNN)  # "best peer" = the fastest of these
# The same custom call under other EXLA_RS_CUDA_PATH settings (read at every call).
OURS_MMA = "exla_rs mma.sync (EXLA_RS_CUDA_PATH=mma)"
OURS_SM90 = "exla_rs sm90 (EXLA_RS_CUDA_PATH=sm90)"
PATH_NAMES = {"auto": OURS, "mma": OURS_MMA, "sm90": OURS_SM90}
SHORT = {OURS: "auto", OURS_MMA: "mma", OURS_SM90: "sm90", FA2: "FA2", TORCH_CUDNN: "PyTorch cuDNN", JAX_CUDNN: "jax cuDNN"}
SKIP_DEADLINE = "skipped (deadline)"
WATCHDOG_GRACE_S = 10.0


def flops(b, s, d, causal, bwd=False):
    f = 4 * b * H * s * s * d / (2 if causal else 1)
    return f * (2.5 if bwd else 1.0)


def kv_bytes_decode(b=DEC_B, sk=DEC_SK):
    return 2 * b * sk * DEC_HKV * DEC_D * 2  # K and V, bf16


def err(e):
    """An exception as one short table cell."""
    first = (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:60]}".replace("|", "/")


# ---------------------------------------------------------------------------------------------
# The run's state: rows so far, the deadline, the one report write (main, watchdog or SIGTERM)
# ---------------------------------------------------------------------------------------------

class Run:
    def __init__(self, deadline_s, results, meta, quick):
        self.end = None if deadline_s is None else T0 + deadline_s
        self.results, self.meta, self.quick = results, meta, quick
        self.rows, self.decode = [], []
        self.current = None  # ("prefill", row key) or ("decode", row key) being measured
        self.lock = threading.RLock()
        self.written = False

    def past_deadline(self):
        return self.end is not None and time.monotonic() > self.end

    def measure(self, kind, key, thunk):
        """Runs one measurement unless past the deadline; records, prints and returns its result."""
        if self.past_deadline():
            r = SKIP_DEADLINE
        else:
            self.current = (kind, key)
            try:
                r = thunk()
            except Exception as e:  # an implementation that refuses a size (memory, cuDNN limits)
                r = err(e)
            self.current = None
        (self.rows if kind == "prefill" else self.decode).append(key + (r,))
        print(kind, *key, r, f"[{time.monotonic() - T0:.0f} s]", flush=True)
        return r

    def note_row(self, kind, key, text):
        """A row not measured by design (a skip), printed like the others."""
        (self.rows if kind == "prefill" else self.decode).append(key + (text,))
        print(kind, *key, text, flush=True)

    def finish(self, note=None, row=None):
        """Writes the report once; False when it was already written."""
        with self.lock:
            if self.written:
                return False
            self.written = True
            rows, decode = list(self.rows), list(self.decode)
            if row is not None and self.current is not None:  # the measurement in flight
                kind, key = self.current
                (rows if kind == "prefill" else decode).append(key + (row,))
            meta = dict(self.meta)
            if note is not None:
                meta["note"] = f"Stopped early: {note}; rows not started are absent."
            text = report(meta, rows, decode, quick=self.quick)
            try:
                append_results(self.results, text)
                where = f"appended to {self.results}"
            except Exception as e:
                where = f"NOT appended to {self.results}: {err(e)}"
            print(text)
            print(where, flush=True)
            return True

    def start_watchdog(self):
        if self.end is None:
            return

        def fire():
            if self.finish(note=f"watchdog: a measurement still running {WATCHDOG_GRACE_S:.0f} s past the deadline",
                           row="unfinished (watchdog)"):
                sys.stdout.flush()
                os._exit(3)

        t = threading.Timer(max(0.0, self.end + WATCHDOG_GRACE_S - time.monotonic()), fire)
        t.daemon = True
        t.start()

    def on_sigterm(self):
        def handler(signum, frame):
            self.finish(note=f"signal {signum} (e.g. an outer timeout)", row=f"unfinished (signal {signum})")
            sys.stdout.flush()
            os._exit(128 + signum)

        signal.signal(signal.SIGTERM, handler)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def time_jax(f, args, iters, reps):
    jax.block_until_ready(f(*args))  # compile + warm up
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def time_torch(step, iters, reps):
    """Seconds per step by CUDA events, best of reps (the caller sets the backend)."""
    step(), step()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            step()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / iters)
    return best


def jax_mem(f, args):
    m = f.lower(*args).compile().memory_analysis()
    return (m.temp_size_in_bytes + m.output_size_in_bytes) if m is not None else float("nan")


def masked_ours(causal, scale, key_mask):
    """Ours with a key mask operand, differentiable through our backward (which gets it too)."""
    wl, wr = ex.window(causal)
    kw = dict(scale=scale, window_left=wl, window_right=wr, platform="cuda", key_mask=key_mask)

    @jax.custom_vjp
    def f(q, k, v, kv, qs):
        return ex.flash_attn_fwd(q, k, v, kv, qs, **kw)[0]

    def fwd(q, k, v, kv, qs):
        o, lse = ex.flash_attn_fwd(q, k, v, kv, qs, **kw)
        return o, (q, k, v, kv, qs, o, lse)

    def bwd(res, do):
        q, k, v, kv, qs, o, lse = res
        dq, dk, dv = ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do.astype(o.dtype), **kw)
        zero = lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0)
        return dq, dk, dv, zero(kv), zero(qs)

    f.defvjp(fwd, bwd)
    return f


def jax_impls(causal, scale, lens=None):
    """Our attention, jax's cuDNN and XLA attention; with `lens` (--key-mask) each batch row b
    sees its first lens[b] keys: ours through key_mask, cuDNN through key_value_seq_lengths."""
    wl, wr = ex.window(causal)
    if lens is not None:
        def ours_masked(q, k, v, kv, qs):
            key_mask = (jnp.arange(k.shape[1])[None, :] < lens[:, None]).astype(jnp.int8)
            return masked_ours(causal, scale, key_mask)(q, k, v, kv, qs)

        def cudnn_masked(q, k, v, kv, qs):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, key_value_seq_lengths=lens,
                                                implementation="cudnn")

        return {OURS: ours_masked, JAX_CUDNN: cudnn_masked}

    def ours(q, k, v, kv, qs):
        return ex.attention(q, k, v, kv, qs, scale, 0.0, wl, wr, "cuda")

    def cudnn(q, k, v, kv, qs):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="cudnn")

    def xla(q, k, v, kv, qs):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="xla")

    return {OURS: ours, JAX_CUDNN: cudnn, XLA: xla}


def bench_jax(fn, q, k, v, kv, qs, do, iters, reps):
    """(fwd s, bwd s, fwd bytes, fwd+bwd bytes); raises on failure (Run.measure catches)."""
    fwd = jax.jit(fn)
    args = (q, k, v, kv, qs)

    def loss(q, k, v, kv, qs, do):
        return jnp.sum(fn(q, k, v, kv, qs).astype(jnp.float32) * do.astype(jnp.float32))

    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    tf = time_jax(fwd, args, iters, reps)
    tb = time_jax(both, args + (do,), iters, reps)
    return tf, max(tb - tf, 1e-9), jax_mem(fwd, args), jax_mem(both, args + (do,))


def bench_torch(backend, q, k, v, do, causal, scale, iters, reps):
    """Like bench_jax for one PyTorch SDPA backend; raises on failure."""
    qt, kt, vt, dot = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v, do))  # [B,H,S,D]
    qt.requires_grad_(True), kt.requires_grad_(True), vt.requires_grad_(True)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)

    def timed(step):
        with sdpa_kernel(backend):
            return time_torch(step, iters, reps)

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

    tf, tb = timed(fwd_step), timed(both_step)
    return tf, max(tb - tf, 1e-9), peak(fwd_step), peak(both_step)


def set_path(path):
    if path is None:
        os.environ.pop("EXLA_RS_CUDA_PATH", None)
    else:
        os.environ["EXLA_RS_CUDA_PATH"] = path


def bench_decode(run, b, sk, paths, iters, reps):
    """Decode at (b, sk), forward only: each implementation's seconds per call, or a string, into
    run.decode as (b, sk, name, result)."""
    names = [PATH_NAMES[p] for p in paths] + [JAX_CUDNN, XLA] + ([FA2, TORCH_CUDNN] if torch is not None else [])
    if run.past_deadline():  # no inputs to make: every row of this shape is skipped
        for name in names:
            run.measure("decode", (b, sk, name), None)
        return
    try:
        gpu = jax.devices("gpu")[0]
        rng = np.random.default_rng(sk)
        mk = lambda *sh: jax.device_put(jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16), gpu)
        q, k, v = mk(b, 1, DEC_H, DEC_D), mk(b, sk, DEC_HKV, DEC_D), mk(b, sk, DEC_HKV, DEC_D)
        kv = jax.device_put(np.full(b, sk, np.int32), gpu)
        qs = jax.device_put(np.full(b, sk - 1, np.int32), gpu)  # the new token sits last
    except Exception as e:
        for name in names:
            run.note_row("decode", (b, sk, name), f"inputs: {err(e)}")
        return
    scale = 1.0 / np.sqrt(DEC_D)
    ours = lambda q, k, v: ex.flash_attn_fwd(q, k, v, kv, qs, scale=scale, platform="cuda")[0]
    for path in paths:
        def one(path=path):
            set_path(path)
            try:
                return time_jax(jax.jit(ours), (q, k, v), iters, reps)
            finally:
                set_path(None)
        run.measure("decode", (b, sk, PATH_NAMES[path]), one)
    peers = {
        JAX_CUDNN: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn"),
        XLA: lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="xla"),
    }
    for name, fn in peers.items():
        run.measure("decode", (b, sk, name), lambda fn=fn: time_jax(jax.jit(fn), (q, k, v), iters, reps))
    if torch is None:
        return
    tk = {}

    def tensors():  # [B, H, S, D], made once (inside a measurement: a failure is that row's)
        if not tk:
            tk["t"] = tuple(torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v))
        return tk["t"]

    for name, backend in ((FA2, "FLASH_ATTENTION"), (TORCH_CUDNN, "CUDNN_ATTENTION")):
        def one(backend=backend):
            backend = getattr(SDPBackend, backend)
            qt, kt, vt = tensors()
            step = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, scale=scale, enable_gqa=True)
            with torch.no_grad(), sdpa_kernel(backend):
                return time_torch(step, iters, reps)
        run.measure("decode", (b, sk, name), one)


def bench_prefill(run, gpu, d, causal, s, paths, iters, reps, with_xla, sm90_dims, key_mask=False):
    b = max(1, TOKENS // s)
    scale = 1.0 / np.sqrt(d)
    key = lambda name: (d, causal, s, b, name)
    with_xla = with_xla and not key_mask
    with_torch = torch is not None and not key_mask
    names = [PATH_NAMES[p] for p in paths] + [JAX_CUDNN] + ([XLA] if with_xla else []) + \
        ([FA2, TORCH_CUDNN] if with_torch else [])
    if run.past_deadline():  # no inputs to make: every row of this shape is skipped
        for name in names:
            run.measure("prefill", key(name), None)
        return
    try:
        rng = np.random.default_rng(1000 * d + 10 * s + causal)
        mk = lambda *sh: jax.device_put(jnp.asarray(rng.standard_normal(sh, np.float32), jnp.bfloat16), gpu)
        q, k, v, do = mk(b, s, H, d), mk(b, s, H, d), mk(b, s, H, d), mk(b, s, H, d)
        kv = jax.device_put(np.full(b, s, np.int32), gpu)
        qs = jax.device_put(np.zeros(b, np.int32), gpu)
        lens = jax.device_put(rng.integers(s // 2, s + 1, b).astype(np.int32), gpu) if key_mask else None
    except Exception as e:
        for name in names:
            run.note_row("prefill", key(name), f"inputs: {err(e)}")
        return
    impls = jax_impls(causal, scale, lens)
    for path in paths:
        if path == "sm90" and d not in sm90_dims:
            run.note_row("prefill", key(OURS_SM90), f"skipped (D={d} not in --sm90-dims)")
            continue

        def one(path=path):
            set_path(path)
            try:
                return bench_jax(impls[OURS], q, k, v, kv, qs, do, iters, reps)
            finally:
                set_path(None)
        run.measure("prefill", key(PATH_NAMES[path]), one)
    run.measure("prefill", key(JAX_CUDNN), lambda: bench_jax(impls[JAX_CUDNN], q, k, v, kv, qs, do, iters, reps))
    if with_xla:
        if s > XLA_MAX_S:
            run.note_row("prefill", key(XLA), f"skipped (S > {XLA_MAX_S})")
        else:
            run.measure("prefill", key(XLA), lambda: bench_jax(impls[XLA], q, k, v, kv, qs, do, iters, reps))
    if with_torch:
        for name, backend in ((FA2, "FLASH_ATTENTION"), (TORCH_CUDNN, "CUDNN_ATTENTION")):
            run.measure("prefill", key(name), lambda backend=backend: bench_torch(
                getattr(SDPBackend, backend), q, k, v, do, causal, scale, iters, reps))


# ---------------------------------------------------------------------------------------------
# The report (pure: --selftest runs it)
# ---------------------------------------------------------------------------------------------

def fmt(r, digits=1):
    return r if isinstance(r, str) else f"{r:.{digits}f}"


def ok(r):
    return r is not None and not isinstance(r, str)


def peer_table(by):
    """'ours / best peer' lines: per (D, causal, S), for each of our paths present, best peer's
    time / ours, forward and backward; best peer = the fastest of PEERS in that row and direction."""
    ours = [n for n in (OURS, OURS_MMA, OURS_SM90) if any(k[3] == n for k in by)]
    shapes = sorted({k[:3] for k in by})
    if not ours or not any(ok(by.get(sh + (p,))) for sh in shapes for p in PEERS):
        return []
    head = "| D | causal | S | " + " | ".join(f"{SHORT[n]} fwd | {SHORT[n]} bwd" for n in ours) + " | best peer fwd | best peer bwd |"
    lines = ["", "Ours / best peer: the best peer's time / ours (> 1: ours faster; best peer = the fastest of FA2, "
             "PyTorch cuDNN, jax cuDNN in that row and direction; sm90's backward is the mma.sync one):", "",
             head, "|" + " --- |" * (5 + 2 * len(ours))]
    for sh in shapes:
        cells = [str(x) for x in sh]
        best = []
        for i in (0, 1):
            cand = [(by[sh + (p,)][i], p) for p in PEERS if ok(by.get(sh + (p,)))]
            best.append(min(cand) if cand else None)
        for n in ours:
            r = by.get(sh + (n,))
            for i in (0, 1):
                cells.append(f"{best[i][0] / r[i]:.2f}" if ok(r) and best[i] else "-")
        cells += [SHORT[bp[1]] if bp else "-" for bp in best]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def decode_table(decode):
    """decode: (b, sk, name, seconds or string). One row per implementation, us and TB/s of K/V per shape."""
    shapes = sorted({(b, sk) for b, sk, _, _ in decode}, key=lambda x: (x[1], x[0]))
    names = list(dict.fromkeys(n for _, _, n, _ in decode))
    res = {(b, sk, n): r for b, sk, n, r in decode}
    lines = ["", f"Decode: Sq=1, H={DEC_H} over Hkv={DEC_HKV}, D={DEC_D}, bf16, forward; TB/s of K/V read per call ("
             + ", ".join(f"B={b} Sk={sk}: {kv_bytes_decode(b, sk) / 1e9:.3f} GB" for b, sk in shapes) + ").", "",
             "| implementation | " + " | ".join(f"B={b} Sk={sk} us | TB/s" for b, sk in shapes) + " |",
             "| --- |" + " --- | --- |" * len(shapes)]
    for n in names:
        cells = [n]
        for b, sk in shapes:
            t = res.get((b, sk, n))
            if ok(t):
                cells += [f"{t * 1e6:.1f}", f"{kv_bytes_decode(b, sk) / t / 1e12:.2f}"]
            else:
                cells += ["" if t is None else t, ""]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(meta, rows, decode, quick=False):
    """Markdown for one run. rows: (d, causal, s, b, name, result) with result (tf, tb, mf, mb)
    seconds/bytes or a string; decode: [(b, sk, name, seconds or string)] (empty: none)."""
    lines = [f"## CUDA {'quick run (--quick)' if quick else 'run'} {meta['date']} on {meta['gpu']}", "",
             f"`bench/bench_cuda.py`; {meta['versions']}. " + (meta["settings"] + " " if meta.get("settings") else "") +
             f"bf16, H={H}, B*S={TOKENS}; "
             f"TFLOP/s (higher is better), memory beyond inputs in MiB; "
             + ("no XLA prefill rows (--quick)." if quick else f"XLA's unfused attention only up to S={XLA_MAX_S}.")]
    if meta.get("note"):
        lines += ["", f"**{meta['note']}**"]
    lines += ["", "| D | causal | S | B | implementation | fwd TFLOP/s | bwd TFLOP/s | fwd MiB | fwd+bwd MiB |",
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
    lines += peer_table(by)
    # The bar, from the rows that have both sides.
    fa2_rat, xla_rat = [], []
    for (d, causal, s, name), r in by.items():
        if name != OURS or not ok(r) or s < 1024:
            continue
        f = by.get((d, causal, s, FA2))
        if ok(f):
            fa2_rat.append((d, causal, s, f[0] / r[0], f[1] / r[1]))
        x = by.get((d, causal, s, XLA))
        if ok(x):
            xla_rat.append((d, causal, s, (x[0] + x[1]) / (r[0] + r[1])))
    for other in (OURS_MMA, OURS_SM90):
        rat = []
        for (d, causal, s, name), r in by.items():
            m = by.get((d, causal, s, other))
            if name == OURS and ok(r) and ok(m):
                rat.append((d, causal, s, m[0] / r[0], m[1] / r[1]))
        if rat:
            lines += ["", f"{SHORT[other]} time / default path (auto; the backward is mma.sync in both, so bwd ~ 1.0):", "",
                      "| D | causal | S | fwd | bwd |", "| --- | --- | --- | --- | --- |"]
            lines += [f"| {d} | {c} | {s} | {f:.2f} | {bw:.2f} |" for d, c, s, f, bw in sorted(rat)]
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
    if decode:
        lines += decode_table(decode)
        bar = [r for b, sk, n, r in decode if (b, sk, n) == (DEC_B, DEC_SK, OURS)]
        if bar:
            verdicts.append(("decode >= 2 TB/s", ok(bar[0]) and kv_bytes_decode() / bar[0] / 1e12 >= 2.0))
    if verdicts:
        lines += ["", "Bar: " + "; ".join(f"{n}: {'met' if good else 'NOT met'}" for n, good in verdicts) + "."]
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
        try:
            v.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
        except Exception as e:
            v.append(f"torch ? ({err(e)})")
    try:
        import subprocess
        drv = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.strip()
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
                  [(DEC_B, DEC_SK, OURS, kv_bytes_decode() / 2.5e12), (DEC_B, DEC_SK, FA2, kv_bytes_decode() / 3.0e12),
                   (DEC_B, DEC_SK, XLA, "OOM")])
    assert "| 128 | True | 8192 | 2.00 | 1.00 |" in text, text
    assert "skipped" in text and "Bar: ours >= FA2: NOT met; fwd+bwd >= 2x XLA: met; decode >= 2 TB/s: met." in text, text
    assert "| exla_rs (XLA FFI) | 429.5 | 2.50 |" in text, text
    # Ours / best peer in a full run (auto, mma; FA2 the only peer).
    assert "| 64 | False | 1024 | 1.10 | 0.96 | 0.55 | 0.96 | FA2 | FA2 |" in text, text
    print(text)
    print("--- quick ---")
    selftest_quick()


def selftest_quick():
    """The --quick report on made-up numbers: the ratio table (best peer per row and direction,
    failed and skipped rows) and decode at two Sk."""
    rows = []
    for d in (64, 128):
        for causal in (False, True):
            for s in (4096, 16384):
                b = TOKENS // s
                t = flops(b, s, d, causal) / 200e12  # mma: 200 TFLOP/s forward, 100 backward
                mem = (2**20, 2**21)
                rows.append((d, causal, s, b, OURS_MMA, (t, 5 * t) + mem))
                rows.append((d, causal, s, b, OURS_SM90, (t / 2, 5 * t) + mem if (d, causal, s) != (64, True, 16384) else SKIP_DEADLINE))
                rows.append((d, causal, s, b, FA2, (0.6 * t, 2.0 * t) + mem))
                rows.append((d, causal, s, b, TORCH_CUDNN, (0.3 * t, 1.5 * t) + mem if d == 128 else "RuntimeError: no cuDNN"))
                rows.append((d, causal, s, b, JAX_CUDNN, (0.4 * t, 1.25 * t) + mem if s == 4096 else "XlaRuntimeError: refused"))
    dec = []
    for sk in (4096, 32768):
        g = kv_bytes_decode(DEC_B, sk)
        dec += [(DEC_B, sk, OURS_MMA, g / 0.4e12), (DEC_B, sk, OURS_SM90, g / 0.5e12), (DEC_B, sk, FA2, g / 3.0e12),
                (DEC_B, sk, TORCH_CUDNN, "RuntimeError: no kernel"), (DEC_B, sk, JAX_CUDNN, g / 4.0e12),
                (DEC_B, sk, XLA, g / 1.0e12 if sk == 4096 else SKIP_DEADLINE)]
    meta = {"date": "2026-01-01 00:00 UTC", "gpu": "selftest", "versions": "none, driver 0", "settings": "iters 5, best of 2;"}
    text = report(meta, rows, dec, quick=True)
    assert text.startswith("## CUDA quick run (--quick) 2026-01-01 00:00 UTC on selftest"), text
    assert "| D | causal | S | mma fwd | mma bwd | sm90 fwd | sm90 bwd | best peer fwd | best peer bwd |" in text, text
    # D=128: PyTorch cuDNN fastest both ways (0.3 fwd, 1.5 bwd), except jax cuDNN's bwd 1.25 at S=4096.
    assert "| 128 | False | 4096 | 0.30 | 0.25 | 0.60 | 0.25 | PyTorch cuDNN | jax cuDNN |" in text, text
    assert "| 128 | True | 16384 | 0.30 | 0.30 | 0.60 | 0.30 | PyTorch cuDNN | PyTorch cuDNN |" in text, text
    # D=64: PyTorch cuDNN failed; jax cuDNN at 4096, FA2 at 16384 (jax refused); sm90 skipped there.
    assert "| 64 | False | 4096 | 0.40 | 0.25 | 0.80 | 0.25 | jax cuDNN | jax cuDNN |" in text, text
    assert "| 64 | True | 16384 | 0.60 | 0.40 | - | - | FA2 | FA2 |" in text, text
    assert "| 64 | True | 16384 | 1 | exla_rs sm90 (EXLA_RS_CUDA_PATH=sm90) | skipped (deadline) | | | |" in text, text
    assert "| implementation | B=8 Sk=4096 us | TB/s | B=8 Sk=32768 us | TB/s |" in text, text
    g4, g32 = kv_bytes_decode(DEC_B, 4096), kv_bytes_decode(DEC_B, 32768)
    assert f"| {OURS_MMA} | {g4 / 0.4e12 * 1e6:.1f} | 0.40 | {g32 / 0.4e12 * 1e6:.1f} | 0.40 |" in text, text
    assert f"| {OURS_SM90} | {g4 / 0.5e12 * 1e6:.1f} | 0.50 | {g32 / 0.5e12 * 1e6:.1f} | 0.50 |" in text, text
    assert f"| {XLA} | {g4 / 1.0e12 * 1e6:.1f} | 1.00 | skipped (deadline) |  |" in text, text
    assert f"| {TORCH_CUDNN} | RuntimeError: no kernel |  | RuntimeError: no kernel |  |" in text, text
    assert "Bar:" not in text and "XLA fwd+bwd" not in text, text  # no auto path, no XLA prefill: no verdicts
    assert "| 16384 | 1 |" in text and "| 4096 | 4 |" in text, text
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "bench/RESULTS.md"), help="markdown file every run is appended to")
    ap.add_argument("--quick", action="store_true", help="the ~2-minute run (module docstring)")
    ap.add_argument("--seqs", default=None, help="default 1024,2048,4096,8192,16384 (--quick: 4096,16384)")
    ap.add_argument("--dims", default=None, help="default 64,128,256 (--quick: 128,64)")
    ap.add_argument("--iters", type=int, default=None, help="calls per timed run: default 10 (--quick: 5)")
    ap.add_argument("--reps", type=int, default=None, help="timed runs, the best counts: default 3 (--quick: 2)")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-sk", default="4096,32768", help="decode KV lengths (B=8)")
    ap.add_argument("--paths", default=None, help="our kernel choices to time: auto, mma, sm90 (default auto,mma; --quick: mma,sm90)")
    ap.add_argument("--sm90-dims", default="64,128,256", help="head dims at which the sm90 path is timed")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start after which rows are skipped (default none; --quick: 110)")
    ap.add_argument("--key-mask", action="store_true", help="prefill rows with a padding key mask, as Bumblebee calls (module docstring)")
    ap.add_argument("--selftest", action="store_true", help="check the report logic without a GPU")
    a = ap.parse_args()
    if a.selftest:
        return selftest()
    q = a.quick
    dims = [int(x) for x in (a.dims or ("128,64" if q else "64,128,256")).split(",")]  # quick: D=128 first
    seqs = [int(x) for x in (a.seqs or ("4096,16384" if q else "1024,2048,4096,8192,16384")).split(",")]
    iters, reps = a.iters or (5 if q else 10), a.reps or (2 if q else 3)
    paths = [p.strip() for p in (a.paths or ("mma,sm90" if q else "auto,mma")).split(",") if p.strip()]
    bad = [p for p in paths if p not in PATH_NAMES]
    if bad:
        ap.error(f"--paths: {bad} (expected {', '.join(PATH_NAMES)})")
    sm90_dims = {int(x) for x in a.sm90_dims.split(",") if x.strip()}
    deadline = a.deadline if a.deadline is not None else (110.0 if q else None)
    decode_sk = [] if a.no_decode else [int(x) for x in a.decode_sk.split(",")]

    gpu = jax.devices("gpu")[0]
    try:
        ex.load("cuda")
    except Exception as e:  # every row of ours then carries the error
        print("exla_rs: load failed:", err(e), flush=True)
    settings = f"iters {iters}, best of {reps}" + (f", deadline {deadline:.0f} s" if deadline is not None else "") + \
        ("" if torch is not None else ", PyTorch absent") + \
        (", every prefill call with a padding key mask (batch row b sees its first lens[b] in [S/2, S] keys; "
         "jax cuDNN: key_value_seq_lengths; no PyTorch rows)" if a.key_mask else "") + ";"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": gpu.device_kind,
            "versions": versions(), "settings": settings}
    print(f"# {meta['gpu']}; {meta['versions']}; {settings}", flush=True)
    run = Run(deadline, a.results, meta, q)
    run.start_watchdog()
    run.on_sigterm()
    # Decode first: cheap, and its table is wanted even when the prefill rows run out of time.
    for sk in decode_sk:
        bench_decode(run, DEC_B, sk, paths, iters, reps)
    for d in dims:
        for causal in (False, True):
            for s in seqs:
                bench_prefill(run, gpu, d, causal, s, paths, iters, reps, not q, sm90_dims, a.key_mask)
    set_path(None)
    run.finish()


if __name__ == "__main__":
    main()
