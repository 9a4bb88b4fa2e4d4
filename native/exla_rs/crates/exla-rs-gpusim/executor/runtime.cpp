// The executor: runs a launch block after block, each CUDA thread of a block on its own fiber,
// cooperatively scheduled on the calling OS thread. A thread runs until it must wait (a warp
// collective whose lanes have not all arrived, a barrier, an mbarrier phase, an asynchronous
// group); the scheduler then resumes the next runnable thread in thread order. When no thread can
// run, pending copy-engine work completes; if that does not help, the launch has deadlocked and
// the report names what each waiting thread waits for.
//
// Happens-before for ThreadSanitizer comes only from what orders memory on a GPU: CTA barriers
// (bar.sync / bar.arrive / __syncthreads), __syncwarp, mbarrier phases, the async units' issue and
// completion, and the launch boundaries. Blocks are not ordered with each other, so two blocks
// touching the same global word without atomics race, as they would on a GPU, even though they
// run one after the other here: a block's threads are ThreadSanitizer threads of their own, from
// kTsanSets sets that live for the whole launch (block n takes set n mod kTsanSets), and its
// barriers, warps and mbarriers are fresh sync objects. Only blocks whose indices differ by a
// multiple of kTsanSets share threads, and so are ordered (a fresh sanitizer thread per block
// cost most of the tsan harness's time, and the sanitizer reused the ids of destroyed ones,
// which ordered every block after the last: executor_test --block_race).
#include "runtime.hpp"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "exec.h"
#include "fiber.hpp"

#if defined(EXLA_RS_GPUSIM_TSAN)
// ThreadSanitizer's range annotations (exported by its runtime, not declared in its header).
extern "C" void __tsan_read_range(void* addr, unsigned long size);
extern "C" void __tsan_write_range(void* addr, unsigned long size);
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif
#include "kernel_table.hpp"

namespace exla_rs_gpusim {

namespace {

// The core's own memory traffic (its maps, vectors, tokens; the allocator calls ThreadSanitizer
// intercepts) happens in whichever fiber entered it and is ordered by the scheduler, not by GPU
// rules: every entry point from a kernel ignores it. The memory effects the core performs for a
// kernel are annotated explicitly (tsan_read / tsan_write), outside the ignore.
bool g_in_engine = false;  // a copy-engine or tensor-core context is current (no ignore there)
struct CoreScope {
  CoreScope() {
#if defined(EXLA_RS_GPUSIM_TSAN)
    if (!g_in_engine) __tsan_ignore_thread_begin();
#endif
  }
  ~CoreScope() {
#if defined(EXLA_RS_GPUSIM_TSAN)
    if (!g_in_engine) __tsan_ignore_thread_end();
#endif
  }
  CoreScope(const CoreScope&) = delete;
  CoreScope& operator=(const CoreScope&) = delete;
};

// Per CUDA thread. The kernels' frames are a few KiB (registers on a GPU); AddressSanitizer's
// redzones grow them. Under ThreadSanitizer every block maps the stack pages the last one touched
// anew (fiber_reset), so the sanitizer forgets the previous block's stack accesses.
constexpr size_t kStackBytes =
#if defined(EXLA_RS_GPUSIM_ASAN)
    1 << 20;
#elif defined(EXLA_RS_GPUSIM_TSAN)
    128 << 10;
#else
    256 << 10;
#endif

struct CpCopy {
  uint32_t off;
  unsigned char data[16];
};

struct ThreadState {
  unsigned tid = 0;
  Dim3 idx{0, 0, 0};
  unsigned warp = 0, lane = 0;
  Fiber fiber;
  bool done = false;
  bool runnable = true;
  // What a blocked thread waits for (reports and wake-ups).
  enum class Wait { None, Warp, Warpgroup, Barrier, Mbar, WgmmaNone, Regs } wait = Wait::None;
  uint64_t wait_key = 0;
  unsigned wait_arg = 0;
  const char* wait_site = nullptr;
  // cp.async groups: copies since the last commit, then committed groups oldest first.
  std::vector<CpCopy> cp_open;
  std::deque<std::vector<CpCopy>> cp_groups;
  uint64_t cp_seq = 0;  // this lane's cp.async count (bank statistics pair lanes by it)
  // Plain shared-memory accesses (the statistics build): the lane's k-th access since its last
  // call into the executor pairs with the other lanes' k-th (a warp's lanes make the same calls).
  uint64_t epoch = 0;
  uint32_t access_k = 0;
  uint64_t last_key = 0;  // the lane's previous plain access, which a contiguous one widens
  uint32_t last_off = 0;
  unsigned last_bytes = 0;
  bool last_write = false;
};

// A rendezvous of the lanes of a warp (32) or a warpgroup (128).
struct Group {
  bool active = false;
  Op op = Op::Shfl;
  const char* site = nullptr;
  uint64_t mask[2] = {0, 0};
  uint64_t arrived[2] = {0, 0};
  LaneIo* io[128] = {};
  char sync[4] = {};  // ThreadSanitizer sync objects, by generation mod 4
  unsigned gen = 0;
  void* token = nullptr;  // warpgroup ops: every issuer releases into it (wgmma's inputs)
};

struct CtaBarrier {
  unsigned expected = 0, arrived = 0;
  int vote = 0, result = 0;
  unsigned gen = 0;
  char sync[4] = {};
};

struct Mbar {
  unsigned expected = 0;
  int pending = 0;
  int64_t tx = 0;
  unsigned phase = 0;  // completed phases
  char sync[4] = {};
};

struct AsyncCopy {
  uint32_t bar;
  uint32_t dst, bytes;  // the shared-memory span it writes
  AsyncCopyFn fn;
  std::vector<unsigned char> ctx;
  std::unique_ptr<char> token;  // the issuer released into it
  unsigned tid;
};

struct AsyncMath {
  AsyncMathFn fn;
  std::vector<unsigned char> ctx;
  void* token;  // the issuing warpgroup released into it (owned)
};

struct WarpgroupAsync {
  std::vector<AsyncMath> open;
  std::deque<std::vector<AsyncMath>> groups;
  char done_sync = 0;  // the tensor cores release here when they retire ops
};

struct BankStat {
  uint64_t accesses = 0, wavefronts = 0, ideal = 0;
};

// cp.async bank statistics: lanes' k-th cp.async, paired per warp.
struct CpBank {
  uint32_t offs[32];
  unsigned have = 0;
};

// Sets of ThreadSanitizer threads per launch (see the top): 4, fewer for big blocks so that a launch
// keeps at most 2048 sanitizer threads alive, never fewer than 2 (neighbouring blocks unordered).
constexpr unsigned kTsanSets = 4;
unsigned tsan_sets(unsigned nthreads) { return std::max(2u, std::min(kTsanSets, 2048u / nthreads)); }

struct Launch {
  const KernelEntry* kernel = nullptr;
  void** args = nullptr;
  Dim3 grid{1, 1, 1}, block{1, 1, 1}, bidx{0, 0, 0};
  unsigned nthreads = 0;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  std::vector<ThreadState> threads;
  std::vector<Group> warps, warpgroups;
  std::vector<CtaBarrier> barriers = std::vector<CtaBarrier>(16);
  std::unordered_map<uint32_t, Mbar> mbars;
  std::deque<AsyncCopy> copies;
  std::vector<WarpgroupAsync> wg_async;
  // setmaxnreg: registers per thread each warpgroup holds, what one waits for (0: nothing), and the
  // block's pool of released registers.
  unsigned launch_regs = 0;
  std::vector<unsigned> wg_regs, wg_regs_want;
  uint64_t reg_pool = 0;
  std::vector<std::unordered_map<uint64_t, CpBank>> cp_bank;  // per warp, by sequence number
  ThreadState* cur = nullptr;
  Fiber sched;
  std::string error;
  bool failed = false;
  char start_sync = 0, end_sync = 0;
  size_t tsan_slots = 0;  // tsan_sets(nthreads) sets of nthreads: the first slots of g_tsan_pool
};

Launch* g = nullptr;  // the launch in progress (one at a time: g_mutex)
#if defined(EXLA_RS_GPUSIM_TSAN)
// The ThreadSanitizer threads the blocks' CUDA threads run as, made on first use and kept for the
// process's life: every launch reuses the pool's first slots (set s, thread i at s * nthreads + i).
// Making and destroying up to 2048 of them per launch (each a zeroed sanitizer thread state and
// its shadow stack) was most of the tsan harness's time, nearly all of it the kernel's page
// faults. Reuse orders nothing a GPU leaves unordered: launches on a stream are ordered anyway
// (start_sync / end_sync), and within a launch block n still runs on set n mod tsan_sets.
std::vector<void*> g_tsan_pool;  // g_mutex
#endif
// A ThreadSanitizer context of its own for work that a unit other than the executing thread does
// (the copy engine, the tensor cores): made and entered on construction, left and destroyed by
// leave() or at the end of the scope. It is ordered only by what the caller adds (acquire the
// issue's token, release the completion); while it is current, the core's accesses are not
// ignored (g_in_engine: the unit's own reads and writes are what the sanitizer must see).
class EngineContext {
 public:
  EngineContext() : prev_(tsan_current()), ctx_(tsan_context_create()), was_engine_(g_in_engine) {
    if (ctx_) {
      tsan_context_switch(ctx_);
      g_in_engine = true;
    }
  }
  ~EngineContext() { leave(); }
  EngineContext(const EngineContext&) = delete;
  EngineContext& operator=(const EngineContext&) = delete;
  // Back to the thread that entered it, before anything that reports in that thread's name.
  void leave() {
    if (!ctx_) return;
    g_in_engine = was_engine_;
    tsan_context_switch(prev_);
    tsan_context_destroy(ctx_);
    ctx_ = nullptr;
  }

 private:
  void* prev_;
  void* ctx_;
  bool was_engine_;
};

// A warpgroup collective's ThreadSanitizer token while its function runs (wgmma_enqueue takes it).
void* g_current_token = nullptr;
std::mutex g_mutex;
std::unordered_map<std::string, std::unordered_map<std::string, BankStat>> g_bank;  // kernel -> kind
std::mutex g_bank_mutex;

std::string vformat(const char* fmt, va_list ap) {
  char buf[2048];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}

std::string where(const ThreadState* t) {
  char buf[160];
  if (!t) return "executor";
  snprintf(buf, sizeof buf, "block (%u,%u,%u) thread %u (warp %u lane %u)", g->bidx.x, g->bidx.y, g->bidx.z, t->tid, t->warp,
           t->lane);
  return buf;
}

void switch_to_scheduler() {
  ThreadState* t = g->cur;
  g->cur = nullptr;
  fiber_switch(t->fiber, g->sched);
}

// The scheduler's order (run_block): passes over the threads in thread order, each runnable one
// run until it waits. A thread that waits hands over to the next runnable thread of the pass
// itself, and only the pass's last one goes back to the scheduler: one switch per hand-over
// instead of two (a warp collective is 32 of them), the same order.
void yield_in_pass() {
  ThreadState* t = g->cur;
  for (size_t i = t->tid + 1; i < g->threads.size(); ++i) {
    ThreadState& next = g->threads[i];
    if (!next.done && next.runnable) {
      g->cur = &next;
      fiber_switch(t->fiber, next.fiber);
      return;  // whoever resumed t made it g->cur
    }
  }
  switch_to_scheduler();
}

// Blocks the current thread until something makes it runnable again.
void block(ThreadState::Wait w, uint64_t key, unsigned arg, const char* site) {
  ThreadState* t = g->cur;
  t->wait = w;
  t->wait_key = key;
  t->wait_arg = arg;
  t->wait_site = site;
  t->runnable = false;
  yield_in_pass();
  t->wait = ThreadState::Wait::None;
}

void wake(ThreadState& t) {
  t.runnable = true;
}

// Plain ld.shared / st.shared of one instruction: lanes' accesses grouped by (warp, epoch, k).
struct PlainGroup {
  uint32_t offs[32];
  uint32_t have = 0;
  unsigned bytes = 0;  // the widest lane access (a lane's contiguous pieces merged)
  bool write = false;
};
std::unordered_map<uint64_t, PlainGroup> g_plain;  // key: warp << 48 | epoch << 16 | k (statistics build)

void flush_plain(PlainGroup& pg) {
  uint32_t offs[32];
  int n = 0;
  for (int l = 0; l < 32; ++l)
    if ((pg.have >> l) & 1) offs[n++] = pg.offs[l];
  bank_access(pg.write ? "st.shared" : "ld.shared", offs, n, pg.bytes);
}

void note_core_call() {
  if (ThreadState* t = g->cur) {
    t->epoch += 1;
    t->access_k = 0;
  }
}

void fiber_main() {
  fiber_entered();
  tsan_acquire(&g->start_sync);
  g->kernel->entry(g->args);
  ThreadState* t = g->cur;
  t->done = true;
  tsan_release(&g->end_sync);
  yield_in_pass();
  __builtin_trap();  // a finished fiber is never resumed
}

std::string lanes_text(const uint64_t m[2], unsigned n) {
  std::string s;
  int run_start = -1;
  for (unsigned i = 0; i <= n; ++i) {
    const bool on = i < n && ((m[i / 64] >> (i % 64)) & 1);
    if (on && run_start < 0) run_start = (int)i;
    if (!on && run_start >= 0) {
      if (!s.empty()) s += ",";
      s += std::to_string(run_start);
      if ((int)i - 1 > run_start) s += "-" + std::to_string(i - 1);
      run_start = -1;
    }
  }
  return s.empty() ? "none" : s;
}

const char* wait_name(ThreadState::Wait w) {
  switch (w) {
    case ThreadState::Wait::Warp: return "a warp collective";
    case ThreadState::Wait::Warpgroup: return "a warpgroup collective";
    case ThreadState::Wait::Barrier: return "a CTA barrier";
    case ThreadState::Wait::Mbar: return "an mbarrier";
    case ThreadState::Wait::Regs: return "registers (setmaxnreg.inc)";
    default: return "nothing";
  }
}

// The deadlock report: every waiting thread grouped by what it waits for.
std::string deadlock_report() {
  std::string r = "deadlock in block (" + std::to_string(g->bidx.x) + "," + std::to_string(g->bidx.y) + "," +
                  std::to_string(g->bidx.z) + "): no thread can run and no asynchronous work is pending.";
  struct Key {
    ThreadState::Wait w;
    uint64_t key;
    unsigned arg;
    const char* site;
  };
  // A warpgroup waiting in setmaxnreg.inc first: the pool can no longer grow (nothing that could
  // release registers can run), so its request is never met.
  for (size_t w = 0; w < g->wg_regs_want.size(); ++w) {
    const unsigned want = g->wg_regs_want[w];
    if (!want) continue;
    std::string held;
    for (size_t v = 0; v < g->wg_regs.size(); ++v) held += (v ? "/" : "") + std::to_string(g->wg_regs[v]);
    char buf[512];
    snprintf(buf, sizeof buf,
             "\n  setmaxnreg.inc %u in warpgroup %zu can never complete: it holds %u registers per thread and asks "
             "(%u - %u) x 128 = %u from the block's pool, which holds %llu (launch: %u registers x %u threads = %u; "
             "warpgroups hold %s per thread)",
             want, w, g->wg_regs[w], want, g->wg_regs[w], (want - g->wg_regs[w]) * 128, (unsigned long long)g->reg_pool,
             g->launch_regs, g->nthreads, g->launch_regs * g->nthreads, held.c_str());
    r += buf;
  }
  std::vector<std::pair<Key, std::vector<unsigned>>> groups;
  unsigned exited = 0;
  for (auto& t : g->threads) {
    if (t.done) {
      ++exited;
      continue;
    }
    Key k{t.wait, t.wait_key, t.wait_arg, t.wait_site};
    auto it = std::find_if(groups.begin(), groups.end(), [&](auto& p) {
      return p.first.w == k.w && p.first.key == k.key && p.first.arg == k.arg && p.first.site == k.site;
    });
    if (it == groups.end()) groups.push_back({k, {t.tid}});
    else it->second.push_back(t.tid);
  }
  for (auto& [k, tids] : groups) {
    uint64_t m[2] = {0, 0};
    std::string who;
    unsigned lo = tids.front(), hi = tids.back();
    who = tids.size() == 1 ? "thread " + std::to_string(lo)
                           : std::to_string(tids.size()) + " threads (" + std::to_string(lo) + ".." + std::to_string(hi) + ")";
    (void)m;
    char buf[512];
    switch (k.w) {
      case ThreadState::Wait::Mbar: {
        auto& mb = g->mbars[(uint32_t)k.key];
        snprintf(buf, sizeof buf,
                 "\n  %s wait on the mbarrier at shared offset 0x%x for the phase of parity %u: %u phases completed, "
                 "current phase %u has %d of %u arrivals pending and %lld transaction bytes outstanding (%s)",
                 who.c_str(), (unsigned)k.key, k.arg, mb.phase, mb.phase, mb.pending, mb.expected, (long long)mb.tx,
                 k.site ? k.site : "?");
        break;
      }
      case ThreadState::Wait::Barrier: {
        auto& b = g->barriers[k.key];
        snprintf(buf, sizeof buf, "\n  %s wait at barrier %u (bar.sync, %u of %u threads arrived; %s)", who.c_str(), (unsigned)k.key,
                 b.arrived, b.expected, k.site ? k.site : "?");
        break;
      }
      case ThreadState::Wait::Warp:
      case ThreadState::Wait::Warpgroup: {
        bool wgp = k.w == ThreadState::Wait::Warpgroup;
        Group& gr = wgp ? g->warpgroups[k.key] : g->warps[k.key];
        snprintf(buf, sizeof buf, "\n  %s wait in %s %s (%s %llu at %s): lanes %s of mask %s arrived", who.c_str(), wgp ? "warpgroup" : "warp",
                 op_name(gr.op), wgp ? "warpgroup" : "warp", (unsigned long long)k.key, k.site ? k.site : "?",
                 lanes_text(gr.arrived, wgp ? 128 : 32).c_str(), lanes_text(gr.mask, wgp ? 128 : 32).c_str());
        break;
      }
      case ThreadState::Wait::Regs:
        snprintf(buf, sizeof buf, "\n  %s wait in setmaxnreg.inc for %u registers per thread (warpgroup %llu)", who.c_str(), k.arg,
                 (unsigned long long)k.key);
        break;
      default:
        snprintf(buf, sizeof buf, "\n  %s wait for %s", who.c_str(), wait_name(k.w));
    }
    r += buf;
  }
  if (exited) r += "\n  " + std::to_string(exited) + " threads have exited";
  return r;
}

// Completes copy-engine work: those aimed at `bar` (or all when bar == ~0u). Returns how many.
size_t deliver_copies(uint32_t bar);

void complete_phase_if_done(uint32_t off, Mbar& mb) {
  if (mb.pending != 0 || mb.tx != 0) return;
  mb.phase += 1;
  mb.pending = (int)mb.expected;
  for (auto& t : g->threads)
    if (!t.done && t.wait == ThreadState::Wait::Mbar && t.wait_key == off) wake(t);
}

Mbar& mbar_at(uint32_t off, const char* what) {
  auto it = g->mbars.find(off);
  if (it == g->mbars.end()) fail("%s on shared offset 0x%x, which no mbarrier.init initialised in this block", what, off);
  return it->second;
}

size_t deliver_copies(uint32_t bar) {
  size_t n = 0;
  for (size_t i = 0; i < g->copies.size();) {
    if (bar != ~0u && g->copies[i].bar != bar) {
      ++i;
      continue;
    }
    AsyncCopy c = std::move(g->copies[i]);
    g->copies.erase(g->copies.begin() + (long)i);
    // The engine: a context that happens after the issue and before the phase completion the
    // bytes count towards.
    EngineContext engine;
    tsan_acquire(c.token.get());
    // The byte count comes from the issue, not back from the engine: a count written through a
    // pointer from two engine contexts in one call would itself look like a race.
    const uint32_t bytes = c.bytes;
    const char* err = c.fn(c.ctx.data(), g->smem, g->smem_bytes);
    auto it = g->mbars.find(c.bar);
    if (!err && it == g->mbars.end()) err = "its mbarrier is not initialised";
    if (!err) {
      Mbar& mb = it->second;
      tsan_release(&mb.sync[mb.phase & 3]);
    }
    // The engine read the copy's context: its buffer is freed in the engine's name. Freed by the
    // caller after leave(), nothing orders that free after the engine's reads, and when every
    // thread of the block waits (an mbarrier waited for before its TMA was issued: the sm90
    // backward's consumers wait for K/V while the producer has yet to issue them) the scheduler
    // delivers from the main thread, which ThreadSanitizer then reported as a race in delete.
    std::vector<unsigned char>().swap(c.ctx);
    engine.leave();
    if (err) fail("TMA copy issued by thread %u completing on the mbarrier at 0x%x: %s", c.tid, c.bar, err);
    Mbar& mb = it->second;
    mb.tx -= bytes;
    complete_phase_if_done(c.bar, mb);
    ++n;
  }
  return n;
}

// `v` with as many default elements in a new allocation; the old one is freed.
template <class T>
void fresh(std::vector<T>& v) {
  std::vector<T>(v.size()).swap(v);
}

void run_block() {
  Launch& L = *g;
  // Fresh, poisoned shared memory for every block: a new allocation (the sanitizers forget the
  // previous block's accesses to it, as a GPU's blocks do not share shared memory), all-ones bytes,
  // which are NaN as f32, f16 and bf16, so a read of shared memory nothing wrote shows in the
  // results (and the models check their operands). Exactly smem_bytes (AddressSanitizer bounds an
  // access past them), 1024-aligned like a GPU's shared window (128-byte swizzle atoms need it).
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_ignore_thread_begin();  // freeing the last block's shared memory is no thread's store
#endif
  free(L.smem);
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_ignore_thread_end();
#endif
  L.smem = nullptr;
  if (L.smem_bytes) {
#if defined(EXLA_RS_GPUSIM_TSAN)
    // The allocation and the executor's poison are no thread's stores (an allocation made while
    // ignoring clears the sanitizer's record of the range instead: this block's threads may have
    // been made before it).
    __tsan_ignore_thread_begin();
#endif
    void* sm = nullptr;
    const bool ok = posix_memalign(&sm, 1024, L.smem_bytes) == 0;
    if (ok) memset(sm, 0xff, L.smem_bytes);
#if defined(EXLA_RS_GPUSIM_TSAN)
    __tsan_ignore_thread_end();
#endif
    if (!ok) throw std::runtime_error("out of memory for shared memory");
    L.smem = static_cast<unsigned char*>(sm);
  }
  // The block's rendezvous state in fresh allocations, not reset in place: ThreadSanitizer keys
  // its sync objects by address and drops those inside a heap block when it is freed, so this
  // block never acquires what the last one released into a reused barrier or warp (that ordered
  // every block after the one before it and hid races between blocks: executor_test
  // --block_race).
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_ignore_thread_begin();  // freeing the executor's own state is no thread's store
#endif
  fresh(L.warps);
  fresh(L.warpgroups);
  fresh(L.barriers);
  L.mbars.clear();
  L.copies.clear();
  fresh(L.wg_async);
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_ignore_thread_end();
#endif
  L.launch_regs = launch_reg_cap(L.nthreads);
  L.wg_regs.assign(L.wg_async.size(), L.launch_regs);
  L.wg_regs_want.assign(L.wg_async.size(), 0);
  L.reg_pool = 0;
  for (auto& m : L.cp_bank) m.clear();
#if defined(EXLA_RS_GPUSIM_TSAN)
  const uint64_t block_no = L.bidx.x + (uint64_t)L.grid.x * (L.bidx.y + (uint64_t)L.grid.y * L.bidx.z);
  const size_t set = block_no % (L.tsan_slots / L.nthreads);
#endif
  for (unsigned i = 0; i < L.nthreads; ++i) {
    ThreadState& t = L.threads[i];
    t.tid = i;
    t.idx = Dim3{i % L.block.x, (i / L.block.x) % L.block.y, i / (L.block.x * L.block.y)};
    t.warp = i / 32;
    t.lane = i % 32;
    t.done = false;
    t.runnable = true;
    t.wait = ThreadState::Wait::None;
    t.cp_open.clear();
    t.cp_groups.clear();
    t.cp_seq = 0;
#if defined(EXLA_RS_GPUSIM_TSAN)
    void*& thread = g_tsan_pool[set * L.nthreads + i];
    if (!thread) thread = tsan_context_create();
    t.fiber.tsan = thread;
#endif
    fiber_reset(t.fiber, fiber_main);
  }
  for (;;) {
    // One pass: the first runnable thread, which hands over to the next ones (yield_in_pass).
    bool ran = false, all_done = true;
    for (auto& t : L.threads) {
      if (t.done) continue;
      all_done = false;
      if (!t.runnable) continue;
      ran = true;
      L.cur = &t;
      fiber_switch(L.sched, t.fiber);
      L.cur = nullptr;
      if (L.failed) return;
      break;
    }
    if (all_done) break;
    if (ran) continue;
    // Nobody can run: the copy engine finishes what it holds; if that wakes nobody, deadlock.
    if (!L.copies.empty()) {
      L.cur = nullptr;
      deliver_copies(~0u);
      if (L.failed) return;
      continue;
    }
    L.error = deadlock_report();
    L.failed = true;
    return;
  }
  // Shared-memory statistics of cp.async groups that not every lane completed.
  for (unsigned w = 0; w < L.cp_bank.size(); ++w)
    for (auto& [seq, b] : L.cp_bank[w]) {
      (void)seq;
      uint32_t offs[32];
      int n = 0;
      for (int l = 0; l < 32; ++l)
        if ((b.have >> l) & 1) offs[n++] = b.offs[l];
      bank_access("cp.async", offs, n, 16);
    }
  for (auto& [key, pg] : g_plain) {
    (void)key;
    flush_plain(pg);
  }
  g_plain.clear();
}

}  // namespace

// ---------------------------------------------------------------------------------------------

const char* op_name(Op op) {
  switch (op) {
    case Op::Shfl: return "shfl.sync.idx";
    case Op::ShflXor: return "shfl.sync.bfly";
    case Op::Ballot: return "vote.sync.ballot";
    case Op::Any: return "vote.sync.any";
    case Op::All: return "vote.sync.all";
    case Op::SyncWarp: return "bar.warp.sync";
    case Op::Mma: return "mma.sync.m16n8k16";
    case Op::Ldmatrix: return "ldmatrix.sync";
    case Op::WgmmaFence: return "wgmma.fence";
    case Op::WgmmaIssue: return "wgmma.mma_async";
    case Op::WgmmaCommit: return "wgmma.commit_group";
    case Op::WgmmaWait: return "wgmma.wait_group";
    case Op::SetMaxNreg: return "setmaxnreg";
    case Op::Elect: return "elect.sync";
  }
  return "?";
}

Dim3 thread_idx() { return g->cur->idx; }
Dim3 block_idx() { return g->bidx; }
Dim3 block_dim() { return g->block; }
Dim3 grid_dim() { return g->grid; }
unsigned linear_tid() { return g->cur->tid; }
unsigned char* dynamic_smem() { return g->smem; }
size_t dynamic_smem_bytes() { return g->smem_bytes; }

void fail(const char* fmt, ...) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  // The report is the executor's own work; the failing fiber never resumes, so no matching end.
  if (g->cur) __tsan_ignore_thread_begin();
#endif
  va_list ap;
  va_start(ap, fmt);
  std::string msg = vformat(fmt, ap);
  va_end(ap);
  if (!g->failed) {
    g->error = where(g->cur) + ": " + msg;
    g->failed = true;
  }
  if (g->cur) {
    g->cur->done = true;
    tsan_release(&g->end_sync);
    switch_to_scheduler();
  }
  // In the scheduler's own context (copy-engine delivery): unwind to the launch.
  throw std::runtime_error(g->error);
}

uint32_t smem_offset(const void* p, size_t bytes, const char* what) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (!g->smem || c < g->smem || c + bytes > g->smem + g->smem_bytes)
    fail("%s: address %p (%zu bytes) is outside the block's %zu bytes of dynamic shared memory", what, p, bytes, g->smem_bytes);
  return (uint32_t)(c - g->smem);
}

unsigned char* smem_ptr(uint32_t off, size_t bytes, const char* what) {
  if ((size_t)off + bytes > g->smem_bytes)
    fail("%s: shared offset 0x%x (%zu bytes) is past the block's %zu bytes of dynamic shared memory", what, off, bytes, g->smem_bytes);
  return g->smem + off;
}

// The last lane's work in a collective: fn on a contiguous array of the lanes' copies, results
// back to each lane. Out of line: its 17 KiB of arrays then sit on one fiber's stack per
// collective rather than in the frame of every lane that waits in one (5 more pages a lane).
__attribute__((noinline)) static void complete_collective(Group& gr, unsigned n_lanes, const uint64_t mask[2], CollectiveFn fn,
                                                         void* ctx) {
  LaneIo* lanes[128];
  static LaneIo unused;
  for (unsigned i = 0; i < n_lanes; ++i) lanes[i] = ((mask[i / 64] >> (i % 64)) & 1) ? gr.io[i] : &unused;
  LaneIo local[128];
  for (unsigned i = 0; i < n_lanes; ++i) local[i] = *lanes[i];
  void* token = gr.token;
  gr.token = nullptr;
  g_current_token = token;
  fn(local, mask[0], mask[1], ctx);
  if (g_current_token) delete static_cast<char*>(g_current_token);  // not claimed by the op
  g_current_token = nullptr;
  for (unsigned i = 0; i < n_lanes; ++i)
    if ((mask[i / 64] >> (i % 64)) & 1) memcpy(lanes[i]->out, local[i].out, sizeof local[i].out);
}

static void collective(Group& gr, unsigned n_lanes, unsigned my, uint64_t key, bool wg, Op op, const uint64_t mask[2], const char* site,
                       LaneIo& io, CollectiveFn fn, void* ctx, bool orders_memory) {
  ThreadState* t = g->cur;
  if (!((mask[my / 64] >> (my % 64)) & 1))
    fail("%s at %s with member mask %s, which excludes the executing lane %u", op_name(op), site, lanes_text(mask, n_lanes).c_str(), my);
  if (gr.active) {
    if (gr.op != op || gr.site != site || gr.mask[0] != mask[0] || gr.mask[1] != mask[1])
      fail("%s %llu: lane %u reached %s at %s (mask %s) while lanes %s wait in %s at %s (mask %s)", wg ? "warpgroup" : "warp",
           (unsigned long long)key, my, op_name(op), site, lanes_text(mask, n_lanes).c_str(), lanes_text(gr.arrived, n_lanes).c_str(),
           op_name(gr.op), gr.site, lanes_text(gr.mask, n_lanes).c_str());
  } else {
    gr.active = true;
    gr.op = op;
    gr.site = site;
    gr.mask[0] = mask[0];
    gr.mask[1] = mask[1];
    gr.arrived[0] = gr.arrived[1] = 0;
    if (wg) gr.token = new char(0);
  }
  if ((gr.arrived[my / 64] >> (my % 64)) & 1) fail("lane %u arrived twice at %s", my, op_name(op));
  gr.arrived[my / 64] |= 1ull << (my % 64);
  gr.io[my] = &io;
  const unsigned gen = gr.gen;
  if (orders_memory) tsan_release(&gr.sync[gen & 3]);
  if (gr.token) tsan_release(gr.token);
  if (gr.arrived[0] == gr.mask[0] && gr.arrived[1] == gr.mask[1]) {
    // Last to arrive: compute for everyone, then release the waiters.
    complete_collective(gr, n_lanes, mask, fn, ctx);
    gr.active = false;
    gr.gen += 1;
    const unsigned base = wg ? (unsigned)key * 128 : (unsigned)key * 32;
    for (unsigned i = 0; i < n_lanes; ++i)
      if (((mask[i / 64] >> (i % 64)) & 1) && i != my) wake(g->threads[base + i]);
  } else {
    block(wg ? ThreadState::Wait::Warpgroup : ThreadState::Wait::Warp, key, op == Op::SyncWarp ? 1 : 0, site);
  }
  if (orders_memory) tsan_acquire(&gr.sync[gen & 3]);
  (void)t;
}

static void* claim_collective_token() {
  void* t = g_current_token;
  g_current_token = nullptr;
  return t;
}

void warp_collective(Op op, unsigned mask, const char* site, LaneIo& io, CollectiveFn fn, void* ctx, bool orders_memory) {
  CoreScope scope;
  note_core_call();
  ThreadState* t = g->cur;
  const uint64_t m[2] = {mask, 0};
  // A warp past the block's last thread has fewer lanes: a mask naming them can never complete.
  collective(g->warps[t->warp], 32, t->lane, t->warp, false, op, m, site, io, fn, ctx, orders_memory);
}

void warpgroup_collective(Op op, const char* site, LaneIo& io, CollectiveFn fn, void* ctx) {
  CoreScope scope;
  note_core_call();
  ThreadState* t = g->cur;
  const unsigned wgi = t->tid / 128;
  if ((wgi + 1) * 128 > g->nthreads) fail("%s at %s: warpgroup %u is incomplete (block of %u threads)", op_name(op), site, wgi, g->nthreads);
  const uint64_t m[2] = {~0ull, ~0ull};
  collective(g->warpgroups[wgi], 128, t->tid % 128, wgi, true, op, m, site, io, fn, ctx, true);
}

unsigned launch_reg_cap(unsigned threads) { return std::min(255u, 65536u / threads / 8 * 8); }

// Grants waiting setmaxnreg.inc requests the pool can cover, lowest warpgroup first (the ISA
// leaves the order open), and wakes their threads.
static void grant_registers() {
  for (size_t w = 0; w < g->wg_regs_want.size(); ++w) {
    const unsigned want = g->wg_regs_want[w];
    if (!want || g->reg_pool < (uint64_t)(want - g->wg_regs[w]) * 128) continue;
    g->reg_pool -= (uint64_t)(want - g->wg_regs[w]) * 128;
    g->wg_regs[w] = want;
    g->wg_regs_want[w] = 0;
    for (auto& t : g->threads)
      if (!t.done && t.wait == ThreadState::Wait::Regs && t.wait_key == w) wake(t);
  }
}

// The warpgroup's last thread to arrive: in[0] = the count, in[1] = 1 for .inc.
static void setmaxnreg_wg(LaneIo* l, uint64_t, uint64_t, void*) {
  const unsigned regs = l[0].in[0];
  const bool inc = l[0].in[1] != 0;
  for (int t = 1; t < 128; ++t)
    if (l[t].in[0] != regs) fail("setmaxnreg.%s: thread %d of the warpgroup asks %u registers, thread 0 %u", inc ? "inc" : "dec", t, l[t].in[0], regs);
  const unsigned w = g->cur->tid / 128;
  unsigned& held = g->wg_regs[w];
  // PTX ISA, setmaxnreg: .dec lowers the count, .inc raises it; anything else is undefined.
  if (inc ? regs < held : regs > held)
    fail("setmaxnreg.%s %u in warpgroup %u, which holds %u registers per thread: .%s must not %s the count", inc ? "inc" : "dec", regs, w,
         held, inc ? "inc" : "dec", inc ? "lower" : "raise");
  if (inc) {
    g->wg_regs_want[w] = regs;
  } else {
    g->reg_pool += (uint64_t)(held - regs) * 128;
    held = regs;
  }
  grant_registers();
}

void setmaxnreg(bool inc, unsigned regs) {
  LaneIo io;
  io.in[0] = regs;
  io.in[1] = inc;
  warpgroup_collective(Op::SetMaxNreg, inc ? "setmaxnreg.inc" : "setmaxnreg.dec", io, setmaxnreg_wg, nullptr);
  CoreScope scope;
  note_core_call();
  const unsigned w = g->cur->tid / 128;
  // Until the pool covers the request (a .dec elsewhere grants it); the scheduler reports a
  // request nothing can still meet as a deadlock.
  while (g->wg_regs_want[w]) block(ThreadState::Wait::Regs, w, g->wg_regs_want[w], "setmaxnreg.inc");
}

int cta_barrier(unsigned id, unsigned count, bool wait, int vote) {
  CoreScope scope;
  note_core_call();
  if (id >= 16) fail("bar.%s %u: barrier ids are 0..15", wait ? "sync" : "arrive", id);
  if (count == 0 || count % 32 != 0 || count > g->nthreads)
    fail("bar.%s %u, %u: the thread count must be a non-zero multiple of 32 and at most the block's %u", wait ? "sync" : "arrive", id,
         count, g->nthreads);
  CtaBarrier& b = g->barriers[id];
  if (b.arrived == 0) {
    b.expected = count;
    b.vote = 0;
  } else if (b.expected != count) {
    fail("bar.%s %u with count %u while the barrier's current phase expects %u threads", wait ? "sync" : "arrive", id, count, b.expected);
  }
  const unsigned gen = b.gen;
  tsan_release(&b.sync[gen & 3]);
  b.vote += vote;
  b.arrived += 1;
  if (b.arrived == b.expected) {
    b.result = b.vote;
    b.arrived = 0;
    b.gen += 1;
    for (auto& t : g->threads)
      if (!t.done && t.wait == ThreadState::Wait::Barrier && t.wait_key == id && t.wait_arg == gen) wake(t);
  } else if (wait) {
    block(ThreadState::Wait::Barrier, id, gen, "bar.sync");
  }
  if (!wait) return 0;
  tsan_acquire(&b.sync[gen & 3]);
  return b.result;
}

void mbar_init(uint32_t off, unsigned count) {
  CoreScope scope;
  note_core_call();
  if (off % 8) fail("mbarrier.init at shared offset 0x%x: mbarriers are 8-byte aligned", off);
  if (count == 0 || count >= (1u << 20)) fail("mbarrier.init at 0x%x with count %u: must be 1 .. 2^20 - 1", off, count);
  Mbar& mb = g->mbars[off];
  mb = Mbar{};
  mb.expected = count;
  mb.pending = (int)count;
}

void mbar_arrive(uint32_t off, unsigned expect_tx) {
  CoreScope scope;
  note_core_call();
  Mbar& mb = mbar_at(off, expect_tx ? "mbarrier.arrive.expect_tx" : "mbarrier.arrive");
  mb.tx += expect_tx;
  tsan_release(&mb.sync[mb.phase & 3]);
  if (mb.pending <= 0) fail("mbarrier.arrive on 0x%x: more arrivals than its count %u in phase %u", off, mb.expected, mb.phase);
  mb.pending -= 1;
  complete_phase_if_done(off, mb);
}

void mbar_wait(uint32_t off, unsigned parity) {
  CoreScope scope;
  note_core_call();
  for (;;) {
    Mbar& mb = mbar_at(off, "mbarrier.try_wait.parity");
    // The phase of parity `parity` has completed when the current (incomplete) phase's parity differs.
    if ((mb.phase & 1) != (parity & 1)) {
      // The phase just completed is mb.phase - 1; waiting on an older phase of the same parity would
      // be mb.phase - 3, whose sync object has been reused: acquire the latest completed one.
      tsan_acquire(&mb.sync[(mb.phase - 1) & 3]);
      return;
    }
    // The copy engine completes what targets this barrier as late as it may: when it is waited for.
    if (deliver_copies(off) > 0) continue;
    block(ThreadState::Wait::Mbar, off, parity, "mbarrier.try_wait.parity");
  }
}

void async_copy(uint32_t bar, uint32_t dst, uint32_t bytes, AsyncCopyFn fn, const void* ctx, size_t ctx_bytes) {
  CoreScope scope;
  note_core_call();
  mbar_at(bar, "cp.async.bulk.tensor (its mbarrier)");
  const unsigned tid = g->cur ? g->cur->tid : 0;
  for (const AsyncCopy& o : g->copies)
    if (dst < o.dst + o.bytes && o.dst < dst + bytes)
      fail("cp.async.bulk.tensor by thread %u into shared [0x%x, 0x%x) (mbarrier 0x%x) overlaps the copy thread %u issued "
           "into [0x%x, 0x%x) (mbarrier 0x%x), which no wait has observed complete: the two writes are unordered",
           tid, dst, dst + bytes, bar, o.tid, o.dst, o.dst + o.bytes, o.bar);
  AsyncCopy c;
  c.bar = bar;
  c.dst = dst;
  c.bytes = bytes;
  c.fn = fn;
  c.ctx.assign(static_cast<const unsigned char*>(ctx), static_cast<const unsigned char*>(ctx) + ctx_bytes);
  c.token.reset(new char(0));
  c.tid = tid;
  tsan_release(c.token.get());
  g->copies.push_back(std::move(c));
}

void wgmma_enqueue(AsyncMathFn fn, const void* ctx, size_t ctx_bytes) {
  ThreadState* t = g->cur;
  AsyncMath m;
  m.fn = fn;
  m.ctx.assign(static_cast<const unsigned char*>(ctx), static_cast<const unsigned char*>(ctx) + ctx_bytes);
  m.token = claim_collective_token();
  g->wg_async[t->tid / 128].open.push_back(std::move(m));
}

void wgmma_commit() {
  ThreadState* t = g->cur;
  auto& a = g->wg_async[t->tid / 128];
  a.groups.push_back(std::move(a.open));
  a.open.clear();
}

void wgmma_wait(unsigned pending) {
  ThreadState* t = g->cur;
  auto& a = g->wg_async[t->tid / 128];
  if (a.groups.size() <= pending) return;
  // The tensor cores retire the oldest groups in one ThreadSanitizer context: a warpgroup's
  // wgmma operations on one accumulator are ordered by the hardware (each op of a group reads
  // the accumulators the previous one wrote), and each op happens after its issue (its token).
  EngineContext tensor_cores;
  const char* err = nullptr;
  while (a.groups.size() > pending && !err) {
    std::vector<AsyncMath> grp = std::move(a.groups.front());
    a.groups.pop_front();
    for (auto& m : grp) {
      if (m.token) tsan_acquire(m.token);
      if (!err) err = m.fn(m.ctx.data(), g->smem, g->smem_bytes);
      delete static_cast<char*>(m.token);
      m.token = nullptr;
    }
  }
  tsan_release(&a.done_sync);
  tensor_cores.leave();
  if (err) fail("wgmma: %s", err);
}

void wgmma_retired_acquire() {
  ThreadState* t = g->cur;
  tsan_acquire(&g->wg_async[t->tid / 128].done_sync);
}

void cp_async_issue(uint32_t dst_off, const void* bytes16) {
  CoreScope scope;
  note_core_call();
  ThreadState* t = g->cur;
  CpCopy c;
  c.off = dst_off;
  memcpy(c.data, bytes16, 16);
  t->cp_open.push_back(c);
  // The PTX ISA orders cp.async's shared-memory write with nothing until the issuing thread's
  // wait_group: it may land any time from now on. For race detection it is this thread's write
  // now (a read of the destination by another thread not ordered before this issue races); the
  // data itself lands at the wait (a read before it sees stale bytes).
  tsan_write(g->smem + dst_off, 16);
  // Bank statistics: the warp's lanes' k-th cp.async form one instruction.
  auto& m = g->cp_bank[t->warp];
  CpBank& b = m[t->cp_seq++];
  b.offs[t->lane] = dst_off;
  b.have |= 1u << t->lane;
  const unsigned lanes_in_warp = std::min(32u, g->nthreads - t->warp * 32);
  if ((unsigned)__builtin_popcount(b.have) == lanes_in_warp) {
    bank_access("cp.async", b.offs, (int)lanes_in_warp, 16);
    m.erase(t->cp_seq - 1);
  }
}

void cp_async_commit_group() {
  CoreScope scope;
  note_core_call();
  ThreadState* t = g->cur;
  t->cp_groups.push_back(std::move(t->cp_open));
  t->cp_open.clear();
}

void cp_async_wait_group(unsigned pending) {
  CoreScope scope;
  note_core_call();
  ThreadState* t = g->cur;
  while (t->cp_groups.size() > pending) {
    for (auto& c : t->cp_groups.front()) {
      unsigned char* dst = smem_ptr(c.off, 16, "cp.async landing");
      memcpy(dst, c.data, 16);  // under the core's ignore: the write was annotated at issue
    }
    t->cp_groups.pop_front();
  }
}

// Global traffic: the registered device allocations (start -> length) and the bytes per kernel.
struct Traffic {
  uint64_t read = 0, written = 0, atomic = 0;
};
bool g_count_global = false;
std::mutex g_alloc_mutex;
std::map<uintptr_t, size_t> g_allocs;
std::unordered_map<std::string, Traffic> g_traffic;  // under g_bank_mutex

void count_global_traffic() { g_count_global = true; }

void global_access(const void* p, size_t bytes, Global kind) {
  if (!g_count_global || !g || bytes == 0) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  {
    std::lock_guard<std::mutex> lk(g_alloc_mutex);
    auto it = g_allocs.upper_bound(a);
    if (it == g_allocs.begin()) return;
    --it;
    if (a >= it->first + it->second) return;  // a stack, the parameters, the executor's state
  }
  std::lock_guard<std::mutex> lk(g_bank_mutex);
  Traffic& t = g_traffic[g->kernel->name];
  (kind == Global::Read ? t.read : kind == Global::Write ? t.written : t.atomic) += bytes;
}

void shared_access(const void* p, unsigned bytes, bool write) {
  if (!g || !g->cur) return;
  const unsigned char* c = static_cast<const unsigned char*>(p);
  if (!g->smem || c < g->smem || c >= g->smem + g->smem_bytes) {  // not shared memory: global?
    global_access(p, bytes, write ? Global::Write : Global::Read);
    return;
  }
  ThreadState* t = g->cur;
  const uint32_t off = (uint32_t)(c - g->smem);
  // The C++ compiler may split one vector access (a 16-byte chunk: LDS.128 on the GPU) into
  // narrower ones, in any order: a lane's access inside the same aligned 16 bytes as its previous
  // one (same epoch and direction) widens that access instead of counting anew.
  if (t->access_k > 0 && t->last_write == write && off / 16 == t->last_off / 16 && (off + bytes - 1) / 16 == off / 16) {
    PlainGroup& pg = g_plain[t->last_key];
    const uint32_t lo = std::min(off, t->last_off), hi = std::max(off + bytes, t->last_off + t->last_bytes);
    t->last_off = lo;
    t->last_bytes = hi - lo;
    pg.offs[t->lane] = lo;
    // An access of w bytes is served as a naturally aligned w-byte word (w rounded up to 4, 8, 16).
    unsigned w = 4;
    while (w < t->last_bytes) w *= 2;
    pg.bytes = std::max(pg.bytes, w);
    return;
  }
  const uint64_t key = (uint64_t)t->warp << 48 | (t->epoch & 0xffffffffull) << 16 | (t->access_k++ & 0xffff);
  PlainGroup& pg = g_plain[key];
  if (pg.have == 0) pg.write = write;
  pg.bytes = std::max(pg.bytes, std::max(4u, bytes));
  pg.offs[t->lane] = off;
  pg.have |= 1u << t->lane;
  t->last_key = key;
  t->last_off = off;
  t->last_bytes = bytes;
  t->last_write = write;
}

// A memory effect the core performs for the current context, reported outside the core's ignore.
static void tsan_range(const void* p, size_t n, bool write) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  if (!g_in_engine) __tsan_ignore_thread_end();
  (write ? __tsan_write_range : __tsan_read_range)(const_cast<void*>(p), n);
  if (!g_in_engine) __tsan_ignore_thread_begin();
#else
  (void)p;
  (void)n;
  (void)write;
#endif
}
void tsan_read(const void* p, size_t n) { tsan_range(p, n, false); }
void tsan_write(const void* p, size_t n) { tsan_range(p, n, true); }

// Shared memory has 32 banks of 4 bytes. A warp access is served in phases: 128 bytes of lane
// accesses at a time (8 lanes of 16 bytes, 16 of 8, 32 of 4); inside a phase each bank delivers one
// distinct 4-byte word per wavefront (equal words broadcast). Conflicts = wavefronts beyond one per
// phase, what Nsight Compute counts as shared-memory bank conflicts for these instructions.
void bank_access(const char* kind, const uint32_t* offs, int n, unsigned bytes) {
  if (n <= 0 || !g) return;
  const int per_phase = (int)std::max(1u, 128u / bytes);
  uint64_t wavefronts = 0, phases = 0;
  for (int p0 = 0; p0 < n; p0 += per_phase) {
    uint32_t words[32][32];
    int count[32] = {};
    for (int l = p0; l < std::min(n, p0 + per_phase); ++l)
      for (unsigned w = 0; w < std::max(1u, bytes / 4); ++w) {
        const uint32_t word = offs[l] / 4 + w;
        const unsigned bank = word % 32;
        bool seen = false;
        for (int k = 0; k < count[bank]; ++k) seen |= words[bank][k] == word;
        if (!seen && count[bank] < 32) words[bank][count[bank]++] = word;
      }
    int mx = 1;
    for (int b = 0; b < 32; ++b) mx = std::max(mx, count[b]);
    wavefronts += (uint64_t)mx;
    phases += 1;
  }
  std::lock_guard<std::mutex> lk(g_bank_mutex);
  BankStat& s = g_bank[g->kernel->name][kind];
  s.accesses += 1;
  s.wavefronts += wavefronts;
  s.ideal += phases;
}

}  // namespace exla_rs_gpusim

// ---------------------------------------------------------------------------------------------
// The C ABI (exec.h).

using namespace exla_rs_gpusim;

extern "C" int exla_rs_gpusim_has_kernel(const char* kernel) { return find_kernel(kernel) ? 1 : 0; }

extern "C" int exla_rs_gpusim_launch(const char* kernel, const uint32_t grid[3], const uint32_t block[3], uint32_t smem_bytes, void** args,
                                     char* err, size_t err_len) {
  auto report = [&](const std::string& s) {
    if (err && err_len) {
      snprintf(err, err_len, "%s", s.c_str());
    }
    return 1;
  };
  const KernelEntry* k = find_kernel(kernel);
  if (!k) return report(std::string("no kernel named ") + kernel + " in the GPU-on-CPU executor's table");
  const uint64_t nthreads = (uint64_t)block[0] * block[1] * block[2];
  if (nthreads == 0 || nthreads > 1024)
    return report("launch of " + std::string(kernel) + ": " + std::to_string(nthreads) + " threads per block (1..1024 allowed)");
  if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535)
    return report("launch of " + std::string(kernel) + ": grid (" + std::to_string(grid[0]) + "," + std::to_string(grid[1]) + "," +
                  std::to_string(grid[2]) + ") is empty or past the limits");
  if (smem_bytes > 227 * 1024)
    return report("launch of " + std::string(kernel) + ": " + std::to_string(smem_bytes) + " bytes of dynamic shared memory (227 KiB at most)");

  std::lock_guard<std::mutex> lk(g_mutex);
  Launch L;
  L.kernel = k;
  L.args = args;
  L.grid = Dim3{grid[0], grid[1], grid[2]};
  L.block = Dim3{block[0], block[1], block[2]};
  L.nthreads = (unsigned)nthreads;
  L.smem_bytes = smem_bytes;
  L.threads.resize(L.nthreads);
  L.warps.resize((L.nthreads + 31) / 32);
  L.warpgroups.resize((L.nthreads + 127) / 128);
  L.wg_async.resize((L.nthreads + 127) / 128);
  L.cp_bank.resize((L.nthreads + 31) / 32);
#if defined(EXLA_RS_GPUSIM_TSAN)
  L.tsan_slots = (size_t)tsan_sets(L.nthreads) * L.nthreads;
  if (g_tsan_pool.size() < L.tsan_slots) g_tsan_pool.resize(L.tsan_slots, nullptr);
#endif
  int rc = 0;
  for (auto& t : L.threads)
    if (!fiber_map(t.fiber, kStackBytes)) {
      rc = report("cannot map fiber stacks");
      break;
    }
  g = &L;
  fiber_init_main(L.sched);
  tsan_release(&L.start_sync);
  if (rc == 0) {
    try {
      for (unsigned z = 0; z < grid[2] && !L.failed; ++z)
        for (unsigned y = 0; y < grid[1] && !L.failed; ++y)
          for (unsigned x = 0; x < grid[0] && !L.failed; ++x) {
            L.bidx = Dim3{x, y, z};
            run_block();
          }
    } catch (const std::exception& e) {
      if (!L.failed) L.error = e.what();
      L.failed = true;
    }
    if (L.failed) {
      // The threads stopped mid-kernel end here as far as ThreadSanitizer is concerned, so the
      // caller's later use of the buffers is ordered after their accesses.
      void* self = tsan_current();
      for (auto& t : L.threads)
        if (!t.done && t.fiber.tsan) {
          tsan_context_switch(t.fiber.tsan);
          tsan_release(&L.end_sync);
          tsan_context_switch(self);
        }
    }
    tsan_acquire(&L.end_sync);
    if (L.failed) rc = report(std::string(kernel) + ": " + L.error);
  }
  g = nullptr;
#if defined(EXLA_RS_GPUSIM_TSAN)
  // A failed launch leaves fibers stopped inside the core with ThreadSanitizer's ignores on, and
  // destroying such a fiber aborts the process, as would running one again: keep them (and their
  // stacks) for the process's life, out of the pool; the report has already been written.
  if (L.failed) {
    for (auto& t : L.threads) t.fiber.stack = nullptr;
    std::fill(g_tsan_pool.begin(), g_tsan_pool.begin() + (long)L.tsan_slots, nullptr);
  }
#endif
  for (auto& t : L.threads) fiber_unmap(t.fiber);
  free(L.smem);
  return rc;
}

extern "C" size_t exla_rs_gpusim_stats_json(char* buf, size_t len) {
  std::lock_guard<std::mutex> lk(g_bank_mutex);
  std::string s = "{";
  bool first_k = true;
  std::vector<std::string> names;
  for (auto& [k, v] : g_bank) names.push_back(k);
  std::sort(names.begin(), names.end());
  for (auto& k : names) {
    s += (first_k ? "" : ",") + std::string("\"") + k + "\":{";
    first_k = false;
    bool first = true;
    for (auto& [kind, st] : g_bank[k]) {
      char b[256];
      snprintf(b, sizeof b, "%s\"%s\":{\"accesses\":%llu,\"wavefronts\":%llu,\"ideal\":%llu,\"conflicts\":%llu}", first ? "" : ",",
               kind.c_str(), (unsigned long long)st.accesses, (unsigned long long)st.wavefronts, (unsigned long long)st.ideal,
               (unsigned long long)(st.wavefronts - st.ideal));
      s += b;
      first = false;
    }
    s += "}";
  }
  s += "}";
  if (buf && len) snprintf(buf, len, "%s", s.c_str());
  return s.size();
}

extern "C" void exla_rs_gpusim_stats_reset(void) {
  std::lock_guard<std::mutex> lk(g_bank_mutex);
  g_bank.clear();
  g_traffic.clear();
}

extern "C" size_t exla_rs_gpusim_traffic_json(char* buf, size_t len) {
  std::lock_guard<std::mutex> lk(g_bank_mutex);
  std::vector<std::string> names;
  for (auto& [k, v] : g_traffic) names.push_back(k);
  std::sort(names.begin(), names.end());
  std::string s = "{";
  for (size_t i = 0; i < names.size(); ++i) {
    const Traffic& t = g_traffic[names[i]];
    char b[512];
    snprintf(b, sizeof b, "%s\"%s\":{\"read\":%llu,\"written\":%llu,\"atomic\":%llu}", i ? "," : "", names[i].c_str(),
             (unsigned long long)t.read, (unsigned long long)t.written, (unsigned long long)t.atomic);
    s += b;
  }
  s += "}";
  if (buf && len) snprintf(buf, len, "%s", s.c_str());
  return s.size();
}

extern "C" void exla_rs_gpusim_register_alloc(const void* p, size_t len) {
  if (!p || !len) return;
  std::lock_guard<std::mutex> lk(g_alloc_mutex);
  g_allocs[reinterpret_cast<uintptr_t>(p)] = len;
}

extern "C" void exla_rs_gpusim_unregister_alloc(const void* p) {
  std::lock_guard<std::mutex> lk(g_alloc_mutex);
  g_allocs.erase(reinterpret_cast<uintptr_t>(p));
}
