//! The debug-exit port: the guest writes one byte, its exit status, before powering off.

use std::sync::Arc;

use crate::{BusDevice, GuestExitSignal};

/// A one-byte write-only port recording the guest's exit status. Unlike QEMU's
/// `isa-debug-exit` it does not stop the machine: the guest powers off afterwards, so its
/// console is flushed first.
pub struct DebugExit {
    signal: Arc<GuestExitSignal>,
}

impl DebugExit {
    /// A debug-exit port reporting to `signal`.
    pub fn new(signal: Arc<GuestExitSignal>) -> Self {
        DebugExit { signal }
    }
}

impl BusDevice for DebugExit {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0xff);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        if let Some(&status) = data.first() {
            tracing::debug!(status, "guest reported its exit status");
            self.signal.set_status(status);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_last_status_wins_and_does_not_stop() {
        let signal = Arc::new(GuestExitSignal::new().unwrap());
        let mut dev = DebugExit::new(signal.clone());
        dev.write(0, &[3]);
        dev.write(0, &[1, 9]);
        dev.write(0, &[]);
        assert_eq!(signal.status(), Some(1));
        assert_eq!(signal.exit(), None);
    }
}
