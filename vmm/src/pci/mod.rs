//! PCI segment 0 as the guest reaches it: every function of the node's tree behind ECAM,
//! the only configuration mechanism. Functions whose configuration changes only on writes
//! are also imaged ([`ConfigImages`]) for KVM to map read-only over their ECAM pages, so
//! that only writes exit; a passed-through device's function exits on every access. The
//! long runs of absent functions on the buses a guest scans in full
//! ([`PciSegment::absent_ranges`]) are mapped as all-ones, so enumerating empty device
//! slots costs no exit either.
//!
//! There is no type-1 mechanism at ports 0xcf8/0xcfc, as on QEMU's `microvm` with PCIe and
//! on arm64: Linux finds it missing (its probe reads 0xcf8 back as all-ones), and then uses
//! ECAM from MCFG for all of configuration space. Were type 1 there, Linux would use it for
//! the first 256 bytes of every function, two port exits an access, and nothing could be
//! mapped. Port 0xcf9, the PC reset register, stays (`machine.rs`).
//!
//! Written by hand: no rust-vmm crate models PCI-to-PCI bridges or PCIe ports, and Cloud
//! Hypervisor's and crosvm's PCI buses are tied to their own device managers.

mod function;
mod image;

use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use gdrvm_devices::{lock, BusDevice, ConfigWriteEffects};
use gdrvm_model::node::{FunctionKind, Node};

pub use function::{Backend, PciFunction};
pub use gdrvm_devices::{ConfigSpace, ACS_CAPABILITIES, CONFIG_SPACE_SIZE};
pub use image::{ConfigImages, ImagePage};

/// Applies what a configuration write meant (BARs moved, decode switched, MSI-X enabled)
/// to the machine; called after the function's lock is released.
pub trait ApplyEffects: Send + Sync {
    /// `effects` of a write to function `function` (its index in the node).
    fn apply(&self, function: usize, effects: ConfigWriteEffects);
}

/// No function at this bus/device/function.
const ABSENT: u16 = u16::MAX;

/// The functions of one PCI segment, by bus, device and function. Each function has its
/// own lock: a configuration access locks only the function it reaches.
pub struct PciSegment {
    /// Index into `functions` for each `bus << 8 | device << 3 | function`.
    index: Box<[u16; 65536]>,
    functions: Vec<Mutex<PciFunction>>,
    /// Images of the imageable functions, kept equal to their configuration space.
    images: ConfigImages,
    /// ECAM ranges of the absent functions on the buses a guest scans.
    absent: Vec<Range<u64>>,
    /// Weak: the sink (the device wiring) reaches the segment's buses; its owner keeps it.
    effects: OnceLock<Weak<dyn ApplyEffects>>,
}

impl PciSegment {
    /// The segment holding every function of `node`, with nothing behind them.
    pub fn new(node: &Node) -> Self {
        let functions = (0..node.functions.len()).map(|i| PciFunction::hollow(ConfigSpace::for_function(node, i)));
        PciSegment::with_functions(node, functions.collect())
    }

    /// The segment holding `functions`, one per function of `node`, in the node's order,
    /// with an image of each that is [`PciFunction::imageable`].
    pub fn with_functions(node: &Node, functions: Vec<PciFunction>) -> Self {
        let mut index = Box::new([ABSENT; 65536]);
        let mut offsets = Vec::with_capacity(node.functions.len());
        for (i, f) in node.functions.iter().enumerate() {
            let slot = usize::from(f.bdf.bus) << 8 | usize::from(f.bdf.device) << 3 | usize::from(f.bdf.function);
            index[slot] = i as u16;
            offsets.push((slot as u64) << 12);
        }
        let imaged = functions
            .iter()
            .zip(offsets)
            .enumerate()
            .filter(|(_, (f, _))| f.imageable())
            .map(|(i, (f, offset))| (i, offset, f.snapshot(0..CONFIG_SPACE_SIZE, None)));
        let images = ConfigImages::new(functions.len(), imaged).unwrap_or_else(|e| {
            tracing::warn!("cannot allocate configuration images ({e}): every configuration read exits");
            ConfigImages::none(functions.len())
        });
        let absent = absent_ranges(node, &index);
        PciSegment {
            index,
            functions: functions.into_iter().map(Mutex::new).collect(),
            images,
            absent,
            effects: OnceLock::new(),
        }
    }

    /// ECAM ranges (offsets, 4 KiB-aligned) of absent functions on the buses a guest
    /// scans in full, each host bridge's and each switch's internal bus: runs of
    /// consecutive absent functions, none crossing a bus, each holding enough absent
    /// device slots to be worth a KVM slot. Their reads are all-ones.
    pub fn absent_ranges(&self) -> &[Range<u64>] {
        &self.absent
    }

    /// Brings function `i`'s image (if it has one) up to what its device holds now, after
    /// something other than a guest write changed it (the VMM resetting the device).
    pub fn refresh_image(&self, i: usize) {
        if let (true, Some(f)) = (self.images.is_imaged(i), self.functions.get(i)) {
            let f = lock(f);
            self.images.update(i, 0, &f.snapshot(0..CONFIG_SPACE_SIZE, None));
        }
    }

    /// The images of the imageable functions, for KVM to map over their ECAM pages.
    pub fn images(&self) -> &ConfigImages {
        &self.images
    }

    /// Sends the effects of configuration writes to `sink` from now on (set once), for
    /// as long as its owner keeps it.
    pub fn set_effects(&self, sink: Weak<dyn ApplyEffects>) {
        if self.effects.set(sink).is_err() {
            tracing::warn!("the PCI segment's effects sink was already set");
        }
    }

    fn find(&self, bus: u8, devfn: u8) -> Option<(usize, &Mutex<PciFunction>)> {
        let i = usize::from(self.index[usize::from(bus) << 8 | usize::from(devfn)]);
        self.functions.get(i).map(|f| (i, f))
    }

    /// Reads configuration space; an absent function reads as all-ones (no vendor).
    pub fn read(&self, bus: u8, devfn: u8, offset: usize, data: &mut [u8]) {
        tracing::trace!(bus, devfn, offset, len = data.len(), "configuration read");
        match self.find(bus, devfn) {
            Some((_, f)) => lock(f).read(offset, data),
            None => data.fill(0xff),
        }
    }

    /// Writes configuration space (writes to absent functions are dropped), then applies
    /// what the write meant, with the function's lock released.
    pub fn write(&self, bus: u8, devfn: u8, offset: usize, data: &[u8]) {
        let Some((i, f)) = self.find(bus, devfn) else { return };
        tracing::trace!(bus, devfn, offset, ?data, "configuration write");
        let effects = {
            let mut f = lock(f);
            let effects = f.write(offset, data);
            // Under the lock, so that concurrent writes leave the image as the last one. A
            // write that reset the function (FLR) changed every byte, and a write that
            // reached the device may have changed any of its bytes: they are
            // read back, after the write has had its reply (an emulator rewrites its shared
            // configuration before replying). A write of the VMM's bytes alone (a hollow
            // function's, BARs, MSI) changed only the dwords it touched, and the device's
            // bytes among them are as the image has them: an imaged device's bytes change
            // only through writes and resets. Refreshing just those dwords keeps a write
            // to a bridge at a few dozen bytes copied, not three times 4 KiB.
            if self.images.is_imaged(i) {
                let (range, last) = if effects.reset || f.write_reaches_device(offset, data.len()) {
                    (0..CONFIG_SPACE_SIZE, None)
                } else {
                    let range = offset & !3..(offset + data.len()).next_multiple_of(4).min(CONFIG_SPACE_SIZE);
                    (range.clone(), self.images.contents(i, range))
                };
                self.images.update(i, range.start, &f.snapshot(range, last.as_deref()));
            }
            effects
        };
        if !effects.is_empty() {
            if let Some(sink) = self.effects.get().and_then(Weak::upgrade) {
                sink.apply(i, effects);
            }
        }
    }
}

/// Absent device slots a run must hold for mapping it to pay: a KVM slot costs more
/// than one exit (nested about 0.4 ms against 0.1-0.3 ms), and Linux reads one
/// function of each absent slot.
const MIN_ABSENT_SLOTS: usize = 4;

/// The runs of absent functions on the buses of `node` a guest scans in full (each host
/// bridge's, and each switch upstream port's secondary bus), as ECAM offsets, where
/// each holds at least [`MIN_ABSENT_SLOTS`] absent device slots. Below a root or
/// downstream port a guest reads device 0 only (Linux's `only_one_child`): one read, not
/// worth a slot.
fn absent_ranges(node: &Node, index: &[u16; 65536]) -> Vec<Range<u64>> {
    let mut buses: BTreeSet<u8> = node.host_bridges.iter().map(|h| h.first_bus).collect();
    for f in &node.functions {
        if let (Some((secondary, _)), FunctionKind::SwitchUpstream) = (f.buses, f.kind) {
            buses.insert(secondary);
        }
    }
    let page = |slot: usize| (slot as u64) << 12;
    let mut ranges = Vec::new();
    for bus in buses {
        let first = usize::from(bus) << 8;
        let on_bus = index[first..first + 256].iter().map(|&i| i == ABSENT);
        let mut start = None;
        // A present sentinel past the bus's last function closes a run that reaches it.
        for (slot, absent) in (first..).zip(on_bus.chain([false])) {
            match (absent, start) {
                (true, None) => start = Some(slot),
                (false, Some(s)) => {
                    // Device slots whose function 0 the run holds: the reads it saves.
                    if (s..slot).filter(|devfn| devfn % 8 == 0).count() >= MIN_ABSENT_SLOTS {
                        ranges.push(page(s)..page(slot));
                    }
                    start = None;
                }
                _ => {}
            }
        }
    }
    ranges
}

/// ECAM: bus in address bits 27:20, device 19:15, function 14:12, register 11:0.
pub struct Ecam(pub Arc<PciSegment>);

impl Ecam {
    fn decode(offset: u64, len: usize) -> Option<(u8, u8, usize)> {
        let reg = (offset & 0xfff) as usize;
        // An access must stay inside one function's 4 KiB.
        (len <= 8 && reg + len <= CONFIG_SPACE_SIZE).then_some(((offset >> 20) as u8, (offset >> 12) as u8, reg))
    }
}

impl BusDevice for Ecam {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match Ecam::decode(offset, data.len()) {
            Some((bus, devfn, reg)) => self.0.read(bus, devfn, reg, data),
            None => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some((bus, devfn, reg)) = Ecam::decode(offset, data.len()) {
            self.0.write(bus, devfn, reg, data);
        }
    }
}

#[cfg(test)]
mod tests;
