//! `gdrvm-verbs pair`: an RC queue pair between two nodes. Both sides register, per size, a
//! buffer the peer writes into, a buffer holding their own pattern for the peer to read,
//! and a scratch buffer; they swap endpoints over TCP ([`crate::wire`]), connect their
//! queue pairs with the GRH RoCE needs, then in lock step: a SEND each way, an RDMA WRITE
//! at each size (the peer checks the bytes and says so), an RDMA READ at each size (checked
//! here). Every wait has a deadline: a peer that goes away fails the test under way with
//! the reason, and the tests after it as not run.

use std::net::Ipv6Addr;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use crate::ib::{self, Context, Mr, Qp, Rdma, Remote, PORT};
use crate::pattern::{self, Op};
use crate::report::{Emitter, TestResult};
use crate::wire::{Channel, Endpoint, Msg, Region, RemoteBuffer, Side, PROTOCOL_VERSION};

/// The sizes RDMA WRITE and READ move by default.
pub const DEFAULT_SIZES: [u64; 3] = [4 << 10, 64 << 10, 4 << 20];
/// Bytes of the send/receive message.
const MSG_LEN: usize = 64;
const WR_SEND: u64 = 1;
const WR_RECV: u64 = 2;
const WR_WRITE: u64 = 3;
const WR_READ: u64 = 4;

/// Which end of the side channel this process is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Listen on this TCP port (the server).
    Listen(u16),
    /// Connect to `IP:PORT` (the client).
    Connect(String),
}

/// What `pair` was asked to do.
#[derive(Debug, Clone)]
pub struct PairArgs {
    /// RDMA device (`rxe_nic0`).
    pub device: String,
    /// GID index to send from (the RoCE v2 one).
    pub gid_index: u32,
    /// Server or client.
    pub role: Role,
    /// How long any one completion may take.
    pub timeout: Duration,
    /// How long to wait for the side channel to connect.
    pub connect_timeout: Duration,
    /// The RDMA sizes.
    pub sizes: Vec<u64>,
}

impl PairArgs {
    fn side(&self) -> Side {
        match self.role {
            Role::Listen(_) => Side::Server,
            Role::Connect(_) => Side::Client,
        }
    }

    /// How long the side channel waits for the peer's next message: the peer may be
    /// waiting out a completion timeout of its own first.
    fn channel_timeout(&self) -> Duration {
        self.timeout * 2 + Duration::from_secs(5)
    }
}

/// The tests `pair` reports, in order.
pub fn test_names(sizes: &[u64]) -> Vec<String> {
    let mut names = vec!["setup".to_owned(), "qp_connect".to_owned(), "send_recv".to_owned()];
    names.extend(sizes.iter().map(|s| format!("rdma_write_{s}")));
    names.extend(sizes.iter().map(|s| format!("rdma_read_{s}")));
    names
}

/// Tracks which of the planned tests were reported, so an abort reports the rest.
struct Plan {
    names: Vec<String>,
    done: usize,
}

impl Plan {
    fn emit(&mut self, out: &mut Emitter, r: TestResult) {
        if let Some(i) = self.names.iter().position(|n| *n == r.test) {
            self.done = self.done.max(i + 1);
        }
        out.emit(r);
    }

    /// Fails the next test with `reason` and every later one as not run.
    fn abort(&mut self, out: &mut Emitter, diag: Vec<String>, reason: &str) {
        let rest: Vec<String> = self.names[self.done.min(self.names.len())..].to_vec();
        let Some((first, later)) = rest.split_first() else { return };
        self.emit(out, TestResult::fail(first, diag, reason));
        for name in later {
            self.emit(out, TestResult::fail(name, Vec::new(), format!("not run: {first} failed: {reason}")));
        }
    }
}

/// A fatal failure: diagnostics so far and the reason.
struct Abort(Vec<String>, String);

impl From<String> for Abort {
    fn from(reason: String) -> Self {
        Abort(Vec::new(), reason)
    }
}

/// Runs the pair test, reporting through `out`.
pub fn run(args: &PairArgs, out: &mut Emitter) {
    let mut plan = Plan { names: test_names(&args.sizes), done: 0 };
    if let Err(Abort(diag, reason)) = session(args, out, &mut plan) {
        plan.abort(out, diag, &reason);
    }
}

/// A random 24-bit packet sequence number.
fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    h.write_u128(now ^ u128::from(std::process::id()));
    (h.finish() & 0xff_ffff) as u32
}

/// `0.42 Gb/s`.
pub fn rate(bytes: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-9);
    format!("{:.3} Gb/s", bytes as f64 * 8.0 / secs / 1e9)
}

fn millis(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// The message each side sends the other.
pub fn greeting(side: Side, psn: u32) -> Vec<u8> {
    let mut msg = format!("gdrvm-verbs {side:?} psn {psn:06x}").into_bytes();
    msg.resize(MSG_LEN, 0);
    msg
}

/// One size's buffers.
struct Buffers<'p> {
    size: u64,
    /// The peer RDMA-WRITEs here.
    target: Mr<'p>,
    /// Our pattern, for the peer's RDMA READ.
    source: Mr<'p>,
    /// What we write from and read into.
    scratch: Mr<'p>,
}

fn session(args: &PairArgs, out: &mut Emitter, plan: &mut Plan) -> Result<(), Abort> {
    let side = args.side();
    let ctx = Context::open(&args.device)?;
    let port = ctx.query_port(PORT)?;
    let state = ib::port_state_text(port.state);
    if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
        return Err(format!("port {PORT} of {} is {state}, not PORT_ACTIVE", args.device).into());
    }
    let gid_index = u8::try_from(args.gid_index)
        .map_err(|_| format!("GID index {} does not fit the GRH (0..255)", args.gid_index))?;
    let gid = ctx.query_gid(PORT, args.gid_index)?;
    if gid == [0; 16] {
        return Err(format!("GID index {} of {} is empty", args.gid_index, args.device).into());
    }
    let pd = ctx.alloc_pd()?;
    let cq = ctx.create_cq(64)?;
    let psn = random_psn();
    // Buffers before the queue pair: Rust drops in reverse, so the QP goes first.
    let mut msg_out = pd.register(MSG_LEN)?;
    let msg_in = pd.register(MSG_LEN)?;
    let mut sets = Vec::new();
    for &size in &args.sizes {
        let len = usize::try_from(size).map_err(|_| format!("size {size} too large"))?;
        let target = pd.register(len)?;
        let mut source = pd.register(len)?;
        pattern::fill(source.bytes_mut(), pattern::seed(size, side, Op::Read, psn));
        let scratch = pd.register(len)?;
        sets.push(Buffers { size, target, source, scratch });
    }
    let mut qp = pd.create_rc_qp(&cq, 16)?;
    qp.init()?;
    let me = Endpoint {
        qpn: qp.qpn(),
        psn,
        lid: port.lid,
        gid: Ipv6Addr::from(gid).to_string(),
        mtu: port.active_mtu,
        buffers: sets
            .iter()
            .map(|b| RemoteBuffer {
                size: b.size,
                target: Region { addr: b.target.addr(), rkey: b.target.rkey() },
                source: Region { addr: b.source.addr(), rkey: b.source.rkey() },
            })
            .collect(),
    };
    plan.emit(
        out,
        TestResult::pass(
            "setup",
            vec![
                format!(
                    "{} port {PORT} {state}, active MTU {}, GID[{}] {}",
                    args.device,
                    ib::mtu_bytes(port.active_mtu),
                    args.gid_index,
                    me.gid
                ),
                format!("{side:?}: QPN {:#x}, PSN {psn:#08x}, buffers of {:?} bytes registered", me.qpn, args.sizes),
            ],
        ),
    );

    // qp_connect: side channel, endpoints, RTR/RTS, receive posted, both ready.
    let mut ch = match &args.role {
        Role::Listen(port) => Channel::accept(*port, args.connect_timeout, args.channel_timeout())?,
        Role::Connect(addr) => Channel::connect(addr, args.connect_timeout, args.channel_timeout())?,
    };
    let during = "qp_connect";
    ch.send(&Msg::Hello { version: PROTOCOL_VERSION, side, endpoint: me.clone() }, during)?;
    let peer = match ch.recv(during)? {
        Msg::Hello { version, side: their_side, endpoint } => {
            if version != PROTOCOL_VERSION {
                return Err(format!("peer {} speaks protocol {version}, we speak {PROTOCOL_VERSION}", ch.peer).into());
            }
            if their_side != side.peer() {
                return Err(format!("peer {} is a {their_side:?} too", ch.peer).into());
            }
            endpoint.validate(&args.sizes).map_err(|e| format!("peer {}: {e}", ch.peer))?;
            endpoint
        }
        other => return Err(unexpected(&ch, &other, during, "hello").into()),
    };
    let remote = Remote { qpn: peer.qpn, psn: peer.psn, gid: peer.gid_bytes()?, lid: peer.lid };
    let path_mtu = port.active_mtu.min(peer.mtu);
    qp.connect(&remote, gid_index, path_mtu, psn)?;
    // SAFETY: `msg_in` outlives the QP (declared before it) and is read only after this
    // receive's completion is polled in send_recv.
    unsafe { qp.post_recv(&msg_in, MSG_LEN, WR_RECV) }?;
    ch.send(&Msg::Ready, during)?;
    match ch.recv(during)? {
        Msg::Ready => {}
        other => return Err(unexpected(&ch, &other, during, "ready").into()),
    }
    plan.emit(
        out,
        TestResult::pass(
            during,
            vec![
                format!("side channel with {} ({side:?} side)", ch.peer),
                format!("local  QPN {:#x} PSN {:#08x} GID {}", me.qpn, me.psn, me.gid),
                format!("remote QPN {:#x} PSN {:#08x} GID {}", peer.qpn, peer.psn, peer.gid),
                format!("RC queue pair RTS, path MTU {} B, GRH from GID index {gid_index}", ib::mtu_bytes(path_mtu)),
            ],
        ),
    );

    let mut s = Session { side, psn, peer, ch, qp, timeout: args.timeout, qp_error: None };
    let r = s.send_recv(&mut msg_out, &msg_in, &cq);
    plan.emit(out, r);
    for b in &mut sets {
        let r = s.write(b, &cq)?;
        plan.emit(out, r);
    }
    for b in &mut sets {
        let r = s.read(b, &cq)?;
        plan.emit(out, r);
    }
    // Both sides are done with each other's buffers; a lost goodbye changes no result.
    if let Err(e) = s.ch.send(&Msg::Bye, "bye").and_then(|_| s.ch.recv("bye").map(|_| ())) {
        eprintln!("gdrvm-verbs: {e}");
    }
    Ok(())
}

fn unexpected(ch: &Channel, got: &Msg, during: &str, wanted: &str) -> String {
    format!("peer {} sent {got:?} during {during}, expected '{wanted}'", ch.peer)
}

/// The connected state the data tests share.
struct Session<'q> {
    side: Side,
    psn: u32,
    peer: Endpoint,
    ch: Channel,
    qp: Qp<'q>,
    timeout: Duration,
    /// Why the queue pair cannot be used any more (a failed completion puts it in error).
    qp_error: Option<String>,
}

impl Session<'_> {
    /// Waits for `wr_ids`, noting a failed or missing completion as the QP's end.
    fn complete(&mut self, cq: &ib::Cq<'_>, wr_ids: &[u64], what: &str) -> Result<Vec<ib::Completion>, String> {
        let deadline = Instant::now() + self.timeout;
        match cq.wait(wr_ids, deadline) {
            Ok(done) => {
                if let Some(bad) = done.iter().find(|c| c.status != ffi::ibv_wc_status::IBV_WC_SUCCESS) {
                    let e = format!("{what} completed with {}", ib::status_text(bad.status));
                    self.qp_error = Some(e.clone());
                    return Err(e);
                }
                Ok(done)
            }
            Err(e) => {
                let e = format!("{what}: {e}");
                self.qp_error = Some(e.clone());
                Err(e)
            }
        }
    }

    fn send_recv(&mut self, msg_out: &mut Mr<'_>, msg_in: &Mr<'_>, cq: &ib::Cq<'_>) -> TestResult {
        const NAME: &str = "send_recv";
        let mine = greeting(self.side, self.psn);
        msg_out.bytes_mut().copy_from_slice(&mine);
        let start = Instant::now();
        // SAFETY: `msg_out` is not touched again before the completion is polled below (or
        // the QP is destroyed, which ends the request, before the buffer is freed).
        if let Err(e) = unsafe { self.qp.post_send(msg_out, MSG_LEN, WR_SEND) } {
            self.qp_error = Some(e.clone());
            return TestResult::fail(NAME, Vec::new(), e);
        }
        let done = match self.complete(cq, &[WR_SEND, WR_RECV], "SEND/RECV") {
            Ok(d) => d,
            Err(e) => return TestResult::fail(NAME, Vec::new(), e),
        };
        let elapsed = start.elapsed();
        let want = greeting(self.side.peer(), self.peer.psn);
        let got_len = done.iter().find(|c| c.wr_id == WR_RECV).map_or(0, |c| c.len);
        let text = |b: &[u8]| String::from_utf8_lossy(b).trim_end_matches('\0').to_owned();
        let diag = vec![
            format!("sent {MSG_LEN} B '{}'", text(&mine)),
            format!("received {got_len} B '{}' within {}", text(msg_in.bytes()), millis(elapsed)),
        ];
        if got_len != MSG_LEN || msg_in.bytes() != want.as_slice() {
            return TestResult::fail(NAME, diag, format!("expected '{}' from the peer", text(&want)));
        }
        TestResult::pass(NAME, diag)
    }

    fn write(&mut self, b: &mut Buffers<'_>, cq: &ib::Cq<'_>) -> Result<TestResult, Abort> {
        let name = format!("rdma_write_{}", b.size);
        let len = b.size as usize;
        let theirs = *self.peer.buffer(b.size).ok_or_else(|| format!("peer has no buffer of {} B", b.size))?;
        pattern::fill(b.scratch.bytes_mut(), pattern::seed(b.size, self.side, Op::Write, self.psn));
        let mut diag = Vec::new();
        let mine: Result<Duration, String> = match self.qp_error.clone() {
            Some(e) => Err(format!("not posted: {e}")),
            None => {
                let start = Instant::now();
                // SAFETY: `scratch` is not touched until the completion is polled.
                let posted = unsafe {
                    self.qp.post_rdma(Rdma::Write, &b.scratch, len, theirs.target.addr, theirs.target.rkey, WR_WRITE)
                };
                posted
                    .and_then(|_| self.complete(cq, &[WR_WRITE], &format!("RDMA WRITE of {} B", b.size)))
                    .map(|_| start.elapsed())
            }
        };
        if let Ok(t) = &mine {
            diag.push(format!(
                "RDMA WRITE {} B to peer {:#x} (rkey {:#x}) in {}: {}",
                b.size,
                theirs.target.addr,
                theirs.target.rkey,
                millis(*t),
                rate(b.size, *t)
            ));
        }
        // If the side channel fails now, say what became of our own write too.
        let ours = mine.as_ref().err().map(|e| format!("our write: {e}"));
        let abort = |diag: &Vec<String>, e: String| Abort(diag.iter().cloned().chain(ours.clone()).collect(), e);
        let wrote = Msg::Wrote { size: b.size, ok: mine.is_ok(), error: mine.as_ref().err().cloned() };
        self.ch.send(&wrote, &name).map_err(|e| abort(&diag, e))?;
        let peer_wrote = match self.ch.recv(&name).map_err(|e| abort(&diag, e))? {
            Msg::Wrote { size, ok, error } if size == b.size => {
                if ok {
                    Ok(())
                } else {
                    Err(error.unwrap_or_else(|| "no reason given".into()))
                }
            }
            other => return Err(abort(&diag, unexpected(&self.ch, &other, &name, "wrote"))),
        };
        // Check what the peer wrote into our buffer and tell it.
        let check = peer_wrote.map_err(|e| format!("the peer's write failed: {e}")).and_then(|_| {
            pattern::verify(b.target.bytes(), pattern::seed(b.size, self.side.peer(), Op::Write, self.peer.psn))
        });
        let detail = match &check {
            Ok(()) => format!("all {} B as the writer wrote them", b.size),
            Err(e) => e.clone(),
        };
        diag.push(format!("the peer's write into our buffer: {detail}"));
        self.ch.send(&Msg::Verified { size: b.size, ok: check.is_ok(), detail }, &name).map_err(|e| abort(&diag, e))?;
        let verdict = match self.ch.recv(&name).map_err(|e| abort(&diag, e))? {
            Msg::Verified { size, ok, detail } if size == b.size => (ok, detail),
            other => return Err(abort(&diag, unexpected(&self.ch, &other, &name, "verified"))),
        };
        let problem = match (mine, verdict) {
            (Err(e), _) => Some(e),
            (Ok(_), (true, detail)) => {
                diag.push(format!("the peer checked our write: {detail}"));
                None
            }
            (Ok(_), (false, detail)) => Some(format!("the peer found our write wrong: {detail}")),
        };
        Ok(TestResult::from_outcome(&name, diag, problem))
    }

    fn read(&mut self, b: &mut Buffers<'_>, cq: &ib::Cq<'_>) -> Result<TestResult, Abort> {
        let name = format!("rdma_read_{}", b.size);
        let len = b.size as usize;
        let theirs = *self.peer.buffer(b.size).ok_or_else(|| format!("peer has no buffer of {} B", b.size))?;
        b.scratch.bytes_mut().fill(0);
        let mut diag = Vec::new();
        let problem = match self.qp_error.clone() {
            Some(e) => Some(format!("not posted: {e}")),
            None => {
                let start = Instant::now();
                // SAFETY: `scratch` is not touched until the completion is polled.
                let posted = unsafe {
                    self.qp.post_rdma(Rdma::Read, &b.scratch, len, theirs.source.addr, theirs.source.rkey, WR_READ)
                };
                match posted.and_then(|_| self.complete(cq, &[WR_READ], &format!("RDMA READ of {} B", b.size))) {
                    Err(e) => Some(e),
                    Ok(_) => {
                        let t = start.elapsed();
                        diag.push(format!(
                            "RDMA READ {} B from peer {:#x} (rkey {:#x}) in {}: {}",
                            b.size,
                            theirs.source.addr,
                            theirs.source.rkey,
                            millis(t),
                            rate(b.size, t)
                        ));
                        let seed = pattern::seed(b.size, self.side.peer(), Op::Read, self.peer.psn);
                        match pattern::verify(b.scratch.bytes(), seed) {
                            Ok(()) => {
                                diag.push(format!("all {} B are the peer's pattern", b.size));
                                None
                            }
                            Err(e) => Some(format!("the data read is wrong: {e}")),
                        }
                    }
                }
            }
        };
        // Keep both sides in step: neither moves on while the other still reads.
        let ours = problem.as_ref().map(|p| format!("our read: {p}"));
        let abort = |e: String| Abort(diag.iter().cloned().chain(ours.clone()).collect(), e);
        self.ch.send(&Msg::ReadDone { size: b.size }, &name).map_err(abort)?;
        match self.ch.recv(&name).map_err(abort)? {
            Msg::ReadDone { size } if size == b.size => {}
            other => return Err(abort(unexpected(&self.ch, &other, &name, "read_done"))),
        }
        Ok(TestResult::from_outcome(&name, diag, problem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_names_in_order() {
        assert_eq!(
            test_names(&[4096, 65536]),
            [
                "setup",
                "qp_connect",
                "send_recv",
                "rdma_write_4096",
                "rdma_write_65536",
                "rdma_read_4096",
                "rdma_read_65536"
            ]
        );
    }

    #[test]
    fn test_abort_fails_the_rest_as_not_run() {
        let mut out = Emitter::default();
        let mut plan = Plan { names: test_names(&[4096]), done: 0 };
        plan.emit(&mut out, TestResult::pass("setup", vec![]));
        plan.emit(&mut out, TestResult::pass("qp_connect", vec![]));
        plan.abort(&mut out, vec!["posted".into()], "peer 10.77.0.2:18515 closed the connection during send_recv");
        let got: Vec<(&str, bool, &str)> =
            out.results.iter().map(|r| (r.test.as_str(), r.ok, r.diag.last().map_or("", String::as_str))).collect();
        assert_eq!(
            got,
            [
                ("setup", true, ""),
                ("qp_connect", true, ""),
                ("send_recv", false, "peer 10.77.0.2:18515 closed the connection during send_recv"),
                (
                    "rdma_write_4096",
                    false,
                    "not run: send_recv failed: peer 10.77.0.2:18515 closed the connection during send_recv"
                ),
                (
                    "rdma_read_4096",
                    false,
                    "not run: send_recv failed: peer 10.77.0.2:18515 closed the connection during send_recv"
                ),
            ]
        );
        assert_eq!(out.results[2].diag, ["posted", "peer 10.77.0.2:18515 closed the connection during send_recv"]);
    }

    #[test]
    fn test_rate_and_greeting() {
        assert_eq!(rate(65536, Duration::from_millis(1)), "0.524 Gb/s");
        let g = greeting(Side::Server, 0xabc);
        assert_eq!(g.len(), MSG_LEN);
        assert!(g.starts_with(b"gdrvm-verbs Server psn 000abc\0"));
        assert_ne!(greeting(Side::Client, 0xabc), g);
    }

    /// Both ends of the pair test on one soft-RoCE device, through its own GID. Needs a live
    /// RDMA device with an IPv4 RoCE v2 GID (this kernel's `rdma_rxe` on a NIC that has an
    /// address), so it is ignored by default. Run it as root where one exists:
    /// `GDRVM_VERBS_DEVICE=rxe0 GDRVM_VERBS_GID=1 cargo test -p gdrvm-verbs loopback -- --ignored`
    #[test]
    #[ignore = "needs an RDMA device: set GDRVM_VERBS_DEVICE and GDRVM_VERBS_GID"]
    fn test_loopback_pair_on_a_real_device() {
        let device = std::env::var("GDRVM_VERBS_DEVICE").expect("GDRVM_VERBS_DEVICE names the RDMA device");
        let gid_index = std::env::var("GDRVM_VERBS_GID").ok().and_then(|g| g.parse().ok()).unwrap_or(1);
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let args = |role| PairArgs {
            device: device.clone(),
            gid_index,
            role,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
            sizes: DEFAULT_SIZES.to_vec(),
        };
        let server_args = args(Role::Listen(port));
        let server = std::thread::spawn(move || {
            let mut out = Emitter::default();
            run(&server_args, &mut out);
            out.results
        });
        let mut out = Emitter::default();
        run(&args(Role::Connect(format!("127.0.0.1:{port}"))), &mut out);
        let server = server.join().unwrap();
        for r in server.iter().chain(&out.results) {
            assert!(r.ok, "{r:?}");
        }
        assert_eq!(out.results.len(), test_names(&DEFAULT_SIZES).len());
        assert_eq!(server.len(), out.results.len());
    }
}
