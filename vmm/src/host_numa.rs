//! Guest NUMA nodes bound to the host's (`host_numa = N` in a node file), as libvirt's
//! `<numatune>` and vCPU pinning do for Vela: each guest node's RAM is placed on its host
//! node with `mbind(MPOL_BIND)` before the guest touches it, and its vCPU threads run only
//! on that node's CPUs. A GPU and the NIC next to it then share the guest node whose memory
//! and CPUs really are theirs, so a guest's NUMA table is true, not only well formed.

use std::path::{Path, PathBuf};

use gdrvm_model::layout;
use gdrvm_model::node::NumaNode;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

/// Where Linux lists the host's NUMA nodes.
pub const SYSFS_NODES: &str = "/sys/devices/system/node";

/// Why a guest node could not be bound to its host node.
#[derive(Debug, thiserror::Error)]
pub enum HostNumaError {
    /// The host has no such node (or its CPU list cannot be read).
    #[error("numa[{guest}].host_numa = {host}: this host has no NUMA node {host} ({}: {source})", path.display())]
    NoSuchNode {
        /// Guest node.
        guest: u32,
        /// Host node asked for.
        host: u32,
        /// The file that was read.
        path: PathBuf,
        /// The system's words.
        #[source]
        source: std::io::Error,
    },
    /// The node's CPU list is not a list of CPUs, or names none.
    #[error("numa[{guest}].host_numa = {host}: host node {host} has no CPUs to run vCPUs on ('{list}')")]
    NoCpus {
        /// Guest node.
        guest: u32,
        /// Host node.
        host: u32,
        /// What sysfs said.
        list: String,
    },
    /// `mbind` refused.
    #[error("numa[{guest}].host_numa = {host}: cannot bind guest RAM {start:#x}..{end:#x} to host node {host}")]
    Bind {
        /// Guest node.
        guest: u32,
        /// Host node.
        host: u32,
        /// First guest-physical address.
        start: u64,
        /// End guest-physical address.
        end: u64,
        /// The system's words.
        #[source]
        source: std::io::Error,
    },
}

/// The host node and CPUs of each guest node that has one, by guest node id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostPlacement {
    nodes: Vec<Option<(u32, Vec<usize>)>>,
}

impl HostPlacement {
    /// Reads the CPUs of every host node the guest's nodes name, from `sysfs`
    /// ([`SYSFS_NODES`]). Nodes without `host_numa` stay unbound.
    pub fn read(sysfs: &Path, numa: &[NumaNode]) -> Result<HostPlacement, HostNumaError> {
        let mut nodes = Vec::with_capacity(numa.len());
        for n in numa {
            let Some(host) = n.host_numa else {
                nodes.push(None);
                continue;
            };
            let path = sysfs.join(format!("node{host}")).join("cpulist");
            let list = std::fs::read_to_string(&path).map_err(|source| HostNumaError::NoSuchNode {
                guest: n.id,
                host,
                path: path.clone(),
                source,
            })?;
            let cpus = parse_cpu_list(list.trim()).filter(|c| !c.is_empty());
            let cpus = cpus.ok_or_else(|| HostNumaError::NoCpus { guest: n.id, host, list: list.trim().into() })?;
            nodes.push(Some((host, cpus)));
        }
        Ok(HostPlacement { nodes })
    }

    /// Whether any guest node is bound.
    pub fn any(&self) -> bool {
        self.nodes.iter().any(Option::is_some)
    }

    /// The host CPUs the vCPUs of guest node `guest` may run on, when it is bound.
    pub fn cpus(&self, guest: u32) -> Option<&[usize]> {
        self.nodes.get(guest as usize)?.as_ref().map(|(_, cpus)| cpus.as_slice())
    }

    /// Binds each bound guest node's RAM (its ranges as SRAT gives them) to its host node.
    /// Called before anything writes guest memory: pages already there stay where they are.
    pub fn bind_memory(&self, mem: &GuestMemoryMmap, numa: &[NumaNode]) -> Result<(), HostNumaError> {
        let sizes: Vec<u64> = numa.iter().map(|n| n.memory).collect();
        for (guest, start, len) in layout::numa_ranges(&sizes) {
            let Some(Some((host, _))) = self.nodes.get(guest as usize) else { continue };
            let end = start + len;
            let fail = |source| HostNumaError::Bind { guest, host: *host, start, end, source };
            for region in mem.iter() {
                let (r_start, r_end) = (region.start_addr().0, region.start_addr().0 + region.len());
                let (from, to) = (start.max(r_start), end.min(r_end));
                if from >= to {
                    continue;
                }
                // SAFETY: `from - r_start` is inside the region, so the pointer stays within
                // the mapping guest memory owns for its lifetime.
                let addr = unsafe { region.as_ptr().add((from - r_start) as usize) };
                mbind(addr, (to - from) as usize, *host).map_err(fail)?;
            }
        }
        Ok(())
    }
}

/// Restricts the calling thread to `cpus`.
pub fn pin_current_thread(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        // SAFETY: CPU_SET writes inside `set`, and ignores CPUs beyond CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `mbind(addr, len, MPOL_BIND, {node})`. Neither libc nor a kept crate wraps it.
fn mbind(addr: *mut u8, len: usize, node: u32) -> std::io::Result<()> {
    let words = node as usize / 64 + 1;
    let mut mask = vec![0u64; words];
    mask[node as usize / 64] |= 1 << (node % 64);
    // The kernel reads maxnode - 1 bits (numactl passes one more than its mask holds).
    let maxnode = (words * 64 + 1) as libc::c_ulong;
    // SAFETY: `addr..addr + len` is a mapping the caller owns; `mask` outlives the call and
    // holds the `maxnode - 1` bits the kernel reads; MPOL_BIND changes placement, not data.
    let rc = unsafe { libc::syscall(libc::SYS_mbind, addr, len, libc::MPOL_BIND, mask.as_ptr(), maxnode, 0u32) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Parses a sysfs CPU list (`0-3,8,10-11`).
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if a > b {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: u32, memory: u64, host_numa: Option<u32>) -> NumaNode {
        NumaNode { id, cpus: 1, memory, distances: vec![], host_numa }
    }

    #[test]
    fn test_cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn test_placement_reads_named_host_nodes_and_refuses_missing_ones() {
        let sysfs = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(sysfs.path().join("node1")).unwrap();
        std::fs::write(sysfs.path().join("node1/cpulist"), "4-5\n").unwrap();
        let p = HostPlacement::read(sysfs.path(), &[node(0, 1 << 30, None), node(1, 1 << 30, Some(1))]).unwrap();
        assert!(p.any());
        assert_eq!(p.cpus(0), None);
        assert_eq!(p.cpus(1), Some(&[4usize, 5][..]));
        let e = HostPlacement::read(sysfs.path(), &[node(0, 1 << 30, Some(3))]).unwrap_err().to_string();
        assert!(e.starts_with("numa[0].host_numa = 3: this host has no NUMA node 3"), "{e}");
        std::fs::create_dir_all(sysfs.path().join("node2")).unwrap();
        std::fs::write(sysfs.path().join("node2/cpulist"), "\n").unwrap();
        let e = HostPlacement::read(sysfs.path(), &[node(0, 1 << 30, Some(2))]).unwrap_err().to_string();
        assert!(e.contains("has no CPUs"), "{e}");
    }

    /// On this host's node 0: guest RAM bound there reports MPOL_BIND to node 0, and a
    /// thread pinned to node 0's CPUs runs only there.
    #[test]
    fn test_binds_memory_and_pins_threads_on_this_hosts_node0() {
        let numa = [node(0, 64 << 20, Some(0))];
        let placement = match HostPlacement::read(Path::new(SYSFS_NODES), &numa) {
            Ok(p) => p,
            Err(e) => {
                println!("SKIP test_binds_memory_and_pins_threads_on_this_hosts_node0: {e}");
                return;
            }
        };
        let ram = crate::memory::create(64 << 20).unwrap();
        placement.bind_memory(&ram.memory, &numa).unwrap();
        let region = ram.memory.iter().next().unwrap();
        let (mut mode, mut mask) = (-1i32, [0u64; 16]);
        // SAFETY: `mode` and `mask` are writable for the sizes passed; MPOL_F_ADDR (2) asks
        // for the policy of the page at `addr`, which guest memory maps.
        let rc = unsafe {
            libc::syscall(libc::SYS_get_mempolicy, &mut mode, mask.as_mut_ptr(), 1024u64, region.as_ptr(), 2u64)
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        assert_eq!((mode, mask[0]), (libc::MPOL_BIND, 1));

        let cpus = placement.cpus(0).unwrap().to_vec();
        let pinned = std::thread::spawn(move || {
            pin_current_thread(&cpus).unwrap();
            // SAFETY: cpu_set_t is plain data; sched_getaffinity fills it for this thread.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `set` is writable and of the size passed.
            assert_eq!(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
            // SAFETY: CPU_ISSET reads inside `set`.
            (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect::<Vec<_>>()
        });
        assert_eq!(pinned.join().unwrap(), placement.cpus(0).unwrap());
    }
}
