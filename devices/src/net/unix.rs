//! `unix:DIR`: a hub of unix datagram sockets, one per port, named by the port's MAC. A port
//! learns which socket each source MAC sends from, like a switch, and sends a unicast frame
//! to that socket alone; broadcast, multicast and unknown destinations go to every other
//! socket in the directory.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::sys::{self, Counters};
use super::{frame_of, FramePort, WireError, WireStats, MAX_PACKET, MIN_PACKET, OFFLOAD_LEN};
use crate::sync::lock;

/// Most MACs a port remembers; a guest that sends from ever new source MACs makes the table
/// start again rather than grow.
const MAX_LEARNED: usize = 4096;
/// Most unusable datagrams one `recv` skips before it says that none waits (the socket then
/// still polls readable).
const RECV_SKIP: usize = 256;
/// Send buffer asked for: frames queued to peers that have not read them yet count against
/// it, so a larger one lets one slow peer hold more before others see drops too.
const SEND_BUFFER: libc::c_int = 4 << 20;

/// The socket name of a MAC: 12 lowercase hex digits.
pub(super) fn socket_name(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `name` is a port's socket name.
fn is_socket_name(name: &OsStr) -> bool {
    let b = name.as_bytes();
    b.len() == 12 && b.iter().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
}

/// A unix socket address with a path.
#[derive(Clone, Copy)]
struct Peer {
    addr: libc::sockaddr_un,
    len: libc::socklen_t,
}

/// Offset of `sun_path` in `sockaddr_un`.
const PATH_OFFSET: usize = std::mem::offset_of!(libc::sockaddr_un, sun_path);

impl Peer {
    /// The address of the socket at `path`; `None` when it does not fit `sun_path`.
    fn from_path(path: &Path) -> Option<Peer> {
        let bytes = path.as_os_str().as_bytes();
        // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        if bytes.is_empty() || bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
            return None;
        }
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        Some(Peer { addr, len: (PATH_OFFSET + bytes.len() + 1) as libc::socklen_t })
    }

    /// The sender of a datagram, when it is a unix socket bound to a path (not unnamed or
    /// abstract).
    fn from_datagram(d: &sys::Datagram) -> Option<Peer> {
        let len = d.from_len as usize;
        if d.from.ss_family != libc::AF_UNIX as libc::sa_family_t
            || len <= PATH_OFFSET
            || len > std::mem::size_of::<libc::sockaddr_un>()
        {
            return None;
        }
        // SAFETY: the storage holds an AF_UNIX address, which is a sockaddr_un; storage is
        // larger and at least as aligned, so the read is in bounds and aligned.
        let addr: libc::sockaddr_un = unsafe { std::ptr::read((&d.from as *const libc::sockaddr_storage).cast()) };
        let peer = Peer { addr, len: d.from_len };
        (peer.path_bytes().first().is_some_and(|b| *b != 0)).then_some(peer)
    }

    /// `sun_path` up to its end or first NUL.
    fn path_bytes(&self) -> &[libc::c_char] {
        let n = (self.len as usize).saturating_sub(PATH_OFFSET).min(self.addr.sun_path.len());
        let path = &self.addr.sun_path[..n];
        if path.first() == Some(&0) {
            return path;
        }
        path.iter().position(|c| *c == 0).map_or(path, |end| &path[..end])
    }

    fn same(&self, other: &Peer) -> bool {
        self.path_bytes() == other.path_bytes()
    }

    /// Sends `frame` to it; with `wait`, waits while its queue is full, up to the socket's
    /// send timeout ([`FULL_PEER_WAIT`]): the kernel wakes the sender as soon as the peer
    /// reads (`unix_wait_for_peer`), so no time is lost polling.
    fn send(&self, fd: RawFd, frame: &[u8], wait: bool) -> io::Result<()> {
        let flags = libc::MSG_NOSIGNAL | if wait { 0 } else { libc::MSG_DONTWAIT };
        loop {
            // SAFETY: `frame` and `addr` are valid for reads of the lengths passed, for the
            // whole call.
            let n = unsafe {
                libc::sendto(
                    fd,
                    frame.as_ptr().cast(),
                    frame.len(),
                    flags,
                    (&self.addr as *const libc::sockaddr_un).cast(),
                    self.len,
                )
            };
            if n >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// One port of a `unix:DIR` hub.
pub struct UnixPort {
    socket: UnixDatagram,
    dir: PathBuf,
    path: PathBuf,
    /// This port's own address (never sent to).
    own: Peer,
    /// Device and inode of the socket file this port bound, so that dropping the port
    /// removes that file and no other.
    inode: (u64, u64),
    mac: [u8; 6],
    /// Source MAC -> the socket it was last seen sending from.
    learned: Mutex<HashMap<[u8; 6], Peer>>,
    /// Destinations whose queue stayed full for a whole [`FULL_PEER_WAIT`]: frames to them
    /// are dropped at once until then.
    stuck: Mutex<HashMap<[u8; 6], Instant>>,
    counters: Counters,
}

/// How long a frame may wait for a peer whose queue is full. A unix datagram socket holds
/// only `net.unix.max_dgram_qlen` frames (10 by default), so a burst (a 4 MiB RDMA READ is
/// a thousand frames) overruns a peer that is merely slow; dropping then costs the
/// transport a retransmission timeout (RoCE's is tens of milliseconds), which is why RoCE
/// fabrics are lossless: a full receiver pauses its sender (PFC) rather than dropping, and
/// a watchdog ends a pause that lasts (a peer that stopped reading). This is that pause and
/// that watchdog, as QEMU's `dgram` netdev, which queues without limit, has none. The wait
/// is the sending device's transmit worker's, never a vCPU's, the VMM's or its receive
/// worker's (see `virtio::net`): the guest's transmit ring fills meanwhile and its driver
/// stops the queue, as behind a paused link. A whole second: nested, a receiving guest
/// busy with a 4 MiB RDMA burst was seen to leave its queue full past 100 ms, and every
/// frame dropped then cost soft-RoCE a retransmission (ib_write_bw fell by a third).
const FULL_PEER_WAIT: Duration = Duration::from_secs(1);
/// How long a peer that stayed full for [`FULL_PEER_WAIT`] counts as stuck: frames to it
/// are dropped at once meanwhile, so that a stopped peer costs the others on the hub one
/// pause a second.
const STUCK_FOR: Duration = Duration::from_secs(1);

impl std::fmt::Debug for UnixPort {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("UnixPort").field("path", &self.path).field("stats", &self.counters.stats()).finish()
    }
}

impl UnixPort {
    /// Joins the hub in `dir` (created when missing) as `dir/<MAC in 12 hex digits>`. A
    /// socket file of that name that nobody is bound to any more is replaced; one a live
    /// port holds is refused ([`WireError::MacInUse`]).
    pub fn open(dir: &Path, mac: [u8; 6]) -> Result<UnixPort, WireError> {
        fs::create_dir_all(dir).map_err(|e| WireError::io(format!("creating hub directory {}", dir.display()), e))?;
        let path = dir.join(socket_name(&mac));
        let in_use = || WireError::MacInUse { path: path.clone(), mac: gdrvm_model::node::format_mac(&mac) };
        let own = Peer::from_path(&path).ok_or_else(|| {
            let reason =
                io::Error::new(io::ErrorKind::InvalidInput, "longer than a unix socket path may be (107 bytes)");
            WireError::io(format!("socket {}", path.display()), reason)
        })?;
        match fs::symlink_metadata(&path) {
            Ok(meta) if !meta.file_type().is_socket() => {
                let reason = io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a socket");
                return Err(WireError::io(format!("socket {}", path.display()), reason));
            }
            Ok(_) => {
                if is_live(&path).map_err(|e| WireError::io(format!("probing {}", path.display()), e))? {
                    return Err(in_use());
                }
                tracing::debug!("wire: replacing stale socket {}", path.display());
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(WireError::io(format!("removing stale socket {}", path.display()), e)),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(WireError::io(format!("socket {}", path.display()), e)),
        }
        let socket = UnixDatagram::bind(&path).map_err(|e| match e.kind() {
            // Another port took the name since it was probed.
            io::ErrorKind::AddrInUse => in_use(),
            _ => WireError::io(format!("binding {}", path.display()), e),
        })?;
        let inode = match fs::metadata(&path) {
            Ok(m) => (m.dev(), m.ino()),
            Err(e) => {
                let _ = fs::remove_file(&path);
                return Err(WireError::io(format!("socket {}", path.display()), e));
            }
        };
        let port = UnixPort {
            socket,
            dir: dir.to_owned(),
            path,
            own,
            inode,
            mac,
            learned: Mutex::new(HashMap::new()),
            stuck: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        };
        // The socket stays blocking so that a send may wait for a full peer (bounded by the
        // send timeout); every other send and every receive passes MSG_DONTWAIT.
        sys::set_send_timeout(port.socket.as_raw_fd(), FULL_PEER_WAIT);
        sys::set_buffer(port.socket.as_raw_fd(), libc::SO_SNDBUF, SEND_BUFFER);
        Ok(port)
    }

    /// The socket file this port is bound to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The MAC it was opened with.
    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    /// Sends to every other socket of the hub (the directory is read each time: such frames
    /// are rare, ARP and neighbour discovery). The frame counts as sent when one peer took it.
    fn flood(&self, frame: &[u8]) {
        let entries = match fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(e) => {
                self.counters.warn_once(&format!("reading hub directory {}", self.dir.display()), &e);
                self.counters.dropped();
                return;
            }
        };
        let fd = self.socket.as_raw_fd();
        let mut delivered = false;
        for entry in entries.flatten() {
            if !is_socket_name(&entry.file_name()) || !entry.file_type().is_ok_and(|t| t.is_socket()) {
                continue;
            }
            let Some(peer) = Peer::from_path(&entry.path()) else { continue };
            if peer.same(&self.own) {
                continue;
            }
            match peer.send(fd, frame, false) {
                Ok(()) => delivered = true,
                Err(e) if sys::is_peer_busy(&e) || sys::is_peer_gone(&e) => {}
                Err(e) => self.counters.warn_once(&format!("sending to {}", entry.path().display()), &e),
            }
        }
        if delivered {
            self.counters.sent();
        } else {
            self.counters.dropped();
        }
    }

    /// Remembers that `src` sends from `peer`.
    fn learn(&self, src: [u8; 6], peer: Peer) {
        if src[0] & 1 != 0 || src == self.mac || peer.same(&self.own) {
            return;
        }
        let mut learned = lock(&self.learned);
        if learned.get(&src).is_some_and(|p| p.same(&peer)) {
            return;
        }
        if learned.len() >= MAX_LEARNED && !learned.contains_key(&src) {
            learned.clear();
        }
        learned.insert(src, peer);
    }
}

/// Whether a port is bound at socket file `path` (a datagram connect succeeds); false when
/// the file is left over from a port that is gone.
fn is_live(path: &Path) -> io::Result<bool> {
    let probe = UnixDatagram::unbound()?;
    match probe.connect(path) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => Ok(false),
        Err(e) => Err(e),
    }
}

impl UnixPort {
    /// Sends `frame` to `peer` (MAC `dst`), waiting up to [`FULL_PEER_WAIT`] while its
    /// queue is full; a peer that stays full is then skipped for [`STUCK_FOR`].
    fn send_waiting(&self, peer: &Peer, dst: [u8; 6], frame: &[u8]) -> io::Result<()> {
        let fd = self.socket.as_raw_fd();
        let first = peer.send(fd, frame, false);
        match &first {
            Err(e) if sys::is_peer_busy(e) => {}
            _ => return first,
        }
        {
            let mut stuck = lock(&self.stuck);
            match stuck.get(&dst) {
                Some(until) if *until > Instant::now() => return first,
                Some(_) => {
                    stuck.remove(&dst);
                }
                None => {}
            }
        }
        let again = peer.send(fd, frame, true);
        if matches!(&again, Err(e) if sys::is_peer_busy(e)) {
            lock(&self.stuck).insert(dst, Instant::now() + STUCK_FOR);
        }
        again
    }
}

impl FramePort for UnixPort {
    fn send(&self, packet: &[u8]) {
        if !(MIN_PACKET..=MAX_PACKET).contains(&packet.len()) {
            self.counters.dropped();
            return;
        }
        let mut dst = [0u8; 6];
        dst.copy_from_slice(&frame_of(packet)[..6]);
        let known = if dst[0] & 1 == 0 { lock(&self.learned).get(&dst).copied() } else { None };
        let Some(peer) = known else {
            self.flood(packet);
            return;
        };
        match self.send_waiting(&peer, dst, packet) {
            Ok(()) => self.counters.sent(),
            Err(e) if sys::is_peer_busy(&e) => self.counters.dropped(),
            Err(e) => {
                if !sys::is_peer_gone(&e) {
                    self.counters.warn_once("sending to a learned peer", &e);
                }
                let mut learned = lock(&self.learned);
                if learned.get(&dst).is_some_and(|p| p.same(&peer)) {
                    learned.remove(&dst);
                }
                self.counters.dropped();
            }
        }
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        for _ in 0..RECV_SKIP {
            let Some(d) = sys::recv_from(self.socket.as_raw_fd(), buf)? else { return Ok(None) };
            if d.len < MIN_PACKET || d.len > MAX_PACKET || d.len > buf.len() {
                self.counters.dropped();
                continue;
            }
            if let Some(peer) = Peer::from_datagram(&d) {
                let mut src = [0u8; 6];
                src.copy_from_slice(&buf[OFFLOAD_LEN + 6..OFFLOAD_LEN + 12]);
                self.learn(src, peer);
            }
            self.counters.received();
            return Ok(Some(d.len));
        }
        Ok(None)
    }

    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }

    fn stats(&self) -> WireStats {
        self.counters.stats()
    }
}

impl Drop for UnixPort {
    fn drop(&mut self) {
        // Only the file this port bound: a port that replaced it keeps its own.
        if fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.inode) {
            if let Err(e) = fs::remove_file(&self.path) {
                tracing::debug!("wire: removing {}: {e}", self.path.display());
            }
        }
    }
}
