//! `cargo xtask`: gdrvm's developer commands.

mod bench;
mod build;
mod host;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gdrvm_harness::{
    exit, gdrvm_dir, junit, Artifacts, BootImage, Runner, RunnerChoice, RunnerKind, VmResult, VmSpec, Vmm,
};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "gdrvm developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, ValueEnum)]
enum RunnerArg {
    /// Probe this host's KVM and pick.
    Auto,
    /// gdrvm on this host's KVM.
    Native,
    /// gdrvm inside L1 under QEMU TCG.
    Nested,
}

#[derive(clap::Args)]
struct RunOpts {
    /// Where VMs run.
    #[arg(long, value_enum, default_value = "auto")]
    runner: RunnerArg,
    /// vCPUs of the guest.
    #[arg(long, default_value_t = 2)]
    cpus: u32,
    /// Guest RAM.
    #[arg(long, default_value = "1G")]
    memory: String,
    /// Seconds before a hung guest is stopped.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Node description (preset or TOML file); --cpus and --memory then spread over its
    /// NUMA nodes.
    #[arg(long)]
    node: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build what is missing, boot the default guest, run its suites, print the KTAP summary.
    /// Exits 0 all passed, 1 a test failed (or the guest panicked or hung), 125 could not test.
    Boot {
        /// Suites to run in the guest (repeatable).
        #[arg(long = "suite", default_value = "smoke")]
        suites: Vec<String>,
        /// A busybox shell on the guest console instead of suites (Ctrl-A x quits).
        #[arg(long)]
        shell: bool,
        /// Extra kernel parameters (e.g. "pci=realloc"), appended to the command line.
        #[arg(long, default_value = "")]
        append: String,
        #[command(flatten)]
        run: RunOpts,
    },
    /// Build the static binaries and the guest and L1 images.
    Image,
    /// Benchmarks (figures only; nothing is asserted).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Fuzz the node-file parser and checker with cargo-fuzz (libFuzzer), seeded with the
    /// presets. Needs cargo-fuzz (`cargo install cargo-fuzz`) and a C++ compiler.
    Fuzz {
        /// How long to run.
        #[arg(long, default_value_t = 10)]
        minutes: u64,
    },
    /// Run every test: dependency guard, unit tests and end-to-end boots.
    Test {
        /// Extra arguments for `cargo test`.
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Time to the agent's first KTAP line, gdrvm against QEMU (-M pc, -M microvm) on the
    /// same kernel and initramfs; also gdrvm's setup time and RSS beyond guest RAM.
    Boot {
        /// Runs of each VMM (the median is reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
    },
    /// Time to the agent's first KTAP line on vela-a100 (41 PCI functions, two NUMA nodes)
    /// over minimal (6 functions), same vCPUs and RAM, alternating: the cost of the tree.
    Topology {
        /// Runs of each node (the median is reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
    },
    /// ECAM config-access dispatch cost (criterion, no VM exit), against a lock-and-copy
    /// reference in the same process.
    Ecam,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("GDRVM_LOG").unwrap_or_else(|_| "info".into()))
        .with_target(false)
        .without_time()
        .init();
    let cli = Cli::parse();
    let code = match cli.command {
        Cmd::Image => build::artifacts().map(|_| exit::PASS),
        Cmd::Boot { suites, shell, append, run } => boot(&suites, shell, &append, &run),
        Cmd::Test { cargo_args } => test(&cargo_args),
        Cmd::Fuzz { minutes } => fuzz(minutes),
        Cmd::Bench { what: BenchCmd::Boot { rounds, runner: arg } } => bench_boot(rounds, arg),
        Cmd::Bench { what: BenchCmd::Topology { rounds, runner: arg } } => bench_topology(rounds, arg),
        Cmd::Bench { what: BenchCmd::Ecam } => bench::ecam().map(|_| exit::PASS),
    };
    match code {
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(e) => {
            eprintln!("xtask: cannot test: {e:#}");
            ExitCode::from(exit::CANNOT_TEST as u8)
        }
    }
}

/// Runs `work` on a tokio runtime; Ctrl-C or SIGTERM drops it, which kills the VMMs it
/// started (their handles kill on drop) and removes its temporary files.
fn run_interruptible(work: impl std::future::Future<Output = Result<i32>>) -> Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            result = work => result,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("xtask: interrupted; VMs stopped");
                Ok(130)
            }
            _ = term.recv() => {
                eprintln!("xtask: terminated; VMs stopped");
                Ok(143)
            }
        }
    })
}

async fn runner(artifacts: Artifacts, arg: RunnerArg, echo: bool) -> Result<Runner> {
    let choice = match arg {
        RunnerArg::Auto => RunnerChoice::Auto,
        RunnerArg::Native => RunnerChoice::Force(RunnerKind::Native),
        RunnerArg::Nested => RunnerChoice::Force(RunnerKind::Nested),
    };
    let (kind, why) = gdrvm_harness::choose(choice, &artifacts).await;
    println!("xtask: runner: {kind:?}: {why}");
    if kind == RunnerKind::Nested {
        host::require_commands(&[("qemu-system-x86_64", "qemu-system-x86")])?;
    }
    Ok(Runner { kind, artifacts, echo })
}

fn boot(suites: &[String], shell: bool, append: &str, opts: &RunOpts) -> Result<i32> {
    let mut spec = VmSpec {
        name: "boot".into(),
        vmm: Vmm::Gdrvm,
        image: BootImage { kernel: PathBuf::new(), initrd: PathBuf::new() },
        node: opts.node.clone(),
        cmdline: if shell {
            format!("console=ttyS0 quiet panic=-1 gdrvm.shell {append}")
        } else {
            format!("console=ttyS0 quiet panic=-1 gdrvm.suites={} {append}", suites.join(","))
        }
        .trim_end()
        .to_owned(),
        cpus: opts.cpus,
        memory: opts.memory.clone(),
        timeout: Duration::from_secs(opts.timeout),
    };
    if let Err(e) = spec.validate() {
        eprintln!("xtask: usage: {e}");
        return Ok(exit::USAGE);
    }
    let artifacts = build::artifacts()?;
    spec.image = artifacts.guest.clone();
    run_interruptible(async {
        let runner = runner(artifacts, opts.runner, true).await?;
        if shell {
            println!("xtask: shell on the guest console; Ctrl-A x quits");
            return Ok(runner.run_interactive(&spec).await?);
        }
        let results = runner.run(std::slice::from_ref(&spec)).await?;
        let result = results.first().context("the runner returned no result")?;
        report(result)
    })
}

fn bench_boot(rounds: usize, arg: RunnerArg) -> Result<i32> {
    let artifacts = build::artifacts()?;
    host::require_commands(&[("qemu-system-x86_64", "qemu-system-x86")])?;
    run_interruptible(async {
        let runner = runner(artifacts, arg, false).await?;
        bench::boot(&runner, rounds).await?;
        Ok(exit::PASS)
    })
}

/// Runs the `node_file` fuzz target for `minutes`. libFuzzer writes new inputs to
/// fuzz/corpus (the presets are read-only seeds) and crashes to fuzz/artifacts.
fn fuzz(minutes: u64) -> Result<i32> {
    let have_cargo_fuzz =
        std::process::Command::new("cargo").args(["fuzz", "--version"]).output().is_ok_and(|o| o.status.success());
    if !have_cargo_fuzz {
        println!("xtask: fuzz: cannot run: cargo-fuzz is not installed (cargo install cargo-fuzz)");
        return Ok(exit::CANNOT_TEST);
    }
    host::require_commands(&[("c++", "g++")])?;
    let root = build::workspace();
    std::fs::create_dir_all(root.join("fuzz/corpus/node_file"))?;
    // `-s none`: no sanitizer, so no nightly-only -Z flags; Rust's own checks (bounds,
    // overflow with debug assertions) still turn bugs into crashes.
    let status = std::process::Command::new("cargo")
        .current_dir(root.join("fuzz"))
        .args(["fuzz", "run", "-s", "none", "node_file", "corpus/node_file", "../model/presets", "--"])
        .arg(format!("-max_total_time={}", minutes * 60))
        .arg("-timeout=10")
        .status()?;
    if status.success() {
        println!("xtask: fuzz: node_file ran {minutes} min without a crash");
        Ok(exit::PASS)
    } else {
        println!("xtask: fuzz: node_file failed ({status}); the input is under fuzz/artifacts/node_file");
        Ok(exit::FAIL)
    }
}

fn bench_topology(rounds: usize, arg: RunnerArg) -> Result<i32> {
    let artifacts = build::artifacts()?;
    run_interruptible(async {
        let runner = runner(artifacts, arg, false).await?;
        bench::topology(&runner, rounds).await?;
        Ok(exit::PASS)
    })
}

/// Prints the summary, writes KTAP and JUnit files, returns the exit code.
fn report(result: &VmResult) -> Result<i32> {
    let dir = gdrvm_dir().join("results");
    std::fs::create_dir_all(&dir)?;
    let ktap_path = dir.join(format!("{}.ktap", result.name));
    let junit_path = dir.join(format!("{}.xml", result.name));
    std::fs::write(&ktap_path, result.console.join("\n") + "\n")?;
    let problem = result.problem();
    std::fs::write(&junit_path, junit::render(&result.name, &result.ktap, problem.as_deref()))?;
    for suite in &result.ktap.suites {
        let (p, f, s) = suite.counts();
        println!(
            "xtask: suite {}: {} ({p} passed, {f} failed, {s} skipped)",
            suite.name,
            if suite.ok { "ok" } else { "NOT OK" }
        );
    }
    if let Some(problem) = &problem {
        println!("xtask: {problem}");
        println!("xtask: last {} console lines:", result.tail().len());
        for line in result.tail() {
            println!("  | {line}");
        }
    }
    let code = result.exit_code();
    println!("xtask: KTAP in {}, JUnit in {}", ktap_path.display(), junit_path.display());
    println!(
        "xtask: {} in {:.1?} (exit {code})",
        match code {
            exit::PASS => "PASS",
            exit::FAIL => "FAIL",
            _ => "CANNOT TEST",
        },
        result.elapsed
    );
    Ok(code)
}

/// rust-vmm crates whose types cross crate boundaries: two versions of one do not mix.
const SINGLE_VERSION_CRATES: [&str; 4] = ["vm-memory ", "vfio-bindings ", "kvm-bindings ", "vmm-sys-util "];

/// The rust-vmm crates among the duplicated packages `cargo tree -d --depth 0` lists.
fn duplicated_rust_vmm(tree: &str) -> Vec<&str> {
    tree.lines().filter(|l| SINGLE_VERSION_CRATES.iter().any(|c| l.starts_with(c))).collect()
}

/// Dependency guard: types from two versions of a rust-vmm crate do not mix.
fn single_rust_vmm_versions() -> Result<()> {
    // --depth 0: only the duplicated packages, not the crates that depend on them.
    let out = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(build::workspace())
        .args(["tree", "--workspace", "-d", "-e", "normal", "--depth", "0", "--prefix", "none"])
        .output()
        .context("running cargo tree")?;
    if !out.status.success() {
        anyhow::bail!("cargo tree failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let dups = duplicated_rust_vmm(&text);
    if !dups.is_empty() {
        anyhow::bail!(
            "duplicate rust-vmm crates in the dependency tree (their types will not match): {}",
            dups.join("; ")
        );
    }
    println!("xtask: dependency guard: one version each of vm-memory, vfio-bindings, kvm-bindings, vmm-sys-util");
    Ok(())
}

fn test(cargo_args: &[String]) -> Result<i32> {
    single_rust_vmm_versions()?;
    host::require_commands(&[("iasl", "acpica-tools"), ("qemu-system-x86_64", "qemu-system-x86")])?;
    build::artifacts()?;
    let status = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(build::workspace())
        .args(["test", "--workspace"])
        .args(cargo_args)
        .status()
        .context("running cargo test")?;
    Ok(status.code().unwrap_or(exit::FAIL))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_guard_reads_only_duplicated_packages() {
        let tree = "bitflags v1.3.2\nbitflags v2.13.2\n\nvm-memory v0.17.1\nvm-memory v0.18.0\n";
        assert_eq!(duplicated_rust_vmm(tree), ["vm-memory v0.17.1", "vm-memory v0.18.0"]);
        assert!(duplicated_rust_vmm("syn v2.0.119\nsyn v3.0.10\n").is_empty());
    }
}
