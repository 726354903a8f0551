//! Boots the vela-a100 node scaled down and checks the NUMA layout Linux reports. The
//! expectations are written here by hand, not taken from the model.

use gdrvm_e2e::{guests, result, skip};
use gdrvm_harness::ktap::CaseOutcome;
use gdrvm_harness::VmOutcome;

#[test]
fn test_vela_two_numa_nodes_as_described() {
    let r = match result(guests::VELA_NUMA) {
        Ok(r) => r,
        Err(why) => return skip("test_vela_two_numa_nodes_as_described", &why),
    };
    let dump = format!("{:?} {:?}\n{}", r.outcome, r.problem(), r.tail().join("\n"));
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    assert!(r.ktap.all_ok(), "{dump}");
    let topo = r.ktap.suites.iter().find(|s| s.name == "topology").expect("topology suite ran");
    let diag = |check: &str| {
        let c = topo.cases.iter().find(|c| c.name == check).unwrap_or_else(|| panic!("no check {check}"));
        assert_eq!(c.outcome, CaseOutcome::Pass, "{check}: {dump}");
        c.diagnostics.join("\n")
    };
    // vela-a100 has two NUMA nodes; 4 vCPUs and 1 GiB spread evenly.
    assert_eq!(diag("numa_nodes"), "nodes online: 0-1");
    assert_eq!(diag("numa0_cpus"), "node 0 CPUs 0-1");
    assert_eq!(diag("numa1_cpus"), "node 1 CPUs 2-3");
    assert!(diag("numa0_memory").ends_with("present of 512 MiB"));
    assert!(diag("numa1_memory").ends_with("present of 512 MiB"));
    diag("numa0_distances");
    diag("numa1_distances");
    // Every vCPU came up and the kernel had nothing to warn about (CPU topology included).
    let smoke = r.ktap.suites.iter().find(|s| s.name == "smoke").expect("smoke suite ran");
    assert!(smoke.ok, "{dump}");
}
