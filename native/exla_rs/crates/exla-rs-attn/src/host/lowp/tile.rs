//! The AMX tile configuration (palette 1) the lowp kernels use, shared by the real AMX unit
//! (`ldtilecfg` reads [`TileConfig::bytes`]) and the model (which reads the same shapes).
//!
//! Palette 1 has 8 tile registers `tmm0..tmm7` of at most 16 rows × 64 bytes. All eight are
//! configured full size: a C tile is 16 × 16 f32, an A tile 16 rows × 32 16-bit elements (16
//! pairs), a B tile 16 pair-rows × 16 columns × 2 elements (VNNI layout). A one-block product uses
//! `tmm0` = C, `tmm1` = A, `tmm2` = B; the 2 × 2 block product (`amx.rs`) keeps four C tiles
//! (`tmm0..tmm3`) resident and streams two A (`tmm4`, `tmm5`) and two B (`tmm6`, `tmm7`), so four
//! independent `TDP*` chains hide the instruction's latency and each tile load feeds two products.

/// Rows of every tile (and of the C block one tile product writes).
pub(crate) const TILE_M: usize = 16;
/// f32 columns of C per tile product (64 bytes).
pub(crate) const TILE_N: usize = 16;
/// 16-bit elements of the reduction per tile product: 16 pairs (64 bytes of an A row).
pub(crate) const TILE_K: usize = 32;

/// The tile registers palette 1 has.
pub(crate) const TILES: usize = 8;
/// The register numbers of the three operands.
pub(crate) const TMM_C: usize = 0;
pub(crate) const TMM_A: usize = 1;
pub(crate) const TMM_B: usize = 2;

/// One `ldtilecfg` operand: palette, start row, and per tile its rows and bytes per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TileConfig {
    pub palette: u8,
    pub start_row: u8,
    pub colsb: [u16; TILES],
    pub rows: [u8; TILES],
}

impl TileConfig {
    /// Every tile full size (16 × 64 bytes).
    pub(crate) const fn lowp() -> Self {
        let mut colsb = [0u16; TILES];
        let mut rows = [0u8; TILES];
        let mut t = 0;
        while t < TILES {
            colsb[t] = (TILE_K * 2) as u16;
            rows[t] = TILE_M as u8;
            t += 1;
        }
        Self { palette: 1, start_row: 0, colsb, rows }
    }

    /// The 64-byte memory image `ldtilecfg` reads: byte 0 palette, byte 1 start row, bytes
    /// 16..32 `colsb` (u16 little-endian per tile), bytes 48..56 `rows`; the rest 0 (reserved).
    pub(crate) fn bytes(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0] = self.palette;
        b[1] = self.start_row;
        for t in 0..TILES {
            b[16 + 2 * t..18 + 2 * t].copy_from_slice(&self.colsb[t].to_le_bytes());
            b[48 + t] = self.rows[t];
        }
        b
    }

    /// (rows, bytes per row) of tile `t`.
    pub(crate) fn shape(&self, t: usize) -> (usize, usize) {
        (self.rows[t] as usize, self.colsb[t] as usize)
    }
}

/// The configuration every lowp tile product runs under.
pub(crate) const LOWP_TILES: TileConfig = TileConfig::lowp();
