//! The node's devices attach on a thread of their own while the guest boots. Starting ten
//! emulators and opening their connections takes about a second nested, and the guest
//! reaches its PCI scan a second or more into its boot. The functions with a device wait
//! at the segment's gate ([`crate::pci::AttachGate`]), so the guest sees each one only with
//! its device in place, reset and with its BARs where firmware would leave them.
//!
//! A failure stops the VM: the supervisor is told through [`Attaching::done`], and
//! [`Attaching::finish`] returns the error, which names the function.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use gdrvm_devices::lock;
use gdrvm_devices::net::WireSpec;
use gdrvm_model::node::{Backing, Node};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{open_backing, Backings, DeviceWiring, GuestRamRegion, MachineParts, Prestarted, WiringError};
use crate::pci::{ApplyEffects, Hold, PciSegment};

/// What the attaching thread needs: the node, the machine's buses and router, guest RAM
/// and the wires its virtio-net NICs join.
pub struct AttachInputs {
    /// The node.
    pub node: Node,
    /// The machine's memory sink, MMIO bus and GSI router.
    pub parts: MachineParts,
    /// Guest RAM, for the DMA space.
    pub ram: Vec<GuestRamRegion>,
    /// Guest RAM, for the devices in the VMM.
    pub memory: GuestMemoryMmap,
    /// Wires by endpoint name.
    pub wires: BTreeMap<String, WireSpec>,
}

/// Devices attaching beside the guest's boot.
pub struct Attaching {
    thread: Option<JoinHandle<Result<(), WiringError>>>,
    /// Dropped to let the thread stop the devices and end. It outlives its work because
    /// the emulators it started die with it (`PR_SET_PDEATHSIG` follows the thread that
    /// forked them), and it drops the wiring, so they stop as they should.
    release: Option<mpsc::Sender<()>>,
    /// Disconnects once attaching is over, whatever its result.
    attached: mpsc::Receiver<()>,
    /// The wiring, once attached. Only the thread holds it outside the lock, so the
    /// wiring is dropped there.
    wiring: Arc<Mutex<Option<Arc<DeviceWiring>>>>,
    pci: Arc<PciSegment>,
    done: EventFd,
    failed: Arc<AtomicBool>,
    ready_at: Arc<OnceLock<Instant>>,
}

/// Which of the guest's accesses to function `i` of `node` wait for its device: none
/// without one; all but the identity registers for gdrvm's emulators, which build their
/// configuration space from the same node; all for the others.
pub fn hold(node: &Node, i: usize) -> Hold {
    match node.functions.get(i).map(|f| &f.backing) {
        None | Some(Backing::None) => Hold::Nothing,
        Some(Backing::EmulatedGpu | Backing::EmulatedNic) => Hold::AllButIdentity,
        Some(_) => Hold::Everything,
    }
}

impl Attaching {
    /// Starts attaching the devices of `inputs.node` into `pci` (built with
    /// [`PciSegment::attaching`] over [`hold`]).
    pub fn start(inputs: AttachInputs, pci: Arc<PciSegment>) -> std::io::Result<Attaching> {
        let done = EventFd::new(libc::EFD_NONBLOCK)?;
        let failed = Arc::new(AtomicBool::new(false));
        let ready_at = Arc::new(OnceLock::new());
        let (release, released) = mpsc::channel::<()>();
        let (over, attached) = mpsc::channel::<()>();
        let wiring = Arc::new(Mutex::new(None));
        let thread = {
            let (pci, done, failed, ready_at) = (pci.clone(), done.try_clone()?, failed.clone(), ready_at.clone());
            let wiring = wiring.clone();
            std::thread::Builder::new().name("gdrvm-attach".into()).spawn(move || {
                // Whatever happens here, a panic included: the gate opens, the supervisor
                // hears of it, and a failure is a failure.
                let mut over = Over { pci: pci.clone(), done, failed, succeeded: false, _over: over };
                let result = attach(inputs, &pci).map(|devices| *lock(&wiring) = Some(devices));
                if result.is_ok() {
                    let _ = ready_at.set(Instant::now());
                    tracing::debug!("devices attached");
                    over.succeeded = true;
                }
                drop(over);
                // Until the VMM is done with the devices (the sender is dropped); then
                // they stop here, on the thread that started their emulators.
                let _ = released.recv();
                drop(lock(&wiring).take());
                result
            })?
        };
        Ok(Attaching { thread: Some(thread), release: Some(release), attached, wiring, pci, done, failed, ready_at })
    }

    /// Readable once attaching has ended, whatever its result.
    pub fn done(&self) -> &EventFd {
        &self.done
    }

    /// Set once attaching has failed (the VM must stop).
    pub fn failed_flag(&self) -> Arc<AtomicBool> {
        self.failed.clone()
    }

    /// When every device was in place, if they are.
    pub fn ready_at(&self) -> Option<Instant> {
        self.ready_at.get().copied()
    }

    /// Lets any vCPU waiting for a device go on (the VM is stopping), waits for attaching
    /// to end, reads what `read` needs of the wiring, then stops the devices; or returns
    /// why attaching failed.
    pub fn finish<T>(mut self, read: impl FnOnce(&DeviceWiring) -> T) -> Result<T, WiringError> {
        self.pci.attached();
        // Returns (disconnected) once attaching is over.
        let _ = self.attached.recv();
        let read = lock(&self.wiring).as_deref().map(read);
        let stopped = self.stop();
        match (read, stopped) {
            (_, Err(e)) => Err(e),
            (Some(value), Ok(())) => Ok(value),
            (None, Ok(())) => Err(WiringError::Backing {
                function: "devices".into(),
                reason: "attaching ended without devices".into(),
            }),
        }
    }

    /// Lets the thread drop the wiring and end, and waits for it.
    fn stop(&mut self) -> Result<(), WiringError> {
        self.release.take();
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => {
                Err(WiringError::Backing { function: "devices".into(), reason: "the attaching thread panicked".into() })
            }
            None => Ok(()),
        }
    }
}

impl Drop for Attaching {
    fn drop(&mut self) {
        self.pci.attached();
        let _ = self.stop();
    }
}

/// The end of attaching, told on drop: the failure flag (unless it succeeded), the
/// `attached` channel disconnected, the gate opened, the supervisor woken.
struct Over {
    pci: Arc<PciSegment>,
    done: EventFd,
    failed: Arc<AtomicBool>,
    succeeded: bool,
    _over: mpsc::Sender<()>,
}

impl Drop for Over {
    fn drop(&mut self) {
        if !self.succeeded {
            self.failed.store(true, Ordering::Release);
        }
        self.pci.attached();
        let _ = self.done.write(1);
    }
}

/// Opens every backing, puts each device in place of its hollow function, sends the
/// segment's configuration effects to the wiring and starts the devices as firmware would.
fn attach(inputs: AttachInputs, pci: &Arc<PciSegment>) -> Result<Arc<DeviceWiring>, WiringError> {
    let AttachInputs { node, parts, ram, memory, wires } = inputs;
    let backings = Backings { prestarted: Prestarted::start(&node)?, memory, wires };
    let open = |node: &Node, i| open_backing(&backings, node, i);
    let (devices, functions) = DeviceWiring::new(&node, parts, &ram, &open)?;
    for (i, function) in functions.into_iter().enumerate() {
        if hold(&node, i) != Hold::Nothing {
            pci.install(i, function);
        }
    }
    let sink: Arc<dyn ApplyEffects> = devices.clone();
    pci.set_effects(Arc::downgrade(&sink));
    devices.start(&node, pci);
    Ok(devices)
}
