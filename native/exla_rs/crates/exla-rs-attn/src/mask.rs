//! Which keys a query row sees. Under the contract the visible set of a row is always one
//! contiguous interval of key positions, so every backend works with `[start, end)` ranges
//! instead of evaluating a mask per element.

use crate::AttnOptions;

/// The half-open interval of keys `[start, end)` visible to one query row; empty when
/// `start >= end` (a fully masked row: `lse = -inf`, `o = 0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRange {
    pub start: usize,
    pub end: usize,
}

impl KeyRange {
    /// visible(i, j) ⇔ j < kv_len ∧ (wl < 0 ∨ j >= q_start + i - wl) ∧ (wr < 0 ∨ j <= q_start + i + wr),
    /// intersected with the keys that exist, `[0, seq_k)`. `kv_len` outside `[0, seq_k]` is clamped
    /// so no backend ever reads past the key buffers.
    pub fn for_row(opts: &AttnOptions, seq_k: usize, kv_len: i32, q_start: i32, row: usize) -> Self {
        let pos = q_start as i64 + row as i64;
        let mut lo: i64 = 0;
        let mut hi: i64 = (kv_len as i64).clamp(0, seq_k as i64);
        if opts.window_left >= 0 {
            lo = lo.max(pos.saturating_sub(opts.window_left));
        }
        if opts.window_right >= 0 {
            hi = hi.min(pos.saturating_add(opts.window_right).saturating_add(1));
        }
        if lo >= hi {
            return Self { start: 0, end: 0 };
        }
        Self { start: lo as usize, end: hi as usize }
    }

    /// Keys visible to any of the rows `[row0, row1)`: the union of their ranges, which is again an
    /// interval because both bounds are monotone in the row. Used to skip whole key tiles.
    pub fn for_rows(opts: &AttnOptions, seq_k: usize, kv_len: i32, q_start: i32, row0: usize, row1: usize) -> Self {
        if row0 >= row1 {
            return Self { start: 0, end: 0 };
        }
        let first = Self::for_row(opts, seq_k, kv_len, q_start, row0);
        let last = Self::for_row(opts, seq_k, kv_len, q_start, row1 - 1);
        if !first.is_empty() && !last.is_empty() {
            // Both bounds are non-decreasing in the row and consecutive rows' ranges touch, so the
            // union of the rows in between is exactly [first.start, last.end).
            return Self { start: first.start, end: last.end };
        }
        // An empty end row (a window that slides past kv_len, a q_start before the keys) says
        // nothing about the rows in between: take the union row by row.
        (row0..row1)
            .map(|r| Self::for_row(opts, seq_k, kv_len, q_start, r))
            .fold(Self { start: 0, end: 0 }, Self::union)
    }

    pub fn is_empty(&self) -> bool {
        self.start >= self.end
    }

    pub fn len(&self) -> usize {
        self.end.saturating_sub(self.start)
    }

    fn union(self, other: Self) -> Self {
        match (self.is_empty(), other.is_empty()) {
            (true, _) => other,
            (_, true) => self,
            _ => Self { start: self.start.min(other.start), end: self.end.max(other.end) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(wl: i64, wr: i64) -> AttnOptions {
        AttnOptions { scale: 1.0, softcap: 0.0, window_left: wl, window_right: wr }
    }

    fn brute(o: &AttnOptions, sk: usize, kv: i32, qs: i32, i: usize) -> Vec<usize> {
        (0..sk)
            .filter(|&j| {
                let (j, p) = (j as i64, qs as i64 + i as i64);
                j < kv as i64
                    && (o.window_left < 0 || j >= p - o.window_left)
                    && (o.window_right < 0 || j <= p + o.window_right)
            })
            .collect()
    }

    #[test]
    fn row_ranges_match_the_contract_predicate() {
        for &(wl, wr) in &[(-1, -1), (-1, 0), (3, 0), (2, 5), (0, 0), (-1, 2), (4, -1)] {
            for kv in [-3, 0, 1, 7, 13, 40] {
                for qs in [-20, -5, 0, 3, 12, 30] {
                    let o = opts(wl, wr);
                    for i in 0..16 {
                        let r = KeyRange::for_row(&o, 13, kv, qs, i);
                        let got: Vec<usize> = (r.start..r.end).collect();
                        assert_eq!(got, brute(&o, 13, kv, qs, i), "wl={wl} wr={wr} kv={kv} qs={qs} i={i}");
                    }
                    for r0 in 0..16 {
                        for r1 in r0..=16 {
                            let u = KeyRange::for_rows(&o, 13, kv, qs, r0, r1);
                            let mut all: Vec<usize> = (r0..r1).flat_map(|i| brute(&o, 13, kv, qs, i)).collect();
                            all.sort();
                            all.dedup();
                            if all.is_empty() {
                                assert!(u.is_empty());
                            } else {
                                assert!(u.start <= all[0] && u.end > *all.last().unwrap());
                            }
                        }
                    }
                }
            }
        }
    }
}
