//! A VFIO container as a [`DmaTarget`]: every region of the DMA space (guest RAM, a peer's
//! mapped BAR) is mapped into the container's IOMMU domain at its guest-physical address,
//! readable and writable, from where the VMM has it mapped.

use std::sync::Arc;

use super::backend::VfioContainerOps;
use crate::dma::{DmaError, DmaRegion, DmaTarget};

/// The DMA target of one VFIO container.
pub struct VfioDmaTarget {
    container: Arc<dyn VfioContainerOps>,
}

impl VfioDmaTarget {
    /// The target that maps into `container`.
    ///
    /// # Safety
    ///
    /// Every region this target is later asked to map must uphold
    /// [`VfioContainerOps::dma_map`]'s contract until it is unmapped: `host_addr` is a live
    /// mapping of `size` bytes in this process (guest RAM or a BAR mapping the VMM keeps),
    /// touched only through volatile accesses or system calls, since the device may write
    /// it at any time.
    pub unsafe fn new(container: Arc<dyn VfioContainerOps>) -> Self {
        VfioDmaTarget { container }
    }
}

impl DmaTarget for VfioDmaTarget {
    fn map(&mut self, region: &DmaRegion) -> Result<(), DmaError> {
        let size =
            usize::try_from(region.size).map_err(|_| DmaError::Invalid { iova: region.iova, size: region.size })?;
        // SAFETY: `new`'s caller promised that every region mapped here is a live mapping of
        // this process that nothing holds a reference into, until it is unmapped.
        unsafe { self.container.dma_map(region.iova, size, region.host_addr as *mut u8) }
            .map_err(|e| DmaError::Backend(Box::new(e)))
    }

    fn unmap(&mut self, iova: u64, size: u64) -> Result<(), DmaError> {
        let len = usize::try_from(size).map_err(|_| DmaError::Invalid { iova, size })?;
        self.container.dma_unmap(iova, len).map_err(|e| DmaError::Backend(Box::new(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::{DeviceId, DmaSpace};
    use crate::lock;
    use crate::vfio::fake::{DmaCall, FakeContainer};

    const HOST: u64 = 0x7f00_0000_0000;

    fn ram(iova: u64, size: u64) -> DmaRegion {
        DmaRegion { iova, size, host_addr: HOST + iova, fd: None, owner: None }
    }

    fn target(container: &Arc<FakeContainer>) -> Box<dyn DmaTarget> {
        // SAFETY: the fake container never touches the addresses it is given.
        Box::new(unsafe { VfioDmaTarget::new(container.clone()) })
    }

    #[test]
    fn test_maps_host_address_at_iova_and_unmaps() {
        let container = Arc::new(FakeContainer::default());
        let mut t = target(&container);
        t.map(&ram(0x1_0000_0000, 0x4000_0000)).unwrap();
        t.unmap(0x1_0000_0000, 0x4000_0000).unwrap();
        assert_eq!(
            *lock(&container.calls),
            [
                DmaCall::Map(0x1_0000_0000, 0x4000_0000, HOST + 0x1_0000_0000),
                DmaCall::Unmap(0x1_0000_0000, 0x4000_0000)
            ]
        );
    }

    #[test]
    fn test_failures_keep_the_ioctl_error() {
        let container = Arc::new(FakeContainer { fail_at: Some(0), ..Default::default() });
        let err = target(&container).map(&ram(0, 0x1000)).unwrap_err();
        assert_eq!(err.to_string(), "the DMA target failed");
        let source = std::error::Error::source(&err).unwrap().to_string();
        assert!(source.starts_with("failed to add guest memory map into iommu table"), "{source}");
    }

    #[test]
    fn test_dma_space_replays_guest_ram_and_peer_bars_into_the_container() {
        let (gpu, nic) = (Arc::new(FakeContainer::default()), Arc::new(FakeContainer::default()));
        let mut space = DmaSpace::new();
        space.add_region(ram(0, 0x8000_0000)).unwrap();
        space.add_target(DeviceId(1), target(&gpu), true).unwrap();
        space.add_target(DeviceId(2), target(&nic), true).unwrap();
        let bar =
            DmaRegion { iova: 0x38_0000_0000, size: 0x100_0000, host_addr: HOST, fd: None, owner: Some(DeviceId(1)) };
        space.add_region(bar).unwrap();
        space.move_region(DeviceId(1), 0x38_0000_0000, 0x39_0000_0000).unwrap();
        assert_eq!(*lock(&gpu.calls), [DmaCall::Map(0, 0x8000_0000, HOST)]);
        assert_eq!(
            *lock(&nic.calls),
            [
                DmaCall::Map(0, 0x8000_0000, HOST),
                DmaCall::Map(0x38_0000_0000, 0x100_0000, HOST),
                DmaCall::Unmap(0x38_0000_0000, 0x100_0000),
                DmaCall::Map(0x39_0000_0000, 0x100_0000, HOST),
            ]
        );
    }
}
