//! PCI segment 0 as the guest reaches it: every function of the node's tree behind ECAM
//! (MMIO, one exit per access) and the legacy type-1 mechanism at ports 0xcf8/0xcfc, which
//! Linux probes first and then uses for the first 256 bytes.
//!
//! Written by hand: no rust-vmm crate models PCI-to-PCI bridges or PCIe ports, and Cloud
//! Hypervisor's and crosvm's PCI buses are tied to their own device managers.

mod function;

use std::sync::{Arc, Mutex, OnceLock, Weak};

use gdrvm_devices::{lock, BusDevice, ConfigWriteEffects};
use gdrvm_model::node::Node;

pub use function::{Backend, PciFunction};
pub use gdrvm_devices::{ConfigSpace, ACS_CAPABILITIES, CONFIG_SPACE_SIZE};

/// Applies what a configuration write meant (BARs moved, decode switched, MSI-X enabled)
/// to the machine; called after the function's lock is released.
pub trait ApplyEffects: Send + Sync {
    /// `effects` of a write to function `function` (its index in the node).
    fn apply(&self, function: usize, effects: ConfigWriteEffects);
}

/// No function at this bus/device/function.
const ABSENT: u16 = u16::MAX;
/// First I/O port of the type-1 configuration mechanism (address register).
pub const CONFIG_IO_PORT: u16 = 0xcf8;
/// Ports it covers: the address register (0xcf8) and the data window (0xcfc-0xcff).
pub const CONFIG_IO_LEN: u64 = 8;

/// The functions of one PCI segment, by bus, device and function. Each function has its
/// own lock: a configuration access locks only the function it reaches.
pub struct PciSegment {
    /// Index into `functions` for each `bus << 8 | device << 3 | function`.
    index: Box<[u16; 65536]>,
    functions: Vec<Mutex<PciFunction>>,
    /// Weak: the sink (the device wiring) reaches the segment's buses; its owner keeps it.
    effects: OnceLock<Weak<dyn ApplyEffects>>,
}

impl PciSegment {
    /// The segment holding every function of `node`, with nothing behind them.
    pub fn new(node: &Node) -> Self {
        let functions = (0..node.functions.len()).map(|i| PciFunction::hollow(ConfigSpace::for_function(node, i)));
        PciSegment::with_functions(node, functions.collect())
    }

    /// The segment holding `functions`, one per function of `node`, in the node's order.
    pub fn with_functions(node: &Node, functions: Vec<PciFunction>) -> Self {
        let mut index = Box::new([ABSENT; 65536]);
        for (i, f) in node.functions.iter().enumerate() {
            let slot = usize::from(f.bdf.bus) << 8 | usize::from(f.bdf.device) << 3 | usize::from(f.bdf.function);
            index[slot] = i as u16;
        }
        PciSegment { index, functions: functions.into_iter().map(Mutex::new).collect(), effects: OnceLock::new() }
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

    /// Function `i` of the node.
    pub fn function(&self, i: usize) -> Option<&Mutex<PciFunction>> {
        self.functions.get(i)
    }

    /// Reads configuration space; an absent function reads as all-ones (no vendor).
    pub fn read(&self, bus: u8, devfn: u8, offset: usize, data: &mut [u8]) {
        match self.find(bus, devfn) {
            Some((_, f)) => lock(f).read(offset, data),
            None => data.fill(0xff),
        }
    }

    /// Writes configuration space (writes to absent functions are dropped), then applies
    /// what the write meant, with the function's lock released.
    pub fn write(&self, bus: u8, devfn: u8, offset: usize, data: &[u8]) {
        let Some((i, f)) = self.find(bus, devfn) else { return };
        let effects = lock(f).write(offset, data);
        if !effects.is_empty() {
            if let Some(sink) = self.effects.get().and_then(Weak::upgrade) {
                sink.apply(i, effects);
            }
        }
    }
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

/// The type-1 mechanism: a 32-bit address register at 0xcf8 (enable bit 31, bus 23:16,
/// device 15:11, function 10:8, register 7:2) and the data window at 0xcfc. A byte access
/// at 0xcf9 is the PC reset control register, handed to `reset`.
pub struct ConfigIo {
    segment: Arc<PciSegment>,
    address: u32,
    reset: Box<dyn BusDevice>,
}

impl ConfigIo {
    /// The mechanism over `segment`, with `reset` behind port 0xcf9.
    pub fn new(segment: Arc<PciSegment>, reset: Box<dyn BusDevice>) -> Self {
        ConfigIo { segment, address: 0, reset }
    }

    /// Bus, devfn and register the data window at `offset` (4 to 7) reaches, if enabled.
    fn target(&self, offset: u64, len: usize) -> Option<(u8, u8, usize)> {
        let byte = (offset - 4) as usize;
        (self.address & 0x8000_0000 != 0 && byte + len <= 4)
            .then(|| ((self.address >> 16) as u8, (self.address >> 8) as u8, (self.address & 0xfc) as usize + byte))
    }
}

impl BusDevice for ConfigIo {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        match (offset, data.len()) {
            (0, 4) => data.copy_from_slice(&self.address.to_le_bytes()),
            (1, 1) => self.reset.read(0, data),
            (4..=7, len) => match self.target(offset, len) {
                Some((bus, devfn, reg)) => self.segment.read(bus, devfn, reg, data),
                None => data.fill(0xff),
            },
            _ => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match (offset, data) {
            (0, &[a, b, c, d]) => self.address = u32::from_le_bytes([a, b, c, d]) & 0x80ff_fffc,
            (1, [_]) => self.reset.write(0, data),
            (4..=7, _) => {
                if let Some((bus, devfn, reg)) = self.target(offset, data.len()) {
                    self.segment.write(bus, devfn, reg, data);
                }
            }
            // Byte writes elsewhere (Linux writes 0x01 to 0xcfb while probing) do nothing.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests;
