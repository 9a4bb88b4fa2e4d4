// Forward attention for Hopper (sm_90a), FlashAttention-3's design: warp specialisation with a
// TMA producer warp and two wgmma consumer warpgroups that take turns on the tensor cores.
//
// Block = 384 threads, one block per SM, persistent over the work tiles (128 query rows of one
// head of one batch row), heaviest (causal: last) query tiles first.
//   warpgroup 0 (producer, 56 registers; 40 at D = 256): warp 0 loads Q once per tile and K/V
//     tiles into a ring of kStages shared-memory stages with TMA (cp.async.bulk.tensor,
//     SWIZZLE_128B), each completing on an mbarrier; it zeroes the V rows past kv_len (the tensor
//     cores multiply P = 0 by them, and 0 * NaN = NaN) before it hands such a stage over.
//   warpgroups 1 and 2 (consumers, 224 registers each; 232 at D = 256): 64 query rows each.
//     S = Q K^T with wgmma SS (both operands K-major in shared memory), softmax in registers (exp2
//     domain, masks only on tiles that straddle a bound), O += P V with wgmma RS: P is the S
//     accumulator re-packed in registers, V is read MN-major (transposed by the instruction).
//     Each consumer issues the next S product and the previous P V product together, inside its
//     turn (a named-barrier ping-pong), then does its softmax while the other consumer's products
//     run.
// Semantics are the contract's (docs/flash-attention-contract.md). The optional operands come in
// the mma.sync kernels' compile-time feature sets (F, extras.cuh: kFeatMasks = key_mask, bias,
// ALiBi; kFeatDropout = dropout, the same Philox bits as every backend), one instantiation per set
// (generate.py); a clear bit compiles its feature out, so the plain set (F = 0) is the kernel it
// was. In a masked set the consumers add bias and ALiBi to the scores after scale and softcap, hide
// key_mask's keys (a warp ballot of the tile's mask bytes) with the interval test, drop entries of
// P after the row sums, and the producer inspects V for non-finite values on every tile some
// element of which key_mask or a bias (-inf) may hide. D = 256 has no dropout set (generate.py
// NO_SM90: the generator does not fit the consumers' registers there).
#pragma once

#include "../common.cuh"
#include "../extras.cuh"
#include "hopper.cuh"

namespace exla_rs {
namespace sm90 {

template <int D>
struct FwdTraits {
  static_assert(D == 64 || D == 128 || D == 256, "sm90 forward head dims: 64, 128, 256");
  static constexpr int kHeadDim = D;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kRowsPerConsumer = 64;  // one wgmma M
  static constexpr int kBlockM = kRowsPerConsumer * kConsumers;
  // S (kBlockN / 2 floats) and O (D / 2) both live in a consumer's registers: D = 256 halves N.
  static constexpr int kBlockN = D <= 128 ? 128 : 64;
  static constexpr int kStages = D <= 64 ? 3 : 2;
  static constexpr int kColBlocks = D / 64;  // 64-element (128-byte) column blocks per tile row
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kKVBytes = kBlockN * D * 2;
  // Register split (setmaxnreg). The block starts with kLaunchRegs per thread; the producer
  // warpgroup gives (kLaunchRegs - P) * 128 back to the block's pool and each consumer takes
  // (C - kLaunchRegs) * 128 from it. setmaxnreg.inc waits until the pool holds its request, so a
  // split that asks more than the launch pool hangs every call (48/232 did at D = 256 on an
  // H200). D = 256 consumers spill at 224 and the producer at 40 needs its V inspection loop's
  // rare path rolled (fwd_producer); sass_stats.py --check-regpool reads the same sum from the
  // cubins, and the executor (crates/exla-rs-gpusim) models the pool.
  static constexpr int kLaunchRegs = launch_reg_cap(kThreads);
  static constexpr int kProducerRegs = D == 256 ? 40 : 56;
  static constexpr int kConsumerRegs = D == 256 ? 232 : 224;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * kLaunchRegs,
                "setmaxnreg: the producer/consumer split asks more registers than the block holds at launch");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
                "setmaxnreg: a multiple of 8 in 24..256");
  // Shared memory: Q | K stages | V stages | mbarriers, every tile 1024-byte aligned (swizzle atom).
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKVBytes;
  static constexpr int kBarOffset = kVOffset + kStages * kKVBytes;
  static constexpr int kBarriers = 3 + 4 * kStages;  // q_full, q_empty, v_raw, k/v full/empty
  static constexpr int kPoisonOffset = kBarOffset + kBarriers * 8;
  static constexpr int kMaxPoison = 32;  // non-finite V elements listed per stage (more: per key)
  static constexpr int kPoisonBytes = 160;  // sizeof(Poison)
  static constexpr int kSmemBytes = kPoisonOffset + kStages * kPoisonBytes + 1024;  // + alignment slack
  // Consumer warps that release a stage read only through wgmma (K, Q): lane 0 of each, after its
  // warpgroup's wgmma wait. A V stage also holds the Poison list, which every consumer thread
  // reads with ordinary loads and the producer rewrites after v_empty: every consumer thread
  // arrives on v_empty and every producer lane on v_full, each releasing its own accesses
  // (compute-sanitizer racecheck reported the count's read and rewrite as a race on an H200,
  // 2026-11-28, when one lane per warp arrived).
  static constexpr int kReleasers = kConsumers * 4;
  static constexpr int kVReleasers = kConsumers * 128;
  static constexpr int kVFillers = 32;
  static constexpr int kTurnBarrier = 1;  // named barriers 1 and 2: consumer c's turn
};

// Non-finite V values on a tile some rows of the block see and others do not: the tensor cores
// would multiply the hidden rows' P = 0 by them (0 * inf = NaN). The producer zeroes them in
// shared memory and lists them here per stage; a consumer marks NaN the output columns of its rows
// that do see such a key (what the exact sum gives, up to inf vs NaN), before that stage's P V.
struct Poison {
  int count;                // entries found (may exceed kMaxPoison: then `keys` is what counts)
  unsigned keys[4];         // bit r: key n0 + r of the tile holds a non-finite value
  unsigned entry[32];       // (key in tile << 16) | head-dim column, the first kMaxPoison found
  unsigned pad[3];
};
static_assert(sizeof(Poison) == 160, "kPoisonBytes");

template <class Tr>
EXLA_RS_SM90 Poison* poison_of(unsigned char* smem, int stage) {
  return reinterpret_cast<Poison*>(smem + Tr::kPoisonOffset) + stage;
}

struct FwdBarriers {
  u64* q_full;
  u64* q_empty;
  u64* v_raw;  // V tiles that need rows zeroed land here first (producer-private)
  u64* k_full;
  u64* k_empty;
  u64* v_full;
  u64* v_empty;
};

template <class Tr>
EXLA_RS_SM90 FwdBarriers fwd_barriers(unsigned char* smem) {
  u64* b = reinterpret_cast<u64*>(smem + Tr::kBarOffset);
  constexpr int S = Tr::kStages;
  return {b, b + 1, b + 2, b + 3, b + 3 + S, b + 3 + 2 * S, b + 3 + 3 * S};
}

// One work tile: 128 query rows of one (batch, head). Heaviest first: under a causal mask the last
// query tiles see the most keys, so they start first and the short ones fill the tail.
struct WorkTile {
  int m_block, head, batch;
};

EXLA_RS_SM90 WorkTile work_tile(int t, int m_blocks, int heads, int batch) {
  int hb = heads * batch;
  int rest = t % hb;
  return {m_blocks - 1 - t / hb, rest % heads, rest / heads};
}

// The contract's visible keys of a query at position `pos` form the interval [lo, hi).
struct KeyInterval {
  long long window_left, window_right;
  int kv;  // kv_len clamped to [0, Sk]

  EXLA_RS_SM90 int lo(long long pos) const {
    if (window_left < 0) return 0;
    long long x = pos - window_left;
    return x < 0 ? 0 : (x > kv ? kv : static_cast<int>(x));
  }
  EXLA_RS_SM90 int hi(long long pos) const {
    if (window_right < 0) return kv;
    long long x = pos + window_right + 1;
    return x < 0 ? 0 : (x > kv ? kv : static_cast<int>(x));
  }
};

// The key blocks a range of query rows visits: [first, last) in kBlockN units (lo and hi are
// monotone in the row, so the first row bounds lo and the last row bounds hi).
struct KeyBlocks {
  int first, count;
};

template <class Tr>
EXLA_RS_SM90 KeyBlocks key_blocks(const KeyInterval& ki, long long pos_first, long long pos_last) {
  int lo = ki.lo(pos_first), hi = ki.hi(pos_last);
  if (hi <= lo) return {0, 0};
  int first = lo / Tr::kBlockN;
  return {first, (hi + Tr::kBlockN - 1) / Tr::kBlockN - first};
}

EXLA_RS_SM90 float exp2_approx(float x) { return ptx::ex2_approx_ftz(x); }
EXLA_RS_SM90 float tanh_approx(float x) { return ptx::tanh_approx(x); }

// ---------------------------------------------------------------------------------------------
// Descriptor addresses (executor/tests/sm90_models_test.cpp reads a tile back through the same numbers).
// Q and K are K-major: a k-step of 16 elements moves 32 bytes inside a 128-byte swizzled row
// (the hardware applies the swizzle to the final address), and every 4 k-steps the next column
// block. V is MN-major (head dim contiguous): a k-step of 16 keys is two whole 8-row atoms,
// and the N extent (head dim) crosses column blocks at the leading byte offset.

template <class Tr>
EXLA_RS_SM90 unsigned kmajor_kstep_offset(int kk, int rows_in_block) {
  return (kk / 4) * rows_in_block * kSwizzleRowBytes + (kk % 4) * 32;
}

template <class Tr>
EXLA_RS_SM90 unsigned v_kstep_offset(int kk) {
  return kk * 16 * kSwizzleRowBytes;
}

template <class Tr>
EXLA_RS_SM90 u64 v_desc(unsigned v_stage_addr, int kk) {
  return smem_desc(v_stage_addr + v_kstep_offset<Tr>(kk), Tr::kBlockN * kSwizzleRowBytes, kAtomBytes);
}

// ---------------------------------------------------------------------------------------------

// Whether every key of the tile [n0, n0 + BN) that key_mask covers is visible (keys >= seq_k arrive
// as zeros and need no inspection): one warp, one ballot per 32 keys.
template <class Tr>
EXLA_RS_SM90 bool key_mask_tile_all_visible(const ExtraParams& x, long long mask_row, int n0, int seq_k, int lane) {
  bool all = true;
#pragma unroll 1
  for (int k = 0; k < Tr::kBlockN / 32; ++k) {
    const int key = n0 + 32 * k + lane;
    all &= __all_sync(0xffffffffu, key >= seq_k || key_mask_visible(x.key_mask, x.key_mask_bytes, mask_row + key));
  }
  return all;
}

template <class T, class Tr, int F>
EXLA_RS_SM90 void fwd_producer(const FwdParams& p, const TensorMap* tq, const TensorMap* tk, const TensorMap* tv,
                               unsigned char* smem, const FwdBarriers& bar) {
  const int lane = threadIdx.x % 32;
  const int m_blocks = (p.seq_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int tiles = m_blocks * p.heads * p.batch;
  const int group = p.heads / p.kv_heads;
  int kv_iter = 0, q_iter = 0;
  unsigned raw_phase = 0;
  if (lane == 0) {
    tma_prefetch_map(tq);
    tma_prefetch_map(tk);
    tma_prefetch_map(tv);
  }
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const WorkTile w = work_tile(t, m_blocks, p.heads, p.batch);
    const int m0 = w.m_block * Tr::kBlockM;
    const int kv = imax(0, imin(p.kv_len[w.batch], p.seq_k));
    const KeyInterval ki{p.window_left, p.window_right, kv};
    const long long pos0 = static_cast<long long>(p.q_start[w.batch]) + m0;
    const KeyBlocks kb = key_blocks<Tr>(ki, pos0, pos0 + imin(Tr::kBlockM, p.seq_q - m0) - 1);
    if (kb.count == 0) continue;
    const int kv_head = w.head / group;
    const int valid = imin(Tr::kBlockM, p.seq_q - m0);
    const int lo_last = ki.lo(pos0 + valid - 1), hi_first = ki.hi(pos0);
    if (lane == 0) {
      mbar_wait(bar.q_empty, (q_iter & 1) ^ 1);
      mbar_arrive_expect_tx(bar.q_full, Tr::kQBytes);
      for (int c = 0; c < Tr::kColBlocks; ++c)
        tma_load_4d(tq, bar.q_full, smem + Tr::kQOffset + c * Tr::kBlockM * kSwizzleRowBytes, c * 64, m0, w.head,
                    w.batch);
    }
    ++q_iter;
    for (int i = 0; i < kb.count; ++i, ++kv_iter) {
      const int n0 = (kb.first + kb.count - 1 - i) * Tr::kBlockN;  // last (straddling) block first
      const int stage = kv_iter % Tr::kStages;
      const unsigned phase = (kv_iter / Tr::kStages) & 1;
      unsigned char* k_dst = smem + Tr::kKOffset + stage * Tr::kKVBytes;
      unsigned char* v_dst = smem + Tr::kVOffset + stage * Tr::kKVBytes;
      // Keys in [kv, Sk) are padding the contract lets hold anything; keys >= Sk arrive as zeros.
      const int pad_from = kv - n0;
      const bool pad = pad_from < Tr::kBlockN && kv < p.seq_k;
      // A tile every row of the block sees whole needs no inspection: non-finite values reach
      // exactly the rows that see them.
      const bool straddles = !(n0 >= lo_last && n0 + Tr::kBlockN <= hi_first);
      bool inspect = pad || straddles;
      // Masked sets: a bias may hide any element (-inf), key_mask any key: their V is inspected
      // too (a tile key_mask shows whole needs it no more than the plain set does).
      if constexpr ((F & kFeatMasks) != 0) {
        if (p.x.bias != nullptr)
          inspect = true;
        else if (p.x.key_mask != nullptr && !inspect)
          inspect = !key_mask_tile_all_visible<Tr>(p.x, static_cast<long long>(w.batch) * p.seq_k, n0, p.seq_k, lane);
      }
      Poison* ps = poison_of<Tr>(smem, stage);
      if (lane == 0) {
        mbar_wait(bar.k_empty + stage, phase ^ 1);
        mbar_arrive_expect_tx(bar.k_full + stage, Tr::kKVBytes);
        for (int c = 0; c < Tr::kColBlocks; ++c)
          tma_load_4d(tk, bar.k_full + stage, k_dst + c * Tr::kBlockN * kSwizzleRowBytes, c * 64, n0, kv_head, w.batch);
        mbar_wait(bar.v_empty + stage, phase ^ 1);
        ps->count = 0;  // published by the arrive on v_full (release), read after its wait
        for (int k = 0; k < 4; ++k) ps->keys[k] = 0;
        u64* done = inspect ? bar.v_raw : bar.v_full + stage;
        mbar_arrive_expect_tx(done, Tr::kKVBytes);
        for (int c = 0; c < Tr::kColBlocks; ++c)
          tma_load_4d(tv, done, v_dst + c * Tr::kBlockN * kSwizzleRowBytes, c * 64, n0, kv_head, w.batch);
      }
      // Lane 0 alone waited for the stage to be free: the other lanes arrive on v_full only after it
      // (an arrive before that wait could land in the stage's previous phase).
      __syncwarp();
      if (!inspect && lane != 0) mbar_arrive(bar.v_full + stage);  // lane 0's arrive carries the bytes
      if (inspect) {
        mbar_wait(bar.v_raw, raw_phase);
        raw_phase ^= 1;
        const int keep = pad ? imax(pad_from, 0) : Tr::kBlockN;  // rows below are kept
        for (int c = 0; c < Tr::kColBlocks; ++c) {
          Chunk16* block = reinterpret_cast<Chunk16*>(v_dst + c * Tr::kBlockN * kSwizzleRowBytes);
          // Whole 128-byte rows past kv_len: the swizzle permutes chunks within a row, so row r
          // of a column block is chunks [8r, 8r + 8) whatever the swizzle.
          // The producer runs on 40 registers at D = 256: this loop stays rolled, and a chunk with
          // inf/NaN lists its elements from a bit mask in a rolled loop (unrolled per element, the
          // listing spilled there).
#pragma unroll 1
          for (int x = keep * 8 + lane; x < Tr::kBlockN * 8; x += 32) block[x] = Chunk16{0, 0, 0, 0};
          for (int x = lane; x < keep * 8; x += 32) {
            Chunk16 ch = block[x];
            const unsigned words[4] = {ch.x, ch.y, ch.z, ch.w};
            unsigned bad = 0;  // bit k: element k of the chunk is inf/NaN
#pragma unroll
            for (int k = 0; k < 8; ++k)
              bad |= nonfinite1<T>(static_cast<unsigned short>(words[k / 2] >> (16 * (k % 2)))) ? 1u << k : 0u;
            if (!bad) continue;
            zero_nonfinite_chunk<T>(ch);
            block[x] = ch;
            const int r = x / 8;
            // (key << 16) | head-dim column of element 0 of the logical (un-swizzled) chunk.
            const unsigned base = (static_cast<unsigned>(r) << 16) | (c * 64 + ((x % 8) ^ (r % 8)) * 8);
            atomicOr(&ps->keys[r / 32], 1u << (r % 32));
            int slot = atomicAdd(&ps->count, __popc(bad));
            for (; bad && slot < Tr::kMaxPoison; bad &= bad - 1, ++slot) ps->entry[slot] = base + __ffs(bad) - 1;
          }
        }
        fence_proxy_async_smem();
        mbar_arrive(bar.v_full + stage);  // every lane: the chunks it zeroed and the entries it listed
      }
    }
  }
}

// What a consumer's key-tile step reads, fixed for one work tile.
struct ConsumerView {
  unsigned q_addr, k_addr, v_addr;
  int turn_mine, turn_other, lane, quad_col;
  bool softcap;
  float cap_in, cap_out, scale_log2;
  int wg_lo_max, wg_hi_min, lo0, hi0, lo1, hi1;
  int first, count;
  unsigned char* smem;
  // The optional features (masked / dropout sets; unused and compiled out in the plain set).
  int batch, head, kv;
  int row0, row1;    // this thread's two rows (clamped to Sq: rows past it are never stored)
  int row_a;         // the unclamped first row (dropout's counter rows are row_a and row_a + 8)
  long long q_start;  // q_start[b]: row i's position is q_start + i
  float slope_l2;    // ALiBi: -slope[h] * log2(e)
  bool has_km, has_bias, has_alibi, has_drop;
};

// Whether a key of [lo, hi) of row h (0: row0, 1: row1) is hidden by key_mask or a -inf bias (the
// rare non-finite-V path; the element's key is below kv_len, so the reads are in bounds).
template <int F>
EXLA_RS_SM90 bool hidden_by_extras(const FwdParams& p, const ConsumerView& cv, int h, int key) {
  if constexpr ((F & kFeatMasks) == 0) {
    return false;
  } else {
    const ExtraParams& x = p.x;
    if (cv.has_km && !key_mask_visible(x.key_mask, x.key_mask_bytes, static_cast<long long>(cv.batch) * p.seq_k + key)) return true;
    return cv.has_bias && bias_load(x.bias, x.bias_dtype, bias_offset(x, cv.batch, cv.head, h ? cv.row1 : cv.row0, key)) == neg_inf();
  }
}

// Marks NaN the output columns of this thread's rows that see a non-finite V value the producer
// zeroed in the tile starting at key n0 (before that tile's P V; O is not in flight then).
// Masked sets: a key that key_mask or a -inf bias hides from the row does not count.
template <class Tr, int F>
EXLA_RS_SM90 void mark_poisoned(const Poison* ps, int n0, int lo0, int hi0, int lo1, int hi1, int quad_col,
                                float (&o)[Tr::kHeadDim / 2], const FwdParams& p, const ConsumerView& cv) {
  const int count = ps->count;
  if (count == 0) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int a = (h ? lo1 : lo0) - n0, b = (h ? hi1 : hi0) - n0;
    if (count > Tr::kMaxPoison) {  // too many to list: every column of a row seeing a flagged key
      bool sees = false;
      for (int r = imax(a, 0); r < imin(b, Tr::kBlockN); ++r) {
        if constexpr ((F & kFeatMasks) == 0)
          sees |= (ps->keys[r / 32] >> (r % 32)) & 1u;
        else
          sees |= ((ps->keys[r / 32] >> (r % 32)) & 1u) && !hidden_by_extras<F>(p, cv, h, n0 + r);
      }
      if (sees)
#pragma unroll
        for (int e = 0; e < Tr::kHeadDim / 2; ++e)
          if ((e / 2) % 2 == h) o[e] = qnan();
      continue;
    }
    for (int k = 0; k < count; ++k) {
      const int r = static_cast<int>(ps->entry[k] >> 16), col = static_cast<int>(ps->entry[k] & 0xffffu);
      if (r < a || r >= b || hidden_by_extras<F>(p, cv, h, n0 + r)) continue;
#pragma unroll
      for (int e = 0; e < Tr::kHeadDim / 2; ++e)
        if ((e / 2) % 2 == h && (e / 4) * 8 + quad_col + (e % 2) == col) o[e] = qnan();
    }
  }
}

// z += (bias + ALiBi) * log2(e) on this thread's scores of the tile at n0 (exp2 domain, after scale
// and softcap). Element e is row (e / 2) % 2 (row0 / row1), key n0 + 8 (e / 4) + quad_col + e % 2;
// keys at or past kv_len are hidden (and may lie past Sk): their bias is not read.
template <class Tr, class BT>
EXLA_RS_SM90 void add_bias_tile_sm90(float (&s)[Tr::kBlockN / 2], const FwdParams& p, const ConsumerView& cv, int n0) {
  const ExtraParams& x = p.x;
  const int k_lim = cv.kv - n0 - cv.quad_col;  // element offsets below this are readable keys
  const long long base0 = bias_offset(x, cv.batch, cv.head, cv.row0, n0 + cv.quad_col);
  const long long base1 = bias_offset(x, cv.batch, cv.head, cv.row1, n0 + cv.quad_col);
#pragma unroll
  for (int e = 0; e < Tr::kBlockN / 2; ++e) {
    const int c = (e / 4) * 8 + (e % 2);
    if (c < k_lim) s[e] += BT::load(x.bias, ((e / 2) % 2 ? base1 : base0) + c * x.bias_stride_k) * kLog2e;
  }
}

template <class Tr>
EXLA_RS_SM90 void add_extras(float (&s)[Tr::kBlockN / 2], const FwdParams& p, const ConsumerView& cv, int n0) {
  if (cv.has_bias) {  // one loop per dtype, no per-element switch
    if (p.x.bias_dtype == 0)
      add_bias_tile_sm90<Tr, BiasF32>(s, p, cv, n0);
    else if (p.x.bias_dtype == 1)
      add_bias_tile_sm90<Tr, BiasF16>(s, p, cv, n0);
    else
      add_bias_tile_sm90<Tr, BiasBF16>(s, p, cv, n0);
  }
  if (cv.has_alibi) {
    // Distance of each row to the thread's first key of the tile; elements differ by constants.
    const int rel0 = alibi_rel(cv.q_start + cv.row0, n0 + cv.quad_col);
    const int rel1 = alibi_rel(cv.q_start + cv.row1, n0 + cv.quad_col);
#pragma unroll
    for (int e = 0; e < Tr::kBlockN / 2; ++e)
      s[e] += cv.slope_l2 * alibi_dist(((e / 2) % 2 ? rel1 : rel0) - ((e / 4) * 8 + (e % 2)));
  }
}

// The contract's dropout keep bits of this thread's elements of the tile at n0, as the mma.sync
// forward draws them (flash_fwd.cuh dropout_tile; extras.cuh's generator): the accumulator's
// element e of each 64 keys is that kernel's m16n8 fragment (e / 4, e % 4), row row_a + 8 ((e / 2)
// % 2), key n0 + 8 (e / 4) + 2 (lane % 4) + e % 2, so bit e % 32 of word e / 32 keeps element e.
// Per pair of n8 tiles the quad's 4 lanes draw one x call each (2 rows x 2 tiles) and a 4 x 4
// transpose hands every lane its words: one Philox call per 8 elements.
template <class Tr>
EXLA_RS_SM90 void dropout_bits(unsigned (&bits)[Tr::kBlockN / 64], const FwdParams& p, const ConsumerView& cv, int n0) {
  const int tig = cv.lane % 4;
  // Read per tile (the key from global memory, the threshold from the parameters): no registers
  // held through the key loop for it.
  const Dropout dr = Dropout::load(p.x);
#pragma unroll
  for (int part = 0; part < Tr::kBlockN / 64; ++part) {
    const unsigned oct0 = static_cast<unsigned>(n0 + 64 * part) >> 3;
    unsigned b = 0;
#pragma unroll 1
    for (int jp = 0; jp < 4; ++jp) {
      const Philox4 r = dropout_x(dr.k0, dr.k1, static_cast<unsigned>(cv.batch), static_cast<unsigned>(cv.head),
                                  static_cast<unsigned>(cv.row_a + 8 * (tig & 1)), oct0 + static_cast<unsigned>(2 * jp + (tig >> 1)));
      unsigned a[4] = {r.x[0], r.x[1], r.x[2], r.x[3]};
      transpose4_lanes<1>(a, tig);
      b |= dr.keep8(a, tig, oct0 + 2 * jp, static_cast<unsigned>(cv.row_a), 8u, static_cast<unsigned>(cv.batch), static_cast<unsigned>(cv.head))
           << (8 * jp);
    }
    bits[part] = b;
  }
}

// One key tile of a consumer: S = Q K^T and (kPrev) the previous tile's O += P V, issued together
// in this consumer's turn; the softmax of S; P re-packed for the next turn. The first tile has no
// previous P V: a separate instantiation, so the steady-state loop has no branch around the
// asynchronous products (a merge point there makes ptxas copy accumulators mid-flight).
template <class T, class Tr, int F, bool kPrev>
EXLA_RS_SM90 void consumer_tile(const FwdParams& p, const ConsumerView& cv, const FwdBarriers& bar, int i, int kv_iter, int& prev_stage,
                                unsigned& prev_phase, int& prev_n0, float (&o)[Tr::kHeadDim / 2], unsigned (&pf)[Tr::kBlockN / 16][4],
                                float (&m_run)[2], float (&l_run)[2]) {
  constexpr int BN = Tr::kBlockN;
  constexpr int kSAcc = BN / 2;
  constexpr int kOAcc = Tr::kHeadDim / 2;
  constexpr int kPSteps = BN / 16;
  constexpr int kQSteps = Tr::kHeadDim / 16;
  const unsigned q_addr = cv.q_addr, k_addr = cv.k_addr, v_addr = cv.v_addr;
  const int turn_mine = cv.turn_mine, turn_other = cv.turn_other, lane = cv.lane, quad_col = cv.quad_col;
  const bool softcap = cv.softcap;
  const float cap_in = cv.cap_in, cap_out = cv.cap_out, scale_log2 = cv.scale_log2;
  const int wg_lo_max = cv.wg_lo_max, wg_hi_min = cv.wg_hi_min, lo0 = cv.lo0, hi0 = cv.hi0, lo1 = cv.lo1, hi1 = cv.hi1;
      const int n0 = (cv.first + cv.count - 1 - i) * BN;
      const int stage = kv_iter % Tr::kStages;
      const unsigned phase = (kv_iter / Tr::kStages) & 1;
      const unsigned k_stage = k_addr + stage * Tr::kKVBytes;
      float s[kSAcc];
      mbar_wait(bar.k_full + stage, phase);
      if constexpr (kPrev) {
        mbar_wait(bar.v_full + prev_stage, prev_phase);
        mark_poisoned<Tr, F>(poison_of<Tr>(cv.smem, prev_stage), prev_n0, lo0, hi0, lo1, hi1, quad_col, o, p, cv);
      }
      // key_mask: this lane's mask entries of the tile, loaded before the turn so that their
      // latency hides behind the products (keys past kv_len are hidden by the interval test and
      // not read); one ballot per 32 keys after the wait.
      [[maybe_unused]] bool km_lane[BN / 32];
      if constexpr ((F & kFeatMasks) != 0) {
        if (cv.has_km) {
          const long long mask_row = static_cast<long long>(cv.batch) * p.seq_k;
#pragma unroll
          for (int k = 0; k < BN / 32; ++k) {
            const int key = n0 + 32 * k + lane;
            km_lane[k] = key < cv.kv && key_mask_visible(p.x.key_mask, p.x.key_mask_bytes, mask_row + key);
          }
        }
      }
      named_sync(turn_mine, 256);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk) {
        u64 da = smem_desc(q_addr + kmajor_kstep_offset<Tr>(kk, Tr::kBlockM), 16, kAtomBytes);
        u64 db = smem_desc(k_stage + kmajor_kstep_offset<Tr>(kk, BN), 16, kAtomBytes);
        wgmma_ss<T>(s, da, db, kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      if constexpr (kPrev) {
        const unsigned v_stage = v_addr + prev_stage * Tr::kKVBytes;
#pragma unroll
        for (int kk = 0; kk < kPSteps; ++kk) wgmma_rs<T, 1>(o, pf[kk], v_desc<Tr>(v_stage, kk), 1);
        wgmma_commit();
      }
      named_arrive(turn_other, 256);
      if constexpr (kPrev) {
        wgmma_wait<1>();
      } else {
        wgmma_wait<0>();
      }
#pragma unroll
      for (int e = 0; e < kSAcc; ++e) pin(s[e]);
      if (lane == 0) mbar_arrive(bar.k_empty + stage);
      if (i == cv.count - 1 && lane == 0) mbar_arrive(bar.q_empty);  // last read of Q

      // Scores in the exp2 domain; the element test only where the tile straddles a bound.
#pragma unroll
      for (int e = 0; e < kSAcc; ++e)
        s[e] = softcap ? tanh_approx(s[e] * cap_in) * cap_out : s[e] * scale_log2;
      // Bias and ALiBi after scale and softcap, before the masks (a hidden element becomes -inf
      // whatever its bias, NaN included); key_mask's bits for the hide below.
      [[maybe_unused]] unsigned km[BN / 32];
      if constexpr ((F & kFeatMasks) != 0) {
        add_extras<Tr>(s, p, cv, n0);
        if (cv.has_km)
#pragma unroll
          for (int k = 0; k < BN / 32; ++k) km[k] = __ballot_sync(0xffffffffu, km_lane[k]) >> quad_col;
      }
      if (!(n0 >= wg_lo_max && n0 + BN <= wg_hi_min) || ((F & kFeatMasks) != 0 && cv.has_km)) {
        const int a0 = lo0 - n0, b0 = hi0 - n0, a1 = lo1 - n0, b1 = hi1 - n0;
#pragma unroll
        for (int e = 0; e < kSAcc; ++e) {
          const int col = (e / 4) * 8 + quad_col + (e % 2);
          const bool upper = (e / 2) % 2;
          const int a = upper ? a1 : a0, b = upper ? b1 : b0;
          bool hide = col < a || col >= b;
          // Bit (e / 4 % 4) * 8 + e % 2 of word e / 16, after the shift by quad_col: key col.
          if constexpr ((F & kFeatMasks) != 0)
            if (cv.has_km) hide |= !((km[e / 16] >> (((e / 4) % 4) * 8 + (e % 2))) & 1u);
          if (hide) s[e] = neg_inf();
        }
      }
      float corr[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m_run[h];
#pragma unroll
        for (int e = 0; e < kSAcc; ++e)
          if ((e / 2) % 2 == h) mx = fmaxf(mx, s[e]);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float use = mx == neg_inf() ? 0.f : mx;  // a row with no key yet: exp2(-inf) = 0
        corr[h] = exp2_approx(m_run[h] - use);
        m_run[h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int e = 0; e < kSAcc; ++e)
          if ((e / 2) % 2 == h) {
            s[e] = exp2_approx(s[e] - use);
            sum += s[e];
          }
        l_run[h] = l_run[h] * corr[h] + sum;
      }
      // Dropout after the row sums (the softmax is taken first); 1 / (1 - rate) in the epilogue.
      if constexpr ((F & kFeatDropout) != 0) {
        if (cv.has_drop) {
          unsigned drop_bits[BN / 64];
          dropout_bits<Tr>(drop_bits, p, cv, n0);
#pragma unroll
          for (int e = 0; e < kSAcc; ++e)
            if (!((drop_bits[e / 32] >> (e % 32)) & 1u)) s[e] = 0.f;
        }
      }
      if constexpr (kPrev) {
        wgmma_wait<0>();  // P V of the previous tile: its P registers and V stage are free now
#pragma unroll
        for (int e = 0; e < kOAcc; ++e) pin(o[e]);
        mbar_arrive(bar.v_empty + prev_stage);  // every thread: its reads of the stage's Poison list
      }
#pragma unroll
      for (int e = 0; e < kOAcc; ++e) o[e] *= corr[(e / 2) % 2];
      // The S accumulator of 16 keys is exactly the A fragment of P V (rows lane/4 and +8,
      // columns 2 * (lane % 4) and + 8): re-pack in registers, rounded to the input type.
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) pf[kk][j] = T::pack2(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
      prev_stage = stage;
      prev_phase = phase;
      prev_n0 = n0;
}

template <class T, class Tr, int F>
EXLA_RS_SM90 void fwd_consumer(const FwdParams& p, unsigned char* smem, const FwdBarriers& bar, int consumer) {
  constexpr int D = Tr::kHeadDim;
  constexpr int BN = Tr::kBlockN;
  constexpr int kOAcc = D / 2;    // O accumulator floats per thread
  constexpr int kPSteps = BN / 16;  // k-steps of P V (16 keys each)
  using Storage = typename T::Storage;

  const int tid = threadIdx.x % 128;
  const int warp = tid / 32, lane = tid % 32;
  const int quad_col = (lane % 4) * 2;  // first of the two columns this thread holds per 8-group
  // Accumulator layout (PTX ISA, wgmma D fragment): warp w holds rows 16w..16w+15 of the 64;
  // element e is row lane/4 + 8 * ((e / 2) % 2), column 8 * (e / 4) + 2 * (lane % 4) + e % 2.
  const int row_in_tile = consumer * Tr::kRowsPerConsumer + warp * 16 + lane / 4;  // and + 8
  const int turn_mine = Tr::kTurnBarrier + consumer, turn_other = Tr::kTurnBarrier + 1 - consumer;

  const int m_blocks = (p.seq_q + Tr::kBlockM - 1) / Tr::kBlockM;
  const int tiles = m_blocks * p.heads * p.batch;
  const float scale_log2 = p.scale * kLog2e;
  const bool softcap = p.softcap > 0.f;
  const float cap_in = p.scale * p.softcap_inv, cap_out = p.softcap * kLog2e;

  const unsigned q_addr = smem_addr(smem + Tr::kQOffset) + consumer * Tr::kRowsPerConsumer * kSwizzleRowBytes;
  const unsigned k_addr = smem_addr(smem + Tr::kKOffset);
  const unsigned v_addr = smem_addr(smem + Tr::kVOffset);

  if (consumer == 1) named_arrive(Tr::kTurnBarrier, 256);  // consumer 0 takes the first turn
  int kv_iter = 0, q_iter = 0;

  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const WorkTile w = work_tile(t, m_blocks, p.heads, p.batch);
    const int m0 = w.m_block * Tr::kBlockM;
    const int kv = imax(0, imin(p.kv_len[w.batch], p.seq_k));
    const KeyInterval ki{p.window_left, p.window_right, kv};
    const long long pos0 = static_cast<long long>(p.q_start[w.batch]) + m0;
    const int valid_rows = imin(Tr::kBlockM, p.seq_q - m0);
    const KeyBlocks kb = key_blocks<Tr>(ki, pos0, pos0 + valid_rows - 1);

    // This thread's two rows and their key intervals; this warpgroup's bounds decide which
    // tiles need the element test (rows past Sq are clamped: they are never stored).
    const int r0 = imin(row_in_tile, valid_rows - 1), r1 = imin(row_in_tile + 8, valid_rows - 1);
    const int lo0 = ki.lo(pos0 + r0), hi0 = ki.hi(pos0 + r0);
    const int lo1 = ki.lo(pos0 + r1), hi1 = ki.hi(pos0 + r1);
    const int wg_first = imin(consumer * Tr::kRowsPerConsumer, valid_rows - 1);
    const int wg_last = imin(consumer * Tr::kRowsPerConsumer + Tr::kRowsPerConsumer - 1, valid_rows - 1);
    const int wg_lo_max = ki.lo(pos0 + wg_last), wg_hi_min = ki.hi(pos0 + wg_first);

    float o[kOAcc];
#pragma unroll
    for (int e = 0; e < kOAcc; ++e) o[e] = 0.f;
    float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};

    if (kb.count > 0) {
      mbar_wait(bar.q_full, q_iter & 1);
      ++q_iter;
      unsigned pf[kPSteps][4];
      int prev_stage = 0, prev_n0 = 0;
      unsigned prev_phase = 0;
      ConsumerView cv{q_addr,     k_addr,     v_addr,    turn_mine, turn_other, lane,     quad_col,
                      softcap,    cap_in,     cap_out,   scale_log2, wg_lo_max, wg_hi_min, lo0,
                      hi0,        lo1,        hi1,       kb.first,  kb.count,  smem};
      if constexpr (F != 0) {
        cv.batch = w.batch;
        cv.head = w.head;
        cv.kv = kv;
        cv.row0 = m0 + r0;
        cv.row1 = m0 + r1;
        cv.row_a = m0 + row_in_tile;
        cv.q_start = p.q_start[w.batch];
        cv.has_km = (F & kFeatMasks) != 0 && p.x.key_mask != nullptr;
        cv.has_bias = (F & kFeatMasks) != 0 && p.x.bias != nullptr;
        cv.has_alibi = (F & kFeatMasks) != 0 && p.x.alibi_slopes != nullptr;
        cv.has_drop = (F & kFeatDropout) != 0 && p.x.dropout_key != nullptr;
        cv.slope_l2 = cv.has_alibi ? -p.x.alibi_slopes[w.head] * kLog2e : 0.f;
      }
      consumer_tile<T, Tr, F, false>(p, cv, bar, 0, kv_iter++, prev_stage, prev_phase, prev_n0, o, pf, m_run, l_run);
      for (int i = 1; i < kb.count; ++i, ++kv_iter)
        consumer_tile<T, Tr, F, true>(p, cv, bar, i, kv_iter, prev_stage, prev_phase, prev_n0, o, pf, m_run, l_run);
      mbar_wait(bar.v_full + prev_stage, prev_phase);
      mark_poisoned<Tr, F>(poison_of<Tr>(smem, prev_stage), prev_n0, lo0, hi0, lo1, hi1, quad_col, o, p, cv);
      named_sync(turn_mine, 256);
      wgmma_fence();
      const unsigned v_stage = v_addr + prev_stage * Tr::kKVBytes;
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk) wgmma_rs<T, 1>(o, pf[kk], v_desc<Tr>(v_stage, kk), 1);
      wgmma_commit();
      named_arrive(turn_other, 256);
      wgmma_wait<0>();
#pragma unroll
      for (int e = 0; e < kOAcc; ++e) pin(o[e]);
      mbar_arrive(bar.v_empty + prev_stage);  // every thread: its reads of the stage's Poison list
    }

    // Epilogue: o / l and lse per row; a row that saw no key has l = 0: o = 0, lse = -inf. With
    // dropout, kept entries are scaled by 1 / (1 - rate): folded into 1 / l.
    float o_scale = 1.f;
    if constexpr ((F & kFeatDropout) != 0)
      if (p.x.dropout_key != nullptr) o_scale = p.x.dropout_scale;
    float inv[2], lse[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float m = m_run[h] == neg_inf() ? 0.f : m_run[h];
      inv[h] = l > 0.f ? o_scale / l : 0.f;
      lse[h] = l > 0.f ? (m + __log2f(l)) * kLn2 : neg_inf();
    }
    Storage* out = static_cast<Storage*>(p.o);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row_in_tile + 8 * h;
      if (row >= valid_rows) continue;
      const long long i = m0 + row;
      unsigned* dst = reinterpret_cast<unsigned*>(
          out + ((static_cast<long long>(w.batch) * p.seq_q + i) * p.heads + w.head) * D + quad_col);
#pragma unroll
      for (int g = 0; g < D / 8; ++g) dst[g * 4] = T::pack2(o[4 * g + 2 * h] * inv[h], o[4 * g + 2 * h + 1] * inv[h]);
      if (lane % 4 == 0) p.lse[(static_cast<long long>(w.batch) * p.heads + w.head) * p.seq_q + i] = lse[h];
    }
  }
  if (consumer == 0) named_sync(Tr::kTurnBarrier, 256);  // pairs with consumer 1's last hand-over
}

template <class T, int D, int F = 0>
EXLA_RS_SM90 void flash_fwd(const FwdParams& p, const TensorMap* tq, const TensorMap* tk, const TensorMap* tv) {
  using Tr = FwdTraits<D>;
  EXLA_RS_DYNAMIC_SMEM_UNALIGNED(smem_raw);
  // Swizzle atoms must start 1024-byte aligned in the shared window.
  const unsigned raw = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const FwdBarriers bar = fwd_barriers<Tr>(smem);
  if (threadIdx.x == 0) {
    mbar_init(bar.q_full, 1);
    mbar_init(bar.q_empty, Tr::kReleasers);
    mbar_init(bar.v_raw, 1);
    for (int s = 0; s < Tr::kStages; ++s) {
      mbar_init(bar.k_full + s, 1);
      mbar_init(bar.v_full + s, Tr::kVFillers);
      mbar_init(bar.k_empty + s, Tr::kReleasers);
      mbar_init(bar.v_empty + s, Tr::kVReleasers);
    }
    fence_barrier_init();
  }
  __syncthreads();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    regs_release<Tr::kProducerRegs>();
    if (threadIdx.x / 32 == 0) fwd_producer<T, Tr, F>(p, tq, tk, tv, smem, bar);
  } else {
    regs_claim<Tr::kConsumerRegs>();
    fwd_consumer<T, Tr, F>(p, smem, bar, warpgroup - 1);
  }
}

}  // namespace sm90
}  // namespace exla_rs
