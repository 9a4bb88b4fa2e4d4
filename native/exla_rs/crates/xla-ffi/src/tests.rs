//! Unit tests of the safe layer on hand-built call frames and a fake runtime.

use xla_ffi_sys as sys;

use crate::testing::*;
use crate::*;

const V01: ApiVersion = ApiVersion::new(0, 1);

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn decodes_buffers_and_typed_slices() {
    let api = fake_api(ApiVersion::new(0, 2));
    let mut fb = FrameBuilder::new()
        .arg(OwnedBuffer::new(sys::XLA_FFI_DataType_F32, &[2, 3], &f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])))
        .arg(OwnedBuffer::new(sys::XLA_FFI_DataType_S32, &[], &7i32.to_ne_bytes()))
        .ret(OwnedBuffer::zeroed(sys::XLA_FFI_DataType_F32, &[6], 24))
        .build(api);
    let frame = unsafe { CallFrame::from_raw(&*fb.frame(), "t").unwrap() };
    assert_eq!(frame.stage(), Stage::Execute);
    assert_eq!((frame.arg_count(), frame.ret_count()), (2, 1));
    let a = frame.arg(0).unwrap();
    assert_eq!(a.dtype, DataType::F32);
    assert_eq!(a.dims, &[2, 3]);
    assert_eq!(a.element_count(), 6);
    assert_eq!(a.describe(), "f32[2,3]");
    assert_eq!(unsafe { a.as_slice::<f32>() }.unwrap(), &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let s = frame.arg(1).unwrap();
    assert_eq!((s.rank(), s.element_count()), (0, 1));
    assert_eq!(unsafe { s.as_slice::<i32>() }.unwrap(), &[7]);
    let r = frame.ret(0).unwrap();
    unsafe { r.as_mut_slice::<f32>().unwrap()[5] = 9.5 };
    assert_eq!(fb.rets[0].view::<f32>()[5], 9.5);
    let err = frame.arg(2).unwrap_err();
    assert_eq!(err.code, ErrorCode::InvalidArgument);
    assert!(err.message.contains("missing operand 2"), "{}", err.message);
}

#[test]
fn misaligned_buffer_is_an_error_not_ub() {
    let b = Buffer { dtype: DataType::F32, data: 3usize as *mut _, dims: &[4] };
    let e = unsafe { b.as_slice::<f32>() }.unwrap_err();
    assert!(e.message.contains("not aligned"), "{}", e.message);
    let null = Buffer { dtype: DataType::F32, data: std::ptr::null_mut(), dims: &[4] };
    assert!(unsafe { null.as_slice::<f32>() }.is_err());
    let empty = Buffer { dtype: DataType::F32, data: std::ptr::null_mut(), dims: &[0, 4] };
    assert!(unsafe { empty.as_slice::<f32>() }.unwrap().is_empty());
}

#[test]
fn attributes_by_name_with_exact_types() {
    let api = fake_api(V01);
    // Names inserted out of order; the builder sorts them like XLA. "scale" vs "scale2" checks
    // that names are compared by length too (they are not NUL-terminated).
    let mut fb = FrameBuilder::new()
        .attr("window_right", AttrValue::I64(0))
        .attr("scale", AttrValue::F32(0.125))
        .attr("scale2", AttrValue::F32(2.0))
        .attr("softcap", AttrValue::F64(30.0))
        .attr("mode", AttrValue::Str("fast".into()))
        .attr("window_left", AttrValue::I32(-1))
        .build(api);
    let frame = unsafe { CallFrame::from_raw(&*fb.frame(), "exla_rs_flash_attn_fwd").unwrap() };
    let attrs = frame.attrs();
    assert_eq!(attrs.len(), 6);
    assert_eq!(attrs.names().collect::<Vec<_>>(), ["mode", "scale", "scale2", "softcap", "window_left", "window_right"]);
    assert_eq!(attrs.f32("t", "scale").unwrap(), 0.125);
    assert_eq!(attrs.f32("t", "scale2").unwrap(), 2.0);
    assert_eq!(attrs.i64("t", "window_right").unwrap(), 0);
    assert_eq!(attrs.string("t", "mode").unwrap(), "fast");
    let wrong = attrs.f32("exla_rs_flash_attn_fwd", "softcap").unwrap_err();
    assert_eq!(wrong.code, ErrorCode::InvalidArgument);
    assert!(wrong.message.contains("`softcap` must be a f32 scalar, got a f64 scalar"), "{}", wrong.message);
    let narrow = attrs.i64("t", "window_left").unwrap_err();
    assert!(narrow.message.contains("s64 scalar, got a s32 scalar"), "{}", narrow.message);
    let missing = attrs.f32("exla_rs_flash_attn_fwd", "scal").unwrap_err();
    assert!(missing.message.contains("missing attribute `scal`"), "{}", missing.message);
    assert!(missing.message.contains("scale, scale2"), "{}", missing.message);
}

#[test]
fn errors_round_trip_through_the_runtime() {
    let api = unsafe { Api::from_ptr(fake_api(V01)).unwrap() };
    let raw = FfiError::invalid_argument("operand 0 `q`: bad\0rank").into_raw(api);
    let fake = unsafe { take_fake_error(raw) }.unwrap();
    assert_eq!(fake.code, sys::XLA_FFI_Error_Code_INVALID_ARGUMENT);
    assert_eq!(fake.message, "operand 0 `q`: bad\\0rank");
    let raw = FfiError::internal("boom").into_raw(api);
    let back = unsafe { FfiError::take_raw(api, raw, ErrorCode::Internal) };
    assert_eq!(back, FfiError::internal("boom"));
    assert_eq!(format!("{back}"), "INTERNAL: boom");
    for c in [3, 12, 13, 5, 99] {
        assert_eq!(ErrorCode::from_raw(c).to_raw(), c);
    }
}

#[test]
fn metadata_probe_reports_version_and_traits_with_null_api() {
    let info = HandlerInfo { target: "t", version: V01, traits: 0 };
    for api in [std::ptr::null(), fake_api(V01) as *const _] {
        let mut probe = ProbeFrame::new(api);
        let called = std::cell::Cell::new(false);
        let err = unsafe {
            run_handler(probe.frame(), &info, |_| {
                called.set(true);
                Ok(())
            })
        };
        assert!(err.is_null());
        assert!(!called.get(), "the body must not run for a probe");
        let m = &probe.metadata;
        assert_eq!((m.api_version.major_version, m.api_version.minor_version), (0, 1));
        assert_eq!(m.api_version.struct_size, 24);
        assert_eq!(m.traits, 0);
    }
}

#[test]
fn handler_errors_and_panics_become_xla_errors() {
    let api = fake_api(V01);
    let info = HandlerInfo { target: "exla_rs_flash_attn_fwd", version: V01, traits: 0 };
    let mut fb = FrameBuilder::new().build(api);
    let ok = unsafe { run_handler(fb.frame(), &info, |_| Ok(())) };
    assert!(ok.is_null());
    let e = unsafe { run_handler(fb.frame(), &info, |_| Err(FfiError::unimplemented("no kernel"))) };
    let e = unsafe { take_fake_error(e) }.unwrap();
    assert_eq!((e.code, e.message.as_str()), (12, "no kernel"));
    let p = unsafe { run_handler(fb.frame(), &info, |_| panic!("index out of range 7")) };
    let p = unsafe { take_fake_error(p) }.unwrap();
    assert_eq!(p.code, sys::XLA_FFI_Error_Code_INTERNAL);
    assert!(p.message.contains("Rust panic: index out of range 7"), "{}", p.message);
    assert!(unsafe { run_handler(std::ptr::null_mut(), &info, |_| panic!("unreachable")) }.is_null());
}

#[test]
fn non_execute_stages_do_nothing() {
    let api = fake_api(V01);
    let info = HandlerInfo { target: "t", version: V01, traits: 0 };
    let mut fb = FrameBuilder::new().build(api);
    unsafe { (*fb.frame()).stage = sys::XLA_FFI_ExecutionStage_PREPARE };
    assert!(unsafe { run_handler(fb.frame(), &info, |_| panic!("must not run")) }.is_null());
}

#[test]
fn stream_get_on_cpu_is_a_clean_error() {
    let api = fake_api(V01);
    let mut fb = FrameBuilder::new().build(api);
    let frame = unsafe { CallFrame::from_raw(&*fb.frame(), "t").unwrap() };
    let e = frame.stream().unwrap_err();
    assert!(e.message.contains("not supported on the Host platform"), "{}", e.message);
}

unsafe extern "C" fn dummy_handler(_: *mut sys::XLA_FFI_CallFrame) -> *mut sys::XLA_FFI_Error {
    std::ptr::null_mut()
}

#[test]
fn registration_uses_the_layout_of_the_api_version() {
    for (minor, size) in [(1, 84), (2, 84), (3, 84), (4, 92), (5, 92)] {
        let api = unsafe { Api::from_ptr(fake_api(ApiVersion::new(0, minor))).unwrap() };
        let target = format!("layout_probe_{minor}");
        unsafe { register::register_handler(api, &target, "Host", dummy_handler, 0x5) }.unwrap();
        let regs = REGISTRATIONS.lock().unwrap();
        let r = regs.iter().find(|r| r.name == target).unwrap();
        assert_eq!((r.struct_size, r.traits, r.platform.as_str()), (size, 0x5, "Host"), "FFI 0.{minor}");
        assert_eq!(r.execute, dummy_handler as usize);
    }
}

#[test]
fn registration_reports_the_runtime_error() {
    let api = unsafe { Api::from_ptr(fake_api(ApiVersion::new(0, 2))).unwrap() };
    let e = unsafe { register::register_handler(api, "x", "nowhere", dummy_handler, 0) }.unwrap_err();
    assert_eq!(e.message, "unknown platform nowhere");
    let future = unsafe { Api::from_ptr(fake_api(ApiVersion::new(1, 0))).unwrap() };
    let e = unsafe { register::register_handler(future, "x", "Host", dummy_handler, 0) }.unwrap_err();
    assert!(e.message.contains("unsupported XLA FFI API version 1.0"), "{}", e.message);
}

#[test]
fn short_api_tables_hide_later_slots() {
    let table = fake_api(V01) as *const sys::XLA_FFI_Api as *mut sys::XLA_FFI_Api;
    // Pretend the runtime's table ends right after XLA_FFI_Handler_Register.
    unsafe { (*table).struct_size = std::mem::offset_of!(sys::XLA_FFI_Api, XLA_FFI_Stream_Get) };
    let api = unsafe { Api::from_ptr(table).unwrap() };
    assert!(api_slot!(api, XLA_FFI_Handler_Register).is_some());
    assert!(api_slot!(api, XLA_FFI_Stream_Get).is_none());
}
