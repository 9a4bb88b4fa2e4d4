#include "fiber.hpp"

#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <vector>

#if defined(EXLA_RS_GPUSIM_TSAN)
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif
#if defined(EXLA_RS_GPUSIM_ASAN)
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#error "the GPU-on-CPU executor's context switch is written for x86-64"
#endif

// void exla_rs_gpusim_switch(void** save_sp, void* new_sp): pushes the callee-saved registers and
// the FP control words, stores rsp in *save_sp, loads new_sp and pops the same frame from there.
extern "C" void exla_rs_gpusim_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .p2align 4
  .globl exla_rs_gpusim_switch
  .hidden exla_rs_gpusim_switch
  .type exla_rs_gpusim_switch,@function
exla_rs_gpusim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size exla_rs_gpusim_switch, .-exla_rs_gpusim_switch
)");

namespace exla_rs_gpusim {

static size_t page_size() {
  static size_t p = (size_t)sysconf(_SC_PAGESIZE);
  return p;
}

bool fiber_map(Fiber& f, size_t bytes) {
  const size_t pg = page_size();
  const size_t usable = (bytes + pg - 1) / pg * pg;
  void* m = mmap(nullptr, usable + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return false;
  mprotect(m, pg, PROT_NONE);  // a stack overflow faults instead of corrupting the next stack
  f.stack = m;
  f.mapped = usable + pg;
  f.usable = usable;
  f.asan_bottom = static_cast<char*>(m) + pg;
  f.asan_size = usable;
  return true;
}

void fiber_unmap(Fiber& f) {
  if (f.stack) munmap(f.stack, f.mapped);
  f.stack = nullptr;
}

#if defined(EXLA_RS_GPUSIM_TSAN)
// Bytes at the top of f's stack that code touched since they were mapped: a stack grows down, so
// the lowest resident page bounds them (mincore; a page that was only read counts too), or all of
// it when mincore cannot tell.
static size_t touched_bytes(const Fiber& f) {
  const size_t pg = page_size(), pages = f.usable / pg;
  static thread_local std::vector<unsigned char> resident;
  resident.resize(pages);
  if (mincore(static_cast<char*>(f.stack) + pg, f.usable, resident.data()) != 0) return f.usable;
  for (size_t i = 0; i < pages; ++i)
    if (resident[i] & 1) return (pages - i) * pg;
  return 0;
}

// Fresh pages where the previous block's thread ran, so that ThreadSanitizer does not take its
// stack variables for the next thread's accesses: a mapping made while the scheduler ignores
// memory accesses clears the sanitizer's record of the range (its mmap interceptor resets the
// shadow instead of recording a write, which the next block's thread, made before it, would race
// with). Only the touched top of the stack, mapped again in place: the kernels' frames are a few
// KiB of the 128.
static void fresh_stack_pages(Fiber& f) {
  const size_t used = touched_bytes(f);
  if (used == 0) return;
  char* lo = static_cast<char*>(f.stack) + f.mapped - used;
  __tsan_ignore_thread_begin();
  if (mmap(lo, used, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) != lo) {
    const size_t usable = f.usable;
    void* tsan = f.tsan;
    fiber_unmap(f);
    fiber_map(f, usable);
    f.tsan = tsan;
  }
  __tsan_ignore_thread_end();
}
#endif

void fiber_reset(Fiber& f, void (*entry)()) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  fresh_stack_pages(f);
#endif
  // Frame popped by the first switch into the fiber, from low to high addresses:
  // [mxcsr, fcw][r15 r14 r13 r12 rbx rbp][return address = entry][0: entry's own "return address"]
  // so that entry starts with rsp = 8 (mod 16), as after a call.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + f.mapped) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;
  *--sp = reinterpret_cast<uint64_t>(entry);
  for (int i = 0; i < 6; ++i) *--sp = 0;
  uint32_t ctl[2];
  asm volatile("stmxcsr %0" : "=m"(ctl[0]));
  asm volatile("fnstcw %0" : "=m"(ctl[1]));
  ctl[1] &= 0xffff;
  --sp;
  memcpy(sp, ctl, 8);
  f.sp = sp;
}

void fiber_init_main(Fiber& main_fiber) {
  main_fiber.stack = nullptr;
#if defined(EXLA_RS_GPUSIM_TSAN)
  main_fiber.tsan = __tsan_get_current_fiber();
#endif
}

#if defined(EXLA_RS_GPUSIM_ASAN)
// The scheduler's stack, as AddressSanitizer reports it when a fiber first starts.
static const void* g_main_bottom = nullptr;
static size_t g_main_size = 0;
#endif

#if defined(EXLA_RS_GPUSIM_ASAN)
// Whether the switch in progress left the scheduler's stack: a fiber may also start when another
// hands over to it (a thread that waits resumes the next runnable one directly), and only the
// scheduler's stack is the one to remember.
static bool g_switch_from_main = false;
#endif

void fiber_entered() {
#if defined(EXLA_RS_GPUSIM_ASAN)
  const void* bottom = nullptr;
  size_t size = 0;
  __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
  if (g_switch_from_main) {
    g_main_bottom = bottom;
    g_main_size = size;
  }
#endif
}

void fiber_switch(Fiber& from, Fiber& to) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_switch_to_fiber(to.tsan, __tsan_switch_to_fiber_no_sync);
#endif
#if defined(EXLA_RS_GPUSIM_ASAN)
  g_switch_from_main = from.stack == nullptr;
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, to.stack ? to.asan_bottom : g_main_bottom, to.stack ? to.asan_size : g_main_size);
#endif
  exla_rs_gpusim_switch(&from.sp, to.sp);
#if defined(EXLA_RS_GPUSIM_ASAN)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void* tsan_context_create() {
#if defined(EXLA_RS_GPUSIM_TSAN)
  return __tsan_create_fiber(0);
#else
  return nullptr;
#endif
}
void tsan_context_destroy(void* ctx) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  if (ctx) __tsan_destroy_fiber(ctx);
#else
  (void)ctx;
#endif
}
void tsan_context_switch(void* ctx) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_switch_to_fiber(ctx, __tsan_switch_to_fiber_no_sync);
#else
  (void)ctx;
#endif
}
void* tsan_current() {
#if defined(EXLA_RS_GPUSIM_TSAN)
  return __tsan_get_current_fiber();
#else
  return nullptr;
#endif
}
void tsan_acquire(void* addr) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_acquire(addr);
#else
  (void)addr;
#endif
}
void tsan_release(void* addr) {
#if defined(EXLA_RS_GPUSIM_TSAN)
  __tsan_release(addr);
#else
  (void)addr;
#endif
}

}  // namespace exla_rs_gpusim
