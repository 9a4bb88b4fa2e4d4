//! exla-rs-cuda's launch code on the executor (`Stream::Target(&SimDevice)`) against the Host
//! kernels, a few quick cases of the sanitizer harness (examples/gpu_on_cpu_check runs them all),
//! and what the emulated device refuses as the driver would.

#[path = "../examples/gpu_on_cpu_check/cases.rs"]
mod cases;

use cases::Case;
use exla_rs_attn::{AttnError, AttnOptions, AttnShape, ElementType};
use exla_rs_cuda::{forward, FwdBuffers, Stream};

/// The launcher reads EXLA_RS_CUDA_PATH / EXLA_RS_GPUSIM_* at every call: tests that set them
/// hold this so no other test's calls see the change.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn shape(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> AttnShape {
    AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d }
}

#[test]
fn simt_mma_sync_and_sm90_kernels_match_the_host_kernels() {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let mut simt = Case::new("f32_d64_gqa_causal", ElementType::F32, shape(2, 37, 45, 4, 2, 64));
    simt.window = (-1, 0);
    let mut mma = Case::new("bf16_d64_bias_dbias", ElementType::BF16, shape(1, 70, 66, 2, 1, 64));
    (mma.bias, mma.dbias, mma.key_mask) = (Some(([1, 2, 70, 66], ElementType::F32)), true, true);
    let mut sm90 = Case::new("sm90_f16_d64", ElementType::F16, shape(1, 130, 140, 2, 1, 64));
    (sm90.path, sm90.backward) = (Some("sm90"), false);
    // A decode call (one query row, GQA 2): the split-KV kernels with the launcher's own split
    // count on the default 132 SMs, then the combine pass; the backward is the usual one.
    let mut decode = Case::new("split_bf16_d128_decode", ElementType::BF16, shape(2, 1, 300, 4, 2, 128));
    (decode.window, decode.kv_len) = ((-1, 0), Some(vec![300, 133]));
    exla_rs_gpusim::reset_launch_counts();
    for c in [simt, mma, sm90, decode] {
        if let Err(e) = cases::run(&c, 7) {
            panic!("{}: {e}", c.name);
        }
    }
    let ran = exla_rs_gpusim::launch_counts();
    // The bias/key_mask call runs the masks-and-terms feature set (config.rs FeatureSet), not the plain one.
    for k in [
        "exla_rs_fwd_f32_d64",
        "exla_rs_bwd_dkdv_f32_d64",
        "exla_rs_fwd_bf16_d64_mask",
        "exla_rs_bwd_bf16_d64_mask",
        "exla_rs_dbias_round",
        "exla_rs_sm90_fwd_f16_d64",
        "exla_rs_fwd_split_bf16_d128",
        "exla_rs_fwd_combine_bf16_d128",
        "exla_rs_bwd_bf16_d128",
    ] {
        assert!(ran.contains_key(k), "{k} never launched: {ran:?}");
    }
    assert!(!ran.contains_key("exla_rs_fwd_bf16_d64") && !ran.contains_key("exla_rs_bwd_bf16_d64"), "{ran:?}");
    // Opted in, the sm90 call ran no mma.sync forward.
    assert!(!ran.contains_key("exla_rs_fwd_f16_d64"), "{ran:?}");
    // The decode call's forward ran no non-split forward.
    assert!(!ran.contains_key("exla_rs_fwd_bf16_d128"), "{ran:?}");
}

/// EXLA_RS_DETERMINISTIC=1: the mma.sync backward runs one launch per key block (3 here: 300
/// keys in blocks of 128), the sm90 path is not taken, and the gradients are the default mode's
/// bit for bit. The executor runs thread blocks in launch order, x (the key block) fastest, so
/// the default mode's atomics already come in key-block order here: equal bits say the
/// one-key-block launches cover every key block of every (kv head, batch) exactly once. (On a
/// GPU the default mode's order varies; test/gpu's determinism test checks repeat runs there.)
#[test]
fn the_deterministic_backward_runs_key_block_by_key_block() {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let mut gqa = Case::new("bf16_d64_gqa_causal", ElementType::BF16, shape(2, 70, 300, 4, 2, 64));
    (gqa.window, gqa.kv_len) = ((-1, 0), Some(vec![300, 201]));
    let mut masked = Case::new("f16_d128_key_mask_bias_dbias", ElementType::F16, shape(1, 40, 300, 2, 1, 128));
    (masked.key_mask, masked.bias, masked.dbias) = (true, Some(([1, 2, 40, 300], ElementType::F32)), true);
    let run = |c: &Case| {
        exla_rs_gpusim::reset_launch_counts();
        let r = cases::run(c, 11).unwrap_or_else(|e| panic!("{} (deterministic {}): {e}", c.name, c.deterministic));
        (r.grads, exla_rs_gpusim::launch_counts())
    };
    for (c, kernel) in [(&gqa, "exla_rs_bwd_bf16_d64"), (&masked, "exla_rs_bwd_f16_d128_mask")] {
        let (default, ran) = run(c);
        assert_eq!(ran.get(kernel), Some(&1), "{}: {ran:?}", c.name);
        let (fixed, ran) = run(&Case { deterministic: true, ..c.clone() });
        assert_eq!(ran.get(kernel), Some(&3), "{} deterministic: {ran:?}", c.name);
        assert!(!default.is_empty() && default == fixed, "{}: the deterministic gradients differ from the default mode's", c.name);
    }
    // Opted in to sm90, the deterministic backward still runs mma.sync.
    let (_, ran) = run(&Case { deterministic: true, path: Some("sm90"), ..masked.clone() });
    assert_eq!(ran.get("exla_rs_bwd_f16_d128_mask"), Some(&3), "{ran:?}");
    assert!(!ran.keys().any(|k| k.starts_with("exla_rs_sm90_bwd")), "the sm90 backward ran: {ran:?}");
    // dbias of a bias broadcast over the heads sums with atomics inside a launch: refused.
    let mut broadcast = Case::new("bf16_d64_broadcast_dbias", ElementType::BF16, shape(1, 40, 130, 2, 1, 64));
    (broadcast.bias, broadcast.dbias, broadcast.deterministic) = (Some(([1, 1, 40, 130], ElementType::F32)), true, true);
    let e = cases::run(&broadcast, 11).unwrap_err();
    assert!(e.contains("EXLA_RS_DETERMINISTIC") && e.contains("heads"), "{e}");
}

#[test]
fn launches_are_refused_as_the_driver_refuses_them() {
    let s = shape(1, 8, 8, 2, 2, 64);
    let opts = AttnOptions { scale: 0.125, softcap: 0.0, window_left: -1, window_right: -1 };
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    // The kernels need compute capability 8.0; the driver path says so at module load.
    std::env::set_var("EXLA_RS_GPUSIM_CC", "7.5");
    let device = exla_rs_gpusim::SimDevice::from_env().unwrap();
    let r = unsafe { forward(Stream::Target(&device), ElementType::BF16, &s, &opts, &FwdBuffers::default()) };
    std::env::remove_var("EXLA_RS_GPUSIM_CC");
    match r {
        Err(AttnError::Unimplemented(m)) => assert!(m.contains("7.5") && m.contains("8.0"), "{m}"),
        other => panic!("{other:?}"),
    }
}
