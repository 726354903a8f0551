//! One PCI function's 4 KiB configuration space: the bytes the guest reads and a mask of
//! the bits it may write. Sizing a BAR (write all-ones, read back) works through the mask
//! alone, as do bus numbers and bridge windows; nothing else reacts to writes, because the
//! functions behind this model are not backed by anything (their BARs read as all-ones).
//!
//! Layouts follow the PCI Local Bus 3.0 headers and PCI Express Base 4.0 chapter 7
//! (capability IDs 0x10 PCIe and 0x11 MSI-X, extended IDs 0x0d ACS and 0x0f ATS).

use gdrvm_model::node::{Bar, BridgeWindows, FunctionKind, Link, LinkSpeed, Node, MSIX_VECTORS};

/// Size of a PCIe function's configuration space.
pub const CONFIG_SPACE_SIZE: usize = 4096;

/// Offsets in the common header.
mod reg {
    pub const VENDOR_ID: usize = 0x00;
    pub const COMMAND: usize = 0x04;
    pub const STATUS: usize = 0x06;
    pub const REVISION: usize = 0x08;
    pub const CACHE_LINE_SIZE: usize = 0x0c;
    pub const HEADER_TYPE: usize = 0x0e;
    pub const BAR0: usize = 0x10;
    pub const SUBSYSTEM_VENDOR_ID: usize = 0x2c;
    pub const CAPABILITIES: usize = 0x34;
    pub const INTERRUPT_LINE: usize = 0x3c;
    // Type 1 (bridge) header.
    pub const PRIMARY_BUS: usize = 0x18;
    pub const MEMORY_BASE: usize = 0x20;
    pub const PREF_BASE: usize = 0x24;
    pub const PREF_BASE_UPPER: usize = 0x28;
    pub const PREF_LIMIT_UPPER: usize = 0x2c;
    pub const BRIDGE_CONTROL: usize = 0x3e;
}

/// Command register bits the guest may set: memory space, bus master, parity, SERR, INTx off.
const COMMAND_WRITABLE: u16 = 0x0546;
/// Command: memory space enable (firmware has assigned the BARs) and bus master.
const COMMAND_MEMORY: u16 = 0x0002;
const COMMAND_MASTER: u16 = 0x0004;
/// Status: a capability list is present.
const STATUS_CAP_LIST: u16 = 0x0010;

/// Where the capabilities sit.
const PCIE_CAP: usize = 0x40;
const PCIE_CAP_LEN: usize = 0x3c;
const MSIX_CAP: usize = 0x80;
const EXT_CAP: usize = 0x100;

const CAP_ID_PCIE: u8 = 0x10;
const CAP_ID_MSIX: u8 = 0x11;
const EXT_CAP_ID_ACS: u16 = 0x000d;
const EXT_CAP_ID_ATS: u16 = 0x000f;

/// ACS capability bits offered on root and downstream ports: source validation, translation
/// blocking, P2P request redirect, completion redirect, upstream forwarding.
pub const ACS_CAPABILITIES: u16 = 0x001f;
/// ATS capability: page-aligned requests (invalidate queue depth 0 means 32).
const ATS_CAPABILITIES: u16 = 0x0020;

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
    pub fn for_function(node: &Node, i: usize) -> Self {
        let f = &node.functions[i];
        let mut c = ConfigSpace::empty();
        c.set16(reg::VENDOR_ID, f.vendor);
        c.set16(reg::VENDOR_ID + 2, f.device);
        c.set8(reg::REVISION, 0x01);
        c.set8(reg::REVISION + 1, (f.class & 0xff) as u8);
        c.set16(reg::REVISION + 2, (f.class >> 8) as u16);
        c.mask8(reg::CACHE_LINE_SIZE, 0xff);
        c.mask8(reg::INTERRUPT_LINE, 0xff);
        c.mask16(reg::COMMAND, COMMAND_WRITABLE);
        if f.kind.is_bridge() {
            c.bridge_header(f.buses.unwrap_or_default(), f.windows.unwrap_or_default(), f.bdf.bus);
            c.set16(reg::COMMAND, COMMAND_MEMORY | COMMAND_MASTER);
        } else {
            for bar in &f.bars {
                c.bar(bar);
            }
            if !f.bars.is_empty() {
                c.set16(reg::COMMAND, COMMAND_MEMORY);
            }
            if let Some((vendor, device)) = f.subsystem {
                c.set16(reg::SUBSYSTEM_VENDOR_ID, vendor);
                c.set16(reg::SUBSYSTEM_VENDOR_ID + 2, device);
            }
        }
        let Some(port_type) = f.kind.pcie_port_type() else {
            return c;
        };
        c.set16(reg::STATUS, STATUS_CAP_LIST);
        c.set8(reg::CAPABILITIES, PCIE_CAP as u8);
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
            c.ext_capability(EXT_CAP_ID_ACS, ACS_CAPABILITIES, ACS_CAPABILITIES);
            c.set16(EXT_CAP + 6, f.acs_control & ACS_CAPABILITIES);
        } else if f.ats {
            c.ext_capability(EXT_CAP_ID_ATS, ATS_CAPABILITIES, 0x801f);
        }
        c
    }

    /// Reads `data.len()` bytes at `offset`; all-ones beyond the space.
    pub fn read(&self, offset: usize, data: &mut [u8]) {
        match self.bytes.get(offset..offset.saturating_add(data.len())) {
            Some(src) => data.copy_from_slice(src),
            None => data.fill(0xff),
        }
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
        let at = reg::BAR0 + 4 * usize::from(bar.index);
        let flags = (u32::from(bar.prefetchable) << 3) | if bar.is_64bit { 0x4 } else { 0 };
        self.set32(at, (bar.address as u32 & 0xffff_fff0) | flags);
        self.mask32(at, !((bar.size - 1) as u32) & 0xffff_fff0);
        if bar.is_64bit {
            self.set32(at + 4, (bar.address >> 32) as u32);
            self.mask32(at + 4, !(((bar.size - 1) >> 32) as u32));
        }
    }

    /// The type-1 header: bus numbers and windows, no I/O window, no expansion ROM.
    fn bridge_header(&mut self, (secondary, subordinate): (u8, u8), windows: BridgeWindows, primary: u8) {
        self.set8(reg::HEADER_TYPE, 0x01);
        self.set8(reg::PRIMARY_BUS, primary);
        self.set8(reg::PRIMARY_BUS + 1, secondary);
        self.set8(reg::PRIMARY_BUS + 2, subordinate);
        self.mask32(reg::PRIMARY_BUS, 0xffff_ffff);
        // Memory window: bits 31:20 of base and limit; base above limit means closed.
        let (base, limit) = windows.mem.map_or((0xfff0, 0), |w| ((w.base >> 16) as u16, (w.last() >> 16) as u16));
        self.set16(reg::MEMORY_BASE, base & 0xfff0);
        self.set16(reg::MEMORY_BASE + 2, limit & 0xfff0);
        self.mask32(reg::MEMORY_BASE, 0xfff0_fff0);
        // Prefetchable window, 64-bit (type 1 in the low nibble).
        let (base, limit) = windows.pref.map_or((0xfff0_0000_0000, 0), |w| (w.base, w.last()));
        self.set16(reg::PREF_BASE, ((base >> 16) as u16 & 0xfff0) | 1);
        self.set16(reg::PREF_BASE + 2, ((limit >> 16) as u16 & 0xfff0) | 1);
        self.set32(reg::PREF_BASE_UPPER, (base >> 32) as u32);
        self.set32(reg::PREF_LIMIT_UPPER, (limit >> 32) as u32);
        self.mask32(reg::PREF_BASE, 0xfff0_fff0);
        self.mask32(reg::PREF_BASE_UPPER, 0xffff_ffff);
        self.mask32(reg::PREF_LIMIT_UPPER, 0xffff_ffff);
        // Parity, SERR, ISA, VGA, VGA16, master abort, secondary bus reset.
        self.mask16(reg::BRIDGE_CONTROL, 0x007f);
    }

    /// The PCI Express capability (version 2) with the link as configured and trained.
    fn pcie_capability(&mut self, port_type: u8, link: Link, trained: Option<Link>, port: u8, next: usize) {
        let at = PCIE_CAP;
        let is_endpoint = port_type == 0;
        let is_downstream = port_type == 0x4 || port_type == 0x6;
        self.set8(at, CAP_ID_PCIE);
        self.set8(at + 1, next as u8);
        self.set16(at + 0x02, 0x0002 | (u16::from(port_type) << 4));
        // Device capabilities: 256-byte max payload, role-based error reporting; FLR on endpoints.
        self.set32(at + 0x04, 0x1 | (1 << 15) | if is_endpoint { 1 << 28 } else { 0 });
        // Device control: relaxed ordering, no snoop, 512-byte max read request.
        self.set16(at + 0x08, 0x2810);
        self.mask16(at + 0x08, 0x7fff);
        // Link capabilities: max speed, max width, data-link-active reporting on ports.
        let dllla_capable = if is_downstream { 1 << 20 } else { 0 };
        self.set32(
            at + 0x0c,
            u32::from(link.speed.encoding()) | (u32::from(link.width) << 4) | dllla_capable | (u32::from(port) << 24),
        );
        self.mask16(at + 0x10, 0x0fff);
        // Link status: the trained speed and width; link active when a port has a partner.
        let status = match trained {
            Some(t) => {
                u16::from(t.speed.encoding()) | (u16::from(t.width) << 4) | if is_downstream { 1 << 13 } else { 0 }
            }
            None => 0x0001,
        };
        self.set16(at + 0x12, status);
        if port_type == 0x4 {
            self.mask16(at + 0x1c, 0x001f);
        }
        // Link capabilities 2: every speed up to the maximum; Linux reads max_link_speed here.
        let speeds = (1u32 << (link.speed.encoding() + 1)) - 2;
        self.set32(at + 0x2c, speeds);
        self.set16(at + 0x30, u16::from(link.speed.encoding()));
        self.mask16(at + 0x30, 0x003f);
        debug_assert!(at + PCIE_CAP_LEN <= MSIX_CAP);
    }

    /// MSI-X with its table at the start of BAR `bar` and the pending-bit array after it.
    fn msix_capability(&mut self, bar: &Bar, table_size: u16) {
        let at = MSIX_CAP;
        self.set8(at, CAP_ID_MSIX);
        self.set8(at + 1, 0);
        self.set16(at + 2, table_size - 1);
        self.mask16(at + 2, 0xc000);
        self.set32(at + 4, u32::from(bar.index));
        self.set32(at + 8, (u32::from(table_size) * 16) | u32::from(bar.index));
    }

    /// One extended capability at 0x100: header, a 16-bit capability and control register.
    fn ext_capability(&mut self, id: u16, capability: u16, control_mask: u16) {
        self.set32(EXT_CAP, u32::from(id) | (1 << 16));
        self.set16(EXT_CAP + 4, capability);
        self.mask16(EXT_CAP + 6, control_mask);
    }
}
