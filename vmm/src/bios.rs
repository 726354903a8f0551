//! The only BIOS gdrvm has: code at the reset vector that resets the machine.
//!
//! Linux reboots through the BIOS when nothing else is left: on hardware-reduced ACPI
//! without EFI runtime services it chooses `reboot=efi`, finds no EFI and falls back to
//! `machine_real_restart()`, which jumps to F000:FFF0 in real mode. With nothing there
//! the vCPU would execute zeroed memory forever (seen after `panic=-1`). This stub does
//! what a PC's firmware does on that jump: reset the machine, here through the ACPI reset
//! register the FADT describes.

use gdrvm_devices::{ACPI_RESET_PORT, ACPI_RESET_VALUE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Physical address of the real-mode reset vector F000:FFF0.
pub const RESET_VECTOR: u64 = 0xffff0;

/// Real-mode code: `mov al, RESET_VALUE; mov dx, RESET_PORT; out dx, al; cli; hlt; jmp $-2`.
pub fn reset_stub() -> [u8; 11] {
    let [port_lo, port_hi] = ACPI_RESET_PORT.to_le_bytes();
    [0xb0, ACPI_RESET_VALUE, 0xba, port_lo, port_hi, 0xee, 0xfa, 0xf4, 0xeb, 0xfd, 0x90]
}

/// Writes the stub at the reset vector.
pub fn write(mem: &GuestMemoryMmap) -> Result<(), vm_memory::GuestMemoryError> {
    mem.write_slice(&reset_stub(), GuestAddress(RESET_VECTOR))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_stub_writes_the_reset_register_and_fits_below_1mib() {
        let stub = reset_stub();
        assert_eq!(&stub[..6], &[0xb0, 0x06, 0xba, 0xf9, 0x0c, 0xee]);
        assert!(RESET_VECTOR + stub.len() as u64 <= gdrvm_model::layout::BIOS_END);
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write(&mem).unwrap();
        let mut back = [0u8; 11];
        mem.read_slice(&mut back, GuestAddress(RESET_VECTOR)).unwrap();
        assert_eq!(back, stub);
    }
}
