//! `gdrvm topology capture`: a node file from a Linux sysfs tree, the live host's (`/`) or
//! a recorded one. NUMA nodes (CPUs, memory, distances), a host bridge per root complex
//! with its NUMA node, root ports, switches and endpoints with their kind (GPU, NIC,
//! NVSwitch from class codes), IDs, BARs, link, ACS control and ATS; functions named for
//! passthrough get `backing = "vfio:<BDF>"`. What the node format cannot say (functions
//! beside another on one link, bridges that are not PCIe ports, degraded links, bus and
//! device numbers it renumbers, ...) is written as comments at the top of the file and
//! returned as notes, never dropped silently. The file is checked with the node loader
//! before it is returned.
//!
//! [`equivalent`] compares two nodes as a guest and NCCL see them: a capture inside a guest
//! against the node it booted on, or a host's against its guest's.

mod compare;
#[cfg(test)]
mod fake;
mod plan;
pub mod record;
mod sysfs;
#[cfg(test)]
mod tests;
mod write;

use std::path::{Path, PathBuf};

pub use compare::equivalent;

use crate::host_pci::{HostBdf, HostPci, HostPciError};
use crate::node::{Node, NodeError};

/// Which captured endpoints are passed through (`backing = "vfio:<BDF>"`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CaptureOptions {
    /// Host functions by address (`0000:3b:00.0`, or `3b:00.0` in domain 0). A virtual
    /// function named here takes its physical function's place (the node has one function
    /// per link).
    pub vfio: Vec<String>,
    /// Endpoint kinds whose every captured endpoint is passed through: `gpu`, `nic`,
    /// `nvswitch`, `generic`.
    pub vfio_classes: Vec<String>,
}

/// A captured node.
#[derive(Debug, Clone)]
pub struct Capture {
    /// The node file: the notes as `#` comments at the top, then the node.
    pub toml: String,
    /// What the node file cannot say about the host, one sentence each.
    pub notes: Vec<String>,
    /// The node file as the loader reads it (its `source` names the capture: write
    /// [`Capture::toml`] to a file for `gdrvm run --node`).
    pub node: Node,
}

/// Capture failed: the sysfs path or option at fault, and why.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// A file or directory capture needs is unreadable.
    #[error("cannot read {}", path.display())]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file is not as the kernel writes it.
    #[error("{}: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A PCI function's files (IDs, class, `resource`) are unreadable or malformed.
    #[error(transparent)]
    Function(#[from] HostPciError),
    /// A `--vfio` address that is none.
    #[error("--vfio {text}: {reason}")]
    VfioAddress {
        /// What was given.
        text: String,
        /// Why it is no address.
        reason: String,
    },
    /// A `--vfio-class` that is no endpoint kind.
    #[error("--vfio-class {0}: not an endpoint kind (gpu, nic, nvswitch, generic)")]
    VfioClass(String),
    /// Two `--vfio` functions on one link, where the node has room for one.
    #[error("--vfio {a} and {b}: functions on one link, where a node has room for one; name one of them")]
    VfioConflict {
        /// The first.
        a: HostBdf,
        /// The second.
        b: HostBdf,
    },
    /// A `--vfio` function that is not an endpoint of the captured node.
    #[error("--vfio {bdf}: {reason}")]
    VfioNotCaptured {
        /// The function.
        bdf: HostBdf,
        /// Why it is not in the node.
        reason: String,
    },
    /// The node loader refuses the node written (a host beyond what node files can hold,
    /// such as more than 256 buses in one segment).
    #[error("the node file captured from {} is refused", root.display())]
    Refused {
        /// The sysfs root.
        root: PathBuf,
        /// The loader's reason.
        #[source]
        source: NodeError,
    },
}

/// Captures the host whose sysfs is below `sysfs_root` (`/` for this host; a recorded tree
/// holds `sys/bus/pci/devices`, `sys/devices/...`, `sys/devices/system/node` and, without
/// NUMA, `proc/meminfo`).
pub fn capture(sysfs_root: &Path, opts: &CaptureOptions) -> Result<Capture, CaptureError> {
    let selection = plan::Selection::parse(opts)?;
    let host = sysfs::read(sysfs_root)?;
    let plan = plan::plan(&host, &selection, sysfs_root)?;
    let source = sysfs_root.display().to_string();
    let name = host.hostname.clone().unwrap_or_else(|| "captured".into());
    let body = write::node_file(&plan, &name, &format!("Captured from {source} by gdrvm topology capture"));
    let node = Node::parse_with_host(&format!("capture of {source}"), &body, &HostPci::at(sysfs_root.join("sys")))
        .map_err(|source| CaptureError::Refused { root: sysfs_root.to_owned(), source })?;
    let mut notes = plan.notes.clone();
    notes.extend(imposed_ids(&plan, &host, &node));
    Ok(Capture { toml: write::with_notes(&source, &notes, &body), notes, node })
}

/// Notes for the IDs the loader gives where node files have no say: root ports and the
/// host bridge function.
fn imposed_ids(plan: &plan::Plan, host: &sysfs::Host, node: &Node) -> Vec<String> {
    let ids_of = |name: &str| node.functions.iter().find(|f| f.name == name).map(|f| (f.vendor, f.device));
    let show = |(v, d): (u16, u16)| format!("[{v:04x}:{d:04x}]");
    let mut notes = Vec::new();
    let mut node_ids = None;
    let mut differing = Vec::new();
    for rp in &plan.root_ports {
        let (Some(ids), Some(s)) = (ids_of(&rp.name), host.functions.get(&rp.bdf)) else { continue };
        if ids != (s.f.vendor, s.f.device) {
            node_ids = Some(ids);
            differing.push(format!("{} {}", rp.bdf, show((s.f.vendor, s.f.device))));
        }
    }
    if let Some(ids) = node_ids {
        notes.push(format!("root ports are {} in a node, on the host {}", show(ids), differing.join(", ")));
    }
    let Some(hb) = plan.host_bridges.first() else { return notes };
    let Some(ids) = ids_of(&format!("{}.host", hb.name)) else { return notes };
    match plan.host_function.and_then(|b| host.functions.get(&b).map(|s| (b, s))) {
        Some((bdf, s)) if (s.f.vendor, s.f.device) != ids => notes.push(format!(
            "host bridge function {bdf} is {} on the host, {} in a node",
            show((s.f.vendor, s.f.device)),
            show(ids)
        )),
        Some(_) => {}
        None => notes.push(format!("the node adds a host bridge function {} at 00:00.0", show(ids))),
    }
    notes
}
