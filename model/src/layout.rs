//! The guest-physical memory map, the one definition both the VMM and the node model use:
//! the boot structures in low memory, the BIOS area, RAM below the MMIO hole and again from
//! 4 GiB, the hole itself (32-bit PCI window, ECAM, IOAPIC, LAPIC) and the 64-bit PCI
//! window above RAM, and the e820 map that tells the kernel so.

/// Start of the page holding the GDT used for the boot CPU's entry state.
pub const BOOT_GDT_START: u64 = 0x500;
/// Boot IDT (empty; the kernel installs its own).
pub const BOOT_IDT_START: u64 = 0x520;
/// PVH `hvm_start_info`.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH module list (the initrd).
pub const PVH_MODLIST_START: u64 = 0x6040;
/// PVH memory map table.
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Linux `boot_params` (the "zero page") for the 64-bit boot protocol.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the boot CPU.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity page tables for the 64-bit entry: PML4, PDPT, PD.
pub const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory (2 MiB pages covering the first 1 GiB).
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Longest command line accepted (the kernel's COMMAND_LINE_SIZE on x86_64).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// End of conventional low memory (start of the EBDA).
pub const EBDA_START: u64 = 0x9fc00;
/// Firmware tables: RSDP first (where legacy scans look), the others after it.
pub const ACPI_START: u64 = 0xe0000;
/// End of the BIOS area.
pub const BIOS_END: u64 = 0x10_0000;
/// Where the kernel may be loaded from (the ELF's physical addresses are at or above this).
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit MMIO hole (PCI window, ECAM, IOAPIC, LAPIC); RAM resumes at 4 GiB.
pub const MMIO_HOLE_START: u64 = 0xc000_0000;
/// Start of the 32-bit PCI MMIO window: the bottom of the MMIO hole.
pub const MMIO32_BASE: u64 = MMIO_HOLE_START;
/// ECAM (PCIe enhanced configuration space): 1 MiB for each of the 256 buses of segment 0.
pub const ECAM_BASE: u64 = 0xe000_0000;
/// ECAM size.
pub const ECAM_SIZE: u64 = 256 << 20;
/// End (exclusive) of the 32-bit PCI MMIO window: ECAM follows it.
pub const MMIO32_END: u64 = ECAM_BASE;
/// IOAPIC MMIO base.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC MMIO base.
pub const LAPIC_START: u64 = 0xfee0_0000;
/// KVM's TSS (three pages, needed on Intel) just below the BIOS flash area.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// KVM's identity-map page (Intel real-mode emulation), the page before the TSS.
pub const KVM_IDENTITY_MAP_ADDRESS: u64 = 0xfffb_c000;
/// First address above 4 GiB, where RAM that does not fit below the MMIO hole resumes.
pub const FOUR_GIB: u64 = 0x1_0000_0000;
/// Where the platform decodes addresses itself, ahead of any BAR: ECAM, then the IOAPIC,
/// the LAPIC and KVM's pages, up to 4 GiB. A BAR the guest moves over it is not reached
/// there, as a root complex decodes its own ranges first; were it mapped, the guest's own
/// configuration accesses (or interrupts) would land in the device.
pub const PLATFORM_DECODED: std::ops::Range<u64> = ECAM_BASE..FOUR_GIB;

/// Whether `size` bytes at `address` overlap [`PLATFORM_DECODED`].
pub fn overlaps_platform(address: u64, size: u64) -> bool {
    address < PLATFORM_DECODED.end && PLATFORM_DECODED.start < address.saturating_add(size)
}

/// End (exclusive) of the 64-bit PCI MMIO window: 46 physical address bits, what server
/// CPUs have at least. The VMM checks the highest address against the vCPU's address bits.
pub const MMIO64_END: u64 = 1 << 46;
/// The 64-bit PCI window starts on a GiB boundary.
const MMIO64_ALIGN: u64 = 1 << 30;

/// The kind of an e820 range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum E820Kind {
    /// Usable RAM.
    Ram = 1,
    /// Reserved (firmware tables, BIOS area).
    Reserved = 2,
}

/// One e820 range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    /// First address.
    pub addr: u64,
    /// Length in bytes.
    pub size: u64,
    /// What the range is.
    pub kind: E820Kind,
}

/// The guest RAM ranges `(start, length)` for `memory` bytes: below the MMIO hole, then
/// above 4 GiB.
pub fn ram_ranges(memory: u64) -> Vec<(u64, u64)> {
    if memory <= MMIO_HOLE_START {
        vec![(0, memory)]
    } else {
        vec![(0, MMIO_HOLE_START), (FOUR_GIB, memory - MMIO_HOLE_START)]
    }
}

/// Highest address + 1 of RAM below 4 GiB.
pub fn low_ram_end(memory: u64) -> u64 {
    memory.min(MMIO_HOLE_START)
}

/// First address of the 64-bit PCI window for a guest with `memory` bytes of RAM: the
/// first GiB boundary above both RAM and 4 GiB.
pub fn mmio64_base(memory: u64) -> u64 {
    let ram_end = ram_ranges(memory).last().map_or(0, |&(start, len)| start + len);
    ram_end.max(FOUR_GIB).next_multiple_of(MMIO64_ALIGN)
}

/// The e820 map for `memory` bytes of RAM.
pub fn e820_map(memory: u64) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry { addr: 0, size: EBDA_START, kind: E820Kind::Ram },
        E820Entry { addr: EBDA_START, size: BIOS_END - EBDA_START, kind: E820Kind::Reserved },
    ];
    let low = low_ram_end(memory);
    if low > HIMEM_START {
        map.push(E820Entry { addr: HIMEM_START, size: low - HIMEM_START, kind: E820Kind::Ram });
    }
    // PCIe ECAM: reserved, so Linux trusts MCFG already at its early check.
    map.push(E820Entry { addr: ECAM_BASE, size: ECAM_SIZE, kind: E820Kind::Reserved });
    if memory > MMIO_HOLE_START {
        map.push(E820Entry { addr: FOUR_GIB, size: memory - MMIO_HOLE_START, kind: E820Kind::Ram });
    }
    map
}

/// Guest-physical ranges of each NUMA node's RAM: the nodes take consecutive slices of
/// guest RAM in order, each split where RAM is split around the MMIO hole. Returns
/// `(node, start, length)`.
pub fn numa_ranges(node_memory: &[u64]) -> Vec<(u32, u64, u64)> {
    let mut out = Vec::new();
    let ram = ram_ranges(node_memory.iter().sum());
    let (mut range, mut used) = (0, 0u64);
    for (node, &size) in (0u32..).zip(node_memory) {
        let mut left = size;
        while left > 0 && range < ram.len() {
            let (start, len) = ram[range];
            let take = left.min(len - used);
            out.push((node, start + used, take));
            left -= take;
            used += take;
            if used == len {
                range += 1;
                used = 0;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn test_platform_ranges_are_ecam_to_4g() {
        assert!(!overlaps_platform(MMIO32_END - 0x1000, 0x1000), "the top of the 32-bit window is a BAR's");
        assert!(overlaps_platform(MMIO32_END - 0x1000, 0x1001));
        assert!(overlaps_platform(ECAM_BASE + (4 << 20), 0x20000));
        assert!(overlaps_platform(LAPIC_START, 0x1000));
        assert!(!overlaps_platform(FOUR_GIB, 1 << 30));
        assert!(overlaps_platform(0, u64::MAX), "no overflow");
    }

    #[test]
    fn test_e820_small_guest() {
        let map = e820_map(512 * MIB);
        assert_eq!(
            map,
            vec![
                E820Entry { addr: 0, size: 0x9fc00, kind: E820Kind::Ram },
                E820Entry { addr: 0x9fc00, size: 0x60400, kind: E820Kind::Reserved },
                E820Entry { addr: 0x10_0000, size: 512 * MIB - 0x10_0000, kind: E820Kind::Ram },
                E820Entry { addr: 0xe000_0000, size: 256 * MIB, kind: E820Kind::Reserved },
            ]
        );
        let ram: u64 = map.iter().filter(|e| e.kind == E820Kind::Ram).map(|e| e.size).sum();
        assert!(ram > 511 * MIB);
    }

    #[test]
    fn test_numa_ranges_follow_ram_around_the_hole() {
        assert_eq!(numa_ranges(&[512 * MIB, 512 * MIB]), vec![(0, 0, 512 * MIB), (1, 512 * MIB, 512 * MIB)]);
        // 2 GiB + 2 GiB: node 1 starts below the hole and continues above 4 GiB.
        let r = numa_ranges(&[2 * GIB, 2 * GIB]);
        assert_eq!(r, vec![(0, 0, 2 * GIB), (1, 2 * GIB, GIB), (1, FOUR_GIB, GIB)]);
        assert_eq!(numa_ranges(&[GIB]), vec![(0, 0, GIB)]);
    }

    #[test]
    fn test_e820_splits_around_mmio_hole() {
        let map = e820_map(8 * GIB);
        let high = map.last().unwrap();
        assert_eq!(high.addr, FOUR_GIB);
        assert_eq!(high.size, 8 * GIB - MMIO_HOLE_START);
        assert_eq!(map[2].addr + map[2].size, MMIO_HOLE_START);
        assert_eq!((map[3].addr, map[3].kind), (ECAM_BASE, E820Kind::Reserved));
        assert_eq!(ram_ranges(8 * GIB), vec![(0, MMIO_HOLE_START), (FOUR_GIB, 5 * GIB)]);
        assert!(map.windows(2).all(|w| w[0].addr + w[0].size <= w[1].addr));
    }

    #[test]
    fn test_mmio64_window_starts_above_ram_and_4gib() {
        assert_eq!(mmio64_base(GIB), FOUR_GIB);
        assert_eq!(mmio64_base(MMIO_HOLE_START), FOUR_GIB);
        // 3 GiB + 64 MiB: 64 MiB above 4 GiB, so the window starts at 5 GiB.
        assert_eq!(mmio64_base(MMIO_HOLE_START + 64 * MIB), 5 * GIB);
        assert_eq!(mmio64_base(8 * GIB), 9 * GIB);
    }
}
