//! Whether a host function can be passed through, from sysfs alone: it exists, sits behind
//! an IOMMU, is bound to vfio-pci, and shares its IOMMU group only with functions passed
//! through too. A pure function of the sysfs tree, so recorded trees test it.

use gdrvm_model::host_pci::{HostBdf, HostFunction, HostPci, HostPciError};

use super::error::VfioError;

/// The driver passthrough needs.
const VFIO_PCI: &str = "vfio-pci";
/// Class code (base class and subclass) of a PCI-to-PCI bridge.
const PCI_CLASS_BRIDGE_PCI: u32 = 0x0604;

/// What sysfs says of a function that can be passed through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostCheck {
    /// The function.
    pub function: HostFunction,
    /// Its IOMMU group.
    pub group: u32,
}

/// Checks that host function `bdf` can be passed through to a guest that also gets
/// `passed_through` (every host function of the run; `bdf` may be among them). Other
/// members of its IOMMU group must be passed through too, except PCI bridges, which VFIO
/// lets stay with the host.
pub fn check_host(host: &HostPci, bdf: HostBdf, passed_through: &[HostBdf]) -> Result<HostCheck, VfioError> {
    let function = host.function(bdf).map_err(|e| match e {
        HostPciError::Missing(bdf, path) => VfioError::NoDevice(bdf, path),
        other => VfioError::Sysfs(other),
    })?;
    let group = function.iommu_group.ok_or(VfioError::NoIommu(bdf))?;
    if function.driver.as_deref() != Some(VFIO_PCI) {
        return Err(VfioError::NotBound {
            bdf,
            driver: function.driver.clone(),
            commands: bind_commands(host, &function),
        });
    }
    let others: Vec<HostBdf> = host
        .iommu_group_members(group)
        .into_iter()
        .filter(|m| *m != bdf && !passed_through.contains(m))
        .filter(|m| !host.function(*m).is_ok_and(|f| f.class >> 8 == PCI_CLASS_BRIDGE_PCI))
        .collect();
    if !others.is_empty() {
        return Err(VfioError::GroupShared { bdf, group, others });
    }
    Ok(HostCheck { function, group })
}

/// The shell commands that bind `f` to vfio-pci (the xtask does the same and restores the
/// driver afterwards).
fn bind_commands(host: &HostPci, f: &HostFunction) -> String {
    let bdf = f.bdf;
    let dir = host.dir(bdf);
    let mut steps = Vec::new();
    if !host.root().join("bus/pci/drivers").join(VFIO_PCI).is_dir() {
        steps.push("modprobe vfio-pci".to_string());
    }
    if f.driver.is_some() {
        steps.push(format!("echo {bdf} > {}", dir.join("driver/unbind").display()));
    }
    steps.push(format!("echo {VFIO_PCI} > {}", dir.join("driver_override").display()));
    steps.push(format!("echo {bdf} > {}", host.root().join("bus/pci/drivers_probe").display()));
    steps.join("; ")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    /// Records function `bdf` of class `class` under sysfs `root`, bound to `driver`, in
    /// IOMMU group `group`.
    fn record(root: &Path, bdf: &str, class: u32, driver: Option<&str>, group: Option<u32>) -> HostBdf {
        let bdf: HostBdf = bdf.parse().unwrap();
        let host = HostPci::at(root);
        let dir = host.dir(bdf);
        std::fs::create_dir_all(&dir).unwrap();
        let resource = "0x00000000fe840000 0x00000000fe85ffff 0x0000000000040200\n";
        for (name, text) in [
            ("vendor", "0x8086\n".to_string()),
            ("device", "0x10d3\n".to_string()),
            ("class", format!("{class:#08x}\n")),
            ("resource", resource.to_string()),
        ] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        if let Some(driver) = driver {
            let drv = root.join("bus/pci/drivers").join(driver);
            std::fs::create_dir_all(&drv).unwrap();
            std::os::unix::fs::symlink(&drv, dir.join("driver")).unwrap();
        }
        if let Some(group) = group {
            let g = root.join("kernel/iommu_groups").join(group.to_string());
            std::fs::create_dir_all(g.join("devices")).unwrap();
            std::os::unix::fs::symlink(&dir, g.join("devices").join(bdf.to_string())).unwrap();
            std::os::unix::fs::symlink(&g, dir.join("iommu_group")).unwrap();
        }
        bdf
    }

    const NIC: u32 = 0x020000;

    #[test]
    fn test_a_bound_device_alone_in_its_group_passes() {
        let dir = tempfile::tempdir().unwrap();
        let bdf = record(dir.path(), "0000:01:00.0", NIC, Some("vfio-pci"), Some(7));
        let check = check_host(&HostPci::at(dir.path()), bdf, &[]).unwrap();
        assert_eq!((check.function.bdf, check.function.vendor, check.group), (bdf, 0x8086, 7));
    }

    #[test]
    fn test_missing_device_and_missing_iommu() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostPci::at(dir.path());
        let err = check_host(&host, "3b:00.0".parse().unwrap(), &[]).unwrap_err();
        assert!(matches!(err, VfioError::NoDevice(..)), "{err}");
        assert!(err.to_string().starts_with("host PCI device 0000:3b:00.0 does not exist (no "), "{err}");
        let bdf = record(dir.path(), "0000:02:00.0", NIC, Some("vfio-pci"), None);
        assert_eq!(
            check_host(&host, bdf, &[]).unwrap_err().to_string(),
            "host PCI device 0000:02:00.0 has no IOMMU group: the host has no IOMMU or it is off \
             (boot the host with intel_iommu=on or amd_iommu=on)"
        );
    }

    #[test]
    fn test_not_bound_prints_the_bind_commands() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().display();
        let host = HostPci::at(dir.path());
        let bdf = record(dir.path(), "0000:01:00.0", NIC, Some("e1000e"), Some(7));
        // vfio-pci is not loaded yet: no driver directory.
        assert_eq!(
            check_host(&host, bdf, &[]).unwrap_err().to_string(),
            format!(
                "host PCI device 0000:01:00.0 is bound to e1000e, not vfio-pci: run `cargo xtask vfio-bind \
                 0000:01:00.0` or, as root, `modprobe vfio-pci; \
                 echo 0000:01:00.0 > {root}/bus/pci/devices/0000:01:00.0/driver/unbind; \
                 echo vfio-pci > {root}/bus/pci/devices/0000:01:00.0/driver_override; \
                 echo 0000:01:00.0 > {root}/bus/pci/drivers_probe`"
            )
        );
        // Loaded, and a device bound to no driver: nothing to unbind.
        record(dir.path(), "0000:05:00.0", NIC, Some("vfio-pci"), Some(9));
        let unbound = record(dir.path(), "0000:02:00.0", NIC, None, Some(8));
        assert_eq!(
            check_host(&host, unbound, &[]).unwrap_err().to_string(),
            format!(
                "host PCI device 0000:02:00.0 is bound to no driver, not vfio-pci: run `cargo xtask vfio-bind \
                 0000:02:00.0` or, as root, \
                 `echo vfio-pci > {root}/bus/pci/devices/0000:02:00.0/driver_override; \
                 echo 0000:02:00.0 > {root}/bus/pci/drivers_probe`"
            )
        );
    }

    #[test]
    fn test_group_shared_with_devices_not_passed_through_names_them() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostPci::at(dir.path());
        let gpu = record(dir.path(), "0000:41:00.0", 0x030200, Some("vfio-pci"), Some(12));
        let audio = record(dir.path(), "0000:41:00.1", 0x040300, Some("snd_hda_intel"), Some(12));
        let usb = record(dir.path(), "0000:41:00.2", 0x0c0330, Some("vfio-pci"), Some(12));
        let bridge = record(dir.path(), "0000:40:01.0", 0x060400, Some("pcieport"), Some(12));
        let err = check_host(&host, gpu, &[gpu]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "host PCI device 0000:41:00.0 shares IOMMU group 12 with 0000:41:00.1, 0000:41:00.2 (not passed \
             through): pass them through too, or move 0000:41:00.0 to a slot of its own"
        );
        let VfioError::GroupShared { others, .. } = err else { panic!("{err}") };
        assert_eq!(others, [audio, usb], "the bridge may stay with the host");
        // Every function passed through: fine, in any order.
        assert_eq!(check_host(&host, gpu, &[usb, audio, gpu]).unwrap().group, 12);
        let _ = bridge;
    }
}
