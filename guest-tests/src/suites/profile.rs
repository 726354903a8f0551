//! `profile`: where the guest's boot went, from the kernel's own log timestamps, so that
//! `cargo xtask bench boot --profile` can put gdrvm's and QEMU's boots side by side.
//! With `initcall_debug` (and a log buffer big enough to keep every line, such as
//! `log_buf_len=4M`) it lists the slowest initcalls; always, the milestones of the boot
//! and the longest silences in the log (a calibration loop, a probe timing out).
//!
//! Times are the kernel's clock (the log's timestamps, `initcall_debug`'s durations,
//! uptime), which nested can fall behind real time during the boot: by the agent's start
//! it read 1.28 s where the guest's TSC, which kept pace with L1's own trace clock, read
//! 1.53 s since the same moment. Compare them across VMMs on one machine, not with wall time.
//!
//! Every figure is a diagnostic line prefixed [`LINE_PREFIX`]: `milestone SECONDS NAME`,
//! `initcall USECS FUNCTION`, `initcalls USECS COUNT` (their sum), `interrupts N SOURCE`,
//! `gap SECONDS AT_SECONDS LINE` (the line that ended the silence) and `cpuflags N FLAG...`
//! (the CPU features Linux saw, N of them: a VMM that hides or adds one changes which code
//! the guest runs, such as its string copies).

use crate::context::Context;
use crate::ktap::{Check, Verdict};

/// Prefix of the diagnostic lines that carry the profile.
pub const LINE_PREFIX: &str = "profile| ";
/// How many of the slowest initcalls are listed.
const TOP_INITCALLS: usize = 40;
/// How many of the longest silences are listed.
const TOP_GAPS: usize = 8;
/// How many interrupt sources are listed.
const TOP_INTERRUPTS: usize = 10;

/// Log lines that mark a stage of the boot, with the milestone's name.
const MILESTONES: [(&str, &str); 11] = [
    ("Linux version", "kernel start"),
    ("tsc: Refined TSC", "TSC refined"),
    ("ACPI: Interpreter enabled", "ACPI up"),
    ("PCI host bridge to bus", "PCI scan start"),
    // Linux 6.1 says the first with CONFIG_BLK_DEV_RAM, the second without.
    ("Trying to unpack rootfs image as initramfs", "initramfs unpack start"),
    ("Unpacking initramfs", "initramfs unpack start"),
    ("Freeing initrd memory", "initramfs unpacked"),
    ("Freeing unused kernel image", "kernel init done"),
    ("Run /init as init process", "init started"),
    (crate::init::MARK_STARTED, "agent started"),
    (crate::init::MARK_MODULES, "agent modules loaded"),
];

pub fn run(_ctx: &Context) -> Vec<Check> {
    let log = match crate::sys::kernel_log() {
        Ok(log) => log,
        Err(e) => return vec![Check::new("kernel_log", Verdict::Fail(format!("cannot read the kernel log: {e}")))],
    };
    let uptime =
        std::fs::read_to_string("/proc/uptime").ok().and_then(|u| u.split_whitespace().next()?.parse::<f64>().ok());
    let lines = parse_log(&log);
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let interrupts = std::fs::read_to_string("/proc/interrupts").unwrap_or_default();
    vec![
        milestones(&lines, uptime),
        initcalls(&lines),
        gaps(&lines),
        cpu_flags(&cpuinfo),
        interrupt_counts(&interrupts),
    ]
}

/// Each interrupt source of `/proc/interrupts` with its count summed over the CPUs, the
/// largest first: the local timer (`LOC`) and the IPIs by kind (`RES` rescheduling, `CAL`
/// function calls, `TLB` shootdowns) are most of a guest's exits that depend on time,
/// and which of them a boot sends says where to cut.
fn interrupt_counts(text: &str) -> Check {
    let mut lines = text.lines();
    let cpus = lines.next().map_or(0, |header| header.split_whitespace().count());
    let mut counts: Vec<(String, u64)> = lines
        .filter_map(|line| {
            let (name, rest) = line.split_once(':')?;
            let total = rest.split_whitespace().take(cpus).map_while(|w| w.parse::<u64>().ok()).sum::<u64>();
            (total > 0).then(|| (name.trim().to_owned(), total))
        })
        .collect();
    if counts.is_empty() {
        return Check::new("interrupts", Verdict::Skip("/proc/interrupts has no counts".into()));
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut check = Check::new("interrupts", Verdict::Pass);
    for (name, n) in counts.into_iter().take(TOP_INTERRUPTS) {
        check = check.note(format!("{LINE_PREFIX}interrupts {n} {name}"));
    }
    check
}

/// Seconds from the vCPUs' start to the start of the kernel's clock (0 in the log's
/// timestamps), from the line kvm-clock logs as it takes over the kernel's clock: its
/// reading then, in nanoseconds (Linux calls them cycles), since KVM's clock was 0, which
/// QEMU and gdrvm set as the VM starts running. That is the firmware's time and the
/// kernel's first steps, on the hypervisor's clock. The guest's TSC cannot tell it: the
/// TSC is true, but the kernel's clock it would be set against can fall behind real time
/// while the guest boots nested (0.25 s by the agent's start, measured against L1's own
/// trace clock), so the two do not subtract.
fn kvm_clock_start(lines: &[LogLine]) -> Option<f64> {
    lines.iter().find_map(|l| {
        let ns: u64 =
            l.text.strip_prefix("kvm-clock: using sched offset of ")?.strip_suffix(" cycles")?.parse().ok()?;
        Some(ns as f64 / 1e9)
    })
}

/// The first CPU's `flags` line of `/proc/cpuinfo`, sorted.
fn cpu_flags(cpuinfo: &str) -> Check {
    let Some(flags) = cpuinfo.lines().find_map(|l| l.strip_prefix("flags")?.split_once(':').map(|(_, f)| f)) else {
        return Check::new("cpu_flags", Verdict::Skip("/proc/cpuinfo has no flags line".into()));
    };
    let mut flags: Vec<&str> = flags.split_whitespace().collect();
    flags.sort_unstable();
    Check::new("cpu_flags", Verdict::Pass).note(format!("{LINE_PREFIX}cpuflags {} {}", flags.len(), flags.join(" ")))
}

/// One timestamped kernel log line: seconds since boot and the text.
#[derive(Debug, Clone, PartialEq)]
struct LogLine<'a> {
    secs: f64,
    text: &'a str,
}

/// The timestamped lines of a `klogctl` dump (`<6>[    0.123456] text`).
fn parse_log(log: &str) -> Vec<LogLine<'_>> {
    log.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix('<').and_then(|l| l.split_once('>')).map_or(line, |(_, r)| r);
            let (stamp, text) = rest.strip_prefix('[')?.split_once(']')?;
            Some(LogLine { secs: stamp.trim().parse().ok()?, text: text.trim_start() })
        })
        .collect()
}

/// The milestones found in the log, and `uptime` as the agent's; first, in a KVM guest,
/// when its vCPUs started ([`kvm_clock_start`]): how long the VMM's firmware and the
/// kernel's start took before the log's first timestamp.
fn milestones(lines: &[LogLine], uptime: Option<f64>) -> Check {
    let mut check = Check::new("milestones", Verdict::Pass);
    if let Some(secs) = kvm_clock_start(lines) {
        check = check.note(format!("{LINE_PREFIX}milestone {:.3} vCPUs started (kvm-clock 0)", -secs));
    }
    for (marker, name) in MILESTONES {
        if let Some(line) = lines.iter().find(|l| l.text.contains(marker)) {
            check = check.note(format!("{LINE_PREFIX}milestone {:.3} {name}", line.secs));
        }
    }
    if let Some(up) = uptime {
        check = check.note(format!("{LINE_PREFIX}milestone {up:.3} agent profiling"));
    }
    check
}

/// `initcall FUNCTION returned N after USECS usecs` → (function, µs).
fn initcall(text: &str) -> Option<(&str, u64)> {
    let rest = text.strip_prefix("initcall ")?;
    let (function, rest) = rest.split_once(" returned ")?;
    let usecs = rest.split_once(" after ")?.1.strip_suffix(" usecs")?.trim().parse().ok()?;
    // `foo_init+0x0/0x60 [module]` → `foo_init [module]`.
    Some((function.split('+').next().unwrap_or(function), usecs))
}

fn initcalls(lines: &[LogLine]) -> Check {
    let mut calls: Vec<(&str, u64)> = lines.iter().filter_map(|l| initcall(l.text)).collect();
    if calls.is_empty() {
        return Check::new(
            "initcalls",
            Verdict::Skip("no initcall timings in the log (boot with initcall_debug log_buf_len=4M)".into()),
        );
    }
    let total: u64 = calls.iter().map(|c| c.1).sum();
    let mut check =
        Check::new("initcalls", Verdict::Pass).note(format!("{LINE_PREFIX}initcalls {total} {}", calls.len()));
    calls.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    for (function, usecs) in calls.into_iter().take(TOP_INITCALLS) {
        check = check.note(format!("{LINE_PREFIX}initcall {usecs} {function}"));
    }
    check
}

fn gaps(lines: &[LogLine]) -> Check {
    let mut gaps: Vec<(f64, &LogLine)> = lines.windows(2).map(|w| (w[1].secs - w[0].secs, &w[1])).collect();
    gaps.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut check = Check::new("log_gaps", Verdict::Pass);
    for (gap, line) in gaps.into_iter().take(TOP_GAPS) {
        let text: String = line.text.chars().take(100).collect();
        check = check.note(format!("{LINE_PREFIX}gap {gap:.3} {:.3} {text}", line.secs));
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "<5>[    0.000000] Linux version 6.1.0-28-amd64 (debian-kernel@lists.debian.org)\n\
        <6>[    0.020000] tsc: Refined TSC clocksource calibration: 2994.371 MHz\n\
        <7>[    0.100000] initcall pci_arch_init+0x0/0x60 returned 0 after 120 usecs\n\
        <7>[    0.900000] initcall i8042_init+0x0/0x440 returned 0 after 780000 usecs\n\
        <7>[    0.910000] initcall virtio_net_driver_init+0x0/0x90 [virtio_net] returned 0 after 9 usecs\n\
        <6>[    1.200000] Freeing unused kernel image (initmem) memory: 2960K\n\
        <6>[    1.210000] Run /init as init process\n\
        a line with no stamp\n";

    #[test]
    fn test_parses_stamps_and_initcalls() {
        let lines = parse_log(LOG);
        assert_eq!(lines.len(), 7);
        assert_eq!(lines[1], LogLine { secs: 0.02, text: "tsc: Refined TSC clocksource calibration: 2994.371 MHz" });
        assert_eq!(initcall(lines[3].text), Some(("i8042_init", 780000)));
        assert_eq!(initcall(lines[4].text), Some(("virtio_net_driver_init", 9)));
        assert_eq!(initcall("initcall broken"), None);
        let kvm = parse_log("<6>[    0.000000] kvm-clock: using sched offset of 118904117 cycles\n");
        assert_eq!(kvm_clock_start(&kvm), Some(0.118904117));
        assert_eq!(kvm_clock_start(&lines), None, "not a KVM guest");
    }

    #[test]
    fn test_reports_milestones_initcalls_and_gaps() {
        let lines = parse_log(LOG);
        let m = milestones(&lines, Some(1.5));
        assert!(m.diagnostics.contains(&"profile| milestone 1.210 init started".to_owned()), "{:?}", m.diagnostics);
        assert!(m.diagnostics.contains(&"profile| milestone 1.500 agent profiling".to_owned()));
        assert!(!m.diagnostics.iter().any(|d| d.contains("vCPUs started")), "not a KVM guest: {:?}", m.diagnostics);
        let kvm = format!("<6>[    0.000000] kvm-clock: using sched offset of 412600000 cycles\n{LOG}");
        let m = milestones(&parse_log(&kvm), Some(1.5));
        assert_eq!(m.diagnostics[0], "profile| milestone -0.413 vCPUs started (kvm-clock 0)");
        let i = initcalls(&lines);
        assert_eq!(i.diagnostics[0], "profile| initcalls 780129 3");
        assert_eq!(i.diagnostics[1], "profile| initcall 780000 i8042_init");
        let g = gaps(&lines);
        assert!(g.diagnostics[0].starts_with("profile| gap 0.800 0.900 initcall i8042_init"), "{:?}", g.diagnostics);
        assert!(matches!(initcalls(&lines[..2]).verdict, Verdict::Skip(_)));
    }

    #[test]
    fn test_counts_interrupts_over_the_cpus_largest_first() {
        let text = "           CPU0       CPU1       \n\
                      4:        120          0  IR-IO-APIC    4-edge      ttyS0\n\
                    LOC:       1500        310   Local timer interrupts\n\
                    RES:         40        160   Rescheduling interrupts\n\
                    TLB:          0          0   TLB shootdowns\n\
                    ERR:          0\n";
        let c = interrupt_counts(text);
        assert_eq!(
            c.diagnostics,
            ["profile| interrupts 1810 LOC", "profile| interrupts 200 RES", "profile| interrupts 120 4"]
        );
        assert!(matches!(interrupt_counts("").verdict, Verdict::Skip(_)));
    }

    #[test]
    fn test_lists_the_first_cpus_flags_sorted() {
        let cpuinfo = "processor\t: 0\nflags\t\t: fpu sse2 erms avx\n\nprocessor\t: 1\nflags\t\t: fpu\n";
        assert_eq!(cpu_flags(cpuinfo).diagnostics, vec!["profile| cpuflags 4 avx erms fpu sse2".to_owned()]);
        assert!(matches!(cpu_flags("processor\t: 0\n").verdict, Verdict::Skip(_)));
    }
}
