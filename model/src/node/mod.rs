//! The node description: NUMA nodes, host bridges, root ports, switches and endpoints of a
//! GPU training node, read from TOML (`schema`) and checked into a [`Node`] whose every
//! function has its bus/device/function and place in the tree. Errors name the file, the
//! key and the reason.

mod address;
mod build;
mod error;
mod expect;
mod export;
mod identity;
mod schema;
mod tree;

use std::fmt;
use std::path::Path;

pub use address::{BridgeWindows, Window};
pub use error::NodeError;
pub use identity::{VIRTIO_NET_BAR_SIZE, VIRTIO_NET_DEVICE, VIRTIO_VENDOR};

use error::KeyError;

use crate::host_pci::{HostBdf, HostPci};

/// A preset: name, TOML text.
const PRESETS: &[(&str, &str)] = &[
    ("minimal", include_str!("../../presets/minimal.toml")),
    ("flat", include_str!("../../presets/flat.toml")),
    ("vela-a100", include_str!("../../presets/vela-a100.toml")),
    ("vfio-lab", include_str!("../../presets/vfio-lab.toml")),
    ("dgx-h100", include_str!("../../presets/dgx-h100.toml")),
];

/// Names of the shipped presets.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

/// Names of the presets that build on any host: those with no passed-through device
/// (a lab preset's devices exist only in the L1 its `[nested]` table describes).
pub fn standalone_preset_names() -> Vec<&'static str> {
    PRESETS.iter().filter(|(_, text)| !text.contains("backing = \"vfio:")).map(|(n, _)| *n).collect()
}

/// A PCIe link generation's rate per lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LinkSpeed {
    /// Gen1, 2.5 GT/s.
    Gt2_5,
    /// Gen2, 5 GT/s.
    Gt5,
    /// Gen3, 8 GT/s.
    Gt8,
    /// Gen4, 16 GT/s.
    Gt16,
    /// Gen5, 32 GT/s.
    Gt32,
    /// Gen6, 64 GT/s.
    Gt64,
}

impl LinkSpeed {
    /// All speeds, slowest first.
    pub const ALL: [LinkSpeed; 6] =
        [LinkSpeed::Gt2_5, LinkSpeed::Gt5, LinkSpeed::Gt8, LinkSpeed::Gt16, LinkSpeed::Gt32, LinkSpeed::Gt64];

    /// How Linux's sysfs writes it (`max_link_speed`), e.g. `16.0 GT/s PCIe`.
    pub fn sysfs(self) -> &'static str {
        match self {
            LinkSpeed::Gt2_5 => "2.5 GT/s PCIe",
            LinkSpeed::Gt5 => "5.0 GT/s PCIe",
            LinkSpeed::Gt8 => "8.0 GT/s PCIe",
            LinkSpeed::Gt16 => "16.0 GT/s PCIe",
            LinkSpeed::Gt32 => "32.0 GT/s PCIe",
            LinkSpeed::Gt64 => "64.0 GT/s PCIe",
        }
    }

    /// The Link Capabilities "Max Link Speed" encoding (1 = 2.5 GT/s ... 6 = 64 GT/s).
    pub fn encoding(self) -> u8 {
        self as u8 + 1
    }

    fn parse(s: &str) -> Option<LinkSpeed> {
        Some(match s {
            "2.5GT/s" => LinkSpeed::Gt2_5,
            "5GT/s" => LinkSpeed::Gt5,
            "8GT/s" => LinkSpeed::Gt8,
            "16GT/s" => LinkSpeed::Gt16,
            "32GT/s" => LinkSpeed::Gt32,
            "64GT/s" => LinkSpeed::Gt64,
            _ => return None,
        })
    }
}

/// Widths a PCIe link can have.
pub const LINK_WIDTHS: [u8; 7] = [1, 2, 4, 8, 12, 16, 32];

/// A link's speed and width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    /// Rate per lane.
    pub speed: LinkSpeed,
    /// Lanes.
    pub width: u8,
}

impl Link {
    /// Parses `16GT/s x16`.
    pub fn parse(s: &str) -> Result<Link, String> {
        let (speed, width) =
            s.split_once(" x").ok_or_else(|| format!("'{s}' is not a link: write it like \"16GT/s x16\""))?;
        let speed = LinkSpeed::parse(speed.trim())
            .ok_or_else(|| format!("'{speed}' is not a PCIe speed (2.5GT/s, 5GT/s, 8GT/s, 16GT/s, 32GT/s, 64GT/s)"))?;
        let width: u8 = width.trim().parse().map_err(|_| format!("'x{width}' is not a link width"))?;
        if !LINK_WIDTHS.contains(&width) {
            return Err(format!("x{width} is not a PCIe link width (x1, x2, x4, x8, x12, x16, x32)"));
        }
        Ok(Link { speed, width })
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} x{}", self.speed.sysfs().trim_end_matches(" PCIe"), self.width)
    }
}

/// Bus, device, function in PCI segment 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bdf {
    /// Bus number.
    pub bus: u8,
    /// Device (slot) number, 0 to 31.
    pub device: u8,
    /// Function number, 0 to 7.
    pub function: u8,
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "0000:{:02x}:{:02x}.{}", self.bus, self.device, self.function)
    }
}

/// What an endpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointKind {
    /// A GPU.
    Gpu,
    /// A network adapter (a RoCE NIC or one of its VFs).
    Nic,
    /// An NVSwitch.
    NvSwitch,
    /// Anything else; its class code must be given.
    Generic,
}

/// What a PCI function is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FunctionKind {
    /// The host bridge's own function at 00:00.0 (class 06/00, as on q35): firmware and
    /// Linux's PCI probes look for it.
    HostBridge,
    /// A root port of a host bridge.
    RootPort,
    /// A switch's upstream port.
    SwitchUpstream,
    /// A switch's downstream port.
    SwitchDownstream,
    /// An endpoint.
    Endpoint(EndpointKind),
}

impl FunctionKind {
    /// True for the type-1 (bridge) functions.
    pub fn is_bridge(self) -> bool {
        matches!(self, FunctionKind::RootPort | FunctionKind::SwitchUpstream | FunctionKind::SwitchDownstream)
    }

    /// The Device/Port Type of its PCIe capability (`None`: no PCIe capability).
    pub fn pcie_port_type(self) -> Option<u8> {
        match self {
            FunctionKind::HostBridge => None,
            FunctionKind::Endpoint(_) => Some(0x0),
            FunctionKind::RootPort => Some(0x4),
            FunctionKind::SwitchUpstream => Some(0x5),
            FunctionKind::SwitchDownstream => Some(0x6),
        }
    }
}

/// What stands behind an endpoint's configuration space.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Backing {
    /// Nothing: the VMM's configuration space alone, BARs read all-ones.
    #[default]
    None,
    /// A host device passed through with VFIO.
    Vfio(HostBdf),
    /// A vfio-user server already listening on this socket.
    VfioUser(std::path::PathBuf),
    /// `gdrvm-gpu-emu`, started by the VMM for this endpoint.
    EmulatedGpu,
    /// `gdrvm-nic-emu`, started by the VMM for this endpoint.
    EmulatedNic,
    /// A virtio-net device in the VMM (modern virtio PCI, IDs 1af4:1041), joined to a wire
    /// the VMM is told of at run time. It brings its own identity: the endpoint's IDs and
    /// BARs give way to virtio's, at the endpoint's place in the tree.
    VirtioNet,
}

impl Backing {
    /// Whether a device stands behind the configuration space.
    pub fn is_device(&self) -> bool {
        *self != Backing::None
    }
}

impl std::str::FromStr for Backing {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            _ if s == "none" => Ok(Backing::None),
            _ if s == "emulated-gpu" => Ok(Backing::EmulatedGpu),
            _ if s == "emulated-nic" => Ok(Backing::EmulatedNic),
            _ if s == "virtio-net" => Ok(Backing::VirtioNet),
            Some(("vfio", bdf)) => bdf.parse().map(Backing::Vfio),
            Some(("vfio-user", "")) => Err("'vfio-user:' needs the server's socket path after the colon".into()),
            Some(("vfio-user", path)) => Ok(Backing::VfioUser(path.into())),
            _ => Err(format!(
                "'{s}' is not a backing this version knows (none, vfio:<host BDF>, vfio-user:<socket>, \
                 emulated-gpu, emulated-nic, virtio-net)"
            )),
        }
    }
}

impl fmt::Display for Backing {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            Backing::None => f.write_str("none"),
            Backing::Vfio(bdf) => write!(f, "vfio:{bdf}"),
            Backing::VfioUser(path) => write!(f, "vfio-user:{}", path.display()),
            Backing::EmulatedGpu => f.write_str("emulated-gpu"),
            Backing::EmulatedNic => f.write_str("emulated-nic"),
            Backing::VirtioNet => f.write_str("virtio-net"),
        }
    }
}

/// A memory BAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bar {
    /// BAR register index (0-5); a 64-bit BAR also uses the next one.
    pub index: u8,
    /// Size in bytes (a power of two).
    pub size: u64,
    /// Prefetchable.
    pub prefetchable: bool,
    /// 64-bit.
    pub is_64bit: bool,
    /// Guest-physical address the VMM assigns.
    pub address: u64,
}

/// A NUMA node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    /// Proximity domain.
    pub id: u32,
    /// vCPUs on it.
    pub cpus: u32,
    /// RAM on it, in bytes.
    pub memory: u64,
    /// Distance to each NUMA node (SLIT row).
    pub distances: Vec<u8>,
    /// The host NUMA node its RAM is placed on and its vCPU threads run on (`host_numa`),
    /// as libvirt's numatune and vCPU pinning do; unbound when absent.
    pub host_numa: Option<u32>,
}

/// A PCIe host bridge (root complex) and the buses below it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostBridge {
    /// Name from the node file.
    pub name: String,
    /// NUMA node (`_PXM`).
    pub numa: u32,
    /// Its root bus (`_BBN`).
    pub first_bus: u8,
    /// The highest bus number below it.
    pub last_bus: u8,
    /// Its window below 4 GiB (`None` when nothing below needs one).
    pub mem32: Option<Window>,
    /// Its 64-bit window above RAM.
    pub mem64: Option<Window>,
    /// Devices below it reach other devices' BARs, and others reach theirs (peer-to-peer).
    pub p2p: bool,
}

/// A PCI function in the tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Function {
    /// Name from the node file (switch ports get `<switch>.up` and `<switch>.down<n>`, a
    /// host bridge's own function `<host bridge>.host`).
    pub name: String,
    /// Where it comes from in the node file, e.g. `endpoint[3] (gpu3)`, for errors.
    pub key: String,
    /// What it is.
    pub kind: FunctionKind,
    /// Where it is.
    pub bdf: Bdf,
    /// Index of its host bridge in [`Node::host_bridges`].
    pub host_bridge: usize,
    /// Index of the bridge function above it in [`Node::functions`]; `None` on a root bus.
    pub parent: Option<usize>,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code (base, sub, programming interface).
    pub class: u32,
    /// Subsystem vendor and device.
    pub subsystem: Option<(u16, u16)>,
    /// Link capability (`None` for the host bridge function, which has no link).
    pub link: Option<Link>,
    /// ACS capability (ports).
    pub acs: bool,
    /// ACS Control register at boot (bits as [`ACS_CONTROLS`] names them); 0 without ACS.
    pub acs_control: u16,
    /// ATS capability (endpoints).
    pub ats: bool,
    /// An SR-IOV virtual function.
    pub virtual_function: bool,
    /// Memory BARs.
    pub bars: Vec<Bar>,
    /// For bridges: secondary and subordinate bus.
    pub buses: Option<(u8, u8)>,
    /// For bridges: the windows the VMM assigns.
    pub windows: Option<BridgeWindows>,
    /// What stands behind it (endpoints; bridges are the VMM's own).
    pub backing: Backing,
    /// For a passed-through device: the capabilities it brings (the guest sees its own
    /// configuration space, not the VMM's).
    pub device_caps: Option<crate::host_pci::DeviceCaps>,
    /// Every access to its BARs exits to the VMM, even where they could be mapped.
    pub trap_bars: bool,
    /// Extra arguments for the emulator the VMM starts for it.
    pub emulator_args: Vec<String>,
    /// For a virtio-net endpoint: its MAC address and MTU.
    pub net: Option<NetParams>,
}

/// What a virtio-net endpoint offers its driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetParams {
    /// MAC address.
    pub mac: [u8; 6],
    /// Largest MTU the device takes (VIRTIO_NET_F_MTU).
    pub mtu: u16,
}

/// MTUs a virtio-net endpoint may offer (the IPv4 minimum to jumbo frames).
pub const NET_MTU_RANGE: std::ops::RangeInclusive<u16> = 68..=9000;

/// An endpoint turned into virtio-net at run time (`gdrvm run --net`, a cluster's wire),
/// as if its node-file entry said `backing = "virtio-net"` and these keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetAttach {
    /// The endpoint's name in the node file.
    pub endpoint: String,
    /// MAC address (`52:54:00:12:34:56`), if not derived.
    pub mac: Option<String>,
    /// MTU, if not 1500.
    pub mtu: Option<u16>,
}

/// Parses `aa:bb:cc:dd:ee:ff` into bytes.
pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for byte in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Formats a MAC address as `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The ACS controls a node file may set, by bit of the ACS Control register (PCIe 4.0,
/// 7.7.7.3): the five every gdrvm port offers.
pub const ACS_CONTROLS: [&str; 5] =
    ["source_validation", "translation_blocking", "request_redirect", "completion_redirect", "upstream_forwarding"];

/// MSI-X vectors each emulated endpoint offers.
pub const MSIX_VECTORS: u16 = 16;

impl Function {
    /// The BAR holding an endpoint's MSI-X table and pending-bit array (the first large
    /// enough for both); `None` for bridges and endpoints without such a BAR (no MSI-X).
    pub fn msix_bar(&self) -> Option<&Bar> {
        let needed = u64::from(MSIX_VECTORS) * 16 + 8;
        matches!(self.kind, FunctionKind::Endpoint(_)).then(|| self.bars.iter().find(|b| b.size >= needed)).flatten()
    }
}

/// A checked node: every function placed, every bus numbered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    /// Name.
    pub name: String,
    /// What it models.
    pub description: String,
    /// NUMA nodes, by id.
    pub numa: Vec<NumaNode>,
    /// Host bridges, in file order.
    pub host_bridges: Vec<HostBridge>,
    /// Every PCI function, parents before children.
    pub functions: Vec<Function>,
    /// What L1 must be in a nested run (its `[nested]` table).
    pub nested: Option<crate::l1::L1Lab>,
    /// What [`Node::resolve`] takes to build this node again: the preset's name or the
    /// node file's path (device emulators the VMM starts read the same node).
    pub source: String,
}

impl Node {
    /// Whether function `i` takes part in peer-to-peer (the node's and its host bridge's
    /// `p2p`, both on by default).
    pub fn p2p(&self, i: usize) -> bool {
        self.host_bridges.get(self.functions[i].host_bridge).is_some_and(|h| h.p2p)
    }
}

impl Node {
    /// Reads and checks a node file.
    pub fn load(path: &Path) -> Result<Node, NodeError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| NodeError::whole_file(&origin, e.to_string()))?;
        Node::parse(&origin, &text)
    }

    /// A shipped preset by name.
    pub fn preset(name: &str) -> Option<Result<Node, NodeError>> {
        PRESETS.iter().find(|(n, _)| *n == name).map(|(n, text)| {
            Node::parse(&format!("preset {n}"), text).map(|node| Node { source: (*n).to_owned(), ..node })
        })
    }

    /// The text of a shipped preset.
    pub fn preset_text(name: &str) -> Option<&'static str> {
        PRESETS.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
    }

    /// A preset name, or else a path to a node file.
    pub fn resolve(arg: &str) -> Result<Node, NodeError> {
        Node::resolve_with(arg, &[])
    }

    /// [`Node::resolve`], with endpoints turned into virtio-net by `nets` before the node is
    /// checked (errors name the endpoint's key as if the file said it).
    pub fn resolve_with(arg: &str, nets: &[NetAttach]) -> Result<Node, NodeError> {
        let (origin, text, source) = match Node::preset_text(arg) {
            Some(text) if !Path::new(arg).exists() => (format!("preset {arg}"), text.to_owned(), arg.to_owned()),
            _ if !Path::new(arg).exists() => {
                return Err(NodeError::whole_file(
                    arg,
                    format!("no such node file, and not a preset ({})", preset_names().join(", ")),
                ))
            }
            _ => {
                let text = std::fs::read_to_string(arg).map_err(|e| NodeError::whole_file(arg, e.to_string()))?;
                (arg.to_owned(), text, arg.to_owned())
            }
        };
        let node = build::build_with(&origin, &text, &HostPci::default(), nets)?;
        Ok(Node { source, ..node })
    }

    /// Checks node-file text; `origin` names it in errors. Passed-through devices are
    /// looked up in this host's sysfs.
    pub fn parse(origin: &str, text: &str) -> Result<Node, NodeError> {
        build::build(origin, text, &HostPci::default())
    }

    /// [`Node::parse`] with host devices looked up in `host` (a recorded sysfs in tests).
    pub fn parse_with_host(origin: &str, text: &str, host: &HostPci) -> Result<Node, NodeError> {
        build::build(origin, text, host)
    }

    /// The link a function trained to: the slower and narrower of its own and its partner's
    /// (the port above an endpoint or upstream port, the device below a port). `None` for a
    /// port with nothing below (link down) and for functions without a link.
    pub fn negotiated_link(&self, i: usize) -> Option<Link> {
        let f = &self.functions[i];
        let own = f.link?;
        let partner = match f.kind {
            FunctionKind::RootPort | FunctionKind::SwitchDownstream => {
                self.functions.iter().find(|c| c.parent == Some(i)).and_then(|c| c.link)?
            }
            FunctionKind::Endpoint(_) | FunctionKind::SwitchUpstream => {
                f.parent.and_then(|p| self.functions[p].link).unwrap_or(own)
            }
            FunctionKind::HostBridge => return None,
        };
        Some(Link { speed: own.speed.min(partner.speed), width: own.width.min(partner.width) })
    }

    /// The highest guest-physical address any PCI window reaches.
    pub fn highest_mmio(&self) -> u64 {
        self.host_bridges.iter().filter_map(|h| h.mem64.or(h.mem32)).map(|w| w.last()).max().unwrap_or(0)
    }

    /// A machine without a PCIe tree: one NUMA node with `cpus` and `memory`, one host bridge
    /// with nothing but its own function (so the guest finds working config space).
    pub fn plain(cpus: u32, memory: u64) -> Node {
        let text =
            "name = \"plain\"\n[[numa]]\ncpus = 1\nmemory = \"64M\"\n[[host_bridge]]\nname = \"pci0\"\nnuma = 0\n";
        // The text is fixed and valid; sizes are set after parsing so that the VM
        // configuration, not the node checker, judges them.
        let mut node = Node::parse("plain", text).unwrap_or_else(|e| unreachable!("{e}"));
        node.numa[0].cpus = cpus;
        node.numa[0].memory = memory;
        node
    }

    /// Total vCPUs.
    pub fn cpus(&self) -> u32 {
        self.numa.iter().map(|n| n.cpus).sum()
    }

    /// Total RAM in bytes.
    pub fn memory(&self) -> u64 {
        self.numa.iter().map(|n| n.memory).sum()
    }

    /// The same PCIe layout with `cpus` vCPUs and `memory` bytes spread evenly over the NUMA
    /// nodes (what fits a developer's machine or CI).
    pub fn scaled(&self, cpus: Option<u32>, memory: Option<u64>) -> Result<Node, NodeError> {
        let n = self.numa.len() as u32;
        let mut node = self.clone();
        if let Some(cpus) = cpus {
            if cpus < n {
                let reason = format!("{cpus} vCPUs cannot cover {n} NUMA nodes");
                return Err(KeyError::new("cpus", reason).in_file(&self.name));
            }
            for (i, numa) in node.numa.iter_mut().enumerate() {
                numa.cpus = cpus / n + u32::from((i as u32) < cpus % n);
            }
        }
        if let Some(memory) = memory {
            let each = (memory / u64::from(n)) & !((2 << 20) - 1);
            if each < crate::MIN_GUEST_MEMORY / 2 {
                let reason = format!("{memory} bytes is too little for {n} NUMA nodes");
                return Err(KeyError::new("memory", reason).in_file(&self.name));
            }
            for numa in &mut node.numa {
                numa.memory = each;
            }
        }
        address::assign(&mut node).map_err(|e| e.in_file(&self.name))?;
        Ok(node)
    }
}

#[cfg(test)]
mod tests;
