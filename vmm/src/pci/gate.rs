//! Devices attach beside the guest's boot: the guest starts while emulators start and
//! VFIO devices open, and its first configuration access to a function whose device is not
//! there yet waits here until it is. The guest never sees a function without its device.
//! Linux's full PCI scan comes a second or more into its boot; its early quirk scan (in
//! `setup_arch`, following every bridge) reads only identity registers, which an emulated
//! function answers from the node before its device is there (see `PciSegment`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Closed while devices attach; opened once, when they are all in place or attaching has
/// been given up (then the functions stay hollow and the VM is being stopped).
pub struct AttachGate {
    open: AtomicBool,
    state: Mutex<bool>,
    opened: Condvar,
    /// Accesses that waited, and for how long in all (µs).
    waits: AtomicU64,
    waited_us: AtomicU64,
}

impl AttachGate {
    /// A gate that is already open: nothing attaches later.
    pub fn opened() -> Self {
        AttachGate::new(true)
    }

    /// A closed gate.
    pub fn closed() -> Self {
        AttachGate::new(false)
    }

    fn new(open: bool) -> Self {
        AttachGate {
            open: AtomicBool::new(open),
            state: Mutex::new(open),
            opened: Condvar::new(),
            waits: AtomicU64::new(0),
            waited_us: AtomicU64::new(0),
        }
    }

    /// Returns once the gate is open; at once after that.
    pub fn wait(&self) {
        if self.open.load(Ordering::Acquire) {
            return;
        }
        let since = Instant::now();
        let mut open = gdrvm_devices::lock(&self.state);
        while !*open {
            open = self.opened.wait(open).unwrap_or_else(std::sync::PoisonError::into_inner);
        }
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.waited_us.fetch_add(since.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    /// How many accesses waited, and how long they waited in all.
    pub fn waited(&self) -> (u64, Duration) {
        (self.waits.load(Ordering::Relaxed), Duration::from_micros(self.waited_us.load(Ordering::Relaxed)))
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
        assert_eq!(gate.waited().0, 1, "one access waited");
        AttachGate::opened().wait();
    }
}
