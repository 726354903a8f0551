//! The emulated GPUs and NICs in sysfs: found by the expectations' BDF, unbound, claimed
//! (`enable`, Command bits), BAR 0 mapped, their registers answering as the contract says,
//! and a GPU's aperture mapped at the bus address NICs copy to.

use std::path::PathBuf;

use gdrvm_model::emulated::{REGS, REGS_LEN};
use gdrvm_model::PciExpectation;

use super::{check, plan, regs};
use crate::context::Context;
use crate::ktap::Check;
use crate::pcidev::{self, Claim, MappedBar, COMMAND_BUS_MASTER, COMMAND_MEMORY};

/// An emulated GPU that answered, claimed (memory decode on), its aperture mapped.
pub struct Gpu<'a> {
    /// What the VMM promised.
    pub exp: &'a PciExpectation,
    /// Puts `enable` and Command back.
    pub claim: Claim,
    /// The start of the aperture as the CPU reaches it ([`plan::APERTURE_WINDOW`] at most).
    pub aperture: MappedBar,
    /// The aperture's bus address.
    pub iova: u64,
    /// Bytes of it mapped and used by transfers.
    pub size: u64,
}

/// An emulated NIC that answered, claimed (memory decode and bus mastering on), its
/// registers mapped.
pub struct Nic<'a> {
    /// What the VMM promised.
    pub exp: &'a PciExpectation,
    /// Puts `enable` and Command back.
    pub claim: Claim,
    /// BAR 0.
    pub regs: MappedBar,
}

/// The function of `exp` found in sysfs, unbound, claimed with `bits`, BAR 0 mapped, its
/// registers answering as a device of `kind`: the claim, the mapping, its directory. Notes
/// and problems go to `notes` and `problems`.
fn open_function(
    ctx: &Context,
    exp: &PciExpectation,
    bits: u16,
    kind: u32,
    probe: u32,
    notes: &mut Vec<String>,
    problems: &mut Vec<String>,
) -> Option<(Claim, MappedBar, PathBuf)> {
    let (bdf, dir) = (&exp.bdf, pcidev::function_dir(&ctx.root, &exp.bdf));
    if !dir.exists() {
        problems.push(format!("not found: {bdf} ({}) is not in sysfs", exp.name));
        return None;
    }
    if let Some(driver) = pcidev::driver(&dir) {
        problems.push(format!("{bdf} is bound to {driver}; the suite drives unbound functions only"));
        return None;
    }
    let ids = match pcidev::ids(&dir) {
        Ok(ids) => ids,
        Err(e) => {
            problems.push(e);
            return None;
        }
    };
    notes.push(format!("{} {bdf}: {:04x}:{:04x}, backing {}, p2p {}", exp.name, ids.0, ids.1, exp.backing, exp.p2p));
    if ids != (exp.vendor, exp.device) {
        problems.push(format!("sysfs IDs {:04x}:{:04x}, expected {:04x}:{:04x}", ids.0, ids.1, exp.vendor, exp.device));
    }
    let claim = match Claim::take(&dir, bits) {
        Ok((claim, line)) => {
            notes.push(line);
            claim
        }
        Err(e) => {
            problems.push(format!("cannot enable {bdf}: {e}"));
            return None;
        }
    };
    let mut regs = match MappedBar::open(&dir.join("resource0")) {
        Ok(bar) if bar.len() as u64 >= REGS + REGS_LEN => bar,
        Ok(bar) => {
            problems.push(format!("BAR 0 maps {} bytes; the registers end at {:#x}", bar.len(), REGS + REGS_LEN));
            return None;
        }
        Err(e) => {
            problems.push(format!("cannot map BAR 0: {e}"));
            return None;
        }
    };
    for f in [regs::common(&mut regs, ids, kind, probe), regs::doorbell(&mut regs)] {
        notes.extend(f.notes);
        problems.extend(f.problems);
    }
    Some((claim, regs, dir))
}

/// Opens the emulated GPU of `exp`: its registers check, and the GPU when it answered.
pub fn open_gpu<'a>(ctx: &Context, exp: &'a PciExpectation, probe: u32) -> (Check, Option<Gpu<'a>>) {
    let name = format!("{}_registers", exp.name);
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    let kind = regs::kind_of(true);
    let Some((claim, mut regs, dir)) = open_function(ctx, exp, COMMAND_MEMORY, kind, probe, &mut notes, &mut problems)
    else {
        return (check(&name, notes, &problems), None);
    };
    let (index, size) = regs::aperture(&mut regs);
    if index == u32::MAX {
        problems.push("no aperture: its BAR index reads 0xffffffff".into());
        return (check(&name, notes, &problems), None);
    }
    notes.push(format!("aperture: BAR {index}, {}", plan::size_name(size)));
    match plan::aperture_bar(exp) {
        Some(bar) if (u32::from(bar.index), bar.size) == (index, size) => {}
        Some(bar) => problems.push(format!(
            "the aperture registers say BAR {index}, {size} bytes; the largest expected BAR is {}, {} bytes",
            bar.index, bar.size
        )),
        None => problems.push("the expectations list no BAR but BAR 0 for it".into()),
    }
    if index == 0 {
        problems.push("the aperture is BAR 0, where the registers are".into());
    }
    let aperture = usize::try_from(index).map_err(|e| e.to_string()).and_then(|i| pcidev::resource(&dir, i));
    let res = match aperture {
        Ok(r) if r.is_mem() && r.size() == size => r,
        Ok(r) => {
            problems.push(format!("sysfs resource line {index} is {r:x?}, not a memory BAR of {size} bytes"));
            return (check(&name, notes, &problems), None);
        }
        Err(e) => {
            problems.push(e);
            return (check(&name, notes, &problems), None);
        }
    };
    if !res.is_prefetchable() {
        problems.push(format!("BAR {index} is not prefetchable (sysfs flags {:#x})", res.flags));
    }
    notes.push(format!("aperture at bus address {:#x}", res.start));
    // Transfers use the start of the aperture: only that much is mapped.
    let window = size.min(plan::APERTURE_WINDOW);
    if window < size {
        notes.push(format!("mapping the first {} of it", plan::size_name(window)));
    }
    let aperture = match MappedBar::open_window(&dir.join(format!("resource{index}")), window as usize) {
        Ok(bar) if bar.len() as u64 == window => bar,
        Ok(bar) => {
            problems.push(format!("resource{index} maps {} bytes, not {window}", bar.len()));
            return (check(&name, notes, &problems), None);
        }
        Err(e) => {
            problems.push(format!("cannot map the aperture: {e}"));
            return (check(&name, notes, &problems), None);
        }
    };
    drop(regs);
    let gpu = problems.is_empty().then_some(Gpu { exp, claim, aperture, iova: res.start, size: window });
    (check(&name, notes, &problems), gpu)
}

/// Opens the emulated NIC of `exp`: its registers check, and the NIC when it answered.
pub fn open_nic<'a>(ctx: &Context, exp: &'a PciExpectation, probe: u32) -> (Check, Option<Nic<'a>>) {
    let name = format!("{}_registers", exp.name);
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    let (bits, kind) = (COMMAND_MEMORY | COMMAND_BUS_MASTER, regs::kind_of(false));
    let opened = open_function(ctx, exp, bits, kind, probe, &mut notes, &mut problems);
    let nic = opened.filter(|_| problems.is_empty()).map(|(claim, regs, _)| Nic { exp, claim, regs });
    (check(&name, notes, &problems), nic)
}
