//! The virtio vendor capabilities of a PCI function (virtio 1.x, 4.1.4), found by walking the
//! capability list of its configuration space (a byte image of sysfs `config`), and the check
//! of where they point against the layout of gdrvm's virtio-net BAR 0.

use std::collections::BTreeSet;

/// Status register: a capability list is present (bit 4).
const STATUS: usize = 0x06;
const STATUS_CAP_LIST: u8 = 1 << 4;
/// Capabilities pointer (type 0 header).
const CAP_POINTER: usize = 0x34;
/// The first offset after the standard header: capabilities live in 0x40..0x100.
const CAP_FIRST: usize = 0x40;
/// The end of the conventional configuration space, which the list never leaves.
const CAP_END: usize = 0x100;
/// Capability ID of a vendor-specific capability: what virtio's are.
pub const CAP_ID_VENDOR: u8 = 0x09;
/// `struct virtio_pci_cap` is 16 bytes; the notify capability adds `notify_off_multiplier`.
const VIRTIO_CAP_LEN: u8 = 16;
const VIRTIO_NOTIFY_CAP_LEN: u8 = 20;

/// `cfg_type` of the common configuration.
pub const CFG_COMMON: u8 = 1;
/// `cfg_type` of the notifications.
pub const CFG_NOTIFY: u8 = 2;
/// `cfg_type` of the ISR status.
pub const CFG_ISR: u8 = 3;
/// `cfg_type` of the device-specific configuration.
pub const CFG_DEVICE: u8 = 4;

/// What is wrong with a capability list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CapError {
    /// The image is shorter than the header.
    #[error("configuration space of {0} bytes: too short for a header")]
    Short(usize),
    /// The Status register says there is no list.
    #[error("no capability list (Status {0:#06x})")]
    NoList(u16),
    /// A pointer leaves the capability area, or the image.
    #[error("capability pointer {pointer:#04x} (at {from:#04x}) is outside 0x40..0x100 or the {len} bytes read")]
    Pointer {
        /// Where the pointer was read.
        from: usize,
        /// Its value.
        pointer: usize,
        /// Bytes of configuration space read.
        len: usize,
    },
    /// The list comes back to a capability it already visited.
    #[error("the capability list loops back to {0:#04x}")]
    Loop(usize),
    /// A virtio capability shorter than its structure, or running past the image.
    #[error(
        "virtio capability at {at:#04x} (cfg_type {cfg_type}) has cap_len {cap_len}, needs {needs} within the space"
    )]
    Truncated {
        /// Its offset.
        at: usize,
        /// Its type.
        cfg_type: u8,
        /// Its `cap_len`.
        cap_len: u8,
        /// What its type needs.
        needs: u8,
    },
    /// A structure the driver needs has no capability.
    #[error("no virtio capability of cfg_type {0} ({1})")]
    Missing(u8, &'static str),
}

/// One capability in the list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    /// Its offset in configuration space.
    pub at: usize,
    /// Capability ID.
    pub id: u8,
}

/// Walks the capability list of `config` (a configuration space image): every capability in
/// list order, or why the list is broken.
pub fn walk(config: &[u8]) -> Result<Vec<Capability>, CapError> {
    if config.len() < CAP_FIRST {
        return Err(CapError::Short(config.len()));
    }
    let status = u16::from_le_bytes([config[STATUS], config[STATUS + 1]]);
    if config[STATUS] & STATUS_CAP_LIST == 0 {
        return Err(CapError::NoList(status));
    }
    let limit = config.len().min(CAP_END);
    let mut caps = Vec::new();
    let mut seen = BTreeSet::new();
    let (mut from, mut pointer) = (CAP_POINTER, usize::from(config[CAP_POINTER] & 0xfc));
    while pointer != 0 {
        if pointer < CAP_FIRST || pointer + 2 > limit {
            return Err(CapError::Pointer { from, pointer, len: config.len() });
        }
        if !seen.insert(pointer) {
            return Err(CapError::Loop(pointer));
        }
        caps.push(Capability { at: pointer, id: config[pointer] });
        (from, pointer) = (pointer + 1, usize::from(config[pointer + 1] & 0xfc));
    }
    Ok(caps)
}

/// One virtio structure as a capability describes it (`struct virtio_pci_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VirtioCap {
    /// The capability's offset in configuration space.
    pub at: usize,
    /// `cfg_type`.
    pub cfg_type: u8,
    /// The BAR holding the structure.
    pub bar: u8,
    /// Where in the BAR it starts.
    pub offset: u32,
    /// Its length in bytes.
    pub length: u32,
}

/// The four structures a virtio 1.x PCI driver needs, from the first capability of each type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VirtioCaps {
    /// Common configuration.
    pub common: VirtioCap,
    /// Notifications.
    pub notify: VirtioCap,
    /// Bytes between the notify addresses of consecutive `queue_notify_off` values.
    pub notify_off_multiplier: u32,
    /// ISR status.
    pub isr: VirtioCap,
    /// Device-specific configuration.
    pub device: VirtioCap,
    /// Every virtio capability, in list order (other types and repeats included).
    pub all: Vec<VirtioCap>,
}

/// The name of a `cfg_type`.
pub fn cfg_name(cfg_type: u8) -> &'static str {
    match cfg_type {
        CFG_COMMON => "common",
        CFG_NOTIFY => "notify",
        CFG_ISR => "isr",
        CFG_DEVICE => "device",
        5 => "pci-cfg",
        8 => "shared-memory",
        9 => "vendor",
        _ => "unknown",
    }
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The virtio capabilities of `config`: the list walked, every vendor capability read as a
/// `virtio_pci_cap`, the first of each needed type kept.
pub fn virtio_caps(config: &[u8]) -> Result<VirtioCaps, CapError> {
    let mut all = Vec::new();
    let mut multiplier = None;
    for cap in walk(config)?.into_iter().filter(|c| c.id == CAP_ID_VENDOR) {
        let at = cap.at;
        // The header (ID, next, cap_len, cfg_type) lies within the space: `walk` checked
        // two bytes; check the rest before reading it.
        let (cap_len, cfg_type) = (config.get(at + 2).copied().unwrap_or(0), config.get(at + 3).copied().unwrap_or(0));
        let needs = if cfg_type == CFG_NOTIFY { VIRTIO_NOTIFY_CAP_LEN } else { VIRTIO_CAP_LEN };
        if cap_len < needs || at + usize::from(needs) > config.len().min(CAP_END) {
            return Err(CapError::Truncated { at, cfg_type, cap_len, needs });
        }
        let vc = VirtioCap {
            at,
            cfg_type,
            bar: config[at + 4],
            offset: le32(config, at + 8),
            length: le32(config, at + 12),
        };
        if cfg_type == CFG_NOTIFY && multiplier.is_none() {
            multiplier = Some(le32(config, at + 16));
        }
        all.push(vc);
    }
    let first = |t: u8| all.iter().find(|c| c.cfg_type == t).copied().ok_or(CapError::Missing(t, cfg_name(t)));
    Ok(VirtioCaps {
        common: first(CFG_COMMON)?,
        notify: first(CFG_NOTIFY)?,
        notify_off_multiplier: multiplier.unwrap_or(0),
        isr: first(CFG_ISR)?,
        device: first(CFG_DEVICE)?,
        all,
    })
}

/// Where gdrvm's virtio-net puts its structures in BAR 0 (the fabric contract).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContractLayout {
    /// BAR index.
    pub bar: u8,
    /// Common configuration offset.
    pub common: u32,
    /// ISR offset.
    pub isr: u32,
    /// Device configuration offset.
    pub device: u32,
    /// Notification area offset.
    pub notify: u32,
    /// `notify_off_multiplier`.
    pub notify_off_multiplier: u32,
}

/// gdrvm's virtio-net BAR 0: MSI-X table at 0, PBA at 0x100, common 0x1000, ISR 0x2000,
/// device 0x3000, notify 0x4000 with a multiplier of 4.
pub const CONTRACT: ContractLayout =
    ContractLayout { bar: 0, common: 0x1000, isr: 0x2000, device: 0x3000, notify: 0x4000, notify_off_multiplier: 4 };

/// One line per capability, as the diagnostics print them.
pub fn describe(caps: &VirtioCaps) -> Vec<String> {
    let mut lines: Vec<String> = caps
        .all
        .iter()
        .map(|c| {
            format!(
                "cap at {:#04x}: cfg_type {} ({}), BAR{} + {:#06x}, {:#x} bytes",
                c.at,
                c.cfg_type,
                cfg_name(c.cfg_type),
                c.bar,
                c.offset,
                c.length
            )
        })
        .collect();
    lines.push(format!("notify_off_multiplier {}", caps.notify_off_multiplier));
    lines
}

/// The differences between where the capabilities point and `want`; empty when they agree.
pub fn layout_mismatches(caps: &VirtioCaps, want: &ContractLayout) -> Vec<String> {
    let mut out = Vec::new();
    for (cap, offset) in
        [(&caps.common, want.common), (&caps.isr, want.isr), (&caps.device, want.device), (&caps.notify, want.notify)]
    {
        if (cap.bar, cap.offset) != (want.bar, offset) {
            out.push(format!(
                "{} is at BAR{} + {:#06x}, the contract says BAR{} + {offset:#06x}",
                cfg_name(cap.cfg_type),
                cap.bar,
                cap.offset,
                want.bar
            ));
        }
    }
    if caps.notify_off_multiplier != want.notify_off_multiplier {
        out.push(format!(
            "notify_off_multiplier is {}, the contract says {}",
            caps.notify_off_multiplier, want.notify_off_multiplier
        ));
    }
    out
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// A virtio_pci_cap (notify_off_multiplier appended for notify) at `at`, linking to `next`.
    pub fn put_virtio_cap(config: &mut [u8], at: usize, next: u8, cfg: (u8, u8, u32, u32), multiplier: Option<u32>) {
        let (cfg_type, bar, offset, length) = cfg;
        let len = if multiplier.is_some() { 20 } else { 16 };
        config[at..at + 4].copy_from_slice(&[CAP_ID_VENDOR, next, len, cfg_type]);
        config[at + 4] = bar;
        config[at + 8..at + 12].copy_from_slice(&offset.to_le_bytes());
        config[at + 12..at + 16].copy_from_slice(&length.to_le_bytes());
        if let Some(m) = multiplier {
            config[at + 16..at + 20].copy_from_slice(&m.to_le_bytes());
        }
    }

    /// The configuration space of gdrvm's virtio-net as the contract lays it out: MSI-X at
    /// 0x80 (first in the list), then the four structures (two doorbells, 12 bytes of
    /// `virtio_net_config`) with a PCI-cfg access capability among them.
    pub fn contract_config() -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[..4].copy_from_slice(&[0xf4, 0x1a, 0x41, 0x10]);
        c[STATUS] = STATUS_CAP_LIST;
        c[CAP_POINTER] = 0x80;
        // MSI-X: ID 0x11, 16 vectors, table BAR0 + 0, PBA BAR0 + 0x100.
        c[0x80..0x84].copy_from_slice(&[0x11, 0x40, 15, 0]);
        c[0x88..0x8c].copy_from_slice(&0x100u32.to_le_bytes());
        put_virtio_cap(&mut c, 0x40, 0x54, (CFG_COMMON, 0, 0x1000, 0x38), None);
        put_virtio_cap(&mut c, 0x54, 0x64, (5, 0, 0, 0), None);
        put_virtio_cap(&mut c, 0x64, 0x8c, (CFG_NOTIFY, 0, 0x4000, 8), Some(4));
        put_virtio_cap(&mut c, 0x8c, 0x9c, (CFG_ISR, 0, 0x2000, 1), None);
        put_virtio_cap(&mut c, 0x9c, 0x00, (CFG_DEVICE, 0, 0x3000, 12), None);
        c
    }

    #[test]
    fn test_walk_the_contract_image() {
        let c = contract_config();
        let ids: Vec<(usize, u8)> = walk(&c).unwrap().iter().map(|c| (c.at, c.id)).collect();
        assert_eq!(ids, [(0x80, 0x11), (0x40, 9), (0x54, 9), (0x64, 9), (0x8c, 9), (0x9c, 9)]);
        let caps = virtio_caps(&c).unwrap();
        assert_eq!(caps.common, VirtioCap { at: 0x40, cfg_type: 1, bar: 0, offset: 0x1000, length: 0x38 });
        assert_eq!((caps.notify.offset, caps.notify_off_multiplier), (0x4000, 4));
        assert_eq!((caps.isr.offset, caps.device.offset), (0x2000, 0x3000));
        assert_eq!(caps.all.len(), 5, "the PCI-cfg capability is listed, not used");
        assert!(layout_mismatches(&caps, &CONTRACT).is_empty());
        let lines = describe(&caps);
        assert_eq!(lines[0], "cap at 0x40: cfg_type 1 (common), BAR0 + 0x1000, 0x38 bytes");
        assert_eq!(lines[1], "cap at 0x54: cfg_type 5 (pci-cfg), BAR0 + 0x0000, 0x0 bytes");
        assert_eq!(lines[5], "notify_off_multiplier 4");
        // A 4 KiB (PCIe) image walks the same.
        let mut big = c.clone();
        big.resize(4096, 0);
        assert_eq!(virtio_caps(&big).unwrap(), caps);
    }

    #[test]
    fn test_the_first_of_each_type_wins_and_low_pointer_bits_are_ignored() {
        let mut c = contract_config();
        // A second common capability at the end of the list points elsewhere: ignored.
        c[0x9d] = 0xb0;
        put_virtio_cap(&mut c, 0xb0, 0, (CFG_COMMON, 2, 0x8000, 0x38), None);
        // The bottom two bits of a pointer are reserved.
        c[CAP_POINTER] = 0x83;
        let caps = virtio_caps(&c).unwrap();
        assert_eq!((caps.common.bar, caps.common.offset), (0, 0x1000));
        assert_eq!(caps.all.len(), 6);
    }

    #[test]
    fn test_layout_mismatches_name_every_difference() {
        let mut c = contract_config();
        put_virtio_cap(&mut c, 0x64, 0x8c, (CFG_NOTIFY, 0, 0x5000, 8), Some(2));
        put_virtio_cap(&mut c, 0x8c, 0x9c, (CFG_ISR, 2, 0x2000, 1), None);
        let caps = virtio_caps(&c).unwrap();
        assert_eq!(
            layout_mismatches(&caps, &CONTRACT),
            [
                "isr is at BAR2 + 0x2000, the contract says BAR0 + 0x2000",
                "notify is at BAR0 + 0x5000, the contract says BAR0 + 0x4000",
                "notify_off_multiplier is 2, the contract says 4"
            ]
        );
    }

    #[test]
    fn test_broken_lists() {
        assert_eq!(walk(&[0u8; 16]), Err(CapError::Short(16)));
        let mut c = contract_config();
        c[STATUS] = 0;
        assert_eq!(walk(&c), Err(CapError::NoList(0)));

        let mut c = contract_config();
        c[0x9d] = 0x54; // device -> pci-cfg: a loop
        assert_eq!(walk(&c), Err(CapError::Loop(0x54)));
        let mut c = contract_config();
        c[0x9d] = 0x9c; // a capability pointing at itself
        assert_eq!(walk(&c), Err(CapError::Loop(0x9c)));

        let mut c = contract_config();
        c[0x65] = 0x20; // into the header
        assert_eq!(walk(&c), Err(CapError::Pointer { from: 0x65, pointer: 0x20, len: 256 }));
        // Only the first 64 bytes readable (an unprivileged read of sysfs config).
        let c = contract_config();
        assert_eq!(walk(&c[..64]), Err(CapError::Pointer { from: CAP_POINTER, pointer: 0x80, len: 64 }));

        // A notify capability too short for its multiplier.
        let mut c = contract_config();
        c[0x66] = 16;
        assert_eq!(virtio_caps(&c), Err(CapError::Truncated { at: 0x64, cfg_type: 2, cap_len: 16, needs: 20 }));
        // A capability whose structure runs past the space.
        let mut c = contract_config();
        c[0x9d] = 0xfc;
        c[0xfc..0x100].copy_from_slice(&[CAP_ID_VENDOR, 0, 16, CFG_DEVICE]);
        assert_eq!(virtio_caps(&c), Err(CapError::Truncated { at: 0xfc, cfg_type: 4, cap_len: 16, needs: 16 }));
        c.resize(4096, 0);
        assert!(virtio_caps(&c).is_err(), "not even into the extended space");

        // No ISR capability.
        let mut c = contract_config();
        c[0x65] = 0x9c;
        assert_eq!(virtio_caps(&c), Err(CapError::Missing(CFG_ISR, "isr")));
        assert_eq!(CapError::Missing(CFG_ISR, "isr").to_string(), "no virtio capability of cfg_type 3 (isr)");
    }
}
