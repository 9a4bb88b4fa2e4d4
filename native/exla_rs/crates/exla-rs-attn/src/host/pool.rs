//! f32 scratch reused from one call to the next: the packed K and V of the forward and the
//! backward.
//!
//! A fresh `vec![0.0; n]` of a few MiB is a fresh `mmap` from glibc: its pages fault in one by one
//! on the first write (and are cleared by the kernel first), and go back to the system when it is
//! freed. In an S = 2048, D = 128 forward on one core that was 5% of the samples (`clear_page`,
//! the fault path, `unmap`), for buffers that are the same size on every call of a model. So a
//! finished call hands its buffers back here and the next one takes them, pages already mapped.
//!
//! Every buffer starts on a cache line ([`super::lines`]): the AMX tile loads of the packed K and V
//! run at a sixth of their rate on rows that straddle two lines.
//!
//! A taken buffer holds whatever the call before wrote (or zeros when new): its user writes every
//! element it reads. At most [`RETAIN_BYTES`] are kept between calls (the largest buffers that fit),
//! so a rare huge call does not pin its memory for the life of the process.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

use super::lines::Lines;

/// What the process-wide pool keeps between calls: a packed K and V of B·Hkv·Sk·D = 32M elements.
const RETAIN_BYTES: usize = 256 << 20;

static POOL: Pool = Pool::new(RETAIN_BYTES);

#[cfg(test)]
thread_local! {
    /// Tests set this to have every buffer this thread takes come filled with NaN: the worst an
    /// earlier call can leave behind.
    pub(crate) static POISON: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Buffers handed back, and how many bytes of them to keep.
pub(crate) struct Pool {
    free: Mutex<Vec<Lines<f32>>>,
    retain_bytes: usize,
}

/// A buffer of exactly the length asked for; back to its pool when dropped.
pub(crate) struct PoolBuf {
    buf: Lines<f32>,
    pool: &'static Pool,
}

/// A buffer of `len` f32 from the process-wide pool, contents unspecified (see the module's notes).
pub(crate) fn take(len: usize) -> PoolBuf {
    POOL.take(len)
}

impl Pool {
    pub(crate) const fn new(retain_bytes: usize) -> Self {
        Self { free: Mutex::new(Vec::new()), retain_bytes }
    }

    fn free(&self) -> std::sync::MutexGuard<'_, Vec<Lines<f32>>> {
        // A panic elsewhere while the lock was held leaves a list of plain buffers: still valid.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn take(&'static self, len: usize) -> PoolBuf {
        let reused = {
            let mut free = self.free();
            // The smallest kept buffer that holds `len` without growing.
            let best = free.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
            best.map(|i| free.swap_remove(i))
        };
        let buf = match reused {
            Some(mut buf) => {
                // Within the capacity: no allocation; new elements (if the length grows) are zeros.
                buf.resize(len);
                buf
            }
            None => Lines::zeroed(len),
        };
        #[cfg(test)]
        let buf = {
            let mut buf = buf;
            if POISON.with(|p| p.get()) {
                buf.fill(f32::NAN);
            }
            buf
        };
        PoolBuf { buf, pool: self }
    }

    fn give_back(&self, buf: Lines<f32>) {
        let bytes = |b: &Lines<f32>| b.capacity() * 4;
        if bytes(&buf) == 0 || bytes(&buf) > self.retain_bytes {
            return;
        }
        let mut free = self.free();
        free.push(buf);
        // Keep the largest buffers within the budget: a model's calls ask for the same sizes,
        // and a large buffer serves a smaller request.
        free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut kept = 0;
        free.retain(|b| {
            kept += bytes(b);
            kept <= self.retain_bytes
        });
    }
}

impl PoolBuf {
    /// The buffer as 16-bit elements (twice as many; same bytes, contents as unspecified).
    pub(crate) fn as_u16(&self) -> &[u16] {
        self.buf.view()
    }

    /// [`PoolBuf::as_u16`], mutable.
    pub(crate) fn as_u16_mut(&mut self) -> &mut [u16] {
        self.buf.view_mut()
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        self.pool.give_back(std::mem::replace(&mut self.buf, Lines::zeroed(0)));
    }
}

impl Deref for PoolBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf
    }
}

impl DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(retain_bytes: usize) -> &'static Pool {
        Box::leak(Box::new(Pool::new(retain_bytes)))
    }

    #[test]
    fn a_returned_buffer_serves_the_next_request_it_holds_and_only_one_at_a_time() {
        let p = pool(1 << 20);
        let mut a = p.take(1000);
        a[999] = 7.0;
        let ptr = a.as_ptr();
        assert_eq!(ptr as usize % super::super::lines::LINE, 0, "buffers start on a cache line");
        drop(a);
        let b = p.take(900);
        assert_eq!((b.len(), b.as_ptr()), (900, ptr), "the kept buffer serves a smaller request");
        let c = p.take(900);
        assert_ne!(c.as_ptr(), ptr, "a taken buffer is not handed out twice");
        assert!(c.iter().all(|&x| x == 0.0), "a new buffer is zeros");
        drop(b);
        // Too small for 2000: a new one.
        assert_ne!(p.take(2000).as_ptr(), ptr);
    }

    #[test]
    fn the_pool_keeps_the_largest_buffers_within_its_budget() {
        let p = pool(4000 * 4);
        // Whole cache lines (16 f32 each), so the capacities are the lengths.
        let (a, b, c) = (p.take(1024), p.take(2496), p.take(5008));
        drop((a, b, c));
        let kept: Vec<usize> = p.free().iter().map(|b| b.capacity()).collect();
        // 5008 is over the budget alone; 2496 + 1024 fit.
        assert_eq!(kept, [2496, 1024]);
    }
}
