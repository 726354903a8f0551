//! Populating guest RAM ahead of the guest, in the host's idle time.
//!
//! The first touch of a guest page the host has not allocated yet costs the guest a page
//! fault in the host, and the host zeroes the page (2 MiB with transparent huge pages)
//! before KVM maps it. A booting Linux touches a known few regions first: its own bss and
//! brk, what its boot allocator takes from the top of memory (below the initramfs), and
//! what its page allocator hands out first, just above the kernel. A thread at idle
//! priority (`SCHED_IDLE`: it runs only on a CPU nothing else wants) populates those
//! regions in that order while the boot CPU runs, so the guest finds them ready.
//!
//! Nested, a fresh 2 MiB page costs the guest about 5 ms of L1 time, and only the boot CPU
//! runs for the first second, so L1's other CPU is idle. Measured with L1's
//! `kvm_exit`/`kvm_entry` trace over a boot of the default guest: about 70 such faults took
//! the vCPUs 0.22 s of L1 time without this thread, 0.03 s with it (the bss pages the guest
//! clears before the thread gets there). On real KVM zeroing 2 MiB takes tens of
//! microseconds and the thread is done before it matters. Nothing of what the
//! guest sees changes: `MADV_POPULATE_WRITE` allocates missing pages and leaves present
//! ones (and their contents) alone.
//!
//! Written by hand: no rust-vmm crate prefaults part of guest memory in the background
//! (Cloud Hypervisor's `prefault` populates all of it before the guest starts).

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use gdrvm_model::layout;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

/// The populating step: one huge page, so a stop is noticed within one page's zeroing.
const STEP: u64 = 2 << 20;
/// How much above the kernel image to populate: what the page allocator hands out first.
const ABOVE_KERNEL: u64 = 64 << 20;
/// The fixed part of what the boot allocator takes below the initramfs (page tables,
/// per-CPU areas, hash tables); the struct page array comes on top, [`STRUCT_PAGE_SHARE`].
const BELOW_INITRD: u64 = 16 << 20;
/// What the boot allocator takes from the top of a NUMA node other than the last, besides
/// its struct pages: the node's data and the per-CPU areas of its CPUs.
const NODE_OWN: u64 = 4 << 20;
/// Linux's struct page array: 64 bytes per 4 KiB page, 1/64 of RAM.
const STRUCT_PAGE_SHARE: u64 = 64;

/// The guest-physical regions a booting Linux touches first, in the order it does: the
/// kernel's bss and brk (from its end down, as the guest clears it from its start up),
/// the boot allocator's region at the top of RAM, below the initramfs where that lies at
/// the top (top down, as it allocates), the top of every other NUMA node (`numa`: each
/// node's RAM, as SRAT gives it), where the boot allocator puts that node's own struct
/// pages, node data and per-CPU areas, and the page allocator's first pages above the
/// kernel. Regions are 2 MiB aligned and may overlap what the image copies already
/// populated, which costs next to nothing; parts in the MMIO hole are skipped.
pub fn boot_regions(numa: &[u64], kernel: &Range<u64>, initrd: Option<&Range<u64>>) -> Vec<Populate> {
    let align_down = |a: u64| a & !(STEP - 1);
    let align_up = |a: u64| a.saturating_add(STEP - 1) & !(STEP - 1);
    let ram: u64 = numa.iter().sum();
    let ram_end = layout::ram_ranges(ram).last().map_or(0, |&(start, len)| start + len);
    // The initramfs sits at the top of RAM below 2 GiB (where Linux's boot protocol wants
    // it); above that much RAM the boot allocator starts from the real top.
    let top = match initrd {
        Some(i) if i.end.saturating_add(STEP) >= ram_end => i.start,
        _ => ram_end,
    };
    let below = BELOW_INITRD + ram / STRUCT_PAGE_SHARE;
    let kernel_end = align_up(kernel.end);
    // Where each node's RAM ends (its last range); a node without RAM has no end.
    let mut node_ends = vec![None; numa.len()];
    for (node, start, len) in layout::numa_ranges(numa) {
        if let Some(end) = node_ends.get_mut(node as usize) {
            *end = Some(start + len);
        }
    }
    let other_nodes = node_ends.into_iter().zip(numa).filter_map(|(end, &size)| {
        let end = end.filter(|&end| end != ram_end)?;
        let start = align_down(end.saturating_sub(NODE_OWN + size / STRUCT_PAGE_SHARE)).max(kernel_end);
        Some(Populate { range: start..align_down(end), downwards: true })
    });
    [
        Populate { range: align_down(kernel.start)..kernel_end, downwards: true },
        Populate { range: align_down(top.saturating_sub(below)).max(kernel_end)..align_down(top), downwards: true },
    ]
    .into_iter()
    .chain(other_nodes)
    .chain([Populate {
        range: kernel_end..align_down(kernel_end.saturating_add(ABOVE_KERNEL)).min(top),
        downwards: false,
    }])
    .filter(|p| p.range.start < p.range.end)
    .collect()
}

/// One guest-physical region to populate, and in which direction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Populate {
    /// Guest-physical addresses.
    pub range: Range<u64>,
    /// From its end down (the guest comes from the other end, or allocates top down).
    pub downwards: bool,
}

/// The populating thread; dropping it stops the thread and waits for it.
pub struct Prefault {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Prefault {
    /// Starts populating `regions` of `mem` at idle priority. Parts outside guest RAM are
    /// skipped. The thread must be dropped before `mem`'s mappings go.
    pub fn start(mem: &GuestMemoryMmap, regions: &[Populate]) -> Prefault {
        // Host addresses, computed here: the thread gets plain numbers, not the map.
        let steps: Vec<(usize, usize)> = regions
            .iter()
            .flat_map(|p| {
                let mut starts: Vec<u64> = (p.range.start..p.range.end).step_by(STEP as usize).collect();
                if p.downwards {
                    starts.reverse();
                }
                let end = p.range.end;
                starts.into_iter().map(move |s| (s, STEP.min(end - s)))
            })
            .filter_map(|(gpa, len)| {
                let len = usize::try_from(len).ok()?;
                // The whole step must lie in one region of guest RAM.
                let slice = mem.get_slice(GuestAddress(gpa), len).ok()?;
                Some((slice.ptr_guard().as_ptr() as usize, len))
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("prefault".into())
            .spawn(move || populate(&steps, &flag))
            .map_err(|e| tracing::debug!(err = %e, "no prefault thread"))
            .ok();
        Prefault { stop, thread }
    }
}

impl Drop for Prefault {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The thread: idle priority, then each step until done, stopped, or refused (a host
/// older than Linux 5.14 has no `MADV_POPULATE_WRITE`; RAM then fills as the guest goes).
fn populate(steps: &[(usize, usize)], stop: &AtomicBool) {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: changes only this thread's scheduling policy; `param` outlives the call.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
        // At normal priority it would take CPU time from the vCPUs: better not at all.
        tracing::debug!(err = %std::io::Error::last_os_error(), "prefault: no idle priority, not populating");
        return;
    }
    let started = std::time::Instant::now();
    for (i, &(addr, len)) in steps.iter().enumerate() {
        if stop.load(Ordering::Relaxed) {
            tracing::debug!(done = i, of = steps.len(), "prefault stopped");
            return;
        }
        // SAFETY: `addr..addr + len` lies in guest RAM's mapping (checked at start), which
        // the VMM keeps until this thread is joined; MADV_POPULATE_WRITE allocates missing
        // pages and maps them, never changing what a page holds.
        if unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) } != 0 {
            tracing::debug!(err = %std::io::Error::last_os_error(), "prefault: the host will not populate");
            return;
        }
    }
    tracing::debug!(steps = steps.len(), took = ?started.elapsed(), "prefault done");
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn test_regions_are_bss_then_below_the_initrd_then_above_the_kernel() {
        // The Debian 6.1 vmlinux: 16 MiB to 74 MiB with its bss; a 24 MiB initramfs at the top of 1 GiB.
        let kernel = 16 * MIB..0x4a0_d000;
        let initrd = 1000 * MIB..1024 * MIB;
        let regions = boot_regions(&[1024 * MIB], &kernel, Some(&initrd));
        assert_eq!(
            regions,
            vec![
                Populate { range: 16 * MIB..76 * MIB, downwards: true },
                Populate { range: 968 * MIB..1000 * MIB, downwards: true },
                Populate { range: 76 * MIB..140 * MIB, downwards: false },
            ]
        );
    }

    #[test]
    fn test_every_other_numa_node_gets_its_top_populated() {
        // vela-a100's two nodes in 1 GiB: node 0 ends at 512 MiB, where its own struct pages
        // (8 MiB) and node data go; node 1's top is RAM's, below the initramfs.
        let kernel = 16 * MIB..0x4a0_d000;
        let initrd = 1000 * MIB..1024 * MIB;
        let regions = boot_regions(&[512 * MIB, 512 * MIB], &kernel, Some(&initrd));
        assert_eq!(
            regions,
            vec![
                Populate { range: 16 * MIB..76 * MIB, downwards: true },
                Populate { range: 968 * MIB..1000 * MIB, downwards: true },
                Populate { range: 500 * MIB..512 * MIB, downwards: true },
                Populate { range: 76 * MIB..140 * MIB, downwards: false },
            ]
        );
        // Above the hole, a node's top is where its last range ends: node 0 has 3 GiB below
        // the hole and 1 GiB above it, and 4 MiB and 64 MiB of struct pages under 5 GiB.
        let regions = boot_regions(&[4096 * MIB, 4096 * MIB], &(16 * MIB..76 * MIB), None);
        assert!(regions.contains(&Populate { range: 5052 * MIB..5120 * MIB, downwards: true }), "{regions:?}");
        // A node without RAM (CPUs or devices only) takes nothing; the nodes around it keep theirs.
        let regions = boot_regions(&[512 * MIB, 0, 512 * MIB], &kernel, Some(&initrd));
        assert_eq!(regions[2], Populate { range: 500 * MIB..512 * MIB, downwards: true });
        assert_eq!(regions.len(), 4, "{regions:?}");
    }

    #[test]
    fn test_small_ram_keeps_regions_apart_and_inside_it() {
        // 128 MiB, no initramfs: the region below the top (16 MiB and 2 MiB of struct pages)
        // and the one above the kernel both stop at the top of RAM.
        let regions = boot_regions(&[128 * MIB], &(16 * MIB..100 * MIB), None);
        assert_eq!(
            regions,
            vec![
                Populate { range: 16 * MIB..100 * MIB, downwards: true },
                Populate { range: 110 * MIB..128 * MIB, downwards: true },
                Populate { range: 100 * MIB..128 * MIB, downwards: false },
            ]
        );
    }

    #[test]
    fn test_big_ram_populates_below_its_real_top_not_below_the_initrd() {
        // 8 GiB: RAM runs to 9 GiB above the hole; the initramfs sits below 2 GiB, and the
        // boot allocator's region (16 MiB and 128 MiB of struct pages) is under 9 GiB.
        let kernel = 16 * MIB..76 * MIB;
        let initrd = 2024 * MIB..2048 * MIB;
        let regions = boot_regions(&[8192 * MIB], &kernel, Some(&initrd));
        assert_eq!(regions[1], Populate { range: 9072 * MIB..9216 * MIB, downwards: true });
    }

    #[test]
    fn test_populating_leaves_contents_and_stops_when_dropped() {
        use vm_memory::Bytes;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), (8 * MIB) as usize)]).unwrap();
        mem.write_obj(0x1234_5678_u32, GuestAddress(3 * MIB)).unwrap();
        let regions =
            [Populate { range: 0..8 * MIB, downwards: true }, Populate { range: 6 * MIB..9 * MIB, downwards: false }];
        drop(Prefault::start(&mem, &regions));
        assert_eq!(mem.read_obj::<u32>(GuestAddress(3 * MIB)).unwrap(), 0x1234_5678);
        assert_eq!(mem.read_obj::<u32>(GuestAddress(7 * MIB)).unwrap(), 0);
    }
}
