//! Configuration-space register offsets and bits, named as Linux names them in
//! `include/uapi/linux/pci_regs.h` (PCI Local Bus 3.0, PCI Express Base 4.0 chapter 7).
//! Capability registers are offsets from the start of their capability; a field's
//! position is its mask's lowest set bit. Devices and the VMM both name registers from here.

// Common header.
pub const PCI_VENDOR_ID: usize = 0x00;
pub const PCI_DEVICE_ID: usize = 0x02;
pub const PCI_COMMAND: usize = 0x04;
pub const PCI_STATUS: usize = 0x06;
pub const PCI_REVISION_ID: usize = 0x08;
pub const PCI_CLASS_PROG: usize = 0x09;
pub const PCI_CLASS_DEVICE: usize = 0x0a;
pub const PCI_CACHE_LINE_SIZE: usize = 0x0c;
pub const PCI_LATENCY_TIMER: usize = 0x0d;
pub const PCI_HEADER_TYPE: usize = 0x0e;
pub const PCI_BIST: usize = 0x0f;
pub const PCI_CAPABILITY_LIST: usize = 0x34;
pub const PCI_INTERRUPT_LINE: usize = 0x3c;
pub const PCI_INTERRUPT_PIN: usize = 0x3d;
/// Length of the common header of type 0 and type 1 functions.
pub const PCI_STD_HEADER_SIZEOF: usize = 0x40;

pub const PCI_COMMAND_IO: u16 = 0x0001;
pub const PCI_COMMAND_MEMORY: u16 = 0x0002;
pub const PCI_COMMAND_MASTER: u16 = 0x0004;
/// Memory Write and Invalidate enable.
pub const PCI_COMMAND_INVALIDATE: u16 = 0x0010;
pub const PCI_COMMAND_PARITY: u16 = 0x0040;
pub const PCI_COMMAND_SERR: u16 = 0x0100;
pub const PCI_COMMAND_INTX_DISABLE: u16 = 0x0400;
pub const PCI_STATUS_CAP_LIST: u16 = 0x0010;
/// The write-1-to-clear error bits of the status register.
pub const PCI_STATUS_ERROR_BITS: u16 = 0xf900;
pub const PCI_HEADER_TYPE_BRIDGE: u8 = 0x01;

// Type 0 (endpoint) header.
pub const PCI_BASE_ADDRESS_0: usize = 0x10;
pub const PCI_SUBSYSTEM_VENDOR_ID: usize = 0x2c;
pub const PCI_SUBSYSTEM_ID: usize = 0x2e;
pub const PCI_ROM_ADDRESS: usize = 0x30;

pub const PCI_BASE_ADDRESS_SPACE_IO: u32 = 0x01;
pub const PCI_BASE_ADDRESS_MEM_TYPE_MASK: u32 = 0x06;
pub const PCI_BASE_ADDRESS_MEM_TYPE_64: u32 = 0x04;
pub const PCI_BASE_ADDRESS_MEM_PREFETCH: u32 = 0x08;
pub const PCI_BASE_ADDRESS_MEM_MASK: u32 = !0x0f;

// Type 1 (bridge) header.
pub const PCI_PRIMARY_BUS: usize = 0x18;
pub const PCI_SECONDARY_BUS: usize = 0x19;
pub const PCI_SUBORDINATE_BUS: usize = 0x1a;
pub const PCI_MEMORY_BASE: usize = 0x20;
pub const PCI_MEMORY_LIMIT: usize = 0x22;
pub const PCI_PREF_MEMORY_BASE: usize = 0x24;
pub const PCI_PREF_MEMORY_LIMIT: usize = 0x26;
pub const PCI_PREF_BASE_UPPER32: usize = 0x28;
pub const PCI_PREF_LIMIT_UPPER32: usize = 0x2c;
pub const PCI_BRIDGE_CONTROL: usize = 0x3e;

pub const PCI_PREF_RANGE_TYPE_64: u16 = 0x01;

// Capability list.
pub const PCI_CAP_LIST_ID: usize = 0x00;
pub const PCI_CAP_LIST_NEXT: usize = 0x01;
pub const PCI_CAP_ID_PM: u8 = 0x01;
pub const PCI_CAP_ID_MSI: u8 = 0x05;
pub const PCI_CAP_ID_VNDR: u8 = 0x09;
pub const PCI_CAP_ID_EXP: u8 = 0x10;
pub const PCI_CAP_ID_MSIX: u8 = 0x11;
/// A vendor-specific capability's length byte.
pub const PCI_CAP_FLAGS: usize = 0x02;

// Power management capability.
pub const PCI_PM_CTRL: usize = 0x04;
pub const PCI_PM_SIZEOF: usize = 0x08;
pub const PCI_PM_CTRL_STATE_MASK: u16 = 0x0003;
pub const PCI_PM_CTRL_PME_ENABLE: u16 = 0x0100;
pub const PCI_PM_CTRL_PME_STATUS: u16 = 0x8000;

// PCI Express capability.
pub const PCI_EXP_FLAGS: usize = 0x02;
pub const PCI_EXP_DEVCAP: usize = 0x04;
pub const PCI_EXP_DEVCTL: usize = 0x08;
pub const PCI_EXP_DEVSTA: usize = 0x0a;
pub const PCI_EXP_LNKCAP: usize = 0x0c;
pub const PCI_EXP_LNKCTL: usize = 0x10;
pub const PCI_EXP_LNKSTA: usize = 0x12;
pub const PCI_EXP_RTCTL: usize = 0x1c;
pub const PCI_EXP_RTSTA: usize = 0x20;
pub const PCI_EXP_DEVCTL2: usize = 0x28;
pub const PCI_EXP_LNKCAP2: usize = 0x2c;
pub const PCI_EXP_LNKCTL2: usize = 0x30;
/// Length of a version 1 PCI Express capability (it ends after the root status).
pub const PCI_CAP_EXP_SIZEOF_V1: usize = PCI_EXP_RTSTA + 4;
/// Length of a version 2 PCI Express capability.
pub const PCI_CAP_EXP_ENDPOINT_SIZEOF_V2: usize = 0x3c;

pub const PCI_EXP_FLAGS_VERS: u16 = 0x000f;
pub const PCI_EXP_FLAGS_TYPE: u16 = 0x00f0;
pub const PCI_EXP_TYPE_ENDPOINT: u8 = 0x0;
pub const PCI_EXP_TYPE_ROOT_PORT: u8 = 0x4;
pub const PCI_EXP_TYPE_DOWNSTREAM: u8 = 0x6;
pub const PCI_EXP_DEVCAP_RBER: u32 = 0x0000_8000;
pub const PCI_EXP_DEVCAP_FLR: u32 = 0x1000_0000;
pub const PCI_EXP_DEVCTL_RELAX_EN: u16 = 0x0010;
/// Max_Payload_Size.
pub const PCI_EXP_DEVCTL_PAYLOAD: u16 = 0x00e0;
/// Phantom Functions Enable.
pub const PCI_EXP_DEVCTL_PHANTOM: u16 = 0x0200;
pub const PCI_EXP_DEVCTL_NOSNOOP_EN: u16 = 0x0800;
/// Initiate Function Level Reset (writes as 1 start it; reads as 0).
pub const PCI_EXP_DEVCTL_BCR_FLR: u16 = 0x8000;
pub const PCI_EXP_DEVCTL_READRQ_512B: u16 = 0x2000;
pub const PCI_EXP_LNKCAP_SLS: u32 = 0x0000_000f;
pub const PCI_EXP_LNKCAP_MLW: u32 = 0x0000_03f0;
pub const PCI_EXP_LNKCAP_DLLLARC: u32 = 0x0010_0000;
pub const PCI_EXP_LNKCAP_PN: u32 = 0xff00_0000;
pub const PCI_EXP_LNKSTA_CLS: u16 = 0x000f;
pub const PCI_EXP_LNKSTA_NLW: u16 = 0x03f0;
pub const PCI_EXP_LNKSTA_DLLLA: u16 = 0x2000;
/// Device Status error bits (write 1 to clear): correctable, non-fatal, fatal, unsupported request.
pub const PCI_EXP_DEVSTA_CED: u16 = 0x0001;
pub const PCI_EXP_DEVSTA_NFED: u16 = 0x0002;
pub const PCI_EXP_DEVSTA_FED: u16 = 0x0004;
pub const PCI_EXP_DEVSTA_URD: u16 = 0x0008;
/// Link Bandwidth Management and Link Autonomous Bandwidth Status (write 1 to clear).
pub const PCI_EXP_LNKSTA_LBMS: u16 = 0x4000;
pub const PCI_EXP_LNKSTA_LABS: u16 = 0x8000;
/// ARI Forwarding Enable.
pub const PCI_EXP_DEVCTL2_ARI: u16 = 0x0020;
/// Target Link Speed.
pub const PCI_EXP_LNKCTL2_TLS: u16 = 0x000f;
/// Hardware Autonomous Speed Disable.
pub const PCI_EXP_LNKCTL2_HASD: u16 = 0x0020;

// MSI-X capability.
pub const PCI_MSIX_FLAGS: usize = 0x02;
pub const PCI_MSIX_TABLE: usize = 0x04;
pub const PCI_MSIX_PBA: usize = 0x08;
/// Table Size, encoded as N - 1.
pub const PCI_MSIX_FLAGS_QSIZE: u16 = 0x07ff;
pub const PCI_MSIX_FLAGS_MASKALL: u16 = 0x4000;
pub const PCI_MSIX_FLAGS_ENABLE: u16 = 0x8000;
pub const PCI_MSIX_ENTRY_SIZE: u32 = 16;
/// The BAR (BIR) and offset fields of the table and PBA registers.
pub const PCI_MSIX_TABLE_BIR: u32 = 0x0000_0007;
pub const PCI_MSIX_TABLE_OFFSET: u32 = 0xffff_fff8;
pub const PCI_MSIX_PBA_BIR: u32 = 0x0000_0007;
pub const PCI_MSIX_PBA_OFFSET: u32 = 0xffff_fff8;
/// Length of the MSI-X capability.
pub const PCI_CAP_MSIX_SIZEOF: usize = 0x0c;
// MSI-X table entry: registers from the start of the entry.
pub const PCI_MSIX_ENTRY_LOWER_ADDR: usize = 0x0;
pub const PCI_MSIX_ENTRY_UPPER_ADDR: usize = 0x4;
pub const PCI_MSIX_ENTRY_DATA: usize = 0x8;
pub const PCI_MSIX_ENTRY_VECTOR_CTRL: usize = 0xc;
pub const PCI_MSIX_ENTRY_CTRL_MASKBIT: u32 = 0x1;

// MSI capability.
pub const PCI_MSI_FLAGS: usize = 0x02;
pub const PCI_MSI_ADDRESS_LO: usize = 0x04;
pub const PCI_MSI_ADDRESS_HI: usize = 0x08;
pub const PCI_MSI_DATA_32: usize = 0x08;
pub const PCI_MSI_MASK_32: usize = 0x0c;
pub const PCI_MSI_PENDING_32: usize = 0x10;
pub const PCI_MSI_DATA_64: usize = 0x0c;
pub const PCI_MSI_MASK_64: usize = 0x10;
pub const PCI_MSI_PENDING_64: usize = 0x14;
pub const PCI_MSI_FLAGS_ENABLE: u16 = 0x0001;
/// Multiple Message Capable: log2 of the vectors the function offers.
pub const PCI_MSI_FLAGS_QMASK: u16 = 0x000e;
/// Multiple Message Enable: log2 of the vectors software granted.
pub const PCI_MSI_FLAGS_QSIZE: u16 = 0x0070;
pub const PCI_MSI_FLAGS_64BIT: u16 = 0x0080;
pub const PCI_MSI_FLAGS_MASKBIT: u16 = 0x0100;

// Extended capabilities: they start after the 256 bytes of conventional config space.
pub const PCI_CFG_SPACE_SIZE: usize = 0x100;
pub const PCI_CFG_SPACE_EXP_SIZE: usize = 0x1000;
pub const PCI_EXT_CAP_ID_VNDR: u16 = 0x000b;
pub const PCI_EXT_CAP_ID_ACS: u16 = 0x000d;
pub const PCI_EXT_CAP_ID_ATS: u16 = 0x000f;
/// Designated Vendor-Specific Extended Capability.
pub const PCI_EXT_CAP_ID_DVSEC: u16 = 0x0023;
/// Vendor-Specific Extended Capability header: its length field (bits 31:20).
pub const PCI_VNDR_HEADER: usize = 0x04;
pub const PCI_ACS_CAP: usize = 0x04;
pub const PCI_ACS_CTRL: usize = 0x06;
pub const PCI_ATS_CAP: usize = 0x04;
pub const PCI_ATS_CTRL: usize = 0x06;

pub const PCI_ATS_CAP_PAGE_ALIGNED: u16 = 0x0020;
pub const PCI_ATS_CTRL_ENABLE: u16 = 0x8000;
/// Smallest Translation Unit (Linux writes the field with `PCI_ATS_CTRL_STU(x)`).
pub const PCI_ATS_CTRL_STU: u16 = 0x001f;
