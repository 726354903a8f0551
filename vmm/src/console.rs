//! The host end of the guest console: the terminal in raw mode while a person types into
//! the guest, and the escape sequence (Ctrl-A x, as in QEMU) that leaves the VM.

use std::os::fd::RawFd;

/// Puts a terminal into raw mode and restores its exact previous settings when dropped.
pub struct RawTerminal {
    fd: RawFd,
    saved: libc::termios,
}

impl RawTerminal {
    /// Switches `fd` to raw mode; `None` when `fd` is not a terminal.
    pub fn enter(fd: RawFd) -> Option<RawTerminal> {
        // SAFETY: isatty only inspects the descriptor.
        if unsafe { libc::isatty(fd) } != 1 {
            return None;
        }
        // SAFETY: termios is plain data; zeroed is a valid value for tcgetattr to overwrite.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` is a valid termios to fill for a terminal descriptor.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return None;
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only edits the struct it is given.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: `raw` is a valid termios derived from the terminal's own settings.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return None;
        }
        Some(RawTerminal { fd, saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        // SAFETY: restores the settings read from this same descriptor in `enter`.
        unsafe { libc::tcsetattr(self.fd, libc::TCSANOW, &self.saved) };
    }
}

/// Ctrl-A: the escape prefix.
const ESCAPE: u8 = 0x01;

/// What the console input asks for after a chunk of keyboard input.
#[derive(Debug, PartialEq, Eq)]
pub enum InputAction {
    /// Forward these bytes to the guest.
    Forward(Vec<u8>),
    /// The user pressed Ctrl-A x: stop the VM.
    Quit,
}

/// Filters keyboard input for the escape sequence: Ctrl-A x quits, Ctrl-A Ctrl-A sends one
/// Ctrl-A, anything else after Ctrl-A is forwarded with it.
#[derive(Default)]
pub struct EscapeFilter {
    pending_escape: bool,
}

impl EscapeFilter {
    /// Feeds `input` through the filter.
    pub fn feed(&mut self, input: &[u8]) -> InputAction {
        let mut out = Vec::with_capacity(input.len());
        for &b in input {
            if self.pending_escape {
                self.pending_escape = false;
                match b {
                    b'x' | b'X' => return InputAction::Quit,
                    ESCAPE => out.push(ESCAPE),
                    other => out.extend_from_slice(&[ESCAPE, other]),
                }
            } else if b == ESCAPE {
                self.pending_escape = true;
            } else {
                out.push(b);
            }
        }
        InputAction::Forward(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_escape_sequences() {
        let mut f = EscapeFilter::default();
        assert_eq!(f.feed(b"ls\r"), InputAction::Forward(b"ls\r".to_vec()));
        assert_eq!(f.feed(&[ESCAPE]), InputAction::Forward(vec![]));
        assert_eq!(f.feed(b"x"), InputAction::Quit);
        assert_eq!(f.feed(&[ESCAPE, ESCAPE, b'a']), InputAction::Forward(vec![ESCAPE, b'a']));
        assert_eq!(f.feed(&[ESCAPE, b'c']), InputAction::Forward(vec![ESCAPE, b'c']));
    }

    #[test]
    fn test_not_a_terminal() {
        let (r, _w) = std::os::unix::net::UnixStream::pair().unwrap();
        use std::os::fd::AsRawFd;
        assert!(RawTerminal::enter(r.as_raw_fd()).is_none());
    }
}
