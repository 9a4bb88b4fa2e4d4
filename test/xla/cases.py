"""Random attention cases shared by the Host XLA tests (and the GPU tests with a platform switch)."""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    b: int
    sq: int
    sk: int
    h: int
    hkv: int
    d: int
    causal: bool = False
    window_size: tuple | None = None
    softcap: float = 0.0
    scale: float | None = None
    kv_len: str = "full"  # full | random (one row 0) | short
    q_start: str = "default"  # default (Sk - Sq) | zero | negative | random


CASES = [
    Case("plain", 2, 33, 33, 4, 4, 64),
    Case("causal_odd", 1, 70, 70, 2, 2, 32, causal=True),
    Case("causal_sq_lt_sk", 2, 17, 45, 3, 3, 64, causal=True),
    Case("sq1_sk1", 2, 1, 1, 2, 2, 16),
    Case("decode_step", 3, 1, 50, 4, 2, 64, causal=True),
    Case("sliding_causal", 1, 100, 100, 2, 1, 32, causal=True, window_size=(8, 0)),
    Case("local_both_sides", 2, 40, 40, 2, 2, 48, window_size=(5, 3)),
    Case("softcap_scale_d80", 1, 37, 29, 2, 2, 80, softcap=20.0, scale=0.5),
    Case("kv_padding_fully_masked", 3, 24, 31, 2, 2, 64, kv_len="random"),
    Case("q_start_negative", 2, 20, 20, 2, 2, 32, causal=True, q_start="negative"),
    Case("gqa", 2, 45, 45, 8, 2, 64, causal=True),
    Case("mqa", 1, 30, 61, 6, 1, 40),
    Case("d256", 1, 19, 23, 2, 1, 256, causal=True),
    Case("d1", 1, 9, 12, 3, 3, 1),
    Case("d128_s130", 1, 130, 130, 2, 2, 128),
    Case("everything", 3, 50, 67, 6, 2, 96, causal=True, window_size=(20, 2), softcap=15.0, kv_len="random", q_start="random"),
]

DTYPES = {"f32": np.float32, "f16": jnp.float16, "bf16": jnp.bfloat16}
# Relative to the reference's largest magnitude (the bars).
TOL = {"f32": 1e-4, "f16": 5e-3, "bf16": 3e-2}


def seed() -> int:
    return int(os.environ.get("EXLA_RS_SEED", secrets.randbits(32)))


@dataclass
class Inputs:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    kv_len: np.ndarray
    q_start: np.ndarray
    do: np.ndarray
    scale: float
    softcap: float
    window_left: int
    window_right: int
    seed: int
    kw: dict = field(default_factory=dict)


def make(case: Case, dtype, s: int) -> Inputs:
    """Fresh normal random inputs (never zeros), rounded to `dtype`."""
    from exla_rs_jax import window

    rng = np.random.default_rng(s)
    cast = lambda a: np.asarray(jnp.asarray(a, dtype=dtype))
    q = cast(rng.standard_normal((case.b, case.sq, case.h, case.d), dtype=np.float32))
    k = cast(rng.standard_normal((case.b, case.sk, case.hkv, case.d), dtype=np.float32))
    v = cast(rng.standard_normal((case.b, case.sk, case.hkv, case.d), dtype=np.float32))
    do = cast(rng.standard_normal((case.b, case.sq, case.h, case.d), dtype=np.float32))
    if case.kv_len == "full":
        kv_len = np.full(case.b, case.sk, np.int32)
    elif case.kv_len == "random":
        kv_len = rng.integers(1, case.sk + 1, case.b).astype(np.int32)
        kv_len[0] = 0  # a batch row with every key padded: fully masked rows
    else:
        kv_len = np.full(case.b, max(1, case.sk // 2), np.int32)
    if case.q_start == "default":
        q_start = np.full(case.b, case.sk - case.sq, np.int32)
    elif case.q_start == "zero":
        q_start = np.zeros(case.b, np.int32)
    elif case.q_start == "negative":
        q_start = np.full(case.b, -5, np.int32)
    else:
        q_start = rng.integers(-4, case.sk, case.b).astype(np.int32)
    wl, wr = window(case.causal, case.window_size)
    scale = case.scale if case.scale is not None else 1.0 / np.sqrt(case.d)
    kw = dict(scale=scale, softcap=case.softcap, window_left=wl, window_right=wr)
    return Inputs(q, k, v, kv_len, q_start, do, scale, case.softcap, wl, wr, s, kw)


def rel_err(got, ref) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    # Inputs are O(1) normals; a reference that is exactly zero (dq and dk with a single visible
    # key, where softmax is the constant 1) is judged with the absolute tolerance tol * 1e-1
    # rather than dividing rounding noise by ~0. That noise is real: dS = P·(dP - Δ) cancels two
    # D-term f32 dot products of O(1) values (dO·v and dO·o, with o = v), summed in different
    # orders, so even a gradient that is exactly 0 comes out ~D·eps ≈ 1e-6..1e-5 (seen: 1.5e-6
    # in dq and 4e-6 in dk at D = 96, which the earlier floor of 1e-2, i.e. 1e-6 for f32, failed).
    denom = max(float(np.max(np.abs(ref[fin]), initial=0.0)), 1e-1)
    return float(np.max(np.abs(got[fin] - ref[fin]), initial=0.0)) / denom


def fully_masked_rows(x: Inputs) -> np.ndarray:
    """bool[B, Sq]: queries that see no key (their o is 0, lse -inf, dq 0)."""
    from exla_rs_jax import visible_mask

    m = visible_mask(x.q.shape[0], x.q.shape[1], x.k.shape[1], x.kv_len, x.q_start, x.window_left, x.window_right)
    return ~m.any(-1)


def assert_grads(x: Inputs, dt: str, grads, refs, ctx: str, masked=None) -> None:
    """(dq, dk, dv) typed and shaped like (q, k, v), finite (outputs are poisoned on the GPU, so
    an unwritten element fails here), within TOL[dt] of the float64 refs, and dq exactly 0 on
    fully masked rows: `masked` (bool[B, Sq]) when a key mask or bias hides rows too, else
    those the visibility options hide."""
    masked = fully_masked_rows(x) if masked is None else masked
    for name, got, ref, like in zip(("dq", "dk", "dv"), grads, refs, (x.q, x.k, x.v)):
        got = np.asarray(got)
        assert got.dtype == like.dtype and got.shape == like.shape, f"{name} {ctx}"
        assert np.isfinite(got.astype(np.float32)).all(), f"{name}: unwritten or non-finite values ({ctx})"
        err = rel_err(got, ref)
        assert err <= TOL[dt], f"{name} rel err {err:.2e} > {TOL[dt]} ({ctx})"
    assert np.all(np.asarray(grads[0]).astype(np.float32)[masked] == 0), f"dq of fully masked rows ({ctx})"



# ---------------------------------------------------------------------------------------------
# The contract's optional operands: key_mask, bias (+ dbias), alibi_slopes
# ---------------------------------------------------------------------------------------------

# Bias broadcast patterns: one letter per dim of [B, H, Sq, Sk], "1" = broadcast.
BIAS_PATTERNS = ("BHQK", "1HQK", "B1QK", "11QK", "1H1K", "BHQ1", "1111")
MASK_DTYPES = (np.uint8, np.bool_, np.int32, np.int64)


@dataclass(frozen=True)
class Extra:
    key_mask: str | None = None  # left_pad | holes | all_masked (batch row 0 sees nothing)
    bias: str | None = None  # a BIAS_PATTERNS entry
    bias_f32: bool = False  # bias in f32 whatever the q type (else q's type)
    bias_neg_inf: bool = False  # row 0 of the bias all -inf (fully masked rows) plus scattered -inf
    alibi: bool = False
    mask_dtype: int = 0  # index into MASK_DTYPES

    def name(self) -> str:
        parts = []
        if self.key_mask:
            parts.append(f"mask_{self.key_mask}_{np.dtype(MASK_DTYPES[self.mask_dtype]).name}")
        if self.bias:
            parts.append(f"bias_{self.bias}" + ("_f32" if self.bias_f32 else "") + ("_neginf" if self.bias_neg_inf else ""))
        if self.alibi:
            parts.append("alibi")
        return "+".join(parts) or "none"


def bias_dims(pattern: str, b: int, h: int, sq: int, sk: int) -> tuple:
    return tuple(1 if c == "1" else n for c, n in zip(pattern, (b, h, sq, sk)))


def make_extras(x: Inputs, e: Extra, dtype) -> dict:
    """Fresh random optional operands for the inputs `x` (keyword arguments of flash_attn_*/
    reference_*): never zeros, the bias rounded to the type it is passed in."""
    rng = np.random.default_rng(x.seed + 17)
    b, sq, h, _ = x.q.shape
    sk = x.k.shape[1]
    out = {}
    if e.key_mask:
        j = np.arange(sk)[None, :]
        if e.key_mask == "left_pad":
            pad = rng.integers(0, max(1, sk - 1), b)
            pad[0] = sk // 3  # a left-padded row whose padding spans whole 64-key tiles when sk is large
            m = j >= pad[:, None]
        elif e.key_mask == "holes":
            m = rng.random((b, sk)) > 0.3
        else:
            m = np.broadcast_to(j >= rng.integers(0, sk, b)[:, None], (b, sk)).copy()
            m[0] = False
        out["key_mask"] = m.astype(MASK_DTYPES[e.mask_dtype])
    if e.bias:
        dims = bias_dims(e.bias, b, h, sq, sk)
        bias = rng.standard_normal(dims).astype(np.float32)
        if e.bias_neg_inf:
            bias[(0,) * 3] = -np.inf  # the first bias row: every key of query row 0 hidden
            bias[rng.random(dims) < 0.1] = -np.inf
        bdt = np.float32 if e.bias_f32 else dtype
        out["bias"] = np.asarray(jnp.asarray(bias, dtype=bdt))
    if e.alibi:
        # Geometric slopes as ALiBi uses them, one negative to cover both signs.
        slopes = (2.0 ** (-8.0 * (np.arange(h) + 1) / h)).astype(np.float32)
        slopes[-1] = -slopes[-1] / 4
        out["alibi_slopes"] = slopes
    return out
