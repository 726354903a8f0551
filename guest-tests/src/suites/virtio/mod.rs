//! `virtio`: the virtio chaos check. Each virtio-net function (1af4:1041) the expectations
//! list is taken from its driver and driven from userspace: its virtio capabilities are found
//! by walking its configuration space (and compared with the fabric contract's BAR 0
//! layout), a minimal driver brings it up with the transmit queue (queue 1) in pinned memory
//! and no interrupts, and the queue is fed malformed descriptors: an address beyond guest
//! RAM, a chain that loops, a buffer of over 1 MiB, an available index moved past the queue
//! size. Virtio 1.x lets a device drop such a buffer (used element, len 0) or set
//! DEVICE_NEEDS_RESET; the contract makes the available-index case NEEDS_RESET. After each
//! case the device must still answer, a broken device must come back from a reset, and a
//! dropped buffer must not stop the queue (a good frame goes through); a good frame ends the
//! cases. Finally the device is reset and given back to its driver, and its network
//! interface must come back (`<nic>_driver_rebinds`).
//!
//! Every wait is bounded, sysfs writes too (a bind runs the driver's probe, which waits for
//! the device without a deadline): a device that hangs gives a failed test with the reason.
//! Never in `all`: the NIC is away from the kernel meanwhile and comes back without the
//! addresses it had; outside a gdrvm guest (no expectations) the suite skips.

mod caps;
mod driver;
#[cfg(test)]
mod fake;
mod queue;

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use gdrvm_model::PciExpectation;

use self::caps::{VirtioCaps, CONTRACT};
use self::driver::{
    common, feature, feature_names, human, judge, poll, Layout, Regs, Session, Setup, Timing, Transport,
    NET_CONFIG_LEN, TX_QUEUE,
};
use self::queue::Case;
use crate::context::Context;
use crate::dma::{PinnedBuffer, PAGE_SIZE};
use crate::ktap::{Check, Verdict};
use crate::packet::{format_mac, parse_mac};
use crate::pcidev::{self, Claim, MappedBar, COMMAND_BUS_MASTER, COMMAND_MEMORY};

/// Vendor and device ID of a modern virtio-net function.
pub const VIRTIO_NET: (u16, u16) = (0x1af4, 0x1041);
/// The kernel's driver of virtio PCI functions.
pub const VIRTIO_PCI: &str = "virtio-pci";
/// Command register: INTx disabled. The driver polls, and the ISR's line must not fire with
/// no handler while the kernel's driver is away.
const COMMAND_INTX_DISABLE: u16 = 1 << 10;
/// What the claim turns on.
const CLAIM_BITS: u16 = COMMAND_MEMORY | COMMAND_BUS_MASTER | COMMAND_INTX_DISABLE;

/// How long the suite waits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The driver's waits.
    pub driver: Timing,
    /// A sysfs write (unbind; bind, which runs the driver's probe) and its effect.
    pub sysfs: Duration,
    /// The network interface to appear after the bind.
    pub netdev: Duration,
}

/// The waits of a real run.
pub const LIMITS: Limits = Limits {
    driver: Timing { reset: Duration::from_secs(1), used: Duration::from_secs(2) },
    sysfs: Duration::from_secs(10),
    netdev: Duration::from_secs(10),
};

/// Runs the suite.
pub fn run(ctx: &Context) -> Vec<Check> {
    run_with(ctx, &LIMITS)
}

fn run_with(ctx: &Context, limits: &Limits) -> Vec<Check> {
    const NAME: &str = "virtio_net";
    let Some(expect) = &ctx.expect else {
        let why = "not in a gdrvm guest (no expectations): the suite feeds a virtio device malformed descriptors";
        return vec![Check::new(NAME, Verdict::Skip(why.into()))];
    };
    let nics: Vec<&PciExpectation> = expect.pci.iter().filter(|p| (p.vendor, p.device) == VIRTIO_NET).collect();
    if nics.is_empty() {
        let why = "no virtio-net function (1af4:1041) in the expectations";
        return vec![Check::new(NAME, Verdict::Skip(why.into()))];
    }
    nics.into_iter().flat_map(|exp| function(ctx, exp, limits)).collect()
}

fn check(name: &str, notes: Vec<String>, problems: &[String]) -> Check {
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    Check { diagnostics: notes, ..Check::new(name, verdict) }
}

fn skip(name: &str, why: String) -> Check {
    Check::new(name, Verdict::Skip(why))
}

/// The network interface of a virtio function (`virtioN/net/NAME`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Netdev {
    name: String,
    mac: Option<[u8; 6]>,
}

impl Netdev {
    fn describe(&self) -> String {
        format!("{} ({})", self.name, self.mac.as_ref().map_or("MAC unreadable".into(), format_mac))
    }
}

fn sorted_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    names.sort();
    names
}

/// The network interface under the function in `dir`, if virtio_net made one.
fn netdev(dir: &Path) -> Option<Netdev> {
    sorted_names(dir).into_iter().filter(|n| n.starts_with("virtio")).find_map(|v| {
        let net = dir.join(v).join("net");
        let name = sorted_names(&net).into_iter().next()?;
        let mac = std::fs::read_to_string(net.join(&name).join("address")).ok().and_then(|m| parse_mac(&m));
        Some(Netdev { name, mac })
    })
}

/// Writes `data` to the sysfs file `path` from a thread, waiting at most `timeout` for the
/// write to return: a driver's remove or probe runs inside it and may wait on a device
/// forever. A write that does not return is left behind.
fn write_bounded(path: &Path, data: &str, timeout: Duration) -> Result<(), String> {
    let (tx, rx) = mpsc::channel();
    let (p, d) = (path.to_owned(), data.to_owned());
    std::thread::Builder::new()
        .name("virtio-sysfs".into())
        .spawn(move || {
            let _ = tx.send(std::fs::write(&p, d));
        })
        .map_err(|e| format!("cannot start a thread to write {}: {e}", path.display()))?;
    match rx.recv_timeout(timeout) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("writing {data} to {}: {e}", path.display())),
        Err(_) => Err(format!("writing {data} to {} did not return within {}", path.display(), human(timeout))),
    }
}

/// Unbinds the function in `dir` from `driver`; a line saying how long it took.
fn unbind(dir: &Path, bdf: &str, driver: &str, timeout: Duration) -> Result<String, String> {
    write_bounded(&dir.join("driver/unbind"), bdf, timeout)?;
    poll(timeout, || pcidev::driver(dir).is_none().then_some(()))
        .map(|((), t)| format!("unbound from {driver} in {}", human(t)))
        .map_err(|t| format!("{bdf} is still bound {} after writing it to {driver}'s unbind", human(t)))
}

/// Binds the function in `dir` to `driver`; a line saying how long it took.
fn bind(ctx: &Context, dir: &Path, bdf: &str, driver: &str, timeout: Duration) -> Result<String, String> {
    let path = ctx.path(&format!("/sys/bus/pci/drivers/{driver}/bind"));
    if !path.exists() {
        return Err(format!("{} does not exist: {driver} is not loaded", path.display()));
    }
    write_bounded(&path, bdf, timeout)?;
    poll(timeout, || (pcidev::driver(dir).as_deref() == Some(driver)).then_some(()))
        .map(|((), t)| format!("bound to {driver} in {}", human(t)))
        .map_err(|t| {
            let now = pcidev::driver(dir).unwrap_or_else(|| "no driver".into());
            format!("{bdf} is bound to {now} {} after writing it to {}", human(t), path.display())
        })
}

/// The virtio capabilities in the function's configuration space.
fn read_caps(dir: &Path) -> Result<VirtioCaps, String> {
    let path = dir.join("config");
    let config = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    caps::virtio_caps(&config).map_err(|e| format!("{}: {e}", path.display()))
}

/// Maps the BAR the structures lie in, checking each fits in it and is long enough.
fn map_bar(dir: &Path, caps: &VirtioCaps) -> Result<(MappedBar, Layout), String> {
    let parts = [(&caps.common, common::LEN), (&caps.notify, 2), (&caps.isr, 1), (&caps.device, NET_CONFIG_LEN)];
    let bars: BTreeSet<u8> = parts.iter().map(|(c, _)| c.bar).collect();
    let bar = match bars.iter().collect::<Vec<_>>()[..] {
        [&bar] if bar <= 5 => bar,
        _ => return Err(format!("the structures lie in BARs {bars:?}; the driver maps one, of BAR0 to BAR5")),
    };
    let mapped = MappedBar::open(&dir.join(format!("resource{bar}")))?;
    for (c, min) in parts {
        let name = caps::cfg_name(c.cfg_type);
        if (c.length as usize) < min {
            return Err(format!("the {name} structure is {} bytes, the driver needs {min}", c.length));
        }
        if u64::from(c.offset) + u64::from(c.length) > mapped.len() as u64 {
            return Err(format!(
                "the {name} structure (+{:#x}, {:#x} bytes) runs past BAR{bar}'s {:#x} bytes",
                c.offset,
                c.length,
                mapped.len()
            ));
        }
    }
    let at = |c: &caps::VirtioCap| c.offset as usize;
    let layout = Layout {
        common: at(&caps.common),
        notify: at(&caps.notify),
        notify_off_multiplier: caps.notify_off_multiplier,
        isr: at(&caps.isr),
        device: at(&caps.device),
        notify_len: caps.notify.length as usize,
    };
    Ok((mapped, layout))
}

/// Two locked pages (rings, frame) and their physical addresses.
fn pin() -> Result<(PinnedBuffer, [u64; 2]), String> {
    let buf = PinnedBuffer::new(2 * PAGE_SIZE)?;
    match buf.physical_pages()?[..] {
        [rings, frame] => Ok((buf, [rings, frame])),
        ref other => Err(format!("{} pages pinned, 2 asked for", other.len())),
    }
}

/// The whole check of one function.
fn function(ctx: &Context, exp: &PciExpectation, limits: &Limits) -> Vec<Check> {
    let (name, bdf) = (exp.name.as_str(), exp.bdf.as_str());
    let test = |t: &str| format!("{name}_{t}");
    let dir = pcidev::function_dir(&ctx.root, bdf);
    let mut notes = vec![format!("{name} {bdf}: {:04x}:{:04x}", exp.vendor, exp.device)];
    let mut problems = Vec::new();
    if !dir.exists() {
        problems.push(format!("not found: {bdf} is not in sysfs"));
        return vec![check(&test("capabilities"), notes, &problems)];
    }
    let before = netdev(&dir);
    let bound = pcidev::driver(&dir);
    notes.push(format!(
        "driver {}, network interface {}",
        bound.as_deref().unwrap_or("none"),
        before.as_ref().map_or("none".into(), Netdev::describe)
    ));
    if let Some(driver) = &bound {
        match unbind(&dir, bdf, driver, limits.sysfs) {
            Ok(line) => notes.push(line),
            Err(e) => {
                problems.push(e);
                return vec![check(&test("capabilities"), notes, &problems)];
            }
        }
    }
    // From here on, every path ends with the device reset and handed back.
    let claim = match Claim::take(&dir, CLAIM_BITS) {
        Ok((claim, line)) => {
            notes.push(line);
            Some(claim)
        }
        Err(e) => {
            problems.push(format!("cannot claim {bdf}: {e}"));
            None
        }
    };
    let caps = read_caps(&dir);
    let mut mapped = None;
    match &caps {
        Ok(c) => {
            notes.extend(caps::describe(c));
            if claim.is_some() {
                match map_bar(&dir, c) {
                    Ok(m) => mapped = Some(m),
                    Err(e) => problems.push(e),
                }
            }
        }
        Err(e) => problems.push(e.clone()),
    }
    let mut checks = vec![check(&test("capabilities"), notes, &problems)];
    checks.push(match &caps {
        Ok(c) => {
            let l = CONTRACT;
            let want = format!(
                "contract: BAR{} common {:#x}, isr {:#x}, device {:#x}, notify {:#x} x {}",
                l.bar, l.common, l.isr, l.device, l.notify, l.notify_off_multiplier
            );
            let found = format!(
                "found: BAR{} common {:#x}, isr {:#x}, device {:#x}, notify {:#x} x {}",
                c.common.bar, c.common.offset, c.isr.offset, c.device.offset, c.notify.offset, c.notify_off_multiplier
            );
            check(&test("layout"), vec![found, want], &caps::layout_mismatches(c, &CONTRACT))
        }
        Err(_) => skip(&test("layout"), format!("no capabilities (see {name}_capabilities)")),
    });
    let mut session = None;
    checks.push(match mapped {
        Some((bar, layout)) => match pin() {
            Ok((buf, pages)) => {
                let mut s = Session::new(Transport { regs: bar, layout }, buf, pages, limits.driver);
                let c = init(&test("init"), &mut s, before.as_ref());
                session = Some(s);
                c
            }
            Err(e) => check(&test("init"), vec![], &[format!("cannot pin memory for the rings: {e}")]),
        },
        None => skip(&test("init"), format!("not run: see {name}_capabilities")),
    });
    match session.as_mut() {
        Some(s) => checks.extend(run_cases(s, name)),
        None => checks.extend(Case::ALL.map(|c| skip(&test(c.name()), "not run: the device was not set up".into()))),
    }
    checks.push(leave(&test("driver_rebinds"), ctx, (&dir, bdf), session, claim, (bound, before), limits));
    checks
}

/// Sets the device up: its check, noting what it offers and holds.
fn init<R: Regs, M: Regs>(name: &str, s: &mut Session<R, M>, before: Option<&Netdev>) -> Check {
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    match s.setup() {
        Ok(setup) => describe_setup(&setup, before, &mut notes, &mut problems),
        Err(e) => {
            s.dead = Some(format!("the device did not initialise ({e})"));
            problems.push(e);
        }
    }
    check(name, notes, &problems)
}

fn describe_setup(setup: &Setup, before: Option<&Netdev>, notes: &mut Vec<String>, problems: &mut Vec<String>) {
    let (offered, accepted, config) = (setup.offered, setup.accepted, setup.config);
    notes.push(format!("reset: device_status 0 after {}", human(setup.reset_in)));
    notes.push(format!(
        "device features {offered:#018x} ({}); accepted {}, FEATURES_OK stuck",
        feature_names(offered),
        feature_names(accepted)
    ));
    for (bit, what) in [(feature::NET_MAC, "MAC"), (feature::NET_MTU, "MTU")] {
        if offered & bit == 0 {
            problems.push(format!("the device does not offer {what}"));
        }
    }
    let mac = format_mac(&config.mac);
    notes.push(format!("MAC {mac}, MTU {}", config.mtu));
    if config.mac == [0; 6] || config.mac[0] & 1 != 0 {
        problems.push(format!("MAC {mac} is not a unicast address"));
    }
    match before.map(|b| (b, b.mac)) {
        Some((b, Some(kernel))) if kernel != config.mac => {
            problems.push(format!("the device says MAC {mac}; the kernel's {} had {}", b.name, format_mac(&kernel)))
        }
        Some((b, Some(_))) => notes.push(format!("the same MAC as the kernel's {}", b.name)),
        _ => {}
    }
    if accepted & feature::NET_MTU != 0 && !(68..=9000).contains(&config.mtu) {
        problems.push(format!("MTU {} is outside 68..=9000", config.mtu));
    }
    let [desc, avail, used] = setup.rings;
    notes.push(format!(
        "{} queues; queue {TX_QUEUE}: {} entries (at most {}), descriptors {desc:#x}, available {avail:#x}, used {used:#x}, \
         doorbell BAR + {:#x} (queue_notify_off {}), MSI-X none: polled",
        setup.num_queues, setup.layout.size, setup.queue_max, setup.notify_at, setup.notify_off
    ));
    problems.extend(setup.warnings.iter().cloned());
}

/// Runs every case on a set-up device: one check each.
fn run_cases<R: Regs, M: Regs>(s: &mut Session<R, M>, nic: &str) -> Vec<Check> {
    let mut checks = Vec::new();
    for case in Case::ALL {
        let name = format!("{nic}_{}", case.name());
        if let Some(why) = &s.dead {
            checks.push(skip(&name, format!("not run: {why}")));
            continue;
        }
        let (mut notes, mut problems) = (vec![case.what()], Vec::new());
        let observed = s.run_case(case);
        let verdict = judge(case, case.head(), &observed);
        let clean = verdict.is_ok() && !observed.timed_out;
        match verdict {
            Ok(line) => notes.push(line),
            Err(e) => problems.push(e),
        }
        let (n, p) = s.after_case(case, clean);
        notes.extend(n);
        problems.extend(p);
        checks.push(check(&name, notes, &problems));
    }
    checks
}

/// Resets the device, releases the claim and binds the driver back (the one it had, else
/// virtio-pci); the network interface must come back, with the MAC it had.
fn leave<R: Regs, M: Regs>(
    name: &str,
    ctx: &Context,
    (dir, bdf): (&Path, &str),
    session: Option<Session<R, M>>,
    claim: Option<Claim>,
    (bound, before): (Option<String>, Option<Netdev>),
    limits: &Limits,
) -> Check {
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    let mut reset = true;
    if let Some(s) = session {
        let (mut dev, mem) = s.into_parts();
        match dev.reset(limits.driver.reset) {
            Ok(t) => {
                notes.push(format!("reset: device_status 0 after {}", human(t)));
                drop(mem);
            }
            Err(e) => {
                problems.push(format!("the device does not reset: {e}"));
                notes.push("its ring memory stays pinned: the device may still use it".into());
                std::mem::forget(mem);
                reset = false;
            }
        }
    }
    if let Some(claim) = claim {
        match claim.release() {
            Ok(line) => notes.push(format!("released: {line}")),
            Err(e) => problems.push(format!("cannot release {bdf}: {e}")),
        }
    }
    if !reset {
        problems.push("not bound back: the driver's probe would wait for the reset forever".into());
        return check(name, notes, &problems);
    }
    let driver = bound.unwrap_or_else(|| VIRTIO_PCI.to_owned());
    match bind(ctx, dir, bdf, &driver, limits.sysfs) {
        Ok(line) => notes.push(line),
        Err(e) => {
            problems.push(e);
            return check(name, notes, &problems);
        }
    }
    if driver != VIRTIO_PCI {
        notes.push(format!("{driver} makes no network interface of it"));
        return check(name, notes, &problems);
    }
    match poll(limits.netdev, || netdev(dir)) {
        Ok((nd, t)) => {
            notes.push(format!("network interface {} after {}", nd.describe(), human(t)));
            if let (Some(old), Some(new)) = (before.as_ref().and_then(|b| b.mac), nd.mac) {
                if old != new {
                    problems.push(format!(
                        "the interface came back with MAC {}, not {}",
                        format_mac(&new),
                        format_mac(&old)
                    ));
                }
            }
        }
        Err(t) => {
            problems.push(format!("no network interface in {}/virtio*/net/ {} after the bind", dir.display(), human(t)))
        }
    }
    check(name, notes, &problems)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::path::PathBuf;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use super::fake::{self, Policy};
    use super::*;
    use crate::context::expected_function;

    const QUICK: Limits = Limits {
        driver: Timing { reset: Duration::from_millis(20), used: Duration::from_millis(20) },
        sysfs: Duration::from_secs(2),
        netdev: Duration::from_millis(300),
    };

    fn verdicts(checks: &[Check]) -> Vec<(&str, &Verdict)> {
        checks.iter().map(|c| (c.name.as_str(), &c.verdict)).collect()
    }

    fn names(checks: &[Check]) -> Vec<&str> {
        checks.iter().map(|c| c.name.as_str()).collect()
    }

    /// A session on a fake device, set up.
    fn session(
        tweak: impl FnOnce(&mut fake::FakeNet),
    ) -> (Rc<RefCell<fake::FakeNet>>, Session<fake::Bar, fake::Memory>) {
        let (dev, transport, mem) = fake::device();
        tweak(&mut dev.borrow_mut());
        let mut s = Session::new(transport, mem, fake::PAGES, QUICK.driver);
        let c = init("nic0_init", &mut s, None);
        assert_eq!(c.verdict, Verdict::Pass, "{c:#?}");
        (dev, s)
    }

    fn sent_frames(dev: &Rc<RefCell<fake::FakeNet>>) -> usize {
        let d = dev.borrow();
        assert!(d.sent.iter().all(|f| *f == queue::good_frame(fake::MAC)), "only good frames go out");
        d.sent.len()
    }

    #[test]
    fn test_init_notes_what_the_device_holds() {
        let (dev, transport, mem) = fake::device();
        let mut s = Session::new(transport, mem, fake::PAGES, QUICK.driver);
        let kernel = Netdev { name: "eth0".into(), mac: Some(fake::MAC) };
        let c = init("nic0_init", &mut s, Some(&kernel));
        assert_eq!(c.verdict, Verdict::Pass, "{c:#?}");
        let notes = c.diagnostics.join("\n");
        assert!(notes.contains("accepted MTU|MAC|VERSION_1, FEATURES_OK stuck"), "{notes}");
        assert!(notes.contains("MAC 52:54:00:ab:cd:01, MTU 9000"), "{notes}");
        assert!(notes.contains("the same MAC as the kernel's eth0"), "{notes}");
        assert!(notes.contains("queue 1: 64 entries (at most 256), descriptors 0x76543000, available 0x76543400, used 0x76543488, doorbell BAR + 0x4004"), "{notes}");
        // The device took exactly what the driver accepted; queue 0 untouched.
        assert_eq!(dev.borrow().sent.len(), 0);

        // Another MAC than the kernel's, and no MTU offered: problems, but the device is live.
        let (dev, transport, mem) = fake::device();
        dev.borrow_mut().offered &= !feature::NET_MTU;
        let mut s = Session::new(transport, mem, fake::PAGES, QUICK.driver);
        let other = Netdev { name: "eth0".into(), mac: Some([2, 0, 0, 0, 0, 1]) };
        let Verdict::Fail(why) = init("nic0_init", &mut s, Some(&other)).verdict else { panic!() };
        assert_eq!(
            why,
            "the device does not offer MTU; the device says MAC 52:54:00:ab:cd:01; the kernel's eth0 had 02:00:00:00:00:01"
        );
        assert!(s.dead.is_none());

        // No VERSION_1: nothing runs.
        let (dev, transport, mem) = fake::device();
        dev.borrow_mut().offered = feature::NET_MAC;
        let mut s = Session::new(transport, mem, fake::PAGES, QUICK.driver);
        let Verdict::Fail(why) = init("nic0_init", &mut s, None).verdict else { panic!() };
        assert_eq!(why, "the device does not offer VERSION_1 (offers MAC)");
        let checks = run_cases(&mut s, "nic0");
        assert!(checks.iter().all(|c| matches!(&c.verdict, Verdict::Skip(w) if w.contains("did not initialise"))));
    }

    #[test]
    fn test_a_device_that_drops_malformed_buffers() {
        let (dev, mut s) = session(|_| {});
        let checks = run_cases(&mut s, "nic0");
        assert_eq!(
            names(&checks),
            [
                "nic0_bad_address",
                "nic0_looping_chain",
                "nic0_oversized_length",
                "nic0_avail_idx_jump",
                "nic0_good_frame"
            ]
        );
        assert!(checks.iter().all(|c| c.verdict == Verdict::Pass), "{checks:#?}");
        for c in &checks[..3] {
            assert!(c.diagnostics[1].starts_with("dropped: used id "), "{c:?}");
            assert!(c.diagnostics[2].starts_with("the device answers: device_status 0x0f"), "{c:?}");
            assert!(c.diagnostics[3].starts_with("a good frame still goes through: consumed"), "{c:?}");
        }
        let jump = &checks[3].diagnostics;
        assert!(jump[1].starts_with("NEEDS_RESET after"), "{jump:?}");
        assert_eq!(jump[3], "ISR 0x02 (configuration change)");
        assert!(
            jump[4].starts_with("reset: device_status 0 after")
                && jump[4].ends_with("set up again: device_status 0x0f (ACKNOWLEDGE|DRIVER|FEATURES_OK|DRIVER_OK)"),
            "{jump:?}"
        );
        assert!(checks[4].diagnostics[1].starts_with("consumed: used id 0 len 0"));
        assert_eq!(dev.borrow().dropped, 3);
        assert_eq!(sent_frames(&dev), 4, "a good frame after each drop, and the last case");
        assert!(s.dead.is_none());
    }

    #[test]
    fn test_a_device_that_needs_reset_on_malformed_buffers() {
        let (dev, mut s) = session(|d| d.policy = Policy::NeedsReset);
        let checks = run_cases(&mut s, "nic0");
        assert!(checks.iter().all(|c| c.verdict == Verdict::Pass), "{checks:#?}");
        for c in &checks[..4] {
            assert!(c.diagnostics[1].starts_with("NEEDS_RESET after"), "{c:?}");
            assert!(c.diagnostics.last().unwrap().contains("set up again"), "{c:?}");
        }
        assert_eq!((dev.borrow().dropped, sent_frames(&dev)), (0, 1));
    }

    #[test]
    fn test_a_device_that_hangs_fails_in_bounded_time() {
        let (dev, mut s) = session(|d| d.policy = Policy::Ignore);
        let start = std::time::Instant::now();
        let checks = run_cases(&mut s, "nic0");
        assert!(start.elapsed() < Duration::from_secs(2), "bounded by the deadlines");
        let v = verdicts(&checks);
        for (name, verdict) in &v[..3] {
            let Verdict::Fail(why) = verdict else { panic!("{name}: {verdict:?}") };
            assert!(why.starts_with("neither a used element nor NEEDS_RESET within"), "{why}");
        }
        // Each hang is followed by a reset that brings the device back, so the next case runs.
        assert!(checks[0].diagnostics.last().unwrap().contains("set up again"));
        assert_eq!(&v[3..], [("nic0_avail_idx_jump", &Verdict::Pass), ("nic0_good_frame", &Verdict::Pass)]);
        assert_eq!(sent_frames(&dev), 1);
    }

    #[test]
    fn test_a_device_that_ignores_the_avail_index_jump() {
        let (dev, mut s) = session(|d| d.checks_avail = false);
        let checks = run_cases(&mut s, "nic0");
        let Verdict::Fail(why) = &checks[3].verdict else { panic!("{checks:#?}") };
        assert!(why.starts_with("the device consumed 65 buffer(s) (used id 0 len 0 after"), "{why}");
        assert!(why.ends_with("instead of setting NEEDS_RESET"), "{why}");
        assert!(checks[3].diagnostics.last().unwrap().contains("set up again"));
        assert_eq!(checks[4].verdict, Verdict::Pass, "a reset brings it back for the good frame");
        assert!(sent_frames(&dev) > 3);
    }

    #[test]
    fn test_a_device_that_does_not_reset_or_stops_answering() {
        let (dev, mut s) = session(|d| d.resets = false);
        let checks = run_cases(&mut s, "nic0");
        let Verdict::Fail(why) = &checks[3].verdict else { panic!("{checks:#?}") };
        assert!(why.starts_with("the reset did not bring the device back: device_status still reads 0x4f"), "{why}");
        assert_eq!(checks[4].verdict, Verdict::Skip(format!("not run: {why}")));
        drop(dev);

        let (dev, mut s) = session(|_| {});
        dev.borrow_mut().gone = true;
        let checks = run_cases(&mut s, "nic0");
        let Verdict::Fail(why) = &checks[0].verdict else { panic!("{checks:#?}") };
        assert!(why.contains("device_status reads 0xff: the device stopped answering"), "{why}");
        assert!(why.contains("the device stopped answering: device_status 0xff, num_queues 0xffff"), "{why}");
        assert!(checks[1..].iter().all(|c| matches!(c.verdict, Verdict::Skip(_))));
    }

    fn ctx(root: &Path, pci: Vec<PciExpectation>) -> Context {
        crate::context::test_context(root, pci)
    }

    fn nic(bdf: &str) -> PciExpectation {
        PciExpectation {
            subsystem: Some((0x1af4, 0x1100)),
            backing: "virtio".into(),
            ..expected_function("nic0", "nic", bdf, (0x1af4, 0x1041))
        }
    }

    #[test]
    fn test_skips_without_a_virtio_nic() {
        let root = tempfile::tempdir().unwrap();
        let none = Context { expect: None, ..ctx(root.path(), vec![]) };
        assert!(matches!(&run(&none)[0].verdict, Verdict::Skip(w) if w.starts_with("not in a gdrvm guest")));
        let other = PciExpectation { vendor: 0x8086, device: 0x10d3, ..nic("0000:01:00.0") };
        assert_eq!(
            verdicts(&run(&ctx(root.path(), vec![other]))),
            [("virtio_net", &Verdict::Skip("no virtio-net function (1af4:1041) in the expectations".into()))]
        );
        let checks = run(&ctx(root.path(), vec![nic("0000:01:00.0")]));
        assert_eq!(
            verdicts(&checks),
            [("nic0_capabilities", &Verdict::Fail("not found: 0000:01:00.0 is not in sysfs".into()))]
        );
    }

    /// A virtio-net function in a fake sysfs, bound to virtio-pci with interface eth0; its
    /// BAR 0 a plain file (a device that offers no features).
    fn fake_function(root: &Path, bdf: &str) -> PathBuf {
        let dir = pcidev::function_dir(root, bdf);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("enable"), "0\n").unwrap();
        std::fs::write(dir.join("config"), caps::tests::contract_config()).unwrap();
        std::fs::write(dir.join("resource0"), vec![0u8; 0x8000]).unwrap();
        let drivers = root.join("sys/bus/pci/drivers/virtio-pci");
        std::fs::create_dir_all(&drivers).unwrap();
        std::fs::write(drivers.join("unbind"), "").unwrap();
        std::fs::write(drivers.join("bind"), "").unwrap();
        std::os::unix::fs::symlink(&drivers, dir.join("driver")).unwrap();
        let net = dir.join("virtio0/net/eth0");
        std::fs::create_dir_all(&net).unwrap();
        std::fs::write(net.join("address"), "52:54:00:ab:cd:01\n").unwrap();
        dir
    }

    /// Plays the kernel: a BDF written to virtio-pci's unbind removes the `driver` link and
    /// the interface; written to bind, puts them back (the interface when `netdev`).
    fn fake_kernel(root: &Path, dir: &Path, netdev: bool, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
        let drivers = root.join("sys/bus/pci/drivers/virtio-pci");
        let dir = dir.to_owned();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if !std::fs::read_to_string(drivers.join("unbind")).unwrap().is_empty() {
                    std::fs::write(drivers.join("unbind"), "").unwrap();
                    std::fs::remove_file(dir.join("driver")).unwrap();
                    std::fs::remove_dir_all(dir.join("virtio0")).unwrap();
                }
                if !std::fs::read_to_string(drivers.join("bind")).unwrap().is_empty() {
                    std::fs::write(drivers.join("bind"), "").unwrap();
                    std::os::unix::fs::symlink(&drivers, dir.join("driver")).unwrap();
                    if netdev {
                        // Made aside and moved in, so that it appears whole, as sysfs does.
                        let staging = dir.join("staging");
                        std::fs::create_dir_all(staging.join("net/eth1")).unwrap();
                        std::fs::write(staging.join("net/eth1/address"), "52:54:00:ab:cd:01\n").unwrap();
                        std::fs::rename(&staging, dir.join("virtio1")).unwrap();
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    }

    #[test]
    fn test_a_whole_run_on_a_fake_sysfs() {
        for netdev_comes_back in [true, false] {
            let root = tempfile::tempdir().unwrap();
            let bdf = "0000:05:00.0";
            let dir = fake_function(root.path(), bdf);
            let stop = Arc::new(AtomicBool::new(false));
            let kernel = fake_kernel(root.path(), &dir, netdev_comes_back, stop.clone());
            let checks = run_with(&ctx(root.path(), vec![nic(bdf)]), &QUICK);
            stop.store(true, Ordering::Relaxed);
            kernel.join().unwrap();

            assert_eq!(
                names(&checks),
                [
                    "nic0_capabilities",
                    "nic0_layout",
                    "nic0_init",
                    "nic0_bad_address",
                    "nic0_looping_chain",
                    "nic0_oversized_length",
                    "nic0_avail_idx_jump",
                    "nic0_good_frame",
                    "nic0_driver_rebinds"
                ]
            );
            let caps = &checks[0];
            assert_eq!(caps.verdict, Verdict::Pass, "{caps:#?}");
            assert_eq!(caps.diagnostics[1], "driver virtio-pci, network interface eth0 (52:54:00:ab:cd:01)");
            assert!(caps.diagnostics[2].starts_with("unbound from virtio-pci in "), "{caps:?}");
            assert_eq!(caps.diagnostics[3], "enable was 0, Command 0x0000 -> 0x0406");
            assert!(caps.diagnostics.contains(&"cap at 0x64: cfg_type 2 (notify), BAR0 + 0x4000, 0x8 bytes".into()));
            assert_eq!(checks[1].verdict, Verdict::Pass);
            assert_eq!(
                checks[1].diagnostics,
                [
                    "found: BAR0 common 0x1000, isr 0x2000, device 0x3000, notify 0x4000 x 4",
                    "contract: BAR0 common 0x1000, isr 0x2000, device 0x3000, notify 0x4000 x 4"
                ]
            );
            // A BAR of zeros offers no features (or, unprivileged, the pages hide their
            // addresses): init fails, the cases do not run.
            let Verdict::Fail(why) = &checks[2].verdict else { panic!("{:?}", checks[2]) };
            assert!(
                why == "the device does not offer VERSION_1 (offers none)" || why.contains("CAP_SYS_ADMIN"),
                "{why}"
            );
            assert!(checks[3..8].iter().all(|c| matches!(c.verdict, Verdict::Skip(_))), "{checks:#?}");

            let rebind = &checks[8];
            if netdev_comes_back {
                assert_eq!(rebind.verdict, Verdict::Pass, "{rebind:#?}");
                let last = rebind.diagnostics.last().unwrap();
                assert!(last.starts_with("network interface eth1 (52:54:00:ab:cd:01) after "), "{last}");
            } else {
                let Verdict::Fail(why) = &rebind.verdict else { panic!("{rebind:?}") };
                assert!(why.starts_with("no network interface in ") && why.contains("after the bind"), "{why}");
            }
            assert!(rebind.diagnostics.iter().any(|l| l.starts_with("bound to virtio-pci in ")), "{rebind:?}");
            assert!(rebind.diagnostics.contains(&"released: Command 0x0406 -> 0x0000, enable back to 0".into()));
            assert_eq!(std::fs::read(dir.join("config")).unwrap()[4..6], [0, 0], "Command as found");
            assert_eq!(pcidev::driver(&dir).as_deref(), Some("virtio-pci"));
        }
    }

    #[test]
    fn test_leave_keeps_memory_of_a_device_that_does_not_reset_and_does_not_rebind() {
        let root = tempfile::tempdir().unwrap();
        let (dev, mut s) = session(|d| d.resets = false);
        s.run_case(Case::AvailJump);
        assert_eq!(s.dev.status() & driver::status::NEEDS_RESET, driver::status::NEEDS_RESET);
        let c = ctx(root.path(), vec![]);
        let check =
            leave("nic0_driver_rebinds", &c, (root.path(), "0000:05:00.0"), Some(s), None, (None, None), &QUICK);
        let Verdict::Fail(why) = &check.verdict else { panic!("{check:?}") };
        assert!(why.starts_with("the device does not reset: device_status still reads 0x4f"), "{why}");
        assert!(why.ends_with("not bound back: the driver's probe would wait for the reset forever"), "{why}");
        assert_eq!(check.diagnostics, ["its ring memory stays pinned: the device may still use it"]);
        drop(dev);
    }

    #[test]
    fn test_bounded_sysfs_writes() {
        let root = tempfile::tempdir().unwrap();
        let file = root.path().join("bind");
        write_bounded(&file, "0000:05:00.0", Duration::from_secs(1)).unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "0000:05:00.0");
        let err = write_bounded(&root.path().join("no/such/bind"), "x", Duration::from_secs(1)).unwrap_err();
        assert!(err.starts_with("writing x to ") && err.contains("No such file"), "{err}");
        // A FIFO with no reader: the open never returns.
        let fifo = root.path().join("stuck");
        let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path for the call.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let start = std::time::Instant::now();
        let err = write_bounded(&fifo, "x", Duration::from_millis(100)).unwrap_err();
        assert!(err.ends_with("did not return within 100.0 ms"), "{err}");
        assert!(start.elapsed() < Duration::from_secs(1));
        // Let the stuck thread finish.
        let _ = std::fs::File::open(&fifo);
    }

    #[test]
    fn test_bars_and_structures_are_checked_before_use() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        std::fs::write(dir.join("resource0"), vec![0u8; 0x4000]).unwrap();
        let mut c = caps::virtio_caps(&caps::tests::contract_config()).unwrap();
        let err = map_bar(dir, &c).unwrap_err();
        assert_eq!(err, "the notify structure (+0x4000, 0x8 bytes) runs past BAR0's 0x4000 bytes");
        std::fs::write(dir.join("resource0"), vec![0u8; 0x8000]).unwrap();
        let (bar, layout) = map_bar(dir, &c).unwrap();
        assert_eq!(bar.len(), 0x8000);
        assert_eq!(layout, fake::LAYOUT);
        c.common.length = 0x20;
        assert_eq!(map_bar(dir, &c).unwrap_err(), "the common structure is 32 bytes, the driver needs 56");
        c.common.length = 0x38;
        c.isr.bar = 2;
        assert_eq!(
            map_bar(dir, &c).unwrap_err(),
            "the structures lie in BARs {0, 2}; the driver maps one, of BAR0 to BAR5"
        );
    }

    #[test]
    fn test_netdev_of_a_function() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path();
        assert_eq!(netdev(dir), None);
        std::fs::create_dir_all(dir.join("virtio3/net/ens5")).unwrap();
        assert_eq!(netdev(dir), Some(Netdev { name: "ens5".into(), mac: None }));
        std::fs::write(dir.join("virtio3/net/ens5/address"), "02:00:00:00:00:07\n").unwrap();
        assert_eq!(netdev(dir).unwrap().describe(), "ens5 (02:00:00:00:00:07)");
    }
}
