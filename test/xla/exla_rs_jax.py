"""Our XLA FFI handlers through a real XLA, via JAX's FFI.

Loads ``libexla_rs_xla.so`` (``$EXLA_RS_XLA_LIB`` or the release build), registers the handler
symbols with ``jax.ffi.register_ffi_target`` and calls them with ``jax.ffi.ffi_call`` exactly as the
custom-call contract lays them out (docs/flash-attention-contract.md), optional operands included. Used by the tests
in this folder, the demo and the benchmarks.
"""
from __future__ import annotations

import ctypes
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LIB = ROOT / "native/exla_rs/target/release/libexla_rs_xla.so"

FWD, BWD = "exla_rs_flash_attn_fwd", "exla_rs_flash_attn_bwd"
# XLA FFI data type codes (c_api.h) of the element types we accept.
DTYPE_CODES = {np.dtype(np.float32): 11, np.dtype(jnp.float16): 10, np.dtype(jnp.bfloat16): 16}
# Our platforms: the contract's platform code (workspace sizes, feature bits), the handler symbol's
# suffix and the jax platform the handlers are registered for. "cuda-on-cpu" is the CUDA handlers'
# code path with the CUDA kernels run by the GPU-on-CPU executor on jax's cpu device (a library
# built with exla-rs-xla's `gpu-on-cpu` feature: scripts/gpu_on_cpu.sh).
PLATFORM_CODES = {"cpu": 0, "cuda": 1, "cuda-on-cpu": 1}
_SUFFIX = {"cpu": "host", "cuda": "cuda", "cuda-on-cpu": "cuda_on_cpu"}
_JAX_PLATFORM = {"cpu": "cpu", "cuda": "CUDA", "cuda-on-cpu": "cpu"}

_lib = None
_registered: set[str] = set()


def lib_path() -> Path:
    return Path(os.environ.get("EXLA_RS_XLA_LIB", DEFAULT_LIB))


def load(platform: str = "cpu") -> ctypes.CDLL:
    """Opens the library once and registers both targets for ``platform`` ('cpu', 'cuda' or
    'cuda-on-cpu'). 'cpu' and 'cuda-on-cpu' both register for jax's cpu platform: one process
    runs one of them."""
    global _lib
    if _lib is None:
        path = lib_path()
        if not path.exists():
            raise FileNotFoundError(f"{path} not built: cargo build --release --manifest-path native/exla_rs/Cargo.toml --workspace")
        _lib = ctypes.CDLL(str(path))
        _lib.exla_rs_flash_attn_workspace_bytes.restype = ctypes.c_int64
        _lib.exla_rs_flash_attn_workspace_bytes.argtypes = [ctypes.c_int32] * 3 + [ctypes.c_int64] * 6
        if hasattr(_lib, "exla_rs_flash_attn_dbias_workspace_bytes"):  # absent from libraries before it
            _lib.exla_rs_flash_attn_dbias_workspace_bytes.restype = ctypes.c_int64
            _lib.exla_rs_flash_attn_dbias_workspace_bytes.argtypes = [ctypes.c_int32] + [ctypes.c_int64] * 4
    if platform not in _registered:
        jax_platform = _JAX_PLATFORM[platform]
        clash = [p for p in _registered if _JAX_PLATFORM[p] == jax_platform]
        if clash:
            raise RuntimeError(f"exla_rs targets are already registered for jax's {jax_platform} platform as {clash[0]!r}; "
                               f"{platform!r} would replace them: run one of them per process")
        for target in (FWD, BWD):
            symbol = f"{target}_{_SUFFIX[platform]}"
            if not hasattr(_lib, symbol):
                raise RuntimeError(f"{lib_path()} has no {symbol}" + (": build it with exla-rs-xla's gpu-on-cpu feature "
                                   "(scripts/gpu_on_cpu.sh) and point EXLA_RS_XLA_LIB at it" if platform == "cuda-on-cpu" else ""))
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(_lib, symbol)), platform=jax_platform)
        _registered.add(platform)
    return _lib


def _json_export(name: str):
    """Calls one of the gpu-on-cpu library's `size_t f(char* buf, size_t len)` JSON exports."""
    import json

    fn = getattr(load("cuda-on-cpu"), name)
    fn.restype, fn.argtypes = ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]
    n = fn(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    fn(buf, n + 1)
    return json.loads(buf.value.decode())


def gpusim_launch_counts() -> dict:
    """cuda-on-cpu: launches per kernel on the GPU-on-CPU executor since the last reset."""
    return _json_export("exla_rs_cuda_on_cpu_launch_counts_json")


def gpusim_bank_stats():
    """cuda-on-cpu: the executor's shared-memory bank statistics since the last reset."""
    return _json_export("exla_rs_cuda_on_cpu_bank_stats_json")


def gpusim_traffic() -> dict:
    """cuda-on-cpu: global-memory bytes per kernel since the last reset ({kernel: {read, written,
    atomic}}); counted by the executor's statistics build only ({} otherwise)."""
    return _json_export("exla_rs_cuda_on_cpu_traffic_json")


def gpusim_stats_reset() -> None:
    """cuda-on-cpu: forgets the launch counts and the bank statistics."""
    load("cuda-on-cpu").exla_rs_cuda_on_cpu_stats_reset()


def workspace_bytes(pass_: int, platform: str, dtype, b, sq, sk, h, hkv, d) -> int:
    lib = load(platform)
    return lib.exla_rs_flash_attn_workspace_bytes(pass_, PLATFORM_CODES[platform], DTYPE_CODES[np.dtype(dtype)], b, sq, sk, h, hkv, d)


def _attrs(scale, softcap, window_left, window_right) -> dict:
    # Typed exactly as the contract says: f32 scale/softcap, s64 windows.
    return dict(scale=np.float32(scale), softcap=np.float32(softcap), window_left=np.int64(window_left), window_right=np.int64(window_right))


def _workspace_result(pass_, platform, q, k, dbias_shape=None):
    b, sq, h, d = q.shape
    _, sk, hkv, _ = k.shape
    n = workspace_bytes(pass_, platform, q.dtype, b, sq, sk, h, hkv, d)
    if n < 0:
        raise NotImplementedError(f"{q.dtype} D={d} unsupported on {platform}")
    if dbias_shape is not None:
        # A backward with bias_grad: the dbias accumulator follows the base workspace.
        n += load(platform).exla_rs_flash_attn_dbias_workspace_bytes(PLATFORM_CODES[platform], *map(int, dbias_shape))
    return [jax.ShapeDtypeStruct((n,), jnp.uint8)] if n > 0 else []


def _extras(key_mask, bias, alibi_slopes, dropout_key=None, dropout_rate=0.0):
    """The optional operands in the contract's fixed order and the presence attributes (pred,
    i.e. Python bools) that announce them; absent ones are left out entirely. Dropout (rate > 0)
    adds the u32[2] key last and the f32 rate attribute."""
    args, attrs = [], {}
    for name, x in (("has_key_mask", key_mask), ("has_bias", bias), ("has_alibi", alibi_slopes)):
        if x is not None:
            args.append(x)
            attrs[name] = True
    if dropout_rate > 0:
        args.append(dropout_key)
        attrs.update(has_dropout=True, dropout_rate=np.float32(dropout_rate))
    return args, attrs


def flash_attn_fwd(q, k, v, kv_len, q_start, *, scale, softcap=0.0, window_left=-1, window_right=-1, platform="cpu",
                   key_mask=None, bias=None, alibi_slopes=None, dropout_key=None, dropout_rate=0.0):
    """Returns (o, lse) from the forward target. key_mask [B, Sk] (any integer/bool type, nonzero =
    visible), bias rank 4 broadcastable to [B, H, Sq, Sk] (f32/f16/bf16), alibi_slopes f32[H]."""
    load(platform)
    b, sq, h, _ = q.shape
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32)]
    outs += _workspace_result(0, platform, q, k)
    extra, flags = _extras(key_mask, bias, alibi_slopes, dropout_key, dropout_rate)
    res = jax.ffi.ffi_call(FWD, outs)(q, k, v, kv_len, q_start, *extra, **_attrs(scale, softcap, window_left, window_right), **flags)
    return res[0], res[1]


def flash_attn_bwd(q, k, v, kv_len, q_start, o, lse, do, *, scale, softcap=0.0, window_left=-1, window_right=-1, platform="cpu",
                   key_mask=None, bias=None, alibi_slopes=None, bias_grad=False, dropout_key=None, dropout_rate=0.0):
    """Returns (dq, dk, dv) from the backward target, plus dbias (shaped and typed like bias)
    when bias_grad."""
    load(platform)
    outs = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if bias_grad:
        outs.append(jax.ShapeDtypeStruct(bias.shape, bias.dtype))
    outs += _workspace_result(1, platform, q, k, dbias_shape=bias.shape if bias_grad else None)
    extra, flags = _extras(key_mask, bias, alibi_slopes, dropout_key, dropout_rate)
    if bias_grad:
        flags["bias_grad"] = True
    res = jax.ffi.ffi_call(BWD, outs)(q, k, v, kv_len, q_start, o, lse, do, *extra, **_attrs(scale, softcap, window_left, window_right), **flags)
    return tuple(res[:4]) if bias_grad else (res[0], res[1], res[2])


# Head dims the CUDA kernels are built for; the lse-gradient pass pads to one of them. Every other
# head dim in 1..=256 runs on CUDA too, padded to the next of these (kernel_head_dim).
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 192, 256)


def kernel_head_dim(d: int):
    """The head dim the CUDA kernels run a call of head dim d on (config.rs kernel_head_dim): d
    itself when it has a kernel, else the next kernel head dim (zero-padded copies in the
    workspace); None for 0 and past 256."""
    return next((n for n in KERNEL_HEAD_DIMS if n >= d), None) if d >= 1 else None


def padded_workspace_bytes(pass_: int, dtype, b, sq, sk, h, hkv, d) -> int:
    """The CUDA workspace of a padded head dim, as docs/flash-attention-contract.md ("Head dims on
    CUDA") lays it out: for the backward the kernels' scratch at Dk (delta f32[B,H,Sq], and for
    f16/bf16 the f32 dq accumulator [B,Sq,H,Dk]) rounded up to 256 bytes, then 256-aligned copies
    of q, k, v, o (forward) or q, k, v, o, do, dq, dk, dv (backward)."""
    a = lambda n: -(-n // 256) * 256
    dk, e = kernel_head_dim(d), np.dtype(dtype).itemsize
    qb, kvb = a(b * sq * h * dk * e), a(b * sk * hkv * dk * e)
    if pass_ == 0:
        return 2 * qb + 2 * kvb
    scratch = a(b * h * sq * 4) + (0 if np.dtype(dtype) == np.float32 else b * sq * h * dk * 4)
    return a(scratch) + 4 * qb + 4 * kvb


def lse_grad_head_dim(d: int) -> int:
    """The head dim of the lse-gradient pass (ExlaRs.Attention does the same): d + 1 rounded up
    to a kernel head dim, or d + 1 past 256 (no kernel there: the Nx fallback runs)."""
    return next((n for n in KERNEL_HEAD_DIMS if n > d), d + 1)


def flash_attn_bwd_lse(q, k, v, kv_len, q_start, lse, dlse, *, scale, softcap=0.0, window_left=-1, window_right=-1, platform="cpu"):
    """(dq, dk, dv) of sum(lse * dlse), from the backward target on augmented operands.

    The backward computes ds = p * (do . v_j - rowsum(do * o)). With q and k padded by zero
    columns (the logits are unchanged), v given a column of ones at index d, o = 0 and do = dlse
    in that column only: do . v_j = dlse_i and rowsum(do * o) = 0, so ds = p * dlse, which is the
    lse part of the gradient; dq and dk are the first d columns, dv gets nothing from lse."""
    b, sq, h, d = q.shape
    dp = lse_grad_head_dim(d)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, dp - d)))
    ones = jnp.ones(v.shape[:3] + (1,), v.dtype)
    v_aug = jnp.concatenate([v, ones, jnp.zeros(v.shape[:3] + (dp - d - 1,), v.dtype)], axis=-1)
    dlse_col = jnp.transpose(dlse, (0, 2, 1))[..., None].astype(q.dtype)
    do_aug = jnp.concatenate([jnp.zeros(q.shape, q.dtype), dlse_col, jnp.zeros((b, sq, h, dp - d - 1), q.dtype)], axis=-1)
    dq, dk, _ = flash_attn_bwd(pad(q), pad(k), v_aug, kv_len, q_start, jnp.zeros(do_aug.shape, q.dtype), lse, do_aug,
                               scale=scale, softcap=softcap, window_left=window_left, window_right=window_right, platform=platform)
    return dq[..., :d], dk[..., :d], jnp.zeros(v.shape, v.dtype)


def window(causal: bool, window_size=None) -> tuple[int, int]:
    """(window_left, window_right) for the user-facing options, as the Elixir API maps them."""
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return int(left), int(right)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def attention(q, k, v, kv_len, q_start, scale, softcap, window_left, window_right, platform):
    """Differentiable attention whose backward is our backward target."""
    return flash_attn_fwd(q, k, v, kv_len, q_start, scale=scale, softcap=softcap, window_left=window_left, window_right=window_right, platform=platform)[0]


def _attention_fwd(q, k, v, kv_len, q_start, scale, softcap, window_left, window_right, platform):
    o, lse = flash_attn_fwd(q, k, v, kv_len, q_start, scale=scale, softcap=softcap, window_left=window_left, window_right=window_right, platform=platform)
    return o, (q, k, v, kv_len, q_start, o, lse)


def _attention_bwd(scale, softcap, window_left, window_right, platform, res, do):
    q, k, v, kv_len, q_start, o, lse = res
    dq, dk, dv = flash_attn_bwd(q, k, v, kv_len, q_start, o, lse, do.astype(o.dtype), scale=scale, softcap=softcap, window_left=window_left, window_right=window_right, platform=platform)
    zero = lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0)
    return dq, dk, dv, zero(kv_len), zero(q_start)


attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------------
# float64 references of the contract's function
# ---------------------------------------------------------------------------------------------

def visible_mask(b, sq, sk, kv_len, q_start, window_left, window_right, key_mask=None) -> np.ndarray:
    """bool[B, Sq, Sk]: visible(i, j) exactly as the contract writes it."""
    i = np.arange(sq)[None, :, None]
    j = np.arange(sk)[None, None, :]
    pos = np.asarray(q_start, np.int64)[:, None, None] + i
    m = j < np.asarray(kv_len, np.int64)[:, None, None]
    if window_left >= 0:
        m = m & (j >= pos - window_left)
    if window_right >= 0:
        m = m & (j <= pos + window_right)
    if key_mask is not None:
        m = m & (np.asarray(key_mask).astype(np.int64) != 0)[:, None, :]
    return np.broadcast_to(m, (b, sq, sk))


def alibi_term(sq, sk, q_start, slopes) -> np.ndarray:
    """float64 [B, H, Sq, Sk]: -slope[h] * |q_start[b] + i - j|."""
    pos = np.asarray(q_start, np.int64)[:, None, None, None] + np.arange(sq)[None, None, :, None]
    dist = np.abs(pos - np.arange(sk)[None, None, None, :]).astype(np.float64)
    return -np.asarray(slopes, np.float64)[None, :, None, None] * dist


def _additive(bias, alibi_slopes, q_start, sq, sk):
    """float64 bias + alibi, broadcastable to [B, H, Sq, Sk] (0 when neither is given)."""
    add = 0.0
    if bias is not None:
        add = add + np.asarray(bias, np.float64)
    if alibi_slopes is not None:
        add = add + alibi_term(sq, sk, q_start, alibi_slopes)
    return add


# Where the float64 references run. None: numpy on the host (the Host tests, the demo, the
# benchmarks). A jax device (test/gpu on a GPU: set_reference_device): the same function jitted in
# float64 on that device, compiled once per shape and reused, so a GPU test is not held up by
# numpy's einsums on a shared CPU (issue 31).
_REF_DEVICE = None
_REF_JIT = None


def set_reference_device(device) -> None:
    """Runs reference()/reference_fwd()/reference_bwd() on `device` (None: numpy on the host).
    Needs jax_enable_x64."""
    global _REF_DEVICE, _REF_JIT
    if device is not None and not jax.config.jax_enable_x64:
        raise RuntimeError("float64 references on a device need jax.config.update('jax_enable_x64', True)")
    _REF_DEVICE = device
    if device is not None and _REF_JIT is None:
        _REF_JIT = jax.jit(partial(_reference_core, jnp), static_argnames=("scale", "softcap", "bias_shape", "grads"))


def _reference_core(xp, q, k, v, visible, add, do, dlse, ms, *, scale, softcap, bias_shape, grads):
    """The contract's function and its closed-form gradient in float64, written once for numpy and
    jax.numpy (`xp`). visible: bool[B, Sq, Sk]; add: the bias + ALiBi term broadcastable to
    [B, H, Sq, Sk] (a -inf entry hides its key); ms: dropout scales [B, H, Sq, Sk] or None. Returns
    (o, lse) or, with grads, (o, lse, dq, dk, dv, dbias) of sum(o * do) (+ sum(lse * dlse)), dbias
    summed to bias_shape (None: no bias). Softcap applies to the scaled logits before the bias."""
    f64 = lambda t: t.astype(xp.float64)
    q, k, v = f64(q), f64(k), f64(v)
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    ein = partial(xp.einsum, optimize=True)
    kk, vv = xp.repeat(k, g, axis=2), xp.repeat(v, g, axis=2)
    x = scale * ein("bihd,bjhd->bhij", q, kk)
    s = softcap * xp.tanh(x / softcap) if softcap > 0 else x
    z = s + add
    m = visible[:, None] & (z > -xp.inf)
    zm = xp.where(m, z, -xp.inf)
    mx = xp.max(zm, axis=-1, keepdims=True)
    mx = xp.where(xp.isfinite(mx), mx, 0.0)
    p = xp.where(m, xp.exp(zm - mx), 0.0)
    l = p.sum(-1, keepdims=True)
    lse = xp.where(l > 0, xp.log(xp.where(l > 0, l, 1.0)) + mx, -xp.inf)[..., 0]
    p = p / xp.where(l > 0, l, 1.0)  # masked entries exactly 0, fully masked rows all 0
    pd = p if ms is None else p * ms
    o = ein("bhij,bjhd->bihd", pd, vv)
    if not grads:
        return o, lse
    do = f64(do)
    dv_h = ein("bhij,bihd->bjhd", pd, do)
    dp = ein("bihd,bjhd->bhij", do, vv)
    delta = ein("bihd,bihd->bhi", do, o)[..., None]
    dz = p * ((dp if ms is None else ms * dp) - delta + (0.0 if dlse is None else f64(dlse)[..., None]))
    dx = dz * (1.0 - (s / softcap) ** 2) if softcap > 0 else dz
    dq = scale * ein("bhij,bjhd->bihd", dx, kk)
    dk_h = scale * ein("bhij,bihd->bjhd", dx, q)
    fold = lambda t: t.reshape(b, sk, hkv, g, d).sum(axis=3)  # GQA: sum the group's query heads
    dbias = None if bias_shape is None else dz.sum(axis=tuple(n for n in range(4) if bias_shape[n] == 1), keepdims=True)
    return o, lse, dq, fold(dk_h), fold(dv_h), dbias


def reference(q, k, v, kv_len, q_start, do=None, *, scale, softcap=0.0, window_left=-1, window_right=-1, key_mask=None, bias=None,
              alibi_slopes=None, dlse=None, dropout_scales=None):
    """float64 numpy (o, lse) of the contract, or with `do` (o, lse, dq, dk, dv, dbias) (dbias
    None without a bias), on the reference device (set_reference_device) or the host. Shapes:
    o [B,Sq,H,D], lse [B,H,Sq]; dropout_scales [B,H,Sq,Sk] (mask / keep probability) applies to P."""
    b, sq, h, _ = np.shape(q)
    sk = np.shape(k)[1]
    visible = visible_mask(b, sq, sk, kv_len, q_start, window_left, window_right, key_mask)
    add = np.asarray(_additive(bias, alibi_slopes, q_start, sq, sk), np.float64)
    args = (q, k, v, visible, add, do, dlse, dropout_scales)
    static = dict(scale=float(scale), softcap=float(softcap), bias_shape=None if bias is None else tuple(np.shape(bias)), grads=do is not None)
    if _REF_DEVICE is None:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            out = _reference_core(np, *(None if a is None else np.asarray(a) for a in args), **static)
    else:
        out = _REF_JIT(*(None if a is None else jax.device_put(np.asarray(a), _REF_DEVICE) for a in args), **static)
    return tuple(None if a is None else np.asarray(a) for a in out)


def reference_fwd(q, k, v, kv_len, q_start, *, scale, softcap=0.0, window_left=-1, window_right=-1, key_mask=None, bias=None, alibi_slopes=None):
    """float64 numpy (o [B,Sq,H,D], lse [B,H,Sq]) of the contract."""
    return reference(q, k, v, kv_len, q_start, scale=scale, softcap=softcap, window_left=window_left, window_right=window_right,
                     key_mask=key_mask, bias=bias, alibi_slopes=alibi_slopes)


def reference_bwd(q, k, v, kv_len, q_start, do, *, scale, softcap=0.0, window_left=-1, window_right=-1, dlse=None,
                  key_mask=None, bias=None, alibi_slopes=None):
    """float64 (dq, dk, dv) of sum(o * do) (+ sum(lse * dlse) when dlse [B,H,Sq] is given), o and
    lse the contract's forward; closed form (reference() adds dbias; reference_jax is the
    independent jax.grad one)."""
    out = reference(q, k, v, kv_len, q_start, do, scale=scale, softcap=softcap, window_left=window_left, window_right=window_right,
                    key_mask=key_mask, bias=bias, alibi_slopes=alibi_slopes, dlse=dlse)
    return out[2], out[3], out[4]


def reference_jax(q, k, v, kv_len, q_start, *, scale, softcap=0.0, window_left=-1, window_right=-1, key_mask=None, bias=None, alibi_slopes=None):
    """The same function in jax.numpy (for jax.grad of a reference, bias included; run under x64).
    Hidden entries go through `where` with safe values on both sides, so their gradient is an
    exact 0, never 0 * inf."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    kk = jnp.repeat(k, g, axis=2)
    vv = jnp.repeat(v, g, axis=2)
    x = scale * jnp.einsum("bihd,bjhd->bhij", q, kk)
    s = softcap * jnp.tanh(x / softcap) if softcap > 0 else x
    m = jnp.asarray(visible_mask(b, sq, sk, kv_len, q_start, window_left, window_right, key_mask))[:, None]
    if bias is not None:
        m = m & jnp.broadcast_to(bias > -jnp.inf, (b, h, sq, sk))
        s = s + jnp.where(bias > -jnp.inf, bias, 0.0)
    if alibi_slopes is not None:
        s = s + jnp.asarray(alibi_term(sq, sk, q_start, alibi_slopes))
    s = jnp.where(m, s, 0.0)
    mx = jax.lax.stop_gradient(jnp.max(jnp.where(m, s, -1e300), axis=-1, keepdims=True))
    mx = jnp.where(mx > -1e300, mx, 0.0)
    p = jnp.where(m, jnp.exp(s - mx), 0.0)
    l = p.sum(-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    return jnp.einsum("bhij,bjhd->bihd", p, vv)
