//! `gdrvm-verbs tcp`: TCP stream throughput between two nodes, the plain-network figure next
//! to the verbs ones (and the one `cargo xtask bench net` compares between VMMs). The client
//! sends `bytes` in 1 MiB writes and shuts its side down; the server counts to end of
//! stream and answers with the count (8 bytes, little endian), so each side times the same
//! transfer: the server from the first byte to end of stream, the client from its first
//! write to the server's answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::report::{Emitter, TestResult};

/// Bytes a client sends unless told otherwise.
pub const DEFAULT_BYTES: u64 = 64 << 20;
/// One write.
const CHUNK: usize = 1 << 20;

/// Which side this is.
pub enum TcpRole {
    /// Accept one client on this port.
    Listen(u16),
    /// Connect to the server here and send this many bytes.
    Connect(SocketAddr, u64),
}

/// `bytes` moved in `elapsed`, as the result's figure line.
pub fn figure(bytes: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!("tcp_stream {bytes} B in {secs:.3} s: {:.3} Gb/s", bytes as f64 * 8.0 / secs / 1e9)
}

/// Runs one side, every wait bounded by `timeout`, and emits `tcp_stream`.
pub fn run(role: &TcpRole, timeout: Duration, out: &mut Emitter) {
    let result = match role {
        TcpRole::Listen(port) => serve(*port, timeout),
        TcpRole::Connect(addr, bytes) => send(*addr, *bytes, timeout),
    };
    out.emit(match result {
        Ok(line) => TestResult::pass("tcp_stream", vec![line]),
        Err(e) => TestResult::fail("tcp_stream", Vec::new(), e),
    });
}

fn serve(port: u16, timeout: Duration) -> Result<String, String> {
    let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| format!("cannot listen on port {port}: {e}"))?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout;
    let (mut stream, peer) = loop {
        match listener.accept() {
            Ok(s) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(format!("no peer connected to port {port} within {} s", timeout.as_secs()))
            }
            Err(e) => return Err(format!("accept on port {port}: {e}")),
        }
    };
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    let mut started = None;
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                started.get_or_insert_with(Instant::now);
                total += n as u64;
            }
            Err(e) => return Err(format!("peer {peer} after {total} bytes: {e}")),
        }
    }
    let elapsed = started.map_or(Duration::ZERO, |s| s.elapsed());
    stream.write_all(&total.to_le_bytes()).map_err(|e| format!("answering peer {peer}: {e}"))?;
    Ok(figure(total, elapsed))
}

fn send(addr: SocketAddr, bytes: u64, timeout: Duration) -> Result<String, String> {
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(format!("cannot connect to {addr} within {} s: {e}", timeout.as_secs())),
        }
    };
    stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    let chunk = vec![0x5au8; CHUNK];
    let started = Instant::now();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(CHUNK as u64) as usize;
        stream.write_all(&chunk[..n]).map_err(|e| format!("peer {addr} after {} bytes: {e}", bytes - left))?;
        left -= n as u64;
    }
    stream.shutdown(std::net::Shutdown::Write).map_err(|e| e.to_string())?;
    let mut answer = [0u8; 8];
    stream.read_exact(&mut answer).map_err(|e| format!("peer {addr} did not confirm the count: {e}"))?;
    let elapsed = started.elapsed();
    let counted = u64::from_le_bytes(answer);
    if counted != bytes {
        return Err(format!("sent {bytes} bytes, peer {addr} counted {counted}"));
    }
    Ok(figure(bytes, elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_figure_line() {
        assert_eq!(figure(1_000_000_000, Duration::from_secs(8)), "tcp_stream 1000000000 B in 8.000 s: 1.000 Gb/s");
    }

    #[test]
    fn test_both_sides_agree_over_loopback() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let server = std::thread::spawn(move || serve(port, Duration::from_secs(10)));
        let client = send(SocketAddr::from(([127, 0, 0, 1], port)), 3 << 20, Duration::from_secs(10));
        let server = server.join().unwrap();
        assert!(client.as_deref().unwrap().starts_with("tcp_stream 3145728 B in "), "{client:?}");
        assert!(server.as_deref().unwrap().starts_with("tcp_stream 3145728 B in "), "{server:?}");
    }

    #[test]
    fn test_no_server_is_a_bounded_failure() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let e = send(addr, 1, Duration::from_millis(300)).unwrap_err();
        assert!(e.starts_with(&format!("cannot connect to {addr} within 0 s")), "{e}");
    }
}
