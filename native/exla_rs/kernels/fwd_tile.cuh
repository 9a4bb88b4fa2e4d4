// One key tile of the mma.sync forward's main loop, the pieces flash_fwd.cuh and
// flash_fwd_split.cuh share: S = Q K^T, the log2-domain scores, the interval and key_mask test,
// the non-finite-V guard, the online softmax and O += P V. The two kernels differ only in where a
// thread's two rows come from (a query block of one head, or packed rows of a GQA group) and in
// what they do around these steps (bias and ALiBi per row, dropout, warps with no real row), so
// each step takes the rows' data as arguments. All of it is inlined: the SASS of every kernel
// file is what it was when each kernel spelled the steps out, but for the masked sets' rare
// non-finite-V path, where the bias test's bool costs +-8 instructions (2026-11-27, all 256 images
// compared).
//
// A warp's 16 rows are m16n8k16 A fragments; the thread holds rows g and g + 8 (g = lane / 4) and,
// of each n8 column tile j, columns tig * 2 and tig * 2 + 1 (tig = lane % 4): s[j][2 r + h] is row
// r's element of key n0 + j * 8 + tig * 2 + h, acc_o[dt][2 r + h] its output column
// dt * 8 + tig * 2 + h.
#pragma once

#include "common.cuh"

namespace exla_rs {

// s += the warp's 16 rows of Q (sQ, swizzled by SwQ) times the tile's BN keys (sKs, SwK).
template <class T, int BN, int D, class SwQ, class SwK>
__device__ __forceinline__ void tile_qk(float (&s)[BN / 8][4], const unsigned short* sQ, const unsigned short* sKs, int warp, int lane) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned a[4];
    ldmatrix_x4(a, sQ + SwQ::off(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8));
#pragma unroll
    for (int nt = 0; nt < BN / 16; ++nt) {
      unsigned bf[4];
      ldmatrix_x4(bf, sKs + SwK::off(nt * 16 + (lane & 7) + (lane >> 4) * 8, kk * 16 + ((lane >> 3) & 1) * 8));
      T::mma(s[2 * nt], a, bf[0], bf[1]);
      T::mma(s[2 * nt + 1], a, bf[2], bf[3]);
    }
  }
}

// Scores in the log2 domain: scale (and softcap, a uniform branch: the common path has no tanh in
// its loop), times log2(e).
template <int BN>
__device__ __forceinline__ void tile_scores_log2(float (&s)[BN / 8][4], const FwdParams& p, float scale_log2) {
  if (p.softcap > 0.f) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = score(s[j][e], p.scale, p.softcap, p.softcap_inv) * kLog2e;
  } else {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] *= scale_log2;
  }
}

// -inf where row r does not see the key: outside its visible interval [lo_r, hi_r) or hidden by
// key_mask (km_bits: bit c = key n0 + c shown). Bit c = j * 8 + h of vis is this thread's element
// (j, 2r + h), key n0 + tig * 2 + c: one bit test per element. For tiles that straddle a bound.
template <int BN>
__device__ __forceinline__ void tile_hide_invisible(float (&s)[BN / 8][4], const int (&lo_r)[2], const int (&hi_r)[2], int n0, int tig,
                                                    unsigned long long km_bits, bool has_km) {
  const unsigned long long km_mine = km_bits >> (tig * 2);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    auto vis = bit_range<BN>(lo_r[r] - n0 - tig * 2, hi_r[r] - n0 - tig * 2);
    if (has_km) vis &= static_cast<decltype(vis)>(km_mine);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (!((vis >> (j * 8 + h)) & 1)) s[j][2 * r + h] = neg_inf();
  }
}

// Whether the tile's V (sVs, BN keys of D columns) holds a non-finite element: one vote of the
// whole block (every thread must call it).
template <class T, int BN, int D, int NT>
__device__ __forceinline__ bool tile_v_nonfinite(const unsigned short* sVs, int tid) {
  int bad = 0;
#pragma unroll 1  // the rare path stays small: it must not crowd the main loop's code or registers
  for (int c = tid; c < BN * D / 8; c += NT) bad |= nonfinite_chunk<T>(reinterpret_cast<const Chunk16*>(sVs)[c]);
  return __syncthreads_or(bad);
}

// NaN in this thread's output columns of row r where a key the row sees (in [lo_r, hi_r), shown
// by key_mask, and with a bias, not hidden_by_bias(r, key)) has a non-finite V element: the
// contract's result there is not finite, and P V on the zeroed tile (tile_v_zero_nonfinite) would
// not show it.
template <class T, int BN, int D, class SwK, class HiddenByBias>
__device__ __forceinline__ void tile_mark_nonfinite_v(float (&acc_o)[D / 8][4], const unsigned short* sVs, const int (&lo_r)[2],
                                                      const int (&hi_r)[2], int n0, int tig, unsigned long long km_bits, bool has_km,
                                                      bool has_bias, HiddenByBias hidden_by_bias) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int lo = imax(lo_r[r], n0), hi = imin(hi_r[r], n0 + BN);
    unsigned long long cols = 0;  // bit 2 dt + h: this thread's column dt * 8 + tig * 2 + h
#pragma unroll 1
    for (int key = lo; key < hi; ++key) {
      if (has_km && !((km_bits >> (key - n0)) & 1)) continue;  // hidden by key_mask
      if (has_bias && hidden_by_bias(r, key)) continue;         // a bias of -inf hides the element
#pragma unroll 1
      for (int c = 0; c < D / 4; ++c)
        if (nonfinite1<T>(sVs[SwK::off(key - n0, (c >> 1) * 8 + tig * 2 + (c & 1))])) cols |= 1ull << c;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      if ((cols >> (2 * dt)) & 1) acc_o[dt][2 * r] = qnan();
      if ((cols >> (2 * dt + 1)) & 1) acc_o[dt][2 * r + 1] = qnan();
    }
  }
}

// The tile's non-finite V elements become +0 for the product; between two barriers: every thread
// has read the tile before, and reads it again only after.
template <class T, int BN, int D, int NT>
__device__ __forceinline__ void tile_v_zero_nonfinite(const unsigned short* sVs, int tid) {
  __syncthreads();
#pragma unroll 1
  for (int c = tid; c < BN * D / 8; c += NT) zero_nonfinite_chunk<T>(reinterpret_cast<Chunk16*>(const_cast<unsigned short*>(sVs))[c]);
  __syncthreads();
}

// Online softmax over the tile. A row's 4 threads (same g) hold its BN values: reduce across the
// quad. s becomes P (exp2 of s minus the running max); the running sum and O are rescaled.
template <int BN, int D>
__device__ __forceinline__ void tile_online_softmax(float (&s)[BN / 8][4], float (&row_max)[2], float (&row_sum)[2], float (&acc_o)[D / 8][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = row_max[r];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // All -inf so far: subtract 0 instead, so exp2 gives 0, never NaN.
    const float base = mx == neg_inf() ? 0.f : mx;
    const float alpha = ex2(row_max[r] - base);
    row_max[r] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      s[j][2 * r] = ex2(s[j][2 * r] - base);
      s[j][2 * r + 1] = ex2(s[j][2 * r + 1] - base);
      sum += s[j][2 * r] + s[j][2 * r + 1];
    }
    row_sum[r] = row_sum[r] * alpha + sum;  // before dropout: the softmax is taken first
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      acc_o[d][2 * r] *= alpha;
      acc_o[d][2 * r + 1] *= alpha;
    }
  }
}

// O += P V. The S accumulator layout of two n8 tiles is exactly the A fragment of one k16 step.
template <class T, int BN, int D, class SwK>
__device__ __forceinline__ void tile_pv(float (&acc_o)[D / 8][4], const float (&s)[BN / 8][4], const unsigned short* sVs, int lane) {
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    unsigned a[4];
    a[0] = T::pack2(s[2 * kk][0], s[2 * kk][1]);
    a[1] = T::pack2(s[2 * kk][2], s[2 * kk][3]);
    a[2] = T::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    a[3] = T::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      unsigned bf[4];
      ldmatrix_x4_trans(bf, sVs + SwK::off(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dt * 16 + (lane >> 4) * 8));
      T::mma(acc_o[2 * dt], a, bf[0], bf[1]);
      T::mma(acc_o[2 * dt + 1], a, bf[2], bf[3]);
    }
  }
}

}  // namespace exla_rs
