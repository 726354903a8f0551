use super::*;
use crate::layout::{mmio64_base, MMIO32_BASE, MMIO32_END, MMIO64_END};

fn preset(name: &str) -> Node {
    Node::preset(name).expect("preset exists").expect("preset is valid")
}

fn by_name<'a>(node: &'a Node, name: &str) -> &'a Function {
    node.functions.iter().find(|f| f.name == name).unwrap_or_else(|| panic!("no function {name}"))
}

/// The chain of bridges from a function up to its root bus.
fn ancestors(node: &Node, name: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut f = by_name(node, name);
    while let Some(p) = f.parent {
        f = &node.functions[p];
        out.push(f.name.clone());
    }
    out
}

#[test]
fn test_minimal_tree() {
    let node = preset("minimal");
    let names: Vec<(&str, String)> = node.functions.iter().map(|f| (f.name.as_str(), f.bdf.to_string())).collect();
    assert_eq!(
        names,
        [
            ("pxb0.host", "0000:00:00.0".into()),
            ("rp0", "0000:00:01.0".into()),
            ("sw0.up", "0000:01:00.0".into()),
            ("sw0.down0", "0000:02:00.0".into()),
            ("gpu0", "0000:03:00.0".into()),
            ("sw0.down1", "0000:02:01.0".into()),
            ("nic0", "0000:04:00.0".into()),
        ]
    );
    assert_eq!(by_name(&node, "rp0").buses, Some((1, 4)));
    assert_eq!(by_name(&node, "sw0.up").buses, Some((2, 4)));
    assert_eq!(node.host_bridges[0].last_bus, 4);
    let gpu = by_name(&node, "gpu0");
    assert_eq!(gpu.link, Some(Link { speed: LinkSpeed::Gt16, width: 16 }));
    assert_eq!(gpu.bars[1], Bar { index: 1, size: 128 << 30, prefetchable: true, is_64bit: true, address: 128 << 30 });
    assert_eq!(gpu.bars[2].index, 3);
    assert_eq!(
        gpu.bars[0],
        Bar { index: 0, size: 16 << 20, prefetchable: false, is_64bit: false, address: MMIO32_BASE }
    );
    assert_eq!(ancestors(&node, "nic0"), ["sw0.down1", "sw0.up", "rp0"]);
    assert!(by_name(&node, "nic0").virtual_function);
    assert_eq!((by_name(&node, "sw0.down0").acs, by_name(&node, "sw0.down0").acs_control), (true, 0));
}

#[test]
fn test_vela_gpus_nics_and_numa() {
    let node = preset("vela-a100");
    let gpus: Vec<&Function> =
        node.functions.iter().filter(|f| f.kind == FunctionKind::Endpoint(EndpointKind::Gpu)).collect();
    assert_eq!(gpus.len(), 8);
    let numa_of = |f: &Function| node.host_bridges[f.host_bridge].numa;
    assert_eq!(gpus.iter().map(|g| numa_of(g)).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 1, 1, 1]);
    // Each NIC VF shares a switch with two GPUs.
    assert_eq!(ancestors(&node, "nic0")[1], "sw0.up");
    assert_eq!(ancestors(&node, "gpu1")[1], "sw0.up");
    assert_eq!(ancestors(&node, "nic1")[1], "sw2.up");
    assert_eq!(node.host_bridges.len(), 5);
    assert_eq!(node.cpus(), 80);
    // Host bridges own disjoint, increasing bus ranges.
    assert!(node.host_bridges.windows(2).all(|w| w[0].last_bus < w[1].first_bus));
    // Vela's switches redirect P2P requests and completions, and forward upstream.
    assert_eq!(by_name(&node, "sw2.down1").acs_control, 0b11100);
    assert_eq!(by_name(&node, "rp2").acs_control, 0);
    let nvswitches = node.functions.iter().filter(|f| f.kind == FunctionKind::Endpoint(EndpointKind::NvSwitch)).count();
    assert_eq!(nvswitches, 6);
}

#[test]
fn test_flat_puts_everything_on_one_root_bus() {
    let node = preset("flat");
    assert_eq!(node.host_bridges.len(), 1);
    assert!(node.functions.iter().all(|f| f.parent.is_none() && f.bdf.bus == 0));
    assert_eq!(node.functions.len(), 17);
    assert_eq!(node.functions[0].kind, FunctionKind::HostBridge);
}

#[test]
fn test_scaling_keeps_the_pcie_layout() {
    let node = preset("vela-a100");
    let small = node.scaled(Some(3), Some(2 << 30)).unwrap();
    let shape = |n: &Node| n.functions.iter().map(|f| (f.name.clone(), f.bdf, f.buses, f.link)).collect::<Vec<_>>();
    assert_eq!(shape(&small), shape(&node));
    // Less RAM, so the 64-bit windows move down.
    assert!(small.highest_mmio() < node.highest_mmio());
    assert_eq!(small.numa.iter().map(|n| n.cpus).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(small.memory(), 2 << 30);
    assert!(node.scaled(Some(1), None).unwrap_err().to_string().contains("cannot cover 2 NUMA nodes"));
}

/// Every BAR is aligned to its size and inside its bridge's window, every bridge window inside
/// its parent's, every root window inside its host bridge's; nothing overlaps.
fn check_addresses(node: &Node) {
    let inside = |inner: Window, outer: Option<Window>| {
        let outer = outer.expect("an enclosing window");
        assert!(inner.base >= outer.base && inner.last() <= outer.last(), "{inner:x?} outside {outer:x?}");
    };
    let mut taken: Vec<Window> = Vec::new();
    for f in &node.functions {
        let hb = &node.host_bridges[f.host_bridge];
        let enclosing = |pref: bool| match f.parent {
            Some(p) => {
                let w = node.functions[p].windows.expect("bridges have windows");
                if pref {
                    w.pref
                } else {
                    w.mem
                }
            }
            None if pref => hb.mem64,
            None => hb.mem32,
        };
        for bar in &f.bars {
            assert_eq!(bar.address % bar.size, 0, "{} BAR{} misaligned", f.name, bar.index);
            let w = Window { base: bar.address, size: bar.size };
            inside(w, enclosing(bar.prefetchable && bar.is_64bit));
            if !bar.is_64bit {
                assert!(w.last() < 1 << 32);
            }
            assert!(taken.iter().all(|t| w.last() < t.base || w.base > t.last()), "{} overlaps", f.name);
            taken.push(w);
        }
        if let Some(w) = f.windows {
            for (win, pref) in [(w.mem, false), (w.pref, true)] {
                if let Some(win) = win {
                    inside(win, enclosing(pref));
                }
            }
        }
    }
    assert!(node.highest_mmio() < MMIO64_END);
}

#[test]
fn test_addresses_nest_and_align() {
    for name in standalone_preset_names() {
        let node = preset(name);
        check_addresses(&node);
        check_addresses(&node.scaled(Some(2), Some(1 << 30)).unwrap());
    }
    let vela = preset("vela-a100").scaled(Some(4), Some(1 << 30)).unwrap();
    let gpu0 = by_name(&vela, "gpu0");
    assert_eq!(gpu0.bars[1].address % (128 << 30), 0);
    assert!(gpu0.bars[0].address >= MMIO32_BASE && gpu0.bars[0].address < MMIO32_END);
    // Above 4 GiB of RAM the 64-bit window starts above RAM.
    assert!(vela.host_bridges[0].mem64.unwrap().base >= mmio64_base(1 << 30));
}

#[test]
fn test_tree_snapshots() {
    insta::assert_snapshot!("minimal", preset("minimal").render_tree());
    insta::assert_snapshot!("vela_a100", preset("vela-a100").render_tree());
}

fn minimal_with(from: &str, to: &str) -> String {
    let text = include_str!("../../presets/minimal.toml");
    assert!(text.contains(from), "{from}");
    text.replacen(from, to, 1)
}

fn error(text: &str) -> String {
    Node::parse("bad.toml", text).unwrap_err().to_string()
}

#[test]
fn test_bad_files_name_file_key_and_reason() {
    assert_eq!(
        error(&minimal_with("link = \"16GT/s x16\"\nats", "link = \"16GT/s x3\"\nats")),
        "bad.toml: key endpoint[0] (gpu0).link: x3 is not a PCIe link width (x1, x2, x4, x8, x12, x16, x32)"
    );
    assert_eq!(
        error(&minimal_with("numa = 0", "numa = 2")),
        "bad.toml: key host_bridge[0] (pxb0).numa: NUMA node 2 does not exist (the file has 1: 0 to 0)"
    );
    let syntax = error(&minimal_with("ports = 2", "ports = = 2"));
    assert!(syntax.starts_with("bad.toml: TOML: ") && syntax.contains("line"), "{syntax}");
    assert_eq!(
        error(&minimal_with("name = \"nic0\"", "name = \"gpu0\"")),
        "bad.toml: key endpoint[1].name: name 'gpu0' is already used by endpoint[0].name"
    );
    assert!(error(&minimal_with("parent = \"sw0\"", "parent = \"sw9\""))
        .contains("'sw9' is not a host bridge, root port or switch"));
    assert!(error(&minimal_with("{ size = \"32M\", prefetchable = true }", "{ size = \"3M\" }"))
        .contains("bars[2].size: 3M is not a power of two"));
    assert!(
        error(&minimal_with("ports = 2", "ports = 1")).contains("switch 'sw0' has only 1 downstream ports, all taken")
    );
    assert_eq!(
        error(&minimal_with("ports = 2", "ports = 2\nacs_control = [\"redirect\"]")),
        "bad.toml: key switch[0] (sw0).acs_control: 'redirect' is not an ACS control (source_validation, \
         translation_blocking, request_redirect, completion_redirect, upstream_forwarding)"
    );
    assert!(error(&minimal_with("ports = 2", "ports = 2\nacs = false\nacs_control = [\"request_redirect\"]"))
        .contains("ACS controls on a port without ACS"));
}

#[test]
fn test_endpoint_and_bar_errors_name_their_field() {
    assert_eq!(
        error(&minimal_with("kind = \"gpu\"", "kind = \"tpu\"")),
        "bad.toml: key endpoint[0] (gpu0).kind: 'tpu' is not gpu, nic, nvswitch or generic"
    );
    assert_eq!(
        error(&minimal_with("kind = \"gpu\"", "kind = \"generic\"")),
        "bad.toml: key endpoint[0] (gpu0).class: a generic endpoint needs its class code"
    );
    assert_eq!(
        error(&minimal_with("{ size = \"16M\", bits = 32 }", "{ size = \"16M\", bits = 16 }")),
        "bad.toml: key endpoint[0] (gpu0).bars[0].bits: 16 is not 32 or 64"
    );
    assert_eq!(
        error(&minimal_with("{ size = \"2M\", prefetchable = true }", &["{ size = \"2M\" }"; 4].join(", "))),
        "bad.toml: key endpoint[1] (nic0).bars[3]: more BARs than the six BAR registers hold"
    );
}

#[test]
fn test_duplicate_bdf() {
    let text = "name = \"dup\"\n[[numa]]\ncpus = 1\nmemory = \"1G\"\n[[host_bridge]]\nname = \"hb\"\nnuma = 0\n\
        [[root_port]]\nname = \"a\"\nhost_bridge = \"hb\"\nslot = 3\nlink = \"8GT/s x4\"\n\
        [[root_port]]\nname = \"b\"\nhost_bridge = \"hb\"\nslot = 3\nlink = \"8GT/s x4\"\n";
    assert_eq!(error(text), "bad.toml: key root_port[1] (b).slot: 0000:00:03.0 is already taken by 'a'");
}

#[test]
fn test_more_than_256_buses() {
    let mut text =
        String::from("name = \"big\"\n[[numa]]\ncpus = 1\nmemory = \"1G\"\n[[host_bridge]]\nname = \"hb\"\nnuma = 0\n");
    // 30 root ports, each with a 8-port switch: 30 * (1 + 1 + 8) = 300 buses.
    for i in 0..30 {
        text += &format!("[[root_port]]\nname = \"rp{i}\"\nhost_bridge = \"hb\"\nlink = \"16GT/s x16\"\n");
        text += &format!("[[switch]]\nname = \"sw{i}\"\nparent = \"rp{i}\"\nports = 8\nlink = \"16GT/s x16\"\n");
    }
    let e = error(&text);
    assert!(e.contains("more than 256 buses"), "{e}");
}

#[test]
fn test_resolve_names_presets_when_nothing_matches() {
    assert_eq!(Node::resolve("minimal").unwrap().name, "minimal");
    let e = Node::resolve("/no/such/node.toml").unwrap_err().to_string();
    assert_eq!(
        e,
        "/no/such/node.toml: no such node file, and not a preset (minimal, flat, vela-a100, vfio-lab, dgx-h100)"
    );
}

#[test]
fn test_bar_that_fits_no_window() {
    // A 1 GiB BAR must sit below 4 GiB as a 32-bit BAR: the 32-bit window holds 512 MiB.
    assert_eq!(
        error(&minimal_with("{ size = \"16M\", bits = 32 }", "{ size = \"1G\", bits = 32 }")),
        "bad.toml: key endpoint[0] (gpu0).bars[0]: a BAR of 1G fits no window: host bridge 'pxb0' needs 1G of \
         32-bit MMIO and only 512M is left"
    );
    // 64-bit BARs beyond what 46 address bits reach.
    let huge =
        error(&minimal_with("{ size = \"128G\", prefetchable = true }", "{ size = \"64T\", prefetchable = true }"));
    assert!(huge.starts_with("bad.toml: key endpoint[0] (gpu0).bars[1]: a BAR of 64T fits no window"), "{huge}");
    // Sizes whose sum overflows 64 bits are refused the same way, without overflowing.
    let absurd = error(&minimal_with(
        "{ size = \"128G\", prefetchable = true },\n  { size = \"32M\", prefetchable = true }",
        "{ size = \"8388608T\", prefetchable = true },\n  { size = \"8388608T\", prefetchable = true }",
    ));
    assert!(absurd.contains("fits no window"), "{absurd}");
}

#[test]
fn test_nccl_xml_snapshot_and_bus_ids() {
    let vela = preset("vela-a100").scaled(Some(4), Some(1 << 30)).unwrap();
    let xml = vela.nccl_topology_xml();
    // Every GPU and NIC the guest has is in the file with its guest bus ID.
    for f in vela.functions.iter().filter(|f| matches!(f.kind, FunctionKind::Endpoint(_))) {
        assert!(xml.contains(&format!("busid=\"{}\"", f.bdf)), "{}", f.name);
    }
    insta::assert_snapshot!("vela_a100_nccl_xml", xml);
}

#[test]
fn test_dot_snapshot_and_every_function() {
    for name in ["minimal", "vela-a100"] {
        let node = preset(name);
        let dot = node.dot();
        for f in &node.functions {
            assert!(dot.contains(&format!("\"fn:{}\" [fillcolor=", f.name)), "{name}: {}", f.name);
        }
        let edges = dot.lines().filter(|l| l.contains(" -> ")).count();
        assert_eq!(edges, node.functions.len(), "{name}: one edge into every function");
        assert_eq!(dot.matches("subgraph cluster_numa").count(), node.numa.len(), "{name}");
    }
    insta::assert_snapshot!("minimal_dot", preset("minimal").dot());
    insta::assert_snapshot!("vela_a100_dot", preset("vela-a100").dot());
}

/// Graphviz must accept the graph (`dot -Tsvg`); skips when Graphviz is not installed.
#[test]
fn test_graphviz_accepts_dot() {
    if std::process::Command::new("dot").arg("-V").output().is_err() {
        eprintln!("SKIP test_graphviz_accepts_dot: dot (graphviz) not installed");
        return;
    }
    for name in standalone_preset_names() {
        let mut child = std::process::Command::new("dot")
            .arg("-Tsvg")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(&mut child.stdin.take().unwrap(), preset(name).dot().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        let svg = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && svg.contains("<svg"), "{name}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// QEMU 7.2 must accept the command line (started paused, stopped after a moment).
#[test]
fn test_qemu_accepts_qemu_args() {
    if std::process::Command::new("qemu-system-x86_64").arg("--version").output().is_err() {
        eprintln!("SKIP test_qemu_accepts_qemu_args: qemu-system-x86_64 not installed");
        return;
    }
    for name in standalone_preset_names() {
        let text = preset(name).scaled(Some(2), Some(1 << 30)).unwrap().qemu_args();
        let args: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .flat_map(|l| l.trim().trim_end_matches('\\').split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .skip(1)
            .map(|a| a.replace("accel=kvm", "accel=tcg"))
            .collect();
        let out = std::process::Command::new("timeout")
            .arg("3")
            .arg("qemu-system-x86_64")
            .args(&args)
            .args(["-display", "none", "-S", "-monitor", "none", "-serial", "none"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let errors: Vec<&str> =
            err.lines().filter(|l| !l.contains("terminating on signal") && !l.contains("has no peer")).collect();
        assert!(errors.is_empty(), "{name}: {errors:?}\n{text}");
        assert_eq!(out.status.code(), Some(124), "{name}: QEMU exited early: {err}");
    }
}

/// A lab preset's L1 binds exactly the devices its endpoints pass through, and the presets
/// that need no lab say so.
#[test]
fn test_lab_presets_bind_what_they_pass_through() {
    let lab_presets: Vec<&str> =
        preset_names().into_iter().filter(|n| !standalone_preset_names().contains(n)).collect();
    assert_eq!(lab_presets, ["vfio-lab"]);
    for name in lab_presets {
        let text = Node::preset_text(name).unwrap();
        let lab = crate::l1::L1Lab::of_node_text(text).unwrap().expect("a [nested] table");
        let file: schema::NodeFile = toml::from_str(text).unwrap();
        let mut passed: Vec<String> = file
            .endpoint
            .iter()
            .filter_map(|e| match e.backing.parse() {
                Ok(Backing::Vfio(bdf)) => Some(bdf.to_string()),
                _ => None,
            })
            .collect();
        passed.sort();
        let mut bound = lab.vfio_bind.clone();
        bound.sort();
        assert_eq!(passed, bound, "{name}");
        assert!(lab.qemu_args.iter().any(|a| a.starts_with("edu,")), "{name}");
    }
    for name in standalone_preset_names() {
        assert_eq!(crate::l1::L1Lab::of_node_text(Node::preset_text(name).unwrap()).unwrap(), None, "{name}");
    }
}

#[test]
fn test_p2p_is_on_unless_the_node_or_its_host_bridge_says_no() {
    let minimal = include_str!("../../presets/minimal.toml");
    let gpu = |node: &Node| node.functions.iter().position(|f| f.name == "gpu0").unwrap();
    let node = Node::parse("m.toml", minimal).unwrap();
    assert!(node.p2p(gpu(&node)));
    let off = minimal.replacen("description =", "p2p = false\ndescription =", 1);
    let node = Node::parse("m.toml", &off).unwrap();
    assert!(!node.p2p(gpu(&node)));
    let off = minimal.replacen("numa = 0", "numa = 0\np2p = false", 1);
    let node = Node::parse("m.toml", &off).unwrap();
    assert!(!node.p2p(gpu(&node)));
}
