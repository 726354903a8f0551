//! Absent functions as the guest reads them: all-ones, from memory.
//!
//! A guest enumerating a bus reads the vendor ID of every device slot on it, and Linux
//! scans all 32 slots of each root bus and switch bus. Where no function is, each such
//! read was an exit that returned all-ones: 268 of them at boot on vela-a100, 61 on
//! minimal. A long run of absent functions on a bus a guest scans in full
//! ([`crate::pci::PciSegment::absent_ranges`]) is now all-ones memory, mapped read-only:
//! those reads cost no exit. Writes there still exit, and are dropped as before.
//!
//! The memory is eight device slots' worth (256 KiB) of all-ones in a memfd, mapped over
//! and over to span a run (up to a whole bus, 1 MiB): whatever the guest reads, the VMM
//! holds 256 KiB for it. The file's mappings are named in `/proc/self/smaps`, where the VMM's
//! own RSS figure counts them once (by Pss).
//!
//! Written by hand: no rust-vmm crate offers a pattern-filled memory file, or one mapped
//! repeatedly.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

/// Bytes of all-ones the file holds: eight device slots (64 functions of 4 KiB). Nested,
/// each mmap of it costs a few hundred microseconds, so a whole bus takes four.
const CHUNK: usize = 256 << 10;

/// The memfd's name, as `/proc/self/smaps` shows its mappings (`/memfd:NAME`).
pub const NAME: &str = "gdrvm-absent-functions";

/// A memfd of [`CHUNK`] bytes of all-ones.
pub struct AllOnes {
    file: File,
}

impl AllOnes {
    /// The file, filled.
    pub fn new() -> std::io::Result<AllOnes> {
        let name = CString::new(NAME).unwrap_or_default();
        // SAFETY: `name` is a valid NUL-terminated string; memfd_create has no other inputs.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor this function owns and nothing else refers to.
        let file = unsafe { File::from_raw_fd(fd) };
        // From one page, not a CHUNK-sized buffer: stack pages once touched stay resident.
        let page = [0xffu8; 4096];
        for at in (0..CHUNK).step_by(page.len()) {
            file.write_all_at(&page, at as u64)?;
        }
        Ok(AllOnes { file })
    }

    /// `len` bytes (a multiple of 4 KiB) of all-ones in one range of this process, read-only.
    pub fn map(&self, len: usize) -> std::io::Result<OnesMapping> {
        // SAFETY: a fresh anonymous reservation (no address hint), checked before use.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let mapping = OnesMapping { addr, len };
        for at in (0..len).step_by(CHUNK) {
            let n = CHUNK.min(len - at);
            // SAFETY: replaces `n` bytes inside the reservation this function just made
            // (MAP_FIXED there only), with the file's first `n` bytes; checked below.
            let chunk = unsafe {
                libc::mmap(
                    addr.cast::<u8>().add(at).cast(),
                    n,
                    libc::PROT_READ,
                    libc::MAP_SHARED | libc::MAP_FIXED,
                    self.file.as_raw_fd(),
                    0,
                )
            };
            if chunk == libc::MAP_FAILED {
                // `mapping` unmaps the whole range on the way out.
                return Err(std::io::Error::last_os_error());
            }
        }
        Ok(mapping)
    }
}

/// A range of all-ones mapped into this process; unmapped on drop.
pub struct OnesMapping {
    addr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the range is owned by this value and only read (by KVM, and in tests); the
// pointer is used for address arithmetic and handed to KVM.
unsafe impl Send for OnesMapping {}
// SAFETY: as above; nothing mutates through a shared reference.
unsafe impl Sync for OnesMapping {}

impl OnesMapping {
    /// Its address in this process.
    pub fn host_addr(&self) -> u64 {
        self.addr as u64
    }
}

impl Drop for OnesMapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the range this value reserved; its KVM slot is removed
        // before (the owner removes slots first).
        unsafe { libc::munmap(self.addr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_bus_of_all_ones_from_a_small_file() {
        let ones = AllOnes::new().unwrap();
        assert_eq!(ones.file.metadata().unwrap().len(), CHUNK as u64);
        // A whole bus but its first function: 255 pages, not a multiple of the chunk.
        let len = 255 << 12;
        let m = ones.map(len).unwrap();
        // SAFETY: the mapping is `len` bytes long and stays mapped while `m` lives.
        let bytes = unsafe { std::slice::from_raw_parts(m.host_addr() as *const u8, len) };
        assert!(bytes.iter().all(|&b| b == 0xff));
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let chunks = smaps.lines().filter(|l| l.ends_with(&format!("/memfd:{NAME} (deleted)"))).count();
        assert!(chunks >= len.div_ceil(CHUNK), "{chunks} mappings of the file");
    }
}
