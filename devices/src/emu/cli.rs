//! The emulator binaries' command line (`gdrvm-gpu-emu`, `gdrvm-nic-emu` share it).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use super::fault::Fault;
use super::{run, EmuKind, EmuOptions, Endpoint};

/// Serves one node-file endpoint as an emulated GPU or RoCE NIC on a vfio-user socket, to
/// one client, until it disconnects.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The vfio-user socket to listen on (removed on exit).
    #[arg(long, required_unless_present = "fd", conflicts_with = "fd")]
    socket: Option<PathBuf>,
    /// Serve the connected socket inherited at this descriptor instead (how gdrvm starts
    /// its emulators: a socket pair, no file).
    #[arg(long)]
    fd: Option<i32>,
    /// Inject a fault: KIND@N, after the guest's Nth register write the device dies
    /// (exit), answers every request with an error (error) or stops answering (hang).
    #[arg(long)]
    fault: Option<Fault>,
    /// A node file, or a preset's name.
    #[arg(long)]
    node: String,
    /// The endpoint's name in the node.
    #[arg(long)]
    function: String,
    /// Exit (SIGTERM) when the parent process dies.
    #[arg(long)]
    die_with_parent: bool,
}

/// The emulator binaries' main: `kind` says which device it plays.
pub fn main(kind: EmuKind) -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .init();
    // clap requires one of --socket and --fd.
    let endpoint = match args.fd {
        Some(fd) => Endpoint::Fd(fd),
        None => Endpoint::Socket(args.socket.unwrap_or_default()),
    };
    let options = EmuOptions {
        endpoint,
        fault: args.fault,
        node: args.node,
        function: args.function,
        die_with_parent: args.die_with_parent,
    };
    let program = match kind {
        EmuKind::Gpu => "gdrvm-gpu-emu",
        EmuKind::Nic => "gdrvm-nic-emu",
    };
    match run(kind, &options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = if e.is_usage() { 2 } else { 1 };
            eprintln!("{program}: {}", chain(&e));
            ExitCode::from(code)
        }
    }
}

/// An error and its sources, one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
