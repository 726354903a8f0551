//! VFIO passthrough proven one level down: in a lab L1 (q35, QEMU's intel-iommu), QEMU's
//! e1000e NICs, edu and ivshmem are bound to vfio-pci and gdrvm passes them to its guest.
//! The guest drives them with their real drivers or from userspace and reports what
//! happened; the expectations here are written by hand from what QEMU's devices are.

use gdrvm_e2e::{check as diagnostics, guest, guests, suite};
use gdrvm_harness::ktap::CaseOutcome;
use gdrvm_harness::VmOutcome;

#[test]
fn test_passed_through_nics_dma_engine_and_peer_to_peer_work_in_the_guest() {
    let Some((r, dump)) =
        guest(guests::VFIO_LAB, "test_passed_through_nics_dma_engine_and_peer_to_peer_work_in_the_guest")
    else {
        return;
    };
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    assert!(r.ktap.all_ok(), "{dump}");
    let vfio = suite(&r, "vfio");
    // The real e1000e driver on both NICs, with MSI-X vectors.
    let (outcome, text) = diagnostics(&vfio, "e1000e_bound");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert_eq!(text.matches("driver e1000e").count(), 2, "{text}");
    assert!(text.contains("MSI-X vector(s)"), "{text}");
    // Frames cross QEMU's hub both ways, and interrupts arrive.
    let (outcome, text) = diagnostics(&vfio, "e1000e_frames");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert_eq!(text.matches("8/8 frames received").count(), 2, "{text}");
    // edu answers through its mapped BAR and DMAs guest RAM through L1's IOMMU.
    let (outcome, text) = diagnostics(&vfio, "edu_identity");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert!(text.contains("identity 0x010000ed"), "{text}");
    assert_eq!(diagnostics(&vfio, "edu_dma").0, CaseOutcome::Pass);
    // Peer-to-peer: edu's DMA lands in ivshmem's BAR at its guest-physical address.
    let (outcome, text) = diagnostics(&vfio, "p2p_into_bar");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    // The tree: the devices' own IDs, under the switch.
    let topo = suite(&r, "topology");
    let (_, lspci) = diagnostics(&topo, "lspci");
    for device in ["8086:10d3", "1234:11e8", "1af4:1110"] {
        assert!(lspci.contains(device), "{device} in\n{lspci}");
    }
}

#[test]
fn test_without_p2p_the_dma_into_another_devices_bar_does_not_land() {
    let test = "test_without_p2p_the_dma_into_another_devices_bar_does_not_land";
    let Some((r, dump)) = guest(guests::VFIO_LAB_NO_P2P, test) else { return };
    let vfio = suite(&r, "vfio");
    // Guest RAM is still in edu's IOMMU domain...
    assert_eq!(diagnostics(&vfio, "edu_dma").0, CaseOutcome::Pass, "{dump}");
    // ...but ivshmem's BAR is not: the bytes never arrive, so the other test proves the path.
    let (outcome, text) = diagnostics(&vfio, "p2p_into_bar");
    assert_eq!(outcome, CaseOutcome::Fail, "{text}");
    assert!(text.contains("did not land") || text.contains("all-ones"), "{text}");
}

#[test]
fn test_chaos_on_every_register_ends_with_the_guests_own_verdict() {
    let Some((r, dump)) =
        guest(guests::VFIO_LAB_CHAOS, "test_chaos_on_every_register_ends_with_the_guests_own_verdict")
    else {
        return;
    };
    // The VMM neither crashed nor hung: the guest reported and powered off.
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    let chaos = suite(&r, "chaos");
    let (outcome, text) = diagnostics(&chaos, "vmm_answers");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert_eq!(diagnostics(&chaos, "guest_alive").0, CaseOutcome::Pass, "{dump}");
    // The passed-through devices' firewalls turned writes away, and said how many.
    let stats = r.stats.expect("gdrvm's stats line");
    assert!(stats.dropped_config_writes > 0, "{stats:?}");
}

#[test]
fn test_legacy_intx_reaches_the_guest_through_the_routing_table() {
    let Some((r, dump)) = guest(guests::VFIO_LAB_INTX, "test_legacy_intx_reaches_the_guest_through_the_routing_table")
    else {
        return;
    };
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    let vfio = suite(&r, "vfio");
    // e1000e on INTx: the device's pin, swizzled to the root port, through _PRT to an
    // IOAPIC input, a KVM irqfd with resample, and VFIO's INTx eventfds.
    let (outcome, text) = diagnostics(&vfio, "e1000e_bound");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert_eq!(text.matches("legacy INTx on IRQ").count(), 2, "{text}");
    let (outcome, text) = diagnostics(&vfio, "e1000e_frames");
    assert_eq!(outcome, CaseOutcome::Pass, "{text}");
    assert_eq!(text.matches("8/8 frames received").count(), 2, "{text}");
}
