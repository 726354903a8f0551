//! One transfer through a NIC's ring: both ends resolved to the runs the NIC addresses, the
//! source filled with a fresh pattern and the destination with another, the copy, then the
//! NIC's counters and what the destination holds, against what the peer-to-peer rule says.

use gdrvm_model::emulated::DESC_MAX_LEN;

use super::data::{check, fill};
use super::plan::{judge, timeout_for, End, Expected, Transfer};
use super::ring::{split, Outcome, Ring, RingError};
use crate::dma::{runs, Run};
use crate::pcidev::Mmio;

/// How the NIC addresses a memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// Pages, each at its own physical address (pinned host memory).
    Pages(Vec<u64>),
    /// One contiguous range (a BAR).
    Contiguous {
        /// Its bus address.
        base: u64,
        /// Its size.
        len: u64,
    },
}

impl Layout {
    /// The runs of `len` bytes at `offset`; `None` when they leave the memory.
    pub fn runs(&self, offset: u64, len: u64) -> Option<Vec<Run>> {
        match self {
            Layout::Pages(pages) => runs(pages, offset, len),
            Layout::Contiguous { base, len: size } => {
                (offset.checked_add(len)? <= *size).then(|| vec![Run { addr: base + offset, len }])
            }
        }
    }
}

/// A memory both the CPU (through `mem`) and the NIC (through `layout`) reach.
pub struct Space<'a> {
    /// The CPU's way in.
    pub mem: &'a mut dyn Mmio,
    /// The NIC's.
    pub layout: Layout,
}

/// The memories transfers use: the host buffer (when one could be pinned) and the
/// apertures of the opened GPUs, by [`End`].
pub struct Spaces<'a> {
    /// The pinned host buffer.
    pub host: Option<Space<'a>>,
    /// GPU apertures.
    pub gpus: Vec<Space<'a>>,
}

impl<'a> Spaces<'a> {
    fn space(&mut self, end: End) -> Result<(&mut Space<'a>, u64), Failed> {
        let (space, offset) = match end {
            End::Host(offset) => (self.host.as_mut(), offset),
            End::Gpu(n) => (self.gpus.get_mut(n), 0),
        };
        let space = space.ok_or_else(|| Failed::Setup(format!("no memory for {end:?}")))?;
        Ok((space, offset))
    }

    fn runs(&mut self, end: End, len: u64) -> Result<Vec<Run>, Failed> {
        let (space, offset) = self.space(end)?;
        space.layout.runs(offset, len).ok_or_else(|| Failed::Setup(format!("{len} bytes at {end:?} do not fit")))
    }

    fn fill(&mut self, end: End, len: u64, seed: u64) -> Result<(), Failed> {
        let (space, offset) = self.space(end)?;
        fill(space.mem, to_usize(offset)?, to_usize(len)?, seed);
        Ok(())
    }
}

fn to_usize(n: u64) -> Result<usize, Failed> {
    usize::try_from(n).map_err(|_| Failed::Setup(format!("{n} does not fit in usize")))
}

/// Why a transfer did not run to its end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failed {
    /// It could not be set up (a memory missing, a range outside it).
    #[error("{0}")]
    Setup(String),
    /// The ring failed: the NIC is not usable for more transfers.
    #[error(transparent)]
    Ring(#[from] RingError),
}

/// What a transfer that ran did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// How the ring ended.
    pub outcome: Outcome,
    /// Descriptors it took.
    pub descriptors: usize,
    /// Where it differs from what was expected; empty when it held.
    pub problems: Vec<String>,
}

/// Runs `t` through `ring` with pattern `seed` (the destination first holds its complement's
/// pattern) and checks it against `expected`: the ring's statuses, the NIC's counters, and
/// the destination: the pattern when copied, untouched when refused.
pub fn execute<R: Mmio, M: Mmio>(
    ring: &mut Ring<'_, R, M>,
    spaces: &mut Spaces<'_>,
    t: &Transfer,
    seed: u64,
    expected: Expected,
) -> Result<Report, Failed> {
    let (src, dst) = (spaces.runs(t.src, t.len)?, spaces.runs(t.dst, t.len)?);
    let pieces = split(&src, &dst, DESC_MAX_LEN)?;
    spaces.fill(t.src, t.len, seed)?;
    spaces.fill(t.dst, t.len, !seed)?;
    let before = ring.counters();
    let outcome = ring.transfer(&pieces, timeout_for(t.len))?;
    let after = ring.counters();
    let mut report = Report { outcome, descriptors: pieces.len(), problems: Vec::new() };
    if let Err(e) = judge(expected, &outcome, pieces.len()) {
        report.problems.push(e);
        return Ok(report);
    }
    let completed = after.completed.wrapping_sub(before.completed) as usize;
    let failed = after.failed.wrapping_sub(before.failed) as usize;
    let bytes = after.bytes.wrapping_sub(before.bytes);
    let (want, counted) = match expected {
        Expected::Copied => ((pieces.len(), 0, t.len), "copied"),
        Expected::Refused => ((0, outcome.posted, 0), "refused"),
    };
    if (completed, failed, bytes) != want {
        report.problems.push(format!(
            "the NIC counted {completed} completed, {failed} failed, {bytes} bytes; {counted}, that is {} completed, {} failed, {} bytes",
            want.0, want.1, want.2
        ));
    }
    let (space, offset) = spaces.space(t.dst)?;
    let (want, other) = if expected == Expected::Copied { (seed, !seed) } else { (!seed, seed) };
    if let Err(m) = check(space.mem, to_usize(offset)?, to_usize(t.len)?, want, other) {
        report.problems.push(match expected {
            Expected::Copied => format!("the destination does not hold the source's pattern: {m}"),
            Expected::Refused => format!("the destination changed though the copy was refused: {m}"),
        });
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use gdrvm_model::emulated::{STATUS_OK, STATUS_UNMAPPED};

    use super::super::fake::{phys, FakeDevice, Phys, Window};
    use super::super::ring::Piece;
    use super::*;

    const PAGE: u64 = 4096;
    const RING: u64 = 0x10_0000;
    const HOST: u64 = 0x200_0000;
    const GPU0: u64 = 0x40_0000_0000;
    const GPU1: u64 = 0x48_0000_0000;
    const APERTURE: u64 = 1 << 20;

    /// RAM with the ring page and 64 host pages, two GPU apertures.
    fn memory() -> Phys {
        phys(&[(RING, 4096), (HOST, 64 * 4096), (GPU0, APERTURE as usize), (GPU1, APERTURE as usize)])
    }

    /// Host pages: pairs of contiguous pages, the pairs in reverse order.
    fn host_pages() -> Vec<u64> {
        (0..64u64).map(|i| HOST + ((63 - i) / 2 * 2 + i % 2) * PAGE).collect()
    }

    /// A NIC on [`memory`], windows onto its ring page, the host pages and two apertures.
    fn setup() -> (FakeDevice, Window, Window, [Window; 2]) {
        let phys = memory();
        let window = |base| Window { phys: phys.clone(), base, pages: vec![] };
        let host = Window { pages: host_pages(), ..window(0) };
        (FakeDevice::nic_on(phys.clone()), window(RING), host, [window(GPU0), window(GPU1)])
    }

    fn spaces<'a>(host: &'a mut Window, gpus: &'a mut [Window; 2]) -> Spaces<'a> {
        let [g0, g1] = gpus;
        Spaces {
            host: Some(Space { mem: host, layout: Layout::Pages(host_pages()) }),
            gpus: vec![
                Space { mem: g0, layout: Layout::Contiguous { base: GPU0, len: APERTURE } },
                Space { mem: g1, layout: Layout::Contiguous { base: GPU1, len: APERTURE } },
            ],
        }
    }

    #[test]
    fn test_split_follows_both_sides_runs() {
        let src = [Run { addr: 0x1000, len: 0x3000 }, Run { addr: 0x9000, len: 0x1000 }];
        let dst = [Run { addr: 0x50000, len: 0x1800 }, Run { addr: 0, len: 0 }, Run { addr: 0x70000, len: 0x2800 }];
        assert_eq!(
            split(&src, &dst, 0x1000).unwrap(),
            [
                Piece { src: 0x1000, dst: 0x50000, len: 0x1000 },
                Piece { src: 0x2000, dst: 0x51000, len: 0x800 },
                Piece { src: 0x2800, dst: 0x70000, len: 0x1000 },
                Piece { src: 0x3800, dst: 0x71000, len: 0x800 },
                Piece { src: 0x9000, dst: 0x71800, len: 0x1000 },
            ]
        );
        let one = [Run { addr: 0, len: 3 << 26 }];
        let pieces = split(&one, &[Run { addr: 1 << 40, len: 3 << 26 }], DESC_MAX_LEN).unwrap();
        assert_eq!(pieces.len(), 3);
        assert!(pieces.iter().all(|p| p.len == DESC_MAX_LEN));
        assert_eq!(split(&one, &[], 1), Err(RingError::Lengths { src: 3 << 26, dst: 0 }));
        assert_eq!(split(&[], &[], 1), Ok(vec![]));
    }

    #[test]
    fn test_host_to_gpu_and_back_through_a_small_ring() {
        let (mut nic, mut ring_mem, mut host, mut gpus) = setup();
        let mut ring = Ring::attach(&mut nic, &mut ring_mem, RING, 4).unwrap();
        let mut spaces = spaces(&mut host, &mut gpus);
        // 64 pages in 32 runs of two: 32 descriptors through 4 slots, refilled as head moves.
        let t = Transfer { src: End::Host(0), dst: End::Gpu(0), len: 64 * PAGE };
        let r = execute(&mut ring, &mut spaces, &t, 11, Expected::Copied).unwrap();
        assert_eq!(r.problems, Vec::<String>::new());
        assert_eq!((r.descriptors, r.outcome.posted, r.outcome.failure), (32, 32, None));
        let back = Transfer { src: End::Gpu(0), dst: End::Host(0), len: 8 * PAGE };
        let r = execute(&mut ring, &mut spaces, &back, 12, Expected::Copied).unwrap();
        assert_eq!(r.problems, Vec::<String>::new());
        let across = Transfer { src: End::Gpu(0), dst: End::Gpu(1), len: APERTURE };
        let r = execute(&mut ring, &mut spaces, &across, 13, Expected::Copied).unwrap();
        assert_eq!((r.descriptors, r.problems), (1, vec![]));
        drop(ring);
        assert_eq!(nic.ring.1, 0, "dropping the ring stops the engine");
        assert_eq!(nic.seen.len(), 37);
        assert!(nic.seen[..36].iter().all(|&(_, _, len, status)| len == 2 * PAGE as u32 && status == STATUS_OK));
        assert_eq!(nic.seen[0], (HOST + 62 * PAGE, GPU0, 8192, STATUS_OK));
        assert_eq!(nic.seen[36], (GPU0, GPU1, APERTURE as u32, STATUS_OK));
    }

    #[test]
    fn test_refused_when_p2p_is_off_and_ram_still_copies() {
        let (mut nic, mut ring_mem, mut host, mut gpus) = setup();
        nic.unreachable = vec![(GPU0, APERTURE), (GPU1, APERTURE)];
        let mut ring = Ring::attach(&mut nic, &mut ring_mem, RING, 8).unwrap();
        let mut spaces = spaces(&mut host, &mut gpus);
        for t in [
            Transfer { src: End::Host(0), dst: End::Gpu(0), len: 32 * PAGE },
            Transfer { src: End::Gpu(0), dst: End::Host(0), len: 4 * PAGE },
            Transfer { src: End::Gpu(0), dst: End::Gpu(1), len: APERTURE },
        ] {
            let r = execute(&mut ring, &mut spaces, &t, 3, Expected::Refused).unwrap();
            assert_eq!(r.problems, Vec::<String>::new(), "{t:?}");
            assert_eq!(r.outcome.failure, Some((0, STATUS_UNMAPPED)));
            // Expecting a copy instead names the failure.
            let r = execute(&mut ring, &mut spaces, &t, 4, Expected::Copied).unwrap();
            assert_eq!(r.problems.len(), 1);
            assert!(r.problems[0].starts_with("descriptor 0 of "), "{:?}", r.problems);
        }
        let t = Transfer { src: End::Host(0), dst: End::Host(32 * PAGE), len: 32 * PAGE };
        let r = execute(&mut ring, &mut spaces, &t, 5, Expected::Copied).unwrap();
        assert_eq!(r.problems, Vec::<String>::new());
        drop(ring);
        // A copy where the rule says refused fails.
        nic.unreachable.clear();
        let mut ring = Ring::attach(&mut nic, &mut ring_mem, RING, 8).unwrap();
        let t = Transfer { src: End::Host(0), dst: End::Gpu(1), len: 4 * PAGE };
        let r = execute(&mut ring, &mut spaces, &t, 6, Expected::Refused).unwrap();
        assert_eq!(r.problems, ["p2p is off, yet all 2 descriptors completed"]);
    }

    #[test]
    fn test_data_that_did_not_land_is_named() {
        let (mut nic, mut ring_mem, mut host, mut gpus) = setup();
        let mut ring = Ring::attach(&mut nic, &mut ring_mem, RING, 8).unwrap();
        let mut spaces = spaces(&mut host, &mut gpus);
        // The NIC is sent to GPU 0's address while the CPU looks at GPU 1: the copy
        // "succeeds" but GPU 1 keeps what it held.
        spaces.gpus[1].layout = Layout::Contiguous { base: GPU0, len: APERTURE };
        let t = Transfer { src: End::Host(0), dst: End::Gpu(1), len: PAGE };
        let r = execute(&mut ring, &mut spaces, &t, 7, Expected::Copied).unwrap();
        assert_eq!(r.problems.len(), 1);
        assert!(r.problems[0].ends_with("(what was there before)"), "{:?}", r.problems);
        let t = Transfer { src: End::Host(0), dst: End::Gpu(0), len: 2 * APERTURE };
        assert!(matches!(execute(&mut ring, &mut spaces, &t, 7, Expected::Copied), Err(Failed::Setup(_))));
        spaces.host = None;
        let t = Transfer { src: End::Host(0), dst: End::Gpu(0), len: PAGE };
        assert!(matches!(execute(&mut ring, &mut spaces, &t, 7, Expected::Copied), Err(Failed::Setup(_))));
    }

    #[test]
    fn test_layout_runs() {
        let bar = Layout::Contiguous { base: GPU0, len: APERTURE };
        assert_eq!(bar.runs(PAGE, PAGE), Some(vec![Run { addr: GPU0 + PAGE, len: PAGE }]));
        assert_eq!(bar.runs(PAGE, APERTURE), None);
        let pages = Layout::Pages(host_pages());
        assert_eq!(pages.runs(0, 4 * PAGE).map(|r| r.len()), Some(2));
    }
}
