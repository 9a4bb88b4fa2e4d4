//! Packing the operands into the units' layouts ([`super::unit`]): 16-bit elements, the
//! reduction padded with zeros to a multiple of [`TILE_K`], B operands in VNNI panels.
//!
//! Per (batch, kv head), for key tiles of [`BC`] keys and head dim padded to `dp`:
//! - `kt` (B of `S = Q·Kᵀ`, reduction over d): tile `t`, key panel `p` (16 keys), pair-row `r`
//!   (d = 2r, 2r+1), key `n` of the panel, element `e`:
//!   `kt[(((t·BC/16 + p)·dp/2 + r)·16 + n)·2 + e] = k[t·BC + 16p + n][2r + e]`.
//! - `vt` (B of `O += P·V`, reduction over keys): tile `t`, d panel `p` (16 columns of d),
//!   pair-row `r` (keys 2r, 2r+1 of the tile), column `n`, element `e`:
//!   `vt[(((t·dp/16 + p)·BC/2 + r)·16 + n)·2 + e] = v[t·BC + 2r + e][16p + n]`.
//!
//! Keys past `Sk` and d past `D` are 0, so they add nothing (0·0) to any product.

use super::super::HostElement;
use super::model::Half16;
use super::tile::{TILE_K, TILE_N};

/// Keys per tile: a multiple of [`TILE_K`] (P·V's reduction) and of [`TILE_N`] (S's columns).
pub(crate) const BC: usize = 64;

/// `x` (a value of type `elem`, or any f32 for P) as `elem`'s bits, rounded to nearest even.
#[inline]
pub(crate) fn bits(elem: Half16, x: f32) -> u16 {
    match elem {
        Half16::Bf16 => half::bf16::from_f32(x).to_bits(),
        Half16::F16 => half::f16::from_f32(x).to_bits(),
    }
}

/// The value of `elem`'s bits, exactly (no flushing: this is the input, not a unit's view).
#[inline]
pub(crate) fn value(elem: Half16, x: u16) -> f32 {
    match elem {
        Half16::Bf16 => half::bf16::from_bits(x).to_f32(),
        Half16::F16 => half::f16::from_bits(x).to_f32(),
    }
}

/// Head dim padded to the units' reduction step (also a multiple of [`TILE_N`]).
pub(crate) fn padded_dim(d: usize) -> usize {
    d.div_ceil(TILE_K) * TILE_K
}

/// `K` of one (batch, kv head) into `kt` (`ntk·BC·dp` elements, zeroed by the caller);
/// `row(j)` is key `j`'s `d` elements.
pub(crate) fn pack_kt<'a, T: HostElement>(elem: Half16, kt: &mut [u16], sk: usize, d: usize, dp: usize, row: impl Fn(usize) -> &'a [T]) {
    for j in 0..sk {
        let (t, p, n) = (j / BC, (j % BC) / TILE_N, j % TILE_N);
        let panel = &mut kt[(t * BC / TILE_N + p) * dp * TILE_N..][..dp * TILE_N];
        for (dd, x) in row(j)[..d].iter().enumerate() {
            panel[((dd / 2) * TILE_N + n) * 2 + dd % 2] = bits(elem, x.to_f32());
        }
    }
}

/// `V` of one (batch, kv head) into `vt` (`ntk·BC·dp` elements, zeroed by the caller).
pub(crate) fn pack_vt<'a, T: HostElement>(elem: Half16, vt: &mut [u16], sk: usize, d: usize, dp: usize, row: impl Fn(usize) -> &'a [T]) {
    for j in 0..sk {
        let (t, r, e) = (j / BC, (j % BC) / 2, j % 2);
        let tile = &mut vt[t * BC * dp..][..BC * dp];
        for (dd, x) in row(j)[..d].iter().enumerate() {
            let (p, n) = (dd / TILE_N, dd % TILE_N);
            tile[((p * BC / 2 + r) * TILE_N + n) * 2 + e] = bits(elem, x.to_f32());
        }
    }
}

/// Element (key `jt` of the tile, column `dd`) of a packed V tile.
#[inline]
pub(crate) fn vt_at(vt_tile: &[u16], jt: usize, dd: usize) -> u16 {
    let (p, n, r, e) = (dd / TILE_N, dd % TILE_N, jt / 2, jt % 2);
    vt_tile[((p * BC / 2 + r) * TILE_N + n) * 2 + e]
}
