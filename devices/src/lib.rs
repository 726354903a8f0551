//! Device models for the gdrvm VMM.
//!
//! Devices sit behind the [`BusDevice`] trait and are placed on a port-I/O or MMIO [`Bus`]
//! by the VMM. A device never reaches into the VMM: what a guest access means for the
//! machine as a whole (power off, reset, an exit status) is reported through
//! [`GuestExitSignal`].
//!
//! PCI functions backed by devices implement [`PciDevice`]; a configuration write returns
//! its [`ConfigWriteEffects`], MSI and MSI-X are emulated once ([`MsiCapability`],
//! [`MsixTable`]), and the [`DmaSpace`] mirrors guest RAM and mapped BARs into every
//! [`DmaTarget`]. Register names shared with the VMM are in [`pci_regs`].
//!
//! A host function passed through with VFIO is a [`VfioPciDevice`]: its configuration
//! writes pass a firewall, its BARs are mapped from the device file, and its container is a
//! [`VfioDmaTarget`]. A device emulated in another process is reached over
//! [`vfio_user`]: the same [`VfioPciDevice`] over a [`UserDeviceOps`], its server a
//! [`UserDmaTarget`]; the server side ([`vfio_user::serve`]) is what emulators build on.
//!
//! The emulated GPU and RoCE NIC that the vfio-user server binaries (`gdrvm-gpu-emu`,
//! `gdrvm-nic-emu`) serve are in [`emu`].
//!
//! The NIC stand-in in the VMM itself is [`VirtioNet`] (modern virtio PCI, [`virtio`]); its
//! doorbells are [`IoEvent`]s, and it is joined to other nodes through a [`net::FramePort`].

mod bus;
mod debug_exit;
mod dma;
pub mod emu;
mod exit;
mod i8042;
pub mod net;
mod pci;
mod serial;
mod sleep;
mod sync;
mod vfio;
pub mod vfio_user;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError};
pub use debug_exit::DebugExit;
pub use dma::{DeviceId, DmaError, DmaOp, DmaRegion, DmaSpace, DmaTarget, TargetError};
pub use exit::{GuestExit, GuestExitSignal};
pub use i8042::I8042;
pub use pci::regs as pci_regs;
pub use pci::{
    flr_control, initiates_flr, merge_ranges, BarChange, BarInfo, BarMapping, ConfigOwnership, ConfigSpace,
    ConfigWriteEffects, DeviceError, Fire, IoEvent, MsiCapability, MsiEvent, MsiInfo, MsiMessage, MsixControl,
    MsixEvent, MsixLayout, MsixTable, Owner, PciDevice, ACS_CAPABILITIES, CONFIG_SPACE_SIZE, MSIX_MAX_VECTORS,
    MSI_MAX_VECTORS,
};
pub use serial::{Serial, SerialInput, COM1_IRQ, COM1_LEN, COM1_PORT};
pub use sleep::{
    AcpiSleepControl, ResetRegister, ACPI_RESET_PORT, ACPI_RESET_VALUE, ACPI_SLEEP_LEN, ACPI_SLEEP_PORT, S5_SLEEP_TYPE,
};
pub use sync::lock;
pub use vfio::{
    check_host, open_container, Capability, CapabilityId, ConfigWrites, HostCheck, IrqKind, RegionInfo, VfioContainer,
    VfioContainerOps, VfioDeviceFd, VfioDeviceOps, VfioDmaTarget, VfioError, VfioOptions, VfioPciDevice,
};
pub use vfio_user::{open_user_device, UserConnection, UserDeviceOps, UserDmaTarget, UserError};
pub use virtio::{NetStats, VirtioNet};
