//! Raw Ethernet for checks that frames cross a wire: test frames with a private EtherType,
//! an AF_PACKET socket bound to one interface, and bringing an interface up (SIOCSIFFLAGS).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// IEEE 802 "local experimental" EtherType 1: never used by real protocols.
pub const ETHERTYPE: u16 = 0x88b5;
/// Length of a test frame (header and payload, without the FCS the NIC adds).
pub const FRAME_LEN: usize = 128;
/// `sll_pkttype` of frames this host sent (looped back to packet sockets).
pub const PACKET_OUTGOING: u8 = 4;
/// Where the payload's fill starts: header (14), token (8), direction (1), sequence (4).
const FILL_AT: usize = 27;

/// What a test frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// Random per run, so frames of other runs or other traffic are told apart.
    pub token: u64,
    /// Which direction of the test sent it.
    pub direction: u8,
    /// Sequence number within the direction.
    pub seq: u32,
}

fn fill(probe: &Probe, i: usize) -> u8 {
    (probe.seq as u8).wrapping_mul(31).wrapping_add(i as u8) ^ (probe.token as u8) ^ probe.direction
}

/// A test frame from `src` to `dst`.
pub fn build_frame(dst: [u8; 6], src: [u8; 6], probe: &Probe) -> Vec<u8> {
    let mut f = Vec::with_capacity(FRAME_LEN);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE.to_be_bytes());
    f.extend_from_slice(&probe.token.to_be_bytes());
    f.push(probe.direction);
    f.extend_from_slice(&probe.seq.to_be_bytes());
    f.extend((FILL_AT..FRAME_LEN).map(|i| fill(probe, i)));
    f
}

/// The probe in `frame` and whether its payload arrived intact; `None` for frames that are
/// not test frames (another EtherType, or too short to carry a probe).
pub fn parse_frame(frame: &[u8]) -> Option<(Probe, bool)> {
    if frame.len() < FILL_AT || frame[12..14] != ETHERTYPE.to_be_bytes() {
        return None;
    }
    let token = u64::from_be_bytes(frame[14..22].try_into().ok()?);
    let seq = u32::from_be_bytes(frame[23..27].try_into().ok()?);
    let probe = Probe { token, direction: frame[22], seq };
    let intact =
        frame.len() >= FRAME_LEN && frame[FILL_AT..FRAME_LEN].iter().zip(FILL_AT..).all(|(&b, i)| b == fill(&probe, i));
    Some((probe, intact))
}

/// `52:54:00:12:34:56` → bytes.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.trim().split(':');
    for b in &mut mac {
        *b = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Bytes → `52:54:00:12:34:56`.
pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn socket(domain: libc::c_int, kind: libc::c_int, protocol: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers.
    let fd = check(unsafe { libc::socket(domain, kind | libc::SOCK_CLOEXEC, protocol) })?;
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `struct ifreq` with the `ifr_flags` member of its union (40 bytes on x86-64).
#[repr(C)]
struct IfreqFlags {
    name: [libc::c_char; libc::IFNAMSIZ],
    flags: libc::c_short,
    _rest: [u8; 22],
}

/// Sets IFF_UP on interface `name`; returns whether it was already up.
pub fn set_up(name: &str) -> io::Result<bool> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad interface name '{name}'")));
    }
    let sock = socket(libc::AF_INET, libc::SOCK_DGRAM, 0)?;
    let mut req = IfreqFlags { name: [0; libc::IFNAMSIZ], flags: 0, _rest: [0; 22] };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    // SAFETY: `req` is a valid, NUL-terminated ifreq the kernel reads and writes in place.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req as *mut IfreqFlags) })?;
    let up = libc::IFF_UP as libc::c_short;
    if req.flags & up != 0 {
        return Ok(true);
    }
    req.flags |= up;
    // SAFETY: as above; the kernel only reads it.
    check(unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req as *const IfreqFlags) })?;
    Ok(false)
}

/// An AF_PACKET raw socket bound to one interface and one EtherType.
pub struct PacketSocket {
    fd: OwnedFd,
}

impl PacketSocket {
    /// Binds to interface `ifindex`, receiving only `ethertype`.
    pub fn bind(ifindex: i32, ethertype: u16) -> io::Result<PacketSocket> {
        let fd = socket(libc::AF_PACKET, libc::SOCK_RAW, libc::c_int::from(ethertype.to_be()))?;
        let addr = libc::sockaddr_ll {
            sll_family: libc::AF_PACKET as u16,
            sll_protocol: ethertype.to_be(),
            sll_ifindex: ifindex,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        // SAFETY: `addr` is a valid sockaddr_ll of the length passed.
        check(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        })?;
        Ok(PacketSocket { fd })
    }

    /// Sends one whole frame (Ethernet header included) on the bound interface.
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        // SAFETY: the buffer is valid for reads of its length.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        match usize::try_from(n) {
            Ok(n) if n == frame.len() => Ok(()),
            Ok(n) => Err(io::Error::other(format!("sent {n} of {} bytes", frame.len()))),
            Err(_) => Err(io::Error::last_os_error()),
        }
    }

    /// Receives one frame into `buf` within `timeout`: its length and `sll_pkttype`, or
    /// `None` when nothing came (or a signal interrupted the wait).
    pub fn recv(&self, buf: &mut [u8], timeout: Duration) -> io::Result<Option<(usize, u8)>> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut pfd, 1, ms) } {
            0 => return Ok(None),
            n if n < 0 => {
                let e = io::Error::last_os_error();
                return if e.kind() == io::ErrorKind::Interrupted { Ok(None) } else { Err(e) };
            }
            _ => {}
        }
        let mut addr = libc::sockaddr_ll {
            sll_family: 0,
            sll_protocol: 0,
            sll_ifindex: 0,
            sll_hatype: 0,
            sll_pkttype: 0,
            sll_halen: 0,
            sll_addr: [0; 8],
        };
        let mut len = std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
        // SAFETY: `buf` is writable for its length; `addr` and `len` describe a writable
        // sockaddr_ll.
        let n = unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_DONTWAIT,
                (&mut addr as *mut libc::sockaddr_ll).cast(),
                &mut len,
            )
        };
        match usize::try_from(n) {
            Ok(n) => Ok(Some((n, addr.sll_pkttype))),
            Err(_) => {
                let e = io::Error::last_os_error();
                if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) {
                    Ok(None)
                } else {
                    Err(e)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
    const B: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x57];

    #[test]
    fn test_frame_round_trip() {
        let probe = Probe { token: 0x0123_4567_89ab_cdef, direction: 1, seq: 7 };
        let f = build_frame(B, A, &probe);
        assert_eq!(f.len(), FRAME_LEN);
        assert_eq!(&f[..6], &B);
        assert_eq!(&f[6..12], &A);
        assert_eq!(&f[12..14], &[0x88, 0xb5]);
        assert_eq!(&f[14..22], &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef]);
        assert_eq!(&f[22..27], &[1, 0, 0, 0, 7]);
        assert_eq!(parse_frame(&f), Some((probe, true)));
        // Trailing bytes (padding some NICs add) do not matter.
        let mut padded = f.clone();
        padded.extend_from_slice(&[0; 4]);
        assert_eq!(parse_frame(&padded), Some((probe, true)));
    }

    #[test]
    fn test_frames_that_are_not_ours_or_damaged() {
        let probe = Probe { token: 42, direction: 0, seq: 3 };
        let mut f = build_frame(B, A, &probe);
        f[100] ^= 0xff;
        assert_eq!(parse_frame(&f), Some((probe, false)));
        assert_eq!(parse_frame(&f[..64]), Some((probe, false)));
        let mut ipv6 = build_frame(B, A, &probe);
        ipv6[12..14].copy_from_slice(&[0x86, 0xdd]);
        assert_eq!(parse_frame(&ipv6), None);
        assert_eq!(parse_frame(&f[..20]), None);
        // Sequence numbers change the fill, so a frame cannot pass for another.
        assert_ne!(build_frame(B, A, &Probe { seq: 4, ..probe })[FILL_AT..], f[FILL_AT..]);
    }

    #[test]
    fn test_macs() {
        assert_eq!(parse_mac("52:54:00:12:34:56\n"), Some(A));
        assert_eq!(format_mac(&A), "52:54:00:12:34:56");
        assert_eq!(parse_mac("52:54:00:12:34"), None);
        assert_eq!(parse_mac("52:54:00:12:34:56:78"), None);
        assert_eq!(parse_mac("zz:54:00:12:34:56"), None);
    }

    #[test]
    fn test_bad_interface_names() {
        assert_eq!(set_up("").unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(set_up("a-name-far-too-long").unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }
}
