//! The part of an i8042 keyboard controller Linux uses to reset a PC.

use std::sync::Arc;

use crate::{BusDevice, GuestExit, GuestExitSignal};

/// Command byte that pulses the CPU reset line.
const CMD_RESET_CPU: u8 = 0xfe;

/// An i8042 at ports 0x60-0x64 with no keyboard: the status register reads empty, and the
/// reset command (0xfe on the command port) resets the machine.
pub struct I8042 {
    signal: Arc<GuestExitSignal>,
}

impl I8042 {
    /// Base I/O port (data); the command/status port is base + 4.
    pub const PORT: u16 = 0x60;
    /// Length of the port range.
    pub const LEN: u64 = 5;

    /// An i8042 that reports resets to `signal`.
    pub fn new(signal: Arc<GuestExitSignal>) -> Self {
        I8042 { signal }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Output buffer empty, input buffer empty: nothing to read, ready for commands.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 4 && data.first() == Some(&CMD_RESET_CPU) {
            tracing::warn!("the guest resets through the keyboard controller (port 0x64)");
            self.signal.request(GuestExit::Reset);
        }
    }
}
