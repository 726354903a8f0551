//! A host PCI function passed through with VFIO, behind the [`PciDevice`] trait.
//!
//! Configuration reads come from the device; writes go through the [`Firewall`]. Memory
//! BARs are offered mapped (the device file at the region's offset) where VFIO allows
//! mmap, with the MSI-X table and PBA pages, and whatever a sparse-mmap capability keeps
//! back, left as trapped holes; the rest go through `pread`/`pwrite`. I/O BARs are not
//! offered. The VMM emulates MSI-X and MSI once for every device kind and wires each
//! vector's eventfd here; INTx is an eventfd plus a resample eventfd.
//!
//! Guest-driven paths never fail: a failed access reads all-ones or is dropped, and is
//! logged once per kind (and BAR).

use std::ops::Range;

use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vmm_sys_util::eventfd::EventFd;

use super::backend::{IrqKind, RegionInfo, VfioDeviceOps};
use super::caps::{self, msix_pba_len, msix_table_len, read32, Capability};
use super::error::VfioError;
use super::firewall::{ConfigWrites, Firewall};
use crate::pci::{merge_ranges, BarInfo, BarMapping, DeviceError, MsiInfo, MsixLayout, PciDevice};
use crate::pci_regs::*;

/// Pages of x86-64: the granularity of mmap, KVM memory slots and the IOMMU.
const PAGE_SIZE: u64 = 4096;

/// A passed-through PCI function.
///
/// Drop every [`BarMapping::Mapped`] file (and unmap what was mapped from it) before the
/// device: while a device file is open the kernel keeps its group in the container.
pub struct VfioPciDevice {
    name: String,
    // Declared before `backend` so their file handles close first: the backend's drop
    // takes the group out of the container, which the kernel refuses while one is open.
    bars: Vec<BarInfo>,
    backend: Box<dyn VfioDeviceOps>,
    config_len: usize,
    caps: Vec<Capability>,
    firewall: Firewall,
    msix: Option<MsixLayout>,
    msi: Option<MsiInfo>,
    interrupt_pin: Option<u8>,
    /// The interrupt kind VFIO signals now: it has one at a time, and refuses to disable
    /// one that is not on.
    irqs_on: Option<IrqKind>,
    /// One bit per kind of failed access already logged (see [`Failure`]).
    logged: u32,
}

/// Kinds of failed guest access, logged once each.
#[derive(Clone, Copy)]
enum Failure {
    ConfigRead,
    ConfigWrite,
    BarRead(u8),
    BarWrite(u8),
}

impl Failure {
    fn bit(self) -> u32 {
        match self {
            Failure::ConfigRead => 1,
            Failure::ConfigWrite => 1 << 1,
            Failure::BarRead(bar) => 1 << (2 + bar.min(7)),
            Failure::BarWrite(bar) => 1 << (10 + bar.min(7)),
        }
    }
}

impl VfioPciDevice {
    /// The device behind `backend`, called `name` in messages (its host BDF), reading its
    /// configuration space once for capabilities and BARs. `config_writes` says what the
    /// firewall does with registers it does not know to be safe.
    pub fn new(
        name: impl Into<String>,
        backend: Box<dyn VfioDeviceOps>,
        config_writes: ConfigWrites,
    ) -> Result<Self, VfioError> {
        let name = name.into();
        let Some(region) = backend.region(VFIO_PCI_CONFIG_REGION_INDEX) else {
            return Err(VfioError::NoConfigRegion { name });
        };
        let config_len = region.size.min(PCI_CFG_SPACE_EXP_SIZE as u64) as usize;
        let mut config = vec![0; config_len];
        if let Err(source) = backend.read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut config) {
            return Err(VfioError::ConfigRead { name, source });
        }
        let caps = caps::walk(&config);
        // An interrupt kind VFIO offers no vector of cannot be wired: it is not reported.
        let msix = caps::msix(&config, &caps).filter(|_| backend.irq_count(IrqKind::Msix) > 0);
        let msi = caps::msi(&config, &caps).filter(|_| backend.irq_count(IrqKind::Msi) > 0);
        let interrupt_pin = config
            .get(PCI_INTERRUPT_PIN)
            .copied()
            .filter(|pin| (1..=4).contains(pin) && backend.irq_count(IrqKind::Intx) > 0);
        let bars = describe_bars(&*backend, &config, msix.as_ref());
        let firewall = Firewall::new(&caps, &config, config_writes);
        Ok(VfioPciDevice {
            name,
            backend,
            config_len,
            caps,
            firewall,
            bars,
            msix,
            msi,
            interrupt_pin,
            irqs_on: None,
            logged: 0,
        })
    }

    /// The device's name in messages (its host BDF).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes of configuration space: 256, or 4096 for PCI Express.
    pub fn config_len(&self) -> usize {
        self.config_len
    }

    /// The device's capabilities, standard then extended.
    pub fn capabilities(&self) -> &[Capability] {
        &self.caps
    }

    /// The MSI capability, when VFIO offers MSI.
    pub fn msi(&self) -> Option<MsiInfo> {
        self.msi
    }

    /// The INTx pin (1 = INTA to 4 = INTD), when the device has one and VFIO offers INTx.
    pub fn interrupt_pin(&self) -> Option<u8> {
        self.interrupt_pin
    }

    /// The vectors of `kind` VFIO offers.
    pub fn irq_count(&self, kind: IrqKind) -> u32 {
        self.backend.irq_count(kind)
    }

    /// Whether [`PciDevice::reset`] resets the device (VFIO offers `VFIO_DEVICE_RESET`).
    pub fn can_reset(&self) -> bool {
        self.backend.can_reset()
    }

    /// Signals MSI-X vector `i` on `fds[i]` (the VMM's irqfds), for as many vectors as
    /// `fds` holds.
    pub fn enable_msix(&mut self, fds: &[&EventFd]) -> Result<(), VfioError> {
        self.enable(IrqKind::Msix, fds)
    }

    /// Signals MSI vector `i` on `fds[i]`.
    pub fn enable_msi(&mut self, fds: &[&EventFd]) -> Result<(), VfioError> {
        self.enable(IrqKind::Msi, fds)
    }

    /// Signals INTx on `trigger` and unmasks it when `resample` is signalled (a KVM irqfd
    /// with a resample eventfd: the guest's EOI).
    pub fn enable_intx(&mut self, trigger: &EventFd, resample: &EventFd) -> Result<(), VfioError> {
        self.enable(IrqKind::Intx, &[trigger])?;
        self.backend.set_intx_resample(resample).map_err(|source| {
            // Leave INTx off rather than signalled but never unmasked.
            let _ = self.disable_irqs(IrqKind::Intx);
            VfioError::Irq { name: self.name.clone(), kind: IrqKind::Intx, action: "enable", source }
        })
    }

    /// Stops every vector of `kind`; nothing to do when `kind` is not on.
    pub fn disable_irqs(&mut self, kind: IrqKind) -> Result<(), VfioError> {
        if self.irqs_on != Some(kind) {
            return Ok(());
        }
        self.backend.disable_irq(kind).map_err(|source| VfioError::Irq {
            name: self.name.clone(),
            kind,
            action: "disable",
            source,
        })?;
        self.irqs_on = None;
        Ok(())
    }

    fn enable(&mut self, kind: IrqKind, fds: &[&EventFd]) -> Result<(), VfioError> {
        let offered = self.backend.irq_count(kind);
        if fds.is_empty() || fds.len() > offered as usize {
            return Err(VfioError::Vectors { name: self.name.clone(), kind, asked: fds.len(), offered });
        }
        self.backend.enable_irq(kind, fds).map_err(|source| VfioError::Irq {
            name: self.name.clone(),
            kind,
            action: "enable",
            source,
        })?;
        self.irqs_on = Some(kind);
        Ok(())
    }

    /// Guest configuration writes the firewall dropped something of, since open.
    pub fn dropped_config_writes(&self) -> u64 {
        self.firewall.dropped()
    }

    /// The dword registers the firewall dropped writes to, in order.
    pub fn dropped_config_registers(&self) -> Vec<usize> {
        self.firewall.dropped_registers()
    }

    /// Logs `failure` the first time it happens.
    fn failed(&mut self, failure: Failure, at: u64, error: &std::io::Error) {
        if self.logged & failure.bit() != 0 {
            return;
        }
        self.logged |= failure.bit();
        let what = match failure {
            Failure::ConfigRead => "configuration read".to_string(),
            Failure::ConfigWrite => "configuration write".to_string(),
            Failure::BarRead(bar) => format!("BAR {bar} read"),
            Failure::BarWrite(bar) => format!("BAR {bar} write"),
        };
        tracing::warn!(device = self.name, at = format_args!("{at:#x}"), "VFIO {what} failed: {error} (logged once)");
    }

    fn offers(&self, bar: u8) -> bool {
        self.bars.iter().any(|b| b.index == bar)
    }
}

impl PciDevice for VfioPciDevice {
    fn intx_pin(&self) -> Option<u8> {
        self.interrupt_pin
    }

    fn connect_intx(&mut self, lines: Option<(&EventFd, &EventFd)>) -> Result<(), DeviceError> {
        let result = match lines {
            Some((trigger, resample)) => self.enable_intx(trigger, resample),
            None => self.disable_irqs(IrqKind::Intx),
        };
        result.map_err(|e| DeviceError::Interrupts {
            what: if lines.is_some() { "connected" } else { "disconnected" },
            source: std::io::Error::other(e.to_string()),
        })
    }

    fn msi(&self) -> Option<MsiInfo> {
        self.msi
    }

    fn connect_msi(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        let result = match vectors {
            Some(fds) => self.enable_msi(fds),
            None => self.disable_irqs(IrqKind::Msi),
        };
        result.map_err(|e| DeviceError::Interrupts {
            what: if vectors.is_some() { "connected" } else { "disconnected" },
            source: std::io::Error::other(e.to_string()),
        })
    }

    fn dropped_config_writes(&self) -> u64 {
        self.firewall.dropped()
    }

    fn config_read(&mut self, reg: usize, data: &mut [u8]) {
        data.fill(0xff);
        let len = self.config_len.saturating_sub(reg).min(data.len());
        if len == 0 {
            return;
        }
        if let Err(e) = self.backend.read(VFIO_PCI_CONFIG_REGION_INDEX, reg as u64, &mut data[..len]) {
            data.fill(0xff);
            self.failed(Failure::ConfigRead, reg as u64, &e);
        }
    }

    fn config_write(&mut self, reg: usize, data: &[u8]) {
        for run in self.firewall.filter(&self.name, reg, data) {
            let at = run.reg as u64;
            let len = run.bytes.len().min(self.config_len.saturating_sub(run.reg));
            if len == 0 {
                continue;
            }
            let bytes = if run.merges() {
                let mut current = vec![0; run.bytes.len()];
                if let Err(e) = self.backend.read(VFIO_PCI_CONFIG_REGION_INDEX, at, &mut current[..len]) {
                    // Without the device's bits the write cannot be made safe: drop it.
                    self.failed(Failure::ConfigRead, at, &e);
                    continue;
                }
                run.merged(&current)
            } else {
                run.bytes
            };
            if let Err(e) = self.backend.write(VFIO_PCI_CONFIG_REGION_INDEX, at, &bytes[..len]) {
                self.failed(Failure::ConfigWrite, at, &e);
            }
        }
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        if !self.offers(bar) {
            data.fill(0xff);
            return;
        }
        if let Err(e) = self.backend.read(u32::from(bar), offset, data) {
            data.fill(0xff);
            self.failed(Failure::BarRead(bar), offset, &e);
        }
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if !self.offers(bar) {
            return;
        }
        if let Err(e) = self.backend.write(u32::from(bar), offset, data) {
            self.failed(Failure::BarWrite(bar), offset, &e);
        }
    }

    fn bars(&self) -> Vec<BarInfo> {
        self.bars.clone()
    }

    /// Where the MSI-X table and PBA are, when the device has MSI-X and VFIO offers it.
    fn msix(&self) -> Option<MsixLayout> {
        self.msix
    }

    fn connect_msix(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        let (what, result) = match vectors {
            Some(fds) => ("connected", self.enable_msix(fds)),
            None => ("disconnected", self.disable_irqs(IrqKind::Msix)),
        };
        result.map_err(|e| DeviceError::Interrupts { what, source: std::io::Error::other(e) })
    }

    fn can_reset(&self) -> bool {
        self.backend.can_reset()
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        if !self.backend.can_reset() {
            tracing::debug!(device = self.name, "VFIO offers no reset for this device");
            return Ok(());
        }
        // MSI and MSI-X off first, as QEMU's vfio_pci_pre_reset does: the device must not
        // signal the guest's vectors across its reset, and the guest finds them off after
        // it anyway (the VMM's own disconnect that follows has nothing left to do). INTx
        // stays: its line is the function's.
        if let Some(kind @ (IrqKind::Msi | IrqKind::Msix)) = self.irqs_on {
            if let Err(e) = self.disable_irqs(kind) {
                tracing::warn!(device = self.name, "before the reset: {e}");
            }
        }
        self.backend.reset().map_err(DeviceError::Reset)
    }
}

/// The memory BARs of a device with configuration space `config`.
fn describe_bars(backend: &dyn VfioDeviceOps, config: &[u8], msix: Option<&MsixLayout>) -> Vec<BarInfo> {
    let mut bars = Vec::new();
    let mut index = 0u8;
    while index < 6 {
        let reg = read32(config, PCI_BASE_ADDRESS_0 + 4 * usize::from(index));
        let is_io = reg & PCI_BASE_ADDRESS_SPACE_IO != 0;
        let is_64bit = !is_io && reg & PCI_BASE_ADDRESS_MEM_TYPE_MASK == PCI_BASE_ADDRESS_MEM_TYPE_64;
        let region = backend.region(u32::from(index)).filter(|r| r.size > 0);
        // A 64-bit BAR needs the next register too: in BAR 5 it is malformed.
        if let Some(region) = region.filter(|_| !is_io && (!is_64bit || index < 5)) {
            let mapping = match region.mmap_fd.clone().filter(|_| region.mmap && region.size >= PAGE_SIZE) {
                None => BarMapping::Trapped,
                Some(fd) => {
                    let holes = holes(index, &region, msix);
                    match holes.first() {
                        Some(h) if *h == (0..region.size) => BarMapping::Trapped,
                        _ => BarMapping::Mapped { fd, offset: region.offset, holes },
                    }
                }
            };
            let prefetchable = reg & PCI_BASE_ADDRESS_MEM_PREFETCH != 0;
            bars.push(BarInfo { index, size: region.size, is_64bit, prefetchable, mapping });
        }
        index += if is_64bit { 2 } else { 1 };
    }
    bars
}

/// The parts of BAR `bar` (region `region`) that must stay trapped, page-aligned, sorted
/// and merged: the MSI-X table and PBA pages, and what a sparse-mmap capability does not
/// let the VMM map.
pub(super) fn holes(bar: u8, region: &RegionInfo, msix: Option<&MsixLayout>) -> Vec<Range<u64>> {
    let mut holes = Vec::new();
    if let Some(m) = msix {
        for ((index, offset), len) in [(m.table, msix_table_len(m)), (m.pba, msix_pba_len(m))] {
            if index == bar {
                holes.push(page_down(offset)..page_up(offset.saturating_add(len)));
            }
        }
    }
    if let Some(areas) = &region.sparse_mmap {
        // Only whole pages inside an area may be mapped; the gaps between them are holes.
        let mut areas: Vec<Range<u64>> =
            areas.iter().map(|a| page_up(a.start)..page_down(a.end)).filter(|a| a.start < a.end).collect();
        areas.sort_by_key(|a| a.start);
        let mut at = 0;
        for a in areas {
            if a.start > at {
                holes.push(at..a.start);
            }
            at = at.max(a.end);
        }
        holes.push(at..region.size);
    }
    merge_ranges(holes, region.size)
}

fn page_down(x: u64) -> u64 {
    x & !(PAGE_SIZE - 1)
}

fn page_up(x: u64) -> u64 {
    x.div_ceil(PAGE_SIZE).saturating_mul(PAGE_SIZE)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::vfio::fake::{region, Call, FakeDevice};

    const MIB: u64 = 1 << 20;

    fn open(fake: &FakeDevice, mode: ConfigWrites) -> VfioPciDevice {
        VfioPciDevice::new("0000:41:00.0", Box::new(fake.clone()), mode).unwrap()
    }

    fn read32_at(dev: &mut VfioPciDevice, reg: usize) -> u32 {
        let mut b = [0; 4];
        dev.config_read(reg, &mut b);
        u32::from_le_bytes(b)
    }

    #[test]
    fn test_config_reads_come_from_the_device() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Filtered);
        assert_eq!(dev.config_len(), 4096);
        assert_eq!(read32_at(&mut dev, PCI_VENDOR_ID), 0x2330_10de);
        assert_eq!(read32_at(&mut dev, 0xb0 + PCI_MSIX_TABLE), 0x000b_0000);
        // Past the end: all-ones, never a panic.
        assert_eq!(read32_at(&mut dev, 0x1000), u32::MAX);
        assert_eq!(read32_at(&mut dev, usize::MAX), u32::MAX);
        // A conventional function's extended space reads all-ones; a straddling read is
        // served in part.
        fake.with(|s| s.regions.get_mut(&VFIO_PCI_CONFIG_REGION_INDEX).unwrap().size = 256);
        let mut dev = open(&fake, ConfigWrites::Filtered);
        assert_eq!(dev.config_len(), 256);
        assert_eq!(read32_at(&mut dev, 0x100), u32::MAX);
        assert_eq!(read32_at(&mut dev, 0xfe), 0xffff_0000);
        assert!(dev.capabilities().iter().all(|c| c.offset < 0x100));
        // A failing device reads all-ones.
        fake.with(|s| s.fail_io = true);
        assert_eq!(read32_at(&mut dev, PCI_VENDOR_ID), u32::MAX);
    }

    #[test]
    fn test_firewall_decides_which_writes_reach_the_device() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Filtered);
        let command = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_IO;
        dev.config_write(PCI_COMMAND, &command.to_le_bytes());
        dev.config_write(PCI_BASE_ADDRESS_0, &[0xff; 4]);
        dev.config_write(0xb0 + PCI_MSIX_FLAGS, &PCI_MSIX_FLAGS_ENABLE.to_le_bytes());
        dev.config_write(0xc4, &[0xde, 0xad]);
        dev.config_write(0x150, &[1, 2, 3, 4]);
        assert_eq!(
            fake.take_config_writes(),
            [(PCI_COMMAND, vec![0x06, 0x00]), (0xb2, vec![63, 0x80])],
            "I/O enable, the BAR, the vendor-specific and extended registers stay out"
        );
        assert_eq!(read32_at(&mut dev, PCI_BASE_ADDRESS_0), 0xfd00_0000, "the BAR is untouched");
        assert_eq!(dev.dropped_config_writes(), 3);
        assert_eq!(dev.dropped_config_registers(), [PCI_COMMAND, 0xc4, 0x150]);
        // The same drops again are counted, not logged again.
        dev.config_write(0xc4, &[0xde, 0xad]);
        assert_eq!((dev.dropped_config_writes(), dev.dropped_config_registers().len()), (4, 3));
        // A device failing writes drops them quietly.
        fake.with(|s| s.fail_io = true);
        dev.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
        assert_eq!(fake.take_config_writes(), []);
    }

    #[test]
    fn test_bits_the_guest_may_not_change_keep_the_device_value() {
        let fake = FakeDevice::gpu();
        // The host left I/O decode on and programmed Max_Payload_Size 256 B.
        fake.with(|s| {
            s.config.set16(PCI_COMMAND, PCI_COMMAND_IO);
            s.config.set16(0x70 + PCI_EXP_DEVCTL, 1 << 5);
        });
        let mut dev = open(&fake, ConfigWrites::Filtered);
        dev.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
        // The guest asks for 128 B and relaxed ordering.
        dev.config_write(0x70 + PCI_EXP_DEVCTL, &PCI_EXP_DEVCTL_RELAX_EN.to_le_bytes());
        let command = PCI_COMMAND_IO | PCI_COMMAND_MEMORY;
        let devctl = PCI_EXP_DEVCTL_RELAX_EN | 1 << 5;
        assert_eq!(
            fake.take_config_writes(),
            [(PCI_COMMAND, command.to_le_bytes().to_vec()), (0x78, devctl.to_le_bytes().to_vec())]
        );
        assert_eq!(dev.dropped_config_writes(), 0, "the guest set no bit it may not");
    }

    #[test]
    fn test_permissive_flag_passes_vendor_registers_but_never_bars() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Permissive);
        dev.config_write(0xc4, &[0xde, 0xad]);
        dev.config_write(PCI_BASE_ADDRESS_0 + 16, &[0; 4]);
        // Past a 256-byte region nothing is written even in permissive mode.
        fake.with(|s| s.regions.get_mut(&VFIO_PCI_CONFIG_REGION_INDEX).unwrap().size = 256);
        let mut small = open(&fake, ConfigWrites::Permissive);
        small.config_write(0xfe, &[1, 2, 3, 4]);
        assert_eq!(fake.take_config_writes(), [(0xc4, vec![0xde, 0xad]), (0xfe, vec![1, 2])]);
        assert_eq!(dev.dropped_config_writes(), 0);
    }

    #[test]
    #[expect(clippy::single_range_in_vec_init, reason = "lists of holes that hold one range")]
    fn test_bars_are_mapped_around_msix_and_sparse_holes() {
        let fake = FakeDevice::gpu();
        let dev = open(&fake, ConfigWrites::Filtered);
        let file = fake.file();
        let bars: Vec<_> = dev
            .bars()
            .into_iter()
            .map(|b| {
                let mapping = match b.mapping {
                    BarMapping::Mapped { fd, offset, holes } => {
                        assert!(Arc::ptr_eq(&fd, &file));
                        Some((offset, holes))
                    }
                    BarMapping::Trapped => None,
                };
                (b.index, b.size, b.is_64bit, b.prefetchable, mapping)
            })
            .collect();
        assert_eq!(
            bars,
            [
                (0, 16 * MIB, false, false, Some((0, vec![0xb_0000..0xb_1000, 0xb_c000..0xb_d000]))),
                (1, 256 * MIB, true, true, Some((1 << 40, vec![128 * MIB..192 * MIB]))),
                // BAR3 is I/O: not offered. BAR4 may not be mmapped.
                (4, 4096, false, false, None),
            ]
        );
    }

    #[test]
    #[expect(clippy::single_range_in_vec_init, reason = "lists of holes that hold one range")]
    fn test_holes() {
        let bar = |size, sparse| region(0, size, true, sparse);
        let msix = |table_offset, pba_bar, pba_offset| MsixLayout {
            cap: 0xb0,
            vectors: 300,
            table: (0, table_offset),
            pba: (pba_bar, pba_offset),
        };
        // An unaligned table of 300 vectors (4800 bytes) spans two pages; the PBA shares
        // the second.
        let m = msix(0x2800, 0, 0x3f00);
        assert_eq!(holes(0, &bar(MIB, None), Some(&m)), [0x2000..0x4000]);
        // The PBA elsewhere; a BAR without the table has no MSI-X holes.
        let m = msix(0, 2, 0);
        assert_eq!(holes(0, &bar(MIB, None), Some(&m)), [0..0x2000]);
        assert_eq!(holes(2, &bar(MIB, None), Some(&m)), [0..0x1000]);
        assert_eq!(holes(1, &bar(MIB, None), Some(&m)), []);
        // Sparse areas shrink to whole pages; everything outside them is a hole.
        let sparse = Some(vec![0x1800..0x8000, 0x9000..0xa000, 0xc000..0xe800]);
        assert_eq!(holes(1, &bar(0x10000, sparse), None), [0..0x2000, 0x8000..0x9000, 0xa000..0xc000, 0xe000..0x10000]);
        // No area at all: the whole BAR is a hole, so the BAR is trapped.
        assert_eq!(holes(1, &bar(0x10000, Some(vec![])), None), [0..0x10000]);
        // A table claiming to run past the BAR is clamped to it.
        let m = msix(u64::MAX - 8, 0, u64::MAX - 8);
        assert_eq!(holes(0, &bar(MIB, None), Some(&m)), []);
    }

    #[test]
    fn test_a_bar_all_holes_or_not_mappable_is_trapped() {
        let fake = FakeDevice::gpu();
        // BAR0's table and PBA fill a 4 KiB BAR; BAR1's sparse capability offers nothing.
        fake.with(|s| {
            s.regions.insert(0, region(0, 4096, true, None));
            s.regions.insert(1, region(1, 256 * MIB, true, Some(vec![])));
            s.config.set32(0xb0 + PCI_MSIX_TABLE, 0);
            s.config.set32(0xb0 + PCI_MSIX_PBA, 0x800);
        });
        let dev = open(&fake, ConfigWrites::Filtered);
        assert!(dev.bars().iter().all(|b| matches!(b.mapping, BarMapping::Trapped)));
        // A 64-bit BAR in BAR 5 is malformed and not offered.
        fake.with(|s| {
            s.regions.insert(5, region(5, MIB, true, None));
            s.config.set32(PCI_BASE_ADDRESS_0 + 20, PCI_BASE_ADDRESS_MEM_TYPE_64);
        });
        assert!(open(&fake, ConfigWrites::Filtered).bars().iter().all(|b| b.index != 5));
    }

    #[test]
    fn test_bar_accesses_reach_the_region() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Filtered);
        dev.bar_write(4, 0x10, &[1, 2, 3, 4]);
        let mut b = [0; 4];
        dev.bar_read(4, 0x10, &mut b);
        assert_eq!(b, [1, 2, 3, 4]);
        dev.bar_read(0, 0xb_c008, &mut b);
        assert_eq!(b, [0x08, 0x09, 0x0a, 0x0b]);
        assert_eq!(fake.take_calls(), [Call::Write(4, 0x10, vec![1, 2, 3, 4])]);
        // Past the BAR, an I/O BAR, a BAR that does not exist: all-ones, writes dropped.
        for (bar, offset) in [(4, 0xffe), (3, 0), (5, 0), (200, 0)] {
            dev.bar_read(bar, offset, &mut b);
            assert_eq!(b, [0xff; 4], "BAR {bar} at {offset:#x}");
            dev.bar_write(bar, offset, &b);
        }
        assert_eq!(fake.take_calls(), []);
    }

    #[test]
    fn test_interrupt_layout_and_wiring() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Filtered);
        let msix = dev.msix().unwrap();
        assert_eq!((msix.cap, msix.vectors, msix.table, msix.pba), (0xb0, 64, (0, 0xb_0000), (0, 0xb_c000)));
        assert_eq!(dev.msi().map(|m| (m.cap, m.vectors)), Some((0x50, 8)));
        assert_eq!(dev.interrupt_pin(), Some(1));
        let fds: Vec<EventFd> = (0..65).map(|_| EventFd::new(0).unwrap()).collect();
        let refs: Vec<&EventFd> = fds.iter().collect();
        dev.enable_msix(&refs[..64]).unwrap();
        dev.disable_irqs(IrqKind::Msix).unwrap();
        dev.enable_msi(&refs[..1]).unwrap();
        dev.enable_intx(refs[0], refs[1]).unwrap();
        assert_eq!(
            fake.take_calls(),
            [
                Call::Enable(IrqKind::Msix, 64),
                Call::Disable(IrqKind::Msix),
                Call::Enable(IrqKind::Msi, 1),
                Call::Enable(IrqKind::Intx, 1),
                Call::Resample
            ]
        );
        // The same through the device trait, as the VMM's MSI-X wiring calls it.
        dev.connect_msix(Some(&refs[..64])).unwrap();
        dev.connect_msix(None).unwrap();
        assert_eq!(fake.take_calls(), [Call::Enable(IrqKind::Msix, 64), Call::Disable(IrqKind::Msix)]);
        let err = dev.connect_msix(Some(&refs)).unwrap_err();
        assert_eq!(err.to_string(), "the device's interrupts could not be connected");
        let err = dev.enable_msix(&refs).unwrap_err();
        assert_eq!(err.to_string(), "VFIO device 0000:41:00.0 offers 64 MSI-X vector(s), 65 were asked");
        assert!(matches!(dev.enable_msi(&[]), Err(VfioError::Vectors { asked: 0, offered: 8, .. })));
        fake.with(|s| s.fail_io = true);
        let err = dev.enable_msi(&refs[..2]).unwrap_err();
        assert_eq!(err.to_string(), "VFIO could not enable MSI on device 0000:41:00.0");
        assert!(std::error::Error::source(&err).is_some());
    }

    #[test]
    fn test_interrupts_vfio_does_not_offer_are_not_reported() {
        let fake = FakeDevice::gpu();
        fake.with(|s| {
            s.irqs.insert(IrqKind::Msix, 0);
            s.irqs.insert(IrqKind::Intx, 0);
        });
        let dev = open(&fake, ConfigWrites::Filtered);
        assert_eq!((dev.msix(), dev.interrupt_pin()), (None, None));
        assert!(dev.msi().is_some());
        // Without MSI-X, its table pages need no hole.
        assert!(matches!(&dev.bars()[0].mapping, BarMapping::Mapped { holes, .. } if holes.is_empty()));
    }

    #[test]
    fn test_vectors_go_off_before_a_reset_and_only_what_is_on_is_disabled() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Filtered);
        let fds: Vec<EventFd> = (0..2).map(|_| EventFd::new(0).unwrap()).collect();
        let refs: Vec<&EventFd> = fds.iter().collect();
        // Nothing is on: VFIO would refuse a disable, so none is asked.
        dev.connect_msix(None).unwrap();
        dev.disable_irqs(IrqKind::Intx).unwrap();
        assert_eq!(fake.take_calls(), []);
        // MSI-X on, then a Function Level Reset, then the VMM's disconnect.
        dev.connect_msix(Some(&refs)).unwrap();
        dev.reset().unwrap();
        dev.connect_msix(None).unwrap();
        assert_eq!(fake.take_calls(), [Call::Enable(IrqKind::Msix, 2), Call::Disable(IrqKind::Msix), Call::Reset]);
        // INTx stays connected across a reset.
        dev.enable_intx(refs[0], refs[1]).unwrap();
        dev.reset().unwrap();
        assert_eq!(fake.take_calls(), [Call::Enable(IrqKind::Intx, 1), Call::Resample, Call::Reset]);
        dev.connect_intx(None).unwrap();
        assert_eq!(fake.take_calls(), [Call::Disable(IrqKind::Intx)]);
    }

    #[test]
    fn test_reset_only_where_offered() {
        let fake = FakeDevice::gpu();
        let mut dev = open(&fake, ConfigWrites::Filtered);
        assert!(dev.can_reset());
        dev.reset().unwrap();
        assert_eq!(fake.take_calls(), [Call::Reset]);
        fake.with(|s| s.fail_io = true);
        assert!(matches!(dev.reset(), Err(DeviceError::Reset(_))));
        fake.with(|s| s.can_reset = false);
        dev.reset().unwrap();
        assert_eq!(fake.take_calls(), []);
    }

    #[test]
    fn test_devices_without_configuration_space_are_refused() {
        let fake = FakeDevice::gpu();
        fake.with(|s| s.fail_io = true);
        let err = VfioPciDevice::new("0000:41:00.0", Box::new(fake.clone()), ConfigWrites::Filtered).err().unwrap();
        assert_eq!(err.to_string(), "the configuration space of VFIO device 0000:41:00.0 could not be read");
        fake.with(|s| {
            s.regions.remove(&VFIO_PCI_CONFIG_REGION_INDEX);
        });
        let err = VfioPciDevice::new("0000:41:00.0", Box::new(fake), ConfigWrites::Filtered).err().unwrap();
        assert_eq!(err.to_string(), "VFIO device 0000:41:00.0 has no PCI configuration region");
    }
}
