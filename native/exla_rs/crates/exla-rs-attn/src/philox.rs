//! Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
//! SC 2011; the Random123 library) and the attention-dropout mask built on it, exactly as
//! `docs/flash-attention-contract.md` ("Dropout") defines them. The Host kernels draw their
//! masks here; the Nx fallback (`lib/exla_rs/attention/philox.ex`), the numpy reference
//! (`test/xla/philox_ref.py`) and the CUDA kernels compute the same bits, and
//! `tests/philox_vectors.rs` checks this module against the table they all share.
//!
//! A counter-based generator: every entry `M[b, h, i, j]` is a pure function of the key and of
//! `(b, h, i, j)`, so any tiling, thread count or platform regenerates the same mask, and the
//! backward regenerates the forward's mask without storing it.

use crate::AttnError;

/// Philox4x32 multipliers (Random123 `PHILOX_M4x32_0`, `PHILOX_M4x32_1`).
pub const M0: u32 = 0xD251_1F53;
pub const M1: u32 = 0xCD9E_8D57;
/// Weyl increments of the key schedule (Random123 `PHILOX_W32_0`, `PHILOX_W32_1`).
pub const W0: u32 = 0x9E37_79B9;
pub const W1: u32 = 0xBB67_AE85;

#[inline(always)]
pub(crate) fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

#[inline(always)]
fn round(c: [u32; 4], k: [u32; 2]) -> [u32; 4] {
    let (hi0, lo0) = mulhilo(M0, c[0]);
    let (hi1, lo1) = mulhilo(M1, c[2]);
    [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0]
}

/// Philox4x32 with 10 rounds: round 0 with `key`, each later round with the key bumped once more
/// by `(W0, W1)` (wrapping), as Random123's `philox4x32_R(10, ctr, key)`.
#[inline]
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = ctr;
    let mut k = key;
    for r in 0..10 {
        if r > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        c = round(c, k);
    }
    c
}

/// Counter word 0 of the second stream (`y`, the draws' lower halves): the first stream's with
/// the top bit set. The contract's `j < 2^34` keeps `j div 8` below it.
pub const LOWER_STREAM: u32 = 1 << 31;

/// The Philox output `x` of the eight mask entries `(b, h, i, 8·oct .. 8·oct + 7)`: counter
/// `(oct, i, h, b)` (oct = j div 8; each index taken as u32). Its halves are the entries' upper
/// 16 bits ([`half`]).
#[inline]
pub fn dropout_upper8(key: [u32; 2], b: u32, h: u32, i: u32, oct: u32) -> [u32; 4] {
    debug_assert!(oct < LOWER_STREAM);
    philox4x32_10([oct, i, h, b], key)
}

/// The Philox output `y` of the same eight entries: counter `(2^31 + oct, i, h, b)`, the entries'
/// lower 16 bits. The kernels need it only where an upper half ties with the threshold's.
#[inline]
pub fn dropout_lower8(key: [u32; 2], b: u32, h: u32, i: u32, oct: u32) -> [u32; 4] {
    debug_assert!(oct < LOWER_STREAM);
    philox4x32_10([LOWER_STREAM | oct, i, h, b], key)
}

/// `half(w, j)`: the 16 bits of an eight-key Philox output that belong to key `j` (half `j mod 2`
/// of word `(j mod 8) div 2`; as eight little-endian u16 the words are in key order).
#[inline]
pub fn half(w: &[u32; 4], j: usize) -> u32 {
    (w[(j >> 1) & 3] >> (16 * (j & 1))) & 0xFFFF
}

/// The u32 draw of mask entry `(b, h, i, j)` (query head `h`, not the key/value head):
/// `half(x, j)·2^16 + half(y, j)`.
#[inline]
pub fn dropout_draw(key: [u32; 2], b: u32, h: u32, i: u32, j: u64) -> u32 {
    debug_assert!(j < 1 << 34, "key index {j} outside the contract's j < 2^34");
    let oct = (j >> 3) as u32;
    let lane = (j & 7) as usize;
    half(&dropout_upper8(key, b, h, i, oct), lane) << 16 | half(&dropout_lower8(key, b, h, i, oct), lane)
}

/// The keep threshold of a rate: `floor(rate · 2^32)`, exact (scaling an f32 by a power of two
/// loses nothing in f64). An entry is kept iff its draw is `>=` it. `rate` must be in `[0, 1)`;
/// rate 0 gives 0 (everything kept), though the contract runs no generator then at all.
#[inline]
pub fn dropout_threshold(rate: f32) -> u32 {
    debug_assert!((0.0..1.0).contains(&rate), "dropout rate {rate} outside [0, 1)");
    (f64::from(rate) * 4_294_967_296.0).floor() as u32
}

/// Whether entry `(b, h, i, j)` is kept (`M = 1`) at `threshold` (`dropout_threshold`).
#[inline]
pub fn dropout_keep(key: [u32; 2], threshold: u32, b: u32, h: u32, i: u32, j: u64) -> bool {
    dropout_draw(key, b, h, i, j) >= threshold
}

/// The factor kept entries are multiplied by: `1 / (1 - rate)`, in f32 as the kernels apply it.
#[inline]
pub fn dropout_keep_scale(rate: f32) -> f32 {
    1.0 / (1.0 - rate)
}

/// The dropout of one call, as the kernels use it: the key, the keep threshold and the scale.
/// Built by `Dropout::from_attributes` from the contract's `has_dropout`, `dropout_rate` and the
/// `dropout_key` operand, with the contract's validity rules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dropout {
    pub key: [u32; 2],
    pub rate: f32,
    /// `dropout_threshold(rate)`: entry kept iff its draw is `>=` this.
    pub threshold: u32,
    /// `dropout_keep_scale(rate)`.
    pub scale: f32,
}

/// The rate part of a call's dropout, without the key's value (on CUDA the key lives in device
/// memory, so the handler decodes this and hands the kernels the key's pointer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutRate {
    pub rate: f32,
    /// `dropout_threshold(rate)`: entry kept iff its draw is `>=` this.
    pub threshold: u32,
    /// `dropout_keep_scale(rate)`.
    pub scale: f32,
}

impl DropoutRate {
    /// The contract's rules for `dropout_rate` and `has_dropout` (`has_key`): `None` for no
    /// dropout (rate 0, no key); INVALID_ARGUMENT for a rate outside `[0, 1)` or NaN, a rate
    /// `> 0` without the key, or the key with rate 0.
    pub fn from_attributes(rate: f32, has_key: bool) -> Result<Option<Self>, AttnError> {
        if !(0.0..1.0).contains(&rate) {
            return Err(AttnError::invalid(format!(
                "attribute `dropout_rate`: expected a rate in [0, 1), got {rate}"
            )));
        }
        match (rate > 0.0, has_key) {
            (false, false) => Ok(None),
            (true, true) => Ok(Some(Self { rate, threshold: dropout_threshold(rate), scale: dropout_keep_scale(rate) })),
            (true, false) => Err(AttnError::invalid(format!(
                "attribute `dropout_rate` is {rate} but `has_dropout` is false (no `dropout_key` operand)"
            ))),
            (false, true) => Err(AttnError::invalid(
                "`has_dropout` is true but attribute `dropout_rate` is 0 (absent or zero)",
            )),
        }
    }

    /// With the key's value: the dropout the Host kernels run.
    pub fn with_key(self, key: [u32; 2]) -> Dropout {
        Dropout { key, rate: self.rate, threshold: self.threshold, scale: self.scale }
    }
}

impl Dropout {
    /// `None` for no dropout (rate 0, no key), the dropout otherwise; INVALID_ARGUMENT for a
    /// rate outside `[0, 1)` or NaN, a rate `> 0` without the key, or the key with rate 0.
    pub fn from_attributes(rate: f32, key: Option<[u32; 2]>) -> Result<Option<Self>, AttnError> {
        Ok(DropoutRate::from_attributes(rate, key.is_some())?.zip(key).map(|(r, k)| r.with_key(k)))
    }

    /// Whether entry `(b, h, i, j)` is kept.
    #[inline]
    pub fn keep(&self, b: u32, h: u32, i: u32, j: u64) -> bool {
        dropout_keep(self.key, self.threshold, b, h, i, j)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Random123 tests/kat_vectors, the three "philox4x32 10" lines (counter[4] key[2] -> out[4]).
    const KAT: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        ([0, 0, 0, 0], [0, 0], [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]),
        ([u32::MAX; 4], [u32::MAX; 2], [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]),
        (
            [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
            [0xa409_3822, 0x299f_31d0],
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
        ),
    ];

    #[test]
    fn random123_known_answers() {
        for (ctr, key, out) in KAT {
            assert_eq!(philox4x32_10(ctr, key), out, "ctr {ctr:x?} key {key:x?}");
        }
    }

    #[test]
    fn draw_is_the_halves_of_the_two_streams() {
        let key = [0x243f_6a88, 0x85a3_08d3];
        let x = philox4x32_10([5, 9, 2, 1], key);
        let y = philox4x32_10([5 | 1 << 31, 9, 2, 1], key);
        for lane in 0..8usize {
            let (hi, lo) = ((x[lane / 2] >> (16 * (lane % 2))) & 0xFFFF, (y[lane / 2] >> (16 * (lane % 2))) & 0xFFFF);
            assert_eq!(dropout_draw(key, 1, 2, 9, 40 + lane as u64), hi << 16 | lo);
        }
        // The top of the j range: j div 8 = 2^31 - 1 in counter word 0, y's word 0 is 2^32 - 1.
        let (x, y) = (philox4x32_10([(1 << 31) - 1, 0, 0, 0], key), philox4x32_10([u32::MAX, 0, 0, 0], key));
        assert_eq!(dropout_draw(key, 0, 0, 0, (1 << 34) - 1), (x[3] >> 16) << 16 | y[3] >> 16);
    }

    #[test]
    fn thresholds() {
        assert_eq!(dropout_threshold(0.0), 0);
        assert_eq!(dropout_threshold(0.5), 1 << 31);
        assert_eq!(dropout_threshold(0.25), 1 << 30);
        assert_eq!(dropout_threshold(1.0 - f32::EPSILON / 2.0), u32::MAX - 255);
        assert_eq!(dropout_threshold(0.1), 0x1999_99a0);
        assert_eq!(dropout_threshold(2f32.powi(-33)), 0);
    }

    #[test]
    fn dropout_from_attributes_follows_the_contract() {
        assert_eq!(Dropout::from_attributes(0.0, None), Ok(None));
        let d = Dropout::from_attributes(0.25, Some([1, 2])).unwrap().unwrap();
        assert_eq!((d.threshold, d.scale, d.key), (1 << 30, 4.0 / 3.0, [1, 2]));
        assert_eq!(d.keep(0, 1, 2, 3), dropout_draw([1, 2], 0, 1, 2, 3) >= 1 << 30);
        for bad in [1.0, 1.5, -0.1, f32::NAN, f32::INFINITY] {
            assert!(matches!(Dropout::from_attributes(bad, Some([0, 0])), Err(AttnError::InvalidArgument(_))), "{bad}");
        }
        assert!(matches!(Dropout::from_attributes(0.1, None), Err(AttnError::InvalidArgument(_))));
        assert!(matches!(Dropout::from_attributes(0.0, Some([0, 0])), Err(AttnError::InvalidArgument(_))));
        assert_eq!(dropout_keep_scale(0.5), 2.0);
    }

    #[test]
    fn kept_fraction_and_heads() {
        // 2^18 entries at rate 0.1: the kept fraction within 4 sigma of 0.9; heads 0 and 1 differ.
        let rate = 0.1f32;
        let t = dropout_threshold(rate);
        let key = [0, 42];
        let (mut kept, mut differ) = (0u64, 0u64);
        let n = 4 * 256 * 256u64;
        for h in 0..4 {
            for i in 0..256 {
                for j in 0..256u64 {
                    let k = dropout_keep(key, t, 0, h, i, j);
                    kept += u64::from(k);
                    if h == 0 && k != dropout_keep(key, t, 0, 1, i, j) {
                        differ += 1;
                    }
                }
            }
        }
        let p = 1.0 - f64::from(rate);
        let sigma = (p * (1.0 - p) / n as f64).sqrt();
        assert!((kept as f64 / n as f64 - p).abs() < 4.0 * sigma, "kept {kept} of {n}");
        assert!(differ > 0);
    }
}
