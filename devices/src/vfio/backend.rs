//! The little gdrvm needs of VFIO, as two traits: a device's regions, interrupts and reset
//! ([`VfioDeviceOps`]) and a container's DMA mappings ([`VfioContainerOps`]). Implemented
//! here over `vfio-ioctls`; tests implement them with a fake, since these hosts have no
//! `/dev/vfio`.
//!
//! Region accesses go through the device file with `pread`/`pwrite` rather than
//! `VfioDevice::region_read`/`region_write`, which log and swallow errors: the caller
//! decides what a failed access means (all-ones for the guest, an error at open). Reset
//! and the reset flag use the ioctls directly, since `VfioDevice::reset` neither reports
//! failure nor says whether a reset is offered.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use vfio_bindings::bindings::vfio::{
    vfio_device_info, VFIO_BASE, VFIO_DEVICE_FLAGS_RESET, VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_INTX_IRQ_INDEX,
    VFIO_PCI_MSIX_IRQ_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ,
    VFIO_REGION_INFO_FLAG_WRITE, VFIO_TYPE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioError as IoctlError, VfioRegionInfoCap};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::ioctl::{ioctl, ioctl_with_mut_ref};
use vmm_sys_util::ioctl_io_nr;

ioctl_io_nr!(VFIO_DEVICE_GET_INFO, VFIO_TYPE.into(), VFIO_BASE + 7);
ioctl_io_nr!(VFIO_DEVICE_RESET, VFIO_TYPE.into(), VFIO_BASE + 11);

/// A kind of device interrupt, as VFIO indexes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IrqKind {
    /// The legacy pin interrupt (level-triggered, unmasked through a resample eventfd).
    Intx,
    /// Message-signalled interrupts.
    Msi,
    /// MSI-X.
    Msix,
}

impl IrqKind {
    /// VFIO's IRQ index (`VFIO_PCI_*_IRQ_INDEX`).
    pub fn index(self) -> u32 {
        match self {
            IrqKind::Intx => VFIO_PCI_INTX_IRQ_INDEX,
            IrqKind::Msi => VFIO_PCI_MSI_IRQ_INDEX,
            IrqKind::Msix => VFIO_PCI_MSIX_IRQ_INDEX,
        }
    }
}

impl std::fmt::Display for IrqKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            IrqKind::Intx => "INTx",
            IrqKind::Msi => "MSI",
            IrqKind::Msix => "MSI-X",
        })
    }
}

/// One region of a VFIO device (a BAR, the ROM, the configuration space), as
/// `VFIO_DEVICE_GET_REGION_INFO` describes it.
#[derive(Debug, Clone, Default)]
pub struct RegionInfo {
    /// Size in bytes.
    pub size: u64,
    /// Where the region starts in `mmap_fd` (for a VFIO device, the device file, also for
    /// `pread`).
    pub offset: u64,
    /// Reads are allowed.
    pub readable: bool,
    /// Writes are allowed.
    pub writable: bool,
    /// The region may be mmapped.
    pub mmap: bool,
    /// The file the region is mmapped from, at `offset`, when `mmap` (the VFIO device
    /// file; a vfio-user server's region fd).
    pub mmap_fd: Option<Arc<File>>,
    /// With a sparse-mmap capability, the only parts that may be mmapped (offsets from the
    /// region's start); `None`: all of it, when `mmap`.
    pub sparse_mmap: Option<Vec<Range<u64>>>,
}

/// What gdrvm needs of one VFIO PCI device. Methods take `&self`: the state they change
/// is the kernel's.
pub trait VfioDeviceOps: Send {
    /// Region `index` (`VFIO_PCI_*_REGION_INDEX`), if the device has it.
    fn region(&self, index: u32) -> Option<RegionInfo>;
    /// Reads `data.len()` bytes of region `index` at `offset` from its start.
    fn read(&self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()>;
    /// Writes region `index` at `offset` from its start.
    fn write(&self, index: u32, offset: u64, data: &[u8]) -> io::Result<()>;
    /// The vectors of `kind` the device offers (0: none).
    fn irq_count(&self, kind: IrqKind) -> u32;
    /// Signals vector `i` of `kind` on `fds[i]` from now on.
    fn enable_irq(&self, kind: IrqKind, fds: &[&EventFd]) -> io::Result<()>;
    /// Stops every vector of `kind`.
    fn disable_irq(&self, kind: IrqKind) -> io::Result<()>;
    /// Unmasks INTx whenever `fd` is signalled (the guest's EOI, through KVM's resample).
    fn set_intx_resample(&self, fd: &EventFd) -> io::Result<()>;
    /// Whether `VFIO_DEVICE_RESET` is offered (FLR, a PM reset, a bus reset of a lone device).
    fn can_reset(&self) -> bool;
    /// `VFIO_DEVICE_RESET`.
    fn reset(&self) -> io::Result<()>;
}

/// What gdrvm needs of a VFIO container: its IOMMU mappings.
pub trait VfioContainerOps: Send + Sync {
    /// Maps `size` bytes at `host_addr` in this process to `iova`, readable and writable
    /// by the container's devices (`VFIO_IOMMU_MAP_DMA`).
    ///
    /// # Safety
    ///
    /// Until the range is unmapped from the container, `[host_addr, host_addr + size)`
    /// must stay mapped in this process, and be accessed only as memory the devices may
    /// change at any time: shared with the guest, read and written through volatile
    /// accesses or system calls, never behind a Rust reference (the contract of
    /// `vfio_ioctls::VfioContainer::vfio_dma_map`).
    unsafe fn dma_map(&self, iova: u64, size: usize, host_addr: *mut u8) -> Result<(), IoctlError>;
    /// Removes the mapping of `size` bytes at `iova` (`VFIO_IOMMU_UNMAP_DMA`).
    fn dma_unmap(&self, iova: u64, size: usize) -> Result<(), IoctlError>;
}

impl VfioContainerOps for VfioContainer {
    unsafe fn dma_map(&self, iova: u64, size: usize, host_addr: *mut u8) -> Result<(), IoctlError> {
        // SAFETY: the caller upholds this method's contract, which is the callee's.
        unsafe { self.vfio_dma_map(iova, size, host_addr) }
    }

    fn dma_unmap(&self, iova: u64, size: usize) -> Result<(), IoctlError> {
        self.vfio_dma_unmap(iova, size)
    }
}

/// A device opened through `vfio-ioctls`.
pub(super) struct IoctlDevice {
    // Declared before `device` so it closes first: `VfioDevice`'s drop takes the group out
    // of the container, which the kernel refuses while a device file is open.
    file: Arc<File>,
    regions: Vec<Option<RegionInfo>>,
    can_reset: bool,
    device: VfioDevice,
}

impl IoctlDevice {
    /// Wraps `device`, reading its region table and whether it can be reset.
    pub(super) fn new(device: VfioDevice) -> io::Result<Self> {
        // SAFETY: the descriptor is `device`'s, open for as long as `device` lives, which
        // outlasts this borrow: it is duplicated at once into a descriptor of our own.
        let file = File::from(unsafe { BorrowedFd::borrow_raw(device.as_raw_fd()) }.try_clone_to_owned()?);
        let mut info = vfio_device_info { argsz: std::mem::size_of::<vfio_device_info>() as u32, ..Default::default() };
        // SAFETY: `file` is a VFIO device; `info` is a `vfio_device_info` whose `argsz` is
        // its own size, so the kernel writes no more than it holds.
        let ret = unsafe { ioctl_with_mut_ref(&file, VFIO_DEVICE_GET_INFO(), &mut info) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        let file = Arc::new(file);
        let regions = (0..=VFIO_PCI_CONFIG_REGION_INDEX).map(|index| region_info(&device, &file, index)).collect();
        Ok(IoctlDevice { file, regions, can_reset: info.flags & VFIO_DEVICE_FLAGS_RESET != 0, device })
    }

    /// Region `index` with `len` bytes at `offset` inside it: the file offset.
    fn at(&self, index: u32, offset: u64, len: usize) -> io::Result<u64> {
        let region = self.regions.get(index as usize).and_then(Option::as_ref);
        region
            .filter(|r| offset.checked_add(len as u64).is_some_and(|end| end <= r.size))
            .map(|r| r.offset + offset)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "access outside the region"))
    }
}

/// Region `index` of `device` (whose file is `file`), from what `vfio-ioctls` read at open.
fn region_info(device: &VfioDevice, file: &Arc<File>, index: u32) -> Option<RegionInfo> {
    let size = device.get_region_size(index);
    if size == 0 {
        return None;
    }
    let flags = device.get_region_flags(index);
    let sparse_mmap = device.get_region_caps(index).into_iter().find_map(|cap| match cap {
        VfioRegionInfoCap::SparseMmap(s) => Some(s.areas.iter().map(|a| a.offset..a.offset + a.size).collect()),
        _ => None,
    });
    let mmap = flags & VFIO_REGION_INFO_FLAG_MMAP != 0;
    Some(RegionInfo {
        size,
        offset: device.get_region_offset(index),
        readable: flags & VFIO_REGION_INFO_FLAG_READ != 0,
        writable: flags & VFIO_REGION_INFO_FLAG_WRITE != 0,
        mmap,
        mmap_fd: mmap.then(|| file.clone()),
        sparse_mmap,
    })
}

impl VfioDeviceOps for IoctlDevice {
    fn region(&self, index: u32) -> Option<RegionInfo> {
        self.regions.get(index as usize).cloned().flatten()
    }

    fn read(&self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(data, self.at(index, offset, data.len())?)
    }

    fn write(&self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, self.at(index, offset, data.len())?)
    }

    fn irq_count(&self, kind: IrqKind) -> u32 {
        self.device.get_irq_info(kind.index()).map_or(0, |irq| irq.count)
    }

    fn enable_irq(&self, kind: IrqKind, fds: &[&EventFd]) -> io::Result<()> {
        self.device.enable_irq(kind.index(), fds.to_vec()).map_err(io::Error::other)
    }

    fn disable_irq(&self, kind: IrqKind) -> io::Result<()> {
        self.device.disable_irq(kind.index()).map_err(io::Error::other)
    }

    fn set_intx_resample(&self, fd: &EventFd) -> io::Result<()> {
        self.device.set_irq_resample_fd(IrqKind::Intx.index(), vec![fd]).map_err(io::Error::other)
    }

    fn can_reset(&self) -> bool {
        self.can_reset
    }

    fn reset(&self) -> io::Result<()> {
        // SAFETY: `file` is a VFIO device and VFIO_DEVICE_RESET takes no argument.
        let ret = unsafe { ioctl(&*self.file, VFIO_DEVICE_RESET()) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
