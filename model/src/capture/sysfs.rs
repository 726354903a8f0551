//! Reading a Linux sysfs tree: every PCI function with its place below a root complex, its
//! capabilities and links, and the NUMA nodes. The tree may be the live one or a recording,
//! so nothing it says is trusted: a file that is not as the kernel writes it is an error that
//! names it, a function that cannot be placed is left out with a note.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::CaptureError;
use crate::host_pci::{HostBdf, HostFunction, HostPci};
use crate::node::{Link, LinkSpeed, LINK_WIDTHS};

/// Where sysfs lists PCI functions, below the sysfs root's `sys`.
const PCI_DEVICES: &str = "bus/pci/devices";
/// Where the device tree is.
const DEVICES: &str = "devices";
/// Where NUMA nodes are.
const NODES: &str = "devices/system/node";
/// Size of one memory block (`memoryN` in a node's directory), hex.
const BLOCK_SIZE: &str = "devices/system/memory/block_size_bytes";
/// Online CPUs, when the kernel has no NUMA directory.
const CPUS_ONLINE: &str = "devices/system/cpu/online";
/// Memory is rounded up to this when only `MemTotal` tells it (the kernel's own share is
/// missing from it).
const MEM_TOTAL_GRANULE: u64 = 128 << 20;

/// Status register bit: the function has a capability list.
const STATUS_CAP_LIST: u8 = 0x10;
/// Offset of the Status register's low byte.
const STATUS: usize = 0x06;
/// Offset of the capability pointer.
const CAP_POINTER: usize = 0x34;
/// Capability ID of PCI Express.
const CAP_ID_PCIE: u8 = 0x10;
/// Offset, in the PCI Express capability, of its Capabilities register (port type in bits 7:4).
const PCIE_FLAGS: usize = 0x02;
/// Where extended capabilities start.
const EXT_CAP_START: usize = 0x100;
/// Size of a configuration space with extended capabilities.
const EXT_CONFIG_SIZE: usize = 4096;
/// Extended capability ID of ACS.
const EXT_CAP_ID_ACS: u16 = 0x000d;
/// Offset, in the ACS capability, of its Control register.
const ACS_CONTROL: usize = 0x06;
/// `IORESOURCE_IO` in a sysfs `resource` line's flags.
const IORESOURCE_IO: u64 = 0x100;
/// Standard BARs of a type-0 function.
const BARS: usize = 6;

/// What the configuration space tells of a function's place in a PCIe tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Port {
    /// `config` is shorter than 256 bytes (read without root): nothing is known.
    Unknown,
    /// No PCI Express capability: conventional PCI.
    Conventional,
    /// The Device/Port Type of its PCI Express capability (4 root port, 5 switch upstream,
    /// 6 switch downstream, 0 endpoint, 9 root complex integrated endpoint, ...).
    Pcie(u8),
}

/// Device/Port Type of a root port.
pub(super) const PORT_ROOT: u8 = 0x4;
/// Device/Port Type of a switch upstream port.
pub(super) const PORT_UPSTREAM: u8 = 0x5;
/// Device/Port Type of a switch downstream port.
pub(super) const PORT_DOWNSTREAM: u8 = 0x6;

/// One PCI function as sysfs shows it.
#[derive(Debug, Clone)]
pub(super) struct Seen {
    /// IDs, class, subsystem, memory BARs and ATS, as the loader reads a passed-through
    /// device (so that a `vfio:` backing agrees with what capture wrote).
    pub f: HostFunction,
    /// Its root complex: the domain and root bus of its `pciDDDD:BB` directory.
    pub complex: (u16, u8),
    /// The bridge above it; `None` on a root bus.
    pub parent: Option<HostBdf>,
    /// `numa_node` (-1 when the firmware gives none).
    pub numa_node: i32,
    /// Its PCI Express port type.
    pub port: Port,
    /// Whether extended configuration space (ACS, ATS) could be read.
    pub extended: bool,
    /// Its ACS Control register, when it has the ACS capability.
    pub acs_control: Option<u16>,
    /// `max_link_speed` and `max_link_width`.
    pub max_link: Option<Link>,
    /// `current_link_*`; `None` when the link is down or the kernel does not say.
    pub current_link: Option<Link>,
    /// Indices of its I/O BARs.
    pub io_bars: Vec<u8>,
    /// For an SR-IOV virtual function: its physical function.
    pub physfn: Option<HostBdf>,
}

/// Base class and subclass of a PCI-to-PCI bridge.
const CLASS_PCI_BRIDGE: u32 = 0x0604;
/// ... of a semi-transparent PCI-to-PCI bridge.
const CLASS_PCI_BRIDGE_SEMI: u32 = 0x0609;
/// ... of a host bridge.
const CLASS_HOST_BRIDGE: u32 = 0x0600;

impl Seen {
    /// A PCI-to-PCI bridge (a port, or a bridge to conventional PCI).
    pub fn is_bridge(&self) -> bool {
        matches!(self.f.class >> 8, CLASS_PCI_BRIDGE | CLASS_PCI_BRIDGE_SEMI)
    }

    /// A host bridge's own function.
    pub fn is_host_bridge(&self) -> bool {
        self.f.class >> 8 == CLASS_HOST_BRIDGE
    }
}

/// One NUMA node of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct HostNuma {
    /// Its number (`nodeN`).
    pub id: u32,
    /// CPUs in its `cpulist`.
    pub cpus: u32,
    /// Its memory in bytes.
    pub memory: u64,
    /// Its `distance` row: to every node, in node order.
    pub distances: Vec<u8>,
}

/// What capture reads of a host.
#[derive(Debug)]
pub(super) struct Host {
    /// The host's name, when the tree has `proc/sys/kernel/hostname`.
    pub hostname: Option<String>,
    /// NUMA nodes by number.
    pub numa: Vec<HostNuma>,
    /// PCI functions by address.
    pub functions: BTreeMap<HostBdf, Seen>,
    /// Functions left out while reading, and why.
    pub skipped: BTreeMap<HostBdf, String>,
    /// What the reading found that the node cannot say.
    pub notes: Vec<String>,
}

fn read_text(path: &Path) -> Result<String, CaptureError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| CaptureError::Read { path: path.to_owned(), source })
}

fn malformed(path: &Path, reason: impl Into<String>) -> CaptureError {
    CaptureError::Malformed { path: path.to_owned(), reason: reason.into() }
}

fn read_dir_names(path: &Path) -> Result<Vec<String>, CaptureError> {
    let entries = std::fs::read_dir(path).map_err(|source| CaptureError::Read { path: path.to_owned(), source })?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| CaptureError::Read { path: path.to_owned(), source })?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    names.sort();
    Ok(names)
}

/// Reads the host under sysfs root `root` (`/` for the live host).
pub(super) fn read(root: &Path) -> Result<Host, CaptureError> {
    let sys = root.join("sys");
    let list = sys.join(PCI_DEVICES);
    let names = read_dir_names(&list)?;
    let mut notes = Vec::new();
    let numa = read_numa(root, &sys, &mut notes)?;
    let mut host = Host {
        hostname: std::fs::read_to_string(root.join("proc/sys/kernel/hostname"))
            .ok()
            .map(|h| h.trim().to_owned())
            .filter(|h| !h.is_empty()),
        numa,
        functions: BTreeMap::new(),
        skipped: BTreeMap::new(),
        notes,
    };
    let devices = sys.join(DEVICES);
    let devices =
        std::fs::canonicalize(&devices).map_err(|source| CaptureError::Read { path: devices.clone(), source })?;
    let reader = HostPci::at(&sys);
    for name in names {
        let Ok(bdf) = name.parse::<HostBdf>() else {
            host.notes.push(format!("{}: not a PCI address this version reads: left out", list.join(&name).display()));
            continue;
        };
        let link = list.join(&name);
        let real = std::fs::canonicalize(&link).map_err(|source| CaptureError::Read { path: link.clone(), source })?;
        match place(&real, &devices, bdf) {
            Ok((complex, parent)) => {
                let seen = read_function(&reader, bdf, complex, parent)?;
                host.functions.insert(bdf, seen);
            }
            Err(reason) => {
                let reason = format!("{}: {reason}", real.display());
                host.notes.push(format!("{bdf}: left out: {reason}"));
                host.skipped.insert(bdf, reason);
            }
        }
    }
    Ok(host)
}

/// The root complex and parent bridge of function `bdf` from its device path `real` (below
/// `devices`): the last `pciDDDD:BB` component, then the functions down to this one.
fn place(real: &Path, devices: &Path, bdf: HostBdf) -> Result<((u16, u8), Option<HostBdf>), String> {
    let rel = real.strip_prefix(devices).map_err(|_| "not below the sysfs device tree".to_owned())?;
    let parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let at = parts
        .iter()
        .rposition(|p| root_complex(p).is_some())
        .ok_or_else(|| "not below a PCI root bus (no pciDDDD:BB directory)".to_owned())?;
    let complex = root_complex(&parts[at]).ok_or_else(|| "not below a PCI root bus".to_owned())?;
    let chain: Vec<HostBdf> = parts[at + 1..].iter().filter_map(|p| p.parse().ok()).collect();
    if chain.len() != parts.len() - at - 1 || chain.last() != Some(&bdf) {
        return Err("its device path is not a chain of PCI functions from a root bus".into());
    }
    Ok((complex, chain.len().checked_sub(2).map(|i| chain[i])))
}

/// `pciDDDD:BB` as domain and bus.
fn root_complex(name: &str) -> Option<(u16, u8)> {
    let (domain, bus) = name.strip_prefix("pci")?.split_once(':')?;
    if domain.len() != 4 || bus.len() != 2 {
        return None;
    }
    Some((u16::from_str_radix(domain, 16).ok()?, u8::from_str_radix(bus, 16).ok()?))
}

fn read_function(
    reader: &HostPci,
    bdf: HostBdf,
    complex: (u16, u8),
    parent: Option<HostBdf>,
) -> Result<Seen, CaptureError> {
    let f = reader.function(bdf)?;
    let dir = reader.dir(bdf);
    let numa_path = dir.join("numa_node");
    let numa_node = match std::fs::read_to_string(&numa_path) {
        Ok(text) => {
            text.trim().parse().map_err(|_| malformed(&numa_path, format!("'{}' is not a number", text.trim())))?
        }
        Err(_) => -1,
    };
    // Unreadable as a whole (a recording without it) is the same as unreadable beyond the
    // header (read without root): the capabilities are unknown.
    let config = std::fs::read(dir.join("config")).unwrap_or_default();
    let (port, extended, acs_control) = capabilities(&config);
    let physfn = std::fs::read_link(dir.join("physfn"))
        .ok()
        .and_then(|p| p.file_name().and_then(|n| n.to_str()).and_then(|n| n.parse().ok()));
    let resource = dir.join("resource");
    Ok(Seen {
        io_bars: io_bars(&read_text(&resource)?, &resource)?,
        max_link: link(&dir, "max_link_speed", "max_link_width")?,
        current_link: link(&dir, "current_link_speed", "current_link_width")?,
        f,
        complex,
        parent,
        numa_node,
        port,
        extended,
        acs_control,
        physfn,
    })
}

/// The port type, whether extended space was readable, and the ACS Control register, from a
/// configuration space image. Walks are bounded: a corrupt list cannot loop.
fn capabilities(config: &[u8]) -> (Port, bool, Option<u16>) {
    if config.len() < EXT_CAP_START {
        return (Port::Unknown, false, None);
    }
    let byte = |at: usize| config.get(at).copied().unwrap_or(0);
    let word = |at: usize| u16::from_le_bytes([byte(at), byte(at + 1)]);
    let mut port = Port::Conventional;
    if byte(STATUS) & STATUS_CAP_LIST != 0 {
        let mut at = usize::from(byte(CAP_POINTER) & 0xfc);
        for _ in 0..48 {
            if at < 0x40 {
                break;
            }
            if byte(at) == CAP_ID_PCIE {
                port = Port::Pcie(((word(at + PCIE_FLAGS) >> 4) & 0xf) as u8);
                break;
            }
            at = usize::from(byte(at + 1) & 0xfc);
        }
    }
    let extended = config.len() >= EXT_CONFIG_SIZE;
    let mut acs = None;
    let mut at = EXT_CAP_START;
    for _ in 0..(EXT_CONFIG_SIZE - EXT_CAP_START) / 8 {
        if !extended || at < EXT_CAP_START || at + 4 > config.len() {
            break;
        }
        let header = u32::from(word(at)) | u32::from(word(at + 2)) << 16;
        if header == 0 || header == u32::MAX {
            break;
        }
        if word(at) == EXT_CAP_ID_ACS {
            acs = Some(word(at + ACS_CONTROL));
        }
        at = (header >> 20) as usize & 0xffc;
    }
    (port, extended, acs)
}

/// Indices of the I/O BARs in a `resource` file.
fn io_bars(text: &str, path: &Path) -> Result<Vec<u8>, CaptureError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().take(BARS).enumerate() {
        let fields: Vec<u64> = line
            .split_whitespace()
            .map(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16))
            .collect::<Result<_, _>>()
            .map_err(|_| malformed(path, format!("line {}: '{line}' is not three hex numbers", i + 1)))?;
        if let [start, end, flags] = fields[..] {
            if flags & IORESOURCE_IO != 0 && end > start {
                out.push(i as u8);
            }
        }
    }
    Ok(out)
}

/// A link speed as sysfs writes it (`16.0 GT/s PCIe`, older kernels `16 GT/s`); `None` for
/// `Unknown` and anything else.
fn parse_speed(text: &str) -> Option<LinkSpeed> {
    let number = |s: &str| s.split_whitespace().next().map(|n| n.strip_suffix(".0").unwrap_or(n).to_owned());
    if !text.contains("GT/s") {
        return None;
    }
    let want = number(text)?;
    LinkSpeed::ALL.into_iter().find(|s| number(s.sysfs()).as_deref() == Some(want.as_str()))
}

/// The link in `speed` and `width` of `dir`: `None` when the files are absent, the link is
/// down (width 0) or the speed unknown; an error when they are not as the kernel writes them.
fn link(dir: &Path, speed: &str, width: &str) -> Result<Option<Link>, CaptureError> {
    let (speed_path, width_path) = (dir.join(speed), dir.join(width));
    let (Ok(speed), Ok(width)) = (std::fs::read_to_string(&speed_path), std::fs::read_to_string(&width_path)) else {
        return Ok(None);
    };
    let width_text = width.trim();
    let width: u8 =
        width_text.parse().map_err(|_| malformed(&width_path, format!("'{width_text}' is not a link width")))?;
    if width == 0 {
        return Ok(None);
    }
    if !LINK_WIDTHS.contains(&width) {
        return Err(malformed(&width_path, format!("x{width} is not a PCIe link width")));
    }
    Ok(parse_speed(speed.trim()).map(|speed| Link { speed, width }))
}

/// Number of CPUs in a `cpulist` (`0-3,8-11`; empty for none).
fn count_cpus(text: &str, path: &Path) -> Result<u32, CaptureError> {
    let mut n = 0u32;
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || malformed(path, format!("'{part}' is not a CPU or CPU range"));
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
        n = b.checked_sub(a).and_then(|d| d.checked_add(1)).and_then(|d| n.checked_add(d)).ok_or_else(bad)?;
    }
    Ok(n)
}

/// `MemTotal` in bytes from a `meminfo` file (`/proc/meminfo`, or a node's
/// `Node 0 MemTotal:  1234 kB`).
fn mem_total(path: &Path) -> Result<u64, CaptureError> {
    let text = read_text(path)?;
    let line = text.lines().find(|l| l.contains("MemTotal:")).ok_or_else(|| malformed(path, "no MemTotal line"))?;
    let kib = line
        .split_once("MemTotal:")
        .and_then(|(_, v)| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .ok_or_else(|| malformed(path, format!("'{line}' is not 'MemTotal: N kB'")))?;
    Ok((kib << 10).next_multiple_of(MEM_TOTAL_GRANULE))
}

/// The NUMA nodes: from `devices/system/node`, or one node of all CPUs and memory when the
/// kernel has no NUMA.
fn read_numa(root: &Path, sys: &Path, notes: &mut Vec<String>) -> Result<Vec<HostNuma>, CaptureError> {
    let dir = sys.join(NODES);
    if !dir.is_dir() {
        let online = sys.join(CPUS_ONLINE);
        let cpus = count_cpus(&read_text(&online)?, &online)?;
        let meminfo = root.join("proc/meminfo");
        let memory = mem_total(&meminfo)?;
        notes.push(format!(
            "no {}: one NUMA node of every CPU, memory from {} MemTotal rounded up to 128M",
            dir.display(),
            meminfo.display()
        ));
        return Ok(vec![HostNuma { id: 0, cpus, memory, distances: vec![10] }]);
    }
    let mut ids: Vec<u32> = read_dir_names(&dir)?.iter().filter_map(|n| n.strip_prefix("node")?.parse().ok()).collect();
    ids.sort_unstable();
    let block_path = sys.join(BLOCK_SIZE);
    let block = std::fs::read_to_string(&block_path)
        .ok()
        .and_then(|t| u64::from_str_radix(t.trim().trim_start_matches("0x"), 16).ok())
        .filter(|b| *b > 0);
    let mut out = Vec::new();
    for id in ids {
        let node = dir.join(format!("node{id}"));
        let cpulist = node.join("cpulist");
        let cpus = count_cpus(&read_text(&cpulist)?, &cpulist)?;
        let distance = node.join("distance");
        let distances = read_text(&distance)?
            .split_whitespace()
            .map(|d| d.parse::<u8>().map_err(|_| malformed(&distance, format!("'{d}' is not a distance (0-255)"))))
            .collect::<Result<Vec<u8>, _>>()?;
        let blocks = read_dir_names(&node)?
            .iter()
            .filter(|n| {
                n.strip_prefix("memory").is_some_and(|k| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
            })
            .count() as u64;
        let memory = match block {
            Some(size) if blocks > 0 => blocks * size,
            _ => {
                let meminfo = node.join("meminfo");
                let memory = mem_total(&meminfo)?;
                if memory > 0 {
                    notes.push(format!(
                        "NUMA node {id}: no memory blocks in {}: memory from MemTotal rounded up to 128M (the \
                         kernel's own share is not in it)",
                        node.display()
                    ));
                }
                memory
            }
        };
        out.push(HostNuma { id, cpus, memory, distances });
    }
    Ok(out)
}

/// Path of function `bdf`'s sysfs directory under sysfs root `root`, for messages.
pub(super) fn function_path(root: &Path, bdf: HostBdf) -> PathBuf {
    root.join("sys").join(PCI_DEVICES).join(bdf.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_speeds_as_kernels_write_them() {
        assert_eq!(parse_speed("16.0 GT/s PCIe"), Some(LinkSpeed::Gt16));
        assert_eq!(parse_speed("8 GT/s"), Some(LinkSpeed::Gt8));
        assert_eq!(parse_speed("2.5 GT/s PCIe"), Some(LinkSpeed::Gt2_5));
        assert_eq!(parse_speed("Unknown"), None);
        assert_eq!(parse_speed("Unknown speed"), None);
        assert_eq!(parse_speed("3 GT/s"), None);
    }

    #[test]
    fn test_cpulists_and_bad_ones() {
        let p = Path::new("cpulist");
        assert_eq!(count_cpus("0-3,8-11", p).unwrap(), 8);
        assert_eq!(count_cpus("5", p).unwrap(), 1);
        assert_eq!(count_cpus("", p).unwrap(), 0);
        for bad in ["3-1", "x", "0-", "1-4294967295,0-4294967295"] {
            assert!(count_cpus(bad, p).is_err(), "{bad}");
        }
    }

    #[test]
    fn test_root_complex_names() {
        assert_eq!(root_complex("pci0000:3a"), Some((0, 0x3a)));
        assert_eq!(root_complex("pci0009:00"), Some((9, 0)));
        assert_eq!(root_complex("pci10000:e0"), None);
        assert_eq!(root_complex("pci_bus"), None);
    }

    #[test]
    fn test_capabilities_of_short_and_looping_config() {
        assert_eq!(capabilities(&[0u8; 64]), (Port::Unknown, false, None));
        let mut config = vec![0u8; 4096];
        config[STATUS] = STATUS_CAP_LIST;
        config[CAP_POINTER] = 0x40;
        config[0x40] = CAP_ID_PCIE;
        config[0x41] = 0x40;
        config[0x42] = 0x62;
        // ACS whose next pointer is itself.
        config[0x100..0x104].copy_from_slice(&(0x000du32 | 1 << 16 | 0x100 << 20).to_le_bytes());
        config[0x106] = 0x1d;
        assert_eq!(capabilities(&config), (Port::Pcie(6), true, Some(0x1d)));
        assert_eq!(capabilities(&config[..256]), (Port::Pcie(6), false, None));
        config[STATUS] = 0;
        assert_eq!(capabilities(&config[..256]).0, Port::Conventional);
    }
}
