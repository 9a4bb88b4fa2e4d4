// Backward attention for Hopper (sm_90a), FlashAttention-3's split of the work: one block per
// (key block of 128 keys, D = 256: 64, kv head, batch) keeps K and V in shared memory and sweeps
// every query tile of 64 rows (of every query head sharing the kv head, for GQA) that sees the block.
//
// Block = 384 threads (one per SM: the shared memory decides):
//   warpgroup 0 (producer, kProducerRegs): warp 0 loads K and V once (TMA), then per query tile
//     Q and dO (TMA, SWIZZLE_128B) and lse * log2(e), delta (ordinary loads) into a ring of
//     kStages stages, each completing on an mbarrier. Rows the forward found fully masked
//     (lse = -inf) get their Q and dO rows zeroed before the stage is handed over (what the
//     mma.sync backward's zero fill does: P^T = 0 must not meet a non-finite dO / Q in a product).
//   warpgroups 1 and 2 (consumers, kConsumerRegs): 64 keys each (D = 256: the same 64 keys, and
//     the dK / dV / dQ columns split in halves: BwdTraits90::kSharedKeys).
//     S^T = K Q^T, dP^T = V dO^T          wgmma SS (m64n64, both operands K-major)
//     P^T = exp2(S^T scale log2e - lse), dS^T = P^T (dP^T - delta) softcap'   (registers)
//     dV += P^T dO, dK += dS^T Q           wgmma RS (the accumulators re-packed as A; B MN-major)
//     dS^T -> shared memory as dS [query][key] (K-major), then dQ = dS K: wgmma SS with B
//       MN-major (K as stored); D = 128: consumer c takes dQ columns [64c, +64) over all 128 keys,
//       D = 64: consumer c takes all 64 columns over its own 64 keys, D = 256: columns
//       [128c, +128) over the block's 64 keys, in two products of 64 columns. The f32 dQ
//       partials go to the workspace's dq_accum with red.global.add (the mma.sync backward's pre
//       pass zeroes it and its convert pass scales and rounds it): not deterministic in the
//       summation order, like the mma.sync backward.
// Semantics are the contract's (docs/flash-attention-contract.md), treated as flash_bwd.cuh's
// general loop treats them: K rows past kv_len and non-finite K elements are zeroed in shared
// memory (0 * inf in dS K would leak NaN into rows that do not see the key) and rows that see a
// non-finite K row get s = NaN; hidden pairs are selects, not products.
// The optional operands come in the mma.sync kernels' compile-time feature sets (F, extras.cuh:
// kFeatMasks = key_mask, bias, ALiBi, dbias; kFeatDropout = dropout), one instantiation per set
// (generate.py); a clear bit compiles its feature out, so the plain set (F = 0) is the kernel it
// was. key_mask empties the query interval of each key it hides (a block it hides whole sweeps
// nothing); the sets' consumers take flash_bwd.cuh's elementwise step with the features itself
// (bwd_extras.cuh: the wgmma accumulator of a warp is the mma.sync fragment's layout), the
// dropout bits drawn as it draws them (the same Philox bits) before each step's products. They
// split the registers 24 / 240 (BwdTraits90), the plain set 40 / 232.
#pragma once

#include "../bwd_extras.cuh"
#include "../common.cuh"
#include "../extras.cuh"
#include "hopper.cuh"

namespace exla_rs {
namespace sm90 {

template <int D, int F = 0>
struct BwdTraits90 {
  static_assert(D == 64 || D == 128 || D == 256, "sm90 backward head dims: 64, 128, 256");
  static constexpr int kHeadDim = D;
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kKeysPerConsumer = 64;  // one wgmma M
  // D = 256: dK and dV of 64 keys x 256 columns would take 256 registers a thread. The two
  // consumers take the same 64 keys and half the columns each (64 + 64 registers: D = 128's
  // footprint), and both compute the block's S^T and dP^T (2 of the 5 products twice).
  static constexpr bool kSharedKeys = D == 256;
  static constexpr int kBlockN = kSharedKeys ? kKeysPerConsumer : kKeysPerConsumer * kConsumers;  // keys per block
  static constexpr int kKVCols = kSharedKeys ? D / kConsumers : D;  // dK / dV columns per consumer
  static constexpr int kBlockM = 64;                                 // queries per step (wgmma N of S^T)
  static constexpr int kStages = 2;
  static constexpr int kColBlocks = D / 64;
  // dQ = dS K per consumer: kDqCols columns (wgmma N = 64 pieces) over kDqKeys keys.
  static constexpr int kDqKeys = D == 64 ? kKeysPerConsumer : kBlockN;
  static constexpr int kDqCols = D == 64 ? 64 : D / kConsumers;
  static constexpr int kQBytes = kBlockM * D * 2;
  static constexpr int kKVBytes = kBlockN * D * 2;
  static constexpr int kDSBytes = kBlockM * kBlockN * 2;
  // Register split (setmaxnreg), as FwdTraits: 128 * P + 256 * C must fit the launch pool. The
  // feature sets' consumers hold the elementwise step's extra state (bias and dbias addresses,
  // ALiBi distances, the dropout bits) beside dK, dV, S^T and dP^T: at 232 the masked sets
  // spilled 188 (D = 128 _mask) to 296 bytes (_mask_drop); the producer (TMA issue, lse / delta
  // rows, the zero fill) fits setmaxnreg's floor of 24 without a spill, so they take 24 / 240
  // (the whole pool). The plain set keeps the split it was verified with on an H200.
  static constexpr int kLaunchRegs = launch_reg_cap(kThreads);
  static constexpr int kProducerRegs = F == 0 ? 40 : 24;
  static constexpr int kConsumerRegs = F == 0 ? 232 : 240;
  static_assert(128 * kProducerRegs + 128 * kConsumers * kConsumerRegs <= kThreads * kLaunchRegs,
                "setmaxnreg: the producer/consumer split asks more registers than the block holds at launch");
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
                "setmaxnreg: a multiple of 8 in 24..256");
  // Shared memory: K | V | Q stages | dO stages | dS x 2 | lse stages | delta stages | key flags |
  // mbarriers | (feature sets) key rows; tiles 1024-byte aligned.
  static constexpr int kKOffset = 0;
  static constexpr int kVOffset = kKOffset + kKVBytes;
  static constexpr int kQOffset = kVOffset + kKVBytes;
  static constexpr int kDOOffset = kQOffset + kStages * kQBytes;
  static constexpr int kDSOffset = kDOOffset + kStages * kQBytes;
  static constexpr int kLseOffset = kDSOffset + 2 * kDSBytes;
  static constexpr int kDeltaOffset = kLseOffset + kStages * kBlockM * 4;
  static constexpr int kKbadOffset = kDeltaOffset + kStages * kBlockM * 4;
  static constexpr int kBarOffset = kKbadOffset + kBlockN * 4;
  static constexpr int kBarriers = 2 + 2 * kStages;  // kv_full, q_raw, q_full[S], q_empty[S]
  // The feature sets keep each key's visible query rows [lo, hi) (key_mask applied) here, read at
  // every step, instead of in registers: their consumers have none to spare (four values held
  // through the sweep beside dK, dV, S^T and dP^T made ptxas spill 4-116 bytes, D = 128 and 256).
  static constexpr int kKeyRowsOffset = kBarOffset + kBarriers * 8;
  static constexpr int kKeyRowsBytes = F != 0 ? 2 * kBlockN * 4 : 0;
  static constexpr int kSmemBytes = kKeyRowsOffset + kKeyRowsBytes + 1024;  // + alignment slack
  // Arrivals per phase. Every thread that touched a stage's ordinary shared memory (the lse /
  // delta rows, the zeroed Q / dO rows) arrives itself, so each one's accesses are released by
  // its own arrive: compute-sanitizer racecheck (H200, 2026-11-28) reported the lse / delta
  // writes and reads as races when one lane per warp arrived after a warp sync.
  static constexpr int kFillers = 32;                   // q_full: the producer warp's lanes
  static constexpr int kReleasers = kConsumers * 128;   // q_empty: every consumer thread
  static constexpr int kKCheckBarrier = 1;            // named barriers (256 consumer threads)
  // dS ready: D = 128 reads both consumers' halves of dS (one barrier of 256 threads), D = 256 the
  // halves of its query rows each consumer writes (both hold the whole dS); D = 64 reads only its
  // own keys' half, so each consumer syncs its own 128 threads (barriers 2, 3) and the two drift
  // apart, one's elementwise work beside the other's wgmma.
  static constexpr int kDSBarrier = 2;
  static constexpr bool kDSShared = kDqKeys == kBlockN;
};

struct BwdBarriers {
  u64* kv_full;
  u64* q_raw;  // Q / dO stages that need rows zeroed land here first (producer-private)
  u64* q_full;
  u64* q_empty;
};

template <class Tr>
EXLA_RS_SM90 BwdBarriers bwd_barriers(unsigned char* smem) {
  u64* b = reinterpret_cast<u64*>(smem + Tr::kBarOffset);
  return {b, b + 1, b + 2, b + 2 + Tr::kStages};
}

// The block's sweep: query tiles [m_first, m_first + m_tiles * kBlockM) of each of `group` heads.
struct BwdSweep {
  int n0, hk, b, group, m_first, m_tiles, steps;
};

// Every thread of the block calls it (key_mask's ballots), with the same result.
template <class Tr, int F>
EXLA_RS_SM90 BwdSweep bwd_sweep(const BwdParams& p, const Mask& mask) {
  BwdSweep s;
  s.n0 = blockIdx.x * Tr::kBlockN;
  s.hk = blockIdx.y;
  s.b = blockIdx.z;
  s.group = p.heads / p.kv_heads;
  int q_lo, q_hi;
  mask.keys_rows(s.n0, s.n0 + Tr::kBlockN, q_lo, q_hi);
  // key_mask: a block whose keys it hides all (a padded batch row's tail) sweeps nothing and loads
  // nothing; the consumers write its dK = dV = 0.
  if constexpr ((F & kFeatMasks) != 0) {
    if (p.x.key_mask != nullptr && q_lo < q_hi) {
      bool any = false;
#pragma unroll
      for (int w = 0; w < Tr::kBlockN / 64; ++w)
        any |= key_mask_tile_bits<64>(p.x, static_cast<long long>(s.b) * p.seq_k, s.n0 + 64 * w, p.seq_k, threadIdx.x % 32) != 0;
      if (!any) q_lo = q_hi = 0;
    }
  }
  s.m_first = (q_lo / Tr::kBlockM) * Tr::kBlockM;
  s.m_tiles = q_lo < q_hi ? (q_hi - s.m_first + Tr::kBlockM - 1) / Tr::kBlockM : 0;
  s.steps = s.group * s.m_tiles;
  return s;
}

template <class T, class Tr>
EXLA_RS_SM90 void bwd_producer(const BwdParams& p, const BwdSweep& sw, const TensorMap* tq, const TensorMap* tk,
                               const TensorMap* tv, const TensorMap* tdo, unsigned char* smem, const BwdBarriers& bar) {
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    tma_prefetch_map(tq);
    tma_prefetch_map(tk);
    tma_prefetch_map(tv);
    tma_prefetch_map(tdo);
    mbar_arrive_expect_tx(bar.kv_full, 2 * Tr::kKVBytes);
    for (int c = 0; c < Tr::kColBlocks; ++c) {
      tma_load_4d(tk, bar.kv_full, smem + Tr::kKOffset + c * Tr::kBlockN * kSwizzleRowBytes, c * 64, sw.n0, sw.hk, sw.b);
      tma_load_4d(tv, bar.kv_full, smem + Tr::kVOffset + c * Tr::kBlockN * kSwizzleRowBytes, c * 64, sw.n0, sw.hk, sw.b);
    }
  }
  unsigned raw_phase = 0;
#pragma unroll 1
  for (int t = 0; t < sw.steps; ++t) {
    const int h = sw.hk * sw.group + t / sw.m_tiles;
    const int m0 = sw.m_first + (t % sw.m_tiles) * Tr::kBlockM;
    const int stage = t % Tr::kStages;
    const unsigned phase = (t / Tr::kStages) & 1;
    mbar_wait(bar.q_empty + stage, phase ^ 1);
    float* s_lse = reinterpret_cast<float*>(smem + Tr::kLseOffset) + stage * Tr::kBlockM;
    float* s_delta = reinterpret_cast<float*>(smem + Tr::kDeltaOffset) + stage * Tr::kBlockM;
    const long long row0 = (static_cast<long long>(sw.b) * p.heads + h) * p.seq_q;
    bool hidden = false;  // a row below Sq with lse = -inf: its Q / dO rows get zeroed
#pragma unroll
    for (int r = lane; r < Tr::kBlockM; r += 32) {
      const int row = m0 + r;
      const float l = row < p.seq_q ? p.lse[row0 + row] : neg_inf();
      hidden |= row < p.seq_q && l == neg_inf();
      s_lse[r] = l == neg_inf() ? neg_inf() : l * kLog2e;
      s_delta[r] = l == neg_inf() ? 0.f : p.delta[row0 + row];
    }
    const bool fix = __any_sync(0xffffffffu, hidden);
    __syncwarp();
    unsigned char* q_dst = smem + Tr::kQOffset + stage * Tr::kQBytes;
    unsigned char* do_dst = smem + Tr::kDOOffset + stage * Tr::kQBytes;
    if (lane == 0) {
      u64* done = fix ? bar.q_raw : bar.q_full + stage;
      mbar_arrive_expect_tx(done, 2 * Tr::kQBytes);
      for (int c = 0; c < Tr::kColBlocks; ++c) {
        tma_load_4d(tq, done, q_dst + c * Tr::kBlockM * kSwizzleRowBytes, c * 64, m0, h, sw.b);
        tma_load_4d(tdo, done, do_dst + c * Tr::kBlockM * kSwizzleRowBytes, c * 64, m0, h, sw.b);
      }
    } else if (!fix) {
      mbar_arrive(bar.q_full + stage);  // this lane's lse / delta rows (lane 0's arrive carries the bytes)
    }
    if (fix) {
      mbar_wait(bar.q_raw, raw_phase);
      raw_phase ^= 1;
      // Whole 128-byte rows: the swizzle permutes chunks within a row only.
#pragma unroll 1
      for (int x = lane; x < Tr::kColBlocks * Tr::kBlockM * 8; x += 32) {
        const int r = (x / 8) % Tr::kBlockM;
        if (s_lse[r] != neg_inf()) continue;
        reinterpret_cast<Chunk16*>(q_dst)[x] = Chunk16{0, 0, 0, 0};
        reinterpret_cast<Chunk16*>(do_dst)[x] = Chunk16{0, 0, 0, 0};
      }
      fence_proxy_async_smem();
      mbar_arrive(bar.q_full + stage);  // every lane: its lse / delta rows and the rows it zeroed
    }
  }
}

// K-major operand: a k-step of 16 elements moves 32 bytes inside a 128-byte swizzled row, every
// 4 k-steps the next 64-column block (of `rows` rows).
EXLA_RS_SM90 unsigned bwd_kstep_offset(int kk, int rows) { return (kk / 4) * rows * kSwizzleRowBytes + (kk % 4) * 32; }

// Byte offset of element (row, col) of a K-major tile of `rows` rows stored as 64-column blocks of
// 128-byte rows with the 128-byte swizzle (what TMA's SWIZZLE_128B writes).
EXLA_RS_SM90 unsigned swz_offset(int row, int col, int rows) {
  const int cb = col / 64, c = col % 64;
  return cb * rows * kSwizzleRowBytes + row * kSwizzleRowBytes + ((((c * 2) / 16) ^ (row % 8)) * 16) + (c * 2) % 16;
}

template <class T, class Tr, int F>
EXLA_RS_SM90 void bwd_consumer(const BwdParams& p, const BwdSweep& sw, const Mask& mask, unsigned char* smem,
                               const BwdBarriers& bar, int consumer) {
  constexpr int D = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM;
  constexpr int kAcc = Tr::kKVCols / 2;  // dK / dV accumulator floats per thread
  constexpr int kQSteps = D / 16;    // k-steps of S^T, dP^T
  constexpr int kPSteps = BM / 16;   // k-steps of dV, dK (16 queries each)
  using Storage = typename T::Storage;

  const int tid = threadIdx.x % 128, ctid = threadIdx.x - 128;
  const int warp = tid / 32, lane = tid % 32;
  const int quad_col = (lane % 4) * 2;
  // Accumulator layout (wgmma D fragment): element e is row 16 warp + lane/4 + 8 ((e / 2) % 2),
  // column 8 (e / 4) + 2 (lane % 4) + e % 2. Rows are this consumer's keys.
  const int slice0 = Tr::kSharedKeys ? 0 : consumer * Tr::kKeysPerConsumer;  // this consumer's keys in the block
  const int key_local = slice0 + warp * 16 + lane / 4;  // and + 8
  const int kv_col0 = Tr::kSharedKeys ? Tr::kKVCols * consumer : 0;  // dK, dV: columns [kv_col0, + kKVCols)
  const int n0 = sw.n0;

  const unsigned k_addr = smem_addr(smem + Tr::kKOffset), v_addr = smem_addr(smem + Tr::kVOffset);
  const unsigned q_base = smem_addr(smem + Tr::kQOffset), do_base = smem_addr(smem + Tr::kDOOffset);
  const unsigned ds_base = smem_addr(smem + Tr::kDSOffset);
  int* s_kbad = reinterpret_cast<int*>(smem + Tr::kKbadOffset);

  float dk[kAcc], dv[kAcc];
#pragma unroll
  for (int e = 0; e < kAcc; ++e) dk[e] = dv[e] = 0.f;

  if (sw.steps > 0) {
    mbar_wait(bar.kv_full, 0);
    // K rows past kv_len and non-finite K elements: zeroed (dS K would meet them with dS = 0),
    // the latter flagged per key.
    for (int x = ctid; x < Tr::kColBlocks * Tr::kBlockN * 8; x += 256) {
      const int r = (x / 8) % Tr::kBlockN;
      Chunk16* ch = reinterpret_cast<Chunk16*>(smem + Tr::kKOffset) + x;
      if (n0 + r >= mask.kv_end) {
        *ch = Chunk16{0, 0, 0, 0};
      } else {
        Chunk16 c = *ch;
        if (nonfinite_chunk<T>(c)) {
          zero_nonfinite_chunk<T>(c);
          *ch = c;
          atomicOr(s_kbad + r, 1);
        }
      }
    }
    fence_proxy_async_smem();
    named_sync(Tr::kKCheckBarrier, 256);
    const bool kbad[2] = {s_kbad[key_local] != 0, s_kbad[key_local + 8] != 0};
    // The queries that see each of this thread's two keys.
    int qlo[2], qhi[2];
    mask.keys_rows(n0 + key_local, n0 + key_local + 1, qlo[0], qhi[0]);
    mask.keys_rows(n0 + key_local + 8, n0 + key_local + 9, qlo[1], qhi[1]);
    // key_mask: a key it hides is seen by no query; km_full: it hides none of this warp's 16 keys
    // (warp-uniform; with the window test below, the step's `full`).
    constexpr bool kMasks = (F & kFeatMasks) != 0, kDrop = (F & kFeatDropout) != 0;
    const ExtraParams& x = p.x;
    bool km_full = true;
    if constexpr (kMasks) {
      if (x.key_mask != nullptr) {
        bool vis[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int key = n0 + key_local + 8 * r;
          vis[r] = key < p.seq_k && key_mask_visible(x.key_mask, x.key_mask_bytes, static_cast<long long>(sw.b) * p.seq_k + key);
          if (!vis[r]) qlo[r] = qhi[r] = 0;
        }
        km_full = __all_sync(0xffffffffu, vis[0] && vis[1]);
      }
    }
    int* s_qlo = reinterpret_cast<int*>(smem + Tr::kKeyRowsOffset);  // feature sets: [kBlockN] lo, then hi
    if constexpr (F != 0) {
      // One writer per key: the quad's 4 lanes hold the same two keys (D = 256: both consumers).
      if ((!Tr::kSharedKeys || consumer == 0) && lane % 4 == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          s_qlo[key_local + 8 * r] = qlo[r];
          s_qlo[Tr::kBlockN + key_local + 8 * r] = qhi[r];
        }
      named_sync(Tr::kKCheckBarrier, 256);
    }
    const bool has_bias = kMasks && x.bias != nullptr, has_alibi = kMasks && x.alibi_slopes != nullptr;
    const bool has_drop = kDrop && x.dropout_key != nullptr, has_dbias = kMasks && p.dbias_accum != nullptr;
    const float scale_log2 = p.scale * kLog2e;
    const bool softcap = p.softcap > 0.f;
    const int wg_n0 = n0 + slice0;
    const unsigned k_wg = k_addr + slice0 * kSwizzleRowBytes;
    const unsigned v_wg = v_addr + slice0 * kSwizzleRowBytes;
    // dQ: columns [dq_col0, + kDqCols) over keys [dq_key0, + kDqKeys) of the block.
    const int dq_col0 = D == 64 ? 0 : Tr::kDqCols * consumer;
    const int dq_key0 = D == 64 ? Tr::kKeysPerConsumer * consumer : 0;

#pragma unroll 1
    for (int t = 0; t < sw.steps; ++t) {
      const int h = sw.hk * sw.group + t / sw.m_tiles;
      const int m0 = sw.m_first + (t % sw.m_tiles) * BM;
      const int stage = t % Tr::kStages;
      const unsigned phase = (t / Tr::kStages) & 1;
      const unsigned q_addr = q_base + stage * Tr::kQBytes, do_addr = do_base + stage * Tr::kQBytes;
      const float* s_lse = reinterpret_cast<const float*>(smem + Tr::kLseOffset) + stage * BM;
      const float* s_delta = reinterpret_cast<const float*>(smem + Tr::kDeltaOffset) + stage * BM;
      // Dropout's keep bits of the step (flash_bwd.cuh's draw: this warp's 16 keys are its key
      // slice), before the stage's wait and the products: only dK and dV are live here.
      unsigned keep_bits = ~0u;
      if (has_drop) keep_bits = dropout_keep_bits_t<BM>(Dropout::load(x), sw.b, h, m0, wg_n0 + warp * 16, lane / 4, lane % 4);
      mbar_wait(bar.q_full + stage, phase);

      float s[32], dp[32];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk)
        wgmma_ss<T>(s, smem_desc(k_wg + bwd_kstep_offset(kk, Tr::kBlockN), 16, kAtomBytes),
                    smem_desc(q_addr + bwd_kstep_offset(kk, BM), 16, kAtomBytes), kk > 0 ? 1 : 0);
#pragma unroll
      for (int kk = 0; kk < kQSteps; ++kk)
        wgmma_ss<T>(dp, smem_desc(v_wg + bwd_kstep_offset(kk, Tr::kBlockN), 16, kAtomBytes),
                    smem_desc(do_addr + bwd_kstep_offset(kk, BM), 16, kAtomBytes), kk > 0 ? 1 : 0);
      wgmma_commit();
      wgmma_wait<0>();
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        pin(s[e]);
        pin(dp[e]);
      }

      // P^T and dS^T (without the final scale, applied by the convert pass and to dK). In the
      // plain set, a tile every row of which sees every key of this consumer's slice, without
      // softcap and with the thread's K rows finite, takes the lean step: no mask test, no
      // softcap, only the lse = -inf select (a hidden row's dP may be NaN: a select, not a product).
      const bool full = km_full && mask.tile_full(m0, m0 + BM, wg_n0, wg_n0 + Tr::kKeysPerConsumer);
      if constexpr (F != 0) {
        // This thread's keys: non-finite K rows, visible query rows (shared memory, Traits).
        const bool kb[2] = {s_kbad[key_local] != 0, s_kbad[key_local + 8] != 0};
        const int ql[2] = {s_qlo[key_local], s_qlo[key_local + 8]};
        const int qh[2] = {s_qlo[Tr::kBlockN + key_local], s_qlo[Tr::kBlockN + key_local + 8]};
        // The masked and dropout sets: flash_bwd.cuh's step with the features, at every step
        // (those sets of the mma.sync backward have no lean step either; beside the two steps
        // below, ptxas spilled 32-116 bytes of the D = 128 _mask_drop consumers, at 240
        // registers). Element e of the accumulator is the mma.sync fragment's (e / 4, e % 4).
        bwd_extras_step<BM>(reinterpret_cast<float(&)[BM / 8][4]>(s), reinterpret_cast<float(&)[BM / 8][4]>(dp), p, mask, s_lse, s_delta,
                            kb, ql, qh, full, keep_bits, has_drop, has_alibi, has_bias,
                            // D = 256: both consumers compute the same dZ; consumer 0 adds it.
                            has_dbias && (!Tr::kSharedKeys || consumer == 0) ? p.dbias_accum : nullptr, sw.b, h,
                            m0, n0 + key_local, lane / 4, lane % 4, lane);
      } else if (full && !softcap && !kbad[0] && !kbad[1]) {
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          const int ql = 8 * (e / 4) + quad_col + e % 2;
          const float l2 = s_lse[ql];
          const bool vis = l2 != neg_inf();
          const float pr = vis ? ex2(fmaf(s[e], scale_log2, -l2)) : 0.f;
          s[e] = pr;
          dp[e] = vis ? pr * (dp[e] - s_delta[ql]) : 0.f;
        }
      } else {
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          const int kh = (e / 2) % 2;
          const int ql = 8 * (e / 4) + quad_col + e % 2;
          const int q = m0 + ql;
          const float l2 = s_lse[ql];
          const float sc = softcap ? score(s[e], p.scale, p.softcap, p.softcap_inv) : s[e] * p.scale;
          const float sv = kbad[kh] ? qnan() : sc;
          const bool vis = l2 != neg_inf() && (full || (q >= qlo[kh] && q < qhi[kh]));
          // A key whose K row held an inf/NaN: s = NaN for the rows that see it (the unzeroed product).
          const float z = kbad[kh] ? qnan() : (softcap ? sc * kLog2e - l2 : fmaf(s[e], scale_log2, -l2));
          const float pr = vis ? ex2(z) : 0.f;
          s[e] = pr;
          dp[e] = vis ? pr * (dp[e] - s_delta[ql]) * softcap_grad(sv, p.softcap, p.softcap_inv) : 0.f;
        }
      }
      unsigned pf[kPSteps][4], dsf[kPSteps][4];
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          pf[kk][j] = T::pack2(s[8 * kk + 2 * j], s[8 * kk + 2 * j + 1]);
          dsf[kk][j] = T::pack2(dp[8 * kk + 2 * j], dp[8 * kk + 2 * j + 1]);
        }

      // dV += P^T dO, dK += dS^T Q: B MN-major (the tile's head dim contiguous), columns
      // [kv_col0, + kKVCols).
      const unsigned kv_cols = (kv_col0 / 64) * BM * kSwizzleRowBytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
        wgmma_rs<T, 1>(dv, pf[kk], smem_desc(do_addr + kv_cols + kk * 16 * kSwizzleRowBytes, BM * kSwizzleRowBytes, kAtomBytes), 1);
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
        wgmma_rs<T, 1>(dk, dsf[kk], smem_desc(q_addr + kv_cols + kk * 16 * kSwizzleRowBytes, BM * kSwizzleRowBytes, kAtomBytes), 1);
      wgmma_commit();

      // dS^T to shared memory as dS [query][key] (buffer t % 2: at D = 128 and 256 the other
      // consumer may still read the previous step's), from the packed fragments (the values dK
      // uses); at D = 256 consumer c writes query rows [32 c, + 32) of the dS both hold.
      unsigned char* ds_buf = smem + Tr::kDSOffset + (t % 2) * Tr::kDSBytes;
#pragma unroll
      for (int kk = 0; kk < kPSteps; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (Tr::kSharedKeys && kk / (kPSteps / Tr::kConsumers) != consumer) continue;
          const int e = 8 * kk + 2 * j;
          const int key = key_local + 8 * ((e / 2) % 2);
          const int ql = 8 * (e / 4) + quad_col;
          const unsigned w = dsf[kk][j];
          *reinterpret_cast<Storage*>(ds_buf + swz_offset(ql, key, BM)) = static_cast<Storage>(w & 0xffffu);
          *reinterpret_cast<Storage*>(ds_buf + swz_offset(ql + 1, key, BM)) = static_cast<Storage>(w >> 16);
        }
      fence_proxy_async_smem();
      if constexpr (Tr::kDSShared)
        named_sync(Tr::kDSBarrier, 256);
      else if (consumer == 0)  // constant ids: ptxas then reserves 4 barriers, not all 16
        named_sync(Tr::kDSBarrier, 128);
      else
        named_sync(Tr::kDSBarrier + 1, 128);

      // dQ (64 queries x 64 columns at a time) = dS [:, keys] K [keys, cols].
      const unsigned ds_addr = ds_base + (t % 2) * Tr::kDSBytes;
#pragma unroll
      for (int piece = 0; piece < Tr::kDqCols / 64; ++piece) {
        const int col0 = dq_col0 + 64 * piece;
        float dq[32];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Tr::kDqKeys / 16; ++kk) {
          const int kg = dq_key0 / 16 + kk;  // 16-key step within the block
          wgmma_ss<T, 1>(dq, smem_desc(ds_addr + bwd_kstep_offset(kg, BM), 16, kAtomBytes),
                         smem_desc(k_addr + (col0 / 64) * Tr::kBlockN * kSwizzleRowBytes + kg * 16 * kSwizzleRowBytes,
                                   Tr::kBlockN * kSwizzleRowBytes, kAtomBytes),
                         kk > 0 ? 1 : 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        if (piece == 0) {
#pragma unroll
          for (int e = 0; e < kAcc; ++e) {
            pin(dk[e]);
            pin(dv[e]);
          }
          mbar_arrive(bar.q_empty + stage);  // every thread: its reads of the stage's lse / delta
        }
#pragma unroll
        for (int e = 0; e < 32; ++e) pin(dq[e]);

        float* dq_rows = p.dq_accum + ((static_cast<long long>(sw.b) * p.seq_q + m0) * p.heads + h) * D + col0;
        const long long q_stride = static_cast<long long>(p.heads) * D;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int row = warp * 16 + lane / 4 + 8 * hh;
          if (m0 + row >= p.seq_q) continue;
          float* dst = dq_rows + row * q_stride + quad_col;
#pragma unroll
          for (int g = 0; g < 8; ++g) {
            ptx::red_add_f32(dst + 8 * g, dq[4 * g + 2 * hh]);
            ptx::red_add_f32(dst + 8 * g + 1, dq[4 * g + 2 * hh + 1]);
          }
        }
      }
    }
  }

  // dK (times scale) and dV; keys past kv_len get exact zeros.
  const long long kv_stride = static_cast<long long>(p.kv_heads) * D;
  const long long kv_off = (static_cast<long long>(sw.b) * p.seq_k * p.kv_heads + sw.hk) * D;
  Storage* gdk = static_cast<Storage*>(p.dk) + kv_off;
  Storage* gdv = static_cast<Storage*>(p.dv) + kv_off;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int key = n0 + key_local + 8 * hh;
    if (key >= p.seq_k) continue;
    const bool pad = key >= mask.kv_end;
    unsigned* dk_row = reinterpret_cast<unsigned*>(gdk + key * kv_stride + kv_col0 + quad_col);
    unsigned* dv_row = reinterpret_cast<unsigned*>(gdv + key * kv_stride + kv_col0 + quad_col);
#pragma unroll
    for (int g = 0; g < Tr::kKVCols / 8; ++g) {
      dk_row[g * 4] = pad ? 0u : T::pack2(dk[4 * g + 2 * hh] * p.scale, dk[4 * g + 2 * hh + 1] * p.scale);
      dv_row[g * 4] = pad ? 0u : T::pack2(dv[4 * g + 2 * hh], dv[4 * g + 2 * hh + 1]);
    }
  }
}

template <class T, int D, int F = 0>
EXLA_RS_SM90 void flash_bwd(const BwdParams& p, const TensorMap* tq, const TensorMap* tk, const TensorMap* tv,
                            const TensorMap* tdo) {
  using Tr = BwdTraits90<D, F>;
  EXLA_RS_DYNAMIC_SMEM_UNALIGNED(smem_raw);
  const unsigned raw = smem_addr(smem_raw);
  unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  const BwdBarriers bar = bwd_barriers<Tr>(smem);
  if (threadIdx.x == 0) {
    mbar_init(bar.kv_full, 1);
    mbar_init(bar.q_raw, 1);
    for (int s = 0; s < Tr::kStages; ++s) {
      mbar_init(bar.q_full + s, Tr::kFillers);
      mbar_init(bar.q_empty + s, Tr::kReleasers);
    }
    fence_barrier_init();
  }
  for (int r = threadIdx.x; r < Tr::kBlockN; r += Tr::kThreads) reinterpret_cast<int*>(smem + Tr::kKbadOffset)[r] = 0;
  const Mask mask = Mask::make(p.seq_q, p.seq_k, p.kv_len[blockIdx.z], p.q_start[blockIdx.z], p.window_left, p.window_right);
  const BwdSweep sw = bwd_sweep<Tr, F>(p, mask);
  __syncthreads();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    regs_release<Tr::kProducerRegs>();
    if (threadIdx.x / 32 == 0 && sw.steps > 0) bwd_producer<T, Tr>(p, sw, tq, tk, tv, tdo, smem, bar);
  } else {
    regs_claim<Tr::kConsumerRegs>();
    bwd_consumer<T, Tr, F>(p, sw, mask, smem, bar, warpgroup - 1);
  }
}

}  // namespace sm90
}  // namespace exla_rs
