//! A fake VFIO layer for unit tests (these hosts have no `/dev/vfio`): a device with a
//! recorded configuration space and regions that records what it is asked, and a
//! container that records its DMA mappings.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::sync::{Arc, Mutex};

use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vfio_ioctls::VfioError as IoctlError;
use vmm_sys_util::eventfd::EventFd;

use super::backend::{IrqKind, RegionInfo, VfioContainerOps, VfioDeviceOps};
use crate::lock;
use crate::pci_regs::*;

/// A configuration space image.
#[derive(Clone)]
pub(crate) struct ConfigImage {
    pub bytes: Vec<u8>,
}

impl ConfigImage {
    /// A PCI Express GPU-like function:
    /// - BAR0 32-bit 16 MiB (MSI-X table at 0xb0000, PBA at 0xbc000), BAR1 64-bit
    ///   prefetchable 256 MiB, BAR3 I/O, BAR4 32-bit 4 KiB, interrupt pin A;
    /// - capabilities: PM 0x40, MSI 0x50 (64-bit, masking, 8 vectors), PCIe v2 0x70,
    ///   MSI-X 0xb0 (64 vectors), vendor-specific 0xc0 (0x14 bytes), AF 0xe0;
    /// - extended: AER 0x100, vendor-specific 0x148 (0x18 bytes), ACS 0x180.
    pub fn gpu() -> Self {
        let mut c = ConfigImage { bytes: vec![0; PCI_CFG_SPACE_EXP_SIZE] };
        c.set32(PCI_VENDOR_ID, 0x2330_10de);
        c.set16(PCI_STATUS, PCI_STATUS_CAP_LIST);
        c.set32(PCI_REVISION_ID, 0x0302_00a1);
        c.set32(PCI_BASE_ADDRESS_0, 0xfd00_0000);
        c.set32(PCI_BASE_ADDRESS_0 + 4, 0xe000_0000 | PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH);
        c.set32(PCI_BASE_ADDRESS_0 + 8, 0x38);
        c.set32(PCI_BASE_ADDRESS_0 + 12, 0xe001);
        c.set32(PCI_BASE_ADDRESS_0 + 16, 0xfe00_0000);
        c.set32(PCI_SUBSYSTEM_VENDOR_ID, 0x1234_10de);
        c.bytes[PCI_CAPABILITY_LIST] = 0x40;
        c.bytes[PCI_INTERRUPT_PIN] = 1;
        c.cap(0x40, PCI_CAP_ID_PM, 0x50, 0x0003);
        let msi = PCI_MSI_FLAGS_64BIT | PCI_MSI_FLAGS_MASKBIT | 3 << PCI_MSI_FLAGS_QMASK.trailing_zeros();
        c.cap(0x50, PCI_CAP_ID_MSI, 0x70, msi);
        c.cap(0x70, PCI_CAP_ID_EXP, 0xb0, 0x0002);
        c.set32(0x70 + PCI_EXP_LNKCAP, 0x0000_4105);
        c.cap(0xb0, PCI_CAP_ID_MSIX, 0xc0, 63);
        c.set32(0xb0 + PCI_MSIX_TABLE, 0x000b_0000);
        c.set32(0xb0 + PCI_MSIX_PBA, 0x000b_c000);
        c.cap(0xc0, PCI_CAP_ID_VNDR, 0xe0, 0x14);
        c.cap(0xe0, 0x13, 0x00, 0);
        c.set32(0x100, 0x0001 | 1 << 16 | 0x148 << 20);
        c.set32(0x148, u32::from(PCI_EXT_CAP_ID_VNDR) | 1 << 16 | 0x180 << 20);
        c.set32(0x148 + PCI_VNDR_HEADER, 0x18 << 20 | 1 << 16 | 0x0001);
        c.set32(0x180, u32::from(PCI_EXT_CAP_ID_ACS) | 1 << 16);
        c
    }

    fn cap(&mut self, at: usize, id: u8, next: u8, flags: u16) {
        self.bytes[at] = id;
        self.bytes[at + 1] = next;
        self.set16(at + 2, flags);
    }

    pub fn set16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    pub fn set32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// What the fake device was asked to do, besides reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// A region write: index, offset, bytes.
    Write(u32, u64, Vec<u8>),
    /// Interrupts enabled with this many eventfds.
    Enable(IrqKind, usize),
    /// Interrupts disabled.
    Disable(IrqKind),
    /// The INTx resample eventfd set.
    Resample,
    /// VFIO_DEVICE_RESET.
    Reset,
}

/// The shared state of a fake device: tests keep a handle after the device takes it.
pub(crate) struct FakeState {
    pub config: ConfigImage,
    pub regions: HashMap<u32, RegionInfo>,
    /// Bytes of non-configuration regions ever written; the rest read as `offset as u8`.
    pub memory: HashMap<(u32, u64), u8>,
    pub irqs: HashMap<IrqKind, u32>,
    pub can_reset: bool,
    pub fail_io: bool,
    pub calls: Vec<Call>,
}

/// A fake VFIO device over [`FakeState`].
#[derive(Clone)]
pub(crate) struct FakeDevice {
    pub state: Arc<Mutex<FakeState>>,
    file: Arc<File>,
}

/// The region info the fake uses for BAR `index` of `size` bytes.
pub(crate) fn region(index: u32, size: u64, mmap: bool, sparse: Option<Vec<std::ops::Range<u64>>>) -> RegionInfo {
    RegionInfo {
        size,
        offset: u64::from(index) << 40,
        readable: true,
        writable: true,
        mmap,
        mmap_fd: None,
        sparse_mmap: sparse,
    }
}

impl FakeDevice {
    /// The GPU of [`ConfigImage::gpu`]: BAR0 mmappable, BAR1 mmappable with a sparse
    /// hole at 128-192 MiB, BAR3 I/O, BAR4 not mmappable; 64 MSI-X, 8 MSI, 1 INTx vectors;
    /// reset offered.
    pub fn gpu() -> Self {
        let regions = HashMap::from([
            (0, region(0, 16 << 20, true, None)),
            (1, region(1, 256 << 20, true, Some(vec![0..128 << 20, 192 << 20..256 << 20]))),
            (3, region(3, 0x80, false, None)),
            (4, region(4, 4 << 10, false, None)),
            (VFIO_PCI_CONFIG_REGION_INDEX, region(VFIO_PCI_CONFIG_REGION_INDEX, 4096, false, None)),
        ]);
        let state = FakeState {
            config: ConfigImage::gpu(),
            regions,
            memory: HashMap::new(),
            irqs: HashMap::from([(IrqKind::Intx, 1), (IrqKind::Msi, 8), (IrqKind::Msix, 64)]),
            can_reset: true,
            fail_io: false,
            calls: Vec::new(),
        };
        let file = File::open("/dev/null").expect("/dev/null opens");
        FakeDevice { state: Arc::new(Mutex::new(state)), file: Arc::new(file) }
    }

    /// The device file every mmappable region is mapped from.
    pub fn file(&self) -> Arc<File> {
        self.file.clone()
    }

    /// The calls so far, taken.
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut lock(&self.state).calls)
    }

    /// Configuration writes so far, taken: (register, bytes).
    pub fn take_config_writes(&self) -> Vec<(usize, Vec<u8>)> {
        self.take_calls()
            .into_iter()
            .filter_map(|c| match c {
                Call::Write(VFIO_PCI_CONFIG_REGION_INDEX, at, bytes) => Some((at as usize, bytes)),
                _ => None,
            })
            .collect()
    }

    /// Edits the state.
    pub fn with(&self, f: impl FnOnce(&mut FakeState)) -> &Self {
        f(&mut lock(&self.state));
        self
    }

    fn check(state: &FakeState, index: u32, offset: u64, len: usize) -> io::Result<()> {
        let fits = state.regions.get(&index).is_some_and(|r| offset + len as u64 <= r.size);
        if state.fail_io || !fits {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }
}

impl VfioDeviceOps for FakeDevice {
    fn region(&self, index: u32) -> Option<RegionInfo> {
        let mut region = lock(&self.state).regions.get(&index).cloned()?;
        // Like a VFIO device, every mmappable region is mapped from the device file.
        if region.mmap && region.mmap_fd.is_none() {
            region.mmap_fd = Some(self.file.clone());
        }
        Some(region)
    }

    fn read(&self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let state = lock(&self.state);
        Self::check(&state, index, offset, data.len())?;
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset + i as u64;
            *b = if index == VFIO_PCI_CONFIG_REGION_INDEX {
                state.config.bytes[at as usize]
            } else {
                state.memory.get(&(index, at)).copied().unwrap_or(at as u8)
            };
        }
        Ok(())
    }

    fn write(&self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut state = lock(&self.state);
        Self::check(&state, index, offset, data.len())?;
        for (i, &b) in data.iter().enumerate() {
            let at = offset + i as u64;
            if index == VFIO_PCI_CONFIG_REGION_INDEX {
                state.config.bytes[at as usize] = b;
            } else {
                state.memory.insert((index, at), b);
            }
        }
        state.calls.push(Call::Write(index, offset, data.to_vec()));
        Ok(())
    }

    fn irq_count(&self, kind: IrqKind) -> u32 {
        lock(&self.state).irqs.get(&kind).copied().unwrap_or(0)
    }

    fn enable_irq(&self, kind: IrqKind, fds: &[&EventFd]) -> io::Result<()> {
        let mut state = lock(&self.state);
        if state.fail_io {
            return Err(io::Error::other(IoctlError::VfioDeviceEnableIrq));
        }
        state.calls.push(Call::Enable(kind, fds.len()));
        Ok(())
    }

    fn disable_irq(&self, kind: IrqKind) -> io::Result<()> {
        lock(&self.state).calls.push(Call::Disable(kind));
        Ok(())
    }

    fn set_intx_resample(&self, _fd: &EventFd) -> io::Result<()> {
        lock(&self.state).calls.push(Call::Resample);
        Ok(())
    }

    fn can_reset(&self) -> bool {
        lock(&self.state).can_reset
    }

    fn reset(&self) -> io::Result<()> {
        let mut state = lock(&self.state);
        if state.fail_io {
            return Err(io::Error::from_raw_os_error(libc::EBUSY));
        }
        state.calls.push(Call::Reset);
        Ok(())
    }
}

/// A DMA mapping the fake container was asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DmaCall {
    /// iova, size, host address.
    Map(u64, usize, u64),
    /// iova, size.
    Unmap(u64, usize),
}

/// A container that records its mappings and fails maps at `fail_at`.
#[derive(Default)]
pub(crate) struct FakeContainer {
    pub calls: Mutex<Vec<DmaCall>>,
    pub fail_at: Option<u64>,
}

impl VfioContainerOps for FakeContainer {
    unsafe fn dma_map(&self, iova: u64, size: usize, host_addr: *mut u8) -> Result<(), IoctlError> {
        if self.fail_at == Some(iova) {
            return Err(IoctlError::IommuDmaMap(vmm_sys_util::errno::Error::new(libc::ENOSPC)));
        }
        lock(&self.calls).push(DmaCall::Map(iova, size, host_addr as u64));
        Ok(())
    }

    fn dma_unmap(&self, iova: u64, size: usize) -> Result<(), IoctlError> {
        lock(&self.calls).push(DmaCall::Unmap(iova, size));
        Ok(())
    }
}
