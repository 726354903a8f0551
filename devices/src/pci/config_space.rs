//! One PCI function's 4 KiB configuration space: the bytes the guest reads and a mask of
//! the bits it may write. Sizing a BAR (write all-ones, read back) works through the mask
//! alone, as do bus numbers and bridge windows; nothing else reacts to writes, because the
//! functions behind this model are not backed by anything (their BARs read as all-ones).
//!
//! Layouts follow the PCI Local Bus 3.0 headers and PCI Express Base 4.0 chapter 7
//! (capability IDs 0x10 PCIe and 0x11 MSI-X, extended IDs 0x0d ACS and 0x0f ATS).

use super::regs::*;
use gdrvm_model::node::{Bar, BridgeWindows, FunctionKind, Link, LinkSpeed, Node, MSIX_VECTORS};

/// Size of a PCIe function's configuration space.
pub const CONFIG_SPACE_SIZE: usize = 4096;

/// Command register bits the guest may set: memory space, bus master, parity, SERR, INTx off.
const COMMAND_WRITABLE: u16 =
    PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_PARITY | PCI_COMMAND_SERR | PCI_COMMAND_INTX_DISABLE;

/// Where the capabilities sit.
const PCIE_CAP: usize = 0x40;
const MSIX_CAP: usize = 0x80;
/// The one extended capability a function has sits at the start of extended space.
const EXT_CAP: usize = PCI_CFG_SPACE_SIZE;

/// ACS capability bits offered on root and downstream ports: source validation, translation
/// blocking, P2P request redirect, completion redirect, upstream forwarding.
pub const ACS_CAPABILITIES: u16 = 0x001f;
/// ATS capability: page-aligned requests (invalidate queue depth 0 means 32).
const ATS_CAPABILITIES: u16 = PCI_ATS_CAP_PAGE_ALIGNED;

/// A configuration space and its writable-bit mask.
#[derive(Clone)]
pub struct ConfigSpace {
    bytes: Box<[u8; CONFIG_SPACE_SIZE]>,
    wmask: Box<[u8; CONFIG_SPACE_SIZE]>,
}

impl ConfigSpace {
    fn empty() -> Self {
        ConfigSpace { bytes: Box::new([0; CONFIG_SPACE_SIZE]), wmask: Box::new([0; CONFIG_SPACE_SIZE]) }
    }

    /// The configuration space of function `i` of `node`, with the addresses and bus
    /// numbers the model assigned already programmed (as firmware leaves them).
    ///
    /// The Command register starts at zero: decode and bus mastering off on bridges and
    /// endpoints alike, as UEFI firmware leaves what no firmware driver used (EDK2's PCI
    /// bus driver clears the bits it owns when it enumerates) and as Cloud Hypervisor and
    /// Firecracker boot their guests. Linux keeps the assigned addresses of a function
    /// whose decode is off and turns decode on when a driver or a port service enables the
    /// function; and it sizes the BARs of such a function without toggling decode around
    /// each one, which on a node like vela is 300 configuration writes fewer per boot.
    pub fn for_function(node: &Node, i: usize) -> Self {
        let f = &node.functions[i];
        let mut c = ConfigSpace::empty();
        c.set16(PCI_VENDOR_ID, f.vendor);
        c.set16(PCI_DEVICE_ID, f.device);
        c.set8(PCI_REVISION_ID, 0x01);
        c.set8(PCI_CLASS_PROG, (f.class & 0xff) as u8);
        c.set16(PCI_CLASS_DEVICE, (f.class >> 8) as u16);
        c.mask8(PCI_CACHE_LINE_SIZE, 0xff);
        c.mask8(PCI_INTERRUPT_LINE, 0xff);
        c.mask16(PCI_COMMAND, COMMAND_WRITABLE);
        if f.kind.is_bridge() {
            c.bridge_header(f.buses.unwrap_or_default(), f.windows.unwrap_or_default(), f.bdf.bus);
        } else {
            for bar in &f.bars {
                c.bar(bar);
            }
            if let Some((vendor, device)) = f.subsystem {
                c.set16(PCI_SUBSYSTEM_VENDOR_ID, vendor);
                c.set16(PCI_SUBSYSTEM_ID, device);
            }
        }
        let Some(port_type) = f.kind.pcie_port_type() else {
            return c;
        };
        c.set16(PCI_STATUS, PCI_STATUS_CAP_LIST);
        c.set8(PCI_CAPABILITY_LIST, PCIE_CAP as u8);
        let msix = f.msix_bar();
        let port_number = if f.kind == FunctionKind::SwitchDownstream { f.bdf.device } else { 0 };
        c.pcie_capability(
            port_type,
            f.link.unwrap_or(Link { speed: LinkSpeed::Gt2_5, width: 1 }),
            node.negotiated_link(i),
            port_number,
            if msix.is_some() { MSIX_CAP } else { 0 },
        );
        if let Some(bar) = msix {
            c.msix_capability(bar, MSIX_VECTORS);
        }
        if f.acs {
            c.acs_capability(f.acs_control);
        } else if f.ats {
            c.ats_capability();
        }
        c
    }

    /// The VMM's image of a passed-through function `i` of `node`: the BAR registers, at
    /// the addresses the model assigned (the device's own are host addresses the guest must
    /// never see), no expansion ROM, and shadows of the registers the VMM must watch but
    /// the device answers (command; MSI-X control at `msix_cap`). Decode starts off, as
    /// after the device's reset and as [`ConfigSpace::for_function`] leaves every function.
    pub fn for_passthrough(node: &Node, i: usize, msix_cap: Option<usize>) -> Self {
        let f = &node.functions[i];
        let mut c = ConfigSpace::empty();
        c.mask16(PCI_COMMAND, COMMAND_WRITABLE);
        for bar in &f.bars {
            c.bar(bar);
        }
        if let Some(cap) = msix_cap.filter(|c| c + PCI_MSIX_PBA <= PCI_CFG_SPACE_SIZE) {
            c.mask16(cap + PCI_MSIX_FLAGS, PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL);
        }
        c
    }

    /// The configuration bytes the VMM holds (for comparing before and after a write).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..]
    }

    /// Reads `data.len()` bytes at `offset`; all-ones beyond the space.
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        match self.bytes.get(offset..offset.saturating_add(data.len())) {
            Some(src) => data.copy_from_slice(src),
            None => data.fill(0xff),
        }
    }

    /// Sets every byte to `bytes` (the space as [`ConfigSpace::bytes`] had it earlier),
    /// whatever the mask: a reset to that moment. Bytes past `bytes`' end stay.
    pub fn restore(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(CONFIG_SPACE_SIZE);
        self.bytes[..n].copy_from_slice(&bytes[..n]);
    }

    /// Writes `data` at `offset`, keeping the bits the mask protects.
    pub fn write(&mut self, offset: usize, data: &[u8]) {
        let end = offset.saturating_add(data.len());
        let (Some(bytes), Some(mask)) = (self.bytes.get_mut(offset..end), self.wmask.get(offset..end)) else {
            return;
        };
        for ((b, m), v) in bytes.iter_mut().zip(mask).zip(data) {
            *b = (*b & !m) | (v & m);
        }
    }

    /// Appends capability `cap` (its ID in byte 0, its length as written; the next pointer
    /// in byte 1 is set here) to the end of the capability list, at the first dword after
    /// every capability already listed, and lets the guest write the bits `writable` sets
    /// (as long as `cap`, or shorter: the rest read-only). Starts the list if there is none.
    /// Returns where it went, or `None` when it does not fit in the first 256 bytes.
    pub(crate) fn append_capability(&mut self, cap: &[u8], writable: &[u8]) -> Option<usize> {
        let mut last = None;
        let mut end = PCI_STD_HEADER_SIZEOF;
        if self.read16(PCI_STATUS) & PCI_STATUS_CAP_LIST != 0 {
            let mut at = usize::from(self.bytes[PCI_CAPABILITY_LIST] & !3);
            // A list longer than 48 entries loops (Linux's PCI_FIND_CAP_TTL).
            for _ in 0..48 {
                if at < PCI_STD_HEADER_SIZEOF || at + 2 > PCI_CFG_SPACE_SIZE {
                    break;
                }
                end = end.max(at + self.capability_len(at));
                last = Some(at);
                at = usize::from(self.bytes[at + PCI_CAP_LIST_NEXT] & !3);
            }
        }
        let at = end.next_multiple_of(4);
        if cap.len() < 2 || at + cap.len() > PCI_CFG_SPACE_SIZE || writable.len() > cap.len() {
            return None;
        }
        self.bytes[at..at + cap.len()].copy_from_slice(cap);
        self.bytes[at + PCI_CAP_LIST_NEXT] = 0;
        self.wmask[at..at + writable.len()].copy_from_slice(writable);
        match last {
            Some(prev) => self.bytes[prev + PCI_CAP_LIST_NEXT] = at as u8,
            None => {
                self.set16(PCI_STATUS, self.read16(PCI_STATUS) | PCI_STATUS_CAP_LIST);
                self.set8(PCI_CAPABILITY_LIST, at as u8);
            }
        }
        Some(at)
    }

    /// Bytes the capability at `at` spans, as far as this model's capabilities go.
    fn capability_len(&self, at: usize) -> usize {
        match self.bytes[at + PCI_CAP_LIST_ID] {
            PCI_CAP_ID_EXP => PCI_CAP_EXP_ENDPOINT_SIZEOF_V2,
            PCI_CAP_ID_MSIX => PCI_CAP_MSIX_SIZEOF,
            PCI_CAP_ID_PM => PCI_PM_SIZEOF,
            // Vendor-specific: its length byte.
            PCI_CAP_ID_VNDR => usize::from(self.bytes[at + PCI_CAP_FLAGS]).max(PCI_CAP_FLAGS + 1),
            // MSI with 64-bit addresses and per-vector masking, the largest form.
            PCI_CAP_ID_MSI => 24,
            _ => 4,
        }
    }

    fn read16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.bytes[at], self.bytes[at + 1]])
    }

    fn set8(&mut self, at: usize, v: u8) {
        self.bytes[at] = v;
    }

    fn set16(&mut self, at: usize, v: u16) {
        self.bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn set32(&mut self, at: usize, v: u32) {
        self.bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn mask8(&mut self, at: usize, m: u8) {
        self.wmask[at] = m;
    }

    fn mask16(&mut self, at: usize, m: u16) {
        self.wmask[at..at + 2].copy_from_slice(&m.to_le_bytes());
    }

    fn mask32(&mut self, at: usize, m: u32) {
        self.wmask[at..at + 4].copy_from_slice(&m.to_le_bytes());
    }

    /// A memory BAR: address, type bits, and a mask that makes sizing read back its size.
    fn bar(&mut self, bar: &Bar) {
        let at = PCI_BASE_ADDRESS_0 + 4 * usize::from(bar.index);
        let prefetch = if bar.prefetchable { PCI_BASE_ADDRESS_MEM_PREFETCH } else { 0 };
        let flags = prefetch | if bar.is_64bit { PCI_BASE_ADDRESS_MEM_TYPE_64 } else { 0 };
        self.set32(at, (bar.address as u32 & PCI_BASE_ADDRESS_MEM_MASK) | flags);
        self.mask32(at, !((bar.size - 1) as u32) & PCI_BASE_ADDRESS_MEM_MASK);
        if bar.is_64bit {
            // The next BAR register holds the upper 32 bits.
            self.set32(at + 4, (bar.address >> 32) as u32);
            self.mask32(at + 4, !(((bar.size - 1) >> 32) as u32));
        }
    }

    /// The type-1 header: bus numbers and windows, no I/O window, no expansion ROM.
    fn bridge_header(&mut self, (secondary, subordinate): (u8, u8), windows: BridgeWindows, primary: u8) {
        self.set8(PCI_HEADER_TYPE, PCI_HEADER_TYPE_BRIDGE);
        self.set8(PCI_PRIMARY_BUS, primary);
        self.set8(PCI_SECONDARY_BUS, secondary);
        self.set8(PCI_SUBORDINATE_BUS, subordinate);
        // Primary, secondary and subordinate bus, secondary latency timer.
        self.mask32(PCI_PRIMARY_BUS, 0xffff_ffff);
        // Memory window: bits 31:20 of base and limit; base above limit means closed.
        let (base, limit) = windows.mem.map_or((0xfff0, 0), |w| ((w.base >> 16) as u16, (w.last() >> 16) as u16));
        self.set16(PCI_MEMORY_BASE, base & 0xfff0);
        self.set16(PCI_MEMORY_LIMIT, limit & 0xfff0);
        self.mask32(PCI_MEMORY_BASE, 0xfff0_fff0);
        // Prefetchable window, 64-bit. Closed, base 0xfff0_0000 is above limit 0xf_ffff in the
        // low halves with both upper halves 0, as Linux closes one: Linux ignores the upper
        // halves when the base's is above the limit's, so a closure only there reads as an
        // open window at 0.
        let (base, limit) = windows.pref.map_or((0xfff0_0000, 0), |w| (w.base, w.last()));
        self.set16(PCI_PREF_MEMORY_BASE, ((base >> 16) as u16 & 0xfff0) | PCI_PREF_RANGE_TYPE_64);
        self.set16(PCI_PREF_MEMORY_LIMIT, ((limit >> 16) as u16 & 0xfff0) | PCI_PREF_RANGE_TYPE_64);
        self.set32(PCI_PREF_BASE_UPPER32, (base >> 32) as u32);
        self.set32(PCI_PREF_LIMIT_UPPER32, (limit >> 32) as u32);
        self.mask32(PCI_PREF_MEMORY_BASE, 0xfff0_fff0);
        self.mask32(PCI_PREF_BASE_UPPER32, 0xffff_ffff);
        self.mask32(PCI_PREF_LIMIT_UPPER32, 0xffff_ffff);
        // Parity, SERR, ISA, VGA, VGA16, master abort, secondary bus reset.
        self.mask16(PCI_BRIDGE_CONTROL, 0x007f);
    }

    /// The PCI Express capability (version 2) with the link as configured and trained.
    fn pcie_capability(&mut self, port_type: u8, link: Link, trained: Option<Link>, port: u8, next: usize) {
        let at = PCIE_CAP;
        let is_endpoint = port_type == PCI_EXP_TYPE_ENDPOINT;
        let is_downstream = port_type == PCI_EXP_TYPE_ROOT_PORT || port_type == PCI_EXP_TYPE_DOWNSTREAM;
        self.set8(at + PCI_CAP_LIST_ID, PCI_CAP_ID_EXP);
        self.set8(at + PCI_CAP_LIST_NEXT, next as u8);
        let flags = (2 & PCI_EXP_FLAGS_VERS) | (u16::from(port_type) << PCI_EXP_FLAGS_TYPE.trailing_zeros());
        self.set16(at + PCI_EXP_FLAGS, flags);
        // Device capabilities: 256-byte max payload (encoding 1), role-based error reporting;
        // FLR on endpoints.
        let flr = if is_endpoint { PCI_EXP_DEVCAP_FLR } else { 0 };
        self.set32(at + PCI_EXP_DEVCAP, 0x1 | PCI_EXP_DEVCAP_RBER | flr);
        // Device control: relaxed ordering, no snoop, 512-byte max read request.
        self.set16(
            at + PCI_EXP_DEVCTL,
            PCI_EXP_DEVCTL_RELAX_EN | PCI_EXP_DEVCTL_NOSNOOP_EN | PCI_EXP_DEVCTL_READRQ_512B,
        );
        self.mask16(at + PCI_EXP_DEVCTL, 0x7fff);
        // Link capabilities: max speed, max width, data-link-active reporting on ports.
        let dllla_capable = if is_downstream { PCI_EXP_LNKCAP_DLLLARC } else { 0 };
        self.set32(
            at + PCI_EXP_LNKCAP,
            (u32::from(link.speed.encoding()) & PCI_EXP_LNKCAP_SLS)
                | (u32::from(link.width) << PCI_EXP_LNKCAP_MLW.trailing_zeros())
                | dllla_capable
                | (u32::from(port) << PCI_EXP_LNKCAP_PN.trailing_zeros()),
        );
        self.mask16(at + PCI_EXP_LNKCTL, 0x0fff);
        // Link status: the trained speed and width; link active when a port has a partner.
        let status = match trained {
            Some(t) => {
                let active = if is_downstream { PCI_EXP_LNKSTA_DLLLA } else { 0 };
                (u16::from(t.speed.encoding()) & PCI_EXP_LNKSTA_CLS)
                    | (u16::from(t.width) << PCI_EXP_LNKSTA_NLW.trailing_zeros())
                    | active
            }
            // Link down: 2.5 GT/s, no lanes.
            None => 0x0001,
        };
        self.set16(at + PCI_EXP_LNKSTA, status);
        if port_type == PCI_EXP_TYPE_ROOT_PORT {
            // Root control: system error and PME interrupt enables, CRS visibility.
            self.mask16(at + PCI_EXP_RTCTL, 0x001f);
        }
        // Link capabilities 2: every speed up to the maximum; Linux reads max_link_speed here.
        let speeds = (1u32 << (link.speed.encoding() + 1)) - 2;
        self.set32(at + PCI_EXP_LNKCAP2, speeds);
        // Link control 2: the target link speed.
        self.set16(at + PCI_EXP_LNKCTL2, u16::from(link.speed.encoding()));
        self.mask16(at + PCI_EXP_LNKCTL2, 0x003f);
        debug_assert!(at + PCI_CAP_EXP_ENDPOINT_SIZEOF_V2 <= MSIX_CAP);
    }

    /// MSI-X with its table at the start of BAR `bar` and the pending-bit array after it.
    fn msix_capability(&mut self, bar: &Bar, table_size: u16) {
        let at = MSIX_CAP;
        self.set8(at + PCI_CAP_LIST_ID, PCI_CAP_ID_MSIX);
        self.set8(at + PCI_CAP_LIST_NEXT, 0);
        self.set16(at + PCI_MSIX_FLAGS, table_size - 1);
        self.mask16(at + PCI_MSIX_FLAGS, PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL);
        // Table and PBA: offset in the BAR, BAR index in the low three bits.
        self.set32(at + PCI_MSIX_TABLE, u32::from(bar.index));
        self.set32(at + PCI_MSIX_PBA, (u32::from(table_size) * PCI_MSIX_ENTRY_SIZE) | u32::from(bar.index));
    }

    /// ACS offering [`ACS_CAPABILITIES`], with `control` as the node sets it at boot.
    fn acs_capability(&mut self, control: u16) {
        self.ext_capability_header(PCI_EXT_CAP_ID_ACS);
        self.set16(EXT_CAP + PCI_ACS_CAP, ACS_CAPABILITIES);
        self.set16(EXT_CAP + PCI_ACS_CTRL, control & ACS_CAPABILITIES);
        self.mask16(EXT_CAP + PCI_ACS_CTRL, ACS_CAPABILITIES);
    }

    /// ATS, disabled until the guest enables it.
    fn ats_capability(&mut self) {
        self.ext_capability_header(PCI_EXT_CAP_ID_ATS);
        self.set16(EXT_CAP + PCI_ATS_CAP, ATS_CAPABILITIES);
        self.mask16(EXT_CAP + PCI_ATS_CTRL, PCI_ATS_CTRL_ENABLE | PCI_ATS_CTRL_STU);
    }

    /// The header of the one extended capability: `id`, version 1, nothing after it.
    fn ext_capability_header(&mut self, id: u16) {
        self.set32(EXT_CAP, u32::from(id) | (1 << 16));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The minimal preset's NIC: a PCIe capability at 0x40, MSI-X at 0x80.
    fn nic() -> ConfigSpace {
        let node = Node::preset("minimal").unwrap().unwrap();
        let i = node.functions.iter().position(|f| f.name == "nic0").unwrap();
        ConfigSpace::for_function(&node, i)
    }

    fn byte(c: &ConfigSpace, at: usize) -> u8 {
        let mut b = [0u8];
        c.read(at, &mut b);
        b[0]
    }

    #[test]
    fn test_append_capability_links_after_the_last() {
        let mut c = nic();
        assert_eq!(byte(&c, MSIX_CAP + PCI_CAP_LIST_NEXT), 0);
        let mut cap = [0u8; 16];
        cap[0] = PCI_CAP_ID_VNDR;
        cap[1] = 0x55; // overwritten: the new capability ends the list
        cap[2] = 16;
        let at = c.append_capability(&cap, &[0, 0, 0, 0xff]).unwrap();
        assert_eq!(at, MSIX_CAP + PCI_CAP_MSIX_SIZEOF);
        assert_eq!(byte(&c, MSIX_CAP + PCI_CAP_LIST_NEXT), at as u8);
        assert_eq!((byte(&c, at), byte(&c, at + 1), byte(&c, at + 2)), (PCI_CAP_ID_VNDR, 0, 16));
        // Only the writable byte takes a guest write.
        c.write(at, &[0xaa; 4]);
        assert_eq!((byte(&c, at), byte(&c, at + 3)), (PCI_CAP_ID_VNDR, 0xaa));
        // The next one goes after it, by its length byte.
        let second = c.append_capability(&cap, &[]).unwrap();
        assert_eq!(second, at + 16);
        assert_eq!(byte(&c, at + PCI_CAP_LIST_NEXT), second as u8);
        // Until the first 256 bytes are full: the last 4 bytes still take a short one.
        let mut last = second;
        while let Some(at) = c.append_capability(&cap, &[]) {
            last = at;
        }
        assert_eq!(last + 16, PCI_CFG_SPACE_SIZE - 4);
        let short = [PCI_CAP_ID_VNDR, 0, 4, 0];
        assert_eq!(c.append_capability(&short, &[]), Some(PCI_CFG_SPACE_SIZE - 4));
        assert_eq!(c.append_capability(&short, &[]), None);
    }
}
