//! A fake XLA runtime and hand-built call frames, for unit tests of decoding and of handlers
//! without loading XLA. The fake API implements error creation/reading, handler registration
//! (recorded) and a stream getter that answers UNIMPLEMENTED like XLA's CPU runtime.

use std::ffi::{c_void, CStr};
use std::sync::Mutex;

use xla_ffi_sys as sys;

use crate::ApiVersion;

/// An error as the fake runtime stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeError {
    pub code: i32,
    pub message: String,
}

/// A registration the fake runtime accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakeRegistration {
    pub name: String,
    pub platform: String,
    pub traits: u32,
    /// The `struct_size` the caller sent (84 or 92).
    pub struct_size: usize,
    pub execute: usize,
}

pub static REGISTRATIONS: Mutex<Vec<FakeRegistration>> = Mutex::new(Vec::new());

unsafe extern "C" fn error_create(args: *mut sys::XLA_FFI_Error_Create_Args) -> *mut sys::XLA_FFI_Error {
    let a = &*args;
    let message = CStr::from_ptr(a.message).to_string_lossy().into_owned();
    Box::into_raw(Box::new(FakeError { code: a.errc, message })) as *mut sys::XLA_FFI_Error
}

unsafe extern "C" fn error_get_message(args: *mut sys::XLA_FFI_Error_GetMessage_Args) {
    // Messages are handed out NUL-terminated from a leaked copy: fine for tests.
    let e = &*((*args).error as *const FakeError);
    let c = std::ffi::CString::new(e.message.clone()).unwrap();
    (*args).message = c.into_raw();
}

unsafe extern "C" fn error_destroy(args: *mut sys::XLA_FFI_Error_Destroy_Args) {
    drop(Box::from_raw((*args).error as *mut FakeError));
}

unsafe extern "C" fn handler_register(args: *mut sys::XLA_FFI_Handler_Register_Args) -> *mut sys::XLA_FFI_Error {
    let a = &*args;
    let name = String::from_utf8_lossy(std::slice::from_raw_parts(a.name.ptr as *const u8, a.name.len)).into_owned();
    let platform = String::from_utf8_lossy(std::slice::from_raw_parts(a.platform.ptr as *const u8, a.platform.len)).into_owned();
    // Read `traits` where the declared layout puts it, as a real runtime does.
    let traits = if a.struct_size == sys::XLA_FFI_Handler_Register_Args_V0_4_STRUCT_SIZE {
        (*(args as *const sys::XLA_FFI_Handler_Register_Args_V0_4)).traits
    } else {
        a.traits
    };
    if platform.eq_ignore_ascii_case("nowhere") {
        let msg = std::ffi::CString::new(format!("unknown platform {platform}")).unwrap();
        let mut e = sys::XLA_FFI_Error_Create_Args {
            struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            message: msg.as_ptr(),
            errc: sys::XLA_FFI_Error_Code_INVALID_ARGUMENT,
        };
        return error_create(&mut e);
    }
    REGISTRATIONS.lock().unwrap().push(FakeRegistration {
        name,
        platform,
        traits,
        struct_size: a.struct_size,
        execute: a.bundle.execute.map(|f| f as usize).unwrap_or(0),
    });
    std::ptr::null_mut()
}

unsafe extern "C" fn stream_get(_args: *mut sys::XLA_FFI_Stream_Get_Args) -> *mut sys::XLA_FFI_Error {
    let mut e = sys::XLA_FFI_Error_Create_Args {
        struct_size: sys::XLA_FFI_Error_Create_Args_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        message: c"XLA_FFI_Stream_Get is not supported on the Host platform".as_ptr(),
        errc: sys::XLA_FFI_Error_Code_UNIMPLEMENTED,
    };
    error_create(&mut e)
}

/// A fake `XLA_FFI_Api` of the given version (leaked: lives for the test process).
pub fn fake_api(version: ApiVersion) -> &'static sys::XLA_FFI_Api {
    Box::leak(Box::new(sys::XLA_FFI_Api {
        struct_size: sys::XLA_FFI_Api_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        api_version: sys::XLA_FFI_Api_Version {
            struct_size: sys::XLA_FFI_Api_Version_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            major_version: version.major,
            minor_version: version.minor,
        },
        internal_api: std::ptr::null(),
        XLA_FFI_Error_Create: Some(error_create),
        XLA_FFI_Error_GetMessage: Some(error_get_message),
        XLA_FFI_Error_Destroy: Some(error_destroy),
        XLA_FFI_Handler_Register: Some(handler_register),
        XLA_FFI_Stream_Get: Some(stream_get),
        XLA_FFI_Type_Register: None,
        XLA_FFI_ExecutionContext_Get: None,
        XLA_FFI_State_Set: None,
        XLA_FFI_State_Get: None,
        XLA_FFI_DeviceMemory_Allocate: None,
        XLA_FFI_DeviceMemory_Free: None,
        XLA_FFI_ThreadPool_Schedule: None,
        XLA_FFI_ThreadPool_NumThreads: None,
        XLA_FFI_Future_Create: None,
        XLA_FFI_Future_SetAvailable: None,
        XLA_FFI_Future_SetError: None,
        XLA_FFI_RunId_Get: None,
        XLA_FFI_DeviceOrdinal_Get: None,
    }))
}

/// Reads and frees an error the fake runtime created (what a handler returned).
///
/// # Safety
/// `err` must come from the fake API's `error_create`.
pub unsafe fn take_fake_error(err: *mut sys::XLA_FFI_Error) -> Option<FakeError> {
    if err.is_null() {
        None
    } else {
        Some(*Box::from_raw(err as *mut FakeError))
    }
}

/// An attribute value for [`FrameBuilder::attr`].
pub enum AttrValue {
    F32(f32),
    F64(f64),
    I64(i64),
    I32(i32),
    /// A `PRED` scalar, as XLA passes an MLIR `i1` (`true`/`false`) attribute.
    Pred(bool),
    Str(String),
}

/// An owned buffer: dtype, dims and bytes (8-byte aligned storage).
pub struct OwnedBuffer {
    pub dtype: i32,
    pub dims: Vec<i64>,
    pub data: Vec<u64>,
    pub bytes: usize,
}

impl OwnedBuffer {
    pub fn new(dtype: i32, dims: &[i64], bytes: &[u8]) -> Self {
        let mut data = vec![0u64; bytes.len().div_ceil(8).max(1)];
        // SAFETY: `data` holds at least `bytes.len()` bytes.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), data.as_mut_ptr() as *mut u8, bytes.len()) };
        Self { dtype, dims: dims.to_vec(), data, bytes: bytes.len() }
    }

    pub fn zeroed(dtype: i32, dims: &[i64], bytes: usize) -> Self {
        Self::new(dtype, dims, &vec![0u8; bytes])
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: `data` holds `bytes` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.bytes) }
    }

    /// Typed view; `T` must match the dtype the test put in.
    pub fn view<T: Copy>(&self) -> Vec<T> {
        let n = self.bytes / std::mem::size_of::<T>();
        // SAFETY: 8-byte aligned storage of at least `bytes` bytes; T is plain data in tests.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const T, n).to_vec() }
    }
}

/// The bytes of a plain-data numeric slice (what `OwnedBuffer::new` takes).
pub fn bytes<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain-old-data views of numeric slices.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)).to_vec() }
}

/// An `f32` buffer of the given dims.
pub fn f32_buf(dims: &[i64], v: &[f32]) -> OwnedBuffer {
    OwnedBuffer::new(sys::XLA_FFI_DataType_F32, dims, &bytes(v))
}

/// An `s32` vector (`kv_len`, `q_start`).
pub fn i32_buf(v: &[i32]) -> OwnedBuffer {
    OwnedBuffer::new(sys::XLA_FFI_DataType_S32, &[v.len() as i64], &bytes(v))
}

/// A `u32` buffer of the given dims (a dropout key).
pub fn u32_buf(dims: &[i64], v: &[u32]) -> OwnedBuffer {
    OwnedBuffer::new(sys::XLA_FFI_DataType_U32, dims, &bytes(v))
}

/// Deterministic non-zero pseudo-random values in [-1, 1) (a tiny LCG; no test dependency).
pub fn randn(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) as f64 / (1u64 << 31) as f64 * 2.0 - 1.0) as f32
        })
        .collect()
}

/// Builds a call frame from owned buffers and attributes. The frame points into the builder,
/// so the builder must stay put (it is boxed by `build`) while the frame is in use.
pub struct FrameBuilder {
    pub args: Vec<OwnedBuffer>,
    pub rets: Vec<OwnedBuffer>,
    attrs: Vec<(String, AttrValue)>,
    // Storage the raw frame points into.
    raw_args: Vec<sys::XLA_FFI_Buffer>,
    raw_rets: Vec<sys::XLA_FFI_Buffer>,
    arg_types: Vec<sys::XLA_FFI_ArgType>,
    ret_types: Vec<sys::XLA_FFI_RetType>,
    arg_ptrs: Vec<*mut c_void>,
    ret_ptrs: Vec<*mut c_void>,
    attr_names: Vec<sys::XLA_FFI_ByteSpan>,
    attr_name_ptrs: Vec<*mut sys::XLA_FFI_ByteSpan>,
    attr_types: Vec<sys::XLA_FFI_AttrType>,
    attr_scalars: Vec<sys::XLA_FFI_Scalar>,
    attr_strings: Vec<sys::XLA_FFI_ByteSpan>,
    attr_ptrs: Vec<*mut c_void>,
    attr_values: Vec<[u8; 8]>,
    frame: Option<sys::XLA_FFI_CallFrame>,
}

impl Default for FrameBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameBuilder {
    pub fn new() -> Self {
        Self {
            args: Vec::new(),
            rets: Vec::new(),
            attrs: Vec::new(),
            raw_args: Vec::new(),
            raw_rets: Vec::new(),
            arg_types: Vec::new(),
            ret_types: Vec::new(),
            arg_ptrs: Vec::new(),
            ret_ptrs: Vec::new(),
            attr_names: Vec::new(),
            attr_name_ptrs: Vec::new(),
            attr_types: Vec::new(),
            attr_scalars: Vec::new(),
            attr_strings: Vec::new(),
            attr_ptrs: Vec::new(),
            attr_values: Vec::new(),
            frame: None,
        }
    }

    pub fn arg(mut self, b: OwnedBuffer) -> Self {
        self.args.push(b);
        self
    }

    pub fn ret(mut self, b: OwnedBuffer) -> Self {
        self.rets.push(b);
        self
    }

    pub fn attr(mut self, name: &str, v: AttrValue) -> Self {
        self.attrs.push((name.to_string(), v));
        self
    }

    /// Lays out the raw frame (attributes sorted by name, as XLA sorts them) and returns it
    /// boxed so its internal pointers stay valid.
    pub fn build(mut self, api: &'static sys::XLA_FFI_Api) -> Box<Self> {
        self.attrs.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
        let mut me = Box::new(self);
        let m = &mut *me;
        for b in m.args.iter_mut() {
            m.raw_args.push(raw_buffer(b));
        }
        for b in m.rets.iter_mut() {
            m.raw_rets.push(raw_buffer(b));
        }
        m.arg_types = vec![sys::XLA_FFI_ArgType_BUFFER; m.raw_args.len()];
        m.ret_types = vec![sys::XLA_FFI_RetType_BUFFER; m.raw_rets.len()];
        m.arg_ptrs = m.raw_args.iter_mut().map(|b| b as *mut _ as *mut c_void).collect();
        m.ret_ptrs = m.raw_rets.iter_mut().map(|b| b as *mut _ as *mut c_void).collect();

        // Reserve so pushes never move what earlier pointers point to.
        let n = m.attrs.len();
        m.attr_names.reserve(n);
        m.attr_values.reserve(n);
        m.attr_scalars.reserve(n);
        m.attr_strings.reserve(n);
        for (name, v) in m.attrs.iter() {
            m.attr_names.push(sys::XLA_FFI_ByteSpan { ptr: name.as_ptr() as *const _, len: name.len() });
            match v {
                AttrValue::Str(s) => {
                    m.attr_strings.push(sys::XLA_FFI_ByteSpan { ptr: s.as_ptr() as *const _, len: s.len() });
                    m.attr_types.push(sys::XLA_FFI_AttrType_STRING);
                    m.attr_ptrs.push(m.attr_strings.last_mut().unwrap() as *mut _ as *mut c_void);
                }
                scalar => {
                    let (dtype, bytes): (i32, [u8; 8]) = match scalar {
                        AttrValue::F32(x) => (sys::XLA_FFI_DataType_F32, pad(&x.to_ne_bytes())),
                        AttrValue::F64(x) => (sys::XLA_FFI_DataType_F64, x.to_ne_bytes()),
                        AttrValue::I64(x) => (sys::XLA_FFI_DataType_S64, x.to_ne_bytes()),
                        AttrValue::I32(x) => (sys::XLA_FFI_DataType_S32, pad(&x.to_ne_bytes())),
                        AttrValue::Pred(x) => (sys::XLA_FFI_DataType_PRED, pad(&[u8::from(*x)])),
                        AttrValue::Str(_) => unreachable!(),
                    };
                    m.attr_values.push(bytes);
                    let value = m.attr_values.last_mut().unwrap().as_mut_ptr() as *mut c_void;
                    m.attr_scalars.push(sys::XLA_FFI_Scalar { dtype, value });
                    m.attr_types.push(sys::XLA_FFI_AttrType_SCALAR);
                    m.attr_ptrs.push(m.attr_scalars.last_mut().unwrap() as *mut _ as *mut c_void);
                }
            }
        }
        m.attr_name_ptrs = m.attr_names.iter_mut().map(|s| s as *mut _).collect();

        m.frame = Some(sys::XLA_FFI_CallFrame {
            struct_size: sys::XLA_FFI_CallFrame_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            api,
            ctx: std::ptr::null_mut(),
            stage: sys::XLA_FFI_ExecutionStage_EXECUTE,
            args: sys::XLA_FFI_Args {
                struct_size: sys::XLA_FFI_Args_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: m.arg_ptrs.len() as i64,
                types: m.arg_types.as_mut_ptr(),
                args: m.arg_ptrs.as_mut_ptr(),
            },
            rets: sys::XLA_FFI_Rets {
                struct_size: sys::XLA_FFI_Rets_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: m.ret_ptrs.len() as i64,
                types: m.ret_types.as_mut_ptr(),
                rets: m.ret_ptrs.as_mut_ptr(),
            },
            attrs: sys::XLA_FFI_Attrs {
                struct_size: sys::XLA_FFI_Attrs_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: m.attr_ptrs.len() as i64,
                types: m.attr_types.as_mut_ptr(),
                names: m.attr_name_ptrs.as_mut_ptr(),
                attrs: m.attr_ptrs.as_mut_ptr(),
            },
            future: std::ptr::null_mut(),
        });
        me
    }

    /// The raw frame to hand to a handler (after `build`).
    pub fn frame(&mut self) -> *mut sys::XLA_FFI_CallFrame {
        self.frame.as_mut().expect("call build() first") as *mut _
    }
}

fn pad(b: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out[..b.len()].copy_from_slice(b);
    out
}

fn raw_buffer(b: &mut OwnedBuffer) -> sys::XLA_FFI_Buffer {
    sys::XLA_FFI_Buffer {
        struct_size: sys::XLA_FFI_Buffer_STRUCT_SIZE,
        extension_start: std::ptr::null_mut(),
        dtype: b.dtype,
        data: b.data.as_mut_ptr() as *mut c_void,
        rank: b.dims.len() as i64,
        dims: b.dims.as_mut_ptr(),
    }
}

/// A metadata-probe frame as XLA builds it at registration (`api` may be NULL, as on older runtimes).
pub struct ProbeFrame {
    pub metadata: Box<sys::XLA_FFI_Metadata>,
    ext: Box<sys::XLA_FFI_Metadata_Extension>,
    frame: sys::XLA_FFI_CallFrame,
}

impl ProbeFrame {
    pub fn new(api: *const sys::XLA_FFI_Api) -> Box<Self> {
        let mut metadata = Box::new(sys::XLA_FFI_Metadata {
            struct_size: sys::XLA_FFI_Metadata_STRUCT_SIZE,
            api_version: sys::XLA_FFI_Api_Version {
                struct_size: sys::XLA_FFI_Api_Version_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                major_version: 0,
                minor_version: 0,
            },
            traits: 0xdead,
            state_type_id: sys::XLA_FFI_TypeId::default(),
        });
        let mut ext = Box::new(sys::XLA_FFI_Metadata_Extension {
            extension_base: sys::XLA_FFI_Extension_Base {
                struct_size: sys::XLA_FFI_Metadata_Extension_STRUCT_SIZE,
                type_: sys::XLA_FFI_Extension_Metadata,
                next: std::ptr::null_mut(),
            },
            metadata: &mut *metadata,
        });
        let empty_args = sys::XLA_FFI_Args {
            struct_size: sys::XLA_FFI_Args_STRUCT_SIZE,
            extension_start: std::ptr::null_mut(),
            size: 0,
            types: std::ptr::null_mut(),
            args: std::ptr::null_mut(),
        };
        let frame = sys::XLA_FFI_CallFrame {
            struct_size: sys::XLA_FFI_CallFrame_STRUCT_SIZE,
            extension_start: &mut ext.extension_base,
            api,
            ctx: std::ptr::null_mut(),
            stage: sys::XLA_FFI_ExecutionStage_EXECUTE,
            args: empty_args,
            rets: sys::XLA_FFI_Rets {
                struct_size: sys::XLA_FFI_Rets_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: 0,
                types: std::ptr::null_mut(),
                rets: std::ptr::null_mut(),
            },
            attrs: sys::XLA_FFI_Attrs {
                struct_size: sys::XLA_FFI_Attrs_STRUCT_SIZE,
                extension_start: std::ptr::null_mut(),
                size: 0,
                types: std::ptr::null_mut(),
                names: std::ptr::null_mut(),
                attrs: std::ptr::null_mut(),
            },
            future: std::ptr::null_mut(),
        };
        Box::new(Self { metadata, ext, frame })
    }

    pub fn frame(&mut self) -> *mut sys::XLA_FFI_CallFrame {
        let _ = &self.ext;
        &mut self.frame
    }
}
