//! PCI functions driven from userspace through sysfs: finding a function by ID, its
//! resources, enabling it, bus mastering, its MSI vectors and interrupt counts, and a BAR
//! mapped for MMIO (`resourceN`).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::mapping::{Mapped, Mapping};

/// Where sysfs lists PCI functions.
pub const SYSFS_PCI: &str = "/sys/bus/pci/devices";
/// Command register: memory space decode.
pub const COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: bus master (the function may issue DMA).
pub const COMMAND_BUS_MASTER: u16 = 1 << 2;
/// Offset of the Command register in configuration space.
const COMMAND_OFFSET: u64 = 4;
/// `IORESOURCE_MEM` in a sysfs `resource` line's flags.
const IORESOURCE_MEM: u64 = 0x200;
/// `IORESOURCE_PREFETCH` in a sysfs `resource` line's flags.
const IORESOURCE_PREFETCH: u64 = 0x2000;

/// The sysfs directory of function `bdf` under `root`.
pub fn function_dir(root: &Path, bdf: &str) -> PathBuf {
    root.join(SYSFS_PCI.trim_start_matches('/')).join(bdf)
}

fn read_hex(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    u64::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// BDFs of the functions with this vendor and device ID, sorted.
pub fn find(root: &Path, vendor: u16, device: u16) -> Vec<String> {
    let dir = root.join(SYSFS_PCI.trim_start_matches('/'));
    let Ok(entries) = std::fs::read_dir(&dir) else { return Vec::new() };
    let mut found: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            read_hex(&e.path().join("vendor")) == Some(u64::from(vendor))
                && read_hex(&e.path().join("device")) == Some(u64::from(device))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    found.sort();
    found
}

/// One line of sysfs `resource`: `0x<start> 0x<end> 0x<flags>`, zeros when unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    /// First address (CPU physical, which is the bus address without an IOMMU on x86).
    pub start: u64,
    /// Last address.
    pub end: u64,
    /// `IORESOURCE_*` flags.
    pub flags: u64,
}

impl Resource {
    /// Size in bytes; 0 when unused.
    pub fn size(&self) -> u64 {
        if self.end > self.start {
            self.end - self.start + 1
        } else {
            0
        }
    }

    /// A memory (not I/O port) resource.
    pub fn is_mem(&self) -> bool {
        self.flags & IORESOURCE_MEM != 0
    }

    /// A prefetchable memory resource.
    pub fn is_prefetchable(&self) -> bool {
        self.is_mem() && self.flags & IORESOURCE_PREFETCH != 0
    }
}

/// Parses one `resource` line.
pub fn parse_resource_line(line: &str) -> Option<Resource> {
    let hex = |s: &str| u64::from_str_radix(s.strip_prefix("0x")?, 16).ok();
    let mut words = line.split_whitespace();
    let r = Resource { start: hex(words.next()?)?, end: hex(words.next()?)?, flags: hex(words.next()?)? };
    words.next().is_none().then_some(r)
}

/// Resource `index` (BAR 0-5, then the ROM and bridge windows) of the function in `dir`.
pub fn resource(dir: &Path, index: usize) -> Result<Resource, String> {
    let path = dir.join("resource");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let line = text.lines().nth(index).ok_or_else(|| format!("{} has no line {index}", path.display()))?;
    parse_resource_line(line).ok_or_else(|| format!("{} line {index} unparsable: '{line}'", path.display()))
}

/// The reset methods Linux offers for the function in `dir`, best first (sysfs
/// `reset_method`, Linux 5.15 on); `None` when the file is not there.
pub fn reset_methods(dir: &Path) -> Option<String> {
    std::fs::read_to_string(dir.join("reset_method")).ok().map(|m| m.trim().to_owned())
}

/// Resets the function in `dir` as Linux does for sysfs `reset`: its configuration saved,
/// the reset its first method makes, the configuration restored.
pub fn reset(dir: &Path) -> Result<(), String> {
    let path = dir.join("reset");
    std::fs::write(&path, "1").map_err(|e| format!("writing 1 to {}: {e}", path.display()))
}

/// The driver bound to the function in `dir` (the `driver` link's last component).
pub fn driver(dir: &Path) -> Option<String> {
    let link = std::fs::read_link(dir.join("driver")).ok()?;
    link.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// Enables the function (`enable` ← 1, which turns memory decode on) unless it already is;
/// returns what `enable` read before.
pub fn enable(dir: &Path) -> Result<String, String> {
    let path = dir.join("enable");
    let before = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?.trim().to_owned();
    if before == "0" {
        std::fs::write(&path, "1").map_err(|e| format!("writing 1 to {}: {e}", path.display()))?;
    }
    Ok(before)
}

/// Sets `bits` in the Command register by read-modify-write of sysfs `config`; returns the
/// register before and after (as read back).
pub fn set_command_bits(dir: &Path, bits: u16) -> Result<(u16, u16), String> {
    update_command(dir, |c| c | bits)
}

/// Clears `bits` in the Command register, as [`set_command_bits`] sets them.
pub fn clear_command_bits(dir: &Path, bits: u16) -> Result<(u16, u16), String> {
    update_command(dir, |c| c & !bits)
}

/// The Command register.
pub fn command(dir: &Path) -> Result<u16, String> {
    update_command(dir, |c| c).map(|(before, _)| before)
}

/// Read-modify-write of the Command register (no write when `f` changes nothing); the
/// register before and after, as read back.
fn update_command(dir: &Path, f: impl FnOnce(u16) -> u16) -> Result<(u16, u16), String> {
    let path = dir.join("config");
    let file = OpenOptions::new().read(true).write(true).open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let read = || -> Result<u16, String> {
        let mut b = [0u8; 2];
        file.read_exact_at(&mut b, COMMAND_OFFSET)
            .map_err(|e| format!("reading Command from {}: {e}", path.display()))?;
        Ok(u16::from_le_bytes(b))
    };
    let before = read()?;
    let want = f(before);
    if want != before {
        file.write_all_at(&want.to_le_bytes(), COMMAND_OFFSET)
            .map_err(|e| format!("writing Command to {}: {e}", path.display()))?;
    }
    Ok((before, read()?))
}

/// The function's vendor and device ID from sysfs `vendor` and `device`.
pub fn ids(dir: &Path) -> Result<(u16, u16), String> {
    let id = |file: &str| {
        let path = dir.join(file);
        read_hex(&path)
            .and_then(|v| u16::try_from(v).ok())
            .ok_or_else(|| format!("{} is unreadable or not a 16-bit hex ID", path.display()))
    };
    Ok((id("vendor")?, id("device")?))
}

/// A function this process turned on (`enable`, Command bits) and turns back to how it found
/// it: on [`Claim::release`], or quietly when dropped.
#[derive(Debug)]
pub struct Claim {
    dir: PathBuf,
    /// The Command register before the claim.
    command_before: u16,
    /// The Command bits the claim set.
    bits: u16,
    /// Whether `enable` read 0 before (so the claim wrote 1).
    was_disabled: bool,
    released: bool,
}

impl Claim {
    /// The function's sysfs directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Enables the function (sysfs `enable`) and sets `bits` in its Command register;
    /// a diagnostic line with what it found and left.
    pub fn take(dir: &Path, bits: u16) -> Result<(Claim, String), String> {
        let command_before = command(dir)?;
        let enable_before = enable(dir)?;
        // From here on, dropping the claim (on an error too) restores the function.
        let claim =
            Claim { dir: dir.to_owned(), command_before, bits, was_disabled: enable_before == "0", released: false };
        let (_, after) = set_command_bits(dir, bits)?;
        let line = format!("enable was {enable_before}, Command {command_before:#06x} -> {after:#06x}");
        if after & bits != bits {
            return Err(format!("{line}: bits {bits:#06x} did not stick"));
        }
        Ok((claim, line))
    }

    /// Puts `enable` and the claimed Command bits back as they were; a diagnostic line.
    pub fn release(mut self) -> Result<String, String> {
        self.released = true;
        self.restore()
    }

    fn restore(&self) -> Result<String, String> {
        let (before, after) = clear_command_bits(&self.dir, self.bits & !self.command_before)?;
        let mut line = format!("Command {before:#06x} -> {after:#06x}");
        if self.was_disabled {
            let path = self.dir.join("enable");
            std::fs::write(&path, "0").map_err(|e| format!("{line}; writing 0 to {}: {e}", path.display()))?;
            line.push_str(", enable back to 0");
        }
        Ok(line)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.released {
            let _ = self.restore();
        }
    }
}

/// The function's MSI/MSI-X vectors from `msi_irqs/`: (Linux IRQ number, mode `msi` or
/// `msix`), by IRQ number.
pub fn msi_irqs(dir: &Path) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir(dir.join("msi_irqs")) else { return Vec::new() };
    let mut irqs: Vec<(u32, String)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let irq = e.file_name().to_str()?.parse().ok()?;
            let mode = std::fs::read_to_string(e.path()).map(|m| m.trim().to_owned()).unwrap_or_default();
            Some((irq, mode))
        })
        .collect();
    irqs.sort();
    irqs
}

/// Total count (all CPUs) of every numbered IRQ in `/proc/interrupts`.
pub fn interrupt_counts(text: &str) -> BTreeMap<u32, u64> {
    let mut lines = text.lines();
    let cpus = lines.next().map(|h| h.split_whitespace().filter(|w| w.starts_with("CPU")).count()).unwrap_or(0);
    lines
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let irq = words.next()?.strip_suffix(':')?.parse().ok()?;
            let total = words.take(cpus).map_while(|w| w.parse::<u64>().ok()).sum();
            Some((irq, total))
        })
        .collect()
}

/// Sum of the counts of `irqs`.
pub fn sum_counts(counts: &BTreeMap<u32, u64>, irqs: &[u32]) -> u64 {
    irqs.iter().filter_map(|i| counts.get(i)).sum()
}

/// Register access to a device, so that a driver's register sequence runs against a real
/// BAR or a fake register file alike.
pub trait Mmio {
    /// A 32-bit read at `offset`.
    fn read32(&mut self, offset: usize) -> u32;
    /// A 32-bit write at `offset`.
    fn write32(&mut self, offset: usize, value: u32);
    /// A 64-bit read at `offset`, one access.
    fn read64(&mut self, offset: usize) -> u64;
    /// A 64-bit write at `offset`, one access.
    fn write64(&mut self, offset: usize, value: u64);
}

/// A memory BAR mapped from sysfs `resourceN` (the whole resource, shared, uncached as the
/// kernel maps it). Accesses outside it or misaligned read all-ones and drop writes, as an
/// unclaimed PCI access would, rather than fault.
#[derive(Debug)]
pub struct MappedBar {
    map: Mapping,
    _file: File,
}

impl MappedBar {
    /// Maps `path` (a sysfs `resourceN` file, or any file in tests) read-write.
    pub fn open(path: &Path) -> Result<MappedBar, String> {
        Self::open_window(path, usize::MAX)
    }

    /// Maps the first `max` bytes of `path` (all of it when shorter). A sysfs resource
    /// mapping is built of 4 KiB page-table entries up front: all of a 128 GiB GPU aperture
    /// would take 256 MiB of the guest's memory.
    pub fn open_window(path: &Path, max: usize) -> Result<MappedBar, String> {
        let what = |e: std::io::Error| format!("{}: {e}", path.display());
        let file = OpenOptions::new().read(true).write(true).custom_flags(libc::O_SYNC).open(path).map_err(what)?;
        let len =
            usize::try_from(file.metadata().map_err(what)?.len()).map_err(|e| format!("{}: {e}", path.display()))?;
        let len = len.min(max);
        if len == 0 {
            return Err(format!("{}: empty resource", path.display()));
        }
        let map = Mapping::new(len, libc::MAP_SHARED, file.as_raw_fd(), &path.display().to_string())?;
        Ok(MappedBar { map, _file: file })
    }

    /// Mapped length in bytes.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Writes `data` at `offset`: aligned 32-bit accesses, single bytes at unaligned edges.
    pub fn write_bytes(&mut self, offset: usize, data: &[u8]) {
        let mut i = 0;
        while i < data.len() {
            let at = offset.saturating_add(i);
            if at % 4 == 0 && i + 4 <= data.len() {
                self.write32(at, u32::from_le_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]));
                i += 4;
            } else {
                if let Some(p) = self.map.at(at, 1) {
                    // SAFETY: `at` checked that the byte is inside the live mapping.
                    unsafe { std::ptr::write_volatile(p, data[i]) };
                }
                i += 1;
            }
        }
    }

    /// Reads `len` bytes at `offset`: aligned 32-bit accesses, single bytes at unaligned edges.
    pub fn read_bytes(&mut self, offset: usize, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let at = offset.saturating_add(out.len());
            if at % 4 == 0 && out.len() + 4 <= len {
                out.extend_from_slice(&self.read32(at).to_le_bytes());
            } else {
                // SAFETY: `at` checked that the byte is inside the live mapping.
                out.push(self.map.at(at, 1).map_or(0xff, |p| unsafe { std::ptr::read_volatile(p) }));
            }
        }
        out
    }
}

impl Mapped for MappedBar {
    fn mapping(&self) -> &Mapping {
        &self.map
    }
}

/// What an unprivileged reader gets of sysfs `config`: the header only.
pub const CONFIG_HEADER_LEN: usize = 64;
/// Capability pointer in the configuration header.
pub const CAP_POINTER: usize = 0x34;
/// Status register byte holding "capabilities list".
pub const STATUS_LOW: usize = 0x06;
/// Status: the function has a capabilities list.
pub const STATUS_CAP_LIST: u8 = 0x10;
/// Where extended capabilities start.
pub const EXT_CAP_START: usize = 0x100;
/// ACS and ATS both keep their control register here, from the capability's header.
pub const EXT_CAP_CONTROL: usize = 6;

/// The offset of standard capability `id` in raw configuration space `config` (sysfs
/// `config`), or `None`. A looping or truncated list ends the walk.
pub fn find_capability(config: &[u8], id: u8) -> Option<usize> {
    if config.get(STATUS_LOW)? & STATUS_CAP_LIST == 0 {
        return None;
    }
    let mut at = usize::from(config.get(CAP_POINTER)? & 0xfc);
    for _ in 0..48 {
        if at < CONFIG_HEADER_LEN {
            return None;
        }
        if *config.get(at)? == id {
            return Some(at);
        }
        at = usize::from(config.get(at + 1)? & 0xfc);
    }
    None
}

/// The offset of extended capability `id` in `config`, or `None` (also when `config` has
/// no extended space: an unprivileged read, or conventional PCI).
pub fn find_ext_capability(config: &[u8], id: u16) -> Option<usize> {
    let mut at = EXT_CAP_START;
    for _ in 0..(4096 - EXT_CAP_START) / 8 {
        let header = u32::from_le_bytes(config.get(at..at + 4)?.try_into().ok()?);
        if header == 0 || header == u32::MAX {
            return None;
        }
        if header & 0xffff == u32::from(id) {
            return Some(at);
        }
        at = (header >> 20) as usize & 0xffc;
        if at < EXT_CAP_START {
            return None;
        }
    }
    None
}

/// The control register of extended capability `id` (ACS, ATS), when present.
pub fn ext_capability_control(config: &[u8], id: u16) -> Option<u16> {
    let at = find_ext_capability(config, id)? + EXT_CAP_CONTROL;
    Some(u16::from_le_bytes(config.get(at..at + 2)?.try_into().ok()?))
}

/// Whether `name` is a PCI function address as sysfs writes it (`0000:03:00.0`).
pub fn is_bdf(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && [0..4, 5..7, 8..10].iter().all(|r| b[r.clone()].iter().all(u8::is_ascii_hexdigit))
        && (b'0'..=b'7').contains(&b[11])
}

/// The nearest PCI function at or above sysfs path `path`: resolves links, then walks up to
/// the first directory named like a BDF. `None` when there is none under `root`.
pub fn pci_function_of(root: &Path, path: &Path) -> Option<(String, PathBuf)> {
    let resolved = std::fs::canonicalize(path).ok()?;
    let root = std::fs::canonicalize(root).ok()?;
    let mut at = resolved.as_path();
    while at.starts_with(&root) {
        if let Some(name) = at.file_name().map(|n| n.to_string_lossy()) {
            if is_bdf(&name) {
                return Some((name.into_owned(), resolved.clone()));
            }
        }
        at = at.parent()?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_resource_lines() {
        let r = parse_resource_line("0x0000000380000000 0x0000000383ffffff 0x000000000014220c").unwrap();
        assert_eq!(r.start, 0x3_8000_0000);
        assert_eq!(r.size(), 64 << 20);
        assert!(r.is_mem() && r.is_prefetchable());
        let io = parse_resource_line("0x000000000000c000 0x000000000000c01f 0x0000000000040101").unwrap();
        assert!(!io.is_mem() && !io.is_prefetchable());
        assert_eq!(parse_resource_line("0x0000000000000000 0x0000000000000000 0x0000000000000000").unwrap().size(), 0);
        assert_eq!(parse_resource_line("0x1 0x2"), None);
        assert_eq!(parse_resource_line("1000 2000 200"), None);
        assert_eq!(parse_resource_line("0x1 0x2 0x3 0x4"), None);
    }

    fn fake_function(dir: &Path, vendor: &str, device: &str, resource: &str) {
        std::fs::create_dir_all(dir.join("msi_irqs")).unwrap();
        std::fs::write(dir.join("vendor"), vendor).unwrap();
        std::fs::write(dir.join("device"), device).unwrap();
        std::fs::write(dir.join("resource"), resource).unwrap();
        std::fs::write(dir.join("enable"), "0\n").unwrap();
        let mut config = vec![0u8; 64];
        config[4] = 0x02;
        std::fs::write(dir.join("config"), config).unwrap();
    }

    #[test]
    fn test_sysfs_function() {
        let root = tempfile::tempdir().unwrap();
        let zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        let res = format!("{zero}{zero}0x0000000380000000 0x0000000383ffffff 0x000000000014220c\n");
        let ivshmem = function_dir(root.path(), "0000:05:00.0");
        fake_function(&ivshmem, "0x1af4\n", "0x1110\n", &res);
        fake_function(&function_dir(root.path(), "0000:03:00.0"), "0x1234\n", "0x11e8\n", zero);
        fake_function(&function_dir(root.path(), "0000:02:00.0"), "0x1234\n", "0x11e8\n", zero);
        assert_eq!(find(root.path(), 0x1234, 0x11e8), ["0000:02:00.0", "0000:03:00.0"]);
        assert_eq!(find(root.path(), 0x8086, 0x10d3), Vec::<String>::new());
        assert_eq!(resource(&ivshmem, 2).unwrap().start, 0x3_8000_0000);
        assert!(resource(&ivshmem, 5).unwrap_err().contains("no line 5"));

        assert_eq!(enable(&ivshmem).unwrap(), "0");
        assert_eq!(std::fs::read_to_string(ivshmem.join("enable")).unwrap(), "1");
        assert_eq!(set_command_bits(&ivshmem, COMMAND_MEMORY | COMMAND_BUS_MASTER).unwrap(), (0x0002, 0x0006));
        assert_eq!(set_command_bits(&ivshmem, COMMAND_BUS_MASTER).unwrap(), (0x0006, 0x0006));

        std::fs::write(ivshmem.join("msi_irqs/27"), "msix\n").unwrap();
        std::fs::write(ivshmem.join("msi_irqs/9"), "msix\n").unwrap();
        assert_eq!(msi_irqs(&ivshmem), [(9, "msix".to_owned()), (27, "msix".to_owned())]);
        assert_eq!(driver(&ivshmem), None);
    }

    #[test]
    fn test_ids_and_a_claim_put_back() {
        let root = tempfile::tempdir().unwrap();
        let dir = function_dir(root.path(), "0000:04:00.0");
        fake_function(&dir, "0x15b3\n", "0x101b\n", "");
        assert_eq!(ids(&dir).unwrap(), (0x15b3, 0x101b));
        std::fs::write(dir.join("device"), "0x12345\n").unwrap();
        assert!(ids(&dir).unwrap_err().contains("not a 16-bit hex ID"));

        // Memory decode was on, bus mastering off, the function disabled.
        let (claim, line) = Claim::take(&dir, COMMAND_MEMORY | COMMAND_BUS_MASTER).unwrap();
        assert_eq!(line, "enable was 0, Command 0x0002 -> 0x0006");
        assert_eq!(command(&dir).unwrap(), 0x0006);
        assert_eq!(claim.release().unwrap(), "Command 0x0006 -> 0x0002, enable back to 0");
        assert_eq!(command(&dir).unwrap(), 0x0002);
        assert_eq!(std::fs::read_to_string(dir.join("enable")).unwrap(), "0");

        // Dropped without a release: put back all the same. Enabled before: left enabled.
        std::fs::write(dir.join("enable"), "1\n").unwrap();
        let (claim, _) = Claim::take(&dir, COMMAND_BUS_MASTER).unwrap();
        drop(claim);
        assert_eq!(command(&dir).unwrap(), 0x0002);
        assert_eq!(std::fs::read_to_string(dir.join("enable")).unwrap(), "1\n");
        assert_eq!(clear_command_bits(&dir, COMMAND_MEMORY).unwrap(), (0x0002, 0x0000));
    }

    #[test]
    fn test_interrupt_counts() {
        let text = "           CPU0       CPU1       \n  0:         45          0   IO-APIC   2-edge      timer\n 24:          3         12   PCI-MSIX-0000:01:00.0    0-edge      eth0-rx-0\n 25:          1          0   PCI-MSIX-0000:01:00.0    1-edge      eth0-tx-0\nNMI:          0          0   Non-maskable interrupts\nERR:          0\n";
        let counts = interrupt_counts(text);
        assert_eq!(counts.len(), 3);
        assert_eq!(counts[&24], 15);
        assert_eq!(sum_counts(&counts, &[24, 25, 99]), 16);
    }

    #[test]
    fn test_mapped_bar_on_a_file() {
        let file = tempfile::NamedTempFile::new().unwrap();
        file.as_file().set_len(4096).unwrap();
        let mut bar = MappedBar::open(file.path()).unwrap();
        assert_eq!(bar.len(), 4096);
        bar.write32(4, 0xdead_beef);
        bar.write64(8, 0x0123_4567_89ab_cdef);
        assert_eq!(bar.read32(4), 0xdead_beef);
        assert_eq!(bar.read64(8), 0x0123_4567_89ab_cdef);
        bar.write_bytes(0x100, &[1, 2, 3, 4, 5, 6]);
        bar.write_bytes(0x203, &[7, 8, 9, 10, 11, 12]);
        assert_eq!(bar.read_bytes(0xff, 8), [0, 1, 2, 3, 4, 5, 6, 0]);
        assert_eq!(bar.read_bytes(0x200, 12), [0, 0, 0, 7, 8, 9, 10, 11, 12, 0, 0, 0]);
        assert_eq!(bar.read_bytes(4094, 4), [0, 0, 0xff, 0xff]);
        // Outside or misaligned: all-ones, writes dropped, no fault.
        assert_eq!(bar.read32(4096), u32::MAX);
        assert_eq!(bar.read64(4092), u64::MAX);
        assert_eq!(bar.read32(2), u32::MAX);
        bar.write32(usize::MAX - 1, 1);
        drop(bar);
        let bytes = std::fs::read(file.path()).unwrap();
        assert_eq!(&bytes[4..8], &0xdead_beef_u32.to_le_bytes());
        assert!(MappedBar::open(Path::new("/nonexistent/resource0")).unwrap_err().contains("resource0"));
    }
}
