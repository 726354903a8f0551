//! `profile`: where the guest's boot went, from the kernel's own log timestamps, so that
//! `cargo xtask bench boot --profile` can put gdrvm's and QEMU's boots side by side.
//! With `initcall_debug` (and a log buffer big enough to keep every line, such as
//! `log_buf_len=4M`) it lists the slowest initcalls; always, the milestones of the boot
//! and the longest silences in the log (a calibration loop, a probe timing out).
//!
//! Every figure is a diagnostic line prefixed [`LINE_PREFIX`]: `milestone SECONDS NAME`,
//! `initcall USECS FUNCTION`, `initcalls USECS COUNT` (their sum),
//! `gap SECONDS AT_SECONDS LINE` (the line that ended the silence) and `cpuflags N FLAG...`
//! (the CPU features Linux saw, N of them: a VMM that hides or adds one changes which code
//! the guest runs, such as its string copies).

use crate::context::Context;
use crate::ktap::{Check, Verdict};

/// Prefix of the diagnostic lines that carry the profile.
pub const LINE_PREFIX: &str = "profile| ";
/// How many of the slowest initcalls are listed.
const TOP_INITCALLS: usize = 20;
/// How many of the longest silences are listed.
const TOP_GAPS: usize = 8;

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
    vec![milestones(&lines, uptime), initcalls(&lines), gaps(&lines), cpu_flags(&cpuinfo)]
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

fn milestones(lines: &[LogLine], uptime: Option<f64>) -> Check {
    let mut check = Check::new("milestones", Verdict::Pass);
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
    }

    #[test]
    fn test_reports_milestones_initcalls_and_gaps() {
        let lines = parse_log(LOG);
        let m = milestones(&lines, Some(1.5));
        assert!(m.diagnostics.contains(&"profile| milestone 1.210 init started".to_owned()), "{:?}", m.diagnostics);
        assert!(m.diagnostics.contains(&"profile| milestone 1.500 agent profiling".to_owned()));
        let i = initcalls(&lines);
        assert_eq!(i.diagnostics[0], "profile| initcalls 780129 3");
        assert_eq!(i.diagnostics[1], "profile| initcall 780000 i8042_init");
        let g = gaps(&lines);
        assert!(g.diagnostics[0].starts_with("profile| gap 0.800 0.900 initcall i8042_init"), "{:?}", g.diagnostics);
        assert!(matches!(initcalls(&lines[..2]).verdict, Verdict::Skip(_)));
    }

    #[test]
    fn test_lists_the_first_cpus_flags_sorted() {
        let cpuinfo = "processor\t: 0\nflags\t\t: fpu sse2 erms avx\n\nprocessor\t: 1\nflags\t\t: fpu\n";
        assert_eq!(cpu_flags(cpuinfo).diagnostics, vec!["profile| cpuflags 4 avx erms fpu sse2".to_owned()]);
        assert!(matches!(cpu_flags("processor\t: 0\n").verdict, Verdict::Skip(_)));
    }
}
