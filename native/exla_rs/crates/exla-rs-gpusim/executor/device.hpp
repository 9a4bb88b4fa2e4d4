// What the kernels see when they are compiled as host C++ for the GPU-on-CPU executor
// (EXLA_RS_CPU): CUDA's keywords and built-in variables, the warp intrinsics, and a CPU model of
// every PTX wrapper of kernels/ptx.cuh, each written from the PTX ISA's definition of the
// instruction (section names in the comments), not from how our kernels use it.
//
// This header is compiled into every kernel translation unit, which the sanitizer builds
// instrument: the loads and stores a model makes on behalf of the executing lane (the bytes a lane
// hands to ldmatrix, the source of its cp.async) are that lane's accesses. Rendezvous, scheduling
// and the asynchronous units live in runtime.cpp.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "runtime.hpp"

// ---------------------------------------------------------------------------------------------
// CUDA's keywords.

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))

#define EXLA_RS_DEVICE inline

#define threadIdx (::exla_rs_gpusim::thread_idx())
#define blockIdx (::exla_rs_gpusim::block_idx())
#define blockDim (::exla_rs_gpusim::block_dim())
#define gridDim (::exla_rs_gpusim::grid_dim())

// The block's dynamic shared memory: exactly the launch's bytes, poisoned at each block's start.
#define EXLA_RS_DYNAMIC_SMEM(name, align) unsigned char* const name = ::exla_rs_gpusim::dynamic_smem()
#define EXLA_RS_DYNAMIC_SMEM_UNALIGNED(name) unsigned char* const name = ::exla_rs_gpusim::dynamic_smem()

#define EXLA_RS_STR2(x) #x
#define EXLA_RS_STR(x) EXLA_RS_STR2(x)
// A call site, so that the lanes of a collective can be checked to have reached the same one.
#define EXLA_RS_SITE (__FILE__ ":" EXLA_RS_STR(__LINE__))

namespace exla_rs_gpusim {

// The kernel's entry as the executor calls it: cuLaunchKernel-style `args` (one pointer per
// parameter) unpacked into the kernel's by-value parameters.
template <class... P, size_t... I>
inline void invoke_with(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<P>>*>(args[I])...);
}
template <class... P>
inline void invoke(void (*kernel)(P...), void** args) {
  invoke_with(kernel, args, std::index_sequence_for<P...>{});
}

// ---------------------------------------------------------------------------------------------
// Warp intrinsics (CUDA C++ Programming Guide, "Warp Shuffle Functions", "Warp Vote Functions",
// "__syncwarp"; PTX ISA "shfl.sync", "vote.sync", "bar.warp.sync"). Every lane named in the mask
// must execute the same intrinsic with the same mask; the executor fails the launch otherwise.

// in[0..1]: the value, in[2]: the lane argument, in[3]: width. A source lane outside the width's
// segment (xor) keeps the lane's own value; a source lane outside the mask is undefined on the
// GPU: here it fails the launch.
inline void shfl_fn(LaneIo* l, uint64_t mask, uint64_t, void* xor_mode) {
  for (unsigned i = 0; i < 32; ++i) {
    if (!((mask >> i) & 1)) continue;
    const int arg = (int)l[i].in[2], width = (int)l[i].in[3];
    const unsigned seg = i & ~(unsigned)(width - 1);
    unsigned src;
    if (xor_mode) {
      src = i ^ (unsigned)arg;
      if ((src & ~(unsigned)(width - 1)) != seg) src = i;
    } else {
      src = seg + ((unsigned)arg & (unsigned)(width - 1));
    }
    if (!((mask >> src) & 1)) fail("shfl.sync: lane %u reads lane %u, which is not in the member mask 0x%08llx", i, src, (unsigned long long)mask);
    l[i].out[0] = l[src].in[0];
    l[i].out[1] = l[src].in[1];
  }
}

template <class T>
inline T shfl(Op op, const char* site, unsigned mask, T v, int arg, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shfl of a value over 8 bytes");
  if (width <= 0 || width > 32 || (width & (width - 1))) fail("shfl.sync at %s: width %d is not a power of two in 1..32", site, width);
  LaneIo io;
  memset(io.in, 0, 8);
  memcpy(io.in, &v, sizeof v);
  io.in[2] = (uint32_t)arg;
  io.in[3] = (uint32_t)width;
  warp_collective(op, mask, site, io, shfl_fn, op == Op::ShflXor ? reinterpret_cast<void*>(1) : nullptr, false);
  T r;
  memcpy(&r, io.out, sizeof r);
  return r;
}

// Vote: in[0] = predicate. out[0] = ballot bits of the mask's lanes (any / all derive from it).
inline void ballot_fn(LaneIo* l, uint64_t mask, uint64_t, void*) {
  uint32_t bits = 0;
  for (unsigned i = 0; i < 32; ++i)
    if (((mask >> i) & 1) && l[i].in[0]) bits |= 1u << i;
  for (unsigned i = 0; i < 32; ++i) l[i].out[0] = bits;
}
inline unsigned vote(Op op, const char* site, unsigned mask, int pred) {
  LaneIo io;
  io.in[0] = pred != 0;
  warp_collective(op, mask, site, io, ballot_fn, nullptr, false);
  return io.out[0];
}

inline void nothing_fn(LaneIo*, uint64_t, uint64_t, void*) {}
// __syncwarp(mask = all): a call site bound first, so the macro needs no comma juggling.
struct SyncWarpAt {
  const char* site;
  void operator()(unsigned mask = 0xffffffffu) const {
    LaneIo io;
    warp_collective(Op::SyncWarp, mask, site, io, nothing_fn, nullptr, true);
  }
};

template <class T>
inline T shfl_at(Op op, const char* site, unsigned mask, T v, int arg, int width = 32) {
  return shfl(op, site, mask, v, arg, width);
}

inline unsigned block_threads() {
  const Dim3 b = block_dim();
  return b.x * b.y * b.z;
}

}  // namespace exla_rs_gpusim

#define __shfl_sync(...) ::exla_rs_gpusim::shfl_at(::exla_rs_gpusim::Op::Shfl, EXLA_RS_SITE, __VA_ARGS__)
#define __shfl_xor_sync(...) ::exla_rs_gpusim::shfl_at(::exla_rs_gpusim::Op::ShflXor, EXLA_RS_SITE, __VA_ARGS__)
#define __ballot_sync(mask, pred) ::exla_rs_gpusim::vote(::exla_rs_gpusim::Op::Ballot, EXLA_RS_SITE, mask, pred)
#define __any_sync(mask, pred) (::exla_rs_gpusim::vote(::exla_rs_gpusim::Op::Any, EXLA_RS_SITE, mask, pred) != 0)
#define __all_sync(mask, pred) \
  (::exla_rs_gpusim::vote(::exla_rs_gpusim::Op::All, EXLA_RS_SITE, mask, pred) == (unsigned)(mask))
#define __syncwarp(...) ::exla_rs_gpusim::SyncWarpAt{EXLA_RS_SITE}(__VA_ARGS__)

// __syncthreads = bar.sync 0 with every thread of the block (PTX ISA "bar.sync").
inline void __syncthreads() { ::exla_rs_gpusim::cta_barrier(0, ::exla_rs_gpusim::block_threads(), true, 0); }
inline int __syncthreads_or(int pred) {
  return ::exla_rs_gpusim::cta_barrier(0, ::exla_rs_gpusim::block_threads(), true, pred != 0) != 0;
}
inline int __syncthreads_count(int pred) { return ::exla_rs_gpusim::cta_barrier(0, ::exla_rs_gpusim::block_threads(), true, pred != 0); }

[[noreturn]] inline void __trap() { ::exla_rs_gpusim::fail("the kernel executed __trap()"); }

// Bit casts and integer intrinsics (CUDA Math API, "Integer Intrinsics", "Type Casting").
inline float __int_as_float(int x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}
inline float __uint_as_float(unsigned x) {
  float f;
  memcpy(&f, &x, 4);
  return f;
}
inline int __float_as_int(float f) {
  int x;
  memcpy(&x, &f, 4);
  return x;
}
inline unsigned __float_as_uint(float f) {
  unsigned x;
  memcpy(&x, &f, 4);
  return x;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
// The shared window address of a generic pointer into shared memory (cvta.to.shared).
inline size_t __cvta_generic_to_shared(const void* p) { return ::exla_rs_gpusim::smem_offset(p, 0, "__cvta_generic_to_shared"); }
// __log2f: lg2.approx.f32 (no .ftz unless compiled with -ftz=true; nvcc's default here is false).
inline float __log2f(float x) { return log2f(x); }

// Atomics on global or shared memory (CUDA "Atomic Functions"): real atomic read-modify-writes,
// which ThreadSanitizer sees as such (fibers run one at a time, but the sanitizer judges order).
// The statistics build counts the global ones as atomic traffic (global_access ignores shared memory).
inline void gpusim_count_atomic(const void* p, size_t n) { ::exla_rs_gpusim::global_access(p, n, ::exla_rs_gpusim::Global::Atomic); }
inline int atomicAdd(int* p, int v) { gpusim_count_atomic(p, 4); return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { gpusim_count_atomic(p, 4); return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicOr(unsigned* p, unsigned v) { gpusim_count_atomic(p, 4); return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline int atomicOr(int* p, int v) { gpusim_count_atomic(p, 4); return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
inline float atomicAdd(float* p, float v) {
  gpusim_count_atomic(p, 4);
  unsigned* u = reinterpret_cast<unsigned*>(p);
  unsigned old = __atomic_load_n(u, __ATOMIC_RELAXED);
  for (;;) {
    const unsigned want = __float_as_uint(__uint_as_float(old) + v);
    if (__atomic_compare_exchange_n(u, &old, want, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return __uint_as_float(old);
  }
}

#define EXLA_RS_KERNEL_ENTRY(name) \
  extern "C" void name##_gpusim_entry(void** args) { ::exla_rs_gpusim::invoke(name, args); }

// ---------------------------------------------------------------------------------------------
// The PTX wrappers of kernels/ptx.cuh.

namespace exla_rs {
namespace ptx {

inline uint32_t f32_bits(float f) { return __float_as_uint(f); }

// cvt.f32.f16 (PTX ISA "cvt"): exact; subnormal halves become normal f32 values; NaN stays NaN
// (the canonical 0x7fffffff).
inline float cvt_f32_f16(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  if (exp == 0x1f) return man ? __uint_as_float(0x7fffffffu) : __uint_as_float(sign | 0x7f800000u);
  if (exp == 0) {
    // man * 2^-24, exactly representable.
    const float v = ldexpf((float)man, -24);
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 112) << 23) | (man << 13));
}

// Round-to-nearest-even of a 32-bit magnitude shifted right by `shift` (>= 1).
inline unsigned rne_shift(unsigned m, unsigned shift) {
  if (shift >= 32) return 0;
  const unsigned q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return q + ((rem > half || (rem == half && (q & 1))) ? 1u : 0u);
}

// cvt.rn.f16.f32: round to nearest even, overflow to +-inf, subnormal results kept (no .ftz),
// NaN to the canonical NaN 0x7fff.
inline unsigned short cvt_rn_f16_f32(float f) {
  const unsigned x = f32_bits(f), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;
  if (a == 0x7f800000u) return (unsigned short)(sign | 0x7c00u);
  const int exp = (int)(a >> 23);
  if (exp >= 113) {  // a normal half at least (2^-14 and up), maybe rounding up to inf
    const unsigned h = rne_shift(((unsigned)(exp - 112) << 23) | (a & 0x7fffffu), 13);
    return (unsigned short)(sign | (h >= 0x7c00u ? 0x7c00u : h));
  }
  if (exp == 0) return (unsigned short)sign;  // an f32 subnormal is far below half a half ulp
  // Subnormal half: units of 2^-24; value = (man | 2^23) * 2^(exp - 150).
  return (unsigned short)(sign | rne_shift((a & 0x7fffffu) | 0x800000u, (unsigned)(126 - exp)));
}

// cvt.rn.bf16.f32: round to nearest even on the upper 16 bits, NaN to the canonical 0x7fff.
inline unsigned short cvt_rn_bf16_f32(float f) {
  const unsigned x = f32_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// cvt.rn.{f16,bf16}x2.f32 d, a, b: "the value converted from input a is stored in the upper half
// of d and the value converted from input b is stored in the lower half".
inline unsigned cvt_rn_f16x2_f32(float a, float b) { return ((unsigned)cvt_rn_f16_f32(a) << 16) | cvt_rn_f16_f32(b); }
inline unsigned cvt_rn_bf16x2_f32(float a, float b) { return ((unsigned)cvt_rn_bf16_f32(a) << 16) | cvt_rn_bf16_f32(b); }

inline float bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (PTX ISA "Matrix Fragments for
// mma.m16n8k16 with floating point type"): groupID = lane >> 2, tig = lane % 4;
//   A (16 x 16, row): a0 = (g, 2 tig + {0,1}), a1 = (g + 8, 2 tig + {0,1}), a2 = (g, 2 tig + 8 + {0,1}),
//                     a3 = (g + 8, 2 tig + 8 + {0,1}); lower half = lower column.
//   B (16 x 8, col):  b0 = (k = 2 tig + {0,1}, n = g), b1 = (k = 2 tig + 8 + {0,1}, n = g).
//   C, D (16 x 8):    c0, c1 = (g, 2 tig + {0,1}), c2, c3 = (g + 8, 2 tig + {0,1}).
// The products of 16-bit inputs are exact in f32; the ISA leaves the summation order and its
// intermediate precision open: here the 16 products and c are summed in double and rounded once.
// in[0..3] = a, in[4..5] = b, in[6..9] = c (f32 bits); out[0..3] = d.
template <bool kBf16>
inline void mma_fn(exla_rs_gpusim::LaneIo* l, uint64_t, uint64_t, void*) {
  auto half = [](unsigned w, int hi) -> float {
    const unsigned short h = (unsigned short)(hi ? w >> 16 : w & 0xffff);
    return kBf16 ? bf16_to_f32(h) : cvt_f32_f16(h);
  };
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    const uint32_t* r = l[lane].in;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = half(r[0], e);
      A[g + 8][2 * t + e] = half(r[1], e);
      A[g][2 * t + 8 + e] = half(r[2], e);
      A[g + 8][2 * t + 8 + e] = half(r[3], e);
      B[2 * t + e][g] = half(r[4], e);
      B[2 * t + 8 + e][g] = half(r[5], e);
      C[g][2 * t + e] = __uint_as_float(r[6 + e]);
      C[g + 8][2 * t + e] = __uint_as_float(r[8 + e]);
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int q = 0; q < 4; ++q) {
      const int row = g + 8 * (q >> 1), col = 2 * t + (q & 1);
      double acc = C[row][col];
      for (int k = 0; k < 16; ++k) acc += (double)A[row][k] * (double)B[k][col];
      l[lane].out[q] = f32_bits((float)acc);
    }
  }
}

template <bool kBf16>
inline void mma_m16n8k16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  exla_rs_gpusim::LaneIo io;
  for (int i = 0; i < 4; ++i) io.in[i] = a[i];
  io.in[4] = b0;
  io.in[5] = b1;
  for (int i = 0; i < 4; ++i) io.in[6 + i] = f32_bits(c[i]);
  exla_rs_gpusim::warp_collective(exla_rs_gpusim::Op::Mma, 0xffffffffu, kBf16 ? "mma.sync bf16" : "mma.sync f16", io, mma_fn<kBf16>,
                                  nullptr, false);
  for (int i = 0; i < 4; ++i) c[i] = __uint_as_float(io.out[i]);
}
inline void mma_m16n8k16_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { mma_m16n8k16<false>(c, a, b0, b1); }
inline void mma_m16n8k16_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { mma_m16n8k16<true>(c, a, b0, b1); }

// ex2.approx.ftz.f32 / lg2.approx.ftz.f32 / tanh.approx.f32 (PTX ISA "Floating Point
// Instructions"): the ISA bounds their error (2^-22 relative for ex2 and lg2 over the normal range,
// 2^-10.987 for tanh); the correctly rounded result is one of the results the ISA allows. .ftz:
// subnormal inputs and results are flushed to sign-preserving zero. ex2(-inf) = +0, lg2(+0) = -inf,
// lg2(x < 0) = NaN.
inline float flush(float x) { return fabsf(x) < 1.17549435e-38f ? copysignf(0.f, x) : x; }
inline float ex2_approx_ftz(float x) { return flush(exp2f(flush(x))); }
inline float lg2_approx_ftz(float x) { return log2f(flush(x)); }
inline float tanh_approx(float x) { return tanhf(x); }

inline unsigned smem_u32(const void* p) { return exla_rs_gpusim::smem_offset(p, 0, "cvta.to.shared"); }

// cp.async.cg.shared.global [dst], [src], 16, src_bytes (PTX ISA "cp.async"): copies src_bytes
// (0..16) bytes and zero-fills the rest of the 16; .cg requires 16-byte alignment of both
// addresses. The bytes are read now, by this lane; they land in shared memory only when a
// cp.async.wait_group of this thread retires their group (until then the destination keeps what
// it had: a kernel that reads early reads stale data).
inline void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const uint32_t off = exla_rs_gpusim::smem_offset(smem, 16, "cp.async destination");
  if (off % 16) exla_rs_gpusim::fail("cp.async.cg: shared destination offset 0x%x is not 16-byte aligned", off);
  if (src_bytes < 0 || src_bytes > 16) exla_rs_gpusim::fail("cp.async: src-size %d is outside 0..16", src_bytes);
  if (src_bytes > 0 && reinterpret_cast<uintptr_t>(gmem) % 16)
    exla_rs_gpusim::fail("cp.async.cg: global source %p is not 16-byte aligned", gmem);
  unsigned char data[16] = {};
  if (src_bytes > 0) memcpy(data, gmem, (size_t)src_bytes);
  exla_rs_gpusim::global_access(gmem, (size_t)src_bytes, exla_rs_gpusim::Global::Read);
  exla_rs_gpusim::cp_async_issue(off, data);
}
inline void cp_async_commit() { exla_rs_gpusim::cp_async_commit_group(); }
template <int N>
inline void cp_async_wait() {
  exla_rs_gpusim::cp_async_wait_group(N);
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16 (PTX ISA "ldmatrix"): lanes 8i..8i+7
// give the addresses of rows 0..7 of matrix i (16 bytes each, 16-byte aligned); the other lanes'
// addresses are not used. Without .trans, lane L receives in r[i] the elements (row L / 4,
// columns 2 (L % 4) and 2 (L % 4) + 1) of matrix i, the lower column in the lower half; with
// .trans, those of the transposed matrix. Each lane reads its own row (that lane's shared-memory
// access); a row still holding the executor's poison (0xffff halves: nothing wrote it) fails the
// launch as an uninitialised read.
struct LdmatrixShape {
  int matrices;
  bool trans;
};
inline void ldmatrix_fn(exla_rs_gpusim::LaneIo* l, uint64_t, uint64_t, void* ctx) {
  const LdmatrixShape& sh = *static_cast<const LdmatrixShape*>(ctx);
  uint32_t offs[32];
  for (int i = 0; i < 8 * sh.matrices; ++i) offs[i] = (uint32_t)l[i].aux;
  exla_rs_gpusim::bank_access("ldmatrix", offs, 8 * sh.matrices, 16);
  for (int lane = 0; lane < 32; ++lane) {
    const int r = lane >> 2, c = 2 * (lane & 3);
    for (int m = 0; m < sh.matrices; ++m) {
      unsigned short e[2];
      for (int k = 0; k < 2; ++k) {
        // Element (row, col) of matrix m is half `col` of the row given by lane 8m + row.
        const int row = sh.trans ? c + k : r, col = sh.trans ? r : c + k;
        const uint32_t* src = l[8 * m + row].in;
        e[k] = (unsigned short)((src[col / 2] >> (16 * (col % 2))) & 0xffff);
      }
      l[lane].out[m] = (unsigned)e[0] | ((unsigned)e[1] << 16);
    }
  }
}
template <int N>
inline void ldmatrix_impl(unsigned (&r)[N], const void* smem, bool trans) {
  static_assert(N == 1 || N == 2 || N == 4, "ldmatrix .x1, .x2 or .x4");
  static const LdmatrixShape shapes[2] = {{N, false}, {N, true}};
  exla_rs_gpusim::LaneIo io;
  memset(io.in, 0, sizeof io.in);
  io.aux = 0;
  if ((int)exla_rs_gpusim::linear_tid() % 32 < 8 * N) {
    const uint32_t off = exla_rs_gpusim::smem_offset(smem, 16, trans ? "ldmatrix.trans row" : "ldmatrix row");
    if (off % 16) exla_rs_gpusim::fail("ldmatrix: row address at shared offset 0x%x is not 16-byte aligned", off);
    memcpy(io.in, smem, 16);
    for (int i = 0; i < 8; ++i) {
      const unsigned short h = (unsigned short)((io.in[i / 2] >> (16 * (i % 2))) & 0xffff);
      if (h == 0xffff)
        exla_rs_gpusim::fail("initcheck: ldmatrix reads shared offset 0x%x, which nothing wrote (the executor's poison)", off + 2 * i);
    }
    io.aux = off;
  }
  exla_rs_gpusim::warp_collective(exla_rs_gpusim::Op::Ldmatrix, 0xffffffffu, trans ? "ldmatrix.trans" : "ldmatrix", io, ldmatrix_fn,
                                  const_cast<LdmatrixShape*>(&shapes[trans]), false);
  for (int i = 0; i < N; ++i) r[i] = io.out[i];
}
// The 32-bit shared-window forms (ptx.cuh ldsm_x4, ldsm_x4_trans, cp_async16_s): the address is an
// offset into the block's dynamic shared memory (what smem_u32 returns).
inline void ldsm_x4(unsigned (&r)[4], unsigned addr) { ldmatrix_impl<4>(r, exla_rs_gpusim::smem_ptr(addr, 16, "ldmatrix row"), false); }
inline void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
  ldmatrix_impl<4>(r, exla_rs_gpusim::smem_ptr(addr, 16, "ldmatrix.trans row"), true);
}
inline void cp_async16_s(unsigned addr, const void* gmem, int src_bytes) {
  cp_async16(exla_rs_gpusim::smem_ptr(addr, 16, "cp.async destination"), gmem, src_bytes);
}
inline void ldmatrix_x1(unsigned (&r)[1], const void* smem) { ldmatrix_impl<1>(r, smem, false); }
inline void ldmatrix_x2(unsigned (&r)[2], const void* smem) { ldmatrix_impl<2>(r, smem, false); }
inline void ldmatrix_x4(unsigned (&r)[4], const void* smem) { ldmatrix_impl<4>(r, smem, false); }
inline void ldmatrix_x1_trans(unsigned (&r)[1], const void* smem) { ldmatrix_impl<1>(r, smem, true); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) { ldmatrix_impl<2>(r, smem, true); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) { ldmatrix_impl<4>(r, smem, true); }

// red.global.add.f32 (PTX ISA "red"): an atomic add.
inline void red_add_f32(float* addr, float v) { atomicAdd(addr, v); }

}  // namespace ptx
}  // namespace exla_rs
