//! From node-file text to a checked [`Node`]: names resolved, parents checked, buses and
//! device numbers assigned depth-first under each host bridge.

use std::collections::HashMap;

use super::error::{KeyError, NodeError};
use super::schema::{BarEntry, EndpointEntry, NodeFile};
use super::{
    identity, parse_mac, Backing, Bar, Bdf, EndpointKind, Function, FunctionKind, HostBridge, Link, NetAttach,
    NetParams, Node, NumaNode, NET_MTU_RANGE,
};
use crate::host_pci::HostPci;

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

/// The MAC and MTU of endpoint `ep` (entry `k` of node `node`) when it is virtio-net
/// (`is_net`); refused on any other backing. A MAC not given is derived from the node's and
/// endpoint's names: locally administered (52:54:00, QEMU's prefix), stable across runs.
fn net_params(
    ep: &EndpointEntry,
    k: &str,
    node: &str,
    is_net: bool,
    kind: EndpointKind,
) -> Result<Option<NetParams>, KeyError> {
    if !is_net {
        for (set, f) in [(ep.mac.is_some(), "mac"), (ep.mtu.is_some(), "mtu")] {
            if set {
                return Err(KeyError::new(format!("{k}.{f}"), "only a virtio-net endpoint takes it"));
            }
        }
        return Ok(None);
    }
    if kind != EndpointKind::Nic {
        return Err(KeyError::new(
            format!("{k}.backing"),
            "virtio-net stands behind NIC endpoints only (kind = \"nic\")",
        ));
    }
    let mac = match &ep.mac {
        Some(text) => {
            let mac = parse_mac(text).ok_or_else(|| {
                KeyError::new(format!("{k}.mac"), format!("'{text}' is not a MAC address like 52:54:00:12:34:56"))
            })?;
            if mac[0] & 1 != 0 {
                return Err(KeyError::new(format!("{k}.mac"), format!("'{text}' is a multicast address")));
            }
            mac
        }
        None => {
            // FNV-1a over the names: stable, and different for each endpoint of a node.
            let hash = format!("{node}/{}", ep.name)
                .bytes()
                .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
            let b = hash.to_le_bytes();
            [0x52, 0x54, 0x00, b[0], b[1], b[2]]
        }
    };
    let mtu = ep.mtu.unwrap_or(1500);
    if !NET_MTU_RANGE.contains(&mtu) {
        return Err(KeyError::new(format!("{k}.mtu"), format!("{mtu} is out of range: 68 to 9000")));
    }
    Ok(Some(NetParams { mac, mtu }))
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
        backing: Backing::None,
        device_caps: None,
        trap_bars: false,
        emulator_args: Vec::new(),
        net: None,
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

/// Entries by name, and where each sits.
type Places = HashMap<String, Place>;

/// The tree being built: who sits below whom, then the numbered functions.
struct Builder<'a> {
    file: &'a NodeFile,
    /// Where passed-through devices are looked up.
    host: &'a HostPci,
    links: HashMap<String, Link>,
    hb_children: Vec<Vec<(Option<u8>, Child, String)>>,
    rp_child: Vec<Option<Child>>,
    sw_children: Vec<Vec<Child>>,
    next_bus: u16,
    functions: Vec<Function>,
}

/// An entry of the node file, e.g. `endpoint[3] (gpu3)`.
fn entry(section: &str, i: usize, name: &str) -> String {
    format!("{section}[{i}] ({name})")
}

/// A key of an entry, e.g. `endpoint[3] (gpu3).link`.
fn key(section: &str, i: usize, name: &str, field: &str) -> String {
    format!("{}.{field}", entry(section, i, name))
}

/// Checks `text` (from `origin`) and builds the node; passed-through devices are looked
/// up in `host`.
pub fn build(origin: &str, text: &str, host: &HostPci) -> Result<Node, NodeError> {
    build_with(origin, text, host, &[])
}

/// [`build`], with the endpoints `nets` names turned into virtio-net first.
pub fn build_with(origin: &str, text: &str, host: &HostPci, nets: &[NetAttach]) -> Result<Node, NodeError> {
    let mut file = parse_toml(origin, text)?;
    attach_nets(&mut file, nets).map_err(|e| e.in_file(origin))?;
    let node = build_file(&file, host).map_err(|e| e.in_file(origin))?;
    Ok(Node { source: origin.to_owned(), ..node })
}

/// Sets `backing = "virtio-net"` (and the MAC and MTU given) on each endpoint `nets` names.
fn attach_nets(file: &mut NodeFile, nets: &[NetAttach]) -> Result<(), KeyError> {
    for net in nets {
        let Some(ep) = file.endpoint.iter_mut().find(|e| e.name == net.endpoint) else {
            let names: Vec<&str> = file.endpoint.iter().map(|e| e.name.as_str()).collect();
            return Err(KeyError::new(
                format!("--net {}", net.endpoint),
                format!("the node has no endpoint of that name (endpoints: {})", names.join(", ")),
            ));
        };
        ep.backing = "virtio-net".into();
        ep.emulator_args.clear();
        if net.mac.is_some() {
            ep.mac = net.mac.clone();
        }
        if net.mtu.is_some() {
            ep.mtu = net.mtu;
        }
    }
    Ok(())
}

fn parse_toml(origin: &str, text: &str) -> Result<NodeFile, NodeError> {
    toml::from_str(text).map_err(|e| {
        // toml's message quotes the source over several lines; one line reads better.
        let message = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        NodeError::whole_file(origin, format!("TOML: {message}"))
    })
}

/// NUMA nodes, names, who sits below whom, bus and device numbers, then addresses.
fn build_file(file: &NodeFile, host: &HostPci) -> Result<Node, KeyError> {
    let numa = numa_nodes(file)?;
    let places = resolve_names(file, numa.len())?;
    let mut b = Builder::new(file, host);
    b.attach_root_ports(&places)?;
    b.attach_switches(&places)?;
    b.attach_endpoints(&places)?;
    let host_bridges = b.number_host_bridges()?;
    let mut node = Node {
        name: file.name.clone(),
        description: file.description.clone(),
        numa,
        host_bridges,
        functions: b.functions,
        nested: file.nested.clone(),
        source: String::new(),
    };
    super::address::assign(&mut node)?;
    Ok(node)
}

/// The NUMA nodes, by id, with their sizes and SLIT rows checked.
fn numa_nodes(file: &NodeFile) -> Result<Vec<NumaNode>, KeyError> {
    if file.numa.is_empty() {
        return Err(KeyError::new("numa", "a node needs at least one [[numa]] entry"));
    }
    let n = file.numa.len();
    let mut out = Vec::new();
    for (i, e) in file.numa.iter().enumerate() {
        let k = |f: &str| format!("numa[{i}].{f}");
        if e.cpus == 0 {
            return Err(KeyError::new(k("cpus"), "a NUMA node needs at least one vCPU"));
        }
        let memory = crate::parse_size(&e.memory)
            .ok_or_else(|| KeyError::new(k("memory"), format!("'{}' is not a size (e.g. 512M, 64G)", e.memory)))?;
        if memory < crate::MIN_GUEST_MEMORY / 2 {
            return Err(KeyError::new(k("memory"), format!("{} is less than 32M", e.memory)));
        }
        let distances = e.distances.clone().unwrap_or_else(|| (0..n).map(|j| if j == i { 10 } else { 20 }).collect());
        if distances.len() != n {
            return Err(KeyError::new(k("distances"), format!("{} distances for {n} NUMA nodes", distances.len())));
        }
        if distances[i] != 10 || distances.iter().enumerate().any(|(j, d)| j != i && *d <= 10) {
            return Err(KeyError::new(
                k("distances"),
                "the distance to itself is 10 and to others more than 10 (ACPI SLIT)",
            ));
        }
        out.push(NumaNode { id: i as u32, cpus: e.cpus, memory, distances, host_numa: e.host_numa });
    }
    Ok(out)
}

/// Where each named entry sits; names are unique across sections. Each host bridge's NUMA
/// node is checked with its name, so that errors come in file order.
fn resolve_names(file: &NodeFile, numa_nodes: usize) -> Result<Places, KeyError> {
    let mut names: HashMap<String, (String, Place)> = HashMap::new();
    let mut add = |name: &str, k: String, place: Place| -> Result<(), KeyError> {
        if let Some((other, _)) = names.get(name) {
            return Err(KeyError::new(k, format!("name '{name}' is already used by {other}")));
        }
        names.insert(name.to_owned(), (k, place));
        Ok(())
    };
    for (i, hb) in file.host_bridge.iter().enumerate() {
        add(&hb.name, format!("host_bridge[{i}].name"), Place::HostBridge(i))?;
        if hb.numa as usize >= numa_nodes {
            return Err(KeyError::new(
                key("host_bridge", i, &hb.name, "numa"),
                format!("NUMA node {} does not exist (the file has {numa_nodes}: 0 to {})", hb.numa, numa_nodes - 1),
            ));
        }
    }
    for (i, rp) in file.root_port.iter().enumerate() {
        add(&rp.name, format!("root_port[{i}].name"), Place::RootPort(i))?;
    }
    for (i, sw) in file.switch.iter().enumerate() {
        add(&sw.name, format!("switch[{i}].name"), Place::Switch(i))?;
    }
    for (i, ep) in file.endpoint.iter().enumerate() {
        add(&ep.name, format!("endpoint[{i}].name"), Place::Endpoint)?;
    }
    Ok(names.into_iter().map(|(name, (_, place))| (name, place)).collect())
}

/// An endpoint's BARs; `k` is its `bars` key.
pub(super) fn parse_bars(bars: &[BarEntry], k: &str) -> Result<Vec<Bar>, KeyError> {
    let mut out = Vec::new();
    let mut index = 0u8;
    for (j, bar) in bars.iter().enumerate() {
        let field = |f: &str| format!("{k}[{j}].{f}");
        let size = crate::parse_size(&bar.size)
            .ok_or_else(|| KeyError::new(field("size"), format!("'{}' is not a size", bar.size)))?;
        if !size.is_power_of_two() || size < 16 {
            let reason = format!("{} is not a power of two of at least 16 bytes", bar.size);
            return Err(KeyError::new(field("size"), reason));
        }
        let is_64bit = match bar.bits {
            64 => true,
            32 if size <= 1 << 31 => false,
            32 => return Err(KeyError::new(field("size"), format!("{} does not fit a 32-bit BAR", bar.size))),
            other => return Err(KeyError::new(field("bits"), format!("{other} is not 32 or 64"))),
        };
        let needed = if is_64bit { 2 } else { 1 };
        if index + needed > BAR_SLOTS {
            return Err(KeyError::new(format!("{k}[{j}]"), "more BARs than the six BAR registers hold"));
        }
        out.push(Bar { index, size, prefetchable: bar.prefetchable, is_64bit, address: 0 });
        index += needed;
    }
    Ok(out)
}

/// An endpoint's kind and the class code it implies (none for a generic one); `entry`
/// names it in the file.
fn endpoint_kind(ep: &EndpointEntry, entry: &str) -> Result<(EndpointKind, Option<u32>), KeyError> {
    let (kind, default_class) = match ep.kind.as_str() {
        "gpu" => (EndpointKind::Gpu, Some(0x03_02_00)),
        "nic" => (EndpointKind::Nic, Some(0x02_00_00)),
        "nvswitch" => (EndpointKind::NvSwitch, Some(0x06_80_00)),
        "generic" => (EndpointKind::Generic, None),
        other => {
            let reason = format!("'{other}' is not gpu, nic, nvswitch or generic");
            return Err(KeyError::new(format!("{entry}.kind"), reason));
        }
    };
    if let Some(class) = ep.class.filter(|c| *c > 0xff_ffff) {
        return Err(KeyError::new(format!("{entry}.class"), format!("{class:#x} is more than 24 bits")));
    }
    Ok((kind, default_class))
}

impl<'a> Builder<'a> {
    fn new(file: &'a NodeFile, host: &'a HostPci) -> Self {
        Builder {
            file,
            host,
            links: HashMap::new(),
            hb_children: vec![Vec::new(); file.host_bridge.len()],
            rp_child: vec![None; file.root_port.len()],
            sw_children: vec![Vec::new(); file.switch.len()],
            next_bus: 0,
            functions: Vec::new(),
        }
    }

    /// Puts each root port on its host bridge's root bus.
    fn attach_root_ports(&mut self, places: &Places) -> Result<(), KeyError> {
        let file = self.file;
        for (i, rp) in file.root_port.iter().enumerate() {
            let Some(Place::HostBridge(h)) = places.get(&rp.host_bridge).copied() else {
                let reason = format!("'{}' is not a host bridge", rp.host_bridge);
                return Err(KeyError::new(key("root_port", i, &rp.name, "host_bridge"), reason));
            };
            self.link(&rp.name, &rp.link, key("root_port", i, &rp.name, "link"))?;
            self.hb_children[h].push((rp.slot, Child::RootPort(i), key("root_port", i, &rp.name, "slot")));
        }
        Ok(())
    }

    /// Puts each switch below its root port or on a downstream port of another switch.
    fn attach_switches(&mut self, places: &Places) -> Result<(), KeyError> {
        let file = self.file;
        for (i, sw) in file.switch.iter().enumerate() {
            let k = key("switch", i, &sw.name, "parent");
            self.link(&sw.name, &sw.link, key("switch", i, &sw.name, "link"))?;
            if sw.ports == 0 || sw.ports > SLOTS {
                let reason = format!("{} downstream ports: a switch has 1 to 32", sw.ports);
                return Err(KeyError::new(key("switch", i, &sw.name, "ports"), reason));
            }
            match places.get(&sw.parent).copied() {
                Some(Place::RootPort(r)) => self.attach_to_root_port(r, Child::Switch(i), k)?,
                Some(Place::Switch(s)) if s != i => self.attach_to_switch(s, Child::Switch(i), k)?,
                _ => return Err(KeyError::new(k, format!("'{}' is not a root port or another switch", sw.parent))),
            }
        }
        Ok(())
    }

    /// Puts each endpoint on a host bridge's root bus, below a root port, or on a switch.
    fn attach_endpoints(&mut self, places: &Places) -> Result<(), KeyError> {
        let file = self.file;
        for (i, ep) in file.endpoint.iter().enumerate() {
            let k = key("endpoint", i, &ep.name, "parent");
            self.link(&ep.name, &ep.link, key("endpoint", i, &ep.name, "link"))?;
            match places.get(&ep.parent).copied() {
                Some(Place::HostBridge(h)) => {
                    self.hb_children[h].push((ep.slot, Child::Endpoint(i), key("endpoint", i, &ep.name, "slot")))
                }
                Some(Place::RootPort(r)) => self.attach_to_root_port(r, Child::Endpoint(i), k)?,
                Some(Place::Switch(s)) => self.attach_to_switch(s, Child::Endpoint(i), k)?,
                _ => {
                    let reason = format!("'{}' is not a host bridge, root port or switch", ep.parent);
                    return Err(KeyError::new(k, reason));
                }
            }
        }
        Ok(())
    }

    /// Numbers each host bridge's buses in file order, depth-first below it, and returns
    /// the host bridges with their bus ranges.
    fn number_host_bridges(&mut self) -> Result<Vec<HostBridge>, KeyError> {
        let file = self.file;
        let mut host_bridges = Vec::new();
        for (h, hb) in file.host_bridge.iter().enumerate() {
            let k = key("host_bridge", h, &hb.name, "bus");
            self.next_bus = match hb.bus {
                Some(bus) if u16::from(bus) < self.next_bus => {
                    let reason = format!(
                        "bus {bus:#04x} is already below an earlier host bridge (next free bus: {:#04x})",
                        self.next_bus
                    );
                    return Err(KeyError::new(k, reason));
                }
                Some(bus) => u16::from(bus),
                None => self.next_bus,
            };
            let root = self.alloc_bus(&k)?;
            self.number_root_bus(h, root)?;
            host_bridges.push(HostBridge {
                name: hb.name.clone(),
                numa: hb.numa,
                first_bus: root,
                last_bus: (self.next_bus - 1) as u8,
                mem32: None,
                mem64: None,
                p2p: file.p2p && hb.p2p,
            });
        }
        Ok(host_bridges)
    }

    /// The ACS Control value for `names` on a port whose ACS capability is `present`.
    fn acs_control(&self, present: bool, names: &[String], k: &str) -> Result<u16, KeyError> {
        if !present && !names.is_empty() {
            return Err(KeyError::new(k, "ACS controls on a port without ACS (acs = false)"));
        }
        let mut bits = 0u16;
        for name in names {
            let bit = super::ACS_CONTROLS.iter().position(|c| c == name).ok_or_else(|| {
                KeyError::new(k, format!("'{name}' is not an ACS control ({})", super::ACS_CONTROLS.join(", ")))
            })?;
            bits |= 1 << bit;
        }
        Ok(bits)
    }

    fn link(&mut self, name: &str, text: &str, k: String) -> Result<(), KeyError> {
        let link = Link::parse(text).map_err(|reason| KeyError::new(k, reason))?;
        self.links.insert(name.to_owned(), link);
        Ok(())
    }

    fn attach_to_root_port(&mut self, r: usize, child: Child, k: String) -> Result<(), KeyError> {
        if self.rp_child[r].is_some() {
            let name = &self.file.root_port[r].name;
            let reason = format!("root port '{name}' already has a device below it: a root port has one link");
            return Err(KeyError::new(k, reason));
        }
        self.rp_child[r] = Some(child);
        Ok(())
    }

    fn attach_to_switch(&mut self, s: usize, child: Child, k: String) -> Result<(), KeyError> {
        let sw = &self.file.switch[s];
        if self.sw_children[s].len() >= usize::from(sw.ports) {
            let reason = format!("switch '{}' has only {} downstream ports, all taken", sw.name, sw.ports);
            return Err(KeyError::new(k, reason));
        }
        self.sw_children[s].push(child);
        Ok(())
    }

    fn alloc_bus(&mut self, k: &str) -> Result<u8, KeyError> {
        let bus = u8::try_from(self.next_bus)
            .map_err(|_| KeyError::new(k, "the topology needs more than 256 buses (PCI segment 0 has 256)"))?;
        self.next_bus += 1;
        Ok(bus)
    }

    /// Numbers the devices on host bridge `h`'s root bus `bus` (its own function at device
    /// 0 on bus 0, then the slots the file fixes, then the rest in order), and what sits
    /// below each.
    fn number_root_bus(&mut self, h: usize, bus: u8) -> Result<(), KeyError> {
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
                    entry("host_bridge", h, &self.file.host_bridge[h].name),
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
                None => return Err(KeyError::new(k, format!("slot {slot} is beyond the 32 devices of a bus"))),
                Some(Some(other)) => {
                    let bdf = Bdf { bus, device: slot, function: 0 };
                    return Err(KeyError::new(k, format!("{bdf} is already taken by '{other}'")));
                }
                Some(None) => {}
            }
            taken[usize::from(slot)] = Some(name);
            placed.push((slot, *child));
        }
        for (_, child, k) in children.iter().filter(|(s, ..)| s.is_none()) {
            let free = taken.iter().position(Option::is_none).ok_or_else(|| {
                KeyError::new(k, format!("bus {bus:#04x} has no free device number left (32 per bus)"))
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
    fn number(&mut self, child: Child, bdf: Bdf, h: usize, parent: Option<usize>) -> Result<(), KeyError> {
        let at = At { bdf, host_bridge: h, parent };
        match child {
            Child::RootPort(i) => self.number_root_port(i, at),
            Child::Switch(i) => self.number_switch(i, at),
            Child::Endpoint(i) => self.number_endpoint(i, at),
        }
    }

    /// Root port `i` at `at`, and what sits below it on its secondary bus.
    fn number_root_port(&mut self, i: usize, at: At) -> Result<(), KeyError> {
        let rp = &self.file.root_port[i];
        let link = self.links[&rp.name];
        let k = entry("root_port", i, &rp.name);
        let mut f = bridge(rp.name.clone(), k.clone(), FunctionKind::RootPort, at, ROOT_PORT_ID, link, rp.acs);
        f.acs_control = self.acs_control(rp.acs, &rp.acs_control, &format!("{k}.acs_control"))?;
        let me = self.push(f);
        let below = self.rp_child[i];
        self.bridge_below(me, below.into_iter().collect(), at.host_bridge, &format!("{k}.link"))
    }

    /// Switch `i`'s upstream port at `at`, its internal bus of downstream ports, and what
    /// sits below each of them.
    fn number_switch(&mut self, i: usize, at: At) -> Result<(), KeyError> {
        let sw = &self.file.switch[i];
        let link = self.links[&sw.name];
        let ids = (sw.vendor.unwrap_or(SWITCH_ID.0), sw.device.unwrap_or(SWITCH_ID.1));
        let sk = entry("switch", i, &sw.name);
        let up = bridge(format!("{}.up", sw.name), sk.clone(), FunctionKind::SwitchUpstream, at, ids, link, false);
        let up = self.push(up);
        let k = format!("{sk}.ports");
        let internal = self.alloc_bus(&k)?;
        let children = self.sw_children[i].clone();
        for port in 0..sw.ports {
            let pbdf = Bdf { bus: internal, device: port, function: 0 };
            let name = format!("{}.down{port}", sw.name);
            let at = At { bdf: pbdf, host_bridge: at.host_bridge, parent: Some(up) };
            let mut down = bridge(name, sk.clone(), FunctionKind::SwitchDownstream, at, ids, link, sw.acs);
            down.acs_control = self.acs_control(sw.acs, &sw.acs_control, &format!("{sk}.acs_control"))?;
            let down = self.push(down);
            let below = children.get(usize::from(port)).copied().into_iter().collect();
            self.bridge_below(down, below, at.host_bridge, &k)?;
        }
        self.functions[up].buses = Some((internal, (self.next_bus - 1) as u8));
        Ok(())
    }

    /// Endpoint `i` at `at`, with its kind, class and BARs checked.
    fn number_endpoint(&mut self, i: usize, at: At) -> Result<(), KeyError> {
        let ep = &self.file.endpoint[i];
        let k = entry("endpoint", i, &ep.name);
        let (kind, default_class) = endpoint_kind(ep, &k)?;
        let backing: Backing =
            ep.backing.parse().map_err(|reason: String| KeyError::new(format!("{k}.backing"), reason))?;
        let id = identity::resolve(ep, &k, backing.clone(), default_class, self.host)?;
        let net = net_params(ep, &k, &self.file.name, backing == Backing::VirtioNet, kind)?;
        if !ep.emulator_args.is_empty() && !matches!(backing, Backing::EmulatedGpu | Backing::EmulatedNic) {
            return Err(KeyError::new(
                format!("{k}.emulator_args"),
                format!(
                    "only an emulated backing (emulated-gpu, emulated-nic) starts an emulator; this one is {backing}"
                ),
            ));
        }
        let f = Function {
            name: ep.name.clone(),
            key: k,
            kind: FunctionKind::Endpoint(kind),
            bdf: at.bdf,
            host_bridge: at.host_bridge,
            parent: at.parent,
            vendor: id.vendor,
            device: id.device,
            class: id.class,
            subsystem: id.subsystem,
            link: Some(self.links[&ep.name]),
            acs: false,
            acs_control: 0,
            ats: ep.ats,
            virtual_function: ep.virtual_function,
            bars: id.bars,
            buses: None,
            windows: None,
            backing,
            device_caps: id.caps,
            trap_bars: ep.trap_bars,
            emulator_args: ep.emulator_args.clone(),
            net,
        };
        self.push(f);
        Ok(())
    }

    /// Gives bridge `me` a secondary bus and numbers what sits on it (device 0).
    fn bridge_below(&mut self, me: usize, below: Vec<Child>, h: usize, k: &str) -> Result<(), KeyError> {
        let secondary = self.alloc_bus(k)?;
        for child in below {
            self.number(child, Bdf { bus: secondary, device: 0, function: 0 }, h, Some(me))?;
        }
        self.functions[me].buses = Some((secondary, (self.next_bus - 1) as u8));
        Ok(())
    }
}
