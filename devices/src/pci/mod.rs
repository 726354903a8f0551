//! PCI functions backed by devices: the narrow device trait, who owns each configuration
//! byte, what a configuration write means for the machine, and the MSI and MSI-X
//! emulation every kind of device shares. All pure data structures: the VMM wires them to
//! KVM, VFIO and its buses.

mod config_space;
mod device;
mod effects;
mod flr;
mod msi;
mod msix;
mod ownership;
pub mod regs;

pub use config_space::{ConfigSpace, ACS_CAPABILITIES, CONFIG_SPACE_SIZE};
pub use device::{merge_ranges, BarInfo, BarMapping, DeviceError, IoEvent, MsiInfo, MsixLayout, PciDevice};
pub use effects::{BarChange, ConfigWriteEffects, MsixControl};
pub use flr::{flr_control, initiates_flr};
pub use msi::{MsiCapability, MsiEvent, MSI_MAX_VECTORS};
pub use msix::{Fire, MsiMessage, MsixEvent, MsixTable, MSIX_MAX_VECTORS};
pub use ownership::{ConfigOwnership, Owner};
