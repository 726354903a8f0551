//! A host's PCI functions as sysfs shows them (`/sys/bus/pci/devices/<BDF>/`): IDs, class,
//! BARs, driver, IOMMU group and link. The VMM reads a passed-through device's identity
//! and BAR layout here before it places the device in the node's tree; tests read recorded
//! trees under another root.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// `IORESOURCE_MEM` in a sysfs `resource` line's flags.
const IORESOURCE_MEM: u64 = 0x0000_0200;
/// `IORESOURCE_PREFETCH`.
const IORESOURCE_PREFETCH: u64 = 0x0000_2000;
/// `IORESOURCE_MEM_64`.
const IORESOURCE_MEM_64: u64 = 0x0010_0000;
/// Standard BARs of a type-0 function (the ROM and SR-IOV lines after them are ignored).
const BARS: usize = 6;

/// A host PCI address with its domain, as sysfs names devices: `0000:3b:00.0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostBdf {
    /// PCI domain (segment).
    pub domain: u16,
    /// Bus.
    pub bus: u8,
    /// Device, 0 to 31.
    pub device: u8,
    /// Function, 0 to 7.
    pub function: u8,
}

impl fmt::Display for HostBdf {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{}", self.domain, self.bus, self.device, self.function)
    }
}

impl FromStr for HostBdf {
    type Err = String;

    /// `DDDD:BB:DD.F`, or `BB:DD.F` in domain 0.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("'{s}' is not a PCI address (DDDD:BB:DD.F or BB:DD.F)");
        let (domain, rest) = match s.matches(':').count() {
            2 => s.split_once(':').ok_or_else(bad)?,
            1 => ("0", s),
            _ => return Err(bad()),
        };
        let (bus, rest) = rest.split_once(':').ok_or_else(bad)?;
        let (device, function) = rest.split_once('.').ok_or_else(bad)?;
        let hex8 = |t: &str, max: u8| u8::from_str_radix(t, 16).ok().filter(|v| *v <= max && !t.is_empty());
        Ok(HostBdf {
            domain: u16::from_str_radix(domain, 16).map_err(|_| bad())?,
            bus: hex8(bus, 0xff).ok_or_else(bad)?,
            device: hex8(device, 31).ok_or_else(bad)?,
            function: hex8(function, 7).ok_or_else(bad)?,
        })
    }
}

/// One memory BAR of a host function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostBar {
    /// BAR register index (a 64-bit BAR also uses the next one).
    pub index: u8,
    /// Size in bytes.
    pub size: u64,
    /// Prefetchable.
    pub prefetchable: bool,
    /// 64-bit.
    pub is_64bit: bool,
}

/// What the host says about one PCI function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostFunction {
    /// Its address.
    pub bdf: HostBdf,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code.
    pub class: u32,
    /// Subsystem vendor and device, when it has them.
    pub subsystem: Option<(u16, u16)>,
    /// Memory BARs (I/O BARs are left out: a passed-through device's port I/O is not offered).
    pub bars: Vec<HostBar>,
    /// The bound driver's name (`vfio-pci` for passthrough).
    pub driver: Option<String>,
    /// Its IOMMU group; `None` when the host has no IOMMU (or it is off).
    pub iommu_group: Option<u32>,
    /// What the guest will find in its own configuration space.
    pub caps: DeviceCaps,
}

/// The capabilities a passed-through device brings with it (the guest sees the device's
/// own configuration space, not the VMM's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceCaps {
    /// Its PCIe link capability (`max_link_speed`, `max_link_width`); `None` for a
    /// conventional PCI device.
    pub link: Option<crate::node::Link>,
    /// An MSI-X capability.
    pub msix: bool,
    /// An ATS extended capability.
    pub ats: bool,
}

/// PCI capability ID of MSI-X.
const CAP_MSIX: u8 = 0x11;
/// Extended capability ID of ATS.
const EXT_CAP_ATS: u16 = 0x0f;

impl DeviceCaps {
    /// Reads the capability lists of a configuration space image (`config` in sysfs:
    /// 256 bytes, or 4096 with extended space when read as root).
    fn from_config(config: &[u8], link: Option<crate::node::Link>) -> Self {
        let byte = |at: usize| config.get(at).copied().unwrap_or(0);
        let word = |at: usize| u16::from_le_bytes([byte(at), byte(at + 1)]);
        let mut caps = DeviceCaps { link, ..Default::default() };
        // Bounded walks: a corrupt list cannot loop.
        let (mut at, mut left) = (usize::from(byte(0x34)) & !3, 48);
        while at >= 0x40 && left > 0 {
            caps.msix |= byte(at) == CAP_MSIX;
            at = usize::from(byte(at + 1)) & !3;
            left -= 1;
        }
        let (mut at, mut left) = (0x100, 1024);
        while at >= 0x100 && at + 4 <= config.len() && left > 0 {
            let header = u32::from_le_bytes([byte(at), byte(at + 1), byte(at + 2), byte(at + 3)]);
            caps.ats |= word(at) == EXT_CAP_ATS;
            at = (header >> 20) as usize & !3;
            left -= 1;
        }
        caps
    }
}

/// Reading a host function failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostPciError {
    /// No such device in sysfs.
    #[error("host PCI device {0} does not exist (no {1})")]
    Missing(HostBdf, PathBuf),
    /// A sysfs file is unreadable or not as the kernel writes it.
    #[error("host PCI device {bdf}: {file}: {reason}")]
    Sysfs {
        /// The device.
        bdf: HostBdf,
        /// The file.
        file: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// The host's PCI devices under a sysfs root (`/sys` on a live host).
#[derive(Debug, Clone)]
pub struct HostPci {
    root: PathBuf,
}

impl Default for HostPci {
    fn default() -> Self {
        HostPci::at("/sys")
    }
}

impl HostPci {
    /// The devices under `sysfs` (a recorded tree in tests).
    pub fn at(sysfs: impl Into<PathBuf>) -> Self {
        HostPci { root: sysfs.into() }
    }

    /// The sysfs directory of `bdf`.
    pub fn dir(&self, bdf: HostBdf) -> PathBuf {
        self.root.join("bus/pci/devices").join(bdf.to_string())
    }

    /// Reads function `bdf`.
    pub fn function(&self, bdf: HostBdf) -> Result<HostFunction, HostPciError> {
        let dir = self.dir(bdf);
        if !dir.is_dir() {
            return Err(HostPciError::Missing(bdf, dir));
        }
        let read = |name: &str| {
            let file = dir.join(name);
            std::fs::read_to_string(&file)
                .map_err(|e| HostPciError::Sysfs { bdf, file: file.clone(), reason: e.to_string() })
                .map(|s| (s.trim().to_owned(), file))
        };
        let hex = |name: &str| -> Result<u32, HostPciError> {
            let (text, file) = read(name)?;
            u32::from_str_radix(text.trim_start_matches("0x"), 16).map_err(|_| HostPciError::Sysfs {
                bdf,
                file,
                reason: format!("'{text}' is not a hex number"),
            })
        };
        let subsystem = match (hex("subsystem_vendor"), hex("subsystem_device")) {
            (Ok(v), Ok(d)) if v != 0 => Some((v as u16, d as u16)),
            _ => None,
        };
        let (resource, file) = read("resource")?;
        let bars = parse_resource(&resource).map_err(|reason| HostPciError::Sysfs { bdf, file, reason })?;
        let link_name = |name: &str| {
            std::fs::read_link(dir.join(name)).ok().and_then(|p| Some(p.file_name()?.to_string_lossy().into_owned()))
        };
        let link = match (read("max_link_speed"), read("max_link_width")) {
            (Ok((speed, _)), Ok((width, _))) => crate::node::LinkSpeed::ALL
                .into_iter()
                .find(|s| s.sysfs() == speed)
                .zip(width.parse().ok())
                .map(|(speed, width)| crate::node::Link { speed, width }),
            _ => None,
        };
        let config = std::fs::read(dir.join("config")).unwrap_or_default();
        Ok(HostFunction {
            caps: DeviceCaps::from_config(&config, link),
            bdf,
            vendor: hex("vendor")? as u16,
            device: hex("device")? as u16,
            class: hex("class")?,
            subsystem,
            bars,
            driver: link_name("driver"),
            iommu_group: link_name("iommu_group").and_then(|g| g.parse().ok()),
        })
    }

    /// The functions in IOMMU group `group`.
    pub fn iommu_group_members(&self, group: u32) -> Vec<HostBdf> {
        let dir = self.root.join("kernel/iommu_groups").join(group.to_string()).join("devices");
        let mut members: Vec<HostBdf> = std::fs::read_dir(dir)
            .map(|d| d.filter_map(Result::ok).filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
            .unwrap_or_default();
        members.sort();
        members
    }

    /// Where `bdf`'s sysfs directory is, for messages that tell a user what to look at.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// The memory BARs of a sysfs `resource` file: one `start end flags` line (hex) per
/// resource, BARs 0-5 first.
fn parse_resource(text: &str) -> Result<Vec<HostBar>, String> {
    let mut bars = Vec::new();
    for (i, line) in text.lines().take(BARS).enumerate() {
        let fields: Vec<u64> = line
            .split_whitespace()
            .map(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16))
            .collect::<Result<_, _>>()
            .map_err(|_| format!("line {}: '{line}' is not three hex numbers", i + 1))?;
        let [start, end, flags] = fields[..] else {
            return Err(format!("line {}: '{line}' is not three hex numbers", i + 1));
        };
        if flags & IORESOURCE_MEM == 0 || end <= start {
            continue;
        }
        bars.push(HostBar {
            index: i as u8,
            size: end - start + 1,
            prefetchable: flags & IORESOURCE_PREFETCH != 0,
            is_64bit: flags & IORESOURCE_MEM_64 != 0,
        });
    }
    Ok(bars)
}

/// A recorded sysfs entry under `root`: QEMU's e1000e at 0000:01:00.0 as L1 sees it
/// behind intel-iommu, bound to vfio-pci, alone in IOMMU group 7.
#[cfg(test)]
pub(crate) fn record_e1000e(root: &Path) -> HostBdf {
    let bdf: HostBdf = "0000:01:00.0".parse().unwrap();
    let dir = HostPci::at(root).dir(bdf);
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in [
        ("vendor", "0x8086\n"),
        ("device", "0x10d3\n"),
        ("class", "0x020000\n"),
        ("subsystem_vendor", "0x8086\n"),
        ("subsystem_device", "0x0000\n"),
        ("max_link_speed", "2.5 GT/s PCIe\n"),
        ("max_link_width", "1\n"),
        (
            "resource",
            "0x00000000fe840000 0x00000000fe85ffff 0x0000000000040200\n\
                 0x00000000fe860000 0x00000000fe87ffff 0x0000000000040200\n\
                 0x000000000000c000 0x000000000000c01f 0x0000000000040101\n\
                 0x00000000fe880000 0x00000000fe883fff 0x0000000000040200\n\
                 0x0000008000000000 0x00000080003fffff 0x000000000014220c\n\
                 0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                 0x00000000fe800000 0x00000000fe83ffff 0x0000000000046200\n",
        ),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    // Capabilities as QEMU's e1000e has them: PM at 0xc8, MSI at 0xd0, PCIe at 0xe0,
    // MSI-X at 0xa0; AER then DSN in extended space.
    let mut config = vec![0u8; 4096];
    config[0x34] = 0xc8;
    for (at, id, next) in [(0xc8, 0x01, 0xd0), (0xd0, 0x05, 0xe0), (0xe0, 0x10, 0xa0), (0xa0, 0x11, 0x00)] {
        config[at] = id;
        config[at + 1] = next;
    }
    config[0x100..0x104].copy_from_slice(&(0x0001u32 | 1 << 16 | 0x140 << 20).to_le_bytes());
    config[0x140..0x144].copy_from_slice(&(0x0003u32 | 1 << 16).to_le_bytes());
    std::fs::write(dir.join("config"), config).unwrap();
    let group = root.join("kernel/iommu_groups/7/devices");
    std::fs::create_dir_all(&group).unwrap();
    std::os::unix::fs::symlink(&dir, group.join(bdf.to_string())).unwrap();
    std::os::unix::fs::symlink(root.join("kernel/iommu_groups/7"), dir.join("iommu_group")).unwrap();
    let drv = root.join("bus/pci/drivers/vfio-pci");
    std::fs::create_dir_all(&drv).unwrap();
    std::os::unix::fs::symlink(&drv, dir.join("driver")).unwrap();
    bdf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_reads_ids_memory_bars_driver_and_group() {
        let dir = tempfile::tempdir().unwrap();
        let bdf = record_e1000e(dir.path());
        let host = HostPci::at(dir.path());
        let f = host.function(bdf).unwrap();
        assert_eq!((f.vendor, f.device, f.class, f.subsystem), (0x8086, 0x10d3, 0x020000, Some((0x8086, 0))));
        // The I/O BAR (2) and the upper half of the 64-bit one (5) are left out; the ROM
        // line is not a BAR.
        let bars: Vec<(u8, u64, bool, bool)> =
            f.bars.iter().map(|b| (b.index, b.size, b.prefetchable, b.is_64bit)).collect();
        assert_eq!(
            bars,
            [
                (0, 128 << 10, false, false),
                (1, 128 << 10, false, false),
                (3, 16 << 10, false, false),
                (4, 4 << 20, true, true)
            ]
        );
        assert_eq!(f.driver.as_deref(), Some("vfio-pci"));
        let gen1_x1 = crate::node::Link { speed: crate::node::LinkSpeed::Gt2_5, width: 1 };
        assert_eq!(f.caps, DeviceCaps { link: Some(gen1_x1), msix: true, ats: false });
        assert_eq!(f.iommu_group, Some(7));
        assert_eq!(host.iommu_group_members(7), [bdf]);
    }

    #[test]
    fn test_capability_walks_find_ats_and_survive_loops() {
        let mut config = vec![0u8; 4096];
        // A standard list that points at itself, and ATS after ACS in extended space.
        config[0x34] = 0x40;
        config[0x40] = 0x11;
        config[0x41] = 0x40;
        config[0x100..0x104].copy_from_slice(&(0x000du32 | 1 << 16 | 0x120 << 20).to_le_bytes());
        config[0x120..0x124].copy_from_slice(&(0x000fu32 | 1 << 16 | 0x120 << 20).to_le_bytes());
        assert_eq!(DeviceCaps::from_config(&config, None), DeviceCaps { link: None, msix: true, ats: true });
        // 256 bytes (sysfs as a normal user): no extended space.
        assert_eq!(DeviceCaps::from_config(&config[..256], None), DeviceCaps { link: None, msix: true, ats: false });
    }

    #[test]
    fn test_missing_device_and_bad_addresses_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err = HostPci::at(dir.path()).function("3b:00.0".parse().unwrap()).unwrap_err().to_string();
        assert!(err.starts_with("host PCI device 0000:3b:00.0 does not exist"), "{err}");
        assert_eq!("0001:3b:1f.7".parse::<HostBdf>().unwrap().to_string(), "0001:3b:1f.7");
        for bad in ["3b:00", "3b:20.0", "3b:00.8", "x:00.0", "0000:3b:00:0.0", ""] {
            assert!(bad.parse::<HostBdf>().is_err(), "{bad}");
        }
    }
}
