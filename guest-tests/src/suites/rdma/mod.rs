//! `rdma`: RoCE between the nodes of a cluster over soft-RoCE (`rdma_rxe`). In order:
//! the kernel modules ([`modules`]); each NIC of `gdrvm.net` addressed and up
//! ([`crate::net`]); an rxe device on each (`rdma link add rxe_<func> type rxe netdev
//! <if>`), with its port ACTIVE and a RoCE v2 GID for the NIC's IPv4 address; every RDMA
//! device's PCI function against the node file ([`ibdev`]); the verbs view of each device
//! (`gdrvm-verbs query`, [`verbs`]); then with each peer of `gdrvm.peers` in name order,
//! over a control connection of the agents ([`control`]; the lower name listens): the RC
//! queue-pair test (`gdrvm-verbs pair`: send/receive, RDMA WRITE and READ at 4 KiB,
//! 64 KiB and 4 MiB, verified on both sides) and perftest (`ib_write_bw`, `ib_read_lat`,
//! [`perftest`]), their figures as diagnostics. Every wait on a peer has a deadline and a
//! vanished peer is an error within seconds, so the suite always finishes.
//!
//! The verbs code lives in gdrvm-verbs, a dynamically linked program: the agent stays
//! static and starts where libibverbs is absent.

mod control;
pub(super) mod ibdev;
mod modules;
mod perftest;
pub(crate) mod process;
mod verbs;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use self::control::{Control, Line};
use self::perftest::Tool;
use self::process::{secs, Outcome};
use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::net::{self, Cluster, Configured, Peer};

/// First TCP port of the pair ports: a pair whose client has rank R uses BASE + 5R
/// (control), + 1 (gdrvm-verbs pair), + 2 (ib_write_bw), + 3 (ib_read_lat), + 4 (TCP stream).
const PORT_BASE: u16 = 18500;
/// How long the two agents of a pair may take to find each other (boots differ).
const CONNECT_WINDOW: Duration = Duration::from_secs(120);
/// How long an interface may take to get carrier.
const CARRIER_WAIT: Duration = Duration::from_secs(10);
/// How long a new rxe device may take to show up ACTIVE with its RoCE v2 GID.
const RXE_WAIT: Duration = Duration::from_secs(10);
/// The peer's answer before a step (it is at the same point).
const READY_WAIT: Duration = Duration::from_secs(60);
/// gdrvm-verbs pair: completions and side-channel timeouts.
const PAIR_TIMEOUT_SECS: u64 = 10;
/// gdrvm-verbs pair: how long its side channel may take to connect.
const PAIR_CONNECT_SECS: u64 = 30;
/// gdrvm-verbs pair as a whole.
const PAIR_LIMIT: Duration = Duration::from_secs(240);
/// One perftest run.
const PERF_LIMIT: Duration = Duration::from_secs(60);
/// How long a perftest client retries while its server is not listening yet.
const PERF_RETRY: Duration = Duration::from_secs(20);
/// Where iproute2's `rdma` may be.
const RDMA_TOOL: &[&str] = &["/usr/bin/rdma", "/sbin/rdma", "/usr/sbin/rdma", "/bin/rdma"];

/// A NIC with its soft-RoCE device, ready for verbs.
#[derive(Debug, Clone)]
struct Local {
    nic: Configured,
    dev: String,
    gid_index: u32,
    /// The RoCE v2 GID, as an IPv6 address.
    gid: String,
}

/// Runs the suite.
pub fn run(ctx: &Context) -> Vec<Check> {
    let cmdline = std::fs::read_to_string(ctx.path("/proc/cmdline")).unwrap_or_default();
    let cluster = Cluster::from_cmdline(&cmdline);
    let mut checks = Vec::new();
    if !cluster.errors.is_empty() {
        checks.push(Check::new("cluster_args", Verdict::Fail(cluster.errors.join("; "))));
    }
    let modules = modules::ensure(ctx, modules::RDMA_MODULES);
    let modules_ok = modules.verdict == Verdict::Pass;
    checks.push(modules);

    let mut nics = Vec::new();
    if cluster.nets.is_empty() {
        checks.push(Check::new(
            "net",
            Verdict::Skip("no gdrvm.net on the kernel command line: no NIC to address".into()),
        ));
    }
    for addr in &cluster.nets {
        let (result, notes) = net::configure(ctx, addr, CARRIER_WAIT);
        checks.push(check(&format!("net_{}", addr.func), notes, result.as_ref().err().cloned()));
        nics.extend(result.ok());
    }
    let mut locals = Vec::new();
    for nic in &nics {
        let (check, local) = rxe_device(ctx, nic, modules_ok);
        checks.push(check);
        locals.extend(local);
    }
    checks.extend(pci_parents(ctx, &locals, !cluster.nets.is_empty()));
    checks.extend(verbs_query(ctx, &locals));
    checks.extend(pairs(&cluster, &locals));
    checks
}

fn check(name: &str, notes: Vec<String>, problem: Option<String>) -> Check {
    let verdict = problem.map_or(Verdict::Pass, Verdict::Fail);
    Check { diagnostics: notes, ..Check::new(name, verdict) }
}

fn rdma_tool() -> Option<PathBuf> {
    RDMA_TOOL.iter().map(PathBuf::from).find(|p| p.is_file())
}

/// The rxe device on `nic`: an existing one on its interface, or a new `rxe_<func>`; then
/// its port ACTIVE and the RoCE v2 GID of the NIC's address.
fn rxe_device(ctx: &Context, nic: &Configured, modules_ok: bool) -> (Check, Option<Local>) {
    let name = format!("rxe_{}", nic.net.func);
    let mut notes = Vec::new();
    let tool = rdma_tool();
    let existing = ibdev::devices(&ctx.root)
        .into_iter()
        .find(|d| ibdev::netdevs(&ctx.root, d).contains(&nic.ifname))
        .or_else(|| {
            let out = process::run(tool.as_ref()?, &["link".into(), "show".into()], Duration::from_secs(10)).ok()?;
            ibdev::parse_rdma_links(&out.stdout)
                .into_iter()
                .find(|l| l.netdev.as_ref() == Some(&nic.ifname))
                .map(|l| l.dev)
        });
    let dev = match existing {
        Some(dev) => {
            notes.push(format!("{dev} already runs on {}", nic.ifname));
            dev
        }
        None if !modules_ok => {
            let reason = "soft-RoCE is not available (see rdma_modules)".to_owned();
            return (Check { diagnostics: notes, ..Check::new(&name, Verdict::Skip(reason)) }, None);
        }
        None => {
            let Some(tool) = tool else {
                let reason = format!("iproute2's rdma is not in the image (looked for {})", RDMA_TOOL.join(", "));
                return (check(&name, notes, Some(reason)), None);
            };
            let args: Vec<String> =
                ["link", "add", &name, "type", "rxe", "netdev", &nic.ifname].iter().map(|s| s.to_string()).collect();
            match process::run(&tool, &args, Duration::from_secs(20)) {
                Ok(o) if o.success() => notes.push(format!("{} (in {} ms)", o.command, o.elapsed.as_millis())),
                Ok(o) => {
                    let reason = format!("{}: {}", o.describe(), o.tail(2).join(" / "));
                    return (check(&name, notes, Some(reason)), None);
                }
                Err(e) => return (check(&name, notes, Some(e)), None),
            }
            name.clone()
        }
    };
    let start = Instant::now();
    let ready = net::wait_for(RXE_WAIT, || {
        let state = ibdev::port_state(&ctx.root, &dev)?;
        let gids = ibdev::gids(&ctx.root, &dev);
        let gid = ibdev::roce_v2_ipv4(&gids, nic.net.addr)?.clone();
        (state == "ACTIVE").then_some(gid)
    });
    let state = ibdev::port_state(&ctx.root, &dev);
    let Some(gid) = ready else {
        let reason = match state {
            None => format!("{dev} did not appear in /sys/class/infiniband within {}", secs(RXE_WAIT)),
            Some(s) if s != "ACTIVE" => format!("{dev} port 1 is {s} after {}, not ACTIVE", secs(RXE_WAIT)),
            Some(_) => {
                let have: Vec<String> = ibdev::gids(&ctx.root, &dev)
                    .iter()
                    .map(|g| format!("[{}] {} {}", g.index, g.gid, g.kind))
                    .collect();
                format!(
                    "{dev} has no RoCE v2 GID for {} after {} (GIDs: {})",
                    nic.net.addr,
                    secs(RXE_WAIT),
                    have.join(", ")
                )
            }
        };
        return (check(&name, notes, Some(reason)), None);
    };
    notes.push(format!(
        "{dev} on {} ({}): port 1 ACTIVE after {} ms, RoCE v2 GID[{}] {}",
        nic.ifname,
        nic.bdf,
        start.elapsed().as_millis(),
        gid.index,
        gid.gid
    ));
    let local = Local { nic: nic.clone(), dev, gid_index: gid.index, gid: gid.gid.to_string() };
    (check(&name, notes, None), Some(local))
}

/// Every RDMA device's PCI function: a soft-RoCE device must sit on its NIC's function
/// (the node file's BDF); any other must sit on a function the node file has. With NICs to
/// run soft-RoCE on (`want_devices`), no device at all is a failure.
fn pci_parents(ctx: &Context, locals: &[Local], want_devices: bool) -> Vec<Check> {
    let devs = ibdev::devices(&ctx.root);
    if devs.is_empty() {
        let reason = "no RDMA device in /sys/class/infiniband".to_owned();
        let verdict = if want_devices { Verdict::Fail(reason) } else { Verdict::Skip(reason) };
        return vec![Check::new("ib_devices", verdict)];
    }
    devs.iter()
        .map(|dev| {
            let name = format!("{dev}_pci_parent");
            let parent = match ibdev::pci_parent(&ctx.root, dev) {
                Ok(p) => p,
                Err(e) => return check(&name, Vec::new(), Some(e)),
            };
            let mut notes = vec![parent.via.clone(), format!("{dev} is on {}", parent.bdf)];
            let problem = match locals.iter().find(|l| &l.dev == dev) {
                Some(l) => {
                    notes.push(format!("the node file puts {} at {}", l.nic.net.func, l.nic.bdf));
                    (parent.bdf != l.nic.bdf)
                        .then(|| format!("{dev} sits on {}, but {} is {}", parent.bdf, l.nic.net.func, l.nic.bdf))
                }
                None => match ctx.expect.as_ref().map(|e| e.pci.iter().find(|p| p.bdf == parent.bdf)) {
                    Some(Some(f)) => {
                        notes.push(format!("that is {} ({}) in the node file", f.name, f.kind));
                        None
                    }
                    Some(None) => Some(format!("{dev} sits on {}, which the node file does not have", parent.bdf)),
                    None => None,
                },
            };
            check(&name, notes, problem)
        })
        .collect()
}

/// `gdrvm-verbs query`, and each soft-RoCE device as verbs sees it.
fn verbs_query(ctx: &Context, locals: &[Local]) -> Vec<Check> {
    const NAME: &str = "verbs_query";
    if locals.is_empty() && ibdev::devices(&ctx.root).is_empty() {
        return vec![Check::new(NAME, Verdict::Skip("no RDMA device to query".into()))];
    }
    let Some(binary) = verbs::binary() else {
        let reason = format!("gdrvm-verbs is not in the image ({}) nor beside the agent", verbs::VERBS);
        let verdict = if ctx.image.is_some() { Verdict::Fail(reason) } else { Verdict::Skip(reason) };
        return vec![Check::new(NAME, verdict)];
    };
    let out = match process::run(&binary, &["query".into()], Duration::from_secs(60)) {
        Ok(o) => o,
        Err(e) => return vec![check(NAME, Vec::new(), Some(e))],
    };
    let (results, bad) = verbs::parse_results(&out.stdout);
    let mut checks = Vec::new();
    if !out.success() || results.is_empty() || !bad.is_empty() {
        let mut notes = out.tail(5);
        notes.extend(bad);
        checks.push(check(NAME, notes, Some(format!("{} with {} results", out.describe(), results.len()))));
    }
    for r in &results {
        let Some(dev) = r.test.strip_prefix("device_") else {
            checks.push(r.to_check("verbs_"));
            continue;
        };
        let mut c = r.to_check("");
        c.name = format!("{dev}_verbs");
        if let (Some(l), Verdict::Pass) = (locals.iter().find(|l| l.dev == dev), &c.verdict) {
            let checked = r.device().ok_or_else(|| "gdrvm-verbs gave no device description".to_owned());
            match checked.and_then(|d| verbs::check_device(&d, l.gid_index, &l.gid)) {
                Ok(notes) => c.diagnostics.extend(notes),
                Err(e) => c.verdict = Verdict::Fail(e),
            }
        }
        checks.push(c);
    }
    for l in locals {
        if !results.iter().any(|r| r.test == format!("device_{}", l.dev)) {
            checks.push(Check::new(
                &format!("{}_verbs", l.dev),
                Verdict::Fail(format!("libibverbs does not list {}", l.dev)),
            ));
        }
    }
    checks
}

/// The pair tests with every peer, in name order (one order for all nodes, so no two
/// wait on each other).
fn pairs(cluster: &Cluster, locals: &[Local]) -> Vec<Check> {
    if cluster.peers.is_empty() {
        let reason = "no gdrvm.peers on the kernel command line (a single node): the queue-pair and perftest \
                      tests need a second node";
        return vec![Check::new("pair", Verdict::Skip(reason.into()))];
    }
    let Some(me) = cluster.node.as_deref() else {
        return vec![Check::new(
            "pair",
            Verdict::Fail("gdrvm.peers without gdrvm.node: no way to tell who listens".into()),
        )];
    };
    cluster.peers.iter().flat_map(|peer| pair_with(cluster, me, peer, locals)).collect()
}

/// One step of a pair: what each side runs.
struct Step {
    name: &'static str,
    program: PathBuf,
    /// Why this node cannot run it, if it cannot.
    unavailable: Option<String>,
    server_args: Vec<String>,
    client_args: Vec<String>,
    limit: Duration,
    /// Rerun the client while the server is not listening yet (perftest).
    retry_client: bool,
}

/// How a step went.
enum StepRun {
    /// One side could not run it: ours (`true`) or the peer's, with why.
    NotReady(bool, String),
    /// It ran here (`Outcome`); the peer's report, or why it is missing.
    Ran(Outcome, Result<(bool, String), String>),
    /// It did not run here; the control connection or the server failed.
    Failed(String),
}

fn pair_with(cluster: &Cluster, me: &str, peer: &Peer, locals: &[Local]) -> Vec<Check> {
    let p = format!("{}_", peer.name);
    let serve = cluster.serves(&peer.name).unwrap_or(false);
    let client = if serve { peer.name.as_str() } else { me };
    let rank = cluster.rank(client).unwrap_or(0) as u16;
    let base = PORT_BASE.saturating_add(rank.saturating_mul(5));
    let local = cluster.nic_for(peer.addr).and_then(|n| locals.iter().find(|l| l.nic.net.func == n.func));
    let step_names = ["tcp_stream", "pair", "ib_write_bw", "ib_read_lat"];
    let not_run = |reason: &str| -> Vec<Check> {
        step_names.iter().map(|s| Check::new(&format!("{p}{s}"), Verdict::Fail(format!("not run: {reason}")))).collect()
    };

    let role = if serve { "serves (lower name)" } else { "connects (higher name)" };
    let ctl = if serve {
        Control::accept(base, me, &peer.name, CONNECT_WINDOW)
    } else {
        Control::connect(SocketAddr::new(peer.addr.into(), base), me, &peer.name, CONNECT_WINDOW)
    };
    let mut ctl = match ctl {
        Ok(c) => c,
        Err(e) => {
            let mut checks = vec![Check::new(&format!("{p}control"), Verdict::Fail(e.clone()))];
            checks.extend(not_run(&format!("no control connection with {}", peer.name)));
            return checks;
        }
    };
    let connected = format!("control connection with {} on port {base}: this node ({me}) {role}", ctl.peer);
    // Progress on the console as the pair tests start (KTAP comes at the end): the
    // end-to-end tests kill a node's VMM at this line.
    {
        use std::io::Write;
        println!("# rdma: pairing with {}: {connected}", peer.name);
        let _ = std::io::stdout().flush();
    }
    let mut checks = vec![Check::new(&format!("{p}control"), Verdict::Pass).note(connected)];

    let (dev, gid) = match local {
        Some(l) => (l.dev.clone(), l.gid_index),
        None => (String::new(), 0),
    };
    let no_device = local.is_none().then(|| format!("no soft-RoCE device on the NIC towards {}", peer.addr));
    let verbs_bin = verbs::binary();
    let pair_args = |listen: bool| -> Vec<String> {
        let mut a = vec!["pair".into(), "--device".into(), dev.clone(), "--gid-index".into(), gid.to_string()];
        if listen {
            a.extend(["--listen".into(), (base + 1).to_string()]);
        } else {
            a.extend(["--connect".into(), format!("{}:{}", peer.addr, base + 1)]);
        }
        a.extend([
            "--timeout-secs".into(),
            PAIR_TIMEOUT_SECS.to_string(),
            "--connect-timeout-secs".into(),
            PAIR_CONNECT_SECS.to_string(),
        ]);
        a
    };
    let perf = |tool: Tool, port: u16| Step {
        name: tool.name(),
        program: PathBuf::from(tool.path()),
        unavailable: no_device.clone().or_else(|| {
            (!PathBuf::from(tool.path()).is_file()).then(|| format!("perftest's {} is not in the image", tool.path()))
        }),
        server_args: perftest::args(tool, &dev, gid, port, None),
        client_args: perftest::args(tool, &dev, gid, port, Some(peer.addr)),
        limit: PERF_LIMIT,
        retry_client: true,
    };
    let tcp_args = |listen: bool| -> Vec<String> {
        let mut a = vec!["tcp".into()];
        if listen {
            a.extend(["--listen".into(), (base + 4).to_string()]);
        } else {
            a.extend(["--connect".into(), format!("{}:{}", peer.addr, base + 4)]);
        }
        a.extend(["--timeout-secs".into(), PERF_LIMIT.as_secs().to_string()]);
        a
    };
    let steps = [
        // Plain TCP over the same link first: it needs no RDMA device.
        Step {
            name: "tcp_stream",
            program: verbs_bin.clone().unwrap_or_default(),
            unavailable: verbs_bin.is_none().then(|| format!("gdrvm-verbs is not in the image ({})", verbs::VERBS)),
            server_args: tcp_args(true),
            client_args: tcp_args(false),
            limit: PERF_LIMIT,
            retry_client: false,
        },
        Step {
            name: "pair",
            program: verbs_bin.clone().unwrap_or_default(),
            unavailable: no_device
                .clone()
                .or_else(|| verbs_bin.is_none().then(|| format!("gdrvm-verbs is not in the image ({})", verbs::VERBS))),
            server_args: pair_args(true),
            client_args: pair_args(false),
            limit: PAIR_LIMIT,
            retry_client: false,
        },
        perf(Tool::WriteBw, base + 2),
        perf(Tool::ReadLat, base + 3),
    ];
    let mut broken: Option<String> = None;
    for step in &steps {
        let name = format!("{p}{}", step.name);
        if let Some(b) = &broken {
            checks.push(Check::new(&name, Verdict::Fail(format!("not run: {b}"))));
            continue;
        }
        match run_step(&mut ctl, serve, step) {
            StepRun::NotReady(true, why) => checks.push(Check::new(&name, Verdict::Fail(why))),
            StepRun::NotReady(false, why) => {
                checks.push(Check::new(&name, Verdict::Skip(format!("{} cannot run it: {why}", peer.name))))
            }
            StepRun::Failed(why) => {
                broken = Some(format!("{} failed: {why}", step.name));
                checks.push(Check::new(&name, Verdict::Fail(why)));
            }
            StepRun::Ran(outcome, theirs) => {
                if let Err(e) = &theirs {
                    broken = Some(format!("{} failed: {e}", step.name));
                }
                if step.name == "pair" {
                    checks.extend(pair_checks(&p, &peer.name, &outcome, &theirs));
                } else if step.name == "tcp_stream" {
                    checks.push(tcp_check(&name, &peer.name, &outcome, &theirs));
                } else {
                    let tool = if step.name == Tool::WriteBw.name() { Tool::WriteBw } else { Tool::ReadLat };
                    checks.push(perf_check(&name, tool, &peer.name, &outcome, &theirs));
                }
            }
        }
    }
    checks
}

/// One step in lock step with the peer: both say they can, the server starts and says
/// `go`, the client follows, both report.
fn run_step(ctl: &mut Control, serve: bool, step: &Step) -> StepRun {
    let name = step.name;
    let ready = Line::Ready {
        step: name.into(),
        ok: step.unavailable.is_none(),
        reason: step.unavailable.clone().unwrap_or_default(),
    };
    if let Err(e) = ctl.send(&ready, name) {
        return StepRun::Failed(e);
    }
    let theirs = match ctl.recv_step(name, READY_WAIT) {
        Ok(Line::Ready { ok, reason, .. }) => (ok, reason),
        Ok(other) => return StepRun::Failed(format!("peer {} sent '{}' before {name}", ctl.peer, other.render())),
        Err(e) => return StepRun::Failed(e),
    };
    match (&step.unavailable, theirs) {
        (Some(why), _) => return StepRun::NotReady(true, why.clone()),
        (None, (false, reason)) => return StepRun::NotReady(false, reason),
        (None, (true, _)) => {}
    }
    let outcome = if serve {
        let running = match process::spawn(&step.program, &step.server_args) {
            Ok(r) => r,
            Err(e) => {
                let _ = ctl.send(&Line::Abort { step: name.into(), reason: e.clone() }, name);
                return StepRun::NotReady(true, e);
            }
        };
        if let Err(e) = ctl.send(&Line::Go(name.into()), name) {
            let _ = running.wait(Duration::ZERO);
            return StepRun::Failed(e);
        }
        running.wait(step.limit)
    } else {
        match ctl.recv_step(name, READY_WAIT) {
            Ok(Line::Go(_)) => {}
            Ok(Line::Abort { reason, .. }) => return StepRun::NotReady(false, reason),
            Ok(other) => return StepRun::Failed(format!("peer {} sent '{}' instead of go", ctl.peer, other.render())),
            Err(e) => return StepRun::Failed(e),
        }
        match run_client(step) {
            Ok(o) => o,
            Err(e) => {
                // Keep in step: report, and take the server's report off the line.
                let done = Line::Done { step: name.into(), ok: false, summary: e.clone() };
                if let Err(c) =
                    ctl.send(&done, name).and_then(|_| ctl.recv_step(name, step.limit + Duration::from_secs(30)))
                {
                    return StepRun::Failed(format!("{e}; then {c}"));
                }
                return StepRun::NotReady(true, e);
            }
        }
    };
    let (ok, summary) = summarize(step, &outcome);
    let theirs = ctl
        .send(&Line::Done { step: name.into(), ok, summary }, name)
        .and_then(|_| ctl.recv_step(name, step.limit + Duration::from_secs(30)))
        .and_then(|line| match line {
            Line::Done { ok, summary, .. } => Ok((ok, summary)),
            other => Err(format!("peer {} sent '{}' instead of its result", ctl.peer, other.render())),
        });
    StepRun::Ran(outcome, theirs)
}

/// The client's run; perftest clients are rerun (for at most [`PERF_RETRY`]) while the
/// server is not listening yet.
fn run_client(step: &Step) -> Result<Outcome, String> {
    let start = Instant::now();
    loop {
        let left = step.limit.saturating_sub(start.elapsed()).max(Duration::from_secs(1));
        let o = process::run(&step.program, &step.client_args, left)?;
        let not_ready = !o.success() && perftest::server_not_ready(&format!("{}{}", o.stdout, o.stderr));
        if !step.retry_client || !not_ready || start.elapsed() >= PERF_RETRY {
            return Ok(o);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// This side's result of a step as one line for the peer: ok and a figure, or the failure.
fn summarize(step: &Step, o: &Outcome) -> (bool, String) {
    if step.name == "tcp_stream" {
        let (results, _) = verbs::parse_results(&o.stdout);
        return match results.first() {
            Some(r) => (r.ok, r.diag.last().cloned().unwrap_or_default()),
            None => (false, o.describe()),
        };
    }
    if step.name == "pair" {
        let (results, bad) = verbs::parse_results(&o.stdout);
        let failed: Vec<&verbs::VerbsResult> = results.iter().filter(|r| !r.ok).collect();
        let ok = o.success() && bad.is_empty() && !results.is_empty() && failed.is_empty();
        let summary = match failed.first() {
            Some(f) => format!(
                "{} of {} failed, first {}: {}",
                failed.len(),
                results.len(),
                f.test,
                f.diag.last().map_or("", String::as_str)
            ),
            None if ok => format!("{} of {} ok", results.len(), results.len()),
            None => o.describe(),
        };
        return (ok, summary);
    }
    let tool = if step.name == Tool::WriteBw.name() { Tool::WriteBw } else { Tool::ReadLat };
    match (o.success(), perftest::figure(tool, &o.stdout)) {
        (true, Some(f)) => (true, f),
        (true, None) => (true, String::new()),
        (false, _) => (false, format!("{}: {}", o.describe(), o.tail(1).join(""))),
    }
}

/// gdrvm-verbs pair's results as checks, then the pair as a whole (both nodes' view).
fn pair_checks(p: &str, peer: &str, o: &Outcome, theirs: &Result<(bool, String), String>) -> Vec<Check> {
    let (results, bad) = verbs::parse_results(&o.stdout);
    let mut checks: Vec<Check> = results.iter().map(|r| r.to_check(p)).collect();
    let mine_ok = o.success() && bad.is_empty() && !results.is_empty() && results.iter().all(|r| r.ok);
    let mut notes = vec![format!("{} in {:.1} s", o.command, o.elapsed.as_secs_f64())];
    notes.extend(bad);
    let mut problems = Vec::new();
    if !o.success() || results.is_empty() {
        notes.extend(o.tail(5));
        problems.push(format!("{} after {} results", o.describe(), results.len()));
    } else if !mine_ok {
        problems.push(format!("{} of {} tests failed here", results.iter().filter(|r| !r.ok).count(), results.len()));
    }
    match theirs {
        Ok((true, s)) => notes.push(format!("{peer}: {s}")),
        Ok((false, s)) => problems.push(format!("{peer} reports: {s}")),
        Err(e) => problems.push(e.clone()),
    }
    let name = format!("{p}pair");
    checks.push(check(&name, notes, (!problems.is_empty()).then(|| problems.join("; "))));
    checks
}

/// The TCP stream's check: this side's figure, and the peer's as it measured it.
fn tcp_check(name: &str, peer: &str, o: &Outcome, theirs: &Result<(bool, String), String>) -> Check {
    let (results, bad) = verbs::parse_results(&o.stdout);
    let mut notes: Vec<String> = bad;
    let mut problem = None;
    match results.first() {
        Some(r) if r.ok => notes.extend(r.diag.iter().cloned()),
        Some(r) => problem = Some(r.diag.last().cloned().unwrap_or_else(|| "failed (no reason given)".into())),
        None => {
            notes.extend(o.tail(3));
            problem = Some(o.describe());
        }
    }
    match theirs {
        Ok((true, s)) if !s.is_empty() => notes.push(format!("as {peer} measured it: {s}")),
        Ok((true, _)) => {}
        Ok((false, s)) => problem = problem.or(Some(format!("{peer}'s side failed: {s}"))),
        Err(e) => problem = problem.or(Some(e.clone())),
    }
    check(name, notes, problem)
}

/// A perftest step's check: this side ran and the pair reported a figure.
fn perf_check(name: &str, tool: Tool, peer: &str, o: &Outcome, theirs: &Result<(bool, String), String>) -> Check {
    let mut notes = vec![format!("{} in {:.1} s", o.command, o.elapsed.as_secs_f64())];
    let mine = perftest::figure(tool, &o.stdout);
    if let Some(f) = &mine {
        notes.push(format!("{} {f}", tool.name()));
    }
    let problem = if !o.success() {
        notes.extend(o.tail(3));
        Some(o.describe())
    } else {
        match theirs {
            Err(e) => Some(e.clone()),
            Ok((false, s)) => Some(format!("{peer}'s side failed: {s}")),
            Ok((true, s)) => {
                if !s.is_empty() && mine.as_deref() != Some(s.as_str()) {
                    notes.push(format!("{} as {peer} measured it: {s}", tool.name()));
                }
                (mine.is_none() && s.is_empty()).then(|| "neither side reported a figure".to_owned())
            }
        }
    };
    check(name, notes, problem)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    fn status(code: i32) -> Option<ExitStatus> {
        Some(ExitStatus::from_raw(code << 8))
    }

    fn outcome(code: Option<i32>, stdout: &str, stderr: &str) -> Outcome {
        Outcome {
            command: "/usr/bin/ib_read_lat -d rxe_nic0".into(),
            status: code.and_then(status),
            stdout: stdout.into(),
            stderr: stderr.into(),
            elapsed: Duration::from_millis(1500),
            limit: PERF_LIMIT,
        }
    }

    const LAT: &str = " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] \n 2       200          31.02          412.87       40.11    \t       45.30     \t28.94\t\t120.55 \t\t412.87 \t\n";

    #[test]
    fn test_latency_server_shows_the_clients_figure() {
        let server = outcome(Some(0), "* Waiting for client to connect... *\n", "");
        let theirs = Ok((true, perftest::figure(Tool::ReadLat, LAT).unwrap()));
        let c = perf_check("node1_ib_read_lat", Tool::ReadLat, "node1", &server, &theirs);
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.diagnostics[1],
            "ib_read_lat as node1 measured it: 2 B: 40.11 us typical, 45.30 us average (min 31.02, max 412.87, 99% 120.55), 200 iterations"
        );
        let client = outcome(Some(0), LAT, "");
        let c = perf_check("node0_ib_read_lat", Tool::ReadLat, "node0", &client, &Ok((true, String::new())));
        assert_eq!(c.verdict, Verdict::Pass);
        assert!(c.diagnostics[1].starts_with("ib_read_lat 2 B: 40.11 us typical"), "{:?}", c.diagnostics);
    }

    #[test]
    fn test_perftest_failures_are_named() {
        let killed = outcome(None, "", " Couldn't connect to 10.77.0.1:18503\n");
        let c = perf_check("node0_ib_read_lat", Tool::ReadLat, "node0", &killed, &Ok((true, String::new())));
        assert_eq!(
            c.verdict,
            Verdict::Fail("/usr/bin/ib_read_lat -d rxe_nic0 did not finish within 60 s and was killed".into())
        );
        assert_eq!(c.diagnostics.last().unwrap(), "Couldn't connect to 10.77.0.1:18503");
        let ok = outcome(Some(0), LAT, "");
        let gone =
            Err("peer node1 (10.77.0.2:18500) stopped answering (TCP keepalive timed out) during ib_read_lat"
                .to_owned());
        let c = perf_check("node1_ib_read_lat", Tool::ReadLat, "node1", &ok, &gone);
        assert!(matches!(&c.verdict, Verdict::Fail(r) if r.contains("stopped answering")), "{c:?}");
        let c =
            perf_check("node1_ib_read_lat", Tool::ReadLat, "node1", &ok, &Ok((false, "exited with status 1".into())));
        assert_eq!(c.verdict, Verdict::Fail("node1's side failed: exited with status 1".into()));
        let silent = outcome(Some(0), "", "");
        let c = perf_check("node1_ib_read_lat", Tool::ReadLat, "node1", &silent, &Ok((true, String::new())));
        assert_eq!(c.verdict, Verdict::Fail("neither side reported a figure".into()));
    }

    const PAIR_OK: &str = r#"{"test":"setup","ok":true,"diag":["rxe_nic0 port 1 PORT_ACTIVE"]}
{"test":"rdma_write_4096","ok":true,"diag":["RDMA WRITE 4096 B to peer 0x7f00 (rkey 0x5d4) in 1.20 ms: 0.027 Gb/s"]}
"#;

    #[test]
    fn test_pair_results_and_the_peers_view() {
        let o = outcome(Some(0), PAIR_OK, "");
        let checks = pair_checks("node1_", "node1", &o, &Ok((true, "2 of 2 ok".into())));
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["node1_setup", "node1_rdma_write_4096", "node1_pair"]);
        assert!(checks.iter().all(|c| c.verdict == Verdict::Pass), "{checks:?}");
        assert_eq!(checks[2].diagnostics[1], "node1: 2 of 2 ok");

        let theirs = Ok((false, "1 of 2 failed, first rdma_write_4096: the peer found our write wrong".into()));
        let checks = pair_checks("node1_", "node1", &o, &theirs);
        assert_eq!(
            checks[2].verdict,
            Verdict::Fail("node1 reports: 1 of 2 failed, first rdma_write_4096: the peer found our write wrong".into())
        );

        let crashed = outcome(Some(101), "", "thread 'main' panicked at src/pair.rs\n");
        let checks = pair_checks("node1_", "node1", &crashed, &Ok((true, "2 of 2 ok".into())));
        assert_eq!(checks.len(), 1);
        assert_eq!(
            checks[0].verdict,
            Verdict::Fail("/usr/bin/ib_read_lat -d rxe_nic0 exited with status 101 after 0 results".into())
        );
        assert!(checks[0].diagnostics.contains(&"thread 'main' panicked at src/pair.rs".to_owned()));
    }

    #[test]
    fn test_step_summaries() {
        let step = Step {
            name: "pair",
            program: PathBuf::from("/usr/bin/gdrvm-verbs"),
            unavailable: None,
            server_args: vec![],
            client_args: vec![],
            limit: PAIR_LIMIT,
            retry_client: false,
        };
        assert_eq!(summarize(&step, &outcome(Some(0), PAIR_OK, "")), (true, "2 of 2 ok".into()));
        let failing = PAIR_OK.replace(r#""ok":true,"diag":["RDMA"#, r#""ok":false,"diag":["RDMA"#);
        assert_eq!(
            summarize(&step, &outcome(Some(0), &failing, "")),
            (
                false,
                "1 of 2 failed, first rdma_write_4096: RDMA WRITE 4096 B to peer 0x7f00 (rkey 0x5d4) in 1.20 ms: 0.027 Gb/s"
                    .into()
            )
        );
        let bw = Step { name: "ib_write_bw", ..step };
        let out = " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n 65536      200              0.45               0.42   \t\t     0.000801\n";
        assert_eq!(
            summarize(&bw, &outcome(Some(0), out, "")),
            (true, "65536 B: 0.42 Gb/s (peak 0.45 Gb/s, 200 iterations, 0.000801 Mpps)".into())
        );
        let (ok, s) = summarize(&bw, &outcome(Some(1), "", " Couldn't connect to 10.77.0.1:18502\n"));
        assert!(!ok);
        assert!(s.ends_with("exited with status 1: Couldn't connect to 10.77.0.1:18502"), "{s}");
    }

    /// Both agents of a pair on this host: a server and a client `Control` over loopback.
    fn control_pair() -> (Control, std::thread::JoinHandle<Control>) {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server =
            std::thread::spawn(move || Control::accept(port, "node0", "node1", Duration::from_secs(10)).unwrap());
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        (Control::connect(addr, "node1", "node0", Duration::from_secs(10)).unwrap(), server)
    }

    fn sh_step(name: &'static str, server: &str, client: &str, unavailable: Option<&str>) -> Step {
        Step {
            name,
            program: PathBuf::from("/bin/sh"),
            unavailable: unavailable.map(str::to_owned),
            server_args: vec!["-c".into(), server.into()],
            client_args: vec!["-c".into(), client.into()],
            limit: Duration::from_secs(20),
            retry_client: name != "pair",
        }
    }

    const BW_TABLE: &str = "printf ' #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\\n 65536      200              0.45               0.42   \\t\\t     0.000801\\n'";

    #[test]
    fn test_steps_run_in_lock_step() {
        let (mut client, server) = control_pair();
        let mut server = server.join().unwrap();
        let bw = sh_step("ib_write_bw", BW_TABLE, BW_TABLE, None);
        let s = std::thread::spawn(move || {
            let r = run_step(&mut server, true, &bw);
            (server, r)
        });
        let bw = sh_step("ib_write_bw", BW_TABLE, BW_TABLE, None);
        let mine = run_step(&mut client, false, &bw);
        let (mut server, theirs) = s.join().unwrap();
        for r in [&mine, &theirs] {
            match r {
                StepRun::Ran(o, Ok((true, summary))) => {
                    assert!(o.success());
                    assert_eq!(summary, "65536 B: 0.42 Gb/s (peak 0.45 Gb/s, 200 iterations, 0.000801 Mpps)");
                }
                _ => panic!("step did not run on both sides"),
            }
        }
        // A step this client cannot run: both sides skip it and stay in step.
        let lat = sh_step("ib_read_lat", "exit 0", "exit 0", None);
        let s = std::thread::spawn(move || run_step(&mut server, true, &lat));
        let lat =
            sh_step("ib_read_lat", "exit 0", "exit 0", Some("perftest's /usr/bin/ib_read_lat is not in the image"));
        assert!(matches!(run_step(&mut client, false, &lat), StepRun::NotReady(true, _)));
        match s.join().unwrap() {
            StepRun::NotReady(false, why) => assert_eq!(why, "perftest's /usr/bin/ib_read_lat is not in the image"),
            _ => panic!("the server ran a step its client could not"),
        }
    }

    #[test]
    fn test_a_peer_gone_mid_step_fails_the_step_with_the_reason() {
        let (client, server) = control_pair();
        let mut server = server.join().unwrap();
        let step = sh_step("pair", "echo '{\"test\":\"setup\",\"ok\":true,\"diag\":[]}'", "exit 0", None);
        // The client takes the ready and go, then vanishes (its VM is killed).
        let c = std::thread::spawn(move || {
            let mut client = client;
            client.send(&Line::Ready { step: "pair".into(), ok: true, reason: String::new() }, "pair").unwrap();
            let _ = client.recv_step("pair", Duration::from_secs(10));
            let _ = client.recv_step("pair", Duration::from_secs(10));
            drop(client);
        });
        let start = Instant::now();
        let r = run_step(&mut server, true, &step);
        c.join().unwrap();
        assert!(start.elapsed() < Duration::from_secs(15));
        let StepRun::Ran(o, theirs) = r else { panic!("the server's side should have run") };
        assert!(o.success());
        let e = theirs.unwrap_err();
        assert!(e.starts_with("peer node1 (127.0.0.1:"), "{e}");
        assert!(e.ends_with("closed the control connection during pair"), "{e}");
        let checks = pair_checks("node1_", "node1", &o, &Err(e));
        assert_eq!(checks[0].verdict, Verdict::Pass);
        assert!(matches!(&checks[1].verdict, Verdict::Fail(r) if r.contains("closed the control connection")));
    }

    /// Two nodes on this host (both at 127.0.0.1) without soft-RoCE: the agents find each
    /// other on the pair's control port and agree that nothing can run, each naming why.
    /// Uses the real ports of the pair node0/node1 (18505..18509).
    #[test]
    fn test_two_nodes_without_rdma_agree_and_finish() {
        let node0 = Cluster::from_cmdline("gdrvm.node=node0 gdrvm.peers=node1:127.0.0.1");
        let node1 = Cluster::from_cmdline("gdrvm.node=node1 gdrvm.peers=node0:127.0.0.1");
        let server = std::thread::spawn(move || pairs(&node0, &[]));
        let client = pairs(&node1, &[]);
        let server = server.join().unwrap();
        let show = |checks: &[Check]| checks.iter().map(|c| format!("{} {:?}", c.name, c.verdict)).collect::<Vec<_>>();
        assert_eq!(
            show(&server),
            [
                "node1_control Pass",
                "node1_tcp_stream Fail(\"gdrvm-verbs is not in the image (/usr/bin/gdrvm-verbs)\")",
                "node1_pair Fail(\"no soft-RoCE device on the NIC towards 127.0.0.1\")",
                "node1_ib_write_bw Fail(\"no soft-RoCE device on the NIC towards 127.0.0.1\")",
                "node1_ib_read_lat Fail(\"no soft-RoCE device on the NIC towards 127.0.0.1\")",
            ]
        );
        assert_eq!(show(&client)[0], "node0_control Pass");
        assert!(server[0].diagnostics[0].contains("on port 18505: this node (node0) serves"), "{:?}", server[0]);
        assert!(client[0].diagnostics[0].contains("on port 18505: this node (node1) connects"), "{:?}", client[0]);
    }
}
