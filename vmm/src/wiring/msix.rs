//! MSI-X for a device behind a PCI function: the table and pending bits emulated by the
//! VMM (the same emulation for every device kind), each vector a GSI with an eventfd
//! registered as a KVM irqfd, and the device's own vectors connected to those eventfds
//! while the guest has MSI-X on.

use std::sync::{Arc, Mutex};

use gdrvm_devices::{lock, MsixControl, MsixEvent, MsixLayout, MsixTable, PciDevice};

use crate::irq::{GsiRouter, IrqError, MsiVector};

/// The MSI-X state of one function.
pub struct MsixState {
    /// Where the table and pending bits are.
    pub layout: MsixLayout,
    table: Mutex<MsixTable>,
    vectors: Mutex<Vec<MsiVector>>,
    router: Arc<GsiRouter>,
    device: Arc<Mutex<dyn PciDevice>>,
    connected: Mutex<bool>,
}

impl MsixState {
    /// MSI-X for `device` as `layout` describes it, with one GSI per vector.
    pub fn new(
        layout: MsixLayout,
        device: Arc<Mutex<dyn PciDevice>>,
        router: Arc<GsiRouter>,
    ) -> Result<Self, IrqError> {
        let vectors = (0..layout.vectors).map(|_| MsiVector::new(router.clone())).collect::<Result<Vec<_>, _>>()?;
        Ok(MsixState {
            layout,
            table: Mutex::new(MsixTable::new(layout.vectors)),
            vectors: Mutex::new(vectors),
            router,
            device,
            connected: Mutex::new(false),
        })
    }

    /// Bytes of the table.
    pub fn table_len(&self) -> u64 {
        lock(&self.table).table_len()
    }

    /// Bytes of the pending-bit array.
    pub fn pba_len(&self) -> u64 {
        lock(&self.table).pba_len()
    }

    /// A guest read of the table.
    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        lock(&self.table).read_table(offset, data);
    }

    /// A guest read of the pending bits.
    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        lock(&self.table).read_pba(offset, data);
    }

    /// A guest write to the table.
    pub fn write_table(&self, offset: u64, data: &[u8]) {
        let events = lock(&self.table).write_table(offset, data);
        self.apply(events);
    }

    /// The guest changed MSI-X Enable or Function Mask.
    pub fn control(&self, control: MsixControl) {
        let events = lock(&self.table).set_control(control.enabled, control.masked);
        self.apply(events);
        let mut connected = lock(&self.connected);
        if control.enabled != *connected {
            let vectors = lock(&self.vectors);
            let fds: Vec<_> = vectors.iter().map(MsiVector::eventfd).collect();
            let result = lock(&self.device).connect_msix(control.enabled.then_some(&fds[..]));
            match result {
                Ok(()) => *connected = control.enabled,
                Err(e) => tracing::warn!("MSI-X: {e}"),
            }
        }
    }

    /// Back to power-on after a Function Level Reset: every entry zeroed and masked, no
    /// bit pending, every vector's route held and what it held forgotten. (The guest's
    /// control word went to zero with the reset, and [`MsixState::control`] has
    /// disconnected the device.)
    pub fn reset(&self) {
        let vectors = self.layout.vectors;
        *lock(&self.table) = MsixTable::new(vectors);
        self.apply((0..vectors).map(MsixEvent::Mask).collect());
        lock(&self.vectors).iter().for_each(MsiVector::drain);
    }

    fn apply(&self, events: Vec<MsixEvent>) {
        if events.is_empty() {
            return;
        }
        let mut vectors = lock(&self.vectors);
        for event in events {
            let result = match event {
                MsixEvent::Route { vector, msg } => vectors.get_mut(usize::from(vector)).map(|v| v.update(msg)),
                MsixEvent::Mask(vector) => vectors.get_mut(usize::from(vector)).map(MsiVector::mask),
                MsixEvent::Unmask(vector) => vectors.get_mut(usize::from(vector)).map(MsiVector::unmask),
                MsixEvent::Deliver { vector, .. } => {
                    vectors.get(usize::from(vector)).map(|v| v.eventfd().write(1).map_err(IrqError::EventFd))
                }
            };
            if let Some(Err(e)) = result {
                tracing::warn!("MSI-X: {e}");
            }
        }
        if let Err(e) = self.router.commit() {
            tracing::warn!("MSI-X: {e}");
        }
    }
}
