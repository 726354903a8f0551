//! `udp:LOCAL@REMOTE`: a point-to-point link over one UDP socket, for ports on different
//! hosts. Every packet goes to the one remote address; datagrams from anyone else are
//! dropped. A datagram holds at most 65507 bytes, so a device on this wire offers no
//! segmentation offload ([`FramePort::max_packet`]).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use super::sys::{self, Counters};
use super::{FramePort, WireError, WireStats, MAX_PACKET, MIN_PACKET};

/// Most unusable datagrams one `recv` skips before it says that none waits.
const RECV_SKIP: usize = 256;
/// Socket buffers asked for (the kernel caps them at `net.core.[rw]mem_max`).
const BUFFER: libc::c_int = 4 << 20;
/// The largest UDP payload over IPv4 (65535 less the IP and UDP headers).
const MAX_DATAGRAM: usize = 65507;

/// One end of a `udp:LOCAL@REMOTE` link.
#[derive(Debug)]
pub struct UdpPort {
    socket: UdpSocket,
    remote: SocketAddr,
    counters: Counters,
}

impl UdpPort {
    /// Binds `local` (port 0: any free port) and sends to `remote`. The socket is not
    /// connected, so that datagrams from other senders reach the port and are counted as
    /// dropped.
    pub fn open(local: SocketAddr, remote: SocketAddr) -> Result<UdpPort, WireError> {
        let socket = UdpSocket::bind(local).map_err(|e| WireError::io(format!("binding UDP {local}"), e))?;
        socket.set_nonblocking(true).map_err(|e| WireError::io(format!("UDP socket {local}"), e))?;
        sys::set_buffer(socket.as_raw_fd(), libc::SO_SNDBUF, BUFFER);
        sys::set_buffer(socket.as_raw_fd(), libc::SO_RCVBUF, BUFFER);
        Ok(UdpPort { socket, remote, counters: Counters::default() })
    }

    /// The address the socket is bound to (with the port chosen when `local` had port 0).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.socket.local_addr()
    }

    /// The peer.
    pub fn remote(&self) -> SocketAddr {
        self.remote
    }
}

/// The sender of a datagram, when it is an IPv4 or IPv6 address.
fn sender(d: &sys::Datagram) -> Option<SocketAddr> {
    let storage = &d.from as *const libc::sockaddr_storage;
    match libc::c_int::from(d.from.ss_family) {
        libc::AF_INET if d.from_len as usize >= std::mem::size_of::<libc::sockaddr_in>() => {
            // SAFETY: the storage holds an AF_INET address, a sockaddr_in; the storage is
            // larger and at least as aligned.
            let a: libc::sockaddr_in = unsafe { std::ptr::read(storage.cast()) };
            let ip = Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 if d.from_len as usize >= std::mem::size_of::<libc::sockaddr_in6>() => {
            // SAFETY: as above, for AF_INET6 and sockaddr_in6.
            let a: libc::sockaddr_in6 = unsafe { std::ptr::read(storage.cast()) };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(ip, u16::from_be(a.sin6_port), a.sin6_flowinfo, a.sin6_scope_id)))
        }
        _ => None,
    }
}

/// Whether a datagram from `from` comes from `remote` (an IPv4 peer may show up as an
/// IPv4-mapped IPv6 address on a dual-stack socket).
fn is_remote(from: SocketAddr, remote: SocketAddr) -> bool {
    let canonical = |a: SocketAddr| (a.ip().to_canonical(), a.port());
    canonical(from) == canonical(remote)
}

impl FramePort for UdpPort {
    fn send(&self, packet: &[u8]) {
        if !(MIN_PACKET..=MAX_DATAGRAM).contains(&packet.len()) {
            self.counters.dropped();
            return;
        }
        match self.socket.send_to(packet, self.remote) {
            Ok(_) => self.counters.sent(),
            Err(e) => {
                if !sys::is_peer_busy(&e) && !sys::is_peer_gone(&e) {
                    self.counters.warn_once(&format!("sending to {}", self.remote), &e);
                }
                self.counters.dropped();
            }
        }
    }

    fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        for _ in 0..RECV_SKIP {
            let d = match sys::recv_from(self.socket.as_raw_fd(), buf) {
                Ok(Some(d)) => d,
                Ok(None) => return Ok(None),
                // An ICMP error for an earlier send (the peer's port is closed): not a frame.
                Err(e) if sys::is_peer_gone(&e) => continue,
                Err(e) => return Err(e),
            };
            let from_remote = sender(&d).is_some_and(|from| is_remote(from, self.remote));
            if !from_remote || d.len < MIN_PACKET || d.len > MAX_PACKET || d.len > buf.len() {
                self.counters.dropped();
                continue;
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

    fn max_packet(&self) -> usize {
        MAX_DATAGRAM
    }
}
