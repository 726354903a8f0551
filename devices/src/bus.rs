//! Address-range dispatch for port I/O and MMIO.
//!
//! Written by hand: rust-vmm's `vm-device` bus ties devices to its own manager and mutability
//! model; gdrvm needs only a sorted range map with all-ones reads for holes.
//!
//! The map changes while vCPUs run: BARs move when the guest reprograms them and disappear
//! when it turns memory decode off. So every method takes `&self`, and a device is called
//! with no bus lock held: a device may itself change the bus (a config write that moves a
//! BAR), and a slow device never stalls the other vCPUs' lookups.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::lock;

/// A device reachable by guest loads and stores at an address range.
pub trait BusDevice: Send {
    /// Handles a read of `data.len()` bytes at `offset` from the start of the device's range.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Handles a write at `offset` from the start of the device's range.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors changing a bus.
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
    /// The range runs past the end of the address space.
    #[error("range {base:#x}+{len:#x} runs past the end of the address space")]
    Wraps {
        /// Start of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
    /// No device's range starts at this address.
    #[error("no device starts at {0:#x}")]
    NotFound(u64),
}

#[derive(Clone)]
struct Entry {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// Devices by the start of their range; ranges never overlap.
type RangeMap = BTreeMap<u64, Entry>;

/// A map from address ranges to devices. Accesses that hit no device read as all-ones and
/// are logged once per address, never fatal: a guest may probe any address.
#[derive(Default)]
pub struct Bus {
    name: &'static str,
    // An RwLock rather than an immutable map swapped atomically: the read path is one
    // uncontended read-lock acquire and release (two atomic operations on one futex word)
    // plus the device's Arc clone, which dispatch needs either way. std has no atomic Arc,
    // so a swapped map would still sit behind a lock and add a refcount round trip on the
    // map itself; a lock-free swap (the arc-swap crate) would be a new dependency to save a
    // few nanoseconds on a path that has already paid a KVM exit (microseconds). Writers (BAR
    // moves, decode toggles) are rare and hold the lock only for a map update.
    devices: RwLock<RangeMap>,
    unclaimed_seen: Mutex<HashSet<u64>>,
    unclaimed: AtomicU64,
}

impl Bus {
    /// An empty bus; `name` ("pio", "mmio") appears in log lines.
    pub fn new(name: &'static str) -> Self {
        Bus { name, ..Default::default() }
    }

    /// Places `device` at `[base, base + len)`.
    pub fn insert(&self, device: Arc<Mutex<dyn BusDevice>>, base: u64, len: u64) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::Empty(base));
        }
        let mut map = self.write_map();
        check_free(&map, base, len, None)?;
        map.insert(base, Entry { len, device });
        Ok(())
    }

    /// Takes the device whose range starts at `base` off the bus and returns it.
    pub fn remove(&self, base: u64) -> Result<Arc<Mutex<dyn BusDevice>>, BusError> {
        self.write_map().remove(&base).map(|entry| entry.device).ok_or(BusError::NotFound(base))
    }

    /// Moves the range starting at `old_base` (same device, same length) to start at
    /// `new_base`. The new range may overlap the old one but no other; on error the bus is
    /// unchanged, and no access ever sees the device at both places or at neither.
    pub fn move_range(&self, old_base: u64, new_base: u64) -> Result<(), BusError> {
        let mut map = self.write_map();
        let len = map.get(&old_base).ok_or(BusError::NotFound(old_base))?.len;
        if old_base == new_base {
            return Ok(());
        }
        check_free(&map, new_base, len, Some(old_base))?;
        if let Some(entry) = map.remove(&old_base) {
            map.insert(new_base, entry);
        }
        Ok(())
    }

    /// The ranges on the bus as `(base, len)`, in address order.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        self.read_map().iter().map(|(base, entry)| (*base, entry.len)).collect()
    }

    /// The device claiming `[addr, addr + size)` and the offset of `addr` in its range. The
    /// map lock is released on return, before the caller calls the device: an access racing
    /// with a move or removal reaches the device as if it had happened just before.
    fn find(&self, addr: u64, size: usize) -> Option<(u64, Arc<Mutex<dyn BusDevice>>)> {
        let map = self.read_map();
        let (base, entry) = map.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset.checked_add(size as u64)? <= entry.len).then(|| (offset, entry.device.clone()))
    }

    /// Dispatches a read; returns the start of the range that claimed it, or None (and
    /// fills all-ones) when no device claims `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> Option<u64> {
        match self.find(addr, data.len()) {
            Some((offset, device)) => {
                lock(&device).read(offset, data);
                Some(addr - offset)
            }
            None => {
                data.fill(0xff);
                self.note_unclaimed(addr, "read");
                None
            }
        }
    }

    /// Dispatches a write; returns the start of the range that claimed it, or None (and
    /// drops it) when no device claims `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> Option<u64> {
        match self.find(addr, data.len()) {
            Some((offset, device)) => {
                lock(&device).write(offset, data);
                Some(addr - offset)
            }
            None => {
                self.note_unclaimed(addr, "write");
                None
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

    // Poisoning is ignored as in `lock`: every map update is a single BTreeMap call made
    // after all checks, so a panicking holder cannot leave the map half changed.
    fn read_map(&self) -> RwLockReadGuard<'_, RangeMap> {
        self.devices.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_map(&self) -> RwLockWriteGuard<'_, RangeMap> {
        self.devices.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Fails unless `[base, base + len)` lies in the address space and overlaps no range in
/// `map` other than the one starting at `ignore` (the range being moved).
fn check_free(map: &RangeMap, base: u64, len: u64, ignore: Option<u64>) -> Result<(), BusError> {
    let end = base.checked_add(len).ok_or(BusError::Wraps { base, len })?;
    // Ranges do not overlap, so only the last one starting below `end` can reach `base`.
    let clash =
        map.range(..end).rev().find(|(b, _)| Some(**b) != ignore).is_some_and(|(b, entry)| b + entry.len > base);
    if clash {
        return Err(BusError::Overlap { base, len });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::{mpsc, Weak};
    use std::time::Duration;

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

    fn echo() -> Arc<Mutex<Echo>> {
        Arc::new(Mutex::new(Echo(vec![])))
    }

    fn read_byte(bus: &Bus, addr: u64) -> u8 {
        let mut b = [0u8; 1];
        bus.read(addr, &mut b);
        b[0]
    }

    #[test]
    fn test_dispatch_by_offset_and_all_ones_for_holes() {
        let dev = echo();
        let bus = Bus::new("pio");
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        let mut b = [0u8; 1];
        assert_eq!(bus.read(0x3fa, &mut b), Some(0x3f8));
        assert_eq!(b, [2]);
        assert_eq!(bus.read(0x400, &mut b), None);
        assert_eq!(b, [0xff]);
        // An access straddling the end of a range is unclaimed.
        let mut w = [0u8; 2];
        assert_eq!(bus.read(0x3ff, &mut w), None);
        assert_eq!(bus.unclaimed(), 2);
        assert_eq!(bus.write(0x3f9, &[7]), Some(0x3f8));
        assert_eq!(dev.lock().unwrap().0, vec![(1, vec![7])]);
    }

    #[test]
    fn test_overlaps_rejected() {
        let dev = echo();
        let bus = Bus::new("pio");
        bus.insert(dev.clone(), 0x10, 0x10).unwrap();
        assert_eq!(bus.insert(dev.clone(), 0x18, 1), Err(BusError::Overlap { base: 0x18, len: 1 }));
        assert_eq!(bus.insert(dev.clone(), 0x8, 0x9), Err(BusError::Overlap { base: 0x8, len: 0x9 }));
        assert_eq!(bus.insert(dev.clone(), 0x0, 0), Err(BusError::Empty(0)));
        assert_eq!(bus.insert(dev.clone(), u64::MAX, 2), Err(BusError::Wraps { base: u64::MAX, len: 2 }));
        bus.insert(dev, 0x20, 1).unwrap();
        assert_eq!(bus.ranges(), vec![(0x10, 0x10), (0x20, 1)]);
    }

    #[test]
    fn test_remove_and_move() {
        let (a, b) = (echo(), echo());
        let bus = Bus::new("mmio");
        bus.insert(a.clone(), 0x1000, 0x100).unwrap();
        bus.insert(b.clone(), 0x2000, 0x100).unwrap();

        bus.move_range(0x1000, 0x3000).unwrap();
        assert_eq!(bus.ranges(), vec![(0x2000, 0x100), (0x3000, 0x100)]);
        assert_eq!(read_byte(&bus, 0x1004), 0xff);
        // Offsets are from the new base.
        assert!(bus.write(0x3004, &[9]).is_some());
        assert_eq!(a.lock().unwrap().0, vec![(4, vec![9])]);
        // Moving onto part of its own old range is allowed, and to the same base is a no-op.
        bus.move_range(0x3000, 0x3080).unwrap();
        bus.move_range(0x3080, 0x3080).unwrap();
        assert_eq!(read_byte(&bus, 0x3081), 1);

        let removed = bus.remove(0x2000).unwrap();
        let b_dyn: Arc<Mutex<dyn BusDevice>> = b;
        assert!(Arc::ptr_eq(&removed, &b_dyn));
        assert_eq!(read_byte(&bus, 0x2000), 0xff);
        assert_eq!(bus.ranges(), vec![(0x3080, 0x100)]);
        // The freed range can be used again.
        bus.insert(removed, 0x2000, 0x100).unwrap();

        assert!(matches!(bus.remove(0x2001), Err(BusError::NotFound(0x2001))));
        assert_eq!(bus.move_range(0x1000, 0x5000), Err(BusError::NotFound(0x1000)));
        assert_eq!(bus.unclaimed(), 2);
    }

    #[test]
    fn test_refused_changes_leave_the_map_unchanged() {
        let bus = Bus::new("mmio");
        bus.insert(echo(), 0x10, 0x10).unwrap();
        bus.insert(echo(), 0x30, 0x10).unwrap();
        bus.insert(echo(), 0x50, 0x10).unwrap();
        let before = bus.ranges();

        // Onto the start, the end and the whole of a neighbour, and past the address space.
        assert_eq!(bus.move_range(0x10, 0x28), Err(BusError::Overlap { base: 0x28, len: 0x10 }));
        assert_eq!(bus.move_range(0x10, 0x3f), Err(BusError::Overlap { base: 0x3f, len: 0x10 }));
        assert_eq!(bus.move_range(0x50, 0x30), Err(BusError::Overlap { base: 0x30, len: 0x10 }));
        assert_eq!(bus.move_range(0x30, u64::MAX - 4), Err(BusError::Wraps { base: u64::MAX - 4, len: 0x10 }));
        assert_eq!(bus.insert(echo(), 0x0, 0x11), Err(BusError::Overlap { base: 0, len: 0x11 }));
        assert!(matches!(bus.remove(0x31), Err(BusError::NotFound(0x31))));
        assert_eq!(bus.ranges(), before);
        assert_eq!(read_byte(&bus, 0x35), 5);

        // Exactly between two neighbours fits.
        bus.move_range(0x30, 0x20).unwrap();
        assert_eq!(bus.ranges(), vec![(0x10, 0x10), (0x20, 0x10), (0x50, 0x10)]);
    }

    /// On a write, moves itself to `to` and puts a new device where it was, through the bus
    /// that called it; on a read, reads another address through the same bus.
    struct Rearranger {
        bus: Weak<Bus>,
        at: u64,
        to: u64,
        peer: u64,
    }

    impl BusDevice for Rearranger {
        fn read(&mut self, _offset: u64, data: &mut [u8]) {
            let bus = self.bus.upgrade().expect("the bus outlives its devices' calls");
            bus.read(self.peer, data);
        }
        fn write(&mut self, _offset: u64, _data: &[u8]) {
            let bus = self.bus.upgrade().expect("the bus outlives its devices' calls");
            bus.move_range(self.at, self.to).unwrap();
            bus.insert(echo(), self.at, 0x10).unwrap();
            bus.remove(self.at).unwrap();
            bus.insert(echo(), self.at, 0x10).unwrap();
            self.at = self.to;
        }
    }

    #[test]
    fn test_device_call_can_change_the_bus_without_deadlock() {
        let bus = Arc::new(Bus::new("mmio"));
        let dev = Rearranger { bus: Arc::downgrade(&bus), at: 0x100, to: 0x200, peer: 0x305 };
        bus.insert(Arc::new(Mutex::new(dev)), 0x100, 0x10).unwrap();
        bus.insert(echo(), 0x300, 0x10).unwrap();

        // Were the map lock held during the device call, the write lock taken by the device
        // would deadlock (or panic): run it on a thread and give it a deadline.
        let (done, finished) = mpsc::channel();
        let worker = bus.clone();
        std::thread::spawn(move || {
            assert!(worker.write(0x100, &[1]).is_some());
            // Now at 0x200, it reads the echo at 0x300 through the bus: nested dispatch.
            let mut b = [0u8; 1];
            assert!(worker.read(0x200, &mut b).is_some());
            assert_eq!(b, [5]);
            done.send(()).unwrap();
        });
        finished.recv_timeout(Duration::from_secs(10)).expect("a device call that changes the bus completes");
        assert_eq!(bus.ranges(), vec![(0x100, 0x10), (0x200, 0x10), (0x300, 0x10)]);
        assert_eq!(read_byte(&bus, 0x103), 3);
    }

    /// Records every offset it is called with.
    struct Probe(Vec<u64>);
    impl BusDevice for Probe {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            self.0.push(offset);
            data.fill(0x5a);
        }
        fn write(&mut self, _offset: u64, _data: &[u8]) {}
    }

    #[test]
    fn test_concurrent_readers_while_a_range_moves() {
        const A: u64 = 0x1000;
        const B: u64 = 0x8000;
        let bus = Arc::new(Bus::new("mmio"));
        let probe = Arc::new(Mutex::new(Probe(Vec::new())));
        bus.insert(probe.clone(), A, 0x100).unwrap();
        let stop = Arc::new(AtomicBool::new(false));

        let readers: Vec<_> = (0..3)
            .map(|_| {
                let (bus, stop) = (bus.clone(), stop.clone());
                std::thread::spawn(move || {
                    let (mut hits, mut misses) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        for addr in [A + 0x10, B + 0x10] {
                            let mut data = [0u8; 4];
                            if bus.read(addr, &mut data).is_some() {
                                assert_eq!(data, [0x5a; 4]);
                                hits += 1;
                            } else {
                                assert_eq!(data, [0xff; 4]);
                                misses += 1;
                            }
                        }
                    }
                    (hits, misses)
                })
            })
            .collect();
        for _ in 0..2000 {
            bus.move_range(A, B).unwrap();
            bus.move_range(B, A).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let (mut hits, mut misses) = (0, 0);
        for r in readers {
            let (h, m) = r.join().unwrap();
            hits += h;
            misses += m;
        }

        assert_eq!(bus.ranges(), vec![(A, 0x100)]);
        assert_eq!(bus.unclaimed(), misses);
        let offsets = &probe.lock().unwrap().0;
        assert_eq!(offsets.len() as u64, hits);
        // The device only ever saw the offset of the address inside its range, never one
        // computed against the other base.
        assert!(offsets.iter().all(|&o| o == 0x10));
    }
}
