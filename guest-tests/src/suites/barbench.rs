//! Suite `barbench`: how fast the guest reads a passed-through device's memory BAR, next to
//! how fast it reads its own RAM, in the same run. A mapped BAR is reached without exits
//! and should read at a large fraction of RAM speed; a trapped one (`trap_bars = true` on
//! the endpoint) costs an exit per access. Figures only: the check passes when both could
//! be measured; `cargo xtask bench vfio` turns them into ratios.

use std::time::{Duration, Instant};

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::pcidev::{self, MappedBar, Mmio};

/// ivshmem-plain: BAR2 is plain memory on the device's side.
const IVSHMEM: (u16, u16) = (0x1af4, 0x1110);
/// Bytes read per pass.
const SPAN: usize = 4 << 20;
/// How long each measurement reads for (at least one access).
const BUDGET: Duration = Duration::from_secs(2);

/// Reads 8-byte words through `read` over `span` bytes, round and round, for `budget`;
/// returns bytes per second.
pub fn rate(span: usize, budget: Duration, mut read: impl FnMut(usize) -> u64) -> f64 {
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut sink = 0u64;
    let mut at = 0;
    while bytes == 0 || start.elapsed() < budget {
        // A batch between clock reads, so the clock does not dominate a fast path.
        for _ in 0..64 {
            sink = sink.wrapping_add(read(at));
            at = (at + 8) % span.max(8);
            bytes += 8;
        }
    }
    std::hint::black_box(sink);
    bytes as f64 / start.elapsed().as_secs_f64()
}

/// Runs the suite.
pub fn run(ctx: &Context) -> Vec<Check> {
    let name = "bar_read_rate";
    let Some(bdf) = pcidev::find(&ctx.root, IVSHMEM.0, IVSHMEM.1).into_iter().next() else {
        return vec![Check::new(name, Verdict::Fail("no ivshmem (1af4:1110) found".into()))];
    };
    let dir = pcidev::function_dir(&ctx.root, &bdf);
    let mut notes = Vec::new();
    if let Err(e) = pcidev::enable(&dir) {
        return vec![Check::new(name, Verdict::Fail(format!("cannot enable {bdf}: {e}")))];
    }
    let mut bar = match MappedBar::open(&dir.join("resource2")) {
        Ok(bar) => bar,
        Err(e) => return vec![Check::new(name, Verdict::Fail(e))],
    };
    let span = SPAN.min(bar.len());
    let ram: Vec<u64> = (0..span as u64 / 8).collect();
    let ram_rate = rate(span, BUDGET, |at| {
        // SAFETY: `at / 8` < ram.len(): `rate` keeps `at` below `span`.
        unsafe { std::ptr::read_volatile(ram.as_ptr().add(at / 8)) }
    });
    let bar_rate = rate(span, BUDGET, |at| bar.read64(at));
    notes.push(format!("ram_read {:.1} MB/s", ram_rate / 1e6));
    notes.push(format!("bar_read {:.1} MB/s ({bdf} BAR2, {} KiB span)", bar_rate / 1e6, span >> 10));
    notes.push(format!("bar/ram {:.4}", bar_rate / ram_rate));
    vec![Check { diagnostics: notes, ..Check::new(name, Verdict::Pass) }]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_rate_reads_round_and_round_within_the_span() {
        let mut seen = std::collections::BTreeSet::new();
        let r = rate(64, Duration::from_millis(5), |at| {
            seen.insert(at);
            0
        });
        assert!(r > 0.0);
        assert_eq!(seen.into_iter().collect::<Vec<_>>(), [0, 8, 16, 24, 32, 40, 48, 56]);
    }
}
