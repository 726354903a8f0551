//! The Internet checksum (RFC 1071) behind virtio-net's two checksum offloads:
//! completing the checksum a driver left to the device (`VIRTIO_NET_F_CSUM`: a transmit
//! header with `VIRTIO_NET_HDR_F_NEEDS_CSUM`, [`complete`]), and verifying a received TCP
//! or UDP segment's checksum, pseudo-header included, before the device tells the driver
//! it is good (`VIRTIO_NET_F_GUEST_CSUM`: `VIRTIO_NET_HDR_F_DATA_VALID`, [`verify`]).
//!
//! Written by hand: no rust-vmm crate offers it (virtio-queue stops at the rings,
//! vm-memory at guest memory, virtio-bindings at constants); Cloud Hypervisor's and
//! Firecracker's versions live inside their own net device crates.
//!
//! [`verify`] is deliberately narrow: it says [`Verdict::Valid`] only for a segment whose
//! checksum it has summed and found right. Anything it does not fully understand (a
//! fragment, IPv6 extension headers, lengths that disagree, a UDP datagram without a
//! checksum) is [`Verdict::Unchecked`], and the guest verifies it itself.

/// EtherType of IPv4.
const ETH_P_IP: u16 = 0x0800;
/// EtherType of IPv6.
const ETH_P_IPV6: u16 = 0x86dd;
/// EtherType of an 802.1Q VLAN tag.
const ETH_P_8021Q: u16 = 0x8100;
/// Bytes of an Ethernet header without a VLAN tag.
const ETH_HLEN: usize = 14;
/// IP protocol number of TCP.
const IPPROTO_TCP: u8 = 6;
/// IP protocol number of UDP.
const IPPROTO_UDP: u8 = 17;
/// Bytes of a TCP header without options.
const TCP_HLEN: usize = 20;
/// Bytes of a UDP header.
const UDP_HLEN: usize = 8;

/// Adds `data` to the running ones' complement sum `sum`, as big-endian 16-bit words (a
/// last odd byte padded with a zero byte). `data` must start at an even offset of what is
/// being summed. The result stays below 2^33 whatever `sum` was, so sums can be chained.
pub fn add(sum: u64, data: &[u8]) -> u64 {
    // Summing 32-bit words is the same sum modulo 0xffff, as 2^16 is 1 modulo 0xffff.
    let mut sum = fold32(sum);
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        sum += u64::from(u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
    }
    match *words.remainder() {
        [a, b, c] => sum += u64::from(u32::from_be_bytes([a, b, c, 0])),
        [a, b] => sum += u64::from(u16::from_be_bytes([a, b])),
        [a] => sum += u64::from(u16::from_be_bytes([a, 0])),
        _ => {}
    }
    fold32(sum)
}

/// `sum` below 2^33 and equal modulo 0xffff (zero only if it was zero).
fn fold32(sum: u64) -> u64 {
    (sum & 0xffff_ffff) + (sum >> 32)
}

/// Folds a running sum to 16 bits with end-around carry: the ones' complement sum, not
/// complemented. Zero only for a sum of zeros.
pub fn fold(mut sum: u64) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The Internet checksum of `data`: the ones' complement of its ones' complement sum.
pub fn checksum(data: &[u8]) -> u16 {
    !fold(add(0, data))
}

/// A checksum the driver asked for lies (partly) outside the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("checksum at {start} + {offset} lies outside a frame of {len} bytes")]
pub struct OutOfFrame {
    /// `csum_start` of the header.
    pub start: usize,
    /// `csum_offset` of the header.
    pub offset: usize,
    /// Bytes of the frame.
    pub len: usize,
}

/// Completes the partial checksum of `frame` a driver left to the device: sums the frame
/// from `start` to its end (the 16-bit field at `start + offset`, inside that range,
/// holds the pseudo-header's sum the driver put there) and stores the checksum in that
/// field, big-endian. A result of 0 is stored as `0xffff`, as Linux's
/// `skb_checksum_help` does: the same value in ones' complement, and UDP reads 0 as "no
/// checksum". The frame is left alone when the field does not fit in it.
pub fn complete(frame: &mut [u8], start: usize, offset: usize) -> Result<(), OutOfFrame> {
    let len = frame.len();
    let at = start.checked_add(offset).filter(|at| at.checked_add(2).is_some_and(|end| end <= len));
    let Some(at) = at else { return Err(OutOfFrame { start, offset, len }) };
    let sum = match checksum(&frame[start..]) {
        0 => 0xffff,
        sum => sum,
    };
    frame[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    Ok(())
}

/// What verifying a received frame's transport checksum found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// A TCP or UDP segment over IPv4 or IPv6 whose checksum, pseudo-header included,
    /// verifies.
    Valid,
    /// A TCP or UDP segment whose checksum does not verify.
    Invalid,
    /// Not checked: not TCP or UDP over IPv4 or IPv6 (at most one VLAN tag), an IPv4
    /// fragment, IPv6 extension headers or a jumbogram, headers cut short, lengths that
    /// disagree with the frame, or a UDP datagram whose checksum field is 0 (none over
    /// IPv4; invalid over IPv6, which the guest decides).
    Unchecked,
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

/// Verifies the TCP or UDP checksum of Ethernet frame `frame` (no FCS; trailing padding
/// after the IP packet is ignored). The IPv4 header checksum is not checked: receivers
/// check it whatever the device says.
pub fn verify(frame: &[u8]) -> Verdict {
    let Some(mut ethertype) = be16(frame, 12) else { return Verdict::Unchecked };
    let mut l3 = ETH_HLEN;
    if ethertype == ETH_P_8021Q {
        let Some(inner) = be16(frame, 16) else { return Verdict::Unchecked };
        ethertype = inner;
        l3 += 4;
    }
    let packet = &frame[l3.min(frame.len())..];
    match ethertype {
        ETH_P_IP => verify_ipv4(packet),
        ETH_P_IPV6 => verify_ipv6(packet),
        _ => Verdict::Unchecked,
    }
}

fn verify_ipv4(p: &[u8]) -> Verdict {
    if p.len() < 20 || p[0] >> 4 != 4 {
        return Verdict::Unchecked;
    }
    let ihl = usize::from(p[0] & 0xf) * 4;
    let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
    let fragment = u16::from_be_bytes([p[6], p[7]]) & 0x3fff; // MF and the offset
    if ihl < 20 || total < ihl || total > p.len() || fragment != 0 {
        return Verdict::Unchecked;
    }
    let proto = p[9];
    let segment = &p[ihl..total];
    let Ok(len) = u16::try_from(segment.len()) else { return Verdict::Unchecked };
    let mut pseudo = [0u8; 12];
    pseudo[..8].copy_from_slice(&p[12..20]);
    pseudo[9] = proto;
    pseudo[10..].copy_from_slice(&len.to_be_bytes());
    verify_segment(&pseudo, proto, segment)
}

fn verify_ipv6(p: &[u8]) -> Verdict {
    if p.len() < 40 || p[0] >> 4 != 6 {
        return Verdict::Unchecked;
    }
    let payload = usize::from(u16::from_be_bytes([p[4], p[5]]));
    let next = p[6];
    // A payload length of 0 is a jumbogram (hop-by-hop option); extension headers are
    // left to the guest, as is anything longer than the frame.
    if payload == 0 || 40 + payload > p.len() {
        return Verdict::Unchecked;
    }
    let segment = &p[40..40 + payload];
    let mut pseudo = [0u8; 40];
    pseudo[..32].copy_from_slice(&p[8..40]);
    pseudo[32..36].copy_from_slice(&(payload as u32).to_be_bytes());
    pseudo[39] = next;
    verify_segment(&pseudo, next, segment)
}

/// Verifies TCP or UDP `segment` with the sum of its pseudo-header `pseudo`.
fn verify_segment(pseudo: &[u8], proto: u8, segment: &[u8]) -> Verdict {
    match proto {
        IPPROTO_TCP if segment.len() >= TCP_HLEN => {}
        IPPROTO_UDP if segment.len() >= UDP_HLEN => {
            // The UDP length must be the IP payload's: anything else is the guest's to judge.
            let udp_len = usize::from(u16::from_be_bytes([segment[4], segment[5]]));
            let check = u16::from_be_bytes([segment[6], segment[7]]);
            if udp_len != segment.len() || check == 0 {
                return Verdict::Unchecked;
            }
        }
        _ => return Verdict::Unchecked,
    }
    // The sum over the pseudo-header and the segment, its checksum field included, is
    // 0xffff (negative zero) exactly when the checksum is right.
    if fold(add(add(0, pseudo), segment)) == 0xffff {
        Verdict::Valid
    } else {
        Verdict::Invalid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UDP/IPv4 frame (192.168.1.10:49152 -> 192.168.1.20:4791, 19 bytes of payload),
    /// checksums computed with Python's `struct` by the RFC 1071 definition: IPv4 header
    /// 0x9b09, UDP 0xbf01.
    const UDP4: &str = "525400123456525400abcdef08004500002f1c46400040119b09c0a8010ac0a80114\
                        c00012b7001bbf01676472766d20636865636b73756d2074657374";
    /// A TCP/IPv6 frame (fe80::1:40000 -> fe80::2:5201, PSH|ACK, 11 bytes of payload),
    /// TCP checksum 0xdd2f computed the same way.
    const TCP6: &str = "525400123456525400abcdef86dd60000000001f0640fe80000000000000000000000000\
                        0001fe8000000000000000000000000000029c401451010203040a0b0c0d5018ffffdd2f\
                        000068656c6c6f2c2069707636";
    /// Where the UDP checksum is in [`UDP4`] and the TCP checksum in [`TCP6`].
    const UDP4_CSUM: usize = 14 + 20 + 6;
    const TCP6_CSUM: usize = 14 + 40 + 16;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    /// RFC 1071 literally: 16-bit words one at a time, carries folded at the end.
    fn reference(data: &[u8]) -> u16 {
        let mut sum: u64 = 0;
        for pair in data.chunks(2) {
            let word = u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]);
            sum += u64::from(word);
        }
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    }

    #[test]
    fn test_rfc1071_examples() {
        // RFC 1071 section 3: the sum of 00 01 f2 03 f4 f5 f6 f7 is ddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(add(0, &data)), 0xddf2);
        assert_eq!(checksum(&data), 0x220d);
        // Byte-order independence (RFC 1071 1.2(B)): the byte-swapped data sums to the
        // byte-swapped sum.
        let swapped = [0x01, 0x00, 0x03, 0xf2, 0xf5, 0xf4, 0xf7, 0xf6];
        assert_eq!(fold(add(0, &swapped)), 0xf2dd);
        // The IPv4 header everyone quotes: checksum b861.
        let mut ip = hex("450000730000400040110000c0a80001c0a800c7");
        assert_eq!(checksum(&ip), 0xb861);
        ip[10..12].copy_from_slice(&0xb861u16.to_be_bytes());
        assert_eq!(checksum(&ip), 0, "a header with its checksum sums to negative zero");
        // Nothing, and zeros, sum to zero.
        assert_eq!(fold(add(0, &[])), 0);
        assert_eq!(checksum(&[0; 7]), 0xffff);
    }

    #[test]
    fn test_matches_reference_on_every_length_and_chained() {
        let data: Vec<u8> = (0..2000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in 0..300 {
            assert_eq!(checksum(&data[..len]), reference(&data[..len]), "length {len}");
        }
        assert_eq!(checksum(&data), reference(&data));
        assert_eq!(checksum(&[0xff; 65550]), reference(&[0xff; 65550]));
        // Sums chain over pieces starting at even offsets.
        let chained = !fold(add(add(add(0, &data[..2]), &data[2..1000]), &data[1000..]));
        assert_eq!(chained, reference(&data));
        // A large running sum carried on: the same as summing the whole at once.
        let big = [0xffu8; 65550];
        let twice = [0xffu8; 2 * 65550];
        assert_eq!(!fold(add(add(0, &big), &big)), reference(&twice));
        assert_eq!(fold(add(u64::MAX, &[])), fold(u64::MAX));
    }

    #[test]
    fn test_known_frames_verify() {
        let udp = hex(UDP4);
        assert_eq!(udp.len(), 61);
        assert_eq!(checksum(&udp[14..34]), 0, "the IPv4 header checksum is right");
        assert_eq!(verify(&udp), Verdict::Valid);
        let tcp = hex(TCP6);
        assert_eq!(tcp.len(), 85);
        assert_eq!(verify(&tcp), Verdict::Valid);

        // The checksums, recomputed here with the reference over an explicit pseudo-header.
        let mut pseudo4 = Vec::new();
        pseudo4.extend_from_slice(&udp[26..34]);
        pseudo4.extend_from_slice(&[0, 17, 0, 27]);
        let mut seg = udp[34..].to_vec();
        seg[6..8].fill(0);
        pseudo4.extend_from_slice(&seg);
        assert_eq!(reference(&pseudo4), 0xbf01);
        let mut pseudo6 = Vec::new();
        pseudo6.extend_from_slice(&tcp[22..54]);
        pseudo6.extend_from_slice(&[0, 0, 0, 31, 0, 0, 0, 6]);
        let mut seg = tcp[54..].to_vec();
        seg[16..18].fill(0);
        pseudo6.extend_from_slice(&seg);
        assert_eq!(reference(&pseudo6), 0xdd2f);
    }

    #[test]
    fn test_corrupted_frames_do_not_verify() {
        for (frame, csum_at) in [(hex(UDP4), UDP4_CSUM), (hex(TCP6), TCP6_CSUM)] {
            // Any single flipped bit in the segment or the addresses breaks it.
            let start = if csum_at == UDP4_CSUM { 14 + 12 } else { 14 + 8 };
            for at in start..frame.len() {
                let mut bad = frame.clone();
                bad[at] ^= 0x10;
                let verdict = verify(&bad);
                // Flipping a length byte makes the lengths disagree: unchecked, not valid.
                assert_ne!(verdict, Verdict::Valid, "byte {at} flipped still verifies");
            }
            // A wrong checksum field.
            let mut bad = frame.clone();
            bad[csum_at] ^= 0x01;
            assert_eq!(verify(&bad), Verdict::Invalid);
        }
    }

    #[test]
    fn test_unchecked_frames() {
        let udp = hex(UDP4);
        // UDP over IPv4 without a checksum.
        let mut none = udp.clone();
        none[UDP4_CSUM..UDP4_CSUM + 2].fill(0);
        assert_eq!(verify(&none), Verdict::Unchecked);
        // A fragment (MF set), and a later fragment.
        let mut frag = udp.clone();
        frag[14 + 6] |= 0x20;
        assert_eq!(verify(&frag), Verdict::Unchecked);
        let mut frag = udp.clone();
        frag[14 + 7] = 1;
        assert_eq!(verify(&frag), Verdict::Unchecked);
        // ARP, a frame cut inside the IP header, an IP total length past the frame.
        let mut arp = udp.clone();
        arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        assert_eq!(verify(&arp), Verdict::Unchecked);
        assert_eq!(verify(&udp[..30]), Verdict::Unchecked);
        assert_eq!(verify(&udp[..udp.len() - 1]), Verdict::Unchecked);
        assert_eq!(verify(&udp[..13]), Verdict::Unchecked);
        assert_eq!(verify(&[]), Verdict::Unchecked);
        // ICMP.
        let mut icmp = udp.clone();
        icmp[14 + 9] = 1;
        assert_eq!(verify(&icmp), Verdict::Unchecked);
        // An IPv6 hop-by-hop header first.
        let mut hbh = hex(TCP6);
        hbh[14 + 6] = 0;
        assert_eq!(verify(&hbh), Verdict::Unchecked);
        // An IHL below 5.
        let mut ihl = udp.clone();
        ihl[14] = 0x44;
        assert_eq!(verify(&ihl), Verdict::Unchecked);
    }

    #[test]
    fn test_padding_and_vlan() {
        // Ethernet padding after the IP packet is not summed.
        let mut padded = hex(UDP4);
        padded.extend_from_slice(&[0xa5; 3]);
        assert_eq!(verify(&padded), Verdict::Valid);
        // One 802.1Q tag.
        let udp = hex(UDP4);
        let mut tagged = udp[..12].to_vec();
        tagged.extend_from_slice(&[0x81, 0x00, 0x00, 0x05]);
        tagged.extend_from_slice(&udp[12..]);
        assert_eq!(verify(&tagged), Verdict::Valid);
        let last = tagged.len() - 1;
        tagged[last] ^= 1;
        assert_eq!(verify(&tagged), Verdict::Invalid);
    }

    #[test]
    fn test_complete_fills_partial_checksums() {
        // What a driver hands over: the pseudo-header's folded sum in the field.
        let udp = hex(UDP4);
        let mut partial = udp.clone();
        partial[UDP4_CSUM..UDP4_CSUM + 2].copy_from_slice(&0x839bu16.to_be_bytes());
        complete(&mut partial, 34, 6).unwrap();
        assert_eq!(partial, udp);
        let tcp = hex(TCP6);
        let mut partial = tcp.clone();
        partial[TCP6_CSUM..TCP6_CSUM + 2].copy_from_slice(&0xfd29u16.to_be_bytes());
        complete(&mut partial, 54, 16).unwrap();
        assert_eq!(partial, tcp);

        // A sum of zero goes out as 0xffff.
        let mut zeros = [0u8; 8];
        complete(&mut zeros, 0, 6).unwrap();
        assert_eq!(zeros, [0, 0, 0, 0, 0, 0, 0xff, 0xff]);
        let mut ones = [0xffu8, 0xff, 0, 0];
        complete(&mut ones, 0, 2).unwrap();
        assert_eq!(ones, [0xff, 0xff, 0xff, 0xff]);

        // Fields outside the frame are refused and the frame left alone.
        let mut f = udp.clone();
        let len = f.len();
        for (start, offset) in [(len - 1, 0), (len, 0), (0, len - 1), (60, 6), (65535, 65535), (usize::MAX, 2)] {
            assert_eq!(complete(&mut f, start, offset), Err(OutOfFrame { start, offset, len }));
        }
        assert_eq!(f, udp);
        // The last two bytes are still inside.
        complete(&mut f, len - 2, 0).unwrap();
    }
}
