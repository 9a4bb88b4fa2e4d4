// The backward's elementwise step with the contract's optional features (bias, ALiBi, dropout,
// dbias; key_mask arrives as the keys' query intervals: docs/flash-attention-contract.md), shared by
// the mma.sync backward (flash_bwd.cuh) and the Hopper one (sm90/flash_bwd_sm90.cuh): their S^T / dP^T
// fragments have the same layout (an m16n8 accumulator per 8 queries; the wgmma m64nN accumulator of
// a warp is the same registers in the same order, element 4 j + e being (j, e)), so one copy of the
// math and of the Philox draw serves both.
#pragma once

#include "common.cuh"
#include "extras.cuh"

namespace exla_rs {

// Dropout keep bits of this thread's S^T fragment for one step: bit j*4 + e = element (j, e) (query
// m0 + j*8 + tig*2 + (e & 1), key key_a + (e >> 1)*8, key_a = key_warp0 + g) is kept. One x call
// covers a query's 8 keys key_warp0 + 8k .. + 7 (k = e >> 1), and lane g = 2w + p holds key 2w + p
// of the octet: half p of word w. Per pair of steps (j = 2jp, 2jp + 1), the 8 lanes with the same
// tig need 8 calls (2 steps x 2 queries x 2 octets): lane (w, p) computes call c = w of step
// 2jp + p (query + (c & 1), octet k = c >> 1); a 4 x 4 transpose over w (lane distances 8, 16)
// hands lane (w, p) word w of the 4 calls of step 2jp + p, whose halves p are its own keep bits
// and halves p ^ 1 those of lane (w, p ^ 1) for that step: decided here (y only on a tie), they
// travel as 4 bits in one shuffle (lane ^ 4). 1 Philox call per 8 elements instead of 4.
template <int BM>
EXLA_RS_DEVICE unsigned dropout_keep_bits_t(const Dropout& dr, int b, int h, int m0, int key_warp0, int g, int tig) {
  constexpr int NJ = BM / 8;
  static_assert(NJ <= 8, "4 keep bits per step row block in one u32");
  const int w = g >> 1, p = g & 1;
  const unsigned oct0 = (unsigned)key_warp0 >> 3;  // key_warp0 = n0 + 16 ks: a multiple of 8
  unsigned bits = 0;
#pragma unroll 1  // the Philox rounds are long: one copy in the code
  for (int jp = 0; jp < (NJ + 1) / 2; ++jp) {
    // With NJ odd, lanes p = 1 of the last pair compute step NJ: its bits (4 NJ .. 4 NJ + 3, inside
    // the u32 for NJ <= 7) are never read.
    const int j = 2 * jp + p;
    const unsigned q0 = (unsigned)(m0 + j * 8 + tig * 2);  // call c: query q0 + (c & 1), octet oct0 + (c >> 1)
    const Philox4 r = dropout_x(dr.k0, dr.k1, (unsigned)b, (unsigned)h, q0 + (unsigned)(w & 1), oct0 + (unsigned)(w >> 1));
    unsigned a[4] = {r.x[0], r.x[1], r.x[2], r.x[3]};
    transpose4_lanes<8>(a, w);
    const unsigned k8 = dr.keep8(a, w, oct0, q0, 1u, (unsigned)b, (unsigned)h);  // bit 2c + hh
    // The 4 bits of one half (2c + hh for c = 0..3) packed as bit c.
    const unsigned mine = k8 >> p, give = k8 >> (p ^ 1);
    const unsigned mine4 = (mine & 1u) | ((mine >> 1) & 2u) | ((mine >> 2) & 4u) | ((mine >> 3) & 8u);
    const unsigned give4 = (give & 1u) | ((give >> 1) & 2u) | ((give >> 2) & 4u) | ((give >> 3) & 8u);
    const unsigned got4 = __shfl_xor_sync(0xffffffffu, give4, 4);  // lane (w, p ^ 1)'s halves p, step j ^ 1
    bits |= (mine4 << (4 * j)) | (got4 << (4 * (j ^ 1)));
  }
  return bits;
}

// The per-step values of the backward's elementwise step with optional features (flash_bwd's
// `if (extras)` branch), handed to bwd_extras_elementwise.
struct BwdExtrasStep {
  const void* bias;
  unsigned keep_bits;   // dropout: bit j*4 + e = element (j, e) kept (all ones without dropout)
  float drop_scale;     // 1 / (1 - rate), 1 without dropout
  float slope_l2;       // -slope[h] * log2(e)
  bool has_alibi;
  int rel;              // position - key of element (0, 0)
  int q_lim, k_lim;     // element query / key offsets below these are rows < Sq / keys < kv_end
  long long bias_base;  // bias (and dbias) offset of element (0, 0)
  int bsq, bsk;         // bias strides of queries and keys
  float* dbias;         // dbias_accum, null when this warp adds nothing
  int g, tig;
};

// The elementwise step for bias type BT (NoBias without a bias): z = s + bias + alibi in the exp2
// domain, P^T <- P^T * M * scale_drop, dZ = P (M * scale_drop * dP - delta), dS = dZ softcap'(s),
// dZ into dbias_accum after summing what this thread / warp covers (dbias_keys: Sqb = 1 sums).
template <class BT, int BM>
EXLA_RS_DEVICE void bwd_extras_elementwise(float (&st)[BM / 8][4], float (&dpt)[BM / 8][4], float (&dbias_keys)[2],
                                           const BwdExtrasStep& xs, const BwdParams& p, const float* sLse,
                                           const float* sDelta, const bool (&kbad)[2], const int (&qa)[2],
                                           const int (&qz)[2], bool full) {
  const void* bias = xs.bias;
  const unsigned keep_bits = xs.keep_bits;
  const float drop_scale = xs.drop_scale, slope_l2 = xs.slope_l2;
  const bool has_alibi = xs.has_alibi;
  const int rel = xs.rel, q_lim = xs.q_lim, k_lim = xs.k_lim, bsq = xs.bsq, bsk = xs.bsk, g = xs.g, tig = xs.tig;
  const long long bias_base = xs.bias_base;
  float* dbias = xs.dbias;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    float dz4[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int ql = j * 8 + tig * 2 + (e & 1);
      const int qc = j * 8 + (e & 1), kc = (e >> 1) * 8;  // query / key offsets from element (0, 0)
      const float l2 = sLse[ql];
      const float s0 = p.softcap > 0.f ? score(st[j][e], p.scale, p.softcap, p.softcap_inv) : st[j][e] * p.scale;
      const float s = kbad[e >> 1] ? qnan() : s0;
      float z2 = s * kLog2e;
      if constexpr (BT::kPresent) {
        if (qc < q_lim && kc < k_lim) z2 += BT::load(bias, bias_base + (long long)qc * bsq + kc * bsk) * kLog2e;
      }
      if (has_alibi) z2 += slope_l2 * alibi_dist(rel + qc - kc);
      // A bias of -inf hides the element like the mask (P = 0, and no NaN from dP).
      // Two compares, not bit_range's mask: the masks' live registers spilled bwd_*_d96/d192 here.
      const bool vis = l2 != neg_inf() && (full || (qc >= qa[e >> 1] && qc < qz[e >> 1])) && z2 != neg_inf();
      const float pr = vis ? ex2(z2 - l2) : 0.f;
      const float pm = ((keep_bits >> (j * 4 + e)) & 1) ? drop_scale : 0.f;  // M * scale_drop
      st[j][e] = pr * pm;
      const float dz = vis ? pr * (pm * dpt[j][e] - sDelta[ql]) : 0.f;
      dz4[e] = dz;
      dpt[j][e] = dz * softcap_grad(s, p.softcap, p.softcap_inv);
    }
    if (dbias != nullptr) {
      if (bsq == 0) {  // Sqb = 1: per key, in registers across the step's queries
        dbias_keys[0] += dz4[0] + dz4[1];
        dbias_keys[1] += dz4[2] + dz4[3];
      } else if (bsk == 0) {  // Skb = 1: per query, summed over the warp's 16 keys first
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float v = dz4[c] + dz4[c + 2];
          v += __shfl_xor_sync(0xffffffffu, v, 4);
          v += __shfl_xor_sync(0xffffffffu, v, 8);
          v += __shfl_xor_sync(0xffffffffu, v, 16);
          if (g == 0 && v != 0.f) red_add_f32(dbias + bias_base + (long long)(j * 8 + c) * bsq, v);
        }
      } else {  // one entry per element; dZ != 0 only where visible, so in range
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (dz4[e] != 0.f) red_add_f32(dbias + bias_base + (long long)(j * 8 + (e & 1)) * bsq + (e >> 1) * 8 * bsk, dz4[e]);
      }
    }
  }
}

// The whole step for one thread's fragment of BM queries x its two keys key_a, key_a + 8 (element
// (j, e) is query m0 + j*8 + tig*2 + (e & 1), key key_a + (e >> 1)*8): st <- P^T * M * scale_drop,
// dpt <- dS^T (without the final scale), dZ added into `dbias` (dbias_accum, or null where this
// thread adds nothing). qlo / qhi: the queries that see each key ([0, 0) for a key key_mask hides);
// `full`: every query of the step sees both keys. sLse holds lse * log2(e) (-inf: a hidden row),
// sDelta delta. keep_bits: dropout's (bit j*4 + e; all ones without dropout). Every lane of the
// warp calls it (the dbias sums shuffle).
template <int BM>
EXLA_RS_DEVICE void bwd_extras_step(float (&st)[BM / 8][4], float (&dpt)[BM / 8][4], const BwdParams& p, const Mask& mask,
                                    const float* sLse, const float* sDelta, const bool (&kbad)[2], const int (&qlo)[2],
                                    const int (&qhi)[2], bool full, unsigned keep_bits, bool has_drop, bool has_alibi,
                                    bool has_bias, float* dbias, int b, int h, int m0, int key_a, int g, int tig, int lane) {
  const ExtraParams& x = p.x;
  const float drop_scale = has_drop ? x.dropout_scale : 1.f;
  const float slope_l2 = has_alibi ? -x.alibi_slopes[h] * kLog2e : 0.f;
  const int rel = alibi_rel(mask.q_start + m0 + tig * 2, key_a);  // position - key of element (0, 0)
  const int q_lim = p.seq_q - m0 - tig * 2;  // element query offsets below this are rows < Sq
  const int k_lim = mask.kv_end - key_a;      // key offsets (0, 8) below this are keys < kv_end
  const long long bias_base = bias_offset(x, b, h, m0 + tig * 2, key_a);  // element (0, 0)
  // Sqb <= Sq and Skb <= Sk: these two strides fit in 32 bits (products widen below).
  const int bsq = (int)x.bias_stride_q, bsk = (int)x.bias_stride_k;
  // Sqb = 1: this thread's dZ sums for its two keys over the step's queries, flushed below
  // with one atomic per entry and step. (Summing across steps as well kept two more values
  // live through the whole sweep, which spilled bwd_bf16_d192 on sm_90.)
  float dbias_keys[2] = {0.f, 0.f};
  const int qa[2] = {qlo[0] - m0 - tig * 2, qlo[1] - m0 - tig * 2};
  const int qz[2] = {qhi[0] - m0 - tig * 2, qhi[1] - m0 - tig * 2};
  const BwdExtrasStep xs{has_bias ? x.bias : nullptr, keep_bits, drop_scale, slope_l2, has_alibi, rel, q_lim, k_lim, bias_base, bsq, bsk, dbias, g, tig};
  // One copy of the loop per bias dtype and one without a bias: no per-element type switch.
  // (Not a generic lambda: NVRTC's JIT mode takes its call operator for a host function.)
  if (!has_bias)
    bwd_extras_elementwise<NoBias, BM>(st, dpt, dbias_keys, xs, p, sLse, sDelta, kbad, qa, qz, full);
  else if (x.bias_dtype == 0)
    bwd_extras_elementwise<BiasF32, BM>(st, dpt, dbias_keys, xs, p, sLse, sDelta, kbad, qa, qz, full);
  else if (x.bias_dtype == 1)
    bwd_extras_elementwise<BiasF16, BM>(st, dpt, dbias_keys, xs, p, sLse, sDelta, kbad, qa, qz, full);
  else
    bwd_extras_elementwise<BiasBF16, BM>(st, dpt, dbias_keys, xs, p, sLse, sDelta, kbad, qa, qz, full);
  // Sqb = 1: flush the per-key sums; the quad's 4 threads hold the same keys' other queries.
  if (dbias != nullptr && bsq == 0) {
    const long long base = bias_offset(x, b, h, 0, key_a);
    if (bsk == 0) {  // Sqb = Skb = 1: one entry for the whole warp
      float v = dbias_keys[0] + dbias_keys[1];
      v = warp_sum(v);
      if (lane == 0 && v != 0.f) red_add_f32(dbias + base, v);
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        dbias_keys[r] += __shfl_xor_sync(0xffffffffu, dbias_keys[r], 1);
        dbias_keys[r] += __shfl_xor_sync(0xffffffffu, dbias_keys[r], 2);
      }
      if (tig == 0)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (dbias_keys[r] != 0.f) red_add_f32(dbias + base + r * 8 * bsk, dbias_keys[r]);
    }
  }
}

}  // namespace exla_rs
