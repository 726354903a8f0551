//! Emulated devices behind the tree: gdrvm starts `gdrvm-gpu-emu` and `gdrvm-nic-emu` for
//! the presets' GPUs and NICs (vfio-user over a socket pair), and the guest's `gdr` suite
//! drives the NIC's DMA engine from userspace: host memory into the GPU's BAR and back,
//! bandwidth reported. With peer-to-peer off the same transfers are refused; a NIC
//! emulator that dies, errs or hangs mid-suite fails the suite, never the VMM.

use gdrvm_e2e::{check, guest, guests, skip, suite};
use gdrvm_harness::ktap::CaseOutcome;
use gdrvm_harness::VmOutcome;

#[test]
fn test_emulated_gpu_and_nic_carry_gpudirect_dma_on_minimal() {
    let test = "test_emulated_gpu_and_nic_carry_gpudirect_dma_on_minimal";
    let Some((r, dump)) = guest(guests::MINIMAL, test) else { return };
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    assert!(r.ktap.all_ok(), "{dump}");
    let gdr = suite(&r, "gdr");
    for name in [
        "gpu0_registers",
        "nic0_registers",
        "nic0_ring",
        "nic0_host_to_gpu0",
        "nic0_gpu0_to_host",
        "nic0_function_level_reset",
    ] {
        let (outcome, text) = check(&gdr, name);
        assert_eq!(outcome, CaseOutcome::Pass, "{name}: {text}\n{dump}");
    }
    // Every size up to 64 MiB went host -> GPU BAR with its bandwidth reported.
    let (_, text) = check(&gdr, "nic0_host_to_gpu0");
    assert!(text.contains("64 MiB") && text.contains("GB/s"), "{text}");
    // NCCL's decision next to the measured figure.
    let (outcome, text) = check(&gdr, "gdr_matrix");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert!(text.contains("gpu0 nic0 path PIX gdr yes"), "{text}");
    // The topology suite passes unchanged with devices behind the functions.
    assert!(suite(&r, "topology").cases.iter().all(|c| c.outcome != CaseOutcome::Fail), "{dump}");
}

#[test]
fn test_without_p2p_the_nic_cannot_reach_the_gpu_bar() {
    let test = "test_without_p2p_the_nic_cannot_reach_the_gpu_bar";
    let Some((r, dump)) = guest(guests::MINIMAL_NO_P2P, test) else { return };
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    let gdr = suite(&r, "gdr");
    // Host memory to host memory still copies...
    assert_eq!(check(&gdr, "nic0_host_to_host").0, CaseOutcome::Pass, "{dump}");
    // ...but every transfer into the BAR completes with the unmapped status.
    let (outcome, text) = check(&gdr, "nic0_host_to_gpu0");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert!(text.contains("refused (unmapped)"), "{text}");
}

/// A guest whose NIC emulator failed mid-suite: it reached its verdict (the VMM answered
/// all-ones instead of hanging), and the suite failed naming the NIC.
fn assert_device_failure_fails_the_suite(name: &str, test: &str) {
    let Some((r, dump)) = guest(name, test) else { return };
    assert_eq!(r.outcome, VmOutcome::Exited(1), "the guest reports the failure and exits: {dump}");
    let gdr = suite(&r, "gdr");
    let failed: Vec<String> = gdr
        .cases
        .iter()
        .filter(|c| c.outcome == CaseOutcome::Fail)
        .map(|c| format!("{}: {}", c.name, c.diagnostics.join(" ")))
        .collect();
    assert!(failed.iter().any(|f| f.starts_with("nic0")), "{failed:?}\n{dump}");
    // The registers and the ring are set up before the fault strikes.
    assert_eq!(check(&gdr, "nic0_registers").0, CaseOutcome::Pass, "{dump}");
}

#[test]
fn test_a_nic_emulator_killed_mid_suite_fails_the_suite_not_the_vmm() {
    let test = "test_a_nic_emulator_killed_mid_suite_fails_the_suite_not_the_vmm";
    assert_device_failure_fails_the_suite(guests::NIC_DIES, test);
}

#[test]
fn test_a_nic_emulator_answering_errors_fails_the_suite_not_the_vmm() {
    let test = "test_a_nic_emulator_answering_errors_fails_the_suite_not_the_vmm";
    assert_device_failure_fails_the_suite(guests::NIC_ERRORS, test);
}

#[test]
fn test_a_nic_emulator_that_stops_answering_fails_the_suite_not_the_vmm() {
    let test = "test_a_nic_emulator_that_stops_answering_fails_the_suite_not_the_vmm";
    assert_device_failure_fails_the_suite(guests::NIC_HANGS, test);
}

#[test]
fn test_no_guest_leaves_an_emulator_or_any_process_behind() {
    let test = "test_no_guest_leaves_an_emulator_or_any_process_behind";
    let results = match gdrvm_e2e::results() {
        Ok(r) => r,
        Err(why) => return skip(test, &why),
    };
    // L1's agent lists whatever a job left running once it ended (native runs have no
    // such witness; `cargo xtask soak --kill` checks the host side).
    for r in &results {
        let left: Vec<&String> = r.console.iter().filter(|l| l.contains(gdrvm_model::l1::LEFT_BEHIND)).collect();
        assert!(left.is_empty(), "{}: {left:?}", r.name);
    }
}
