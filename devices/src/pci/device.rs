//! The narrow trait a PCI function's backend implements, modelled on Firecracker's four
//! methods: configuration bytes the device owns, accesses to its trapped BARs, and what it
//! offers. Everything else (topology registers, BAR placement, the MSI-X capability) stays
//! with the VMM, which asks the device only for the bytes it does not own.
//!
//! Written by hand: rust-vmm has no PCI device crate, and Cloud Hypervisor's and crosvm's
//! traits carry their device managers' plumbing.

use std::fs::File;
use std::ops::Range;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

/// A PCI function's backend: an emulated device, a VFIO device, a vfio-user server.
pub trait PciDevice: Send {
    /// Reads device-owned configuration bytes at register `reg` (the VMM asks only for
    /// bytes it does not own).
    fn config_read(&mut self, reg: usize, data: &mut [u8]);
    /// Writes device-owned configuration bytes at register `reg`.
    fn config_write(&mut self, reg: usize, data: &[u8]);
    /// Reads `data.len()` bytes of trapped BAR `bar` at `offset` from the BAR's start.
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]);
    /// Writes trapped BAR `bar` at `offset` from the BAR's start.
    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]);
    /// The memory BARs the device offers and how each can be reached. Default: none.
    fn bars(&self) -> Vec<BarInfo> {
        Vec::new()
    }
    /// Where the device's MSI-X table and pending bits are, if it has MSI-X: the VMM
    /// emulates the table there (for every device kind alike) and traps those pages.
    fn msix(&self) -> Option<MsixLayout> {
        None
    }
    /// Connects the device's MSI-X vectors to `vectors` (one eventfd per vector, in
    /// order), or disconnects them (`None`), as the guest enables or disables MSI-X.
    fn connect_msix(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        let _ = vectors;
        Ok(())
    }
    /// The device's MSI capability, if it has one: the VMM emulates it (for every device
    /// kind alike) and connects the vectors the guest enables.
    fn msi(&self) -> Option<MsiInfo> {
        None
    }
    /// Connects the device's MSI vectors to `vectors` (one eventfd per enabled vector), or
    /// disconnects them (`None`).
    fn connect_msi(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        let _ = vectors;
        Ok(())
    }
    /// The legacy INTx pin the device raises (1 = INTA to 4 = INTD), if it has one.
    fn intx_pin(&self) -> Option<u8> {
        None
    }
    /// Connects the device's INTx to `lines` (trigger: assert the pin; resample: the
    /// guest's EOI, where a still-pending device asserts again), or disconnects it (`None`).
    /// Only one interrupt mode is connected at a time: the VMM disconnects INTx before it
    /// connects MSI or MSI-X, and connects it again when they go off.
    fn connect_intx(&mut self, lines: Option<(&EventFd, &EventFd)>) -> Result<(), DeviceError> {
        let _ = lines;
        Ok(())
    }
    /// Configuration writes the device refused to pass on (a passed-through device's
    /// firewall), since it was opened.
    fn dropped_config_writes(&self) -> u64 {
        0
    }
    /// Resets the device (FLR or its own reset) before the guest starts and after it stops,
    /// and when the guest initiates a Function Level Reset.
    fn reset(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Whether [`PciDevice::reset`] really resets the device. The VMM carries out a guest's
    /// Function Level Reset only for such a device; another one gets the guest's write.
    /// Default: no.
    fn can_reset(&self) -> bool {
        false
    }
    /// The device's doorbells: guest writes the VMM should turn into eventfd signals
    /// without an exit (KVM ioeventfds) while the BAR is placed. The fds are clones
    /// (`try_clone`) of the device's own. Default: none.
    fn ioeventfds(&self) -> Vec<IoEvent> {
        Vec::new()
    }
}

/// A doorbell: guest writes (any size, any value) to BAR `bar` at `offset` signal `fd`;
/// the VMM registers it as a KVM ioeventfd while the BAR is placed, so such writes do
/// not exit to the VMM. Writes that still arrive through bar_write must have the same effect.
#[derive(Debug)]
pub struct IoEvent {
    /// The BAR the doorbell is in.
    pub bar: u8,
    /// Offset of the doorbell from the BAR's start.
    pub offset: u64,
    /// Signalled on every write to the doorbell.
    pub fd: EventFd,
}

/// Where a device's MSI-X structures are (from its MSI-X capability).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixLayout {
    /// Offset of the MSI-X capability in configuration space.
    pub cap: usize,
    /// Number of vectors.
    pub vectors: u16,
    /// BAR holding the table, and the table's offset in it.
    pub table: (u8, u64),
    /// BAR holding the pending-bit array, and its offset in it.
    pub pba: (u8, u64),
}

/// The device's MSI capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsiInfo {
    /// Offset of the capability in configuration space.
    pub cap: usize,
    /// Vectors offered (Multiple Message Capable), 1 to 32.
    pub vectors: u8,
    /// 64-bit message address.
    pub is_64bit: bool,
    /// Per-vector masking.
    pub per_vector_mask: bool,
}

/// One memory BAR a device offers.
#[derive(Debug, Clone)]
pub struct BarInfo {
    /// BAR register index, 0 to 5 (a 64-bit BAR also takes `index + 1`).
    pub index: u8,
    /// Size in bytes, a power of two.
    pub size: u64,
    /// Whether the BAR takes two registers and may sit above 4 GiB.
    pub is_64bit: bool,
    /// Whether reads have no side effects (the guest may map it write-combined).
    pub prefetchable: bool,
    /// How guest accesses reach the BAR.
    pub mapping: BarMapping,
}

/// How guest accesses to a BAR reach the device.
#[derive(Debug, Clone)]
pub enum BarMapping {
    /// Every access exits to the VMM and goes to [`PciDevice::bar_read`]/[`PciDevice::bar_write`].
    Trapped,
    /// The BAR is memory the VMM maps into the guest (a KVM slot over `fd`) and into the
    /// DMA space; only `holes` stay trapped.
    Mapped {
        /// The file the BAR is mapped from (a VFIO device fd, a vfio-user region fd).
        fd: Arc<File>,
        /// Offset of the BAR's start in `fd`.
        offset: u64,
        /// Sub-ranges of the BAR, offsets from its start, that stay trapped (the MSI-X
        /// table and PBA pages).
        holes: Vec<Range<u64>>,
    },
}

/// Errors a device reports to the VMM.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The device could not be reset.
    #[error("the device could not be reset")]
    Reset(#[source] std::io::Error),
    /// The device's interrupts could not be connected or disconnected.
    #[error("the device's interrupts could not be {what}")]
    Interrupts {
        /// What was being done ("connected", "disconnected").
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// `ranges` clamped to `[0, size)`, empty ones dropped, sorted, overlapping and adjacent
/// ones merged.
pub fn merge_ranges(ranges: Vec<Range<u64>>, size: u64) -> Vec<Range<u64>> {
    let mut ranges: Vec<Range<u64>> =
        ranges.into_iter().map(|r| r.start.min(size)..r.end.min(size)).filter(|r| r.start < r.end).collect();
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::new();
    for r in ranges {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device that implements only the four access methods.
    struct Scratch([u8; 4]);

    impl PciDevice for Scratch {
        fn config_read(&mut self, _reg: usize, data: &mut [u8]) {
            data.fill(0xff);
        }
        fn config_write(&mut self, _reg: usize, _data: &[u8]) {}
        fn bar_read(&mut self, _bar: u8, offset: u64, data: &mut [u8]) {
            let at = offset as usize;
            match self.0.get(at..at + data.len()) {
                Some(src) => data.copy_from_slice(src),
                None => data.fill(0xff),
            }
        }
        fn bar_write(&mut self, _bar: u8, offset: u64, data: &[u8]) {
            let at = offset as usize;
            if let Some(dst) = self.0.get_mut(at..at + data.len()) {
                dst.copy_from_slice(data);
            }
        }
    }

    #[test]
    fn test_defaults_offer_nothing_and_reset_succeeds() {
        let mut dev: Box<dyn PciDevice> = Box::new(Scratch([0; 4]));
        assert!(dev.bars().is_empty());
        assert!(dev.reset().is_ok());
        dev.bar_write(0, 1, &[0xab, 0xcd]);
        let mut b = [0u8; 4];
        dev.bar_read(0, 0, &mut b);
        assert_eq!(b, [0, 0xab, 0xcd, 0]);
    }

    #[test]
    fn test_reset_error_keeps_its_cause() {
        let e = DeviceError::Reset(std::io::Error::from_raw_os_error(libc::EBUSY));
        assert_eq!(e.to_string(), "the device could not be reset");
        assert!(std::error::Error::source(&e).is_some());
    }
}
