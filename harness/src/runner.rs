//! Running VMs: natively (gdrvm on this host's KVM) or nested (gdrvm inside an L1 Linux that
//! QEMU TCG boots, on L1's KVM). Both stream the guest console, enforce timeouts and turn
//! what happened into a [`VmResult`] with `git bisect run` exit codes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gdrvm_model::l1::{L1Job, L1Jobs, GDRVM_PATH, JOBS_PATH};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use gdrvm_images::{Initramfs, Source};

use crate::artifacts::{Artifacts, BootImage};
use crate::ktap::{self, KtapReport};
use crate::l1::{classify, L1Line};

/// Exit codes shared by every host command (`git bisect run` convention).
pub mod exit {
    /// Every test passed.
    pub const PASS: i32 = 0;
    /// A test failed, the guest panicked or hung.
    pub const FAIL: i32 = 1;
    /// Bad arguments.
    pub const USAGE: i32 = 2;
    /// Nothing could be tested (no image, no usable KVM, L1 failed).
    pub const CANNOT_TEST: i32 = 125;
}

/// The kernel's message when it panics.
const PANIC_MARKER: &str = "Kernel panic - not syncing";
/// Console lines kept for a panic or hang report.
pub const TAIL_LINES: usize = 40;

/// Errors that keep a run from producing results at all.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A program the run needs is missing.
    #[error("cannot start {program}: {reason}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        reason: String,
    },
    /// Preparing a nested run failed.
    #[error("cannot prepare the nested run: {0}")]
    Prepare(String),
}

/// How VMs are run on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RunnerKind {
    /// gdrvm on this host's `/dev/kvm`.
    Native,
    /// gdrvm inside L1 (QEMU TCG, `-cpu max`, kvm_amd), on L1's `/dev/kvm`.
    Nested,
}

/// Which VMM boots a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vmm {
    /// gdrvm.
    Gdrvm,
    /// QEMU with KVM, the reference in benchmarks.
    Qemu(QemuMachine),
}

/// QEMU machine types compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QemuMachine {
    /// `-M pc` (i440FX, SeaBIOS).
    Pc,
    /// `-M microvm` (qboot, minimal devices).
    Microvm,
}

/// Where QEMU is, on the host and inside L1.
const QEMU_PATH: &str = "/usr/bin/qemu-system-x86_64";
/// QEMU firmware a direct kernel boot can load (`-M pc` and `-M microvm`); Debian keeps
/// SeaBIOS in its own directory, which its QEMU also searches.
const QEMU_FIRMWARE: &[&str] = &[
    "/usr/share/seabios/bios-256k.bin",
    "/usr/share/seabios/bios.bin",
    "/usr/share/qemu/bios-microvm.bin",
    "/usr/share/qemu/qboot.rom",
    "/usr/share/qemu/pvh.bin",
    "/usr/share/qemu/linuxboot.bin",
    "/usr/share/qemu/linuxboot_dma.bin",
    "/usr/share/qemu/kvmvapic.bin",
];

/// One VM to run.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Name for reports.
    pub name: String,
    /// The VMM that boots it.
    pub vmm: Vmm,
    /// What to boot.
    pub image: BootImage,
    /// Node description for gdrvm's `--node`: a preset name or a node file.
    pub node: Option<String>,
    /// Kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub cpus: u32,
    /// Guest RAM, as gdrvm takes it (`1G`).
    pub memory: String,
    /// Longest the guest may run.
    pub timeout: Duration,
}

impl VmSpec {
    /// The program and arguments that boot this VM; `gdrvm` is where gdrvm is.
    /// `node` is where the node description is for the VMM (a preset name, or the file's
    /// path as the VMM sees it).
    fn command_line(
        &self,
        gdrvm: &Path,
        (kernel, initrd, node): (&Path, &Path, Option<&str>),
        interactive: bool,
    ) -> (PathBuf, Vec<String>) {
        match self.vmm {
            Vmm::Gdrvm => {
                let mut args = vec!["run".to_owned()];
                args.extend(self.gdrvm_args(kernel, initrd));
                if let Some(node) = node {
                    args.extend(["--node".to_owned(), node.to_owned()]);
                }
                args.push(if interactive { "--interactive" } else { "--stats" }.into());
                (gdrvm.to_owned(), args)
            }
            Vmm::Qemu(machine) => (PathBuf::from(QEMU_PATH), self.qemu_args(machine, kernel, initrd)),
        }
    }

    fn qemu_args(&self, machine: QemuMachine, kernel: &Path, initrd: &Path) -> Vec<String> {
        let machine = match machine {
            QemuMachine::Pc => "pc",
            QemuMachine::Microvm => "microvm",
        };
        [
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-M",
            machine,
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-vga",
            "none",
            "-serial",
            "stdio",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain([
            "-smp".into(),
            self.cpus.to_string(),
            "-m".into(),
            format!("{}M", self.memory_mib()),
            "-kernel".into(),
            kernel.display().to_string(),
            "-initrd".into(),
            initrd.display().to_string(),
            "-append".into(),
            self.cmdline.clone(),
        ])
        .collect()
    }

    fn gdrvm_args(&self, kernel: &Path, initrd: &Path) -> Vec<String> {
        vec![
            "--kernel".into(),
            kernel.display().to_string(),
            "--initrd".into(),
            initrd.display().to_string(),
            "--cmdline".into(),
            self.cmdline.clone(),
            "--cpus".into(),
            self.cpus.to_string(),
            "--memory".into(),
            self.memory.clone(),
        ]
    }

    /// Checks what gdrvm would reject as a usage error, before anything is built or booted.
    pub fn validate(&self) -> Result<(), String> {
        let bytes = gdrvm_model::parse_size(&self.memory)
            .ok_or_else(|| format!("memory '{}' is not a size (e.g. 512M, 2G)", self.memory))?;
        if !(gdrvm_model::MIN_GUEST_MEMORY..=gdrvm_model::MAX_GUEST_MEMORY).contains(&bytes) {
            return Err(format!("memory {} is out of range: a guest needs at least 64M and at most 1T", self.memory));
        }
        if self.cpus == 0 || self.cpus > gdrvm_model::MAX_GUEST_CPUS {
            return Err(format!("cpus {} is out of range: 1 to {}", self.cpus, gdrvm_model::MAX_GUEST_CPUS));
        }
        Ok(())
    }

    fn memory_mib(&self) -> u64 {
        gdrvm_model::parse_size(&self.memory).map_or(1024, |b| b >> 20)
    }
}

/// How a VM ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmOutcome {
    /// The VMM exited with this status (for gdrvm: the guest's, or its own 125).
    Exited(i32),
    /// The guest ran past its timeout.
    TimedOut,
    /// The VM could not be run.
    CannotRun(String),
}

/// What one VM produced.
#[derive(Debug, Clone)]
pub struct VmResult {
    /// The spec's name.
    pub name: String,
    /// How it ended.
    pub outcome: VmOutcome,
    /// The guest kernel panicked (seen on the console), whatever happened after.
    pub panicked: bool,
    /// Console and gdrvm log lines, in order.
    pub console: Vec<String>,
    /// KTAP parsed from the console.
    pub ktap: KtapReport,
    /// Wall time of the VM.
    pub elapsed: Duration,
    /// From starting the VMM to the agent's first KTAP line.
    pub time_to_ktap: Option<Duration>,
    /// Figures gdrvm reported about itself (`--stats`).
    pub stats: Option<GdrvmStats>,
}

/// What `gdrvm run --stats` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
pub struct GdrvmStats {
    /// Process start to the boot CPU's first KVM_RUN, in µs.
    pub setup_us: Option<u64>,
    /// Resident memory beyond guest RAM, in KiB.
    pub rss_beyond_guest_kib: Option<u64>,
}

/// Prefix of gdrvm's stats line on stderr.
const STATS_PREFIX: &str = "gdrvm-stats: ";

impl VmResult {
    fn new(name: &str, outcome: VmOutcome, console: Vec<String>, elapsed: Duration) -> Self {
        let text = console.join("\n");
        let panicked = text.contains(PANIC_MARKER);
        let stats =
            console.iter().find_map(|l| l.strip_prefix(STATS_PREFIX)).and_then(|j| serde_json::from_str(j).ok());
        VmResult {
            name: name.to_owned(),
            outcome,
            panicked,
            ktap: ktap::parse(&text),
            console,
            elapsed,
            time_to_ktap: None,
            stats,
        }
    }

    /// `git bisect run` status: 0 all passed, 1 failed/panicked/hung, 125 could not test.
    pub fn exit_code(&self) -> i32 {
        match &self.outcome {
            _ if self.panicked => exit::FAIL,
            VmOutcome::Exited(0) if self.ktap.all_ok() => exit::PASS,
            VmOutcome::Exited(exit::CANNOT_TEST) | VmOutcome::CannotRun(_) => exit::CANNOT_TEST,
            VmOutcome::Exited(exit::USAGE) => exit::USAGE,
            _ => exit::FAIL,
        }
    }

    /// A sentence for what went wrong at the VM level, if anything did.
    pub fn problem(&self) -> Option<String> {
        match &self.outcome {
            VmOutcome::TimedOut if self.panicked => {
                Some(format!("the guest kernel panicked and did not reset within {:.0?}", self.elapsed))
            }
            _ if self.panicked => Some("the guest kernel panicked".into()),
            VmOutcome::Exited(0) if self.ktap.complete() => None,
            VmOutcome::Exited(0) => Some("the guest exited without a complete KTAP report".into()),
            VmOutcome::Exited(1) if self.ktap.complete() => None,
            VmOutcome::Exited(code) => Some(format!("the VMM exited with status {code}{}", self.last_error())),
            VmOutcome::TimedOut => Some(format!("the guest hung: no exit within {:.0?}", self.elapsed)),
            VmOutcome::CannotRun(why) => Some(format!("could not run: {why}")),
        }
    }

    fn last_error(&self) -> String {
        self.console
            .iter()
            .rev()
            .find(|l| l.starts_with("gdrvm: error:"))
            .map(|l| format!(" ({l})"))
            .unwrap_or_default()
    }

    /// The guest reset (gdrvm exit 1, no status) before the agent printed anything and
    /// without a kernel panic on the console: a triple fault in early boot. Seen only in
    /// nested runs under QEMU TCG, intermittently; the nested runner runs such a guest again.
    pub fn silent_reset(&self) -> bool {
        self.outcome == VmOutcome::Exited(1) && !self.panicked && self.time_to_ktap.is_none()
    }

    /// The last [`TAIL_LINES`] console lines.
    pub fn tail(&self) -> &[String] {
        &self.console[self.console.len().saturating_sub(TAIL_LINES)..]
    }
}

/// Runs VMs one way or the other.
pub struct Runner {
    /// Native or nested.
    pub kind: RunnerKind,
    /// What to run with.
    pub artifacts: Artifacts,
    /// Print console lines as they arrive.
    pub echo: bool,
}

/// Time L1 may take to boot and load KVM (measured: 6–8 s; TCG on a loaded host is slower).
const L1_BOOT_BUDGET: Duration = Duration::from_secs(120);
/// How long past a job's own timeout the host waits for L1's agent to report it.
const L1_STALL_MARGIN: Duration = Duration::from_secs(30);

impl Runner {
    /// Runs `specs` one after another (nested: in one L1 boot) and returns their results.
    pub async fn run(&self, specs: &[VmSpec]) -> Result<Vec<VmResult>, HarnessError> {
        match self.kind {
            RunnerKind::Native => {
                let mut results = Vec::new();
                for spec in specs {
                    results.push(self.run_native(spec).await?);
                }
                Ok(results)
            }
            RunnerKind::Nested => self.run_nested(specs).await,
        }
    }

    /// Runs one VM with this terminal attached to its console; returns gdrvm's status.
    pub async fn run_interactive(&self, spec: &VmSpec) -> Result<i32, HarnessError> {
        let status = match self.kind {
            RunnerKind::Native => {
                let files = (spec.image.kernel.as_path(), spec.image.initrd.as_path(), spec.node.as_deref());
                let (program, args) = spec.command_line(&self.artifacts.gdrvm, files, true);
                spawn(Command::new(&program).args(args), &program)?.wait().await
            }
            RunnerKind::Nested => {
                let dir = tempfile::tempdir().map_err(|e| HarnessError::Prepare(e.to_string()))?;
                let (initrd, mem) = self.prepare_l1(dir.path(), std::slice::from_ref(spec), true)?;
                let mut cmd = self.qemu(&initrd, mem, true);
                spawn(&mut cmd, Path::new("qemu-system-x86_64"))?.wait().await
            }
        };
        Ok(status.map(|s| s.code().unwrap_or(exit::FAIL)).unwrap_or(exit::CANNOT_TEST))
    }

    async fn run_native(&self, spec: &VmSpec) -> Result<VmResult, HarnessError> {
        let started = Instant::now();
        let files = (spec.image.kernel.as_path(), spec.image.initrd.as_path(), spec.node.as_deref());
        let (program, args) = spec.command_line(&self.artifacts.gdrvm, files, false);
        let mut cmd = Command::new(&program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn(&mut cmd, &program)?;
        let mut time_to_ktap = None;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        forward_lines(child.stdout.take(), tx.clone());
        forward_lines(child.stderr.take(), tx);
        let mut console = Vec::new();
        let deadline = tokio::time::sleep(spec.timeout);
        tokio::pin!(deadline);
        let outcome = loop {
            tokio::select! {
                line = rx.recv() => match line {
                    Some(line) => {
                        if line == "KTAP version 1" && time_to_ktap.is_none() {
                            time_to_ktap = Some(started.elapsed());
                        }
                        self.take_line(&mut console, line);
                    }
                    None => break exited(&mut child).await,
                },
                _ = &mut deadline => {
                    stop(&mut child).await;
                    break VmOutcome::TimedOut;
                }
            }
        };
        let mut result = VmResult::new(&spec.name, outcome, console, started.elapsed());
        result.time_to_ktap = time_to_ktap;
        Ok(result)
    }

    fn take_line(&self, console: &mut Vec<String>, line: String) {
        if self.echo {
            println!("{line}");
        }
        console.push(line);
    }

    /// Writes L1's initramfs for this run: the L1 image, then an archive with gdrvm, the
    /// guests' files, QEMU when a spec uses it, and the job list. Returns it and the L1
    /// memory size in MiB.
    fn prepare_l1(&self, dir: &Path, specs: &[VmSpec], interactive: bool) -> Result<(PathBuf, u64), HarnessError> {
        let prep = |e: std::io::Error| HarnessError::Prepare(e.to_string());
        let mut files: BTreeMap<PathBuf, String> = BTreeMap::new();
        let mut guest_path = |host: &Path| -> String {
            let n = files.len();
            files.entry(host.to_owned()).or_insert_with(|| format!("/l1/files/{n}")).clone()
        };
        let jobs =
            L1Jobs {
                interactive,
                jobs: specs
                    .iter()
                    .map(|s| {
                        let (k, i) = (guest_path(&s.image.kernel), guest_path(&s.image.initrd));
                        // A node file travels into L1; a preset name is known to gdrvm there.
                        let node = s.node.as_ref().map(|n| {
                            if Path::new(n).is_file() {
                                guest_path(Path::new(n))
                            } else {
                                n.clone()
                            }
                        });
                        let files = (Path::new(&k), Path::new(&i), node.as_deref());
                        let (program, args) = s.command_line(Path::new(GDRVM_PATH), files, interactive);
                        L1Job { program: program.display().to_string(), args, timeout_secs: s.timeout.as_secs().max(1) }
                    })
                    .collect(),
            };
        let mut run = Initramfs::new();
        let jobs_json = serde_json::to_vec(&jobs).map_err(|e| HarnessError::Prepare(e.to_string()))?;
        run.file(JOBS_PATH, Source::Bytes(jobs_json), 0o644);
        run.file(GDRVM_PATH, Source::Host(self.artifacts.gdrvm.clone()), 0o755);
        for (host, guest) in &files {
            run.file(guest, Source::Host(host.clone()), 0o644);
        }
        if specs.iter().any(|s| matches!(s.vmm, Vmm::Qemu(_))) {
            for (path, mode) in qemu_files()? {
                run.file(&path, Source::Host(PathBuf::from(&path)), mode);
            }
        }
        let run_archive = dir.join("run.cpio");
        run.write_to(&run_archive).map_err(prep)?;
        let mut data = std::fs::read(&self.artifacts.l1.initrd)
            .map_err(|e| HarnessError::Prepare(format!("{}: {e}", self.artifacts.l1.initrd.display())))?;
        data.resize(data.len().next_multiple_of(4), 0);
        data.extend_from_slice(&std::fs::read(&run_archive).map_err(prep)?);
        let path = dir.join("l1-run.cpio");
        std::fs::write(&path, &data).map_err(prep)?;
        // L1 keeps the unpacked initramfs in RAM next to the largest guest.
        let guest = specs.iter().map(VmSpec::memory_mib).max().unwrap_or(1024);
        let memory = (guest + 1024 + 2 * (data.len() as u64 >> 20)).max(2048);
        Ok((path, memory))
    }

    fn qemu(&self, initrd: &Path, memory_mib: u64, interactive: bool) -> Command {
        let mut cmd = Command::new("qemu-system-x86_64");
        // 46 physical address bits, as server CPUs have: TCG's default 40 cannot place the
        // 64-bit windows of 128 GiB GPU BARs above RAM.
        cmd.args(["-accel", "tcg,thread=multi", "-cpu", "max,phys-bits=46", "-smp", "2", "-m"])
            .arg(format!("{memory_mib}M"))
            .args(["-nodefaults", "-display", "none", "-vga", "none", "-no-reboot"])
            .arg("-kernel")
            .arg(&self.artifacts.l1.kernel)
            .arg("-initrd")
            .arg(initrd)
            .arg("-append")
            .arg(l1_cmdline(std::env::var("GDRVM_LOG").ok().as_deref()));
        if interactive {
            // Ctrl-C goes to the guest; Ctrl-A x (handled by gdrvm in L1) leaves.
            cmd.args(["-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con"]);
        } else {
            cmd.args(["-serial", "stdio"]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        }
        cmd.kill_on_drop(true);
        cmd
    }

    /// Runs `specs` in one L1 boot. If L1 stalls (a job overruns its timeout with no word
    /// from L1's agent, as when L1's emulated CPUs wedge), the job it stalled on and those
    /// after it run again, once, in a fresh L1; the rerun job's console says so. Guests that
    /// reset before printing anything also run again once (see [`VmResult::silent_reset`]).
    async fn run_nested(&self, specs: &[VmSpec]) -> Result<Vec<VmResult>, HarnessError> {
        let mut results = self.run_nested_stall_safe(specs).await?;
        let silent: Vec<usize> = (0..results.len()).filter(|&i| results[i].silent_reset()).collect();
        if silent.is_empty() {
            return Ok(results);
        }
        let again: Vec<VmSpec> = silent.iter().map(|&i| specs[i].clone()).collect();
        tracing::warn!(jobs = ?again.iter().map(|s| &s.name).collect::<Vec<_>>(), "guests reset before printing anything; running them again in a fresh L1");
        let rerun = self.run_nested_stall_safe(&again).await?;
        for (&i, mut r) in silent.iter().zip(rerun) {
            let first = results[i].tail().join("\n");
            r.console.insert(
                0,
                format!(
                    "L1: the guest reset before printing anything (a triple fault in early boot, seen only \
                     nested under TCG); it ran again in a fresh L1. First run's last lines:\n{first}"
                ),
            );
            results[i] = r;
        }
        Ok(results)
    }

    async fn run_nested_stall_safe(&self, specs: &[VmSpec]) -> Result<Vec<VmResult>, HarnessError> {
        let mut batch = self.run_nested_once(specs).await?;
        if let Some(stalled) = batch.stalled {
            tracing::warn!(job = %specs[stalled].name, "L1 stalled; running the rest of the batch in a fresh L1");
            let rerun = self.run_nested_once(&specs[stalled..]).await?;
            let note = format!("L1: L1 stalled during this job (no word from its agent past the timeout); it ran again in a fresh L1. Stalled L1's last lines:\n{}", batch.l1_tail);
            batch.results.truncate(stalled);
            for (i, mut r) in rerun.results.into_iter().enumerate() {
                if i == 0 {
                    r.console.insert(0, note.clone());
                }
                batch.results.push(r);
            }
        }
        Ok(batch.results)
    }

    async fn run_nested_once(&self, specs: &[VmSpec]) -> Result<NestedBatch, HarnessError> {
        let dir = tempfile::tempdir().map_err(|e| HarnessError::Prepare(e.to_string()))?;
        let (initrd, memory) = self.prepare_l1(dir.path(), specs, false)?;
        let mut qemu = spawn(&mut self.qemu(&initrd, memory, false), Path::new("qemu-system-x86_64"))?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        forward_lines(qemu.stdout.take(), tx.clone());
        forward_lines(qemu.stderr.take(), tx);

        let boot_deadline = tokio::time::sleep(L1_BOOT_BUDGET);
        tokio::pin!(boot_deadline);
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        let mut consoles: Vec<Vec<String>> = vec![Vec::new(); specs.len()];
        let mut outcomes: Vec<Option<(VmOutcome, Duration)>> = vec![None; specs.len()];
        let mut time_to_ktap: Vec<Option<Duration>> = vec![None; specs.len()];
        let mut l1_lines: Vec<String> = Vec::new();
        let mut l1_error: Option<String> = None;
        let mut current: Option<(usize, Instant)> = None;
        let mut stalled = None;
        let mut ready = false;
        let started = Instant::now();
        loop {
            tokio::select! {
                line = rx.recv() => {
                    let Some(line) = line else { break };
                    match classify(&line) {
                        L1Line::JobOutput(i, text) if i < specs.len() => self.take_line(&mut consoles[i], text.to_owned()),
                        L1Line::JobStart(i) if i < specs.len() => current = Some((i, Instant::now())),
                        L1Line::Stuck(text) => match current {
                            Some((i, _)) => self.take_line(&mut consoles[i], format!("L1: {text}")),
                            None => l1_lines.push(line.clone()),
                        },
                        L1Line::JobExit { job, code, millis } if job < specs.len() => {
                            outcomes[job] = Some((VmOutcome::Exited(code), Duration::from_millis(millis)));
                            current = None;
                        }
                        L1Line::JobKtap { job, millis } if job < specs.len() => {
                            time_to_ktap[job] = Some(Duration::from_millis(millis));
                        }
                        L1Line::JobTimeout(job) if job < specs.len() => {
                            outcomes[job] = Some((VmOutcome::TimedOut, specs[job].timeout));
                            current = None;
                        }
                        L1Line::Error(e) => l1_error = Some(e.to_owned()),
                        L1Line::Ready => {
                            ready = true;
                            tracing::info!(after = ?started.elapsed(), "L1 ready");
                        }
                        L1Line::Done => {}
                        _ => {
                            if self.echo && !line.trim().is_empty() {
                                println!("[L1] {line}");
                            }
                            l1_lines.push(line);
                        }
                    }
                }
                _ = &mut boot_deadline, if !ready && l1_error.is_none() => {
                    l1_error = Some(format!("L1 did not get ready within {L1_BOOT_BUDGET:?}"));
                    break;
                }
                _ = tick.tick() => {
                    // L1's agent reports a job's timeout itself; past that plus a margin, L1 is wedged.
                    if let Some((i, since)) = current {
                        if since.elapsed() > specs[i].timeout + L1_STALL_MARGIN {
                            stalled = Some(i);
                            l1_error = Some(format!("L1 stalled while running {}", specs[i].name));
                            break;
                        }
                    }
                }
            }
        }
        stop(&mut qemu).await;
        let l1_tail = l1_lines[l1_lines.len().saturating_sub(TAIL_LINES)..].join("\n");
        let results = specs
            .iter()
            .zip(consoles)
            .zip(outcomes)
            .zip(time_to_ktap)
            .map(|(((spec, console), outcome), ktap_at)| {
                let (outcome, elapsed) = outcome.unwrap_or_else(|| {
                    let why = l1_error.clone().unwrap_or_else(|| "L1 stopped before the job finished".into());
                    (VmOutcome::CannotRun(format!("{why}; last L1 console lines:\n{l1_tail}")), started.elapsed())
                });
                let mut result = VmResult::new(&spec.name, outcome, console, elapsed);
                result.time_to_ktap = ktap_at;
                result
            })
            .collect();
        Ok(NestedBatch { results, stalled, l1_tail })
    }
}

/// One L1 boot's results, and the job it stalled on, if it did.
struct NestedBatch {
    results: Vec<VmResult>,
    stalled: Option<usize>,
    l1_tail: String,
}

/// QEMU and what it loads (shared libraries from `ldd`, firmware), to run it inside L1 at
/// the same paths. Paths are returned with the mode to give them.
fn qemu_files() -> Result<Vec<(String, u32)>, HarnessError> {
    let out = std::process::Command::new("ldd")
        .arg(QEMU_PATH)
        .output()
        .map_err(|e| HarnessError::Spawn { program: "ldd".into(), reason: e.to_string() })?;
    if !out.status.success() {
        return Err(HarnessError::Prepare(format!("ldd {QEMU_PATH} failed: is qemu-system-x86 installed?")));
    }
    let mut files = vec![(QEMU_PATH.to_owned(), 0o755)];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
        let path = line.split("=>").last().unwrap_or("").split_whitespace().next().unwrap_or("");
        if path.starts_with('/') {
            files.push((path.to_owned(), 0o755));
        }
    }
    files.extend(QEMU_FIRMWARE.iter().filter(|f| Path::new(f).exists()).map(|f| (f.to_string(), 0o644)));
    Ok(files)
}

/// L1's kernel command line. `GDRVM_LOG` from the host reaches gdrvm in L1 as init's
/// environment (the kernel passes `KEY=value` words without a dot to init).
fn l1_cmdline(gdrvm_log: Option<&str>) -> String {
    let mut cmdline = "console=ttyS0 quiet panic=-1 gdrvm.l1".to_owned();
    if let Some(filter) = gdrvm_log.filter(|f| !f.is_empty() && !f.contains(char::is_whitespace)) {
        cmdline.push_str(&format!(" GDRVM_LOG={filter}"));
    }
    cmdline
}

fn spawn(cmd: &mut Command, program: &Path) -> Result<Child, HarnessError> {
    cmd.kill_on_drop(true).spawn().map_err(|e| HarnessError::Spawn {
        program: program.display().to_string(),
        reason: if program.ends_with("qemu-system-x86_64") && e.kind() == std::io::ErrorKind::NotFound {
            "not installed (Debian: apt-get install qemu-system-x86)".into()
        } else {
            e.to_string()
        },
    })
}

fn forward_lines<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    stream: Option<R>,
    tx: tokio::sync::mpsc::UnboundedSender<String>,
) {
    if let Some(stream) = stream {
        tokio::spawn(async move {
            let mut lines = BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(line.trim_end_matches('\r').to_owned()).is_err() {
                    break;
                }
            }
        });
    }
}

async fn exited(child: &mut Child) -> VmOutcome {
    match child.wait().await {
        Ok(status) => VmOutcome::Exited(status.code().unwrap_or(exit::FAIL)),
        Err(e) => VmOutcome::CannotRun(format!("lost the gdrvm process: {e}")),
    }
}

/// SIGTERM (gdrvm and QEMU stop cleanly on it), then SIGKILL after two seconds.
async fn stop(child: &mut Child) {
    if let Some(pid) = child.id() {
        // SAFETY: signals a child we own and have not reaped.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        if tokio::time::timeout(Duration::from_secs(2), child.wait()).await.is_ok() {
            return;
        }
    }
    let _ = child.kill().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(outcome: VmOutcome, console: &str) -> VmResult {
        VmResult::new("t", outcome, console.lines().map(str::to_owned).collect(), Duration::from_secs(1))
    }

    const PASSING: &str = "KTAP version 1\n1..1\n    1..1\n    ok 1 a\nok 1 smoke";

    #[test]
    fn test_silent_reset_only_without_output_or_panic() {
        assert!(result(VmOutcome::Exited(1), "gdrvm: the guest reset without reporting a status").silent_reset());
        let panicked = "Kernel panic - not syncing: VFS: Unable to mount root fs\ngdrvm: the guest reset";
        assert!(!result(VmOutcome::Exited(1), panicked).silent_reset());
        assert!(!result(VmOutcome::Exited(0), "").silent_reset());
        let mut spoke = result(VmOutcome::Exited(1), "KTAP version 1");
        spoke.time_to_ktap = Some(Duration::from_secs(9));
        assert!(!spoke.silent_reset());
    }

    #[test]
    fn test_exit_codes_follow_bisect() {
        assert_eq!(result(VmOutcome::Exited(0), PASSING).exit_code(), exit::PASS);
        assert_eq!(result(VmOutcome::Exited(0), "KTAP version 1\n1..1\n").exit_code(), exit::FAIL);
        assert_eq!(result(VmOutcome::Exited(1), PASSING).exit_code(), exit::FAIL);
        assert_eq!(result(VmOutcome::TimedOut, "").exit_code(), exit::FAIL);
        assert_eq!(
            result(VmOutcome::Exited(125), "gdrvm: error: KVM: cannot open /dev/kvm").exit_code(),
            exit::CANNOT_TEST
        );
        assert_eq!(result(VmOutcome::CannotRun("no L1".into()), "").exit_code(), exit::CANNOT_TEST);
    }

    #[test]
    fn test_l1_cmdline_carries_log_filter() {
        assert_eq!(l1_cmdline(None), "console=ttyS0 quiet panic=-1 gdrvm.l1");
        assert_eq!(l1_cmdline(Some("gdrvm=debug")), "console=ttyS0 quiet panic=-1 gdrvm.l1 GDRVM_LOG=gdrvm=debug");
        assert_eq!(l1_cmdline(Some("a b")), "console=ttyS0 quiet panic=-1 gdrvm.l1");
    }

    #[test]
    fn test_panic_detected_and_tail_kept() {
        let mut console: Vec<String> = (0..100).map(|i| format!("line {i}")).collect();
        console.push("[    1.2] Kernel panic - not syncing: VFS: Unable to mount root fs".into());
        let r = VmResult::new("t", VmOutcome::Exited(1), console.clone(), Duration::ZERO);
        assert!(r.panicked);
        assert_eq!(r.outcome, VmOutcome::Exited(1));
        assert_eq!(r.exit_code(), exit::FAIL);
        assert_eq!(r.problem().as_deref(), Some("the guest kernel panicked"));
        let hung = VmResult::new("t", VmOutcome::TimedOut, console, Duration::from_secs(300));
        assert!(hung.problem().unwrap().contains("did not reset"), "{:?}", hung.problem());
        assert_eq!(r.tail().len(), TAIL_LINES);
        assert!(r.tail().last().unwrap().contains("Kernel panic"));
        let err = result(VmOutcome::Exited(125), "gdrvm: error: kernel 'x' cannot be read: No such file");
        assert!(err.problem().unwrap().contains("cannot be read"));
    }
}
