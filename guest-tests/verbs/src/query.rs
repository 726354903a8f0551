//! `gdrvm-verbs query`: every RDMA device, its port 1 and its GID table.

use std::path::Path;

use ibverbs_sys as ffi;
use serde::Serialize;

use crate::ib::{self, Context, PORT};
use crate::report::{Emitter, TestResult};

/// GID entries read through libibverbs when the `ibverbs` crate cannot open the device
/// (it refuses ports that are not ACTIVE).
const GID_FALLBACK_ENTRIES: u32 = 16;

/// One GID table entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GidInfo {
    /// Its index.
    pub index: u32,
    /// The GID as an IPv6 address (`::ffff:10.77.0.1` for an IPv4-mapped one).
    pub gid: String,
    /// `RoCE v2`, `IB/RoCE v1` (sysfs `gid_attrs/types`), else libibverbs's type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The network interface behind it (0 when unknown).
    pub ndev_ifindex: u32,
}

/// Port 1 of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PortInfo {
    /// `PORT_ACTIVE`, `PORT_DOWN` ...
    pub state: String,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Largest MTU in bytes.
    pub max_mtu: u32,
    /// `Ethernet` (RoCE) or `InfiniBand`.
    pub link_layer: String,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// Entries in the GID table.
    pub gid_tbl_len: i32,
    /// Largest message.
    pub max_msg_sz: u32,
}

/// What `query` reports of a device (the `data` of its result).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// Device name (`rxe_nic0`).
    pub name: String,
    /// Node GUID, `xxxx:xxxx:xxxx:xxxx` as sysfs writes it.
    pub node_guid: String,
    /// Firmware version text.
    pub fw_ver: String,
    /// Most queue pairs.
    pub max_qp: i32,
    /// Most work requests per queue.
    pub max_qp_wr: i32,
    /// Most completion queue entries.
    pub max_cqe: i32,
    /// Most memory regions.
    pub max_mr: i32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Outstanding RDMA READs per QP.
    pub max_qp_rd_atom: i32,
    /// Ports.
    pub phys_port_cnt: u8,
    /// Port 1, when it could be queried.
    pub port: Option<PortInfo>,
    /// The valid GID entries.
    pub gids: Vec<GidInfo>,
}

/// `xxxx:xxxx:xxxx:xxxx`.
pub fn format_guid(guid: u64) -> String {
    let hex = format!("{guid:016x}");
    [&hex[0..4], &hex[4..8], &hex[8..12], &hex[12..16]].join(":")
}

fn link_layer(code: u8) -> String {
    match u32::from(code) {
        ffi::IBV_LINK_LAYER_ETHERNET => "Ethernet".into(),
        ffi::IBV_LINK_LAYER_INFINIBAND | ffi::IBV_LINK_LAYER_UNSPECIFIED => "InfiniBand".into(),
        other => format!("link layer {other}"),
    }
}

fn verbs_gid_type(t: ffi::ibv_gid_type) -> String {
    match t {
        ffi::IBV_GID_TYPE_ROCE_V2 => "RoCE v2".into(),
        ffi::IBV_GID_TYPE_ROCE_V1 => "IB/RoCE v1".into(),
        ffi::IBV_GID_TYPE_IB => "IB".into(),
        other => format!("type {other}"),
    }
}

/// The type sysfs gives GID `index` of `dev` (`RoCE v2`, `IB/RoCE v1`).
fn sysfs_gid_type(sysfs: &Path, dev: &str, index: u32) -> Option<String> {
    let path = sysfs.join(format!("class/infiniband/{dev}/ports/{PORT}/gid_attrs/types/{index}"));
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())
}

/// Runs the command: a `devices` result, then one `device_<name>` result per device.
pub fn run(out: &mut Emitter, sysfs: &Path) {
    let list = match ibverbs::devices() {
        Ok(l) => l,
        Err(e) => {
            out.emit(TestResult::fail("devices", Vec::new(), ib::device_list_error(&e)));
            return;
        }
    };
    let names: Vec<String> =
        list.iter().map(|d| d.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()).collect();
    if names.is_empty() {
        let kernel: Vec<String> = std::fs::read_dir(sysfs.join("class/infiniband"))
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default();
        let reason = if kernel.is_empty() {
            "no RDMA device: the kernel has none (/sys/class/infiniband is empty or absent)".to_owned()
        } else {
            format!(
                "libibverbs lists no device although the kernel has {}: is ib_uverbs loaded and the provider \
                 (librxe-rdmav34.so with /etc/libibverbs.d/rxe.driver) installed?",
                kernel.join(", ")
            )
        };
        out.emit(TestResult::fail("devices", Vec::new(), reason));
        return;
    }
    out.emit(TestResult::pass("devices", vec![format!("{} RDMA device(s): {}", names.len(), names.join(", "))]));
    for dev in list.iter() {
        let name = dev.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // The crate reads the GUID as it lies in memory (big-endian); this is the value.
        let guid = dev.guid().map(|g| u64::from_be(u64::from(g))).unwrap_or(0);
        // The crate opens only devices whose port is ACTIVE; then its GID table is the one
        // the kernel reports (with types). Otherwise read the first entries directly.
        let crate_gids = dev.open().ok().map(|c| c.gid_table().to_vec());
        out.emit(describe(&name, guid, crate_gids, sysfs));
    }
}

fn describe(name: &str, guid: u64, crate_gids: Option<Vec<ibverbs::GidEntry>>, sysfs: &Path) -> TestResult {
    let test = format!("device_{name}");
    let ctx = match Context::open(name) {
        Ok(c) => c,
        Err(e) => return TestResult::fail(&test, Vec::new(), e),
    };
    let mut diag = Vec::new();
    let mut problems = Vec::new();
    let mut info = DeviceInfo {
        name: name.to_owned(),
        node_guid: format_guid(guid),
        fw_ver: String::new(),
        max_qp: 0,
        max_qp_wr: 0,
        max_cqe: 0,
        max_mr: 0,
        max_mr_size: 0,
        max_qp_rd_atom: 0,
        phys_port_cnt: 0,
        port: None,
        gids: Vec::new(),
    };
    match ctx.query_device() {
        Ok(a) => {
            let fw: Vec<u8> = a.fw_ver.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
            info.fw_ver = String::from_utf8_lossy(&fw).into_owned();
            info.max_qp = a.max_qp;
            info.max_qp_wr = a.max_qp_wr;
            info.max_cqe = a.max_cqe;
            info.max_mr = a.max_mr;
            info.max_mr_size = a.max_mr_size;
            info.max_qp_rd_atom = a.max_qp_rd_atom;
            info.phys_port_cnt = a.phys_port_cnt;
            diag.push(format!(
                "node GUID {}, firmware '{}', {} port(s), max_qp {}, max_qp_wr {}, max_cqe {}, max_mr {}, max_mr_size {:#x}, max_qp_rd_atom {}",
                info.node_guid, info.fw_ver, a.phys_port_cnt, a.max_qp, a.max_qp_wr, a.max_cqe, a.max_mr, a.max_mr_size, a.max_qp_rd_atom
            ));
        }
        Err(e) => problems.push(e),
    }
    match ctx.query_port(PORT) {
        Ok(p) => {
            let port = PortInfo {
                state: ib::port_state_text(p.state),
                active_mtu: ib::mtu_bytes(p.active_mtu),
                max_mtu: ib::mtu_bytes(p.max_mtu),
                link_layer: link_layer(p.link_layer),
                lid: p.lid,
                gid_tbl_len: p.gid_tbl_len,
                max_msg_sz: p.max_msg_sz,
            };
            diag.push(format!(
                "port {PORT}: {}, active MTU {}, max MTU {}, link layer {}, LID {}, {} GID entries, max message {} B",
                port.state, port.active_mtu, port.max_mtu, port.link_layer, port.lid, port.gid_tbl_len, port.max_msg_sz
            ));
            info.port = Some(port);
        }
        Err(e) => problems.push(e),
    }
    info.gids = match crate_gids {
        Some(entries) => entries
            .iter()
            .filter(|e| e.port_num == u32::from(PORT))
            .map(|e| {
                let gid: ffi::ibv_gid = e.gid.into();
                // SAFETY: every bit pattern of the union is a valid byte array.
                let raw = unsafe { gid.raw };
                GidInfo {
                    index: e.gid_index,
                    gid: std::net::Ipv6Addr::from(raw).to_string(),
                    kind: sysfs_gid_type(sysfs, name, e.gid_index).unwrap_or_else(|| verbs_gid_type(e.gid_type)),
                    ndev_ifindex: e.ndev_ifindex,
                }
            })
            .collect(),
        None => (0..GID_FALLBACK_ENTRIES)
            .filter_map(|i| {
                let raw = ctx.query_gid(PORT, i).ok().filter(|g| g != &[0u8; 16])?;
                Some(GidInfo {
                    index: i,
                    gid: std::net::Ipv6Addr::from(raw).to_string(),
                    kind: sysfs_gid_type(sysfs, name, i).unwrap_or_else(|| "unknown".into()),
                    ndev_ifindex: 0,
                })
            })
            .collect(),
    };
    if info.gids.is_empty() {
        diag.push("no valid GID entries".into());
    }
    for g in &info.gids {
        diag.push(format!("GID[{}] {} {} (ifindex {})", g.index, g.gid, g.kind, g.ndev_ifindex));
    }
    let data = serde_json::to_value(&info).ok();
    let mut result = match problems.is_empty() {
        true => TestResult::pass(&test, diag),
        false => TestResult::fail(&test, diag, problems.join("; ")),
    };
    result.data = data;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_guid_and_link_layer_text() {
        assert_eq!(format_guid(0x0250_56ff_fe12_3456), "0250:56ff:fe12:3456");
        assert_eq!(link_layer(2), "Ethernet");
        assert_eq!(link_layer(1), "InfiniBand");
        assert_eq!(verbs_gid_type(ffi::IBV_GID_TYPE_ROCE_V2), "RoCE v2");
    }

    #[test]
    fn test_sysfs_gid_type() {
        let dir = tempfile::tempdir().unwrap();
        let types = dir.path().join("class/infiniband/rxe_nic0/ports/1/gid_attrs/types");
        std::fs::create_dir_all(&types).unwrap();
        std::fs::write(types.join("1"), "RoCE v2\n").unwrap();
        assert_eq!(sysfs_gid_type(dir.path(), "rxe_nic0", 1).as_deref(), Some("RoCE v2"));
        assert_eq!(sysfs_gid_type(dir.path(), "rxe_nic0", 2), None);
    }
}
