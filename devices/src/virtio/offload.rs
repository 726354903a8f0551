//! What virtio-net's offloads mean at each end of a wire. The header a guest writes before
//! each transmitted frame (`virtio_net_hdr_v1`) travels with the frame ([`crate::net`]);
//! the sending device only checks it against what its guest negotiated ([`outgoing`]:
//! what was not negotiated is ignored, as a device always has),
//! and the receiving device turns it into what its own guest accepted ([`incoming`]):
//!
//! | on the wire | receiver accepted | the guest gets |
//! |---|---|---|
//! | TCP GSO frame (`gso_type`, NEEDS_CSUM) | `GUEST_TSO4`/`6` | the frame whole, the header as sent |
//! | TCP GSO frame | not that | MSS-sized segments, checksums complete ([`super::gso`]); DATA_VALID with `GUEST_CSUM` |
//! | NEEDS_CSUM | `GUEST_CSUM` | the frame as sent, NEEDS_CSUM (the checksum is never on the wire) |
//! | NEEDS_CSUM | not that | the checksum completed by the device, flags 0 |
//! | no flags | `GUEST_CSUM` | DATA_VALID when the device verified the checksum |
//! | no flags | not that | flags 0 |
//!
//! So a checksum is computed once at most, by the device of a guest that cannot leave it,
//! and a TCP stream between two Linux guests crosses in 64 KiB frames.

use super::csum;
use super::gso::{self, GSO_ECN, GSO_TCPV4, GSO_TCPV6};
use crate::net::OFFLOAD_LEN;

/// `flags`: the checksum from `csum_start` to the end is left to be completed, its field
/// at `csum_start + csum_offset`.
pub const F_NEEDS_CSUM: u8 = 1;
/// `flags` (receive): the device verified the checksum.
pub const F_DATA_VALID: u8 = 2;
/// `gso_type` of a frame that needs no segmentation.
pub const GSO_NONE: u8 = 0;

/// Byte offsets of the header's fields.
const FLAGS: usize = 0;
const GSO_TYPE: usize = 1;
const HDR_LEN: usize = 2;
const GSO_SIZE: usize = 4;
const CSUM_START: usize = 6;
const CSUM_OFFSET: usize = 8;
const NUM_BUFFERS: usize = 10;

fn le16(h: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([h[at], h[at + 1]])
}

fn set_le16(h: &mut [u8], at: usize, v: u16) {
    h[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

/// What one end of a device negotiated that bears on headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accepted {
    /// `VIRTIO_NET_F_CSUM` (transmit) or `VIRTIO_NET_F_GUEST_CSUM` (receive).
    pub csum: bool,
    /// `HOST_TSO4` (transmit) or `GUEST_TSO4` (receive).
    pub tso4: bool,
    /// `HOST_TSO6` (transmit) or `GUEST_TSO6` (receive).
    pub tso6: bool,
}

impl Accepted {
    fn tso(self, gso_type: u8) -> bool {
        match gso_type {
            GSO_TCPV4 => self.tso4,
            GSO_TCPV6 => self.tso6,
            _ => false,
        }
    }
}

/// Why a transmit header cannot go on the wire (the chain is dropped as malformed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadHeader {
    /// NEEDS_CSUM whose field lies (partly) outside the frame.
    ChecksumOutside,
    /// A segmentation request the driver did not negotiate, of a type not offered (UDP,
    /// ECN), without NEEDS_CSUM, or with `gso_size` 0.
    Segmentation,
}

/// Checks and tidies the transmit header `header` of a `frame_len`-byte frame for the wire:
/// what the driver did not negotiate is cleared (a NEEDS_CSUM without CSUM is ignored, as
/// the device always has), `num_buffers` and the receive-only flags zeroed.
pub fn outgoing(header: &mut [u8], frame_len: usize, tx: Accepted) -> Result<(), BadHeader> {
    let mut flags = header[FLAGS] & F_NEEDS_CSUM;
    if !tx.csum {
        flags = 0;
    }
    if flags & F_NEEDS_CSUM != 0 {
        let (start, offset) = (usize::from(le16(header, CSUM_START)), usize::from(le16(header, CSUM_OFFSET)));
        if start + offset + 2 > frame_len {
            return Err(BadHeader::ChecksumOutside);
        }
    } else {
        set_le16(header, CSUM_START, 0);
        set_le16(header, CSUM_OFFSET, 0);
    }
    // Without TSO the field is ignored, as NEEDS_CSUM is without CSUM.
    let gso_type = if tx.tso4 || tx.tso6 { header[GSO_TYPE] } else { GSO_NONE };
    if gso_type == GSO_NONE {
        header[GSO_TYPE] = GSO_NONE;
        set_le16(header, GSO_SIZE, 0);
        set_le16(header, HDR_LEN, 0);
    } else if gso_type & GSO_ECN != 0 || !tx.tso(gso_type) || flags & F_NEEDS_CSUM == 0 || le16(header, GSO_SIZE) == 0 {
        return Err(BadHeader::Segmentation);
    }
    header[FLAGS] = flags;
    set_le16(header, NUM_BUFFERS, 0);
    Ok(())
}

/// What became of a received packet.
#[derive(Debug, PartialEq, Eq)]
pub enum Incoming {
    /// Deliver the packet as it now stands (header rewritten for this guest, frame as
    /// received or with its checksum completed).
    Deliver,
    /// Deliver these packets (header and frame each) instead: the GSO frame in segments.
    Segments(Vec<Vec<u8>>),
    /// Drop it: its header cannot be honoured (a checksum outside the frame, a GSO frame
    /// that is not TCP).
    Drop(&'static str),
}

/// Rewrites received `packet` (header, then frame) for a guest that accepted `rx`;
/// `num_buffers` is set to 1 (MRG_RXBUF rewrites it).
pub fn incoming(packet: &mut [u8], rx: Accepted) -> Incoming {
    let (header, frame) = packet.split_at_mut(OFFLOAD_LEN);
    let flags = header[FLAGS] & F_NEEDS_CSUM;
    let gso_type = header[GSO_TYPE];
    let (start, offset) = (usize::from(le16(header, CSUM_START)), usize::from(le16(header, CSUM_OFFSET)));
    if flags != 0 && start + offset + 2 > frame.len() {
        return Incoming::Drop("received frame asking for a checksum outside itself dropped");
    }
    if gso_type != GSO_NONE {
        if rx.csum && rx.tso(gso_type) && flags != 0 {
            header[FLAGS] = F_NEEDS_CSUM;
            set_le16(header, NUM_BUFFERS, 1);
            return Incoming::Deliver;
        }
        let mut segments = Vec::new();
        let done = gso::segment(frame, gso_type, le16(header, GSO_SIZE), |s| {
            let mut p = vec![0u8; OFFLOAD_LEN + s.len()];
            p[FLAGS] = if rx.csum { F_DATA_VALID } else { 0 };
            set_le16(&mut p, NUM_BUFFERS, 1);
            p[OFFLOAD_LEN..].copy_from_slice(s);
            segments.push(p);
        });
        return match done {
            Ok(()) => Incoming::Segments(segments),
            Err(_) => Incoming::Drop("received segmentation frame that is not TCP, or with a bad gso_size, dropped"),
        };
    }
    let verified = if flags != 0 && rx.csum {
        // Passed on: the guest takes it as checksummed (CHECKSUM_PARTIAL).
        header.fill(0);
        header[FLAGS] = F_NEEDS_CSUM;
        set_le16(header, CSUM_START, start as u16);
        set_le16(header, CSUM_OFFSET, offset as u16);
        set_le16(header, NUM_BUFFERS, 1);
        return Incoming::Deliver;
    } else if flags != 0 {
        // Checked above to fit.
        csum::complete(frame, start, offset).is_ok() && rx.csum
    } else {
        rx.csum && csum::verify(frame) == csum::Verdict::Valid
    };
    header.fill(0);
    if verified {
        header[FLAGS] = F_DATA_VALID;
    }
    set_le16(header, NUM_BUFFERS, 1);
    Incoming::Deliver
}

/// A header for a frame that asks nothing of the receiver (what a port test or a peer
/// without offloads sends).
pub fn plain_header() -> [u8; OFFLOAD_LEN] {
    [0; OFFLOAD_LEN]
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Accepted = Accepted { csum: true, tso4: true, tso6: true };
    const NONE: Accepted = Accepted { csum: false, tso4: false, tso6: false };
    const CSUM_ONLY: Accepted = Accepted { csum: true, tso4: false, tso6: false };

    /// A UDP/IPv4 frame with `payload`, its checksum field holding `check`.
    fn udp4(payload: &[u8], check: u16) -> Vec<u8> {
        let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00];
        let total = (28 + payload.len()) as u16;
        f.extend_from_slice(&[0x45, 0]);
        f.extend_from_slice(&total.to_be_bytes());
        f.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]);
        f.extend_from_slice(&[0x12, 0x34, 0x56, 0x78]);
        f.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        f.extend_from_slice(&check.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The partial checksum Linux leaves for NEEDS_CSUM: the pseudo-header's sum.
    fn partial_udp4(payload: &[u8]) -> Vec<u8> {
        let f = udp4(payload, 0);
        let len = (8 + payload.len()) as u16;
        let mut pseudo = f[26..34].to_vec();
        pseudo.extend_from_slice(&[0, 17]);
        pseudo.extend_from_slice(&len.to_be_bytes());
        udp4(payload, csum::fold(csum::add(0, &pseudo)))
    }

    fn needs_csum(start: u16, offset: u16) -> [u8; OFFLOAD_LEN] {
        let mut h = plain_header();
        h[FLAGS] = F_NEEDS_CSUM;
        set_le16(&mut h, CSUM_START, start);
        set_le16(&mut h, CSUM_OFFSET, offset);
        h
    }

    fn packet(header: &[u8], frame: &[u8]) -> Vec<u8> {
        [header, frame].concat()
    }

    #[test]
    fn test_outgoing_keeps_what_was_negotiated_and_refuses_the_rest() {
        let frame = partial_udp4(b"hello");
        let mut h = needs_csum(34, 6);
        h[NUM_BUFFERS] = 9;
        outgoing(&mut h, frame.len(), CSUM_ONLY).unwrap();
        assert_eq!(h, needs_csum(34, 6), "NEEDS_CSUM kept, num_buffers zeroed");
        let mut h = needs_csum(34, 6);
        outgoing(&mut h, frame.len(), NONE).unwrap();
        assert_eq!(h, plain_header(), "NEEDS_CSUM without CSUM is ignored");
        let mut outside = needs_csum(frame.len() as u16 - 1, 0);
        assert_eq!(outgoing(&mut outside, frame.len(), CSUM_ONLY), Err(BadHeader::ChecksumOutside));
        let gso = |t: u8, size: u16, flags: u8| {
            let mut h = needs_csum(34, 16);
            h[FLAGS] = flags;
            h[GSO_TYPE] = t;
            set_le16(&mut h, GSO_SIZE, size);
            h
        };
        assert_eq!(outgoing(&mut gso(GSO_TCPV4, 1448, F_NEEDS_CSUM), 9000, ALL), Ok(()));
        let v6_only = Accepted { tso4: false, ..ALL };
        assert_eq!(outgoing(&mut gso(GSO_TCPV4, 1448, F_NEEDS_CSUM), 9000, v6_only), Err(BadHeader::Segmentation));
        // Without TSO at all the field is ignored, as NEEDS_CSUM is without CSUM.
        let mut ignored = gso(GSO_TCPV4, 1448, F_NEEDS_CSUM);
        assert_eq!(outgoing(&mut ignored, 9000, CSUM_ONLY), Ok(()));
        assert_eq!(ignored, needs_csum(34, 16));
        assert_eq!(outgoing(&mut gso(GSO_TCPV6, 0, F_NEEDS_CSUM), 9000, ALL), Err(BadHeader::Segmentation));
        assert_eq!(outgoing(&mut gso(GSO_TCPV4, 1448, 0), 9000, ALL), Err(BadHeader::Segmentation));
        assert_eq!(outgoing(&mut gso(GSO_TCPV4 | GSO_ECN, 1448, 1), 9000, ALL), Err(BadHeader::Segmentation));
        assert_eq!(outgoing(&mut gso(3, 1448, F_NEEDS_CSUM), 9000, ALL), Err(BadHeader::Segmentation), "UDP");
    }

    #[test]
    fn test_incoming_checksums_are_passed_on_completed_or_verified() {
        let partial = partial_udp4(b"checksum me");
        let h = needs_csum(34, 6);
        // A guest with GUEST_CSUM takes the partial checksum as it is.
        let mut p = packet(&h, &partial);
        assert_eq!(incoming(&mut p, CSUM_ONLY), Incoming::Deliver);
        assert_eq!(&p[OFFLOAD_LEN..], &partial[..]);
        assert_eq!(p[FLAGS], F_NEEDS_CSUM);
        assert_eq!(le16(&p, NUM_BUFFERS), 1);
        // One without gets it completed.
        let mut p = packet(&h, &partial);
        assert_eq!(incoming(&mut p, NONE), Incoming::Deliver);
        assert_eq!(csum::verify(&p[OFFLOAD_LEN..]), csum::Verdict::Valid);
        assert_eq!(&p[..OFFLOAD_LEN], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
        // A frame with its checksum computed: verified for GUEST_CSUM, left alone otherwise.
        let mut done = p[OFFLOAD_LEN..].to_vec();
        let mut q = packet(&plain_header(), &done);
        assert_eq!(incoming(&mut q, CSUM_ONLY), Incoming::Deliver);
        assert_eq!(q[FLAGS], F_DATA_VALID);
        done[20] ^= 1;
        let mut bad = packet(&plain_header(), &done);
        assert_eq!(incoming(&mut bad, CSUM_ONLY), Incoming::Deliver);
        assert_eq!(bad[FLAGS], 0, "a wrong checksum is the guest's to find");
        // A header pointing outside the frame: dropped.
        let mut out = packet(&needs_csum(partial.len() as u16, 0), &partial);
        assert!(matches!(incoming(&mut out, CSUM_ONLY), Incoming::Drop(_)));
    }

    #[test]
    fn test_incoming_gso_frames_go_whole_to_tso_guests_and_in_segments_to_others() {
        // A 4000-byte TCP/IPv4 payload at MSS 1000, as the gso module's tests build it.
        let mut frame = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00, 0x45, 0];
        frame.extend_from_slice(&(20u16 + 20 + 4000).to_be_bytes());
        frame.extend_from_slice(&[0, 1, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]);
        frame.extend_from_slice(&[0, 80, 0, 81, 0, 0, 0, 1, 0, 0, 0, 1, 0x50, 0x18, 0xff, 0xff, 0, 0, 0, 0]);
        frame.extend((0..4000u32).map(|i| i as u8));
        let mut h = needs_csum(34, 16);
        h[GSO_TYPE] = GSO_TCPV4;
        set_le16(&mut h, GSO_SIZE, 1000);
        let mut whole = packet(&h, &frame);
        assert_eq!(incoming(&mut whole, ALL), Incoming::Deliver);
        assert_eq!((whole[GSO_TYPE], le16(&whole, GSO_SIZE), le16(&whole, NUM_BUFFERS)), (GSO_TCPV4, 1000, 1));
        // No TSO, no offload at all, TSO for IPv6 only: segments.
        let v6_only = Accepted { csum: true, tso4: false, tso6: true };
        for (rx, flags) in [(CSUM_ONLY, F_DATA_VALID), (NONE, 0), (v6_only, F_DATA_VALID)] {
            let Incoming::Segments(segs) = incoming(&mut packet(&h, &frame), rx) else { panic!("{rx:?}") };
            assert_eq!(segs.len(), 4, "{rx:?}");
            for s in &segs {
                assert_eq!(&s[..OFFLOAD_LEN], &[flags, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]);
                assert_eq!(csum::verify(&s[OFFLOAD_LEN..]), csum::Verdict::Valid);
                assert_eq!(s.len(), OFFLOAD_LEN + 54 + 1000);
            }
        }
        let mut not_tcp = frame.clone();
        not_tcp[23] = 17;
        assert!(matches!(incoming(&mut packet(&h, &not_tcp), CSUM_ONLY), Incoming::Drop(_)));
    }
}
