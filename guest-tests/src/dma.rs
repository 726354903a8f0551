//! Pages a device can DMA to when there is no IOMMU (bus address = physical address):
//! anonymous memory, locked and touched so that it is backed and stays put, its physical
//! address read from `/proc/self/pagemap` (the kernel shows PFNs to CAP_SYS_ADMIN only).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;

use crate::mapping::{Mapped, Mapping};

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

/// The physical addresses of the `count` pages from this process's virtual address `vaddr`
/// (page-aligned) on, read from `/proc/self/pagemap` in one go.
pub fn physical_pages(vaddr: usize, count: usize) -> Result<Vec<u64>, String> {
    let file = File::open("/proc/self/pagemap").map_err(|e| format!("/proc/self/pagemap: {e}"))?;
    let mut entries = vec![0u8; count * 8];
    file.read_exact_at(&mut entries, (vaddr / PAGE_SIZE * 8) as u64)
        .map_err(|e| format!("/proc/self/pagemap entries of {count} pages from {vaddr:#x}: {e}"))?;
    entries
        .chunks_exact(8)
        .enumerate()
        .map(|(i, bytes)| {
            let mut entry = [0u8; 8];
            entry.copy_from_slice(bytes);
            let entry = u64::from_ne_bytes(entry);
            let at = vaddr + i * PAGE_SIZE;
            match decode_pagemap(entry) {
                PageEntry::Present { pfn } => Ok(pfn * PAGE_SIZE as u64),
                PageEntry::PfnHidden => Err(format!("pagemap hides the PFN of {at:#x} (needs CAP_SYS_ADMIN)")),
                PageEntry::Swapped => Err(format!("page of {at:#x} is swapped out")),
                PageEntry::NotPresent => Err(format!("page of {at:#x} is not present")),
            }
        })
        .collect()
}

/// A physically contiguous range of memory, as a device addresses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Bus (here physical) address.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// The physically contiguous runs of the `len` bytes at `offset` in a buffer whose pages lie
/// at `pages` (one physical address per page, in order): neighbouring pages merge when the
/// second starts where the first ends. `None` when the range leaves the buffer.
pub fn runs(pages: &[u64], offset: u64, len: u64) -> Option<Vec<Run>> {
    let page = PAGE_SIZE as u64;
    let end = offset.checked_add(len)?;
    if end > (pages.len() as u64).checked_mul(page)? {
        return None;
    }
    let mut out: Vec<Run> = Vec::new();
    let mut at = offset;
    while at < end {
        let within = at % page;
        let n = (page - within).min(end - at);
        let addr = *pages.get(usize::try_from(at / page).ok()?)? + within;
        match out.last_mut() {
            Some(run) if run.addr.checked_add(run.len) == Some(addr) => run.len += n,
            _ => out.push(Run { addr, len: n }),
        }
        at += n;
    }
    Some(out)
}

/// Locked anonymous memory of whole pages that devices DMA into and out of. Like
/// [`PinnedPage`], every access is volatile; it reads and writes through [`Mmio`](crate::pcidev::Mmio) like a BAR,
/// so that one routine fills or checks either.
#[derive(Debug)]
pub struct PinnedBuffer {
    map: Mapping,
}

impl PinnedBuffer {
    /// Maps, locks and touches `len` bytes (rounded up to whole pages, at least one).
    pub fn new(len: usize) -> Result<PinnedBuffer, String> {
        let len = len.max(1).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let what = format!("{} KiB of anonymous memory", len >> 10);
        // From here on, dropping the buffer unmaps it.
        let map = Mapping::new(len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, &what)?;
        // SAFETY: locks exactly the range just mapped.
        if unsafe { libc::mlock(map.addr() as *const libc::c_void, len) } != 0 {
            return Err(format!("mlock of {} KiB: {}", len >> 10, std::io::Error::last_os_error()));
        }
        for page in (0..len).step_by(PAGE_SIZE) {
            if let Some(p) = map.at(page, 1) {
                // SAFETY: `at` checked the byte is inside the mapped, writable range; a write
                // gives the page its own frame (a read would map the shared zero page).
                unsafe { std::ptr::write_volatile(p, 0) };
            }
        }
        Ok(PinnedBuffer { map })
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The physical address of each page, in order.
    pub fn physical_pages(&self) -> Result<Vec<u64>, String> {
        physical_pages(self.map.addr(), self.map.len() / PAGE_SIZE)
    }
}

impl Mapped for PinnedBuffer {
    fn mapping(&self) -> &Mapping {
        &self.map
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pcidev::Mmio;

    #[test]
    fn test_runs_merge_contiguous_pages() {
        let p = PAGE_SIZE as u64;
        // Pages 0-1 contiguous, 2 elsewhere, 3 right after 2, 4 before 3 (not a continuation).
        let pages = [10 * p, 11 * p, 40 * p, 41 * p, 5 * p];
        assert_eq!(
            runs(&pages, 0, 5 * p).unwrap(),
            [Run { addr: 10 * p, len: 2 * p }, Run { addr: 40 * p, len: 2 * p }, Run { addr: 5 * p, len: p }]
        );
        // Unaligned start and end inside pages.
        assert_eq!(
            runs(&pages, p + 0x100, p).unwrap(),
            [Run { addr: 11 * p + 0x100, len: p - 0x100 }, Run { addr: 40 * p, len: 0x100 }]
        );
        assert_eq!(runs(&pages, 2 * p + 8, 16).unwrap(), [Run { addr: 40 * p + 8, len: 16 }]);
        assert_eq!(runs(&pages, 0, 0).unwrap(), []);
        assert_eq!(runs(&pages, 4 * p, p + 1), None);
        assert_eq!(runs(&pages, u64::MAX, 2), None);
    }

    #[test]
    fn test_pinned_buffer_reads_and_writes_in_bounds() {
        // Small enough for the default RLIMIT_MEMLOCK of an unprivileged test run.
        let mut buf = PinnedBuffer::new(PAGE_SIZE + 1).unwrap();
        assert_eq!(buf.len(), 2 * PAGE_SIZE);
        buf.write64(PAGE_SIZE - 8, 0x0123_4567_89ab_cdef);
        buf.write32(PAGE_SIZE, 0xdead_beef);
        assert_eq!(buf.read64(PAGE_SIZE - 8), 0x0123_4567_89ab_cdef);
        assert_eq!(buf.read32(PAGE_SIZE - 4), 0x0123_4567);
        assert_eq!(buf.read32(PAGE_SIZE), 0xdead_beef);
        assert_eq!(buf.read64(2 * PAGE_SIZE - 4), u64::MAX);
        assert_eq!(buf.read32(2), u32::MAX);
        buf.write64(2 * PAGE_SIZE, 1);
        match buf.physical_pages() {
            Ok(pages) => assert_eq!(pages.len(), 2),
            Err(e) => assert!(e.contains("CAP_SYS_ADMIN"), "{e}"),
        }
    }

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
