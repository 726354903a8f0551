//! The node description as written in TOML. [`super::Node`] is what it becomes once checked.

use serde::Deserialize;

/// A whole node file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeFile {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub numa: Vec<NumaEntry>,
    #[serde(default)]
    pub host_bridge: Vec<HostBridgeEntry>,
    #[serde(default)]
    pub root_port: Vec<RootPortEntry>,
    #[serde(default)]
    pub switch: Vec<SwitchEntry>,
    #[serde(default)]
    pub endpoint: Vec<EndpointEntry>,
    /// What a nested run's L1 needs for this node (emulated devices to pass through).
    pub nested: Option<crate::l1::L1Lab>,
    /// Peer-to-peer between devices (each one's BARs in the others' IOMMU domains).
    #[serde(default = "yes")]
    pub p2p: bool,
}

/// `[[numa]]`: one NUMA node; its index is its id.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NumaEntry {
    pub cpus: u32,
    pub memory: String,
    /// SLIT row: distance to every NUMA node, this one included (10 to itself).
    pub distances: Option<Vec<u8>>,
    /// The host NUMA node this node's RAM and vCPU threads are bound to.
    pub host_numa: Option<u32>,
}

/// `[[host_bridge]]`: a PCIe root complex (PNP0A08) on one NUMA node.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostBridgeEntry {
    pub name: String,
    pub numa: u32,
    /// First bus number; allocated after the previous bridge's buses when absent.
    pub bus: Option<u8>,
    /// Peer-to-peer for the devices below it (off: as a host with ACS redirect, no ATS).
    #[serde(default = "yes")]
    pub p2p: bool,
}

/// `[[root_port]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RootPortEntry {
    pub name: String,
    pub host_bridge: String,
    pub slot: Option<u8>,
    pub link: String,
    #[serde(default = "yes")]
    pub acs: bool,
    /// ACS controls set at boot (see [`super::AcsControl`]).
    #[serde(default)]
    pub acs_control: Vec<String>,
}

/// `[[switch]]`: an upstream port and `ports` downstream ports, below a root port or a
/// downstream port of another switch.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SwitchEntry {
    pub name: String,
    pub parent: String,
    pub ports: u8,
    pub link: String,
    #[serde(default)]
    pub vendor: Option<u16>,
    #[serde(default)]
    pub device: Option<u16>,
    #[serde(default = "yes")]
    pub acs: bool,
    /// ACS controls set at boot on every downstream port.
    #[serde(default)]
    pub acs_control: Vec<String>,
}

/// `[[endpoint]]`: a PCIe function.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointEntry {
    pub name: String,
    pub kind: String,
    /// A host bridge (the endpoint sits on its root bus), a root port, or a switch (it gets
    /// the switch's next free downstream port).
    pub parent: String,
    pub slot: Option<u8>,
    /// IDs: required unless a passed-through device supplies them.
    pub vendor: Option<u16>,
    pub device: Option<u16>,
    pub class: Option<u32>,
    pub subsystem: Option<[u16; 2]>,
    pub link: String,
    #[serde(default)]
    pub bars: Vec<BarEntry>,
    #[serde(default)]
    pub ats: bool,
    /// An SR-IOV virtual function (as a VF passed through to the guest appears).
    #[serde(default)]
    pub virtual_function: bool,
    /// What stands behind the endpoint: `none`, `vfio:<host BDF>`, `vfio-user:<socket>`,
    /// `emulated-gpu`, `emulated-nic` or `virtio-net`.
    #[serde(default = "no_backing")]
    pub backing: String,
    /// Extra arguments for the emulator the VMM starts (emulated backings only), e.g.
    /// `["--fault", "exit-after=20s"]` to test how the guest and VMM cope with its death.
    #[serde(default)]
    pub emulator_args: Vec<String>,
    /// virtio-net only: the MAC address (`52:54:00:12:34:56`); derived from the node's and
    /// endpoint's names when absent.
    #[serde(default)]
    pub mac: Option<String>,
    /// virtio-net only: the MTU the device offers (68 to 9000, default 1500).
    #[serde(default)]
    pub mtu: Option<u16>,
    /// Trap every guest access to the device's BARs instead of mapping them (to measure
    /// the exit cost; slow).
    #[serde(default)]
    pub trap_bars: bool,
}

/// One memory BAR.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BarEntry {
    pub size: String,
    #[serde(default)]
    pub prefetchable: bool,
    /// 32 or 64 (default 64).
    #[serde(default = "sixty_four")]
    pub bits: u8,
}

fn yes() -> bool {
    true
}

fn no_backing() -> String {
    "none".into()
}

fn sixty_four() -> u8 {
    64
}
