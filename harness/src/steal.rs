//! Steal time: how long the hypervisor under this machine ran something else while this
//! machine's CPUs had work (`/proc/stat`'s eighth CPU field). On a shared cloud machine it
//! comes in bursts that make one boot take two or three times as long as the next, which
//! no pairing of runs cancels; a benchmark shows it beside each time, so that a slow run
//! can be told from a slow VMM.
//!
//! Written by hand: reading one line of `/proc/stat` needs no crate.

use std::time::Duration;

/// The host's steal counter at one moment, summed over its CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StealClock {
    ticks: u64,
}

impl StealClock {
    /// The counter now; `None` where `/proc/stat` cannot be read or has no steal field
    /// (Linux before 2.6.11).
    pub(crate) fn now() -> Option<StealClock> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        Some(StealClock { ticks: steal_ticks(&stat)? })
    }

    /// CPU time stolen from all of this machine's CPUs together since `self`.
    pub(crate) fn elapsed(&self) -> Option<Duration> {
        let now = StealClock::now()?;
        Some(ticks_to_duration(now.ticks.saturating_sub(self.ticks)))
    }
}

/// The steal field of the summary `cpu` line of a `/proc/stat` text, in clock ticks.
fn steal_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.split_whitespace().next() == Some("cpu"))?;
    // cpu user nice system idle iowait irq softirq steal ...
    line.split_whitespace().nth(8)?.parse().ok()
}

/// `ticks` of the kernel's `USER_HZ` clock as a duration.
fn ticks_to_duration(ticks: u64) -> Duration {
    // SAFETY: sysconf reads a constant of the C library; it touches no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    Duration::from_micros(ticks.saturating_mul(1_000_000) / hz)
}

/// How many CPUs this machine has online (what a steal total is spread over).
pub fn host_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_steal_is_the_eighth_field_of_the_summary_line() {
        let stat = "cpu  2148518 337 156376 1779588 7431 0 44740 64697 1 0\n\
                    cpu0 1074259 168 78188 889794 3715 0 22370 32348 0 0\n\
                    intr 12345\n";
        assert_eq!(steal_ticks(stat), Some(64697));
        assert_eq!(steal_ticks("cpu  1 2 3 4\n"), None, "no steal field");
        assert_eq!(steal_ticks("cpu0 1 2 3 4 5 6 7 8\n"), None, "no summary line");
    }

    #[test]
    fn test_this_machine_reads_its_steal_clock() {
        // Every Linux gdrvm runs on (2.6.11 on) has the field.
        let then = StealClock::now().expect("/proc/stat's steal field");
        assert!(then.elapsed().is_some());
    }
}
