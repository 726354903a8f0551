use std::path::{Path, PathBuf};

use super::fake::{FakeFunction, FakeHost, FakeNuma};
use super::*;
use crate::host_pci::HostPci;
use crate::node::{Backing, EndpointKind, FunctionKind, Node};

fn preset(name: &str) -> Node {
    Node::preset(name).expect("preset exists").expect("preset is valid")
}

/// Writes `host` into a temporary directory and captures it.
fn capture_of(host: &FakeHost, opts: &CaptureOptions) -> (tempfile::TempDir, Result<Capture, CaptureError>) {
    let dir = tempfile::tempdir().unwrap();
    host.write(dir.path());
    let result = capture(dir.path(), opts);
    (dir, result)
}

fn notes_of(c: &Capture) -> String {
    c.notes.join("\n")
}

fn has_note(c: &Capture, fragments: &[&str]) -> bool {
    c.notes.iter().any(|n| fragments.iter().all(|f| n.contains(f)))
}

#[test]
fn test_round_trip_of_presets_is_equivalent_and_says_nothing_is_missing() {
    for name in ["minimal", "flat", "vela-a100"] {
        // As booted (scaled to a guest's size), and as the preset says.
        let node = preset(name).scaled(Some(4), Some(2 << 30)).unwrap();
        let (_dir, c) = capture_of(&FakeHost::of(&node), &CaptureOptions::default());
        let c = c.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(equivalent(&node, &c.node), Ok(()), "{name}:\n{}", c.toml);
        assert!(c.notes.is_empty(), "{name}: {}", notes_of(&c));
        let node = preset(name);
        let (dir, c) = capture_of(&FakeHost::of(&node), &CaptureOptions::default());
        let c = c.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(equivalent(&node, &c.node), Ok(()), "{name}:\n{}", c.toml);
        assert!(c.notes.iter().all(|n| n.contains("more than a gdrvm guest takes")), "{name}: {}", notes_of(&c));
        // The text itself loads, comments and all, and the same BDFs come out.
        let again = Node::parse_with_host("again", &c.toml, &HostPci::at(dir.path().join("sys"))).unwrap();
        let bdfs = |n: &Node| n.functions.iter().map(|f| f.bdf).collect::<Vec<_>>();
        assert_eq!(bdfs(&again), bdfs(&node), "{name}");
    }
}

#[test]
fn test_vela_capture_names_in_address_order_and_keeps_acs_and_numa() {
    let (_dir, c) = capture_of(&FakeHost::of(&preset("vela-a100")), &CaptureOptions::default());
    let c = c.unwrap();
    let names: Vec<&str> = c
        .node
        .functions
        .iter()
        .filter(|f| matches!(f.kind, FunctionKind::Endpoint(EndpointKind::Gpu | EndpointKind::Nic)))
        .map(|f| f.name.as_str())
        .collect();
    assert_eq!(names, ["gpu0", "gpu1", "nic0", "gpu2", "gpu3", "gpu4", "gpu5", "nic1", "gpu6", "gpu7"]);
    assert!(c.toml.contains("memory = \"576G\"\ndistances = [10, 21]"), "{}", c.toml);
    assert!(
        c.toml.contains("acs_control = [\"request_redirect\", \"completion_redirect\", \"upstream_forwarding\"]"),
        "{}",
        c.toml
    );
    assert!(c.toml.starts_with("# Captured from "), "{}", c.toml);
    assert!(c.toml.contains("# host 0000:03:00.0\nname = \"gpu0\""), "{}", c.toml);
    assert!(c.toml.contains("# host node 1\ncpus = "), "{}", c.toml);
    assert!(c.toml.contains("host_numa = 1\n"), "{}", c.toml);
    assert_eq!(c.node.numa[1].host_numa, Some(1));
}

#[test]
fn test_flat_and_vela_are_not_equivalent_and_every_difference_is_named() {
    let diffs = equivalent(&preset("flat"), &preset("vela-a100")).unwrap_err();
    assert_eq!(diffs, ["host bridges: 1 (pcie0) in flat, 5 (pxb0, pxb1, pxb2, pxb3, pxb4) in vela-a100"]);
    // Same tree, a GPU's link and a switch's ACS changed: both found, named on each side.
    let text = crate::node::Node::preset_text("minimal").unwrap();
    let changed = text.replacen("link = \"16GT/s x16\"\nats = true", "link = \"16GT/s x8\"\nats = true", 1).replacen(
        "ports = 2\nlink = \"16GT/s x16\"",
        "ports = 2\nlink = \"16GT/s x16\"\nacs_control = [\"request_redirect\"]",
        1,
    );
    let changed =
        changed.replace("name = \"gpu0\"", "name = \"g\"").replace("name = \"minimal\"", "name = \"changed\"");
    let diffs = equivalent(&preset("minimal"), &Node::parse("changed", &changed).unwrap()).unwrap_err();
    assert_eq!(
        diffs,
        [
            "sw0.down0 (02:00.0) / sw0.down0 (02:00.0) ACS control: 0x0000 in minimal, 0x0004 in changed",
            "gpu0 (03:00.0) / g (03:00.0) link: 16.0 GT/s x16 in minimal, 16.0 GT/s x8 in changed",
            "sw0.down1 (02:01.0) / sw0.down1 (02:01.0) ACS control: 0x0000 in minimal, 0x0004 in changed",
        ]
    );
    // Names alone do not count.
    let renamed = Node::parse("renamed", &text.replace("\"sw0\"", "\"s\"").replace("\"gpu0\"", "\"g\"")).unwrap();
    assert_eq!(equivalent(&preset("minimal"), &renamed), Ok(()));
}

#[test]
fn test_vfio_backings_by_address_and_by_class() {
    let host = FakeHost::of(&preset("minimal"));
    let opts = CaptureOptions { vfio: vec!["03:00.0".into()], vfio_classes: vec!["nic".into()] };
    let (_dir, c) = capture_of(&host, &opts);
    let c = c.unwrap();
    let backing = |name: &str| c.node.functions.iter().find(|f| f.name == name).unwrap().backing.clone();
    assert_eq!(backing("gpu0"), Backing::Vfio("0000:03:00.0".parse().unwrap()));
    assert_eq!(backing("nic0"), Backing::Vfio("0000:04:00.0".parse().unwrap()));
    assert!(c.toml.contains("backing = \"vfio:0000:04:00.0\""), "{}", c.toml);
}

#[test]
fn test_vfio_options_that_name_nothing_usable_are_errors() {
    let host = FakeHost::of(&preset("minimal"));
    let run = |vfio: &[&str], classes: &[&str]| {
        let opts = CaptureOptions {
            vfio: vfio.iter().map(|s| (*s).to_owned()).collect(),
            vfio_classes: classes.iter().map(|s| (*s).to_owned()).collect(),
        };
        capture_of(&host, &opts).1.unwrap_err().to_string()
    };
    assert_eq!(run(&["0000:01:00.0"], &[]), "--vfio 0000:01:00.0: a bridge, not an endpoint");
    let err = run(&["3b:00.0"], &[]);
    assert!(err.starts_with("--vfio 0000:3b:00.0: no such function ("), "{err}");
    assert!(err.ends_with("sys/bus/pci/devices/0000:3b:00.0)"), "{err}");
    assert_eq!(run(&["3b:00"], &[]), "--vfio 3b:00: '3b:00' is not a PCI address (DDDD:BB:DD.F or BB:DD.F)");
    assert_eq!(run(&[], &["fpga"]), "--vfio-class fpga: not an endpoint kind (gpu, nic, nvswitch, generic)");
}

/// minimal with what real hosts have and node files cannot say.
fn awkward_minimal() -> FakeHost {
    let mut host = FakeHost::of(&preset("minimal"));
    let nic = host.function_mut("0000:04:00.0").clone();
    for (bdf, vf) in [("0000:04:00.1", 0x101e), ("0000:04:00.2", 0x101e)] {
        host.functions.push(FakeFunction {
            bdf: bdf.into(),
            device: vf,
            link: None,
            physfn: Some("0000:04:00.0".into()),
            ..nic.clone()
        });
    }
    let nic = host.function_mut("0000:04:00.0");
    nic.device = 0x101d;
    nic.io_bars = vec![2];
    let gpu = host.function_mut("0000:03:00.0");
    gpu.link = Some((("16.0 GT/s PCIe".into(), 16), ("16.0 GT/s PCIe".into(), 8)));
    let audio = FakeFunction { bdf: "0000:03:00.1".into(), class: 0x040300, bars: vec![], ..gpu.clone() };
    host.functions.push(audio);
    let root = host.function_mut("0000:00:01.0").clone();
    let pci_bridge = FakeFunction { bdf: "0000:00:02.0".into(), port_type: Some(7), acs: None, ..root.clone() };
    let behind = FakeFunction {
        bdf: "0000:05:01.0".into(),
        parents: vec!["0000:00:02.0".into()],
        class: 0x020000,
        vendor: 0x8086,
        device: 0x100e,
        port_type: None,
        link: None,
        acs: None,
        bars: vec![],
        ..root.clone()
    };
    let isa = FakeFunction {
        bdf: "0000:00:1f.0".into(),
        class: 0x060100,
        vendor: 0x8086,
        device: 0x2918,
        port_type: None,
        link: None,
        acs: None,
        ..root
    };
    host.functions.extend([pci_bridge, behind, isa]);
    host
}

#[test]
fn test_what_a_node_cannot_say_is_noted_and_the_rest_loads() {
    let (_dir, c) = capture_of(&awkward_minimal(), &CaptureOptions::default());
    let c = c.unwrap();
    let expected: [&[&str]; 6] = [
        &["0000:04:00.1, 0000:04:00.2: left out: virtual functions of 0000:04:00.0", "--vfio"],
        &["0000:03:00.0: link trained to 16.0 GT/s PCIe x8 where both ends can do 16.0 GT/s PCIe x16"],
        &["0000:03:00.1: left out: other functions on the link of 0000:03:00.0"],
        &["0000:00:02.0, 0000:05:01.0: left out: a bridge of PCIe port type 7 on a root bus"],
        &["0000:00:1f.0: left out: class 060100 [8086:2918] without a PCIe link"],
        &["0000:04:00.0: I/O BARs [2] left out"],
    ];
    for fragments in expected {
        assert!(has_note(&c, fragments), "{fragments:?} not in:\n{}", notes_of(&c));
    }
    assert_eq!(c.notes.len(), expected.len(), "{}", notes_of(&c));
    for note in &c.notes {
        let first = note.split_whitespace().next().unwrap();
        assert!(c.toml.contains(&format!("# - {first}")), "{note}\n{}", c.toml);
    }
    // The PF stands at the NIC's place, as a PF.
    let nic = c.node.functions.iter().find(|f| f.name == "nic0").unwrap();
    assert_eq!((nic.device, nic.virtual_function), (0x101d, false));
}

#[test]
fn test_a_vf_named_for_vfio_takes_its_pfs_place() {
    let opts = CaptureOptions { vfio: vec!["0000:04:00.2".into()], ..Default::default() };
    let (_dir, c) = capture_of(&awkward_minimal(), &opts);
    let c = c.unwrap();
    let nic = c.node.functions.iter().find(|f| f.name == "nic0").unwrap();
    assert_eq!((nic.device, nic.virtual_function), (0x101e, true));
    assert_eq!(nic.backing, Backing::Vfio("0000:04:00.2".parse().unwrap()));
    assert!(has_note(&c, &["0000:04:00.2: a virtual function of 0000:04:00.0, in its place"]), "{}", notes_of(&c));
    assert!(has_note(&c, &["0000:04:00.0, 0000:04:00.1: left out: other functions on the link"]), "{}", notes_of(&c));
    let opts = CaptureOptions { vfio: vec!["0000:04:00.2".into(), "0000:04:00.1".into()], ..Default::default() };
    let err = capture_of(&awkward_minimal(), &opts).1.unwrap_err().to_string();
    assert_eq!(
        err,
        "--vfio 0000:04:00.1 and 0000:04:00.2: functions on one link, where a node has room for one; name one of them"
    );
}

#[test]
fn test_an_empty_port_before_a_device_is_noted() {
    let mut host = FakeHost::of(&preset("minimal"));
    host.functions.retain(|f| f.bdf != "0000:03:00.0");
    let (_dir, c) = capture_of(&host, &CaptureOptions::default());
    let c = c.unwrap();
    assert!(
        has_note(
            &c,
            &["switch 0000:01:00.0: the node fills downstream ports in order", "0000:04:00.0 from port 1 to 0"]
        ),
        "{}",
        notes_of(&c)
    );
}

#[test]
fn test_numa_nodes_without_cpus_and_devices_without_proximity() {
    let mut host = FakeHost::of(&preset("flat"));
    for f in &mut host.functions {
        f.numa_node = -1;
    }
    // A memory-only node (GPU or CXL memory), far from both.
    for n in &mut host.numa {
        n.distances.push(40);
    }
    host.numa.push(FakeNuma { cpus: vec![], memory: 64 << 30, distances: vec![40, 40, 10] });
    let (_dir, c) = capture_of(&host, &CaptureOptions::default());
    let c = c.unwrap();
    assert!(has_note(&c, &["host NUMA node 2 (0 CPUs, 65536 MiB): left out"]), "{}", notes_of(&c));
    assert!(has_note(&c, &["pci0000:00: numa_node -1", "NUMA node 0"]), "{}", notes_of(&c));
    assert_eq!(c.node.numa.len(), 2);
    assert_eq!(c.node.numa[1].distances, [21, 10]);
}

#[test]
fn test_config_read_without_root_infers_ports_and_loses_acs() {
    let mut host = FakeHost::of(&preset("minimal"));
    host.config_len = 64;
    let (_dir, c) = capture_of(&host, &CaptureOptions::default());
    let c = c.unwrap();
    let read = "0000:00:01.0, 0000:01:00.0, 0000:02:00.0, 0000:02:01.0, 0000:03:00.0, 0000:04:00.0: configuration \
                space unreadable beyond its header";
    assert!(has_note(&c, &[read]), "{}", notes_of(&c));
    assert_eq!(c.notes.len(), 1, "{}", notes_of(&c));
    let diffs = equivalent(&preset("minimal"), &c.node).unwrap_err();
    assert!(diffs.iter().all(|d| d.contains(" ACS: true in minimal, false in ") || d.contains(" ATS: ")), "{diffs:?}");
}

#[test]
fn test_unreadable_and_malformed_sysfs_name_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = capture(&dir.path().join("nowhere"), &CaptureOptions::default()).unwrap_err();
    assert!(matches!(&err, CaptureError::Read { path, .. } if path.ends_with("nowhere/sys/bus/pci/devices")), "{err}");
    FakeHost::of(&preset("minimal")).write(dir.path());
    let cpulist = dir.path().join("sys/devices/system/node/node0/cpulist");
    std::fs::write(&cpulist, "0-x\n").unwrap();
    let err = capture(dir.path(), &CaptureOptions::default()).unwrap_err().to_string();
    assert_eq!(err, format!("{}: '0-x' is not a CPU or CPU range", cpulist.display()));
    std::fs::write(&cpulist, "0-1\n").unwrap();
    let class = dir.path().join("sys/bus/pci/devices/0000:03:00.0/class");
    std::fs::write(&class, "gpu\n").unwrap();
    let err = capture(dir.path(), &CaptureOptions::default()).unwrap_err().to_string();
    assert!(err.contains("0000:03:00.0/class: 'gpu' is not a hex number"), "{err}");
}

/// The recorded sysfs of the machine gdrvm is developed on (a VM with virtio devices on
/// one root bus; see fixtures/record-sysfs.sh).
fn dev_vm() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/capture/fixtures/dev-vm")
}

#[test]
fn test_capture_of_the_recorded_dev_vm_loads() {
    let c = capture(&dev_vm(), &CaptureOptions::default()).unwrap();
    let again = Node::parse_with_host("dev-vm", &c.toml, &HostPci::at(dev_vm().join("sys"))).unwrap();
    assert_eq!(again, Node { source: again.source.clone(), ..c.node.clone() });
    assert_eq!((c.node.cpus(), c.node.memory()), (2, 24 << 30));
    let nics: Vec<(&str, u16, u16)> = c
        .node
        .functions
        .iter()
        .filter(|f| f.kind == FunctionKind::Endpoint(EndpointKind::Nic))
        .map(|f| (f.name.as_str(), f.vendor, f.device))
        .collect();
    assert_eq!(nics, [("nic0", 0x1af4, 0x1041)]);
    assert!(has_note(&c, &["0000:00:03.0: no PCIe link", "2.5GT/s x1"]), "{}", notes_of(&c));
    assert!(has_note(&c, &["0000:00:01.0: left out: class ffff00 [1af4:1045]"]), "{}", notes_of(&c));
    assert!(
        has_note(&c, &["host bridge function 0000:00:00.0 is [8086:0d57] on the host, [1b36:0008]"]),
        "{}",
        notes_of(&c)
    );
    let opts = CaptureOptions { vfio_classes: vec!["nic".into()], ..Default::default() };
    let c = capture(&dev_vm(), &opts).unwrap();
    assert!(c.toml.contains("backing = \"vfio:0000:00:03.0\""), "{}", c.toml);
    // A function named for passthrough is kept, link or not.
    let opts = CaptureOptions { vfio: vec!["00:02.0".into()], ..Default::default() };
    let c = capture(&dev_vm(), &opts).unwrap();
    assert!(c.toml.contains("name = \"dev0\"\nkind = \"generic\"\nparent = \"hb0\"\nslot = 2\n"), "{}", c.toml);
    assert!(c.toml.contains("backing = \"vfio:0000:00:02.0\""), "{}", c.toml);
}

/// The recorded sysfs of a GPU machine: a Firecracker VM with one NVIDIA H200 passed
/// through (device check of 2026-12-04, fixtures/record-sysfs.sh run as root there).
fn h200_vm() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/capture/fixtures/h200-vm")
}

#[test]
fn test_capture_of_a_recorded_h200_vm_keeps_the_gpu_as_the_host_has_it() {
    let c = capture(&h200_vm(), &CaptureOptions { vfio_classes: vec!["gpu".into()], ..Default::default() }).unwrap();
    let again = Node::parse_with_host("h200-vm", &c.toml, &HostPci::at(h200_vm().join("sys"))).unwrap();
    assert_eq!(again, Node { source: again.source.clone(), ..c.node.clone() });
    assert_eq!(c.node.cpus(), 16);
    let gpus: Vec<&crate::node::Function> =
        c.node.functions.iter().filter(|f| f.kind == FunctionKind::Endpoint(EndpointKind::Gpu)).collect();
    let [gpu] = gpus[..] else { panic!("{}", c.toml) };
    assert_eq!((gpu.name.as_str(), gpu.vendor, gpu.device, gpu.class), ("gpu0", 0x10de, 0x2335, 0x030200));
    assert_eq!(gpu.subsystem, Some((0x10de, 0x18bf)));
    assert_eq!(gpu.link.as_ref().map(|l| (l.speed, l.width)), Some((crate::node::LinkSpeed::Gt32, 16)));
    // Registers, the 256 GiB aperture and 32 MiB, as that VM presents them: all three
    // 64-bit prefetchable (at 0, 2 and 4), where the bare chip's BAR0 is 32-bit.
    let bars: Vec<(u8, u64, bool, bool)> =
        gpu.bars.iter().map(|b| (b.index, b.size, b.prefetchable, b.is_64bit)).collect();
    assert_eq!(bars, [(0, 16 << 20, true, true), (2, 256 << 30, true, true), (4, 32 << 20, true, true)], "{}", c.toml);
    assert!(matches!(&gpu.backing, Backing::Vfio(b) if b.to_string() == "0000:00:06.0"), "{:?}", gpu.backing);
    // The virtio functions beside it have no PCIe link: left out, each with a note.
    for bdf in ["00:01.0", "00:02.0", "00:04.0", "00:05.0"] {
        assert!(has_note(&c, &[&format!("0000:{bdf}: left out")]), "{}", notes_of(&c));
    }
}

/// The sysfs of a guest gdrvm booted on `preset` (fixtures/guest-<preset>, written by
/// `cargo xtask record-sysfs --node <preset>` with the vCPUs and memory given here): Linux's
/// own view of gdrvm's tree, not the fake's.
fn recorded_guest(preset: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("src/capture/fixtures/guest-{preset}"))
}

#[test]
fn test_captures_of_recorded_guests_are_their_presets() {
    for (preset, cpus, memory) in [("minimal", 2, 1u64 << 30), ("flat", 2, 1 << 30), ("vela-a100", 4, 1 << 30)] {
        let root = recorded_guest(preset);
        let c = capture(&root, &CaptureOptions::default()).unwrap_or_else(|e| panic!("{preset}: {e}"));
        let booted = Node::preset(preset).unwrap().unwrap().scaled(Some(cpus), Some(memory)).unwrap();
        if let Err(differences) = equivalent(&booted, &c.node) {
            panic!("{preset}: the recorded guest's capture differs:\n{}\n{}", differences.join("\n"), c.toml);
        }
        // Each guest NUMA node is bound to the node it was captured from.
        assert!(c.node.numa.iter().all(|n| n.host_numa == Some(n.id)), "{preset}: {}", c.toml);
    }
    // What sets the presets apart survives Linux: vela-a100's two NUMA nodes, its five root
    // complexes and its switches; flat's one root bus and none.
    let vela = capture(&recorded_guest("vela-a100"), &CaptureOptions::default()).unwrap().node;
    assert_eq!((vela.numa.len(), vela.host_bridges.len()), (2, 5));
    let switches = |n: &Node| n.functions.iter().filter(|f| f.kind == FunctionKind::SwitchUpstream).count();
    assert_eq!(switches(&vela), 4);
    let flat = capture(&recorded_guest("flat"), &CaptureOptions::default()).unwrap().node;
    assert_eq!((flat.host_bridges.len(), switches(&flat)), (1, 0));
}
