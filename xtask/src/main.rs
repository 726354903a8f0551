//! `cargo xtask`: gdrvm's developer commands.

mod bench;
mod bisect;
mod build;
mod host;
mod kernel;
mod matrix;
mod parity;
mod regress;
mod soak;
mod vfio_bind;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gdrvm_harness::{
    exit, gdrvm_dir, junit, Artifacts, BootImage, ClusterSpec, L1Config, QemuMachine, Runner, RunnerChoice, RunnerKind,
    TcgThreads, VmResult, VmSpec, Vmm,
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
    /// vCPUs of the guest (default 2; 1 on a lab node, see vfio-lab).
    #[arg(long)]
    cpus: Option<u32>,
    /// Guest RAM.
    #[arg(long, default_value = "1G")]
    memory: String,
    /// Seconds before a hung guest is stopped.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Node description (preset or TOML file); --cpus and --memory then spread over its
    /// NUMA nodes.
    #[arg(long, conflicts_with = "cluster")]
    node: Option<String>,
    /// A cluster (preset `two-node`, or a cluster file): every node boots, joined by its
    /// wires, with this image, size and suites; one KTAP subtest per node.
    #[arg(long)]
    cluster: Option<String>,
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
        /// Extra kernel parameters (e.g. "pci=realloc"), appended to the command line;
        /// `{attempt}` in them becomes the attempt's number (0, 1, ...; see --repeat).
        #[arg(long, default_value = "")]
        append: String,
        /// Boot up to this many times (odd) and exit as the majority did, so a flaky test
        /// does not mislead `git bisect run`; stops once the majority is certain.
        #[arg(long, default_value_t = 1, conflicts_with = "shell")]
        repeat: usize,
        #[command(flatten)]
        run: RunOpts,
        #[command(flatten)]
        kernel: kernel::KernelOpts,
    },
    /// The kernels images/kernels.lock pins.
    Kernels {
        #[command(subcommand)]
        what: KernelsCmd,
    },
    /// Build the static binaries and the guest and L1 images.
    Image,
    /// Benchmarks (figures only; nothing is asserted).
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
    /// Run every fuzz target (node files; vfio-user messages into the emulators' server and
    /// into the VMM's client) with cargo-fuzz (libFuzzer), each for --minutes. Needs
    /// cargo-fuzz (`cargo install cargo-fuzz`) and a C++ compiler.
    Fuzz {
        /// How long to run.
        #[arg(long, default_value_t = 10)]
        minutes: u64,
    },
    /// Many boots in a row, counting L1 panics and stalls, guest oopses, guests lost to the emulator and
    /// hangs, each with its signature; or, with --kill, runs stopped at random points and
    /// checked for anything left behind.
    Soak {
        /// Boots (rounds, with --kill).
        #[arg(long, default_value_t = 100)]
        boots: usize,
        /// Stop each run at a random point (SIGINT, SIGTERM or SIGKILL to xtask or its VMM)
        /// and check that no process, temp file, mount or net device is left.
        #[arg(long)]
        kill: bool,
        /// Seed for --kill's random choices (the default is the clock; printed, to replay).
        #[arg(long)]
        seed: Option<u64>,
        /// The VMM booting the guests (inside L1 when nested).
        #[arg(long, value_enum, default_value = "gdrvm")]
        vmm: VmmArg,
        /// Guests per L1 boot.
        #[arg(long, default_value_t = 10)]
        per_l1: usize,
        /// Guest suites, comma-separated (empty: boot to the agent and stop).
        #[arg(long, default_value = "")]
        suites: String,
        #[command(flatten)]
        l1: L1Opts,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
    },
    /// Hand host PCI devices to vfio-pci for passthrough (remembering their drivers), or
    /// give them back with --restore. Needs root, an IOMMU, and every member of each
    /// device's IOMMU group.
    VfioBind {
        /// PCI addresses (DDDD:BB:DD.F or BB:DD.F).
        #[arg(required = true)]
        bdfs: Vec<String>,
        /// Give the devices back to the drivers they had.
        #[arg(long)]
        restore: bool,
    },
    /// Pin every package of the image recipes to the version Debian's archive serves now
    /// (refreshing apt's lists), with its sha256; rewrites images/recipes/*.toml.
    Repin,
    /// Run every test: dependency guard, unit tests and end-to-end boots. With --matrix,
    /// boot each cell of a matrix file instead (kernels x nodes x command lines x module
    /// sources x suites): JUnit with one testsuite per cell, a summary, what differs.
    Test {
        /// A matrix file (e.g. matrix/kernels.toml).
        #[arg(long)]
        matrix: Option<PathBuf>,
        /// Run every N-th cell from the I-th (`I/N`), for a CI system's own matrix; join
        /// the shards' JUnit with `cargo xtask results merge`.
        #[arg(long, requires = "matrix")]
        shard: Option<matrix::Shard>,
        /// Where the matrix's JUnit goes (default target/gdrvm/results/matrix-<name>[-I-of-N].xml).
        #[arg(long, requires = "matrix")]
        junit: Option<PathBuf>,
        /// Where the matrix's VMs run.
        #[arg(long, value_enum, default_value = "auto", requires = "matrix")]
        runner: RunnerArg,
        /// Extra arguments for `cargo test`.
        #[arg(last = true)]
        cargo_args: Vec<String>,
    },
    /// Boot a guest on a node and record the sysfs files `gdrvm topology capture` reads
    /// there, as a tree that `capture --sysfs` reads: how capture's unit-test fixtures of
    /// the presets' guests were made.
    RecordSysfs {
        /// The directory to write the tree into (created; must not exist).
        #[arg(short, long)]
        output: PathBuf,
        #[command(flatten)]
        run: RunOpts,
    },
    /// Compare NCCL's paths on a host and in its guest: both files are KTAP output of the
    /// agent's `topology` suite. Lists every GPU-NIC and GPU-GPU pair (matched by kind and
    /// BDF order) whose path type or GDR decision differs; exits 0 when none does, 1 when one
    /// does, 125 when a file cannot be read.
    Parity {
        /// KTAP of the bare-metal run on the host.
        host: PathBuf,
        /// KTAP of the run inside the guest.
        guest: PathBuf,
        /// Also write the report as one self-contained HTML page.
        #[arg(long, value_name = "OUT.html")]
        html: Option<PathBuf>,
    },
    /// Result files: JUnit of matrix shards, KTAP of runs outside gdrvm (bare metal).
    Results {
        #[command(subcommand)]
        what: ResultsCmd,
    },
    /// Find the first bad candidate between a good and a bad one: kernels from the lock
    /// file (--kernels) or a list of candidates (--candidates FILE), each booted with the
    /// suites; --repeat boots each candidate several times and takes the majority. Exit 0
    /// with the first bad named, 125 when untestable candidates hide it, 1 when the ends
    /// are wrong (--verify-ends).
    Bisect {
        /// Candidates: every kernel in images/kernels.lock, in version order.
        #[arg(long, conflicts_with = "candidates")]
        kernels: bool,
        /// Candidates: a TOML file of [[candidate]] name = .., kernel = .., append = ..,
        /// module_src = .. (oldest first).
        #[arg(long)]
        candidates: Option<PathBuf>,
        /// The last known good candidate (a name, or a unique part of one).
        #[arg(long)]
        good: String,
        /// A known bad candidate, after the good one.
        #[arg(long)]
        bad: String,
        /// Suites each candidate runs (repeatable).
        #[arg(long = "suite", default_value = "smoke")]
        suites: Vec<String>,
        /// Judge by one KTAP test (`suite.case`, or a case name) instead of the whole run.
        #[arg(long)]
        test: Option<String>,
        /// Boots per candidate (odd); the majority of passes and failures decides.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Boot the two ends first and stop unless they are good and bad.
        #[arg(long)]
        verify_ends: bool,
        /// Extra kernel parameters for every candidate.
        #[arg(long, default_value = "")]
        append: String,
        #[command(flatten)]
        run: RunOpts,
        #[command(flatten)]
        kernel: kernel::KernelOpts,
    },
}

#[derive(Subcommand)]
enum ResultsCmd {
    /// Join JUnit files (matrix shards) into one, totals recomputed.
    Merge {
        /// The merged file.
        #[arg(short, long)]
        output: PathBuf,
        /// The files to join.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
    },
    /// Turn a KTAP file (a bare-metal `gdrvm-agent run`'s output) into JUnit, as a boot's
    /// results are; exit 0 when every test passed, 1 otherwise.
    Junit {
        /// The KTAP file.
        ktap: PathBuf,
        /// The JUnit file to write.
        #[arg(short, long)]
        output: PathBuf,
        /// The run's name in the JUnit (default: the KTAP file's stem).
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Subcommand)]
enum KernelsCmd {
    /// Rewrite images/kernels.lock from Debian's archive: every Debian 12 kernel it serves
    /// (linux-image-6.1.0-N-amd64, linux-image-6.12.N+deb12-amd64), newest version, sha256.
    Update,
    /// List the pinned kernels, oldest first.
    List,
}

#[derive(Clone, Copy, ValueEnum)]
enum VmmArg {
    /// gdrvm.
    Gdrvm,
    /// QEMU -M pc.
    QemuPc,
    /// QEMU -M microvm.
    QemuMicrovm,
}

#[derive(Clone, Copy, ValueEnum)]
enum TcgArg {
    /// One host thread per vCPU (MTTCG).
    Multi,
    /// All vCPUs on one host thread.
    Single,
}

/// How L1 is made (nested runs), for comparing configurations.
#[derive(clap::Args)]
struct L1Opts {
    /// TCG threading of L1's vCPUs.
    #[arg(long, value_enum, default_value = "multi")]
    l1_tcg: TcgArg,
    /// QEMU CPU model of L1 (it must offer SVM with NPT).
    #[arg(long, default_value = gdrvm_harness::L1_CPU)]
    l1_cpu: String,
    /// L1's vCPUs.
    #[arg(long, default_value_t = 2)]
    l1_smp: u32,
    /// Extra words for L1's kernel command line.
    #[arg(long, default_value = "")]
    l1_append: String,
}

impl L1Opts {
    fn config(&self) -> L1Config {
        L1Config {
            tcg_threads: match self.l1_tcg {
                TcgArg::Multi => TcgThreads::Multi,
                TcgArg::Single => TcgThreads::Single,
            },
            cpu: self.l1_cpu.clone(),
            smp: self.l1_smp,
            append: self.l1_append.clone(),
        }
    }
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Time and KVM exits to the agent's first KTAP line, gdrvm against QEMU (-M pc,
    /// -M microvm) on the same kernel and initramfs; also gdrvm's setup phases, the exits
    /// it served by device, and its RSS beyond guest RAM.
    Boot {
        /// Runs of each VMM (the median is reported; 9 is the fewest whose ratio's 95%
        /// interval leaves out the extreme round at each end).
        #[arg(long, default_value_t = 9)]
        rounds: usize,
        /// Also boot each VMM once with initcall timing and show where the boot went.
        #[arg(long)]
        profile: bool,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
        #[command(flatten)]
        l1: L1Opts,
    },
    /// Time to the agent's first KTAP line on vela-a100 (41 PCI functions, two NUMA nodes)
    /// over minimal (6 functions), same vCPUs and RAM, alternating: with every endpoint
    /// hollow (the cost of the tree, which the 1.10 target is for), and as the presets have
    /// them (with the emulators behind ten endpoints against two).
    Topology {
        /// Runs of each node (the median is reported; 9 is the fewest whose ratio's 95%
        /// interval leaves out the extreme round at each end).
        #[arg(long, default_value_t = 9)]
        rounds: usize,
        /// Also boot each hollow node three times with initcall timing and show where the
        /// boots went, side by side.
        #[arg(long)]
        profile: bool,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
        #[command(flatten)]
        l1: L1Opts,
    },
    /// ECAM config-access dispatch cost (criterion, no VM exit), against a lock-and-copy
    /// reference in the same process.
    Ecam,
    /// Emulated peer-to-peer DMA (NIC emulator into a GPU emulator's BAR) against host
    /// memcpy, a trapped emulator register read against an in-VMM one (criterion), and
    /// vela-a100's time to the agent with its emulators against the same tree hollow.
    P2p {
        /// Boots of each kind (the median is reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
    },
    /// TCP and ib_write_bw throughput between the two guests of the two-node cluster:
    /// gdrvm (virtio-net on its userspace wire) against QEMU (virtio-net-pci on a unix
    /// dgram netdev), same kernel and initramfs, alternating; ratios gdrvm / QEMU.
    Net {
        /// Runs of each VMM (the median is reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Where VMs run.
        #[arg(long, value_enum, default_value = "auto")]
        runner: RunnerArg,
    },
    /// Guest reads of a passed-through BAR (vfio-lab's ivshmem), mapped and trapped, each
    /// against guest RAM reads in the same guest; nested, in the lab L1.
    Vfio {
        /// Runs of each kind (the median is reported).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
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
        Cmd::Boot { suites, shell, append, repeat, run, kernel } => {
            boot(&suites, shell, &append, repeat, &run, &kernel)
        }
        Cmd::Kernels { what } => kernels(what),
        Cmd::RecordSysfs { output, run } => record_sysfs(&output, &run),
        Cmd::Test { matrix: Some(path), shard, junit, runner, .. } => test_matrix(&path, shard, junit, runner),
        Cmd::Test { cargo_args, .. } => test(&cargo_args),
        Cmd::Results { what: ResultsCmd::Merge { output, inputs } } => merge_results(&output, &inputs),
        Cmd::Results { what: ResultsCmd::Junit { ktap, output, name } } => ktap_to_junit(&ktap, &output, name),
        Cmd::Bisect { kernels, candidates, good, bad, suites, test, repeat, verify_ends, append, run, kernel } => {
            let candidates = match (kernels, candidates) {
                (_, Some(file)) => regress::Candidates::File(file),
                (true, None) => regress::Candidates::Kernels,
                (false, None) => {
                    eprintln!("xtask: usage: bisect needs --kernels or --candidates FILE");
                    return ExitCode::from(exit::USAGE as u8);
                }
            };
            let args = regress::BisectArgs { candidates, good, bad, test, repeat, verify_ends };
            bisect(&args, &suites, &append, &run, &kernel)
        }
        Cmd::Parity { host, guest, html } => parity::run(&host, &guest, html.as_deref()),
        Cmd::Repin => repin(),
        Cmd::VfioBind { bdfs, restore } => vfio_bind::run(&bdfs, restore),
        Cmd::Soak { boots, kill, seed, vmm, per_l1, suites, l1, runner: arg } => {
            let vmm = match vmm {
                VmmArg::Gdrvm => Vmm::Gdrvm,
                VmmArg::QemuPc => Vmm::Qemu(QemuMachine::Pc),
                VmmArg::QemuMicrovm => Vmm::Qemu(QemuMachine::Microvm),
            };
            let plan = soak::SoakPlan { boots, vmm, per_l1, suites };
            soak(&plan, kill, seed, l1.config(), arg)
        }
        Cmd::Fuzz { minutes } => fuzz(minutes),
        Cmd::Bench { what: BenchCmd::Boot { rounds, profile, runner: arg, l1 } } => {
            bench_boot(rounds, profile, arg, l1.config())
        }
        Cmd::Bench { what: BenchCmd::Topology { rounds, profile, runner: arg, l1 } } => {
            bench_topology(rounds, profile, arg, l1.config())
        }
        Cmd::Bench { what: BenchCmd::Ecam } => bench::ecam().map(|_| exit::PASS),
        Cmd::Bench { what: BenchCmd::Vfio { rounds } } => bench_vfio(rounds),
        Cmd::Bench { what: BenchCmd::P2p { rounds, runner: arg } } => bench_p2p(rounds, arg),
        Cmd::Bench { what: BenchCmd::Net { rounds, runner: arg } } => bench_net(rounds, arg),
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
    let mut runner = Runner::new(kind, artifacts);
    runner.echo = echo;
    Ok(runner)
}

fn soak(plan: &soak::SoakPlan, kill: bool, seed: Option<u64>, l1: L1Config, arg: RunnerArg) -> Result<i32> {
    let artifacts = build::artifacts()?;
    if plan.vmm != Vmm::Gdrvm {
        host::require_commands(&[("qemu-system-x86_64", "qemu-system-x86")])?;
    }
    if kill {
        let rt = tokio::runtime::Runtime::new().context("starting tokio")?;
        let kind = rt.block_on(runner(artifacts, arg, false))?.kind;
        let seed = seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        return soak::kill_soak(plan.boots, kind, seed);
    }
    run_interruptible(async {
        let mut runner = runner(artifacts, arg, false).await?;
        runner.l1 = l1;
        soak::soak(&runner, plan).await
    })
}

/// `cargo xtask repin`: every shipped recipe's packages to the archive's current versions.
fn repin() -> Result<i32> {
    host::require_commands(&[("apt-get", "apt"), ("dpkg-deb", "dpkg")])?;
    let cache = gdrvm_images::Cache::new(gdrvm_dir().join("cache"));
    let progress = |line: &str| println!("xtask: repin: {line}");
    let mut recipes: Vec<PathBuf> = std::fs::read_dir(gdrvm_images::recipes_dir())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    recipes.sort();
    for path in recipes {
        let moved = gdrvm_images::repin(&path, &cache, &progress)?;
        println!("xtask: repin: {}: {} pin(s) moved", path.display(), moved.len());
    }
    Ok(exit::PASS)
}

/// `cargo xtask test --matrix FILE`.
fn test_matrix(
    path: &std::path::Path,
    shard: Option<matrix::Shard>,
    junit: Option<PathBuf>,
    arg: RunnerArg,
) -> Result<i32> {
    let m = match matrix::Matrix::load(path) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("xtask: usage: {e:#}");
            return Ok(exit::USAGE);
        }
    };
    let artifacts = build::artifacts()?;
    let junit = junit.unwrap_or_else(|| {
        let shard = shard.map(|s| format!("-{}-of-{}", s.index, s.count)).unwrap_or_default();
        gdrvm_dir().join("results").join(format!("matrix-{}{shard}.xml", m.name))
    });
    let base = regress::GuestPlan {
        node: None,
        suites: Vec::new(),
        append: String::new(),
        cpus: m.run.cpus.unwrap_or(2),
        memory: m.run.memory.clone().unwrap_or_else(|| "1G".into()),
        timeout: Duration::from_secs(m.run.timeout.unwrap_or(300)),
    };
    run_interruptible(async {
        let runner = std::sync::Arc::new(runner(artifacts, arg, false).await?);
        regress::run_matrix(runner, &m, shard, &base, &junit).await
    })
}

/// `cargo xtask results merge -o OUT IN...`.
fn merge_results(output: &std::path::Path, inputs: &[PathBuf]) -> Result<i32> {
    let merged = matrix::merge(inputs)?;
    std::fs::write(output, merged).with_context(|| format!("writing {}", output.display()))?;
    println!("xtask: results: {} file(s) merged into {}", inputs.len(), output.display());
    Ok(exit::PASS)
}

/// `cargo xtask results junit`.
fn ktap_to_junit(ktap: &std::path::Path, output: &std::path::Path, name: Option<String>) -> Result<i32> {
    let text = std::fs::read_to_string(ktap).with_context(|| format!("reading {}", ktap.display()))?;
    let report = gdrvm_harness::ktap::parse(&text);
    let name = name.unwrap_or_else(|| ktap.file_stem().map_or("ktap".into(), |s| s.to_string_lossy().into_owned()));
    let problem = report.planned.is_none().then_some("no KTAP plan in the file");
    std::fs::write(output, junit::render(&name, &report, problem))
        .with_context(|| format!("writing {}", output.display()))?;
    let ok = problem.is_none() && report.all_ok();
    println!(
        "xtask: results: {} -> {}: {}",
        ktap.display(),
        output.display(),
        if ok { "all ok" } else { "something failed" }
    );
    Ok(if ok { exit::PASS } else { exit::FAIL })
}

/// `cargo xtask bisect`.
fn bisect(
    args: &regress::BisectArgs,
    suites: &[String],
    append: &str,
    opts: &RunOpts,
    kernel: &kernel::KernelOpts,
) -> Result<i32> {
    let plan = regress::GuestPlan {
        node: opts.node.clone(),
        suites: suites.to_vec(),
        append: append.to_owned(),
        cpus: opts.cpus.unwrap_or(2),
        memory: opts.memory.clone(),
        timeout: Duration::from_secs(opts.timeout),
    };
    let artifacts = build::artifacts()?;
    run_interruptible(async {
        let runner = runner(artifacts, opts.runner, false).await?;
        regress::run_bisect(&runner, args, kernel, &plan).await
    })
}

/// `cargo xtask kernels update|list`.
fn kernels(what: KernelsCmd) -> Result<i32> {
    let path = gdrvm_images::lock_path();
    match what {
        KernelsCmd::Update => {
            host::require_commands(&[("apt-get", "apt")])?;
            let archive = gdrvm_images::Archive::system();
            let progress = |line: &str| println!("xtask: kernels: {line}");
            let c = gdrvm_images::update_kernel_lock(&path, &archive, &progress)?;
            println!(
                "xtask: kernels: {}: {} added, {} removed, {} moved",
                path.display(),
                c.added.len(),
                c.removed.len(),
                c.moved.len()
            );
            for line in c.added.iter().map(|k| format!("+ {k}")).chain(c.removed.iter().map(|k| format!("- {k}"))) {
                println!("xtask: kernels: {line}");
            }
            for m in &c.moved {
                println!("xtask: kernels: ~ {m}");
            }
        }
        KernelsCmd::List => {
            for k in gdrvm_images::KernelLock::load(&path)?.kernels {
                println!("{}\t{}", k.id(), k.version);
            }
        }
    }
    Ok(exit::PASS)
}

fn boot(
    suites: &[String],
    shell: bool,
    append: &str,
    repeat: usize,
    opts: &RunOpts,
    kernel: &kernel::KernelOpts,
) -> Result<i32> {
    if repeat % 2 == 0 {
        eprintln!("xtask: usage: --repeat takes an odd number (a majority must exist), not {repeat}");
        return Ok(exit::USAGE);
    }
    let mut spec = VmSpec {
        name: "boot".into(),
        vmm: Vmm::Gdrvm,
        image: BootImage { kernel: PathBuf::new(), initrd: PathBuf::new() },
        node: opts.node.clone(),
        cluster: opts.cluster.clone().map(|cluster| ClusterSpec { cluster, kill: None, qemu: false }),
        cmdline: if shell {
            format!("console=ttyS0 quiet panic=-1 gdrvm.shell {append}").trim_end().to_owned()
        } else {
            regress::suites_cmdline(suites, append)
        },
        cpus: opts.cpus.unwrap_or(2),
        memory: opts.memory.clone(),
        timeout: Duration::from_secs(opts.timeout),
    };
    if opts.cpus.is_none() && spec.needs_lab() {
        // Two vCPUs livelock L1's KVM when one changes a BAR's memory slot while the other
        // faults on it (see the vfio-lab preset).
        spec.cpus = 1;
    }
    if let Err(e) = spec.validate() {
        eprintln!("xtask: usage: {e}");
        return Ok(exit::USAGE);
    }
    if let Some(cluster) = &opts.cluster {
        if shell {
            eprintln!("xtask: usage: --shell takes one guest, not a cluster");
            return Ok(exit::USAGE);
        }
        if let Err(e) = gdrvm_model::cluster::Cluster::resolve(cluster) {
            eprintln!("xtask: usage: {e}");
            return Ok(exit::USAGE);
        }
    }
    let artifacts = build::artifacts()?;
    spec.image = if kernel.is_default() {
        artifacts.guest_for(&spec.cmdline)
    } else {
        build::custom_guest(kernel, &spec.cmdline)?
    };
    // A lab node's devices exist only in its L1.
    let arg = if spec.needs_lab() && matches!(opts.runner, RunnerArg::Auto) { RunnerArg::Nested } else { opts.runner };
    run_interruptible(async {
        let runner = runner(artifacts, arg, true).await?;
        if shell {
            println!("xtask: shell on the guest console; Ctrl-A x quits");
            return Ok(runner.run_interactive(&spec).await?);
        }
        if repeat > 1 || spec.cmdline.contains(regress::ATTEMPT) {
            return regress::boot_repeated(&runner, &spec, repeat, report).await;
        }
        let results = runner.run(std::slice::from_ref(&spec)).await?;
        let result = results.first().context("the runner returned no result")?;
        report(result)
    })
}

/// `cargo xtask record-sysfs`: the guest's `capture` suite prints its sysfs as recorded
/// lines, written here as a tree.
fn record_sysfs(output: &std::path::Path, opts: &RunOpts) -> Result<i32> {
    use gdrvm_model::capture::record::{self, Recorded};
    if output.exists() {
        eprintln!("xtask: usage: {} exists; record-sysfs writes a new directory", output.display());
        return Ok(exit::USAGE);
    }
    let artifacts = build::artifacts()?;
    let cmdline = regress::suites_cmdline(&["capture".to_owned()], record::CMDLINE_FLAG);
    let spec = VmSpec {
        name: "record-sysfs".into(),
        vmm: Vmm::Gdrvm,
        image: artifacts.guest_for(&cmdline),
        node: opts.node.clone(),
        cluster: None,
        cmdline,
        cpus: opts.cpus.unwrap_or(2),
        memory: opts.memory.clone(),
        timeout: Duration::from_secs(opts.timeout),
    };
    run_interruptible(async {
        let runner = runner(artifacts, opts.runner, false).await?;
        let results = runner.run(std::slice::from_ref(&spec)).await?;
        let result = results.first().context("the runner returned no result")?;
        let lines: Vec<&str> =
            result.console.iter().filter_map(|l| Some(l.split_once(record::LINE_PREFIX)?.1)).collect();
        if lines.is_empty() {
            println!("xtask: record-sysfs: the guest printed no recording: {}", result.problem().unwrap_or_default());
            for line in result.tail() {
                println!("  | {line}");
            }
            return Ok(exit::CANNOT_TEST);
        }
        let entries = lines
            .iter()
            .enumerate()
            .map(|(i, l)| Recorded::parse(l, i + 1))
            .collect::<Result<Vec<_>, _>>()
            .context("the guest's recording")?;
        record::write(output, &entries).with_context(|| format!("writing {}", output.display()))?;
        println!("xtask: record-sysfs: {} entries in {}", entries.len(), output.display());
        Ok(exit::PASS)
    })
}

fn bench_boot(rounds: usize, profile: bool, arg: RunnerArg, l1: L1Config) -> Result<i32> {
    let artifacts = build::artifacts()?;
    host::require_commands(&[("qemu-system-x86_64", "qemu-system-x86")])?;
    run_interruptible(async {
        let mut runner = runner(artifacts, arg, false).await?;
        runner.l1 = l1;
        bench::boot(&runner, rounds, profile).await?;
        Ok(exit::PASS)
    })
}

/// The fuzz targets under fuzz/fuzz_targets, each with its read-only seed directory.
const FUZZ_TARGETS: [(&str, Option<&str>); 3] =
    [("node_file", Some("../model/presets")), ("vfio_user_server", None), ("vfio_user_client", None)];

/// Runs every fuzz target for `minutes` each. libFuzzer writes new inputs to
/// fuzz/corpus/<target> (the presets seed node_file) and crashes to fuzz/artifacts.
fn fuzz(minutes: u64) -> Result<i32> {
    let have_cargo_fuzz =
        std::process::Command::new("cargo").args(["fuzz", "--version"]).output().is_ok_and(|o| o.status.success());
    if !have_cargo_fuzz {
        println!("xtask: fuzz: cannot run: cargo-fuzz is not installed (cargo install cargo-fuzz)");
        return Ok(exit::CANNOT_TEST);
    }
    host::require_commands(&[("c++", "g++")])?;
    let root = build::workspace();
    let mut failed = Vec::new();
    for (i, (target, seeds)) in FUZZ_TARGETS.iter().enumerate() {
        println!("xtask: fuzz: target {} of {}: {target}, {minutes} min", i + 1, FUZZ_TARGETS.len());
        let corpus = format!("corpus/{target}");
        std::fs::create_dir_all(root.join("fuzz").join(&corpus))?;
        // `-s none`: no sanitizer, so no nightly-only -Z flags; Rust's own checks (bounds,
        // overflow with debug assertions) still turn bugs into crashes. `-timeout`: an input
        // that takes longer is a hang, reported like a crash.
        let status = std::process::Command::new("cargo")
            .current_dir(root.join("fuzz"))
            .args(["fuzz", "run", "-s", "none", target, &corpus])
            .args(seeds.iter())
            .arg("--")
            .arg(format!("-max_total_time={}", minutes * 60))
            .arg("-timeout=10")
            .status()?;
        if status.success() {
            println!("xtask: fuzz: {target} ran {minutes} min without a crash or hang");
        } else {
            println!("xtask: fuzz: {target} failed ({status}); the input is under fuzz/artifacts/{target}");
            failed.push(*target);
        }
    }
    Ok(if failed.is_empty() { exit::PASS } else { exit::FAIL })
}

fn bench_vfio(rounds: usize) -> Result<i32> {
    let artifacts = build::artifacts()?;
    run_interruptible(async {
        // The lab's devices exist only in its L1.
        let runner = runner(artifacts, RunnerArg::Nested, false).await?;
        bench::vfio(&runner, rounds).await?;
        Ok(exit::PASS)
    })
}

fn bench_p2p(rounds: usize, arg: RunnerArg) -> Result<i32> {
    let artifacts = build::artifacts()?;
    run_interruptible(async {
        let runner = runner(artifacts, arg, false).await?;
        bench::p2p(&runner, rounds).await?;
        Ok(exit::PASS)
    })
}

fn bench_net(rounds: usize, arg: RunnerArg) -> Result<i32> {
    let artifacts = build::artifacts()?;
    host::require_commands(&[("qemu-system-x86_64", "qemu-system-x86")])?;
    run_interruptible(async {
        let runner = runner(artifacts, arg, false).await?;
        bench::net(&runner, rounds).await?;
        Ok(exit::PASS)
    })
}

fn bench_topology(rounds: usize, profile: bool, arg: RunnerArg, l1: L1Config) -> Result<i32> {
    let artifacts = build::artifacts()?;
    run_interruptible(async {
        let mut runner = runner(artifacts, arg, false).await?;
        runner.l1 = l1;
        bench::topology(&runner, rounds, profile).await?;
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
    for incident in &result.l1_incidents {
        println!("xtask: {} (the job ran again); L1's console:", incident.summary());
        for line in &incident.console {
            println!("  L1| {line}");
        }
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
    // git, make and gcc build the regression tests' out-of-tree driver; xmllint checks
    // their JUnit against the schema; headless Chromium renders the parity report (its
    // test says SKIP under a plain `cargo test` without it, never here).
    host::require_commands(&[
        ("iasl", "acpica-tools"),
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("git", "git"),
        ("make", "make"),
        ("gcc", "gcc"),
        ("xmllint", "libxml2-utils"),
        ("chromium", "chromium"),
    ])?;
    build::artifacts()?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("xtask: unit and integration tests");
    let units = std::process::Command::new(&cargo)
        .current_dir(build::workspace())
        .args(["test", "--workspace", "--exclude", "gdrvm-e2e"])
        .args(cargo_args)
        .status()
        .context("running cargo test")?;
    println!("xtask: end-to-end tests (every one must run: {}=1)", gdrvm_e2e::REQUIRED_ENV);
    let e2e = e2e_tests(&cargo, cargo_args)?;
    println!(
        "xtask: e2e: {} tests: {} ran ({} passed, {} failed), {} skipped",
        e2e.passed + e2e.failed,
        e2e.passed + e2e.failed - e2e.skipped.min(e2e.passed),
        e2e.passed - e2e.skipped.min(e2e.passed),
        e2e.failed,
        e2e.skipped
    );
    let ok = units.success() && e2e.status_ok && e2e.failed == 0;
    Ok(if ok { exit::PASS } else { exit::FAIL })
}

/// What the end-to-end run reported.
#[derive(Debug, Default, PartialEq, Eq)]
struct E2eCounts {
    passed: usize,
    failed: usize,
    skipped: usize,
    status_ok: bool,
}

impl E2eCounts {
    /// Reads libtest's result lines and the tests' SKIP lines.
    fn read(&mut self, line: &str) {
        if let Some(rest) = line.trim().strip_prefix("test result: ") {
            let count = |what: &str| {
                rest.split(';').find_map(|p| p.trim().strip_suffix(what)?.trim().rsplit(' ').next()?.parse().ok())
            };
            self.passed += count(" passed").unwrap_or(0);
            self.failed += count(" failed").unwrap_or(0);
        }
        if line.contains(&format!("{}test_", gdrvm_e2e::SKIP_MARKER)) {
            self.skipped += 1;
        }
    }
}

/// Runs the e2e crate's tests with their output shown (for the SKIP lines), echoing it.
fn e2e_tests(cargo: &str, cargo_args: &[String]) -> Result<E2eCounts> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(cargo)
        .current_dir(build::workspace())
        .args(["test", "-p", "gdrvm-e2e"])
        .args(cargo_args)
        .args(["--", "--nocapture"])
        .env(gdrvm_e2e::REQUIRED_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running cargo test -p gdrvm-e2e")?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let readers: Vec<_> = [
        child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child.stderr.take().map(|s| Box::new(s) as _),
    ]
    .into_iter()
    .flatten()
    .map(|stream| {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stream).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        })
    })
    .collect();
    drop(tx);
    let mut counts = E2eCounts::default();
    for line in rx {
        println!("{line}");
        counts.read(&line);
    }
    for r in readers {
        let _ = r.join();
    }
    counts.status_ok = child.wait()?.success();
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_e2e_counts_read_libtest_and_skip_lines() {
        let mut c = E2eCounts::default();
        for line in [
            "SKIP test_smoke_suite_passes_with_two_cpus_and_1g: no artifacts",
            "test e2e::boot::test_smoke ... ok",
            "test result: ok. 14 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 80.1s",
            "test result: FAILED. 1 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out",
        ] {
            c.read(line);
        }
        assert_eq!(c, E2eCounts { passed: 15, failed: 2, skipped: 1, status_ok: false });
    }

    #[test]
    fn test_guard_reads_only_duplicated_packages() {
        let tree = "bitflags v1.3.2\nbitflags v2.13.2\n\nvm-memory v0.17.1\nvm-memory v0.18.0\n";
        assert_eq!(duplicated_rust_vmm(tree), ["vm-memory v0.17.1", "vm-memory v0.18.0"]);
        assert!(duplicated_rust_vmm("syn v2.0.119\nsyn v3.0.10\n").is_empty());
    }
}
