//! Hardware-reduced ACPI power control: the FADT's sleep control register and reset register.

use std::sync::Arc;

use crate::{BusDevice, GuestExit, GuestExitSignal};

/// I/O port of the FADT sleep control register (sleep status is the next port).
pub const ACPI_SLEEP_PORT: u16 = 0x3c0;
/// I/O ports of the sleep control and status registers, from [`ACPI_SLEEP_PORT`].
pub const ACPI_SLEEP_LEN: u8 = 2;
/// I/O port of the FADT reset register (the PC's traditional reset control port).
pub const ACPI_RESET_PORT: u16 = 0xcf9;
/// Value the FADT tells the OS to write to the reset register.
pub const ACPI_RESET_VALUE: u8 = 0x06;
/// SLP_TYP of S5 (soft off), as the DSDT's `\_S5` package declares it.
pub const S5_SLEEP_TYPE: u8 = 5;

const SLP_EN: u8 = 1 << 5;

/// Sleep control (offset 0) and status (offset 1) registers. Writing SLP_EN with the S5
/// sleep type powers off; other sleep states are not supported and are ignored.
pub struct AcpiSleepControl {
    signal: Arc<GuestExitSignal>,
}

impl AcpiSleepControl {
    /// A sleep control register reporting power-off to `signal`.
    pub fn new(signal: Arc<GuestExitSignal>) -> Self {
        AcpiSleepControl { signal }
    }
}

impl BusDevice for AcpiSleepControl {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        if offset == 0 && value & SLP_EN != 0 {
            let sleep_type = (value >> 2) & 0x7;
            if sleep_type == S5_SLEEP_TYPE {
                self.signal.request(GuestExit::PowerOff);
            } else {
                tracing::debug!(sleep_type, "ignoring a request for an unsupported sleep state");
            }
        }
    }
}

/// The FADT reset register: writing [`ACPI_RESET_VALUE`] resets the machine.
pub struct ResetRegister {
    signal: Arc<GuestExitSignal>,
}

impl ResetRegister {
    /// A reset register reporting to `signal`.
    pub fn new(signal: Arc<GuestExitSignal>) -> Self {
        ResetRegister { signal }
    }
}

impl BusDevice for ResetRegister {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        // Bit 2 starts the reset; 0x06 (full reset) and 0x04 both reset a PC.
        if data.first().is_some_and(|v| v & 0x04 != 0) {
            tracing::warn!("the guest resets through the ACPI reset register (port 0xcf9)");
            self.signal.request(GuestExit::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_s5_powers_off_other_states_ignored() {
        let signal = Arc::new(GuestExitSignal::new().unwrap());
        let mut dev = AcpiSleepControl::new(signal.clone());
        dev.write(0, &[(3 << 2) | SLP_EN]);
        assert_eq!(signal.exit(), None);
        dev.write(0, &[S5_SLEEP_TYPE << 2]);
        assert_eq!(signal.exit(), None);
        dev.write(0, &[(S5_SLEEP_TYPE << 2) | SLP_EN]);
        assert_eq!(signal.exit(), Some(GuestExit::PowerOff));
    }

    #[test]
    fn test_reset_register() {
        let signal = Arc::new(GuestExitSignal::new().unwrap());
        ResetRegister::new(signal.clone()).write(0, &[0x02]);
        assert_eq!(signal.exit(), None);
        ResetRegister::new(signal.clone()).write(0, &[ACPI_RESET_VALUE]);
        assert_eq!(signal.exit(), Some(GuestExit::Reset));
    }
}
