//! The wiring driven as a guest drives it, against a fake device, fake KVM memory slots
//! and a fake GSI routing table: BARs placed where firmware leaves them, moved, removed
//! with decode, device memory in the DMA space, MSI-X table writes becoming routes.

use std::sync::{Arc, Mutex};

use gdrvm_devices::pci_regs::*;
use gdrvm_devices::{
    lock, BarInfo, BarMapping, Bus, DeviceError, DeviceId, DmaError, DmaRegion, DmaTarget, MsiInfo, MsixLayout,
    PciDevice,
};
use gdrvm_model::host_pci::HostBdf;
use gdrvm_model::node::{Backing, Node};
use kvm_bindings::{kvm_irq_routing_entry, kvm_userspace_memory_region, KVM_IRQ_ROUTING_MSI, KVM_MEM_READONLY};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::irq::{GsiRouter, IrqError, RoutingSink};
use crate::pci::{Ecam, PciSegment, CONFIG_SPACE_SIZE};

/// What the fakes saw.
#[derive(Default)]
struct Seen {
    slots: Vec<kvm_userspace_memory_region>,
    routes: Vec<Vec<kvm_irq_routing_entry>>,
    config_writes: Vec<(usize, Vec<u8>)>,
    /// Configuration reads the device was asked for.
    config_reads: usize,
    bar_reads: Vec<(u8, u64)>,
    connected: Vec<Option<usize>>,
    msi_connected: Vec<Option<usize>>,
    /// INTx connected (true) or disconnected (false), in order.
    intx: Vec<bool>,
    /// GSIs resampling irqfds were registered on.
    intx_gsis: Vec<u32>,
    dma: Vec<(bool, u64, u64)>,
    /// ioeventfds registered (true) or removed (false), by address.
    ioevents: Vec<(u64, bool)>,
    /// Refuse read-only slots, as a KVM out of slots would.
    refuse_readonly: bool,
    /// GSIs with a plain irqfd (an MSI or MSI-X vector's) registered now.
    irqfds: Vec<u32>,
    /// Device resets asked for.
    resets: usize,
}

type Shared = Arc<Mutex<Seen>>;

struct FakeKvm(Shared);

impl MemorySink for FakeKvm {
    unsafe fn set_region(&self, region: kvm_userspace_memory_region) -> Result<(), kvm_ioctls::Error> {
        let mut seen = lock(&self.0);
        if seen.refuse_readonly && region.flags & KVM_MEM_READONLY != 0 {
            return Err(kvm_ioctls::Error::new(libc::ENOSPC));
        }
        seen.slots.push(region);
        Ok(())
    }

    fn ioevent(&self, _fd: &vmm_sys_util::eventfd::EventFd, gpa: u64, on: bool) -> Result<(), kvm_ioctls::Error> {
        lock(&self.0).ioevents.push((gpa, on));
        Ok(())
    }
}

impl RoutingSink for FakeKvm {
    fn max_routes(&self) -> usize {
        4096
    }
    fn set_gsi_routing(&self, entries: &[kvm_irq_routing_entry]) -> Result<(), IrqError> {
        lock(&self.0).routes.push(entries.to_vec());
        Ok(())
    }
    fn register_irqfd(&self, _: &EventFd, gsi: u32) -> Result<(), IrqError> {
        lock(&self.0).irqfds.push(gsi);
        Ok(())
    }
    fn register_irqfd_with_resample(&self, _: &EventFd, _: &EventFd, gsi: u32) -> Result<(), IrqError> {
        lock(&self.0).intx_gsis.push(gsi);
        Ok(())
    }
    fn unregister_irqfd(&self, _: &EventFd, gsi: u32) -> Result<(), IrqError> {
        lock(&self.0).irqfds.retain(|g| *g != gsi);
        Ok(())
    }
}

struct FakeDma(Shared);

impl DmaTarget for FakeDma {
    fn map(&mut self, r: &DmaRegion) -> Result<(), DmaError> {
        lock(&self.0).dma.push((true, r.iova, r.size));
        Ok(())
    }
    fn unmap(&mut self, iova: u64, size: u64) -> Result<(), DmaError> {
        lock(&self.0).dma.push((false, iova, size));
        Ok(())
    }
}

/// minimal's NIC VF with: BAR0 2 MiB of device memory (a memfd), MSI-X (4 vectors) in
/// its first page, and a PCI Express capability that offers FLR; its other configuration
/// bytes read as zero.
struct FakeNic {
    seen: Shared,
    memory: Arc<std::fs::File>,
    /// Whether its reset is a real one (not on [`NO_RESET`]).
    can_reset: bool,
}

/// A vfio-user socket whose fake offers no device reset.
const NO_RESET: &str = "/no-reset.sock";

const MSIX: MsixLayout = MsixLayout { cap: 0x70, vectors: 4, table: (0, 0), pba: (0, 0x800) };
/// Where the fake's MSI capability is (the VMM emulates it there).
const MSI_CAP: usize = 0x50;
/// Where the fake's PCI Express capability is (the only one its list holds).
const EXP_CAP: usize = 0x60;

/// The fake's configuration byte at `reg`.
fn fake_config(reg: usize) -> u8 {
    let devcap = PCI_EXP_DEVCAP_FLR.to_le_bytes();
    match reg {
        PCI_STATUS => PCI_STATUS_CAP_LIST as u8,
        PCI_CAPABILITY_LIST => EXP_CAP as u8,
        r if r == EXP_CAP => PCI_CAP_ID_EXP,
        r if (EXP_CAP + PCI_EXP_DEVCAP..EXP_CAP + PCI_EXP_DEVCAP + 4).contains(&r) => {
            devcap[r - EXP_CAP - PCI_EXP_DEVCAP]
        }
        _ => 0,
    }
}

impl PciDevice for FakeNic {
    fn config_read(&mut self, reg: usize, data: &mut [u8]) {
        lock(&self.seen).config_reads += 1;
        for (k, b) in data.iter_mut().enumerate() {
            *b = fake_config(reg + k);
        }
    }
    fn config_write(&mut self, reg: usize, data: &[u8]) {
        lock(&self.seen).config_writes.push((reg, data.to_vec()));
    }
    fn bar_read(&mut self, bar: u8, offset: u64, data: &mut [u8]) {
        lock(&self.seen).bar_reads.push((bar, offset));
        data.fill(0x5a);
    }
    fn bar_write(&mut self, _bar: u8, _offset: u64, _data: &[u8]) {}
    fn bars(&self) -> Vec<BarInfo> {
        let mapping = BarMapping::Mapped { fd: self.memory.clone(), offset: 0, holes: Vec::new() };
        vec![BarInfo { index: 0, size: 2 << 20, is_64bit: true, prefetchable: true, mapping }]
    }
    fn msix(&self) -> Option<MsixLayout> {
        Some(MSIX)
    }
    fn connect_msix(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        lock(&self.seen).connected.push(vectors.map(<[_]>::len));
        Ok(())
    }
    fn msi(&self) -> Option<MsiInfo> {
        Some(MsiInfo { cap: MSI_CAP, vectors: 4, is_64bit: true, per_vector_mask: false })
    }
    fn connect_msi(&mut self, vectors: Option<&[&EventFd]>) -> Result<(), DeviceError> {
        lock(&self.seen).msi_connected.push(vectors.map(<[_]>::len));
        Ok(())
    }
    fn intx_pin(&self) -> Option<u8> {
        Some(1)
    }
    fn connect_intx(&mut self, lines: Option<(&EventFd, &EventFd)>) -> Result<(), DeviceError> {
        lock(&self.seen).intx.push(lines.is_some());
        Ok(())
    }
    fn reset(&mut self) -> Result<(), DeviceError> {
        lock(&self.seen).resets += 1;
        Ok(())
    }
    fn can_reset(&self) -> bool {
        self.can_reset
    }
}

struct Machine {
    seen: Shared,
    node: Node,
    nic: usize,
    mmio: Arc<Bus>,
    pci: Arc<PciSegment>,
    wiring: Arc<DeviceWiring>,
}

/// Preset minimal with a fake NIC behind nic0 (the preset's GPU is hollow here).
fn machine() -> Machine {
    machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::VfioUser("/fake.sock".into()))
}

/// `node` with a fake NIC behind each function named in `backed` (the first is the
/// machine's `nic`), as `backing` says (a fake either way), and nothing behind the others;
/// started, and each backed function's memory decode turned on, as the guest's driver does.
fn machine_on(node: Node, backed: &[&str], backing: Backing) -> Machine {
    let m = started_machine_on(node, backed, backing);
    for name in backed {
        let i = m.node.functions.iter().position(|f| f.name == *name).unwrap();
        m.config_write_to(i, PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    }
    m
}

/// [`machine_on`] as the wiring starts it, before the guest touches anything.
fn started_machine_on(mut node: Node, backed: &[&str], backing: Backing) -> Machine {
    let seen: Shared = Arc::default();
    let index = |name: &str| node.functions.iter().position(|f| f.name == name).unwrap();
    let nic = index(backed[0]);
    let backed: Vec<usize> = backed.iter().map(|n| index(n)).collect();
    for (i, f) in node.functions.iter_mut().enumerate() {
        f.backing = if backed.contains(&i) { backing.clone() } else { Backing::None };
    }
    let memfd = memfd(2 << 20);
    let kvm = Arc::new(FakeKvm(seen.clone()));
    let mmio = Arc::new(Bus::new("mmio"));
    let parts = MachineParts { memory: kvm.clone(), mmio: mmio.clone(), irq: Arc::new(GsiRouter::new(kvm).unwrap()) };
    // The NIC's own DMA target sees guest RAM; an observer (another device) its BAR.
    let open = |node: &Node, i: usize| -> Result<Option<Opened>, String> {
        let can_reset = node.functions[i].backing != Backing::VfioUser(NO_RESET.into());
        let device: Arc<Mutex<dyn PciDevice>> =
            Arc::new(Mutex::new(FakeNic { seen: seen.clone(), memory: memfd.clone(), can_reset }));
        Ok(Some(Opened { device, dma: Some(Box::new(FakeDma(Arc::default()))), process: None }))
    };
    let (wiring, functions) = DeviceWiring::new(
        &node,
        parts,
        &[super::GuestRamRegion { gpa: 0, size: 1 << 30, host_addr: 0x7000_0000, file: None }],
        &open,
    )
    .unwrap();
    lock(wiring.dma()).add_target(DeviceId(999), Box::new(FakeDma(seen.clone())), true).unwrap();
    let pci = Arc::new(PciSegment::with_functions(&node, functions));
    let sink: Arc<dyn ApplyEffects> = wiring.clone();
    pci.set_effects(Arc::downgrade(&sink));
    mmio.insert(
        Arc::new(Mutex::new(Ecam(pci.clone()))),
        gdrvm_model::layout::ECAM_BASE,
        gdrvm_model::layout::ECAM_SIZE,
    )
    .unwrap();
    wiring.start(&pci);
    Machine { seen, node, nic, mmio, pci, wiring }
}

fn memfd(size: u64) -> Arc<std::fs::File> {
    // SAFETY: a NUL-terminated name; the returned fd is checked and then owned by the File.
    let fd = unsafe { libc::memfd_create(c"fake-bar".as_ptr(), 0) };
    assert!(fd >= 0);
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(size).unwrap();
    Arc::new(file)
}

impl Machine {
    fn config_write(&self, reg: usize, data: &[u8]) {
        self.config_write_to(self.nic, reg, data);
    }

    fn config_write_to(&self, i: usize, reg: usize, data: &[u8]) {
        let bdf = self.node.functions[i].bdf;
        self.pci.write(bdf.bus, bdf.device << 3 | bdf.function, reg, data);
    }

    fn bar0(&self) -> u64 {
        self.node.functions[self.nic].bars[0].address
    }

    /// Live KVM slots at the end: slot -> (gpa, size).
    fn live_slots(&self) -> std::collections::BTreeMap<u32, (u64, u64)> {
        let mut live = std::collections::BTreeMap::new();
        for r in &lock(&self.seen).slots {
            if r.memory_size == 0 {
                live.remove(&r.slot);
            } else {
                live.insert(r.slot, (r.guest_phys_addr, r.memory_size));
            }
        }
        live
    }
}

#[test]
fn test_decode_starts_off_and_turning_it_on_maps_the_bar_with_its_msix_page_trapped() {
    let m = started_machine_on(
        Node::preset("minimal").unwrap().unwrap(),
        &["nic0"],
        Backing::VfioUser("/fake.sock".into()),
    );
    let bar0 = m.bar0();
    // Started: the BAR is assigned but decodes nothing, as firmware without a driver leaves it.
    let mut command = [0u8; 2];
    let bdf = m.node.functions[m.nic].bdf;
    m.pci.read(bdf.bus, bdf.device << 3 | bdf.function, PCI_COMMAND, &mut command);
    assert_eq!(u16::from_le_bytes(command), 0);
    assert!(m.live_slots().is_empty() && !m.mmio.ranges().iter().any(|&(b, _)| b == bar0));
    let in_bar = |iova: u64| (bar0..bar0 + (2 << 20)).contains(&iova);
    assert!(!lock(&m.seen).dma.iter().any(|&(_, iova, _)| in_bar(iova)), "nothing of the BAR in the DMA space yet");
    // The guest's driver turns decode on; the device hears it.
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    assert!(lock(&m.seen).config_writes.contains(&(PCI_COMMAND, PCI_COMMAND_MEMORY.to_le_bytes().to_vec())));
    // Device memory past the MSI-X page is one KVM slot; the page itself is trapped.
    let slots: Vec<(u64, u64)> = m.live_slots().into_values().collect();
    assert_eq!(slots, [(bar0 + 0x1000, (2 << 20) - 0x1000)]);
    assert!(m.mmio.ranges().contains(&(bar0, 0x1000)), "{:x?}", m.mmio.ranges());
    // The mapped part is in the DMA space, owned by the NIC: peer-to-peer for others.
    assert_eq!(lock(&m.seen).dma.last(), Some(&(true, bar0 + 0x1000, (2 << 20) - 0x1000)));
    // A read in the trapped page but outside the MSI-X structures reaches the device.
    let mut b = [0u8; 4];
    m.mmio.read(bar0 + 0xc00, &mut b);
    assert_eq!((b, lock(&m.seen).bar_reads.last().copied()), ([0x5a; 4], Some((0, 0xc00))));
}

#[test]
fn test_sizing_parks_the_bar_and_a_move_takes_the_slots_along() {
    let m = machine();
    let (old, new) = (m.bar0(), m.bar0() + (64 << 20));
    let flags = PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH;
    let before = m.live_slots();
    // Linux sizes every BAR with decode off and puts the same address back: no KVM slot
    // and no trap changes on the way.
    m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
    assert_eq!(m.live_slots(), before, "decode off parks the BAR where it is");
    m.config_write(PCI_BASE_ADDRESS_0, &u32::MAX.to_le_bytes());
    m.config_write(PCI_BASE_ADDRESS_0 + 4, &u32::MAX.to_le_bytes());
    m.config_write(PCI_BASE_ADDRESS_0, &(old as u32 | flags).to_le_bytes());
    m.config_write(PCI_BASE_ADDRESS_0 + 4, &((old >> 32) as u32).to_le_bytes());
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    assert_eq!(m.live_slots(), before, "sized and put back: nothing moved");
    assert!(m.mmio.ranges().iter().any(|&(b, _)| b == old), "the trap stayed");
    // A real move: decode off, a new address, decode on.
    m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
    m.config_write(
        PCI_BASE_ADDRESS_0,
        &(new as u32 | PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH).to_le_bytes(),
    );
    m.config_write(PCI_BASE_ADDRESS_0 + 4, &((new >> 32) as u32).to_le_bytes());
    // The device never sees the guest's BAR addresses.
    assert!(!lock(&m.seen)
        .config_writes
        .iter()
        .any(|(reg, _)| (PCI_BASE_ADDRESS_0..PCI_BASE_ADDRESS_0 + 8).contains(reg)));
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    let slots: Vec<(u64, u64)> = m.live_slots().into_values().collect();
    assert_eq!(slots, [(new + 0x1000, (2 << 20) - 0x1000)]);
    assert!(!m.mmio.ranges().iter().any(|&(b, _)| b == old), "the old trap is gone");
    let dma = lock(&m.seen).dma.clone();
    assert!(
        dma.contains(&(false, old + 0x1000, (2 << 20) - 0x1000))
            && dma.last() == Some(&(true, new + 0x1000, (2 << 20) - 0x1000)),
        "{dma:x?}"
    );
    drop(m.wiring);
}

#[test]
fn test_a_passed_through_devices_bar_is_removed_while_its_decode_is_off() {
    let bdf = HostBdf { domain: 0, bus: 0x3b, device: 0, function: 0 };
    let m = machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::Vfio(bdf));
    let bar0 = m.bar0();
    assert!(!m.live_slots().is_empty());
    // vfio-pci revokes the mapping while decode is off: the slot must not outlive it.
    m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
    assert!(m.live_slots().is_empty(), "decode off removes the slot");
    assert!(!m.mmio.ranges().iter().any(|&(b, _)| b == bar0), "and the trap");
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    let slots: Vec<(u64, u64)> = m.live_slots().into_values().collect();
    assert_eq!(slots, [(bar0 + 0x1000, (2 << 20) - 0x1000)]);
}

#[test]
fn test_a_bar_placed_over_a_parked_one_evicts_it() {
    let text = r#"
name = "two-nics"
[[numa]]
cpus = 1
memory = "1G"
[[host_bridge]]
name = "pxb0"
numa = 0
[[root_port]]
name = "rp0"
host_bridge = "pxb0"
link = "16GT/s x16"
[[switch]]
name = "sw0"
parent = "rp0"
ports = 2
link = "16GT/s x16"
[[endpoint]]
name = "nic0"
kind = "nic"
parent = "sw0"
vendor = 0x15b3
device = 0x101e
link = "16GT/s x16"
bars = [{ size = "2M", prefetchable = true }]
[[endpoint]]
name = "nic1"
kind = "nic"
parent = "sw0"
vendor = 0x15b3
device = 0x101e
link = "16GT/s x16"
bars = [{ size = "2M", prefetchable = true }]
"#;
    let m = machine_on(Node::parse("two-nics.toml", text).unwrap(), &["nic0", "nic1"], Backing::VfioUser("/x".into()));
    let nic1 = m.node.functions.iter().position(|f| f.name == "nic1").unwrap();
    let theirs = m.node.functions[nic1].bars[0].address;
    let flags = PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH;
    // nic1's decode goes off: parked, still mapped.
    m.config_write_to(nic1, PCI_COMMAND, &0u16.to_le_bytes());
    assert!(m.live_slots().values().any(|&(gpa, _)| gpa == theirs + 0x1000));
    // nic0 moves onto nic1's parked BAR: nic1's goes, nic0's takes its place.
    m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
    m.config_write(PCI_BASE_ADDRESS_0, &(theirs as u32 | flags).to_le_bytes());
    m.config_write(PCI_BASE_ADDRESS_0 + 4, &((theirs >> 32) as u32).to_le_bytes());
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    let slots: Vec<(u64, u64)> = m.live_slots().into_values().collect();
    assert_eq!(slots, [(theirs + 0x1000, (2 << 20) - 0x1000)], "one mapping at that address: nic0's");
    assert_eq!(m.mmio.ranges().iter().filter(|&&(b, _)| b == theirs).count(), 1, "one trap there");
}

#[test]
fn test_msix_table_writes_become_routes_and_enable_connects_the_device() {
    let m = machine();
    let bar0 = m.bar0();
    // Linux: MSI-X enable with the function masked, program vector 2, unmask it, unmask all.
    let flags = MSIX.cap + PCI_MSIX_FLAGS;
    m.config_write(flags, &(PCI_MSIX_FLAGS_ENABLE | PCI_MSIX_FLAGS_MASKALL).to_le_bytes());
    assert_eq!(lock(&m.seen).connected, [Some(4)]);
    let entry = bar0 + 2 * 16;
    m.mmio.write(entry, &0xfee0_1000u32.to_le_bytes());
    m.mmio.write(entry + 4, &0u32.to_le_bytes());
    m.mmio.write(entry + 8, &0x4041u32.to_le_bytes());
    m.mmio.write(entry + 12, &0u32.to_le_bytes());
    m.config_write(flags, &PCI_MSIX_FLAGS_ENABLE.to_le_bytes());
    let table = lock(&m.seen).routes.last().cloned().unwrap();
    let msi: Vec<_> = table.iter().filter(|e| e.type_ == KVM_IRQ_ROUTING_MSI).collect();
    assert_eq!(msi.len(), 1, "one routed vector");
    // SAFETY: an MSI entry's union holds the `msi` member.
    let (lo, data) = unsafe { (msi[0].u.msi.address_lo, msi[0].u.msi.data) };
    assert_eq!((lo, data), (0xfee0_1000, 0x4041));
    // The guest reads back what it wrote; the device never saw the table.
    let mut b = [0u8; 4];
    m.mmio.read(entry + 8, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x4041);
    assert!(lock(&m.seen).bar_reads.is_empty());
    m.config_write(flags, &0u16.to_le_bytes());
    assert_eq!(lock(&m.seen).connected, [Some(4), None]);
}

#[test]
fn test_msi_is_the_vmms_and_enable_connects_the_vectors_it_grants() {
    let m = machine();
    let bdf = m.node.functions[m.nic].bdf;
    let read16 = |reg: usize| {
        let mut b = [0u8; 2];
        m.pci.read(bdf.bus, bdf.device << 3 | bdf.function, reg, &mut b);
        u16::from_le_bytes(b)
    };
    // The emulated capability: MSI, 64-bit, four vectors offered (Multiple Message Capable 2).
    assert_eq!(read16(MSI_CAP) & 0xff, u16::from(PCI_CAP_ID_MSI));
    let flags = read16(MSI_CAP + PCI_MSI_FLAGS);
    assert_eq!((flags & PCI_MSI_FLAGS_64BIT != 0, (flags & PCI_MSI_FLAGS_QMASK) >> 1), (true, 2));
    // Linux: address, data, then enable with two vectors (Multiple Message Enable 1).
    m.config_write(MSI_CAP + PCI_MSI_ADDRESS_LO, &0xfee0_2000u32.to_le_bytes());
    m.config_write(MSI_CAP + PCI_MSI_ADDRESS_HI, &0u32.to_le_bytes());
    m.config_write(MSI_CAP + PCI_MSI_DATA_64, &0x4052u16.to_le_bytes());
    m.config_write(MSI_CAP + PCI_MSI_FLAGS, &(PCI_MSI_FLAGS_ENABLE | 1 << 4).to_le_bytes());
    assert_eq!(lock(&m.seen).msi_connected, [Some(2)]);
    let table = lock(&m.seen).routes.last().cloned().unwrap();
    // SAFETY: MSI entries' unions hold the `msi` member.
    let mut data: Vec<u32> =
        table.iter().filter(|e| e.type_ == KVM_IRQ_ROUTING_MSI).map(|e| unsafe { e.u.msi.data }).collect();
    data.sort();
    assert_eq!(data, [0x4052, 0x4053], "vector i sends data + i");
    // Without per-vector masking both vectors deliver at once: each has its irqfd.
    assert_eq!(lock(&m.seen).irqfds.len(), 2, "both vectors deliver");
    // The device never saw the capability's registers.
    assert!(!lock(&m.seen).config_writes.iter().any(|(reg, _)| (MSI_CAP..MSI_CAP + 14).contains(reg)));
    m.config_write(MSI_CAP + PCI_MSI_FLAGS, &0u16.to_le_bytes());
    assert_eq!(lock(&m.seen).msi_connected, [Some(2), None]);
}

#[test]
fn test_intx_is_swizzled_to_its_root_port_and_yields_to_msix() {
    let m = machine();
    // nic0's INTA: 0 at 04:00.0 (slot 0), 1 at the downstream port 02:01.0 (slot 1), 1 at
    // the upstream port 01:00.0 (slot 0); rp0 sits at 00:01.0, so _PRT gives 16 + (1 + 1).
    assert_eq!(lock(&m.seen).intx_gsis, [18]);
    // Connected at start (before the guest runs), off while MSI-X is on, back after.
    assert_eq!(lock(&m.seen).intx, [true]);
    let flags = MSIX.cap + PCI_MSIX_FLAGS;
    m.config_write(flags, &PCI_MSIX_FLAGS_ENABLE.to_le_bytes());
    let seen = lock(&m.seen);
    assert_eq!((seen.intx.clone(), seen.connected.clone()), (vec![true, false], vec![Some(4)]));
    drop(seen);
    m.config_write(flags, &0u16.to_le_bytes());
    assert_eq!(lock(&m.seen).intx, [true, false, true]);
}

#[test]
fn test_a_long_run_is_given_to_kvm_a_touched_chunk_at_a_time() {
    const MIB: u64 = 1 << 20;
    let seen: Shared = Arc::default();
    let slots = Arc::new(MemorySlots::new(Arc::new(FakeKvm(seen.clone())), KVM_SLOTS));
    let memory = DeviceMemory::map(&memfd(4 * MIB), 0, 4 * MIB).unwrap();
    let given = Arc::new(Mutex::new(bars::LazySlots::default()));
    let gpa = 0x20_0000_0000;
    let mut run = LazyRun { gpa, host: memory.host_addr(0), len: 4 * MIB, chunk: MIB, slots, given: given.clone() };
    let added = || lock(&seen).slots.iter().map(|r| (r.guest_phys_addr, r.memory_size)).collect::<Vec<_>>();
    assert!(added().is_empty(), "nothing is given before the guest touches it");
    // The first access to a chunk gives it to KVM and completes through the VMM's mapping.
    gdrvm_devices::BusDevice::write(&mut run, MIB + 8, &0x1234_5678u32.to_le_bytes());
    assert_eq!(added(), [(gpa + MIB, MIB)]);
    let mut b = [0; 4];
    gdrvm_devices::BusDevice::read(&mut run, MIB + 8, &mut b);
    assert_eq!(u32::from_le_bytes(b), 0x1234_5678);
    assert_eq!(added().len(), 1, "a chunk is given once");
    // An access across a chunk boundary gives both chunks; one past the run reads all-ones.
    gdrvm_devices::BusDevice::read(&mut run, 3 * MIB - 2, &mut b);
    assert_eq!(added(), [(gpa + MIB, MIB), (gpa + 2 * MIB, MIB), (gpa + 3 * MIB, MIB)]);
    gdrvm_devices::BusDevice::read(&mut run, 4 * MIB - 2, &mut b);
    assert_eq!(b, [0xff; 4]);
    // Once the run is removed it gives nothing more.
    lock(&given).closed = true;
    gdrvm_devices::BusDevice::read(&mut run, 0, &mut b);
    assert_eq!((added().len(), b), (3, [0xff; 4]));
}

#[test]
fn test_configuration_images_are_mapped_read_only_and_removed_first() {
    let Machine { seen, node, nic, pci, wiring, mmio } = machine();
    let before = lock(&seen).slots.len();
    let holders = Arc::strong_count(&pci);
    wiring.map_config_images(&pci, gdrvm_model::layout::ECAM_BASE);
    assert_eq!(Arc::strong_count(&pci), holders + 1, "the mapped images keep their memory");
    // Once only: a second call maps nothing more.
    wiring.map_config_images(&pci, gdrvm_model::layout::ECAM_BASE);
    let all_added: Vec<kvm_userspace_memory_region> = lock(&seen).slots[before..].to_vec();
    // After the images, all-ones over each run of absent functions on a scanned bus.
    let (added, absent) = all_added.split_at(all_added.len() - pci.absent_ranges().len());
    for (slot, range) in absent.iter().zip(pci.absent_ranges()) {
        assert_eq!(slot.guest_phys_addr, gdrvm_model::layout::ECAM_BASE + range.start);
        assert_eq!(slot.memory_size, range.end - range.start);
        assert_eq!(slot.flags, KVM_MEM_READONLY);
        // SAFETY: the wiring keeps the slot's memory mapped while it lives.
        let bytes = unsafe { std::slice::from_raw_parts(slot.userspace_addr as *const u8, slot.memory_size as usize) };
        assert!(bytes.iter().all(|&b| b == 0xff), "absent functions read all-ones");
    }
    assert!(!absent.is_empty());
    // One read-only page for each function with nothing behind it, at its ECAM address;
    // none for the NIC, whose device answers its own registers.
    let ecam = |i: usize| {
        let b = node.functions[i].bdf;
        gdrvm_model::layout::ECAM_BASE
            + ((u64::from(b.bus) << 20) | (u64::from(b.device) << 15) | (u64::from(b.function) << 12))
    };
    let mut gpas: Vec<u64> = added.iter().map(|r| r.guest_phys_addr).collect();
    gpas.sort_unstable();
    let mut want: Vec<u64> = (0..node.functions.len()).filter(|&i| i != nic).map(ecam).collect();
    want.sort_unstable();
    assert_eq!(gpas, want);
    assert!(added.iter().all(|r| r.flags == KVM_MEM_READONLY && r.memory_size == 4096), "{added:?}");
    assert_eq!(wiring.config_images(), node.functions.len() - 1);
    assert!(!pci.images().is_imaged(nic));
    // The host bridge's slot is its image's page, which holds what ECAM reads: its IDs.
    let host = node.functions.iter().position(|f| (f.bdf.bus, f.bdf.device, f.bdf.function) == (0, 0, 0)).unwrap();
    let slot = added.iter().find(|r| r.guest_phys_addr == ecam(host)).unwrap();
    let page = pci.images().pages().into_iter().find(|p| p.ecam_offset == 0).unwrap();
    assert_eq!(slot.userspace_addr, page.host_addr);
    let mut ids = [0u8; 4];
    mmio.read(ecam(host), &mut ids);
    assert_eq!(pci.images().contents(host, 0..CONFIG_SPACE_SIZE).unwrap()[..4], ids);
    // Dropping the wiring removes those slots first, then lets go of the segment.
    drop(wiring);
    let removed: Vec<u32> = lock(&seen).slots.iter().filter(|r| r.memory_size == 0).map(|r| r.slot).collect();
    assert!(all_added.iter().all(|r| removed.contains(&r.slot)), "image slots left in KVM");
    assert_eq!(Arc::strong_count(&pci), holders);
}

#[test]
fn test_images_kvm_refuses_leave_their_reads_to_exit() {
    let m = machine();
    lock(&m.seen).refuse_readonly = true;
    m.wiring.map_config_images(&m.pci, gdrvm_model::layout::ECAM_BASE);
    assert_eq!(m.wiring.config_images(), 0);
    // Reads still come, through the ECAM exit path: the host bridge's IDs.
    let mut ids = [0u8; 4];
    m.mmio.read(gdrvm_model::layout::ECAM_BASE, &mut ids);
    assert_ne!(ids, [0xff; 4]);
    let host = m.node.functions.iter().position(|f| (f.bdf.bus, f.bdf.device, f.bdf.function) == (0, 0, 0)).unwrap();
    assert_eq!(m.pci.images().contents(host, 0..CONFIG_SPACE_SIZE).unwrap()[..4], ids);
}

#[test]
fn test_an_emulated_function_is_imaged_and_its_image_follows_writes() {
    let m = machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::EmulatedNic);
    assert!(m.pci.images().is_imaged(m.nic), "gdrvm's own emulator changes its configuration only on writes");
    let b = m.node.functions[m.nic].bdf;
    let ecam = gdrvm_model::layout::ECAM_BASE
        + ((u64::from(b.bus) << 20) | (u64::from(b.device) << 15) | (u64::from(b.function) << 12));
    let read_all = || {
        let mut bytes = vec![0u8; 4096];
        for (n, dword) in bytes.chunks_exact_mut(4).enumerate() {
            m.mmio.read(ecam + n as u64 * 4, dword);
        }
        bytes
    };
    assert_eq!(m.pci.images().contents(m.nic, 0..CONFIG_SPACE_SIZE).unwrap(), read_all(), "at start");
    // BAR sizing (the VMM's bytes), a command write and one into the device's own bytes.
    // The image follows the VMM's bytes without asking the device (a request each, to an
    // emulator), and re-reads the device's in one request after a write that reached it.
    let reads = || lock(&m.seen).config_reads;
    let before = reads();
    m.config_write(0x10, &u32::MAX.to_le_bytes());
    assert_eq!(reads(), before, "a BAR write does not read the device");
    m.config_write(PCI_COMMAND, &(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER).to_le_bytes());
    assert_eq!(reads(), before, "the command register is the VMM's: a write to it does not read the device");
    m.config_write(0x40, &0x1234_5678u32.to_le_bytes());
    assert_eq!(reads(), before + 1, "a write that reached the device reads it once");
    assert_eq!(m.pci.images().contents(m.nic, 0..CONFIG_SPACE_SIZE).unwrap(), read_all(), "after writes");
    assert_ne!(
        m.pci.images().contents(m.nic, 0..CONFIG_SPACE_SIZE).unwrap()[0x10..0x14],
        m.bar0().to_le_bytes()[..4],
        "sizing shows"
    );
}

#[test]
fn test_a_bar_moved_over_ecam_is_not_decoded_there() {
    let m = machine();
    let ecam_bus4 = gdrvm_model::layout::ECAM_BASE + (4 << 20);
    let flags = PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH;
    let move_to = |address: u64| {
        m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
        m.config_write(PCI_BASE_ADDRESS_0, &(address as u32 | flags).to_le_bytes());
        m.config_write(PCI_BASE_ADDRESS_0 + 4, &((address >> 32) as u32).to_le_bytes());
        m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    };
    move_to(ecam_bus4);
    // No KVM slot and no trap over ECAM: the guest's configuration accesses still reach ECAM.
    let end = gdrvm_model::layout::FOUR_GIB;
    assert!(
        m.live_slots().values().all(|&(gpa, _)| gpa + (2 << 20) <= ecam_bus4 || gpa >= end),
        "{:x?}",
        m.live_slots()
    );
    assert!(m.mmio.ranges().iter().all(|&(b, _)| b == gdrvm_model::layout::ECAM_BASE || b < ecam_bus4 || b >= end));
    let mut ids = [0u8; 4];
    m.mmio.read(gdrvm_model::layout::ECAM_BASE, &mut ids);
    assert_ne!(ids, [0xff; 4], "ECAM still answers");
    // Moved back into the window, it is placed again.
    let back = m.bar0();
    move_to(back);
    assert_eq!(m.live_slots().into_values().collect::<Vec<_>>(), [(back + 0x1000, (2 << 20) - 0x1000)]);
}

#[test]
fn test_backings_open_side_by_side_and_come_back_in_the_nodes_order() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut node = Node::preset("vela-a100").unwrap().unwrap();
    let gpus: Vec<usize> =
        node.functions.iter().enumerate().filter(|(_, f)| f.name.starts_with("gpu")).map(|(i, _)| i).collect();
    for (i, f) in node.functions.iter_mut().enumerate() {
        f.backing = if gpus.contains(&i) { Backing::VfioUser("/fake.sock".into()) } else { Backing::None };
    }
    let (open_now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let asked = Mutex::new(Vec::new());
    let open = |_: &Node, i: usize| -> Result<Option<Opened>, String> {
        most.fetch_max(open_now.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
        lock(&asked).push(i);
        // Long enough for the others to start while this one waits, as on a server.
        std::thread::sleep(std::time::Duration::from_millis(100));
        open_now.fetch_sub(1, Ordering::SeqCst);
        match i % 2 {
            0 => Err(format!("function {i} refused")),
            _ => Ok(None),
        }
    };
    let opened = open_all(&node, &open);
    assert_eq!(opened.len(), node.functions.len());
    for (i, result) in opened.iter().enumerate() {
        match (gpus.contains(&i), result) {
            (true, Err(e)) => assert_eq!((i % 2, e.as_str()), (0, format!("function {i} refused").as_str())),
            (true, Ok(None)) => assert_eq!(i % 2, 1),
            (false, Ok(None)) => {}
            _ => panic!("function {i}: unexpected {:?}", result.as_ref().map(Option::is_some)),
        }
    }
    let mut asked = asked.into_inner().unwrap();
    asked.sort_unstable();
    assert_eq!(asked, gpus, "only functions with a backing are opened, each once");
    assert!(most.load(Ordering::SeqCst) > 1, "backings were opened one after another");
}

#[test]
fn test_an_emulator_is_told_the_command_register_only_when_more_than_decode_changes() {
    let told = |m: &Machine| -> Vec<u16> {
        let seen = lock(&m.seen);
        seen.config_writes
            .iter()
            .filter(|(reg, _)| *reg == PCI_COMMAND)
            .map(|(_, v)| u16::from_le_bytes([v[0], v[1]]))
            .collect()
    };
    let m = machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::EmulatedNic);
    let at_start = told(&m);
    // Decode off, the BAR moved, decode on: the VMM moves the BAR's slots, and the
    // emulator hears of none of it.
    let new = m.bar0() + (64 << 20);
    m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
    let flags = PCI_BASE_ADDRESS_MEM_TYPE_64 | PCI_BASE_ADDRESS_MEM_PREFETCH;
    m.config_write(PCI_BASE_ADDRESS_0, &(new as u32 | flags).to_le_bytes());
    m.config_write(PCI_BASE_ADDRESS_0 + 4, &((new >> 32) as u32).to_le_bytes());
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    let slots: Vec<(u64, u64)> = m.live_slots().into_values().collect();
    assert_eq!(slots, [(new + 0x1000, (2 << 20) - 0x1000)], "the BAR moved with decode");
    assert_eq!(told(&m), at_start, "decode toggles stay in the VMM");
    // Bus mastering and INTx disable are the device's business: it is told the register.
    let on = PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
    m.config_write(PCI_COMMAND, &on.to_le_bytes());
    m.config_write(PCI_COMMAND, &(on | PCI_COMMAND_INTX_DISABLE).to_le_bytes());
    assert_eq!(told(&m)[at_start.len()..], [on, on | PCI_COMMAND_INTX_DISABLE]);
    let b = m.node.functions[m.nic].bdf;
    let mut command = [0u8; 2];
    m.pci.read(b.bus, b.device << 3 | b.function, PCI_COMMAND, &mut command);
    assert_eq!(u16::from_le_bytes(command), on | PCI_COMMAND_INTX_DISABLE);

    // Another vfio-user server hears every write: its decode may be its own business.
    let m = machine();
    let at_start = told(&m).len();
    m.config_write(PCI_COMMAND, &0u16.to_le_bytes());
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    assert_eq!(told(&m)[at_start..], [0, PCI_COMMAND_MEMORY]);
}

#[test]
fn test_flr_resets_the_device_and_turns_off_what_the_guest_turned_on() {
    // An emulator's: the VMM keeps its Command register, so what reads back is the VMM's.
    let m = machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::EmulatedNic);
    let bdf = m.node.functions[m.nic].bdf;
    let read16 = |reg: usize| {
        let mut b = [0u8; 2];
        m.pci.read(bdf.bus, bdf.device << 3 | bdf.function, reg, &mut b);
        u16::from_le_bytes(b)
    };
    let bar0 = m.bar0();
    // The guest drives the function: bus mastering, MSI-X with vector 1 routed and unmasked.
    m.config_write(PCI_COMMAND, &(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER).to_le_bytes());
    let flags = MSIX.cap + PCI_MSIX_FLAGS;
    m.config_write(flags, &PCI_MSIX_FLAGS_ENABLE.to_le_bytes());
    let entry = bar0 + 16;
    m.mmio.write(entry, &0xfee0_1000u32.to_le_bytes());
    m.mmio.write(entry + 8, &0x4041u32.to_le_bytes());
    m.mmio.write(entry + 12, &0u32.to_le_bytes());
    assert_eq!(lock(&m.seen).irqfds.len(), 1, "vector 1 delivers");
    let resets = lock(&m.seen).resets;

    // pcie_flr: Device Control read, Initiate FLR set, written back.
    let devctl = EXP_CAP + PCI_EXP_DEVCTL;
    m.config_write(devctl, &(read16(devctl) | PCI_EXP_DEVCTL_BCR_FLR).to_le_bytes());

    let seen = lock(&m.seen);
    assert_eq!(seen.resets, resets + 1, "the device was reset");
    assert!(!seen.config_writes.iter().any(|(reg, _)| *reg == devctl), "the FLR write itself is not passed on");
    assert_eq!(seen.connected, [Some(4), None], "MSI-X disconnected");
    assert!(seen.irqfds.is_empty(), "no vector delivers");
    drop(seen);
    assert_eq!(read16(PCI_COMMAND), 0, "decode and bus mastering off");
    assert_eq!(m.pci.images().contents(m.nic, PCI_COMMAND..PCI_COMMAND + 2).unwrap(), [0, 0], "the image says so too");
    // The BARs keep their addresses (the power-on state is firmware's), so the guest's
    // restore finds the table where it was: zeroed and every vector masked.
    m.config_write(PCI_COMMAND, &PCI_COMMAND_MEMORY.to_le_bytes());
    let mut b = [0u8; 4];
    for (at, want) in [(entry, 0), (entry + 8, 0), (entry + 12, PCI_MSIX_ENTRY_CTRL_MASKBIT)] {
        m.mmio.read(at, &mut b);
        assert_eq!(u32::from_le_bytes(b), want, "table entry 1 at {:#x}", at - bar0);
    }
}

#[test]
fn test_flr_of_an_endpoint_with_nothing_behind_it_resets_its_registers_and_image() {
    let m = machine();
    let gpu = m.node.functions.iter().position(|f| f.name == "gpu0").unwrap();
    let bdf = m.node.functions[gpu].bdf;
    let devfn = bdf.device << 3 | bdf.function;
    let read16 = |reg: usize| {
        let mut b = [0u8; 2];
        m.pci.read(bdf.bus, devfn, reg, &mut b);
        u16::from_le_bytes(b)
    };
    let devctl = gdrvm_devices::flr_control(&mut |reg, data| m.pci.read(bdf.bus, devfn, reg, data)).unwrap();
    let power_on = m.pci.images().contents(gpu, 0..CONFIG_SPACE_SIZE).unwrap();
    m.config_write_to(gpu, PCI_COMMAND, &(PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER).to_le_bytes());
    m.config_write_to(gpu, devctl, &(read16(devctl) & !PCI_EXP_DEVCTL_READRQ_512B).to_le_bytes());
    assert_ne!(m.pci.images().contents(gpu, 0..CONFIG_SPACE_SIZE).unwrap(), power_on);
    m.config_write_to(gpu, devctl, &PCI_EXP_DEVCTL_BCR_FLR.to_le_bytes());
    assert_eq!(m.pci.images().contents(gpu, 0..CONFIG_SPACE_SIZE).unwrap(), power_on, "the image is power-on's");
    assert_eq!((read16(PCI_COMMAND), read16(devctl) & PCI_EXP_DEVCTL_BCR_FLR), (0, 0));
}

#[test]
fn test_flr_of_a_passed_through_device_turns_its_decode_off_before_vfio_resets_it() {
    let bdf = HostBdf { domain: 0, bus: 0x3b, device: 0, function: 0 };
    let m = machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::Vfio(bdf));
    let bar0 = m.bar0();
    assert!(!m.live_slots().is_empty());
    let resets = lock(&m.seen).resets;
    let devctl = EXP_CAP + PCI_EXP_DEVCTL;
    m.config_write(devctl, &PCI_EXP_DEVCTL_BCR_FLR.to_le_bytes());
    // VFIO's reset restores the Command register the device had: it is cleared first.
    let seen = lock(&m.seen);
    assert_eq!(seen.config_writes.last(), Some(&(PCI_COMMAND, vec![0, 0])), "{:?}", seen.config_writes);
    assert_eq!(seen.resets, resets + 1);
    drop(seen);
    assert!(m.live_slots().is_empty(), "decode went off: the BAR's slot is gone");
    assert!(!m.mmio.ranges().iter().any(|&(b, _)| b == bar0), "and its trap");
}

#[test]
fn test_a_device_that_cannot_reset_gets_the_flr_write_itself() {
    let m = machine_on(Node::preset("minimal").unwrap().unwrap(), &["nic0"], Backing::VfioUser(NO_RESET.into()));
    let devctl = EXP_CAP + PCI_EXP_DEVCTL;
    let write = PCI_EXP_DEVCTL_BCR_FLR.to_le_bytes();
    let resets = lock(&m.seen).resets;
    m.config_write(devctl, &write);
    let seen = lock(&m.seen);
    assert_eq!(seen.resets, resets, "no reset from the VMM");
    assert_eq!(seen.config_writes.last(), Some(&(devctl, write.to_vec())), "a server carries out its own FLR");
}
