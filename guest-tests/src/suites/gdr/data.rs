//! Test data for DMA: a pseudo-random pattern of 64-bit words that any word of can be
//! computed alone (so a 64 MiB transfer is filled and checked in place, without a copy of it
//! in memory), written and checked through [`Mmio`] in RAM and BARs alike.

use crate::pcidev::Mmio;

/// Word `index` of the pattern `seed` (splitmix64 of the two).
pub fn word(seed: u64, index: u64) -> u64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Writes `len` bytes (whole words) of pattern `seed` at `at` in `mem`.
pub fn fill<M: Mmio + ?Sized>(mem: &mut M, at: usize, len: usize, seed: u64) {
    for i in 0..len / 8 {
        mem.write64(at + i * 8, word(seed, i as u64));
    }
}

/// Where `len` bytes at `at` are not pattern `seed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// Words that differ.
    pub words: usize,
    /// Words compared.
    pub of: usize,
    /// Byte offset (from `at`) of the first that differs.
    pub first: usize,
    /// What it holds.
    pub got: u64,
    /// What it should hold.
    pub want: u64,
    /// Whether it holds pattern `other` there instead (what was there before).
    pub other: bool,
}

impl std::fmt::Display for Mismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let (words, of, first, got, want) = (self.words, self.of, self.first, self.got, self.want);
        write!(f, "{words} of {of} words differ, first at +{first:#x}: {got:#018x}, expected {want:#018x}")?;
        if self.other {
            f.write_str(" (what was there before)")?;
        } else if got == u64::MAX {
            f.write_str(" (all-ones)")?;
        }
        Ok(())
    }
}

/// Checks that the `len` bytes at `at` in `mem` are pattern `seed`; `other` is the pattern
/// the same bytes held before, to tell "nothing landed" from "something else landed".
pub fn check<M: Mmio + ?Sized>(mem: &mut M, at: usize, len: usize, seed: u64, other: u64) -> Result<(), Mismatch> {
    let mut mismatch: Option<Mismatch> = None;
    for i in 0..len / 8 {
        let got = mem.read64(at + i * 8);
        let want = word(seed, i as u64);
        if got != want {
            let m = mismatch.get_or_insert(Mismatch {
                words: 0,
                of: len / 8,
                first: i * 8,
                got,
                want,
                other: got == word(other, i as u64),
            });
            m.words += 1;
        }
    }
    mismatch.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dma::PinnedBuffer;

    #[test]
    fn test_pattern_words_differ_by_seed_and_place() {
        assert_eq!(word(7, 3), word(7, 3));
        assert_ne!(word(7, 3), word(7, 4));
        assert_ne!(word(7, 3), word(8, 3));
        assert_ne!(word(0, 0), 0);
        let words: std::collections::BTreeSet<u64> = (0..1024).map(|i| word(1, i)).collect();
        assert_eq!(words.len(), 1024);
    }

    #[test]
    fn test_fill_and_check() {
        let mut buf = PinnedBuffer::new(4096).unwrap();
        fill(&mut buf, 64, 1024, 5);
        assert_eq!(check(&mut buf, 64, 1024, 5, 6), Ok(()));
        assert_eq!(buf.read64(56), 0, "nothing before");
        assert_eq!(buf.read64(64 + 1024), 0, "nothing after");

        let e = check(&mut buf, 64, 1024, 6, 5).unwrap_err();
        assert_eq!((e.words, e.of, e.first, e.other), (128, 128, 0, true));
        assert!(e.to_string().ends_with("(what was there before)"), "{e}");

        buf.write64(64 + 80, u64::MAX);
        let e = check(&mut buf, 64, 1024, 5, 6).unwrap_err();
        assert_eq!((e.words, e.first, e.other), (1, 80, false));
        assert_eq!(
            e.to_string(),
            format!(
                "1 of 128 words differ, first at +0x50: 0xffffffffffffffff, expected {:#018x} (all-ones)",
                word(5, 10)
            )
        );
    }
}
