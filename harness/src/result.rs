//! What a VM produced: its outcome, console, KTAP, figures, and what L1 went through
//! while running it; `git bisect run` exit codes.

use std::time::Duration;

use gdrvm_model::kvm_exits::{ExitReasons, KvmExits};

use crate::ktap::{self, KtapReport};
use crate::oops::{self, Oops};

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
/// What gdrvm logs when the guest triple-faults (vmm/src/vcpu.rs).
const TRIPLE_FAULT: &str = gdrvm_model::TRIPLE_FAULT_LINE;
/// Console lines kept for a panic or hang report.
pub const TAIL_LINES: usize = 40;

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
    /// CPU time the hypervisor under this machine took from all its CPUs together
    /// ([`crate::host_cpus`]) over [`Self::time_to_ktap`], where `/proc/stat` tells it.
    pub host_steal: Option<Duration>,
    /// The exits KVM counted for the VM until its first KTAP line, where the kernel's
    /// counters could be read (debugfs, as root).
    pub kvm_exits: Option<KvmExits>,
    /// The exits by reason and MSR accesses until the first KTAP line, where KVM's
    /// tracepoints could be read (nested runs, where L1 runs one job at a time).
    pub exit_reasons: Option<ExitReasons>,
    /// Figures gdrvm reported about itself (`--stats`).
    pub stats: Option<GdrvmStats>,
    /// L1 failures while this VM ran (nested runs); the VM ran again in a fresh L1 after
    /// the first, and this result is that run's.
    pub l1_incidents: Vec<L1Incident>,
    /// Runs of this VM before this one that reset before printing anything (nested runs
    /// run such a guest again, up to twice).
    pub emulator_losses: u32,
}

/// How an L1 failed to finish its jobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum L1Failure {
    /// L1's kernel panicked (or oopsed and QEMU went away).
    Panic,
    /// L1's kernel oopsed during the job and carried on.
    Oops,
    /// L1 stopped answering: a job overran its timeout with no word from L1's agent.
    Stall,
    /// QEMU exited before L1's agent said it was done, with nothing on the console to say why.
    Exit,
    /// L1 did not get ready (boot and KVM) within its budget.
    Boot,
}

/// One L1 failure: what, during which job, its oops signature, and the L1 console lines
/// around it (enough to name the process: the oops, its registers and trace, the tail).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct L1Incident {
    /// What happened.
    pub failure: L1Failure,
    /// Seconds after L1 started.
    pub after_secs: f64,
    /// L1's first oops, if it printed one.
    pub oops: Option<Oops>,
    /// L1 console lines kept for the report.
    pub console: Vec<String>,
}

impl L1Incident {
    /// One line: the failure, when, and the oops signature.
    pub fn summary(&self) -> String {
        format!(
            "L1 {:?} {:.0} s after boot{}",
            self.failure,
            self.after_secs,
            self.oops.as_ref().map(|o| format!(": {}", o.signature())).unwrap_or_default()
        )
    }
}

/// What `gdrvm run --stats` reports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
pub struct GdrvmStats {
    /// Process start to the boot CPU's first KVM_RUN, in µs.
    pub setup_us: Option<u64>,
    /// That time by phase, in order: name and µs.
    #[serde(default)]
    pub phases: Vec<(String, u64)>,
    /// Resident memory beyond guest RAM, in KiB.
    pub rss_beyond_guest_kib: Option<u64>,
    /// Guest configuration writes passed-through devices' firewalls dropped.
    #[serde(default)]
    pub dropped_config_writes: u64,
    /// Functions whose configuration space KVM maps read-only, so only writes exit.
    #[serde(default)]
    pub config_images: u64,
    /// Exits the VMM served, to the end of the run.
    #[serde(default)]
    pub vmm_exits: u64,
    /// The most frequent of them by kind and device (`pio 0x3f8 (COM1)`), with counts.
    #[serde(default)]
    pub vmm_exit_kinds: Vec<(String, u64)>,
}

/// Prefix of gdrvm's stats line on stderr.
const STATS_PREFIX: &str = "gdrvm-stats: ";

impl VmResult {
    /// The result of a run named `name` that ended as `outcome` after `elapsed`, its KTAP,
    /// panic and gdrvm's stats read from `console`; the runner adds the rest.
    pub fn new(name: &str, outcome: VmOutcome, console: Vec<String>, elapsed: Duration) -> Self {
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
            host_steal: None,
            kvm_exits: None,
            exit_reasons: None,
            stats,
            l1_incidents: Vec::new(),
            emulator_losses: 0,
        }
    }

    /// The guest kernel's first oops, if it had one.
    pub fn oops(&self) -> Option<Oops> {
        oops::find(&self.console)
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
            VmOutcome::TimedOut if self.panicked => Some(format!(
                "the guest kernel panicked and did not reset within {:.0?}{}",
                self.elapsed,
                self.oops_signature()
            )),
            _ if self.panicked => Some(format!("the guest kernel panicked{}", self.oops_signature())),
            VmOutcome::Exited(0) if self.ktap.complete() => None,
            VmOutcome::Exited(0) => Some("the guest exited without a complete KTAP report".into()),
            VmOutcome::Exited(1) if self.ktap.complete() => None,
            VmOutcome::Exited(code) => Some(format!("the VMM exited with status {code}{}", self.last_error())),
            VmOutcome::TimedOut => Some(format!("the guest hung: no exit within {:.0?}", self.elapsed)),
            VmOutcome::CannotRun(why) => Some(format!("could not run: {why}")),
        }
    }

    /// ": " and the signature of the guest's first oops (first line, task, RIP), which is
    /// all a one-line verdict such as a bisect step's can keep of the console; empty when
    /// the console shows none.
    fn oops_signature(&self) -> String {
        self.oops().map(|o| format!(": {}", o.signature())).unwrap_or_default()
    }

    fn last_error(&self) -> String {
        self.console
            .iter()
            .rev()
            .find(|l| l.starts_with("gdrvm: error:"))
            .map(|l| format!(" ({l})"))
            .unwrap_or_default()
    }

    /// The guest was lost the way nested runs under QEMU TCG lose one now and then, not by
    /// anything it did: it reset (gdrvm exit 1, no status) with no kernel panic, either
    /// before the agent printed anything or by a triple fault the VMM saw (its CPU state
    /// went bad with no oops: early in boot, and under heavy interrupt traffic), or its
    /// kernel died of page faults recursing in the exception entry code
    /// ([`Oops::is_entry_fault_recursion`]) or of an exception frame no CPU pushes
    /// ([`Oops::has_impossible_frame`]). The nested runner runs such a guest again and
    /// keeps each earlier run's end; a guest that really does this does it again.
    ///
    /// So does a guest that exited 0 with its report cut short, once the agent spoke or
    /// after a triple fault: the agent powers off only after its whole report.
    ///
    /// In a cluster run (consoles prefixed `[node] `), one node's guest doing so counts too.
    /// A job that hung with processes L1 could not kill (stuck in L1's kernel) counts too,
    /// and so does any guest, whatever its end, whose kernel faulted inside the exception
    /// entry code ([`oops::faulted_in_entry_code`]): one that went on after it may have
    /// passed with that oops cut into a suite's output.
    pub fn lost_to_emulator(&self) -> bool {
        if self.console.iter().any(|l| oops::faulted_in_entry_code(l)) {
            return true;
        }
        if self.outcome == VmOutcome::TimedOut {
            return !self.panicked
                && self.console.iter().any(|l| l.contains(gdrvm_model::l1::SURVIVED_SIGKILL) || halted_for_good(l));
        }
        let triple = |line: &str| line.contains(TRIPLE_FAULT);
        if self.outcome == VmOutcome::Exited(0) {
            // The agent powers the guest off only after its whole report, so a report cut
            // short with exit 0 is a guest stopped under it: the emulator lost it after the
            // agent reported its status (a triple fault; gdrvm exits with the status) or a
            // vCPU halted for good (gdrvm takes that for a power-off).
            let spoke = self.time_to_ktap.is_some();
            return !self.panicked && !self.ktap.complete() && (spoke || self.console.iter().any(|l| triple(l)));
        }
        if self.outcome != VmOutcome::Exited(1) {
            return false;
        }
        let emulator_oops = |lines: &[String]| {
            oops::find(lines).is_some_and(|o| o.is_entry_fault_recursion() || o.has_impossible_frame())
        };
        if !self.panicked && (self.time_to_ktap.is_none() || self.console.iter().any(|l| triple(l))) {
            return true;
        }
        if emulator_oops(&self.console) {
            return true;
        }
        #[derive(Default)]
        struct Node {
            reset: bool,
            spoke: bool,
            panicked: bool,
            triple: bool,
            console: Vec<String>,
        }
        let mut nodes: std::collections::BTreeMap<&str, Node> = Default::default();
        for line in &self.console {
            let Some((node, rest)) = line.strip_prefix('[').and_then(|l| l.split_once("] ")) else { continue };
            if node.is_empty() || !node.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
                continue;
            }
            let n = nodes.entry(node).or_default();
            n.reset |= rest == gdrvm_model::GUEST_RESET_LINE;
            n.spoke |= rest.trim_start() == "KTAP version 1";
            n.panicked |= rest.contains(PANIC_MARKER);
            n.triple |= triple(rest);
            n.console.push(rest.to_owned());
        }
        nodes.values().any(|n| n.reset && ((!n.panicked && (!n.spoke || n.triple)) || emulator_oops(&n.console)))
    }

    /// The last [`TAIL_LINES`] console lines.
    pub fn tail(&self) -> &[String] {
        &self.console[self.console.len().saturating_sub(TAIL_LINES)..]
    }
}

/// Whether `line` is gdrvm's word, as the harness stopped a hung guest, that a vCPU sat in
/// HLT with interrupts off: a CPU waiting for a paravirtual spinlock kick, which only the
/// lock's releaser sends. On 2026-12-03 a nested vela guest hung so for 150 s, vCPU 0
/// halted waiting for its kick while vCPU 3 spun with interrupts off: a kick lost in
/// nested KVM under TCG. A guest that deadlocks so by itself does it again on its reruns.
fn halted_for_good(line: &str) -> bool {
    line.contains(gdrvm_model::VCPU_STATE_LINE)
        && line.contains(gdrvm_model::VCPU_IRQS_OFF)
        && line.contains(gdrvm_model::VCPU_HALTED)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(outcome: VmOutcome, console: &str) -> VmResult {
        VmResult::new("t", outcome, console.lines().map(str::to_owned).collect(), Duration::from_secs(1))
    }

    const PASSING: &str = "KTAP version 1\n1..1\n    1..1\n    ok 1 a\nok 1 smoke";

    #[test]
    fn test_a_triple_fault_without_a_panic_counts_at_any_point() {
        let mut single =
            result(VmOutcome::Exited(1), "KTAP version 1\n WARN gdrvm::vcpu: triple fault: the guest resets id=0");
        single.time_to_ktap = Some(Duration::from_secs(9));
        assert!(single.lost_to_emulator());
        let mut cluster = result(
            VmOutcome::Exited(1),
            "[a] KTAP version 1\n[a] # tcp_stream\n[a] WARN gdrvm::vcpu: triple fault: the guest resets id=0\n\
             [a] gdrvm: the guest reset without reporting a status\n[b] KTAP version 1\nKTAP version 1",
        );
        cluster.time_to_ktap = Some(Duration::from_secs(9));
        assert!(cluster.lost_to_emulator());
        // A kernel panic first is the guest's own failure.
        let console =
            cluster.console.join("\n").replacen("[a] # tcp_stream", "[a] Kernel panic - not syncing: oops", 1);
        let mut panicked = result(VmOutcome::Exited(1), &console);
        panicked.time_to_ktap = Some(Duration::from_secs(9));
        assert!(!panicked.lost_to_emulator());
    }

    #[test]
    fn test_entry_fault_recursion_is_lost_to_the_emulator_other_panics_are_not() {
        let died = "KTAP version 1\n\
                    [   24.2] BUG: stack guard page was hit at 00000000a1b2c3d4 (stack is 1..2)\n\
                    [   24.2] kernel stack overflow (double-fault): 0000 [#1] PREEMPT SMP NOPTI\n\
                    [   24.2] RIP: 0010:error_entry+0x1e/0x130\n\
                    [   24.2] Kernel panic - not syncing: Fatal exception in interrupt\n\
                    gdrvm: the guest reset without reporting a status";
        let mut single = result(VmOutcome::Exited(1), died);
        single.time_to_ktap = Some(Duration::from_secs(9));
        assert!(single.lost_to_emulator());
        let node_b = died.lines().map(|l| format!("[b] {l}")).collect::<Vec<_>>().join("\n");
        let mut cluster = result(VmOutcome::Exited(1), &format!("[a] KTAP version 1\n{node_b}\nKTAP version 1"));
        cluster.time_to_ktap = Some(Duration::from_secs(9));
        assert!(cluster.lost_to_emulator());
        let own = result(VmOutcome::Exited(1), &died.replace("error_entry+0x1e", "do_sys_poll+0x1e"));
        assert!(!own.lost_to_emulator());
    }

    #[test]
    fn test_a_triple_fault_cutting_a_reported_pass_short_is_lost_to_the_emulator() {
        // CI's bisect test on 2026-12-04: the agent reported status 0, vCPU 1 then
        // triple-faulted delivering its timer interrupt, and the report ended mid-line.
        let cut = "\x1b[33m WARN\x1b[0m gdrvm::vcpu: triple fault: the guest resets id=1\n\
                   L1: KVM: vCPU thread vcpu1-108 shut down at rip 0xffffffff8117091a delivering interrupt vector 0xec\n\
                   KTAP version 1\n1..1\n    KTAP version 1\n    # Subtest: drivers\n    1..2\n    \
                   ok 1 gdrvm_drv_loaded\n    ok";
        let mut r = result(VmOutcome::Exited(0), cut);
        r.time_to_ktap = Some(Duration::from_secs(3));
        assert!(r.lost_to_emulator());
        // A complete report, or no triple fault, is the guest's own result.
        let complete = format!("{cut} 2 gdrvm_drv_bound\nok 1 drivers");
        assert!(!result(VmOutcome::Exited(0), &complete).lost_to_emulator());
        // Without the triple fault, a report the agent began and never finished counts too
        // (CI's matrix, 2026-12-04: a vela guest exited 0 mid-report), silence does not.
        let quiet = cut.replace("triple fault", "note");
        assert!(!result(VmOutcome::Exited(0), &quiet).lost_to_emulator());
        let mut began = result(VmOutcome::Exited(0), &quiet);
        began.time_to_ktap = Some(Duration::from_secs(3));
        assert!(began.lost_to_emulator());
    }

    #[test]
    fn test_a_panic_on_a_frame_with_the_null_code_segment_is_lost_to_the_emulator() {
        // CI's flat guest on 2026-12-04, mid capture suite.
        let died = "KTAP version 1\n    # capture| kind = \"gpu\"\n\
                    [    9.382521] Bad pagetable: fcc8 [#1] PREEMPT SMP NOPTI\n\
                    [    9.382521] RIP: 0000:0xffff88800517ca00\n\
                    [    9.382521] Kernel panic - not syncing: Fatal exception in interrupt\n\
                    gdrvm: the guest reset without reporting a status";
        let mut flat = result(VmOutcome::Exited(1), died);
        flat.time_to_ktap = Some(Duration::from_secs(9));
        flat.panicked = true;
        assert!(flat.lost_to_emulator());
        let mut own = result(VmOutcome::Exited(1), &died.replace("RIP: 0000:", "RIP: 0010:"));
        own.time_to_ktap = Some(Duration::from_secs(9));
        own.panicked = true;
        assert!(!own.lost_to_emulator());
    }

    #[test]
    fn test_a_fault_in_entry_code_is_lost_to_the_emulator_whatever_the_end() {
        // The vela guest of 2026-12-03: an idle CPU oopsed in error_entry, the agent went
        // on and the guest exited 0, with the oops cut into the capture suite's output.
        let spliced = "KTAP version 1\n# subsystem = [0x1[   13.931881] RIP: 0010:error_entry+0xd/0x130\nok 1 capture";
        for outcome in [VmOutcome::Exited(0), VmOutcome::Exited(1), VmOutcome::TimedOut] {
            assert!(result(outcome.clone(), spliced).lost_to_emulator(), "{outcome:?}");
        }
        let cluster = spliced.lines().map(|l| format!("[a] {l}")).collect::<Vec<_>>().join("\n");
        assert!(result(VmOutcome::Exited(0), &cluster).lost_to_emulator());
        assert!(!result(VmOutcome::Exited(0), PASSING).lost_to_emulator());
    }

    #[test]
    fn test_a_hang_counts_only_when_l1_could_not_kill_the_job_or_a_cpu_waits_for_a_kick() {
        let hung = "[a] # rdma: pairing with b\ngdrvm-l1: left behind by the job: pid 240 (gdrvm)";
        assert!(!result(VmOutcome::TimedOut, hung).lost_to_emulator());
        let stuck = format!("{hung}\n{} pid 240 (gdrvm)", gdrvm_model::l1::SURVIVED_SIGKILL);
        assert!(result(VmOutcome::TimedOut, &stuck).lost_to_emulator());
        // The vela hang of 2026-12-03, as gdrvm said it (tracing's fields after the text).
        let waiting = "    ok 53 nccl_03:00.0_04:00.0\n\
            WARN gdrvm::vcpu: vCPU state at the stop: rip 0xffffffff81a592fa ring 0 rsp 0xffffc90000003e70 \
            rflags 0x46 (interrupts off) cr3 0x2a10000, halted id=0\n\
            WARN gdrvm::vcpu: vCPU state at the stop: rip 0xffffffff81a5a45e ring 0 rsp 0xffffc900002d4b50 \
            rflags 0x46 (interrupts off) cr3 0x2a10000 id=3";
        assert!(result(VmOutcome::TimedOut, waiting).lost_to_emulator());
        // Halted with interrupts on is an idle CPU; a guest whose CPUs all idle hung itself.
        let idle = waiting
            .replace("0x46 (interrupts off) cr3 0x2a10000, halted", "0x246 (interrupts on) cr3 0x2a10000, halted");
        assert!(!result(VmOutcome::TimedOut, &idle).lost_to_emulator());
        let mut panicked = result(VmOutcome::TimedOut, waiting);
        panicked.panicked = true;
        assert!(!panicked.lost_to_emulator(), "a panic's CPUs halt so too");
    }

    #[test]
    fn test_silent_reset_only_without_output_or_panic() {
        assert!(result(VmOutcome::Exited(1), "gdrvm: the guest reset without reporting a status").lost_to_emulator());
        // A cluster: node b vanished before its agent spoke, node a reported.
        let mut cluster = result(
            VmOutcome::Exited(1),
            "[a] KTAP version 1\n[a] ok 1 rdma\n[b] gdrvm: the guest reset without reporting a status\nKTAP version 1",
        );
        cluster.time_to_ktap = Some(Duration::from_secs(9));
        assert!(cluster.lost_to_emulator());
        // ...but a node that reset after its agent spoke failed for real.
        cluster.console.insert(0, "[b] KTAP version 1".into());
        assert!(!cluster.lost_to_emulator());
        let panicked = "Kernel panic - not syncing: VFS: Unable to mount root fs\ngdrvm: the guest reset";
        assert!(!result(VmOutcome::Exited(1), panicked).lost_to_emulator());
        assert!(!result(VmOutcome::Exited(0), "").lost_to_emulator());
        let mut spoke = result(VmOutcome::Exited(1), "KTAP version 1");
        spoke.time_to_ktap = Some(Duration::from_secs(9));
        assert!(!spoke.lost_to_emulator());
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
    fn test_panic_detected_and_tail_kept() {
        let mut console: Vec<String> = (0..100).map(|i| format!("line {i}")).collect();
        console.push("[    1.2] Kernel panic - not syncing: VFS: Unable to mount root fs".into());
        let r = VmResult::new("t", VmOutcome::Exited(1), console.clone(), Duration::ZERO);
        assert!(r.panicked);
        assert_eq!(r.outcome, VmOutcome::Exited(1));
        assert_eq!(r.exit_code(), exit::FAIL);
        assert_eq!(
            r.problem().as_deref(),
            Some("the guest kernel panicked: Kernel panic - not syncing: VFS: Unable to mount root fs")
        );
        let hung = VmResult::new("t", VmOutcome::TimedOut, console, Duration::from_secs(300));
        assert!(hung.problem().unwrap().contains("did not reset"), "{:?}", hung.problem());
        assert_eq!(r.tail().len(), TAIL_LINES);
        assert!(r.tail().last().unwrap().contains("Kernel panic"));
        let err = result(VmOutcome::Exited(125), "gdrvm: error: kernel 'x' cannot be read: No such file");
        assert!(err.problem().unwrap().contains("cannot be read"));
    }
}
