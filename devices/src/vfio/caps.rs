//! The capabilities of a passed-through function, read once from its configuration space
//! at open: where each one is and how long, and the MSI and MSI-X layouts the VMM needs to
//! wire interrupts. The lists are the device's, so every walk is bounded: a pointer loop,
//! a pointer into the header or past the end ends the list, never the VMM.

use crate::pci::MsiInfo;
use crate::pci::MsixLayout;
use crate::pci_regs::*;

/// At most this many standard capabilities (the 192 bytes after the header, 4 bytes each).
const MAX_STANDARD: usize = (PCI_CFG_SPACE_SIZE - PCI_STD_HEADER_SIZEOF) / 4;
/// At most this many extended capabilities.
const MAX_EXTENDED: usize = (PCI_CFG_SPACE_EXP_SIZE - PCI_CFG_SPACE_SIZE) / 4;

/// A capability's ID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CapabilityId {
    /// In the first 256 bytes (`PCI_CAP_ID_*`).
    Standard(u8),
    /// In the extended space (`PCI_EXT_CAP_ID_*`).
    Extended(u16),
}

/// One capability of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    /// Its ID.
    pub id: CapabilityId,
    /// Offset of its header in configuration space.
    pub offset: usize,
    /// Bytes it takes: its layout's length where the ID fixes one, else up to the next
    /// capability or the end of its space.
    pub len: usize,
}

impl Capability {
    /// Whether configuration byte `reg` is inside the capability.
    pub fn contains(&self, reg: usize) -> bool {
        (self.offset..self.offset + self.len).contains(&reg)
    }
}

/// The capabilities in `config` (a configuration space image from register 0; 256 bytes
/// for a conventional function, 4096 for PCI Express), standard first, each list in
/// address order.
pub(super) fn walk(config: &[u8]) -> Vec<Capability> {
    let mut caps = standard(config);
    caps.extend(extended(config));
    caps
}

fn standard(config: &[u8]) -> Vec<Capability> {
    let end = config.len().min(PCI_CFG_SPACE_SIZE);
    if read16(config, PCI_STATUS) & PCI_STATUS_CAP_LIST == 0 {
        return Vec::new();
    }
    let mut found: Vec<(u8, usize)> = Vec::new();
    let mut at = usize::from(read8(config, PCI_CAPABILITY_LIST) & !3);
    while at >= PCI_STD_HEADER_SIZEOF
        && at + 2 <= end
        && found.len() < MAX_STANDARD
        && !found.iter().any(|&(_, o)| o == at)
    {
        found.push((read8(config, at + PCI_CAP_LIST_ID), at));
        at = usize::from(read8(config, at + PCI_CAP_LIST_NEXT) & !3);
    }
    lay_out(found.into_iter().map(|(id, at)| (CapabilityId::Standard(id), at)), end, |id, at| match id {
        CapabilityId::Standard(id) => standard_len(config, id, at),
        CapabilityId::Extended(_) => None,
    })
}

fn extended(config: &[u8]) -> Vec<Capability> {
    let end = config.len().min(PCI_CFG_SPACE_EXP_SIZE);
    let mut found: Vec<(u16, usize)> = Vec::new();
    let mut at = PCI_CFG_SPACE_SIZE;
    while at >= PCI_CFG_SPACE_SIZE
        && at + 4 <= end
        && found.len() < MAX_EXTENDED
        && !found.iter().any(|&(_, o)| o == at)
    {
        let header = read32(config, at);
        if header == 0 || header == u32::MAX {
            break;
        }
        found.push((header as u16, at));
        at = (header >> 20) as usize & !3;
    }
    lay_out(found.into_iter().map(|(id, at)| (CapabilityId::Extended(id), at)), end, |id, at| match id {
        CapabilityId::Extended(PCI_EXT_CAP_ID_VNDR) => Some((read32(config, at + PCI_VNDR_HEADER) >> 20) as usize),
        _ => None,
    })
}

/// Capabilities at the given places, sorted, each as long as `known` says (never past the
/// next one or `end`), else up to the next one or `end`.
fn lay_out(
    found: impl Iterator<Item = (CapabilityId, usize)>,
    end: usize,
    known: impl Fn(CapabilityId, usize) -> Option<usize>,
) -> Vec<Capability> {
    let mut caps: Vec<Capability> = found.map(|(id, offset)| Capability { id, offset, len: 0 }).collect();
    caps.sort_by_key(|c| c.offset);
    let starts: Vec<usize> = caps.iter().map(|c| c.offset).skip(1).chain([end]).collect();
    for (cap, next) in caps.iter_mut().zip(starts) {
        let room = next - cap.offset;
        cap.len = known(cap.id, cap.offset).map_or(room, |len| len.max(2).min(room));
    }
    caps
}

/// The length a standard capability's layout fixes.
fn standard_len(config: &[u8], id: u8, at: usize) -> Option<usize> {
    match id {
        PCI_CAP_ID_PM => Some(PCI_PM_SIZEOF),
        PCI_CAP_ID_MSI => {
            let flags = read16(config, at + PCI_MSI_FLAGS);
            let is_64bit = flags & PCI_MSI_FLAGS_64BIT != 0;
            Some(match (is_64bit, flags & PCI_MSI_FLAGS_MASKBIT != 0) {
                (false, false) => PCI_MSI_DATA_32 + 4,
                (true, false) => PCI_MSI_DATA_64 + 4,
                (false, true) => PCI_MSI_PENDING_32 + 4,
                (true, true) => PCI_MSI_PENDING_64 + 4,
            })
        }
        PCI_CAP_ID_MSIX => Some(PCI_CAP_MSIX_SIZEOF),
        PCI_CAP_ID_EXP => Some(if read16(config, at + PCI_EXP_FLAGS) & PCI_EXP_FLAGS_VERS >= 2 {
            PCI_CAP_EXP_ENDPOINT_SIZEOF_V2
        } else {
            PCI_CAP_EXP_SIZEOF_V1
        }),
        PCI_CAP_ID_VNDR => Some(usize::from(read8(config, at + PCI_CAP_FLAGS))),
        _ => None,
    }
}

/// The first standard capability with ID `id`.
pub(super) fn find(caps: &[Capability], id: u8) -> Option<&Capability> {
    caps.iter().find(|c| c.id == CapabilityId::Standard(id))
}

/// Bytes an MSI-X table of `layout` takes (16 per vector).
pub(super) fn msix_table_len(layout: &MsixLayout) -> u64 {
    u64::from(layout.vectors) * u64::from(PCI_MSIX_ENTRY_SIZE)
}

/// Bytes an MSI-X pending-bit array of `layout` takes (a qword per 64 vectors).
pub(super) fn msix_pba_len(layout: &MsixLayout) -> u64 {
    u64::from(layout.vectors).div_ceil(64) * 8
}

/// The MSI-X layout, if the device has a well-formed MSI-X capability.
pub(super) fn msix(config: &[u8], caps: &[Capability]) -> Option<MsixLayout> {
    let cap = find(caps, PCI_CAP_ID_MSIX)?.offset;
    let flags = read16(config, cap + PCI_MSIX_FLAGS);
    let table = read32(config, cap + PCI_MSIX_TABLE);
    let pba = read32(config, cap + PCI_MSIX_PBA);
    let (table_bar, pba_bar) = ((table & PCI_MSIX_TABLE_BIR) as u8, (pba & PCI_MSIX_PBA_BIR) as u8);
    // BIR 6 and 7 are reserved: such a capability points nowhere.
    (table_bar < 6 && pba_bar < 6).then_some(MsixLayout {
        cap,
        vectors: (flags & PCI_MSIX_FLAGS_QSIZE) + 1,
        table: (table_bar, u64::from(table & PCI_MSIX_TABLE_OFFSET)),
        pba: (pba_bar, u64::from(pba & PCI_MSIX_PBA_OFFSET)),
    })
}

/// The MSI layout, if the device has an MSI capability.
pub(super) fn msi(config: &[u8], caps: &[Capability]) -> Option<MsiInfo> {
    let cap = find(caps, PCI_CAP_ID_MSI)?.offset;
    let flags = read16(config, cap + PCI_MSI_FLAGS);
    let log2 = (flags & PCI_MSI_FLAGS_QMASK) >> PCI_MSI_FLAGS_QMASK.trailing_zeros();
    Some(MsiInfo {
        cap,
        // Encodings above 32 vectors are reserved.
        vectors: 1 << log2.min(5),
        is_64bit: flags & PCI_MSI_FLAGS_64BIT != 0,
        per_vector_mask: flags & PCI_MSI_FLAGS_MASKBIT != 0,
    })
}

pub(super) fn read8(bytes: &[u8], at: usize) -> u8 {
    read::<1>(bytes, at)[0]
}

pub(super) fn read16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(read(bytes, at))
}

pub(super) fn read32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(read(bytes, at))
}

/// `N` bytes at `at`; all-ones where the image ends first (as absent registers read).
fn read<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    bytes.get(at..).and_then(|rest| rest.get(..N)).and_then(|b| b.try_into().ok()).unwrap_or([0xff; N])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio::fake::ConfigImage;

    #[test]
    fn test_walk_finds_standard_and_extended_capabilities_with_their_lengths() {
        let config = ConfigImage::gpu().bytes;
        let caps = walk(&config);
        let found: Vec<(CapabilityId, usize, usize)> = caps.iter().map(|c| (c.id, c.offset, c.len)).collect();
        use CapabilityId::*;
        assert_eq!(
            found,
            [
                (Standard(PCI_CAP_ID_PM), 0x40, 8),
                (Standard(PCI_CAP_ID_MSI), 0x50, 0x18),
                (Standard(PCI_CAP_ID_EXP), 0x70, 0x3c),
                (Standard(PCI_CAP_ID_MSIX), 0xb0, 12),
                (Standard(PCI_CAP_ID_VNDR), 0xc0, 0x14),
                // An unknown capability runs to the end of the standard space.
                (Standard(0x13), 0xe0, 0x20),
                (Extended(1), 0x100, 0x48),
                (Extended(PCI_EXT_CAP_ID_VNDR), 0x148, 0x18),
                (Extended(PCI_EXT_CAP_ID_ACS), 0x180, 0xe80),
            ]
        );
        assert!(caps[0].contains(0x47) && !caps[0].contains(0x48));
    }

    #[test]
    fn test_msix_and_msi_layouts() {
        let config = ConfigImage::gpu().bytes;
        let caps = walk(&config);
        let msix = msix(&config, &caps).unwrap();
        assert_eq!(msix, MsixLayout { cap: 0xb0, vectors: 64, table: (0, 0xb_0000), pba: (0, 0xb_c000) });
        assert_eq!((msix_table_len(&msix), msix_pba_len(&msix)), (1024, 8));
        let msi = msi(&config, &caps).unwrap();
        assert_eq!(msi, MsiInfo { cap: 0x50, vectors: 8, is_64bit: true, per_vector_mask: true });
    }

    #[test]
    fn test_walks_survive_loops_bad_pointers_and_short_images() {
        let mut img = ConfigImage::gpu();
        // The last standard capability points back at the first; the extended list at itself.
        img.bytes[0xe0 + PCI_CAP_LIST_NEXT] = 0x40;
        let header = read32(&img.bytes, 0x180) & 0x000f_ffff | 0x180 << 20;
        img.bytes[0x180..0x184].copy_from_slice(&header.to_le_bytes());
        assert_eq!(walk(&img.bytes).len(), 9);
        // A pointer into the header ends the list.
        img.bytes[PCI_CAPABILITY_LIST] = 0x20;
        assert_eq!(walk(&img.bytes).iter().filter(|c| matches!(c.id, CapabilityId::Standard(_))).count(), 0);
        // No capability list bit: no standard capabilities; a conventional function: no
        // extended ones; an empty image: nothing.
        let mut img = ConfigImage::gpu();
        img.bytes[PCI_STATUS] &= !(PCI_STATUS_CAP_LIST as u8);
        assert!(walk(&img.bytes[..PCI_CFG_SPACE_SIZE]).is_empty());
        assert!(walk(&[]).is_empty());
        // A capability claiming more than fits ends at the next one.
        let mut img = ConfigImage::gpu();
        img.bytes[0xc0 + PCI_CAP_FLAGS] = 0xff;
        let caps = walk(&img.bytes);
        assert_eq!(caps.iter().find(|c| c.offset == 0xc0).map(|c| c.len), Some(0x20));
        // Reserved BIRs: no MSI-X.
        let mut img = ConfigImage::gpu();
        img.bytes[0xb0 + PCI_MSIX_TABLE] |= 7;
        assert_eq!(msix(&img.bytes, &walk(&img.bytes)), None);
    }
}
