//! virtio-net driven as a guest driver would: through BAR 0 and configuration space, with
//! rings and buffers in a `GuestMemoryMmap` over anonymous memory and a port made of a
//! datagram socket pair. Waits are bounded (a few seconds at most, polled every
//! millisecond), so a broken device fails a test instead of hanging it.

use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gdrvm_model::node::{NetAttach, NetParams, Node, VIRTIO_NET_DEVICE, VIRTIO_VENDOR};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GSO, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_ECN, VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6,
    VIRTIO_NET_F_HOST_UFO, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF, VIRTIO_NET_F_MTU, VIRTIO_NET_F_STATUS,
};
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::*;
use crate::pci::regs::{PCI_CAP_ID_VNDR, PCI_CAP_LIST_ID};
use crate::virtio::transport::{
    CAP_COMMON_CFG, CAP_DEVICE_CFG, CAP_ISR_CFG, CAP_NOTIFY_CFG, CAP_PCI_CFG, NOTIFY_OFF_MULTIPLIER,
};

const MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
const MEM_SIZE: usize = 4 << 20;
/// Entries per queue the test driver uses.
const QSIZE: u16 = 16;
/// Where each queue's descriptor table, driver area and device area are.
const RINGS: [(u64, u64, u64); 2] = [(0x1000, 0x2000, 0x3000), (0x4000, 0x5000, 0x6000)];
/// MSI-X vectors the test driver assigns.
const CONFIG_VECTOR: u16 = 0;
const QUEUE_VECTORS: [u16; 2] = [1, 2];
const WAIT: Duration = Duration::from_secs(5);

/// Common configuration field offsets.
const DEVICE_FEATURE_SELECT: u64 = 0;
const DEVICE_FEATURE: u64 = 4;
const DRIVER_FEATURE_SELECT: u64 = 8;
const DRIVER_FEATURE: u64 = 12;
const MSIX_CONFIG: u64 = 16;
const NUM_QUEUES: u64 = 18;
const DEVICE_STATUS: u64 = 20;
const QUEUE_SELECT: u64 = 22;
const QUEUE_SIZE: u64 = 24;
const QUEUE_MSIX_VECTOR: u64 = 26;
const QUEUE_ENABLE: u64 = 28;
const QUEUE_NOTIFY_OFF: u64 = 30;
const QUEUE_DESC: u64 = 32;
const QUEUE_DRIVER: u64 = 40;
const QUEUE_DEVICE: u64 = 48;

const ACK_DRIVER: u8 = (VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER) as u8;
const FEATURES_OK: u8 = VIRTIO_CONFIG_S_FEATURES_OK as u8;
const DRIVER_OK: u8 = VIRTIO_CONFIG_S_DRIVER_OK as u8;
const NEEDS_RESET: u8 = VIRTIO_CONFIG_S_NEEDS_RESET as u8;
const DRIVER_FEATURES: u64 =
    1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_NET_F_MTU | 1 << VIRTIO_NET_F_STATUS;
const EVENT_IDX: u64 = 1 << VIRTIO_RING_F_EVENT_IDX;
const CSUM: u64 = 1 << VIRTIO_NET_F_CSUM;
const GUEST_CSUM: u64 = 1 << VIRTIO_NET_F_GUEST_CSUM;
const MRG: u64 = 1 << VIRTIO_NET_F_MRG_RXBUF;
const TSO: u64 = 1 << VIRTIO_NET_F_HOST_TSO4
    | 1 << VIRTIO_NET_F_HOST_TSO6
    | 1 << VIRTIO_NET_F_GUEST_TSO4
    | 1 << VIRTIO_NET_F_GUEST_TSO6;
/// `flags` of a header: NEEDS_CSUM (transmit), DATA_VALID (receive).
const NEEDS_CSUM: u8 = 1;
const DATA_VALID: u8 = 2;

/// A port over one end of a datagram socket pair; the test holds the other end.
struct FakePort {
    sock: UnixDatagram,
    sent: AtomicU64,
    received: AtomicU64,
    /// While true, `send` waits, as the wire does for a full peer.
    paused: Arc<Pause>,
    /// What [`FramePort::max_packet`] says.
    limit: usize,
}

/// A switch the test flips to hold a port's sends.
#[derive(Default)]
struct Pause {
    on: Mutex<bool>,
    changed: Condvar,
}

impl Pause {
    fn set(&self, on: bool) {
        *self.on.lock().unwrap() = on;
        self.changed.notify_all();
    }

    /// Waits while paused, at most [`WAIT`].
    fn wait(&self) {
        let on = self.on.lock().unwrap();
        let _ = self.changed.wait_timeout_while(on, WAIT, |on| *on).unwrap();
    }
}

impl FramePort for FakePort {
    fn send(&self, frame: &[u8]) {
        self.paused.wait();
        if self.sock.send(frame).is_ok() {
            self.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn recv(&self, buf: &mut [u8]) -> std::io::Result<Option<usize>> {
        match self.sock.recv(buf) {
            Ok(n) => {
                self.received.fetch_add(1, Ordering::Relaxed);
                Ok(Some(n))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn as_raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    fn max_packet(&self) -> usize {
        self.limit
    }

    fn stats(&self) -> WireStats {
        WireStats {
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            dropped: 0,
        }
    }
}

/// The minimal preset with nic0 turned into virtio-net (MTU `mtu`): the node and nic0's index.
fn node(mtu: u16) -> (Node, usize) {
    let attach = NetAttach { endpoint: "nic0".into(), mac: Some("52:54:00:12:34:56".into()), mtu: Some(mtu) };
    let node = Node::resolve_with("minimal", &[attach]).expect("minimal preset with virtio-net");
    let i = node.functions.iter().position(|f| f.name == "nic0").expect("nic0");
    (node, i)
}

/// A test driver: the device, guest memory, MSI-X eventfds, the far end of the port.
struct Guest {
    dev: VirtioNet,
    mem: GuestMemoryMmap,
    vectors: Vec<EventFd>,
    peer: Option<UnixDatagram>,
    /// Holds the port's sends while set.
    paused: Arc<Pause>,
    /// Next free descriptor, next avail index, used entries already seen, per queue.
    next_desc: [u16; 2],
    avail: [u16; 2],
    used_seen: [u16; 2],
    /// Doorbell writes made, per queue.
    kicks: [u64; 2],
}

impl Guest {
    /// A device named `key` with a port (or none) and MTU `mtu`, MSI-X connected.
    fn new(key: &str, with_port: bool, mtu: u16) -> Guest {
        Guest::with_limit(key, with_port, mtu, crate::net::MAX_PACKET)
    }

    /// A device whose port carries packets of at most `limit` bytes (a UDP wire's 65507).
    fn with_port_limit(key: &str, limit: usize) -> Guest {
        Guest::with_limit(key, true, 1500, limit)
    }

    fn with_limit(key: &str, with_port: bool, mtu: u16, limit: usize) -> Guest {
        let (node, i) = node(mtu);
        let f = &node.functions[i];
        assert_eq!((f.vendor, f.device), (VIRTIO_VENDOR, VIRTIO_NET_DEVICE));
        let net = f.net.unwrap_or(NetParams { mac: MAC, mtu });
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).unwrap();
        let paused = Arc::new(Pause::default());
        let (port, peer) = if with_port {
            let (a, b) = UnixDatagram::pair().unwrap();
            a.set_nonblocking(true).unwrap();
            b.set_read_timeout(Some(WAIT)).unwrap();
            let port: Box<dyn FramePort> = Box::new(FakePort {
                sock: a,
                sent: AtomicU64::new(0),
                received: AtomicU64::new(0),
                paused: paused.clone(),
                limit,
            });
            (Some(port), Some(b))
        } else {
            (None, None)
        };
        let mut dev = VirtioNet::new(key, ConfigSpace::for_function(&node, i), net, mem.clone(), port).unwrap();
        let vectors: Vec<EventFd> = (0..16).map(|_| EventFd::new(EFD_NONBLOCK).unwrap()).collect();
        let refs: Vec<&EventFd> = vectors.iter().collect();
        dev.connect_msix(Some(&refs)).unwrap();
        Guest { dev, mem, vectors, peer, paused, next_desc: [0; 2], avail: [0; 2], used_seen: [0; 2], kicks: [0; 2] }
    }

    /// A device with a port, negotiated and running.
    fn running(key: &str, mtu: u16) -> Guest {
        let mut g = Guest::new(key, true, mtu);
        g.bring_up();
        g
    }

    fn read(&mut self, offset: u64, size: usize) -> u64 {
        let mut b = [0u8; 8];
        self.dev.bar_read(0, COMMON_CFG + offset, &mut b[..size]);
        u64::from_le_bytes(b)
    }

    fn write(&mut self, offset: u64, size: usize, value: u64) {
        self.dev.bar_write(0, COMMON_CFG + offset, &value.to_le_bytes()[..size]);
    }

    fn status(&mut self) -> u8 {
        self.read(DEVICE_STATUS, 1) as u8
    }

    fn set_status(&mut self, status: u8) {
        self.write(DEVICE_STATUS, 1, u64::from(status));
    }

    fn device_features(&mut self) -> u64 {
        self.write(DEVICE_FEATURE_SELECT, 4, 0);
        let low = self.read(DEVICE_FEATURE, 4);
        self.write(DEVICE_FEATURE_SELECT, 4, 1);
        low | self.read(DEVICE_FEATURE, 4) << 32
    }

    /// Resets, acknowledges, writes `features` and sets FEATURES_OK; returns the status
    /// read back.
    fn negotiate(&mut self, features: u64) -> u8 {
        self.set_status(0);
        self.set_status(ACK_DRIVER);
        for word in 0..2 {
            self.write(DRIVER_FEATURE_SELECT, 4, word);
            self.write(DRIVER_FEATURE, 4, (features >> (32 * word)) & 0xffff_ffff);
        }
        self.set_status(ACK_DRIVER | FEATURES_OK);
        self.status()
    }

    /// Sets both queues up as Linux does (size, rings as two dword halves, vector, enable).
    fn setup_queues(&mut self) {
        self.write(MSIX_CONFIG, 2, u64::from(CONFIG_VECTOR));
        for q in 0..2 {
            self.write(QUEUE_SELECT, 2, q as u64);
            self.write(QUEUE_SIZE, 2, u64::from(QSIZE));
            let (desc, driver, device) = RINGS[q];
            for (field, addr) in [(QUEUE_DESC, desc), (QUEUE_DRIVER, driver), (QUEUE_DEVICE, device)] {
                self.write(field, 4, addr & 0xffff_ffff);
                self.write(field + 4, 4, addr >> 32);
            }
            self.write(QUEUE_MSIX_VECTOR, 2, u64::from(QUEUE_VECTORS[q]));
            assert_eq!(self.read(QUEUE_MSIX_VECTOR, 2), u64::from(QUEUE_VECTORS[q]));
            self.write(QUEUE_ENABLE, 2, 1);
        }
    }

    fn bring_up(&mut self) {
        self.bring_up_with(DRIVER_FEATURES);
    }

    /// Brings the device up with `features` accepted.
    fn bring_up_with(&mut self, features: u64) {
        // Zeroed rings, as a driver allocates them.
        for (desc, driver, device) in RINGS {
            for addr in [desc, driver, device] {
                self.mem.write_slice(&[0u8; 0x1000], GuestAddress(addr)).unwrap();
            }
        }
        self.next_desc = [0; 2];
        self.avail = [0; 2];
        self.used_seen = [0; 2];
        assert_ne!(self.negotiate(features) & FEATURES_OK, 0);
        self.setup_queues();
        self.set_status(ACK_DRIVER | FEATURES_OK | DRIVER_OK);
        assert!(self.dev.is_running());
    }

    fn write_desc(&self, q: usize, index: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let at = RINGS[q].0 + 16 * u64::from(index);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..16].copy_from_slice(&next.to_le_bytes());
        self.mem.write_slice(&d, GuestAddress(at)).unwrap();
    }

    /// Makes `head` available on queue `q` (no kick).
    fn publish(&mut self, q: usize, head: u16) {
        let driver = RINGS[q].1;
        let slot = driver + 4 + 2 * u64::from(self.avail[q] % QSIZE);
        self.mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail[q] = self.avail[q].wrapping_add(1);
        self.mem.write_obj(self.avail[q], GuestAddress(driver + 2)).unwrap();
    }

    /// Posts a chain of `bufs` (address, length) on queue `q`, device-writable or not; returns its head.
    fn post(&mut self, q: usize, bufs: &[(u64, u32)], writable: bool) -> u16 {
        let head = self.next_desc[q];
        let n = bufs.len() as u16;
        for (i, &(addr, len)) in bufs.iter().enumerate() {
            let index = (head + i as u16) % QSIZE;
            let last = i as u16 + 1 == n;
            let mut flags = if writable { VRING_DESC_F_WRITE as u16 } else { 0 };
            if !last {
                flags |= VRING_DESC_F_NEXT as u16;
            }
            self.write_desc(q, index, addr, len, flags, (index + 1) % QSIZE);
        }
        self.next_desc[q] = (head + n) % QSIZE;
        self.publish(q, head);
        head
    }

    /// Posts one raw descriptor (its own chain) and returns its index.
    fn post_raw(&mut self, q: usize, addr: u64, len: u32, flags: u16, next: Option<u16>) -> u16 {
        let index = self.next_desc[q];
        self.write_desc(q, index, addr, len, flags, next.unwrap_or(index));
        self.next_desc[q] = (index + 1) % QSIZE;
        self.publish(q, index);
        index
    }

    fn kick(&mut self, q: usize) {
        self.kicks[q] += 1;
        self.dev.bar_write(0, NOTIFY_CFG + q as u64 * u64::from(NOTIFY_OFF_MULTIPLIER), &(q as u16).to_le_bytes());
    }

    fn used_idx(&self, q: usize) -> u16 {
        self.mem.read_obj(GuestAddress(RINGS[q].2 + 2)).unwrap()
    }

    /// Waits (bounded) for `n` more used entries on queue `q`; returns them as (id, len).
    fn wait_used(&mut self, q: usize, n: u16) -> Vec<(u32, u32)> {
        let target = self.used_seen[q].wrapping_add(n);
        let deadline = Instant::now() + WAIT;
        while self.used_idx(q) != target {
            assert!(Instant::now() < deadline, "queue {q}: used index {} never reached {target}", self.used_idx(q));
            std::thread::sleep(Duration::from_millis(1));
        }
        let used = (0..n)
            .map(|i| {
                let slot = RINGS[q].2 + 4 + 8 * u64::from(self.used_seen[q].wrapping_add(i) % QSIZE);
                let id: u32 = self.mem.read_obj(GuestAddress(slot)).unwrap();
                let len: u32 = self.mem.read_obj(GuestAddress(slot + 4)).unwrap();
                (id, len)
            })
            .collect();
        self.used_seen[q] = target;
        used
    }

    /// Waits (bounded) for MSI-X `vector`'s eventfd to fire; consumes it.
    fn fired(&self, vector: u16) -> bool {
        let fd = &self.vectors[usize::from(vector)];
        let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, WAIT.as_millis() as i32) };
        n == 1 && fd.read().is_ok()
    }

    /// EVENT_IDX: the driver's `used_event` of queue `q` (after the available ring).
    fn set_used_event(&self, q: usize, value: u16) {
        self.mem.write_obj(value, GuestAddress(RINGS[q].1 + 4 + 2 * u64::from(QSIZE))).unwrap();
    }

    /// EVENT_IDX: the device's `avail_event` of queue `q` (after the used ring).
    fn avail_event(&self, q: usize) -> u16 {
        self.mem.read_obj(GuestAddress(RINGS[q].2 + 4 + 8 * u64::from(QSIZE))).unwrap()
    }

    /// Interrupts signalled on `vector` and not yet taken (without waiting); takes them.
    fn pending(&self, vector: u16) -> u64 {
        self.vectors[usize::from(vector)].read().unwrap_or(0)
    }

    /// Posts `bytes` (header and frame) as one transmit chain at `addr` and kicks.
    fn transmit(&mut self, addr: u64, bytes: &[u8]) -> u16 {
        self.mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        let head = self.post(TX_QUEUE, &[(addr, bytes.len() as u32)], false);
        self.kick(TX_QUEUE);
        head
    }

    /// Makes sure both workers have finished what they were doing: one chain on `via` goes
    /// through (a frame out, or a frame in), and each worker has handled every doorbell
    /// write made to its queue (the other queue's worker runs on a thread of its own, so
    /// the chain alone says nothing of it).
    fn settle(&mut self, via: usize) {
        if via == TX_QUEUE {
            let mut bytes = vec![0u8; NET_HDR_LEN];
            bytes.extend_from_slice(&frame(60, 0x5e));
            self.transmit(0x3f000, &bytes);
        } else {
            self.post(RX_QUEUE, &[(0x3e000, 2048)], true);
            self.kick(RX_QUEUE);
            self.send_from_wire(&frame(60, 0x5e));
        }
        self.wait_used(via, 1);
        let deadline = Instant::now() + WAIT;
        loop {
            let stats = self.dev.stats();
            if [stats.rx_kicks, stats.tx_kicks] == [self.kicks[RX_QUEUE], self.kicks[TX_QUEUE]] {
                return;
            }
            assert!(Instant::now() < deadline, "workers handled {stats:?} of {:?} kicks", self.kicks);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Sends `frame` to the device as a peer without offloads would (a plain header).
    fn send_from_wire(&self, frame: &[u8]) {
        self.send_packet_from_wire(&offload::plain_header(), frame);
    }

    /// Sends `frame` with offload header `header`, as another device would.
    fn send_packet_from_wire(&self, header: &[u8], frame: &[u8]) {
        self.peer.as_ref().unwrap().send(&[header, frame].concat()).unwrap();
    }

    /// The next frame the device sent, its header asking nothing of the receiver.
    fn recv_on_wire(&self) -> Vec<u8> {
        let (header, frame) = self.recv_packet_on_wire();
        assert_eq!(header, offload::plain_header(), "the header of a frame that asks nothing");
        frame
    }

    /// The next packet the device sent: its offload header and its frame.
    fn recv_packet_on_wire(&self) -> ([u8; NET_HDR_LEN], Vec<u8>) {
        let mut buf = vec![0u8; 70000];
        let n = self.peer.as_ref().unwrap().recv(&mut buf).expect("a packet on the wire");
        assert!(n >= NET_HDR_LEN, "{n} bytes: no header");
        let mut header = [0u8; NET_HDR_LEN];
        header.copy_from_slice(&buf[..NET_HDR_LEN]);
        (header, buf[NET_HDR_LEN..n].to_vec())
    }

    /// Posts a receive buffer of `len` bytes (filled with 0xee) at each of `addrs`, each its
    /// own one-descriptor chain, as Linux does with MRG_RXBUF (no kick); returns (head, address).
    fn post_rx_buffers(&mut self, addrs: &[u64], len: u32) -> Vec<(u16, u64)> {
        addrs
            .iter()
            .map(|&addr| {
                self.mem.write_slice(&vec![0xee; len as usize], GuestAddress(addr)).unwrap();
                (self.post(RX_QUEUE, &[(addr, len)], true), addr)
            })
            .collect()
    }

    /// What the device wrote into the used buffers `used`, in order, each found at its
    /// address in `posted`: header and frame, concatenated.
    fn received(&self, used: &[(u32, u32)], posted: &[(u16, u64)]) -> Vec<u8> {
        let mut got = Vec::new();
        for &(id, len) in used {
            let addr = posted.iter().find(|(head, _)| u32::from(*head) == id).expect("a posted buffer").1;
            let mut part = vec![0u8; len as usize];
            self.mem.read_slice(&mut part, GuestAddress(addr)).unwrap();
            got.extend_from_slice(&part);
        }
        got
    }

    /// EVENT_IDX: kicks the receive queue if the device asked for it for the buffers
    /// posted since avail index `old`, as Linux's virtqueue_kick_prepare; without, always.
    fn kick_rx_if_asked(&mut self, event_idx: bool, old: u16) {
        fence(Ordering::SeqCst);
        if !event_idx || need_event(self.avail_event(RX_QUEUE), self.avail[RX_QUEUE], old) {
            self.kick(RX_QUEUE);
        }
    }
}

/// A receive header as the device writes it without GUEST_CSUM: zero but `num_buffers`.
fn rx_header(num_buffers: u16) -> [u8; NET_HDR_LEN] {
    let mut h = [0u8; NET_HDR_LEN];
    h[10..].copy_from_slice(&num_buffers.to_le_bytes());
    h
}

/// An Ethernet frame of `len` bytes with a recognisable payload.
fn frame(len: usize, seed: u8) -> Vec<u8> {
    let mut f: Vec<u8> = (0..len).map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed)).collect();
    f[..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&MAC);
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    f
}

/// Whether a thread of this process has the name `name` (as the kernel keeps it).
fn thread_exists(name: &str) -> bool {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .any(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|comm| comm.trim_end() == name))
}

/// Waits (bounded) until thread `name` exists or not: a new thread names itself once it
/// runs, and a joined one leaves /proc an instant after it has exited.
fn thread_becomes(name: &str, exists: bool) -> bool {
    let deadline = Instant::now() + WAIT;
    while thread_exists(name) != exists {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

#[test]
fn test_feature_negotiation() {
    let mut g = Guest::new("t1", true, 1500);
    assert_eq!(g.device_features(), DRIVER_FEATURES | EVENT_IDX | MRG | CSUM | GUEST_CSUM | TSO);
    // TCP segmentation both ways; no UDP segmentation, legacy GSO or ECN.
    for gso in [VIRTIO_NET_F_GSO, VIRTIO_NET_F_GUEST_UFO, VIRTIO_NET_F_HOST_UFO, VIRTIO_NET_F_HOST_ECN] {
        assert_eq!(g.device_features() & 1 << gso, 0, "feature {gso} offered");
    }
    assert_eq!(g.read(NUM_QUEUES, 2), 2);

    // Without VERSION_1: FEATURES_OK does not stick.
    let status = g.negotiate(1 << VIRTIO_NET_F_MAC | 1 << VIRTIO_NET_F_STATUS);
    assert_eq!(status & FEATURES_OK, 0);
    assert_eq!(status, ACK_DRIVER);

    // A feature not offered (HOST_UFO), VERSION_1 or not: refused.
    assert_eq!(g.negotiate(DRIVER_FEATURES | CSUM | 1 << VIRTIO_NET_F_HOST_UFO) & FEATURES_OK, 0);
    // The new ones offered are accepted.
    let all = DRIVER_FEATURES | EVENT_IDX | MRG | CSUM | GUEST_CSUM;
    assert_eq!(g.negotiate(all), ACK_DRIVER | FEATURES_OK);
    assert_eq!(g.dev.transport.driver_features(), all);

    // A bit in a feature word the device does not have: refused.
    g.set_status(0);
    g.set_status(ACK_DRIVER);
    g.write(DRIVER_FEATURE_SELECT, 4, 0);
    g.write(DRIVER_FEATURE, 4, DRIVER_FEATURES & 0xffff_ffff);
    g.write(DRIVER_FEATURE_SELECT, 4, 1);
    g.write(DRIVER_FEATURE, 4, DRIVER_FEATURES >> 32);
    g.write(DRIVER_FEATURE_SELECT, 4, 2);
    g.write(DRIVER_FEATURE, 4, 1);
    g.set_status(ACK_DRIVER | FEATURES_OK);
    assert_eq!(g.status() & FEATURES_OK, 0);

    // Reset clears everything.
    g.set_status(0);
    assert_eq!(g.status(), 0);
    g.write(DRIVER_FEATURE_SELECT, 4, 0);
    assert_eq!(g.read(DRIVER_FEATURE, 4), 0);

    // A subset with VERSION_1: accepted, and fixed from then on.
    let subset = 1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_NET_F_MAC;
    assert_eq!(g.negotiate(subset), ACK_DRIVER | FEATURES_OK);
    assert_eq!(g.dev.transport.driver_features(), subset);
    g.write(DRIVER_FEATURE_SELECT, 4, 0);
    g.write(DRIVER_FEATURE, 4, 0);
    assert_eq!(g.dev.transport.driver_features(), subset);

    // The device configuration: MAC, link up (a port is attached), one pair, the MTU.
    let mut cfg = [0u8; 12];
    g.dev.bar_read(0, DEVICE_CFG, &mut cfg);
    assert_eq!(&cfg[..6], &MAC);
    assert_eq!(u16::from_le_bytes([cfg[6], cfg[7]]), 1);
    assert_eq!(u16::from_le_bytes([cfg[8], cfg[9]]), 1);
    assert_eq!(u16::from_le_bytes([cfg[10], cfg[11]]), 1500);
}

#[test]
fn test_capability_walk_finds_virtio_structures() {
    let mut g = Guest::new("t2", true, 1500);
    let read = |dev: &mut VirtioNet, at: usize, len: usize| {
        let mut b = [0u8; 4];
        dev.config_read(at, &mut b[..len]);
        u32::from_le_bytes(b)
    };
    let mut found = std::collections::BTreeMap::new();
    let mut msix = false;
    let mut at = read(&mut g.dev, PCI_CAPABILITY_LIST, 1) as usize;
    let mut hops = 0;
    while at != 0 {
        hops += 1;
        assert!(hops < 48, "the capability list loops");
        assert_eq!(at % 4, 0);
        let id = read(&mut g.dev, at + PCI_CAP_LIST_ID, 1) as u8;
        if id == PCI_CAP_ID_MSIX {
            msix = true;
        }
        if id == PCI_CAP_ID_VNDR {
            let cfg_type = read(&mut g.dev, at + 3, 1) as u8;
            let bar = read(&mut g.dev, at + 4, 1);
            let offset = read(&mut g.dev, at + 8, 4);
            let length = read(&mut g.dev, at + 12, 4);
            let multiplier = (cfg_type == CAP_NOTIFY_CFG).then(|| read(&mut g.dev, at + 16, 4));
            let cap_len = if matches!(cfg_type, CAP_NOTIFY_CFG | CAP_PCI_CFG) { 20 } else { 16 };
            assert_eq!(read(&mut g.dev, at + 2, 1), cap_len, "cap_len of cfg_type {cfg_type}");
            found.insert(cfg_type, (at, bar, offset, length, multiplier));
        }
        at = read(&mut g.dev, at + PCI_CAP_LIST_NEXT, 1) as usize & !3;
    }
    assert!(msix, "the MSI-X capability stays in the list");
    let common = found[&CAP_COMMON_CFG];
    assert_eq!((common.1, common.2, common.3), (0, 0x1000, 56));
    assert_eq!((found[&CAP_ISR_CFG].1, found[&CAP_ISR_CFG].2), (0, 0x2000));
    assert_eq!((found[&CAP_DEVICE_CFG].1, found[&CAP_DEVICE_CFG].2, found[&CAP_DEVICE_CFG].3), (0, 0x3000, 12));
    let notify = found[&CAP_NOTIFY_CFG];
    assert_eq!((notify.1, notify.2, notify.3, notify.4), (0, 0x4000, 8, Some(4)));
    assert!(found.contains_key(&CAP_PCI_CFG));
    assert_eq!(g.dev.capabilities().common, found[&CAP_COMMON_CFG].0);

    // Each queue's doorbell: notify offset + queue_notify_off * multiplier.
    for q in 0..2u64 {
        g.write(QUEUE_SELECT, 2, q);
        assert_eq!(g.read(QUEUE_NOTIFY_OFF, 2), q);
    }
    let doorbells: Vec<(u8, u64)> = g.dev.ioeventfds().iter().map(|e| (e.bar, e.offset)).collect();
    assert_eq!(doorbells, vec![(0, 0x4000), (0, 0x4004)]);

    // What the VMM needs: BAR 0 trapped, MSI-X table at its start and the PBA at 0x100.
    let bars = g.dev.bars();
    assert_eq!(bars.len(), 1);
    assert_eq!((bars[0].index, bars[0].size, bars[0].is_64bit, bars[0].prefetchable), (0, 0x8000, true, false));
    let m = g.dev.msix().unwrap();
    assert_eq!((m.cap, m.vectors, m.table, m.pba), (0x80, 16, (0, 0), (0, 0x100)));

    // The PCI configuration access capability reaches BAR 0: num_queues through it.
    let cap = found[&CAP_PCI_CFG].0;
    g.dev.config_write(cap + 4, &[0]);
    g.dev.config_write(cap + 8, &(0x1000u32 + NUM_QUEUES as u32).to_le_bytes());
    g.dev.config_write(cap + 12, &2u32.to_le_bytes());
    assert_eq!(read(&mut g.dev, cap + PCI_CFG_DATA, 2), 2);
}

#[test]
fn test_tx_frame_reaches_port_without_header() {
    let mut g = Guest::running("t3", 1500);
    let sent = frame(1000, 3);
    // Header in one descriptor, the frame split over two.
    g.mem.write_slice(&[0xaa; NET_HDR_LEN], GuestAddress(0x10000)).unwrap();
    g.mem.write_slice(&sent[..400], GuestAddress(0x11000)).unwrap();
    g.mem.write_slice(&sent[400..], GuestAddress(0x12000)).unwrap();
    let head = g.post(TX_QUEUE, &[(0x10000, NET_HDR_LEN as u32), (0x11000, 400), (0x12000, 600)], false);
    // Kick through the doorbell eventfd the VMM would give KVM.
    let doorbell = g.dev.ioeventfds().into_iter().find(|e| e.offset == 0x4004).unwrap();
    doorbell.fd.write(1).unwrap();
    assert_eq!(g.recv_on_wire(), sent);
    assert_eq!(g.wait_used(TX_QUEUE, 1), vec![(u32::from(head), 0)]);
    assert!(g.fired(QUEUE_VECTORS[TX_QUEUE]));
    let stats = g.dev.stats();
    assert_eq!((stats.tx_frames, stats.tx_bytes, stats.malformed), (1, 1000, 0));
    assert_eq!(stats.wire.map(|w| w.sent), Some(1));

    // Header and frame in one descriptor (VERSION_1 implies any layout), kicked through BAR 0.
    let second = frame(60, 9);
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&second);
    g.mem.write_slice(&buf, GuestAddress(0x13000)).unwrap();
    g.post(TX_QUEUE, &[(0x13000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    assert_eq!(g.recv_on_wire(), second);
    g.wait_used(TX_QUEUE, 1);
}

#[test]
fn test_rx_frame_lands_in_posted_buffer() {
    let mut g = Guest::running("t4", 1500);
    // The frame arrives before any buffer: it waits in the port.
    let sent = frame(100, 4);
    g.send_from_wire(&sent);
    g.mem.write_slice(&[0xee; 2048], GuestAddress(0x20000)).unwrap();
    let head = g.post(RX_QUEUE, &[(0x20000, 2048)], true);
    g.kick(RX_QUEUE);
    assert_eq!(g.wait_used(RX_QUEUE, 1), vec![(u32::from(head), (NET_HDR_LEN + 100) as u32)]);
    assert!(g.fired(QUEUE_VECTORS[RX_QUEUE]));
    let mut got = vec![0u8; NET_HDR_LEN + 100];
    g.mem.read_slice(&mut got, GuestAddress(0x20000)).unwrap();
    let mut header = [0u8; NET_HDR_LEN];
    header[10] = 1; // num_buffers = 1, everything else zero
    assert_eq!(&got[..NET_HDR_LEN], &header);
    assert_eq!(&got[NET_HDR_LEN..], &sent[..]);

    // A buffer posted first, the frame after.
    g.post(RX_QUEUE, &[(0x21000, 2048)], true);
    g.kick(RX_QUEUE);
    let second = frame(1514, 5);
    g.send_from_wire(&second);
    assert_eq!(g.wait_used(RX_QUEUE, 1)[0].1, (NET_HDR_LEN + 1514) as u32);
    assert!(g.fired(QUEUE_VECTORS[RX_QUEUE]));
    let stats = g.dev.stats();
    assert_eq!((stats.rx_frames, stats.rx_bytes, stats.rx_dropped), (2, 1614, 0));
}

#[test]
fn test_rx_big_packet_chain() {
    // MTU 9000 without MRG_RXBUF: Linux posts the header alone, then a chain of pages.
    let mut g = Guest::running("t5", 9000);
    let pages = [(0x30000, NET_HDR_LEN as u32), (0x31000, 4096 - 16), (0x32000, 4096), (0x33000, 4096)];
    g.post(RX_QUEUE, &pages, true);
    g.kick(RX_QUEUE);
    let sent = frame(9014, 6);
    g.send_from_wire(&sent);
    assert_eq!(g.wait_used(RX_QUEUE, 1)[0].1, (NET_HDR_LEN + 9014) as u32);
    assert!(g.fired(QUEUE_VECTORS[RX_QUEUE]));
    let mut got = Vec::new();
    let mut rest = NET_HDR_LEN + 9014;
    for (addr, len) in pages {
        let n = rest.min(len as usize);
        let mut part = vec![0u8; n];
        g.mem.read_slice(&mut part, GuestAddress(addr)).unwrap();
        got.extend_from_slice(&part);
        rest -= n;
    }
    assert_eq!(u16::from_le_bytes([got[10], got[11]]), 1);
    assert_eq!(&got[NET_HDR_LEN..], &sent[..]);

    // A frame larger than the whole chain is dropped; the buffer comes back empty.
    g.post(RX_QUEUE, &[(0x34000, NET_HDR_LEN as u32), (0x35000, 1024)], true);
    g.kick(RX_QUEUE);
    g.send_from_wire(&frame(2000, 7));
    assert_eq!(g.wait_used(RX_QUEUE, 1)[0].1, 0);
    assert_eq!(g.dev.stats().rx_dropped, 1);
}

#[test]
fn test_malformed_descriptors_dropped_device_keeps_working() {
    let mut g = Guest::running("t6", 1500);
    // TX: a buffer beyond guest memory, a chain looping on itself, a 1 MiB length, then a
    // good frame.
    let beyond = g.post_raw(TX_QUEUE, 1 << 32, 100, 0, None);
    let looping = g.post_raw(TX_QUEUE, 0x10000, 64, VRING_DESC_F_NEXT as u16, None);
    let huge = g.post_raw(TX_QUEUE, 0x10000, 1 << 20, 0, None);
    let good = frame(200, 8);
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&good);
    g.mem.write_slice(&buf, GuestAddress(0x40000)).unwrap();
    let ok = g.post(TX_QUEUE, &[(0x40000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    assert_eq!(g.recv_on_wire(), good);
    let used = g.wait_used(TX_QUEUE, 4);
    assert_eq!(used, vec![(u32::from(beyond), 0), (u32::from(looping), 0), (u32::from(huge), 0), (u32::from(ok), 0)]);
    let stats = g.dev.stats();
    assert_eq!((stats.malformed, stats.tx_frames, stats.needs_reset), (3, 1, 0));

    // RX: a chain looping on itself takes the first frame (dropped), a good buffer the next.
    let bad = g.post_raw(RX_QUEUE, 0x50000, 2048, (VRING_DESC_F_WRITE | VRING_DESC_F_NEXT) as u16, None);
    let fine = g.post(RX_QUEUE, &[(0x51000, 2048)], true);
    g.kick(RX_QUEUE);
    g.send_from_wire(&frame(300, 1));
    let next = frame(400, 2);
    g.send_from_wire(&next);
    assert_eq!(g.wait_used(RX_QUEUE, 2), vec![(u32::from(bad), 0), (u32::from(fine), (NET_HDR_LEN + 400) as u32)]);
    let mut got = vec![0u8; 400];
    g.mem.read_slice(&mut got, GuestAddress(0x51000 + NET_HDR_LEN as u64)).unwrap();
    assert_eq!(got, next);
    let stats = g.dev.stats();
    assert_eq!((stats.malformed, stats.rx_frames, stats.rx_dropped), (4, 1, 1));
    assert_eq!(g.status() & NEEDS_RESET, 0);
    assert!(g.dev.is_running());
}

#[test]
fn test_jumped_avail_idx_needs_reset() {
    let mut g = Guest::running("t7", 1500);
    // The driver's index jumps past a whole queue's worth of entries.
    g.mem.write_obj(QSIZE + 5, GuestAddress(RINGS[TX_QUEUE].1 + 2)).unwrap();
    g.kick(TX_QUEUE);
    assert!(g.fired(CONFIG_VECTOR), "the configuration vector fires");
    assert_ne!(g.status() & NEEDS_RESET, 0);
    let mut isr = [0u8; 4];
    g.dev.bar_read(0, ISR_CFG, &mut isr);
    assert_eq!(isr[0] & 2, 2, "ISR: configuration change");
    g.dev.bar_read(0, ISR_CFG, &mut isr);
    assert_eq!(isr[0], 0, "reading the ISR clears it");
    assert_eq!(g.dev.stats().needs_reset, 1);
    // The worker has stopped processing; a later kick changes nothing.
    let deadline = Instant::now() + WAIT;
    while g.dev.is_running() {
        assert!(Instant::now() < deadline, "the worker keeps running");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(g.used_idx(TX_QUEUE), 0);

    // A reset brings the device back.
    g.set_status(0);
    assert_eq!(g.status(), 0);
    g.bring_up();
    let sent = frame(64, 2);
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&sent);
    g.mem.write_slice(&buf, GuestAddress(0x10000)).unwrap();
    g.post(TX_QUEUE, &[(0x10000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    assert_eq!(g.recv_on_wire(), sent);
}

/// Two nodes sending to each other at once, each wire full: a transmitter held by the wire
/// must not keep the receiver from draining it, or neither side ever makes room.
#[test]
fn test_transmit_held_by_the_wire_does_not_hold_receive() {
    let mut g = Guest::running("t13", 1500);
    g.paused.set(true);
    let sent = frame(200, 4);
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&sent);
    g.mem.write_slice(&buf, GuestAddress(0x10000)).unwrap();
    let head = g.post(TX_QUEUE, &[(0x10000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    // The transmit worker is now in the port's send; a frame from the wire still lands.
    let rx = g.post(RX_QUEUE, &[(0x20000, 2048)], true);
    g.kick(RX_QUEUE);
    let incoming = frame(300, 5);
    g.send_from_wire(&incoming);
    assert_eq!(g.wait_used(RX_QUEUE, 1), vec![(u32::from(rx), (NET_HDR_LEN + 300) as u32)]);
    assert_eq!(g.used_idx(TX_QUEUE), 0, "the transmit chain is still held");
    // The wire lets go: the held frame goes out and its chain comes back.
    g.paused.set(false);
    assert_eq!(g.recv_on_wire(), sent);
    assert_eq!(g.wait_used(TX_QUEUE, 1), vec![(u32::from(head), 0)]);
}

#[test]
fn test_reset_stops_both_worker_threads() {
    const WORKERS: [&str; 2] = ["vnet-rx-t8", "vnet-tx-t8"];
    let workers_become = |exist: bool| WORKERS.iter().all(|w| thread_becomes(w, exist));
    let mut g = Guest::running("t8", 1500);
    assert!(workers_become(true));
    assert!(Arc::strong_count(&g.dev.counters) > 1);
    g.set_status(0);
    assert!(!g.dev.is_running());
    assert_eq!(Arc::strong_count(&g.dev.counters), 1, "the workers are joined and nothing of them is left");
    assert!(workers_become(false), "no thread left after reset");
    assert_eq!(g.status(), 0);

    // The VMM's reset and dropping the device stop them too.
    g.bring_up();
    assert!(workers_become(true));
    g.dev.reset().unwrap();
    assert_eq!(Arc::strong_count(&g.dev.counters), 1);
    assert!(workers_become(false), "no thread left after the VMM's reset");
    g.bring_up();
    assert!(workers_become(true));
    let counters = g.dev.counters.clone();
    drop(g);
    assert_eq!(Arc::strong_count(&counters), 1);
    assert!(workers_become(false), "no thread left after drop");
}

#[test]
fn test_without_port_link_down_and_tx_dropped() {
    let mut g = Guest::new("t9", false, 1500);
    g.bring_up();
    let mut status = [0u8; 2];
    g.dev.bar_read(0, DEVICE_CFG + 6, &mut status);
    assert_eq!(u16::from_le_bytes(status), 0, "link down");
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&frame(64, 0));
    g.mem.write_slice(&buf, GuestAddress(0x10000)).unwrap();
    let head = g.post(TX_QUEUE, &[(0x10000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    assert_eq!(g.wait_used(TX_QUEUE, 1), vec![(u32::from(head), 0)]);
    let stats = g.dev.stats();
    assert_eq!((stats.tx_dropped, stats.tx_frames, stats.wire), (1, 0, None));
}

#[test]
fn test_no_interrupt_flag_respected() {
    let mut g = Guest::running("t10", 1500);
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&frame(64, 0));
    g.mem.write_slice(&buf, GuestAddress(0x10000)).unwrap();
    // VRING_AVAIL_F_NO_INTERRUPT on the transmit queue: no interrupt for this frame.
    g.mem.write_obj(1u16, GuestAddress(RINGS[TX_QUEUE].1)).unwrap();
    g.post(TX_QUEUE, &[(0x10000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    g.wait_used(TX_QUEUE, 1);
    // Flag cleared: the next frame interrupts, and that is the only interrupt sent.
    g.mem.write_obj(0u16, GuestAddress(RINGS[TX_QUEUE].1)).unwrap();
    g.post(TX_QUEUE, &[(0x10000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    g.wait_used(TX_QUEUE, 1);
    let fd = &g.vectors[usize::from(QUEUE_VECTORS[TX_QUEUE])];
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd for the duration of the call.
    assert_eq!(unsafe { libc::poll(&mut pfd, 1, WAIT.as_millis() as i32) }, 1);
    assert_eq!(fd.read().unwrap(), 1);
}

#[test]
fn test_queue_vector_beyond_table_reads_back_none() {
    let mut g = Guest::new("t11", true, 1500);
    g.write(QUEUE_SELECT, 2, 0);
    g.write(QUEUE_MSIX_VECTOR, 2, 16);
    assert_eq!(g.read(QUEUE_MSIX_VECTOR, 2), 0xffff);
    g.write(MSIX_CONFIG, 2, 300);
    assert_eq!(g.read(MSIX_CONFIG, 2), 0xffff);
    // A queue the device lacks reads size 0.
    g.write(QUEUE_SELECT, 2, 7);
    assert_eq!(g.read(QUEUE_SIZE, 2), 0);
}

#[test]
fn test_any_register_write_never_panics() {
    let mut g = Guest::running("t12", 1500);
    let values: [u64; 5] = [0, 1, 0xffff_ffff_ffff_ffff, 0x8000_0000_0000_0001, 0x0000_0100_0000_00ff];
    let offsets = (0..0x48u64)
        .map(|o| COMMON_CFG + o)
        .chain((0..8).map(|o| ISR_CFG + o))
        .chain((0..16).map(|o| DEVICE_CFG + o))
        .chain((0..12).map(|o| NOTIFY_CFG + o))
        .chain([0, 0x100, 0xfff, 0x5000, 0x7ffc, 0x8000, u64::MAX - 3]);
    for offset in offsets {
        for size in [1usize, 2, 3, 4, 8] {
            for v in values {
                let mut b = [0u8; 8];
                g.dev.bar_read(0, offset, &mut b[..size]);
                g.dev.bar_write(0, offset, &v.to_le_bytes()[..size]);
                g.dev.bar_write(3, offset, &v.to_le_bytes()[..size]);
            }
        }
    }
    for reg in (0..4096).step_by(3) {
        let mut b = [0u8; 4];
        g.dev.config_read(reg, &mut b);
        g.dev.config_write(reg, &[0xff; 4]);
    }
    // Whatever state that left, a reset and a normal bring-up still work.
    g.set_status(0);
    g.bring_up();
    let mut buf = vec![0u8; NET_HDR_LEN];
    buf.extend_from_slice(&frame(64, 1));
    g.mem.write_slice(&buf, GuestAddress(0x10000)).unwrap();
    g.post(TX_QUEUE, &[(0x10000, buf.len() as u32)], false);
    g.kick(TX_QUEUE);
    g.wait_used(TX_QUEUE, 1);
}

/// RFC 1071 by the book, independent of the device's `csum` module: 16-bit words one at a
/// time, a last odd byte padded with zero, carries folded at the end, complemented.
fn internet_checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    for pair in data.chunks(2) {
        sum += u32::from(u16::from_be_bytes([pair[0], pair.get(1).copied().unwrap_or(0)]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A TCP or UDP frame as a test builds it: the frame with every checksum right, where its
/// transport checksum is, where the transport header starts, and the pseudo-header.
struct Packet {
    frame: Vec<u8>,
    csum_at: usize,
    l4: usize,
    pseudo: Vec<u8>,
}

impl Packet {
    /// Whether the transport checksum verifies (the pseudo-header and segment sum to zero).
    fn verifies(frame: &[u8], p: &Packet) -> bool {
        let mut all = p.pseudo.clone();
        all.extend_from_slice(&frame[p.l4..]);
        internet_checksum(&all) == 0
    }

    /// The frame as a driver offloading its checksum hands it over: the folded sum of the
    /// pseudo-header in the checksum field (what Linux's `~csum_tcpudp_magic` leaves).
    fn partial(&self) -> Vec<u8> {
        let mut f = self.frame.clone();
        f[self.csum_at..self.csum_at + 2].copy_from_slice(&(!internet_checksum(&self.pseudo)).to_be_bytes());
        f
    }

    /// A transmit header asking for this packet's checksum.
    fn needs_csum_header(&self) -> [u8; NET_HDR_LEN] {
        let mut h = [0u8; NET_HDR_LEN];
        h[0] = NEEDS_CSUM;
        h[6..8].copy_from_slice(&(self.l4 as u16).to_le_bytes());
        h[8..10].copy_from_slice(&((self.csum_at - self.l4) as u16).to_le_bytes());
        h
    }
}

fn ethernet(ethertype: u16) -> Vec<u8> {
    let mut f = MAC.to_vec();
    f.extend_from_slice(&[0x52, 0x54, 0x00, 0xab, 0xcd, 0xef]);
    f.extend_from_slice(&ethertype.to_be_bytes());
    f
}

/// A UDP/IPv4 frame 10.1.2.3:49152 -> 10.1.2.4:4791 carrying `payload`.
fn udp4(payload: &[u8]) -> Packet {
    let (src, dst) = ([10, 1, 2, 3], [10, 1, 2, 4]);
    let udp_len = (8 + payload.len()) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&(20 + udp_len).to_be_bytes());
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let ip_csum = internet_checksum(&ip);
    ip[10..12].copy_from_slice(&ip_csum.to_be_bytes());
    let mut pseudo = [src, dst].concat();
    pseudo.extend_from_slice(&[0, 17]);
    pseudo.extend_from_slice(&udp_len.to_be_bytes());
    let mut udp = [49152u16.to_be_bytes(), 4791u16.to_be_bytes(), udp_len.to_be_bytes(), [0, 0]].concat();
    udp.extend_from_slice(payload);
    let csum = match internet_checksum(&[pseudo.as_slice(), &udp].concat()) {
        0 => 0xffff,
        c => c,
    };
    udp[6..8].copy_from_slice(&csum.to_be_bytes());
    let mut frame = ethernet(0x0800);
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(&udp);
    Packet { frame, csum_at: 14 + 20 + 6, l4: 14 + 20, pseudo }
}

/// A TCP/IPv6 frame fd00::1:40000 -> fd00::2:5201 (PSH|ACK) carrying `payload`.
fn tcp6(payload: &[u8]) -> Packet {
    let mut src = [0u8; 16];
    src[0] = 0xfd;
    let mut dst = src;
    src[15] = 1;
    dst[15] = 2;
    let mut tcp = [40000u16.to_be_bytes(), 5201u16.to_be_bytes()].concat();
    tcp.extend_from_slice(&0x0102_0304u32.to_be_bytes());
    tcp.extend_from_slice(&0x0a0b_0c0du32.to_be_bytes());
    tcp.extend_from_slice(&[0x50, 0x18, 0xff, 0xff, 0, 0, 0, 0]);
    tcp.extend_from_slice(payload);
    let len = tcp.len() as u32;
    let mut pseudo = [src, dst].concat();
    pseudo.extend_from_slice(&len.to_be_bytes());
    pseudo.extend_from_slice(&[0, 0, 0, 6]);
    let csum = internet_checksum(&[pseudo.as_slice(), &tcp].concat());
    tcp[16..18].copy_from_slice(&csum.to_be_bytes());
    let mut frame = ethernet(0x86dd);
    frame.extend_from_slice(&[0x60, 0, 0, 0]);
    frame.extend_from_slice(&(len as u16).to_be_bytes());
    frame.extend_from_slice(&[6, 64]);
    frame.extend_from_slice(&src);
    frame.extend_from_slice(&dst);
    frame.extend_from_slice(&tcp);
    Packet { frame, csum_at: 14 + 40 + 16, l4: 14 + 40, pseudo }
}

/// Whether a driver must kick after moving its index from `old` to `new` with the device's
/// `avail_event` at `event` (virtio 1.2 2.7.10, Linux's `vring_need_event`).
fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

#[test]
fn test_event_idx_interrupts_follow_used_event() {
    let mut g = Guest::new("t13", true, 1500);
    g.bring_up_with(DRIVER_FEATURES | EVENT_IDX);
    let mut bytes = vec![0u8; NET_HDR_LEN];
    bytes.extend_from_slice(&frame(64, 1));
    let tx = QUEUE_VECTORS[TX_QUEUE];

    // used_event 1: the driver wants an interrupt once entry 1 is used (the used index
    // moves past 1). Entry 0 interrupts not; entry 1 does, once.
    g.set_used_event(TX_QUEUE, 1);
    g.transmit(0x10000, &bytes);
    g.wait_used(TX_QUEUE, 1);
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 0, "used index 0 -> 1 does not pass used_event 1");
    g.transmit(0x10000, &bytes);
    g.wait_used(TX_QUEUE, 1);
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 1, "used index 1 -> 2 passes used_event 1");

    // Three chains used in one go (2 -> 5) past used_event 4: one interrupt.
    g.set_used_event(TX_QUEUE, 4);
    g.mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    for _ in 0..3 {
        g.post(TX_QUEUE, &[(0x10000, bytes.len() as u32)], false);
    }
    g.kick(TX_QUEUE);
    g.wait_used(TX_QUEUE, 3);
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 1, "a batch passing used_event interrupts once");

    // used_event 9: a batch stopping short of it (5 -> 8) and entry 8 interrupt not,
    // entry 9 does.
    g.set_used_event(TX_QUEUE, 9);
    for _ in 0..3 {
        g.post(TX_QUEUE, &[(0x10000, bytes.len() as u32)], false);
    }
    g.kick(TX_QUEUE);
    g.wait_used(TX_QUEUE, 3);
    g.transmit(0x10000, &bytes);
    g.wait_used(TX_QUEUE, 1);
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 0, "used index 5 -> 9 does not pass used_event 9");
    g.transmit(0x10000, &bytes);
    g.wait_used(TX_QUEUE, 1);
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 1, "used index 9 -> 10 passes used_event 9");

    // used_event left behind (a driver with callbacks off): no interrupt at all, however
    // many chains, and VRING_AVAIL_F_NO_INTERRUPT no longer counts with EVENT_IDX.
    g.set_used_event(TX_QUEUE, 3);
    for _ in 0..4 {
        g.transmit(0x10000, &bytes);
        g.wait_used(TX_QUEUE, 1);
    }
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 0);
    g.mem.write_obj(1u16, GuestAddress(RINGS[TX_QUEUE].1)).unwrap();
    g.set_used_event(TX_QUEUE, g.used_idx(TX_QUEUE));
    g.transmit(0x10000, &bytes);
    g.wait_used(TX_QUEUE, 1);
    g.settle(RX_QUEUE);
    assert_eq!(g.pending(tx), 1, "used_event, not the flag, decides");

    // The receive queue likewise, settled through the transmit queue.
    let rx = QUEUE_VECTORS[RX_QUEUE];
    g.pending(rx);
    // (Frames came in already, one per settle.)
    let u = g.used_idx(RX_QUEUE);
    g.set_used_event(RX_QUEUE, u);
    for i in 0..3u64 {
        g.post(RX_QUEUE, &[(0x20000 + 0x1000 * i, 2048)], true);
    }
    g.kick(RX_QUEUE);
    g.send_from_wire(&frame(100, 1));
    g.wait_used(RX_QUEUE, 1);
    g.settle(TX_QUEUE);
    assert_eq!(g.pending(rx), 1, "receive used index u -> u + 1 passes used_event u");
    g.send_from_wire(&frame(100, 2));
    g.wait_used(RX_QUEUE, 1);
    g.settle(TX_QUEUE);
    assert_eq!(g.pending(rx), 0, "receive used index u + 1 -> u + 2 does not pass used_event u");
    g.set_used_event(RX_QUEUE, u + 2);
    g.send_from_wire(&frame(100, 3));
    g.wait_used(RX_QUEUE, 1);
    g.settle(TX_QUEUE);
    assert_eq!(g.pending(rx), 1, "receive used index u + 2 -> u + 3 passes used_event u + 2");
}

#[test]
fn test_event_idx_kicks_asked_for_only_when_idle() {
    let mut g = Guest::new("t14", true, 1500);
    g.bring_up_with(DRIVER_FEATURES | EVENT_IDX);
    let mut bytes = vec![0u8; NET_HDR_LEN];
    bytes.extend_from_slice(&frame(64, 1));
    g.mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();

    // Transmit: idle from the start, the device asks for a kick at entry 0.
    assert_eq!(g.avail_event(TX_QUEUE), 0);
    for _ in 0..3 {
        g.post(TX_QUEUE, &[(0x10000, bytes.len() as u32)], false);
    }
    assert!(need_event(g.avail_event(TX_QUEUE), 3, 0), "the driver must kick");
    g.kick(TX_QUEUE);
    g.wait_used(TX_QUEUE, 3);
    g.settle(RX_QUEUE);
    assert_eq!(g.avail_event(TX_QUEUE), 3, "idle again: a kick is wanted for entry 3");
    assert_eq!(g.mem.read_obj::<u16>(GuestAddress(RINGS[TX_QUEUE].2)).unwrap(), 0, "used flags untouched");

    // Receive: with buffers left the device wants no kicks (avail_event stays behind)...
    let rx_event = g.avail_event(RX_QUEUE);
    let avail = g.avail[RX_QUEUE];
    g.post(RX_QUEUE, &[(0x20000, 2048)], true);
    g.post(RX_QUEUE, &[(0x21000, 2048)], true);
    g.kick(RX_QUEUE);
    g.send_from_wire(&frame(100, 1));
    g.wait_used(RX_QUEUE, 1);
    g.settle(TX_QUEUE);
    assert_eq!(g.avail_event(RX_QUEUE), rx_event, "a buffer left: no kick asked for");
    assert!(!need_event(g.avail_event(RX_QUEUE), avail + 3, avail + 2), "posting more would not kick");
    // ... and asks for one when they run out.
    g.send_from_wire(&frame(100, 2));
    g.wait_used(RX_QUEUE, 1);
    g.settle(TX_QUEUE);
    assert_eq!(g.avail_event(RX_QUEUE), avail + 2, "out of buffers: a kick is wanted for the next");
    // The driver kicks as told, and the frame waiting meanwhile comes in.
    g.send_from_wire(&frame(100, 3));
    let old = g.avail[RX_QUEUE];
    g.post(RX_QUEUE, &[(0x22000, 2048)], true);
    assert!(need_event(g.avail_event(RX_QUEUE), g.avail[RX_QUEUE], old));
    g.kick(RX_QUEUE);
    assert_eq!(g.wait_used(RX_QUEUE, 1)[0].1, (NET_HDR_LEN + 100) as u32);
    // Three frames, and the one of the settle above.
    assert_eq!(g.dev.stats().rx_frames, 4);
}

/// Spins (bounded, yielding now and then) until `done`; fails naming `what` if it never is.
fn spin_until(g: &Guest, what: &str, done: impl Fn(&Guest) -> bool) {
    let deadline = Instant::now() + WAIT;
    let mut spins = 0u32;
    while !done(g) {
        spins = spins.wrapping_add(1);
        if spins % 256 == 0 {
            assert!(Instant::now() < deadline, "stalled: {what}");
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[test]
fn test_event_idx_driver_kicking_only_when_asked_never_stalls() {
    // A driver that kicks only when avail_event says so, racing the worker. A chain posted
    // between the device's last look at the ring and its asking for a kick comes with no
    // kick; were it not taken on the device's second look, the ring would stall and the
    // bounded waits fail. Depth 1 (post one, wait for it) makes the device go idle on
    // every chain, the moment the driver posts the next; more depth keeps it busy.
    let mut g = Guest::new("t15", true, 1500);
    g.bring_up_with(DRIVER_FEATURES | EVENT_IDX);

    // Transmit.
    let mut bytes = vec![0u8; NET_HDR_LEN];
    bytes.extend_from_slice(&frame(64, 1));
    g.mem.write_slice(&bytes, GuestAddress(0x10000)).unwrap();
    let mut sent = 0u64;
    for (depth, frames) in [(1u16, 20_000u32), (QSIZE, 20_000)] {
        let mut kicks = 0;
        for _ in 0..frames {
            spin_until(&g, "transmit ring full", |g| g.avail[TX_QUEUE].wrapping_sub(g.used_idx(TX_QUEUE)) < depth);
            let old = g.avail[TX_QUEUE];
            g.post(TX_QUEUE, &[(0x10000, bytes.len() as u32)], false);
            // The index store before the avail_event load, as Linux's virtio_mb.
            fence(Ordering::SeqCst);
            if need_event(g.avail_event(TX_QUEUE), g.avail[TX_QUEUE], old) {
                g.kick(TX_QUEUE);
                kicks += 1;
            }
        }
        spin_until(&g, "transmit ring drains", |g| g.used_idx(TX_QUEUE) == g.avail[TX_QUEUE]);
        sent += u64::from(frames);
        assert_eq!(g.dev.stats().tx_frames, sent);
        assert!(kicks > 0 && kicks <= frames);
    }

    // Receive: the wire sends numbered frames as fast as the device takes them.
    const RX_FRAMES: u32 = 15_000;
    let peer = g.peer.as_ref().unwrap().try_clone().unwrap();
    peer.set_write_timeout(Some(WAIT)).unwrap();
    let sender = std::thread::spawn(move || {
        for n in 0..2 * RX_FRAMES {
            let mut f = frame(100, 0);
            f[20..24].copy_from_slice(&n.to_le_bytes());
            peer.send(&[&offload::plain_header()[..], &f].concat()).unwrap();
        }
    });
    // Posts buffers until `depth` are out past used index `upto`, and kicks if asked to.
    let refill = |g: &mut Guest, upto: u16, depth: u16| {
        let old = g.avail[RX_QUEUE];
        while g.avail[RX_QUEUE].wrapping_sub(upto) < depth {
            let addr = 0x100000 + 0x1000 * u64::from(g.next_desc[RX_QUEUE]);
            g.post(RX_QUEUE, &[(addr, 2048)], true);
        }
        fence(Ordering::SeqCst);
        if g.avail[RX_QUEUE] != old && need_event(g.avail_event(RX_QUEUE), g.avail[RX_QUEUE], old) {
            g.kick(RX_QUEUE);
        }
    };
    let mut next = 0u32;
    let mut seen = g.used_idx(RX_QUEUE);
    // Depth at most QSIZE / 2: buffers posted before the used ones are read never reuse
    // their descriptors (each descriptor has its own buffer).
    for (depth, until) in [(1, RX_FRAMES), (QSIZE / 2, 2 * RX_FRAMES)] {
        refill(&mut g, seen, depth);
        while next < until {
            spin_until(&g, "receive buffers used", |g| g.used_idx(RX_QUEUE) != seen);
            // New buffers first, racing the device going idle; then what came in.
            let upto = g.used_idx(RX_QUEUE);
            refill(&mut g, upto, depth);
            while seen != upto {
                let slot = RINGS[RX_QUEUE].2 + 4 + 8 * u64::from(seen % QSIZE);
                let id: u32 = g.mem.read_obj(GuestAddress(slot)).unwrap();
                let len: u32 = g.mem.read_obj(GuestAddress(slot + 4)).unwrap();
                assert_eq!(len, (NET_HDR_LEN + 100) as u32);
                let at = 0x100000 + 0x1000 * u64::from(id) + NET_HDR_LEN as u64 + 20;
                let n: u32 = g.mem.read_obj(GuestAddress(at)).unwrap();
                assert_eq!(n, next, "frames in order, none lost");
                next += 1;
                seen = seen.wrapping_add(1);
            }
        }
    }
    sender.join().unwrap();
    let stats = g.dev.stats();
    assert_eq!((stats.rx_frames, stats.rx_dropped), (u64::from(2 * RX_FRAMES), 0));
    assert_eq!(g.status() & NEEDS_RESET, 0);
}

#[test]
fn test_tx_checksum_travels_with_the_frame_and_a_receiver_without_guest_csum_completes_it() {
    let mut g = Guest::new("t16", true, 1500);
    g.bring_up_with(DRIVER_FEATURES | CSUM);
    let mut plain = Guest::new("t16-rx", true, 1500);
    plain.bring_up();
    for (i, p) in [udp4(b"checksum me, odd length"), tcp6(b"hello over ipv6 and tcp!"), udp4(&[0x5a; 1400])]
        .into_iter()
        .enumerate()
    {
        let partial = p.partial();
        assert!(!Packet::verifies(&partial, &p));
        // The header alone, then the frame in two pieces split inside the transport header.
        g.mem.write_slice(&p.needs_csum_header(), GuestAddress(0x10000)).unwrap();
        g.mem.write_slice(&partial[..p.l4 + 3], GuestAddress(0x11000)).unwrap();
        g.mem.write_slice(&partial[p.l4 + 3..], GuestAddress(0x12000)).unwrap();
        let rest = (partial.len() - p.l4 - 3) as u32;
        g.post(TX_QUEUE, &[(0x10000, NET_HDR_LEN as u32), (0x11000, p.l4 as u32 + 3), (0x12000, rest)], false);
        g.kick(TX_QUEUE);
        // The device computes nothing: header and partial frame go on the wire as written.
        let (header, got) = g.recv_packet_on_wire();
        assert_eq!(header, p.needs_csum_header());
        assert_eq!(got, partial);
        g.wait_used(TX_QUEUE, 1);
        // A receiving device whose guest did not take GUEST_CSUM completes it.
        let addr = 0x20000 + 0x1000 * i as u64;
        plain.post(RX_QUEUE, &[(addr, 2048)], true);
        plain.kick(RX_QUEUE);
        plain.send_packet_from_wire(&header, &got);
        let len = plain.wait_used(RX_QUEUE, 1)[0].1 as usize;
        let mut delivered = vec![0u8; len];
        plain.mem.read_slice(&mut delivered, GuestAddress(addr)).unwrap();
        assert_eq!(&delivered[..NET_HDR_LEN], &rx_header(1), "flags 0 for a guest without GUEST_CSUM");
        assert!(Packet::verifies(&delivered[NET_HDR_LEN..], &p), "the checksum the receiver filled in verifies");
        assert_eq!(&delivered[NET_HDR_LEN..], &p.frame[..]);
    }

    // Checksums outside the frame: dropped as malformed, never sent, the device carries on.
    let p = udp4(b"x");
    let len = p.frame.len() as u16;
    for (start, offset) in [(len - 1, 0u16), (len, 0), (p.l4 as u16, len), (0xffff, 0xffff), (len - 2, 1)] {
        let mut bytes = p.needs_csum_header().to_vec();
        bytes[6..8].copy_from_slice(&start.to_le_bytes());
        bytes[8..10].copy_from_slice(&offset.to_le_bytes());
        bytes.extend_from_slice(&p.partial());
        let head = g.transmit(0x10000, &bytes);
        assert_eq!(g.wait_used(TX_QUEUE, 1), vec![(u32::from(head), 0)]);
    }
    let stats = g.dev.stats();
    assert_eq!((stats.malformed, stats.tx_frames, stats.needs_reset), (5, 3, 0));
    // The last two bytes of the frame are still inside it; the receiver completes it there.
    let mut bytes = p.needs_csum_header().to_vec();
    bytes[6..8].copy_from_slice(&(len - 2).to_le_bytes());
    bytes[8..10].copy_from_slice(&0u16.to_le_bytes());
    bytes.extend_from_slice(&p.frame);
    g.transmit(0x10000, &bytes);
    let (header, got) = g.recv_packet_on_wire();
    assert_eq!(got.len(), p.frame.len(), "the next frame on the wire is this one: the bad ones were not sent");
    g.wait_used(TX_QUEUE, 1);
    plain.post(RX_QUEUE, &[(0x30000, 2048)], true);
    plain.kick(RX_QUEUE);
    plain.send_packet_from_wire(&header, &got);
    plain.wait_used(RX_QUEUE, 1);
    let end = len as usize - 2;
    let mut field = [0u8; 2];
    plain.mem.read_slice(&mut field, GuestAddress(0x30000 + (NET_HDR_LEN + end) as u64)).unwrap();
    let expected = match internet_checksum(&p.frame[end..]) {
        0 => 0xffff,
        c => c,
    };
    assert_eq!(u16::from_be_bytes(field), expected);

    // A header without NEEDS_CSUM: the frame goes as it is, checksum field included.
    let mut bytes = vec![0u8; NET_HDR_LEN];
    bytes.extend_from_slice(&p.partial());
    g.transmit(0x10000, &bytes);
    assert_eq!(g.recv_on_wire(), p.partial());
    g.wait_used(TX_QUEUE, 1);
}

/// A TCP/IPv4 frame of `payload` from 10.1.2.3:80 to 10.1.2.4:81 as Linux hands one to a
/// TSO device: lengths for the whole frame, the checksum field holding the pseudo-header
/// seed, and the header asking for segmentation at `mss`.
fn tso4(payload: &[u8], mss: u16) -> ([u8; NET_HDR_LEN], Vec<u8>) {
    let mut f = frame(14, 0)[..12].to_vec();
    f.extend_from_slice(&[0x08, 0x00, 0x45, 0]);
    f.extend_from_slice(&(40 + payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[0, 1, 0x40, 0, 64, 6, 0, 0, 10, 1, 2, 3, 10, 1, 2, 4]);
    f.extend_from_slice(&[0, 80, 0, 81, 0, 0, 0, 1, 0, 0, 0, 1, 0x50, 0x18, 0xff, 0xff, 0, 0, 0, 0]);
    f.extend_from_slice(payload);
    let mut h = [0u8; NET_HDR_LEN];
    h[0] = NEEDS_CSUM;
    h[1] = 1; // VIRTIO_NET_HDR_GSO_TCPV4
    h[2..4].copy_from_slice(&54u16.to_le_bytes());
    h[4..6].copy_from_slice(&mss.to_le_bytes());
    h[6..8].copy_from_slice(&34u16.to_le_bytes());
    h[8..10].copy_from_slice(&16u16.to_le_bytes());
    (h, f)
}

#[test]
fn test_tso_frames_cross_whole_and_are_segmented_for_a_guest_without_guest_tso() {
    let payload: Vec<u8> = (0..30_000u32).map(|i| (i % 251) as u8).collect();
    let (header, frame) = tso4(&payload, 8960);
    // The sender's guest took HOST_TSO4: the 30 KB frame goes on the wire as one packet.
    let mut tx = Guest::new("t-tso-tx", true, 9000);
    tx.bring_up_with(DRIVER_FEATURES | CSUM | TSO);
    tx.transmit(0x10000, &[&header[..], &frame].concat());
    let (on_wire, got) = tx.recv_packet_on_wire();
    assert_eq!((on_wire, got.len()), (header, frame.len()));
    tx.wait_used(TX_QUEUE, 1);
    // A segmentation request with gso_size 0 is malformed.
    let mut bad = header;
    bad[4..6].fill(0);
    let head = tx.transmit(0x10000, &[&bad[..], &frame].concat());
    assert_eq!(tx.wait_used(TX_QUEUE, 1), vec![(u32::from(head), 0)]);
    assert_eq!(tx.dev.stats().malformed, 1);

    // A receiver whose guest took GUEST_TSO4 (with MRG_RXBUF, as Linux does) gets it whole.
    let mut whole = Guest::new("t-tso-whole", true, 9000);
    whole.bring_up_with(DRIVER_FEATURES | GUEST_CSUM | TSO | MRG);
    let bufs = whole.post_rx_buffers(&(0..16).map(|i| 0x100000 + 0x1000 * i).collect::<Vec<_>>(), 4096);
    whole.kick(RX_QUEUE);
    whole.send_packet_from_wire(&on_wire, &got);
    let used = whole.wait_used(RX_QUEUE, 8);
    assert_eq!(used.iter().map(|(_, len)| *len as usize).sum::<usize>(), NET_HDR_LEN + frame.len());
    let mut first = [0u8; NET_HDR_LEN];
    whole.mem.read_slice(&mut first, GuestAddress(bufs[0].1)).unwrap();
    assert_eq!((first[0], first[1], u16::from_le_bytes([first[4], first[5]])), (NEEDS_CSUM, 1, 8960));
    assert_eq!(u16::from_le_bytes([first[10], first[11]]), 8, "num_buffers");

    // One that took only GUEST_CSUM gets four segments of at most 8960 bytes, each a whole
    // TCP segment whose checksum the device made and says is valid.
    let mut cut = Guest::new("t-tso-cut", true, 9000);
    cut.bring_up_with(DRIVER_FEATURES | GUEST_CSUM);
    for i in 0..4u64 {
        cut.post(RX_QUEUE, &[(0x200000 + 0x4000 * i, 0x4000)], true);
    }
    cut.kick(RX_QUEUE);
    cut.send_packet_from_wire(&on_wire, &got);
    let used = cut.wait_used(RX_QUEUE, 4);
    let mut joined = Vec::new();
    for (i, (_, len)) in used.iter().enumerate() {
        let mut seg = vec![0u8; *len as usize];
        cut.mem.read_slice(&mut seg, GuestAddress(0x200000 + 0x4000 * i as u64)).unwrap();
        assert_eq!(seg[0], DATA_VALID, "segment {i}");
        assert!(seg.len() <= NET_HDR_LEN + 54 + 8960, "segment {i}: {} bytes", seg.len());
        assert_eq!(
            crate::virtio::csum::verify(&seg[NET_HDR_LEN..]),
            crate::virtio::csum::Verdict::Valid,
            "segment {i}"
        );
        joined.extend_from_slice(&seg[NET_HDR_LEN + 54..]);
    }
    assert_eq!(joined, payload);
    assert_eq!(cut.dev.stats().rx_frames, 4);
}

#[test]
fn test_no_tso_offered_over_a_wire_of_small_datagrams() {
    let mut g = Guest::with_port_limit("t-udp", 65507);
    assert_eq!(g.device_features() & TSO, 0);
    assert_eq!(g.device_features() & (CSUM | GUEST_CSUM), CSUM | GUEST_CSUM);
}

#[test]
fn test_without_new_features_behaviour_unchanged() {
    let mut g = Guest::running("t17", 1500);
    // NEEDS_CSUM set though CSUM was not accepted: the device does not touch the frame,
    // nor drop one whose offsets point nowhere.
    let p = udp4(b"not offloaded");
    let mut bytes = p.needs_csum_header().to_vec();
    bytes.extend_from_slice(&p.partial());
    g.transmit(0x10000, &bytes);
    assert_eq!(g.recv_on_wire(), p.partial());
    g.wait_used(TX_QUEUE, 1);
    bytes[6..8].copy_from_slice(&0xffffu16.to_le_bytes());
    g.transmit(0x10000, &bytes);
    assert_eq!(g.recv_on_wire(), p.partial());
    g.wait_used(TX_QUEUE, 1);
    assert_eq!(g.dev.stats().malformed, 0);
    // No EVENT_IDX: the event fields are never written, every used buffer interrupts.
    g.set_used_event(TX_QUEUE, 100);
    g.transmit(0x10000, &bytes);
    g.wait_used(TX_QUEUE, 1);
    assert!(g.fired(QUEUE_VECTORS[TX_QUEUE]));
    assert_eq!(g.avail_event(TX_QUEUE), 0);
    assert_eq!(g.avail_event(RX_QUEUE), 0);
    assert_eq!(g.mem.read_obj::<u16>(GuestAddress(RINGS[TX_QUEUE].2)).unwrap(), 0, "used flags untouched");

    // Without GUEST_CSUM a good UDP frame comes in with flags 0, the header as before.
    g.post(RX_QUEUE, &[(0x20000, 2048)], true);
    g.kick(RX_QUEUE);
    let good = udp4(b"good but unflagged");
    g.send_from_wire(&good.frame);
    let len = g.wait_used(RX_QUEUE, 1)[0].1 as usize;
    assert_eq!(len, NET_HDR_LEN + good.frame.len());
    let mut got = vec![0u8; len];
    g.mem.read_slice(&mut got, GuestAddress(0x20000)).unwrap();
    assert_eq!(&got[..NET_HDR_LEN], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
    assert_eq!(&got[NET_HDR_LEN..], &good.frame[..]);

    // Without MRG_RXBUF a frame never spreads over buffers: one too small for it comes
    // back empty, the next buffer waits for the next frame.
    let first = g.post(RX_QUEUE, &[(0x21000, 2048)], true);
    let second = g.post(RX_QUEUE, &[(0x22000, 2048)], true);
    g.kick(RX_QUEUE);
    g.send_from_wire(&frame(3000, 1));
    assert_eq!(g.wait_used(RX_QUEUE, 1), vec![(u32::from(first), 0)]);
    g.send_from_wire(&frame(100, 2));
    assert_eq!(g.wait_used(RX_QUEUE, 1), vec![(u32::from(second), (NET_HDR_LEN + 100) as u32)]);
    let mut header = [0u8; NET_HDR_LEN];
    g.mem.read_slice(&mut header, GuestAddress(0x22000)).unwrap();
    assert_eq!(header, rx_header(1));
    let stats = g.dev.stats();
    assert_eq!((stats.rx_frames, stats.rx_dropped), (2, 1));
}

#[test]
fn test_rx_data_valid_only_for_verified_checksums() {
    let mut g = Guest::new("t18", true, 1500);
    g.bring_up_with(DRIVER_FEATURES | GUEST_CSUM);
    let udp = udp4(b"a datagram the device checks");
    let tcp = tcp6(&[7; 1000]);
    let mut bad_udp = udp.frame.clone();
    *bad_udp.last_mut().unwrap() ^= 0x40;
    let mut bad_tcp = tcp.frame.clone();
    bad_tcp[tcp.l4 + 30] ^= 1;
    let mut no_csum = udp.frame.clone();
    no_csum[udp.csum_at..udp.csum_at + 2].fill(0);
    let mut wrong_csum = udp.frame.clone();
    wrong_csum[udp.csum_at] ^= 0x80;
    let mut padded = udp.frame.clone();
    padded.extend_from_slice(&[0; 8]);
    let cases: [(&str, &[u8], u8); 9] = [
        ("good UDP/IPv4", &udp.frame, DATA_VALID),
        ("UDP/IPv4 with a flipped payload bit", &bad_udp, 0),
        ("good TCP/IPv6", &tcp.frame, DATA_VALID),
        ("TCP/IPv6 with a flipped payload bit", &bad_tcp, 0),
        ("UDP/IPv4 without a checksum", &no_csum, 0),
        ("UDP/IPv4 with a wrong checksum", &wrong_csum, 0),
        ("not IP", &frame(200, 3), 0),
        ("good UDP/IPv4 with Ethernet padding", &padded, DATA_VALID),
        ("good UDP/IPv4 after bad ones", &udp.frame, DATA_VALID),
    ];
    for (i, (what, sent, flags)) in cases.iter().enumerate() {
        let addr = 0x20000 + 0x1000 * i as u64;
        g.mem.write_slice(&[0xee; 2048], GuestAddress(addr)).unwrap();
        g.post(RX_QUEUE, &[(addr, 2048)], true);
        g.kick(RX_QUEUE);
        g.send_from_wire(sent);
        let len = g.wait_used(RX_QUEUE, 1)[0].1 as usize;
        assert_eq!(len, NET_HDR_LEN + sent.len(), "{what}");
        let mut got = vec![0u8; len];
        g.mem.read_slice(&mut got, GuestAddress(addr)).unwrap();
        assert_eq!(&got[..NET_HDR_LEN], &[*flags, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0], "{what}");
        assert_eq!(&got[NET_HDR_LEN..], *sent, "{what}: the frame itself is untouched");
    }
    assert_eq!(g.dev.stats().rx_frames, cases.len() as u64);
}

#[test]
fn test_mrg_rxbuf_frame_spread_over_buffers() {
    for (key, event_idx) in [("t19", false), ("t19e", true)] {
        let mut g = Guest::new(key, true, 9000);
        g.bring_up_with(DRIVER_FEATURES | MRG | if event_idx { EVENT_IDX } else { 0 });
        let rx = QUEUE_VECTORS[RX_QUEUE];
        let posted = g.post_rx_buffers(&[0x30000, 0x31000, 0x32000, 0x33000], 4096);
        g.kick_rx_if_asked(event_idx, 0);

        // 12 + 9014 bytes over three 4096-byte buffers: each filled, the rest in the third.
        let sent = frame(9014, 6);
        g.send_from_wire(&sent);
        let used = g.wait_used(RX_QUEUE, 3);
        let heads: Vec<u32> = posted[..3].iter().map(|&(h, _)| u32::from(h)).collect();
        assert_eq!(used, vec![(heads[0], 4096), (heads[1], 4096), (heads[2], (NET_HDR_LEN + 9014 - 8192) as u32)]);
        let got = g.received(&used, &posted);
        assert_eq!(&got[..NET_HDR_LEN], &rx_header(3), "num_buffers 3 in the first buffer's header");
        assert_eq!(&got[NET_HDR_LEN..], &sent[..], "the frame reassembles");
        let past = g.mem.read_obj::<u8>(GuestAddress(0x32000 + used[2].1 as u64)).unwrap();
        assert_eq!(past, 0xee, "nothing written past the used length");
        g.settle(TX_QUEUE);
        assert_eq!(g.pending(rx), 1, "one interrupt for the frame's three buffers");

        // A small frame takes one buffer, num_buffers 1. With EVENT_IDX, used_event 0
        // (the rings start zeroed) is behind: used index 3 -> 4 interrupts not.
        let small = frame(100, 7);
        g.send_from_wire(&small);
        let used = g.wait_used(RX_QUEUE, 1);
        assert_eq!(used, vec![(u32::from(posted[3].0), (NET_HDR_LEN + 100) as u32)]);
        let got = g.received(&used, &posted);
        assert_eq!(&got[..NET_HDR_LEN], &rx_header(1));
        assert_eq!(&got[NET_HDR_LEN..], &small[..]);
        g.settle(TX_QUEUE);
        assert_eq!(g.pending(rx), u64::from(!event_idx), "used index 3 -> 4 past used_event 0");
        // used_event 5: 4 -> 5 interrupts not, 5 -> 7 (a frame of two buffers) does.
        g.set_used_event(RX_QUEUE, 5);

        // Header and frame filling one buffer exactly take one; a byte more takes two.
        let old = g.avail[RX_QUEUE];
        let posted = g.post_rx_buffers(&[0x34000, 0x35000, 0x36000], 4096);
        g.kick_rx_if_asked(event_idx, old);
        let exact = frame(4096 - NET_HDR_LEN, 8);
        g.send_from_wire(&exact);
        let used = g.wait_used(RX_QUEUE, 1);
        assert_eq!(used, vec![(u32::from(posted[0].0), 4096)]);
        assert_eq!(g.received(&used, &posted), [&rx_header(1)[..], &exact].concat());
        g.settle(TX_QUEUE);
        assert_eq!(g.pending(rx), u64::from(!event_idx), "used index 4 -> 5 does not pass used_event 5");
        let over = frame(4096 - NET_HDR_LEN + 1, 9);
        g.send_from_wire(&over);
        let used = g.wait_used(RX_QUEUE, 2);
        assert_eq!(used, vec![(u32::from(posted[1].0), 4096), (u32::from(posted[2].0), 1)]);
        assert_eq!(g.received(&used, &posted), [&rx_header(2)[..], &over].concat());
        g.settle(TX_QUEUE);
        assert_eq!(g.pending(rx), 1, "used index 5 -> 7 passes used_event 5");

        let stats = g.dev.stats();
        assert_eq!((stats.rx_frames, stats.rx_bytes), (4, 9014 + 100 + 4084 + 4085));
        assert_eq!((stats.rx_dropped, stats.malformed, stats.needs_reset), (0, 0, 0));
    }
}

#[test]
fn test_mrg_rxbuf_frame_waits_for_enough_buffers() {
    for (key, event_idx) in [("t20", false), ("t20e", true)] {
        let mut g = Guest::new(key, true, 9000);
        g.bring_up_with(DRIVER_FEATURES | MRG | if event_idx { EVENT_IDX } else { 0 });
        let rx = QUEUE_VECTORS[RX_QUEUE];
        let sent = frame(9014, 10);
        g.send_from_wire(&sent);
        let mut posted = g.post_rx_buffers(&[0x30000, 0x31000], 4096);
        g.kick_rx_if_asked(event_idx, 0);
        g.settle(TX_QUEUE);
        // Two buffers hold 8192 bytes of the 9026: none is taken, the frame waits.
        assert_eq!(g.used_idx(RX_QUEUE), 0, "nothing consumed");
        let stats = g.dev.stats();
        assert_eq!((stats.rx_frames, stats.rx_dropped), (0, 0));
        assert_eq!(g.pending(rx), 0);
        if event_idx {
            assert_eq!(g.avail_event(RX_QUEUE), 2, "a kick is asked for the next buffer posted");
        }
        // A frame coming meanwhile stays in the port behind it.
        let next = frame(200, 11);
        g.send_from_wire(&next);

        // Still short (8704 bytes): nothing taken again.
        posted.extend(g.post_rx_buffers(&[0x32000], 512));
        g.kick_rx_if_asked(event_idx, 2);
        g.settle(TX_QUEUE);
        assert_eq!(g.used_idx(RX_QUEUE), 0, "still nothing consumed");
        if event_idx {
            assert_eq!(g.avail_event(RX_QUEUE), 3);
        }

        // Enough, and a buffer for the next frame: both land whole, in order.
        posted.extend(g.post_rx_buffers(&[0x33000, 0x34000], 4096));
        g.kick_rx_if_asked(event_idx, 3);
        let used = g.wait_used(RX_QUEUE, 5);
        let heads: Vec<u32> = posted.iter().map(|&(h, _)| u32::from(h)).collect();
        let last = (NET_HDR_LEN + 9014 - 4096 - 4096 - 512) as u32;
        assert_eq!(
            used,
            vec![
                (heads[0], 4096),
                (heads[1], 4096),
                (heads[2], 512),
                (heads[3], last),
                (heads[4], (NET_HDR_LEN + 200) as u32)
            ],
            "the frame took the first buffers posted, the next frame the one after"
        );
        let got = g.received(&used[..4], &posted);
        assert_eq!(&got[..NET_HDR_LEN], &rx_header(4));
        assert_eq!(&got[NET_HDR_LEN..], &sent[..]);
        assert_eq!(g.received(&used[4..], &posted), [&rx_header(1)[..], &next].concat());
        assert!(g.fired(rx));
        let stats = g.dev.stats();
        assert_eq!((stats.rx_frames, stats.rx_dropped, stats.malformed), (2, 0, 0));
        if event_idx {
            assert_eq!(g.avail_event(RX_QUEUE), 5, "out of buffers again: a kick is wanted for the next");
        }
    }
}

#[test]
fn test_mrg_rxbuf_frame_larger_than_full_ring_dropped() {
    let mut g = Guest::new("t21", true, 9000);
    g.bring_up_with(DRIVER_FEATURES | MRG);
    // Every entry of the ring posted, 16 * 256 bytes: a 9014-byte frame can never fit.
    let addrs: Vec<u64> = (0..u64::from(QSIZE)).map(|i| 0x30000 + 0x1000 * i).collect();
    let posted = g.post_rx_buffers(&addrs, 256);
    g.kick(RX_QUEUE);
    g.send_from_wire(&frame(9014, 12));
    let small = frame(300, 13);
    g.send_from_wire(&small);
    // The big one is dropped taking nothing; the next takes the first two buffers.
    let used = g.wait_used(RX_QUEUE, 2);
    assert_eq!(used, vec![(u32::from(posted[0].0), 256), (u32::from(posted[1].0), (NET_HDR_LEN + 300 - 256) as u32)]);
    assert_eq!(g.received(&used, &posted), [&rx_header(2)[..], &small].concat());
    let stats = g.dev.stats();
    assert_eq!((stats.rx_frames, stats.rx_dropped, stats.malformed, stats.needs_reset), (1, 1, 0, 0));
}

#[test]
fn test_mrg_rxbuf_malformed_chain_drops_frame() {
    let mut g = Guest::new("t22", true, 9000);
    g.bring_up_with(DRIVER_FEATURES | MRG);
    let write = VRING_DESC_F_WRITE as u16;
    let next = VRING_DESC_F_NEXT as u16;
    // (what, a good buffer before it, the bad chain as (address, length, flags)).
    type Case = (&'static str, Option<u64>, (u64, u32, u16));
    let cases: [Case; 5] = [
        ("a chain looping on itself", Some(0x40000), (0x41000, 4096, write | next)),
        ("a device-readable buffer", Some(0x42000), (0x43000, 4096, 0)),
        ("a buffer smaller than the header", Some(0x44000), (0x45000, NET_HDR_LEN as u32 - 1, write)),
        ("a buffer outside guest memory", Some(0x46000), (1 << 32, 4096, write)),
        ("a bad first chain", None, (0x48000, 4096, 0)),
    ];
    for (i, (what, good, (addr, len, flags))) in cases.into_iter().enumerate() {
        let mut heads = Vec::new();
        if let Some(good) = good {
            heads.push(g.post_rx_buffers(&[good], 4096)[0].0);
        }
        heads.push(g.post_raw(RX_QUEUE, addr, len, flags, None));
        g.kick(RX_QUEUE);
        g.send_from_wire(&frame(9014, i as u8));
        // Every chain the frame took goes back empty, together.
        let used = g.wait_used(RX_QUEUE, heads.len() as u16);
        assert_eq!(used, heads.iter().map(|&h| (u32::from(h), 0)).collect::<Vec<_>>(), "{what}");
        let stats = g.dev.stats();
        assert_eq!((stats.malformed, stats.rx_dropped, stats.rx_frames), (i as u64 + 1, i as u64 + 1, 0), "{what}");
    }
    // The device carries on: the next frame lands whole.
    let posted = g.post_rx_buffers(&[0x50000, 0x51000, 0x52000], 4096);
    g.kick(RX_QUEUE);
    let sent = frame(9014, 14);
    g.send_from_wire(&sent);
    let used = g.wait_used(RX_QUEUE, 3);
    assert_eq!(used.iter().map(|u| u.1).collect::<Vec<_>>(), vec![4096, 4096, (NET_HDR_LEN + 9014 - 8192) as u32]);
    assert_eq!(g.received(&used, &posted), [&rx_header(3)[..], &sent].concat());
    assert_eq!(g.status() & NEEDS_RESET, 0);
    assert_eq!(g.dev.stats().rx_frames, 1);
}

#[test]
fn test_mrg_rxbuf_driver_kicking_only_when_asked_never_stalls() {
    // As test_event_idx_driver_kicking_only_when_asked_never_stalls, with frames taking two
    // buffers each: the device often holds a frame waiting for its second buffer, and one
    // posted while it asks for a kick (which brings none) must not leave the frame waiting.
    let mut g = Guest::new("t23", true, 9000);
    g.bring_up_with(DRIVER_FEATURES | MRG | EVENT_IDX);
    const FRAMES: u32 = 5_000;
    const DEPTHS: [u16; 3] = [2, 3, QSIZE / 2];
    const BUF: u32 = 2048;
    const LEN: usize = 3000;
    let total = FRAMES * DEPTHS.len() as u32;
    let peer = g.peer.as_ref().unwrap().try_clone().unwrap();
    peer.set_write_timeout(Some(WAIT)).unwrap();
    let sender = std::thread::spawn(move || {
        for n in 0..total {
            let mut f = frame(LEN, n as u8);
            f[20..24].copy_from_slice(&n.to_le_bytes());
            peer.send(&[&offload::plain_header()[..], &f].concat()).unwrap();
        }
    });
    // One buffer at a time, each with its own kick decision: the second of a frame's
    // buffers may come while the device, holding the first, asks for a kick.
    let refill = |g: &mut Guest, upto: u16, depth: u16| {
        while g.avail[RX_QUEUE].wrapping_sub(upto) < depth {
            let old = g.avail[RX_QUEUE];
            let addr = 0x100000 + 0x1000 * u64::from(g.next_desc[RX_QUEUE]);
            g.post(RX_QUEUE, &[(addr, BUF)], true);
            g.kick_rx_if_asked(true, old);
        }
    };
    let mut next = 0u32;
    let mut seen = g.used_idx(RX_QUEUE);
    for (i, depth) in DEPTHS.into_iter().enumerate() {
        let until = FRAMES * (i as u32 + 1);
        refill(&mut g, seen, depth);
        while next < until {
            spin_until(&g, "receive buffers used", |g| g.used_idx(RX_QUEUE) != seen);
            let upto = g.used_idx(RX_QUEUE);
            assert_eq!(upto.wrapping_sub(seen) % 2, 0, "a frame's two buffers are published together");
            refill(&mut g, upto, depth);
            while seen != upto {
                let entry = |g: &Guest, n: u16| {
                    let slot = RINGS[RX_QUEUE].2 + 4 + 8 * u64::from(n % QSIZE);
                    let id: u32 = g.mem.read_obj(GuestAddress(slot)).unwrap();
                    let len: u32 = g.mem.read_obj(GuestAddress(slot + 4)).unwrap();
                    (0x100000 + 0x1000 * u64::from(id), len)
                };
                let (first, len) = entry(&g, seen);
                assert_eq!(len, BUF);
                let mut header = [0u8; NET_HDR_LEN];
                g.mem.read_slice(&mut header, GuestAddress(first)).unwrap();
                assert_eq!(header, rx_header(2));
                let n: u32 = g.mem.read_obj(GuestAddress(first + NET_HDR_LEN as u64 + 20)).unwrap();
                assert_eq!(n, next, "frames in order, none lost");
                let (second, len) = entry(&g, seen.wrapping_add(1));
                assert_eq!(len as usize, NET_HDR_LEN + LEN - BUF as usize);
                let tail: u8 = g.mem.read_obj(GuestAddress(second + u64::from(len) - 1)).unwrap();
                assert_eq!(tail, frame(LEN, n as u8)[LEN - 1], "the frame's last byte in the second buffer");
                next += 1;
                seen = seen.wrapping_add(2);
            }
        }
    }
    sender.join().unwrap();
    let stats = g.dev.stats();
    assert_eq!((stats.rx_frames, stats.rx_dropped, stats.malformed), (u64::from(total), 0, 0));
    assert_eq!(g.status() & NEEDS_RESET, 0);
}
