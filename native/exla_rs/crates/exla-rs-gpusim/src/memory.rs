//! Simulated device allocations. Each buffer a kernel reads or writes gets its own allocation of
//! exactly its size (as `cudaMalloc` gives XLA's buffers), so AddressSanitizer reports an access
//! one byte past a tensor as memcheck would on the GPU; aligned like `cudaMalloc` (256 bytes), so
//! the alignment rules the launcher relies on (TMA's 16-byte global addresses, vector loads) hold.

/// `cudaMalloc`'s alignment.
const ALIGN: usize = 256;

/// An exactly-sized, 256-byte-aligned host allocation standing in for device memory.
pub struct DeviceAlloc {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned and only reached through this value (or raw device pointers the
// owner hands to a launch it waits for).
unsafe impl Send for DeviceAlloc {}

impl DeviceAlloc {
    /// `len` bytes, each `byte` (0xFF: the NaN poison of an unwritten output).
    pub fn filled(len: usize, byte: u8) -> Result<Self, String> {
        let mut ptr: *mut libc::c_void = std::ptr::null_mut();
        // SAFETY: posix_memalign writes `ptr` on success; ALIGN is a power of two multiple of
        // sizeof(void*). Size 0 gives NULL or a unique pointer, both fine for an empty buffer.
        let rc = unsafe { libc::posix_memalign(&mut ptr, ALIGN, len) };
        if rc != 0 || (ptr.is_null() && len > 0) {
            return Err(format!("cannot allocate {len} bytes of simulated device memory (posix_memalign: {rc})"));
        }
        let a = Self { ptr: ptr.cast(), len };
        if len > 0 {
            // SAFETY: `len` writable bytes just allocated.
            unsafe { std::ptr::write_bytes(a.ptr, byte, len) };
            // Device memory for the executor's traffic count (global bytes: exec.h).
            // SAFETY: a live allocation of `len` bytes, unregistered before it is freed.
            unsafe { crate::ffi::exla_rs_gpusim_register_alloc(a.ptr.cast(), len) };
        }
        Ok(a)
    }

    /// A copy of `bytes` (an input the kernels read).
    pub fn copy_of(bytes: &[u8]) -> Result<Self, String> {
        let mut a = Self::filled(bytes.len(), 0)?;
        a.as_mut_slice().copy_from_slice(bytes);
        Ok(a)
    }

    /// The "device pointer" (`CUdeviceptr`) a launch receives.
    pub fn addr(&self) -> u64 {
        self.ptr as usize as u64
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as above, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // SAFETY: unregistering an address (registered or not) only edits the executor's table;
        // allocated by posix_memalign (free accepts NULL).
        unsafe {
            crate::ffi::exla_rs_gpusim_unregister_alloc(self.ptr.cast());
            libc::free(self.ptr.cast());
        }
    }
}

impl std::fmt::Debug for DeviceAlloc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceAlloc({:#x}, {} bytes)", self.addr(), self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_exact_aligned_and_filled() {
        for len in [0usize, 1, 6, 255, 4096 + 3] {
            let a = DeviceAlloc::filled(len, 0xFF).unwrap();
            assert_eq!(a.len(), len);
            assert_eq!(a.addr() % ALIGN as u64, 0, "len {len}");
            assert!(a.as_slice().iter().all(|&b| b == 0xFF));
        }
        let src: Vec<u8> = (0..=200).collect();
        let mut c = DeviceAlloc::copy_of(&src).unwrap();
        assert_eq!(c.as_slice(), &src[..]);
        c.as_mut_slice()[7] = 1;
        assert_eq!(c.as_slice()[7], 1);
        assert!(DeviceAlloc::copy_of(&[]).unwrap().is_empty());
    }
}
