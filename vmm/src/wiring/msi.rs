//! MSI for a device behind a PCI function: the capability emulated by the VMM (the same
//! emulation for every device kind), each vector a GSI with an eventfd registered as a KVM
//! irqfd, and the device's vectors connected to those eventfds while the guest has MSI on.

use std::sync::{Arc, Mutex};

use gdrvm_devices::{lock, MsiEvent, PciDevice};

use crate::irq::{GsiRouter, IrqError, MsiVector};

/// The MSI state of one function.
pub struct MsiState {
    vectors: Mutex<Vec<MsiVector>>,
    router: Arc<GsiRouter>,
    device: Arc<Mutex<dyn PciDevice>>,
}

impl MsiState {
    /// MSI for `device`, with one GSI for each of the `vectors` it offers.
    pub fn new(vectors: u8, device: Arc<Mutex<dyn PciDevice>>, router: Arc<GsiRouter>) -> Result<Self, IrqError> {
        let vectors = (0..vectors).map(|_| MsiVector::new(router.clone())).collect::<Result<Vec<_>, _>>()?;
        Ok(MsiState { vectors: Mutex::new(vectors), router, device })
    }

    /// Back to power-on after a Function Level Reset (MSI went off with it, and `apply`
    /// has disconnected the device): every vector masked, what it held forgotten.
    pub fn reset(&self) {
        let mut vectors = lock(&self.vectors);
        for v in vectors.iter_mut() {
            if let Err(e) = v.mask() {
                tracing::warn!("MSI: {e}");
            }
            v.drain();
        }
    }

    /// Carries out what guest writes to the capability asked for.
    pub fn apply(&self, events: &[MsiEvent]) {
        let mut vectors = lock(&self.vectors);
        for event in events {
            let result = match *event {
                MsiEvent::Route { vector, msg } => vectors.get_mut(usize::from(vector)).map(|v| v.update(msg)),
                MsiEvent::Mask(vector) => vectors.get_mut(usize::from(vector)).map(MsiVector::mask),
                MsiEvent::Unmask(vector) => vectors.get_mut(usize::from(vector)).map(MsiVector::unmask),
                MsiEvent::Deliver { vector, .. } => {
                    vectors.get(usize::from(vector)).map(|v| v.eventfd().write(1).map_err(IrqError::EventFd))
                }
                MsiEvent::Enable { vectors: n } => {
                    let fds: Vec<_> = vectors.iter().take(usize::from(n)).map(MsiVector::eventfd).collect();
                    if let Err(e) = lock(&self.device).connect_msi(Some(&fds)) {
                        tracing::warn!("MSI: {e}");
                    }
                    None
                }
                MsiEvent::Disable => {
                    if let Err(e) = lock(&self.device).connect_msi(None) {
                        tracing::warn!("MSI: {e}");
                    }
                    None
                }
            };
            if let Some(Err(e)) = result {
                tracing::warn!("MSI: {e}");
            }
        }
        if let Err(e) = self.router.commit() {
            tracing::warn!("MSI: {e}");
        }
    }
}
