//! `gpu`: what CUDA sees, from `gdrvm-gpu` (a dynamically linked helper, because libcuda is
//! loaded with dlopen and the agent is static): the GPUs against sysfs and the VMM's
//! expectations, their memory and pinned host copy bandwidth, the peer-access matrix next to
//! NCCL's path for every pair (from sysfs, [`gdrvm_model::nccl`]), peer copy bandwidth, and
//! GPUDirect RDMA readiness. Without the helper, libcuda or a GPU every check is a SKIP with
//! the reason.

#[path = "../../gpu/src/report.rs"]
mod report;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use gdrvm_model::nccl::{self, PathType};

use self::report::{DeviceReport, GpuReport, Outcome, PeerReport};
use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::suites::rdma::process;

/// Where the image puts gdrvm-gpu.
pub const GPU: &str = "/usr/bin/gdrvm-gpu";

/// Why the suite skips where gdrvm-gpu is in neither place [`binary`] looks.
const NO_HELPER: &str = "no gdrvm-gpu (neither /usr/bin/gdrvm-gpu nor beside gdrvm-agent)";

/// Longest gdrvm-gpu may run (bounded copies: seconds even with eight GPUs).
const LIMIT: Duration = Duration::from_secs(180);

/// The checks every run reports, in order (per-GPU checks go after `gpu_bus_ids`).
const CHECKS: &[&str] = &["gpu_available", "gpu_count", "gpu_bus_ids", "peer_matrix", "peer_copy", "gdr_ready"];

const SYSFS_PCI: &str = "/sys/bus/pci/devices";

pub fn run(ctx: &Context) -> Vec<Check> {
    let Some(bin) = binary() else {
        return all_skip(NO_HELPER);
    };
    let out = match process::run(&bin, &[], LIMIT) {
        Ok(o) => o,
        Err(e) => return broken(e, vec![]),
    };
    if !out.success() {
        return broken(out.describe(), out.tail(5));
    }
    match serde_json::from_str::<GpuReport>(out.stdout.trim()) {
        Ok(r) => checks(ctx, &r),
        Err(e) => broken(format!("unreadable report from gdrvm-gpu: {e}"), out.tail(5)),
    }
}

/// gdrvm-gpu: [`GPU`], else next to the running agent (a bare-metal build directory).
fn binary() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("gdrvm-gpu")));
    [Some(PathBuf::from(GPU)), beside].into_iter().flatten().find(|p| p.is_file())
}

fn all_skip(reason: &str) -> Vec<Check> {
    CHECKS.iter().map(|n| Check::new(n, Verdict::Skip(reason.to_owned()))).collect()
}

/// gdrvm-gpu did not report: `gpu_available` fails with why, the rest cannot run.
fn broken(reason: String, tail: Vec<String>) -> Vec<Check> {
    let mut checks = all_skip("gdrvm-gpu gave no report");
    checks[0] = Check { diagnostics: tail, ..Check::new(CHECKS[0], Verdict::Fail(reason)) };
    checks
}

/// The suite's checks on gdrvm-gpu's report, sysfs under `ctx.root` and the expectations.
fn checks(ctx: &Context, r: &GpuReport) -> Vec<Check> {
    let mut out = if r.available {
        vec![available(r), count(ctx, r), bus_ids(ctx, r)]
    } else {
        let reason = r.reason.clone().unwrap_or_else(|| "gdrvm-gpu gave no reason".into());
        let mut skipped = all_skip(&reason);
        skipped[0].diagnostics.push(format!("nvidia_peermem loaded: {}", r.gdr.nvidia_peermem));
        return skipped;
    };
    for d in &r.devices {
        out.extend([memory(d), host_copies(r, d)]);
    }
    out.extend([peer_matrix(ctx, r), peer_copy(r), gdr_ready(r)]);
    out
}

/// `gpu0 (NVIDIA H200, 0000:3b:00.0)`.
fn label(d: &DeviceReport) -> String {
    format!("gpu{} ({}, {})", d.ordinal, d.name, report::normalize_bus_id(&d.bus_id))
}

fn available(r: &GpuReport) -> Check {
    let version = r.driver_version.map_or("unknown".into(), |v| format!("{}.{}", v / 1000, v % 1000 / 10));
    let mut c = Check::new("gpu_available", Verdict::Pass)
        .note(format!("CUDA driver API {version}, {} device(s)", r.devices.len()));
    c.diagnostics.extend(r.devices.iter().map(label));
    c
}

/// Where the suite runs, from the expectations it was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A gdrvm guest: CUDA can drive the GPUs the VMM passed through (an emulated GPU has
    /// no NVIDIA driver behind it).
    Guest,
    /// Bare metal checked against a node file (`gdrvm-agent run --node`, a capture of the
    /// host): every GPU of the node file is the host's own.
    HostWithNode,
    /// Bare metal with no node file: sysfs is all there is.
    Host,
}

fn place(ctx: &Context) -> Place {
    match ctx.expect.as_ref().filter(|e| !e.pci.is_empty()) {
        None => Place::Host,
        Some(e) if e.host => Place::HostWithNode,
        Some(_) => Place::Guest,
    }
}

/// The GPUs CUDA should drive here (name, bus ID), as [`Place`] says; empty without
/// expectations.
fn expected_gpus(ctx: &Context) -> Vec<(String, String)> {
    let here = place(ctx);
    let Some(e) = ctx.expect.as_ref() else {
        return vec![];
    };
    e.pci
        .iter()
        .filter(|f| f.kind == "gpu" && (here == Place::HostWithNode || f.backing.starts_with("vfio:")))
        .map(|f| (f.name.clone(), report::normalize_bus_id(&f.bdf)))
        .collect()
}

/// What the expected GPUs are, in words.
fn expected_what(here: Place) -> &'static str {
    match here {
        Place::Guest => "the VMM passed through",
        Place::HostWithNode | Place::Host => "the node file has",
    }
}

/// The display-class functions in sysfs (bus IDs), where no expectations say more.
fn sysfs_gpus(ctx: &Context) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(ctx.path(SYSFS_PCI)) else { return vec![] };
    let mut found: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|bdf| read_class(ctx, bdf).is_some_and(|c| c >> 16 == 0x03))
        .collect();
    found.sort();
    found
}

fn count(ctx: &Context, r: &GpuReport) -> Check {
    let seen = r.devices.len();
    let here = place(ctx);
    if here == Place::Host {
        // Bare metal without a node file: CUDA against the display controllers in sysfs
        // (other vendors' GPUs among them, so fewer CUDA devices is only a note).
        let display = sysfs_gpus(ctx);
        let verdict = if seen <= display.len() {
            Verdict::Pass
        } else {
            Verdict::Fail(format!("CUDA sees {seen} GPU(s), sysfs has {} display controller(s)", display.len()))
        };
        return Check::new("gpu_count", verdict).note(format!(
            "{seen} CUDA device(s); {} display controller(s) in sysfs: {}",
            display.len(),
            display.join(", ")
        ));
    }
    let want = expected_gpus(ctx);
    let what = expected_what(here);
    let verdict = if want.len() == seen {
        Verdict::Pass
    } else {
        Verdict::Fail(format!("CUDA sees {seen} GPU(s), {what} {}", want.len()))
    };
    let excluded = if here == Place::Guest { " (emulated ones excluded)" } else { "" };
    Check::new("gpu_count", verdict).note(format!("{seen} CUDA device(s); {} GPU(s) {what}{excluded}", want.len()))
}

fn read_class(ctx: &Context, bdf: &str) -> Option<u32> {
    let text = std::fs::read_to_string(ctx.path(&format!("{SYSFS_PCI}/{bdf}/class"))).ok()?;
    u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// Every CUDA device is a display-class function in sysfs and, with expectations, one of the
/// GPUs expected here ([`expected_gpus`]); every such GPU has a CUDA device.
fn bus_ids(ctx: &Context, r: &GpuReport) -> Check {
    let here = place(ctx);
    let want = expected_gpus(ctx);
    let mut problems = Vec::new();
    let mut notes = Vec::new();
    let mut found = BTreeSet::new();
    for d in &r.devices {
        let bdf = report::normalize_bus_id(&d.bus_id);
        found.insert(bdf.clone());
        match read_class(ctx, &bdf) {
            None => problems.push(format!("{} is not in sysfs ({SYSFS_PCI}/{bdf})", label(d))),
            Some(c) if c >> 16 != 0x03 => {
                problems.push(format!("{} is class {c:06x} in sysfs, not a display controller (03xxxx)", label(d)))
            }
            Some(c) => notes.push(format!("{}: sysfs class {c:06x}", label(d))),
        }
        if here != Place::Host && !want.iter().any(|(_, b)| *b == bdf) {
            let names: Vec<String> = want.iter().map(|(n, b)| format!("{n} {b}")).collect();
            problems.push(format!(
                "{} is not a GPU {} (expected: {})",
                label(d),
                expected_what(here),
                if names.is_empty() { "none".into() } else { names.join(", ") }
            ));
        }
    }
    for (name, bdf) in want.iter().filter(|(_, b)| !found.contains(b)) {
        problems.push(format!("expected GPU {name} at {bdf} has no CUDA device"));
    }
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    Check { diagnostics: notes, ..Check::new("gpu_bus_ids", verdict) }
}

fn memory(d: &DeviceReport) -> Check {
    let verdict =
        if d.total_memory > 0 { Verdict::Pass } else { Verdict::Fail(format!("{} reports no memory", label(d))) };
    Check::new(&format!("gpu{}_memory", d.ordinal), verdict).note(format!("{}: {} MiB", label(d), d.total_memory >> 20))
}

fn host_copies(r: &GpuReport, d: &DeviceReport) -> Check {
    let name = format!("gpu{}_h2d_d2h", d.ordinal);
    if !r.bandwidth_measured {
        return Check::new(&name, Verdict::Skip("bandwidth not measured (--quick)".into()));
    }
    if let Some(e) = &d.bandwidth_error {
        return Check::new(&name, Verdict::Fail(format!("{}: {e}", label(d))));
    }
    match (d.h2d_gbps, d.d2h_gbps) {
        (Some(h), Some(g)) => Check::new(
            &name,
            if h > 0.0 && g > 0.0 {
                Verdict::Pass
            } else {
                Verdict::Fail(format!("{}: no bandwidth measured (H2D {h:.2}, D2H {g:.2} GB/s)", label(d)))
            },
        )
        .note(format!("{}: H2D {h:.1} GB/s, D2H {g:.1} GB/s (pinned host memory)", label(d))),
        _ => Check::new(&name, Verdict::Fail(format!("{}: bandwidth missing from the report", label(d)))),
    }
}

/// What NCCL predicts for a GPU pair: the PCIe path type, and whether it would use P2P.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prediction {
    path: PathType,
    p2p: bool,
}

/// NCCL's path between GPUs at `a` and `b` from sysfs (else from the expectations' paths),
/// and P2P when the path stays below the CPU's root complexes (PIX, PXB, PHB) and the VMM
/// lets both take part in peer-to-peer DMA.
fn predict(ctx: &Context, a: &str, b: &str) -> Option<Prediction> {
    let path = match (super::pci::nccl_device(ctx, a), super::pci::nccl_device(ctx, b)) {
        (Some(da), Some(db)) => nccl::path_type(&da, &db),
        _ => {
            let paths = ctx.expect.as_ref().map(|e| e.paths.as_slice()).unwrap_or_default();
            paths.iter().find(|p| (p.a == a && p.b == b) || (p.a == b && p.b == a))?.path
        }
    };
    let allowed = |bdf: &str| {
        let pci = ctx.expect.as_ref().map(|e| e.pci.as_slice()).unwrap_or_default();
        pci.iter().find(|f| f.bdf == bdf).is_none_or(|f| f.p2p)
    };
    Some(Prediction { path, p2p: path <= PathType::Phb && allowed(a) && allowed(b) })
}

fn find_peer(r: &GpuReport, a: i32, b: i32) -> Option<&PeerReport> {
    r.peers.iter().find(|p| p.a == a && p.b == b)
}

/// CUDA's peer access for every GPU pair next to NCCL's path; a pair where one allows P2P
/// and the other does not fails (unless CUDA reaches the peer over NVLink, which NCCL uses
/// whatever the PCIe path).
fn peer_matrix(ctx: &Context, r: &GpuReport) -> Check {
    if r.devices.len() < 2 {
        return Check::new("peer_matrix", Verdict::Skip("one GPU: no pairs".into()));
    }
    let mut notes = vec!["peer access (CUDA a->b / b->a) and NCCL's path, by pair:".to_owned()];
    let mut problems = Vec::new();
    for (i, da) in r.devices.iter().enumerate() {
        for db in &r.devices[i + 1..] {
            let (ba, bb) = (report::normalize_bus_id(&da.bus_id), report::normalize_bus_id(&db.bus_id));
            let (ab, back) = (find_peer(r, da.ordinal, db.ordinal), find_peer(r, db.ordinal, da.ordinal));
            let yes = |p: Option<&PeerReport>| p.is_some_and(|p| p.can_access);
            let nvlink = [ab, back].iter().any(|p| p.is_some_and(|p| p.native_atomics == Some(true)));
            let cuda = format!("{}/{}", yn(yes(ab)), yn(yes(back)));
            let pair = format!("gpu{} {ba} - gpu{} {bb}", da.ordinal, db.ordinal);
            let Some(nccl) = predict(ctx, &ba, &bb) else {
                notes.push(format!("{pair}: CUDA {cuda}, NCCL path unknown (not in sysfs or the expectations)"));
                continue;
            };
            let says = if nccl.p2p { "P2P" } else { "no P2P" };
            let link = if nvlink { ", NVLink (native atomics)" } else { "" };
            notes.push(format!("{pair}: CUDA {cuda}{link}, NCCL {} ({says})", nccl.path));
            if nccl.p2p && !(yes(ab) && yes(back)) {
                problems
                    .push(format!("{pair}: CUDA peer access {cuda} but NCCL's path is {} (P2P expected)", nccl.path));
            } else if !nccl.p2p && (yes(ab) || yes(back)) && !nvlink {
                problems.push(format!("{pair}: CUDA peer access {cuda} but NCCL's path is {} (no P2P)", nccl.path));
            }
        }
    }
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    Check { diagnostics: notes, ..Check::new("peer_matrix", verdict) }
}

fn yn(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

fn peer_copy(r: &GpuReport) -> Check {
    if !r.bandwidth_measured {
        return Check::new("peer_copy", Verdict::Skip("bandwidth not measured (--quick)".into()));
    }
    let able: Vec<&PeerReport> = r.peers.iter().filter(|p| p.can_access).collect();
    if able.is_empty() {
        return Check::new("peer_copy", Verdict::Skip("no GPU pair has peer access".into()));
    }
    let mut notes = Vec::new();
    let mut problems = Vec::new();
    for p in able {
        let pair = format!("gpu{} -> gpu{}", p.a, p.b);
        match (p.copy_gbps, &p.copy_error) {
            (_, Some(e)) => problems.push(format!("{pair}: {e}")),
            (Some(g), None) if g > 0.0 => notes.push(format!("{pair}: {g:.1} GB/s")),
            (g, None) => problems.push(format!("{pair}: no bandwidth measured ({g:?})")),
        }
    }
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    Check { diagnostics: notes, ..Check::new("peer_copy", verdict) }
}

/// GPUDirect RDMA readiness: `nvidia_peermem` loaded, or every GPU's memory exported as a
/// dma-buf and, where an RDMA device exists, registered with it (`ibv_reg_dmabuf_mr`).
fn gdr_ready(r: &GpuReport) -> Check {
    let peermem = r.gdr.nvidia_peermem;
    let mut notes = vec![format!("nvidia_peermem {}", if peermem { "loaded" } else { "not loaded" })];
    let mut failed = Vec::new();
    let device = r.gdr.rdma_device.as_deref().unwrap_or("the RDMA device");
    for d in &r.devices {
        match (&d.dmabuf_export.ok, &d.dmabuf_export.error) {
            (true, _) => notes.push(format!("{}: dma-buf export ok", label(d))),
            (false, e) => {
                let e = e.clone().unwrap_or_else(|| "failed (no reason given)".into());
                notes.push(format!("{}: dma-buf export {e}", label(d)));
                failed.push(format!("gpu{}: {e}", d.ordinal));
            }
        }
        match &d.dmabuf_mr {
            Some(Outcome { ok: true, .. }) => notes.push(format!("{}: ibv_reg_dmabuf_mr with {device} ok", label(d))),
            Some(Outcome { error, .. }) => {
                let e = error.clone().unwrap_or_else(|| "failed (no reason given)".into());
                notes.push(format!("{}: ibv_reg_dmabuf_mr with {device}: {e}", label(d)));
                failed.push(format!("gpu{} with {device}: {e}", d.ordinal));
            }
            None => {}
        }
    }
    if r.gdr.dmabuf_mr.is_none() {
        let why = r.gdr.dmabuf_mr_reason.clone().unwrap_or_else(|| "not tried".into());
        notes.push(format!("ibv_reg_dmabuf_mr: {why}"));
    }
    let verdict = if peermem || failed.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(format!("nvidia_peermem is not loaded and the dma-buf path failed ({})", failed.join("; ")))
    };
    Check { diagnostics: notes, ..Check::new("gdr_ready", verdict) }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::report::GdrReport;
    use super::*;
    use crate::context::{expected_function, test_context};

    /// A sysfs tree: each `(bdf, class, numa, parents)` a function under
    /// `/sys/devices/pci0000:00/<parents, root first>/<bdf>`, linked from `/sys/bus/pci/devices`.
    fn fake_sysfs(root: &Path, functions: &[(&str, u32, i32, &[&str])]) {
        let links = root.join("sys/bus/pci/devices");
        std::fs::create_dir_all(&links).unwrap();
        for (bdf, class, numa, parents) in functions {
            let mut dir = root.join("sys/devices/pci0000:00");
            for p in *parents {
                dir.push(p);
            }
            dir.push(bdf);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("class"), format!("{class:#08x}\n")).unwrap();
            std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
            std::os::unix::fs::symlink(&dir, links.join(bdf)).unwrap();
        }
    }

    /// vela-like: GPUs 03 and 04 below one switch (PIX), 0a behind another root port (PHB),
    /// 11 on the other NUMA node (SYS), and NIC 05.
    fn vela(root: &Path) {
        let sw0: &[&str] = &["0000:00:01.0", "0000:01:00.0", "0000:02:00.0"];
        let sw0b: &[&str] = &["0000:00:01.0", "0000:01:00.0", "0000:02:01.0"];
        fake_sysfs(
            root,
            &[
                ("0000:03:00.0", 0x03_02_00, 0, sw0),
                ("0000:04:00.0", 0x03_02_00, 0, sw0b),
                ("0000:0a:00.0", 0x03_02_00, 0, &["0000:00:02.0", "0000:08:00.0", "0000:09:00.0"]),
                ("0000:11:00.0", 0x03_02_00, 1, &["0000:00:03.0", "0000:0f:00.0", "0000:10:00.0"]),
                ("0000:05:00.0", 0x02_00_00, 0, &["0000:00:01.0", "0000:01:00.0", "0000:02:02.0"]),
            ],
        );
    }

    fn device(ordinal: i32, bus_id: &str) -> DeviceReport {
        DeviceReport {
            ordinal,
            name: "NVIDIA H200".into(),
            bus_id: bus_id.into(),
            total_memory: 141 << 30,
            h2d_gbps: Some(50.0),
            d2h_gbps: Some(51.0),
            dmabuf_export: Outcome { ok: true, error: None },
            ..DeviceReport::default()
        }
    }

    /// Every ordered pair, peer access as `access(a, b)` says.
    fn report(bus_ids: &[&str], access: impl Fn(usize, usize) -> bool) -> GpuReport {
        let devices: Vec<DeviceReport> = bus_ids.iter().enumerate().map(|(i, b)| device(i as i32, b)).collect();
        let mut peers = Vec::new();
        for a in 0..devices.len() {
            for b in (0..devices.len()).filter(|&b| b != a) {
                let can = access(a, b);
                peers.push(PeerReport {
                    a: a as i32,
                    b: b as i32,
                    can_access: can,
                    native_atomics: Some(false),
                    copy_gbps: can.then_some(40.0),
                    copy_error: None,
                });
            }
        }
        GpuReport {
            available: true,
            driver_version: Some(12040),
            bandwidth_measured: true,
            devices,
            peers,
            ..GpuReport::default()
        }
    }

    fn gpu(name: &str, bdf: &str) -> gdrvm_model::PciExpectation {
        gdrvm_model::PciExpectation {
            backing: format!("vfio:{bdf}"),
            ..expected_function(name, "gpu", bdf, (0x10de, 0x2335))
        }
    }

    #[test]
    fn test_from_the_helpers_json_all_pass() {
        let root = tempfile::tempdir().unwrap();
        vela(root.path());
        let ctx = test_context(root.path(), vec![gpu("gpu0", "0000:03:00.0"), gpu("gpu1", "0000:04:00.0")]);
        // CUDA's own spelling, as gdrvm-gpu would pass it on unnormalized.
        let json = serde_json::to_string(&report(&["0000:03:00.0", "00000000:04:00.0"], |_, _| true)).unwrap();
        let r: GpuReport = serde_json::from_str(&json).unwrap();
        let checks = checks(&ctx, &r);
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "gpu_available",
                "gpu_count",
                "gpu_bus_ids",
                "gpu0_memory",
                "gpu0_h2d_d2h",
                "gpu1_memory",
                "gpu1_h2d_d2h",
                "peer_matrix",
                "peer_copy",
                "gdr_ready"
            ]
        );
        for c in &checks {
            assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        }
        let matrix = &checks[7].diagnostics;
        assert_eq!(matrix[1], "gpu0 0000:03:00.0 - gpu1 0000:04:00.0: CUDA yes/yes, NCCL PIX (P2P)");
        assert_eq!(
            checks[4].diagnostics,
            ["gpu0 (NVIDIA H200, 0000:03:00.0): H2D 50.0 GB/s, D2H 51.0 GB/s (pinned host memory)"]
        );
    }

    #[test]
    fn test_bus_ids_missing_and_extra() {
        let root = tempfile::tempdir().unwrap();
        vela(root.path());
        let ctx = test_context(root.path(), vec![gpu("gpu0", "0000:03:00.0"), gpu("gpu1", "0000:04:00.0")]);
        // CUDA sees 03 (expected), 0a (in sysfs, not passed through), 3b (nowhere), NIC 05;
        // expected 04 has no CUDA device.
        let r = report(&["0000:03:00.0", "0000:0A:00.0", "0000:3b:00.0", "0000:05:00.0"], |_, _| false);
        let c = bus_ids(&ctx, &r);
        let Verdict::Fail(why) = &c.verdict else { panic!("{c:?}") };
        let problems: Vec<&str> = why.split("; ").collect();
        assert_eq!(
            problems,
            [
                "gpu1 (NVIDIA H200, 0000:0a:00.0) is not a GPU the VMM passed through (expected: gpu0 0000:03:00.0, gpu1 0000:04:00.0)",
                "gpu2 (NVIDIA H200, 0000:3b:00.0) is not in sysfs (/sys/bus/pci/devices/0000:3b:00.0)",
                "gpu2 (NVIDIA H200, 0000:3b:00.0) is not a GPU the VMM passed through (expected: gpu0 0000:03:00.0, gpu1 0000:04:00.0)",
                "gpu3 (NVIDIA H200, 0000:05:00.0) is class 020000 in sysfs, not a display controller (03xxxx)",
                "gpu3 (NVIDIA H200, 0000:05:00.0) is not a GPU the VMM passed through (expected: gpu0 0000:03:00.0, gpu1 0000:04:00.0)",
                "expected GPU gpu1 at 0000:04:00.0 has no CUDA device",
            ]
        );
        assert_eq!(count(&ctx, &r).verdict, Verdict::Fail("CUDA sees 4 GPU(s), the VMM passed through 2".into()));
        // Bare metal: sysfs only; CUDA may see fewer GPUs than there are display
        // controllers (another vendor's), never more.
        let bare = Context { expect: None, ..test_context(root.path(), vec![]) };
        let ok = report(&["0000:03:00.0", "0000:04:00.0"], |_, _| true);
        assert_eq!(bus_ids(&bare, &ok).verdict, Verdict::Pass);
        let c = count(&bare, &ok);
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.diagnostics,
            ["2 CUDA device(s); 4 display controller(s) in sysfs: 0000:03:00.0, 0000:04:00.0, 0000:0a:00.0, 0000:11:00.0"]
        );
        let five =
            report(&["0000:03:00.0", "0000:04:00.0", "0000:0a:00.0", "0000:11:00.0", "0000:12:00.0"], |_, _| true);
        assert_eq!(
            count(&bare, &five).verdict,
            Verdict::Fail("CUDA sees 5 GPU(s), sysfs has 4 display controller(s)".into())
        );
    }

    /// gdrvm-gpu's report on a real GPU: the device check of 2026-12-04, a Firecracker VM
    /// with one H200 passed through (driver 580, CUDA 13.0), no RDMA device.
    const H200_REPORT: &str = r#"{"available":true,"driver_version":13000,"bandwidth_measured":true,"devices":[{"ordinal":0,"name":"NVIDIA H200","bus_id":"0000:00:06.0","total_memory":150109880320,"h2d_gbps":54.91058693382472,"d2h_gbps":55.010692469366944,"dmabuf_export":{"ok":true}}],"gdr":{"nvidia_peermem":false,"dmabuf_mr":null,"dmabuf_mr_reason":"not tried: no RDMA device in /sys/class/infiniband"}}"#;

    #[test]
    fn test_a_real_h200_report_passes_against_the_sysfs_recorded_beside_it() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/src/capture/fixtures/h200-vm");
        let ctx = Context { expect: None, ..test_context(&root, vec![]) };
        let r: GpuReport = serde_json::from_str(H200_REPORT).unwrap();
        let c = checks(&ctx, &r);
        let verdicts: Vec<(&str, &Verdict)> = c.iter().map(|c| (c.name.as_str(), &c.verdict)).collect();
        assert!(c.iter().all(|c| !matches!(c.verdict, Verdict::Fail(_))), "{verdicts:?}");
        let names: Vec<&str> = c.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "gpu_available",
                "gpu_count",
                "gpu_bus_ids",
                "gpu0_memory",
                "gpu0_h2d_d2h",
                "peer_matrix",
                "peer_copy",
                "gdr_ready"
            ]
        );
        let gdr = c.iter().find(|c| c.name == "gdr_ready").unwrap();
        assert_eq!(gdr.verdict, Verdict::Pass, "{gdr:?}");
        assert!(gdr.diagnostics.iter().any(|d| d.contains("dma-buf export ok")), "{gdr:?}");
        let copies = c.iter().find(|c| c.name == "gpu0_h2d_d2h").unwrap();
        assert!(copies.diagnostics.iter().any(|d| d.contains("H2D 54.9 GB/s, D2H 55.0 GB/s")), "{copies:?}");
    }

    #[test]
    fn test_bare_metal_against_its_capture_expects_every_gpu_of_the_node_file() {
        let root = tempfile::tempdir().unwrap();
        vela(root.path());
        // A capture made without --vfio: the GPUs keep backing "none", and they are the
        // host's own.
        let host_gpu = |name, bdf| gdrvm_model::PciExpectation { backing: "none".into(), ..gpu(name, bdf) };
        let mut ctx =
            test_context(root.path(), vec![host_gpu("gpu0", "0000:03:00.0"), host_gpu("gpu1", "0000:04:00.0")]);
        if let Some(e) = ctx.expect.as_mut() {
            e.host = true;
        }
        let both = report(&["0000:03:00.0", "0000:04:00.0"], |_, _| true);
        assert_eq!(count(&ctx, &both).verdict, Verdict::Pass);
        assert_eq!(bus_ids(&ctx, &both).verdict, Verdict::Pass);
        let one = report(&["0000:03:00.0"], |_, _| true);
        assert_eq!(count(&ctx, &one).verdict, Verdict::Fail("CUDA sees 1 GPU(s), the node file has 2".into()));
        assert_eq!(
            bus_ids(&ctx, &one).verdict,
            Verdict::Fail("expected GPU gpu1 at 0000:04:00.0 has no CUDA device".into())
        );
        // The same node in a guest: only passed-through GPUs count, so none here.
        if let Some(e) = ctx.expect.as_mut() {
            e.host = false;
        }
        assert_eq!(count(&ctx, &both).verdict, Verdict::Fail("CUDA sees 2 GPU(s), the VMM passed through 0".into()));
    }

    #[test]
    fn test_peer_matrix_against_nccl_paths() {
        let root = tempfile::tempdir().unwrap();
        vela(root.path());
        let bare = Context { expect: None, ..test_context(root.path(), vec![]) };
        let ids = ["0000:03:00.0", "0000:04:00.0", "0000:0a:00.0", "0000:11:00.0"];
        // Agree: P2P up to PHB (gpu0-2), none across NUMA nodes (gpu3 is SYS to all).
        let agree = report(&ids, |a, b| a != 3 && b != 3);
        let c = peer_matrix(&bare, &agree);
        assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        assert!(c.diagnostics.contains(&"gpu0 0000:03:00.0 - gpu2 0000:0a:00.0: CUDA yes/yes, NCCL PHB (P2P)".into()));
        assert!(c.diagnostics.contains(&"gpu2 0000:0a:00.0 - gpu3 0000:11:00.0: CUDA no/no, NCCL SYS (no P2P)".into()));

        // CUDA says no where NCCL's path is PIX (one direction is enough).
        let cuda_no = report(&ids, |a, b| a != 3 && b != 3 && (a, b) != (1, 0));
        assert_eq!(
            peer_matrix(&bare, &cuda_no).verdict,
            Verdict::Fail(
                "gpu0 0000:03:00.0 - gpu1 0000:04:00.0: CUDA peer access yes/no but NCCL's path is PIX (P2P expected)"
                    .into()
            )
        );

        // CUDA says yes across NUMA nodes where NCCL's path is SYS...
        let cuda_yes = report(&ids[..], |a, b| (a, b) != (2, 3) && (a, b) != (3, 2));
        let Verdict::Fail(why) = peer_matrix(&bare, &cuda_yes).verdict else { panic!() };
        assert_eq!(
            why.split("; ").next(),
            Some("gpu0 0000:03:00.0 - gpu3 0000:11:00.0: CUDA peer access yes/yes but NCCL's path is SYS (no P2P)")
        );
        assert_eq!(why.split("; ").count(), 2, "{why}");
        // ... which NVLink explains.
        let mut nvlink = cuda_yes.clone();
        nvlink.peers.iter_mut().for_each(|p| p.native_atomics = Some(p.can_access));
        assert_eq!(peer_matrix(&bare, &nvlink).verdict, Verdict::Pass);

        // A GPU the node keeps out of P2P: NCCL predicts none even on a PIX path.
        let no_p2p = gdrvm_model::PciExpectation { p2p: false, ..gpu("gpu1", "0000:04:00.0") };
        let ctx = test_context(root.path(), vec![gpu("gpu0", "0000:03:00.0"), no_p2p]);
        let two = report(&ids[..2], |_, _| true);
        assert_eq!(
            peer_matrix(&ctx, &two).verdict,
            Verdict::Fail(
                "gpu0 0000:03:00.0 - gpu1 0000:04:00.0: CUDA peer access yes/yes but NCCL's path is PIX (no P2P)"
                    .into()
            )
        );
    }

    #[test]
    fn test_unavailable_skips_everything_with_the_reason() {
        let root = tempfile::tempdir().unwrap();
        let ctx = test_context(root.path(), vec![gpu("gpu0", "0000:03:00.0")]);
        let r: GpuReport = serde_json::from_str(
            r#"{"available":false,"reason":"libcuda cannot be loaded","gdr":{"nvidia_peermem":false,"dmabuf_mr":null}}"#,
        )
        .unwrap();
        let checks = checks(&ctx, &r);
        assert_eq!(checks.len(), CHECKS.len());
        for c in &checks {
            assert_eq!(c.verdict, Verdict::Skip("libcuda cannot be loaded".into()), "{c:?}");
        }
        let missing = all_skip(NO_HELPER);
        assert!(missing.iter().all(|c| c.verdict == Verdict::Skip(NO_HELPER.into())));
        let b = broken("gdrvm-gpu exited with status 1".into(), vec![]);
        assert_eq!(b[0].verdict, Verdict::Fail("gdrvm-gpu exited with status 1".into()));
        assert_eq!(b[1].verdict, Verdict::Skip("gdrvm-gpu gave no report".into()));
    }

    #[test]
    fn test_copies_and_gdr_readiness() {
        let mut r = report(&["0000:03:00.0", "0000:04:00.0"], |_, _| true);
        assert_eq!(peer_copy(&r).diagnostics, ["gpu0 -> gpu1: 40.0 GB/s", "gpu1 -> gpu0: 40.0 GB/s"]);
        r.peers[1].copy_error = Some("cuMemcpyPeer failed: CUDA_ERROR_UNKNOWN".into());
        assert_eq!(
            peer_copy(&r).verdict,
            Verdict::Fail("gpu1 -> gpu0: cuMemcpyPeer failed: CUDA_ERROR_UNKNOWN".into())
        );
        r.devices[1].bandwidth_error = Some("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY".into());
        assert!(matches!(host_copies(&r, &r.devices[1]).verdict, Verdict::Fail(_)));
        r.bandwidth_measured = false;
        assert!(matches!(host_copies(&r, &r.devices[1]).verdict, Verdict::Skip(_)));
        assert!(matches!(peer_copy(&r).verdict, Verdict::Skip(_)));

        assert_eq!(gdr_ready(&r).verdict, Verdict::Pass);
        r.devices[1].dmabuf_export =
            Outcome { ok: false, error: Some("CUDA_ERROR_NOT_SUPPORTED: operation not supported".into()) };
        assert_eq!(
            gdr_ready(&r).verdict,
            Verdict::Fail(
                "nvidia_peermem is not loaded and the dma-buf path failed (gpu1: CUDA_ERROR_NOT_SUPPORTED: operation not supported)"
                    .into()
            )
        );
        r.gdr.nvidia_peermem = true;
        assert_eq!(gdr_ready(&r).verdict, Verdict::Pass);
    }

    #[test]
    fn test_gpu_memory_the_rdma_device_cannot_register_is_not_gdr_ready() {
        let mut r = report(&["0000:03:00.0", "0000:04:00.0"], |_, _| true);
        r.gdr.dmabuf_mr_reason = Some("not tried: no RDMA device in /sys/class/infiniband".into());
        let c = gdr_ready(&r);
        assert_eq!(c.verdict, Verdict::Pass);
        assert!(c
            .diagnostics
            .contains(&"ibv_reg_dmabuf_mr: not tried: no RDMA device in /sys/class/infiniband".into()));

        r.gdr = GdrReport { rdma_device: Some("mlx5_0".into()), dmabuf_mr: Some(false), ..GdrReport::default() };
        r.devices[0].dmabuf_mr = Some(Outcome { ok: true, error: None });
        r.devices[1].dmabuf_mr = Some(Outcome { ok: false, error: Some("ibv_reg_dmabuf_mr: Bad address".into()) });
        let c = gdr_ready(&r);
        assert_eq!(
            c.verdict,
            Verdict::Fail(
                "nvidia_peermem is not loaded and the dma-buf path failed (gpu1 with mlx5_0: ibv_reg_dmabuf_mr: Bad address)"
                    .into()
            )
        );
        assert!(c.diagnostics.contains(&"gpu0 (NVIDIA H200, 0000:03:00.0): ibv_reg_dmabuf_mr with mlx5_0 ok".into()));
        // nvidia_peermem is the other way to GPUDirect RDMA.
        r.gdr.nvidia_peermem = true;
        assert_eq!(gdr_ready(&r).verdict, Verdict::Pass);
    }
}
