//! Absent functions as the guest reads them: all-ones, from memory.
//!
//! A guest enumerating a bus reads the vendor ID of every device slot on it, and Linux
//! scans all 32 slots of each root bus and switch bus. Where no function is, each such
//! read was an exit that returned all-ones: 268 of them at boot on vela-a100, 61 on
//! minimal. One small file of all-ones, mapped read-only over each run of absent
//! functions on the buses a guest scans ([`crate::pci::PciSegment::absent_ranges`]),
//! answers those reads without an exit. Writes there still exit, and are dropped as
//! before; the file's pages are shared by every run, so the guest can make the VMM hold
//! at most the longest run's size of them.
//!
//! Written by hand: no rust-vmm crate offers a pattern-filled memory file.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use super::memslots::{DeviceMemory, MemslotError};

/// A memfd of all-ones, as long as the longest run it backs.
pub struct AllOnes {
    file: Arc<File>,
    len: u64,
}

impl AllOnes {
    /// `len` bytes of all-ones (a multiple of 4 KiB).
    pub fn new(len: u64) -> std::io::Result<AllOnes> {
        let name = CString::new("gdrvm-absent-functions").unwrap_or_default();
        // SAFETY: `name` is a valid NUL-terminated string; memfd_create has no other inputs.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor this function owns and nothing else refers to.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len)?;
        // Written, not mapped and stored: the pages stay out of this process's RSS until
        // the guest reads them.
        let ones = [0xffu8; 64 << 10];
        let mut at = 0;
        while at < len {
            let n = ones.len().min(usize::try_from(len - at).unwrap_or(ones.len()));
            file.write_all_at(&ones[..n], at)?;
            at += n as u64;
        }
        Ok(AllOnes { file: Arc::new(file), len })
    }

    /// Its first `len` bytes mapped into this process (at most its length).
    pub fn map(&self, len: u64) -> Result<DeviceMemory, MemslotError> {
        DeviceMemory::map(&self.file, 0, len.min(self.len))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_all_ones_maps_as_all_ones() {
        let ones = AllOnes::new(3 << 12).unwrap();
        let m = ones.map(2 << 12).unwrap();
        // SAFETY: the mapping is 8 KiB long and stays mapped while `m` lives.
        let bytes = unsafe { std::slice::from_raw_parts(m.host_addr(0) as *const u8, 2 << 12) };
        assert!(bytes.iter().all(|&b| b == 0xff));
        let mut tail = [0u8; 4];
        ones.file.read_exact_at(&mut tail, (3 << 12) - 4).unwrap();
        assert_eq!(tail, [0xff; 4]);
    }
}
