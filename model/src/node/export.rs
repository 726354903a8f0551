//! The node in other tools' terms: an `NCCL_TOPO_FILE` (NCCL's topology XML, version 1),
//! the closest QEMU command line, and a Graphviz graph.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use super::{EndpointKind, FunctionKind, Node};

/// NCCL's PCI tree: for each PCI node's bus ID (`None`: a CPU), the functions below it.
type NcclTree = BTreeMap<Option<String>, BTreeSet<usize>>;

impl Node {
    /// NCCL's topology XML (version 1) for a guest booted on this node: one `cpu` per NUMA
    /// node, under it the PCI nodes NCCL builds from sysfs (a switch's upstream port stands
    /// for the switch, as NCCL's xml.cc folds one bridge level out of two) and the GPUs,
    /// NICs and NVSwitches with the bus IDs the guest sees.
    pub fn nccl_topology_xml(&self) -> String {
        let tree = self.nccl_tree();
        let mut out = String::from("<system version=\"1\">\n");
        let mut first_cpu = 0u32;
        for numa in &self.numa {
            let affinity = cpu_mask(first_cpu, numa.cpus);
            first_cpu += numa.cpus;
            let _ = writeln!(out, "  <cpu numaid=\"{}\" affinity=\"{affinity}\" arch=\"x86_64\">", numa.id);
            let roots = self.nccl_children(&tree, None).into_iter().filter(|&i| self.numa_of(i) == numa.id);
            for i in roots {
                self.write_nccl_pci(&tree, &mut out, i, 2);
            }
            out.push_str("  </cpu>\n");
        }
        out.push_str("</system>\n");
        out
    }

    fn numa_of(&self, i: usize) -> u32 {
        self.host_bridges[self.functions[i].host_bridge].numa
    }

    /// Whether NCCL's XML holds function `i` as a device (GPU, NIC, NVSwitch).
    fn nccl_leaf(&self, i: usize) -> bool {
        matches!(
            self.functions[i].kind,
            FunctionKind::Endpoint(EndpointKind::Gpu | EndpointKind::Nic | EndpointKind::NvSwitch)
        )
    }

    /// NCCL's tree: for each PCI node (`None`: a CPU), the functions hanging from it. The
    /// PCI nodes are the functions on the devices' NCCL parent chains.
    fn nccl_tree(&self) -> NcclTree {
        let index = |bdf: &str| self.functions.iter().position(|f| f.bdf.to_string() == bdf);
        let mut tree = NcclTree::new();
        for leaf in (0..self.functions.len()).filter(|&i| self.nccl_leaf(i)) {
            let dev = self.nccl_device(leaf);
            let chain = dev.nccl_parents();
            let mut child = leaf;
            for parent in &chain {
                tree.entry(Some((*parent).to_owned())).or_default().insert(child);
                child = index(parent).unwrap_or(child);
            }
            tree.entry(None).or_default().insert(child);
        }
        tree
    }

    /// What hangs from NCCL PCI node `parent` (`None`: from a CPU) in `tree`.
    fn nccl_children(&self, tree: &NcclTree, parent: Option<&str>) -> Vec<usize> {
        let mut out: Vec<usize> =
            tree.get(&parent.map(str::to_owned)).map(|c| c.iter().copied().collect()).unwrap_or_default();
        out.sort_by_key(|&i| self.functions[i].bdf);
        out
    }

    fn write_nccl_pci(&self, tree: &NcclTree, out: &mut String, i: usize, depth: usize) {
        let f = &self.functions[i];
        let (sv, sd) = f.subsystem.unwrap_or((0, 0));
        let link =
            f.link.map_or(String::new(), |l| format!(" link_speed=\"{}\" link_width=\"{}\"", l.speed.sysfs(), l.width));
        let attrs = format!(
            "busid=\"{}\" class=\"0x{:06x}\" vendor=\"0x{:04x}\" device=\"0x{:04x}\" subsystem_vendor=\"0x{sv:04x}\" \
             subsystem_device=\"0x{sd:04x}\"{link}",
            f.bdf, f.class, f.vendor, f.device
        );
        let indent = "  ".repeat(depth);
        if self.nccl_leaf(i) {
            let _ = writeln!(out, "{indent}<pci {attrs}/>");
            return;
        }
        let _ = writeln!(out, "{indent}<pci {attrs}>");
        for c in self.nccl_children(tree, Some(&f.bdf.to_string())) {
            self.write_nccl_pci(tree, out, c, depth + 1);
        }
        let _ = writeln!(out, "{indent}</pci>");
    }

    /// The closest QEMU (q35) command line: NUMA nodes, one pxb-pcie per host bridge (the
    /// first on bus 0 is pcie.0 itself), pcie-root-port with the link speed and width, x3130
    /// switches, and stand-in endpoints (virtio-net for NICs, nvme for the others; swap in
    /// `vfio-pci,host=...` to pass real devices through).
    pub fn qemu_args(&self) -> String {
        let mut args: Vec<String> = vec![
            "-machine q35,accel=kvm".into(),
            "-nodefaults".into(),
            format!("-smp {},sockets={}", self.cpus(), self.numa.len()),
            format!("-m {}M", self.memory() >> 20),
        ];
        let mut first_cpu = 0;
        for n in &self.numa {
            args.push(format!("-object memory-backend-ram,id=mem{},size={}M", n.id, n.memory >> 20));
            args.push(format!(
                "-numa node,nodeid={},cpus={}-{},memdev=mem{}",
                n.id,
                first_cpu,
                first_cpu + n.cpus - 1,
                n.id
            ));
            first_cpu += n.cpus;
        }
        for a in &self.numa {
            for (b, d) in a.distances.iter().enumerate().filter(|(b, _)| *b as u32 > a.id) {
                args.push(format!("-numa dist,src={},dst={b},val={d}", a.id));
            }
        }
        let bus_of = |h: usize| -> String {
            if self.host_bridges[h].first_bus == 0 {
                "pcie.0".into()
            } else {
                self.host_bridges[h].name.clone()
            }
        };
        // Expander bridges take free slots of pcie.0 (q35's host bridge holds slot 0).
        let mut free = (1u8..32).filter(|d| !self.functions.iter().any(|f| f.bdf.bus == 0 && f.bdf.device == *d));
        for hb in self.host_bridges.iter().filter(|hb| hb.first_bus != 0) {
            let slot = free.next().unwrap_or(31);
            args.push(format!(
                "-device pxb-pcie,id={},bus_nr={},numa_node={},bus=pcie.0,addr={slot:#04x}",
                hb.name, hb.first_bus, hb.numa
            ));
        }
        let mut chassis = 0;
        for f in &self.functions {
            let mut bus = match f.parent {
                None => bus_of(f.host_bridge),
                Some(p) => self.functions[p].name.clone(),
            };
            // QEMU's expander buses take bridges only: an endpoint on one gets a root port.
            if f.parent.is_none() && bus != "pcie.0" && !f.kind.is_bridge() {
                chassis += 1;
                args.push(format!("-device pcie-root-port,id={}-port,bus={bus},chassis={chassis},slot=0", f.name));
                bus = format!("{}-port", f.name);
            }
            let link = f.link.map(|l| {
                let speed = match l.speed.encoding() {
                    1 => "2_5",
                    2 => "5",
                    3 => "8",
                    // QEMU 7.2 knows no faster root port: Gen5 and Gen6 links are shown as Gen4.
                    _ => "16",
                };
                (speed, l.width)
            });
            let device = match f.kind {
                FunctionKind::HostBridge => continue,
                FunctionKind::RootPort => {
                    chassis += 1;
                    let (s, w) = link.unwrap_or(("16", 16));
                    format!("pcie-root-port,id={},bus={bus},chassis={chassis},slot=0,x-speed={s},x-width={w}", f.name)
                }
                FunctionKind::SwitchUpstream => format!("x3130-upstream,id={},bus={bus}", f.name),
                FunctionKind::SwitchDownstream => {
                    chassis += 1;
                    format!("xio3130-downstream,id={},bus={bus},chassis={chassis},slot={}", f.name, f.bdf.device)
                }
                FunctionKind::Endpoint(EndpointKind::Nic) => format!("virtio-net-pci,id={},bus={bus}", f.name),
                FunctionKind::Endpoint(_) => format!("nvme,id={},serial={},bus={bus}", f.name, f.name),
            };
            let addr = if f.parent.is_none() && bus == bus_of(f.host_bridge) {
                format!(",addr={:#04x}", f.bdf.device)
            } else {
                String::new()
            };
            args.push(format!("-device {device}{addr}"));
        }
        let mut out = String::from(
            "# The closest QEMU command line for this node. QEMU 7.2's PCIe ports do not tell the truth:\n\
             # endpoints report 2.5 GT/s x1 whatever x-speed/x-width say, xio3130 downstream ports an\n\
             # unknown speed and width 0, and devices on pcie.0 numa_node -1; NCCL then computes\n\
             # wrong bandwidths. Endpoints are stand-ins (virtio-net for NICs, nvme otherwise); those\n\
             # on an expander bus sit behind a root port there, as QEMU's pxb-pcie takes bridges only.\n\
             qemu-system-x86_64",
        );
        for a in args {
            let _ = write!(out, " \\\n  {a}");
        }
        out.push('\n');
        out
    }
}

impl Node {
    /// The tree as a Graphviz `digraph` (`gdrvm topology show --format dot`): one cluster per
    /// NUMA node holding its host bridges and everything below them, functions colored by
    /// kind (ports and switches blue, GPUs green, NICs orange, NVSwitches purple), edges
    /// labelled with the link of the function below.
    pub fn dot(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "digraph {} {{", dot_id(&self.name));
        out.push_str(
            "  graph [rankdir=TB, fontname=\"Helvetica\", nodesep=0.25, ranksep=0.4];\n  \
             node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=10, fillcolor=\"#ffffff\"];\n  \
             edge [fontname=\"Helvetica\", fontsize=8, color=\"#555555\"];\n",
        );
        let _ = writeln!(
            out,
            "  label={}; labelloc=t;",
            dot_id(&format!("{}: {} vCPUs, {} RAM", self.name, self.cpus(), super::tree::size(self.memory())))
        );
        for numa in &self.numa {
            let _ = writeln!(out, "  subgraph cluster_numa{} {{", numa.id);
            let distances = numa.distances.iter().map(u8::to_string).collect::<Vec<_>>().join(" ");
            let _ = writeln!(
                out,
                "    label={}; style=\"rounded,dashed\"; color=\"#888888\";",
                dot_id(&format!(
                    "numa{}: {} vCPUs, {} RAM, distances [{distances}]",
                    numa.id,
                    numa.cpus,
                    super::tree::size(numa.memory)
                ))
            );
            if !self.host_bridges.iter().any(|hb| hb.numa == numa.id) {
                let id = dot_id(&format!("numa:{}", numa.id));
                let _ = writeln!(out, "    {id} [shape=plaintext, style=\"\", label=\"no PCI\"];");
            }
            for (h, hb) in self.host_bridges.iter().enumerate().filter(|(_, hb)| hb.numa == numa.id) {
                let label = format!("host bridge {}\nbuses {:02x}-{:02x}", hb.name, hb.first_bus, hb.last_bus);
                let _ = writeln!(
                    out,
                    "    {} [shape=box3d, style=filled, fillcolor=\"#d9d9d9\", label={}];",
                    dot_id(&format!("hb:{}", hb.name)),
                    dot_id(&label)
                );
                for (i, f) in self.functions.iter().enumerate().filter(|(_, f)| f.host_bridge == h) {
                    let _ = writeln!(
                        out,
                        "    {} [fillcolor=\"{}\", label={}];",
                        dot_id(&format!("fn:{}", f.name)),
                        dot_color(f.kind),
                        dot_id(&self.dot_label(i))
                    );
                }
            }
            out.push_str("  }\n");
        }
        for (i, f) in self.functions.iter().enumerate() {
            let from = match f.parent {
                Some(p) => format!("fn:{}", self.functions[p].name),
                None => format!("hb:{}", self.host_bridges[f.host_bridge].name),
            };
            let link = f.link.map(|l| format!(" [label={}]", dot_id(&l.to_string()))).unwrap_or_default();
            let _ =
                writeln!(out, "  {} -> {}{link};", dot_id(&from), dot_id(&format!("fn:{}", self.functions[i].name)));
        }
        out.push_str("}\n");
        out
    }

    /// A function's box: BDF, name, what it is and its IDs.
    fn dot_label(&self, i: usize) -> String {
        let f = &self.functions[i];
        let what = match f.kind {
            FunctionKind::HostBridge => "host bridge",
            FunctionKind::RootPort => "root port",
            FunctionKind::SwitchUpstream => "switch upstream",
            FunctionKind::SwitchDownstream => "switch downstream",
            FunctionKind::Endpoint(EndpointKind::Gpu) => "GPU",
            FunctionKind::Endpoint(EndpointKind::Nic) if f.virtual_function => "NIC VF",
            FunctionKind::Endpoint(EndpointKind::Nic) => "NIC",
            FunctionKind::Endpoint(EndpointKind::NvSwitch) => "NVSwitch",
            FunctionKind::Endpoint(EndpointKind::Generic) => "endpoint",
        };
        format!("{} {}\n{what} [{:04x}:{:04x}]", &f.bdf.to_string()[5..], f.name, f.vendor, f.device)
    }
}

/// The fill color of a function of `kind`.
fn dot_color(kind: FunctionKind) -> &'static str {
    match kind {
        FunctionKind::HostBridge => "#d9d9d9",
        FunctionKind::RootPort => "#9ecae1",
        FunctionKind::SwitchUpstream | FunctionKind::SwitchDownstream => "#c6dbef",
        FunctionKind::Endpoint(EndpointKind::Gpu) => "#a1d76a",
        FunctionKind::Endpoint(EndpointKind::Nic) => "#fdb863",
        FunctionKind::Endpoint(EndpointKind::NvSwitch) => "#c2a5cf",
        FunctionKind::Endpoint(EndpointKind::Generic) => "#ffffff",
    }
}

/// `s` as a quoted Graphviz ID (`"`, `\` escaped; `\n` stays a line break).
fn dot_id(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
}

/// NCCL's affinity mask for `count` CPUs from `first`: hex, 32-bit groups joined by commas
/// (the format of `/sys/devices/system/node/nodeN/cpumap`).
fn cpu_mask(first: u32, count: u32) -> String {
    let last = first + count;
    let words = last.div_ceil(32).max(1);
    (0..words)
        .rev()
        .map(|w| {
            let mut bits = 0u32;
            for c in (w * 32)..(w * 32 + 32) {
                if c >= first && c < last {
                    bits |= 1 << (c - w * 32);
                }
            }
            format!("{bits:08x}")
        })
        .collect::<Vec<_>>()
        .join(",")
}
