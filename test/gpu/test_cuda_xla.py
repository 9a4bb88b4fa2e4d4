"""The CUDA handlers through a real XLA (jax with its CUDA plugin): forward and backward against
float64 references over every option, dtype, head dim and odd size. Outputs are poisoned (NaN)
before each call, so an element a kernel forgets to write fails the test. Fresh random inputs each
run (EXLA_RS_SEED replays one).

Run on a GPU machine after `cargo build --release --manifest-path native/exla_rs/Cargo.toml --workspace`:
    python3 -m pytest -q test/gpu/test_cuda_xla.py

Without a GPU (scripts/gpu_on_cpu.sh): EXLA_RS_TEST_PLATFORM=cuda-on-cpu runs every test, the
CUDA-specific ones included, against the CUDA handlers' code path on jax's cpu device, the CUDA
kernels executed by the GPU-on-CPU executor (EXLA_RS_XLA_LIB = a library built with exla-rs-xla's
`gpu-on-cpu` feature); EXLA_RS_GPUSIM_MAX_SEQ caps the sequence lengths for that slower run
(capped() below), and conftest.py checks at the end that every kernel was launched.
"""
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

import jax
import jax.numpy as jnp

# EXLA_RS_TEST_PLATFORM=cpu runs the same cases against the Host handlers: a check of this file
# itself on a machine without a GPU (the CUDA-only tests are skipped then); cuda-on-cpu runs the
# CUDA handlers and kernels on the CPU (see the module doc).
PLATFORM = os.environ.get("EXLA_RS_TEST_PLATFORM", "cuda")
assert PLATFORM in ("cuda", "cpu", "cuda-on-cpu"), f"EXLA_RS_TEST_PLATFORM={PLATFORM!r}: expected cuda, cpu or cuda-on-cpu"
try:
    GPU = jax.devices("gpu" if PLATFORM == "cuda" else "cpu")[0]
except RuntimeError:
    pytest.skip("no CUDA device visible to jax", allow_module_level=True)
# The float64 references: numpy with BLAS einsums by default; EXLA_RS_TEST_REF=device jits them in
# float64 on the GPU. Measured on an H200 (2026-11-27, 583 tests a path, 16 processes): numpy 0.54 s
# per test (median), the GPU 2.17 s: its XLA compile per shape costs more than the einsums.
if PLATFORM == "cuda" and os.environ.get("EXLA_RS_TEST_REF", "host") == "device":
    import exla_rs_jax

    exla_rs_jax.set_reference_device(GPU)
# Tests of the CUDA handlers' own rules (head dims, workspace layout): cuda and cuda-on-cpu.
cuda_only = pytest.mark.skipif(PLATFORM == "cpu", reason="CUDA-specific")

import exla_rs_jax as ex
from cases import CASES as HOST_CASES, DTYPES, TOL, Case, assert_grads, fully_masked_rows, make, rel_err, seed

CUDA_DIMS = ex.KERNEL_HEAD_DIMS
# Head dims without a kernel (issue 33, part 4): run on the next kernel head dim with zero-padded
# copies in the workspace (Stable Diffusion's 40/80/160, Phi-2's 80, and odd ones).
PADDED_DIMS = (40, 80, 160, 72, 8)

# cuda-on-cpu: the longest sequence a case keeps (0 = no cap). Keep it above 128, the kernels'
# largest tile (32/64/128 rows), so capped cases still cross tile boundaries.
MAX_SEQ = int(os.environ.get("EXLA_RS_GPUSIM_MAX_SEQ", "0"))


# The cuda-on-cpu run of the sm90 kernel set (EXLA_RS_CUDA_PATH=sm90): a test whose calls never
# reach the sm90 forward (f32, head dims without an sm90 instantiation, tests of the backward
# alone) runs exactly the kernels of the default run, so it is skipped there to keep CI within its
# time; on a GPU every test runs under every setting. Calls with optional operands (key_mask, bias,
# ALiBi, dropout) reach the sm90 forward's feature sets (issue 32, part 3): those tests run.
SM90_CPU_RUN = PLATFORM == "cuda-on-cpu" and os.environ.get("EXLA_RS_CUDA_PATH", "").strip() == "sm90"
SM90_DIMS = (64, 128, 256)


SM90_BWD_DIMS = (64, 128, 256)  # sm90_bwd.rs SM90_BWD_HEAD_DIMS


def dt_name(dt) -> str:
    """"f32" / "f16" / "bf16" for a dtype name or a numpy / jax type."""
    if isinstance(dt, str):
        return dt
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}[np.dtype(dt).name]


def skip_unless_sm90_forward(dt, d: int, optional_operands: bool = False, forward_only_test: bool = True, dropout: bool = False,
                             sm90_backward_d: int | None = None):
    """In the sm90 cuda-on-cpu run, skips a test that cannot reach the sm90 kernels (a padded head
    dim reaches them when its kernel head dim is an sm90 one: 40 runs on 64). The sm90 forward has
    every feature set, but dropout at D = 256 (sm90.rs sm90_has_set: its calls run the mma.sync
    forward), so `optional_operands` alone no longer skips a forward test. `sm90_backward_d`: the
    head dim of the test's backward calls; the test is kept when they reach the sm90 backward
    (which has every feature set too)."""
    if SM90_CPU_RUN and sm90_backward_d is not None and reaches_sm90_backward(dt_name(dt), sm90_backward_d):
        return
    kd = ex.kernel_head_dim(d)
    if SM90_CPU_RUN and (dt_name(dt) == "f32" or kd not in SM90_DIMS or not forward_only_test or (dropout and kd == 256)):
        pytest.skip("sm90 cuda-on-cpu run: these calls run the mma.sync/SIMT kernels the default run checks")


def reaches_sm90_backward(dt: str, d: int) -> bool:
    """Whether EXLA_RS_CUDA_PATH=sm90 runs a backward of (dt, d) on the sm90 kernels, whatever its
    optional operands (sm90_bwd.rs: every feature set at D = 64, 128 and 256)."""
    return dt in ("f16", "bf16") and ex.kernel_head_dim(d) in SM90_BWD_DIMS


def sm90_backward_launches(dt, d: int, suffix: str = "") -> int:
    """How often the sm90 backward image of (dt, d) and feature set `suffix` ("", "_mask", "_drop",
    "_mask_drop") ran so far (0 off the cuda-on-cpu platform)."""
    dt = dt_name(dt)
    if PLATFORM != "cuda-on-cpu" or not reaches_sm90_backward(dt, d):
        return 0
    return ex.gpusim_launch_counts().get(f"exla_rs_sm90_bwd_{dt}_d{ex.kernel_head_dim(d)}{suffix}", 0)


def assert_sm90_backward_ran(dt, d: int, before: int, suffix: str = ""):
    """In the sm90 cuda-on-cpu run, proves the backward this test checked ran on the sm90 kernel
    of feature set `suffix` (`before`: sm90_backward_launches(dt, d, suffix) before the call)."""
    if SM90_CPU_RUN and reaches_sm90_backward(dt_name(dt), d):
        assert sm90_backward_launches(dt, d, suffix) > before, f"the sm90 backward (dt {dt_name(dt)}, d {d}, set {suffix or 'plain'}) did not run"


def sm90_forward(fn, suffix: str, d: int | None = None):
    """fn() (a forward call) run to completion; in the sm90 cuda-on-cpu run also the proof of the
    path it took: the sm90 image of feature set `suffix` ("", "_mask", "_drop", "_mask_drop"), or
    for a decode-sized call the split-KV kernels, which take such calls first on every path. `d`:
    the call's head dim, where a dropout call may have none (D = 256: the mma.sync forward runs
    it, sm90.rs sm90_has_set; such a test is in this run for its sm90 backward)."""
    if not SM90_CPU_RUN or (d is not None and "drop" in suffix and ex.kernel_head_dim(d) == 256):
        return fn()
    import re

    before = dict(ex.gpusim_launch_counts())
    out = jax.block_until_ready(fn())
    after = ex.gpusim_launch_counts()
    ran = {n for n in after if after[n] != before.get(n, 0)}
    want = re.compile(rf"exla_rs_sm90_fwd_b?f16_d\d+{suffix}$")
    assert any(want.match(n) for n in ran) or any("_fwd_split_" in n for n in ran), f"not the sm90 forward's {suffix or 'plain'} set: ran {sorted(ran)}"
    return out


def capped(c: Case) -> Case:
    """`c` with Sq and Sk scaled down together so the longer is at most MAX_SEQ: their ratio, a
    one-row decode, the window sizes relative to the sequence, and every option stay."""
    if MAX_SEQ <= 0 or max(c.sq, c.sk) <= MAX_SEQ:
        return c
    f = MAX_SEQ / max(c.sq, c.sk)
    shrink = lambda n: n if n <= 1 else max(2, round(n * f))
    win = None if c.window_size is None else tuple(w if w <= 0 else max(1, round(w * f)) for w in c.window_size)
    return dataclasses.replace(c, sq=shrink(c.sq), sk=shrink(c.sk), window_size=win)

# The Host cases (every head dim up to 256 runs on CUDA, natively or padded: d1, d16, d40, d48 and
# d80 among them), plus cases sized to cross tile boundaries (the kernels use 32/64/128-row tiles):
# several tiles, ragged last tiles, long windows, big GQA groups; and the padded head dims likewise.
CUDA_CASES = [capped(c) for c in [c for c in HOST_CASES if c.d <= 256] + [
    Case(f"d{d}_ragged", 2, 131, 197, 4, 2, d, causal=c, kv_len="random", q_start="random")
    for d in CUDA_DIMS
    for c in (False, True)
] + [
    Case(f"d{d}_ragged", 2, 131, 197, 4, 2, d, causal=n % 2 == 0, kv_len="random", q_start="random", softcap=10.0 * (n == 2),
         scale=0.3 if n == 1 else None)
    for n, d in enumerate(PADDED_DIMS)
] + [
    # A padded decode step: the kernel shape (D = 96) decides the split-KV forward too.
    Case("decode_padded_d80", 4, 1, 900, 8, 1, 80, causal=True),
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
]]
PARAMS = [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in CUDA_CASES for dt in DTYPES]
# Forward only, at the sm90 head dims in the 16-bit types: windows that reach right of the
# diagonal (window_right > 0, which no causal case has), one of them left-unbounded, so the sm90
# forward's key intervals and straddle tests meet them too (the mma.sync ones already do above).
FWD_PARAMS = PARAMS + [pytest.param(c, dt, id=f"{c.name}-{dt}") for c in [
    Case("window_right_d256", 1, 80, 130, 2, 1, 256, window_size=(-1, 30), q_start="zero"),
    Case("window_both_gqa_d128", 1, 150, 160, 4, 2, 128, window_size=(70, 5), softcap=20.0, kv_len="short", q_start="random"),
    Case("window_both_d64", 2, 140, 150, 2, 2, 64, window_size=(20, 40), q_start="random"),
] for dt in ("f16", "bf16")]


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


@pytest.mark.parametrize("case,dt", FWD_PARAMS)
def test_forward_matches_float64_reference(case, dt):
    skip_unless_sm90_forward(dt, case.d)
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
    # The backward kernels are those of the default run; the sm90 forward's o / lse are checked
    # by the forward test.
    skip_unless_sm90_forward(dt, case.d, forward_only_test=False, sm90_backward_d=case.d)
    x = make(case, DTYPES[dt], seed())
    o, lse = run_fwd(x)
    poison((x.q.shape, x.q.dtype), (x.k.shape, x.k.dtype), (x.v.shape, x.v.dtype))
    q, k, v, kv, qs, do = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start, x.do)
    before = sm90_backward_launches(dt, case.d)
    dq, dk, dv = ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do, platform=PLATFORM, **x.kw)
    assert_sm90_backward_ran(dt, case.d, before)
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
    skip_unless_sm90_forward(dt, case.d, forward_only_test=False, sm90_backward_d=ex.lse_grad_head_dim(case.d))
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
    skip_unless_sm90_forward(dt, 64)
    case = capped(Case("everything_d64", 2, 150, 170, 6, 2, 64, causal=True, window_size=(40, 3), softcap=12.0, kv_len="random", q_start="random"))
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
    case = capped(Case("repeat", 2, 300, 300, 4, 2, 128, causal=True))
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
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_backward_is_deterministic_with_the_switch(dt, monkeypatch):
    """EXLA_RS_DETERMINISTIC=1 (exla-rs-cuda's determinism.rs): the tensor-core backward adds dQ
    key block after key block, so repeated calls give the same bits (the default mode's atomics
    may not on a GPU), within the float64 reference's tolerance. On the executor the repeats
    agree either way; crates/exla-rs-gpusim's test checks its launches there."""
    monkeypatch.setenv("EXLA_RS_DETERMINISTIC", "1")
    case = capped(Case("deterministic", 2, 2048, 2048, 8, 2, 128, causal=False, kv_len="random"))
    x = make(case, DTYPES[dt], seed())
    q, k, v, kv, qs, do = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start, x.do)
    o, lse = ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw)
    bwd = jax.jit(lambda *a: ex.flash_attn_bwd(*a, platform=PLATFORM, **x.kw))
    runs = [[np.asarray(g) for g in bwd(q, k, v, kv, qs, o, lse, do)] for _ in range(3)]
    for r in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], r):
            assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), f"{name} differs between runs (seed={x.seed})"
    refs = ex.reference_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, x.do, **x.kw)
    for name, g, r in zip(("dq", "dk", "dv"), runs[0], refs):
        assert rel_err(g, r) <= TOL[dt], f"{name} (seed={x.seed})"


@cuda_only
@pytest.mark.parametrize("d", [1, 8, 16, 40, 48, 72, 80, 100, 160, 200, 255])
def test_padded_head_dims_take_their_copies_in_the_workspace(d):
    """Issue 33, part 4: a head dim without a kernel is supported; its workspace holds the padded
    copies (the contract's "Head dims on CUDA"); past 256 nothing runs."""
    b, sq, sk, h, hkv = 2, 100, 120, 8, 2
    for dt in (jnp.bfloat16, jnp.float16, np.float32):
        for pass_ in (0, 1):
            got = ex.workspace_bytes(pass_, PLATFORM, dt, b, sq, sk, h, hkv, d)
            assert got == ex.padded_workspace_bytes(pass_, dt, b, sq, sk, h, hkv, d), (d, dt, pass_)
    assert ex.workspace_bytes(0, PLATFORM, jnp.bfloat16, b, sq, sk, h, hkv, 257) == -1


@cuda_only
@pytest.mark.parametrize("d", [80, 8])
@pytest.mark.parametrize("dt", list(DTYPES))
def test_a_padded_call_is_the_next_kernel_dims_call_on_zero_columns(d, dt):
    """The padded path computes exactly what the next kernel head dim computes on inputs padded by
    hand with zero columns (same kernels, same scale): the same bits in the first d columns of o,
    dk, dv and in lse, and dq and dbias equal up to the order of their atomic f32 sums. With
    options (mask, bias with its gradient, ALiBi, GQA, causal, softcap) so the feature-set kernels
    run padded too."""
    skip_unless_sm90_forward(dt, d, optional_operands=True, forward_only_test=False)
    case = capped(Case("pad_vs_native", 2, 70, 90, 4, 2, d, causal=True, softcap=7.0, kv_len="random", q_start="random"))
    x = make(case, DTYPES[dt], seed())
    ext = make_extras(x, Extra(key_mask="holes", bias="B1QK", alibi=True), DTYPES[dt])
    dk_ = ex.kernel_head_dim(d)
    wide = lambda a: np.concatenate([a, np.zeros(a.shape[:3] + (dk_ - d,), a.dtype)], axis=-1)
    kw = dict(x.kw, platform=PLATFORM, **on_gpu_dict(ext))
    ctx = f"seed={x.seed}"

    def run(q, k, v, do):
        q, k, v, kv, qs, do = on_gpu(q, k, v, x.kv_len, x.q_start, do)
        o, lse = ex.flash_attn_fwd(q, k, v, kv, qs, **kw)
        return (o, lse) + tuple(ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do, bias_grad=True, **kw))

    got = [np.asarray(t) for t in run(x.q, x.k, x.v, x.do)]
    want = [np.asarray(t) for t in run(wide(x.q), wide(x.k), wide(x.v), wide(x.do))]
    for name, g, w in zip(["o", "lse", "dq", "dk", "dv", "dbias"], got, want):
        if name not in ("lse", "dbias"):
            assert g.shape[-1] == d, name
            assert not w[..., d:].astype(np.float32).any(), f"{name}: the zero columns got values ({ctx})"
            w = w[..., :d]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        # Sums added into f32 by atomics, in an order the contract leaves open: dbias (the bias
        # broadcasts over heads here: f32 differed in its last bits on an H200) and the
        # tensor-core backward's dq (key blocks add into one f32 accumulator). The two calls agree
        # up to that order's rounding, then one rounding to the result's type; the rest must be
        # the same bits.
        if name == "dbias" or (name == "dq" and w.dtype != np.float32):
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            tol = 2 * float(jnp.finfo(w.dtype).eps) * np.abs(w64) + 64 * 2.0**-23 * np.abs(w64).max()
            bad = ~(np.abs(g64 - w64) <= tol)
            assert not bad.any(), f"{name} differs from the D={dk_} call beyond the summation order's rounding at {np.argwhere(bad)[:4].tolist()} ({ctx})"
            continue
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=f"{name} differs from the D={dk_} call ({ctx})")


@cuda_only
def test_workspace_matches_the_layout():
    # Backward scratch: delta f32[B,H,Sq] (256-aligned) + f32 dq accumulator for half types.
    b, sq, sk, h, hkv, d = 2, 100, 120, 8, 2, 128
    delta = -(-(b * h * sq * 4) // 256) * 256
    assert ex.workspace_bytes(0, PLATFORM, jnp.bfloat16, b, sq, sk, h, hkv, d) == 0
    assert ex.workspace_bytes(1, PLATFORM, jnp.bfloat16, b, sq, sk, h, hkv, d) == delta + b * sq * h * d * 4
    assert ex.workspace_bytes(1, PLATFORM, np.float32, b, sq, sk, h, hkv, d) == delta


# Issue 13, part 1: non-finite values no row may see, and windows near i64::MAX. The poisoned call
# is compared with the same call on poison-free inputs on every output a row or key that does not
# see the poison produces. The kv_padding cases put inf/NaN in K and V rows past kv_len (padding
# the contract lets hold anything) inside key tiles that also hold visible keys: the mma.sync
# loaders zero-fill those rows, the sm90 producer zeroes them after its TMA load.
NONFINITE = [
    # (name, B, Sq, Sk, H, Hkv, D, wl, wr, kv_len, q_start, k/v poison (tensor, b, key, kv head, col, value), dead rows (b, i))
    ("window_kv", 1, 200, 200, 2, 1, 64, 7, 0, [200], [0],
     [("k", 0, 3, 0, 5, np.inf), ("v", 0, 5, 0, 3, np.nan), ("v", 0, 130, 0, 10, -np.inf), ("k", 0, 199, 0, 0, np.nan)], []),
    ("kv_cache_garbage", 2, 40, 300, 4, 2, 128, -1, 0, [300, 300], [100, 60],
     [("k", 0, 250, 1, 0, np.nan), ("v", 0, 141, 0, 9, np.inf), ("v", 1, 200, 1, 1, np.nan), ("k", 1, 101, 0, 7, -np.inf)], []),
    ("dead_rows_d256", 2, 70, 60, 2, 1, 256, -1, 0, [60, 0], [-20, 0], [("v", 0, 59, 0, 2, np.nan)],
     [(0, i) for i in range(20)] + [(1, i) for i in range(70)]),
    ("dead_rows_d32", 1, 90, 90, 4, 4, 32, 3, 0, [90], [-10], [], [(0, i) for i in range(10)]),
    ("kv_padding_d128", 2, 70, 150, 2, 1, 128, -1, 0, [137, 70], [67, 0],
     [("k", 0, 140, 0, 3, np.nan), ("v", 0, 137, 0, 0, np.nan), ("v", 0, 149, 0, 127, np.inf), ("k", 1, 100, 0, 0, np.inf),
      ("v", 1, 70, 0, 5, np.nan), ("v", 1, 127, 0, 9, -np.inf), ("v", 1, 149, 0, 64, np.nan)], []),
    # Decode (the split-KV path: GQA 4, several splits): garbage in the cache past and inside kv_len.
    ("decode_split_d128", 2, 1, 300, 8, 2, 128, -1, 0, [300, 180], [299, 179],
     [("v", 0, 40, 1, 7, np.nan), ("k", 0, 200, 1, 3, np.inf), ("v", 1, 250, 0, 1, np.nan), ("v", 1, 181, 1, 100, np.inf),
      ("k", 1, 299, 1, 0, np.nan)], []),
    ("kv_padding_d256", 1, 40, 100, 2, 2, 256, -1, -1, [77], [0],
     [("v", 0, 77, 1, 200, np.nan), ("k", 0, 90, 0, 0, np.nan), ("v", 0, 99, 0, 3, np.inf), ("v", 0, 80, 0, 64, -np.inf)], []),
]


@pytest.mark.parametrize("dt", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("cfg", NONFINITE, ids=[c[0] for c in NONFINITE])
def test_no_nan_from_hidden_nonfinite_values_or_dead_rows(cfg, dt):
    name, b, sq, sk, h, hkv, d, wl, wr, kv_len, q_start, kvp, dead = cfg
    skip_unless_sm90_forward(dt, d)
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


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("d", [64, 128, 32])
def test_backward_rows_with_lse_neg_inf_inside_fully_visible_tiles(d, dt):
    """Rows the caller's lse marks fully masked (-inf), with NaN in their q and do, inside query
    tiles that see every key of a block: the mma.sync backward runs such tiles in its lean loop
    (no mask code), where those rows must still contribute nothing. dq of those rows is exactly 0,
    and dq, dk, dv match the clean call with their do rows zero (which contribute nothing either);
    a GQA group of 2 so the lean loop's steps cross query heads."""
    skip_unless_sm90_forward(dt, d, forward_only_test=False, sm90_backward_d=d)
    b, sq, sk, h, hkv = 1, 150, 140, 4, 2
    sd = seed()
    rng = np.random.default_rng(sd)
    dtype = DTYPES[dt]
    q, do = (rng.standard_normal((b, sq, h, d)).astype(np.float32).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype) for _ in range(2))
    kv, qs = np.array([sk], np.int32), np.zeros((b,), np.int32)
    kw = dict(scale=1 / np.sqrt(d), window_left=-1, window_right=-1)
    gq, gk, gv, gkv, gqs = on_gpu(q, k, v, kv, qs)
    o, lse = ex.flash_attn_fwd(gq, gk, gv, gkv, gqs, platform=PLATFORM, **kw)
    o, lse0 = np.asarray(o), np.asarray(lse)
    # Dead rows in heads 1 and 2 (one of each kv head's group); heads 0 and 3 keep them clean.
    dead, hd = [3, 40, 41, 77, 100], [1, 2]
    sel = np.ix_(range(b), dead, hd)
    pq, pdo, zdo, lse = q.copy(), do.copy(), do.copy(), lse0.copy()
    pq[sel], pdo[sel], zdo[sel] = np.nan, np.nan, 0
    lse[np.ix_(range(b), hd, dead)] = -np.inf

    def run(q_, do_, lse_):
        args = on_gpu(q_, k, v, kv, qs, o, lse_, do_)
        return [np.asarray(x).astype(np.float32) for x in ex.flash_attn_bwd(*args, platform=PLATFORM, **kw)]

    before = sm90_backward_launches(dt, d)
    got, want = run(pq, pdo, lse), run(q, zdo, lse0)
    assert_sm90_backward_ran(dt, d, before)
    ctx = f"d{d} {dt} seed={sd}"
    assert np.all(got[0][sel] == 0), f"dq of the lse = -inf rows ({ctx})"
    for what, gx, wx in zip(("dq", "dk", "dv"), got, want):
        assert np.isfinite(gx).all(), f"{what}: non-finite ({ctx})"
        assert rel_err(gx, wx) <= TOL[dt], f"{what}: rel err {rel_err(gx, wx):.2e} ({ctx})"


@pytest.mark.parametrize("d", [64, 40], ids=["d64", "d40_padded"])
@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("b,sq,sk", [(2, 0, 50), (2, 40, 0), (0, 40, 50)], ids=["no_queries", "no_keys", "no_batch"])
def test_empty_shapes(b, sq, sk, dt, d):
    """Calls with an empty dimension (the launcher skips empty grids; on the sm90 setting they stay
    on mma.sync, no tensor map describes an empty tensor): every result fully written, rows with
    no keys fully masked (o = 0, lse = -inf, dq = 0), keys with no queries get dk = dv = 0."""
    h, hkv = 4, 2
    rng = np.random.default_rng(seed())
    dtype = DTYPES[dt]
    q, do = (rng.standard_normal((b, sq, h, d)).astype(np.float32).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((b, sk, hkv, d)).astype(np.float32).astype(dtype) for _ in range(2))
    kw = dict(scale=0.125, window_left=-1, window_right=-1)
    g = on_gpu(q, k, v, np.full((b,), sk, np.int32), np.zeros((b,), np.int32), do)
    poison(((b, sq, h, d), dtype), ((b, h, sq), np.float32))
    o, lse = ex.flash_attn_fwd(*g[:5], platform=PLATFORM, **kw)
    poison(((b, sq, h, d), dtype), ((b, sk, hkv, d), dtype), ((b, sk, hkv, d), dtype))
    dq, dk, dv = (np.asarray(x).astype(np.float32) for x in ex.flash_attn_bwd(*g[:5], o, lse, g[5], platform=PLATFORM, **kw))
    o, lse = np.asarray(o).astype(np.float32), np.asarray(lse)
    assert o.shape == (b, sq, h, d) and lse.shape == (b, h, sq) and dk.shape == dv.shape == (b, sk, hkv, d)
    if sk == 0:
        assert np.all(o == 0) and np.all(np.isneginf(lse)) and np.all(dq == 0), "rows with no keys: o = 0, lse = -inf, dq = 0"
    if sq == 0:
        assert np.all(dk == 0) and np.all(dv == 0), "keys no query sees: dk = dv = 0"


@pytest.mark.parametrize("wl,wr", [(2**63 - 1, 2**63 - 1), (2**63 - 1, 0), (3, 2**63 - 2)])
def test_windows_near_i64_max_are_unbounded(wl, wr):
    """Windows near i64::MAX (clamped to 2^40 by the kernels' Mask::make, sm90's KeyInterval) give
    the bits of unbounded ones, with q_start at both i32 extremes: forward (rows' key intervals)
    and backward (keys' query intervals, keys_rows)."""
    rng = np.random.default_rng(seed())
    b, sq, sk, h, d = 2, 70, 90, 2, 64
    q, k, v, do = (rng.standard_normal(s).astype(np.float32).astype(DTYPES["bf16"]) for s in [(b, sq, h, d), (b, sk, 1, d), (b, sk, 1, d), (b, sq, h, d)])
    kv, qs = np.array([90, 50], np.int32), np.array([-(2**31), 2**31 - 80], np.int32)
    unb = lambda w: -1 if w >= 2**40 else w
    q_, k_, v_, kvg, qsg, do_ = on_gpu(q, k, v, kv, qs, do)
    got = ex.flash_attn_fwd(q_, k_, v_, kvg, qsg, scale=0.125, window_left=wl, window_right=wr, platform=PLATFORM)
    want = ex.flash_attn_fwd(q_, k_, v_, kvg, qsg, scale=0.125, window_left=unb(wl), window_right=unb(wr), platform=PLATFORM)
    for g_, w_ in zip(got, want):
        assert np.array_equal(np.asarray(g_).astype(np.float32), np.asarray(w_).astype(np.float32))
    o, lse = want
    got = ex.flash_attn_bwd(q_, k_, v_, kvg, qsg, o, lse, do_, scale=0.125, window_left=wl, window_right=wr, platform=PLATFORM)
    want = ex.flash_attn_bwd(q_, k_, v_, kvg, qsg, o, lse, do_, scale=0.125, window_left=unb(wl), window_right=unb(wr), platform=PLATFORM)
    for name, g_, w_ in zip(("dq", "dk", "dv"), got, want):
        assert np.array_equal(np.asarray(g_).astype(np.float32), np.asarray(w_).astype(np.float32)), f"{name} ({wl}, {wr})"


# ---------------------------------------------------------------------------------------------
# Issues 10 and 11 on CUDA: key_mask, bias (with dbias), ALiBi and dropout, each alone and with
# the older options, against float64. A feature whose bit `exla_rs_flash_attn_features` leaves
# clear must answer UNIMPLEMENTED instead (then the Elixir layer runs the Nx fallback).
# ---------------------------------------------------------------------------------------------
import philox_ref
from cases import BIAS_PATTERNS, Extra, make_extras
from test_host_extras import reference_grads_closed_form as reference_grads, summed_rows

FEATURE = {"key_mask": 1, "bias": 2, "alibi_slopes": 4, "bias_grad": 8, "dropout": 16}


def platform_features() -> int:
    return ex.load(PLATFORM).exla_rs_flash_attn_features(ex.PLATFORM_CODES[PLATFORM])


def missing_features(names) -> list:
    have = platform_features()
    return [n for n in names if not have & FEATURE[n]]


def expect_unimplemented(fn, missing):
    with pytest.raises(Exception, match="|".join(missing)) as info:
        jax.block_until_ready(fn())
    msg = str(info.value)
    assert "UNIMPLEMENTED" in msg or "Unimplemented" in msg or "not supported" in msg, msg


def on_gpu_dict(ext):
    return {n: jax.device_put(a, GPU) for n, a in ext.items()}


BY_NAME_CUDA = {c.name: c for c in CUDA_CASES}
# The older options with CUDA head dims: causal, windows, kv_len (fully masked batch rows),
# q_start (negative, random), GQA, softcap, Sq != Sk, odd sizes, several key tiles.
OLD_CUDA = ["plain", "causal_odd", "causal_sq_lt_sk", "decode_step", "sliding_causal", "kv_padding_fully_masked", "q_start_negative", "gqa",
            "everything", "softcap_d96", "window_both_d192", "d128_ragged"]
# Each new option the way the Host tests vary it (mask dtype, bias dtype by case index).
from test_host_extras import NEW as NEW_CUDA  # noqa: E402
EXTRA_PARAMS = [pytest.param(BY_NAME_CUDA[o], NEW_CUDA[k](n), dt, id=f"{k}-{o}-{dt}") for n, o in enumerate(OLD_CUDA) for k in NEW_CUDA for dt in DTYPES]
# Every bias broadcast pattern (and {B,1,1,Sk}) with its gradient, across several key tiles.
LONG_CUDA = capped(Case("long", 2, 70, 131, 4, 2, 32))
DBIAS_PATTERNS = tuple(BIAS_PATTERNS) + ("B11K",)
EXTRA_PARAMS += [pytest.param(LONG_CUDA, Extra(bias=p, bias_f32=n % 2 == 0), dt, id=f"bias_{p}-{dt}") for n, p in enumerate(DBIAS_PATTERNS) for dt in DTYPES]
EXTRA_PARAMS += [pytest.param(BY_NAME_CUDA["gqa"], Extra(bias=p), "f32", id=f"bias_{p}-gqa-f32") for p in DBIAS_PATTERNS]
# The masks-and-terms feature set (its own kernel images, config.rs FeatureSet) at every head dim,
# key_mask + bias + ALiBi with the bias gradient, over several tiles.
EXTRA_PARAMS += [pytest.param(BY_NAME_CUDA[f"d{d}_ragged"], Extra(key_mask="holes", bias="B1QK", alibi=True, mask_dtype=n % 4), dt,
                              id=f"feature_set_mask-d{d}-{dt}") for n, d in enumerate(CUDA_DIMS) for dt in DTYPES]
# The same on the padded head dims (their copies feed the feature-set kernels; dbias written in place).
EXTRA_PARAMS += [pytest.param(BY_NAME_CUDA[f"d{d}_ragged"], Extra(key_mask="holes", bias="1HQK", alibi=True, mask_dtype=n % 4), dt,
                              id=f"feature_set_mask-padded-d{d}-{dt}") for n, d in enumerate(PADDED_DIMS) for dt in DTYPES]
SPECIAL_CUDA = [
    ("mask_all_masked_row", LONG_CUDA, Extra(key_mask="all_masked", mask_dtype=0)),
    ("mask_holes_causal", BY_NAME_CUDA["causal_odd"], Extra(key_mask="holes", mask_dtype=2)),
    ("mask_left_pad_long_window", capped(Case("lp_win", 2, 150, 200, 2, 1, 64, causal=True, window_size=(70, 0))), Extra(key_mask="left_pad", mask_dtype=1)),
    ("mask_left_pad_tiles_d128", capped(Case("lp_tiles", 2, 200, 330, 4, 2, 128, q_start="zero")), Extra(key_mask="left_pad", mask_dtype=0)),
    ("bias_neginf_rows", LONG_CUDA, Extra(bias="1HQK", bias_neg_inf=True)),
    ("bias_neginf_full_softcap", BY_NAME_CUDA["softcap_d96"], Extra(bias="BHQK", bias_neg_inf=True)),
    ("alibi_long_causal", capped(Case("alibi_long", 1, 129, 300, 4, 1, 64, causal=True, q_start="random")), Extra(alibi=True)),
    ("all_three", BY_NAME_CUDA["everything"], Extra(key_mask="left_pad", bias="B1QK", alibi=True, mask_dtype=3)),
    ("all_three_neginf", LONG_CUDA, Extra(key_mask="holes", bias="1HQK", bias_neg_inf=True, alibi=True, bias_f32=True)),
    ("all_three_d256", BY_NAME_CUDA["softcap_gqa_d256"], Extra(key_mask="all_masked", bias="11QK", alibi=True)),
]
EXTRA_PARAMS += [pytest.param(c, e, dt, id=f"{name}-{dt}") for name, c, e in SPECIAL_CUDA for dt in DTYPES]


def extras_needed(ext, bias_grad):
    names = [n for n in ("key_mask", "bias", "alibi_slopes") if n in ext]
    return names + (["bias_grad"] if bias_grad else [])


def check_forward(x, dt, o, lse, ref_o, ref_lse, ctx):
    """o/lse against the float64 reference; fully masked rows exactly o = 0, lse = -inf."""
    tol = TOL[dt]
    o, lse = np.asarray(o), np.asarray(lse)
    assert o.dtype == x.q.dtype and o.shape == x.q.shape, ctx
    assert not np.isnan(o.astype(np.float32)).any() and not np.isnan(lse).any(), f"unwritten or NaN output ({ctx})"
    err = rel_err(o, ref_o)
    assert err <= tol, f"o rel err {err:.2e} > {tol} ({ctx})"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), f"fully masked rows differ ({ctx})"
    masked = np.isneginf(ref_lse).transpose(0, 2, 1)  # [B, Sq, H]
    assert np.all(o.astype(np.float32)[masked] == 0), ctx
    fin = np.isfinite(ref_lse)
    lse_tol = 1e-4 if dt == "f32" else tol
    assert np.max(np.abs(lse[fin] - ref_lse[fin]), initial=0) <= lse_tol * max(1.0, np.abs(ref_lse[fin]).max(initial=1)), ctx
    return masked


def check_dbias(got, ref, ext, shape, bar, ctx):
    got = np.asarray(got)
    assert got.dtype == ext["bias"].dtype and got.shape == ext["bias"].shape, ctx
    assert np.isfinite(got.astype(np.float32)).all(), f"dbias: unwritten or non-finite ({ctx})"
    ref = np.asarray(ref, np.float64)
    if got.shape[3] == 1:
        # sum_j dZ = 0 analytically: judged absolutely against the rows summed (as on the Host).
        floor = 1.0 * summed_rows(ext, shape)
        err = float(np.max(np.abs(got.astype(np.float64) - ref))) / max(floor, float(np.max(np.abs(ref))))
    else:
        err = rel_err(got, ref)
    assert err <= bar, f"dbias rel err {err:.2e} > {bar} ({ctx})"


@pytest.mark.parametrize("case,extra,dt", EXTRA_PARAMS)
def test_extras_forward_and_backward_match_float64(case, extra, dt):
    skip_unless_sm90_forward(dt, case.d, optional_operands=True)
    x = make(case, DTYPES[dt], seed())
    ext = make_extras(x, extra, DTYPES[dt])
    ctx = f"seed={x.seed} {extra.name()}"
    gext = on_gpu_dict(ext)
    q, k, v, kv, qs, do = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start, x.do)
    want_db = "bias" in ext
    missing = missing_features(extras_needed(ext, False))
    if missing:
        expect_unimplemented(lambda: ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw, **gext), missing)
        return
    poison((x.q.shape, x.q.dtype), ((case.b, case.h, case.sq), np.float32))
    o, lse = sm90_forward(lambda: ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw, **gext), "_mask")
    ref_o, ref_lse = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **ext)
    masked = check_forward(x, dt, o, lse, ref_o, ref_lse, ctx)
    if extra.key_mask == "all_masked" or extra.bias_neg_inf:
        assert masked.any(), f"the case should have fully masked rows ({ctx})"

    missing = missing_features(extras_needed(ext, want_db))
    if missing:
        expect_unimplemented(lambda: ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do, platform=PLATFORM, **x.kw, **gext, bias_grad=want_db), missing)
        return
    shapes = [(x.q.shape, x.q.dtype), (x.k.shape, x.k.dtype), (x.v.shape, x.v.dtype)] + ([(ext["bias"].shape, ext["bias"].dtype)] if want_db else [])
    poison(*shapes)
    before = sm90_backward_launches(dt, case.d, "_mask")
    grads = ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do, platform=PLATFORM, **x.kw, **gext, bias_grad=want_db)
    assert_sm90_backward_ran(dt, case.d, before, "_mask")
    refs = reference_grads(x, ext)
    assert_grads(x, dt, grads[:3], refs[:3], ctx, masked=masked)
    if want_db:
        check_dbias(grads[3], refs[3], ext, x.q.shape, 2 * TOL[dt], ctx)
        if extra.bias_neg_inf:
            db = np.asarray(grads[3]).astype(np.float32)
            assert np.all(db[np.isneginf(ext["bias"].astype(np.float32))] == 0), f"dbias at -inf entries ({ctx})"


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("d", [64, 256])
def test_key_mask_tile_gaps_and_nonfinite_values_at_hidden_keys(d, dt):
    """key_mask hiding whole key tiles between visible ones (the forward's tile search skips them
    unloaded; in the backward a block of hidden keys ends at once and writes zeros) and a -inf bias
    column hiding a key from every row, against the float64 reference; then the same call with
    inf/NaN in V (and K) at keys only key_mask or the -inf bias hides, which must change nothing.
    The mask is u8 at D = 64 and i16 at D = 256 (the other widths: EXTRA_PARAMS' mask dtypes).
    Batch row 1's -inf column lies in a key tile without any other hidden element: there only the
    bias makes the forward inspect V (flash_fwd.cuh, `!full || has_bias`)."""
    skip_unless_sm90_forward(dt, d, optional_operands=True)
    if missing_features(["key_mask", "bias", "bias_grad"]):
        pytest.skip("this platform lacks key_mask / bias / bias_grad")
    b, sq, sk, h, hkv = 2, 40, 200, 2, 1
    x = make(Case("tile_gaps", b, sq, sk, h, hkv, d, q_start="zero"), DTYPES[dt], seed())
    ctx = f"seed={x.seed} d={d} {dt}"
    key_mask = np.ones((b, sk), np.uint8 if d == 64 else np.int16)  # 1- and 2-byte mask loads
    # Forward key tiles 64.. (BN 64) or 64.., 96.. (BN 32) hidden between visible ones; the
    # backward's key block 0..127 (BN 128 at D = 64/128) half hidden, 64.. or 64.., 96.. (BN 64/32) whole.
    key_mask[0, 64:128] = 0
    key_mask[0, [5, 150]] = 0
    # The first visible forward tile after 2 (BN 64) or 4 (BN 32) hidden ones; the backward's first
    # block of 128 keys (D = 64/128) wholly hidden.
    key_mask[1, 0:128] = 0
    key_mask[1, 195] = 0
    bias = np.random.default_rng(x.seed + 3).standard_normal((b, 1, 1, sk)).astype(np.float32)
    bias[0, 0, 0, 20] = bias[1, 0, 0, 140] = -np.inf
    ext = {"key_mask": key_mask, "bias": bias.astype(DTYPES[dt])}
    # (tensor, b, key, kv head, column, value): keys hidden from every row.
    poison_at = [("v", 0, 100, 0, 3, np.nan), ("k", 0, 101, 0, 2, np.nan), ("v", 0, 5, 0, 1, np.inf), ("k", 0, 150, 0, 0, -np.inf),
                 ("v", 0, 20, 0, 7, np.inf), ("v", 1, 30, 0, 0, -np.inf), ("k", 1, 64, 0, 5, np.inf), ("v", 1, 140, 0, d - 1, np.nan)]
    gext = on_gpu_dict(ext)

    def run(k, v):
        q, k, v, kv, qs, do = on_gpu(x.q, k, v, x.kv_len, x.q_start, x.do)
        poison((x.q.shape, x.q.dtype), ((b, h, sq), np.float32))
        o, lse = sm90_forward(lambda: ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw, **gext), "_mask")
        poison((x.q.shape, x.q.dtype), (x.k.shape, x.k.dtype), (x.v.shape, x.v.dtype), (bias.shape, ext["bias"].dtype))
        before = sm90_backward_launches(dt, d, "_mask")
        grads = ex.flash_attn_bwd(q, k, v, kv, qs, o, lse, do, platform=PLATFORM, **x.kw, **gext, bias_grad=True)
        assert_sm90_backward_ran(dt, d, before, "_mask")
        return [o, lse, *grads]

    clean = run(x.k, x.v)
    ref_o, ref_lse = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **ext)
    masked = check_forward(x, dt, clean[0], clean[1], ref_o, ref_lse, ctx)
    refs = reference_grads(x, ext)
    assert_grads(x, dt, clean[2:5], refs[:3], ctx, masked=masked)
    check_dbias(clean[5], refs[3], ext, x.q.shape, 2 * TOL[dt], ctx)
    hidden = ~key_mask.astype(bool)  # [B, Sk]
    for bb in range(b):
        assert np.all(np.asarray(clean[3]).astype(np.float32)[bb, hidden[bb]] == 0), f"dk of hidden keys ({ctx})"
        assert np.all(np.asarray(clean[4]).astype(np.float32)[bb, hidden[bb]] == 0), f"dv of hidden keys ({ctx})"
    assert np.all(np.asarray(clean[5]).astype(np.float32)[np.isneginf(bias)] == 0), f"dbias at the -inf entries ({ctx})"

    pk, pv = x.k.copy(), x.v.copy()
    for t, bb, j, hh, c, val in poison_at:
        (pk if t == "k" else pv)[bb, j, hh, c] = val
    got = run(pk, pv)
    for name, g_, w_ in zip(("o", "lse", "dq", "dk", "dv", "dbias"), got, clean):
        g_, w_ = np.asarray(g_).astype(np.float32), np.asarray(w_).astype(np.float32)
        fin = np.isfinite(w_)
        assert np.array_equal(np.isfinite(g_), fin), f"{name}: non-finite values from inf/NaN at hidden keys ({ctx})"
        assert rel_err(g_[fin], w_[fin]) <= TOL[dt], f"{name}: rel err {rel_err(g_[fin], w_[fin]):.2e} ({ctx})"


# ---------------------------------------------------------------------------------------------
# Dropout (issue 11): the CUDA kernels draw the contract's Philox mask bit for bit
# ---------------------------------------------------------------------------------------------

import philox_ref  # noqa: E402
from test_dropout import CONFIGS as DROPOUT_CONFIGS, reference as dropout_reference  # noqa: E402

DROPOUT_DTYPES = [np.float32, jnp.float16, jnp.bfloat16]


def observed_dropout_mask(dt, key, rate, b, s, h, hkv):
    """M·s [B, H, Sq, Sk] as the kernel applies it: q = 0 (uniform softmax, lse = log Sk) and V the
    identity over keys (D = Sk), so o[b, i, h, j] = M·s / Sk exactly up to one rounding."""
    rng = np.random.default_rng(seed())
    q = np.zeros((b, s, h, s), dt)
    k = rng.standard_normal((b, s, hkv, s)).astype(dt)
    v = np.broadcast_to(np.eye(s, dtype=np.float32)[None, :, None, :], (b, s, hkv, s)).astype(dt)
    kv, qs = np.full((b,), s, np.int32), np.zeros((b,), np.int32)
    poison(((b, s, h, s), dt), ((b, h, s), np.float32))
    gq, gk, gv, gkv, gqs, gkey = on_gpu(q, k, v, kv, qs, np.asarray(key, np.uint32))
    o, lse = sm90_forward(lambda: ex.flash_attn_fwd(gq, gk, gv, gkv, gqs, scale=1.0, platform=PLATFORM, dropout_key=gkey, dropout_rate=rate), "_drop")
    np.testing.assert_allclose(np.asarray(lse), np.log(s), rtol=1e-6)
    return np.asarray(o, np.float64).transpose(0, 2, 1, 3) * s


@pytest.mark.parametrize("dt", DROPOUT_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("s", [64, 128])
def test_dropout_mask_is_bit_identical_to_the_reference(s, rate, dt):
    skip_unless_sm90_forward(dt, s, optional_operands=True, dropout=True)
    if missing_features(["dropout"]):
        pytest.skip("this platform does not report the dropout feature")
    key = (0x243F6A88, 0x85A308D3)
    b, h, hkv = 2, 4, 2
    ms = observed_dropout_mask(dt, key, rate, b, s, h, hkv)
    want = philox_ref.mask(key, rate, (b, h, s, s))
    kept = ms > 0
    np.testing.assert_array_equal(kept, want)
    # 16-bit outputs round scale/Sk to 8 (bf16) or 11 (f16) bits.
    tol = {np.float32: 1e-6, jnp.float16: 1e-3, jnp.bfloat16: 8e-3}[dt]
    np.testing.assert_allclose(ms[kept], float(philox_ref.keep_scale(rate)), rtol=tol)


def test_dropout_statistics_on_the_device():
    skip_unless_sm90_forward("f32", 256, optional_operands=True)
    if missing_features(["dropout"]):
        pytest.skip("this platform does not report the dropout feature")
    rate, b, s, h = 0.3, 1, 256, 4
    m1 = observed_dropout_mask(np.float32, (7, 11), rate, b, s, h, h) > 0
    p = 1 - philox_ref.threshold(rate) / 2**32
    assert abs(m1.mean() - p) < 4 * np.sqrt(p * (1 - p) / m1.size), (m1.mean(), p)
    np.testing.assert_array_equal(m1, observed_dropout_mask(np.float32, (7, 11), rate, b, s, h, h) > 0)
    assert (m1 != (observed_dropout_mask(np.float32, (7, 12), rate, b, s, h, h) > 0)).mean() > 0.3
    for hh in range(h - 1):
        assert (m1[:, hh] != m1[:, hh + 1]).mean() > 0.3


def tied_entries(key, shape, n=4):
    """Up to n entries (b, h, i, j) of a [B, H, Sq, Sk] mask whose draw is below 2^24, so that a
    threshold equal to the draw (or the draw + 1) is floor(rate * 2^32) of an f32 rate exactly.
    Picked to vary the bits the kernels' tie path keys on: j's half of a word (j & 1), the second
    n-tile / key octet of a pair ((j >> 3) & 1), the row's upper half of the mma fragment
    ((i >> 3) & 1, forward) and the query's parity (i & 1, backward)."""
    b, h, i, j = np.meshgrid(*(np.arange(n_) for n_ in shape), indexing="ij")
    draws = philox_ref.dropout_draw(key, b, h, i, j)
    low = np.argwhere(draws < (1 << 24) - 1)
    picked = []
    for pattern in ((0, 0, 0, 0), (1, 1, 1, 1), (0, 1, 0, 1), (1, 0, 1, 0)):
        for e in low:
            bits = (e[3] & 1, (e[3] >> 3) & 1, (e[2] >> 3) & 1, e[2] & 1)
            if bits == pattern and not any((e == p).all() for p in picked):
                picked.append(e)
                break
    return [(tuple(int(c) for c in e), int(draws[tuple(e)])) for e in picked[:n]]


@pytest.mark.parametrize("dt", DROPOUT_DTYPES, ids=["f32", "f16", "bf16"])
def test_dropout_ties_are_decided_by_the_lower_half(dt):
    """An entry whose draw's upper half equals the threshold's is decided by the lower half (the
    y draw, computed only then: probability 2^-16 per entry, so random thresholds almost never
    reach it). The threshold is forced onto chosen entries' draws (T = draw: kept; T = draw + 1:
    dropped) and the mask both kernels apply must be the contract's bit for bit: the forward's
    as o (q = 0, V the identity over keys), the backward's as dV (dO the identity over queries:
    dV[b, j, h, i] = M[b, h, i, j] * scale / Sk)."""
    skip_unless_sm90_forward(dt, 64, optional_operands=True, dropout=True)
    if missing_features(["dropout"]):
        pytest.skip("this platform does not report the dropout feature")
    key = (0x9E3779B9, 0x7F4A7C15)
    b, s, h = 2, 64, 2
    entries = tied_entries(key, (b, h, s, s))
    assert len(entries) == 4, entries
    rng = np.random.default_rng(seed())
    q = np.zeros((b, s, h, s), dt)
    k = rng.standard_normal((b, s, h, s)).astype(dt)
    v = np.broadcast_to(np.eye(s, dtype=np.float32)[None, :, None, :], (b, s, h, s)).astype(dt)
    do = np.broadcast_to(np.eye(s, dtype=np.float32)[None, :, None, :], (b, s, h, s)).astype(dt)
    kv, qs = np.full((b,), s, np.int32), np.zeros((b,), np.int32)
    gq, gk, gv, gkv, gqs, gdo, gkey = on_gpu(q, k, v, kv, qs, do, np.asarray(key, np.uint32))
    for entry, draw in entries:
        for thr, kept in ((draw, True), (draw + 1, False)):
            rate = thr / 2**32
            assert philox_ref.threshold(rate) == thr
            want = philox_ref.mask(key, rate, (b, h, s, s))
            assert want[entry] == kept, (entry, thr)
            kw = dict(scale=1.0, platform=PLATFORM, dropout_key=gkey, dropout_rate=rate)
            poison(((b, s, h, s), dt), ((b, h, s), np.float32))
            o, lse = ex.flash_attn_fwd(gq, gk, gv, gkv, gqs, **kw)
            fwd = np.asarray(o, np.float64).transpose(0, 2, 1, 3) > 0  # [B, H, Sq, Sk]
            poison(((b, s, h, s), dt), ((b, s, h, s), dt), ((b, s, h, s), dt))
            before = sm90_backward_launches(dt, s, "_drop")
            dv = np.asarray(ex.flash_attn_bwd(gq, gk, gv, gkv, gqs, o, lse, gdo, **kw)[2], np.float64)
            assert_sm90_backward_ran(dt, s, before, "_drop")
            bwd = dv.transpose(0, 2, 3, 1) > 0  # dv[b, j, h, i] -> [B, H, Sq = i, Sk = j]
            assert np.isfinite(np.asarray(o, np.float64)).all() and np.isfinite(dv).all(), f"unwritten or non-finite o / dv ({thr:#x})"
            for what, got in (("forward", fwd), ("backward", bwd)):
                bad = np.argwhere(got != want)
                assert bad.size == 0, f"{what} mask differs at {bad[:4].tolist()} (T = {thr:#x}, forced tie at {entry})"

# Every config at two head dims; the dropout-only and dropout-with-everything feature sets (their
# own kernel images) at every head dim.
DROPOUT_PARAMS = [pytest.param(name, d, dt, id=f"{name}-{d}-{i}") for name in DROPOUT_CONFIGS for d in (64, 128)
                  for dt, i in zip(DROPOUT_DTYPES, ["f32", "f16", "bf16"])]
DROPOUT_PARAMS += [pytest.param(name, d, dt, id=f"{name}-{d}-{i}") for name in ("plain", "everything") for d in CUDA_DIMS if d not in (64, 128)
                   for dt, i in zip(DROPOUT_DTYPES, ["f32", "f16", "bf16"])]
# Padded head dims with dropout (the mask does not depend on the head dim).
DROPOUT_PARAMS += [pytest.param("everything", d, dt, id=f"everything-padded-{d}-{i}") for d in (80, 72)
                   for dt, i in zip(DROPOUT_DTYPES, ["f32", "f16", "bf16"])]


@pytest.mark.parametrize("name,d,dt", DROPOUT_PARAMS)
def test_dropout_forward_backward_match_float64(name, d, dt):
    skip_unless_sm90_forward(dt, d, optional_operands=True, dropout=True, sm90_backward_d=d)
    """Forward and backward with dropout (and the other options) against a float64 reference that
    applies philox_ref's mask; the mask of the kernels is the reference's (bit identity above)."""
    need = ["dropout"] + [f for f in ("key_mask", "bias", "alibi_slopes") if DROPOUT_CONFIGS[name].get(f.split("_slopes")[0])]
    if missing_features(need):
        pytest.skip(f"this platform lacks {missing_features(need)}")
    c = DROPOUT_CONFIGS[name]
    rng = np.random.default_rng(seed())
    b, sq, sk, h = 2, 77, 93, 4
    hkv = c.get("hkv", h)
    rate = 0.2
    key = rng.integers(1, 2**32, 2, dtype=np.uint64).astype(np.uint32)
    q, k, v, do = (rng.standard_normal(sh).astype(np.float32) for sh in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, h, d)))
    q, k, v, do = (x.astype(dt) for x in (q, k, v, do))
    kv = np.array([c.get("kv_len", sk), sk - 5], np.int32)
    qs = np.full((b,), c.get("q_start", 0), np.int32)
    km = (rng.random((b, sk)) > 0.3).astype(np.uint8) if c.get("key_mask") else None
    bias = rng.standard_normal((1, h, sq, sk)).astype(np.float32) if c.get("bias") else None
    slopes = (2.0 ** (-8.0 * (np.arange(h) + 1) / h)).astype(np.float32) if c.get("alibi") else None
    opt = dict(scale=1.0 / np.sqrt(d), softcap=c.get("softcap", 0.0), window_left=c.get("wl", -1), window_right=c.get("wr", -1))
    ext = {n: x for n, x in (("key_mask", km), ("bias", bias), ("alibi_slopes", slopes)) if x is not None}
    g = on_gpu(q, k, v, kv, qs, do, key)
    gext = on_gpu_dict(ext)
    o, lse = sm90_forward(lambda: ex.flash_attn_fwd(*g[:5], platform=PLATFORM, **opt, **gext, dropout_key=g[6], dropout_rate=rate),
                          "_mask_drop" if ext else "_drop", d)
    before = sm90_backward_launches(dt, d, "_mask_drop" if ext else "_drop")
    grads = ex.flash_attn_bwd(*g[:5], o, lse, g[5], platform=PLATFORM, **opt, **gext, bias_grad=bias is not None, dropout_key=g[6], dropout_rate=rate)
    assert_sm90_backward_ran(dt, d, before, "_mask_drop" if ext else "_drop")
    ms = philox_ref.mask(tuple(int(x) for x in key), rate, (b, h, sq, sk)) * float(philox_ref.keep_scale(rate))
    want = dropout_reference(q, k, v, kv, qs, do, ms, scale=opt["scale"], softcap=opt["softcap"], wl=opt["window_left"], wr=opt["window_right"],
                             key_mask=km, bias=bias, slopes=slopes)
    bar = {np.float32: 1e-4, jnp.float16: 1e-2, jnp.bfloat16: 5e-2}[dt]
    got = [o, lse] + list(grads)
    for what, x, y in zip(["o", "lse", "dq", "dk", "dv", "dbias"], got, want):
        if y is None:
            continue
        x = np.asarray(x, np.float64)
        fin = np.isfinite(y)
        np.testing.assert_array_equal(np.isfinite(x), fin, err_msg=f"{name} {what}: non-finite entries differ")
        err = np.max(np.abs(x[fin] - y[fin])) / max(np.max(np.abs(y[fin])), 1e-2) if fin.any() else 0.0
        assert err < bar, f"{name} d={d} {dt}: {what} relative error {err:.2e} >= {bar}"


# ---------------------------------------------------------------------------------------------
# Split-KV decode (issue 34): a decode call (Sq <= 16) runs flash_fwd_split (every head of a GQA
# group and every query row in one CTA, the key range split across CTAs) and, with several
# splits, flash_fwd_combine. EXLA_RS_CUDA_SPLITS (read at every call) forces the split count
# (clamped to what the workspace holds) or turns the path off: each case runs split and non-split
# and both must match float64 and each other within the contract's tolerances.
# ---------------------------------------------------------------------------------------------
import contextlib  # noqa: E402


@contextlib.contextmanager
def cuda_splits(value):
    """EXLA_RS_CUDA_SPLITS=value inside the block. The launcher reads it when the call executes, and
    jax dispatches asynchronously: block on every result inside (split_call does)."""
    old = os.environ.get("EXLA_RS_CUDA_SPLITS")
    os.environ["EXLA_RS_CUDA_SPLITS"] = str(value)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("EXLA_RS_CUDA_SPLITS", None)
        else:
            os.environ["EXLA_RS_CUDA_SPLITS"] = old


def decode_cases(d):
    """Decode shapes at head dim d: Sq = 1 with GQA and a ragged cache (a batch row with kv_len 0,
    random q_start: Bumblebee's offset), small Sq with MQA, a sliding window and softcap, Sq = 16
    (the decode bound), and a long call (Sq = 40, > 8 key tiles) that the workspace lets split."""
    return [
        Case(f"dec1_gqa_d{d}", 3, 1, 300, 8, 2, d, causal=True, kv_len="random", q_start="random"),
        Case(f"dec5_mqa_win_softcap_d{d}", 2, 5, 260, 6, 1, d, causal=True, window_size=(90, 0), softcap=12.0, q_start="random"),
        Case(f"dec16_d{d}", 1, 16, 200, 4, 4, d, kv_len="short", q_start="zero", scale=0.3),
        Case(f"long40_gqa_d{d}", 1, 40, 600 if d <= 128 else 300, 4, 2, d, causal=True, q_start="default"),
    ]


# Every kernel head dim in both 16-bit types, several forced split counts (7 > the visible tiles of
# most row blocks here: empty splits; 128 is clamped to the workspace's limit); f32 (simt_fwd_split,
# 8 packed rows per warp, 32-key chunks) at every head dim on the decode cases (Sq <= 16: f32 splits
# only decode calls), one of them with a single split (the kernel writes o and lse itself).
DECODE_PARAMS = [pytest.param(c, dt, n, id=f"{c.name}-{dt}-s{n}") for d in CUDA_DIMS for dt in ("f16", "bf16")
                 for c, n in zip(decode_cases(d), (3, 7, 128, 2))]
DECODE_PARAMS += [pytest.param(c, "f32", n, id=f"{c.name}-f32-s{n}") for d in CUDA_DIMS
                  for c, n in zip(decode_cases(d)[:3], (4, 128, 1))]
# Padded head dims (the split kernels run on the next kernel head dim's zero-padded copies, their
# partials after the copies in the workspace).
DECODE_PARAMS += [pytest.param(c, dt, 3, id=f"{c.name}-{dt}-s3") for d in (40, 80) for dt in ("f16", "bf16") for c in decode_cases(d)[:2]]


def split_call(value, fn):
    """fn() run to completion with EXLA_RS_CUDA_SPLITS=value; on the executor also checks the path
    taken: the split kernel exactly when the setting is not off (a decode call, no dropout)."""
    before = dict(ex.gpusim_launch_counts()) if PLATFORM == "cuda-on-cpu" else None
    with cuda_splits(value):
        out = jax.block_until_ready(fn())
    if before is not None:
        after = ex.gpusim_launch_counts()
        ran = {n for n in after if after[n] != before.get(n, 0)}
        split = any("_fwd_split_" in n for n in ran)
        assert split == (value != "off") or any("_drop" in n for n in ran), f"EXLA_RS_CUDA_SPLITS={value}: ran {sorted(ran)}"
    return out


def check_split_vs_reference(x, dt, got, ref, ctx):
    o, lse = (np.asarray(t) for t in got)
    ref_o, ref_lse = ref
    return check_forward(x, dt, o, lse, ref_o, ref_lse, ctx)


@pytest.mark.parametrize("case,dt,splits", DECODE_PARAMS)
def test_decode_split_matches_float64_and_the_non_split_forward(case, dt, splits):
    skip_unless_sm90_forward(dt, case.d, forward_only_test=False)  # the split path is not the sm90 forward
    x = make(case, DTYPES[dt], seed())
    ctx = f"seed={x.seed} splits={splits}"
    ref = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    split_o, split_lse = split_call(splits, lambda: run_fwd(x))
    base_o, base_lse = split_call("off", lambda: run_fwd(x))
    check_split_vs_reference(x, dt, (split_o, split_lse), ref, ctx)
    check_split_vs_reference(x, dt, (base_o, base_lse), ref, ctx + " (non-split)")
    split_o, base_o = np.asarray(split_o).astype(np.float32), np.asarray(base_o).astype(np.float32)
    split_lse, base_lse = np.asarray(split_lse), np.asarray(base_lse)
    assert rel_err(split_o, base_o) <= TOL[dt], f"split vs non-split o: {rel_err(split_o, base_o):.2e} ({ctx})"
    assert np.array_equal(np.isneginf(split_lse), np.isneginf(base_lse)), ctx
    fin = np.isfinite(base_lse)
    assert np.max(np.abs(split_lse[fin] - base_lse[fin]), initial=0) <= 1e-4 * max(1.0, np.abs(base_lse[fin]).max(initial=1)), ctx


# The masks-and-terms split kernels at every head dim (key_mask of every width, bias of every
# dtype and broadcast over heads and rows, ALiBi), and the special cases: rows fully masked by the
# key mask or by a -inf bias, left padding over whole tiles.
DECODE_EXTRA_PARAMS = [pytest.param(decode_cases(d)[n % 2], Extra(key_mask="holes", bias=("BHQK", "B1QK", "1H1K")[n % 3], bias_f32=n % 2 == 1,
                                                                   alibi=True, mask_dtype=n % 4), dt, 3 + n, id=f"mask-d{d}-{dt}")
                       for n, d in enumerate(CUDA_DIMS) for dt in ("f16", "bf16", "f32")]
DECODE_EXTRA_PARAMS += [pytest.param(c, e, dt, 5, id=f"{name}-{dt}") for name, c, e in [
    ("all_masked", decode_cases(64)[0], Extra(key_mask="all_masked", mask_dtype=1)),
    ("bias_neginf", decode_cases(128)[1], Extra(bias="BHQK", bias_neg_inf=True, bias_f32=True)),
    ("left_pad_alibi", decode_cases(128)[2], Extra(key_mask="left_pad", alibi=True, mask_dtype=3)),
] for dt in ("f16", "bf16", "f32")]


@pytest.mark.parametrize("case,extra,dt,splits", DECODE_EXTRA_PARAMS)
def test_decode_split_with_masks_bias_alibi(case, extra, dt, splits):
    skip_unless_sm90_forward(dt, case.d, optional_operands=True)
    x = make(case, DTYPES[dt], seed())
    ext = make_extras(x, extra, DTYPES[dt])
    ctx = f"seed={x.seed} {extra.name()} splits={splits}"
    gext = on_gpu_dict(ext)
    q, k, v, kv, qs = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start)
    ref_o, ref_lse = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **ext)
    outs = {}
    for setting in (splits, "off"):
        poison((x.q.shape, x.q.dtype), ((case.b, case.h, case.sq), np.float32))
        outs[setting] = split_call(setting, lambda: ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw, **gext))
        masked = check_forward(x, dt, *outs[setting], ref_o, ref_lse, f"{ctx} setting={setting}")
    if extra.key_mask == "all_masked" or extra.bias_neg_inf:
        assert masked.any(), f"the case should have fully masked rows ({ctx})"
    a, b = (np.asarray(outs[s][0]).astype(np.float32) for s in (splits, "off"))
    assert rel_err(a, b) <= TOL[dt], ctx


@cuda_only
def test_decode_workspace_holds_the_split_partials():
    """The forward's workspace for a decode shape (the contract's "Decode on CUDA"): f32 partials of
    the most splits the launcher may take, S = min(128, key tiles, 1024 / CTAs of one split)."""
    a = lambda n: -(-n // 256) * 256
    b, sk, h, hkv, d = 8, 32768, 32, 8, 128
    s = min(128, sk // 64, 1024 // (1 * hkv * b))  # one row block of 4 packed rows per (kv head, batch)
    assert s == 16
    assert ex.workspace_bytes(0, PLATFORM, jnp.bfloat16, b, 1, sk, h, hkv, d) == a(s * b * h * d * 4) + a(s * b * h * 4)
    assert ex.workspace_bytes(0, PLATFORM, jnp.float16, 1, 3, 200, 4, 1, 256) == a(7 * 4 * 3 * 256 * 4) + a(7 * 4 * 3 * 4)  # 7 tiles of 32
    # f32: one-warp CTAs of 8 packed rows over 32-key chunks, S = min(128, Sk / 32, 4096 / CTAs of one split).
    s32 = min(128, sk // 32, 4096 // (1 * hkv * b))
    assert s32 == 64
    assert ex.workspace_bytes(0, PLATFORM, np.float32, b, 1, sk, h, hkv, d) == a(s32 * b * h * d * 4) + a(s32 * b * h * 4)
    assert ex.workspace_bytes(0, PLATFORM, np.float32, 1, 17, 4096, 4, 4, 64) == 0  # Sq > 16: f32 splits only decode
    assert ex.workspace_bytes(0, PLATFORM, jnp.bfloat16, b, 1, 64, h, hkv, d) == 0  # one key tile: one split


@cuda_only
@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
def test_decode_split_nan_in_a_visible_key_poisons_its_rows_only(dt):
    """A NaN in K or V at a key a row sees makes that row's o NaN on both paths (the combine pass
    must not drop the split that holds it); the other KV head's rows stay equal to a clean call."""
    skip_unless_sm90_forward(dt, 64, forward_only_test=False)
    rng = np.random.default_rng(seed())
    b, sk, h, hkv, d = 2, 300, 4, 2, 64
    q, k, v = (rng.standard_normal(sh).astype(np.float32).astype(DTYPES[dt]) for sh in ((b, 1, h, d), (b, sk, hkv, d), (b, sk, hkv, d)))
    kv, qs = np.array([300, 250], np.int32), np.array([299, 249], np.int32)
    pk, pv = k.copy(), v.copy()
    pk[0, 10, 0, 3] = np.nan   # batch 0, KV head 0: heads 0 and 1 see it (split 0 of 4)
    pv[1, 200, 1, 5] = np.nan  # batch 1, KV head 1: heads 2 and 3 (a middle split)
    kw = dict(scale=0.125, window_left=-1, window_right=0)
    runs = {}
    for setting in (4, "off"):
        for name, kk, vv in (("clean", k, v), ("poisoned", pk, pv)):
            o, _ = split_call(setting, lambda: ex.flash_attn_fwd(*on_gpu(q, kk, vv, kv, qs), platform=PLATFORM, **kw))
            runs[setting, name] = np.asarray(o).astype(np.float32)
    # NaN where the poison reaches: every column of the rows whose score is NaN (K), column 5 of
    # the rows that weigh the NaN V; everything else as in the clean call, bit for bit.
    dirty = np.zeros((b, 1, h, d), bool)
    dirty[0, 0, :2, :] = True
    dirty[1, 0, 2:, 5] = True
    for setting in (4, "off"):
        got = runs[setting, "poisoned"]
        assert np.isnan(got[dirty]).all(), f"splits={setting}: a row that sees a NaN key must be NaN there"
        assert np.array_equal(got[~dirty], runs[setting, "clean"][~dirty]), f"splits={setting}: clean entries changed"


@pytest.mark.parametrize("dt", ["f16", "bf16", "f32"])
def test_decode_split_counts_and_dropout_fallback(dt):
    """One call at every split count from 1 to past the key tiles (each clamped to the workspace's
    limit): the same result each time within rounding; dropout calls take the non-split forward."""
    skip_unless_sm90_forward(dt, 64, forward_only_test=False)
    case = Case("counts", 2, 2, 330, 4, 1, 64, causal=True, kv_len="random", q_start="random")
    x = make(case, DTYPES[dt], seed())
    ref = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw)
    for n in (1, 2, 3, 4, 5, 6, 9, 128):
        o, lse = split_call(n, lambda: run_fwd(x))
        check_split_vs_reference(x, dt, (o, lse), ref, f"seed={x.seed} splits={n}")
    if missing_features(["dropout"]):
        return
    key = on_gpu(np.array([5, 9], np.uint32))[0]
    q, k, v, kv, qs = on_gpu(x.q, x.k, x.v, x.kv_len, x.q_start)
    before = dict(ex.gpusim_launch_counts()) if PLATFORM == "cuda-on-cpu" else None
    with cuda_splits(4):
        o, _ = jax.block_until_ready(ex.flash_attn_fwd(q, k, v, kv, qs, platform=PLATFORM, **x.kw, dropout_key=key, dropout_rate=0.25))
    assert np.isfinite(np.asarray(o).astype(np.float32)).all()
    if before is not None:
        after = ex.gpusim_launch_counts()
        ran = {n for n in after if after[n] != before.get(n, 0)}
        assert ran == {f"exla_rs_fwd_{dt}_d64" + ("" if dt == "f32" else "_drop")}, ran


# ---------------------------------------------------------------------------------------------
# cuda-on-cpu: the run reached every kernel image (issue 22, part 4)
# ---------------------------------------------------------------------------------------------

def kernels_defined(folder: str) -> set:
    """The `extern "C" __global__` kernels of the instantiation files in kernels/<folder>."""
    import re

    root = ex.ROOT / "native/exla_rs/kernels" / folder
    text = "\n".join(p.read_text() for p in sorted(root.glob("*.cu")))
    return set(re.findall(r'extern "C" __global__[^;{]*?\b(exla_rs_\w+)\s*\(', text))


@pytest.mark.skipif(PLATFORM != "cuda-on-cpu", reason="launch counts come from the GPU-on-CPU executor")
def test_every_kernel_was_launched():
    """Run last over the whole file (conftest.py): every mma.sync, SIMT and auxiliary kernel ran;
    with EXLA_RS_CUDA_PATH=sm90 every sm90 forward too; with mma none, and with auto only those of
    the pairs verified on Hopper (sm90.rs AUTO_SM90_VERIFIED)."""
    import conftest

    if conftest.LAUNCHES_DIR:
        # After the shards (conftest.py): the union of what they launched.
        shards = sorted(Path(conftest.LAUNCHES_DIR).glob("shard-*.json"))
        assert shards, f"no shard launch files in {conftest.LAUNCHES_DIR}"
        ran = set().union(*(json.loads(p.read_text()) for p in shards))
    elif conftest.DESELECTED:
        pytest.skip("some tests were deselected: the launches do not cover the whole file")
    else:
        ran = set(ex.gpusim_launch_counts())
    sm90 = kernels_defined("sm90/inst")
    if SM90_CPU_RUN:
        # The tests this run keeps (above) reach every sm90 instantiation: the forward's 2 dtypes x
        # (3 head dims x plain, _mask + 2 head dims x _drop, _mask_drop: D = 256 has no dropout
        # image) and the backward's 2 dtypes x D = 64, 128, 256 x its 4 feature sets.
        assert len(sm90) == 44, sm90
        assert not sm90 - ran, f"never launched with EXLA_RS_CUDA_PATH=sm90: {sorted(sm90 - ran)}"
        return
    want = kernels_defined("inst")
    assert len(want) > 40, want
    assert not want - ran, f"never launched: {sorted(want - ran)}"
    path = os.environ.get("EXLA_RS_CUDA_PATH", "").strip()
    if path == "mma":
        assert not ran & sm90, f"the sm90 forward ran with EXLA_RS_CUDA_PATH=mma: {sorted(ran & sm90)}"
    elif path in ("", "auto"):
        import re

        src = (ex.ROOT / "native/exla_rs/crates/exla-rs-cuda/src/sm90.rs").read_text()
        table = re.search(r"AUTO_SM90_VERIFIED: [^=]*= &\[(.*?)\];", src, re.S).group(1)
        verified = {f"exla_rs_sm90_fwd_{t.lower()}_d{d}" for t, d in re.findall(r"ElementType::(\w+), (\d+)\)", table)}
        assert verified and verified <= sm90, verified
        assert not (ran & sm90) - verified, f"auto ran an unverified sm90 forward: {sorted((ran & sm90) - verified)}"
