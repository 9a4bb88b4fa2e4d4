//! Rust reports as the Elixir maps `ExlaRs.status/0` shows. Keys are atoms; absent values nil.

use exla_rs_runtime::{ApiVersion, Counters, LoadedPlugin, Registration, RuntimeReport};
use rustler::{Encoder, Env, Term};

rustler::atoms! {
    ok,
    error,
    nil,
}

pub fn version(env: Env<'_>, v: Option<ApiVersion>) -> Term<'_> {
    match v {
        Some(v) => (v.major, v.minor).encode(env),
        None => nil().encode(env),
    }
}

pub fn make_map<'a>(env: Env<'a>, pairs: Vec<(&str, Term<'a>)>) -> Term<'a> {
    let mut m = Term::map_new(env);
    for (k, v) in pairs {
        let key = rustler::Atom::from_str(env, k).expect("atom").encode(env);
        m = m.map_put(key, v).expect("map_put on a map");
    }
    m
}

fn opt_string<'a>(env: Env<'a>, s: &Option<String>) -> Term<'a> {
    match s {
        Some(s) => s.encode(env),
        None => nil().encode(env),
    }
}

pub fn registration<'a>(env: Env<'a>, r: &Registration) -> Term<'a> {
    let result = match &r.result {
        Ok(()) => ok().encode(env),
        Err(e) => (error(), e.as_str()).encode(env),
    };
    make_map(env, vec![("target", r.target.encode(env)), ("platform", r.platform.encode(env)), ("result", result)])
}

pub fn runtime<'a>(env: Env<'a>, r: &RuntimeReport) -> Term<'a> {
    let regs: Vec<Term<'a>> = r.registrations.iter().map(|x| registration(env, x)).collect();
    make_map(
        env,
        vec![
            ("kind", rustler::Atom::from_str(env, r.kind.as_str()).expect("atom").encode(env)),
            ("path", r.path.encode(env)),
            ("state", rustler::Atom::from_str(env, r.state()).expect("atom").encode(env)),
            ("ffi_api_version", version(env, r.ffi_api_version)),
            ("pjrt_api_version", version(env, r.pjrt_api_version)),
            ("route", opt_string(env, &r.route)),
            ("verified", r.verified.encode(env)),
            ("registrations", regs.encode(env)),
            ("error", opt_string(env, &r.error)),
        ],
    )
}

pub fn runtimes<'a>(env: Env<'a>, rs: &[RuntimeReport]) -> Term<'a> {
    rs.iter().map(|r| runtime(env, r)).collect::<Vec<_>>().encode(env)
}

pub fn counters(env: Env<'_>, c: Counters) -> Term<'_> {
    make_map(
        env,
        vec![
            ("passes", c.passes.encode(env)),
            ("attempted", c.attempted.encode(env)),
            ("succeeded", c.succeeded.encode(env)),
            ("failed", c.failed.encode(env)),
            ("runtime_failures", c.runtime_failures.encode(env)),
        ],
    )
}

pub fn loaded_plugin<'a>(env: Env<'a>, p: &LoadedPlugin) -> Term<'a> {
    make_map(
        env,
        vec![
            ("path", p.path.encode(env)),
            ("pjrt_api_version", version(env, Some(p.pjrt_api_version))),
            ("newly_loaded", p.newly_loaded.encode(env)),
            ("extension_types", p.extension_types.encode(env)),
        ],
    )
}

pub fn targets(env: Env<'_>) -> Term<'_> {
    exla_rs_xla::TARGETS
        .iter()
        .map(|t| make_map(env, vec![("name", t.name.encode(env)), ("platform", t.platform.encode(env)), ("symbol", t.symbol.encode(env))]))
        .collect::<Vec<_>>()
        .encode(env)
}

pub fn error_tuple<'a>(env: Env<'a>, reason: &str) -> Term<'a> {
    (error(), reason).encode(env)
}

pub fn ok_tuple<'a>(env: Env<'a>, value: Term<'a>) -> Term<'a> {
    (ok(), value).encode(env)
}


