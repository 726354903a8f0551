//! RDMA devices as sysfs shows them (`/sys/class/infiniband`): where each sits on PCI, its
//! port state and GID table, and `rdma link` output.
//!
//! Soft-RoCE devices have had no sysfs parent since Linux 5.11 ("RDMA: Remove dev.parent
//! for sw drivers"): `/sys/class/infiniband/rxe0` resolves under
//! `/sys/devices/virtual/infiniband` and has no `device` link. Their PCI function is then
//! the one under their network interface, which the port's GID attributes name.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;

use crate::pcidev::pci_function_of;

/// The port every check uses.
pub const PORT: u32 = 1;

/// The RDMA devices, sorted.
pub fn devices(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root.join("sys/class/infiniband"))
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The network interfaces port [`PORT`] of `dev` runs on (its GID entries' `ndevs`).
pub fn netdevs(root: &Path, dev: &str) -> Vec<String> {
    let dir = root.join(format!("sys/class/infiniband/{dev}/ports/{PORT}/gid_attrs/ndevs"));
    let mut entries: Vec<(u32, String)> = std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let index = e.file_name().to_string_lossy().parse().ok()?;
                    // Empty entries read EINVAL.
                    let name = std::fs::read_to_string(e.path()).ok()?.trim().to_owned();
                    (!name.is_empty()).then_some((index, name))
                })
                .collect()
        })
        .unwrap_or_default();
    entries.sort();
    let mut names: Vec<String> = Vec::new();
    for (_, n) in entries {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    names
}

/// Where an RDMA device sits on PCI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    /// The PCI function.
    pub bdf: String,
    /// How it was found, for the diagnostics.
    pub via: String,
}

/// The PCI function of RDMA device `dev`: its sysfs parent (`device`), or for a device
/// without one (soft-RoCE), the function under its network interface.
pub fn pci_parent(root: &Path, dev: &str) -> Result<Parent, String> {
    let class = root.join(format!("sys/class/infiniband/{dev}"));
    let shown = |p: &Path| {
        format!("/{}", p.strip_prefix(std::fs::canonicalize(root).unwrap_or_default()).unwrap_or(p).display())
    };
    if let Some((bdf, resolved)) = pci_function_of(root, &class.join("device")) {
        return Ok(Parent { via: format!("{dev}/device -> {}", shown(&resolved)), bdf });
    }
    let ifs = netdevs(root, dev);
    let Some(ifname) = ifs.first() else {
        return Err(format!("{dev} has no sysfs parent and no network interface in its GID table"));
    };
    let netdev = root.join(format!("sys/class/net/{ifname}/device"));
    match pci_function_of(root, &netdev) {
        Some((bdf, resolved)) => Ok(Parent {
            via: format!(
                "{dev} has no sysfs parent (a software device); its netdev {ifname}/device -> {}",
                shown(&resolved)
            ),
            bdf,
        }),
        None => Err(format!("{dev} has no sysfs parent and its netdev {ifname} is on no PCI function")),
    }
}

/// Port state as sysfs writes it (`4: ACTIVE`), without the number.
pub fn port_state(root: &Path, dev: &str) -> Option<String> {
    let text = std::fs::read_to_string(root.join(format!("sys/class/infiniband/{dev}/ports/{PORT}/state"))).ok()?;
    let text = text.trim();
    Some(text.split_once(": ").map_or(text, |(_, s)| s).to_owned())
}

/// A GID table entry from sysfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gid {
    /// Its index.
    pub index: u32,
    /// The GID (`0000:0000:0000:0000:0000:ffff:0a4d:0001`) as an address.
    pub gid: Ipv6Addr,
    /// `RoCE v2`, `IB/RoCE v1`.
    pub kind: String,
}

impl Gid {
    /// The IPv4 address of an IPv4-mapped GID.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        self.gid.to_ipv4_mapped()
    }
}

/// The valid (non-zero, typed) GID entries of port [`PORT`] of `dev`, by index.
pub fn gids(root: &Path, dev: &str) -> Vec<Gid> {
    let port = root.join(format!("sys/class/infiniband/{dev}/ports/{PORT}"));
    let mut out: Vec<Gid> = std::fs::read_dir(port.join("gids"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let index: u32 = e.file_name().to_string_lossy().parse().ok()?;
                    let gid: Ipv6Addr = std::fs::read_to_string(e.path()).ok()?.trim().parse().ok()?;
                    if gid.is_unspecified() {
                        return None;
                    }
                    let kind =
                        std::fs::read_to_string(port.join(format!("gid_attrs/types/{index}"))).ok()?.trim().to_owned();
                    (!kind.is_empty()).then_some(Gid { index, gid, kind })
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort_by_key(|g| g.index);
    out
}

/// The RoCE v2 entry for IPv4 address `addr` (what `-x` / `--gid-index` must name).
pub fn roce_v2_ipv4(gids: &[Gid], addr: Ipv4Addr) -> Option<&Gid> {
    gids.iter().find(|g| g.kind == "RoCE v2" && g.ipv4() == Some(addr))
}

/// One line of `rdma link show`: `link rxe0/1 state ACTIVE physical_state LINK_UP netdev eth0`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Device name.
    pub dev: String,
    /// Port number.
    pub port: u32,
    /// `ACTIVE`, `DOWN` ...
    pub state: String,
    /// Its network interface, when it has one.
    pub netdev: Option<String>,
}

/// Parses `rdma link show`.
pub fn parse_rdma_links(text: &str) -> Vec<Link> {
    text.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let (dev, port) = words.get(1)?.split_once('/')?;
            (words.first() == Some(&"link")).then_some(())?;
            let value = |key: &str| words.windows(2).find(|w| w[0] == key).map(|w| w[1].to_owned());
            Some(Link {
                dev: dev.to_owned(),
                port: port.parse().ok()?,
                state: value("state").unwrap_or_default(),
                netdev: value("netdev"),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;
    use crate::pcidev::is_bdf;

    #[test]
    fn test_bdf_names() {
        assert!(is_bdf("0000:03:00.0"));
        assert!(is_bdf("0001:af:1f.7"));
        assert!(!is_bdf("0000:03:00.8"));
        assert!(!is_bdf("pci0000:00"));
        assert!(!is_bdf("virtio1"));
        assert!(!is_bdf("0000:03:00"));
    }

    /// A fake sysfs: a soft-RoCE device (virtual, no parent) on eth0, a virtio-net
    /// interface under 0000:03:00.0, and an HCA with a real parent at 0000:05:00.1.
    fn fake_sysfs() -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let mk = |p: &str| std::fs::create_dir_all(r.join(p)).unwrap();
        let write = |p: &str, s: &str| std::fs::write(r.join(p), s).unwrap();
        mk("sys/devices/pci0000:00/0000:00:02.0/0000:03:00.0/virtio1/net/eth0");
        mk("sys/class/net");
        symlink("../../../virtio1", r.join("sys/devices/pci0000:00/0000:00:02.0/0000:03:00.0/virtio1/net/eth0/device"))
            .unwrap();
        symlink("../../devices/pci0000:00/0000:00:02.0/0000:03:00.0/virtio1/net/eth0", r.join("sys/class/net/eth0"))
            .unwrap();
        let rxe = "sys/devices/virtual/infiniband/rxe_nic0";
        mk(&format!("{rxe}/ports/1/gids"));
        mk(&format!("{rxe}/ports/1/gid_attrs/types"));
        mk(&format!("{rxe}/ports/1/gid_attrs/ndevs"));
        write(&format!("{rxe}/ports/1/state"), "4: ACTIVE\n");
        let entries = [
            ("fe80:0000:0000:0000:5054:00ff:fe12:3401", "IB/RoCE v1"),
            ("fe80:0000:0000:0000:5054:00ff:fe12:3401", "RoCE v2"),
            ("0000:0000:0000:0000:0000:ffff:0a4d:0001", "IB/RoCE v1"),
            ("0000:0000:0000:0000:0000:ffff:0a4d:0001", "RoCE v2"),
            ("0000:0000:0000:0000:0000:0000:0000:0000", ""),
        ];
        for (i, (gid, kind)) in entries.iter().enumerate() {
            write(&format!("{rxe}/ports/1/gids/{i}"), &format!("{gid}\n"));
            write(&format!("{rxe}/ports/1/gid_attrs/types/{i}"), &format!("{kind}\n"));
            write(&format!("{rxe}/ports/1/gid_attrs/ndevs/{i}"), if kind.is_empty() { "" } else { "eth0\n" });
        }
        mk("sys/class/infiniband");
        symlink("../../devices/virtual/infiniband/rxe_nic0", r.join("sys/class/infiniband/rxe_nic0")).unwrap();
        let hca = "sys/devices/pci0000:00/0000:00:03.0/0000:05:00.1/infiniband/mlx5_0";
        mk(hca);
        symlink("../../../0000:05:00.1", r.join(format!("{hca}/device"))).unwrap();
        symlink(format!("../../{}", hca.trim_start_matches("sys/")), r.join("sys/class/infiniband/mlx5_0")).unwrap();
        mk("sys/devices/virtual/infiniband/lonely/ports/1");
        symlink("../../devices/virtual/infiniband/lonely", r.join("sys/class/infiniband/lonely")).unwrap();
        root
    }

    #[test]
    fn test_pci_parent_of_soft_roce_and_of_an_hca() {
        let root = fake_sysfs();
        let r = root.path();
        assert_eq!(devices(r), ["lonely", "mlx5_0", "rxe_nic0"]);
        assert_eq!(netdevs(r, "rxe_nic0"), ["eth0"]);
        let rxe = pci_parent(r, "rxe_nic0").unwrap();
        assert_eq!(rxe.bdf, "0000:03:00.0");
        assert_eq!(
            rxe.via,
            "rxe_nic0 has no sysfs parent (a software device); its netdev eth0/device -> \
             /sys/devices/pci0000:00/0000:00:02.0/0000:03:00.0/virtio1"
        );
        let hca = pci_parent(r, "mlx5_0").unwrap();
        assert_eq!(hca.bdf, "0000:05:00.1");
        assert_eq!(hca.via, "mlx5_0/device -> /sys/devices/pci0000:00/0000:00:03.0/0000:05:00.1");
        assert_eq!(
            pci_parent(r, "lonely"),
            Err("lonely has no sysfs parent and no network interface in its GID table".into())
        );
    }

    #[test]
    fn test_gid_table_and_roce_v2_ipv4_entry() {
        let root = fake_sysfs();
        let g = gids(root.path(), "rxe_nic0");
        assert_eq!(g.len(), 4, "the empty entry is left out");
        let v2 = roce_v2_ipv4(&g, Ipv4Addr::new(10, 77, 0, 1)).unwrap();
        assert_eq!(v2.index, 3);
        assert_eq!(v2.gid.to_string(), "::ffff:10.77.0.1");
        assert_eq!(roce_v2_ipv4(&g, Ipv4Addr::new(10, 77, 0, 2)), None);
        assert_eq!(port_state(root.path(), "rxe_nic0").as_deref(), Some("ACTIVE"));
        assert_eq!(port_state(root.path(), "mlx5_0"), None);
    }

    #[test]
    fn test_rdma_link_output() {
        let text = "link rxe_nic0/1 state ACTIVE physical_state LINK_UP netdev eth0 \n\
                    link mlx5_0/1 subnet_prefix fe80:0000:0000:0000 lid 4 sm_lid 1 lmc 0 state ACTIVE physical_state LINK_UP \n\
                    garbage\n";
        assert_eq!(
            parse_rdma_links(text),
            [
                Link { dev: "rxe_nic0".into(), port: 1, state: "ACTIVE".into(), netdev: Some("eth0".into()) },
                Link { dev: "mlx5_0".into(), port: 1, state: "ACTIVE".into(), netdev: None },
            ]
        );
    }
}
