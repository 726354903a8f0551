//! An endpoint's identity (IDs, class, subsystem, BARs): from the node file, or from the
//! host device passed through to it. A passed-through device supplies whatever the file
//! omits; where the file says something else than the device, the node is refused with
//! the key and both values, since the guest would see the device's and the node's
//! expectations would be wrong.

use super::error::KeyError;
use super::schema::EndpointEntry;
use super::{Backing, Bar};
use crate::host_pci::{DeviceCaps, HostFunction, HostPci};

/// What an endpoint is to the guest.
pub(super) struct Identity {
    pub vendor: u16,
    pub device: u16,
    pub class: u32,
    pub subsystem: Option<(u16, u16)>,
    pub bars: Vec<Bar>,
    /// What a passed-through device brings.
    pub caps: Option<DeviceCaps>,
}

/// The identity of endpoint `ep` (entry `k`), whose kind implies `default_class`.
pub(super) fn resolve(
    ep: &EndpointEntry,
    k: &str,
    backing: Backing,
    default_class: Option<u32>,
    host: &HostPci,
) -> Result<Identity, KeyError> {
    let field = |f: &str| format!("{k}.{f}");
    let file_bars = super::build::parse_bars(&ep.bars, &field("bars"))?;
    let subsystem = ep.subsystem.map(|[v, d]| (v, d));
    if backing == Backing::VirtioNet {
        return Ok(virtio_net());
    }
    let Backing::Vfio(bdf) = backing else {
        let required = |v: Option<u16>, f: &str| {
            v.ok_or_else(|| KeyError::new(field(f), "required (no passed-through device supplies it)"))
        };
        let class = ep
            .class
            .or(default_class)
            .ok_or_else(|| KeyError::new(field("class"), "a generic endpoint needs its class code"))?;
        return Ok(Identity {
            vendor: required(ep.vendor, "vendor")?,
            device: required(ep.device, "device")?,
            class,
            subsystem,
            bars: file_bars,
            caps: None,
        });
    };
    let dev = host.function(bdf).map_err(|e| KeyError::new(field("backing"), e.to_string()))?;
    let differs = |f: &str, node: String, host: String| {
        KeyError::new(field(f), format!("the node says {node}, host device {bdf} has {host}"))
    };
    let check = |f: &str, node: Option<u32>, actual: u32, width: usize| match node {
        Some(n) if n != actual => Err(differs(f, format!("{n:#0width$x}"), format!("{actual:#0width$x}"))),
        _ => Ok(()),
    };
    check("vendor", ep.vendor.map(u32::from), u32::from(dev.vendor), 6)?;
    check("device", ep.device.map(u32::from), u32::from(dev.device), 6)?;
    check("class", ep.class, dev.class, 8)?;
    if subsystem.is_some() && subsystem != dev.subsystem {
        return Err(differs("subsystem", format!("{subsystem:x?}"), format!("{:x?}", dev.subsystem)));
    }
    let bars = device_bars(&dev);
    if !ep.bars.is_empty() {
        let shape = |b: &[Bar]| b.iter().map(|b| (b.size, b.prefetchable, b.is_64bit)).collect::<Vec<_>>();
        if shape(&file_bars) != shape(&bars) {
            let show = |b: &[Bar]| {
                b.iter()
                    .map(|b| {
                        format!(
                            "{}{}{}",
                            super::tree::size(b.size),
                            if b.prefetchable { " pref" } else { "" },
                            if b.is_64bit { " 64" } else { " 32" }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(differs("bars", format!("[{}]", show(&file_bars)), format!("[{}]", show(&bars))));
        }
    }
    Ok(Identity {
        vendor: dev.vendor,
        device: dev.device,
        class: dev.class,
        subsystem: dev.subsystem,
        bars,
        caps: Some(dev.caps),
    })
}

/// Red Hat's virtio vendor ID.
pub const VIRTIO_VENDOR: u16 = 0x1af4;
/// A modern (virtio 1.x, non-transitional) network device: 0x1040 + device type 1.
pub const VIRTIO_NET_DEVICE: u16 = 0x1041;
/// Size of a virtio-net endpoint's one BAR (MSI-X table and PBA, then the virtio
/// structures; see gdrvm-devices' virtio module).
pub const VIRTIO_NET_BAR_SIZE: u64 = 32 << 10;

/// What a virtio-net endpoint is to the guest, whatever the node file said of the device
/// it stands in for.
fn virtio_net() -> Identity {
    Identity {
        vendor: VIRTIO_VENDOR,
        device: VIRTIO_NET_DEVICE,
        class: 0x02_00_00,
        // Subsystem device 0x1100 (>= 0x40 for a modern device), as QEMU's.
        subsystem: Some((VIRTIO_VENDOR, 0x1100)),
        bars: vec![Bar { index: 0, size: VIRTIO_NET_BAR_SIZE, prefetchable: false, is_64bit: true, address: 0 }],
        caps: None,
    }
}

/// The device's memory BARs at their own register indices (a driver finds them there).
fn device_bars(dev: &HostFunction) -> Vec<Bar> {
    dev.bars
        .iter()
        .map(|b| Bar { index: b.index, size: b.size, prefetchable: b.prefetchable, is_64bit: b.is_64bit, address: 0 })
        .collect()
}

#[cfg(test)]
mod tests {
    use crate::host_pci::{record_e1000e, HostPci};
    use crate::node::{Backing, Node};

    /// minimal's tree with its NIC replaced by `nic` (the lines of one endpoint entry).
    fn node_with_nic(nic: &str) -> String {
        let minimal = include_str!("../../presets/minimal.toml");
        let cut = minimal.rfind("[[endpoint]]").unwrap();
        format!("{}[[endpoint]]\nname = \"nic0\"\nparent = \"sw0\"\nlink = \"16GT/s x16\"\n{nic}\n", &minimal[..cut])
    }

    #[test]
    fn test_passed_through_device_supplies_ids_class_and_bars_at_its_indices() {
        let dir = tempfile::tempdir().unwrap();
        let bdf = record_e1000e(dir.path());
        let text = node_with_nic("kind = \"nic\"\nbacking = \"vfio:0000:01:00.0\"");
        let node = Node::parse_with_host("lab.toml", &text, &HostPci::at(dir.path())).unwrap();
        let nic = node.functions.iter().find(|f| f.name == "nic0").unwrap();
        assert_eq!(nic.backing, Backing::Vfio(bdf));
        assert_eq!((nic.vendor, nic.device, nic.class, nic.subsystem), (0x8086, 0x10d3, 0x020000, Some((0x8086, 0))));
        let bars: Vec<(u8, u64)> = nic.bars.iter().map(|b| (b.index, b.size)).collect();
        assert_eq!(bars, [(0, 128 << 10), (1, 128 << 10), (3, 16 << 10), (4, 4 << 20)]);
        assert!(nic.bars.iter().all(|b| b.address != 0 && b.address % b.size == 0), "{:?}", nic.bars);
    }

    #[test]
    fn test_node_and_device_that_disagree_name_the_key_and_both_values() {
        let dir = tempfile::tempdir().unwrap();
        record_e1000e(dir.path());
        let host = HostPci::at(dir.path());
        let cases = [
            ("vendor = 0x15b3", "key endpoint[1] (nic0).vendor: the node says 0x15b3, host device 0000:01:00.0 has 0x8086"),
            ("class = 0x020700", "key endpoint[1] (nic0).class: the node says 0x020700, host device 0000:01:00.0 has 0x020000"),
            (
                "bars = [{ size = \"2M\", prefetchable = true }]",
                "key endpoint[1] (nic0).bars: the node says [2M pref 64], host device 0000:01:00.0 has [128K 32, 128K 32, 16K 32, 4M pref 64]",
            ),
        ];
        for (line, want) in cases {
            let text = node_with_nic(&format!("kind = \"nic\"\nbacking = \"vfio:01:00.0\"\n{line}"));
            let err = Node::parse_with_host("lab.toml", &text, &host).unwrap_err().to_string();
            assert_eq!(err, format!("lab.toml: {want}"));
        }
    }

    #[test]
    fn test_missing_device_unknown_backing_and_missing_ids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let host = HostPci::at(dir.path());
        let parse = |nic: &str| Node::parse_with_host("lab.toml", &node_with_nic(nic), &host).unwrap_err().to_string();
        let err = parse("kind = \"nic\"\nbacking = \"vfio:3b:00.0\"");
        assert!(
            err.starts_with("lab.toml: key endpoint[1] (nic0).backing: host PCI device 0000:3b:00.0 does not exist"),
            "{err}"
        );
        let err = parse("kind = \"nic\"\nvendor = 1\ndevice = 2\nbacking = \"ivshmem:/x\"");
        assert_eq!(
            err,
            "lab.toml: key endpoint[1] (nic0).backing: 'ivshmem:/x' is not a backing this version knows (none, \
             vfio:<host BDF>, vfio-user:<socket>, emulated-gpu, emulated-nic, virtio-net)"
        );
        let err = parse("kind = \"nic\"\ndevice = 2");
        assert_eq!(err, "lab.toml: key endpoint[1] (nic0).vendor: required (no passed-through device supplies it)");
    }
}
