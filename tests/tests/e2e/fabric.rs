//! The RoCE fabric: virtio-net where a node's NIC sits, two nodes joined by a userspace
//! wire, soft-RoCE (rdma_rxe) on top, and the `rdma` suite between them: verbs over an RC
//! queue pair (send/receive, RDMA WRITE and READ checked on the far side) and perftest.
//! A peer killed mid-suite fails the other node's test with a reason, and nothing is left
//! behind; malformed virtio descriptors leave the VMM running and the device reset or
//! broken.

use gdrvm_e2e::{check, guest, guests, node_report, suite, PAIR_STARTED};
use gdrvm_harness::ktap::{CaseOutcome, SuiteResult};
use gdrvm_harness::VmOutcome;

/// Failing cases of `s`, with their diagnostics.
fn failures(s: &SuiteResult) -> Vec<String> {
    s.cases
        .iter()
        .filter(|c| c.outcome == CaseOutcome::Fail)
        .map(|c| format!("{}: {}", c.name, c.diagnostics.join(" | ")))
        .collect()
}

#[test]
fn test_two_nodes_run_verbs_and_perftest_over_the_wire() {
    let test = "test_two_nodes_run_verbs_and_perftest_over_the_wire";
    let Some((r, dump)) = guest(guests::TWO_NODE, test) else { return };
    // Each node's failing checks first: the console's tail holds only the last node's end.
    let failing: Vec<String> = ["a", "b"]
        .iter()
        .map(|n| format!("node {n} failed: {:?}", node_report(&r, n).suites.iter().map(failures).collect::<Vec<_>>()))
        .collect();
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{}\n{dump}", failing.join("\n"));
    // One KTAP subtest per node, both ok.
    assert_eq!(r.ktap.planned, Some(2), "{dump}");
    for node in ["a", "b"] {
        let s = r.ktap.suites.iter().find(|s| s.name == node).unwrap_or_else(|| panic!("no node {node}: {dump}"));
        assert!(s.ok, "node {node}: {dump}");
        let report = node_report(&r, node);
        assert!(report.all_ok(), "node {node}: {:?}\n{dump}", report.suites.iter().map(failures).collect::<Vec<_>>());
        let rdma = report.suites.iter().find(|s| s.name == "rdma").unwrap_or_else(|| panic!("{node}: no rdma suite"));
        let skipped: Vec<&str> =
            rdma.cases.iter().filter(|c| matches!(c.outcome, CaseOutcome::Skip(_))).map(|c| c.name.as_str()).collect();
        assert!(skipped.is_empty(), "node {node}: rdma tests skipped: {skipped:?}\n{dump}");
        // The IB device sits on the NIC's function, where the node file put it.
        let parent = rdma.cases.iter().find(|c| c.name.contains("pci_parent")).map(|c| c.diagnostics.join(" "));
        assert!(parent.is_some(), "node {node}: no PCI-parent check\n{dump}");
        // RDMA WRITE and READ at every size, verified.
        for size in ["4096", "65536", "4194304"] {
            for op in ["write", "read"] {
                assert!(
                    rdma.cases
                        .iter()
                        .any(|c| c.name.contains(op) && c.name.contains(size) && c.outcome == CaseOutcome::Pass),
                    "node {node}: no passing rdma {op} at {size}\n{dump}"
                );
            }
        }
        // The topology suite's NCCL walk still passes with virtio-net standing in the NIC's
        // slot, and finds the soft-RoCE device there (by its netdev: on this kernel it has
        // no sysfs parent, which NCCL itself needs, and the diagnostics say so).
        let topology = report.suites.iter().find(|s| s.name == "topology").unwrap_or_else(|| panic!("no topology"));
        assert!(failures(topology).is_empty(), "node {node}: {:?}", failures(topology));
        let ib = topology.cases.iter().find(|c| c.name == "nccl_ib_rxe_nic0").unwrap_or_else(|| panic!("{dump}"));
        let text = ib.diagnostics.join("\n");
        assert!(text.contains("nccl gpu 0000:03:00.0 ib rxe_nic0 at 0000:04:00.0 PIX"), "{text}");
    }
    // perftest's figures are in the output.
    let text = r.console.join("\n");
    for tool in ["ib_write_bw", "ib_read_lat"] {
        assert!(text.contains(tool), "no {tool} figures\n{dump}");
    }
}

#[test]
fn test_a_peer_killed_mid_suite_fails_the_other_node_with_a_reason_and_leaves_nothing() {
    let test = "test_a_peer_killed_mid_suite_fails_the_other_node_with_a_reason_and_leaves_nothing";
    let Some((r, dump)) = guest(guests::TWO_NODE_KILLED, test) else { return };
    assert_eq!(r.outcome, VmOutcome::Exited(1), "{dump}");
    let b = r.ktap.suites.iter().find(|s| s.name == "b").unwrap_or_else(|| panic!("no node b: {dump}"));
    assert!(!b.ok, "{dump}");
    assert!(r.console.iter().any(|l| l.contains("not ok 2 b # killed on purpose")), "{dump}");
    assert!(
        r.console.iter().any(|l| l.contains(&format!("[b] {PAIR_STARTED}"))),
        "b was killed before pairing: {dump}"
    );
    // Node a reached its own verdict: its guest ran the suite to the end and powered off,
    // with a failing rdma test that says what happened to the peer.
    let report = node_report(&r, "a");
    let rdma = report.suites.iter().find(|s| s.name == "rdma").unwrap_or_else(|| panic!("a: no rdma suite\n{dump}"));
    let failed = failures(rdma);
    assert!(!failed.is_empty(), "a: nothing failed\n{dump}");
    assert!(
        failed.iter().any(|f| ["peer", "closed", "timed out", "no completion", "refused", "reset"]
            .iter()
            .any(|w| f.contains(w))),
        "a: no clear reason: {failed:?}"
    );
    assert!(r.console.iter().any(|l| l.starts_with("not ok 1 a # exit 1")), "a did not shut down by itself: {dump}");
    // Neither a process (b's emulators, its VMM) nor a wire socket or directory outlived the run.
    let left: Vec<&String> = r.console.iter().filter(|l| l.contains(gdrvm_model::l1::LEFT_BEHIND)).collect();
    assert!(left.is_empty(), "{left:?}");
}

#[test]
fn test_malformed_virtio_descriptors_leave_the_vmm_running_and_the_device_reset_or_broken() {
    let test = "test_malformed_virtio_descriptors_leave_the_vmm_running_and_the_device_reset_or_broken";
    let Some((r, dump)) = guest(guests::VIRTIO_NET, test) else { return };
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    let virtio = suite(&r, "virtio");
    assert!(failures(&virtio).is_empty(), "{:?}\n{dump}", failures(&virtio));
    assert!(!virtio.cases.is_empty() && virtio.cases.iter().all(|c| c.outcome == CaseOutcome::Pass), "{dump}");
    // The jumped ring index breaks the device as the spec says: DEVICE_NEEDS_RESET.
    let (_, text) = check(&virtio, "nic0_avail_idx_jump");
    assert!(text.contains("NEEDS_RESET"), "{text}\n{dump}");
    // And the driver takes the device back afterwards.
    assert_eq!(check(&virtio, "nic0_driver_rebinds").0, CaseOutcome::Pass, "{dump}");
    // virtio-net in the NIC's place passes the topology suite as the node file says.
    assert!(failures(&suite(&r, "topology")).is_empty(), "{dump}");
}
