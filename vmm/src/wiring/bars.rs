//! Where a device's BARs are in the guest: a trapped BAR (or a trapped part of a mapped
//! one: the MSI-X pages, pages the device cannot map) is a range on the MMIO bus whose
//! accesses reach the device, or the VMM's MSI-X emulation; a mapped BAR is device memory
//! given to KVM as memory slots, so the guest reaches it without exits.

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use gdrvm_devices::{lock, merge_ranges, BusDevice, PciDevice};

use super::memslots::MemorySlots;
use super::msix::MsixState;

/// Mapped runs longer than this are given to KVM a chunk at a time ([`LazyRun`]).
pub const LAZY_ABOVE: u64 = 1 << 30;

/// Host page size for device mappings (x86-64).
pub const PAGE: u64 = 4096;

/// Guest accesses to a trapped range of a BAR.
pub struct BarTrap {
    /// The device.
    pub device: Arc<Mutex<dyn PciDevice>>,
    /// Which BAR.
    pub bar: u8,
    /// Offset of this range in the BAR.
    pub start: u64,
    /// The function's MSI-X emulation, when this BAR holds its table or pending bits.
    pub msix: Option<Arc<MsixState>>,
}

impl BarTrap {
    /// The MSI-X structure at `at` in the BAR, as (is the table, offset in it).
    fn msix_at(&self, at: u64, len: usize) -> Option<(&MsixState, bool, u64)> {
        let m = self.msix.as_deref()?;
        let inside = |(bar, start): (u8, u64), size: u64| {
            (bar == self.bar && at >= start && at + len as u64 <= start + size).then_some(at - start)
        };
        inside(m.layout.table, m.table_len())
            .map(|o| (m, true, o))
            .or_else(|| inside(m.layout.pba, m.pba_len()).map(|o| (m, false, o)))
    }
}

impl BusDevice for BarTrap {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let at = self.start + offset;
        match self.msix_at(at, data.len()) {
            Some((m, true, o)) => m.read_table(o, data),
            Some((m, false, o)) => m.read_pba(o, data),
            None => lock(&self.device).bar_read(self.bar, at, data),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let at = self.start + offset;
        match self.msix_at(at, data.len()) {
            Some((m, true, o)) => m.write_table(o, data),
            // The pending bits are read-only.
            Some((_, false, _)) => {}
            None => lock(&self.device).bar_write(self.bar, at, data),
        }
    }
}

/// A long mapped run of a BAR (a GPU's 128 GiB aperture) given to KVM a chunk at a time,
/// on the guest's first access to each chunk, which this trap completes through the VMM's
/// own mapping; later accesses to the chunk reach the memory without an exit. KVM's
/// per-slot metadata grows with the slot (on Debian's kernels two bytes of write tracking
/// per 4 KiB page: 64 MiB, zeroed, for a 128 GiB aperture), and guests touch little of an
/// aperture. The run's DMA mapping is whole from the start: devices reach all of it.
pub struct LazyRun {
    /// Guest-physical start of the run.
    pub gpa: u64,
    /// Where the VMM has the run mapped.
    pub host: u64,
    /// Length of the run.
    pub len: u64,
    /// Bytes per KVM slot.
    pub chunk: u64,
    /// Where slots come from.
    pub slots: Arc<MemorySlots>,
    /// The slots given so far, shared with the placement that removes them.
    pub given: Arc<Mutex<LazySlots>>,
}

/// The KVM slots a [`LazyRun`] has added.
#[derive(Default)]
pub struct LazySlots {
    /// Chunk index -> (slot, guest address).
    pub slots: std::collections::BTreeMap<u64, (u32, u64)>,
    /// The run was removed from the guest: no more slots.
    pub closed: bool,
    /// Chunks that could not be given (logged once each).
    failed: BTreeSet<u64>,
}

impl LazyRun {
    /// The chunk size for a run of `len` bytes: at least [`LAZY_ABOVE`], and at most 32
    /// chunks, so eight fully touched 128 GiB apertures fit KVM's slots beside the
    /// configuration images.
    pub fn chunk_for(len: u64) -> u64 {
        (len / 32).max(LAZY_ABOVE).next_power_of_two()
    }

    /// Gives KVM the chunks `offset..offset + len` touches; false when the range is outside
    /// the run or the run is gone.
    fn ensure(&self, offset: u64, len: usize) -> bool {
        let Some(end) = offset.checked_add(len as u64).filter(|&e| e <= self.len && len > 0) else { return false };
        let mut given = lock(&self.given);
        if given.closed {
            return false;
        }
        for index in offset / self.chunk..=(end - 1) / self.chunk {
            if given.slots.contains_key(&index) || given.failed.contains(&index) {
                continue;
            }
            let start = index * self.chunk;
            let size = self.chunk.min(self.len - start);
            match self.slots.add(self.gpa + start, self.host + start, size) {
                Ok(slot) => {
                    given.slots.insert(index, (slot, self.gpa + start));
                }
                Err(e) => {
                    tracing::warn!("device memory at {:#x}: {e}; accesses there stay trapped", self.gpa + start);
                    given.failed.insert(index);
                }
            }
        }
        true
    }
}

impl BusDevice for LazyRun {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if !self.ensure(offset, data.len()) {
            data.fill(0xff);
            return;
        }
        // SAFETY: `offset..offset + len` lies in the run (checked by `ensure`), which the VMM
        // keeps mapped while the run is on the bus; device memory is read with a plain copy
        // into `data`, never through a reference into the mapping.
        unsafe { std::ptr::copy_nonoverlapping((self.host + offset) as *const u8, data.as_mut_ptr(), data.len()) };
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if !self.ensure(offset, data.len()) {
            return;
        }
        // SAFETY: as in `read`; the mapping is writable device memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), (self.host + offset) as *mut u8, data.len()) };
    }
}

/// `0..size` split into the runs inside `holes` (trapped) and outside them (mapped), in
/// order; holes are widened to whole pages.
pub fn split(size: u64, holes: &[Range<u64>]) -> Vec<(bool, Range<u64>)> {
    let pages = holes.iter().filter(|h| h.start < h.end).map(|h| (h.start / PAGE * PAGE)..h.end.div_ceil(PAGE) * PAGE);
    let merged = merge_ranges(pages.collect(), size);
    let mut runs = Vec::new();
    let mut at = 0;
    for h in merged {
        if h.start > at {
            runs.push((false, at..h.start));
        }
        runs.push((true, h.clone()));
        at = h.end;
    }
    if at < size {
        runs.push((false, at..size));
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_split_widens_holes_to_pages_and_keeps_order() {
        assert_eq!(split(0x10000, &[]), [(false, 0..0x10000)]);
        // e1000e's MSI-X: table at 0x0, PBA at 0x2000 of a 16 KiB BAR.
        assert_eq!(
            split(0x4000, &[0..0x50, 0x2000..0x2008]),
            [(true, 0..0x1000), (false, 0x1000..0x2000), (true, 0x2000..0x3000), (false, 0x3000..0x4000)]
        );
        // Overlapping and adjacent holes merge; a hole past the end is ignored.
        assert_eq!(
            split(0x3000, &[0x1800..0x2100, 0x1000..0x1100, 0x9000..0xa000]),
            [(false, 0..0x1000), (true, 0x1000..0x3000)]
        );
        // A BAR smaller than a page is trapped whole.
        let hole = 0..0x10;
        assert_eq!(split(0x100, std::slice::from_ref(&hole)), [(true, 0..0x100)]);
    }
}
