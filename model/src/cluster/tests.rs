use super::*;

fn two_node() -> Cluster {
    Cluster::resolve("two-node").expect("the preset builds")
}

fn error(text: &str) -> String {
    Cluster::parse("bad.toml", text, Path::new("/nonexistent")).unwrap_err().to_string()
}

/// The two-node preset with one replacement.
fn two_node_with(from: &str, to: &str) -> String {
    let text = Cluster::preset_text("two-node").expect("preset");
    assert!(text.contains(from), "{from}");
    text.replacen(from, to, 1)
}

/// The minimal node with a second NIC (`nic1`) on a third switch port.
fn two_nic_node() -> String {
    let text = Node::preset_text("minimal").expect("preset").replacen("ports = 2", "ports = 3", 1);
    text.replacen("name = \"minimal\"", "name = \"two-nic\"", 1)
        + "\n[[endpoint]]\nname = \"nic1\"\nkind = \"nic\"\nparent = \"sw0\"\nvendor = 0x15b3\ndevice = 0x101e\n\
           link = \"16GT/s x16\"\nbars = [{ size = \"2M\", prefetchable = true }]\n"
}

/// Three nodes a, b, c; b has two NICs: w0 = a.nic0-b.nic0, w1 = b.nic1-c.nic0.
fn chain(dir: &Path) -> Cluster {
    std::fs::create_dir_all(dir.join("nodes")).unwrap();
    std::fs::write(dir.join("nodes/two-nic.toml"), two_nic_node()).unwrap();
    let text = "name = \"chain\"\n\
        [[node]]\nname = \"a\"\nnode = \"minimal\"\n\
        [[node]]\nname = \"b\"\nnode = \"nodes/two-nic.toml\"\n\
        [[node]]\nname = \"c\"\nnode = \"minimal\"\n\
        [[wire]]\nname = \"w0\"\nends = [\"a.nic0\", \"b.nic0\"]\nmtu = 9000\n\
        [[wire]]\nname = \"w1\"\nends = [\"c.nic0\", \"b.nic1\"]\nsubnet = \"192.168.5.0/29\"\n";
    std::fs::write(dir.join("chain.toml"), text).unwrap();
    Cluster::load(&dir.join("chain.toml")).expect("the chain builds")
}

#[test]
fn test_cluster_preset_resolves() {
    assert_eq!(Cluster::presets(), ["two-node"]);
    let c = two_node();
    assert_eq!((c.name.as_str(), c.source.as_str()), ("two-node", "two-node"));
    assert_eq!(c.description, "two minimal nodes, NIC to NIC");
    let names: Vec<(&str, &str, &str)> =
        c.nodes.iter().map(|n| (n.name.as_str(), n.node.name.as_str(), n.source.as_str())).collect();
    assert_eq!(names, [("a", "minimal", "minimal"), ("b", "minimal", "minimal")]);
    assert_eq!(c.wires.len(), 1);
    let w = &c.wires[0];
    assert_eq!((w.name.as_str(), w.mtu, w.subnet.to_string()), ("w0", 9000, "10.77.0.0/24".to_owned()));
    assert_eq!(
        w.ends,
        [
            WireEnd {
                node: 0,
                function: "nic0".into(),
                mac: [0x52, 0x54, 0, 0, 0, 0],
                ip: Ipv4Addr::new(10, 77, 0, 1),
                prefix: 24
            },
            WireEnd {
                node: 1,
                function: "nic0".into(),
                mac: [0x52, 0x54, 0, 0, 1, 0],
                ip: Ipv4Addr::new(10, 77, 0, 2),
                prefix: 24
            },
        ]
    );
    // The wired NICs are virtio-net with their end's MAC and the wire's MTU; the rest of the
    // node is the preset's.
    for (i, node) in c.nodes.iter().enumerate() {
        let nic = node.node.functions.iter().find(|f| f.name == "nic0").unwrap();
        assert_eq!(nic.backing, crate::node::Backing::VirtioNet);
        assert_eq!((nic.vendor, nic.device), (crate::node::VIRTIO_VENDOR, crate::node::VIRTIO_NET_DEVICE));
        assert_eq!(nic.net, Some(crate::node::NetParams { mac: [0x52, 0x54, 0, 0, i as u8, 0], mtu: 9000 }));
        let preset = Node::resolve("minimal").unwrap();
        let bdfs = |n: &Node| n.functions.iter().map(|f| (f.name.clone(), f.bdf)).collect::<Vec<_>>();
        assert_eq!(bdfs(&node.node), bdfs(&preset));
        let gpu = |n: &Node| n.functions.iter().find(|f| f.name == "gpu0").cloned();
        assert_eq!(gpu(&node.node), gpu(&preset));
    }
    assert_eq!(c.node_index("b"), Some(1));
    assert_eq!(c.node_index("z"), None);
    // A preset that is not one, and a file that is not there.
    assert_eq!(
        Cluster::resolve("/no/such/cluster.toml").unwrap_err().to_string(),
        "/no/such/cluster.toml: no such cluster file, and not a cluster preset (two-node)"
    );
    assert!(Cluster::preset("minimal").is_none());
}

#[test]
fn test_cluster_cmdline_and_nets() {
    let c = two_node();
    assert_eq!(c.node_cmdline(0), "gdrvm.node=a gdrvm.net=nic0:10.77.0.1/24 gdrvm.peers=b:10.77.0.2");
    assert_eq!(c.node_cmdline(1), "gdrvm.node=b gdrvm.net=nic0:10.77.0.2/24 gdrvm.peers=a:10.77.0.1");
    assert_eq!(c.node_nets(0), [("nic0".to_owned(), [0x52, 0x54, 0, 0, 0, 0], 9000, 0)]);
    assert_eq!(c.node_nets(1), [("nic0".to_owned(), [0x52, 0x54, 0, 0, 1, 0], 9000, 0)]);
    assert_eq!(format_mac(&c.node_nets(1)[0].1), "52:54:00:00:01:00");
}

#[test]
fn test_cluster_node_file_by_relative_path_peers_and_unique_macs() {
    let dir = tempfile::tempdir().unwrap();
    let c = chain(dir.path());
    let b = &c.nodes[1];
    assert_eq!(b.node.name, "two-nic");
    let canonical = std::fs::canonicalize(dir.path().join("nodes/two-nic.toml")).unwrap();
    assert_eq!(b.source, canonical.display().to_string());
    assert_eq!(b.node.source, b.source);
    // The node's source and its nets build the same node again.
    let nets: Vec<NetAttach> = c
        .node_nets(1)
        .into_iter()
        .map(|(endpoint, mac, mtu, _)| NetAttach { endpoint, mac: Some(format_mac(&mac)), mtu: Some(mtu) })
        .collect();
    assert_eq!(Node::resolve_with(&b.source, &nets).unwrap(), b.node);
    assert_eq!(c.source, std::fs::canonicalize(dir.path().join("chain.toml")).unwrap().display().to_string());
    // Resolving the file's path is the same as loading it.
    assert_eq!(Cluster::resolve(&dir.path().join("chain.toml").display().to_string()).unwrap(), c);

    assert_eq!(c.wires[0].mtu, 9000);
    let net = |n: usize, f: &str| c.nodes[n].node.functions.iter().find(|x| x.name == f).unwrap().net;
    assert_eq!(net(1, "nic0").map(|n| n.mtu), Some(9000));
    assert_eq!(net(1, "nic1").map(|n| n.mtu), Some(1500));
    assert_eq!(net(2, "nic0").map(|n| (n.mac, n.mtu)), Some(([0x52, 0x54, 0, 1, 2, 0], 1500)));
    assert_eq!(c.wires[1].subnet, Subnet { network: Ipv4Addr::new(192, 168, 5, 0), prefix: 29 });
    assert_eq!(c.node_cmdline(0), "gdrvm.node=a gdrvm.net=nic0:10.77.0.1/24 gdrvm.peers=b:10.77.0.2,c:192.168.5.1");
    assert_eq!(
        c.node_cmdline(1),
        "gdrvm.node=b gdrvm.net=nic0:10.77.0.2/24,nic1:192.168.5.2/29 gdrvm.peers=a:10.77.0.1,c:192.168.5.1"
    );
    assert_eq!(c.node_cmdline(2), "gdrvm.node=c gdrvm.net=nic0:192.168.5.1/29 gdrvm.peers=a:10.77.0.1,b:192.168.5.2");
    assert_eq!(
        c.node_nets(1),
        [
            ("nic0".to_owned(), [0x52, 0x54, 0, 0, 1, 0], 9000, 0),
            ("nic1".to_owned(), [0x52, 0x54, 0, 1, 1, 1], 1500, 1)
        ]
    );

    let macs: Vec<[u8; 6]> = c.wires.iter().flat_map(|w| w.ends.iter().map(|e| e.mac)).collect();
    assert_eq!(macs.len(), 4);
    let mut unique = macs.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), macs.len(), "{macs:?}");
    for mac in macs {
        assert_eq!(mac[0] & 0b11, 0b10, "locally administered unicast: {mac:?}");
    }
}

#[test]
fn test_cluster_node_without_wire() {
    let text = two_node_with("[[wire]]", "[[node]]\nname = \"lonely\"\nnode = \"flat\"\n[[wire]]");
    let c = Cluster::parse("t.toml", &text, Path::new(".")).unwrap();
    assert_eq!(c.node_cmdline(2), "gdrvm.node=lonely gdrvm.peers=a:10.77.0.1,b:10.77.0.2");
    assert_eq!(c.node_cmdline(0), "gdrvm.node=a gdrvm.net=nic0:10.77.0.1/24 gdrvm.peers=b:10.77.0.2");
    assert!(c.node_nets(2).is_empty());
    // A node on no wire is its preset as it is.
    assert_eq!(c.nodes[2].node, Node::resolve("flat").unwrap());
}

#[test]
fn test_bad_cluster_files_name_file_key_and_reason() {
    assert_eq!(
        error(&two_node_with("\"b.nic0\"", "\"c.nic0\"")),
        "bad.toml: key wire[0].ends[1]: 'c' is not a node of this cluster (a, b)"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"", "\"b.gpu0\"")),
        "bad.toml: key wire[0].ends[1]: 'b.gpu0' is a GPU, not a NIC"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"", "\"b.sw0.up\"")),
        "bad.toml: key wire[0].ends[1]: 'b.sw0.up' is a switch upstream port, not a NIC"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"", "\"b.nic7\"")),
        "bad.toml: key wire[0].ends[1]: node 'b' has no endpoint 'nic7' (its NICs: nic0)"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"", "\"b\"")),
        "bad.toml: key wire[0].ends[1]: 'b' is not NODE.ENDPOINT (e.g. a.nic0)"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"]", "\"b.nic0\"]\n[[wire]]\nname = \"w1\"\nends = [\"b.nic0\", \"a.nic0\"]")),
        "bad.toml: key wire[1].ends[0]: 'b.nic0' is already on wire 'w0' (a NIC joins at most one wire)"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"", "\"a.nic0\"")),
        "bad.toml: key wire[0].ends[1]: 'a.nic0' is on this wire twice"
    );
    assert_eq!(
        error(&two_node_with("\"b.nic0\"]", "]")),
        "bad.toml: key wire[0].ends: a wire joins at least two NICs, not 1"
    );
    assert_eq!(
        error(&two_node_with("name = \"b\"", "name = \"a\"")),
        "bad.toml: key node[1].name: name 'a' is already used by node[0]"
    );
    assert_eq!(
        error(&two_node_with("name = \"b\"", "name = \"B_1\"")),
        "bad.toml: key node[1].name: 'B_1' is not a name (lowercase letters, digits and '-')"
    );
    assert_eq!(
        error(&two_node_with("mtu = 9000", "mtu = 9001")),
        "bad.toml: key wire[0].mtu: 9001 is not an MTU from 68 to 9000"
    );
    assert_eq!(
        error(&two_node_with("mtu = 9000", "mtu = 67")),
        "bad.toml: key wire[0].mtu: 67 is not an MTU from 68 to 9000"
    );
    assert_eq!(
        error(&two_node_with("mtu = 9000", "mtu = -1500")),
        "bad.toml: key wire[0].mtu: -1500 is not an MTU from 68 to 9000"
    );
    assert_eq!(
        error(&two_node_with("mtu = 9000", "mtu = 99999999999")),
        "bad.toml: key wire[0].mtu: 99999999999 is not an MTU from 68 to 9000"
    );
    let edge = Cluster::parse("ok.toml", &two_node_with("mtu = 9000", "mtu = 68"), Path::new("."));
    assert_eq!(edge.unwrap().wires[0].mtu, 68);
    let node_error = error(&two_node_with("node = \"minimal\"\n\n[[wire]]", "node = \"minimall\"\n\n[[wire]]"));
    assert_eq!(
        node_error,
        "bad.toml: key node[1].node: no node file /nonexistent/minimall, and not a preset \
         (minimal, flat, vela-a100, vfio-lab, dgx-h100)"
    );
    let unknown = error(&two_node_with("name = \"w0\"", "name = \"w0\"\nspeed = 100"));
    assert_eq!(
        unknown,
        "bad.toml: TOML: TOML parse error at line 16, column 1 | 16 | speed = 100 | ^^^^^ unknown field `speed`, \
         expected one of `name`, `ends`, `subnet`, `mtu`"
    );
    let unknown = error(&two_node_with("node = \"minimal\"", "node = \"minimal\"\nnic = \"virtio\""));
    assert!(unknown.starts_with("bad.toml: TOML: ") && unknown.contains("unknown field `nic`"), "{unknown}");
    assert_eq!(error("name = \"empty\"\n"), "bad.toml: key node: a cluster needs at least one [[node]] entry");
    assert_eq!(
        error(&two_node_with("name = \"two-node\"", "name = \"\"")),
        "bad.toml: key name: '' is not a name (lowercase letters, digits and '-')"
    );
}

#[test]
fn test_bad_subnets() {
    let with_subnet = |s: &str| error(&two_node_with("name = \"w0\"", &format!("name = \"w0\"\nsubnet = \"{s}\"")));
    assert_eq!(
        with_subnet("10.77.0.0"),
        "bad.toml: key wire[0].subnet: '10.77.0.0' is not an IPv4 subnet (write it like \"10.77.0.0/24\")"
    );
    assert_eq!(
        with_subnet("10.77.0.0/33"),
        "bad.toml: key wire[0].subnet: '10.77.0.0/33' is not an IPv4 subnet (write it like \"10.77.0.0/24\")"
    );
    assert_eq!(
        with_subnet("10.777.0.0/24"),
        "bad.toml: key wire[0].subnet: '10.777.0.0/24' is not an IPv4 subnet (write it like \"10.77.0.0/24\")"
    );
    assert_eq!(
        with_subnet("10.77.0.1/24"),
        "bad.toml: key wire[0].subnet: '10.77.0.1/24' has host bits set (the subnet is 10.77.0.0/24)"
    );
    assert_eq!(
        with_subnet("10.77.0.0/31"),
        "bad.toml: key wire[0].subnet: 10.77.0.0/31 holds 0 host addresses, the wire has 2 ends"
    );
    // Three ends do not fit a /30 (two host addresses); two do.
    let three =
        "name = \"three\"\n[[node]]\nname = \"a\"\nnode = \"minimal\"\n[[node]]\nname = \"b\"\nnode = \"minimal\"\n\
        [[node]]\nname = \"c\"\nnode = \"minimal\"\n\
        [[wire]]\nname = \"hub\"\nends = [\"a.nic0\", \"b.nic0\", \"c.nic0\"]\nsubnet = \"10.1.2.4/30\"\n";
    assert_eq!(error(three), "bad.toml: key wire[0].subnet: 10.1.2.4/30 holds 2 host addresses, the wire has 3 ends");
    let c = Cluster::parse("ok.toml", &three.replace("/30", "/29").replace("10.1.2.4", "10.1.2.8"), Path::new("."))
        .unwrap();
    let ips: Vec<String> = c.wires[0].ends.iter().map(|e| format!("{}/{}", e.ip, e.prefix)).collect();
    assert_eq!(ips, ["10.1.2.9/29", "10.1.2.10/29", "10.1.2.11/29"]);
    // A second wire whose default subnet (10.77.1.0/24) the first one covers.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("two-nic.toml"), two_nic_node()).unwrap();
    let overlap = "name = \"overlap\"\n[[node]]\nname = \"a\"\nnode = \"two-nic.toml\"\n\
        [[node]]\nname = \"b\"\nnode = \"two-nic.toml\"\n\
        [[wire]]\nname = \"w0\"\nends = [\"a.nic0\", \"b.nic0\"]\nsubnet = \"10.77.0.0/16\"\n\
        [[wire]]\nname = \"w1\"\nends = [\"a.nic1\", \"b.nic1\"]\n";
    assert_eq!(
        Cluster::parse("bad.toml", overlap, dir.path()).unwrap_err().to_string(),
        "bad.toml: key wire[1].subnet: 10.77.1.0/24 overlaps wire 'w0' (10.77.0.0/16)"
    );
}

#[test]
fn test_bad_node_file_in_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let bad = Node::preset_text("minimal").unwrap().replacen("ports = 2", "ports = 1", 1);
    std::fs::write(dir.path().join("bad-node.toml"), bad).unwrap();
    let text = two_node_with("node = \"minimal\"\n\n[[wire]]", "node = \"bad-node.toml\"\n\n[[wire]]");
    let e = Cluster::parse("c.toml", &text, dir.path()).unwrap_err();
    assert_eq!(e.key.as_deref(), Some("node[1].node"));
    let path = dir.path().join("bad-node.toml").display().to_string();
    assert!(e.reason.starts_with(&format!("{path}: key endpoint[1] (nic0)")), "{e}");
    assert!(e.reason.contains("switch 'sw0' has only 1 downstream ports, all taken"), "{e}");
}

#[test]
fn test_subnet_parse_display_and_overlap() {
    let s: Subnet = "10.0.0.0/8".parse().unwrap();
    assert_eq!(s.to_string(), "10.0.0.0/8");
    assert_eq!(s.hosts(), (1 << 24) - 2);
    assert_eq!(s.host(1), Some(Ipv4Addr::new(10, 0, 0, 1)));
    assert_eq!(s.host(0), None);
    assert_eq!(s.host(1 << 24), None);
    assert!(s.overlaps("10.200.0.0/16".parse().unwrap()));
    assert!(!s.overlaps("11.0.0.0/8".parse().unwrap()));
    let all: Subnet = "0.0.0.0/0".parse().unwrap();
    assert!(all.overlaps(s));
    assert!("0.0.0.1/0".parse::<Subnet>().is_err());
    assert_eq!("1.2.3.4/32".parse::<Subnet>().unwrap().hosts(), 0);
}
