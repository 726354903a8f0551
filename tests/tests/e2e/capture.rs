//! `gdrvm topology capture` inside guests booted on minimal, flat and vela-a100: the node
//! file the agent captures from the guest's own sysfs loads, and is equivalent to the preset
//! scaled as the guest was booted (same tree, links, NUMA, IDs, BARs; names may differ).

use gdrvm_e2e::{check, guest, guests, suite};
use gdrvm_harness::ktap::CaseOutcome;
use gdrvm_model::capture::equivalent;
use gdrvm_model::node::Node;

/// The agent's prefix for the captured file's lines (guest-tests' `capture` suite).
const LINE_PREFIX: &str = "capture| ";

fn round_trip(name: &str, preset: &str, cpus: u32, memory: u64, test: &str) {
    let Some((r, dump)) = guest(name, test) else { return };
    let capture = suite(&r, "capture");
    let (outcome, diagnostics) = check(&capture, "capture_loads");
    assert_eq!(outcome, CaseOutcome::Pass, "{dump}");
    let toml: String =
        diagnostics.lines().filter_map(|l| l.strip_prefix(LINE_PREFIX)).map(|l| format!("{l}\n")).collect();
    let captured = Node::parse(&format!("capture inside {name}"), &toml)
        .unwrap_or_else(|e| panic!("the guest's capture does not load: {e}\n{toml}"));
    let booted = Node::preset(preset).expect("preset").expect("valid preset").scaled(Some(cpus), Some(memory));
    let booted = booted.expect("scaled preset");
    // Capture binds each node to the host node it came from: in a guest, the guest's own.
    for n in &captured.numa {
        assert_eq!(n.host_numa, Some(n.id), "{name}: NUMA node {} captured without host_numa\n{toml}", n.id);
    }
    if let Err(differences) = equivalent(&booted, &captured) {
        panic!("{name}: the capture differs from {preset} as booted:\n{}\n{toml}", differences.join("\n"));
    }
}

#[test]
fn test_capture_inside_minimal_is_the_preset() {
    round_trip(guests::MINIMAL, "minimal", 2, 1 << 30, "test_capture_inside_minimal_is_the_preset");
}

#[test]
fn test_capture_inside_flat_is_the_preset() {
    round_trip(guests::FLAT, "flat", 2, 1 << 30, "test_capture_inside_flat_is_the_preset");
}

#[test]
fn test_capture_inside_vela_a100_is_the_preset() {
    round_trip(guests::VELA_NUMA, "vela-a100", 4, 1 << 30, "test_capture_inside_vela_a100_is_the_preset");
}
