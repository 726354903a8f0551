//! The configuration-space firewall of a passed-through function. Guests writing legal but
//! unexpected values into a real device's configuration space have hung GPUs and hosts, so
//! only registers known to be safe reach the device, and only their safe bits:
//!
//! - the command register (memory, bus master, MWI, parity, SERR, INTx disable: not I/O
//!   space, which passed-through devices do not offer) and the status register's
//!   write-1-to-clear error bits; cache line size, latency timer and interrupt line
//!   (vfio-pci keeps the last two virtual: they never reach the hardware);
//! - the MSI capability, the MSI-X capability's enable and function-mask bits, and the
//!   power management control/status register (power state, PME);
//! - the PCI Express device, link and (version 2) device 2 and link 2 control registers,
//!   without the bits that break the link or confuse the IOMMU (Max_Payload_Size, phantom
//!   functions, ARI forwarding, compliance and margining), and the error and bandwidth
//!   status bits of device and link status.
//!
//! A passed register's other bits keep the device's value: the device is read and the
//! guest's safe bits merged in (a guest cannot shrink Max_Payload_Size below what the host
//! programmed, or clear the command bits it does not own). A status register's bits other
//! than its write-1-to-clear ones are read-only in hardware: writing them is no drop
//! (Linux writes them back whenever it restores a whole dword, after every reset).
//!
//! BARs and the expansion ROM BAR are the VMM's (it virtualizes them):
//! writes to them never reach the device and are not firewall drops. Everything else
//! (read-only registers, vendor-specific capabilities, capabilities and registers the list
//! above does not name, the whole extended space) is dropped, counted, and logged once per
//! register. In [`ConfigWrites::Permissive`] mode every register the VMM does not
//! virtualize passes unchanged.
//!
//! vfio-pci filters some writes in the kernel too (its own permission tables); this is
//! gdrvm's policy on top, stricter where it matters (vendor-specific capabilities pass raw
//! in vfio-pci).

use std::ops::Range;

use super::caps::{read16, Capability, CapabilityId};
use crate::pci_regs::*;

/// What happens to the guest's writes to registers of a passed-through function that the
/// firewall does not know to be safe.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ConfigWrites {
    /// Dropped, counted and logged once per register.
    #[default]
    Filtered,
    /// Passed unchanged (the node's `config_writes = "permissive"`); registers the VMM
    /// virtualizes still never reach the device.
    Permissive,
}

/// Command register bits that reach the device.
const COMMAND_PASS: u16 = PCI_COMMAND_MEMORY
    | PCI_COMMAND_MASTER
    | PCI_COMMAND_INVALIDATE
    | PCI_COMMAND_PARITY
    | PCI_COMMAND_SERR
    | PCI_COMMAND_INTX_DISABLE;
/// Power management control/status bits that reach the device.
const PM_CTRL_PASS: u16 = PCI_PM_CTRL_STATE_MASK | PCI_PM_CTRL_PME_ENABLE | PCI_PM_CTRL_PME_STATUS;
const DEVCTL_PASS: u16 = !(PCI_EXP_DEVCTL_PAYLOAD | PCI_EXP_DEVCTL_PHANTOM);
const DEVSTA_PASS: u16 = PCI_EXP_DEVSTA_CED | PCI_EXP_DEVSTA_NFED | PCI_EXP_DEVSTA_FED | PCI_EXP_DEVSTA_URD;
const LNKSTA_PASS: u16 = PCI_EXP_LNKSTA_LBMS | PCI_EXP_LNKSTA_LABS;
const DEVCTL2_PASS: u16 = !PCI_EXP_DEVCTL2_ARI;
const LNKCTL2_PASS: u16 = PCI_EXP_LNKCTL2_TLS | PCI_EXP_LNKCTL2_HASD;

/// What the firewall does with one configuration byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// These bits reach the device; the others are dropped.
    Pass(u8),
    /// A status register's write-1-to-clear bits, which reach the device. Its other bits
    /// are read-only in hardware, so writing them changes nothing and drops nothing:
    /// Linux writes them whenever it restores a whole dword (after a reset, on resume).
    Rw1c(u8),
    /// The VMM virtualizes the register: the device never sees it written.
    Virtual,
    /// Dropped.
    Drop(Why),
}

/// Why a byte is dropped, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    ReadOnly,
    Bits,
    VendorSpecific,
    NotPassed,
}

impl Why {
    fn text(self) -> &'static str {
        match self {
            Why::ReadOnly => "a read-only register",
            Why::Bits => "bits of a passed register that the firewall does not pass",
            Why::VendorSpecific => "a vendor-specific capability",
            Why::NotPassed => "a register the firewall does not pass",
        }
    }
}

/// Consecutive bytes of a guest write that reach the device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Run {
    /// The first register.
    pub reg: usize,
    /// The guest's bits of each byte (the others zero).
    pub bytes: Vec<u8>,
    /// The bits of each byte that keep the device's current value: the device is read and
    /// its bits merged in before the write, so a register's unsafe bits never change.
    pub keep: Vec<u8>,
}

impl Run {
    /// Whether the device must be read before the write.
    pub(super) fn merges(&self) -> bool {
        self.keep.iter().any(|&k| k != 0)
    }

    /// The bytes to write, given the device's current bytes of the run.
    pub(super) fn merged(&self, current: &[u8]) -> Vec<u8> {
        self.bytes.iter().zip(&self.keep).zip(current).map(|((b, k), c)| b | (c & k)).collect()
    }
}

/// The firewall of one function.
pub(super) struct Firewall {
    rules: Vec<Rule>,
    caps: Vec<Capability>,
    mode: ConfigWrites,
    dropped: u64,
    /// One bit per dword register a write was dropped at (each logged once).
    seen: [u64; PCI_CFG_SPACE_EXP_SIZE / 4 / 64],
}

impl Firewall {
    /// The firewall of a function with capabilities `caps`, found in `config`.
    pub(super) fn new(caps: &[Capability], config: &[u8], mode: ConfigWrites) -> Self {
        let mut f = Firewall {
            rules: vec![Rule::Drop(Why::NotPassed); PCI_CFG_SPACE_EXP_SIZE],
            caps: caps.to_vec(),
            mode,
            dropped: 0,
            seen: [0; PCI_CFG_SPACE_EXP_SIZE / 4 / 64],
        };
        f.set(0..PCI_STD_HEADER_SIZEOF, Rule::Drop(Why::ReadOnly));
        f.pass16(PCI_COMMAND, COMMAND_PASS);
        f.rw1c16(PCI_STATUS, PCI_STATUS_ERROR_BITS);
        f.set(PCI_CACHE_LINE_SIZE..PCI_LATENCY_TIMER + 1, Rule::Pass(0xff));
        f.set(PCI_BIST..PCI_BIST + 1, Rule::Drop(Why::NotPassed));
        f.set(PCI_BASE_ADDRESS_0..PCI_BASE_ADDRESS_0 + 6 * 4, Rule::Virtual);
        f.set(PCI_ROM_ADDRESS..PCI_ROM_ADDRESS + 4, Rule::Virtual);
        f.set(PCI_INTERRUPT_LINE..PCI_INTERRUPT_LINE + 1, Rule::Pass(0xff));
        for cap in caps {
            f.cap(cap, config);
        }
        f
    }

    fn cap(&mut self, cap: &Capability, config: &[u8]) {
        let (at, end) = (cap.offset, cap.offset + cap.len);
        let id = match cap.id {
            CapabilityId::Standard(id) => id,
            CapabilityId::Extended(id) => {
                self.set(at..at + 4, Rule::Drop(Why::ReadOnly));
                let why = if matches!(id, PCI_EXT_CAP_ID_VNDR | PCI_EXT_CAP_ID_DVSEC) {
                    Why::VendorSpecific
                } else {
                    Why::NotPassed
                };
                self.set(at + 4..end, Rule::Drop(why));
                return;
            }
        };
        self.set(at..at + 2, Rule::Drop(Why::ReadOnly));
        let body = at + 2..end;
        match id {
            PCI_CAP_ID_PM => {
                self.set(body, Rule::Drop(Why::ReadOnly));
                self.pass16(at + PCI_PM_CTRL, PM_CTRL_PASS);
            }
            PCI_CAP_ID_MSI => self.set(body, Rule::Pass(0xff)),
            PCI_CAP_ID_MSIX => {
                self.set(body, Rule::Drop(Why::ReadOnly));
                self.pass16(at + PCI_MSIX_FLAGS, PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL);
            }
            PCI_CAP_ID_EXP => {
                self.set(body, Rule::Drop(Why::ReadOnly));
                self.pass16(at + PCI_EXP_DEVCTL, DEVCTL_PASS);
                self.rw1c16(at + PCI_EXP_DEVSTA, DEVSTA_PASS);
                self.pass16(at + PCI_EXP_LNKCTL, !0);
                self.rw1c16(at + PCI_EXP_LNKSTA, LNKSTA_PASS);
                if read16(config, at + PCI_EXP_FLAGS) & PCI_EXP_FLAGS_VERS >= 2 && cap.len >= PCI_EXP_LNKCTL2 + 2 {
                    self.pass16(at + PCI_EXP_DEVCTL2, DEVCTL2_PASS);
                    self.pass16(at + PCI_EXP_LNKCTL2, LNKCTL2_PASS);
                }
            }
            PCI_CAP_ID_VNDR => self.set(body, Rule::Drop(Why::VendorSpecific)),
            _ => self.set(body, Rule::Drop(Why::NotPassed)),
        }
    }

    fn set(&mut self, regs: Range<usize>, rule: Rule) {
        let end = regs.end.min(self.rules.len());
        for r in self.rules.get_mut(regs.start.min(end)..end).into_iter().flatten() {
            *r = rule;
        }
    }

    fn pass16(&mut self, at: usize, mask: u16) {
        let [low, high] = mask.to_le_bytes();
        self.set(at..at + 1, Rule::Pass(low));
        self.set(at + 1..at + 2, Rule::Pass(high));
    }

    fn rw1c16(&mut self, at: usize, mask: u16) {
        let [low, high] = mask.to_le_bytes();
        self.set(at..at + 1, Rule::Rw1c(low));
        self.set(at + 1..at + 2, Rule::Rw1c(high));
    }

    /// Filters a guest write of `data` at register `reg` of device `name`: returns the
    /// runs that reach the device, and counts and logs what it drops.
    pub(super) fn filter(&mut self, name: &str, reg: usize, data: &[u8]) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        let mut dropped = false;
        for (i, &value) in data.iter().enumerate() {
            let r = reg.saturating_add(i);
            let rule = self.rules.get(r).copied().unwrap_or(Rule::Drop(Why::NotPassed));
            // The bits passed, or `None` when the byte is not written at all.
            let (mask, why) = match (rule, self.mode) {
                (Rule::Virtual, _) => (None, None),
                (_, ConfigWrites::Permissive) => (Some(0xff), None),
                (Rule::Pass(mask), _) => (Some(mask), (value & !mask != 0).then_some(Why::Bits)),
                (Rule::Rw1c(mask), _) => (Some(mask), None),
                (Rule::Drop(why), _) => (None, Some(why)),
            };
            if let Some(why) = why {
                dropped = true;
                self.note(name, r, why, data);
            }
            let Some(mask) = mask else { continue };
            match runs.last_mut() {
                Some(run) if run.reg + run.bytes.len() == r => {
                    run.bytes.push(value & mask);
                    run.keep.push(!mask);
                }
                _ => runs.push(Run { reg: r, bytes: vec![value & mask], keep: vec![!mask] }),
            }
        }
        if dropped {
            self.dropped += 1;
        }
        // A run of registers the guest may not change at all is not written.
        runs.retain(|run| run.keep.iter().any(|&k| k != 0xff));
        runs
    }

    /// Logs the first drop at `reg`'s dword register.
    fn note(&mut self, name: &str, reg: usize, why: Why, data: &[u8]) {
        let dword = reg / 4;
        let Some(word) = self.seen.get_mut(dword / 64) else {
            return;
        };
        let bit = 1u64 << (dword % 64);
        if *word & bit != 0 {
            return;
        }
        *word |= bit;
        let place = match self.caps.iter().find(|c| c.contains(reg)) {
            Some(Capability { id: CapabilityId::Standard(id), offset, .. }) => {
                format!("in capability {id:#04x} at {offset:#x}")
            }
            Some(Capability { id: CapabilityId::Extended(id), offset, .. }) => {
                format!("in extended capability {id:#06x} at {offset:#x}")
            }
            None if reg < PCI_STD_HEADER_SIZEOF => "in the header".to_string(),
            None => "outside every capability".to_string(),
        };
        tracing::warn!(
            device = name,
            reg = format_args!("{reg:#05x}"),
            data = format_args!("{data:02x?}"),
            "config write dropped by the firewall: {} {place} (logged once per register)",
            why.text()
        );
    }

    /// Guest writes that had something dropped, since open.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The dword registers (offsets) where something was dropped, in order.
    pub(super) fn dropped_registers(&self) -> Vec<usize> {
        (0..self.seen.len() * 64).filter(|d| self.seen[d / 64] & (1 << (d % 64)) != 0).map(|d| d * 4).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio::caps::walk;
    use crate::vfio::fake::ConfigImage;

    fn firewall(mode: ConfigWrites) -> Firewall {
        let img = ConfigImage::gpu();
        Firewall::new(&walk(&img.bytes), &img.bytes, mode)
    }

    /// The runs of a write, as (register, guest bits, bits kept from the device).
    fn write(f: &mut Firewall, reg: usize, data: &[u8]) -> Vec<(usize, Vec<u8>, Vec<u8>)> {
        f.filter("test", reg, data).into_iter().map(|r| (r.reg, r.bytes, r.keep)).collect()
    }

    fn write16(f: &mut Firewall, reg: usize, v: u16) -> Vec<(usize, Vec<u8>, Vec<u8>)> {
        write(f, reg, &v.to_le_bytes())
    }

    fn whole(reg: usize, v: u16) -> (usize, Vec<u8>, Vec<u8>) {
        (reg, v.to_le_bytes().to_vec(), vec![0, 0])
    }

    const PM: usize = 0x40;
    const MSI: usize = 0x50;
    const EXP: usize = 0x70;
    const MSIX: usize = 0xb0;
    const VNDR: usize = 0xc0;

    #[test]
    fn test_command_passes_its_safe_bits_and_keeps_the_others() {
        let mut f = firewall(ConfigWrites::Filtered);
        let linux = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE;
        let keep = (!COMMAND_PASS).to_le_bytes().to_vec();
        assert_eq!(write16(&mut f, PCI_COMMAND, linux), [(PCI_COMMAND, linux.to_le_bytes().to_vec(), keep.clone())]);
        assert_eq!(f.dropped(), 0);
        // I/O space is not offered: the guest's bit is dropped (the device keeps its own),
        // the rest passes, the drop is counted.
        assert_eq!(
            write16(&mut f, PCI_COMMAND, linux | PCI_COMMAND_IO),
            [(PCI_COMMAND, linux.to_le_bytes().to_vec(), keep)]
        );
        assert_eq!((f.dropped(), f.dropped_registers()), (1, vec![PCI_COMMAND]));
        // What reaches the device: the guest's safe bits over the device's other bits.
        let run = &f.filter("test", PCI_COMMAND, &linux.to_le_bytes())[0];
        assert!(run.merges());
        let device = (PCI_COMMAND_IO | PCI_COMMAND_SERR).to_le_bytes();
        assert_eq!(run.merged(&device), (linux | PCI_COMMAND_IO).to_le_bytes());
    }

    #[test]
    fn test_dword_write_over_command_and_status() {
        let mut f = firewall(ConfigWrites::Filtered);
        // Command = memory, status = clear every error bit: one run; the status' read-only
        // bits keep the device's value.
        let v = u32::from(PCI_COMMAND_MEMORY) | u32::from(PCI_STATUS_ERROR_BITS) << 16;
        let [c0, c1] = (!COMMAND_PASS).to_le_bytes();
        assert_eq!(
            write(&mut f, PCI_COMMAND, &v.to_le_bytes()),
            [(PCI_COMMAND, vec![2, 0, 0, 0xf9], vec![c0, c1, 0xff, 0x06])]
        );
        assert_eq!(f.dropped(), 0);
        // A write to the status' read-only byte alone writes nothing and drops nothing.
        assert_eq!(write(&mut f, PCI_STATUS, &[0]), []);
        assert_eq!(f.dropped(), 0);
        // Linux restoring the dword after a reset writes the status' read-only bits back as
        // it saved them (the capability list bit): nothing of it is a drop.
        let restore = u32::from(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER) | u32::from(PCI_STATUS_CAP_LIST) << 16;
        assert_eq!(
            write(&mut f, PCI_COMMAND, &restore.to_le_bytes()),
            [(PCI_COMMAND, vec![6, 0, 0, 0], vec![c0, c1, 0xff, 0x06])]
        );
        assert_eq!(f.dropped(), 0);
        // Nor are Device Status' read-only bits (Transactions Pending) written with a dword
        // of Device Control.
        let pending = u32::from(PCI_EXP_DEVCTL_RELAX_EN) | 0x0020 << 16;
        assert_eq!(write(&mut f, EXP + PCI_EXP_DEVCTL, &pending.to_le_bytes()).len(), 1);
        assert_eq!(f.dropped(), 0);
    }

    #[test]
    fn test_virtualized_registers_never_reach_the_device_and_are_not_drops() {
        for mode in [ConfigWrites::Filtered, ConfigWrites::Permissive] {
            let mut f = firewall(mode);
            for reg in (PCI_BASE_ADDRESS_0..PCI_BASE_ADDRESS_0 + 24).step_by(4).chain([PCI_ROM_ADDRESS]) {
                assert_eq!(write(&mut f, reg, &[0xff; 4]), [], "{reg:#x}");
            }
            assert_eq!(f.dropped(), 0);
        }
    }

    #[test]
    fn test_interrupt_power_and_express_controls_pass() {
        let mut f = firewall(ConfigWrites::Filtered);
        // MSI: flags, address and data reach the device as written.
        let enable = PCI_MSI_FLAGS_ENABLE | 3 << 4;
        assert_eq!(write16(&mut f, MSI + PCI_MSI_FLAGS, enable), [whole(MSI + 2, enable)]);
        assert_eq!(write(&mut f, PCI_INTERRUPT_LINE, &[10]), [(PCI_INTERRUPT_LINE, vec![10], vec![0])]);
        let addr = write(&mut f, MSI + PCI_MSI_ADDRESS_LO, &0xfee0_0000u32.to_le_bytes());
        assert_eq!(addr, [(MSI + 4, vec![0, 0, 0xe0, 0xfe], vec![0; 4])]);
        // MSI-X enable and function mask (the table size is the device's).
        let msix = PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL;
        assert_eq!(write16(&mut f, MSIX + PCI_MSIX_FLAGS, msix), [(MSIX + 2, vec![0, 0xc0], vec![0xff, 0x3f])]);
        // D3hot.
        let keep = (!PM_CTRL_PASS).to_le_bytes().to_vec();
        assert_eq!(write16(&mut f, PM + PCI_PM_CTRL, 3), [(PM + 4, vec![3, 0], keep)]);
        // Device control with relaxed ordering and 512-byte reads; link control; target
        // link speed.
        let devctl = PCI_EXP_DEVCTL_RELAX_EN | PCI_EXP_DEVCTL_READRQ_512B;
        let keep = (!DEVCTL_PASS).to_le_bytes().to_vec();
        assert_eq!(write16(&mut f, EXP + PCI_EXP_DEVCTL, devctl), [(EXP + 8, devctl.to_le_bytes().to_vec(), keep)]);
        assert_eq!(write16(&mut f, EXP + PCI_EXP_LNKCTL, 0x0040), [whole(EXP + 0x10, 0x0040)]);
        assert_eq!(write16(&mut f, EXP + PCI_EXP_LNKCTL2, 4)[0].1, [4, 0]);
        assert_eq!(f.dropped(), 0);
    }

    #[test]
    fn test_dangerous_bits_of_passed_registers_keep_the_device_value() {
        let mut f = firewall(ConfigWrites::Filtered);
        // Max_Payload_Size 256 B: the device keeps its own; the rest of the write passes.
        let runs = f.filter("test", EXP + PCI_EXP_DEVCTL, &(PCI_EXP_DEVCTL_RELAX_EN | 1 << 5).to_le_bytes());
        let device_mps_512 = (2u16 << 5).to_le_bytes();
        assert_eq!(runs[0].merged(&device_mps_512), (PCI_EXP_DEVCTL_RELAX_EN | 2 << 5).to_le_bytes());
        // Enter Compliance in link control 2.
        assert_eq!(write16(&mut f, EXP + PCI_EXP_LNKCTL2, 0x0014)[0].1, [4, 0]);
        // The MSI-X table size is read-only.
        assert_eq!(write16(&mut f, MSIX + PCI_MSIX_FLAGS, PCI_MSIX_FLAGS_ENABLE | 7)[0].1, [0, 0x80]);
        assert_eq!(f.dropped(), 3);
        assert_eq!(f.dropped_registers(), [EXP + 8, EXP + 0x30, MSIX]);
    }

    #[test]
    fn test_vendor_specific_unknown_and_read_only_writes_are_dropped_and_counted() {
        let mut f = firewall(ConfigWrites::Filtered);
        let writes = [
            PCI_VENDOR_ID,        // read-only header
            PCI_BIST,             // writable, not passed
            VNDR + 4,             // vendor-specific capability
            0xe4,                 // a capability the firewall does not know
            EXP + PCI_EXP_LNKCAP, // read-only capability register
            0x104,                // extended: AER
            0x150,                // extended: vendor-specific
            0x400,                // extended: outside every capability
        ];
        for reg in writes {
            assert_eq!(write(&mut f, reg, &[0x5a]), [], "{reg:#x}");
        }
        // The same registers again: counted again, logged once.
        for reg in writes {
            f.filter("test", reg, &[0x5a]);
        }
        assert_eq!(f.dropped(), 16);
        let mut dwords: Vec<usize> = writes.iter().map(|r| r & !3).collect();
        dwords.sort();
        assert_eq!(f.dropped_registers(), dwords);
        // A write past 4 KiB (the VMM never sends one) is dropped too, without panicking.
        assert_eq!(write(&mut f, usize::MAX - 1, &[1, 2, 3]), []);
        assert_eq!(f.dropped(), 17);
    }

    #[test]
    fn test_permissive_passes_everything_the_vmm_does_not_virtualize() {
        let mut f = firewall(ConfigWrites::Permissive);
        assert_eq!(write(&mut f, VNDR + 4, &[1, 2]), [(VNDR + 4, vec![1, 2], vec![0, 0])]);
        assert_eq!(write(&mut f, 0x150, &[7]), [(0x150, vec![7], vec![0])]);
        let io = PCI_COMMAND_IO | PCI_COMMAND_MEMORY;
        assert_eq!(write16(&mut f, PCI_COMMAND, io), [whole(PCI_COMMAND, io)]);
        // A dword over BAR5 and the CardBus pointer: only the pointer's bytes pass.
        assert_eq!(write(&mut f, 0x26, &[1, 2, 3, 4]), [(0x28, vec![3, 4], vec![0, 0])]);
        assert!(!f.filter("test", 0x150, &[7])[0].merges());
        assert_eq!(f.dropped(), 0);
        assert!(f.dropped_registers().is_empty());
    }
}
