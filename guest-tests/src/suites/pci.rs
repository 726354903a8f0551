//! The PCI half of `topology`: every PCI function Linux found (sysfs) against the VMM's
//! expectations (IDs, class, place in the tree, NUMA node, link, ACS, ATS, MSI-X), the tree as
//! Linux sees it, and NCCL's path type and GPUDirect RDMA decision for every GPU-NIC and
//! GPU-GPU pair, computed from sysfs with NCCL's rules ([`gdrvm_model::nccl`]).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use gdrvm_model::nccl::{self, PathType, PciDevice};
use gdrvm_model::{LinkExpectation, PciExpectation};

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::pcidev::{ext_capability_control, find_capability, find_ext_capability, is_bdf};

const SYSFS_PCI: &str = "/sys/bus/pci/devices";
const CAP_ID_MSIX: u8 = 0x11;
const EXT_CAP_ID_ACS: u16 = 0x000d;
const EXT_CAP_ID_ATS: u16 = 0x000f;

/// A PCI function as sysfs shows it.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    bdf: String,
    /// BDFs from the root bus down to this one (its `/sys/devices` path).
    path: Vec<String>,
    vendor: u16,
    device: u16,
    class: u32,
    subsystem: (u16, u16),
    numa_node: i32,
    /// `max_link_speed`, `max_link_width` (PCIe functions only).
    max_link: Option<(String, u8)>,
    /// `current_link_*`; `None` when the link is down (width 0).
    current_link: Option<(String, u8)>,
    /// The ACS Control register, when the ACS capability is there.
    acs: Option<u16>,
    ats: bool,
    msix: bool,
    /// Memory resources from sysfs `resource`, by BAR index: (start, size).
    bars: BTreeMap<u8, (u64, u64)>,
}

impl Seen {
    fn depth(&self) -> usize {
        self.path.len().saturating_sub(1)
    }

    fn nccl(&self) -> PciDevice {
        PciDevice { bdf: self.bdf.clone(), path: self.path.clone(), numa_node: self.numa_node }
    }

    fn is_gpu(&self) -> bool {
        self.class >> 16 == 0x03
    }

    fn is_nic(&self) -> bool {
        self.class >> 16 == 0x02
    }

    fn bandwidth(&self) -> Option<f64> {
        self.current_link.as_ref().and_then(|(speed, width)| nccl::link_bandwidth(speed, u32::from(*width)))
    }

    /// One line of the tree.
    fn describe(&self) -> String {
        let link = match (&self.current_link, &self.max_link) {
            (Some((s, w)), Some((ms, mw))) => format!(" link {s} x{w} of {ms} x{mw}"),
            (None, Some((ms, mw))) => format!(" link down of {ms} x{mw}"),
            _ => String::new(),
        };
        let flag = |b: bool| if b { '+' } else { '-' };
        format!(
            "pci {:indent$}{} [{:04x}:{:04x}] class {:06x} numa {}{link} ACS{} ATS{} MSI-X{}",
            "",
            self.bdf,
            self.vendor,
            self.device,
            self.class,
            self.numa_node,
            flag(self.acs.is_some()),
            flag(self.ats),
            flag(self.msix),
            indent = 2 * self.depth()
        )
    }
}

fn read_hex(dir: &Path, file: &str) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join(file)).ok()?;
    u64::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

fn read_text(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_owned())
}

/// Capabilities from the raw configuration space (`config`, 4 KiB when readable): ACS (its
/// control register), ATS, MSI-X.
fn capabilities(config: &[u8]) -> (Option<u16>, bool, bool) {
    let acs = ext_capability_control(config, EXT_CAP_ID_ACS);
    let ats = find_ext_capability(config, EXT_CAP_ID_ATS).is_some();
    (acs, ats, find_capability(config, CAP_ID_MSIX).is_some())
}

/// BARs 0-5 from sysfs `resource` ("start end flags" per line, zeros when unused).
fn read_bars(dir: &Path) -> BTreeMap<u8, (u64, u64)> {
    let text = read_text(dir, "resource").unwrap_or_default();
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    (0u8..6)
        .zip(text.lines())
        .filter_map(|(i, line)| {
            let mut w = line.split_whitespace();
            let (start, end) = (hex(w.next()?)?, hex(w.next()?)?);
            (end > start).then_some((i, (start, end - start + 1)))
        })
        .collect()
}

/// The functions from the root bus down to `bdf` (the BDFs of its `/sys/devices` path), or
/// `None` when sysfs has no such function.
fn sysfs_path(ctx: &Context, bdf: &str) -> Option<Vec<String>> {
    let real = std::fs::canonicalize(ctx.path(&format!("{SYSFS_PCI}/{bdf}"))).ok()?;
    Some(real.components().filter_map(|c| c.as_os_str().to_str()).filter(|c| is_bdf(c)).map(str::to_owned).collect())
}

/// Function `bdf` as NCCL reads it from sysfs (for suites that type paths between devices
/// they found elsewhere, such as CUDA's), or `None` when sysfs has no such function.
pub(super) fn nccl_device(ctx: &Context, bdf: &str) -> Option<PciDevice> {
    let path = sysfs_path(ctx, bdf)?;
    let dir = ctx.path(&format!("{SYSFS_PCI}/{bdf}"));
    let numa_node = read_text(&dir, "numa_node").and_then(|n| n.parse().ok()).unwrap_or(-1);
    Some(PciDevice { bdf: bdf.to_owned(), path, numa_node })
}

fn read_function(ctx: &Context, bdf: &str) -> Option<Seen> {
    let dir = ctx.path(&format!("{SYSFS_PCI}/{bdf}"));
    let path = sysfs_path(ctx, bdf)?;
    let link = |speed: &str, width: &str| -> Option<(String, u8)> {
        let w: u8 = read_text(&dir, width)?.parse().ok()?;
        let s = read_text(&dir, speed)?;
        (w > 0 && !s.starts_with("Unknown")).then_some((s, w))
    };
    let (acs, ats, msix) = capabilities(&std::fs::read(dir.join("config")).unwrap_or_default());
    Some(Seen {
        bdf: bdf.to_owned(),
        path,
        vendor: read_hex(&dir, "vendor")? as u16,
        device: read_hex(&dir, "device")? as u16,
        class: read_hex(&dir, "class")? as u32,
        subsystem: (
            read_hex(&dir, "subsystem_vendor").unwrap_or(0) as u16,
            read_hex(&dir, "subsystem_device").unwrap_or(0) as u16,
        ),
        numa_node: read_text(&dir, "numa_node").and_then(|n| n.parse().ok()).unwrap_or(-1),
        max_link: link("max_link_speed", "max_link_width"),
        current_link: link("current_link_speed", "current_link_width"),
        acs,
        ats,
        msix,
        bars: read_bars(&dir),
    })
}

/// Every function in sysfs, by BDF.
fn read_all(ctx: &Context) -> BTreeMap<String, Seen> {
    let Ok(entries) = std::fs::read_dir(ctx.path(SYSFS_PCI)) else {
        return BTreeMap::new();
    };
    let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    names.iter().filter_map(|bdf| read_function(ctx, bdf)).map(|f| (f.bdf.clone(), f)).collect()
}

/// The link a node file captured from a host gives a device that reports none (see
/// `gdrvm topology capture`): not a link to hold the host to.
const CAPTURE_PLACEHOLDER_LINK: (&str, u8) = ("2.5 GT/s PCIe", 1);

/// What differs between an expected function and what sysfs shows. `host`: a host checked
/// against a node file ([`gdrvm_model::Expectations::host`]), where the host bridge
/// function's IDs are the node format's own, a device on a one-NUMA-node host may have
/// no affinity (-1), and a device without a link has the capture's placeholder.
fn differences(want: &PciExpectation, seen: &Seen, host: Option<usize>) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |what: &str, want: String, seen: String| {
        if want != seen {
            out.push(format!("{what} {seen}, expected {want}"));
        }
    };
    if !(host.is_some() && want.kind == "host_bridge") {
        check(
            "IDs",
            format!("{:04x}:{:04x}", want.vendor, want.device),
            format!("{:04x}:{:04x}", seen.vendor, seen.device),
        );
    }
    check("class", format!("{:06x}", want.class), format!("{:06x}", seen.class));
    let sub = want.subsystem.unwrap_or((0, 0));
    check(
        "subsystem",
        format!("{:04x}:{:04x}", sub.0, sub.1),
        format!("{:04x}:{:04x}", seen.subsystem.0, seen.subsystem.1),
    );
    let parents: Vec<&str> = seen.path.iter().rev().skip(1).map(String::as_str).collect();
    check("parents", want.parents.join(" < "), parents.join(" < "));
    let one_node_host = host.is_some_and(|numa_nodes| numa_nodes <= 1);
    if !(one_node_host && seen.numa_node == -1) {
        check("numa_node", want.numa_node.to_string(), seen.numa_node.to_string());
    }
    let show = |l: &Option<(String, u8)>| l.as_ref().map_or("none".to_owned(), |(s, w)| format!("{s} x{w}"));
    let (max, current) = match &want.link {
        Some(LinkExpectation { max_speed, max_width, .. })
            if host.is_some()
                && seen.max_link.is_none()
                && (max_speed.as_str(), *max_width) == CAPTURE_PLACEHOLDER_LINK =>
        {
            (None, None)
        }
        Some(LinkExpectation { max_speed, max_width, current }) => {
            (Some((max_speed.clone(), *max_width)), current.clone())
        }
        None => (None, None),
    };
    check("max link", show(&max), show(&seen.max_link));
    match (&current, &seen.current_link) {
        // A host's devices retrain their links as they work and idle (a GPU at rest runs
        // at 2.5 GT/s): slower than captured is the host suite's note, narrower a failure.
        (Some((_, want_width)), Some((_, width))) if host.is_some() && want_width == width => {}
        _ => check("current link", show(&current), show(&seen.current_link)),
    }
    check("ACS", want.acs.to_string(), seen.acs.is_some().to_string());
    if let Some(control) = seen.acs.filter(|_| want.acs) {
        check("ACS control", format!("{:#06x}", want.acs_control), format!("{control:#06x}"));
    }
    check("ATS", want.ats.to_string(), seen.ats.to_string());
    check("MSI-X", want.msix.to_string(), seen.msix.to_string());
    for bar in &want.bars {
        let size = seen.bars.get(&bar.index).map_or(0, |(_, size)| *size);
        check(&format!("BAR{} size", bar.index), bar.size.to_string(), size.to_string());
    }
    out
}

/// BARs at the address the VMM gave them, and BARs Linux moved.
fn bar_placement(expect: &[PciExpectation], seen: &BTreeMap<String, Seen>) -> (usize, usize) {
    let (mut kept, mut moved) = (0, 0);
    for want in expect {
        for bar in &want.bars {
            match seen.get(&want.bdf).and_then(|s| s.bars.get(&bar.index)) {
                Some((start, _)) if *start == bar.address => kept += 1,
                Some(_) => moved += 1,
                None => {}
            }
        }
    }
    (kept, moved)
}

/// The PCI checks of `topology`.
pub fn run(ctx: &Context) -> Vec<Check> {
    let seen = read_all(ctx);
    let expect = ctx.expect.as_ref().filter(|e| !e.pci.is_empty());
    let mut tree = Check::new(
        "pci_functions",
        match expect {
            None => Verdict::Skip("no PCI expectations (not a gdrvm guest)".into()),
            Some(e) => {
                let want: BTreeSet<&str> = e.pci.iter().map(|p| p.bdf.as_str()).collect();
                let have: BTreeSet<&str> = seen.keys().map(String::as_str).collect();
                let missing: Vec<&&str> = want.difference(&have).collect();
                let extra: Vec<&&str> = have.difference(&want).collect();
                if missing.is_empty() && (extra.is_empty() || e.host) {
                    Verdict::Pass
                } else {
                    Verdict::Fail(format!("missing {missing:?}, unexpected {extra:?}"))
                }
            }
        },
    );
    tree.diagnostics.push(format!("{} PCI functions", seen.len()));
    if let Some(e) = expect.filter(|e| e.host) {
        let want: BTreeSet<&str> = e.pci.iter().map(|p| p.bdf.as_str()).collect();
        let beside: Vec<&str> = seen.keys().map(String::as_str).filter(|b| !want.contains(b)).collect();
        if !beside.is_empty() {
            tree.diagnostics.push(format!("not in the node file (left out by a capture): {}", beside.join(", ")));
        }
    }
    // A host's firmware placed its BARs, not a VMM: a capture records sizes, not addresses.
    if let Some(e) = expect.filter(|e| !e.host) {
        let (kept, moved) = bar_placement(&e.pci, &seen);
        tree.diagnostics.push(format!("BARs: {kept} where the VMM put them, {moved} moved by Linux"));
    }
    tree.diagnostics.extend(seen.values().map(Seen::describe));
    let mut checks = vec![tree];

    for want in expect.map(|e| e.pci.as_slice()).unwrap_or_default() {
        let name = format!("pci_{}_{}", want.bdf.trim_start_matches("0000:"), want.name);
        checks.push(Check::new(
            &name,
            match seen.get(&want.bdf) {
                None => Verdict::Fail(format!("{} ({}) is not in sysfs", want.bdf, want.name)),
                Some(s) => match differences(want, s, expect.filter(|e| e.host).map(|e| e.numa.len())) {
                    d if d.is_empty() => Verdict::Pass,
                    d => Verdict::Fail(d.join("; ")),
                },
            },
        ));
    }
    checks.extend(nccl_checks(ctx, &seen));
    checks.extend(nccl_ib_devices(ctx, &seen));
    checks
}

/// Where NCCL finds each RDMA device (`/sys/class/infiniband`): NCCL takes the device's
/// PCI path from its sysfs parent. Soft-RoCE devices have none on 6.x kernels (upstream
/// removed `dev.parent` of software drivers in 5.11), so NCCL itself places them on no PCI
/// switch and turns GPUDirect RDMA off through them; that is said in the diagnostics. The
/// check is where the device really sits: its parent, or its network interface's PCI
/// function, which must be a NIC of the node file.
fn nccl_ib_devices(ctx: &Context, seen: &BTreeMap<String, Seen>) -> Vec<Check> {
    use super::rdma::ibdev;
    let gpus: Vec<&Seen> = seen.values().filter(|s| s.is_gpu()).collect();
    ibdev::devices(&ctx.root)
        .into_iter()
        .map(|dev| {
            let name = format!("nccl_ib_{dev}");
            let own =
                crate::pcidev::pci_function_of(&ctx.root, &ctx.root.join(format!("sys/class/infiniband/{dev}/device")));
            let mut notes = vec![match &own {
                Some((bdf, _)) => format!("NCCL finds {dev} at {bdf} (its sysfs parent)"),
                None => format!(
                    "NCCL finds no PCI path for {dev}: it has no sysfs parent (a software device), so NCCL puts \
                     it under no PCI switch and GPUDirect RDMA is off through it"
                ),
            }];
            let parent = match ibdev::pci_parent(&ctx.root, &dev) {
                Ok(p) => p,
                Err(e) => return Check::new(&name, Verdict::Fail(e)),
            };
            notes.push(parent.via.clone());
            let Some(nic) = seen.get(&parent.bdf).filter(|s| s.is_nic()) else {
                return Check {
                    diagnostics: notes,
                    ..Check::new(
                        &name,
                        Verdict::Fail(format!("{dev} sits on {}, which is not a NIC function", parent.bdf)),
                    )
                };
            };
            for gpu in &gpus {
                let path = nccl::path_type(&gpu.nccl(), &nic.nccl());
                notes.push(format!(
                    "nccl gpu {} ib {dev} at {} {path} gdr {}",
                    gpu.bdf,
                    nic.bdf,
                    if path.gdr() && own.is_some() {
                        "on"
                    } else if path.gdr() {
                        "on by its place, off in NCCL (no PCI path)"
                    } else {
                        "off"
                    }
                ));
            }
            let named = ctx.expect.as_ref().and_then(|e| e.pci.iter().find(|p| p.bdf == parent.bdf));
            let verdict = match (ctx.expect.as_ref(), named) {
                (None, _) => Verdict::Pass,
                (Some(_), Some(f)) => {
                    notes.push(format!("{} is {} ({}) in the node file", parent.bdf, f.name, f.kind));
                    Verdict::Pass
                }
                (Some(_), None) => {
                    Verdict::Fail(format!("{dev} sits on {}, which the node file does not have", parent.bdf))
                }
            };
            Check { diagnostics: notes, ..Check::new(&name, verdict) }
        })
        .collect()
}

/// NCCL's view from sysfs: every GPU-NIC and GPU-GPU path, checked against expectations.
fn nccl_checks(ctx: &Context, seen: &BTreeMap<String, Seen>) -> Vec<Check> {
    let gpus: Vec<&Seen> = seen.values().filter(|s| s.is_gpu()).collect();
    let nics: Vec<&Seen> = seen.values().filter(|s| s.is_nic()).collect();
    let mut lines = Vec::new();
    let mut found: BTreeMap<(String, String), PathType> = BTreeMap::new();
    let mut gdr_pairs = 0;
    for (n, gpu) in gpus.iter().enumerate() {
        for (other, is_nic) in nics.iter().map(|o| (o, true)).chain(gpus[n + 1..].iter().map(|o| (o, false))) {
            let path = nccl::path_type(&gpu.nccl(), &other.nccl());
            let bw = gpu.bandwidth().zip(other.bandwidth()).map(|(a, b)| a.min(b));
            let gdr = if is_nic {
                gdr_pairs += usize::from(path.gdr());
                if path.gdr() {
                    " gdr on"
                } else {
                    " gdr off"
                }
            } else {
                ""
            };
            lines.push(format!(
                "nccl gpu {} {} {} {path}{gdr} bw {}",
                gpu.bdf,
                if is_nic { "nic" } else { "gpu" },
                other.bdf,
                bw.map_or("unknown".into(), |b| format!("{b:.1} GB/s"))
            ));
            found.insert((gpu.bdf.clone(), other.bdf.clone()), path);
        }
    }
    let pairs = gpus.len() * nics.len();
    let expect = ctx.expect.as_ref().filter(|e| !e.pci.is_empty());
    let want_gdr = expect.map(|e| e.paths.iter().filter(|p| p.gdr == Some(true)).count());
    let mut summary = Check::new(
        "nccl_gdr",
        match want_gdr {
            None => Verdict::Skip("no expectations: see the diagnostics for what NCCL would do".into()),
            Some(w) if w == gdr_pairs => Verdict::Pass,
            Some(w) => Verdict::Fail(format!("GDR on for {gdr_pairs} GPU-NIC pairs, expected {w}")),
        },
    );
    summary.diagnostics = lines;
    summary.diagnostics.push(format!(
        "GDR on for {gdr_pairs} of {pairs} GPU-NIC pairs ({} GPUs, {} NICs)",
        gpus.len(),
        nics.len()
    ));
    let mut checks = vec![summary];
    for p in expect.map(|e| e.paths.as_slice()).unwrap_or_default() {
        let name = format!("nccl_{}_{}", p.a.trim_start_matches("0000:"), p.b.trim_start_matches("0000:"));
        let verdict = match found.get(&(p.a.clone(), p.b.clone())) {
            None => Verdict::Fail(format!("{} or {} is not a GPU/NIC in sysfs", p.a, p.b)),
            Some(t) if *t == p.path => Verdict::Pass,
            Some(t) => Verdict::Fail(format!("NCCL path {t}, expected {}", p.path)),
        };
        checks.push(Check::new(&name, verdict));
    }
    checks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_capability_walk() {
        let mut config = vec![0u8; 4096];
        config[0x06] = 0x10;
        config[0x34] = 0x40;
        config[0x40] = 0x10;
        config[0x41] = 0x80;
        config[0x80] = CAP_ID_MSIX;
        config[0x100..0x104].copy_from_slice(&(u32::from(EXT_CAP_ID_ATS) | (1 << 16) | (0x140 << 20)).to_le_bytes());
        config[0x140..0x144].copy_from_slice(&(u32::from(EXT_CAP_ID_ACS) | (1 << 16)).to_le_bytes());
        config[0x146] = 0x1c;
        assert_eq!(capabilities(&config), (Some(0x1c), true, true));
        // 256 bytes only (no extended space), a looping list: no hang, no extended caps.
        let mut short = config[..256].to_vec();
        short[0x81] = 0x40;
        assert_eq!(capabilities(&short), (None, false, true));
        assert_eq!(capabilities(&[]), (None, false, false));
    }

    /// A sysfs tree (devices under `/sys/devices/pci0000:BB/...`, links in `/sys/bus/pci/devices`)
    /// holding what `expect` promises, with `alter` applied to each function's files.
    fn fake_sysfs(
        expect: &gdrvm_model::Expectations,
        alter: impl Fn(&str, &mut BTreeMap<&str, String>),
    ) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let links = dir.path().join("sys/bus/pci/devices");
        std::fs::create_dir_all(&links).unwrap();
        for f in &expect.pci {
            let mut path = dir.path().join("sys/devices/pci0000:00");
            for p in f.parents.iter().rev() {
                path.push(p);
            }
            path.push(&f.bdf);
            std::fs::create_dir_all(&path).unwrap();
            let mut files = BTreeMap::new();
            files.insert("vendor", format!("{:#06x}", f.vendor));
            files.insert("device", format!("{:#06x}", f.device));
            files.insert("class", format!("{:#08x}", f.class));
            let sub = f.subsystem.unwrap_or((0, 0));
            files.insert("subsystem_vendor", format!("{:#06x}", sub.0));
            files.insert("subsystem_device", format!("{:#06x}", sub.1));
            files.insert("numa_node", f.numa_node.to_string());
            if let Some(l) = &f.link {
                files.insert("max_link_speed", l.max_speed.clone());
                files.insert("max_link_width", l.max_width.to_string());
                let (s, w) = l.current.clone().unwrap_or(("2.5 GT/s PCIe".into(), 0));
                files.insert("current_link_speed", s);
                files.insert("current_link_width", w.to_string());
            }
            let mut resource = vec!["0x0000000000000000 0x0000000000000000 0x0000000000000000".to_owned(); 6];
            for b in &f.bars {
                resource[usize::from(b.index)] =
                    format!("{:#018x} {:#018x} 0x0000000000040200", b.address, b.address + b.size - 1);
            }
            files.insert("resource", resource.join("\n"));
            alter(&f.bdf, &mut files);
            for (name, text) in files {
                std::fs::write(path.join(name), format!("{text}\n")).unwrap();
            }
            let mut config = vec![0u8; 4096];
            config[0x06] = 0x10;
            config[0x34] = 0x40;
            config[0x40] = 0x10;
            if f.msix {
                config[0x41] = 0x80;
                config[0x80] = CAP_ID_MSIX;
            }
            let ext = if f.acs {
                EXT_CAP_ID_ACS
            } else if f.ats {
                EXT_CAP_ID_ATS
            } else {
                0
            };
            if ext != 0 {
                config[0x100..0x104].copy_from_slice(&(u32::from(ext) | (1 << 16)).to_le_bytes());
                config[0x106..0x108].copy_from_slice(&f.acs_control.to_le_bytes());
            }
            std::fs::write(path.join("config"), config).unwrap();
            std::os::unix::fs::symlink(&path, links.join(&f.bdf)).unwrap();
        }
        dir
    }

    fn checks_on(preset: &str, alter: impl Fn(&str, &mut BTreeMap<&str, String>)) -> Vec<Check> {
        let node = gdrvm_model::node::Node::preset(preset).unwrap().unwrap().scaled(Some(2), Some(1 << 30)).unwrap();
        let expect = gdrvm_model::Expectations::new(2, 1 << 30, &node);
        let root = fake_sysfs(&expect, alter);
        let ctx = Context {
            expect: Some(expect),
            image: None,
            root: root.path().to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        };
        run(&ctx)
    }

    fn failed(checks: &[Check]) -> Vec<(String, String)> {
        checks
            .iter()
            .filter_map(|c| match &c.verdict {
                Verdict::Fail(why) => Some((c.name.clone(), why.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn test_sysfs_as_promised_passes_and_nccl_sees_pix() {
        let checks = checks_on("minimal", |_, _| {});
        assert_eq!(failed(&checks), []);
        let tree = checks.iter().find(|c| c.name == "pci_functions").unwrap();
        assert_eq!(tree.diagnostics[1], "BARs: 4 where the VMM put them, 0 moved by Linux");
        let gdr = checks.iter().find(|c| c.name == "nccl_gdr").unwrap();
        assert_eq!(gdr.diagnostics[0], "nccl gpu 0000:03:00.0 nic 0000:04:00.0 PIX gdr on bw 24.0 GB/s");
        let flat = checks_on("flat", |_, _| {});
        assert_eq!(failed(&flat), []);
        let gdr = flat.iter().find(|c| c.name == "nccl_gdr").unwrap();
        assert!(gdr.diagnostics.iter().all(|l| !l.contains("gdr on")), "{gdr:?}");
    }

    /// A host checked against its own capture: a function the capture left out, the node
    /// format's host bridge IDs, no NUMA affinity on a one-node host and the placeholder link
    /// of a device that reports none are noted, not failed; in a guest each fails.
    #[test]
    fn test_a_host_against_its_capture_tolerates_only_what_a_capture_cannot_say() {
        let text = "name = \"h\"\n[[numa]]\ncpus = 2\nmemory = \"1G\"\n[[host_bridge]]\nname = \"hb0\"\nnuma = 0\n\
                    [[endpoint]]\nname = \"nic0\"\nkind = \"nic\"\nparent = \"hb0\"\nvendor = 0x1af4\ndevice = 0x1041\n\
                    link = \"2.5GT/s x1\"\n";
        let node = gdrvm_model::node::Node::parse("test", text).unwrap();
        let guest = gdrvm_model::Expectations::new(2, 1 << 30, &node);
        let hb_bdf = guest.pci.iter().find(|p| p.kind == "host_bridge").unwrap().bdf.clone();
        // The host: another host bridge function, no NUMA, no link, one function more.
        let mut seen = guest.clone();
        seen.pci.push(PciExpectation { bdf: "0000:00:1f.0".into(), link: None, ..guest.pci[1].clone() });
        let root = fake_sysfs(&seen, |bdf, files| {
            files.insert("numa_node", "-1".into());
            files.remove("max_link_speed");
            files.remove("current_link_speed");
            if bdf == hb_bdf {
                files.insert("vendor", "0x8086".into());
                files.insert("device", "0x0d57".into());
            }
        });
        let ctx = |host: bool| Context {
            expect: Some(gdrvm_model::Expectations { host, ..guest.clone() }),
            image: None,
            root: root.path().to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        };
        let checks = run(&ctx(true));
        assert_eq!(failed(&checks), []);
        let tree = checks.iter().find(|c| c.name == "pci_functions").unwrap();
        assert!(tree.diagnostics.iter().any(|d| d.contains("left out by a capture): 0000:00:1f.0")), "{tree:?}");
        assert!(!tree.diagnostics.iter().any(|d| d.starts_with("BARs: ")), "{tree:?}");
        let as_guest: Vec<String> = failed(&run(&ctx(false))).into_iter().map(|(name, _)| name).collect();
        assert_eq!(as_guest.len(), 3, "{as_guest:?}");
    }

    #[test]
    fn test_a_host_link_may_run_slower_than_captured_but_not_narrower() {
        let node = gdrvm_model::node::Node::preset("minimal").unwrap().unwrap().scaled(Some(2), Some(1 << 30)).unwrap();
        let host = gdrvm_model::Expectations { host: true, ..gdrvm_model::Expectations::new(2, 1 << 30, &node) };
        let on_host = |alter: &dyn Fn(&str, &mut BTreeMap<&str, String>)| {
            let root = fake_sysfs(&host, alter);
            let ctx = Context {
                expect: Some(host.clone()),
                image: None,
                root: root.path().to_owned(),
                kernel_log: Ok(String::new()),
                module_errors: vec![],
                modules_left_out: vec![],
            };
            failed(&run(&ctx))
        };
        // The GPU idles at 2.5 GT/s, otherwise as captured: nothing fails.
        let idle = |bdf: &str, f: &mut BTreeMap<&str, String>| {
            if bdf == "0000:03:00.0" {
                f.insert("current_link_speed", "2.5 GT/s PCIe".into());
            }
        };
        assert_eq!(on_host(&idle), []);
        // Its link trained to x8: a finding.
        let narrow = |bdf: &str, f: &mut BTreeMap<&str, String>| {
            if bdf == "0000:03:00.0" {
                f.insert("current_link_width", "8".into());
            }
        };
        assert_eq!(
            on_host(&narrow),
            [("pci_03:00.0_gpu0".to_owned(), "current link 16.0 GT/s PCIe x8, expected 16.0 GT/s PCIe x16".to_owned())]
        );
    }

    #[test]
    fn test_a_narrow_link_and_a_moved_numa_node_fail_by_function() {
        let checks = checks_on("minimal", |bdf, files| {
            if bdf == "0000:03:00.0" {
                files.insert("current_link_width", "1".into());
                files.insert("numa_node", "-1".into());
            }
        });
        assert_eq!(
            failed(&checks),
            [(
                "pci_03:00.0_gpu0".to_owned(),
                "numa_node -1, expected 0; current link 16.0 GT/s PCIe x1, expected 16.0 GT/s PCIe x16".to_owned()
            )]
        );
    }

    #[test]
    fn test_a_wrong_bar_size_fails_and_a_moved_bar_is_counted() {
        let checks = checks_on("minimal", |bdf, files| {
            if bdf == "0000:04:00.0" {
                // The NIC's 2 MiB BAR0 seen as 1 MiB.
                files.insert("resource", "0x0000004100000000 0x00000041000fffff 0x0000000000140204".into());
            }
            if bdf == "0000:03:00.0" {
                // Linux moved the GPU's 16 MiB BAR0 (same size).
                let r = files["resource"].replacen(
                    "0x00000000c0000000 0x00000000c0ffffff",
                    "0x00000000c1000000 0x00000000c1ffffff",
                    1,
                );
                files.insert("resource", r);
            }
        });
        assert_eq!(
            failed(&checks),
            [("pci_04:00.0_nic0".to_owned(), "BAR0 size 1048576, expected 2097152".to_owned())]
        );
        let tree = checks.iter().find(|c| c.name == "pci_functions").unwrap();
        assert_eq!(tree.diagnostics[1], "BARs: 2 where the VMM put them, 2 moved by Linux");
    }

    /// `pci::run` on `preset`'s sysfs as one `topology` KTAP document; `expect: false` is a
    /// bare-metal run (sysfs alone).
    fn topology_ktap(preset: &str, expect: bool) -> String {
        let node = gdrvm_model::node::Node::preset(preset).unwrap().unwrap().scaled(Some(2), Some(1 << 30)).unwrap();
        let expectations = gdrvm_model::Expectations::new(2, 1 << 30, &node);
        let root = fake_sysfs(&expectations, |_, _| {});
        let ctx = Context {
            expect: expect.then_some(expectations),
            image: None,
            root: root.path().to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        };
        crate::ktap::render(&[crate::ktap::SuiteReport { name: "topology".into(), checks: run(&ctx) }])
    }

    #[test]
    fn test_bare_metal_prints_every_pair_from_sysfs() {
        let ktap = topology_ktap("vela-a100", false);
        let pairs: Vec<&str> = ktap.lines().filter(|l| l.starts_with("    # nccl gpu ")).collect();
        // 8 GPUs: 8 x 2 GPU-NIC pairs and 28 GPU-GPU pairs, by BDF and kind.
        assert_eq!(pairs.len(), 16 + 28, "{ktap}");
        assert!(pairs.contains(&"    # nccl gpu 0000:03:00.0 nic 0000:05:00.0 PIX gdr on bw 24.0 GB/s"), "{ktap}");
        assert!(pairs.contains(&"    # nccl gpu 0000:03:00.0 gpu 0000:11:00.0 SYS bw 24.0 GB/s"), "{ktap}");
        assert!(ktap.contains("ok 1 pci_functions # SKIP no PCI expectations"), "{ktap}");
    }

    /// The KTAP fixtures `cargo xtask parity` is tested with (`tests/fixtures/parity/`) are
    /// this agent's output: a bare-metal run on vela-a100's tree (the host) and a guest booted
    /// on `flat` (the deliberately flattened guest). `GDRVM_UPDATE_FIXTURES=1` rewrites them.
    #[test]
    fn test_parity_fixtures_are_agent_output() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/parity");
        for (file, preset, expect) in [("vela-a100-host.ktap", "vela-a100", false), ("flat-guest.ktap", "flat", true)] {
            let ktap = topology_ktap(preset, expect);
            let path = dir.join(file);
            if std::env::var_os("GDRVM_UPDATE_FIXTURES").is_some() {
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(&path, &ktap).unwrap();
            }
            let stored = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                stored == ktap,
                "{} is not what the agent prints now; GDRVM_UPDATE_FIXTURES=1 rewrites it",
                path.display()
            );
        }
    }

    #[test]
    fn test_bdf_format() {
        assert!(is_bdf("0000:03:00.0"));
        assert!(!is_bdf("pci0000:00") && !is_bdf("0000:03:00") && !is_bdf("0000:0g:00.0"));
    }
}
