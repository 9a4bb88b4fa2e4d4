// The two small passes around the backward's main kernel.
#pragma once

#include "common.cuh"

namespace exla_rs {

// delta[b,h,i] = sum_d do[b,i,h,d] * o[b,i,h,d] (in f32), and zeroes dq_accum's row when the main
// kernel accumulates dQ there. One warp per (b, i, h) row; rows are contiguous in memory.
template <class T>
__device__ __forceinline__ void bwd_preprocess(const BwdParams& p) {
  using S = typename T::Storage;
  const long long rows = (long long)p.batch * p.seq_q * p.heads;
  const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int D = p.head_dim;
  const S* o = static_cast<const S*>(p.o) + row * D;
  const S* d_o = static_cast<const S*>(p.d_o) + row * D;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += T::to_float(o[d]) * T::to_float(d_o[d]);
  acc = warp_sum(acc);
  // row = (b * Sq + i) * H + h  ->  delta index (b * H + h) * Sq + i
  const long long h = row % p.heads, bi = row / p.heads, i = bi % p.seq_q, b = bi / p.seq_q;
  if (lane == 0) p.delta[(b * p.heads + h) * p.seq_q + i] = acc;
  if (p.dq_accum)
    for (int d = lane; d < D; d += 32) p.dq_accum[row * D + d] = 0.f;
}

// dq = scale * dq_accum, in the element type of q.
template <class T>
__device__ __forceinline__ void bwd_convert_dq(const BwdParams& p) {
  using S = typename T::Storage;
  const long long n = (long long)p.batch * p.seq_q * p.heads * p.head_dim;
  S* dq = static_cast<S*>(p.dq);
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dq[i] = T::from_float(p.dq_accum[i] * p.scale);
}

}  // namespace exla_rs
