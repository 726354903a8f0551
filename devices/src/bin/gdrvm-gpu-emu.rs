//! `gdrvm-gpu-emu`: the emulated GPU of a node file's endpoint, served over vfio-user.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use gdrvm_devices::emu::{self, EmuKind, EmuOptions, Endpoint};
use tracing_subscriber::EnvFilter;

/// Serves one node-file endpoint as an emulated GPU on a vfio-user socket, to one client,
/// until it disconnects.
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
    fault: Option<emu::fault::Fault>,
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

fn main() -> ExitCode {
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
    match emu::run(EmuKind::Gpu, &options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = if e.is_usage() { 2 } else { 1 };
            eprintln!("gdrvm-gpu-emu: {:#}", anyhow::Error::from(e));
            ExitCode::from(code)
        }
    }
}
