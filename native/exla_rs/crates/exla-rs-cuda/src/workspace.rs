//! The trailing `u8[N]` workspace result of a call: what it holds (a padded call's copies,
//! config.rs's `pad_layout`; the backward's delta and dQ accumulator; the split-KV forward's
//! partials, split.rs) and so its size, or why CUDA has no kernel for the configuration.

use crate::config::{bwd_workspace_layout, check_supported, pad_layout};
use crate::split;
use exla_rs_attn::{AttnShape, ElementType, Pass};

/// Bytes of the trailing workspace result, or why CUDA has no kernel for the configuration.
pub fn workspace_requirement(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Result<usize, String> {
    check_supported(dtype, shape)?;
    if let Some(pad) = pad_layout(pass, dtype, shape) {
        return Ok(pad.end + split_workspace(pass, dtype, &AttnShape { head_dim: pad.head_dim, ..*shape }));
    }
    Ok(match pass {
        Pass::Forward => split_workspace(pass, dtype, shape),
        // With no query rows both parts are 0: the kernels never touch scratch then.
        Pass::Backward => {
            let (delta, accum) = bwd_workspace_layout(dtype, shape);
            delta + accum
        }
    })
}

/// The split-KV forward's partials (src/split.rs), sized for the kernel shape; they start at
/// [`split_workspace_offset`].
fn split_workspace(pass: Pass, dtype: ElementType, kernel_shape: &AttnShape) -> usize {
    match pass {
        Pass::Forward => split::workspace_bytes(dtype, kernel_shape),
        Pass::Backward => 0,
    }
}

/// Where the forward's split-KV partials start in the workspace: after a padded call's copies.
pub fn split_workspace_offset(dtype: ElementType, shape: &AttnShape) -> usize {
    pad_layout(Pass::Forward, dtype, shape).map_or(0, |p| p.end)
}

/// [`workspace_requirement`] without the reason: None when unsupported.
pub fn workspace_bytes(pass: Pass, dtype: ElementType, shape: &AttnShape) -> Option<usize> {
    workspace_requirement(pass, dtype, shape).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{head_dims_summary, kernel_head_dim, HEAD_DIMS};

    fn shape(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> AttnShape {
        AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d }
    }

    #[test]
    fn every_head_dim_up_to_256_is_supported_natively_or_padded() {
        for dtype in [ElementType::F32, ElementType::F16, ElementType::BF16] {
            for d in 1..=256 {
                let s = shape(2, 100, 130, 4, 2, d);
                let fwd = workspace_bytes(Pass::Forward, dtype, &s);
                let bwd = workspace_bytes(Pass::Backward, dtype, &s);
                if HEAD_DIMS.contains(&d) {
                    assert_eq!(kernel_head_dim(d), Some(d));
                    assert_eq!(pad_layout(Pass::Forward, dtype, &s), None);
                    assert_eq!(fwd, Some(0), "{dtype} d={d}");
                    let (delta, accum) = bwd_workspace_layout(dtype, &s);
                    assert_eq!(delta, (2 * 4 * 100 * 4usize).div_ceil(256) * 256);
                    assert_eq!(bwd, Some(delta + accum));
                    let want_accum = if dtype == ElementType::F32 { 0 } else { 2 * 100 * 4 * d * 4 };
                    assert_eq!(accum, want_accum);
                } else {
                    let dk = kernel_head_dim(d).unwrap();
                    assert!(dk > d && HEAD_DIMS.contains(&dk) && HEAD_DIMS.iter().all(|&k| k < d || k >= dk), "d={d} -> {dk}");
                    let f = pad_layout(Pass::Forward, dtype, &s).unwrap();
                    let b = pad_layout(Pass::Backward, dtype, &s).unwrap();
                    assert_eq!((fwd, bwd), (Some(f.end), Some(b.end)), "{dtype} d={d}");
                }
            }
            for d in [0, 257, 300] {
                let s = shape(2, 100, 130, 4, 2, d);
                assert_eq!(kernel_head_dim(d), None);
                assert_eq!(workspace_bytes(Pass::Forward, dtype, &s), None);
                let e = check_supported(dtype, &s).unwrap_err();
                assert!(e.contains(&format!("D={d}")) && e.contains("[32, 64, 96, 128, 192, 256]"), "{e}");
            }
        }
        assert_eq!([40, 80, 160, 72, 8, 1, 33, 255].map(|d| kernel_head_dim(d).unwrap()), [64, 96, 192, 96, 32, 32, 64, 256]);
        assert!(head_dims_summary().contains("native: D = 32, 64, 96, 128, 192, 256"), "{}", head_dims_summary());
    }


    #[test]
    fn padded_workspace_holds_every_copy_aligned_after_the_kernels_scratch() {
        let a = |n: usize| n.div_ceil(256) * 256;
        // B=2, Sq=100, Sk=130, H=4, Hkv=2, D=80 -> Dk=96.
        let s = shape(2, 100, 130, 4, 2, 80);
        for dtype in [ElementType::F32, ElementType::F16, ElementType::BF16] {
            let e = dtype.size_bytes();
            let (qb, kvb) = (a(2 * 100 * 4 * 96 * e), a(2 * 130 * 2 * 96 * e));
            let f = pad_layout(Pass::Forward, dtype, &s).unwrap();
            assert_eq!(f.head_dim, 96);
            assert_eq!((f.q, f.k, f.v, f.o, f.end), (0, qb, qb + kvb, qb + 2 * kvb, 2 * qb + 2 * kvb), "{dtype}");
            assert_eq!((f.d_o, f.dq, f.dk, f.dv), (0, 0, 0, 0));
            assert_eq!(workspace_bytes(Pass::Forward, dtype, &s), Some(f.end));

            // The backward: the kernels' scratch for Dk first (delta, dq accumulator at 96
            // columns), then q, k, v, o, do, dq, dk, dv.
            let padded = AttnShape { head_dim: 96, ..s };
            let (delta, accum) = bwd_workspace_layout(dtype, &padded);
            assert_eq!(accum, if dtype == ElementType::F32 { 0 } else { 2 * 100 * 4 * 96 * 4 });
            let b = pad_layout(Pass::Backward, dtype, &s).unwrap();
            let start = a(delta + accum);
            assert_eq!(b.q, start);
            assert_eq!([b.k, b.v, b.o, b.d_o, b.dq, b.dk, b.dv, b.end], {
                let mut at = start + qb;
                [kvb, kvb, qb, qb, qb, kvb, kvb, 0].map(|n| {
                    let here = at;
                    at += n;
                    here
                })
            });
            assert_eq!(b.end, start + 4 * qb + 4 * kvb);
            assert_eq!(workspace_bytes(Pass::Backward, dtype, &s), Some(b.end));
            for off in [b.q, b.k, b.v, b.o, b.d_o, b.dq, b.dk, b.dv, b.end] {
                assert_eq!(off % 256, 0, "{dtype}: {b:?}");
            }
            // Rows of the padded copies keep the kernels' 16-byte rule.
            assert_eq!((96 * e) % 16, 0);
        }
        // dbias follows the whole base: the launcher puts its accumulator at workspace_bytes.
        // Empty shapes: the copies of an empty tensor take no bytes, the others still do.
        let s = shape(2, 0, 130, 4, 2, 40);
        let f = pad_layout(Pass::Forward, ElementType::BF16, &s).unwrap();
        assert_eq!((f.q, f.k, f.end), (0, 0, 2 * a(2 * 130 * 2 * 64 * 2)));
        assert_eq!(pad_layout(Pass::Forward, ElementType::BF16, &shape(0, 5, 5, 1, 1, 40)).unwrap().end, 0);
        // Huge K/V row counts are refused rather than overflowing the sizes.
        let huge = shape(60_000, 1, 1 << 30, 64, 64, 80);
        assert!(check_supported(ElementType::BF16, &huge).unwrap_err().contains("B*Sk*Hkv"));
    }


    #[test]
    fn grid_limits_are_unsupported_not_errors_at_launch() {
        let s = shape(70_000, 1, 1, 1, 1, 64);
        assert_eq!(workspace_bytes(Pass::Forward, ElementType::BF16, &s), None);
        assert!(check_supported(ElementType::BF16, &s).unwrap_err().contains("65535"));
    }


    #[test]
    fn empty_queries_need_no_workspace() {
        let s = shape(2, 0, 16, 4, 4, 64);
        assert_eq!(workspace_bytes(Pass::Backward, ElementType::F16, &s), Some(0));
    }
}
