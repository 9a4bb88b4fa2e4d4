// f32 attention on CUDA cores: correct to f32 precision rather than fast (tensor cores would
// round f32 inputs to tf32). One warp per row; lane l holds elements l, l + 32, ... of the head dim,
// so every global access is a coalesced row read and dot products end in one warp reduction.
// Visible keys (or, in dK/dV, visible queries) are one interval per row: only those are visited.
#pragma once

#include "common.cuh"

namespace exla_rs {

struct SimtTraits {
  static constexpr int kWarps = 4;  // rows per block
  static constexpr int kThreads = 32 * kWarps;
};

template <class T, int D>
EXLA_RS_DEVICE void load_row(float (&r)[D / 32], const typename T::Storage* src, int lane) {
#pragma unroll
  for (int e = 0; e < D / 32; ++e) r[e] = T::to_float(src[lane + 32 * e]);
}
template <class T, int D>
EXLA_RS_DEVICE float dot_row(const float (&a)[D / 32], const typename T::Storage* src, int lane) {
  float s = 0.f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) s += a[e] * T::to_float(src[lane + 32 * e]);
  return warp_sum(s);
}

// Forward: grid (ceil(Sq / 4), H, B).
template <class T, int D>
__device__ __forceinline__ void simt_fwd(const FwdParams& p) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * SimtTraits::kWarps + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq_q) return;
  const int hk = h / (p.heads / p.kv_heads);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const long long kv_stride = (long long)p.kv_heads * D;
  const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
  const S* K = static_cast<const S*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const S* V = static_cast<const S*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  float q[E], o[E];
  load_row<T, D>(q, static_cast<const S*>(p.q) + q_row * D, lane);
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0.f;
  float m = neg_inf(), l = 0.f;  // running max (log2 domain) and sum
  int lo, hi;
  mask.row_keys(i, lo, hi);
  for (int j0 = lo; j0 < hi; j0 += 32) {
    const int cnt = imin(32, hi - j0);
    float mine = neg_inf();  // lane jj keeps the score of key j0 + jj
    for (int jj = 0; jj < cnt; ++jj) {
      float s = score(dot_row<T, D>(q, K + (long long)(j0 + jj) * kv_stride, lane), p.scale, p.softcap, p.softcap_inv) * kLog2e;
      if (lane == jj) mine = s;
    }
    const float m_new = fmaxf(m, warp_max(mine));  // finite: every key in [lo, hi) is visible
    const float alpha = ex2(m - m_new);
    const float pr = lane < cnt ? ex2(mine - m_new) : 0.f;
    l = l * alpha + warp_sum(pr);
    m = m_new;
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] *= alpha;
    for (int jj = 0; jj < cnt; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, pr, jj);
      const S* vr = V + (long long)(j0 + jj) * kv_stride;
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] += pj * T::to_float(vr[lane + 32 * e]);
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  S* out = static_cast<S*>(p.o) + q_row * D;
#pragma unroll
  for (int e = 0; e < E; ++e) out[lane + 32 * e] = T::from_float(o[e] * inv);
  if (lane == 0) p.lse[((long long)b * p.heads + h) * p.seq_q + i] = l > 0.f ? (m + lg2(l)) * kLn2 : neg_inf();
}

// Backward dQ: grid (ceil(Sq / 4), H, B); writes dq directly (no accumulation buffer).
template <class T, int D>
__device__ __forceinline__ void simt_bwd_dq(const BwdParams& p) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * SimtTraits::kWarps + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq_q) return;
  const int hk = h / (p.heads / p.kv_heads);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const long long kv_stride = (long long)p.kv_heads * D;
  const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
  const long long lrow = ((long long)b * p.heads + h) * p.seq_q + i;
  const S* K = static_cast<const S*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const S* V = static_cast<const S*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  float q[E], dout[E], dq[E];
  load_row<T, D>(q, static_cast<const S*>(p.q) + q_row * D, lane);
  load_row<T, D>(dout, static_cast<const S*>(p.d_o) + q_row * D, lane);
#pragma unroll
  for (int e = 0; e < E; ++e) dq[e] = 0.f;
  const float lse2 = p.lse[lrow] * kLog2e, delta = p.delta[lrow];
  int lo, hi;
  mask.row_keys(i, lo, hi);
  if (lse2 == neg_inf()) hi = lo;  // a row that saw nothing contributes nothing
  for (int j = lo; j < hi; ++j) {
    const S* kr = K + (long long)j * kv_stride;
    const float s = score(dot_row<T, D>(q, kr, lane), p.scale, p.softcap, p.softcap_inv);
    const float dp = dot_row<T, D>(dout, V + (long long)j * kv_stride, lane);
    const float ds = ex2(s * kLog2e - lse2) * (dp - delta) * softcap_grad(s, p.softcap, p.softcap_inv);
#pragma unroll
    for (int e = 0; e < E; ++e) dq[e] += ds * T::to_float(kr[lane + 32 * e]);
  }
  S* out = static_cast<S*>(p.dq) + q_row * D;
#pragma unroll
  for (int e = 0; e < E; ++e) out[lane + 32 * e] = T::from_float(dq[e] * p.scale);
}

// Backward dK, dV: grid (ceil(Sk / 4), Hkv, B). A warp owns one key of one kv head and sums over
// every query head of its group and every query that sees the key: no atomics, deterministic.
template <class T, int D>
__device__ __forceinline__ void simt_bwd_dkdv(const BwdParams& p) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int j = blockIdx.x * SimtTraits::kWarps + (threadIdx.x >> 5), hk = blockIdx.y, b = blockIdx.z;
  if (j >= p.seq_k) return;
  const int group = p.heads / p.kv_heads;
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const long long k_row = ((long long)b * p.seq_k + j) * p.kv_heads + hk;

  float k[E], v[E], dk[E], dv[E];
#pragma unroll
  for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
  int lo, hi;
  mask.keys_rows(j, j + 1, lo, hi);  // empty for keys past kv_len
  if (lo < hi) {
    load_row<T, D>(k, static_cast<const S*>(p.k) + k_row * D, lane);
    load_row<T, D>(v, static_cast<const S*>(p.v) + k_row * D, lane);
  }
  for (int hh = 0; hh < group && lo < hi; ++hh) {
    const int h = hk * group + hh;
    for (int i = lo; i < hi; ++i) {
      const long long lrow = ((long long)b * p.heads + h) * p.seq_q + i;
      const float lse2 = p.lse[lrow] * kLog2e;
      if (lse2 == neg_inf()) continue;
      const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
      const S* qr = static_cast<const S*>(p.q) + q_row * D;
      const S* dor = static_cast<const S*>(p.d_o) + q_row * D;
      const float s = score(dot_row<T, D>(k, qr, lane), p.scale, p.softcap, p.softcap_inv);
      const float dp = dot_row<T, D>(v, dor, lane);
      const float pr = ex2(s * kLog2e - lse2);
      const float ds = pr * (dp - p.delta[lrow]) * softcap_grad(s, p.softcap, p.softcap_inv);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        dv[e] += pr * T::to_float(dor[lane + 32 * e]);
        dk[e] += ds * T::to_float(qr[lane + 32 * e]);
      }
    }
  }
  S* gdk = static_cast<S*>(p.dk) + k_row * D;
  S* gdv = static_cast<S*>(p.dv) + k_row * D;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    gdk[lane + 32 * e] = T::from_float(dk[e] * p.scale);
    gdv[lane + 32 * e] = T::from_float(dv[e]);
  }
}

}  // namespace exla_rs
