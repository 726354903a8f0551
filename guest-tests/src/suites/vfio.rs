//! `vfio`: devices passed through with VFIO work in the guest (preset `vfio-lab`). Two
//! e1000e NICs on one wire bind to the real e1000e driver, get MSI-X vectors, link up and
//! carry frames both ways; QEMU's `edu` device, driven from userspace through sysfs, answers
//! on its BAR and DMAs guest RAM -> device -> guest RAM; and edu DMAs peer-to-peer into the
//! `ivshmem` BAR ("GPU memory") at its guest-physical address. The guest has no IOMMU, so DMA
//! addresses are guest-physical addresses.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::context::Context;
use crate::dma::{PinnedPage, PAGE_SIZE};
use crate::ktap::{Check, Verdict};
use crate::net::{link_state, netdev_of, wait_for};
use crate::packet::{self, PacketSocket, Probe, ETHERTYPE, PACKET_OUTGOING};
use crate::pcidev::{self, MappedBar, Mmio, COMMAND_BUS_MASTER, COMMAND_MEMORY};
use crate::sys;

/// Intel 82574L, QEMU's `e1000e`.
const E1000E: (u16, u16) = (0x8086, 0x10d3);
/// QEMU's `edu` teaching device.
const EDU: (u16, u16) = (0x1234, 0x11e8);
/// QEMU's `ivshmem-plain` (BAR2 is shared memory).
const IVSHMEM: (u16, u16) = (0x1af4, 0x1110);

/// How long both links get to come up.
const CARRIER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a late driver probe is waited for.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// Frames sent each way.
const FRAMES: u32 = 8;
/// Rounds of sending the frames not yet received (the first frames after link-up can be
/// dropped while the kernel activates the queue).
const SEND_ROUNDS: u32 = 3;
/// How long a round waits for its frames.
const ROUND_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one edu DMA may take (edu starts it from a 100 ms timer).
const DMA_TIMEOUT: Duration = Duration::from_secs(5);

// edu's registers (QEMU docs/specs/edu.txt) and its DMA buffer.
const EDU_IDENTITY: usize = 0x00;
const EDU_LIVENESS: usize = 0x04;
const EDU_DMA_SRC: usize = 0x80;
const EDU_DMA_DST: usize = 0x88;
const EDU_DMA_COUNT: usize = 0x90;
const EDU_DMA_CMD: usize = 0x98;
/// What the identity register reads: version 1.0, 0xed.
const EDU_ID: u32 = 0x0100_00ed;
/// The registers' extent in BAR0.
const EDU_REGS_LEN: usize = 0x100;
/// The DMA buffer's address on edu's side, and the bytes each transfer moves: half the
/// 4 KiB buffer, because QEMU before 8.2.1 rejects a transfer that reaches the buffer's
/// last byte with a hw_error that aborts the whole QEMU (fixed upstream in "edu: fix DMA
/// range upper bound check"); QEMU 7.2 runs L1 here.
const EDU_BUFFER: u64 = 0x40000;
const EDU_BUFFER_LEN: usize = 2048;
/// Command: start (reads 1 while busy).
const CMD_START: u64 = 1;
/// Command: direction device buffer -> RAM (0 is RAM -> device buffer).
const CMD_FROM_DEVICE: u64 = 2;
/// Where in the ivshmem BAR the peer-to-peer copy lands.
const P2P_OFFSET: u64 = 0x1000;

pub fn run(ctx: &Context) -> Vec<Check> {
    let token = sys::random_u64();
    let (bound, nics) = e1000e_bound(ctx);
    let frames = e1000e_frames(ctx, &nics, token);
    let (identity, mut edu) = edu_identity(ctx, token);
    let dma = edu_dma(edu.as_mut(), token);
    let p2p = p2p_into_bar(ctx, edu.as_mut(), token);
    vec![bound, frames, identity, dma, p2p]
}

fn read_trimmed(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// `Check` with diagnostics and a verdict built from a list of problems.
fn check(name: &str, notes: Vec<String>, problems: &[String]) -> Check {
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    Check { diagnostics: notes, ..Check::new(name, verdict) }
}

fn fail(name: &str, notes: Vec<String>, reason: String) -> Check {
    check(name, notes, &[reason])
}

/// A NIC whose network interface exists.
struct Nic {
    bdf: String,
    dir: PathBuf,
    netdev: String,
    ifindex: i32,
    mac: [u8; 6],
}

impl Nic {
    /// Its MSI/MSI-X vectors, or its legacy INTx line when it has none.
    fn irqs(&self) -> Vec<u32> {
        let msi: Vec<u32> = pcidev::msi_irqs(&self.dir).into_iter().map(|(irq, _)| irq).collect();
        if !msi.is_empty() {
            return msi;
        }
        legacy_irq(&self.dir).into_iter().collect()
    }
}

/// The legacy (INTx) IRQ Linux routed for the function in `dir` (sysfs `irq`), if any.
fn legacy_irq(dir: &Path) -> Option<u32> {
    read_trimmed(&dir.join("irq")).and_then(|i| i.parse().ok()).filter(|&i| i != 0)
}

/// The interrupt mode the kernel command line asks of e1000e (`e1000e.IntMode=N`, the first
/// adapter's: 0 legacy INTx, 1 MSI, 2 MSI-X), if it asks.
fn e1000e_int_mode(ctx: &Context) -> Option<u32> {
    read_trimmed(&ctx.path("/proc/cmdline"))?
        .split_whitespace()
        .find_map(|w| w.strip_prefix("e1000e.IntMode="))
        .and_then(|modes| modes.split(',').next()?.parse().ok())
}

fn e1000e_bound(ctx: &Context) -> (Check, Vec<Nic>) {
    const NAME: &str = "e1000e_bound";
    let bdfs = pcidev::find(&ctx.root, E1000E.0, E1000E.1);
    if bdfs.len() < 2 {
        let reason = format!("not found: {} e1000e function(s) (8086:10d3) in sysfs {bdfs:?}, 2 needed", bdfs.len());
        return (fail(NAME, Vec::new(), reason), Vec::new());
    }
    let (mut notes, mut problems, mut nics) = (Vec::new(), Vec::new(), Vec::new());
    for bdf in &bdfs[..2] {
        let dir = pcidev::function_dir(&ctx.root, bdf);
        // e1000e probes when init loads it; give a late (asynchronous) probe a moment.
        let driver =
            wait_for(PROBE_TIMEOUT, || pcidev::driver(&dir).filter(|d| d == "e1000e")).or_else(|| pcidev::driver(&dir));
        let netdev = netdev_of(&dir);
        let irqs = pcidev::msi_irqs(&dir);
        let msix: Vec<String> = irqs.iter().filter(|(_, m)| m == "msix").map(|(i, _)| i.to_string()).collect();
        let other: Vec<String> = irqs.iter().filter(|(_, m)| m != "msix").map(|(i, m)| format!("{i} {m}")).collect();
        notes.push(format!(
            "{bdf}: driver {}, netdev {}, {} MSI-X vector(s) (IRQ {}){}",
            driver.as_deref().unwrap_or("none"),
            netdev.as_deref().unwrap_or("none"),
            msix.len(),
            msix.join(","),
            if other.is_empty() { String::new() } else { format!(", other vectors: {}", other.join(", ")) }
        ));
        if driver.as_deref() != Some("e1000e") {
            problems.push(format!("{bdf} is bound to {}", driver.as_deref().unwrap_or("no driver")));
        }
        if msix.is_empty() {
            let msi: Vec<u32> = irqs.iter().filter(|(_, m)| m == "msi").map(|(i, _)| *i).collect();
            match (e1000e_int_mode(ctx), legacy_irq(&dir)) {
                (Some(0), Some(irq)) => notes.push(format!("{bdf}: legacy INTx on IRQ {irq}, as asked")),
                (Some(1), _) if !msi.is_empty() => notes.push(format!("{bdf}: MSI on IRQ {msi:?}, as asked")),
                (Some(1), _) => problems.push(format!("{bdf} has no MSI vector in msi_irqs/, though asked")),
                _ => problems.push(format!("{bdf} has no MSI-X vectors in msi_irqs/")),
            }
        }
        let Some(netdev) = netdev else {
            problems.push(format!("{bdf} has no network interface"));
            continue;
        };
        let class = ctx.path(&format!("/sys/class/net/{netdev}"));
        let mac = read_trimmed(&class.join("address")).and_then(|m| packet::parse_mac(&m));
        let ifindex = read_trimmed(&class.join("ifindex")).and_then(|i| i.parse().ok());
        match (mac, ifindex) {
            (Some(mac), Some(ifindex)) => {
                notes.push(format!("{netdev}: ifindex {ifindex}, MAC {}", packet::format_mac(&mac)));
                nics.push(Nic { bdf: bdf.clone(), dir, netdev, ifindex, mac });
            }
            _ => problems.push(format!("{netdev}: unreadable address or ifindex in {}", class.display())),
        }
    }
    for nic in &nics {
        match packet::set_up(&nic.netdev) {
            Ok(true) => notes.push(format!("{} was already up", nic.netdev)),
            Ok(false) => notes.push(format!("{} set up (SIOCSIFFLAGS IFF_UP)", nic.netdev)),
            Err(e) => problems.push(format!("cannot bring {} up: {e}", nic.netdev)),
        }
    }
    let started = Instant::now();
    for nic in &nics {
        let ready = wait_for(CARRIER_TIMEOUT.saturating_sub(started.elapsed()), || {
            let (carrier, operstate) = link_state(&ctx.root, &nic.netdev);
            (carrier == "1" && operstate == "up").then_some(())
        });
        let (carrier, operstate) = link_state(&ctx.root, &nic.netdev);
        if ready.is_some() {
            notes.push(format!(
                "{}: carrier {carrier}, operstate {operstate} after {} ms",
                nic.netdev,
                started.elapsed().as_millis()
            ));
        } else {
            problems.push(format!(
                "{}: no link within {} s (carrier {carrier}, operstate {operstate})",
                nic.netdev,
                CARRIER_TIMEOUT.as_secs()
            ));
        }
    }
    (check(NAME, notes, &problems), nics)
}

/// What one direction of the frame test saw.
#[derive(Debug, Default)]
struct Transfer {
    received: BTreeSet<u32>,
    sent: u32,
    rounds: u32,
    damaged: u32,
    foreign: u32,
    elapsed: Duration,
}

/// Sends [`FRAMES`] test frames from `from` to `to` (again, for the missing ones, up to
/// [`SEND_ROUNDS`] times) and collects those that arrive intact.
fn transfer(from: &Nic, to: &Nic, token: u64, direction: u8) -> Result<Transfer, String> {
    let rx =
        PacketSocket::bind(to.ifindex, ETHERTYPE).map_err(|e| format!("AF_PACKET socket on {}: {e}", to.netdev))?;
    let tx =
        PacketSocket::bind(from.ifindex, ETHERTYPE).map_err(|e| format!("AF_PACKET socket on {}: {e}", from.netdev))?;
    let mut t = Transfer::default();
    let started = Instant::now();
    let mut buf = [0u8; 2048];
    for round in 1..=SEND_ROUNDS {
        t.rounds = round;
        for seq in (0..FRAMES).filter(|s| !t.received.contains(s)) {
            let frame = packet::build_frame(to.mac, from.mac, &Probe { token, direction, seq });
            tx.send(&frame).map_err(|e| format!("sending on {}: {e}", from.netdev))?;
            t.sent += 1;
        }
        let deadline = Instant::now() + ROUND_TIMEOUT;
        while t.received.len() < FRAMES as usize {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let got = rx.recv(&mut buf, left).map_err(|e| format!("receiving on {}: {e}", to.netdev))?;
            let Some((n, pkttype)) = got else { continue };
            if pkttype == PACKET_OUTGOING {
                continue;
            }
            match packet::parse_frame(&buf[..n]) {
                Some((p, true)) if p.token == token && p.direction == direction && p.seq < FRAMES => {
                    t.received.insert(p.seq);
                }
                Some((p, false)) if p.token == token => t.damaged += 1,
                _ => t.foreign += 1,
            }
        }
        if t.received.len() == FRAMES as usize {
            break;
        }
    }
    t.elapsed = started.elapsed();
    Ok(t)
}

fn interrupts(ctx: &Context) -> Option<std::collections::BTreeMap<u32, u64>> {
    std::fs::read_to_string(ctx.path("/proc/interrupts")).ok().map(|t| pcidev::interrupt_counts(&t))
}

fn e1000e_frames(ctx: &Context, nics: &[Nic], token: u64) -> Check {
    const NAME: &str = "e1000e_frames";
    let [a, b] = nics else {
        return fail(NAME, Vec::new(), "not found: two e1000e interfaces are needed (see e1000e_bound)".into());
    };
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    notes.push(format!("token {token:#018x}, EtherType {ETHERTYPE:#06x}, {FRAMES} frames each way"));
    let before = interrupts(ctx);
    for (direction, (from, to)) in [(a, b), (b, a)].into_iter().enumerate() {
        let arrow = format!("{} ({}) -> {} ({})", from.netdev, from.bdf, to.netdev, to.bdf);
        match transfer(from, to, token, direction as u8) {
            Ok(t) => {
                notes.push(format!(
                    "{arrow}: {}/{FRAMES} frames received, {} sent in {} round(s), {} ms; {} damaged, {} other frame(s) of that EtherType",
                    t.received.len(),
                    t.sent,
                    t.rounds,
                    t.elapsed.as_millis(),
                    t.damaged,
                    t.foreign
                ));
                if t.received.len() < FRAMES as usize {
                    let missing: Vec<String> =
                        (0..FRAMES).filter(|s| !t.received.contains(s)).map(|s| s.to_string()).collect();
                    problems.push(format!("{arrow}: frames {} never arrived", missing.join(",")));
                }
            }
            Err(e) => problems.push(format!("{arrow}: {e}")),
        }
    }
    let after = interrupts(ctx);
    for nic in [a, b] {
        // e1000e tests MSI when the interface comes up and falls back to INTx, quietly but
        // for a log line, when its test interrupt does not arrive. QEMU's e1000e model never
        // raises that one (its IMS drops the test's cause, RXSEQ), so on vfio-lab MSI mode
        // always ends on INTx: said as a failure, since MSI was asked for and not tested.
        let msi = pcidev::msi_irqs(&nic.dir).iter().any(|(_, mode)| mode == "msi");
        if e1000e_int_mode(ctx) == Some(1) && !msi {
            problems.push(format!(
                "{}: no MSI vector once up: e1000e's MSI test interrupt never arrived and it fell back to INTx \
                 (QEMU's e1000e model never raises it; on hardware, suspect the MSI path)",
                nic.netdev
            ));
        }
        let irqs = nic.irqs();
        let list = irqs.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        match (&before, &after) {
            (Some(before), Some(after)) => {
                let (x, y) = (pcidev::sum_counts(before, &irqs), pcidev::sum_counts(after, &irqs));
                notes.push(format!("{} interrupts on IRQ {list}: {x} -> {y} (+{})", nic.netdev, y.saturating_sub(x)));
            }
            _ => notes.push(format!("{}: /proc/interrupts unreadable", nic.netdev)),
        }
    }
    check(NAME, notes, &problems)
}

/// edu as found and mapped.
struct Edu {
    bdf: String,
    dir: PathBuf,
    bar: MappedBar,
}

/// The identity register and the liveness check (edu returns the complement of what was
/// written); the diagnostic either way.
fn identity_regs<M: Mmio>(regs: &mut M, probe: u32) -> Result<String, String> {
    let id = regs.read32(EDU_IDENTITY);
    regs.write32(EDU_LIVENESS, probe);
    let back = regs.read32(EDU_LIVENESS);
    let line = format!("identity {id:#010x}, liveness wrote {probe:#010x} read {back:#010x}");
    match (id == EDU_ID, back == !probe) {
        (true, true) => Ok(line),
        (false, _) if id == u32::MAX => Err(format!("{line}: BAR0 reads all-ones (memory decode off?)")),
        (false, _) => Err(format!("{line}: identity should be {EDU_ID:#010x}")),
        (true, false) => Err(format!("{line}: liveness should read {:#010x}", !probe)),
    }
}

fn edu_identity(ctx: &Context, token: u64) -> (Check, Option<Edu>) {
    const NAME: &str = "edu_identity";
    let Some(bdf) = pcidev::find(&ctx.root, EDU.0, EDU.1).into_iter().next() else {
        return (fail(NAME, Vec::new(), "not found: no edu function (1234:11e8) in sysfs".into()), None);
    };
    let dir = pcidev::function_dir(&ctx.root, &bdf);
    let mut notes = Vec::new();
    match pcidev::enable(&dir) {
        Ok(before) => notes
            .push(format!("{bdf}: driver {}, enable was {before}", pcidev::driver(&dir).as_deref().unwrap_or("none"))),
        Err(e) => return (fail(NAME, notes, format!("cannot enable {bdf}: {e}")), None),
    }
    match pcidev::resource(&dir, 0) {
        Ok(r) => notes.push(format!("BAR0 at {:#x}, {} KiB", r.start, r.size() >> 10)),
        Err(e) => notes.push(e),
    }
    let mut bar = match MappedBar::open(&dir.join("resource0")) {
        Ok(bar) => bar,
        Err(e) => return (fail(NAME, notes, format!("cannot map BAR0: {e}")), None),
    };
    if bar.len() < EDU_REGS_LEN {
        let reason = format!("BAR0 maps {} bytes, the registers need {EDU_REGS_LEN:#x}", bar.len());
        return (fail(NAME, notes, reason), None);
    }
    match identity_regs(&mut bar, token as u32) {
        Ok(line) => {
            notes.push(line);
            (check(NAME, notes, &[]), Some(Edu { bdf, dir, bar }))
        }
        Err(reason) => (fail(NAME, notes, reason), None),
    }
}

/// Direction of an edu DMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    /// RAM (or a peer's BAR) -> edu's buffer.
    ToDevice,
    /// edu's buffer -> RAM (or a peer's BAR).
    FromDevice,
}

/// One edu DMA: source, destination and count (each read back), start, then poll the
/// command register until the engine is idle. Returns how long it took.
fn edu_dma_once<M: Mmio>(
    regs: &mut M,
    src: u64,
    dst: u64,
    count: u64,
    direction: Direction,
    timeout: Duration,
) -> Result<Duration, String> {
    let cmd = regs.read64(EDU_DMA_CMD);
    if cmd == u64::MAX {
        return Err("the DMA command register reads all-ones (memory decode off, or the device is gone)".into());
    }
    if cmd & CMD_START != 0 {
        return Err(format!("the DMA engine is busy before starting (command {cmd:#x})"));
    }
    for (reg, value, what) in
        [(EDU_DMA_SRC, src, "source"), (EDU_DMA_DST, dst, "destination"), (EDU_DMA_COUNT, count, "count")]
    {
        regs.write64(reg, value);
        let back = regs.read64(reg);
        if back != value {
            return Err(format!("the DMA {what} register ({reg:#x}) reads {back:#x} after writing {value:#x}"));
        }
    }
    let start = CMD_START | if direction == Direction::FromDevice { CMD_FROM_DEVICE } else { 0 };
    regs.write64(EDU_DMA_CMD, start);
    let started = Instant::now();
    loop {
        let cmd = regs.read64(EDU_DMA_CMD);
        if cmd & CMD_START == 0 {
            return Ok(started.elapsed());
        }
        if started.elapsed() >= timeout {
            return Err(format!("DMA still busy after {} ms (command {cmd:#x})", timeout.as_millis()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// RAM page `a` -> edu buffer -> RAM page `b`.
fn ram_round_trip<M: Mmio>(regs: &mut M, a: u64, b: u64, timeout: Duration) -> Result<[Duration; 2], String> {
    let len = EDU_BUFFER_LEN as u64;
    let there = edu_dma_once(regs, a, EDU_BUFFER, len, Direction::ToDevice, timeout)
        .map_err(|e| format!("A -> edu buffer: {e}"))?;
    let back = edu_dma_once(regs, EDU_BUFFER, b, len, Direction::FromDevice, timeout)
        .map_err(|e| format!("edu buffer -> B: {e}"))?;
    Ok([there, back])
}

/// Peer-to-peer: the BAR at `bar` -> edu buffer, then (to see what arrived there) edu buffer
/// -> RAM page `inspect`, then edu buffer -> `bar` + [`P2P_OFFSET`].
fn p2p_sequence<M: Mmio>(regs: &mut M, bar: u64, inspect: Option<u64>, timeout: Duration) -> Result<(), String> {
    let len = EDU_BUFFER_LEN as u64;
    edu_dma_once(regs, bar, EDU_BUFFER, len, Direction::ToDevice, timeout)
        .map_err(|e| format!("BAR2 -> edu buffer: {e}"))?;
    if let Some(page) = inspect {
        edu_dma_once(regs, EDU_BUFFER, page, len, Direction::FromDevice, timeout)
            .map_err(|e| format!("edu buffer -> RAM (inspection): {e}"))?;
    }
    edu_dma_once(regs, EDU_BUFFER, bar + P2P_OFFSET, len, Direction::FromDevice, timeout)
        .map_err(|e| format!("edu buffer -> BAR2 + {P2P_OFFSET:#x}: {e}"))?;
    Ok(())
}

/// `len` pseudo-random bytes from `seed` (xorshift64).
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().take(16).map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

/// Whether `got` is `expected`; if not, what differs, and whether it is still `fill` (what
/// was there before the DMA).
fn compare(expected: &[u8], got: &[u8], fill: &[u8]) -> Result<(), String> {
    if got == expected {
        return Ok(());
    }
    let differ = expected.iter().zip(got).filter(|(e, g)| e != g).count() + expected.len().abs_diff(got.len());
    let first = expected.iter().zip(got).position(|(e, g)| e != g).unwrap_or(expected.len().min(got.len()));
    let why = if got == fill {
        ": it still holds what was there before (the DMA did not land)"
    } else if got.iter().all(|&b| b == 0xff) {
        ": it reads all-ones"
    } else {
        ""
    };
    Err(format!(
        "{differ} of {} bytes differ, first at {first:#x}{why}; got {} ..., expected {} ...",
        expected.len(),
        hex(got),
        hex(expected)
    ))
}

/// Turns on memory decode and bus mastering of edu; a diagnostic line.
fn bus_master(edu: &Edu) -> Result<String, String> {
    let (before, after) = pcidev::set_command_bits(&edu.dir, COMMAND_MEMORY | COMMAND_BUS_MASTER)?;
    let line = format!("{} Command {before:#06x} -> {after:#06x}", edu.bdf);
    if after & COMMAND_BUS_MASTER == 0 {
        return Err(format!("{line}: bus master did not stick"));
    }
    Ok(line)
}

fn edu_dma(edu: Option<&mut Edu>, token: u64) -> Check {
    const NAME: &str = "edu_dma";
    let Some(edu) = edu else {
        return fail(NAME, Vec::new(), "not found: no usable edu (see edu_identity)".into());
    };
    let mut notes = Vec::new();
    match bus_master(edu) {
        Ok(line) => notes.push(line),
        Err(e) => return fail(NAME, notes, e),
    }
    let pages = PinnedPage::new().and_then(|a| Ok((a, PinnedPage::new()?)));
    let (mut a, mut b) = match pages {
        Ok(pages) => pages,
        Err(e) => return fail(NAME, notes, format!("cannot get locked pages: {e}")),
    };
    let (pa, pb) = match (a.phys(), b.phys()) {
        (Ok(pa), Ok(pb)) => (pa, pb),
        (Err(e), _) | (_, Err(e)) => return fail(NAME, notes, format!("no physical address: {e}")),
    };
    notes.push(format!("buffer A at {pa:#x} (virtual {:#x}), B at {pb:#x} (virtual {:#x})", a.vaddr(), b.vaddr()));
    let data = pattern(token, PAGE_SIZE);
    let fill: Vec<u8> = data.iter().map(|b| !b).collect();
    a.write(&data);
    b.write(&fill);
    match ram_round_trip(&mut edu.bar, pa, pb, DMA_TIMEOUT) {
        Ok([there, back]) => notes.push(format!(
            "A -> edu buffer {} ms, edu buffer -> B {} ms ({EDU_BUFFER_LEN} bytes each)",
            there.as_millis(),
            back.as_millis()
        )),
        Err(e) => return fail(NAME, notes, e),
    }
    let got = b.read();
    notes.push(format!("B now starts {}", hex(&got)));
    let mut problems = Vec::new();
    // Only the transferred bytes; the rest of B keeps its fill.
    if let Err(e) = compare(&data[..EDU_BUFFER_LEN], &got[..EDU_BUFFER_LEN], &fill[..EDU_BUFFER_LEN]) {
        problems.push(format!("B is not A: {e}"));
    }
    if a.phys() != Ok(pa) || b.phys() != Ok(pb) {
        problems.push("a locked buffer moved during the test (its physical address changed)".into());
    }
    check(NAME, notes, &problems)
}

fn p2p_into_bar(ctx: &Context, edu: Option<&mut Edu>, token: u64) -> Check {
    const NAME: &str = "p2p_into_bar";
    let Some(edu) = edu else {
        return fail(NAME, Vec::new(), "not found: no usable edu (see edu_identity)".into());
    };
    let Some(bdf) = pcidev::find(&ctx.root, IVSHMEM.0, IVSHMEM.1).into_iter().next() else {
        return fail(NAME, Vec::new(), "not found: no ivshmem function (1af4:1110) in sysfs".into());
    };
    let dir = pcidev::function_dir(&ctx.root, &bdf);
    let mut notes = Vec::new();
    match pcidev::enable(&dir) {
        Ok(before) => notes.push(format!("{bdf}: enable was {before}")),
        Err(e) => return fail(NAME, notes, format!("cannot enable {bdf}: {e}")),
    }
    let res = match pcidev::resource(&dir, 2) {
        Ok(r) if r.is_mem() && r.size() >= P2P_OFFSET + EDU_BUFFER_LEN as u64 => r,
        Ok(r) => return fail(NAME, notes, format!("BAR2 is not a usable memory BAR: {r:x?}")),
        Err(e) => return fail(NAME, notes, e),
    };
    let gpa = res.start;
    notes.push(format!("BAR2 at guest-physical {gpa:#x}, {} MiB", res.size() >> 20));
    let mut bar2 = match MappedBar::open(&dir.join("resource2")) {
        Ok(bar) => bar,
        Err(e) => return fail(NAME, notes, format!("cannot map BAR2: {e}")),
    };
    match bus_master(edu) {
        Ok(line) => notes.push(line),
        Err(e) => return fail(NAME, notes, e),
    }
    let data = pattern(token.rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15, EDU_BUFFER_LEN);
    let fill = vec![0u8; EDU_BUFFER_LEN];
    let at = P2P_OFFSET as usize;
    bar2.write_bytes(0, &data);
    bar2.write_bytes(at, &fill);
    if let Err(e) = compare(&data, &bar2.read_bytes(0, EDU_BUFFER_LEN), &fill) {
        return fail(NAME, notes, format!("BAR2 does not keep what the CPU wrote: {e}"));
    }
    notes.push(format!("pattern written at BAR2 + 0 through the mapping: {} ...", hex(&data)));
    let inspect = PinnedPage::new().and_then(|p| Ok((p.phys()?, p)));
    if let Err(e) = &inspect {
        notes.push(format!("no RAM page to see what reached edu's buffer: {e}"));
    }
    let result = p2p_sequence(&mut edu.bar, gpa, inspect.as_ref().ok().map(|(phys, _)| *phys), DMA_TIMEOUT);
    if let Ok((_, page)) = &inspect {
        if result.is_ok() {
            match compare(&data, &page.read()[..EDU_BUFFER_LEN], &[]) {
                Ok(()) => notes.push("edu's buffer after BAR2 -> edu holds the pattern".into()),
                Err(e) => notes.push(format!("edu's buffer after BAR2 -> edu is not the pattern: {e}")),
            }
        }
    }
    if let Err(e) = result {
        return fail(NAME, notes, e);
    }
    let got = bar2.read_bytes(at, EDU_BUFFER_LEN);
    notes.push(format!("BAR2 + {at:#x} now starts {}", hex(&got)));
    match compare(&data, &got, &fill) {
        Ok(()) => check(NAME, notes, &[]),
        Err(e) => fail(NAME, notes, format!("BAR2 + {at:#x} is not the pattern: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    /// edu as QEMU models it: registers, a 4 KiB buffer at 0x40000, and a DMA engine that
    /// finishes after a few polls, over a fake physical address space of regions.
    #[derive(Default)]
    struct FakeEdu {
        liveness: u32,
        src: u64,
        dst: u64,
        count: u64,
        cmd: u64,
        busy_polls: u32,
        buffer: Vec<u8>,
        memory: BTreeMap<u64, Vec<u8>>,
        /// Every DMA started: (src, dst, count, cmd).
        started: Vec<(u64, u64, u64, u64)>,
        /// The engine never finishes.
        stuck: bool,
        /// 64-bit writes lose their upper half (a VMM splitting them wrongly).
        truncate_writes: bool,
        /// Every read is all-ones.
        gone: bool,
    }

    impl FakeEdu {
        fn new(memory: &[(u64, Vec<u8>)]) -> Self {
            FakeEdu { buffer: vec![0; EDU_BUFFER_LEN], memory: memory.iter().cloned().collect(), ..Default::default() }
        }

        fn region(&mut self, addr: u64, len: usize) -> &mut [u8] {
            let (base, region) = self.memory.range_mut(..=addr).next_back().expect("DMA to unmapped memory");
            let at = (addr - base) as usize;
            &mut region[at..at + len]
        }

        fn finish(&mut self) {
            let len = self.count as usize;
            if self.cmd & CMD_FROM_DEVICE == 0 {
                let at = (self.dst - EDU_BUFFER) as usize;
                let data = self.region(self.src, len).to_vec();
                self.buffer[at..at + len].copy_from_slice(&data);
            } else {
                let at = (self.src - EDU_BUFFER) as usize;
                let data = self.buffer[at..at + len].to_vec();
                let dst = self.dst;
                self.region(dst, len).copy_from_slice(&data);
            }
            self.cmd &= !CMD_START;
        }
    }

    impl Mmio for FakeEdu {
        fn read32(&mut self, offset: usize) -> u32 {
            match offset {
                _ if self.gone => u32::MAX,
                EDU_IDENTITY => EDU_ID,
                EDU_LIVENESS => !self.liveness,
                _ => self.read64(offset) as u32,
            }
        }

        fn write32(&mut self, offset: usize, value: u32) {
            match offset {
                EDU_LIVENESS => self.liveness = value,
                _ => self.write64(offset, u64::from(value)),
            }
        }

        fn read64(&mut self, offset: usize) -> u64 {
            if self.gone {
                return u64::MAX;
            }
            match offset {
                EDU_DMA_SRC => self.src,
                EDU_DMA_DST => self.dst,
                EDU_DMA_COUNT => self.count,
                EDU_DMA_CMD => {
                    if self.cmd & CMD_START != 0 && !self.stuck {
                        self.busy_polls = self.busy_polls.saturating_sub(1);
                        if self.busy_polls == 0 {
                            self.finish();
                        }
                    }
                    self.cmd
                }
                _ => 0,
            }
        }

        fn write64(&mut self, offset: usize, value: u64) {
            let value = if self.truncate_writes { value & 0xffff_ffff } else { value };
            match offset {
                EDU_DMA_SRC => self.src = value,
                EDU_DMA_DST => self.dst = value,
                EDU_DMA_COUNT => self.count = value,
                EDU_DMA_CMD => {
                    self.cmd = value;
                    if value & CMD_START != 0 {
                        self.started.push((self.src, self.dst, self.count, value));
                        self.busy_polls = 3;
                    }
                }
                _ => {}
            }
        }
    }

    const A: u64 = 0x1234_5000;
    const B: u64 = 0x2345_6000;
    const BAR2: u64 = 0x38_0000_0000;
    const T: Duration = Duration::from_secs(1);

    #[test]
    fn test_identity_and_liveness() {
        let mut edu = FakeEdu::new(&[]);
        let line = identity_regs(&mut edu, 0x1234_5678).unwrap();
        assert_eq!(line, "identity 0x010000ed, liveness wrote 0x12345678 read 0xedcba987");
        edu.gone = true;
        assert!(identity_regs(&mut edu, 1).unwrap_err().contains("all-ones"));
    }

    #[test]
    fn test_ram_round_trip_register_sequence() {
        let data = pattern(7, PAGE_SIZE);
        let mut edu = FakeEdu::new(&[(A, data.clone()), (B, vec![0; PAGE_SIZE])]);
        ram_round_trip(&mut edu, A, B, T).unwrap();
        let n = EDU_BUFFER_LEN as u64;
        assert_eq!(edu.started, [(A, EDU_BUFFER, n, 1), (EDU_BUFFER, B, n, 3)]);
        assert_eq!(edu.memory[&B][..EDU_BUFFER_LEN], data[..EDU_BUFFER_LEN]);
        assert_eq!(edu.buffer[..EDU_BUFFER_LEN], data[..EDU_BUFFER_LEN]);
    }

    #[test]
    fn test_p2p_register_sequence() {
        let data = pattern(9, EDU_BUFFER_LEN);
        let mut bar = data.clone();
        bar.resize(0x2000, 0);
        let mut edu = FakeEdu::new(&[(BAR2, bar), (A, vec![0; PAGE_SIZE])]);
        p2p_sequence(&mut edu, BAR2, Some(A), T).unwrap();
        let n = EDU_BUFFER_LEN as u64;
        assert_eq!(edu.started, [(BAR2, EDU_BUFFER, n, 1), (EDU_BUFFER, A, n, 3), (EDU_BUFFER, BAR2 + 0x1000, n, 3)]);
        assert!(edu.memory[&BAR2][0x1000..0x1000 + EDU_BUFFER_LEN] == data[..], "the pattern arrived at BAR2 + 0x1000");
        assert!(edu.memory[&A][..EDU_BUFFER_LEN] == data[..], "and in the RAM page");
        let mut edu = FakeEdu::new(&[(BAR2, vec![0; 0x2000])]);
        p2p_sequence(&mut edu, BAR2, None, T).unwrap();
        assert_eq!(edu.started.len(), 2);
    }

    #[test]
    fn test_dma_failures_are_named() {
        let mut edu = FakeEdu::new(&[(A, vec![0; PAGE_SIZE])]);
        edu.stuck = true;
        let e = ram_round_trip(&mut edu, A, B, Duration::from_millis(20)).unwrap_err();
        assert!(e.starts_with("A -> edu buffer: DMA still busy after 20 ms (command 0x1)"), "{e}");
        assert!(edu_dma_once(&mut edu, A, EDU_BUFFER, 4096, Direction::ToDevice, T)
            .unwrap_err()
            .contains("busy before"));

        let mut edu = FakeEdu::new(&[]);
        edu.truncate_writes = true;
        let e = p2p_sequence(&mut edu, BAR2, None, T).unwrap_err();
        assert_eq!(e, "BAR2 -> edu buffer: the DMA source register (0x80) reads 0x0 after writing 0x3800000000");
        assert!(edu.started.is_empty());

        let mut edu = FakeEdu::new(&[]);
        edu.gone = true;
        assert!(ram_round_trip(&mut edu, A, B, T).unwrap_err().contains("all-ones"));
    }

    #[test]
    fn test_compare_names_what_arrived() {
        let data = pattern(1, 64);
        let fill = vec![0u8; 64];
        assert_eq!(compare(&data, &data, &fill), Ok(()));
        let e = compare(&data, &fill, &fill).unwrap_err();
        assert!(e.contains("first at 0x0: it still holds what was there before (the DMA did not land)"), "{e}");
        assert!(compare(&data, &[0xff; 64], &fill).unwrap_err().contains("all-ones"));
        let mut one_off = data.clone();
        one_off[9] ^= 1;
        let e = compare(&data, &one_off, &fill).unwrap_err();
        assert!(e.starts_with("1 of 64 bytes differ, first at 0x9; got "), "{e}");
        assert!(compare(&data, &data[..60], &fill).unwrap_err().starts_with("4 of 64 bytes differ, first at 0x3c"));
    }

    #[test]
    fn test_pattern() {
        let p = pattern(0, 4096);
        assert_eq!(p, pattern(0, 4096));
        assert_ne!(p, pattern(2, 4096));
        // Not constant, and every byte value shows up: a stuck or shifted copy cannot match.
        assert_eq!(p.iter().collect::<BTreeSet<_>>().len(), 256);
    }

    fn ctx(root: &Path) -> Context {
        Context {
            expect: None,
            image: None,
            root: root.to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        }
    }

    #[test]
    fn test_missing_devices_fail_as_not_found() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("sys/bus/pci/devices")).unwrap();
        let checks = run(&ctx(root.path()));
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["e1000e_bound", "e1000e_frames", "edu_identity", "edu_dma", "p2p_into_bar"]);
        for c in &checks {
            assert!(matches!(&c.verdict, Verdict::Fail(m) if m.starts_with("not found")), "{c:?}");
        }
    }

    #[test]
    fn test_netdev_and_link_state_from_sysfs() {
        let root = tempfile::tempdir().unwrap();
        let dir = pcidev::function_dir(root.path(), "0000:01:00.0");
        std::fs::create_dir_all(dir.join("net/eth1")).unwrap();
        std::fs::create_dir_all(dir.join("net/eth0")).unwrap();
        assert_eq!(netdev_of(&dir).as_deref(), Some("eth0"));
        let class = root.path().join("sys/class/net/eth0");
        std::fs::create_dir_all(&class).unwrap();
        std::fs::write(class.join("carrier"), "1\n").unwrap();
        std::fs::write(class.join("operstate"), "up\n").unwrap();
        let c = ctx(root.path());
        assert_eq!(link_state(&c.root, "eth0"), ("1".into(), "up".into()));
        assert_eq!(link_state(&c.root, "eth9"), ("?".into(), "?".into()));
    }

    #[test]
    fn test_e1000e_interrupt_mode_from_the_command_line() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("proc")).unwrap();
        let mode = |cmdline: &str| {
            std::fs::write(dir.path().join("proc/cmdline"), cmdline).unwrap();
            e1000e_int_mode(&ctx(dir.path()))
        };
        assert_eq!(mode("quiet e1000e.IntMode=1,1 gdrvm.suites=vfio\n"), Some(1));
        assert_eq!(mode("e1000e.IntMode=0"), Some(0));
        assert_eq!(mode("quiet e1000e.debug=3"), None);
        assert_eq!(mode("e1000e.IntMode=x"), None);
    }
}
