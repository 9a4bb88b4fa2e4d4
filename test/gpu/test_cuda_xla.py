"""The CUDA handlers through a real XLA (jax with its CUDA plugin): forward and backward against
float64 references over every option, dtype, head dim and odd size. Outputs are poisoned (NaN)
before each call, so an element a kernel forgets to write fails the test. Fresh random inputs each
run (EXLA_RS_SEED replays one).

Run on a GPU machine after `cargo build --release --manifest-path native/exla_rs/Cargo.toml --workspace`:
    python3 -m pytest -q test/gpu/test_cuda_xla.py
"""
import os

import numpy as np
import pytest

import jax
import jax.numpy as jnp

# EXLA_RS_TEST_PLATFORM=cpu runs the same cases against the Host handlers: a check of this file
# itself on a machine without a GPU (the CUDA-only tests are skipped then).
PLATFORM = os.environ.get("EXLA_RS_TEST_PLATFORM", "cuda")
try:
    GPU = jax.devices("gpu" if PLATFORM == "cuda" else "cpu")[0]
except RuntimeError:
    pytest.skip("no CUDA device visible to jax", allow_module_level=True)
cuda_only = pytest.mark.skipif(PLATFORM != "cuda", reason="CUDA-specific")

import exla_rs_jax as ex
from cases import CASES as HOST_CASES, DTYPES, TOL, Case, assert_grads, fully_masked_rows, make, rel_err, seed

CUDA_DIMS = ex.KERNEL_HEAD_DIMS

# The Host cases with a CUDA head dim, plus cases sized to cross tile boundaries (the kernels use
# 32/64/128-row tiles): several tiles, ragged last tiles, long windows, big GQA groups.
CUDA_CASES = [c for c in HOST_CASES if c.d in CUDA_DIMS] + [
    Case(f"d{d}_ragged", 2, 131, 197, 4, 2, d, causal=c, kv_len="random", q_start="random")
    for d in CUDA_DIMS
    for c in (False, True)
] + [
    Case("long_causal_d128", 1, 1030, 1030, 2, 2, 128, causal=True),
    Case("long_noncausal_d64", 1, 777, 1300, 4, 1, 64),
    Case("sliding_d64", 2, 600, 600, 4, 4, 64, causal=True, window_size=(100, 0)),
    Case("window_both_d192", 1, 300, 350, 2, 2, 192, window_size=(40, 17)),
    Case("softcap_gqa_d256", 2, 150, 150, 8, 2, 256, causal=True, softcap=30.0),
    Case("softcap_d96", 1, 260, 200, 3, 3, 96, softcap=5.0, scale=0.3),
    Case("decode_d128", 4, 1, 900, 8, 1, 128, causal=True),
    Case("q_start_neg_d32", 2, 90, 90, 2, 2, 32, causal=True, q_start="negative"),
    Case("all_masked_batch_d64", 3, 64, 64, 2, 2, 64, kv_len="random"),
]
PARAMS = [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in CUDA_CASES for dt in DTYPES]


def on_gpu(*xs):
    return [jax.device_put(x, GPU) for x in xs]


def poison(*shapes_dtypes):
    """Leaves NaN-filled freed buffers of the outputs' sizes behind, which the next allocations of
    those sizes get back (XLA_PYTHON_CLIENT_PREALLOCATE=false in conftest)."""
    bufs = [jax.device_put(np.full(s, np.nan, dtype=d), GPU) for s, d in shapes_dtypes]
    for b in bufs:
        b.block_until_ready()
        b.delete()


def run_fwd(x):
    b, sq, h, d = x.q.shape
    poison((x.q.shape, x.q.dtype), ((b, h, sq), np.float32))
    q, k, v, kv, qs = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start)
    o, lse = ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw)
    return o, lse


@pytest.mark.parametrize("case,dt", PARAMS)
def test_forward_matches_float64_reference(case, dt):
    x = make(case, DTYPES[dt], seed())
    o, lse = run_fwd(x)
    assert o.devices() == {GPU}
    o, lse = np.asarray(o), np.asarray(lse)
    ref_o, ref_lse = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    ctx = f"seed={x.seed}"
    assert o.dtype == x.q.dtype and o.shape == x.q.shape and lse.shape == (case.b, case.h, case.sq), ctx
    assert not np.isnan(o.astype(np.float32)).any(), f"unwritten or NaN output ({ctx})"
    assert not np.isnan(lse).any(), ctx
    err = rel_err(o, ref_o)
    assert err <= TOL[dt], f"o rel err {err:.2e} > {TOL[dt]} ({ctx})"
    masked = fully_masked_rows(x)
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[masked])), ctx
    assert np.all(o.astype(np.float32)[masked] == 0), ctx
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), ctx
    fin = np.isfinite(ref_lse)
    lse_tol = 1e-4 if dt == "f32" else TOL[dt]
    assert np.max(np.abs(lse[fin] - ref_lse[fin]), initial=0) <= lse_tol * max(1.0, np.abs(ref_lse[fin]).max(initial=1)), ctx


@pytest.mark.parametrize("case,dt", PARAMS)
def test_backward_matches_float64_reference(case, dt):
    x = make(case, DTYPES[dt], seed())
    o, lse = run_fwd(x)
    poison((x.q.shape, x.q.dtype), (x.k.shape, x.k.dtype), (x.v.shape, x.v.dtype))
    q, k, v, kv, qs, do = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start, x.do)
    dq, dk, dv = ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do, platform=PLATFORM, **x.kw)
    # The reference takes the kernel's own o (as the contract's backward does) in float64.
    refs = ex.reference_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, x.do, **x.kw)
    ctx = f"seed={x.seed}"
    assert_grads(x, dt, (dq, dk, dv), refs, ctx)
    # Keys past kv_len get exactly zero gradients.
    for bi, n in enumerate(x.kv_len):
        assert np.all(np.asarray(dk)[bi, max(n, 0):].astype(np.float32) == 0), ctx
        assert np.all(np.asarray(dv)[bi, max(n, 0):].astype(np.float32) == 0), ctx


# The widened operands need a kernel head dim (none past 256).
LSE_PARAMS = [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in CUDA_CASES if ex.lse_grad_head_dim(c.d) <= 256 for dt in DTYPES]


@pytest.mark.parametrize("case,dt", LSE_PARAMS)
def test_lse_gradient_through_augmented_backward(case, dt):
    """The lse part of the gradient (ExlaRs.attention_with_lse): our backward on operands padded
    to the next kernel head dim, v with a column of ones and do carrying dlse there."""
    x = make(case, DTYPES[dt], seed())
    o, lse = run_fwd(x)
    dlse = np.random.default_rng(x.seed + 1).standard_normal(lse.shape).astype(np.float32)
    q, k, v, kv, qs, dl = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start, dlse)
    dq, dk, dv = ex.flash_attn_bwd_lse(q, k, v, kv, qs, lse, dl, platform=PLATFORM, **x.kw)
    refs = ex.reference_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, np.zeros(x.q.shape), dlse=dlse.astype(x.q.dtype), **x.kw)
    ctx = f"seed={x.seed}"
    for name, got, ref in (("dq", dq, refs[0]), ("dk", dk, refs[1])):
        got = np.asarray(got)
        assert np.isfinite(got.astype(np.float32)).all(), f"{name}: non-finite values ({ctx})"
        err = rel_err(got, ref)
        assert err <= TOL[dt], f"{name} rel err {err:.2e} > {TOL[dt]} ({ctx})"
    assert not np.asarray(dv).astype(np.float32).any(), ctx


@pytest.mark.parametrize("dt", list(DTYPES))
def test_jit_grad_runs_both_targets_on_the_gpu(dt):
    case = Case("everything_d64", 2, 150, 170, 6, 2, 64, causal=True, window_size=(40, 3), softcap=12.0, kv_len="random", q_start="random")
    x = make(case, DTYPES[dt], seed())
    kv, qs = on_gpu(x.kv_len, x.q_start)

    def loss(q, k, v):
        o = ex.attention(q, k, v, kv, qs, x.scale, x.softcap, x.window_left, x.window_right, PLATFORM)
        return jnp.sum(o.astype(jnp.float32) * jnp.asarray(x.do, jnp.float32))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    args = on_gpu(x.q, x.k, x.v)
    text = f.lower(*args).as_text()
    assert "exla_rs_flash_attn_fwd" in text and "exla_rs_flash_attn_bwd" in text
    grads = f(*args)
    refs = ex.reference_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, x.do, **x.kw)
    for g, r in zip(grads, refs):
        assert rel_err(np.asarray(g), r) <= TOL[dt], f"seed={x.seed}"


def test_forward_is_deterministic_and_stream_ordered():
    """Many calls in one jit, no host sync between them: same bits every time."""
    case = Case("repeat", 2, 300, 300, 4, 2, 128, causal=True)
    x = make(case, jnp.bfloat16, seed())
    q, k, v, kv, qs = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start)

    @jax.jit
    def many(q, k, v):
        outs = []
        for i in range(8):
            o, _ = ex.flash_attn_fwd(q * (1 + i), k, v, kv, qs, platform=PLATFORM, **x.kw)
            outs.append(o)
        return jnp.stack(outs)

    a, b = np.asarray(many(q, k, v)), np.asarray(many(q, k, v))
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


@cuda_only
@pytest.mark.parametrize("d", [16, 48, 80, 160])
def test_head_dims_without_a_kernel_are_unimplemented(d):
    assert ex.workspace_bytes(0, "cuda", jnp.bfloat16, 1, 8, 8, 2, 2, d) == -1
    assert ex.workspace_bytes(1, "cuda", jnp.float32, 1, 8, 8, 2, 2, d) == -1
    x = make(Case("odd", 1, 8, 8, 2, 2, d), jnp.bfloat16, seed())
    q, k, v, kv, qs = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start)
    ex.load(PLATFORM)
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)]
    attrs = dict(scale=np.float32(0.1), softcap=np.float32(0), window_left=np.int64(-1), window_right=np.int64(-1))
    with pytest.raises(Exception, match=r"(?i)unimplemented.*head dim|head dim.*unimplemented|D=%d" % d):
        jax.block_until_ready(jax.ffi.ffi_call(ex.FWD, outs)(q, k, v, kv, qs, **attrs))


@cuda_only
def test_workspace_matches_the_layout():
    # Backward scratch: delta f32[B,H,Sq] (256-aligned) + f32 dq accumulator for half types.
    b, sq, sk, h, hkv, d = 2, 100, 120, 8, 2, 128
    delta = -(-(b * h * sq * 4) // 256) * 256
    assert ex.workspace_bytes(0, "cuda", jnp.bfloat16, b, sq, sk, h, hkv, d) == 0
    assert ex.workspace_bytes(1, "cuda", jnp.bfloat16, b, sq, sk, h, hkv, d) == delta + b * sq * h * d * 4
    assert ex.workspace_bytes(1, "cuda", np.float32, b, sq, sk, h, hkv, d) == delta


# Issue 13, part 1: non-finite values no row may see, and windows near i64::MAX. The poisoned call
# is compared with the same call on poison-free inputs (poison -> 0) on every output a row or key
# that does not see the poison produces; kernels/emulate.py checks the same cases lane by lane.
NONFINITE = [
    # (name, B, Sq, Sk, H, Hkv, D, wl, wr, kv_len, q_start, k/v poison (tensor, b, key, kv head, col, value), dead rows (b, i))
    ("window_kv", 1, 200, 200, 2, 1, 64, 7, 0, [200], [0],
     [("k", 0, 3, 0, 5, np.inf), ("v", 0, 5, 0, 3, np.nan), ("v", 0, 130, 0, 10, -np.inf), ("k", 0, 199, 0, 0, np.nan)], []),
    ("kv_cache_garbage", 2, 40, 300, 4, 2, 128, -1, 0, [300, 300], [100, 60],
     [("k", 0, 250, 1, 0, np.nan), ("v", 0, 141, 0, 9, np.inf), ("v", 1, 200, 1, 1, np.nan), ("k", 1, 101, 0, 7, -np.inf)], []),
    ("dead_rows_d256", 2, 70, 60, 2, 1, 256, -1, 0, [60, 0], [-20, 0], [("v", 0, 59, 0, 2, np.nan)],
     [(0, i) for i in range(20)] + [(1, i) for i in range(70)]),
    ("dead_rows_d32", 1, 90, 90, 4, 4, 32, 3, 0, [90], [-10], [], [(0, i) for i in range(10)]),
]


@pytest.mark.parametrize("dt", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("cfg", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_no_nan_from_hidden_nonfinite_values_or_dead_rows(cfg, dt):
    name, b, sq, sk, h, hkv, d, wl, wr, kv_len, q_start, kvp, dead = cfg
    if d not in CUDA_DIMS:
        pytest.skip(f"no kernel for D={d}")
    sd = seed()
    rng = np.random.default_rng(sd)
    dtype = DTYPES[dt]
    q, k, v, do = (rng.standard_normal(s).astype(np.float32).astype(dtype) for s in [(b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)])
    kv, qs = np.array(kv_len, np.int32), np.array(q_start, np.int32)
    kw = dict(scale=1 / np.sqrt(d), window_left=wl, window_right=wr)
    clean = [x.copy() for x in (q, k, v, do)]
    pq, pk, pv, pdo = (x.copy() for x in (q, k, v, do))
    for t, bb, j, hh, c, val in kvp:
        (pk if t == "k" else pv)[bb, j, hh, c] = val
    for bb, i in dead:
        pq[bb, i] = np.nan
        pdo[bb, i] = np.nan

    def run(q, k, v, do):
        q, k, v, kvg, qsg, do = on_gpu(q, k, v, kv, qs, do)
        o, lse = ex.flash_attn_fwd(q, k, v, kvg, qsg, platform=PLATFORM, **kw)
        grads = ex.flash_attn_bwd(q, k, v, kvg, qsg, o, lse, do, platform=PLATFORM, **kw)
        return [np.asarray(x).astype(np.float32) for x in (o, lse, *grads)]

    got, want = run(pq, pk, pv, pdo), run(*clean)
    vis = ex.visible_mask(b, sq, sk, kv, qs, wl, wr)  # [B, Sq, Sk]
    bad = np.zeros((b, sk, hkv), bool)
    for t, bb, j, hh, c, val in kvp:
        bad[bb, j, hh] = True
    g = h // hkv
    dirty = np.einsum("bij,bjh->bih", vis.astype(np.int64), bad.astype(np.int64)).repeat(g, 2) > 0  # [B, Sq, H]
    seen = np.einsum("bij,bih->bjh", vis.astype(np.int64), dirty.reshape(b, sq, hkv, g).any(3).astype(np.int64)) > 0
    ok_q, ok_k = ~dirty, ~seen
    ctx = f"{name} {dt} seed={sd}"
    for what, gx, wx, m in [("o", got[0], want[0], ok_q), ("dq", got[2], want[2], ok_q), ("dk", got[3], want[3], ok_k), ("dv", got[4], want[4], ok_k)]:
        gx, wx = gx[m], wx[m]
        assert np.isfinite(gx).all(), f"{what}: non-finite on a row/key that sees no poison ({ctx})"
        assert rel_err(gx, wx) <= TOL[dt], f"{what}: rel err {rel_err(gx, wx):.2e} ({ctx})"
    lse_ok = ok_q.transpose(0, 2, 1)
    assert np.array_equal(got[1][lse_ok], want[1][lse_ok]) or np.allclose(got[1][lse_ok], want[1][lse_ok], atol=1e-5), ctx


@pytest.mark.parametrize("wl,wr", [(2**63 - 1, 2**63 - 1), (2**63 - 1, 0), (3, 2**63 - 2)])
def test_windows_near_i64_max_are_unbounded(wl, wr):
    rng = np.random.default_rng(seed())
    b, sq, sk, h, d = 2, 70, 90, 2, 64
    q, k, v = (rng.standard_normal(s).astype(np.float32).astype(DTYPES["bf16"]) for s in [(b, sq, h, d), (b, sk, 1, d), (b, sk, 1, d)])
    kv, qs = np.array([90, 50], np.int32), np.array([-(2**31), 2**31 - 80], np.int32)
    unb = lambda w: -1 if w >= 2**40 else w
    q_, k_, v_, kvg, qsg = on_gpu(q, k, v, kv, qs)
    got = ex.flash_attn_fwd(q_, k_, v_, kvg, qsg, scale=0.125, window_left=wl, window_right=wr, platform=PLATFORM)
    want = ex.flash_attn_fwd(q_, k_, v_, kvg, qsg, scale=0.125, window_left=unb(wl), window_right=unb(wr), platform=PLATFORM)
    for g_, w_ in zip(got, want):
        assert np.array_equal(np.asarray(g_).astype(np.float32), np.asarray(w_).astype(np.float32))
