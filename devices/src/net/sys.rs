//! What both kinds of port share: counters, a warning given once, and `recvfrom` that tells
//! a datagram's real length (so that one larger than the buffer is dropped, not cut).

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::WireStats;

/// Frame counters, shared by the sending and receiving threads.
#[derive(Debug, Default)]
pub(super) struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    dropped: AtomicU64,
    /// An unexpected error was logged already.
    warned: AtomicBool,
}

impl Counters {
    pub(super) fn sent(&self) {
        self.sent.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn received(&self) {
        self.received.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn dropped(&self) {
        self.dropped.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn stats(&self) -> WireStats {
        WireStats {
            sent: self.sent.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
        }
    }

    /// Logs the first unexpected error of this port; later ones are only counted.
    pub(super) fn warn_once(&self, what: &str, error: &io::Error) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!("wire: {what}: {error} (dropped; further errors are counted, not logged)");
        }
    }
}

/// Whether a send failed because the peer cannot take the frame now or is gone: expected,
/// counted, never logged.
pub(super) fn is_peer_busy(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::ENOBUFS)) || error.kind() == io::ErrorKind::WouldBlock
}

/// Whether a send failed because nobody is bound at the destination any more.
pub(super) fn is_peer_gone(error: &io::Error) -> bool {
    matches!(error.raw_os_error(), Some(libc::ECONNREFUSED | libc::ENOENT))
}

/// One datagram taken from a socket.
pub(super) struct Datagram {
    /// Its full length (more than the buffer when it did not fit).
    pub(super) len: usize,
    /// The sender's address.
    pub(super) from: libc::sockaddr_storage,
    /// Bytes of `from` the kernel filled in.
    pub(super) from_len: libc::socklen_t,
}

/// Takes one datagram from nonblocking socket `fd` into `buf`; `None` when none waits.
pub(super) fn recv_from(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<Datagram>> {
    loop {
        // SAFETY: sockaddr_storage is plain data; all zeroes is a valid value.
        let mut from: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let mut from_len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        // SAFETY: `buf` is valid for writes of `buf.len()` bytes and `from` for `from_len`
        // bytes, both for the whole call; the kernel writes no further.
        let n = unsafe {
            libc::recvfrom(
                fd,
                buf.as_mut_ptr().cast(),
                buf.len(),
                libc::MSG_TRUNC | libc::MSG_DONTWAIT,
                (&mut from as *mut libc::sockaddr_storage).cast(),
                &mut from_len,
            )
        };
        if n >= 0 {
            return Ok(Some(Datagram { len: n as usize, from, from_len }));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Asks for a socket buffer (`SO_SNDBUF` or `SO_RCVBUF`) of `bytes`; the kernel caps it at
/// its limit (`net.core.wmem_max` / `rmem_max`). Best effort: a smaller buffer only drops
/// more under load.
pub(super) fn set_buffer(fd: RawFd, option: libc::c_int, bytes: libc::c_int) {
    // SAFETY: `bytes` is a valid c_int for the call, and its size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            option,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::debug!("wire: setsockopt({option}, {bytes}): {}", io::Error::last_os_error());
    }
}

/// Sets how long a blocking send on `fd` waits (`SO_SNDTIMEO`) for room at the receiver
/// before it fails with EAGAIN. Best effort, as [`set_buffer`].
pub(super) fn set_send_timeout(fd: RawFd, wait: std::time::Duration) {
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(wait.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_usec: libc::suseconds_t::from(wait.subsec_micros() as i32),
    };
    // SAFETY: `tv` is a valid timeval for the call, and its size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        tracing::debug!("wire: setsockopt(SO_SNDTIMEO, {wait:?}): {}", io::Error::last_os_error());
    }
}
