//! Ethernet links between VMM processes: a [`FramePort`] is one end of an L2 link that
//! a virtio-net device sends its guest's frames into and receives the peers' frames from.
//!
//! What travels is a packet: the sending device's 12-byte `virtio_net_hdr_v1` (its
//! offload state: a checksum left to be completed, `csum_start` and `csum_offset`, a TCP
//! segmentation request, `gso_type` and `gso_size`), then the Ethernet frame without FCS,
//! as a tap with `IFF_VNET_HDR` carries them. The receiving device gives its own guest
//! what that guest accepted and finishes the rest itself (see `virtio::net`), so neither
//! end computes a checksum its guest can leave to the other, and a TCP stream crosses the
//! wire in 64 KiB frames rather than MTU-sized ones.

/// One end of an L2 link. Never blocks.
pub trait FramePort: Send + Sync {
    /// Sends one packet ([`OFFLOAD_LEN`] bytes of offload header, then the frame); one
    /// that cannot be delivered now (peer full, gone, unknown) is dropped and counted,
    /// never an error the device must handle.
    fn send(&self, packet: &[u8]);
    /// Receives one waiting packet into `buf`: Ok(Some(len)), Ok(None) when none waits.
    fn recv(&self, buf: &mut [u8]) -> std::io::Result<Option<usize>>;
    /// A file descriptor that polls readable while a packet waits.
    fn as_raw_fd(&self) -> std::os::fd::RawFd;
    /// Counters since the port opened.
    fn stats(&self) -> WireStats;
    /// The longest packet the link carries: [`MAX_PACKET`] unless the transport has a
    /// lower bound (a UDP datagram stops at 65507 bytes), which keeps a device from
    /// offering 64 KiB segmentation offload over it.
    fn max_packet(&self) -> usize {
        MAX_PACKET
    }
}

/// A port's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WireStats {
    /// Packets sent.
    pub sent: u64,
    /// Packets received.
    pub received: u64,
    /// Packets dropped (peer full, gone, unknown; too large or too short).
    pub dropped: u64,
}

mod sys;
mod udp;
mod unix;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

pub use udp::UdpPort;
pub use unix::UnixPort;

/// Bytes of the offload header before each frame: a `virtio_net_hdr_v1`.
pub const OFFLOAD_LEN: usize = 12;
/// Shortest frame a port carries: an Ethernet header (destination, source, EtherType).
pub const MIN_FRAME: usize = 14;
/// Longest frame a port carries: a 64 KiB TCP segmentation frame plus an Ethernet header
/// with a VLAN tag (the largest MTU-sized one is 9000 + 14 + 4 = 9018 bytes).
pub const MAX_FRAME: usize = 65550;
/// Shortest packet: the offload header and an Ethernet header.
pub const MIN_PACKET: usize = OFFLOAD_LEN + MIN_FRAME;
/// Longest packet: the offload header and [`MAX_FRAME`].
pub const MAX_PACKET: usize = OFFLOAD_LEN + MAX_FRAME;

/// The Ethernet frame of `packet` (empty when the packet is shorter than its header).
pub fn frame_of(packet: &[u8]) -> &[u8] {
    packet.get(OFFLOAD_LEN..).unwrap_or_default()
}

/// Where a port joins: `unix:DIR` (a hub directory of unix datagram sockets, one per port,
/// learning MAC -> socket like a switch), `udp:LOCAL_IP:PORT@REMOTE_IP:PORT` (point to point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireSpec {
    /// A hub: every port binds `DIR/<12 hex digits of its MAC>`.
    Unix(PathBuf),
    /// A UDP socket bound to `local` that sends to, and hears only, `remote`.
    Udp {
        /// The address to bind (port 0: any free port).
        local: SocketAddr,
        /// The one peer.
        remote: SocketAddr,
    },
}

/// What the text forms of a [`WireSpec`] are, for error messages.
const SPEC_FORMS: &str = "unix:DIR or udp:LOCAL_IP:PORT@REMOTE_IP:PORT";

impl FromStr for WireSpec {
    type Err = WireError;

    fn from_str(s: &str) -> Result<Self, WireError> {
        let bad = |reason: String| WireError::Spec { spec: s.to_owned(), reason };
        match s.split_once(':') {
            Some(("unix", "")) => Err(bad("'unix:' needs the hub directory after the colon".into())),
            Some(("unix", dir)) => Ok(WireSpec::Unix(PathBuf::from(dir))),
            Some(("udp", rest)) => {
                let (local, remote) = rest.split_once('@').ok_or_else(|| {
                    bad("a UDP wire is udp:LOCAL_IP:PORT@REMOTE_IP:PORT, e.g. udp:127.0.0.1:7000@127.0.0.1:7001".into())
                })?;
                let addr = |a: &str, which: &str| {
                    a.parse::<SocketAddr>()
                        .map_err(|_| bad(format!("{which} '{a}' is not a socket address (IP:PORT, or [IPv6]:PORT)")))
                };
                let (local, remote) = (addr(local, "local")?, addr(remote, "remote")?);
                if remote.ip().is_unspecified() || remote.port() == 0 {
                    return Err(bad(format!("remote {remote} is not a peer's address (an IP and a port, not 0)")));
                }
                if local.is_ipv4() != remote.is_ipv4() {
                    return Err(bad(format!("local {local} and remote {remote} are of different IP versions")));
                }
                Ok(WireSpec::Udp { local, remote })
            }
            _ => Err(bad(format!("it is not {SPEC_FORMS}"))),
        }
    }
}

impl fmt::Display for WireSpec {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        match self {
            WireSpec::Unix(dir) => write!(f, "unix:{}", dir.display()),
            WireSpec::Udp { local, remote } => write!(f, "udp:{local}@{remote}"),
        }
    }
}

/// A port that cannot be opened, or a wire spec that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The text is not a wire spec.
    #[error("'{spec}' is not a wire: {reason}")]
    Spec {
        /// The text given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// Another live port of the hub has the same MAC.
    #[error("{}: MAC {mac} already on this wire", path.display())]
    MacInUse {
        /// The socket it holds.
        path: PathBuf,
        /// The MAC, `52:54:00:00:01:00`.
        mac: String,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done, and on which path or address.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
}

impl WireError {
    fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        WireError::Io { what: what.into(), source }
    }
}

/// Opens a port with MAC `mac` on the wire `spec` names (the MAC names the port's socket on
/// a hub; a UDP port does not use it).
pub fn open(spec: &WireSpec, mac: [u8; 6]) -> Result<Box<dyn FramePort>, WireError> {
    Ok(match spec {
        WireSpec::Unix(dir) => Box::new(UnixPort::open(dir, mac)?),
        WireSpec::Udp { local, remote } => Box::new(UdpPort::open(*local, *remote)?),
    })
}

#[cfg(test)]
mod tests;
