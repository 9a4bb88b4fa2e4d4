//! Checks one call frame against the custom-call contract and turns it into a validated call.
//! Every malformed call becomes INVALID_ARGUMENT naming the operand (index and name) and what
//! was expected; a valid call the platform cannot run becomes UNIMPLEMENTED.

use exla_rs_attn::philox::DropoutRate;
use exla_rs_attn::{extras, AttnError, AttnOptions, AttnShape, ElementType, Pass, Platform};
use xla_ffi::{Attr, Buffer, CallFrame, DataType, ErrorCode, FfiError};

use crate::workspace::{features, platform_workspace, FEATURE_ALIBI, FEATURE_BIAS, FEATURE_BIAS_GRAD, FEATURE_DROPOUT, FEATURE_KEY_MASK};

/// Operand names in contract order, for messages (the optional ones follow, see [`Extras`]).
pub const FWD_OPERANDS: [&str; 5] = ["q", "k", "v", "kv_len", "q_start"];
pub const BWD_OPERANDS: [&str; 8] = ["q", "k", "v", "kv_len", "q_start", "o", "lse", "do"];

/// The optional operands, in their fixed order, with the attribute that announces each.
pub const OPTIONAL_OPERANDS: [(&str, &str); 4] =
    [("has_key_mask", "key_mask"), ("has_bias", "bias"), ("has_alibi", "alibi_slopes"), ("has_dropout", "dropout_key")];

/// XLA's U32 element type (the Philox key's), which `DataType` has no name for.
const U32: DataType = DataType(xla_ffi::sys::XLA_FFI_DataType_U32);

/// A call's dropout, platform-neutral: the key stays a buffer (host memory on the Host, device
/// memory on CUDA, where the kernels read it through its pointer), the rest comes from the
/// attributes with the `exla_rs_attn::philox` helpers.
pub struct DropoutOperand<'a> {
    /// `u32[2]`: the Philox key `(k0, k1)`.
    pub key: Buffer<'a>,
    /// Rate, keep threshold (`draw >= threshold` keeps) and keep scale `1 / (1 - rate)`.
    pub rate: DropoutRate,
}

/// The optional operands of a call, validated against its shape.
#[derive(Default)]
pub struct Extras<'a> {
    /// `[B, Sk]` of an integer or pred type, nonzero = visible.
    pub key_mask: Option<Buffer<'a>>,
    /// `[Bb, Hb, Sqb, Skb]`, each 1 or full, f32/f16/bf16.
    pub bias: Option<Buffer<'a>>,
    /// `f32[H]`.
    pub alibi_slopes: Option<Buffer<'a>>,
    /// Present iff `has_dropout` (then `0 < rate < 1`).
    pub dropout: Option<DropoutOperand<'a>>,
    /// Backward only: the call returns `dbias` after `dv`.
    pub bias_grad: bool,
}

impl Extras<'_> {
    pub fn is_none(&self) -> bool {
        self.key_mask.is_none() && self.bias.is_none() && self.alibi_slopes.is_none() && self.dropout.is_none()
    }

    /// The contract's feature bits this call uses (see `exla_rs_flash_attn_features`).
    pub fn features(&self) -> u32 {
        let mut f = 0;
        if self.key_mask.is_some() {
            f |= FEATURE_KEY_MASK;
        }
        if self.bias.is_some() {
            f |= FEATURE_BIAS;
        }
        if self.alibi_slopes.is_some() {
            f |= FEATURE_ALIBI;
        }
        if self.bias_grad {
            f |= FEATURE_BIAS_GRAD;
        }
        if self.dropout.is_some() {
            f |= FEATURE_DROPOUT;
        }
        f
    }
}

/// Integer (or pred) element types a key mask may have.
const MASK_TYPES: [i32; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 9];

/// The operands every call shares, validated.
pub struct Common<'a> {
    pub dtype: ElementType,
    pub shape: AttnShape,
    pub opts: AttnOptions,
    pub q: Buffer<'a>,
    pub k: Buffer<'a>,
    pub v: Buffer<'a>,
    pub kv_len: Buffer<'a>,
    pub q_start: Buffer<'a>,
    pub extras: Extras<'a>,
}

/// A validated forward call.
pub struct FwdCall<'a> {
    pub common: Common<'a>,
    pub o: Buffer<'a>,
    pub lse: Buffer<'a>,
    pub workspace: Option<Buffer<'a>>,
}

/// A validated backward call.
pub struct BwdCall<'a> {
    pub common: Common<'a>,
    pub o: Buffer<'a>,
    pub lse: Buffer<'a>,
    pub d_o: Buffer<'a>,
    pub dq: Buffer<'a>,
    pub dk: Buffer<'a>,
    pub dv: Buffer<'a>,
    /// Iff `bias_grad`: shaped and typed like the bias.
    pub dbias: Option<Buffer<'a>>,
    pub workspace: Option<Buffer<'a>>,
}

/// Maps a backend error onto XLA's codes, prefixed with the target name.
pub fn attn_error(target: &str, e: AttnError) -> FfiError {
    match e {
        AttnError::InvalidArgument(m) => FfiError::invalid_argument(format!("{target}: {m}")),
        AttnError::Unimplemented(m) => FfiError::unimplemented(format!("{target}: {m}")),
        AttnError::Internal(m) => FfiError::internal(format!("{target}: {m}")),
    }
}

fn invalid(target: &str, msg: String) -> FfiError {
    FfiError::invalid_argument(format!("{target}: {msg}"))
}

fn dims_string(dims: &[usize]) -> String {
    let d: Vec<String> = dims.iter().map(|x| x.to_string()).collect();
    format!("[{}]", d.join(","))
}

/// `what` (e.g. "operand 5 `o`") must be `dtype[dims]`.
fn expect_exact(target: &str, what: &str, b: &Buffer<'_>, dtype: DataType, dims: &[usize], meaning: &str) -> Result<(), FfiError> {
    let same_dims = b.dims.len() == dims.len() && b.dims.iter().zip(dims).all(|(&a, &e)| a >= 0 && a as usize == e);
    if b.dtype != dtype || !same_dims {
        return Err(invalid(
            target,
            format!("{what} must be {dtype}{} {meaning}, got {}", dims_string(dims), b.describe()),
        ));
    }
    Ok(())
}

fn rank4(target: &str, what: &str, b: &Buffer<'_>, layout: &str) -> Result<[usize; 4], FfiError> {
    if b.rank() != 4 || b.dims.iter().any(|&d| d < 0) {
        return Err(invalid(target, format!("{what} must have rank 4 {layout}, got {}", b.describe())));
    }
    Ok([b.dims[0] as usize, b.dims[1] as usize, b.dims[2] as usize, b.dims[3] as usize])
}

/// A presence attribute: absent = false; `pred`, or `s64` 0/1.
fn flag(target: &str, frame: &CallFrame<'_>, name: &str) -> Result<bool, FfiError> {
    match frame.attrs().get(name) {
        None => Ok(false),
        // SAFETY: XLA stores a scalar of the given dtype at `value` (1 byte for PRED, 8 for S64).
        Some(Attr::Scalar { dtype, value }) if dtype == DataType::PRED && !value.is_null() => Ok(unsafe { *(value as *const u8) } != 0),
        Some(Attr::Scalar { dtype, value }) if dtype == DataType::S64 && !value.is_null() => {
            match unsafe { std::ptr::read_unaligned(value as *const i64) } {
                0 => Ok(false),
                1 => Ok(true),
                other => Err(invalid(target, format!("attribute `{name}` must be true/false (pred) or an s64 0/1, got {other}"))),
            }
        }
        Some(other) => Err(invalid(target, format!("attribute `{name}` must be a pred scalar (true/false), got a {}", other.kind()))),
    }
}

/// The operand list the presence attributes announce: the fixed `names`, then the present
/// optional ones in contract order. Checks the call has exactly those.
fn operand_count(target: &str, frame: &CallFrame<'_>, names: &[&str]) -> Result<[bool; 4], FfiError> {
    let mut present = [false; 4];
    let mut all: Vec<&str> = names.to_vec();
    for (n, (attr, operand)) in OPTIONAL_OPERANDS.iter().enumerate() {
        present[n] = flag(target, frame, attr)?;
        if present[n] {
            all.push(operand);
        }
    }
    if frame.arg_count() != all.len() {
        return Err(invalid(
            target,
            format!(
                "expected {} operands ({}), got {} (the optional operands are those has_key_mask/has_bias/has_alibi/has_dropout announce)",
                all.len(),
                all.join(", "),
                frame.arg_count()
            ),
        ));
    }
    Ok(present)
}

/// The optional operands from index `first` on, in contract order, validated against `c`.
fn extras<'a>(target: &str, frame: &CallFrame<'a>, first: usize, present: [bool; 4], c: &Common<'a>) -> Result<Extras<'a>, FfiError> {
    let s = c.shape;
    let mut ex = Extras::default();
    let mut at = first;
    if present[0] {
        let m = frame.arg(at)?;
        let what = format!("operand {at} `key_mask`");
        let dims_ok = m.rank() == 2 && m.dims[0] >= 0 && m.dims[0] as usize == s.batch && m.dims[1] >= 0 && m.dims[1] as usize == s.seq_k;
        if !MASK_TYPES.contains(&m.dtype.0) || !dims_ok {
            return Err(invalid(
                target,
                format!("{what} must be [B, Sk] = [{}, {}] of an integer or pred type (nonzero = visible), got {}", s.batch, s.seq_k, m.describe()),
            ));
        }
        ex.key_mask = Some(m);
        at += 1;
    }
    if present[1] {
        let b = frame.arg(at)?;
        let what = format!("operand {at} `bias`");
        if b.rank() != 4 || b.dims.iter().any(|&d| d < 0) {
            return Err(invalid(target, format!("{what} must have rank 4 (broadcastable to [B, H, Sq, Sk]), got {}", b.describe())));
        }
        if ElementType::from_xla_code(b.dtype.0).is_none() {
            return Err(invalid(target, format!("{what} must be f32, f16 or bf16, got {}", b.describe())));
        }
        let dims = [b.dims[0] as usize, b.dims[1] as usize, b.dims[2] as usize, b.dims[3] as usize];
        extras::bias_dims_ok(&s, &dims).map_err(|m| invalid(target, format!("{what}: {m}")))?;
        ex.bias = Some(b);
        at += 1;
    }
    if present[2] {
        let a = frame.arg(at)?;
        expect_exact(target, &format!("operand {at} `alibi_slopes`"), &a, DataType::F32, &[s.heads], "(one ALiBi slope per query head)")?;
        ex.alibi_slopes = Some(a);
        at += 1;
    }
    let rate = dropout_rate(target, frame)?;
    if let Some(rate) = DropoutRate::from_attributes(rate, present[3]).map_err(|e| attn_error(target, e))? {
        let key = frame.arg(at)?;
        expect_exact(target, &format!("operand {at} `dropout_key`"), &key, U32, &[2], "(the Philox key, as Nx.Random.key/1 returns it)")?;
        ex.dropout = Some(DropoutOperand { key, rate });
    }
    Ok(ex)
}

/// The optional `dropout_rate` attribute: absent = 0, else an f32 scalar.
fn dropout_rate(target: &str, frame: &CallFrame<'_>) -> Result<f32, FfiError> {
    match frame.attrs().get("dropout_rate") {
        None => Ok(0.0),
        Some(_) => frame.attrs().f32(target, "dropout_rate"),
    }
}

/// UNIMPLEMENTED when `platform` lacks a feature the call uses (after validation, so a
/// malformed call is still INVALID_ARGUMENT everywhere).
fn check_features(target: &str, platform: Platform, ex: &Extras<'_>) -> Result<(), FfiError> {
    let missing = ex.features() & !features(platform);
    if missing != 0 {
        let names: Vec<&str> = [(FEATURE_KEY_MASK, "key_mask"), (FEATURE_BIAS, "bias"), (FEATURE_ALIBI, "alibi_slopes"), (FEATURE_BIAS_GRAD, "bias_grad"), (FEATURE_DROPOUT, "dropout")]
            .iter()
            .filter(|(bit, _)| missing & bit != 0)
            .map(|(_, n)| *n)
            .collect();
        return Err(FfiError::unimplemented(format!(
            "{target}: {} not supported on {platform:?} yet (exla_rs_flash_attn_features({}) = {}); use the Nx fallback",
            names.join(", "),
            platform as i32,
            features(platform)
        )));
    }
    Ok(())
}

fn options(target: &str, frame: &CallFrame<'_>) -> Result<AttnOptions, FfiError> {
    let attrs = frame.attrs();
    let opts = AttnOptions {
        scale: attrs.f32(target, "scale")?,
        softcap: attrs.f32(target, "softcap")?,
        window_left: attrs.i64(target, "window_left")?,
        window_right: attrs.i64(target, "window_right")?,
    };
    opts.validate().map_err(|e| attn_error(target, e))?;
    Ok(opts)
}

/// q, k, v, kv_len, q_start and the attributes.
fn common<'a>(target: &str, frame: &CallFrame<'a>) -> Result<Common<'a>, FfiError> {
    let q = frame.arg(0)?;
    let k = frame.arg(1)?;
    let v = frame.arg(2)?;
    let kv_len = frame.arg(3)?;
    let q_start = frame.arg(4)?;
    let [b, sq, h, d] = rank4(target, "operand 0 `q`", &q, "[B, Sq, H, D]")?;
    let [kb, sk, hkv, kd] = rank4(target, "operand 1 `k`", &k, "[B, Sk, Hkv, D]")?;
    rank4(target, "operand 2 `v`", &v, "[B, Sk, Hkv, D]")?;
    let dtype = ElementType::from_xla_code(q.dtype.0)
        .ok_or_else(|| invalid(target, format!("operand 0 `q` must be f32, f16 or bf16, got {}", q.describe())))?;
    for (what, buf) in [("operand 1 `k`", &k), ("operand 2 `v`", &v)] {
        if buf.dtype != q.dtype {
            return Err(invalid(target, format!("{what} must have the type of `q` ({}), got {}", q.dtype, buf.describe())));
        }
    }
    if kb != b {
        return Err(invalid(target, format!("operand 1 `k` batch {kb} differs from `q` batch {b} (k is {}, q is {})", k.describe(), q.describe())));
    }
    if kd != d {
        return Err(invalid(target, format!("operand 1 `k` head dim {kd} differs from `q` head dim {d} (k is {}, q is {})", k.describe(), q.describe())));
    }
    if v.dims != k.dims {
        return Err(invalid(target, format!("operand 2 `v` must have the shape of `k` ({}), got {}", k.describe(), v.describe())));
    }
    let shape = AttnShape { batch: b, seq_q: sq, seq_k: sk, heads: h, kv_heads: hkv, head_dim: d };
    shape.validate().map_err(|e| match e {
        AttnError::InvalidArgument(m) => invalid(target, format!("operands 0 `q` / 1 `k`: {m}")),
        other => attn_error(target, other),
    })?;
    expect_exact(target, "operand 3 `kv_len`", &kv_len, DataType::S32, &[b], "(valid keys per batch row)")?;
    expect_exact(target, "operand 4 `q_start`", &q_start, DataType::S32, &[b], "(key position of query 0 per batch row)")?;
    let opts = options(target, frame)?;
    Ok(Common { dtype, shape, opts, q, k, v, kv_len, q_start, extras: Extras::default() })
}

/// The optional trailing workspace result at `index`, checked against what `platform` asks for.
///
/// A caller may pass a workspace larger than this platform needs, or one where it needs none:
/// the Elixir layer traces one program before it knows the client, so it sizes the workspace
/// for the most demanding platform (EXLA takes a custom call's results from the traced graph).
fn workspace<'a>(
    target: &str,
    frame: &CallFrame<'a>,
    index: usize,
    pass: Pass,
    platform: Platform,
    c: &Common<'a>,
    result_names: &str,
) -> Result<Option<Buffer<'a>>, FfiError> {
    let need = platform_workspace(pass, platform, c.dtype, &c.shape).map_err(|why| {
        FfiError::new(
            ErrorCode::Unimplemented,
            format!(
                "{target}: this {} call is not supported on {platform:?}: {why} (exla_rs_flash_attn_workspace_bytes says -1)",
                c.dtype
            ),
        )
    })?;
    let count = frame.ret_count();
    let allowed = if need > 0 { index + 1..=index + 1 } else { index..=index + 1 };
    if !allowed.contains(&count) {
        let ws = if need > 0 { format!(", workspace u8[{need}]") } else { String::from(" and an optional u8 workspace") };
        return Err(invalid(target, format!("expected {} results ({result_names}{ws}), got {count}", index + usize::from(need > 0))));
    }
    if count == index {
        return Ok(None);
    }
    let w = frame.ret(index)?;
    if w.dtype != DataType::U8 || w.rank() != 1 || w.dims[0] < 0 || (w.dims[0] as usize) < need {
        return Err(invalid(target, format!("result {index} `workspace` must be u8[N] with N >= {need}, got {}", w.describe())));
    }
    Ok(Some(w))
}

pub fn forward<'a>(target: &str, frame: &CallFrame<'a>, platform: Platform) -> Result<FwdCall<'a>, FfiError> {
    let present = operand_count(target, frame, &FWD_OPERANDS)?;
    let mut c = common(target, frame)?;
    c.extras = extras(target, frame, FWD_OPERANDS.len(), present, &c)?;
    let ws = workspace(target, frame, 2, Pass::Forward, platform, &c, "o, lse")?;
    check_features(target, platform, &c.extras)?;
    let s = c.shape;
    let o = frame.ret(0)?;
    expect_exact(target, "result 0 `o`", &o, c.q.dtype, &[s.batch, s.seq_q, s.heads, s.head_dim], "(like q)")?;
    let lse = frame.ret(1)?;
    expect_exact(target, "result 1 `lse`", &lse, DataType::F32, &[s.batch, s.heads, s.seq_q], "[B, H, Sq]")?;
    Ok(FwdCall { common: c, o, lse, workspace: ws })
}

pub fn backward<'a>(target: &str, frame: &CallFrame<'a>, platform: Platform) -> Result<BwdCall<'a>, FfiError> {
    let present = operand_count(target, frame, &BWD_OPERANDS)?;
    let mut c = common(target, frame)?;
    c.extras = extras(target, frame, BWD_OPERANDS.len(), present, &c)?;
    c.extras.bias_grad = flag(target, frame, "bias_grad")?;
    if c.extras.bias_grad && c.extras.bias.is_none() {
        return Err(invalid(target, "attribute `bias_grad` asks for dbias but the call has no bias (has_bias is false)".into()));
    }
    let nres = 3 + usize::from(c.extras.bias_grad);
    let names = if c.extras.bias_grad { "dq, dk, dv, dbias" } else { "dq, dk, dv" };
    let ws = workspace(target, frame, nres, Pass::Backward, platform, &c, names)?;
    let s = c.shape;
    let q_dims = [s.batch, s.seq_q, s.heads, s.head_dim];
    let kv_dims = [s.batch, s.seq_k, s.kv_heads, s.head_dim];
    let o = frame.arg(5)?;
    expect_exact(target, "operand 5 `o`", &o, c.q.dtype, &q_dims, "(the forward's o, like q)")?;
    let lse = frame.arg(6)?;
    expect_exact(target, "operand 6 `lse`", &lse, DataType::F32, &[s.batch, s.heads, s.seq_q], "(the forward's lse, [B, H, Sq])")?;
    let d_o = frame.arg(7)?;
    expect_exact(target, "operand 7 `do`", &d_o, c.q.dtype, &q_dims, "(like o)")?;
    let dq = frame.ret(0)?;
    expect_exact(target, "result 0 `dq`", &dq, c.q.dtype, &q_dims, "(like q)")?;
    let dk = frame.ret(1)?;
    expect_exact(target, "result 1 `dk`", &dk, c.q.dtype, &kv_dims, "(like k)")?;
    let dv = frame.ret(2)?;
    expect_exact(target, "result 2 `dv`", &dv, c.q.dtype, &kv_dims, "(like v)")?;
    let dbias = match (&c.extras.bias, c.extras.bias_grad) {
        (Some(bias), true) => {
            let r = frame.ret(3)?;
            let dims: Vec<usize> = bias.dims.iter().map(|&d| d as usize).collect();
            expect_exact(target, "result 3 `dbias`", &r, bias.dtype, &dims, "(shaped and typed like the bias)")?;
            Some(r)
        }
        _ => None,
    };
    check_features(target, platform, &c.extras)?;
    Ok(BwdCall { common: c, o, lse, d_o, dq, dk, dv, dbias, workspace: ws })
}
