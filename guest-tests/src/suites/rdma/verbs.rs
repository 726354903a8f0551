//! `gdrvm-verbs`, the dynamically linked verbs helper: where it is, and its JSON result
//! lines turned into KTAP checks.

use std::path::PathBuf;

use serde::Deserialize;

use crate::ktap::{Check, Verdict};

/// Where the image puts gdrvm-verbs.
pub const VERBS: &str = "/usr/bin/gdrvm-verbs";

/// gdrvm-verbs: [`VERBS`], else next to the running agent (a bare-metal build directory).
pub fn binary() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("gdrvm-verbs")));
    [Some(PathBuf::from(VERBS)), beside].into_iter().flatten().find(|p| p.is_file())
}

/// One result line of gdrvm-verbs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VerbsResult {
    /// Test name.
    pub test: String,
    /// Whether it held.
    pub ok: bool,
    /// Diagnostics, a failure's reason last.
    #[serde(default)]
    pub diag: Vec<String>,
    /// Why it did not run.
    #[serde(default)]
    pub skip: Option<String>,
    /// Structured detail (`query`).
    #[serde(default)]
    pub data: Option<serde_json::Value>,
}

impl VerbsResult {
    /// The KTAP check, named `prefix` + test.
    pub fn to_check(&self, prefix: &str) -> Check {
        let name = format!("{prefix}{}", self.test);
        let verdict = match (&self.skip, self.ok) {
            (Some(reason), _) => Verdict::Skip(reason.clone()),
            (None, true) => Verdict::Pass,
            (None, false) => {
                Verdict::Fail(self.diag.last().cloned().unwrap_or_else(|| "failed (no reason given)".into()))
            }
        };
        // A failure's reason is printed with the verdict; keep the rest as diagnostics.
        let n = if matches!(verdict, Verdict::Fail(_)) { self.diag.len().saturating_sub(1) } else { self.diag.len() };
        Check { diagnostics: self.diag[..n].to_vec(), ..Check::new(&name, verdict) }
    }
}

/// Parses gdrvm-verbs's stdout; lines that are not results come back as errors.
pub fn parse_results(stdout: &str) -> (Vec<VerbsResult>, Vec<String>) {
    let (mut results, mut bad) = (Vec::new(), Vec::new());
    for line in stdout.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<VerbsResult>(line) {
            Ok(r) => results.push(r),
            Err(e) => bad.push(format!("unreadable line from gdrvm-verbs ({e}): {line}")),
        }
    }
    (results, bad)
}

/// The parts of `gdrvm-verbs query`'s device description the suite checks.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QueryDevice {
    /// Device name.
    pub name: String,
    /// Port 1.
    pub port: Option<QueryPort>,
    /// GID entries.
    #[serde(default)]
    pub gids: Vec<QueryGid>,
}

/// Port 1 as gdrvm-verbs saw it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QueryPort {
    /// `PORT_ACTIVE` ...
    pub state: String,
    /// Bytes.
    pub active_mtu: u32,
    /// `Ethernet` / `InfiniBand`.
    pub link_layer: String,
}

/// A GID entry as gdrvm-verbs saw it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QueryGid {
    /// Index.
    pub index: u32,
    /// `::ffff:10.77.0.1`.
    pub gid: String,
    /// `RoCE v2` ...
    #[serde(rename = "type")]
    pub kind: String,
}

impl VerbsResult {
    /// The device description of a `device_<name>` result.
    pub fn device(&self) -> Option<QueryDevice> {
        serde_json::from_value(self.data.clone()?).ok()
    }
}

/// What the suite expects of a soft-RoCE device in the verbs view: port ACTIVE on
/// Ethernet, and GID `gid_index` present as RoCE v2 with address `gid`.
pub fn check_device(dev: &QueryDevice, gid_index: u32, gid: &str) -> Result<Vec<String>, String> {
    let mut notes = Vec::new();
    let port = dev.port.as_ref().ok_or_else(|| format!("{}: port 1 could not be queried", dev.name))?;
    notes.push(format!("verbs: port 1 {}, active MTU {}, link layer {}", port.state, port.active_mtu, port.link_layer));
    if port.state != "PORT_ACTIVE" {
        return Err(format!("{} port 1 is {}, not PORT_ACTIVE", dev.name, port.state));
    }
    if port.link_layer != "Ethernet" {
        return Err(format!("{} port 1 link layer is {}, not Ethernet (RoCE)", dev.name, port.link_layer));
    }
    match dev.gids.iter().find(|g| g.index == gid_index) {
        Some(g) if g.kind == "RoCE v2" && g.gid == gid => {
            notes.push(format!("verbs: GID[{}] {} {}", g.index, g.gid, g.kind));
            Ok(notes)
        }
        Some(g) => Err(format!("verbs shows GID[{gid_index}] as {} {}, sysfs as {gid} RoCE v2", g.gid, g.kind)),
        None => Err(format!("verbs shows no GID[{gid_index}] on {} (sysfs has {gid} RoCE v2 there)", dev.name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as gdrvm-verbs prints them.
    const PAIR: &str = r#"{"test":"setup","ok":true,"diag":["rxe_nic0 port 1 PORT_ACTIVE, active MTU 1024, GID[3] ::ffff:10.77.0.1"]}
{"test":"rdma_write_4096","ok":false,"diag":["RDMA WRITE 4096 B to peer 0x7f00 (rkey 0x5d4) in 1.20 ms: 0.027 Gb/s","peer 10.77.0.2:18501 closed the connection during rdma_write_4096"]}
{"test":"rdma_read_4096","ok":true,"diag":[],"skip":"not asked for"}
garbage
"#;

    #[test]
    fn test_results_become_checks() {
        let (results, bad) = parse_results(PAIR);
        assert_eq!(results.len(), 3);
        assert_eq!(bad.len(), 1);
        assert!(bad[0].starts_with("unreadable line from gdrvm-verbs"), "{}", bad[0]);
        let checks: Vec<Check> = results.iter().map(|r| r.to_check("node1_")).collect();
        assert_eq!(checks[0].name, "node1_setup");
        assert_eq!(checks[0].verdict, Verdict::Pass);
        assert_eq!(checks[0].diagnostics.len(), 1);
        assert_eq!(checks[1].name, "node1_rdma_write_4096");
        assert_eq!(
            checks[1].verdict,
            Verdict::Fail("peer 10.77.0.2:18501 closed the connection during rdma_write_4096".into())
        );
        assert_eq!(checks[1].diagnostics, ["RDMA WRITE 4096 B to peer 0x7f00 (rkey 0x5d4) in 1.20 ms: 0.027 Gb/s"]);
        assert_eq!(checks[2].verdict, Verdict::Skip("not asked for".into()));
        let no_reason = VerbsResult { test: "x".into(), ok: false, diag: vec![], skip: None, data: None };
        assert_eq!(no_reason.to_check("").verdict, Verdict::Fail("failed (no reason given)".into()));
    }

    const QUERY: &str = r#"{"test":"devices","ok":true,"diag":["1 RDMA device(s): rxe_nic0"]}
{"test":"device_rxe_nic0","ok":true,"diag":["port 1: PORT_ACTIVE"],"data":{"name":"rxe_nic0","node_guid":"5054:00ff:fe12:3401","fw_ver":"","max_qp":1048576,"max_qp_wr":1048576,"max_cqe":1048576,"max_mr":524287,"max_mr_size":18446744073709551615,"max_qp_rd_atom":128,"phys_port_cnt":1,"port":{"state":"PORT_ACTIVE","active_mtu":1024,"max_mtu":4096,"link_layer":"Ethernet","lid":0,"gid_tbl_len":1024,"max_msg_sz":2147483648},"gids":[{"index":0,"gid":"fe80::5054:ff:fe12:3401","type":"IB/RoCE v1","ndev_ifindex":2},{"index":1,"gid":"fe80::5054:ff:fe12:3401","type":"RoCE v2","ndev_ifindex":2},{"index":3,"gid":"::ffff:10.77.0.1","type":"RoCE v2","ndev_ifindex":2}]}}
"#;

    #[test]
    fn test_query_device_checks() {
        let (results, bad) = parse_results(QUERY);
        assert!(bad.is_empty(), "{bad:?}");
        let dev = results[1].device().unwrap();
        assert_eq!(dev.name, "rxe_nic0");
        let notes = check_device(&dev, 3, "::ffff:10.77.0.1").unwrap();
        assert_eq!(
            notes,
            [
                "verbs: port 1 PORT_ACTIVE, active MTU 1024, link layer Ethernet",
                "verbs: GID[3] ::ffff:10.77.0.1 RoCE v2"
            ]
        );
        assert_eq!(
            check_device(&dev, 1, "::ffff:10.77.0.1"),
            Err("verbs shows GID[1] as fe80::5054:ff:fe12:3401 RoCE v2, sysfs as ::ffff:10.77.0.1 RoCE v2".into())
        );
        assert!(check_device(&dev, 2, "::ffff:10.77.0.1").unwrap_err().starts_with("verbs shows no GID[2]"));
        let mut down = dev.clone();
        down.port.as_mut().unwrap().state = "PORT_DOWN".into();
        assert_eq!(
            check_device(&down, 3, "::ffff:10.77.0.1"),
            Err("rxe_nic0 port 1 is PORT_DOWN, not PORT_ACTIVE".into())
        );
        assert_eq!(results[0].device(), None);
    }
}
