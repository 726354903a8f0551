//! Who answers each byte of a function's 4 KiB configuration space: the VMM (topology,
//! BARs, the command register, capabilities it emulates) or the device behind it. An
//! access spanning both is split into runs of one owner, each served by its owner, and the
//! results merged in the guest's buffer.
//!
//! Written by hand: a bitmap over 4096 bytes; no rust-vmm crate splits configuration space.

use std::ops::Range;

/// Size of the configuration space ownership covers.
const SPACE: usize = 4096;

/// Who serves a configuration byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The VMM's model of the function.
    Vmm,
    /// The device behind the function ([`crate::PciDevice::config_read`]).
    Device,
}

/// The owner of every byte of one function's configuration space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigOwnership {
    /// One bit per byte, set where the device owns it.
    device: [u64; SPACE / 64],
}

impl ConfigOwnership {
    /// Every byte owned by `owner`.
    pub fn new(owner: Owner) -> Self {
        let fill = if owner == Owner::Device { u64::MAX } else { 0 };
        ConfigOwnership { device: [fill; SPACE / 64] }
    }

    /// Gives the bytes of `regs` (clamped to 4 KiB) to `owner`; later calls win.
    pub fn assign(&mut self, regs: Range<usize>, owner: Owner) -> &mut Self {
        for reg in regs.start.min(SPACE)..regs.end.min(SPACE) {
            let bit = 1u64 << (reg % 64);
            match owner {
                Owner::Device => self.device[reg / 64] |= bit,
                Owner::Vmm => self.device[reg / 64] &= !bit,
            }
        }
        self
    }

    /// The owner of byte `reg`; bytes beyond 4 KiB are the VMM's (they read as all-ones).
    pub fn owner(&self, reg: usize) -> Owner {
        match self.device.get(reg / 64) {
            Some(word) if word & (1 << (reg % 64)) != 0 => Owner::Device,
            _ => Owner::Vmm,
        }
    }

    /// Splits an access of `len` bytes at `reg` into runs of one owner, in order. Each run's
    /// range indexes the access's buffer: its bytes are registers `reg + range.start ..`.
    pub fn split(&self, reg: usize, len: usize) -> impl Iterator<Item = (Owner, Range<usize>)> + '_ {
        let mut start = 0;
        std::iter::from_fn(move || {
            if start >= len {
                return None;
            }
            let owner = self.owner(reg.saturating_add(start));
            let end = (start + 1..len).find(|&i| self.owner(reg.saturating_add(i)) != owner).unwrap_or(len);
            let run = (owner, start..end);
            start = end;
            Some(run)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci_regs::*;

    /// An endpoint whose header and PCIe capability are the VMM's, the rest the device's.
    fn endpoint() -> ConfigOwnership {
        let mut o = ConfigOwnership::new(Owner::Device);
        o.assign(0..0x40, Owner::Vmm).assign(0x40..0x40 + PCI_CAP_EXP_ENDPOINT_SIZEOF_V2, Owner::Vmm);
        o
    }

    #[test]
    fn test_owner_of_each_byte() {
        let o = endpoint();
        assert_eq!(o.owner(PCI_VENDOR_ID), Owner::Vmm);
        assert_eq!(o.owner(0x7b), Owner::Vmm);
        assert_eq!(o.owner(0x7c), Owner::Device);
        assert_eq!(o.owner(0xfff), Owner::Device);
        assert_eq!(o.owner(0x1000), Owner::Vmm);
        assert_eq!(o.owner(usize::MAX), Owner::Vmm);
    }

    #[test]
    fn test_later_assignments_win_and_ranges_clamp() {
        let mut o = ConfigOwnership::new(Owner::Vmm);
        o.assign(0x100..0x2000, Owner::Device).assign(0x104..0x106, Owner::Vmm);
        assert_eq!(o.owner(0x103), Owner::Device);
        assert_eq!(o.owner(0x104), Owner::Vmm);
        assert_eq!(o.owner(0x106), Owner::Device);
        assert_eq!(o.owner(0xfff), Owner::Device);
        // An empty or reversed range changes nothing.
        let before = o.clone();
        let (start, end) = (0x20, 0x10);
        o.assign(start..end, Owner::Device);
        assert_eq!(o, before);
    }

    #[test]
    fn test_access_within_one_owner_is_one_run() {
        let o = endpoint();
        assert_eq!(o.split(PCI_COMMAND, 4).collect::<Vec<_>>(), vec![(Owner::Vmm, 0..4)]);
        assert_eq!(o.split(0x200, 8).collect::<Vec<_>>(), vec![(Owner::Device, 0..8)]);
        assert_eq!(o.split(0x10, 0).count(), 0);
    }

    #[test]
    fn test_access_spanning_owners_splits_and_merges() {
        let mut o = ConfigOwnership::new(Owner::Vmm);
        // A device-owned register in the middle of a dword (a vendor capability's byte).
        o.assign(0x81..0x82, Owner::Device);
        let runs: Vec<_> = o.split(0x80, 4).collect();
        assert_eq!(runs, vec![(Owner::Vmm, 0..1), (Owner::Device, 1..2), (Owner::Vmm, 2..4)]);

        // Serve a dword read the way the VMM will: each run from its owner, into one buffer.
        let vmm = [0x11u8; 4];
        let device = [0x22u8; 4];
        let mut data = [0u8; 4];
        for (owner, r) in o.split(0x80, data.len()) {
            let src = if owner == Owner::Vmm { &vmm } else { &device };
            data[r.clone()].copy_from_slice(&src[r]);
        }
        assert_eq!(data, [0x11, 0x22, 0x11, 0x11]);
    }

    #[test]
    fn test_access_past_the_end_belongs_to_the_vmm() {
        let o = ConfigOwnership::new(Owner::Device);
        let runs: Vec<_> = o.split(0xffe, 4).collect();
        assert_eq!(runs, vec![(Owner::Device, 0..2), (Owner::Vmm, 2..4)]);
    }
}
