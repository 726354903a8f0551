//! `gdrvm-verbs`: the verbs half of the agent's `rdma` suite, apart from the static agent
//! because it links libibverbs. `query` describes every RDMA device; `pair` runs an RC
//! queue-pair test (send/receive, RDMA WRITE and READ verified on both sides) against the
//! same command on another node; `tcp` measures a TCP stream between the two;
//! `reg-dmabuf` registers a dma-buf an exporter (gdrvm-gpu) hands down. Each result is one JSON object per line on stdout:
//! `{"test": NAME, "ok": bool, "diag": [..], "skip": REASON?, "data": {..}?}`, a failure's
//! reason as its last `diag` line. Exit status 0 whenever results were reported.

mod dmabuf;
mod ib;
mod pair;
mod pattern;
mod query;
mod report;
mod tcp;
mod wire;

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::pair::{PairArgs, Role};
use crate::report::Emitter;

#[derive(Parser)]
#[command(name = "gdrvm-verbs", version, about = "RDMA device query and RC queue-pair test (JSON lines)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Describe every RDMA device: GUID, port 1, GID table, limits.
    Query,
    /// RC queue-pair test with the same command on a peer node.
    Pair(PairCli),
    /// TCP stream throughput with the same command on a peer node.
    Tcp(TcpCli),
    /// Register an inherited dma-buf fd (exported GPU memory) with an RDMA device
    /// (`ibv_reg_dmabuf_mr`): the GPUDirect RDMA path without nvidia_peermem.
    RegDmabuf(RegDmabufCli),
}

#[derive(Args)]
struct RegDmabufCli {
    /// RDMA device (e.g. mlx5_0).
    #[arg(long)]
    device: String,
    /// The dma-buf's file descriptor, inherited from the caller.
    #[arg(long)]
    fd: i32,
    /// Bytes to register from the dma-buf's start.
    #[arg(long)]
    length: usize,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("role").required(true).args(["listen", "connect"])))]
struct TcpCli {
    /// Be the server: accept one client on this port.
    #[arg(long)]
    listen: Option<u16>,
    /// Be the client: send to the server at IP:PORT.
    #[arg(long)]
    connect: Option<std::net::SocketAddr>,
    /// Bytes the client sends.
    #[arg(long, default_value_t = tcp::DEFAULT_BYTES)]
    bytes: u64,
    /// Longest wait for the peer, in seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("role").required(true).args(["listen", "connect"])))]
struct PairCli {
    /// RDMA device (e.g. rxe_nic0).
    #[arg(long)]
    device: String,
    /// GID index to send from (the RoCE v2 entry of the interface's IPv4 address).
    #[arg(long)]
    gid_index: u32,
    /// Be the server: listen on this TCP port for the peer's side channel.
    #[arg(long)]
    listen: Option<u16>,
    /// Be the client: connect to the server's side channel at IP:PORT.
    #[arg(long)]
    connect: Option<String>,
    /// Longest wait for any one completion, in seconds.
    #[arg(long, default_value_t = 10)]
    timeout_secs: u64,
    /// Longest wait for the side channel to connect, in seconds.
    #[arg(long, default_value_t = 30)]
    connect_timeout_secs: u64,
    /// RDMA WRITE/READ sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = pair::DEFAULT_SIZES)]
    sizes: Vec<u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut out = Emitter::stdout();
    match cli.command {
        Command::Query => query::run(&mut out, Path::new("/sys")),
        Command::Pair(p) => {
            let role = match (p.listen, p.connect) {
                (Some(port), _) => Role::Listen(port),
                (None, Some(addr)) => Role::Connect(addr),
                (None, None) => return ExitCode::from(2),
            };
            if p.sizes.is_empty() || p.sizes.contains(&0) {
                eprintln!("gdrvm-verbs: --sizes needs sizes above 0");
                return ExitCode::from(2);
            }
            let args = PairArgs {
                device: p.device,
                gid_index: p.gid_index,
                role,
                timeout: Duration::from_secs(p.timeout_secs.max(1)),
                connect_timeout: Duration::from_secs(p.connect_timeout_secs.max(1)),
                sizes: p.sizes,
            };
            pair::run(&args, &mut out);
        }
        Command::Tcp(t) => {
            let role = match (t.listen, t.connect) {
                (Some(port), _) => tcp::TcpRole::Listen(port),
                (None, Some(addr)) => tcp::TcpRole::Connect(addr, t.bytes),
                (None, None) => return ExitCode::from(2),
            };
            tcp::run(&role, Duration::from_secs(t.timeout_secs.max(1)), &mut out);
        }
        Command::RegDmabuf(r) => out.emit(dmabuf::register(&r.device, r.fd, r.length)),
    }
    if out.results.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
