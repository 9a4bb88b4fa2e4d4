// Split-KV forward for decode (issue 34), f16/bf16 on tensor cores, and the combine pass.
//
// The FA2 forward spreads work over (query block, head, batch): a decode call (Sq = 1, a few query
// rows) fills a handful of CTAs, and each walks the whole KV cache alone, once per query head of a
// GQA group. Here a CTA owns
//   - every query head of one KV head's GQA group and every query row: "packed" rows
//     r = i * g + hh (query row i, head hk * g + hh, g = H / Hkv), kBlockM of them per CTA
//     (more than kBlockM packed rows: several row blocks), so each K/V byte is read once per call;
//   - one split: a contiguous share of the key tiles the row block sees (that batch row's visible
//     range, by kv_len, windows and q_start, divided evenly between the splits).
// Grid (row_blocks * num_splits, Hkv, B). With one split the kernel writes O (in its dtype) and LSE
// itself; with more it writes each split's normalised partial o and its lse in f32 to the
// workspace, and flash_fwd_combine (one warp per (b, h, i) row) merges them:
//   lse = log sum_s exp(lse_s),  o = sum_s exp(lse_s - lse) o_s
// (a split that sees no key of a row has lse_s = -inf and weight 0, its o_s is not read). The main
// loop is flash_fwd's (cp.async double buffering, key_mask tile skipping, and one tile's steps from
// fwd_tile.cuh: mma.sync, the exp2-domain online softmax, the interval masks, the non-finite-V
// guard), with bias and ALiBi per packed row; the packed rows only change where a row's query,
// head, mask interval, bias and output live. Warps
// whose 16 rows are all padding (g * Sq < kBlockM, the decode case) load tiles but skip the math.
// Dropout is not compiled here (the launcher runs dropout calls on the non-split forward).
#pragma once

#include "common.cuh"
#include "extras.cuh"
#include "fwd_tile.cuh"

namespace exla_rs {

// Tiles of the split kernel. Mirrored in crates/exla-rs-cuda/src/split.rs: change both.
template <int D>
struct SplitTraits {
  static constexpr int kWarps = 4;
  static constexpr int kBlockM = 16 * kWarps;  // packed (query row, group head) rows
  static constexpr int kBlockN = D <= 128 ? 64 : 32;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSmemBytes = (kBlockM * D + 4 * kBlockN * D) * 2;
  static_assert(D % 32 == 0 && D <= 256, "head dim");
};

// The combine pass: one warp per output row.
struct CombineTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
};

// Two floats for one 8-byte store (float2 needs vector_types.h, which NVRTC may lack).
struct __align__(8) Float2 {
  float x, y;
};

// Q rows of packed rows [m0, m0 + ROWS) into a swizzled tile: packed row r is query row r / g of
// head hk * g + r % g, at gQ + (r / g) * q_row_stride + (r % g) * D. Rows >= rows become zeros.
// Once per CTA, so the divisions do not matter.
template <int ROWS, int D, int NT>
EXLA_RS_DEVICE void load_q_packed(unsigned short* s, const unsigned short* gQ, int m0, int rows, int grp,
                                  long long q_row_stride, int tid) {
  constexpr int kChunks = D / 8;
  for (int c = tid; c < ROWS * kChunks; c += NT) {
    const TileChunk t = tile_chunk<ROWS, D>(c);
    const int r = m0 + t.row;
    const bool ok = r < rows;
    const unsigned short* src = ok ? gQ + (long long)(r / grp) * q_row_stride + (long long)(r % grp) * D + t.col : gQ;
    cp_async16(s + Swz<ROWS, D>::off(t.row, t.col), src, ok ? 16 : 0);
  }
}

// z += bias * log2(e) for this thread's two packed rows (query row i_r, head h_r each; ok_r false
// for padding rows, whose bias is not read) and the keys of one tile below kv_end.
template <int BN, class BT>
EXLA_RS_DEVICE void add_bias_rows(float (&s)[BN / 8][4], const ExtraParams& x, int b, const int (&h_r)[2], const int (&i_r)[2],
                                  const bool (&ok_r)[2], int n0, int tig, int kv_end) {
  const int k_lim = kv_end - n0 - tig * 2;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!ok_r[r]) continue;
    const long long base = bias_offset(x, b, h_r[r], i_r[r], n0 + tig * 2);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (j * 8 + hh < k_lim) s[j][2 * r + hh] += BT::load(x.bias, base + (j * 8 + hh) * x.bias_stride_k) * kLog2e;
  }
}

// F: kFeatMasks or 0 (no dropout here).
template <class T, int D, int F>
__device__ __forceinline__ void flash_fwd_split(const SplitParams& sp) {
  static_assert(!(F & kFeatDropout), "dropout calls run the non-split forward");
  constexpr bool kMasks = F & kFeatMasks;
  using Tr = SplitTraits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NT = Tr::kThreads;
  using SwQ = Swz<BM, D>;
  using SwK = Swz<BN, D>;
  if (blockDim.x != NT) __trap();  // the launcher's table disagrees with this file
  const FwdParams& p = sp.f;

  EXLA_RS_DYNAMIC_SMEM(smem_raw, 128);
  unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);
  unsigned short* sK = sQ + BM * D;      // [2][BN * D]
  unsigned short* sV = sK + 2 * BN * D;  // [2][BN * D]
  // The thread's ldmatrix addresses (32-bit shared window, stage 0; fwd_tile.cuh).
  const unsigned sQa = smem_u32(smem_raw), sKa = sQa + BM * D * 2, sVa = sKa + 4 * BN * D;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int split = blockIdx.x % sp.num_splits, mb = blockIdx.x / sp.num_splits;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int grp = p.heads / p.kv_heads;
  const int rows = grp * p.seq_q;  // packed rows of this (kv head, batch row)
  const int m0 = mb * BM, m_end = imin(m0 + BM, rows);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);

  const long long q_row_stride = (long long)p.heads * D, kv_stride = (long long)p.kv_heads * D;
  const long long q_off = ((long long)b * p.seq_q * p.heads + (long long)hk * grp) * D;
  const unsigned short* gQ = static_cast<const unsigned short*>(p.q) + q_off;
  const unsigned short* gK = static_cast<const unsigned short*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const unsigned short* gV = static_cast<const unsigned short*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;

  // The query rows of this block, [i_lo, i_hi), their key tiles, and this split's share of them.
  const int i_lo = m0 / grp, i_hi = m0 < m_end ? (m_end - 1) / grp + 1 : i_lo;
  int k_lo, k_hi;
  mask.rows_keys(i_lo, i_hi, k_lo, k_hi);
  const int n_first = k_lo / BN, n_vis = (k_hi + BN - 1) / BN - n_first;
  const int n_begin = n_first + (int)((long long)split * n_vis / sp.num_splits);
  const int n_last = n_first + (int)((long long)(split + 1) * n_vis / sp.num_splits);

  const ExtraParams& x = p.x;
  const bool has_km = kMasks && x.key_mask != nullptr;
  const bool has_bias = kMasks && x.bias != nullptr;
  const long long km_row = (long long)b * p.seq_k;
  constexpr unsigned long long kAllKeys = ~0ull >> (64 - BN);
  auto next_tile = [&](int n, unsigned long long& bits) {
    bits = kAllKeys;
    if (has_km)
      for (; n < n_last; ++n)
        if ((bits = key_mask_tile_bits<BN>(x, km_row, n * BN, p.seq_k, lane)) != 0) break;
    return n;
  };
  unsigned long long km_bits;
  const int n_start = next_tile(n_begin, km_bits);

  // This thread's packed rows row_a, row_a + 8: query row, head, interval; padding rows (>= rows)
  // compute on zero queries and are never stored.
  const int row_a = m0 + warp * 16 + g;
  int i_r[2], h_r[2], lo_r[2], hi_r[2];
  bool ok_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int pr = row_a + 8 * r;
    i_r[r] = pr / grp;
    h_r[r] = hk * grp + pr % grp;
    ok_r[r] = pr < rows;
    mask.row_keys(i_r[r], lo_r[r], hi_r[r]);
  }
  const bool active = m0 + warp * 16 < rows;  // warp-uniform: this warp has a real row
  float slope_l2[2] = {0.f, 0.f};
  const bool has_alibi = kMasks && x.alibi_slopes != nullptr;
  if (has_alibi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) slope_l2[r] = -x.alibi_slopes[h_r[r]] * kLog2e;
  }

  float acc_o[1][D / 8][4];  // one m16 fragment per warp (fwd_tile.cuh's MF = 1)
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[0][i][0] = acc_o[0][i][1] = acc_o[0][i][2] = acc_o[0][i][3] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()};
  float row_sum[2] = {0.f, 0.f};

  if (n_start < n_last) {
    load_q_packed<BM, D, NT>(sQ, gQ, m0, rows, grp, q_row_stride, tid);
    load_tile_async<BN, D, NT>(sK, gK, n_start * BN, mask.kv_end, kv_stride, tid);
    load_tile_async<BN, D, NT>(sV, gV, n_start * BN, mask.kv_end, kv_stride, tid);
    cp_async_commit();
  }
  const float scale_log2 = p.scale * kLog2e;
  const unsigned q_ld = sQa + q_ld_off<BM, D>(warp * 16, lane);
  const unsigned k_ld = sKa + k_ld_off<BN, D>(lane), v_ld = sVa + v_ld_off<BN, D>(lane);

  for (int n = n_start, it = 0; n < n_last; ++it) {
    const int stage = it & 1;
    unsigned long long km_bits_next;
    const int n_next = next_tile(n + 1, km_bits_next);
    if (n_next < n_last) {
      load_tile_async<BN, D, NT>(sK + (stage ^ 1) * BN * D, gK, n_next * BN, mask.kv_end, kv_stride, tid);
      load_tile_async<BN, D, NT>(sV + (stage ^ 1) * BN * D, gV, n_next * BN, mask.kv_end, kv_stride, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const unsigned short* sVs = sV + stage * BN * D;
    const int n0 = n * BN;
    const bool full = mask.tile_full(i_lo, i_hi, n0, n0 + BN) && (!has_km || km_bits == kAllKeys);

    float s[1][BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[0][i][0] = s[0][i][1] = s[0][i][2] = s[0][i][3] = 0.f;
    if (active) {
      // S = Q K^T for this warp's 16 packed rows.
      tile_qk<T, 1, BM, BN, D>(s, q_ld, k_ld + stage * BN * D * 2);
      tile_scores_log2<1, BN>(s, p, scale_log2);
      if (has_bias) {
        if (x.bias_dtype == 0)
          add_bias_rows<BN, BiasF32>(s[0], x, b, h_r, i_r, ok_r, n0, tig, mask.kv_end);
        else if (x.bias_dtype == 1)
          add_bias_rows<BN, BiasF16>(s[0], x, b, h_r, i_r, ok_r, n0, tig, mask.kv_end);
        else
          add_bias_rows<BN, BiasBF16>(s[0], x, b, h_r, i_r, ok_r, n0, tig, mask.kv_end);
      }
      if (has_alibi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int rel = alibi_rel(mask.q_start + i_r[r], n0 + tig * 2);
#pragma unroll
          for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) s[0][j][2 * r + hh] += slope_l2[r] * alibi_dist(rel - (j * 8 + hh));
        }
      }
      if (!full) tile_hide_invisible<1, BN>(s, lo_r, hi_r, n0, tig, km_bits, has_km);
    }

    // Non-finite V on a tile some rows must not see (flash_fwd.cuh explains): every thread votes.
    if ((!full || has_bias) && tile_v_nonfinite<T, BN, D, NT>(sVs, tid)) {
      if (active)
        tile_mark_nonfinite_v<T, 1, BN, D, SwK>(acc_o, sVs, lo_r, hi_r, n0, tig, km_bits, has_km, has_bias, [&](int r, int key) {
          return ok_r[r] && bias_load(x.bias, x.bias_dtype, bias_offset(x, b, h_r[r], i_r[r], key)) == neg_inf();
        });
      tile_v_zero_nonfinite<T, BN, D, NT>(sVs, tid);
    }

    if (active) {
      tile_online_softmax<1, BN, D, false>(s, row_max, row_sum, acc_o, scale_log2);
      tile_pv<T, 1, BN, D>(acc_o, s, v_ld + stage * BN * D * 2);
    }
    __syncthreads();  // this stage is reloaded by the next iteration's prefetch
    n = n_next;
    km_bits = km_bits_next;
  }

  // Epilogue: o / l and lse (natural log) of this split; rows that saw no key: o = 0, lse = -inf.
  float inv[2], lse[2];
  bool l_nan[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = l > 0.f ? 1.f / l : 0.f;
    lse[r] = l > 0.f ? (row_max[r] + lg2(l)) * kLn2 : neg_inf();
    l_nan[r] = l != l;
  }
  if (sp.num_splits == 1) {
    // The result itself: lse [B, H, Sq], O [B, Sq, H, D] staged through the warp's own rows of sQ.
    if (tig == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (ok_r[r]) p.lse[((long long)b * p.heads + h_r[r]) * p.seq_q + i_r[r]] = lse[r];
    }
    unsigned short* sO = sQ;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int col = dt * 8 + tig * 2, ra = warp * 16 + g;
      *reinterpret_cast<unsigned*>(sO + SwQ::off(ra, col)) = T::pack2(acc_o[0][dt][0] * inv[0], acc_o[0][dt][1] * inv[0]);
      *reinterpret_cast<unsigned*>(sO + SwQ::off(ra + 8, col)) = T::pack2(acc_o[0][dt][2] * inv[1], acc_o[0][dt][3] * inv[1]);
    }
    __syncwarp();
    unsigned short* gO = static_cast<unsigned short*>(p.o) + q_off;
    constexpr int kChunks = D / 8;
    for (int c = lane; c < 16 * kChunks; c += 32) {
      const int r = c / kChunks, col = (c % kChunks) * 8;
      const int pr = m0 + warp * 16 + r;
      if (pr < rows)
        *reinterpret_cast<Chunk16*>(gO + (long long)(pr / grp) * q_row_stride + (long long)(pr % grp) * D + col) =
            *reinterpret_cast<const Chunk16*>(sO + SwQ::off(warp * 16 + r, col));
    }
  } else {
    // Partials, split-major: row (split, b, h, i) of o_part [S, B, H, Sq, D] and lse_part [S, B, H, Sq].
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!ok_r[r]) continue;
      const long long prow = (((long long)split * p.batch + b) * p.heads + h_r[r]) * p.seq_q + i_r[r];
      // A NaN row sum (a NaN score: a visible key's K holds one) must not read as "no key" (-inf)
      // to the combine pass, which would drop the split: NaN keeps the row NaN.
      if (tig == 0) sp.lse_part[prow] = l_nan[r] ? qnan() : lse[r];
      float* dst = sp.o_part + prow * D + tig * 2;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        Float2 v;
        v.x = acc_o[0][dt][2 * r] * inv[r];
        v.y = acc_o[0][dt][2 * r + 1] * inv[r];
        *reinterpret_cast<Float2*>(dst + dt * 8) = v;
      }
    }
  }
}

// max that keeps a NaN (fmaxf drops it): a NaN lse_s (a NaN score) makes the row NaN, as the
// non-split forward's running max does.
EXLA_RS_DEVICE float max_nan(float a, float b) { return (a != a || b != b) ? qnan() : fmaxf(a, b); }

// Merges the splits' partials: grid (ceil(B * H * Sq / kWarps)), one warp per row (b, h, i) in the
// lse order; lane l holds columns l, l + 32, ... A split with lse_s = -inf (it saw no key of the
// row) has weight 0 and its o_s is not read; all -inf: o = 0, lse = -inf. A NaN in some o_s (a
// non-finite V value the row sees) propagates, as in the non-split forward.
template <class T, int D>
__device__ __forceinline__ void flash_fwd_combine(const SplitParams& sp) {
  using S = typename T::Storage;
  constexpr int E = D / 32;
  const FwdParams& p = sp.f;
  const int lane = threadIdx.x & 31;
  const long long n_rows = (long long)p.batch * p.heads * p.seq_q;
  const long long row = (long long)blockIdx.x * CombineTraits::kWarps + (threadIdx.x >> 5);
  if (row >= n_rows) return;
  const int ns = sp.num_splits;
  float mx = neg_inf();
  for (int s = lane; s < ns; s += 32) mx = max_nan(mx, sp.lse_part[s * n_rows + row]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float o[E];
#pragma unroll
  for (int e = 0; e < E; ++e) o[e] = 0.f;
  float lse = neg_inf();
  if (mx != neg_inf()) {
    float sum = 0.f;
    for (int s = lane; s < ns; s += 32) {
      const float l = sp.lse_part[s * n_rows + row];
      if (l != neg_inf()) sum += ex2((l - mx) * kLog2e);
    }
    sum = warp_sum(sum);  // >= 1: the max term is exp(0)
    lse = mx + lg2(sum) * kLn2;
    for (int s = 0; s < ns; ++s) {
      const float l = sp.lse_part[s * n_rows + row];
      if (l == neg_inf()) continue;
      const float w = ex2((l - lse) * kLog2e);
      const float* src = sp.o_part + (s * n_rows + row) * D;
#pragma unroll
      for (int e = 0; e < E; ++e) o[e] += w * src[lane + 32 * e];
    }
  }
  const long long bh = row / p.seq_q;
  const int i = (int)(row % p.seq_q), h = (int)(bh % p.heads), b = (int)(bh / p.heads);
  S* out = static_cast<S*>(p.o) + (((long long)b * p.seq_q + i) * p.heads + h) * D;
#pragma unroll
  for (int e = 0; e < E; ++e) out[lane + 32 * e] = T::from_float(o[e]);
  if (lane == 0) p.lse[row] = lse;
}

}  // namespace exla_rs
