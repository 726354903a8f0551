//! `topology`: the guest sees the node's layout. NUMA here (the nodes Linux brought up,
//! each node's CPUs, RAM and SLIT distances, against the VMM's expectations), then the PCI
//! tree and NCCL's paths ([`super::pci`]), and the tree as the guest's lspci decodes it
//! ([`super::lspci`]).

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::suites::smoke::count_cpu_list;

/// How far a node's RAM may be from what the VMM gave it (the first 1 MiB and holes).
const NODE_MEMORY_TOLERANCE: f64 = 0.02;

pub fn run(ctx: &Context) -> Vec<Check> {
    let mut checks = numa(ctx);
    checks.extend(super::pci::run(ctx));
    checks.extend(super::lspci::run(ctx));
    checks
}

fn numa(ctx: &Context) -> Vec<Check> {
    let Some(expect) = ctx.expect.as_ref().filter(|e| !e.numa.is_empty()) else {
        return vec![Check::new(
            "numa_nodes",
            Verdict::Skip("the VM has one NUMA node (no --node with several)".into()),
        )];
    };
    let online = std::fs::read_to_string(ctx.path("/sys/devices/system/node/online")).unwrap_or_default();
    let count = count_cpu_list(&online).unwrap_or(0);
    let mut checks = vec![Check::new(
        "numa_nodes",
        if count as usize == expect.numa.len() {
            Verdict::Pass
        } else {
            Verdict::Fail(format!("{count} NUMA nodes online ({}), {} configured", online.trim(), expect.numa.len()))
        },
    )
    .note(format!("nodes online: {}", online.trim()))];
    let present = zone_present_pages(ctx);
    for (i, node) in expect.numa.iter().enumerate() {
        let dir = format!("/sys/devices/system/node/node{i}");
        let cpulist = std::fs::read_to_string(ctx.path(&format!("{dir}/cpulist"))).unwrap_or_default();
        let want = node.cpus.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let seen = expand_cpu_list(&cpulist).map(|v| v.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
        checks.push(
            Check::new(
                &format!("numa{i}_cpus"),
                match seen {
                    Some(s) if s == want => Verdict::Pass,
                    _ => Verdict::Fail(format!("node {i} has CPUs '{}', expected {want}", cpulist.trim())),
                },
            )
            .note(format!("node {i} CPUs {}", cpulist.trim())),
        );

        let bytes = present.get(i).copied().unwrap_or(0) * 4096;
        let off = (bytes as f64 - node.memory_bytes as f64).abs() / node.memory_bytes as f64;
        checks.push(
            Check::new(
                &format!("numa{i}_memory"),
                if off <= NODE_MEMORY_TOLERANCE {
                    Verdict::Pass
                } else {
                    Verdict::Fail(format!(
                        "node {i} has {} MiB present, {} MiB configured",
                        bytes >> 20,
                        node.memory_bytes >> 20
                    ))
                },
            )
            .note(format!("node {i} {} MiB present of {} MiB", bytes >> 20, node.memory_bytes >> 20)),
        );

        let distance = std::fs::read_to_string(ctx.path(&format!("{dir}/distance"))).unwrap_or_default();
        let seen: Vec<u8> = distance.split_whitespace().filter_map(|d| d.parse().ok()).collect();
        checks.push(Check::new(
            &format!("numa{i}_distances"),
            if seen == node.distances {
                Verdict::Pass
            } else {
                Verdict::Fail(format!("node {i} distances '{}', expected {:?}", distance.trim(), node.distances))
            },
        ));
    }
    checks
}

/// `0-2,5` → `[0, 1, 2, 5]`.
fn expand_cpu_list(list: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u32>().ok()?..=b.parse::<u32>().ok()?),
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

/// Present pages of every node, summed over its zones (`/proc/zoneinfo`): the RAM the
/// firmware gave the node, before the kernel takes its share.
fn zone_present_pages(ctx: &Context) -> Vec<u64> {
    let text = std::fs::read_to_string(ctx.path("/proc/zoneinfo")).unwrap_or_default();
    let mut pages: Vec<u64> = Vec::new();
    let mut node = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Node ") {
            node = rest.split(',').next().and_then(|n| n.trim().parse::<usize>().ok());
        } else if let (Some(n), Some(v)) = (node, line.trim().strip_prefix("present")) {
            if pages.len() <= n {
                pages.resize(n + 1, 0);
            }
            pages[n] += v.trim().parse::<u64>().unwrap_or(0);
        }
    }
    pages
}

#[cfg(test)]
mod tests {
    use gdrvm_model::{Expectations, NumaExpectation};

    use super::*;

    fn fake(numa_online: &str, cpulists: &[&str], distances: &[&str], zoneinfo: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir_all(p.join("proc")).unwrap();
        std::fs::write(p.join("proc/zoneinfo"), zoneinfo).unwrap();
        let nodes = p.join("sys/devices/system/node");
        std::fs::create_dir_all(&nodes).unwrap();
        std::fs::write(nodes.join("online"), numa_online).unwrap();
        for (i, (c, d)) in cpulists.iter().zip(distances).enumerate() {
            std::fs::create_dir_all(nodes.join(format!("node{i}"))).unwrap();
            std::fs::write(nodes.join(format!("node{i}/cpulist")), c).unwrap();
            std::fs::write(nodes.join(format!("node{i}/distance")), d).unwrap();
        }
        dir
    }

    const ZONEINFO: &str = "Node 0, zone      DMA\n  pages free 3000\n        present  3998\nNode 0, zone    DMA32\n        present  127074\nNode 1, zone    DMA32\n        present  131072\n";

    fn ctx(root: &std::path::Path) -> Context {
        let numa = vec![
            NumaExpectation { cpus: vec![0], memory_bytes: 512 << 20, distances: vec![10, 21] },
            NumaExpectation { cpus: vec![1], memory_bytes: 512 << 20, distances: vec![21, 10] },
        ];
        Context {
            expect: Some(Expectations {
                cpus: 2,
                memory_bytes: 1 << 30,
                numa,
                pci: vec![],
                paths: vec![],
                host: false,
            }),
            image: None,
            root: root.to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        }
    }

    #[test]
    fn test_two_nodes_as_configured() {
        let root = fake("0-1\n", &["0\n", "1\n"], &["10 21\n", "21 10\n"], ZONEINFO);
        let checks = numa(&ctx(root.path()));
        assert_eq!(checks.len(), 7);
        for c in &checks {
            assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        }
    }

    #[test]
    fn test_wrong_layout_fails_by_name() {
        let root = fake("0\n", &["0-1\n"], &["10\n"], "Node 0, zone DMA32\n        present  262144\n");
        let checks = numa(&ctx(root.path()));
        let failed: Vec<&str> =
            checks.iter().filter(|c| matches!(c.verdict, Verdict::Fail(_))).map(|c| c.name.as_str()).collect();
        assert_eq!(
            failed,
            [
                "numa_nodes",
                "numa0_cpus",
                "numa0_memory",
                "numa0_distances",
                "numa1_cpus",
                "numa1_memory",
                "numa1_distances"
            ]
        );
    }

    #[test]
    fn test_cpu_lists() {
        assert_eq!(expand_cpu_list("0-2,5\n"), Some(vec![0, 1, 2, 5]));
        assert_eq!(expand_cpu_list(""), Some(vec![]));
        assert_eq!(expand_cpu_list("a"), None);
    }
}
