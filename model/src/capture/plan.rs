//! From what sysfs shows to what a node file can say: the NUMA nodes the loader takes, a
//! host bridge per root complex, root ports, switches and one endpoint per link, named in
//! address order. Whatever does not fit is left out or approximated, and a note says so.

use std::collections::{BTreeMap, BTreeSet};

use super::sysfs::{Host, Port, Seen, PORT_DOWNSTREAM, PORT_ROOT, PORT_UPSTREAM};
use super::{CaptureError, CaptureOptions};
use crate::host_pci::{HostBar, HostBdf};
use crate::node::{EndpointKind, Link, LinkSpeed, ACS_CONTROLS};

/// NVIDIA's vendor ID (an NVSwitch is its "other bridge" function).
const VENDOR_NVIDIA: u16 = 0x10de;
/// What the node writes for a device that reports no link.
const NO_LINK: Link = Link { speed: LinkSpeed::Gt2_5, width: 1 };
/// ACS Control bits the node file can name.
const ACS_NAMEABLE: u16 = (1 << ACS_CONTROLS.len()) - 1;
/// Smallest NUMA node memory the loader takes.
const MIN_NUMA_MEMORY: u64 = crate::MIN_GUEST_MEMORY / 2;
/// Devices on a bus.
const SLOTS: usize = 32;
/// Downstream ports a node-file switch can have.
const MAX_PORTS: usize = 32;

/// Which endpoints get `backing = "vfio:<BDF>"`.
#[derive(Debug, Default)]
pub(super) struct Selection {
    bdfs: Vec<HostBdf>,
    kinds: Vec<EndpointKind>,
}

impl Selection {
    /// Checks the addresses and kinds of `opts`.
    pub fn parse(opts: &CaptureOptions) -> Result<Self, CaptureError> {
        let bdfs = opts
            .vfio
            .iter()
            .map(|text| text.parse().map_err(|reason| CaptureError::VfioAddress { text: text.clone(), reason }))
            .collect::<Result<_, _>>()?;
        let kinds = opts
            .vfio_classes
            .iter()
            .map(|k| match k.as_str() {
                "gpu" => Ok(EndpointKind::Gpu),
                "nic" => Ok(EndpointKind::Nic),
                "nvswitch" => Ok(EndpointKind::NvSwitch),
                "generic" => Ok(EndpointKind::Generic),
                _ => Err(CaptureError::VfioClass(k.clone())),
            })
            .collect::<Result<_, _>>()?;
        Ok(Selection { bdfs, kinds })
    }
}

/// A `[[numa]]` entry.
#[derive(Debug)]
pub(super) struct NumaPlan {
    /// The host node it is.
    pub host_id: u32,
    /// CPUs.
    pub cpus: u32,
    /// Bytes.
    pub memory: u64,
    /// SLIT row; `None` when the host's is not one the loader takes.
    pub distances: Option<Vec<u8>>,
}

/// A `[[host_bridge]]` entry.
#[derive(Debug)]
pub(super) struct HostBridgePlan {
    /// Name.
    pub name: String,
    /// NUMA node (index in the node file).
    pub numa: u32,
    /// Root bus, when the host's can be kept.
    pub bus: Option<u8>,
    /// The host's root complex (domain, bus).
    pub complex: (u16, u8),
}

/// A `[[root_port]]` entry.
#[derive(Debug)]
pub(super) struct RootPortPlan {
    /// Name.
    pub name: String,
    /// The host function.
    pub bdf: HostBdf,
    /// Its host bridge's name.
    pub host_bridge: String,
    /// Device number on the root bus, when free.
    pub slot: Option<u8>,
    /// Link capability.
    pub link: Link,
    /// ACS capability, and its Control register.
    pub acs: Option<u16>,
}

/// A `[[switch]]` entry.
#[derive(Debug)]
pub(super) struct SwitchPlan {
    /// Name.
    pub name: String,
    /// The host's upstream port.
    pub bdf: HostBdf,
    /// Root port or switch above it.
    pub parent: String,
    /// Downstream ports.
    pub ports: u8,
    /// Link capability of its upstream port.
    pub link: Link,
    /// Vendor and device ID of its upstream port.
    pub ids: (u16, u16),
    /// ACS capability of its downstream ports, and their Control register.
    pub acs: Option<u16>,
}

/// An `[[endpoint]]` entry.
#[derive(Debug)]
pub(super) struct EndpointPlan {
    /// Name.
    pub name: String,
    /// The host function.
    pub bdf: HostBdf,
    /// What it is.
    pub kind: EndpointKind,
    /// Host bridge, root port or switch.
    pub parent: String,
    /// Device number on a root bus, when free.
    pub slot: Option<u8>,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code.
    pub class: u32,
    /// Subsystem IDs.
    pub subsystem: Option<(u16, u16)>,
    /// Link capability.
    pub link: Link,
    /// Memory BARs; `None` to let a passed-through device give its own.
    pub bars: Option<Vec<HostBar>>,
    /// ATS capability.
    pub ats: bool,
    /// An SR-IOV virtual function.
    pub virtual_function: bool,
    /// Passed through with VFIO.
    pub vfio: bool,
}

/// The node file to write, and what it cannot say.
#[derive(Debug)]
pub(super) struct Plan {
    /// NUMA nodes.
    pub numa: Vec<NumaPlan>,
    /// Host bridges, by root complex.
    pub host_bridges: Vec<HostBridgePlan>,
    /// Root ports, by address.
    pub root_ports: Vec<RootPortPlan>,
    /// Switches, by upstream port address.
    pub switches: Vec<SwitchPlan>,
    /// Endpoints, by address.
    pub endpoints: Vec<EndpointPlan>,
    /// The host function the node's own host bridge function (00:00.0) stands for.
    pub host_function: Option<HostBdf>,
    /// What the node cannot say, in the order found.
    pub notes: Vec<String>,
}

/// Where something hangs in the tree being planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parent {
    HostBridge(usize),
    RootPort(HostBdf),
    Switch(HostBdf),
}

#[derive(Debug)]
struct DraftRootPort {
    bdf: HostBdf,
    host_bridge: usize,
    slot: Option<u8>,
    link: Link,
    acs: Option<u16>,
}

#[derive(Debug)]
struct DraftSwitch {
    bdf: HostBdf,
    host_bridge: usize,
    parent: Parent,
    /// The host's downstream port it hangs from, when below a switch.
    host_port: Option<usize>,
    ports: u8,
    link: Link,
    acs: Option<u16>,
}

#[derive(Debug)]
struct DraftEndpoint {
    bdf: HostBdf,
    kind: EndpointKind,
    parent: Parent,
    host_port: Option<usize>,
    slot: Option<u8>,
    link: Link,
    vfio: bool,
}

/// The kind an endpoint's class code (and vendor) implies.
fn kind_of(s: &Seen) -> EndpointKind {
    match (s.f.class >> 8, s.f.vendor) {
        (0x0300 | 0x0302, _) => EndpointKind::Gpu,
        (0x0200 | 0x0207, _) => EndpointKind::Nic,
        (0x0680, VENDOR_NVIDIA) => EndpointKind::NvSwitch,
        _ => EndpointKind::Generic,
    }
}

/// `a, b, c` of addresses, shortened past eight.
fn list(bdfs: &[HostBdf]) -> String {
    let mut out: Vec<String> = bdfs.iter().take(8).map(HostBdf::to_string).collect();
    if bdfs.len() > 8 {
        out.push(format!("and {} more", bdfs.len() - 8));
    }
    out.join(", ")
}

/// ACS Control bits as the node file names them.
fn acs_names(control: u16) -> String {
    let on: Vec<&str> =
        ACS_CONTROLS.iter().enumerate().filter(|(i, _)| control & (1 << i) != 0).map(|(_, n)| *n).collect();
    if on.is_empty() {
        "none".into()
    } else {
        on.join(", ")
    }
}

/// The link as sysfs would write it, for notes.
fn show_link(l: Link) -> String {
    format!("{} x{}", l.speed.sysfs(), l.width)
}

struct Planner<'a> {
    host: &'a Host,
    sel: &'a Selection,
    /// The functions directly below each bridge.
    below: BTreeMap<HostBdf, Vec<HostBdf>>,
    root_ports: Vec<DraftRootPort>,
    switches: Vec<DraftSwitch>,
    endpoints: Vec<DraftEndpoint>,
    host_function: Option<HostBdf>,
    notes: Vec<String>,
    skipped: BTreeMap<HostBdf, String>,
    /// Functions kept whose configuration space is unreadable beyond its header (bridges'
    /// port types inferred from the tree, ACS and ATS unknown).
    inferred: Vec<HostBdf>,
    /// PCIe functions kept whose extended configuration space (ACS, ATS) is unreadable.
    unextended: Vec<HostBdf>,
}

/// Plans the node file for `host`.
pub(super) fn plan(host: &Host, sel: &Selection, root: &std::path::Path) -> Result<Plan, CaptureError> {
    let mut below: BTreeMap<HostBdf, Vec<HostBdf>> = BTreeMap::new();
    let mut complexes: BTreeMap<(u16, u8), Vec<HostBdf>> = BTreeMap::new();
    for (bdf, s) in &host.functions {
        let on_root = complexes.entry(s.complex).or_default();
        match s.parent {
            Some(p) => below.entry(p).or_default().push(*bdf),
            None => on_root.push(*bdf),
        }
    }
    let mut p = Planner {
        host,
        sel,
        below,
        root_ports: Vec::new(),
        switches: Vec::new(),
        endpoints: Vec::new(),
        host_function: None,
        notes: host.notes.clone(),
        skipped: host.skipped.clone(),
        inferred: Vec::new(),
        unextended: Vec::new(),
    };
    let (numa, numa_map) = p.numa();
    let mut host_bridges = Vec::new();
    for (h, (complex, on_root)) in complexes.iter().enumerate() {
        let numa = p.complex_numa(*complex, &numa_map);
        p.root_bus(h, on_root)?;
        host_bridges.push(HostBridgePlan { name: format!("hb{h}"), numa, bus: None, complex: *complex });
    }
    p.orphans();
    if !p.inferred.is_empty() {
        p.inferred.sort();
        p.inferred.dedup();
        let inferred = list(&p.inferred);
        p.notes.push(format!(
            "{inferred}: configuration space unreadable beyond its header (capture as root to read it): bridges taken \
             for the ports their place in the tree calls for; ACS and ATS unknown, written as absent"
        ));
    }
    if !p.unextended.is_empty() {
        p.unextended.sort();
        p.unextended.dedup();
        let unextended = list(&p.unextended);
        p.notes.push(format!(
            "{unextended}: no extended configuration space (256 bytes; no ECAM?): ACS and ATS unknown, written as absent"
        ));
    }
    p.buses(&mut host_bridges);
    p.switch_positions();
    p.check_vfio(root)?;
    Ok(p.finish(numa, host_bridges))
}

impl<'a> Planner<'a> {
    fn note(&mut self, text: String) {
        self.notes.push(text);
    }

    /// Leaves `bdfs` out, saying why.
    fn skip(&mut self, bdfs: &[HostBdf], reason: &str) {
        if bdfs.is_empty() {
            return;
        }
        self.notes.push(format!("{}: left out: {reason}", list(bdfs)));
        for bdf in bdfs {
            self.skipped.insert(*bdf, reason.to_owned());
        }
    }

    /// `bdf` and everything below it.
    fn subtree(&self, bdf: HostBdf) -> Vec<HostBdf> {
        let mut out = vec![bdf];
        let mut i = 0;
        while i < out.len() {
            out.extend(self.below.get(&out[i]).into_iter().flatten().copied());
            i += 1;
        }
        out.sort();
        out
    }

    fn seen(&self, bdf: HostBdf) -> &'a Seen {
        &self.host.functions[&bdf]
    }

    /// Whether `s` is a bridge with PCIe port type `want`; a bridge whose configuration
    /// space is unreadable is taken for one (the tree says where it is).
    fn is_port(&mut self, bdf: HostBdf, want: u8) -> bool {
        let s = self.seen(bdf);
        if !s.is_bridge() {
            return false;
        }
        match s.port {
            Port::Pcie(t) => t == want,
            Port::Unknown => {
                self.inferred.push(bdf);
                true
            }
            Port::Conventional => false,
        }
    }

    /// Leaves out a bridge that is not the port its place calls for, and all below it.
    fn skip_bridge(&mut self, bdf: HostBdf, place: &str) {
        let what = match self.seen(bdf).port {
            Port::Pcie(t) => format!("a bridge of PCIe port type {t}"),
            Port::Conventional | Port::Unknown => "a conventional PCI bridge".to_owned(),
        };
        let reason = format!("{what} {place}; the node has root ports and switch ports only (with all below it)");
        let subtree = self.subtree(bdf);
        self.skip(&subtree, &reason);
    }

    /// The NUMA nodes the loader takes (at least one CPU and 32M), and each host node's
    /// index among them.
    fn numa(&mut self) -> (Vec<NumaPlan>, BTreeMap<u32, u32>) {
        let nodes = &self.host.numa;
        let kept: Vec<usize> =
            (0..nodes.len()).filter(|&i| nodes[i].cpus > 0 && nodes[i].memory >= MIN_NUMA_MEMORY).collect();
        for n in nodes.iter().filter(|n| n.cpus == 0 || n.memory < MIN_NUMA_MEMORY) {
            self.notes.push(format!(
                "host NUMA node {} ({} CPUs, {} MiB): left out: a node-file NUMA node needs a CPU and 32M; devices \
                 on it go to NUMA node 0",
                n.id,
                n.cpus,
                n.memory >> 20
            ));
        }
        let mut out = Vec::new();
        let mut map = BTreeMap::new();
        for (index, &i) in kept.iter().enumerate() {
            let n = &nodes[i];
            map.insert(n.id, index as u32);
            let distances = if n.distances.len() == nodes.len() {
                let row: Vec<u8> = kept.iter().map(|&j| n.distances[j]).collect();
                let valid = row.iter().enumerate().all(|(j, d)| if j == index { *d == 10 } else { *d > 10 });
                if !valid {
                    self.notes.push(format!(
                        "host NUMA node {}: distances {:?} are not a SLIT row the node takes (10 to itself, more to \
                         others): left to the default",
                        n.id, n.distances
                    ));
                }
                valid.then_some(row)
            } else {
                self.notes.push(format!(
                    "host NUMA node {}: {} distances for {} nodes: left to the default",
                    n.id,
                    n.distances.len(),
                    nodes.len()
                ));
                None
            };
            out.push(NumaPlan { host_id: n.id, cpus: n.cpus, memory: n.memory, distances });
        }
        if out.is_empty() {
            // The loader needs one: all CPUs and memory, whatever the nodes said.
            let cpus = nodes.iter().map(|n| n.cpus).sum::<u32>().max(1);
            let memory = nodes.iter().map(|n| n.memory).sum::<u64>().max(MIN_NUMA_MEMORY);
            self.notes.push("no host NUMA node has both CPUs and memory: one node of all of them".into());
            out.push(NumaPlan { host_id: 0, cpus, memory, distances: None });
            map.insert(0, 0);
        }
        let cpus: u32 = out.iter().map(|n| n.cpus).sum();
        let memory: u64 = out.iter().map(|n| n.memory).sum();
        if cpus > crate::MAX_GUEST_CPUS || memory > crate::MAX_GUEST_MEMORY {
            self.notes.push(format!(
                "{cpus} CPUs and {} GiB: more than a gdrvm guest takes ({} vCPUs, {} GiB); boot it with --cpus and \
                 --memory",
                memory >> 30,
                crate::MAX_GUEST_CPUS,
                crate::MAX_GUEST_MEMORY >> 30
            ));
        }
        (out, map)
    }

    /// The NUMA node (node-file index) of a root complex: its functions' `numa_node`.
    fn complex_numa(&mut self, complex: (u16, u8), map: &BTreeMap<u32, u32>) -> u32 {
        let name = format!("pci{:04x}:{:02x}", complex.0, complex.1);
        let nodes: BTreeSet<i32> =
            self.host.functions.values().filter(|s| s.complex == complex).map(|s| s.numa_node).collect();
        let known: Vec<i32> = nodes.iter().copied().filter(|n| *n >= 0).collect();
        if known.len() > 1 {
            self.note(format!("{name}: its functions are on NUMA nodes {known:?}: the node puts all on {}", known[0]));
        }
        let Some(&first) = known.first() else {
            if self.host.numa.len() > 1 {
                self.note(format!("{name}: numa_node -1 (the firmware gives no proximity): NUMA node 0"));
            }
            return 0;
        };
        match map.get(&(first as u32)) {
            Some(&index) => index,
            None => {
                self.note(format!("{name}: host NUMA node {first} is not in the node: NUMA node 0"));
                0
            }
        }
    }

    /// The functions on host bridge `h`'s root bus `on_root`. The node's first host bridge
    /// has the root bus 0 (its host bridge function takes device 0).
    fn root_bus(&mut self, h: usize, on_root: &[HostBdf]) -> Result<(), CaptureError> {
        let mut taken = [false; SLOTS];
        taken[0] = h == 0;
        for &bdf in on_root {
            let s = self.seen(bdf);
            if s.is_host_bridge() {
                if h == 0 && (bdf.device, bdf.function) == (0, 0) {
                    self.host_function = Some(bdf);
                } else {
                    self.skip(
                        &[bdf],
                        "a host bridge function; the node has one only, at 00:00.0 of its first root bus",
                    );
                }
                continue;
            }
            if s.is_bridge() {
                if self.is_port(bdf, PORT_ROOT) {
                    let slot = self.slot(bdf, &mut taken);
                    self.root_port(bdf, h, slot)?;
                } else {
                    self.skip_bridge(bdf, "on a root bus");
                }
                continue;
            }
            if s.physfn.is_some() && !self.sel.bdfs.contains(&bdf) {
                self.skip(&[bdf], "a virtual function on a root bus (name it with --vfio to keep it)");
                continue;
            }
            if self.keepable(bdf) {
                let slot = self.slot(bdf, &mut taken);
                self.endpoint(bdf, Parent::HostBridge(h), None, slot);
            }
        }
        Ok(())
    }

    /// Device `bdf`'s number on its root bus, when still free.
    fn slot(&mut self, bdf: HostBdf, taken: &mut [bool; SLOTS]) -> Option<u8> {
        let d = usize::from(bdf.device);
        if taken.get(d).copied().unwrap_or(true) {
            self.note(format!(
                "{bdf}: device {:02x} of its root bus is taken (the node numbers functions 0 only): it gets a free one",
                bdf.device
            ));
            return None;
        }
        taken[d] = true;
        Some(bdf.device)
    }

    /// Whether an endpoint can be written: GPUs, NICs, NVSwitches and functions named with
    /// `--vfio` always; other endpoints when they have a PCIe link (chipset functions do not).
    fn keepable(&mut self, bdf: HostBdf) -> bool {
        let s = self.seen(bdf);
        if kind_of(s) != EndpointKind::Generic || self.link_of(bdf).is_some() || self.sel.bdfs.contains(&bdf) {
            return true;
        }
        let reason = format!(
            "class {:06x} [{:04x}:{:04x}] without a PCIe link (chipset or conventional PCI function); the node's \
             endpoints are PCIe",
            s.f.class, s.f.vendor, s.f.device
        );
        self.skip(&[bdf], &reason);
        false
    }

    /// A function's link capability: its own, or its physical function's for a VF.
    fn link_of(&self, bdf: HostBdf) -> Option<Link> {
        let s = self.seen(bdf);
        s.max_link.or_else(|| s.physfn.and_then(|pf| self.host.functions.get(&pf)).and_then(|pf| pf.max_link))
    }

    /// Root port `bdf` on host bridge `h`, and what is below it.
    fn root_port(&mut self, bdf: HostBdf, h: usize, slot: Option<u8>) -> Result<(), CaptureError> {
        let link = self.port_link(bdf);
        let acs = self.port_acs(bdf);
        self.bridge_bars(bdf);
        self.root_ports.push(DraftRootPort { bdf, host_bridge: h, slot, link, acs });
        let children = self.below.get(&bdf).cloned().unwrap_or_default();
        self.link_partner(Parent::RootPort(bdf), h, None, &children)
    }

    /// A port's link capability (a port that reports none gets the node's smallest).
    fn port_link(&mut self, bdf: HostBdf) -> Link {
        self.seen(bdf).max_link.unwrap_or_else(|| {
            self.notes.push(format!("{bdf}: a port without a link capability: written as 2.5GT/s x1"));
            NO_LINK
        })
    }

    /// A port's ACS, with a note for Control bits the node cannot name.
    fn port_acs(&mut self, bdf: HostBdf) -> Option<u16> {
        self.extended(bdf);
        let acs = self.seen(bdf).acs_control;
        if let Some(extra) = acs.map(|c| c & !ACS_NAMEABLE).filter(|e| *e != 0) {
            self.note(format!(
                "{bdf}: ACS Control bits {extra:#06x} (P2P egress control, direct translated P2P) are not in node files"
            ));
        }
        acs.map(|c| c & ACS_NAMEABLE)
    }

    /// Remembers a function whose extended capabilities are unknown.
    fn extended(&mut self, bdf: HostBdf) {
        match self.seen(bdf) {
            s if s.port == Port::Unknown => self.inferred.push(bdf),
            s if matches!(s.port, Port::Pcie(_)) && !s.extended => self.unextended.push(bdf),
            _ => {}
        }
    }

    /// A note for a bridge's own BARs (node ports have none).
    fn bridge_bars(&mut self, bdf: HostBdf) {
        let bars = &self.seen(bdf).f.bars;
        if !bars.is_empty() {
            let sizes: Vec<String> = bars.iter().map(|b| format!("BAR{} {} KiB", b.index, b.size >> 10)).collect();
            self.note(format!("{bdf}: port BARs ({}) left out: node ports have none", sizes.join(", ")));
        }
    }

    /// What sits on the link below a root port or downstream port (`children`, all on
    /// its secondary bus): a switch, or one endpoint.
    fn link_partner(
        &mut self,
        parent: Parent,
        h: usize,
        host_port: Option<usize>,
        children: &[HostBdf],
    ) -> Result<(), CaptureError> {
        let (bridges, endpoints): (Vec<HostBdf>, Vec<HostBdf>) =
            children.iter().copied().partition(|b| self.seen(*b).is_bridge());
        if let Some((&first, rest)) = bridges.split_first() {
            if self.is_port(first, PORT_UPSTREAM) {
                self.switch(first, parent, h, host_port)?;
            } else {
                self.skip_bridge(first, "below a port");
            }
            for &other in rest {
                let subtree = self.subtree(other);
                self.skip(&subtree, &format!("shares the link of {first}; the node has one device per link"));
            }
            self.skip(&endpoints, &format!("functions beside switch port {first}; the node has one device per link"));
            return Ok(());
        }
        let keep: Vec<HostBdf> = endpoints.iter().copied().filter(|&b| self.keepable(b)).collect();
        let named: Vec<HostBdf> = keep.iter().copied().filter(|b| self.sel.bdfs.contains(b)).collect();
        if let [a, b, ..] = named[..] {
            return Err(CaptureError::VfioConflict { a, b });
        }
        let chosen = named
            .first()
            .or_else(|| keep.iter().find(|b| self.seen(**b).physfn.is_none()))
            .or_else(|| keep.first())
            .copied();
        let Some(chosen) = chosen else { return Ok(()) };
        let physfn = self.seen(chosen).physfn;
        if let Some(pf) = physfn {
            self.note(format!("{chosen}: a virtual function of {pf}, in its place (--vfio)"));
        }
        let vfs: Vec<HostBdf> =
            keep.iter().copied().filter(|&b| b != chosen && self.seen(b).physfn == Some(chosen)).collect();
        self.skip(
            &vfs,
            &format!("virtual functions of {chosen}; the node has one function per link (name one with --vfio to put it in its PF's place)"),
        );
        let others: Vec<HostBdf> = keep.iter().copied().filter(|&b| b != chosen && !vfs.contains(&b)).collect();
        self.skip(&others, &format!("other functions on the link of {chosen}; the node has one function per link"));
        self.endpoint(chosen, parent, host_port, None);
        Ok(())
    }

    /// The switch whose upstream port is `up`, below `parent`.
    fn switch(&mut self, up: HostBdf, parent: Parent, h: usize, host_port: Option<usize>) -> Result<(), CaptureError> {
        let link = self.port_link(up);
        self.degraded(up);
        self.bridge_bars(up);
        if self.seen(up).acs_control.is_some() {
            self.note(format!("{up}: ACS on a switch upstream port: node switches have it on downstream ports only"));
        }
        let children = self.below.get(&up).cloned().unwrap_or_default();
        let mut downs = Vec::new();
        for &c in &children {
            if self.is_port(c, PORT_DOWNSTREAM) {
                downs.push(c);
            } else if self.seen(c).is_bridge() {
                self.skip_bridge(c, "inside a switch");
            } else {
                self.skip(&[c], &format!("an endpoint inside switch {up} (beside its downstream ports)"));
            }
        }
        if downs.len() > MAX_PORTS {
            let extra: Vec<HostBdf> = downs.split_off(MAX_PORTS).into_iter().flat_map(|d| self.subtree(d)).collect();
            self.skip(&extra, &format!("switch {up} has more than {MAX_PORTS} downstream ports"));
        }
        let Some(&first) = downs.first() else {
            let subtree = self.subtree(up);
            self.skip(&subtree, "a switch without downstream ports");
            return Ok(());
        };
        let numbered: Vec<String> = downs.iter().map(|d| format!("{:02x}.{}", d.device, d.function)).collect();
        if downs.iter().enumerate().any(|(j, d)| (usize::from(d.device), d.function) != (j, 0)) {
            self.note(format!(
                "switch {up}: downstream ports at {} on the host are numbered 00.0 to {:02x}.0 in the node",
                numbered.join(", "),
                downs.len() - 1
            ));
        }
        let ids = (self.seen(up).f.vendor, self.seen(up).f.device);
        let acs = self.port_acs(first);
        for &d in &downs[1..] {
            let other = self.port_acs(d);
            if other != acs {
                let show = |a: Option<u16>| a.map_or("no ACS".to_owned(), |c| format!("ACS ({})", acs_names(c)));
                self.note(format!(
                    "switch {up}: downstream port {d} has {}, {first} {}: the node gives all ports the first's",
                    show(other),
                    show(acs)
                ));
            }
        }
        for &d in &downs {
            let s = self.seen(d);
            let down_ids = (s.f.vendor, s.f.device);
            if down_ids != ids {
                self.note(format!(
                    "switch {up}: downstream port {d} is [{:04x}:{:04x}], the upstream port [{:04x}:{:04x}]: the node \
                     gives all the upstream port's IDs",
                    down_ids.0, down_ids.1, ids.0, ids.1
                ));
            }
            if let Some(l) = s.max_link.filter(|l| *l != link) {
                self.note(format!(
                    "switch {up}: downstream port {d} links at {}, the upstream port at {}: the node gives all ports \
                     the upstream port's",
                    show_link(l),
                    show_link(link)
                ));
            }
            self.bridge_bars(d);
        }
        self.switches.push(DraftSwitch {
            bdf: up,
            host_bridge: h,
            parent,
            host_port,
            ports: downs.len() as u8,
            link,
            acs,
        });
        for (j, &d) in downs.iter().enumerate() {
            let below = self.below.get(&d).cloned().unwrap_or_default();
            self.link_partner(Parent::Switch(up), h, Some(j), &below)?;
        }
        Ok(())
    }

    /// A note when the link of `bdf` trained below what both its ends can do.
    fn degraded(&mut self, bdf: HostBdf) {
        let s = self.seen(bdf);
        let (Some(own), Some(current)) = (s.max_link, s.current_link) else { return };
        let partner = s.parent.and_then(|p| self.host.functions.get(&p)).and_then(|p| p.max_link).unwrap_or(own);
        let best = Link { speed: own.speed.min(partner.speed), width: own.width.min(partner.width) };
        if current.speed < best.speed || current.width < best.width {
            self.note(format!(
                "{bdf}: link trained to {} where both ends can do {} (degraded; GPUs slow their links when idle, a \
                 narrow link is a fault): the node describes capabilities",
                show_link(current),
                show_link(best)
            ));
        }
    }

    /// Endpoint `bdf` below `parent`.
    fn endpoint(&mut self, bdf: HostBdf, parent: Parent, host_port: Option<usize>, slot: Option<u8>) {
        let kind = kind_of(self.seen(bdf));
        let vfio = self.sel.bdfs.contains(&bdf) || self.sel.kinds.contains(&kind);
        let link = self.link_of(bdf).unwrap_or_else(|| {
            self.notes.push(format!("{bdf}: no PCIe link (conventional PCI, or not reported): written as 2.5GT/s x1"));
            NO_LINK
        });
        if self.seen(bdf).physfn.is_none() {
            self.degraded(bdf);
        }
        self.extended(bdf);
        let s = self.seen(bdf);
        if s.acs_control.is_some() {
            self.note(format!("{bdf}: ACS on an endpoint: node endpoints have none"));
        }
        if !s.io_bars.is_empty() {
            let io = s.io_bars.clone();
            self.note(format!("{bdf}: I/O BARs {io:?} left out: the node has memory BARs only"));
        }
        self.endpoints.push(DraftEndpoint { bdf, kind, parent, host_port, slot, link, vfio });
    }

    /// The memory BARs to write for endpoint `bdf` (`None`: the passed-through device gives
    /// its own), with notes for what the node cannot hold.
    fn bars(&mut self, bdf: HostBdf, vfio: bool) -> Option<Vec<HostBar>> {
        let bars = self.seen(bdf).f.bars.clone();
        let valid = |b: &HostBar| b.size.is_power_of_two() && b.size >= 16 && (b.is_64bit || b.size <= 1 << 31);
        let (good, bad): (Vec<HostBar>, Vec<HostBar>) = bars.iter().partition(|b| valid(b));
        if vfio && !bad.is_empty() {
            self.note(format!(
                "{bdf}: BARs not written (one is no power of two of 16 bytes or more): the device gives its own"
            ));
            return None;
        }
        for b in &bad {
            self.note(format!(
                "{bdf}: BAR{} of {} bytes left out: not a power of two of at least 16 bytes, or over 2G in 32 bits",
                b.index, b.size
            ));
        }
        let mut index = 0u8;
        let packed: Vec<u8> = good
            .iter()
            .map(|b| {
                let at = index;
                index += if b.is_64bit { 2 } else { 1 };
                at
            })
            .collect();
        let host: Vec<u8> = good.iter().map(|b| b.index).collect();
        if !vfio && packed != host {
            self.note(format!(
                "{bdf}: BARs at host indices {host:?} are at {packed:?} in the node (it packs BARs in order; a \
                 passed-through device keeps its own)"
            ));
        }
        Some(good)
    }

    /// Functions whose parent bridge sysfs does not list: left out.
    fn orphans(&mut self) {
        let orphans: Vec<HostBdf> = self
            .host
            .functions
            .iter()
            .filter(|(_, s)| s.parent.is_some_and(|p| !self.host.functions.contains_key(&p)))
            .map(|(b, _)| *b)
            .collect();
        for o in orphans {
            let subtree = self.subtree(o);
            self.skip(&subtree, "its parent bridge is not in the sysfs PCI list");
        }
    }

    /// Root bus numbers: the host's where the node's numbering allows (each bridge takes one
    /// bus below its host bridge's root bus), otherwise the next free one.
    fn buses(&mut self, host_bridges: &mut [HostBridgePlan]) {
        let mut next = 0usize;
        for (h, hb) in host_bridges.iter_mut().enumerate() {
            let (domain, bus) = hb.complex;
            let name = format!("pci{domain:04x}:{bus:02x}");
            hb.bus = if domain != 0 {
                self.notes.push(format!(
                    "{name}: PCI domain {domain:04x} is folded into segment 0 (a node has one): its buses are \
                     renumbered"
                ));
                None
            } else if h == 0 && bus != 0 {
                self.notes.push(format!("{name}: the node's first host bridge has root bus 0: buses renumbered"));
                None
            } else if usize::from(bus) < next {
                self.notes.push(format!(
                    "{name}: the node numbers buses densely and has used bus {bus:#04x} already: buses renumbered"
                ));
                None
            } else {
                Some(bus)
            };
            let root = hb.bus.map_or(next, usize::from);
            let bridges = self.root_ports.iter().filter(|r| r.host_bridge == h).count()
                + self.switches.iter().filter(|s| s.host_bridge == h).map(|s| 1 + usize::from(s.ports)).sum::<usize>();
            next = root + 1 + bridges;
        }
    }

    /// A note for each switch whose children the node puts on other downstream ports: it
    /// fills ports in order, switches first, then endpoints, each in address order.
    fn switch_positions(&mut self) {
        let mut notes = Vec::new();
        for sw in &self.switches {
            let mut switches: Vec<(HostBdf, Option<usize>)> = self
                .switches
                .iter()
                .filter(|c| c.parent == Parent::Switch(sw.bdf))
                .map(|c| (c.bdf, c.host_port))
                .collect();
            let mut endpoints: Vec<(HostBdf, Option<usize>)> = self
                .endpoints
                .iter()
                .filter(|e| e.parent == Parent::Switch(sw.bdf))
                .map(|e| (e.bdf, e.host_port))
                .collect();
            switches.sort();
            endpoints.sort();
            let below = switches.into_iter().chain(endpoints);
            let moved: Vec<String> = below
                .enumerate()
                .filter(|(k, (_, j))| *j != Some(*k))
                .map(|(k, (b, j))| format!("{b} from port {} to {k}", j.map_or("?".into(), |j| j.to_string())))
                .collect();
            if !moved.is_empty() {
                notes.push(format!(
                    "switch {}: the node fills downstream ports in order (switches first): {}",
                    sw.bdf,
                    moved.join(", ")
                ));
            }
        }
        self.notes.extend(notes);
    }

    /// Every `--vfio` address must be an endpoint of the node.
    fn check_vfio(&self, root: &std::path::Path) -> Result<(), CaptureError> {
        for &bdf in &self.sel.bdfs {
            if self.endpoints.iter().any(|e| e.bdf == bdf) {
                continue;
            }
            let reason = if let Some(why) = self.skipped.get(&bdf) {
                format!("left out of the node: {why}")
            } else if let Some(s) = self.host.functions.get(&bdf) {
                if s.is_bridge() || s.is_host_bridge() {
                    "a bridge, not an endpoint".to_owned()
                } else {
                    "not an endpoint of the node".to_owned()
                }
            } else {
                format!("no such function ({})", super::sysfs::function_path(root, bdf).display())
            };
            return Err(CaptureError::VfioNotCaptured { bdf, reason });
        }
        Ok(())
    }

    /// Names everything in address order and resolves parents.
    fn finish(mut self, numa: Vec<NumaPlan>, host_bridges: Vec<HostBridgePlan>) -> Plan {
        self.root_ports.sort_by_key(|r| r.bdf);
        self.switches.sort_by_key(|s| s.bdf);
        self.endpoints.sort_by_key(|e| e.bdf);
        let rp_names: BTreeMap<HostBdf, String> =
            self.root_ports.iter().enumerate().map(|(i, r)| (r.bdf, format!("rp{i}"))).collect();
        let sw_names: BTreeMap<HostBdf, String> =
            self.switches.iter().enumerate().map(|(i, s)| (s.bdf, format!("sw{i}"))).collect();
        let parent_name = |p: Parent| match p {
            Parent::HostBridge(h) => host_bridges[h].name.clone(),
            Parent::RootPort(b) => rp_names[&b].clone(),
            Parent::Switch(b) => sw_names[&b].clone(),
        };
        let root_ports = self
            .root_ports
            .iter()
            .map(|r| RootPortPlan {
                name: rp_names[&r.bdf].clone(),
                bdf: r.bdf,
                host_bridge: host_bridges[r.host_bridge].name.clone(),
                slot: r.slot,
                link: r.link,
                acs: r.acs,
            })
            .collect();
        let switches = self
            .switches
            .iter()
            .map(|s| SwitchPlan {
                name: sw_names[&s.bdf].clone(),
                bdf: s.bdf,
                parent: parent_name(s.parent),
                ports: s.ports,
                link: s.link,
                ids: (self.seen(s.bdf).f.vendor, self.seen(s.bdf).f.device),
                acs: s.acs,
            })
            .collect();
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        let drafts = std::mem::take(&mut self.endpoints);
        let mut endpoints = Vec::new();
        for e in drafts {
            let prefix = match e.kind {
                EndpointKind::Gpu => "gpu",
                EndpointKind::Nic => "nic",
                EndpointKind::NvSwitch => "nvswitch",
                EndpointKind::Generic => "dev",
            };
            let n = counts.entry(prefix).or_default();
            let name = format!("{prefix}{n}");
            *n += 1;
            let bars = self.bars(e.bdf, e.vfio);
            let s = self.seen(e.bdf);
            endpoints.push(EndpointPlan {
                name,
                bdf: e.bdf,
                kind: e.kind,
                parent: parent_name(e.parent),
                slot: e.slot,
                vendor: s.f.vendor,
                device: s.f.device,
                class: s.f.class,
                subsystem: s.f.subsystem,
                link: e.link,
                bars,
                ats: s.f.caps.ats,
                virtual_function: s.physfn.is_some(),
                vfio: e.vfio,
            });
        }
        Plan {
            numa,
            host_bridges,
            root_ports,
            switches,
            endpoints,
            host_function: self.host_function,
            notes: self.notes,
        }
    }
}
