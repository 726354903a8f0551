//! The one owner of KVM's GSI routing table, and the interrupt lines built on it.
//!
//! KVM_SET_GSI_ROUTING replaces the whole table, so every route lives in one [`GsiRouter`]:
//! the legacy irqchip routes KVM installs with KVM_CREATE_IRQCHIP (reproduced here, or COM1
//! would lose its interrupt the moment the first MSI route is set) and one MSI route per GSI
//! handed out for a device vector. A device's interrupts are eventfds the device (or VFIO)
//! signals: an [`MsiVector`] is a GSI, an eventfd and an irqfd joining them; an [`IntxLine`]
//! is a level-triggered irqfd on an IOAPIC pin with a resample eventfd.
//!
//! Written by hand: kvm-ioctls wraps the ioctls, but no rust-vmm crate owns a routing table.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use gdrvm_devices::{lock, MsiMessage};
use kvm_bindings::{
    kvm_irq_routing_entry, kvm_irq_routing_irqchip, kvm_irq_routing_msi, KvmIrqRouting, KVM_IRQCHIP_IOAPIC,
    KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI, KVM_MAX_IRQ_ROUTES,
};
use kvm_ioctls::{Cap, VmFd};
use vmm_sys_util::eventfd::EventFd;

/// GSIs 0 to 23 are the IOAPIC's pins (0 to 15 also the PICs'); MSI GSIs start here.
pub const LEGACY_GSIS: u32 = 24;

/// GSIs the two 8259 PICs take (8 pins each).
const PIC_GSIS: u32 = 16;

/// Entries in the legacy table: one IOAPIC route per pin, one PIC route for each of the first 16.
const LEGACY_ENTRIES: usize = (LEGACY_GSIS + PIC_GSIS) as usize;

/// Errors routing interrupts.
#[derive(Debug, thiserror::Error)]
pub enum IrqError {
    /// KVM has no GSI routing (no KVM_CAP_IRQ_ROUTING), or no room beyond the legacy routes.
    #[error("KVM's routing table holds {0} entries, no more than the {LEGACY_ENTRIES} legacy routes")]
    Unsupported(usize),
    /// Every GSI KVM can route is taken.
    #[error("no GSI left: KVM routes at most {0} entries")]
    Exhausted(usize),
    /// The GSI was not handed out by [`GsiRouter::allocate`] (or was already removed).
    #[error("GSI {0} is not allocated")]
    NotAllocated(u32),
    /// The IOAPIC has no such pin.
    #[error("IOAPIC pin {0} does not exist (it has {LEGACY_GSIS})")]
    NoSuchPin(u32),
    /// The table is larger than KVM accepts.
    #[error("{count} routes exceed KVM's limit of {limit}")]
    TooManyRoutes {
        /// Entries in the table.
        count: usize,
        /// KVM's limit.
        limit: usize,
    },
    /// A KVM call failed.
    #[error("KVM: cannot {what}")]
    Kvm {
        /// What was being done.
        what: &'static str,
        /// KVM's error.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// An eventfd could not be created.
    #[error("host: cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
}

/// The KVM calls routing needs; implemented for [`VmFd`], and by a recording fake in tests.
pub trait RoutingSink: Send + Sync {
    /// How many routing entries (and GSIs) KVM accepts; 0 when it has no GSI routing.
    fn max_routes(&self) -> usize;
    /// KVM_SET_GSI_ROUTING: replaces the whole table with `entries`.
    fn set_gsi_routing(&self, entries: &[kvm_irq_routing_entry]) -> Result<(), IrqError>;
    /// KVM_IRQFD: a write to `fd` raises `gsi`.
    fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), IrqError>;
    /// KVM_IRQFD with KVM_IRQFD_FLAG_RESAMPLE: a write to `fd` asserts level-triggered `gsi`;
    /// KVM de-asserts it at the guest's EOI and signals `resample`.
    fn register_irqfd_with_resample(&self, fd: &EventFd, resample: &EventFd, gsi: u32) -> Result<(), IrqError>;
    /// KVM_IRQFD with KVM_IRQFD_FLAG_DEASSIGN: detaches `fd` from `gsi`.
    fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), IrqError>;
}

fn kvm(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> IrqError {
    move |source| IrqError::Kvm { what, source }
}

impl RoutingSink for VmFd {
    fn max_routes(&self) -> usize {
        // KVM_CHECK_EXTENSION(KVM_CAP_IRQ_ROUTING) answers KVM_MAX_IRQ_ROUTES, or 0.
        usize::try_from(self.check_extension_int(Cap::IrqRouting)).unwrap_or(0).min(KVM_MAX_IRQ_ROUTES)
    }

    fn set_gsi_routing(&self, entries: &[kvm_irq_routing_entry]) -> Result<(), IrqError> {
        let table = KvmIrqRouting::from_entries(entries)
            .map_err(|_| IrqError::TooManyRoutes { count: entries.len(), limit: KVM_MAX_IRQ_ROUTES })?;
        VmFd::set_gsi_routing(self, &table).map_err(kvm("set the GSI routing table"))
    }

    fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), IrqError> {
        VmFd::register_irqfd(self, fd, gsi).map_err(kvm("register an irqfd"))
    }

    fn register_irqfd_with_resample(&self, fd: &EventFd, resample: &EventFd, gsi: u32) -> Result<(), IrqError> {
        VmFd::register_irqfd_with_resample(self, fd, resample, gsi).map_err(kvm("register a resampling irqfd"))
    }

    fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), IrqError> {
        VmFd::unregister_irqfd(self, fd, gsi).map_err(kvm("unregister an irqfd"))
    }
}

/// The routes beyond the legacy ones, and which GSIs are taken.
struct Routes {
    /// Allocated GSIs; `None` until [`GsiRouter::set_msi`] gives one a route.
    msi: BTreeMap<u32, Option<MsiMessage>>,
    /// GSIs removed and free to hand out again, lowest first.
    freed: BTreeSet<u32>,
    /// The lowest GSI never handed out.
    next: u32,
    /// One past the highest GSI that keeps the table within KVM's limit.
    end: u32,
}

/// Owns KVM's GSI routing table: the legacy irqchip routes, always present, plus the MSI
/// routes of every allocated GSI. Changes take effect at [`GsiRouter::commit`], which sends
/// the whole table to KVM at once.
pub struct GsiRouter {
    sink: Arc<dyn RoutingSink>,
    routes: Mutex<Routes>,
}

impl GsiRouter {
    /// A router for the VM behind `sink`, which must have an in-kernel irqchip
    /// (KVM_CREATE_IRQCHIP). Nothing is sent to KVM until [`GsiRouter::commit`].
    pub fn new(sink: Arc<dyn RoutingSink>) -> Result<GsiRouter, IrqError> {
        let max = sink.max_routes();
        if max <= LEGACY_ENTRIES {
            return Err(IrqError::Unsupported(max));
        }
        // Both bounds KVM enforces: GSIs below the limit, and at most `max` entries in all.
        let msi_routes = u32::try_from(max - LEGACY_ENTRIES).unwrap_or(u32::MAX);
        let end = LEGACY_GSIS.saturating_add(msi_routes).min(u32::try_from(max).unwrap_or(u32::MAX));
        let routes = Routes { msi: BTreeMap::new(), freed: BTreeSet::new(), next: LEGACY_GSIS, end };
        Ok(GsiRouter { sink, routes: Mutex::new(routes) })
    }

    /// Hands out a GSI for an MSI route, the lowest free one from 24 up. It has no route
    /// until [`GsiRouter::set_msi`].
    pub fn allocate(&self) -> Result<u32, IrqError> {
        let mut routes = lock(&self.routes);
        let gsi = match routes.freed.pop_first() {
            Some(gsi) => gsi,
            None if routes.next < routes.end => {
                routes.next += 1;
                routes.next - 1
            }
            None => return Err(IrqError::Exhausted(self.sink.max_routes())),
        };
        routes.msi.insert(gsi, None);
        Ok(gsi)
    }

    /// Routes allocated `gsi` to the MSI message (`address`, `data`), from the next commit.
    pub fn set_msi(&self, gsi: u32, address: u64, data: u32) -> Result<(), IrqError> {
        let mut routes = lock(&self.routes);
        let route = routes.msi.get_mut(&gsi).ok_or(IrqError::NotAllocated(gsi))?;
        *route = Some(MsiMessage { address, data });
        Ok(())
    }

    /// Drops `gsi`'s route (from the next commit) and frees the GSI. Any irqfd on it must be
    /// unregistered first: the GSI may be handed out again.
    pub fn remove(&self, gsi: u32) -> Result<(), IrqError> {
        let mut routes = lock(&self.routes);
        routes.msi.remove(&gsi).ok_or(IrqError::NotAllocated(gsi))?;
        routes.freed.insert(gsi);
        Ok(())
    }

    /// Sends the whole table to KVM: the legacy routes and every MSI route set.
    pub fn commit(&self) -> Result<(), IrqError> {
        // Held across the ioctl, so that concurrent commits reach KVM in the order their
        // tables were built and the last one holds every change.
        let routes = lock(&self.routes);
        let msi = routes.msi.iter().filter_map(|(gsi, route)| route.map(|r| msi_entry(*gsi, r)));
        let table: Vec<_> = legacy_entries().chain(msi).collect();
        self.sink.set_gsi_routing(&table)
    }

    /// Registers `fd` as an edge-triggered irqfd on legacy `pin` (an ISA interrupt such as
    /// COM1's) for the rest of the VM's life.
    pub fn legacy_irqfd(&self, fd: &EventFd, pin: u32) -> Result<(), IrqError> {
        check_pin(pin)?;
        self.sink.register_irqfd(fd, pin)
    }
}

fn check_pin(pin: u32) -> Result<(), IrqError> {
    if pin >= LEGACY_GSIS {
        return Err(IrqError::NoSuchPin(pin));
    }
    Ok(())
}

/// The table KVM_CREATE_IRQCHIP installs (`kvm_setup_default_irq_routing`, x86): GSIs 0-15
/// to the IOAPIC pin of the same number and to the master (0-7) or slave (8-15) PIC, GSIs
/// 16-23 to the IOAPIC only.
fn legacy_entries() -> impl Iterator<Item = kvm_irq_routing_entry> {
    (0..LEGACY_GSIS).flat_map(|gsi| {
        let ioapic = irqchip_entry(gsi, KVM_IRQCHIP_IOAPIC, gsi);
        let pic = (gsi < PIC_GSIS)
            .then(|| irqchip_entry(gsi, if gsi < 8 { KVM_IRQCHIP_PIC_MASTER } else { KVM_IRQCHIP_PIC_SLAVE }, gsi % 8));
        std::iter::once(ioapic).chain(pic)
    })
}

fn irqchip_entry(gsi: u32, irqchip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_IRQCHIP, ..Default::default() };
    entry.u.irqchip = kvm_irq_routing_irqchip { irqchip, pin };
    entry
}

fn msi_entry(gsi: u32, route: MsiMessage) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry { gsi, type_: KVM_IRQ_ROUTING_MSI, ..Default::default() };
    entry.u.msi = kvm_irq_routing_msi {
        address_lo: route.address as u32,
        address_hi: (route.address >> 32) as u32,
        data: route.data,
        ..Default::default()
    };
    entry
}

/// One MSI or MSI-X vector: a GSI of its own, the eventfd the device signals, and the irqfd
/// joining them. It starts masked and unrouted, as MSI-X vectors do; the irqfd is registered
/// while the vector is routed and unmasked. While masked, signals wait in the eventfd and
/// are delivered by KVM when the irqfd is registered again at unmask.
///
/// Dropping it unregisters the irqfd and frees the GSI; its route leaves KVM's table at the
/// router's next commit (nothing can raise a GSI without an irqfd, so tearing down many
/// vectors costs one commit, not one each).
pub struct MsiVector {
    router: Arc<GsiRouter>,
    gsi: u32,
    event: EventFd,
    routed: bool,
    masked: bool,
    registered: bool,
}

impl MsiVector {
    /// A masked, unrouted vector on a newly allocated GSI.
    pub fn new(router: Arc<GsiRouter>) -> Result<MsiVector, IrqError> {
        let event = EventFd::new(libc::EFD_NONBLOCK).map_err(IrqError::EventFd)?;
        let gsi = router.allocate()?;
        Ok(MsiVector { router, gsi, event, routed: false, masked: true, registered: false })
    }

    /// The GSI this vector raises.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }

    /// The eventfd that raises the interrupt when written (by the device model, or handed
    /// to VFIO).
    pub fn eventfd(&self) -> &EventFd {
        &self.event
    }

    /// Routes the vector to the message the guest programmed and commits the table.
    pub fn update(&mut self, msg: MsiMessage) -> Result<(), IrqError> {
        self.router.set_msi(self.gsi, msg.address, msg.data)?;
        self.router.commit()?;
        self.routed = true;
        self.sync_irqfd()
    }

    /// Forgets the signals pending in the eventfd (a reset of the function that raised them).
    pub fn drain(&self) {
        // The eventfd is non-blocking: an empty one answers EAGAIN, which is the goal.
        let _ = self.event.read();
    }

    /// Stops delivery: signals stay pending in the eventfd.
    pub fn mask(&mut self) -> Result<(), IrqError> {
        self.masked = true;
        self.sync_irqfd()
    }

    /// Resumes delivery, delivering what is pending, once the vector has a route.
    pub fn unmask(&mut self) -> Result<(), IrqError> {
        self.masked = false;
        self.sync_irqfd()
    }

    /// Registers or unregisters the irqfd so that it is registered exactly while the
    /// vector is routed and unmasked.
    fn sync_irqfd(&mut self) -> Result<(), IrqError> {
        let want = self.routed && !self.masked;
        if want && !self.registered {
            self.router.sink.register_irqfd(&self.event, self.gsi)?;
        } else if !want && self.registered {
            self.router.sink.unregister_irqfd(&self.event, self.gsi)?;
        }
        self.registered = want;
        Ok(())
    }
}

impl Drop for MsiVector {
    fn drop(&mut self) {
        if self.registered {
            if let Err(e) = self.router.sink.unregister_irqfd(&self.event, self.gsi) {
                tracing::warn!(gsi = self.gsi, "tearing down an MSI vector: {e}");
            }
        }
        if let Err(e) = self.router.remove(self.gsi) {
            tracing::warn!(gsi = self.gsi, "tearing down an MSI vector: {e}");
        }
    }
}

/// A level-triggered INTx line on an IOAPIC pin, for devices without MSI: writing
/// [`IntxLine::trigger`] asserts the pin; at the guest's EOI KVM de-asserts it and signals
/// [`IntxLine::resample`], where the device re-asserts if it still needs service. Several
/// lines may share a pin. Dropping it unregisters the irqfd.
pub struct IntxLine {
    router: Arc<GsiRouter>,
    pin: u32,
    trigger: EventFd,
    resample: EventFd,
}

impl IntxLine {
    /// Registers a resampling irqfd on IOAPIC `pin` (0 to 23; PCI INTx uses 16 to 23).
    pub fn new(router: Arc<GsiRouter>, pin: u32) -> Result<IntxLine, IrqError> {
        check_pin(pin)?;
        let trigger = EventFd::new(libc::EFD_NONBLOCK).map_err(IrqError::EventFd)?;
        let resample = EventFd::new(libc::EFD_NONBLOCK).map_err(IrqError::EventFd)?;
        // Legacy GSIs route to the IOAPIC pin of the same number.
        router.sink.register_irqfd_with_resample(&trigger, &resample, pin)?;
        Ok(IntxLine { router, pin, trigger, resample })
    }

    /// The IOAPIC pin.
    pub fn pin(&self) -> u32 {
        self.pin
    }

    /// Written to assert the line.
    pub fn trigger(&self) -> &EventFd {
        &self.trigger
    }

    /// Signalled by KVM when the guest ends the interrupt and the line is de-asserted.
    pub fn resample(&self) -> &EventFd {
        &self.resample
    }
}

impl Drop for IntxLine {
    fn drop(&mut self) {
        if let Err(e) = self.router.sink.unregister_irqfd(&self.trigger, self.pin) {
            tracing::warn!(pin = self.pin, "tearing down an INTx line: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, RawFd};

    use super::*;

    /// A routing entry as plain data, for comparisons.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    enum Route {
        Irqchip { gsi: u32, chip: u32, pin: u32 },
        Msi { gsi: u32, address_lo: u32, address_hi: u32, data: u32 },
    }

    fn decode(e: &kvm_irq_routing_entry) -> Route {
        match e.type_ {
            KVM_IRQ_ROUTING_IRQCHIP => {
                // SAFETY: every member of the union is made of integers, so any bytes are a
                // valid `kvm_irq_routing_irqchip`; `type_` says this member was written.
                let c = unsafe { e.u.irqchip };
                Route::Irqchip { gsi: e.gsi, chip: c.irqchip, pin: c.pin }
            }
            KVM_IRQ_ROUTING_MSI => {
                // SAFETY: as above, for the `msi` member.
                let m = unsafe { e.u.msi };
                Route::Msi { gsi: e.gsi, address_lo: m.address_lo, address_hi: m.address_hi, data: m.data }
            }
            other => panic!("unexpected route type {other}"),
        }
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        SetRouting(Vec<Route>),
        Register { fd: RawFd, gsi: u32 },
        RegisterResample { fd: RawFd, resample: RawFd, gsi: u32 },
        Unregister { fd: RawFd, gsi: u32 },
    }

    /// Records every call; KVM's limit is `max`.
    struct Recorder {
        max: usize,
        calls: Mutex<Vec<Call>>,
    }

    impl Recorder {
        fn new(max: usize) -> Arc<Recorder> {
            Arc::new(Recorder { max, calls: Mutex::new(Vec::new()) })
        }

        fn take(&self) -> Vec<Call> {
            std::mem::take(&mut *lock(&self.calls))
        }

        /// The last table committed.
        fn table(&self) -> Vec<Route> {
            lock(&self.calls)
                .iter()
                .rev()
                .find_map(|c| match c {
                    Call::SetRouting(t) => Some(t.clone()),
                    _ => None,
                })
                .expect("a table was committed")
        }
    }

    impl RoutingSink for Recorder {
        fn max_routes(&self) -> usize {
            self.max
        }
        fn set_gsi_routing(&self, entries: &[kvm_irq_routing_entry]) -> Result<(), IrqError> {
            lock(&self.calls).push(Call::SetRouting(entries.iter().map(decode).collect()));
            Ok(())
        }
        fn register_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), IrqError> {
            lock(&self.calls).push(Call::Register { fd: fd.as_raw_fd(), gsi });
            Ok(())
        }
        fn register_irqfd_with_resample(&self, fd: &EventFd, resample: &EventFd, gsi: u32) -> Result<(), IrqError> {
            lock(&self.calls).push(Call::RegisterResample { fd: fd.as_raw_fd(), resample: resample.as_raw_fd(), gsi });
            Ok(())
        }
        fn unregister_irqfd(&self, fd: &EventFd, gsi: u32) -> Result<(), IrqError> {
            lock(&self.calls).push(Call::Unregister { fd: fd.as_raw_fd(), gsi });
            Ok(())
        }
    }

    fn new_router(max: usize) -> (Arc<Recorder>, Arc<GsiRouter>) {
        let sink = Recorder::new(max);
        let router = Arc::new(GsiRouter::new(sink.clone()).unwrap());
        (sink, router)
    }

    fn legacy() -> Vec<Route> {
        legacy_entries().map(|e| decode(&e)).collect()
    }

    fn msi(gsi: u32, address: u64, data: u32) -> Route {
        Route::Msi { gsi, address_lo: address as u32, address_hi: (address >> 32) as u32, data }
    }

    #[test]
    fn test_legacy_table_is_kvms_default() {
        let (sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        router.commit().unwrap();
        let table = sink.table();
        assert_eq!(table.len(), 40);
        let routes_of = |gsi| table.iter().filter(|r| matches!(r, Route::Irqchip { gsi: g, .. } if *g == gsi)).count();
        // COM1's IRQ 4: the IOAPIC pin and the master PIC pin.
        assert!(table.contains(&Route::Irqchip { gsi: 4, chip: KVM_IRQCHIP_IOAPIC, pin: 4 }));
        assert!(table.contains(&Route::Irqchip { gsi: 4, chip: KVM_IRQCHIP_PIC_MASTER, pin: 4 }));
        assert!(table.contains(&Route::Irqchip { gsi: 0, chip: KVM_IRQCHIP_IOAPIC, pin: 0 }));
        assert!(table.contains(&Route::Irqchip { gsi: 10, chip: KVM_IRQCHIP_PIC_SLAVE, pin: 2 }));
        assert!(table.contains(&Route::Irqchip { gsi: 23, chip: KVM_IRQCHIP_IOAPIC, pin: 23 }));
        assert!((0..16).all(|gsi| routes_of(gsi) == 2));
        assert!((16..24).all(|gsi| routes_of(gsi) == 1));
        assert_eq!(routes_of(24), 0);
    }

    #[test]
    fn test_commit_holds_legacy_and_msi_routes() {
        let (sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        let (a, b, c) = (router.allocate().unwrap(), router.allocate().unwrap(), router.allocate().unwrap());
        assert_eq!((a, b, c), (24, 25, 26));
        router.set_msi(a, 0xfee0_1000, 0x4041).unwrap();
        // A 64-bit address (an interrupt-remapping or x2APIC destination) splits in two.
        router.set_msi(b, 0x1_fee0_2000, 0x22).unwrap();
        // `c` has no route yet: it is not in the table.
        router.commit().unwrap();
        let mut want = legacy();
        want.extend([msi(a, 0xfee0_1000, 0x4041), msi(b, 0x1_fee0_2000, 0x22)]);
        assert_eq!(sink.table(), want);
        assert!(want.contains(&Route::Msi { gsi: b, address_lo: 0xfee0_2000, address_hi: 1, data: 0x22 }));

        // A re-route replaces the entry; a removed GSI leaves the table.
        router.set_msi(a, 0xfee0_3000, 0x51).unwrap();
        router.remove(b).unwrap();
        router.commit().unwrap();
        let mut want = legacy();
        want.push(msi(a, 0xfee0_3000, 0x51));
        assert_eq!(sink.table(), want);

        assert!(matches!(router.set_msi(b, 0xfee0_0000, 0), Err(IrqError::NotAllocated(25))));
        assert!(matches!(router.set_msi(4, 0xfee0_0000, 0), Err(IrqError::NotAllocated(4))));
        assert!(matches!(router.remove(b), Err(IrqError::NotAllocated(25))));
    }

    #[test]
    fn test_allocation_is_bounded_by_kvms_limit_and_reuses_freed_gsis() {
        // Room for 40 legacy entries and 3 MSI routes.
        let (_sink, router) = new_router(43);
        assert_eq!([router.allocate().unwrap(), router.allocate().unwrap(), router.allocate().unwrap()], [24, 25, 26]);
        assert!(matches!(router.allocate(), Err(IrqError::Exhausted(43))));
        router.remove(25).unwrap();
        assert_eq!(router.allocate().unwrap(), 25);
        assert!(matches!(router.allocate(), Err(IrqError::Exhausted(43))));

        // With KVM's real limit, GSIs stop where the table would exceed 4096 entries.
        let (_sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        let last = std::iter::from_fn(|| router.allocate().ok()).last().unwrap();
        assert_eq!(last as usize, LEGACY_GSIS as usize + KVM_MAX_IRQ_ROUTES - LEGACY_ENTRIES - 1);

        assert!(matches!(GsiRouter::new(Recorder::new(0)), Err(IrqError::Unsupported(0))));
        assert!(matches!(GsiRouter::new(Recorder::new(40)), Err(IrqError::Unsupported(40))));
    }

    #[test]
    fn test_msi_vector_registers_its_irqfd_only_while_routed_and_unmasked() {
        let (sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        let mut v = MsiVector::new(router.clone()).unwrap();
        let (fd, gsi) = (v.eventfd().as_raw_fd(), v.gsi());
        assert_eq!(gsi, 24);
        // Unmasked without a route: nothing to deliver to yet.
        v.unmask().unwrap();
        assert_eq!(sink.take(), vec![]);

        v.update(MsiMessage { address: 0xfee0_0000, data: 0x30 }).unwrap();
        let mut table = legacy();
        table.push(msi(gsi, 0xfee0_0000, 0x30));
        assert_eq!(sink.take(), vec![Call::SetRouting(table.clone()), Call::Register { fd, gsi }]);

        v.mask().unwrap();
        v.mask().unwrap();
        assert_eq!(sink.take(), vec![Call::Unregister { fd, gsi }]);
        // Re-routing while masked commits but leaves the irqfd off.
        v.update(MsiMessage { address: 0xfee0_1000, data: 0x31 }).unwrap();
        *table.last_mut().unwrap() = msi(gsi, 0xfee0_1000, 0x31);
        assert_eq!(sink.take(), vec![Call::SetRouting(table)]);
        v.unmask().unwrap();
        // Re-routing while live only replaces the table: KVM moves live irqfds itself.
        v.update(MsiMessage { address: 0xfee0_2000, data: 0x32 }).unwrap();
        let calls = sink.take();
        assert_eq!(calls[0], Call::Register { fd, gsi });
        assert!(matches!(&calls[1..], [Call::SetRouting(_)]));

        drop(v);
        assert_eq!(sink.take(), vec![Call::Unregister { fd, gsi }]);
        // The route leaves at the next commit, and the GSI is free again.
        router.commit().unwrap();
        assert_eq!(sink.table(), legacy());
        assert_eq!(router.allocate().unwrap(), 24);
    }

    #[test]
    fn test_dropping_a_masked_vector_frees_its_gsi_without_unregistering() {
        let (sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        let v = MsiVector::new(router.clone()).unwrap();
        drop(v);
        assert_eq!(sink.take(), vec![]);
        assert_eq!(router.allocate().unwrap(), 24);
    }

    #[test]
    fn test_intx_line_is_a_resampling_irqfd_on_its_pin() {
        let (sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        assert!(matches!(IntxLine::new(router.clone(), 24), Err(IrqError::NoSuchPin(24))));
        let line = IntxLine::new(router.clone(), 16).unwrap();
        let (fd, resample) = (line.trigger().as_raw_fd(), line.resample().as_raw_fd());
        assert_eq!(line.pin(), 16);
        assert_eq!(sink.take(), vec![Call::RegisterResample { fd, resample, gsi: 16 }]);
        drop(line);
        assert_eq!(sink.take(), vec![Call::Unregister { fd, gsi: 16 }]);
    }

    #[test]
    fn test_legacy_irqfd_on_an_isa_pin() {
        let (sink, router) = new_router(KVM_MAX_IRQ_ROUTES);
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        router.legacy_irqfd(&fd, 4).unwrap();
        assert_eq!(sink.take(), vec![Call::Register { fd: fd.as_raw_fd(), gsi: 4 }]);
        assert!(matches!(router.legacy_irqfd(&fd, 24), Err(IrqError::NoSuchPin(24))));
    }

    /// The same calls against the host's KVM, when it has one: KVM accepts the table, the
    /// MSI route and both kinds of irqfd.
    #[test]
    fn test_kvm_accepts_the_table_and_irqfds() {
        let Ok(kvm) = kvm_ioctls::Kvm::new() else {
            eprintln!("no usable /dev/kvm: skipped");
            return;
        };
        let vm = kvm.create_vm().unwrap();
        vm.create_irq_chip().unwrap();
        let router = Arc::new(GsiRouter::new(Arc::new(vm)).unwrap());
        router.commit().unwrap();
        let mut v = MsiVector::new(router.clone()).unwrap();
        v.update(MsiMessage { address: 0xfee0_0000, data: 0x30 }).unwrap();
        v.unmask().unwrap();
        v.mask().unwrap();
        v.unmask().unwrap();
        let line = IntxLine::new(router.clone(), 16).unwrap();
        drop((v, line));
        router.commit().unwrap();
    }
}
