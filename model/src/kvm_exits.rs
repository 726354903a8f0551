//! The exits a VM cost, as the host kernel's KVM counts them: the figure a boot benchmark
//! compares, since under nested virtualization an exit costs 55–100 µs and, unlike a time,
//! a count is not noisy. KVM keeps the same counters for every VM whatever its VMM, so
//! reading them from the kernel compares gdrvm and QEMU exits against exits.
//!
//! KVM's debugfs has a directory per VM, named `<pid>-<vm fd>`, with one file per counter,
//! each the sum over the VM's vCPUs. The harness reads them for its own VMs (in L1 for
//! nested runs) at the moment the guest's first KTAP line appears.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// Where KVM's debugfs directory is when debugfs is mounted at its usual place.
pub const DEBUGFS_KVM: &str = "/sys/kernel/debug/kvm";

/// The counter of every exit, whatever its kind.
pub const TOTAL: &str = "exits";

/// The KVM counters read (x86, Linux 5.x and 6.x names), with what each counts. The kinds
/// overlap: an MMIO exit to userspace was a nested page fault and an emulated instruction
/// first, so they are shown side by side, never summed.
pub const COUNTERS: [(&str, &str); 12] = [
    (TOTAL, "every exit"),
    ("io_exits", "port I/O passed to the VMM"),
    ("mmio_exits", "MMIO passed to the VMM"),
    ("halt_exits", "HLT"),
    ("irq_window_exits", "interrupt windows"),
    ("nmi_window_exits", "NMI windows"),
    ("irq_exits", "host interrupts"),
    ("request_irq_exits", "interrupt requests from the VMM"),
    ("signal_exits", "signals to the vCPU thread"),
    ("insn_emulation", "instructions KVM emulated (MMIO, port I/O, APIC)"),
    ("pf_taken", "page faults KVM handled (nested paging)"),
    ("hypercalls", "hypercalls"),
];

/// KVM's exit counters of one VMM process, by counter name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvmExits(pub BTreeMap<String, u64>);

/// Why KVM's counters of a process could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvmExitsError {
    /// The debugfs directory is missing or unreadable (debugfs not mounted, not root).
    #[error("cannot read {dir}: {reason} (KVM's counters need debugfs mounted and root)")]
    NoDebugfs {
        /// The directory tried.
        dir: String,
        /// The system's words.
        reason: String,
    },
    /// The process has no VM (it has not created one yet, or it is gone).
    #[error("no KVM VM of process {0} in debugfs")]
    NoVm(u32),
}

impl KvmExits {
    /// Reads the counters of every VM process `pid` holds, summed (one VMM has one VM),
    /// from KVM's debugfs directory `root` ([`DEBUGFS_KVM`]). Counters the kernel does
    /// not have are left out.
    pub fn read(root: &Path, pid: u32) -> Result<KvmExits, KvmExitsError> {
        let entries = std::fs::read_dir(root)
            .map_err(|e| KvmExitsError::NoDebugfs { dir: root.display().to_string(), reason: e.to_string() })?;
        let prefix = format!("{pid}-");
        let mut counts = BTreeMap::new();
        let mut found = false;
        for entry in entries.map_while(Result::ok) {
            let name = entry.file_name();
            let Some(fd) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else { continue };
            if fd.parse::<u32>().is_err() {
                continue;
            }
            found = true;
            for (counter, _) in COUNTERS {
                let Ok(text) = std::fs::read_to_string(entry.path().join(counter)) else { continue };
                if let Ok(n) = text.trim().parse::<u64>() {
                    *counts.entry(counter.to_owned()).or_insert(0) += n;
                }
            }
        }
        if !found {
            return Err(KvmExitsError::NoVm(pid));
        }
        Ok(KvmExits(counts))
    }

    /// Every exit, when the kernel counts them.
    pub fn total(&self) -> Option<u64> {
        self.0.get(TOTAL).copied()
    }

    /// The kinds (every counter but the total), largest first.
    pub fn kinds(&self) -> Vec<(&str, u64)> {
        let mut kinds: Vec<(&str, u64)> =
            self.0.iter().filter(|(k, _)| k.as_str() != TOTAL).map(|(k, v)| (k.as_str(), *v)).collect();
        kinds.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        kinds
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm_dir(root: &Path, name: &str, counters: &[(&str, u64)]) {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (k, v) in counters {
            std::fs::write(dir.join(k), format!("{v}\n")).unwrap();
        }
    }

    #[test]
    fn test_reads_the_process_vms_and_sums_them() {
        let root = tempfile::tempdir().unwrap();
        vm_dir(root.path(), "412-11", &[("exits", 900), ("io_exits", 300), ("halt_exits", 50), ("blocking", 7)]);
        vm_dir(root.path(), "412-15", &[("exits", 100), ("io_exits", 20)]);
        vm_dir(root.path(), "4120-11", &[("exits", 5)]);
        let exits = KvmExits::read(root.path(), 412).unwrap();
        assert_eq!(exits.total(), Some(1000));
        assert_eq!(exits.kinds(), vec![("io_exits", 320), ("halt_exits", 50)], "only the listed counters");
    }

    #[test]
    fn test_missing_vm_and_missing_debugfs_are_told_apart() {
        let root = tempfile::tempdir().unwrap();
        vm_dir(root.path(), "7-3", &[("exits", 1)]);
        assert_eq!(KvmExits::read(root.path(), 8), Err(KvmExitsError::NoVm(8)));
        let gone = root.path().join("nothing");
        assert!(matches!(KvmExits::read(&gone, 7), Err(KvmExitsError::NoDebugfs { .. })));
    }

    #[test]
    fn test_round_trips_through_json() {
        let exits = KvmExits([("exits".to_owned(), 3), ("mmio_exits".to_owned(), 1)].into_iter().collect());
        let json = serde_json::to_string(&exits).unwrap();
        assert_eq!(json, r#"{"exits":3,"mmio_exits":1}"#);
        assert_eq!(serde_json::from_str::<KvmExits>(&json).unwrap(), exits);
    }
}
