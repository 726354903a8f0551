//! The bytes each side writes or exposes for reading: a function of the size, the side, the
//! operation and the owner's PSN (random per run), so data from another run, another size or
//! the other direction never passes for the right data.

use crate::wire::Side;

/// Which operation a buffer's pattern is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// The bytes a side RDMA-WRITEs into its peer's buffer.
    Write,
    /// The bytes a side exposes for its peer to RDMA-READ.
    Read,
}

/// The seed of the pattern `side` (whose PSN is `psn`) uses for `op` at `size`.
pub fn seed(size: u64, side: Side, op: Op, psn: u32) -> u64 {
    let side = match side {
        Side::Server => 1u64,
        Side::Client => 2,
    };
    let op = match op {
        Op::Write => 1u64,
        Op::Read => 2,
    };
    splitmix(size ^ (side << 56) ^ (op << 60) ^ (u64::from(psn) << 24))
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern of `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    for (i, chunk) in buf.chunks_mut(8).enumerate() {
        let word = splitmix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)).to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
}

/// The byte at `offset` of the pattern of `seed`.
#[cfg(test)]
fn byte_at(seed: u64, offset: usize) -> u8 {
    let word = splitmix(seed ^ ((offset / 8) as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)).to_le_bytes();
    word[offset % 8]
}

/// Checks `buf` against the pattern of `seed`; on a mismatch, says how many bytes differ,
/// the first one, and whether nothing arrived at all (all zeros).
pub fn verify(buf: &[u8], seed: u64) -> Result<(), String> {
    let mut first = None;
    let mut differ = 0usize;
    for (i, chunk) in buf.chunks(8).enumerate() {
        let word = splitmix(seed ^ (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d)).to_le_bytes();
        if chunk != &word[..chunk.len()] {
            for (j, (&got, &want)) in chunk.iter().zip(&word).enumerate() {
                if got != want {
                    differ += 1;
                    first.get_or_insert((i * 8 + j, want, got));
                }
            }
        }
    }
    let Some((at, want, got)) = first else { return Ok(()) };
    let zeros = if buf.iter().all(|&b| b == 0) { " (the buffer is all zeros: nothing arrived)" } else { "" };
    Err(format!(
        "{differ} of {} bytes differ, the first at offset {at}: expected {want:#04x}, found {got:#04x}{zeros}",
        buf.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_fill_then_verify() {
        for size in [1usize, 7, 8, 4096, 65536 + 3] {
            let s = seed(size as u64, Side::Client, Op::Write, 0x12_3456);
            let mut buf = vec![0u8; size];
            fill(&mut buf, s);
            assert_eq!(verify(&buf, s), Ok(()));
            assert_eq!(buf[size - 1], byte_at(s, size - 1));
        }
    }

    #[test]
    fn test_patterns_differ_by_size_side_op_and_psn() {
        let base = seed(4096, Side::Server, Op::Write, 7);
        let others = [
            seed(65536, Side::Server, Op::Write, 7),
            seed(4096, Side::Client, Op::Write, 7),
            seed(4096, Side::Server, Op::Read, 7),
            seed(4096, Side::Server, Op::Write, 8),
        ];
        let mut a = vec![0u8; 4096];
        fill(&mut a, base);
        for o in others {
            assert_ne!(o, base);
            assert!(verify(&a, o).is_err(), "pattern of seed {o:#x} passed for {base:#x}");
        }
    }

    #[test]
    fn test_mismatch_names_the_first_byte() {
        let s = seed(64, Side::Server, Op::Read, 1);
        let mut buf = vec![0u8; 64];
        fill(&mut buf, s);
        let want = buf[10];
        buf[10] ^= 0xff;
        buf[40] ^= 0x01;
        let err = verify(&buf, s).unwrap_err();
        assert_eq!(
            err,
            format!("2 of 64 bytes differ, the first at offset 10: expected {want:#04x}, found {:#04x}", want ^ 0xff)
        );
        let zeros = verify(&[0u8; 32], s).unwrap_err();
        assert!(zeros.ends_with("(the buffer is all zeros: nothing arrived)"), "{zeros}");
    }
}
