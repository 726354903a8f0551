//! Data shared by the VMM and the in-guest agent.
//!
//! The VMM writes [`Expectations`] into the guest's initramfs; the image builder writes
//! [`ImageManifest`]. The agent reads both and compares them with what Linux reports, so
//! the agent never links the VMM (dependency arrows: agent ← model → vmm). The guest
//! memory map ([`layout`]) lives here too, so that the node's PCI windows and the VMM's RAM
//! and firmware are placed by one definition. A [`cluster`] joins nodes' NICs by wires and
//! gives each guest its addresses. [`kvm_exits`] reads what a VM cost in exits.

pub mod capture;
pub mod cluster;

/// What `gdrvm run` prints on stderr when its guest reset without reporting a status (a
/// triple fault, or the guest's own reboot): the harness reads it to tell a guest that
/// vanished in early boot.
pub const GUEST_RESET_LINE: &str = "gdrvm: the guest reset without reporting a status";

/// What `gdrvm run` logs when a vCPU's guest triple-faults (KVM's shutdown exit): the
/// harness counts it as a silent reset, and L1's agent answers it with KVM's own record of
/// the shutdown ([`kvm_exits::Shutdown`]).
pub const TRIPLE_FAULT_LINE: &str = "triple fault: the guest resets";

/// What `gdrvm run` logs of each vCPU when a signal stops the VM, before its registers
/// (`vcpu::log_state_at_stop`); [`VCPU_IRQS_OFF`] and [`VCPU_HALTED`] in the same line say
/// it sat in HLT with interrupts off, where only an NMI or a paravirtual kick (a spinlock
/// waiter's) wakes it.
pub const VCPU_STATE_LINE: &str = "vCPU state at the stop:";
/// See [`VCPU_STATE_LINE`].
pub const VCPU_IRQS_OFF: &str = "(interrupts off)";
/// See [`VCPU_STATE_LINE`].
pub const VCPU_HALTED: &str = ", halted";
pub mod emulated;
pub mod host_pci;
pub mod kvm_exits;
pub mod l1;
pub mod layout;
pub mod nccl;
pub mod node;
pub mod symbols;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Path, inside the guest, of the expectations the VMM appends to the initramfs.
pub const EXPECT_PATH: &str = "/gdrvm/expect.json";
/// Path, inside the guest, of the manifest the image builder writes.
pub const IMAGE_MANIFEST_PATH: &str = "/gdrvm/image.json";

/// The suites the agent runs as PID 1 when the kernel command line names none.
pub const DEFAULT_SUITES: &[&str] = &["smoke"];

/// Whether a kernel command line asks the agent for a shell instead of suites.
pub fn cmdline_shell(cmdline: &str) -> bool {
    cmdline.split_whitespace().any(|w| w == "gdrvm.shell" || w == "gdrvm.shell=1")
}

/// The suites a kernel command line asks of the agent: those of its last
/// `gdrvm.suites=a,b` word (none for `gdrvm.suites=`), else [`DEFAULT_SUITES`].
pub fn cmdline_suites(cmdline: &str) -> Vec<String> {
    let last = cmdline.split_whitespace().rev().find_map(|w| w.strip_prefix("gdrvm.suites="));
    match last {
        Some(list) => list.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect(),
        None => DEFAULT_SUITES.iter().map(|s| s.to_string()).collect(),
    }
}
/// I/O port of the debug-exit device: the guest writes its exit status (one byte) here.
/// The same port as QEMU's `isa-debug-exit` default, so one agent serves both VMMs.
pub const DEBUG_EXIT_PORT: u16 = 0x501;

/// What the VMM promises the guest will see.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expectations {
    /// Number of vCPUs the VMM created.
    pub cpus: u32,
    /// Bytes of RAM the VMM gave the guest.
    pub memory_bytes: u64,
    /// NUMA nodes, when the VM has more than one.
    #[serde(default)]
    pub numa: Vec<NumaExpectation>,
    /// Every PCI function, parents before children.
    #[serde(default)]
    pub pci: Vec<PciExpectation>,
    /// NCCL's path type for every GPU-NIC and GPU-GPU pair.
    #[serde(default)]
    pub paths: Vec<PathExpectation>,
    /// A host checked against a node file (`gdrvm-agent run --node`, on bare metal), not a
    /// guest gdrvm booted: what a node file cannot say about a host (functions it leaves
    /// out, the host bridge function's IDs, no NUMA affinity on a one-node host, the link it
    /// writes for a device that reports none) is noted, not failed.
    #[serde(default)]
    pub host: bool,
}

/// One PCI function as the guest must see it in sysfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciExpectation {
    /// Name in the node description.
    pub name: String,
    /// `gpu`, `nic`, `nvswitch`, `endpoint`, `root_port`, `switch_upstream`,
    /// `switch_downstream` or `host_bridge`.
    pub kind: String,
    /// `0000:03:00.0`.
    pub bdf: String,
    /// The functions above it, nearest first (its sysfs path read backwards).
    pub parents: Vec<String>,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code.
    pub class: u32,
    /// Subsystem vendor and device, when set.
    pub subsystem: Option<(u16, u16)>,
    /// `numa_node`.
    pub numa_node: i32,
    /// The PCIe link, for functions with a PCIe capability.
    pub link: Option<LinkExpectation>,
    /// ACS extended capability present.
    pub acs: bool,
    /// Its ACS Control register (0 without ACS).
    #[serde(default)]
    pub acs_control: u16,
    /// ATS extended capability present.
    pub ats: bool,
    /// MSI-X capability present.
    pub msix: bool,
    /// Memory BARs: sizes the guest must find, at the addresses the VMM assigned (Linux may
    /// move them).
    #[serde(default)]
    pub bars: Vec<BarExpectation>,
    /// What stands behind it, as the node file says (`none`, `vfio:<BDF>`, `emulated-gpu`,
    /// ...).
    #[serde(default)]
    pub backing: String,
    /// Whether it takes part in peer-to-peer DMA (its node's and host bridge's `p2p`).
    #[serde(default = "yes")]
    pub p2p: bool,
}

fn yes() -> bool {
    true
}

/// A memory BAR.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BarExpectation {
    /// BAR register index (the line of sysfs `resource`).
    pub index: u8,
    /// Size in bytes.
    pub size: u64,
    /// Where the VMM put it.
    pub address: u64,
}

/// A link as sysfs writes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkExpectation {
    /// `max_link_speed`, e.g. `16.0 GT/s PCIe`.
    pub max_speed: String,
    /// `max_link_width`.
    pub max_width: u8,
    /// `current_link_speed` and `current_link_width`; `None` when the link is down.
    pub current: Option<(String, u8)>,
}

/// NCCL's path between two devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathExpectation {
    /// First device (a GPU).
    pub a: String,
    /// Second device (a NIC or GPU).
    pub b: String,
    /// Path type.
    pub path: nccl::PathType,
    /// For GPU-NIC pairs: whether NCCL would use GPUDirect RDMA.
    pub gdr: Option<bool>,
}

/// One NUMA node as the guest must see it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaExpectation {
    /// Its CPUs (logical CPU numbers, as Linux numbers them in APIC-id order).
    pub cpus: Vec<u32>,
    /// Its RAM in bytes.
    pub memory_bytes: u64,
    /// SLIT row.
    pub distances: Vec<u8>,
}

/// What the image builder put into the initramfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageManifest {
    /// Image name from its recipe (e.g. `default`).
    pub name: String,
    /// `uname -r` of the kernel the image was built for.
    pub kernel_release: String,
    /// Kernel module files (paths inside the guest) in load order, dependencies first.
    pub modules: Vec<String>,
    /// Modules to try after `modules`; failing to load one is not an error (e.g. kvm_intel
    /// on an AMD host). Same order rule. One that drives PCI devices is skipped when none
    /// of them is present and no module of the image depends on it.
    #[serde(default)]
    pub optional_modules: Vec<String>,
    /// Modules in the image that suites load when they need them (soft-RoCE), dependencies
    /// first; none is loaded at boot.
    #[serde(default)]
    pub on_demand_modules: Vec<String>,
    /// Out-of-tree modules the user built (`--module-src`), loaded after `modules`; the
    /// guest cannot test what they drive if one fails to load.
    #[serde(default)]
    pub user_modules: Vec<String>,
    /// The layers of the image's recipe that this image was built without, each with the
    /// suites that need it: the agent fails such a suite, naming the layer, rather than
    /// letting its checks skip for a missing tool.
    #[serde(default)]
    pub left_out_layers: BTreeMap<String, Vec<String>>,
}

impl Expectations {
    /// The expectations of a VM with `cpus` vCPUs and `memory` bytes on `node` (vCPUs are
    /// handed to the NUMA nodes in order, as the VMM does).
    pub fn new(cpus: u32, memory: u64, node: &node::Node) -> Self {
        let numa = &node.numa;
        let mut next = 0;
        let numa = if numa.len() > 1 {
            numa.iter()
                .map(|n| {
                    let cpus = (next..next + n.cpus).collect();
                    next += n.cpus;
                    NumaExpectation { cpus, memory_bytes: n.memory, distances: n.distances.clone() }
                })
                .collect()
        } else {
            Vec::new()
        };
        let (pci, paths) = node.pci_expectations();
        Expectations { cpus, memory_bytes: memory, numa, pci, paths, host: false }
    }

    /// Serializes to the JSON stored at [`EXPECT_PATH`].
    pub fn to_json(&self) -> String {
        // A struct of integers always serializes.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Smallest guest RAM a stock Linux kernel with an initramfs boots in.
pub const MIN_GUEST_MEMORY: u64 = 64 << 20;
/// Most vCPUs of a guest (its APIC ids must fit the 8-bit xAPIC MADT entries).
pub const MAX_GUEST_CPUS: u32 = 254;
/// Largest guest RAM gdrvm lays out (1 TiB).
pub const MAX_GUEST_MEMORY: u64 = 1 << 40;

/// Parses a size such as `512M`, `4G`, `2GiB` or `1048576` into bytes (K, M, G, T suffixes
/// are binary). `None` for anything else, or a size that overflows.
pub fn parse_size(s: &str) -> Option<u64> {
    let t = s.trim();
    let t = t.strip_suffix("iB").or_else(|| t.strip_suffix('B')).unwrap_or(t);
    let (digits, shift) = match t.chars().last()? {
        'K' | 'k' => (&t[..t.len() - 1], 10),
        'M' | 'm' => (&t[..t.len() - 1], 20),
        'G' | 'g' => (&t[..t.len() - 1], 30),
        'T' | 't' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cmdline_suites_takes_the_last_list_or_the_default() {
        assert_eq!(cmdline_suites("console=ttyS0 quiet"), DEFAULT_SUITES);
        assert_eq!(cmdline_suites("quiet gdrvm.suites=smoke,topology panic=-1"), ["smoke", "topology"]);
        assert!(cmdline_suites("gdrvm.suites= quiet").is_empty());
        assert_eq!(cmdline_suites("gdrvm.suites=rdma gdrvm.suites=gpu,"), ["gpu"]);
    }
}
