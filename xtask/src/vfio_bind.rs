//! `cargo xtask vfio-bind BDF...`: hands host PCI devices to vfio-pci for passthrough and,
//! with `--restore`, gives them back to the drivers they had. What each device had is
//! remembered in `target/gdrvm/vfio-bind.json`, so a restore after a reboot of the tool
//! (not of the host) still knows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use gdrvm_model::host_pci::{HostBdf, HostPci};

/// Where the drivers devices had before binding are remembered.
fn ledger_path() -> PathBuf {
    gdrvm_harness::gdrvm_dir().join("vfio-bind.json")
}

fn write(path: &Path, value: &str) -> Result<()> {
    std::fs::write(path, value).with_context(|| format!("writing '{value}' to {}", path.display()))
}

/// Binds `bdf` to vfio-pci under `sysfs`; returns the driver it had.
pub fn bind(sysfs: &HostPci, bdf: HostBdf) -> Result<Option<String>> {
    let f = sysfs.function(bdf)?;
    if f.driver.as_deref() == Some("vfio-pci") {
        return Ok(None);
    }
    if f.iommu_group.is_none() {
        bail!("{bdf} has no IOMMU group: the host has no IOMMU, or it is off (intel_iommu=on / amd_iommu=on on the kernel command line)");
    }
    let dir = sysfs.dir(bdf);
    write(&dir.join("driver_override"), "vfio-pci")?;
    if f.driver.is_some() {
        write(&dir.join("driver/unbind"), &bdf.to_string())?;
    }
    write(&sysfs.root().join("bus/pci/drivers_probe"), &bdf.to_string())?;
    Ok(f.driver)
}

/// Gives `bdf` back to `driver` (or to whatever the kernel picks, for `None`).
pub fn restore(sysfs: &HostPci, bdf: HostBdf, driver: Option<&str>) -> Result<()> {
    let dir = sysfs.dir(bdf);
    write(&dir.join("driver_override"), "\n")?;
    if dir.join("driver").exists() {
        write(&dir.join("driver/unbind"), &bdf.to_string())?;
    }
    match driver {
        Some(d) => write(&sysfs.root().join("bus/pci/drivers").join(d).join("bind"), &bdf.to_string()),
        None => write(&sysfs.root().join("bus/pci/drivers_probe"), &bdf.to_string()),
    }
}

/// The other members of `bdf`'s IOMMU group, which must go to vfio-pci as well.
fn group_mates(sysfs: &HostPci, bdf: HostBdf, binding: &[HostBdf]) -> Result<Vec<HostBdf>> {
    let group = sysfs.function(bdf)?.iommu_group;
    Ok(group
        .map(|g| sysfs.iommu_group_members(g))
        .unwrap_or_default()
        .into_iter()
        .filter(|m| !binding.contains(m))
        .collect())
}

/// The command: bind every `bdfs` (or restore them).
pub fn run(bdfs: &[String], restore_them: bool) -> Result<i32> {
    let sysfs = HostPci::default();
    let bdfs: Vec<HostBdf> = bdfs.iter().map(|b| b.parse().map_err(anyhow::Error::msg)).collect::<Result<_>>()?;
    let path = ledger_path();
    let mut ledger: BTreeMap<String, Option<String>> =
        std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    if restore_them {
        for bdf in &bdfs {
            let driver = ledger.remove(&bdf.to_string()).flatten();
            restore(&sysfs, *bdf, driver.as_deref())?;
            println!("xtask: vfio-bind: {bdf} restored to {}", driver.as_deref().unwrap_or("the kernel's choice"));
        }
    } else {
        if !Path::new("/sys/module/vfio_pci").exists() {
            let status = std::process::Command::new("modprobe").arg("vfio-pci").status().context("running modprobe")?;
            if !status.success() {
                bail!("cannot load vfio-pci (modprobe vfio-pci failed)");
            }
        }
        for bdf in &bdfs {
            let mates = group_mates(&sysfs, *bdf, &bdfs)?;
            if !mates.is_empty() {
                let list = mates.iter().map(ToString::to_string).collect::<Vec<_>>().join(" ");
                bail!("{bdf} shares its IOMMU group with {list}: bind them too (cargo xtask vfio-bind {bdf} {list})");
            }
        }
        for bdf in &bdfs {
            let had = bind(&sysfs, *bdf)?;
            println!("xtask: vfio-bind: {bdf} bound to vfio-pci (had {})", had.as_deref().unwrap_or("no driver"));
            ledger.entry(bdf.to_string()).or_insert(had);
        }
    }
    std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(&path, serde_json::to_vec_pretty(&ledger)?)?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recorded device: `bdf` bound to `driver`, alone in IOMMU group 3.
    fn record(root: &Path, bdf: &str, driver: &str) -> HostBdf {
        let bdf: HostBdf = bdf.parse().unwrap();
        let dir = HostPci::at(root).dir(bdf);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in [("vendor", "0x8086"), ("device", "0x10d3"), ("class", "0x020000"), ("resource", "")] {
            std::fs::write(dir.join(name), text).unwrap();
        }
        let drv = root.join("bus/pci/drivers").join(driver);
        std::fs::create_dir_all(&drv).unwrap();
        std::os::unix::fs::symlink(&drv, dir.join("driver")).unwrap();
        let group = root.join("kernel/iommu_groups/3/devices");
        std::fs::create_dir_all(&group).unwrap();
        std::os::unix::fs::symlink(&dir, group.join(bdf.to_string())).unwrap();
        std::os::unix::fs::symlink(root.join("kernel/iommu_groups/3"), dir.join("iommu_group")).unwrap();
        bdf
    }

    #[test]
    fn test_bind_overrides_unbinds_and_reprobes_then_restore_rebinds() {
        let root = tempfile::tempdir().unwrap();
        let bdf = record(root.path(), "0000:3b:00.0", "e1000e");
        let sysfs = HostPci::at(root.path());
        assert_eq!(bind(&sysfs, bdf).unwrap().as_deref(), Some("e1000e"));
        let read = |p: &str| std::fs::read_to_string(root.path().join(p)).unwrap();
        assert_eq!(read("bus/pci/devices/0000:3b:00.0/driver_override"), "vfio-pci");
        assert_eq!(read("bus/pci/drivers/e1000e/unbind"), "0000:3b:00.0");
        assert_eq!(read("bus/pci/drivers_probe"), "0000:3b:00.0");
        restore(&sysfs, bdf, Some("e1000e")).unwrap();
        assert_eq!(read("bus/pci/devices/0000:3b:00.0/driver_override"), "\n");
        assert_eq!(read("bus/pci/drivers/e1000e/bind"), "0000:3b:00.0");
    }

    #[test]
    fn test_group_mates_must_be_bound_together() {
        let root = tempfile::tempdir().unwrap();
        let a = record(root.path(), "0000:3b:00.0", "e1000e");
        let b = record(root.path(), "0000:3b:00.1", "e1000e");
        let sysfs = HostPci::at(root.path());
        assert_eq!(group_mates(&sysfs, a, &[a]).unwrap(), [b]);
        assert!(group_mates(&sysfs, a, &[a, b]).unwrap().is_empty());
    }
}
