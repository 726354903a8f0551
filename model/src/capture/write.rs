//! The planned node as node-file TOML, laid out as the presets are (hex IDs, sizes with
//! units), each entry headed by the host function or root complex it stands for.

use std::fmt::Write as _;

use super::plan::{EndpointPlan, Plan};
use crate::node::{Link, ACS_CONTROLS};

/// Notes are wrapped to this width.
const WIDTH: usize = 100;

/// `bytes` with the largest binary unit that divides it (`128G`, `512K`).
fn size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    UNITS
        .iter()
        .find(|(u, _)| bytes >= *u && bytes % u == 0)
        .map_or(bytes.to_string(), |(u, s)| format!("{}{s}", bytes / u))
}

/// A link as a node file writes it: `16GT/s x16`, `2.5GT/s x1`.
pub(super) fn link_text(link: Link) -> String {
    let rate = link.speed.sysfs().split_whitespace().next().unwrap_or_default();
    format!("{}GT/s x{}", rate.strip_suffix(".0").unwrap_or(rate), link.width)
}

/// A TOML string, quoted and escaped.
fn quoted(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

/// ACS Control bits as the node file's `acs_control` list.
fn acs_list(control: u16) -> String {
    let on: Vec<String> =
        ACS_CONTROLS.iter().enumerate().filter(|(i, _)| control & (1 << i) != 0).map(|(_, n)| quoted(n)).collect();
    format!("[{}]", on.join(", "))
}

/// `acs` and `acs_control` lines for a port.
fn acs_lines(out: &mut String, acs: Option<u16>) {
    let _ = writeln!(out, "acs = {}", acs.is_some());
    if let Some(control) = acs.filter(|c| *c != 0) {
        let _ = writeln!(out, "acs_control = {}", acs_list(control));
    }
}

/// The node file, without notes.
pub(super) fn node_file(plan: &Plan, name: &str, description: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "name = {}", quoted(name));
    let _ = writeln!(out, "description = {}", quoted(description));
    for n in &plan.numa {
        let _ = writeln!(out, "\n[[numa]]\n# host node {}", n.host_id);
        let _ = writeln!(out, "cpus = {}\nmemory = \"{}\"", n.cpus, size(n.memory));
        if let Some(d) = &n.distances {
            let row: Vec<String> = d.iter().map(u8::to_string).collect();
            let _ = writeln!(out, "distances = [{}]", row.join(", "));
        }
        let _ = writeln!(out, "host_numa = {}", n.host_id);
    }
    for hb in &plan.host_bridges {
        let _ = writeln!(out, "\n[[host_bridge]]\n# host pci{:04x}:{:02x}", hb.complex.0, hb.complex.1);
        let _ = writeln!(out, "name = {}\nnuma = {}", quoted(&hb.name), hb.numa);
        if let Some(bus) = hb.bus {
            let _ = writeln!(out, "bus = {bus:#04x}");
        }
    }
    for rp in &plan.root_ports {
        let _ = writeln!(out, "\n[[root_port]]\n# host {}", rp.bdf);
        let _ = writeln!(out, "name = {}\nhost_bridge = {}", quoted(&rp.name), quoted(&rp.host_bridge));
        if let Some(slot) = rp.slot {
            let _ = writeln!(out, "slot = {slot}");
        }
        let _ = writeln!(out, "link = \"{}\"", link_text(rp.link));
        acs_lines(&mut out, rp.acs);
    }
    for sw in &plan.switches {
        let _ = writeln!(out, "\n[[switch]]\n# host {} (upstream port)", sw.bdf);
        let _ = writeln!(out, "name = {}\nparent = {}", quoted(&sw.name), quoted(&sw.parent));
        let _ = writeln!(out, "ports = {}\nlink = \"{}\"", sw.ports, link_text(sw.link));
        let _ = writeln!(out, "vendor = {:#06x}\ndevice = {:#06x}", sw.ids.0, sw.ids.1);
        acs_lines(&mut out, sw.acs);
    }
    for ep in &plan.endpoints {
        endpoint(&mut out, ep);
    }
    out
}

fn endpoint(out: &mut String, ep: &EndpointPlan) {
    let kind = match ep.kind {
        crate::node::EndpointKind::Gpu => "gpu",
        crate::node::EndpointKind::Nic => "nic",
        crate::node::EndpointKind::NvSwitch => "nvswitch",
        crate::node::EndpointKind::Generic => "generic",
    };
    let _ = writeln!(out, "\n[[endpoint]]\n# host {}", ep.bdf);
    let _ = writeln!(out, "name = {}\nkind = \"{kind}\"\nparent = {}", quoted(&ep.name), quoted(&ep.parent));
    if let Some(slot) = ep.slot {
        let _ = writeln!(out, "slot = {slot}");
    }
    let _ = writeln!(out, "vendor = {:#06x}\ndevice = {:#06x}\nclass = {:#08x}", ep.vendor, ep.device, ep.class);
    if let Some((v, d)) = ep.subsystem {
        let _ = writeln!(out, "subsystem = [{v:#06x}, {d:#06x}]");
    }
    let _ = writeln!(out, "link = \"{}\"", link_text(ep.link));
    if ep.ats {
        let _ = writeln!(out, "ats = true");
    }
    if ep.virtual_function {
        let _ = writeln!(out, "virtual_function = true");
    }
    if ep.vfio {
        let _ = writeln!(out, "backing = \"vfio:{}\"", ep.bdf);
    }
    match ep.bars.as_deref() {
        None | Some([]) => {}
        Some(bars) => {
            let _ = writeln!(out, "bars = [");
            for b in bars {
                let mut line = format!("  {{ size = \"{}\"", size(b.size));
                if b.prefetchable {
                    line.push_str(", prefetchable = true");
                }
                if !b.is_64bit {
                    line.push_str(", bits = 32");
                }
                let _ = writeln!(out, "{line} }},");
            }
            let _ = writeln!(out, "]");
        }
    }
}

/// `body` headed by `notes` as comments, each wrapped to [`WIDTH`].
pub(super) fn with_notes(source: &str, notes: &[String], body: &str) -> String {
    let mut out = format!("# Captured from {source} by `gdrvm topology capture`.\n");
    if notes.is_empty() {
        out.push_str("# The node file says everything capture read.\n");
    } else {
        out.push_str("# What this node file cannot say about the host:\n");
    }
    for note in notes {
        let mut line = String::from("# -");
        for word in note.split_whitespace() {
            if line.len() + 1 + word.len() > WIDTH && line.len() > 4 {
                let _ = writeln!(out, "{line}");
                line = String::from("#  ");
            }
            line.push(' ');
            line.push_str(word);
        }
        let _ = writeln!(out, "{line}");
    }
    out.push('\n');
    out.push_str(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::LinkSpeed;

    #[test]
    fn test_link_text_is_what_the_loader_parses() {
        for speed in LinkSpeed::ALL {
            let link = Link { speed, width: 16 };
            assert_eq!(Link::parse(&link_text(link)), Ok(link), "{}", link_text(link));
        }
        assert_eq!(link_text(Link { speed: LinkSpeed::Gt2_5, width: 1 }), "2.5GT/s x1");
    }

    #[test]
    fn test_notes_wrap_as_comments() {
        let long = "word ".repeat(40);
        let text = with_notes("/", &[long.trim().to_owned(), "short".into()], "name = \"x\"\n");
        assert!(text.lines().take_while(|l| !l.is_empty()).all(|l| l.starts_with('#') && l.len() <= WIDTH), "{text}");
        assert!(text.contains("\n# - short\n\nname = \"x\"\n"), "{text}");
        assert_eq!(size(24 << 30), "24G");
        assert_eq!(size(1536 << 20), "1536M");
        assert_eq!(size(100), "100");
    }
}
