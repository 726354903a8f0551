//! The MultiProcessor Specification 1.4 tables a PC's firmware leaves in low memory: the
//! MP floating pointer, at the start of the EBDA, and the MP configuration table it points
//! to, at the top of the BIOS area below the reset vector.
//!
//! Why a machine with ACPI has them: every x86 Linux looks for the floating pointer early
//! in `setup_arch` (`find_smp_config`), in its first KiB, the last KiB of base memory and
//! the 64 KiB BIOS segment, 16 bytes at a time, remapping each step (`early_memremap`,
//! a TLB flush per page). Without one all 4,200 steps run: 60 ms of a nested boot, traced
//! through L1's `kvm_exit` samples. Found at the first step of the second region, the scan
//! ends there. With the MADT present Linux takes the CPUs and the IOAPIC from ACPI and
//! reads no further than the floating pointer; this table is what `acpi=off` would see:
//! the same CPUs and IOAPIC, ISA interrupts 1:1 on its pins, as the MADT (no overrides).
//!
//! Written by hand from the specification: rust-vmm has no crate for it (Firecracker and
//! Cloud Hypervisor each keep their own in-tree).

use std::ops::Range;

use gdrvm_model::layout;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::cpu_topology::CpuPlace;

/// Where the floating pointer goes: the first paragraph of the EBDA, the first place of
/// the second region Linux scans (the top KiB of 640 KiB).
pub const FLOATING_POINTER_START: u64 = layout::EBDA_START;

/// The specification revision both structures carry (1.4).
const SPEC_REVISION: u8 = 4;
/// Local APIC version KVM's in-kernel APIC reports (integrated, 0x14).
const LAPIC_VERSION: u8 = 0x14;
/// IOAPIC version KVM's in-kernel IOAPIC reports (0x11, 24 pins).
const IOAPIC_VERSION: u8 = 0x11;
/// Processor signature (family 6) and feature flags (FPU, APIC) in the processor entries:
/// informational, Linux takes neither from here.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = 1 | (1 << 9);
/// The ISA interrupts routed to the IOAPIC (2 is the PICs' cascade, never a device's).
const ISA_IRQS: [u8; 15] = [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15];
/// Header of the configuration table, in bytes.
const HEADER_LEN: usize = 44;

/// Why the tables could not be written.
#[derive(Debug, thiserror::Error)]
pub enum MpTableError {
    /// The configuration table does not fit between the ACPI tables and the reset vector.
    #[error("the MP configuration table ({size} bytes) does not fit in [{:#x}, {:#x})", room.start, room.end)]
    NoRoom {
        /// Its size.
        size: usize,
        /// Where it had to fit.
        room: Range<u64>,
    },
    /// Writing into guest memory failed.
    #[error("cannot write the MP tables into guest memory")]
    GuestWrite,
}

/// Entry types of the configuration table.
#[repr(u8)]
enum Entry {
    Processor = 0,
    Bus = 1,
    IoApic = 2,
    IoInterrupt = 3,
    LocalInterrupt = 4,
}

/// Interrupt types of the assignment entries.
const INT_VECTORED: u8 = 0;
const INT_NMI: u8 = 1;
const INT_EXTINT: u8 = 3;

/// The configuration table for `cpus` (the first is the boot processor) and the IOAPIC
/// `ioapic_id`, checksummed.
pub fn config_table(cpus: &[CpuPlace], ioapic_id: u8) -> Vec<u8> {
    let mut t = vec![0u8; HEADER_LEN];
    let mut entries = 0u16;
    for (i, cpu) in cpus.iter().enumerate() {
        // The config keeps APIC ids below 255 (as the MADT's 8-bit entries need).
        let flags = 1 | if i == 0 { 2 } else { 0 };
        t.extend_from_slice(&[Entry::Processor as u8, cpu.apic_id as u8, LAPIC_VERSION, flags]);
        t.extend_from_slice(&CPU_SIGNATURE.to_le_bytes());
        t.extend_from_slice(&CPU_FEATURES.to_le_bytes());
        t.extend_from_slice(&[0; 8]);
        entries += 1;
    }
    t.extend_from_slice(&[Entry::Bus as u8, 0]);
    t.extend_from_slice(b"ISA   ");
    t.extend_from_slice(&[Entry::IoApic as u8, ioapic_id, IOAPIC_VERSION, 1]);
    t.extend_from_slice(&(layout::IOAPIC_START as u32).to_le_bytes());
    entries += 2;
    for irq in ISA_IRQS {
        // Flags 0: the bus's own polarity and trigger (ISA: active high, edge).
        t.extend_from_slice(&[Entry::IoInterrupt as u8, INT_VECTORED, 0, 0, 0, irq, ioapic_id, irq]);
        entries += 1;
    }
    // Virtual wire: the PIC on every local APIC's LINT0, NMI on LINT1.
    for (kind, lint) in [(INT_EXTINT, 0), (INT_NMI, 1)] {
        t.extend_from_slice(&[Entry::LocalInterrupt as u8, kind, 0, 0, 0, 0, 0xff, lint]);
        entries += 1;
    }
    t[0..4].copy_from_slice(b"PCMP");
    let len = t.len() as u16;
    t[4..6].copy_from_slice(&len.to_le_bytes());
    t[6] = SPEC_REVISION;
    t[8..16].copy_from_slice(b"GDRVM   ");
    t[16..28].copy_from_slice(b"GDRVM NODE  ");
    t[34..36].copy_from_slice(&entries.to_le_bytes());
    t[36..40].copy_from_slice(&(layout::LAPIC_START as u32).to_le_bytes());
    t[7] = checksum(&t);
    t
}

/// The 16-byte floating pointer to a configuration table at `table`.
pub fn floating_pointer(table: u64) -> [u8; 16] {
    let mut f = [0u8; 16];
    f[0..4].copy_from_slice(b"_MP_");
    f[4..8].copy_from_slice(&(table as u32).to_le_bytes());
    f[8] = 1; // Length in 16-byte paragraphs.
    f[9] = SPEC_REVISION;
    // Feature bytes stay 0: a configuration table is present, no IMCR (virtual wire mode).
    f[10] = checksum(&f);
    f
}

/// The byte that makes `bytes` sum to zero, given a zero where it goes.
fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |a, b| a.wrapping_sub(*b))
}

/// Writes both tables: the configuration table as high in `room` as it fits (16-byte
/// aligned), the floating pointer at [`FLOATING_POINTER_START`]. Returns where the
/// configuration table went.
pub fn write(
    mem: &GuestMemoryMmap,
    cpus: &[CpuPlace],
    ioapic_id: u8,
    room: Range<u64>,
) -> Result<Range<u64>, MpTableError> {
    let table = config_table(cpus, ioapic_id);
    let start = room
        .end
        .checked_sub(table.len() as u64)
        .map(|s| s & !0xf)
        .filter(|s| *s >= room.start)
        .ok_or(MpTableError::NoRoom { size: table.len(), room: room.clone() })?;
    mem.write_slice(&table, GuestAddress(start)).map_err(|_| MpTableError::GuestWrite)?;
    mem.write_slice(&floating_pointer(start), GuestAddress(FLOATING_POINTER_START))
        .map_err(|_| MpTableError::GuestWrite)?;
    Ok(start..start + table.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_topology;

    fn sums_to_zero(b: &[u8]) -> bool {
        b.iter().fold(0u8, |a, x| a.wrapping_add(*x)) == 0
    }

    #[test]
    fn test_config_table_lists_cpus_bus_ioapic_and_interrupts() {
        let cpus = cpu_topology::layout(4, &[]);
        let t = config_table(&cpus, 4);
        assert!(sums_to_zero(&t));
        assert_eq!(&t[0..4], b"PCMP");
        assert_eq!(u16::from_le_bytes([t[4], t[5]]) as usize, t.len());
        // 4 processors, a bus, the IOAPIC, 15 ISA interrupts, 2 local interrupts.
        assert_eq!(u16::from_le_bytes([t[34], t[35]]), 4 + 2 + 15 + 2);
        assert_eq!(t.len(), HEADER_LEN + 4 * 20 + 8 + 8 + 15 * 8 + 2 * 8);
        assert_eq!(u32::from_le_bytes(t[36..40].try_into().unwrap()), 0xfee0_0000);
        let cpu = |i: usize| &t[HEADER_LEN + i * 20..HEADER_LEN + (i + 1) * 20];
        assert_eq!(&cpu(0)[..4], &[0, cpus[0].apic_id as u8, LAPIC_VERSION, 3], "enabled boot processor");
        assert_eq!(&cpu(3)[..4], &[0, cpus[3].apic_id as u8, LAPIC_VERSION, 1]);
        let ioapic = &t[HEADER_LEN + 80 + 8..HEADER_LEN + 80 + 16];
        assert_eq!(ioapic, &[2, 4, IOAPIC_VERSION, 1, 0x00, 0x00, 0xc0, 0xfe]);
        // IRQ 4 (COM1) on pin 4.
        let irq4 = &t[HEADER_LEN + 96 + 3 * 8..HEADER_LEN + 96 + 4 * 8];
        assert_eq!(irq4, &[3, INT_VECTORED, 0, 0, 0, 4, 4, 4]);
    }

    #[test]
    fn test_floating_pointer_points_at_the_table() {
        let f = floating_pointer(0xffe00);
        assert!(sums_to_zero(&f));
        assert_eq!(&f[0..4], b"_MP_");
        assert_eq!(u32::from_le_bytes(f[4..8].try_into().unwrap()), 0xffe00);
        assert_eq!((f[8], f[9]), (1, 4));
    }

    #[test]
    fn test_write_places_the_table_high_and_the_pointer_in_the_ebda() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let cpus = cpu_topology::layout(2, &[]);
        let at = write(&mem, &cpus, 2, 0xe0000..0xffff0).unwrap();
        assert_eq!(at.start % 16, 0);
        assert!(at.end <= 0xffff0 && at.end + 16 > 0xffff0);
        let mut f = [0u8; 16];
        mem.read_slice(&mut f, GuestAddress(FLOATING_POINTER_START)).unwrap();
        assert_eq!(f, floating_pointer(at.start));
        let mut t = vec![0u8; (at.end - at.start) as usize];
        mem.read_slice(&mut t, GuestAddress(at.start)).unwrap();
        assert_eq!(t, config_table(&cpus, 2));
    }

    #[test]
    fn test_no_room_is_an_error_naming_the_size() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let e = write(&mem, &cpu_topology::layout(8, &[]), 8, 0xfff00..0xffff0).unwrap_err();
        assert!(e.to_string().contains("bytes) does not fit in [0xfff00, 0xffff0)"), "{e}");
    }
}
