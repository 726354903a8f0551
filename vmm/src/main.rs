//! `gdrvm`: the VMM's command line.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use gdrvm::{ConsoleOptions, Outcome, VmConfig};
use gdrvm_model::node::Node;

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
}

#[derive(Subcommand)]
enum TopologyCommand {
    /// Print the node's NUMA nodes, host bridges and PCIe tree. Exits 2 for a bad node file.
    Show {
        /// A preset (minimal, flat, vela-a100, vfio-lab, dgx-h100) or a node file.
        node: String,
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

#[derive(clap::Args)]
struct RunArgs {
    /// Kernel: a vmlinux (PVH note or 64-bit entry) or a bzImage.
    #[arg(long)]
    kernel: PathBuf,
    /// Initramfs (cpio newc, optionally compressed).
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line.
    #[arg(long, default_value = "console=ttyS0 quiet panic=-1")]
    cmdline: String,
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
    /// Print run figures (setup time, RSS beyond guest RAM) as one JSON line on stderr.
    #[arg(long)]
    stats: bool,
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
        Command::Topology { command } => {
            let (node, scale, render): (_, _, fn(&Node) -> String) = match command {
                TopologyCommand::Show { node } => (node, None, Node::render_tree),
                TopologyCommand::NcclXml { node, scale } => (node, Some(scale), Node::nccl_topology_xml),
                TopologyCommand::QemuArgs { node, scale } => (node, Some(scale), Node::qemu_args),
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

fn run(args: RunArgs, started: Instant) -> ExitCode {
    let node = match args.node.as_deref() {
        Some(n) => Node::resolve(n).and_then(|n| n.scaled(args.cpus, args.memory)),
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
        kernel: args.kernel,
        initrd: args.initrd,
        cmdline: args.cmdline,
        cpus: node.cpus(),
        memory: node.memory(),
        node,
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
        eprintln!(
            "gdrvm-stats: {{\"setup_us\": {}, \"rss_beyond_guest_kib\": {}, \"unclaimed_mmio\": {}, \"dropped_config_writes\": {}}}",
            report.setup.map_or("null".into(), |d| d.as_micros().to_string()),
            report.rss_beyond_guest_kib.map_or("null".into(), |v| v.to_string()),
            report.unclaimed_mmio,
            report.dropped_config_writes,
        );
    }
    match (report.outcome, report.status) {
        (Outcome::Interrupted, _) => {
            eprintln!("gdrvm: interrupted; VM stopped");
            ExitCode::from(EXIT_INTERRUPTED)
        }
        (_, Some(status)) => ExitCode::from(status),
        (Outcome::PoweredOff, None) => ExitCode::SUCCESS,
        (Outcome::Reset, None) => {
            eprintln!("gdrvm: the guest reset without reporting a status");
            ExitCode::from(1)
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
