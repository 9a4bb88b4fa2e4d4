//! `Elixir.ExlaRs.NIF`: thin glue from Elixir to `exla-rs-runtime` (finding XLA runtimes and
//! registering our handlers), `exla-rs-xla` (the handlers, targets, workspace sizes) and
//! `exla-rs-cuda` (driver and kernel status). It links the same handler code as the plain
//! handler library `libexla_rs_xla.so`.
//!
//! Loading does nothing but register the NIFs: no CUDA, no dlopen (modules load at compile time).
//! Anything that may block (dlopen, XLA registration, the CUDA driver) runs on a dirty
//! scheduler. Every body runs in `guard::guarded`, so a panic becomes `{:error, reason}` (or an
//! `ErlangError` for the functions that return plain values), never a crashed BEAM.

mod cuda;
mod guard;
mod terms;

use std::path::PathBuf;

use exla_rs_runtime::{registry, HandlerSet, HandlerTarget};
use rustler::{Encoder, Env, Error, NifResult, Term};

use guard::guarded;

fn handler_set() -> HandlerSet {
    HandlerSet {
        targets: exla_rs_xla::TARGETS
            .iter()
            .map(|t| HandlerTarget { name: t.name, platform: t.platform, handler: t.handler })
            .collect(),
        api_version: exla_rs_xla::FFI_API_VERSION,
    }
}

fn paths(extra: Vec<String>) -> Vec<PathBuf> {
    extra.into_iter().map(PathBuf::from).collect()
}

fn raise(reason: String) -> Error {
    Error::Term(Box::new(reason))
}

/// `%{version:, ffi_api_version:, targets:, counters:}`: static facts, cheap.
#[rustler::nif]
fn native_info(env: Env<'_>) -> NifResult<Term<'_>> {
    guarded("native_info", || {
        terms::make_map(
            env,
            vec![
                ("version", env!("CARGO_PKG_VERSION").encode(env)),
                ("ffi_api_version", terms::version(env, Some(exla_rs_xla::FFI_API_VERSION))),
                ("targets", terms::targets(env)),
                ("counters", terms::counters(env, registry::counters())),
            ],
        )
    })
    .map_err(raise)
}

/// The runtimes found now and what was registered there, registering nothing.
#[rustler::nif(schedule = "DirtyIo")]
fn runtimes(env: Env<'_>, extra: Vec<String>) -> NifResult<Term<'_>> {
    guarded("runtimes", || {
        let (reports, counters) = registry::snapshot(&paths(extra));
        (terms::runtimes(env, &reports), terms::counters(env, counters)).encode(env)
    })
    .map_err(raise)
}

/// One registration pass: `{:ok, [runtime]}` (possibly empty) or `{:error, reason}` on a panic.
#[rustler::nif(schedule = "DirtyCpu")]
fn register(env: Env<'_>, extra: Vec<String>, retry_failed: bool) -> Term<'_> {
    match guarded("register", || registry::register(&handler_set(), &paths(extra), retry_failed)) {
        Ok(reports) => terms::ok_tuple(env, terms::runtimes(env, &reports)),
        Err(reason) => terms::error_tuple(env, &reason),
    }
}

/// Loads a PJRT plugin into the BEAM for good (and initialises it once).
#[rustler::nif(schedule = "DirtyIo")]
fn load_pjrt_plugin(env: Env<'_>, path: String) -> Term<'_> {
    match guarded("load_pjrt_plugin", || registry::load_pjrt_plugin(std::path::Path::new(&path))) {
        Ok(Ok(info)) => terms::ok_tuple(env, terms::loaded_plugin(env, &info)),
        Ok(Err(reason)) | Err(reason) => terms::error_tuple(env, &reason),
    }
}

/// CUDA driver and devices. Initialises the CUDA driver if there is one.
#[rustler::nif(schedule = "DirtyIo")]
fn cuda_status(env: Env<'_>) -> NifResult<Term<'_>> {
    guarded("cuda_status", || cuda::status(env)).map_err(raise)
}

/// How the CUDA kernels were built (embedded archs, PTX, NVRTC fallback).
#[rustler::nif]
fn kernel_build(env: Env<'_>) -> NifResult<Term<'_>> {
    guarded("kernel_build", || cuda::kernels(env)).map_err(raise)
}

/// `exla_rs_flash_attn_workspace_bytes`: N > 0 bytes of workspace, 0 none, -1 unsupported.
#[rustler::nif]
#[allow(clippy::too_many_arguments)]
fn workspace_bytes(pass: i32, platform: i32, dtype: i32, b: i64, sq: i64, sk: i64, h: i64, hkv: i64, d: i64) -> NifResult<i64> {
    guarded("workspace_bytes", || exla_rs_xla::workspace_bytes(pass, platform, dtype, b, sq, sk, h, hkv, d)).map_err(raise)
}

/// `exla_rs_flash_attn_dbias_workspace_bytes`: bytes a backward with bias_grad appends to the
/// base workspace for a bias of dims `[bb, hb, sqb, skb]`; -1 for an unknown platform or bad dims.
#[rustler::nif]
fn dbias_workspace_bytes(platform: i32, bb: i64, hb: i64, sqb: i64, skb: i64) -> NifResult<i64> {
    guarded("dbias_workspace_bytes", || exla_rs_xla::workspace::dbias_workspace_bytes(platform, bb, hb, sqb, skb)).map_err(raise)
}

/// `exla_rs_flash_attn_features`: the bit set of optional features `platform`'s handlers run
/// (0 Host, 1 CUDA), -1 for an unknown platform code.
#[rustler::nif]
fn flash_attn_features(platform: i32) -> NifResult<i32> {
    guarded("flash_attn_features", || exla_rs_xla::exla_rs_flash_attn_features(platform)).map_err(raise)
}

/// The contract's feature bits by name, from the handlers' own constants, so that Elixir never
/// repeats them: `%{key_mask: 1, bias: 2, alibi_slopes: 4, bias_grad: 8, dropout: 16}`.
#[rustler::nif]
fn feature_bits(env: Env<'_>) -> NifResult<Term<'_>> {
    use exla_rs_xla::workspace::{FEATURE_ALIBI, FEATURE_BIAS, FEATURE_BIAS_GRAD, FEATURE_DROPOUT, FEATURE_KEY_MASK};
    guarded("feature_bits", || {
        terms::make_map(
            env,
            vec![
                ("key_mask", FEATURE_KEY_MASK.encode(env)),
                ("bias", FEATURE_BIAS.encode(env)),
                ("alibi_slopes", FEATURE_ALIBI.encode(env)),
                ("bias_grad", FEATURE_BIAS_GRAD.encode(env)),
                ("dropout", FEATURE_DROPOUT.encode(env)),
            ],
        )
    })
    .map_err(raise)
}

/// A NIF that panics, so the tests can show a panic never takes the BEAM down.
#[rustler::nif]
fn panic_for_test(env: Env<'_>) -> Term<'_> {
    match guarded("panic_for_test", || -> () { panic!("deliberate panic") }) {
        Ok(()) => terms::ok().encode(env),
        Err(reason) => terms::error_tuple(env, &reason),
    }
}

rustler::init!("Elixir.ExlaRs.NIF");
