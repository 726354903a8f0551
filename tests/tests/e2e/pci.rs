//! Boots vela-a100, flat and minimal scaled down and checks the PCIe tree Linux reports and
//! what NCCL would make of it. The expectations are written here by hand from the presets'
//! descriptions (IBM's Vela layout), not taken from the model.

use std::collections::BTreeMap;

use gdrvm_e2e::{guest, guests};
use gdrvm_harness::ktap::{CaseOutcome, SuiteResult};
use gdrvm_harness::{VmOutcome, VmResult};

/// The guest's topology suite, after requiring that the guest passed everything.
fn topology(name: &str, test: &str) -> Option<(VmResult, SuiteResult)> {
    let (r, dump) = guest(name, test)?;
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{dump}");
    assert!(r.ktap.all_ok(), "{dump}");
    let topo = r.ktap.suites.iter().find(|s| s.name == "topology").expect("topology suite ran").clone();
    assert!(topo.cases.iter().all(|c| c.outcome != CaseOutcome::Fail), "{dump}");
    Some((r, topo))
}

/// A diagnostic line of the guest's PCI tree: BDF → (IDs, class, numa, link).
#[derive(Debug, PartialEq, Eq)]
struct PciLine {
    ids: String,
    class: String,
    numa: String,
    link: String,
}

fn pci_lines(topo: &SuiteResult) -> BTreeMap<String, PciLine> {
    let case = topo.cases.iter().find(|c| c.name == "pci_functions").expect("pci_functions check");
    case.diagnostics
        .iter()
        .filter_map(|l| l.strip_prefix("pci "))
        .map(|l| {
            // "0000:03:00.0 [10de:20b2] class 030200 numa 0 link 16.0 GT/s PCIe x16 of ... ACS- ATS+ MSI-X+"
            let w: Vec<&str> = l.split_whitespace().collect();
            let link = l.split_once(" link ").map_or("", |(_, rest)| rest.split(" ACS").next().unwrap_or(""));
            (w[0].to_owned(), PciLine { ids: w[1].into(), class: w[3].into(), numa: w[5].into(), link: link.into() })
        })
        .collect()
}

/// "BARs: N where the VMM put them, M moved by Linux" → (N, M).
fn bar_placement(topo: &SuiteResult) -> (u32, u32) {
    let case = topo.cases.iter().find(|c| c.name == "pci_functions").expect("pci_functions check");
    let line = case.diagnostics.iter().find_map(|l| l.strip_prefix("BARs: ")).expect("a BARs line");
    let w: Vec<&str> = line.split_whitespace().collect();
    (w[0].parse().expect("kept count"), w[6].parse().expect("moved count"))
}

/// NCCL's verdict for every GPU-NIC pair: (GPU, NIC) → (path type, GDR on).
fn gpu_nic_paths(topo: &SuiteResult) -> BTreeMap<(String, String), (String, bool)> {
    let case = topo.cases.iter().find(|c| c.name == "nccl_gdr").expect("nccl_gdr check");
    case.diagnostics
        .iter()
        .filter_map(|l| l.strip_prefix("nccl gpu "))
        .filter(|l| l.contains(" nic "))
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            // "0000:03:00.0 nic 0000:05:00.0 PIX gdr on bw 24.0 GB/s"
            ((w[0].to_owned(), w[2].to_owned()), (w[3].to_owned(), w[5] == "on"))
        })
        .collect()
}

const GEN4_X16: &str = "16.0 GT/s PCIe x16 of 16.0 GT/s PCIe x16";

#[test]
fn test_vela_gpus_nics_numa_links_and_pix_pairs() {
    let Some((_, topo)) = topology(guests::VELA_NUMA, "test_vela_gpus_nics_numa_links_and_pix_pairs") else {
        return;
    };
    let pci = pci_lines(&topo);
    let gpus: Vec<(&String, &PciLine)> = pci.iter().filter(|(_, l)| l.class == "030200").collect();
    let nics: Vec<(&String, &PciLine)> = pci.iter().filter(|(_, l)| l.class == "020000").collect();
    // Four GPUs per NUMA node, two per switch, each switch behind its own expander bridge.
    let want_gpus = [
        ("0000:03:00.0", "0"),
        ("0000:04:00.0", "0"),
        ("0000:0a:00.0", "0"),
        ("0000:0b:00.0", "0"),
        ("0000:11:00.0", "1"),
        ("0000:12:00.0", "1"),
        ("0000:18:00.0", "1"),
        ("0000:19:00.0", "1"),
    ];
    assert_eq!(gpus.iter().map(|(b, l)| (b.as_str(), l.numa.as_str())).collect::<Vec<_>>(), want_gpus);
    for (bdf, l) in &gpus {
        assert_eq!(l.ids, "[10de:20b2]", "{bdf}");
        assert_eq!(l.link, GEN4_X16, "{bdf}");
    }
    // One ConnectX-6 Dx VF per NUMA node, on the first switch of each.
    let want_nics = [("0000:05:00.0", "0"), ("0000:13:00.0", "1")];
    assert_eq!(nics.iter().map(|(b, l)| (b.as_str(), l.numa.as_str())).collect::<Vec<_>>(), want_nics);
    for (bdf, l) in &nics {
        assert_eq!(l.ids, "[15b3:101e]", "{bdf}");
        assert_eq!(l.link, GEN4_X16, "{bdf}");
    }
    // The GPUs sharing a switch with a NIC are PIX to it and run GPUDirect RDMA; every other
    // GPU-NIC pair goes through a host bridge (PHB) or across NUMA nodes (SYS): GDR off.
    let paths = gpu_nic_paths(&topo);
    assert_eq!(paths.len(), 16);
    let pix = [
        ("0000:03:00.0", "0000:05:00.0"),
        ("0000:04:00.0", "0000:05:00.0"),
        ("0000:11:00.0", "0000:13:00.0"),
        ("0000:12:00.0", "0000:13:00.0"),
    ];
    for ((gpu, nic), (path, gdr)) in &paths {
        if pix.contains(&(gpu.as_str(), nic.as_str())) {
            assert_eq!((path.as_str(), *gdr), ("PIX", true), "{gpu} - {nic}");
        } else {
            assert!(["PHB", "SYS"].contains(&path.as_str()) && !gdr, "{gpu} - {nic}: {path} gdr {gdr}");
        }
    }
    // GPU and NIC on different NUMA nodes: SYS.
    assert_eq!(paths[&("0000:03:00.0".into(), "0000:13:00.0".into())].0, "SYS");
    // Linux kept every BAR where the VMM put them: 3 per GPU, 1 per NIC, 1 per NVSwitch.
    assert_eq!(bar_placement(&topo), (8 * 3 + 2 + 6, 0));
}

#[test]
fn test_flat_turns_gdr_off() {
    let Some((_, topo)) = topology(guests::FLAT, "test_flat_turns_gdr_off") else {
        return;
    };
    let pci = pci_lines(&topo);
    let gpus: Vec<&String> = pci.iter().filter(|(_, l)| l.class == "030200").map(|(b, _)| b).collect();
    let nics: Vec<&String> = pci.iter().filter(|(_, l)| l.class == "020000").map(|(b, _)| b).collect();
    assert_eq!((gpus.len(), nics.len()), (8, 2));
    // Everything on root bus 0.
    assert!(pci.keys().all(|b| b.starts_with("0000:00:")), "{pci:?}");
    let paths = gpu_nic_paths(&topo);
    assert_eq!(paths.len(), 16);
    for ((gpu, nic), (path, gdr)) in &paths {
        assert!(["PHB", "SYS"].contains(&path.as_str()) && !gdr, "{gpu} - {nic}: {path} gdr {gdr}");
    }
}

#[test]
fn test_minimal_gpu_and_nic_are_pix() {
    let Some((_, topo)) = topology(guests::MINIMAL, "test_minimal_gpu_and_nic_are_pix") else {
        return;
    };
    let paths = gpu_nic_paths(&topo);
    assert_eq!(
        paths.into_iter().collect::<Vec<_>>(),
        [(("0000:03:00.0".to_owned(), "0000:04:00.0".to_owned()), ("PIX".to_owned(), true))]
    );
}
