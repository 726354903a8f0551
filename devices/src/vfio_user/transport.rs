//! One vfio-user message at a time over a Unix stream socket, with the file descriptors
//! that travel with it (SCM_RIGHTS), within a deadline.
//!
//! A sender attaches its fds to the message's first bytes, so the kernel hands them to the
//! receive call that reads the header. A message is read exactly (header, then
//! `msg_size - 16` bytes), never into the next one; fds arriving with any part of it are
//! kept, at most [`MAX_FDS`]. Waits use the socket's send and receive timeouts, set from
//! the deadline before each call.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use libc::{c_void, iovec};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::protocol::{Header, ProtocolError, HEADER_SIZE, MAX_FDS, MAX_MSG_SIZE};

/// One received message.
#[derive(Debug)]
pub struct Message {
    /// Its header, checked.
    pub header: Header,
    /// The `msg_size - 16` bytes after the header.
    pub payload: Vec<u8>,
    /// The fds that came with it, owned.
    pub fds: Vec<File>,
}

/// Why a message could not be sent or received.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer closed the connection between messages.
    #[error("the peer closed the connection")]
    Closed,
    /// The peer closed the connection in the middle of a message.
    #[error("the peer closed the connection in the middle of a message")]
    Truncated,
    /// The deadline passed.
    #[error("the peer did not {0} in time")]
    Timeout(&'static str),
    /// The header is malformed: the framing is lost.
    #[error("the message header is malformed")]
    Header(#[source] ProtocolError),
    /// More fds came than a message may carry (they are closed).
    #[error("the peer sent more than {MAX_FDS} file descriptors with one message")]
    TooManyFds,
    /// A message to send is larger than the protocol allows.
    #[error("a message of {0} bytes exceeds the limit of {MAX_MSG_SIZE}")]
    TooLarge(usize),
    /// Sending more fds than a message may carry.
    #[error("{0} file descriptors exceed the limit of {MAX_FDS} per message")]
    FdsToSend(usize),
    /// The socket failed.
    #[error("the socket failed")]
    Io(#[source] io::Error),
}

impl TransportError {
    /// Whether the message boundary is lost, so the connection cannot go on (everything
    /// but a refused send, which sent nothing).
    pub fn breaks_framing(&self) -> bool {
        !matches!(self, TransportError::TooLarge(_) | TransportError::FdsToSend(_))
    }
}

/// Sends `header`, `payload` and `fds` as one message, by `deadline` (`None`: no limit).
/// `header.msg_size` must cover the payload.
pub fn send(
    stream: &UnixStream,
    header: &Header,
    payload: &[u8],
    fds: &[BorrowedFd<'_>],
    deadline: Option<Instant>,
) -> Result<(), TransportError> {
    let total = HEADER_SIZE + payload.len();
    if total > MAX_MSG_SIZE || header.msg_size as usize != total {
        return Err(TransportError::TooLarge(total));
    }
    if fds.len() > MAX_FDS {
        return Err(TransportError::FdsToSend(fds.len()));
    }
    let head = header.encode();
    let raw: Vec<RawFd> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let mut sent = 0;
    while sent < total {
        stream.set_write_timeout(Some(remaining(deadline, "accept the message")?)).map_err(TransportError::Io)?;
        let (head_part, body_part) = if sent < HEADER_SIZE {
            (head.get(sent..).unwrap_or_default(), payload)
        } else {
            (&[][..], payload.get(sent - HEADER_SIZE..).unwrap_or_default())
        };
        // The fds go with the first bytes only.
        let with = if sent == 0 { &raw[..] } else { &[] };
        match stream.send_with_fds(&[head_part, body_part], with) {
            Ok(n) => sent += n,
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) if e.errno() == libc::EAGAIN || e.errno() == libc::EWOULDBLOCK => {}
            Err(e) => return Err(TransportError::Io(io::Error::from_raw_os_error(e.errno()))),
        }
    }
    Ok(())
}

/// Receives one message. Its first byte must arrive by `deadline` (`None`: wait as long as
/// it takes); the rest by `deadline` and within `stall` of the first.
pub fn receive(stream: &UnixStream, deadline: Option<Instant>, stall: Duration) -> Result<Message, TransportError> {
    let mut fds = Vec::new();
    let mut head = [0u8; HEADER_SIZE];
    let got = recv_some(stream, &mut head, &mut fds, deadline, "send a message")?;
    if got == 0 {
        return Err(TransportError::Closed);
    }
    let stalled = Instant::now() + stall;
    let deadline = Some(deadline.map_or(stalled, |d| d.min(stalled)));
    recv_exact(stream, &mut head[got..], &mut fds, deadline)?;
    let header = Header::decode(&head).map_err(TransportError::Header)?;
    let mut payload = vec![0; header.payload_len()];
    recv_exact(stream, &mut payload, &mut fds, deadline)?;
    Ok(Message { header, payload, fds })
}

/// Fills `buf`, or fails with [`TransportError::Truncated`] at end of file.
fn recv_exact(
    stream: &UnixStream,
    mut buf: &mut [u8],
    fds: &mut Vec<File>,
    deadline: Option<Instant>,
) -> Result<(), TransportError> {
    while !buf.is_empty() {
        let n = recv_some(stream, buf, fds, deadline, "send the rest of a message")?;
        if n == 0 {
            return Err(TransportError::Truncated);
        }
        buf = &mut buf[n..];
    }
    Ok(())
}

/// One `recvmsg` into `buf` (non-empty): the bytes read, 0 at end of file. Retries when
/// interrupted; fails when the deadline passes.
fn recv_some(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<File>,
    deadline: Option<Instant>,
    what: &'static str,
) -> Result<usize, TransportError> {
    loop {
        let timeout = match deadline {
            Some(_) => Some(remaining(deadline, what)?),
            None => None,
        };
        stream.set_read_timeout(timeout).map_err(TransportError::Io)?;
        let mut raw = [-1; MAX_FDS];
        let mut iov = [iovec { iov_base: buf.as_mut_ptr().cast::<c_void>(), iov_len: buf.len() }];
        // SAFETY: the one iovec covers `buf`, which is borrowed mutably for the call and
        // holds plain bytes, so the kernel may write any of them.
        let result = unsafe { stream.recv_with_fds(&mut iov, &mut raw) };
        match result {
            Ok((n, count)) => {
                for &fd in raw.iter().take(count) {
                    // SAFETY: `recv_with_fds` hands over `count` fds it received, open and
                    // owned by nobody else; each is wrapped exactly once.
                    fds.push(unsafe { File::from_raw_fd(fd) });
                }
                if fds.len() > MAX_FDS {
                    return Err(TransportError::TooManyFds);
                }
                return Ok(n);
            }
            // The control data did not fit: the library closed the fds.
            Err(e) if e.errno() == libc::ENOBUFS => return Err(TransportError::TooManyFds),
            Err(e) if e.errno() == libc::EINTR => {}
            Err(e) if e.errno() == libc::EAGAIN || e.errno() == libc::EWOULDBLOCK => {}
            Err(e) => return Err(TransportError::Io(io::Error::from_raw_os_error(e.errno()))),
        }
    }
}

/// Time left until `deadline` (`None`: a day, the socket's "no timeout" being zero, which
/// `set_*_timeout` refuses); an error when none is left.
fn remaining(deadline: Option<Instant>, what: &'static str) -> Result<Duration, TransportError> {
    let Some(deadline) = deadline else {
        return Ok(Duration::from_secs(86_400));
    };
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(TransportError::Timeout(what));
    }
    // Below a microsecond the socket would round the timeout to "none".
    Ok(left.max(Duration::from_micros(1)))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::fd::AsFd;

    use super::*;
    use crate::vfio_user::protocol::Command;

    fn in_a_second() -> Option<Instant> {
        Some(Instant::now() + Duration::from_secs(1))
    }

    #[test]
    fn test_messages_and_fds_arrive_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile::tempfile().unwrap();
        let payload = vec![0x5a; 200_000];
        let header = Header::command(3, Command::RegionWrite, payload.len());
        let sender = std::thread::spawn(move || {
            send(&a, &header, &payload, &[file.as_fd()], in_a_second()).unwrap();
            send(&a, &Header::command(4, Command::DeviceReset, 0), &[], &[], in_a_second()).unwrap();
            a
        });
        let m = receive(&b, in_a_second(), Duration::from_secs(1)).unwrap();
        assert_eq!((m.header.msg_id, m.payload.len(), m.fds.len()), (3, 200_000, 1));
        assert!(m.payload.iter().all(|&x| x == 0x5a));
        let m = receive(&b, in_a_second(), Duration::from_secs(1)).unwrap();
        assert_eq!((m.header.msg_id, m.payload.len(), m.fds.len()), (4, 0, 0));
        drop(sender.join().unwrap());
        assert!(matches!(receive(&b, in_a_second(), Duration::from_secs(1)), Err(TransportError::Closed)));
    }

    #[test]
    fn test_deadlines_truncation_and_limits() {
        let (mut a, b) = UnixStream::pair().unwrap();
        let soon = Some(Instant::now() + Duration::from_millis(50));
        assert!(matches!(receive(&b, soon, Duration::from_secs(1)), Err(TransportError::Timeout(_))));
        // Half a header, then silence: the stall limit applies.
        a.write_all(&[1, 0, 9]).unwrap();
        let started = Instant::now();
        assert!(matches!(receive(&b, None, Duration::from_millis(50)), Err(TransportError::Timeout(_))));
        assert!(started.elapsed() < Duration::from_secs(1));
        // A header promising more than comes.
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&Header::command(1, Command::RegionRead, 16).encode()).unwrap();
        drop(a);
        assert!(matches!(receive(&b, None, Duration::from_secs(1)), Err(TransportError::Truncated)));
        // A bad header.
        let (mut a, b) = UnixStream::pair().unwrap();
        a.write_all(&[0; 16]).unwrap();
        assert!(matches!(
            receive(&b, None, Duration::from_secs(1)),
            Err(TransportError::Header(ProtocolError::SizeTooSmall(0)))
        ));
        // Nothing too large or with too many fds leaves.
        let big = vec![0; MAX_MSG_SIZE];
        let err = send(&b, &Header::command(1, Command::RegionWrite, big.len()), &big, &[], None).unwrap_err();
        assert!(matches!(err, TransportError::TooLarge(_)) && !err.breaks_framing());
        let f = tempfile::tempfile().unwrap();
        let many = vec![f.as_fd(); MAX_FDS + 1];
        let err = send(&b, &Header::command(1, Command::DeviceReset, 0), &[], &many, None).unwrap_err();
        assert!(matches!(err, TransportError::FdsToSend(9)));
    }

    #[test]
    fn test_too_many_fds_are_refused_and_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = tempfile::tempfile().unwrap();
        let raw: Vec<RawFd> = vec![f.as_raw_fd(); MAX_FDS + 4];
        let head = Header::command(1, Command::DeviceReset, 0).encode();
        a.send_with_fds(&[&head[..]], &raw).unwrap();
        assert!(matches!(receive(&b, in_a_second(), Duration::from_secs(1)), Err(TransportError::TooManyFds)));
    }
}
