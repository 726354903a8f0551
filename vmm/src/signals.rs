//! SIGINT, SIGTERM and SIGHUP as events: blocked for the whole process while a
//! [`StopSignals`] lives, so that they arrive on its signalfd instead of killing a VMM (or
//! a cluster of them) mid-teardown.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};

/// A signalfd for the signals that ask the process to stop.
pub struct StopSignals {
    file: File,
    previous: libc::sigset_t,
}

impl StopSignals {
    /// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and the threads it starts from
    /// now on) and opens a non-blocking signalfd for them.
    pub fn new() -> std::io::Result<StopSignals> {
        // SAFETY: sigset_t is plain data; sigemptyset initializes it before use.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `previous` is written by pthread_sigmask.
        let mut previous: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t owned by this frame; the signal numbers are valid.
        unsafe {
            libc::sigemptyset(&mut set);
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::sigaddset(&mut set, sig);
            }
        }
        // SAFETY: blocks signals for this thread (and threads it starts); both sets are valid.
        let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut previous) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        // SAFETY: creates a new descriptor from a valid set; the result is checked.
        let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_NONBLOCK | libc::SFD_CLOEXEC) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            // SAFETY: restores the mask saved above.
            unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &previous, std::ptr::null_mut()) };
            return Err(e);
        }
        // SAFETY: `fd` is a fresh descriptor owned by nothing else.
        Ok(StopSignals { file: unsafe { File::from_raw_fd(fd) }, previous })
    }

    /// Whether a stop signal arrived since the last call (it is consumed).
    pub fn take(&self) -> bool {
        let mut info = [0u8; std::mem::size_of::<libc::signalfd_siginfo>()];
        let mut got = false;
        while (&self.file).read(&mut info).is_ok_and(|n| n == info.len()) {
            got = true;
        }
        got
    }
}

impl Drop for StopSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `new`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.previous, std::ptr::null_mut()) };
    }
}

impl AsRawFd for StopSignals {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_blocked_signal_is_taken_once() {
        let signals = StopSignals::new().unwrap();
        assert!(!signals.take());
        // SAFETY: raise() signals this thread, which blocks SIGHUP: it stays pending.
        unsafe { libc::raise(libc::SIGHUP) };
        assert!(signals.take());
        assert!(!signals.take());
    }
}
