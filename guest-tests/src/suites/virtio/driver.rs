//! A minimal userspace virtio-net driver over the virtio 1.x PCI transport: reset, feature
//! negotiation, the transmit queue (queue 1) in pinned memory, no interrupts (MSI-X vectors
//! NO_VECTOR; the used ring is polled against a deadline). It posts the chaos cases and
//! judges what the device did with each.

use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::queue::{choose_queue_size, good_frame, Case, RingLayout};
use crate::dma::PAGE_SIZE;
use crate::mapping::Mapped;
use crate::pcidev::Mmio;

/// `struct virtio_pci_common_cfg` (virtio 1.x, 4.1.4.3).
pub mod common {
    /// le32, selects the half of `device_feature`.
    pub const DEVICE_FEATURE_SELECT: usize = 0x00;
    /// le32, read-only.
    pub const DEVICE_FEATURE: usize = 0x04;
    /// le32, selects the half of `driver_feature`.
    pub const DRIVER_FEATURE_SELECT: usize = 0x08;
    /// le32.
    pub const DRIVER_FEATURE: usize = 0x0c;
    /// le16, the configuration-change MSI-X vector.
    pub const MSIX_CONFIG: usize = 0x10;
    /// le16, read-only.
    pub const NUM_QUEUES: usize = 0x12;
    /// u8.
    pub const DEVICE_STATUS: usize = 0x14;
    /// u8, read-only.
    pub const CONFIG_GENERATION: usize = 0x15;
    /// le16.
    pub const QUEUE_SELECT: usize = 0x16;
    /// le16: the maximum on read; the driver may write a smaller one.
    pub const QUEUE_SIZE: usize = 0x18;
    /// le16.
    pub const QUEUE_MSIX_VECTOR: usize = 0x1a;
    /// le16.
    pub const QUEUE_ENABLE: usize = 0x1c;
    /// le16, read-only.
    pub const QUEUE_NOTIFY_OFF: usize = 0x1e;
    /// le64, the descriptor table.
    pub const QUEUE_DESC: usize = 0x20;
    /// le64, the available ring.
    pub const QUEUE_DRIVER: usize = 0x28;
    /// le64, the used ring.
    pub const QUEUE_DEVICE: usize = 0x30;
    /// Bytes up to the end of `queue_device`.
    pub const LEN: usize = 0x38;
}

/// `device_status` bits.
pub mod status {
    /// The guest found the device.
    pub const ACKNOWLEDGE: u8 = 1;
    /// The guest knows how to drive it.
    pub const DRIVER: u8 = 2;
    /// The driver is ready.
    pub const DRIVER_OK: u8 = 4;
    /// Feature negotiation is complete.
    pub const FEATURES_OK: u8 = 8;
    /// The device hit an error it cannot recover from without a reset.
    pub const NEEDS_RESET: u8 = 0x40;
    /// The driver gave up on the device.
    pub const FAILED: u8 = 0x80;
    /// What a live, initialised device reads.
    pub const LIVE: u8 = ACKNOWLEDGE | DRIVER | FEATURES_OK | DRIVER_OK;
}

/// Feature bits.
pub mod feature {
    /// `VIRTIO_NET_F_MTU`: the device reports its MTU.
    pub const NET_MTU: u64 = 1 << 3;
    /// `VIRTIO_NET_F_MAC`: the device has a MAC address.
    pub const NET_MAC: u64 = 1 << 5;
    /// `VIRTIO_NET_F_STATUS`: link status in the configuration.
    pub const NET_STATUS: u64 = 1 << 16;
    /// `VIRTIO_F_VERSION_1`: a modern (virtio 1.x) device.
    pub const VERSION_1: u64 = 1 << 32;
}

/// `struct virtio_net_config`: MAC at 0, status at 6, max_virtqueue_pairs at 8, MTU at 10.
const NET_CONFIG_MAC: usize = 0;
const NET_CONFIG_STATUS: usize = 6;
const NET_CONFIG_MTU: usize = 10;
/// Bytes of the configuration the driver reads.
pub const NET_CONFIG_LEN: usize = 12;
/// The MSI-X vector meaning none.
pub const NO_VECTOR: u16 = 0xffff;
/// The transmit queue of the first pair.
pub const TX_QUEUE: u16 = 1;
/// The features the driver accepts when offered.
pub const WANTED: u64 = feature::VERSION_1 | feature::NET_MAC | feature::NET_MTU;
/// Reads of the device configuration before giving up on a stable generation.
const GENERATION_TRIES: u32 = 8;
/// Where the good frame lies in the driver's memory: the page after the rings.
const FRAME_OFFSET: usize = PAGE_SIZE;
/// Polls without progress before the driver sleeps between polls.
const SPIN_POLLS: u32 = 64;
/// The sleep between polls after that.
const POLL_SLEEP: Duration = Duration::from_micros(50);

/// Byte and halfword access on top of [`Mmio`]: virtio registers must be accessed at their
/// own width (virtio 1.x, 4.1.3.1).
pub trait Regs: Mmio {
    /// An 8-bit read.
    fn read8(&mut self, offset: usize) -> u8;
    /// An 8-bit write.
    fn write8(&mut self, offset: usize, value: u8);
    /// A 16-bit read (aligned).
    fn read16(&mut self, offset: usize) -> u16;
    /// A 16-bit write (aligned).
    fn write16(&mut self, offset: usize, value: u16);
}

impl<T: Mapped> Regs for T {
    fn read8(&mut self, offset: usize) -> u8 {
        // SAFETY: `at` checked bounds inside the live mapping.
        self.mapping().at(offset, 1).map_or(u8::MAX, |p| unsafe { std::ptr::read_volatile(p) })
    }

    fn write8(&mut self, offset: usize, value: u8) {
        if let Some(p) = self.mapping().at(offset, 1) {
            // SAFETY: `at` checked bounds inside the live mapping.
            unsafe { std::ptr::write_volatile(p, value) };
        }
    }

    fn read16(&mut self, offset: usize) -> u16 {
        // SAFETY: `at` checked bounds and alignment inside the live mapping.
        self.mapping().at(offset, 2).map_or(u16::MAX, |p| unsafe { std::ptr::read_volatile(p.cast::<u16>()) })
    }

    fn write16(&mut self, offset: usize, value: u16) {
        if let Some(p) = self.mapping().at(offset, 2) {
            // SAFETY: `at` checked bounds and alignment inside the live mapping.
            unsafe { std::ptr::write_volatile(p.cast::<u16>(), value) };
        }
    }
}

/// Feature bits by name, for diagnostics (unnamed bits in hex).
pub fn feature_names(bits: u64) -> String {
    const NAMES: &[(u64, &str)] = &[
        (1 << 0, "CSUM"),
        (1 << 1, "GUEST_CSUM"),
        (feature::NET_MTU, "MTU"),
        (feature::NET_MAC, "MAC"),
        (feature::NET_STATUS, "STATUS"),
        (1 << 28, "RING_INDIRECT_DESC"),
        (1 << 29, "RING_EVENT_IDX"),
        (feature::VERSION_1, "VERSION_1"),
        (1 << 33, "ACCESS_PLATFORM"),
        (1 << 34, "RING_PACKED"),
    ];
    let mut names: Vec<String> = NAMES.iter().filter(|(b, _)| bits & b != 0).map(|(_, n)| (*n).to_owned()).collect();
    let rest = NAMES.iter().fold(bits, |r, (b, _)| r & !b);
    if rest != 0 {
        names.push(format!("{rest:#x}"));
    }
    if names.is_empty() {
        "none".into()
    } else {
        names.join("|")
    }
}

/// `device_status` by name.
pub fn status_names(s: u8) -> String {
    if s == 0 {
        return "reset".into();
    }
    let names = [
        (status::ACKNOWLEDGE, "ACKNOWLEDGE"),
        (status::DRIVER, "DRIVER"),
        (status::FEATURES_OK, "FEATURES_OK"),
        (status::DRIVER_OK, "DRIVER_OK"),
        (status::NEEDS_RESET, "NEEDS_RESET"),
        (status::FAILED, "FAILED"),
    ];
    let mut out: Vec<String> = names.iter().filter(|(b, _)| s & b != 0).map(|(_, n)| (*n).to_owned()).collect();
    let rest = names.iter().fold(s, |r, (b, _)| r & !b);
    if rest != 0 {
        out.push(format!("{rest:#04x}"));
    }
    out.join("|")
}

/// Where the virtio structures lie in the BAR the driver maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Common configuration.
    pub common: usize,
    /// Notification area.
    pub notify: usize,
    /// `notify_off_multiplier`.
    pub notify_off_multiplier: u32,
    /// ISR status.
    pub isr: usize,
    /// Device configuration.
    pub device: usize,
    /// Bytes of the notification area.
    pub notify_len: usize,
}

/// The registers of a virtio PCI function, in one BAR.
pub struct Transport<R: Regs> {
    /// The BAR.
    pub regs: R,
    /// Where the structures are in it.
    pub layout: Layout,
}

impl<R: Regs> Transport<R> {
    fn common(&self, field: usize) -> usize {
        self.layout.common + field
    }

    /// `device_status`.
    pub fn status(&mut self) -> u8 {
        let at = self.common(common::DEVICE_STATUS);
        self.regs.read8(at)
    }

    /// Writes `device_status`.
    pub fn set_status(&mut self, s: u8) {
        let at = self.common(common::DEVICE_STATUS);
        self.regs.write8(at, s);
    }

    /// `num_queues`.
    pub fn num_queues(&mut self) -> u16 {
        let at = self.common(common::NUM_QUEUES);
        self.regs.read16(at)
    }

    /// `config_generation`.
    pub fn generation(&mut self) -> u8 {
        let at = self.common(common::CONFIG_GENERATION);
        self.regs.read8(at)
    }

    /// Reads (and so clears) the ISR status.
    pub fn isr(&mut self) -> u8 {
        let at = self.layout.isr;
        self.regs.read8(at)
    }

    /// Writes 0 to `device_status` and waits up to `timeout` for it to read 0: how long it took,
    /// or what it still read.
    pub fn reset(&mut self, timeout: Duration) -> Result<Duration, String> {
        self.set_status(0);
        poll(timeout, || (self.status() == 0).then_some(())).map(|((), t)| t).map_err(|t| {
            let s = self.status();
            format!("device_status still reads {s:#04x} ({}) {} after the reset", status_names(s), human(t))
        })
    }

    /// The 64 feature bits the device offers.
    pub fn device_features(&mut self) -> u64 {
        let (select, value) = (self.common(common::DEVICE_FEATURE_SELECT), self.common(common::DEVICE_FEATURE));
        self.regs.write32(select, 0);
        let low = self.regs.read32(value);
        self.regs.write32(select, 1);
        let high = self.regs.read32(value);
        u64::from(low) | u64::from(high) << 32
    }

    /// Writes the 64 feature bits the driver accepts.
    pub fn set_driver_features(&mut self, bits: u64) {
        let (select, value) = (self.common(common::DRIVER_FEATURE_SELECT), self.common(common::DRIVER_FEATURE));
        self.regs.write32(select, 0);
        self.regs.write32(value, bits as u32);
        self.regs.write32(select, 1);
        self.regs.write32(value, (bits >> 32) as u32);
    }

    /// The 64 feature bits `driver_feature` reads back.
    pub fn driver_features(&mut self) -> u64 {
        let (select, value) = (self.common(common::DRIVER_FEATURE_SELECT), self.common(common::DRIVER_FEATURE));
        self.regs.write32(select, 0);
        let low = self.regs.read32(value);
        self.regs.write32(select, 1);
        let high = self.regs.read32(value);
        u64::from(low) | u64::from(high) << 32
    }

    /// Writes a 16-bit common field and reads it back.
    fn write16_back(&mut self, field: usize, value: u16) -> u16 {
        let at = self.common(field);
        self.regs.write16(at, value);
        self.regs.read16(at)
    }

    fn read16(&mut self, field: usize) -> u16 {
        let at = self.common(field);
        self.regs.read16(at)
    }

    /// A 64-bit common field as two 32-bit writes, low half first (the spec lets a driver).
    fn write64(&mut self, field: usize, value: u64) {
        let at = self.common(field);
        self.regs.write32(at, value as u32);
        self.regs.write32(at + 4, (value >> 32) as u32);
    }

    fn read64(&mut self, field: usize) -> u64 {
        let at = self.common(field);
        u64::from(self.regs.read32(at)) | u64::from(self.regs.read32(at + 4)) << 32
    }

    /// The MAC, link status and MTU from the device configuration, read until
    /// `config_generation` is the same before and after.
    pub fn net_config(&mut self) -> Result<NetConfig, String> {
        for _ in 0..GENERATION_TRIES {
            let before = self.generation();
            let base = self.layout.device;
            let mut mac = [0u8; 6];
            for (i, b) in mac.iter_mut().enumerate() {
                *b = self.regs.read8(base + NET_CONFIG_MAC + i);
            }
            let link = self.regs.read16(base + NET_CONFIG_STATUS);
            let mtu = self.regs.read16(base + NET_CONFIG_MTU);
            if self.generation() == before {
                return Ok(NetConfig { mac, link, mtu });
            }
        }
        Err(format!("config_generation changed during each of {GENERATION_TRIES} reads of the configuration"))
    }

    /// Rings the doorbell of queue `queue` whose `queue_notify_off` is `off`.
    pub fn notify(&mut self, queue: u16, off: u16) {
        let at = self.layout.notify + usize::from(off) * self.layout.notify_off_multiplier as usize;
        fence(Ordering::SeqCst);
        self.regs.write16(at, queue);
    }
}

/// What the device configuration holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    /// MAC address.
    pub mac: [u8; 6],
    /// Link status (valid with STATUS).
    pub link: u16,
    /// MTU (valid with MTU).
    pub mtu: u16,
}

/// Calls `f` until it gives a value or `timeout` passes, spinning a little and then sleeping
/// between calls: the value and when it came, or how long it waited.
pub fn poll<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Result<(T, Duration), Duration> {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        if let Some(v) = f() {
            return Ok((v, start.elapsed()));
        }
        if start.elapsed() >= timeout {
            return Err(start.elapsed());
        }
        polls += 1;
        if polls > SPIN_POLLS {
            std::thread::sleep(POLL_SLEEP);
        }
    }
}

/// How long the driver waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// For `device_status` to read 0 after a reset.
    pub reset: Duration,
    /// For a posted buffer to come back (or NEEDS_RESET).
    pub used: Duration,
}

/// What one setup found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setup {
    /// How long the reset took.
    pub reset_in: Duration,
    /// Offered by the device.
    pub offered: u64,
    /// Accepted by the driver.
    pub accepted: u64,
    /// The device configuration.
    pub config: NetConfig,
    /// Queues the device has.
    pub num_queues: u16,
    /// The transmit queue's maximum size, and the size set.
    pub queue_max: u16,
    /// Where the rings are.
    pub layout: RingLayout,
    /// `queue_notify_off` of the transmit queue.
    pub notify_off: u16,
    /// Where its doorbell is in the BAR.
    pub notify_at: usize,
    /// Physical addresses of the descriptor table, available ring and used ring.
    pub rings: [u64; 3],
    /// Deviations that do not stop the driver.
    pub warnings: Vec<String>,
}

/// What the device did with one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// The first new used element (id, len), if the used ring moved.
    pub used: Option<(u32, u32)>,
    /// How far the used index moved.
    pub advanced: u16,
    /// `device_status` afterwards.
    pub status: u8,
    /// How long the driver waited.
    pub waited: Duration,
    /// Whether it waited until the deadline.
    pub timed_out: bool,
}

/// A duration for the diagnostics: µs below a millisecond, ms below a second, else s.
pub fn human(d: Duration) -> String {
    match d.as_micros() {
        us if us < 1000 => format!("{us} µs"),
        us if us < 1_000_000 => format!("{:.1} ms", d.as_secs_f64() * 1e3),
        _ => format!("{:.2} s", d.as_secs_f64()),
    }
}

/// The verdict on one case: a line of what happened, or the problem.
pub fn judge(case: Case, head: u16, o: &Observed) -> Result<String, String> {
    let waited = human(o.waited);
    let st = format!("device_status {:#04x} ({})", o.status, status_names(o.status));
    if o.status == u8::MAX {
        return Err(format!("device_status reads 0xff: the device stopped answering (after {waited})"));
    }
    let needs_reset = o.status & status::NEEDS_RESET != 0;
    let used = o.used.map(|(id, len)| (id, len, format!("used id {id} len {len} after {waited}")));
    if let Some((id, _, line)) = &used {
        if *id != u32::from(head) {
            return Err(format!("{line}: the device returned descriptor {id}, the case posted {head}"));
        }
        if o.advanced > 1 && case != Case::AvailJump {
            return Err(format!("{line}: the used index moved by {} for one buffer posted", o.advanced));
        }
    }
    match (case, used, needs_reset) {
        (Case::GoodFrame, Some((_, _, line)), false) => Ok(format!("consumed: {line}")),
        (Case::GoodFrame, _, true) => Err(format!("{st} after a good frame")),
        (Case::AvailJump, None, true) => Ok(format!("NEEDS_RESET after {waited}: {st}")),
        (Case::AvailJump, Some((_, _, line)), _) => {
            Err(format!("the device consumed {} buffer(s) ({line}, {st}) instead of setting NEEDS_RESET", o.advanced))
        }
        (_, Some((_, len, line)), _) if len != 0 => Err(format!("{line}: a dropped buffer comes back with len 0")),
        (_, Some((_, _, line)), false) => Ok(format!("dropped: {line}")),
        (_, Some((_, _, line)), true) => Ok(format!("dropped and NEEDS_RESET: {line}, {st}")),
        (_, None, true) => Ok(format!("NEEDS_RESET after {waited}: {st}")),
        (_, None, false) => {
            let expect = match case {
                Case::GoodFrame => "the buffer back",
                Case::AvailJump => "NEEDS_RESET",
                _ => "the buffer back (dropped) or NEEDS_RESET",
            };
            Err(format!("neither a used element nor NEEDS_RESET within {waited} (expected {expect}); {st}"))
        }
    }
}

/// The driver: the transport, its memory (page 0: the rings; page 1: the frame) at the
/// physical addresses `pages`, and where the transmit queue stands.
pub struct Session<R: Regs, M: Regs> {
    /// The registers.
    pub dev: Transport<R>,
    mem: M,
    pages: [u64; 2],
    timing: Timing,
    ring: RingLayout,
    notify_off: u16,
    next_avail: u16,
    last_used: u16,
    /// Why the device can no longer be driven, once it cannot.
    pub dead: Option<String>,
}

impl<R: Regs, M: Regs> Session<R, M> {
    /// A driver for `dev` using `mem` (two pages at the physical addresses `pages`).
    pub fn new(dev: Transport<R>, mem: M, pages: [u64; 2], timing: Timing) -> Self {
        Session {
            dev,
            mem,
            pages,
            timing,
            ring: RingLayout::new(1),
            notify_off: 0,
            next_avail: 0,
            last_used: 0,
            dead: None,
        }
    }

    /// Gives back the registers and the memory.
    pub fn into_parts(self) -> (Transport<R>, M) {
        (self.dev, self.mem)
    }

    fn zero(&mut self, from: usize, len: usize) {
        for at in (from..from + len).step_by(4) {
            self.mem.write32(at, 0);
        }
    }

    fn write_desc(&mut self, slot: u16, d: super::queue::Desc) {
        let at = self.ring.desc_at(slot);
        self.mem.write64(at, d.addr);
        self.mem.write32(at + 8, d.len);
        self.mem.write32(at + 12, u32::from(d.flags) | u32::from(d.next) << 16);
    }

    /// Resets the device and brings it up with the transmit queue live: the full virtio
    /// initialisation (3.1.1). Fresh state is checked on the way: status 0 after the reset,
    /// the queue disabled, and the status exactly ACKNOWLEDGE|DRIVER|FEATURES_OK|DRIVER_OK
    /// at the end.
    pub fn setup(&mut self) -> Result<Setup, String> {
        let reset_in = self.dev.reset(self.timing.reset)?;
        let mut warnings = Vec::new();
        self.select(TX_QUEUE);
        match self.dev.read16(common::QUEUE_ENABLE) {
            0 => {}
            e => return Err(format!("queue {TX_QUEUE} reads queue_enable {e} after the reset")),
        }
        self.dev.set_status(status::ACKNOWLEDGE);
        self.dev.set_status(status::ACKNOWLEDGE | status::DRIVER);
        let offered = self.dev.device_features();
        if offered & feature::VERSION_1 == 0 {
            return Err(format!("the device does not offer VERSION_1 (offers {})", feature_names(offered)));
        }
        let accepted = offered & WANTED;
        self.dev.set_driver_features(accepted);
        self.dev.set_status(status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK);
        let s = self.dev.status();
        if s & status::FEATURES_OK == 0 {
            self.dev.set_status(status::FAILED);
            return Err(format!(
                "FEATURES_OK did not stick: device_status {s:#04x} ({}) after accepting {}",
                status_names(s),
                feature_names(accepted)
            ));
        }
        let back = self.dev.driver_features();
        if back != accepted {
            warnings.push(format!(
                "driver_feature reads back {} after writing {}",
                feature_names(back),
                feature_names(accepted)
            ));
        }
        let vector = self.dev.write16_back(common::MSIX_CONFIG, NO_VECTOR);
        if vector != NO_VECTOR {
            warnings.push(format!("msix_config reads {vector:#06x} after writing NO_VECTOR"));
        }
        let config = self.dev.net_config()?;
        let num_queues = self.dev.num_queues();
        if num_queues <= TX_QUEUE {
            return Err(format!("num_queues is {num_queues}: no transmit queue {TX_QUEUE}"));
        }
        self.select(TX_QUEUE);
        let queue_max = self.dev.read16(common::QUEUE_SIZE);
        let size = choose_queue_size(queue_max)
            .ok_or_else(|| format!("queue {TX_QUEUE} offers {queue_max} entries; the driver needs 8 or more"))?;
        let set = self.dev.write16_back(common::QUEUE_SIZE, size);
        if set != size {
            return Err(format!("queue_size reads {set} after writing {size}"));
        }
        let vector = self.dev.write16_back(common::QUEUE_MSIX_VECTOR, NO_VECTOR);
        if vector != NO_VECTOR {
            warnings.push(format!("queue_msix_vector reads {vector:#06x} after writing NO_VECTOR"));
        }
        self.ring = RingLayout::new(size);
        self.zero(0, PAGE_SIZE);
        let base = self.pages[0];
        let addrs = [
            (common::QUEUE_DESC, base + self.ring.desc as u64),
            (common::QUEUE_DRIVER, base + self.ring.avail as u64),
            (common::QUEUE_DEVICE, base + self.ring.used as u64),
        ];
        for (field, addr) in addrs {
            self.dev.write64(field, addr);
            let got = self.dev.read64(field);
            if got != addr {
                return Err(format!("queue field {field:#04x} reads {got:#x} after writing {addr:#x}"));
            }
        }
        let notify_off = self.dev.read16(common::QUEUE_NOTIFY_OFF);
        let l = self.dev.layout;
        let notify_at = usize::from(notify_off) * l.notify_off_multiplier as usize;
        if notify_at + 2 > l.notify_len {
            return Err(format!(
                "queue {TX_QUEUE}'s doorbell (queue_notify_off {notify_off} x {}) lies past the {}-byte notify area",
                l.notify_off_multiplier, l.notify_len
            ));
        }
        let notify_at = l.notify + notify_at;
        match self.dev.write16_back(common::QUEUE_ENABLE, 1) {
            1 => {}
            e => return Err(format!("queue_enable reads {e} after writing 1")),
        }
        self.dev.set_status(status::LIVE);
        let s = self.dev.status();
        if s != status::LIVE {
            return Err(format!("device_status reads {s:#04x} ({}) after DRIVER_OK", status_names(s)));
        }
        self.notify_off = notify_off;
        (self.next_avail, self.last_used) = (0, 0);
        let frame = good_frame(config.mac);
        self.zero(FRAME_OFFSET, frame.len().next_multiple_of(4));
        for (i, chunk) in frame.chunks(4).enumerate() {
            let mut word = [0u8; 4];
            word[..chunk.len()].copy_from_slice(chunk);
            self.mem.write32(FRAME_OFFSET + 4 * i, u32::from_le_bytes(word));
        }
        for case in Case::ALL {
            for (slot, d) in case.descriptors(self.pages[1], frame.len() as u32) {
                self.write_desc(slot, d);
            }
        }
        let (layout, rings) = (self.ring, addrs.map(|(_, a)| a));
        Ok(Setup {
            reset_in,
            offered,
            accepted,
            config,
            num_queues,
            queue_max,
            layout,
            notify_off,
            notify_at,
            rings,
            warnings,
        })
    }

    fn select(&mut self, queue: u16) {
        let at = self.dev.common(common::QUEUE_SELECT);
        self.dev.regs.write16(at, queue);
    }

    /// Makes the case's head available (for [`Case::AvailJump`]: moves the index by the queue
    /// size plus one, every entry naming the head), rings the doorbell, and waits for the used
    /// ring to move, NEEDS_RESET, or the deadline.
    pub fn run_case(&mut self, case: Case) -> Observed {
        let head = case.head();
        let step = if case == Case::AvailJump {
            for i in 0..self.ring.size {
                let at = self.ring.avail_entry(i);
                self.mem.write16(at, head);
            }
            self.ring.size + 1
        } else {
            let at = self.ring.avail_entry(self.next_avail);
            self.mem.write16(at, head);
            1
        };
        self.next_avail = self.next_avail.wrapping_add(step);
        // The entries before the index (the device reads them once it sees the index).
        fence(Ordering::SeqCst);
        let at = self.ring.avail_idx();
        self.mem.write16(at, self.next_avail);
        self.dev.notify(TX_QUEUE, self.notify_off);
        self.observe()
    }

    fn observe(&mut self) -> Observed {
        let used_at = self.ring.used_idx();
        let last = self.last_used;
        let waited = poll(self.timing.used, || {
            let used = self.mem.read16(used_at);
            if used != last {
                return Some(());
            }
            let s = self.dev.status();
            (s == u8::MAX || s & status::NEEDS_RESET != 0).then_some(())
        });
        let (waited, timed_out) = match waited {
            Ok(((), t)) => (t, false),
            Err(t) => (t, true),
        };
        fence(Ordering::SeqCst);
        let now = self.mem.read16(used_at);
        let advanced = now.wrapping_sub(last);
        let used = (advanced != 0).then(|| {
            let at = self.ring.used_entry(last);
            (self.mem.read32(at), self.mem.read32(at + 4))
        });
        self.last_used = now;
        Observed { used, advanced, status: self.dev.status(), waited, timed_out }
    }

    /// After a case: the device must still answer; when it is broken (NEEDS_RESET) or the case
    /// did not end `clean`ly, a reset must bring it back; when it dropped a malformed buffer,
    /// a good frame must still go through. Lines for the diagnostics, and the problems.
    pub fn after_case(&mut self, case: Case, clean: bool) -> (Vec<String>, Vec<String>) {
        let (mut notes, mut problems) = (Vec::new(), Vec::new());
        let s = self.dev.status();
        let queues = self.dev.num_queues();
        if s == u8::MAX || queues == u16::MAX {
            let why = format!("the device stopped answering: device_status {s:#04x}, num_queues {queues:#06x}");
            problems.push(why.clone());
            self.dead = Some(why);
            return (notes, problems);
        }
        notes.push(format!("the device answers: device_status {s:#04x} ({}), num_queues {queues}", status_names(s)));
        let broken = s & status::NEEDS_RESET != 0;
        if broken {
            let isr = self.dev.isr();
            notes.push(format!("ISR {isr:#04x}{}", if isr & 2 != 0 { " (configuration change)" } else { "" }));
        }
        if case.malformed() && !broken && clean {
            let probe = self.run_case(Case::GoodFrame);
            match judge(Case::GoodFrame, Case::GoodFrame.head(), &probe) {
                Ok(line) if probe.status == status::LIVE => {
                    notes.push(format!("a good frame still goes through: {line}"));
                    return (notes, problems);
                }
                Ok(line) => {
                    problems.push(format!("a good frame after it: {line}, but device_status {:#04x}", probe.status))
                }
                Err(e) => problems.push(format!("a good frame after it: {e}")),
            }
        } else if !broken && clean {
            return (notes, problems);
        }
        match self.setup() {
            Ok(setup) => notes.push(format!(
                "reset: device_status 0 after {}, queue {TX_QUEUE} disabled; set up again: device_status {:#04x} ({})",
                human(setup.reset_in),
                status::LIVE,
                status_names(status::LIVE)
            )),
            Err(e) => {
                let why = format!("the reset did not bring the device back: {e}");
                problems.push(why.clone());
                self.dead = Some(why);
            }
        }
        (notes, problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(used: Option<(u32, u32)>, status: u8) -> Observed {
        Observed {
            used,
            advanced: u16::from(used.is_some()),
            status,
            waited: Duration::from_micros(20),
            timed_out: false,
        }
    }

    #[test]
    fn test_judge_malformed_cases() {
        let (live, broken) = (status::LIVE, status::LIVE | status::NEEDS_RESET);
        for case in [Case::BadAddress, Case::LoopingChain, Case::Oversized] {
            let h = case.head();
            let dropped = judge(case, h, &seen(Some((u32::from(h), 0)), live)).unwrap();
            assert_eq!(dropped, format!("dropped: used id {h} len 0 after 20 µs"));
            let reset = judge(case, h, &seen(None, broken)).unwrap();
            assert!(reset.starts_with("NEEDS_RESET after 20 µs: device_status 0x4f"), "{reset}");
            assert!(judge(case, h, &seen(Some((u32::from(h), 0)), broken))
                .unwrap()
                .starts_with("dropped and NEEDS_RESET"));
            let hang = Observed { waited: Duration::from_secs(2), timed_out: true, ..seen(None, live) };
            assert_eq!(
                judge(case, h, &hang).unwrap_err(),
                "neither a used element nor NEEDS_RESET within 2.00 s (expected the buffer back (dropped) or \
                 NEEDS_RESET); device_status 0x0f (ACKNOWLEDGE|DRIVER|FEATURES_OK|DRIVER_OK)"
            );
            assert!(judge(case, h, &seen(Some((u32::from(h), 72)), live)).unwrap_err().contains("len 0"));
            assert!(judge(case, h, &seen(Some((9, 0)), live)).unwrap_err().contains("returned descriptor 9"));
            let twice = Observed { advanced: 2, ..seen(Some((u32::from(h), 0)), live) };
            assert!(judge(case, h, &twice).unwrap_err().contains("moved by 2"));
            assert!(judge(case, h, &seen(None, 0xff)).unwrap_err().contains("stopped answering"));
        }
    }

    #[test]
    fn test_judge_avail_jump_and_good_frame() {
        let (live, broken) = (status::LIVE, status::LIVE | status::NEEDS_RESET);
        assert!(judge(Case::AvailJump, 0, &seen(None, broken)).is_ok());
        assert!(judge(Case::AvailJump, 0, &seen(Some((0, 0)), live))
            .unwrap_err()
            .contains("instead of setting NEEDS_RESET"));
        assert!(judge(Case::AvailJump, 0, &seen(None, live)).unwrap_err().contains("expected NEEDS_RESET"));
        assert_eq!(
            judge(Case::GoodFrame, 0, &seen(Some((0, 0)), live)).unwrap(),
            "consumed: used id 0 len 0 after 20 µs"
        );
        assert!(judge(Case::GoodFrame, 0, &seen(None, broken)).unwrap_err().contains("after a good frame"));
        assert!(judge(Case::GoodFrame, 0, &seen(None, live)).unwrap_err().contains("expected the buffer back)"));
    }

    #[test]
    fn test_human_durations() {
        assert_eq!(human(Duration::from_micros(999)), "999 µs");
        assert_eq!(human(Duration::from_micros(1500)), "1.5 ms");
        assert_eq!(human(Duration::from_millis(2500)), "2.50 s");
    }

    #[test]
    fn test_names() {
        assert_eq!(
            feature_names(feature::VERSION_1 | feature::NET_MAC | feature::NET_MTU | 1 << 40),
            "MTU|MAC|VERSION_1|0x10000000000"
        );
        assert_eq!(feature_names(0), "none");
        assert_eq!(status_names(0), "reset");
        assert_eq!(status_names(0x4f), "ACKNOWLEDGE|DRIVER|FEATURES_OK|DRIVER_OK|NEEDS_RESET");
        assert_eq!(status_names(0x13), "ACKNOWLEDGE|DRIVER|0x10");
    }

    #[test]
    fn test_byte_and_halfword_access_on_a_mapping() {
        let mut buf = crate::dma::PinnedBuffer::new(PAGE_SIZE).unwrap();
        buf.write32(0, 0x4433_2211);
        assert_eq!((buf.read8(0), buf.read8(3), buf.read16(2)), (0x11, 0x44, 0x4433));
        buf.write8(1, 0xaa);
        buf.write16(2, 0xbbcc);
        assert_eq!(buf.read32(0), 0xbbcc_aa11);
        // Outside or misaligned: all-ones, writes dropped.
        assert_eq!((buf.read16(1), buf.read16(PAGE_SIZE), buf.read8(PAGE_SIZE)), (u16::MAX, u16::MAX, u8::MAX));
        buf.write16(3, 0);
        buf.write8(PAGE_SIZE, 0);
        assert_eq!(buf.read32(0), 0xbbcc_aa11);
    }
}
