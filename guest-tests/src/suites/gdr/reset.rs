//! A Function Level Reset of an emulated device as Linux makes one (sysfs `reset`: save
//! the configuration, disable, initiate FLR, wait, restore): the device's own state goes
//! back to power-on, so its scratch register reads 0, while the configuration Linux
//! restores brings its registers back where they were, answering.

use std::path::Path;

use gdrvm_model::emulated::{REGS, REG_IDENT, REG_SCRATCH};

use super::regs::Findings;
use crate::pcidev::{self, Mmio};

/// Resets the function in `dir`, BAR 0 mapped as `regs`, through `reset` (sysfs `reset` in
/// the guest) after writing `probe` to its scratch register, and checks that Linux chose
/// FLR, that the scratch register reads 0 afterwards and that the identity register still
/// reads `ids` (`device << 16 | vendor`).
pub fn function_level_reset<R: Mmio>(
    dir: &Path,
    regs: &mut R,
    ids: (u16, u16),
    probe: u32,
    reset: impl FnOnce(&mut R) -> Result<(), String>,
) -> Findings {
    let mut f = Findings::default();
    match pcidev::reset_methods(dir) {
        // Linux tries the methods in this order and uses the first that works.
        Some(methods) if methods.split_whitespace().next() == Some("flr") => {
            f.notes.push(format!("reset methods: {methods}"));
        }
        Some(methods) => {
            f.problems.push(format!("Linux would not reset it by FLR first (reset_method: {methods:?})"));
            return f;
        }
        None => f.notes.push("no reset_method in sysfs (a kernel before 5.15): reset by whatever Linux picks".into()),
    }
    let probe = probe | 1;
    let scratch = (REGS + REG_SCRATCH) as usize;
    regs.write32(scratch, probe);
    let before = regs.read32(scratch);
    if before != probe {
        f.problems.push(format!("scratch reads {before:#010x} after writing {probe:#010x}"));
        return f;
    }
    if let Err(e) = reset(regs) {
        f.problems.push(format!("reset: {e}"));
        return f;
    }
    let (after, ident) = (regs.read32(scratch), regs.read32((REGS + REG_IDENT) as usize));
    let want = u32::from(ids.1) << 16 | u32::from(ids.0);
    if ident != want {
        f.problems.push(format!("after the reset the identity reads {ident:#010x}, not {want:#010x}"));
    } else if after != 0 {
        f.problems.push(format!("scratch still reads {after:#010x} after the reset: the device was not reset"));
    } else {
        f.notes.push(format!("scratch {probe:#010x} -> 0 across the reset; the registers answer again"));
    }
    f
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeDevice;
    use super::*;

    fn sysfs(methods: Option<&str>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        if let Some(m) = methods {
            std::fs::write(dir.path().join("reset_method"), format!("{m}\n")).unwrap();
        }
        dir
    }

    #[test]
    fn test_a_device_that_resets_passes() {
        let dir = sysfs(Some("flr bus"));
        let mut nic = FakeDevice::nic(0x15b3, 0x101b);
        let f = function_level_reset(dir.path(), &mut nic, (0x15b3, 0x101b), 0x1234_5678, |d| {
            d.scratch = 0;
            Ok(())
        });
        assert_eq!(f.problems, Vec::<String>::new());
        assert_eq!(
            f.notes,
            ["reset methods: flr bus", "scratch 0x12345679 -> 0 across the reset; the registers answer again"]
        );
    }

    #[test]
    fn test_what_goes_wrong_is_named() {
        let ids = (0x15b3, 0x101b);
        let mut nic = FakeDevice::nic(ids.0, ids.1);
        let f = function_level_reset(sysfs(Some("flr")).path(), &mut nic, ids, 2, |_| Ok(()));
        assert_eq!(f.problems, ["scratch still reads 0x00000003 after the reset: the device was not reset"]);
        let f = function_level_reset(sysfs(Some("pm flr bus")).path(), &mut nic, ids, 2, |_| Ok(()));
        assert_eq!(f.problems, ["Linux would not reset it by FLR first (reset_method: \"pm flr bus\")"]);
        let f = function_level_reset(sysfs(None).path(), &mut nic, ids, 2, |_| Err("EIO".into()));
        assert_eq!(f.problems, ["reset: EIO"]);
        let f = function_level_reset(sysfs(None).path(), &mut nic, ids, 2, |d| {
            d.gone = true;
            Ok(())
        });
        assert_eq!(f.problems, ["after the reset the identity reads 0xffffffff, not 0x101b15b3"]);
    }
}
