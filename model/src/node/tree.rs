//! `gdrvm topology show`: the node as a tree.

use std::fmt::Write as _;

use super::{EndpointKind, FunctionKind, Node};

/// `bytes` with the largest binary unit that divides it (`128G`, `2M`).
pub(super) fn size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    UNITS
        .iter()
        .find(|(u, _)| bytes >= *u && bytes % u == 0)
        .map_or(bytes.to_string(), |(u, s)| format!("{}{s}", bytes / u))
}

impl Node {
    /// The node as an indented tree: NUMA nodes, host bridges, ports and endpoints.
    pub fn render_tree(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{}: {} vCPUs, {} RAM, {} NUMA nodes",
            self.name,
            self.cpus(),
            size(self.memory()),
            self.numa.len()
        );
        if !self.description.is_empty() {
            let _ = writeln!(out, "  {}", self.description);
        }
        for numa in &self.numa {
            let distances = numa.distances.iter().map(u8::to_string).collect::<Vec<_>>().join(" ");
            let _ = writeln!(
                out,
                "numa{}: {} vCPUs, {} RAM, distances [{distances}]",
                numa.id,
                numa.cpus,
                size(numa.memory)
            );
            for (h, hb) in self.host_bridges.iter().enumerate().filter(|(_, hb)| hb.numa == numa.id) {
                let mut line = format!("  host bridge {} buses {:02x}-{:02x}", hb.name, hb.first_bus, hb.last_bus);
                for (what, w) in [("mem", hb.mem32), ("mem64", hb.mem64)] {
                    if let Some(w) = w {
                        let _ = write!(line, " {what} {:#x}-{:#x}", w.base, w.last());
                    }
                }
                let _ = writeln!(out, "{line}");
                for (i, _) in
                    self.functions.iter().enumerate().filter(|(_, f)| f.host_bridge == h && f.parent.is_none())
                {
                    self.render_function(&mut out, i, 2);
                }
            }
        }
        out
    }

    fn render_function(&self, out: &mut String, i: usize, depth: usize) {
        let f = &self.functions[i];
        let what = match f.kind {
            FunctionKind::HostBridge => "host bridge".to_owned(),
            FunctionKind::RootPort => "root port".to_owned(),
            FunctionKind::SwitchUpstream => "switch upstream".to_owned(),
            FunctionKind::SwitchDownstream => "switch downstream".to_owned(),
            FunctionKind::Endpoint(k) => match k {
                EndpointKind::Gpu => "GPU",
                EndpointKind::Nic if f.virtual_function => "NIC VF",
                EndpointKind::Nic => "NIC",
                EndpointKind::NvSwitch => "NVSwitch",
                EndpointKind::Generic => "endpoint",
            }
            .to_owned(),
        };
        let mut line = format!(
            "{:indent$}{} {what} {} [{:04x}:{:04x}]{}",
            "",
            &f.bdf.to_string()[5..],
            f.name,
            f.vendor,
            f.device,
            f.link.map(|l| format!(" {l}")).unwrap_or_default(),
            indent = depth * 2
        );
        if let Some((sec, sub)) = f.buses {
            let _ = write!(line, " buses {sec:02x}-{sub:02x}");
        }
        if let Some(w) = &f.windows {
            for (what, w) in [("mem", w.mem), ("pref", w.pref)] {
                if let Some(w) = w {
                    let _ = write!(line, " {what} {:#x}-{:#x}", w.base, w.last());
                }
            }
        }
        if f.acs {
            line.push_str(" ACS");
            let on: Vec<&str> = super::ACS_CONTROLS
                .iter()
                .enumerate()
                .filter(|(i, _)| f.acs_control & (1 << i) != 0)
                .map(|(_, n)| *n)
                .collect();
            if !on.is_empty() {
                let _ = write!(line, "({})", on.join(","));
            }
        }
        if f.ats {
            line.push_str(" ATS");
        }
        if !f.bars.is_empty() {
            let bars: Vec<String> = f
                .bars
                .iter()
                .map(|b| {
                    format!(
                        "{}{}{}@{:#x}",
                        size(b.size),
                        if b.prefetchable { " pref" } else { "" },
                        if b.is_64bit { "" } else { " 32-bit" },
                        b.address
                    )
                })
                .collect();
            let _ = write!(line, " BARs {}", bars.join(", "));
        }
        let _ = writeln!(out, "{line}");
        for (c, _) in self.functions.iter().enumerate().filter(|(_, c)| c.parent == Some(i)) {
            self.render_function(out, c, depth + 1);
        }
    }
}
