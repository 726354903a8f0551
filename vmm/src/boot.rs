//! Loading the kernel, initramfs and command line, and writing the boot protocol
//! structures: `boot_params` (zero page) for the 64-bit Linux boot protocol, or PVH
//! `hvm_start_info` when asked to enter a vmlinux with a PVH note at its PVH entry.

use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::thread::{Scope, ScopedJoinHandle};

use gdrvm_model::layout::{self, E820Entry};
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::loader::elf::start_info::{hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info};
use linux_loader::loader::elf::PvhBootCapability;
use linux_loader::loader::{BzImage, Cmdline, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{Address, GuestAddress, GuestMemoryMmap};

use crate::config::VmConfig;
use crate::initrd::{InitrdError, InitrdSource};
use crate::stats::SetupPhases;

/// Errors loading the guest's boot images.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file could not be opened or read.
    #[error("cannot read kernel '{path}'")]
    KernelRead {
        /// The kernel path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel is neither a loadable ELF nor a bzImage.
    #[error("kernel '{path}' cannot be loaded (neither an x86-64 vmlinux nor a bzImage)")]
    KernelLoad {
        /// The kernel path.
        path: String,
        /// The loader's error.
        #[source]
        source: linux_loader::loader::Error,
    },
    /// The command line is too long or has a NUL byte.
    #[error("kernel command line rejected: {0}")]
    Cmdline(String),
    /// The initramfs does not fit below the MMIO hole after the kernel.
    #[error("initrd of {size} bytes does not fit in guest RAM after the kernel (ends at {kernel_end:#x})")]
    InitrdTooBig {
        /// Initramfs size.
        size: usize,
        /// End of the loaded kernel.
        kernel_end: u64,
    },
    /// The initramfs could not be read or is corrupt.
    #[error(transparent)]
    Initrd(#[from] InitrdError),
    /// Writing boot structures into guest memory failed.
    #[error("cannot write {what} into guest memory")]
    GuestWrite {
        /// What was being written.
        what: &'static str,
    },
}

/// How the boot CPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryMode {
    /// PVH: 32-bit protected mode, paging off, `rbx` = `hvm_start_info`. Only on request
    /// ([`VmConfig::pvh`]): Linux's PVH entry looks for Xen (`xen_prepare_pvh`) before
    /// anything else, and that scan of all 256 hypervisor CPUID bases is one exit each,
    /// 256 of a boot's few thousand.
    Pvh,
    /// 64-bit Linux boot protocol: long mode, identity paging, `rsi` = `boot_params`. The
    /// default for a vmlinux (its ELF entry, `startup_64`) and the entry of a bzImage.
    Linux64,
}

/// What loading left in guest RAM: the boot CPU's entry and where the images lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// Where and how the boot CPU starts.
    pub entry: BootEntry,
    /// The kernel image in guest physical memory, from its load address (a vmlinux's
    /// entry point) to the end of its last segment, zero-filled parts (bss, brk) included.
    pub kernel: Range<u64>,
    /// The initramfs, where there is one.
    pub initrd: Option<Range<u64>>,
}

/// Where and how the boot CPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootEntry {
    /// First instruction.
    pub rip: u64,
    /// Entry protocol.
    pub mode: EntryMode,
}

const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
/// `hvm_start_info.magic`.
const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;
/// Offset of the 64-bit entry point from the start of a bzImage's protected-mode code.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Highest address the initrd may end at for 32-bit-clean kernels.
const INITRD_ADDR_MAX: u64 = 0x8000_0000;

/// The kernel's and the initramfs's copies into guest memory, under way on threads of
/// `scope` while the rest of the machine is set up: they need only guest memory, and are
/// the biggest part of the setup (about 55 MB; nested, 145-175 ms for the kernel and
/// 100-130 ms for the initramfs, each on its own thread).
pub struct Copies<'scope> {
    kernel: ScopedJoinHandle<'scope, Result<KernelLoaderResult, BootError>>,
    initrd: Option<InitrdCopy<'scope>>,
}

/// The initrd's copy: its size, where it goes, and the copy itself unless it fits nowhere.
struct InitrdCopy<'scope> {
    job: Option<ScopedJoinHandle<'scope, Result<(), InitrdError>>>,
    size: usize,
    addr: Option<u64>,
}

/// Starts copying the kernel and the initramfs into `mem` on threads of `scope`; the
/// initrd's place depends only on RAM and its size, and is checked against the kernel's
/// end once both are in ([`finish`]).
pub fn start_copies<'scope, 'env>(
    scope: &'scope Scope<'scope, 'env>,
    mem: &'env GuestMemoryMmap,
    config: &'env VmConfig,
    initrd: Option<&'env dyn InitrdSource>,
) -> Copies<'scope> {
    let initrd = initrd.map(|source| {
        let (size, addr) = (source.size(), initrd_addr(config.memory, source.size()));
        let job = addr.map(|addr| scope.spawn(move || source.load(mem, GuestAddress(addr))));
        InitrdCopy { job, size, addr }
    });
    Copies { kernel: scope.spawn(move || load_kernel(mem, config)), initrd }
}

/// Loads everything the guest needs to boot and returns the boot CPU's entry, marking the
/// kernel's and the initramfs's loads in `phases`.
pub fn load(
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    initrd: Option<&dyn InitrdSource>,
    rsdp: u64,
    phases: &mut SetupPhases,
) -> Result<Loaded, BootError> {
    std::thread::scope(|s| finish(start_copies(s, mem, config, initrd), mem, config, rsdp, phases))
}

/// Waits for `copies`, then writes the command line and the boot structures around them
/// and returns the boot CPU's entry and where the images lie.
pub fn finish(
    copies: Copies<'_>,
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    rsdp: u64,
    phases: &mut SetupPhases,
) -> Result<Loaded, BootError> {
    let kernel = join(copies.kernel);
    let initrd = copies.initrd.map(|c| (c.job.map(join), c.size, c.addr));
    let kernel = kernel?;
    let initrd = match initrd {
        Some((Some(loaded), size, Some(addr))) if addr >= kernel.kernel_end => {
            loaded?;
            Some((addr, size))
        }
        Some((_, size, _)) => return Err(BootError::InitrdTooBig { size, kernel_end: kernel.kernel_end }),
        None => None,
    };
    let cmdline = write_cmdline(mem, &config.cmdline)?;
    phases.mark("kernel and initramfs load (the rest of it)");
    let e820 = layout::e820_map(config.memory);

    let entry = match kernel.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) if config.pvh => {
            write_pvh_start_info(mem, cmdline, initrd, rsdp, &e820)?;
            BootEntry { rip: entry.raw_value(), mode: EntryMode::Pvh }
        }
        _ => {
            write_zero_page(mem, &kernel, cmdline, initrd, rsdp, &e820)?;
            let rip = match kernel.setup_header {
                // A bzImage: its 64-bit entry sits 0x200 into the protected-mode code.
                Some(_) => kernel.kernel_load.raw_value() + BZIMAGE_64BIT_ENTRY_OFFSET,
                // A vmlinux: the loader returns its ELF entry point.
                None => kernel.kernel_load.raw_value(),
            };
            BootEntry { rip, mode: EntryMode::Linux64 }
        }
    };
    Ok(Loaded {
        entry,
        kernel: kernel.kernel_load.raw_value().min(kernel.kernel_end)..kernel.kernel_end,
        initrd: initrd.map(|(addr, size)| addr..addr + size as u64),
    })
}

/// Waits for a copy's thread; its panic is this thread's.
fn join<T>(job: ScopedJoinHandle<'_, T>) -> T {
    job.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

fn load_kernel(mem: &GuestMemoryMmap, config: &VmConfig) -> Result<KernelLoaderResult, BootError> {
    let path = config.kernel.display().to_string();
    let read_err = |source| BootError::KernelRead { path: path.clone(), source };
    let mut file = File::open(&config.kernel).map_err(read_err)?;
    let mut magic = [0u8; 4];
    let is_elf = file.read_exact(&mut magic).is_ok() && &magic == ELF_MAGIC;
    let himem = Some(GuestAddress(layout::HIMEM_START));
    let result =
        if is_elf { Elf::load(mem, None, &mut file, himem) } else { BzImage::load(mem, None, &mut file, himem) };
    result.map_err(|source| BootError::KernelLoad { path, source })
}

/// Kernel parameters the machine itself implies, ahead of the user's. `pci=noearly`, as
/// there is no type-1 configuration mechanism (see `pci`). Without it Linux reads bus 0
/// and the AMD northbridge slots through ports 0xcf8/0xcfc before it has ECAM (early
/// quirks and the GART aperture search in `setup_arch`, the AMD root-bus probe at
/// postcore), about 110 accesses and 220 exits that all read all-ones, and tries the
/// early MMCONFIG check at `pci_arch_init`, which 6.1 passes only with type 1. ECAM is
/// taken from MCFG at `acpi_init` either way.
///
/// `8250.nr_uarts=1`: the machine has one UART, COM1. Without it the 8250 driver probes
/// COM2-4 at their ISA addresses too, each probe a run of port reads that find nothing.
const MACHINE_ARGS: &str = "pci=noearly 8250.nr_uarts=1";

fn write_cmdline(mem: &GuestMemoryMmap, text: &str) -> Result<(u64, usize), BootError> {
    let text = format!("{MACHINE_ARGS} {text}");
    let text = text.trim_end();
    let mut cmdline = Cmdline::new(layout::CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    cmdline.insert_str(text).map_err(|e| BootError::Cmdline(e.to_string()))?;
    linux_loader::loader::load_cmdline(mem, GuestAddress(layout::CMDLINE_START), &cmdline)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    Ok((layout::CMDLINE_START, text.len() + 1))
}

/// Where the initrd goes: as high as it fits below the MMIO hole (and 2 GiB), page-aligned;
/// `None` if it is bigger than that.
fn initrd_addr(memory: u64, size: usize) -> Option<u64> {
    let top = layout::low_ram_end(memory).min(INITRD_ADDR_MAX);
    Some(top.checked_sub(size as u64)? & !0xfff)
}

fn write_pvh_start_info(
    mem: &GuestMemoryMmap,
    (cmdline_addr, _): (u64, usize),
    initrd: Option<(u64, usize)>,
    rsdp: u64,
    e820: &[E820Entry],
) -> Result<(), BootError> {
    let memmap: Vec<hvm_memmap_table_entry> = e820
        .iter()
        .map(|e| hvm_memmap_table_entry { addr: e.addr, size: e.size, type_: e.kind as u32, reserved: 0 })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        cmdline_paddr: cmdline_addr,
        rsdp_paddr: rsdp,
        memmap_paddr: layout::PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        nr_modules: u32::from(initrd.is_some()),
        modlist_paddr: if initrd.is_some() { layout::PVH_MODLIST_START } else { 0 },
        ..Default::default()
    };
    let mut params = BootParams::new(&start_info, GuestAddress(layout::PVH_INFO_START));
    params.set_sections(&memmap, GuestAddress(layout::PVH_MEMMAP_START));
    if let Some((addr, size)) = initrd {
        let module = hvm_modlist_entry { paddr: addr, size: size as u64, ..Default::default() };
        params.set_modules(&[module], GuestAddress(layout::PVH_MODLIST_START));
    }
    PvhBootConfigurator::write_bootparams(&params, mem).map_err(|_| BootError::GuestWrite { what: "hvm_start_info" })
}

/// `boot_params.hdr.header`: "HdrS".
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
/// `boot_params.hdr.boot_flag`.
const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
/// `type_of_loader`: undefined boot loader.
const KERNEL_LOADER_OTHER: u8 = 0xff;
/// Kernel alignment for a relocatable vmlinux entered without a setup header.
const KERNEL_MIN_ALIGNMENT: u32 = 0x0100_0000;

fn write_zero_page(
    mem: &GuestMemoryMmap,
    kernel: &KernelLoaderResult,
    (cmdline_addr, cmdline_size): (u64, usize),
    initrd: Option<(u64, usize)>,
    rsdp: u64,
    e820: &[E820Entry],
) -> Result<(), BootError> {
    let mut params = boot_params::default();
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    } else {
        params.hdr.header = KERNEL_HDR_MAGIC;
        params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT;
    }
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.cmd_line_ptr = cmdline_addr as u32;
    params.hdr.cmdline_size = cmdline_size as u32;
    if let Some((addr, size)) = initrd {
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    params.acpi_rsdp_addr = rsdp;
    for (slot, e) in params.e820_table.iter_mut().zip(e820) {
        *slot = boot_e820_entry { addr: e.addr, size: e.size, r#type: e.kind as u32 };
    }
    params.e820_entries = e820.len().min(params.e820_table.len()) as u8;
    let bp = BootParams::new(&params, GuestAddress(layout::ZERO_PAGE_START));
    LinuxBootConfigurator::write_bootparams(&bp, mem).map_err(|_| BootError::GuestWrite { what: "boot_params" })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use vm_memory::GuestMemoryMmap;

    use super::*;
    use vm_memory::Bytes;

    /// Raw bytes as an initrd (the tests' own, unchecked).
    impl InitrdSource for &[u8] {
        fn size(&self) -> usize {
            self.len()
        }
        fn load(&self, mem: &GuestMemoryMmap, addr: GuestAddress) -> Result<(), InitrdError> {
            mem.write_slice(self, addr)
                .map_err(|e| InitrdError::Read { path: "test".into(), source: std::io::Error::other(e.to_string()) })
        }
    }

    fn phases() -> SetupPhases {
        SetupPhases::new(std::time::Instant::now())
    }

    const MIB: u64 = 1 << 20;

    fn mem(size: u64) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size as usize)]).unwrap()
    }

    /// A minimal 64-bit ELF: one PT_LOAD of `code` at 16 MiB, plus a PT_NOTE carrying the
    /// Xen PVH entry note when `pvh` is set.
    fn tiny_elf(pvh: bool) -> Vec<u8> {
        let code: &[u8] = &[0xf4]; // hlt
        let load_addr: u64 = 16 * MIB;
        let phnum: u16 = if pvh { 2 } else { 1 };
        let phoff = 64u64;
        let data_off = phoff + 56 * u64::from(phnum);
        let mut note = Vec::new();
        note.extend_from_slice(&4u32.to_le_bytes()); // namesz "Xen\0"
        note.extend_from_slice(&4u32.to_le_bytes()); // descsz
        note.extend_from_slice(&18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
        note.extend_from_slice(b"Xen\0");
        note.extend_from_slice(&(load_addr as u32 + 0x40).to_le_bytes());
        let note_off = data_off + code.len() as u64;

        let mut f = Vec::new();
        f.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
        f.extend_from_slice(&[0; 8]);
        f.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
        f.extend_from_slice(&62u16.to_le_bytes()); // EM_X86_64
        f.extend_from_slice(&1u32.to_le_bytes());
        f.extend_from_slice(&(load_addr + 0x1000).to_le_bytes()); // e_entry
        f.extend_from_slice(&phoff.to_le_bytes());
        f.extend_from_slice(&0u64.to_le_bytes()); // shoff
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&64u16.to_le_bytes());
        f.extend_from_slice(&56u16.to_le_bytes());
        f.extend_from_slice(&phnum.to_le_bytes());
        f.extend_from_slice(&[0; 6]);
        let mut phdr = |ty: u32, off: u64, addr: u64, size: u64| {
            f.extend_from_slice(&ty.to_le_bytes());
            f.extend_from_slice(&5u32.to_le_bytes());
            f.extend_from_slice(&off.to_le_bytes());
            f.extend_from_slice(&addr.to_le_bytes());
            f.extend_from_slice(&addr.to_le_bytes());
            f.extend_from_slice(&size.to_le_bytes());
            f.extend_from_slice(&size.to_le_bytes());
            f.extend_from_slice(&4u64.to_le_bytes());
        };
        phdr(1, data_off, load_addr, code.len() as u64);
        if pvh {
            phdr(4, note_off, 0, note.len() as u64);
        }
        f.extend_from_slice(code);
        if pvh {
            f.extend_from_slice(&note);
        }
        f
    }

    fn config(dir: &tempfile::TempDir, kernel: &[u8]) -> VmConfig {
        let path = dir.path().join("kernel");
        std::fs::File::create(&path).unwrap().write_all(kernel).unwrap();
        VmConfig {
            kernel: path,
            pvh: true,
            initrd: None,
            cmdline: "console=ttyS0 quiet".into(),
            cpus: 1,
            memory: 64 * MIB,
            node: gdrvm_model::node::Node::plain(1, 64 * MIB),
            wires: Default::default(),
        }
    }

    #[test]
    fn test_pvh_vmlinux_gets_start_info() {
        let dir = tempfile::tempdir().unwrap();
        let m = mem(64 * MIB);
        let loaded =
            load(&m, &config(&dir, &tiny_elf(true)), Some(&&b"070701initrd"[..]), layout::ACPI_START, &mut phases())
                .unwrap();
        assert_eq!(loaded.entry, BootEntry { rip: 16 * MIB + 0x40, mode: EntryMode::Pvh });
        // Where the images lie, for the prefault: the kernel at 16 MiB, the initrd in the
        // last page of RAM.
        assert!(loaded.kernel.start >= 16 * MIB && loaded.kernel.end >= loaded.kernel.start);
        assert_eq!(loaded.initrd, Some(64 * MIB - 0x1000..64 * MIB - 0x1000 + 12));
        let info: hvm_start_info = m.read_obj(GuestAddress(layout::PVH_INFO_START)).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC);
        assert_eq!(info.rsdp_paddr, layout::ACPI_START);
        assert_eq!(info.nr_modules, 1);
        assert_eq!(info.memmap_entries, 4, "low RAM, BIOS area, RAM, ECAM");
        let module: hvm_modlist_entry = m.read_obj(GuestAddress(info.modlist_paddr)).unwrap();
        assert_eq!(module.size, 12);
        assert_eq!(module.paddr % 4096, 0);
        assert!(module.paddr + module.size <= 64 * MIB);
        let want = b"pci=noearly 8250.nr_uarts=1 console=ttyS0 quiet";
        let mut cmd = [0u8; 48];
        m.read_slice(&mut cmd, GuestAddress(info.cmdline_paddr)).unwrap();
        assert_eq!(&cmd[..want.len()], want, "the machine's parameters, then the user's");
        assert_eq!(cmd[want.len()], 0);
        let ram: hvm_memmap_table_entry = m
            .read_obj(GuestAddress(layout::PVH_MEMMAP_START + 2 * std::mem::size_of::<hvm_memmap_table_entry>() as u64))
            .unwrap();
        assert_eq!((ram.addr, ram.size, ram.type_), (MIB, 63 * MIB, 1));
    }

    #[test]
    fn test_pvh_vmlinux_takes_the_64bit_entry_unless_pvh_is_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let m = mem(64 * MIB);
        let cfg = VmConfig { pvh: false, ..config(&dir, &tiny_elf(true)) };
        let entry = load(&m, &cfg, None, layout::ACPI_START, &mut phases()).unwrap().entry;
        assert_eq!(entry, BootEntry { rip: 16 * MIB + 0x1000, mode: EntryMode::Linux64 });
        let params: boot_params = m.read_obj(GuestAddress(layout::ZERO_PAGE_START)).unwrap();
        assert_eq!({ params.acpi_rsdp_addr }, layout::ACPI_START);
    }

    #[test]
    fn test_vmlinux_without_pvh_note_uses_zero_page() {
        let dir = tempfile::tempdir().unwrap();
        let m = mem(64 * MIB);
        let entry = load(&m, &config(&dir, &tiny_elf(false)), None, layout::ACPI_START, &mut phases()).unwrap().entry;
        assert_eq!(entry, BootEntry { rip: 16 * MIB + 0x1000, mode: EntryMode::Linux64 });
        let params: boot_params = m.read_obj(GuestAddress(layout::ZERO_PAGE_START)).unwrap();
        assert_eq!({ params.hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ params.hdr.boot_flag }, KERNEL_BOOT_FLAG_MAGIC);
        assert_eq!({ params.hdr.cmd_line_ptr }, layout::CMDLINE_START as u32);
        assert_eq!({ params.acpi_rsdp_addr }, layout::ACPI_START);
        assert_eq!(params.e820_entries, 4);
        assert_eq!({ params.hdr.ramdisk_size }, 0);
    }

    #[test]
    fn test_garbage_kernel_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let m = mem(64 * MIB);
        let err = load(&m, &config(&dir, b"MZ not a kernel at all"), None, 0, &mut phases()).unwrap_err();
        assert!(err.to_string().contains("cannot be loaded"), "{err}");
    }

    #[test]
    fn test_initrd_too_big_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let m = mem(64 * MIB);
        let big = vec![0u8; 63 * MIB as usize];
        let err = load(&m, &config(&dir, &tiny_elf(true)), Some(&big.as_slice()), 0, &mut phases()).unwrap_err();
        assert!(matches!(err, BootError::InitrdTooBig { .. }), "{err}");
    }

    #[test]
    fn test_overlong_cmdline_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let m = mem(64 * MIB);
        let mut cfg = config(&dir, &tiny_elf(true));
        cfg.cmdline = "x".repeat(5000);
        assert!(matches!(load(&m, &cfg, None, 0, &mut phases()), Err(BootError::Cmdline(_))));
    }
}
