//! The DMA space: every range a device may reach by DMA (guest RAM and every mapped BAR),
//! kept in one place and fanned out to each DMA target (the VFIO container, vfio-user
//! servers), so a target added late is replayed everything and a BAR the guest moves moves
//! in every target. Peer-to-peer is a BAR in the DMA space: a device's BARs reach another
//! device's target only when both allow it, and never its own.
//!
//! Written by hand: rust-vmm's `vfio-ioctls` maps into one container and `vfio_user` talks
//! to one server; neither keeps the address space they share.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::sync::Arc;

/// The VMM's name for a device (an index it assigns).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceId(pub u32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device {}", self.0)
    }
}

/// A range of guest physical addresses devices may reach by DMA.
#[derive(Debug, Clone)]
pub struct DmaRegion {
    /// Guest physical address, which is also the I/O virtual address devices use.
    pub iova: u64,
    /// Length in bytes.
    pub size: u64,
    /// Where the range is mapped in the VMM's address space.
    pub host_addr: u64,
    /// The file backing the range and the offset of `iova` in it, for targets in another
    /// process (vfio-user servers map it themselves).
    pub fd: Option<(Arc<File>, u64)>,
    /// The device whose BAR this is; `None` for guest RAM.
    pub owner: Option<DeviceId>,
}

/// Where DMA mappings go: an IOMMU container, a vfio-user server.
pub trait DmaTarget: Send {
    /// Makes `region` reachable by the target's devices.
    fn map(&mut self, region: &DmaRegion) -> Result<(), DmaError>;
    /// Removes the mapping of `size` bytes at `iova`.
    fn unmap(&mut self, iova: u64, size: u64) -> Result<(), DmaError>;
}

/// What a target was asked to do when it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DmaOp {
    /// [`DmaTarget::map`].
    Map,
    /// [`DmaTarget::unmap`].
    Unmap,
}

impl fmt::Display for DmaOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if *self == DmaOp::Map { "map" } else { "unmap" })
    }
}

/// One target's failure to follow a change of the DMA space.
#[derive(Debug, thiserror::Error)]
#[error("the DMA target of {target} could not {op} {iova:#x}+{size:#x}")]
pub struct TargetError {
    /// The failing target.
    pub target: DeviceId,
    /// What it was asked.
    pub op: DmaOp,
    /// Start of the region.
    pub iova: u64,
    /// Length of the region.
    pub size: u64,
    /// The target's own error.
    #[source]
    pub source: DmaError,
}

/// Errors of the DMA space and its targets.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// A target's own failure (an ioctl, a message to a server).
    #[error("the DMA target failed")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The region is empty or runs past the end of the address space.
    #[error("region {iova:#x}+{size:#x} is empty or wraps around")]
    Invalid {
        /// Start of the region.
        iova: u64,
        /// Length of the region.
        size: u64,
    },
    /// The region overlaps one already in the DMA space.
    #[error("region {iova:#x}+{size:#x} overlaps one already in the DMA space")]
    Overlap {
        /// Start of the region.
        iova: u64,
        /// Length of the region.
        size: u64,
    },
    /// No region of that owner starts there.
    #[error("no region of {} starts at {iova:#x}", owner_name(.owner))]
    NotFound {
        /// The owner asked for; `None` for guest RAM.
        owner: Option<DeviceId>,
        /// The start asked for.
        iova: u64,
    },
    /// The device already has a target.
    #[error("{0} already has a DMA target")]
    DuplicateTarget(DeviceId),
    /// Some targets failed; the change is in the DMA space and in every other target.
    #[error("{} DMA target operation(s) failed: {}", .0.len(), list(.0))]
    Targets(Vec<TargetError>),
}

fn owner_name(owner: &Option<DeviceId>) -> String {
    owner.map_or_else(|| "guest RAM".to_string(), |id| id.to_string())
}

fn list(failures: &[TargetError]) -> String {
    failures.iter().map(|f| f.to_string()).collect::<Vec<_>>().join("; ")
}

struct Target {
    id: DeviceId,
    p2p: bool,
    target: Box<dyn DmaTarget>,
}

/// Guest RAM and mapped BARs, and the targets that mirror them.
#[derive(Default)]
pub struct DmaSpace {
    regions: BTreeMap<u64, DmaRegion>,
    targets: Vec<Target>,
}

impl DmaSpace {
    /// An empty space without targets.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the target of device `id`, which may reach other devices' BARs when `p2p` (and
    /// they allow it), and maps into it every region it may reach. With `p2p`, the device's
    /// BARs already in the space are mapped into the other peer-to-peer targets too. The
    /// target stays even when some mappings fail.
    pub fn add_target(&mut self, id: DeviceId, target: Box<dyn DmaTarget>, p2p: bool) -> Result<(), DmaError> {
        if self.targets.iter().any(|t| t.id == id) {
            return Err(DmaError::DuplicateTarget(id));
        }
        self.targets.push(Target { id, p2p, target });
        let new = self.targets.len() - 1;
        let mut failures = Vec::new();
        for region in self.regions.values() {
            let reached_by = self.reached_by(region);
            for (i, t) in self.targets.iter_mut().enumerate() {
                // The new target gets everything it reaches; the others, the new device's BARs.
                if reached_by(t) && (i == new || region.owner == Some(id)) {
                    map(t, region, &mut failures);
                }
            }
        }
        outcome(failures)
    }

    /// Adds `region` and maps it into every target that may reach it.
    pub fn add_region(&mut self, region: DmaRegion) -> Result<(), DmaError> {
        self.check_free(region.iova, region.size, None)?;
        let mut failures = Vec::new();
        let reached_by = self.reached_by(&region);
        for t in self.targets.iter_mut().filter(|t| reached_by(t)) {
            map(t, &region, &mut failures);
        }
        self.regions.insert(region.iova, region);
        outcome(failures)
    }

    /// Moves `owner`'s region at `old_iova` to `new_iova` in the space and in every target
    /// that reaches it; moving a region where it is changes nothing.
    pub fn move_region(&mut self, owner: DeviceId, old_iova: u64, new_iova: u64) -> Result<(), DmaError> {
        let size = self.find(Some(owner), old_iova)?.size;
        if new_iova == old_iova {
            return Ok(());
        }
        self.check_free(new_iova, size, Some(old_iova))?;
        let mut region = self.take(Some(owner), old_iova)?;
        region.iova = new_iova;
        let mut failures = Vec::new();
        let reached_by = self.reached_by(&region);
        for t in self.targets.iter_mut().filter(|t| reached_by(t)) {
            unmap(t, old_iova, size, &mut failures);
            map(t, &region, &mut failures);
        }
        self.regions.insert(new_iova, region);
        outcome(failures)
    }

    /// Removes the region of `owner` (`None`: guest RAM) at `iova` from the space and
    /// every target that reaches it.
    pub fn remove_region(&mut self, owner: Option<DeviceId>, iova: u64) -> Result<(), DmaError> {
        let region = self.take(owner, iova)?;
        let mut failures = Vec::new();
        let reached_by = self.reached_by(&region);
        for t in self.targets.iter_mut().filter(|t| reached_by(t)) {
            unmap(t, iova, region.size, &mut failures);
        }
        outcome(failures)
    }

    fn find(&self, owner: Option<DeviceId>, iova: u64) -> Result<&DmaRegion, DmaError> {
        self.regions.get(&iova).filter(|r| r.owner == owner).ok_or(DmaError::NotFound { owner, iova })
    }

    /// Removes `owner`'s region at `iova` from the map (not from the targets).
    fn take(&mut self, owner: Option<DeviceId>, iova: u64) -> Result<DmaRegion, DmaError> {
        match self.regions.entry(iova) {
            Entry::Occupied(e) if e.get().owner == owner => Ok(e.remove()),
            _ => Err(DmaError::NotFound { owner, iova }),
        }
    }

    /// Whether `[iova, iova + size)` is a valid range clear of every region but `moving`.
    fn check_free(&self, iova: u64, size: u64, moving: Option<u64>) -> Result<(), DmaError> {
        let end = iova.checked_add(size).filter(|_| size > 0).ok_or(DmaError::Invalid { iova, size })?;
        let clash = self.regions.range(..end).rev().find(|(start, _)| Some(**start) != moving);
        match clash {
            Some((start, r)) if start + r.size > iova => Err(DmaError::Overlap { iova, size }),
            _ => Ok(()),
        }
    }

    /// Which targets may reach `region`: every one for guest RAM; for a BAR, the other
    /// devices' targets, when both they and the BAR's device allow peer-to-peer.
    fn reached_by(&self, region: &DmaRegion) -> impl Fn(&Target) -> bool {
        let owner = region.owner;
        let owner_p2p = owner.is_some_and(|o| self.targets.iter().any(|t| t.id == o && t.p2p));
        move |t: &Target| match owner {
            None => true,
            Some(o) => o != t.id && t.p2p && owner_p2p,
        }
    }
}

fn map(t: &mut Target, region: &DmaRegion, failures: &mut Vec<TargetError>) {
    if let Err(source) = t.target.map(region) {
        failures.push(TargetError { target: t.id, op: DmaOp::Map, iova: region.iova, size: region.size, source });
    }
}

fn unmap(t: &mut Target, iova: u64, size: u64, failures: &mut Vec<TargetError>) {
    if let Err(source) = t.target.unmap(iova, size) {
        failures.push(TargetError { target: t.id, op: DmaOp::Unmap, iova, size, source });
    }
}

fn outcome(failures: Vec<TargetError>) -> Result<(), DmaError> {
    if failures.is_empty() {
        Ok(())
    } else {
        Err(DmaError::Targets(failures))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::lock;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Op {
        Map { iova: u64, size: u64, host_addr: u64 },
        Unmap { iova: u64, size: u64 },
    }

    /// A target that records what it is asked and fails maps at `fail_at`.
    #[derive(Clone, Default)]
    struct Recorder {
        ops: Arc<Mutex<Vec<Op>>>,
        fail_at: Option<u64>,
    }

    impl Recorder {
        fn failing_at(iova: u64) -> Self {
            Recorder { fail_at: Some(iova), ..Default::default() }
        }

        fn take(&self) -> Vec<Op> {
            std::mem::take(&mut *lock(&self.ops))
        }
    }

    impl DmaTarget for Recorder {
        fn map(&mut self, r: &DmaRegion) -> Result<(), DmaError> {
            if self.fail_at == Some(r.iova) {
                return Err(DmaError::Backend("no IOMMU space left".into()));
            }
            lock(&self.ops).push(Op::Map { iova: r.iova, size: r.size, host_addr: r.host_addr });
            Ok(())
        }

        fn unmap(&mut self, iova: u64, size: u64) -> Result<(), DmaError> {
            lock(&self.ops).push(Op::Unmap { iova, size });
            Ok(())
        }
    }

    const GPU: DeviceId = DeviceId(1);
    const NIC: DeviceId = DeviceId(2);
    const NVME: DeviceId = DeviceId(3);
    const RAM_LOW: u64 = 0x8000_0000;
    const HOST: u64 = 0x7f00_0000_0000;

    fn ram(iova: u64, size: u64) -> DmaRegion {
        DmaRegion { iova, size, host_addr: HOST.wrapping_add(iova), fd: None, owner: None }
    }

    fn bar(owner: DeviceId, iova: u64) -> DmaRegion {
        DmaRegion { iova, size: 0x100_0000, host_addr: HOST - 0x100_0000, fd: None, owner: Some(owner) }
    }

    fn mapped(r: &DmaRegion) -> Op {
        Op::Map { iova: r.iova, size: r.size, host_addr: r.host_addr }
    }

    /// Guest RAM below and above the 32-bit hole.
    fn with_ram() -> DmaSpace {
        let mut space = DmaSpace::new();
        space.add_region(ram(0, RAM_LOW)).unwrap();
        space.add_region(ram(1 << 32, 1 << 30)).unwrap();
        space
    }

    #[test]
    fn test_new_target_is_replayed_guest_ram() {
        let mut space = with_ram();
        let gpu = Recorder::default();
        space.add_target(GPU, Box::new(gpu.clone()), false).unwrap();
        assert_eq!(gpu.take(), vec![mapped(&ram(0, RAM_LOW)), mapped(&ram(1 << 32, 1 << 30))]);
        // RAM added later reaches every target.
        let nic = Recorder::default();
        space.add_target(NIC, Box::new(nic.clone()), false).unwrap();
        nic.take();
        space.add_region(ram(2 << 32, 1 << 20)).unwrap();
        assert_eq!(gpu.take(), vec![mapped(&ram(2 << 32, 1 << 20))]);
        assert_eq!(nic.take(), vec![mapped(&ram(2 << 32, 1 << 20))]);
    }

    #[test]
    fn test_bars_reach_peers_only_when_both_allow() {
        let mut space = DmaSpace::new();
        let (gpu, nic, nvme) = (Recorder::default(), Recorder::default(), Recorder::default());
        space.add_target(GPU, Box::new(gpu.clone()), true).unwrap();
        space.add_target(NIC, Box::new(nic.clone()), true).unwrap();
        space.add_target(NVME, Box::new(nvme.clone()), false).unwrap();
        let gpu_bar = bar(GPU, 0x38_0000_0000);
        space.add_region(gpu_bar.clone()).unwrap();
        assert_eq!(gpu.take(), vec![], "a device's own BAR is never in its own target");
        assert_eq!(nic.take(), vec![mapped(&gpu_bar)]);
        assert_eq!(nvme.take(), vec![], "NVMe does not allow peer-to-peer");
        // The NVMe's BAR reaches no one: its device does not allow peer-to-peer.
        space.add_region(bar(NVME, 0x39_0000_0000)).unwrap();
        assert_eq!((gpu.take(), nic.take(), nvme.take()), (vec![], vec![], vec![]));
    }

    #[test]
    fn test_bar_added_before_its_target_reaches_peers_when_the_target_comes() {
        let mut space = with_ram();
        let nic = Recorder::default();
        space.add_target(NIC, Box::new(nic.clone()), true).unwrap();
        nic.take();
        let gpu_bar = bar(GPU, 0x38_0000_0000);
        space.add_region(gpu_bar.clone()).unwrap();
        assert_eq!(nic.take(), vec![], "the GPU's wish is not known yet");
        let gpu = Recorder::default();
        space.add_target(GPU, Box::new(gpu.clone()), true).unwrap();
        assert_eq!(nic.take(), vec![mapped(&gpu_bar)]);
        assert_eq!(gpu.take(), vec![mapped(&ram(0, RAM_LOW)), mapped(&ram(1 << 32, 1 << 30))]);
    }

    #[test]
    fn test_moving_a_bar_moves_it_in_every_peer() {
        let mut space = DmaSpace::new();
        let (gpu, nic) = (Recorder::default(), Recorder::default());
        space.add_target(GPU, Box::new(gpu.clone()), true).unwrap();
        space.add_target(NIC, Box::new(nic.clone()), true).unwrap();
        let from = bar(GPU, 0x38_0000_0000);
        space.add_region(from.clone()).unwrap();
        nic.take();
        let to = DmaRegion { iova: 0x40_0000_0000, ..from.clone() };
        space.move_region(GPU, from.iova, to.iova).unwrap();
        assert_eq!(nic.take(), vec![Op::Unmap { iova: from.iova, size: from.size }, mapped(&to)]);
        assert_eq!(gpu.take(), vec![]);
        // Moves are idempotent: the VMM may apply the same one twice.
        space.move_region(GPU, to.iova, to.iova).unwrap();
        assert_eq!(nic.take(), vec![]);
        // Only the owner's region at that address moves.
        assert!(matches!(
            space.move_region(NIC, to.iova, 0),
            Err(DmaError::NotFound { owner: Some(NIC), iova: 0x40_0000_0000 })
        ));
        assert!(matches!(space.move_region(GPU, from.iova, 0), Err(DmaError::NotFound { .. })));
        // A move may overlap where the region was, never another region.
        space.move_region(GPU, to.iova, to.iova + 0x1000).unwrap();
        space.add_region(ram(0, RAM_LOW)).unwrap();
        assert!(matches!(space.move_region(GPU, to.iova + 0x1000, 0x1000), Err(DmaError::Overlap { .. })));
    }

    #[test]
    fn test_removing_regions() {
        let mut space = with_ram();
        let (gpu, nic) = (Recorder::default(), Recorder::default());
        space.add_target(GPU, Box::new(gpu.clone()), true).unwrap();
        space.add_target(NIC, Box::new(nic.clone()), true).unwrap();
        space.add_region(bar(GPU, 0x38_0000_0000)).unwrap();
        gpu.take();
        nic.take();
        // Memory decode off: the BAR leaves the space.
        space.remove_region(Some(GPU), 0x38_0000_0000).unwrap();
        assert_eq!(nic.take(), vec![Op::Unmap { iova: 0x38_0000_0000, size: 0x100_0000 }]);
        assert_eq!(gpu.take(), vec![]);
        assert!(matches!(space.remove_region(Some(GPU), 0x38_0000_0000), Err(DmaError::NotFound { .. })));
        // Guest RAM is removed only as guest RAM.
        assert!(matches!(space.remove_region(Some(GPU), 0), Err(DmaError::NotFound { .. })));
        space.remove_region(None, 0).unwrap();
        assert_eq!(gpu.take(), vec![Op::Unmap { iova: 0, size: RAM_LOW }]);
        assert_eq!(nic.take(), vec![Op::Unmap { iova: 0, size: RAM_LOW }]);
    }

    #[test]
    fn test_one_failing_target_does_not_stop_the_others() {
        let mut space = DmaSpace::new();
        let (gpu, nic) = (Recorder::failing_at(1 << 32), Recorder::default());
        space.add_target(GPU, Box::new(gpu.clone()), false).unwrap();
        space.add_target(NIC, Box::new(nic.clone()), false).unwrap();
        let high = ram(1 << 32, 1 << 30);
        let Err(DmaError::Targets(failures)) = space.add_region(high.clone()) else {
            panic!("the GPU's target fails");
        };
        assert_eq!(failures.len(), 1);
        let f = &failures[0];
        assert_eq!((f.target, f.op, f.iova, f.size), (GPU, DmaOp::Map, 1 << 32, 1 << 30));
        assert_eq!(nic.take(), vec![mapped(&high)]);
        // The region is in the space: a target added later gets it, and it can be removed.
        let nvme = Recorder::default();
        space.add_target(NVME, Box::new(nvme.clone()), false).unwrap();
        assert_eq!(nvme.take(), vec![mapped(&high)]);
        space.remove_region(None, 1 << 32).unwrap();
        assert_eq!(nic.take(), vec![Op::Unmap { iova: 1 << 32, size: 1 << 30 }]);
        // Replaying into a failing target reports it and keeps the target.
        space.add_region(high.clone()).unwrap_err();
        let late = Recorder::failing_at(1 << 32);
        assert!(matches!(space.add_target(DeviceId(9), Box::new(late), false), Err(DmaError::Targets(_))));
        assert!(matches!(
            space.add_target(DeviceId(9), Box::new(Recorder::default()), false),
            Err(DmaError::DuplicateTarget(DeviceId(9)))
        ));
    }

    #[test]
    fn test_invalid_and_overlapping_regions_are_refused() {
        let mut space = with_ram();
        let t = Recorder::default();
        space.add_target(NIC, Box::new(t.clone()), false).unwrap();
        t.take();
        assert!(matches!(space.add_region(ram(RAM_LOW, 0)), Err(DmaError::Invalid { .. })));
        assert!(matches!(space.add_region(ram(u64::MAX, 2)), Err(DmaError::Invalid { .. })));
        assert!(matches!(space.add_region(ram(RAM_LOW - 1, 2)), Err(DmaError::Overlap { .. })));
        assert!(matches!(space.add_region(ram((1 << 32) + 0x1000, 1)), Err(DmaError::Overlap { .. })));
        assert!(matches!(space.add_region(ram((1 << 32) - 1, 2)), Err(DmaError::Overlap { .. })));
        assert_eq!(t.take(), vec![], "a refused region reaches no target");
        // Adjacent regions are fine.
        space.add_region(ram(RAM_LOW, 0x1000)).unwrap();
    }

    #[test]
    fn test_errors_name_target_and_region() {
        let backend = DmaError::Backend("no IOMMU space left".into());
        let f = TargetError { target: GPU, op: DmaOp::Map, iova: 0x1000, size: 0x2000, source: backend };
        assert_eq!(f.to_string(), "the DMA target of device 1 could not map 0x1000+0x2000");
        let all = DmaError::Targets(vec![f]);
        assert_eq!(
            all.to_string(),
            "1 DMA target operation(s) failed: the DMA target of device 1 could not map 0x1000+0x2000"
        );
        let missing = DmaError::NotFound { owner: None, iova: 0x10 };
        assert_eq!(missing.to_string(), "no region of guest RAM starts at 0x10");
    }
}
