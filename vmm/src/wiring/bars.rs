//! Where a device's BARs are in the guest: a trapped BAR (or a trapped part of a mapped
//! one: the MSI-X pages, pages the device cannot map) is a range on the MMIO bus whose
//! accesses reach the device, or the VMM's MSI-X emulation; a mapped BAR is device memory
//! given to KVM as memory slots, so the guest reaches it without exits.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use gdrvm_devices::{lock, merge_ranges, BusDevice, PciDevice};

use super::msix::MsixState;

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
