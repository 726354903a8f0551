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

use crate::symbols::SymbolMap;

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

/// Where the kernel's tracing files are when debugfs is mounted at its usual place.
pub const TRACEFS: &str = "/sys/kernel/debug/tracing";

/// The histogram of exits by reason and guest instruction pointer, on KVM's `kvm_exit`
/// tracepoint: which code in the guest exits, and how; the exits by reason are its sums. One
/// histogram on the event, not one by reason besides: 6.1 keeps only the last of two there.
/// Sized for a boot's distinct sites (about a thousand); hits past that are counted as
/// dropped.
const EXIT_HIST: (&str, &str) = ("events/kvm/kvm_exit", "hist:keys=exit_reason,guest_rip:size=16384");
/// The histogram of MSR accesses by register and direction, on `kvm_msr`.
const MSR_HIST: (&str, &str) = ("events/kvm/kvm_msr", "hist:keys=ecx,write");
/// The histogram of CPUID exits by leaf and subleaf, on `kvm_cpuid`: a paravirtualized
/// kernel executes every CPUID in one function, so its site says nothing of the caller.
const CPUID_HIST: (&str, &str) = ("events/kvm/kvm_cpuid", "hist:keys=function,index");

/// The exits of the host's VMs by reason, and their MSR accesses by register, counted in
/// kernel-side histograms (hist triggers) on KVM's tracepoints: what the per-VM counters
/// do not split, such as MSR writes and CPUID. They count every VM of the host together,
/// so they are read for one job at a time (L1 runs its jobs one after another).
///
/// Keys: `reason NAME` (`reason msr`, `reason cpuid`, ...), `msr read|write 0xN NAME` and
/// `site NAME 0xRIP` (the exits of reason NAME at guest address RIP) and `cpuid 0xLEAF
/// 0xSUBLEAF`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitReasons(pub BTreeMap<String, u64>);

/// Which vendor's exit codes a host's KVM reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vendor {
    /// AMD SVM (`kvm_amd`): VMCB exit codes.
    Svm,
    /// Intel VMX (`kvm_intel`): basic exit reasons.
    Vmx,
}

impl Vendor {
    /// The vendor of the loaded KVM module, from sysfs.
    pub fn loaded() -> Option<Vendor> {
        if Path::new("/sys/module/kvm_amd").exists() {
            Some(Vendor::Svm)
        } else if Path::new("/sys/module/kvm_intel").exists() {
            Some(Vendor::Vmx)
        } else {
            None
        }
    }

    /// The name of exit code `code`, or the code in hex.
    fn exit_name(self, code: u64) -> String {
        let name = match self {
            Vendor::Svm => match code {
                0x00..=0x0f => return format!("cr{} read", code),
                0x10..=0x1f => return format!("cr{} write", code - 0x10),
                0x40..=0x5f => return format!("exception {}", code - 0x40),
                0x60 => "interrupt",
                0x61 => "nmi",
                0x64 => "interrupt window",
                0x65 => "cr0 selective write",
                0x6e => "rdtsc",
                0x72 => "cpuid",
                0x77 => "pause",
                0x78 => "hlt",
                0x79 => "invlpg",
                0x7b => "port i/o",
                0x7c => "msr",
                0x7f => "shutdown",
                0x81 => "vmmcall",
                0x87 => "rdtscp",
                0x89 => "wbinvd",
                0x8d => "xsetbv",
                0x400 => "nested page fault",
                _ => return format!("{code:#x}"),
            },
            Vendor::Vmx => match code {
                0 => "exception or nmi",
                1 => "interrupt",
                2 => "triple fault",
                7 => "interrupt window",
                8 => "nmi window",
                10 => "cpuid",
                12 => "hlt",
                14 => "invlpg",
                16 => "rdtsc",
                18 => "vmcall",
                28 => "cr access",
                30 => "port i/o",
                31 => "msr read",
                32 => "msr write",
                40 => "pause",
                44 => "apic access",
                45 => "eoi induced",
                48 => "ept violation",
                49 => "ept misconfig",
                52 => "preemption timer",
                54 => "wbinvd",
                55 => "xsetbv",
                56 => "apic write",
                _ => return format!("{code}"),
            },
        };
        name.to_owned()
    }
}

/// What an MSR is, for the ones a booting Linux guest touches most.
fn msr_name(msr: u64) -> &'static str {
    match msr {
        0x10 => "TSC",
        0x1b => "APIC base",
        0x3b => "TSC adjust",
        0x48 => "SPEC_CTRL",
        0x49 => "PRED_CMD",
        0x1a0 => "MISC_ENABLE",
        0x200..=0x21f => "MTRR variable",
        0x250 | 0x258 | 0x259 | 0x268..=0x26f => "MTRR fixed",
        0x277 => "PAT",
        0x2ff => "MTRR default type",
        0x6e0 => "TSC deadline",
        0x802 => "x2APIC id",
        0x808 => "x2APIC TPR",
        0x80b => "x2APIC EOI",
        0x80f => "x2APIC spurious vector",
        0x830 => "x2APIC ICR (IPI)",
        0x832..=0x837 => "x2APIC LVT",
        0x838 => "x2APIC timer count",
        0x83e => "x2APIC timer divide",
        0x4b56_4d00..=0x4b56_4d07 => "KVM paravirtual",
        0xc000_0080 => "EFER",
        0xc000_0100..=0xc000_0102 => "FS/GS base",
        0xc000_0103 => "TSC_AUX",
        _ => "",
    }
}

/// Where an x86-64 kernel's text is mapped: its physical address plus this. No kernel text
/// lies below it.
pub const KERNEL_MAP: u64 = 0xffff_ffff_8000_0000;
/// The physical range a kernel loaded at its link address (16 MiB) occupies.
const KERNEL_PHYS: u64 = 16 << 20;
const KERNEL_PHYS_END: u64 = 1 << 30;

/// The reason given to exits the histogram had no room for.
pub const DROPPED: &str = "unrecorded (histogram full)";

impl ExitReasons {
    /// Installs the histograms under `tracefs`, or clears them where they are installed:
    /// from here on they count for the next job.
    pub fn start(tracefs: &Path) -> std::io::Result<()> {
        for (event, spec) in [EXIT_HIST, MSR_HIST, CPUID_HIST] {
            let trigger = tracefs.join(event).join("trigger");
            // An identical trigger is refused once installed; `:clear` empties it instead.
            if std::fs::write(&trigger, spec).is_err() {
                std::fs::write(&trigger, format!("{spec}:clear"))?;
            }
        }
        Ok(())
    }

    /// Reads the histograms under `tracefs`, naming exit codes as `vendor`'s.
    pub fn read(tracefs: &Path, vendor: Vendor) -> std::io::Result<ExitReasons> {
        let exits = std::fs::read_to_string(tracefs.join(EXIT_HIST.0).join("hist"))?;
        let msrs = std::fs::read_to_string(tracefs.join(MSR_HIST.0).join("hist"))?;
        let cpuid = std::fs::read_to_string(tracefs.join(CPUID_HIST.0).join("hist"))?;
        let mut r = ExitReasons::parse(&exits, &msrs, vendor);
        r.add_cpuid_leaves(&cpuid);
        Ok(r)
    }

    /// Parses the `hist` files' entries (`{ exit_reason: 124 } hitcount: 7`, `{ ecx: 1760,
    /// write: 1 } hitcount: 7`); other lines (comments, totals) are skipped.
    pub fn parse(exits: &str, msrs: &str, vendor: Vendor) -> ExitReasons {
        let mut map = BTreeMap::new();
        for (keys, n) in hist_entries(exits) {
            let Some(&code) = keys.get("exit_reason") else { continue };
            let reason = vendor.exit_name(code);
            if let Some(&rip) = keys.get("guest_rip") {
                *map.entry(format!("site {reason} {rip:#x}")).or_insert(0) += n;
            }
            *map.entry(format!("reason {reason}")).or_insert(0) += n;
        }
        // Exits the full histogram had no room for: counted, with no reason.
        let dropped: u64 =
            exits.lines().filter_map(|l| l.trim().strip_prefix("Dropped:")?.trim().parse::<u64>().ok()).sum();
        if dropped > 0 {
            map.insert(format!("reason {DROPPED}"), dropped);
        }
        for (keys, n) in hist_entries(msrs) {
            if let (Some(&msr), Some(&write)) = (keys.get("ecx"), keys.get("write")) {
                let dir = if write != 0 { "write" } else { "read" };
                let key = format!("msr {dir} {msr:#x} {}", msr_name(msr));
                *map.entry(key.trim_end().to_owned()).or_insert(0) += n;
            }
        }
        ExitReasons(map)
    }

    /// The `reason ...` entries, largest first, without their prefix.
    pub fn reasons(&self) -> Vec<(&str, u64)> {
        self.with_prefix("reason ")
    }

    /// Adds the entries of a `kvm_cpuid` hist file (`{ function: 11, index: 1 } hitcount: 4`).
    pub fn add_cpuid_leaves(&mut self, hist: &str) {
        for (keys, n) in hist_entries(hist) {
            if let (Some(&leaf), Some(&sub)) = (keys.get("function"), keys.get("index")) {
                *self.0.entry(format!("cpuid {leaf:#x} {sub:#x}")).or_insert(0) += n;
            }
        }
    }

    /// The `cpuid ...` entries (`0xLEAF 0xSUBLEAF`), largest first.
    pub fn cpuid_leaves(&self) -> Vec<(&str, u64)> {
        self.with_prefix("cpuid ")
    }

    /// The `site ...` entries as (reason, place, exits), most exits first: the place is
    /// the guest address (`0x...`) or, once [`ExitReasons::name_sites`] ran, the function.
    pub fn sites(&self) -> Vec<(&str, &str, u64)> {
        self.with_prefix("site ")
            .into_iter()
            .filter_map(|(k, n)| {
                let (reason, place) = k.rsplit_once(' ')?;
                Some((reason, place, n))
            })
            .collect()
    }

    /// Tells each site's address by the function of `map` it falls in (sites in one function
    /// add up); the kernel's entry code, running at its physical address, is told as
    /// `function(unpaged)`; an address no symbol covers (user space, firmware) stays as it is.
    pub fn name_sites(&mut self, map: &SymbolMap) {
        let sites: Vec<String> = self.0.keys().filter(|k| k.starts_with("site ")).cloned().collect();
        for key in sites {
            let Some((head, addr)) = key.rsplit_once(' ') else { continue };
            let Some(addr) = addr.strip_prefix("0x").and_then(|a| u64::from_str_radix(a, 16).ok()) else { continue };
            let named = match map.function(addr) {
                Some(f) => format!("{head} {f}"),
                // The kernel's entry code runs at its physical address before paging moves it
                // up to the kernel map; a kernel at its link address sits 16 MiB up.
                None if (KERNEL_PHYS..KERNEL_PHYS_END).contains(&addr) && map.in_kernel_text(addr + KERNEL_MAP) => {
                    match map.function(addr + KERNEL_MAP) {
                        Some(f) => format!("{head} {f}(unpaged)"),
                        None => continue,
                    }
                }
                None => continue,
            };
            if let Some(n) = self.0.remove(&key) {
                *self.0.entry(named).or_insert(0) += n;
            }
        }
    }

    /// The `msr ...` entries, largest first, without their prefix.
    pub fn msrs(&self) -> Vec<(&str, u64)> {
        self.with_prefix("msr ")
    }

    fn with_prefix(&self, prefix: &str) -> Vec<(&str, u64)> {
        let mut v: Vec<(&str, u64)> = self.0.iter().filter_map(|(k, n)| Some((k.strip_prefix(prefix)?, *n))).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        v
    }
}

/// The entries of a hist file: each key's numeric value, and the hit count.
fn hist_entries(text: &str) -> Vec<(BTreeMap<&str, u64>, u64)> {
    text.lines()
        .filter_map(|line| {
            let (keys, rest) = line.trim().strip_prefix('{')?.split_once('}')?;
            let hits = rest.trim().strip_prefix("hitcount:")?.trim().parse().ok()?;
            let keys = keys
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once(':')?;
                    Some((k.trim(), v.split_whitespace().next()?.parse().ok()?))
                })
                .collect();
            Some((keys, hits))
        })
        .collect()
}

/// The `kvm_exit` event, recorded into the trace buffer only for shutdowns.
const EXIT_EVENT: &str = "events/kvm/kvm_exit";

/// A guest's shutdown (triple fault) as KVM's `kvm_exit` tracepoint recorded it: where the
/// vCPU was and which event it was delivering when its CPU gave up. On AMD, KVM has reset
/// the vCPU by the time it tells the VMM, so this line is all that is left of the state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shutdown {
    /// The vCPU thread (`comm-pid`).
    pub thread: String,
    /// The guest's instruction pointer.
    pub rip: u64,
    /// The event being delivered (SVM EXITINTINFO, VMX IDT-vectoring information).
    pub intr_info: u64,
    /// Its error code.
    pub error_code: u64,
}

impl Shutdown {
    /// Records, from now on, every shutdown exit of the host's VMs in the trace buffer (a
    /// filter on `kvm_exit`: other exits are not recorded, and the histograms on the same
    /// tracepoint still count them all).
    pub fn start(tracefs: &Path, vendor: Vendor) -> std::io::Result<()> {
        let code = match vendor {
            Vendor::Svm => 0x7f,
            Vendor::Vmx => 2,
        };
        let event = tracefs.join(EXIT_EVENT);
        std::fs::write(event.join("filter"), format!("exit_reason == {code}"))?;
        std::fs::write(event.join("enable"), "1")?;
        // Empty the buffer: what it holds is older than this.
        std::fs::write(tracefs.join("trace"), "")
    }

    /// The shutdowns recorded since [`Shutdown::start`] or the last call, oldest first;
    /// the buffer is emptied.
    pub fn take(tracefs: &Path) -> std::io::Result<Vec<Shutdown>> {
        let text = std::fs::read_to_string(tracefs.join("trace"))?;
        std::fs::write(tracefs.join("trace"), "")?;
        Ok(text.lines().filter_map(Shutdown::parse).collect())
    }

    /// One `kvm_exit` line of the trace buffer (`vcpu0-107 [000] ..... 29.49: kvm_exit: vcpu
    /// 0 reason shutdown rip 0x.. info1 .. info2 .. intr_info 0x80000b0e error_code 0x10`).
    pub fn parse(line: &str) -> Option<Shutdown> {
        let (head, exit) = line.split_once(": kvm_exit: ")?;
        let thread = head.split_whitespace().next()?.to_owned();
        let words: Vec<&str> = exit.split_whitespace().collect();
        let field = |name: &str| {
            let at = words.iter().position(|w| *w == name)?;
            u64::from_str_radix(words.get(at + 1)?.trim_start_matches("0x"), 16).ok()
        };
        Some(Shutdown { thread, rip: field("rip")?, intr_info: field("intr_info")?, error_code: field("error_code")? })
    }

    /// What the guest's CPU was doing, in words: `vCPU thread vcpu0-107 shut down at rip
    /// 0xffffffff816aa497 delivering #PF (error 0x10: instruction fetch, not present)`.
    pub fn describe(&self) -> String {
        format!("vCPU thread {} shut down at rip {:#x} {}", self.thread, self.rip, self.event())
    }

    /// The event being delivered (the same encoding on SVM and VMX for these fields).
    fn event(&self) -> String {
        const VALID: u64 = 1 << 31;
        const HAS_ERROR: u64 = 1 << 11;
        if self.intr_info & VALID == 0 {
            return "delivering no event".into();
        }
        let vector = self.intr_info & 0xff;
        let error = (self.intr_info & HAS_ERROR != 0).then_some(self.error_code);
        match (self.intr_info >> 8) & 0x7 {
            0 => format!("delivering interrupt vector {vector:#x}"),
            2 => "delivering an NMI".into(),
            3 => {
                let name = EXCEPTIONS.get(vector as usize).copied().unwrap_or("an exception");
                match error {
                    Some(e) if vector == 14 => format!("delivering {name} (error {e:#x}: {})", page_fault_words(e)),
                    Some(e) => format!("delivering {name} (error {e:#x})"),
                    None => format!("delivering {name}"),
                }
            }
            kind => format!("delivering event type {kind}, vector {vector:#x}"),
        }
    }
}

/// x86 exception mnemonics by vector.
const EXCEPTIONS: [&str; 22] = [
    "#DE", "#DB", "NMI", "#BP", "#OF", "#BR", "#UD", "#NM", "#DF", "#CSO", "#TS", "#NP", "#SS", "#GP", "#PF", "#15",
    "#MF", "#AC", "#MC", "#XM", "#VE", "#CP",
];

/// A page fault's error code in words.
fn page_fault_words(e: u64) -> String {
    let access = if e & 0x10 != 0 {
        "instruction fetch"
    } else if e & 0x2 != 0 {
        "write"
    } else {
        "read"
    };
    let mut words = vec![access, if e & 0x1 != 0 { "protection violation" } else { "not present" }];
    if e & 0x4 != 0 {
        words.push("user mode");
    }
    if e & 0x8 != 0 {
        words.push("reserved bit set");
    }
    words.join(", ")
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
    fn test_exit_reasons_are_named_and_summed_from_the_histograms() {
        let exits =
            "# event histogram\n#\n# trigger info: hist:keys=exit_reason,guest_rip:vals=hitcount:size=16384\n#\n\n\
            { exit_reason:        120, guest_rip: 18446744071589000000 } hitcount:         30\n\
            { exit_reason:        124, guest_rip: 18446744071579000000 } hitcount:       2000\n\
            { exit_reason:        124, guest_rip:          4198400 } hitcount:        100\n\
            { exit_reason:        114, guest_rip: 18446744071581156608 } hitcount:         20\n\
            { exit_reason:       4095, guest_rip:                0 } hitcount:          1\n\
            \nTotals:\n    Hits: 2151\n    Entries: 5\n    Dropped: 0\n";
        let msrs = "{ ecx:       1760, write:          1 } hitcount:       1500\n\
            { ecx:       2059, write:          1 } hitcount:        400\n\
            { ecx:      12345, write:          0 } hitcount:          2\n";
        let mut r = ExitReasons::parse(exits, msrs, Vendor::Svm);
        assert_eq!(r.reasons(), vec![("msr", 2100), ("hlt", 30), ("cpuid", 20), ("0xfff", 1)]);
        assert_eq!(r.sites()[..2], [("msr", "0xffffffff81025cc0", 2000), ("msr", "0x401000", 100)]);
        assert_eq!(r.sites()[3], ("cpuid", "0xffffffff81234500", 20));
        let map = SymbolMap::parse(
            "ffffffff81000000 T startup_64\nffffffff81025c00 T native_write_msr\nffffffff81234000 t native_cpuid\n\
             ffffffff81300000 T _etext\n",
        );
        r.0.insert("site cpuid 0x1000010".into(), 4);
        r.0.insert("site cpuid 0x1400000".into(), 2);
        r.name_sites(&map);
        assert_eq!(r.sites()[..2], [("msr", "native_write_msr", 2000), ("msr", "0x401000", 100)]);
        assert_eq!(r.sites()[3], ("cpuid", "native_cpuid", 20));
        assert!(r.sites().contains(&("cpuid", "startup_64(unpaged)", 4)));
        assert!(r.sites().contains(&("cpuid", "0x1400000", 2)), "past _etext: firmware, not the kernel");
        assert_eq!(
            r.msrs(),
            vec![("write 0x6e0 TSC deadline", 1500), ("write 0x80b x2APIC EOI", 400), ("read 0x3039", 2)]
        );
        r.add_cpuid_leaves(
            "{ function:         13, index:          1 } hitcount:          9\n{ function: 1 } hitcount: 2\n",
        );
        assert_eq!(r.cpuid_leaves(), vec![("0xd 0x1", 9)]);
        assert_eq!(
            ExitReasons::parse("{ exit_reason: 32, guest_rip: 1 } hitcount: 5\n  Dropped: 7\n", "", Vendor::Vmx)
                .reasons(),
            vec![(DROPPED, 7), ("msr write", 5)]
        );
    }

    #[test]
    fn test_exit_reasons_start_installs_then_clears() {
        let root = tempfile::tempdir().unwrap();
        for (event, _) in [EXIT_HIST, MSR_HIST, CPUID_HIST] {
            std::fs::create_dir_all(root.path().join(event)).unwrap();
        }
        ExitReasons::start(root.path()).unwrap();
        let trigger = std::fs::read_to_string(root.path().join(EXIT_HIST.0).join("trigger")).unwrap();
        assert_eq!(trigger, "hist:keys=exit_reason,guest_rip:size=16384");
        let trigger = std::fs::read_to_string(root.path().join(CPUID_HIST.0).join("trigger")).unwrap();
        assert_eq!(trigger, "hist:keys=function,index");
        assert!(ExitReasons::start(Path::new("/nonexistent/tracefs")).is_err());
    }

    #[test]
    fn test_shutdown_lines_say_what_the_cpu_was_delivering() {
        let pf = "           vcpu0-107     [000] .....    21.371493: kvm_exit: vcpu 0 reason shutdown rip \
                  0xffffffff816aa497 info1 0x0000000000000000 info2 0x0000000000000000 intr_info 0x80000b0e \
                  error_code 0x00000010";
        let s = Shutdown::parse(pf).unwrap();
        assert_eq!(
            s,
            Shutdown { thread: "vcpu0-107".into(), rip: 0xffffffff816aa497, intr_info: 0x80000b0e, error_code: 0x10 }
        );
        assert_eq!(
            s.describe(),
            "vCPU thread vcpu0-107 shut down at rip 0xffffffff816aa497 delivering #PF (error 0x10: instruction fetch, not present)"
        );
        let irq = "vcpu0-107 [000] ..... 29.497210: kvm_exit: vcpu 0 reason shutdown rip 0x7f08794effb0 info1 0x0 \
                   info2 0x0 intr_info 0x80000024 error_code 0x00000000";
        assert_eq!(
            Shutdown::parse(irq).unwrap().describe(),
            "vCPU thread vcpu0-107 shut down at rip 0x7f08794effb0 delivering interrupt vector 0x24"
        );
        let gp = Shutdown { intr_info: 0x80000b0d, error_code: 0, ..s.clone() };
        assert!(gp.describe().ends_with("delivering #GP (error 0x0)"));
        assert!(Shutdown { intr_info: 0, ..s }.describe().ends_with("delivering no event"));
        assert_eq!(Shutdown::parse("# tracer: nop"), None);
        assert_eq!(Shutdown::parse("x [000] 1.0: kvm_exit: vcpu 0 reason shutdown rip zz"), None);
    }

    #[test]
    fn test_shutdown_recording_filters_the_exit_event_and_take_empties_the_buffer() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join(EXIT_EVENT)).unwrap();
        Shutdown::start(root.path(), Vendor::Svm).unwrap();
        let filter = std::fs::read_to_string(root.path().join(EXIT_EVENT).join("filter")).unwrap();
        assert_eq!(filter, "exit_reason == 127");
        assert_eq!(std::fs::read_to_string(root.path().join(EXIT_EVENT).join("enable")).unwrap(), "1");
        std::fs::write(
            root.path().join("trace"),
            "# tracer: nop\n vcpu0-9 [001] ..... 5.0: kvm_exit: vcpu 0 reason TRIPLE_FAULT rip 0x1000 info1 0x0 info2 0x0 \
             intr_info 0x0 error_code 0x0\n",
        )
        .unwrap();
        let taken = Shutdown::take(root.path()).unwrap();
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].rip, 0x1000);
        assert!(Shutdown::take(root.path()).unwrap().is_empty());
        Shutdown::start(root.path(), Vendor::Vmx).unwrap();
        assert_eq!(std::fs::read_to_string(root.path().join(EXIT_EVENT).join("filter")).unwrap(), "exit_reason == 2");
    }

    #[test]
    fn test_round_trips_through_json() {
        let exits = KvmExits([("exits".to_owned(), 3), ("mmio_exits".to_owned(), 1)].into_iter().collect());
        let json = serde_json::to_string(&exits).unwrap();
        assert_eq!(json, r#"{"exits":3,"mmio_exits":1}"#);
        assert_eq!(serde_json::from_str::<KvmExits>(&json).unwrap(), exits);
    }
}
