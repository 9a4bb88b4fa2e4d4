//! Maps the pages of a large, freshly allocated result before the tasks write it.
//!
//! XLA gives the backward a newly allocated `dbias` on every call (glibc serves 128 MiB with a
//! fresh `mmap`). Touching it the first time costs the kernel one fault per 4 KiB page, and that
//! costs more than the write itself. Measured on a 2-core EPYC VM, 128 MiB, in CPU ms (a C test
//! doing the same `posix_memalign`, then `memset`, then `free`):
//!
//! | how the pages come | map | write | free |
//! |---|---:|---:|---:|
//! | one fault per 4 KiB page | (in the write) | 95-135 | 10-14 |
//! | `MADV_POPULATE_WRITE`, 2 MiB chunks | 55-84 | 7-8 | 9-13 |
//! | `MADV_HUGEPAGE`, then populate | 16-19 | 7-8 | 1 |
//!
//! So the range's 2 MiB-aligned interior is asked for transparent huge pages, and every chunk is
//! populated in parallel. Whether the kernel grants huge pages is its choice
//! (`/sys/kernel/mm/transparent_hugepage`): with `enabled=never` the chunks get 4 KiB pages as
//! before. Where free 2 MiB blocks are scarce, the kernel may compact memory to make one while
//! we wait (`defrag=madvise`): a chunk that takes [`STALL_NS`] of CPU time or more turns huge
//! pages off for the rest of the process, so such a stall happens at most once.
//!
//! Everything here is a hint: an error (an older kernel, another OS) leaves the pages to fault as
//! before, and the contents are never changed.

// Off Linux `populate` does nothing, and what it would use goes unused.
#![cfg_attr(not(target_os = "linux"), allow(dead_code, unused_imports))]

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

/// A populated 2 MiB huge page takes ~0.3 ms here and 512 small pages ~1 ms; 8 ms means the
/// kernel compacted or reclaimed memory to find the block.
const STALL_NS: i64 = 8_000_000;

const PAGE: usize = 4096;
const HUGE: usize = 2 << 20;

/// Set once a huge page took [`STALL_NS`] to populate.
static HUGE_STALLED: AtomicBool = AtomicBool::new(false);

/// Maps every whole page of `[ptr, ptr + bytes)` for writing, with huge pages where the range
/// covers them. The caller may write the whole range; the partial pages at either end may hold
/// other data of the process and are left alone.
pub(super) fn populate(ptr: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        let (start, end) = (ptr as usize, ptr as usize + bytes);
        let (first, last) = (start.next_multiple_of(PAGE), end / PAGE * PAGE);
        if first >= last {
            return;
        }
        let (h0, h1) = (first.next_multiple_of(HUGE), last / HUGE * HUGE);
        let huge = h0 < h1 && !HUGE_STALLED.load(Ordering::Relaxed);
        if huge {
            // SAFETY: [h0, h1) lies inside the caller's buffer; the advice changes how its pages
            // are backed, never what they hold.
            unsafe { sys::madvise(h0 as *mut _, h1 - h0, sys::MADV_HUGEPAGE) };
        }
        // Chunks end on 2 MiB boundaries, so each huge page is one chunk.
        let base = first / HUGE * HUGE;
        (0..(last - base).div_ceil(HUGE)).into_par_iter().for_each(|c| {
            let (at, end) = ((base + c * HUGE).max(first), (base + (c + 1) * HUGE).min(last));
            let t0 = sys::thread_cpu_ns();
            // SAFETY: [at, end) lies inside the caller's buffer, which it may write entirely;
            // populating maps the pages as a write of their current contents would.
            unsafe { sys::madvise(at as *mut _, end - at, sys::MADV_POPULATE_WRITE) };
            if huge && end - at == HUGE && sys::thread_cpu_ns() - t0 >= STALL_NS {
                HUGE_STALLED.store(true, Ordering::Relaxed);
            }
        });
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, bytes);
}

#[cfg(target_os = "linux")]
mod sys {
    use core::ffi::c_void;

    pub(super) const MADV_HUGEPAGE: i32 = 14;
    /// Linux ≥ 5.14.
    pub(super) const MADV_POPULATE_WRITE: i32 = 23;
    const CLOCK_THREAD_CPUTIME_ID: i32 = 3;

    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }

    extern "C" {
        pub(super) fn madvise(addr: *mut c_void, len: usize, advice: i32) -> i32;
        fn clock_gettime(clock: i32, tp: *mut Timespec) -> i32;
    }

    /// CPU time of the calling thread, in ns (0 if the clock cannot be read): kernel time spent
    /// compacting counts, time the thread waits to be scheduled does not.
    pub(super) fn thread_cpu_ns() -> i64 {
        let mut t = Timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: t is a valid timespec to write.
        if unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
            return 0;
        }
        t.tv_sec * 1_000_000_000 + t.tv_nsec
    }
}

#[cfg(test)]
mod tests {
    use super::populate;

    /// Populating maps pages and changes nothing: not the range (fresh or written), not the bytes
    /// around it, whatever its alignment (huge pages, partial pages at both ends, nothing at all).
    #[test]
    fn populate_keeps_contents() {
        let n = 9 << 20;
        let pattern = |i: usize| (i.wrapping_mul(2654435761) >> 13) as u8;
        for (lo, len) in [(0usize, n), (4095, 5 << 20), (123_457, 4 << 20 | 77), (1 << 20, 100), (3, 0)] {
            // A fresh allocation (calloc: pages not yet touched), half of it written first.
            let mut buf = vec![0u8; n];
            for (i, x) in buf[..n / 2].iter_mut().enumerate() {
                *x = pattern(i);
            }
            populate(buf[lo..].as_mut_ptr(), len);
            assert!(buf[..n / 2].iter().enumerate().all(|(i, x)| *x == pattern(i)), "written half changed ({lo}, {len})");
            assert!(buf[n / 2..].iter().all(|x| *x == 0), "fresh half changed ({lo}, {len})");
        }
    }
}
