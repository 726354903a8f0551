//! `gdrvm`: the VMM's command line.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use std::io::Write;
use std::sync::{Arc, Mutex};

use gdrvm::{cluster, ConsoleOptions, Outcome, RunReport, VmConfig};
use gdrvm_devices::net::WireSpec;
use gdrvm_model::capture::{self, CaptureError, CaptureOptions};
use gdrvm_model::cluster::Cluster;
use gdrvm_model::node::{NetAttach, Node};

/// Exit status when the VM could not be run at all (`git bisect run`'s "cannot test").
const EXIT_CANNOT_TEST: u8 = 125;
/// Exit status for a usage error.
const EXIT_USAGE: u8 = 2;
/// Exit status when a signal or Ctrl-A x stopped the VM.
const EXIT_INTERRUPTED: u8 = 130;

#[derive(Parser)]
#[command(name = "gdrvm", version, about = "Boot Linux guests on GPU-node PCIe topologies")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a kernel and run it until the guest powers off.
    ///
    /// Exits with the status the guest wrote to the debug-exit port (0 when it powered off
    /// without one), 1 if it reset without reporting, 125 if the VM could not run, 2 for
    /// bad arguments, 130 if interrupted.
    Run(RunArgs),
    /// Inspect a node description (a preset name or a TOML file).
    Topology {
        #[command(subcommand)]
        command: TopologyCommand,
    },
    /// Run several nodes joined by wires (a cluster file or preset).
    Cluster {
        #[command(subcommand)]
        command: ClusterCommand,
    },
}

#[derive(Subcommand)]
enum ClusterCommand {
    /// Boot every node of the cluster, each with its own `gdrvm run`, joined by its wires.
    ///
    /// Every node boots the same kernel, initramfs and command line; each node's command
    /// line also gets its name, addresses and peers. Consoles stream on stderr, prefixed
    /// `[node]`; at the end one KTAP document on stdout
    /// has a subtest per node. Exits 0 when every node passed, 1 when one failed, 125 when
    /// one could not be tested, 130 if interrupted.
    Up(ClusterUpArgs),
    /// Print the cluster's nodes, wires, MACs and addresses. Exits 2 for a bad cluster file.
    Show {
        /// A cluster preset (two-node) or a cluster file.
        cluster: String,
    },
}

#[derive(clap::Args)]
struct ClusterUpArgs {
    /// A cluster preset (two-node) or a cluster file.
    cluster: String,
    #[command(flatten)]
    boot: BootArgs,
    /// vCPUs of each node [default: the node's].
    #[arg(long)]
    cpus: Option<u32>,
    /// Guest RAM of each node [default: the node's].
    #[arg(long)]
    memory: Option<String>,
    /// Kill NODE's VMM (SIGKILL) as soon as its console shows TEXT: how do the others cope?
    #[arg(long, value_name = "NODE:TEXT")]
    kill: Option<String>,
    /// Run the nodes with QEMU at this path instead (`-M pc`, virtio-net-pci on a `dgram`
    /// netdev per wire): the reference for `cargo xtask bench net`. QEMU knows nothing of
    /// the nodes' PCIe trees.
    #[arg(long, value_name = "QEMU")]
    qemu: Option<PathBuf>,
}

#[derive(Subcommand)]
enum TopologyCommand {
    /// Print the node's NUMA nodes, host bridges and PCIe tree. Exits 2 for a bad node file.
    Show {
        /// A preset (minimal, flat, vela-a100, vfio-lab, dgx-h100) or a node file.
        node: String,
        /// `text`: an indented tree; `dot`: a Graphviz graph (`| dot -Tsvg > node.svg`).
        #[arg(long, value_enum, default_value = "text")]
        format: ShowFormat,
    },
    /// Print an NCCL_TOPO_FILE (NCCL topology XML, version 1) whose bus IDs match the guest's.
    NcclXml {
        /// A preset or a node file.
        node: String,
        #[command(flatten)]
        scale: Scale,
    },
    /// Print the closest QEMU command line (pxb-pcie, pcie-root-port, switch ports).
    QemuArgs {
        /// A preset or a node file.
        node: String,
        #[command(flatten)]
        scale: Scale,
    },
    /// Write a node file of this host (or of a recorded sysfs tree): NUMA nodes, a host
    /// bridge per root complex, root ports, switches and endpoints with their IDs, BARs,
    /// links, ACS and ATS. What a node file cannot say about the host is in comments at its
    /// top. Exits 2 for bad options, 1 when the tree cannot be read or captured.
    Capture(CaptureArgs),
}

/// How `gdrvm topology show` prints the node.
#[derive(Clone, Copy, clap::ValueEnum)]
enum ShowFormat {
    /// An indented tree.
    Text,
    /// A Graphviz digraph: NUMA nodes as clusters, functions colored by kind.
    Dot,
}

/// `gdrvm topology capture`.
#[derive(clap::Args)]
struct CaptureArgs {
    /// Sysfs root to read: `/` for this host, or a recorded tree holding `sys/...`.
    #[arg(long, value_name = "ROOT", default_value = "/")]
    sysfs: PathBuf,
    /// Pass these host functions through (`backing = "vfio:<BDF>"`); a virtual function
    /// takes its physical function's place.
    #[arg(long, value_name = "BDF,...", value_delimiter = ',')]
    vfio: Vec<String>,
    /// Pass every endpoint of these kinds through: gpu, nic, nvswitch, generic.
    #[arg(long = "vfio-class", value_name = "KIND,...", value_delimiter = ',')]
    vfio_class: Vec<String>,
    /// Write the node file here instead of standard output.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    output: Option<PathBuf>,
}

/// Scaling a node down, as `gdrvm run` does.
#[derive(clap::Args)]
struct Scale {
    /// vCPUs, spread over the NUMA nodes [default: the node's].
    #[arg(long)]
    cpus: Option<u32>,
    /// Guest RAM, spread over the NUMA nodes [default: the node's].
    #[arg(long, value_parser = parse_memory)]
    memory: Option<u64>,
}

/// What a guest boots.
#[derive(clap::Args)]
struct BootArgs {
    /// Kernel: a vmlinux (entered at its 64-bit Linux entry) or a bzImage.
    #[arg(long)]
    kernel: PathBuf,
    /// Initramfs (cpio newc, optionally compressed).
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = "console=ttyS0 quiet panic=-1")]
    cmdline: String,
}

#[derive(clap::Args)]
struct RunArgs {
    #[command(flatten)]
    boot: BootArgs,
    /// Enter a vmlinux that has a PVH note at its PVH entry, as QEMU does, instead of its
    /// 64-bit Linux entry. The PVH path costs a boot 256 CPUID exits more: its early code
    /// scans the hypervisor leaves for Xen.
    #[arg(long)]
    pvh: bool,
    /// Number of vCPUs [default: 1, or the node's; with --node, spread over its NUMA nodes].
    #[arg(long)]
    cpus: Option<u32>,
    /// Guest RAM, e.g. 512M, 2G [default: 512M, or the node's; with --node, spread likewise].
    #[arg(long, value_parser = parse_memory)]
    memory: Option<u64>,
    /// Node description: a preset (minimal, flat, vela-a100) or a TOML file. Gives the
    /// guest its NUMA layout.
    #[arg(long)]
    node: Option<String>,
    /// Forward standard input to the guest console (raw terminal; Ctrl-A x quits).
    #[arg(long)]
    interactive: bool,
    /// Print run figures as one JSON line on stderr: setup time and its phases, RSS beyond
    /// guest RAM, the exits the VMM served by kind and device (to the end of the run).
    #[arg(long)]
    stats: bool,
    /// Make endpoint NAME of the node a virtio-net NIC, joined to WIRE when one is given:
    /// `unix:DIR` (a hub of unix datagram sockets shared by the VMMs on this host) or
    /// `udp:LOCAL_IP:PORT@REMOTE_IP:PORT`; options `mac=52:54:00:..`, `mtu=N` (68-9000).
    /// Repeatable. Example: `--net nic0=unix:/tmp/w0,mtu=9000`.
    #[arg(long, value_name = "NAME[=WIRE][,mac=MAC][,mtu=N]", value_parser = parse_net)]
    net: Vec<NetArg>,
}

/// One `--net` argument.
#[derive(Clone)]
struct NetArg {
    attach: NetAttach,
    wire: Option<WireSpec>,
}

fn parse_net(s: &str) -> Result<NetArg, String> {
    let mut items = s.split(',');
    let first = items.next().unwrap_or_default();
    let (endpoint, wire) = match first.split_once('=') {
        Some((name, wire)) => (name, Some(wire.parse::<WireSpec>().map_err(|e| format!("wire '{wire}': {e}"))?)),
        None => (first, None),
    };
    if endpoint.is_empty() {
        return Err("expected an endpoint name first, e.g. nic0=unix:/tmp/w0".into());
    }
    let mut attach = NetAttach { endpoint: endpoint.to_owned(), mac: None, mtu: None };
    for item in items {
        match item.split_once('=') {
            Some(("mac", mac)) => attach.mac = Some(mac.to_owned()),
            Some(("mtu", mtu)) => attach.mtu = Some(mtu.parse().map_err(|_| format!("mtu '{mtu}' is not a number"))?),
            _ => return Err(format!("'{item}' is not mac=MAC or mtu=N")),
        }
    }
    Ok(NetArg { attach, wire })
}

fn parse_memory(s: &str) -> Result<u64, String> {
    gdrvm::parse_size(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let started = Instant::now();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("GDRVM_LOG").unwrap_or_else(|_| "warn".into()))
        .init();
    let cli = Cli::parse();
    match cli.command {
        Command::Run(args) => run(args, started),
        Command::Cluster { command: ClusterCommand::Up(args) } => cluster_up(args),
        Command::Cluster { command: ClusterCommand::Show { cluster } } => match Cluster::resolve(&cluster) {
            Ok(c) => {
                print!("{}", c.render());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gdrvm: error: {e}");
                ExitCode::from(EXIT_USAGE)
            }
        },
        Command::Topology { command } => {
            let (node, scale, render): (_, _, fn(&Node) -> String) = match command {
                TopologyCommand::Show { node, format: ShowFormat::Text } => (node, None, Node::render_tree),
                TopologyCommand::Show { node, format: ShowFormat::Dot } => (node, None, Node::dot),
                TopologyCommand::NcclXml { node, scale } => (node, Some(scale), Node::nccl_topology_xml),
                TopologyCommand::QemuArgs { node, scale } => (node, Some(scale), Node::qemu_args),
                TopologyCommand::Capture(args) => return topology_capture(args),
            };
            let node = Node::resolve(&node).and_then(|n| match scale {
                Some(s) => n.scaled(s.cpus, s.memory),
                None => Ok(n),
            });
            match node {
                Ok(node) => {
                    print!("{}", render(&node));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("gdrvm: error: {e}");
                    ExitCode::from(EXIT_USAGE)
                }
            }
        }
    }
}

fn topology_capture(args: CaptureArgs) -> ExitCode {
    let opts = CaptureOptions { vfio: args.vfio, vfio_classes: args.vfio_class };
    let capture = match capture::capture(&args.sysfs, &opts) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gdrvm: error: {}", error_chain(&e));
            let usage = matches!(
                e,
                CaptureError::VfioAddress { .. }
                    | CaptureError::VfioClass(_)
                    | CaptureError::VfioConflict { .. }
                    | CaptureError::VfioNotCaptured { .. }
            );
            return ExitCode::from(if usage { EXIT_USAGE } else { 1 });
        }
    };
    let Some(path) = args.output else {
        print!("{}", capture.toml);
        return ExitCode::SUCCESS;
    };
    if let Err(e) = std::fs::write(&path, &capture.toml) {
        eprintln!("gdrvm: error: cannot write {}: {e}", path.display());
        return ExitCode::from(1);
    }
    eprintln!(
        "gdrvm: wrote {} ({} notes on what it cannot say about the host, at its top)",
        path.display(),
        capture.notes.len()
    );
    ExitCode::SUCCESS
}

fn run(args: RunArgs, started: Instant) -> ExitCode {
    let attach: Vec<NetAttach> = args.net.iter().map(|n| n.attach.clone()).collect();
    let node = match args.node.as_deref() {
        Some(n) => Node::resolve_with(n, &attach).and_then(|n| n.scaled(args.cpus, args.memory)),
        None if !attach.is_empty() => {
            eprintln!("gdrvm: error: --net needs --node (a node whose NIC endpoint becomes virtio-net)");
            return ExitCode::from(EXIT_USAGE);
        }
        None => Ok(Node::plain(args.cpus.unwrap_or(1), args.memory.unwrap_or(512 << 20))),
    };
    let node = match node {
        Ok(node) => node,
        Err(e) => {
            eprintln!("gdrvm: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let config = VmConfig {
        kernel: args.boot.kernel,
        pvh: args.pvh,
        initrd: args.boot.initrd,
        cmdline: args.boot.cmdline,
        cpus: node.cpus(),
        memory: node.memory(),
        node,
        wires: args.net.into_iter().filter_map(|n| Some((n.attach.endpoint, n.wire?))).collect(),
    };
    // SAFETY: fd 1 is this process's stdout; ManuallyDrop keeps it open after the VM is gone.
    // Unbuffered, so the console shows each byte as the guest writes it.
    let stdout = std::mem::ManuallyDrop::new(unsafe { File::from_raw_fd(libc::STDOUT_FILENO) });
    let output = Box::new(ConsoleWriter(stdout));
    let report = match gdrvm::run(&config, ConsoleOptions { output, interactive: args.interactive }, started) {
        Ok(report) => report,
        Err(e) => {
            eprintln!("gdrvm: error: {}", error_chain(&e));
            return ExitCode::from(if e.is_usage() { EXIT_USAGE } else { EXIT_CANNOT_TEST });
        }
    };
    if args.stats {
        eprintln!("gdrvm-stats: {}", stats_json(&report));
    }
    match (report.outcome, report.status) {
        (Outcome::Interrupted, _) => {
            eprintln!("gdrvm: interrupted; VM stopped");
            ExitCode::from(EXIT_INTERRUPTED)
        }
        (_, Some(status)) => ExitCode::from(status),
        (Outcome::PoweredOff, None) => ExitCode::SUCCESS,
        (Outcome::Reset, None) => {
            eprintln!("{}", gdrvm_model::GUEST_RESET_LINE);
            ExitCode::from(1)
        }
    }
}

/// How many exit kinds `--stats` lists, most frequent first.
const STATS_EXIT_KINDS: usize = 12;

/// The `--stats` line's JSON.
fn stats_json(report: &RunReport) -> serde_json::Value {
    serde_json::json!({
        "setup_us": report.setup.map(|d| d.as_micros() as u64),
        "phases": report.phases.iter().map(|(name, d)| serde_json::json!([name, d.as_micros() as u64])).collect::<Vec<_>>(),
        "rss_beyond_guest_kib": report.rss_beyond_guest_kib,
        "unclaimed_mmio": report.unclaimed_mmio,
        "dropped_config_writes": report.dropped_config_writes,
        "config_images": report.config_images,
        "vmm_exits": report.exits.total(),
        "vmm_exit_kinds": report
            .exits
            .by_count()
            .into_iter()
            .take(STATS_EXIT_KINDS)
            .map(|(kind, n)| serde_json::json!([kind.to_string(), n]))
            .collect::<Vec<_>>(),
    })
}

fn cluster_up(args: ClusterUpArgs) -> ExitCode {
    let cluster = match Cluster::resolve(&args.cluster) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gdrvm: error: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let kill = match args.kill.as_deref().map(|k| k.split_once(':')) {
        None => None,
        Some(Some((node, text))) if cluster.nodes.iter().any(|n| n.name == node) && !text.is_empty() => {
            Some((node.to_owned(), text.to_owned()))
        }
        Some(_) => {
            eprintln!("gdrvm: error: --kill takes NODE:TEXT, NODE one of the cluster's nodes");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let gdrvm = match std::env::current_exe() {
        Ok(path) => path,
        Err(e) => {
            eprintln!("gdrvm: error: cannot tell where gdrvm runs from: {e}");
            return ExitCode::from(EXIT_CANNOT_TEST);
        }
    };
    let run = cluster::ClusterRun {
        gdrvm,
        kernel: args.boot.kernel,
        initrd: args.boot.initrd,
        cmdline: args.boot.cmdline,
        cpus: args.cpus,
        memory: args.memory,
        kill,
        vmm: args.qemu.map_or(cluster::ClusterVmm::Gdrvm, cluster::ClusterVmm::Qemu),
    };
    let live: Arc<Mutex<dyn Write + Send>> = Arc::new(Mutex::new(std::io::stderr()));
    match cluster::up(&cluster, &run, live) {
        Ok(outcomes) => {
            print!("{}", cluster::ktap(&outcomes));
            ExitCode::from(cluster::exit_status(&outcomes))
        }
        Err(e) => {
            eprintln!("gdrvm: error: {}", error_chain(&e));
            ExitCode::from(EXIT_CANNOT_TEST)
        }
    }
}

/// Standard output without Rust's line buffer.
struct ConsoleWriter(std::mem::ManuallyDrop<File>);

impl std::io::Write for ConsoleWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        (&*self.0).write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
