// Fibers for the executor: one stack per CUDA thread and a context switch that saves only what the
// System V x86-64 ABI says survives a call (rbx, rbp, r12-r15, rsp, the MXCSR and x87 control
// words). swapcontext would also save the signal mask with a system call on every switch, and a
// warp collective costs 32 switches (a thread that waits hands over to the next). The sanitizers
// are told about every switch: AddressSanitizer so it knows which stack is live, ThreadSanitizer
// so each fiber is its own thread to it.
#pragma once

#include <stddef.h>

namespace exla_rs_gpusim {

struct Fiber {
  void* sp = nullptr;      // saved stack pointer while switched out
  void* stack = nullptr;   // mapping: guard page + stack
  size_t mapped = 0;
  size_t usable = 0;
  void* tsan = nullptr;    // ThreadSanitizer's fiber handle (TSan builds; the executor owns it)
  const void* asan_bottom = nullptr;
  size_t asan_size = 0;
};

// Maps a stack of `bytes` (plus a guard page below it) once; reset() prepares a fresh start at
// `entry` (a function that never returns) on it, reusing the mapping (under ThreadSanitizer the
// pages the last run touched are mapped anew, the sanitizer's record of them cleared). The
// fiber's ThreadSanitizer thread, `tsan`, is the caller's to create, set and destroy.
bool fiber_map(Fiber& f, size_t bytes);
void fiber_unmap(Fiber& f);
void fiber_reset(Fiber& f, void (*entry)());

// The scheduler's own context (the OS thread's stack) as a Fiber that can be switched to.
void fiber_init_main(Fiber& main_fiber);

// First thing a fresh fiber's entry calls (AddressSanitizer learns which stack it came from).
void fiber_entered();

// Switches from `from` (saved) to `to`. ThreadSanitizer is told "no synchronisation": the kernel's
// happens-before edges come only from the barriers, collectives and mbarriers that order memory.
void fiber_switch(Fiber& from, Fiber& to);

// ThreadSanitizer contexts that run no code of their own: the copy engine and the tensor cores
// perform their memory effects in one of these (tsan_context_enter/leave around them).
void* tsan_context_create();
void tsan_context_destroy(void* ctx);
void tsan_context_switch(void* ctx);
void* tsan_current();
void tsan_acquire(void* addr);
void tsan_release(void* addr);

}  // namespace exla_rs_gpusim
