// Every PTX instruction the sm_80 kernels issue by hand, one thin inline-asm wrapper each. The
// GPU-on-CPU executor models the same functions from the PTX ISA's definitions
// (crates/exla-rs-gpusim/executor/device.hpp): a kernel calls these and nothing else written in
// asm, so the same kernel text runs on both. Header-free (NVRTC compiles this text too).
#pragma once

#define EXLA_RS_DEVICE __device__ __forceinline__

// Where the kernels declare their dynamic shared memory, and the per-kernel entry the executor
// needs (nothing on the GPU: the driver calls the __global__ function itself).
#define EXLA_RS_DYNAMIC_SMEM(name, align) extern __shared__ __align__(align) unsigned char name[]
#define EXLA_RS_DYNAMIC_SMEM_UNALIGNED(name) extern __shared__ unsigned char name[]
#define EXLA_RS_KERNEL_ENTRY(name)

namespace exla_rs {
namespace ptx {

// cvt: 16-bit float patterns <-> f32, round to nearest even.
EXLA_RS_DEVICE float cvt_f32_f16(unsigned short x) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
  return r;
}
EXLA_RS_DEVICE unsigned short cvt_rn_f16_f32(float x) {
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
EXLA_RS_DEVICE unsigned short cvt_rn_bf16_f32(float x) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
// cvt.rn.{f16,bf16}x2.f32 d, a, b: a lands in the upper half of d, b in the lower.
EXLA_RS_DEVICE unsigned cvt_rn_f16x2_f32(float a, float b) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a), "f"(b));
  return r;
}
EXLA_RS_DEVICE unsigned cvt_rn_bf16x2_f32(float a, float b) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(a), "f"(b));
  return r;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: c += A B for the warp's fragments.
EXLA_RS_DEVICE void mma_m16n8k16_f16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
EXLA_RS_DEVICE void mma_m16n8k16_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Approximate transcendentals. ex2.approx has a relative error near 2^-22 and maps -inf to +0;
// .ftz flushes subnormal inputs and results to zero. tanh.approx: max relative error 2^-10.987.
EXLA_RS_DEVICE float ex2_approx_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
EXLA_RS_DEVICE float lg2_approx_ftz(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
EXLA_RS_DEVICE float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

EXLA_RS_DEVICE unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// 16 bytes global -> shared, asynchronously; src_bytes = 0 writes zeros (rows past the end).
EXLA_RS_DEVICE void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}
EXLA_RS_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
EXLA_RS_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8i..8i+7 address matrix i's rows.
EXLA_RS_DEVICE void ldmatrix_x1(unsigned (&r)[1], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(smem_u32(smem)));
}
EXLA_RS_DEVICE void ldmatrix_x2(unsigned (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(smem)));
}
EXLA_RS_DEVICE void ldmatrix_x4(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}
EXLA_RS_DEVICE void ldmatrix_x1_trans(unsigned (&r)[1], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(smem_u32(smem)));
}
EXLA_RS_DEVICE void ldmatrix_x2_trans(unsigned (&r)[2], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(smem)));
}
EXLA_RS_DEVICE void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(smem)));
}

// The same with a 32-bit shared-window address (smem_u32 of the tile once, then integer offsets):
// the forward's key loop keeps its addresses in 32-bit registers, no 64-bit generic pointer and no
// cvta per instruction.
EXLA_RS_DEVICE void ldsm_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
EXLA_RS_DEVICE void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
EXLA_RS_DEVICE void cp_async16_s(unsigned smem_addr, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

// red.global.add.f32: an atomic add whose old value nobody reads.
EXLA_RS_DEVICE void red_add_f32(float* addr, float v) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(addr), "f"(v) : "memory");
}

}  // namespace ptx
}  // namespace exla_rs
