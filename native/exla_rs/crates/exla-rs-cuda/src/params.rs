//! The kernels' argument blocks, field for field `kernels/params.cuh` (one struct passed by value).

use crate::ExtraBuffers;
use exla_rs_attn::ElementType;
use std::ffi::c_void;

/// The widest window the kernels are given (`kWindowCap` in kernels/common.cuh). Any window of 2^40
/// or more already spans every (query, key) pair, since positions are 32-bit; clamping keeps the
/// kernels' i64 bound arithmetic (`q_start + i - wl`, `q_start + i + wr + 1`, ...) from wrapping, so
/// a window near `i64::MAX` stays unbounded as on the Host (which saturates those sums).
pub const WINDOW_CAP: i64 = 1 << 40;

/// `1 / softcap` as the kernels take it (0 when the softcap is off).
pub fn softcap_inv(softcap: f32) -> f32 {
    if softcap > 0.0 {
        1.0 / softcap
    } else {
        0.0
    }
}

/// The window value a kernel receives; negative (unbounded) values pass through.
pub fn kernel_window(w: i64) -> i64 {
    w.min(WINDOW_CAP)
}

/// The contract's optional operands (`ExtraParams` in params.cuh); a null pointer = absent.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExtraParams {
    /// `[B, Sk]` integer of `key_mask_bytes` bytes, nonzero = visible.
    pub key_mask: *const c_void,
    /// `[Bb, Hb, Sqb, Skb]` of `bias_dtype`, read through the strides.
    pub bias: *const c_void,
    pub alibi_slopes: *const f32,
    /// `u32[2]` in device memory.
    pub dropout_key: *const u32,
    /// Element strides of the bias; 0 on a broadcast dimension.
    pub bias_stride_b: i64,
    pub bias_stride_h: i64,
    pub bias_stride_q: i64,
    pub bias_stride_k: i64,
    pub key_mask_bytes: i32,
    /// 0 = f32, 1 = f16, 2 = bf16.
    pub bias_dtype: i32,
    /// Keep iff draw >= threshold (`floor(rate * 2^32)`).
    pub dropout_threshold: u32,
    /// `1 / (1 - rate)`.
    pub dropout_scale: f32,
}

impl ExtraParams {
    /// A call without optional operands.
    pub const NONE: ExtraParams = ExtraParams {
        key_mask: std::ptr::null(),
        bias: std::ptr::null(),
        alibi_slopes: std::ptr::null(),
        dropout_key: std::ptr::null(),
        bias_stride_b: 0,
        bias_stride_h: 0,
        bias_stride_q: 0,
        bias_stride_k: 0,
        key_mask_bytes: 0,
        bias_dtype: 0,
        dropout_threshold: 0,
        dropout_scale: 1.0,
    };
}

/// Element strides `[b, h, q, k]` of a dense row-major `[Bb, Hb, Sqb, Skb]` bias, 0 on every
/// broadcast (size-1) dimension, so `b*sb + h*sh + i*sq + j*sk` reads the entry of (b, h, i, j)
/// for every full-size index. The dbias accumulator uses the same index (it is dense like the bias).
pub fn bias_strides(dims: [usize; 4]) -> [i64; 4] {
    let mut strides = [0i64; 4];
    let mut dense = 1i64;
    for axis in (0..4).rev() {
        strides[axis] = if dims[axis] == 1 { 0 } else { dense };
        dense *= dims[axis] as i64;
    }
    strides
}

/// `bias_dtype` of params.cuh: 0 = f32, 1 = f16, 2 = bf16.
pub fn bias_dtype_code(dtype: ElementType) -> i32 {
    match dtype {
        ElementType::F32 => 0,
        ElementType::F16 => 1,
        ElementType::BF16 => 2,
    }
}

/// The kernels' view of a call's optional operands.
pub fn extra_params(x: &ExtraBuffers) -> ExtraParams {
    let mut p = ExtraParams::NONE;
    if x.key_mask != 0 {
        p.key_mask = x.key_mask as *const c_void;
        p.key_mask_bytes = x.key_mask_bytes as i32;
    }
    if let Some(b) = &x.bias {
        p.bias = b.ptr as *const c_void;
        p.bias_dtype = bias_dtype_code(b.dtype);
        [p.bias_stride_b, p.bias_stride_h, p.bias_stride_q, p.bias_stride_k] = bias_strides(b.dims);
    }
    if x.alibi_slopes != 0 {
        p.alibi_slopes = x.alibi_slopes as *const f32;
    }
    if let Some(d) = &x.dropout {
        p.dropout_key = d.key as *const u32;
        p.dropout_threshold = d.threshold;
        p.dropout_scale = d.scale;
    }
    p
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FwdParams {
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    pub kv_len: *const i32,
    pub q_start: *const i32,
    pub o: *mut c_void,
    pub lse: *mut f32,
    pub batch: i32,
    pub seq_q: i32,
    pub seq_k: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub softcap: f32,
    pub window_left: i64,
    pub window_right: i64,
    /// `1 / softcap` (0 when off): the kernels multiply by it instead of dividing.
    pub softcap_inv: f32,
    pub x: ExtraParams,
}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BwdParams {
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    pub kv_len: *const i32,
    pub q_start: *const i32,
    pub o: *const c_void,
    pub lse: *const f32,
    pub d_o: *const c_void,
    pub dq: *mut c_void,
    pub dk: *mut c_void,
    pub dv: *mut c_void,
    pub delta: *mut f32,
    pub dq_accum: *mut f32,
    pub batch: i32,
    pub seq_q: i32,
    pub seq_k: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub softcap: f32,
    pub window_left: i64,
    pub window_right: i64,
    /// `1 / softcap` (0 when off): the kernels multiply by it instead of dividing.
    pub softcap_inv: f32,
    pub x: ExtraParams,
    /// bias_grad: f32 accumulator in the workspace, laid out densely like the bias (null without).
    pub dbias_accum: *mut f32,
    /// The `dbias` result, of `x.bias_dtype`.
    pub dbias: *mut c_void,
    pub dbias_elems: i64,
    /// The tensor-core backward's blocks with `blockIdx.x < kb_first` return at once: 0 but in
    /// the deterministic mode's one-key-block launches (launch.rs).
    pub kb_first: i32,
    pub unused: i32,
}

/// The split-KV forward's block (`SplitParams` in params.cuh, kernels/flash_fwd_split.cuh): the
/// call's `FwdParams`, the split count and the f32 partials in the workspace (null for one split).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SplitParams {
    pub f: FwdParams,
    pub o_part: *mut f32,
    pub lse_part: *mut f32,
    pub num_splits: i32,
    pub row_blocks: i32,
}

/// The pad kernel's block (`PadParams` in params.cuh, kernels/pad.cuh): `dst[r, c] = c < copy_cols ?
/// src[r, c] : 0` over `rows` rows of `src_cols` / `dst_cols` elements.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PadParams {
    pub src: *const c_void,
    pub dst: *mut c_void,
    pub rows: i64,
    pub src_cols: i32,
    pub dst_cols: i32,
    pub copy_cols: i32,
    pub unused: i32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use exla_rs_attn::{AttnOptions, KeyRange};
    use std::mem::{offset_of, size_of};

    /// `Mask` of kernels/common.cuh, transcribed with the device's two's-complement i64 arithmetic
    /// (wrapping, which is what the GPU does on overflow) and its `clamp_window` made optional.
    struct DevMask {
        kv_end: i64,
        q_start: i64,
        wl: i64,
        wr: i64,
        seq_q: i64,
    }
    impl DevMask {
        fn new(seq_q: i64, seq_k: i64, kv_len: i64, q_start: i64, wl: i64, wr: i64, clamp: bool) -> Self {
            let c = |w: i64| if clamp { kernel_window(w) } else { w };
            Self { kv_end: kv_len.clamp(0, seq_k), q_start, wl: c(wl), wr: c(wr), seq_q }
        }
        fn row_keys(&self, i: i64) -> (i64, i64) {
            let p = self.q_start.wrapping_add(i);
            let mut a = if self.wl < 0 { 0 } else { p.wrapping_sub(self.wl) };
            let mut b = if self.wr < 0 { self.kv_end } else { p.wrapping_add(self.wr).wrapping_add(1) };
            a = a.max(0);
            b = b.min(self.kv_end);
            if a < b {
                (a, b)
            } else {
                (0, 0)
            }
        }
        fn visible(&self, i: i64, j: i64) -> bool {
            let p = self.q_start.wrapping_add(i);
            j < self.kv_end && (self.wl < 0 || j >= p.wrapping_sub(self.wl)) && (self.wr < 0 || j <= p.wrapping_add(self.wr))
        }
        fn keys_rows(&self, n0: i64, n1: i64) -> (i64, i64) {
            let n1 = n1.min(self.kv_end);
            if n0 >= n1 {
                return (0, 0);
            }
            let a = if self.wr < 0 { 0 } else { n0.wrapping_sub(self.q_start).wrapping_sub(self.wr) }.max(0);
            let b = if self.wl < 0 { self.seq_q } else { (n1 - 1).wrapping_sub(self.q_start).wrapping_add(self.wl).wrapping_add(1) }
                .min(self.seq_q);
            if a < b {
                (a, b)
            } else {
                (0, 0)
            }
        }
    }

    #[test]
    fn windows_near_i64_max_saturate_like_the_host() {
        let (sq, sk) = (9i64, 11i64);
        let big = [i64::MAX, i64::MAX - 1, 1 << 62, WINDOW_CAP, WINDOW_CAP + 1];
        let mut unclamped_wrong = false;
        for &(wl, wr) in &[(i64::MAX, i64::MAX), (i64::MAX, 0), (0, i64::MAX), (1 << 62, 3), (2, i64::MAX - 1), (-1, i64::MAX)] {
            for qs in [i32::MIN, -20, -3, 0, 4, 30, i32::MAX - 8] {
                for kv in [0, 5, 11] {
                    let opts = AttnOptions { scale: 1.0, softcap: 0.0, window_left: wl, window_right: wr };
                    for clamp in [true, false] {
                        let m = DevMask::new(sq, sk, kv as i64, qs as i64, wl, wr, clamp);
                        let mut ok = true;
                        for i in 0..sq {
                            let r = KeyRange::for_row(&opts, sk as usize, kv, qs, i as usize);
                            let want = (r.start as i64, r.end as i64);
                            ok &= m.row_keys(i) == want;
                            for j in 0..sk {
                                ok &= m.visible(i, j) == (j >= want.0 && j < want.1);
                            }
                        }
                        // keys_rows covers exactly the rows that see a key of the range.
                        for n0 in 0..sk {
                            let (lo, hi) = m.keys_rows(n0, n0 + 1);
                            let rows: Vec<i64> = (0..sq)
                                .filter(|&i| {
                                    let r = KeyRange::for_row(&opts, sk as usize, kv, qs, i as usize);
                                    (r.start as i64) <= n0 && n0 < r.end as i64
                                })
                                .collect();
                            ok &= rows.iter().all(|&i| lo <= i && i < hi);
                        }
                        if clamp {
                            assert!(ok, "wl={wl} wr={wr} q_start={qs} kv_len={kv}: clamped device mask differs from the Host");
                        } else {
                            unclamped_wrong |= !ok;
                        }
                    }
                }
            }
        }
        // The check has teeth: without the clamp the device's i64 sums wrap.
        assert!(unclamped_wrong);
        for w in big {
            assert_eq!(kernel_window(w), WINDOW_CAP);
        }
        assert_eq!(kernel_window(-1), -1);
        assert_eq!(kernel_window(7), 7);
        assert!(include_str!("../../../kernels/common.cuh").contains("kWindowCap = 1LL << 40;"));
    }

    #[test]
    fn bias_strides_are_dense_with_zeros_on_broadcast_dims() {
        let (b, h, sq, sk) = (3usize, 4usize, 5usize, 7usize);
        for mask in 0..16u32 {
            let full = [b, h, sq, sk];
            let dims: [usize; 4] = std::array::from_fn(|a| if mask & (1 << a) != 0 { 1 } else { full[a] });
            let st = bias_strides(dims);
            // Every (b, h, i, j) reads the dense row-major entry of its broadcast index.
            for (bi, hi, ii, ji) in (0..b).flat_map(|x| (0..h).flat_map(move |y| (0..sq).flat_map(move |z| (0..sk).map(move |w| (x, y, z, w))))) {
                let idx = [bi, hi, ii, ji];
                let bc: [usize; 4] = std::array::from_fn(|a| if dims[a] == 1 { 0 } else { idx[a] });
                let want = ((bc[0] * dims[1] + bc[1]) * dims[2] + bc[2]) * dims[3] + bc[3];
                let got = st.iter().zip(idx).map(|(&s, i)| s * i as i64).sum::<i64>();
                assert_eq!(got, want as i64, "dims {dims:?} index {idx:?}");
            }
        }
        assert_eq!(bias_strides([1, 4, 5, 7]), [0, 35, 7, 1]);
        assert_eq!(bias_strides([3, 1, 1, 7]), [7, 0, 0, 1]);
        assert_eq!(bias_strides([3, 4, 5, 1]), [20, 5, 1, 0]);
        assert_eq!(bias_strides([1, 1, 1, 1]), [0, 0, 0, 0]);
    }

    #[test]
    fn layouts_match_params_cuh() {
        // 7 pointers, 6 ints, 2 floats, 2 int64: the C++ compiler lays out the same sizes.
        assert_eq!(offset_of!(FwdParams, batch), 56);
        assert_eq!(offset_of!(FwdParams, scale), 80);
        assert_eq!(offset_of!(FwdParams, window_left), 88);
        assert_eq!(offset_of!(FwdParams, softcap_inv), 104);
        assert_eq!(offset_of!(FwdParams, x), 112);
        assert_eq!(size_of::<ExtraParams>(), 80);
        assert_eq!(offset_of!(ExtraParams, bias_stride_b), 32);
        assert_eq!(offset_of!(ExtraParams, key_mask_bytes), 64);
        assert_eq!(offset_of!(ExtraParams, dropout_scale), 76);
        assert_eq!(size_of::<FwdParams>(), 192);
        assert_eq!(offset_of!(BwdParams, batch), 104);
        assert_eq!(offset_of!(BwdParams, scale), 128);
        assert_eq!(offset_of!(BwdParams, window_right), 144);
        assert_eq!(offset_of!(BwdParams, softcap_inv), 152);
        assert_eq!(offset_of!(BwdParams, x), 160);
        assert_eq!(offset_of!(BwdParams, dbias_accum), 240);
        assert_eq!(offset_of!(BwdParams, dbias_elems), 256);
        assert_eq!(offset_of!(BwdParams, kb_first), 264);
        assert_eq!(size_of::<BwdParams>(), 272);
        assert_eq!(offset_of!(PadParams, rows), 16);
        assert_eq!(offset_of!(PadParams, copy_cols), 32);
        assert_eq!(size_of::<PadParams>(), 40);
        assert_eq!(offset_of!(SplitParams, o_part), 192);
        assert_eq!(offset_of!(SplitParams, num_splits), 208);
        assert_eq!(size_of::<SplitParams>(), 216);
        assert!(include_str!("../../../kernels/params.cuh").contains("sizeof(exla_rs::SplitParams) == 216"));
        let cuh = include_str!("../../../kernels/params.cuh");
        assert!(cuh.contains("sizeof(exla_rs::PadParams) == 40"));
        let cuh = include_str!("../../../kernels/params.cuh");
        for f in ["const void* q;", "float* lse;", "int batch, seq_q, seq_k, heads, kv_heads, head_dim;", "float* dq_accum;"] {
            assert!(cuh.contains(f), "params.cuh changed: {f}");
        }
    }
}
