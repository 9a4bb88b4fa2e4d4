"""Attention dropout (docs/flash-attention-contract.md, "Dropout") on the Host handlers through a
real XLA (jax.ffi):

(a) bit identity: the mask the Host kernel applies, observed directly (q = 0 so P = 1/Sk, V the
    identity over keys so o[b, i, h, j] = M·s / Sk), equals test/xla/philox_ref.py's mask, which is
    checked against the same vectors (test/data/dropout_vectors.txt) as the Nx fallback;
(b) forward and backward against a float64 reference that applies that mask, every dtype, with
    causal, windows, GQA, kv_len, key_mask, bias (and dbias), ALiBi, softcap;
(c) statistics: kept fraction within 4 sigma of 1 - rate, a new key gives a new mask, the same key
    the same one on every call, head h's mask is not head h+1's;
and the contract's INVALID_ARGUMENT errors. Fresh random inputs each run (EXLA_RS_SEED replays).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exla_rs_jax as ex
import philox_ref
from cases import seed

TOL = {np.float32: 2e-5, jnp.float16: 4e-3, jnp.bfloat16: 3e-2}


def _fwd(q, k, v, kv_len, q_start, key, rate, *, scale, extra=(), flags=None, **opt):
    """(o, lse) from the forward target; extra: the optional operands before the key."""
    ex.load("cpu")
    b, sq, h, _ = q.shape
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)]
    attrs = dict(flags or {})
    args = list(extra)
    if rate > 0:
        attrs.update(has_dropout=True, dropout_rate=np.float32(rate))
        args.append(key)
    res = jax.ffi.ffi_call(ex.FWD, outs)(q, k, v, kv_len, q_start, *args, **ex._attrs(scale, opt.get("softcap", 0.0), opt.get("wl", -1), opt.get("wr", -1)), **attrs)
    return res[0], res[1]


def _bwd(q, k, v, kv_len, q_start, o, lse, do, key, rate, *, scale, extra=(), flags=None, bias_grad=None, **opt):
    ex.load("cpu")
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    attrs = dict(flags or {})
    if bias_grad is not None:
        outs.append(jax.ShapeDtypeStruct(bias_grad.shape, bias_grad.dtype))
        attrs["bias_grad"] = True
    args = list(extra)
    if rate > 0:
        attrs.update(has_dropout=True, dropout_rate=np.float32(rate))
        args.append(key)
    return jax.ffi.ffi_call(ex.BWD, outs)(q, k, v, kv_len, q_start, o, lse, do, *args, **ex._attrs(scale, opt.get("softcap", 0.0), opt.get("wl", -1), opt.get("wr", -1)), **attrs)


def observed_mask(key, rate, b, s, h, hkv=None):
    """The kernel's M·s observed: q = 0, V = identity over keys (D = Sk), o = M·s / Sk."""
    hkv = hkv or h
    rng = np.random.default_rng(seed())
    q = jnp.zeros((b, s, h, s), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, s)), jnp.float32)
    v = jnp.asarray(np.broadcast_to(np.eye(s, dtype=np.float32)[None, :, None, :], (b, s, hkv, s)).copy())
    kv_len, q_start = jnp.full((b,), s, jnp.int32), jnp.zeros((b,), jnp.int32)
    o, lse = _fwd(q, k, v, kv_len, q_start, jnp.asarray(key, jnp.uint32), rate, scale=1.0)
    ms = np.asarray(o, np.float64).transpose(0, 2, 1, 3) * s  # [B, H, Sq, Sk]
    np.testing.assert_allclose(np.asarray(lse), np.log(s), rtol=1e-6)
    return ms


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_mask_is_bit_identical_to_the_reference(rate):
    key = (0x243F6A88, 0x85A308D3)
    b, s, h = 2, 70, 3
    ms = observed_mask(key, rate, b, s, h, hkv=1)
    want = philox_ref.mask(key, rate, (b, h, s, s))
    scale = float(philox_ref.keep_scale(rate))
    # Each entry is exactly 0 or scale/Sk·Sk up to the one rounding of the division by Sk.
    kept = ms > 0
    np.testing.assert_array_equal(kept, want)
    np.testing.assert_allclose(ms[kept], scale, rtol=1e-6)


def test_statistics():
    rate, b, s, h = 0.3, 1, 256, 4
    m1 = observed_mask((7, 11), rate, b, s, h) > 0
    n = m1.size
    p = 1 - philox_ref.threshold(rate) / 2**32
    assert abs(m1.mean() - p) < 4 * np.sqrt(p * (1 - p) / n), (m1.mean(), p)
    # Same key: the same mask on another call; another key: another mask.
    np.testing.assert_array_equal(m1, observed_mask((7, 11), rate, b, s, h) > 0)
    m2 = observed_mask((7, 12), rate, b, s, h) > 0
    assert (m1 != m2).mean() > 0.3
    # Heads do not repeat each other (independent masks differ in ~2p(1-p) of the entries).
    for hh in range(h - 1):
        assert (m1[:, hh] != m1[:, hh + 1]).mean() > 0.3


CONFIGS = {
    "plain": dict(),
    "causal_gqa": dict(wl=-1, wr=0, hkv=1),
    "window_kvlen_softcap": dict(wl=9, wr=4, kv_len=40, softcap=5.0),
    "key_mask": dict(key_mask=True),
    "bias_dbias": dict(bias=True),
    "alibi_causal": dict(alibi=True, wl=-1, wr=0, q_start=6),
    "everything": dict(key_mask=True, bias=True, alibi=True, wl=20, wr=0, q_start=10, kv_len=45, softcap=8.0, hkv=1),
}


def reference(q, k, v, kv_len, q_start, do, ms, *, scale, softcap, wl, wr, key_mask, bias, slopes):
    """float64 o, lse, dq, dk, dv, dbias of the contract with dropout scales ms [B, H, Sq, Sk]."""
    return ex.reference(q, k, v, kv_len, q_start, do, scale=scale, softcap=softcap, window_left=wl, window_right=wr,
                        key_mask=key_mask, bias=bias, alibi_slopes=slopes, dropout_scales=ms)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-2)


@pytest.mark.parametrize("dtype", [np.float32, jnp.float16, jnp.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_backward_against_float64(name, dtype):
    c = CONFIGS[name]
    rng = np.random.default_rng(seed())
    b, sq, sk, h, d = 2, 37, 50, 4, 16
    hkv = c.get("hkv", 2)
    rate, key = 0.35, (int(rng.integers(2**32)), int(rng.integers(2**32)))
    rnd = lambda *sh: jnp.asarray(rng.standard_normal(sh), dtype)
    q, k, v, do = rnd(b, sq, h, d), rnd(b, sk, hkv, d), rnd(b, sk, hkv, d), rnd(b, sq, h, d)
    kv_len = jnp.asarray([c.get("kv_len", sk), sk], jnp.int32)
    q_start = jnp.asarray([c.get("q_start", 0)] * b, jnp.int32)
    scale, softcap, wl, wr = 1 / np.sqrt(d), c.get("softcap", 0.0), c.get("wl", -1), c.get("wr", -1)
    extra, flags = [], {}
    key_mask = bias = slopes = None
    if c.get("key_mask"):
        key_mask = jnp.asarray(rng.random((b, sk)) > 0.3, jnp.int32)
        extra.append(key_mask); flags["has_key_mask"] = True
    if c.get("bias"):
        bias = jnp.asarray(rng.standard_normal((1, h, sq, sk)), dtype)
        extra.append(bias); flags["has_bias"] = True
    if c.get("alibi"):
        slopes = jnp.asarray(rng.uniform(0.05, 0.5, h), jnp.float32)
        extra.append(slopes); flags["has_alibi"] = True
    kj = jnp.asarray(key, jnp.uint32)
    kw = dict(scale=scale, softcap=softcap, wl=wl, wr=wr)
    o, lse = _fwd(q, k, v, kv_len, q_start, kj, rate, extra=extra, flags=flags, **kw)
    res = _bwd(q, k, v, kv_len, q_start, o, lse, do, kj, rate, extra=extra, flags=flags, bias_grad=bias, **kw)
    ms = np.where(philox_ref.mask(key, rate, (b, h, sq, sk)), np.float64(philox_ref.keep_scale(rate)), 0.0)
    f64 = lambda x: None if x is None else np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    ro, rlse, rdq, rdk, rdv, rdb = reference(f64(q), f64(k), f64(v), np.asarray(kv_len), np.asarray(q_start), f64(do), ms, scale=scale, softcap=softcap,
                                             wl=wl, wr=wr, key_mask=None if key_mask is None else np.asarray(key_mask), bias=f64(bias), slopes=f64(slopes))
    tol = TOL[dtype]
    assert rel(o, ro) < tol, ("o", rel(o, ro))
    fin = np.isfinite(rlse)
    np.testing.assert_array_equal(np.asarray(lse)[~fin], -np.inf)
    assert rel(np.asarray(lse)[fin], rlse[fin]) < tol
    for nm, got, want in zip(["dq", "dk", "dv", "dbias"], res, [rdq, rdk, rdv, rdb]):
        assert rel(got, want) < 4 * tol, (nm, rel(got, want))


def _err(fn):
    with pytest.raises(Exception) as e:
        jax.block_until_ready(fn())
    return str(e.value)


def test_errors_are_invalid_argument():
    rng = np.random.default_rng(seed())
    q, k = (jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32) for _ in range(2))
    kv_len, q_start = jnp.asarray([8], jnp.int32), jnp.asarray([0], jnp.int32)
    ex.load("cpu")
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)]
    base = ex._attrs(0.25, 0.0, -1, -1)
    call = lambda *extra, **attrs: jax.ffi.ffi_call(ex.FWD, outs)(q, k, k, kv_len, q_start, *extra, **base, **attrs)
    m = _err(lambda: call(dropout_rate=np.float32(0.1)))
    assert "INVALID_ARGUMENT" in m and "attribute `dropout_rate` is 0.1 but `has_dropout` is false" in m, m
    m = _err(lambda: call(jnp.asarray([1, 2, 3], jnp.uint32), has_dropout=True, dropout_rate=np.float32(0.5)))
    assert "INVALID_ARGUMENT" in m and "operand 5 `dropout_key` must be u32[2]" in m, m
    for bad in (1.0, 1.5, -0.5):
        m = _err(lambda: call(jnp.asarray([1, 2], jnp.uint32), has_dropout=True, dropout_rate=np.float32(bad)))
        assert "INVALID_ARGUMENT" in m and "expected a rate in [0, 1)" in m, m
    m = _err(lambda: call(jnp.asarray([1, 2], jnp.uint32), has_dropout=True))
    assert "INVALID_ARGUMENT" in m and "`dropout_rate` is 0" in m, m
