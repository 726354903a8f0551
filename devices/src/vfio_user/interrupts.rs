//! The eventfds a vfio-user client set for the device's interrupts (DEVICE_SET_IRQS): the
//! server loop fills them, the device's threads signal them.

use std::collections::HashMap;
use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

use crate::lock;

/// The most vectors of one IRQ index (MSI-X's limit).
pub const MAX_VECTORS: u32 = 2048;

/// The eventfd of each vector, per IRQ index; shared between the server loop and the
/// device's threads.
#[derive(Debug, Default)]
pub struct Interrupts {
    /// IRQ index -> vector -> eventfd.
    vectors: Mutex<HashMap<u32, Vec<Option<EventFd>>>>,
}

impl Interrupts {
    /// No eventfd set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Signals vector `vector` of IRQ index `index`; false when the client set no eventfd
    /// for it (or signalling failed).
    pub fn trigger(&self, index: u32, vector: u32) -> bool {
        let vectors = lock(&self.vectors);
        let fd = vectors.get(&index).and_then(|v| v.get(vector as usize)).and_then(Option::as_ref);
        fd.is_some_and(|fd| fd.write(1).is_ok())
    }

    /// Whether the client set an eventfd for vector `vector` of IRQ index `index`.
    pub fn is_set(&self, index: u32, vector: u32) -> bool {
        let vectors = lock(&self.vectors);
        vectors.get(&index).and_then(|v| v.get(vector as usize)).is_some_and(Option::is_some)
    }

    /// Sets the eventfds of vectors `start..start + fds.len()` of `index`, keeping the
    /// others. The caller bounds `start + fds.len()` by [`MAX_VECTORS`].
    pub(super) fn set(&self, index: u32, start: u32, fds: Vec<EventFd>) {
        let mut vectors = lock(&self.vectors);
        let list = vectors.entry(index).or_default();
        let end = (start as usize + fds.len()).min(MAX_VECTORS as usize);
        if list.len() < end {
            list.resize_with(end, || None);
        }
        for (slot, fd) in list.iter_mut().skip(start as usize).zip(fds) {
            *slot = Some(fd);
        }
    }

    /// Forgets every eventfd of `index`.
    pub(super) fn clear(&self, index: u32) {
        lock(&self.vectors).remove(&index);
    }

    /// Forgets every eventfd (the device was reset or the client left).
    pub(super) fn clear_all(&self) {
        lock(&self.vectors).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_set_trigger_clear() {
        let irqs = Interrupts::new();
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        assert!(!irqs.trigger(2, 3));
        irqs.set(2, 3, vec![fd.try_clone().unwrap()]);
        assert!(irqs.is_set(2, 3) && !irqs.is_set(2, 2));
        assert!(irqs.trigger(2, 3));
        assert!(!irqs.trigger(2, 2) && !irqs.trigger(1, 3) && !irqs.trigger(2, u32::MAX));
        assert_eq!(fd.read().unwrap(), 1);
        irqs.clear(2);
        assert!(!irqs.trigger(2, 3));
        irqs.set(0, 0, vec![fd.try_clone().unwrap()]);
        irqs.clear_all();
        assert!(!irqs.trigger(0, 0));
    }
}
