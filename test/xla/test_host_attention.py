"""The Host handlers through a real XLA (jax[cpu]): forward and backward against float64
references over every option, dtype and odd size; fresh random inputs each run (set
EXLA_RS_SEED to replay one)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exla_rs_jax as ex
from cases import CASES, DTYPES, TOL, assert_grads, fully_masked_rows, make, rel_err, seed

PARAMS = [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in CASES for dt in DTYPES]


@pytest.mark.parametrize("case,dt", PARAMS)
def test_forward_matches_float64_reference(case, dt):
    x = make(case, DTYPES[dt], seed())
    o, lse = ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    o, lse = np.asarray(o), np.asarray(lse)
    ref_o, ref_lse = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    ctx = f"seed={x.seed}"
    assert o.dtype == x.q.dtype and o.shape == x.q.shape, ctx
    assert lse.dtype == np.float32 and lse.shape == (case.b, case.h, case.sq), ctx
    assert not np.isnan(o.astype(np.float32)).any(), ctx
    assert rel_err(o, ref_o) <= TOL[dt], f"o rel err {rel_err(o, ref_o):.2e} > {TOL[dt]} ({ctx})"
    masked = fully_masked_rows(x)  # [B, Sq]
    # Fully masked rows: lse = -inf and o = 0, never NaN.
    assert np.all(np.isneginf(lse.transpose(0, 2, 1)[masked])), ctx
    assert np.all(o.astype(np.float32)[masked] == 0), ctx
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), ctx
    fin = np.isfinite(ref_lse)
    lse_tol = 1e-4 if dt == "f32" else TOL[dt]
    assert np.max(np.abs(lse[fin] - ref_lse[fin]), initial=0) <= lse_tol * max(1.0, np.abs(ref_lse[fin]).max(initial=1)), ctx


def reference_grads(x):
    f64 = lambda a: jnp.asarray(np.asarray(a, np.float64))
    q, k, v, do = map(f64, (x.q, x.k, x.v, x.do))

    def loss(q, k, v):
        return jnp.sum(ex.reference_jax(q, k, v, x.kv_len, x.q_start, **x.kw) * do)

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("case,dt", PARAMS)
def test_backward_matches_jax_grad_of_reference(case, dt):
    x = make(case, DTYPES[dt], seed())
    o, lse = ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    dq, dk, dv = ex.flash_attn_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, o, lse, x.do, **x.kw)
    assert_grads(x, dt, (dq, dk, dv), reference_grads(x), f"seed={x.seed}")


@pytest.mark.parametrize("case,dt", PARAMS)
def test_lse_gradient_through_augmented_backward(case, dt):
    """The gradient of sum(o * do) + sum(lse * dlse): our backward on (do) plus our backward on
    the head-dim-augmented operands (dlse), as ExlaRs.attention_with_lse differentiates lse."""
    x = make(case, DTYPES[dt], seed())
    if ex.lse_grad_head_dim(x.q.shape[-1]) > 256:
        pytest.skip("no kernel past head dim 256: ExlaRs falls back to Nx there")
    o, lse = ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    rng = np.random.default_rng(x.seed + 1)
    dlse = rng.standard_normal(lse.shape).astype(np.float32)
    from_o = ex.flash_attn_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, o, lse, x.do, **x.kw)
    from_lse = ex.flash_attn_bwd_lse(x.q, x.k, x.v, x.kv_len, x.q_start, lse, dlse, **x.kw)
    refs = ex.reference_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, x.do, dlse=dlse.astype(x.q.dtype), **x.kw)
    lse_only = ex.reference_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, np.zeros(x.q.shape), dlse=dlse.astype(x.q.dtype), **x.kw)
    ctx = f"seed={x.seed}"
    for name, a, b, ref, ref_lse in zip(("dq", "dk", "dv"), from_o, from_lse, refs, lse_only):
        b = np.asarray(b)
        assert np.isfinite(b.astype(np.float32)).all(), f"{name} has non-finite values ({ctx})"
        if np.abs(ref_lse).max() > 0:
            err = rel_err(b, ref_lse)
            assert err <= TOL[dt], f"{name} (lse part) rel err {err:.2e} > {TOL[dt]} ({ctx})"
        total = np.asarray(a).astype(np.float64) + b.astype(np.float64)
        err = rel_err(total, ref)
        assert err <= TOL[dt], f"{name} rel err {err:.2e} > {TOL[dt]} ({ctx})"


@pytest.mark.parametrize("dt", list(DTYPES))
def test_grad_through_custom_vjp_uses_our_backward(dt):
    case = CASES[-1]  # every option at once
    x = make(case, DTYPES[dt], seed())

    def loss(q, k, v):
        o = ex.attention(q, k, v, x.kv_len, x.q_start, x.scale, x.softcap, x.window_left, x.window_right, "cpu")
        return jnp.sum(o.astype(jnp.float32) * x.do.astype(np.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.q, x.k, x.v)
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x.q, x.k, x.v).as_text()
    assert "exla_rs_flash_attn_bwd" in text and "exla_rs_flash_attn_fwd" in text
    for got, ref in zip(grads, reference_grads(x)):
        assert rel_err(got, ref) <= TOL[dt], f"seed={x.seed}"


def test_finite_differences_agree_with_backward():
    """One small f32 case checked against central differences of the float64 reference."""
    case = CASES[7]  # softcap + scale
    x = make(case, np.float32, seed())
    o, lse = ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    dq, dk, dv = (np.asarray(g) for g in ex.flash_attn_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, o, lse, x.do, **x.kw))
    rng = np.random.default_rng(x.seed)
    for name, arr, grad in (("q", x.q, dq), ("k", x.k, dk), ("v", x.v, dv)):
        for _ in range(4):
            idx = tuple(rng.integers(0, s) for s in arr.shape)
            eps = 1e-4
            plus, minus = arr.astype(np.float64), arr.astype(np.float64)
            plus[idx] += eps
            minus[idx] -= eps
            args = {"q": (x.q, x.k, x.v), "k": (x.q, x.k, x.v), "v": (x.q, x.k, x.v)}[name]
            def f(a):
                qq, kk, vv = [a if n == name else t for n, t in zip("qkv", args)]
                return np.sum(ex.reference_fwd(qq, kk, vv, x.kv_len, x.q_start, **x.kw)[0] * x.do)
            fd = (f(plus) - f(minus)) / (2 * eps)
            assert abs(fd - grad[idx]) <= 1e-3 * max(1.0, abs(fd)), f"d{name}{idx}: fd {fd} vs {grad[idx]} (seed={x.seed})"


def test_workspace_bytes_contract():
    assert ex.workspace_bytes(0, "cpu", np.float32, 1, 128, 128, 8, 8, 64) >= 0
    assert ex.workspace_bytes(1, "cpu", jnp.bfloat16, 2, 33, 65, 8, 2, 256) >= 0
    lib = ex.load("cpu")
    f = lib.exla_rs_flash_attn_workspace_bytes
    assert f(0, 0, 11, 1, 8, 8, 6, 4, 64) == -1  # H not a multiple of Hkv
    assert f(0, 0, 11, 1, 8, 8, 4, 4, 300) == -1  # head dim beyond 256
    assert f(0, 0, 12, 1, 8, 8, 4, 4, 64) == -1  # f64 is not an input type
    assert f(2, 0, 11, 1, 8, 8, 4, 4, 64) == -1  # no such pass
    assert f(0, 7, 11, 1, 8, 8, 4, 4, 64) == -1  # no such platform
