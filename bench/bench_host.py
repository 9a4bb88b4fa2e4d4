"""Host (CPU) benchmark: our flash-attention FFI handlers vs XLA's own attention, both under jit.

    .venv/jax-0.10.2/bin/python bench/bench_host.py            # full table, updates bench/RESULTS.md
    .venv/jax-0.10.2/bin/python bench/bench_host.py --quick    # S=1024 only, no file update
    .venv/jax-0.10.2/bin/python bench/bench_host.py --extras [--old-lib OLD.so]   # key_mask/bias/ALiBi, S=2048

Ours: `exla_rs_jax.attention` (test/xla/exla_rs_jax.py), a jax.custom_vjp over the
`exla_rs_flash_attn_fwd/bwd` targets, so jax.grad runs our backward kernel.
XLA:  `jax.nn.dot_product_attention(q, k, v, is_causal=..., implementation="xla")` and its jax.grad.
Shapes: B=1, H=8, D=64, f32, S in {1024, 2048, 4096}, causal and not.
"fwd" times o = attn(q, k, v); "fwd+bwd" times jax.grad of sum(attn(q, k, v) * do) w.r.t. q, k, v.

Every (S, causal, impl, pass) runs in its own child process, so its VmHWM (peak RSS, from
/proc/self/status) is that configuration's alone; we report peak minus the RSS measured right
after the inputs exist (so the inputs and the Python/JAX runtime are not counted).
Inputs are fresh standard-normal draws (seeded per run), never zeros. Before timing, a check
child compares ours, XLA and a float64 numpy reference at small S, and ours vs XLA at S=2048.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "test/xla"))

B, H, D = 1, 8, 64
SCALE = 1.0 / D**0.5


def rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def make_inputs(s: int, seed: int):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    q, k, v, do = (jnp.asarray(rng.standard_normal((B, s, H, D), dtype=np.float32)) for _ in range(4))
    return q, k, v, do


def build(impl: str, pass_: str, s: int, causal: bool, do):
    """The jitted function of (q, k, v) for one configuration."""
    import jax
    import jax.numpy as jnp

    if impl == "ours":
        import exla_rs_jax as ex

        kv_len = jnp.full((B,), s, jnp.int32)
        q_start = jnp.zeros((B,), jnp.int32)
        wl, wr = ex.window(causal)
        attn = lambda q, k, v: ex.attention(q, k, v, kv_len, q_start, SCALE, 0.0, wl, wr, "cpu")
    else:
        attn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, implementation="xla")
    if pass_ == "fwd":
        return jax.jit(attn)
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v) * do), argnums=(0, 1, 2)))


def child_time(args) -> dict:
    import jax

    q, k, v, do = make_inputs(args.s, args.seed)
    jax.block_until_ready((q, k, v, do))
    base = rss_kb("VmRSS")
    f = build(args.impl, args.pass_, args.s, args.causal, do)
    jax.block_until_ready(f(q, k, v))  # compile + warm up
    jax.block_until_ready(f(q, k, v))
    times = []
    for _ in range(args.reps):
        t = time.perf_counter()
        jax.block_until_ready(f(q, k, v))
        times.append(time.perf_counter() - t)
    times.sort()
    return {"best_ms": 1e3 * times[0], "median_ms": 1e3 * times[len(times) // 2], "peak_kb": rss_kb("VmHWM"), "base_kb": base}


def rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def child_check(args) -> dict:
    """Ours vs XLA vs float64 at a small S (float64 grads via jax.grad of the jnp reference under
    x64), and ours vs XLA at S=2048."""
    import jax

    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    import exla_rs_jax as ex

    out = {}
    for s, with_ref in ((256, True), (2048, False)):
        q, k, v, do = make_inputs(s, args.seed + s)
        for causal in (False, True):
            key = f"S={s} {'causal' if causal else 'full'}"
            o_ours = build("ours", "fwd", s, causal, do)(q, k, v)
            o_xla = build("xla", "fwd", s, causal, do)(q, k, v)
            g_ours = build("ours", "bwd", s, causal, do)(q, k, v)
            g_xla = build("xla", "bwd", s, causal, do)(q, k, v)
            r = {"o ours~xla": rel(o_ours, o_xla)}
            for n, a, b in zip(("dq", "dk", "dv"), g_ours, g_xla):
                r[f"{n} ours~xla"] = rel(a, b)
            if with_ref:
                kv_len, q_start = np.full((B,), s, np.int32), np.zeros((B,), np.int32)
                wl, wr = ex.window(causal)
                kw = dict(scale=SCALE, window_left=wl, window_right=wr)
                ref_o, _ = ex.reference_fwd(q, k, v, kv_len, q_start, **kw)
                r["o ours~f64"] = rel(o_ours, ref_o)
                r["o xla~f64"] = rel(o_xla, ref_o)
                f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
                dof = f64(do)
                ref_g = jax.grad(lambda a, b, c: jnp.sum(ex.reference_jax(a, b, c, kv_len, q_start, **kw) * dof), argnums=(0, 1, 2))(f64(q), f64(k), f64(v))
                for n, a, b, c in zip(("dq", "dk", "dv"), g_ours, g_xla, ref_g):
                    r[f"{n} ours~f64"] = rel(a, c)
                    r[f"{n} xla~f64"] = rel(b, c)
            out[key] = r
    return out


# ---------------------------------------------------------------------------------------------
# Optional operands (key_mask, bias, ALiBi) side by side with kv_len only, and the old library
# ---------------------------------------------------------------------------------------------

EXTRAS_S = 2048
# name -> (keyword arguments of flash_attn_*, whether the old library can run it). kv_len is S
# unless the name says 3/4; "mask left 1/4" hides the first S/4 keys (as many as kv_len 3/4 hides,
# so both skip the same number of key tiles).
EXTRAS_CONFIGS = {
    "kv_len only": ({}, True),
    "causal": ({"causal": True}, True),
    "kv_len 3/4": ({"kv34": True}, True),
    "key_mask (all visible)": ({"mask": "all"}, False),
    "key_mask right 3/4": ({"mask": "right34"}, False),
    "key_mask left 1/4": ({"mask": "left14"}, False),
    "ALiBi": ({"alibi": True}, False),
    "ALiBi causal": ({"alibi": True, "causal": True}, False),
    "bias {1,H,S,S}": ({"bias": True}, False),
    "dropout 0.1": ({"dropout": 0.1}, False),
    "dropout 0.1 causal": ({"dropout": 0.1, "causal": True}, False),
}
DROPOUT_ONLY = ("dropout 0.1", "dropout 0.1 causal")
DROPOUT_CONFIGS = ("kv_len only", "dropout 0.1", "causal", "dropout 0.1 causal")


def build_extras(name: str, pass_: str, s: int, seed: int):
    """The jitted (q, k, v, do, bias) -> outputs of one configuration, calling the targets
    directly (fwd+bwd = the forward then the backward, dbias included when there is a bias)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import exla_rs_jax as ex

    spec, _ = EXTRAS_CONFIGS[name]
    kv = s * 3 // 4 if spec.get("kv34") else s
    kv_len = jnp.full((B,), kv, jnp.int32)
    q_start = jnp.zeros((B,), jnp.int32)
    wl, wr = ex.window(spec.get("causal", False))
    kw = dict(scale=SCALE, window_left=wl, window_right=wr)
    mask = spec.get("mask")
    if mask:
        j = np.arange(s)[None, :]
        m = {"all": j >= 0, "right34": j < s * 3 // 4, "left14": j >= s // 4}[mask]
        kw["key_mask"] = jnp.asarray(np.broadcast_to(m, (B, s)).astype(np.uint8))
    if spec.get("alibi"):
        kw["alibi_slopes"] = jnp.asarray((2.0 ** (-8.0 * (np.arange(H) + 1) / H)).astype(np.float32))
    use_bias = spec.get("bias", False)
    if spec.get("dropout"):
        # A fresh key per run (never all zero), as Nx.Random.key/1 would give.
        kw["dropout_key"] = jnp.asarray(np.random.default_rng(seed + 2).integers(1, 2**32, 2, dtype=np.uint64).astype(np.uint32))
        kw["dropout_rate"] = spec["dropout"]

    def fwd(q, k, v, do, bias):
        extra = dict(kw, bias=bias) if use_bias else kw
        return ex.flash_attn_fwd(q, k, v, kv_len, q_start, **extra)

    def fwd_bwd(q, k, v, do, bias):
        extra = dict(kw, bias=bias) if use_bias else kw
        o, lse = ex.flash_attn_fwd(q, k, v, kv_len, q_start, **extra)
        return ex.flash_attn_bwd(q, k, v, kv_len, q_start, o, lse, do, **extra, bias_grad=use_bias)

    return jax.jit(fwd if pass_ == "fwd" else fwd_bwd)


def child_extras(args) -> dict:
    """Times every configuration in args.configs round-robin (each rep runs them all in turn,
    so load changes hit all of them alike) with the library in $EXLA_RS_XLA_LIB."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    s = args.s
    q, k, v, do = make_inputs(s, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    bias = jnp.asarray(rng.standard_normal((1, H, s, s), dtype=np.float32))
    jax.block_until_ready((q, k, v, do, bias))
    fns = {}
    for key in args.configs.split(";"):
        if key == "bias read":
            # A plain read of the same bias (XLA's reduction): the cost of reading it once.
            fns[key] = jax.jit(lambda q, k, v, do, b: jnp.sum(b))
            continue
        if key == "bias copy":
            # One read of the bias and one write of a fresh array of its size (XLA's negation):
            # what the backward's dbias costs at the least (XLA allocates that result anew, so the
            # first touch of its pages is in both).
            fns[key] = jax.jit(lambda q, k, v, do, b: -b)
            continue
        name, pass_ = key.rsplit("|", 1)
        fns[key] = build_extras(name, pass_, s, args.seed)
    for f in fns.values():
        jax.block_until_ready(f(q, k, v, do, bias))
        jax.block_until_ready(f(q, k, v, do, bias))
    times = {key: [] for key in fns}
    cpu = {key: [] for key in fns}
    for _ in range(args.reps):
        for key, f in fns.items():
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(f(q, k, v, do, bias))
            times[key].append(time.perf_counter() - t)
            cpu[key].append(time.process_time() - c)
    # CPU time (all threads of this process) as well as wall time: on a shared machine other jobs
    # stretch the wall clock, while the CPU time our threads spend moves much less.
    # Every rep's times as well: the parent pairs the reps of two configurations (timed one right
    # after the other) to take their difference where the machine's speed was the same.
    return {
        key: {"best_ms": 1e3 * min(t), "median_ms": 1e3 * sorted(t)[len(t) // 2], "wall_reps": [1e3 * x for x in t], "cpu_reps": [1e3 * x for x in cpu[key]]}
        for key, t in times.items()
    }


def reference_of(name: str) -> str:
    """The configuration an extras row is compared with: the same call without the option."""
    if name in ("ALiBi causal", "dropout 0.1 causal"):
        return "causal"
    if name in ("key_mask right 3/4", "key_mask left 1/4"):
        return "kv_len 3/4"
    return "kv_len only"


def run_extras(args) -> None:
    """The extras table: new library (every configuration) and, when --old-lib is given, the
    previous library (the configurations it has) in alternating child processes."""
    s = EXTRAS_S if not args.quick else 512
    seed = args.seed
    # --dropout: only dropout beside its two references, in its own section (issue 11).
    names = list(DROPOUT_CONFIGS) if args.dropout else [n for n in EXTRAS_CONFIGS if n not in DROPOUT_ONLY]
    if args.only:
        # --only "ALiBi;bias {1,H,S,S}": a quick look at a few configurations, with the ones they
        # are compared with (never written to RESULTS.md).
        only = args.only.split(";")
        keep = set(only) | {"kv_len only"} | {reference_of(n) for n in only}
        names = [n for n in names if n in keep]
    new_keys = [f"{n}|{p}" for n in names for p in ("fwd", "fwd+bwd")] + ([] if args.dropout else ["bias read", "bias copy"])
    old_keys = [f"{n}|{p}" for n in names if EXTRAS_CONFIGS[n][1] for p in ("fwd", "fwd+bwd")]
    new_lib = str(Path(os.environ.get("EXLA_RS_XLA_LIB", ROOT / "native/exla_rs/target/release/libexla_rs_xla.so")))
    best: dict = {}
    for rnd in range(args.rounds):
        libs = [("new", new_lib, new_keys)] + ([("old", args.old_lib, old_keys)] if args.old_lib else [])
        if rnd % 2:
            libs.reverse()
        for tag, lib, keys in libs:
            env = dict(os.environ, EXLA_RS_XLA_LIB=lib)
            cmd = [sys.executable, __file__, "--child", "--extras", "--s", str(s), "--reps", str(args.reps), "--seed", str(seed), "--configs", ";".join(keys)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode != 0:
                raise RuntimeError(f"{tag} child failed:\n{res.stderr[-3000:]}")
            out = json.loads(res.stdout.strip().splitlines()[-1])
            for key, r in out.items():
                cur = best.setdefault((tag, key), {"medians": [], "wall_reps": [], "cpu_reps": []})
                cur["medians"].append(r["median_ms"])
                cur["wall_reps"] += r["wall_reps"]
                cur["cpu_reps"] += r["cpu_reps"]
            print(f"round {rnd} {tag}: " + ", ".join(f"{k} {v['best_ms']:.0f}" for k, v in out.items()), flush=True)

    med = lambda xs: sorted(xs)[len(xs) // 2]

    def get(tag, key):
        """(best wall, median of the rounds' medians, best CPU) over every rep of every round."""
        r = best.get((tag, key))
        return (min(r["wall_reps"]), med(r["medians"]), min(r["cpu_reps"])) if r else None

    def paired(tag, key, ref_key):
        """Median over reps of (key's time - ref_key's time in the same rep), wall and CPU: the
        machine's speed drifts by tens of percent over minutes on a shared VM, and two calls timed
        back to back see the same speed, where the best of each may come from different moments."""
        a, b = best.get((tag, key)), best.get((tag, ref_key))
        return tuple(med([x - y for x, y in zip(a[f], b[f])]) for f in ("wall_reps", "cpu_reps"))

    def median_of(tag, key):
        r = best.get((tag, key))
        return tuple(med(r[f]) for f in ("wall_reps", "cpu_reps"))

    bias_mib = H * s * s * 4 / 2**20
    read = get("new", "bias read")
    copy = get("new", "bias copy")
    title = "## Host (CPU): dropout (issue 11)" if args.dropout else "## Host (CPU): key mask, bias, ALiBi (issue 10)"
    lines = [
        title,
        "",
        f"Run {time.strftime('%Y-%m-%d')} by `bench/bench_host.py --extras{' --dropout' if args.dropout else ''}{' --old-lib ...' if args.old_lib else ''}` (seed {seed}). Machine: {machine()}.",
        f"S={s}, B=1, H=8, D=64, f32, self-attention, q_start = 0. Each configuration calls the targets directly under `jax.jit`",
        "(\"fwd+bwd\" = the forward then the backward, with `dbias` when there is a bias). All configurations of one library",
        "run round-robin in one process (every rep times each in turn), and the processes of the new and the old",
        f"library alternate, {args.rounds} rounds of {args.reps} reps: times are the best over all (median of the rounds' medians in brackets).",
        f"Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.",
        "",
        "CPU ms = the least process CPU time (all threads) of one call: other jobs on the machine stretch the wall",
        "clock much more than they change it, so the ratios are given for both. In square brackets: the paired ratio,",
        "the median over reps of (configuration - reference, timed back to back in the same rep) over the reference's",
        "median, steadier than best against best where the machine's speed drifts.",
        "",
        "| configuration | pass | wall ms | CPU ms | vs kv_len only (wall / CPU) | old library wall ms | old CPU ms | new / old (wall / CPU) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        for p in ("fwd", "fwd+bwd"):
            key = f"{name}|{p}"
            new = get("new", key)
            old = get("old", key)
            ref_name = reference_of(name)
            ref = get("new", f"{ref_name}|{p}")
            ratio = f"{(new[0] / ref[0] - 1) * 100:+.1f}% / {(new[2] / ref[2] - 1) * 100:+.1f}%"
            if name != "kv_len only":
                # Paired: the median per-rep difference over the reference's median time.
                (pw, pc), (mw, mc) = paired("new", key, f"{ref_name}|{p}"), median_of("new", f"{ref_name}|{p}")
                ratio += f" [{pw / mw * 100:+.1f}% / {pc / mc * 100:+.1f}%]"
            ratio += "" if ref_name == "kv_len only" else f" (vs {ref_name})"
            lines.append(
                f"| {name} | {p} | {new[0]:.1f} ({new[1]:.1f}) | {new[2]:.1f} | {ratio if name != 'kv_len only' else '—'} | "
                + (f"{old[0]:.1f} ({old[1]:.1f}) | {old[2]:.1f} | {new[0] / old[0]:.3f} / {new[2] / old[2]:.3f} |" if old else "— | — | — |")
            )
    lines += [""]
    if read and copy and get("new", "bias {1,H,S,S}|fwd"):
        # The bar: the forward's extra ≤ one read; the backward (with dbias) adds at most one more
        # read and one write of a fresh dbias, i.e. XLA's `-bias`.
        lines.append(
            f"- Yardsticks, bias {{1,H,S,S}} f32 = {bias_mib:.0f} MiB, by XLA in the same process: one read (`jnp.sum(bias)`) "
            f"{read[0]:.1f} wall / {read[2]:.1f} CPU ms ({bias_mib / 1024 / (read[0] / 1e3):.1f} GiB/s); one read + one write of a fresh "
            f"array (`-bias`) {copy[0]:.1f} wall / {copy[2]:.1f} CPU ms."
        )
        for p, allow_wall, allow_cpu, what in (
            ("fwd", read[0], read[2], "1 read"),
            ("fwd+bwd", read[0] + copy[0], read[2] + copy[2], "1 read + (1 read + 1 write)"),
        ):
            new, base = get("new", f"bias {{1,H,S,S}}|{p}"), get("new", f"kv_len only|{p}")
            dw, dc = new[0] - base[0], new[2] - base[2]
            # The same bar on paired reps: median of (bias - kv_len only) per rep against the
            # medians of the yardsticks.
            pw, pc = paired("new", f"bias {{1,H,S,S}}|{p}", f"kv_len only|{p}")
            (rw, rc), (cw, cc) = median_of("new", "bias read"), median_of("new", "bias copy")
            aw, ac = (rw, rc) if p == "fwd" else (rw + cw, rc + cc)
            lines.append(
                f"- {p}: +{dw:.1f} wall / +{dc:.1f} CPU ms over kv_len only (best against best), against {what} = {allow_wall:.1f} wall / {allow_cpu:.1f} CPU ms: "
                f"{dw / allow_wall:.2f} / {dc / allow_cpu:.2f} of the allowance. Paired reps (median of the per-rep difference, against the "
                f"yardsticks' medians {aw:.1f} wall / {ac:.1f} CPU ms): +{pw:.1f} wall / +{pc:.1f} CPU ms, {pw / aw:.2f} / {pc / ac:.2f} of the allowance."
            )
    section = "\n".join(lines) + "\n"
    print(section)
    if not (args.quick or args.no_write or args.only):
        path = ROOT / "bench/RESULTS.md"
        text = path.read_text()
        pat = re.compile("^" + re.escape(title) + r".*?(?=^## |\Z)", re.S | re.M)
        text = pat.sub(lambda _: section, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + section
        path.write_text(text)


def spawn(extra: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--child", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def machine() -> str:
    model = "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except Exception:
        pass
    import jax

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    widest = "AVX-512" if " avx512f" in flags else "AVX2+FMA" if " avx2" in flags and " fma" in flags else "scalar"
    isa = os.environ.get("EXLA_RS_HOST_ISA", f"widest available ({widest} here)")
    have = set(re.search(r"^flags\s*:(.*)$", flags, re.M).group(1).split()) if "flags" in flags else set()
    isa_flags = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16") if f in have]
    return f"{model} ({' '.join(isa_flags)}), {os.cpu_count()} cores, {platform.system()} {platform.release()}; jax {jax.__version__}; Host kernel ISA: {isa}"


def update_results(section: str) -> None:
    path = ROOT / "bench/RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    pat = re.compile(r"^## Host \(CPU\)\n.*?(?=^## |\Z)", re.S | re.M)
    text = pat.sub(lambda _: section, text) if pat.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


TORCH_TITLE = "## Host (CPU) against PyTorch's CPU flash attention"


def append_torch_section(run: str) -> None:
    """Adds a run at the end of RESULTS.md's PyTorch section (earlier runs stay: other machines)."""
    path = ROOT / "bench/RESULTS.md"
    text = path.read_text()
    pat = re.compile("^" + re.escape(TORCH_TITLE) + r"\n.*?(?=^## |\Z)", re.S | re.M)
    m = pat.search(text)
    if not m:
        text = text.rstrip("\n") + "\n\n" + TORCH_TITLE + "\n\n" + run
    else:
        text = text[: m.end()].rstrip("\n") + "\n\n" + run + "\n" + text[m.end():]
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--impl", default="ours")
    ap.add_argument("--pass", dest="pass_", default="fwd")
    ap.add_argument("--s", type=int, default=1024)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=int.from_bytes(os.urandom(4), "little"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="sequence lengths (default 1024,2048,4096; with --torch 512,...,8192)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--extras", action="store_true", help="key_mask / bias / ALiBi vs kv_len only at S=2048 (own RESULTS.md section)")
    ap.add_argument("--dropout", action="store_true", help="with --extras: dropout 0.1 vs none at S=2048 (own RESULTS.md section)")
    ap.add_argument("--old-lib", help="a libexla_rs_xla.so of the previous code, timed alternately with the current one (--extras)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="")
    ap.add_argument("--only", default="", help="extras: only these configurations (';'-separated names)")
    ap.add_argument("--torch", action="store_true", help="side by side with PyTorch's CPU SDPA (bench/torch_peer.py; needs .venv/bench)")
    ap.add_argument("--dims", default="64,128", help="--torch: head dims")
    ap.add_argument("--dtypes", default="f32,bf16", help="--torch: element types")
    ap.add_argument("--decode-only", action="store_true", help="--torch: only the decode table")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_extras(args) if args.extras else child_check(args) if args.check else child_time(args)))
        return
    if args.extras:
        run_extras(args)
        return
    if args.torch:
        import torch_peer

        torch_peer.run(args, machine(), append_torch_section)
        return

    seed = args.seed
    print(f"seed {seed}", flush=True)
    check = spawn(["--check", "--seed", str(seed)])
    for key, r in check.items():
        print(key, " ".join(f"{n}={e:.1e}" for n, e in r.items()), flush=True)
    # Ours must match float64 to the f32 bar; against XLA (itself an f32 approximation) allow 1e-3.
    bad = {key: {n: e for n, e in r.items() if e > (1e-4 if "f64" in n else 1e-3) and "ours" in n} for key, r in check.items()}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        raise SystemExit(f"results disagree beyond 1e-4: {bad}")

    sizes = [1024] if args.quick else [int(x) for x in (args.sizes or "1024,2048,4096").split(",")]
    rows = []
    for s in sizes:
        reps = args.reps if s < 4096 else max(2, args.reps - 2)
        for causal in (False, True):
            for pass_ in ("fwd", "bwd"):
                res = {}
                for impl in ("ours", "xla"):
                    extra = ["--impl", impl, "--pass", pass_, "--s", str(s), "--reps", str(reps), "--seed", str(seed)]
                    res[impl] = spawn(extra + (["--causal"] if causal else []))
                row = (s, causal, "fwd" if pass_ == "fwd" else "fwd+bwd", res["ours"], res["xla"])
                rows.append(row)
                o, x = res["ours"], res["xla"]
                print(
                    f"S={s} {'causal' if causal else 'full  '} {row[2]:8s} ours {o['best_ms']:9.1f} ms  xla {x['best_ms']:9.1f} ms  "
                    f"speedup {x['best_ms'] / o['best_ms']:5.2f}x  peak ours {(o['peak_kb'] - o['base_kb']) / 1024:7.1f} MiB  xla {(x['peak_kb'] - x['base_kb']) / 1024:7.1f} MiB",
                    flush=True,
                )

    lines = [
        "## Host (CPU)",
        "",
        f"Run {dt.date.today().isoformat()} by `bench/bench_host.py` (seed {seed}). Machine: {machine()}.",
        "B=1, H=8, D=64, f32, self-attention (kv_len = S, q_start = 0). Both sides under `jax.jit`;",
        "ours = `exla_rs_flash_attn_fwd/bwd` through `jax.ffi` as a `jax.custom_vjp`; XLA =",
        '`jax.nn.dot_product_attention(..., implementation="xla")`. "fwd+bwd" = `jax.grad` of',
        "`sum(attn(q,k,v)·do)` w.r.t. q, k, v (it includes the forward). Times: best of N after warm-up",
        "(median in brackets). Memory: peak RSS (VmHWM) of a fresh process per configuration minus its",
        "RSS once the inputs exist, i.e. what the computation itself needed at its peak (for both sides",
        "this includes the O(S) outputs and residuals JAX allocates). Ours grows ~2x per doubling of S,",
        "XLA's ~3-4x (it materialises the S×S score/probability matrices).",
        f"Load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other jobs shared the",
        "machine), so single timings move by ~±20%; each ratio compares runs of the same sweep.",
        "",
        "| S | mask | pass | ours ms | XLA ms | XLA / ours | ours peak MiB | XLA peak MiB |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for s, causal, p, o, x in rows:
        lines.append(
            f"| {s} | {'causal' if causal else 'none'} | {p} | {o['best_ms']:.1f} ({o['median_ms']:.1f}) | {x['best_ms']:.1f} ({x['median_ms']:.1f}) "
            f"| {x['best_ms'] / o['best_ms']:.2f}x | {(o['peak_kb'] - o['base_kb']) / 1024:.0f} | {(x['peak_kb'] - x['base_kb']) / 1024:.0f} |"
        )
    lines += ["", "Agreement (max abs error / max abs of the second operand):", ""]
    for key, r in check.items():
        lines.append(f"- {key}: " + ", ".join(f"{n} {e:.1e}" for n, e in r.items()))
    section = "\n".join(lines) + "\n"
    print(section)
    if not (args.quick or args.no_write):
        update_results(section)


if __name__ == "__main__":
    main()
