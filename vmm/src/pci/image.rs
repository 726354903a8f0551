//! Read-only images of configuration spaces that change only when the guest writes them
//! (host bridge, root and switch ports, endpoints with nothing behind them, and gdrvm's
//! own emulated devices), for KVM to map over those functions' 4 KiB of ECAM as read-only
//! guest memory.
//!
//! Linux reads each function's configuration space about a hundred times at boot (the
//! capability lists, link and slot registers, the extended list from 0x100) and writes it
//! a few dozen times. With the image mapped a read costs no exit; a write still exits, as
//! KVM turns a guest write to read-only memory into an MMIO exit, reaches the segment, and
//! the segment brings the image up to date, under the function's lock, before the vCPU
//! resumes. A vCPU's own reads after its write therefore see it.
//!
//! A passed-through or foreign vfio-user device changes registers of its own (status,
//! link state) without any write, so reads of its function must reach it: it is not
//! imaged ([`super::PciFunction::imageable`]). An emulator that dies keeps its last image
//! until the next write to its function (the VMM logs the failure, and its BARs read
//! all-ones at once), where the exit path would read all-ones at once.
//!
//! Written by hand: no rust-vmm crate maps configuration space into the guest; QEMU and
//! Cloud Hypervisor trap every ECAM access.

use std::ops::Range;
use std::sync::atomic::Ordering;

use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, VolatileMemory};

use super::CONFIG_SPACE_SIZE;

/// One function's image: where it belongs in ECAM and where it lies in this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImagePage {
    /// Offset of the function's configuration space in ECAM (`bus << 20 | devfn << 12`).
    pub ecam_offset: u64,
    /// Host address of its 4 KiB image.
    pub host_addr: u64,
}

/// The images of a segment's imaged functions, one page each, in one anonymous mapping.
pub struct ConfigImages {
    /// The pages; `None` when no function is imaged.
    memory: Option<MmapRegion<()>>,
    /// For each function of the node, its page in `memory`, if it is imaged.
    page_of: Vec<Option<usize>>,
    /// For each page, the ECAM offset of its function.
    ecam_offsets: Vec<u64>,
}

impl ConfigImages {
    /// Images of the functions `imaged` names (index in the node, ECAM offset, the
    /// function's configuration space as the guest reads it now), out of `count` functions
    /// in the node.
    pub fn new(
        count: usize,
        imaged: impl IntoIterator<Item = (usize, u64, Vec<u8>)>,
    ) -> Result<Self, vm_memory::mmap::MmapRegionError> {
        let imaged: Vec<_> = imaged.into_iter().filter(|(i, _, _)| *i < count).collect();
        let mut page_of = vec![None; count];
        let memory = match imaged.len() {
            0 => None,
            n => Some(MmapRegion::new(n * CONFIG_SPACE_SIZE)?),
        };
        for (page, (i, _, _)) in imaged.iter().enumerate() {
            page_of[*i] = Some(page);
        }
        let ecam_offsets = imaged.iter().map(|(_, offset, _)| *offset).collect();
        let images = ConfigImages { memory, page_of, ecam_offsets };
        for (i, _, bytes) in imaged {
            images.update(i, 0, &bytes);
        }
        Ok(images)
    }

    /// No images: every configuration access exits.
    pub fn none(count: usize) -> Self {
        ConfigImages { memory: None, page_of: vec![None; count], ecam_offsets: Vec::new() }
    }

    /// Whether function `function` is imaged.
    pub fn is_imaged(&self, function: usize) -> bool {
        matches!(self.page_of.get(function), Some(Some(_)))
    }

    /// Brings the bytes of function `function`'s image from `at` (a dword's offset) up to
    /// `bytes`, if it is imaged. Changed dwords are stored whole (atomically), so a vCPU
    /// reading meanwhile sees each register either before or after, never torn.
    pub fn update(&self, function: usize, at: usize, bytes: &[u8]) {
        let (Some(memory), Some(Some(page))) = (&self.memory, self.page_of.get(function)) else { return };
        let image = memory.as_volatile_slice();
        let base = page * CONFIG_SPACE_SIZE + (at & !3);
        let dwords = CONFIG_SPACE_SIZE.saturating_sub(at & !3) / 4;
        for (n, dword) in bytes.chunks_exact(4).take(dwords).enumerate() {
            let value = u32::from_le_bytes([dword[0], dword[1], dword[2], dword[3]]);
            let at = base + n * 4;
            // Inside the mapping by construction (`page` < pages, the dword inside its
            // 4 KiB); a failure would only leave that dword stale, so it is logged.
            match image.load::<u32>(at, Ordering::Relaxed) {
                Ok(old) if old == value => {}
                _ => {
                    if let Err(e) = image.store(value, at, Ordering::Release) {
                        tracing::warn!("configuration image of function {function}: {e}");
                    }
                }
            }
        }
    }

    /// Bytes `range` of function `function`'s image as the guest reads them through the
    /// mapping, if it is imaged and the range lies inside its 4 KiB.
    pub fn contents(&self, function: usize, range: Range<usize>) -> Option<Vec<u8>> {
        let (Some(memory), Some(Some(page))) = (&self.memory, self.page_of.get(function)) else { return None };
        if range.start > range.end || range.end > CONFIG_SPACE_SIZE {
            return None;
        }
        let mut bytes = vec![0; range.len()];
        memory.as_volatile_slice().read_slice(&mut bytes, page * CONFIG_SPACE_SIZE + range.start).ok()?;
        Some(bytes)
    }

    /// Every image, to be mapped into the guest.
    pub fn pages(&self) -> Vec<ImagePage> {
        let Some(memory) = &self.memory else { return Vec::new() };
        self.ecam_offsets
            .iter()
            .enumerate()
            .map(|(page, &ecam_offset)| ImagePage {
                ecam_offset,
                host_addr: memory.as_ptr() as u64 + (page * CONFIG_SPACE_SIZE) as u64,
            })
            .collect()
    }
}
