// Device helpers for the contract's optional features (docs/flash-attention-contract.md: key mask,
// bias, ALiBi, dropout), shared by the tensor-core kernels (flash_fwd.cuh, flash_bwd.cuh) and the
// f32 SIMT kernels (simt.cuh). Each helper computes one element of the contract's definition; the
// kernels decide where (which fragment element, which tile) to call them.
//
// Header-free like common.cuh: NVRTC compiles this text with no CUDA include directory.
#pragma once

#include "common.cuh"

namespace exla_rs {

// Compile-time feature sets of the tensor-core kernels (flash_fwd.cuh, flash_bwd.cuh): the `F`
// template argument is an OR of these bits, and kernels/generate.py writes one instantiation per
// set; the launcher (crates/exla-rs-cuda/src/config.rs, FeatureSet) picks the smallest set that
// covers the call. A feature whose bit is clear is compiled out, so the plain set (F = 0: causal,
// window, softcap, kv_len, q_start only) carries none of the others' code, registers or integer
// work. Inside a set, a feature is still tested at run time (a null pointer = absent), so the set
// with a bit computes the same result as the plain set when that feature is absent.
constexpr int kFeatMasks = 1;    // key_mask, bias, ALiBi, dbias (masks and additive terms)
constexpr int kFeatDropout = 2;  // dropout

// ---------------------------------------------------------------------------------------------
// Dropout: Philox4x32-10 (Salmon et al., SC 2011; Random123's philox4x32_R(10, ctr, key)), as the
// contract's "The generator" section defines it. All arithmetic wraps mod 2^32.

struct Philox4 {
  unsigned x[4];
};

EXLA_RS_DEVICE Philox4 philox4x32_10(unsigned c0, unsigned c1, unsigned c2, unsigned c3, unsigned k0, unsigned k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    // (hi, lo) of the 64-bit products M0 * c0 and M1 * c2: __umulhi and a plain multiply.
    const unsigned hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const unsigned hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;  // the key bump before the next round (dead after round 9)
    k1 += 0xBB67AE85u;
  }
  Philox4 o;
  o.x[0] = c0;
  o.x[1] = c1;
  o.x[2] = c2;
  o.x[3] = c3;
  return o;
}

// The mask (contract "Dropout", "The mask"): entry (b, h, i, j) draws half(x, j) << 16 | half(y, j)
// with x = Philox(ctr (j div 8, i, h, b)), y = Philox(ctr (2^31 + j div 8, i, h, b)) and
// half(w, j) = the 16-bit half j mod 2 (0 = low) of word (j mod 8) div 2; kept iff draw >= T. So
// one x call covers the upper halves of 8 keys (an "octet"), and they decide alone unless
// half(x, j) == T >> 16 (probability 2^-16): only then is y computed, for that key. h is the QUERY
// head; i the row index (not q_start + i). Every index is taken as a u32 (the contract's domain).
EXLA_RS_DEVICE Philox4 dropout_x(unsigned k0, unsigned k1, unsigned b, unsigned h, unsigned i, unsigned oct) {
  return philox4x32_10(oct, i, h, b, k0, k1);
}

// Word w (0..3, runtime) of a Philox output with selects: indexing the array with a runtime value
// would place it in local memory (a stack frame).
EXLA_RS_DEVICE unsigned philox_word(const Philox4& r, int w) {
  return w == 0 ? r.x[0] : (w == 1 ? r.x[1] : (w == 2 ? r.x[2] : r.x[3]));
}

// The dropout state a kernel needs, read once from the argument block: the key lives in device
// memory (the operand), the threshold and scale come from the host.
struct Dropout {
  unsigned k0, k1, threshold;
  float scale;  // 1 / (1 - rate), f32 from the host
  // Only call when x.dropout_key is non-null.
  EXLA_RS_DEVICE static Dropout load(const ExtraParams& x) {
    Dropout d;
    d.k0 = x.dropout_key[0];
    d.k1 = x.dropout_key[1];
    d.threshold = x.dropout_threshold;
    d.scale = x.dropout_scale;
    return d;
  }
  // The rare path: the key whose upper half (half hh of word w of x, counter (oct, i, h, b)) equals
  // T >> 16 is kept iff its lower half, the same half of y's word w, is >= T & 0xFFFF.
  EXLA_RS_DEVICE bool tie_keep(unsigned b, unsigned h, unsigned i, unsigned oct, int w, int hh) const {
    const Philox4 y = philox4x32_10(oct + 0x80000000u, i, h, b, k0, k1);  // oct < 2^31: the top bit set
    return ((philox_word(y, w) >> (16 * hh)) & 0xFFFFu) >= (threshold & 0xFFFFu);
  }
  // One entry's keep bit: (b, h, i, j) with j < 2^34 (j div 8 is the counter's first word).
  EXLA_RS_DEVICE bool keep(unsigned b, unsigned h, unsigned i, long long j) const {
    const unsigned oct = (unsigned)(j >> 3);
    const int w = (int)(j >> 1) & 3, hh = (int)j & 1;
    const unsigned up = (philox_word(dropout_x(k0, k1, b, h, i, oct), w) >> (16 * hh)) & 0xFFFFu, t = threshold >> 16;
    return up != t ? up > t : tie_keep(b, h, i, oct, w, hh);
  }
  // The keep bits of the 8 keys whose upper halves are in a[0..3]: a[c] is word w of x of counter
  // (oct0 + (c >> 1), i0 + (c & 1) * i_step, h, b), and bit 2c + hh is its key of half hh (key
  // 8 (oct0 + (c >> 1)) + 2w + hh). Eight compares; y only for a tie (at most one per tied key).
  EXLA_RS_DEVICE unsigned keep8(const unsigned (&a)[4], int w, unsigned oct0, unsigned i0, unsigned i_step, unsigned b,
                                unsigned h) const {
    const unsigned t = threshold >> 16;
    unsigned bits = 0, tie = 0;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const unsigned up = hh ? a[c] >> 16 : a[c] & 0xFFFFu;
        bits |= (unsigned)(up > t) << (2 * c + hh);
        tie |= (unsigned)(up == t) << (2 * c + hh);
      }
#pragma unroll 1  // rare (2^-16 per key) and divergent: one copy of the Philox rounds
    while (tie != 0) {
      const int k = __ffs(tie) - 1, c = k >> 1;
      tie &= tie - 1;
      bits |= (unsigned)tie_keep(b, h, i0 + (unsigned)(c & 1) * i_step, oct0 + (unsigned)(c >> 1), w, k & 1) << k;
    }
    return bits;
  }
};

// The 4 x 4 transpose of u32 words across 4 lanes whose lane ids differ in bits log2(kStride) and
// log2(kStride) + 1 (lane w of the group has w = (lane / kStride) & 3): lane w enters with a[k] =
// word k of Philox call w and leaves with a[e] = word w of call e. Two butterfly levels (lane
// distance kStride, then 2 kStride); at each, a lane swaps with its partner the two words whose
// index bit differs from its own w bit. The forward uses kStride 1 (the 4 lanes of an mma quad),
// the backward kStride 8 (lanes g = 2w + p, same p and tig).
template <int kStride>
EXLA_RS_DEVICE void transpose4_lanes(unsigned (&a)[4], int w) {
  const bool w1 = w & 1, w2 = w & 2;
#pragma unroll
  for (int t = 0; t < 2; ++t) {  // index bit 0, partner lane ^ kStride
    const unsigned got = __shfl_xor_sync(0xffffffffu, w1 ? a[2 * t] : a[2 * t + 1], kStride);
    if (w1) a[2 * t] = got; else a[2 * t + 1] = got;
  }
#pragma unroll
  for (int t = 0; t < 2; ++t) {  // index bit 1, partner lane ^ 2 kStride
    const unsigned got = __shfl_xor_sync(0xffffffffu, w2 ? a[t] : a[t + 2], 2 * kStride);
    if (w2) a[t] = got; else a[t + 2] = got;
  }
}

// ---------------------------------------------------------------------------------------------
// Key mask: [B, Sk] integers of 1, 2, 4 or 8 bytes; nonzero = visible. `idx` = b * Sk + j.

EXLA_RS_DEVICE bool key_mask_visible(const void* key_mask, int bytes, long long idx) {
  switch (bytes) {
    case 1: return static_cast<const unsigned char*>(key_mask)[idx] != 0;
    case 2: return static_cast<const unsigned short*>(key_mask)[idx] != 0;
    case 4: return static_cast<const unsigned*>(key_mask)[idx] != 0;
    default: return static_cast<const unsigned long long*>(key_mask)[idx] != 0;
  }
}

// The key-mask bits of a key tile [n0, n0 + BN) (BN = 32 or 64) of batch row `mask_row` (= b * Sk):
// bit k = key n0 + k is visible by key_mask, 0 past seq_k. Every warp reads the BN entries itself
// (one or two per lane, coalesced) and ballots, so the result is warp-uniform and the same in every
// warp: a block agrees on skipping a tile (all bits 0) without a barrier.
template <int BN>
EXLA_RS_DEVICE unsigned long long key_mask_tile_bits(const ExtraParams& x, long long mask_row, int n0, int seq_k, int lane) {
  static_assert(BN == 32 || BN == 64, "key tile width");
  unsigned long long bits = 0;
#pragma unroll
  for (int half = 0; half < BN / 32; ++half) {
    const int key = n0 + half * 32 + lane;
    const bool vis = key < seq_k && key_mask_visible(x.key_mask, x.key_mask_bytes, mask_row + key);
    bits |= (unsigned long long)__ballot_sync(0xffffffffu, vis) << (32 * half);
  }
  return bits;
}

// ---------------------------------------------------------------------------------------------
// Bias: element (b, h, i, j) (h = query head) sits at b*stride_b + h*stride_h + i*stride_q +
// j*stride_k, strides 0 on broadcast dimensions (the Host fills them from the operand's shape).

EXLA_RS_DEVICE long long bias_offset(const ExtraParams& x, long long b, long long h, long long i, long long j) {
  return b * x.bias_stride_b + h * x.bias_stride_h + i * x.bias_stride_q + j * x.bias_stride_k;
}

// The bias element types as tags, so a kernel switches on bias_dtype once, outside its loops, and
// runs a loop specialised for one type (BiasF32::load etc.; NoBias below for "no bias operand").
struct BiasF32 {
  static constexpr bool kPresent = true;
  static EXLA_RS_DEVICE float load(const void* bias, long long off) { return static_cast<const float*>(bias)[off]; }
};
struct BiasF16 {
  static constexpr bool kPresent = true;
  static EXLA_RS_DEVICE float load(const void* bias, long long off) {
    return F16::to_float(static_cast<const unsigned short*>(bias)[off]);
  }
};
struct BiasBF16 {
  static constexpr bool kPresent = true;
  static EXLA_RS_DEVICE float load(const void* bias, long long off) {
    return BF16::to_float(static_cast<const unsigned short*>(bias)[off]);
  }
};

// Bias tag for "no bias operand": the kernels' extras loops take it where x.bias is null.
struct NoBias {
  static constexpr bool kPresent = false;
  static EXLA_RS_DEVICE float load(const void*, long long) { return 0.f; }
};

// One element with the type switch inside (for code outside hot loops).
EXLA_RS_DEVICE float bias_load(const void* bias, int dtype, long long off) {
  switch (dtype) {
    case 0: return BiasF32::load(bias, off);
    case 1: return BiasF16::load(bias, off);
    default: return BiasBF16::load(bias, off);
  }
}

// Kernels pick BiasF32/BiasF16/BiasBF16/NoBias with an if-chain on bias_dtype outside their loops
// and call a template: a generic lambda ([&](auto tag)) would be neater, but NVRTC's JIT mode takes
// its call operator for a host function and refuses to compile it.

// ---------------------------------------------------------------------------------------------
// ALiBi: alpha = -slope[h] * |pos - j| with pos = q_start + i (64-bit in the contract). |pos - j|
// is converted to f32 once (one rounding, as the Host does) and multiplied by the slope.

EXLA_RS_DEVICE float alibi_term(float slope, long long pos, long long j) {
  const long long d = pos - j;
  return -slope * (float)(d < 0 ? -d : d);
}

// The tensor-core kernels keep scores in the exp2 domain, so they add alpha * log2(e) with one FMA
// per element from a slope pre-multiplied by -log2(e) and an integer distance (the kernels work with
// tile-relative 32-bit distances; alibi_rel clamps so that they never overflow).
EXLA_RS_DEVICE int alibi_rel(long long pos, long long j0) {
  const long long d = pos - j0;
  constexpr long long kCap = 1LL << 30;  // |pos - j| >= 2^30: ALiBi beyond any real context length
  return (int)(d > kCap ? kCap : (d < -kCap ? -kCap : d));
}
EXLA_RS_DEVICE float alibi_dist(int rel) { return (float)(rel < 0 ? -rel : rel); }

// ---------------------------------------------------------------------------------------------
// The bias gradient: dbias_accum (f32, laid out like the bias) += v, without reading the result
// back (red, not atom): the sum's order does not matter and nothing waits for the old value.
using ptx::red_add_f32;

}  // namespace exla_rs
