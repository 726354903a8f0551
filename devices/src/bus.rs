//! Address-range dispatch for port I/O and MMIO.
//!
//! Written by hand: rust-vmm's `vm-device` bus ties devices to its own manager and mutability
//! model; gdrvm needs only a sorted range map with all-ones reads for holes.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::lock;

/// A device reachable by guest loads and stores at an address range.
pub trait BusDevice: Send {
    /// Handles a read of `data.len()` bytes at `offset` from the start of the device's range.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Handles a write at `offset` from the start of the device's range.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors building a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The new range overlaps one already on the bus.
    #[error("range {base:#x}+{len:#x} overlaps a device already on the bus")]
    Overlap {
        /// Start of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
    /// Zero-length ranges cannot be dispatched to.
    #[error("range at {0:#x} has zero length")]
    Empty(u64),
}

struct Entry {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// A map from address ranges to devices. Accesses that hit no device read as all-ones and
/// are logged once per address, never fatal: a guest may probe any address.
#[derive(Default)]
pub struct Bus {
    name: &'static str,
    devices: BTreeMap<u64, Entry>,
    unclaimed_seen: Mutex<HashSet<u64>>,
    unclaimed: AtomicU64,
}

impl Bus {
    /// An empty bus; `name` ("pio", "mmio") appears in log lines.
    pub fn new(name: &'static str) -> Self {
        Bus { name, ..Default::default() }
    }

    /// Places `device` at `[base, base + len)`.
    pub fn insert(&mut self, device: Arc<Mutex<dyn BusDevice>>, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let end = base.checked_add(len).ok_or(BusError::Overlap { base, len })?;
        let clash_before = self.devices.range(..end).next_back().is_some_and(|(b, e)| b + e.len > base);
        if clash_before {
            return Err(BusError::Overlap { base, len });
        }
        self.devices.insert(base, Entry { len, device });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &Entry)> {
        let (base, entry) = self.devices.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset.checked_add(size as u64)? <= entry.len).then_some((offset, entry))
    }

    /// Dispatches a read; returns false (and fills all-ones) when no device claims `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, entry)) => {
                lock(&entry.device).read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                self.note_unclaimed(addr, "read");
                false
            }
        }
    }

    /// Dispatches a write; returns false (and drops it) when no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, entry)) => {
                lock(&entry.device).write(offset, data);
                true
            }
            None => {
                self.note_unclaimed(addr, "write");
                false
            }
        }
    }

    /// Accesses no device claimed (unbacked BARs, probes of empty space) since the start.
    pub fn unclaimed(&self) -> u64 {
        self.unclaimed.load(Ordering::Relaxed)
    }

    fn note_unclaimed(&self, addr: u64, what: &str) {
        self.unclaimed.fetch_add(1, Ordering::Relaxed);
        let mut seen = lock(&self.unclaimed_seen);
        // Bounded: a guest sweeping addresses must not grow the set without limit.
        if seen.len() < 4096 && seen.insert(addr) {
            tracing::debug!(bus = self.name, addr = format_args!("{addr:#x}"), "unclaimed {what} (logged once)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(Vec<(u64, Vec<u8>)>);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn test_dispatch_by_offset_and_all_ones_for_holes() {
        let dev = Arc::new(Mutex::new(Echo(vec![])));
        let mut bus = Bus::new("pio");
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fa, &mut b));
        assert_eq!(b, [2]);
        assert!(!bus.read(0x400, &mut b));
        assert_eq!(b, [0xff]);
        // An access straddling the end of a range is unclaimed.
        let mut w = [0u8; 2];
        assert!(!bus.read(0x3ff, &mut w));
        assert_eq!(bus.unclaimed(), 2);
        assert!(bus.write(0x3f9, &[7]));
        assert_eq!(dev.lock().unwrap().0, vec![(1, vec![7])]);
    }

    #[test]
    fn test_overlaps_rejected() {
        let dev = Arc::new(Mutex::new(Echo(vec![])));
        let mut bus = Bus::new("pio");
        bus.insert(dev.clone(), 0x10, 0x10).unwrap();
        assert_eq!(bus.insert(dev.clone(), 0x18, 1), Err(BusError::Overlap { base: 0x18, len: 1 }));
        assert_eq!(bus.insert(dev.clone(), 0x8, 0x9), Err(BusError::Overlap { base: 0x8, len: 0x9 }));
        assert_eq!(bus.insert(dev.clone(), 0x0, 0), Err(BusError::Empty(0)));
        bus.insert(dev, 0x20, 1).unwrap();
    }
}
