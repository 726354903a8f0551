//! `gdrvm-nic-emu`: the emulated RoCE NIC of a node file's endpoint, served over vfio-user.

fn main() -> std::process::ExitCode {
    gdrvm_devices::emu::cli::main(gdrvm_devices::emu::EmuKind::Nic)
}
