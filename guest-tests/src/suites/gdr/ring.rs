//! A userspace driver for the emulated NIC's DMA engine ([`gdrvm_model::emulated`]): copies
//! cut into descriptors, and one ring of them in guest memory, posted and refilled as the
//! device advances its head.

use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use gdrvm_model::emulated::{
    DESC_DST, DESC_FLAGS, DESC_LEN, DESC_LEN_FIELD, DESC_SRC, DESC_STATUS, ENGINE_BROKEN, NIC_BYTES_HI, NIC_BYTES_LO,
    NIC_COMPLETED, NIC_ENGINE, NIC_FAILED, NIC_RING_BASE_HI, NIC_RING_BASE_LO, NIC_RING_HEAD, NIC_RING_MAX,
    NIC_RING_SIZE, NIC_RING_TAIL, REGS, STATUS_BAD_LENGTH, STATUS_NO_BUS_MASTER, STATUS_OK, STATUS_PENDING,
    STATUS_UNMAPPED,
};

use crate::dma::Run;
use crate::pcidev::Mmio;

/// Polls without progress before the driver starts sleeping between polls.
const SPIN_POLLS: u32 = 64;
/// The sleep between polls once the device is slow.
const POLL_SLEEP: Duration = Duration::from_micros(100);

/// What went wrong driving the ring.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The source and destination runs differ in length.
    #[error("the source holds {src} bytes and the destination {dst}")]
    Lengths {
        /// Source bytes.
        src: u64,
        /// Destination bytes.
        dst: u64,
    },
    /// A ring size the device does not take.
    #[error("ring size {0} is not a power of two from 1 to {NIC_RING_MAX}")]
    Size(u32),
    /// A register reads all-ones.
    #[error("register {0:#x} reads all-ones: memory decode is off, or the device is gone")]
    AllOnes(u64),
    /// A register does not hold what was written.
    #[error("register {reg:#x} reads {got:#x} after writing {wrote:#x}")]
    Readback {
        /// The register.
        reg: u64,
        /// What was written.
        wrote: u32,
        /// What it reads.
        got: u32,
    },
    /// The ring was not idle when a transfer started.
    #[error("the engine is busy before starting (head {head}, tail {tail})")]
    Busy {
        /// HEAD.
        head: u32,
        /// TAIL.
        tail: u32,
    },
    /// HEAD moved past TAIL.
    #[error("head {now} ran past tail {tail} (it was {head})")]
    HeadPastTail {
        /// HEAD before.
        head: u32,
        /// HEAD now.
        now: u32,
        /// TAIL.
        tail: u32,
    },
    /// The engine stopped: it could not read or write the ring.
    #[error("the engine is broken: it could not read or write the ring at {0:#x}")]
    Broken(u64),
    /// The device did not finish in time.
    #[error("timed out after {ms} ms: head {head}, tail {tail}, {done} of {total} descriptors done")]
    Timeout {
        /// How long the driver waited.
        ms: u128,
        /// HEAD.
        head: u32,
        /// TAIL.
        tail: u32,
        /// Descriptors completed.
        done: usize,
        /// Descriptors in the transfer.
        total: usize,
    },
}

/// What one descriptor copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Source IOVA.
    pub src: u64,
    /// Destination IOVA.
    pub dst: u64,
    /// Bytes.
    pub len: u32,
}

/// Cuts a copy from the `src` runs to the `dst` runs (of the same total) into descriptors of at
/// most `max` bytes, none crossing a run boundary on either side.
pub fn split(src: &[Run], dst: &[Run], max: u32) -> Result<Vec<Piece>, RingError> {
    let total = |runs: &[Run]| runs.iter().map(|r| r.len).sum::<u64>();
    if total(src) != total(dst) {
        return Err(RingError::Lengths { src: total(src), dst: total(dst) });
    }
    let mut pieces = Vec::new();
    let (mut s, mut d) = (src.iter().filter(|r| r.len > 0), dst.iter().filter(|r| r.len > 0));
    let (mut a, mut b) = (s.next().copied(), d.next().copied());
    while let (Some(x), Some(y)) = (a.as_mut(), b.as_mut()) {
        let len = x.len.min(y.len).min(u64::from(max.max(1)));
        // `len <= max`, a u32.
        pieces.push(Piece { src: x.addr, dst: y.addr, len: len as u32 });
        for run in [&mut *x, &mut *y] {
            run.addr += len;
            run.len -= len;
        }
        if x.len == 0 {
            a = s.next().copied();
        }
        if y.len == 0 {
            b = d.next().copied();
        }
    }
    Ok(pieces)
}

/// The byte offset of the descriptor with index `index` in a ring of `size` entries.
pub fn slot_offset(index: u32, size: u32) -> usize {
    (index % size.max(1)) as usize * DESC_LEN as usize
}

/// How one transfer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// From the first doorbell to the last descriptor done.
    pub elapsed: Duration,
    /// Descriptors posted (all of them, unless one failed).
    pub posted: usize,
    /// The first descriptor that failed: its place in the transfer and its status.
    pub failure: Option<(usize, u32)>,
}

/// The NIC's counters ([`NIC_COMPLETED`], [`NIC_FAILED`], [`NIC_BYTES_LO`]/`_HI`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Descriptors completed.
    pub completed: u32,
    /// Descriptors failed.
    pub failed: u32,
    /// Bytes copied.
    pub bytes: u64,
}

/// A descriptor status by name.
pub fn status_name(status: u32) -> String {
    match status {
        STATUS_PENDING => "pending".into(),
        STATUS_OK => "ok".into(),
        STATUS_UNMAPPED => "unmapped".into(),
        STATUS_BAD_LENGTH => "bad length".into(),
        STATUS_NO_BUS_MASTER => "no bus master".into(),
        other => format!("unknown status {other}"),
    }
}

/// A NIC register at `reg` (an offset from [`REGS`]).
fn read<R: Mmio>(regs: &mut R, reg: u64) -> u32 {
    regs.read32((REGS + reg) as usize)
}

fn write<R: Mmio>(regs: &mut R, reg: u64, value: u32) {
    regs.write32((REGS + reg) as usize, value);
}

/// A ring attached to the NIC whose registers are `regs` (its BAR 0), in the memory `mem`
/// that the NIC sees at `base`. Dropping it stops the engine (ring size 0).
pub struct Ring<'a, R: Mmio, M: Mmio> {
    regs: &'a mut R,
    mem: &'a mut M,
    base: u64,
    size: u32,
}

impl<'a, R: Mmio, M: Mmio> Ring<'a, R, M> {
    /// Points the NIC at a ring of `size` entries at `base` and checks it reset: base as
    /// written, size as written, head and tail 0.
    pub fn attach(regs: &'a mut R, mem: &'a mut M, base: u64, size: u32) -> Result<Self, RingError> {
        if !size.is_power_of_two() || size > NIC_RING_MAX {
            return Err(RingError::Size(size));
        }
        for (reg, value) in [(NIC_RING_BASE_LO, base as u32), (NIC_RING_BASE_HI, (base >> 32) as u32)] {
            write(regs, reg, value);
            match read(regs, reg) {
                got if got == value => {}
                u32::MAX => return Err(RingError::AllOnes(reg)),
                got => return Err(RingError::Readback { reg, wrote: value, got }),
            }
        }
        write(regs, NIC_RING_SIZE, size);
        // From here on, dropping the ring stops the engine.
        let mut ring = Ring { regs, mem, base, size };
        for (reg, want) in [(NIC_RING_SIZE, size), (NIC_RING_HEAD, 0), (NIC_RING_TAIL, 0)] {
            match ring.read(reg) {
                got if got == want => {}
                u32::MAX => return Err(RingError::AllOnes(reg)),
                got => return Err(RingError::Readback { reg, wrote: want, got }),
            }
        }
        Ok(ring)
    }

    fn read(&mut self, reg: u64) -> u32 {
        read(self.regs, reg)
    }

    /// The NIC's counters now.
    pub fn counters(&mut self) -> Counters {
        let bytes = u64::from(self.read(NIC_BYTES_LO)) | u64::from(self.read(NIC_BYTES_HI)) << 32;
        Counters { completed: self.read(NIC_COMPLETED), failed: self.read(NIC_FAILED), bytes }
    }

    fn post(&mut self, index: u32, piece: &Piece) {
        let at = slot_offset(index, self.size);
        self.mem.write64(at + DESC_SRC as usize, piece.src);
        self.mem.write64(at + DESC_DST as usize, piece.dst);
        self.mem.write32(at + DESC_LEN_FIELD as usize, piece.len);
        self.mem.write32(at + DESC_FLAGS as usize, 0);
        self.mem.write32(at + DESC_STATUS as usize, STATUS_PENDING);
        self.mem.write32(at + DESC_STATUS as usize + 4, 0);
    }

    /// Copies `pieces` in order: posts as many as the ring holds, rings the doorbell, and as
    /// the head advances reads each done descriptor's status and posts more. After a
    /// descriptor fails it posts nothing more and waits for those already posted. Gives up
    /// after `timeout`, stopping the engine first (ring size 0) so that nothing lands later.
    pub fn transfer(&mut self, pieces: &[Piece], timeout: Duration) -> Result<Outcome, RingError> {
        let (head0, tail0) = (self.read(NIC_RING_HEAD), self.read(NIC_RING_TAIL));
        if head0 == u32::MAX && self.read(NIC_ENGINE) == u32::MAX {
            return Err(RingError::AllOnes(NIC_RING_HEAD));
        }
        if head0 != tail0 {
            return Err(RingError::Busy { head: head0, tail: tail0 });
        }
        let (mut head, mut tail) = (head0, tail0);
        let (mut next, mut failure, mut idle) = (0usize, None, 0u32);
        let started = Instant::now();
        loop {
            let before = tail;
            while failure.is_none() && next < pieces.len() && tail.wrapping_sub(head) < self.size {
                self.post(tail, &pieces[next]);
                tail = tail.wrapping_add(1);
                next += 1;
            }
            if tail != before {
                // The descriptors are in memory before the device hears of them.
                fence(Ordering::SeqCst);
                write(self.regs, NIC_RING_TAIL, tail);
            }
            if head == tail {
                return Ok(Outcome { elapsed: started.elapsed(), posted: next, failure });
            }
            let now = self.read(NIC_RING_HEAD);
            if now.wrapping_sub(head) > tail.wrapping_sub(head) {
                return Err(match self.read(NIC_ENGINE) {
                    u32::MAX => RingError::AllOnes(NIC_RING_HEAD),
                    _ => RingError::HeadPastTail { head, now, tail },
                });
            }
            let moved = now != head;
            fence(Ordering::SeqCst);
            while head != now {
                let status = self.mem.read32(slot_offset(head, self.size) + DESC_STATUS as usize);
                if status != STATUS_OK && failure.is_none() {
                    failure = Some((head.wrapping_sub(head0) as usize, status));
                }
                head = head.wrapping_add(1);
            }
            if moved {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if self.read(NIC_ENGINE) == ENGINE_BROKEN {
                return Err(RingError::Broken(self.base));
            }
            if started.elapsed() >= timeout {
                write(self.regs, NIC_RING_SIZE, 0);
                return Err(RingError::Timeout {
                    ms: started.elapsed().as_millis(),
                    head,
                    tail,
                    done: head.wrapping_sub(head0) as usize,
                    total: pieces.len(),
                });
            }
            if idle > SPIN_POLLS {
                std::thread::sleep(POLL_SLEEP);
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl<R: Mmio, M: Mmio> Drop for Ring<'_, R, M> {
    fn drop(&mut self) {
        write(self.regs, NIC_RING_SIZE, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::{phys, FakeDevice, Window};
    use super::*;

    const RING: u64 = 0x10_0000;
    const RAM: u64 = 0x20_0000;

    fn nic() -> (FakeDevice, Window) {
        let phys = phys(&[(RING, 4096), (RAM, 8192)]);
        (FakeDevice::nic_on(phys.clone()), Window { phys, base: RING, pages: vec![] })
    }

    fn pieces(n: u64) -> Vec<Piece> {
        (0..n).map(|i| Piece { src: RAM + i * 64, dst: RAM + 4096 + i * 64, len: 64 }).collect()
    }

    #[test]
    fn test_ring_indices_wrap() {
        assert_eq!(slot_offset(0, 128), 0);
        assert_eq!(slot_offset(129, 128), 32);
        assert_eq!(slot_offset(u32::MAX, 128), 127 * 32);
        // An engine whose head and tail stand just below 2^32.
        let (mut dev, mut mem) = nic();
        dev.ring = (RING, 4, u32::MAX - 5, u32::MAX - 5);
        let mut ring = Ring { regs: &mut dev, mem: &mut mem, base: RING, size: 4 };
        let out = ring.transfer(&pieces(10), Duration::from_secs(1)).unwrap();
        assert_eq!((out.posted, out.failure), (10, None));
        drop(ring);
        assert_eq!(dev.seen.len(), 10);
        assert_eq!(dev.counters, (10, 0, 640));
    }

    #[test]
    fn test_a_failure_stops_posting_and_is_reported_by_place() {
        let (mut dev, mut mem) = nic();
        dev.unreachable = vec![(RAM + 4096 + 3 * 64, 64)];
        let mut ring = Ring::attach(&mut dev, &mut mem, RING, 4).unwrap();
        let out = ring.transfer(&pieces(20), Duration::from_secs(1)).unwrap();
        assert_eq!(out.failure, Some((3, STATUS_UNMAPPED)));
        assert!(out.posted < 20, "posting stopped after the failure ({} posted)", out.posted);
        assert_eq!(
            ring.counters(),
            Counters { completed: out.posted as u32 - 1, failed: 1, bytes: (out.posted as u64 - 1) * 64 }
        );
        // The ring is idle again and takes the next transfer.
        let out = ring.transfer(&pieces(2), Duration::from_secs(1)).unwrap();
        assert_eq!(out.failure, None);
        drop(ring);
        dev.bus_master = false;
        let mut ring = Ring::attach(&mut dev, &mut mem, RING, 4).unwrap();
        let out = ring.transfer(&pieces(1), Duration::from_secs(1)).unwrap();
        assert_eq!(out.failure, Some((0, STATUS_NO_BUS_MASTER)));
        assert_eq!(status_name(STATUS_NO_BUS_MASTER), "no bus master");
        assert_eq!(status_name(9), "unknown status 9");
    }

    #[test]
    fn test_ring_errors() {
        let (mut dev, mut mem) = nic();
        assert_eq!(Ring::attach(&mut dev, &mut mem, RING, 3).err(), Some(RingError::Size(3)));
        assert_eq!(Ring::attach(&mut dev, &mut mem, RING, 8192).err(), Some(RingError::Size(8192)));
        dev.gone = true;
        assert_eq!(Ring::attach(&mut dev, &mut mem, RING, 8).err(), Some(RingError::AllOnes(NIC_RING_BASE_LO)));
        dev.gone = false;

        dev.stuck = true;
        let mut ring = Ring::attach(&mut dev, &mut mem, RING, 8).unwrap();
        let e = ring.transfer(&pieces(1), Duration::from_millis(30)).unwrap_err();
        assert!(matches!(e, RingError::Timeout { head: 0, tail: 1, done: 0, total: 1, .. }), "{e:?}");
        drop(ring);
        assert_eq!(dev.ring.1, 0, "a timeout stops the engine");

        dev.ring = (RING, 8, 1, 2);
        let mut ring = Ring { regs: &mut dev, mem: &mut mem, base: RING, size: 8 };
        assert_eq!(ring.transfer(&pieces(1), Duration::from_secs(1)), Err(RingError::Busy { head: 1, tail: 2 }));
        drop(ring);
        dev.stuck = false;

        // A ring the device cannot read breaks the engine.
        let mut ring = Ring::attach(&mut dev, &mut mem, 0x7000_0000, 8).unwrap();
        assert_eq!(ring.transfer(&pieces(1), Duration::from_secs(1)), Err(RingError::Broken(0x7000_0000)));
    }
}
