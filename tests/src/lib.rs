//! The end-to-end fixture: every guest the tests need, run once in one batch (so a nested
//! run boots L1 once), with results shared by the test functions.
//!
//! Tests need the artifacts `cargo xtask test` builds first; without them each test prints
//! SKIP with the reason instead of passing silently. Under `cargo xtask test` (which sets
//! [`REQUIRED_ENV`]) nothing may be skipped for want of artifacts or a working runner: a
//! test that cannot run fails with the reason, so CI never goes green having booted nothing.
//! Only a host that truly lacks the means ([`skip_unsupported`]) still skips.

use std::sync::OnceLock;
use std::time::Duration;

use gdrvm_harness::{Artifacts, ClusterSpec, Runner, RunnerChoice, VmResult, VmSpec, Vmm};

/// Names of the guests in the batch.
pub mod guests {
    /// The default image running the smoke suite on 2 vCPUs and 1 GiB.
    pub const SMOKE: &str = "smoke-2cpu-1g";
    /// The default image on 1 vCPU and 512 MiB.
    pub const SMOKE_SMALL: &str = "smoke-1cpu-512m";
    /// A guest whose init does not exist: the kernel panics.
    pub const NO_INIT: &str = "panic-no-init";
    /// The vela-a100 node scaled to 4 vCPUs and 1 GiB over its two NUMA nodes, both bound
    /// to host node 0 (`host_numa`).
    pub const VELA_NUMA: &str = "vela-a100-4cpu-1g";
    /// The flat node (vela-a100's devices on one root bus) scaled to 2 vCPUs and 1 GiB.
    pub const FLAT: &str = "flat-2cpu-1g";
    /// The minimal node: one GPU and one NIC under one switch.
    pub const MINIMAL: &str = "minimal-2cpu-1g";
    /// vfio-lab: QEMU's e1000e x2, edu and ivshmem passed through from a lab L1.
    pub const VFIO_LAB: &str = "vfio-lab-1cpu-1g";
    /// vfio-lab with `p2p = false`: edu's DMA into the ivshmem BAR must not land.
    pub const VFIO_LAB_NO_P2P: &str = "vfio-lab-no-p2p-1cpu-1g";
    /// vfio-lab with e1000e on legacy INTx (`e1000e.IntMode=0,0`).
    pub const VFIO_LAB_INTX: &str = "vfio-lab-intx-1cpu-1g";
    /// vfio-lab under the chaos suite: random config and BAR writes, then the guest's verdict.
    pub const VFIO_LAB_CHAOS: &str = "vfio-lab-chaos-1cpu-1g";
    /// minimal with peer-to-peer off: the emulated NIC must not reach the GPU's BAR.
    pub const MINIMAL_NO_P2P: &str = "minimal-no-p2p-2cpu-1g";
    /// minimal whose NIC emulator dies (SIGKILL) in the middle of the gdr suite.
    pub const NIC_DIES: &str = "minimal-nic-dies-2cpu-1g";
    /// minimal whose NIC emulator answers every request with an error mid-suite.
    pub const NIC_ERRORS: &str = "minimal-nic-errors-2cpu-1g";
    /// minimal whose NIC emulator stops answering mid-suite.
    pub const NIC_HANGS: &str = "minimal-nic-hangs-2cpu-1g";
    /// minimal with virtio-net for nic0 (no wire) under the virtio chaos suite.
    pub const VIRTIO_NET: &str = "minimal-virtio-net-2cpu-1g";
    /// The two-node cluster: two minimal nodes joined NIC to NIC, soft-RoCE between them.
    pub const TWO_NODE: &str = "two-node-1cpu-768m";
    /// two-node whose node b's VMM is killed once the rdma suite starts pairing.
    pub const TWO_NODE_KILLED: &str = "two-node-b-killed-1cpu-768m";
}

/// The line the rdma suite prints as its pair tests start; the killed-peer test kills node
/// b's VMM there.
pub const PAIR_STARTED: &str = "# rdma: pairing with";

/// The register write of the gdr suite's NIC at which the fault tests' emulator fails:
/// past the register checks and the ring set-up, among the transfers.
const FAULT_AT: u32 = 12;

/// A preset with `edit` applied, written where the batch can find it (the harness
/// carries node files into L1).
fn variant_node(preset: &str, name: &str, edit: impl Fn(&str) -> String) -> Result<String, String> {
    let text = gdrvm_model::node::Node::preset_text(preset).ok_or(format!("no {preset} preset"))?;
    let dir = gdrvm_harness::gdrvm_dir().join("e2e");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, edit(text)).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path.display().to_string())
}

/// minimal with nic0's emulator failing as `fault` says.
fn faulty_nic(kind: &str) -> Result<String, String> {
    variant_node("minimal", &format!("minimal-nic-{kind}"), |text| {
        text.replacen(
            "name = \"nic0\"\n",
            &format!("name = \"nic0\"\nemulator_args = [\"--fault\", \"{kind}@{FAULT_AT}\"]\n"),
            1,
        )
    })
}

fn specs(a: &Artifacts) -> Result<Vec<VmSpec>, String> {
    let p2p_off = |t: &str| t.replacen("description =", "p2p = false\ndescription =", 1);
    let no_p2p = variant_node("vfio-lab", "vfio-lab-no-p2p", p2p_off)?;
    let minimal_no_p2p = variant_node("minimal", "minimal-no-p2p", p2p_off)?;
    let (dies, errors, hangs) = (faulty_nic("exit")?, faulty_nic("error")?, faulty_nic("hang")?);
    // Both guest NUMA nodes bound to host node 0 (L1 and these hosts have one): the
    // memory binding and vCPU pinning run on every CI boot of the NUMA guest.
    let vela_bound =
        variant_node("vela-a100", "vela-a100-host-numa", |t| t.replace("[[numa]]\n", "[[numa]]\nhost_numa = 0\n"))?;
    let virtio_net = variant_node("minimal", "minimal-virtio-net", |t| {
        t.replacen("backing = \"emulated-nic\"", "backing = \"virtio-net\"\nmtu = 9000", 1)
    })?;
    let spec = |name: &str, cmdline: &str, cpus: u32, memory: &str| VmSpec {
        name: name.into(),
        vmm: Vmm::Gdrvm,
        image: a.guest_for(cmdline),
        node: match name {
            guests::VELA_NUMA => Some(vela_bound.clone()),
            guests::FLAT => Some("flat".to_owned()),
            guests::MINIMAL => Some("minimal".to_owned()),
            guests::VFIO_LAB | guests::VFIO_LAB_INTX | guests::VFIO_LAB_CHAOS => Some("vfio-lab".to_owned()),
            guests::VFIO_LAB_NO_P2P => Some(no_p2p.clone()),
            guests::MINIMAL_NO_P2P => Some(minimal_no_p2p.clone()),
            guests::NIC_DIES => Some(dies.clone()),
            guests::NIC_ERRORS => Some(errors.clone()),
            guests::NIC_HANGS => Some(hangs.clone()),
            guests::VIRTIO_NET => Some(virtio_net.clone()),
            _ => None,
        },
        cluster: match name {
            guests::TWO_NODE => Some(ClusterSpec { cluster: "two-node".into(), kill: None, qemu: false }),
            guests::TWO_NODE_KILLED => {
                Some(ClusterSpec { cluster: "two-node".into(), kill: Some(format!("b:{PAIR_STARTED}")), qemu: false })
            }
            _ => None,
        },
        cmdline: cmdline.into(),
        cpus,
        memory: memory.into(),
        // A guest boots in 15-20 s nested; a hung one should not hold CI for long.
        timeout: Duration::from_secs(150),
    };
    Ok(vec![
        spec(guests::SMOKE, "console=ttyS0 quiet panic=-1 gdrvm.suites=smoke", 2, "1G"),
        spec(guests::SMOKE_SMALL, "console=ttyS0 quiet panic=-1 gdrvm.suites=smoke", 1, "512M"),
        spec(guests::NO_INIT, "console=ttyS0 quiet panic=-1 rdinit=/no/such/init", 1, "256M"),
        spec(guests::VELA_NUMA, "console=ttyS0 quiet panic=-1 gdrvm.suites=smoke,topology,capture", 4, "1G"),
        spec(guests::FLAT, "console=ttyS0 quiet panic=-1 gdrvm.suites=smoke,topology,capture", 2, "1G"),
        // Emulated GPU and NIC: the GPUDirect path, its P2P-off negative, and devices that die.
        spec(guests::MINIMAL, "console=ttyS0 quiet panic=-1 gdrvm.suites=smoke,topology,capture,gdr", 2, "1G"),
        spec(guests::MINIMAL_NO_P2P, "console=ttyS0 quiet panic=-1 gdrvm.suites=gdr", 2, "1G"),
        spec(guests::NIC_DIES, "console=ttyS0 quiet panic=-1 gdrvm.suites=gdr", 2, "1G"),
        spec(guests::NIC_ERRORS, "console=ttyS0 quiet panic=-1 gdrvm.suites=gdr", 2, "1G"),
        spec(guests::NIC_HANGS, "console=ttyS0 quiet panic=-1 gdrvm.suites=gdr", 2, "1G"),
        // virtio-net and the fabric: malformed descriptors, then two nodes over a wire.
        spec(guests::VIRTIO_NET, "console=ttyS0 quiet panic=-1 gdrvm.suites=topology,virtio", 2, "1G"),
        spec(guests::TWO_NODE, "console=ttyS0 quiet panic=-1 tsc=reliable gdrvm.suites=rdma,topology", 1, "768M"),
        spec(guests::TWO_NODE_KILLED, "console=ttyS0 quiet panic=-1 tsc=reliable gdrvm.suites=rdma", 1, "768M"),
        // One vCPU: see the vfio-lab preset. Both share one lab L1.
        spec(guests::VFIO_LAB, "console=ttyS0 quiet panic=-1 gdrvm.suites=vfio,topology", 1, "1G"),
        spec(guests::VFIO_LAB_NO_P2P, "console=ttyS0 quiet panic=-1 gdrvm.suites=vfio", 1, "1G"),
        spec(guests::VFIO_LAB_INTX, "console=ttyS0 quiet panic=-1 gdrvm.suites=vfio e1000e.IntMode=0,0", 1, "1G"),
        // A fixed seed, so that a failure replays; last, since it leaves devices in odd
        // states (gdrvm resets them before the next guest).
        spec(
            guests::VFIO_LAB_CHAOS,
            "console=ttyS0 quiet panic=-1 gdrvm.suites=chaos gdrvm.chaos_secs=15 gdrvm.chaos_seed=0x8a1d93f578ba8a0d",
            1,
            "1G",
        ),
    ])
}

/// What node `node` of a cluster run reported: its console lines (the cluster prefixes
/// them with `[node] `) parsed as KTAP on their own.
pub fn node_report(r: &VmResult, node: &str) -> gdrvm_harness::ktap::KtapReport {
    let prefix = format!("[{node}] ");
    let lines: Vec<&str> = r.console.iter().filter_map(|l| l.strip_prefix(prefix.as_str())).collect();
    gdrvm_harness::ktap::parse(&lines.join("\n"))
}

/// Why the end-to-end tests cannot run, or the artifacts to run with.
pub fn artifacts() -> Result<Artifacts, String> {
    Artifacts::locate().map_err(|e| e.to_string())
}

static RESULTS: OnceLock<Result<Vec<VmResult>, String>> = OnceLock::new();

fn run_batch() -> Result<Vec<VmResult>, String> {
    let a = artifacts()?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let (kind, why) = gdrvm_harness::choose(RunnerChoice::Auto, &a).await;
        eprintln!("e2e: runner {kind:?}: {why}");
        // GDRVM_ECHO=1 prints every console line as it arrives, for debugging a slow run.
        let mut runner = Runner::new(kind, a.clone());
        runner.echo = std::env::var_os("GDRVM_ECHO").is_some();
        let results = runner.run(&specs(&a)?).await.map_err(|e| e.to_string())?;
        for r in &results {
            let reruns = match r.emulator_losses {
                0 => String::new(),
                n => format!(" (after {n} loss(es) to the emulator, each run again)"),
            };
            eprintln!("e2e: {}: {:?} in {:.1?}{reruns}", r.name, r.outcome, r.elapsed);
        }
        Ok(results)
    })
}

/// What a guest's result looks like in an assertion message: outcome, problem, last lines.
pub fn dump(r: &VmResult) -> String {
    let mut text = format!("{:?} {:?}\n{}", r.outcome, r.problem(), r.tail().join("\n"));
    // A cluster's console interleaves its nodes (`[a] ...`): each node's own last lines too.
    let mut nodes: Vec<&str> = r
        .console
        .iter()
        .filter_map(|l| l.strip_prefix('[')?.split_once("] ").map(|(n, _)| n))
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()) && *n != "l1")
        .collect();
    nodes.sort_unstable();
    nodes.dedup();
    for node in nodes {
        let prefix = format!("[{node}] ");
        let lines: Vec<&str> = r.console.iter().filter(|l| l.starts_with(&prefix)).map(String::as_str).collect();
        text.push_str(&format!(
            "\n--- node {node}, last lines:\n{}",
            lines[lines.len().saturating_sub(25)..].join("\n")
        ));
    }
    text
}

/// Guest `name`'s result and its [`dump`], or None after test `test` printed a SKIP.
pub fn guest(name: &str, test: &str) -> Option<(VmResult, String)> {
    match result(name) {
        Ok(r) => {
            let dump = dump(&r);
            Some((r, dump))
        }
        Err(why) => {
            skip(test, &why);
            None
        }
    }
}

/// Suite `name` of a guest's KTAP; panics with the guest's [`dump`] when it is missing.
pub fn suite(r: &VmResult, name: &str) -> gdrvm_harness::ktap::SuiteResult {
    r.ktap.suites.iter().find(|s| s.name == name).cloned().unwrap_or_else(|| panic!("no suite {name}: {}", dump(r)))
}

/// Check `name` of suite `s`: its outcome and its diagnostics, one per line.
pub fn check(s: &gdrvm_harness::ktap::SuiteResult, name: &str) -> (gdrvm_harness::ktap::CaseOutcome, String) {
    let c = s.cases.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no check {name} in {}", s.name));
    (c.outcome.clone(), c.diagnostics.join("\n"))
}

/// Every guest's result, or the reason the batch could not run (the caller SKIPs).
pub fn results() -> Result<Vec<VmResult>, String> {
    RESULTS.get_or_init(run_batch).clone()
}

/// The result of guest `name`, or the reason the batch could not run (the caller SKIPs).
pub fn result(name: &str) -> Result<VmResult, String> {
    let results = RESULTS.get_or_init(run_batch).as_ref().map_err(Clone::clone)?;
    results.iter().find(|r| r.name == name).cloned().ok_or_else(|| format!("no guest named {name} in the batch"))
}

/// Set (to anything) by `cargo xtask test`: every end-to-end test must run.
pub const REQUIRED_ENV: &str = "GDRVM_E2E_REQUIRED";

/// Marks the start of a SKIP line; `cargo xtask test` counts them.
pub const SKIP_MARKER: &str = "SKIP ";

/// Prints a SKIP line for a test that could not run; fails it instead when every test
/// must run ([`REQUIRED_ENV`]).
pub fn skip(test: &str, why: &str) {
    if std::env::var_os(REQUIRED_ENV).is_some() {
        panic!("{test} could not run, and under `cargo xtask test` every end-to-end test must: {why}");
    }
    skip_unsupported(test, why);
}

/// Prints a SKIP line for a test this host has no means to run (not even in CI), in one
/// line with the reason.
pub fn skip_unsupported(test: &str, why: &str) {
    eprintln!("{SKIP_MARKER}{test}: {why}");
}
