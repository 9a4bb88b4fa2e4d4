"""Malformed calls come back from XLA as INVALID_ARGUMENT naming the operand, never a crash."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exla_rs_jax as ex

F32 = np.float32
rng = np.random.default_rng()


def r(*shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def i32(*vals):
    return np.asarray(vals, np.int32)


GOOD_ATTRS = dict(scale=np.float32(0.125), softcap=np.float32(0.0), window_left=np.int64(-1), window_right=np.int64(0))


def call_fwd(q, k, v, kv_len, q_start, outs=None, **attrs):
    ex.load("cpu")
    b, sq, h = q.shape[0], q.shape[1], q.shape[2] if q.ndim > 2 else 1
    outs = outs or [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)]
    return jax.block_until_ready(jax.ffi.ffi_call(ex.FWD, outs)(q, k, v, kv_len, q_start, **(attrs or GOOD_ATTRS)))


def expect(match, fn):
    with pytest.raises(Exception, match=match) as info:
        fn()
    assert "INVALID_ARGUMENT" in str(info.value) or "Invalid argument" in str(info.value), str(info.value)


def test_rank():
    expect(r"operand 0 `q` must have rank 4 \[B, Sq, H, D\], got f32\[2,5,64\]", lambda: call_fwd(r(2, 5, 64), r(2, 5, 1, 64), r(2, 5, 1, 64), i32(5, 5), i32(0, 0)))


def test_dtype_mismatch():
    expect(r"operand 1 `k` must have the type of `q` \(f32\), got f16", lambda: call_fwd(r(1, 4, 2, 8), r(1, 4, 2, 8, dtype=np.float16), r(1, 4, 2, 8), i32(4), i32(0)))


def test_unsupported_dtype():
    q = r(1, 4, 2, 8).astype(np.float64)
    expect(r"operand 0 `q` must be f32, f16 or bf16, got f64", lambda: call_fwd(q, q, q, i32(4), i32(0)))


def test_head_dim_mismatch():
    expect(r"operand 1 `k` head dim 32 differs from `q` head dim 64", lambda: call_fwd(r(1, 4, 2, 64), r(1, 4, 2, 32), r(1, 4, 2, 32), i32(4), i32(0)))


def test_heads_not_divisible():
    expect(r"H=6 must be a multiple of k/v heads Hkv=4", lambda: call_fwd(r(1, 4, 6, 8), r(1, 4, 4, 8), r(1, 4, 4, 8), i32(4), i32(0)))


def test_head_dim_too_large():
    expect(r"head dim D=300 must be in 1..=256", lambda: call_fwd(r(1, 2, 1, 300), r(1, 2, 1, 300), r(1, 2, 1, 300), i32(2), i32(0)))


def test_v_shape():
    expect(r"operand 2 `v` must have the shape of `k`", lambda: call_fwd(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 5, 2, 8), i32(4), i32(0)))


def test_kv_len_type_and_shape():
    expect(r"operand 3 `kv_len` must be s32\[2\]", lambda: call_fwd(r(2, 4, 2, 8), r(2, 4, 2, 8), r(2, 4, 2, 8), np.asarray([4, 4], np.int64), i32(0, 0)))
    expect(r"operand 4 `q_start` must be s32\[2\]", lambda: call_fwd(r(2, 4, 2, 8), r(2, 4, 2, 8), r(2, 4, 2, 8), i32(4, 4), i32(0)))


def test_missing_attribute():
    attrs = dict(GOOD_ATTRS)
    del attrs["window_right"]
    expect(r"missing attribute `window_right`", lambda: call_fwd(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), i32(4), i32(0), **attrs))


def test_mistyped_attribute():
    # A Python float arrives as f64. (0.3, unlike 0.125, has no equal f32, so jax cannot reuse the
    # executable it cached for the well-typed calls above.)
    attrs = dict(GOOD_ATTRS, scale=0.3)
    expect(r"attribute `scale` must be a f32 scalar, got a f64 scalar", lambda: call_fwd(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), i32(4), i32(0), **attrs))


def test_bad_softcap_value():
    attrs = dict(GOOD_ATTRS, softcap=np.float32(-1.0))
    expect(r"attribute `softcap` must be a finite f32 >= 0", lambda: call_fwd(r(1, 4, 2, 8), r(1, 4, 2, 8), r(1, 4, 2, 8), i32(4), i32(0), **attrs))


def test_wrong_result_shape():
    q = r(1, 4, 2, 8)
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((1, 4, 2), jnp.float32)]
    expect(r"result 1 `lse` must be f32\[1,2,4\] \[B, H, Sq\], got f32\[1,4,2\]", lambda: call_fwd(q, q, q, i32(4), i32(0), outs=outs))


def test_backward_operand_count_and_do_shape():
    ex.load("cpu")
    q = r(1, 4, 2, 8)
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 3
    lse = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(Exception, match=r"operand 7 `do` must be f32\[1,4,2,8\]"):
        jax.block_until_ready(jax.ffi.ffi_call(ex.BWD, outs)(q, q, q, i32(4), i32(0), q, lse, r(1, 4, 2, 4), **GOOD_ATTRS))
    with pytest.raises(Exception, match=r"expected 8 operands \(q, k, v, kv_len, q_start, o, lse, do\), got 5"):
        jax.block_until_ready(jax.ffi.ffi_call(ex.BWD, outs)(q, q, q, i32(4), i32(0), **GOOD_ATTRS))


def test_process_survives_and_still_computes():
    """After all the bad calls above, a good call in the same process still works."""
    q = r(1, 6, 2, 8)
    o, lse = ex.flash_attn_fwd(q, q, q, i32(6), i32(0), scale=0.3)
    ref, _ = ex.reference_fwd(q, q, q, i32(6), i32(0), scale=0.3)
    assert np.abs(np.asarray(o) - ref).max() < 1e-4
