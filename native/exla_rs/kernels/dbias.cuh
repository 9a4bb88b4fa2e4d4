// The two passes around a backward that returns dbias (bias_grad): the main kernels add every
// dZ entry into an f32 accumulator laid out densely like the bias (params.cuh: dbias_accum, at the
// end of the workspace), so it is zeroed before them and rounded once into the dbias result, of
// the bias's own type, after them: the contract's "accumulated in f32 and rounded once".
#pragma once

#include "common.cuh"

namespace exla_rs {

// dbias_accum[0 .. dbias_elems) = 0. Grid-stride over the elements.
__device__ __forceinline__ void dbias_zero(const BwdParams& p) {
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < p.dbias_elems; e += (long long)gridDim.x * blockDim.x)
    p.dbias_accum[e] = 0.f;
}

// dbias[e] = dbias_accum[e] rounded to bias_dtype (0 = f32, 1 = f16, 2 = bf16).
template <class T>
__device__ __forceinline__ void dbias_round_as(const BwdParams& p) {
  using S = typename T::Storage;
  S* out = static_cast<S*>(p.dbias);
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < p.dbias_elems; e += (long long)gridDim.x * blockDim.x)
    out[e] = T::from_float(p.dbias_accum[e]);
}

__device__ __forceinline__ void dbias_round(const BwdParams& p) {
  switch (p.x.bias_dtype) {
    case 0: dbias_round_as<F32>(p); break;
    case 1: dbias_round_as<F16>(p); break;
    default: dbias_round_as<BF16>(p); break;
  }
}

}  // namespace exla_rs
