//! `EXLA_RS_DETERMINISTIC`: the CUDA backward with its sums in a fixed order, so that one
//! configuration gives the same bits on every run (PyTorch's `use_deterministic_algorithms`, XLA's
//! `--xla_gpu_deterministic_ops`).
//!
//! The tensor-core backwards (mma.sync and sm90) give each key block its own thread block, and
//! every key block adds its partial dQ into one f32 accumulator with atomics (`red.global.add`):
//! the key blocks of one (kv head, batch) run side by side, so the order in which they add into
//! an element, and with it the f32 rounding of the sum, changes from run to run. With the setting
//! on, the mma.sync backward is launched once per key block (`BwdParams::kb_first`), each launch
//! taking that key block of every (kv head, batch): an element's additions come in key-block
//! order, one launch after the other on the stream. Within a thread block each dQ element gets
//! one addition, and different (kv head, batch) blocks of a launch add into different elements.
//!
//! Launch `r` is `r + 1` blocks wide so that `blockIdx.x` stays the key block and the kernel's
//! code stays the default mode's: its first `r` blocks return at once (`BwdParams::kb_first`),
//! about `B·Hkv·n²/2` empty blocks over `n` key blocks.
//!
//! The price is parallelism: `B·Hkv` thread blocks per launch, `ceil(Sk / kBlockN)` launches in
//! a row, where the default runs all `B·Hkv·ceil(Sk / kBlockN)` at once: little where `B·Hkv`
//! fills the GPU (training batches), a multiple of the default's time for a small batch of few kv
//! heads (not yet timed on hardware).
//! - The f32 backward (SIMT kernels) has no atomics: deterministic either way.
//! - The sm90 backward has no such mode: the setting routes every backward to mma.sync.
//! - dbias: an element of a bias broadcast over a dimension (a size-1 dim where the call's is
//!   larger) is the sum of several products added by atomics in one launch, so such a call is
//!   refused while the setting is on; a full-size bias's dbias has one addition per element.
//!
//! Read at every backward call (as `EXLA_RS_CUDA_PATH` is), so a program can switch it between
//! calls. The forward needs nothing: it has no atomics (the split-KV combine sums the splits in
//! order).

use exla_rs_attn::{AttnError, AttnShape};

use crate::BiasBuffer;

/// The environment variable.
pub const VAR: &str = "EXLA_RS_DETERMINISTIC";

/// The setting: unset, empty, `0`, `false`, `off` = off; `1`, `true`, `on` = on; anything else
/// is an error naming what it accepts.
pub fn parse(value: Option<&str>) -> Result<bool, String> {
    match value.map(str::trim) {
        None | Some("" | "0" | "false" | "off") => Ok(false),
        Some("1" | "true" | "on") => Ok(true),
        Some(other) => Err(format!("{VAR}={other:?}: expected 1/true/on or 0/false/off")),
    }
}

/// The setting as this call sees it.
pub fn enabled() -> Result<bool, AttnError> {
    parse(std::env::var(VAR).ok().as_deref()).map_err(AttnError::invalid)
}

/// Refuses a deterministic backward whose dbias sums over a broadcast bias dimension.
pub fn check_dbias(bias: &BiasBuffer, shape: &AttnShape) -> Result<(), AttnError> {
    let call = [shape.batch, shape.heads, shape.seq_q, shape.seq_k];
    let names = ["batch", "heads", "query", "key"];
    let broadcast: Vec<&str> = (0..4).filter(|&i| bias.dims[i] == 1 && call[i] > 1).map(|i| names[i]).collect();
    if broadcast.is_empty() {
        return Ok(());
    }
    Err(AttnError::invalid(format!(
        "{VAR} is on, but dbias of this bias (dims {:?}) sums over its broadcast {} dimension(s) with atomics, in no fixed order; \
         pass a full-size bias, or unset {VAR} for this call",
        bias.dims,
        broadcast.join(", ")
    )))
}

/// The line `ExlaRs.status()` shows.
pub fn summary() -> String {
    match enabled() {
        Ok(true) => format!("deterministic backward ({VAR}=1): mma.sync, one key block per launch; dQ and dbias sums in key-block order"),
        Ok(false) => format!("backward sums by atomics, in no fixed order ({VAR}=1 makes them deterministic)"),
        Err(e) => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use exla_rs_attn::ElementType;

    #[test]
    fn parse_accepts_the_documented_spellings_and_names_the_rest() {
        for v in [None, Some(""), Some("0"), Some("false"), Some(" off ")] {
            assert_eq!(parse(v), Ok(false), "{v:?}");
        }
        for v in ["1", "true", "on"] {
            assert_eq!(parse(Some(v)), Ok(true), "{v}");
        }
        let e = parse(Some("yes")).unwrap_err();
        assert!(e.contains("EXLA_RS_DETERMINISTIC=\"yes\"") && e.contains("1/true/on"), "{e}");
    }

    #[test]
    fn dbias_of_a_broadcast_bias_is_refused() {
        let shape = AttnShape { batch: 2, seq_q: 10, seq_k: 12, heads: 4, kv_heads: 2, head_dim: 64 };
        let bias = |dims| BiasBuffer { ptr: 0, dtype: ElementType::F32, dims };
        assert!(check_dbias(&bias([2, 4, 10, 12]), &shape).is_ok());
        let e = check_dbias(&bias([1, 4, 10, 12]), &shape).unwrap_err().to_string();
        assert!(e.contains("batch") && e.contains("EXLA_RS_DETERMINISTIC"), "{e}");
        let e = check_dbias(&bias([2, 1, 1, 12]), &shape).unwrap_err().to_string();
        assert!(e.contains("heads, query"), "{e}");
        // A size-1 dim of a size-1 call dim is no broadcast.
        let one = AttnShape { batch: 1, ..shape };
        assert!(check_dbias(&bias([1, 4, 10, 12]), &one).is_ok());
    }
}
