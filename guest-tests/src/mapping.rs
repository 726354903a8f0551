//! Memory this process maps for devices (a BAR from sysfs, a locked DMA buffer), touched
//! only through volatile accesses: the device may change it at any time. Accesses outside
//! the mapping or misaligned read all-ones and drop writes, as an unclaimed PCI access
//! would, rather than fault. Both kinds read and write through [`Mmio`], so one routine
//! fills or checks either.

use std::os::fd::RawFd;
use std::ptr::NonNull;

use crate::pcidev::Mmio;

/// A shared or private mapping of `len` bytes, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes read-write with mmap `flags`, of `fd` from its start (-1 with
    /// `MAP_ANONYMOUS`); `what` names it in errors.
    pub fn new(len: usize, flags: libc::c_int, fd: RawFd, what: &str) -> Result<Mapping, String> {
        // SAFETY: a fresh mapping at an address the kernel picks; nothing existing is
        // replaced. The result is checked before use.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap of {what}: {}", std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| format!("mmap of {what} returned null"))?;
        Ok(Mapping { ptr, len })
    }

    /// Mapped length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the mapping starts in this process.
    pub fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// A pointer to `size` bytes at `offset` when they lie in the mapping, naturally aligned.
    pub fn at(&self, offset: usize, size: usize) -> Option<*mut u8> {
        let fits = offset.checked_add(size).is_some_and(|end| end <= self.len);
        // SAFETY: `offset + size <= len`, so the pointer stays inside the mapping.
        (fits && offset % size == 0).then(|| unsafe { self.ptr.as_ptr().add(offset) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps (and so unlocks) exactly the range mapped in `new`; no pointer into
        // it outlives self.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A type whose memory is a [`Mapping`]: it reads and writes as [`Mmio`].
pub trait Mapped {
    /// The mapping.
    fn mapping(&self) -> &Mapping;
}

impl<T: Mapped> Mmio for T {
    fn read32(&mut self, offset: usize) -> u32 {
        // SAFETY: `at` checked bounds and alignment inside the live mapping.
        self.mapping().at(offset, 4).map_or(u32::MAX, |p| unsafe { std::ptr::read_volatile(p.cast::<u32>()) })
    }

    fn write32(&mut self, offset: usize, value: u32) {
        if let Some(p) = self.mapping().at(offset, 4) {
            // SAFETY: `at` checked bounds and alignment inside the live mapping.
            unsafe { std::ptr::write_volatile(p.cast::<u32>(), value) };
        }
    }

    fn read64(&mut self, offset: usize) -> u64 {
        // SAFETY: `at` checked bounds and alignment inside the live mapping.
        self.mapping().at(offset, 8).map_or(u64::MAX, |p| unsafe { std::ptr::read_volatile(p.cast::<u64>()) })
    }

    fn write64(&mut self, offset: usize, value: u64) {
        if let Some(p) = self.mapping().at(offset, 8) {
            // SAFETY: `at` checked bounds and alignment inside the live mapping.
            unsafe { std::ptr::write_volatile(p.cast::<u64>(), value) };
        }
    }
}
