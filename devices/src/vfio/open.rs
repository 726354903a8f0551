//! Opening VFIO on a live host: the container (`/dev/vfio/vfio`, one IOMMU domain) and a
//! device in it, after the sysfs checks, with each way it can fail named.

use std::path::Path;
use std::sync::Arc;

use gdrvm_model::host_pci::{HostBdf, HostPci};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioDeviceFd, VfioError as IoctlError, VfioOps};

use super::backend::IoctlDevice;
use super::device::VfioPciDevice;
use super::error::VfioError;
use super::firewall::ConfigWrites;
use super::host::check_host;

/// The VFIO character device containers are opened from.
const VFIO_DEV: &str = "/dev/vfio/vfio";

/// How a host device is passed through.
#[derive(Debug, Clone, Default)]
pub struct VfioOptions {
    /// What the configuration-space firewall does with registers it does not know.
    pub config_writes: ConfigWrites,
    /// Every host function the run passes through (members of one IOMMU group must all
    /// be).
    pub passed_through: Vec<HostBdf>,
}

/// Opens a VFIO container (type 1 v2 IOMMU). `kvm_vfio` is the VM's KVM VFIO device
/// (`KVM_DEV_TYPE_VFIO`, wrapped with `VfioDeviceFd::new_from_kvm`), which KVM needs to know
/// the groups in it.
pub fn open_container(kvm_vfio: Option<VfioDeviceFd>) -> Result<Arc<VfioContainer>, VfioError> {
    if !Path::new(VFIO_DEV).exists() {
        return Err(VfioError::NoVfio(VFIO_DEV.into()));
    }
    VfioContainer::new(kvm_vfio.map(Arc::new)).map(Arc::new).map_err(VfioError::Container)
}

impl VfioPciDevice {
    /// Opens host function `bdf` (under sysfs `host`) in `container`, after checking that
    /// it can be passed through ([`check_host`](super::host::check_host)).
    pub fn open(
        host: &HostPci,
        bdf: HostBdf,
        container: &Arc<VfioContainer>,
        options: &VfioOptions,
    ) -> Result<Self, VfioError> {
        let group = check_host(host, bdf, &options.passed_through)?.group;
        let ops: Arc<dyn VfioOps> = container.clone();
        let device = VfioDevice::new(&host.dir(bdf), ops, false).map_err(|e| match e {
            IoctlError::OpenGroup(source, _) => VfioError::Group { bdf, group, source },
            IoctlError::GroupViable => VfioError::GroupNotViable { bdf, group },
            source => VfioError::Open { bdf, source },
        })?;
        let backend = IoctlDevice::new(device).map_err(|source| VfioError::Info { name: bdf.to_string(), source })?;
        VfioPciDevice::new(bdf.to_string(), Box::new(backend), options.config_writes)
    }
}
