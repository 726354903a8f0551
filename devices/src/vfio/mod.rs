//! VFIO passthrough: a host PCI function behind the [`crate::PciDevice`] trait, with a
//! configuration-space firewall, BARs mapped from the device file around the MSI-X pages,
//! interrupts wired from VFIO eventfds, and the container as a [`crate::DmaTarget`].
//!
//! Built on `vfio-ioctls` behind two thin traits ([`VfioDeviceOps`], [`VfioContainerOps`])
//! so everything but the ioctls themselves is tested against a fake: these hosts have no
//! `/dev/vfio`. Sysfs checks (the device exists, sits behind an IOMMU, is bound to
//! vfio-pci, shares its IOMMU group with nothing left behind) are a pure function of the
//! sysfs tree ([`check_host`]).

mod backend;
mod caps;
mod device;
mod dma;
mod error;
#[cfg(test)]
mod fake;
mod firewall;
mod host;
mod open;

pub use backend::{IrqKind, RegionInfo, VfioContainerOps, VfioDeviceOps};
pub use caps::{Capability, CapabilityId};
pub use device::VfioPciDevice;
pub use dma::VfioDmaTarget;
pub use error::VfioError;
pub use firewall::ConfigWrites;
pub use host::{check_host, HostCheck};
pub use open::{open_container, VfioOptions};
pub use vfio_ioctls::{VfioContainer, VfioDeviceFd};
