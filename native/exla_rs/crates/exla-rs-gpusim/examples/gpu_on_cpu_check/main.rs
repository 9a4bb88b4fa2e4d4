//! The GPU-on-CPU sanitizer harness: a list of calls that together launch EVERY kernel image of
//! this build (each mma.sync forward and backward, each f32 SIMT kernel, the auxiliary kernels,
//! dbias, dropout, and the sm90 forward set), run through `exla_rs_cuda::forward` / `backward`
//! on the executor (`Stream::Target(&SimDevice)`) with exactly-sized host buffers, each compared with the Host kernels.
//!
//! It exists because the sanitizers cannot run inside python + jaxlib here (AddressSanitizer
//! crashes in jaxlib, ThreadSanitizer reports jaxlib's own races): build the executor
//! instrumented and run this instead (scripts/gpu_on_cpu.sh):
//!
//!     EXLA_RS_GPUSIM_SANITIZE=thread cargo run --profile gpusim -p exla-rs-gpusim --example gpu_on_cpu_check
//!
//! with `TSAN_OPTIONS=halt_on_error=1:exitcode=66` (or `ASAN_OPTIONS=detect_leaks=0:...`): a
//! sanitizer report ends the process with the sanitizer's exit code. Otherwise the exit status
//! is 0 when every case matched the Host kernels and every kernel was launched, 1 if not.
//!
//! Options: `--only SUBSTRING` (cases whose name contains it; skips the coverage check),
//! `--list`, `--seed N`, `--short-o` (the forward's `o` one element short: the proof that
//! AddressSanitizer bounds every buffer exactly; under it the run must end in its report).
//! Side by side (scripts/gpu_on_cpu.sh): `--shard I/N --launches FILE` runs every N-th case from
//! the I-th and writes the kernels it launched to FILE instead of judging coverage;
//! `--coverage FILE...` runs nothing and judges the union of such files against the build.

mod cases;

use cases::Case;
use exla_rs_attn::{AttnShape, ElementType};
use exla_rs_cuda::{embedded, HEAD_DIMS, SM90_HEAD_DIMS};
use std::collections::BTreeSet;
use std::time::Instant;

const DTYPES: [ElementType; 3] = [ElementType::F16, ElementType::BF16, ElementType::F32];

fn shape(b: usize, sq: usize, sk: usize, h: usize, hkv: usize, d: usize) -> AttnShape {
    AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d }
}

/// The option sets, in rotation over the (head dim, dtype) cases, so every option meets several
/// dtypes and head dims; whether the set needs two batch rows (a fully masked one beside another).
const OPTIONS: [(&str, bool); 8] = [
    ("causal", false),
    ("window_softcap", false),
    ("ragged", true),
    ("mask_alibi", true),
    ("bias1HQK_dbias", false),
    ("biasB11K_dbias", true),
    ("dropout", false),
    ("everything", true),
];

fn with_options(mut c: Case, n: usize) -> Case {
    let s = c.shape;
    let (b, h, sq, sk) = (s.batch, s.heads, s.seq_q, s.seq_k);
    match n % 8 {
        0 => c.window = (-1, 0),
        1 => (c.window, c.softcap) = ((20, 3), 15.0),
        2 => {
            // A batch row with no keys (fully masked rows) and query positions off the diagonal.
            c.kv_len = Some((0..b).map(|i| if i == 0 { 0 } else { sk as i32 - 9 }).collect());
            c.q_start = Some((0..b).map(|i| [5, -3][i % 2]).collect());
        }
        3 => (c.key_mask, c.alibi) = (true, true),
        4 => (c.bias, c.dbias) = (Some(([1, h, sq, sk], ElementType::F32)), true),
        5 => (c.bias, c.dbias, c.window) = (Some(([b, 1, 1, sk], ElementType::BF16)), true, (-1, 0)),
        6 => (c.dropout, c.window) = (0.2, (-1, 0)),
        _ => {
            (c.dropout, c.key_mask, c.alibi) = (0.1, true, true);
            (c.bias, c.dbias) = (Some(([1, 1, sq, sk], ElementType::F16)), true);
        }
    }
    c.name = format!("{}_{}", c.name, OPTIONS[n % 8].0);
    c
}

// Sizes. Every CUDA thread is a fiber here, and each block runs them all, so a case costs in
// proportion to the threads its launches start: the shapes are the
// smallest that still cross each kernel's tiles (rows past one tile and a ragged last tile), with
// GQA groups of 2. The elementwise kernels (dq conversion, dbias passes) start one thread per
// element, which is why the backward cases keep Sq small.

/// Query rows of a forward + backward case: past one backward query tile (64 rows up to D = 96,
/// 32 above), and past the D = 256 forward's 64-row tile.
fn bwd_rows(d: usize) -> usize {
    if d <= 96 {
        70
    } else {
        40
    }
}

/// Keys: past one key tile of the forward and the backward (64 keys up to D = 128, 32 above; the
/// backward's key blocks hold 128 at D = 64 and 128, so two of its blocks add into one dq row).
fn keys(d: usize) -> usize {
    if d == 64 || d == 128 {
        130
    } else if d <= 128 {
        70
    } else {
        40
    }
}

/// The option sets (indices into OPTIONS) that each tensor-core feature set runs (config.rs
/// FeatureSet): plain, masks and additive terms, dropout, both.
const OPTIONS_PER_FEATURE_SET: [&[usize]; 4] = [&[0, 1, 2], &[3, 4, 5], &[6], &[7]];

/// Every case: for each (D, dtype) the SIMT kernels forward and backward with a rotating option
/// set, or the mma.sync kernels once per feature set (each set is its own kernel image), and
/// (f16/bf16) a forward-only case past one 128-row forward tile; the sm90 forward set opted in;
/// an empty call.
fn all_cases() -> Vec<Case> {
    let mut v = Vec::new();
    // n counts every (D, dtype) for the SIMT rotation, m only the tensor-core ones: each feature
    // set's options rotate over m, so every option of a set (the plain set's ragged included)
    // meets the tensor-core kernels.
    let (mut n, mut m) = (0, 0);
    for d in HEAD_DIMS {
        for dt in DTYPES {
            // SIMT kernels: 4-row tiles, keys in 32-lane steps; small shapes cross both.
            let (sq, sk) = if dt == ElementType::F32 { (37, 45) } else { (bwd_rows(d), keys(d)) };
            let picks: Vec<usize> = if dt == ElementType::F32 {
                vec![n % 8]
            } else {
                m += 1;
                OPTIONS_PER_FEATURE_SET.iter().map(|o| o[(m - 1) % o.len()]).collect()
            };
            for k in picks {
                let b = if OPTIONS[k].1 { 2 } else { 1 };
                v.push(with_options(Case::new(format!("{}_d{d}", dt.name()), dt, shape(b, sq, sk, 2, 1, d)), k));
            }
            n += 1;
            if dt != ElementType::F32 {
                // Causal, and enough keys that the last row block crosses three key tiles (64 keys up
                // to D = 128, 32 above): the two-stage pipeline reloads a stage, so a missing barrier
                // before that reload is a race ThreadSanitizer sees.
                let tall = if d <= 192 { 130 } else { 70 };
                let tall_keys = if d <= 128 { 150 } else { tall };
                let mut c = Case::new(format!("{}_d{d}_tall_fwd", dt.name()), dt, shape(1, tall, tall_keys, 2, 1, d));
                (c.window, c.backward) = ((-1, 0), false);
                v.push(c);
            }
        }
    }
    for dt in [ElementType::F16, ElementType::BF16] {
        for d in SM90_HEAD_DIMS {
            // Past one 128-row query tile and one key tile (128 keys, D = 256: 64), ragged.
            let sk = if d <= 128 { 140 } else { 70 };
            let b = if d == 128 { 2 } else { 1 };
            // D = 64 and 256 on 2 SMs: each block takes 2 of the 4 work tiles, so the stage ring
            // (3 stages at D = 64, 2 at D = 256) and its mbarrier phases carry over from one work
            // tile to the next (the D = 128 persistent case below does so with 2 stages).
            let name = if d == 128 { format!("sm90_{}_d{d}", dt.name()) } else { format!("sm90_{}_d{d}_2sms", dt.name()) };
            let mut c = Case::new(name, dt, shape(b, 130, sk, 2, 1, d));
            c.path = Some("sm90");
            c.backward = false;
            match d {
                64 => (c.window, c.sms) = ((-1, 0), Some(2)),
                128 => {
                    c.kv_len = Some(vec![sk as i32 - 30, 0]);
                    c.q_start = Some(vec![7, -2]);
                }
                _ => (c.softcap, c.sms) = (20.0, Some(2)),
            }
            v.push(c);
        }
    }
    // The sm90 backward (issue 32): two key blocks of 128 (the second ragged; D = 256: three of 64),
    // query tiles of 64 over a GQA group of 2 (the Q/dO stage ring wraps), opted in; D = 64 causal
    // with softcap and ragged kv_len / q_start (a K row past kv_len zeroed), D = 128 a two-sided
    // window, D = 256 causal with ragged kv_len.
    for dt in [ElementType::F16, ElementType::BF16] {
        for d in [64, 128, 256] {
            let mut c = Case::new(format!("sm90_bwd_{}_d{d}", dt.name()), dt, shape(2, 130, 140, 4, 2, d));
            c.path = Some("sm90");
            if d == 64 {
                (c.window, c.softcap) = ((-1, 0), 20.0);
                c.kv_len = Some(vec![133, 70]);
                c.q_start = Some(vec![5, -3]);
            } else if d == 128 {
                c.window = (40, 9);
            } else {
                c.window = (-1, 0);
                c.kv_len = Some(vec![140, 101]);
            }
            v.push(c);
        }
    }
    // The sm90 backward's feature sets (issue 32, part 3: each its own image), per (dtype, D), past
    // one query tile and one key block (the Q/dO ring wraps over the GQA group): key_mask (batch row 1 hidden whole: its key blocks sweep nothing) with
    // bias and dbias in each of the three accumulations (per element; Sqb = 1, per key; Skb = 1,
    // per query) and ALiBi on every other; dropout alone (causal); everything together.
    for (n, dt) in [ElementType::F16, ElementType::BF16].into_iter().enumerate() {
        for (i, d) in [64, 128, 256].into_iter().enumerate() {
            let m = 3 * n + i;
            let (sq, sk) = (70, 140);
            let mut c = Case::new(format!("sm90_bwd_{}_d{d}_mask", dt.name()), dt, shape(2, sq, sk, 4, 2, d));
            (c.path, c.key_mask, c.dbias, c.alibi) = (Some("sm90"), true, true, m % 2 == 0);
            c.bias = Some(match m % 3 {
                0 => ([1, 1, sq, sk], ElementType::F32),
                1 => ([2, 1, 1, sk], ElementType::BF16),
                _ => ([1, 4, sq, 1], ElementType::F16),
            });
            v.push(c);
            let mut c = Case::new(format!("sm90_bwd_{}_d{d}_drop", dt.name()), dt, shape(1, sq, sk, 4, 2, d));
            (c.path, c.dropout, c.window) = (Some("sm90"), 0.2, (-1, 0));
            v.push(c);
            let mut c = Case::new(format!("sm90_bwd_{}_d{d}_mask_drop", dt.name()), dt, shape(2, sq, sk, 4, 2, d));
            (c.path, c.dropout, c.key_mask, c.alibi, c.dbias) = (Some("sm90"), 0.1, true, true, true);
            c.bias = Some(([1, 1, sq, sk], ElementType::F16));
            c.kv_len = Some(vec![sk as i32 - 9, sk as i32]);
            v.push(c);
        }
    }
    // The sm90 forward's masked and dropout feature sets (issue 32, part 3: each its own image), per
    // (dtype, D): key_mask (a fully hidden batch row and holes) with ALiBi or a bias of another
    // broadcast and type, dropout alone (causal), and everything together (D = 64, 128: D = 256
    // has no dropout image); past one key tile, GQA, two batch rows where the key mask or kv_len
    // leaves one fully masked.
    for (n, dt) in [ElementType::F16, ElementType::BF16].into_iter().enumerate() {
        for (i, d) in SM90_HEAD_DIMS.into_iter().enumerate() {
            let sk = if d <= 128 { 140 } else { 70 };
            let m = 3 * n + i;
            let mut c = Case::new(format!("sm90_{}_d{d}_mask", dt.name()), dt, shape(2, 70, sk, 4, 2, d));
            (c.path, c.backward, c.key_mask) = (Some("sm90"), false, true);
            match m % 3 {
                0 => (c.alibi, c.window) = (true, (-1, 0)),
                1 => c.bias = Some(([1, 4, 70, sk], ElementType::F32)),
                _ => (c.bias, c.alibi, c.softcap) = (Some(([2, 1, 1, sk], ElementType::BF16)), true, 15.0),
            }
            v.push(c);
            if d == 256 {
                continue; // no sm90 dropout image at D = 256 (sm90.rs sm90_has_set)
            }
            let mut c = Case::new(format!("sm90_{}_d{d}_drop", dt.name()), dt, shape(1, 70, sk, 4, 2, d));
            (c.path, c.backward, c.dropout, c.window) = (Some("sm90"), false, 0.2, (-1, 0));
            v.push(c);
            let mut c = Case::new(format!("sm90_{}_d{d}_mask_drop", dt.name()), dt, shape(2, 70, sk, 4, 2, d));
            (c.path, c.backward, c.dropout, c.key_mask, c.alibi) = (Some("sm90"), false, 0.1, true, true);
            c.bias = Some(([1, 1, 70, sk], ElementType::F16));
            c.kv_len = Some(vec![sk as i32 - 9, sk as i32]);
            v.push(c);
        }
    }
    // The split-KV forward (issue 34): decode calls (one query row, a GQA group of 2 in one CTA),
    // each (dtype, D) plain with 3 splits (the combine pass) over a ragged causal cache, and with
    // key_mask, bias and ALiBi (the masks-and-terms images) on the launcher's own split count;
    // blocks of one launch write disjoint partials, which ThreadSanitizer would see otherwise.
    // f32 (simt_fwd_split, one warp per block) the same way.
    for dt in DTYPES {
        for (i, d) in HEAD_DIMS.into_iter().enumerate() {
            let sk = if d <= 128 { 200 } else { 110 };
            let mut c = Case::new(format!("split_{}_d{d}_decode", dt.name()), dt, shape(2, 1, sk, 4, 2, d));
            (c.backward, c.window, c.splits, c.softcap) = (false, (-1, 0), Some("3"), if i % 2 == 0 { 0.0 } else { 20.0 });
            c.kv_len = Some(vec![sk as i32 - 7, 0]);
            c.q_start = Some(vec![sk as i32 - 8, 3]);
            v.push(c);
            let mut c = Case::new(format!("split_{}_d{d}_decode_mask_bias_alibi", dt.name()), dt, shape(2, 2, sk, 4, 2, d));
            (c.backward, c.key_mask, c.alibi) = (false, true, true);
            c.bias = Some(if i % 2 == 0 { ([1, 4, 2, sk], ElementType::F32) } else { ([2, 1, 1, sk], ElementType::BF16) });
            v.push(c);
        }
    }
    // Two row blocks of packed rows (Sq = 40, GQA 2: 80 rows) over 10 key tiles, 4 splits.
    let mut c = Case::new("split_bf16_d64_two_row_blocks", ElementType::BF16, shape(1, 40, 600, 4, 2, 64));
    (c.backward, c.window, c.splits) = (false, (-1, 0), Some("4"));
    v.push(c);
    // The persistent grid with fewer blocks than work tiles: each block takes several.
    let mut c = Case::new("sm90_bf16_d128_persistent_3sms", ElementType::BF16, shape(2, 260, 200, 2, 1, 128));
    (c.path, c.backward, c.sms, c.window) = (Some("sm90"), false, Some(3), (-1, 0));
    v.push(c);
    v.push(Case::new("empty_queries_bf16_d64", ElementType::BF16, shape(2, 0, 50, 2, 2, 64)));
    // Head dims without a kernel (issue 33, part 4): the pad kernel's copies in (q, k, v, o, do)
    // and out (o, dq, dk, dv) around the next kernel head dim's kernels, each copy an exactly-sized
    // workspace slice: both pad images (16- and 32-bit elements), odd and SD-style D, options
    // (window, softcap, mask, bias with dbias, ALiBi, dropout), GQA; and a padded sm90 forward
    // (D = 40 on the D = 64 image).
    for (i, (d, dt)) in [(40, ElementType::F16), (80, ElementType::BF16), (72, ElementType::F32), (8, ElementType::BF16)].into_iter().enumerate() {
        let (sq, sk) = if dt == ElementType::F32 { (37, 45) } else { (bwd_rows(d), keys(d)) };
        let k = [1, 7, 3, 5][i];
        let b = if OPTIONS[k].1 { 2 } else { 1 };
        v.push(with_options(Case::new(format!("padded_{}_d{d}", dt.name()), dt, shape(b, sq, sk, 4, 2, d)), k));
    }
    let mut c = Case::new("padded_sm90_bf16_d40", ElementType::BF16, shape(1, 130, 140, 2, 1, 40));
    (c.path, c.backward, c.window) = (Some("sm90"), false, (-1, 0));
    v.push(c);
    v
}

/// Every `extern "C" __global__` kernel the build embeds, by name.
fn embedded_kernels() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for f in embedded::KERNEL_FILES {
        for (at, _) in f.source.match_indices("extern \"C\" __global__") {
            let rest = &f.source[at..];
            let start = rest.find("exla_rs_").expect("a kernel named exla_rs_*");
            let name: String = rest[start..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            names.insert(name);
        }
    }
    names
}

struct Args {
    only: Option<String>,
    list: bool,
    seed: u64,
    short_o: bool,
    shard: Option<(usize, usize)>,
    launches: Option<String>,
    coverage: Vec<String>,
}

fn parse_shard(s: &str) -> Option<(usize, usize)> {
    let (i, n) = s.split_once('/')?;
    let (i, n) = (i.parse().ok()?, n.parse().ok()?);
    (i < n).then_some((i, n))
}

fn args() -> Result<Args, String> {
    let mut a = Args { only: None, list: false, seed: 1, short_o: false, shard: None, launches: None, coverage: Vec::new() };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--only" => a.only = Some(it.next().ok_or("--only needs a substring")?),
            "--list" => a.list = true,
            "--short-o" => a.short_o = true,
            "--seed" => a.seed = it.next().and_then(|s| s.parse().ok()).ok_or("--seed needs an integer")?,
            "--shard" => a.shard = Some(it.next().as_deref().and_then(parse_shard).ok_or("--shard needs I/N with I < N")?),
            "--launches" => a.launches = Some(it.next().ok_or("--launches needs a file")?),
            "--coverage" => a.coverage.extend(it.by_ref()),
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--only SUBSTRING, --list, --seed N, --short-o, --shard I/N, --launches FILE, --coverage FILE...)"
                ))
            }
        }
    }
    if a.shard.is_some() != a.launches.is_some() {
        return Err("--shard and --launches go together".into());
    }
    Ok(a)
}

/// `--coverage FILE...`: every embedded kernel must be in one of the shards' launch lists.
fn judge_coverage(files: &[String]) -> ! {
    let mut ran = BTreeSet::new();
    for f in files {
        match std::fs::read_to_string(f) {
            Ok(text) => ran.extend(text.lines().map(str::to_string)),
            Err(e) => {
                eprintln!("gpu_on_cpu_check: {f}: {e}");
                std::process::exit(2)
            }
        }
    }
    let missing = report_coverage(&ran);
    println!("{} passed, {} failed (coverage over {} shards)", usize::from(missing.is_empty()), usize::from(!missing.is_empty()), files.len());
    std::process::exit(if missing.is_empty() { 0 } else { 1 })
}

/// Prints how many embedded kernels `ran` covers; returns those it misses.
fn report_coverage(ran: &BTreeSet<String>) -> Vec<String> {
    let embedded = embedded_kernels();
    let missing: Vec<String> = embedded.iter().filter(|k| !ran.contains(*k)).cloned().collect();
    println!("kernels launched: {} of {} embedded", embedded.len() - missing.len(), embedded.len());
    if !missing.is_empty() {
        println!("NEVER LAUNCHED: {}", missing.join(", "));
    }
    missing
}

fn main() {
    let a = args().unwrap_or_else(|e| {
        eprintln!("gpu_on_cpu_check: {e}");
        std::process::exit(2)
    });
    let wanted = |c: &Case| match &a.only {
        Some(o) => c.name.contains(o.as_str()),
        None => true,
    };
    if !a.coverage.is_empty() {
        judge_coverage(&a.coverage);
    }
    let mut cases: Vec<Case> = all_cases().into_iter().filter(wanted).collect();
    if cases.is_empty() {
        // A filter that matches nothing must not pass as a clean run (the mutation script's
        // case names, for one).
        eprintln!("gpu_on_cpu_check: no case matches --only {:?} (--list shows them)", a.only.as_deref().unwrap_or(""));
        std::process::exit(2)
    }
    if let Some((i, n)) = a.shard {
        cases = cases.into_iter().skip(i).step_by(n).collect();
    }
    cases.iter_mut().for_each(|c| c.short_o = a.short_o);
    if a.list {
        cases.iter().for_each(|c| println!("{}", c.name));
        return;
    }
    // The Host reference kernels run on this thread alone: Rust's synchronisation is not
    // instrumented, so ThreadSanitizer would report rayon's hand-offs between its workers as races.
    // One thread, no worker: every report is the kernels' own.
    if let Err(e) = rayon::ThreadPoolBuilder::new().num_threads(1).use_current_thread().build_global() {
        eprintln!("gpu_on_cpu_check: {e}");
        std::process::exit(2)
    }
    let device = exla_rs_gpusim::SimDevice::from_env().unwrap_or_else(|e| {
        eprintln!("gpu_on_cpu_check: {e}");
        std::process::exit(2)
    });
    println!(
        "GPU-on-CPU check: {} cases, emulated compute capability {}.{}, {} SMs, sanitizer {}",
        cases.len(),
        device.cc.0,
        device.cc.1,
        device.sms,
        exla_rs_gpusim::SANITIZER.unwrap_or("none")
    );
    exla_rs_gpusim::reset_launch_counts();
    let started = Instant::now();
    let mut failed = Vec::new();
    for c in &cases {
        let t = Instant::now();
        let r = cases::run(c, a.seed);
        let ms = t.elapsed().as_millis();
        match r {
            Ok(rep) => {
                let errs: Vec<String> = rep.errors.iter().map(|(w, e)| format!("{w} {e:.1e}")).collect();
                println!("ok   {:<40} {ms:>7} ms  {}", c.name, errs.join(", "));
            }
            Err(e) => {
                println!("FAIL {:<40} {ms:>7} ms  {e}", c.name);
                failed.push(c.name.clone());
            }
        }
    }
    let mut missing = Vec::new();
    let ran: BTreeSet<String> = exla_rs_gpusim::launch_counts().into_keys().collect();
    if let Some(file) = &a.launches {
        let text: String = ran.iter().map(|k| format!("{k}\n")).collect();
        if let Err(e) = std::fs::write(file, text) {
            eprintln!("gpu_on_cpu_check: {file}: {e}");
            std::process::exit(2)
        }
    } else if a.only.is_none() {
        missing = report_coverage(&ran);
    }
    println!(
        "{} passed, {} failed in {:.1} s",
        cases.len() - failed.len(),
        failed.len() + usize::from(!missing.is_empty()),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() || !missing.is_empty() {
        std::process::exit(1);
    }
}
