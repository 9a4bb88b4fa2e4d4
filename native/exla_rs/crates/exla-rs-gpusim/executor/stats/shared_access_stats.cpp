// The statistics build's stand-in for ThreadSanitizer's runtime: the kernels' translation units
// are compiled with -fsanitize=thread, which makes the compiler call __tsan_readN / __tsan_writeN
// before every load and store, but the library links this file instead of libtsan. Each call goes
// to the executor (shared_access), which counts the shared-memory ones as warp-wide ld.shared /
// st.shared for the bank statistics; the atomics the instrumentation routes here are performed.
// Nothing is checked: this build only measures (scripts/gpu_on_cpu.sh, bench/bank_conflicts.py).
#include <stdint.h>

#include "../runtime.hpp"

using exla_rs_gpusim::shared_access;

extern "C" {

// Called by every instrumented unit's constructor: this is the statistics build, so the executor
// counts global traffic too (exla_rs_gpusim_traffic_json).
void __tsan_init() { exla_rs_gpusim::count_global_traffic(); }
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_read_range(void*, unsigned long) {}
void __tsan_write_range(void*, unsigned long) {}

#define ACCESS(n)                                                                        \
  void __tsan_read##n(void* p) { shared_access(p, n, false); }                           \
  void __tsan_write##n(void* p) { shared_access(p, n, true); }                           \
  void __tsan_unaligned_read##n(void* p) { shared_access(p, n, false); }                 \
  void __tsan_unaligned_write##n(void* p) { shared_access(p, n, true); }                 \
  void __tsan_volatile_read##n(void* p) { shared_access(p, n, false); }                  \
  void __tsan_volatile_write##n(void* p) { shared_access(p, n, true); }                  \
  void __tsan_unaligned_volatile_read##n(void* p) { shared_access(p, n, false); }        \
  void __tsan_unaligned_volatile_write##n(void* p) { shared_access(p, n, true); }
ACCESS(1)
ACCESS(2)
ACCESS(4)
ACCESS(8)
ACCESS(16)
#undef ACCESS

// Atomics (the memory order argument is ignored: fibers run one at a time).
#define ATOMICS(bits, T)                                                                                    \
  T __tsan_atomic##bits##_load(const volatile T* a, int) { return *a; }                                     \
  void __tsan_atomic##bits##_store(volatile T* a, T v, int) { *a = v; }                                     \
  T __tsan_atomic##bits##_exchange(volatile T* a, T v, int) { T o = *a; *a = v; return o; }                 \
  T __tsan_atomic##bits##_fetch_add(volatile T* a, T v, int) { T o = *a; *a = o + v; return o; }            \
  T __tsan_atomic##bits##_fetch_sub(volatile T* a, T v, int) { T o = *a; *a = o - v; return o; }            \
  T __tsan_atomic##bits##_fetch_and(volatile T* a, T v, int) { T o = *a; *a = o & v; return o; }            \
  T __tsan_atomic##bits##_fetch_or(volatile T* a, T v, int) { T o = *a; *a = o | v; return o; }             \
  T __tsan_atomic##bits##_fetch_xor(volatile T* a, T v, int) { T o = *a; *a = o ^ v; return o; }            \
  T __tsan_atomic##bits##_fetch_nand(volatile T* a, T v, int) { T o = *a; *a = ~(o & v); return o; }        \
  int __tsan_atomic##bits##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {                   \
    if (*a == *c) { *a = v; return 1; }                                                                     \
    *c = *a;                                                                                                \
    return 0;                                                                                               \
  }                                                                                                         \
  int __tsan_atomic##bits##_compare_exchange_weak(volatile T* a, T* c, T v, int m, int f) {                 \
    return __tsan_atomic##bits##_compare_exchange_strong(a, c, v, m, f);                                    \
  }                                                                                                         \
  T __tsan_atomic##bits##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                         \
    T o = *a;                                                                                               \
    if (o == c) *a = v;                                                                                     \
    return o;                                                                                               \
  }
ATOMICS(8, uint8_t)
ATOMICS(16, uint16_t)
ATOMICS(32, uint32_t)
ATOMICS(64, uint64_t)
#undef ATOMICS
void __tsan_atomic_thread_fence(int) {}
void __tsan_atomic_signal_fence(int) {}

}  // extern "C"
