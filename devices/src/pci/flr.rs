//! Function Level Reset (PCI Express Base 4.0, 6.6.2): whether a function offers it (FLR
//! Capable in its PCI Express capability's Device Capabilities) and whether a configuration
//! write initiates it (Initiate Function Level Reset, bit 15 of Device Control, which
//! always reads as zero).
//!
//! Linux initiates an FLR to reset a function (`pcie_flr`: sysfs `reset`, vfio-pci in the
//! guest, a driver's recovery), waits 100 ms, and restores the configuration it saved. The
//! VMM carries the reset out for every function kind alike, as QEMU's PCIe core does: the
//! VMM's registers and interrupt state go back to power-on and the device behind the
//! function is reset through its own backend (a vfio-user or VFIO device reset).
//!
//! Written by hand: a capability-list walk and a bit test; no rust-vmm crate has them.

use super::regs::*;

/// Linux's `PCI_FIND_CAP_TTL`: a capability list longer than this loops.
const MAX_CAPABILITIES: usize = 48;

/// Where the Device Control register of a function that offers FLR is, found by walking
/// its capability list through `read` (register, bytes); `None` when the function has no
/// PCI Express capability or does not offer FLR. The list may come from a device: a loop
/// or a pointer outside the first 256 bytes ends the walk.
pub fn flr_control(read: &mut dyn FnMut(usize, &mut [u8])) -> Option<usize> {
    let mut word = [0u8; 4];
    read(PCI_STATUS, &mut word[..2]);
    if u16::from_le_bytes([word[0], word[1]]) & PCI_STATUS_CAP_LIST == 0 {
        return None;
    }
    read(PCI_CAPABILITY_LIST, &mut word[..1]);
    let mut at = usize::from(word[0] & !3);
    for _ in 0..MAX_CAPABILITIES {
        if at < PCI_STD_HEADER_SIZEOF || at + 2 > PCI_CFG_SPACE_SIZE {
            return None;
        }
        read(at, &mut word[..2]);
        match word[0] {
            // Linux's __pci_find_next_cap_ttl: an ID of 0xff ends the list (a function
            // that reads all-ones).
            0xff => return None,
            PCI_CAP_ID_EXP if at + PCI_EXP_DEVCTL + 2 <= PCI_CFG_SPACE_SIZE => {
                read(at + PCI_EXP_DEVCAP, &mut word);
                return (u32::from_le_bytes(word) & PCI_EXP_DEVCAP_FLR != 0).then_some(at + PCI_EXP_DEVCTL);
            }
            PCI_CAP_ID_EXP => return None,
            _ => at = usize::from(word[1] & !3),
        }
    }
    None
}

/// Whether writing `data` at register `reg` sets Initiate FLR in the Device Control
/// register at `devctl`.
pub fn initiates_flr(devctl: usize, reg: usize, data: &[u8]) -> bool {
    let [_, high] = PCI_EXP_DEVCTL_BCR_FLR.to_le_bytes();
    (devctl + 1).checked_sub(reg).and_then(|i| data.get(i)).is_some_and(|b| b & high != 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::ConfigSpace;
    use gdrvm_model::node::{FunctionKind, Node};

    fn reader(bytes: &[u8]) -> impl FnMut(usize, &mut [u8]) + '_ {
        |reg, data: &mut [u8]| data.copy_from_slice(&bytes[reg..reg + data.len()])
    }

    #[test]
    fn test_endpoints_offer_flr_and_ports_do_not() {
        let node = Node::resolve("vela-a100").unwrap();
        let mut endpoints = 0;
        for (i, f) in node.functions.iter().enumerate() {
            let config = ConfigSpace::for_function(&node, i);
            let found = flr_control(&mut reader(config.bytes()));
            if matches!(f.kind, FunctionKind::Endpoint(_)) {
                endpoints += 1;
                let devctl = found.unwrap_or_else(|| panic!("{}: no FLR", f.key));
                assert_eq!(config.bytes()[devctl - PCI_EXP_DEVCTL], PCI_CAP_ID_EXP);
            } else {
                assert_eq!(found, None, "{} offers FLR", f.key);
            }
        }
        assert!(endpoints > 8);
    }

    #[test]
    fn test_the_walk_ends_at_loops_and_wild_pointers_and_passes_short_capabilities() {
        let mut bytes = [0u8; 256];
        bytes[PCI_STATUS] = PCI_STATUS_CAP_LIST as u8;
        bytes[PCI_CAPABILITY_LIST] = 0x40;
        bytes[0x41] = 0x40; // A capability (not PCIe) pointing at itself.
        assert_eq!(flr_control(&mut reader(&bytes)), None);
        bytes[0x41] = 0xfc; // A PCIe capability where its Device Control does not fit.
        bytes[0xfc] = PCI_CAP_ID_EXP;
        assert_eq!(flr_control(&mut reader(&bytes)), None);
        bytes[0xfc] = 0xff; // All-ones: the end.
        assert_eq!(flr_control(&mut reader(&bytes)), None);
        // A short capability high up is walked past to the PCIe capability after it.
        bytes[0xfc] = 0x05;
        bytes[0xfd] = 0x60;
        bytes[0x60] = PCI_CAP_ID_EXP;
        bytes[0x64..0x68].copy_from_slice(&PCI_EXP_DEVCAP_FLR.to_le_bytes());
        assert_eq!(flr_control(&mut reader(&bytes)), Some(0x60 + PCI_EXP_DEVCTL));
        bytes[PCI_STATUS] = 0; // No list at all.
        assert_eq!(flr_control(&mut reader(&bytes)), None);
    }

    #[test]
    fn test_only_bit_15_of_device_control_initiates_flr() {
        let devctl = 0x48;
        // A word or a dword write of Device Control, and a byte write of its high byte.
        assert!(initiates_flr(devctl, devctl, &0x8000u16.to_le_bytes()));
        assert!(initiates_flr(devctl, devctl, &0x0000_8010u32.to_le_bytes()));
        assert!(initiates_flr(devctl, devctl + 1, &[0x80]));
        // A qword from the capability's Device Capabilities on.
        assert!(initiates_flr(devctl, devctl - 4, &[0, 0, 0, 0, 0, 0x80, 0, 0]));
        // Every other bit, the low byte alone, and the register after it.
        assert!(!initiates_flr(devctl, devctl, &0x7fffu16.to_le_bytes()));
        assert!(!initiates_flr(devctl, devctl, &[0xff]));
        assert!(!initiates_flr(devctl, devctl + 2, &[0xff, 0xff]));
        assert!(!initiates_flr(devctl, devctl - 4, &[0xff; 4]));
    }
}
