//! Nested runs: gdrvm inside an L1 Linux that QEMU TCG boots (`-cpu max`, kvm_amd), on
//! L1's `/dev/kvm`, for hosts whose KVM cannot boot a stock kernel. One L1 boot runs a
//! whole batch of jobs; when L1 dies (panics, stalls, exits, never gets ready) the job it
//! died on runs again in a fresh L1 (up to [`L1_DEATHS_PER_JOB`] deaths), and the batch
//! goes on from there. Every L1 failure is kept with its oops signature and console on the
//! job it hit.
//!
//! L1's initramfs exists only as an open, unlinked file that QEMU inherits: nothing is left
//! on disk whatever happens to the harness.

use std::collections::BTreeMap;
use std::io::{Read, Seek, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use gdrvm_images::{Initramfs, Source};
use gdrvm_model::kvm_exits::{ExitReasons, KvmExits};
use gdrvm_model::l1::{L1Job, L1Jobs, L1Lab, GDRVM_PATH, JOBS_PATH, L1_DIR};
use tokio::process::Command;

use crate::l1::{classify, L1Line};
use crate::oops;
use crate::process::{forward_lines, spawn, stop};
use crate::result::{exit, L1Failure, L1Incident, VmOutcome, VmResult, TAIL_LINES};
use crate::runner::{HarnessError, Runner};
use crate::spec::{VmSpec, HARNESS_CMDLINE, QEMU_FIRMWARE, QEMU_PATH};
use crate::steal::StealClock;

/// Time L1 may take to boot and load KVM (measured: 6–8 s; TCG on a loaded host is slower).
const L1_BOOT_BUDGET: Duration = Duration::from_secs(120);
/// How long past a job's own timeout the host waits for L1's agent to report it.
const L1_STALL_MARGIN: Duration = Duration::from_secs(30);

/// How QEMU's TCG runs L1's vCPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum TcgThreads {
    /// One host thread per vCPU (MTTCG).
    Multi,
    /// All vCPUs on one host thread, round robin.
    Single,
}

/// L1's default QEMU CPU model (see [`L1Config::default`]).
pub const L1_CPU: &str = "max,phys-bits=46,family=25,model=1,stepping=1,erms=off,fsrm=off";

/// How L1 is made: the knobs a soak compares. The default is the configuration the
/// harness uses everywhere.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct L1Config {
    /// TCG threading.
    pub tcg_threads: TcgThreads,
    /// QEMU `-cpu` model for L1 (it must offer SVM with NPT, or VMX with EPT).
    pub cpu: String,
    /// L1's vCPUs.
    pub smp: u32,
    /// Extra words for L1's kernel command line.
    pub append: String,
}

impl Default for L1Config {
    fn default() -> Self {
        L1Config {
            tcg_threads: TcgThreads::Multi,
            // 46 physical address bits, as server CPUs have: TCG's default 40 cannot place
            // the 64-bit windows of 128 GiB GPU BARs above RAM. And a Zen family (0x19):
            // TCG's `max` says family 0xf (K8), which L1's KVM passes on to every guest,
            // and for a K8 Linux looks for an AGP aperture twice at boot, reading every
            // device of all 256 buses through the type-1 ports: 33,000 exits and about
            // 4 s of each nested boot under QEMU (and under gdrvm before it dropped type
            // 1 and passed `pci=noearly`). And no ERMS or FSRM: with them
            // Linux copies and clears memory with `rep movsb`/`rep stosb`, which QEMU 7.2's
            // TCG runs one byte per translated-block trip; without them it uses `rep
            // movsq` and unrolled loops. Measured: L1 ready in 3.7-4.8 s instead of 6.9 s,
            // gdrvm's setup in L1 0.5 s instead of 2.0 s, a nested boot to its first KTAP
            // line 4.3 s instead of 6.4 s (QEMU's 6.0 s instead of 9.8 s).
            cpu: L1_CPU.into(),
            smp: 2,
            append: String::new(),
        }
    }
}

impl L1Config {
    /// L1's kernel command line. `GDRVM_LOG` from the host reaches gdrvm in L1 as init's
    /// environment (the kernel passes `KEY=value` words without a dot to init).
    ///
    /// Every L1 CPU but the first is `nohz_full`: a CPU running one vCPU thread stops its
    /// 250 Hz tick, and each tick of L1's would be an exit of the guest on it (a host
    /// interrupt), which nested costs 55-100 µs and takes the guest's time. Measured
    /// 2026-12-03, `cargo xtask bench boot` in the same hour: gdrvm's exits to the first
    /// KTAP line 6710 -> 5283 (host interrupts 1666 -> 1177) and QEMU `-M pc`'s 11310 ->
    /// 10612. The first CPU keeps its tick: Linux needs one housekeeping CPU.
    ///
    /// `kvm.nx_huge_pages=never`: otherwise L1's KVM starts a huge-page recovery thread
    /// for every VM it creates, and waits for it, although L1's AMD CPU needs no iTLB
    /// multihit mitigation; KVM_CREATE_VM took 64-77 ms with it and 33-41 ms without, out
    /// of every guest's setup (gdrvm's and QEMU's alike).
    ///
    /// `init_on_alloc=0`: Debian's kernels zero every page they allocate
    /// (`CONFIG_INIT_ON_ALLOC_DEFAULT_ON`), a hardening L1, a throwaway VM that only
    /// hosts the test guests, has no use for. The guests' RAM is what L1 allocates most,
    /// and it is zeroed anyway as it is faulted in; under TCG every pass over it is paid
    /// in full. Measured 2026-12-05, `cargo xtask bench boot --rounds 9` without and with
    /// it in the same hour (medians): gdrvm's setup 330 -> 213 ms, of which the kernel and
    /// initramfs copies into guest RAM 267 -> 64 ms; time to the first KTAP line gdrvm
    /// 2.17 -> 2.09 s, QEMU `-M pc` 3.36 -> 3.27 s. The guests keep their kernel's default.
    ///
    /// [`HARNESS_CMDLINE`]: L1 under TCG spends as long on crypto self-tests as a guest.
    fn cmdline(&self, gdrvm_log: Option<&str>) -> String {
        let mut cmdline =
            format!("console=ttyS0 quiet panic=-1 gdrvm.l1 kvm.nx_huge_pages=never init_on_alloc=0 {HARNESS_CMDLINE}");
        match self.smp {
            0 | 1 => {}
            2 => cmdline.push_str(" nohz_full=1"),
            n => cmdline.push_str(&format!(" nohz_full=1-{}", n - 1)),
        }
        if let Some(filter) = gdrvm_log.filter(|f| !f.is_empty() && !f.contains(char::is_whitespace)) {
            cmdline.push_str(&format!(" GDRVM_LOG={filter}"));
        }
        if !self.append.trim().is_empty() {
            cmdline.push(' ');
            cmdline.push_str(self.append.trim());
        }
        cmdline
    }

    /// QEMU's arguments for L1, less the console. With a `lab`, L1 is a q35 machine with
    /// a virtual IOMMU and the lab's devices, booted with `intel_iommu=on`.
    fn qemu_args(&self, kernel: &Path, initrd: &str, memory_mib: u64, lab: Option<&L1Lab>) -> Vec<String> {
        let threads = match self.tcg_threads {
            TcgThreads::Multi => "multi",
            TcgThreads::Single => "single",
        };
        let mut cmdline = self.cmdline(std::env::var("GDRVM_LOG").ok().as_deref());
        let mut machine = Vec::new();
        if let Some(lab) = lab {
            cmdline.push_str(" intel_iommu=on");
            // The IOMMU first: QEMU wants it before the devices it translates for.
            machine = ["-M", "q35", "-device", "intel-iommu,intremap=on,aw-bits=48"].map(String::from).to_vec();
            machine.extend(lab.qemu_args.iter().cloned());
        }
        [
            "-accel".into(),
            format!("tcg,thread={threads}"),
            "-cpu".into(),
            self.cpu.clone(),
            "-smp".into(),
            self.smp.to_string(),
            "-m".into(),
            format!("{memory_mib}M"),
        ]
        .into_iter()
        .chain(["-nodefaults", "-display", "none", "-vga", "none", "-no-reboot"].map(String::from))
        .chain(["-kernel".into(), kernel.display().to_string(), "-initrd".into(), initrd.into()])
        .chain(["-append".into(), cmdline])
        .chain(machine)
        .collect()
    }
}

/// How many times a guest lost to the emulator (a silent reset, a triple fault, page faults
/// recursing in the kernel's entry code: see [`VmResult::lost_to_emulator`]) runs again.
/// Measured on 2026-12-01: the two-node cluster moving frames through the rdma suite
/// lost a guest to a triple fault in about 3 of 10 runs (with QEMU 7.2 and 10.0 as L0 alike,
/// fewer without huge pages, none in 7 runs with a one-vCPU L1, which is too slow to pass).
/// KVM's record of each shutdown shows the guest's CPU delivering a page fault on an
/// instruction fetch from mapped kernel text, or an interrupt, right after an exit KVM had
/// just served; KVM's own walk of the same address moments earlier found it present. That
/// is TCG's nested paging, not the guest. On 2026-12-02 CI lost a one-node guest the other
/// way TCG loses L1 itself: a double fault on the stack guard page from page faults
/// recursing in `error_entry`; and one two-node run hung with node a's VMM surviving
/// SIGKILL, stuck in L1's kernel. Four reruns keep a whole CI run from failing on it
/// (0.3^5 < 0.3%) while a guest that really resets fails within minutes.
const SILENT_RESET_RERUNS: usize = 4;

/// A job whose L1 died this many times is given up. L1 under TCG with nested SVM dies on
/// its own now and then (stack recursion in `error_entry`, a triple fault: QEMU's SVM
/// emulation, not the job), about once in a hundred boots and more often under heavy
/// exit traffic such as two guests moving frames: on 2026-12-04 CI's two-node job lost
/// three L1s in a row (a stack overflow in `exc_page_fault`, a stall, a silent exit) and
/// was given up, in a run whose other 34 jobs passed. Five tries make that rare, while a
/// job that really kills L1 is still given up within minutes.
const L1_DEATHS_PER_JOB: usize = 5;

/// One L1 boot's results, and how it died if it did not finish.
struct L1Batch {
    /// One per job; `None` for jobs L1 never finished.
    results: Vec<Option<VmResult>>,
    /// How L1 died, and the first job it did not finish.
    death: Option<(usize, L1Incident)>,
    /// L1 got as far as running jobs.
    ready: bool,
    /// L1's agent could not run jobs at all (no KVM, bad job list): no use restarting.
    agent_error: Option<String>,
}

/// An L1 initramfs: an unlinked temporary file, passed to QEMU as an inherited fd.
struct L1Initrd {
    file: std::fs::File,
    memory_mib: u64,
}

impl L1Initrd {
    /// The path QEMU opens it by (its own fd, inherited at the same number).
    fn path(&self) -> String {
        use std::os::fd::AsRawFd;
        format!("/proc/self/fd/{}", self.file.as_raw_fd())
    }
}

impl Runner {
    /// Runs one VM in L1 with this terminal on its console; returns gdrvm's own status,
    /// which L1's agent reports on L1's second serial port.
    pub(crate) async fn run_interactive_nested(&self, spec: &VmSpec) -> Result<i32, HarnessError> {
        let lab = lab_of(spec)?;
        let initrd = self.l1_initrd(std::slice::from_ref(spec), true, lab.as_ref())?;
        let mut status = tempfile::tempfile().map_err(|e| HarnessError::Prepare(format!("a status file: {e}")))?;
        let status_path = {
            use std::os::fd::AsRawFd;
            format!("/proc/self/fd/{}", status.as_raw_fd())
        };
        let mut cmd = Command::new(QEMU_PATH);
        cmd.args(self.l1.qemu_args(&self.artifacts.l1.kernel, &initrd.path(), initrd.memory_mib, lab.as_ref()));
        // Ctrl-C goes to the guest; Ctrl-A x (handled by gdrvm in L1) leaves.
        cmd.args(["-chardev", "stdio,id=con,signal=off", "-serial", "chardev:con"]);
        cmd.args(["-serial", &format!("file:{status_path}")]);
        let qemu = spawn(&mut cmd, Path::new(QEMU_PATH), &[initrd.file.as_fd(), status.as_fd()])?.wait().await;
        qemu.map_err(|e| HarnessError::Spawn { program: QEMU_PATH.into(), reason: e.to_string() })?;
        let mut text = String::new();
        let _ = status.rewind().and_then(|()| status.read_to_string(&mut text));
        Ok(text
            .lines()
            .find_map(|l| match classify(l) {
                L1Line::JobExit { code, .. } => Some(code),
                _ => None,
            })
            .unwrap_or(exit::CANNOT_TEST))
    }

    /// Runs `specs` in L1, restarting L1 when it dies (a job is given up at its
    /// [`L1_DEATHS_PER_JOB`]th L1 death),
    /// then runs again guests lost to the emulator ([`VmResult::lost_to_emulator`]).
    pub(crate) async fn run_nested(&self, specs: &[VmSpec]) -> Result<Vec<VmResult>, HarnessError> {
        // Guests whose nodes need another L1 (a lab of devices to pass through) get their
        // own L1 boot; consecutive guests with the same needs share one.
        let labs = specs.iter().map(lab_of).collect::<Result<Vec<_>, _>>()?;
        let mut results = Vec::with_capacity(specs.len());
        let mut start = 0;
        while start < specs.len() {
            let end = (start..specs.len()).find(|&i| labs[i] != labs[start]).unwrap_or(specs.len());
            results.extend(self.run_nested_lab(&specs[start..end], labs[start].as_ref()).await?);
            start = end;
        }
        Ok(results)
    }

    /// [`Runner::run_nested`] for guests that share one kind of L1.
    async fn run_nested_lab(&self, specs: &[VmSpec], lab: Option<&L1Lab>) -> Result<Vec<VmResult>, HarnessError> {
        let mut results = self.run_nested_restarting(specs, lab).await?;
        for _ in 0..SILENT_RESET_RERUNS {
            let lost: Vec<usize> = (0..results.len()).filter(|&i| results[i].lost_to_emulator()).collect();
            if lost.is_empty() {
                break;
            }
            let again: Vec<VmSpec> = lost.iter().map(|&i| specs[i].clone()).collect();
            tracing::warn!(jobs = ?again.iter().map(|s| &s.name).collect::<Vec<_>>(), "guests lost to the emulator (reset with no panic, triple fault, entry fault recursion, impossible exception frame, unkillable hang); running them again in a fresh L1");
            let rerun = self.run_nested_restarting(&again, lab).await?;
            for (&i, mut r) in lost.iter().zip(rerun) {
                // What L1 reported killing after the lost run is L1's trouble, not a leak.
                let first: Vec<&str> = results[i]
                    .tail()
                    .iter()
                    .map(String::as_str)
                    .filter(|l| !l.contains(gdrvm_model::l1::LEFT_BEHIND))
                    .collect();
                let first = first.join("\n");
                r.console.insert(
                    0,
                    format!(
                        "L1: a guest was lost to the emulator (a reset with no panic before printing anything, \
                         a triple fault, page faults recursing in the kernel's entry code, an oops on an \
                         exception frame no CPU pushes, or a hang whose processes L1 could not kill: seen \
                         only nested under TCG); it ran again in a fresh L1. Previous run's last lines:\n{first}"
                    ),
                );
                r.emulator_losses = results[i].emulator_losses + 1;
                results[i] = r;
            }
        }
        Ok(results)
    }

    async fn run_nested_restarting(
        &self,
        specs: &[VmSpec],
        lab: Option<&L1Lab>,
    ) -> Result<Vec<VmResult>, HarnessError> {
        let mut results: Vec<Option<VmResult>> = vec![None; specs.len()];
        let mut incidents: Vec<Vec<L1Incident>> = vec![Vec::new(); specs.len()];
        let mut start = 0;
        let mut boots_not_ready = 0;
        while start < specs.len() {
            let batch = self.run_l1(&specs[start..], lab).await?;
            for (i, r) in batch.results.into_iter().enumerate() {
                if r.is_some() {
                    results[start + i] = r;
                }
            }
            if let Some(why) = batch.agent_error {
                fail_rest(&mut results, specs, start, &format!("L1 cannot run jobs: {why}"));
                break;
            }
            let Some((first_unfinished, incident)) = batch.death else { break };
            let k = start + first_unfinished;
            let summary = incident.summary();
            let console = incident.console.join("\n");
            boots_not_ready = if batch.ready { 0 } else { boots_not_ready + 1 };
            incidents[k].push(incident);
            let deaths = incidents[k].len();
            if boots_not_ready >= 2 {
                fail_rest(
                    &mut results,
                    specs,
                    k,
                    &format!("L1 did not get ready twice in a row: {summary}; L1 console:\n{console}"),
                );
                break;
            }
            if deaths >= L1_DEATHS_PER_JOB {
                tracing::error!(job = %specs[k].name, "{summary}, L1 death {deaths} for this job: giving it up");
                results[k] = Some(VmResult::new(
                    &specs[k].name,
                    VmOutcome::CannotRun(format!("{summary} (L1 death {deaths} for this job); L1 console:\n{console}")),
                    Vec::new(),
                    Duration::ZERO,
                ));
                start = k + 1;
            } else {
                tracing::warn!(job = %specs[k].name, "{summary}; running the rest of the batch in a fresh L1");
                start = k;
            }
        }
        Ok(results
            .into_iter()
            .zip(incidents)
            .zip(specs)
            .map(|((r, incidents), spec)| {
                let mut r = r.unwrap_or_else(|| {
                    VmResult::new(
                        &spec.name,
                        VmOutcome::CannotRun("L1 never ran it".into()),
                        Vec::new(),
                        Duration::ZERO,
                    )
                });
                // One line for each incident the job ran again after (the last one of a job
                // given up is its outcome); their L1 consoles stay in `l1_incidents`.
                for (n, incident) in incidents.iter().take(L1_DEATHS_PER_JOB - 1).enumerate() {
                    r.console.insert(n, format!("L1: {}; the job ran again in a fresh L1", incident.summary()));
                }
                r.l1_incidents = incidents;
                r
            })
            .collect())
    }

    /// Writes L1's initramfs for this run into an unlinked file: the L1 image, then an
    /// archive with gdrvm, the guests' files, QEMU when a spec uses it, and the job list.
    fn l1_initrd(&self, specs: &[VmSpec], interactive: bool, lab: Option<&L1Lab>) -> Result<L1Initrd, HarnessError> {
        let prep = |e: std::io::Error| HarnessError::Prepare(e.to_string());
        let mut files: BTreeMap<PathBuf, String> = BTreeMap::new();
        let mut guest_path = |host: &Path| -> String {
            let n = files.len();
            files.entry(host.to_owned()).or_insert_with(|| format!("/l1/files/{n}")).clone()
        };
        let jobs = L1Jobs {
            interactive,
            vfio_bind: lab.map(|l| l.vfio_bind.clone()).unwrap_or_default(),
            jobs: specs
                .iter()
                .map(|s| {
                    let (k, i) = (guest_path(&s.image.kernel), guest_path(&s.image.initrd));
                    // A node file travels into L1; a preset name is known to gdrvm there.
                    let node = s.cluster.as_ref().map(|c| &c.cluster).or(s.node.as_ref()).map(|n| {
                        if Path::new(n).is_file() {
                            guest_path(Path::new(n))
                        } else {
                            n.clone()
                        }
                    });
                    let files = (Path::new(&k), Path::new(&i), node.as_deref());
                    let (program, args) = s.command_line(Path::new(GDRVM_PATH), files, interactive);
                    L1Job {
                        program: program.display().to_string(),
                        args,
                        timeout_secs: s.timeout.as_secs().max(1),
                        guest_runs_l1_kernel: s.image.kernel == self.artifacts.l1.kernel
                            && !self.artifacts.l1.kernel.to_string_lossy().ends_with("bzImage"),
                    }
                })
                .collect(),
        };
        let mut run = Initramfs::new();
        let jobs_json = serde_json::to_vec(&jobs).map_err(|e| HarnessError::Prepare(e.to_string()))?;
        run.file(JOBS_PATH, Source::Bytes(jobs_json), 0o644);
        run.file(GDRVM_PATH, Source::Host(self.artifacts.gdrvm.clone()), 0o755);
        // The device emulators gdrvm starts sit next to it, in L1 as on the host.
        for emulator in gdrvm_model::l1::EMULATORS {
            let host = self.artifacts.gdrvm.with_file_name(emulator);
            if host.is_file() {
                run.file(&format!("{L1_DIR}/{emulator}"), Source::Host(host), 0o755);
            }
        }
        for (host, guest) in &files {
            run.file(guest, Source::Host(host.clone()), 0o644);
        }
        if specs.iter().any(VmSpec::uses_qemu) {
            for (path, mode) in qemu_files()? {
                run.file(&path, Source::Host(PathBuf::from(&path)), mode);
            }
        }
        let mut data = std::fs::read(&self.artifacts.l1.initrd)
            .map_err(|e| HarnessError::Prepare(format!("{}: {e}", self.artifacts.l1.initrd.display())))?;
        data.resize(data.len().next_multiple_of(4), 0);
        let mut file = tempfile::tempfile().map_err(prep)?;
        file.write_all(&data).map_err(prep)?;
        run.write(&mut file).map_err(prep)?;
        let size = file.stream_position().map_err(prep)?;
        // L1 keeps the unpacked initramfs in RAM next to the largest guest.
        let guest = specs.iter().map(VmSpec::guest_memory_mib).max().unwrap_or(1024);
        let extra = lab.map_or(0, |l| l.extra_memory_mib);
        let memory_mib = (guest + 1024 + 2 * (size >> 20)).max(2048) + extra;
        Ok(L1Initrd { file, memory_mib })
    }

    /// One L1 boot running `specs` in order, until they are done or L1 dies.
    async fn run_l1(&self, specs: &[VmSpec], lab: Option<&L1Lab>) -> Result<L1Batch, HarnessError> {
        let initrd = self.l1_initrd(specs, false, lab)?;
        let mut cmd = Command::new(QEMU_PATH);
        cmd.args(self.l1.qemu_args(&self.artifacts.l1.kernel, &initrd.path(), initrd.memory_mib, lab));
        cmd.args(["-serial", "stdio"]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut qemu = spawn(&mut cmd, Path::new(QEMU_PATH), &[initrd.file.as_fd()])?;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        forward_lines(qemu.stdout.take(), tx.clone());
        forward_lines(qemu.stderr.take(), tx);

        let boot_deadline = tokio::time::sleep(L1_BOOT_BUDGET);
        tokio::pin!(boot_deadline);
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        let mut consoles: Vec<Vec<String>> = vec![Vec::new(); specs.len()];
        let mut outcomes: Vec<Option<(VmOutcome, Duration)>> = vec![None; specs.len()];
        let mut time_to_ktap: Vec<Option<Duration>> = vec![None; specs.len()];
        // The host's steal counter when each job started, and what it stole to the job's KTAP.
        let mut steal_at_start: Vec<Option<StealClock>> = vec![None; specs.len()];
        let mut host_steal: Vec<Option<Duration>> = vec![None; specs.len()];
        let mut kvm_exits: Vec<Option<KvmExits>> = vec![None; specs.len()];
        let mut exit_reasons: Vec<Option<ExitReasons>> = vec![None; specs.len()];
        // L1's own lines, and where each job's stretch of them starts.
        let mut l1_lines: Vec<String> = Vec::new();
        let mut l1_from: Vec<usize> = vec![0; specs.len()];
        let mut agent_error: Option<String> = None;
        let mut failure: Option<L1Failure> = None;
        let mut current: Option<(usize, Instant)> = None;
        let mut ready = false;
        let mut done = false;
        let started = Instant::now();
        loop {
            tokio::select! {
                line = rx.recv() => {
                    let Some(line) = line else { break };
                    match classify(&line) {
                        L1Line::JobOutput(i, text) if i < specs.len() => self.take_line(&mut consoles[i], text.to_owned()),
                        L1Line::JobStart(i) if i < specs.len() => {
                            current = Some((i, Instant::now()));
                            steal_at_start[i] = StealClock::now();
                            l1_from[i] = l1_lines.len();
                        }
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
                            host_steal[job] = steal_at_start[job].and_then(|s| s.elapsed());
                        }
                        L1Line::JobExits { job, json } if job < specs.len() => {
                            kvm_exits[job] = serde_json::from_str(json).ok();
                        }
                        L1Line::JobReasons { job, json } if job < specs.len() => {
                            exit_reasons[job] = serde_json::from_str(json).ok();
                        }
                        L1Line::JobTimeout(job) if job < specs.len() => {
                            outcomes[job] = Some((VmOutcome::TimedOut, specs[job].timeout));
                            current = None;
                        }
                        L1Line::Error(e) => agent_error = Some(e.to_owned()),
                        L1Line::Ready => {
                            ready = true;
                            tracing::info!(after = ?started.elapsed(), "L1 ready");
                        }
                        L1Line::Done => done = true,
                        _ => {
                            if self.echo && !line.trim().is_empty() {
                                println!("[L1] {line}");
                            }
                            l1_lines.push(line);
                        }
                    }
                }
                _ = &mut boot_deadline, if !ready && agent_error.is_none() => {
                    failure = Some(L1Failure::Boot);
                    break;
                }
                _ = tick.tick() => {
                    // L1's agent reports a job's timeout itself; past that plus a margin, L1 is wedged.
                    if let Some((i, since)) = current {
                        if since.elapsed() > specs[i].timeout + L1_STALL_MARGIN {
                            failure = Some(L1Failure::Stall);
                            break;
                        }
                    }
                }
            }
        }
        stop(&mut qemu).await;
        let after_secs = started.elapsed().as_secs_f64();
        let first_unfinished = outcomes.iter().position(Option::is_none);
        let death = match first_unfinished {
            Some(k) if agent_error.is_none() => {
                let oops = oops::find(&l1_lines);
                let failure = failure.unwrap_or(if oops.is_some() { L1Failure::Panic } else { L1Failure::Exit });
                let failure = if !ready && failure == L1Failure::Exit { L1Failure::Boot } else { failure };
                let console = oops::excerpt(&l1_lines, oops.as_ref(), TAIL_LINES);
                Some((k, L1Incident { failure, after_secs, oops, console }))
            }
            _ => None,
        };
        if first_unfinished.is_none() && !done {
            tracing::debug!("L1 finished every job but did not say done");
        }
        // An oops in L1 that L1 survived is still an incident of the job it happened in.
        let ends: Vec<usize> = (0..specs.len())
            .map(|i| l1_from.get(i + 1).copied().filter(|&e| e > 0).unwrap_or(l1_lines.len()))
            .collect();
        let results = specs
            .iter()
            .zip(consoles)
            .zip(outcomes)
            .zip(time_to_ktap)
            .zip(kvm_exits)
            .enumerate()
            .map(|(i, ((((spec, console), outcome), ktap_at), exits))| {
                let (outcome, elapsed) = outcome?;
                let mut result = VmResult::new(&spec.name, outcome, console, elapsed);
                result.time_to_ktap = ktap_at;
                result.host_steal = host_steal[i];
                result.kvm_exits = exits;
                result.exit_reasons = exit_reasons[i].take();
                let stretch = &l1_lines[l1_from[i].min(ends[i])..ends[i]];
                if let Some(o) = oops::find(stretch) {
                    let console = oops::excerpt(stretch, Some(&o), TAIL_LINES);
                    result.l1_incidents.push(L1Incident {
                        failure: L1Failure::Oops,
                        after_secs,
                        oops: Some(o),
                        console,
                    });
                }
                Some(result)
            })
            .collect();
        let agent_error = agent_error
            .map(|e| format!("{e}; last L1 console lines:\n{}", oops::excerpt(&l1_lines, None, TAIL_LINES).join("\n")));
        Ok(L1Batch { results, death, ready, agent_error })
    }
}

impl VmSpec {
    /// Whether this VM's node needs a lab L1 (it passes through devices that exist only
    /// there), so it can run only nested.
    pub fn needs_lab(&self) -> bool {
        lab_of(self).is_ok_and(|lab| lab.is_some())
    }
}

/// The L1 lab `spec`'s node asks for (its `[nested]` table), if any.
fn lab_of(spec: &VmSpec) -> Result<Option<L1Lab>, HarnessError> {
    let Some(node) = &spec.node else { return Ok(None) };
    let text = match gdrvm_model::node::Node::preset_text(node) {
        Some(text) if !Path::new(node).exists() => text.to_owned(),
        _ => std::fs::read_to_string(node).map_err(|e| HarnessError::Prepare(format!("node file {node}: {e}")))?,
    };
    L1Lab::of_node_text(&text).map_err(|e| HarnessError::Prepare(format!("node file {node}: [nested]: {e}")))
}

/// Marks every job from `from` on that has no result as not run, for `why`.
fn fail_rest(results: &mut [Option<VmResult>], specs: &[VmSpec], from: usize, why: &str) {
    for (r, spec) in results.iter_mut().zip(specs).skip(from).filter(|(r, _)| r.is_none()) {
        *r = Some(VmResult::new(&spec.name, VmOutcome::CannotRun(why.to_owned()), Vec::new(), Duration::ZERO));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_l1_cmdline_carries_log_filter_and_extra_words() {
        let c = L1Config::default();
        let base =
            format!("console=ttyS0 quiet panic=-1 gdrvm.l1 kvm.nx_huge_pages=never init_on_alloc=0 {HARNESS_CMDLINE} nohz_full=1");
        assert_eq!(c.cmdline(None), base);
        assert_eq!(c.cmdline(Some("gdrvm=debug")), format!("{base} GDRVM_LOG=gdrvm=debug"));
        assert_eq!(c.cmdline(Some("a b")), base);
        let c = L1Config { append: " nmi_watchdog=0 ".into(), ..L1Config::default() };
        assert_eq!(c.cmdline(None), format!("{base} nmi_watchdog=0"));
        // One CPU has no CPU to spare from housekeeping; four spare three.
        assert_eq!(
            L1Config { smp: 1, ..L1Config::default() }.cmdline(None),
            format!("console=ttyS0 quiet panic=-1 gdrvm.l1 kvm.nx_huge_pages=never init_on_alloc=0 {HARNESS_CMDLINE}")
        );
        assert!(L1Config { smp: 4, ..L1Config::default() }.cmdline(None).ends_with(" nohz_full=1-3"));
    }

    #[test]
    fn test_l1_qemu_args_follow_the_config() {
        let c = L1Config { tcg_threads: TcgThreads::Single, cpu: "EPYC-v4".into(), smp: 4, append: String::new() };
        let args = c.qemu_args(Path::new("/k"), "/proc/self/fd/7", 3072, None).join(" ");
        assert!(args.starts_with("-accel tcg,thread=single -cpu EPYC-v4 -smp 4 -m 3072M "), "{args}");
        assert!(args.contains("-kernel /k -initrd /proc/self/fd/7"), "{args}");
        assert!(!args.contains("q35") && !args.contains("intel_iommu"), "{args}");
        let lab =
            L1Lab { qemu_args: vec!["-device".into(), "edu,bus=lab1".into()], vfio_bind: vec![], extra_memory_mib: 64 };
        let args = c.qemu_args(Path::new("/k"), "/i", 3072, Some(&lab)).join(" ");
        assert!(
            args.contains(&format!(
                "gdrvm.l1 kvm.nx_huge_pages=never init_on_alloc=0 {HARNESS_CMDLINE} nohz_full=1-3 intel_iommu=on -M q35 -device intel-iommu,intremap=on,aw-bits=48 -device edu,bus=lab1"
            )),
            "{args}"
        );
    }
}
