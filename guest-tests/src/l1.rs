//! The agent's L1 role in nested runs: on a host whose KVM cannot boot a stock kernel, the
//! harness boots L1 under QEMU TCG with this agent as init. It runs the host's VM jobs
//! (gdrvm, or QEMU for comparisons) on L1's `/dev/kvm` and relays each job's output, the
//! time to its first KTAP line, the exits KVM counted until then, and its exit status as
//! marker lines.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use gdrvm_model::kvm_exits::{ExitReasons, KvmExits, Shutdown, Vendor, DEBUGFS_KVM, TRACEFS};
use gdrvm_model::l1::{job_output_prefix, L1Job, L1Jobs, IN_L1_ENV, JOBS_PATH, LEFT_BEHIND, MARKER, SURVIVED_SIGKILL};
use gdrvm_model::symbols::SymbolMap;

/// Whether shared memory (memfds) may be backed by transparent huge pages.
const SHMEM_THP: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// Whether new processes get randomized addresses.
const RANDOMIZE_VA_SPACE: &str = "/proc/sys/kernel/randomize_va_space";

/// Exit status of L1 when it could not run its jobs.
const CANNOT_TEST: u8 = 125;

/// Runs every job; returns 0 when they all ran (whatever their own status), 125 otherwise.
pub fn run() -> u8 {
    if !Path::new("/dev/kvm").exists() {
        println!("{MARKER}error no /dev/kvm in L1: no KVM module loaded (does the CPU model offer SVM or VMX?)");
        return CANNOT_TEST;
    }
    let jobs: L1Jobs = match std::fs::read(JOBS_PATH)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(jobs) => jobs,
        Err(e) => {
            println!("{MARKER}error cannot read {JOBS_PATH}: {e}");
            return CANNOT_TEST;
        }
    };
    for bdf in &jobs.vfio_bind {
        if let Err(e) = bind_vfio(bdf) {
            println!("{MARKER}error cannot bind L1's {bdf} to vfio-pci: {e}");
            return CANNOT_TEST;
        }
    }
    // KVM's exit counters per VM live in debugfs; without it the jobs still run, and the
    // host reads no counts.
    if let Err(e) = crate::sys::mount("debugfs", "/sys/kernel/debug", "debugfs") {
        println!("# gdrvm-l1: cannot mount debugfs, no exit counts: {e}");
    }
    // Exits by reason and MSR accesses by register, from histograms on KVM's tracepoints.
    let reasons = match (Vendor::loaded(), ExitReasons::start(Path::new(TRACEFS))) {
        (Some(vendor), Ok(())) => Some(vendor),
        (None, _) => None,
        (_, Err(e)) => {
            println!("# gdrvm-l1: no exits by reason (hist triggers on KVM's tracepoints): {e}");
            None
        }
    };
    // A triple fault leaves no registers (on AMD KVM resets the vCPU first): KVM's record
    // of the shutdown exit says where the guest was and what it was delivering.
    if let Some(vendor) = Vendor::loaded() {
        if let Err(e) = Shutdown::start(Path::new(TRACEFS), vendor) {
            println!("# gdrvm-l1: no record of guest shutdowns (a filter on kvm_exit): {e}");
        }
    }
    // Huge pages for memfd-backed guest RAM (gdrvm's), as anonymous RAM (QEMU's) gets
    // them by default: each nested page fault is a costly exit.
    if let Err(e) = std::fs::write(SHMEM_THP, "advise") {
        println!("# gdrvm-l1: cannot enable huge pages for guest RAM ({SHMEM_THP}): {e}");
    }
    // Every job's processes at the addresses of the job before: QEMU 7.2's TCG, which runs
    // L1, keys its translated code by virtual address (x86 has no PC-relative blocks before
    // QEMU 8.0), so a randomized process (gdrvm is static-pie, QEMU a PIE with its
    // libraries) is translated afresh in every job. L1 is a throwaway test machine.
    if let Err(e) = std::fs::write(RANDOMIZE_VA_SPACE, "0") {
        println!("# gdrvm-l1: cannot turn address-space randomization off ({RANDOMIZE_VA_SPACE}): {e}");
    }
    println!("{MARKER}ready");
    for (i, job) in jobs.jobs.iter().enumerate() {
        println!("{MARKER}job {i} start");
        let started = Instant::now();
        // The histograms count every VM: they start from zero for each job.
        let reasons = reasons.filter(|_| ExitReasons::start(Path::new(TRACEFS)).is_ok());
        let result = if jobs.interactive { run_attached(job) } else { run_relayed(i, job, reasons) };
        match result {
            Ok(Some(code)) => {
                let line = format!("{MARKER}job {i} exit {code} {}", started.elapsed().as_millis());
                if jobs.interactive {
                    report_status(&line);
                }
                println!("{line}");
            }
            Ok(None) => println!("{MARKER}job {i} timeout"),
            Err(e) => {
                println!("{MARKER}error job {i}: cannot start {}: {e}", job.program);
                return CANNOT_TEST;
            }
        }
    }
    println!("{MARKER}done");
    0
}

/// Binds PCI function `bdf` to vfio-pci (driver_override, unbind, reprobe) and checks
/// that its VFIO group node appeared.
fn bind_vfio(bdf: &str) -> Result<(), String> {
    let dev = Path::new("/sys/bus/pci/devices").join(bdf);
    let write = |path: &Path, value: &str| std::fs::write(path, value).map_err(|e| format!("{}: {e}", path.display()));
    if !dev.exists() {
        return Err(format!("{} does not exist (is the lab's QEMU device at that address?)", dev.display()));
    }
    write(&dev.join("driver_override"), "vfio-pci")?;
    if dev.join("driver").exists() {
        write(&dev.join("driver/unbind"), bdf)?;
    }
    write(Path::new("/sys/bus/pci/drivers_probe"), bdf)?;
    let driver = std::fs::read_link(dev.join("driver"))
        .map_err(|_| "no driver bound after probing (is vfio-pci loaded?)".to_owned())?;
    if !driver.ends_with("vfio-pci") {
        return Err(format!("bound to {} instead", driver.display()));
    }
    let group =
        std::fs::read_link(dev.join("iommu_group")).map_err(|_| "no IOMMU group (is the IOMMU on?)".to_owned())?;
    let group = group.file_name().map(|g| g.to_string_lossy().into_owned()).unwrap_or_default();
    if !Path::new("/dev/vfio").join(&group).exists() {
        return Err(format!("/dev/vfio/{group} did not appear"));
    }
    Ok(())
}

/// The serial port on which an interactive run reports its job's status: the console
/// belongs to the person at it, so the host reads the status from L1's second port.
const STATUS_PORT: &str = "/dev/ttyS1";

/// Writes `line` to [`STATUS_PORT`]; a missing port only loses the status (the host then
/// reports 125).
fn report_status(line: &str) {
    use std::io::Write;
    match std::fs::OpenOptions::new().write(true).open(STATUS_PORT) {
        Ok(mut port) => {
            let _ = writeln!(port, "{line}");
        }
        Err(e) => println!("{MARKER}error cannot report the job's status on {STATUS_PORT}: {e}"),
    }
}

fn command(job: &L1Job) -> Command {
    let mut cmd = Command::new(&job.program);
    cmd.args(&job.args).env(IN_L1_ENV, "1");
    cmd
}

/// Exit code of a finished child; a signal counts as 128 + its number.
fn code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

fn run_attached(job: &L1Job) -> std::io::Result<Option<i32>> {
    Ok(Some(code(command(job).status()?)))
}

/// What the relay of a job's standard output reports at its first KTAP line.
struct FirstKtap {
    /// When the job started.
    started: Instant,
    /// The job's process, whose VM's counters are read.
    pid: u32,
    /// The exit histograms' vendor, where they count.
    reasons: Option<Vendor>,
    /// Whether the guest runs L1's kernel, so L1's symbols name its exit sites.
    l1_kernel: bool,
}

/// Relays a job's output; with `first_ktap`, also reports when the first KTAP line arrived
/// and the exits KVM counted for the job's VM until then.
fn relay(job: usize, stream: impl Read + Send + 'static, first_ktap: Option<FirstKtap>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let prefix = job_output_prefix(job);
        let mut first_ktap = first_ktap;
        for line in BufReader::new(stream).split(b'\n').map_while(Result::ok) {
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches('\r');
            if line == "KTAP version 1" {
                if let Some(FirstKtap { started: t, pid, reasons, l1_kernel }) = first_ktap.take() {
                    println!("{MARKER}job {job} ktap {}", t.elapsed().as_millis());
                    // Only a process that holds a VM itself (not a cluster's parent).
                    let held = holds_vm(pid).then(|| Held::stop(pid));
                    // The VM's own counters first: a guest with nothing to run powers off
                    // right after this line, and its counters go with it.
                    match KvmExits::read(Path::new(DEBUGFS_KVM), pid) {
                        Ok(exits) => match serde_json::to_string(&exits) {
                            Ok(json) => println!("{MARKER}job {job} exits {json}"),
                            Err(e) => println!("# gdrvm-l1: job {job}: exit counts: {e}"),
                        },
                        Err(e) => println!("# gdrvm-l1: job {job}: no exit counts: {e}"),
                    }
                    if let Some(vendor) = reasons {
                        let read = ExitReasons::read(Path::new(TRACEFS), vendor).map(|mut r| {
                            // Named after the read: kallsyms is slow to read the first time.
                            if let Some(map) = l1_kernel.then(l1_symbols).flatten() {
                                r.name_sites(map);
                            }
                            serde_json::to_string(&r)
                        });
                        match read {
                            Ok(Ok(json)) => println!("{MARKER}job {job} reasons {json}"),
                            Ok(Err(e)) => println!("# gdrvm-l1: job {job}: exits by reason: {e}"),
                            Err(e) => println!("# gdrvm-l1: job {job}: no exits by reason: {e}"),
                        }
                    }
                    drop(held);
                }
            }
            println!("{prefix}{line}");
            if line.contains(gdrvm_model::TRIPLE_FAULT_LINE) {
                report_shutdowns(&prefix);
            }
        }
    })
}

/// A job's process held still (SIGSTOP) while its VM's counters are read at the first KTAP
/// line, and let go (SIGCONT) when dropped, so that the totals and the histograms by reason
/// and site describe the same moment. Read while the guest ran on, the histograms, slow
/// to read under TCG, took in part of what came after the line: a guest with nothing to
/// run powers off at once, and its power-off clears the IOAPIC pin by pin (about a hundred
/// exits that then showed as the boot's). Stopping kicks each vCPU running in the guest
/// out of it, one exit each, counted with the rest.
struct Held(u32);

impl Held {
    /// How long the process's threads get to stop; the counters are read then anyway.
    const PATIENCE: Duration = Duration::from_millis(200);

    fn stop(pid: u32) -> Held {
        // SAFETY: kill touches no memory of ours. `pid` is the job's child, which held a VM
        // a moment ago (`holds_vm`): its VM goes only when it exits, and it is reaped after.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        let deadline = Instant::now() + Held::PATIENCE;
        while !all_threads_stopped(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        Held(pid)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: as in `stop`; a process that ended meanwhile ignores it.
        unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGCONT) };
    }
}

/// Whether process `pid` holds a KVM VM, by KVM's debugfs directories (`<pid>-<fd>`).
fn holds_vm(pid: u32) -> bool {
    let prefix = format!("{pid}-");
    std::fs::read_dir(DEBUGFS_KVM)
        .map(|dir| dir.flatten().any(|e| e.file_name().to_string_lossy().starts_with(&prefix)))
        .unwrap_or(false)
}

/// Whether every thread of process `pid` is stopped (state `T`), by `/proc`; false when
/// that cannot be read.
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return false };
    tasks.flatten().all(|t| {
        std::fs::read_to_string(t.path().join("stat"))
            .ok()
            .and_then(|stat| stat.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('T')))
            .unwrap_or(false)
    })
}

/// L1's own kernel symbols, read once: a guest booted from the same vmlinux runs at the
/// same addresses. None where kallsyms hides them.
fn l1_symbols() -> Option<&'static SymbolMap> {
    static MAP: std::sync::OnceLock<Option<SymbolMap>> = std::sync::OnceLock::new();
    MAP.get_or_init(|| match SymbolMap::load(Path::new("/proc/kallsyms")) {
        Ok(map) if !map.is_empty() => Some(map),
        Ok(_) => {
            println!("# gdrvm-l1: /proc/kallsyms shows no addresses: exit sites stay addresses");
            None
        }
        Err(e) => {
            println!("# gdrvm-l1: cannot read /proc/kallsyms, exit sites stay addresses: {e}");
            None
        }
    })
    .as_ref()
}

/// Prints KVM's record of the guests' shutdowns since the last look, on the job's output.
fn report_shutdowns(prefix: &str) {
    // The VMM logs the exit after KVM recorded it; the trace file is read as it stands
    // (empty when the line came again, as a cluster's summary repeats a node's last lines).
    match Shutdown::take(Path::new(TRACEFS)) {
        Ok(all) => {
            for s in all {
                println!("{prefix}L1: KVM: {}", s.describe());
            }
        }
        Err(e) => println!("{prefix}L1: cannot read KVM's record of the shutdown: {e}"),
    }
}

fn run_relayed(i: usize, job: &L1Job, reasons: Option<Vendor>) -> std::io::Result<Option<i32>> {
    let started = Instant::now();
    let mut child = command(job).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let pid = child.id();
    let relays: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| relay(i, s, Some(FirstKtap { started, pid, reasons, l1_kernel: job.guest_runs_l1_kernel }))),
        child.stderr.take().map(|s| relay(i, s, None)),
    ]
    .into_iter()
    .flatten()
    .collect();
    let result = wait_with_deadline(&mut child, Duration::from_secs(job.timeout_secs));
    // Whatever the job started must have ended with it (a VMM's device emulators): report
    // and kill what did not, before waiting for the relays its pipes would hold open.
    let prefix = job_output_prefix(i);
    let left = leftovers();
    for (pid, comm) in &left {
        println!("{prefix}{LEFT_BEHIND} pid {pid} ({comm})");
        // SAFETY: kill touches no memory of ours; `pid` is a process this agent outlives.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    // A process still there seconds after SIGKILL is stuck in the kernel, not leaked.
    let survivors = survivors_of(&left, SIGKILL_GRACE);
    if !survivors.is_empty() {
        let list: Vec<String> = survivors.iter().map(|(pid, comm)| format!("pid {pid} ({comm})")).collect();
        println!("{prefix}{SURVIVED_SIGKILL} {}", list.join(", "));
    }
    // Nor files: wire sockets and directories of a cluster, temporary files of a VMM.
    for path in leftover_files(Path::new(SCRATCH_DIR)) {
        println!("{prefix}{LEFT_BEHIND} file {}", path.display());
        let _ = std::fs::remove_dir_all(&path).or_else(|_| std::fs::remove_file(&path));
    }
    // The relays end when the job's pipes close; a job stuck past SIGKILL keeps them open,
    // so its relays are left running rather than waited for.
    if matches!(result, Ok(Some(_))) {
        for r in relays {
            let _ = r.join();
        }
    }
    result
}

/// How long processes killed with SIGKILL get to be gone.
const SIGKILL_GRACE: Duration = Duration::from_secs(5);

/// Those of `killed` still running after up to `grace`.
fn survivors_of(killed: &[(i32, String)], grace: Duration) -> Vec<(i32, String)> {
    let until = Instant::now() + grace;
    loop {
        let now = leftovers();
        let still: Vec<(i32, String)> = killed.iter().filter(|k| now.contains(k)).cloned().collect();
        if still.is_empty() || Instant::now() >= until {
            return still;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Where L1's jobs may leave temporary files (empty before each job).
const SCRATCH_DIR: &str = "/tmp";

/// What sits in `dir` (L1 keeps nothing there between jobs).
fn leftover_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir).into_iter().flatten().filter_map(|e| Some(e.ok()?.path())).collect();
    found.sort();
    found
}

/// User processes other than this agent (L1 runs nothing else between jobs): pid and
/// command name. Kernel threads (no command line) and zombies are not counted.
fn leftovers() -> Vec<(i32, String)> {
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut found: Vec<(i32, String)> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| !c.is_empty()))
        .filter_map(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
            Some((i32::try_from(pid).ok()?, comm.trim().to_owned()))
        })
        .collect();
    found.sort();
    found
}

fn wait_with_deadline(child: &mut Child, timeout: Duration) -> std::io::Result<Option<i32>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(code(status)));
        }
        if Instant::now() >= deadline {
            report_stuck(child.id());
            // SIGTERM first: gdrvm stops its VM cleanly; SIGKILL if it does not.
            // SAFETY: signals a child we own and have not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            std::thread::sleep(Duration::from_secs(2));
            let _ = child.kill();
            // A thread stuck in the kernel can outlive SIGKILL: do not wait for it forever.
            let gone = Instant::now() + Duration::from_secs(10);
            while child.try_wait()?.is_none() && Instant::now() < gone {
                std::thread::sleep(Duration::from_millis(100));
            }
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Prints where each thread of a job that ran past its timeout is: name, state, kernel wait
/// channel and kernel stack, for the report of a hang.
fn report_stuck(pid: u32) {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().filter_map(Result::ok);
    for task in tasks {
        let path = task.path();
        let read = |f: &str| std::fs::read_to_string(path.join(f)).unwrap_or_default();
        let state = read("stat").rsplit(')').next().unwrap_or("").split_whitespace().next().unwrap_or("?").to_owned();
        println!(
            "{MARKER}stuck task {} ({}) state {state} wchan {}",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim()
        );
        for line in read("stack").lines().take(12) {
            println!("{MARKER}stuck   {line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_held_process_stops_while_held_and_runs_again_after() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        assert!(!all_threads_stopped(pid), "a sleeping process is not stopped");
        let held = Held::stop(pid);
        assert!(all_threads_stopped(pid), "held, the process stops within the patience");
        drop(held);
        let deadline = Instant::now() + Duration::from_secs(5);
        while all_threads_stopped(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!all_threads_stopped(pid), "let go, it runs again");
        assert!(child.try_wait().unwrap().is_none(), "stopping is not ending");
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!all_threads_stopped(pid), "a reaped process reads as not stopped");
    }
}
