// Tests of the GPU-on-CPU executor itself: the PTX models against independent references (the
// CPU's own F16C conversions, float64 matrix products of operands placed by the ISA's fragment
// tables) and the executor's checks on small kernels written here (divergent collectives, a mask
// that excludes its lane, deadlocks on a CTA barrier and on an mbarrier, cp.async data that lands
// only at its wait, __trap, setmaxnreg splits that fit the block's register pool and one that
// does not); and, as host code, the kernels' visibility intervals (common.cuh Mask) against the
// contract's predicate. With an argument it runs one kernel that a sanitizer must catch:
// `--race` (two threads write one shared word unordered: ThreadSanitizer), `--block_race` (two
// blocks write one global word: ThreadSanitizer, however each block orders itself), `--oob` (a store one
// byte past the dynamic shared memory: AddressSanitizer); run_executor_test.sh checks they fail.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>

#include <random>
#include <string>
#include <vector>

#include "../device.hpp"
#include "../exec.h"
#include "../kernel_table.hpp"
#include "sm90/hopper.cuh"  // regs_release / regs_claim: the wrappers the sm90 kernels call
#include "common.cuh"  // Mask: the kernels' visibility intervals (test_mask_intervals)

using namespace exla_rs;

static int failures = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      ++failures;                                          \
      printf("FAIL %s:%d: ", __FILE__, __LINE__);          \
      printf(__VA_ARGS__);                                 \
      printf("\n");                                        \
    }                                                      \
  } while (0)

// ---------------------------------------------------------------------------------------------
// Test kernels. Parameters are a single pointer block.

struct MmaArgs {
  const unsigned short* a;   // 16 x 16 row-major
  const unsigned short* bt;  // 8 x 16: B^T, row n holds column n of B
  const unsigned short* b;   // 16 x 8 row-major (for ldmatrix.trans)
  float* d;                  // 16 x 8 (non-trans B), then 16 x 8 (trans B)
  int bf16;
};

extern "C" void test_mma(const MmaArgs p) {
  EXLA_RS_DYNAMIC_SMEM(smem, 128);
  unsigned short* sA = reinterpret_cast<unsigned short*>(smem);  // 16 x 16
  unsigned short* sBt = sA + 256;                                // 8 x 16
  unsigned short* sB = sBt + 128;                                // 16 x 8
  const int lane = threadIdx.x;
  for (int i = lane; i < 256; i += 32) sA[i] = p.a[i];
  for (int i = lane; i < 128; i += 32) sBt[i] = p.bt[i], sB[i] = p.b[i];
  __syncwarp();
  unsigned a[4], b[4], bt[4];
  // Matrices 0..3 of A: rows 0-7 / 8-15 of columns 0-7, then of columns 8-15 (lanes 16-31).
  ptx::ldmatrix_x4(a, sA + (lane & 15) * 16 + (lane >> 4) * 8);
  // B^T rows n = lane & 7, k half (lane >> 3) & 1: matrices (k 0-7), (k 8-15), then repeated.
  ptx::ldmatrix_x4(b, sBt + (lane & 7) * 16 + ((lane >> 3) & 1) * 8);
  // B rows k = lane & 15 (two 8 x 8 matrices of k), transposed on load.
  ptx::ldmatrix_x4_trans(bt, sB + (lane & 15) * 8);
  // .x2 and .x1 give the first matrices of the same addresses (lanes 0-15 / 0-7 address them).
  unsigned b2[2], b1[1], bt1[1];
  ptx::ldmatrix_x2(b2, sBt + (lane & 7) * 16 + ((lane >> 3) & 1) * 8);
  ptx::ldmatrix_x1(b1, sBt + (lane & 7) * 16);
  ptx::ldmatrix_x1_trans(bt1, sB + (lane & 7) * 8);
  if (b2[0] != b[0] || b2[1] != b[1] || b1[0] != b[0] || bt1[0] != bt[0]) __trap();
  float c[4] = {0.5f, -0.25f, 1.f, 2.f}, c2[4] = {0.5f, -0.25f, 1.f, 2.f};
  if (p.bf16) {
    ptx::mma_m16n8k16_bf16(c, a, b[0], b[1]);
    ptx::mma_m16n8k16_bf16(c2, a, bt[0], bt[1]);
  } else {
    ptx::mma_m16n8k16_f16(c, a, b[0], b[1]);
    ptx::mma_m16n8k16_f16(c2, a, bt[0], bt[1]);
  }
  const int g = lane >> 2, t = lane & 3;
  for (int q = 0; q < 4; ++q) {
    p.d[(g + 8 * (q >> 1)) * 8 + 2 * t + (q & 1)] = c[q];
    p.d[128 + (g + 8 * (q >> 1)) * 8 + 2 * t + (q & 1)] = c2[q];
  }
}
EXLA_RS_KERNEL_ENTRY(test_mma)

struct VoteArgs {
  int* out;  // per thread: shfl_xor(v, 5), shfl(v, 3, width 16), ballot(odd), any(lane == 7), all(lane < 40)
};
extern "C" void test_vote(const VoteArgs p) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int v = 1000 * tid;
  int* o = p.out + 5 * tid;
  o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
  o[1] = __shfl_sync(0xffffffffu, v, 3, 16);
  o[2] = (int)__ballot_sync(0xffffffffu, lane & 1);
  o[3] = __any_sync(0xffffffffu, lane == 7);
  o[4] = __all_sync(0xffffffffu, tid < 40);
}
EXLA_RS_KERNEL_ENTRY(test_vote)

struct Empty {
  int unused;
};
extern "C" void test_divergent(const Empty) {
  if (threadIdx.x < 16)
    (void)__shfl_xor_sync(0xffffffffu, 1, 1);
  else
    (void)__ballot_sync(0xffffffffu, 1);
}
EXLA_RS_KERNEL_ENTRY(test_divergent)

extern "C" void test_mask(const Empty) { (void)__shfl_xor_sync(0xffffffdfu, 1, 1); }  // lane 5 excluded, yet runs it
EXLA_RS_KERNEL_ENTRY(test_mask)

extern "C" void test_barrier_deadlock(const Empty) {
  if (threadIdx.x == 0) return;
  __syncthreads();
}
EXLA_RS_KERNEL_ENTRY(test_barrier_deadlock)

extern "C" void test_mbar_deadlock(const Empty) {
  EXLA_RS_DYNAMIC_SMEM(smem, 128);
  const uint32_t off = 0;
  if (threadIdx.x == 0) exla_rs_gpusim::mbar_init(off, 1);
  __syncthreads();
  exla_rs_gpusim::mbar_wait(off, 0);  // phase 0 never completes: nobody arrives
  (void)smem;
}
EXLA_RS_KERNEL_ENTRY(test_mbar_deadlock)

// setmaxnreg against the block's register pool, shaped like the sm90 forward: 384 threads start
// with 168 registers each (__launch_bounds__(384, 1): 64512 in all), the producer warpgroup drops
// to P, the two others ask C. 40/232 fits exactly (the producer last, so both .inc wait for its
// .dec); 48/232 (the D = 256 split that hung on an H200) leaves the second consumer 1024 short.
template <int kProducer, int P, int C>
void regs_split() {
  if (threadIdx.x / 128 == kProducer)
    exla_rs::sm90::regs_release<P>();
  else
    exla_rs::sm90::regs_claim<C>();
}
extern "C" void test_regs_fit(const Empty) { regs_split<2, 40, 232>(); }
EXLA_RS_KERNEL_ENTRY(test_regs_fit)
extern "C" void test_regs_overdraw(const Empty) { regs_split<0, 48, 232>(); }
EXLA_RS_KERNEL_ENTRY(test_regs_overdraw)

struct CpArgs {
  const unsigned* src;  // 4 words
  unsigned* seen;       // before the wait, after it
};
extern "C" void test_cp_async(const CpArgs p) {
  EXLA_RS_DYNAMIC_SMEM(smem, 128);
  unsigned* s = reinterpret_cast<unsigned*>(smem);
  ptx::cp_async16(s, p.src, 16);
  ptx::cp_async_commit();
  p.seen[0] = s[0];  // too early: the copy has not landed
  ptx::cp_async_wait<0>();
  p.seen[1] = s[0];
}
EXLA_RS_KERNEL_ENTRY(test_cp_async)

extern "C" void test_trap(const Empty) {
  if (threadIdx.x == 3) __trap();
}
EXLA_RS_KERNEL_ENTRY(test_trap)

extern "C" void test_race(const Empty) {
  EXLA_RS_DYNAMIC_SMEM(smem, 128);
  reinterpret_cast<int*>(smem)[0] = (int)threadIdx.x;  // every thread, unordered
  __syncthreads();
}
EXLA_RS_KERNEL_ENTRY(test_race)

extern "C" void test_ordered(const Empty) {
  EXLA_RS_DYNAMIC_SMEM(smem, 128);
  if (threadIdx.x == 0) reinterpret_cast<int*>(smem)[0] = 1;
  __syncthreads();
  if (threadIdx.x == 1) reinterpret_cast<int*>(smem)[0] += 1;  // after the barrier: ordered
}
EXLA_RS_KERNEL_ENTRY(test_ordered)

// Blocks of a grid are unordered: block 0's store before its barrier and block 1's after its own
// race, however each block orders its threads (the executor reuses one barrier, and in a pool of
// ThreadSanitizer threads the same ones, for every block: none of that may order the blocks).
// `--block_race` must be caught; `--block_ordered` (the second store in block 0) must not.
struct RaceArgs {
  int* word;
  unsigned block, thread;  // who stores after the barrier
};
extern "C" void test_block_race(const RaceArgs p) {
  if (blockIdx.x == 0 && threadIdx.x == 0) p.word[0] = 1;
  __syncthreads();
  if (blockIdx.x == p.block && threadIdx.x == p.thread) p.word[0] = 2;
}
EXLA_RS_KERNEL_ENTRY(test_block_race)

extern "C" void test_oob(const Empty) {
  EXLA_RS_DYNAMIC_SMEM(smem, 128);
  if (threadIdx.x == 0) smem[64] = 1;  // the launch asks for 64 bytes
}
EXLA_RS_KERNEL_ENTRY(test_oob)

// Copy-engine (TMA-like) copies: each fills its span with its byte. Two on one mbarrier land in one
// delivery, each in its own ThreadSanitizer context: `--two_copies` must run clean (it did not when
// the engine wrote its byte count back through a pointer), and overlapping spans in flight at once
// must fail at issue.
struct FillCopy {
  uint32_t dst, bytes;
  unsigned char value;
};
static const char* fill_copy(void* ctx, unsigned char* smem, size_t) {
  const FillCopy& c = *static_cast<const FillCopy*>(ctx);
  memset(smem + c.dst, c.value, c.bytes);
  return nullptr;
}
static void issue_fill(uint32_t bar, uint32_t dst, uint32_t bytes, unsigned char value) {
  const FillCopy c{dst, bytes, value};
  exla_rs_gpusim::async_copy(bar, dst, bytes, fill_copy, &c, sizeof c);
}
struct CopyArgs {
  uint32_t second_dst;  // 192: beside the first copy's [128, 192); 160: overlapping it
  unsigned* seen;       // words 0 and 16 of the copies' spans after the wait
};
extern "C" void test_two_copies(const CopyArgs p) {
  EXLA_RS_DYNAMIC_SMEM(smem, 256);
  const uint32_t bar = 0;
  if (threadIdx.x == 0) {
    exla_rs_gpusim::mbar_init(bar, 1);
    exla_rs_gpusim::mbar_arrive(bar, 128);
    issue_fill(bar, 128, 64, 0x11);
    issue_fill(bar, p.second_dst, 64, 0x22);
  }
  __syncthreads();
  exla_rs_gpusim::mbar_wait(bar, 0);
  if (threadIdx.x == 1 && p.seen) {
    p.seen[0] = reinterpret_cast<unsigned*>(smem + 128)[0];
    p.seen[1] = reinterpret_cast<unsigned*>(smem + 192)[0];
  }
}
EXLA_RS_KERNEL_ENTRY(test_two_copies)

// This binary's own table (the library's kernel_table.cpp lists the attention kernels).
namespace exla_rs_gpusim {
#define ROW(n) {#n, n##_gpusim_entry}
static const KernelEntry kTests[] = {ROW(test_mma),          ROW(test_vote),         ROW(test_divergent), ROW(test_mask),
                                     ROW(test_barrier_deadlock), ROW(test_mbar_deadlock), ROW(test_cp_async),  ROW(test_trap),
                                     ROW(test_race),         ROW(test_ordered),      ROW(test_oob),       ROW(test_two_copies),
                                     ROW(test_block_race),   ROW(test_regs_fit),     ROW(test_regs_overdraw)};
const KernelEntry* find_kernel(const char* name) {
  for (const auto& k : kTests)
    if (strcmp(k.name, name) == 0) return &k;
  return nullptr;
}
}  // namespace exla_rs_gpusim

static std::string launch(const char* k, unsigned threads, unsigned smem, void* args_block, unsigned blocks = 1) {
  void* args[1] = {args_block};
  const uint32_t grid[3] = {blocks, 1, 1}, block[3] = {threads, 1, 1};
  char err[4096] = "";
  const int rc = exla_rs_gpusim_launch(k, grid, block, smem, args, err, sizeof err);
  return rc == 0 ? std::string() : std::string(err[0] ? err : "failed without a message");
}

// ---------------------------------------------------------------------------------------------

static void test_cvt() {
  // f16 -> f32: every pattern against the CPU's F16C (vcvtph2ps), NaNs as NaN.
  for (unsigned h = 0; h < 65536; ++h) {
    const float want = _cvtsh_ss((unsigned short)h), got = ptx::cvt_f32_f16((unsigned short)h);
    if (want != want) {
      CHECK(got != got, "cvt.f32.f16 0x%04x: want NaN", h);
    } else {
      CHECK(__float_as_uint(got) == __float_as_uint(want), "cvt.f32.f16 0x%04x: %a vs %a", h, got, want);
    }
  }
  // f32 -> f16, round to nearest even: every 4099th pattern plus the boundaries (vcvtps2ph, RNE).
  int bad = 0;
  auto one = [&](unsigned x) {
    const float f = __uint_as_float(x);
    const unsigned short got = ptx::cvt_rn_f16_f32(f);
    if (f != f) {
      if (got != 0x7fff) ++bad;
      return;
    }
    if (got != _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT) && bad++ < 5) printf("  cvt.rn.f16.f32 %a: 0x%04x vs 0x%04x\n", f, got, _cvtss_sh(f, 0));
  };
  for (unsigned long long x = 0; x <= 0xffffffffull; x += 4099) one((unsigned)x);
  for (unsigned x : {0x477fefffu, 0x477ff000u, 0x33000000u, 0x33000001u, 0x387fc000u, 0x387fe000u, 0x7f800000u, 0xff800000u})
    one(x), one(x ^ 0x80000000u);
  CHECK(bad == 0, "cvt.rn.f16.f32: %d mismatches with the CPU's F16C", bad);
  // f32 -> bf16: the nearest bfloat16, ties to even (checked from the definition).
  std::mt19937 rng(7);
  bad = 0;
  for (int i = 0; i < 1000000; ++i) {
    const unsigned x = rng();
    const float f = __uint_as_float(x);
    const unsigned short r = ptx::cvt_rn_bf16_f32(f);
    if (f != f) {
      bad += r != 0x7fff;
      continue;
    }
    const double v = f, lo = ptx::bf16_to_f32((unsigned short)(x >> 16));
    double hi = ptx::bf16_to_f32((unsigned short)((x >> 16) + 1));
    if (std::isinf(hi)) hi = copysign(ldexp(1.0, 128), v);  // past the largest finite: rounds to inf
    const double got = ptx::bf16_to_f32(r);
    const double dl = fabs(v - lo), dh = fabs(v - hi);
    const double want = dl < dh ? lo : (dh < dl ? hi : (((x >> 16) & 1) ? hi : lo));
    if (got != want && !(std::isinf(got) && fabs(want) == ldexp(1.0, 128))) ++bad;
  }
  CHECK(bad == 0, "cvt.rn.bf16.f32: %d values not rounded to the nearest (ties to even)", bad);
  // The x2 forms put their first source in the upper half.
  CHECK(ptx::cvt_rn_bf16x2_f32(1.f, 2.f) == ((0x3f80u << 16) | 0x4000u), "cvt.rn.bf16x2.f32 half order");
  CHECK(ptx::cvt_rn_f16x2_f32(1.f, 2.f) == ((0x3c00u << 16) | 0x4000u), "cvt.rn.f16x2.f32 half order");
  // ex2 / lg2 .ftz edge cases from the ISA's tables.
  CHECK(ptx::ex2_approx_ftz(-INFINITY) == 0.f && !signbit(ptx::ex2_approx_ftz(-INFINITY)), "ex2(-inf) = +0");
  CHECK(ptx::ex2_approx_ftz(-130.f) == 0.f, "ex2: subnormal results flush to zero");
  CHECK(ptx::lg2_approx_ftz(1e-40f) == -INFINITY, "lg2: subnormal inputs flush to zero, lg2(0) = -inf");
  CHECK(ptx::lg2_approx_ftz(-1.f) != ptx::lg2_approx_ftz(-1.f), "lg2(-1) = NaN");
}

static void test_mma_kernel(bool bf16) {
  std::mt19937 rng(bf16 ? 11 : 12);
  std::uniform_real_distribution<float> u(-2.f, 2.f);
  std::vector<unsigned short> a(256), bt(128), b(128);
  std::vector<float> af(256), bf(128);
  auto enc = [&](float f) { return bf16 ? ptx::cvt_rn_bf16_f32(f) : ptx::cvt_rn_f16_f32(f); };
  auto dec = [&](unsigned short h) { return bf16 ? ptx::bf16_to_f32(h) : ptx::cvt_f32_f16(h); };
  for (int i = 0; i < 256; ++i) a[i] = enc(u(rng)), af[i] = dec(a[i]);
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) {
      const unsigned short h = enc(u(rng));
      b[k * 8 + n] = h;
      bt[n * 16 + k] = h;
      bf[k * 8 + n] = dec(h);
    }
  std::vector<float> d(256, NAN);
  MmaArgs p{a.data(), bt.data(), b.data(), d.data(), bf16};
  const std::string err = launch("test_mma", 32, (256 + 128 + 128) * 2, &p);
  CHECK(err.empty(), "test_mma: %s", err.c_str());
  const float c0[4] = {0.5f, -0.25f, 1.f, 2.f};
  double worst = 0;
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double want = c0[2 * (m >= 8) + (n & 1)];
      for (int k = 0; k < 16; ++k) want += (double)af[m * 16 + k] * bf[k * 8 + n];
      worst = fmax(worst, fabs(d[m * 8 + n] - want));
      worst = fmax(worst, fabs(d[128 + m * 8 + n] - want));
    }
  CHECK(worst < 1e-5, "ldmatrix + mma.m16n8k16 (%s) vs float64: max error %g", bf16 ? "bf16" : "f16", worst);
}

static void test_vote_kernel() {
  std::vector<int> out(64 * 5, -1);
  VoteArgs p{out.data()};
  const std::string err = launch("test_vote", 64, 0, &p);
  CHECK(err.empty(), "test_vote: %s", err.c_str());
  for (int t = 0; t < 64; ++t) {
    const int lane = t & 31, base = t & ~31;
    CHECK(out[5 * t] == 1000 * (base + (lane ^ 5)), "shfl.bfly thread %d", t);
    CHECK(out[5 * t + 1] == 1000 * (base + (lane & ~15) + 3), "shfl.idx width 16 thread %d", t);
    CHECK((unsigned)out[5 * t + 2] == 0xaaaaaaaau, "ballot thread %d", t);
    CHECK(out[5 * t + 3] == 1, "any thread %d", t);
    CHECK(out[5 * t + 4] == (t < 32 ? 1 : 0), "all thread %d", t);
  }
}

// The kernels' visibility arithmetic (common.cuh Mask), run as host code. Output comparisons
// (test/gpu) catch an interval that is too narrow; this catches one that is too wide (rows_keys'
// O(1) union must be exactly the union of the rows' intervals, or blocks visit tiles nobody sees)
// and checks every interval against the contract's predicate computed without overflow: row_keys,
// keys_rows (one key and whole tiles), rows_keys, tile_full and visible, over windows (near
// i64::MAX too, which Mask::make clamps to 2^40), kv_len (negative, 0, short, full) and q_start
// at both i32 extremes.
static bool contract_visible(long long qs, long long i, long long j, long long kv_end, long long wl, long long wr) {
  const __int128 p = (__int128)qs + i;
  return j < kv_end && (wl < 0 || j >= p - wl) && (wr < 0 || j <= p + wr);
}

static void test_mask_intervals() {
  struct Span {
    int first, second;
  };
  const long long M = 0x7fffffffffffffffLL;
  const int sq = 40, sk = 64;
  int bad = 0, checked = 0;
  auto fail = [&](const char* what, long long wl, long long wr, long long qs, int kv, int a, int b, int got_lo, int got_hi, int lo,
                  int hi) {
    if (bad++ < 8)
      printf("  %s(%d, %d) with wl %lld wr %lld q_start %lld kv_len %d: [%d, %d), want [%d, %d)\n", what, a, b, wl, wr, qs, kv, got_lo,
             got_hi, lo, hi);
  };
  for (long long wl : {-1LL, 0LL, 1LL, 5LL, 40LL, 1LL << 62, M - 1, M})
    for (long long wr : {-1LL, 0LL, 2LL, 33LL, 1LL << 62, M})
      for (long long qs : {-2147483648LL, -50LL, -7LL, 0LL, 9LL, 60LL, 2147483647LL - 40})
        for (int kv : {-2, 0, 1, 17, 31, 63, 64}) {
          const Mask m = Mask::make(sq, sk, kv, (int)qs, wl, wr);
          const long long kv_end = kv < 0 ? 0 : kv;
          auto vis = [&](int i, int j) { return contract_visible(qs, i, j, kv_end, wl, wr); };
          // One row's keys / one key's rows, and unions over row or key ranges, from the predicate.
          auto keys_of = [&](int r0, int r1, int& lo, int& hi) {
            lo = sk, hi = 0;
            for (int i = r0; i < r1; ++i)
              for (int j = 0; j < sk; ++j)
                if (vis(i, j)) lo = imin(lo, j), hi = imax(hi, j + 1);
            if (lo >= hi) lo = hi = 0;
          };
          auto rows_of = [&](int n0, int n1, int& lo, int& hi) {
            lo = sq, hi = 0;
            for (int j = n0; j < n1; ++j)
              for (int i = 0; i < sq; ++i)
                if (vis(i, j)) lo = imin(lo, i), hi = imax(hi, i + 1);
            if (lo >= hi) lo = hi = 0;
          };
          int lo, hi, glo, ghi;
          for (int i = 0; i < sq; ++i) {
            keys_of(i, i + 1, lo, hi);
            m.row_keys(i, glo, ghi);
            ++checked;
            if (glo != lo || ghi != hi) fail("row_keys", wl, wr, qs, kv, i, i + 1, glo, ghi, lo, hi);
            for (int j = 0; j < sk; ++j)
              if (m.visible(i, j) != vis(i, j)) fail("visible", wl, wr, qs, kv, i, j, m.visible(i, j), 0, vis(i, j), 0);
          }
          for (int j = 0; j < sk; ++j) {
            rows_of(j, j + 1, lo, hi);
            m.keys_rows(j, j + 1, glo, ghi);
            ++checked;
            if (glo != lo || ghi != hi) fail("keys_rows", wl, wr, qs, kv, j, j + 1, glo, ghi, lo, hi);
          }
          for (const Span r : {Span{0, 40}, {0, 16}, {16, 32}, {5, 6}, {39, 40}, {7, 7}, {32, 40}}) {
            keys_of(r.first, r.second, lo, hi);
            m.rows_keys(r.first, r.second, glo, ghi);
            ++checked;
            if (glo != lo || ghi != hi) fail("rows_keys", wl, wr, qs, kv, r.first, r.second, glo, ghi, lo, hi);
          }
          for (const Span n : {Span{0, 64}, {0, 32}, {32, 64}, {16, 48}, {63, 64}}) {
            rows_of(n.first, n.second, lo, hi);
            m.keys_rows(n.first, n.second, glo, ghi);
            ++checked;
            if (glo != lo || ghi != hi) fail("keys_rows", wl, wr, qs, kv, n.first, n.second, glo, ghi, lo, hi);
            for (const Span r : {Span{0, 40}, {0, 16}, {16, 32}, {24, 40}}) {
              bool all = true;
              for (int i = r.first; i < r.second; ++i)
                for (int j = n.first; j < n.second; ++j) all &= vis(i, j);
              if (m.tile_full(r.first, r.second, n.first, n.second) != all)
                fail("tile_full", wl, wr, qs, kv, r.first, n.first, m.tile_full(r.first, r.second, n.first, n.second), 0, all, 0);
            }
          }
        }
  CHECK(bad == 0, "Mask: %d of %d intervals differ from the contract's predicate", bad, checked);
}

static void expect_error(const char* kernel, unsigned threads, unsigned smem, const std::vector<const char*>& words) {
  Empty e{0};
  const std::string err = launch(kernel, threads, smem, &e);
  CHECK(!err.empty(), "%s: the executor accepted it", kernel);
  for (const char* w : words) CHECK(err.find(w) != std::string::npos, "%s: report lacks \"%s\": %s", kernel, w, err.c_str());
  printf("  %s -> %s\n", kernel, err.c_str());
}

int main(int argc, char** argv) {
  if (argc > 1) {  // a kernel the sanitizer must stop (or, --ordered / --two_copies, must not)
    Empty e{0};
    CopyArgs copies{192, nullptr};
    const std::string arg = argv[1] + 2;
    if (arg == "block_race" || arg == "block_ordered") {
      // Three blocks; the second store is block 1's thread 0 or, ordered, block 0's thread 1.
      int word = 0;
      RaceArgs r = arg == "block_race" ? RaceArgs{&word, 1, 0} : RaceArgs{&word, 0, 1};
      const std::string err = launch("test_block_race", 64, 0, &r, 3);
      printf("test_%s: %s\n", arg.c_str(), err.empty() ? "ran" : err.c_str());
      return 0;
    }
    const std::string k = "test_" + arg;
    const unsigned smem = k == "test_oob" ? 64 : k == "test_two_copies" ? 256 : 128;
    const std::string err = launch(k.c_str(), 64, smem, k == "test_two_copies" ? static_cast<void*>(&copies) : &e);
    printf("%s: %s\n", k.c_str(), err.empty() ? "ran" : err.c_str());
    return 0;
  }
  test_cvt();
  test_mma_kernel(false);
  test_mma_kernel(true);
  test_vote_kernel();
  test_mask_intervals();
  expect_error("test_divergent", 32, 0, {"reached", "vote.sync.ballot", "shfl.sync.bfly"});
  expect_error("test_mask", 32, 0, {"excludes the executing lane 5"});
  expect_error("test_barrier_deadlock", 64, 0, {"deadlock", "barrier 0", "63 of 64"});
  expect_error("test_mbar_deadlock", 32, 128, {"deadlock", "mbarrier at shared offset 0x0", "parity 0"});
  expect_error("test_trap", 32, 0, {"__trap", "thread 3"});
  expect_error("test_regs_overdraw", 384, 0,
               {"test_regs_overdraw", "deadlock in block (0,0,0)", "setmaxnreg.inc 232 in warpgroup 2 can never complete",
                "asks (232 - 168) x 128 = 8192", "pool, which holds 7168", "168 registers x 384 threads = 64512",
                "warpgroups hold 48/232/168"});
  {
    Empty e{0};
    const std::string err = launch("test_regs_fit", 384, 0, &e);
    CHECK(err.empty(), "test_regs_fit: %s", err.c_str());
  }
  {
    unsigned src[4] = {0x11111111u, 2, 3, 4}, seen[2] = {0, 0};
    CpArgs p{src, seen};
    const std::string err = launch("test_cp_async", 1, 128, &p);
    CHECK(err.empty(), "test_cp_async: %s", err.c_str());
    CHECK(seen[0] == 0xffffffffu, "cp.async: data visible before wait_group (0x%08x)", seen[0]);
    CHECK(seen[1] == 0x11111111u, "cp.async: data missing after wait_group (0x%08x)", seen[1]);
  }
  {
    unsigned seen[2] = {0, 0};
    CopyArgs p{192, seen};
    std::string err = launch("test_two_copies", 64, 256, &p);
    CHECK(err.empty(), "test_two_copies: %s", err.c_str());
    CHECK(seen[0] == 0x11111111u && seen[1] == 0x22222222u, "copy engine: spans hold 0x%08x 0x%08x", seen[0], seen[1]);
    p.second_dst = 160;
    p.seen = nullptr;
    err = launch("test_two_copies", 64, 256, &p);
    CHECK(err.find("overlaps the copy thread 0 issued into [0x80, 0xc0)") != std::string::npos, "overlapping copies: %s", err.c_str());
    printf("  test_two_copies (overlapping) -> %s\n", err.c_str());
  }
  {
    Empty e{0};
    const std::string err = launch("test_ordered", 64, 128, &e);
    CHECK(err.empty(), "test_ordered: %s", err.c_str());
  }
  printf("%s: %d failure(s)\n", failures ? "FAIL" : "ok", failures);
  return failures ? 1 : 0;
}
