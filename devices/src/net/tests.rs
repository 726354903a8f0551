use std::net::UdpSocket;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::time::{Duration, Instant};

use super::*;

const A: [u8; 6] = [0x52, 0x54, 0, 0, 0, 0];
const B: [u8; 6] = [0x52, 0x54, 0, 0, 1, 0];
const C: [u8; 6] = [0x52, 0x54, 0, 0, 2, 0];
const BROADCAST: [u8; 6] = [0xff; 6];

/// A packet: an offload header asking nothing, then an Ethernet frame from `src` to `dst`
/// carrying `payload` (IPv4 EtherType).
fn frame(dst: [u8; 6], src: [u8; 6], payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(OFFLOAD_LEN + 14 + payload.len());
    f.extend_from_slice(&[0; OFFLOAD_LEN]);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(payload);
    f
}

/// Every packet waiting at `port`.
fn drain(port: &dyn FramePort) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; MAX_PACKET];
    while let Some(n) = port.recv(&mut buf).unwrap() {
        out.push(buf[..n].to_vec());
    }
    out
}

fn hub(dir: &Path, mac: [u8; 6]) -> Box<dyn FramePort> {
    open(&WireSpec::Unix(dir.to_owned()), mac).unwrap()
}

fn stats(sent: u64, received: u64, dropped: u64) -> WireStats {
    WireStats { sent, received, dropped }
}

/// Whether `fd` polls readable right now.
fn readable(fd: std::os::fd::RawFd) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, for the duration of the call.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & libc::POLLIN != 0
}

#[test]
fn test_net_unix_two_ports_unicast_and_broadcast() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hub/w0");
    let (a, b) = (hub(&dir, A), hub(&dir, B));
    assert!(dir.join("525400000000").exists() && dir.join("525400000100").exists());
    assert!(!readable(b.as_raw_fd()));

    let arp = frame(BROADCAST, A, b"who has 10.77.0.2");
    a.send(&arp);
    assert!(readable(b.as_raw_fd()));
    assert_eq!(drain(b.as_ref()), [arp]);
    assert!(drain(a.as_ref()).is_empty(), "a port never hears itself");

    let reply = frame(A, B, b"10.77.0.2 is at B");
    b.send(&reply);
    assert_eq!(drain(a.as_ref()), [reply]);
    let data = frame(B, A, &[7u8; 9000]);
    a.send(&data);
    assert_eq!(drain(b.as_ref()), [data]);
    assert_eq!(a.stats(), stats(2, 1, 0));
    assert_eq!(b.stats(), stats(1, 2, 0));
}

#[test]
fn test_net_unix_three_ports_learning() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b, c) = (hub(tmp.path(), A), hub(tmp.path(), B), hub(tmp.path(), C));

    // Broadcast reaches both others; so does unicast to a MAC nobody has sent from yet.
    let hello = frame(BROADCAST, A, b"hello");
    a.send(&hello);
    assert_eq!(drain(b.as_ref()), std::slice::from_ref(&hello));
    assert_eq!(drain(c.as_ref()), [hello]);
    let unknown = frame(B, C, b"to b, not learned yet");
    c.send(&unknown);
    assert_eq!(drain(b.as_ref()), std::slice::from_ref(&unknown));
    assert_eq!(drain(a.as_ref()), [unknown]);

    // B learned A from the broadcast: its unicast reply reaches A alone.
    let reply = frame(A, B, b"reply");
    b.send(&reply);
    assert_eq!(drain(a.as_ref()), [reply]);
    assert!(drain(c.as_ref()).is_empty());
    // A learned B from the reply: A to B is unicast too.
    let data = frame(B, A, b"data");
    a.send(&data);
    assert_eq!(drain(b.as_ref()), [data]);
    assert!(drain(c.as_ref()).is_empty());
    // Multicast (IPv6 neighbour discovery) floods whatever was learned.
    let nd = frame([0x33, 0x33, 0xff, 0, 0, 1], A, b"neighbour solicitation");
    a.send(&nd);
    assert_eq!(drain(b.as_ref()), std::slice::from_ref(&nd));
    assert_eq!(drain(c.as_ref()), [nd]);
}

#[test]
fn test_net_unix_full_peer_never_blocks_and_drops_are_counted() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (hub(tmp.path(), A), hub(tmp.path(), B));
    // A learns B; from then on B never reads.
    b.send(&frame(A, B, b"here"));
    assert_eq!(drain(a.as_ref()).len(), 1);

    let data = frame(B, A, &[1u8; 1500]);
    let start = Instant::now();
    for _ in 0..5000 {
        a.send(&data);
    }
    assert!(start.elapsed() < Duration::from_secs(5), "sending to a full peer took {:?}", start.elapsed());
    let s = a.stats();
    assert!(s.dropped > 0, "{s:?}");
    assert_eq!(s.sent + s.dropped, 5000, "{s:?}");
    // Exactly the frames counted as sent wait at B.
    let got = drain(b.as_ref());
    assert_eq!(got.len() as u64, s.sent);
    assert!(got.iter().all(|f| *f == data));
    // Once B reads again, frames get through.
    a.send(&data);
    assert_eq!(drain(b.as_ref()).len(), 1);
}

/// A peer that reads slowly (a few frames at a time, as a busy VMM's worker does) loses
/// nothing from a burst far longer than its socket's queue: the sender waits briefly for
/// room instead of dropping.
#[test]
fn test_net_unix_a_slow_peer_loses_nothing_from_a_burst() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (hub(tmp.path(), A), hub(tmp.path(), B));
    b.send(&frame(A, B, b"learn me"));
    assert_eq!(drain(a.as_ref()).len(), 1);
    const BURST: usize = 500;
    let reader = std::thread::spawn(move || {
        let mut got = 0;
        let mut buf = vec![0u8; 65536];
        let deadline = Instant::now() + Duration::from_secs(10);
        while got < BURST && Instant::now() < deadline {
            while let Some(_n) = b.recv(&mut buf).unwrap() {
                got += 1;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        got
    });
    let data = frame(B, A, &[0x5a; 4000]);
    for _ in 0..BURST {
        a.send(&data);
    }
    assert_eq!(reader.join().unwrap(), BURST);
    assert_eq!(a.stats(), stats(BURST as u64, 1, 0));
}

#[test]
fn test_net_unix_gone_peer_is_dropped_counted_and_forgotten() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (hub(tmp.path(), A), hub(tmp.path(), B));
    b.send(&frame(A, B, b"here"));
    assert_eq!(drain(a.as_ref()).len(), 1);
    drop(b);
    let to_b = frame(B, A, b"are you there");
    a.send(&to_b);
    assert_eq!(a.stats(), stats(0, 1, 1));
    // Forgotten: the next frame for B's MAC floods, and C hears it.
    let c = hub(tmp.path(), C);
    a.send(&to_b);
    assert_eq!(drain(c.as_ref()), [to_b]);
    assert_eq!(a.stats(), stats(1, 1, 1));
}

#[test]
fn test_net_unix_flood_with_nobody_else_is_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let a = hub(tmp.path(), A);
    // A stray file and a stale socket of a gone port are skipped.
    std::fs::write(tmp.path().join("README"), "not a port").unwrap();
    drop(UnixDatagram::bind(tmp.path().join("525400000900")).unwrap());
    a.send(&frame(BROADCAST, A, b"anyone?"));
    assert_eq!(a.stats(), stats(0, 0, 1));
}

#[test]
fn test_net_unix_bad_frame_sizes_are_dropped() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (hub(tmp.path(), A), hub(tmp.path(), B));
    a.send(&[0u8; MIN_PACKET - 1]);
    a.send(&vec![0u8; MAX_PACKET + 1]);
    assert_eq!(a.stats(), stats(0, 0, 2));
    // Sent straight to B's socket: too short, too long for the buffer, then a good one.
    let raw = UnixDatagram::unbound().unwrap();
    let b_path = tmp.path().join("525400000100");
    raw.send_to(&[0u8; 22], &b_path).unwrap();
    raw.send_to(&frame(B, C, &[0u8; 200]), &b_path).unwrap();
    raw.send_to(&frame(B, C, b"ok"), &b_path).unwrap();
    let mut small = [0u8; 100];
    assert_eq!(b.recv(&mut small).unwrap(), Some(OFFLOAD_LEN + 16));
    assert_eq!(&small[..OFFLOAD_LEN + 16], &frame(B, C, b"ok")[..]);
    assert_eq!(b.stats(), stats(0, 1, 2));
    assert_eq!(b.recv(&mut small).unwrap(), None);
}

#[test]
fn test_net_unix_socket_files_stale_live_and_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("525400000000");
    // A socket file left by a port that is gone: replaced.
    drop(UnixDatagram::bind(&path).unwrap());
    assert!(path.exists());
    let a = UnixPort::open(tmp.path(), A).unwrap();
    assert_eq!(a.path(), path);
    assert_eq!(a.mac(), A);
    // A live port holds the MAC: refused, and the live port keeps its socket.
    let e = UnixPort::open(tmp.path(), A).unwrap_err();
    assert_eq!(e.to_string(), format!("{}: MAC 52:54:00:00:00:00 already on this wire", path.display()));
    assert!(matches!(e, WireError::MacInUse { .. }));
    let b = hub(tmp.path(), B);
    a.send(&frame(BROADCAST, B, b"still works"));
    assert_eq!(drain(b.as_ref()).len(), 1);
    // Dropped ports remove their socket files.
    drop(a);
    drop(b);
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // Something that is not a socket is not replaced.
    std::fs::write(&path, "data").unwrap();
    let e = UnixPort::open(tmp.path(), A).unwrap_err().to_string();
    assert_eq!(e, format!("socket {}: exists and is not a socket", path.display()));
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "data");
}

#[test]
fn test_net_unix_path_too_long() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("d".repeat(100));
    let e = UnixPort::open(&dir, A).unwrap_err().to_string();
    assert!(e.ends_with("longer than a unix socket path may be (107 bytes)"), "{e}");
}

/// Two free UDP ports on 127.0.0.1.
fn free_ports() -> (SocketAddr, SocketAddr) {
    let x = UdpSocket::bind("127.0.0.1:0").unwrap();
    let y = UdpSocket::bind("127.0.0.1:0").unwrap();
    (x.local_addr().unwrap(), y.local_addr().unwrap())
}

#[test]
fn test_net_udp_pair_and_foreign_sender() {
    let (x, y) = free_ports();
    let a = open(&format!("udp:{x}@{y}").parse().unwrap(), A).unwrap();
    let b = UdpPort::open(y, x).unwrap();
    assert_eq!((b.local_addr().unwrap(), b.remote()), (y, x));

    let to_b = frame(B, A, &[3u8; 9000]);
    a.send(&to_b);
    let to_a = frame(A, B, b"back");
    b.send(&to_a);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(drain(&b), [to_b]);
    assert_eq!(drain(a.as_ref()), std::slice::from_ref(&to_a));

    // Someone else sends to A: dropped and counted; the peer still gets through.
    let stranger = UdpSocket::bind("127.0.0.1:0").unwrap();
    stranger.send_to(&frame(A, C, b"let me in"), x).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(readable(a.as_raw_fd()));
    assert!(drain(a.as_ref()).is_empty());
    b.send(&to_a);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(drain(a.as_ref()), [to_a]);
    assert_eq!(a.stats(), stats(1, 2, 1));
    assert_eq!(b.stats(), stats(2, 1, 0));

    // Short frames are not sent.
    a.send(&[0u8; 5]);
    assert_eq!(a.stats().dropped, 2);
}

#[test]
fn test_net_udp_gone_peer_does_not_fail() {
    let (x, y) = free_ports();
    // Nobody is bound at y.
    let a = UdpPort::open(x, y).unwrap();
    for _ in 0..3 {
        a.send(&frame(B, A, b"anyone"));
    }
    std::thread::sleep(Duration::from_millis(50));
    let mut buf = [0u8; 2048];
    assert_eq!(a.recv(&mut buf).unwrap(), None);
    assert_eq!(a.stats().sent + a.stats().dropped, 3);
}

#[test]
fn test_net_wire_spec_round_trip() {
    for text in
        ["unix:/tmp/gdrvm/w0", "unix:relative/dir", "udp:127.0.0.1:7000@127.0.0.1:7001", "udp:[::1]:7000@[::1]:7001"]
    {
        let spec: WireSpec = text.parse().unwrap();
        assert_eq!(spec.to_string(), text);
    }
    assert_eq!("unix:/run/w".parse::<WireSpec>().unwrap(), WireSpec::Unix("/run/w".into()));
    assert_eq!(
        "udp:0.0.0.0:0@10.0.0.2:4791".parse::<WireSpec>().unwrap(),
        WireSpec::Udp { local: "0.0.0.0:0".parse().unwrap(), remote: "10.0.0.2:4791".parse().unwrap() }
    );
}

#[test]
fn test_net_wire_spec_errors() {
    let e = |s: &str| s.parse::<WireSpec>().unwrap_err().to_string();
    assert_eq!(e("unix:"), "'unix:' is not a wire: 'unix:' needs the hub directory after the colon");
    assert_eq!(e("tap:tap0"), "'tap:tap0' is not a wire: it is not unix:DIR or udp:LOCAL_IP:PORT@REMOTE_IP:PORT");
    assert_eq!(e("/tmp/w0"), "'/tmp/w0' is not a wire: it is not unix:DIR or udp:LOCAL_IP:PORT@REMOTE_IP:PORT");
    assert_eq!(
        e("udp:127.0.0.1:7000"),
        "'udp:127.0.0.1:7000' is not a wire: a UDP wire is udp:LOCAL_IP:PORT@REMOTE_IP:PORT, \
         e.g. udp:127.0.0.1:7000@127.0.0.1:7001"
    );
    assert_eq!(
        e("udp:127.0.0.1@127.0.0.1:7001"),
        "'udp:127.0.0.1@127.0.0.1:7001' is not a wire: local '127.0.0.1' is not a socket address \
         (IP:PORT, or [IPv6]:PORT)"
    );
    assert_eq!(
        e("udp:127.0.0.1:7000@host:7001"),
        "'udp:127.0.0.1:7000@host:7001' is not a wire: remote 'host:7001' is not a socket address \
         (IP:PORT, or [IPv6]:PORT)"
    );
    assert_eq!(
        e("udp:127.0.0.1:7000@127.0.0.1:0"),
        "'udp:127.0.0.1:7000@127.0.0.1:0' is not a wire: remote 127.0.0.1:0 is not a peer's address \
         (an IP and a port, not 0)"
    );
    assert_eq!(
        e("udp:127.0.0.1:7000@[::1]:7001"),
        "'udp:127.0.0.1:7000@[::1]:7001' is not a wire: local 127.0.0.1:7000 and remote [::1]:7001 are of \
         different IP versions"
    );
    // Opening: a port already taken.
    let hold = UdpSocket::bind("127.0.0.1:0").unwrap();
    let addr = hold.local_addr().unwrap();
    let spec: WireSpec = format!("udp:{addr}@127.0.0.1:9").parse().unwrap();
    let e = open(&spec, A).err().expect("the port is taken").to_string();
    assert!(e.starts_with(&format!("binding UDP {addr}: ")), "{e}");
}
