//! Keeps the `#[repr(C)]` mirror honest: compiles a small C program against XLA's real
//! `c_api.h` (from the jaxlib wheels `scripts/setup.sh` installs, FFI 0.2 and 0.3) and compares
//! every offset, size and counted struct size the mirror relies on with Rust's view.
//!
//! Header directories: `$XLA_FFI_INCLUDE_DIRS` (colon-separated), else every
//! `.venv/*/lib/python3*/site-packages/jaxlib/include` of the repository.

use std::collections::BTreeMap;
use std::mem::{offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use xla_ffi_sys::*;

/// (C expression printed by the probe, the value Rust computes).
fn rust_layout() -> Vec<(String, usize)> {
    let mut v: Vec<(String, usize)> = Vec::new();
    macro_rules! fields {
        ($ty:ident: $($f:ident),+) => {
            v.push((format!("sizeof({})", stringify!($ty)), size_of::<$ty>()));
            $( v.push((format!("offsetof({}, {})", stringify!($ty), stringify!($f)), offset_of!($ty, $f))); )+
        };
    }
    macro_rules! counted {
        ($ty:ident, $rust:expr) => {
            v.push((format!("{}_STRUCT_SIZE", stringify!($ty)), $rust));
        };
    }
    fields!(XLA_FFI_Extension_Base: struct_size, next);
    fields!(XLA_FFI_Api_Version: struct_size, extension_start, major_version, minor_version);
    fields!(XLA_FFI_Error_Create_Args: struct_size, extension_start, message, errc);
    fields!(XLA_FFI_Error_GetMessage_Args: struct_size, extension_start, error, message);
    fields!(XLA_FFI_Error_Destroy_Args: struct_size, extension_start, error);
    fields!(XLA_FFI_Buffer: struct_size, extension_start, dtype, data, rank, dims);
    fields!(XLA_FFI_ByteSpan: ptr, len);
    fields!(XLA_FFI_Scalar: dtype, value);
    fields!(XLA_FFI_Array: dtype, size, data);
    fields!(XLA_FFI_Args: struct_size, extension_start, size, types, args);
    fields!(XLA_FFI_Rets: struct_size, extension_start, size, types, rets);
    fields!(XLA_FFI_Attrs: struct_size, extension_start, size, types, names, attrs);
    fields!(XLA_FFI_CallFrame: struct_size, extension_start, api, ctx, stage, args, rets, attrs, future);
    fields!(XLA_FFI_Handler_Bundle: instantiate, prepare, initialize, execute);
    fields!(XLA_FFI_Handler_Register_Args: struct_size, extension_start, name, platform, bundle, traits);
    fields!(XLA_FFI_Stream_Get_Args: struct_size, extension_start, ctx, stream);
    fields!(XLA_FFI_DeviceOrdinal_Get_Args: struct_size, extension_start, ctx, device_ordinal);
    fields!(XLA_FFI_Metadata: struct_size, api_version, traits, state_type_id);
    fields!(XLA_FFI_Metadata_Extension: extension_base, metadata);
    fields!(XLA_FFI_Api: struct_size, extension_start, api_version, internal_api,
        XLA_FFI_Error_Create, XLA_FFI_Error_GetMessage, XLA_FFI_Error_Destroy,
        XLA_FFI_Handler_Register, XLA_FFI_Stream_Get, XLA_FFI_Type_Register,
        XLA_FFI_ExecutionContext_Get, XLA_FFI_State_Set, XLA_FFI_State_Get,
        XLA_FFI_DeviceMemory_Allocate, XLA_FFI_DeviceMemory_Free, XLA_FFI_ThreadPool_Schedule,
        XLA_FFI_ThreadPool_NumThreads, XLA_FFI_Future_Create, XLA_FFI_Future_SetAvailable,
        XLA_FFI_Future_SetError, XLA_FFI_RunId_Get, XLA_FFI_DeviceOrdinal_Get);
    counted!(XLA_FFI_Api_Version, XLA_FFI_Api_Version_STRUCT_SIZE);
    counted!(XLA_FFI_Error_Create_Args, XLA_FFI_Error_Create_Args_STRUCT_SIZE);
    counted!(XLA_FFI_Error_GetMessage_Args, XLA_FFI_Error_GetMessage_Args_STRUCT_SIZE);
    counted!(XLA_FFI_Error_Destroy_Args, XLA_FFI_Error_Destroy_Args_STRUCT_SIZE);
    counted!(XLA_FFI_Buffer, XLA_FFI_Buffer_STRUCT_SIZE);
    counted!(XLA_FFI_Args, XLA_FFI_Args_STRUCT_SIZE);
    counted!(XLA_FFI_Rets, XLA_FFI_Rets_STRUCT_SIZE);
    counted!(XLA_FFI_Attrs, XLA_FFI_Attrs_STRUCT_SIZE);
    counted!(XLA_FFI_CallFrame, XLA_FFI_CallFrame_STRUCT_SIZE);
    counted!(XLA_FFI_Handler_Register_Args, XLA_FFI_Handler_Register_Args_STRUCT_SIZE);
    counted!(XLA_FFI_Stream_Get_Args, XLA_FFI_Stream_Get_Args_STRUCT_SIZE);
    counted!(XLA_FFI_DeviceOrdinal_Get_Args, XLA_FFI_DeviceOrdinal_Get_Args_STRUCT_SIZE);
    counted!(XLA_FFI_Metadata, XLA_FFI_Metadata_STRUCT_SIZE);
    counted!(XLA_FFI_Metadata_Extension, XLA_FFI_Metadata_Extension_STRUCT_SIZE);
    counted!(XLA_FFI_Api, XLA_FFI_Api_STRUCT_SIZE);
    // Enum values the mirror hard-codes.
    for (name, value) in [
        ("XLA_FFI_DataType_F16", XLA_FFI_DataType_F16),
        ("XLA_FFI_DataType_F32", XLA_FFI_DataType_F32),
        ("XLA_FFI_DataType_BF16", XLA_FFI_DataType_BF16),
        ("XLA_FFI_DataType_S32", XLA_FFI_DataType_S32),
        ("XLA_FFI_DataType_S64", XLA_FFI_DataType_S64),
        ("XLA_FFI_DataType_U8", XLA_FFI_DataType_U8),
        ("XLA_FFI_DataType_F64", XLA_FFI_DataType_F64),
        ("XLA_FFI_DataType_PRED", XLA_FFI_DataType_PRED),
        ("XLA_FFI_AttrType_SCALAR", XLA_FFI_AttrType_SCALAR),
        ("XLA_FFI_AttrType_STRING", XLA_FFI_AttrType_STRING),
        ("XLA_FFI_AttrType_ARRAY", XLA_FFI_AttrType_ARRAY),
        ("XLA_FFI_AttrType_DICTIONARY", XLA_FFI_AttrType_DICTIONARY),
        ("XLA_FFI_ExecutionStage_EXECUTE", XLA_FFI_ExecutionStage_EXECUTE),
        ("XLA_FFI_Extension_Metadata", XLA_FFI_Extension_Metadata),
        ("XLA_FFI_Error_Code_INVALID_ARGUMENT", XLA_FFI_Error_Code_INVALID_ARGUMENT),
        ("XLA_FFI_Error_Code_UNIMPLEMENTED", XLA_FFI_Error_Code_UNIMPLEMENTED),
        ("XLA_FFI_Error_Code_INTERNAL", XLA_FFI_Error_Code_INTERNAL),
    ] {
        v.push((name.to_string(), value as usize));
    }
    v
}

fn header_dirs() -> Vec<PathBuf> {
    if let Ok(dirs) = std::env::var("XLA_FFI_INCLUDE_DIRS") {
        return dirs.split(':').filter(|d| !d.is_empty()).map(PathBuf::from).collect();
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../..");
    let mut found = Vec::new();
    if let Ok(venvs) = std::fs::read_dir(repo.join(".venv")) {
        for venv in venvs.flatten() {
            if let Ok(libs) = std::fs::read_dir(venv.path().join("lib")) {
                for py in libs.flatten() {
                    let inc = py.path().join("site-packages/jaxlib/include");
                    if inc.join("xla/ffi/api/c_api.h").is_file() {
                        found.push(inc);
                    }
                }
            }
        }
    }
    found.sort();
    found
}

/// Compiles and runs the probe against one header; returns expression -> value.
fn c_layout(include: &Path, exprs: &[String]) -> BTreeMap<String, usize> {
    let dir = std::env::temp_dir().join(format!("xla_ffi_layout_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut src = String::from("#include <stdio.h>\n#include <stddef.h>\n#include \"xla/ffi/api/c_api.h\"\nint main(void) {\n");
    for e in exprs {
        src.push_str(&format!("  printf(\"%s=%zu\\n\", \"{e}\", (size_t)({e}));\n"));
    }
    src.push_str("  return 0;\n}\n");
    let c = dir.join("probe.c");
    let exe = dir.join("probe");
    std::fs::write(&c, src).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .arg("-std=c11")
        .arg("-I")
        .arg(include)
        .arg(&c)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(out.status.success(), "C probe failed to compile against {}:\n{}", include.display(), String::from_utf8_lossy(&out.stderr));
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    String::from_utf8(run.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let (k, v) = l.rsplit_once('=').unwrap();
            (k.to_string(), v.parse().unwrap())
        })
        .collect()
}

#[test]
fn mirror_matches_the_real_c_header() {
    let dirs = header_dirs();
    assert!(
        !dirs.is_empty(),
        "no XLA FFI header found: run scripts/setup.sh (jaxlib wheels ship xla/ffi/api/c_api.h) or set XLA_FFI_INCLUDE_DIRS"
    );
    let rust = rust_layout();
    let exprs: Vec<String> = rust.iter().map(|(e, _)| e.clone()).collect();
    for dir in &dirs {
        let c = c_layout(dir, &exprs);
        let mismatches: Vec<String> = rust
            .iter()
            .filter(|(e, v)| c.get(e) != Some(v))
            .map(|(e, v)| format!("{e}: rust {v}, C {:?}", c.get(e)))
            .collect();
        assert!(mismatches.is_empty(), "layout mismatches against {}:\n{}", dir.display(), mismatches.join("\n"));
        eprintln!("layout matches {} ({} checks)", dir.display(), rust.len());
    }
}
