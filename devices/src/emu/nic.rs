//! The emulated RoCE NIC: a DMA engine that copies between any two IOVAs the client has
//! mapped (guest RAM, a peer GPU's BAR), driven by a descriptor ring in guest memory.
//!
//! A worker thread does the copying so that a doorbell write returns at once: it sleeps on
//! a condition variable that [`NIC_RING_TAIL`] writes wake, reads each descriptor
//! with [`DmaMemory::read`], copies with [`DmaMemory::copy`] (file to file, no bounce
//! buffer), writes the status back, then advances the head. Nothing in a descriptor can make
//! it fail: a bad one gets a status, a ring it cannot read or a tail too far ahead stops the
//! engine ([`ENGINE_BROKEN`]) until the driver writes the ring size again.
//!
//! Ring size writes and resets bump a generation: the worker drops what it was doing on
//! the old ring instead of counting it against the new one.

use std::io;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use gdrvm_model::emulated::*;
use gdrvm_model::node::Node;
use tracing::{debug, warn};

use super::{Common, EmuError, Emulated, LogOnce, Registers};
use crate::lock;
use crate::vfio_user::{DmaMemory, Interrupts};

/// An emulated NIC.
pub type EmulatedNic = Emulated<Nic>;

/// The NIC's own registers and its DMA engine thread (stopped and joined on drop).
pub struct Nic {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
}

/// What the register thread and the worker share.
struct Shared {
    engine: Mutex<Engine>,
    wake: Condvar,
    common: Arc<Common>,
    dma: Arc<DmaMemory>,
}

/// The ring registers and counters.
#[derive(Debug, Default)]
struct Engine {
    base: u64,
    size: u32,
    head: u32,
    tail: u32,
    completed: u32,
    failed: u32,
    bytes: u64,
    state: u32,
    /// Bumped by ring size writes and resets: work on an older generation is dropped.
    generation: u64,
    /// The device is going away.
    stop: bool,
}

/// Descriptors the worker took on at one wake.
#[derive(Debug, Clone, Copy)]
struct Batch {
    base: u64,
    size: u32,
    head: u32,
    count: u32,
    generation: u64,
}

impl Engine {
    /// The descriptors posted and not yet processed, marking the engine busy; `None` (and
    /// the engine idle or broken) when there is nothing it can do.
    fn next_batch(&mut self, odd: &LogOnce) -> Option<Batch> {
        if self.state == ENGINE_BROKEN {
            return None;
        }
        let count = self.tail.wrapping_sub(self.head);
        if self.size == 0 || count == 0 {
            self.state = ENGINE_IDLE;
            return None;
        }
        if count > self.size {
            if odd.first("tail too far ahead", u64::from(count)) {
                warn!(
                    head = self.head,
                    tail = self.tail,
                    size = self.size,
                    "tail ahead of head by more than the ring: engine stopped"
                );
            }
            self.state = ENGINE_BROKEN;
            return None;
        }
        self.state = ENGINE_BUSY;
        Some(Batch { base: self.base, size: self.size, head: self.head, count, generation: self.generation })
    }
}

impl Nic {
    /// The NIC's registers at power-on, its engine thread started: it copies through `dma`
    /// and signals through `common`.
    pub fn new(common: &Arc<Common>, dma: Arc<DmaMemory>) -> io::Result<Self> {
        let shared = Arc::new(Shared { engine: Mutex::default(), wake: Condvar::new(), common: common.clone(), dma });
        let worker = shared.clone();
        let worker = std::thread::Builder::new().name("nic-dma".into()).spawn(move || worker.run())?;
        Ok(Nic { shared, worker: Some(worker) })
    }
}

impl Drop for Nic {
    fn drop(&mut self) {
        lock(&self.shared.engine).stop = true;
        self.shared.wake.notify_all();
        if let Some(worker) = self.worker.take() {
            if worker.join().is_err() {
                warn!("the DMA engine thread panicked");
            }
        }
    }
}

impl Registers for Nic {
    const KIND: u32 = KIND_NIC;

    fn read(&self, reg: u64) -> Option<u32> {
        let e = lock(&self.shared.engine);
        Some(match reg {
            NIC_RING_BASE_LO => e.base as u32,
            NIC_RING_BASE_HI => (e.base >> 32) as u32,
            NIC_RING_SIZE => e.size,
            NIC_RING_HEAD => e.head,
            NIC_RING_TAIL => e.tail,
            NIC_COMPLETED => e.completed,
            NIC_FAILED => e.failed,
            NIC_ENGINE => e.state,
            NIC_BYTES_LO => e.bytes as u32,
            NIC_BYTES_HI => (e.bytes >> 32) as u32,
            _ => return None,
        })
    }

    fn write(&mut self, reg: u64, value: u32) -> bool {
        let mut e = lock(&self.shared.engine);
        match reg {
            // The ring is 64-byte aligned: the low six bits of the base read as 0.
            NIC_RING_BASE_LO => e.base = (e.base & !0xffff_ffff) | u64::from(value & !0x3f),
            NIC_RING_BASE_HI => e.base = (e.base & 0xffff_ffff) | (u64::from(value) << 32),
            NIC_RING_SIZE => {
                if value != 0 && !(value.is_power_of_two() && value <= NIC_RING_MAX) {
                    if self.shared.common.odd.first("bad ring size", u64::from(value)) {
                        warn!(value, "ring size neither 0 nor a power of two up to {NIC_RING_MAX}: ignored");
                    }
                    return true;
                }
                e.size = value;
                e.head = 0;
                e.tail = 0;
                e.state = ENGINE_IDLE;
                e.generation += 1;
            }
            NIC_RING_TAIL => {
                e.tail = value;
                drop(e);
                self.shared.wake.notify_one();
            }
            _ => return false,
        }
        true
    }

    fn reset(&mut self) {
        let mut e = lock(&self.shared.engine);
        *e = Engine { generation: e.generation + 1, stop: e.stop, ..Engine::default() };
    }
}

impl Shared {
    /// The worker: waits for posted descriptors and processes them, until the device goes.
    fn run(&self) {
        loop {
            let batch = {
                let mut e = lock(&self.engine);
                loop {
                    if e.stop {
                        return;
                    }
                    if let Some(batch) = e.next_batch(&self.common.odd) {
                        break batch;
                    }
                    e = self.wake.wait(e).unwrap_or_else(PoisonError::into_inner);
                }
            };
            self.process(batch);
        }
    }

    /// Processes one batch, stopping early if the ring changed or the device goes.
    fn process(&self, batch: Batch) {
        for k in 0..batch.count {
            let index = batch.head.wrapping_add(k);
            let slot = batch.base.checked_add(u64::from(index % batch.size) * DESC_LEN);
            let Some((slot, status_at)) = slot.and_then(|s| Some((s, s.checked_add(DESC_STATUS)?))) else {
                self.broken(&batch, index, "the ring runs past the end of the address space");
                return;
            };
            let mut desc = [0; DESC_LEN as usize];
            if let Err(e) = self.dma.read(slot, &mut desc) {
                debug!(error = ?e, "descriptor read failed");
                self.broken(&batch, index, "the ring cannot be read");
                return;
            }
            let (status, bytes) = self.execute(&desc);
            if let Err(e) = self.dma.write(status_at, &status.to_le_bytes()) {
                debug!(error = ?e, "status write failed");
                self.broken(&batch, index, "the ring cannot be written");
                return;
            }
            {
                let mut e = lock(&self.engine);
                if e.stop || e.generation != batch.generation {
                    return;
                }
                e.head = index.wrapping_add(1);
                if status == STATUS_OK {
                    e.completed = e.completed.wrapping_add(1);
                    e.bytes = e.bytes.wrapping_add(bytes);
                } else {
                    e.failed = e.failed.wrapping_add(1);
                }
            }
            if le32(&desc, DESC_FLAGS) & DESC_FLAG_IRQ != 0 {
                self.common.signal(0);
            }
        }
    }

    /// Carries out one descriptor: its status and the bytes copied.
    fn execute(&self, desc: &[u8; DESC_LEN as usize]) -> (u32, u64) {
        let (src, dst, len) = (le64(desc, DESC_SRC), le64(desc, DESC_DST), le32(desc, DESC_LEN_FIELD));
        if !self.common.bus_master() {
            return (STATUS_NO_BUS_MASTER, 0);
        }
        if len == 0 || len > DESC_MAX_LEN {
            return (STATUS_BAD_LENGTH, 0);
        }
        match self.dma.copy(src, dst, u64::from(len)) {
            Ok(()) => (STATUS_OK, u64::from(len)),
            Err(e) => {
                debug!(src = format_args!("{src:#x}"), dst = format_args!("{dst:#x}"), len, error = ?e, "copy failed");
                (STATUS_UNMAPPED, 0)
            }
        }
    }

    /// Stops the engine on a ring it cannot use, unless the ring has changed meanwhile.
    fn broken(&self, batch: &Batch, index: u32, why: &'static str) {
        let mut e = lock(&self.engine);
        if e.generation != batch.generation {
            return;
        }
        e.state = ENGINE_BROKEN;
        if self.common.odd.first(why, batch.base) {
            warn!(
                base = format_args!("{:#x}", batch.base),
                index, "{why}: engine stopped until the ring size is written"
            );
        }
    }
}

fn le32(desc: &[u8; DESC_LEN as usize], at: u64) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&desc[at as usize..at as usize + 4]);
    u32::from_le_bytes(b)
}

fn le64(desc: &[u8; DESC_LEN as usize], at: u64) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&desc[at as usize..at as usize + 8]);
    u64::from_le_bytes(b)
}

impl EmulatedNic {
    /// The NIC at function `i` of `node` (`origin` names the node in errors): its engine
    /// copies through `dma` and signals through `irqs`.
    pub fn new(
        origin: &str,
        node: &Node,
        i: usize,
        dma: Arc<DmaMemory>,
        irqs: Arc<Interrupts>,
    ) -> Result<Self, EmuError> {
        Emulated::build(origin, node, i, irqs, |_, common| Nic::new(common, dma).map_err(EmuError::Worker))
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::FileExt;
    use std::time::{Duration, Instant};

    use super::super::tests::{index, preset, read32, write32};
    use super::super::{memfd, CONFIG_REGION};
    use super::*;
    use crate::pci::regs::PCI_COMMAND;

    const RAM: u64 = 0x1_0000_0000;
    const RAM_SIZE: u64 = 16 << 20;
    const GPU_BAR: u64 = 0x80_0000_0000;
    const GPU_BAR_SIZE: u64 = 1 << 30;
    const RING: u64 = RAM + 0x10_0000;

    struct Bench {
        nic: EmulatedNic,
        ram: File,
        bar: File,
    }

    fn bench() -> Bench {
        let node = preset("minimal");
        let dma = Arc::new(DmaMemory::new());
        let ram = memfd("ram", RAM_SIZE).unwrap();
        let bar = memfd("gpu-bar", GPU_BAR_SIZE).unwrap();
        dma.map(RAM, RAM_SIZE, &ram, 0, true).unwrap();
        dma.map(GPU_BAR, GPU_BAR_SIZE, &bar, 0, true).unwrap();
        let mut nic =
            EmulatedNic::new("preset minimal", &node, index(&node, "nic0"), dma, Arc::new(Interrupts::new())).unwrap();
        bus_master(&mut nic, true);
        Bench { nic, ram, bar }
    }

    fn bus_master(nic: &mut EmulatedNic, on: bool) {
        let command: u16 = if on { 0x6 } else { 0x2 };
        nic.region_write(CONFIG_REGION, PCI_COMMAND as u64, &command.to_le_bytes());
    }

    impl Bench {
        fn ring(&mut self, base: u64, size: u32) {
            write32(&mut self.nic, NIC_RING_BASE_LO, base as u32);
            write32(&mut self.nic, NIC_RING_BASE_HI, (base >> 32) as u32);
            write32(&mut self.nic, NIC_RING_SIZE, size);
        }

        fn post(&self, slot: u64, src: u64, dst: u64, len: u32, flags: u32) {
            let mut d = [0u8; 32];
            d[0..8].copy_from_slice(&src.to_le_bytes());
            d[8..16].copy_from_slice(&dst.to_le_bytes());
            d[16..20].copy_from_slice(&len.to_le_bytes());
            d[20..24].copy_from_slice(&flags.to_le_bytes());
            d[24..28].copy_from_slice(&STATUS_PENDING.to_le_bytes());
            self.ram.write_all_at(&d, RING - RAM + slot * DESC_LEN).unwrap();
        }

        fn status(&self, slot: u64) -> u32 {
            let mut b = [0; 4];
            self.ram.read_exact_at(&mut b, RING - RAM + slot * DESC_LEN + DESC_STATUS).unwrap();
            u32::from_le_bytes(b)
        }

        /// Rings the doorbell and waits until the engine has stopped working.
        fn kick(&mut self, tail: u32) {
            write32(&mut self.nic, NIC_RING_TAIL, tail);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let state = read32(&mut self.nic, NIC_ENGINE);
                if state == ENGINE_BROKEN || (state == ENGINE_IDLE && read32(&mut self.nic, NIC_RING_HEAD) == tail) {
                    return;
                }
                assert!(Instant::now() < deadline, "engine stuck: state {state}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }

        fn reg(&mut self, reg: u64) -> u32 {
            read32(&mut self.nic, reg)
        }
    }

    #[test]
    fn test_nic_registers() {
        let mut b = bench();
        assert_eq!(b.reg(REG_KIND), KIND_NIC);
        assert_eq!(b.reg(REG_IDENT), 0x101e_15b3);
        b.ring(0x1234_5678_9abc_def0, 64);
        assert_eq!(b.reg(NIC_RING_BASE_LO), 0x9abc_dec0);
        assert_eq!(b.reg(NIC_RING_BASE_HI), 0x1234_5678);
        assert_eq!(b.reg(NIC_RING_SIZE), 64);
        // Bad sizes are ignored.
        for bad in [3, 8192, u32::MAX] {
            write32(&mut b.nic, NIC_RING_SIZE, bad);
            assert_eq!(b.reg(NIC_RING_SIZE), 64);
        }
        // Read-only registers.
        for reg in [NIC_RING_HEAD, NIC_COMPLETED, NIC_FAILED, NIC_ENGINE, NIC_BYTES_LO, NIC_BYTES_HI] {
            write32(&mut b.nic, reg, 5);
            assert_eq!(b.reg(reg), 0, "register {reg:#x}");
        }
        // Size 0 stops the engine: a tail is stored but nothing runs.
        write32(&mut b.nic, NIC_RING_SIZE, 0);
        write32(&mut b.nic, NIC_RING_TAIL, 3);
        assert_eq!(b.reg(NIC_RING_TAIL), 3);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(b.reg(NIC_RING_HEAD), 0);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_IDLE);
        b.nic.reset_device();
        assert_eq!(b.reg(NIC_RING_BASE_LO), 0);
        assert_eq!(b.reg(NIC_RING_TAIL), 0);
        assert_eq!(b.reg(NIC_RING_SIZE), 0);
    }

    #[test]
    fn test_engine_copies_ram_to_bar_and_back() {
        let mut b = bench();
        b.ring(RING, 8);
        let pattern: Vec<u8> = (0..3 << 20).map(|i: u32| (i * 7 + i / 251) as u8).collect();
        b.ram.write_all_at(&pattern, 2 << 20).unwrap();
        // RAM -> BAR (near its end), then BAR -> RAM elsewhere.
        let bar_at = GPU_BAR + GPU_BAR_SIZE - (4 << 20);
        b.post(0, RAM + (2 << 20), bar_at, pattern.len() as u32, DESC_FLAG_IRQ);
        b.post(1, bar_at, RAM + (8 << 20), pattern.len() as u32, 0);
        b.kick(2);
        assert_eq!((b.status(0), b.status(1)), (STATUS_OK, STATUS_OK));
        let mut got = vec![0; pattern.len()];
        b.bar.read_exact_at(&mut got, GPU_BAR_SIZE - (4 << 20)).unwrap();
        assert!(got == pattern, "RAM -> BAR copy differs");
        b.ram.read_exact_at(&mut got, 8 << 20).unwrap();
        assert!(got == pattern, "BAR -> RAM copy differs");
        assert_eq!(b.reg(NIC_COMPLETED), 2);
        assert_eq!(b.reg(NIC_FAILED), 0);
        assert_eq!(b.reg(NIC_BYTES_LO), 6 << 20);
        assert_eq!(b.reg(NIC_BYTES_HI), 0);
        assert_eq!(b.reg(NIC_RING_HEAD), 2);
        // One descriptor asked for an interrupt.
        assert_eq!(b.reg(REG_IRQ_COUNT), 1);
    }

    #[test]
    fn test_bad_descriptors_fail_and_the_engine_goes_on() {
        let mut b = bench();
        b.ring(RING, 8);
        b.ram.write_all_at(b"payload", 0x100).unwrap();
        // Unmapped source, destination running past the mapping, a wrapping address.
        b.post(0, 0x4000_0000_0000, RAM, 16, 0);
        b.post(1, RAM, GPU_BAR + GPU_BAR_SIZE - 4, 16, 0);
        b.post(2, u64::MAX - 3, RAM, 16, DESC_FLAG_IRQ);
        // Bad lengths.
        b.post(3, RAM, RAM + 0x1000, 0, 0);
        b.post(4, RAM, RAM + 0x1000, DESC_MAX_LEN + 1, 0);
        b.post(5, RAM + 0x100, GPU_BAR, 7, 0);
        b.kick(6);
        let statuses: Vec<_> = (0..6).map(|s| b.status(s)).collect();
        assert_eq!(
            statuses,
            [STATUS_UNMAPPED, STATUS_UNMAPPED, STATUS_UNMAPPED, STATUS_BAD_LENGTH, STATUS_BAD_LENGTH, STATUS_OK]
        );
        let mut got = [0; 7];
        b.bar.read_exact_at(&mut got, 0).unwrap();
        assert_eq!(&got, b"payload");
        assert_eq!(b.reg(NIC_FAILED), 5);
        assert_eq!(b.reg(NIC_COMPLETED), 1);
        assert_eq!(b.reg(NIC_BYTES_LO), 7);
        // Failed descriptors that ask for an interrupt get one.
        assert_eq!(b.reg(REG_IRQ_COUNT), 1);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_IDLE);
    }

    #[test]
    fn test_bus_master_off_fails_every_descriptor() {
        let mut b = bench();
        bus_master(&mut b.nic, false);
        b.ring(RING, 4);
        b.post(0, RAM, GPU_BAR, 64, 0);
        b.post(1, RAM, GPU_BAR, 64, 0);
        b.kick(2);
        assert_eq!((b.status(0), b.status(1)), (STATUS_NO_BUS_MASTER, STATUS_NO_BUS_MASTER));
        assert_eq!(b.reg(NIC_FAILED), 2);
        bus_master(&mut b.nic, true);
        b.post(2, RAM, GPU_BAR, 64, 0);
        b.kick(3);
        assert_eq!(b.status(2), STATUS_OK);
    }

    #[test]
    fn test_ring_wraps() {
        let mut b = bench();
        b.ring(RING, 2);
        for round in 0..5u32 {
            let slot = u64::from(round % 2);
            b.post(slot, RAM, GPU_BAR + u64::from(round) * 0x100, 0x100, 0);
            b.kick(round + 1);
            assert_eq!(b.status(slot), STATUS_OK);
        }
        assert_eq!(b.reg(NIC_COMPLETED), 5);
    }

    #[test]
    fn test_broken_ring_until_size_written() {
        let mut b = bench();
        // The ring's base is not mapped.
        b.ring(0x7000_0000_0000, 4);
        b.kick(1);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_BROKEN);
        assert_eq!(b.reg(NIC_RING_HEAD), 0);
        // Further doorbells change nothing.
        b.kick(2);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_BROKEN);
        // A ring at the very top of the address space.
        b.ring(!0x3f, 4);
        b.kick(1);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_BROKEN);
        // Writing a good ring recovers.
        b.ring(RING, 4);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_IDLE);
        b.post(0, RAM, GPU_BAR, 8, 0);
        b.kick(1);
        assert_eq!(b.status(0), STATUS_OK);
        // Tail further ahead than the ring holds: a driver error, the engine stops.
        b.kick(100);
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_BROKEN);
        assert_eq!(b.reg(NIC_RING_HEAD), 1);
        b.nic.reset_device();
        assert_eq!(b.reg(NIC_ENGINE), ENGINE_IDLE);
        assert_eq!(b.reg(NIC_COMPLETED), 0);
    }

    #[test]
    fn test_drop_stops_a_busy_engine() {
        let mut b = bench();
        b.ring(RING, 4096);
        for slot in 0..4096 {
            b.post(slot, RAM, GPU_BAR, 1 << 20, 0);
        }
        write32(&mut b.nic, NIC_RING_TAIL, 4096);
        let start = Instant::now();
        drop(b.nic);
        assert!(start.elapsed() < Duration::from_secs(10));
    }
}
