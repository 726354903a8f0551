//! What a vfio-user client DMA-mapped, as the server sees it: each range mmapped
//! `MAP_SHARED` from the fd the client sent, looked up by I/O virtual address.
//!
//! The memory is the guest's and changes under the server at any time, so it is only ever
//! touched through raw pointers (`std::ptr::copy`), never behind a Rust reference.
//!
//! A range must lie inside its file when mapped (checked for regular files and memfds):
//! touching a page past the end raises SIGBUS. A client that shrinks the file afterwards
//! can still bring that about; gdrvm's VMM never does (guest memory keeps its size).

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::ptr;
use std::sync::{PoisonError, RwLock};

/// The most ranges one client may map (guest RAM and peers' BARs are a few dozen).
pub const MAX_DMA_MAPPINGS: usize = 1024;

/// Why a DMA access or a mapping change failed.
#[derive(Debug, thiserror::Error)]
pub enum DmaFault {
    /// Part of the range is not mapped.
    #[error("DMA to {iova:#x}+{len:#x} reaches unmapped memory")]
    Unmapped {
        /// Start of the access.
        iova: u64,
        /// Its length.
        len: u64,
    },
    /// A write reaches memory mapped read-only.
    #[error("DMA write to {iova:#x} reaches memory mapped read-only")]
    ReadOnly {
        /// Start of the read-only mapping written.
        iova: u64,
    },
    /// A new mapping overlaps one already there.
    #[error("mapping {iova:#x}+{size:#x} overlaps one already there")]
    Overlap {
        /// Start of the new range.
        iova: u64,
        /// Its size.
        size: u64,
    },
    /// The range is empty, wraps around, or is too large for this machine.
    #[error("range {iova:#x}+{size:#x} is empty or wraps around")]
    Invalid {
        /// Start of the range.
        iova: u64,
        /// Its size.
        size: u64,
    },
    /// The range runs past the end of the file it is mapped from.
    #[error("mapping {iova:#x}+{size:#x} runs past the end of its file ({file_len:#x} bytes)")]
    PastEnd {
        /// Start of the range.
        iova: u64,
        /// Its size.
        size: u64,
        /// The file's length.
        file_len: u64,
    },
    /// An unmap would split a mapping.
    #[error("unmapping {iova:#x}+{size:#x} would split a mapping")]
    Partial {
        /// Start of the range.
        iova: u64,
        /// Its size.
        size: u64,
    },
    /// The client has mapped [`MAX_DMA_MAPPINGS`] ranges already.
    #[error("the client has mapped {MAX_DMA_MAPPINGS} ranges already")]
    TooMany,
    /// `mmap` or `fstat` failed.
    #[error("the range could not be mapped")]
    Map(#[source] io::Error),
}

impl DmaFault {
    /// The errno a vfio-user error reply carries for this fault.
    pub fn errno(&self) -> i32 {
        match self {
            DmaFault::Unmapped { .. } => libc::ENOENT,
            DmaFault::ReadOnly { .. } => libc::EPERM,
            DmaFault::Overlap { .. } => libc::EEXIST,
            DmaFault::Invalid { .. } | DmaFault::PastEnd { .. } | DmaFault::Partial { .. } => libc::EINVAL,
            DmaFault::TooMany => libc::ENOSPC,
            DmaFault::Map(e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// One mmapped range.
struct Mapping {
    size: u64,
    /// The range's first byte in this process.
    host: *mut u8,
    /// What `mmap` returned (page-aligned, at or before `host`) and its length.
    base: *mut libc::c_void,
    base_len: usize,
    writable: bool,
}

// SAFETY: a `Mapping` owns its mmap (unmapped only in `drop`) and is a plain address range;
// every access goes through raw-pointer copies under `DmaMemory`'s lock, which keeps the
// mapping alive for the access, whatever thread makes it.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: shared access only reads the pointer values; the memory behind
// them is shared with other processes anyway and only copied through raw pointers.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `base`/`base_len` are exactly what `mmap` returned for this mapping, which
        // is dropped once, under the write lock, so no access through it is in flight.
        unsafe { libc::munmap(self.base, self.base_len) };
    }
}

/// A piece of an access that lies in one mapping.
struct Piece {
    host: *mut u8,
    len: usize,
}

/// The client's DMA mappings; shared between the server loop and the device's threads.
pub struct DmaMemory {
    /// By I/O virtual address; non-overlapping.
    maps: RwLock<BTreeMap<u64, Mapping>>,
}

impl Default for DmaMemory {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for DmaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let maps = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        let ranges: Vec<_> = maps.iter().map(|(iova, m)| (*iova, m.size, m.writable)).collect();
        f.debug_struct("DmaMemory").field("maps", &ranges).finish()
    }
}

impl DmaMemory {
    /// Nothing mapped.
    pub fn new() -> Self {
        DmaMemory { maps: RwLock::new(BTreeMap::new()) }
    }

    /// Maps `size` bytes of `fd` from `offset` at `iova`, writable by the device when
    /// `writable`.
    pub fn map(&self, iova: u64, size: u64, fd: &File, offset: u64, writable: bool) -> Result<(), DmaFault> {
        let end = iova.checked_add(size).filter(|_| size > 0).ok_or(DmaFault::Invalid { iova, size })?;
        // A regular file (a memfd) must hold the range: touching a page past its end would
        // raise SIGBUS in the server. Device files say nothing of their size.
        let meta = fd.metadata().map_err(DmaFault::Map)?;
        if meta.is_file() && offset.checked_add(size).is_none_or(|e| e > meta.len()) {
            return Err(DmaFault::PastEnd { iova, size, file_len: meta.len() });
        }
        let page = page_size();
        let delta = offset % page;
        let base_len =
            size.checked_add(delta).and_then(|l| usize::try_from(l).ok()).ok_or(DmaFault::Invalid { iova, size })?;
        let file_offset = libc::off_t::try_from(offset - delta).map_err(|_| DmaFault::Invalid { iova, size })?;
        let mut maps = self.maps.write().unwrap_or_else(PoisonError::into_inner);
        if maps.len() >= MAX_DMA_MAPPINGS {
            return Err(DmaFault::TooMany);
        }
        if let Some((start, m)) = maps.range(..end).next_back() {
            if start + m.size > iova {
                return Err(DmaFault::Overlap { iova, size });
            }
        }
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        // SAFETY: a fresh shared mapping at an address the kernel picks: it replaces nothing
        // of this process. `fd` is open for the call; the mapping outlives it on its own.
        let base =
            unsafe { libc::mmap(ptr::null_mut(), base_len, prot, libc::MAP_SHARED, fd.as_raw_fd(), file_offset) };
        if base == libc::MAP_FAILED {
            return Err(DmaFault::Map(io::Error::last_os_error()));
        }
        // `delta` is less than a page, inside the mapping.
        let host = base.cast::<u8>().wrapping_add(delta as usize);
        maps.insert(iova, Mapping { size, host, base, base_len, writable });
        tracing::debug!(iova = format_args!("{iova:#x}"), size = format_args!("{size:#x}"), writable, "DMA mapped");
        Ok(())
    }

    /// Unmaps every mapping inside `[iova, iova + size)`; fails, changing nothing, when
    /// none is there or one would be split.
    pub fn unmap(&self, iova: u64, size: u64) -> Result<(), DmaFault> {
        let end = iova.checked_add(size).filter(|_| size > 0).ok_or(DmaFault::Invalid { iova, size })?;
        let mut maps = self.maps.write().unwrap_or_else(PoisonError::into_inner);
        let split_below = maps.range(..iova).next_back().is_some_and(|(s, m)| s + m.size > iova);
        let split_above = maps.range(..end).next_back().is_some_and(|(s, m)| *s >= iova && s + m.size > end);
        if split_below || split_above {
            return Err(DmaFault::Partial { iova, size });
        }
        let inside: Vec<u64> = maps.range(iova..end).map(|(s, _)| *s).collect();
        if inside.is_empty() {
            return Err(DmaFault::Unmapped { iova, len: size });
        }
        for start in inside {
            maps.remove(&start);
        }
        tracing::debug!(iova = format_args!("{iova:#x}"), size = format_args!("{size:#x}"), "DMA unmapped");
        Ok(())
    }

    /// Copies guest memory at `iova` into `data`.
    pub fn read(&self, iova: u64, data: &mut [u8]) -> Result<(), DmaFault> {
        let maps = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        let mut at = 0;
        for piece in pieces(&maps, iova, data.len() as u64, false)? {
            // SAFETY: the piece lies in a live mapping (kept by the read lock) and inside
            // `data` (the pieces cover exactly `data.len()` bytes); guest memory is only read
            // through this raw copy, and `data` is not guest memory.
            unsafe { ptr::copy(piece.host, data.as_mut_ptr().add(at), piece.len) };
            at += piece.len;
        }
        Ok(())
    }

    /// Copies `data` into guest memory at `iova`.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<(), DmaFault> {
        let maps = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        let mut at = 0;
        for piece in pieces(&maps, iova, data.len() as u64, true)? {
            // SAFETY: the piece lies in a live writable mapping (kept by the read lock) and
            // inside `data`; guest memory is only written through this raw copy.
            unsafe { ptr::copy(data.as_ptr().add(at), piece.host, piece.len) };
            at += piece.len;
        }
        Ok(())
    }

    /// Copies `len` bytes from IOVA `src` to IOVA `dst` straight between the mappings (no
    /// bounce buffer; ranges may span adjacent mappings; overlapping ranges behave like
    /// `memmove`). Checks both ranges before copying anything.
    pub fn copy(&self, src: u64, dst: u64, len: u64) -> Result<(), DmaFault> {
        let maps = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        let from = pieces(&maps, src, len, false)?;
        let to = pieces(&maps, dst, len, true)?;
        if let ([s], [d]) = (&from[..], &to[..]) {
            // The hot path: one mapping each side.
            // SAFETY: both ranges lie in live mappings (kept by the read lock), `dst`'s
            // writable; `ptr::copy` is `memmove`, so overlap is fine.
            unsafe { ptr::copy(s.host, d.host, s.len) };
            return Ok(());
        }
        // Split both sides at every mapping boundary of either.
        let mut chunks = Vec::with_capacity(from.len() + to.len());
        let (mut fi, mut ti, mut f_off, mut t_off) = (0, 0, 0, 0);
        while let (Some(f), Some(t)) = (from.get(fi), to.get(ti)) {
            let n = (f.len - f_off).min(t.len - t_off);
            chunks.push((f.host.wrapping_add(f_off), t.host.wrapping_add(t_off), n));
            f_off += n;
            t_off += n;
            if f_off == f.len {
                (fi, f_off) = (fi + 1, 0);
            }
            if t_off == t.len {
                (ti, t_off) = (ti + 1, 0);
            }
        }
        // Like memmove: when the destination starts inside the source, copy from the end.
        let backwards = dst > src && dst - src < len;
        let copy_chunk = |&(s, d, n): &(*mut u8, *mut u8, usize)| {
            // SAFETY: each chunk lies inside one live mapping on either side (kept by the
            // read lock), the destination's writable; `ptr::copy` allows overlap.
            unsafe { ptr::copy(s, d, n) }
        };
        if backwards {
            chunks.iter().rev().for_each(copy_chunk);
        } else {
            chunks.iter().for_each(copy_chunk);
        }
        Ok(())
    }

    /// Unmaps everything (the client left).
    pub(super) fn clear(&self) {
        self.maps.write().unwrap_or_else(PoisonError::into_inner).clear();
    }

    /// Whether `[iova, iova + len)` is mapped, writable too when `write`.
    pub fn is_mapped(&self, iova: u64, len: u64, write: bool) -> bool {
        let maps = self.maps.read().unwrap_or_else(PoisonError::into_inner);
        pieces(&maps, iova, len, write).is_ok()
    }
}

/// `[iova, iova + len)` as pieces of consecutive mappings; fails when some of it is
/// unmapped (or, for `write`, read-only).
fn pieces(maps: &BTreeMap<u64, Mapping>, iova: u64, len: u64, write: bool) -> Result<Vec<Piece>, DmaFault> {
    let unmapped = DmaFault::Unmapped { iova, len };
    let mut out = Vec::with_capacity(1);
    let mut at = iova;
    let mut left = len;
    while left > 0 {
        let Some((start, m)) = maps.range(..=at).next_back() else {
            return Err(unmapped);
        };
        let inside = at - start;
        if inside >= m.size {
            return Err(unmapped);
        }
        if write && !m.writable {
            return Err(DmaFault::ReadOnly { iova: *start });
        }
        let n = left.min(m.size - inside);
        let (Ok(off), Ok(n_usize)) = (usize::try_from(inside), usize::try_from(n)) else {
            return Err(unmapped);
        };
        out.push(Piece { host: m.host.wrapping_add(off), len: n_usize });
        left -= n;
        // Past the end of the address space, whatever is left is unmapped.
        at = match at.checked_add(n) {
            Some(next) => next,
            None if left == 0 => break,
            None => return Err(unmapped),
        };
    }
    Ok(out)
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a system parameter.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).ok().filter(|s| s.is_power_of_two()).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;
    use crate::vfio_user::test_util::memfd;

    #[test]
    fn test_map_read_write_copy_across_mappings() {
        let a = memfd("a", 0x4000);
        let b = memfd("b", 0x2000);
        let dma = DmaMemory::new();
        // Two adjacent mappings; the first from an unaligned offset.
        dma.map(0x10_0000, 0x1000, &a, 0x1800, true).unwrap();
        dma.map(0x10_1000, 0x2000, &b, 0, true).unwrap();
        a.write_all_at(b"he", 0x1800 + 0xffe).unwrap();
        b.write_all_at(b"llo", 0).unwrap();
        let mut got = [0; 5];
        dma.read(0x10_0ffe, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        dma.write(0x10_1ffe, b"world").unwrap();
        let mut back = [0; 5];
        b.read_exact_at(&mut back, 0xffe).unwrap();
        assert_eq!(&back, b"world");
        // A copy spanning both mappings, then overlapping copies either way.
        dma.copy(0x10_0ffe, 0x10_1800, 5).unwrap();
        b.read_exact_at(&mut back, 0x800).unwrap();
        assert_eq!(&back, b"hello");
        let pattern: Vec<u8> = (0..32).collect();
        dma.write(0x10_0ff0, &pattern).unwrap();
        dma.copy(0x10_0ff0, 0x10_0ff4, 28).unwrap();
        let mut all = [0; 32];
        dma.read(0x10_0ff0, &mut all).unwrap();
        assert_eq!(&all[4..], &pattern[..28], "forward overlap across the boundary");
        dma.write(0x10_0ff0, &pattern).unwrap();
        dma.copy(0x10_0ff4, 0x10_0ff0, 28).unwrap();
        dma.read(0x10_0ff0, &mut all).unwrap();
        assert_eq!(&all[..28], &pattern[4..], "backward overlap across the boundary");
    }

    #[test]
    fn test_faults() {
        let f = memfd("f", 0x2000);
        let dma = DmaMemory::new();
        dma.map(0x1000, 0x1000, &f, 0, false).unwrap();
        dma.map(0x3000, 0x1000, &f, 0x1000, true).unwrap();
        let mut b = [0; 8];
        assert!(matches!(dma.read(0x1ffc, &mut b), Err(DmaFault::Unmapped { iova: 0x1ffc, len: 8 })));
        assert!(matches!(dma.read(0, &mut b), Err(DmaFault::Unmapped { .. })));
        assert!(matches!(dma.read(u64::MAX - 3, &mut b), Err(DmaFault::Unmapped { .. })));
        assert!(matches!(dma.write(0x1000, &b), Err(DmaFault::ReadOnly { iova: 0x1000 })));
        assert!(matches!(dma.copy(0x3000, 0x1000, 8), Err(DmaFault::ReadOnly { .. })));
        assert!(matches!(dma.copy(0x1000, 0x3ffc, 8), Err(DmaFault::Unmapped { .. })));
        dma.copy(0x1000, 0x3000, 0x1000).unwrap();
        assert!(matches!(dma.map(0x1800, 0x1000, &f, 0, true), Err(DmaFault::Overlap { .. })));
        assert!(matches!(dma.map(0x800, 0x1000, &f, 0, true), Err(DmaFault::Overlap { .. })));
        assert!(matches!(dma.map(0, 0, &f, 0, true), Err(DmaFault::Invalid { .. })));
        assert!(matches!(dma.map(u64::MAX, 2, &f, 0, true), Err(DmaFault::Invalid { .. })));
        assert!(matches!(dma.map(0x8000, 0x1000, &f, 0x1800, true), Err(DmaFault::PastEnd { .. })));
        assert!(matches!(dma.map(0x8000, 0x1000, &f, u64::MAX, true), Err(DmaFault::PastEnd { .. })));
        assert!(matches!(dma.unmap(0x1800, 0x1000), Err(DmaFault::Partial { .. })));
        assert!(matches!(dma.unmap(0x1000, 0x800), Err(DmaFault::Partial { .. })));
        assert!(matches!(dma.unmap(0x5000, 0x1000), Err(DmaFault::Unmapped { .. })));
        // One unmap covering both.
        dma.unmap(0, 0x10000).unwrap();
        assert!(!dma.is_mapped(0x1000, 1, false));
        assert_eq!(DmaFault::Overlap { iova: 0, size: 1 }.errno(), libc::EEXIST);
    }
}
