//! Whether two nodes are functionally equivalent: the same NUMA nodes, host bridges and
//! PCIe tree, function for function (kind, IDs, class, link, ACS, ATS, BARs), whatever the
//! names and bus numbers.

use crate::node::{Bar, Function, Link, Node};

/// What a guest sees of a function's link: a passed-through device's own capability,
/// otherwise the node's.
fn seen_link(f: &Function) -> Option<Link> {
    f.device_caps.map_or(f.link, |c| c.link)
}

/// What a guest sees of a function's ATS capability.
fn seen_ats(f: &Function) -> bool {
    f.device_caps.map_or(f.ats, |c| c.ats)
}

/// BARs without the addresses the VMM picks.
fn bar_shapes(f: &Function) -> Vec<String> {
    let show = |b: &Bar| {
        format!(
            "BAR{} {}{}{}",
            b.index,
            b.size,
            if b.prefetchable { " pref" } else { "" },
            if b.is_64bit { " 64" } else { " 32" }
        )
    };
    f.bars.iter().map(show).collect()
}

/// Subsystem IDs as `vvvv:dddd`.
fn ids(subsystem: Option<(u16, u16)>) -> String {
    subsystem.map_or("none".into(), |(v, d)| format!("{v:04x}:{d:04x}"))
}

/// A link as `16.0 GT/s x16`.
fn link(l: Option<Link>) -> String {
    l.map_or("no link".into(), |l| l.to_string())
}

/// `name (bus:dev.fn)`.
fn who(f: &Function) -> String {
    format!("{} ({})", f.name, &f.bdf.to_string()[5..])
}

/// Functions of `node` on host bridge `h` hanging from `parent`, in address order.
fn children(node: &Node, h: usize, parent: Option<usize>) -> Vec<usize> {
    let mut out: Vec<usize> = (0..node.functions.len())
        .filter(|&i| node.functions[i].host_bridge == h && node.functions[i].parent == parent)
        .collect();
    out.sort_by_key(|&i| node.functions[i].bdf);
    out
}

struct Comparison<'a> {
    a: &'a Node,
    b: &'a Node,
    differences: Vec<String>,
}

impl Comparison<'_> {
    fn differ(&mut self, what: String, a: impl std::fmt::Display, b: impl std::fmt::Display) {
        self.differences.push(format!("{what}: {a} in {}, {b} in {}", self.a.name, self.b.name));
    }

    fn numa(&mut self) {
        let (a, b) = (&self.a.numa, &self.b.numa);
        if a.len() != b.len() {
            self.differ("NUMA nodes".into(), a.len(), b.len());
            return;
        }
        for (x, y) in a.iter().zip(b) {
            let at = format!("NUMA node {}", x.id);
            if x.cpus != y.cpus {
                self.differ(format!("{at} CPUs"), x.cpus, y.cpus);
            }
            if x.memory != y.memory {
                self.differ(
                    format!("{at} memory"),
                    format!("{} MiB", x.memory >> 20),
                    format!("{} MiB", y.memory >> 20),
                );
            }
            if x.distances != y.distances {
                self.differ(format!("{at} distances"), format!("{:?}", x.distances), format!("{:?}", y.distances));
            }
        }
    }

    fn host_bridges(&mut self) {
        let (a, b) = (&self.a.host_bridges, &self.b.host_bridges);
        if a.len() != b.len() {
            let names = |n: &Node| n.host_bridges.iter().map(|h| h.name.as_str()).collect::<Vec<_>>().join(", ");
            self.differ(
                "host bridges".into(),
                format!("{} ({})", a.len(), names(self.a)),
                format!("{} ({})", b.len(), names(self.b)),
            );
            return;
        }
        for h in 0..a.len() {
            let (x, y) = (&a[h], &b[h]);
            let at = format!("host bridge {} / {}", x.name, y.name);
            if x.numa != y.numa {
                self.differ(format!("{at} NUMA node"), x.numa, y.numa);
            }
            if x.p2p != y.p2p {
                self.differ(format!("{at} p2p"), x.p2p, y.p2p);
            }
            self.level(&at, children(self.a, h, None), children(self.b, h, None));
        }
    }

    /// Compares two lists of sibling functions pairwise, then what hangs below each pair.
    fn level(&mut self, at: &str, a: Vec<usize>, b: Vec<usize>) {
        if a.len() != b.len() {
            let show = |n: &Node, l: &[usize]| {
                let names: Vec<String> = l.iter().map(|&i| who(&n.functions[i])).collect();
                format!("{} [{}]", l.len(), names.join(", "))
            };
            self.differ(format!("{at}: functions below"), show(self.a, &a), show(self.b, &b));
        }
        for (&i, &j) in a.iter().zip(&b) {
            self.function(i, j);
            let (x, y) = (&self.a.functions[i], &self.b.functions[j]);
            let at = format!("{} / {}", who(x), who(y));
            self.level(&at, children(self.a, x.host_bridge, Some(i)), children(self.b, y.host_bridge, Some(j)));
        }
    }

    fn function(&mut self, i: usize, j: usize) {
        let (x, y) = (&self.a.functions[i], &self.b.functions[j]);
        let at = format!("{} / {}", who(x), who(y));
        let checks: [(&str, String, String); 9] = [
            ("kind", x.kind.label().into(), y.kind.label().into()),
            ("IDs", format!("{:04x}:{:04x}", x.vendor, x.device), format!("{:04x}:{:04x}", y.vendor, y.device)),
            ("class", format!("{:06x}", x.class), format!("{:06x}", y.class)),
            ("subsystem", ids(x.subsystem), ids(y.subsystem)),
            ("link", link(seen_link(x)), link(seen_link(y))),
            ("ACS", x.acs.to_string(), y.acs.to_string()),
            ("ACS control", format!("{:#06x}", x.acs_control), format!("{:#06x}", y.acs_control)),
            ("ATS", seen_ats(x).to_string(), seen_ats(y).to_string()),
            ("BARs", format!("[{}]", bar_shapes(x).join(", ")), format!("[{}]", bar_shapes(y).join(", "))),
        ];
        for (what, a, b) in checks {
            if a != b {
                self.differ(format!("{at} {what}"), a, b);
            }
        }
    }
}

/// Whether `a` and `b` are the same machine to a guest and to NCCL: the same NUMA nodes
/// (CPUs, memory, distances), host bridges (NUMA node, peer-to-peer) in order, and below
/// each the same tree, sibling for sibling in address order: kind, vendor and device IDs,
/// class, subsystem, link capability, ACS and its control, ATS and memory BARs (index,
/// size, prefetchable, 64-bit). Names, bus numbers, BAR addresses and the host NUMA nodes
/// the guest's are bound to (`host_numa`) may differ, and so may
/// what does not show in a guest's sysfs: backings (a passed-through device's own link and
/// ATS count), `virtual_function` (a VF is a plain function to a guest), MACs, emulator
/// arguments and BAR trapping. On a difference, each one found, naming the functions of
/// both.
pub fn equivalent(a: &Node, b: &Node) -> Result<(), Vec<String>> {
    let mut c = Comparison { a, b, differences: Vec::new() };
    c.numa();
    c.host_bridges();
    if c.differences.is_empty() {
        Ok(())
    } else {
        Err(c.differences)
    }
}
