//! The emulated GPU: the common registers and where its aperture is.
//!
//! The aperture is the largest prefetchable memory BAR (BAR 1 on NVIDIA data-center
//! GPUs), backed like every memory BAR by a memfd the VMM maps into the guest and into the
//! other devices' DMA space, so a peer's DMA engine can write it.

use std::sync::Arc;

use gdrvm_model::emulated;
use gdrvm_model::node::{Bar, Node};

use super::{Common, EmuError, Emulated, Registers, REGISTER_BAR};
use crate::vfio_user::Interrupts;

/// [`emulated::GPU_APERTURE_BAR`] of a GPU without a prefetchable memory BAR.
pub const NO_APERTURE: u32 = u32::MAX;

/// The GPU's own registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gpu {
    /// The aperture: BAR index and size.
    aperture: Option<(u8, u64)>,
}

/// An emulated GPU.
pub type EmulatedGpu = Emulated<Gpu>;

impl Gpu {
    /// The GPU with these BARs: the aperture is the largest prefetchable BAR, the first of
    /// equals, never the register BAR.
    pub fn new(bars: &[Bar]) -> Self {
        let mut aperture: Option<(u8, u64)> = None;
        for bar in bars {
            if bar.prefetchable && bar.index != REGISTER_BAR && aperture.is_none_or(|(_, best)| bar.size > best) {
                aperture = Some((bar.index, bar.size));
            }
        }
        Gpu { aperture }
    }

    /// The aperture's BAR index and size, if the GPU has one.
    pub fn aperture(&self) -> Option<(u8, u64)> {
        self.aperture
    }
}

impl Registers for Gpu {
    const KIND: u32 = emulated::KIND_GPU;

    fn read(&self, reg: u64) -> Option<u32> {
        let (bar, size) = self.aperture.map_or((NO_APERTURE, 0), |(bar, size)| (u32::from(bar), size));
        match reg {
            emulated::GPU_APERTURE_BAR => Some(bar),
            emulated::GPU_APERTURE_SIZE_LO => Some(size as u32),
            emulated::GPU_APERTURE_SIZE_HI => Some((size >> 32) as u32),
            _ => None,
        }
    }

    fn write(&mut self, _reg: u64, _value: u32) -> bool {
        // Every GPU register is read-only.
        false
    }

    fn reset(&mut self) {}
}

impl EmulatedGpu {
    /// The GPU at function `i` of `node` (`origin` names the node in errors), signalling
    /// through `irqs`.
    pub fn new(origin: &str, node: &Node, i: usize, irqs: Arc<Interrupts>) -> Result<Self, EmuError> {
        Emulated::build(origin, node, i, irqs, |f, _: &Arc<Common>| Ok(Gpu::new(&f.bars)))
    }
}

#[cfg(test)]
mod tests {
    use gdrvm_model::emulated::*;

    use super::super::tests::{index, preset, read32, write32};
    use super::*;

    #[test]
    fn test_aperture_registers() {
        let node = preset("minimal");
        let mut d =
            EmulatedGpu::new("preset minimal", &node, index(&node, "gpu0"), Arc::new(Interrupts::new())).unwrap();
        assert_eq!(read32(&mut d, REG_KIND), KIND_GPU);
        assert_eq!(read32(&mut d, GPU_APERTURE_BAR), 1);
        assert_eq!(read32(&mut d, GPU_APERTURE_SIZE_LO), 0);
        assert_eq!(read32(&mut d, GPU_APERTURE_SIZE_HI), 32);
        // 64-bit read of the size: both halves, low first.
        let mut b = [0; 8];
        d.region_read(0, REGS + GPU_APERTURE_SIZE_LO, &mut b);
        assert_eq!(u64::from_le_bytes(b), 128 << 30);
        // Read-only.
        write32(&mut d, GPU_APERTURE_BAR, 3);
        assert_eq!(read32(&mut d, GPU_APERTURE_BAR), 1);
        // NIC registers mean nothing on the GPU.
        assert_eq!(read32(&mut d, NIC_ENGINE + 0x100), 0);
    }

    #[test]
    fn test_aperture_choice() {
        let bar = |index, size, prefetchable| Bar { index, size, prefetchable, is_64bit: true, address: 0 };
        let gpu = Gpu::new(&[bar(0, 16 << 20, false), bar(1, 1 << 37, true), bar(3, 32 << 20, true)]);
        assert_eq!(gpu.aperture(), Some((1, 1 << 37)));
        let gpu = Gpu::new(&[bar(0, 16 << 20, true), bar(2, 1 << 20, true), bar(4, 1 << 20, true)]);
        assert_eq!(gpu.aperture(), Some((2, 1 << 20)));
        let none = Gpu::new(&[bar(0, 16 << 20, true), bar(1, 1 << 30, false)]);
        assert_eq!(none.aperture(), None);
        assert_eq!(none.read(GPU_APERTURE_BAR), Some(NO_APERTURE));
        assert_eq!(none.read(GPU_APERTURE_SIZE_LO), Some(0));
    }
}
