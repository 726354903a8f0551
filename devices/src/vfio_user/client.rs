//! The client side, in the VMM: a connection to one vfio-user server, the device behind it
//! as a [`VfioDeviceOps`] (so it becomes a [`VfioPciDevice`] with the firewall, MSI/MSI-X
//! emulation and BAR mapping of passthrough), and the server as a [`DmaTarget`].
//!
//! Every request waits a bounded time for sending and for its reply. A server that times
//! out, hangs up or breaks the framing is marked failed, logged once, and every later
//! request fails at once without touching the socket; the device then reads all-ones
//! (the passthrough layer's answer to a failed access).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::VFIO_PCI_CONFIG_REGION_INDEX;
use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory};
use vmm_sys_util::eventfd::EventFd;

use super::protocol::*;
use super::transport::{self, TransportError};
use super::Chain;
use crate::dma::{DmaError, DmaRegion, DmaTarget};
use crate::lock;
use crate::vfio::{ConfigWrites, IrqKind, RegionInfo, VfioDeviceOps, VfioError, VfioPciDevice};

/// How long a request waits for sending and for its reply, unless set otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// Pause between attempts to connect to a socket that is not there yet.
const CONNECT_RETRY: Duration = Duration::from_millis(20);
/// The last region index that is a BAR (`VFIO_PCI_BAR5_REGION_INDEX`).
const LAST_BAR_REGION: u32 = 5;

/// Errors of a vfio-user client: each names the device and, for a request, the command.
#[derive(Debug, thiserror::Error)]
pub enum UserError {
    /// The socket could not be connected to.
    #[error("could not connect to vfio-user device {name} at {}", .path.display())]
    Connect {
        /// The device.
        name: String,
        /// Its socket.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The server did not take the request or answer it in time.
    #[error("vfio-user device {name} did not answer {command} within {timeout:?}")]
    Timeout {
        /// The device.
        name: String,
        /// The request.
        command: Command,
        /// The wait.
        timeout: Duration,
    },
    /// The server hung up.
    #[error("vfio-user device {name} closed the connection during {command}")]
    Closed {
        /// The device.
        name: String,
        /// The request.
        command: Command,
    },
    /// The socket failed or the server broke the framing.
    #[error("vfio-user device {name} broke the connection during {command}")]
    Transport {
        /// The device.
        name: String,
        /// The request.
        command: Command,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// The server answered with an error.
    #[error("vfio-user device {name} refused {command}")]
    Refused {
        /// The device.
        name: String,
        /// The request.
        command: Command,
        /// The errno it answered.
        #[source]
        source: io::Error,
    },
    /// The connection failed earlier; nothing was sent.
    #[error("vfio-user device {name} has failed; {command} was not sent")]
    Failed {
        /// The device.
        name: String,
        /// The request.
        command: Command,
    },
    /// The reply is malformed.
    #[error("vfio-user device {name} sent a malformed reply to {command}")]
    BadReply {
        /// The device.
        name: String,
        /// The request.
        command: Command,
        /// Why.
        #[source]
        source: ProtocolError,
    },
    /// The reply does not answer what was asked, or the request cannot be made.
    #[error("vfio-user device {name}: {command} {reason}")]
    Invalid {
        /// The device.
        name: String,
        /// The request.
        command: Command,
        /// What is wrong.
        reason: String,
    },
    /// The server speaks another protocol version.
    #[error("vfio-user device {name} speaks protocol version {major}.{minor}, gdrvm {VERSION_MAJOR}.{VERSION_MINOR}")]
    Version {
        /// The device.
        name: String,
        /// Its major version.
        major: u16,
        /// Its minor version.
        minor: u16,
    },
    /// A DMA region without a file cannot be shared with another process.
    #[error("vfio-user device {name} cannot map DMA region {iova:#x}: it has no file to share")]
    NoFd {
        /// The device.
        name: String,
        /// The region's start.
        iova: u64,
    },
    /// The device is not a PCI device the passthrough layer accepts.
    #[error("vfio-user device {name} could not be opened as a PCI device")]
    Open {
        /// The device.
        name: String,
        /// Why.
        #[source]
        source: Box<VfioError>,
    },
}

/// A successful reply.
struct Reply {
    payload: Vec<u8>,
    fds: Vec<File>,
}

struct Io {
    stream: UnixStream,
    next_id: u16,
}

/// One connection to a vfio-user server. Requests are serialized (vCPU threads and the
/// DMA space call concurrently). Dropping it shuts the socket down.
pub struct UserConnection {
    name: String,
    io: Mutex<Io>,
    failed: AtomicBool,
    /// A posted write went out after the last reply came in: until the next reply, the
    /// server may not have done it yet.
    posted: AtomicBool,
    timeout_ns: AtomicU64,
    /// The most region data per message: the server's limit and ours.
    max_xfer: usize,
    /// The most fds per message: the server's limit and ours.
    max_fds: usize,
}

impl std::fmt::Debug for UserConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserConnection")
            .field("name", &self.name)
            .field("failed", &self.is_failed())
            .field("timeout", &self.timeout())
            .finish_non_exhaustive()
    }
}

/// Connects to the vfio-user server of device `name` at `socket` and negotiates the
/// version. Retries while the socket does not exist yet or refuses (the VMM starts the
/// emulator just before), until `timeout`; requests then wait `timeout` too.
pub fn connect(name: &str, socket: &Path, timeout: Duration) -> Result<Arc<UserConnection>, UserError> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match UnixStream::connect(socket) {
            Ok(stream) => break stream,
            Err(e)
                if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused)
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(CONNECT_RETRY.min(deadline.saturating_duration_since(Instant::now())));
            }
            Err(source) => return Err(UserError::Connect { name: name.to_string(), path: socket.into(), source }),
        }
    };
    UserConnection::new(name, stream, timeout)
}

/// Connects to device `name` at `socket` and opens it as a PCI device, with the DMA
/// target that maps guest memory into its server.
pub fn open_user_device(
    name: &str,
    socket: &Path,
    timeout: Duration,
    config_writes: ConfigWrites,
) -> Result<(VfioPciDevice, UserDmaTarget), UserError> {
    let conn = connect(name, socket, timeout)?;
    let ops = UserDeviceOps::new(conn.clone())?;
    let device = VfioPciDevice::new(name, Box::new(ops), config_writes)
        .map_err(|e| UserError::Open { name: name.to_string(), source: Box::new(e) })?;
    Ok((device, UserDmaTarget::new(conn)))
}

impl UserConnection {
    /// A connection to device `name` over `stream`, after the VERSION handshake; requests
    /// wait `timeout`.
    pub fn new(name: &str, stream: UnixStream, timeout: Duration) -> Result<Arc<Self>, UserError> {
        let mut conn = UserConnection {
            name: name.to_string(),
            io: Mutex::new(Io { stream, next_id: 0 }),
            failed: AtomicBool::new(false),
            posted: AtomicBool::new(false),
            timeout_ns: AtomicU64::new(0),
            max_xfer: MAX_DATA_XFER,
            max_fds: MAX_FDS,
        };
        conn.set_timeout(timeout);
        let reply = conn.request(Command::Version, &Version::default().encode(), &[])?;
        let theirs = Version::decode(&reply.payload).map_err(|source| conn.bad_reply(Command::Version, source))?;
        if theirs.major != VERSION_MAJOR {
            return Err(UserError::Version { name: conn.name.clone(), major: theirs.major, minor: theirs.minor });
        }
        conn.max_xfer = (theirs.max_data_xfer_size as usize).clamp(1, MAX_DATA_XFER);
        conn.max_fds = (theirs.max_msg_fds as usize).min(MAX_FDS);
        tracing::debug!(
            device = conn.name,
            version = format_args!("{}.{}", theirs.major, theirs.minor),
            max_xfer = conn.max_xfer,
            max_fds = conn.max_fds,
            "vfio-user connected"
        );
        Ok(Arc::new(conn))
    }

    /// The device's name in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long a request waits for sending and for its reply.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Sets how long a request waits (at least a millisecond).
    pub fn set_timeout(&self, timeout: Duration) {
        let ns = u64::try_from(timeout.max(Duration::from_millis(1)).as_nanos()).unwrap_or(u64::MAX);
        self.timeout_ns.store(ns, Ordering::Relaxed);
    }

    /// Whether the connection failed (timeout, hang-up, broken framing).
    pub fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// The most region data one request carries.
    pub fn max_data_xfer(&self) -> usize {
        self.max_xfer
    }

    /// Takes the connection for one message: the socket, and the header of `command` with
    /// the next message ID; fails at once if the connection has failed (before or while
    /// another request held it).
    fn begin(&self, command: Command, len: usize) -> Result<(MutexGuard<'_, Io>, Header), UserError> {
        let failed = || UserError::Failed { name: self.name.clone(), command };
        if self.is_failed() {
            return Err(failed());
        }
        let mut io = lock(&self.io);
        if self.is_failed() {
            return Err(failed());
        }
        let id = io.next_id;
        io.next_id = id.wrapping_add(1);
        Ok((io, Header::command(id, command, len)))
    }

    /// Sends `command` with `payload` and `fds` and waits for its reply.
    fn request(&self, command: Command, payload: &[u8], fds: &[BorrowedFd<'_>]) -> Result<Reply, UserError> {
        let (io, header) = self.begin(command, payload.len())?;
        let id = header.msg_id;
        let timeout = self.timeout();
        let deadline = Some(Instant::now() + timeout);
        if let Err(e) = transport::send(&io.stream, &header, payload, fds, deadline) {
            return Err(self.broken(&io, command, e, timeout));
        }
        loop {
            let m = match transport::receive(&io.stream, deadline, timeout) {
                Ok(m) => m,
                Err(e) => return Err(self.broken(&io, command, e, timeout)),
            };
            if !m.header.is_reply() {
                // The server asks something of us (DMA through the socket, an interrupt
                // message): gdrvm offers none of it.
                tracing::debug!(device = self.name, command = m.header.command, "vfio-user server command refused");
                if !m.header.no_reply() {
                    let refusal = m.header.error_reply(libc::ENOTSUP);
                    if let Err(e) = transport::send(&io.stream, &refusal, &[], &[], deadline) {
                        return Err(self.broken(&io, command, e, timeout));
                    }
                }
                continue;
            }
            if m.header.msg_id != id || m.header.command != command as u16 {
                tracing::debug!(device = self.name, msg_id = m.header.msg_id, "vfio-user reply to no request dropped");
                continue;
            }
            // The server answers in order: every write posted before this request is done.
            self.posted.store(false, Ordering::Release);
            if m.header.is_error() {
                let errno = i32::try_from(m.header.error_no).unwrap_or(libc::EIO);
                let source = io::Error::from_raw_os_error(errno);
                return Err(UserError::Refused { name: self.name.clone(), command, source });
            }
            return Ok(Reply { payload: m.payload, fds: m.fds });
        }
    }

    /// The error for `e`; when it breaks the connection, marks it failed (logged once) and
    /// shuts the socket down.
    fn broken(&self, io: &Io, command: Command, e: TransportError, timeout: Duration) -> UserError {
        let name = self.name.clone();
        let (reason, error) = match e {
            TransportError::Timeout(_) => {
                (format!("{command} got no answer within {timeout:?}"), UserError::Timeout { name, command, timeout })
            }
            TransportError::Closed | TransportError::Truncated => {
                (format!("it hung up during {command}"), UserError::Closed { name, command })
            }
            source => (format!("{command}: {}", Chain(&source)), UserError::Transport { name, command, source }),
        };
        let breaks = match &error {
            UserError::Transport { source, .. } => source.breaks_framing(),
            _ => true,
        };
        if breaks && !self.failed.swap(true, Ordering::AcqRel) {
            let _ = io.stream.shutdown(std::net::Shutdown::Both);
            tracing::error!("vfio-user device {} failed: {reason}; it now reads all-ones", self.name);
        }
        error
    }

    fn bad_reply(&self, command: Command, source: ProtocolError) -> UserError {
        UserError::BadReply { name: self.name.clone(), command, source }
    }

    fn invalid(&self, command: Command, reason: impl Into<String>) -> UserError {
        UserError::Invalid { name: self.name.clone(), command, reason: reason.into() }
    }

    fn device_info(&self) -> Result<VfioDeviceInfo, UserError> {
        let c = Command::DeviceGetInfo;
        let reply = self.request(c, &VfioDeviceInfo::default().encode(), &[])?;
        VfioDeviceInfo::decode(&reply.payload).map_err(|e| self.bad_reply(c, e))
    }

    fn region_info(&self, index: u32) -> Result<(VfioRegionInfo, Option<File>), UserError> {
        let c = Command::DeviceGetRegionInfo;
        let mut reply = self.request(c, &VfioRegionInfo { index, ..Default::default() }.encode(), &[])?;
        let info = VfioRegionInfo::decode(&reply.payload).map_err(|e| self.bad_reply(c, e))?;
        if info.index != index {
            return Err(self.invalid(c, format!("for region {index} describes region {}", info.index)));
        }
        // One fd at most belongs to a region; any others are closed.
        Ok((info, (!reply.fds.is_empty()).then(|| reply.fds.swap_remove(0))))
    }

    fn irq_info(&self, index: u32) -> Result<VfioIrqInfo, UserError> {
        let c = Command::DeviceGetIrqInfo;
        let reply = self.request(c, &VfioIrqInfo { index, ..Default::default() }.encode(), &[])?;
        VfioIrqInfo::decode(&reply.payload).map_err(|e| self.bad_reply(c, e))
    }

    fn set_irqs(&self, set: VfioIrqSet, fds: &[BorrowedFd<'_>]) -> Result<(), UserError> {
        self.request(Command::DeviceSetIrqs, &set.encode(&[]), fds).map(drop)
    }

    fn region_read(&self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), UserError> {
        let c = Command::RegionRead;
        let mut at = offset;
        for chunk in data.chunks_mut(self.max_xfer) {
            let access = RegionAccess { offset: at, region, count: chunk.len() as u32 };
            let reply = self.request(c, &access.encode(&[]), &[])?;
            let (got, bytes) = RegionAccess::decode_with_data(&reply.payload).map_err(|e| self.bad_reply(c, e))?;
            if got != access {
                return Err(self.invalid(c, format!("of {access:?} was answered for {got:?}")));
            }
            chunk.copy_from_slice(bytes);
            at = at.wrapping_add(chunk.len() as u64);
        }
        Ok(())
    }

    /// Writes `data` at `offset` of `region`. Writes to BARs are posted, as memory writes
    /// are on PCIe: sent without waiting for a reply (a failure in one is not reported; a
    /// dead server fails the next request), ordered before every later request on the
    /// socket. Configuration writes wait for their reply.
    fn region_write(&self, region: u32, offset: u64, data: &[u8]) -> Result<(), UserError> {
        let mut at = offset;
        for chunk in data.chunks(self.max_xfer) {
            let access = RegionAccess { offset: at, region, count: chunk.len() as u32 };
            if region <= LAST_BAR_REGION {
                self.post(Command::RegionWrite, &access.encode(chunk))?;
            } else {
                self.request(Command::RegionWrite, &access.encode(chunk), &[])?;
            }
            at = at.wrapping_add(chunk.len() as u64);
        }
        Ok(())
    }

    /// Sends `command` with the no-reply flag: done once it is on the socket.
    fn post(&self, command: Command, payload: &[u8]) -> Result<(), UserError> {
        let (io, mut header) = self.begin(command, payload.len())?;
        let timeout = self.timeout();
        header.flags |= FLAG_NO_REPLY;
        match transport::send(&io.stream, &header, payload, &[], Some(Instant::now() + timeout)) {
            Ok(()) => {
                self.posted.store(true, Ordering::Release);
                Ok(())
            }
            Err(e) => Err(self.broken(&io, command, e, timeout)),
        }
    }

    fn dma_map(&self, region: &DmaRegion) -> Result<(), UserError> {
        let Some((file, offset)) = &region.fd else {
            return Err(UserError::NoFd { name: self.name.clone(), iova: region.iova });
        };
        let map = DmaMap {
            flags: DMA_READ | DMA_WRITE | DMA_MAPPABLE,
            offset: *offset,
            addr: region.iova,
            size: region.size,
        };
        self.request(Command::DmaMap, &map.encode(), &[file.as_fd()]).map(drop)
    }

    fn dma_unmap(&self, iova: u64, size: u64) -> Result<(), UserError> {
        self.request(Command::DmaUnmap, &DmaUnmap { flags: 0, addr: iova, size }.encode(), &[]).map(drop)
    }
}

impl Drop for UserConnection {
    fn drop(&mut self) {
        let io = self.io.get_mut().unwrap_or_else(PoisonError::into_inner);
        let _ = io.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// A server's configuration space mapped read-only into the VMM, when the server offers
/// it for mmap (gdrvm's emulators do; the vfio-user protocol allows it for any region):
/// a configuration read then costs a copy, not a round trip to another process.
///
/// Only a file whose size is sealed (`F_SEAL_SHRINK`) is mapped: a server that could shrink
/// it could make a read fault (SIGBUS) in the VMM.
struct SharedConfig {
    map: MmapRegion<()>,
}

impl SharedConfig {
    /// Maps `size` bytes of `file` at `offset`, or says why not.
    fn map(file: Arc<File>, offset: u64, size: u64) -> Result<Self, String> {
        // SAFETY: F_GET_SEALS takes no argument and touches no memory of ours; `file` is open.
        let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err("its file's size is not sealed against shrinking".into());
        }
        let len = file.metadata().map_err(|e| format!("its file cannot be inspected: {e}"))?.len();
        if offset.checked_add(size).is_none_or(|end| end > len) {
            return Err(format!("{size:#x} bytes at {offset:#x} run past the end of its file ({len:#x} bytes)"));
        }
        let size = usize::try_from(size).map_err(|_| "it is too large".to_string())?;
        let map = MmapRegion::build(Some(FileOffset::from_arc(file, offset)), size, libc::PROT_READ, libc::MAP_SHARED)
            .map_err(|e| format!("mmap failed: {e}"))?;
        Ok(SharedConfig { map })
    }

    /// Copies `data.len()` bytes at `offset`; false if they are not all inside.
    fn read(&self, offset: u64, data: &mut [u8]) -> bool {
        let Ok(offset) = usize::try_from(offset) else { return false };
        match self.map.get_slice(offset, data.len()) {
            Ok(slice) => {
                slice.copy_to(data);
                true
            }
            Err(_) => false,
        }
    }
}

/// The device behind a [`UserConnection`], as the VFIO passthrough layer drives it. The
/// region table, interrupt counts and reset flag are read once, at open.
pub struct UserDeviceOps {
    conn: Arc<UserConnection>,
    /// By region index, BAR0 to the configuration space.
    regions: Vec<Option<RegionInfo>>,
    /// The configuration space, when the server shares it.
    shared_config: Option<SharedConfig>,
    /// INTx, MSI, MSI-X vectors.
    irqs: [u32; 3],
    can_reset: bool,
}

impl UserDeviceOps {
    /// Reads the device's region table and interrupt counts over `conn`.
    pub fn new(conn: Arc<UserConnection>) -> Result<Self, UserError> {
        let info = conn.device_info()?;
        let mut regions = Vec::new();
        for index in 0..=VFIO_PCI_CONFIG_REGION_INDEX {
            if index >= info.num_regions {
                regions.push(None);
                continue;
            }
            let (r, fd) = conn.region_info(index)?;
            let mmap_fd = fd.filter(|_| r.flags & REGION_MMAP != 0).map(Arc::new);
            if r.flags & REGION_MMAP != 0 && mmap_fd.is_none() {
                tracing::warn!(device = conn.name, region = index, "vfio-user region offered for mmap without an fd");
            }
            regions.push((r.size > 0).then(|| RegionInfo {
                size: r.size,
                offset: r.offset,
                readable: r.flags & REGION_READ != 0,
                writable: r.flags & REGION_WRITE != 0,
                mmap: mmap_fd.is_some(),
                mmap_fd,
                sparse_mmap: None,
            }));
        }
        let mut irqs = [0; 3];
        for (count, kind) in irqs.iter_mut().zip([IrqKind::Intx, IrqKind::Msi, IrqKind::Msix]) {
            if kind.index() < info.num_irqs {
                *count = conn.irq_info(kind.index())?.count;
            }
        }
        let can_reset = info.flags & DEVICE_FLAGS_RESET != 0;
        let config = regions.get(VFIO_PCI_CONFIG_REGION_INDEX as usize).and_then(Option::as_ref);
        let shared_config = config.filter(|r| r.readable).and_then(|r| {
            let file = r.mmap_fd.clone()?;
            SharedConfig::map(file, r.offset, r.size)
                .inspect_err(|why| {
                    tracing::warn!(
                        device = conn.name,
                        "vfio-user configuration space not mapped: {why}; reads go by message"
                    )
                })
                .ok()
        });
        Ok(UserDeviceOps { conn, regions, shared_config, irqs, can_reset })
    }

    /// The connection.
    pub fn connection(&self) -> &Arc<UserConnection> {
        &self.conn
    }

    /// Checks that `len` bytes at `offset` lie in region `index`.
    fn check(&self, index: u32, offset: u64, len: usize) -> io::Result<()> {
        let region = self.regions.get(index as usize).and_then(Option::as_ref);
        if region.is_some_and(|r| offset.checked_add(len as u64).is_some_and(|end| end <= r.size)) {
            return Ok(());
        }
        Err(io::Error::new(io::ErrorKind::InvalidInput, "access outside the region"))
    }
}

impl VfioDeviceOps for UserDeviceOps {
    fn region(&self, index: u32) -> Option<RegionInfo> {
        self.regions.get(index as usize).cloned().flatten()
    }

    /// A configuration read comes from the shared image when the server shares one and no
    /// posted write is outstanding (a read must not pass a posted write, as on PCIe); by
    /// message otherwise.
    fn read(&self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.check(index, offset, data.len())?;
        if index == VFIO_PCI_CONFIG_REGION_INDEX && !self.conn.posted.load(Ordering::Acquire) && !self.conn.is_failed()
        {
            if let Some(shared) = &self.shared_config {
                if shared.read(offset, data) {
                    return Ok(());
                }
            }
        }
        self.conn.region_read(index, offset, data).map_err(io::Error::other)
    }

    fn write(&self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check(index, offset, data.len())?;
        self.conn.region_write(index, offset, data).map_err(io::Error::other)
    }

    fn irq_count(&self, kind: IrqKind) -> u32 {
        match kind {
            IrqKind::Intx => self.irqs[0],
            IrqKind::Msi => self.irqs[1],
            IrqKind::Msix => self.irqs[2],
        }
    }

    fn enable_irq(&self, kind: IrqKind, fds: &[&EventFd]) -> io::Result<()> {
        // As many messages as the server's fd limit needs.
        let per_message = self.conn.max_fds.max(1);
        for (i, chunk) in fds.chunks(per_message).enumerate() {
            let set = VfioIrqSet {
                flags: IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER,
                index: kind.index(),
                start: (i * per_message) as u32,
                count: chunk.len() as u32,
            };
            let borrowed: Vec<BorrowedFd<'_>> = chunk
                .iter()
                // SAFETY: each eventfd is borrowed from `fds` for this call and so stays open
                // while the descriptors are sent.
                .map(|fd| unsafe { BorrowedFd::borrow_raw(fd.as_raw_fd()) })
                .collect();
            self.conn.set_irqs(set, &borrowed).map_err(io::Error::other)?;
        }
        Ok(())
    }

    fn disable_irq(&self, kind: IrqKind) -> io::Result<()> {
        let set =
            VfioIrqSet { flags: IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER, index: kind.index(), start: 0, count: 0 };
        self.conn.set_irqs(set, &[]).map_err(io::Error::other)
    }

    fn set_intx_resample(&self, _fd: &EventFd) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("vfio-user device {} cannot unmask INTx on a resample eventfd", self.conn.name),
        ))
    }

    fn can_reset(&self) -> bool {
        self.can_reset
    }

    fn reset(&self) -> io::Result<()> {
        self.conn.request(Command::DeviceReset, &[], &[]).map(drop).map_err(io::Error::other)
    }
}

/// A vfio-user server as a DMA target: every region of the DMA space is sent to it by fd
/// (DMA_MAP), for it to mmap.
pub struct UserDmaTarget {
    conn: Arc<UserConnection>,
}

impl UserDmaTarget {
    /// The target that maps into the server behind `conn`.
    pub fn new(conn: Arc<UserConnection>) -> Self {
        UserDmaTarget { conn }
    }
}

impl DmaTarget for UserDmaTarget {
    fn map(&mut self, region: &DmaRegion) -> Result<(), DmaError> {
        self.conn.dma_map(region).map_err(|e| DmaError::Backend(Box::new(e)))
    }

    fn unmap(&mut self, iova: u64, size: u64) -> Result<(), DmaError> {
        self.conn.dma_unmap(iova, size).map_err(|e| DmaError::Backend(Box::new(e)))
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::os::unix::net::UnixListener;
    use std::thread::JoinHandle;

    use super::*;
    use crate::pci::{BarMapping, PciDevice};
    use crate::vfio_user::test_util::{memfd, TestDevice, BAR0_SIZE};
    use crate::vfio_user::transport::Message;
    use crate::vfio_user::{serve, DmaFault, DmaMemory, Interrupts, ServerError};

    /// A real server on a thread, and what it shares with the test.
    struct Served {
        conn: Arc<UserConnection>,
        device: TestDevice,
        dma: Arc<DmaMemory>,
        irqs: Arc<Interrupts>,
        server: JoinHandle<Result<(), ServerError>>,
    }

    fn served() -> Served {
        let (client, server) = UnixStream::pair().unwrap();
        let device = TestDevice::new();
        let (dma, irqs) = (Arc::new(DmaMemory::new()), Arc::new(Interrupts::new()));
        let (mut d, m, i) = (device.clone(), dma.clone(), irqs.clone());
        let server = std::thread::spawn(move || serve(server, &mut d, &m, &i));
        let conn = UserConnection::new("gpu0", client, DEFAULT_TIMEOUT).unwrap();
        Served { conn, device, dma, irqs, server }
    }

    /// What a scripted server does with a command.
    enum Act {
        Reply(Vec<u8>),
        Error(i32),
        Silent,
        Close,
    }

    /// A server answering VERSION with `version` and everything else as `act` says.
    fn scripted(
        version: Version,
        mut act: impl FnMut(&Message) -> Act + Send + 'static,
        timeout: Duration,
    ) -> (Arc<UserConnection>, JoinHandle<()>) {
        let (client, server) = UnixStream::pair().unwrap();
        let handle = std::thread::spawn(move || {
            let deadline = || Some(Instant::now() + Duration::from_secs(5));
            while let Ok(m) = transport::receive(&server, None, Duration::from_secs(5)) {
                let reply = match m.header.command {
                    1 => Act::Reply(version.encode()),
                    _ => act(&m),
                };
                match reply {
                    Act::Reply(p) => transport::send(&server, &m.header.reply(p.len()), &p, &[], deadline()).unwrap(),
                    Act::Error(errno) => {
                        transport::send(&server, &m.header.error_reply(errno), &[], &[], deadline()).unwrap()
                    }
                    Act::Silent => {}
                    Act::Close => return,
                }
            }
        });
        (UserConnection::new("nic0", client, timeout).unwrap(), handle)
    }

    /// The emulated GPU of preset minimal, counting the configuration reads that reach it.
    struct CountingGpu {
        gpu: crate::emu::EmulatedGpu,
        config_reads: Arc<AtomicU64>,
    }

    impl crate::vfio_user::UserDevice for CountingGpu {
        fn region(&self, index: u32) -> Option<crate::vfio_user::ServerRegion> {
            self.gpu.region(index)
        }
        fn irq_count(&self, index: u32) -> u32 {
            self.gpu.irq_count(index)
        }
        fn read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
            if index == VFIO_PCI_CONFIG_REGION_INDEX {
                self.config_reads.fetch_add(1, Ordering::Relaxed);
            }
            self.gpu.read(index, offset, data)
        }
        fn write(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
            self.gpu.write(index, offset, data)
        }
        fn reset(&mut self) {
            self.gpu.reset()
        }
    }

    #[test]
    fn test_shared_configuration_space_is_read_without_a_message() {
        let node = gdrvm_model::node::Node::preset("minimal").unwrap().unwrap();
        let i = node.functions.iter().position(|f| f.name == "gpu0").unwrap();
        let irqs = Arc::new(Interrupts::new());
        let gpu = crate::emu::EmulatedGpu::new("preset minimal", &node, i, irqs.clone()).unwrap();
        let config_reads = Arc::new(AtomicU64::new(0));
        let mut device = CountingGpu { gpu, config_reads: config_reads.clone() };
        let (client, server) = UnixStream::pair().unwrap();
        let dma = Arc::new(DmaMemory::new());
        let server = std::thread::spawn(move || serve(server, &mut device, &dma, &irqs));
        let conn = UserConnection::new("gpu0", client, DEFAULT_TIMEOUT).unwrap();
        let ops = UserDeviceOps::new(conn.clone()).unwrap();
        assert!(ops.shared_config.is_some());
        let read16 = |at: u64| {
            let mut b = [0; 2];
            ops.read(VFIO_PCI_CONFIG_REGION_INDEX, at, &mut b).unwrap();
            u16::from_le_bytes(b)
        };
        assert_eq!(read16(0), 0x10de);
        let command = read16(4);
        // A configuration write waits for its reply, so the next read sees it.
        ops.write(VFIO_PCI_CONFIG_REGION_INDEX, 4, &[0x06, 0]).unwrap();
        assert_eq!(read16(4), 0x06);
        assert_ne!(command, 0x06);
        assert_eq!(config_reads.load(Ordering::Relaxed), 0, "a shared configuration read went by message");
        // After a posted BAR write, the next read goes behind it, by message; then the
        // image again.
        ops.write(0, 0x10, &[0; 4]).unwrap();
        assert!(conn.posted.load(Ordering::Acquire));
        assert_eq!(read16(0), 0x10de);
        assert_eq!(config_reads.load(Ordering::Relaxed), 1);
        assert!(!conn.posted.load(Ordering::Acquire));
        assert_eq!(read16(2), node.functions[i].device);
        assert_eq!(config_reads.load(Ordering::Relaxed), 1);
        // A reset restores the image too.
        ops.reset().unwrap();
        assert_eq!(read16(4), command);
        drop(ops);
        drop(conn);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn test_configuration_space_in_an_unsealed_file_is_not_mapped() {
        let file = Arc::new(memfd("config", 4096));
        let why = SharedConfig::map(file.clone(), 0, 4096).err().unwrap();
        assert!(why.contains("not sealed"), "{why}");
        // SAFETY: F_ADD_SEALS takes an int; `file` is open. (The test memfd has no
        // MFD_ALLOW_SEALING, so this fails and the file stays unsealed.)
        assert!(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK) } < 0);
        // The plain test device offers no mapping at all: reads go by message.
        let s = served();
        assert!(UserDeviceOps::new(s.conn.clone()).unwrap().shared_config.is_none());
    }

    #[test]
    fn test_handshake_and_region_table() {
        let s = served();
        assert_eq!((s.conn.name(), s.conn.max_data_xfer(), s.conn.is_failed()), ("gpu0", MAX_DATA_XFER, false));
        let ops = UserDeviceOps::new(s.conn.clone()).unwrap();
        let bar0 = ops.region(0).unwrap();
        assert_eq!((bar0.size, bar0.offset, bar0.readable, bar0.writable, bar0.mmap), (BAR0_SIZE, 0, true, true, true));
        assert!(bar0.mmap_fd.is_some());
        let bar2 = ops.region(2).unwrap();
        assert_eq!((bar2.size, bar2.mmap, bar2.mmap_fd.is_none()), (0x100, false, true));
        assert!(ops.region(1).is_none() && ops.region(6).is_none() && ops.region(99).is_none());
        assert_eq!(ops.region(VFIO_PCI_CONFIG_REGION_INDEX).unwrap().size, 256);
        let counts = [IrqKind::Intx, IrqKind::Msi, IrqKind::Msix].map(|k| ops.irq_count(k));
        assert_eq!(counts, [0, 1, 4]);
        assert!(ops.can_reset());
        ops.reset().unwrap();
        assert_eq!(lock(&s.device.state).resets, 1);
        drop(ops);
        drop(s.conn);
        s.server.join().unwrap().unwrap();
    }

    #[test]
    fn test_region_mmap_fd_shows_the_servers_writes() {
        let s = served();
        let ops = UserDeviceOps::new(s.conn.clone()).unwrap();
        let region = ops.region(0).unwrap();
        let fd = region.mmap_fd.unwrap();
        let len = BAR0_SIZE as usize;
        // SAFETY: a fresh shared mapping of the region's fd; unmapped below, read only
        // through volatile reads.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                region.offset as i64,
            )
        };
        assert_ne!(ptr, libc::MAP_FAILED);
        let read = |at: usize| {
            // SAFETY: `at` is inside the live mapping.
            unsafe { std::ptr::read_volatile(ptr.cast::<u8>().add(at)) }
        };
        s.device.bar0.write_all_at(&[0xab], 0x1234).unwrap();
        assert_eq!(read(0x1234), 0xab);
        ops.write(0, 0x10, &[1, 2, 3]).unwrap();
        // BAR writes are posted: a later request is ordered after them.
        ops.read(0, 0x10, &mut [0; 3]).unwrap();
        assert_eq!((read(0x10), read(0x11), read(0x12)), (1, 2, 3));
        // SAFETY: the mapping made above, no longer read.
        unsafe { libc::munmap(ptr, len) };
    }

    #[test]
    fn test_region_read_write_round_trip() {
        let s = served();
        let ops = UserDeviceOps::new(s.conn.clone()).unwrap();
        ops.write(2, 0x20, &[9, 8, 7, 6]).unwrap();
        let mut b = [0; 4];
        ops.read(2, 0x20, &mut b).unwrap();
        assert_eq!(b, [9, 8, 7, 6]);
        assert_eq!(&lock(&s.device.state).bar2[0x20..0x24], &[9, 8, 7, 6]);
        ops.read(VFIO_PCI_CONFIG_REGION_INDEX, 0, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0x10f0_1af4);
        // Outside a region: refused here, nothing sent.
        assert_eq!(ops.read(2, 0xfe, &mut b).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(ops.read(1, 0, &mut b).unwrap_err().kind(), io::ErrorKind::InvalidInput);
        // A BAR write is posted: one the device refuses is not reported (as on PCIe), and
        // the connection lives on.
        ops.write(2, 0xfc, &[0; 4]).unwrap();
        ops.read(2, 0x20, &mut b).unwrap();
        assert!(!s.conn.is_failed());
        assert_eq!(b, [9, 8, 7, 6]);
    }

    #[test]
    fn test_large_accesses_are_split_at_the_servers_limit() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let version = Version { max_data_xfer_size: 4, max_msg_fds: 1, ..Version::default() };
        let (conn, server) = scripted(
            version,
            move |m| {
                let (access, data) = RegionAccess::decode(&m.payload).unwrap();
                lock(&log).push((m.header.command, access.offset, access.count, m.fds.len()));
                match m.header.command {
                    9 => Act::Reply(access.encode(&vec![access.offset as u8; access.count as usize])),
                    10 => Act::Reply(access.encode(&[])),
                    _ => {
                        assert!(data.is_empty() || m.header.command == 8);
                        Act::Reply(Vec::new())
                    }
                }
            },
            DEFAULT_TIMEOUT,
        );
        assert_eq!(conn.max_data_xfer(), 4);
        conn.region_write(2, 0x100, &[0; 10]).unwrap();
        let mut b = [0; 6];
        conn.region_read(2, 0x10, &mut b).unwrap();
        assert_eq!(b, [0x10, 0x10, 0x10, 0x10, 0x14, 0x14]);
        assert_eq!(
            *lock(&seen),
            [(10, 0x100, 4, 0), (10, 0x104, 4, 0), (10, 0x108, 2, 0), (9, 0x10, 4, 0), (9, 0x14, 2, 0)]
        );
        drop(conn);
        server.join().unwrap();
    }

    #[test]
    fn test_set_irqs_wires_eventfds_the_server_triggers() {
        let s = served();
        let ops = UserDeviceOps::new(s.conn.clone()).unwrap();
        let fds: Vec<EventFd> = (0..4).map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap()).collect();
        let refs: Vec<&EventFd> = fds.iter().collect();
        ops.enable_irq(IrqKind::Msix, &refs).unwrap();
        assert!(s.irqs.trigger(2, 1));
        assert_eq!(fds[1].read().unwrap(), 1);
        assert!(fds[0].read().is_err(), "only vector 1 fired");
        ops.disable_irq(IrqKind::Msix).unwrap();
        assert!(!s.irqs.trigger(2, 1));
        // More vectors than offered: refused by the server.
        let five: Vec<EventFd> = (0..5).map(|_| EventFd::new(0).unwrap()).collect();
        let refs: Vec<&EventFd> = five.iter().collect();
        assert!(ops.enable_irq(IrqKind::Msix, &refs).is_err());
        assert_eq!(ops.set_intx_resample(&fds[0]).unwrap_err().kind(), io::ErrorKind::Unsupported);
    }

    #[test]
    fn test_enable_irq_splits_at_the_servers_fd_limit() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let version = Version { max_msg_fds: 2, ..Version::default() };
        let (conn, server) = scripted(
            version,
            move |m| {
                let (set, _) = VfioIrqSet::decode(&m.payload).unwrap();
                lock(&log).push((set.start, set.count, m.fds.len()));
                Act::Reply(Vec::new())
            },
            DEFAULT_TIMEOUT,
        );
        let ops = UserDeviceOps { conn, regions: Vec::new(), shared_config: None, irqs: [0, 0, 5], can_reset: false };
        let fds: Vec<EventFd> = (0..5).map(|_| EventFd::new(0).unwrap()).collect();
        ops.enable_irq(IrqKind::Msix, &fds.iter().collect::<Vec<_>>()).unwrap();
        assert_eq!(*lock(&seen), [(0, 2, 2), (2, 2, 2), (4, 1, 1)]);
        drop(ops);
        server.join().unwrap();
    }

    #[test]
    fn test_dma_map_shares_client_memory_with_the_server() {
        let s = served();
        let guest = Arc::new(memfd("guest", 0x4000));
        guest.write_all_at(b"ping", 0x1000).unwrap();
        let mut target = UserDmaTarget::new(s.conn.clone());
        let region =
            DmaRegion { iova: 0x10_0000, size: 0x3000, host_addr: 0, fd: Some((guest.clone(), 0x1000)), owner: None };
        target.map(&region).unwrap();
        let mut b = [0; 4];
        s.dma.read(0x10_0000, &mut b).unwrap();
        assert_eq!(&b, b"ping");
        s.dma.write(0x10_2000, b"pong").unwrap();
        guest.read_exact_at(&mut b, 0x3000).unwrap();
        assert_eq!(&b, b"pong");
        s.dma.copy(0x10_2000, 0x10_0800, 4).unwrap();
        guest.read_exact_at(&mut b, 0x1800).unwrap();
        assert_eq!(&b, b"pong");
        assert!(matches!(s.dma.read(0x10_3000, &mut b), Err(DmaFault::Unmapped { .. })));
        // Overlapping the first: the server refuses, the DMA space hears of it.
        let err = target.map(&DmaRegion { iova: 0x10_1000, ..region.clone() }).unwrap_err();
        let source = std::error::Error::source(&err).unwrap().to_string();
        assert_eq!(source, "vfio-user device gpu0 refused DMA_MAP");
        // Without a file nothing can be shared.
        let err = target.map(&DmaRegion { iova: 0x20_0000, fd: None, ..region.clone() }).unwrap_err();
        assert!(std::error::Error::source(&err).unwrap().to_string().contains("has no file to share"));
        target.unmap(0x10_0000, 0x3000).unwrap();
        assert!(matches!(s.dma.read(0x10_0000, &mut b), Err(DmaFault::Unmapped { .. })));
        assert!(target.unmap(0x10_0000, 0x3000).is_err());
    }

    #[test]
    fn test_error_reply_fails_the_request_promptly() {
        let (conn, server) = scripted(Version::default(), |_| Act::Error(libc::EIO), DEFAULT_TIMEOUT);
        let started = Instant::now();
        let err = conn.region_read(0, 0, &mut [0; 4]).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(err.to_string(), "vfio-user device nic0 refused REGION_READ");
        assert!(matches!(&err, UserError::Refused { source, .. } if source.raw_os_error() == Some(libc::EIO)));
        assert!(!conn.is_failed(), "an error reply leaves the connection up");
        assert!(matches!(conn.device_info(), Err(UserError::Refused { command: Command::DeviceGetInfo, .. })));
        drop(conn);
        server.join().unwrap();
    }

    #[test]
    fn test_silent_server_times_out_then_fails_fast() {
        let (conn, server) = scripted(Version::default(), |_| Act::Silent, Duration::from_millis(200));
        let started = Instant::now();
        let err = conn.region_read(0, 0, &mut [0; 4]).unwrap_err();
        let waited = started.elapsed();
        assert!(waited >= Duration::from_millis(200) && waited < Duration::from_secs(2), "{waited:?}");
        assert_eq!(err.to_string(), "vfio-user device nic0 did not answer REGION_READ within 200ms");
        assert!(conn.is_failed());
        let started = Instant::now();
        let err = conn.device_info().unwrap_err();
        assert!(started.elapsed() < Duration::from_millis(50));
        assert_eq!(err.to_string(), "vfio-user device nic0 has failed; DEVICE_GET_INFO was not sent");
        // The socket was shut down: the server saw the end.
        server.join().unwrap();
    }

    #[test]
    fn test_server_hanging_up_fails_the_connection() {
        let (conn, server) = scripted(Version::default(), |_| Act::Close, DEFAULT_TIMEOUT);
        // A configuration write waits for its reply, which never comes.
        let err = conn.region_write(VFIO_PCI_CONFIG_REGION_INDEX, 0, &[1]).unwrap_err();
        assert!(matches!(err, UserError::Closed { command: Command::RegionWrite, .. }), "{err}");
        assert!(conn.is_failed());
        assert!(matches!(conn.region_write(0, 0, &[1]), Err(UserError::Failed { .. })));
        server.join().unwrap();
    }

    #[test]
    fn test_malformed_replies_fail_the_request_only() {
        let (conn, server) = scripted(
            Version::default(),
            |m| match m.header.command {
                // Too short a region read reply, then one for another offset.
                9 if m.header.msg_id == 1 => Act::Reply(vec![0; 3]),
                9 => Act::Reply(RegionAccess { offset: 99, region: 0, count: 4 }.encode(&[0; 4])),
                _ => Act::Reply(vec![1, 2]),
            },
            DEFAULT_TIMEOUT,
        );
        assert!(matches!(conn.region_read(0, 0, &mut [0; 4]), Err(UserError::BadReply { .. })));
        assert!(matches!(conn.region_read(0, 0, &mut [0; 4]), Err(UserError::Invalid { .. })));
        assert!(matches!(conn.irq_info(2), Err(UserError::BadReply { .. })));
        assert!(!conn.is_failed());
        drop(conn);
        server.join().unwrap();
    }

    #[test]
    fn test_open_user_device_waits_for_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gpu0.sock");
        let device = TestDevice::new();
        let (listen_at, mut d) = (path.clone(), device.clone());
        let server = std::thread::spawn(move || {
            // The emulator comes up a little after the VMM starts connecting.
            std::thread::sleep(Duration::from_millis(100));
            let listener = UnixListener::bind(listen_at).unwrap();
            let (stream, _) = listener.accept().unwrap();
            serve(stream, &mut d, &DmaMemory::new(), &Interrupts::new())
        });
        let (mut dev, _dma) = open_user_device("gpu0", &path, Duration::from_secs(5), ConfigWrites::Filtered).unwrap();
        let mut b = [0; 4];
        dev.config_read(0, &mut b);
        assert_eq!(u32::from_le_bytes(b), 0x10f0_1af4);
        let bars = dev.bars();
        assert_eq!(bars.iter().map(|b| (b.index, b.size)).collect::<Vec<_>>(), [(0, BAR0_SIZE), (2, 0x100)]);
        assert!(matches!(&bars[0].mapping, BarMapping::Mapped { offset: 0, holes, .. } if holes.is_empty()));
        assert!(matches!(bars[1].mapping, BarMapping::Trapped));
        dev.bar_write(2, 4, &[5, 6]);
        dev.bar_read(2, 4, &mut b[..2]);
        assert_eq!(&b[..2], &[5, 6]);
        assert_eq!(dev.irq_count(IrqKind::Msix), 4);
        // Closing: dropping the device and the DMA target ends the server's loop.
        drop((dev, _dma));
        server.join().unwrap().unwrap();
        // Nobody listening, briefly: a connection error naming the device and the socket.
        let err = connect("gpu1", &dir.path().join("none.sock"), Duration::from_millis(60)).unwrap_err();
        assert!(err.to_string().starts_with("could not connect to vfio-user device gpu1 at "), "{err}");
    }

    #[test]
    fn test_a_failed_device_reads_all_ones() {
        let s = served();
        let ops = UserDeviceOps::new(s.conn.clone()).unwrap();
        let mut dev = VfioPciDevice::new("gpu0", Box::new(ops), ConfigWrites::Filtered).unwrap();
        // The server goes away; the first access finds out, every later one fails at once.
        s.conn.set_timeout(Duration::from_millis(200));
        let io = lock(&s.conn.io);
        io.stream.shutdown(std::net::Shutdown::Both).unwrap();
        drop(io);
        let mut b = [0; 4];
        dev.bar_read(2, 0, &mut b);
        assert_eq!(b, [0xff; 4]);
        assert!(s.conn.is_failed());
        dev.config_read(0, &mut b);
        assert_eq!(b, [0xff; 4]);
    }
}
