// The sm_90a instructions the Hopper kernels use, one thin wrapper each: mbarriers, the bulk tensor
// copy engine (TMA), wgmma's fences and shared-memory matrix descriptors, setmaxnreg and named
// barriers. Header-free like common.cuh (NVRTC compiles the same text). The GPU-on-CPU executor
// runs this text with CPU models of the instructions (crates/exla-rs-gpusim/executor/sm90_isa.hpp).
#pragma once

namespace exla_rs {
namespace sm90 {

#define EXLA_RS_SM90 __device__ __forceinline__

typedef unsigned long long u64;

// Registers per thread ptxas gives a kernel declared __launch_bounds__(threads, 1): the 64K
// register file over the threads, in the allocation unit of 8, at most 255 (checked against
// cuobjdump's REG for 128..1024 threads; 384 -> 168). setmaxnreg moves registers within that
// block-wide pool: sass_stats.py --check-regpool and the executor (crates/exla-rs-gpusim) use the same rule.
__host__ __device__ constexpr int launch_reg_cap(int threads) { return 65536 / threads / 8 * 8 < 255 ? 65536 / threads / 8 * 8 : 255; }

// The driver's CUtensorMap: 128 opaque bytes, 64-byte aligned by the driver's declaration; we ask
// for 128 as the issue's ABI note does (the kernel parameter is copied as is, so a stricter
// alignment costs nothing). Encoded on the host by cuTensorMapEncodeTiled (src/sm90.rs) and passed
// by value as a `const __grid_constant__` parameter, so TMA reads it from parameter memory.
struct __align__(128) TensorMap {
  u64 opaque[16];
};

}  // namespace sm90
}  // namespace exla_rs

// The instruction wrappers: inline PTX on the GPU (ptx_sm90.cuh, wgmma_ops.cuh), their CPU models
// in the GPU-on-CPU executor (crates/exla-rs-gpusim/executor/sm90_isa.hpp). The include goes through a macro so the
// NVRTC flattener never inlines the host-only header.
#if defined(EXLA_RS_CPU)
#define EXLA_RS_CPU_SM90_HEADER "executor/sm90_isa.hpp"
#include EXLA_RS_CPU_SM90_HEADER
#else
#include "ptx_sm90.cuh"
#include "wgmma_ops.cuh"
#endif

namespace exla_rs {
namespace sm90 {

// ---------------------------------------------------------------------------------------------
// Shared-memory matrix descriptors (PTX ISA, "Matrix Descriptor Format" for wgmma):
//   bits  0-13  start address >> 4        bits 16-29  leading-dimension byte offset >> 4
//   bits 32-45  stride-dimension byte offset >> 4
//   bits 49-51  base offset (0: every swizzle atom starts 1024-byte aligned)
//   bits 62-63  swizzle: 1 = 128-byte.
// Every tile here is stored as column blocks of 64 16-bit elements (128-byte rows), in atoms of
// 8 rows x 128 bytes whose 16-byte chunks are XOR-swizzled by the row (TMA's SWIZZLE_128B writes
// exactly that). Between 8-row groups: 1024 bytes (the SBO).
constexpr unsigned kSwizzleRowBytes = 128;
constexpr unsigned kAtomBytes = 1024;  // 8 rows x 128 bytes

EXLA_RS_SM90 u64 smem_desc(unsigned addr, unsigned lbo_bytes, unsigned sbo_bytes) {
  u64 d = 0;
  d |= static_cast<u64>((addr & 0x3FFFF) >> 4);
  d |= static_cast<u64>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<u64>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  d |= static_cast<u64>(1) << 62;  // 128-byte swizzle
  return d;
}

}  // namespace sm90
}  // namespace exla_rs
