//! Which devices a kernel module drives, from the module file itself: its `.modinfo`
//! section's `alias=pci:…` and `alias=virtio:…` patterns (what `modprobe` matches a
//! device's `modalias` against) and its `depends=` list. The agent leaves out a module
//! that drives devices none of which is here, and the modules only such modules need
//! ([`left_out`]): loading e1000e on a machine without one took 55 ms of every nested
//! boot, and the virtio chain (eight modules) more on every node without virtio-net.
//!
//! Written by hand: reading one ELF section and matching `*`/`?` patterns is less than a
//! crate (`object`, `globset`) would add to the static agent.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// What a module's `.modinfo` says about where it is needed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ModInfo {
    /// Its `alias=` patterns.
    pub aliases: Vec<String>,
    /// The modules it needs loaded first (`depends=`), by name.
    pub depends: Vec<String>,
}

impl ModInfo {
    /// Reads the `.modinfo` section of the module file at `path`.
    pub fn read(path: &Path) -> io::Result<ModInfo> {
        let file = File::open(path)?;
        Ok(ModInfo::parse(&modinfo_section(&file)?))
    }

    /// The entries of a `.modinfo` section (`key=value`, NUL-separated).
    pub fn parse(section: &[u8]) -> ModInfo {
        let mut info = ModInfo::default();
        for entry in section.split(|b| *b == 0).filter_map(|e| std::str::from_utf8(e).ok()) {
            if let Some(alias) = entry.strip_prefix("alias=") {
                info.aliases.push(alias.to_owned());
            } else if let Some(depends) = entry.strip_prefix("depends=") {
                info.depends.extend(depends.split(',').filter(|d| !d.is_empty()).map(module_name));
            }
        }
        info
    }

    /// Whether it drives devices of a bus the agent can see before loading anything: PCI,
    /// or virtio (whose devices appear behind a virtio PCI function).
    pub fn drives_devices(&self) -> bool {
        self.aliases.iter().any(|a| a.starts_with("pci:") || a.starts_with("virtio:"))
    }

    /// Whether a device it drives may be here: a `pci:` alias matches a present PCI
    /// device, or it has a `virtio:` alias and a virtio PCI function is present (which
    /// virtio devices it holds is known only once virtio_pci has probed it).
    pub fn drives_any_of(&self, pci_modaliases: &[String]) -> bool {
        let virtio_here = pci_modaliases.iter().any(|m| glob(VIRTIO_PCI_ALIAS.as_bytes(), m.as_bytes()));
        self.matches_any(pci_modaliases) || (virtio_here && self.aliases.iter().any(|a| a.starts_with("virtio:")))
    }

    /// Whether one of its aliases matches one of `modaliases`.
    pub fn matches_any(&self, modaliases: &[String]) -> bool {
        self.aliases.iter().any(|a| modaliases.iter().any(|m| glob(a.as_bytes(), m.as_bytes())))
    }
}

/// The modalias pattern of every virtio PCI function (Red Hat's virtio vendor ID).
const VIRTIO_PCI_ALIAS: &str = "pci:v00001AF4d*";

/// The names of the modules of `modules` (name, `.modinfo`; those the agent loads at
/// boot) to leave out: each that drives devices ([`ModInfo::drives_devices`]) none of
/// which is here, then each that only left-out modules depend on. A module that a kept
/// module, or one of `needed_elsewhere` (the names other modules of the image depend on:
/// those loaded on demand or the user's), depends on is kept; so is a module nothing
/// depends on that drives no devices (a library the image asked for by itself).
pub fn left_out(
    modules: &[(String, ModInfo)],
    present: &[String],
    needed_elsewhere: &HashSet<String>,
) -> HashSet<String> {
    let mut out: HashSet<String> = modules
        .iter()
        .filter(|(name, info)| {
            info.drives_devices() && !info.drives_any_of(present) && !needed_elsewhere.contains(name)
        })
        .map(|(name, _)| name.clone())
        .collect();
    fn dependents<'a>(modules: &'a [(String, ModInfo)], of: &'a str) -> impl Iterator<Item = &'a (String, ModInfo)> {
        modules.iter().filter(move |(_, info)| info.depends.iter().any(|d| d == of))
    }
    // Until nothing changes: a module a kept one needs comes back, a library only
    // left-out modules need goes. Each pass settles at least one more link of the longest
    // dependency chain, so as many passes as modules are enough.
    for _ in 0..=modules.len() {
        let mut changed = false;
        for (name, info) in modules {
            let needed_by_kept = dependents(modules, name).any(|(d, _)| !out.contains(d));
            if out.contains(name) && needed_by_kept {
                out.remove(name);
                changed = true;
            } else if !out.contains(name)
                && !info.drives_devices()
                && !needed_elsewhere.contains(name)
                && dependents(modules, name).next().is_some()
                && !needed_by_kept
            {
                out.insert(name.clone());
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    out
}

/// A module's name as the kernel knows it: `-` and `_` are the same, `_` it is.
pub fn module_name(name: &str) -> String {
    name.replace('-', "_")
}

/// The `modalias` of every PCI device under `devices` (`/sys/bus/pci/devices`).
pub fn pci_modaliases(devices: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(devices) else { return Vec::new() };
    entries
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("modalias")).ok())
        .map(|m| m.trim().to_owned())
        .collect()
}

/// `fnmatch(3)` for what module aliases use: `*` (any run), `?` (any byte), the rest
/// literal.
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    // Where the last `*` was, and the text position it has taken up to.
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p.min(pattern.len())..].iter().all(|&c| c == b'*')
}

/// The bytes of the `.modinfo` section of the ELF64 little-endian file `file`.
fn modinfo_section(file: &File) -> io::Result<Vec<u8>> {
    let bad = |why: &str| io::Error::new(io::ErrorKind::InvalidData, why.to_owned());
    let mut header = [0u8; 64];
    file.read_exact_at(&mut header, 0)?;
    if &header[..4] != b"\x7fELF" || header[4] != 2 || header[5] != 1 {
        return Err(bad("not a 64-bit little-endian ELF file"));
    }
    let u16_at = |b: &[u8], at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
    let u32_at = |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap_or_default());
    let (shoff, shentsize, shnum, shstrndx) = (
        u64_at(&header, 0x28),
        usize::from(u16_at(&header, 0x3a)),
        usize::from(u16_at(&header, 0x3c)),
        usize::from(u16_at(&header, 0x3e)),
    );
    if shentsize < 64 || shnum == 0 || shstrndx >= shnum || shnum > 4096 {
        return Err(bad("no usable section headers"));
    }
    let mut sections = vec![0u8; shentsize * shnum];
    file.read_exact_at(&mut sections, shoff)?;
    let section = |i: usize| {
        let s = &sections[i * shentsize..i * shentsize + 64];
        (u32_at(s, 0) as usize, u64_at(s, 0x18), u64_at(s, 0x20))
    };
    let read = |offset: u64, size: u64| -> io::Result<Vec<u8>> {
        let size = usize::try_from(size).ok().filter(|s| *s <= 64 << 20).ok_or_else(|| bad("section too big"))?;
        let mut data = vec![0u8; size];
        file.read_exact_at(&mut data, offset)?;
        Ok(data)
    };
    let (_, names_at, names_size) = section(shstrndx);
    let names = read(names_at, names_size)?;
    for i in 0..shnum {
        let (name, offset, size) = section(i);
        let name = names.get(name..).and_then(|n| n.split(|b| *b == 0).next()).unwrap_or_default();
        if name == b".modinfo" {
            return read(offset, size);
        }
    }
    Err(bad("no .modinfo section"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal ELF64 file with a `.modinfo` section holding `entries`.
    fn module(entries: &[&str]) -> Vec<u8> {
        let modinfo: Vec<u8> = entries.iter().flat_map(|e| e.bytes().chain([0])).collect();
        let names = b"\0.modinfo\0.shstrtab\0".to_vec();
        let (modinfo_at, names_at) = (64u64, 64 + modinfo.len() as u64);
        let shoff = names_at + names.len() as u64;
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&2u16.to_le_bytes());
        elf.extend(&modinfo);
        elf.extend(&names);
        let header = |name: u32, offset: u64, size: u64| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[0x18..0x20].copy_from_slice(&offset.to_le_bytes());
            h[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            h
        };
        elf.extend(header(0, 0, 0));
        elf.extend(header(1, modinfo_at, modinfo.len() as u64));
        elf.extend(header(10, names_at, names.len() as u64));
        elf
    }

    #[test]
    fn test_reads_aliases_and_depends_from_the_module_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e1000e.ko");
        let entries = ["license=GPL", "alias=pci:v00008086d000010D3sv*sd*bc*sc*i*", "depends=", "name=e1000e"];
        std::fs::write(&path, module(&entries)).unwrap();
        let info = ModInfo::read(&path).unwrap();
        assert_eq!(info.aliases, ["pci:v00008086d000010D3sv*sd*bc*sc*i*"]);
        assert!(info.depends.is_empty() && info.drives_devices());
        let kvm_amd = ModInfo::parse(b"alias=cpu:type:x86,ven*fam*mod*:feature:*0076*\0depends=kvm,ccp-x\0");
        assert_eq!(kvm_amd.depends, ["kvm", "ccp_x"]);
        assert!(!kvm_amd.drives_devices());
        std::fs::write(&path, b"not an elf file at all, not even close to one, really not at all").unwrap();
        assert!(ModInfo::read(&path).is_err());
    }

    #[test]
    fn test_aliases_match_modaliases_as_modprobe_does() {
        let e1000e = ModInfo::parse(b"alias=pci:v00008086d000010D3sv*sd*bc*sc*i*\0");
        let nic = "pci:v00008086d000010D3sv00008086sd0000A01Fbc02sc00i00".to_owned();
        let virtio = "pci:v00001AF4d00001041sv00001AF4sd00001100bc02sc00i00".to_owned();
        assert!(e1000e.matches_any(&[virtio.clone(), nic]));
        assert!(!e1000e.matches_any(&[virtio]));
        assert!(glob(b"a?c*", b"abcdef") && glob(b"*", b"") && glob(b"a*b*c", b"axxbyyc"));
        assert!(!glob(b"a*b", b"acd") && !glob(b"abc", b"ab") && !glob(b"ab", b"abc"));
    }

    /// The default image's boot modules, as their `.modinfo` has them (aliases shortened).
    fn virtio_chain() -> Vec<(String, ModInfo)> {
        [
            ("virtio_ring", ""),
            ("virtio_pci_modern_dev", ""),
            ("virtio_pci_legacy_dev", ""),
            ("virtio", ""),
            ("virtio_pci", "alias=pci:v00001AF4d*sv*sd*bc*sc*i*\0depends=virtio_pci_modern_dev,virtio_pci_legacy_dev,virtio_ring,virtio\0"),
            ("failover", ""),
            ("net_failover", "depends=failover\0"),
            ("virtio_net", "alias=virtio:d00000001v*\0depends=net_failover,virtio_ring,virtio\0"),
            ("e1000e", "alias=pci:v00008086d000010D3sv*sd*bc*sc*i*\0"),
            ("kvm_amd", "alias=cpu:type:x86,ven*fam*mod*:feature:*0076*\0depends=kvm,ccp\0"),
            ("kvm", ""),
            ("ccp", "alias=pci:v00001022d00001537sv*sd*bc*sc*i*\0"),
        ]
        .into_iter()
        .map(|(name, info)| (name.to_owned(), ModInfo::parse(info.as_bytes())))
        .collect()
    }

    fn sorted(set: HashSet<String>) -> Vec<String> {
        let mut v: Vec<String> = set.into_iter().collect();
        v.sort();
        v
    }

    #[test]
    fn test_modules_for_absent_devices_and_what_only_they_need_are_left_out() {
        let none = HashSet::new();
        // No device: the virtio chain and e1000e go; kvm_amd (a CPU driver) stays, and
        // with it kvm and ccp, which it needs although ccp's device is not here.
        let all_virtio = [
            "e1000e",
            "failover",
            "net_failover",
            "virtio",
            "virtio_net",
            "virtio_pci",
            "virtio_pci_legacy_dev",
            "virtio_pci_modern_dev",
            "virtio_ring",
        ];
        assert_eq!(sorted(left_out(&virtio_chain(), &[], &none)), all_virtio);
        // A virtio-net function: the chain stays, e1000e still goes.
        let virtio_net = "pci:v00001AF4d00001041sv00001AF4sd00001100bc02sc00i00".to_owned();
        assert_eq!(sorted(left_out(&virtio_chain(), &[virtio_net], &none)), ["e1000e"]);
        // A module loaded on demand that needs one keeps it, and what it needs.
        let rdma = HashSet::from(["virtio_net".to_owned()]);
        let out = left_out(&virtio_chain(), &[], &rdma);
        assert!(!out.contains("virtio_net") && !out.contains("net_failover") && !out.contains("failover"), "{out:?}");
        assert!(out.contains("virtio_pci") && out.contains("e1000e"), "{out:?}");
        // A driver whose device is here stays, though only a left-out module needs it;
        // and a left-out driver comes back for a kept module that needs it.
        let mut modules = virtio_chain();
        modules[4].1.depends.push("e1000e".into());
        modules.push(("e1000e_ptp".into(), ModInfo::parse(b"depends=virtio_net\0")));
        let e1000e = "pci:v00008086d000010D3sv00008086sd0000A01Fbc02sc00i00".to_owned();
        let out = left_out(&modules, &[e1000e], &none);
        assert!(out.contains("virtio_pci") && !out.contains("e1000e"), "{out:?}");
        assert!(!out.contains("virtio_net") && !out.contains("net_failover"), "{out:?}");
    }

    #[test]
    fn test_pci_modaliases_are_read_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("0000:00:03.0");
        std::fs::create_dir(&dev).unwrap();
        std::fs::write(dev.join("modalias"), "pci:v00008086d000010D3sv*\n").unwrap();
        std::fs::create_dir(dir.path().join("0000:00:04.0")).unwrap();
        assert_eq!(pci_modaliases(dir.path()), ["pci:v00008086d000010D3sv*"]);
        assert!(pci_modaliases(&dir.path().join("absent")).is_empty());
    }
}
