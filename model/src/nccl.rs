//! NCCL's view of a PCI tree, computed the way NCCL computes it (NCCL 2.18+:
//! `src/graph/xml.cc` builds the tree from sysfs, `topo.cc` makes nodes and links,
//! `paths.cc` types the paths), so that the VMM can predict and the guest can check
//! what NCCL will decide on this VM.
//!
//! - Parents: from a device's sysfs path NCCL goes up two directories at a time (a switch's
//!   downstream and upstream port count as one PCI node, and so do a root port and what is
//!   under it), stopping at the root complex (`pciDDDD:BB`), which becomes the CPU node of
//!   the device's NUMA node.
//! - Path types: PIX (one PCI node between), PXB (a PCI-to-PCI link on the way), PHB (through
//!   a CPU node), SYS (between two CPU nodes).
//! - GPUDirect RDMA is used when the GPU-NIC path is PXB or better (`NCCL_NET_GDR_LEVEL`
//!   defaults to PXB).
//! - Link bandwidth: width × per-lane rate / 80 GB/s (`kvDictPciGen`: 16 GT/s is 120).

use std::fmt;

use serde::{Deserialize, Serialize};

/// The type of a path between two devices, best first (NCCL's `PATH_*` order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum PathType {
    /// Through one PCI switch.
    #[serde(rename = "PIX")]
    Pix,
    /// Through several PCI switches, not through a host bridge.
    #[serde(rename = "PXB")]
    Pxb,
    /// Through a CPU (host bridge).
    #[serde(rename = "PHB")]
    Phb,
    /// Across NUMA nodes.
    #[serde(rename = "SYS")]
    Sys,
}

impl PathType {
    /// NCCL's name.
    pub fn name(self) -> &'static str {
        match self {
            PathType::Pix => "PIX",
            PathType::Pxb => "PXB",
            PathType::Phb => "PHB",
            PathType::Sys => "SYS",
        }
    }

    /// Whether NCCL's default GDR level (PXB) lets a GPU and NIC on this path use
    /// GPUDirect RDMA.
    pub fn gdr(self) -> bool {
        self <= PathType::Pxb
    }
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A PCI device as NCCL reads it from sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDevice {
    /// `0000:03:00.0`.
    pub bdf: String,
    /// The PCI functions from the root bus down to this one, this one last (the BDF
    /// components of its `/sys/devices/pciDDDD:BB/...` path).
    pub path: Vec<String>,
    /// `numa_node` (-1 when Linux does not know).
    pub numa_node: i32,
}

impl PciDevice {
    /// The PCI nodes NCCL puts above this device, nearest first: every second function up
    /// its sysfs path (xml.cc walks up two directories at a time).
    pub fn nccl_parents(&self) -> Vec<&str> {
        let mut out = Vec::new();
        let mut i = self.path.len() as isize - 1 - 2;
        while i >= 0 {
            out.push(self.path[i as usize].as_str());
            i -= 2;
        }
        out
    }
}

/// The type of the path NCCL finds between `a` and `b`.
pub fn path_type(a: &PciDevice, b: &PciDevice) -> PathType {
    let (pa, pb) = (a.nccl_parents(), b.nccl_parents());
    // The lowest PCI node both hang below, and how far each is from it.
    for (da, node) in pa.iter().enumerate() {
        if let Some(db) = pb.iter().position(|n| n == node) {
            // da / db PCI-to-PCI links on each side below the common node.
            return if da == 0 && db == 0 { PathType::Pix } else { PathType::Pxb };
        }
    }
    if a.numa_node == b.numa_node {
        PathType::Phb
    } else {
        PathType::Sys
    }
}

/// NCCL's bandwidth of a PCIe link in GB/s (`width * speed / 80`, speed per lane in
/// NCCL's table units), from the sysfs strings (`16.0 GT/s PCIe`, `16`).
pub fn link_bandwidth(speed: &str, width: u32) -> Option<f64> {
    let rate = match speed.split_whitespace().next()? {
        "2.5" => 15.0,
        "5.0" | "5" => 30.0,
        "8.0" | "8" => 60.0,
        "16.0" | "16" => 120.0,
        "32.0" | "32" => 240.0,
        "64.0" | "64" => 480.0,
        _ => return None,
    };
    Some(f64::from(width) * rate / 80.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(path: &[&str], numa: i32) -> PciDevice {
        PciDevice {
            bdf: path.last().unwrap().to_string(),
            path: path.iter().map(|s| s.to_string()).collect(),
            numa_node: numa,
        }
    }

    #[test]
    fn test_paths_by_nccl_rules() {
        // Root port / switch up / switch down / device, as on vela-a100.
        let gpu0 = dev(&["00:01.0", "01:00.0", "02:00.0", "03:00.0"], 0);
        let nic0 = dev(&["00:01.0", "01:00.0", "02:02.0", "05:00.0"], 0);
        let gpu2 = dev(&["07:00.0", "08:00.0", "09:00.0", "0a:00.0"], 0);
        let gpu4 = dev(&["0e:00.0", "0f:00.0", "10:00.0", "11:00.0"], 1);
        assert_eq!(gpu0.nccl_parents(), ["01:00.0"]);
        assert_eq!(path_type(&gpu0, &nic0), PathType::Pix);
        assert_eq!(path_type(&gpu0, &gpu2), PathType::Phb);
        assert_eq!(path_type(&gpu0, &gpu4), PathType::Sys);
        // Two switches deep: the NIC one switch further down is PXB.
        let deep = dev(&["00:01.0", "01:00.0", "02:03.0", "06:00.0", "07:00.0", "08:00.0"], 0);
        assert_eq!(deep.nccl_parents(), ["06:00.0", "01:00.0"]);
        assert_eq!(path_type(&gpu0, &deep), PathType::Pxb);
        // Flat: everything on the root bus meets only at the CPU.
        let flat_gpu = dev(&["00:01.0"], 0);
        let flat_nic = dev(&["00:03.0"], 0);
        assert!(flat_gpu.nccl_parents().is_empty());
        assert_eq!(path_type(&flat_gpu, &flat_nic), PathType::Phb);
        assert!(!PathType::Phb.gdr() && PathType::Pxb.gdr() && PathType::Pix.gdr());
    }

    #[test]
    fn test_link_bandwidth() {
        assert_eq!(link_bandwidth("16.0 GT/s PCIe", 16), Some(24.0));
        assert_eq!(link_bandwidth("8.0 GT/s PCIe", 16), Some(12.0));
        assert_eq!(link_bandwidth("Unknown", 16), None);
    }
}
