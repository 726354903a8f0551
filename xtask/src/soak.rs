//! `cargo xtask soak`: many boots in a row, counting each way a run goes wrong with its
//! signature, so that rare failures (an L1 that panics under a nested guest one boot in a
//! hundred) get rates instead of anecdotes; and `--kill`, which stops runs at random
//! points and checks that nothing is left behind.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use gdrvm_harness::{exit, gdrvm_dir, L1Failure, QemuMachine, Runner, RunnerKind, VmResult, VmSpec, Vmm};

/// What a soak boots.
pub struct SoakPlan {
    /// Boots in all.
    pub boots: usize,
    /// The L2 VMM.
    pub vmm: Vmm,
    /// Guests per L1 boot (nested); L1 restarts after a death either way.
    pub per_l1: usize,
    /// Guest suites (empty: boot to the agent and stop).
    pub suites: String,
}

/// How one boot ended, for the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum BootEnd {
    Passed,
    GuestPanic,
    GuestOops,
    Hung,
    NotRun,
    Failed,
}

fn classify(r: &VmResult) -> BootEnd {
    match r.outcome {
        _ if r.panicked => BootEnd::GuestPanic,
        _ if r.oops().is_some() => BootEnd::GuestOops,
        _ if r.exit_code() == exit::PASS => BootEnd::Passed,
        gdrvm_harness::VmOutcome::TimedOut => BootEnd::Hung,
        gdrvm_harness::VmOutcome::CannotRun(_) => BootEnd::NotRun,
        _ => BootEnd::Failed,
    }
}

fn vmm_name(vmm: Vmm) -> &'static str {
    match vmm {
        Vmm::Gdrvm => "gdrvm",
        Vmm::Qemu(QemuMachine::Pc) => "qemu-pc",
        Vmm::Qemu(QemuMachine::Microvm) => "qemu-microvm",
    }
}

/// Runs the soak and prints its table; exits 0 when every boot passed in the end.
pub async fn soak(runner: &Runner, plan: &SoakPlan) -> Result<i32> {
    let name = vmm_name(plan.vmm);
    println!(
        "xtask: soak: {} boots of {name}, {} per L1, {:?} runner, L1 {:?}",
        plan.boots, plan.per_l1, runner.kind, runner.l1
    );
    let cmdline = format!("console=ttyS0 quiet panic=-1 gdrvm.suites={}", plan.suites);
    let image = runner.artifacts.guest_for(&cmdline);
    let spec = |i: usize| VmSpec {
        name: format!("{name} #{i}"),
        vmm: plan.vmm,
        image: image.clone(),
        node: None,
        cluster: None,
        cmdline: cmdline.clone(),
        cpus: 2,
        memory: "1G".into(),
        timeout: Duration::from_secs(120),
    };
    let started = Instant::now();
    let mut results = Vec::new();
    let specs: Vec<VmSpec> = (0..plan.boots).map(spec).collect();
    for chunk in specs.chunks(plan.per_l1.max(1)) {
        let batch = runner.run(chunk).await?;
        for r in &batch {
            let end = classify(r);
            let incidents: Vec<String> = r.l1_incidents.iter().map(|i| i.summary()).collect();
            println!(
                "xtask: soak: {}: {end:?} in {:.1} s{}{}",
                r.name,
                r.elapsed.as_secs_f64(),
                if r.emulator_losses > 0 {
                    format!(", {} loss(es) to the emulator first", r.emulator_losses)
                } else {
                    String::new()
                },
                if incidents.is_empty() { String::new() } else { format!("; {}", incidents.join("; ")) }
            );
            if end != BootEnd::Passed {
                if let Some(o) = r.oops() {
                    println!("xtask: soak:   guest oops: {}", o.signature());
                }
                println!("xtask: soak:   {}", r.problem().unwrap_or_default().lines().next().unwrap_or(""));
            }
        }
        results.extend(batch);
    }
    let report = Report::of(&results);
    report.print(plan, runner, started.elapsed());
    let dir = gdrvm_dir().join("results");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("soak-{name}.txt"));
    std::fs::write(&path, report.file(plan, runner, started.elapsed()))?;
    println!("xtask: soak: report in {}", path.display());
    Ok(if report.ends.get(&BootEnd::Passed).copied().unwrap_or(0) == results.len() { exit::PASS } else { exit::FAIL })
}

/// Counts over a soak.
struct Report {
    boots: usize,
    ends: BTreeMap<BootEnd, usize>,
    l1: BTreeMap<String, usize>,
    emulator_losses: u32,
    signatures: Vec<String>,
    /// Each L1 incident's console (the oops, its registers and trace, the tail), for the file.
    consoles: Vec<String>,
}

impl Report {
    fn of(results: &[VmResult]) -> Self {
        let mut r = Report {
            boots: results.len(),
            ends: BTreeMap::new(),
            l1: BTreeMap::new(),
            emulator_losses: 0,
            signatures: Vec::new(),
            consoles: Vec::new(),
        };
        for res in results {
            *r.ends.entry(classify(res)).or_default() += 1;
            r.emulator_losses += res.emulator_losses;
            for i in &res.l1_incidents {
                *r.l1.entry(format!("{:?}", i.failure)).or_default() += 1;
                r.signatures.push(format!("{}: {}", res.name, i.summary()));
                r.consoles.push(format!("== {}: {}", res.name, i.summary()));
                r.consoles.extend(i.console.iter().map(|l| format!("   L1| {l}")));
            }
            if let Some(o) = res.oops() {
                r.signatures.push(format!("{}: guest {}", res.name, o.signature()));
            }
        }
        r
    }

    fn l1_deaths(&self) -> usize {
        [L1Failure::Panic, L1Failure::Stall, L1Failure::Exit, L1Failure::Boot]
            .iter()
            .map(|f| self.l1.get(&format!("{f:?}")).copied().unwrap_or(0))
            .sum()
    }

    fn lines(&self, plan: &SoakPlan, runner: &Runner, took: Duration) -> Vec<String> {
        let per100 = |n: usize| 100.0 * n as f64 / self.boots.max(1) as f64;
        let mut out = vec![
            format!(
                "soak: {} boots of {} in {:.0} s, {:?} runner, L1 {:?}",
                self.boots,
                vmm_name(plan.vmm),
                took.as_secs_f64(),
                runner.kind,
                runner.l1
            ),
            format!("L1 deaths: {} ({:.1} per 100 boots): {:?}", self.l1_deaths(), per100(self.l1_deaths()), self.l1),
            format!("guests lost to the emulator (each ran again): {}", self.emulator_losses),
        ];
        for (end, n) in &self.ends {
            out.push(format!("boots {end:?}: {n} ({:.1} per 100)", per100(*n)));
        }
        out.extend(self.signatures.iter().map(|s| format!("signature {s}")));
        out
    }

    fn print(&self, plan: &SoakPlan, runner: &Runner, took: Duration) {
        for line in self.lines(plan, runner, took) {
            println!("xtask: {line}");
        }
    }

    /// The report file: the table, then every L1 incident's console.
    fn file(&self, plan: &SoakPlan, runner: &Runner, took: Duration) -> String {
        let mut lines = self.lines(plan, runner, took);
        lines.extend(self.consoles.iter().cloned());
        lines.join("\n") + "\n"
    }
}

/// A small deterministic generator (xorshift64*), so a `--kill` soak can be replayed with
/// its `--seed`; no statistical quality is needed to pick delays and signals.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Environment variable that marks every process of one `--kill` round.
const TAG_ENV: &str = "GDRVM_SOAK_TAG";

/// Processes whose environment carries `tag`: (pid, command name).
fn tagged_processes(tag: &str) -> Vec<(i32, String)> {
    let needle = format!("{TAG_ENV}={tag}");
    let Ok(dir) = std::fs::read_dir("/proc") else { return Vec::new() };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|b| *b == 0).any(|v| v == needle.as_bytes()))
        })
        .map(|pid| (pid, std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default().trim().to_owned()))
        .collect()
}

/// Mount points under `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let prefix = dir.display().to_string();
    info.lines()
        .filter_map(|l| l.split_whitespace().nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(str::to_owned)
        .collect()
}

fn net_devices() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .map(|d| d.filter_map(Result::ok).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default()
}

/// What one `--kill` round found left behind, or nothing.
fn leftovers(tag: &str, tmp: &Path, nets_before: &[String]) -> Vec<String> {
    let mut left: Vec<String> =
        tagged_processes(tag).into_iter().map(|(pid, comm)| format!("process {pid} ({comm})")).collect();
    if let Ok(entries) = std::fs::read_dir(tmp) {
        left.extend(entries.filter_map(Result::ok).map(|e| format!("temp file {}", e.path().display())));
    }
    left.extend(mounts_under(tmp).into_iter().map(|m| format!("mount {m}")));
    left.extend(net_devices().into_iter().filter(|d| !nets_before.contains(d)).map(|d| format!("net device {d}")));
    left
}

/// `soak --kill`: `rounds` runs of `cargo xtask boot`, each stopped at a random point by
/// SIGINT, SIGTERM or SIGKILL to xtask or to the VMM process it started (QEMU running L1
/// when nested, gdrvm when native), then checked for leftover processes, temp files,
/// mounts and net devices. Exits 0 when nothing was ever left.
pub fn kill_soak(rounds: usize, kind: RunnerKind, seed: u64) -> Result<i32> {
    let xtask = std::env::current_exe().context("finding the xtask binary")?;
    let mut dice = Dice(seed.max(1));
    // The VMM process on this host: QEMU (L1) when nested, gdrvm when native.
    let (vmm, window_ms) = match kind {
        RunnerKind::Nested => ("qemu-system-x86", 14_000),
        RunnerKind::Native => ("gdrvm", 5_000),
    };
    println!("xtask: soak --kill: {rounds} rounds, {kind:?} runner, seed {seed}");
    let log_dir = gdrvm_dir().join("results").join("soak-kill");
    std::fs::create_dir_all(&log_dir)?;
    let mut dirty = 0;
    for round in 0..rounds {
        let tag = format!("{}-{round}", std::process::id());
        let tmp = tempfile::Builder::new().prefix("gdrvm-soak-").tempdir()?;
        let nets_before = net_devices();
        let log = std::fs::File::create(log_dir.join(format!("round-{round}.log")))?;
        let runner = match kind {
            RunnerKind::Nested => "nested",
            RunnerKind::Native => "native",
        };
        let mut child = {
            use std::os::unix::process::CommandExt;
            Command::new(&xtask)
                .args(["boot", "--runner", runner, "--timeout", "120"])
                .env(TAG_ENV, &tag)
                .env("TMPDIR", tmp.path())
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .process_group(0)
                .spawn()
                .context("starting xtask boot")?
        };
        let delay = Duration::from_millis(dice.below(window_ms));
        let (signal, signame) =
            [(libc::SIGINT, "SIGINT"), (libc::SIGTERM, "SIGTERM"), (libc::SIGKILL, "SIGKILL")][dice.below(3) as usize];
        let at_vmm = dice.below(2) == 1;
        let started = Instant::now();
        while started.elapsed() < delay && child.try_wait()?.is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let vmm_pid = tagged_processes(&tag).into_iter().find(|(_, c)| c == vmm).map(|(p, _)| p);
        let (pid, whom) = match (at_vmm, vmm_pid) {
            (true, Some(p)) => (p, vmm),
            _ => (child.id() as i32, "xtask"),
        };
        let finished_first = child.try_wait()?.is_some();
        if !finished_first {
            // SAFETY: signals a process of this round, found by pid just now.
            unsafe { libc::kill(pid, signal) };
        }
        // A killed VMM makes xtask restart L1 and run the guest again: allow for a run.
        let wait_until = Instant::now() + Duration::from_secs(150);
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break Some(s);
            }
            if Instant::now() > wait_until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut left = Vec::new();
        if status.is_none() {
            left.push("xtask itself: still running 150 s after the signal".to_owned());
            let _ = child.kill();
            let _ = child.wait();
        }
        // Children get SIGKILL from the kernel when xtask dies; give them a moment to go.
        let settle = Instant::now();
        while !tagged_processes(&tag).is_empty() && settle.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(100));
        }
        left.extend(leftovers(&tag, tmp.path(), &nets_before));
        let what = if finished_first {
            format!("finished before the signal ({:.1} s)", delay.as_secs_f64())
        } else {
            format!("{signame} to {whom} at {:.1} s", delay.as_secs_f64())
        };
        let status = status.map_or("-".into(), |s| format!("{s}"));
        if left.is_empty() {
            println!("xtask: soak --kill: round {round}: {what}: xtask {status}; nothing left behind");
        } else {
            dirty += 1;
            println!("xtask: soak --kill: round {round}: {what}: xtask {status}; LEFT BEHIND: {}", left.join(", "));
            for (p, _) in tagged_processes(&tag) {
                // SAFETY: kills a leftover of this round, found by its tag just now.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
    }
    println!("xtask: soak --kill: {} of {rounds} rounds left something behind", dirty);
    Ok(if dirty == 0 { exit::PASS } else { exit::FAIL })
}
