//! Cache hints: a line or a span asked for ahead of its use. Hints only: they never fault, and are
//! no-ops off x86-64.

/// Asks the caches for the line holding `p`. A hint only: never faults, a no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never dereferences.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Asks L2 alone for the line holding `p` (`prefetcht1`; L1 gets it at its first load), for data
/// from memory read a while after the request. The decode's hints (its next phase's rows) took
/// bf16 decode 3-15% faster so than with `prefetcht0` on the 2-vCPU Emerald Rapids (medians of
/// alternated runs, one and two threads); a guess at why: a request for L1 holds one of its few
/// fill buffers until the line arrives. A hint only: never faults, a no-op off x86-64.
#[inline(always)]
pub(crate) fn prefetch_line_l2(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch never dereferences.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(p as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Prefetches bytes `[start, start + len)` of the allocation at `base` into L2, one request per
/// cache line the span touches (lines of the address space: `base` need not start on one). A
/// hint only: never faults, and a no-op off x86-64.
#[inline]
pub(crate) fn prefetch_span(base: *const u8, start: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let from = base.wrapping_add(start);
        let skew = from as usize & 63;
        let mut off = 0;
        while off < skew + len {
            // SAFETY: prefetch never dereferences; `wrapping_*` keeps the pointer arithmetic
            // defined even past the span's ends.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(from.wrapping_sub(skew).wrapping_add(off) as *const i8) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (base, start, len);
}
