//! Test doubles: an emulated GPU or NIC as a register file that follows
//! [`gdrvm_model::emulated`], over a fake physical address space that the NIC copies in and
//! the CPU reaches through [`Window`]s.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use gdrvm_model::emulated::{
    DESC_DST, DESC_LEN, DESC_LEN_FIELD, DESC_MAX_LEN, DESC_SRC, DESC_STATUS, ENGINE_BROKEN, ENGINE_BUSY, ENGINE_IDLE,
    GPU_APERTURE_BAR, GPU_APERTURE_SIZE_HI, GPU_APERTURE_SIZE_LO, KIND_GPU, KIND_NIC, NIC_BYTES_HI, NIC_BYTES_LO,
    NIC_COMPLETED, NIC_ENGINE, NIC_FAILED, NIC_RING_BASE_HI, NIC_RING_BASE_LO, NIC_RING_HEAD, NIC_RING_SIZE,
    NIC_RING_TAIL, REGS, REG_IDENT, REG_IRQ_COUNT, REG_IRQ_DOORBELL, REG_KIND, REG_SCRATCH, REG_VERSION,
    STATUS_BAD_LENGTH, STATUS_NO_BUS_MASTER, STATUS_OK, STATUS_UNMAPPED, VERSION,
};

use crate::pcidev::Mmio;

/// A physical address space: regions by base address.
pub type Phys = Rc<RefCell<BTreeMap<u64, Vec<u8>>>>;

/// An address space with `regions` (base, bytes) of zeros.
pub fn phys(regions: &[(u64, usize)]) -> Phys {
    Rc::new(RefCell::new(regions.iter().map(|&(base, len)| (base, vec![0; len])).collect()))
}

/// The region and offset holding `len` bytes at `addr`, if one holds them all.
fn locate(map: &BTreeMap<u64, Vec<u8>>, addr: u64, len: usize) -> Option<(u64, usize)> {
    let (&base, region) = map.range(..=addr).next_back()?;
    let at = usize::try_from(addr - base).ok()?;
    (at.checked_add(len)? <= region.len()).then_some((base, at))
}

/// Reads `len` bytes at `addr`.
pub fn read_phys(phys: &Phys, addr: u64, len: usize) -> Option<Vec<u8>> {
    let map = phys.borrow();
    let (base, at) = locate(&map, addr, len)?;
    Some(map[&base][at..at + len].to_vec())
}

/// Writes `data` at `addr`; false when no region holds it all.
pub fn write_phys(phys: &Phys, addr: u64, data: &[u8]) -> bool {
    let mut map = phys.borrow_mut();
    let Some((base, at)) = locate(&map, addr, data.len()) else { return false };
    map.get_mut(&base).is_some_and(|r| {
        r[at..at + data.len()].copy_from_slice(data);
        true
    })
}

/// What the CPU sees of physical memory: from `base` on, or (when `pages` is not empty)
/// page `i` at `pages[i]`, as a process sees its pinned buffer. Out of range reads all-ones.
pub struct Window {
    /// The address space.
    pub phys: Phys,
    /// Where offset 0 is.
    pub base: u64,
    /// The pages, when scattered.
    pub pages: Vec<u64>,
}

impl Window {
    fn addr(&self, offset: usize) -> Option<u64> {
        if self.pages.is_empty() {
            return Some(self.base + offset as u64);
        }
        Some(self.pages.get(offset / 4096)? + (offset % 4096) as u64)
    }
}

impl Mmio for Window {
    fn read32(&mut self, offset: usize) -> u32 {
        self.addr(offset)
            .and_then(|a| read_phys(&self.phys, a, 4))
            .map_or(u32::MAX, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn write32(&mut self, offset: usize, value: u32) {
        if let Some(a) = self.addr(offset) {
            write_phys(&self.phys, a, &value.to_le_bytes());
        }
    }

    fn read64(&mut self, offset: usize) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }

    fn write64(&mut self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
}

/// An emulated GPU or NIC's BAR 0 registers, and the NIC's DMA engine, which processes
/// `per_poll` descriptors each time the driver reads HEAD.
pub struct FakeDevice {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// REG_KIND.
    pub kind: u32,
    /// REG_SCRATCH.
    pub scratch: u32,
    /// Scratch drops writes.
    pub scratch_broken: bool,
    /// Every register reads all-ones.
    pub gone: bool,
    /// REG_IRQ_COUNT.
    pub irq_count: u32,
    /// GPU: aperture BAR index and size.
    pub aperture: (u32, u64),
    /// NIC: where DMA goes.
    pub phys: Phys,
    /// NIC: ring base, size, head, tail.
    pub ring: (u64, u32, u32, u32),
    /// NIC: completed, failed, bytes.
    pub counters: (u32, u32, u64),
    /// NIC: descriptors processed per HEAD read.
    pub per_poll: u32,
    /// NIC: physical ranges (base, len) its DMA cannot reach (peers' BARs with p2p off).
    pub unreachable: Vec<(u64, u64)>,
    /// NIC: the engine never advances.
    pub stuck: bool,
    /// NIC: Command's bus master bit.
    pub bus_master: bool,
    /// NIC: every descriptor processed: (src, dst, len, status).
    pub seen: Vec<(u64, u64, u32, u32)>,
    /// NIC: the engine could not read the ring.
    pub broken: bool,
}

impl FakeDevice {
    fn new(vendor: u16, device: u16, kind: u32) -> Self {
        FakeDevice {
            vendor,
            device,
            kind,
            scratch: 0,
            scratch_broken: false,
            gone: false,
            irq_count: 0,
            aperture: (0, 0),
            phys: phys(&[]),
            ring: (0, 0, 0, 0),
            counters: (0, 0, 0),
            per_poll: 3,
            unreachable: Vec::new(),
            stuck: false,
            bus_master: true,
            seen: Vec::new(),
            broken: false,
        }
    }

    /// A GPU with its aperture at BAR `bar`, `size` bytes.
    pub fn gpu(vendor: u16, device: u16, bar: u32, size: u64) -> Self {
        FakeDevice { aperture: (bar, size), ..FakeDevice::new(vendor, device, KIND_GPU) }
    }

    /// A NIC with an empty address space.
    pub fn nic(vendor: u16, device: u16) -> Self {
        FakeDevice::new(vendor, device, KIND_NIC)
    }

    /// A NIC copying in `phys`.
    pub fn nic_on(phys: Phys) -> Self {
        FakeDevice { phys, ..FakeDevice::nic(0x15b3, 0x101b) }
    }

    fn reachable(&self, addr: u64, len: u32) -> bool {
        let end = addr + u64::from(len);
        let blocked = self.unreachable.iter().any(|&(b, l)| addr < b + l && b < end);
        !blocked && locate(&self.phys.borrow(), addr, len as usize).is_some()
    }

    /// Processes one descriptor, as the NIC emulator would.
    fn step(&mut self) {
        let (base, size, head, _) = self.ring;
        let at = base + u64::from(head % size) * DESC_LEN;
        let Some(desc) = read_phys(&self.phys, at, DESC_LEN as usize) else {
            self.broken = true;
            return;
        };
        let u64_at = |o: u64| u64::from_le_bytes(desc[o as usize..o as usize + 8].try_into().unwrap());
        let (src, dst) = (u64_at(DESC_SRC), u64_at(DESC_DST));
        let len = u32::from_le_bytes(desc[DESC_LEN_FIELD as usize..DESC_LEN_FIELD as usize + 4].try_into().unwrap());
        let status = if !self.bus_master {
            STATUS_NO_BUS_MASTER
        } else if len == 0 || len > DESC_MAX_LEN {
            STATUS_BAD_LENGTH
        } else if !self.reachable(src, len) || !self.reachable(dst, len) {
            STATUS_UNMAPPED
        } else {
            let data = read_phys(&self.phys, src, len as usize).unwrap();
            write_phys(&self.phys, dst, &data);
            STATUS_OK
        };
        write_phys(&self.phys, at + DESC_STATUS, &status.to_le_bytes());
        self.seen.push((src, dst, len, status));
        if status == STATUS_OK {
            self.counters.0 += 1;
            self.counters.2 += u64::from(len);
        } else {
            self.counters.1 += 1;
        }
        self.ring.2 = head.wrapping_add(1);
    }

    fn read_reg(&mut self, reg: u64) -> u32 {
        let (base, size, head, tail) = self.ring;
        match (reg, self.kind) {
            (REG_IDENT, _) => u32::from(self.device) << 16 | u32::from(self.vendor),
            (REG_KIND, _) => self.kind,
            (REG_VERSION, _) => VERSION,
            (REG_SCRATCH, _) => self.scratch,
            (REG_IRQ_COUNT, _) => self.irq_count,
            (GPU_APERTURE_BAR, KIND_GPU) => self.aperture.0,
            (GPU_APERTURE_SIZE_LO, KIND_GPU) => self.aperture.1 as u32,
            (GPU_APERTURE_SIZE_HI, KIND_GPU) => (self.aperture.1 >> 32) as u32,
            (NIC_RING_BASE_LO, KIND_NIC) => base as u32,
            (NIC_RING_BASE_HI, KIND_NIC) => (base >> 32) as u32,
            (NIC_RING_SIZE, KIND_NIC) => size,
            (NIC_RING_HEAD, KIND_NIC) => {
                for _ in 0..self.per_poll {
                    if self.stuck || self.broken || size == 0 || self.ring.2 == tail {
                        break;
                    }
                    self.step();
                }
                self.ring.2
            }
            (NIC_RING_TAIL, KIND_NIC) => tail,
            (NIC_COMPLETED, KIND_NIC) => self.counters.0,
            (NIC_FAILED, KIND_NIC) => self.counters.1,
            (NIC_BYTES_LO, KIND_NIC) => self.counters.2 as u32,
            (NIC_BYTES_HI, KIND_NIC) => (self.counters.2 >> 32) as u32,
            (NIC_ENGINE, KIND_NIC) if self.broken => ENGINE_BROKEN,
            (NIC_ENGINE, KIND_NIC) if head != tail => ENGINE_BUSY,
            (NIC_ENGINE, KIND_NIC) => ENGINE_IDLE,
            _ => 0,
        }
    }

    fn write_reg(&mut self, reg: u64, value: u32) {
        let ring = &mut self.ring;
        match (reg, self.kind) {
            (REG_SCRATCH, _) if !self.scratch_broken => self.scratch = value,
            (REG_IRQ_DOORBELL, _) => {}
            (NIC_RING_BASE_LO, KIND_NIC) => ring.0 = ring.0 & !0xffff_ffff | u64::from(value),
            (NIC_RING_BASE_HI, KIND_NIC) => ring.0 = ring.0 & 0xffff_ffff | u64::from(value) << 32,
            (NIC_RING_SIZE, KIND_NIC) => {
                *ring = (ring.0, value, 0, 0);
                self.broken = false;
            }
            (NIC_RING_TAIL, KIND_NIC) => ring.3 = value,
            _ => {}
        }
    }
}

impl Mmio for FakeDevice {
    fn read32(&mut self, offset: usize) -> u32 {
        match (offset as u64).checked_sub(REGS) {
            _ if self.gone => u32::MAX,
            Some(reg) if offset % 4 == 0 => self.read_reg(reg),
            _ => 0,
        }
    }

    fn write32(&mut self, offset: usize, value: u32) {
        if let Some(reg) = (offset as u64).checked_sub(REGS).filter(|_| !self.gone && offset % 4 == 0) {
            self.write_reg(reg, value);
        }
    }

    fn read64(&mut self, offset: usize) -> u64 {
        u64::from(self.read32(offset)) | u64::from(self.read32(offset + 4)) << 32
    }

    fn write64(&mut self, offset: usize, value: u64) {
        self.write32(offset, value as u32);
        self.write32(offset + 4, (value >> 32) as u32);
    }
}
