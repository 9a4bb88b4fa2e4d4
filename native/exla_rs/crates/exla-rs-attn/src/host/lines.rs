//! Buffers that start on a 64-byte cache line: what the AMX tile loads and stores, and the
//! 512-bit vector loads, read and write.
//!
//! A `Vec<u16>` or `Vec<f32>` from the system allocator starts 16 bytes past a line as often as
//! not. Then every 64-byte row of an AMX tile straddles two lines, and on the one AMX machine
//! measured (an Emerald Rapids KVM guest) a `TILELOADD` of such rows took about 44 cycles where
//! a line-aligned one takes about 7: the 2 × 2 block product ran at 770 GFLOP/s instead of 1625
//! (`host_bench peak` prints both). Row strides that are whole lines keep every row aligned
//! once the first is; the lowp kernels' strides all are (their padded widths are multiples of
//! 32 elements, or of 16 f32).

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One cache line of storage; `Vec<Line>` is what gives the alignment.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; LINE]);

/// Bytes per cache line.
pub(crate) const LINE: usize = 64;

/// An element type a [`Lines`] may hold.
///
/// # Safety
/// Every bit pattern is a valid value (the buffer's bytes are reinterpreted), and the type's
/// size and alignment divide [`LINE`].
pub(crate) unsafe trait Plain: Copy + Send + Sync + 'static {}
// SAFETY: plain numbers: every bit pattern is a value, sizes 2 and 4.
unsafe impl Plain for u16 {}
unsafe impl Plain for f32 {}

/// `len` elements of `T` starting on a cache line; the rest of the last line is padding.
pub(crate) struct Lines<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _elem: PhantomData<T>,
}

impl<T: Plain> Lines<T> {
    const PER_LINE: usize = LINE / std::mem::size_of::<T>();

    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self { lines: vec![Line([0; LINE]); len.div_ceil(Self::PER_LINE)], len, _elem: PhantomData }
    }

    /// Elements this buffer holds without reallocating.
    pub(crate) fn capacity(&self) -> usize {
        self.lines.capacity() * Self::PER_LINE
    }

    /// Makes the length `len`: elements kept keep their values, new lines are zeros.
    pub(crate) fn resize(&mut self, len: usize) {
        self.lines.resize(len.div_ceil(Self::PER_LINE), Line([0; LINE]));
        self.len = len;
    }

    /// The same bytes as another element type (`len` scaled by the sizes; the padding past
    /// `len` is not included).
    pub(crate) fn view<U: Plain>(&self) -> &[U] {
        let bytes = self.len * std::mem::size_of::<T>();
        // SAFETY: as in `view_mut`, shared.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<U>(), bytes / std::mem::size_of::<U>()) }
    }

    /// [`Lines::view`], mutable.
    pub(crate) fn view_mut<U: Plain>(&mut self) -> &mut [U] {
        let bytes = self.len * std::mem::size_of::<T>();
        // SAFETY: the lines hold at least `bytes` bytes, aligned to 64 (≥ U's alignment); every
        // bit pattern is a valid U (`Plain`); the borrow of self keeps them alive and unaliased.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<U>(), bytes / std::mem::size_of::<U>()) }
    }
}

impl<T: Plain> Deref for Lines<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` elements fit in the lines (`zeroed`, `resize`), aligned for T; every
        // bit pattern is a valid T.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for Lines<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes the view unique.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_holds_what_is_written() {
        for len in [0, 1, 15, 16, 17, 33, 1000] {
            let mut b = Lines::<f32>::zeroed(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0.0));
            assert_eq!(b.as_ptr() as usize % LINE, 0);
            for (i, x) in b.iter_mut().enumerate() {
                *x = i as f32;
            }
            b.resize(len + 20);
            assert!(b[..len].iter().enumerate().all(|(i, &x)| x == i as f32) && b[len..].iter().all(|&x| x == 0.0));
            assert_eq!(b.view_mut::<u16>().len(), 2 * (len + 20));
            let h = Lines::<u16>::zeroed(len);
            assert_eq!(h.as_ptr() as usize % LINE, 0);
        }
    }
}
