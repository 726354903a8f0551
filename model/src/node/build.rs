//! From node-file text to a checked [`Node`]: names resolved, parents checked, buses and
//! device numbers assigned depth-first under each host bridge.

use std::collections::HashMap;

use super::schema::{BarEntry, EndpointEntry, NodeFile};
use super::{Bar, Bdf, EndpointKind, Function, FunctionKind, HostBridge, Link, Node, NumaNode};

/// A node file that cannot be used: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {}{reason}", if key.is_empty() { String::new() } else { format!("key {key}: ") })]
pub struct NodeError {
    /// The file (or preset) it came from.
    pub origin: String,
    /// The key at fault, e.g. `endpoint[3] (gpu3).link`; empty for whole-file errors.
    pub key: String,
    /// What is wrong.
    pub reason: String,
}

impl NodeError {
    pub(super) fn new(origin: &str, key: &str, reason: impl Into<String>) -> Self {
        NodeError { origin: origin.to_owned(), key: key.to_owned(), reason: reason.into() }
    }
}

/// PCI class of a PCI-to-PCI bridge (root and switch ports).
const CLASS_PCI_BRIDGE: u32 = 0x06_04_00;
/// Red Hat's ID for a virtual PCIe root port (the one QEMU uses; no driver quirks).
const ROOT_PORT_ID: (u16, u16) = (0x1b36, 0x000c);
/// Broadcom PEX88096, the switch of HGX A100 baseboards (same ID up and down).
const SWITCH_ID: (u16, u16) = (0x1000, 0xc010);
/// Devices on one bus.
const SLOTS: u8 = 32;
/// BAR registers of a type-0 function.
const BAR_SLOTS: u8 = 6;

/// Where a function goes: its address and the host bridge and bridge above it.
#[derive(Clone, Copy)]
struct At {
    bdf: Bdf,
    host_bridge: usize,
    parent: Option<usize>,
}

/// Red Hat's ID for a virtual PCIe host bridge function (QEMU's gpex/pxb).
const HOST_BRIDGE_ID: (u16, u16) = (0x1b36, 0x0008);
/// PCI class of a host bridge.
const CLASS_HOST_BRIDGE: u32 = 0x06_00_00;

/// A root or switch port; `key` is its entry in the node file.
fn bridge(name: String, key: String, kind: FunctionKind, at: At, ids: (u16, u16), link: Link, acs: bool) -> Function {
    Function {
        name,
        key,
        kind,
        bdf: at.bdf,
        host_bridge: at.host_bridge,
        parent: at.parent,
        vendor: ids.0,
        device: ids.1,
        class: CLASS_PCI_BRIDGE,
        subsystem: None,
        link: Some(link),
        acs,
        acs_control: 0,
        ats: false,
        virtual_function: false,
        bars: Vec::new(),
        buses: None,
        windows: None,
    }
}

/// Where something is attached.
#[derive(Clone, Copy)]
enum Place {
    HostBridge(usize),
    RootPort(usize),
    Switch(usize),
    Endpoint,
}

/// What sits below a port or on a bus.
#[derive(Clone, Copy)]
enum Child {
    RootPort(usize),
    Switch(usize),
    Endpoint(usize),
}

struct Builder<'a> {
    origin: &'a str,
    file: &'a NodeFile,
    links: HashMap<String, Link>,
    hb_children: Vec<Vec<(Option<u8>, Child, String)>>,
    rp_child: Vec<Option<Child>>,
    sw_children: Vec<Vec<Child>>,
    next_bus: u16,
    functions: Vec<Function>,
}

fn key(section: &str, i: usize, name: &str, field: &str) -> String {
    format!("{section}[{i}] ({name}).{field}")
}

/// Checks `text` (from `origin`) and builds the node.
pub fn build(origin: &str, text: &str) -> Result<Node, NodeError> {
    let err = |key: String, reason: String| NodeError { origin: origin.to_owned(), key, reason };
    let file: NodeFile = toml::from_str(text).map_err(|e| {
        err(String::new(), format!("TOML: {}", e.to_string().split_whitespace().collect::<Vec<_>>().join(" ")))
    })?;
    let numa = numa_nodes(origin, &file)?;

    let mut names: HashMap<String, (String, Place)> = HashMap::new();
    let mut add_name = |name: &str, k: String, place: Place| -> Result<(), NodeError> {
        if let Some((other, _)) = names.get(name) {
            return Err(err(k, format!("name '{name}' is already used by {other}")));
        }
        names.insert(name.to_owned(), (k, place));
        Ok(())
    };
    for (i, hb) in file.host_bridge.iter().enumerate() {
        add_name(&hb.name, format!("host_bridge[{i}].name"), Place::HostBridge(i))?;
        if hb.numa as usize >= numa.len() {
            return Err(err(
                key("host_bridge", i, &hb.name, "numa"),
                format!("NUMA node {} does not exist (the file has {}: 0 to {})", hb.numa, numa.len(), numa.len() - 1),
            ));
        }
    }
    for (i, rp) in file.root_port.iter().enumerate() {
        add_name(&rp.name, format!("root_port[{i}].name"), Place::RootPort(i))?;
    }
    for (i, sw) in file.switch.iter().enumerate() {
        add_name(&sw.name, format!("switch[{i}].name"), Place::Switch(i))?;
    }
    for (i, ep) in file.endpoint.iter().enumerate() {
        add_name(&ep.name, format!("endpoint[{i}].name"), Place::Endpoint)?;
    }
    let place = |name: &str| names.get(name).map(|(_, p)| *p);

    let mut b = Builder {
        origin,
        file: &file,
        links: HashMap::new(),
        hb_children: vec![Vec::new(); file.host_bridge.len()],
        rp_child: vec![None; file.root_port.len()],
        sw_children: vec![Vec::new(); file.switch.len()],
        next_bus: 0,
        functions: Vec::new(),
    };
    for (i, rp) in file.root_port.iter().enumerate() {
        let k = key("root_port", i, &rp.name, "host_bridge");
        let Some(Place::HostBridge(h)) = place(&rp.host_bridge) else {
            return Err(err(k, format!("'{}' is not a host bridge", rp.host_bridge)));
        };
        b.link(&rp.name, &rp.link, key("root_port", i, &rp.name, "link"))?;
        b.hb_children[h].push((rp.slot, Child::RootPort(i), key("root_port", i, &rp.name, "slot")));
    }
    for (i, sw) in file.switch.iter().enumerate() {
        let k = key("switch", i, &sw.name, "parent");
        b.link(&sw.name, &sw.link, key("switch", i, &sw.name, "link"))?;
        if sw.ports == 0 || sw.ports > SLOTS {
            return Err(err(
                key("switch", i, &sw.name, "ports"),
                format!("{} downstream ports: a switch has 1 to 32", sw.ports),
            ));
        }
        match place(&sw.parent) {
            Some(Place::RootPort(r)) => b.attach_to_root_port(r, Child::Switch(i), k)?,
            Some(Place::Switch(s)) if s != i => b.attach_to_switch(s, Child::Switch(i), k)?,
            _ => return Err(err(k, format!("'{}' is not a root port or another switch", sw.parent))),
        }
    }
    for (i, ep) in file.endpoint.iter().enumerate() {
        let k = key("endpoint", i, &ep.name, "parent");
        b.link(&ep.name, &ep.link, key("endpoint", i, &ep.name, "link"))?;
        match place(&ep.parent) {
            Some(Place::HostBridge(h)) => {
                b.hb_children[h].push((ep.slot, Child::Endpoint(i), key("endpoint", i, &ep.name, "slot")))
            }
            Some(Place::RootPort(r)) => b.attach_to_root_port(r, Child::Endpoint(i), k)?,
            Some(Place::Switch(s)) => b.attach_to_switch(s, Child::Endpoint(i), k)?,
            _ => return Err(err(k, format!("'{}' is not a host bridge, root port or switch", ep.parent))),
        }
    }

    let mut host_bridges = Vec::new();
    for (h, hb) in file.host_bridge.iter().enumerate() {
        let first = match hb.bus {
            Some(bus) if u16::from(bus) < b.next_bus => {
                return Err(err(
                    key("host_bridge", h, &hb.name, "bus"),
                    format!(
                        "bus {bus:#04x} is already below an earlier host bridge (next free bus: {:#04x})",
                        b.next_bus
                    ),
                ));
            }
            Some(bus) => u16::from(bus),
            None => b.next_bus,
        };
        b.next_bus = first;
        let root = b.alloc_bus(&key("host_bridge", h, &hb.name, "bus"))?;
        b.number_root_bus(h, root)?;
        host_bridges.push(HostBridge {
            name: hb.name.clone(),
            numa: hb.numa,
            first_bus: root,
            last_bus: (b.next_bus - 1) as u8,
            mem32: None,
            mem64: None,
        });
    }
    let mut node = Node {
        name: file.name.clone(),
        description: file.description.clone(),
        numa,
        host_bridges,
        functions: b.functions,
    };
    super::address::assign(&mut node, origin)?;
    Ok(node)
}

fn numa_nodes(origin: &str, file: &NodeFile) -> Result<Vec<NumaNode>, NodeError> {
    let err = |key: String, reason: String| NodeError { origin: origin.to_owned(), key, reason };
    if file.numa.is_empty() {
        return Err(err("numa".into(), "a node needs at least one [[numa]] entry".into()));
    }
    let n = file.numa.len();
    let mut out = Vec::new();
    for (i, e) in file.numa.iter().enumerate() {
        let k = |f: &str| format!("numa[{i}].{f}");
        if e.cpus == 0 {
            return Err(err(k("cpus"), "a NUMA node needs at least one vCPU".into()));
        }
        let memory = crate::parse_size(&e.memory)
            .ok_or_else(|| err(k("memory"), format!("'{}' is not a size (e.g. 512M, 64G)", e.memory)))?;
        if memory < crate::MIN_GUEST_MEMORY / 2 {
            return Err(err(k("memory"), format!("{} is less than 32M", e.memory)));
        }
        let distances = e.distances.clone().unwrap_or_else(|| (0..n).map(|j| if j == i { 10 } else { 20 }).collect());
        if distances.len() != n {
            return Err(err(k("distances"), format!("{} distances for {n} NUMA nodes", distances.len())));
        }
        if distances[i] != 10 || distances.iter().enumerate().any(|(j, d)| j != i && *d <= 10) {
            return Err(err(
                k("distances"),
                "the distance to itself is 10 and to others more than 10 (ACPI SLIT)".into(),
            ));
        }
        out.push(NumaNode { id: i as u32, cpus: e.cpus, memory, distances });
    }
    Ok(out)
}

fn parse_bars(bars: &[BarEntry], k: &str) -> Result<Vec<Bar>, String> {
    let mut out = Vec::new();
    let mut index = 0u8;
    for (j, bar) in bars.iter().enumerate() {
        let size =
            crate::parse_size(&bar.size).ok_or_else(|| format!("{k}[{j}].size: '{}' is not a size", bar.size))?;
        if !size.is_power_of_two() || size < 16 {
            return Err(format!("{k}[{j}].size: {} is not a power of two of at least 16 bytes", bar.size));
        }
        let is_64bit = match bar.bits {
            64 => true,
            32 if size <= 1 << 31 => false,
            32 => return Err(format!("{k}[{j}].size: {} does not fit a 32-bit BAR", bar.size)),
            other => return Err(format!("{k}[{j}].bits: {other} is not 32 or 64")),
        };
        let needed = if is_64bit { 2 } else { 1 };
        if index + needed > BAR_SLOTS {
            return Err(format!("{k}[{j}]: more BARs than the six BAR registers hold"));
        }
        out.push(Bar { index, size, prefetchable: bar.prefetchable, is_64bit, address: 0 });
        index += needed;
    }
    Ok(out)
}

fn endpoint_kind(ep: &EndpointEntry) -> Result<(EndpointKind, u32), String> {
    let (kind, default_class) = match ep.kind.as_str() {
        "gpu" => (EndpointKind::Gpu, Some(0x03_02_00)),
        "nic" => (EndpointKind::Nic, Some(0x02_00_00)),
        "nvswitch" => (EndpointKind::NvSwitch, Some(0x06_80_00)),
        "generic" => (EndpointKind::Generic, None),
        other => return Err(format!("kind: '{other}' is not gpu, nic, nvswitch or generic")),
    };
    let class = ep.class.or(default_class).ok_or("class: a generic endpoint needs its class code")?;
    if class > 0xff_ffff {
        return Err(format!("class: {class:#x} is more than 24 bits"));
    }
    Ok((kind, class))
}

impl Builder<'_> {
    fn err(&self, key: String, reason: String) -> NodeError {
        NodeError { origin: self.origin.to_owned(), key, reason }
    }

    /// The ACS Control value for `names` on a port whose ACS capability is `present`.
    fn acs_control(&self, present: bool, names: &[String], k: &str) -> Result<u16, NodeError> {
        if !present && !names.is_empty() {
            return Err(self.err(k.to_owned(), "ACS controls on a port without ACS (acs = false)".into()));
        }
        let mut bits = 0u16;
        for name in names {
            let bit = super::ACS_CONTROLS.iter().position(|c| c == name).ok_or_else(|| {
                self.err(k.to_owned(), format!("'{name}' is not an ACS control ({})", super::ACS_CONTROLS.join(", ")))
            })?;
            bits |= 1 << bit;
        }
        Ok(bits)
    }

    fn link(&mut self, name: &str, text: &str, k: String) -> Result<(), NodeError> {
        let link = Link::parse(text).map_err(|r| self.err(k, r))?;
        self.links.insert(name.to_owned(), link);
        Ok(())
    }

    fn attach_to_root_port(&mut self, r: usize, child: Child, k: String) -> Result<(), NodeError> {
        if self.rp_child[r].is_some() {
            let name = &self.file.root_port[r].name;
            return Err(
                self.err(k, format!("root port '{name}' already has a device below it: a root port has one link"))
            );
        }
        self.rp_child[r] = Some(child);
        Ok(())
    }

    fn attach_to_switch(&mut self, s: usize, child: Child, k: String) -> Result<(), NodeError> {
        let sw = &self.file.switch[s];
        if self.sw_children[s].len() >= usize::from(sw.ports) {
            return Err(self.err(k, format!("switch '{}' has only {} downstream ports, all taken", sw.name, sw.ports)));
        }
        self.sw_children[s].push(child);
        Ok(())
    }

    fn alloc_bus(&mut self, k: &str) -> Result<u8, NodeError> {
        let bus = u8::try_from(self.next_bus).map_err(|_| {
            self.err(k.to_owned(), "the topology needs more than 256 buses (PCI segment 0 has 256)".into())
        })?;
        self.next_bus += 1;
        Ok(bus)
    }

    fn number_root_bus(&mut self, h: usize, bus: u8) -> Result<(), NodeError> {
        let mut taken: [Option<String>; SLOTS as usize] = Default::default();
        let mut placed = Vec::new();
        if bus == 0 {
            let name = format!("{}.host", self.file.host_bridge[h].name);
            taken[0] = Some(name.clone());
            let f = Function {
                kind: FunctionKind::HostBridge,
                class: CLASS_HOST_BRIDGE,
                link: None,
                acs: false,
                ..bridge(
                    name,
                    format!("host_bridge[{h}] ({})", self.file.host_bridge[h].name),
                    FunctionKind::HostBridge,
                    At { bdf: Bdf { bus, device: 0, function: 0 }, host_bridge: h, parent: None },
                    HOST_BRIDGE_ID,
                    Link { speed: super::LinkSpeed::Gt2_5, width: 1 },
                    false,
                )
            };
            self.push(f);
        }
        let children = self.hb_children[h].clone();
        for (slot, child, k) in children.iter().filter(|(s, ..)| s.is_some()) {
            let slot = slot.unwrap_or_default();
            let name = self.child_name(*child);
            match taken.get(usize::from(slot)) {
                None => return Err(self.err(k.clone(), format!("slot {slot} is beyond the 32 devices of a bus"))),
                Some(Some(other)) => {
                    let bdf = Bdf { bus, device: slot, function: 0 };
                    return Err(self.err(k.clone(), format!("{bdf} is already taken by '{other}'")));
                }
                Some(None) => {}
            }
            taken[usize::from(slot)] = Some(name);
            placed.push((slot, *child));
        }
        for (_, child, k) in children.iter().filter(|(s, ..)| s.is_none()) {
            let free = taken.iter().position(Option::is_none).ok_or_else(|| {
                self.err(k.clone(), format!("bus {bus:#04x} has no free device number left (32 per bus)"))
            })?;
            taken[free] = Some(self.child_name(*child));
            placed.push((free as u8, *child));
        }
        placed.sort_by_key(|(slot, _)| *slot);
        for (slot, child) in placed {
            self.number(child, Bdf { bus, device: slot, function: 0 }, h, None)?;
        }
        Ok(())
    }

    fn child_name(&self, child: Child) -> String {
        match child {
            Child::RootPort(i) => self.file.root_port[i].name.clone(),
            Child::Switch(i) => self.file.switch[i].name.clone(),
            Child::Endpoint(i) => self.file.endpoint[i].name.clone(),
        }
    }

    fn push(&mut self, f: Function) -> usize {
        self.functions.push(f);
        self.functions.len() - 1
    }

    /// Places `child` at `bdf`, then everything below it.
    fn number(&mut self, child: Child, bdf: Bdf, h: usize, parent: Option<usize>) -> Result<(), NodeError> {
        match child {
            Child::RootPort(i) => {
                let rp = &self.file.root_port[i];
                let link = self.links[&rp.name];
                let at = At { bdf, host_bridge: h, parent };
                let k = format!("root_port[{i}] ({})", rp.name);
                let mut f = bridge(rp.name.clone(), k.clone(), FunctionKind::RootPort, at, ROOT_PORT_ID, link, rp.acs);
                f.acs_control = self.acs_control(rp.acs, &rp.acs_control, &format!("{k}.acs_control"))?;
                let me = self.push(f);
                let below = self.rp_child[i];
                self.bridge_below(me, below.into_iter().collect(), h, &key("root_port", i, &rp.name, "link"))
            }
            Child::Switch(i) => {
                let sw = &self.file.switch[i];
                let link = self.links[&sw.name];
                let ids = (sw.vendor.unwrap_or(SWITCH_ID.0), sw.device.unwrap_or(SWITCH_ID.1));
                let at = At { bdf, host_bridge: h, parent };
                let sk = format!("switch[{i}] ({})", sw.name);
                let up =
                    bridge(format!("{}.up", sw.name), sk.clone(), FunctionKind::SwitchUpstream, at, ids, link, false);
                let up = self.push(up);
                let k = key("switch", i, &sw.name, "ports");
                let internal = self.alloc_bus(&k)?;
                let children = self.sw_children[i].clone();
                for port in 0..sw.ports {
                    let pbdf = Bdf { bus: internal, device: port, function: 0 };
                    let name = format!("{}.down{port}", sw.name);
                    let at = At { bdf: pbdf, host_bridge: h, parent: Some(up) };
                    let mut down = bridge(name, sk.clone(), FunctionKind::SwitchDownstream, at, ids, link, sw.acs);
                    down.acs_control = self.acs_control(sw.acs, &sw.acs_control, &format!("{sk}.acs_control"))?;
                    let down = self.push(down);
                    self.bridge_below(down, children.get(usize::from(port)).copied().into_iter().collect(), h, &k)?;
                }
                self.functions[up].buses = Some((internal, (self.next_bus - 1) as u8));
                Ok(())
            }
            Child::Endpoint(i) => {
                let ep = &self.file.endpoint[i];
                let (kind, class) = endpoint_kind(ep).map_err(|r| {
                    let (field, reason) = r.split_once(": ").unwrap_or(("kind", &r));
                    self.err(key("endpoint", i, &ep.name, field), reason.to_owned())
                })?;
                if ep.backing != "emulated" {
                    return Err(self.err(
                        key("endpoint", i, &ep.name, "backing"),
                        format!("'{}' is not a backing this version knows (emulated)", ep.backing),
                    ));
                }
                let bars = parse_bars(&ep.bars, &key("endpoint", i, &ep.name, "bars")).map_err(|r| {
                    let (k, reason) = r.split_once(": ").unwrap_or(("", &r));
                    self.err(k.to_owned(), reason.to_owned())
                })?;
                let f = Function {
                    name: ep.name.clone(),
                    key: format!("endpoint[{i}] ({})", ep.name),
                    kind: FunctionKind::Endpoint(kind),
                    bdf,
                    host_bridge: h,
                    parent,
                    vendor: ep.vendor,
                    device: ep.device,
                    class,
                    subsystem: ep.subsystem.map(|[v, d]| (v, d)),
                    link: Some(self.links[&ep.name]),
                    acs: false,
                    acs_control: 0,
                    ats: ep.ats,
                    virtual_function: ep.virtual_function,
                    bars,
                    buses: None,
                    windows: None,
                };
                self.push(f);
                Ok(())
            }
        }
    }

    /// Gives bridge `me` a secondary bus and numbers what sits on it (device 0).
    fn bridge_below(&mut self, me: usize, below: Vec<Child>, h: usize, k: &str) -> Result<(), NodeError> {
        let secondary = self.alloc_bus(k)?;
        for child in below {
            self.number(child, Bdf { bus: secondary, device: 0, function: 0 }, h, Some(me))?;
        }
        self.functions[me].buses = Some((secondary, (self.next_bus - 1) as u8));
        Ok(())
    }
}
