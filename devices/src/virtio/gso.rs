//! TCP segmentation in the device, for a large (GSO) frame whose receiver cannot take it
//! whole: another device's guest sent it with `VIRTIO_NET_F_HOST_TSO4`/`6` and it arrived
//! over the wire with its `virtio_net_hdr` (`gso_type`, `gso_size`), but this device's
//! guest did not accept `GUEST_TSO4`/`6` for it. Each segment gets its own IP and TCP
//! header (IPv4 total length, identification and header checksum, or IPv6 payload length;
//! sequence number; FIN and PSH on the last segment only, CWR on the first only) and a
//! full TCP checksum, as a NIC's TSO engine does.
//!
//! Written by hand, as [`super::csum`] is: no rust-vmm crate segments frames.

use super::csum;

/// `gso_type` of a TCP-over-IPv4 frame.
pub const GSO_TCPV4: u8 = 1;
/// `gso_type` of a TCP-over-IPv6 frame.
pub const GSO_TCPV6: u8 = 4;
/// `gso_type` flag: the frame carries ECN (not offered).
pub const GSO_ECN: u8 = 0x80;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const IPPROTO_TCP: u8 = 6;
const TCP_FIN: u8 = 0x01;
const TCP_PSH: u8 = 0x08;
const TCP_CWR: u8 = 0x80;
/// Segments one frame may become: a 64 KiB frame at the smallest MSS worth sending.
const MAX_SEGMENTS: usize = 1024;

/// Why a GSO frame cannot be segmented (it is dropped and counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum GsoError {
    /// Not TCP over the IP version its `gso_type` says, or headers cut short.
    #[error("not a TCP frame over the IP version its gso_type says")]
    NotTcp,
    /// `gso_size` is 0, or so small the frame would make too many segments.
    #[error("gso_size {0} cannot cut the frame")]
    BadSize(u16),
}

/// Where a frame's headers are.
struct Layout {
    /// Start of the IP header.
    l3: usize,
    /// Start of the TCP header.
    l4: usize,
    /// Start of the payload.
    payload: usize,
    ipv4: bool,
}

fn be16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

fn layout(frame: &[u8], gso_type: u8) -> Result<Layout, GsoError> {
    let mut ethertype = be16(frame, 12).ok_or(GsoError::NotTcp)?;
    let mut l3 = ETH_HLEN;
    if ethertype == ETH_P_8021Q {
        ethertype = be16(frame, 16).ok_or(GsoError::NotTcp)?;
        l3 += 4;
    }
    let ip = frame.get(l3..).ok_or(GsoError::NotTcp)?;
    let (ipv4, l4) = match (gso_type & !GSO_ECN, ethertype) {
        (GSO_TCPV4, ETH_P_IP) if ip.len() >= 20 && ip[0] >> 4 == 4 && ip[9] == IPPROTO_TCP => {
            let ihl = usize::from(ip[0] & 0xf) * 4;
            (true, l3 + ihl.max(20))
        }
        // No extension headers: Linux's own TSO frames have none.
        (GSO_TCPV6, ETH_P_IPV6) if ip.len() >= 40 && ip[0] >> 4 == 6 && ip[6] == IPPROTO_TCP => (false, l3 + 40),
        _ => return Err(GsoError::NotTcp),
    };
    let offset = usize::from(*frame.get(l4 + 12).ok_or(GsoError::NotTcp)? >> 4) * 4;
    let payload = l4 + offset;
    if offset < 20 || payload > frame.len() {
        return Err(GsoError::NotTcp);
    }
    Ok(Layout { l3, l4, payload, ipv4 })
}

/// Cuts TCP frame `frame` (Ethernet, IPv4 or IPv6 as `gso_type` says, TCP) into segments
/// of at most `mss` payload bytes, each a complete frame with correct checksums, handed
/// to `emit` in order. A frame whose payload fits in one segment comes out as one, its
/// checksums made whole.
pub fn segment(frame: &[u8], gso_type: u8, mss: u16, mut emit: impl FnMut(&[u8])) -> Result<(), GsoError> {
    let at = layout(frame, gso_type)?;
    let payload = &frame[at.payload..];
    let mss_bytes = usize::from(mss);
    if mss == 0 || payload.len().div_ceil(mss_bytes) > MAX_SEGMENTS {
        return Err(GsoError::BadSize(mss));
    }
    let headers = &frame[..at.payload];
    let seq = u32::from_be_bytes([frame[at.l4 + 4], frame[at.l4 + 5], frame[at.l4 + 6], frame[at.l4 + 7]]);
    let ip_id = be16(frame, at.l3 + 4).unwrap_or(0);
    let flags = frame[at.l4 + 13];
    let chunks: Vec<&[u8]> = if payload.is_empty() { vec![&[][..]] } else { payload.chunks(mss_bytes).collect() };
    let last = chunks.len() - 1;
    let mut out = Vec::with_capacity(headers.len() + mss_bytes);
    for (i, chunk) in chunks.iter().enumerate() {
        out.clear();
        out.extend_from_slice(headers);
        out.extend_from_slice(chunk);
        let tcp_len = out.len() - at.l4;
        if at.ipv4 {
            let total = (out.len() - at.l3) as u16;
            out[at.l3 + 2..at.l3 + 4].copy_from_slice(&total.to_be_bytes());
            out[at.l3 + 4..at.l3 + 6].copy_from_slice(&ip_id.wrapping_add(i as u16).to_be_bytes());
            out[at.l3 + 10..at.l3 + 12].fill(0);
            let check = csum::checksum(&out[at.l3..at.l4]);
            out[at.l3 + 10..at.l3 + 12].copy_from_slice(&check.to_be_bytes());
        } else {
            out[at.l3 + 4..at.l3 + 6].copy_from_slice(&(tcp_len as u16).to_be_bytes());
        }
        let offset = (i * mss_bytes) as u32;
        out[at.l4 + 4..at.l4 + 8].copy_from_slice(&seq.wrapping_add(offset).to_be_bytes());
        let mut f = flags;
        if i != last {
            f &= !(TCP_FIN | TCP_PSH);
        }
        if i != 0 {
            f &= !TCP_CWR;
        }
        out[at.l4 + 13] = f;
        out[at.l4 + 16..at.l4 + 18].fill(0);
        let sum = csum::add(pseudo_header_sum(&out, &at, tcp_len), &out[at.l4..]);
        let check = !csum::fold(sum);
        out[at.l4 + 16..at.l4 + 18].copy_from_slice(&check.to_be_bytes());
        emit(&out);
    }
    Ok(())
}

/// The sum of the TCP pseudo-header of a segment of `tcp_len` bytes in `frame`.
fn pseudo_header_sum(frame: &[u8], at: &Layout, tcp_len: usize) -> u64 {
    let addresses = if at.ipv4 { &frame[at.l3 + 12..at.l3 + 20] } else { &frame[at.l3 + 8..at.l3 + 40] };
    let mut tail = [0u8; 8];
    tail[..4].copy_from_slice(&(tcp_len as u32).to_be_bytes());
    tail[7] = IPPROTO_TCP;
    csum::add(csum::add(0, addresses), &tail)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An Ethernet + IPv4 (or IPv6) + TCP frame carrying `payload`, as Linux hands a TSO
    /// frame to its device: lengths for the whole frame, the checksum field holding only
    /// a seed (garbage here: segmentation must not trust it).
    fn tso_frame(ipv6: bool, payload: &[u8], flags: u8) -> Vec<u8> {
        let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
        let tcp_len = 32 + payload.len();
        if ipv6 {
            f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
            let mut ip = vec![0x60, 0, 0, 0];
            ip.extend_from_slice(&(tcp_len as u16).to_be_bytes());
            ip.extend_from_slice(&[IPPROTO_TCP, 64]);
            ip.extend((0..16u8).map(|i| 0xfd ^ i));
            ip.extend((0..16).map(|i| 0x20 + i as u8));
            f.extend_from_slice(&ip);
        } else {
            f.extend_from_slice(&ETH_P_IP.to_be_bytes());
            let total = (20 + tcp_len) as u16;
            f.extend_from_slice(&[0x45, 0]);
            f.extend_from_slice(&total.to_be_bytes());
            f.extend_from_slice(&[0x12, 0x34, 0x40, 0, 64, IPPROTO_TCP, 0xde, 0xad, 10, 77, 0, 1, 10, 77, 0, 2]);
        }
        // TCP with 12 bytes of options (timestamps), seq 0xfffffff0 to wrap.
        let mut tcp = vec![0x48, 0x49, 0x12, 0x4d, 0xff, 0xff, 0xff, 0xf0, 0, 0, 0, 1, 0x80, flags, 0xff, 0xff];
        tcp.extend_from_slice(&[0xbe, 0xef, 0, 0, 1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 2]);
        f.extend_from_slice(&tcp);
        f.extend_from_slice(payload);
        f
    }

    fn segments(frame: &[u8], gso_type: u8, mss: u16) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        segment(frame, gso_type, mss, |s| out.push(s.to_vec())).unwrap();
        out
    }

    #[test]
    fn test_segments_carry_the_payload_in_order_with_valid_checksums() {
        let payload: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        for (ipv6, gso_type) in [(false, GSO_TCPV4), (true, GSO_TCPV6)] {
            let frame = tso_frame(ipv6, &payload, TCP_PSH | TCP_FIN | TCP_CWR | 0x10);
            let segs = segments(&frame, gso_type, 1448);
            assert_eq!(segs.len(), 7, "10000 bytes at 1448 a segment");
            let header = frame.len() - payload.len();
            let mut joined = Vec::new();
            for (i, s) in segs.iter().enumerate() {
                assert!(s.len() <= header + 1448);
                assert_eq!(
                    csum::verify(s),
                    csum::Verdict::Valid,
                    "segment {i} ({}): TCP checksum",
                    ["v4", "v6"][usize::from(ipv6)]
                );
                let l4 = if ipv6 { 54 } else { 34 };
                let seq = u32::from_be_bytes([s[l4 + 4], s[l4 + 5], s[l4 + 6], s[l4 + 7]]);
                assert_eq!(seq, 0xffff_fff0u32.wrapping_add(1448 * i as u32), "segment {i}: sequence number");
                let flags = s[l4 + 13];
                assert_eq!(flags & (TCP_FIN | TCP_PSH) != 0, i == 6, "segment {i}: FIN/PSH only on the last");
                assert_eq!(flags & TCP_CWR != 0, i == 0, "segment {i}: CWR only on the first");
                assert_eq!(flags & 0x10, 0x10, "ACK on every segment");
                if ipv6 {
                    assert_eq!(usize::from(u16::from_be_bytes([s[18], s[19]])), s.len() - 54);
                } else {
                    assert_eq!(usize::from(u16::from_be_bytes([s[16], s[17]])), s.len() - 14);
                    assert_eq!(u16::from_be_bytes([s[18], s[19]]), 0x1234 + i as u16, "IPv4 identification");
                    assert_eq!(csum::checksum(&s[14..34]), 0, "IPv4 header checksum");
                }
                joined.extend_from_slice(&s[header..]);
            }
            assert_eq!(joined, payload);
        }
    }

    #[test]
    fn test_a_small_frame_is_one_segment_and_bad_frames_are_refused() {
        let frame = tso_frame(false, b"short", 0x18);
        let segs = segments(&frame, GSO_TCPV4, 1448);
        assert_eq!(segs.len(), 1);
        assert_eq!(csum::verify(&segs[0]), csum::Verdict::Valid);
        assert_eq!(segments(&tso_frame(false, b"", 0x10), GSO_TCPV4, 1448).len(), 1, "a bare ACK");
        let none = |f: &[u8], t: u8, mss: u16| segment(f, t, mss, |_| panic!("no segment expected"));
        assert_eq!(none(&frame, GSO_TCPV6, 1448), Err(GsoError::NotTcp), "IPv4 frame, IPv6 gso_type");
        assert_eq!(none(&frame[..40], GSO_TCPV4, 1448), Err(GsoError::NotTcp), "cut short");
        assert_eq!(none(&frame, GSO_TCPV4, 0), Err(GsoError::BadSize(0)));
        assert_eq!(none(&tso_frame(false, &[0; 60000], 0x10), GSO_TCPV4, 8), Err(GsoError::BadSize(8)));
        let mut udp = frame.clone();
        udp[23] = 17;
        assert_eq!(none(&udp, GSO_TCPV4, 1448), Err(GsoError::NotTcp), "UDP");
        let mut offset = frame.clone();
        offset[34 + 12] = 0x10;
        assert_eq!(none(&offset, GSO_TCPV4, 1448), Err(GsoError::NotTcp), "TCP data offset below 20");
    }
}
