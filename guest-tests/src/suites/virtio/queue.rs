//! The split virtqueue (virtio 1.x, 2.7) as the suite lays it out in one page: descriptor
//! table, available ring and used ring; the descriptors of the chaos cases, malformed on
//! purpose; and the good frame.

use crate::packet::ETHERTYPE;

/// Bytes of one descriptor (`le64 addr, le32 len, le16 flags, le16 next`).
pub const DESC_SIZE: usize = 16;
/// The descriptor continues in `next`.
pub const DESC_F_NEXT: u16 = 1;
/// Alignment the spec requires of the descriptor table, the available and the used ring.
pub const DESC_ALIGN: usize = 16;
/// Alignment of the available ring.
pub const AVAIL_ALIGN: usize = 2;
/// Alignment of the used ring.
pub const USED_ALIGN: usize = 4;
/// The largest queue the suite sets up: all three parts then fit in one 4 KiB page.
pub const MAX_QUEUE: u16 = 64;
/// The smallest: the cases use descriptors 0 to 4.
pub const MIN_QUEUE: u16 = 8;
/// `struct virtio_net_hdr` with VERSION_1 (num_buffers included).
pub const NET_HDR_LEN: usize = 12;
/// The shortest Ethernet frame without its FCS.
pub const MIN_FRAME: usize = 60;

/// Where the three parts of a split virtqueue of `size` entries lie, from offset 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    /// Entries (a power of two).
    pub size: u16,
    /// Descriptor table (`16 * size` bytes).
    pub desc: usize,
    /// Available ring: flags, idx, `ring[size]`, used_event.
    pub avail: usize,
    /// Used ring: flags, idx, `ring[size]` of (id, len), avail_event.
    pub used: usize,
    /// Bytes from offset 0 to the end of the used ring.
    pub len: usize,
}

fn align_up(x: usize, align: usize) -> usize {
    x.div_ceil(align) * align
}

impl RingLayout {
    /// The parts back to back, each at its required alignment.
    pub fn new(size: u16) -> RingLayout {
        let n = usize::from(size);
        // The table starts the page; its alignment holds trivially, stated for the reader.
        let desc = align_up(0, DESC_ALIGN);
        let avail = align_up(desc + DESC_SIZE * n, AVAIL_ALIGN);
        let used = align_up(avail + 6 + 2 * n, USED_ALIGN);
        RingLayout { size, desc, avail, used, len: used + 6 + 8 * n }
    }

    /// Descriptor `i` (taken modulo the size).
    pub fn desc_at(&self, i: u16) -> usize {
        self.desc + DESC_SIZE * usize::from(i % self.size.max(1))
    }

    /// The available ring's `idx`.
    pub fn avail_idx(&self) -> usize {
        self.avail + 2
    }

    /// The available ring's entry for free-running index `idx`.
    pub fn avail_entry(&self, idx: u16) -> usize {
        self.avail + 4 + 2 * usize::from(idx % self.size.max(1))
    }

    /// The used ring's `idx`.
    pub fn used_idx(&self) -> usize {
        self.used + 2
    }

    /// The used ring's element (`le32 id, le32 len`) for free-running index `idx`.
    pub fn used_entry(&self, idx: u16) -> usize {
        self.used + 4 + 8 * usize::from(idx % self.size.max(1))
    }
}

/// The queue size to ask for when the device offers at most `max`: the largest power of two
/// up to [`MAX_QUEUE`]; `None` when that is below [`MIN_QUEUE`] (0: the queue does not exist).
pub fn choose_queue_size(max: u16) -> Option<u16> {
    let size = 1u16 << max.min(MAX_QUEUE).checked_ilog2()?;
    (size >= MIN_QUEUE).then_some(size)
}

/// One descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Guest-physical address of the buffer.
    pub addr: u64,
    /// Its length.
    pub len: u32,
    /// `DESC_F_*`.
    pub flags: u16,
    /// The next descriptor when `DESC_F_NEXT` is set.
    pub next: u16,
}

/// What one chaos case does to the transmit queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Case {
    /// A buffer far beyond guest RAM.
    BadAddress,
    /// Two descriptors that point at each other.
    LoopingChain,
    /// A buffer larger than any frame.
    Oversized,
    /// The available index moved by more than the queue size.
    AvailJump,
    /// A well-formed broadcast frame.
    GoodFrame,
}

/// An address no guest RAM reaches (256 TiB less a page).
pub const BAD_ADDRESS: u64 = 0xffff_ffff_f000;
/// 1 MiB and a page: far over any frame (9000 MTU here; a virtio-net device carries 64 KiB
/// at most).
pub const OVERSIZED_LEN: u32 = (1 << 20) + 4096;
/// Descriptor slots: the good frame, the bad address, the loop (two), the oversized buffer.
const GOOD_HEAD: u16 = 0;
const BAD_ADDRESS_HEAD: u16 = 1;
const LOOP_HEAD: u16 = 2;
const OVERSIZED_HEAD: u16 = 4;

impl Case {
    /// Every case, in the order the suite runs them: the malformed ones, then a good frame.
    pub const ALL: [Case; 5] =
        [Case::BadAddress, Case::LoopingChain, Case::Oversized, Case::AvailJump, Case::GoodFrame];

    /// The test's name (after the function's).
    pub fn name(self) -> &'static str {
        match self {
            Case::BadAddress => "bad_address",
            Case::LoopingChain => "looping_chain",
            Case::Oversized => "oversized_length",
            Case::AvailJump => "avail_idx_jump",
            Case::GoodFrame => "good_frame",
        }
    }

    /// What the case posts, in words.
    pub fn what(self) -> String {
        match self {
            Case::BadAddress => format!("one descriptor at {BAD_ADDRESS:#x}, beyond guest RAM"),
            Case::LoopingChain => format!("descriptors {LOOP_HEAD} and {} chained to each other", LOOP_HEAD + 1),
            Case::Oversized => format!("one descriptor of {OVERSIZED_LEN} bytes"),
            Case::AvailJump => "the available index moved by the queue size + 1".into(),
            Case::GoodFrame => format!("a {MIN_FRAME}-byte broadcast frame behind a {NET_HDR_LEN}-byte virtio_net_hdr"),
        }
    }

    /// Whether the case is malformed on purpose.
    pub fn malformed(self) -> bool {
        self != Case::GoodFrame
    }

    /// The head descriptor the case makes available.
    pub fn head(self) -> u16 {
        match self {
            Case::BadAddress => BAD_ADDRESS_HEAD,
            Case::LoopingChain => LOOP_HEAD,
            Case::Oversized => OVERSIZED_HEAD,
            Case::AvailJump | Case::GoodFrame => GOOD_HEAD,
        }
    }

    /// The descriptors the case needs, by slot, given the good frame's address and length.
    /// The available-index case posts good descriptors: only the index is wrong.
    pub fn descriptors(self, frame: u64, frame_len: u32) -> Vec<(u16, Desc)> {
        let plain = |addr, len| Desc { addr, len, flags: 0, next: 0 };
        match self {
            Case::BadAddress => vec![(BAD_ADDRESS_HEAD, plain(BAD_ADDRESS, frame_len))],
            Case::LoopingChain => vec![
                (LOOP_HEAD, Desc { addr: frame, len: frame_len, flags: DESC_F_NEXT, next: LOOP_HEAD + 1 }),
                (LOOP_HEAD + 1, Desc { addr: frame, len: frame_len, flags: DESC_F_NEXT, next: LOOP_HEAD }),
            ],
            Case::Oversized => vec![(OVERSIZED_HEAD, plain(frame, OVERSIZED_LEN))],
            Case::AvailJump | Case::GoodFrame => vec![(GOOD_HEAD, plain(frame, frame_len))],
        }
    }
}

/// What a transmit buffer holds: a zero `virtio_net_hdr` (no offloads) and a broadcast frame
/// from `mac` with the private EtherType and a payload naming the suite, padded to the
/// shortest frame.
pub fn good_frame(mac: [u8; 6]) -> Vec<u8> {
    let mut b = vec![0u8; NET_HDR_LEN];
    b.extend_from_slice(&[0xff; 6]);
    b.extend_from_slice(&mac);
    b.extend_from_slice(&ETHERTYPE.to_be_bytes());
    b.extend_from_slice(b"gdrvm virtio chaos: good frame");
    b.resize(NET_HDR_LEN + MIN_FRAME, 0);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ring_layout_arithmetic() {
        let l = RingLayout::new(16);
        assert_eq!((l.desc, l.avail, l.used, l.len), (0, 256, 296, 302 + 128));
        assert_eq!((l.avail_idx(), l.avail_entry(0), l.avail_entry(15), l.avail_entry(16)), (258, 260, 290, 260));
        assert_eq!((l.used_idx(), l.used_entry(0), l.used_entry(17)), (298, 300, 308));
        assert_eq!((l.desc_at(3), l.desc_at(19)), (48, 48));
        // Free-running indices wrap at 2^16, which a power-of-two size divides.
        assert_eq!(l.avail_entry(u16::MAX), l.avail_entry(15));
        assert_eq!(l.used_entry(u16::MAX.wrapping_add(1)), l.used_entry(0));

        for size in [1u16, 2, 8, 16, 32, 64, 128, 256, 1024, 32768] {
            let l = RingLayout::new(size);
            let n = usize::from(size);
            assert_eq!(l.desc % DESC_ALIGN, 0);
            assert_eq!(l.avail % AVAIL_ALIGN, 0);
            assert_eq!(l.used % USED_ALIGN, 0);
            // Back to back, never overlapping: flags + idx + ring + event.
            assert!(l.avail >= l.desc + 16 * n, "{size}");
            assert!(l.used >= l.avail + 4 + 2 * n + 2, "{size}");
            assert!(l.used - (l.avail + 6 + 2 * n) < USED_ALIGN, "no more padding than alignment needs");
            assert_eq!(l.len, l.used + 4 + 8 * n + 2);
            assert!(l.avail_entry(size - 1) + 2 <= l.used && l.used_entry(size - 1) + 8 <= l.len);
        }
        // An odd size needs padding before the used ring.
        let l = RingLayout::new(3);
        assert_eq!((l.avail, l.used), (48, 60));
        assert_eq!(RingLayout::new(MAX_QUEUE).len, 1024 + 136 + 518);
        assert!(RingLayout::new(MAX_QUEUE).len <= 4096, "the largest queue fits in one page");
        assert!(RingLayout::new(MAX_QUEUE * 4).len > 4096);
    }

    #[test]
    fn test_queue_size_choice() {
        assert_eq!(choose_queue_size(0), None);
        assert_eq!(choose_queue_size(4), None, "too small for the cases");
        assert_eq!(choose_queue_size(8), Some(8));
        assert_eq!(choose_queue_size(12), Some(8));
        assert_eq!(choose_queue_size(256), Some(MAX_QUEUE));
        assert_eq!(choose_queue_size(u16::MAX), Some(MAX_QUEUE));
    }

    #[test]
    fn test_malformed_chains() {
        let (frame, len) = (0x1234_5000, 72);
        let descs = |c: Case| c.descriptors(frame, len);
        let bad = descs(Case::BadAddress);
        assert_eq!(bad, [(1, Desc { addr: 0xffff_ffff_f000, len: 72, flags: 0, next: 0 })]);
        // The loop: each is a NEXT descriptor naming the other; following it never ends.
        let lp = descs(Case::LoopingChain);
        assert_eq!(lp.len(), 2);
        assert_eq!(lp[0].0, Case::LoopingChain.head());
        let next_of = |slot: u16| lp.iter().find(|(s, _)| *s == slot).map(|(_, d)| d).unwrap();
        let mut at = Case::LoopingChain.head();
        for _ in 0..10 {
            let d = next_of(at);
            assert_eq!(d.flags & DESC_F_NEXT, DESC_F_NEXT);
            assert_eq!((d.addr, d.len), (frame, len));
            assert_ne!(d.next, at);
            at = d.next;
        }
        assert_eq!(at, Case::LoopingChain.head());
        let big = descs(Case::Oversized);
        assert_eq!(big, [(4, Desc { addr: frame, len: (1 << 20) + 4096, flags: 0, next: 0 })]);
        assert!(big[0].1.len as usize > 9000 + 18 + NET_HDR_LEN);
        // Every case's head is its first descriptor; no two cases share a slot.
        let mut slots = std::collections::BTreeSet::new();
        for c in Case::ALL {
            let d = descs(c);
            assert_eq!(d[0].0, c.head(), "{c:?}");
            assert!(d.iter().all(|(s, _)| *s < MIN_QUEUE));
            if c != Case::AvailJump {
                assert!(d.iter().all(|(s, _)| slots.insert(*s)), "{c:?} reuses a slot");
            }
        }
        // The available-index case posts the good descriptor: only the index is wrong.
        assert_eq!(descs(Case::AvailJump), descs(Case::GoodFrame));
        assert_eq!(Case::ALL.iter().filter(|c| c.malformed()).count(), 4);
        assert_eq!(Case::ALL.map(Case::name)[3], "avail_idx_jump");
    }

    #[test]
    fn test_good_frame() {
        let mac = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
        let f = good_frame(mac);
        assert_eq!(f.len(), 72);
        assert_eq!(f[..NET_HDR_LEN], [0; 12], "no offloads, num_buffers 0");
        assert_eq!(f[12..18], [0xff; 6]);
        assert_eq!(f[18..24], mac);
        assert_eq!(f[24..26], [0x88, 0xb5]);
        assert!(f[26..].starts_with(b"gdrvm virtio chaos"));
    }
}
