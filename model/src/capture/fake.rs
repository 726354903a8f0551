//! Test helper: the sysfs tree Linux shows in a guest that gdrvm boots on a node, written
//! from the model's own expectations (addresses, parents, IDs, links, ACS, ATS, NUMA) and
//! the node's BAR layout, so that a capture of it can be compared with the node. Tests
//! alter it to make hosts the node format cannot say everything about.

use std::fmt::Write as _;
use std::path::Path;

use crate::node::{Bar, Node};
use crate::Expectations;

/// `IORESOURCE_MEM`, `_PREFETCH`, `_MEM_64` and `_IO` as sysfs `resource` writes them.
const MEM: u64 = 0x200;
const PREFETCH: u64 = 0x2000;
const MEM_64: u64 = 0x10_0000;
const IO: u64 = 0x101;

/// One PCI function of the fake tree.
#[derive(Debug, Clone)]
pub(super) struct FakeFunction {
    /// `0000:03:00.0`.
    pub bdf: String,
    /// Its root bus (domain 0).
    pub root_bus: u8,
    /// The functions above it, nearest first.
    pub parents: Vec<String>,
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    pub subsystem: Option<(u16, u16)>,
    pub numa_node: i32,
    /// PCIe Device/Port Type; `None` for no PCIe capability.
    pub port_type: Option<u8>,
    /// `max_link_*` and `current_link_*` (width 0: down).
    pub link: Option<((String, u8), (String, u8))>,
    /// ACS Control, when it has ACS.
    pub acs: Option<u16>,
    pub ats: bool,
    pub msix: bool,
    /// Memory BARs.
    pub bars: Vec<Bar>,
    /// I/O BAR indices.
    pub io_bars: Vec<u8>,
    /// Its physical function, for a VF.
    pub physfn: Option<String>,
}

/// One NUMA node of the fake tree.
#[derive(Debug, Clone)]
pub(super) struct FakeNuma {
    pub cpus: Vec<u32>,
    pub memory: u64,
    pub distances: Vec<u8>,
}

/// A fake host: its PCI functions and NUMA nodes.
#[derive(Debug, Clone)]
pub(super) struct FakeHost {
    pub functions: Vec<FakeFunction>,
    pub numa: Vec<FakeNuma>,
    /// Config space length written (4096 as root, 64 as a user reads it).
    pub config_len: usize,
}

fn bus_of(bdf: &str) -> u8 {
    u8::from_str_radix(&bdf[5..7], 16).expect("a BDF")
}

impl FakeHost {
    /// What a guest booted on `node` sees.
    pub fn of(node: &Node) -> FakeHost {
        let expect = Expectations::new(node.cpus(), node.memory(), node);
        let functions = expect
            .pci
            .iter()
            .zip(&node.functions)
            .map(|(e, f)| FakeFunction {
                bdf: e.bdf.clone(),
                root_bus: bus_of(e.parents.last().unwrap_or(&e.bdf)),
                parents: e.parents.clone(),
                vendor: e.vendor,
                device: e.device,
                class: e.class,
                subsystem: e.subsystem,
                numa_node: e.numa_node,
                port_type: f.kind.pcie_port_type(),
                link: e.link.as_ref().map(|l| {
                    ((l.max_speed.clone(), l.max_width), l.current.clone().unwrap_or(("2.5 GT/s PCIe".into(), 0)))
                }),
                acs: e.acs.then_some(e.acs_control),
                ats: e.ats,
                msix: e.msix,
                bars: f.bars.clone(),
                io_bars: Vec::new(),
                physfn: None,
            })
            .collect();
        let numa = if expect.numa.is_empty() {
            vec![FakeNuma { cpus: (0..expect.cpus).collect(), memory: expect.memory_bytes, distances: vec![10] }]
        } else {
            expect
                .numa
                .iter()
                .map(|n| FakeNuma { cpus: n.cpus.clone(), memory: n.memory_bytes, distances: n.distances.clone() })
                .collect()
        };
        FakeHost { functions, numa, config_len: 4096 }
    }

    /// The function at `bdf`.
    pub fn function_mut(&mut self, bdf: &str) -> &mut FakeFunction {
        self.functions.iter_mut().find(|f| f.bdf == bdf).unwrap_or_else(|| panic!("no function {bdf}"))
    }

    /// Writes the tree below `root` (`root/sys/...`), with relative links as Linux has them.
    pub fn write(&self, root: &Path) {
        let sys = root.join("sys");
        let list = sys.join("bus/pci/devices");
        std::fs::create_dir_all(&list).unwrap();
        for f in &self.functions {
            let mut rel = format!("devices/pci0000:{:02x}", f.root_bus);
            for p in f.parents.iter().rev() {
                rel.push('/');
                rel.push_str(p);
            }
            rel.push('/');
            rel.push_str(&f.bdf);
            let dir = sys.join(&rel);
            std::fs::create_dir_all(&dir).unwrap();
            let (sv, sd) = f.subsystem.unwrap_or((0, 0));
            let mut files = vec![
                ("vendor", format!("{:#06x}", f.vendor)),
                ("device", format!("{:#06x}", f.device)),
                ("class", format!("{:#08x}", f.class)),
                ("subsystem_vendor", format!("{sv:#06x}")),
                ("subsystem_device", format!("{sd:#06x}")),
                ("numa_node", f.numa_node.to_string()),
                ("resource", resource(f)),
            ];
            if let Some(((ms, mw), (cs, cw))) = &f.link {
                files.push(("max_link_speed", ms.clone()));
                files.push(("max_link_width", mw.to_string()));
                files.push(("current_link_speed", cs.clone()));
                files.push(("current_link_width", cw.to_string()));
            }
            for (name, text) in files {
                std::fs::write(dir.join(name), format!("{text}\n")).unwrap();
            }
            let mut config = config(f);
            config.truncate(self.config_len);
            std::fs::write(dir.join("config"), config).unwrap();
            std::os::unix::fs::symlink(format!("../../../{rel}"), list.join(&f.bdf)).unwrap();
            if let Some(pf) = &f.physfn {
                std::os::unix::fs::symlink(format!("../{pf}"), dir.join("physfn")).unwrap();
            }
        }
        let nodes = sys.join("devices/system/node");
        let memory = sys.join("devices/system/memory");
        std::fs::create_dir_all(&memory).unwrap();
        // Linux's block size: 128M to 2G, here the largest that divides every node.
        let block = (27..=31).rev().map(|s| 1u64 << s).find(|b| self.numa.iter().all(|n| n.memory % b == 0));
        if let Some(block) = block {
            std::fs::write(memory.join("block_size_bytes"), format!("{block:x}\n")).unwrap();
        }
        let mut next_block = 0;
        for (i, n) in self.numa.iter().enumerate() {
            let dir = nodes.join(format!("node{i}"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("cpulist"), format!("{}\n", cpulist(&n.cpus))).unwrap();
            let row: Vec<String> = n.distances.iter().map(u8::to_string).collect();
            std::fs::write(dir.join("distance"), format!("{}\n", row.join(" "))).unwrap();
            // The kernel's own share is missing from MemTotal.
            let kib = (n.memory >> 10) / 100 * 97;
            std::fs::write(dir.join("meminfo"), format!("Node {i} MemTotal:       {kib} kB\nNode {i} MemFree: 0 kB\n"))
                .unwrap();
            for _ in 0..block.map_or(0, |b| n.memory / b) {
                let name = format!("memory{next_block}");
                std::os::unix::fs::symlink(format!("../../memory/{name}"), dir.join(&name)).unwrap();
                next_block += 1;
            }
        }
    }
}

/// `0-3,8` for CPUs 0, 1, 2, 3, 8.
fn cpulist(cpus: &[u32]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        let sep = if out.is_empty() { "" } else { "," };
        let _ = if i == j { write!(out, "{sep}{}", cpus[i]) } else { write!(out, "{sep}{}-{}", cpus[i], cpus[j]) };
        i = j + 1;
    }
    out
}

/// `resource`: BARs 0-5 and the ROM, `start end flags` in hex.
fn resource(f: &FakeFunction) -> String {
    let zero = (0u64, 0u64, 0u64);
    let mut lines = [zero; 7];
    for b in &f.bars {
        let flags = MEM | if b.prefetchable { PREFETCH } else { 0 } | if b.is_64bit { MEM_64 } else { 0 };
        lines[usize::from(b.index)] = (b.address, b.address + b.size - 1, flags);
    }
    for &i in &f.io_bars {
        lines[usize::from(i)] = (0xc000, 0xc01f, IO);
    }
    lines.iter().map(|(s, e, fl)| format!("{s:#018x} {e:#018x} {fl:#018x}")).collect::<Vec<_>>().join("\n")
}

/// A configuration space with the capabilities `f` has: PCIe (port type), MSI-X, then
/// ACS and ATS in extended space.
fn config(f: &FakeFunction) -> Vec<u8> {
    let mut c = vec![0u8; 4096];
    c[0..2].copy_from_slice(&f.vendor.to_le_bytes());
    c[2..4].copy_from_slice(&f.device.to_le_bytes());
    c[0x09..0x0c].copy_from_slice(&f.class.to_le_bytes()[..3]);
    c[0x0e] = u8::from(f.class >> 8 == 0x0604);
    let mut caps = Vec::new();
    if let Some(t) = f.port_type {
        caps.push((0x40, 0x10u8, 0x02 | t << 4));
    }
    if f.msix {
        caps.push((0x80, 0x11, 0));
    }
    if let Some(&(first, ..)) = caps.first() {
        c[0x06] = 0x10;
        c[0x34] = first;
    }
    for (k, &(at, id, flags)) in caps.iter().enumerate() {
        let at = usize::from(at);
        c[at] = id;
        c[at + 1] = caps.get(k + 1).map_or(0, |n| n.0);
        c[at + 2] = flags;
    }
    let mut ext: Vec<(u16, u16)> = Vec::new();
    if let Some(control) = f.acs {
        ext.push((0x000d, control));
    }
    if f.ats {
        ext.push((0x000f, 0));
    }
    for (k, &(id, control)) in ext.iter().enumerate() {
        let at = 0x100 + 0x40 * k;
        let next = if k + 1 < ext.len() { (at + 0x40) as u32 } else { 0 };
        c[at..at + 4].copy_from_slice(&(u32::from(id) | 1 << 16 | next << 20).to_le_bytes());
        c[at + 6..at + 8].copy_from_slice(&control.to_le_bytes());
    }
    c
}
