//! The CUDA driver API through cudarc's `sys` bindings, loaded with dlopen: device facts,
//! copy bandwidth, peer access and dma-buf export, every failure a [`CudaError`] naming the
//! call. Each device is driven through its primary context.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::fmt;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdeviceptr, CUresult};

/// Every driver symbol this module calls: checked before the first call, because cudarc
/// panics on a missing one (and the release profile aborts on panic).
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDeviceGetP2PAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuCtxEnablePeerAccess",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoD_v2",
    "cuMemcpyDtoH_v2",
    "cuMemcpyPeer",
];

/// Exports GPU memory as a dma-buf (CUDA 11.7+); probed on its own so an older driver only
/// loses that check.
const DMABUF_SYMBOL: &str = "cuMemGetHandleForAddressRange";

/// A failed driver call: which one, and CUDA's name and text for the error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaError {
    /// The call, e.g. `cuInit`.
    pub call: &'static str,
    /// `CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected`.
    pub error: String,
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, self.error)
    }
}

impl std::error::Error for CudaError {}

/// CUDA's name and description of `r` (`CUDA_ERROR_NO_DEVICE: no CUDA-capable ...`).
fn describe(r: CUresult) -> String {
    let (mut name, mut text): (*const c_char, *const c_char) = (std::ptr::null(), std::ptr::null());
    // SAFETY: both calls only write a pointer to a static string owned by the driver (or
    // leave it null for an unknown code), which stays valid for the life of the process.
    let (nr, tr) = unsafe { (sys::cuGetErrorName(r, &mut name), sys::cuGetErrorString(r, &mut text)) };
    let read = |ok: CUresult, p: *const c_char| {
        // SAFETY: on success `p` is the driver's NUL-terminated static string.
        (ok == CUresult::CUDA_SUCCESS && !p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy())
    };
    match (read(nr, name), read(tr, text)) {
        (Some(n), Some(t)) => format!("{n}: {t}"),
        (Some(n), None) => n.into_owned(),
        _ => format!("{r:?}"),
    }
}

fn check(call: &'static str, r: CUresult) -> Result<(), CudaError> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError { call, error: describe(r) })
    }
}

/// The loaded driver: only made by [`Driver::load`], after libcuda opened, every symbol was
/// found and `cuInit` succeeded.
pub struct Driver {
    /// Whether `cuMemGetHandleForAddressRange` exists.
    has_dmabuf: bool,
}

impl Driver {
    /// Opens libcuda, checks its symbols and calls `cuInit`; the error says which step failed.
    pub fn load() -> Result<Driver, String> {
        // SAFETY: dlopen of the driver library by name; its initialisers are NVIDIA's, run
        // once, before any other CUDA use in this process.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda cannot be loaded (no NVIDIA driver's libcuda.so on the library path)".into());
        }
        // SAFETY: the library is present (just checked), so culib() opens it instead of
        // panicking; the handle is kept for the life of the process.
        let lib = unsafe { sys::culib() };
        let has = |name: &str| {
            // SAFETY: only looks the symbol up (a data pointer type); nothing is called.
            unsafe { lib.get::<*const c_void>(name.as_bytes()) }.is_ok()
        };
        let missing: Vec<&str> = SYMBOLS.iter().copied().filter(|s| !has(s)).collect();
        if !missing.is_empty() {
            return Err(format!("libcuda lacks {} (driver too old for CUDA 12.0?)", missing.join(", ")));
        }
        // SAFETY: every symbol is present; cuInit takes flags 0 and touches no memory of ours.
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(|e| e.to_string())?;
        Ok(Driver { has_dmabuf: has(DMABUF_SYMBOL) })
    }

    /// `cuDriverGetVersion`.
    pub fn version(&self) -> Result<i32, CudaError> {
        let mut v: c_int = 0;
        // SAFETY: writes one int to `v`.
        check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) })?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub fn count(&self) -> Result<i32, CudaError> {
        let mut n: c_int = 0;
        // SAFETY: writes one int to `n`.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n)
    }

    /// Device `ordinal`, its primary context retained and made current.
    pub fn device(&self, ordinal: i32) -> Result<Device, CudaError> {
        let mut dev: CUdevice = 0;
        // SAFETY: writes one handle to `dev`.
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        let mut ctx: CUcontext = std::ptr::null_mut();
        // SAFETY: writes the primary context's handle to `ctx`; released in Device's Drop.
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        let device = Device { ordinal, dev, ctx };
        device.make_current()?;
        Ok(device)
    }

    /// `cuDeviceCanAccessPeer(a, b)` and, where the driver answers, whether native atomics
    /// work between them.
    pub fn peer(&self, a: &Device, b: &Device) -> Result<(bool, Option<bool>), CudaError> {
        let mut can: c_int = 0;
        // SAFETY: writes one int; both handles come from cuDeviceGet.
        check("cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.dev, b.dev) })?;
        let mut atomics: c_int = 0;
        let attr = sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED;
        // SAFETY: writes one int; both handles come from cuDeviceGet.
        let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut atomics, attr, a.dev, b.dev) };
        Ok((can != 0, (r == CUresult::CUDA_SUCCESS).then_some(atomics != 0)))
    }
}

/// A device with its primary context retained.
pub struct Device {
    /// CUDA ordinal.
    pub ordinal: i32,
    dev: CUdevice,
    ctx: CUcontext,
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: balances the retain in Driver::device; every allocation made in the
        // context is freed before (their guards borrow the Device).
        unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// Device memory, freed on drop.
struct DeviceBuffer<'d> {
    device: &'d Device,
    ptr: CUdeviceptr,
    len: usize,
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc in `device`'s context, which is made current
        // first; nothing uses it after this.
        unsafe {
            let _ = sys::cuCtxSetCurrent(self.device.ctx);
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// Pinned host memory, freed on drop.
struct PinnedBuffer {
    ptr: *mut c_void,
    len: usize,
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemHostAlloc (portable, so valid in every context) and
        // nothing uses it after this.
        unsafe {
            sys::cuMemFreeHost(self.ptr);
        }
    }
}

impl Device {
    fn make_current(&self) -> Result<(), CudaError> {
        // SAFETY: `ctx` is this device's retained primary context.
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }

    fn synchronize(&self) -> Result<(), CudaError> {
        self.make_current()?;
        // SAFETY: waits for the current context's work; no pointers.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// `cuDeviceGetName`.
    pub fn name(&self) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, self.dev) })?;
        Ok(c_string(&buf))
    }

    /// `cuDeviceGetPCIBusId` as sysfs names the function (`0000:3b:00.0`).
    pub fn bus_id(&self) -> Result<String, CudaError> {
        let mut buf = [0 as c_char; 32];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, self.dev)
        })?;
        Ok(crate::report::normalize_bus_id(&c_string(&buf)))
    }

    /// `cuDeviceTotalMem`, bytes.
    pub fn total_memory(&self) -> Result<u64, CudaError> {
        let mut bytes: usize = 0;
        // SAFETY: writes one size_t to `bytes`.
        check("cuDeviceTotalMem", unsafe { sys::cuDeviceTotalMem_v2(&mut bytes, self.dev) })?;
        Ok(bytes as u64)
    }

    fn alloc(&self, len: usize) -> Result<DeviceBuffer<'_>, CudaError> {
        self.make_current()?;
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: writes the new allocation's address to `ptr`; freed by DeviceBuffer.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, len) })?;
        Ok(DeviceBuffer { device: self, ptr, len })
    }

    /// Host-to-device and device-to-host bandwidth in GB/s: `copies` copies of `len` bytes
    /// each way between pinned host memory and the device, after one untimed copy.
    pub fn host_bandwidth(&self, len: usize, copies: u32) -> Result<(f64, f64), CudaError> {
        let dbuf = self.alloc(len)?;
        let host = pinned(len)?;
        let h2d = timed(copies, || {
            // SAFETY: both buffers are `len` bytes and live for the call; the device
            // buffer's context is current (alloc made it so, and nothing changed it).
            check("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(dbuf.ptr, host.ptr, host.len) })?;
            self.synchronize()
        })?;
        let d2h = timed(copies, || {
            // SAFETY: as above, the other way.
            check("cuMemcpyDtoH", unsafe { sys::cuMemcpyDtoH_v2(host.ptr, dbuf.ptr, dbuf.len) })?;
            self.synchronize()
        })?;
        Ok((gbps(len, copies, h2d), gbps(len, copies, d2h)))
    }

    /// Exports a small allocation as a dma-buf, hands its fd and length to `with` while the
    /// allocation lives, then closes the fd.
    pub fn dmabuf_export<R>(&self, driver: &Driver, with: impl FnOnce(c_int, usize) -> R) -> Result<R, String> {
        if !driver.has_dmabuf {
            return Err(format!("libcuda lacks {DMABUF_SYMBOL} (driver older than CUDA 11.7)"));
        }
        // One 2 MiB page: the range must be aligned to the host page size.
        let dbuf = self.alloc(2 << 20).map_err(|e| e.to_string())?;
        let mut fd: c_int = -1;
        let kind = sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD;
        // SAFETY: the driver writes an int fd to `fd` for the range [ptr, ptr + len) of a live
        // allocation in the current context.
        let r =
            unsafe { sys::cuMemGetHandleForAddressRange((&mut fd as *mut c_int).cast(), dbuf.ptr, dbuf.len, kind, 0) };
        check("cuMemGetHandleForAddressRange", r).map_err(|e| e.to_string())?;
        if fd < 0 {
            return Err(format!("cuMemGetHandleForAddressRange returned fd {fd}"));
        }
        let out = with(fd, dbuf.len);
        // SAFETY: the fd was created for us above and is closed once, after its user.
        unsafe { libc::close(fd) };
        Ok(out)
    }

    /// Peer copy bandwidth from this device to `to`, GB/s, with peer access enabled.
    pub fn peer_bandwidth(&self, to: &Device, len: usize, copies: u32) -> Result<f64, CudaError> {
        self.make_current()?;
        // SAFETY: enables access from the current (this) context to `to`'s context; already
        // enabled is fine.
        let r = unsafe { sys::cuCtxEnablePeerAccess(to.ctx, 0) };
        if r != CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            check("cuCtxEnablePeerAccess", r)?;
        }
        let src = self.alloc(len)?;
        let dst = to.alloc(len)?;
        timed(copies, || {
            // SAFETY: both allocations are `len` bytes, live, each in the context given.
            check("cuMemcpyPeer", unsafe { sys::cuMemcpyPeer(dst.ptr, to.ctx, src.ptr, self.ctx, len) })?;
            to.synchronize()?;
            self.synchronize()
        })
        .map(|t| gbps(len, copies, t))
    }
}

fn pinned(len: usize) -> Result<PinnedBuffer, CudaError> {
    let mut ptr: *mut c_void = std::ptr::null_mut();
    // SAFETY: writes the new allocation's address to `ptr`; freed by PinnedBuffer.
    check("cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut ptr, len, sys::CU_MEMHOSTALLOC_PORTABLE) })?;
    Ok(PinnedBuffer { ptr, len })
}

/// Runs `copy` once untimed, then `copies` times; the time of those.
fn timed(copies: u32, mut copy: impl FnMut() -> Result<(), CudaError>) -> Result<Duration, CudaError> {
    copy()?;
    let start = Instant::now();
    for _ in 0..copies {
        copy()?;
    }
    Ok(start.elapsed())
}

/// 10^9 bytes per second.
pub fn gbps(len: usize, copies: u32, took: Duration) -> f64 {
    let secs = took.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    len as f64 * f64::from(copies) / secs / 1e9
}

fn c_string(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_gbps_and_names() {
        assert_eq!(gbps(1_000_000_000, 2, Duration::from_secs(1)), 2.0);
        assert_eq!(gbps(64 << 20, 4, Duration::ZERO), 0.0);
        let mut buf = [0 as c_char; 8];
        for (i, b) in b"H200 \0xy".iter().enumerate() {
            buf[i] = *b as c_char;
        }
        assert_eq!(c_string(&buf), "H200");
    }
}
