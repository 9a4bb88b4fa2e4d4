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
// every instantiation also runs on sm_86/sm_89 (99 KiB per block). Up to D = 64 a warp owns 32
// query rows (kRowFrags = 2 m16 fragments: each K/V fragment from ldmatrix feeds 4 mma, half the
// shared-memory reads per mma of 16-row warps), above it 16: at D = 128 the 32 rows' O
// accumulators (128 registers) with the tile's scores left ptxas no room for the loop's
// addresses (it spilled 4-64 bytes on sm_80/sm_90 however the interior loop was cut, 2026-11-27),
// and D = 96 spilled 16 bytes.
// Mirrored in the Rust launcher (crates/exla-rs-cuda/src/config.rs): change both.
template <int D>
struct FwdTraits {
  static constexpr int kRowFrags = D <= 64 ? 2 : 1;
  static constexpr int kWarps = D <= 64 ? 4 : (D <= 192 ? 8 : 4);
  static constexpr int kBlockM = 16 * kRowFrags * kWarps;
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
//
// Two key loops. The interior loop takes the tiles every row of the block sees entirely (no mask
// test, no non-finite-V guard, unpredicated loads), when the call has nothing that works per
// element besides the softmax (no softcap, key_mask, bias, ALiBi; scale > 0, which lets the scale
// fold into the exp2): its body is Q K^T, the online softmax, (dropout,) P V and the next tile's
// cp.async. The general loop takes every other tile: those straddling a mask bound (the causal
// diagonal, window edges, kv_len), and every tile of a call with those features. The general
// tiles run first (the tail straddling tiles, then the head ones), the interior ones last: the
// online softmax does not depend on the order, and the two loops stay disjoint.
template <class T, int D, int F>
__device__ __forceinline__ void flash_fwd(const FwdParams& p) {
  constexpr bool kMasks = F & kFeatMasks, kDrop = F & kFeatDropout;
  using Tr = FwdTraits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NT = Tr::kThreads, MF = Tr::kRowFrags, WM = 16 * MF;
  constexpr int kParts = MF == 2 ? 2 : 1, NK = BN / kParts;  // the general loop's steps per tile, keys per step
  using SwQ = Swz<BM, D>;
  using SwK = Swz<BN, D>;
  if (blockDim.x != NT) __trap();  // the launcher's table disagrees with this file

  EXLA_RS_DYNAMIC_SMEM(smem_raw, 128);
  unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);
  unsigned short* sK = sQ + BM * D;      // [2][BN * D]
  unsigned short* sV = sK + 2 * BN * D;  // [2][BN * D]
  // 32-bit shared addresses: Q, then 2 stages of K, then 2 of V; a stage is kStage bytes on.
  constexpr unsigned kStage = BN * D * 2;
  const unsigned sQa = smem_u32(smem_raw), sKa = sQa + BM * D * 2, sVa = sKa + 2 * kStage;

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

  int k_lo, k_hi;
  mask.rows_keys(m0, m_end, k_lo, k_hi);
  const int n_first = k_lo / BN, n_last = (k_hi + BN - 1) / BN;  // tiles [n_first, n_last)

  // Optional features (null pointer = absent; every test below is uniform across the block, and
  // constant false where the set compiles the feature out).
  const ExtraParams& x = p.x;
  const bool has_km = kMasks && x.key_mask != nullptr;
  const bool has_bias = kMasks && x.bias != nullptr;
  const bool has_alibi = kMasks && x.alibi_slopes != nullptr;
  const bool has_drop = kDrop && x.dropout_key != nullptr;
  const long long km_row = (long long)b * p.seq_k;

  // The interior tiles [i_lo, i_hi) (empty: both n_last, and then the general loop takes
  // [n_first, n_last) in order).
  int i_lo = n_last, i_hi = n_last;
  const bool lean = !has_km && !has_bias && !has_alibi && !(p.softcap > 0.f) && p.scale > 0.f;
  if (lean) mask.full_tiles(m0, m0 + BM, BN, n_first, n_last, i_lo, i_hi);
  // The general loop's tiles in order: the tail [i_hi, n_last) (empty unless there is an interior),
  // then the head [n_first, i_lo); then the interior. With key_mask, the next head tile it does not
  // hide entirely, and its mask bits (the tile's BN bits all set without key_mask): a hidden tile
  // is never loaded. n_last: no tile left.
  constexpr unsigned long long kAllKeys = ~0ull >> (64 - BN);
  auto next_head = [&](int n, unsigned long long& bits) {
    bits = kAllKeys;
    if (has_km)
      for (; n < i_lo; ++n)
        if ((bits = key_mask_tile_bits<BN>(x, km_row, n * BN, p.seq_k, lane)) != 0) break;
    return n < i_lo ? n : i_lo < i_hi ? i_lo : n_last;
  };
  auto next_general = [&](int n, unsigned long long& bits) {  // the tile after general tile n
    if (n >= i_hi) {  // in the tail
      bits = kAllKeys;
      if (n + 1 < n_last) return n + 1;
      return next_head(n_first, bits);
    }
    return next_head(n + 1, bits);
  };
  unsigned long long km_bits;
  int n = i_hi < n_last ? i_hi : next_head(n_first, km_bits);
  if (i_hi < n_last) km_bits = kAllKeys;

  // Per thread: rows warp * WM + 16 mf + g (+ 8); O accumulators for D/8 column tiles of 8.
  float acc_o[MF][D / 8][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc_o[mf][i][0] = acc_o[mf][i][1] = acc_o[mf][i][2] = acc_o[mf][i][3] = 0.f;
  float row_max[2 * MF], row_sum[2 * MF];  // running max of s * log2(e); this thread's share of the running sum
#pragma unroll
  for (int rr = 0; rr < 2 * MF; ++rr) row_max[rr] = neg_inf(), row_sum[rr] = 0.f;

  if (n < n_last) {
    load_tile_async<BM, D, NT>(sQ, gQ, m0, p.seq_q, q_stride, tid);
    load_tile_async<BN, D, NT>(sK, gK, n * BN, mask.kv_end, kv_stride, tid);
    load_tile_async<BN, D, NT>(sV, gV, n * BN, mask.kv_end, kv_stride, tid);
    cp_async_commit();
  }
  const float scale_log2 = p.scale * kLog2e;
  const int row_a = m0 + warp * WM + g;  // this thread's rows: row_a + 16 mf + 8 r
  // The thread's ldmatrix addresses (stage 0); the stage adds st, 0 or kStage.
  const unsigned q_ld = sQa + q_ld_off<BM, D>(warp * WM, lane);
  const unsigned k_ld = sKa + k_ld_off<BN, D>(lane), v_ld = sVa + v_ld_off<BN, D>(lane);
  unsigned st = 0;

  // General loop. The rows' visible keys, one interval each, found once: a straddling tile then
  // tests each element with one bit of a tile-relative mask of it (bit_range) instead of the
  // 64-bit window predicate.
  int lo_r[2 * MF], hi_r[2 * MF];
#pragma unroll
  for (int rr = 0; rr < 2 * MF; ++rr) mask.row_keys(row_a + 16 * (rr >> 1) + 8 * (rr & 1), lo_r[rr], hi_r[rr]);
  while (n < n_last && !(n >= i_lo && n < i_hi)) {
    unsigned long long km_bits_next;
    const int n_next = next_general(n, km_bits_next);
    if (n_next < n_last) {  // prefetch the next tile into the other stage while this one computes
      load_tile_async<BN, D, NT>(sK + (st ^ kStage) / 2, gK, n_next * BN, mask.kv_end, kv_stride, tid);
      load_tile_async<BN, D, NT>(sV + (st ^ kStage) / 2, gV, n_next * BN, mask.kv_end, kv_stride, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const unsigned short* sVs = reinterpret_cast<const unsigned short*>(smem_raw + (BM * D * 2 + 2 * kStage) + st);
    const int n0 = n * BN;
    // full: every element of the tile is visible (no key_mask hole either): no per-element test.
    const bool full = mask.tile_full(m0, m0 + BM, n0, n0 + BN) && (!has_km || km_bits == kAllKeys);

    // A straddling tile holds keys that some of the block's rows must not see. P is exactly 0 there,
    // but the mma still multiplies it by V, and 0 * inf = NaN. So on such tiles (and only when the
    // tile's V has an inf/NaN at all: one block-wide vote) each thread first marks NaN in its
    // accumulator columns where a key its row does see is non-finite (the contract's result there
    // is not finite either), then the non-finite V elements become +0 for the product. Full tiles
    // need none of this: every row sees every key, so the natural propagation is the right one.
    // A bias of -inf hides elements of any tile the same way: then every tile takes this path.
    if ((!full || has_bias) && tile_v_nonfinite<T, BN, D, NT>(sVs, tid)) {
      tile_mark_nonfinite_v<T, MF, BN, D, SwK>(acc_o, sVs, lo_r, hi_r, n0, tig, km_bits, has_km, has_bias, [&](int rr, int key) {
        const int row = row_a + 16 * (rr >> 1) + 8 * (rr & 1);
        return row < p.seq_q && bias_load(x.bias, x.bias_dtype, bias_offset(x, b, h, row, key)) == neg_inf();
      });
      tile_v_zero_nonfinite<T, BN, D, NT>(sVs, tid);
    }

    // The tile in kParts parts of NK keys (a rolled loop): with 32-row warps the scores of a whole
    // tile next to the masks' and features' state would not fit in registers.
#pragma unroll 1
    for (int part = 0; part < kParts; ++part) {
      const int p0 = n0 + part * NK;
      const unsigned part_off = st + part * NK * 2 * SwK::W;  // NK rows on: the same row swizzle
      // S = Q K^T for this warp's rows and the NK keys of the part.
      float s[MF][NK / 8][4];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int i = 0; i < NK / 8; ++i) s[mf][i][0] = s[mf][i][1] = s[mf][i][2] = s[mf][i][3] = 0.f;
      tile_qk<T, MF, BM, BN, D, NK>(s, q_ld, k_ld + part_off);

      // Scores in the log2 domain; masked entries -inf (only tiles that straddle a bound test).
      tile_scores_log2<MF, NK>(s, p, scale_log2);
      // Bias and ALiBi after scale and softcap, before the masks: a hidden element becomes -inf
      // whatever its bias (NaN included).
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) {
        if (has_bias) {  // one loop per dtype, no per-element switch (and no generic lambda: NVRTC rejects it)
          if (x.bias_dtype == 0)
            add_bias_tile<NK, BiasF32>(s[mf], p, b, h, row_a + 16 * mf, p0, tig, mask.kv_end);
          else if (x.bias_dtype == 1)
            add_bias_tile<NK, BiasF16>(s[mf], p, b, h, row_a + 16 * mf, p0, tig, mask.kv_end);
          else
            add_bias_tile<NK, BiasBF16>(s[mf], p, b, h, row_a + 16 * mf, p0, tig, mask.kv_end);
        }
        if (has_alibi) add_alibi_tile<NK>(s[mf], -x.alibi_slopes[h] * kLog2e, mask.q_start + row_a + 16 * mf, p0, tig);
      }
      if (!full) tile_hide_invisible<MF, NK>(s, lo_r, hi_r, p0, tig, km_bits >> (part * NK), has_km);

      tile_online_softmax<MF, NK, D, false>(s, row_max, row_sum, acc_o, scale_log2);
      if (has_drop)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) dropout_tile<NK>(s[mf], Dropout::load(x), b, h, row_a + 16 * mf, p0, tig);
      tile_pv<T, MF, BN, D, NK>(acc_o, s, v_ld + part_off);
    }
    __syncthreads();  // this stage is reloaded by the next iteration's prefetch
    n = n_next;
    km_bits = km_bits_next;
    st ^= kStage;
  }

  // Interior loop: tiles [n, i_hi), every key visible to every row of the block (so below kv_end:
  // unpredicated loads), in order; nothing follows them.
  {
    using Copy = RowCopy<BN, D, NT>;
    // The thread's sources in the next tile (RowCopy advances them a tile per copy).
    const long long src_off = (long long)((n + 1) * BN + Copy::r0(tid)) * kv_stride + Copy::col(tid);
    const unsigned short* gKt = gK + src_off;
    const unsigned short* gVt = gV + src_off;
    const long long step = Copy::kStep * kv_stride;
    const unsigned k_dst = sKa + Copy::thread_dst_off(tid), v_dst = sVa + Copy::thread_dst_off(tid);
    // Counted down: the loop carries no tile bound (registers are at their limit here).
    for (int left = i_hi - n; left > 0; --left, ++n) {
      if (left > 1) {
        if constexpr (Copy::kFits) {
          Copy::copy(k_dst + (st ^ kStage), gKt, step);
          Copy::copy(v_dst + (st ^ kStage), gVt, step);
        } else {
          const long long next = (long long)(n + 1) * BN * kv_stride;
          ChunkCopy<BN, D, NT>::copy(sKa + (st ^ kStage), gK + next, kv_stride, tid);
          ChunkCopy<BN, D, NT>::copy(sVa + (st ^ kStage), gV + next, kv_stride, tid);
        }
      }
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      float s[MF][BN / 8][4];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int i = 0; i < BN / 8; ++i) s[mf][i][0] = s[mf][i][1] = s[mf][i][2] = s[mf][i][3] = 0.f;
      tile_qk<T, MF, BM, BN, D>(s, q_ld, k_ld + st);
      tile_online_softmax<MF, BN, D, true>(s, row_max, row_sum, acc_o, scale_log2);
      if (has_drop)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) dropout_tile<BN>(s[mf], Dropout::load(x), b, h, row_a + 16 * mf, n * BN, tig);
      tile_pv<T, MF, BN, D>(acc_o, s, v_ld + st);
      __syncthreads();  // this stage is reloaded by the next iteration's prefetch
      st ^= kStage;
    }
  }

  // Epilogue: O / l and lse; rows nobody sees get o = 0, lse = -inf. (The output addresses are
  // found here, not before the loops: they would hold registers through them.)
  unsigned short* gO = static_cast<unsigned short*>(p.o) + ((long long)b * p.seq_q * p.heads + h) * D;
  float* gL = p.lse + ((long long)b * p.heads + h) * p.seq_q;
  // With dropout, kept entries are scaled by 1 / (1 - rate): folded into 1 / l.
  const float o_scale = has_drop ? x.dropout_scale : 1.f;
  float inv[2 * MF], lse[2 * MF];
#pragma unroll
  for (int rr = 0; rr < 2 * MF; ++rr) {
    float l = row_sum[rr];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[rr] = l > 0.f ? o_scale / l : 0.f;
    lse[rr] = l > 0.f ? (row_max[rr] + lg2(l)) * kLn2 : neg_inf();
  }
  if (tig == 0) {
#pragma unroll
    for (int rr = 0; rr < 2 * MF; ++rr) {
      const int row = row_a + 16 * (rr >> 1) + 8 * (rr & 1);
      if (row < p.seq_q) gL[row] = lse[rr];
    }
  }
  // Stage the warp's WM output rows in its own rows of sQ (only this warp ever read them), then
  // store 16-byte chunks so the global writes are coalesced.
  unsigned short* sO = sQ;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      int col = dt * 8 + tig * 2;
      int ra = warp * WM + 16 * mf + g;
      *reinterpret_cast<unsigned*>(sO + SwQ::off(ra, col)) = T::pack2(acc_o[mf][dt][0] * inv[2 * mf], acc_o[mf][dt][1] * inv[2 * mf]);
      *reinterpret_cast<unsigned*>(sO + SwQ::off(ra + 8, col)) =
          T::pack2(acc_o[mf][dt][2] * inv[2 * mf + 1], acc_o[mf][dt][3] * inv[2 * mf + 1]);
    }
  __syncwarp();
  constexpr int kChunks = D / 8;
  for (int c = lane; c < WM * kChunks; c += 32) {
    int r = c / kChunks, col = (c % kChunks) * 8;
    int row = m0 + warp * WM + r;
    if (row < p.seq_q)
      *reinterpret_cast<Chunk16*>(gO + (long long)row * q_stride + col) =
          *reinterpret_cast<const Chunk16*>(sO + SwQ::off(warp * WM + r, col));
  }
}

}  // namespace exla_rs
