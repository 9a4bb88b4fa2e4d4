"""The contract's optional operands (key_mask, bias with its gradient, alibi_slopes) on the Host
handlers through a real XLA: each alone and with every older option, all three dtypes, odd sizes,
Sq != Sk, left-padded masks, fully masked rows (by the mask alone and by a -inf bias), every bias
broadcast pattern; forward against the float64 reference, backward (dbias included) against
jax.grad of the float64 reference. Fresh random inputs each run (EXLA_RS_SEED replays one).

Each test checks the forward and the backward of one configuration, so XLA compiles each call once.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import exla_rs_jax as ex
from cases import BIAS_PATTERNS, CASES, DTYPES, TOL, Case, Extra, make, make_extras, rel_err, seed

BY_NAME = {c.name: c for c in CASES}
# The older options, one case each (CASES holds them with odd sizes and Sq != Sk).
OLD = ["plain", "causal_odd", "causal_sq_lt_sk", "decode_step", "sliding_causal", "local_both_sides", "softcap_scale_d80",
       "kv_padding_fully_masked", "q_start_negative", "gqa", "mqa", "everything"]
NEW = {
    "mask": lambda n: Extra(key_mask="left_pad", mask_dtype=n % 4),
    "bias": lambda n: Extra(bias="1HQK", bias_f32=n % 2 == 1),
    "alibi": lambda n: Extra(alibi=True),
}

PARAMS = [pytest.param(BY_NAME[o], NEW[k](n), dt, id=f"{k}-{o}-{dt}") for n, o in enumerate(OLD) for k in NEW for dt in DTYPES]

# Every bias broadcast pattern, with its gradient.
LONG = Case("long", 2, 70, 131, 4, 2, 32)
PARAMS += [pytest.param(LONG, Extra(bias=p, bias_f32=n % 2 == 0), dt, id=f"bias_{p}-{dt}") for n, p in enumerate(BIAS_PATTERNS) for dt in DTYPES]
PARAMS += [pytest.param(BY_NAME["gqa"], Extra(bias=p), "f32", id=f"bias_{p}-gqa-f32") for p in BIAS_PATTERNS]

# Fully masked rows, left padding over whole key tiles, holes, everything together.
SPECIAL = [
    ("mask_all_masked_row", LONG, Extra(key_mask="all_masked", mask_dtype=0)),
    ("mask_holes_causal", BY_NAME["causal_odd"], Extra(key_mask="holes", mask_dtype=2)),
    ("mask_left_pad_long_window", Case("lp_win", 2, 150, 200, 2, 1, 64, causal=True, window_size=(70, 0)), Extra(key_mask="left_pad", mask_dtype=1)),
    ("bias_neginf_rows", LONG, Extra(bias="1HQK", bias_neg_inf=True)),
    ("bias_neginf_full_softcap", BY_NAME["softcap_scale_d80"], Extra(bias="BHQK", bias_neg_inf=True)),
    ("alibi_long_causal", Case("alibi_long", 1, 129, 300, 4, 1, 64, causal=True, q_start="random"), Extra(alibi=True)),
    ("all_three", BY_NAME["everything"], Extra(key_mask="left_pad", bias="B1QK", alibi=True, mask_dtype=3)),
    ("all_three_neginf", LONG, Extra(key_mask="holes", bias="1HQK", bias_neg_inf=True, alibi=True, bias_f32=True)),
    ("all_three_d256", BY_NAME["d256"], Extra(key_mask="all_masked", bias="11QK", alibi=True)),
    # Whole key tiles (Sk a multiple of 64) and no key mask: an f32 bias is read in place.
    ("bias_in_place_causal", Case("tiles", 2, 70, 128, 4, 2, 64, causal=True, q_start="random"), Extra(bias="BHQK", bias_f32=True)),
    ("bias_in_place_broadcast", Case("tiles_b", 2, 65, 192, 2, 1, 32, softcap=10.0, kv_len="random"), Extra(bias="1HQK", bias_f32=True, alibi=True)),
    ("bias_in_place_neginf", Case("tiles_n", 1, 130, 256, 2, 2, 16, window_size=(40, 10)), Extra(bias="B1QK", bias_f32=True, bias_neg_inf=True)),
]
PARAMS += [pytest.param(c, e, dt, id=f"{name}-{dt}") for name, c, e in SPECIAL for dt in DTYPES]


def _f64(a):
    return jnp.asarray(np.asarray(a, np.float64))


def reference_grads(x, ext):
    """jax.grad of the float64 reference: (dq, dk, dv[, dbias])."""
    q, k, v, do = map(_f64, (x.q, x.k, x.v, x.do))
    kw = dict(x.kw)
    if "key_mask" in ext:
        kw["key_mask"] = ext["key_mask"]
    if "alibi_slopes" in ext:
        kw["alibi_slopes"] = ext["alibi_slopes"]
    args = [q, k, v] + ([_f64(ext["bias"])] if "bias" in ext else [])

    def loss(q, k, v, bias=None):
        return jnp.sum(ex.reference_jax(q, k, v, x.kv_len, x.q_start, bias=bias, **kw) * do)

    return jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def reference_grads_closed_form(x, ext):
    """(dq, dk, dv[, dbias]) from ex.reference's closed form (what test/gpu compares with, on the
    GPU): the same function as reference_grads, without jax.grad."""
    out = ex.reference(x.q, x.k, x.v, x.kv_len, x.q_start, x.do, **x.kw, **ext)
    return out[2:5] + ((out[5],) if "bias" in ext else ())


@pytest.mark.parametrize("name", ["all_three_neginf", "bias_neginf_full_softcap", "all_three_d256"])
def test_closed_form_gradient_is_jax_grad_of_the_reference(name):
    """The closed-form float64 gradient (dbias, softcap, -inf bias entries, masks) equals jax.grad of
    the independent jax.numpy reference, so either can judge a kernel."""
    _, case, extra = next(s for s in SPECIAL if s[0] == name)
    x = make(case, np.float32, seed())
    ext = make_extras(x, extra, np.float32)
    for got, want in zip(reference_grads_closed_form(x, ext), reference_grads(x, ext)):
        want = np.asarray(want)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * max(1.0, np.abs(want).max()), err_msg=f"{name} seed={x.seed}")


def summed_rows(ext, shape) -> int:
    """How many (b, h, i) rows are summed into one dbias entry."""
    b, sq, h = shape[0], shape[1], shape[2]
    bd = ext["bias"].shape
    return (b // bd[0]) * (h // bd[1]) * (sq // bd[2])


@pytest.mark.parametrize("case,extra,dt", PARAMS)
def test_extras_forward_and_backward(case, extra, dt):
    x = make(case, DTYPES[dt], seed())
    ext = make_extras(x, extra, DTYPES[dt])
    ctx = f"seed={x.seed} {extra.name()}"
    tol = TOL[dt]

    # Forward.
    o, lse = ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **ext)
    o, lse = np.asarray(o), np.asarray(lse)
    ref_o, ref_lse = ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **ext)
    assert o.dtype == x.q.dtype and o.shape == x.q.shape, ctx
    assert not np.isnan(o.astype(np.float32)).any() and not np.isnan(lse).any(), ctx
    err = rel_err(o, ref_o)
    assert err <= tol, f"o rel err {err:.2e} > {tol} ({ctx})"
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), f"fully masked rows differ ({ctx})"
    masked = np.isneginf(ref_lse).transpose(0, 2, 1)  # [B, Sq, H]
    assert np.all(o.astype(np.float32)[masked] == 0), ctx
    fin = np.isfinite(ref_lse)
    lse_tol = 1e-4 if dt == "f32" else tol
    assert np.max(np.abs(lse[fin] - ref_lse[fin]), initial=0) <= lse_tol * max(1.0, np.abs(ref_lse[fin]).max(initial=1)), ctx
    if extra.key_mask == "all_masked" or extra.bias_neg_inf:
        assert masked.any(), f"the case should have fully masked rows ({ctx})"

    # Backward, with dbias whenever there is a bias.
    want_db = "bias" in ext
    grads = ex.flash_attn_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, o, lse, x.do, **x.kw, **ext, bias_grad=want_db)
    refs = reference_grads(x, ext)
    for name, got, ref, like in zip(("dq", "dk", "dv", "dbias"), grads, refs, (x.q, x.k, x.v, ext.get("bias"))):
        got = np.asarray(got)
        assert got.dtype == like.dtype and got.shape == like.shape, f"{name} {ctx}"
        assert np.isfinite(got.astype(np.float32)).all(), f"{name}: non-finite values ({ctx})"
        if name == "dbias" and like.shape[3] == 1:
            # A bias shared by all keys has dbias = sum_j dZ = 0 analytically (softmax ignores a
            # per-row shift): the kernel returns the cancellation of sum_j p_j dP_j against
            # Delta = do.o, whose scale is O(1) per row for unit-normal inputs (and whose rounding
            # follows o's type). Judge it absolutely, against that scale times the rows summed.
            floor = 1.0 * summed_rows(ext, x.q.shape)
            err = float(np.max(np.abs(got.astype(np.float64) - np.asarray(ref)))) / max(floor, float(np.max(np.abs(ref))))
        elif name in ("dq", "dk") and not np.any(ref):
            # Every row sees at most one key (a seed where left padding meets kv_len): the softmax
            # is the constant 1, so dq = dk = 0 analytically, and the kernel returns the rounding
            # of dP - Delta, two O(sqrt(D)·|do|·|v|) dot products that cancel. Judge that noise
            # against the scale of what cancels (times |k| or |q|), not the 1e-2 floor of rel_err.
            other = x.k if name == "dq" else x.q
            cancel = float(np.sqrt(x.q.shape[3]) * np.max(np.abs(x.do.astype(np.float64))) * np.max(np.abs(x.v.astype(np.float64)))
                           * np.max(np.abs(other.astype(np.float64))))
            err = float(np.max(np.abs(got.astype(np.float64)))) / cancel
        else:
            err = rel_err(got, ref)
        bar = tol * (2 if name == "dbias" else 1)
        assert err <= bar, f"{name} rel err {err:.2e} > {bar} ({ctx})"
    dq = np.asarray(grads[0]).astype(np.float32)
    assert np.all(dq[masked] == 0), f"dq of fully masked rows ({ctx})"
    if want_db and extra.bias_neg_inf:
        db = np.asarray(grads[3]).astype(np.float32)
        assert np.all(db[np.isneginf(ext["bias"].astype(np.float32))] == 0), f"dbias at -inf entries ({ctx})"


def test_bias_gradient_finite_differences():
    """dbias of one small f32 case against central differences of the float64 reference."""
    case = Case("fd", 2, 7, 11, 2, 1, 8, causal=True, softcap=3.0, q_start="random")
    x = make(case, np.float32, seed())
    ext = make_extras(x, Extra(bias="1HQK", key_mask="holes", alibi=True), np.float32)
    o, lse = ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **ext)
    dbias = np.asarray(ex.flash_attn_bwd(x.q, x.k, x.v, x.kv_len, x.q_start, o, lse, x.do, **x.kw, **ext, bias_grad=True)[3])
    rng = np.random.default_rng(x.seed)
    for _ in range(8):
        idx = tuple(rng.integers(0, s) for s in ext["bias"].shape)
        eps = 1e-4
        f = lambda b: np.sum(ex.reference_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **{**ext, "bias": b})[0] * x.do)
        plus, minus = ext["bias"].astype(np.float64), ext["bias"].astype(np.float64)
        plus[idx] += eps
        minus[idx] -= eps
        fd = (f(plus) - f(minus)) / (2 * eps)
        assert abs(fd - dbias[idx]) <= 1e-3 * max(1.0, abs(fd)), f"dbias{idx}: fd {fd} vs {dbias[idx]} (seed={x.seed})"


def test_features_export():
    lib = ex.load("cpu")
    assert lib.exla_rs_flash_attn_features(0) == 31  # Host: key_mask, bias, alibi, bias_grad, dropout
    assert lib.exla_rs_flash_attn_features(1) == 31  # CUDA: every feature, dropout included
    assert lib.exla_rs_flash_attn_features(9) == -1


def _expect_invalid(match, fn):
    with pytest.raises(Exception, match=match) as info:
        jax.block_until_ready(fn())
    assert "INVALID_ARGUMENT" in str(info.value) or "Invalid argument" in str(info.value), str(info.value)


def test_malformed_extras_are_invalid_argument_through_xla():
    x = make(Case("err", 2, 5, 7, 4, 2, 8), np.float32, seed())
    call = lambda **kw: ex.flash_attn_fwd(x.q, x.k, x.v, x.kv_len, x.q_start, **x.kw, **kw)
    _expect_invalid(r"operand 5 `key_mask` must be \[B, Sk\] = \[2, 7\]", lambda: call(key_mask=np.ones((2, 6), np.uint8)))
    _expect_invalid(r"operand 5 `key_mask` must be .* integer or pred", lambda: call(key_mask=np.ones((2, 7), np.float32)))
    _expect_invalid(r"operand 5 `bias`: dimension 1 is 2, must be 1 or H = 4", lambda: call(bias=np.zeros((1, 2, 5, 7), np.float32)))
    _expect_invalid(r"operand 5 `bias` must have rank 4", lambda: call(bias=np.zeros((4, 5, 7), np.float32)))
    _expect_invalid(r"operand 5 `bias` must be f32, f16 or bf16", lambda: call(bias=np.zeros((1, 1, 5, 7), np.int32)))
    _expect_invalid(r"operand 6 `alibi_slopes` must be f32\[4\]", lambda: call(key_mask=np.ones((2, 7), np.uint8), alibi_slopes=np.ones(3, np.float32)))
