//! `cargo xtask parity HOST.ktap GUEST.ktap [--html OUT.html]`: does the guest's PCIe tree
//! lead NCCL to the same decisions as the host's?
//!
//! Both files are KTAP documents of the agent's `topology` suite (a bare-metal run on the host,
//! a run inside the guest). Two kinds of diagnostic lines are read, both printed by
//! `guest-tests/src/suites/pci.rs`:
//!
//! - NCCL's path for a pair: `nccl gpu BDF nic BDF PATH gdr on|off bw ...` (GPU-NIC) and
//!   `nccl gpu BDF gpu BDF PATH bw ...` (GPU-GPU, which has no GDR decision). `nccl gpu BDF
//!   ib DEV ...` lines (per RDMA device) are not pairs of the tree and are left out.
//! - The tree: `pci <2 spaces per level>BDF [VVVV:DDDD] class CCCCCC ...`.
//!
//! Pairs are matched by kind and ordinal: on each side the GPUs (class 03) and the NICs
//! (class 02), from the tree and the pair lines, are numbered in ascending BDF order, and host
//! `gpuI`-`nicJ` is compared with guest `gpuI`-`nicJ` (`gpuI`-`gpuJ` likewise). That holds
//! when the guest's node file keeps the host's BDF order (as `gdrvm topology capture` names
//! devices) and both sides see the same GPUs and NICs; when the counts differ, that is
//! reported first and the pairs that exist on one side only are differences.
//!
//! Exits 0 when no pair differs in path type or GDR decision, 1 when one does, 125 when a
//! file cannot be read or holds no `topology` output.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use gdrvm_harness::exit;

/// The kind of a device at one end of a pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A GPU (class 03).
    Gpu,
    /// A network adapter (class 02).
    Nic,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Gpu => "gpu",
            Kind::Nic => "nic",
        }
    }
}

/// A pair by kind and ordinal: GPU `gpu` with the `peer`-th device of `kind` (for GPU-GPU
/// pairs `gpu < peer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PairKey {
    /// The GPU's ordinal.
    pub gpu: usize,
    /// The kind of the other end.
    pub kind: Kind,
    /// The other end's ordinal among its kind.
    pub peer: usize,
}

impl std::fmt::Display for PairKey {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "gpu{}-{}{}", self.gpu, self.kind.prefix(), self.peer)
    }
}

/// What NCCL decides for one pair on one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// The GPU's BDF.
    pub gpu: String,
    /// The other end's BDF.
    pub peer: String,
    /// NCCL's path type as printed (`PIX`, `PXB`, `PHB`, `SYS`, `NVL`, ...).
    pub path: String,
    /// GPUDirect RDMA on (GPU-NIC pairs; `None` for GPU-GPU pairs).
    pub gdr: Option<bool>,
}

impl Pair {
    /// `PIX gdr on` / `PHB`.
    fn decision(&self) -> String {
        match self.gdr {
            Some(on) => format!("{} gdr {}", self.path, if on { "on" } else { "off" }),
            None => self.path.clone(),
        }
    }
}

/// One line of the PCI tree as the agent printed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeLine {
    /// Levels below the root bus.
    pub depth: usize,
    /// `0000:03:00.0`.
    pub bdf: String,
    /// `10de:20b2`.
    pub ids: String,
    /// The 24-bit class code.
    pub class: u32,
    /// The rest of the line (NUMA node, link, ACS, ATS, MSI-X).
    pub rest: String,
}

impl TreeLine {
    /// What the function is, for the eye: GPU, NIC, NVSwitch, bridge, host bridge, other.
    fn role(&self) -> &'static str {
        match self.class >> 8 {
            c if c >> 8 == 0x03 => "gpu",
            c if c >> 8 == 0x02 => "nic",
            0x0680 if self.ids.starts_with("10de:") => "nvswitch",
            0x0604 => "bridge",
            0x0600 => "hostbridge",
            _ => "other",
        }
    }
}

/// What one KTAP file says about the tree and NCCL's paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Side {
    /// Where it came from (the file name).
    pub label: String,
    /// GPU BDFs in ascending order: `gpus[i]` is `gpuI`.
    pub gpus: Vec<String>,
    /// NIC BDFs in ascending order: `nics[j]` is `nicJ`.
    pub nics: Vec<String>,
    /// NCCL's decision for every pair.
    pub pairs: BTreeMap<PairKey, Pair>,
    /// The PCI tree.
    pub tree: Vec<TreeLine>,
}

/// `0000:03:00.0`: four, two, two hex digits and one function digit.
fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter().enumerate().all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// `nccl gpu A nic B PATH gdr on|off ...` or `nccl gpu A gpu B PATH ...` → (A, kind, B, path,
/// gdr); `Ok(None)` for the per-RDMA-device `nccl gpu A ib ...` lines.
fn pair_line(line: &str) -> Result<Option<(String, Kind, String, Pair)>> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let kind = match words.get(3) {
        Some(&"nic") => Kind::Nic,
        Some(&"gpu") => Kind::Gpu,
        Some(&"ib") => return Ok(None),
        _ => bail!("'{line}' is not `nccl gpu BDF nic|gpu BDF PATH ...`"),
    };
    let (gpu, peer, path) = match (words.get(2), words.get(4), words.get(5)) {
        (Some(a), Some(b), Some(p)) if is_bdf(a) && is_bdf(b) && p.chars().all(|c| c.is_ascii_uppercase()) => {
            (*a, *b, *p)
        }
        _ => bail!("'{line}' does not name two BDFs and a path type"),
    };
    let gdr = match (kind, words.get(6), words.get(7)) {
        (Kind::Gpu, ..) => None,
        (Kind::Nic, Some(&"gdr"), Some(&"on")) => Some(true),
        (Kind::Nic, Some(&"gdr"), Some(&"off")) => Some(false),
        (Kind::Nic, ..) => bail!("'{line}' has no `gdr on|off` after the path type"),
    };
    let pair = Pair { gpu: gpu.to_owned(), peer: peer.to_owned(), path: path.to_owned(), gdr };
    Ok(Some((gpu.to_owned(), kind, peer.to_owned(), pair)))
}

/// `pci <indent>BDF [VVVV:DDDD] class CCCCCC rest`.
fn tree_line(body: &str) -> Option<TreeLine> {
    let indent = body.len() - body.trim_start_matches(' ').len();
    let mut words = body.split_whitespace();
    let bdf = words.next().filter(|b| is_bdf(b))?;
    let ids = words.next()?.strip_prefix('[')?.strip_suffix(']')?;
    (words.next()? == "class").then_some(())?;
    let class = u32::from_str_radix(words.next()?, 16).ok()?;
    Some(TreeLine {
        depth: indent / 2,
        bdf: bdf.to_owned(),
        ids: ids.to_owned(),
        class,
        rest: words.collect::<Vec<_>>().join(" "),
    })
}

impl Side {
    /// Reads the `topology` output of the KTAP document in `text`.
    pub fn parse(label: &str, text: &str) -> Result<Side> {
        let report = gdrvm_harness::ktap::parse(text);
        let mut tree = Vec::new();
        let mut lines = Vec::new();
        let diagnostics = report.suites.iter().flat_map(|s| &s.cases).flat_map(|c| &c.diagnostics);
        for d in diagnostics {
            if d.starts_with("nccl gpu ") {
                if let Some(line) = pair_line(d).with_context(|| format!("in {label}"))? {
                    lines.push(line);
                }
            } else if let Some(t) = d.strip_prefix("pci ").and_then(tree_line) {
                tree.push(t);
            }
        }
        if tree.is_empty() && lines.is_empty() {
            bail!("{label} holds no `topology` suite output (no `pci` tree lines, no `nccl gpu` lines)");
        }
        let mut gpus: BTreeSet<String> = tree.iter().filter(|t| t.role() == "gpu").map(|t| t.bdf.clone()).collect();
        let mut nics: BTreeSet<String> = tree.iter().filter(|t| t.role() == "nic").map(|t| t.bdf.clone()).collect();
        for (gpu, kind, peer, _) in &lines {
            gpus.insert(gpu.clone());
            match kind {
                Kind::Gpu => gpus.insert(peer.clone()),
                Kind::Nic => nics.insert(peer.clone()),
            };
        }
        let (gpus, nics): (Vec<String>, Vec<String>) = (gpus.into_iter().collect(), nics.into_iter().collect());
        let ordinal = |list: &[String], bdf: &str| list.iter().position(|b| b == bdf).unwrap_or(usize::MAX);
        let mut pairs = BTreeMap::new();
        for (gpu, kind, peer, pair) in lines {
            let (a, b) = (ordinal(&gpus, &gpu), ordinal(if kind == Kind::Gpu { &gpus } else { &nics }, &peer));
            let key = match kind {
                Kind::Gpu => PairKey { gpu: a.min(b), kind, peer: a.max(b) },
                Kind::Nic => PairKey { gpu: a, kind, peer: b },
            };
            pairs.insert(key, pair);
        }
        Ok(Side { label: label.to_owned(), gpus, nics, pairs, tree })
    }

    /// `gpu3` / `nic0` for `bdf`, when it is one.
    fn name_of(&self, bdf: &str) -> Option<String> {
        let find =
            |list: &[String], kind: Kind| list.iter().position(|b| b == bdf).map(|i| format!("{}{i}", kind.prefix()));
        find(&self.gpus, Kind::Gpu).or_else(|| find(&self.nics, Kind::Nic))
    }
}

/// One pair whose NCCL decision differs (or that one side lacks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    /// The pair.
    pub key: PairKey,
    /// The host's decision.
    pub host: Option<Pair>,
    /// The guest's decision.
    pub guest: Option<Pair>,
}

/// Host and guest side by side, and where they differ.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parity {
    /// The bare-metal run.
    pub host: Side,
    /// The run inside the guest.
    pub guest: Side,
    /// Every pair whose path type or GDR decision differs, in pair order.
    pub differences: Vec<Difference>,
}

impl Parity {
    /// Matches the pairs of `host` and `guest` by kind and ordinal.
    pub fn compare(host: Side, guest: Side) -> Parity {
        let keys: BTreeSet<PairKey> = host.pairs.keys().chain(guest.pairs.keys()).copied().collect();
        let differences = keys
            .into_iter()
            .filter_map(|key| {
                let (h, g) = (host.pairs.get(&key), guest.pairs.get(&key));
                let same = matches!((h, g), (Some(h), Some(g)) if h.path == g.path && h.gdr == g.gdr);
                (!same).then(|| Difference { key, host: h.cloned(), guest: g.cloned() })
            })
            .collect();
        Parity { host, guest, differences }
    }

    /// True when the device counts or a pair differ.
    pub fn differs(&self) -> bool {
        !self.differences.is_empty() || self.count_mismatch().is_some()
    }

    /// `host has 8 GPUs and 2 NICs, guest 7 GPUs and 2 NICs`, when the counts differ.
    fn count_mismatch(&self) -> Option<String> {
        let (h, g) = (&self.host, &self.guest);
        (h.gpus.len() != g.gpus.len() || h.nics.len() != g.nics.len()).then(|| {
            format!(
                "host has {} GPUs and {} NICs, guest {} GPUs and {} NICs: pairs are matched by ordinal",
                h.gpus.len(),
                h.nics.len(),
                g.gpus.len(),
                g.nics.len()
            )
        })
    }

    /// The plain-text report: one line per differing pair, then a summary.
    pub fn report(&self) -> String {
        let mut out = String::new();
        let side =
            |s: &Side| format!("{} ({} GPUs, {} NICs, {} pairs)", s.label, s.gpus.len(), s.nics.len(), s.pairs.len());
        let _ = writeln!(out, "parity: host {}, guest {}", side(&self.host), side(&self.guest));
        if let Some(m) = self.count_mismatch() {
            let _ = writeln!(out, "differs: {m}");
        }
        let show = |p: &Option<Pair>| match p {
            Some(p) => format!("{} ({}-{})", p.decision(), p.gpu, p.peer),
            None => "no such pair".to_owned(),
        };
        for d in &self.differences {
            let _ = writeln!(out, "differs {}: host {}, guest {}", d.key, show(&d.host), show(&d.guest));
        }
        let total = self.host.pairs.keys().chain(self.guest.pairs.keys()).collect::<BTreeSet<_>>().len();
        let _ = writeln!(out, "parity: {} of {total} pairs differ", self.differences.len());
        out
    }

    fn differing(&self, key: &PairKey) -> bool {
        self.differences.iter().any(|d| d.key == *key)
    }

    /// The report as one self-contained HTML page (XHTML-compatible; inline CSS, no scripts,
    /// no external resources): both PCI trees, the GPU x NIC and GPU x GPU path matrices of
    /// host and guest side by side, cells colored by path type, differing cells outlined.
    pub fn html(&self) -> String {
        let mut out = String::new();
        out.push_str("<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n");
        out.push_str("<meta charset=\"utf-8\"/>\n<title>gdrvm host-guest parity</title>\n");
        let _ = writeln!(out, "<style>{CSS}</style>\n</head>\n<body>");
        let _ = writeln!(out, "<h1>Host-guest parity: {} vs {}</h1>", esc(&self.host.label), esc(&self.guest.label));
        let verdict = if self.differs() { "bad" } else { "good" };
        let summary = self.report().lines().last().unwrap_or_default().to_owned();
        let _ = writeln!(out, "<p class=\"verdict {verdict}\">{}</p>", esc(&summary));
        if let Some(m) = self.count_mismatch() {
            let _ = writeln!(out, "<p class=\"verdict bad\">{}</p>", esc(&m));
        }
        out.push_str("<p class=\"legend\">");
        for p in PATHS {
            let _ = write!(out, "<span class=\"cell p-{p}\">{p}</span> ");
        }
        out.push_str("<span class=\"cell diff\">differs</span> pairs matched by kind and ordinal (BDF order)</p>\n");

        if !self.differences.is_empty() {
            out.push_str(
                "<h2>Differences</h2>\n<table class=\"diffs\">\n<tr><th>pair</th><th>host</th><th>guest</th></tr>\n",
            );
            let show = |p: &Option<Pair>| match p {
                Some(p) => format!("{} ({} - {})", p.decision(), p.gpu, p.peer),
                None => "no such pair".to_owned(),
            };
            for d in &self.differences {
                let _ = writeln!(
                    out,
                    "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                    d.key,
                    esc(&show(&d.host)),
                    esc(&show(&d.guest))
                );
            }
            out.push_str("</table>\n");
        }
        for (title, kind) in [("GPU x NIC paths", Kind::Nic), ("GPU x GPU paths", Kind::Gpu)] {
            let _ = writeln!(out, "<h2>{title}</h2>\n<div class=\"sides\">");
            for (role, side) in [("host", &self.host), ("guest", &self.guest)] {
                let _ = writeln!(out, "<div class=\"side\"><h3>{role}: {}</h3>", esc(&side.label));
                self.matrix(&mut out, side, kind);
                out.push_str("</div>\n");
            }
            out.push_str("</div>\n");
        }
        out.push_str("<h2>PCI trees</h2>\n<div class=\"sides\">\n");
        for (role, side) in [("host", &self.host), ("guest", &self.guest)] {
            let _ = writeln!(out, "<div class=\"side\"><h3>{role}: {}</h3>\n<div class=\"tree\">", esc(&side.label));
            for t in &side.tree {
                let name = side.name_of(&t.bdf).map(|n| format!("<b>{n}</b> ")).unwrap_or_default();
                let _ = writeln!(
                    out,
                    "<div class=\"fn r-{}\" style=\"margin-left:{}em\"><span class=\"bdf\">{}</span> {name}[{}] class {:06x} <span class=\"rest\">{}</span></div>",
                    t.role(),
                    t.depth * 2,
                    esc(&t.bdf),
                    esc(&t.ids),
                    t.class,
                    esc(&t.rest)
                );
            }
            out.push_str("</div></div>\n");
        }
        out.push_str("</div>\n</body>\n</html>\n");
        out
    }

    /// One side's GPU x `kind` matrix as a table.
    fn matrix(&self, out: &mut String, side: &Side, kind: Kind) {
        let cols = if kind == Kind::Nic { &side.nics } else { &side.gpus };
        out.push_str("<table class=\"matrix\">\n<tr><th></th>");
        for (j, bdf) in cols.iter().enumerate() {
            let _ = write!(out, "<th title=\"{}\">{}{j}</th>", esc(bdf), kind.prefix());
        }
        out.push_str("</tr>\n");
        for (i, bdf) in side.gpus.iter().enumerate() {
            let _ = write!(out, "<tr><th title=\"{}\">gpu{i}</th>", esc(bdf));
            for j in 0..cols.len() {
                let key = match kind {
                    Kind::Nic => PairKey { gpu: i, kind, peer: j },
                    Kind::Gpu => PairKey { gpu: i.min(j), kind, peer: i.max(j) },
                };
                if kind == Kind::Gpu && i == j {
                    out.push_str("<td class=\"cell self\">-</td>");
                    continue;
                }
                let diff = if self.differing(&key) { " diff" } else { "" };
                match side.pairs.get(&key) {
                    Some(p) => {
                        let class = if PATHS.contains(&p.path.as_str()) { p.path.as_str() } else { "other" };
                        let gdr = match p.gdr {
                            Some(true) => "<br/>gdr on",
                            Some(false) => "<br/>gdr off",
                            None => "",
                        };
                        let _ = write!(
                            out,
                            "<td class=\"cell p-{class}{diff}\" title=\"{} - {}\">{}{gdr}</td>",
                            esc(&p.gpu),
                            esc(&p.peer),
                            esc(&p.path)
                        );
                    }
                    None => {
                        let _ = write!(out, "<td class=\"cell none{diff}\">?</td>");
                    }
                }
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</table>\n");
    }
}

/// Path types the page has colors for, best first.
const PATHS: [&str; 5] = ["NVL", "PIX", "PXB", "PHB", "SYS"];

const CSS: &str = "body{font-family:sans-serif;margin:1.5em;color:#222}\
h2{margin-top:1.5em;border-bottom:1px solid #ccc}\
.sides{display:flex;gap:2em;align-items:flex-start;flex-wrap:wrap}\
.side{flex:1;min-width:28em}\
table{border-collapse:separate;border-spacing:3px}\
th{font-weight:normal;color:#555;padding:2px 6px}\
.cell{display:inline-block;min-width:3.5em;padding:4px 6px;text-align:center;font-family:monospace;border-radius:3px}\
td.cell{display:table-cell}\
.p-NVL{background:#1a9850;color:#fff}.p-PIX{background:#66bd63}.p-PXB{background:#d9ef8b}\
.p-PHB{background:#fdae61}.p-SYS{background:#d73027;color:#fff}.p-other,.none,.self{background:#eee}\
.diff{outline:3px solid #000;outline-offset:-3px;font-weight:bold}\
.verdict{font-size:1.2em;padding:6px 10px;border-radius:4px}.good{background:#d9f0d3}.bad{background:#fddbc7}\
.diffs td{padding:2px 10px;font-family:monospace;background:#fafafa}\
.tree{font-family:monospace;font-size:0.85em}\
.fn{padding:1px 4px;margin-top:1px;border-left:4px solid #bbb}\
.r-gpu{border-color:#76b900;background:#eef7dc}.r-nic{border-color:#f28e2b;background:#fdebd9}\
.r-nvswitch{border-color:#9467bd;background:#eee5f5}.r-bridge{border-color:#4e79a7}\
.r-hostbridge{border-color:#555}.rest{color:#666}";

/// `s` with XML's special characters escaped.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `cargo xtask parity`: reads both files, prints the report, writes the page when asked.
pub fn run(host: &Path, guest: &Path, html: Option<&Path>) -> Result<i32> {
    let read = |p: &Path| -> Result<Side> {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        Side::parse(&p.display().to_string(), &text)
    };
    let parity = Parity::compare(read(host)?, read(guest)?);
    print!("{}", parity.report());
    if let Some(path) = html {
        std::fs::write(path, parity.html()).with_context(|| format!("writing {}", path.display()))?;
        println!("parity: report in {}", path.display());
    }
    Ok(if parity.differs() { exit::FAIL } else { exit::PASS })
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = include_str!("../../tests/fixtures/parity/vela-a100-host.ktap");
    const GUEST: &str = include_str!("../../tests/fixtures/parity/flat-guest.ktap");

    fn parity(host: &str, guest: &str) -> Parity {
        Parity::compare(Side::parse("host.ktap", host).unwrap(), Side::parse("guest.ktap", guest).unwrap())
    }

    #[test]
    fn test_reads_pairs_and_tree_of_agent_output() {
        let host = Side::parse("host.ktap", HOST).unwrap();
        assert_eq!((host.gpus.len(), host.nics.len(), host.pairs.len()), (8, 2, 16 + 28));
        assert_eq!(host.gpus[2], "0000:0a:00.0");
        assert_eq!(host.nics, ["0000:05:00.0", "0000:13:00.0"]);
        let p = &host.pairs[&PairKey { gpu: 0, kind: Kind::Nic, peer: 0 }];
        assert_eq!((p.path.as_str(), p.gdr), ("PIX", Some(true)));
        assert_eq!(host.pairs[&PairKey { gpu: 0, kind: Kind::Gpu, peer: 4 }].path, "SYS");
        assert_eq!(host.tree.len(), 41);
        let gpu0 = host.tree.iter().find(|t| t.bdf == "0000:03:00.0").unwrap();
        assert_eq!((gpu0.depth, gpu0.ids.as_str(), gpu0.class, gpu0.role()), (3, "10de:20b2", 0x030200, "gpu"));
    }

    #[test]
    fn test_same_tree_has_parity() {
        let p = parity(HOST, HOST);
        assert!(!p.differs(), "{}", p.report());
        assert!(p.report().ends_with("parity: 0 of 44 pairs differ\n"), "{}", p.report());
        // BDFs differ, ordinals match: a guest whose buses are renumbered is still at parity.
        let renumbered = HOST.replace("0000:03:00.0", "0000:03:00.1");
        assert!(!parity(HOST, &renumbered).differs());
    }

    #[test]
    fn test_flattened_guest_differs_pair_by_pair() {
        let p = parity(HOST, GUEST);
        assert!(p.differs());
        let report = p.report();
        // Host vela-a100: gpu0/gpu1 share nic0's switch (PIX, GDR on); gpu4/gpu5 nic1's. Flat:
        // everything meets at the CPU (PHB, GDR off).
        assert!(
            report.contains(
                "differs gpu0-nic0: host PIX gdr on (0000:03:00.0-0000:05:00.0), guest PHB gdr off \
                 (0000:00:01.0-0000:00:09.0)\n"
            ),
            "{report}"
        );
        assert!(report.contains("differs gpu0-gpu4: host SYS (0000:03:00.0-0000:11:00.0), guest PHB"), "{report}");
        // The same on both sides: PHB within a NUMA node but across switches (gpu0-gpu2,
        // gpu2-nic0, ...). Of the 16 GPU-NIC pairs 4 are PHB on the host too; of the 28
        // GPU-GPU pairs 4 are PIX (switch mates) and 16 SYS (across NUMA nodes) on the host.
        assert!(!report.contains("differs gpu0-gpu2:") && !report.contains("differs gpu2-nic0:"), "{report}");
        assert_eq!(p.differences.len(), 12 + 20);
        for d in &p.differences {
            let (h, g) = (d.host.as_ref().unwrap(), d.guest.as_ref().unwrap());
            assert!(h.path != g.path || h.gdr != g.gdr, "{d:?}");
        }
        assert!(report.ends_with("parity: 32 of 44 pairs differ\n"), "{report}");
    }

    #[test]
    fn test_missing_device_is_a_difference() {
        // The guest lost its second NIC: the counts differ and its pairs exist on one side only.
        let one_nic: String = GUEST.lines().filter(|l| !l.contains("0000:00:0a.0")).map(|l| format!("{l}\n")).collect();
        let p = parity(GUEST, &one_nic);
        assert!(p.differs());
        let report = p.report();
        assert!(report.contains("differs: host has 8 GPUs and 2 NICs, guest 8 GPUs and 1 NICs"), "{report}");
        assert!(report.contains("differs gpu0-nic1: host PHB gdr off (0000:00:01.0-0000:00:0a.0), guest no such pair"));
    }

    #[test]
    fn test_bad_lines_and_empty_files_are_errors() {
        assert!(Side::parse("x", "KTAP version 1\n1..0\n").is_err());
        let bad = "KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: topology\n    1..1\n    # nccl gpu \
                   0000:03:00.0 nic 0000:04:00.0 PIX bw 1 GB/s\n    ok 1 nccl_gdr\nok 1 topology\n";
        let err = format!("{:#}", Side::parse("x", bad).unwrap_err());
        assert!(err.contains("no `gdr on|off`"), "{err}");
        // The per-RDMA-device lines are not pairs.
        let ib = bad.replace("nic 0000:04:00.0 PIX bw 1 GB/s", "ib rxe0 at 0000:04:00.0 PHB gdr off");
        assert!(Side::parse("x", &ib).is_err_and(|e| e.to_string().contains("no `topology` suite output")));
    }

    #[test]
    fn test_html_is_well_formed_and_holds_every_pair() {
        let p = parity(HOST, GUEST);
        let html = p.html();
        let opts = roxmltree::ParsingOptions { allow_dtd: true, ..Default::default() };
        let doc = roxmltree::Document::parse_with_options(&html, opts).expect("the page is well-formed XHTML");
        assert!(!html.contains("<script") && !html.contains("src=") && !html.contains("href="));
        let cells: Vec<roxmltree::Node> = doc
            .descendants()
            .filter(|n| n.has_tag_name("td") && n.attribute("class").is_some_and(|c| c.starts_with("cell p-")))
            .collect();
        // Each side: 8 x 2 GPU-NIC cells and 8 x 7 GPU-GPU cells (both halves of the matrix).
        assert_eq!(cells.len(), 2 * (16 + 56));
        for side in [&p.host, &p.guest] {
            for pair in side.pairs.values() {
                let title = format!("{} - {}", pair.gpu, pair.peer);
                assert!(cells.iter().any(|c| c.attribute("title") == Some(title.as_str())), "{title}");
            }
        }
        let outlined = cells.iter().filter(|c| c.attribute("class").is_some_and(|c| c.contains(" diff"))).count();
        let gpu_gpu = p.differences.iter().filter(|d| d.key.kind == Kind::Gpu).count();
        assert_eq!(outlined, 2 * (p.differences.len() + gpu_gpu));
        let tree_rows =
            doc.descendants().filter(|n| n.attribute("class").is_some_and(|c| c.starts_with("fn "))).count();
        assert_eq!(tree_rows, p.host.tree.len() + p.guest.tree.len());
    }

    /// The page in a real browser: headless Chromium takes a screenshot. Skips when no
    /// Chromium is installed.
    #[test]
    fn test_html_renders_in_headless_chromium() {
        let Some(browser) = ["chromium", "chromium-browser", "google-chrome", "google-chrome-stable"]
            .into_iter()
            .find(|b| std::process::Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()))
        else {
            println!(
                "SKIP test_html_renders_in_headless_chromium: no chromium, chromium-browser or google-chrome on PATH"
            );
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let page = dir.path().join("parity.html");
        let png = dir.path().join("parity.png");
        std::fs::write(&page, parity(HOST, GUEST).html()).unwrap();
        let out = std::process::Command::new(browser)
            .args(["--headless", "--disable-gpu", "--no-sandbox", "--window-size=1600,2000"])
            .arg(format!("--screenshot={}", png.display()))
            .arg(format!("file://{}", page.display()))
            .output()
            .unwrap();
        let image = std::fs::read(&png).unwrap_or_default();
        assert!(
            image.len() > 1000 && image.starts_with(b"\x89PNG"),
            "{browser} made no screenshot: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
