//! `gdrvm-agent`: runs gdrvm's test suites and reports KTAP. As a guest's PID 1 it sets up
//! the guest, runs what the kernel command line asks and powers off with its status on
//! the debug-exit port; on a host, `gdrvm-agent run SUITE...` runs the same suites so VM and
//! bare-metal results compare line by line.

mod context;
mod dma;
mod init;
mod ktap;
mod l1;
mod mapping;
mod modalias;
mod net;
mod packet;
mod pcidev;
mod suites;
mod sys;

use std::path::Path;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "gdrvm-agent", version, about = "gdrvm's test agent (guest PID 1 or bare metal)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run suites on this machine and print KTAP; exit 0 when all pass, 1 otherwise.
    Run {
        /// Suites to run (`all` for every suite).
        #[arg(required = true)]
        suites: Vec<String>,
        /// Check this machine against a node file (a preset name, or `gdrvm topology
        /// capture`'s output): its whole CPUs and memory, NUMA layout and PCI tree, as a
        /// guest booted on it is checked.
        #[arg(long)]
        node: Option<String>,
    },
    /// List the suites.
    List,
}

fn main() -> ExitCode {
    if std::process::id() == 1 {
        init::run();
    }
    match Cli::parse().command {
        Command::List => {
            for s in suites::SUITES {
                println!("{s}");
            }
            ExitCode::SUCCESS
        }
        Command::Run { suites: names, node } => {
            let names: Vec<String> = if names.iter().any(|n| n == "all") {
                suites::ALL.iter().map(|s| s.to_string()).collect()
            } else {
                names
            };
            let kernel_log = sys::kernel_log().map_err(|e| e.to_string());
            let expect = match node.as_deref().map(gdrvm_model::node::Node::resolve).transpose() {
                Ok(node) => node.map(|n| gdrvm_model::Expectations {
                    host: true,
                    ..gdrvm_model::Expectations::new(n.cpus(), n.memory(), &n)
                }),
                Err(e) => {
                    eprintln!("gdrvm-agent: {e}");
                    return ExitCode::from(2);
                }
            };
            match context::Context::load(Path::new("/"), kernel_log, Vec::new()) {
                Ok(ctx) => {
                    let ctx = context::Context { expect: expect.or(ctx.expect), ..ctx };
                    ExitCode::from(init::report(&names, &ctx))
                }
                Err(e) => {
                    eprintln!("gdrvm-agent: {e}");
                    ExitCode::from(125)
                }
            }
        }
    }
}
