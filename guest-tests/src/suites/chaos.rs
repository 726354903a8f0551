//! `chaos`: the VMM survives a guest that scribbles over its PCI devices. For a bounded
//! time (`gdrvm.chaos_secs=N` on the kernel command line, [`DEFAULT_SECS`] otherwise) a
//! seeded generator makes random writes to every function's configuration space (sysfs
//! `config`: offset, size 1/2/4 and value at random) and random 32-bit writes and reads to
//! every memory BAR of every endpoint (sysfs `resourceN` mappings), with the vendor ID of
//! every function read in between. Afterwards every function must still answer with the
//! vendor ID it had (`vmm_answers`), and the agent says that it got to the end
//! (`guest_alive`): a VMM that crashes or hangs leaves no verdict at all.
//!
//! The seed is printed on the console before the chaos starts (and again in the report), so
//! a run that kills the guest can be replayed: `gdrvm.chaos_seed=SEED` and, to stop at the
//! same operation, `gdrvm.chaos_ops=N`. The same seed on the same node makes the same
//! operations in the same order.
//!
//! Never in `all`: it leaves the machine's PCI state wrecked on purpose, and it refuses to
//! run outside a gdrvm guest (no expectations file), so a host never gets it. What it leaves
//! alone, so that the guest lives to give its verdict:
//! - the bus-number registers of bridges (0x18-0x1b): other bus numbers route configuration
//!   cycles elsewhere, and the functions behind the bridge vanish by the guest's own doing;
//! - the bus-master bit of endpoints (cleared first, masked out of every write): a device
//!   given random register values and allowed to DMA writes random guest RAM, and sends
//!   MSIs with random vectors, which kills the guest, not the VMM. Endpoints' drivers are
//!   unbound first, so that none turns it back on or trips over its device's garbage.
//!   Bridges' command bits are fair game;
//! - the registers in [`BAR_SKIPS`]: device models that abort their whole emulator on
//!   some writes, which would test that emulator, not gdrvm.
//!
//! A write the kernel refuses (EIO, EPERM, a short write) counts as refused, not as a
//! failure; a BAR that reads all-ones is fine (decode may well be off by then).

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::pcidev::{self, MappedBar, Mmio, SYSFS_PCI};
use crate::sys;

/// How long the chaos lasts unless the command line says otherwise.
pub const DEFAULT_SECS: u64 = 20;
/// The most the command line may ask for.
const MAX_SECS: u64 = 3600;
/// Command-line keys.
const KEY_SECS: &str = "gdrvm.chaos_secs=";
const KEY_SEED: &str = "gdrvm.chaos_seed=";
const KEY_OPS: &str = "gdrvm.chaos_ops=";
/// Operations between two reads of every function's vendor ID.
const SWEEP_EVERY: u64 = 64;
/// How often a progress line goes to the console.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);
/// How long one operation may take before the watchdog names it on the console.
const STALL: Duration = Duration::from_secs(10);
/// How often the watchdog looks.
const WATCHDOG_POLL: Duration = Duration::from_millis(200);
/// Draws before giving up on finding an offset outside the skipped registers.
const PICK_TRIES: u32 = 64;
/// Largest configuration space (PCIe).
const CONFIG_MAX: u64 = 4096;
/// The conventional (PCI) configuration space: header and capabilities. Half of the writes
/// land here, where a VMM's state lives (command, BARs, MSI, MSI-X); the other half
/// anywhere in the space.
const CONFIG_HEADER: u64 = 256;
/// Half of the BAR accesses land in the first page, where devices keep their registers.
const BAR_HEAD: usize = 4096;
/// A bridge's primary, secondary and subordinate bus numbers and secondary latency timer
/// (the same offsets in a CardBus bridge's header).
pub const BRIDGE_BUS_NUMBERS: Range<u64> = 0x18..0x1c;
/// The Command register, and its bus-master bit (in the register's low byte).
const COMMAND: u64 = 0x04;
const BUS_MASTER: u8 = pcidev::COMMAND_BUS_MASTER as u8;
/// Header type register (bit 7 is multi-function).
const HEADER_TYPE: usize = 0x0e;

/// Registers of a device model that the chaos must not write.
#[derive(Debug)]
pub struct BarSkip {
    /// Vendor and device ID.
    pub id: (u16, u16),
    /// BAR index.
    pub bar: usize,
    /// Byte offsets in the BAR.
    pub range: Range<usize>,
    /// Why.
    pub why: &'static str,
}

/// Registers never written, with the reason.
pub const BAR_SKIPS: &[BarSkip] = &[BarSkip {
    id: (0x1234, 0x11e8),
    bar: 0,
    range: 0x98..0xa0,
    why: "QEMU's edu checks a started DMA's range with hw_error(), which aborts the whole emulator \
          (L1 of the VFIO lab) instead of refusing the transfer",
}];

/// The byte ranges of BAR `bar` of a function with `id` that the chaos leaves alone.
pub fn bar_skips(id: (u16, u16), bar: usize) -> Vec<Range<usize>> {
    BAR_SKIPS.iter().filter(|s| s.id == id && s.bar == bar).map(|s| s.range.clone()).collect()
}

/// SplitMix64 (Steele, Lea and Flood): a small generator whose whole state is the seed, so
/// a run replays from the seed alone.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator starting at `seed` (any value, zero included).
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (0 when `n` is 0), by multiply and shift.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// An index into a collection of `len` items.
    fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }
}

/// What the kernel command line asks of the chaos.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// How long the chaos lasts.
    pub duration: Duration,
    /// The seed to replay; a fresh one when not given.
    pub seed: Option<u64>,
    /// Stop after this many operations (to replay up to the one that hurt).
    pub max_ops: Option<u64>,
    /// Values that were ignored, and why.
    pub problems: Vec<String>,
}

/// A decimal or `0x` hexadecimal number.
fn parse_u64(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

impl Options {
    /// Reads `gdrvm.chaos_secs=`, `gdrvm.chaos_seed=` and `gdrvm.chaos_ops=` from a
    /// kernel command line.
    pub fn from_cmdline(cmdline: &str) -> Self {
        let mut o =
            Options { duration: Duration::from_secs(DEFAULT_SECS), seed: None, max_ops: None, problems: Vec::new() };
        for word in cmdline.split_whitespace() {
            if let Some(v) = word.strip_prefix(KEY_SECS) {
                match parse_u64(v) {
                    Some(s) if s <= MAX_SECS => o.duration = Duration::from_secs(s),
                    Some(_) => {
                        o.duration = Duration::from_secs(MAX_SECS);
                        o.problems.push(format!("{word}: more than {MAX_SECS} s, running {MAX_SECS} s"));
                    }
                    None => o.problems.push(format!("{word} ignored: not a number of seconds")),
                }
            } else if let Some(v) = word.strip_prefix(KEY_SEED) {
                match parse_u64(v) {
                    Some(seed) => o.seed = Some(seed),
                    None => o.problems.push(format!("{word} ignored: not a number")),
                }
            } else if let Some(v) = word.strip_prefix(KEY_OPS) {
                match parse_u64(v) {
                    Some(n) => o.max_ops = Some(n),
                    None => o.problems.push(format!("{word} ignored: not a number")),
                }
            }
        }
        o
    }
}

/// One configuration write: `size` bytes (1, 2 or 4) of `bytes` at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConfigWrite {
    /// Offset in configuration space, a multiple of `size`.
    pub offset: u64,
    /// Bytes written.
    pub size: usize,
    /// The value, little-endian; only the first `size` bytes are written.
    pub bytes: [u8; 4],
}

impl ConfigWrite {
    /// The bytes written.
    pub fn data(&self) -> &[u8] {
        &self.bytes[..self.size]
    }
}

fn overlaps(offset: u64, size: u64, range: &Range<u64>) -> bool {
    offset < range.end && range.start < offset.saturating_add(size)
}

/// Whether a write of `size` bytes at `offset` may go to a function (a bridge when
/// `bridge`): anywhere but a bridge's bus numbers.
pub fn config_write_allowed(offset: u64, size: u64, bridge: bool) -> bool {
    !(bridge && overlaps(offset, size, &BRIDGE_BUS_NUMBERS))
}

/// A random configuration write into a space of `len` bytes (at most 4 KiB used), naturally
/// aligned, outside what [`config_write_allowed`] forbids; on an endpoint, never setting
/// bus master. `None` when nothing fits.
pub fn pick_config_write(rng: &mut Rng, len: u64, bridge: bool) -> Option<ConfigWrite> {
    let len = len.min(CONFIG_MAX);
    for _ in 0..PICK_TRIES {
        let size = [1u64, 2, 4][rng.index(3)];
        let span = if rng.below(2) == 0 { len.min(CONFIG_HEADER) } else { len };
        let value = rng.next_u64();
        if span < size {
            continue;
        }
        let offset = rng.below(span / size) * size;
        if !config_write_allowed(offset, size, bridge) {
            continue;
        }
        let mut bytes = (value as u32).to_le_bytes();
        if !bridge && overlaps(offset, size, &(COMMAND..COMMAND + 1)) {
            bytes[(COMMAND - offset) as usize] &= !BUS_MASTER;
        }
        return Some(ConfigWrite { offset, size: size as usize, bytes });
    }
    None
}

/// A random 4-byte-aligned offset of a 32-bit access in a BAR of `len` bytes, clear of
/// `skips`. `None` when nothing fits.
pub fn pick_bar_offset(rng: &mut Rng, len: usize, skips: &[Range<usize>]) -> Option<usize> {
    if len < 4 {
        return None;
    }
    for _ in 0..PICK_TRIES {
        let span = if rng.below(2) == 0 { len.min(BAR_HEAD) } else { len };
        let offset = rng.index(span / 4) * 4;
        if !skips.iter().any(|r| offset < r.end && r.start < offset + 4) {
            return Some(offset);
        }
    }
    None
}

/// A function's configuration space as the chaos reaches it: sysfs `config`, or a fake.
pub trait ConfigAccess {
    /// Reads at `offset`; the bytes read.
    fn read_config(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes at `offset`; the bytes written.
    fn write_config(&mut self, offset: u64, data: &[u8]) -> io::Result<usize>;
}

impl ConfigAccess for File {
    fn read_config(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.read_at(buf, offset)
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) -> io::Result<usize> {
        self.write_at(data, offset)
    }
}

/// What happened to one function.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// Configuration writes made, refused ones included.
    pub config_writes: u64,
    /// Configuration writes the kernel refused or cut short.
    pub config_refused: u64,
    /// The first refusal: offset, size and error.
    pub first_refusal: Option<String>,
    /// Vendor-ID reads during the chaos.
    pub vendor_reads: u64,
    /// Of those, the ones that did not give the vendor ID.
    pub vendor_wrong: u64,
    /// The first wrong one: when, and what it gave.
    pub first_wrong: Option<(Duration, String)>,
}

/// A memory BAR of an endpoint, mapped.
pub struct ChaosBar {
    /// BAR index.
    pub index: usize,
    /// Mapped length in bytes.
    pub len: usize,
    mmio: Box<dyn Mmio>,
    skips: Vec<Range<usize>>,
    /// 32-bit writes made.
    pub writes: u64,
    /// 32-bit reads made.
    pub reads: u64,
    /// Reads that gave all-ones.
    pub all_ones: u64,
}

impl ChaosBar {
    /// BAR `index` of `len` bytes reached through `mmio`, leaving `skips` alone.
    pub fn new(index: usize, len: usize, mmio: Box<dyn Mmio>, skips: Vec<Range<usize>>) -> Self {
        ChaosBar { index, len, mmio, skips, writes: 0, reads: 0, all_ones: 0 }
    }
}

/// A PCI function under chaos.
pub struct Function {
    /// Its address.
    pub bdf: String,
    /// Vendor and device ID as read before the chaos.
    pub id: (u16, u16),
    /// A type-1 (or CardBus) header.
    pub bridge: bool,
    config: Box<dyn ConfigAccess>,
    config_len: u64,
    /// Its mapped memory BARs (endpoints only).
    pub bars: Vec<ChaosBar>,
    /// Counts.
    pub tally: Tally,
    /// The vendor ID read after the chaos.
    pub after: Option<Result<u16, String>>,
}

impl Function {
    /// A function at `bdf` with `id`, its configuration space of `config_len` bytes behind
    /// `config`.
    pub fn new(bdf: &str, id: (u16, u16), bridge: bool, config: Box<dyn ConfigAccess>, config_len: u64) -> Self {
        Function {
            bdf: bdf.to_owned(),
            id,
            bridge,
            config,
            config_len,
            bars: Vec::new(),
            tally: Tally::default(),
            after: None,
        }
    }

    /// Reads the vendor ID, or says what came instead.
    fn vendor(&mut self) -> Result<u16, String> {
        let mut b = [0u8; 2];
        match self.config.read_config(0, &mut b) {
            Ok(2) => Ok(u16::from_le_bytes(b)),
            Ok(n) => Err(format!("a read of {n} of 2 bytes")),
            Err(e) => Err(format!("read error: {e}")),
        }
    }

    /// Reads the vendor ID during the chaos and tallies it.
    fn check_vendor(&mut self, at: Duration) {
        self.tally.vendor_reads += 1;
        let what = match self.vendor() {
            Ok(v) if v == self.id.0 => return,
            Ok(v) => format!("{v:#06x}"),
            Err(e) => e,
        };
        self.tally.vendor_wrong += 1;
        if self.tally.first_wrong.is_none() {
            self.tally.first_wrong = Some((at, what));
        }
    }

    fn config_write(&mut self, rng: &mut Rng) {
        let Some(w) = pick_config_write(rng, self.config_len, self.bridge) else { return };
        self.tally.config_writes += 1;
        let refusal = match self.config.write_config(w.offset, w.data()) {
            Ok(n) if n == w.size => None,
            Ok(n) => Some(format!("{n} of {} bytes written", w.size)),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = refusal {
            self.tally.config_refused += 1;
            if self.tally.first_refusal.is_none() {
                self.tally.first_refusal = Some(format!("{} bytes at {:#x}: {why}", w.size, w.offset));
            }
        }
    }
}

/// When the chaos stops: whichever comes first.
#[derive(Debug, Clone, Copy)]
pub struct Limit {
    /// Time.
    pub time: Duration,
    /// Operations.
    pub ops: u64,
}

/// What the chaos did, all functions together.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Writes and reads made (vendor-ID reads not counted).
    pub ops: u64,
    /// Vendor-ID sweeps over every function.
    pub sweeps: u64,
    /// How long it ran.
    pub elapsed: Duration,
}

/// The operation under way, for the watchdog: kind, function, BAR or size, offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Idle,
    ConfigWrite { function: usize },
    BarWrite { function: usize, bar: usize, offset: usize },
    BarRead { function: usize, bar: usize, offset: usize },
    VendorRead { function: usize },
}

impl Op {
    fn encode(self) -> u64 {
        let (kind, function, bar, offset) = match self {
            Op::Idle => (0, 0, 0, 0),
            Op::ConfigWrite { function } => (1, function, 0, 0),
            Op::BarWrite { function, bar, offset } => (2, function, bar, offset),
            Op::BarRead { function, bar, offset } => (3, function, bar, offset),
            Op::VendorRead { function } => (4, function, 0, 0),
        };
        (kind << 56) | ((function as u64 & 0xffff) << 40) | ((bar as u64 & 0xff) << 32) | (offset as u64 & 0xffff_ffff)
    }

    fn decode(code: u64) -> Op {
        let function = ((code >> 40) & 0xffff) as usize;
        let bar = ((code >> 32) & 0xff) as usize;
        let offset = (code & 0xffff_ffff) as usize;
        match code >> 56 {
            1 => Op::ConfigWrite { function },
            2 => Op::BarWrite { function, bar, offset },
            3 => Op::BarRead { function, bar, offset },
            4 => Op::VendorRead { function },
            _ => Op::Idle,
        }
    }

    /// In words, naming the function from `bdfs` and the BAR from `bars` (function, BAR
    /// position) → BAR index.
    fn describe(self, bdfs: &[String], bar_index: impl Fn(usize, usize) -> usize) -> String {
        let bdf = |f: usize| bdfs.get(f).map_or("?", String::as_str);
        match self {
            Op::Idle => "between operations".into(),
            Op::ConfigWrite { function } => format!("a configuration write to {}", bdf(function)),
            Op::BarWrite { function, bar, offset } => {
                format!("a write to {} BAR{} + {offset:#x}", bdf(function), bar_index(function, bar))
            }
            Op::BarRead { function, bar, offset } => {
                format!("a read of {} BAR{} + {offset:#x}", bdf(function), bar_index(function, bar))
            }
            Op::VendorRead { function } => format!("a vendor-ID read of {}", bdf(function)),
        }
    }
}

/// What the loop shares with its watchdog.
#[derive(Default)]
struct Progress {
    ops: AtomicU64,
    op: AtomicU64,
    done: AtomicBool,
}

impl Progress {
    fn set(&self, op: Op) {
        self.op.store(op.encode(), Ordering::Relaxed);
    }
}

/// Tells the watchdog to stop when dropped, so that a loop that unwinds does not leave the
/// scope waiting for it forever.
struct StopWatchdog<'a>(&'a Progress);

impl Drop for StopWatchdog<'_> {
    fn drop(&mut self) {
        self.0.done.store(true, Ordering::Relaxed);
    }
}

/// Names the operation on the console when one takes longer than [`STALL`] (a config
/// access stuck in the kernel, or a vCPU that comes back from the VMM very late).
fn watchdog(progress: &Progress, stall: Duration, describe: impl Fn(Op) -> String, say: &(dyn Fn(&str) + Sync)) {
    let mut last = (u64::MAX, Op::Idle.encode());
    let mut since = Instant::now();
    let mut reported = false;
    while !progress.done.load(Ordering::Relaxed) {
        std::thread::sleep(WATCHDOG_POLL);
        let now = (progress.ops.load(Ordering::Relaxed), progress.op.load(Ordering::Relaxed));
        if now != last {
            (last, since, reported) = (now, Instant::now(), false);
        } else if !reported && since.elapsed() >= stall {
            reported = true;
            say(&format!(
                "no progress for {} s, after {} operations: stuck in {}",
                since.elapsed().as_secs(),
                now.0,
                describe(Op::decode(now.1))
            ));
        }
    }
}

/// Reads every function's vendor ID.
fn sweep(functions: &mut [Function], at: Duration, progress: &Progress) {
    for (i, f) in functions.iter_mut().enumerate() {
        progress.set(Op::VendorRead { function: i });
        f.check_vendor(at);
    }
}

/// Runs the chaos over `functions` until `limit`, drawing from `rng`; `say` prints a line
/// on the console (progress, and the watchdog's).
pub fn chaos(functions: &mut [Function], rng: &mut Rng, limit: Limit, say: &(dyn Fn(&str) + Sync)) -> Summary {
    let mut summary = Summary::default();
    if functions.is_empty() {
        return summary;
    }
    let bars: Vec<(usize, usize)> =
        functions.iter().enumerate().flat_map(|(f, func)| (0..func.bars.len()).map(move |b| (f, b))).collect();
    let bdfs: Vec<String> = functions.iter().map(|f| f.bdf.clone()).collect();
    let bar_indices: Vec<Vec<usize>> = functions.iter().map(|f| f.bars.iter().map(|b| b.index).collect()).collect();
    let progress = Progress::default();
    let start = Instant::now();
    let describe =
        |op: Op| op.describe(&bdfs, |f, b| bar_indices.get(f).and_then(|v| v.get(b)).copied().unwrap_or(usize::MAX));
    std::thread::scope(|scope| {
        let progress = &progress;
        scope.spawn(move || watchdog(progress, STALL, describe, say));
        let _stop = StopWatchdog(progress);
        let mut next_progress = PROGRESS_EVERY;
        while summary.ops < limit.ops && start.elapsed() < limit.time {
            if summary.ops % SWEEP_EVERY == 0 {
                sweep(functions, start.elapsed(), progress);
                summary.sweeps += 1;
            }
            // Four in eight are config writes, three BAR writes, one a BAR read.
            let roll = rng.below(8);
            if roll < 4 || bars.is_empty() {
                let function = rng.index(functions.len());
                progress.set(Op::ConfigWrite { function });
                functions[function].config_write(rng);
            } else {
                let (function, bar) = bars[rng.index(bars.len())];
                let b = &mut functions[function].bars[bar];
                if let Some(offset) = pick_bar_offset(rng, b.len, &b.skips) {
                    if roll < 7 {
                        progress.set(Op::BarWrite { function, bar, offset });
                        b.mmio.write32(offset, rng.next_u64() as u32);
                        b.writes += 1;
                    } else {
                        progress.set(Op::BarRead { function, bar, offset });
                        b.reads += 1;
                        if b.mmio.read32(offset) == u32::MAX {
                            b.all_ones += 1;
                        }
                    }
                }
            }
            summary.ops += 1;
            progress.ops.store(summary.ops, Ordering::Relaxed);
            if start.elapsed() >= next_progress {
                next_progress = start.elapsed() + PROGRESS_EVERY;
                say(&format!("{} s, {} operations", start.elapsed().as_secs(), summary.ops));
            }
        }
        summary.elapsed = start.elapsed();
        for (i, f) in functions.iter_mut().enumerate() {
            progress.set(Op::VendorRead { function: i });
            f.after = Some(f.vendor());
        }
    });
    summary
}

/// The two verdicts from what the chaos did.
pub fn verdicts(
    functions: &[Function],
    summary: &Summary,
    seed: u64,
    limit: Limit,
    mut notes: Vec<String>,
    mut problems: Vec<String>,
) -> Vec<Check> {
    let replay = format!("{KEY_SEED}{seed:#x} {KEY_OPS}{}", summary.ops);
    notes.insert(0, format!("seed {seed:#018x} (replay: {replay})"));
    if functions.is_empty() && problems.is_empty() {
        problems.push("not found: no PCI function to run the chaos on".into());
    }
    for f in functions {
        let kind = if f.bridge { "bridge" } else { "endpoint" };
        let t = &f.tally;
        let mut line = format!(
            "{} {:04x}:{:04x} {kind}: {} config writes ({} refused{})",
            f.bdf,
            f.id.0,
            f.id.1,
            t.config_writes,
            t.config_refused,
            t.first_refusal.as_ref().map(|r| format!(", first {r}")).unwrap_or_default()
        );
        for b in &f.bars {
            line += &format!(
                "; BAR{} {} KiB: {} writes, {} reads ({} all-ones)",
                b.index,
                b.len.div_ceil(1024),
                b.writes,
                b.reads,
                b.all_ones
            );
        }
        line += &format!("; {} vendor-ID reads, {} wrong", t.vendor_reads, t.vendor_wrong);
        notes.push(line);
        if let Some((at, what)) = &t.first_wrong {
            problems.push(format!(
                "{}: {} of {} vendor-ID reads during the chaos did not give {:#06x} (first at {:.1} s: {what})",
                f.bdf,
                t.vendor_wrong,
                t.vendor_reads,
                f.id.0,
                at.as_secs_f64()
            ));
        }
        match &f.after {
            Some(Ok(v)) if *v == f.id.0 => {}
            Some(Ok(v)) => {
                problems.push(format!("{}: vendor ID {:#06x} before the chaos, {v:#06x} after", f.bdf, f.id.0))
            }
            Some(Err(e)) => problems.push(format!("{}: vendor ID unreadable after the chaos: {e}", f.bdf)),
            None => problems.push(format!("{}: vendor ID not read after the chaos", f.bdf)),
        }
    }
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    let answers = Check { diagnostics: notes, ..Check::new("vmm_answers", verdict) };

    let config: u64 = functions.iter().map(|f| f.tally.config_writes).sum();
    let refused: u64 = functions.iter().map(|f| f.tally.config_refused).sum();
    let bars = functions.iter().flat_map(|f| &f.bars);
    let (writes, reads, ones) = bars.fold((0, 0, 0), |(w, r, o), b| (w + b.writes, r + b.reads, o + b.all_ones));
    let secs = summary.elapsed.as_secs_f64();
    let limit_ops = if limit.ops == u64::MAX { String::new() } else { format!(", {} operations", limit.ops) };
    let alive = Check::new("guest_alive", Verdict::Pass)
        .note(format!(
            "reached the end after {secs:.1} s of chaos (limit {} s{limit_ops}): {} operations ({:.0}/s) on {} functions",
            limit.time.as_secs(),
            summary.ops,
            if secs > 0.0 { summary.ops as f64 / secs } else { 0.0 },
            functions.len()
        ))
        .note(format!(
            "{config} config writes ({refused} refused), {writes} BAR writes, {reads} BAR reads ({ones} all-ones), {} vendor-ID sweeps",
            summary.sweeps
        ))
        .note(format!("replay: {replay}"));
    vec![answers, alive]
}

/// Unbinds the driver of the function in `dir`, if any; a line saying what happened.
fn unbind(dir: &Path, bdf: &str) -> Option<String> {
    let driver = pcidev::driver(dir)?;
    Some(match std::fs::write(dir.join("driver/unbind"), bdf) {
        Ok(()) => format!("{bdf}: unbound from {driver}"),
        Err(e) => format!("{bdf}: cannot unbind from {driver}: {e}"),
    })
}

/// Clears the bus-master bit; a line when it was set or could not be cleared.
fn clear_bus_master(config: &mut File, bdf: &str) -> Option<String> {
    let mut b = [0u8; 1];
    if let Err(e) = config.read_config(COMMAND, &mut b) {
        return Some(format!("{bdf}: Command unreadable: {e}"));
    }
    if b[0] & BUS_MASTER == 0 {
        return None;
    }
    Some(match config.write_config(COMMAND, &[b[0] & !BUS_MASTER]) {
        Ok(1) => format!("{bdf}: bus master turned off"),
        Ok(_) => format!("{bdf}: bus master is on and the write to turn it off was cut short"),
        Err(e) => format!("{bdf}: bus master is on and cannot be turned off: {e}"),
    })
}

/// Opens function `bdf` for the chaos: its configuration space, and for an endpoint (driver
/// unbound, bus mastering off) its memory BARs, mapped. Lines about what was done go to
/// `notes`.
fn open_function(root: &Path, bdf: &str, notes: &mut Vec<String>) -> Result<Function, String> {
    let dir = pcidev::function_dir(root, bdf);
    let path = dir.join("config");
    let what = |e: io::Error| format!("{}: {e}", path.display());
    let mut config = OpenOptions::new().read(true).write(true).open(&path).map_err(what)?;
    let len = config.metadata().map_err(what)?.len().min(CONFIG_MAX);
    let mut header = [0u8; 16];
    config.read_exact_at(&mut header, 0).map_err(|e| format!("reading the header of {}: {e}", path.display()))?;
    let id = (u16::from_le_bytes([header[0], header[1]]), u16::from_le_bytes([header[2], header[3]]));
    let bridge = matches!(header[HEADER_TYPE] & 0x7f, 1 | 2);
    let mut bars = Vec::new();
    if !bridge {
        notes.extend(unbind(&dir, bdf));
        notes.extend(clear_bus_master(&mut config, bdf));
        let resources = std::fs::read_to_string(dir.join("resource")).unwrap_or_default();
        for (index, line) in resources.lines().take(6).enumerate() {
            let Some(r) = pcidev::parse_resource_line(line).filter(|r| r.is_mem() && r.size() >= 4) else {
                continue;
            };
            match MappedBar::open(&dir.join(format!("resource{index}"))) {
                Ok(bar) => {
                    let len = bar.len();
                    for s in BAR_SKIPS.iter().filter(|s| s.id == id && s.bar == index) {
                        notes.push(format!(
                            "{bdf}: BAR{index} {:#x}-{:#x} left alone: {}",
                            s.range.start,
                            s.range.end - 1,
                            s.why
                        ));
                    }
                    bars.push(ChaosBar::new(index, len, Box::new(bar), bar_skips(id, index)));
                }
                Err(e) => notes.push(format!("{bdf}: BAR{index} ({} KiB) not mapped: {e}", r.size() >> 10)),
            }
        }
    }
    let mut f = Function::new(bdf, id, bridge, Box::new(config), len);
    f.bars = bars;
    Ok(f)
}

/// Every PCI function under `root`, opened for the chaos; the problems with those that
/// could not be.
fn discover(root: &Path, notes: &mut Vec<String>, problems: &mut Vec<String>) -> Vec<Function> {
    let dir = root.join(SYSFS_PCI.trim_start_matches('/'));
    let mut bdfs: Vec<String> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect(),
        Err(e) => {
            problems.push(format!("not found: {}: {e}", dir.display()));
            return Vec::new();
        }
    };
    bdfs.sort();
    let mut functions = Vec::new();
    for bdf in bdfs {
        match open_function(root, &bdf, notes) {
            Ok(f) => functions.push(f),
            Err(e) => problems.push(format!("{bdf}: {e}")),
        }
    }
    functions
}

/// A line on the console now (the report comes only at the end, and a guest the chaos
/// kills never prints it).
fn say(line: &str) {
    use std::io::Write as _;
    println!("# chaos: {line}");
    let _ = std::io::stdout().flush();
}

pub fn run(ctx: &Context) -> Vec<Check> {
    if ctx.expect.is_none() {
        let why = "not in a gdrvm guest (no expectations): the chaos wrecks every PCI function's state";
        return vec![
            Check::new("vmm_answers", Verdict::Skip(why.into())),
            Check::new("guest_alive", Verdict::Skip(why.into())),
        ];
    }
    let cmdline = std::fs::read_to_string(ctx.path("/proc/cmdline")).unwrap_or_default();
    let opts = Options::from_cmdline(&cmdline);
    let seed = opts.seed.unwrap_or_else(sys::random_u64);
    let limit = Limit { time: opts.duration, ops: opts.max_ops.unwrap_or(u64::MAX) };
    let mut notes = opts.problems.clone();
    let mut problems = Vec::new();
    let mut functions = discover(&ctx.root, &mut notes, &mut problems);
    let bars: usize = functions.iter().map(|f| f.bars.len()).sum();
    say(&format!(
        "seed {seed:#018x}, {} s{}, {} functions, {bars} memory BARs (replay: {KEY_SEED}{seed:#x})",
        limit.time.as_secs(),
        opts.max_ops.map(|n| format!(" or {n} operations")).unwrap_or_default(),
        functions.len()
    ));
    let summary = chaos(&mut functions, &mut Rng::new(seed), limit, &say);
    say(&format!("done: {} operations in {:.1} s", summary.ops, summary.elapsed.as_secs_f64()));
    verdicts(&functions, &summary, seed, limit, notes, problems)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::BTreeSet;
    use std::rc::Rc;
    use std::sync::Mutex;

    use gdrvm_model::Expectations;

    use super::*;

    /// edu's DMA command register.
    const EDU_DMA_COMMAND: Range<usize> = 0x98..0xa0;
    const FIRST_WORD: Range<usize> = 0..4;

    #[test]
    fn test_generator_is_splitmix64_and_replays() {
        // The reference sequence of SplitMix64 from seed 0.
        let mut r = Rng::new(0);
        assert_eq!(
            [r.next_u64(), r.next_u64(), r.next_u64()],
            [0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f]
        );
        let seq = |seed| {
            let mut r = Rng::new(seed);
            (0..100).map(|_| r.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(seq(0x1234), seq(0x1234));
        assert_ne!(seq(0x1234), seq(0x1235));
        let mut r = Rng::new(7);
        assert_eq!(r.below(0), 0);
        assert_eq!(r.below(1), 0);
        let seen: BTreeSet<u64> = (0..1000).map(|_| r.below(5)).collect();
        assert_eq!(seen, (0..5).collect());
    }

    #[test]
    fn test_config_writes_stay_in_bounds_and_off_the_bus_numbers() {
        let mut rng = Rng::new(42);
        for (len, bridge) in [(4096, true), (4096, false), (256, true), (256, false), (64, false), (8192, true)] {
            let mut offsets = BTreeSet::new();
            let mut sizes = BTreeSet::new();
            for _ in 0..20_000 {
                let w = pick_config_write(&mut rng, len, bridge).unwrap();
                let (o, s) = (w.offset, w.size as u64);
                assert!(o + s <= len.min(4096), "{w:?} in {len}");
                assert_eq!(o % s, 0, "{w:?} is not aligned");
                if bridge {
                    assert!(o + s <= 0x18 || o >= 0x1c, "{w:?} touches a bridge's bus numbers");
                } else if (o..o + s).contains(&COMMAND) {
                    assert_eq!(w.bytes[(COMMAND - o) as usize] & BUS_MASTER, 0, "{w:?} sets bus master");
                }
                offsets.insert(o);
                sizes.insert(s);
            }
            assert_eq!(sizes, BTreeSet::from([1, 2, 4]));
            // The header gets its share, and the rest of the space is reached too.
            assert!([0, COMMAND, 0x14, 0x1c].iter().all(|o| offsets.contains(o)), "{offsets:?}");
            assert_eq!(offsets.iter().any(|&o| o >= 256), len > 256);
        }
        // Tiny or empty spaces: only what fits, or nothing.
        for _ in 0..100 {
            let w = pick_config_write(&mut rng, 1, false).unwrap();
            assert_eq!((w.offset, w.size), (0, 1));
        }
        assert_eq!(pick_config_write(&mut rng, 0, false), None);
        // The bus numbers are the only registers a bridge keeps; an endpoint's are all open.
        assert!(!config_write_allowed(0x18, 1, true) && !config_write_allowed(0x1b, 1, true));
        assert!(!config_write_allowed(0x16, 4, true) && !config_write_allowed(0x1a, 2, true));
        assert!(config_write_allowed(0x14, 4, true) && config_write_allowed(0x1c, 4, true));
        assert!(config_write_allowed(0x18, 4, false));
    }

    #[test]
    fn test_endpoint_command_writes_keep_everything_but_bus_master() {
        let mut rng = Rng::new(3);
        let mut memory_on = false;
        for _ in 0..50_000 {
            let w = pick_config_write(&mut rng, 256, false).unwrap();
            if w.offset == COMMAND && w.size == 2 {
                memory_on |= w.bytes[0] & 0x02 != 0;
            }
        }
        assert!(memory_on, "memory decode is still hit on endpoints");
    }

    #[test]
    fn test_bar_offsets_stay_in_bounds_and_off_the_skips() {
        let mut rng = Rng::new(9);
        let skips = bar_skips((0x1234, 0x11e8), 0);
        assert_eq!(skips, [EDU_DMA_COMMAND]);
        assert!(bar_skips((0x1234, 0x11e8), 2).is_empty());
        assert!(bar_skips((0x8086, 0x10d3), 0).is_empty());
        let len = 1 << 20;
        let mut high = false;
        let mut near = BTreeSet::new();
        for _ in 0..100_000 {
            let o = pick_bar_offset(&mut rng, len, &skips).unwrap();
            assert!(o + 4 <= len && o % 4 == 0, "{o:#x}");
            assert!(!(0x98..0xa0).contains(&o), "{o:#x} is edu's DMA command");
            high |= o >= BAR_HEAD;
            if (0x90..0xa8).contains(&o) {
                near.insert(o);
            }
        }
        assert!(high, "the whole BAR is reached");
        assert_eq!(near, BTreeSet::from([0x90, 0x94, 0xa0, 0xa4]), "the neighbours of the skip are hit");
        for _ in 0..100 {
            assert_eq!(pick_bar_offset(&mut rng, 7, &[]), Some(0));
        }
        assert_eq!(pick_bar_offset(&mut rng, 3, &[]), None);
        assert_eq!(pick_bar_offset(&mut rng, 4, &[FIRST_WORD]), None);
    }

    #[test]
    fn test_options_from_the_command_line() {
        let o = Options::from_cmdline("console=ttyS0 gdrvm.suites=chaos");
        assert_eq!(o, Options { duration: Duration::from_secs(20), seed: None, max_ops: None, problems: vec![] });
        let o = Options::from_cmdline("gdrvm.chaos_secs=5 gdrvm.chaos_seed=0xDEADbeef gdrvm.chaos_ops=1000");
        assert_eq!((o.duration, o.seed, o.max_ops), (Duration::from_secs(5), Some(0xdead_beef), Some(1000)));
        assert_eq!(Options::from_cmdline("gdrvm.chaos_seed=17").seed, Some(17));
        let o = Options::from_cmdline("gdrvm.chaos_secs=abc gdrvm.chaos_seed=0xzz gdrvm.chaos_ops=-1");
        assert_eq!((o.duration, o.seed, o.max_ops), (Duration::from_secs(20), None, None));
        assert_eq!(o.problems.len(), 3, "{:?}", o.problems);
        let o = Options::from_cmdline("gdrvm.chaos_secs=999999");
        assert_eq!(o.duration, Duration::from_secs(MAX_SECS));
        assert!(o.problems[0].contains("more than 3600 s"));
    }

    #[test]
    fn test_watchdog_names_the_operation() {
        let bdfs = vec!["0000:00:00.0".to_owned(), "0000:03:00.0".to_owned()];
        let ops = [
            Op::Idle,
            Op::ConfigWrite { function: 1 },
            Op::BarWrite { function: 1, bar: 0, offset: 0x1000 },
            Op::BarRead { function: 1, bar: 1, offset: 0xfff_fffc },
            Op::VendorRead { function: 0 },
        ];
        for op in ops {
            assert_eq!(Op::decode(op.encode()), op);
        }
        let describe = |op: Op| op.describe(&bdfs, |_, b| [0, 2][b]);
        assert_eq!(describe(ops[2]), "a write to 0000:03:00.0 BAR0 + 0x1000");
        assert_eq!(describe(ops[3]), "a read of 0000:03:00.0 BAR2 + 0xffffffc");
        assert_eq!(describe(ops[1]), "a configuration write to 0000:03:00.0");
        assert_eq!(describe(Op::VendorRead { function: 9 }), "a vendor-ID read of ?");
    }

    /// A configuration space as a VMM keeps it: vendor and device ID read-only, every write
    /// logged; writes at or past `refuse_from` fail with EIO; after `gone_after` writes it
    /// reads all-ones.
    struct FakeConfig {
        bytes: Vec<u8>,
        writes: Vec<ConfigWrite>,
        refuse_from: u64,
        gone_after: usize,
    }

    impl FakeConfig {
        fn new(vendor: u16, len: usize) -> Rc<RefCell<Self>> {
            let mut bytes = vec![0u8; len];
            bytes[..2].copy_from_slice(&vendor.to_le_bytes());
            Rc::new(RefCell::new(FakeConfig {
                bytes,
                writes: Vec::new(),
                refuse_from: u64::MAX,
                gone_after: usize::MAX,
            }))
        }
    }

    struct Shared<T>(Rc<RefCell<T>>);

    impl ConfigAccess for Shared<FakeConfig> {
        fn read_config(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
            let c = self.0.borrow();
            if c.writes.len() >= c.gone_after {
                buf.fill(0xff);
                return Ok(buf.len());
            }
            let at = offset as usize;
            buf.copy_from_slice(&c.bytes[at..at + buf.len()]);
            Ok(buf.len())
        }

        fn write_config(&mut self, offset: u64, data: &[u8]) -> io::Result<usize> {
            let mut c = self.0.borrow_mut();
            let mut bytes = [0u8; 4];
            bytes[..data.len()].copy_from_slice(data);
            c.writes.push(ConfigWrite { offset, size: data.len(), bytes });
            if offset >= c.refuse_from {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            for (i, b) in data.iter().enumerate() {
                if offset as usize + i >= 4 {
                    c.bytes[offset as usize + i] = *b;
                }
            }
            Ok(data.len())
        }
    }

    /// A BAR that logs its accesses and reads all-ones above `ones_from`.
    #[derive(Default)]
    struct FakeBar {
        writes: Vec<usize>,
        reads: Vec<usize>,
        ones_from: usize,
    }

    impl Mmio for Shared<FakeBar> {
        fn read32(&mut self, offset: usize) -> u32 {
            let mut b = self.0.borrow_mut();
            b.reads.push(offset);
            if offset >= b.ones_from {
                u32::MAX
            } else {
                0
            }
        }

        fn write32(&mut self, offset: usize, _value: u32) {
            self.0.borrow_mut().writes.push(offset);
        }

        fn read64(&mut self, _offset: usize) -> u64 {
            unreachable!("the chaos makes 32-bit accesses")
        }

        fn write64(&mut self, _offset: usize, _value: u64) {
            unreachable!("the chaos makes 32-bit accesses")
        }
    }

    struct Lab {
        functions: Vec<Function>,
        configs: Vec<Rc<RefCell<FakeConfig>>>,
        bars: Vec<Rc<RefCell<FakeBar>>>,
    }

    /// A root port (bridge, 4 KiB), edu (endpoint, 256 bytes, BAR0 1 MiB, BAR2 4 KiB that
    /// reads all-ones in its upper half), and a host bridge that refuses writes past 0x40.
    fn lab() -> Lab {
        let configs = vec![FakeConfig::new(0x8086, 4096), FakeConfig::new(0x1234, 256), FakeConfig::new(0x8086, 256)];
        configs[2].borrow_mut().refuse_from = 0x40;
        let bars = vec![
            Rc::new(RefCell::new(FakeBar { ones_from: usize::MAX, ..Default::default() })),
            Rc::new(RefCell::new(FakeBar { ones_from: 2048, ..Default::default() })),
        ];
        let config = |i: usize| Box::new(Shared(configs[i].clone()));
        let mut edu = Function::new("0000:03:00.0", (0x1234, 0x11e8), false, config(1), 256);
        edu.bars = vec![
            ChaosBar::new(0, 1 << 20, Box::new(Shared(bars[0].clone())), bar_skips((0x1234, 0x11e8), 0)),
            ChaosBar::new(2, 4096, Box::new(Shared(bars[1].clone())), bar_skips((0x1234, 0x11e8), 2)),
        ];
        let functions = vec![
            Function::new("0000:00:01.0", (0x8086, 0x7000), true, config(0), 4096),
            edu,
            Function::new("0000:00:00.0", (0x8086, 0x29c0), false, config(2), 256),
        ];
        Lab { functions, configs, bars }
    }

    fn quiet(_: &str) {}

    const OPS: Limit = Limit { time: Duration::from_secs(3600), ops: 20_000 };

    #[test]
    fn test_chaos_over_a_fake_machine() {
        let mut lab = lab();
        let summary = chaos(&mut lab.functions, &mut Rng::new(0xc4a05), OPS, &quiet);
        assert_eq!(summary.ops, 20_000);
        assert_eq!(summary.sweeps, 20_000 / SWEEP_EVERY + 1);

        let port = lab.configs[0].borrow();
        assert!(port.writes.len() > 1000);
        for w in &port.writes {
            assert!(w.offset + w.size as u64 <= 0x18 || w.offset >= 0x1c, "{w:?} hit the port's bus numbers");
        }
        assert!(port.writes.iter().any(|w| w.offset >= 256), "extended space is written");
        let edu = lab.configs[1].borrow();
        for w in &edu.writes {
            assert!(w.offset + w.size as u64 <= 256);
        }
        assert_eq!(edu.bytes[COMMAND as usize] & BUS_MASTER, 0, "edu never becomes a bus master");
        assert!(edu.writes.iter().any(|w| w.offset == COMMAND), "edu's Command register is written");

        let bar0 = lab.bars[0].borrow();
        assert!(bar0.writes.len() > 1000 && !bar0.reads.is_empty());
        assert!(!bar0.writes.iter().any(|o| (0x98..0xa0).contains(o)), "edu's DMA command was written");
        assert!(bar0.writes.iter().chain(&bar0.reads).all(|o| o + 4 <= 1 << 20));

        // Every write counted where it went; refusals and all-ones counted, not failed.
        let [port_f, edu_f, host_f] = &lab.functions[..] else { unreachable!() };
        assert_eq!(port_f.tally.config_writes, port.writes.len() as u64);
        assert_eq!(edu_f.tally.config_writes, edu.writes.len() as u64);
        assert_eq!(edu_f.bars[0].writes, bar0.writes.len() as u64);
        assert_eq!(edu_f.bars[1].reads, lab.bars[1].borrow().reads.len() as u64);
        assert!(edu_f.bars[1].all_ones > 0 && edu_f.bars[0].all_ones == 0);
        let host = lab.configs[2].borrow();
        let refused = host.writes.iter().filter(|w| w.offset >= 0x40).count() as u64;
        assert!(refused > 0);
        assert_eq!(host_f.tally.config_refused, refused);
        assert!(host_f.tally.first_refusal.as_ref().unwrap().contains("Input/output error"));
        for f in &lab.functions {
            assert_eq!(f.tally.vendor_reads, summary.sweeps);
            assert_eq!((f.tally.vendor_wrong, &f.after), (0, &Some(Ok(f.id.0))));
        }

        let checks = verdicts(&lab.functions, &summary, 0xc4a05, OPS, vec![], vec![]);
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["vmm_answers", "guest_alive"]);
        assert!(checks.iter().all(|c| c.verdict == Verdict::Pass), "{checks:#?}");
        let answers = &checks[0].diagnostics;
        assert_eq!(answers[0], "seed 0x00000000000c4a05 (replay: gdrvm.chaos_seed=0xc4a05 gdrvm.chaos_ops=20000)");
        assert!(answers[2].starts_with(&format!(
            "0000:03:00.0 1234:11e8 endpoint: {} config writes (0 refused); BAR0 1024 KiB: {} writes",
            edu.writes.len(),
            bar0.writes.len()
        )));
        assert!(answers[3].contains(&format!("({refused} refused, first ")), "{answers:?}");
        assert!(checks[1].diagnostics[0].contains("20000 operations"), "{:?}", checks[1].diagnostics);
    }

    #[test]
    fn test_same_seed_same_operations() {
        let run = |seed| {
            let mut lab = lab();
            chaos(&mut lab.functions, &mut Rng::new(seed), Limit { ops: 3000, ..OPS }, &quiet);
            let configs: Vec<Vec<ConfigWrite>> = lab.configs.iter().map(|c| c.borrow().writes.clone()).collect();
            let bars: Vec<(Vec<usize>, Vec<usize>)> =
                lab.bars.iter().map(|b| (b.borrow().writes.clone(), b.borrow().reads.clone())).collect();
            (configs, bars)
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn test_a_function_that_stops_answering_fails_by_name() {
        let mut lab = lab();
        lab.configs[1].borrow_mut().gone_after = 100;
        let summary = chaos(&mut lab.functions, &mut Rng::new(1), Limit { ops: 5000, ..OPS }, &quiet);
        let checks = verdicts(&lab.functions, &summary, 1, OPS, vec![], vec![]);
        let Verdict::Fail(why) = &checks[0].verdict else { panic!("{checks:#?}") };
        assert!(why.starts_with("0000:03:00.0: "), "{why}");
        assert!(why.contains("vendor-ID reads during the chaos did not give 0x1234 (first at 0.0 s: 0xffff)"), "{why}");
        assert!(why.contains("0000:03:00.0: vendor ID 0x1234 before the chaos, 0xffff after"), "{why}");
        assert!(!why.contains("0000:00:01.0") && !why.contains("0000:00:00.0"), "{why}");
        assert_eq!(checks[1].verdict, Verdict::Pass, "the guest still got to the end");
    }

    #[test]
    fn test_time_limit_and_nothing_to_do() {
        let mut lab = lab();
        let limit = Limit { time: Duration::from_millis(50), ops: u64::MAX };
        let summary = chaos(&mut lab.functions, &mut Rng::new(2), limit, &quiet);
        assert!(summary.ops > 0 && summary.elapsed >= Duration::from_millis(50));
        let summary = chaos(&mut [], &mut Rng::new(2), limit, &quiet);
        assert_eq!(summary, Summary::default());
        let checks = verdicts(&[], &summary, 2, limit, vec![], vec![]);
        assert!(matches!(&checks[0].verdict, Verdict::Fail(m) if m.starts_with("not found")));
    }

    #[test]
    fn test_watchdog_names_a_stall_once() {
        let lines = Mutex::new(Vec::new());
        let say = |l: &str| lines.lock().unwrap().push(l.to_owned());
        let progress = Progress::default();
        progress.set(Op::ConfigWrite { function: 0 });
        progress.ops.store(17, Ordering::Relaxed);
        std::thread::scope(|s| {
            s.spawn(|| watchdog(&progress, WATCHDOG_POLL * 2, |op| format!("{op:?}"), &say));
            std::thread::sleep(WATCHDOG_POLL * 8);
            progress.done.store(true, Ordering::Relaxed);
        });
        assert_eq!(
            *lines.lock().unwrap(),
            ["no progress for 0 s, after 17 operations: stuck in ConfigWrite { function: 0 }"]
        );
        // An operation that moves on is no stall.
        lines.lock().unwrap().clear();
        let progress = Progress::default();
        std::thread::scope(|s| {
            s.spawn(|| watchdog(&progress, WATCHDOG_POLL * 2, |op| format!("{op:?}"), &say));
            for n in 0..8 {
                progress.ops.store(n, Ordering::Relaxed);
                std::thread::sleep(WATCHDOG_POLL / 2);
            }
            progress.done.store(true, Ordering::Relaxed);
        });
        assert!(lines.lock().unwrap().is_empty());
    }

    fn ctx(root: &Path, expect: bool) -> Context {
        Context {
            expect: expect.then(|| Expectations {
                cpus: 1,
                memory_bytes: 1 << 30,
                numa: vec![],
                pci: vec![],
                paths: vec![],
                host: false,
            }),
            image: None,
            root: root.to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        }
    }

    #[test]
    fn test_outside_a_guest_it_skips() {
        let root = tempfile::tempdir().unwrap();
        let checks = run(&ctx(root.path(), false));
        assert_eq!(checks.len(), 2);
        for c in &checks {
            assert!(matches!(&c.verdict, Verdict::Skip(m) if m.starts_with("not in a gdrvm guest")), "{c:?}");
        }
    }

    /// A function in a fake sysfs: config (header type, Command), resource lines, BAR files.
    fn fake_function(root: &Path, bdf: &str, header_type: u8, command: u8, resource: &str, bars: &[(usize, u64)]) {
        let dir = pcidev::function_dir(root, bdf);
        std::fs::create_dir_all(&dir).unwrap();
        let mut config = vec![0u8; 256];
        config[..4].copy_from_slice(&[0x34, 0x12, 0xe8, 0x11]);
        config[COMMAND as usize] = command;
        config[HEADER_TYPE] = header_type;
        config[0x19] = 5;
        std::fs::write(dir.join("config"), config).unwrap();
        std::fs::write(dir.join("resource"), resource).unwrap();
        for &(i, len) in bars {
            let f = File::create(dir.join(format!("resource{i}"))).unwrap();
            f.set_len(len).unwrap();
        }
    }

    #[test]
    fn test_discovery_and_a_whole_run_on_a_fake_sysfs() {
        let root = tempfile::tempdir().unwrap();
        let zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        let mem = "0x00000000fe000000 0x00000000fe0fffff 0x0000000000040200\n";
        let io = "0x000000000000c000 0x000000000000c01f 0x0000000000040101\n";
        fake_function(root.path(), "0000:00:01.0", 0x81, 0x07, &zero.repeat(13), &[]);
        fake_function(
            root.path(),
            "0000:01:00.0",
            0x00,
            0x07,
            &format!("{mem}{io}{mem}{zero}"),
            &[(0, 4096), (2, 8192)],
        );
        // A memory resource without its file: noted, not mapped.
        fake_function(root.path(), "0000:02:00.0", 0x00, 0x02, &format!("{zero}{mem}"), &[]);
        // The endpoint has a driver: it is unbound.
        let drv = root.path().join("sys/bus/pci/drivers/edu");
        std::fs::create_dir_all(&drv).unwrap();
        std::fs::write(drv.join("unbind"), "").unwrap();
        std::os::unix::fs::symlink(&drv, pcidev::function_dir(root.path(), "0000:01:00.0").join("driver")).unwrap();

        let (mut notes, mut problems) = (Vec::new(), Vec::new());
        let functions = discover(root.path(), &mut notes, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        let seen: Vec<(&str, bool, Vec<usize>)> =
            functions.iter().map(|f| (f.bdf.as_str(), f.bridge, f.bars.iter().map(|b| b.index).collect())).collect();
        assert_eq!(
            seen,
            [("0000:00:01.0", true, vec![]), ("0000:01:00.0", false, vec![0, 2]), ("0000:02:00.0", false, vec![])]
        );
        assert_eq!(functions[1].id, (0x1234, 0x11e8));
        assert_eq!(functions[1].bars[0].skips, [EDU_DMA_COMMAND], "edu's skip list applies");
        assert_eq!(functions[1].bars[1].len, 8192);
        assert_eq!(std::fs::read_to_string(drv.join("unbind")).unwrap(), "0000:01:00.0");
        let config = |bdf| std::fs::read(pcidev::function_dir(root.path(), bdf).join("config")).unwrap();
        assert_eq!(config("0000:01:00.0")[COMMAND as usize], 0x03, "bus master turned off on the endpoint");
        assert_eq!(config("0000:00:01.0")[COMMAND as usize], 0x07, "and left alone on the bridge");
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert_eq!(notes[..2], ["0000:01:00.0: unbound from edu", "0000:01:00.0: bus master turned off"]);
        assert!(notes[2].starts_with("0000:01:00.0: BAR0 0x98-0x9f left alone: QEMU's edu"), "{}", notes[2]);
        let missing = pcidev::function_dir(root.path(), "0000:02:00.0").join("resource1");
        assert_eq!(
            notes[3],
            format!(
                "0000:02:00.0: BAR1 (1024 KiB) not mapped: {}: No such file or directory (os error 2)",
                missing.display()
            )
        );
        drop(functions);

        // The whole suite, replayed from the command line, over these plain files.
        std::fs::create_dir_all(root.path().join("proc")).unwrap();
        std::fs::write(root.path().join("proc/cmdline"), "gdrvm.chaos_seed=0x2a gdrvm.chaos_ops=2000\n").unwrap();
        let checks = run(&ctx(root.path(), true));
        assert_eq!(
            checks[0].diagnostics[0],
            "seed 0x000000000000002a (replay: gdrvm.chaos_seed=0x2a gdrvm.chaos_ops=2000)"
        );
        assert_eq!(checks[1].verdict, Verdict::Pass);
        assert!(checks[1].diagnostics[0].contains(": 2000 operations"), "{:?}", checks[1].diagnostics);
        let port = config("0000:00:01.0");
        assert_eq!(port[0x19], 5, "the bridge's secondary bus number is untouched");
        assert_eq!(config("0000:01:00.0")[COMMAND as usize] & BUS_MASTER, 0);
    }
}
