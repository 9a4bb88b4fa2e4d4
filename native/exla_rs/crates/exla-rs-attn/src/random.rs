//! Seeded random inputs for the benchmarks and the tests that compare two schedules of the same
//! kernels (xorshift64: cheap, reproducible, not for the mask: dropout draws are `philox`'s).

/// `n` floats uniform in `[-1, 1)` (24-bit steps) from the xorshift64 stream of `seed`.
pub fn uniform_pm1(n: usize, seed: u64) -> Vec<f32> {
    // Scramble the seed so small seeds (0, 1, 2, ...) start far apart; xorshift needs x != 0.
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn uniform_pm1_is_seeded_and_in_range() {
        let (a, b) = (super::uniform_pm1(1000, 7), super::uniform_pm1(1000, 8));
        assert_eq!(a, super::uniform_pm1(1000, 7));
        assert_ne!(a, b);
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.1, "{mean}");
    }
}
