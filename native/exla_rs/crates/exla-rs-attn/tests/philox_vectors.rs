//! `exla_rs_attn::philox` against `test/data/dropout_vectors.txt`, the table the numpy reference
//! (`test/xla/philox_ref.py`, which writes it) and the Nx fallback are checked against too: the
//! three implementations draw the same bits for the same (key, b, h, i, j), and agree on the
//! keep threshold and the f32 keep scale of a rate.

use exla_rs_attn::philox::{dropout_draw, dropout_keep_scale, dropout_threshold};

const VECTORS: &str = include_str!("../../../../../test/data/dropout_vectors.txt");

fn hex(s: &str) -> u64 {
    u64::from_str_radix(s, 16).unwrap_or_else(|e| panic!("bad hex {s:?}: {e}"))
}

#[test]
fn draws_and_thresholds_match_the_shared_table() {
    let (mut draws, mut thresholds, mut scales) = (0, 0, 0);
    for line in VECTORS.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        match f[0] {
            "draw" => {
                let v: Vec<u64> = f[1..].iter().map(|s| hex(s)).collect();
                let got = dropout_draw([v[0] as u32, v[1] as u32], v[2] as u32, v[3] as u32, v[4] as u32, v[5]);
                assert_eq!(u64::from(got), v[6], "{line}");
                draws += 1;
            }
            "threshold" => {
                let rate = f32::from_bits(hex(f[1]) as u32);
                assert_eq!(u64::from(dropout_threshold(rate)), hex(f[2]), "{line}");
                thresholds += 1;
            }
            "scale" => {
                let rate = f32::from_bits(hex(f[1]) as u32);
                assert_eq!(dropout_keep_scale(rate).to_bits(), hex(f[2]) as u32, "{line}");
                scales += 1;
            }
            other => panic!("unknown line kind {other:?}"),
        }
    }
    assert!(draws >= 2000 && thresholds >= 10 && scales >= 10, "{draws} draws, {thresholds} thresholds, {scales} scales");
}
