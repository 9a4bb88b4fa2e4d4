// f32 attention on CUDA cores: correct to f32 precision rather than fast (tensor cores would
// round f32 inputs to tf32). One warp per row; lane l holds elements l, l + 32, ... of the head dim,
// so every global access is a coalesced row read and dot products end in one warp reduction.
// Visible keys (or, in dK/dV, visible queries) are one interval per row: only those are visited.
// The contract's optional operands (key mask, bias, ALiBi, dropout) use kernels/extras.cuh's
// helpers; work that is per (row, key) but not per head-dim element (mask bit, bias, ALiBi term,
// Philox draw) is done lane-parallel for 32 keys (or rows) at a time and handed around by shuffle.
#pragma once

#include "common.cuh"
#include "extras.cuh"

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

// M * s of entry (b, h, i, j). Each lane holds its own (row, key), so each computes its own x call
// (in a warp that is one Philox per 32 entries, as many as sharing octets by shuffle would take)
// and y only on a tie; Dropout::keep picks the word with selects (no local-memory array index).
EXLA_RS_DEVICE float simt_keep_scale(const Dropout& d, unsigned b, unsigned h, unsigned i, int j) {
  return d.keep(b, h, i, (long long)j) ? d.scale : 0.f;
}

// What one query row (b, h, i) adds to its scores and probabilities: everything but the mask
// interval (Mask) and the dot product. Each member is only used when its operand is present.
struct SimtRow {
  bool has_mask, has_bias, has_alibi, has_drop;
  long long mask_row;  // b * Sk: the key mask row
  long long bias_row;  // the bias offset of (b, h, i, key 0)
  long long pos;       // q_start[b] + i, for ALiBi
  float slope;
  Dropout drop;
  unsigned b, h, i;

  EXLA_RS_DEVICE static SimtRow make(const ExtraParams& x, int b, int h, int i, int seq_k, long long q_start) {
    SimtRow r;
    r.has_mask = x.key_mask != nullptr;
    r.has_bias = x.bias != nullptr;
    r.has_alibi = x.alibi_slopes != nullptr;
    r.has_drop = x.dropout_key != nullptr;
    r.mask_row = (long long)b * seq_k;
    r.bias_row = r.has_bias ? bias_offset(x, b, h, i, 0) : 0;
    r.pos = q_start + i;
    r.slope = r.has_alibi ? x.alibi_slopes[h] : 0.f;
    if (r.has_drop) r.drop = Dropout::load(x);
    r.b = b;
    r.h = h;
    r.i = i;
    return r;
  }
  // Key j passes the key mask (the interval was tested by the caller).
  EXLA_RS_DEVICE bool visible(const ExtraParams& x, int j) const {
    return !has_mask || key_mask_visible(x.key_mask, x.key_mask_bytes, mask_row + j);
  }
  // beta + alpha of key j: added to the score after scale and softcap. Only for visible keys, so
  // a hidden entry's bias is never read (it may be NaN).
  EXLA_RS_DEVICE float add(const ExtraParams& x, int j) const {
    float a = has_bias ? bias_load(x.bias, x.bias_dtype, bias_row + j * x.bias_stride_k) : 0.f;
    if (has_alibi) a += alibi_term(slope, pos, j);
    return a;
  }
  // M * s of key j: the keep scale (1 without dropout, 0 for a dropped entry).
  EXLA_RS_DEVICE float keep_scale(int j) const { return !has_drop ? 1.f : simt_keep_scale(drop, b, h, i, j); }
};

// Forward: grid (ceil(Sq / 4), H, B). Keys go 32 at a time: lane jj owns key j0 + jj's mask bit,
// score, bias/ALiBi term and keep scale; the V accumulation then visits only the keys with a
// nonzero weight, so a key hidden by the mask or a -inf bias never multiplies its V (which may
// hold inf/NaN) and a dropped key costs nothing.
template <class T, int D>
__device__ __forceinline__ void simt_fwd(const FwdParams& p) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * SimtTraits::kWarps + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq_q) return;
  const int hk = h / (p.heads / p.kv_heads);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const SimtRow row = SimtRow::make(p.x, b, h, i, p.seq_k, p.q_start[b]);
  const long long kv_stride = (long long)p.kv_heads * D;
  const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
  const S* K = static_cast<const S*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const S* V = static_cast<const S*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  float q[E], o[E];
  load_row<T, D>(q, static_cast<const S*>(p.q) + q_row * D, lane);
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0.f;
  float m = neg_inf(), l = 0.f;  // running max of z (log2 domain) and sum
  int lo, hi;
  mask.row_keys(i, lo, hi);
  for (int j0 = lo; j0 < hi; j0 += 32) {
    const int j = j0 + lane;
    const bool vis = j < hi && row.visible(p.x, j);
    float mine = neg_inf();  // lane jj keeps z of key j0 + jj (log2 domain), -inf when hidden
    for (unsigned left = __ballot_sync(0xffffffffu, vis); left; left &= left - 1) {
      const int jj = __ffs(left) - 1;
      const float s = score(dot_row<T, D>(q, K + (long long)(j0 + jj) * kv_stride, lane), p.scale, p.softcap, p.softcap_inv);
      if (lane == jj) mine = s;
    }
    if (vis) mine = (mine + row.add(p.x, j)) * kLog2e;
    const float m_new = fmaxf(m, warp_max(mine));
    // -inf only while every key so far was hidden (by the mask or a -inf bias): then 0 stands in,
    // so no -inf - -inf NaN; l and o are still 0.
    const float m_use = m_new == neg_inf() ? 0.f : m_new;
    const float alpha = ex2(m - m_use);
    const float pr = vis ? ex2(mine - m_use) : 0.f;
    l = l * alpha + warp_sum(pr);
    m = m_new;
    // Dropout scales o only: the softmax (l, lse) is taken before it.
    const float pd = pr == 0.f ? 0.f : pr * row.keep_scale(j);
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] *= alpha;
    for (unsigned left = __ballot_sync(0xffffffffu, pd != 0.f); left; left &= left - 1) {
      const int jj = __ffs(left) - 1;
      const float pj = __shfl_sync(0xffffffffu, pd, jj);
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

// Backward dQ: grid (ceil(Sq / 4), H, B); writes dq directly (no accumulation buffer), and with
// bias_grad adds each dZ entry into the dbias accumulator (this kernel visits every visible
// (b, h, i, j) exactly once; the dK/dV kernel does not touch dbias).
template <class T, int D>
__device__ __forceinline__ void simt_bwd_dq(const BwdParams& p) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int i = blockIdx.x * SimtTraits::kWarps + (threadIdx.x >> 5), h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq_q) return;
  const int hk = h / (p.heads / p.kv_heads);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const SimtRow row = SimtRow::make(p.x, b, h, i, p.seq_k, p.q_start[b]);
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
  for (int j0 = lo; j0 < hi; j0 += 32) {
    // Lane jj: key j0 + jj's mask bit, bias/ALiBi term and keep scale.
    const int jl = j0 + lane;
    const bool vis = jl < hi && row.visible(p.x, jl);
    const float add = vis ? row.add(p.x, jl) : 0.f;
    const float ks = vis ? row.keep_scale(jl) : 0.f;
    for (unsigned left = __ballot_sync(0xffffffffu, vis); left; left &= left - 1) {
      const int jj = __ffs(left) - 1, j = j0 + jj;
      const S* kr = K + (long long)j * kv_stride;
      const float s = score(dot_row<T, D>(q, kr, lane), p.scale, p.softcap, p.softcap_inv);
      const float pr = ex2((s + __shfl_sync(0xffffffffu, add, jj)) * kLog2e - lse2);
      // P = 0 (a -inf bias, or underflow) contributes exactly 0: skip, so an inf/NaN V there
      // cannot turn 0 into NaN. The warp sums are lane-identical, so the branch is uniform.
      if (pr == 0.f) continue;
      const float dp = dot_row<T, D>(dout, V + (long long)j * kv_stride, lane);
      const float dz = pr * (__shfl_sync(0xffffffffu, ks, jj) * dp - delta);
      if (p.dbias_accum && lane == jj) red_add_f32(p.dbias_accum + row.bias_row + (long long)j * p.x.bias_stride_k, dz);
      const float ds = dz * softcap_grad(s, p.softcap, p.softcap_inv);
#pragma unroll
      for (int e = 0; e < E; ++e) dq[e] += ds * T::to_float(kr[lane + 32 * e]);
    }
  }
  S* out = static_cast<S*>(p.dq) + q_row * D;
#pragma unroll
  for (int e = 0; e < E; ++e) out[lane + 32 * e] = T::from_float(dq[e] * p.scale);
}

// Backward dK, dV: grid (ceil(Sk / 4), Hkv, B). A warp owns one key of one kv head and sums over
// every query head of its group and every query that sees the key: no atomics, deterministic.
// Rows go 32 at a time: lane ii owns row i0 + ii's lse, delta, bias/ALiBi term and keep scale.
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
  const long long q_start = p.q_start[b];

  float k[E], v[E], dk[E], dv[E];
#pragma unroll
  for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
  int lo, hi;
  mask.keys_rows(j, j + 1, lo, hi);  // empty for keys past kv_len
  // A key the key mask hides is seen by no row: zero gradients, K/V never read.
  if (p.x.key_mask && !key_mask_visible(p.x.key_mask, p.x.key_mask_bytes, (long long)b * p.seq_k + j)) hi = lo;
  if (lo < hi) {
    load_row<T, D>(k, static_cast<const S*>(p.k) + k_row * D, lane);
    load_row<T, D>(v, static_cast<const S*>(p.v) + k_row * D, lane);
  }
  for (int hh = 0; hh < group && lo < hi; ++hh) {
    const int h = hk * group + hh;
    const float slope = p.x.alibi_slopes ? p.x.alibi_slopes[h] : 0.f;
    for (int i0 = lo; i0 < hi; i0 += 32) {
      const int il = i0 + lane;
      const long long lrow = ((long long)b * p.heads + h) * p.seq_q + il;
      // Lane ii's row: lse (log2), delta, beta + alpha, keep scale; live = in range, saw a key.
      float lse2 = neg_inf(), delta = 0.f, add = 0.f, ks = 1.f;
      if (il < hi) {
        lse2 = p.lse[lrow] * kLog2e;
        delta = p.delta[lrow];
      }
      const bool live = lse2 != neg_inf();
      if (live) {
        if (p.x.bias) add = bias_load(p.x.bias, p.x.bias_dtype, bias_offset(p.x, b, h, il, j));
        if (p.x.alibi_slopes) add += alibi_term(slope, q_start + il, j);
        if (p.x.dropout_key) ks = simt_keep_scale(Dropout::load(p.x), b, h, il, j);
      }
      for (unsigned left = __ballot_sync(0xffffffffu, live); left; left &= left - 1) {
        const int ii = __ffs(left) - 1, i = i0 + ii;
        const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
        const S* qr = static_cast<const S*>(p.q) + q_row * D;
        const S* dor = static_cast<const S*>(p.d_o) + q_row * D;
        const float s = score(dot_row<T, D>(k, qr, lane), p.scale, p.softcap, p.softcap_inv);
        const float pr = ex2((s + __shfl_sync(0xffffffffu, add, ii)) * kLog2e - __shfl_sync(0xffffffffu, lse2, ii));
        if (pr == 0.f) continue;  // as in dQ: exactly 0, and a NaN-free skip (uniform)
        const float dp = dot_row<T, D>(v, dor, lane);
        const float pk = pr * __shfl_sync(0xffffffffu, ks, ii);  // P * M * s
        const float ds = (pk * dp - pr * __shfl_sync(0xffffffffu, delta, ii)) * softcap_grad(s, p.softcap, p.softcap_inv);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          dv[e] += pk * T::to_float(dor[lane + 32 * e]);
          dk[e] += ds * T::to_float(qr[lane + 32 * e]);
        }
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
