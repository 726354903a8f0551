//! vCPUs: the architectural state each one starts with (CPUID, MSRs, FPU, LAPIC, and for
//! the boot CPU the registers of its entry protocol) and the exit loop that serves its
//! port and MMIO accesses.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use gdrvm_devices::{Bus, GuestExit, GuestExitSignal};
use gdrvm_model::layout;
use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, CpuId, Msrs};
use kvm_ioctls::{VcpuExit, VcpuFd};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::boot::{BootEntry, EntryMode};
use crate::cpu_topology::CpuPlace;
use crate::stats::{ExitKind, ExitTally, VcpuTally};

/// Errors configuring or running a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// A KVM ioctl failed while setting up the vCPU.
    #[error("cannot set up vCPU {id}: {what}")]
    Setup {
        /// vCPU index.
        id: u32,
        /// The state being set.
        what: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The boot MSRs do not fit KVM's MSR list.
    #[error("cannot set up vCPU {id}: {count} boot MSRs do not fit KVM's MSR list")]
    MsrList {
        /// vCPU index.
        id: u32,
        /// MSRs asked for.
        count: usize,
        /// The list's error.
        #[source]
        source: vmm_sys_util::fam::Error,
    },
    /// Boot page tables or GDT could not be written.
    #[error("cannot write the boot CPU's {what} into guest memory")]
    GuestWrite {
        /// What was being written.
        what: &'static str,
        /// vm-memory's error.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The vCPU thread could not be pinned to its host node's CPUs.
    #[error("vCPU {id}: cannot pin its thread to host CPUs {cpus:?}")]
    Pin {
        /// vCPU index.
        id: u32,
        /// The CPUs asked for.
        cpus: Vec<usize>,
        /// The system's words.
        #[source]
        source: std::io::Error,
    },
    /// KVM_RUN failed.
    #[error("vCPU {id}: KVM_RUN failed")]
    Run {
        /// vCPU index.
        id: u32,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// KVM could not enter or emulate the guest (on kvm_pvm: a stock kernel's instructions).
    #[error("vCPU {id}: KVM stopped the guest: {reason}")]
    Hardware {
        /// vCPU index.
        id: u32,
        /// The exit KVM reported.
        reason: String,
    },
}

// GDT entries: access byte in bits 0-7, flags (AVL, L, D/B, G) in bits 12-15.
const GDT_CODE64: u16 = 0xa09b;
const GDT_CODE32: u16 = 0xc09b;
const GDT_DATA: u16 = 0xc093;
const GDT_TSS: u16 = 0x808b;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// MTRRs enabled, default type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
        | ((limit & 0xf_0000) << 32)
        | ((flags & 0xf0ff) << 40)
}

fn segment(index: u16, flags: u16, base: u32, limit: u32) -> kvm_segment {
    let g = (flags >> 15) & 1;
    kvm_segment {
        base: u64::from(base),
        limit: if g == 1 { (limit << 12) | 0xfff } else { limit },
        selector: index * 8,
        type_: (flags & 0xf) as u8,
        s: ((flags >> 4) & 1) as u8,
        dpl: ((flags >> 5) & 3) as u8,
        present: ((flags >> 7) & 1) as u8,
        avl: ((flags >> 12) & 1) as u8,
        l: ((flags >> 13) & 1) as u8,
        db: ((flags >> 14) & 1) as u8,
        g: g as u8,
        unusable: 0,
        padding: 0,
    }
}

/// CPUID leaf 1 ECX bit: the LAPIC timer has TSC-deadline mode.
const CPUID_1_ECX_TSC_DEADLINE: u32 = 1 << 24;

/// Adds to KVM's supported CPUID what KVM emulates but leaves to the VMM to announce, as
/// QEMU, Firecracker and Cloud Hypervisor do: the TSC-deadline timer, when the in-kernel
/// LAPIC has it (`KVM_CAP_TSC_DEADLINE_TIMER`). Without it Linux programs its timer through
/// the LAPIC's count registers, and the kernels these guests run pick their timer by it.
pub fn announce_emulated_features(cpuid: &mut CpuId, tsc_deadline: bool) {
    for e in cpuid.as_mut_slice().iter_mut().filter(|e| e.function == 0x1) {
        if tsc_deadline {
            e.ecx |= CPUID_1_ECX_TSC_DEADLINE;
        }
    }
}

/// Per-vCPU CPUID: the host's supported leaves, with this vCPU's APIC id and package
/// layout in the topology leaves (Intel 0x1, 0x4, 0xb, 0x1f; AMD 0x8000_0008, 0x8000_001d,
/// 0x8000_001e) and the last-level cache shared by the package only.
pub fn cpuid_for(base: &CpuId, place: &CpuPlace) -> CpuId {
    let mut cpuid = base.clone();
    let (id, bits) = (place.apic_id, place.core_bits);
    let package_ids = 1u32 << bits;
    for e in cpuid.as_mut_slice() {
        match e.function {
            0x1 => {
                e.ebx = ((id & 0xff) << 24) | ((package_ids & 0xff) << 16) | (e.ebx & 0xffff);
                e.ecx |= 1 << 31; // running under a hypervisor
                if place.cores_in_socket > 1 {
                    e.edx |= 1 << 28; // HTT: the count in ebx is valid
                }
            }
            0x4 if e.eax & 0x1f != 0 => {
                // Cores per package, and threads sharing this cache: the package for L3.
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { package_ids - 1 } else { 0 };
                e.eax = (e.eax & 0x3fff) | ((sharing & 0xfff) << 14) | (((package_ids - 1) & 0x3f) << 26);
            }
            0xb | 0x1f => {
                let (eax, ebx, level) = match e.index {
                    0 => (0, 1, 1),                        // SMT level: one thread per core
                    1 => (bits, place.cores_in_socket, 2), // core level: the package
                    _ => (0, 0, 0),
                };
                e.eax = eax;
                e.ebx = ebx;
                e.ecx = (level << 8) | e.index;
                e.edx = id;
            }
            0x8000_0008 => e.ecx = (bits << 12) | (place.cores_in_socket - 1),
            0x8000_001d if e.eax & 0x1f != 0 => {
                let level = (e.eax >> 5) & 0x7;
                let sharing = if level >= 3 { package_ids - 1 } else { 0 };
                e.eax = (e.eax & !(0xfff << 14)) | ((sharing & 0xfff) << 14);
            }
            0x8000_001e => {
                e.eax = id;
                e.ebx = place.core & 0xff; // one thread per core
                e.ecx = place.socket & 0xff; // node id; one node per package
                e.edx = 0;
            }
            _ => {}
        }
    }
    cpuid
}

/// Machine-check banks each vCPU reports (MCG_CAP's count), as QEMU gives its guests. Left
/// alone, KVM reports its maximum, 32, and a booting Linux touches every bank's MSRs on
/// every CPU (CTL and STATUS written, STATUS and MISC read): a few exits a bank a CPU, about
/// 300 of a 2-vCPU boot's exits at 32 banks.
const MCE_BANKS: u64 = 10;
/// MCG_CAP: MCG_CTL present.
const MCG_CTL_P: u64 = 1 << 8;

// KVM's machine-check ioctls, which kvm-ioctls does not wrap (`linux/kvm.h`).
vmm_sys_util::ioctl_iow_nr!(KVM_X86_SETUP_MCE, kvm_bindings::KVMIO, 0x9c, u64);
vmm_sys_util::ioctl_ior_nr!(KVM_X86_GET_MCE_CAP_SUPPORTED, kvm_bindings::KVMIO, 0x9d, u64);

/// The MCG_CAP every vCPU gets: `MCE_BANKS` banks (KVM takes up to 32), and MCG_CTL
/// where KVM has it; None where KVM emulates no machine checks.
pub fn mcg_cap(kvm: &kvm_ioctls::Kvm) -> Option<u64> {
    if !kvm.check_extension(kvm_ioctls::Cap::Mce) {
        return None;
    }
    let mut supported = 0u64;
    // SAFETY: the ioctl writes one u64 into `supported`, which outlives the call; `kvm` is
    // an open /dev/kvm.
    let ret = unsafe { vmm_sys_util::ioctl::ioctl_with_mut_ref(kvm, KVM_X86_GET_MCE_CAP_SUPPORTED(), &mut supported) };
    if ret < 0 {
        tracing::warn!("KVM has machine checks but will not say which: {}", std::io::Error::last_os_error());
        return None;
    }
    Some(mcg_cap_within(supported))
}

/// [`MCE_BANKS`] banks, and MCG_CTL where `supported` (KVM's capability bits, no count)
/// has it.
fn mcg_cap_within(supported: u64) -> u64 {
    MCE_BANKS | (supported & MCG_CTL_P)
}

/// Sets up vCPU `id`: CPUID, machine-check banks ([`mcg_cap`]), MSRs, FPU and LAPIC for
/// all; registers for the boot CPU.
pub fn configure(
    vcpu: &VcpuFd,
    id: u32,
    cpuid: &CpuId,
    mcg_cap: Option<u64>,
    boot: Option<BootEntry>,
) -> Result<(), VcpuError> {
    let setup = |what| move |source| VcpuError::Setup { id, what, source };
    vcpu.set_cpuid2(cpuid).map_err(setup("CPUID"))?;
    if let Some(cap) = mcg_cap {
        // SAFETY: the ioctl reads one u64 from `cap`, which outlives the call; `vcpu` is an
        // open vCPU fd that has not run yet.
        let ret = unsafe { vmm_sys_util::ioctl::ioctl_with_ref(vcpu, KVM_X86_SETUP_MCE(), &cap) };
        if ret < 0 {
            return Err(setup("machine-check banks")(kvm_ioctls::Error::last()));
        }
    }
    set_xcr0(vcpu, id, cpuid)?;
    set_msrs(vcpu, id)?;
    let fpu = kvm_fpu { fcw: 0x37f, mxcsr: 0x1f80, ..Default::default() };
    vcpu.set_fpu(&fpu).map_err(setup("FPU"))?;
    set_lint(vcpu, id)?;
    if let Some(entry) = boot {
        set_boot_registers(vcpu, id, entry)?;
    }
    Ok(())
}

/// User-state XSAVE components (x87 through PKRU and AMX); supervisor bits are never in XCR0.
const XCR0_USER_MASK: u64 = 0x0006_02ff;

/// Starts the vCPU with every supported user XSAVE component enabled in XCR0, then sets
/// CPUID again so that KVM sizes CPUID 0xD's save area for that XCR0.
///
/// Some KVM versions (seen with Debian 6.1.192 as L1) compute CPUID.(EAX=0xD,ECX=0).EBX once
/// at KVM_SET_CPUID2 and do not refresh it when the guest's XSETBV enables more
/// components; the guest then reads a 576-byte area and warns "XSAVE consistency problem".
/// Linux writes XCR0 itself during boot, so this initial value changes nothing else.
fn set_xcr0(vcpu: &VcpuFd, id: u32, cpuid: &CpuId) -> Result<(), VcpuError> {
    let Some(leaf) = cpuid.as_slice().iter().find(|e| e.function == 0xd && e.index == 0) else {
        return Ok(());
    };
    let xcr0 = (u64::from(leaf.edx) << 32 | u64::from(leaf.eax)) & XCR0_USER_MASK;
    if xcr0 & 0x3 != 0x3 {
        return Ok(());
    }
    let mut xcrs = vcpu.get_xcrs().map_err(|source| VcpuError::Setup { id, what: "XCRs", source })?;
    xcrs.nr_xcrs = 1;
    xcrs.xcrs[0].xcr = 0;
    xcrs.xcrs[0].value = xcr0;
    vcpu.set_xcrs(&xcrs).map_err(|source| VcpuError::Setup { id, what: "XCR0", source })?;
    vcpu.set_cpuid2(cpuid).map_err(|source| VcpuError::Setup { id, what: "CPUID", source })
}

fn set_msrs(vcpu: &VcpuFd, id: u32) -> Result<(), VcpuError> {
    let entries: Vec<kvm_msr_entry> = [
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
    .into_iter()
    .map(|(index, data)| kvm_msr_entry { index, data, ..Default::default() })
    .collect();
    let msrs =
        Msrs::from_entries(&entries).map_err(|source| VcpuError::MsrList { id, count: entries.len(), source })?;
    let written = vcpu.set_msrs(&msrs).map_err(|source| VcpuError::Setup { id, what: "MSRs", source })?;
    if written != entries.len() {
        tracing::debug!(id, written, wanted = entries.len(), "KVM accepted only some boot MSRs");
    }
    Ok(())
}

/// LINT0 delivers the 8259's ExtINT, LINT1 delivers NMIs, as a PC's BIOS leaves them.
fn set_lint(vcpu: &VcpuFd, id: u32) -> Result<(), VcpuError> {
    let setup = |source| VcpuError::Setup { id, what: "LAPIC", source };
    let mut lapic = vcpu.get_lapic().map_err(setup)?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[reg + i] as u8);
        let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
        for (i, b) in value.to_le_bytes().into_iter().enumerate() {
            lapic.regs[reg + i] = b as _;
        }
    }
    vcpu.set_lapic(&lapic).map_err(setup)
}

fn set_boot_registers(vcpu: &VcpuFd, id: u32, entry: BootEntry) -> Result<(), VcpuError> {
    let setup = |what| move |source| VcpuError::Setup { id, what, source };
    let mut sregs = vcpu.get_sregs().map_err(setup("special registers"))?;
    let code_flags = match entry.mode {
        EntryMode::Pvh => GDT_CODE32,
        EntryMode::Linux64 => GDT_CODE64,
    };
    let code = segment(1, code_flags, 0, 0xfffff);
    let data = segment(2, GDT_DATA, 0, 0xfffff);
    let tss = segment(3, GDT_TSS, 0, 0xfffff);
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    sregs.gdt.base = layout::BOOT_GDT_START;
    sregs.gdt.limit = 4 * 8 - 1;
    sregs.idt.base = layout::BOOT_IDT_START;
    sregs.idt.limit = 7;

    let mut regs = kvm_regs { rflags: 0x2, rip: entry.rip, ..Default::default() };
    match entry.mode {
        EntryMode::Pvh => {
            sregs.cr0 = X86_CR0_PE;
            sregs.cr4 = 0;
            sregs.efer = 0;
            regs.rbx = layout::PVH_INFO_START;
        }
        EntryMode::Linux64 => {
            sregs.cr3 = layout::PML4_START;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG;
            sregs.efer |= EFER_LME | EFER_LMA;
            regs.rsp = layout::BOOT_STACK_POINTER;
            regs.rbp = layout::BOOT_STACK_POINTER;
            regs.rsi = layout::ZERO_PAGE_START;
        }
    }
    vcpu.set_sregs(&sregs).map_err(setup("special registers"))?;
    vcpu.set_regs(&regs).map_err(setup("registers"))
}

/// Writes the boot GDT (and, for the 64-bit entry, identity page tables for the first GiB).
pub fn write_boot_tables(mem: &GuestMemoryMmap, mode: EntryMode) -> Result<(), VcpuError> {
    let code = if mode == EntryMode::Pvh { GDT_CODE32 } else { GDT_CODE64 };
    let gdt = [0, gdt_entry(code, 0, 0xfffff), gdt_entry(GDT_DATA, 0, 0xfffff), gdt_entry(GDT_TSS, 0, 0xfffff)];
    let guest_write = |what| move |source| VcpuError::GuestWrite { what, source };
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(layout::BOOT_GDT_START + 8 * i as u64)).map_err(guest_write("GDT"))?;
    }
    mem.write_obj(0u64, GuestAddress(layout::BOOT_IDT_START)).map_err(guest_write("IDT"))?;
    if mode == EntryMode::Linux64 {
        let pt = guest_write("page tables");
        mem.write_obj(layout::PDPTE_START | 0x3, GuestAddress(layout::PML4_START)).map_err(pt)?;
        mem.write_obj(layout::PDE_START | 0x3, GuestAddress(layout::PDPTE_START)).map_err(pt)?;
        for i in 0..512u64 {
            // 2 MiB pages, present + writable + page size.
            mem.write_obj((i << 21) | 0x83, GuestAddress(layout::PDE_START + i * 8)).map_err(pt)?;
        }
    }
    Ok(())
}

/// What a vCPU thread needs to serve its exits.
#[derive(Clone)]
pub struct ExitContext {
    /// Port I/O devices.
    pub pio: Arc<Bus>,
    /// MMIO devices.
    pub mmio: Arc<Bus>,
    /// Where guest power-off and reset requests go.
    pub signal: Arc<GuestExitSignal>,
    /// Set by the VMM to make every vCPU leave its loop.
    pub stop: Arc<AtomicBool>,
    /// Set with `stop` when the VMM was interrupted (a harness ending a hung guest): each
    /// vCPU then says where the guest was as it leaves (`log_state_at_stop`).
    pub tell_state: Arc<AtomicBool>,
    /// Where each vCPU adds the exits it served when it leaves its loop.
    pub exits: Arc<Mutex<ExitTally>>,
}

/// Runs vCPU `id` until the VMM asks it to stop or the guest cannot go on.
pub fn run(mut vcpu: VcpuFd, id: u32, ctx: &ExitContext) -> Result<(), VcpuError> {
    let _done = LeaveLog(id);
    let mut exits = VcpuTally::new(&ctx.exits);
    let count = &mut exits.tally;
    while !ctx.stop.load(Ordering::Acquire) {
        match vcpu.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                ctx.pio.read(u64::from(port), data);
                count.count(ExitKind::Pio(port));
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                ctx.pio.write(u64::from(port), data);
                count.count(ExitKind::Pio(port));
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                count.count(ExitKind::Mmio(ctx.mmio.read(addr, data)));
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                count.count(ExitKind::Mmio(ctx.mmio.write(addr, data)));
            }
            Ok(VcpuExit::Shutdown) => {
                // Triple fault: a PC resets. Said at warn: nothing else tells why a guest
                // vanished without a word. (No registers: on AMD, KVM has already reset the
                // vCPU by the time it reports the shutdown.)
                tracing::warn!(id, "{}", gdrvm_model::TRIPLE_FAULT_LINE);
                ctx.signal.request(GuestExit::Reset);
                return Ok(());
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                let exit =
                    if kind == kvm_bindings::KVM_SYSTEM_EVENT_RESET { GuestExit::Reset } else { GuestExit::PowerOff };
                ctx.signal.request(exit);
                return Ok(());
            }
            Ok(VcpuExit::Hlt) => {
                count.count(ExitKind::Hlt);
                // With the in-kernel LAPIC, HLT only exits when the vCPU can never wake.
                ctx.signal.request(GuestExit::PowerOff);
                return Ok(());
            }
            Ok(VcpuExit::Intr) => count.count(ExitKind::Interrupted),
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                return Err(VcpuError::Hardware {
                    id,
                    reason: format!("entry failed (reason {reason:#x}, host cpu {cpu})"),
                });
            }
            Ok(VcpuExit::InternalError) => {
                // SAFETY: KVM filled the `internal` member for a KVM_EXIT_INTERNAL_ERROR exit.
                let sub = unsafe { vcpu.get_kvm_run().__bindgen_anon_1.internal.suberror };
                let reason = match sub {
                    1 => "instruction emulation failed".to_string(),
                    other => format!("internal error, suberror {other}"),
                };
                return Err(VcpuError::Hardware { id, reason });
            }
            Ok(other) => {
                count.count(ExitKind::Other);
                tracing::debug!(id, exit = ?other, "unhandled vCPU exit");
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => count.count(ExitKind::Interrupted),
            Err(source) => return Err(VcpuError::Run { id, source }),
        }
    }
    if ctx.tell_state.load(Ordering::Acquire) {
        log_state_at_stop(&vcpu, id);
    }
    Ok(())
}

/// What KVM's multiprocessing state says of a vCPU, as a note for [`log_state_at_stop`].
fn mp_state_note(state: u32) -> &'static str {
    match state {
        kvm_bindings::KVM_MP_STATE_HALTED => gdrvm_model::VCPU_HALTED,
        kvm_bindings::KVM_MP_STATE_UNINITIALIZED | kvm_bindings::KVM_MP_STATE_INIT_RECEIVED => {
            ", not started (no INIT-SIPI yet)"
        }
        _ => "",
    }
}

/// Logs where a stopped vCPU was: a guest that hung says no more itself, and whether each
/// CPU sat halted with interrupts on (waiting for a device or a timer that never came) or
/// ran in the kernel (a loop, a lock) is the first thing to know about the hang.
fn log_state_at_stop(vcpu: &VcpuFd, id: u32) {
    let (regs, sregs) = match (vcpu.get_regs(), vcpu.get_sregs()) {
        (Ok(r), Ok(s)) => (r, s),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(id, "{} unreadable ({e})", gdrvm_model::VCPU_STATE_LINE);
            return;
        }
    };
    let state = vcpu.get_mp_state().map_or("", |m| mp_state_note(m.mp_state));
    tracing::warn!(
        id,
        "{} rip {:#x} ring {} rsp {:#x} rflags {:#x} {} cr3 {:#x}{}",
        gdrvm_model::VCPU_STATE_LINE,
        regs.rip,
        sregs.cs.dpl,
        regs.rsp,
        regs.rflags,
        if regs.rflags & RFLAGS_IF != 0 { "(interrupts on)" } else { gdrvm_model::VCPU_IRQS_OFF },
        sregs.cr3,
        state
    );
}

/// RFLAGS' interrupt-enable flag.
const RFLAGS_IF: u64 = 1 << 9;

/// Logs when a vCPU leaves its loop, on every path.
struct LeaveLog(u32);

impl Drop for LeaveLog {
    fn drop(&mut self) {
        tracing::debug!(id = self.0, "vCPU left its loop");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_the_state_note_tells_halted_and_unstarted_cpus() {
        assert_eq!(mp_state_note(kvm_bindings::KVM_MP_STATE_HALTED), ", halted");
        assert_eq!(mp_state_note(kvm_bindings::KVM_MP_STATE_UNINITIALIZED), ", not started (no INIT-SIPI yet)");
        assert_eq!(mp_state_note(kvm_bindings::KVM_MP_STATE_RUNNABLE), "");
    }

    #[test]
    fn test_gdt_entries_match_segments() {
        // The long-mode code segment Linux expects: base 0, 4 GiB limit, L=1.
        assert_eq!(gdt_entry(GDT_CODE64, 0, 0xfffff), 0x00af_9b00_0000_ffff);
        assert_eq!(gdt_entry(GDT_CODE32, 0, 0xfffff), 0x00cf_9b00_0000_ffff);
        assert_eq!(gdt_entry(GDT_DATA, 0, 0xfffff), 0x00cf_9300_0000_ffff);
        let cs = segment(1, GDT_CODE64, 0, 0xfffff);
        assert_eq!((cs.selector, cs.l, cs.db, cs.type_, cs.present, cs.limit), (8, 1, 0, 0xb, 1, 0xffff_ffff));
        let cs32 = segment(1, GDT_CODE32, 0, 0xfffff);
        assert_eq!((cs32.l, cs32.db), (0, 1));
        let tr = segment(3, GDT_TSS, 0, 0xfffff);
        assert_eq!((tr.selector, tr.s, tr.type_), (0x18, 0, 0xb));
    }

    #[test]
    fn test_tsc_deadline_is_announced_only_when_kvm_has_it() {
        let leaf1 = kvm_bindings::kvm_cpuid_entry2 { function: 0x1, ecx: 0x1, ..Default::default() };
        let mut cpuid = CpuId::from_entries(&[leaf1]).unwrap();
        announce_emulated_features(&mut cpuid, false);
        assert_eq!(cpuid.as_slice()[0].ecx, 0x1);
        announce_emulated_features(&mut cpuid, true);
        assert_eq!(cpuid.as_slice()[0].ecx, 0x1 | 1 << 24);
    }

    #[test]
    fn test_mcg_cap_takes_qemus_bank_count_within_kvms() {
        // KVM's supported bits: MCG_CTL_P and MCG_SER_P (and LMCE on Intel).
        assert_eq!(mcg_cap_within(MCG_CTL_P | 1 << 24 | 1 << 27), 10 | MCG_CTL_P);
        assert_eq!(mcg_cap_within(0), 10);
        if let Ok(kvm) = kvm_ioctls::Kvm::new() {
            if let Some(cap) = mcg_cap(&kvm) {
                assert_eq!(cap & 0xff, MCE_BANKS, "{cap:#x}");
            }
        }
    }

    #[test]
    fn test_cpuid_topology_per_vcpu() {
        let leaf = |function, index, eax| kvm_bindings::kvm_cpuid_entry2 { function, index, eax, ..Default::default() };
        let entries = [
            kvm_bindings::kvm_cpuid_entry2 { function: 1, ebx: 0x0800, ..Default::default() },
            leaf(0xb, 0, 0),
            leaf(0xb, 1, 0),
            leaf(0x8000_0008, 0, 0),
            leaf(0x8000_001d, 0, (1 << 5) | 1),              // L1 data cache
            leaf(0x8000_001d, 3, (3 << 5) | 3 | (15 << 14)), // L3, claimed shared by 16
            leaf(0x8000_001e, 0, 0),
        ];
        let base = CpuId::from_entries(&entries).unwrap();
        // vCPU 5 of a 2-node machine with 3 + 3 vCPUs: package 1, core 1, APIC id 0b101.
        let place = CpuPlace { apic_id: 5, socket: 1, core: 1, cores_in_socket: 3, core_bits: 2 };
        let c = cpuid_for(&base, &place);
        let e = c.as_slice();
        assert_eq!(e[0].ebx >> 24, 5);
        assert_eq!((e[0].ebx >> 16) & 0xff, 4);
        assert_eq!(e[0].ebx & 0xffff, 0x0800);
        assert_ne!(e[0].ecx & (1 << 31), 0);
        assert_eq!((e[1].ebx, e[1].edx, e[1].ecx >> 8), (1, 5, 1));
        assert_eq!((e[2].eax, e[2].ebx, e[2].ecx >> 8), (2, 3, 2));
        assert_eq!(e[3].ecx, (2 << 12) | 2);
        assert_eq!((e[4].eax >> 14) & 0xfff, 0, "L1 is per core");
        assert_eq!((e[5].eax >> 14) & 0xfff, 3, "L3 is shared by the 4 APIC ids of the package");
        assert_eq!((e[6].eax, e[6].ebx, e[6].ecx), (5, 1, 1));
    }

    #[test]
    fn test_page_tables_identity_map_first_gib() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        write_boot_tables(&mem, EntryMode::Linux64).unwrap();
        let pml4: u64 = mem.read_obj(GuestAddress(layout::PML4_START)).unwrap();
        assert_eq!(pml4, layout::PDPTE_START | 3);
        let last: u64 = mem.read_obj(GuestAddress(layout::PDE_START + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
        let gdt1: u64 = mem.read_obj(GuestAddress(layout::BOOT_GDT_START + 8)).unwrap();
        assert_eq!(gdt1, gdt_entry(GDT_CODE64, 0, 0xfffff));
    }
}
