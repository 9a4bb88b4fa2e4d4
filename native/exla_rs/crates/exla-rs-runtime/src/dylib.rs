//! `dlopen`/`dlsym` for the two things we do with shared objects: look into one that is already
//! loaded (`RTLD_NOLOAD`: never loads, never runs constructors) and load a PJRT plugin on purpose.

use std::ffi::{c_void, CStr, CString};
use std::path::Path;

/// A `dlopen` handle. Dropping it releases our reference (`dlclose`); the object stays loaded as
/// long as whoever loaded it first holds theirs.
pub struct Library {
    handle: *mut c_void,
}

// SAFETY: a dlopen handle is a process-wide token; dlsym/dlclose are thread-safe in glibc.
unsafe impl Send for Library {}
// SAFETY: &Library only allows dlsym, which is thread-safe.
unsafe impl Sync for Library {}

impl Library {
    /// The already-loaded object at `path`, or an error saying it is not loaded. Never loads it.
    pub fn open_loaded(path: &Path) -> Result<Self, String> {
        Self::dlopen(path, libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_LOCAL)
            .map_err(|e| format!("{} is not loaded in this process ({e})", path.display()))
    }

    /// Loads `path` (or takes another reference to it when it is loaded already), local symbols.
    pub fn load(path: &Path) -> Result<Self, String> {
        Self::dlopen(path, libc::RTLD_NOW | libc::RTLD_LOCAL).map_err(|e| format!("cannot load {}: {e}", path.display()))
    }

    /// Whether `path` is loaded in this process right now.
    pub fn is_loaded(path: &Path) -> bool {
        Self::open_loaded(path).is_ok()
    }

    fn dlopen(path: &Path, flags: libc::c_int) -> Result<Self, String> {
        let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| "path contains a NUL byte".to_string())?;
        // SAFETY: c_path is a valid C string; dlerror is read right after on this thread.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), flags) };
        if handle.is_null() {
            Err(last_dl_error().unwrap_or_else(|| "dlopen failed".into()))
        } else {
            Ok(Self { handle })
        }
    }

    /// The address of `name`, if the object (or its dependencies) defines it.
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c_name = CString::new(name).ok()?;
        // SAFETY: handle is live; clear dlerror first, as the man page asks.
        unsafe {
            libc::dlerror();
            let sym = libc::dlsym(self.handle, c_name.as_ptr());
            (!sym.is_null()).then_some(sym)
        }
    }

    /// Whether `name` resolves to code inside the object at `path` itself (`dlsym` on a handle
    /// also searches the object's dependencies; `dladdr` says where the symbol really lives).
    pub fn defines(&self, name: &str, path: &Path) -> bool {
        let Some(sym) = self.symbol(name) else { return false };
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: sym is an address inside a loaded object; info is writable.
        if unsafe { libc::dladdr(sym, &mut info) } == 0 || info.dli_fname.is_null() {
            return false;
        }
        // SAFETY: dli_fname is a C string owned by the loader.
        let owner = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned();
        same_file(Path::new(&owner), path)
    }

    /// Keeps the object loaded for the rest of the process (our handlers live in its registry).
    pub fn keep_loaded(self) {
        std::mem::forget(self);
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and is released once.
        unsafe {
            libc::dlclose(self.handle);
        }
    }
}

/// Whether two paths name the same file (symlinks and relative paths resolved).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

fn last_dl_error() -> Option<String> {
    // SAFETY: dlerror returns NULL or a thread-local C string valid until the next dl* call.
    unsafe {
        let msg = libc::dlerror();
        (!msg.is_null()).then(|| CStr::from_ptr(msg).to_string_lossy().into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn libc_path() -> std::path::PathBuf {
        crate::proc_maps::current_process()
            .unwrap()
            .into_iter()
            .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("libc.so"))
            .expect("libc is mapped")
    }

    #[test]
    fn opens_a_loaded_library_and_finds_symbols() {
        let lib = Library::open_loaded(&libc_path()).unwrap();
        assert!(lib.symbol("malloc").is_some());
        assert!(lib.symbol("no_such_symbol_exla_rs").is_none());
    }

    #[test]
    fn defines_checks_where_a_symbol_lives() {
        let path = libc_path();
        let lib = Library::open_loaded(&path).unwrap();
        assert!(lib.defines("malloc", &path));
        assert!(!lib.defines("malloc", Path::new("/usr/lib/x86_64-linux-gnu/libm.so.6")));
    }

    #[test]
    fn never_loads_with_noload() {
        let err = Library::open_loaded(Path::new("/nonexistent/libnothing.so")).err().unwrap();
        assert!(err.contains("is not loaded"), "{err}");
        assert!(!Library::is_loaded(Path::new("/nonexistent/libnothing.so")));
    }

    #[test]
    fn load_reports_missing_files() {
        let err = Library::load(Path::new("/nonexistent/libnothing.so")).err().unwrap();
        assert!(err.starts_with("cannot load /nonexistent/libnothing.so"), "{err}");
    }
}
