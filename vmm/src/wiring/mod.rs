//! Device wiring: the devices behind the node's PCI functions (from each endpoint's
//! `backing`), and what their configuration writes mean for the machine. It places BARs
//! (trapped on the MMIO bus, or device memory in KVM memory slots), moves them when the
//! guest does, keeps the DMA space (guest RAM and every mapped BAR) in step, and connects
//! MSI-X. `machine.rs` only calls it.
//!
//! A BAR of an emulated or vfio-user device whose decode goes off (or that is being sized)
//! is parked, not removed: it stays
//! mapped where it was until the guest places it elsewhere, when it moves, or until
//! another BAR is placed over it, when it is evicted. Linux turns decode off around sizing
//! every BAR of every function at boot and puts the same address back; removing and
//! re-adding KVM memory slots each time cost exits and, nested, was seen to stall L1.
//! Cloud Hypervisor likewise moves BARs only on address writes. A passed-through device's
//! BARs are removed instead: vfio-pci revokes their mappings while decode is off.

mod absent;
mod bars;
mod emulator;
mod memslots;
mod msi;
mod msix;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gdrvm_devices::net::{self, WireSpec};
use gdrvm_devices::pci_regs::PCI_COMMAND;
use gdrvm_devices::vfio_user::{self, UserConnection, UserDeviceOps, UserDmaTarget};
use gdrvm_devices::virtio::VirtioNet;
use gdrvm_devices::{
    lock, BarInfo, BarMapping, Bus, ConfigOwnership, ConfigWriteEffects, DeviceId, DmaRegion, DmaSpace, DmaTarget,
    IoEvent, MsiCapability, MsiEvent, Owner, PciDevice,
};
use gdrvm_devices::{open_container, ConfigWrites, VfioDmaTarget, VfioOptions, VfioPciDevice};
use gdrvm_model::host_pci::HostPci;
use gdrvm_model::node::{Backing, Node};
use vm_memory::GuestMemoryMmap;

use crate::irq::{GsiRouter, IntxLine, IrqError};
use crate::pci::{ApplyEffects, Backend, ConfigSpace, PciFunction, PciSegment};
use bars::{split, BarTrap, LazyRun, LazySlots, LAZY_ABOVE};
use memslots::{DeviceMemory, MemorySlots};
use msi::MsiState;
use msix::MsixState;

pub use absent::NAME as ALL_ONES_NAME;
pub use emulator::{Emulator, EMU_DIR_ENV};
pub use memslots::{MemorySink, MemslotError};

/// KVM memory slots gdrvm may use (KVM offers at least 509 on x86).
const KVM_SLOTS: u32 = 509;
/// Of those, the most configuration images may take (one a function): the presets need
/// up to 45, and BARs (up to 256 touched chunks of large apertures) keep the rest.
const MAX_IMAGE_SLOTS: usize = 128;
/// Configuration registers of a passed-through function the VMM answers: the BARs (the
/// device's are host addresses) and the expansion ROM (none is offered).
const VMM_OWNED: [std::ops::Range<usize>; 2] = [0x10..0x28, 0x30..0x34];

/// Errors wiring devices; each names the function.
#[derive(Debug, thiserror::Error)]
pub enum WiringError {
    /// A backing cannot be opened.
    #[error("{function}: {reason}")]
    Backing {
        /// The function's key in the node file.
        function: String,
        /// Why.
        reason: String,
    },
    /// Device memory cannot be mapped.
    #[error("{function}: BAR {bar}: {source}")]
    Memory {
        /// The function's key.
        function: String,
        /// The BAR.
        bar: u8,
        /// Why.
        #[source]
        source: MemslotError,
    },
    /// Interrupt vectors cannot be set up.
    #[error("{function}: {source}")]
    Irq {
        /// The function's key.
        function: String,
        /// Why.
        #[source]
        source: IrqError,
    },
}

/// One BAR as the guest has placed it.
struct Placed {
    address: u64,
    /// Bytes it spans.
    size: u64,
    /// Decode is off (or the BAR is being sized) but it stays mapped where it was.
    parked: bool,
    traps: Vec<u64>,
    slots: Vec<(u32, u64)>,
    /// Long runs given to KVM a chunk at a time, and the slots they added.
    lazy: Vec<Arc<Mutex<LazySlots>>>,
    dma: Vec<u64>,
    /// Doorbells registered with KVM: index into [`Wired::ioevents`] and address.
    ioevents: Vec<(usize, u64)>,
}

/// A function with a device behind it. Fields drop in order: the device's mappings and
/// file handles before the device (VFIO cannot release a group whose files are open).
struct Wired {
    key: String,
    /// Its BARs are parked while decode is off (see the module's doc), rather than removed.
    parks: bool,
    id: DeviceId,
    placed: BTreeMap<u8, Placed>,
    memory: BTreeMap<u8, DeviceMemory>,
    bars: Vec<BarInfo>,
    msix: Option<Arc<MsixState>>,
    msi: Option<MsiState>,
    /// The device's doorbells, registered with KVM while their BAR is placed.
    ioevents: Vec<IoEvent>,
    /// The device's INTx line, connected while neither MSI nor MSI-X is on.
    intx: Option<IntxLine>,
    device: Arc<Mutex<dyn PciDevice>>,
}

impl Wired {
    /// Connects (or disconnects) the device's INTx line, if it has one.
    fn connect_intx(&self, on: bool) {
        let Some(line) = &self.intx else { return };
        let lines = on.then(|| (line.trigger(), line.resample()));
        if let Err(e) = lock(&self.device).connect_intx(lines) {
            tracing::warn!("{}: INTx: {e}", self.key);
        }
    }
}

/// The IOAPIC input that INTx `pin` (1 = INTA) of function `i` reaches: swizzled up
/// through every bridge to the root bus (as the PCI-to-PCI bridge spec and Linux do), then
/// routed as the host bridge's `_PRT` says.
fn intx_gsi(node: &Node, i: usize, pin: u8) -> u32 {
    let mut pin = pin.saturating_sub(1) % 4;
    let mut f = i;
    while let Some(parent) = node.functions[f].parent {
        pin = (pin + node.functions[f].bdf.device) % 4;
        f = parent;
    }
    crate::acpi::intx_gsi(node.functions[f].bdf.device, pin)
}

/// What wiring needs of the machine.
pub struct MachineParts {
    /// KVM's memory slots (the VM).
    pub memory: Arc<dyn MemorySink>,
    /// The MMIO bus the vCPUs dispatch on.
    pub mmio: Arc<Bus>,
    /// The GSI routing table's owner.
    pub irq: Arc<GsiRouter>,
}

/// The devices behind the node's functions.
pub struct DeviceWiring {
    parts: MachineParts,
    slots: Arc<MemorySlots>,
    dma: Mutex<DmaSpace>,
    wired: BTreeMap<usize, Mutex<Wired>>,
    /// The configuration images KVM maps.
    images: Mutex<Option<MappedImages>>,
    /// Emulator processes, stopped after the devices they serve are dropped.
    _emulators: Vec<Emulator>,
}

/// Configuration images given to KVM: their slots (with guest addresses), and the segment
/// that holds their memory, kept until the slots are gone; likewise the all-ones memory
/// over absent functions.
struct MappedImages {
    _segment: Arc<PciSegment>,
    slots: Vec<(u32, u64)>,
    /// Of `slots`, those of configuration images (the rest are absent functions').
    images: usize,
    _absent: Vec<absent::OnesMapping>,
}

/// One range of guest RAM, as the DMA space needs it.
pub struct GuestRamRegion {
    /// Guest-physical address.
    pub gpa: u64,
    /// Length in bytes.
    pub size: u64,
    /// Where the VMM has it mapped.
    pub host_addr: u64,
    /// The file behind it and the range's offset in it (the guest-RAM memfd).
    pub file: Option<(Arc<std::fs::File>, u64)>,
}

/// A device opened for a function: the device, and its DMA target (what it reaches of
/// guest memory), when it does DMA.
pub struct Opened {
    /// The device.
    pub device: Arc<Mutex<dyn PciDevice>>,
    /// Its DMA target (a VFIO container, a vfio-user server).
    pub dma: Option<Box<dyn DmaTarget>>,
    /// The emulator process serving it, when the VMM started one.
    pub process: Option<Emulator>,
}

/// Opens the device an endpoint's backing names (called from several threads at once).
pub type OpenBacking<'a> = dyn Fn(&Node, usize) -> Result<Option<Opened>, String> + Sync + 'a;

/// Opens the backing of every function of `node` with `open`, each on a thread of its own,
/// and returns what each gave, in the node's order. Opening waits on the device: a
/// vfio-user server answers a handshake and a request for each region and interrupt, one
/// round trip each between processes, and a VFIO device opens its group; one function
/// after another, those waits added up to most of a node's setup (nested, vela-a100's ten
/// emulated endpoints took half a second).
fn open_all(node: &Node, open: &OpenBacking<'_>) -> Vec<Result<Option<Opened>, String>> {
    /// A function's backing: opened here, or being opened on a thread.
    enum Opening<T> {
        Done(Result<Option<Opened>, String>),
        Thread(T),
    }
    std::thread::scope(|s| {
        let opening: Vec<_> = node
            .functions
            .iter()
            .enumerate()
            .map(|(i, f)| {
                if matches!(f.backing, Backing::None) {
                    return Opening::Done(Ok(None));
                }
                match std::thread::Builder::new().name(format!("open {i}")).spawn_scoped(s, move || open(node, i)) {
                    Ok(thread) => Opening::Thread(thread),
                    Err(e) => {
                        tracing::debug!("no thread to open function {i} on ({e}): opened here");
                        Opening::Done(open(node, i))
                    }
                }
            })
            .collect();
        opening
            .into_iter()
            .map(|o| match o {
                Opening::Done(opened) => opened,
                Opening::Thread(thread) => thread.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
            })
            .collect()
    })
}

/// Emulators started before any device is opened, so that their start-up (a process each
/// kind, reading the node) overlaps instead of adding up; [`open_backing`] takes them.
pub struct Prestarted(Mutex<BTreeMap<usize, (Emulator, std::os::unix::net::UnixStream)>>);

impl Prestarted {
    /// Starts the emulators of every function of `node` with an emulated backing.
    pub fn start(node: &Node) -> Result<Prestarted, WiringError> {
        let mut started = BTreeMap::new();
        for group in emulator::processes(node) {
            let shares = Emulator::start(node, &group).map_err(|reason| WiringError::Backing {
                function: group.iter().map(|&i| node.functions[i].key.as_str()).collect::<Vec<_>>().join(", "),
                reason,
            })?;
            started.extend(group.into_iter().zip(shares));
        }
        Ok(Prestarted(Mutex::new(started)))
    }
}

/// What opening backings needs beyond the node: the emulators already started, guest RAM
/// (virtio devices in the VMM reach it directly) and the wire each virtio-net NIC joins.
pub struct Backings {
    /// Emulators started ahead.
    pub prestarted: Prestarted,
    /// Guest RAM.
    pub memory: GuestMemoryMmap,
    /// Wires by endpoint name; a virtio-net endpoint not named has no link.
    pub wires: BTreeMap<String, WireSpec>,
}

/// Opens the backing of function `i` of `node`: for `vfio:<BDF>`, the host device in a
/// VFIO container of its own (its DMA target); for `vfio-user:<socket>`, the server
/// listening there; for an emulated backing, its emulator (prestarted, or started now);
/// for `virtio-net`, the device in the VMM on its wire.
pub fn open_backing(backings: &Backings, node: &Node, i: usize) -> Result<Option<Opened>, String> {
    let f = &node.functions[i];
    match &f.backing {
        Backing::None => Ok(None),
        Backing::Vfio(bdf) => open_vfio(node, *bdf).map(Some),
        Backing::VfioUser(socket) => {
            let conn = vfio_user::connect(&f.key, socket, vfio_user::DEFAULT_TIMEOUT).map_err(|e| e.to_string())?;
            open_vfio_user(&f.key, conn, None).map(Some)
        }
        Backing::EmulatedGpu | Backing::EmulatedNic => {
            let (emulator, stream) = match lock(&backings.prestarted.0).remove(&i) {
                Some(started) => started,
                None => Emulator::start(node, &[i])?.pop().ok_or("no emulator started (a wiring bug)")?,
            };
            let conn = UserConnection::new(&f.key, stream, vfio_user::DEFAULT_TIMEOUT).map_err(|e| e.to_string())?;
            open_vfio_user(&f.key, conn, Some(emulator)).map(Some)
        }
        Backing::VirtioNet => {
            let params = f.net.ok_or_else(|| "virtio-net without MAC and MTU (a model bug)".to_owned())?;
            let port = match backings.wires.get(&f.name) {
                Some(spec) => Some(net::open(spec, params.mac).map_err(|e| format!("wire {spec}: {e}"))?),
                None => None,
            };
            let device =
                VirtioNet::new(&f.key, ConfigSpace::for_function(node, i), params, backings.memory.clone(), port)
                    .map_err(|e| format!("virtio-net: {e}"))?;
            Ok(Some(Opened { device: Arc::new(Mutex::new(device)), dma: None, process: None }))
        }
    }
}

/// Host function `bdf` in a VFIO container of its own.
fn open_vfio(node: &Node, bdf: gdrvm_model::host_pci::HostBdf) -> Result<Opened, String> {
    let passed_through = node
        .functions
        .iter()
        .filter_map(|f| match f.backing {
            Backing::Vfio(b) => Some(b),
            _ => None,
        })
        .collect();
    let options = VfioOptions { config_writes: ConfigWrites::Filtered, passed_through };
    let container = open_container(None).map_err(|e| e.to_string())?;
    let device = VfioPciDevice::open(&HostPci::default(), bdf, &container, &options).map_err(|e| e.to_string())?;
    // SAFETY: the DMA space maps only guest RAM, which outlives the devices (the machine
    // drops the wiring first), and BAR mappings the wiring keeps until it has removed their
    // regions; the guest and devices touch both only through the hardware, never through
    // Rust references.
    let dma = unsafe { VfioDmaTarget::new(container) };
    Ok(Opened { device: Arc::new(Mutex::new(device)), dma: Some(Box::new(dma)), process: None })
}

/// The device behind vfio-user connection `conn`, served by `process` when the VMM
/// started it. It goes through the same firewall and interrupt emulation as VFIO; its DMA
/// target maps guest RAM and peers' BARs into the server by their files.
fn open_vfio_user(key: &str, conn: Arc<UserConnection>, process: Option<Emulator>) -> Result<Opened, String> {
    let ops = UserDeviceOps::new(conn.clone()).map_err(|e| e.to_string())?;
    let device = VfioPciDevice::new(key, Box::new(ops), ConfigWrites::Filtered).map_err(|e| e.to_string())?;
    let dma = UserDmaTarget::new(conn);
    Ok(Opened { device: Arc::new(Mutex::new(device)), dma: Some(Box::new(dma)), process })
}

impl DeviceWiring {
    /// Opens every function's backing with `open` and returns the wiring and the functions
    /// of the PCI segment, in the node's order. Guest RAM is the DMA space's first content.
    pub fn new(
        node: &Node,
        parts: MachineParts,
        ram: &[GuestRamRegion],
        open: &OpenBacking<'_>,
    ) -> Result<(Arc<DeviceWiring>, Vec<PciFunction>), WiringError> {
        let mut dma = DmaSpace::new();
        for r in ram {
            let (gpa, size) = (r.gpa, r.size);
            let region = DmaRegion { iova: gpa, size, host_addr: r.host_addr, fd: r.file.clone(), owner: None };
            if let Err(e) = dma.add_region(region) {
                tracing::warn!("DMA space: guest RAM at {gpa:#x}: {e}");
            }
        }
        let mut functions = Vec::with_capacity(node.functions.len());
        let mut wired = BTreeMap::new();
        let mut emulators = Vec::new();
        for ((i, f), opened) in node.functions.iter().enumerate().zip(open_all(node, open)) {
            let opened = opened.map_err(|reason| WiringError::Backing { function: f.key.clone(), reason })?;
            let Some(Opened { device, dma: target, process }) = opened else {
                functions.push(PciFunction::hollow(ConfigSpace::for_function(node, i)));
                continue;
            };
            let id = DeviceId(i as u32);
            if let Some(target) = target {
                // Peer-to-peer as the node allows it (on unless it or the host bridge
                // says `p2p = false`).
                dma.add_target(id, target, node.p2p(i))
                    .map_err(|e| WiringError::Backing { function: f.key.clone(), reason: format!("DMA: {e}") })?;
            }
            emulators.extend(process);
            let (function, w) = wire_device(node, i, device, &parts.irq)?;
            functions.push(function);
            wired.insert(i, Mutex::new(w));
        }
        let slots = Arc::new(MemorySlots::new(parts.memory.clone(), KVM_SLOTS));
        let wiring =
            DeviceWiring { parts, slots, dma: Mutex::new(dma), wired, images: Mutex::new(None), _emulators: emulators };
        Ok((Arc::new(wiring), functions))
    }

    /// Resets every device and connects its INTx line. Decode stays off, as firmware that
    /// assigned the BARs but has no driver for the device leaves it (see
    /// [`gdrvm_devices::ConfigSpace::for_function`]): the guest's driver turns it on, and
    /// the BARs are mapped then.
    ///
    /// Each device starts on a thread of its own: every step waits on the device (a
    /// request to its server; for a passed-through GPU, a reset that can take a tenth of a
    /// second), and one device after another they add up.
    pub fn start(&self, pci: &PciSegment) {
        let start_one = |i: usize, w: &Mutex<Wired>| {
            let reset = {
                let w = lock(w);
                let result = lock(&w.device).reset();
                result.map_err(|e| format!("{}: {e}", w.key))
            };
            if let Err(e) = reset {
                tracing::warn!("{e}");
            }
            pci.refresh_image(i);
            lock(w).connect_intx(true);
        };
        std::thread::scope(|s| {
            for (&i, w) in &self.wired {
                let spawned =
                    std::thread::Builder::new().name(format!("start {i}")).spawn_scoped(s, move || start_one(i, w));
                if let Err(e) = spawned {
                    tracing::debug!("no thread to start function {i} on ({e}): started here");
                    start_one(i, w);
                }
            }
        });
    }

    /// Maps `pci`'s configuration images read-only over their functions' ECAM pages
    /// (ECAM at `ecam_base`), so that the guest reads those functions without an exit,
    /// then all-ones over its runs of absent functions ([`absent`]); at most
    /// `MAX_IMAGE_SLOTS` slots in all, so that BARs keep most of KVM's slots. A page KVM
    /// refuses, or one past the limit, is left to exit on reads too, with a warning (an
    /// absent run with a debug line). Once only.
    pub fn map_config_images(&self, pci: &Arc<PciSegment>, ecam_base: u64) {
        let mut images = lock(&self.images);
        if images.is_some() {
            tracing::warn!("configuration images are mapped already");
            return;
        }
        let pages = pci.images().pages();
        if pages.len() > MAX_IMAGE_SLOTS {
            tracing::warn!(
                "{} functions could be imaged, {MAX_IMAGE_SLOTS} are: the others' configuration reads exit",
                pages.len()
            );
        }
        let mut slots = Vec::new();
        for page in pages.into_iter().take(MAX_IMAGE_SLOTS) {
            let gpa = ecam_base + page.ecam_offset;
            let len = gdrvm_devices::CONFIG_SPACE_SIZE as u64;
            match self.slots.add_readonly(gpa, page.host_addr, len) {
                Ok(slot) => slots.push((slot, gpa)),
                Err(e) => tracing::warn!("configuration image at {gpa:#x}: {e}; its reads exit"),
            }
        }
        let mapped_images = slots.len();
        let absent = self.map_absent(pci.absent_ranges(), ecam_base, MAX_IMAGE_SLOTS - mapped_images, &mut slots);
        *images = Some(MappedImages { _segment: pci.clone(), slots, images: mapped_images, _absent: absent });
    }

    /// Maps all-ones read-only over the absent functions' ECAM `ranges` (offsets from
    /// `ecam_base`), at most `budget` of them, adding their slots to `slots`; returns the
    /// mappings, to be kept until those slots are removed.
    fn map_absent(
        &self,
        ranges: &[std::ops::Range<u64>],
        ecam_base: u64,
        budget: usize,
        slots: &mut Vec<(u32, u64)>,
    ) -> Vec<absent::OnesMapping> {
        if ranges.is_empty() {
            return Vec::new();
        }
        let ones = match absent::AllOnes::new() {
            Ok(ones) => ones,
            Err(e) => {
                tracing::warn!("no all-ones memory for absent functions ({e}): reads of them exit");
                return Vec::new();
            }
        };
        let mut mapped = Vec::new();
        for r in ranges.iter().take(budget) {
            let (gpa, len) = (ecam_base + r.start, r.end - r.start);
            let memory = match usize::try_from(len).map_err(std::io::Error::other).and_then(|n| ones.map(n)) {
                Ok(memory) => memory,
                Err(e) => {
                    tracing::debug!("absent functions at {gpa:#x}: cannot map all-ones ({e}); their reads exit");
                    continue;
                }
            };
            match self.slots.add_readonly(gpa, memory.host_addr(), len) {
                Ok(slot) => {
                    slots.push((slot, gpa));
                    mapped.push(memory);
                }
                Err(e) => tracing::debug!("absent functions at {gpa:#x}: {e}; their reads exit"),
            }
        }
        tracing::debug!(
            "{} of {} runs of absent functions read as all-ones without an exit",
            mapped.len(),
            ranges.len()
        );
        mapped
    }

    /// Configuration images KVM maps.
    pub fn config_images(&self) -> usize {
        lock(&self.images).as_ref().map_or(0, |m| m.images)
    }

    /// Configuration writes the devices' firewalls dropped, over all devices.
    pub fn dropped_config_writes(&self) -> u64 {
        self.wired.values().map(|w| lock(&lock(w).device).dropped_config_writes()).sum()
    }

    /// The DMA space, for DMA targets (a VFIO container) to join.
    pub fn dma(&self) -> &Mutex<DmaSpace> {
        &self.dma
    }

    /// Resets every device (before the guest starts and after it stops).
    pub fn reset_devices(&self) {
        for w in self.wired.values() {
            let w = lock(w);
            let result = lock(&w.device).reset();
            if let Err(e) = result {
                tracing::warn!("{}: {e}", w.key);
            }
        }
    }

    /// Places BAR `index` of `w` at `address`, unless that overlaps what the platform
    /// decodes itself (ECAM, the APICs): there the BAR is not reached, as on hardware.
    fn place(&self, w: &mut Wired, index: u8, address: u64) {
        let Some(bar) = w.bars.iter().find(|b| b.index == index).cloned() else { return };
        if gdrvm_model::layout::overlaps_platform(address, bar.size) {
            tracing::warn!(
                "{}: BAR {index} at {address:#x} overlaps the platform's ECAM or APICs: not decoded there",
                w.key
            );
            return;
        }
        let mut placed = Placed {
            address,
            size: bar.size,
            parked: false,
            traps: Vec::new(),
            slots: Vec::new(),
            lazy: Vec::new(),
            dma: Vec::new(),
            ioevents: Vec::new(),
        };
        let mut holes = match &bar.mapping {
            BarMapping::Mapped { holes, .. } => holes.clone(),
            BarMapping::Trapped => std::iter::once(0..bar.size).collect(),
        };
        if let Some(m) = &w.msix {
            for (b, start, len) in
                [(m.layout.table.0, m.layout.table.1, m.table_len()), (m.layout.pba.0, m.layout.pba.1, m.pba_len())]
            {
                if b == index {
                    holes.push(start..start + len);
                }
            }
        }
        let memory = w.memory.get(&index);
        for (trapped, run) in split(bar.size, &holes) {
            let gpa = address + run.start;
            let len = run.end - run.start;
            match (trapped, memory) {
                (false, Some(mem)) if len > LAZY_ABOVE => {
                    let given = Arc::new(Mutex::new(LazySlots::default()));
                    let lazy = LazyRun {
                        gpa,
                        host: mem.host_addr(run.start),
                        len,
                        chunk: LazyRun::chunk_for(len),
                        slots: self.slots.clone(),
                        given: given.clone(),
                    };
                    match self.parts.mmio.insert(Arc::new(Mutex::new(lazy)), gpa, len) {
                        Ok(()) => {
                            placed.traps.push(gpa);
                            placed.lazy.push(given);
                        }
                        Err(e) => tracing::warn!("{}: BAR {index} at {gpa:#x}: {e}", w.key),
                    }
                    self.add_dma(w, index, mem.dma_region(run.start, gpa, len, w.id), &mut placed);
                }
                (false, Some(mem)) => match self.slots.add(gpa, mem.host_addr(run.start), len) {
                    Ok(slot) => {
                        placed.slots.push((slot, gpa));
                        self.add_dma(w, index, mem.dma_region(run.start, gpa, len, w.id), &mut placed);
                    }
                    Err(e) => tracing::warn!("{}: BAR {index}: {e}", w.key),
                },
                _ => {
                    let trap = BarTrap { device: w.device.clone(), bar: index, start: run.start, msix: w.msix.clone() };
                    match self.parts.mmio.insert(Arc::new(Mutex::new(trap)), gpa, len) {
                        Ok(()) => placed.traps.push(gpa),
                        Err(e) => tracing::warn!("{}: BAR {index} at {gpa:#x}: {e}", w.key),
                    }
                }
            }
        }
        for (n, event) in w.ioevents.iter().enumerate().filter(|(_, e)| e.bar == index && e.offset < bar.size) {
            let gpa = address + event.offset;
            match self.parts.memory.ioevent(&event.fd, gpa, true) {
                Ok(()) => placed.ioevents.push((n, gpa)),
                // The trap still takes the write, an exit each.
                Err(e) => tracing::warn!("{}: BAR {index}: doorbell at {gpa:#x}: {e}", w.key),
            }
        }
        tracing::debug!(function = %w.key, bar = index, address = format_args!("{address:#x}"), "BAR placed");
        w.placed.insert(index, placed);
    }

    /// Puts `region` of `w`'s BAR `index` into the DMA space: peers reach it by DMA.
    fn add_dma(&self, w: &Wired, index: u8, region: DmaRegion, placed: &mut Placed) {
        let gpa = region.iova;
        match lock(&self.dma).add_region(region) {
            Ok(()) => placed.dma.push(gpa),
            Err(e) => tracing::warn!("{}: BAR {index} at {gpa:#x}: DMA space: {e}", w.key),
        }
    }

    /// Removes other functions' parked BARs overlapping `[address, address + size)`, so a
    /// BAR the guest places there finds the room free. A function another vCPU is
    /// configuring right now is skipped (its lock is not waited for: functions lock one at
    /// a time); its parked BAR then makes this placement fail, logged.
    fn evict_parked(&self, placing: usize, address: u64, size: u64) {
        let end = address.saturating_add(size);
        for (&i, other) in self.wired.iter().filter(|(&i, _)| i != placing) {
            let Ok(mut o) = other.try_lock() else { continue };
            let evict: Vec<u8> = o
                .placed
                .iter()
                .filter(|(_, p)| p.parked && p.address < end && address < p.address.saturating_add(p.size))
                .map(|(&index, _)| index)
                .collect();
            for index in evict {
                tracing::debug!(function = i, bar = index, "parked BAR evicted by a placement over it");
                self.unplace(&mut o, index);
            }
        }
    }

    /// Removes BAR `index` of `w` from the guest.
    fn unplace(&self, w: &mut Wired, index: u8) {
        let Some(placed) = w.placed.remove(&index) else { return };
        for (n, gpa) in placed.ioevents {
            if let Some(event) = w.ioevents.get(n) {
                if let Err(e) = self.parts.memory.ioevent(&event.fd, gpa, false) {
                    tracing::warn!("{}: BAR {index}: doorbell at {gpa:#x}: {e}", w.key);
                }
            }
        }
        for gpa in placed.dma {
            if let Err(e) = lock(&self.dma).remove_region(Some(w.id), gpa) {
                tracing::warn!("{}: BAR {index}: DMA space: {e}", w.key);
            }
        }
        // The traps go first, so no access adds a slot to a run being removed.
        for base in &placed.traps {
            if let Err(e) = self.parts.mmio.remove(*base) {
                tracing::warn!("{}: BAR {index}: {e}", w.key);
            }
        }
        let lazy = placed.lazy.iter().flat_map(|given| {
            let mut given = lock(given);
            given.closed = true;
            std::mem::take(&mut given.slots).into_values().collect::<Vec<_>>()
        });
        for (slot, gpa) in placed.slots.into_iter().chain(lazy.collect::<Vec<_>>()) {
            if let Err(e) = self.slots.remove(slot, gpa) {
                tracing::warn!("{}: BAR {index}: {e}", w.key);
            }
        }
        tracing::debug!(function = %w.key, bar = index, address = format_args!("{:#x}", placed.address), "BAR removed");
    }
}

/// Function `i` of `node` with `device` behind it: its configuration space split between
/// the VMM and the device, BAR mappings, and interrupts (MSI-X, MSI, INTx) on `irq`.
fn wire_device(
    node: &Node,
    i: usize,
    device: Arc<Mutex<dyn PciDevice>>,
    irq: &Arc<GsiRouter>,
) -> Result<(PciFunction, Wired), WiringError> {
    let f = &node.functions[i];
    let (mut bars, layout, msi_info, pin, ioevents) = {
        let d = lock(&device);
        (d.bars(), d.msix(), d.msi(), d.intx_pin(), d.ioeventfds())
    };
    if f.trap_bars {
        for bar in &mut bars {
            bar.mapping = BarMapping::Trapped;
        }
    }
    let mut ownership = ConfigOwnership::new(Owner::Device);
    for regs in VMM_OWNED {
        ownership.assign(regs, Owner::Vmm);
    }
    // gdrvm's own emulators leave decode to the VMM: it keeps their Command register and
    // tells them of the other bits' changes (`PciFunction::write`).
    let emulated = emulator::program(&f.backing).is_some();
    if emulated {
        ownership.assign(PCI_COMMAND..PCI_COMMAND + 2, Owner::Vmm);
    }
    let msix = layout
        .map(|l| MsixState::new(l, device.clone(), irq.clone()).map(Arc::new))
        .transpose()
        .map_err(|source| WiringError::Irq { function: f.key.clone(), source })?;
    let mut memory = BTreeMap::new();
    for bar in &bars {
        if let BarMapping::Mapped { fd, offset, .. } = &bar.mapping {
            let mem = DeviceMemory::map(fd, *offset, bar.size).map_err(|source| WiringError::Memory {
                function: f.key.clone(),
                bar: bar.index,
                source,
            })?;
            memory.insert(bar.index, mem);
        }
    }
    // MSI is the VMM's: it answers the capability and connects the vectors.
    let emulated_msi = msi_info.map(|info| {
        let mut next = [0u8];
        lock(&device).config_read(info.cap + 1, &mut next);
        let cap = MsiCapability::new(info.vectors, info.is_64bit, info.per_vector_mask, next[0]);
        ownership.assign(info.cap..info.cap + cap.len(), Owner::Vmm);
        (info.cap, cap)
    });
    let msi = msi_info
        .map(|info| MsiState::new(info.vectors, device.clone(), irq.clone()))
        .transpose()
        .map_err(|source| WiringError::Irq { function: f.key.clone(), source })?;
    let backend = Backend {
        device: device.clone(),
        ownership,
        bars: bars.clone(),
        msix_cap: layout.map(|l| l.cap),
        msi: emulated_msi,
        config_follows_writes: emulated,
    };
    let function = PciFunction::backed(ConfigSpace::for_passthrough(node, i, backend.msix_cap), backend);
    let intx = pin
        .filter(|p| (1..=4).contains(p))
        .map(|p| IntxLine::new(irq.clone(), intx_gsi(node, i, p)))
        .transpose()
        .map_err(|source| WiringError::Irq { function: f.key.clone(), source })?;
    let w = Wired {
        key: f.key.clone(),
        // vfio-pci revokes a device's BAR mappings while its decode is off (an access then
        // faults, and KVM_RUN fails with EFAULT): a passed-through device's BARs must go.
        parks: !matches!(f.backing, Backing::Vfio(_)),
        id: DeviceId(i as u32),
        placed: BTreeMap::new(),
        memory,
        bars,
        msix,
        msi,
        ioevents,
        intx,
        device,
    };
    Ok((function, w))
}

impl ApplyEffects for DeviceWiring {
    fn apply(&self, function: usize, effects: ConfigWriteEffects) {
        let Some(w) = self.wired.get(&function) else { return };
        let mut w = lock(w);
        for change in &effects.bars {
            let Some(to) = change.to else {
                // Decode off, or the BAR being sized: parked where it is, or removed.
                if !w.parks {
                    self.unplace(&mut w, change.index);
                } else if let Some(p) = w.placed.get_mut(&change.index) {
                    p.parked = true;
                }
                continue;
            };
            match w.placed.get_mut(&change.index) {
                Some(p) if p.address == to => p.parked = false,
                _ => {
                    self.unplace(&mut w, change.index);
                    let size = w.bars.iter().find(|b| b.index == change.index).map_or(0, |b| b.size);
                    self.evict_parked(function, to, size);
                    self.place(&mut w, change.index, to);
                }
            }
        }
        // One interrupt mode at a time: INTx off before MSI or MSI-X goes on, and on again
        // once they are off.
        let msi_on = effects.msi.iter().any(|e| matches!(e, MsiEvent::Enable { .. }));
        let msi_off = effects.msi.iter().any(|e| matches!(e, MsiEvent::Disable));
        if effects.msix.is_some_and(|c| c.enabled) || msi_on {
            w.connect_intx(false);
        }
        if let (Some(control), Some(m)) = (effects.msix, &w.msix) {
            m.control(control);
        }
        if let (false, Some(m)) = (effects.msi.is_empty(), &w.msi) {
            m.apply(&effects.msi);
        }
        if effects.msix.is_some_and(|c| !c.enabled) || msi_off {
            w.connect_intx(true);
        }
        if effects.reset {
            if let Some(m) = &w.msix {
                m.reset();
            }
            if let Some(m) = &w.msi {
                m.reset();
            }
        }
    }
}

impl Drop for DeviceWiring {
    fn drop(&mut self) {
        // The images' slots go before the segment holding their memory can.
        if let Some(images) = lock(&self.images).take() {
            for (slot, gpa) in images.slots {
                if let Err(e) = self.slots.remove(slot, gpa) {
                    tracing::warn!("configuration image at {gpa:#x}: {e}");
                }
            }
        }
        for w in self.wired.values() {
            let mut w = lock(w);
            let placed: Vec<u8> = w.placed.keys().copied().collect();
            for index in placed {
                self.unplace(&mut w, index);
            }
        }
        self.reset_devices();
    }
}

#[cfg(test)]
mod tests;
