//! What a guest's configuration write meant for the machine, found by comparing the
//! VMM-owned registers before and after it: BARs that moved, appeared or disappeared,
//! memory decode and bus mastering switched, MSI-X enabled or masked. The VMM applies the
//! effects after releasing the function's lock (crosvm's `ConfigWriteResult`, Cloud
//! Hypervisor's `BarReprogrammingParams`).
//!
//! Written by hand: a pure comparison of two register images; no rust-vmm crate has one.
//!
//! A BAR is live, and has an address the VMM maps, only while memory decode is on and its
//! registers do not read back a sizing pattern (what writing all-ones leaves: the BAR's
//! writable bits). Linux clears decode before sizing a BAR and before rewriting a 64-bit
//! one, so on Linux only the command write that sets decode again maps the BAR. A guest that
//! rewrites a 64-bit BAR with decode on moves it twice (low half, then high half): every
//! change of the combined address is reported, and the VMM applies moves idempotently. A
//! 64-bit BAR is taken as being sized only by its upper register: its lower register alone
//! reading back the writable bits is also a real placement (the top of a 4 GiB block).

use crate::pci::device::BarInfo;
use crate::pci_regs::*;

/// Everything one configuration write changed that the VMM must act on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigWriteEffects {
    /// BARs whose live address changed, in the order the layout lists them.
    pub bars: Vec<BarChange>,
    /// Memory space decode switched on (`Some(true)`) or off.
    pub memory_decode: Option<bool>,
    /// Bus mastering (the function's DMA) switched on or off.
    pub bus_master: Option<bool>,
    /// The MSI-X capability's enable or function-mask bit changed: the new state.
    pub msix: Option<MsixControl>,
    /// What the write to the (VMM-emulated) MSI capability asked for.
    pub msi: Vec<crate::pci::MsiEvent>,
    /// The write initiated a Function Level Reset: every register may have changed, and
    /// the function's MSI-X table is back to power-on (every vector masked).
    pub reset: bool,
}

/// A BAR's live address before and after a write; `None` when it decodes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarChange {
    /// BAR register index.
    pub index: u8,
    /// Where the BAR was live, if it was.
    pub from: Option<u64>,
    /// Where the BAR is live now, if it is.
    pub to: Option<u64>,
}

/// The MSI-X capability's control bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixControl {
    /// MSI-X Enable.
    pub enabled: bool,
    /// Function Mask: every vector masked whatever its own mask bit.
    pub masked: bool,
}

impl ConfigWriteEffects {
    /// The effects of turning configuration bytes `old` into `new` (whole configuration
    /// spaces, from register 0), for a function with memory BARs `bars` and, if it has
    /// one, its MSI-X capability at `msix_cap`. Registers missing from a short image read
    /// as zero.
    pub fn between(old: &[u8], new: &[u8], bars: &[BarInfo], msix_cap: Option<usize>) -> Self {
        let command_bit = |bytes: &[u8], bit: u16| read16(bytes, PCI_COMMAND) & bit != 0;
        let changed = |bit: u16| {
            let now = command_bit(new, bit);
            (command_bit(old, bit) != now).then_some(now)
        };
        let bars = bars
            .iter()
            .filter_map(|bar| {
                let (from, to) = (live_address(old, bar), live_address(new, bar));
                (from != to).then_some(BarChange { index: bar.index, from, to })
            })
            .collect();
        let msix = msix_cap.and_then(|cap| {
            let control = |bytes: &[u8]| {
                let flags = read16(bytes, cap.saturating_add(PCI_MSIX_FLAGS));
                MsixControl { enabled: flags & PCI_MSIX_FLAGS_ENABLE != 0, masked: flags & PCI_MSIX_FLAGS_MASKALL != 0 }
            };
            let now = control(new);
            (control(old) != now).then_some(now)
        });
        ConfigWriteEffects {
            bars,
            memory_decode: changed(PCI_COMMAND_MEMORY),
            bus_master: changed(PCI_COMMAND_MASTER),
            msix,
            msi: Vec::new(),
            reset: false,
        }
    }

    /// Whether the write changed nothing the VMM acts on.
    pub fn is_empty(&self) -> bool {
        *self == ConfigWriteEffects::default()
    }
}

/// The address `bar` decodes in the register image `bytes`, if it decodes at all.
fn live_address(bytes: &[u8], bar: &BarInfo) -> Option<u64> {
    let registers = if bar.is_64bit { 2 } else { 1 };
    if usize::from(bar.index) + registers > 6 || read16(bytes, PCI_COMMAND) & PCI_COMMAND_MEMORY == 0 {
        return None;
    }
    let at = PCI_BASE_ADDRESS_0 + 4 * usize::from(bar.index);
    // The address bits writing all-ones leaves: the BAR's writable bits.
    let sizing = !(bar.size.max(16) - 1);
    let low = read32(bytes, at) & PCI_BASE_ADDRESS_MEM_MASK;
    if !bar.is_64bit {
        return (low != sizing as u32 & PCI_BASE_ADDRESS_MEM_MASK).then_some(u64::from(low));
    }
    let high = read32(bytes, at + 4);
    (high != (sizing >> 32) as u32).then_some(u64::from(high) << 32 | u64::from(low))
}

fn read16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(read(bytes, at))
}

fn read32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(read(bytes, at))
}

/// `N` bytes at `at`; zeros where the image ends first.
fn read<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    bytes.get(at..).and_then(|rest| rest.get(..N)).and_then(|b| b.try_into().ok()).unwrap_or([0; N])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::device::BarMapping;

    const MSIX_CAP: usize = 0x80;
    const BAR0: u64 = 0xfe00_0000;
    const BAR2: u64 = 0x38_0000_0000;
    const BAR4: u64 = 0x3c_0000_0000;

    fn bar(index: u8, size: u64, is_64bit: bool) -> BarInfo {
        BarInfo { index, size, is_64bit, prefetchable: is_64bit, mapping: BarMapping::Trapped }
    }

    /// BAR0: 16 MiB, 32-bit. BAR2: 16 GiB, 64-bit. BAR4: 32 MiB, 64-bit.
    fn layout() -> Vec<BarInfo> {
        vec![bar(0, 16 << 20, false), bar(2, 16 << 30, true), bar(4, 32 << 20, true)]
    }

    /// The VMM-owned registers of an endpoint as firmware leaves them, with a write mask,
    /// written the way the VMM's configuration space writes them.
    struct Function {
        bytes: Vec<u8>,
        wmask: Vec<u8>,
    }

    impl Function {
        fn new() -> Self {
            let mut f = Function { bytes: vec![0; 256], wmask: vec![0; 256] };
            f.set(PCI_COMMAND, u32::from(PCI_COMMAND_MEMORY), u32::from(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER));
            for (b, address) in layout().iter().zip([BAR0, BAR2, BAR4]) {
                let at = PCI_BASE_ADDRESS_0 + 4 * usize::from(b.index);
                let flags = if b.is_64bit { PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH } else { 0 };
                let writable = !(b.size - 1);
                f.set(at, address as u32 | flags, writable as u32 & PCI_BASE_ADDRESS_MEM_MASK);
                if b.is_64bit {
                    f.set(at + 4, (address >> 32) as u32, (writable >> 32) as u32);
                }
            }
            // Table size 64 (encoded as 63); enable and function mask writable.
            let msix_writable = PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL;
            f.set(MSIX_CAP, u32::from(PCI_CAP_ID_MSIX) | 63 << 16, u32::from(msix_writable) << 16);
            f
        }

        fn set(&mut self, at: usize, value: u32, mask: u32) {
            self.bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
            self.wmask[at..at + 4].copy_from_slice(&mask.to_le_bytes());
        }

        fn read32(&self, at: usize) -> u32 {
            read32(&self.bytes, at)
        }

        /// A guest write of `data` at `at`, and its effects.
        fn write(&mut self, at: usize, data: &[u8]) -> ConfigWriteEffects {
            let old = self.bytes.clone();
            for (i, v) in data.iter().enumerate() {
                let m = self.wmask[at + i];
                self.bytes[at + i] = (self.bytes[at + i] & !m) | (v & m);
            }
            ConfigWriteEffects::between(&old, &self.bytes, &layout(), Some(MSIX_CAP))
        }

        fn write16(&mut self, at: usize, v: u16) -> ConfigWriteEffects {
            self.write(at, &v.to_le_bytes())
        }

        fn write32(&mut self, at: usize, v: u32) -> ConfigWriteEffects {
            self.write(at, &v.to_le_bytes())
        }
    }

    fn change(index: u8, from: Option<u64>, to: Option<u64>) -> BarChange {
        BarChange { index, from, to }
    }

    #[test]
    fn test_linux_probe_sizes_bars_with_decode_off() {
        let mut f = Function::new();
        // __pci_read_base: decode off, then each BAR sized and restored.
        let off = f.write16(PCI_COMMAND, 0);
        assert_eq!(off.memory_decode, Some(false));
        assert_eq!(
            off.bars,
            vec![change(0, Some(BAR0), None), change(2, Some(BAR2), None), change(4, Some(BAR4), None)]
        );
        for index in [0usize, 2, 4] {
            let at = PCI_BASE_ADDRESS_0 + 4 * index;
            let low = f.read32(at);
            assert!(f.write32(at, !0).is_empty());
            assert!(f.write32(at, low).is_empty());
            if index > 0 {
                let high = f.read32(at + 4);
                assert!(f.write32(at + 4, !0).is_empty());
                assert!(f.write32(at + 4, high).is_empty());
            }
        }
        let on = f.write16(PCI_COMMAND, PCI_COMMAND_MEMORY);
        assert_eq!(on.memory_decode, Some(true));
        assert_eq!(
            on.bars,
            vec![change(0, None, Some(BAR0)), change(2, None, Some(BAR2)), change(4, None, Some(BAR4))]
        );
    }

    #[test]
    fn test_linux_moves_a_64bit_bar_with_decode_off() {
        let mut f = Function::new();
        let at = PCI_BASE_ADDRESS_0 + 4 * 4;
        let target = 0x40_0200_0000u64;
        // pci_std_update_resource: decode off, low half, high half, decode back on.
        assert_eq!(f.write16(PCI_COMMAND, 0).bars.len(), 3);
        assert!(f.write32(at, target as u32 | PCI_BASE_ADDRESS_MEM_TYPE_64).is_empty());
        assert!(f.write32(at + 4, (target >> 32) as u32).is_empty());
        let on = f.write16(PCI_COMMAND, PCI_COMMAND_MEMORY);
        assert_eq!(on.bars[2], change(4, None, Some(target)));
    }

    #[test]
    fn test_64bit_move_with_decode_on_reports_each_half() {
        let mut f = Function::new();
        let at = PCI_BASE_ADDRESS_0 + 4 * 4;
        let old = BAR4;
        let target = 0x40_0200_0000u64;
        let low = f.write32(at, target as u32);
        let intermediate = (old & !0xffff_ffff) | (target & 0xffff_ffff);
        assert_eq!(low.bars, vec![change(4, Some(old), Some(intermediate))]);
        let high = f.write32(at + 4, (target >> 32) as u32);
        assert_eq!(high.bars, vec![change(4, Some(intermediate), Some(target))]);
        // Writing the same value again changes nothing.
        assert!(f.write32(at + 4, (target >> 32) as u32).is_empty());
    }

    #[test]
    fn test_sizing_with_decode_on_is_not_a_move() {
        let mut f = Function::new();
        // A 32-bit BAR sized with decode on has no address until it is restored.
        let sized = f.write32(PCI_BASE_ADDRESS_0, !0);
        assert_eq!(sized.bars, vec![change(0, Some(BAR0), None)]);
        assert_eq!(f.read32(PCI_BASE_ADDRESS_0), !((16 << 20) - 1) & PCI_BASE_ADDRESS_MEM_MASK);
        let restored = f.write32(PCI_BASE_ADDRESS_0, BAR0 as u32);
        assert_eq!(restored.bars, vec![change(0, None, Some(BAR0))]);
        // The upper half of a 64-bit BAR likewise.
        let at = PCI_BASE_ADDRESS_0 + 4 * 3;
        assert_eq!(f.write32(at, !0).bars, vec![change(2, Some(BAR2), None)]);
        assert_eq!(f.write32(at, (BAR2 >> 32) as u32).bars, vec![change(2, None, Some(BAR2))]);
        // A 16 GiB BAR has no writable bits in its lower half: sizing it changes nothing.
        assert!(f.write32(at - 4, !0).is_empty());
    }

    #[test]
    fn test_64bit_bar_at_the_top_of_a_4gib_block_is_live() {
        let mut f = Function::new();
        let at = PCI_BASE_ADDRESS_0 + 4 * 4;
        // The low half reads back its writable bits, the high half is a real address.
        let top = 0x41_0000_0000u64 - (32 << 20);
        f.write16(PCI_COMMAND, 0);
        f.write32(at, top as u32);
        f.write32(at + 4, (top >> 32) as u32);
        let on = f.write16(PCI_COMMAND, PCI_COMMAND_MEMORY);
        assert_eq!(on.bars[2], change(4, None, Some(top)));
    }

    #[test]
    fn test_bus_master_and_unrelated_writes() {
        let mut f = Function::new();
        let master = f.write16(PCI_COMMAND, PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
        assert_eq!(
            master,
            ConfigWriteEffects { bus_master: Some(true), ..Default::default() },
            "bus mastering alone moves no BAR"
        );
        assert_eq!(f.write16(PCI_COMMAND, PCI_COMMAND_MEMORY).bus_master, Some(false));
        // Read-only bits and registers nothing watches.
        assert!(f.write32(PCI_VENDOR_ID, !0).is_empty());
        assert!(f.write(PCI_CACHE_LINE_SIZE, &[0x10]).is_empty());
    }

    #[test]
    fn test_msix_enable_then_unmask() {
        let mut f = Function::new();
        let at = MSIX_CAP + PCI_MSIX_FLAGS;
        // msix_capability_init: enable with the function masked, program, then unmask.
        let enable = f.write16(at, PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL);
        assert_eq!(enable.msix, Some(MsixControl { enabled: true, masked: true }));
        assert!(f.write16(at, PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL).is_empty());
        let unmask = f.write16(at, PCI_MSIX_FLAGS_ENABLE);
        assert_eq!(unmask.msix, Some(MsixControl { enabled: true, masked: false }));
        // A function without MSI-X reports nothing for the same bytes.
        let old = f.bytes.clone();
        f.write16(at, 0);
        assert_eq!(ConfigWriteEffects::between(&old, &f.bytes, &[], None), ConfigWriteEffects::default());
    }

    #[test]
    fn test_bad_layouts_and_short_images_never_panic() {
        let bars = [bar(5, 1 << 20, true), bar(9, 1 << 20, false), bar(0, 0, false)];
        let on = PCI_COMMAND_MEMORY.to_le_bytes();
        let e = ConfigWriteEffects::between(&[], &[0, 0, 0, 0, on[0], on[1]], &bars, Some(usize::MAX));
        assert_eq!(e.memory_decode, Some(true));
        // Only the zero-sized BAR 0 decodes (at 0); the others do not fit six registers.
        assert_eq!(e.bars, vec![change(0, None, Some(0))]);
    }
}
