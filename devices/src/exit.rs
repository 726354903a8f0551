//! How devices tell the VMM that the guest wants the machine to stop.

use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

use crate::lock;

/// Why the guest asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestExit {
    /// The guest powered off (ACPI S5).
    PowerOff,
    /// The guest asked for a reset (ACPI reset register, i8042, triple fault).
    Reset,
}

/// Shared between devices and the VMM's event loop: an eventfd that wakes the loop, the
/// first stop request, and the last status the guest wrote to the debug-exit port.
pub struct GuestExitSignal {
    evt: EventFd,
    state: Mutex<(Option<GuestExit>, Option<u8>)>,
}

impl GuestExitSignal {
    /// A new, unsignalled exit signal.
    pub fn new() -> std::io::Result<Self> {
        Ok(GuestExitSignal { evt: EventFd::new(libc::EFD_NONBLOCK)?, state: Mutex::new((None, None)) })
    }

    /// The eventfd the VMM's event loop watches.
    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }

    /// Records a stop request (the first one wins) and wakes the event loop.
    pub fn request(&self, exit: GuestExit) {
        tracing::debug!(?exit, "guest asked the machine to stop");
        let mut state = lock(&self.state);
        state.0.get_or_insert(exit);
        drop(state);
        if let Err(e) = self.evt.write(1) {
            tracing::error!("cannot wake the event loop: {e}");
        }
    }

    /// Records the guest's exit status (the last one written wins).
    pub fn set_status(&self, status: u8) {
        lock(&self.state).1 = Some(status);
    }

    /// The stop request, if any.
    pub fn exit(&self) -> Option<GuestExit> {
        lock(&self.state).0
    }

    /// The status the guest reported, if any.
    pub fn status(&self) -> Option<u8> {
        lock(&self.state).1
    }
}
