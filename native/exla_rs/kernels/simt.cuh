// f32 attention on CUDA cores: correct to f32 precision rather than fast (tensor cores would
// round f32 inputs to tf32). One warp per row (a query row in the forward and dQ, a key in dK/dV),
// 32 keys (or rows) at a time: lane jj takes key j0 + jj whole, its score, mask bit, bias/ALiBi
// term, keep scale and P, dP, dS, so a dot product is one lane's own loop over the head dim (the
// warp's row sits in shared memory, read as a broadcast) and the warp meets only for the
// running max and sum of each 32 keys. The accumulations over keys (o += p v, dq += ds k, dv, dk)
// then go lane-per-column: lane l holds elements l, l + 32, ... of the head dim, every global
// access is a coalesced row read, and each key's weight comes from shared memory.
// Visible keys (or, in dK/dV, visible queries) are one interval per row: only those are visited.
// The contract's optional operands (key mask, bias, ALiBi, dropout) use kernels/extras.cuh's helpers.
#pragma once

#include "common.cuh"
#include "extras.cuh"

namespace exla_rs {

// kWarps rows per block; each warp's shared memory holds two head-dim rows in f32 (q and dO, or
// k and v) and two 32-entry weight vectors (p, or dS and P M): (2 D + 64) floats. Mirrored in
// crates/exla-rs-cuda/src/config.rs (simt_smem_bytes): change both.
struct SimtTraits {
  static constexpr int kWarps = 4;  // rows per block
  static constexpr int kThreads = 32 * kWarps;
  __host__ __device__ static constexpr int smem_bytes(int d) { return kWarps * (2 * d + 64) * 4; }
};

// One warp's slice of the block's shared memory: rows a and b (D floats each), weights wa and wb
// (32 floats each).
template <int D>
struct SimtSmem {
  float* a;
  float* b;
  float* wa;
  float* wb;
  EXLA_RS_DEVICE static SimtSmem of_warp(unsigned char* raw, int warp) {
    float* base = reinterpret_cast<float*>(raw) + warp * (2 * D + 64);
    return SimtSmem{base, base + D, base + 2 * D, base + 2 * D + 32};
  }
};

// The warp's row src into shared memory (dst, D floats), coalesced; the caller syncs the warp.
template <class T, int D>
EXLA_RS_DEVICE void stage_row(float* dst, const typename T::Storage* src, int lane) {
#pragma unroll
  for (int e = 0; e < D / 32; ++e) dst[lane + 32 * e] = T::to_float(src[lane + 32 * e]);
}
// One lane's whole dot product: the shared row a (every lane reads the same address: a
// broadcast) with the global row src, in 16-byte loads (rows start at multiples of D elements
// of 16-byte aligned buffers, and D % 32 == 0). Four partial sums hide the FMA latency.
template <class T, int D>
EXLA_RS_DEVICE float dot_lane(const float* a, const typename T::Storage* src) {
  static_assert(sizeof(typename T::Storage) == 4, "the SIMT kernels run f32");
  const Chunk16* s4 = reinterpret_cast<const Chunk16*>(src);
  const Chunk16* a4 = reinterpret_cast<const Chunk16*>(a);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int c = 0; c < D / 4; ++c) {
    const Chunk16 x = s4[c], y = a4[c];
    acc[0] += __uint_as_float(y.x) * __uint_as_float(x.x);
    acc[1] += __uint_as_float(y.y) * __uint_as_float(x.y);
    acc[2] += __uint_as_float(y.z) * __uint_as_float(x.z);
    acc[3] += __uint_as_float(y.w) * __uint_as_float(x.w);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// One online-softmax step of a row over 32 keys, lane jj holding key jj's z (log2 domain; -inf
// and seen false where the row does not see it): the running max m and sum l, o rescaled; returns
// this lane's P. The max stays -inf only while every key so far was hidden (by the mask or a -inf
// bias): then 0 stands in, so no -inf - -inf NaN (l and o are still 0).
template <int E>
EXLA_RS_DEVICE float simt_online_step(float z, bool seen, float& m, float& l, float (&o)[E]) {
  const float m_new = fmaxf(m, warp_max(z));
  const float m_use = m_new == neg_inf() ? 0.f : m_new;
  const float alpha = ex2(m - m_use);
  const float pr = seen ? ex2(z - m_use) : 0.f;
  l = l * alpha + warp_sum(pr);
  m = m_new;
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] *= alpha;
  return pr;
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
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i = blockIdx.x * SimtTraits::kWarps + warp, h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq_q) return;  // whole warps: the warp collectives below see all 32 lanes
  EXLA_RS_DYNAMIC_SMEM(smem_raw, 16);
  const SimtSmem<D> sm = SimtSmem<D>::of_warp(smem_raw, warp);  // a: q; wa: the 32 keys' weights
  const int hk = h / (p.heads / p.kv_heads);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const SimtRow row = SimtRow::make(p.x, b, h, i, p.seq_k, p.q_start[b]);
  const long long kv_stride = (long long)p.kv_heads * D;
  const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
  const S* K = static_cast<const S*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const S* V = static_cast<const S*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  stage_row<T, D>(sm.a, static_cast<const S*>(p.q) + q_row * D, lane);
  __syncwarp();
  float o[E];
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0.f;
  float m = neg_inf(), l = 0.f;  // running max of z (log2 domain) and sum
  int lo, hi;
  mask.row_keys(i, lo, hi);
  for (int j0 = lo; j0 < hi; j0 += 32) {
    const int j = j0 + lane;
    const bool vis = j < hi && row.visible(p.x, j);
    // z of this lane's key (log2 domain), -inf when hidden; its K row is read only when visible.
    const float mine = vis ? (score(dot_lane<T, D>(sm.a, K + (long long)j * kv_stride), p.scale, p.softcap, p.softcap_inv) +
                              row.add(p.x, j)) * kLog2e
                           : neg_inf();
    const float pr = simt_online_step(mine, vis, m, l, o);
    // Dropout scales o only: the softmax (l, lse) is taken before it.
    const float pd = pr == 0.f ? 0.f : pr * row.keep_scale(j);
    sm.wa[lane] = pd;
    __syncwarp();  // the weights are visible to every lane
    for (unsigned left = __ballot_sync(0xffffffffu, pd != 0.f); left; left &= left - 1) {
      const int jj = __ffs(left) - 1;
      const float pj = sm.wa[jj];
      const S* vr = V + (long long)(j0 + jj) * kv_stride;
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] += pj * T::to_float(vr[lane + 32 * e]);
    }
    __syncwarp();  // every lane has read wa before the next keys overwrite it
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
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int i = blockIdx.x * SimtTraits::kWarps + warp, h = blockIdx.y, b = blockIdx.z;
  if (i >= p.seq_q) return;  // whole warps
  EXLA_RS_DYNAMIC_SMEM(smem_raw, 16);
  const SimtSmem<D> sm = SimtSmem<D>::of_warp(smem_raw, warp);  // a: q, b: dO; wa: the keys' dS
  const int hk = h / (p.heads / p.kv_heads);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const SimtRow row = SimtRow::make(p.x, b, h, i, p.seq_k, p.q_start[b]);
  const long long kv_stride = (long long)p.kv_heads * D;
  const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
  const long long lrow = ((long long)b * p.heads + h) * p.seq_q + i;
  const S* K = static_cast<const S*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const S* V = static_cast<const S*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  stage_row<T, D>(sm.a, static_cast<const S*>(p.q) + q_row * D, lane);
  stage_row<T, D>(sm.b, static_cast<const S*>(p.d_o) + q_row * D, lane);
  __syncwarp();
  float dq[E];
#pragma unroll
  for (int e = 0; e < E; ++e) dq[e] = 0.f;
  const float lse2 = p.lse[lrow] * kLog2e, delta = p.delta[lrow];
  int lo, hi;
  mask.row_keys(i, lo, hi);
  if (lse2 == neg_inf()) hi = lo;  // a row that saw nothing contributes nothing
  for (int j0 = lo; j0 < hi; j0 += 32) {
    // Lane jj: key j0 + jj's P, dP, dZ (and its dbias entry) and dS.
    const int j = j0 + lane;
    float ds = 0.f;
    bool used = false;
    if (j < hi && row.visible(p.x, j)) {
      const S* kr = K + (long long)j * kv_stride;
      const float s = score(dot_lane<T, D>(sm.a, kr), p.scale, p.softcap, p.softcap_inv);
      const float pr = ex2((s + row.add(p.x, j)) * kLog2e - lse2);
      // P = 0 (a -inf bias, or underflow) contributes exactly 0: skipped, so an inf/NaN V there
      // cannot turn 0 into NaN.
      if (pr != 0.f) {
        const float dp = dot_lane<T, D>(sm.b, V + (long long)j * kv_stride);
        const float dz = pr * (row.keep_scale(j) * dp - delta);
        if (p.dbias_accum) red_add_f32(p.dbias_accum + row.bias_row + (long long)j * p.x.bias_stride_k, dz);
        ds = dz * softcap_grad(s, p.softcap, p.softcap_inv);
        used = true;
      }
    }
    sm.wa[lane] = ds;
    __syncwarp();  // the weights are visible to every lane
    for (unsigned left = __ballot_sync(0xffffffffu, used); left; left &= left - 1) {
      const int jj = __ffs(left) - 1;
      const float dsj = sm.wa[jj];
      const S* kr = K + (long long)(j0 + jj) * kv_stride;
#pragma unroll
      for (int e = 0; e < E; ++e) dq[e] += dsj * T::to_float(kr[lane + 32 * e]);
    }
    __syncwarp();  // wa is read before the next keys overwrite it
  }
  S* out = static_cast<S*>(p.dq) + q_row * D;
#pragma unroll
  for (int e = 0; e < E; ++e) out[lane + 32 * e] = T::from_float(dq[e] * p.scale);
}

// Backward dK, dV: grid (ceil(Sk / 4), Hkv, B). A warp owns one key of one kv head and sums over
// every query head of its group and every query that sees the key: no atomics, deterministic.
// Rows go 32 at a time: lane ii owns row i0 + ii's lse, delta, bias/ALiBi term, keep scale, and
// its P, dP and dS.
template <class T, int D>
__device__ __forceinline__ void simt_bwd_dkdv(const BwdParams& p) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int j = blockIdx.x * SimtTraits::kWarps + warp, hk = blockIdx.y, b = blockIdx.z;
  if (j >= p.seq_k) return;  // whole warps
  EXLA_RS_DYNAMIC_SMEM(smem_raw, 16);
  const SimtSmem<D> sm = SimtSmem<D>::of_warp(smem_raw, warp);  // a: k, b: v; wa: P M s, wb: dS
  const int group = p.heads / p.kv_heads;
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const long long k_row = ((long long)b * p.seq_k + j) * p.kv_heads + hk;
  const long long q_start = p.q_start[b];

  float dk[E], dv[E];
#pragma unroll
  for (int e = 0; e < E; ++e) dk[e] = dv[e] = 0.f;
  int lo, hi;
  mask.keys_rows(j, j + 1, lo, hi);  // empty for keys past kv_len
  // A key the key mask hides is seen by no row: zero gradients, K/V never read.
  if (p.x.key_mask && !key_mask_visible(p.x.key_mask, p.x.key_mask_bytes, (long long)b * p.seq_k + j)) hi = lo;
  if (lo < hi) {
    stage_row<T, D>(sm.a, static_cast<const S*>(p.k) + k_row * D, lane);
    stage_row<T, D>(sm.b, static_cast<const S*>(p.v) + k_row * D, lane);
    __syncwarp();
  }
  for (int hh = 0; hh < group && lo < hi; ++hh) {
    const int h = hk * group + hh;
    const float slope = p.x.alibi_slopes ? p.x.alibi_slopes[h] : 0.f;
    for (int i0 = lo; i0 < hi; i0 += 32) {
      const int i = i0 + lane;
      // Lane ii's row: P M s (pk) and dS; used = in range, saw a key, P != 0.
      float pk = 0.f, ds = 0.f;
      bool used = false;
      if (i < hi) {
        const long long lrow = ((long long)b * p.heads + h) * p.seq_q + i;
        const float lse2 = p.lse[lrow] * kLog2e;
        if (lse2 != neg_inf()) {  // a row that saw no key contributes nothing (its Q/dO unread)
          const long long q_row = ((long long)b * p.seq_q + i) * p.heads + h;
          float add = 0.f;
          if (p.x.bias) add = bias_load(p.x.bias, p.x.bias_dtype, bias_offset(p.x, b, h, i, j));
          if (p.x.alibi_slopes) add += alibi_term(slope, q_start + i, j);
          const float s = score(dot_lane<T, D>(sm.a, static_cast<const S*>(p.q) + q_row * D), p.scale, p.softcap, p.softcap_inv);
          const float pr = ex2((s + add) * kLog2e - lse2);
          if (pr != 0.f) {  // as in dQ: exactly 0, and a NaN-free skip
            const float dp = dot_lane<T, D>(sm.b, static_cast<const S*>(p.d_o) + q_row * D);
            pk = pr * (p.x.dropout_key ? simt_keep_scale(Dropout::load(p.x), b, h, i, j) : 1.f);  // P * M * s
            ds = (pk * dp - pr * p.delta[lrow]) * softcap_grad(s, p.softcap, p.softcap_inv);
            used = true;
          }
        }
      }
      sm.wa[lane] = pk;
      sm.wb[lane] = ds;
      __syncwarp();  // the weights are visible to every lane
      for (unsigned left = __ballot_sync(0xffffffffu, used); left; left &= left - 1) {
        const int ii = __ffs(left) - 1;
        const long long q_row = ((long long)b * p.seq_q + i0 + ii) * p.heads + h;
        const S* qr = static_cast<const S*>(p.q) + q_row * D;
        const S* dor = static_cast<const S*>(p.d_o) + q_row * D;
        const float pki = sm.wa[ii], dsi = sm.wb[ii];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          dv[e] += pki * T::to_float(dor[lane + 32 * e]);
          dk[e] += dsi * T::to_float(qr[lane + 32 * e]);
        }
      }
      __syncwarp();  // wa, wb are read before the next rows overwrite them
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

// Split-KV forward for f32 decode (issue 34; the f16/bf16 one is flash_fwd_split.cuh, whose
// SplitParams, partials layout and combine pass this shares). One warp per CTA owns kRows
// "packed" rows of one KV head: packed row r = i * g + hh is query row i of head hk * g + hh
// (g = H / Hkv), so the heads of a GQA group and the query rows of a decode call share each K/V
// row the warp reads: lane jj scores key j0 + jj against every packed row (their q in shared
// memory), the running max and sum of each row are warp reductions, and the V row of each used
// key is read once (lane-per-column) for every row. Grid (row_blocks * num_splits, Hkv, B); the
// keys the rows see are divided between the splits in 32-key chunks. With one split the warp writes
// O and LSE itself; with more, its rows' normalised partial o and lse go to the workspace and
// flash_fwd_combine merges them. Mirrored in crates/exla-rs-cuda/src/split.rs: change both.
struct SimtSplitTraits {
  static constexpr int kRows = 8;  // packed rows per warp
  static constexpr int kThreads = 32;
  __host__ __device__ static constexpr int smem_bytes(int d) { return kRows * (d + 32) * 4; }
};

template <class T, int D>
__device__ __forceinline__ void simt_fwd_split(const SplitParams& sp) {
  using S = typename T::Storage;
  constexpr int E = D / 32, R = SimtSplitTraits::kRows;
  const FwdParams& p = sp.f;
  const ExtraParams& x = p.x;
  const int lane = threadIdx.x & 31;
  if (blockDim.x != SimtSplitTraits::kThreads) __trap();  // the launcher's table disagrees with this file
  const int split = blockIdx.x % sp.num_splits, mb = blockIdx.x / sp.num_splits;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int grp = p.heads / p.kv_heads;
  const int m0 = mb * R, nr = imin(R, grp * p.seq_q - m0);  // this warp's packed rows [m0, m0 + nr)
  if (nr <= 0) return;
  EXLA_RS_DYNAMIC_SMEM(smem_raw, 16);
  float* sq = reinterpret_cast<float*>(smem_raw);  // [R][D]: the rows' q
  float* sw = sq + R * D;                          // [R][32]: each row's weights of the 32 keys
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);
  const long long kv_stride = (long long)p.kv_heads * D;
  const S* K = static_cast<const S*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const S* V = static_cast<const S*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  // Each row's query row, head, visible interval; ALiBi slope and bias row (rows >= nr: none).
  int i_r[R], h_r[R], lo_r[R], hi_r[R];
  float slope_r[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int pr = m0 + imin(r, nr - 1);  // padding rows repeat the last real one, never stored
    i_r[r] = pr / grp;
    h_r[r] = hk * grp + pr % grp;
    mask.row_keys(i_r[r], lo_r[r], hi_r[r]);
    if (r >= nr) hi_r[r] = lo_r[r];
    slope_r[r] = x.alibi_slopes && r < nr ? x.alibi_slopes[h_r[r]] : 0.f;
    // Padding rows score zeros (never seen, never stored) rather than read a real row's q again.
    const S* qr = static_cast<const S*>(p.q) + (((long long)b * p.seq_q + i_r[r]) * p.heads + h_r[r]) * D;
#pragma unroll
    for (int e = 0; e < E; ++e) sq[r * D + lane + 32 * e] = r < nr ? T::to_float(qr[lane + 32 * e]) : 0.f;
  }
  __syncwarp();

  // The keys any of the rows sees, and this split's share of their 32-key chunks.
  int k_lo, k_hi;
  mask.rows_keys(i_r[0], (m0 + nr - 1) / grp + 1, k_lo, k_hi);  // (not i_r[nr - 1]: a run-time index spills the array)
  const int n_chunks = k_hi > k_lo ? (k_hi - k_lo + 31) / 32 : 0;
  const int c_begin = (int)((long long)split * n_chunks / sp.num_splits);
  const int c_end = (int)((long long)(split + 1) * n_chunks / sp.num_splits);

  float o[R][E], m[R], l[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf();
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[r][e] = 0.f;
  }
  for (int c = c_begin; c < c_end; ++c) {
    const int j0 = k_lo + 32 * c, j = j0 + lane;
    const bool key_ok = j < k_hi && (!x.key_mask || key_mask_visible(x.key_mask, x.key_mask_bytes, (long long)b * p.seq_k + j));
    bool seen[R];
    bool any = false;
#pragma unroll
    for (int r = 0; r < R; ++r) any |= (seen[r] = key_ok && j >= lo_r[r] && j < hi_r[r]);
    // z of this lane's key for each row (log2 domain), -inf where the row does not see it; the K
    // row is read once for all rows, and only when one of them sees the key.
    float z[R];
#pragma unroll
    for (int r = 0; r < R; ++r) z[r] = neg_inf();
    if (any) {
      float acc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = 0.f;
      const Chunk16* k4 = reinterpret_cast<const Chunk16*>(K + (long long)j * kv_stride);
#pragma unroll 2
      for (int cc = 0; cc < D / 4; ++cc) {
        const Chunk16 kx = k4[cc];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const Chunk16 qx = reinterpret_cast<const Chunk16*>(sq + r * D)[cc];
          acc[r] += __uint_as_float(qx.x) * __uint_as_float(kx.x) + __uint_as_float(qx.y) * __uint_as_float(kx.y) +
                    __uint_as_float(qx.z) * __uint_as_float(kx.z) + __uint_as_float(qx.w) * __uint_as_float(kx.w);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (!seen[r]) continue;
        float add = x.bias ? bias_load(x.bias, x.bias_dtype, bias_offset(x, b, h_r[r], i_r[r], j)) : 0.f;
        if (x.alibi_slopes) add += alibi_term(slope_r[r], mask.q_start + i_r[r], j);
        z[r] = (score(acc[r], p.scale, p.softcap, p.softcap_inv) + add) * kLog2e;
      }
    }
    // Online softmax per row over the 32 keys (simt_online_step, as simt_fwd); the weights go to shared memory.
    unsigned used = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r >= nr) break;  // warp-uniform
      const float pr = simt_online_step(z[r], seen[r], m[r], l[r], o[r]);
      sw[r * 32 + lane] = pr;
      used |= __ballot_sync(0xffffffffu, pr != 0.f);
    }
    __syncwarp();  // the weights are visible to every lane
    // O += P V over the keys some row weighs: each V row read once; a zero weight adds nothing,
    // so a key a row does not see never meets its V (which may hold inf/NaN).
    for (unsigned left = used; left; left &= left - 1) {
      const int jj = __ffs(left) - 1;
      const S* vr = V + (long long)(j0 + jj) * kv_stride;
      float v[E];
#pragma unroll
      for (int e = 0; e < E; ++e) v[e] = T::to_float(vr[lane + 32 * e]);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float w = sw[r * 32 + jj];
        if (w != 0.f) {  // warp-uniform
#pragma unroll
          for (int e = 0; e < E; ++e) o[r][e] += w * v[e];
        }
      }
    }
    __syncwarp();  // sw is read before the next keys overwrite it
  }

  // Epilogue per row: o / l, lse (rows that saw no key: o = 0, lse = -inf), as simt_fwd.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r >= nr) break;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float lse = l[r] > 0.f ? (m[r] + lg2(l[r])) * kLn2 : neg_inf();
    const long long lrow = ((long long)b * p.heads + h_r[r]) * p.seq_q + i_r[r];
    if (sp.num_splits == 1) {
      S* out = static_cast<S*>(p.o) + (((long long)b * p.seq_q + i_r[r]) * p.heads + h_r[r]) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) out[lane + 32 * e] = T::from_float(o[r][e] * inv);
      if (lane == 0) p.lse[lrow] = lse;
    } else {
      // Partials, split-major (flash_fwd_split.cuh's layout). A NaN row sum (a NaN score of a seen
      // key) stays NaN, so the combine pass does not drop the split as one that saw no key.
      const long long prow = (long long)split * p.batch * p.heads * p.seq_q + lrow;
      float* dst = sp.o_part + prow * D;
#pragma unroll
      for (int e = 0; e < E; ++e) dst[lane + 32 * e] = o[r][e] * inv;
      if (lane == 0) sp.lse_part[prow] = l[r] != l[r] ? qnan() : lse;
    }
  }
}

}  // namespace exla_rs
