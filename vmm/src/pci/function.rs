//! One PCI function as the guest reaches it: the VMM's configuration space, and, when a
//! device stands behind the function, that device with the split of the configuration
//! bytes between the two. A configuration write updates the VMM's image of every byte (its
//! write mask keeps what the VMM does not let change), passes the device its own bytes, and
//! returns what the write meant for the machine; the caller applies that after releasing
//! the function's lock. A write that initiates a Function Level Reset is carried out by the
//! VMM instead (see [`PciFunction::write`]).

use std::ops::Range;
use std::sync::{Arc, Mutex};

use gdrvm_devices::pci_regs::{PCI_COMMAND, PCI_COMMAND_IO, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY, PCI_MSI_FLAGS};
use gdrvm_devices::{
    flr_control, initiates_flr, lock, BarInfo, ConfigOwnership, ConfigWriteEffects, MsiCapability, Owner, PciDevice,
};

use super::{ConfigSpace, CONFIG_SPACE_SIZE};

/// The device behind a function. Fields drop in order: the BARs' file handles before the
/// device (VFIO cannot release a group whose files are still open).
pub struct Backend {
    /// Its memory BARs, as the device describes them.
    pub bars: Vec<BarInfo>,
    /// Which configuration bytes the VMM answers and which the device does.
    pub ownership: ConfigOwnership,
    /// Where its MSI-X capability is, if it has one (the VMM watches its control word).
    pub msix_cap: Option<usize>,
    /// Its MSI capability, emulated by the VMM at the device's offset (those bytes are the
    /// VMM's in `ownership`).
    pub msi: Option<(usize, MsiCapability)>,
    /// The device.
    pub device: Arc<Mutex<dyn PciDevice>>,
    /// Whether the device's configuration bytes change only through writes the VMM passes
    /// it and resets the VMM asks for, never by themselves: true for gdrvm's own emulators,
    /// which serve the configuration space the VMM shows and nothing else. Such a function
    /// is imaged like one with nothing behind it.
    pub config_follows_writes: bool,
}

/// A function of the segment.
pub struct PciFunction {
    config: ConfigSpace,
    backend: Option<Backend>,
    /// What a Function Level Reset brings the function back to, when it offers FLR.
    power_on: Option<PowerOn>,
}

/// A function's state at power-on, for Function Level Reset.
struct PowerOn {
    /// Where the function's Device Control register is.
    devctl: usize,
    /// The VMM's configuration bytes.
    config: Box<[u8]>,
    /// The MSI capability the VMM emulates, if it does.
    msi: Option<MsiCapability>,
    /// A reset of the device failed already (logged once; a guest may retry for ever).
    reset_failed: bool,
}

impl PciFunction {
    /// A function answered by the VMM alone (bridges, and endpoints with nothing behind them).
    pub fn hollow(config: ConfigSpace) -> Self {
        PciFunction { config, backend: None, power_on: None }.with_power_on()
    }

    /// A function with `backend` behind it; `config` is the VMM's part.
    pub fn backed(config: ConfigSpace, backend: Backend) -> Self {
        PciFunction { config, backend: Some(backend), power_on: None }.with_power_on()
    }

    /// Keeps the state a Function Level Reset returns to, if the function (as the guest
    /// reads it: a backed one's capabilities are the device's) offers FLR and the device
    /// behind it, if any, can be reset. A device that cannot (a vfio-user server without
    /// DEVICE_RESET) gets the guest's FLR write instead, to carry out itself.
    fn with_power_on(mut self) -> Self {
        if self.backend.as_ref().is_some_and(|b| !lock(&b.device).can_reset()) {
            return self;
        }
        if let Some(devctl) = flr_control(&mut |reg, data| self.read(reg, data)) {
            let msi = self.backend.as_ref().and_then(|b| b.msi.as_ref()).map(|(_, msi)| msi.clone());
            self.power_on = Some(PowerOn { devctl, config: self.config.bytes().into(), msi, reset_failed: false });
        }
        self
    }

    /// Reads `data.len()` bytes at `reg`: each byte from its owner.
    pub fn read(&self, reg: usize, data: &mut [u8]) {
        let Some(backend) = &self.backend else { return self.config.read(reg, data) };
        if reg.saturating_add(data.len()) > CONFIG_SPACE_SIZE {
            return data.fill(0xff);
        }
        for (owner, run) in backend.ownership.split(reg, data.len()) {
            let at = reg + run.start;
            match (owner, &backend.msi) {
                (Owner::Vmm, Some((cap, msi))) if (*cap..cap + msi.len()).contains(&at) => {
                    msi.read(at - cap, &mut data[run]);
                }
                (Owner::Vmm, _) => self.config.read(at, &mut data[run]),
                (Owner::Device, _) => lock(&backend.device).config_read(at, &mut data[run]),
            }
        }
    }

    /// Writes `data` at `reg` and returns what the write changed for the machine.
    pub fn write(&mut self, reg: usize, data: &[u8]) -> ConfigWriteEffects {
        if self.power_on.as_ref().is_some_and(|p| initiates_flr(p.devctl, reg, data)) {
            return self.function_level_reset();
        }
        let Some(backend) = &mut self.backend else {
            self.config.write(reg, data);
            return ConfigWriteEffects::default();
        };
        if reg.saturating_add(data.len()) > CONFIG_SPACE_SIZE {
            return ConfigWriteEffects::default();
        }
        let before = self.config.bytes().to_vec();
        self.config.write(reg, data);
        let mut msi_events = Vec::new();
        for (owner, run) in backend.ownership.split(reg, data.len()) {
            let at = reg + run.start;
            match (owner, &mut backend.msi) {
                (Owner::Device, _) => lock(&backend.device).config_write(at, &data[run]),
                (Owner::Vmm, Some((cap, msi))) if (*cap..*cap + msi.len()).contains(&at) => {
                    msi_events.extend(msi.write(at - *cap, &data[run]));
                }
                (Owner::Vmm, _) => {}
            }
        }
        // A Command register the VMM owns (gdrvm's emulators', whose BARs the VMM maps and
        // parks itself with decode, and which act on bus mastering and INTx disable alone)
        // is told the device only when a bit other than I/O and memory enable changes:
        // Linux turns decode off and on around sizing each BAR, and each toggle told would
        // be a request to another process.
        if backend.ownership.owner(PCI_COMMAND) == Owner::Vmm {
            let command = |bytes: &[u8]| u16::from_le_bytes([bytes[PCI_COMMAND], bytes[PCI_COMMAND + 1]]);
            let now = command(self.config.bytes());
            if (command(&before) ^ now) & !(PCI_COMMAND_IO | PCI_COMMAND_MEMORY) != 0 {
                lock(&backend.device).config_write(PCI_COMMAND, &now.to_le_bytes());
            }
        }
        let mut effects = ConfigWriteEffects::between(&before, self.config.bytes(), &backend.bars, backend.msix_cap);
        effects.msi = msi_events;
        effects
    }

    /// Carries out a Function Level Reset the guest initiated (the rest of its write is
    /// dropped: everything it wrote is reset): the VMM's registers and MSI capability back
    /// to power-on, the device reset through its backend (a vfio-user reset, a VFIO one),
    /// as QEMU's PCIe core resets a device model on FLR. Returns `reset`, and for a backed
    /// function what else changed: decode, bus mastering and MSI or MSI-X off where they
    /// were on. The device's reset runs under the function's lock: for a passed-through
    /// device that is VFIO's reset, 100 ms or more, during which the function's other
    /// accesses wait, as they would on hardware.
    fn function_level_reset(&mut self) -> ConfigWriteEffects {
        let PciFunction { config, backend, power_on } = self;
        let Some(power_on) = power_on else { return ConfigWriteEffects::default() };
        tracing::debug!("function level reset");
        let before = config.bytes().to_vec();
        config.restore(&power_on.config);
        let Some(backend) = backend else {
            return ConfigWriteEffects { reset: true, ..ConfigWriteEffects::default() };
        };
        let mut msi_events = Vec::new();
        if let (Some((_, msi)), Some(fresh)) = (&mut backend.msi, &power_on.msi) {
            msi_events = msi.write(PCI_MSI_FLAGS, &[0, 0]);
            *msi = fresh.clone();
        }
        let mut device = lock(&backend.device);
        // A Command register the device owns (a passed-through device's) loses decode and
        // bus mastering first: VFIO's reset restores the configuration the device had, and
        // the guest must find them off after the reset, as QEMU's vfio_pci_pre_reset does.
        if backend.ownership.owner(PCI_COMMAND) == Owner::Device {
            let mut command = [0u8; 2];
            device.config_read(PCI_COMMAND, &mut command);
            let off = u16::from_le_bytes(command) & !(PCI_COMMAND_IO | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER);
            device.config_write(PCI_COMMAND, &off.to_le_bytes());
        }
        match device.reset() {
            Ok(()) => {}
            Err(e) if !power_on.reset_failed => {
                power_on.reset_failed = true;
                tracing::warn!("function level reset: the device did not reset: {e} (logged once)");
            }
            Err(e) => tracing::debug!("function level reset: the device did not reset: {e}"),
        }
        drop(device);
        let mut effects = ConfigWriteEffects::between(&before, config.bytes(), &backend.bars, backend.msix_cap);
        effects.msi = msi_events;
        effects.reset = true;
        effects
    }

    /// Whether reads can come from an image that writes keep up to date: nothing behind
    /// the function, or a device whose configuration follows writes.
    pub fn imageable(&self) -> bool {
        self.backend.as_ref().is_none_or(|b| b.config_follows_writes)
    }

    /// Whether a write of `len` bytes at `reg` passes any of them to the device.
    pub fn write_reaches_device(&self, reg: usize, len: usize) -> bool {
        self.backend.as_ref().is_some_and(|b| b.ownership.split(reg, len).any(|(owner, _)| owner == Owner::Device))
    }

    /// Bytes `range` of the configuration space as the guest reads it now. The device's
    /// bytes come from one read of the range (a vfio-user request, not one per run of its
    /// bytes), or from `last`, those bytes as an earlier snapshot had them, when the caller
    /// knows they have not changed since.
    pub fn snapshot(&self, range: Range<usize>, last: Option<&[u8]>) -> Vec<u8> {
        let range = range.start.min(CONFIG_SPACE_SIZE)..range.end.min(CONFIG_SPACE_SIZE);
        let mut bytes = vec![0; range.len()];
        let Some(backend) = &self.backend else {
            self.config.read(range.start, &mut bytes);
            return bytes;
        };
        match last {
            Some(last) if last.len() == range.len() => bytes.copy_from_slice(last),
            _ => lock(&backend.device).config_read(range.start, &mut bytes),
        }
        for (owner, run) in backend.ownership.split(range.start, range.len()) {
            if owner == Owner::Vmm {
                self.read(range.start + run.start, &mut bytes[run]);
            }
        }
        bytes
    }

    /// The device behind the function, if any.
    pub fn backend(&self) -> Option<&Backend> {
        self.backend.as_ref()
    }

    /// The VMM's image of the configuration space.
    pub fn config(&self) -> &ConfigSpace {
        &self.config
    }
}
