//! Why a host device could not be passed through, or VFIO refused a request: one sentence
//! each, naming the device and what to do about it; a kernel or ioctl error is chained as
//! the source, never repeated in the message.

use std::fmt;
use std::io;
use std::path::PathBuf;

use gdrvm_model::host_pci::{HostBdf, HostPciError};
use vfio_ioctls::VfioError as IoctlError;

use super::backend::IrqKind;

/// Errors opening, validating and driving a VFIO device.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    /// The host has no such PCI function.
    #[error("host PCI device {0} does not exist (no {path})", path = .1.display())]
    NoDevice(HostBdf, PathBuf),
    /// Sysfs has the function but a file of it is unreadable or malformed.
    #[error(transparent)]
    Sysfs(HostPciError),
    /// The function has no IOMMU group: no IOMMU, or it is off.
    #[error(
        "host PCI device {0} has no IOMMU group: the host has no IOMMU or it is off \
         (boot the host with intel_iommu=on or amd_iommu=on)"
    )]
    NoIommu(HostBdf),
    /// The function is bound to another driver, or to none.
    #[error(
        "host PCI device {bdf} is bound to {}, not vfio-pci: run `cargo xtask vfio-bind {bdf}` or, as \
         root, `{commands}`",
        driver_name(.driver)
    )]
    NotBound {
        /// The function.
        bdf: HostBdf,
        /// The driver it is bound to, if any.
        driver: Option<String>,
        /// The shell commands that bind it to vfio-pci.
        commands: String,
    },
    /// Other functions share the IOMMU group and are not passed through.
    #[error(
        "host PCI device {bdf} shares IOMMU group {group} with {} (not passed through): pass \
         them through too, or move {bdf} to a slot of its own",
        Bdfs(.others)
    )]
    GroupShared {
        /// The function.
        bdf: HostBdf,
        /// Its IOMMU group.
        group: u32,
        /// The other members that are not passed through.
        others: Vec<HostBdf>,
    },
    /// `/dev/vfio/vfio` does not exist.
    #[error("there is no {}: load vfio-pci (modprobe vfio-pci) on a host with an IOMMU", .0.display())]
    NoVfio(PathBuf),
    /// The VFIO container could not be opened or set up.
    #[error("the VFIO container could not be set up")]
    Container(#[source] IoctlError),
    /// `/dev/vfio/<group>` could not be opened (missing, no permission, in use).
    #[error("IOMMU group {group} of host PCI device {bdf} could not be opened (/dev/vfio/{group})")]
    Group {
        /// The function.
        bdf: HostBdf,
        /// Its IOMMU group.
        group: u32,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The kernel says the group is not viable.
    #[error(
        "IOMMU group {group} of host PCI device {bdf} is not viable: every device in it must be \
         bound to vfio-pci or to no driver"
    )]
    GroupNotViable {
        /// The function.
        bdf: HostBdf,
        /// Its IOMMU group.
        group: u32,
    },
    /// VFIO could not open the device in its group.
    #[error("VFIO could not open host PCI device {bdf}")]
    Open {
        /// The function.
        bdf: HostBdf,
        /// The ioctl's error.
        #[source]
        source: IoctlError,
    },
    /// The device's information could not be read.
    #[error("VFIO could not describe device {name}")]
    Info {
        /// The device.
        name: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The device has no configuration region: it is not a PCI device.
    #[error("VFIO device {name} has no PCI configuration region")]
    NoConfigRegion {
        /// The device.
        name: String,
    },
    /// The configuration region could not be read.
    #[error("the configuration space of VFIO device {name} could not be read")]
    ConfigRead {
        /// The device.
        name: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// More vectors (or none) were asked than the device offers.
    #[error("VFIO device {name} offers {offered} {kind} vector(s), {asked} were asked")]
    Vectors {
        /// The device.
        name: String,
        /// The interrupt kind.
        kind: IrqKind,
        /// Vectors asked.
        asked: usize,
        /// Vectors offered.
        offered: u32,
    },
    /// VFIO (or a vfio-user server) refused to enable or disable interrupts.
    #[error("VFIO could not {action} {kind} on device {name}")]
    Irq {
        /// The device.
        name: String,
        /// The interrupt kind.
        kind: IrqKind,
        /// `enable` or `disable`.
        action: &'static str,
        /// The backend's error (an ioctl's, a vfio-user server's).
        #[source]
        source: io::Error,
    },
}

fn driver_name(driver: &Option<String>) -> &str {
    driver.as_deref().unwrap_or("no driver")
}

/// A list of functions, comma separated.
struct Bdfs<'a>(&'a [HostBdf]);

impl fmt::Display for Bdfs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, bdf) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{bdf}")?;
        }
        Ok(())
    }
}
