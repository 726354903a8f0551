//! The virtio-net device: one receive and one transmit queue over the modern PCI
//! transport, its frames carried by a [`FramePort`].
//!
//! When the driver sets DRIVER_OK two worker threads start, one a queue: `vnet-rx-<key>`
//! waits (epoll) on the receive doorbell, the port and a stop eventfd, `vnet-tx-<key>` on
//! the transmit doorbell and the stop eventfd. Apart, a transmitter waiting on a full peer
//! (the wire holds a frame for a full peer a moment, as a RoCE fabric's PFC pause does,
//! see [`crate::net`]) never keeps the receiver from draining the port: two nodes sending
//! to each other at once cannot stall each other. A reset (status 0, or
//! [`PciDevice::reset`]) and dropping the device stop and join both. Transmit strips the
//! frame with its 12-byte `virtio_net_hdr_v1` (checked and tidied, [`super::offload`]);
//! receive rewrites the header of what came for what this guest accepted and writes header
//! and frame across the buffer's writable descriptors, so the chains of pages Linux posts for an MTU above 1500
//! without `MRG_RXBUF` work. While no receive buffer is posted the port is not polled:
//! frames wait in the port's socket (the wire drops what no longer fits), never in the VMM.
//!
//! These features cut the guest's work, each used only when the driver accepts it (without
//! them the device behaves as a plain VERSION_1 device):
//! - `VIRTIO_NET_F_MRG_RXBUF` (virtio 1.x 5.1.6.4): a received frame may take several
//!   buffers (descriptor chains). Header and frame are written across successive chains,
//!   each filled as far as its room, and the header's `num_buffers` (in the first chain)
//!   says how many; the chains go to the used ring together, the used index moved once,
//!   so a driver never sees part of a frame. Linux then posts one-descriptor buffers sized
//!   by an average of recent frames instead of chains of pages for a large MTU. When the available chains run out in the middle
//!   of a frame none is taken (the available position goes back where the frame started),
//!   the frame waits, and so does the port, until the driver posts more and kicks; a frame
//!   larger than everything the ring can hold (all its entries posted) is dropped, taking
//!   none. A malformed chain in the middle of a frame drops the frame: the chains it had
//!   taken go back with used length 0. Each chain must hold at least the 12-byte header,
//!   as the specification requires of the driver.
//! - `VIRTIO_RING_F_EVENT_IDX`: the device asks for a kick only when it is about to sleep
//!   on a queue (the available event index set where it stopped, then the ring looked at
//!   again so that a chain posted meanwhile is not left waiting), and interrupts only when
//!   the used index passes the driver's `used_event`. The receive queue asks for kicks only
//!   once it has run out of buffers.
//! - `VIRTIO_NET_F_CSUM` and `VIRTIO_NET_F_GUEST_CSUM`, `HOST_TSO4`/`6` and
//!   `GUEST_TSO4`/`6`: a checksum left to the device and a TCP frame of up to 64 KiB to
//!   segment travel as the guest asked; the receiving device completes the checksum or
//!   segments the frame only when its own guest cannot take it so ([`super::offload`]).
//!   A header asking for a checksum outside the frame, or for a segmentation the driver
//!   did not negotiate, is a malformed chain. TSO is offered only on a wire that carries
//!   64 KiB packets (not UDP between hosts). No UDP segmentation (UFO, USO) or ECN.
//!
//! What a guest gets wrong is dropped, counted in [`NetStats`], and logged once per kind:
//! a chain that loops or points outside the descriptor table, a buffer outside guest
//! memory, a frame longer than [`MAX_FRAME`] or shorter than an Ethernet header, a
//! descriptor of the wrong direction, a checksum to complete outside the frame. The chain
//! goes back with used length 0. A ring the device cannot make sense of (the available
//! index moved by more than the queue size, a head index beyond the queue, rings outside
//! guest memory) sets DEVICE_NEEDS_RESET with a configuration interrupt, and the queues
//! are left alone until the driver resets.

use std::collections::VecDeque;
use std::num::Wrapping;
use std::ops::Range;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use gdrvm_model::node::NetParams;
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_MTU,
    VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP,
};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_AVAIL_F_NO_INTERRUPT};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemory, GuestMemoryMmap, Permissions};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::offload::{self, Accepted, BadHeader, Incoming};
use super::transport::{
    add_capabilities, Action, Capabilities, Interrupts, Transport, COMMON_CFG, COMMON_CFG_LEN, DEVICE_CFG, ISR_CFG,
    ISR_CFG_LEN, NOTIFY_CFG, NOTIFY_OFF_MULTIPLIER, PCI_CFG_DATA, VIRTIO_BAR, VIRTIO_BAR_SIZE,
};
use crate::emu::LogOnce;
use crate::net::{FramePort, WireStats};
use crate::pci::regs::{
    PCI_CAPABILITY_LIST, PCI_CAP_ID_MSIX, PCI_CAP_LIST_NEXT, PCI_MSIX_FLAGS, PCI_MSIX_PBA, PCI_MSIX_TABLE,
};
use crate::{BarInfo, BarMapping, ConfigSpace, DeviceError, IoEvent, MsixLayout, PciDevice};

/// The receive queue.
pub const RX_QUEUE: usize = 0;
/// The transmit queue.
pub const TX_QUEUE: usize = 1;
/// Queues: one receive/transmit pair.
const QUEUES: u16 = 2;
/// Bytes of `virtio_net_hdr_v1` (VERSION_1: `num_buffers` is always there): the wire's
/// offload header.
pub const NET_HDR_LEN: usize = crate::net::OFFLOAD_LEN;
/// The longest frame the device carries either way (64 KiB plus an Ethernet header with
/// a VLAN tag, as the wire does); a longer transmit chain is malformed.
pub const MAX_FRAME: usize = crate::net::MAX_FRAME;
/// The shortest frame the device sends: an Ethernet header.
const MIN_FRAME: usize = crate::net::MIN_FRAME;
/// Bytes of the device configuration (`virtio_net_config` up to `mtu`).
const NET_CONFIG_LEN: usize = 12;
/// Where `num_buffers` is in the header.
const NUM_BUFFERS: usize = 10;

/// Features offered: VERSION_1, MAC, MTU, STATUS, EVENT_IDX, mergeable receive buffers
/// (MRG_RXBUF) and the two checksum offloads (CSUM, GUEST_CSUM); [`TSO_FEATURES`] too where
/// the wire carries 64 KiB packets.
const FEATURES: u64 = 1 << VIRTIO_F_VERSION_1
    | 1 << VIRTIO_NET_F_MAC
    | 1 << VIRTIO_NET_F_MTU
    | 1 << VIRTIO_NET_F_STATUS
    | 1 << VIRTIO_RING_F_EVENT_IDX
    | 1 << VIRTIO_NET_F_MRG_RXBUF
    | 1 << VIRTIO_NET_F_CSUM
    | 1 << VIRTIO_NET_F_GUEST_CSUM;
/// TCP segmentation both ways, over IPv4 and IPv6.
const TSO_FEATURES: u64 = 1 << VIRTIO_NET_F_HOST_TSO4
    | 1 << VIRTIO_NET_F_HOST_TSO6
    | 1 << VIRTIO_NET_F_GUEST_TSO4
    | 1 << VIRTIO_NET_F_GUEST_TSO6;

/// Chains a worker moves on its queue before it looks at its other sources again.
const BUDGET: usize = 256;

/// Epoll tokens of the workers.
const TOKEN_STOP: u64 = 0;
const TOKEN_KICK: u64 = 1;
const TOKEN_PORT: u64 = 2;

/// Why a virtio-net device cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum VirtioError {
    /// The doorbell eventfds could not be created.
    #[error("cannot create the doorbell eventfds")]
    EventFd(#[source] std::io::Error),
    /// The configuration space has no room left for the virtio capabilities.
    #[error("no room for the virtio capabilities in configuration space")]
    NoRoom,
    /// The configuration space lacks the MSI-X capability the device signals through.
    #[error("the configuration space has no MSI-X capability")]
    NoMsix,
}

/// Counters of a virtio-net device since it was made ([`VirtioNet::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames the guest sent that went to the port.
    pub tx_frames: u64,
    /// Bytes of those frames (without the virtio header).
    pub tx_bytes: u64,
    /// Well-formed frames the guest sent that were dropped: no port attached.
    pub tx_dropped: u64,
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Bytes of those frames (without the virtio header).
    pub rx_bytes: u64,
    /// Frames from the port dropped: the guest's buffer was too small or malformed (with
    /// MRG_RXBUF: a malformed chain among those the frame took, or the frame larger than
    /// all the buffers a full ring holds), or the port failed to receive.
    pub rx_dropped: u64,
    /// Descriptor chains dropped as malformed (either queue), a transmit header asking for
    /// a checksum outside its frame among them.
    pub malformed: u64,
    /// Times the device set DEVICE_NEEDS_RESET.
    pub needs_reset: u64,
    /// Receive doorbell writes (driver notifications) the receive worker has handled.
    pub rx_kicks: u64,
    /// Transmit doorbell writes the transmit worker has handled.
    pub tx_kicks: u64,
    /// The port's own counters, when a port is attached.
    pub wire: Option<WireStats>,
}

/// Counters shared with the worker.
#[derive(Default)]
struct Counters {
    tx_frames: AtomicU64,
    tx_bytes: AtomicU64,
    tx_dropped: AtomicU64,
    rx_frames: AtomicU64,
    rx_bytes: AtomicU64,
    rx_dropped: AtomicU64,
    malformed: AtomicU64,
    needs_reset: AtomicU64,
    rx_kicks: AtomicU64,
    tx_kicks: AtomicU64,
    /// Guest oddities already logged.
    odd: LogOnce,
}

impl Counters {
    fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Logs `what` as a warning the first time, at debug level after that.
    fn odd(&self, key: &str, what: &'static str, detail: std::fmt::Arguments<'_>) {
        if self.odd.first(what, 0) {
            tracing::warn!(device = %key, "{what}: {detail} (logged once; later ones at debug level)");
        } else {
            tracing::debug!(device = %key, "{what}: {detail}");
        }
    }
}

/// A virtio-net PCI function ("virtio-net-pci", modern, 1af4:1041).
pub struct VirtioNet {
    key: String,
    config: ConfigSpace,
    power_on: ConfigSpace,
    caps: Capabilities,
    msix: MsixLayout,
    transport: Transport,
    net_config: [u8; NET_CONFIG_LEN],
    memory: GuestMemoryMmap,
    port: Option<Arc<dyn FramePort>>,
    counters: Arc<Counters>,
    workers: Option<Workers>,
}

/// The running worker threads, receive and transmit.
struct Workers {
    /// Written to stop both (each also writes it when it ends on a broken ring).
    stop: EventFd,
    threads: Vec<JoinHandle<()>>,
}

impl VirtioNet {
    /// Device `key` (the function's name in logs and the worker's thread name) presenting
    /// `config_space` (`ConfigSpace::for_function` of an endpoint with virtio IDs, BAR 0 of
    /// 32 KiB and MSI-X, to which the virtio capabilities are appended), offering `net`'s
    /// MAC and MTU, reaching guest RAM through `memory`, its frames carried by `port`
    /// (`None`: the link is down and transmitted frames are dropped).
    pub fn new(
        key: &str,
        config_space: ConfigSpace,
        net: NetParams,
        memory: GuestMemoryMmap,
        port: Option<Box<dyn FramePort>>,
    ) -> Result<Self, VirtioError> {
        let mut config = config_space;
        let msix = find_msix(&config).ok_or(VirtioError::NoMsix)?;
        let caps = add_capabilities(&mut config, NET_CONFIG_LEN as u32, QUEUES).ok_or(VirtioError::NoRoom)?;
        let port: Option<Arc<dyn FramePort>> = port.map(Arc::from);
        let tso = port.as_ref().is_none_or(|p| p.max_packet() >= crate::net::MAX_PACKET);
        let features = FEATURES | if tso { TSO_FEATURES } else { 0 };
        let transport = Transport::new(key, features, QUEUES, msix.vectors).map_err(VirtioError::EventFd)?;
        let mut net_config = [0u8; NET_CONFIG_LEN];
        net_config[..6].copy_from_slice(&net.mac);
        let link = if port.is_some() { VIRTIO_NET_S_LINK_UP as u16 } else { 0 };
        net_config[6..8].copy_from_slice(&link.to_le_bytes());
        // max_virtqueue_pairs (meaningful with MQ only, which is not offered).
        net_config[8..10].copy_from_slice(&1u16.to_le_bytes());
        net_config[10..12].copy_from_slice(&net.mtu.to_le_bytes());
        Ok(VirtioNet {
            key: key.to_owned(),
            power_on: config.clone(),
            config,
            caps,
            msix,
            transport,
            net_config,
            memory,
            port,
            counters: Arc::new(Counters::default()),
            workers: None,
        })
    }

    /// The device's counters: frames and bytes each way, drops, malformed chains, times it
    /// needed a reset, and the port's own counters.
    pub fn stats(&self) -> NetStats {
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        NetStats {
            tx_frames: get(&c.tx_frames),
            tx_bytes: get(&c.tx_bytes),
            tx_dropped: get(&c.tx_dropped),
            rx_frames: get(&c.rx_frames),
            rx_bytes: get(&c.rx_bytes),
            rx_dropped: get(&c.rx_dropped),
            malformed: get(&c.malformed),
            needs_reset: get(&c.needs_reset),
            rx_kicks: get(&c.rx_kicks),
            tx_kicks: get(&c.tx_kicks),
            wire: self.port.as_ref().map(|p| p.stats()),
        }
    }

    /// Where the virtio capabilities are in configuration space.
    pub fn capabilities(&self) -> Capabilities {
        self.caps
    }

    /// Whether the worker threads are running (DRIVER_OK set, and neither reset nor
    /// broken since).
    pub fn is_running(&self) -> bool {
        self.workers.as_ref().is_some_and(|w| w.threads.iter().all(|t| !t.is_finished()))
    }

    fn apply(&mut self, action: Action) {
        match action {
            Action::None => {}
            Action::Reset => {
                self.stop_workers();
                self.transport.reset();
            }
            Action::Start => self.start_workers(),
            Action::Stop => self.stop_workers(),
        }
    }

    fn needs_reset(&self, why: std::fmt::Arguments<'_>) {
        Counters::add(&self.counters.needs_reset, 1);
        self.counters.odd(&self.key, "device needs reset", why);
        self.transport.interrupts().set_needs_reset();
    }

    fn start_workers(&mut self) {
        self.stop_workers();
        let mut queues = [None, None];
        for (q, slot) in queues.iter_mut().enumerate() {
            match self.transport.build_queue(q, &self.memory) {
                Ok(queue) => *slot = queue,
                Err(e) => return self.needs_reset(format_args!("{e}")),
            }
        }
        let features = self.transport.driver_features();
        let accepted = |bit: u32| features & 1 << bit != 0;
        for queue in queues.iter_mut().flatten() {
            queue.set_event_idx(accepted(VIRTIO_RING_F_EVENT_IDX));
        }
        let [rx, tx] = queues;
        let (Some(rx_kick), Some(tx_kick)) =
            (self.transport.doorbell(RX_QUEUE).cloned(), self.transport.doorbell(TX_QUEUE).cloned())
        else {
            return;
        };
        let stop = match EventFd::new(EFD_NONBLOCK) {
            Ok(fd) => fd,
            Err(e) => return self.needs_reset(format_args!("cannot create the workers' stop eventfd: {e}")),
        };
        let rx_buf = vec![0u8; NET_HDR_LEN + MAX_FRAME];
        let path = |role: Role, queue: Option<Queue>| Datapath {
            key: self.key.clone(),
            role,
            mem: self.memory.clone(),
            queue,
            port: self.port.clone(),
            irq: self.transport.interrupts().clone(),
            counters: self.counters.clone(),
            descs: Vec::new(),
            rx_buf: Vec::new(),
            rx_pending: None,
            tx_buf: Vec::new(),
            port_armed: false,
            tx: Accepted {
                csum: accepted(VIRTIO_NET_F_CSUM),
                tso4: accepted(VIRTIO_NET_F_HOST_TSO4),
                tso6: accepted(VIRTIO_NET_F_HOST_TSO6),
            },
            rx: Accepted {
                csum: accepted(VIRTIO_NET_F_GUEST_CSUM),
                tso4: accepted(VIRTIO_NET_F_GUEST_TSO4),
                tso6: accepted(VIRTIO_NET_F_GUEST_TSO6),
            },
            rx_backlog: VecDeque::new(),
            mrg_rxbuf: accepted(VIRTIO_NET_F_MRG_RXBUF),
            rx_chains: Vec::new(),
        };
        let receiver = Datapath { rx_buf, ..path(Role::Rx, rx) };
        let transmitter = Datapath { tx_buf: Vec::with_capacity(NET_HDR_LEN + MAX_FRAME), ..path(Role::Tx, tx) };
        let mut workers = Workers { stop, threads: Vec::with_capacity(2) };
        for (datapath, kick) in [(receiver, rx_kick), (transmitter, tx_kick)] {
            let stop = match workers.stop.try_clone() {
                Ok(fd) => fd,
                Err(e) => {
                    self.workers = Some(workers);
                    self.stop_workers();
                    return self.needs_reset(format_args!("cannot clone the workers' stop eventfd: {e}"));
                }
            };
            let name = format!("vnet-{}-{}", datapath.role.name(), self.key).replace('\0', "");
            match std::thread::Builder::new().name(name).spawn(move || datapath.run(&stop, &kick)) {
                Ok(thread) => workers.threads.push(thread),
                Err(e) => {
                    self.workers = Some(workers);
                    self.stop_workers();
                    return self.needs_reset(format_args!("cannot start a worker thread: {e}"));
                }
            }
        }
        self.workers = Some(workers);
    }

    /// Stops and joins the workers, if they run.
    fn stop_workers(&mut self) {
        let Some(workers) = self.workers.take() else { return };
        if let Err(e) = workers.stop.write(1) {
            tracing::warn!(device = %self.key, "cannot stop the workers: {e}");
        }
        for thread in workers.threads {
            if thread.join().is_err() {
                tracing::warn!(device = %self.key, "a worker thread panicked");
            }
        }
    }

    /// The PCI configuration access capability's window: a BAR access of `length` bytes at
    /// `offset` of BAR `bar`, as the capability's registers say.
    fn pci_cfg_window(&self) -> (u8, u64, usize) {
        let at = self.caps.pci_cfg;
        let mut b = [0u8; 12];
        self.config.read(at + 4, &mut b);
        let offset = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let length = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        (b[0], u64::from(offset), length as usize)
    }
}

/// The MSI-X capability of `config`: where its table and pending bits are.
fn find_msix(config: &ConfigSpace) -> Option<MsixLayout> {
    let mut ptr = [0u8];
    config.read(PCI_CAPABILITY_LIST, &mut ptr);
    let mut at = usize::from(ptr[0] & !3);
    for _ in 0..48 {
        if at < 0x40 {
            return None;
        }
        let mut head = [0u8; 2];
        config.read(at, &mut head);
        if head[0] == PCI_CAP_ID_MSIX {
            let mut cap = [0u8; 12];
            config.read(at, &mut cap);
            let flags = u16::from_le_bytes([cap[PCI_MSIX_FLAGS], cap[PCI_MSIX_FLAGS + 1]]);
            let dword = |o: usize| u32::from_le_bytes([cap[o], cap[o + 1], cap[o + 2], cap[o + 3]]);
            let (table, pba) = (dword(PCI_MSIX_TABLE), dword(PCI_MSIX_PBA));
            return Some(MsixLayout {
                cap: at,
                vectors: (flags & 0x7ff) + 1,
                table: ((table & 7) as u8, u64::from(table & !7)),
                pba: ((pba & 7) as u8, u64::from(pba & !7)),
            });
        }
        at = usize::from(head[PCI_CAP_LIST_NEXT] & !3);
    }
    None
}

impl PciDevice for VirtioNet {
    fn config_read(&mut self, reg: usize, data: &mut [u8]) {
        self.config.read(reg, data);
        let window = self.caps.pci_cfg + PCI_CFG_DATA;
        if reg == window && !data.is_empty() {
            let (bar, offset, length) = self.pci_cfg_window();
            if matches!(length, 1 | 2 | 4) && length <= data.len() {
                self.bar_read(bar, offset, &mut data[..length]);
            }
        }
    }

    fn config_write(&mut self, reg: usize, data: &[u8]) {
        let window = self.caps.pci_cfg + PCI_CFG_DATA;
        if reg == window && !data.is_empty() {
            let (bar, offset, length) = self.pci_cfg_window();
            if matches!(length, 1 | 2 | 4) && length <= data.len() {
                self.bar_write(bar, offset, &data[..length]);
            }
            return;
        }
        self.config.write(reg, data);
    }

    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if bar != VIRTIO_BAR {
            data.fill(0xff);
            return;
        }
        let end = offset.saturating_add(data.len() as u64);
        let inside = |start: u64, len: u64| offset >= start && end <= start + len;
        if inside(COMMON_CFG, u64::from(COMMON_CFG_LEN)) {
            self.transport.read_common(offset - COMMON_CFG, data);
        } else if inside(ISR_CFG, u64::from(ISR_CFG_LEN).max(4)) {
            self.transport.read_isr(offset - ISR_CFG, data);
        } else if inside(DEVICE_CFG, 0x1000) {
            // Bytes past virtio_net_config read 0.
            for (i, byte) in data.iter_mut().enumerate() {
                *byte = self.net_config.get((offset - DEVICE_CFG) as usize + i).copied().unwrap_or(0);
            }
        }
        // Everything else in the BAR (doorbells, the gaps) reads 0.
    }

    fn bar_write(&mut self, bar: u8, offset: u64, data: &[u8]) {
        if bar != VIRTIO_BAR || data.is_empty() {
            return;
        }
        let notify_len = u64::from(QUEUES) * u64::from(NOTIFY_OFF_MULTIPLIER);
        if (COMMON_CFG..COMMON_CFG + u64::from(COMMON_CFG_LEN)).contains(&offset) {
            let action = self.transport.write_common(offset - COMMON_CFG, data);
            self.apply(action);
        } else if (NOTIFY_CFG..NOTIFY_CFG + notify_len).contains(&offset) {
            self.transport.write_notify(offset - NOTIFY_CFG);
        } else if offset < VIRTIO_BAR_SIZE {
            // The ISR and device configuration are read-only; the rest is unused.
            Counters::odd(
                &self.counters,
                &self.key,
                "write to a read-only part of BAR 0 dropped",
                format_args!("offset {offset:#x}"),
            );
        }
    }

    fn bars(&self) -> Vec<BarInfo> {
        vec![BarInfo {
            index: VIRTIO_BAR,
            size: VIRTIO_BAR_SIZE,
            is_64bit: true,
            prefetchable: false,
            mapping: BarMapping::Trapped,
        }]
    }

    fn msix(&self) -> Option<MsixLayout> {
        Some(self.msix)
    }

    fn connect_msix(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        let fds = match vectors {
            Some(v) => v
                .iter()
                .map(|fd| fd.try_clone())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|source| DeviceError::Interrupts { what: "connected", source })?,
            None => Vec::new(),
        };
        self.transport.interrupts().connect(fds);
        Ok(())
    }

    fn can_reset(&self) -> bool {
        true
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        self.stop_workers();
        self.transport.reset();
        self.config = self.power_on.clone();
        Ok(())
    }

    fn ioeventfds(&self) -> Vec<IoEvent> {
        let mut events = Vec::new();
        for q in 0..self.transport.num_queues() {
            let Some(fd) = self.transport.doorbell(q) else { continue };
            match fd.try_clone() {
                Ok(fd) => events.push(IoEvent {
                    bar: VIRTIO_BAR,
                    offset: NOTIFY_CFG + q as u64 * u64::from(NOTIFY_OFF_MULTIPLIER),
                    fd,
                }),
                Err(e) => tracing::warn!(device = %self.key, queue = q, "cannot clone the doorbell eventfd: {e}"),
            }
        }
        events
    }
}

impl Drop for VirtioNet {
    fn drop(&mut self) {
        self.stop_workers();
        tracing::debug!(device = %self.key, stats = ?self.stats(), "virtio-net: what it moved");
    }
}

/// Why a descriptor chain was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Malformed {
    /// The chain loops, or its next index is beyond the table, or it is empty.
    BrokenChain,
    /// A buffer lies (partly) outside guest memory.
    BadAddress,
    /// A transmit chain with a device-writable buffer, or a receive chain with a
    /// device-readable one.
    WrongDirection,
    /// A transmit frame longer than [`MAX_FRAME`].
    TooLong,
    /// A transmit chain shorter than the header and an Ethernet header.
    TooShort,
    /// A transmit header asking for a checksum (NEEDS_CSUM, CSUM negotiated) whose start
    /// and offset put it (partly) outside the frame.
    ChecksumOutside,
    /// A transmit header asking for a segmentation the driver did not negotiate, or that
    /// is not TCP, lacks NEEDS_CSUM or has `gso_size` 0.
    Segmentation,
    /// With MRG_RXBUF, a receive chain smaller than the 12-byte header.
    ShortBuffer,
}

impl Malformed {
    fn describe(self) -> &'static str {
        match self {
            Malformed::BrokenChain => "malformed descriptor chain (loops, next index out of range, or empty) dropped",
            Malformed::BadAddress => "descriptor buffer outside guest memory dropped",
            Malformed::WrongDirection => "descriptor of the wrong direction for its queue dropped",
            Malformed::TooLong => "transmitted frame longer than 65550 bytes dropped",
            Malformed::TooShort => "transmitted frame shorter than an Ethernet header dropped",
            Malformed::ChecksumOutside => "transmitted frame asking for a checksum outside itself dropped",
            Malformed::Segmentation => "transmitted frame asking for a segmentation not negotiated or not TCP dropped",
            Malformed::ShortBuffer => "mergeable receive buffer smaller than the virtio-net header dropped",
        }
    }
}

/// A ring the device cannot make sense of: DEVICE_NEEDS_RESET.
struct Fatal(String);

/// The queue a worker thread serves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// The receive queue, fed from the port.
    Rx,
    /// The transmit queue, sent into the port.
    Tx,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Rx => "rx",
            Role::Tx => "tx",
        }
    }
}

/// A worker's state: its queue, the port, buffers.
struct Datapath {
    key: String,
    role: Role,
    mem: GuestMemoryMmap,
    /// The queue this worker serves (`None`: the driver did not enable it).
    queue: Option<Queue>,
    port: Option<Arc<dyn FramePort>>,
    irq: Arc<Interrupts>,
    counters: Arc<Counters>,
    /// The current chain's descriptors (with `mrg_rxbuf` on receive, the non-empty ones of
    /// the chains taken for the pending frame).
    descs: Vec<Descriptor>,
    /// A header (num_buffers 1; with `mrg_rxbuf`, set for each frame to the chains it
    /// takes) then room for one frame from the port.
    rx_buf: Vec<u8>,
    /// Length of the frame in `rx_buf` waiting for a receive buffer.
    rx_pending: Option<usize>,
    tx_buf: Vec<u8>,
    /// Whether the port's fd is in the epoll set.
    port_armed: bool,
    /// What the driver accepted for transmit headers (CSUM, HOST_TSO4/6).
    tx: Accepted,
    /// What it accepted for receive headers (GUEST_CSUM, GUEST_TSO4/6).
    rx: Accepted,
    /// Packets (header and frame) waiting for receive buffers ahead of the port: the
    /// segments of a GSO frame this guest cannot take whole.
    rx_backlog: VecDeque<Vec<u8>>,
    /// VIRTIO_NET_F_MRG_RXBUF accepted: a received frame may take several chains.
    mrg_rxbuf: bool,
    /// With `mrg_rxbuf`, the chains taken for the pending frame (their descriptors in
    /// `descs`).
    rx_chains: Vec<RxChain>,
}

impl Datapath {
    /// Serves the queue until `stop` is written or the ring is found broken.
    fn run(mut self, stop: &EventFd, kick: &EventFd) {
        if let Err(f) = self.serve(stop, kick) {
            self.fatal(f);
            // The other worker stops too: the queues are left alone until the reset.
            if let Err(e) = stop.write(1) {
                tracing::warn!(device = %self.key, "cannot stop the other worker: {e}");
            }
        }
    }

    fn serve(&mut self, stop: &EventFd, kick: &EventFd) -> Result<(), Fatal> {
        let epoll = Epoll::new().map_err(|e| Fatal(format!("cannot create the worker's epoll: {e}")))?;
        for (fd, token) in [(stop.as_raw_fd(), TOKEN_STOP), (kick.as_raw_fd(), TOKEN_KICK)] {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token))
                .map_err(|e| Fatal(format!("cannot watch the doorbell: {e}")))?;
        }
        // Doorbell writes this worker made itself (the transmit budget's come-back).
        let mut own_kicks = 0u64;
        // Buffers the driver posted before DRIVER_OK.
        match self.role {
            Role::Rx => {
                self.arm_port(&epoll, true);
                self.process_rx(&epoll)?;
            }
            Role::Tx => {
                if self.process_tx()? {
                    own_kicks += 1;
                    let _ = kick.write(1);
                }
            }
        }
        let mut events = [EpollEvent::default(); 3];
        loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Fatal(format!("epoll_wait failed: {e}"))),
            };
            for event in &events[..n] {
                match (event.data(), self.role) {
                    (TOKEN_STOP, _) => return Ok(()),
                    (TOKEN_KICK, Role::Rx) => {
                        let kicks = kick.read().unwrap_or(0);
                        // New buffers: frames waiting in the port can go in.
                        self.arm_port(&epoll, true);
                        self.process_rx(&epoll)?;
                        Counters::add(&self.counters.rx_kicks, kicks);
                    }
                    (TOKEN_KICK, Role::Tx) => {
                        // The driver's kicks, not the ones this worker gave itself.
                        let kicks = kick.read().unwrap_or(0).saturating_sub(std::mem::take(&mut own_kicks));
                        // Budget spent: come back after a look at the stop eventfd.
                        if self.process_tx()? {
                            own_kicks += 1;
                            let _ = kick.write(1);
                        }
                        Counters::add(&self.counters.tx_kicks, kicks);
                    }
                    _ => self.process_rx(&epoll)?,
                }
            }
        }
    }

    /// Sets DEVICE_NEEDS_RESET; the workers then end (the queues untouched until reset).
    fn fatal(&self, Fatal(why): Fatal) {
        Counters::add(&self.counters.needs_reset, 1);
        self.counters.odd(&self.key, "device needs reset", format_args!("{why}"));
        self.irq.set_needs_reset();
    }

    /// Adds the port's fd to (or removes it from) the epoll set.
    fn arm_port(&mut self, epoll: &Epoll, arm: bool) {
        let Some(port) = &self.port else { return };
        if self.port_armed == arm {
            return;
        }
        let fd: RawFd = port.as_raw_fd();
        let (op, what) = if arm { (ControlOperation::Add, "watch") } else { (ControlOperation::Delete, "unwatch") };
        match epoll.ctl(op, fd, EpollEvent::new(EventSet::IN, TOKEN_PORT)) {
            Ok(()) => self.port_armed = arm,
            Err(e) => tracing::warn!(device = %self.key, "cannot {what} the port: {e}"),
        }
    }

    fn malformed(&self, kind: Malformed, queue: usize, head: u16) {
        Counters::add(&self.counters.malformed, 1);
        self.counters.odd(&self.key, kind.describe(), format_args!("queue {queue}, head {head}"));
    }

    /// Sends the chains the driver has posted on the transmit queue, at most [`BUDGET`];
    /// returns whether more wait. With EVENT_IDX the driver kicks again only once the
    /// device has asked for it ([`rearm`]), which it does here when the queue is empty.
    fn process_tx(&mut self) -> Result<bool, Fatal> {
        let Some(queue) = self.queue.as_mut() else { return Ok(false) };
        let event_idx = queue.event_idx_enabled();
        if event_idx {
            // No kicks while the device works through the ring. (With EVENT_IDX this is
            // implicit: the driver stops kicking once it has passed the available event
            // index, which stays where the device last asked.)
            queue.disable_notification(&self.mem).map_err(|e| Fatal(format!("transmit queue: {e}")))?;
        }
        let mut used = 0;
        while used < BUDGET {
            let Some(chain) = next_chain(queue, &self.mem, TX_QUEUE)? else { break };
            let head = chain.head_index();
            let tx = self.tx;
            let tx_buf = &mut self.tx_buf;
            let gathered = gather(chain, &mut self.descs, tx_buf).and_then(|frame| {
                offload::outgoing(&mut tx_buf[..NET_HDR_LEN], frame, tx).map_err(|e| match e {
                    BadHeader::ChecksumOutside => Malformed::ChecksumOutside,
                    BadHeader::Segmentation => Malformed::Segmentation,
                })?;
                Ok(frame)
            });
            match gathered {
                Ok(frame) => match &self.port {
                    Some(port) => {
                        port.send(&self.tx_buf[..NET_HDR_LEN + frame]);
                        Counters::add(&self.counters.tx_frames, 1);
                        Counters::add(&self.counters.tx_bytes, frame as u64);
                    }
                    None => Counters::add(&self.counters.tx_dropped, 1),
                },
                Err(kind) => {
                    Counters::add(&self.counters.malformed, 1);
                    self.counters.odd(&self.key, kind.describe(), format_args!("queue {TX_QUEUE}, head {head}"));
                }
            }
            queue
                .add_used(&self.mem, head, 0)
                .map_err(|e| Fatal(format!("transmit queue: cannot return a chain: {e}")))?;
            used += 1;
        }
        // A full budget that emptied the ring exactly must ask for the next kick as well:
        // with EVENT_IDX the available event index would stay where the device last asked,
        // behind the driver, which then never kicks again (a stall seen with a full ring).
        let more = if used == BUDGET && has_available(queue, &self.mem)? {
            true
        } else if event_idx {
            // The ring is empty: ask for the next kick, and take what came meanwhile.
            rearm(queue, &self.mem, TX_QUEUE)?
        } else {
            false
        };
        if used > 0 {
            interrupt(queue, &self.mem, &self.irq, TX_QUEUE);
        }
        Ok(more)
    }

    /// Moves frames from the port into the receive buffers while both are there, at most
    /// [`BUDGET`] frames (the port's fd stays readable for the rest). With EVENT_IDX the
    /// driver is asked for a kick ([`rearm`]) only when the buffers have run out.
    fn process_rx(&mut self, epoll: &Epoll) -> Result<(), Fatal> {
        let Some(port) = self.port.clone() else { return Ok(()) };
        if let Some(queue) = self.queue.as_mut().filter(|q| q.event_idx_enabled()) {
            // Kicks for new buffers are wanted only once the device runs out (see below).
            queue.disable_notification(&self.mem).map_err(|e| Fatal(format!("receive queue: {e}")))?;
        }
        // Where the used index stood: with MRG_RXBUF the interrupt is decided past it.
        let used_before = Wrapping(self.queue.as_ref().map_or(0, |q| q.next_used()));
        // Frames handled, chains returned, and (MRG_RXBUF) looks again at a ring that moved
        // while the device asked for a kick.
        let mut frames = 0;
        let mut used = 0;
        let mut retries = 0;
        while frames < BUDGET {
            let Some(queue) = self.queue.as_mut() else {
                self.arm_port(epoll, false);
                break;
            };
            if self.rx_pending.is_none() {
                // A frame leaves the port only when a buffer waits for it.
                if !has_available(queue, &self.mem)? {
                    if queue.event_idx_enabled() && rearm(queue, &self.mem, RX_QUEUE)? {
                        // Buffers came while the kick was being asked for (they bring
                        // none): the port stays watched and its frames go in next turn.
                        break;
                    }
                    self.arm_port(epoll, false);
                    break;
                }
                if let Some(packet) = self.rx_backlog.pop_front() {
                    self.rx_buf[..packet.len()].copy_from_slice(&packet);
                    self.rx_pending = Some(packet.len() - NET_HDR_LEN);
                } else {
                    match port.recv(&mut self.rx_buf) {
                        Ok(Some(len)) if len >= NET_HDR_LEN + MIN_FRAME => {
                            match offload::incoming(&mut self.rx_buf[..len], self.rx) {
                                Incoming::Deliver => self.rx_pending = Some(len - NET_HDR_LEN),
                                Incoming::Segments(segments) => {
                                    self.rx_backlog.extend(segments);
                                    continue;
                                }
                                Incoming::Drop(why) => {
                                    Counters::add(&self.counters.rx_dropped, 1);
                                    self.counters.odd(&self.key, why, format_args!("{len} bytes"));
                                    frames += 1;
                                    continue;
                                }
                            }
                        }
                        Ok(Some(len)) => {
                            Counters::add(&self.counters.rx_dropped, 1);
                            self.counters.odd(
                                &self.key,
                                "received packet too short dropped",
                                format_args!("{len} bytes"),
                            );
                            frames += 1;
                            continue;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            Counters::add(&self.counters.rx_dropped, 1);
                            self.counters.odd(&self.key, "port receive failed", format_args!("{e}"));
                            break;
                        }
                    }
                }
            }
            if self.mrg_rxbuf {
                match self.receive_merged()? {
                    Merged::Returned(n) => used += n,
                    Merged::Dropped => {}
                    // Chains came while the kick was being asked for, with none: try again.
                    // Not counted as a frame (the frame must not be left waiting for a kick
                    // that will not come); the ring's size bounds how often a driver posting
                    // forward can cause it, and only one moving its index back and forth
                    // can exhaust the retries, waiting then for its next kick.
                    Merged::Wait { more: true } if retries < BUDGET => {
                        retries += 1;
                        continue;
                    }
                    Merged::Wait { .. } => {
                        // The frame waits, and with it the port, for the driver's next kick.
                        self.arm_port(epoll, false);
                        break;
                    }
                }
                frames += 1;
                continue;
            }
            let Some(chain) = next_chain(queue, &self.mem, RX_QUEUE)? else {
                // Only a driver moving its index back gets here: wait for its next kick.
                if !(queue.event_idx_enabled() && rearm(queue, &self.mem, RX_QUEUE)?) {
                    self.arm_port(epoll, false);
                }
                break;
            };
            let head = chain.head_index();
            let frame = self.rx_pending.take().unwrap_or(0);
            let len = match scatter(chain, &mut self.descs, &self.rx_buf[..NET_HDR_LEN + frame]) {
                Ok(len) => {
                    Counters::add(&self.counters.rx_frames, 1);
                    Counters::add(&self.counters.rx_bytes, frame as u64);
                    len
                }
                Err(RxError::TooSmall(room)) => {
                    Counters::add(&self.counters.rx_dropped, 1);
                    self.counters.odd(
                        &self.key,
                        "received frame larger than the guest's buffer dropped",
                        format_args!("frame {frame} bytes, buffer {room} bytes with the header"),
                    );
                    0
                }
                Err(RxError::Malformed(kind)) => {
                    Counters::add(&self.counters.rx_dropped, 1);
                    self.malformed(kind, RX_QUEUE, head);
                    0
                }
            };
            let queue = self.queue.as_mut().ok_or_else(|| Fatal("receive queue vanished".into()))?;
            queue
                .add_used(&self.mem, head, len)
                .map_err(|e| Fatal(format!("receive queue: cannot return a chain: {e}")))?;
            used += 1;
            frames += 1;
        }
        if let (true, Some(queue)) = (used > 0, self.queue.as_mut()) {
            if self.mrg_rxbuf {
                interrupt_since(queue, &self.mem, &self.irq, RX_QUEUE, used_before);
            } else {
                interrupt(queue, &self.mem, &self.irq, RX_QUEUE);
            }
        }
        Ok(())
    }

    /// MRG_RXBUF: writes the pending frame (its header in `rx_buf`) across as many receive
    /// chains as it needs and returns them together, or takes none and says why.
    fn receive_merged(&mut self) -> Result<Merged, Fatal> {
        let Some(frame) = self.rx_pending else { return Ok(Merged::Dropped) };
        let queue = self.queue.as_mut().ok_or_else(|| Fatal("receive queue vanished".into()))?;
        let need = NET_HDR_LEN + frame;
        let start = queue.next_avail();
        let taken = take_buffers(queue, &self.mem, &mut self.descs, &mut self.rx_chains, need)?;
        let bad = match taken {
            Taken::Enough => {
                let n = u16::try_from(self.rx_chains.len()).unwrap_or(u16::MAX);
                self.rx_buf[NUM_BUFFERS..NET_HDR_LEN].copy_from_slice(&n.to_le_bytes());
                match fill(&self.mem, &self.descs, &mut self.rx_chains, &self.rx_buf[..need]) {
                    Ok(()) => {
                        Counters::add(&self.counters.rx_frames, 1);
                        Counters::add(&self.counters.rx_bytes, frame as u64);
                        None
                    }
                    Err(head) => Some((Malformed::BadAddress, head)),
                }
            }
            Taken::Malformed(kind, head) => Some((kind, head)),
            Taken::Short { full } => {
                // Nothing is taken. EVENT_IDX: the kick is asked for at the end of what
                // the driver has posted (where the device stands now), not where the frame
                // started: the chains in between are posted already and bring no kick.
                let more = if !full && queue.event_idx_enabled() { rearm(queue, &self.mem, RX_QUEUE)? } else { false };
                queue.set_next_avail(start);
                if !full {
                    return Ok(Merged::Wait { more });
                }
                // Every entry of the ring is posted and still too small: the driver cannot
                // add any, so the frame could wait forever.
                self.rx_pending = None;
                Counters::add(&self.counters.rx_dropped, 1);
                self.counters.odd(
                    &self.key,
                    "received frame larger than all the guest's receive buffers together dropped",
                    format_args!("frame {frame} bytes, {} buffers", self.rx_chains.len()),
                );
                return Ok(Merged::Dropped);
            }
        };
        self.rx_pending = None;
        if let Some((kind, head)) = bad {
            // The frame is dropped; every chain it took goes back empty.
            for c in &mut self.rx_chains {
                c.used = 0;
            }
            Counters::add(&self.counters.rx_dropped, 1);
            self.malformed(kind, RX_QUEUE, head);
        }
        let queue = self.queue.as_mut().ok_or_else(|| Fatal("receive queue vanished".into()))?;
        publish_used(queue, &self.mem, &self.rx_chains)?;
        Ok(Merged::Returned(self.rx_chains.len()))
    }
}

/// What became of a pending frame with MRG_RXBUF.
enum Merged {
    /// This many chains went to the used ring: the frame, or (dropped) the chains it took
    /// up to a malformed one, empty.
    Returned(usize),
    /// Dropped without taking a chain.
    Dropped,
    /// The available chains ran out: none taken, the frame still pending. `more`: chains
    /// were posted while the kick was being asked for (EVENT_IDX), which bring no kick.
    Wait { more: bool },
}

/// A receive chain taken for a frame (MRG_RXBUF).
struct RxChain {
    head: u16,
    /// Its non-empty descriptors in `Datapath::descs`.
    descs: Range<usize>,
    /// Bytes written into it, its used length.
    used: u32,
}

/// What [`take_buffers`] found.
enum Taken {
    /// The chains taken hold header and frame.
    Enough,
    /// The last chain taken (`head`) is malformed.
    Malformed(Malformed, u16),
    /// The available chains ran out first; `full`: they fill the ring (every entry, or
    /// as many descriptors as the table has), so the driver cannot post another.
    Short { full: bool },
}

/// Takes available chains from the receive queue into `chains` (their descriptors into
/// `descs`) until they hold `need` bytes, a malformed one comes, or none is left.
fn take_buffers(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    descs: &mut Vec<Descriptor>,
    chains: &mut Vec<RxChain>,
    need: usize,
) -> Result<Taken, Fatal> {
    descs.clear();
    chains.clear();
    let mut room = 0u64;
    // Descriptors (empty ones included) the chains taken use.
    let mut used_descs = 0usize;
    loop {
        let Some(chain) = next_chain(queue, mem, RX_QUEUE)? else {
            let size = usize::from(queue.size());
            return Ok(Taken::Short { full: chains.len() >= size || used_descs >= size });
        };
        let head = chain.head_index();
        let from = descs.len();
        let taken = writable_chain(mem, chain, descs);
        chains.push(RxChain { head, descs: from..descs.len(), used: 0 });
        match taken {
            Ok((bytes, count)) => {
                room += bytes;
                used_descs += count;
                if room >= need as u64 {
                    return Ok(Taken::Enough);
                }
            }
            Err(kind) => return Ok(Taken::Malformed(kind, head)),
        }
    }
}

/// Appends the non-empty descriptors of a receive `chain` to `descs` (MRG_RXBUF); returns
/// its room and how many descriptors it has. A chain that is broken, has a device-readable
/// descriptor, a buffer outside guest memory, or less room than the header is malformed.
fn writable_chain(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
    descs: &mut Vec<Descriptor>,
) -> Result<(u64, usize), Malformed> {
    let from = descs.len();
    let (mut count, mut room, mut last_next, mut readable) = (0usize, 0u64, true, false);
    for d in chain {
        count += 1;
        last_next = d.has_next();
        readable |= !d.is_write_only();
        if d.len() > 0 {
            room += u64::from(d.len());
            descs.push(d);
        }
    }
    if count == 0 || last_next {
        return Err(Malformed::BrokenChain);
    }
    if readable {
        return Err(Malformed::WrongDirection);
    }
    if !in_memory(mem, &descs[from..], Permissions::Write) {
        return Err(Malformed::BadAddress);
    }
    if room < NET_HDR_LEN as u64 {
        return Err(Malformed::ShortBuffer);
    }
    Ok((room, count))
}

/// Writes `bytes` (header and frame) across `chains` in order, each filled as far as its
/// room, and sets their used lengths; a write that fails names its chain's head.
fn fill(mem: &GuestMemoryMmap, descs: &[Descriptor], chains: &mut [RxChain], bytes: &[u8]) -> Result<(), u16> {
    let mut rest = bytes;
    for c in chains.iter_mut() {
        let mut written = 0u32;
        for d in descs.get(c.descs.clone()).unwrap_or_default() {
            if rest.is_empty() {
                break;
            }
            let n = rest.len().min(d.len() as usize);
            mem.write_slice(&rest[..n], d.addr()).map_err(|_| c.head)?;
            rest = &rest[n..];
            written += n as u32;
        }
        c.used = written;
    }
    Ok(())
}

/// Adds `chains` to `queue`'s used ring (each with its used length) and only then moves
/// the used index, once: a driver sees all of a frame's buffers or none (Linux drops a
/// frame whose `num_buffers` are not all there yet). The interrupt is decided with
/// [`interrupt_since`], virtio-queue's `needs_notification` not knowing of these entries.
fn publish_used(queue: &mut Queue, mem: &GuestMemoryMmap, chains: &[RxChain]) -> Result<(), Fatal> {
    if chains.is_empty() {
        return Ok(());
    }
    let size = queue.size();
    let ring = GuestAddress(queue.used_ring());
    let vanished = || Fatal("receive queue: the used ring is outside guest memory".into());
    let mut next = Wrapping(queue.next_used());
    for c in chains {
        let slot = u64::from(next.0.checked_rem(size).ok_or_else(vanished)?);
        let at = ring.checked_add(4 + 8 * slot).ok_or_else(vanished)?;
        let mut elem = [0u8; 8];
        elem[..4].copy_from_slice(&u32::from(c.head).to_le_bytes());
        elem[4..].copy_from_slice(&c.used.to_le_bytes());
        mem.write_slice(&elem, at).map_err(|_| vanished())?;
        next += Wrapping(1);
    }
    let idx = ring.checked_add(2).ok_or_else(vanished)?;
    // Release: the entries before the index that publishes them.
    mem.store(next.0.to_le(), idx, Ordering::Release).map_err(|_| vanished())?;
    queue.set_next_used(next.0);
    Ok(())
}

/// Whether the driver has posted chains the device has not taken.
fn has_available(queue: &Queue, mem: &GuestMemoryMmap) -> Result<bool, Fatal> {
    let avail =
        queue.avail_idx(mem, Ordering::Acquire).map_err(|e| Fatal(format!("cannot read the available index: {e}")))?;
    Ok(avail != Wrapping(queue.next_avail()))
}

/// The next chain the driver posted on `queue`, or `None`.
fn next_chain<'m>(
    queue: &mut Queue,
    mem: &'m GuestMemoryMmap,
    index: usize,
) -> Result<Option<DescriptorChain<&'m GuestMemoryMmap>>, Fatal> {
    let avail = queue
        .avail_idx(mem, Ordering::Acquire)
        .map_err(|e| Fatal(format!("queue {index}: cannot read the available index: {e}")))?;
    let next = Wrapping(queue.next_avail());
    let waiting = (avail - next).0;
    if waiting == 0 {
        return Ok(None);
    }
    if waiting > queue.size() {
        return Err(Fatal(format!(
            "queue {index}: available index {} is {waiting} ahead of the device's {}, more than the queue's {} entries",
            avail.0,
            next.0,
            queue.size()
        )));
    }
    let size = queue.size();
    let chain = queue
        .iter(mem)
        .map_err(|e| Fatal(format!("queue {index}: {e}")))?
        .next()
        .ok_or_else(|| Fatal(format!("queue {index}: cannot read the available ring")))?;
    if chain.head_index() >= size {
        return Err(Fatal(format!(
            "queue {index}: head index {} beyond the queue's {size} entries",
            chain.head_index()
        )));
    }
    Ok(Some(chain))
}

/// Collects `chain`'s descriptors into `descs`; a chain that ends on a descriptor that
/// still points on (a loop cut by the queue size, a next index or indirect table out of
/// range) or has none is broken.
fn collect(chain: DescriptorChain<&GuestMemoryMmap>, descs: &mut Vec<Descriptor>) -> Result<(), Malformed> {
    descs.clear();
    descs.extend(chain);
    match descs.last() {
        Some(last) if !last.has_next() => Ok(()),
        _ => Err(Malformed::BrokenChain),
    }
}

/// Whether every descriptor of `descs` lies in guest memory.
fn in_memory(mem: &GuestMemoryMmap, descs: &[Descriptor], access: Permissions) -> bool {
    descs.iter().all(|d| GuestMemory::check_range(mem, d.addr(), d.len() as usize, access))
}

/// Reads a transmit chain into `buf` (header and frame); returns the frame's length.
fn gather(
    chain: DescriptorChain<&GuestMemoryMmap>,
    descs: &mut Vec<Descriptor>,
    buf: &mut Vec<u8>,
) -> Result<usize, Malformed> {
    let mem = chain.memory();
    collect(chain.clone(), descs)?;
    if descs.iter().any(Descriptor::is_write_only) {
        return Err(Malformed::WrongDirection);
    }
    let total: u64 = descs.iter().map(|d| u64::from(d.len())).sum();
    if total > (NET_HDR_LEN + MAX_FRAME) as u64 {
        return Err(Malformed::TooLong);
    }
    let total = total as usize;
    if total < NET_HDR_LEN + MIN_FRAME {
        return Err(Malformed::TooShort);
    }
    if !in_memory(mem, descs, Permissions::Read) {
        return Err(Malformed::BadAddress);
    }
    buf.resize(total, 0);
    let mut at = 0;
    for d in descs.iter() {
        let len = d.len() as usize;
        mem.read_slice(&mut buf[at..at + len], d.addr()).map_err(|_| Malformed::BadAddress)?;
        at += len;
    }
    Ok(total - NET_HDR_LEN)
}

/// Why a receive buffer could not take a frame.
enum RxError {
    /// The buffer (this many bytes) is smaller than header and frame.
    TooSmall(u64),
    Malformed(Malformed),
}

/// Writes `bytes` (header and frame) across a receive chain's buffers; returns the used
/// length.
fn scatter(
    chain: DescriptorChain<&GuestMemoryMmap>,
    descs: &mut Vec<Descriptor>,
    bytes: &[u8],
) -> Result<u32, RxError> {
    let mem = chain.memory();
    collect(chain.clone(), descs).map_err(RxError::Malformed)?;
    if !descs.iter().all(Descriptor::is_write_only) {
        return Err(RxError::Malformed(Malformed::WrongDirection));
    }
    if !in_memory(mem, descs, Permissions::Write) {
        return Err(RxError::Malformed(Malformed::BadAddress));
    }
    let room: u64 = descs.iter().map(|d| u64::from(d.len())).sum();
    if room < bytes.len() as u64 {
        return Err(RxError::TooSmall(room));
    }
    let mut rest = bytes;
    for d in descs.iter() {
        if rest.is_empty() {
            break;
        }
        let n = rest.len().min(d.len() as usize);
        mem.write_slice(&rest[..n], d.addr()).map_err(|_| RxError::Malformed(Malformed::BadAddress))?;
        rest = &rest[n..];
    }
    Ok(bytes.len() as u32)
}

/// EVENT_IDX: asks the driver to kick for the next chain it posts (the available event
/// index set to where the device stopped), then looks at the ring again: returns whether
/// chains were posted meanwhile, which may come with no kick and must be taken now.
fn rearm(queue: &mut Queue, mem: &GuestMemoryMmap, index: usize) -> Result<bool, Fatal> {
    queue
        .enable_notification(mem)
        .map_err(|e| Fatal(format!("queue {index}: cannot set the available event index: {e}")))
}

/// Signals `queue`'s vector after used buffers were added, unless the driver does not want
/// it: with EVENT_IDX, unless the used index did not pass the driver's `used_event` since
/// the last check; without, unless VRING_AVAIL_F_NO_INTERRUPT is set.
fn interrupt(queue: &mut Queue, mem: &GuestMemoryMmap, irq: &Interrupts, index: usize) {
    if queue.event_idx_enabled() {
        // needs_notification fences the used ring's writes before reading used_event, and
        // looks at every entry added since its last call.
        match queue.needs_notification(mem) {
            Ok(true) => irq.queue(index),
            Ok(false) => {}
            Err(e) => {
                // Rings are checked to lie in guest memory; should it fail anyway, a
                // spurious interrupt is harmless where a lost one is not.
                tracing::debug!(queue = index, "cannot read used_event: {e}");
                irq.queue(index);
            }
        }
        return;
    }
    interrupt_unless_flagged(queue, mem, irq, index);
}

/// [`interrupt`] for entries added with [`publish_used`], the used index having stood at
/// `old` at the last decision: with EVENT_IDX, unless it did not pass the driver's
/// `used_event` since; without, unless VRING_AVAIL_F_NO_INTERRUPT is set.
fn interrupt_since(queue: &Queue, mem: &GuestMemoryMmap, irq: &Interrupts, index: usize, old: Wrapping<u16>) {
    if !queue.event_idx_enabled() {
        return interrupt_unless_flagged(queue, mem, irq, index);
    }
    // The used ring's writes before used_event is read.
    fence(Ordering::SeqCst);
    let new = Wrapping(queue.next_used());
    let at = queue.avail_ring().checked_add(4 + 2 * u64::from(queue.size()));
    match at.map(|at| mem.load::<u16>(GuestAddress(at), Ordering::Acquire)) {
        // virtio 1.x 2.7.10 (vring_need_event): used_event in [old, new).
        Some(Ok(event)) => {
            if new - Wrapping(u16::from_le(event)) - Wrapping(1) < new - old {
                irq.queue(index);
            }
        }
        // As in interrupt: a spurious interrupt is harmless where a lost one is not.
        _ => irq.queue(index),
    }
}

/// Signals `queue`'s vector unless the driver set VRING_AVAIL_F_NO_INTERRUPT (no EVENT_IDX).
fn interrupt_unless_flagged(queue: &Queue, mem: &GuestMemoryMmap, irq: &Interrupts, index: usize) {
    // The used ring's writes before the driver's flags are read.
    fence(Ordering::SeqCst);
    let flags: u16 = mem.load(GuestAddress(queue.avail_ring()), Ordering::Acquire).map(u16::from_le).unwrap_or(0);
    if flags & VRING_AVAIL_F_NO_INTERRUPT as u16 == 0 {
        irq.queue(index);
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
