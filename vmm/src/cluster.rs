//! `gdrvm cluster up`: the nodes of a cluster, each a `gdrvm run` of its own, joined by
//! wires (hubs of unix datagram sockets in a private directory), each guest told its name,
//! addresses and peers on its kernel command line. Their consoles stream live, prefixed
//! with the node's name, on stderr; when all have stopped, one KTAP document on stdout holds
//! one subtest per node (the node's own KTAP, indented), and the exit status sums them up.
//!
//! Every VMM dies with the cluster process (`PR_SET_PDEATHSIG`); SIGINT, SIGTERM and SIGHUP
//! (taken from a signalfd) are passed on to the VMMs as SIGTERM, which stop their guests and
//! remove their wire sockets; the wire directory goes last, on every way out but SIGKILL.
//!
//! A node can be killed on purpose (`--kill NODE:TEXT`, SIGKILL to its VMM as soon as its
//! console shows TEXT), to test how the others cope with a peer that vanishes mid-test.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};

use gdrvm_model::cluster::Cluster;
use gdrvm_model::node::format_mac;

use crate::signals::StopSignals;

/// Exit statuses, as `gdrvm run` gives them.
const EXIT_FAIL: u8 = 1;
const EXIT_CANNOT_TEST: u8 = 125;
const EXIT_INTERRUPTED: u8 = 130;

/// Errors starting a cluster (a node's own failures are its status, not an error).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The wire directory could not be made.
    #[error("cannot create the wire directory {path}: {source}")]
    WireDir {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A node's VMM could not be started.
    #[error("node {node}: cannot start {program}: {source}")]
    Spawn {
        /// The node.
        node: String,
        /// The VMM binary.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A node cannot be run as asked.
    #[error("node {node}: {reason}")]
    Node {
        /// The node.
        node: String,
        /// Why.
        reason: String,
    },
    /// Signals could not be set up.
    #[error("cannot block signals: {0}")]
    Signals(#[source] std::io::Error),
}

/// How to run each node of a cluster.
#[derive(Debug, Clone)]
pub struct ClusterRun {
    /// The gdrvm binary that runs each node (normally this one).
    pub gdrvm: PathBuf,
    /// Kernel.
    pub kernel: PathBuf,
    /// Initramfs.
    pub initrd: Option<PathBuf>,
    /// Kernel command line shared by all nodes; each node's own keys are appended.
    pub cmdline: String,
    /// vCPUs per node (default: the node's).
    pub cpus: Option<u32>,
    /// Guest RAM per node, as `gdrvm run --memory` takes it (default: the node's).
    pub memory: Option<String>,
    /// Kill node `.0`'s VMM once its console shows `.1`.
    pub kill: Option<(String, String)>,
    /// Which VMM runs the nodes.
    pub vmm: ClusterVmm,
}

/// The VMM that runs a cluster's nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterVmm {
    /// `gdrvm run`, each node on its node's PCIe tree.
    Gdrvm,
    /// QEMU at this path (`-M pc`, KVM), each NIC a virtio-net-pci on a `dgram` netdev
    /// between the two ends of its wire: the reference the net benchmark compares against.
    /// It knows nothing of the node's tree.
    Qemu(PathBuf),
}

/// What one node did.
#[derive(Debug, Clone)]
pub struct NodeOutcome {
    /// The node's name.
    pub name: String,
    /// Its VMM's exit status (`None`: killed by a signal).
    pub status: Option<i32>,
    /// Its console, line by line.
    pub console: Vec<String>,
    /// Killed on purpose by `--kill`.
    pub killed: bool,
}

/// A private directory that is removed with everything in it when dropped.
struct WireDir(PathBuf);

impl WireDir {
    /// A fresh directory `gdrvm-cluster-XXXXXX` under the temporary directory, mode 0700.
    fn create() -> Result<WireDir, ClusterError> {
        let template = std::env::temp_dir().join("gdrvm-cluster-XXXXXX");
        let failed = |source| ClusterError::WireDir { path: template.clone(), source };
        let mut bytes = std::ffi::CString::new(template.as_os_str().as_encoded_bytes())
            .map_err(|_| failed(std::io::Error::other("NUL in the temporary directory's path")))?
            .into_bytes_with_nul();
        // SAFETY: `bytes` is a NUL-terminated template ending in XXXXXX, which mkdtemp
        // rewrites in place.
        let made = unsafe { libc::mkdtemp(bytes.as_mut_ptr().cast()) };
        if made.is_null() {
            return Err(failed(std::io::Error::last_os_error()));
        }
        bytes.pop();
        let path: std::ffi::OsString = std::os::unix::ffi::OsStringExt::from_vec(bytes);
        Ok(WireDir(PathBuf::from(path)))
    }
}

impl Drop for WireDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!("cannot remove {}: {e}", self.0.display());
        }
    }
}

/// The program and arguments that run node `n`, its wires under `dir`.
pub fn node_command(
    cluster: &Cluster,
    n: usize,
    run: &ClusterRun,
    dir: &Path,
) -> Result<(PathBuf, Vec<String>), String> {
    match &run.vmm {
        ClusterVmm::Gdrvm => Ok((run.gdrvm.clone(), node_args(cluster, n, run, dir))),
        ClusterVmm::Qemu(qemu) => Ok((qemu.clone(), qemu_args(cluster, n, run, dir)?)),
    }
}

/// QEMU's arguments for node `n`: the same kernel, initramfs and command line, one
/// virtio-net-pci per wire end on a unix `dgram` netdev whose sockets sit where gdrvm's
/// hub would put them (`DIR/WIRE/<mac>`), so both VMMs share one naming.
fn qemu_args(cluster: &Cluster, n: usize, run: &ClusterRun, dir: &Path) -> Result<Vec<String>, String> {
    let node = &cluster.nodes[n];
    let cmdline = format!("{} {}", run.cmdline, cluster.node_cmdline(n));
    let memory = run.memory.clone().unwrap_or_else(|| format!("{}M", node.node.memory() >> 20));
    let memory_mib = gdrvm_model::parse_size(&memory).ok_or(format!("memory '{memory}' is not a size"))? >> 20;
    let mut args: Vec<String> = ["-accel", "kvm", "-cpu", "host", "-M", "pc", "-nodefaults", "-no-reboot"]
        .into_iter()
        .chain(["-display", "none", "-vga", "none", "-serial", "stdio"])
        .map(str::to_owned)
        .collect();
    args.extend([
        "-smp".into(),
        run.cpus.unwrap_or(node.node.cpus()).to_string(),
        "-m".into(),
        format!("{memory_mib}M"),
    ]);
    args.extend(["-kernel".into(), run.kernel.display().to_string(), "-append".into(), cmdline.trim().to_owned()]);
    if let Some(initrd) = &run.initrd {
        args.extend(["-initrd".into(), initrd.display().to_string()]);
    }
    let hex = |mac: &[u8; 6]| mac.iter().map(|b| format!("{b:02x}")).collect::<String>();
    for (i, (function, mac, mtu, wire)) in cluster.node_nets(n).into_iter().enumerate() {
        let w = &cluster.wires[wire];
        let [a, b] = w.ends.as_slice() else {
            return Err(format!(
                "wire {}: QEMU's dgram netdev joins exactly two ends, this wire has {}",
                w.name,
                w.ends.len()
            ));
        };
        let peer = if a.node == n && a.function == function { b } else { a };
        let path = dir.join(&w.name);
        std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        args.push("-netdev".into());
        args.push(format!(
            "dgram,id=n{i},local.type=unix,local.path={},remote.type=unix,remote.path={}",
            path.join(hex(&mac)).display(),
            path.join(hex(&peer.mac)).display()
        ));
        args.push("-device".into());
        args.push(format!("virtio-net-pci,netdev=n{i},mac={},host_mtu={mtu},romfile=", format_mac(&mac)));
    }
    Ok(args)
}

/// The `gdrvm run` arguments of node `n`, its wires under `dir`.
pub fn node_args(cluster: &Cluster, n: usize, run: &ClusterRun, dir: &Path) -> Vec<String> {
    let node = &cluster.nodes[n];
    let mut args = vec!["run".to_owned(), "--kernel".into(), run.kernel.display().to_string()];
    if let Some(initrd) = &run.initrd {
        args.extend(["--initrd".into(), initrd.display().to_string()]);
    }
    let cmdline = format!("{} {}", run.cmdline, cluster.node_cmdline(n));
    args.extend(["--cmdline".into(), cmdline.trim().to_owned(), "--node".into(), node.node.source.clone()]);
    for (function, mac, mtu, wire) in cluster.node_nets(n) {
        let path = dir.join(&cluster.wires[wire].name);
        args.extend(["--net".into(), format!("{function}=unix:{},mac={},mtu={mtu}", path.display(), format_mac(&mac))]);
    }
    if let Some(cpus) = run.cpus {
        args.extend(["--cpus".into(), cpus.to_string()]);
    }
    if let Some(memory) = &run.memory {
        args.extend(["--memory".into(), memory.clone()]);
    }
    args.push("--stats".into());
    args
}

/// Boots every node of `cluster`, waits for all of them, and returns what each did.
/// Console lines go to `live` as they come, prefixed `[node] `.
pub fn up(
    cluster: &Cluster,
    run: &ClusterRun,
    live: Arc<Mutex<dyn Write + Send>>,
) -> Result<Vec<NodeOutcome>, ClusterError> {
    let signals = StopSignals::new().map_err(ClusterError::Signals)?;
    let dir = WireDir::create()?;
    if let Ok(mut out) = live.lock() {
        let _ =
            writeln!(out, "[cluster] {}: {} nodes, wires in {}", cluster.name, cluster.nodes.len(), dir.0.display());
    }
    let mut children: Vec<Arc<Mutex<Child>>> = Vec::new();
    let (tx, rx) = mpsc::channel::<(usize, Option<String>)>();
    let mut readers = Vec::new();
    for (n, node) in cluster.nodes.iter().enumerate() {
        let (program, args) = match node_command(cluster, n, run, &dir.0) {
            Ok(command) => command,
            Err(reason) => {
                stop_all(&children);
                return Err(ClusterError::Node { node: node.name.clone(), reason });
            }
        };
        let mut command = Command::new(&program);
        command.args(args).stdin(Stdio::null()).stdout(Stdio::piped());
        command.stderr(Stdio::piped());
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: runs in the child between fork and exec, calling only async-signal-safe
        // functions (sigprocmask, prctl, getppid) on memory of its own frame.
        unsafe {
            command.pre_exec(move || {
                // The cluster blocks these signals for its watcher thread; the VMM sets its own.
                let mut none: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut none);
                libc::sigprocmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // A group of its own, so that --kill takes the node's VMM; its emulators
                // die with it (their PR_SET_PDEATHSIG).
                if libc::setpgid(0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    return Err(std::io::Error::other("the cluster process exited"));
                }
                Ok(())
            });
        }
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(source) => {
                stop_all(&children);
                return Err(ClusterError::Spawn { node: node.name.clone(), program, source });
            }
        };
        for stream in [
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stderr.take().map(|s| Box::new(s) as _),
        ]
        .into_iter()
        .flatten()
        {
            let tx = tx.clone();
            readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { break };
                    if tx.send((n, Some(line))).is_err() {
                        break;
                    }
                }
                let _ = tx.send((n, None));
            }));
        }
        children.push(Arc::new(Mutex::new(child)));
    }
    drop(tx);
    let mut outcomes: Vec<NodeOutcome> = cluster
        .nodes
        .iter()
        .map(|n| NodeOutcome { name: n.name.clone(), status: None, console: Vec::new(), killed: false })
        .collect();
    let mut open_streams = 2 * cluster.nodes.len();
    let mut interrupted = false;
    while open_streams > 0 {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok((n, Some(line))) => {
                if let Some((victim, text)) = &run.kill {
                    if *victim == outcomes[n].name && !outcomes[n].killed && line.contains(text.as_str()) {
                        tracing::warn!("killing node {victim}'s VMM, as --kill asked");
                        if let Ok(c) = children[n].lock() {
                            // SAFETY: kill() of the process group this process made for the
                            // node (its VMM; the emulators it started die with it).
                            unsafe { libc::kill(-(c.id() as libc::pid_t), libc::SIGKILL) };
                        }
                        outcomes[n].killed = true;
                    }
                }
                if let Ok(mut out) = live.lock() {
                    let _ = writeln!(out, "[{}] {line}", outcomes[n].name);
                }
                outcomes[n].console.push(line);
            }
            Ok((_, None)) => open_streams -= 1,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
        if !interrupted && signals.take() {
            interrupted = true;
            stop_all(&children);
        }
    }
    for (n, child) in children.iter().enumerate() {
        if let Ok(mut c) = child.lock() {
            outcomes[n].status = c.wait().ok().and_then(|s| s.code());
        }
    }
    for r in readers {
        let _ = r.join();
    }
    drop(signals);
    if interrupted {
        for o in &mut outcomes {
            o.status = o.status.or(Some(i32::from(EXIT_INTERRUPTED)));
        }
    }
    Ok(outcomes)
}

/// SIGTERM to every VMM still running.
fn stop_all(children: &[Arc<Mutex<Child>>]) {
    for child in children {
        if let Ok(mut c) = child.lock() {
            if let Ok(None) = c.try_wait() {
                // SAFETY: kill() with a pid this process spawned and has not reaped.
                unsafe { libc::kill(c.id() as libc::pid_t, libc::SIGTERM) };
            }
        }
    }
}

/// The cluster's one exit status: a failing node fails the cluster; otherwise a node that
/// could not be tested makes the whole "cannot test"; an interruption wins over both.
pub fn exit_status(outcomes: &[NodeOutcome]) -> u8 {
    let codes: Vec<i32> = outcomes.iter().map(|o| o.status.unwrap_or(i32::from(EXIT_FAIL))).collect();
    if codes.contains(&i32::from(EXIT_INTERRUPTED)) {
        EXIT_INTERRUPTED
    } else if codes.iter().any(|&c| c != 0 && c != i32::from(EXIT_CANNOT_TEST)) {
        EXIT_FAIL
    } else if codes.contains(&i32::from(EXIT_CANNOT_TEST)) {
        EXIT_CANNOT_TEST
    } else {
        0
    }
}

/// One KTAP document with a subtest per node: the node's own KTAP (from its first
/// `KTAP version 1` line), indented, then the node's result line.
pub fn ktap(outcomes: &[NodeOutcome]) -> String {
    let mut out = format!("KTAP version 1\n1..{}\n", outcomes.len());
    for (i, o) in outcomes.iter().enumerate() {
        let start = o.console.iter().position(|l| l == "KTAP version 1");
        for line in start.map(|s| &o.console[s..]).unwrap_or_default() {
            if line.starts_with("gdrvm-stats:") || line.starts_with("gdrvm:") {
                continue;
            }
            out.push_str("    ");
            out.push_str(line);
            out.push('\n');
        }
        let ok = o.status == Some(0);
        let why = match (o.killed, o.status) {
            (true, _) => " # killed on purpose (--kill)".to_owned(),
            (false, Some(0)) => String::new(),
            (false, Some(code)) if start.is_none() => format!(" # exit {code}, no KTAP from the guest"),
            (false, Some(code)) => format!(" # exit {code}"),
            (false, None) => " # the VMM was killed by a signal".to_owned(),
        };
        out.push_str(&format!("{} {} {}{why}\n", if ok { "ok" } else { "not ok" }, i + 1, o.name));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(name: &str, status: Option<i32>, console: &[&str]) -> NodeOutcome {
        NodeOutcome {
            name: name.into(),
            status,
            console: console.iter().map(|s| s.to_string()).collect(),
            killed: false,
        }
    }

    /// Runs two-node with `script` standing in for gdrvm (it gets the same arguments).
    fn up_with(script: &str, kill: Option<(&str, &str)>) -> (Vec<NodeOutcome>, String) {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("fake-gdrvm");
        std::fs::write(&fake, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        let run = ClusterRun {
            gdrvm: fake,
            kernel: "/k".into(),
            initrd: None,
            cmdline: "quiet".into(),
            cpus: Some(1),
            memory: Some("256M".into()),
            kill: kill.map(|(n, t)| (n.to_owned(), t.to_owned())),
            vmm: ClusterVmm::Gdrvm,
        };
        let cluster = Cluster::resolve("two-node").unwrap();
        let live: Arc<Mutex<Vec<u8>>> = Arc::new(Mutex::new(Vec::new()));
        let outcomes = up(&cluster, &run, live.clone()).unwrap();
        let text = String::from_utf8(live.lock().unwrap().clone()).unwrap();
        (outcomes, text)
    }

    #[test]
    fn test_nodes_get_their_wires_and_keys_and_the_wire_directory_goes() {
        // Each fake node prints its arguments and the wire directory it was given.
        let (outcomes, live) = up_with("echo \"args: $*\"; echo KTAP version 1; echo 1..1; echo ok 1 fake", None);
        assert_eq!(exit_status(&outcomes), 0, "{live}");
        let a = outcomes[0].console.join("\n");
        assert!(a.contains("gdrvm.node=a gdrvm.net=nic0:10.77.0.1/24 gdrvm.peers=b:10.77.0.2"), "{a}");
        assert!(a.contains("--net nic0=unix:") && a.contains("/w0,mac=52:54:00:00:00:00,mtu=9000"), "{a}");
        assert!(live.contains("[b] args: run --kernel /k"), "{live}");
        let dir = live.lines().find_map(|l| l.strip_prefix("[cluster] two-node: 2 nodes, wires in ")).unwrap();
        assert!(dir.contains("gdrvm-cluster-") && !std::path::Path::new(dir).exists(), "{dir} left behind");
    }

    #[test]
    fn test_a_node_killed_on_its_cue_is_reported_and_the_others_finish() {
        let script = "case \"$*\" in *gdrvm.node=b*) echo '# pairing'; sleep 30;; \
                      *) echo KTAP version 1; echo 1..1; echo ok 1 fake;; esac";
        let started = std::time::Instant::now();
        let (outcomes, live) = up_with(script, Some(("b", "# pairing")));
        assert!(started.elapsed() < std::time::Duration::from_secs(20), "waited for the killed node");
        assert!(outcomes[1].killed && outcomes[1].status.is_none(), "{live}");
        assert_eq!(outcomes[0].status, Some(0));
        assert_eq!(exit_status(&outcomes), 1);
        assert!(ktap(&outcomes).contains("not ok 2 b # killed on purpose (--kill)"));
    }

    #[test]
    fn test_exit_status_fail_beats_cannot_test_and_interrupt_beats_all() {
        let ok = outcome("a", Some(0), &[]);
        assert_eq!(exit_status(&[ok.clone(), ok.clone()]), 0);
        assert_eq!(exit_status(&[ok.clone(), outcome("b", Some(125), &[])]), 125);
        assert_eq!(exit_status(&[outcome("a", Some(125), &[]), outcome("b", Some(1), &[])]), 1);
        assert_eq!(exit_status(&[ok.clone(), outcome("b", None, &[])]), 1);
        assert_eq!(exit_status(&[outcome("a", Some(1), &[]), outcome("b", Some(130), &[])]), 130);
    }

    #[test]
    fn test_ktap_nests_each_nodes_document_and_says_why_a_node_failed() {
        let a =
            outcome("a", Some(0), &["[    0.1] boot noise", "KTAP version 1", "1..1", "ok 1 smoke", "gdrvm-stats: {}"]);
        let mut b = outcome("b", None, &["KTAP version 1", "1..1"]);
        b.killed = true;
        let c = outcome("c", Some(125), &["gdrvm: error: no kernel"]);
        let text = ktap(&[a, b, c]);
        assert_eq!(
            text,
            "KTAP version 1\n1..3\n    KTAP version 1\n    1..1\n    ok 1 smoke\nok 1 a\n    KTAP version 1\n    1..1\n\
             not ok 2 b # killed on purpose (--kill)\nnot ok 3 c # exit 125, no KTAP from the guest\n"
        );
    }
}
