//! The firmware tables: RSDP, XSDT, FADT (hardware-reduced), MADT, DSDT (one PCI host
//! bridge per model host bridge), MCFG, SRAT and SLIT, built with `acpi_tables` and written
//! into the BIOS area of guest memory.

use std::collections::BTreeSet;
use std::ops::Range;

use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, LocalInterruptController, ProcessorLocalApic, MADT};
use acpi_tables::mcfg::MCFG;
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::slit::SLIT;
use acpi_tables::srat::{MemoryAffinity, SRAT};
use acpi_tables::xsdt::XSDT;
use acpi_tables::{aml, Aml};
use gdrvm_devices::{ACPI_RESET_PORT, ACPI_RESET_VALUE, ACPI_SLEEP_PORT, COM1_IRQ, COM1_LEN, COM1_PORT, S5_SLEEP_TYPE};
use gdrvm_model::layout::{self, ECAM_BASE, ECAM_SIZE};
use gdrvm_model::node::{HostBridge, Node, NumaNode};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::cpu_topology::{self, CpuPlace};

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

/// Builds every table for a machine with `cpus` vCPUs on `node`, laid out from
/// [`layout::ACPI_START`]. The RSDP comes first, at the start of the area where legacy scans
/// look for it.
pub fn build(cpus: &[CpuPlace], node: &Node) -> Vec<PlacedTable> {
    let numa = &node.numa;
    let dsdt = dsdt(node);
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
    let mut tables = vec![(dsdt_addr, dsdt), (fadt_addr, fadt), (madt_addr, madt)];
    tables.push(place(mcfg(&node.host_bridges)));
    // Always, one NUMA node included: without SRAT, Linux gives PCI devices numa_node -1.
    tables.push(place(srat(cpus, numa)));
    tables.push(place(slit(numa)));
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for (addr, _) in &tables[1..] {
        xsdt.add_entry(*addr);
    }
    tables.push(place(to_bytes(&xsdt)));
    let rsdp = to_bytes(&Rsdp::new(OEM_ID, tables[tables.len() - 1].0));
    tables.insert(0, (layout::ACPI_START, rsdp));

    tables
        .into_iter()
        .map(|(addr, bytes)| PlacedTable { addr, signature: String::from_utf8_lossy(&bytes[..4]).into_owned(), bytes })
        .collect()
}

/// Writes the tables into guest memory; returns the area they fill, which starts with the RSDP.
pub fn write(mem: &GuestMemoryMmap, cpus: &[CpuPlace], node: &Node) -> Result<Range<u64>, AcpiError> {
    let tables = build(cpus, node);
    let end = tables.iter().map(|t| t.addr + t.bytes.len() as u64).max().unwrap_or(layout::ACPI_START);
    if end > layout::BIOS_END {
        return Err(AcpiError::TooBig(end - layout::ACPI_START));
    }
    for t in &tables {
        mem.write_slice(&t.bytes, GuestAddress(t.addr)).map_err(|_| AcpiError::GuestWrite(t.signature.clone()))?;
    }
    Ok(layout::ACPI_START..end)
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

fn madt(cpus: &[CpuPlace]) -> Vec<u8> {
    let mut madt =
        MADT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION, LocalInterruptController::Address(layout::LAPIC_START as u32));
    for (uid, cpu) in (0u8..).zip(cpus) {
        // The config keeps APIC ids below 255, so the 8-bit xAPIC entry holds them.
        madt.add_structure(ProcessorLocalApic::new(uid, cpu.apic_id as u8, EnabledStatus::Enabled));
    }
    madt.add_structure(IoApic::new(cpu_topology::ioapic_id(cpus), layout::IOAPIC_START as u32, 0));
    to_bytes(&madt)
}

/// SRAT: memory affinity (from `acpi_tables`) and processor x2APIC affinity, which
/// `acpi_tables` 0.2 lacks and which are appended here by hand (ACPI 6.5, 5.2.16.3).
fn srat(cpus: &[CpuPlace], numa: &[NumaNode]) -> Vec<u8> {
    let mut srat = SRAT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    let sizes: Vec<u64> = numa.iter().map(|n| n.memory).collect();
    for (node, start, len) in layout::numa_ranges(&sizes) {
        srat.add_memory_affinity(MemoryAffinity::new(node, start, len).enabled());
    }
    let mut bytes = to_bytes(&srat);
    for cpu in cpus {
        // One package per NUMA node (see cpu_topology).
        bytes.extend_from_slice(&x2apic_affinity(cpu.socket, cpu.apic_id));
    }
    seal(&mut bytes);
    bytes
}

/// Processor Local x2APIC Affinity structure (type 2, 24 bytes), enabled.
fn x2apic_affinity(proximity_domain: u32, x2apic_id: u32) -> [u8; 24] {
    let mut e = [0u8; 24];
    e[0] = 2;
    e[1] = 24;
    e[4..8].copy_from_slice(&proximity_domain.to_le_bytes());
    e[8..12].copy_from_slice(&x2apic_id.to_le_bytes());
    e[12..16].copy_from_slice(&1u32.to_le_bytes());
    e
}

/// Sets a table's length field and checksum after bytes were appended to it.
fn seal(table: &mut [u8]) {
    let len = table.len() as u32;
    table[4..8].copy_from_slice(&len.to_le_bytes());
    table[9] = 0;
    table[9] = table.iter().fold(0u8, |a, b| a.wrapping_sub(*b));
}

/// SLIT: the NUMA distance matrix.
fn slit(numa: &[NumaNode]) -> Vec<u8> {
    let mut slit = SLIT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION, numa.len() as u32);
    for (i, node) in numa.iter().enumerate() {
        for (j, d) in node.distances.iter().enumerate() {
            slit.set_distance(i, j, *d);
        }
    }
    to_bytes(&slit)
}

/// MCFG: ECAM for segment 0, from bus 0 up to the last bus of the node's tree. Not all
/// 256: x86 Linux takes MCFG's end bus as the last bus of the machine and, after the ACPI
/// scan, probes every bus up to it that no host bridge claimed, 32 devices each, for peer
/// root buses (`pcibios_fixup_peer_bridges`): with 255 that was 8000 configuration reads,
/// a quarter of the exits of a minimal guest's boot.
fn mcfg(host_bridges: &[HostBridge]) -> Vec<u8> {
    let mut mcfg = MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    mcfg.add_ecam(ECAM_BASE, 0, 0, last_bus(host_bridges));
    to_bytes(&mcfg)
}

/// The last bus number any host bridge of the tree claims (0 with none).
fn last_bus(host_bridges: &[HostBridge]) -> u8 {
    host_bridges.iter().map(|hb| hb.last_bus).max().unwrap_or(0)
}

fn dsdt(node: &Node) -> Vec<u8> {
    let mut body = Vec::new();
    // \_S5: the sleep type the OS writes to the sleep control register to power off.
    let s5 = aml::Package::new(vec![&S5_SLEEP_TYPE, &0u8, &0u8, &0u8]);
    aml::Name::new("_S5_".into(), &s5).to_aml_bytes(&mut body);
    Com1.to_aml_bytes(&mut body);
    for (uid, hb) in node.host_bridges.iter().enumerate() {
        let slots = node
            .functions
            .iter()
            .filter(|f| f.host_bridge == uid && f.parent.is_none())
            .map(|f| f.bdf.device)
            .collect();
        PciHostBridge { uid: uid as u32, hb, routing: RoutingTable { slots } }.to_aml_bytes(&mut body);
    }
    EcamReservation.to_aml_bytes(&mut body);
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}

/// COM1 as an ACPI device, so that Linux ties ttyS0 to firmware-described resources.
struct Com1;

impl Aml for Com1 {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        let io = aml::IO::new(COM1_PORT, COM1_PORT, 1, COM1_LEN);
        let irq = aml::Interrupt::new(true, true, false, false, COM1_IRQ);
        system_bus_device(sink, "COM1", "PNP0501", &aml::ResourceTemplate::new(vec![&io, &irq]));
    }
}

/// `Scope (\_SB) { Device (name) { _HID, _UID 0, _CRS } }`.
fn system_bus_device(sink: &mut dyn acpi_tables::AmlSink, name: &str, hid: &str, crs: &dyn Aml) {
    let hid = aml::EISAName::new(hid);
    aml::Scope::new(
        "\\_SB_".into(),
        vec![&aml::Device::new(
            name.into(),
            vec![
                &aml::Name::new("_HID".into(), &hid),
                &aml::Name::new("_UID".into(), &0u8),
                &aml::Name::new("_CRS".into(), crs),
            ],
        )],
    )
    .to_aml_bytes(sink);
}

/// The IOAPIC input of legacy INTx `pin` (0 = INTA .. 3 = INTD) of root-bus slot `slot`:
/// eight shared level-triggered lines, GSIs 16-23, spread over slots and pins as QEMU's
/// q35 does. Devices behind bridges reach them through the standard swizzle.
pub fn intx_gsi(slot: u8, pin: u8) -> u32 {
    16 + (u32::from(slot) + u32::from(pin)) % 8
}

/// `_PRT`: the four INTx pins of every occupied slot of a root bus to their IOAPIC inputs
/// ([`intx_gsi`]). Only those slots: nothing is ever plugged into the others (the tree is
/// fixed), devices behind bridges reach a root-bus slot's entries through the swizzle, and
/// the guest pays for every entry. ACPICA builds each one into an object when it loads the
/// DSDT, and Linux evaluates and converts the whole table again for every device it
/// enables. With all 32 slots (128 entries a bridge, as QEMU writes them) vela-a100's five
/// bridges carried 640 entries, now 40 (the gain nested is below the run-to-run noise).
struct RoutingTable {
    /// Device numbers in use on the root bus.
    slots: BTreeSet<u8>,
}

impl Aml for RoutingTable {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        let mut table = aml::PackageBuilder::new();
        for &slot in &self.slots {
            for pin in 0..4u8 {
                // (address: slot in the high word, any function; pin; no link device; GSI)
                let address = u32::from(slot) << 16 | 0xffff;
                let gsi = intx_gsi(slot, pin);
                table.add_element(&aml::Package::new(vec![&address, &pin, &0u8, &gsi]));
            }
        }
        aml::Name::new("_PRT".into(), &table).to_aml_bytes(sink);
    }
}

/// A PCI Express host bridge (PNP0A08, compatible PNP0A03) with its segment, root bus,
/// NUMA node, windows and INTx routing, like QEMU's pxb-pcie.
struct PciHostBridge<'a> {
    uid: u32,
    hb: &'a HostBridge,
    routing: RoutingTable,
}

impl Aml for PciHostBridge<'_> {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        let hb = self.hb;
        let (hid, cid) = (aml::EISAName::new("PNP0A08"), aml::EISAName::new("PNP0A03"));
        let buses = aml::AddressSpace::new_bus_number(u16::from(hb.first_bus), u16::from(hb.last_bus));
        let mem32 = hb.mem32.map(|w| {
            aml::AddressSpace::new_memory(
                aml::AddressSpaceCacheable::NotCacheable,
                true,
                w.base as u32,
                w.last() as u32,
                None,
            )
        });
        let mem64 = hb.mem64.map(|w| {
            aml::AddressSpace::new_memory(aml::AddressSpaceCacheable::PreFetchable, true, w.base, w.last(), None)
        });
        let mut resources: Vec<&dyn Aml> = vec![&buses];
        if let Some(m) = &mem32 {
            resources.push(m);
        }
        if let Some(m) = &mem64 {
            resources.push(m);
        }
        let crs = aml::ResourceTemplate::new(resources);
        let (bbn, pxm) = (u32::from(hb.first_bus), hb.numa);
        aml::Scope::new(
            "\\_SB_".into(),
            vec![&aml::Device::new(
                format!("PC{:02X}", self.uid).as_str().into(),
                vec![
                    &aml::Name::new("_HID".into(), &hid),
                    &aml::Name::new("_CID".into(), &cid),
                    &aml::Name::new("_UID".into(), &self.uid),
                    &aml::Name::new("_SEG".into(), &0u32),
                    &aml::Name::new("_BBN".into(), &bbn),
                    &aml::Name::new("_PXM".into(), &pxm),
                    &aml::Name::new("_CRS".into(), &crs),
                    &self.routing,
                ],
            )],
        )
        .to_aml_bytes(sink);
    }
}

/// A motherboard resource (PNP0C02) claiming the ECAM area, as Linux requires before it
/// trusts MCFG.
struct EcamReservation;

impl Aml for EcamReservation {
    fn to_aml_bytes(&self, sink: &mut dyn acpi_tables::AmlSink) {
        let ecam = aml::Memory32Fixed::new(false, ECAM_BASE as u32, ECAM_SIZE as u32);
        system_bus_device(sink, "ECAM", "PNP0C02", &aml::ResourceTemplate::new(vec![&ecam]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_topology;

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
        let tables = build(&cpu_topology::layout(4, &[]), &Node::plain(4, 1 << 30));
        let sigs: Vec<_> = tables.iter().map(|t| t.signature.as_str()).collect();
        assert_eq!(sigs, ["RSD ", "DSDT", "FACP", "APIC", "MCFG", "SRAT", "SLIT", "XSDT"]);
        let rsdp = &tables[0].bytes;
        assert!(checksum_ok(&rsdp[..20]) && checksum_ok(rsdp));
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().unwrap());
        assert_eq!(xsdt_addr, tables[7].addr);
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
        let dump: String = build(&cpu_topology::layout(2, &[]), &Node::plain(2, 1 << 30))
            .iter()
            .map(|t| format!("{} @ {:#x}\n{}\n", t.signature, t.addr, hexdump(&t.bytes)))
            .collect();
        insta::assert_snapshot!(dump);
    }

    /// vela-a100 scaled to two vCPUs and 1 GiB: two NUMA nodes, five host bridges.
    fn vela() -> Node {
        Node::preset("vela-a100").unwrap().unwrap().scaled(Some(2), Some(1 << 30)).unwrap()
    }

    #[test]
    fn test_numa_tables() {
        let node = vela();
        let tables = build(&cpu_topology::layout(2, &node.numa), &node);
        let sigs: Vec<_> = tables.iter().map(|t| t.signature.as_str()).collect();
        assert_eq!(sigs, ["RSD ", "DSDT", "FACP", "APIC", "MCFG", "SRAT", "SLIT", "XSDT"]);
        for t in &tables[1..] {
            assert!(checksum_ok(&t.bytes), "{} checksum", t.signature);
            assert_eq!(u32::from_le_bytes(t.bytes[4..8].try_into().unwrap()) as usize, t.bytes.len());
        }
        // SRAT: 48-byte header, two memory affinities (40 bytes), two x2APIC affinities (24).
        let srat = &tables[5].bytes;
        assert_eq!(srat.len(), 48 + 2 * 40 + 2 * 24);
        let cpu1 = &srat[48 + 80 + 24..];
        assert_eq!((cpu1[0], cpu1[1]), (2, 24));
        assert_eq!(u32::from_le_bytes(cpu1[4..8].try_into().unwrap()), 1, "proximity domain");
        assert_eq!(u32::from_le_bytes(cpu1[8..12].try_into().unwrap()), 1, "x2APIC id");
        // SLIT: 8-byte locality count, then the matrix.
        assert_eq!(&tables[6].bytes[36..], &[2, 0, 0, 0, 0, 0, 0, 0, 10, 21, 21, 10]);
        // The XSDT lists FADT, MADT, MCFG, SRAT and SLIT.
        assert_eq!(tables[7].bytes.len(), 36 + 5 * 8);
        insta::assert_snapshot!(tables[4..7]
            .iter()
            .map(|t| format!("{} @ {:#x}\n{}\n", t.signature, t.addr, hexdump(&t.bytes)))
            .collect::<String>());
    }

    /// Disassembles every table with `iasl -d` (Debian `acpica-tools`) and requires no errors.
    #[test]
    fn test_tables_pass_iasl() {
        if std::process::Command::new("iasl").arg("-v").output().is_err() {
            eprintln!("SKIP test_tables_pass_iasl: iasl not installed (apt-get install acpica-tools)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for node in [vela(), Node::preset("flat").unwrap().unwrap(), Node::plain(1, 1 << 30)] {
            let cpus = cpu_topology::layout(node.numa.len() as u32, &node.numa);
            for t in build(&cpus, &node).iter().filter(|t| t.signature != "RSD ") {
                let dsl = disassemble(dir.path(), t);
                if node.name == "vela-a100" && ["DSDT", "MCFG"].contains(&t.signature.as_str()) {
                    insta::assert_snapshot!(format!("vela_a100_{}", t.signature.to_lowercase()), dsl);
                }
            }
        }
    }

    /// `iasl -d` of one table, requiring no errors or warnings; the disassembly without
    /// iasl's header comment (which names the tool version and date).
    fn disassemble(dir: &std::path::Path, t: &PlacedTable) -> String {
        let path = dir.join(format!("{}.dat", t.signature.to_lowercase()));
        std::fs::write(&path, &t.bytes).unwrap();
        let out = std::process::Command::new("iasl").arg("-d").arg(&path).current_dir(dir).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "iasl -d {}: {text}", t.signature);
        assert!(!text.contains("Error") && !text.contains("Warning"), "iasl -d {}: {text}", t.signature);
        let dsl = std::fs::read_to_string(path.with_extension("dsl")).unwrap();
        dsl.lines()
            .skip_while(|l| l.starts_with("/*") || l.starts_with(" *"))
            .filter(|l| !l.contains("Checksum") && !l.contains("Compiler Version") && !l.contains("Compiler ID"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
