// The sm_90a instructions the Hopper kernels issue by hand (mbarriers, TMA, named barriers,
// setmaxnreg, wgmma ordering), one inline-asm wrapper each. The GPU-on-CPU executor models the
// same functions (crates/exla-rs-gpusim/executor/sm90_isa.hpp). Included by hopper.cuh only.
#pragma once

namespace exla_rs {
namespace sm90 {

EXLA_RS_SM90 unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// ---------------------------------------------------------------------------------------------
// mbarriers: 8-byte shared-memory words with an arrival count and a transaction (byte) count.
// A phase completes when both reach zero; waiters name the parity of the phase they wait for.

EXLA_RS_SM90 void mbar_init(u64* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes the initialisations visible to the async proxy (TMA completes transactions there).
EXLA_RS_SM90 void fence_barrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

EXLA_RS_SM90 void mbar_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One arrival that also announces `bytes` the copy engine will deliver in this phase.
EXLA_RS_SM90 void mbar_arrive_expect_tx(u64* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

EXLA_RS_SM90 void mbar_wait(u64* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---------------------------------------------------------------------------------------------
// TMA: one box of a rank-4 tensor, global -> shared, completing `bytes` on `bar`. Coordinates are
// innermost first, in elements; parts of the box outside the tensor arrive as zeros (and still
// count their bytes).

EXLA_RS_SM90 void tma_load_4d(const TensorMap* map, u64* bar, void* dst, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

EXLA_RS_SM90 void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// Ordinary stores to shared memory that the copy engine or the tensor cores read next.
EXLA_RS_SM90 void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// ---------------------------------------------------------------------------------------------
// Register budgets (setmaxnreg): the producer warpgroup gives registers back to the block's pool,
// the consumers take them from it. Counts are multiples of 8; the kernel must start with a cap
// (__launch_bounds__(n, 1)), and the counts must fit the pool it gives (launch_reg_cap(n) x n,
// FwdTraits asserts it): .inc retries until the pool holds its request, forever if it never will.

template <int kRegs>
EXLA_RS_SM90 void regs_release() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
EXLA_RS_SM90 void regs_claim() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Named barriers (ids 1..15; 0 is __syncthreads). `sync` waits, `arrive` only signals: a pair of
// warpgroups uses one to hand each other the tensor cores (ping-pong).
EXLA_RS_SM90 void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }
EXLA_RS_SM90 void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------
// wgmma ordering. `fence` before the first wgmma that reads registers written by ordinary code;
// `commit` closes a group of issued wgmma; `wait<N>` returns when at most N groups are pending.

EXLA_RS_SM90 void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
EXLA_RS_SM90 void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
EXLA_RS_SM90 void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Pins an accumulator register between an asynchronous wgmma and its wait, so the compiler
// neither reads it early nor moves it (the wgmma writes it behind the compiler's back).
EXLA_RS_SM90 void pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }
EXLA_RS_SM90 void pin(unsigned& x) { asm volatile("" : "+r"(x)::"memory"); }

}  // namespace sm90
}  // namespace exla_rs
