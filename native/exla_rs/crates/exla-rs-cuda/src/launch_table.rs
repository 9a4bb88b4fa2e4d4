//! Every kernel this crate can launch, with the block size and dynamic shared memory its launch
//! asks for: the figures `kernels/sass_stats.py` shows beside each image's registers (issue 33
//! part 3) and checks against each architecture's per-block limit. The figures come from the
//! launch code itself (`forward_plan`, `backward_plan`, the split-KV plan, the sm90 forward and backward), so
//! the table is what a call really asks the driver for, not a second copy of the formulas.
//! `examples/launch_table.rs` prints it.

use crate::config::{backward_plan, forward_plan, pad_launch, FeatureSet, Launch, HEAD_DIMS};
use crate::{sm90, sm90_bwd, split};
use exla_rs_attn::{AttnShape, ElementType};

/// One kernel's launch figures. `smem` is the largest any of its launches asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelLaunch {
    pub file: &'static str,
    pub kernel: &'static str,
    pub threads: u32,
    pub smem: u32,
}

/// Every (file, kernel) the launch code can name, sorted by kernel name.
pub fn every_launch() -> Vec<KernelLaunch> {
    let mut launches: Vec<Launch> = Vec::new();
    for dtype in [ElementType::F16, ElementType::BF16, ElementType::F32] {
        for d in HEAD_DIMS {
            // A shape every plan accepts; the figures do not depend on it (grids do).
            let s = AttnShape { batch: 1, seq_q: 256, seq_k: 256, heads: 2, kv_heads: 1, head_dim: d };
            for f in FeatureSet::ALL {
                launches.push(forward_plan(dtype, &s, f));
                launches.extend(backward_plan(dtype, &s, f, Some(64)));
                // Two splits: the split kernel and its combine pass.
                launches.extend(split::plan(dtype, &s, f, 2));
            }
            // The sm90 backward's feature sets.
            for f in FeatureSet::ALL {
                if let Some((file, kernel)) = sm90_bwd::sm90_backward_kernel(dtype, d, f) {
                    launches.push(Launch { file, kernel, grid: (1, 1, 1), block: sm90_bwd::THREADS, smem: sm90_bwd::bwd_smem_bytes(d, f) });
                }
            }
            // The sm90 forward's feature sets (D = 256 has no dropout set).
            for f in FeatureSet::ALL {
                if let Some(kernel) = sm90::sm90_forward_kernel_for(dtype, d, f) {
                    let file = kernel.strip_prefix("exla_rs_").expect("sm90 kernels are named exla_rs_<file>");
                    launches.push(Launch { file, kernel, grid: (1, 1, 1), block: sm90::fwd_tiles(d).threads, smem: sm90::fwd_smem_bytes(d) });
                }
            }
        }
    }
    launches.extend([pad_launch(2, 1), pad_launch(4, 1)]);
    let mut table: Vec<KernelLaunch> = Vec::new();
    for l in launches {
        match table.iter_mut().find(|k| k.kernel == l.kernel) {
            Some(k) => {
                assert_eq!((k.file, k.threads), (l.file, l.block), "{}: one kernel, one file and block size", l.kernel);
                k.smem = k.smem.max(l.smem);
            }
            None => table.push(KernelLaunch { file: l.file, kernel: l.kernel, threads: l.block, smem: l.smem }),
        }
    }
    table.sort_by(|a, b| a.kernel.cmp(b.kernel));
    table
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::embedded::KERNEL_FILES;

    #[test]
    fn every_launched_file_is_built_and_every_built_file_is_launched() {
        let table = every_launch();
        for k in &table {
            assert!(KERNEL_FILES.iter().any(|f| f.name == k.file), "{} names file {}, which the build does not carry", k.kernel, k.file);
        }
        for f in KERNEL_FILES {
            assert!(table.iter().any(|k| k.file == f.name), "kernels/{}.cu is built but no launch names it", f.name);
        }
    }

    #[test]
    fn the_tensor_core_kernels_ask_for_their_tiles() {
        let table = every_launch();
        let find = |name: &str| table.iter().find(|k| k.kernel == name).unwrap_or_else(|| panic!("{name} missing"));
        // FwdTraits<128>: 8 warps, 128 x 128 Q tile, 4 64 x 128 K/V tiles, 2-byte elements.
        let f = find("exla_rs_fwd_bf16_d128");
        assert_eq!((f.threads, f.smem), (256, (128 * 128 + 4 * 64 * 128) * 2));
        // sm90::FwdTraits<128>: 3 warpgroups; a 128 x 128 Q tile and 2 stages of 128 x 128 K and V
        // tiles, plus the barriers and lists: within Hopper's 227 KiB per block.
        let s = find("exla_rs_sm90_fwd_bf16_d128");
        assert_eq!(s.threads, 384);
        assert!(s.smem > (128 * 128 + 2 * 2 * 128 * 128) * 2 && s.smem <= 227 * 1024, "{}", s.smem);
    }
}
