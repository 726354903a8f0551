//! Test doubles: a virtio-net device laid out as the fabric contract says (common 0x1000, ISR
//! 0x2000, device 0x3000, notify 0x4000 x 4), which transmits synchronously when its transmit
//! queue is notified, over a driver memory of two pages at made-up physical addresses.

use std::cell::RefCell;
use std::rc::Rc;

use super::driver::{common, feature, status, Layout, Regs, Transport};
use crate::dma::PAGE_SIZE;
use crate::pcidev::Mmio;

/// Where the fake puts the driver's two pages (not contiguous, as pinned pages need not be).
pub const PAGES: [u64; 2] = [0x7654_3000, 0x1234_5000];
/// Guest RAM as the fake sees it: addresses below this are RAM (zeros outside the driver's pages).
pub const RAM_END: u64 = 1 << 32;
/// The largest chain the fake transmits: 9000 MTU + 18 bytes of header + 12 of virtio_net_hdr.
pub const MAX_CHAIN: u64 = 9030;
/// The fake's MAC and MTU.
pub const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0xab, 0xcd, 0x01];
/// MTU in the device configuration.
pub const MTU: u16 = 9000;

/// What the fake does with a chain it cannot make sense of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Drop it: used element with len 0.
    Drop,
    /// Set NEEDS_RESET and stop.
    NeedsReset,
    /// Neither: the buffer never comes back (a device that hangs on it).
    Ignore,
}

#[derive(Debug, Default, Clone, Copy)]
struct Queue {
    max: u16,
    size: u16,
    vector: u16,
    enable: u16,
    desc: u64,
    driver: u64,
    device: u64,
    last_avail: u16,
    used: u16,
}

impl Queue {
    fn fresh(max: u16) -> Queue {
        Queue { max, size: max, ..Queue::default() }
    }
}

/// The driver's memory: two pages.
pub type Mem = Rc<RefCell<Vec<u8>>>;

/// A virtio-net device.
pub struct FakeNet {
    /// The driver's memory, which the device reads and writes at [`PAGES`].
    pub mem: Mem,
    /// Malformed chains.
    pub policy: Policy,
    /// Whether an available index moved by more than the queue size sets NEEDS_RESET
    /// (otherwise the device takes the entries as they come).
    pub checks_avail: bool,
    /// Whether a reset takes (otherwise device_status keeps its value).
    pub resets: bool,
    /// Every register reads all-ones.
    pub gone: bool,
    /// Feature bits offered.
    pub offered: u64,
    /// Frames sent (virtio_net_hdr included).
    pub sent: Vec<Vec<u8>>,
    /// Chains dropped.
    pub dropped: u32,
    status: u8,
    device_select: u32,
    driver_select: u32,
    driver_features: [u32; 2],
    msix_config: u16,
    select: u16,
    queues: [Queue; 2],
    isr: u8,
}

impl FakeNet {
    /// A fresh device over `mem` that drops what it cannot make sense of.
    pub fn new(mem: Mem) -> FakeNet {
        FakeNet {
            mem,
            policy: Policy::Drop,
            checks_avail: true,
            resets: true,
            gone: false,
            offered: feature::VERSION_1 | feature::NET_MAC | feature::NET_MTU | feature::NET_STATUS,
            sent: Vec::new(),
            dropped: 0,
            status: 0,
            device_select: 0,
            driver_select: 0,
            driver_features: [0; 2],
            msix_config: 0,
            select: 0,
            queues: [Queue::fresh(256); 2],
            isr: 0,
        }
    }

    fn reset(&mut self) {
        if !self.resets {
            return;
        }
        self.status = 0;
        self.driver_features = [0; 2];
        self.queues = [Queue::fresh(256); 2];
        self.isr = 0;
    }

    /// The offset in the driver's memory of `len` bytes at physical `addr`, if they lie there.
    fn locate(addr: u64, len: u64) -> Option<usize> {
        PAGES.iter().enumerate().find_map(|(i, &p)| {
            let end = addr.checked_add(len)?;
            (addr >= p && end <= p + PAGE_SIZE as u64).then(|| i * PAGE_SIZE + (addr - p) as usize)
        })
    }

    /// Reads guest RAM: the driver's pages, zeros elsewhere below [`RAM_END`], `None` beyond.
    fn read_ram(&self, addr: u64, len: u64) -> Option<Vec<u8>> {
        if addr.checked_add(len)? > RAM_END {
            return None;
        }
        let at = Self::locate(addr, len);
        let len = usize::try_from(len).ok()?;
        Some(at.map_or_else(|| vec![0; len], |at| self.mem.borrow()[at..at + len].to_vec()))
    }

    fn ram16(&self, addr: u64) -> Option<u16> {
        self.read_ram(addr, 2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }

    fn write_ram(&self, addr: u64, data: &[u8]) {
        if let Some(at) = Self::locate(addr, data.len() as u64) {
            self.mem.borrow_mut()[at..at + data.len()].copy_from_slice(data);
        }
    }

    fn needs_reset(&mut self) {
        self.status |= status::NEEDS_RESET;
        self.isr |= 2;
    }

    /// The bytes of the chain at `head`, or why it is malformed.
    fn gather(&self, q: &Queue, head: u16) -> Result<Vec<u8>, String> {
        let (mut idx, mut ttl, mut out) = (head, q.size, Vec::new());
        loop {
            if idx >= q.size {
                return Err(format!("descriptor {idx} out of the table"));
            }
            let d = self.read_ram(q.desc + 16 * u64::from(idx), 16).ok_or("descriptor table unreadable")?;
            let word = |at: usize| u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]]);
            let addr = u64::from(word(0)) | u64::from(word(4)) << 32;
            let (len, flags, next) = (word(8), word(12) as u16, (word(12) >> 16) as u16);
            if out.len() as u64 + u64::from(len) > MAX_CHAIN {
                return Err(format!("{} bytes: larger than a frame", out.len() as u64 + u64::from(len)));
            }
            out.extend(self.read_ram(addr, u64::from(len)).ok_or_else(|| format!("{addr:#x} is not RAM"))?);
            if flags & 1 == 0 {
                return Ok(out);
            }
            ttl -= 1;
            if ttl == 0 {
                return Err("the chain loops".into());
            }
            idx = next;
        }
    }

    fn transmit(&mut self) {
        let q = self.queues[1];
        if self.status & status::DRIVER_OK == 0 || self.status & status::NEEDS_RESET != 0 || q.enable == 0 {
            return;
        }
        let Some(avail) = self.ram16(q.driver + 2) else { return self.needs_reset() };
        if self.checks_avail && avail.wrapping_sub(q.last_avail) > q.size {
            return self.needs_reset();
        }
        let mut last = q.last_avail;
        while last != avail {
            let Some(head) = self.ram16(q.driver + 4 + 2 * u64::from(last % q.size)) else { return self.needs_reset() };
            last = last.wrapping_add(1);
            self.queues[1].last_avail = last;
            match self.gather(&q, head) {
                Ok(frame) => self.sent.push(frame),
                Err(_) => match self.policy {
                    Policy::Drop => self.dropped += 1,
                    Policy::NeedsReset => return self.needs_reset(),
                    Policy::Ignore => continue,
                },
            }
            let used = self.queues[1].used;
            let mut elem = u32::from(head).to_le_bytes().to_vec();
            elem.extend_from_slice(&0u32.to_le_bytes());
            self.write_ram(q.device + 4 + 8 * u64::from(used % q.size), &elem);
            self.queues[1].used = used.wrapping_add(1);
            self.write_ram(q.device + 2, &self.queues[1].used.to_le_bytes());
        }
    }

    fn read(&mut self, offset: usize, size: usize) -> u64 {
        if self.gone {
            return u64::MAX >> (64 - 8 * size);
        }
        let q = self.queues[usize::from(self.select)];
        match offset {
            0x2000 => {
                let isr = self.isr;
                self.isr = 0;
                u64::from(isr)
            }
            0x3000..=0x3005 => u64::from(MAC[offset - 0x3000]),
            0x3006 => 1,
            0x300a => u64::from(MTU),
            0x1000..=0x10ff => match offset - 0x1000 {
                common::DEVICE_FEATURE_SELECT => u64::from(self.device_select),
                common::DEVICE_FEATURE => match self.device_select {
                    0 => self.offered & 0xffff_ffff,
                    1 => self.offered >> 32,
                    _ => 0,
                },
                common::DRIVER_FEATURE_SELECT => u64::from(self.driver_select),
                common::DRIVER_FEATURE => {
                    self.driver_features.get(self.driver_select as usize).map_or(0, |&f| f.into())
                }
                common::MSIX_CONFIG => u64::from(self.msix_config),
                common::NUM_QUEUES => 2,
                common::DEVICE_STATUS => u64::from(self.status),
                common::CONFIG_GENERATION => 0,
                common::QUEUE_SELECT => u64::from(self.select),
                common::QUEUE_SIZE => u64::from(q.size),
                common::QUEUE_MSIX_VECTOR => u64::from(q.vector),
                common::QUEUE_ENABLE => u64::from(q.enable),
                common::QUEUE_NOTIFY_OFF => u64::from(self.select),
                f @ 0x20..=0x37 => {
                    let v = [q.desc, q.driver, q.device][(f - 0x20) / 8];
                    if f % 8 == 0 {
                        v & 0xffff_ffff
                    } else {
                        v >> 32
                    }
                }
                _ => 0,
            },
            _ => 0,
        }
    }

    fn write(&mut self, offset: usize, value: u64) {
        if self.gone {
            return;
        }
        let sel = usize::from(self.select);
        let half = |old: u64, f: usize| {
            if f % 8 == 0 {
                (old & !0xffff_ffff) | (value & 0xffff_ffff)
            } else {
                (old & 0xffff_ffff) | value << 32
            }
        };
        match offset {
            // Queue 1's doorbell: notify_off 1 x multiplier 4; the value is the queue index.
            0x4004 if value == 1 => self.transmit(),
            0x1000..=0x10ff => match offset - 0x1000 {
                common::DEVICE_FEATURE_SELECT => self.device_select = value as u32,
                common::DRIVER_FEATURE_SELECT => self.driver_select = value as u32,
                common::DRIVER_FEATURE => {
                    if let Some(f) = self.driver_features.get_mut(self.driver_select as usize) {
                        *f = value as u32;
                    }
                }
                common::MSIX_CONFIG => self.msix_config = value as u16,
                common::DEVICE_STATUS if value == 0 => self.reset(),
                common::DEVICE_STATUS => self.status = value as u8,
                common::QUEUE_SELECT if value < 2 => self.select = value as u16,
                common::QUEUE_SIZE if value as u16 <= self.queues[sel].max => self.queues[sel].size = value as u16,
                common::QUEUE_MSIX_VECTOR => self.queues[sel].vector = value as u16,
                common::QUEUE_ENABLE => self.queues[sel].enable = value as u16,
                f @ 0x20..=0x27 => self.queues[sel].desc = half(self.queues[sel].desc, f),
                f @ 0x28..=0x2f => self.queues[sel].driver = half(self.queues[sel].driver, f),
                f @ 0x30..=0x37 => self.queues[sel].device = half(self.queues[sel].device, f),
                _ => {}
            },
            _ => {}
        }
    }
}

/// The device's BAR 0.
pub struct Bar(pub Rc<RefCell<FakeNet>>);

impl Mmio for Bar {
    fn read32(&mut self, offset: usize) -> u32 {
        self.0.borrow_mut().read(offset, 4) as u32
    }

    fn write32(&mut self, offset: usize, value: u32) {
        self.0.borrow_mut().write(offset, value.into());
    }

    fn read64(&mut self, _offset: usize) -> u64 {
        unreachable!("the driver splits 64-bit fields")
    }

    fn write64(&mut self, _offset: usize, _value: u64) {
        unreachable!("the driver splits 64-bit fields")
    }
}

impl Regs for Bar {
    fn read8(&mut self, offset: usize) -> u8 {
        self.0.borrow_mut().read(offset, 1) as u8
    }

    fn write8(&mut self, offset: usize, value: u8) {
        self.0.borrow_mut().write(offset, value.into());
    }

    fn read16(&mut self, offset: usize) -> u16 {
        self.0.borrow_mut().read(offset, 2) as u16
    }

    fn write16(&mut self, offset: usize, value: u16) {
        self.0.borrow_mut().write(offset, value.into());
    }
}

/// The driver's view of its memory.
pub struct Memory(pub Mem);

impl Memory {
    fn get<const N: usize>(&self, offset: usize) -> [u8; N] {
        let m = self.0.borrow();
        let mut b = [0xff; N];
        if let Some(src) = m.get(offset..offset + N) {
            b.copy_from_slice(src);
        }
        b
    }

    fn put(&self, offset: usize, data: &[u8]) {
        if let Some(dst) = self.0.borrow_mut().get_mut(offset..offset + data.len()) {
            dst.copy_from_slice(data);
        }
    }
}

impl Mmio for Memory {
    fn read32(&mut self, offset: usize) -> u32 {
        u32::from_le_bytes(self.get(offset))
    }

    fn write32(&mut self, offset: usize, value: u32) {
        self.put(offset, &value.to_le_bytes());
    }

    fn read64(&mut self, offset: usize) -> u64 {
        u64::from_le_bytes(self.get(offset))
    }

    fn write64(&mut self, offset: usize, value: u64) {
        self.put(offset, &value.to_le_bytes());
    }
}

impl Regs for Memory {
    fn read8(&mut self, offset: usize) -> u8 {
        self.get::<1>(offset)[0]
    }

    fn write8(&mut self, offset: usize, value: u8) {
        self.put(offset, &[value]);
    }

    fn read16(&mut self, offset: usize) -> u16 {
        u16::from_le_bytes(self.get(offset))
    }

    fn write16(&mut self, offset: usize, value: u16) {
        self.put(offset, &value.to_le_bytes());
    }
}

/// The contract's layout of BAR 0.
pub const LAYOUT: Layout =
    Layout { common: 0x1000, notify: 0x4000, notify_off_multiplier: 4, isr: 0x2000, device: 0x3000, notify_len: 8 };

/// A fake device, and the transport and memory a driver uses to reach it.
pub fn device() -> (Rc<RefCell<FakeNet>>, Transport<Bar>, Memory) {
    let mem: Mem = Rc::new(RefCell::new(vec![0; 2 * PAGE_SIZE]));
    let dev = Rc::new(RefCell::new(FakeNet::new(mem.clone())));
    (dev.clone(), Transport { regs: Bar(dev), layout: LAYOUT }, Memory(mem))
}
