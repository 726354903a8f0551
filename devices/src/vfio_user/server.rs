//! The server side: a [`UserDevice`] served to one vfio-user client over a Unix stream.
//!
//! [`serve`] answers every command gdrvm's client sends, fills [`DmaMemory`] from
//! DMA_MAP/DMA_UNMAP and [`Interrupts`] from DEVICE_SET_IRQS. A command that is malformed,
//! unknown or refused by the device gets an error reply and the loop goes on; a client that
//! breaks the framing (a bad header, a message cut short or stalled, too many fds) is
//! disconnected. Nothing a client sends panics the server.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::dma_memory::DmaMemory;
use super::interrupts::{Interrupts, MAX_VECTORS};
use super::protocol::*;
use super::transport::{self, TransportError};
use super::Chain;

/// How long a message, once started, may take to arrive whole, and a reply to be taken.
const STALL: Duration = Duration::from_secs(5);

/// What a vfio-user server offers: a PCI device's regions, interrupts and reset.
pub trait UserDevice: Send {
    /// Region `index` (VFIO_PCI_BAR0..5 = 0..5, ROM 6, CONFIG 7); None when absent.
    fn region(&self, index: u32) -> Option<ServerRegion>;
    /// Vectors offered for IRQ index `index` (VFIO_PCI_INTX=0, MSI=1, MSIX=2, ERR=3, REQ=4).
    fn irq_count(&self, index: u32) -> u32;
    /// Reads `data.len()` bytes of region `index` at `offset` (inside the region: checked).
    fn read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()>;
    /// Writes region `index` at `offset` (inside the region: checked).
    fn write(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Resets the device (DEVICE_RESET).
    fn reset(&mut self);
}

/// One region of a [`UserDevice`].
#[derive(Debug, Clone)]
pub struct ServerRegion {
    /// Bytes.
    pub size: u64,
    /// The client may read it.
    pub readable: bool,
    /// The client may write it.
    pub writable: bool,
    /// fd the client may mmap, and the offset of the region in it
    pub mmap: Option<(Arc<File>, u64)>,
}

/// Why [`serve`] stopped serving a client.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The client broke the framing, or the socket failed.
    #[error("the vfio-user client's message could not be received")]
    Receive(#[source] TransportError),
    /// A reply could not be sent.
    #[error("the reply to vfio-user command {command} could not be sent")]
    Send {
        /// The command number.
        command: u16,
        /// Why.
        #[source]
        source: TransportError,
    },
    /// The client sent a reply, but the server sends no commands.
    #[error("the vfio-user client sent a reply (message {0}) to no command")]
    UnexpectedReply(u16),
}

/// Serves one client on `stream` until it disconnects (Ok) or breaks the framing (Err).
/// When it returns, the client's DMA mappings and eventfds are gone from `dma` and `irqs`.
pub fn serve(
    stream: UnixStream,
    device: &mut dyn UserDevice,
    dma: &DmaMemory,
    irqs: &Interrupts,
) -> Result<(), ServerError> {
    let mut session = Session { device, dma, irqs, negotiated: false };
    let result = session.run(&stream);
    dma.clear();
    irqs.clear_all();
    if let Err(e) = &result {
        tracing::warn!("vfio-user client dropped: {}", Chain(e));
    }
    result
}

/// A successful reply: payload and at most one fd.
struct Reply {
    payload: Vec<u8>,
    fd: Option<Arc<File>>,
}

impl Reply {
    fn empty() -> Self {
        Reply { payload: Vec::new(), fd: None }
    }

    fn with(payload: Vec<u8>) -> Self {
        Reply { payload, fd: None }
    }
}

/// A refused command: the errno of the error reply.
struct Refused(i32);

/// Refuses with `errno`, saying why in the debug log.
fn refuse(errno: i32, why: impl fmt::Display) -> Refused {
    tracing::debug!(errno, "vfio-user command refused: {why}");
    Refused(errno)
}

fn malformed(e: ProtocolError) -> Refused {
    refuse(libc::EINVAL, e)
}

fn io_errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(libc::EIO)
}

struct Session<'a> {
    device: &'a mut dyn UserDevice,
    dma: &'a DmaMemory,
    irqs: &'a Interrupts,
    negotiated: bool,
}

impl Session<'_> {
    fn run(&mut self, stream: &UnixStream) -> Result<(), ServerError> {
        loop {
            let msg = match transport::receive(stream, None, STALL) {
                Ok(m) => m,
                Err(TransportError::Closed) => return Ok(()),
                Err(e) => return Err(ServerError::Receive(e)),
            };
            let header = msg.header;
            if header.is_reply() {
                return Err(ServerError::UnexpectedReply(header.msg_id));
            }
            let result = self.handle(&header, &msg.payload, msg.fds);
            if header.no_reply() {
                continue;
            }
            let deadline = Some(Instant::now() + STALL);
            let sent = match &result {
                Ok(reply) => {
                    let fd: Option<BorrowedFd<'_>> = reply.fd.as_ref().map(|f| f.as_fd());
                    let fds = fd.as_slice();
                    transport::send(stream, &header.reply(reply.payload.len()), &reply.payload, fds, deadline)
                }
                Err(Refused(errno)) => transport::send(stream, &header.error_reply(*errno), &[], &[], deadline),
            };
            sent.map_err(|source| ServerError::Send { command: header.command, source })?;
        }
    }

    fn handle(&mut self, header: &Header, payload: &[u8], fds: Vec<File>) -> Result<Reply, Refused> {
        let Some(command) = Command::from_u16(header.command) else {
            return Err(refuse(libc::ENOSYS, format_args!("unknown command {}", header.command)));
        };
        tracing::trace!(msg_id = header.msg_id, %command, len = payload.len(), fds = fds.len(), "vfio-user command");
        if !self.negotiated && command != Command::Version {
            return Err(refuse(libc::EINVAL, format_args!("{command} before VERSION")));
        }
        let takes_fds = matches!(command, Command::DmaMap | Command::DeviceSetIrqs);
        if !takes_fds && !fds.is_empty() {
            return Err(refuse(libc::EINVAL, format_args!("{command} came with {} fds", fds.len())));
        }
        match command {
            Command::Version => self.version(payload),
            Command::DmaMap => self.dma_map(payload, fds),
            Command::DmaUnmap => self.dma_unmap(payload),
            Command::DeviceGetInfo => {
                VfioDeviceInfo::decode(payload).map_err(malformed)?;
                let info = VfioDeviceInfo {
                    flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET,
                    num_regions: PCI_NUM_REGIONS,
                    num_irqs: PCI_NUM_IRQS,
                };
                Ok(Reply::with(info.encode()))
            }
            Command::DeviceGetRegionInfo => self.region_info(payload),
            Command::DeviceGetIrqInfo => {
                let asked = VfioIrqInfo::decode(payload).map_err(malformed)?;
                if asked.index >= PCI_NUM_IRQS {
                    return Err(refuse(libc::EINVAL, format_args!("no IRQ index {}", asked.index)));
                }
                let count = self.device.irq_count(asked.index).min(MAX_VECTORS);
                Ok(Reply::with(VfioIrqInfo { flags: IRQ_INFO_EVENTFD, index: asked.index, count }.encode()))
            }
            Command::DeviceSetIrqs => self.set_irqs(payload, fds),
            Command::RegionRead => self.region_read(payload),
            Command::RegionWrite => self.region_write(payload),
            Command::DeviceReset => {
                self.device.reset();
                Ok(Reply::empty())
            }
        }
    }

    fn version(&mut self, payload: &[u8]) -> Result<Reply, Refused> {
        let theirs = Version::decode(payload).map_err(malformed)?;
        if theirs.major != VERSION_MAJOR {
            return Err(refuse(libc::ENOTSUP, format_args!("client speaks version {}.{}", theirs.major, theirs.minor)));
        }
        self.negotiated = true;
        Ok(Reply::with(Version::default().encode()))
    }

    fn dma_map(&mut self, payload: &[u8], mut fds: Vec<File>) -> Result<Reply, Refused> {
        let map = DmaMap::decode(payload).map_err(malformed)?;
        let (Some(fd), true) = (fds.pop(), fds.is_empty()) else {
            return Err(refuse(libc::EINVAL, "DMA_MAP needs exactly one fd (gdrvm maps no memory it cannot see)"));
        };
        let writable = map.flags & DMA_WRITE != 0;
        self.dma.map(map.addr, map.size, &fd, map.offset, writable).map_err(|e| refuse(e.errno(), e))?;
        Ok(Reply::empty())
    }

    fn dma_unmap(&mut self, payload: &[u8]) -> Result<Reply, Refused> {
        let unmap = DmaUnmap::decode(payload).map_err(malformed)?;
        self.dma.unmap(unmap.addr, unmap.size).map_err(|e| refuse(e.errno(), e))?;
        Ok(Reply::with(unmap.encode()))
    }

    fn region_info(&mut self, payload: &[u8]) -> Result<Reply, Refused> {
        let asked = VfioRegionInfo::decode(payload).map_err(malformed)?;
        if asked.index >= PCI_NUM_REGIONS {
            return Err(refuse(libc::EINVAL, format_args!("no region index {}", asked.index)));
        }
        let mut info = VfioRegionInfo { index: asked.index, ..Default::default() };
        let mut fd = None;
        if let Some(region) = self.device.region(asked.index) {
            info.size = region.size;
            info.flags = (u32::from(region.readable) * REGION_READ) | (u32::from(region.writable) * REGION_WRITE);
            if let Some((file, offset)) = region.mmap {
                info.flags |= REGION_MMAP;
                info.offset = offset;
                fd = Some(file);
            }
        }
        Ok(Reply { payload: info.encode(), fd })
    }

    fn set_irqs(&mut self, payload: &[u8], fds: Vec<File>) -> Result<Reply, Refused> {
        let (set, data) = VfioIrqSet::decode(payload).map_err(malformed)?;
        let data_kind = set.flags & IRQ_SET_DATA_MASK;
        let action = set.flags & IRQ_SET_ACTION_MASK_ALL;
        if set.index >= PCI_NUM_IRQS
            || !data_kind.is_power_of_two()
            || !action.is_power_of_two()
            || set.flags & !(IRQ_SET_DATA_MASK | IRQ_SET_ACTION_MASK_ALL) != 0
        {
            return Err(refuse(libc::EINVAL, format_args!("bad DEVICE_SET_IRQS {set:?}")));
        }
        if action != IRQ_SET_ACTION_TRIGGER {
            return Err(refuse(libc::ENOTSUP, "masking is emulated by the VMM, not offered"));
        }
        if data_kind != IRQ_SET_DATA_EVENTFD && !fds.is_empty() {
            return Err(refuse(libc::EINVAL, "fds without DATA_EVENTFD"));
        }
        if data_kind == IRQ_SET_DATA_NONE && set.count == 0 {
            self.irqs.clear(set.index);
            return Ok(Reply::empty());
        }
        let offered = self.device.irq_count(set.index).min(MAX_VECTORS);
        let end = set.start.checked_add(set.count).filter(|&end| end <= offered && set.count > 0);
        if end.is_none() {
            return Err(refuse(libc::EINVAL, format_args!("vectors {}+{} of {offered}", set.start, set.count)));
        }
        match data_kind {
            IRQ_SET_DATA_NONE => {
                for v in set.start..set.start + set.count {
                    self.irqs.trigger(set.index, v);
                }
            }
            IRQ_SET_DATA_BOOL => {
                let Some(flags) = data.get(..set.count as usize) else {
                    return Err(refuse(libc::EINVAL, "DATA_BOOL shorter than its count"));
                };
                for (v, _) in (set.start..).zip(flags).filter(|(_, &b)| b != 0) {
                    self.irqs.trigger(set.index, v);
                }
            }
            _ => {
                if fds.len() != set.count as usize {
                    return Err(refuse(libc::EINVAL, format_args!("{} fds for {} vectors", fds.len(), set.count)));
                }
                let fds = fds.into_iter().map(eventfd).collect::<Result<Vec<_>, _>>()?;
                self.irqs.set(set.index, set.start, fds);
            }
        }
        Ok(Reply::empty())
    }

    /// Checks a region access: the region exists, allows it, and holds the range.
    fn check(&self, access: &RegionAccess, write: bool) -> Result<(), Refused> {
        if access.count as usize > MAX_DATA_XFER {
            return Err(refuse(libc::EINVAL, format_args!("access of {} bytes", access.count)));
        }
        let region = self.device.region(access.region).filter(|r| if write { r.writable } else { r.readable });
        let fits =
            region.is_some_and(|r| access.offset.checked_add(u64::from(access.count)).is_some_and(|e| e <= r.size));
        if !fits {
            return Err(refuse(libc::EINVAL, format_args!("access {access:?} outside a region that allows it")));
        }
        Ok(())
    }

    fn region_read(&mut self, payload: &[u8]) -> Result<Reply, Refused> {
        let (access, _) = RegionAccess::decode(payload).map_err(malformed)?;
        self.check(&access, false)?;
        let mut data = vec![0; access.count as usize];
        self.device.read(access.region, access.offset, &mut data).map_err(|e| refuse(io_errno(&e), e))?;
        Ok(Reply::with(access.encode(&data)))
    }

    fn region_write(&mut self, payload: &[u8]) -> Result<Reply, Refused> {
        let (access, data) = RegionAccess::decode_with_data(payload).map_err(malformed)?;
        self.check(&access, true)?;
        self.device.write(access.region, access.offset, data).map_err(|e| refuse(io_errno(&e), e))?;
        Ok(Reply::with(access.encode(&[])))
    }
}

/// `file` as an eventfd, if it is one.
fn eventfd(file: File) -> Result<EventFd, Refused> {
    let fd = OwnedFd::from(file);
    // An eventfd is an anonymous inode of that name; anything else would take our writes.
    let link = std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&fd)));
    if let Ok(link) = link {
        if link.as_os_str() != "anon_inode:[eventfd]" {
            return Err(refuse(libc::EINVAL, format_args!("an interrupt fd is {}, not an eventfd", link.display())));
        }
    }
    // SAFETY: the descriptor is owned (taken out of `fd`, which forgets it) and becomes
    // the EventFd's alone.
    Ok(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use vmm_sys_util::sock_ctrl_msg::ScmSocket;

    use super::*;
    use crate::vfio_user::test_util::{memfd, Rng, TestDevice};

    /// Runs `serve` on a thread; returns the client end and the server's result.
    fn spawn() -> (UnixStream, std::thread::JoinHandle<Result<(), ServerError>>) {
        let (client, server) = UnixStream::pair().unwrap();
        let handle = std::thread::spawn(move || {
            let mut device = TestDevice::new();
            serve(server, &mut device, &DmaMemory::new(), &Interrupts::new())
        });
        (client, handle)
    }

    fn soon() -> Option<Instant> {
        Some(Instant::now() + Duration::from_secs(2))
    }

    fn request(s: &UnixStream, id: u16, cmd: u16, payload: &[u8], fds: &[BorrowedFd<'_>]) -> transport::Message {
        let mut h = Header::command(id, Command::Version, payload.len());
        h.command = cmd;
        transport::send(s, &h, payload, fds, soon()).unwrap();
        transport::receive(s, soon(), STALL).unwrap()
    }

    fn handshake(s: &UnixStream) {
        let reply = request(s, 0, Command::Version as u16, &Version::default().encode(), &[]);
        assert!(!reply.header.is_error());
    }

    fn errno_of(m: &transport::Message) -> Option<u32> {
        m.header.is_error().then_some(m.header.error_no)
    }

    #[test]
    fn test_malformed_commands_get_error_replies() {
        let (s, server) = spawn();
        // Before VERSION.
        let m = request(&s, 1, Command::DeviceGetInfo as u16, &VfioDeviceInfo::default().encode(), &[]);
        assert_eq!(errno_of(&m), Some(libc::EINVAL as u32));
        handshake(&s);
        assert_eq!(errno_of(&request(&s, 2, 99, &[], &[])), Some(libc::ENOSYS as u32));
        assert_eq!(errno_of(&request(&s, 3, Command::DmaMap as u16, &[0; 8], &[])), Some(libc::EINVAL as u32));
        let map = DmaMap { flags: DMA_READ | DMA_WRITE, offset: 0, addr: 0, size: 0x1000 };
        assert_eq!(errno_of(&request(&s, 4, Command::DmaMap as u16, &map.encode(), &[])), Some(libc::EINVAL as u32));
        let f = memfd("x", 0x1000);
        let reply = request(&s, 5, Command::RegionRead as u16, &RegionAccess::default().encode(&[]), &[f.as_fd()]);
        assert_eq!(errno_of(&reply), Some(libc::EINVAL as u32), "fds where none belong");
        let big = RegionAccess { offset: 0, region: 0, count: u32::MAX };
        assert_eq!(
            errno_of(&request(&s, 6, Command::RegionRead as u16, &big.encode(&[]), &[])),
            Some(libc::EINVAL as u32)
        );
        let past = RegionAccess { offset: u64::MAX, region: 0, count: 4 };
        assert!(errno_of(&request(&s, 7, Command::RegionRead as u16, &past.encode(&[]), &[])).is_some());
        let short_write = RegionAccess { offset: 0, region: 0, count: 4 }.encode(&[1]);
        assert!(errno_of(&request(&s, 8, Command::RegionWrite as u16, &short_write, &[])).is_some());
        let not_eventfd =
            VfioIrqSet { flags: IRQ_SET_DATA_EVENTFD | IRQ_SET_ACTION_TRIGGER, index: 2, start: 0, count: 1 };
        let m = request(&s, 9, Command::DeviceSetIrqs as u16, &not_eventfd.encode(&[]), &[f.as_fd()]);
        assert_eq!(errno_of(&m), Some(libc::EINVAL as u32));
        let mask = VfioIrqSet { flags: IRQ_SET_DATA_NONE | IRQ_SET_ACTION_MASK, index: 2, start: 0, count: 1 };
        assert_eq!(errno_of(&request(&s, 10, 8, &mask.encode(&[]), &[])), Some(libc::ENOTSUP as u32));
        let huge =
            VfioIrqSet { flags: IRQ_SET_DATA_NONE | IRQ_SET_ACTION_TRIGGER, index: 2, start: u32::MAX, count: 2 };
        assert_eq!(errno_of(&request(&s, 11, 8, &huge.encode(&[]), &[])), Some(libc::EINVAL as u32));
        // The connection still works.
        let m = request(&s, 12, Command::DeviceGetInfo as u16, &VfioDeviceInfo::default().encode(), &[]);
        assert_eq!(VfioDeviceInfo::decode(&m.payload).unwrap().num_regions, PCI_NUM_REGIONS);
        // No reply to a no-reply command; the next one is answered.
        let mut h = Header::command(13, Command::DeviceReset, 0);
        h.flags |= FLAG_NO_REPLY;
        transport::send(&s, &h, &[], &[], soon()).unwrap();
        assert_eq!(request(&s, 14, Command::DeviceReset as u16, &[], &[]).header.msg_id, 14);
        drop(s);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn test_framing_errors_disconnect() {
        // A header too short, then EOF: the client broke off mid-message.
        let (mut s, server) = spawn();
        s.write_all(&[1, 0, 1]).unwrap();
        drop(s);
        assert!(matches!(server.join().unwrap(), Err(ServerError::Receive(TransportError::Truncated))));
        // msg_size below the header, and huge.
        for size in [4u32, u32::MAX] {
            let (mut s, server) = spawn();
            let mut h = Header::command(1, Command::Version, 0);
            h.msg_size = size;
            s.write_all(&h.encode()).unwrap();
            assert!(matches!(server.join().unwrap(), Err(ServerError::Receive(TransportError::Header(_)))));
        }
        // Too many fds.
        let (s, server) = spawn();
        let f = memfd("x", 0x1000);
        let raw = vec![f.as_raw_fd(); MAX_FDS + 1];
        s.send_with_fds(&[&Header::command(1, Command::Version, 0).encode()[..]], &raw).unwrap();
        assert!(matches!(server.join().unwrap(), Err(ServerError::Receive(TransportError::TooManyFds))));
        // A reply to nothing.
        let (s, server) = spawn();
        let h = Header::command(1, Command::Version, 0).reply(0);
        transport::send(&s, &h, &[], &[], soon()).unwrap();
        assert!(matches!(server.join().unwrap(), Err(ServerError::UnexpectedReply(1))));
    }

    #[test]
    fn test_random_messages_never_panic_the_server() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let (s, server) = spawn();
        handshake(&s);
        for i in 0..3000u32 {
            let cmd = (rng.next() % 15) as u16;
            let payload = rng.bytes(48);
            let mut h = Header::command(i as u16, Command::Version, payload.len());
            h.command = cmd;
            // Now and then, a no-reply flag; never other flags that would break framing.
            if rng.next() % 16 == 0 {
                h.flags |= FLAG_NO_REPLY;
            }
            transport::send(&s, &h, &payload, &[], soon()).unwrap();
            if !h.no_reply() {
                let reply = transport::receive(&s, soon(), STALL).unwrap();
                assert_eq!(reply.header.msg_id, i as u16);
            }
        }
        drop(s);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn test_random_bytes_on_the_socket_never_panic_the_server() {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        for _ in 0..200 {
            let (mut s, server) = spawn();
            let mut bytes = Version::default().encode();
            let h = Header::command(0, Command::Version, bytes.len()).encode();
            bytes.splice(0..0, h);
            bytes.extend(rng.bytes(200));
            s.write_all(&bytes).unwrap();
            drop(s);
            // Ok or Err, never a panic or a hang.
            let _ = server.join().unwrap();
        }
    }
}
