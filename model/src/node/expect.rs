//! What a guest booted on a node must see of its PCI tree, and what NCCL will make of it.

use super::{EndpointKind, FunctionKind, Node};
use crate::nccl::{self, PciDevice};
use crate::{BarExpectation, LinkExpectation, PathExpectation, PciExpectation};

impl FunctionKind {
    /// The name expectations and reports use.
    pub fn label(self) -> &'static str {
        match self {
            FunctionKind::HostBridge => "host_bridge",
            FunctionKind::RootPort => "root_port",
            FunctionKind::SwitchUpstream => "switch_upstream",
            FunctionKind::SwitchDownstream => "switch_downstream",
            FunctionKind::Endpoint(EndpointKind::Gpu) => "gpu",
            FunctionKind::Endpoint(EndpointKind::Nic) => "nic",
            FunctionKind::Endpoint(EndpointKind::NvSwitch) => "nvswitch",
            FunctionKind::Endpoint(EndpointKind::Generic) => "endpoint",
        }
    }
}

impl Node {
    /// The functions above function `i`, nearest first.
    pub fn parents(&self, i: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut at = self.functions[i].parent;
        while let Some(p) = at {
            out.push(p);
            at = self.functions[p].parent;
        }
        out
    }

    /// Function `i` as NCCL reads it from sysfs.
    pub fn nccl_device(&self, i: usize) -> PciDevice {
        let mut path: Vec<String> = self.parents(i).iter().rev().map(|&p| self.functions[p].bdf.to_string()).collect();
        path.push(self.functions[i].bdf.to_string());
        let numa = self.host_bridges[self.functions[i].host_bridge].numa;
        PciDevice { bdf: self.functions[i].bdf.to_string(), path, numa_node: numa as i32 }
    }

    /// Every function's expected sysfs view, and NCCL's path for every GPU-NIC and GPU-GPU pair.
    pub fn pci_expectations(&self) -> (Vec<PciExpectation>, Vec<PathExpectation>) {
        let pci = (0..self.functions.len())
            .map(|i| {
                let f = &self.functions[i];
                PciExpectation {
                    name: f.name.clone(),
                    kind: f.kind.label().to_owned(),
                    bdf: f.bdf.to_string(),
                    parents: self.parents(i).iter().map(|&p| self.functions[p].bdf.to_string()).collect(),
                    vendor: f.vendor,
                    device: f.device,
                    class: f.class,
                    subsystem: f.subsystem,
                    numa_node: self.host_bridges[f.host_bridge].numa as i32,
                    // A passed-through device shows its own link capability and its own
                    // capabilities; the link trains to the slower end as for any other.
                    link: f.device_caps.map_or(f.link, |c| c.link).map(|l| LinkExpectation {
                        max_speed: l.speed.sysfs().to_owned(),
                        max_width: l.width,
                        current: self.negotiated_link(i).map(|t| (t.speed.sysfs().to_owned(), t.width)),
                    }),
                    acs: f.acs,
                    acs_control: f.acs_control,
                    ats: f.device_caps.map_or(f.ats, |c| c.ats),
                    msix: f.device_caps.map_or(f.msix_bar().is_some(), |c| c.msix),
                    bars: f
                        .bars
                        .iter()
                        .map(|b| BarExpectation { index: b.index, size: b.size, address: b.address })
                        .collect(),
                    backing: f.backing.to_string(),
                    p2p: self.p2p(i),
                }
            })
            .collect();
        let of = |k: EndpointKind| -> Vec<usize> {
            (0..self.functions.len()).filter(|&i| self.functions[i].kind == FunctionKind::Endpoint(k)).collect()
        };
        let (gpus, nics) = (of(EndpointKind::Gpu), of(EndpointKind::Nic));
        let mut paths = Vec::new();
        for (n, &g) in gpus.iter().enumerate() {
            let gpu = self.nccl_device(g);
            for (&other, is_nic) in nics.iter().map(|i| (i, true)).chain(gpus[n + 1..].iter().map(|i| (i, false))) {
                let path = nccl::path_type(&gpu, &self.nccl_device(other));
                paths.push(PathExpectation {
                    a: self.functions[g].bdf.to_string(),
                    b: self.functions[other].bdf.to_string(),
                    path,
                    gdr: is_nic.then(|| path.gdr()),
                });
            }
        }
        (pci, paths)
    }
}
