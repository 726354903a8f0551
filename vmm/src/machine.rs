//! One VM from start to stop: KVM, memory, firmware, devices and vCPU threads, supervised by
//! an event loop that feeds the console, watches for guest power-off and host signals, and
//! tears everything down on every path.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use event_manager::{EventManager, EventOps, Events, MutEventSubscriber, SubscriberOps};
use gdrvm_devices::{
    lock, AcpiSleepControl, Bus, BusDevice, DebugExit, GuestExit, GuestExitSignal, ResetRegister, Serial, SerialInput,
    ACPI_RESET_PORT, ACPI_SLEEP_LEN, ACPI_SLEEP_PORT, COM1_IRQ, COM1_LEN, COM1_PORT, I8042,
};
use gdrvm_model::layout;
use gdrvm_model::node::Node;
use gdrvm_model::{Expectations, DEBUG_EXIT_PORT};
use kvm_bindings::{
    kvm_clock_data, kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::signal::{register_signal_handler, Killable, SIGRTMIN};

use crate::config::{ConfigError, VmConfig};
use crate::console::{EscapeFilter, InputAction, RawTerminal};
use crate::cpu_topology::CpuPlace;
use crate::host_numa::{self, HostNumaError, HostPlacement};
use crate::irq::{GsiRouter, IrqError};
use crate::pci::{Ecam, PciSegment};
use crate::prefault::{self, Prefault};
use crate::signals::StopSignals;
use crate::stats::{ExitTally, SetupPhases};
use crate::vcpu::{self, ExitContext, VcpuError};
use crate::{acpi, bios, boot, cpu_topology, initrd, memory, mptable, wiring};

/// Errors that stop a VM from being built or run.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A KVM call failed.
    #[error("KVM: cannot {what}")]
    Kvm {
        /// What was being done.
        what: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be created.
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    /// The initramfs is unusable.
    #[error(transparent)]
    Initrd(#[from] initrd::InitrdError),
    /// The kernel could not be loaded.
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    /// The devices behind the node's functions could not be set up.
    #[error(transparent)]
    Wiring(#[from] wiring::WiringError),
    /// The firmware tables could not be written.
    #[error(transparent)]
    Acpi(#[from] acpi::AcpiError),
    /// The MP tables could not be written.
    #[error(transparent)]
    MpTable(#[from] mptable::MpTableError),
    /// A vCPU failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// A guest NUMA node could not be bound to its host node.
    #[error("{node}: {source}")]
    HostNuma {
        /// The node file (or preset) that asked for it.
        node: String,
        /// Why.
        #[source]
        source: HostNumaError,
    },
    /// Devices overlap.
    #[error("device layout: {0}")]
    Bus(#[from] gdrvm_devices::BusError),
    /// Interrupt routing could not be set up.
    #[error(transparent)]
    Irq(#[from] IrqError),
    /// A host resource (eventfd, epoll, signalfd, thread) could not be had.
    #[error("host: cannot {what}")]
    Host {
        /// What was being done.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Guest RAM could not be written or its host mapping found.
    #[error("guest memory: cannot {what}")]
    GuestMemory {
        /// What was being done.
        what: &'static str,
        /// vm-memory's error.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The event loop could not be created.
    #[error("host: cannot create the event loop")]
    EventLoop(#[source] event_manager::Error),
}

impl VmmError {
    /// True for errors in what the user asked for (exit status 2), as opposed to failures
    /// to run it (125).
    pub fn is_usage(&self) -> bool {
        matches!(self, VmmError::Config(_))
    }
}

fn host(what: &'static str) -> impl FnOnce(std::io::Error) -> VmmError {
    move |source| VmmError::Host { what, source }
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
    move |source| VmmError::Kvm { what, source }
}

/// How the VM stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The guest powered off.
    PoweredOff,
    /// The guest reset (reboot, triple fault, panic with `panic=-1`).
    Reset,
    /// The host asked the VMM to stop (signal, or Ctrl-A x on the console).
    Interrupted,
}

/// What one run produced.
#[derive(Debug, Clone)]
pub struct RunReport {
    /// How the VM stopped.
    pub outcome: Outcome,
    /// The status the guest wrote to the debug-exit port, if any.
    pub status: Option<u8>,
    /// Time from `started` (given to [`run`]) to the boot CPU's first KVM_RUN.
    pub setup: Option<Duration>,
    /// That time by phase, in order.
    pub phases: Vec<(&'static str, Duration)>,
    /// The exits the VMM served (exits KVM handled itself are not among them).
    pub exits: ExitTally,
    /// Resident memory of the VMM beyond guest RAM and device memory (its text, heap,
    /// stacks, configuration images), in KiB.
    pub rss_beyond_guest_kib: Option<u64>,
    /// MMIO accesses nothing claimed (unbacked BARs read as all-ones), counted, not fatal.
    pub unclaimed_mmio: u64,
    /// Guest configuration writes the passed-through devices' firewalls dropped.
    pub dropped_config_writes: u64,
    /// Functions whose configuration space KVM maps read-only, so only writes exit.
    pub config_images: usize,
}

/// Console wiring for a run.
pub struct ConsoleOptions {
    /// Where the guest's serial output goes.
    pub output: Box<dyn Write + Send>,
    /// Forward this host's standard input to the guest's serial port.
    pub interactive: bool,
}

/// Builds the VM described by `config` and runs it until it stops.
pub fn run(config: &VmConfig, console: ConsoleOptions, started: Instant) -> Result<RunReport, VmmError> {
    let mut phases = SetupPhases::new(started);
    config.validate()?;
    phases.mark("process start and node checks");
    // Every input is checked before KVM is touched.
    let expect = Expectations::new(config.cpus, config.memory, &config.node);
    let initrd = config.initrd.as_deref().map(|path| initrd::Initrd::open(path, &expect)).transpose()?;
    phases.mark("initramfs open");
    // Host signals are read from a signalfd; block them before any thread starts.
    let signals = StopSignals::new().map_err(host("block SIGINT, SIGTERM and SIGHUP into a signalfd"))?;
    // Emulators need only the node: their start-up (processes reading it) overlaps the
    // VM's creation instead of following it.
    let emulators = wiring::Prestarted::start(&config.node)?;
    phases.mark("emulators started");
    let ram = memory::create(config.memory)?;
    // Bound before anything writes guest memory: placement happens at first touch.
    let numa_err = |source| VmmError::HostNuma { node: config.node.source.clone(), source };
    let placement = HostPlacement::read(Path::new(host_numa::SYSFS_NODES), &config.node.numa).map_err(numa_err)?;
    placement.bind_memory(&ram.memory, &config.node.numa).map_err(numa_err)?;
    phases.mark("guest memory");

    let cpus = cpu_topology::layout(config.cpus, &config.node.numa);
    let initrd = initrd.as_ref().map(|i| i as &dyn initrd::InitrdSource);
    let (kvm_sys, vm, irq, supported_cpuid, mmio, devices, loaded) = std::thread::scope(|s| {
        let (kvm_sys, vm) = create_vm()?;
        let irq = interrupt_routing(&vm)?;
        phases.mark("VM creation");
        register_memory(&vm, &ram.memory)?;
        phases.mark("guest memory registered");

        let mut supported_cpuid =
            kvm_sys.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).map_err(kvm("read the supported CPUID"))?;
        vcpu::announce_emulated_features(&mut supported_cpuid, kvm_sys.check_extension(Cap::TscDeadlineTimer));
        check_address_bits(&supported_cpuid, &config.node)?;
        let mmio = Arc::new(Bus::new("mmio"));
        // Dropped when `run` returns, whatever the path: BARs leave the guest, devices reset.
        let devices = wire_devices(config, emulators, &vm, &mmio, &irq, &ram, &mut phases)?;
        // The kernel's and the initramfs's copies need only guest memory, and take longest
        // of the setup: they run while the firmware tables are written (disjoint guest
        // memory). Not earlier: their page faults hold the address space's lock for reading
        // (nested, 2 MiB is cleared under it), and creating the VM and wiring the devices
        // take it for writing (mappings, heap growth) each time; measured nested on
        // vela-a100, wiring took 114 ms beside the copies and 5-10 ms before them.
        let copies = boot::start_copies(s, &ram.memory, config, initrd);
        let loaded = load_guest(&ram.memory, config, &cpus, copies, &mut phases)?;
        Ok::<_, VmmError>((kvm_sys, vm, irq, supported_cpuid, mmio, devices, loaded))
    })?;

    let signal = Arc::new(GuestExitSignal::new().map_err(host("create an eventfd"))?);
    let serial_irq = EventFd::new(libc::EFD_NONBLOCK).map_err(host("create an eventfd"))?;
    irq.legacy_irqfd(&serial_irq, COM1_IRQ)?;
    let drained = EventFd::new(libc::EFD_NONBLOCK).map_err(host("create an eventfd"))?;
    let serial = Arc::new(Mutex::new(Serial::new(
        serial_irq,
        drained.try_clone().map_err(host("clone an eventfd"))?,
        console.output,
    )));
    let vcpus = create_vcpus(&supported_cpuid, vcpu::mcg_cap(&kvm_sys), &vm, &cpus, loaded.entry)?;
    let ctx = ExitContext {
        pio: Arc::new(port_io_bus(&signal, serial.clone())?),
        mmio,
        signal: signal.clone(),
        stop: Arc::new(AtomicBool::new(false)),
        tell_state: Arc::new(AtomicBool::new(false)),
        exits: Arc::new(Mutex::new(ExitTally::default())),
    };
    phases.mark("vCPUs");
    let pins = cpus.iter().map(|place| placement.cpus(place.socket).map(<[usize]>::to_vec)).collect();
    start_guest_clock(&vm);
    let mut threads = VcpuThreads::start(vcpus, pins, &ctx)?;
    // Each guest NUMA node's RAM (they add up to `config.memory`: `validate` checked), for
    // where its boot allocations go.
    let node_memory: Vec<u64> = config.node.numa.iter().map(|n| n.memory).collect();
    // Started once the vCPUs are: each populating step holds the address space's lock,
    // which creating a vCPU or a thread needs for writing. Joined before guest RAM goes
    // (declared after it, dropped before it).
    let _prefault =
        Prefault::start(&ram.memory, &prefault::boot_regions(&node_memory, &loaded.kernel, loaded.initrd.as_ref()));

    let _raw = if console.interactive { RawTerminal::enter(libc::STDIN_FILENO) } else { None };
    let supervisor = Supervisor {
        exit_evt: signal.eventfd().try_clone().map_err(host("clone an eventfd"))?,
        vcpu_done: threads.done.try_clone().map_err(host("clone an eventfd"))?,
        signals,
        input: console.interactive.then(|| ConsoleInput::new(serial.clone(), drained)),
        stop: None,
    };
    let cause = supervise(supervisor)?;
    tracing::debug!(?cause, "stopping the vCPUs");
    // Stopped from outside (a harness ending a hung guest): say where the guest was.
    if cause == StopCause::Interrupted {
        ctx.tell_state.store(true, Ordering::Release);
    }
    let vcpu_errors = threads.stop_all();
    tracing::debug!("vCPUs stopped");
    if let Some(err) = vcpu_errors.into_iter().next() {
        return Err(err.into());
    }
    let outcome = match (cause, signal.exit()) {
        (StopCause::Interrupted | StopCause::Quit, _) => Outcome::Interrupted,
        (_, Some(GuestExit::Reset)) => Outcome::Reset,
        _ => Outcome::PoweredOff,
    };
    if let Some(t) = threads.first_run.get() {
        phases.end_at("vCPU threads to the first KVM_RUN", *t);
    }
    let exits = lock(&ctx.exits).clone();
    Ok(RunReport {
        outcome,
        status: signal.status(),
        setup: threads.first_run.get().map(|t| t.duration_since(started)),
        phases: phases.phases,
        exits,
        rss_beyond_guest_kib: rss_beyond_guest_kib(),
        unclaimed_mmio: ctx.mmio.unclaimed(),
        dropped_config_writes: devices.dropped_config_writes(),
        config_images: devices.config_images(),
    })
}

/// Opens KVM and creates the VM with its in-kernel irqchip and PIT.
fn create_vm() -> Result<(Kvm, Arc<VmFd>), VmmError> {
    let kvm_sys = Kvm::new().map_err(kvm("open /dev/kvm"))?;
    let vm = kvm_sys.create_vm().map_err(kvm("create a VM"))?;
    vm.set_tss_address(layout::KVM_TSS_ADDRESS as usize).map_err(kvm("set the TSS address"))?;
    vm.set_identity_map_address(layout::KVM_IDENTITY_MAP_ADDRESS).map_err(kvm("set the identity map address"))?;
    vm.create_irq_chip().map_err(kvm("create the in-kernel irqchip"))?;
    let pit = kvm_pit_config { flags: KVM_PIT_SPEAKER_DUMMY, ..Default::default() };
    vm.create_pit2(pit).map_err(kvm("create the in-kernel PIT"))?;
    Ok((kvm_sys, Arc::new(vm)))
}

/// Sets the guest's kvm-clock to 0 as its vCPUs start, as QEMU does when a VM starts
/// running: KVM counts it from the VM's creation, and the guest should not see the
/// VMM's setup as time it was up (Linux logs its kvm-clock reading at start-up, which
/// `bench boot --profile` compares across VMMs). Without it the clock only starts earlier.
fn start_guest_clock(vm: &VmFd) {
    if let Err(e) = vm.set_clock(&kvm_clock_data { clock: 0, ..Default::default() }) {
        tracing::warn!("cannot start the guest's kvm-clock at 0 (KVM_SET_CLOCK): {e}; it counts from VM creation");
    }
}

/// Takes over KVM's GSI routing table: the router sends the legacy routes again, as
/// KVM_CREATE_IRQCHIP left them, and every route device wiring adds (MSI vectors, INTx
/// lines) joins them there. Device wiring takes the router from here.
fn interrupt_routing(vm: &Arc<VmFd>) -> Result<Arc<GsiRouter>, VmmError> {
    let irq = Arc::new(GsiRouter::new(vm.clone())?);
    irq.commit()?;
    Ok(irq)
}

/// Writes the firmware (ACPI and MP tables, reset vector), waits for the kernel's and the initrd's
/// `copies`, and writes the boot structures.
fn load_guest(
    mem: &vm_memory::GuestMemoryMmap,
    config: &VmConfig,
    cpus: &[CpuPlace],
    copies: boot::Copies<'_>,
    phases: &mut SetupPhases,
) -> Result<boot::Loaded, VmmError> {
    let acpi_area = acpi::write(mem, cpus, &config.node)?;
    mptable::write(mem, cpus, cpu_topology::ioapic_id(cpus), acpi_area.end..bios::RESET_VECTOR)?;
    bios::write(mem).map_err(|source| VmmError::GuestMemory { what: "write the reset vector", source })?;
    phases.mark("firmware tables");
    let loaded = boot::finish(copies, mem, config, acpi_area.start, phases)?;
    vcpu::write_boot_tables(mem, loaded.entry.mode)?;
    Ok(loaded)
}

/// Creates and configures one vCPU per place; the KVM vCPU id is the APIC id, and vCPU 0
/// (APIC id 0) is the boot CPU.
fn create_vcpus(
    base_cpuid: &CpuId,
    mcg_cap: Option<u64>,
    vm: &VmFd,
    cpus: &[CpuPlace],
    entry: boot::BootEntry,
) -> Result<Vec<VcpuFd>, VmmError> {
    let mut vcpus = Vec::new();
    for (id, place) in (0u32..).zip(cpus) {
        let fd = vm.create_vcpu(u64::from(place.apic_id)).map_err(kvm("create a vCPU"))?;
        let boot = (id == 0).then_some(entry);
        vcpu::configure(&fd, id, &vcpu::cpuid_for(base_cpuid, place), mcg_cap, boot)?;
        vcpus.push(fd);
    }
    Ok(vcpus)
}

/// Runs the event loop until something asks the VM to stop.
fn supervise(supervisor: Supervisor) -> Result<StopCause, VmmError> {
    let supervisor = Arc::new(Mutex::new(supervisor));
    let mut events = EventManager::<Arc<Mutex<Supervisor>>>::new().map_err(VmmError::EventLoop)?;
    events.add_subscriber(supervisor.clone());
    loop {
        if let Err(e) = events.run() {
            tracing::warn!("event loop: {e:?}");
        }
        if let Some(cause) = lock(&supervisor).stop {
            return Ok(cause);
        }
    }
}

fn register_memory(vm: &VmFd, mem: &vm_memory::GuestMemoryMmap) -> Result<(), VmmError> {
    for (slot, region) in (0u32..).zip(mem.iter()) {
        let host_addr = mem
            .get_host_address(region.start_addr())
            .map_err(|source| VmmError::GuestMemory { what: "find the host mapping of guest RAM", source })?;
        let region = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host_addr as u64,
            flags: 0,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which outlives the VM's use
        // of it: vCPU threads are joined before `run` returns and drops the memory.
        unsafe { vm.set_user_memory_region(region) }.map_err(kvm("register guest memory"))?;
    }
    Ok(())
}

/// Fails when the node's PCI windows reach beyond the guest-physical addresses the vCPUs
/// can address (CPUID 0x8000_0008 EAX[7:0]).
fn check_address_bits(cpuid: &CpuId, node: &Node) -> Result<(), VmmError> {
    let bits = cpuid.as_slice().iter().find(|e| e.function == 0x8000_0008).map_or(36, |e| e.eax & 0xff);
    let highest = node.highest_mmio();
    if bits < 64 && highest >> bits != 0 {
        return Err(ConfigError::AddressBits { node: node.name.clone(), highest, bits }.into());
    }
    Ok(())
}

/// The devices behind the node's functions, and the PCI segment that reaches them on the
/// MMIO bus as ECAM, with its configuration images mapped where KVM can. BARs of functions
/// with nothing behind them stay unbacked (they read as all-ones); the others are placed
/// as the guest programs them, starting where firmware would leave them. Marks the wiring,
/// the image mapping and the devices' start in `phases`.
fn wire_devices(
    config: &VmConfig,
    emulators: wiring::Prestarted,
    vm: &Arc<VmFd>,
    mmio: &Arc<Bus>,
    irq: &Arc<GsiRouter>,
    ram: &memory::GuestRam,
    phases: &mut SetupPhases,
) -> Result<Arc<wiring::DeviceWiring>, VmmError> {
    let parts = wiring::MachineParts { memory: vm.clone(), mmio: mmio.clone(), irq: irq.clone() };
    // One handle on the memfd for every DMA target in another process.
    let file = ram.file.try_clone().ok().map(Arc::new);
    let mut regions = Vec::new();
    for region in ram.memory.iter() {
        let host = ram
            .memory
            .get_host_address(region.start_addr())
            .map_err(|source| VmmError::GuestMemory { what: "find the host mapping of guest RAM", source })?;
        let file = file.clone().zip(region.file_offset().map(|fo| fo.start()));
        regions.push(wiring::GuestRamRegion {
            gpa: region.start_addr().0,
            size: region.len(),
            host_addr: host as u64,
            file,
        });
    }
    let backings = wiring::Backings { prestarted: emulators, memory: ram.memory.clone(), wires: config.wires.clone() };
    let open = |node: &gdrvm_model::node::Node, i| wiring::open_backing(&backings, node, i);
    let (devices, functions) = wiring::DeviceWiring::new(&config.node, parts, &regions, &open)?;
    let pci = Arc::new(PciSegment::with_functions(&config.node, functions));
    let sink: Arc<dyn crate::pci::ApplyEffects> = devices.clone();
    pci.set_effects(Arc::downgrade(&sink));
    mmio.insert(Arc::new(Mutex::new(Ecam(pci.clone()))), layout::ECAM_BASE, layout::ECAM_SIZE)?;
    phases.mark("devices");
    if vm.check_extension(Cap::ReadonlyMem) {
        devices.map_config_images(&pci, layout::ECAM_BASE);
    } else {
        tracing::warn!("KVM has no read-only memory slots: every configuration read exits");
    }
    phases.mark("configuration images mapped");
    devices.start(&pci);
    phases.mark("devices started");
    Ok(devices)
}

fn port_io_bus(signal: &Arc<GuestExitSignal>, serial: Arc<Mutex<Serial>>) -> Result<Bus, VmmError> {
    let pio = Bus::new("pio");
    let add = |dev: Arc<Mutex<dyn BusDevice>>, port: u16, len: u64| pio.insert(dev, u64::from(port), len);
    add(serial, COM1_PORT, u64::from(COM1_LEN))?;
    add(Arc::new(Mutex::new(DebugExit::new(signal.clone()))), DEBUG_EXIT_PORT, 1)?;
    add(Arc::new(Mutex::new(I8042::new(signal.clone()))), I8042::PORT, I8042::LEN)?;
    add(Arc::new(Mutex::new(AcpiSleepControl::new(signal.clone()))), ACPI_SLEEP_PORT, u64::from(ACPI_SLEEP_LEN))?;
    // The PC reset register alone: there is no type-1 configuration mechanism around it
    // (see `pci`), so the rest of 0xcf8-0xcff reads as all-ones.
    add(Arc::new(Mutex::new(ResetRegister::new(signal.clone()))), ACPI_RESET_PORT, 1)?;
    Ok(pio)
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The vCPU threads; stopping them is the same on every exit path, including errors
/// between spawning and the event loop (through `Drop`).
struct VcpuThreads {
    handles: Vec<JoinHandle<Result<(), VcpuError>>>,
    stop: Arc<AtomicBool>,
    /// Written by each vCPU thread as it leaves its loop.
    done: Arc<EventFd>,
    /// When the boot CPU first entered KVM_RUN.
    first_run: Arc<OnceLock<Instant>>,
}

impl VcpuThreads {
    /// Starts one thread per vCPU, each running its exit loop with `ctx`.
    /// Starts one thread per vCPU; a vCPU with host CPUs in `pins` runs only on them.
    fn start(vcpus: Vec<VcpuFd>, pins: Vec<Option<Vec<usize>>>, ctx: &ExitContext) -> Result<VcpuThreads, VmmError> {
        register_signal_handler(SIGRTMIN(), kick_handler)
            .map_err(std::io::Error::from)
            .map_err(host("install the vCPU kick handler"))?;
        let mut threads = VcpuThreads {
            handles: Vec::new(),
            stop: ctx.stop.clone(),
            done: Arc::new(EventFd::new(libc::EFD_NONBLOCK).map_err(host("create an eventfd"))?),
            first_run: Arc::new(OnceLock::new()),
        };
        for ((id, fd), pin) in (0u32..).zip(vcpus).zip(pins) {
            let ctx = ctx.clone();
            let (done, first_run) = (threads.done.clone(), threads.first_run.clone());
            let handle = std::thread::Builder::new()
                .name(format!("vcpu{id}"))
                .spawn(move || {
                    if let Some(cpus) = pin {
                        if let Err(source) = host_numa::pin_current_thread(&cpus) {
                            let _ = done.write(1);
                            return Err(VcpuError::Pin { id, cpus, source });
                        }
                    }
                    if id == 0 {
                        let _ = first_run.set(Instant::now());
                    }
                    let result = vcpu::run(fd, id, &ctx);
                    let _ = done.write(1);
                    result
                })
                .map_err(host("start a vCPU thread"))?;
            threads.handles.push(handle);
        }
        Ok(threads)
    }

    /// Asks every vCPU to stop, kicks it out of KVM_RUN until it does, and joins it.
    fn stop_all(&mut self) -> Vec<VcpuError> {
        self.stop.store(true, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.handles.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            for h in self.handles.iter().filter(|h| !h.is_finished()) {
                // A thread that already left KVM_RUN ignores the signal.
                let _ = h.kill(SIGRTMIN());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let mut errors = Vec::new();
        for h in self.handles.drain(..) {
            if !h.is_finished() {
                tracing::error!("a vCPU thread did not stop; leaving it to process exit");
                continue;
            }
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => errors.push(e),
                Err(_) => tracing::error!("a vCPU thread panicked"),
            }
        }
        errors
    }
}

impl Drop for VcpuThreads {
    fn drop(&mut self) {
        for e in self.stop_all() {
            tracing::error!("{e}");
        }
    }
}

/// Why the event loop stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StopCause {
    /// A device reported a guest power-off or reset.
    Guest,
    /// A vCPU thread left its loop (error, triple fault).
    VcpuExited,
    /// SIGINT, SIGTERM or SIGHUP.
    Interrupted,
    /// Ctrl-A x on the console: the user left; nothing to report of the guest.
    Quit,
}

/// Feeds the host's standard input to the guest's serial port, pausing while the receive
/// FIFO is full and resuming when the guest drains it.
struct ConsoleInput {
    serial: Arc<Mutex<Serial>>,
    drained: EventFd,
    pending: Vec<u8>,
    escape: EscapeFilter,
    stdin_open: bool,
}

impl ConsoleInput {
    fn new(serial: Arc<Mutex<Serial>>, drained: EventFd) -> Self {
        ConsoleInput { serial, drained, pending: Vec::new(), escape: EscapeFilter::default(), stdin_open: true }
    }

    fn stdin_events() -> Events {
        Events::with_data_raw(libc::STDIN_FILENO, 0, EventSet::IN)
    }

    /// Pushes pending bytes into the FIFO; true when everything went in.
    fn flush(&mut self) -> bool {
        let took = lock(&self.serial).enqueue(&self.pending);
        self.pending.drain(..took);
        self.pending.is_empty()
    }
}

struct Supervisor {
    exit_evt: EventFd,
    vcpu_done: EventFd,
    signals: StopSignals,
    input: Option<ConsoleInput>,
    stop: Option<StopCause>,
}

impl MutEventSubscriber for Supervisor {
    fn init(&mut self, ops: &mut EventOps) {
        let mut add = |e: Events| {
            if let Err(err) = ops.add(e) {
                tracing::error!("event loop registration failed: {err:?}");
            }
        };
        add(Events::new(&self.exit_evt, EventSet::IN));
        add(Events::new(&self.vcpu_done, EventSet::IN));
        add(Events::new(&self.signals, EventSet::IN));
        if let Some(input) = &self.input {
            add(ConsoleInput::stdin_events());
            add(Events::new(&input.drained, EventSet::IN));
        }
    }

    fn process(&mut self, events: Events, ops: &mut EventOps) {
        let fd = events.fd();
        if fd == self.exit_evt.as_raw_fd() {
            let _ = self.exit_evt.read();
            self.stop.get_or_insert(StopCause::Guest);
        } else if fd == self.vcpu_done.as_raw_fd() {
            let _ = self.vcpu_done.read();
            self.stop.get_or_insert(StopCause::VcpuExited);
        } else if fd == self.signals.as_raw_fd() {
            self.signals.take();
            self.stop.get_or_insert(StopCause::Interrupted);
        } else if let Some(input) = self.input.as_mut() {
            if fd == input.drained.as_raw_fd() {
                let _ = input.drained.read();
                if !input.pending.is_empty() && input.flush() && input.stdin_open {
                    let _ = ops.add(ConsoleInput::stdin_events());
                }
            } else if fd == libc::STDIN_FILENO {
                let mut buf = [0u8; 256];
                // SAFETY: reads into a stack buffer of the stated length.
                let n = unsafe { libc::read(libc::STDIN_FILENO, buf.as_mut_ptr().cast(), buf.len()) };
                if n <= 0 {
                    input.stdin_open = false;
                    let _ = ops.remove(ConsoleInput::stdin_events());
                    return;
                }
                match input.escape.feed(&buf[..n as usize]) {
                    InputAction::Quit => {
                        self.stop.get_or_insert(StopCause::Quit);
                    }
                    InputAction::Forward(bytes) => {
                        input.pending.extend_from_slice(&bytes);
                        if !input.flush() {
                            // FIFO full: stop reading until the guest drains it.
                            let _ = ops.remove(ConsoleInput::stdin_events());
                        }
                    }
                }
            }
        }
    }
}

/// Resident memory of this process beyond guest RAM and device memory, in KiB: every
/// mapping's resident pages (anonymous, file-backed, shared memory) except the memfds of
/// guest RAM and of emulated BARs. The VMM's own text counts however it was loaded: from a
/// disk it is file-backed, from an initramfs (the nested L1) it is shared memory, which
/// `RssAnon + RssFile` would leave out. The all-ones file over absent functions counts
/// by Pss: its 256 KiB back dozens of mappings, each of which would count them again.
fn rss_beyond_guest_kib() -> Option<u64> {
    rss_beyond_guest_kib_in(&std::fs::read_to_string("/proc/self/smaps").ok()?)
}

/// [`rss_beyond_guest_kib`] of a `/proc/<pid>/smaps` text.
fn rss_beyond_guest_kib_in(smaps: &str) -> Option<u64> {
    let mut total = None;
    // The line that counts for the current mapping ("Rss:", "Pss:"), if any.
    let mut counted = None;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let Some(first) = words.next() else { continue };
        if Some(first) == counted {
            let kib = words.next().and_then(|v| v.parse::<u64>().ok())?;
            total = Some(total.unwrap_or(0) + kib);
        } else if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: range, permissions, offset, device, inode, then its name.
            let name = words.nth(4).unwrap_or("");
            let device_memory = name.starts_with("/memfd:gdrvm-")
                && (name.starts_with("/memfd:gdrvm-guest-ram") || name.contains("-bar"));
            let shared_ones = name.strip_prefix("/memfd:") == Some(crate::wiring::ALL_ONES_NAME);
            counted = match (device_memory, shared_ones) {
                (true, _) => None,
                (_, true) => Some("Pss:"),
                _ => Some("Rss:"),
            };
            total.get_or_insert(0);
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the host's KVM, when it has one: the guest's clock, running since the VM was
    /// created, reads 0 again when the vCPUs start, and runs on from there.
    #[test]
    fn test_the_guest_clock_starts_at_zero_with_the_vcpus() {
        let Ok((_, vm)) = create_vm() else {
            println!("SKIP test_the_guest_clock_starts_at_zero_with_the_vcpus: no usable /dev/kvm");
            return;
        };
        std::thread::sleep(Duration::from_millis(200));
        let before = vm.get_clock().unwrap().clock;
        assert!(before >= 200_000_000, "KVM's clock runs from VM creation: {before} ns");
        start_guest_clock(&vm);
        let after = vm.get_clock().unwrap().clock;
        assert!(after < 100_000_000, "restarted at 0: {after} ns");
    }

    #[test]
    fn test_rss_beyond_guest_leaves_out_guest_ram_and_bar_memory_only() {
        let smaps = "\
00400000-00800000 r-xp 00000000 08:01 1234                               /usr/bin/gdrvm
Size:               4096 kB
Rss:                3144 kB
7f0000000000-7f0040000000 rw-s 00000000 00:01 55                         /memfd:gdrvm-guest-ram (deleted)
Rss:               57340 kB
7f1000000000-7f1000200000 rw-s 00000000 00:01 56                         /memfd:gdrvm-gpu0-bar1 (deleted)
Rss:                 512 kB
7f2000000000-7f2000001000 r--s 00000000 00:01 57                         /memfd:gdrvm-gpu0-config (deleted)
Rss:                   4 kB
7f3000000000-7f3000100000 rw-p 00000000 00:00 0 
Rss:                 600 kB
7f4000000000-7f4000008000 r--s 00000000 00:01 58                         /memfd:gdrvm-absent-functions (deleted)
Rss:                  32 kB
Pss:                   8 kB
7f4000008000-7f4000010000 r--s 00000000 00:01 58                         /memfd:gdrvm-absent-functions (deleted)
Rss:                  32 kB
Pss:                   8 kB
";
        assert_eq!(rss_beyond_guest_kib_in(smaps), Some(3144 + 4 + 600 + 8 + 8));
        assert_eq!(rss_beyond_guest_kib_in(""), None);
    }

    /// Linux's probes of the type-1 and type-2 mechanisms (`pci_check_type1`,
    /// `pci_check_type2`) against the machine's ports: both find nothing, so Linux takes
    /// ECAM for all of configuration space; the reset register at 0xcf9 still resets, and
    /// only its byte does.
    #[test]
    fn test_linux_finds_no_type_1_or_2_and_0xcf9_still_resets() {
        let signal = Arc::new(GuestExitSignal::new().unwrap());
        let out = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let serial = Arc::new(Mutex::new(Serial::new(out.try_clone().unwrap(), out, Box::new(std::io::sink()))));
        let pio = port_io_bus(&signal, serial).unwrap();
        let inl = |port: u64| {
            let mut b = [0u8; 4];
            pio.read(port, &mut b);
            u32::from_le_bytes(b)
        };
        let inb = |port: u64| {
            let mut b = [0u8; 1];
            pio.read(port, &mut b);
            b[0]
        };
        // Type 1: outb(0x01, 0xcfb); inl(0xcf8); outl(0x80000000, 0xcf8); inl(0xcf8).
        pio.write(0xcfb, &[0x01]);
        assert_eq!(inl(0xcf8), u32::MAX);
        pio.write(0xcf8, &0x8000_0000u32.to_le_bytes());
        assert_ne!(inl(0xcf8), 0x8000_0000, "type 1 must not read back");
        // An address with every bit set, 0xcf9's reset bits included, resets nothing.
        pio.write(0xcf8, &u32::MAX.to_le_bytes());
        assert_eq!(signal.exit(), None);
        // Type 2: outb(0, 0xcfb); outb(0, 0xcf8); outb(0, 0xcfa); inb(0xcf8), inb(0xcfa).
        for port in [0xcfb, 0xcf8, 0xcfa] {
            pio.write(port, &[0]);
        }
        assert_eq!((inb(0xcf8), inb(0xcfa)), (0xff, 0xff), "type 2 must not read back");
        assert_eq!(signal.exit(), None);
        pio.write(u64::from(ACPI_RESET_PORT), &[gdrvm_devices::ACPI_RESET_VALUE]);
        assert_eq!(signal.exit(), Some(GuestExit::Reset));
    }
}
