// Head dims without a kernel (issue 33, part 4): a call of head dim D that no instantiation has
// runs on the next kernel head dim Dk > D (config.rs `kernel_head_dim`). Its operands are copied
// into zero-padded [rows, Dk] buffers in the workspace before the kernels run, and its results
// copied back into the caller's [rows, D] buffers after them. Zero columns change no dot product
// (q . k, do . v, do . o) and the caller's scale is passed as it is, so the padded call computes
// the unpadded one; lse is written in place (it has no head-dim axis).
#pragma once

#include "common.cuh"

namespace exla_rs {

// dst[r, c] = c < copy_cols ? src[r, c] : 0 for r < rows, c < dst_cols, rows of src_cols and
// dst_cols elements. S is the element's bit pattern (16 or 32 bits): the copy is exact (NaN and
// inf included) whatever the float type, and zero bits are +0 in every type. One warp per row, so
// a warp's lanes touch consecutive elements; grid-stride over rows.
template <class S>
__device__ __forceinline__ void pad_rows(const PadParams& p) {
  const S* src = static_cast<const S*>(p.src);
  S* dst = static_cast<S*>(p.dst);
  const int lane = threadIdx.x & 31;
  const long long step = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < p.rows; r += step) {
    const S* s = src + r * p.src_cols;
    S* d = dst + r * p.dst_cols;
    for (int c = lane; c < p.dst_cols; c += 32) d[c] = c < p.copy_cols ? s[c] : (S)0;
  }
}

}  // namespace exla_rs
