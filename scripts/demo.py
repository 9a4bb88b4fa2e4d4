"""The main job: flash attention through a real XLA on the CPU, checked and timed.

Registers libexla_rs_xla.so's Host handlers with jax.ffi, runs forward and forward+backward on
fresh random inputs, checks them against the float64 reference (closed-form forward and backward), and times them
next to XLA's own attention (jax.nn.dot_product_attention, implementation="xla", under jit).
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test/xla"))

import jax
import jax.numpy as jnp
import numpy as np

import exla_rs_jax as ex
from cases import rel_err


def best_of(fn, n):
    jax.block_until_ready(fn())  # compile + warm up
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    b, s, h, d = a.batch, a.seq, a.heads, a.head_dim
    rng = np.random.default_rng()
    q, k, v, do = (rng.standard_normal((b, s, h, d), dtype=np.float32) for _ in range(4))
    kv_len = np.full(b, s, np.int32)
    q_start = np.zeros(b, np.int32)
    scale = 1.0 / np.sqrt(d)
    wl, wr = ex.window(a.causal)
    kw = dict(scale=scale, softcap=0.0, window_left=wl, window_right=wr)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; library {ex.lib_path()}")
    print(f"B={b} S={s} H={h} D={d} f32 causal={a.causal}")

    ours_fwd = jax.jit(lambda q, k, v: ex.flash_attn_fwd(q, k, v, kv_len, q_start, **kw)[0])
    xla_fwd = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=a.causal, implementation="xla"))

    def loss_ours(q, k, v):
        return jnp.sum(ex.attention(q, k, v, kv_len, q_start, scale, 0.0, wl, wr, "cpu") * do)

    def loss_xla(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=a.causal, implementation="xla") * do)

    ours_grad = jax.jit(jax.grad(loss_ours, argnums=(0, 1, 2)))
    xla_grad = jax.jit(jax.grad(loss_xla, argnums=(0, 1, 2)))

    ref_o, _ = ex.reference_fwd(q, k, v, kv_len, q_start, **kw)
    err_fwd = rel_err(ours_fwd(q, k, v), ref_o)
    ref_grads = ex.reference_bwd(q, k, v, kv_len, q_start, do, **kw)
    err_bwd = max(rel_err(g, r) for g, r in zip(ours_grad(q, k, v), ref_grads))
    ok = err_fwd <= 1e-4 and err_bwd <= 1e-4
    print(f"check vs float64 reference: forward rel err {err_fwd:.2e}, backward rel err {err_bwd:.2e} -> {'OK' if ok else 'FAIL'} (bar 1e-4)")

    t = {
        "ours fwd": best_of(lambda: ours_fwd(q, k, v), a.repeats),
        "xla fwd": best_of(lambda: xla_fwd(q, k, v), a.repeats),
        "ours fwd+bwd": best_of(lambda: ours_grad(q, k, v), a.repeats),
        "xla fwd+bwd": best_of(lambda: xla_grad(q, k, v), a.repeats),
    }
    print(f"forward:          ours {t['ours fwd'] * 1e3:8.1f} ms   XLA {t['xla fwd'] * 1e3:8.1f} ms   speedup {t['xla fwd'] / t['ours fwd']:.2f}x")
    print(f"forward+backward: ours {t['ours fwd+bwd'] * 1e3:8.1f} ms   XLA {t['xla fwd+bwd'] * 1e3:8.1f} ms   speedup {t['xla fwd+bwd'] / t['ours fwd+bwd']:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
