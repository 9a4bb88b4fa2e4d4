// Forward flash attention on tensor cores (f16, bf16): mma.sync m16n8k16 with f32 accumulation,
// ldmatrix from swizzled shared memory, cp.async double buffering of K/V tiles, online softmax in
// the exp2 domain. The FA2 work split: one block per (query tile, head, batch), each warp owns 16
// query rows and sweeps all visible key tiles, so no inter-warp reduction is ever needed.
#pragma once

#include "common.cuh"
#include "extras.cuh"
#include "fwd_tile.cuh"

namespace exla_rs {

// Tile shapes per head dim. Shared memory = Q tile + 2 stages of (K, V) tiles, kept <= 96 KiB so
// every instantiation also runs on sm_86/sm_89 (99 KiB per block). Mirrored in the Rust launcher
// (crates/exla-rs-cuda/src/config.rs): change both.
template <int D>
struct FwdTraits {
  static constexpr int kWarps = D <= 192 ? 8 : 4;
  static constexpr int kBlockM = 16 * kWarps;
  static constexpr int kBlockN = D <= 128 ? 64 : 32;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSmemBytes = (kBlockM * D + 4 * kBlockN * D) * 2;
  static_assert(D % 32 == 0 && D <= 256, "head dim");
};

// z += (bias + alibi) * log2(e) for this thread's fragment of one key tile, in the exp2 domain the
// scores live in (so after scale and softcap, as the contract orders it). Element (j, 2r + hh) is
// row row_a + 8r, key n0 + j*8 + tig*2 + hh. Keys past kv_end are hidden and may lie past Sk: their
// bias is not read; rows past Sq are never stored: theirs neither.
template <int BN, class BT>
EXLA_RS_DEVICE void add_bias_tile(float (&s)[BN / 8][4], const FwdParams& p, int b, int h, int row_a, int n0, int tig,
                                  int kv_end) {
  const ExtraParams& x = p.x;
  const int k_lim = kv_end - n0 - tig * 2;  // element offsets j*8 + hh below this are readable keys
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row_a + 8 * r;
    if (row >= p.seq_q) continue;
    const long long base = bias_offset(x, b, h, row, n0 + tig * 2);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        if (j * 8 + hh < k_lim) s[j][2 * r + hh] += BT::load(x.bias, base + (j * 8 + hh) * x.bias_stride_k) * kLog2e;
  }
}
template <int BN>
EXLA_RS_DEVICE void add_alibi_tile(float (&s)[BN / 8][4], float slope_l2, long long pos_a, int n0, int tig) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // Distance of this row to the thread's first key of the tile; elements differ by compile-time offsets.
    const int rel = alibi_rel(pos_a + 8 * r, n0 + tig * 2);
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) s[j][2 * r + hh] += slope_l2 * alibi_dist(rel - (j * 8 + hh));
  }
}

// Dropout on this thread's P fragment of one key tile: P <- P * M (the 1 / (1 - rate) is applied in
// the epilogue). Element (j, 2r + hh) is row row_a + 8r, key n0 + 8j + 2tig + hh: the upper halves of
// n-tile j of one row are exactly one x call (counter (n0 / 8 + j, row, h, b)), and this thread's two
// keys are the two halves of its word tig. So per pair of n-tiles the quad needs 4 calls (2 rows x 2
// n-tiles): lane tig computes call c = tig (n-tile 2jp + (c >> 1), row row_a + 8 (c & 1)), and a 4 x 4
// transpose across the quad hands every lane word tig of each: 1 Philox call per 8 elements (and y
// only where an upper half ties with the threshold's). The keep bits (bit 4j + e) are found in a
// rolled loop, one copy of the rounds, then applied with constant fragment indices.
template <int BN>
EXLA_RS_DEVICE void dropout_tile(float (&s)[BN / 8][4], const Dropout& dr, int b, int h, int row_a, int n0, int tig) {
  constexpr int NJ = BN / 8;
  static_assert(NJ <= 8, "4 keep bits per n-tile in one u32");
  const unsigned oct0 = (unsigned)n0 >> 3;  // n0 is a multiple of BN
  unsigned bits = 0;
#pragma unroll 1
  for (int jp = 0; jp < (NJ + 1) / 2; ++jp) {
    // With NJ odd, the last pair's calls of n-tile NJ are computed and their bits (4 NJ .. 4 NJ + 3,
    // inside the u32 for NJ <= 7) never read.
    const Philox4 r = dropout_x(dr.k0, dr.k1, (unsigned)b, (unsigned)h, (unsigned)(row_a + 8 * (tig & 1)),
                                oct0 + (unsigned)(2 * jp + (tig >> 1)));
    unsigned a[4] = {r.x[0], r.x[1], r.x[2], r.x[3]};
    transpose4_lanes<1>(a, tig);
    bits |= dr.keep8(a, tig, oct0 + 2 * jp, (unsigned)row_a, 8u, (unsigned)b, (unsigned)h) << (8 * jp);
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!((bits >> (4 * j + e)) & 1u)) s[j][e] = 0.f;
}

// F: the feature set (kFeatMasks | kFeatDropout bits, extras.cuh); a clear bit compiles its
// feature out.
template <class T, int D, int F>
__device__ __forceinline__ void flash_fwd(const FwdParams& p) {
  constexpr bool kMasks = F & kFeatMasks, kDrop = F & kFeatDropout;
  using Tr = FwdTraits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NT = Tr::kThreads;
  using SwQ = Swz<BM, D>;
  using SwK = Swz<BN, D>;
  if (blockDim.x != NT) __trap();  // the launcher's table disagrees with this file

  EXLA_RS_DYNAMIC_SMEM(smem_raw, 128);
  unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);
  unsigned short* sK = sQ + BM * D;       // [2][BN * D]
  unsigned short* sV = sK + 2 * BN * D;   // [2][BN * D]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;  // mma fragment row group / thread in group
  const int m0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.heads / p.kv_heads);
  const int m_end = imin(m0 + BM, p.seq_q);
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);

  const long long q_stride = (long long)p.heads * D, kv_stride = (long long)p.kv_heads * D;
  const unsigned short* gQ = static_cast<const unsigned short*>(p.q) + ((long long)b * p.seq_q * p.heads + h) * D;
  const unsigned short* gK = static_cast<const unsigned short*>(p.k) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const unsigned short* gV = static_cast<const unsigned short*>(p.v) + ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  unsigned short* gO = static_cast<unsigned short*>(p.o) + ((long long)b * p.seq_q * p.heads + h) * D;
  float* gL = p.lse + ((long long)b * p.heads + h) * p.seq_q;

  int k_lo, k_hi;
  mask.rows_keys(m0, m_end, k_lo, k_hi);
  const int n_first = k_lo / BN, n_last = (k_hi + BN - 1) / BN;  // tiles [n_first, n_last)

  // Optional features (null pointer = absent; every test below is uniform across the block, and
  // constant false where the set compiles the feature out).
  const ExtraParams& x = p.x;
  const bool has_km = kMasks && x.key_mask != nullptr;
  const bool has_bias = kMasks && x.bias != nullptr;
  const bool has_drop = kDrop && x.dropout_key != nullptr;
  const long long km_row = (long long)b * p.seq_k;
  // The next tile from n on that key_mask does not hide entirely (n_last if none), and its mask
  // bits (the tile's BN bits all set without key_mask). A hidden tile is never loaded.
  constexpr unsigned long long kAllKeys = ~0ull >> (64 - BN);
  auto next_tile = [&](int n, unsigned long long& bits) {
    bits = kAllKeys;
    if (has_km)
      for (; n < n_last; ++n)
        if ((bits = key_mask_tile_bits<BN>(x, km_row, n * BN, p.seq_k, lane)) != 0) break;
    return n;
  };
  unsigned long long km_bits;
  const int n_start = next_tile(n_first, km_bits);

  // Per thread: rows r = warp*16 + g (+8); O accumulators for D/8 column tiles of 8.
  float acc_o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  float row_max[2] = {neg_inf(), neg_inf()};  // running max of s * log2(e)
  float row_sum[2] = {0.f, 0.f};              // this thread's share of the running sum

  if (n_start < n_last) {
    load_tile_async<BM, D, NT>(sQ, gQ, m0, p.seq_q, q_stride, tid);
    load_tile_async<BN, D, NT>(sK, gK, n_start * BN, mask.kv_end, kv_stride, tid);
    load_tile_async<BN, D, NT>(sV, gV, n_start * BN, mask.kv_end, kv_stride, tid);
    cp_async_commit();
  }
  const float scale_log2 = p.scale * kLog2e;
  const int row_a = m0 + warp * 16 + g;  // this thread's two query rows: row_a, row_a + 8
  // Their visible keys, one interval each, found once: a straddling tile then tests each element
  // with one bit of a tile-relative mask of it (bit_range) instead of the 64-bit window predicate.
  int lo_r[2], hi_r[2];
  mask.row_keys(row_a, lo_r[0], hi_r[0]);
  mask.row_keys(row_a + 8, lo_r[1], hi_r[1]);

  for (int n = n_start, it = 0; n < n_last; ++it) {
    const int stage = it & 1;
    unsigned long long km_bits_next;
    const int n_next = next_tile(n + 1, km_bits_next);
    if (n_next < n_last) {  // prefetch the next tile into the other stage while this one computes
      load_tile_async<BN, D, NT>(sK + (stage ^ 1) * BN * D, gK, n_next * BN, mask.kv_end, kv_stride, tid);
      load_tile_async<BN, D, NT>(sV + (stage ^ 1) * BN * D, gV, n_next * BN, mask.kv_end, kv_stride, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const unsigned short* sKs = sK + stage * BN * D;
    const unsigned short* sVs = sV + stage * BN * D;

    // S = Q K^T for this warp's 16 rows and the BN keys of the tile.
    float s[BN / 8][4];
#pragma unroll
    for (int i = 0; i < BN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
    tile_qk<T, BN, D, SwQ, SwK>(s, sQ, sKs, warp, lane);

    // Scores in the log2 domain; masked entries -inf (only tiles that straddle a bound test).
    const int n0 = n * BN;
    // full: every element of the tile is visible (no key_mask hole either): no per-element test.
    const bool full = mask.tile_full(m0, m0 + BM, n0, n0 + BN) && (!has_km || km_bits == kAllKeys);
    tile_scores_log2<BN>(s, p, scale_log2);
    // Bias and ALiBi after scale and softcap, before the masks: a hidden element becomes -inf
    // whatever its bias (NaN included).
    if (has_bias) {  // one loop per dtype, no per-element switch (and no generic lambda: NVRTC rejects it)
      if (x.bias_dtype == 0)
        add_bias_tile<BN, BiasF32>(s, p, b, h, row_a, n0, tig, mask.kv_end);
      else if (x.bias_dtype == 1)
        add_bias_tile<BN, BiasF16>(s, p, b, h, row_a, n0, tig, mask.kv_end);
      else
        add_bias_tile<BN, BiasBF16>(s, p, b, h, row_a, n0, tig, mask.kv_end);
    }
    if (kMasks && x.alibi_slopes != nullptr) add_alibi_tile<BN>(s, -x.alibi_slopes[h] * kLog2e, mask.q_start + row_a, n0, tig);
    if (!full) tile_hide_invisible<BN>(s, lo_r, hi_r, n0, tig, km_bits, has_km);

    // A straddling tile holds keys that some of the block's rows must not see. P is exactly 0 there,
    // but the mma still multiplies it by V, and 0 * inf = NaN. So on such tiles (and only when the
    // tile's V has an inf/NaN at all: one block-wide vote) each thread first marks NaN in its
    // accumulator columns where a key its row does see is non-finite (the contract's result there
    // is not finite either), then the non-finite V elements become +0 for the product. Full tiles
    // need none of this: every row sees every key, so the natural propagation is the right one.
    // A bias of -inf hides elements of any tile the same way: then every tile takes this path.
    if ((!full || has_bias) && tile_v_nonfinite<T, BN, D, NT>(sVs, tid)) {
      tile_mark_nonfinite_v<T, BN, D, SwK>(acc_o, sVs, lo_r, hi_r, n0, tig, km_bits, has_km, has_bias, [&](int r, int key) {
        return row_a + 8 * r < p.seq_q && bias_load(x.bias, x.bias_dtype, bias_offset(x, b, h, row_a + 8 * r, key)) == neg_inf();
      });
      tile_v_zero_nonfinite<T, BN, D, NT>(sVs, tid);
    }

    tile_online_softmax<BN, D>(s, row_max, row_sum, acc_o);
    if (has_drop) dropout_tile<BN>(s, Dropout::load(x), b, h, row_a, n0, tig);
    tile_pv<T, BN, D, SwK>(acc_o, s, sVs, lane);
    __syncthreads();  // this stage is reloaded by the next iteration's prefetch
    n = n_next;
    km_bits = km_bits_next;
  }

  // Epilogue: O / l and lse; rows nobody sees get o = 0, lse = -inf.
  // With dropout, kept entries are scaled by 1 / (1 - rate): folded into 1 / l.
  const float o_scale = has_drop ? x.dropout_scale : 1.f;
  float inv[2], lse[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[r] = l > 0.f ? o_scale / l : 0.f;
    lse[r] = l > 0.f ? (row_max[r] + lg2(l)) * kLn2 : neg_inf();
  }
  if (tig == 0) {
    if (row_a < p.seq_q) gL[row_a] = lse[0];
    if (row_a + 8 < p.seq_q) gL[row_a + 8] = lse[1];
  }
  // Stage the warp's 16 output rows in its own rows of sQ (only this warp ever read them), then
  // store 16-byte chunks so the global writes are coalesced.
  unsigned short* sO = sQ;
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    int col = dt * 8 + tig * 2;
    int ra = warp * 16 + g;
    *reinterpret_cast<unsigned*>(sO + SwQ::off(ra, col)) = T::pack2(acc_o[dt][0] * inv[0], acc_o[dt][1] * inv[0]);
    *reinterpret_cast<unsigned*>(sO + SwQ::off(ra + 8, col)) = T::pack2(acc_o[dt][2] * inv[1], acc_o[dt][3] * inv[1]);
  }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int c = lane; c < 16 * kChunks; c += 32) {
    int r = c / kChunks, col = (c % kChunks) * 8;
    int row = m0 + warp * 16 + r;
    if (row < p.seq_q)
      *reinterpret_cast<Chunk16*>(gO + (long long)row * q_stride + col) =
          *reinterpret_cast<const Chunk16*>(sO + SwQ::off(warp * 16 + r, col));
  }
}

}  // namespace exla_rs
