// The C ABI of the GPU-on-CPU executor ("gpusim"): the kernels of native/exla_rs/kernels compiled
// as host C++ (EXLA_RS_CPU) and run with the GPU's semantics, one CUDA thread per fiber. The Rust
// launcher (crates/exla-rs-cuda) calls these where it would call the driver: same kernel names,
// grids, blocks, dynamic shared memory sizes and parameter blocks; tensor maps are encoded from the
// same arguments cuTensorMapEncodeTiled takes.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Runs one launch to completion on the calling OS thread, block after block. `args` is
// cuLaunchKernel's kernelParams: one pointer per kernel parameter. Returns 0, or non-zero with a
// NUL-terminated report in `err` (at most err_len bytes): the check that failed (deadlock, a
// collective's lanes disagreeing, an out-of-bounds shared-memory access, __trap, ...), the block
// and the threads involved.
int exla_rs_gpusim_launch(const char* kernel, const uint32_t grid[3], const uint32_t block[3], uint32_t dynamic_smem_bytes,
                          void** args, char* err, size_t err_len);

// 1 when this build has the named kernel, else 0.
int exla_rs_gpusim_has_kernel(const char* kernel);

// cuTensorMapEncodeTiled's arguments, same order and meaning (enums as their integer values:
// CUtensorMapDataType, CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
// CUtensorMapFloatOOBfill). Writes the 128-byte map the executor's TMA reads. Returns 0
// (CUDA_SUCCESS) or 1 (CUDA_ERROR_INVALID_VALUE) where the driver would refuse the arguments.
int exla_rs_gpusim_tensor_map_encode_tiled(void* tensor_map, int data_type, uint32_t rank, void* global_address,
                                           const uint64_t* global_dim, const uint64_t* global_strides,
                                           const uint32_t* box_dim, const uint32_t* element_strides, int interleave,
                                           int swizzle, int l2_promotion, int oob_fill);

// Shared-memory bank statistics gathered since the last reset, as JSON (see README.md): per kernel,
// per instruction kind, warp accesses, wavefronts and bank conflicts. Returns the full length;
// writes at most len bytes (NUL-terminated when it fits).
size_t exla_rs_gpusim_stats_json(char* buf, size_t len);
void exla_rs_gpusim_stats_reset(void);

// Global-memory traffic gathered since the last exla_rs_gpusim_stats_reset, as JSON: per kernel,
// bytes read, written and atomically added inside the registered device allocations (plain loads
// and stores, cp.async and TMA sources, atomics and red). Counted by the statistics build only
// (EXLA_RS_GPUSIM_SANITIZE=stats; every kernel access is instrumented there): "{}" elsewhere.
// Same calling convention as exla_rs_gpusim_stats_json.
size_t exla_rs_gpusim_traffic_json(char* buf, size_t len);

// The launcher's stand-ins for device memory (crates/exla-rs-gpusim DeviceAlloc): only accesses
// inside them count as global traffic (a kernel's stack, its parameters and the executor's own
// state do not).
void exla_rs_gpusim_register_alloc(const void* p, size_t len);
void exla_rs_gpusim_unregister_alloc(const void* p);

#ifdef __cplusplus
}
#endif
