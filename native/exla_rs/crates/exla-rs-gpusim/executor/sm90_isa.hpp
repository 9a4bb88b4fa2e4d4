// CPU models of the sm_90a wrappers (kernels/sm90/ptx_sm90.cuh and wgmma_ops.cuh) for the
// GPU-on-CPU executor, included by hopper.cuh under EXLA_RS_CPU. The rendezvous and the
// asynchronous units are the runtime's (runtime.hpp); the data movement and arithmetic are
// sm90_models.hpp's, written from the PTX ISA and the driver's tensor-map definition.
//
// Timing, as the ISA allows it to be observed and no earlier:
//   - TMA (cp.async.bulk.tensor): the bytes land and count against the mbarrier's transaction
//     count when the copy engine completes, which the executor defers until a thread waits on that
//     mbarrier (or nothing else can run). A kernel that reads a stage before its mbarrier phase
//     completes reads the poison or the previous tile.
//   - wgmma.mma_async: the operation reads its shared-memory operands and writes the accumulators
//     when a wgmma.wait_group retires its group. Accumulators read before that hold the old values.
#pragma once

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "runtime.hpp"
#include "sm90_models.hpp"

namespace exla_rs {
namespace sm90 {

namespace gs = ::exla_rs_gpusim;

EXLA_RS_SM90 unsigned smem_addr(const void* p) { return gs::smem_offset(p, 0, "cvta.to.shared"); }

// mbarrier.init.shared::cta.b64: the 8-byte object is written by this thread (its store).
EXLA_RS_SM90 void mbar_init(u64* bar, unsigned count) {
  const uint32_t off = gs::smem_offset(bar, 8, "mbarrier.init");
  *bar = count;
  gs::mbar_init(off, count);
}
// fence.mbarrier_init: the executor's mbarriers are visible to its copy engine at once.
EXLA_RS_SM90 void fence_barrier_init() {}
// arrive and try_wait are atomic operations on the object: this thread's atomic access, which
// ThreadSanitizer orders against the plain store of mbarrier.init (a use not ordered after the
// initialisation, by a barrier, races with it).
EXLA_RS_SM90 void mbar_touch(u64* bar) { (void)__atomic_fetch_add(bar, 0ull, __ATOMIC_RELAXED); }
EXLA_RS_SM90 void mbar_arrive(u64* bar) {
  mbar_touch(bar);
  gs::mbar_arrive(gs::smem_offset(bar, 8, "mbarrier.arrive"), 0);
}
EXLA_RS_SM90 void mbar_arrive_expect_tx(u64* bar, unsigned bytes) {
  mbar_touch(bar);
  gs::mbar_arrive(gs::smem_offset(bar, 8, "mbarrier.arrive.expect_tx"), bytes);
}
EXLA_RS_SM90 void mbar_wait(u64* bar, unsigned parity) {
  (void)__atomic_load_n(bar, __ATOMIC_RELAXED);
  gs::mbar_wait(gs::smem_offset(bar, 8, "mbarrier.try_wait.parity"), parity);
}

// ---------------------------------------------------------------------------------------------
// TMA.

struct TmaCopy {
  exla_rs_gpusim::sm90::TensorMapInfo map;
  int32_t coords[4];
  uint32_t dst;
};

inline const char* tma_deliver(void* ctx, unsigned char* smem, size_t smem_bytes) {
  const TmaCopy& c = *static_cast<const TmaCopy*>(ctx);
  const char* err = exla_rs_gpusim::sm90::tma_load_box(c.map, 4, c.coords, smem, smem_bytes, c.dst, nullptr);
  if (!err) gs::tsan_write(smem + c.dst, exla_rs_gpusim::sm90::box_bytes(c.map));
  return err;
}

EXLA_RS_SM90 const exla_rs_gpusim::sm90::TensorMapInfo& tensor_map(const TensorMap* map, const char* what) {
  const exla_rs_gpusim::sm90::TensorMapInfo* info = exla_rs_gpusim::sm90::decode(map);
  if (!info) gs::fail("%s: the tensor map at %p was not encoded by cuTensorMapEncodeTiled's arguments (bad magic or checksum)", what, (const void*)map);
  return *info;
}

// cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.
EXLA_RS_SM90 void tma_load_4d(const TensorMap* map, u64* bar, void* dst, int c0, int c1, int c2, int c3) {
  TmaCopy c;
  c.map = tensor_map(map, "cp.async.bulk.tensor");
  c.coords[0] = c0;
  c.coords[1] = c1;
  c.coords[2] = c2;
  c.coords[3] = c3;
  const uint32_t bytes = static_cast<uint32_t>(exla_rs_gpusim::sm90::box_bytes(c.map));
  c.dst = gs::smem_offset(dst, bytes, "cp.async.bulk.tensor destination");
  gs::async_copy(gs::smem_offset(bar, 8, "cp.async.bulk.tensor mbarrier"), c.dst, bytes, tma_deliver, &c, sizeof c);
}

EXLA_RS_SM90 void tma_prefetch_map(const TensorMap* map) { (void)tensor_map(map, "prefetch.tensormap"); }

// fence.proxy.async: the executor's async units read shared memory when they run, ordered after
// the generic-proxy writes by the mbarrier or issue that starts them (which ThreadSanitizer checks).
EXLA_RS_SM90 void fence_proxy_async_smem() {}

// setmaxnreg.{inc,dec}.sync.aligned: a warpgroup-wide instruction moving registers between the
// warpgroup and the block's pool (the runtime models the pool: an .inc the pool can never cover
// is a deadlock, as it hangs on the GPU).
inline void nothing_wg(gs::LaneIo*, uint64_t, uint64_t, void*) {}
template <int kRegs>
EXLA_RS_SM90 void regs_release() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: a multiple of 8 in 24..256");
  gs::setmaxnreg(false, kRegs);
}
template <int kRegs>
EXLA_RS_SM90 void regs_claim() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg: a multiple of 8 in 24..256");
  gs::setmaxnreg(true, kRegs);
}

// bar.sync / bar.arrive with an id and a thread count.
EXLA_RS_SM90 void named_sync(int id, int threads) { gs::cta_barrier((unsigned)id, (unsigned)threads, true, 0); }
EXLA_RS_SM90 void named_arrive(int id, int threads) { gs::cta_barrier((unsigned)id, (unsigned)threads, false, 0); }

// ---------------------------------------------------------------------------------------------
// wgmma.

EXLA_RS_SM90 void wgmma_fence() {
  gs::LaneIo io;
  gs::warpgroup_collective(gs::Op::WgmmaFence, "wgmma.fence", io, nothing_wg, nullptr);
}
inline void commit_wg(gs::LaneIo*, uint64_t, uint64_t, void*) { gs::wgmma_commit(); }
EXLA_RS_SM90 void wgmma_commit() {
  gs::LaneIo io;
  gs::warpgroup_collective(gs::Op::WgmmaCommit, "wgmma.commit_group", io, commit_wg, nullptr);
}
inline void wait_wg(gs::LaneIo* l, uint64_t, uint64_t, void*) { gs::wgmma_wait(l[0].in[0]); }
template <int kPending>
EXLA_RS_SM90 void wgmma_wait() {
  gs::LaneIo io;
  io.in[0] = kPending;
  gs::warpgroup_collective(gs::Op::WgmmaWait, "wgmma.wait_group", io, wait_wg, nullptr);
  gs::wgmma_retired_acquire();
}

// The accumulators are written by the runtime through their addresses: nothing to pin.
EXLA_RS_SM90 void pin(float&) {}
EXLA_RS_SM90 void pin(unsigned&) {}

struct WgmmaAsync {
  exla_rs_gpusim::sm90::WgmmaOp op;
  float* acc[128];
  uint32_t a[128][4];
};

// The tensor cores run one op: its shared-memory operands are read now (ThreadSanitizer is told;
// a 16-bit operand still holding the executor's poison is an uninitialised read), then the model
// computes into the 128 threads' accumulators.
inline const char* wgmma_run(void* ctx, unsigned char* smem, size_t smem_bytes) {
  const WgmmaAsync& w = *static_cast<const WgmmaAsync*>(ctx);
  std::vector<exla_rs_gpusim::sm90::ByteRange> ranges;
  if (const char* err = exla_rs_gpusim::sm90::wgmma_smem_ranges(w.op, smem_bytes, &ranges)) return err;
  for (const auto& r : ranges) {
    gs::tsan_read(smem + r.begin, r.end - r.begin);
    for (uint32_t b = r.begin & ~1u; b + 1 < r.end; b += 2)
      if (smem[b] == 0xff && smem[b + 1] == 0xff) {
        static thread_local char msg[160];
        snprintf(msg, sizeof msg, "initcheck: an operand element at shared offset 0x%x was never written (the executor's poison)", b);
        return msg;
      }
  }
  return exla_rs_gpusim::sm90::wgmma(w.op, smem, smem_bytes, w.acc, w.op.a_regs ? w.a : nullptr);
}

// The issue, a warpgroup collective: every thread brings its accumulator address (aux), the
// descriptors and scale-d (in[0..4], which must agree across the warpgroup) and, for RS, its four
// A registers (in[5..8]). ctx: the op's fixed fields.
inline void issue_wg(gs::LaneIo* l, uint64_t, uint64_t, void* ctx) {
  WgmmaAsync w;
  w.op = *static_cast<const exla_rs_gpusim::sm90::WgmmaOp*>(ctx);
  for (int t = 0; t < 128; ++t) {
    for (int i = 0; i < 5; ++i)
      if (l[t].in[i] != l[0].in[i]) gs::fail("wgmma.mma_async: thread %d of the warpgroup passes a different descriptor or scale-d than thread 0", t);
    w.acc[t] = reinterpret_cast<float*>(l[t].aux);
    for (int j = 0; j < 4; ++j) w.a[t][j] = l[t].in[5 + j];
  }
  w.op.desc_a = l[0].in[0] | (uint64_t)l[0].in[1] << 32;
  w.op.desc_b = l[0].in[2] | (uint64_t)l[0].in[3] << 32;
  w.op.scale_d = l[0].in[4] != 0;
  gs::wgmma_enqueue(wgmma_run, &w, sizeof w);
}

template <class T>
constexpr bool kIsBf16 = T::kExpMask == 0x7f80u;

template <class T, int M>
EXLA_RS_SM90 void wgmma_issue(float (&d)[M], const unsigned* a, u64 desc_a, u64 desc_b, int scale_d, int trans_b, const char* site) {
  static_assert(M == 32 || M == 64 || M == 128, "wgmma m64nNk16 with N = 64, 128 or 256");
  exla_rs_gpusim::sm90::WgmmaOp op;
  op.n = 2 * M;
  op.input = kIsBf16<T> ? exla_rs_gpusim::sm90::kWgmmaBF16 : exla_rs_gpusim::sm90::kWgmmaF16;
  op.a_regs = a != nullptr;
  op.trans_b = trans_b;
  gs::LaneIo io;
  io.aux = reinterpret_cast<uint64_t>(&d[0]);
  io.in[0] = (uint32_t)desc_a;
  io.in[1] = (uint32_t)(desc_a >> 32);
  io.in[2] = (uint32_t)desc_b;
  io.in[3] = (uint32_t)(desc_b >> 32);
  io.in[4] = scale_d != 0;
  for (int j = 0; j < 4; ++j) io.in[5 + j] = a ? a[j] : 0;
  gs::warpgroup_collective(gs::Op::WgmmaIssue, site, io, issue_wg, &op);
}

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}: SS "p, 1, 1, 0, kTransB" (scale-d,
// imm-scale-a, imm-scale-b, imm-trans-a, imm-trans-b), RS "p, 1, 1, kTransB". SS with kTransB = 1
// (B MN-major): the sm90 backward's dQ = dS K (kernels/sm90/flash_bwd_sm90.cuh).
template <class T, int kTransB = 0, int M>
EXLA_RS_SM90 void wgmma_ss(float (&d)[M], u64 desc_a, u64 desc_b, int scale_d) {
  wgmma_issue<T>(d, nullptr, desc_a, desc_b, scale_d, kTransB, kTransB ? "wgmma.mma_async SS trans-b" : "wgmma.mma_async SS");
}
template <class T, int kTransB, int M>
EXLA_RS_SM90 void wgmma_rs(float (&d)[M], const unsigned (&a)[4], u64 desc_b, int scale_d) {
  wgmma_issue<T>(d, a, 0, desc_b, scale_d, kTransB, "wgmma.mma_async RS");
}

}  // namespace sm90
}  // namespace exla_rs
