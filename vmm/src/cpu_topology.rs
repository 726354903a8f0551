//! How vCPUs are laid out in packages: one package (socket) per NUMA node, so that CPUID,
//! the MADT and the SRAT agree (Linux warns when CPUs that CPUID puts in one package or
//! last-level cache sit on different NUMA nodes). APIC id = socket << shift | core.

use gdrvm_model::node::NumaNode;

/// Where one vCPU sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuPlace {
    /// Its APIC id (and KVM vCPU id).
    pub apic_id: u32,
    /// Its package, which is its NUMA node.
    pub socket: u32,
    /// Its core number in the package.
    pub core: u32,
    /// vCPUs in its package.
    pub cores_in_socket: u32,
    /// Bits of the APIC id that number cores in a package.
    pub core_bits: u32,
}

/// The IOAPIC's APIC id: the one after the highest vCPU's, so that no ids collide. The
/// MADT and the MP table both name it.
pub fn ioapic_id(cpus: &[CpuPlace]) -> u8 {
    // The config keeps APIC ids below 255, so the next one fits in the tables' 8 bits.
    cpus.iter().map(|c| c.apic_id + 1).max().unwrap_or(0) as u8
}

/// Every vCPU's place, in vCPU order (NUMA node by node).
pub fn layout(cpus: u32, numa: &[NumaNode]) -> Vec<CpuPlace> {
    let per_socket: Vec<u32> = if numa.len() > 1 { numa.iter().map(|n| n.cpus).collect() } else { vec![cpus] };
    let widest = per_socket.iter().copied().max().unwrap_or(1).max(1);
    let core_bits = u32::BITS - (widest - 1).leading_zeros();
    (0u32..)
        .zip(&per_socket)
        .flat_map(|(socket, &n)| {
            (0..n).map(move |core| CpuPlace {
                apic_id: (socket << core_bits) | core,
                socket,
                core,
                cores_in_socket: n,
                core_bits,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32, cpus: u32) -> NumaNode {
        NumaNode { id, cpus, memory: 1 << 30, distances: vec![], host_numa: None }
    }

    #[test]
    fn test_one_package_without_numa() {
        let l = layout(3, &[]);
        assert_eq!(l.iter().map(|p| p.apic_id).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(l.iter().all(|p| p.socket == 0 && p.cores_in_socket == 3 && p.core_bits == 2));
        assert_eq!(layout(1, &[])[0].core_bits, 0);
    }

    #[test]
    fn test_numa_nodes_are_packages() {
        let l = layout(5, &[node(0, 3), node(1, 2)]);
        assert_eq!(l.iter().map(|p| p.apic_id).collect::<Vec<_>>(), [0, 1, 2, 4, 5]);
        assert_eq!(l.iter().map(|p| p.socket).collect::<Vec<_>>(), [0, 0, 0, 1, 1]);
        assert_eq!(l[4], CpuPlace { apic_id: 5, socket: 1, core: 1, cores_in_socket: 2, core_bits: 2 });
        let one_each = layout(2, &[node(0, 1), node(1, 1)]);
        assert_eq!(one_each.iter().map(|p| p.apic_id).collect::<Vec<_>>(), [0, 1]);
    }
}
