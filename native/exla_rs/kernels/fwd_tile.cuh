// One key tile of the mma.sync forward's main loop, the pieces flash_fwd.cuh and
// flash_fwd_split.cuh share: S = Q K^T, the log2-domain scores, the interval and key_mask test,
// the non-finite-V guard, the online softmax and O += P V. The two kernels differ only in where a
// thread's rows come from (a query block of one head, or packed rows of a GQA group) and in what
// they do around these steps (bias and ALiBi per row, dropout, warps with no real row), so each
// step takes the rows' data as arguments. All of it is inlined (when the steps moved here from
// the two kernels, every image's SASS stayed what it was but for the masked sets' rare
// non-finite-V path, +-8 instructions: 2026-11-27).
//
// A warp's rows are MF m16n8k16 A fragments of 16 rows (MF = 2 in flash_fwd up to D = 64, so each
// K/V fragment from ldmatrix feeds 2 MF mma; 1 in the split kernel and above D = 64). In fragment
// mf the thread holds rows g and g + 8 (g = lane / 4) and, of each n8 column tile j, columns
// tig * 2 and tig * 2 + 1 (tig = lane % 4): s[mf][j][2 r + h] is row 16 mf + 8 r's element of key
// n0 + j * 8 + tig * 2 + h, acc_o[mf][dt][2 r + h] its output column dt * 8 + tig * 2 + h. Per-row
// state (running max and sum, visible interval) is indexed rr = 2 mf + r.
//
// Shared memory is addressed with 32-bit shared-window addresses computed once per thread
// (SwzAddr): inside the key loop every ldmatrix address is the thread's base, XORed with a
// compile-time chunk constant and plus a compile-time offset, so the loop holds no address
// arithmetic but one add per stage.
#pragma once

#include "common.cuh"

namespace exla_rs {

// The thread's ldmatrix bases (before the tile's shared address is added): Q (A operand, row-major:
// lanes 0-15 rows, lanes 16-31 the upper 8 columns), K (B operand of Q K^T: matrices 0/1 keys 0-7 at
// k 0/8, 2/3 keys 8-15) and V (B operand of P V, transposed: matrices 0/1 keys 0-7/8-15 at column 0,
// 2/3 at column 8).
template <int ROWS, int D>
EXLA_RS_DEVICE unsigned q_ld_off(int row0, int lane) {
  return SwzAddr<ROWS, D>::thread_off(row0 + (lane & 15), (lane >> 4) * 8);
}
template <int BN, int D>
EXLA_RS_DEVICE unsigned k_ld_off(int lane) {
  return SwzAddr<BN, D>::thread_off((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
}
template <int BN, int D>
EXLA_RS_DEVICE unsigned v_ld_off(int lane) {
  return SwzAddr<BN, D>::thread_off((lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8);
}

// The interior key loop's tile copy where RowCopy does not fit (the chunks of a row do not divide
// the threads: D = 96, 192): thread tid copies chunks tid + i NT, a compile-time count, so each
// chunk's destination and source offset are functions of tid alone that the compiler keeps out of
// the loop; every row real. g: the tile's first row.
template <int ROWS, int D, int NT>
struct ChunkCopy {
  static constexpr int kPer = ROWS * (D / 8) / NT;
  static_assert(ROWS * (D / 8) % NT == 0, "ChunkCopy: the chunks do not divide the threads");
  static EXLA_RS_DEVICE void copy(unsigned s, const unsigned short* g, long long row_stride, int tid) {
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const TileChunk t = tile_chunk<ROWS, D>(tid + i * NT);
      cp_async16_s(s + 2u * (unsigned)Swz<ROWS, D>::off(t.row, t.col), g + (long long)t.row * row_stride + t.col, 16);
    }
  }
};

// s += the warp's 16 MF rows of Q times the tile's BN keys: q_ld, k_ld are the thread's ldmatrix
// addresses (tile + q_ld_off / k_ld_off). Each K fragment feeds 2 MF mma.
// NK: the keys of the step (the tile's BN or a part of it; k_ld then points at the part's first key).
template <class T, int MF, int BM, int BN, int D, int NK = BN>
__device__ __forceinline__ void tile_qk(float (&s)[MF][NK / 8][4], unsigned q_ld, unsigned k_ld) {
  using AQ = SwzAddr<BM, D>;
  using AK = SwzAddr<BN, D>;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    unsigned a[MF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) ldsm_x4(a[mf], AQ::at(q_ld, 16 * mf, kk * 16));
#pragma unroll
    for (int nt = 0; nt < NK / 16; ++nt) {
      unsigned bf[4];
      ldsm_x4(bf, AK::at(k_ld, nt * 16, kk * 16));
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        T::mma(s[mf][2 * nt], a[mf], bf[0], bf[1]);
        T::mma(s[mf][2 * nt + 1], a[mf], bf[2], bf[3]);
      }
    }
  }
}

// Scores in the log2 domain: scale (and softcap, a uniform branch), times log2(e). The general
// loop's step: the interior loop folds the scale into its exp2 (tile_online_softmax<..., true>).
template <int MF, int BN>
__device__ __forceinline__ void tile_scores_log2(float (&s)[MF][BN / 8][4], const FwdParams& p, float scale_log2) {
  if (p.softcap > 0.f) {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mf][j][e] = score(s[mf][j][e], p.scale, p.softcap, p.softcap_inv) * kLog2e;
  } else {
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mf][j][e] *= scale_log2;
  }
}

// -inf where row rr does not see the key: outside its visible interval [lo_r, hi_r) or hidden by
// key_mask (km_bits: bit c = key n0 + c shown). Bit c = j * 8 + h of vis is this thread's element
// (j, 2r + h), key n0 + tig * 2 + c: one bit test per element. For tiles that straddle a bound.
template <int MF, int BN>
__device__ __forceinline__ void tile_hide_invisible(float (&s)[MF][BN / 8][4], const int (&lo_r)[2 * MF], const int (&hi_r)[2 * MF], int n0,
                                                    int tig, unsigned long long km_bits, bool has_km) {
  const unsigned long long km_mine = km_bits >> (tig * 2);
#pragma unroll
  for (int rr = 0; rr < 2 * MF; ++rr) {
    const int mf = rr >> 1, r = rr & 1;
    auto vis = bit_range<BN>(lo_r[rr] - n0 - tig * 2, hi_r[rr] - n0 - tig * 2);
    if (has_km) vis &= static_cast<decltype(vis)>(km_mine);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (!((vis >> (j * 8 + h)) & 1)) s[mf][j][2 * r + h] = neg_inf();
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

// NaN in this thread's output columns of row rr where a key the row sees (in [lo_r, hi_r), shown
// by key_mask, and with a bias, not hidden_by_bias(rr, key)) has a non-finite V element: the
// contract's result there is not finite, and P V on the zeroed tile (tile_v_zero_nonfinite) would
// not show it.
template <class T, int MF, int BN, int D, class SwK, class HiddenByBias>
__device__ __forceinline__ void tile_mark_nonfinite_v(float (&acc_o)[MF][D / 8][4], const unsigned short* sVs, const int (&lo_r)[2 * MF],
                                                      const int (&hi_r)[2 * MF], int n0, int tig, unsigned long long km_bits, bool has_km,
                                                      bool has_bias, HiddenByBias hidden_by_bias) {
#pragma unroll
  for (int rr = 0; rr < 2 * MF; ++rr) {
    const int mf = rr >> 1, r = rr & 1;
    const int lo = imax(lo_r[rr], n0), hi = imin(hi_r[rr], n0 + BN);
    unsigned long long cols = 0;  // bit 2 dt + h: this thread's column dt * 8 + tig * 2 + h
#pragma unroll 1
    for (int key = lo; key < hi; ++key) {
      if (has_km && !((km_bits >> (key - n0)) & 1)) continue;  // hidden by key_mask
      if (has_bias && hidden_by_bias(rr, key)) continue;        // a bias of -inf hides the element
#pragma unroll 1
      for (int c = 0; c < D / 4; ++c)
        if (nonfinite1<T>(sVs[SwK::off(key - n0, (c >> 1) * 8 + tig * 2 + (c & 1))])) cols |= 1ull << c;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      if ((cols >> (2 * dt)) & 1) acc_o[mf][dt][2 * r] = qnan();
      if ((cols >> (2 * dt + 1)) & 1) acc_o[mf][dt][2 * r + 1] = qnan();
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
// kRaw: s holds the raw dot products (the interior loop, scale > 0): the max is taken on them and
// the scale folds into the exp2's FFMA, exp2(s * scale_log2 - max * scale_log2), one instruction
// per element less (max commutes with a positive scale, rounding included). Otherwise s is already
// in the log2 domain (scale_log2 unused).
template <int MF, int BN, int D, bool kRaw>
__device__ __forceinline__ void tile_online_softmax(float (&s)[MF][BN / 8][4], float (&row_max)[2 * MF], float (&row_sum)[2 * MF],
                                                    float (&acc_o)[MF][D / 8][4], float scale_log2) {
#pragma unroll
  for (int rr = 0; rr < 2 * MF; ++rr) {
    const int mf = rr >> 1, r = rr & 1;
    float mx = kRaw ? neg_inf() : row_max[rr];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[mf][j][2 * r], s[mf][j][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (kRaw) mx = fmaxf(row_max[rr], mx * scale_log2);
    // All -inf so far: subtract 0 instead, so exp2 gives 0, never NaN.
    const float base = mx == neg_inf() ? 0.f : mx;
    const float alpha = ex2(row_max[rr] - base);
    row_max[rr] = mx;
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float& e = s[mf][j][2 * r + h];
        e = kRaw ? ex2(fmaf(e, scale_log2, -base)) : ex2(e - base);
        sum += e;
      }
    }
    row_sum[rr] = row_sum[rr] * alpha + sum;  // before dropout: the softmax is taken first
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      acc_o[mf][d][2 * r] *= alpha;
      acc_o[mf][d][2 * r + 1] *= alpha;
    }
  }
}

// O += P V. The S accumulator layout of two n8 tiles is exactly the A fragment of one k16 step;
// each V fragment feeds 2 MF mma. v_ld: tile + v_ld_off (+ the first key's rows for a part of NK).
template <class T, int MF, int BN, int D, int NK = BN>
__device__ __forceinline__ void tile_pv(float (&acc_o)[MF][D / 8][4], const float (&s)[MF][NK / 8][4], unsigned v_ld) {
  using AV = SwzAddr<BN, D>;
#pragma unroll
  for (int kk = 0; kk < NK / 16; ++kk) {
    unsigned a[MF][4];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
      a[mf][0] = T::pack2(s[mf][2 * kk][0], s[mf][2 * kk][1]);
      a[mf][1] = T::pack2(s[mf][2 * kk][2], s[mf][2 * kk][3]);
      a[mf][2] = T::pack2(s[mf][2 * kk + 1][0], s[mf][2 * kk + 1][1]);
      a[mf][3] = T::pack2(s[mf][2 * kk + 1][2], s[mf][2 * kk + 1][3]);
    }
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      unsigned bf[4];
      ldsm_x4_trans(bf, AV::at(v_ld, kk * 16, dt * 16));
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        T::mma(acc_o[mf][2 * dt], a[mf], bf[0], bf[1]);
        T::mma(acc_o[mf][2 * dt + 1], a[mf], bf[2], bf[3]);
      }
    }
  }
}

}  // namespace exla_rs
