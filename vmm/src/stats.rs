//! What a run cost, for `gdrvm run --stats`: the phases of setup, and the exits that
//! reached the VMM by kind and by device (port I/O per port, MMIO per device range, HLT,
//! kicks). Each vCPU counts in a tally of its own (no shared cache line on the exit path)
//! and adds it to the VM's total as it leaves its loop.
//!
//! Exits KVM handles in the kernel (MSRs, the APIC, nested page faults) never reach the
//! VMM; the harness reads those from KVM's own counters (`gdrvm_model::kvm_exits`).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Setup's phases in order, each with how long it took.
#[derive(Debug, Clone)]
pub struct SetupPhases {
    last: Instant,
    /// Each phase's name and duration.
    pub phases: Vec<(&'static str, Duration)>,
}

impl SetupPhases {
    /// Phases timed from `started` (the process start, for the first one).
    pub fn new(started: Instant) -> Self {
        SetupPhases { last: started, phases: Vec::new() }
    }

    /// Ends phase `name` now.
    pub fn mark(&mut self, name: &'static str) {
        let now = Instant::now();
        self.phases.push((name, now.saturating_duration_since(self.last)));
        tracing::debug!(phase = name, took = ?now.saturating_duration_since(self.last), "setup");
        self.last = now;
    }

    /// Ends phase `name` at `at` (a moment another thread noted).
    pub fn end_at(&mut self, name: &'static str, at: Instant) {
        self.phases.push((name, at.saturating_duration_since(self.last)));
        self.last = at;
    }
}

use gdrvm_model::layout;

/// What an exit to the VMM was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExitKind {
    /// Port I/O at this port.
    Pio(u16),
    /// MMIO in the device range starting here, or (None) in no device's range.
    Mmio(Option<u64>),
    /// HLT with nothing to wake the vCPU.
    Hlt,
    /// KVM_RUN interrupted by a signal (the VMM kicking the vCPU).
    Interrupted,
    /// Anything else (shutdown, system events, entry failures).
    Other,
}

impl fmt::Display for ExitKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitKind::Pio(port) => {
                write!(f, "pio {port:#x}{}", port_name(*port).map(|n| format!(" ({n})")).unwrap_or_default())
            }
            ExitKind::Mmio(Some(base)) => {
                write!(f, "mmio {base:#x}{}", mmio_name(*base).map(|n| format!(" ({n})")).unwrap_or_default())
            }
            ExitKind::Mmio(None) => f.write_str("mmio unclaimed"),
            ExitKind::Hlt => f.write_str("hlt"),
            ExitKind::Interrupted => f.write_str("interrupted"),
            ExitKind::Other => f.write_str("other"),
        }
    }
}

/// The device behind a well-known port, for reports.
fn port_name(port: u16) -> Option<&'static str> {
    Some(match port {
        0x3f8..=0x3ff => "COM1",
        0x2f8..=0x2ff | 0x3e8..=0x3ef | 0x2e8..=0x2ef => "COM2-4",
        0x60 | 0x64 => "i8042",
        0x70 | 0x71 => "RTC/CMOS",
        0x40..=0x43 | 0x61 => "PIT",
        0x20 | 0x21 | 0xa0 | 0xa1 | 0x4d0 | 0x4d1 => "PIC",
        0x80 => "POST delay",
        0xcf8..=0xcff => "PCI type 1, absent",
        0x3b0..=0x3df => "VGA",
        0x3f0..=0x3f7 => "floppy",
        0x501 => "debug exit",
        _ => return None,
    })
}

/// The device behind a well-known MMIO range, for reports.
fn mmio_name(base: u64) -> Option<&'static str> {
    (layout::ECAM_BASE..layout::ECAM_BASE + layout::ECAM_SIZE).contains(&base).then_some("ECAM")
}

/// Exits counted by kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExitTally(BTreeMap<ExitKind, u64>);

impl ExitTally {
    /// Counts one exit.
    pub fn count(&mut self, kind: ExitKind) {
        *self.0.entry(kind).or_insert(0) += 1;
    }

    /// Adds `other`'s counts to these.
    pub fn add(&mut self, other: &ExitTally) {
        for (kind, n) in &other.0 {
            *self.0.entry(*kind).or_insert(0) += n;
        }
    }

    /// Every exit counted.
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }

    /// The kinds, most frequent first (ties in kind order).
    pub fn by_count(&self) -> Vec<(ExitKind, u64)> {
        let mut kinds: Vec<(ExitKind, u64)> = self.0.iter().map(|(k, n)| (*k, *n)).collect();
        kinds.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        kinds
    }
}

/// A vCPU's tally, added to the VM's total when the vCPU leaves its loop, on every path.
pub struct VcpuTally<'a> {
    /// This vCPU's counts.
    pub tally: ExitTally,
    total: &'a Mutex<ExitTally>,
}

impl<'a> VcpuTally<'a> {
    /// An empty tally that ends up in `total`.
    pub fn new(total: &'a Mutex<ExitTally>) -> Self {
        VcpuTally { tally: ExitTally::default(), total }
    }
}

impl Drop for VcpuTally<'_> {
    fn drop(&mut self) {
        gdrvm_devices::lock(self.total).add(&self.tally);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_tallies_merge_and_sort_by_count() {
        let total = Mutex::new(ExitTally::default());
        {
            let mut a = VcpuTally::new(&total);
            a.tally.count(ExitKind::Pio(0x3f8));
            a.tally.count(ExitKind::Mmio(Some(layout::ECAM_BASE)));
            a.tally.count(ExitKind::Mmio(Some(layout::ECAM_BASE)));
        }
        {
            let mut b = VcpuTally::new(&total);
            b.tally.count(ExitKind::Mmio(Some(layout::ECAM_BASE)));
            b.tally.count(ExitKind::Hlt);
        }
        let total = total.into_inner().unwrap();
        assert_eq!(total.total(), 5);
        assert_eq!(
            total.by_count(),
            vec![(ExitKind::Mmio(Some(layout::ECAM_BASE)), 3), (ExitKind::Pio(0x3f8), 1), (ExitKind::Hlt, 1)]
        );
    }

    #[test]
    fn test_setup_phases_follow_each_other() {
        let started = Instant::now();
        let mut phases = SetupPhases::new(started);
        phases.mark("vm");
        std::thread::sleep(Duration::from_millis(2));
        phases.mark("memory");
        let names: Vec<_> = phases.phases.iter().map(|p| p.0).collect();
        assert_eq!(names, ["vm", "memory"]);
        assert!(phases.phases[1].1 >= Duration::from_millis(2));
        assert!(phases.phases.iter().map(|p| p.1).sum::<Duration>() <= started.elapsed());
    }

    #[test]
    fn test_kinds_name_their_devices() {
        assert_eq!(ExitKind::Pio(0x3fd).to_string(), "pio 0x3fd (COM1)");
        assert_eq!(ExitKind::Pio(0xcfc).to_string(), "pio 0xcfc (PCI type 1, absent)");
        assert_eq!(ExitKind::Pio(0x1234).to_string(), "pio 0x1234");
        assert_eq!(ExitKind::Mmio(Some(layout::ECAM_BASE)).to_string(), "mmio 0xe0000000 (ECAM)");
        assert_eq!(ExitKind::Mmio(None).to_string(), "mmio unclaimed");
    }
}
