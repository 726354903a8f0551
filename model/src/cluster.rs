//! Clusters: several nodes whose NICs are joined by wires (userspace L2 links between VMM
//! processes), read from TOML and checked into a [`Cluster`] in which every wire end has
//! its MAC and IPv4 address. Errors name the file, the key and the reason, as node-file
//! errors do.
//!
//! ```toml
//! name = "two-node"
//! description = "two minimal nodes, NIC to NIC"
//! [[node]]
//! name = "a"            # unique, [a-z0-9-]+
//! node = "minimal"      # a preset, or a node file (relative to the cluster file's directory)
//! [[node]]
//! name = "b"
//! node = "minimal"
//! [[wire]]
//! name = "w0"                   # unique, [a-z0-9-]+
//! ends = ["a.nic0", "b.nic0"]   # NODE.ENDPOINT: NIC endpoints, each on at most one wire
//! subnet = "10.77.0.0/24"       # optional; default 10.77.<wire index>.0/24
//! mtu = 9000                    # optional; default 1500, 68 to 9000
//! ```
//!
//! Addresses: the ends of a wire get the subnet's host addresses .1, .2, ... in the order of
//! `ends`. MACs: `52:54:00:WW:NN:FF`, WW the wire's index, NN the node's index in the cluster,
//! FF the function's index among its node's NIC endpoints (node-file order); the first octet
//! is locally administered and unicast, and the triple is unique over the cluster (a cluster
//! holds at most 256 nodes and 256 wires, a node at most 256 NICs).

use std::collections::HashMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

pub use crate::node::format_mac;
use crate::node::{EndpointKind, FunctionKind, NetAttach, Node};

/// A preset: name, TOML text.
const PRESETS: &[(&str, &str)] = &[("two-node", include_str!("../presets/clusters/two-node.toml"))];

/// Default MTU of a wire.
pub const DEFAULT_MTU: u16 = 1500;
/// Smallest MTU a wire may have (IPv4's minimum).
pub const MIN_MTU: u16 = 68;
/// Largest MTU a wire may have (a jumbo frame).
pub const MAX_MTU: u16 = 9000;
/// Most nodes, and most wires, in one cluster (each is one octet of the MAC).
pub const MAX_CLUSTER_ITEMS: usize = 256;

/// A cluster file that cannot be used: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {}{reason}", key.as_ref().map(|k| format!("key {k}: ")).unwrap_or_default())]
pub struct ClusterError {
    /// The file (or preset) it came from.
    pub origin: String,
    /// The key at fault, e.g. `wire[0].ends[1]`; `None` for whole-file errors.
    pub key: Option<String>,
    /// What is wrong (for a node that fails to build, the node file's own error).
    pub reason: String,
}

impl ClusterError {
    fn whole_file(origin: &str, reason: impl Into<String>) -> Self {
        ClusterError { origin: origin.to_owned(), key: None, reason: reason.into() }
    }
}

/// What is wrong at one key, before the file is known (mirrors the node files' `KeyError`).
#[derive(Debug)]
struct KeyError {
    key: String,
    reason: String,
}

impl KeyError {
    fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        KeyError { key: key.into(), reason: reason.into() }
    }

    fn in_file(self, origin: &str) -> ClusterError {
        ClusterError { origin: origin.to_owned(), key: Some(self.key), reason: self.reason }
    }
}

/// An IPv4 subnet, e.g. `10.77.0.0/24` (no host bits set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subnet {
    /// The network address.
    pub network: Ipv4Addr,
    /// The prefix length, 0 to 32.
    pub prefix: u8,
}

impl Subnet {
    /// The subnet mask as a number.
    fn mask(self) -> u32 {
        u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0)
    }

    /// Host addresses it holds (network and broadcast excluded; none for /31 and /32).
    pub fn hosts(self) -> u64 {
        if self.prefix > 30 {
            0
        } else {
            (1u64 << (32 - self.prefix)) - 2
        }
    }

    /// Host address number `n` (1 = the first), if the subnet holds it.
    pub fn host(self, n: u64) -> Option<Ipv4Addr> {
        (n >= 1 && n <= self.hosts()).then(|| Ipv4Addr::from(u32::from(self.network) + n as u32))
    }

    /// Whether the two share an address.
    pub fn overlaps(self, other: Subnet) -> bool {
        let mask = self.mask() & other.mask();
        u32::from(self.network) & mask == u32::from(other.network) & mask
    }
}

impl FromStr for Subnet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("'{s}' is not an IPv4 subnet (write it like \"10.77.0.0/24\")");
        let (ip, prefix) = s.split_once('/').ok_or_else(bad)?;
        let ip: Ipv4Addr = ip.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().ok().filter(|p| *p <= 32).ok_or_else(bad)?;
        let subnet = Subnet { network: ip, prefix };
        let network = Ipv4Addr::from(u32::from(ip) & subnet.mask());
        if network != ip {
            return Err(format!("'{s}' has host bits set (the subnet is {network}/{prefix})"));
        }
        Ok(subnet)
    }
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

/// A checked cluster: every node built, every wire end addressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    /// Name.
    pub name: String,
    /// What it models.
    pub description: String,
    /// The nodes, in file order.
    pub nodes: Vec<ClusterNode>,
    /// The wires, in file order.
    pub wires: Vec<Wire>,
    /// What [`Cluster::resolve`] takes to build this cluster again: the preset's name or the
    /// cluster file's path.
    pub source: String,
}

/// One node of a cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterNode {
    /// Its name in the cluster (`[a-z0-9-]+`, unique): the guest's `gdrvm.node`.
    pub name: String,
    /// The node it runs, its NICs on wires turned into virtio-net with their wire end's MAC
    /// and the wire's MTU (as `Node::resolve_with(source, &nets)` builds it, `nets` made from
    /// [`Cluster::node_nets`]).
    pub node: Node,
    /// What [`Node::resolve`] takes to build the node again: a preset's name or the node
    /// file's canonical path.
    pub source: String,
}

/// An L2 link joining NIC endpoints of the cluster's nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wire {
    /// Name (`[a-z0-9-]+`, unique).
    pub name: String,
    /// MTU of every NIC on it.
    pub mtu: u16,
    /// The subnet its ends' addresses come from.
    pub subnet: Subnet,
    /// The NICs on it, in file order.
    pub ends: Vec<WireEnd>,
}

/// One NIC on a wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireEnd {
    /// Index of its node in [`Cluster::nodes`].
    pub node: usize,
    /// The NIC endpoint's name in its node file (e.g. `nic0`).
    pub function: String,
    /// Its MAC address.
    pub mac: [u8; 6],
    /// Its IPv4 address.
    pub ip: Ipv4Addr,
    /// The prefix length of its subnet.
    pub prefix: u8,
}

impl Cluster {
    /// Names of the shipped cluster presets.
    pub fn presets() -> Vec<&'static str> {
        PRESETS.iter().map(|(n, _)| *n).collect()
    }

    /// The text of a shipped preset.
    pub fn preset_text(name: &str) -> Option<&'static str> {
        PRESETS.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
    }

    /// A shipped preset by name (its nodes are node presets).
    pub fn preset(name: &str) -> Option<Result<Cluster, ClusterError>> {
        PRESETS.iter().find(|(n, _)| *n == name).map(|(n, text)| {
            parse(&format!("preset {n}"), text, None).map(|cluster| Cluster { source: (*n).to_owned(), ..cluster })
        })
    }

    /// Reads and checks a cluster file; its node files are found relative to its directory.
    pub fn load(path: &Path) -> Result<Cluster, ClusterError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ClusterError::whole_file(&origin, e.to_string()))?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let cluster = Cluster::parse(&origin, &text, dir)?;
        let source = std::fs::canonicalize(path).map(|p| p.display().to_string()).unwrap_or(origin);
        Ok(Cluster { source, ..cluster })
    }

    /// A preset name, or else a path to a cluster file.
    pub fn resolve(arg: &str) -> Result<Cluster, ClusterError> {
        match Cluster::preset(arg) {
            Some(cluster) if !Path::new(arg).exists() => cluster,
            _ if !Path::new(arg).exists() => Err(ClusterError::whole_file(
                arg,
                format!("no such cluster file, and not a cluster preset ({})", Cluster::presets().join(", ")),
            )),
            _ => Cluster::load(Path::new(arg)),
        }
    }

    /// Checks cluster-file text; `origin` names it in errors and node files are looked up
    /// relative to `dir`.
    pub fn parse(origin: &str, text: &str, dir: &Path) -> Result<Cluster, ClusterError> {
        parse(origin, text, Some(dir))
    }

    /// The wire ends of node `node`, with their wires' indices, in wire order then end order.
    pub fn node_ends(&self, node: usize) -> impl Iterator<Item = (usize, &WireEnd)> + '_ {
        self.wires
            .iter()
            .enumerate()
            .flat_map(move |(w, wire)| wire.ends.iter().filter(move |e| e.node == node).map(move |e| (w, e)))
    }

    /// The address by which node `from` reaches node `to`: `to`'s first end on a wire that
    /// `from` is on too, else `to`'s first address; `None` when `to` is on no wire.
    pub fn peer_address(&self, from: usize, to: usize) -> Option<Ipv4Addr> {
        let shared = |w: usize| self.wires[w].ends.iter().any(|e| e.node == from);
        self.node_ends(to).find(|(w, _)| shared(*w)).or_else(|| self.node_ends(to).next()).map(|(_, e)| e.ip)
    }

    /// The guest kernel command-line keys of node `node` (an index into [`Cluster::nodes`]):
    /// `gdrvm.node=a gdrvm.net=nic0:10.77.0.1/24 gdrvm.peers=b:10.77.0.2`. `gdrvm.net` is left
    /// out for a node on no wire, `gdrvm.peers` when no other node has an address (and a peer
    /// without one is left out of it).
    pub fn node_cmdline(&self, node: usize) -> String {
        let mut keys = vec![format!("gdrvm.node={}", self.nodes[node].name)];
        let nets: Vec<String> =
            self.node_ends(node).map(|(_, e)| format!("{}:{}/{}", e.function, e.ip, e.prefix)).collect();
        if !nets.is_empty() {
            keys.push(format!("gdrvm.net={}", nets.join(",")));
        }
        let peers: Vec<String> = (0..self.nodes.len())
            .filter(|j| *j != node)
            .filter_map(|j| self.peer_address(node, j).map(|ip| format!("{}:{ip}", self.nodes[j].name)))
            .collect();
        if !peers.is_empty() {
            keys.push(format!("gdrvm.peers={}", peers.join(",")));
        }
        keys.join(" ")
    }

    /// The NICs of node `node` that are on a wire, in [`Cluster::node_ends`] order: function
    /// name, MAC, MTU and the wire's index.
    pub fn node_nets(&self, node: usize) -> Vec<(String, [u8; 6], u16, usize)> {
        self.node_ends(node).map(|(w, e)| (e.function.clone(), e.mac, self.wires[w].mtu, w)).collect()
    }

    /// The index of the node named `name`.
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The cluster as `gdrvm cluster show` prints it: nodes, then wires with each end's
    /// MAC and address.
    pub fn render(&self) -> String {
        let mut out = format!("cluster {} ({})\n", self.name, self.description);
        for n in &self.nodes {
            out.push_str(&format!(
                "  node {}: {} ({} vCPUs, {} MiB)\n",
                n.name,
                n.source,
                n.node.cpus(),
                n.node.memory() >> 20
            ));
        }
        for w in &self.wires {
            out.push_str(&format!("  wire {}: {}, MTU {}\n", w.name, w.subnet, w.mtu));
            for e in &w.ends {
                let node = &self.nodes[e.node].name;
                out.push_str(&format!("    {node}.{}  {}  {}/{}\n", e.function, format_mac(&e.mac), e.ip, e.prefix));
            }
        }
        out
    }
}

/// Checks cluster-file text; node files are looked up relative to `dir`, or not at all
/// (presets only) without one.
fn parse(origin: &str, text: &str, dir: Option<&Path>) -> Result<Cluster, ClusterError> {
    let file: ClusterFile = toml::from_str(text).map_err(|e| {
        // toml's message quotes the source over several lines; one line reads better.
        let message = e.to_string().split_whitespace().collect::<Vec<_>>().join(" ");
        ClusterError::whole_file(origin, format!("TOML: {message}"))
    })?;
    let cluster = build(&file, dir).map_err(|e| e.in_file(origin))?;
    Ok(Cluster { source: origin.to_owned(), ..cluster })
}

/// A whole cluster file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    name: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    node: Vec<NodeEntry>,
    #[serde(default)]
    wire: Vec<WireEntry>,
}

/// `[[node]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeEntry {
    name: String,
    node: String,
}

/// `[[wire]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireEntry {
    name: String,
    ends: Vec<String>,
    subnet: Option<String>,
    /// Wide, so that an out-of-range value gets this module's message, not a TOML one.
    mtu: Option<i64>,
}

/// Whether `s` is a name nodes, wires and clusters may have.
fn is_name(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn check_name(key: String, name: &str) -> Result<(), KeyError> {
    if is_name(name) {
        Ok(())
    } else {
        Err(KeyError::new(key, format!("'{name}' is not a name (lowercase letters, digits and '-')")))
    }
}

/// Builds the node of a `[[node]]` entry: a node file relative to `dir` when one is there,
/// else a preset. Returns it and its source (the preset's name or the file's canonical path).
fn resolve_node(arg: &str, dir: Option<&Path>) -> Result<(Node, String), String> {
    let path: Option<PathBuf> = dir.map(|d| d.join(arg));
    if let Some(path) = path.as_ref().filter(|p| p.exists()) {
        let node = Node::load(path).map_err(|e| e.to_string())?;
        let source = std::fs::canonicalize(path).map(|p| p.display().to_string()).unwrap_or(node.source.clone());
        return Ok((Node { source: source.clone(), ..node }, source));
    }
    let presets = crate::node::preset_names().join(", ");
    match (Node::preset(arg), path) {
        (Some(node), _) => node.map(|n| (n, arg.to_owned())).map_err(|e| e.to_string()),
        (None, Some(path)) => Err(format!("no node file {}, and not a preset ({presets})", path.display())),
        (None, None) => Err(format!("'{arg}' is not a preset ({presets})")),
    }
}

/// Node `i` built again with its wired NICs turned into virtio-net.
fn attach_nets(cluster: &Cluster, i: usize) -> Result<Node, KeyError> {
    let nets: Vec<NetAttach> = cluster
        .node_nets(i)
        .into_iter()
        .map(|(endpoint, mac, mtu, _)| NetAttach { endpoint, mac: Some(format_mac(&mac)), mtu: Some(mtu) })
        .collect();
    let node = &cluster.nodes[i];
    if nets.is_empty() {
        return Ok(node.node.clone());
    }
    Node::resolve_with(&node.source, &nets).map_err(|e| KeyError::new(format!("node[{i}].node"), e.to_string()))
}

/// Names, nodes, then wires in file order.
fn build(file: &ClusterFile, dir: Option<&Path>) -> Result<Cluster, KeyError> {
    check_name("name".into(), &file.name)?;
    if file.node.is_empty() {
        return Err(KeyError::new("node", "a cluster needs at least one [[node]] entry"));
    }
    if file.node.len() > MAX_CLUSTER_ITEMS {
        return Err(KeyError::new("node", format!("{} nodes: a cluster holds at most 256", file.node.len())));
    }
    if file.wire.len() > MAX_CLUSTER_ITEMS {
        return Err(KeyError::new("wire", format!("{} wires: a cluster holds at most 256", file.wire.len())));
    }
    let mut nodes: Vec<ClusterNode> = Vec::new();
    for (i, entry) in file.node.iter().enumerate() {
        check_name(format!("node[{i}].name"), &entry.name)?;
        if let Some(j) = nodes.iter().position(|n| n.name == entry.name) {
            return Err(KeyError::new(
                format!("node[{i}].name"),
                format!("name '{}' is already used by node[{j}]", entry.name),
            ));
        }
        let (node, source) = resolve_node(&entry.node, dir).map_err(|e| KeyError::new(format!("node[{i}].node"), e))?;
        nodes.push(ClusterNode { name: entry.name.clone(), node, source });
    }
    let mut wires: Vec<Wire> = Vec::new();
    // (node, function) -> the wire it is on.
    let mut taken: HashMap<(usize, String), usize> = HashMap::new();
    for (w, entry) in file.wire.iter().enumerate() {
        let k = |f: &str| format!("wire[{w}].{f}");
        check_name(k("name"), &entry.name)?;
        if let Some(j) = wires.iter().position(|x| x.name == entry.name) {
            return Err(KeyError::new(k("name"), format!("name '{}' is already used by wire[{j}]", entry.name)));
        }
        if entry.ends.len() < 2 {
            return Err(KeyError::new(k("ends"), format!("a wire joins at least two NICs, not {}", entry.ends.len())));
        }
        let mut ends = Vec::new();
        for (e, end) in entry.ends.iter().enumerate() {
            let key = format!("wire[{w}].ends[{e}]");
            let (node, function, nic) = wire_end(&nodes, end).map_err(|r| KeyError::new(key.clone(), r))?;
            if let Some(other) = taken.get(&(node, function.clone())) {
                let reason = if *other == w {
                    format!("'{end}' is on this wire twice")
                } else {
                    format!("'{end}' is already on wire '{}' (a NIC joins at most one wire)", file.wire[*other].name)
                };
                return Err(KeyError::new(key, reason));
            }
            taken.insert((node, function.clone()), w);
            let nic = u8::try_from(nic)
                .map_err(|_| KeyError::new(key, format!("'{end}' is NIC {nic} of its node; MACs number 256")))?;
            // Both fit an octet: at most 256 nodes and wires (checked above).
            let mac = [0x52, 0x54, 0x00, w as u8, node as u8, nic];
            ends.push(WireEnd { node, function, mac, ip: Ipv4Addr::UNSPECIFIED, prefix: 0 });
        }
        let subnet = match &entry.subnet {
            Some(s) => s.parse::<Subnet>().map_err(|r| KeyError::new(k("subnet"), r))?,
            None if w < 256 => Subnet { network: Ipv4Addr::new(10, 77, w as u8, 0), prefix: 24 },
            None => return Err(KeyError::new(k("subnet"), "wires after the 256th need their subnet")),
        };
        if (ends.len() as u64) > subnet.hosts() {
            let reason = format!("{subnet} holds {} host addresses, the wire has {} ends", subnet.hosts(), ends.len());
            return Err(KeyError::new(k("subnet"), reason));
        }
        if let Some(other) = wires.iter().find(|x| x.subnet.overlaps(subnet)) {
            let reason = format!("{subnet} overlaps wire '{}' ({})", other.name, other.subnet);
            return Err(KeyError::new(k("subnet"), reason));
        }
        for (n, end) in ends.iter_mut().enumerate() {
            // The host count was checked above.
            end.ip = subnet.host(n as u64 + 1).unwrap_or(Ipv4Addr::UNSPECIFIED);
            end.prefix = subnet.prefix;
        }
        let mtu = match entry.mtu {
            None => DEFAULT_MTU,
            Some(m) => u16::try_from(m)
                .ok()
                .filter(|m| (MIN_MTU..=MAX_MTU).contains(m))
                .ok_or_else(|| KeyError::new(k("mtu"), format!("{m} is not an MTU from {MIN_MTU} to {MAX_MTU}")))?,
        };
        wires.push(Wire { name: entry.name.clone(), mtu, subnet, ends });
    }
    let mut cluster =
        Cluster { name: file.name.clone(), description: file.description.clone(), nodes, wires, source: String::new() };
    for i in 0..cluster.nodes.len() {
        cluster.nodes[i].node = attach_nets(&cluster, i)?;
    }
    Ok(cluster)
}

/// `NODE.ENDPOINT`: the node's index, the endpoint's name and its index among the node's NICs.
fn wire_end(nodes: &[ClusterNode], end: &str) -> Result<(usize, String, usize), String> {
    let (node_name, function) =
        end.split_once('.').ok_or_else(|| format!("'{end}' is not NODE.ENDPOINT (e.g. a.nic0)"))?;
    let node = nodes.iter().position(|n| n.name == node_name).ok_or_else(|| {
        let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
        format!("'{node_name}' is not a node of this cluster ({})", names.join(", "))
    })?;
    let is_nic = |kind: FunctionKind| kind == FunctionKind::Endpoint(EndpointKind::Nic);
    let functions = &nodes[node].node.functions;
    let Some(f) = functions.iter().find(|f| f.name == function) else {
        let nics: Vec<&str> = functions.iter().filter(|f| is_nic(f.kind)).map(|f| f.name.as_str()).collect();
        let nics = if nics.is_empty() { "it has none".to_owned() } else { format!("its NICs: {}", nics.join(", ")) };
        return Err(format!("node '{node_name}' has no endpoint '{function}' ({nics})"));
    };
    if !is_nic(f.kind) {
        let what = match f.kind {
            FunctionKind::Endpoint(EndpointKind::Gpu) => "a GPU",
            FunctionKind::Endpoint(EndpointKind::NvSwitch) => "an NVSwitch",
            FunctionKind::Endpoint(_) => "a generic endpoint",
            FunctionKind::HostBridge => "a host bridge",
            FunctionKind::RootPort => "a root port",
            FunctionKind::SwitchUpstream => "a switch upstream port",
            FunctionKind::SwitchDownstream => "a switch downstream port",
        };
        return Err(format!("'{end}' is {what}, not a NIC"));
    }
    if !function.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b)) {
        return Err(format!(
            "'{function}' cannot be named on the guest's command line (letters, digits, '_', '-', '.')"
        ));
    }
    let nic = functions.iter().filter(|f| is_nic(f.kind)).position(|f| f.name == function).unwrap_or(0);
    Ok((node, function.to_owned(), nic))
}

#[cfg(test)]
mod tests;
