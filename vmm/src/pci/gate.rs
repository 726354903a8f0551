//! Devices attach beside the guest's boot: the guest starts while emulators start and
//! VFIO devices open, and its first configuration access to a function whose device is not
//! there yet waits here until it is. The guest never sees a function without its device.
//! Linux touches endpoints only when it scans the PCI buses, a second or more into its boot,
//! so the wait is usually none.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};

/// Closed while devices attach; opened once, when they are all in place or attaching has
/// been given up (then the functions stay hollow and the VM is being stopped).
pub struct AttachGate {
    open: AtomicBool,
    state: Mutex<bool>,
    opened: Condvar,
}

impl AttachGate {
    /// A gate that is already open: nothing attaches later.
    pub fn opened() -> Self {
        AttachGate { open: AtomicBool::new(true), state: Mutex::new(true), opened: Condvar::new() }
    }

    /// A closed gate.
    pub fn closed() -> Self {
        AttachGate { open: AtomicBool::new(false), state: Mutex::new(false), opened: Condvar::new() }
    }

    /// Returns once the gate is open; at once after that.
    pub fn wait(&self) {
        if self.open.load(Ordering::Acquire) {
            return;
        }
        let mut open = gdrvm_devices::lock(&self.state);
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// Opens the gate and wakes everything waiting at it.
    pub fn open(&self) {
        *gdrvm_devices::lock(&self.state) = true;
        self.open.store(true, Ordering::Release);
        self.opened.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn test_waiters_pass_only_once_the_gate_opens() {
        let gate = Arc::new(AttachGate::closed());
        let passed = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (gate, passed) = (gate.clone(), passed.clone());
            std::thread::spawn(move || {
                gate.wait();
                passed.store(true, Ordering::Release);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!passed.load(Ordering::Acquire), "a waiter passed a closed gate");
        gate.open();
        waiter.join().unwrap();
        assert!(passed.load(Ordering::Acquire));
        gate.wait();
        AttachGate::opened().wait();
    }
}
