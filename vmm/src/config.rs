//! What one VM run needs, validated before anything is created.

use std::path::PathBuf;

use gdrvm_model::node::Node;
use gdrvm_model::{MAX_GUEST_CPUS as MAX_CPUS, MAX_GUEST_MEMORY as MAX_MEMORY, MIN_GUEST_MEMORY as MIN_MEMORY};

/// Errors in a VM configuration.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// A lab node (with a `[nested]` table) outside its L1.
    #[error(
        "node {0} passes through the devices of a nested lab by their addresses in its L1: run it with `cargo xtask boot --node {0}` (nested), not on this host"
    )]
    LabOnly(String),
    /// A size string did not parse.
    #[error("invalid size '{0}': expected a number with an optional K, M, G or T suffix (e.g. 512M)")]
    BadSize(String),
    /// Too little or too much memory.
    #[error("memory {0} bytes is out of range: a guest needs at least 64 MiB and at most 1 TiB")]
    MemoryOutOfRange(u64),
    /// Zero or too many vCPUs.
    #[error("cpus {0} is out of range: 1 to 254")]
    CpusOutOfRange(u32),
    /// NUMA nodes that do not add up to the machine.
    #[error("NUMA nodes hold {cpus} vCPUs and {memory} bytes, the machine {want_cpus} and {want_memory}")]
    NumaMismatch {
        /// vCPUs in the nodes.
        cpus: u32,
        /// Bytes in the nodes.
        memory: u64,
        /// vCPUs of the machine.
        want_cpus: u32,
        /// Bytes of the machine.
        want_memory: u64,
    },
    /// The vCPU layout needs APIC ids the xAPIC MADT cannot hold.
    #[error("the vCPU layout needs APIC id {0}, above the 254 an xAPIC MADT holds: fewer vCPUs per NUMA node")]
    ApicIds(u32),
    /// The node's PCI windows reach beyond what the vCPUs can address.
    #[error(
        "node {node}: its PCI windows reach {highest:#x}, beyond the {bits} physical address bits of this \
         host's CPUs: use a node with smaller or fewer 64-bit BARs"
    )]
    AddressBits {
        /// Node name.
        node: String,
        /// Highest address used.
        highest: u64,
        /// The vCPUs' physical address bits.
        bits: u32,
    },
    /// A node description is unusable.
    #[error(transparent)]
    Node(#[from] gdrvm_model::node::NodeError),
    /// An input file does not exist or cannot be read.
    #[error("{what} '{path}' cannot be read: {reason}")]
    Unreadable {
        /// Which input ("kernel", "initrd").
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// The OS's reason.
        reason: String,
    },
}

/// One VM: what to boot and how big it is.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// vmlinux (ELF, PVH or 64-bit entry) or bzImage.
    pub kernel: PathBuf,
    /// Enter a vmlinux with a PVH note at its PVH entry, as QEMU does, rather than at its
    /// 64-bit Linux entry (see [`crate::boot::EntryMode`]).
    pub pvh: bool,
    /// Initramfs (cpio, optionally compressed); the VMM appends its expectations to it.
    pub initrd: Option<PathBuf>,
    /// Kernel command line.
    pub cmdline: String,
    /// Number of vCPUs.
    pub cpus: u32,
    /// Guest RAM in bytes.
    pub memory: u64,
    /// The node: NUMA nodes (their CPUs and memory add up to `cpus` and `memory`) and the
    /// PCIe tree. [`Node::plain`] when no node description was given.
    pub node: Node,
    /// The wire each virtio-net endpoint joins, by endpoint name.
    pub wires: std::collections::BTreeMap<String, gdrvm_devices::net::WireSpec>,
}

impl VmConfig {
    /// Checks ranges and that the input files can be opened.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(MIN_MEMORY..=MAX_MEMORY).contains(&self.memory) {
            return Err(ConfigError::MemoryOutOfRange(self.memory));
        }
        if self.cpus == 0 || self.cpus > MAX_CPUS {
            return Err(ConfigError::CpusOutOfRange(self.cpus));
        }
        {
            let (cpus, memory) = (self.node.cpus(), self.node.memory());
            if (cpus, memory) != (self.cpus, self.memory) {
                return Err(ConfigError::NumaMismatch { cpus, memory, want_cpus: self.cpus, want_memory: self.memory });
            }
        }
        let top = crate::cpu_topology::layout(self.cpus, &self.node.numa).iter().map(|c| c.apic_id).max().unwrap_or(0);
        if top > MAX_CPUS {
            return Err(ConfigError::ApicIds(top));
        }
        if self.node.nested.is_some() && std::env::var_os(gdrvm_model::l1::IN_L1_ENV).is_none() {
            return Err(ConfigError::LabOnly(self.node.name.clone()));
        }
        check_readable("kernel", &self.kernel)?;
        if let Some(initrd) = &self.initrd {
            check_readable("initrd", initrd)?;
        }
        Ok(())
    }
}

fn check_readable(what: &'static str, path: &std::path::Path) -> Result<(), ConfigError> {
    let unreadable = |reason: String| ConfigError::Unreadable { what, path: path.to_owned(), reason };
    let meta = std::fs::metadata(path).map_err(|e| unreadable(e.to_string()))?;
    if !meta.is_file() {
        return Err(unreadable("not a regular file".into()));
    }
    std::fs::File::open(path).map_err(|e| unreadable(e.to_string()))?;
    Ok(())
}

/// Parses `512M`, `4G`, `1048576`, `2GiB` into bytes.
pub fn parse_size(s: &str) -> Result<u64, ConfigError> {
    gdrvm_model::parse_size(s).ok_or_else(|| ConfigError::BadSize(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_size() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("1k"), Ok(1024));
        for bad in ["", "M", "-1M", "1.5G", "12X", "99999999999T"] {
            assert_eq!(parse_size(bad), Err(ConfigError::BadSize(bad.into())), "{bad}");
        }
    }

    #[test]
    fn test_validate_rejects_tiny_memory_and_missing_kernel() {
        let dir = tempfile::tempdir().unwrap();
        let kernel = dir.path().join("vmlinux");
        std::fs::write(&kernel, b"x").unwrap();
        let mut cfg = VmConfig {
            kernel,
            pvh: false,
            initrd: None,
            cmdline: String::new(),
            cpus: 1,
            memory: 1 << 20,
            node: Node::plain(1, 64 << 20),
            wires: Default::default(),
        };
        assert_eq!(cfg.validate(), Err(ConfigError::MemoryOutOfRange(1 << 20)));
        cfg.memory = 256 << 20;
        cfg.cpus = 0;
        assert_eq!(cfg.validate(), Err(ConfigError::CpusOutOfRange(0)));
        cfg.cpus = 2;
        assert!(matches!(cfg.validate(), Err(ConfigError::NumaMismatch { .. })));
        cfg.node = Node::plain(2, 256 << 20);
        assert_eq!(cfg.validate(), Ok(()));
        cfg.kernel = dir.path().join("missing");
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.starts_with("kernel '") && err.contains("missing"), "{err}");
        cfg.kernel = dir.path().to_owned();
        assert!(cfg.validate().unwrap_err().to_string().contains("not a regular file"));
        // A lab node names L1's devices by address: outside L1 it would pass through
        // whatever this host has there.
        cfg.node.nested = Some(gdrvm_model::l1::L1Lab::default());
        assert_eq!(cfg.validate(), Err(ConfigError::LabOnly("plain".into())));
    }
}
