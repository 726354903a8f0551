//! The emulator binaries' command line (`gdrvm-gpu-emu`, `gdrvm-nic-emu` share it).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

use super::fault::Fault;
use super::{run, EmuKind, EmuOptions, Endpoint, Served};

/// Serves node-file endpoints as emulated GPUs or RoCE NICs over vfio-user: one endpoint on a
/// socket it listens on, or several on inherited connected sockets (`--fd N --function NAME`,
/// paired in order), each to one client until it disconnects.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// The vfio-user socket to listen on (removed on exit).
    #[arg(long, required_unless_present = "fd", conflicts_with = "fd")]
    socket: Option<PathBuf>,
    /// Serve the connected socket inherited at this descriptor instead (how gdrvm starts
    /// its emulators: a socket pair each, no file); repeated, one per --function.
    #[arg(long)]
    fd: Vec<i32>,
    /// Inject a fault into every device served: KIND@N, after the guest's Nth register
    /// write the device dies (exit), answers every request with an error (error) or stops
    /// answering (hang).
    #[arg(long)]
    fault: Option<Fault>,
    /// A node file, or a preset's name.
    #[arg(long)]
    node: String,
    /// The endpoint's name in the node; repeated with --fd, once with --socket.
    #[arg(long, required = true)]
    function: Vec<String>,
    /// Exit (SIGTERM) when the parent process dies.
    #[arg(long)]
    die_with_parent: bool,
}

/// The emulator binaries' main: `kind` says which device it plays.
pub fn main(kind: EmuKind) -> ExitCode {
    // Started by gdrvm in a process group of its own, so never in the terminal's
    // foreground: a write of its log to a `stty tostop` terminal would stop it.
    // SAFETY: setting a signal's disposition to SIG_IGN touches no memory of ours.
    unsafe { libc::signal(libc::SIGTTOU, libc::SIG_IGN) };
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")))
        .init();
    let program = match kind {
        EmuKind::Gpu => "gdrvm-gpu-emu",
        EmuKind::Nic => "gdrvm-nic-emu",
    };
    // clap requires one of --socket and --fd.
    let endpoints: Vec<Endpoint> = match args.socket {
        Some(path) => vec![Endpoint::Socket(path)],
        None => args.fd.into_iter().map(Endpoint::Fd).collect(),
    };
    if endpoints.len() != args.function.len() {
        eprintln!(
            "{program}: {} --function for {} endpoint(s): give one --function per --fd, or one with --socket",
            args.function.len(),
            endpoints.len()
        );
        return ExitCode::from(2);
    }
    let served = endpoints.into_iter().zip(args.function).map(|(endpoint, function)| Served { endpoint, function });
    let options = EmuOptions {
        served: served.collect(),
        fault: args.fault,
        node: args.node,
        die_with_parent: args.die_with_parent,
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
