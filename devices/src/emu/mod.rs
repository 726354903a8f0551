//! The emulated GPU and RoCE NIC: vfio-user servers (`gdrvm-gpu-emu`, `gdrvm-nic-emu`)
//! standing behind an endpoint of a node file.
//!
//! An emulated function presents exactly the configuration space the VMM shows for the
//! endpoint ([`ConfigSpace::for_function`]), its register BAR (BAR 0, trapped, registers at
//! [`emulated::REGS`]) and every other BAR as memory (a sparse memfd the client maps). The
//! configuration space is offered for mmap too, as a size-sealed memfd rewritten before each
//! write's reply: the VMM reads it without a round trip (a guest's PCI scan reads each
//! function about a hundred times); writes still go by message, so the device sees them,
//! except that the VMM keeps the Command register's I/O and memory enable bits: it maps and
//! parks the BARs itself, and tells the device the register only when another bit (bus
//! mastering, INTx disable) changes, so the device's copy of those two bits may be stale. The
//! register contract is [`gdrvm_model::emulated`]; the part both devices share (identity,
//! kind, version, scratch, interrupt doorbell and count) is here, the rest in [`gpu`] and
//! [`nic`].
//!
//! Everything a guest or client writes is taken without failing: an odd access is logged
//! once and answered (reads of holes return all-ones, of undefined registers 0) or dropped.
//! A vfio-user client that gets an error back may hang (see the shared ARCHITECTURE.md), so
//! region accesses never return one.
//!
//! [`run`] is the servers' main loop: load the node, check the function, bind the socket,
//! accept one client, serve it until it disconnects, and remove the socket on every way out,
//! SIGTERM and SIGINT included.

pub mod cli;
pub mod fault;
pub mod gpu;
pub mod nic;

use std::collections::HashSet;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use gdrvm_model::emulated;
use gdrvm_model::node::{Function, FunctionKind, Node, NodeError, MSIX_VECTORS};
use tracing::{debug, info, warn};

use crate::lock;
use crate::pci::regs::{PCI_COMMAND, PCI_COMMAND_MASTER};
use crate::vfio_user::{serve, DmaMemory, Interrupts, ServerError, ServerRegion, UserDevice};
use crate::{ConfigSpace, CONFIG_SPACE_SIZE};

pub use gpu::{EmulatedGpu, Gpu};
pub use nic::{EmulatedNic, Nic};

/// VFIO region index of the configuration space.
pub const CONFIG_REGION: u32 = 7;
/// VFIO interrupt index of MSI-X.
pub const MSIX_IRQ: u32 = 2;
/// The BAR holding the registers.
pub const REGISTER_BAR: u8 = 0;

/// Why an emulator cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// The node file or preset is unusable.
    #[error("cannot load the node")]
    Node(#[source] NodeError),
    /// No function of the node has the name asked for.
    #[error("{origin}: no function is named '{name}' (endpoints: {endpoints})")]
    NoSuchFunction {
        /// The node file or preset.
        origin: String,
        /// The name asked for.
        name: String,
        /// The node's endpoints, comma-separated.
        endpoints: String,
    },
    /// The function is a bridge or host bridge, which the VMM emulates itself.
    #[error("{origin}: key {key}: '{name}' is a {what}, not an endpoint an emulator can serve")]
    NotEndpoint {
        /// The node file or preset.
        origin: String,
        /// Where the function comes from in the node file.
        key: String,
        /// The function's name.
        name: String,
        /// What it is instead.
        what: &'static str,
    },
    /// BAR 0 cannot hold the registers.
    #[error("{origin}: key {key}: {reason}")]
    RegisterBar {
        /// The node file or preset.
        origin: String,
        /// Where the function comes from in the node file.
        key: String,
        /// What is wrong with BAR 0.
        reason: String,
    },
    /// The memory behind a BAR could not be created.
    #[error("cannot create the memory behind BAR {bar}")]
    BarMemory {
        /// The BAR index.
        bar: u8,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The memory the client reads the configuration space from could not be created.
    #[error("cannot create the configuration space's shared image")]
    ConfigImage {
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The NIC's DMA engine thread could not be started.
    #[error("cannot start the DMA engine thread")]
    Worker(#[source] io::Error),
    /// Something else is listening on the socket path.
    #[error("{0}: a server is already listening on this socket")]
    SocketInUse(PathBuf),
    /// The socket path is taken by something that is not a socket.
    #[error("{0}: exists and is not a socket")]
    NotASocket(PathBuf),
    /// The socket could not be bound.
    #[error("{path}: cannot listen on this socket")]
    Bind {
        /// The socket path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Accepting the client failed.
    #[error("cannot accept the client")]
    Accept(#[source] io::Error),
    /// SIGTERM/SIGINT handling or the parent-death signal could not be set up.
    #[error("cannot set up signal handling")]
    Signals(#[source] io::Error),
    /// The thread serving an endpoint could not be started.
    #[error("cannot start the thread serving {function}")]
    Thread {
        /// The endpoint's name.
        function: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The vfio-user session failed.
    #[error("the vfio-user session with the client failed")]
    Serve(#[source] ServerError),
}

impl EmuError {
    /// Whether the command line asked for something the node does not have (the
    /// binaries exit with status 2 for these, 1 for the rest).
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            EmuError::Node(_)
                | EmuError::NoSuchFunction { .. }
                | EmuError::NotEndpoint { .. }
                | EmuError::RegisterBar { .. }
        )
    }
}

/// Which device an emulator plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EmuKind {
    /// `gdrvm-gpu-emu`.
    Gpu,
    /// `gdrvm-nic-emu`.
    Nic,
}

/// Where an emulator meets its one client.
#[derive(Debug, Clone)]
pub enum Endpoint {
    /// A vfio-user socket to listen on (removed on exit).
    Socket(PathBuf),
    /// A connected stream socket inherited at this descriptor (the VMM's socket pair).
    Fd(i32),
}

/// One device an emulator process plays: where its client comes from, and its endpoint.
#[derive(Debug, Clone)]
pub struct Served {
    /// Where the client comes from.
    pub endpoint: Endpoint,
    /// The endpoint's name in the node.
    pub function: String,
}

/// What an emulator binary was asked to do.
#[derive(Debug, Clone)]
pub struct EmuOptions {
    /// The devices to play, each on its own connection and thread: one process can serve
    /// several endpoints of a node (how gdrvm starts them, one process per kind).
    pub served: Vec<Served>,
    /// A fault to inject into every device served, for tests of how the VMM and guest cope.
    pub fault: Option<fault::Fault>,
    /// A node file, or a preset's name.
    pub node: String,
    /// Receive SIGTERM when the parent dies.
    pub die_with_parent: bool,
}

/// Logs guest- and client-triggered oddities once per kind and place, never more than a
/// bounded number in all.
#[derive(Default)]
pub struct LogOnce {
    seen: Mutex<HashSet<(&'static str, u64)>>,
}

impl LogOnce {
    const MAX: usize = 1024;

    /// True the first time `what` happens at `at`: the caller logs it then.
    pub fn first(&self, what: &'static str, at: u64) -> bool {
        let mut seen = lock(&self.seen);
        seen.len() < Self::MAX && seen.insert((what, at))
    }
}

/// State both register threads and a device's workers share: interrupts, bus mastering,
/// the interrupt count.
pub struct Common {
    irqs: Arc<Interrupts>,
    msix_vectors: u32,
    irq_count: AtomicU32,
    bus_master: AtomicBool,
    /// Oddities already logged.
    pub odd: LogOnce,
}

impl Common {
    fn new(irqs: Arc<Interrupts>, msix_vectors: u32) -> Self {
        Common {
            irqs,
            msix_vectors,
            irq_count: AtomicU32::new(0),
            bus_master: AtomicBool::new(false),
            odd: LogOnce::default(),
        }
    }

    /// Signals MSI-X `vector` and counts it in [`emulated::REG_IRQ_COUNT`]; a vector the
    /// function does not have is logged once and dropped. Returns whether the client took
    /// the interrupt (it has an eventfd for the vector).
    pub fn signal(&self, vector: u32) -> bool {
        if vector >= self.msix_vectors {
            if self.odd.first("no such MSI-X vector", u64::from(vector)) {
                warn!(vector, vectors = self.msix_vectors, "interrupt on an MSI-X vector the function lacks dropped");
            }
            return false;
        }
        self.irq_count.fetch_add(1, Ordering::Relaxed);
        let taken = self.irqs.trigger(MSIX_IRQ, vector);
        if !taken && self.odd.first("interrupt not taken", u64::from(vector)) {
            debug!(vector, "the client has no eventfd for this MSI-X vector");
        }
        taken
    }

    /// Whether the guest has turned bus mastering on (Command register bit 2).
    pub fn bus_master(&self) -> bool {
        self.bus_master.load(Ordering::Acquire)
    }
}

/// The registers one kind of emulated device adds to the common ones.
pub trait Registers: Send {
    /// [`emulated::REG_KIND`].
    const KIND: u32;
    /// The value of the register at `reg` (from [`emulated::REGS`]); `None` when it is
    /// not one of this device's.
    fn read(&self, reg: u64) -> Option<u32>;
    /// Writes the register at `reg`; false when it is not one of this device's.
    fn write(&mut self, reg: u64, value: u32) -> bool;
    /// Back to power-on.
    fn reset(&mut self);
}

/// One BAR of the function.
struct BarMemory {
    index: u8,
    size: u64,
    /// The memory behind it; `None` for the register BAR.
    file: Option<Arc<File>>,
}

/// An emulated endpoint: configuration space, BARs, the common registers and the
/// device's own (`R`).
pub struct Emulated<R> {
    name: String,
    ident: u32,
    config: ConfigSpace,
    /// `config` as the client reads it: a memfd rewritten after every change, which the
    /// client maps read-only, so a configuration read costs it no round trip.
    config_image: Arc<File>,
    power_on: ConfigSpace,
    bars: Vec<BarMemory>,
    scratch: u32,
    common: Arc<Common>,
    regs: R,
}

impl<R: Registers> Emulated<R> {
    /// Function `i` of `node`, its device registers built by `regs` from the function and
    /// the shared state.
    fn build(
        origin: &str,
        node: &Node,
        i: usize,
        irqs: Arc<Interrupts>,
        regs: impl FnOnce(&Function, &Arc<Common>) -> Result<R, EmuError>,
    ) -> Result<Self, EmuError> {
        let f = &node.functions[i];
        let needed = emulated::REGS + emulated::REGS_LEN;
        match f.bars.iter().find(|b| b.index == REGISTER_BAR) {
            Some(bar) if bar.size >= needed => {}
            found => {
                let reason = match found {
                    Some(bar) => format!("BAR 0 has {:#x} bytes, the registers need {needed:#x}", bar.size),
                    None => "the function has no BAR 0 to hold the registers".to_owned(),
                };
                return Err(EmuError::RegisterBar { origin: origin.to_owned(), key: f.key.clone(), reason });
            }
        }
        let mut bars = Vec::with_capacity(f.bars.len());
        for bar in &f.bars {
            let file = if bar.index == REGISTER_BAR {
                None
            } else {
                let name = format!("gdrvm-{}-bar{}", f.name, bar.index);
                Some(Arc::new(memfd(&name, bar.size).map_err(|source| EmuError::BarMemory { bar: bar.index, source })?))
            };
            bars.push(BarMemory { index: bar.index, size: bar.size, file });
        }
        let vectors = if f.msix_bar().is_some() { u32::from(MSIX_VECTORS) } else { 0 };
        let common = Arc::new(Common::new(irqs, vectors));
        let regs = regs(f, &common)?;
        let config = ConfigSpace::for_function(node, i);
        let image = memfd(&format!("gdrvm-{}-config", f.name), CONFIG_SPACE_SIZE as u64)
            .map_err(|source| EmuError::ConfigImage { source })?;
        let mut device = Emulated {
            name: f.name.clone(),
            ident: (u32::from(f.device) << 16) | u32::from(f.vendor),
            power_on: config.clone(),
            config,
            config_image: Arc::new(image),
            bars,
            scratch: 0,
            common,
            regs,
        };
        device.config_changed();
        Ok(device)
    }

    /// The endpoint's name in the node.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's own registers.
    pub fn registers(&self) -> &R {
        &self.regs
    }

    /// The shared state (interrupt count, bus mastering).
    pub fn common(&self) -> &Arc<Common> {
        &self.common
    }

    /// The VFIO region `index`: BARs 0 to 5, the configuration space; `None` for BARs the
    /// function lacks and the expansion ROM.
    pub fn region_info(&self, index: u32) -> Option<ServerRegion> {
        if index == CONFIG_REGION {
            return Some(ServerRegion {
                size: CONFIG_SPACE_SIZE as u64,
                readable: true,
                writable: true,
                mmap: Some((self.config_image.clone(), 0)),
            });
        }
        let bar = self.bar(index)?;
        Some(ServerRegion {
            size: bar.size,
            readable: true,
            writable: true,
            mmap: bar.file.as_ref().map(|f| (f.clone(), 0)),
        })
    }

    /// Interrupts of VFIO kind `index`: MSI-X vectors when the function has an MSI-X
    /// table, no MSI and no INTx.
    pub fn irqs(&self, index: u32) -> u32 {
        if index == MSIX_IRQ {
            self.common.msix_vectors
        } else {
            0
        }
    }

    /// Reads region `index` at `offset`; never fails.
    pub fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) {
        if index == CONFIG_REGION {
            self.config.read(usize::try_from(offset).unwrap_or(usize::MAX), data);
            return;
        }
        let Some(bar) = self.bar(index) else {
            self.odd(index, offset, "read of a region the function lacks");
            data.fill(0xff);
            return;
        };
        if !fits(offset, data.len(), bar.size) {
            self.odd(index, offset, "read beyond the end of a BAR");
            data.fill(0xff);
            return;
        }
        match &bar.file {
            Some(file) => {
                if let Err(e) = file.read_exact_at(data, offset) {
                    self.odd(index, offset, "BAR memory read failed");
                    debug!(error = %e, "BAR memory read failed");
                    data.fill(0xff);
                }
            }
            None => self.read_registers(offset, data),
        }
    }

    /// Writes region `index` at `offset`; never fails.
    pub fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) {
        if index == CONFIG_REGION {
            self.config.write(usize::try_from(offset).unwrap_or(usize::MAX), data);
            self.config_changed();
            return;
        }
        let Some((size, file)) = self.bar(index).map(|b| (b.size, b.file.clone())) else {
            self.odd(index, offset, "write to a region the function lacks");
            return;
        };
        if !fits(offset, data.len(), size) {
            self.odd(index, offset, "write beyond the end of a BAR");
            return;
        }
        match file {
            Some(file) => {
                if let Err(e) = file.write_all_at(data, offset) {
                    self.odd(index, offset, "BAR memory write failed");
                    debug!(error = %e, "BAR memory write failed");
                }
            }
            None => self.write_registers(offset, data),
        }
    }

    /// Back to power-on: registers, counters, configuration space (BAR memory stays).
    pub fn reset_device(&mut self) {
        info!(function = %self.name, "reset");
        self.regs.reset();
        self.scratch = 0;
        self.common.irq_count.store(0, Ordering::Relaxed);
        self.config = self.power_on.clone();
        self.config_changed();
    }

    fn bar(&self, index: u32) -> Option<&BarMemory> {
        self.bars.iter().find(|b| u32::from(b.index) == index)
    }

    fn odd(&self, index: u32, offset: u64, what: &'static str) {
        if self.common.odd.first(what, (u64::from(index) << 56) ^ offset) {
            warn!(function = %self.name, region = index, offset = format_args!("{offset:#x}"), "{what}: ignored");
        }
    }

    /// After the configuration space changed: mirrors the Command register's bus-master
    /// bit for the DMA engine and rewrites the client's image. The image is written before
    /// the write's reply goes out, so a client that waited for the reply reads the new bytes.
    fn config_changed(&mut self) {
        let mut command = [0; 2];
        self.config.read(PCI_COMMAND, &mut command);
        let on = u16::from_le_bytes(command) & PCI_COMMAND_MASTER != 0;
        self.common.bus_master.store(on, Ordering::Release);
        if let Err(e) = self.config_image.write_all_at(self.config.bytes(), 0) {
            warn!(function = %self.name, error = %e, "the configuration image could not be rewritten");
        }
    }

    /// Reads of BAR 0: registers, 0 elsewhere (the MSI-X table, which the VMM answers
    /// itself, and undefined offsets). Any width and alignment: each 32-bit register the
    /// access touches is read once.
    fn read_registers(&self, offset: u64, data: &mut [u8]) {
        let mut done = 0;
        while done < data.len() {
            let at = offset + done as u64; // `fits` bounded offset + len by the BAR size.
            let word = self.register(at & !3).to_le_bytes();
            let start = (at & 3) as usize;
            let n = (4 - start).min(data.len() - done);
            data[done..done + n].copy_from_slice(&word[start..start + n]);
            done += n;
        }
    }

    /// The 32-bit word at BAR 0 offset `at` (4-byte aligned).
    fn register(&self, at: u64) -> u32 {
        let Some(reg) = at.checked_sub(emulated::REGS).filter(|r| *r < emulated::REGS_LEN) else {
            return 0;
        };
        match reg {
            emulated::REG_IDENT => self.ident,
            emulated::REG_KIND => R::KIND,
            emulated::REG_VERSION => emulated::VERSION,
            emulated::REG_SCRATCH => self.scratch,
            emulated::REG_IRQ_COUNT => self.common.irq_count.load(Ordering::Relaxed),
            _ => self.regs.read(reg).unwrap_or(0),
        }
    }

    /// Writes to BAR 0: one aligned 32-bit register, or two (low half first) for an aligned
    /// 64-bit access; other widths are logged once and dropped.
    fn write_registers(&mut self, offset: u64, data: &[u8]) {
        let aligned = matches!(data.len(), 4 | 8) && offset % data.len() as u64 == 0;
        if !aligned {
            self.odd(0, offset, "register write neither an aligned 32- nor 64-bit access");
            return;
        }
        for (k, word) in data.chunks_exact(4).enumerate() {
            let mut value = [0; 4];
            value.copy_from_slice(word);
            self.write_register(offset + 4 * k as u64, u32::from_le_bytes(value));
        }
    }

    fn write_register(&mut self, at: u64, value: u32) {
        let Some(reg) = at.checked_sub(emulated::REGS).filter(|r| *r < emulated::REGS_LEN) else {
            self.odd(0, at, "write outside the registers");
            return;
        };
        match reg {
            emulated::REG_SCRATCH => self.scratch = value,
            emulated::REG_IRQ_DOORBELL => {
                self.common.signal(value);
            }
            emulated::REG_IDENT | emulated::REG_KIND | emulated::REG_VERSION | emulated::REG_IRQ_COUNT => {
                self.odd(0, at, "write to a read-only register");
            }
            _ => {
                if !self.regs.write(reg, value) {
                    self.odd(0, at, "write to an undefined or read-only register");
                }
            }
        }
    }
}

impl<R: Registers> UserDevice for Emulated<R> {
    fn region(&self, index: u32) -> Option<ServerRegion> {
        self.region_info(index)
    }

    fn irq_count(&self, index: u32) -> u32 {
        self.irqs(index)
    }

    fn read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.region_read(index, offset, data);
        Ok(())
    }

    fn write(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.region_write(index, offset, data);
        Ok(())
    }

    fn reset(&mut self) {
        self.reset_device();
    }
}

/// Whether `len` bytes at `offset` lie within `size`.
fn fits(offset: u64, len: usize, size: u64) -> bool {
    offset.checked_add(len as u64).is_some_and(|end| end <= size)
}

/// A memfd of `size` bytes: sparse, so a 128 GiB BAR costs nothing until touched. Its size
/// is sealed: a client that maps it can never touch a page past its end (SIGBUS).
fn memfd(name: &str, size: u64) -> io::Result<File> {
    let name = CString::new(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `name` is NUL-terminated and outlives the call, which only reads it; the
    // returned descriptor is checked before use.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns; the File closes it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)?;
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: F_ADD_SEALS takes an int and touches no memory of ours; `file` is open.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// Loads the node (a file, or a preset's name) and finds the endpoint `name`: its index
/// and where it came from (for errors).
pub fn find_endpoint(node_arg: &str, name: &str) -> Result<(Node, usize, String), EmuError> {
    let node = Node::resolve(node_arg).map_err(EmuError::Node)?;
    let origin = origin_of(node_arg);
    let i = endpoint_index(&node, &origin, name)?;
    Ok((node, i, origin))
}

/// How errors name where the node came from.
fn origin_of(node_arg: &str) -> String {
    if Path::new(node_arg).exists() {
        format!("node file {node_arg}")
    } else {
        format!("preset {node_arg}")
    }
}

/// The index of endpoint `name` in `node` (read from `origin`).
fn endpoint_index(node: &Node, origin: &str, name: &str) -> Result<usize, EmuError> {
    let origin = origin.to_owned();
    let Some(i) = node.functions.iter().position(|f| f.name == name) else {
        let endpoints: Vec<_> = node
            .functions
            .iter()
            .filter(|f| matches!(f.kind, FunctionKind::Endpoint(_)))
            .map(|f| f.name.as_str())
            .collect();
        return Err(EmuError::NoSuchFunction { origin, name: name.to_owned(), endpoints: endpoints.join(", ") });
    };
    let f = &node.functions[i];
    let what = match f.kind {
        FunctionKind::Endpoint(_) => return Ok(i),
        FunctionKind::HostBridge => "host bridge",
        FunctionKind::RootPort => "root port",
        FunctionKind::SwitchUpstream => "switch upstream port",
        FunctionKind::SwitchDownstream => "switch downstream port",
    };
    Err(EmuError::NotEndpoint { origin, key: f.key.clone(), name: f.name.clone(), what })
}

/// The socket path this process created, removed by whoever leaves first: the main path
/// when it returns, or the signal thread.
#[derive(Clone, Default)]
struct SocketFile(Arc<Mutex<Option<PathBuf>>>);

impl SocketFile {
    fn own(&self, path: &Path) {
        *lock(&self.0) = Some(path.to_owned());
    }

    fn remove(&self) {
        if let Some(path) = lock(&self.0).take() {
            match std::fs::remove_file(&path) {
                Ok(()) => debug!(socket = %path.display(), "socket removed"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => warn!(socket = %path.display(), error = %e, "cannot remove the socket"),
            }
        }
    }
}

/// Binds `path`, replacing a stale socket (one nobody listens on) and refusing anything
/// else already there.
pub fn bind_socket(path: &Path) -> Result<UnixListener, EmuError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(EmuError::Bind { path: path.to_owned(), source }),
        Ok(meta) if !meta.file_type().is_socket() => return Err(EmuError::NotASocket(path.to_owned())),
        Ok(_) => match UnixStream::connect(path) {
            Ok(_) => return Err(EmuError::SocketInUse(path.to_owned())),
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                info!(socket = %path.display(), "replacing a stale socket");
                std::fs::remove_file(path).map_err(|source| EmuError::Bind { path: path.to_owned(), source })?;
            }
            Err(source) => return Err(EmuError::Bind { path: path.to_owned(), source }),
        },
    }
    UnixListener::bind(path).map_err(|source| EmuError::Bind { path: path.to_owned(), source })
}

/// Blocks SIGTERM and SIGINT in this thread and every thread it starts later, and starts a
/// thread that waits for them, removes the socket and exits with 128 + the signal.
fn handle_stop_signals(socket: SocketFile) -> Result<(), EmuError> {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before anything reads it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, exclusively borrowed sigset_t for each call.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
    }
    // SAFETY: `set` is initialised; the old mask is not asked for (null).
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(EmuError::Signals(io::Error::from_raw_os_error(rc)));
    }
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let signal = loop {
                let mut signal = 0;
                // SAFETY: `set` lives in this closure; sigwait writes the signal number
                // into `signal`, which outlives the call.
                if unsafe { libc::sigwait(&set, &mut signal) } == 0 {
                    break signal;
                }
            };
            info!(signal, "stopping on a signal");
            socket.remove();
            std::process::exit(128 + signal);
        })
        .map(drop)
        .map_err(EmuError::Signals)
}

/// Asks the kernel for SIGTERM when the parent dies (the thread that started this process,
/// strictly), and leaves at once if it already has.
fn die_with_parent() -> Result<(), EmuError> {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and touches no memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) } != 0 {
        return Err(EmuError::Signals(io::Error::last_os_error()));
    }
    // SAFETY: as above.
    if unsafe { libc::getppid() } != parent {
        // The parent died before the request took effect: act on it as the signal would,
        // sent to the process (not this thread, which blocks it) so the signal thread
        // takes it.
        // SAFETY: kill touches no memory; the signal is one this process waits for.
        unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    }
    Ok(())
}

/// The connected socket inherited at descriptor `fd`, after checking it is one.
fn inherited_stream(fd: i32) -> Result<UnixStream, EmuError> {
    let bad = |why: &str| EmuError::Accept(io::Error::other(format!("descriptor {fd}: {why}")));
    if fd < 3 {
        return Err(bad("not an inherited socket (0-2 are the standard streams)"));
    }
    // SAFETY: fstat writes only into `st`, a plain struct we own; a bad fd is an error.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(bad("not open"));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(bad("not a socket"));
    }
    // SAFETY: the descriptor is open, a socket, and handed to this process to own (the
    // VMM passed it for exactly this); nothing else in the process uses it.
    let stream = unsafe { UnixStream::from_raw_fd(fd) };
    // Close-on-exec from here on, like every descriptor this process opens itself.
    // SAFETY: F_SETFD on a descriptor we own.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    Ok(stream)
}

/// Runs an emulator: checks the endpoint, listens on the socket, serves one client until
/// it disconnects. The socket is removed on every way out; SIGTERM and SIGINT end the
/// process (status 128 + the signal) after removing it.
pub fn run(kind: EmuKind, options: &EmuOptions) -> Result<(), EmuError> {
    let socket = SocketFile::default();
    handle_stop_signals(socket.clone())?;
    if options.die_with_parent {
        die_with_parent()?;
    }
    let result = serve_all(kind, options, &socket);
    socket.remove();
    result
}

/// Reads the node once, checks every endpoint asked for, then serves each on a thread of
/// its own until every client has left; the first error is the process's.
fn serve_all(kind: EmuKind, options: &EmuOptions, socket: &SocketFile) -> Result<(), EmuError> {
    let node = Node::resolve(&options.node).map_err(EmuError::Node)?;
    let origin = origin_of(&options.node);
    let indices =
        options.served.iter().map(|s| endpoint_index(&node, &origin, &s.function)).collect::<Result<Vec<_>, _>>()?;
    let jobs: Vec<_> = options.served.iter().zip(indices).collect();
    if let [(served, i)] = jobs[..] {
        return serve_one(kind, options, (&node, i, &origin), served, socket);
    }
    std::thread::scope(|s| {
        let threads: Vec<_> = jobs
            .iter()
            .map(|&(served, i)| {
                let (node, origin) = (&node, &origin);
                std::thread::Builder::new()
                    .name(served.function.clone())
                    .spawn_scoped(s, move || serve_one(kind, options, (node, i, origin), served, socket))
                    .map_err(|source| EmuError::Thread { function: served.function.clone(), source })
            })
            .collect();
        let mut first = Ok(());
        for thread in threads {
            let result = thread.and_then(|t| t.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)));
            if first.is_ok() {
                first = result;
            }
        }
        first
    })
}

/// Plays endpoint `i` of `node` (read from `origin`) for the client `served` names.
fn serve_one(
    kind: EmuKind,
    options: &EmuOptions,
    (node, i, origin): (&Node, usize, &str),
    served: &Served,
    socket: &SocketFile,
) -> Result<(), EmuError> {
    let dma = Arc::new(DmaMemory::new());
    let irqs = Arc::new(Interrupts::new());
    let mut device: Box<dyn UserDevice> = match kind {
        EmuKind::Gpu => Box::new(EmulatedGpu::new(origin, node, i, irqs.clone())?),
        EmuKind::Nic => Box::new(EmulatedNic::new(origin, node, i, dma.clone(), irqs.clone())?),
    };
    if let Some(fault) = options.fault {
        device = Box::new(fault::Faulty::new(device, fault));
    }
    let function = &served.function;
    let stream = match &served.endpoint {
        Endpoint::Socket(path) => {
            let listener = bind_socket(path)?;
            socket.own(path);
            info!(socket = %path.display(), function, ?kind, "listening");
            let (stream, _) = listener.accept().map_err(EmuError::Accept)?;
            // One client: later connections are refused.
            drop(listener);
            stream
        }
        Endpoint::Fd(fd) => inherited_stream(*fd)?,
    };
    info!(function, "client connected");
    serve(stream, device.as_mut(), &dma, &irqs).map_err(EmuError::Serve)?;
    info!(function, "client disconnected");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use gdrvm_model::emulated::*;

    use super::*;

    pub(crate) fn preset(name: &str) -> Node {
        Node::preset(name).unwrap().unwrap()
    }

    pub(crate) fn index(node: &Node, name: &str) -> usize {
        node.functions.iter().position(|f| f.name == name).unwrap()
    }

    pub(crate) fn read32<R: Registers>(d: &mut Emulated<R>, reg: u64) -> u32 {
        let mut b = [0; 4];
        d.region_read(0, REGS + reg, &mut b);
        u32::from_le_bytes(b)
    }

    pub(crate) fn write32<R: Registers>(d: &mut Emulated<R>, reg: u64, value: u32) {
        d.region_write(0, REGS + reg, &value.to_le_bytes());
    }

    fn gpu() -> EmulatedGpu {
        gpu_with(Arc::new(Interrupts::new()))
    }

    fn gpu_with(irqs: Arc<Interrupts>) -> EmulatedGpu {
        let node = preset("minimal");
        EmulatedGpu::new("preset minimal", &node, index(&node, "gpu0"), irqs).unwrap()
    }

    #[test]
    fn test_common_registers() {
        let mut d = gpu();
        assert_eq!(read32(&mut d, REG_IDENT), 0x20b2_10de);
        assert_eq!(read32(&mut d, REG_KIND), KIND_GPU);
        assert_eq!(read32(&mut d, REG_VERSION), VERSION);
        assert_eq!(read32(&mut d, REG_SCRATCH), 0);
        write32(&mut d, REG_SCRATCH, 0xdead_beef);
        assert_eq!(read32(&mut d, REG_SCRATCH), 0xdead_beef);
        // Read-only registers keep their value.
        write32(&mut d, REG_IDENT, 0);
        write32(&mut d, REG_KIND, 0);
        assert_eq!(read32(&mut d, REG_IDENT), 0x20b2_10de);
        assert_eq!(read32(&mut d, REG_KIND), KIND_GPU);
        // Narrow and unaligned reads see the same bytes.
        let mut b = [0; 2];
        d.region_read(0, REGS + REG_IDENT + 2, &mut b);
        assert_eq!(u16::from_le_bytes(b), 0x20b2);
        let mut b = [0; 8];
        d.region_read(0, REGS + REG_IDENT + 2, &mut b);
        assert_eq!(b, [0xb2, 0x20, 0x30, 0x55, 0x50, 0x47, 1, 0]);
        // Undefined offsets and the MSI-X table area read 0; writes there are dropped.
        write32(&mut d, 0x800, 5);
        assert_eq!(read32(&mut d, 0x800), 0);
        let mut b = [0xaa; 4];
        d.region_read(0, 0, &mut b);
        assert_eq!(b, [0; 4]);
        d.region_write(0, 0x10, &[1, 2, 3, 4]);
        // Odd widths are dropped, not fatal.
        d.region_write(0, REGS + REG_SCRATCH, &[1, 2]);
        d.region_write(0, REGS + REG_SCRATCH + 1, &[1, 2, 3, 4]);
        assert_eq!(read32(&mut d, REG_SCRATCH), 0xdead_beef);
        // Beyond the BAR: all-ones.
        let mut b = [0; 4];
        d.region_read(0, (16 << 20) - 2, &mut b);
        assert_eq!(b, [0xff; 4]);
        d.region_read(0, u64::MAX, &mut b);
        assert_eq!(b, [0xff; 4]);
    }

    #[test]
    fn test_doorbell_counts_existing_vectors() {
        let mut d = gpu();
        assert_eq!(d.irqs(MSIX_IRQ), u32::from(MSIX_VECTORS));
        assert_eq!(d.irqs(0), 0);
        assert_eq!(d.irqs(1), 0);
        write32(&mut d, REG_IRQ_DOORBELL, 0);
        write32(&mut d, REG_IRQ_DOORBELL, 15);
        assert_eq!(read32(&mut d, REG_IRQ_COUNT), 2);
        // Vectors the function lacks are dropped.
        write32(&mut d, REG_IRQ_DOORBELL, 16);
        write32(&mut d, REG_IRQ_DOORBELL, u32::MAX);
        assert_eq!(read32(&mut d, REG_IRQ_COUNT), 2);
        // The doorbell reads as 0; the count is read-only.
        assert_eq!(read32(&mut d, REG_IRQ_DOORBELL), 0);
        write32(&mut d, REG_IRQ_COUNT, 0);
        assert_eq!(read32(&mut d, REG_IRQ_COUNT), 2);
        d.reset_device();
        assert_eq!(read32(&mut d, REG_IRQ_COUNT), 0);
    }

    #[test]
    fn test_config_space_is_the_vmm_s_and_resets() {
        let node = preset("minimal");
        let i = index(&node, "gpu0");
        let mut d = gpu();
        let want = ConfigSpace::for_function(&node, i);
        let mut got = vec![0; CONFIG_SPACE_SIZE];
        d.region_read(CONFIG_REGION, 0, &mut got);
        assert_eq!(got, want.bytes());
        assert!(!d.common().bus_master());
        // Bus master on; a read-only byte (the vendor ID) stays.
        d.region_write(CONFIG_REGION, PCI_COMMAND as u64, &[0x06, 0]);
        d.region_write(CONFIG_REGION, 0, &[0, 0]);
        assert!(d.common().bus_master());
        let mut b = [0; 2];
        d.region_read(CONFIG_REGION, 0, &mut b);
        assert_eq!(u16::from_le_bytes(b), 0x10de);
        write32(&mut d, REG_SCRATCH, 7);
        d.reset_device();
        d.region_read(CONFIG_REGION, 0, &mut got);
        assert_eq!(got, want.bytes());
        assert!(!d.common().bus_master());
        assert_eq!(read32(&mut d, REG_SCRATCH), 0);
        // Beyond the space: all-ones.
        d.region_read(CONFIG_REGION, u64::MAX - 1, &mut b);
        assert_eq!(b, [0xff; 2]);
    }

    #[test]
    fn test_config_image_follows_writes_and_resets_and_cannot_shrink() {
        let mut d = gpu();
        let (file, offset) = d.region_info(CONFIG_REGION).unwrap().mmap.unwrap();
        assert_eq!((offset, file.metadata().unwrap().len()), (0, CONFIG_SPACE_SIZE as u64));
        let image = |file: &File| {
            let mut b = vec![0; CONFIG_SPACE_SIZE];
            file.read_exact_at(&mut b, 0).unwrap();
            b
        };
        let power_on = image(&file);
        let mut direct = vec![0; CONFIG_SPACE_SIZE];
        d.region_read(CONFIG_REGION, 0, &mut direct);
        assert_eq!(power_on, direct);
        d.region_write(CONFIG_REGION, PCI_COMMAND as u64, &[0x06, 0]);
        assert_eq!(image(&file)[PCI_COMMAND], 0x06);
        d.reset_device();
        assert_eq!(image(&file), power_on);
        // Its size is sealed: a client's mapping can never reach past the end.
        assert!(file.set_len(0).is_err());
        assert!(file.set_len(2 * CONFIG_SPACE_SIZE as u64).is_err());
    }

    #[test]
    fn test_regions() {
        let d = gpu();
        let bar0 = d.region_info(0).unwrap();
        assert_eq!(bar0.size, 16 << 20);
        assert!(bar0.readable && bar0.writable && bar0.mmap.is_none());
        let bar1 = d.region_info(1).unwrap();
        assert_eq!(bar1.size, 128 << 30);
        assert!(bar1.readable && bar1.writable);
        assert_eq!(bar1.mmap.as_ref().unwrap().1, 0);
        // BAR 2 is the high half of BAR 1; the ROM is absent.
        assert!(d.region_info(2).is_none());
        assert!(d.region_info(3).is_some());
        assert!(d.region_info(6).is_none());
        assert_eq!(d.region_info(CONFIG_REGION).unwrap().size, 4096);
        assert!(d.region_info(u32::MAX).is_none());
    }

    #[test]
    fn test_bar_memory_is_sparse_and_shared_with_the_mapping() {
        let mut d = gpu();
        let (file, _) = d.region_info(1).unwrap().mmap.unwrap();
        let meta = file.metadata().unwrap();
        assert_eq!(meta.len(), 128 << 30);
        assert!(meta.blocks() < 64, "a fresh 128 GiB BAR holds {} blocks", meta.blocks());
        let at = (100 << 30) + 3;
        d.region_write(1, at, b"hello");
        let mut b = [0; 5];
        file.read_exact_at(&mut b, at).unwrap();
        assert_eq!(&b, b"hello");
        file.write_all_at(b"world", at).unwrap();
        d.region_read(1, at, &mut b);
        assert_eq!(&b, b"world");
        assert!(file.metadata().unwrap().blocks() < 64);
        // Past the end: all-ones, writes dropped.
        d.region_read(1, (128 << 30) - 2, &mut b);
        assert_eq!(b, [0xff; 5]);
        d.region_write(1, (128 << 30) - 2, b"xxxxx");
        assert_eq!(file.metadata().unwrap().len(), 128 << 30);
        // BAR memory survives a reset.
        d.reset_device();
        d.region_read(1, at, &mut b);
        assert_eq!(&b, b"world");
    }

    #[test]
    fn test_one_process_serves_several_endpoints_until_every_client_leaves() {
        use std::os::fd::IntoRawFd;
        let mut ours = Vec::new();
        let mut served = Vec::new();
        for function in ["gpu0", "gpu1"] {
            let (mine, theirs) = UnixStream::pair().unwrap();
            ours.push(mine);
            served.push(Served { endpoint: Endpoint::Fd(theirs.into_raw_fd()), function: function.into() });
        }
        let options = EmuOptions { served, fault: None, node: "vela-a100".into(), die_with_parent: false };
        let server = std::thread::spawn(move || serve_all(EmuKind::Gpu, &options, &SocketFile::default()));
        let timeout = std::time::Duration::from_secs(10);
        let second = crate::vfio_user::UserConnection::new("gpu1", ours.pop().unwrap(), timeout).unwrap();
        let first = crate::vfio_user::UserConnection::new("gpu0", ours.pop().unwrap(), timeout).unwrap();
        drop(second);
        // gpu0 still answers (device and region info) once gpu1's client has left.
        let ops = crate::vfio_user::UserDeviceOps::new(first).unwrap();
        assert!(!server.is_finished());
        drop(ops);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn test_a_bad_endpoint_among_several_is_a_usage_error_before_any_is_served() {
        let served = ["gpu0", "sw0.up"].map(|function| Served {
            endpoint: Endpoint::Socket(PathBuf::from("/nonexistent/s")),
            function: function.into(),
        });
        let options =
            EmuOptions { served: served.to_vec(), fault: None, node: "minimal".into(), die_with_parent: false };
        let e = serve_all(EmuKind::Gpu, &options, &SocketFile::default()).unwrap_err();
        assert!(e.is_usage(), "{e}");
    }

    #[test]
    fn test_find_endpoint_errors_name_file_key_and_reason() {
        let e = find_endpoint("minimal", "gpu9").unwrap_err();
        assert!(e.is_usage());
        assert_eq!(e.to_string(), "preset minimal: no function is named 'gpu9' (endpoints: gpu0, nic0)");
        let e = find_endpoint("minimal", "sw0.up").unwrap_err();
        assert!(e.is_usage());
        let msg = e.to_string();
        assert!(msg.starts_with("preset minimal: key "), "{msg}");
        assert!(msg.ends_with("'sw0.up' is a switch upstream port, not an endpoint an emulator can serve"), "{msg}");
        let e = find_endpoint("/nonexistent/node.toml", "gpu0").unwrap_err();
        assert!(e.is_usage());
        let (node, i, origin) = find_endpoint("minimal", "nic0").unwrap();
        assert_eq!(node.functions[i].name, "nic0");
        assert_eq!(origin, "preset minimal");
    }

    #[test]
    fn test_register_bar_must_hold_the_registers() {
        let text = include_str!("../../../model/presets/minimal.toml")
            .replace("{ size = \"16M\", bits = 32 }", "{ size = \"4K\", bits = 32 }");
        let node = Node::parse("small.toml", &text).unwrap();
        let e = EmulatedGpu::new("node file small.toml", &node, index(&node, "gpu0"), Arc::new(Interrupts::new()))
            .err()
            .unwrap();
        assert!(e.is_usage());
        assert!(e.to_string().contains("BAR 0 has 0x1000 bytes, the registers need 0x2000"), "{e}");
    }

    #[test]
    fn test_bind_socket_replaces_only_stale_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("emu.sock");
        let live = bind_socket(&path).unwrap();
        assert!(matches!(bind_socket(&path), Err(EmuError::SocketInUse(_))));
        drop(live);
        // The file stays behind, nobody listens: stale, replaced.
        assert!(path.exists());
        let _again = bind_socket(&path).unwrap();
        let file = dir.path().join("plain");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(bind_socket(&file), Err(EmuError::NotASocket(_))));
        assert_eq!(std::fs::read(&file).unwrap(), b"x");
    }

    #[test]
    fn test_served_over_vfio_user() {
        use crate::vfio_user::{UserConnection, UserDeviceOps, DEFAULT_TIMEOUT};
        use crate::VfioDeviceOps;

        let (server_end, client_end) = UnixStream::pair().unwrap();
        let server = std::thread::spawn(move || {
            let (dma, irqs) = (DmaMemory::new(), Arc::new(Interrupts::new()));
            let mut d = gpu_with(irqs.clone());
            serve(server_end, &mut d, &dma, &irqs)
        });
        let ops = UserDeviceOps::new(UserConnection::new("gpu0", client_end, DEFAULT_TIMEOUT).unwrap()).unwrap();
        let mut b = [0; 4];
        ops.read(0, REGS + REG_KIND, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), KIND_GPU);
        ops.write(0, REGS + REG_SCRATCH, &5u32.to_le_bytes()).unwrap();
        ops.read(0, REGS + REG_SCRATCH, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 5);
        ops.read(CONFIG_REGION, 0, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0x20b2_10de);
        let bar1 = ops.region(1).unwrap();
        assert_eq!(bar1.size, 128 << 30);
        ops.reset().unwrap();
        ops.read(0, REGS + REG_SCRATCH, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0);
        drop(ops);
        server.join().unwrap().unwrap();
    }

    #[test]
    fn test_socket_file_removed_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("emu.sock");
        let _listener = bind_socket(&path).unwrap();
        let socket = SocketFile::default();
        socket.remove();
        assert!(path.exists(), "not owned yet: left alone");
        socket.own(&path);
        socket.clone().remove();
        assert!(!path.exists());
        socket.remove();
    }
}
