//! KVM's coalesced I/O ring: writes to the ports the VMM registers here (the type-1 PCI
//! address register at 0xcf8) do not exit to the VMM. KVM appends them to a ring that all
//! of the VM's vCPUs share, and the VMM applies them in order before it serves the next
//! exit of any vCPU. A PCI configuration access through 0xcf8/0xcfc then reaches the VMM
//! once instead of twice, as under QEMU, which coalesces the same port. The guest still
//! exits to KVM for the write; KVM keeps it in the kernel.
//!
//! The zone is the whole 32-bit register (0xcf8-0xcfb), so a byte write to the reset
//! register at 0xcf9 is coalesced too. It must not wait for an exit that may never come:
//! Linux's reboot path writes 0xcf9 and goes on, and a vCPU that KVM puts through INIT has
//! no firmware at the reset vector to exit for it. So the supervisor also applies the ring
//! every [`FLUSH_PERIOD`] ([`PeriodicFlush`]). Reads are never coalesced.
//!
//! Written by hand: kvm-ioctls reads this ring only through `&mut VcpuFd`, which the vCPU
//! loop has lent to the exit it is serving, and without ordering its loads of the
//! kernel's index and the entries. This reader is one per VM, shared by the vCPUs behind
//! a lock, and orders its accesses as KVM's `coalesced_mmio.c` expects (the kernel
//! publishes `last` after the entry; the VMM advances `first` after applying one).

use std::fs::File;
use std::mem::{offset_of, size_of};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvm_bindings::{kvm_coalesced_mmio, kvm_coalesced_mmio_ring, KVM_COALESCED_MMIO_PAGE_OFFSET};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VcpuFd, VmFd};
use vm_memory::mmap::MmapRegion;
use vm_memory::volatile_memory::VolatileSlice;
use vm_memory::{Bytes, FileOffset, VolatileMemory};
use vmm_sys_util::timerfd::TimerFd;

use gdrvm_devices::{lock, Bus};

/// A port range whose writes KVM keeps in the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Zone {
    /// First port.
    pub port: u16,
    /// Length in bytes; a write is coalesced only when it lies wholly inside.
    pub len: u32,
}

/// Where the ring's indices and entries lie in its page.
const FIRST: usize = offset_of!(kvm_coalesced_mmio_ring, first);
const LAST: usize = offset_of!(kvm_coalesced_mmio_ring, last);
const ENTRIES: usize = size_of::<kvm_coalesced_mmio_ring>();
const ENTRY: usize = size_of::<kvm_coalesced_mmio>();
const ENTRY_ADDR: usize = offset_of!(kvm_coalesced_mmio, phys_addr);
const ENTRY_LEN: usize = offset_of!(kvm_coalesced_mmio, len);
const ENTRY_PIO: usize = offset_of!(kvm_coalesced_mmio, __bindgen_anon_1);
const ENTRY_DATA: usize = offset_of!(kvm_coalesced_mmio, data);

/// Why the ring could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CoalescedError {
    /// KVM refused to register a zone.
    #[error("KVM_REGISTER_COALESCED_MMIO for port {port:#x}: {source}")]
    Register {
        /// The zone's first port.
        port: u16,
        /// KVM's error.
        source: kvm_ioctls::Error,
    },
    /// The ring's page could not be mapped from the vCPU.
    #[error("cannot map KVM's coalesced I/O ring: {0}")]
    Map(String),
}

/// The VM's coalesced I/O ring, mapped once and drained by whichever vCPU exits next.
pub struct CoalescedRing {
    /// The ring's page, shared with the kernel.
    page: MmapRegion<()>,
    /// Held by the one vCPU at a time that reads the ring.
    reader: Mutex<()>,
    /// Entries the ring holds (KVM_COALESCED_MMIO_MAX).
    slots: u32,
    /// Writes applied so far.
    applied: AtomicU64,
}

impl CoalescedRing {
    /// Registers `zones` with KVM and maps the ring through `vcpu` (any vCPU of `vm`: the
    /// ring is the VM's). None when KVM cannot coalesce port I/O; every write then exits.
    pub fn new(kvm: &Kvm, vm: &VmFd, vcpu: &VcpuFd, zones: &[Zone]) -> Result<Option<CoalescedRing>, CoalescedError> {
        if !kvm.check_extension(Cap::CoalescedPio) {
            tracing::debug!("KVM cannot coalesce port I/O: PCI address writes exit to the VMM");
            return Ok(None);
        }
        let ring = CoalescedRing::map(vcpu)?;
        for (i, zone) in zones.iter().enumerate() {
            if let Err(source) = vm.register_coalesced_mmio(IoEventAddress::Pio(u64::from(zone.port)), zone.len) {
                // A zone left registered without a reader would swallow the guest's writes.
                for done in &zones[..i] {
                    let _ = vm.unregister_coalesced_mmio(IoEventAddress::Pio(u64::from(done.port)), done.len);
                }
                return Err(CoalescedError::Register { port: zone.port, source });
            }
        }
        Ok(Some(ring))
    }

    /// Maps the ring's page from the vCPU's file.
    fn map(vcpu: &VcpuFd) -> Result<CoalescedRing, CoalescedError> {
        let page = page_size().ok_or_else(|| CoalescedError::Map("the page size is unknown".into()))?;
        // SAFETY: `vcpu` owns the descriptor and keeps it open for the length of this call,
        // in which it is only duplicated.
        let fd = unsafe { BorrowedFd::borrow_raw(vcpu.as_raw_fd()) };
        let file = File::from(fd.try_clone_to_owned().map_err(|e| CoalescedError::Map(e.to_string()))?);
        let offset = u64::from(KVM_COALESCED_MMIO_PAGE_OFFSET) * page as u64;
        let map = MmapRegion::build(
            Some(FileOffset::new(file, offset)),
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
        )
        .map_err(|e| CoalescedError::Map(e.to_string()))?;
        Ok(CoalescedRing::over(map))
    }

    /// The ring in `page` (a page-sized mapping laid out as `kvm_coalesced_mmio_ring`).
    fn over(page: MmapRegion<()>) -> CoalescedRing {
        let slots = ((page.size() - ENTRIES) / ENTRY) as u32;
        CoalescedRing { page, reader: Mutex::new(()), slots, applied: AtomicU64::new(0) }
    }

    /// Applies every write in the ring, oldest first, to `pio` (port writes) or `mmio`;
    /// returns how many it applied. Cheap when the ring is empty: no lock is taken.
    pub fn drain(&self, pio: &Bus, mmio: &Bus) -> u64 {
        if self.is_empty() {
            return 0;
        }
        let _reader = lock(&self.reader);
        let Some(page) = self.slice() else { return 0 };
        let mut applied = 0;
        while let (Ok(first), Ok(last)) =
            (page.load::<u32>(FIRST, Ordering::Relaxed), page.load::<u32>(LAST, Ordering::Acquire))
        {
            if first == last {
                break;
            }
            if first >= self.slots || last >= self.slots {
                // The kernel owns `last` and the VMM `first`; neither is ever out of range.
                tracing::error!(first, last, slots = self.slots, "coalesced I/O ring indices out of range");
                break;
            }
            let at = ENTRIES + first as usize * ENTRY;
            let mut data = [0u8; 8];
            let read = (
                page.read_obj::<u64>(at + ENTRY_ADDR),
                page.read_obj::<u32>(at + ENTRY_LEN),
                page.read_obj::<u32>(at + ENTRY_PIO),
                page.read_slice(&mut data, at + ENTRY_DATA),
            );
            if let (Ok(addr), Ok(len), Ok(is_pio), Ok(())) = read {
                match data.get(..len as usize) {
                    Some(bytes) => {
                        let _ = if is_pio != 0 { pio.write(addr, bytes) } else { mmio.write(addr, bytes) };
                    }
                    None => tracing::error!(addr, len, "coalesced write longer than 8 bytes: dropped"),
                }
            }
            // Applied before it is given back, so a vCPU that finds the ring empty knows
            // every write in it has reached its device.
            let _ = page.store((first + 1) % self.slots, FIRST, Ordering::Release);
            applied += 1;
        }
        self.applied.fetch_add(applied, Ordering::Relaxed);
        applied
    }

    /// Whether the kernel has added nothing the VMM has not applied.
    fn is_empty(&self) -> bool {
        // Read without the lock: a vCPU draining advances `first` only after applying.
        let Some(page) = self.slice() else { return true };
        matches!(
            (page.load::<u32>(FIRST, Ordering::Acquire), page.load::<u32>(LAST, Ordering::Acquire)),
            (Ok(f), Ok(l)) if f == l
        )
    }

    /// The whole page, for volatile and atomic access.
    fn slice(&self) -> Option<VolatileSlice<'_, ()>> {
        self.page.get_slice(0, self.page.size()).ok()
    }

    /// Writes applied so far.
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }
}

/// How often the supervisor applies the ring when no vCPU exits do. Rarely: a reset may
/// wait this long, and nested, every wake-up of the VMM's thread is an interrupt on the
/// CPU under a vCPU (a 10 ms period coincided with L2 guests dying of a #PF recursion).
pub const FLUSH_PERIOD: Duration = Duration::from_millis(200);

/// A timer on which the supervisor applies the ring, for writes after which the guest
/// makes no exit (a reset through 0xcf9).
pub struct PeriodicFlush {
    timer: TimerFd,
    ring: Arc<CoalescedRing>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
}

impl PeriodicFlush {
    /// Applies `ring` to `pio` and `mmio` every [`FLUSH_PERIOD`], once [`PeriodicFlush::fd`]
    /// is polled and [`PeriodicFlush::fire`] called when it is readable.
    pub fn new(ring: Arc<CoalescedRing>, pio: Arc<Bus>, mmio: Arc<Bus>) -> std::io::Result<Self> {
        let mut timer = TimerFd::new().map_err(std::io::Error::from)?;
        timer.reset(FLUSH_PERIOD, Some(FLUSH_PERIOD)).map_err(std::io::Error::from)?;
        Ok(PeriodicFlush { timer, ring, pio, mmio })
    }

    /// The timer's descriptor, readable every period.
    pub fn fd(&self) -> &TimerFd {
        &self.timer
    }

    /// Consumes the expiry and applies the ring.
    pub fn fire(&mut self) {
        let _ = self.timer.wait();
        self.ring.drain(&self.pio, &self.mmio);
    }
}

/// The host's page size.
fn page_size() -> Option<usize> {
    // SAFETY: sysconf reads a system constant and touches no memory of ours.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).ok().filter(|s| *s > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    use gdrvm_devices::BusDevice;
    use kvm_bindings::kvm_userspace_memory_region;
    use kvm_ioctls::VcpuExit;
    use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

    /// Records every write it gets, and answers reads with the last dword written.
    #[derive(Default)]
    struct Recorder(Vec<(u64, Vec<u8>)>);

    impl BusDevice for Recorder {
        fn read(&mut self, _: u64, data: &mut [u8]) {
            let last = self.0.last().map(|(_, d)| d.clone()).unwrap_or_default();
            for (i, b) in data.iter_mut().enumerate() {
                *b = last.get(i).copied().unwrap_or(0xff);
            }
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data.to_vec()));
        }
    }

    /// Plays the kernel: appends a write to the ring as `coalesced_mmio_write` does.
    fn push(ring: &CoalescedRing, addr: u64, data: &[u8], pio: bool) {
        let page = ring.slice().unwrap();
        let last: u32 = page.load(LAST, Ordering::Acquire).unwrap();
        let at = ENTRIES + last as usize * ENTRY;
        page.write_obj(addr, at + ENTRY_ADDR).unwrap();
        page.write_obj(data.len() as u32, at + ENTRY_LEN).unwrap();
        page.write_obj(u32::from(pio), at + ENTRY_PIO).unwrap();
        let mut bytes = [0u8; 8];
        bytes[..data.len()].copy_from_slice(data);
        page.write_slice(&bytes, at + ENTRY_DATA).unwrap();
        page.store((last + 1) % ring.slots, LAST, Ordering::Release).unwrap();
    }

    fn buses() -> (Bus, Bus, Arc<Mutex<Recorder>>, Arc<Mutex<Recorder>>) {
        let (pio, mmio) = (Bus::new("pio"), Bus::new("mmio"));
        let (ports, ecam) = (Arc::new(Mutex::new(Recorder::default())), Arc::new(Mutex::new(Recorder::default())));
        pio.insert(ports.clone(), 0xcf8, 8).unwrap();
        mmio.insert(ecam.clone(), 0xe000_0000, 0x1000).unwrap();
        (pio, mmio, ports, ecam)
    }

    #[test]
    fn test_writes_are_applied_in_order_to_their_bus_across_the_ring_end() {
        let ring = CoalescedRing::over(MmapRegion::new(4096).unwrap());
        assert_eq!(ring.slots, 170, "a 4 KiB page holds 170 entries of 24 bytes after the 8-byte header");
        let (pio, mmio, ports, ecam) = buses();
        assert_eq!(ring.drain(&pio, &mmio), 0);
        // Start near the end so the indices wrap.
        let page = ring.slice().unwrap();
        page.store(168u32, FIRST, Ordering::Release).unwrap();
        page.store(168u32, LAST, Ordering::Release).unwrap();
        push(&ring, 0xcf8, &0x8000_1000u32.to_le_bytes(), true);
        push(&ring, 0xe000_0010, &[7, 8], false);
        push(&ring, 0xcf9, &[6], true);
        assert!(!ring.is_empty());
        assert_eq!(ring.drain(&pio, &mmio), 3);
        assert!(ring.is_empty());
        assert_eq!(page.load::<u32>(FIRST, Ordering::Acquire).unwrap(), 1);
        assert_eq!(lock(&ports).0, [(0, 0x8000_1000u32.to_le_bytes().to_vec()), (1, vec![6])]);
        assert_eq!(lock(&ecam).0, [(0x10, vec![7, 8])]);
        assert_eq!(ring.applied(), 3);
    }

    /// A reset through 0xcf9 after which the guest makes no exit still reaches its
    /// device: the supervisor's timer applies the ring.
    #[test]
    fn test_the_periodic_flush_applies_writes_no_exit_follows() {
        let ring = Arc::new(CoalescedRing::over(MmapRegion::new(4096).unwrap()));
        let (pio, mmio, ports, _) = buses();
        let mut flush = PeriodicFlush::new(ring.clone(), Arc::new(pio), Arc::new(mmio)).unwrap();
        push(&ring, 0xcf9, &[6], true);
        flush.fire();
        assert_eq!(lock(&ports).0, [(1, vec![6])]);
        assert!(ring.is_empty());
    }

    #[test]
    fn test_bad_entries_are_dropped_and_bad_indices_stop_the_drain() {
        let ring = CoalescedRing::over(MmapRegion::new(4096).unwrap());
        let (pio, mmio, ports, _) = buses();
        push(&ring, 0xcf8, &[1, 2, 3, 4], true);
        let page = ring.slice().unwrap();
        page.write_obj(9u32, ENTRIES + ENTRY_LEN).unwrap();
        assert_eq!(ring.drain(&pio, &mmio), 1, "an entry longer than 8 bytes is consumed, not applied");
        assert!(lock(&ports).0.is_empty());
        page.store(500u32, LAST, Ordering::Release).unwrap();
        assert_eq!(ring.drain(&pio, &mmio), 0);
    }

    /// Against the host's KVM, when it has one that coalesces port I/O: a guest writes the
    /// PCI address register and reads the data port; the VMM's first exit is the read, and
    /// by then the write has reached the address register.
    #[test]
    fn test_kvm_keeps_the_address_write_and_the_read_finds_it_applied() {
        let Ok(kvm) = Kvm::new() else {
            println!("SKIP test_kvm_keeps_the_address_write_and_the_read_finds_it_applied: no usable /dev/kvm");
            return;
        };
        let vm = kvm.create_vm().unwrap();
        // mov dx, 0xcf8; mov eax, 0x80001234; out dx, eax; mov dx, 0xcfc; in eax, dx; hlt
        let code =
            [0xba, 0xf8, 0x0c, 0x66, 0xb8, 0x34, 0x12, 0x00, 0x80, 0x66, 0xef, 0xba, 0xfc, 0x0c, 0x66, 0xed, 0xf4];
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        mem.write_slice(&code, GuestAddress(0x1000)).unwrap();
        let host = mem.get_host_address(GuestAddress(0)).unwrap();
        let region = kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: 0x10000,
            userspace_addr: host as u64,
            flags: 0,
        };
        // SAFETY: `mem` is a live mapping that outlives the VM (dropped after it).
        unsafe { vm.set_user_memory_region(region) }.unwrap();
        let mut vcpu = vm.create_vcpu(0).unwrap();
        let mut sregs = vcpu.get_sregs().unwrap();
        sregs.cs.base = 0;
        sregs.cs.selector = 0;
        vcpu.set_sregs(&sregs).unwrap();
        let mut regs = vcpu.get_regs().unwrap();
        regs.rip = 0x1000;
        regs.rflags = 2;
        vcpu.set_regs(&regs).unwrap();
        let zones = [Zone { port: 0xcf8, len: 4 }];
        let Some(ring) = CoalescedRing::new(&kvm, &vm, &vcpu, &zones).unwrap() else {
            println!(
                "SKIP test_kvm_keeps_the_address_write_and_the_read_finds_it_applied: KVM cannot coalesce port I/O"
            );
            return;
        };
        let (pio, mmio, ports, _) = buses();
        let mut seen = Vec::new();
        loop {
            let exit = vcpu.run().unwrap();
            ring.drain(&pio, &mmio);
            match exit {
                VcpuExit::IoIn(port, data) => {
                    pio.read(u64::from(port), data);
                    seen.push(format!("in {port:#x}"));
                }
                VcpuExit::IoOut(port, data) => {
                    pio.write(u64::from(port), data);
                    seen.push(format!("out {port:#x}"));
                }
                VcpuExit::Hlt => break,
                other => panic!("unexpected exit {other:?}"),
            }
        }
        assert_eq!(seen, ["in 0xcfc"], "the address write did not exit");
        assert_eq!(lock(&ports).0, [(0, 0x8000_1234u32.to_le_bytes().to_vec())]);
        assert_eq!(vcpu.get_regs().unwrap().rax as u32, 0x8000_1234, "the read was served after the write");
        assert_eq!(ring.applied(), 1);
    }
}
