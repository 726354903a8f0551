//! Device memory in the guest: a BAR's device memory mapped into the VMM (mmap of the
//! device's fd) and given to KVM as a memory slot at the BAR's guest address, so guest
//! accesses reach the device without an exit.
//!
//! Written by hand: vm-memory maps guest RAM, not device regions that come and go while
//! the VM runs.

use std::os::fd::AsRawFd;
use std::sync::Mutex;

use gdrvm_devices::lock;
use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_READONLY};
use kvm_ioctls::{IoEventAddress, NoDatamatch, VmFd};
use vmm_sys_util::eventfd::EventFd;

/// First slot for device memory: guest RAM takes the slots below.
const FIRST_DEVICE_SLOT: u32 = 16;

/// Errors mapping device memory.
#[derive(Debug, thiserror::Error)]
pub enum MemslotError {
    /// mmap of the device's fd failed.
    #[error("cannot map {len:#x} bytes of device memory at offset {offset:#x}")]
    Mmap {
        /// Bytes asked for.
        len: u64,
        /// Offset in the device's fd.
        offset: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// KVM refused the memory slot.
    #[error("KVM: cannot {what} memory slot {slot} at {gpa:#x}")]
    Kvm {
        /// Add or remove.
        what: &'static str,
        /// The slot.
        slot: u32,
        /// Guest-physical address.
        gpa: u64,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Every slot KVM offers is taken.
    #[error("no free KVM memory slot (KVM offers {0})")]
    Exhausted(u32),
}

/// Device memory mapped into this process; unmapped on drop.
pub struct DeviceMemory {
    addr: *mut libc::c_void,
    len: usize,
    /// The file it maps and the offset of the mapping in it, for DMA targets in other
    /// processes (vfio-user servers map it themselves).
    file: std::sync::Arc<std::fs::File>,
    offset: u64,
}

// SAFETY: the mapping is plain shared memory owned by this value; the pointer is only
// handed to KVM and used for address arithmetic, never dereferenced by this process.
unsafe impl Send for DeviceMemory {}
// SAFETY: as above; no method mutates through a shared reference.
unsafe impl Sync for DeviceMemory {}

impl DeviceMemory {
    /// Maps `len` bytes of `fd` at `offset`, shared, read-write.
    pub fn map(fd: &std::sync::Arc<std::fs::File>, offset: u64, len: u64) -> Result<DeviceMemory, MemslotError> {
        let err = |source| MemslotError::Mmap { len, offset, source };
        let size = usize::try_from(len).map_err(|_| err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
        let off =
            libc::off_t::try_from(offset).map_err(|_| err(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
        // SAFETY: a fresh mapping (no address hint) of a valid fd; the kernel checks the
        // range against the fd, and the result is checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                off,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(err(std::io::Error::last_os_error()));
        }
        Ok(DeviceMemory { addr, len: size, file: fd.clone(), offset })
    }

    /// The host address `offset` bytes into the mapping.
    pub fn host_addr(&self, offset: u64) -> u64 {
        self.addr as u64 + offset
    }

    /// `len` bytes of this memory from `offset` on, as the DMA space holds them: at guest
    /// address `gpa`, owned by device `owner`, with the file and offset behind them.
    pub fn dma_region(
        &self,
        offset: u64,
        gpa: u64,
        len: u64,
        owner: gdrvm_devices::DeviceId,
    ) -> gdrvm_devices::DmaRegion {
        gdrvm_devices::DmaRegion {
            iova: gpa,
            size: len,
            host_addr: self.host_addr(offset),
            fd: Some((self.file.clone(), self.offset + offset)),
            owner: Some(owner),
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this value created; KVM slots over it are
        // removed before (the owner drops slots first).
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

/// What KVM offers for guest memory: KVM_SET_USER_MEMORY_REGION, and ioeventfds for
/// doorbells in device memory (a fake in tests).
pub trait MemorySink: Send + Sync {
    /// Adds, moves or (with size 0) removes a memory slot.
    ///
    /// # Safety
    /// `region.userspace_addr` must stay mapped for `region.memory_size` bytes until the
    /// slot is removed.
    unsafe fn set_region(&self, region: kvm_userspace_memory_region) -> Result<(), kvm_ioctls::Error>;
    /// Makes guest writes of any size and value to MMIO address `gpa` signal `fd` in the
    /// kernel, without an exit to the VMM (or, with `on` false, stops that).
    fn ioevent(&self, fd: &EventFd, gpa: u64, on: bool) -> Result<(), kvm_ioctls::Error>;
}

impl MemorySink for VmFd {
    unsafe fn set_region(&self, region: kvm_userspace_memory_region) -> Result<(), kvm_ioctls::Error> {
        // SAFETY: the caller keeps the memory mapped while the slot exists.
        unsafe { self.set_user_memory_region(region) }
    }

    fn ioevent(&self, fd: &EventFd, gpa: u64, on: bool) -> Result<(), kvm_ioctls::Error> {
        // NoDatamatch has no size: KVM matches a write of any length (KVM_CAP_IOEVENTFD_ANY_LENGTH).
        let at = IoEventAddress::Mmio(gpa);
        if on {
            self.register_ioevent(fd, &at, NoDatamatch)
        } else {
            self.unregister_ioevent(fd, &at, NoDatamatch)
        }
    }
}

/// KVM memory slots for device memory.
pub struct MemorySlots {
    vm: std::sync::Arc<dyn MemorySink>,
    limit: u32,
    free: Mutex<Vec<u32>>,
    next: Mutex<u32>,
}

impl MemorySlots {
    /// Slots of `vm`, up to KVM's limit.
    pub fn new(vm: std::sync::Arc<dyn MemorySink>, limit: u32) -> Self {
        MemorySlots { vm, limit, free: Mutex::new(Vec::new()), next: Mutex::new(FIRST_DEVICE_SLOT) }
    }

    /// Gives KVM `len` bytes at host address `host` as guest memory at `gpa`; returns the slot.
    pub fn add(&self, gpa: u64, host: u64, len: u64) -> Result<u32, MemslotError> {
        self.add_with(gpa, host, len, 0)
    }

    /// As [`MemorySlots::add`], read-only: guest writes there exit to the VMM as MMIO
    /// writes (KVM_MEM_READONLY).
    pub fn add_readonly(&self, gpa: u64, host: u64, len: u64) -> Result<u32, MemslotError> {
        self.add_with(gpa, host, len, KVM_MEM_READONLY)
    }

    fn add_with(&self, gpa: u64, host: u64, len: u64, flags: u32) -> Result<u32, MemslotError> {
        let slot = match lock(&self.free).pop() {
            Some(s) => s,
            None => {
                let mut next = lock(&self.next);
                if *next >= self.limit {
                    return Err(MemslotError::Exhausted(self.limit));
                }
                *next += 1;
                *next - 1
            }
        };
        let region =
            kvm_userspace_memory_region { slot, guest_phys_addr: gpa, memory_size: len, userspace_addr: host, flags };
        // SAFETY: `host..host + len` is a live mapping (a `DeviceMemory`, a configuration
        // image) that its owner keeps until it has removed this slot.
        unsafe { self.vm.set_region(region) }.map_err(|source| {
            lock(&self.free).push(slot);
            MemslotError::Kvm { what: "add", slot, gpa, source }
        })?;
        Ok(slot)
    }

    /// Removes `slot` (at `gpa`) from the guest.
    pub fn remove(&self, slot: u32, gpa: u64) -> Result<(), MemslotError> {
        let region =
            kvm_userspace_memory_region { slot, guest_phys_addr: gpa, memory_size: 0, userspace_addr: 0, flags: 0 };
        // SAFETY: a zero-sized region deletes the slot; no memory is handed to KVM.
        unsafe { self.vm.set_region(region) }.map_err(|source| MemslotError::Kvm {
            what: "remove",
            slot,
            gpa,
            source,
        })?;
        lock(&self.free).push(slot);
        Ok(())
    }
}
