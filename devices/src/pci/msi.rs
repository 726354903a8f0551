//! The MSI capability (PCI Local Bus 3.0 section 6.8.1): a 32- or 64-bit message address,
//! 16-bit data, up to 32 vectors, optional per-vector masking. The capability's bytes live
//! here; configuration reads and writes inside it come here, and writes return what changed
//! for the VMM to apply (enabled with how many vectors, a vector's route, masks), the same
//! shape as [`crate::MsixTable`].
//!
//! Written by hand: no rust-vmm crate emulates MSI; Cloud Hypervisor's and crosvm's
//! capabilities call into their interrupt managers instead of returning events.
//!
//! Multiple Message Enable grants `2^n` vectors; vector `i` sends the data with its low `n`
//! bits replaced by `i`. While MSI is on, every change of a vector's message is a route
//! (Linux writes address and data without masking).

use std::ops::Range;

use super::msix::{Fire, MsiMessage};
use crate::pci_regs::*;

/// Vectors an MSI capability can offer.
pub const MSI_MAX_VECTORS: u8 = 32;

/// Length of the largest layout: 64-bit with per-vector masking.
const MAX_LEN: usize = PCI_MSI_PENDING_64 + 4;

/// What a guest write to the MSI capability asks of the VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsiEvent {
    /// MSI is on with `vectors` vectors (first enable, or Multiple Message Enable changed
    /// while on); routes and masks for every vector follow.
    Enable {
        /// Vectors granted: a power of two, at most what the function offers.
        vectors: u8,
    },
    /// MSI is off: no vector may be delivered.
    Disable,
    /// Route `vector`'s interrupts to `msg`.
    Route {
        /// Vector number.
        vector: u8,
        /// The message the vector now sends.
        msg: MsiMessage,
    },
    /// `vector` may no longer be delivered: hold its interrupts.
    Mask(u8),
    /// `vector` may be delivered again.
    Unmask(u8),
    /// Deliver `msg` now: `vector` was pending when it became deliverable.
    Deliver {
        /// Vector number.
        vector: u8,
        /// The message to send.
        msg: MsiMessage,
    },
}

/// What the registers say, for comparing before and after a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State {
    enabled: bool,
    vectors: u8,
    address: u64,
    data: u16,
    mask: u32,
}

impl State {
    fn message(&self, vector: u8) -> MsiMessage {
        let low = u16::from(self.vectors) - 1;
        MsiMessage { address: self.address, data: u32::from((self.data & !low) | u16::from(vector)) }
    }

    fn masked(&self, vector: u8) -> bool {
        self.mask & (1 << vector) != 0
    }
}

/// One function's MSI capability, header included.
#[derive(Debug, Clone)]
pub struct MsiCapability {
    regs: [u8; MAX_LEN],
    wmask: [u8; MAX_LEN],
    len: usize,
    is_64bit: bool,
    per_vector_mask: bool,
}

impl MsiCapability {
    /// A capability offering `vectors` vectors (rounded down to a power of two, 1 to 32),
    /// a 64-bit address or not, per-vector masking or not, whose header points at the
    /// capability at `next` (0: the last). Disabled, as after reset.
    pub fn new(vectors: u8, is_64bit: bool, per_vector_mask: bool, next: u8) -> Self {
        let log2 = vectors.clamp(1, MSI_MAX_VECTORS).ilog2() as u16;
        let mut c = MsiCapability { regs: [0; MAX_LEN], wmask: [0; MAX_LEN], len: 0, is_64bit, per_vector_mask };
        c.regs[PCI_CAP_LIST_ID] = PCI_CAP_ID_MSI;
        c.regs[PCI_CAP_LIST_NEXT] = next;
        let flags = (log2 << PCI_MSI_FLAGS_QMASK.trailing_zeros())
            | if is_64bit { PCI_MSI_FLAGS_64BIT } else { 0 }
            | if per_vector_mask { PCI_MSI_FLAGS_MASKBIT } else { 0 };
        c.set(PCI_MSI_FLAGS, &flags.to_le_bytes(), &(PCI_MSI_FLAGS_ENABLE | PCI_MSI_FLAGS_QSIZE).to_le_bytes());
        // The address is dword aligned: bits 1:0 read as zero.
        c.set(PCI_MSI_ADDRESS_LO, &[0; 4], &0xffff_fffcu32.to_le_bytes());
        if is_64bit {
            c.set(PCI_MSI_ADDRESS_HI, &[0; 4], &[0xff; 4]);
        }
        // Data is 16 bits; the extended data after it reads as zero.
        c.set(c.data_reg(), &[0; 4], &[0xff, 0xff, 0, 0]);
        c.len = c.data_reg() + 4;
        if per_vector_mask {
            let valid = u32::MAX >> (32 - (1u32 << log2));
            c.set(c.mask_reg(), &[0; 4], &valid.to_le_bytes());
            // The pending bits after the mask are read-only.
            c.len = c.mask_reg() + 8;
        }
        c
    }

    /// Bytes the capability takes in configuration space, a multiple of 4.
    #[expect(clippy::len_without_is_empty, reason = "a capability is never empty")]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Reads at `offset` from the capability's start; all-ones outside it.
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        match self.span(offset, data.len()) {
            Some(span) => data.copy_from_slice(&self.regs[span]),
            None => data.fill(0xff),
        }
    }

    /// Writes at `offset` from the capability's start (dropped outside it); returns what
    /// changed.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Vec<MsiEvent> {
        let Some(span) = self.span(offset, data.len()) else {
            return Vec::new();
        };
        let old = self.state_now();
        for ((r, m), v) in self.regs[span.clone()].iter_mut().zip(&self.wmask[span]).zip(data) {
            *r = (*r & !m) | (v & m);
        }
        self.changes(old)
    }

    /// Raises `vector` (an emulated device's interrupt).
    pub fn fire(&mut self, vector: u8) -> Fire {
        let s = self.state_now();
        if !s.enabled || vector >= s.vectors {
            Fire::Dropped
        } else if s.masked(vector) {
            let at = self.mask_reg() + 4;
            let pending = self.read32(at) | 1 << vector;
            self.regs[at..at + 4].copy_from_slice(&pending.to_le_bytes());
            Fire::Pending
        } else {
            Fire::Deliver(s.message(vector))
        }
    }

    fn data_reg(&self) -> usize {
        if self.is_64bit {
            PCI_MSI_DATA_64
        } else {
            PCI_MSI_DATA_32
        }
    }

    fn mask_reg(&self) -> usize {
        if self.is_64bit {
            PCI_MSI_MASK_64
        } else {
            PCI_MSI_MASK_32
        }
    }

    /// The register bytes an access covers, if it stays inside the capability.
    fn span(&self, offset: usize, len: usize) -> Option<Range<usize>> {
        offset.checked_add(len).filter(|&end| end <= self.len).map(|end| offset..end)
    }

    fn set(&mut self, at: usize, value: &[u8], mask: &[u8]) {
        self.regs[at..at + value.len()].copy_from_slice(value);
        self.wmask[at..at + mask.len()].copy_from_slice(mask);
    }

    fn read32(&self, at: usize) -> u32 {
        u32::from_le_bytes([self.regs[at], self.regs[at + 1], self.regs[at + 2], self.regs[at + 3]])
    }

    fn state_now(&self) -> State {
        let flags = u16::from_le_bytes([self.regs[PCI_MSI_FLAGS], self.regs[PCI_MSI_FLAGS + 1]]);
        let offered = (flags & PCI_MSI_FLAGS_QMASK) >> PCI_MSI_FLAGS_QMASK.trailing_zeros();
        let granted = (flags & PCI_MSI_FLAGS_QSIZE) >> PCI_MSI_FLAGS_QSIZE.trailing_zeros();
        let high = if self.is_64bit { u64::from(self.read32(PCI_MSI_ADDRESS_HI)) << 32 } else { 0 };
        State {
            enabled: flags & PCI_MSI_FLAGS_ENABLE != 0,
            // Granting more than offered is undefined: the function uses what it offers.
            vectors: 1 << granted.min(offered),
            address: high | u64::from(self.read32(PCI_MSI_ADDRESS_LO)),
            data: self.read32(self.data_reg()) as u16,
            mask: if self.per_vector_mask { self.read32(self.mask_reg()) } else { 0 },
        }
    }

    /// The events that take the VMM from `old` to the registers' state now.
    fn changes(&mut self, old: State) -> Vec<MsiEvent> {
        let new = self.state_now();
        let mut events = Vec::new();
        if !new.enabled {
            if old.enabled {
                events.push(MsiEvent::Disable);
            }
            return events;
        }
        let fresh = !old.enabled || old.vectors != new.vectors;
        if fresh {
            events.push(MsiEvent::Enable { vectors: new.vectors });
        }
        for v in 0..new.vectors {
            if fresh || old.message(v) != new.message(v) {
                events.push(MsiEvent::Route { vector: v, msg: new.message(v) });
            }
        }
        for v in 0..new.vectors {
            let masked = new.masked(v);
            if !fresh && masked == old.masked(v) {
                continue;
            }
            if masked {
                events.push(MsiEvent::Mask(v));
                continue;
            }
            // On a fresh enable too: the VMM's vector holds delivery until told otherwise,
            // and a capability without per-vector masking never tells it later.
            events.push(MsiEvent::Unmask(v));
            if self.take_pending(v) {
                events.push(MsiEvent::Deliver { vector: v, msg: new.message(v) });
            }
        }
        events
    }

    /// Clears `vector`'s pending bit; whether it was set.
    fn take_pending(&mut self, vector: u8) -> bool {
        if !self.per_vector_mask {
            return false;
        }
        let at = self.mask_reg() + 4;
        let pending = self.read32(at);
        self.regs[at..at + 4].copy_from_slice(&(pending & !(1 << vector)).to_le_bytes());
        pending & 1 << vector != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADDRESS: u64 = 0xfee0_1000;
    const DATA: u16 = 0x4040;

    fn flags(c: &MsiCapability) -> u16 {
        let mut b = [0u8; 2];
        c.read(PCI_MSI_FLAGS, &mut b);
        u16::from_le_bytes(b)
    }

    fn write16(c: &mut MsiCapability, at: usize, v: u16) -> Vec<MsiEvent> {
        c.write(at, &v.to_le_bytes())
    }

    fn write32(c: &mut MsiCapability, at: usize, v: u32) -> Vec<MsiEvent> {
        c.write(at, &v.to_le_bytes())
    }

    fn read32(c: &MsiCapability, at: usize) -> u32 {
        let mut b = [0u8; 4];
        c.read(at, &mut b);
        u32::from_le_bytes(b)
    }

    fn msg(vector: u16) -> MsiMessage {
        MsiMessage { address: ADDRESS, data: u32::from(DATA | vector) }
    }

    /// __pci_write_msi_msg: Multiple Message Enable, address low, high, data.
    fn program(c: &mut MsiCapability, granted_log2: u16) -> Vec<MsiEvent> {
        let qsize = granted_log2 << PCI_MSI_FLAGS_QSIZE.trailing_zeros();
        let control = (flags(c) & !PCI_MSI_FLAGS_QSIZE) | qsize;
        let mut events = write16(c, PCI_MSI_FLAGS, control);
        events.extend(write32(c, PCI_MSI_ADDRESS_LO, ADDRESS as u32));
        events.extend(write32(c, PCI_MSI_ADDRESS_HI, (ADDRESS >> 32) as u32));
        events.extend(write16(c, PCI_MSI_DATA_64, DATA));
        events
    }

    #[test]
    fn test_header_and_layouts() {
        let c = MsiCapability::new(4, true, true, 0x90);
        let mut header = [0u8; 2];
        c.read(PCI_CAP_LIST_ID, &mut header);
        assert_eq!(header, [PCI_CAP_ID_MSI, 0x90]);
        assert_eq!(flags(&c), 2 << 1 | PCI_MSI_FLAGS_64BIT | PCI_MSI_FLAGS_MASKBIT);
        assert_eq!(c.len(), PCI_MSI_PENDING_64 + 4);
        assert_eq!(MsiCapability::new(1, false, false, 0).len(), PCI_MSI_DATA_32 + 4);
        assert_eq!(MsiCapability::new(1, true, false, 0).len(), PCI_MSI_DATA_64 + 4);
        assert_eq!(MsiCapability::new(1, false, true, 0).len(), PCI_MSI_PENDING_32 + 4);
        // Vector counts round down to a power of two and stop at 32.
        assert_eq!(flags(&MsiCapability::new(6, false, false, 0)) & PCI_MSI_FLAGS_QMASK, 2 << 1);
        assert_eq!(flags(&MsiCapability::new(255, false, false, 0)) & PCI_MSI_FLAGS_QMASK, 5 << 1);
        assert_eq!(flags(&MsiCapability::new(0, false, false, 0)) & PCI_MSI_FLAGS_QMASK, 0);
    }

    #[test]
    fn test_linux_enables_masked_vectors_then_unmasks() {
        let mut c = MsiCapability::new(4, true, true, 0);
        // msi_capability_init: mask every vector, program while disabled, then enable.
        assert!(write32(&mut c, PCI_MSI_MASK_64, !0).is_empty());
        assert_eq!(read32(&c, PCI_MSI_MASK_64), 0xf, "only offered vectors have mask bits");
        assert!(program(&mut c, 2).is_empty());
        let control = flags(&c) | PCI_MSI_FLAGS_ENABLE;
        let enable = write16(&mut c, PCI_MSI_FLAGS, control);
        let mut expected = vec![MsiEvent::Enable { vectors: 4 }];
        expected.extend((0..4).map(|v| MsiEvent::Route { vector: v as u8, msg: msg(v) }));
        expected.extend((0..4).map(MsiEvent::Mask));
        assert_eq!(enable, expected);
        // request_irq unmasks vector 0; vector 1 fires while masked.
        assert_eq!(write32(&mut c, PCI_MSI_MASK_64, 0xe), vec![MsiEvent::Unmask(0)]);
        assert_eq!(c.fire(0), Fire::Deliver(msg(0)));
        assert_eq!(c.fire(1), Fire::Pending);
        assert_eq!(read32(&c, PCI_MSI_PENDING_64), 0b10);
        // The pending register is read-only.
        write32(&mut c, PCI_MSI_PENDING_64, 0);
        assert_eq!(read32(&c, PCI_MSI_PENDING_64), 0b10);
        assert_eq!(
            write32(&mut c, PCI_MSI_MASK_64, 0xc),
            vec![MsiEvent::Unmask(1), MsiEvent::Deliver { vector: 1, msg: msg(1) }]
        );
        assert_eq!(read32(&c, PCI_MSI_PENDING_64), 0);
        assert_eq!(write32(&mut c, PCI_MSI_MASK_64, 0xd), vec![MsiEvent::Mask(0)]);
    }

    #[test]
    fn test_32bit_without_masking() {
        let mut c = MsiCapability::new(1, false, false, 0);
        assert!(write32(&mut c, PCI_MSI_ADDRESS_LO, ADDRESS as u32).is_empty());
        assert!(write16(&mut c, PCI_MSI_DATA_32, DATA).is_empty());
        let on = write16(&mut c, PCI_MSI_FLAGS, PCI_MSI_FLAGS_ENABLE);
        assert_eq!(
            on,
            vec![MsiEvent::Enable { vectors: 1 }, MsiEvent::Route { vector: 0, msg: msg(0) }, MsiEvent::Unmask(0)]
        );
        // Linux rewrites the message in place when the interrupt moves: each change routes.
        let moved = MsiMessage { address: 0xfee0_2000, data: u32::from(DATA) };
        assert_eq!(write32(&mut c, PCI_MSI_ADDRESS_LO, 0xfee0_2000), vec![MsiEvent::Route { vector: 0, msg: moved }]);
        assert!(write16(&mut c, PCI_MSI_DATA_32, DATA).is_empty());
        assert_eq!(c.fire(0), Fire::Deliver(moved));
        assert_eq!(write16(&mut c, PCI_MSI_FLAGS, 0), vec![MsiEvent::Disable]);
        assert_eq!(c.fire(0), Fire::Dropped);
    }

    #[test]
    fn test_multiple_message_enable_sets_the_vector_count() {
        let mut c = MsiCapability::new(8, true, false, 0);
        program(&mut c, 1);
        let control = flags(&c) | PCI_MSI_FLAGS_ENABLE;
        let on = write16(&mut c, PCI_MSI_FLAGS, control);
        assert_eq!(on[0], MsiEvent::Enable { vectors: 2 });
        // Enable, then each vector routed and (without per-vector masking) unmasked.
        assert_eq!(on.len(), 5);
        assert_eq!(on[3..], [MsiEvent::Unmask(0), MsiEvent::Unmask(1)]);
        assert_eq!(c.fire(1), Fire::Deliver(msg(1)));
        assert_eq!(c.fire(2), Fire::Dropped);
        // Changing the grant while on re-announces every vector.
        let control = (flags(&c) & !PCI_MSI_FLAGS_QSIZE) | 2 << 4;
        let grown = write16(&mut c, PCI_MSI_FLAGS, control);
        assert_eq!(grown[0], MsiEvent::Enable { vectors: 4 });
        assert_eq!(grown.len(), 9);
        // Granting more than offered gets what is offered.
        let over = write16(&mut c, PCI_MSI_FLAGS, PCI_MSI_FLAGS_ENABLE | 5 << 4);
        assert_eq!(over[0], MsiEvent::Enable { vectors: 8 });
    }

    #[test]
    fn test_read_only_bits_and_out_of_range_accesses() {
        let mut c = MsiCapability::new(2, false, true, 0);
        // ID, next, offered count, 64-bit and mask capability, address bits 1:0.
        write32(&mut c, 0, !0);
        assert_eq!(read32(&c, 0), u32::from(PCI_CAP_ID_MSI) | u32::from(1 << 1 | PCI_MSI_FLAGS_MASKBIT | 0x71) << 16);
        write32(&mut c, PCI_MSI_ADDRESS_LO, !0);
        assert_eq!(read32(&c, PCI_MSI_ADDRESS_LO), 0xffff_fffc);
        write32(&mut c, PCI_MSI_DATA_32, !0);
        assert_eq!(read32(&c, PCI_MSI_DATA_32), 0xffff, "no extended message data");
        // Byte accesses work; accesses leaving the capability read all-ones and are dropped.
        let mut b = [0u8; 1];
        c.read(PCI_MSI_ADDRESS_LO + 1, &mut b);
        assert_eq!(b, [0xff]);
        let mut d = [0u8; 4];
        c.read(c.len() - 2, &mut d);
        assert_eq!(d, [0xff; 4]);
        c.read(usize::MAX, &mut d);
        assert_eq!(d, [0xff; 4]);
        let before = read32(&c, PCI_MSI_MASK_32);
        assert!(c.write(c.len() - 2, &[0; 4]).is_empty());
        assert!(c.write(usize::MAX - 1, &[0; 4]).is_empty());
        assert_eq!(read32(&c, PCI_MSI_MASK_32), before);
    }

    #[test]
    fn test_pending_vector_delivered_when_enabled_unmasked() {
        let mut c = MsiCapability::new(1, false, true, 0);
        write32(&mut c, PCI_MSI_MASK_32, 1);
        write16(&mut c, PCI_MSI_FLAGS, PCI_MSI_FLAGS_ENABLE);
        assert_eq!(c.fire(0), Fire::Pending);
        write16(&mut c, PCI_MSI_FLAGS, 0);
        write32(&mut c, PCI_MSI_MASK_32, 0);
        let on = write16(&mut c, PCI_MSI_FLAGS, PCI_MSI_FLAGS_ENABLE);
        let zero = MsiMessage::default();
        assert_eq!(
            on,
            vec![
                MsiEvent::Enable { vectors: 1 },
                MsiEvent::Route { vector: 0, msg: zero },
                MsiEvent::Unmask(0),
                MsiEvent::Deliver { vector: 0, msg: zero }
            ]
        );
    }
}
