//! The firmware tables: RSDP, XSDT, FADT (hardware-reduced), MADT and DSDT, built with
//! `acpi_tables` and written into the BIOS area of guest memory.

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml};
use gdrvm_devices::{ACPI_RESET_PORT, ACPI_RESET_VALUE, ACPI_SLEEP_PORT, COM1_IRQ, COM1_PORT, S5_SLEEP_TYPE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::layout;

const OEM_ID: [u8; 6] = *b"GDRVM ";
const OEM_TABLE_ID: [u8; 8] = *b"GDRVMVM ";
const OEM_REVISION: u32 = 1;
/// IAPC_BOOT_ARCH: no VGA, no CMOS RTC (and no 8042: bit 1 clear), so Linux skips probing them.
const IAPC_BOOT_ARCH: u16 = (1 << 2) | (1 << 5);

/// One table and where it goes.
pub struct PlacedTable {
    /// Guest-physical address.
    pub addr: u64,
    /// Signature, for logs and tests.
    pub signature: String,
    /// The table's bytes, checksum included.
    pub bytes: Vec<u8>,
}

/// Errors writing the tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// The tables do not fit the BIOS area.
    #[error("ACPI tables need {0} bytes, more than the BIOS area holds")]
    TooBig(u64),
    /// Writing into guest memory failed.
    #[error("cannot write ACPI table {0} into guest memory")]
    GuestWrite(String),
}

/// Builds every table for a machine with `cpus` vCPUs, laid out from [`layout::ACPI_START`].
/// The RSDP comes first, at the start of the area where legacy scans look for it.
pub fn build(cpus: u32) -> Vec<PlacedTable> {
    let dsdt = dsdt();
    let madt = madt(cpus);
    let mut next = layout::ACPI_START + Rsdp::len() as u64;
    let mut place = |bytes: Vec<u8>| {
        let addr = next.next_multiple_of(8);
        next = addr + bytes.len() as u64;
        (addr, bytes)
    };
    let (dsdt_addr, dsdt) = place(dsdt);
    let (fadt_addr, fadt) = place(fadt(dsdt_addr));
    let (madt_addr, madt) = place(madt);
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let (xsdt_addr, xsdt) = place(to_bytes(&xsdt));
    let rsdp = to_bytes(&Rsdp::new(OEM_ID, xsdt_addr));

    [(layout::ACPI_START, rsdp), (dsdt_addr, dsdt), (fadt_addr, fadt), (madt_addr, madt), (xsdt_addr, xsdt)]
        .into_iter()
        .map(|(addr, bytes)| PlacedTable { addr, signature: String::from_utf8_lossy(&bytes[..4]).into_owned(), bytes })
        .collect()
}

/// Writes the tables into guest memory; returns the RSDP's address.
pub fn write(mem: &GuestMemoryMmap, cpus: u32) -> Result<u64, AcpiError> {
    let tables = build(cpus);
    let end = tables.iter().map(|t| t.addr + t.bytes.len() as u64).max().unwrap_or(layout::ACPI_START);
    if end > layout::BIOS_END {
        return Err(AcpiError::TooBig(end - layout::ACPI_START));
    }
    for t in &tables {
        mem.write_slice(&t.bytes, GuestAddress(t.addr)).map_err(|_| AcpiError::GuestWrite(t.signature.clone()))?;
    }
    Ok(layout::ACPI_START)
}

fn to_bytes(table: &dyn Aml) -> Vec<u8> {
    let mut bytes = Vec::new();
    table.to_aml_bytes(&mut bytes);
    bytes
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    let mut fadt = FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .flag(Flags::PwrButton)
        .flag(Flags::SlpButton);
    fadt.iapc_boot_arch = IAPC_BOOT_ARCH.into();
    fadt.reset_reg = io_register(ACPI_RESET_PORT);
    fadt.reset_value = ACPI_RESET_VALUE;
    fadt.sleep_control_reg = io_register(ACPI_SLEEP_PORT);
    fadt.sleep_status_reg = io_register(ACPI_SLEEP_PORT + 1);
    fadt.hypervisor_vendor_identity = u64::from_le_bytes(*b"GDRVM\0\0\0").into();
    to_bytes(&fadt.finalize())
}

fn io_register(port: u16) -> GAS {
    GAS::new(AddressSpace::SystemIo, 8, 0, AccessSize::ByteAccess, u64::from(port))
}

fn madt(cpus: u32) -> Vec<u8> {
    let mut madt =
        MADT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION, LocalInterruptController::Address(layout::LAPIC_START as u32));
    for id in 0..cpus {
        // cpus is validated to at most 254, so ids fit the 8-bit xAPIC entry.
        let id = id as u8;
        madt.add_structure(ProcessorLocalApic::new(id, id, EnabledStatus::Enabled));
    }
    // The IOAPIC's id follows the CPUs' so that no APIC ids collide.
    madt.add_structure(IoApic::new(cpus as u8, layout::IOAPIC_START as u32, 0));
    to_bytes(&madt)
}

fn dsdt() -> Vec<u8> {
    let mut body = Vec::new();
    // \_S5: the sleep type the OS writes to the sleep control register to power off.
    let s5 = aml::Package::new(vec![&S5_SLEEP_TYPE, &0u8, &0u8, &0u8]);
    aml::Name::new("_S5_".into(), &s5).to_aml_bytes(&mut body);
    Com1.to_aml_bytes(&mut body);
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}

/// COM1 as an ACPI device, so that Linux ties ttyS0 to firmware-described resources.
struct Com1;

impl Aml for Com1 {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        let hid = aml::EISAName::new("PNP0501");
        let io = aml::IO::new(COM1_PORT, COM1_PORT, 1, 8);
        let irq = aml::Interrupt::new(true, true, false, false, COM1_IRQ);
        let crs = aml::ResourceTemplate::new(vec![&io, &irq]);
        aml::Scope::new(
            "\\_SB_".into(),
            vec![&aml::Device::new(
                "COM1".into(),
                vec![
                    &aml::Name::new("_HID".into(), &hid),
                    &aml::Name::new("_UID".into(), &0u8),
                    &aml::Name::new("_CRS".into(), &crs),
                ],
            )],
        )
        .to_aml_bytes(sink);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checksum_ok(bytes: &[u8]) -> bool {
        bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
    }

    fn hexdump(bytes: &[u8]) -> String {
        bytes
            .chunks(16)
            .enumerate()
            .map(|(i, c)| {
                format!("{:04x}: {}", i * 16, c.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" "))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn test_tables_checksum_and_link_up() {
        let tables = build(4);
        let sigs: Vec<_> = tables.iter().map(|t| t.signature.as_str()).collect();
        assert_eq!(sigs, ["RSD ", "DSDT", "FACP", "APIC", "XSDT"]);
        let rsdp = &tables[0].bytes;
        assert!(checksum_ok(&rsdp[..20]) && checksum_ok(rsdp));
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().unwrap());
        assert_eq!(xsdt_addr, tables[4].addr);
        for t in &tables[1..] {
            assert!(checksum_ok(&t.bytes), "{} checksum", t.signature);
            let len = u32::from_le_bytes(t.bytes[4..8].try_into().unwrap()) as usize;
            assert_eq!(len, t.bytes.len(), "{} length", t.signature);
            assert_eq!(t.addr % 8, 0);
        }
        // X_DSDT in the FADT points at the DSDT.
        let fadt = &tables[2].bytes;
        assert_eq!(u64::from_le_bytes(fadt[140..148].try_into().unwrap()), tables[1].addr);
        // MADT: 4 local APICs (8 bytes each) and one IOAPIC (12 bytes) after the 44-byte header.
        assert_eq!(tables[3].bytes.len(), 44 + 4 * 8 + 12);
        let end = tables.iter().map(|t| t.addr + t.bytes.len() as u64).max().unwrap();
        assert!(end <= layout::BIOS_END);
    }

    #[test]
    fn test_table_bytes_snapshot() {
        let dump: String =
            build(2).iter().map(|t| format!("{} @ {:#x}\n{}\n", t.signature, t.addr, hexdump(&t.bytes))).collect();
        insta::assert_snapshot!(dump);
    }

    /// Disassembles every table with `iasl -d` (Debian `acpica-tools`) and requires no errors.
    #[test]
    fn test_tables_pass_iasl() {
        if std::process::Command::new("iasl").arg("-v").output().is_err() {
            eprintln!("SKIP test_tables_pass_iasl: iasl not installed (apt-get install acpica-tools)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for t in build(2).iter().filter(|t| t.signature != "RSD ") {
            let path = dir.path().join(format!("{}.dat", t.signature.to_lowercase()));
            std::fs::write(&path, &t.bytes).unwrap();
            let out = std::process::Command::new("iasl").arg("-d").arg(&path).current_dir(dir.path()).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "iasl -d {}: {text}", t.signature);
            assert!(!text.contains("Error") && !text.contains("Warning"), "iasl -d {}: {text}", t.signature);
        }
    }
}
