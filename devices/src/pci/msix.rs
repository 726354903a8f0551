//! The MSI-X table and pending-bit array, emulated once for every kind of device (PCI Local
//! Bus 3.0 section 6.8.2): the guest programs each vector's message and mask bit here, and
//! writes return what changed for the VMM to apply (a vector's GSI route, its irqfd masked
//! or not, a pending message to deliver). The capability's control bits reach the table
//! through [`MsixTable::set_control`].
//!
//! Written by hand: no rust-vmm crate emulates MSI-X; Cloud Hypervisor's and crosvm's tables
//! call into their interrupt managers instead of returning events.
//!
//! A vector's route is latched when it becomes deliverable (MSI-X on, function and vector
//! unmasked), so Linux's sequence (mask, write address low, address high, data, unmask)
//! yields one [`MsixEvent::Route`] with the whole message, and a route stays in force until
//! the next one for that vector. Accesses other than aligned dwords and qwords inside the
//! table or PBA read all-ones and are dropped.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::pci_regs::*;

/// Vectors an MSI-X capability can describe (its Table Size field is 11 bits).
pub const MSIX_MAX_VECTORS: u16 = 2048;

const ENTRY_SIZE: u64 = PCI_MSIX_ENTRY_SIZE as u64;

/// A message-signalled interrupt: the address and data the device writes to raise it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MsiMessage {
    /// Message address (on x86, the LAPIC window and destination).
    pub address: u64,
    /// Message data (on x86, the vector and delivery mode).
    pub data: u32,
}

/// What a guest write to the table or the capability's control bits asks of the VMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsixEvent {
    /// Route `vector`'s interrupts to `msg` (set its GSI routing entry).
    Route {
        /// Table entry.
        vector: u16,
        /// The message the vector now sends.
        msg: MsiMessage,
    },
    /// `vector` may no longer be delivered: hold its interrupts.
    Mask(u16),
    /// `vector` may be delivered again.
    Unmask(u16),
    /// Deliver `msg` now: `vector` was pending when it was unmasked.
    Deliver {
        /// Table entry.
        vector: u16,
        /// The message to send.
        msg: MsiMessage,
    },
}

/// What became of an interrupt an emulated device raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fire {
    /// Send this message now.
    Deliver(MsiMessage),
    /// The vector is masked: its pending bit is set and it is delivered on unmask.
    Pending,
    /// Message-signalled interrupts are off, or the vector does not exist.
    Dropped,
}

/// One table entry.
#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    msg: MsiMessage,
    masked: bool,
    /// The message last sent out as a route.
    routed: Option<MsiMessage>,
}

/// The MSI-X table and PBA of one function.
#[derive(Debug)]
pub struct MsixTable {
    entries: Vec<Entry>,
    pending: Vec<u64>,
    enabled: bool,
    function_masked: bool,
    bad_access_logged: AtomicBool,
}

impl MsixTable {
    /// A table of `vectors` entries (clamped to 1..=[`MSIX_MAX_VECTORS`]), each masked and
    /// zeroed as after reset, with MSI-X disabled.
    pub fn new(vectors: u16) -> Self {
        let n = vectors.clamp(1, MSIX_MAX_VECTORS);
        MsixTable {
            entries: vec![Entry { masked: true, ..Default::default() }; usize::from(n)],
            pending: vec![0; usize::from(n).div_ceil(64)],
            enabled: false,
            function_masked: false,
            bad_access_logged: AtomicBool::new(false),
        }
    }

    /// Number of vectors.
    pub fn vectors(&self) -> u16 {
        self.entries.len() as u16
    }

    /// Size of the table in bytes (16 per vector).
    pub fn table_len(&self) -> u64 {
        self.entries.len() as u64 * ENTRY_SIZE
    }

    /// Size of the PBA in bytes (a qword per 64 vectors).
    pub fn pba_len(&self) -> u64 {
        self.pending.len() as u64 * 8
    }

    /// Reads the table at `offset` from its start.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        match self.dwords(offset, data.len(), self.table_len()) {
            Some(first) => {
                for (i, chunk) in data.chunks_exact_mut(4).enumerate() {
                    chunk.copy_from_slice(&self.table_dword(first + i).to_le_bytes());
                }
            }
            None => data.fill(0xff),
        }
    }

    /// Writes the table at `offset` from its start; returns what changed.
    pub fn write_table(&mut self, offset: u64, data: &[u8]) -> Vec<MsixEvent> {
        let mut events = Vec::new();
        if let Some(first) = self.dwords(offset, data.len(), self.table_len()) {
            for (i, chunk) in data.chunks_exact(4).enumerate() {
                let value = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                self.write_table_dword(first + i, value, &mut events);
            }
        }
        events
    }

    /// Reads the pending-bit array at `offset` from its start; writes to it are dropped.
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        match self.dwords(offset, data.len(), self.pba_len()) {
            Some(first) => {
                for (i, chunk) in data.chunks_exact_mut(4).enumerate() {
                    let dword = first + i;
                    let word = self.pending[dword / 2] >> (32 * (dword % 2));
                    chunk.copy_from_slice(&(word as u32).to_le_bytes());
                }
            }
            None => data.fill(0xff),
        }
    }

    /// Applies the capability's MSI-X Enable and Function Mask bits; returns what changed.
    pub fn set_control(&mut self, enabled: bool, function_masked: bool) -> Vec<MsixEvent> {
        let was: Vec<bool> = (0..self.entries.len()).map(|v| self.blocked(v)).collect();
        self.enabled = enabled;
        self.function_masked = function_masked;
        let mut events = Vec::new();
        for (v, was_blocked) in was.into_iter().enumerate() {
            self.settle(v, was_blocked, &mut events);
        }
        events
    }

    /// Raises `vector` (an emulated device's interrupt).
    pub fn fire(&mut self, vector: u16) -> Fire {
        let v = usize::from(vector);
        let Some(entry) = self.entries.get(v) else {
            return Fire::Dropped;
        };
        if !self.enabled {
            Fire::Dropped
        } else if self.blocked(v) {
            self.pending[v / 64] |= 1 << (v % 64);
            Fire::Pending
        } else {
            Fire::Deliver(entry.msg)
        }
    }

    /// The first dword an access of `len` bytes at `offset` covers, if it is an aligned
    /// dword or qword inside `limit` bytes.
    fn dwords(&self, offset: u64, len: usize, limit: u64) -> Option<usize> {
        let ok = matches!(len, 4 | 8) && offset % len as u64 == 0 && offset.saturating_add(len as u64) <= limit;
        if !ok && !self.bad_access_logged.swap(true, Ordering::Relaxed) {
            tracing::debug!(offset = format_args!("{offset:#x}"), len, "unsupported MSI-X access (logged once)");
        }
        ok.then_some((offset / 4) as usize)
    }

    fn table_dword(&self, dword: usize) -> u32 {
        let e = &self.entries[dword / 4];
        match (dword % 4) * 4 {
            PCI_MSIX_ENTRY_LOWER_ADDR => e.msg.address as u32,
            PCI_MSIX_ENTRY_UPPER_ADDR => (e.msg.address >> 32) as u32,
            PCI_MSIX_ENTRY_DATA => e.msg.data,
            _ => u32::from(e.masked),
        }
    }

    fn write_table_dword(&mut self, dword: usize, value: u32, events: &mut Vec<MsixEvent>) {
        let v = dword / 4;
        let was_blocked = self.blocked(v);
        let e = &mut self.entries[v];
        match (dword % 4) * 4 {
            PCI_MSIX_ENTRY_LOWER_ADDR => e.msg.address = (e.msg.address & !0xffff_ffff) | u64::from(value),
            PCI_MSIX_ENTRY_UPPER_ADDR => e.msg.address = (e.msg.address & 0xffff_ffff) | u64::from(value) << 32,
            PCI_MSIX_ENTRY_DATA => e.msg.data = value,
            _ => e.masked = value & PCI_MSIX_ENTRY_CTRL_MASKBIT != 0,
        }
        self.settle(v, was_blocked, events);
    }

    /// Whether vector `v` may not be delivered now.
    fn blocked(&self, v: usize) -> bool {
        !self.enabled || self.function_masked || self.entries[v].masked
    }

    /// Reports how vector `v` changed since it was `was_blocked`.
    fn settle(&mut self, v: usize, was_blocked: bool, events: &mut Vec<MsixEvent>) {
        let blocked = self.blocked(v);
        let vector = v as u16;
        let entry = &mut self.entries[v];
        if blocked {
            if !was_blocked {
                events.push(MsixEvent::Mask(vector));
            }
            return;
        }
        if entry.routed != Some(entry.msg) {
            entry.routed = Some(entry.msg);
            events.push(MsixEvent::Route { vector, msg: entry.msg });
        }
        if was_blocked {
            events.push(MsixEvent::Unmask(vector));
            let bit = 1 << (v % 64);
            if self.pending[v / 64] & bit != 0 {
                self.pending[v / 64] &= !bit;
                events.push(MsixEvent::Deliver { vector, msg: entry.msg });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MSG: MsiMessage = MsiMessage { address: 0xfee0_1000, data: 0x4041 };

    fn read32(t: &MsixTable, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read_table(offset, &mut b);
        u32::from_le_bytes(b)
    }

    fn write32(t: &mut MsixTable, offset: u64, v: u32) -> Vec<MsixEvent> {
        t.write_table(offset, &v.to_le_bytes())
    }

    fn entry(v: u16, reg: usize) -> u64 {
        u64::from(v) * ENTRY_SIZE + reg as u64
    }

    /// __pci_write_msi_msg: address low, address high, data (the entry masked meanwhile).
    fn write_msg(t: &mut MsixTable, v: u16, msg: MsiMessage) -> Vec<MsixEvent> {
        let mut events = write32(t, entry(v, PCI_MSIX_ENTRY_LOWER_ADDR), msg.address as u32);
        events.extend(write32(t, entry(v, PCI_MSIX_ENTRY_UPPER_ADDR), (msg.address >> 32) as u32));
        events.extend(write32(t, entry(v, PCI_MSIX_ENTRY_DATA), msg.data));
        events
    }

    fn set_masked(t: &mut MsixTable, v: u16, masked: bool) -> Vec<MsixEvent> {
        write32(t, entry(v, PCI_MSIX_ENTRY_VECTOR_CTRL), u32::from(masked))
    }

    fn pba(t: &MsixTable, offset: u64) -> u64 {
        let mut b = [0u8; 8];
        t.read_pba(offset, &mut b);
        u64::from_le_bytes(b)
    }

    #[test]
    fn test_reset_state_every_vector_masked_and_zero() {
        let t = MsixTable::new(4);
        assert_eq!((t.vectors(), t.table_len(), t.pba_len()), (4, 64, 8));
        for v in 0..4 {
            assert_eq!(read32(&t, entry(v, PCI_MSIX_ENTRY_LOWER_ADDR)), 0);
            assert_eq!(read32(&t, entry(v, PCI_MSIX_ENTRY_DATA)), 0);
            assert_eq!(read32(&t, entry(v, PCI_MSIX_ENTRY_VECTOR_CTRL)), PCI_MSIX_ENTRY_CTRL_MASKBIT);
        }
        assert_eq!(pba(&t, 0), 0);
        assert_eq!(MsixTable::new(0).vectors(), 1);
        assert_eq!(MsixTable::new(u16::MAX).vectors(), MSIX_MAX_VECTORS);
    }

    #[test]
    fn test_linux_enable_program_unmask() {
        let mut t = MsixTable::new(8);
        // msix_capability_init: enable with the function masked, mask every entry.
        assert!(t.set_control(true, true).is_empty());
        for v in 0..8 {
            assert!(set_masked(&mut t, v, true).is_empty());
        }
        // The message is written while masked: nothing to route yet.
        assert!(write_msg(&mut t, 3, MSG).is_empty());
        assert_eq!(read32(&t, entry(3, PCI_MSIX_ENTRY_DATA)), MSG.data);
        // Clear the function mask: every vector is still masked on its own.
        assert!(t.set_control(true, false).is_empty());
        // request_irq unmasks the vector: one route with the whole message, then unmask.
        assert_eq!(set_masked(&mut t, 3, false), vec![MsixEvent::Route { vector: 3, msg: MSG }, MsixEvent::Unmask(3)]);
        assert_eq!(t.fire(3), Fire::Deliver(MSG));
        assert_eq!(t.fire(2), Fire::Pending);
    }

    #[test]
    fn test_affinity_change_routes_once_on_unmask() {
        let mut t = MsixTable::new(2);
        t.set_control(true, false);
        write_msg(&mut t, 0, MSG);
        set_masked(&mut t, 0, false);
        // Linux masks an unmasked entry before rewriting it.
        assert_eq!(set_masked(&mut t, 0, true), vec![MsixEvent::Mask(0)]);
        let moved = MsiMessage { address: 0xfee0_2000, data: 0x4051 };
        assert!(write_msg(&mut t, 0, moved).is_empty());
        assert_eq!(
            set_masked(&mut t, 0, false),
            vec![MsixEvent::Route { vector: 0, msg: moved }, MsixEvent::Unmask(0)]
        );
        // Unmasking again with the same message only unmasks.
        set_masked(&mut t, 0, true);
        assert_eq!(set_masked(&mut t, 0, false), vec![MsixEvent::Unmask(0)]);
    }

    #[test]
    fn test_message_written_while_unmasked_routes_at_once() {
        let mut t = MsixTable::new(1);
        t.set_control(true, false);
        set_masked(&mut t, 0, false);
        let changed = MsiMessage { data: 0x22, ..Default::default() };
        assert_eq!(
            write32(&mut t, entry(0, PCI_MSIX_ENTRY_DATA), 0x22),
            vec![MsixEvent::Route { vector: 0, msg: changed }]
        );
    }

    #[test]
    fn test_pending_while_masked_delivered_on_unmask() {
        let mut t = MsixTable::new(100);
        t.set_control(true, false);
        write_msg(&mut t, 70, MSG);
        assert_eq!(t.fire(70), Fire::Pending);
        assert_eq!(pba(&t, 8), 1 << 6);
        // The dword halves of the PBA's second qword.
        let mut b = [0u8; 4];
        t.read_pba(8, &mut b);
        assert_eq!(u32::from_le_bytes(b), 1 << 6);
        t.read_pba(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0);
        assert_eq!(
            set_masked(&mut t, 70, false),
            vec![
                MsixEvent::Route { vector: 70, msg: MSG },
                MsixEvent::Unmask(70),
                MsixEvent::Deliver { vector: 70, msg: MSG }
            ]
        );
        assert_eq!(pba(&t, 8), 0);
    }

    #[test]
    fn test_function_mask_holds_and_releases_every_vector() {
        let mut t = MsixTable::new(2);
        t.set_control(true, false);
        for v in 0..2 {
            write_msg(&mut t, v, MSG);
            set_masked(&mut t, v, false);
        }
        assert_eq!(t.set_control(true, true), vec![MsixEvent::Mask(0), MsixEvent::Mask(1)]);
        assert_eq!(t.fire(1), Fire::Pending);
        assert_eq!(
            t.set_control(true, false),
            vec![MsixEvent::Unmask(0), MsixEvent::Unmask(1), MsixEvent::Deliver { vector: 1, msg: MSG }]
        );
    }

    #[test]
    fn test_disabled_drops_interrupts() {
        let mut t = MsixTable::new(2);
        assert_eq!(t.fire(0), Fire::Dropped);
        t.set_control(true, false);
        set_masked(&mut t, 0, false);
        assert_eq!(t.set_control(false, false), vec![MsixEvent::Mask(0)]);
        assert_eq!(t.fire(0), Fire::Dropped);
        assert_eq!(t.fire(2), Fire::Dropped);
        assert_eq!(pba(&t, 0), 0);
    }

    #[test]
    fn test_qword_accesses() {
        let mut t = MsixTable::new(2);
        t.set_control(true, false);
        let address = 0x1_fee0_0000u64;
        assert!(t.write_table(entry(1, 0), &address.to_le_bytes()).is_empty());
        // Data and vector control in one qword: unmasks with the message complete.
        let data_ctrl = u64::from(MSG.data);
        let msg = MsiMessage { address, data: MSG.data };
        assert_eq!(
            t.write_table(entry(1, 8), &data_ctrl.to_le_bytes()),
            vec![MsixEvent::Route { vector: 1, msg }, MsixEvent::Unmask(1)]
        );
        let mut b = [0u8; 8];
        t.read_table(entry(1, 0), &mut b);
        assert_eq!(u64::from_le_bytes(b), address);
    }

    #[test]
    fn test_odd_accesses_read_all_ones_and_are_dropped() {
        let mut t = MsixTable::new(2);
        t.set_control(true, false);
        let mut b2 = [0u8; 2];
        t.read_table(0, &mut b2);
        assert_eq!(b2, [0xff; 2]);
        let mut b4 = [0u8; 4];
        t.read_table(2, &mut b4);
        assert_eq!(b4, [0xff; 4]);
        let mut b8 = [0u8; 8];
        t.read_table(4, &mut b8);
        assert_eq!(b8, [0xff; 8]);
        t.read_table(t.table_len(), &mut b4);
        assert_eq!(b4, [0xff; 4]);
        t.read_pba(t.pba_len(), &mut b4);
        assert_eq!(b4, [0xff; 4]);
        t.read_table(u64::MAX - 3, &mut b4);
        assert_eq!(b4, [0xff; 4]);
        // Dropped writes: a byte store to the mask bit, a store past the table.
        assert!(t.write_table(entry(0, PCI_MSIX_ENTRY_VECTOR_CTRL), &[0]).is_empty());
        let past = t.table_len();
        assert!(write32(&mut t, past, 0).is_empty());
        assert!(t.write_table(entry(0, 6), &[0; 4]).is_empty());
        assert_eq!(read32(&t, entry(0, PCI_MSIX_ENTRY_VECTOR_CTRL)), PCI_MSIX_ENTRY_CTRL_MASKBIT);
        assert_eq!(read32(&t, entry(0, PCI_MSIX_ENTRY_LOWER_ADDR)), 0);
    }

    #[test]
    fn test_vector_control_reserved_bits_read_zero() {
        let mut t = MsixTable::new(1);
        write32(&mut t, entry(0, PCI_MSIX_ENTRY_VECTOR_CTRL), !0);
        assert_eq!(read32(&t, entry(0, PCI_MSIX_ENTRY_VECTOR_CTRL)), PCI_MSIX_ENTRY_CTRL_MASKBIT);
        write32(&mut t, entry(0, PCI_MSIX_ENTRY_VECTOR_CTRL), !PCI_MSIX_ENTRY_CTRL_MASKBIT);
        assert_eq!(read32(&t, entry(0, PCI_MSIX_ENTRY_VECTOR_CTRL)), 0);
    }
}
