// The executor's core, as the instruction models in device.hpp and sm90_isa.hpp see it: the CUDA
// thread that runs now, the block it belongs to, and the rendezvous every collective, barrier and
// asynchronous unit goes through. Compiled WITHOUT sanitizer instrumentation (runtime.cpp): its own
// bookkeeping is shared by every fiber and ordered by the scheduler, not by GPU rules, so it must
// not be judged by ThreadSanitizer. The memory effects it performs on behalf of a kernel (a copy
// engine's writes, the tensor cores' shared-memory reads) are reported to the sanitizers
// explicitly; the kernels' own loads and stores are instrumented where they are compiled.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace exla_rs_gpusim {

struct Dim3 {
  unsigned x, y, z;
};

// What a rendezvous is, for matching the lanes that meet there and for reports.
enum class Op : int {
  Shfl,
  ShflXor,
  Ballot,
  Any,
  All,
  SyncWarp,
  Mma,
  Ldmatrix,
  WgmmaFence,
  WgmmaIssue,
  WgmmaCommit,
  WgmmaWait,
  SetMaxNreg,
  Elect,
};
const char* op_name(Op op);

// One lane's part of a warp (or warpgroup) collective: what it brings and where its answer goes.
// `in`/`out` are the lane's own values (registers), up to 64 bytes each.
struct LaneIo {
  uint32_t in[16];
  uint32_t out[16];
  uint64_t aux;  // a pointer or a descriptor the collective needs (accumulator address, ...)
};

// Computes a collective once every participating lane has arrived. lanes[i] is the i-th lane of
// the group (32 for a warp, 128 for a warpgroup); `mask` the participants.
using CollectiveFn = void (*)(LaneIo* lanes, uint64_t mask_lo, uint64_t mask_hi, void* ctx);

// ---------------------------------------------------------------------------------------------
// The current thread.

Dim3 thread_idx();
Dim3 block_idx();
Dim3 block_dim();
Dim3 grid_dim();
unsigned linear_tid();
unsigned char* dynamic_smem();
size_t dynamic_smem_bytes();

// Fails the launch with a report naming the current thread and block; never returns.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Warp collective over the lanes of `mask` (the current lane must be in it): every lane of the
// mask must reach the same op from the same site with the same mask; the last one to arrive runs
// `fn` for all, the others wait. Returns the current lane's LaneIo with its `out` filled.
// `orders_memory`: the collective orders memory among its lanes (__syncwarp), which
// ThreadSanitizer is told; the data-exchanging ones (shfl, ballot, mma, ldmatrix) do not.
void warp_collective(Op op, unsigned mask, const char* site, LaneIo& io, CollectiveFn fn, void* ctx, bool orders_memory);

// The same over the current thread's warpgroup (4 consecutive warps, 128 threads, all taking part:
// wgmma and setmaxnreg are .sync.aligned).
void warpgroup_collective(Op op, const char* site, LaneIo& io, CollectiveFn fn, void* ctx);

// setmaxnreg.{dec,inc}.sync.aligned (a warpgroup collective): the warpgroup's registers per thread
// become `regs`. The block starts with every warpgroup holding the launch count (what ptxas gives
// __launch_bounds__(blockDim, 1), the bound every setmaxnreg kernel here declares) and an empty
// pool; .dec returns (held - regs) x 128 to the pool, .inc waits until the pool holds
// (regs - held) x 128 and takes it. A warp that exits returns nothing to the pool (on an H200 the
// sm90 forward's three idle producer warps exit at once, yet its consumers waited forever). A
// request nothing can still meet fails the launch as a deadlock with the pool's numbers.
void setmaxnreg(bool inc, unsigned regs);
// Registers per thread ptxas gives a kernel declared __launch_bounds__(threads, 1) (kernels/sm90/
// hopper.cuh, launch_reg_cap: the same rule).
unsigned launch_reg_cap(unsigned threads);

// CTA barriers (bar.sync / bar.arrive; id 0 with every thread is __syncthreads). `count` threads
// must arrive; `wait` = false only signals. `vote` (for __syncthreads_or/and/count) is added up
// over the arrivals and returned to the waiters.
int cta_barrier(unsigned id, unsigned count, bool wait, int vote);

// ---------------------------------------------------------------------------------------------
// mbarriers, keyed by their shared-memory offset. Completion of a phase needs both the pending
// arrivals and the transaction bytes at zero.

void mbar_init(uint32_t smem_off, unsigned count);
void mbar_arrive(uint32_t smem_off, unsigned expect_tx_bytes);
// Blocks until the phase of parity `parity` has completed (mbarrier.try_wait.parity in a loop).
void mbar_wait(uint32_t smem_off, unsigned parity);

// An asynchronous copy into shared memory performed by a copy engine (TMA): `deliver` writes the
// `bytes` bytes of shared memory from `dst` on (the span the transaction count gets) and returns
// nullptr, or an error text. It runs later, when the executor decides the engine completes (a
// waiter polls the barrier, or nothing else can run), in its own ThreadSanitizer context that
// happens after the issuing thread's issue. A copy whose span overlaps one still in flight fails
// at issue: nothing orders the two engines' writes (racecheck's write-write hazard).
using AsyncCopyFn = const char* (*)(void* ctx, unsigned char* smem, size_t smem_bytes);
void async_copy(uint32_t mbar_off, uint32_t dst, uint32_t bytes, AsyncCopyFn fn, const void* ctx, size_t ctx_bytes);

// wgmma's asynchronous groups, per warpgroup: ops issued since the last commit form a group;
// `run` computes one op (reads shared memory, writes the accumulators).
using AsyncMathFn = const char* (*)(void* ctx, unsigned char* smem, size_t smem_bytes);
void wgmma_enqueue(AsyncMathFn fn, const void* ctx, size_t ctx_bytes);
void wgmma_commit();
// Retires the oldest groups until at most `pending` remain (run by the last lane of the
// warpgroup's wait_group); each lane then calls wgmma_retired_acquire.
void wgmma_wait(unsigned pending);
void wgmma_retired_acquire();

// cp.async: the 16 bytes were read from global memory at issue (by the issuing lane); they land in
// shared memory when the issuing thread's cp.async.wait_group retires their group.
void cp_async_issue(uint32_t dst_off, const void* bytes16);
void cp_async_commit_group();
void cp_async_wait_group(unsigned pending);

// ---------------------------------------------------------------------------------------------
// Instrumentation helpers for the models.

// Tells ThreadSanitizer that the current context reads/writes [p, p + n) (no-ops otherwise).
void tsan_read(const void* p, size_t n);
void tsan_write(const void* p, size_t n);

// Shared-memory bank statistics: one warp-wide access (an instruction) made of `n` lane accesses
// of `bytes` each at shared offsets `offs` (lane order).
void bank_access(const char* kind, const uint32_t* offs, int n, unsigned bytes);

// A kernel's plain load or store (the statistics build routes the compiler's instrumentation
// here, shared_access_stats.cpp): shared-memory ones count towards the bank statistics as
// "ld.shared" / "st.shared", the lanes' k-th access since their last executor call forming one
// warp instruction. Other addresses are ignored.
void shared_access(const void* p, unsigned bytes, bool write);

// Global-memory traffic (exec.h exla_rs_gpusim_traffic_json): `bytes` at `p` read, written or
// atomically added by the current kernel, counted when p lies in a registered device allocation
// and the statistics build switched counting on (count_global_traffic, from its __tsan_init).
enum class Global { Read, Write, Atomic };
void global_access(const void* p, size_t bytes, Global kind);
void count_global_traffic();

// The shared offset of a generic pointer into the block's dynamic shared memory; fails the launch
// when it points elsewhere or [p, p + bytes) leaves the launch's dynamic shared memory.
uint32_t smem_offset(const void* p, size_t bytes, const char* what);
unsigned char* smem_ptr(uint32_t off, size_t bytes, const char* what);

}  // namespace exla_rs_gpusim
