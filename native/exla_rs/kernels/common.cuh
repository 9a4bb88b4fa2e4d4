// Device building blocks shared by every exla_rs attention kernel: element types, the PTX
// instructions the tensor-core kernels use (mma.sync, ldmatrix, cp.async), the swizzled shared
// memory layout and the contract's mask.
//
// Header-free on purpose (no cuda_fp16.h, no <cstdint>): the same text compiles under nvcc at build
// time and under NVRTC at run time, where no CUDA include directory may exist. Half types are raw
// 16-bit patterns converted with PTX `cvt`; everything targets sm_80 and newer.
//
// One switch, here and nowhere inside a kernel: EXLA_RS_CPU compiles the same kernels as host C++
// for the GPU-on-CPU executor (crates/exla-rs-gpusim/executor/), which supplies CUDA's built-ins and a CPU model of
// every PTX wrapper of ptx.cuh. The include goes through a macro so that the NVRTC flattener
// (crates/exla-rs-cuda/build.rs) never inlines the host-only headers.
#pragma once

#if defined(EXLA_RS_CPU)
#define EXLA_RS_CPU_DEVICE_HEADER "executor/device.hpp"
#include EXLA_RS_CPU_DEVICE_HEADER
#else
#include "ptx.cuh"
#endif
#include "params.cuh"

namespace exla_rs {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 16 bytes, for vectorised copies (uint4 needs vector_types.h, which NVRTC may lack).
struct __align__(16) Chunk16 {
  unsigned x, y, z, w;
};

EXLA_RS_DEVICE int imin(int a, int b) { return a < b ? a : b; }
EXLA_RS_DEVICE int imax(int a, int b) { return a > b ? a : b; }

EXLA_RS_DEVICE float neg_inf() { return __int_as_float(0xff800000); }

// ---------------------------------------------------------------------------------------------
// Element types. `Storage` is what sits in global memory; math is always f32.

struct F32 {
  using Storage = float;
  static EXLA_RS_DEVICE float to_float(float x) { return x; }
  static EXLA_RS_DEVICE float from_float(float x) { return x; }
};

struct F16 {
  using Storage = unsigned short;
  static constexpr unsigned kExpMask = 0x7c00u;  // all ones: inf or NaN
  static EXLA_RS_DEVICE float to_float(unsigned short x) { return ptx::cvt_f32_f16(x); }
  static EXLA_RS_DEVICE unsigned short from_float(float x) { return ptx::cvt_rn_f16_f32(x); }
  // Two values in one 32-bit register, `lo` in the low half (the mma operand order).
  // PTX cvt.*x2 puts its first source in the upper half.
  static EXLA_RS_DEVICE unsigned pack2(float lo, float hi) { return ptx::cvt_rn_f16x2_f32(hi, lo); }
  static EXLA_RS_DEVICE void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    ptx::mma_m16n8k16_f16(c, a, b0, b1);
  }
};

struct BF16 {
  using Storage = unsigned short;
  static constexpr unsigned kExpMask = 0x7f80u;
  static EXLA_RS_DEVICE float to_float(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }
  static EXLA_RS_DEVICE unsigned short from_float(float x) { return ptx::cvt_rn_bf16_f32(x); }
  static EXLA_RS_DEVICE unsigned pack2(float lo, float hi) { return ptx::cvt_rn_bf16x2_f32(hi, lo); }
  static EXLA_RS_DEVICE void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    ptx::mma_m16n8k16_bf16(c, a, b0, b1);
  }
};

// Two m16n8 accumulator tiles `c0`, `c1` (consecutive 8-column halves of 16 rows) packed into
// one m16k16 A fragment of the input type `T`: a product's result reused in registers as the
// next product's A operand (the backward's P^T and dS^T for dV and dK).
template <class T>
EXLA_RS_DEVICE void pack_a_frag(unsigned (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = T::pack2(c0[0], c0[1]);
  a[1] = T::pack2(c0[2], c0[3]);
  a[2] = T::pack2(c1[0], c1[1]);
  a[3] = T::pack2(c1[2], c1[3]);
}

// Non-finite 16-bit values (inf, NaN) by their bits. A tile may hold keys that some of its rows
// must not see; the tensor cores multiply those rows' exact zeros by whatever is stored there, and
// 0 * inf = NaN. The kernels find such values with these (only on the tiles where it can matter)
// and replace them by +0 before the product.
template <class T>
EXLA_RS_DEVICE bool nonfinite1(unsigned short x) {
  return (x & T::kExpMask) == T::kExpMask;
}
template <class T>
EXLA_RS_DEVICE bool nonfinite2(unsigned w) {
  return (w & T::kExpMask) == T::kExpMask || (w & (T::kExpMask << 16)) == (T::kExpMask << 16);
}
template <class T>
EXLA_RS_DEVICE unsigned zero_nonfinite2(unsigned w) {
  if ((w & T::kExpMask) == T::kExpMask) w &= 0xffff0000u;
  if ((w & (T::kExpMask << 16)) == (T::kExpMask << 16)) w &= 0x0000ffffu;
  return w;
}
template <class T>
EXLA_RS_DEVICE bool nonfinite_chunk(const Chunk16& c) {
  return nonfinite2<T>(c.x) || nonfinite2<T>(c.y) || nonfinite2<T>(c.z) || nonfinite2<T>(c.w);
}
template <class T>
EXLA_RS_DEVICE void zero_nonfinite_chunk(Chunk16& c) {
  c.x = zero_nonfinite2<T>(c.x);
  c.y = zero_nonfinite2<T>(c.y);
  c.z = zero_nonfinite2<T>(c.z);
  c.w = zero_nonfinite2<T>(c.w);
}
EXLA_RS_DEVICE float qnan() { return __int_as_float(0x7fffffff); }

// ---------------------------------------------------------------------------------------------
// Math. ex2.approx has a relative error near 2^-22 (ample for the f32 1e-4 bar) and maps
// -inf to +0, which is what masked scores need. tanhf stays precise: the f32 path needs it.

EXLA_RS_DEVICE float ex2(float x) { return ptx::ex2_approx_ftz(x); }
EXLA_RS_DEVICE float lg2(float x) { return ptx::lg2_approx_ftz(x); }

// The score s of the contract from the raw dot product: x = scale * qk, s = cap * tanh(x / cap).
// x / cap is taken as x * (1 / cap) with 1 / cap computed on the host (params' softcap_inv, 0 when
// off), as the Host kernels do: a precise f32 division in a kernel is a subroutine call whose ABI
// register saves are local-memory spills (CI allows none).
EXLA_RS_DEVICE float score(float qk, float scale, float softcap, float softcap_inv) {
  float x = qk * scale;
  return softcap > 0.f ? softcap * tanhf(x * softcap_inv) : x;
}
// ds/d(qk) / scale: the softcap's derivative, 1 - tanh^2, from the already capped score.
EXLA_RS_DEVICE float softcap_grad(float s, float softcap, float softcap_inv) {
  if (softcap > 0.f) {
    float t = s * softcap_inv;
    return 1.f - t * t;
  }
  return 1.f;
}

EXLA_RS_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
EXLA_RS_DEVICE float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// ---------------------------------------------------------------------------------------------
// The mask. Every row's visible keys form one interval, so kernels work with [lo, hi) ranges and
// test single elements only in tiles that straddle a bound.

// Windows are i64 in the contract; any width of 2^40 or more already covers every (query, key) pair
// (positions are 32-bit, so |q_start + i - j| < 2^33) and behaves as unbounded. Clamping to it keeps
// every bound below (p - wl, p + wr + 1, n0 - q_start - wr, ...) far from i64 overflow, so a window
// near i64::MAX does not wrap into an empty one: the Host saturates the same sums (mask.rs).
constexpr long long kWindowCap = 1LL << 40;
EXLA_RS_DEVICE long long clamp_window(long long w) { return w > kWindowCap ? kWindowCap : w; }

// Bits [a, z) of a W-bit word (W = 32 or 64: the tile extent), a and z clamped to [0, W]. A
// straddling tile turns each row's (fwd) or key's (bwd) visible interval into one such mask: an
// element then costs one bit test against a compile-time bit instead of two compares.
template <int W>
struct BitsOf {
  using T = unsigned long long;
};
template <>
struct BitsOf<32> {
  using T = unsigned;  // 32-bit shifts: half the integer work of the 64-bit ones
};
template <int W>
EXLA_RS_DEVICE typename BitsOf<W>::T bit_range(int a, int z) {
  using U = typename BitsOf<W>::T;
  static_assert(W == 32 || W == 64, "tile extent");
  const int lo = imax(a, 0), hi = imin(z, W);
  if (lo >= hi) return U(0);
  const U below_hi = hi == W ? ~U(0) : (U(1) << hi) - U(1);
  return below_hi & (~U(0) << lo);  // lo <= W - 1 here
}

struct Mask {
  int seq_q, seq_k;
  int kv_end;          // min(max(kv_len, 0), seq_k): keys >= kv_end are padding, never read
  long long q_start;   // key position of query 0
  long long wl, wr;    // < 0 = unbounded

  EXLA_RS_DEVICE static Mask make(int seq_q, int seq_k, int kv_len, int q_start, long long wl, long long wr) {
    Mask m;
    m.seq_q = seq_q;
    m.seq_k = seq_k;
    m.kv_end = kv_len < 0 ? 0 : (kv_len > seq_k ? seq_k : kv_len);
    m.q_start = q_start;
    m.wl = clamp_window(wl);
    m.wr = clamp_window(wr);
    return m;
  }
  EXLA_RS_DEVICE bool visible(long long i, long long j) const {
    long long p = q_start + i;
    return j < kv_end && (wl < 0 || j >= p - wl) && (wr < 0 || j <= p + wr);
  }
  // Keys visible to row i: [lo, hi), empty when lo >= hi.
  EXLA_RS_DEVICE void row_keys(long long i, int& lo, int& hi) const {
    long long p = q_start + i;
    long long a = wl < 0 ? 0 : p - wl, b = wr < 0 ? (long long)kv_end : p + wr + 1;
    if (a < 0) a = 0;
    if (b > kv_end) b = kv_end;
    lo = (int)(a < b ? a : 0);
    hi = (int)(a < b ? b : 0);
  }
  // Keys visible to any row in [r0, r1) (a covering interval; exact for the contract's masks).
  // O(1): row i sees a key iff kv_end > 0, p < kv_end + wl and p >= -wr (p = q_start + i; the
  // window terms only when bounded), so those rows are one interval [i0, i1), and both bounds of a
  // row's keys are non-decreasing in i: the union is [lo(i0), hi(i1 - 1)).
  EXLA_RS_DEVICE void rows_keys(int r0, int r1, int& lo, int& hi) const {
    long long i0 = r0, i1 = r1;
    if (wl >= 0 && (long long)kv_end + wl - q_start < i1) i1 = (long long)kv_end + wl - q_start;
    if (wr >= 0 && -wr - q_start > i0) i0 = -wr - q_start;
    lo = hi = 0;
    if (kv_end <= 0 || i0 >= i1) return;
    int a, b;
    row_keys(i0, lo, b);
    row_keys(i1 - 1, a, hi);
  }
  // Queries that see any key in [n0, n1): again one interval, because the window bounds move by
  // one position per key and (wl, wr >= 0) each key's interval has length >= 1.
  EXLA_RS_DEVICE void keys_rows(int n0, int n1, int& lo, int& hi) const {
    if (n1 > kv_end) n1 = kv_end;
    if (n0 >= n1) {
      lo = hi = 0;
      return;
    }
    long long a = wr < 0 ? 0 : (long long)n0 - q_start - wr;
    long long b = wl < 0 ? (long long)seq_q : (long long)(n1 - 1) - q_start + wl + 1;
    if (a < 0) a = 0;
    if (b > seq_q) b = seq_q;
    lo = (int)(a < b ? a : 0);
    hi = (int)(a < b ? b : 0);
  }
  // The key tiles of BN keys that tile_full calls full for rows [r0, r1), as one range [lo, hi)
  // inside [n_first, n_last) (n_last, n_last when none): a tile is full iff its first key is at or
  // past every row's window start and its end at or before kv_end and every row's window end, and
  // both bounds are monotone in the row.
  EXLA_RS_DEVICE void full_tiles(int r0, int r1, int bn, int n_first, int n_last, int& lo, int& hi) const {
    long long a = wl < 0 ? 0 : q_start + (r1 - 1) - wl;                // n0 >= a
    long long z = wr < 0 ? (long long)kv_end : q_start + r0 + wr + 1;  // n1 <= z
    if (z > kv_end) z = kv_end;
    if (a < 0) a = 0;
    const long long t_lo = (a + bn - 1) / bn, t_hi = z < 0 ? 0 : z / bn;
    lo = (int)(t_lo > n_first ? t_lo : n_first);
    hi = (int)(t_hi < n_last ? t_hi : n_last);
    if (lo >= hi) lo = hi = n_last;
  }
  // The backward's counterpart of full_tiles: of the query tiles i in [0, m_tiles) (rows
  // m_first + i bm, + bm), those below seq_q that see every key of [n0, n1) (tile_full), as one
  // range [lo, hi) (m_tiles, m_tiles when none). A tile is full iff its first row is at or past
  // n1 - 1 - wr - q_start and its last at or before n0 + wl - q_start, both bounds fixed here.
  EXLA_RS_DEVICE void full_row_tiles(int n0, int n1, int bm, int m_first, int m_tiles, int& lo, int& hi) const {
    lo = hi = m_tiles;
    if (n1 > kv_end || n0 >= n1) return;
    const long long a = wr < 0 ? (long long)m_first : (long long)(n1 - 1) - q_start - wr;  // m0 >= a
    long long z = (long long)seq_q - bm;                                                   // m0 <= z
    if (wl >= 0 && (long long)n0 - q_start + wl - (bm - 1) < z) z = (long long)n0 - q_start + wl - (bm - 1);
    if (z < m_first) return;
    const long long t_lo = a <= m_first ? 0 : (a - m_first + bm - 1) / bm;
    long long t_hi = (z - m_first) / bm + 1;
    if (t_hi > m_tiles) t_hi = m_tiles;
    if (t_lo < t_hi) lo = (int)t_lo, hi = (int)t_hi;
  }
  // True when every (row in [r0, r1), key in [n0, n1)) pair is visible: no per-element test needed.
  EXLA_RS_DEVICE bool tile_full(int r0, int r1, int n0, int n1) const {
    return n1 <= kv_end && (wl < 0 || (long long)n0 >= q_start + (r1 - 1) - wl) &&
           (wr < 0 || (long long)(n1 - 1) <= q_start + r0 + wr);
  }
};

// ---------------------------------------------------------------------------------------------
// Shared memory: a tile of ROWS x COLS 16-bit elements, stored in column blocks of W = 64 (or 32
// when COLS is not a multiple of 64) elements. Inside a block the 16-byte chunk index is XORed with
// the row so that the 8 row addresses of one ldmatrix phase, and the 16-byte cp.async stores of one
// warp, fall into 8 different bank groups: conflict-free without padding.

template <int ROWS, int COLS>
struct Swz {
  static constexpr int W = (COLS % 64 == 0) ? 64 : 32;
  static_assert(COLS % W == 0, "tile width must be a multiple of 32 elements");
  // Element offset of (row, col); the XOR keeps col's position inside its 8-element chunk.
  static EXLA_RS_DEVICE int off(int row, int col) {
    int blk = col / W, c = (col % W) >> 3, e = col & 7;
    int cs = (W == 64) ? (c ^ (row & 7)) : (c ^ ((row >> 1) & 3));
    return blk * (ROWS * W) + row * W + (cs << 3) + e;
  }
};

// 32-bit shared-memory byte addresses in a Swz<ROWS, COLS> tile (the key loops of flash_fwd.cuh and
// flash_bwd.cuh). A thread's ldmatrix row address is (row_t + R, col_t + C) with its own row_t
// (any) and col_t (0 or 8, the half of a k16 step) and the loop's R (a multiple of 8, so the row
// swizzle is the thread's own) and C (a multiple of 16): the swizzled chunk is then
// ((C % W) / 8) ^ (the thread's chunk), so with a = tile + thread_off (the tile 2W-byte aligned:
// the chunk bits of a are the thread's) the address is (a ^ chunk constant) + (block and row
// constant): one LOP3 per distinct C % W for a tile base that changes (the stage), nothing for one
// that does not. More generally col_t may be any column whose chunk within its block,
// (col_t % W) / 8, shares no bit with the loop's (C % W) / 8 (a whole block, a thread's 32-column
// slice beside a loop over its two 16-column halves, an element offset inside the chunk): the
// chunks then add without carry, which is the XOR.
template <int ROWS, int COLS>
struct SwzAddr {
  static constexpr int W = Swz<ROWS, COLS>::W;
  static EXLA_RS_DEVICE unsigned thread_off(int row_t, int col_t) { return 2u * (unsigned)Swz<ROWS, COLS>::off(row_t, col_t); }
  static EXLA_RS_DEVICE unsigned at(unsigned a, int R, int C) {
    return (a ^ (unsigned)(((C % W) / 8) << 4)) + 2u * (unsigned)((C / W) * ROWS * W + R * W);
  }
};

// cp.async (16 bytes global -> shared; src_bytes = 0 writes zeros), its groups, and ldmatrix: the
// wrappers live in ptx.cuh (and their CPU models in crates/exla-rs-gpusim/executor/device.hpp).
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::ldsm_x4;
using ptx::ldsm_x4_trans;
using ptx::cp_async16_s;
using ptx::smem_u32;

// The 16-byte chunk `c` of a [ROWS, D] Swz tile that a loop striding over every chunk copies,
// so that the 8 lanes of one 128-byte shared-memory phase hit all 32 banks once. Row-major does
// that for 64-wide blocks (D = 192: a phase is one row of one block). D = 96's 32-wide blocks sit
// ROWS * 64 bytes apart, a multiple of 128, so row-major put chunks 0-3 and 4-7 of a row on the
// same banks (2.67 extra wavefronts per warp's cp.async, counted by the GPU-on-CPU executor:
// bench/RESULTS.md): they go block by block, two rows of a block per phase. (Block-major for
// D = 192 too cost the backward's _mask sets 4-36 bytes of spills.)
struct TileChunk {
  int row, col;
};
template <int ROWS, int D>
EXLA_RS_DEVICE TileChunk tile_chunk(int c) {
  constexpr int W = Swz<ROWS, D>::W;
  if constexpr (W == 64) {
    return {c / (D / 8), (c % (D / 8)) * 8};
  } else {
    constexpr int kBlockChunks = ROWS * (W / 8);
    const int in_block = c % kBlockChunks;
    return {in_block / (W / 8), (c / kBlockChunks) * W + (in_block % (W / 8)) * 8};
  }
}

// Copies rows [row0, row0 + ROWS) of a [rows, stride] global matrix (each row D contiguous
// elements) into a swizzled tile; rows >= row_limit become zeros and are never read.
template <int ROWS, int D, int NTHREADS>
EXLA_RS_DEVICE void load_tile_async(unsigned short* s, const unsigned short* g, int row0, int row_limit,
                                    long long row_stride, int tid) {
  constexpr int kChunks = D / 8;
  if constexpr (NTHREADS % kChunks == 0 && ROWS % (NTHREADS / kChunks) == 0) {
    // Every thread keeps one column and steps down the rows by a constant: written this way the
    // compiler sees the column, the swizzle (for steps that are multiples of 8) and both bases as
    // loop invariants and each chunk costs an add, not a division, a swizzle and a 64-bit multiply.
    constexpr int kStep = NTHREADS / kChunks;
    const int r0 = tid / kChunks, col = (tid % kChunks) * 8;
    const unsigned short* src0 = g + (long long)(row0 + r0) * row_stride + col;
    // The swizzle repeats every 8 rows: with a step below 8 (a power of 2 here) the first kPeriod
    // steps' addresses are swizzled once and every later step adds a multiple of 8 rows to one.
    static_assert(kStep % 8 == 0 || 8 % kStep == 0, "row step");
    constexpr int kPeriod = kStep % 8 == 0 ? 1 : 8 / kStep;
    unsigned short* dst0[kPeriod];
#pragma unroll
    for (int k = 0; k < kPeriod; ++k) dst0[k] = s + Swz<ROWS, D>::off(r0 + k * kStep, col);
#pragma unroll
    for (int i = 0; i < ROWS / kStep; ++i) {
      const bool ok = row0 + r0 + i * kStep < row_limit;
      unsigned short* dst = dst0[i % kPeriod] + (i / kPeriod) * kPeriod * kStep * Swz<ROWS, D>::W;
      cp_async16(dst, ok ? src0 + i * kStep * row_stride : g, ok ? 16 : 0);
    }
  } else {
    for (int c = tid; c < ROWS * kChunks; c += NTHREADS) {
      const TileChunk t = tile_chunk<ROWS, D>(c);
      const int r = t.row, col = t.col;
      int gr = row0 + r;
      bool ok = gr < row_limit;
      const unsigned short* src = ok ? g + (long long)gr * row_stride + col : g;
      cp_async16(s + Swz<ROWS, D>::off(r, col), src, ok ? 16 : 0);
    }
  }
}

// The interior key loop's tile copy: every row real, the thread's column fixed (kChunks divides
// the thread count, rows step by kStep). `src` is the thread's source in the tile's first row
// (+ r0 rows, + col) and comes back advanced by ROWS rows, at the next tile: the loop carries one
// pointer per tensor and a 64-bit add per chunk. `dst` = tile + thread_dst_off.
template <int ROWS, int D, int NTHREADS>
struct RowCopy {
  static constexpr int kChunks = D / 8, kStep = NTHREADS / kChunks;
  static constexpr bool kFits = NTHREADS % kChunks == 0 && ROWS % kStep == 0 && kStep % 8 == 0;
  static EXLA_RS_DEVICE int r0(int tid) { return tid / kChunks; }
  static EXLA_RS_DEVICE int col(int tid) { return (tid % kChunks) * 8; }
  static EXLA_RS_DEVICE unsigned thread_dst_off(int tid) { return 2u * (unsigned)Swz<ROWS, D>::off(r0(tid), col(tid)); }
  // kStep a multiple of 8: every row the thread copies has its first row's swizzle.
  static EXLA_RS_DEVICE void copy(unsigned dst, const unsigned short*& src, long long step) {
    static_assert(kFits, "RowCopy: the thread count does not split the tile into whole 8-row steps");
#pragma unroll
    for (int i = 0; i < ROWS / kStep; ++i) {
      cp_async16_s(dst + 2u * (unsigned)(i * kStep * Swz<ROWS, D>::W), src, 16);
      src += step;
    }
  }
};

}  // namespace exla_rs
