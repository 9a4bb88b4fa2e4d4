// Backward flash attention on tensor cores (f16, bf16), the FA2 work split: one block per
// (key tile, kv head, batch) keeps its K and V tile in shared memory and sweeps every query tile
// (of every query head sharing this kv head, for GQA) that sees it. dK and dV accumulate in
// registers and are written once, with no atomics; dQ partial sums go to an f32 buffer in the
// workspace through atomics and flash_bwd_aux.cuh converts them at the end.
//
// Per query tile, with warp w owning keys [16 (w / S), +16) and dK/dV columns [DW (w % S), +DW)
// (S = kDSplit warps share a key slice when D is too wide for one warp's registers):
//   S^T  = K Q^T                    (A: K rows from smem, B: Q rows, ldmatrix)
//   dP^T = V dO^T
//   P^T  = exp(S^T - lse), dS^T = P^T (dP^T - delta) softcap'(S^T)     (elementwise, registers)
//   dV  += P^T dO,  dK += dS^T Q    (A straight from the accumulators, B with ldmatrix.trans)
//   dS^T -> smem;  dQ += dS K       (A with ldmatrix.trans from dS^T, atomics into dq_accum)
#pragma once

#include "common.cuh"
#include "bwd_extras.cuh"
#include "extras.cuh"

namespace exla_rs {

// Mirrored in crates/exla-rs-cuda/src/config.rs: change both. Shared memory <= 96 KiB (sm_86/89).
template <int D>
struct BwdTraits {
  // D = 256: dK and dV of 16 keys x 128 columns (128 f32 per thread) with S^T, dP^T and the
  // fragments spilled (~72 LDL/STL on sm_90). 8 warps with a 4-way column split hold 64 columns
  // each (220 registers, no spill); the price is that 4 warps recompute the same S^T/dP^T slice.
  // D = 64, 128: 8 warps, 128 keys per block, so Q, dO, lse, delta are read and dQ is added once
  // per 128 keys (FA2's kBlockN), half what 64-key blocks move through L2 (issue 33).
  static constexpr int kWarps = (D == 64 || D == 128) ? 8 : (D <= 192 ? 4 : 8);
  static constexpr int kDSplit = D <= 128 ? 1 : (D <= 192 ? 2 : 4);  // warps sharing a 16-key slice
  static constexpr int kBlockN = 16 * kWarps / kDSplit;  // keys per block
  static constexpr int kBlockM = D <= 96 ? 64 : 32;      // queries per step (registers: S^T, dP^T)
  static constexpr int kDW = D / kDSplit;                // dK/dV columns per warp
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSmemBytes =
      (2 * kBlockN * D + 2 * kBlockM * D + kBlockN * kBlockM) * 2 + 2 * kBlockM * 4 + kBlockN * 4;
  static_assert(D % 32 == 0 && D <= 256 && kDW % 16 == 0, "head dim");
};

// F: the feature set (kFeatMasks | kFeatDropout bits, extras.cuh); a clear bit compiles its
// feature out.
template <class T, int D, int F>
__device__ __forceinline__ void flash_bwd(const BwdParams& p) {
  constexpr bool kMasks = F & kFeatMasks, kDrop = F & kFeatDropout;
  using Tr = BwdTraits<D>;
  constexpr int BM = Tr::kBlockM, BN = Tr::kBlockN, NT = Tr::kThreads, DW = Tr::kDW, NW = Tr::kWarps;
  using SwKV = Swz<BN, D>;
  using SwQ = Swz<BM, D>;
  using SwS = Swz<BN, BM>;  // dS^T: rows = keys, cols = queries
  if (blockDim.x != NT) __trap();

  EXLA_RS_DYNAMIC_SMEM(smem_raw, 128);
  unsigned short* sK = reinterpret_cast<unsigned short*>(smem_raw);
  unsigned short* sV = sK + BN * D;
  unsigned short* sQ = sV + BN * D;
  unsigned short* sdO = sQ + BM * D;
  unsigned short* sdS = sdO + BM * D;
  float* sLse = reinterpret_cast<float*>(sdS + BN * BM);  // lse * log2(e); -inf for rows past Sq
  float* sDelta = sLse + BM;
  int* sKbad = reinterpret_cast<int*>(sDelta + BM);  // per key of the tile: K row had an inf/NaN

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tig = lane & 3;
  const int ks = warp / Tr::kDSplit, dpart = warp % Tr::kDSplit;
  if ((int)blockIdx.x < p.kb_first) return;  // the deterministic mode's earlier key blocks
  const int n0 = blockIdx.x * BN, hk = blockIdx.y, b = blockIdx.z;
  const int group = p.heads / p.kv_heads;
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[b], p.q_start[b], p.window_left, p.window_right);

  const long long q_stride = (long long)p.heads * D, kv_stride = (long long)p.kv_heads * D;
  const long long kv_off = ((long long)b * p.seq_k * p.kv_heads + hk) * D;
  const unsigned short* gK = static_cast<const unsigned short*>(p.k) + kv_off;
  const unsigned short* gV = static_cast<const unsigned short*>(p.v) + kv_off;

  float acc_dk[DW / 8][4], acc_dv[DW / 8][4];
#pragma unroll
  for (int i = 0; i < DW / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;

  int q_lo, q_hi;
  mask.keys_rows(n0, n0 + BN, q_lo, q_hi);
  const ExtraParams& x = p.x;
  // key_mask: one bit per key of the block (warp-uniform). A block whose keys are all hidden has
  // nothing to sweep (dK = dV = 0) and loads nothing. Blocks of 128 keys (D = 64/128) take two
  // 64-key words: km_bits holds the word of this warp's keys. Blocks of up to 64 keys keep the one
  // word and its late full test: the extra flags cost the D = 192 masked sets spills on sm_90.
  constexpr int kKmW = BN < 64 ? BN : 64;  // keys per word
  constexpr unsigned long long kKmAll = ~0ull >> (64 - kKmW);
  const int km_word = BN <= 64 ? 0 : ks * 16 / kKmW;
  unsigned long long km_bits = kKmAll;
  bool km_full = true;  // (BN <= 64: set below, from km_bits)
  const bool has_km = kMasks && x.key_mask != nullptr;
  if (has_km) {
    if constexpr (BN <= 64) {
      km_bits = key_mask_tile_bits<BN>(x, (long long)b * p.seq_k, n0, p.seq_k, lane);
      if (km_bits == 0) q_lo = q_hi = 0;
    } else {
      bool any = false;
#pragma unroll
      for (int w = 0; w < BN / kKmW; ++w) {
        const unsigned long long bits = key_mask_tile_bits<kKmW>(x, (long long)b * p.seq_k, n0 + w * kKmW, p.seq_k, lane);
        any |= bits != 0;
        km_full &= bits == kKmAll;
        if (w == km_word) km_bits = bits;
      }
      if (!any) q_lo = q_hi = 0;
    }
  }
  if (q_lo < q_hi) {
    load_tile_async<BN, D, NT>(sK, gK, n0, mask.kv_end, kv_stride, tid);
    load_tile_async<BN, D, NT>(sV, gV, n0, mask.kv_end, kv_stride, tid);
    cp_async_commit();  // waited for together with the first Q/dO tile
  }
  const int key_a = n0 + ks * 16 + g;  // this thread's two keys: key_a, key_a + 8
  bool kbad[2] = {false, false};       // their K rows held an inf/NaN (set at the first step)
  // The queries that see each of the two keys: one interval per key, found once, so a straddling
  // step tests elements against a bit mask of it (qvis below) instead of the 64-bit window predicate.
  int qlo[2], qhi[2];
  mask.keys_rows(key_a, key_a + 1, qlo[0], qhi[0]);
  mask.keys_rows(key_a + 8, key_a + 9, qlo[1], qhi[1]);
#pragma unroll
  for (int r = 0; r < 2; ++r)  // a key hidden by key_mask: no query sees it
    if (has_km && !((km_bits >> (key_a + 8 * r - n0 - km_word * kKmW)) & 1)) qlo[r] = qhi[r] = 0;
  if constexpr (BN <= 64) km_full = km_bits == kKmAll;
  // Any feature that touches the elementwise step (key_mask alone only narrows the intervals);
  // constant false in the plain set, which keeps only the plain step below.
  const bool has_bias = kMasks && x.bias != nullptr, has_alibi = kMasks && x.alibi_slopes != nullptr;
  const bool has_drop = kDrop && x.dropout_key != nullptr, has_dbias = kMasks && p.dbias_accum != nullptr;
  const bool extras = has_bias || has_alibi || has_drop || has_dbias;

  // Steps: (query head of the group, query tile) pairs. The query tiles that see every key of the
  // block, [f_lo, f_hi) of each head (Mask::full_row_tiles), run in a lean loop of their own when
  // nothing else works per element (kLean: the plain set; no softcap; the block's K and V finite,
  // the prologue's vote): no mask code, no row predicates but the lse = -inf zero fill, 32-bit
  // shared addresses hoisted out of the loop. The others run first, in the general loop with the
  // mask code: phase A takes every head's tiles outside [f_lo, f_hi), phase B every head's tiles
  // inside it (the lean loop, or the general loop when the vote found a non-finite K or V).
  // dK and dV are sums over the steps and dQ is added by atomics: the order is free. The loads of
  // step t + 1 are issued while step t computes dQ (which reads only dS^T and K).
  // D = 192 keeps the general loop only: its column split (96 of 192 columns a warp) does not
  // cut the Q tile at a 64-column block, so SwzAddr's constant offsets do not apply.
  constexpr bool kLean = F == 0 && DW % SwQ::W == 0;
  const int m_first = (q_lo / BM) * BM;
  const int m_tiles = q_lo < q_hi ? (q_hi - m_first + BM - 1) / BM : 0;
  int f_lo = m_tiles, f_hi = m_tiles;
  if (kLean && !(p.softcap > 0.f)) mask.full_row_tiles(n0, n0 + BN, BM, m_first, m_tiles, f_lo, f_hi);
  const int steps = group * m_tiles, steps_a = group * (m_tiles - (f_hi - f_lo));
  const int first_a = f_lo == 0 ? f_hi : 0;  // phase A's first tile of a head
  // (h, i) -> the step after it, the t1-th (h: the head within the group, i: the query tile).
  auto next_step = [&](int t1, int& h, int& i) {
    if (t1 < steps_a) {
      if (++i == f_lo) i = f_hi;
      if (i >= m_tiles) ++h, i = first_a;
    } else if (t1 == steps_a) {
      h = 0, i = f_lo;
    } else if (++i == f_hi) {
      ++h, i = f_lo;
    }
  };
  auto issue_loads = [&](int hh, int m0, int stage) {  // Q, dO tiles of head hk * group + hh, rows m0.. (async)
    const int h = hk * group + hh;
    const long long q_off = ((long long)b * p.seq_q * p.heads + h) * D;
    const float* gLse = p.lse + ((long long)b * p.heads + h) * p.seq_q;
    // Rows the forward found fully masked (lse = -inf) contribute nothing: their Q and dO rows are
    // zero-filled like rows past Sq, so a NaN/inf there cannot reach dK, dV through P^T = 0 times it.
    const unsigned short* gQ = static_cast<const unsigned short*>(p.q) + q_off;
    const unsigned short* gdO = static_cast<const unsigned short*>(p.d_o) + q_off;
    constexpr int kChunks = D / 8;
    if constexpr (NT % kChunks == 0 && BM % (NT / kChunks) == 0) {
      // As in load_tile_async: each thread keeps one column and steps down the rows, so the column
      // is loop invariant and no chunk pays a division.
      constexpr int kStep = NT / kChunks;
      const int col = (tid % kChunks) * 8;
#pragma unroll
      for (int i = 0; i < BM / kStep; ++i) {
        const int r = tid / kChunks + i * kStep, gr = m0 + r;
        const bool ok = gr < p.seq_q && gLse[gr] != neg_inf();
        const long long off = ok ? (long long)gr * q_stride + col : 0;
        cp_async16(sQ + SwQ::off(r, col), gQ + off, ok ? 16 : 0);
        cp_async16(sdO + SwQ::off(r, col), gdO + off, ok ? 16 : 0);
      }
    } else {
      for (int c = tid; c < BM * kChunks; c += NT) {
        const TileChunk t = tile_chunk<BM, D>(c);  // bank-conflict-free order (common.cuh)
        const int r = t.row, col = t.col, gr = m0 + r;
        const bool ok = gr < p.seq_q && gLse[gr] != neg_inf();
        const long long off = ok ? (long long)gr * q_stride + col : 0;
        cp_async16(sQ + SwQ::off(r, col), gQ + off, ok ? 16 : 0);
        cp_async16(sdO + SwQ::off(r, col), gdO + off, ok ? 16 : 0);
      }
    }
    cp_async_commit();
    // lse * log2(e) and delta of the step's rows (stage 1, 2; 0: not yet, see the prologue). The
    // general loop's rows past Sq or with lse = -inf are hidden by its test (lse -inf, delta 0
    // past Sq). The lean loop (stage 2) has no test: its rows are below Sq and one with lse = -inf
    // gets +inf and delta 0, so with its zero-filled Q and dO and finite K and V,
    // P = exp2(0 - inf) = 0 and dS = 0 (0 - 0) are exact zeros.
    const float* gDelta = p.delta + ((long long)b * p.heads + h) * p.seq_q;
    if (stage == 2) {
      for (int r = tid; r < BM; r += NT) {
        const float l = gLse[m0 + r];
        sLse[r] = l == neg_inf() ? -neg_inf() : l * kLog2e;
        sDelta[r] = l == neg_inf() ? 0.f : gDelta[m0 + r];
      }
    } else if (stage == 1) {
      for (int r = tid; r < BM; r += NT) {
        const int row = m0 + r;
        sLse[r] = row < p.seq_q ? gLse[row] * kLog2e : neg_inf();  // -inf stays -inf
        sDelta[r] = row < p.seq_q ? gDelta[row] : 0.f;
      }
    }
  };

  // K rows with an inf/NaN: keys some of the swept rows must not see still meet them in
  // dQ += dS K (dS is exactly 0 there, and 0 * inf = NaN). Such a row is zeroed in sK and
  // flagged; rows that do see the key get s = NaN below, as the unzeroed product would give.
  // Returns whether this thread's warp found one (K must have landed, for every thread).
  auto check_k = [&]() {
    int bad_any = 0;
    for (int r = warp; r < BN; r += NW) {
      int bad = 0;
      for (int c = lane; c < D / 8; c += 32) {
        Chunk16* ch = reinterpret_cast<Chunk16*>(sK + SwKV::off(r, c * 8));
        Chunk16 x = *ch;
        if (nonfinite_chunk<T>(x)) {
          bad = 1;
          zero_nonfinite_chunk<T>(x);
          *ch = x;
        }
      }
      bad = __any_sync(0xffffffffu, bad);
      if (lane == 0) sKbad[r] = bad;
      bad_any |= bad;
    }
    return bad_any;
  };

  // Prologue: the first step's loads beside K and V. With a lean loop, K's check (above) and the
  // lean loop's vote run here, once K and V are in, before the first step's lse is staged (its
  // rows' values depend on the loop). Without one (kLean false) the general loop checks K at its
  // first step, as before issue 33: hoisted here, the masks' sets spilled 8-44 bytes on sm_90
  // (D = 96, 192), however the loop's counters were kept.
  int h_s = 0, i_s = steps_a > 0 ? first_a : f_lo;  // the step at hand
  bool lean = false;
  if (steps > 0) {
    issue_loads(h_s, m_first + i_s * BM, kLean ? 0 : 1);
    if constexpr (kLean) {
      cp_async_wait<1>();  // K and V
      __syncthreads();
      int bad_any = check_k();
      // The lean loop multiplies every P^T and dS^T by K and V unmasked: a non-finite V (or K)
      // element of the block sends every phase B step through the general loop instead.
      if (f_lo < f_hi)
        for (int c = tid; c < BN * D / 8; c += NT) bad_any |= nonfinite_chunk<T>(reinterpret_cast<const Chunk16*>(sV)[c]);
      lean = !__syncthreads_or(bad_any) && f_lo < f_hi;
      kbad[0] = sKbad[ks * 16 + g] != 0;
      kbad[1] = sKbad[ks * 16 + g + 8] != 0;
      // The first step's lse and delta, as its loop wants them (a loop of BM threads, no barrier).
      const int m0 = m_first + i_s * BM;
      const long long lrow = ((long long)b * p.heads + hk * group) * p.seq_q + m0;
      for (int r = tid; r < BM; r += NT) {
        const float l = m0 + r < p.seq_q ? p.lse[lrow + r] : neg_inf();
        const bool hide = lean && steps_a == 0 && l == neg_inf();
        sLse[r] = hide ? -neg_inf() : l * kLog2e;
        sDelta[r] = m0 + r < p.seq_q && !hide ? p.delta[lrow + r] : 0.f;
      }
    }
  }

  // General loop: phase A, and phase B too without the lean loop.
  const int steps_g = lean ? steps_a : steps;
  for (int t = 0; t < steps_g; ++t) {
    {
      // Without a lean loop (kLean false) the steps go in order, (h, i) from t as before issue 33.
      if constexpr (!kLean) h_s = t / m_tiles, i_s = t % m_tiles;
      const int h = hk * group + h_s, m0 = m_first + i_s * BM;
      float* gdQ = p.dq_accum + ((long long)b * p.seq_q * p.heads + h) * D;
      cp_async_wait<0>();
      __syncthreads();
      if constexpr (!kLean) {
        if (t == 0) {
          check_k();
          __syncthreads();
          kbad[0] = sKbad[ks * 16 + g] != 0;
          kbad[1] = sKbad[ks * 16 + g + 8] != 0;
        }
      }

      // Dropout keep bits of the step (all ones without dropout). With BM = 64 (D <= 96) they are
      // found before S^T and dP^T take their registers: after them, the Philox state and the tie
      // path's values spilled bwd_*_d96 on sm_86/89. With BM = 32 they are found after (before
      // them spilled bwd_*_d192 on sm_90): ptxas -v, every head dim and arch of the build. The
      // masks' set finds them late at any BM: early, beside the masks' registers, bwd_*_d96_mask_drop
      // spilled 4 bytes (sm_80, sm_90); late it holds 255 registers and spills nothing.
      constexpr bool kDropEarly = BM == 64 && !kMasks;
      unsigned keep_bits = ~0u;
      if (kDropEarly && has_drop) keep_bits = dropout_keep_bits_t<BM>(Dropout::load(x), b, h, m0, n0 + ks * 16, g, tig);

      // S^T and dP^T for this warp's 16 keys x BM queries.
      float st[BM / 8][4], dpt[BM / 8][4];
#pragma unroll
      for (int i = 0; i < BM / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        unsigned ak[4], av[4];
        const int a_off = SwKV::off(ks * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8);
        ldmatrix_x4(ak, sK + a_off);
        ldmatrix_x4(av, sV + a_off);
#pragma unroll
        for (int nt = 0; nt < BM / 16; ++nt) {
          const int b_off = SwQ::off(nt * 16 + (lane & 7) + (lane >> 4) * 8, kk * 16 + ((lane >> 3) & 1) * 8);
          unsigned bq[4], bo[4];
          ldmatrix_x4(bq, sQ + b_off);
          ldmatrix_x4(bo, sdO + b_off);
          T::mma(st[2 * nt], ak, bq[0], bq[1]);
          T::mma(st[2 * nt + 1], ak, bq[2], bq[3]);
          T::mma(dpt[2 * nt], av, bo[0], bo[1]);
          T::mma(dpt[2 * nt + 1], av, bo[2], bo[3]);
        }
      }

      // Elementwise: st <- P^T, dpt <- dS^T (without the final `scale`, applied at the end).
      const bool full = km_full && mask.tile_full(m0, m0 + BM, n0, n0 + BN);
      // Element (j, e) is query m0 + j * 8 + tig * 2 + (e & 1) of key key_a + (e >> 1) * 8.
      if (extras) {
        // The same step with the contract's optional features: z = s + bias + alibi (exp2 domain),
        // P^T <- P^T * M * scale_drop, dZ = P (M * scale_drop * dP - delta), dS = dZ softcap'(s),
        // and dZ into dbias_accum (summed over the broadcast dimensions this thread/warp covers).
        if (!kDropEarly && has_drop) keep_bits = dropout_keep_bits_t<BM>(Dropout::load(x), b, h, m0, n0 + ks * 16, g, tig);
        // Warps that share a key slice (kDSplit > 1) compute the same dZ: only dpart 0 adds it.
        bwd_extras_step<BM>(st, dpt, p, mask, sLse, sDelta, kbad, qlo, qhi, full, keep_bits, has_drop, has_alibi, has_bias,
                            has_dbias && dpart == 0 ? p.dbias_accum : nullptr, b, h, m0, key_a, g, tig, lane);
      } else {
      // Bit qc = j * 8 + (e & 1) of qvis[e >> 1]: that element's query lies in its key's visible
      // interval (all ones on a full step): one bit test per element instead of two compares.
      using QBits = typename BitsOf<BM>::T;
      const QBits qvis[2] = {full || F != 0 ? ~QBits(0) : bit_range<BM>(qlo[0] - m0 - tig * 2, qhi[0] - m0 - tig * 2),
                             full || F != 0 ? ~QBits(0) : bit_range<BM>(qlo[1] - m0 - tig * 2, qhi[1] - m0 - tig * 2)};
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int ql = j * 8 + tig * 2 + (e & 1);  // query within the tile (accumulator column)
          const int qc = j * 8 + (e & 1);
          const float l2 = sLse[ql];
          const float s0 = p.softcap > 0.f ? score(st[j][e], p.scale, p.softcap, p.softcap_inv) : st[j][e] * p.scale;
          const float s = kbad[e >> 1] ? qnan() : s0;
          // The plain set tests a bit of qvis; the others keep the two compares, whose registers do
          // not spill bwd_*_d96 beside the extras step (the masks' did, on sm_80 and sm_90).
          const bool in_range = F == 0 ? ((qvis[e >> 1] >> qc) & 1) != 0
                                       : full || (qc >= qlo[e >> 1] - m0 - tig * 2 && qc < qhi[e >> 1] - m0 - tig * 2);
          const bool vis = l2 != neg_inf() && in_range;
          const float pr = vis ? ex2(s * kLog2e - l2) : 0.f;
          st[j][e] = pr;
          // A select, not a product with pr = 0: dP^T of a hidden pair may be NaN (a non-finite V
          // row, or dO of a row nobody sees) and must not leak.
          dpt[j][e] = vis ? pr * (dpt[j][e] - sDelta[ql]) * softcap_grad(s, p.softcap, p.softcap_inv) : 0.f;
        }
      }
      }

      // dV += P^T dO and dK += dS^T Q over this warp's DW columns.
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        unsigned ap[4], as[4];
        pack_a_frag<T>(ap, st[2 * kq], st[2 * kq + 1]);
        pack_a_frag<T>(as, dpt[2 * kq], dpt[2 * kq + 1]);
#pragma unroll
        for (int dt = 0; dt < DW / 16; ++dt) {
          const int b_off =
              SwQ::off(kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dpart * DW + dt * 16 + (lane >> 4) * 8);
          unsigned bo[4], bq[4];
          ldmatrix_x4_trans(bo, sdO + b_off);
          ldmatrix_x4_trans(bq, sQ + b_off);
          T::mma(acc_dv[2 * dt], ap, bo[0], bo[1]);
          T::mma(acc_dv[2 * dt + 1], ap, bo[2], bo[3]);
          T::mma(acc_dk[2 * dt], as, bq[0], bq[1]);
          T::mma(acc_dk[2 * dt + 1], as, bq[2], bq[3]);
        }
      }

      // dS^T to shared memory (one warp per key slice writes it), then dQ += dS K.
      if (dpart == 0) {
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
          const int col = j * 8 + tig * 2;
          *reinterpret_cast<unsigned*>(sdS + SwS::off(ks * 16 + g, col)) = T::pack2(dpt[j][0], dpt[j][1]);
          *reinterpret_cast<unsigned*>(sdS + SwS::off(ks * 16 + g + 8, col)) = T::pack2(dpt[j][2], dpt[j][3]);
        }
      }
      __syncthreads();  // from here on nobody reads sQ, sdO, sLse, sDelta of this step
      int h_n = h_s, i_n = i_s;
      if (t + 1 < steps) {
        if constexpr (kLean)
          next_step(t + 1, h_n, i_n);
        else
          h_n = (t + 1) / m_tiles, i_n = (t + 1) % m_tiles;
        issue_loads(h_n, m_first + i_n * BM, lean && t + 1 >= steps_a ? 2 : 1);
      }

      // Work items: (16-query row tile, 32-column chunk of D), spread over the warps.
      constexpr int kRowTiles = BM / 16, kItems = kRowTiles * (D / 32);
      for (int item = warp; item < kItems; item += NW) {
        const int rt = item % kRowTiles, dc = item / kRowTiles;
        float acc[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          // A = dS [query][key] read transposed from dS^T [key][query]: matrix i of the x4 covers
          // keys +8*(i/2), queries +8*(i%2), which is the a0..a3 order of the fragment.
          unsigned a[4];
          const int mi = lane >> 3;
          ldmatrix_x4_trans(a, sdS + SwS::off(kk * 16 + (lane & 7) + (mi >> 1) * 8, rt * 16 + (mi & 1) * 8));
#pragma unroll
          for (int dt = 0; dt < 2; ++dt) {
            unsigned bk[4];
            ldmatrix_x4_trans(bk, sK + SwKV::off(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                 dc * 32 + dt * 16 + (lane >> 4) * 8));
            T::mma(acc[2 * dt], a, bk[0], bk[1]);
            T::mma(acc[2 * dt + 1], a, bk[2], bk[3]);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = m0 + rt * 16 + g + r * 8;
          if (row < p.seq_q) {
            float* dst = gdQ + (long long)row * q_stride + dc * 32 + tig * 2;  // then + nt * 8 + (e & 1)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              red_add_f32(dst + nt * 8, acc[nt][2 * r]);
              red_add_f32(dst + nt * 8 + 1, acc[nt][2 * r + 1]);
            }
          }
        }
      }
      __syncthreads();  // sdS is rewritten by the next step
      h_s = h_n, i_s = i_n;
    }
  }

  // Lean loop: phase B, the query tiles that see every key of the block, every row below Sq.
  // Per step: S^T and dP^T, P^T = exp2(S^T scale log2(e) - lse log2(e)), dS^T = P^T (dP^T - delta)
  // (lse = -inf rows: see issue_loads), dV and dK, dS^T to shared memory, the next step's loads,
  // dQ += dS K by atomics. Shared memory through 32-bit addresses (SwzAddr: the thread's base XOR
  // a compile-time chunk constant plus a compile-time offset; no base changes inside the loop),
  // global memory through per-thread pointers offset by the step's (row, head) once.
  if constexpr (kLean) {
    if (lean) {
      using AKV = SwzAddr<BN, D>;
      using AQ = SwzAddr<BM, D>;
      using AS = SwzAddr<BN, BM>;
      constexpr unsigned kOffQ = 2u * BN * D * 2, kOffdO = kOffQ + BM * D * 2, kOffS = kOffdO + BM * D * 2;
      constexpr unsigned kTileKV = BN * D * 2, kTileQ = BM * D * 2;
      const unsigned s0 = smem_u32(smem_raw);
      // ldmatrix bases: K / V rows of this warp's keys (A of S^T, dP^T), Q / dO (B of S^T, dP^T),
      // Q / dO transposed over this warp's dK / dV columns (B of dK, dV).
      const unsigned kv_a = s0 + AKV::thread_off(ks * 16 + (lane & 15), (lane >> 4) * 8);
      const unsigned qd_b = s0 + kOffQ + AQ::thread_off((lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8);
      const unsigned qd_t = s0 + kOffQ + AQ::thread_off((lane & 7) + ((lane >> 3) & 1) * 8, dpart * DW + (lane >> 4) * 8);
      // dS^T stores (byte offsets from smem_raw): this thread's keys ks*16 + g (+ 8), queries tig*2 (+ 1).
      const unsigned ds_st = kOffS + AS::thread_off(ks * 16 + g, tig * 2);
      // dQ += dS K: warp w takes the 16-row tiles rt = w % kRowTiles and the 32-column chunks
      // w / kRowTiles + k kS (k < kPer) of D. A = dS from dS^T transposed (matrix i: keys + 8 (i / 2),
      // queries + 8 (i % 2)), B = K transposed.
      constexpr int kRowTiles = BM / 16, kItems = kRowTiles * (D / 32), kPer = kItems / NW, kS = NW / kRowTiles;
      static_assert(kItems % NW == 0 && NW % kRowTiles == 0, "dQ items per warp");
      static_assert(kPer == 1 || AKV::W == 32 || kS % 2 == 0, "dQ chunks k kS apart keep the thread's swizzle");
      const int rt = warp % kRowTiles, dc = warp / kRowTiles, mi = lane >> 3;
      const unsigned ds_a = s0 + kOffS + AS::thread_off((lane & 7) + (mi >> 1) * 8, rt * 16 + (mi & 1) * 8);
      const unsigned k_t = s0 + AKV::thread_off((lane & 7) + ((lane >> 3) & 1) * 8, dc * 32 + (lane >> 4) * 8);
      const float scale_log2 = p.scale * kLog2e;
      // Global: (row, head) offsets from head hk * group, row 0 of batch b; the step adds its own.
      const long long qb_off = ((long long)b * p.seq_q * p.heads + hk * group) * D;
      const unsigned short* gQb = static_cast<const unsigned short*>(p.q) + qb_off;
      const unsigned short* gdOb = static_cast<const unsigned short*>(p.d_o) + qb_off;
      float* const dq_t = p.dq_accum + ((long long)b * p.seq_q * p.heads + hk * group) * D +
                          (long long)(rt * 16 + g) * q_stride + dc * 32 + tig * 2;
      const long long dq_r8 = 8 * q_stride;
      const long long lse_b = ((long long)b * p.heads + hk * group) * p.seq_q;
      int hh = h_s, ii = i_s;  // (0, f_lo): the general loop or the prologue loaded it
      for (int left = steps - steps_a; left > 0; --left) {
        const int m0 = m_first + ii * BM;
        float* const dq = dq_t + ((long long)m0 * q_stride + hh * D);
        cp_async_wait<0>();
        __syncthreads();

        // S^T and dP^T for this warp's 16 keys x BM queries.
        float st[BM / 8][4], dpt[BM / 8][4];
#pragma unroll
        for (int i = 0; i < BM / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          unsigned ak[4], av[4];
          ldsm_x4(ak, AKV::at(kv_a, 0, kk * 16));
          ldsm_x4(av, AKV::at(kv_a, 0, kk * 16) + kTileKV);
#pragma unroll
          for (int nt = 0; nt < BM / 16; ++nt) {
            unsigned bq[4], bo[4];
            ldsm_x4(bq, AQ::at(qd_b, nt * 16, kk * 16));
            ldsm_x4(bo, AQ::at(qd_b, nt * 16, kk * 16) + kTileQ);
            T::mma(st[2 * nt], ak, bq[0], bq[1]);
            T::mma(st[2 * nt + 1], ak, bq[2], bq[3]);
            T::mma(dpt[2 * nt], av, bo[0], bo[1]);
            T::mma(dpt[2 * nt + 1], av, bo[2], bo[3]);
          }
        }

        // st <- P^T, dpt <- dS^T (without the final `scale`, applied at the end). Element (j, e)
        // is query m0 + j * 8 + tig * 2 + (e & 1) of key key_a + (e >> 1) * 8.
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
          const int ql = j * 8 + tig * 2;
          const float l2[2] = {sLse[ql], sLse[ql + 1]}, dl[2] = {sDelta[ql], sDelta[ql + 1]};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pr = ex2(fmaf(st[j][e], scale_log2, -l2[e & 1]));
            st[j][e] = pr;
            dpt[j][e] = pr * (dpt[j][e] - dl[e & 1]);
          }
        }

        // dV += P^T dO and dK += dS^T Q over this warp's DW columns.
#pragma unroll
        for (int kq = 0; kq < BM / 16; ++kq) {
          unsigned ap[4], as[4];
          pack_a_frag<T>(ap, st[2 * kq], st[2 * kq + 1]);
          pack_a_frag<T>(as, dpt[2 * kq], dpt[2 * kq + 1]);
#pragma unroll
          for (int dt = 0; dt < DW / 16; ++dt) {
            unsigned bo[4], bq[4];
            ldsm_x4_trans(bo, AQ::at(qd_t, kq * 16, dt * 16) + kTileQ);
            ldsm_x4_trans(bq, AQ::at(qd_t, kq * 16, dt * 16));
            T::mma(acc_dv[2 * dt], ap, bo[0], bo[1]);
            T::mma(acc_dv[2 * dt + 1], ap, bo[2], bo[3]);
            T::mma(acc_dk[2 * dt], as, bq[0], bq[1]);
            T::mma(acc_dk[2 * dt + 1], as, bq[2], bq[3]);
          }
          // dS^T to shared memory (one warp per key slice writes it).
          if (dpart == 0) {
#pragma unroll
            for (int jj = 0; jj < 2; ++jj) {
              *reinterpret_cast<unsigned*>(smem_raw + AS::at(ds_st, 0, (2 * kq + jj) * 8)) = as[2 * jj];
              *reinterpret_cast<unsigned*>(smem_raw + AS::at(ds_st, 8, (2 * kq + jj) * 8)) = as[2 * jj + 1];
            }
          }
        }
        __syncthreads();  // from here on nobody reads sQ, sdO, sLse, sDelta of this step

        if (left > 1) {  // the next step's loads: every row below Sq, the lse = -inf zero fill
          if (++ii == f_hi) ++hh, ii = f_lo;
          const int mn = m_first + ii * BM;
          const long long row_off = (long long)mn * q_stride + hh * D;
          const long long lrow = lse_b + (long long)hh * p.seq_q + mn;
          constexpr int kChunks = D / 8;
          if constexpr (NT % kChunks == 0 && BM % (NT / kChunks) == 0 && (NT / kChunks) % 8 == 0) {
            constexpr int kStep = NT / kChunks;
            const int r0 = tid / kChunks, col = (tid % kChunks) * 8;
            const unsigned dst = kOffQ + AQ::thread_off(r0, col);  // + i kStep rows: the same swizzle
#pragma unroll
            for (int i = 0; i < BM / kStep; ++i) {
              const int r = r0 + i * kStep;
              const int bytes = p.lse[lrow + r] != neg_inf() ? 16 : 0;
              const long long off = row_off + (long long)r * q_stride + col;
              cp_async16_s(s0 + dst + 2u * (unsigned)(i * kStep * AQ::W), gQb + off, bytes);
              cp_async16_s(s0 + dst + 2u * (unsigned)(i * kStep * AQ::W) + kTileQ, gdOb + off, bytes);
            }
          } else {
            static_assert(BM * kChunks % NT == 0, "Q chunks per thread");
#pragma unroll
            for (int i = 0; i < BM * kChunks / NT; ++i) {
              const TileChunk c = tile_chunk<BM, D>(tid + i * NT);
              const int bytes = p.lse[lrow + c.row] != neg_inf() ? 16 : 0;
              const long long off = row_off + (long long)c.row * q_stride + c.col;
              const unsigned dst = kOffQ + AQ::thread_off(c.row, c.col);
              cp_async16_s(s0 + dst, gQb + off, bytes);
              cp_async16_s(s0 + dst + kTileQ, gdOb + off, bytes);
            }
          }
          cp_async_commit();
          if (tid < BM) {
            const float l = p.lse[lrow + tid];
            const bool hide = l == neg_inf();
            sLse[tid] = hide ? -neg_inf() : l * kLog2e;
            sDelta[tid] = hide ? 0.f : p.delta[lrow + tid];
          }
        }

#pragma unroll
        for (int k = 0; k < kPer; ++k) {
          float acc[4][4];
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk) {
            unsigned a[4];
            ldsm_x4_trans(a, AS::at(ds_a, kk * 16, 0));
#pragma unroll
            for (int dt = 0; dt < 2; ++dt) {
              unsigned bk[4];
              ldsm_x4_trans(bk, AKV::at(k_t, kk * 16, k * kS * 32 + dt * 16));
              T::mma(acc[2 * dt], a, bk[0], bk[1]);
              T::mma(acc[2 * dt + 1], a, bk[2], bk[3]);
            }
          }
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float* const dst = dq + (r ? dq_r8 : 0) + k * kS * 32;  // then + nt * 8 + (e & 1)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
              red_add_f32(dst + nt * 8, acc[nt][2 * r]);
              red_add_f32(dst + nt * 8 + 1, acc[nt][2 * r + 1]);
            }
          }
        }
        __syncthreads();  // sdS is rewritten by the next step
      }
    }
  }
  // dK (times scale) and dV; keys past kv_len (and tiles nobody sees) get exact zeros.
  unsigned short* gdK = static_cast<unsigned short*>(p.dk) + kv_off;
  unsigned short* gdV = static_cast<unsigned short*>(p.dv) + kv_off;
#pragma unroll
  for (int dt = 0; dt < DW / 8; ++dt) {
    const int col = dpart * DW + dt * 8 + tig * 2;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = key_a + r * 8;
      if (key < p.seq_k) {
        *reinterpret_cast<unsigned*>(gdK + (long long)key * kv_stride + col) =
            T::pack2(acc_dk[dt][2 * r] * p.scale, acc_dk[dt][2 * r + 1] * p.scale);
        *reinterpret_cast<unsigned*>(gdV + (long long)key * kv_stride + col) =
            T::pack2(acc_dv[dt][2 * r], acc_dv[dt][2 * r + 1]);
      }
    }
  }
}

}  // namespace exla_rs
