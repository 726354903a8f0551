//! Pages a device can DMA to when there is no IOMMU (bus address = physical address):
//! anonymous memory, locked and touched so that it is backed and stays put, its physical
//! address read from `/proc/self/pagemap` (the kernel shows PFNs to CAP_SYS_ADMIN only).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;

/// The page size (x86-64).
pub const PAGE_SIZE: usize = 4096;

/// What a `/proc/PID/pagemap` entry says about a page (Documentation/admin-guide/mm/pagemap.rst).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageEntry {
    /// In RAM at this page frame number.
    Present {
        /// Bits 0-54.
        pfn: u64,
    },
    /// In RAM, but the PFN reads 0: the reader lacks CAP_SYS_ADMIN.
    PfnHidden,
    /// Swapped out.
    Swapped,
    /// Not backed (never touched).
    NotPresent,
}

/// Decodes a pagemap entry: bit 63 present, bit 62 swapped, bits 0-54 the PFN.
pub fn decode_pagemap(entry: u64) -> PageEntry {
    const PRESENT: u64 = 1 << 63;
    const SWAPPED: u64 = 1 << 62;
    const PFN: u64 = (1 << 55) - 1;
    if entry & PRESENT != 0 {
        match entry & PFN {
            0 => PageEntry::PfnHidden,
            pfn => PageEntry::Present { pfn },
        }
    } else if entry & SWAPPED != 0 {
        PageEntry::Swapped
    } else {
        PageEntry::NotPresent
    }
}

/// The pagemap entry of this process's virtual address `vaddr`.
pub fn pagemap_entry(vaddr: usize) -> Result<u64, String> {
    let file = File::open("/proc/self/pagemap").map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    let mut entry = [0u8; 8];
    file.read_exact_at(&mut entry, (vaddr / PAGE_SIZE * 8) as u64)
        .map_err(|e| format!("/proc/self/pagemap entry of {vaddr:#x}: {e}"))?;
    Ok(u64::from_ne_bytes(entry))
}

/// The physical address of this process's virtual address `vaddr`.
pub fn physical_address(vaddr: usize) -> Result<u64, String> {
    let entry = pagemap_entry(vaddr)?;
    match decode_pagemap(entry) {
        PageEntry::Present { pfn } => Ok(pfn * PAGE_SIZE as u64 + (vaddr % PAGE_SIZE) as u64),
        PageEntry::PfnHidden => {
            Err(format!("pagemap hides the PFN of {vaddr:#x} (entry {entry:#018x}; needs CAP_SYS_ADMIN)"))
        }
        PageEntry::Swapped => Err(format!("page of {vaddr:#x} is swapped out (entry {entry:#018x})")),
        PageEntry::NotPresent => Err(format!("page of {vaddr:#x} is not present (entry {entry:#018x})")),
    }
}

/// One locked page of anonymous memory. The device writes it behind the compiler's back,
/// so every access is volatile.
#[derive(Debug)]
pub struct PinnedPage {
    ptr: NonNull<u8>,
}

impl PinnedPage {
    /// Maps, locks and touches a page.
    pub fn new() -> Result<PinnedPage, String> {
        // SAFETY: a fresh private anonymous mapping at an address the kernel picks; nothing
        // existing is replaced. The result is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(format!("mmap of an anonymous page: {}", std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or("mmap of an anonymous page returned null")?;
        let page = PinnedPage { ptr };
        // SAFETY: locks exactly the page mapped above.
        if unsafe { libc::mlock(page.ptr.as_ptr().cast(), PAGE_SIZE) } != 0 {
            return Err(format!("mlock: {}", std::io::Error::last_os_error()));
        }
        // SAFETY: the page is mapped writable; a write (not a read, which would map the shared
        // zero page) gives it its own frame.
        unsafe { std::ptr::write_volatile(page.ptr.as_ptr(), 0) };
        Ok(page)
    }

    /// The virtual address of the page.
    pub fn vaddr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    /// Its physical address.
    pub fn phys(&self) -> Result<u64, String> {
        physical_address(self.vaddr())
    }

    /// Writes `data` (at most a page) at the start of the page.
    pub fn write(&mut self, data: &[u8]) {
        for (i, &b) in data.iter().take(PAGE_SIZE).enumerate() {
            // SAFETY: `i < PAGE_SIZE`, inside the mapped, writable page.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(i), b) };
        }
    }

    /// The whole page.
    pub fn read(&self) -> Vec<u8> {
        // SAFETY: every `i < PAGE_SIZE` is inside the mapped page.
        (0..PAGE_SIZE).map(|i| unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(i)) }).collect()
    }
}

impl Drop for PinnedPage {
    fn drop(&mut self) {
        // SAFETY: unmaps (and so unlocks) exactly the page mapped in `new`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), PAGE_SIZE) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_decode_pagemap() {
        assert_eq!(decode_pagemap((1 << 63) | 0x12345), PageEntry::Present { pfn: 0x12345 });
        // Soft-dirty (55), exclusive (56) and file/shared (61) bits are not part of the PFN.
        assert_eq!(decode_pagemap((1 << 63) | (1 << 61) | (1 << 56) | (1 << 55) | 7), PageEntry::Present { pfn: 7 });
        assert_eq!(decode_pagemap((1 << 63) | ((1 << 55) - 1)), PageEntry::Present { pfn: (1 << 55) - 1 });
        assert_eq!(decode_pagemap(1 << 63), PageEntry::PfnHidden);
        assert_eq!(decode_pagemap((1 << 62) | 0x1f), PageEntry::Swapped);
        assert_eq!(decode_pagemap(0), PageEntry::NotPresent);
    }

    #[test]
    fn test_pinned_page() {
        let mut page = PinnedPage::new().unwrap();
        assert_eq!(page.vaddr() % PAGE_SIZE, 0);
        page.write(&[1, 2, 3]);
        assert_eq!(&page.read()[..4], &[1, 2, 3, 0]);
        // Touched, so present; the PFN shows only with CAP_SYS_ADMIN.
        let entry = decode_pagemap(pagemap_entry(page.vaddr()).unwrap());
        assert!(matches!(entry, PageEntry::Present { .. } | PageEntry::PfnHidden), "{entry:?}");
        match (entry, page.phys()) {
            (PageEntry::Present { pfn }, Ok(phys)) => assert_eq!(phys, pfn * PAGE_SIZE as u64),
            (PageEntry::PfnHidden, Err(e)) => assert!(e.contains("CAP_SYS_ADMIN"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
}
