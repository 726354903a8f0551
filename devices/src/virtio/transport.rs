//! The virtio 1.x PCI transport ("modern" virtio over PCI, virtio 1.2 section 4.1): the
//! vendor capabilities that tell a driver where the virtio structures are in BAR 0, the
//! common configuration structure (feature negotiation, device status, queue setup), the
//! ISR status byte, the queue doorbells, and the interrupts a device raises.
//!
//! BAR 0 (32 KiB, trapped) is laid out as the shared contract says; drivers find the parts
//! from the capabilities alone:
//!
//! | offset   | what                                             |
//! |----------|--------------------------------------------------|
//! | `0x0000` | MSI-X table (the VMM emulates it)                |
//! | `0x0100` | MSI-X pending bits (the VMM's)                   |
//! | `0x1000` | common configuration ([`COMMON_CFG`])            |
//! | `0x2000` | ISR status ([`ISR_CFG`])                         |
//! | `0x3000` | device configuration ([`DEVICE_CFG`])            |
//! | `0x4000` | doorbells, queue `q` at `0x4000 + 4 * q` ([`NOTIFY_CFG`]) |
//!
//! Written by hand: rust-vmm's virtio crates stop at queues; Cloud Hypervisor's and
//! Firecracker's transports are tied to their device managers. Every register takes any
//! access size and value: an access is split over the fields it covers, each field
//! updated as if the bytes the access leaves out were written with their current value.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::emu::LogOnce;
use crate::pci::regs::PCI_CAP_ID_VNDR;
use crate::{lock, ConfigSpace};

/// The BAR holding every virtio structure.
pub const VIRTIO_BAR: u8 = 0;
/// Size of that BAR.
pub const VIRTIO_BAR_SIZE: u64 = 32 << 10;
/// Offset of the common configuration structure in the BAR.
pub const COMMON_CFG: u64 = 0x1000;
/// Bytes of the common configuration structure (the virtio 1.0 layout, up to
/// `queue_device`).
pub const COMMON_CFG_LEN: u32 = 56;
/// Offset of the ISR status byte in the BAR.
pub const ISR_CFG: u64 = 0x2000;
/// Bytes of the ISR status region.
pub const ISR_CFG_LEN: u32 = 1;
/// Offset of the device-specific configuration in the BAR.
pub const DEVICE_CFG: u64 = 0x3000;
/// Offset of the doorbells in the BAR.
pub const NOTIFY_CFG: u64 = 0x4000;
/// Bytes between two queues' doorbells (`notify_off_multiplier`).
pub const NOTIFY_OFF_MULTIPLIER: u32 = 4;
/// The MSI-X vector number meaning "no vector" (`VIRTIO_MSI_NO_VECTOR`).
pub const NO_VECTOR: u16 = 0xffff;
/// Entries per queue the device offers (the driver may choose fewer, a power of two).
pub const QUEUE_MAX_SIZE: u16 = 256;

/// `cfg_type` of the common configuration capability.
pub const CAP_COMMON_CFG: u8 = 1;
/// `cfg_type` of the notification capability.
pub const CAP_NOTIFY_CFG: u8 = 2;
/// `cfg_type` of the ISR capability.
pub const CAP_ISR_CFG: u8 = 3;
/// `cfg_type` of the device configuration capability.
pub const CAP_DEVICE_CFG: u8 = 4;
/// `cfg_type` of the PCI configuration access capability.
pub const CAP_PCI_CFG: u8 = 5;

/// Bytes of `struct virtio_pci_cap`.
const CAP_LEN: usize = 16;
/// Offset of `pci_cfg_data` in the PCI configuration access capability.
pub(crate) const PCI_CFG_DATA: usize = 16;

/// ISR bit: a queue has used buffers.
const ISR_QUEUE: u8 = 1;
/// ISR bit: the device configuration (or status) changed.
const ISR_CONFIG: u8 = 2;

/// Device status bits as the register holds them.
const DRIVER_OK: u8 = VIRTIO_CONFIG_S_DRIVER_OK as u8;
const FEATURES_OK: u8 = VIRTIO_CONFIG_S_FEATURES_OK as u8;
const FAILED: u8 = VIRTIO_CONFIG_S_FAILED as u8;
const NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;

/// Fields of the common configuration structure: offset and size.
const FIELDS: [(u64, usize); 16] = [
    (0, 4),  // device_feature_select
    (4, 4),  // device_feature
    (8, 4),  // driver_feature_select
    (12, 4), // driver_feature
    (16, 2), // config_msix_vector
    (18, 2), // num_queues
    (20, 1), // device_status
    (21, 1), // config_generation
    (22, 2), // queue_select
    (24, 2), // queue_size
    (26, 2), // queue_msix_vector
    (28, 2), // queue_enable
    (30, 2), // queue_notify_off
    (32, 8), // queue_desc
    (40, 8), // queue_driver
    (48, 8), // queue_device
];

/// Where the virtio capabilities sit in configuration space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// The common configuration capability.
    pub common: usize,
    /// The notification capability.
    pub notify: usize,
    /// The ISR capability.
    pub isr: usize,
    /// The device configuration capability.
    pub device: usize,
    /// The PCI configuration access capability.
    pub pci_cfg: usize,
}

/// One `struct virtio_pci_cap` for BAR 0, followed by `extra`.
fn vendor_cap(cfg_type: u8, offset: u64, length: u32, extra: &[u8]) -> Vec<u8> {
    let mut cap = vec![PCI_CAP_ID_VNDR, 0, (CAP_LEN + extra.len()) as u8, cfg_type, VIRTIO_BAR, 0, 0, 0];
    cap.extend_from_slice(&(offset as u32).to_le_bytes());
    cap.extend_from_slice(&length.to_le_bytes());
    cap.extend_from_slice(extra);
    cap
}

/// Appends the virtio capabilities to `config`'s list: common, notify (`queues` doorbells),
/// ISR, device configuration (`device_cfg_len` bytes), and the PCI configuration access
/// capability (its `bar`, `offset` and `length` writable). `None` when they do not fit.
pub fn add_capabilities(config: &mut ConfigSpace, device_cfg_len: u32, queues: u16) -> Option<Capabilities> {
    let common = config.append_capability(&vendor_cap(CAP_COMMON_CFG, COMMON_CFG, COMMON_CFG_LEN, &[]), &[])?;
    let notify_len = u32::from(queues) * NOTIFY_OFF_MULTIPLIER;
    let notify = config.append_capability(
        &vendor_cap(CAP_NOTIFY_CFG, NOTIFY_CFG, notify_len, &NOTIFY_OFF_MULTIPLIER.to_le_bytes()),
        &[],
    )?;
    let isr = config.append_capability(&vendor_cap(CAP_ISR_CFG, ISR_CFG, ISR_CFG_LEN, &[]), &[])?;
    let device = config.append_capability(&vendor_cap(CAP_DEVICE_CFG, DEVICE_CFG, device_cfg_len, &[]), &[])?;
    // bar (byte 4), offset (8..12) and length (12..16) are the driver's to set.
    let writable = [0, 0, 0, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
    let pci_cfg = config.append_capability(&vendor_cap(CAP_PCI_CFG, 0, 0, &[0; 4]), &writable)?;
    Some(Capabilities { common, notify, isr, device, pci_cfg })
}

/// The interrupts a virtio device raises and the state behind them, shared between the
/// register interface and the device's worker: MSI-X vector numbers the driver assigned,
/// the ISR status, DEVICE_NEEDS_RESET, and the MSI-X eventfds the VMM connected.
pub struct Interrupts {
    key: String,
    vectors: u16,
    config_vector: AtomicU16,
    queue_vectors: Box<[AtomicU16]>,
    isr: AtomicU8,
    needs_reset: AtomicBool,
    msix: Mutex<Vec<EventFd>>,
    odd: LogOnce,
}

impl Interrupts {
    /// Interrupts of device `key` with `queues` queues and an MSI-X table of `vectors`.
    pub fn new(key: &str, queues: u16, vectors: u16) -> Self {
        Interrupts {
            key: key.to_owned(),
            vectors,
            config_vector: AtomicU16::new(NO_VECTOR),
            queue_vectors: (0..queues).map(|_| AtomicU16::new(NO_VECTOR)).collect(),
            isr: AtomicU8::new(0),
            needs_reset: AtomicBool::new(false),
            msix: Mutex::new(Vec::new()),
            odd: LogOnce::default(),
        }
    }

    /// Connects the MSI-X vectors (index = vector number), or disconnects them.
    pub fn connect(&self, fds: Vec<EventFd>) {
        *lock(&self.msix) = fds;
    }

    /// Queue `q` has used buffers for the driver.
    pub fn queue(&self, q: usize) {
        self.isr.fetch_or(ISR_QUEUE, Ordering::AcqRel);
        let vector = self.queue_vectors.get(q).map_or(NO_VECTOR, |v| v.load(Ordering::Acquire));
        self.signal(vector);
    }

    /// The device configuration or status changed.
    pub fn config_changed(&self) {
        self.isr.fetch_or(ISR_CONFIG, Ordering::AcqRel);
        self.signal(self.config_vector.load(Ordering::Acquire));
    }

    /// Sets DEVICE_NEEDS_RESET and tells the driver (once until the next reset).
    pub fn set_needs_reset(&self) {
        if !self.needs_reset.swap(true, Ordering::AcqRel) {
            self.config_changed();
        }
    }

    /// Whether DEVICE_NEEDS_RESET is set.
    pub fn needs_reset(&self) -> bool {
        self.needs_reset.load(Ordering::Acquire)
    }

    /// Reads and clears the ISR status.
    fn take_isr(&self) -> u8 {
        self.isr.swap(0, Ordering::AcqRel)
    }

    /// Writes the eventfd of MSI-X `vector`. Without MSI-X connected the interrupt stays in
    /// the ISR status alone (the function has no INTx).
    fn signal(&self, vector: u16) {
        if vector == NO_VECTOR {
            return;
        }
        let fds = lock(&self.msix);
        if fds.is_empty() {
            return;
        }
        match fds.get(usize::from(vector)) {
            Some(fd) => {
                if let Err(e) = fd.write(1) {
                    if self.odd.first("MSI-X eventfd write failed", u64::from(vector)) {
                        tracing::warn!(device = %self.key, vector, "MSI-X eventfd write failed: {e} (logged once)");
                    }
                }
            }
            None => {
                if self.odd.first("interrupt on a vector that is not connected", u64::from(vector)) {
                    tracing::warn!(device = %self.key, vector, connected = fds.len(), "interrupt on an MSI-X vector that is not connected dropped (logged once)");
                }
            }
        }
    }

    /// `vector` if the function's MSI-X table has it, else [`NO_VECTOR`] (the driver reads
    /// that back and knows the assignment failed).
    fn checked_vector(&self, vector: u16) -> u16 {
        if vector == NO_VECTOR || vector < self.vectors {
            return vector;
        }
        if self.odd.first("MSI-X vector beyond the table", u64::from(vector)) {
            tracing::warn!(device = %self.key, vector, vectors = self.vectors, "driver assigned an MSI-X vector the function lacks; reads back as none (logged once)");
        }
        NO_VECTOR
    }

    fn reset(&self) {
        self.config_vector.store(NO_VECTOR, Ordering::Release);
        for v in self.queue_vectors.iter() {
            v.store(NO_VECTOR, Ordering::Release);
        }
        self.isr.store(0, Ordering::Release);
        self.needs_reset.store(false, Ordering::Release);
    }
}

/// A queue as the driver configured it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct QueueConfig {
    size: u16,
    enabled: bool,
    desc: u64,
    driver: u64,
    device: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig { size: QUEUE_MAX_SIZE, enabled: false, desc: 0, driver: 0, device: 0 }
    }
}

/// What the device must do after a write to the common configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Nothing beyond the register change.
    None,
    /// The driver wrote 0 to device_status: stop the device, then [`Transport::reset`].
    Reset,
    /// DRIVER_OK is set with features accepted: start processing the queues.
    Start,
    /// The device must stop processing (FAILED set, DRIVER_OK cleared).
    Stop,
}

/// The transport state of one virtio PCI function: everything in the common
/// configuration, the doorbells, and the interrupts.
pub struct Transport {
    key: String,
    device_features: u64,
    driver_features: u64,
    /// The driver wrote feature bits in words the device does not have.
    driver_features_unknown: bool,
    device_feature_select: u32,
    driver_feature_select: u32,
    status: u8,
    queue_select: u16,
    queues: Vec<QueueConfig>,
    notify: Vec<Arc<EventFd>>,
    irq: Arc<Interrupts>,
    odd: LogOnce,
}

impl Transport {
    /// The transport of device `key` offering `device_features`, with `queues` queues and
    /// an MSI-X table of `vectors`.
    pub fn new(key: &str, device_features: u64, queues: u16, vectors: u16) -> std::io::Result<Self> {
        let notify = (0..queues).map(|_| EventFd::new(EFD_NONBLOCK).map(Arc::new)).collect::<Result<Vec<_>, _>>()?;
        Ok(Transport {
            key: key.to_owned(),
            device_features,
            driver_features: 0,
            driver_features_unknown: false,
            device_feature_select: 0,
            driver_feature_select: 0,
            status: 0,
            queue_select: 0,
            queues: vec![QueueConfig::default(); usize::from(queues)],
            notify,
            irq: Arc::new(Interrupts::new(key, queues, vectors)),
            odd: LogOnce::default(),
        })
    }

    /// The interrupts, shared with the device's worker.
    pub fn interrupts(&self) -> &Arc<Interrupts> {
        &self.irq
    }

    /// Queue `q`'s doorbell: signalled on every guest write to it.
    pub fn doorbell(&self, q: usize) -> Option<&Arc<EventFd>> {
        self.notify.get(q)
    }

    /// Number of queues.
    pub fn num_queues(&self) -> usize {
        self.queues.len()
    }

    /// Feature bits the driver accepted.
    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// The device status as the driver reads it.
    pub fn status(&self) -> u8 {
        self.status | if self.irq.needs_reset() { NEEDS_RESET } else { 0 }
    }

    /// Back to the state after power-on: nothing negotiated, no queue set up, every vector
    /// none, the doorbells drained. The caller has stopped the device first.
    pub fn reset(&mut self) {
        self.driver_features = 0;
        self.driver_features_unknown = false;
        self.device_feature_select = 0;
        self.driver_feature_select = 0;
        self.status = 0;
        self.queue_select = 0;
        self.queues.fill(QueueConfig::default());
        self.irq.reset();
        for fd in &self.notify {
            // Nonblocking: EAGAIN when nothing was pending.
            let _ = fd.read();
        }
    }

    /// A guest write to doorbell region offset `offset` (from [`NOTIFY_CFG`]).
    pub fn write_notify(&self, offset: u64) {
        let q = offset / u64::from(NOTIFY_OFF_MULTIPLIER);
        match usize::try_from(q).ok().and_then(|q| self.notify.get(q)) {
            Some(fd) => {
                if let Err(e) = fd.write(1) {
                    tracing::debug!(device = %self.key, queue = q, "doorbell eventfd write failed: {e}");
                }
            }
            None => self.log_odd("write to a doorbell of a queue the device lacks", offset),
        }
    }

    /// A guest read of the ISR status (`offset` from [`ISR_CFG`]): the first byte, which the
    /// read clears; the rest reads 0.
    pub fn read_isr(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if offset == 0 {
            if let Some(first) = data.first_mut() {
                *first = self.irq.take_isr();
            }
        }
    }

    /// A guest read of the common configuration at `offset` from its start.
    pub fn read_common(&self, offset: u64, data: &mut [u8]) {
        for (i, byte) in data.iter_mut().enumerate() {
            let at = offset.saturating_add(i as u64);
            *byte = match FIELDS.iter().find(|(o, s)| at >= *o && at < o + *s as u64) {
                Some(&(o, _)) => self.field(o).to_le_bytes()[(at - o) as usize],
                None => 0,
            };
        }
    }

    /// A guest write to the common configuration at `offset` from its start; returns what
    /// the device must do.
    pub fn write_common(&mut self, offset: u64, data: &[u8]) -> Action {
        let end = offset.saturating_add(data.len() as u64);
        let mut action = Action::None;
        for &(o, size) in &FIELDS {
            let field_end = o + size as u64;
            if end <= o || offset >= field_end {
                continue;
            }
            let mut bytes = self.field(o).to_le_bytes();
            for (i, b) in bytes.iter_mut().enumerate().take(size) {
                let at = o + i as u64;
                if at >= offset && at < end {
                    *b = data[(at - offset) as usize];
                }
            }
            let value = u64::from_le_bytes(bytes);
            match self.set_field(o, value) {
                Action::None => {}
                a => action = a,
            }
        }
        action
    }

    /// The driver's queue `q` as a virtio-queue [`Queue`], ready to use over `memory`;
    /// `Ok(None)` when the driver did not enable it.
    pub fn build_queue(&self, q: usize, memory: &GuestMemoryMmap) -> Result<Option<Queue>, String> {
        let Some(c) = self.queues.get(q) else { return Ok(None) };
        if !c.enabled {
            return Ok(None);
        }
        let mut queue = Queue::new(QUEUE_MAX_SIZE).map_err(|e| format!("queue {q}: {e}"))?;
        queue.try_set_size(c.size).map_err(|e| format!("queue {q}: size {}: {e}", c.size))?;
        queue
            .try_set_desc_table_address(GuestAddress(c.desc))
            .map_err(|e| format!("queue {q}: descriptor table {:#x}: {e}", c.desc))?;
        queue
            .try_set_avail_ring_address(GuestAddress(c.driver))
            .map_err(|e| format!("queue {q}: driver area {:#x}: {e}", c.driver))?;
        queue
            .try_set_used_ring_address(GuestAddress(c.device))
            .map_err(|e| format!("queue {q}: device area {:#x}: {e}", c.device))?;
        queue.set_ready(true);
        if !queue.is_valid(memory) {
            return Err(format!("queue {q}: its rings are not in guest memory"));
        }
        Ok(Some(queue))
    }

    fn log_odd(&self, what: &'static str, at: u64) {
        if self.odd.first(what, 0) {
            tracing::warn!(device = %self.key, at = format_args!("{at:#x}"), "{what} (logged once; later ones at debug level)");
        } else {
            tracing::debug!(device = %self.key, at = format_args!("{at:#x}"), "{what}");
        }
    }

    fn selected(&self) -> Option<&QueueConfig> {
        self.queues.get(usize::from(self.queue_select))
    }

    /// Whether the driver may still change queue setup (DRIVER_OK not yet set).
    fn setting_up(&self) -> bool {
        self.status & DRIVER_OK == 0
    }

    fn running(&self) -> bool {
        self.status & (DRIVER_OK | FEATURES_OK) == DRIVER_OK | FEATURES_OK && self.status & FAILED == 0
    }

    /// The value of the field at `offset`.
    fn field(&self, offset: u64) -> u64 {
        let q = self.selected();
        let queue_field = |f: fn(&QueueConfig) -> u64| q.map_or(0, f);
        match offset {
            0 => u64::from(self.device_feature_select),
            4 => match self.device_feature_select {
                0 => self.device_features & 0xffff_ffff,
                1 => self.device_features >> 32,
                _ => 0,
            },
            8 => u64::from(self.driver_feature_select),
            12 => match self.driver_feature_select {
                0 => self.driver_features & 0xffff_ffff,
                1 => self.driver_features >> 32,
                _ => 0,
            },
            16 => u64::from(self.irq.config_vector.load(Ordering::Acquire)),
            18 => self.queues.len() as u64,
            20 => u64::from(self.status()),
            21 => 0,
            22 => u64::from(self.queue_select),
            24 => queue_field(|c| u64::from(c.size)),
            26 => {
                let v = self.irq.queue_vectors.get(usize::from(self.queue_select));
                u64::from(v.map_or(NO_VECTOR, |v| v.load(Ordering::Acquire)))
            }
            28 => queue_field(|c| u64::from(c.enabled)),
            30 => q.map_or(0, |_| u64::from(self.queue_select)),
            32 => queue_field(|c| c.desc),
            40 => queue_field(|c| c.driver),
            48 => queue_field(|c| c.device),
            _ => 0,
        }
    }

    /// Sets the field at `offset` to `value` (truncated to the field's size).
    fn set_field(&mut self, offset: u64, value: u64) -> Action {
        let setting_up = self.setting_up();
        let select = usize::from(self.queue_select);
        match offset {
            0 => self.device_feature_select = value as u32,
            8 => self.driver_feature_select = value as u32,
            12 => {
                if self.status & FEATURES_OK != 0 {
                    self.log_odd("driver features written after FEATURES_OK", value);
                    return Action::None;
                }
                let word = value & 0xffff_ffff;
                match self.driver_feature_select {
                    0 => self.driver_features = (self.driver_features & !0xffff_ffff) | word,
                    1 => self.driver_features = (self.driver_features & 0xffff_ffff) | word << 32,
                    _ => self.driver_features_unknown |= word != 0,
                }
            }
            16 => self.irq.config_vector.store(self.irq.checked_vector(value as u16), Ordering::Release),
            20 => return self.set_status(value as u8),
            22 => self.queue_select = value as u16,
            26 => {
                if let Some(v) = self.irq.queue_vectors.get(select) {
                    v.store(self.irq.checked_vector(value as u16), Ordering::Release);
                }
            }
            24 | 28 | 32 | 40 | 48 => {
                if !setting_up {
                    self.log_odd("queue setup written after DRIVER_OK", offset);
                    return Action::None;
                }
                let Some(c) = self.queues.get_mut(select) else {
                    self.log_odd("queue setup written for a queue the device lacks", u64::from(self.queue_select));
                    return Action::None;
                };
                match offset {
                    24 => c.size = value as u16,
                    // Only 1 enables; a queue is disabled by a device reset alone.
                    28 => c.enabled |= value as u16 == 1,
                    32 => c.desc = value,
                    40 => c.driver = value,
                    _ => c.device = value,
                }
            }
            // device_feature, num_queues, config_generation, queue_notify_off: read-only.
            _ => {}
        }
        Action::None
    }

    fn set_status(&mut self, value: u8) -> Action {
        // NEEDS_RESET is the device's to set.
        let mut status = value & !NEEDS_RESET;
        if status == 0 {
            return Action::Reset;
        }
        if status & FEATURES_OK != 0 && self.status & FEATURES_OK == 0 && !self.features_acceptable() {
            tracing::debug!(
                device = %self.key,
                driver = format_args!("{:#x}", self.driver_features),
                device_offers = format_args!("{:#x}", self.device_features),
                "FEATURES_OK refused: the driver accepted features not offered, or not VERSION_1"
            );
            status &= !FEATURES_OK;
        }
        // Once accepted, the features stay accepted until reset.
        status |= self.status & FEATURES_OK;
        if status & DRIVER_OK != 0 && status & FEATURES_OK == 0 {
            self.log_odd("DRIVER_OK without FEATURES_OK", u64::from(status));
            self.irq.set_needs_reset();
        }
        let was_running = self.running();
        self.status = status;
        match (was_running, self.running()) {
            (false, true) => Action::Start,
            (true, false) => Action::Stop,
            _ => Action::None,
        }
    }

    /// Whether the driver accepted a subset of the offered features, VERSION_1 among them.
    fn features_acceptable(&self) -> bool {
        let version_1 = 1u64 << VIRTIO_F_VERSION_1;
        !self.driver_features_unknown
            && self.driver_features & !self.device_features == 0
            && self.driver_features & version_1 != 0
    }
}
