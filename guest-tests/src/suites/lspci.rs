//! What the guest's own pciutils say (`lspci -tv`, `lspci -PP`, `lspci -vvv`), read against
//! the VMM's expectations: the tree (each function's path through the bridges above it),
//! and each one's link capability and status, ACS and ATS as lspci decodes them from config
//! space (a second reader besides sysfs).

use std::collections::BTreeMap;
use std::process::Command;

use gdrvm_model::PciExpectation;

use crate::context::Context;
use crate::ktap::{Check, Verdict};

/// Where the image puts pciutils' lspci.
const LSPCI: &str = "/usr/bin/lspci";

/// `16.0 GT/s PCIe` (sysfs) as lspci writes it: `16GT/s`.
fn lspci_speed(sysfs: &str) -> String {
    let number = sysfs.split_whitespace().next().unwrap_or("");
    format!("{}GT/s", number.strip_suffix(".0").unwrap_or(number))
}

/// `lspci -vvv` split into blocks by function (`03:00.0` → its lines).
fn blocks(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) && !line.is_empty() {
            current = line.split_whitespace().next().map(str::to_owned);
        }
        if let Some(c) = &current {
            out.entry(c.clone()).or_default().push(line.trim().to_owned());
        }
    }
    out
}

/// `Speed 16GT/s` and `Width x16` from a `LnkCap:`/`LnkSta:` line.
fn speed_width(line: &str) -> (String, String) {
    let fields = line.split_once(':').map_or(line, |(_, rest)| rest);
    let field = |key: &str| {
        fields
            .split(',')
            .find_map(|part| part.trim().strip_prefix(key))
            .map(|v| v.split_whitespace().next().unwrap_or("").to_owned())
            .unwrap_or_default()
    };
    (field("Speed "), field("Width "))
}

/// Differences between lspci's block for a function and its expectation.
fn differences(want: &PciExpectation, block: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let find = |prefix: &str| block.iter().find(|l| l.starts_with(prefix)).cloned();
    if let Some(link) = &want.link {
        let want_cap = (lspci_speed(&link.max_speed), format!("x{}", link.max_width));
        match find("LnkCap:") {
            Some(l) if speed_width(&l) == want_cap => {}
            other => out.push(format!("LnkCap {other:?}, expected Speed {}, Width {}", want_cap.0, want_cap.1)),
        }
        if let Some((speed, width)) = &link.current {
            let want_sta = (lspci_speed(speed), format!("x{width}"));
            match find("LnkSta:") {
                Some(l) if speed_width(&l) == want_sta => {}
                other => out.push(format!("LnkSta {other:?}, expected Speed {}, Width {}", want_sta.0, want_sta.1)),
            }
        }
    }
    if want.acs {
        // "ACSCtl: SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"
        let names = ["SrcValid+", "TransBlk+", "ReqRedir+", "CmpltRedir+", "UpstreamFwd+"];
        let seen = find("ACSCtl:").map(|l| {
            names
                .iter()
                .enumerate()
                .filter(|(_, n)| l.split_whitespace().any(|w| w == **n))
                .fold(0u16, |a, (i, _)| a | 1 << i)
        });
        if seen != Some(want.acs_control) {
            out.push(format!("ACSCtl {seen:?}, expected {:#06x}", want.acs_control));
        }
    }
    let has = |what: &str| block.iter().any(|l| l.starts_with("Capabilities:") && l.contains(what));
    if has("Access Control Services") != want.acs {
        out.push(format!("ACS capability {}, expected {}", has("Access Control Services"), want.acs));
    }
    if has("Address Translation Service") != want.ats {
        out.push(format!("ATS capability {}, expected {}", has("Address Translation Service"), want.ats));
    }
    if has("MSI-X") != want.msix {
        out.push(format!("MSI-X capability {}, expected {}", has("MSI-X"), want.msix));
    }
    out
}

fn run_lspci(ctx: &Context, args: &[&str]) -> Result<String, String> {
    let out = Command::new(ctx.path(LSPCI)).args(args).output().map_err(|e| format!("{LSPCI}: {e}"))?;
    if !out.status.success() {
        return Err(format!("lspci {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The lspci checks of `topology`.
pub fn run(ctx: &Context) -> Vec<Check> {
    let Some(expect) = ctx.expect.as_ref().filter(|e| !e.pci.is_empty()) else {
        return vec![Check::new("lspci", Verdict::Skip("no PCI expectations (not a gdrvm guest)".into()))];
    };
    if !ctx.path(LSPCI).exists() {
        return vec![Check::new("lspci", Verdict::Skip(format!("{LSPCI} is not in this image")))];
    }
    let (tree, paths, verbose) = match (run_lspci(ctx, &["-tv"]), run_lspci(ctx, &["-PP"]), run_lspci(ctx, &["-vvv"])) {
        (Ok(t), Ok(p), Ok(v)) => (t, p, v),
        (Err(e), ..) | (_, Err(e), _) | (.., Err(e)) => return vec![Check::new("lspci", Verdict::Fail(e))],
    };
    let blocks = blocks(&verbose);
    // `lspci -PP`: "00:01.0/01:00.0/02:00.0/03:00.0 3D controller: ..." per function.
    let paths: BTreeMap<String, String> = paths
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(|p| (p.rsplit('/').next().unwrap_or(p).to_owned(), p.to_owned()))
        .collect();
    let mut failures = Vec::new();
    for want in &expect.pci {
        let short = want.bdf.trim_start_matches("0000:");
        match blocks.get(short) {
            None => failures.push(format!("{short} ({}): not listed by lspci -vvv", want.name)),
            Some(block) => {
                failures.extend(differences(want, block).into_iter().map(|d| format!("{short} ({}): {d}", want.name)))
            }
        }
    }
    for want in &expect.pci {
        let short = |bdf: &str| bdf.trim_start_matches("0000:").to_owned();
        let mut chain: Vec<String> = want.parents.iter().rev().map(|p| short(p)).collect();
        chain.push(short(&want.bdf));
        let want_path = chain.join("/");
        match paths.get(&short(&want.bdf)) {
            Some(p) if *p == want_path => {}
            other => {
                failures.push(format!("{} ({}): lspci -PP path {other:?}, expected {want_path}", want.bdf, want.name))
            }
        }
    }
    if blocks.len() != expect.pci.len() {
        failures.push(format!("lspci lists {} functions, expected {}", blocks.len(), expect.pci.len()));
    }
    let mut check =
        Check::new("lspci", if failures.is_empty() { Verdict::Pass } else { Verdict::Fail(failures.join("; ")) });
    check.diagnostics.push("lspci -tv:".into());
    check.diagnostics.extend(tree.lines().map(str::to_owned));
    check.diagnostics.push(format!(
        "lspci -PP/-vvv: {} functions; tree, link, ACS, ATS and MSI-X as expected: {}",
        blocks.len(),
        failures.is_empty()
    ));
    vec![check]
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU: &str = "03:00.0 3D controller: NVIDIA Corporation GA100 [A100 SXM4 80GB] (rev 01)
\tSubsystem: NVIDIA Corporation Device 147f
\tCapabilities: [40] Express (v2) Endpoint, MSI 00
\t\tLnkCap:\tPort #0, Speed 16GT/s, Width x16, ASPM not supported
\t\tLnkSta:\tSpeed 16GT/s, Width x16
\tCapabilities: [80] MSI-X: Enable- Count=16 Masked-
\tCapabilities: [100 v1] Address Translation Service (ATS)

04:00.0 Ethernet controller: Mellanox Technologies ConnectX Family mlx5Gen Virtual Function
";

    fn gpu() -> PciExpectation {
        PciExpectation {
            name: "gpu0".into(),
            kind: "gpu".into(),
            bdf: "0000:03:00.0".into(),
            parents: vec![],
            vendor: 0x10de,
            device: 0x20b2,
            class: 0x030200,
            subsystem: None,
            numa_node: 0,
            link: Some(gdrvm_model::LinkExpectation {
                max_speed: "16.0 GT/s PCIe".into(),
                max_width: 16,
                current: Some(("16.0 GT/s PCIe".into(), 16)),
            }),
            acs: false,
            acs_control: 0,
            ats: true,
            msix: true,
            bars: vec![],
            backing: "none".into(),
            p2p: true,
        }
    }

    #[test]
    fn test_blocks_and_differences() {
        let b = blocks(GPU);
        assert_eq!(b.keys().collect::<Vec<_>>(), ["03:00.0", "04:00.0"]);
        assert_eq!(differences(&gpu(), &b["03:00.0"]), Vec::<String>::new());
        let mut narrow = gpu();
        narrow.link.as_mut().unwrap().max_width = 8;
        narrow.acs = true;
        let d = differences(&narrow, &b["03:00.0"]);
        assert_eq!(d.len(), 3, "{d:?}");
        assert!(
            d[0].starts_with("LnkCap") && d[1].starts_with("ACSCtl None") && d[2].starts_with("ACS capability false")
        );
        // A downstream port with ReqRedir, CmpltRedir and UpstreamFwd set.
        let port = blocks(
            "02:00.0 PCI bridge: Broadcom / LSI Device c010
\tCapabilities: [100 v1] Access Control Services
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
",
        );
        let want = PciExpectation { link: None, acs: true, acs_control: 0x1c, ats: false, msix: false, ..gpu() };
        assert_eq!(differences(&want, &port["02:00.0"]), Vec::<String>::new());
        assert_eq!(lspci_speed("2.5 GT/s PCIe"), "2.5GT/s");
        assert_eq!(lspci_speed("8.0 GT/s PCIe"), "8GT/s");
    }
}
