//! The agents' own control connection between two nodes, one per pair: the lower-named
//! node listens, the other connects (retrying while the server boots). It keeps the two
//! suites in step: before each step both say whether they can run it, the server starts
//! its side and says `go`, and both report how it went, so each node can show its peer's
//! figures. A text line protocol:
//!
//! ```text
//! hello NAME                 both, first (the client speaks first)
//! ready STEP yes|no REASON   both, before a step
//! go STEP | abort STEP WHY   the server, once its side runs (or could not start)
//! done STEP ok|fail SUMMARY  both, after the step
//! ```
//!
//! Every read has a deadline; a silent or vanished peer is an error that names the peer
//! and the step.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::process::secs;

/// The longest line a peer may send.
const MAX_LINE: u64 = 16 << 10;

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Line {
    /// The sender's node name.
    Hello(String),
    /// Whether the sender can run `step`, and why not.
    Ready {
        /// The step.
        step: String,
        /// Whether it can.
        ok: bool,
        /// Why not (empty when it can).
        reason: String,
    },
    /// The server's side of `step` runs.
    Go(String),
    /// The server could not start `step`.
    Abort {
        /// The step.
        step: String,
        /// Why.
        reason: String,
    },
    /// How `step` went on the sender's side.
    Done {
        /// The step.
        step: String,
        /// Whether it passed there.
        ok: bool,
        /// Its figure or failure, one line.
        summary: String,
    },
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

impl Line {
    /// The line's text, without the newline.
    pub fn render(&self) -> String {
        let yes = |b: bool, y: &str, n: &str| if b { y.to_owned() } else { n.to_owned() };
        match self {
            Line::Hello(name) => format!("hello {name}"),
            Line::Ready { step, ok, reason } => format!("ready {step} {} {}", yes(*ok, "yes", "no"), one_line(reason)),
            Line::Go(step) => format!("go {step}"),
            Line::Abort { step, reason } => format!("abort {step} {}", one_line(reason)),
            Line::Done { step, ok, summary } => format!("done {step} {} {}", yes(*ok, "ok", "fail"), one_line(summary)),
        }
        .trim_end()
        .to_owned()
    }

    /// Parses a line (without its newline).
    pub fn parse(text: &str) -> Option<Line> {
        let mut words = text.trim_end().splitn(4, ' ');
        let kind = words.next()?;
        let step = words.next()?.to_owned();
        let third = words.next();
        let rest = words.next().unwrap_or("").to_owned();
        let with_rest = |w: Option<&str>| match w {
            Some(w) if rest.is_empty() => w.to_owned(),
            Some(w) => format!("{w} {rest}"),
            None => String::new(),
        };
        match kind {
            "hello" if third.is_none() => Some(Line::Hello(step)),
            "go" if third.is_none() => Some(Line::Go(step)),
            "abort" => Some(Line::Abort { step, reason: with_rest(third) }),
            "ready" => Some(Line::Ready { step, ok: yes_no(third?, "yes", "no")?, reason: rest }),
            "done" => Some(Line::Done { step, ok: yes_no(third?, "ok", "fail")?, summary: rest }),
            _ => None,
        }
    }
}

fn yes_no(word: &str, yes: &str, no: &str) -> Option<bool> {
    match word {
        w if w == yes => Some(true),
        w if w == no => Some(false),
        _ => None,
    }
}

/// Makes a vanished peer (a VM killed mid-suite sends no FIN or RST) an error within about
/// 15 s: keepalive probes while idle, and a bound on unacknowledged data while sending.
fn detect_dead_peer(stream: &TcpStream) -> std::io::Result<()> {
    let fd = std::os::fd::AsRawFd::as_raw_fd(stream);
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 2),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
        (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, 15_000),
    ] {
        let v: libc::c_int = value;
        // SAFETY: `fd` is the stream's open socket; the option value is a c_int of the size passed.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// A control connection with a peer agent.
pub struct Control {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    /// `node1 (10.77.0.2:18500)`, for messages.
    pub peer: String,
}

impl Control {
    fn new(stream: TcpStream, peer: String) -> std::io::Result<Control> {
        stream.set_nonblocking(false)?;
        detect_dead_peer(&stream)?;
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(Duration::from_secs(30)))?;
        let writer = stream.try_clone()?;
        Ok(Control { reader: BufReader::new(stream), writer, peer })
    }

    /// Listens on `port` for `peer_name` (the client) for at most `window`. A connection
    /// that introduces itself as another node is dropped and the wait goes on.
    pub fn accept(port: u16, me: &str, peer_name: &str, window: Duration) -> Result<Control, String> {
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(|e| format!("cannot listen on port {port} for {peer_name}: {e}"))?;
        listener.set_nonblocking(true).map_err(|e| format!("listener on port {port}: {e}"))?;
        let deadline = Instant::now() + window;
        let mut last = String::new();
        loop {
            match listener.accept() {
                Ok((stream, addr)) => {
                    let greeted = Control::new(stream, format!("{peer_name} ({addr})"))
                        .map_err(|e| e.to_string())
                        .and_then(|mut c| {
                            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(5));
                            match c.recv("hello", left)? {
                                Line::Hello(name) if name == peer_name => {
                                    c.send(&Line::Hello(me.to_owned()), "hello")?;
                                    Ok(c)
                                }
                                other => {
                                    Err(format!("{addr} introduced itself as {}, not {peer_name}", other.render()))
                                }
                            }
                        });
                    match greeted {
                        Ok(c) => return Ok(c),
                        Err(e) => last = format!(" (last attempt: {e})"),
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("accepting on port {port}: {e}")),
            }
            if Instant::now() >= deadline {
                return Err(format!("{peer_name} did not connect to port {port} within {}{last}", secs(window)));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Connects to `peer_name` at `addr`, retrying for at most `window` while it is not
    /// listening yet.
    pub fn connect(addr: SocketAddr, me: &str, peer_name: &str, window: Duration) -> Result<Control, String> {
        let deadline = Instant::now() + window;
        let peer = format!("{peer_name} ({addr})");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let attempt =
                TcpStream::connect_timeout(&addr, left.clamp(Duration::from_millis(100), Duration::from_secs(3)))
                    .map_err(|e| e.to_string())
                    .and_then(|s| Control::new(s, peer.clone()).map_err(|e| e.to_string()))
                    .and_then(|mut c| {
                        c.send(&Line::Hello(me.to_owned()), "hello")?;
                        match c.recv("hello", Duration::from_secs(30))? {
                            Line::Hello(name) if name == peer_name => Ok(c),
                            other => Err(format!("{addr} answered as {}, not {peer_name}", other.render())),
                        }
                    });
            match attempt {
                Ok(c) => return Ok(c),
                Err(e) if Instant::now() >= deadline => {
                    return Err(format!("could not reach {peer} within {}: {e}", secs(window)));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(250)),
            }
        }
    }

    /// Sends `line`; `during` names the step for the error message.
    pub fn send(&mut self, line: &Line, during: &str) -> Result<(), String> {
        let text = format!("{}\n", line.render());
        self.writer.write_all(text.as_bytes()).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock => format!("peer {} stopped reading during {during}", self.peer),
            ErrorKind::TimedOut => format!("peer {} stopped answering (TCP timeout) during {during}", self.peer),
            _ => format!("peer {} closed the control connection during {during} ({e})", self.peer),
        })
    }

    /// The next line, waiting at most `timeout`.
    pub fn recv(&mut self, during: &str, timeout: Duration) -> Result<Line, String> {
        let peer = self.peer.clone();
        self.reader
            .get_ref()
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(|e| format!("control connection to {peer}: {e}"))?;
        let mut text = String::new();
        let n = (&mut self.reader).take(MAX_LINE).read_line(&mut text).map_err(|e| match e.kind() {
            ErrorKind::WouldBlock => format!("no word from peer {peer} within {} during {during}", secs(timeout)),
            ErrorKind::TimedOut => format!("peer {peer} stopped answering (TCP keepalive timed out) during {during}"),
            _ => format!("peer {peer} closed the control connection during {during} ({e})"),
        })?;
        if n == 0 || !text.ends_with('\n') {
            return Err(format!("peer {peer} closed the control connection during {during}"));
        }
        Line::parse(text.trim_end()).ok_or_else(|| format!("peer {peer} sent '{}' during {during}", text.trim_end()))
    }

    /// The next line, which must be about `step`.
    pub fn recv_step(&mut self, step: &str, timeout: Duration) -> Result<Line, String> {
        let line = self.recv(step, timeout)?;
        let about = match &line {
            Line::Ready { step, .. } | Line::Go(step) | Line::Abort { step, .. } | Line::Done { step, .. } => step,
            Line::Hello(_) => "hello",
        };
        if about != step {
            return Err(format!("peer {} sent '{}' while we were at {step}: out of step", self.peer, line.render()));
        }
        Ok(line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_lines_round_trip() {
        let lines = [
            Line::Hello("node0".into()),
            Line::Ready { step: "ib_write_bw".into(), ok: true, reason: String::new() },
            Line::Ready { step: "pair".into(), ok: false, reason: "gdrvm-verbs is not in the image".into() },
            Line::Go("pair".into()),
            Line::Abort {
                step: "ib_read_lat".into(),
                reason: "cannot start /usr/bin/ib_read_lat: No such file".into(),
            },
            Line::Done { step: "ib_write_bw".into(), ok: true, summary: "65536 B: 0.42 Gb/s (peak 0.45 Gb/s)".into() },
            Line::Done { step: "pair".into(), ok: false, summary: String::new() },
        ];
        for l in &lines {
            assert_eq!(Line::parse(&l.render()).as_ref(), Some(l), "{}", l.render());
        }
        assert_eq!(lines[2].render(), "ready pair no gdrvm-verbs is not in the image");
        assert_eq!(lines[6].render(), "done pair fail");
        assert_eq!(Line::Done { step: "x".into(), ok: true, summary: "a\nb".into() }.render(), "done x ok a b");
        assert_eq!(Line::parse("done pair maybe"), None);
        assert_eq!(Line::parse("hello"), None);
        assert_eq!(Line::parse("launch missiles"), None);
    }

    #[test]
    fn test_handshake_and_steps_over_tcp() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let mut c = Control::accept(port, "node0", "node1", Duration::from_secs(10)).unwrap();
            c.send(&Line::Go("pair".into()), "pair").unwrap();
            c.recv_step("pair", Duration::from_secs(5))
        });
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut client = Control::connect(addr, "node1", "node0", Duration::from_secs(10)).unwrap();
        assert_eq!(client.recv_step("pair", Duration::from_secs(5)).unwrap(), Line::Go("pair".into()));
        client.send(&Line::Done { step: "pair".into(), ok: true, summary: "9 tests ok".into() }, "pair").unwrap();
        assert_eq!(
            server.join().unwrap().unwrap(),
            Line::Done { step: "pair".into(), ok: true, summary: "9 tests ok".into() }
        );
        assert!(client.peer.starts_with("node0 (127.0.0.1:"));
    }

    #[test]
    fn test_gone_and_silent_peers_are_named() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let c = Control::accept(port, "node0", "node1", Duration::from_secs(10)).unwrap();
            std::thread::sleep(Duration::from_millis(300));
            drop(c);
        });
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let mut client = Control::connect(addr, "node1", "node0", Duration::from_secs(10)).unwrap();
        let silent = client.recv_step("ib_write_bw", Duration::from_millis(100)).unwrap_err();
        assert!(silent.starts_with("no word from peer node0 (127.0.0.1:"), "{silent}");
        assert!(silent.ends_with("within 0.1 s during ib_write_bw"), "{silent}");
        server.join().unwrap();
        let gone = client.recv_step("ib_write_bw", Duration::from_secs(5)).unwrap_err();
        assert!(gone.ends_with("closed the control connection during ib_write_bw"), "{gone}");
    }

    #[test]
    fn test_nobody_there() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let e = Control::connect(addr, "node1", "node0", Duration::from_millis(400)).err().unwrap();
        assert!(e.starts_with(&format!("could not reach node0 (127.0.0.1:{port}) within 0.4 s: ")), "{e}");
        let e = Control::accept(port, "node0", "node1", Duration::from_millis(100)).err().unwrap();
        assert_eq!(e, format!("node1 did not connect to port {port} within 0.1 s"));
    }

    #[test]
    fn test_an_impostor_is_turned_away() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let server = std::thread::spawn(move || Control::accept(port, "node0", "node1", Duration::from_millis(1500)));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let e = Control::connect(addr, "node7", "node0", Duration::from_millis(500)).err().unwrap();
        assert!(e.contains("could not reach node0"), "{e}");
        let e = server.join().unwrap().err().unwrap();
        assert!(e.contains("introduced itself as hello node7, not node1"), "{e}");
    }
}
