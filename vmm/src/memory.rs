//! Guest RAM: one memfd mapped into the VMM, so that device processes (vfio-user servers)
//! can map the same pages for DMA.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::FromRawFd;

use gdrvm_model::layout;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// memfd_create failed.
    #[error("cannot create the guest memory file")]
    Memfd(#[source] std::io::Error),
    /// The memfd could not be sized.
    #[error("cannot size the guest memory file to {0} bytes")]
    Size(u64, #[source] std::io::Error),
    /// Mapping the regions failed.
    #[error("cannot map guest memory")]
    Map(#[source] vm_memory::mmap::FromRangesError),
}

/// Guest RAM and the file backing it.
pub struct GuestRam {
    /// The mapped regions.
    pub memory: GuestMemoryMmap,
    /// The memfd (kept so later devices can share it).
    pub file: File,
}

/// Creates `size` bytes of guest RAM laid out by [`layout::ram_ranges`].
pub fn create(size: u64) -> Result<GuestRam, MemoryError> {
    let name = CString::new("gdrvm-guest-ram").unwrap_or_default();
    // SAFETY: `name` is a valid NUL-terminated string; memfd_create has no other inputs.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(MemoryError::Memfd(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh descriptor we own and nothing else refers to it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).map_err(|e| MemoryError::Size(size, e))?;

    let mut offset = 0u64;
    let mut ranges = Vec::new();
    for (start, len) in layout::ram_ranges(size) {
        let fo = FileOffset::new(file.try_clone().map_err(MemoryError::Memfd)?, offset);
        ranges.push((GuestAddress(start), len as usize, Some(fo)));
        offset += len;
    }
    let memory = GuestMemoryMmap::from_ranges_with_files(ranges).map_err(MemoryError::Map)?;
    advise_huge_pages(&memory);
    Ok(GuestRam { memory, file })
}

/// Asks for transparent huge pages behind guest RAM, as QEMU does for its RAM: KVM then
/// maps guest memory 2 MiB at a time, one page fault (a costly exit when nested) where
/// there were 512. For memfd pages the host must allow it
/// (`/sys/kernel/mm/transparent_hugepage/shmem_enabled` = `advise`, which L1 sets);
/// where it does not, the advice does nothing and RAM stays in 4 KiB pages.
fn advise_huge_pages(memory: &GuestMemoryMmap) {
    for region in memory.iter() {
        let addr = region.as_ptr();
        // SAFETY: `addr` and `len` are a mapping guest memory owns for its lifetime;
        // MADV_HUGEPAGE only changes how the kernel backs it, never its contents.
        let rc = unsafe { libc::madvise(addr.cast(), region.len() as usize, libc::MADV_HUGEPAGE) };
        if rc != 0 {
            tracing::debug!(err = %std::io::Error::last_os_error(), "no huge pages for guest RAM");
        }
    }
}

#[cfg(test)]
mod tests {
    use vm_memory::{Bytes, GuestMemoryBackend};

    use super::*;

    #[test]
    fn test_memfd_backs_both_ranges() {
        // 3 GiB + 64 MiB: the last 64 MiB land above 4 GiB. memfd pages are allocated lazily.
        let size = layout::MMIO_HOLE_START + (64 << 20);
        let ram = create(size).unwrap();
        assert_eq!(ram.memory.num_regions(), 2);
        ram.memory.write_obj(0xabcd_u32, GuestAddress(layout::FOUR_GIB)).unwrap();
        assert_eq!(ram.memory.read_obj::<u32>(GuestAddress(layout::FOUR_GIB)).unwrap(), 0xabcd);
        assert!(ram.memory.read_obj::<u32>(GuestAddress(layout::MMIO_HOLE_START)).is_err());
        assert_eq!(ram.file.metadata().unwrap().len(), size);
    }
}
