//! The TCP side channel of `pair`: each side's queue-pair endpoint (QPN, PSN, GID, and per
//! size the buffers the peer may write and read), then the steps of the test in lock step.
//! One JSON message per line; every read has a deadline, and every failure says which peer
//! and which step ("peer 10.77.0.2:18515 closed the connection during rdma_write_4096").

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Version of the message set; both sides must agree.
pub const PROTOCOL_VERSION: u32 = 1;
/// The longest line a peer may send.
const MAX_LINE: u64 = 64 << 10;

/// Which end of the pair: the server listens, the client connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Side {
    /// The listening side.
    Server,
    /// The connecting side.
    Client,
}

impl Side {
    /// The other side.
    pub fn peer(self) -> Side {
        match self {
            Side::Server => Side::Client,
            Side::Client => Side::Server,
        }
    }
}

/// A registered buffer the peer may access: its address and remote key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Virtual address in the owner's process.
    pub addr: u64,
    /// Remote key of its memory region.
    pub rkey: u32,
}

/// The buffers of one size: `target` takes the peer's RDMA WRITE, `source` holds the
/// owner's pattern for the peer's RDMA READ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteBuffer {
    /// Bytes in each buffer.
    pub size: u64,
    /// Where the peer writes.
    pub target: Region,
    /// What the peer reads.
    pub source: Region,
}

/// Everything the peer needs to connect its queue pair to ours and reach our buffers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// First packet sequence number we send (24 bits).
    pub psn: u32,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// Our GID at the chosen index, as an IPv6 address (`::ffff:10.77.0.1`).
    pub gid: String,
    /// Our port's active MTU as `enum ibv_mtu` (1 = 256 ... 5 = 4096).
    pub mtu: u32,
    /// One entry per test size, in order.
    pub buffers: Vec<RemoteBuffer>,
}

impl Endpoint {
    /// The GID's 16 bytes, if `gid` parses.
    pub fn gid_bytes(&self) -> Result<[u8; 16], String> {
        self.gid.parse::<Ipv6Addr>().map(|a| a.octets()).map_err(|e| format!("GID '{}': {e}", self.gid))
    }

    /// Checks a peer's endpoint against the sizes we test.
    pub fn validate(&self, sizes: &[u64]) -> Result<(), String> {
        if self.psn > 0xff_ffff {
            return Err(format!("PSN {:#x} does not fit in 24 bits", self.psn));
        }
        if !(1..=5).contains(&self.mtu) {
            return Err(format!("MTU code {} is not an ibv_mtu (1..5)", self.mtu));
        }
        self.gid_bytes()?;
        let theirs: Vec<u64> = self.buffers.iter().map(|b| b.size).collect();
        if theirs != sizes {
            return Err(format!("the peer offers buffers of {theirs:?} bytes, we test {sizes:?}"));
        }
        Ok(())
    }

    /// The buffers of `size`.
    pub fn buffer(&self, size: u64) -> Option<&RemoteBuffer> {
        self.buffers.iter().find(|b| b.size == size)
    }
}

/// One message on the side channel.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    /// First message each way.
    Hello {
        /// [`PROTOCOL_VERSION`].
        version: u32,
        /// The sender's side.
        side: Side,
        /// The sender's queue pair and buffers.
        endpoint: Endpoint,
    },
    /// The sender's queue pair is ready to receive (RTR/RTS) and its receive is posted.
    Ready,
    /// The sender's RDMA WRITE of `size` completed (or not, with why).
    Wrote {
        /// Bytes written.
        size: u64,
        /// Whether the write completed successfully.
        ok: bool,
        /// Why not.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// The sender checked what its peer wrote at `size`.
    Verified {
        /// Bytes checked.
        size: u64,
        /// Whether they were the expected pattern.
        ok: bool,
        /// What was found.
        detail: String,
    },
    /// The sender finished its RDMA READ of `size`: its peer may reuse the source.
    ReadDone {
        /// Bytes read.
        size: u64,
    },
    /// The sender is done and closes.
    Bye,
}

/// The side channel to the peer.
pub struct Channel {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// The peer's address, for messages.
    pub peer: String,
    /// How long a read may wait.
    pub timeout: Duration,
}

/// `10 s`, or `0.2 s` below a second.
pub fn secs(d: Duration) -> String {
    if d.as_millis() % 1000 == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

fn retryable(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::ConnectionRefused
            | ErrorKind::TimedOut
            | ErrorKind::WouldBlock
            | ErrorKind::HostUnreachable
            | ErrorKind::NetworkUnreachable
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::AddrNotAvailable
    )
}

impl Channel {
    fn new(stream: TcpStream, timeout: Duration) -> Result<Channel, String> {
        let peer = stream.peer_addr().map_or_else(|_| "?".to_owned(), |a| a.to_string());
        let setup = || -> std::io::Result<Channel> {
            stream.set_nonblocking(false)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))?;
            let writer = stream.try_clone()?;
            Ok(Channel { reader: BufReader::new(stream), writer, peer: peer.clone(), timeout })
        };
        setup().map_err(|e| format!("setting up the connection with {peer}: {e}"))
    }

    /// Listens on `port` (all addresses) and takes the first connection within `window`.
    pub fn accept(port: u16, window: Duration, timeout: Duration) -> Result<Channel, String> {
        let listener =
            TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("cannot listen on port {port}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| format!("listener on port {port}: {e}"))?;
        let deadline = Instant::now() + window;
        loop {
            match listener.accept() {
                Ok((stream, _)) => return Channel::new(stream, timeout),
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("accepting on port {port}: {e}")),
            }
            if Instant::now() >= deadline {
                return Err(format!("no peer connected to port {port} within {}", secs(window)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Connects to `addr` (`IP:PORT`), retrying refused and unreachable attempts (the server
    /// may still be starting) until `window` has passed.
    pub fn connect(addr: &str, window: Duration, timeout: Duration) -> Result<Channel, String> {
        let target: SocketAddr = addr
            .to_socket_addrs()
            .map_err(|e| format!("bad peer address '{addr}': {e}"))?
            .next()
            .ok_or_else(|| format!("peer address '{addr}' resolves to nothing"))?;
        let deadline = Instant::now() + window;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt = left.clamp(Duration::from_millis(100), Duration::from_secs(3));
            match TcpStream::connect_timeout(&target, attempt) {
                Ok(stream) => return Channel::new(stream, timeout),
                Err(e) if retryable(e.kind()) && Instant::now() < deadline => {
                    std::thread::sleep(
                        Duration::from_millis(200).min(deadline.saturating_duration_since(Instant::now())),
                    );
                }
                Err(e) => {
                    return Err(format!("could not connect to {target} within {}: {e}", secs(window)));
                }
            }
        }
    }

    /// Sends `msg`; `during` names the step for the error message.
    pub fn send(&mut self, msg: &Msg, during: &str) -> Result<(), String> {
        let mut line = serde_json::to_string(msg).map_err(|e| format!("cannot encode {msg:?}: {e}"))?;
        line.push('\n');
        self.writer.write_all(line.as_bytes()).map_err(|e| self.io_error(&e, during))
    }

    /// Receives the next message, waiting at most `self.timeout`.
    pub fn recv(&mut self, during: &str) -> Result<Msg, String> {
        let mut line = String::new();
        let n = (&mut self.reader).take(MAX_LINE).read_line(&mut line).map_err(|e| self.io_error(&e, during))?;
        if n == 0 {
            return Err(format!("peer {} closed the connection during {during}", self.peer));
        }
        if !line.ends_with('\n') {
            if n as u64 >= MAX_LINE {
                return Err(format!("peer {} sent a line over {MAX_LINE} bytes during {during}", self.peer));
            }
            return Err(format!("peer {} closed the connection mid-message during {during}", self.peer));
        }
        serde_json::from_str(line.trim_end()).map_err(|e| {
            format!("peer {} sent an unreadable message during {during}: {e}: '{}'", self.peer, line.trim_end())
        })
    }

    /// The message for an I/O error on the channel.
    fn io_error(&self, e: &std::io::Error, during: &str) -> String {
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => {
                format!("no message from peer {} within {} during {during}", self.peer, secs(self.timeout))
            }
            ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => {
                format!("peer {} closed the connection during {during} ({e})", self.peer)
            }
            _ => format!("connection to peer {} failed during {during}: {e}", self.peer),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint {
            qpn: 0x11,
            psn: 0x4e_1fb0,
            lid: 0,
            gid: "::ffff:10.77.0.1".into(),
            mtu: 3,
            buffers: vec![RemoteBuffer {
                size: 4096,
                target: Region { addr: 0x7f0e_9f1c_d000, rkey: 0x5d4 },
                source: Region { addr: 0x7f0e_9f1d_e000, rkey: 0x5d5 },
            }],
        }
    }

    #[test]
    fn test_hello_round_trip() {
        let hello = Msg::Hello { version: PROTOCOL_VERSION, side: Side::Server, endpoint: endpoint() };
        let json = serde_json::to_string(&hello).unwrap();
        assert!(json.starts_with(r#"{"msg":"hello","version":1,"side":"server","endpoint":{"qpn":17,"#), "{json}");
        assert_eq!(serde_json::from_str::<Msg>(&json).unwrap(), hello);
        let wrote = Msg::Wrote { size: 4096, ok: true, error: None };
        assert_eq!(serde_json::to_string(&wrote).unwrap(), r#"{"msg":"wrote","size":4096,"ok":true}"#);
        assert_eq!(endpoint().gid_bytes().unwrap(), [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 77, 0, 1]);
    }

    #[test]
    fn test_peer_endpoint_validation() {
        assert_eq!(endpoint().validate(&[4096]), Ok(()));
        let e = endpoint().validate(&[4096, 65536]).unwrap_err();
        assert_eq!(e, "the peer offers buffers of [4096] bytes, we test [4096, 65536]");
        let bad_psn = Endpoint { psn: 0x100_0000, ..endpoint() };
        assert!(bad_psn.validate(&[4096]).unwrap_err().contains("24 bits"));
        let bad_gid = Endpoint { gid: "10.77.0.1.9".into(), ..endpoint() };
        assert!(bad_gid.validate(&[4096]).unwrap_err().starts_with("GID '10.77.0.1.9'"));
        let bad_mtu = Endpoint { mtu: 9, ..endpoint() };
        assert!(bad_mtu.validate(&[4096]).is_err());
    }

    /// A connected pair of channels on the loopback interface.
    fn pair(timeout: Duration) -> (Channel, Channel) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let client = std::thread::spawn(move || Channel::connect(&addr.to_string(), Duration::from_secs(5), timeout));
        let (stream, _) = listener.accept().unwrap();
        (Channel::new(stream, timeout).unwrap(), client.join().unwrap().unwrap())
    }

    #[test]
    fn test_messages_cross_and_a_closed_peer_is_named() {
        let (mut server, mut client) = pair(Duration::from_secs(5));
        client.send(&Msg::Ready, "qp_connect").unwrap();
        assert_eq!(server.recv("qp_connect").unwrap(), Msg::Ready);
        let client_addr = server.peer.clone();
        drop(client);
        let err = server.recv("rdma_write_4096").unwrap_err();
        assert_eq!(err, format!("peer {client_addr} closed the connection during rdma_write_4096"));
    }

    #[test]
    fn test_silent_peer_times_out() {
        let (mut server, _client) = pair(Duration::from_millis(200));
        let start = Instant::now();
        let err = server.recv("send_recv").unwrap_err();
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(err.starts_with("no message from peer 127.0.0.1:"), "{err}");
        assert!(err.ends_with("within 0.2 s during send_recv"), "{err}");
    }

    #[test]
    fn test_garbage_is_reported_not_trusted() {
        let (mut server, mut client) = pair(Duration::from_secs(5));
        client.writer.write_all(b"{\"msg\":\"wrote\",\"size\":\"big\"}\n").unwrap();
        let err = server.recv("rdma_write_65536").unwrap_err();
        assert!(err.contains("sent an unreadable message during rdma_write_65536"), "{err}");
    }

    #[test]
    fn test_connect_gives_up_when_nobody_listens() {
        // Bind then drop: the port is (almost certainly) closed now.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let start = Instant::now();
        let err = Channel::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(600), Duration::from_secs(1))
            .err()
            .unwrap();
        assert!(start.elapsed() >= Duration::from_millis(500), "gave up after {:?}", start.elapsed());
        assert!(err.starts_with(&format!("could not connect to 127.0.0.1:{port} within 0.6 s")), "{err}");
    }

    #[test]
    fn test_accept_gives_up() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let err = Channel::accept(port, Duration::from_millis(100), Duration::from_secs(1)).err().unwrap();
        assert_eq!(err, format!("no peer connected to port {port} within 0.1 s"));
    }
}
