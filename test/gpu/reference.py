"""float64 numpy reference of the contract's backward (closed form, no jax: it runs on the host
next to a GPU process without touching the device)."""
import numpy as np

import exla_rs_jax as ex


def reference_bwd(q, k, v, kv_len, q_start, do, *, scale, softcap=0.0, window_left=-1, window_right=-1):
    """(dq, dk, dv) in float64 of sum(o * do), o the contract's forward."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (q, k, v, do))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    kk = np.repeat(k, g, axis=2)
    vv = np.repeat(v, g, axis=2)
    x = scale * np.einsum("bihd,bjhd->bhij", q, kk)
    s = softcap * np.tanh(x / softcap) if softcap > 0 else x
    m = ex.visible_mask(b, sq, sk, kv_len, q_start, window_left, window_right)[:, None]
    s_m = np.where(m, s, -np.inf)
    mx = np.max(s_m, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.where(m, np.exp(s_m - mx), 0.0)
    l = p.sum(-1, keepdims=True)
    p = np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0)
    o = np.einsum("bhij,bjhd->bihd", p, vv)
    dv_h = np.einsum("bhij,bihd->bjhd", p, do)
    dp = np.einsum("bihd,bjhd->bhij", do, vv)
    delta = np.einsum("bihd,bihd->bhi", do, o)[..., None]
    ds = p * (dp - delta)
    if softcap > 0:
        ds = ds * (1.0 - (s / softcap) ** 2)
    dq = scale * np.einsum("bhij,bjhd->bihd", ds, kk)
    dk_h = scale * np.einsum("bhij,bihd->bjhd", ds, q)
    fold = lambda t: t.reshape(b, sk, hkv, g, d).sum(axis=3)  # GQA: sum the group's query heads
    return dq, fold(dk_h), fold(dv_h)
