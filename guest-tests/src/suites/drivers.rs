//! `drivers`: the user's out-of-tree modules (`--module-src`) at work. Each is loaded, each
//! PCI driver it registers is bound to at least one device, and every device it bound is a
//! function of the node file; what the driver logged about each device is kept as notes.
//! This is the check `git bisect run cargo xtask boot --module-src . --suite drivers` asks:
//! a commit that stops the driver probing fails it.

use std::path::Path;

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::pcidev::is_bdf;

pub fn run(ctx: &Context) -> Vec<Check> {
    let modules: Vec<String> = ctx
        .image
        .iter()
        .flat_map(|i| &i.user_modules)
        .filter_map(|m| Some(Path::new(m).file_stem()?.to_string_lossy().replace('-', "_")))
        .collect();
    if modules.is_empty() {
        return vec![Check::new("user_modules", Verdict::Skip("the image has no --module-src modules".into()))];
    }
    modules.iter().flat_map(|m| [loaded(ctx, m), bound(ctx, m)]).collect()
}

fn loaded(ctx: &Context, module: &str) -> Check {
    let name = format!("{module}_loaded");
    if ctx.path(&format!("/sys/module/{module}")).is_dir() {
        Check::new(&name, Verdict::Pass)
    } else {
        Check::new(&name, Verdict::Fail(format!("/sys/module/{module} is missing: the module is not loaded")))
    }
}

/// The PCI drivers `module` registers (`/sys/module/<m>/drivers/pci:<driver>`).
fn pci_drivers(ctx: &Context, module: &str) -> Vec<String> {
    let mut drivers: Vec<String> = std::fs::read_dir(ctx.path(&format!("/sys/module/{module}/drivers")))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("pci:").map(str::to_owned))
        .collect();
    drivers.sort();
    drivers
}

fn bound(ctx: &Context, module: &str) -> Check {
    let name = format!("{module}_bound");
    let drivers = pci_drivers(ctx, module);
    if drivers.is_empty() {
        return Check::new(&name, Verdict::Fail(format!("{module} registers no PCI driver")));
    }
    let mut notes = Vec::new();
    let mut devices = 0;
    let mut strangers = Vec::new();
    for driver in &drivers {
        let mut bdfs: Vec<String> = std::fs::read_dir(ctx.path(&format!("/sys/bus/pci/drivers/{driver}")))
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_bdf(n))
            .collect();
        bdfs.sort();
        for bdf in bdfs {
            devices += 1;
            let function = ctx.expect.as_ref().and_then(|e| e.pci.iter().find(|p| p.bdf == bdf));
            match (function, &ctx.expect) {
                (Some(f), _) => notes.push(format!("{driver} bound {bdf} ({})", f.name)),
                (None, Some(_)) => strangers.push(bdf.clone()),
                (None, None) => notes.push(format!("{driver} bound {bdf}")),
            }
            // What the driver said about the device (dev_info and friends prefix the BDF).
            if let Ok(log) = &ctx.kernel_log {
                notes
                    .extend(log.lines().filter(|l| l.contains(&bdf) && l.contains(driver.as_str())).map(str::to_owned));
            }
        }
    }
    let verdict = if devices == 0 {
        Verdict::Fail(format!("{} bound no device: the driver did not probe", drivers.join(", ")))
    } else if !strangers.is_empty() {
        Verdict::Fail(format!("bound {} that the node file does not have", strangers.join(", ")))
    } else {
        Verdict::Pass
    };
    notes.into_iter().fold(Check::new(&name, verdict), Check::note)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::context::{expected_function, test_context};

    fn sysfs(root: &Path, module: &str, driver: &str, bdfs: &[&str]) {
        let drivers = root.join(format!("sys/module/{module}/drivers"));
        std::fs::create_dir_all(drivers.join(format!("pci:{driver}"))).unwrap();
        let bound = root.join(format!("sys/bus/pci/drivers/{driver}"));
        std::fs::create_dir_all(&bound).unwrap();
        std::fs::write(bound.join("new_id"), "").unwrap();
        for bdf in bdfs {
            std::fs::create_dir_all(bound.join(bdf)).unwrap();
        }
    }

    fn ctx_with(root: &Path, modules: &[&str]) -> Context {
        let gpu = expected_function("gpu0", "gpu", "0000:01:00.0", (0x10de, 0x20b0));
        let mut ctx = test_context(root, vec![gpu]);
        ctx.image = Some(gdrvm_model::ImageManifest {
            name: "default".into(),
            kernel_release: "6.1.0-57-amd64".into(),
            modules: vec![],
            optional_modules: vec![],
            on_demand_modules: vec![],
            left_out_layers: Default::default(),
            user_modules: modules.iter().map(|m| format!("/lib/modules/{m}.ko")).collect(),
        });
        ctx.kernel_log = Ok("[ 1.0] gdrvm_drv 0000:01:00.0: gdrvm_drv: bar0 16777216 bytes\n".into());
        ctx
    }

    fn verdicts(checks: &[Check]) -> Vec<(String, bool)> {
        checks.iter().map(|c| (c.name.clone(), matches!(c.verdict, Verdict::Pass))).collect()
    }

    #[test]
    fn test_a_driver_bound_to_a_node_device_passes_with_its_log() {
        let dir = tempfile::tempdir().unwrap();
        sysfs(dir.path(), "gdrvm_drv", "gdrvm_drv", &["0000:01:00.0"]);
        let checks = run(&ctx_with(dir.path(), &["gdrvm-drv"]));
        assert_eq!(verdicts(&checks), [("gdrvm_drv_loaded".into(), true), ("gdrvm_drv_bound".into(), true)]);
        assert!(checks[1].diagnostics.iter().any(|n| n.contains("bound 0000:01:00.0 (gpu0)")));
        assert!(checks[1].diagnostics.iter().any(|n| n.contains("bar0 16777216 bytes")));
    }

    #[test]
    fn test_a_driver_that_did_not_probe_fails() {
        let dir = tempfile::tempdir().unwrap();
        sysfs(dir.path(), "gdrvm_drv", "gdrvm_drv", &[]);
        let checks = run(&ctx_with(dir.path(), &["gdrvm_drv"]));
        assert_eq!(verdicts(&checks)[1], ("gdrvm_drv_bound".into(), false));
        assert!(matches!(&checks[1].verdict, Verdict::Fail(w) if w.contains("did not probe")));
    }

    #[test]
    fn test_unloaded_driverless_and_stranger_bindings_fail() {
        let dir = tempfile::tempdir().unwrap();
        let checks = run(&ctx_with(dir.path(), &["gone"]));
        assert_eq!(verdicts(&checks), [("gone_loaded".into(), false), ("gone_bound".into(), false)]);
        sysfs(dir.path(), "odd", "odd", &["0000:09:00.0"]);
        let checks = run(&ctx_with(dir.path(), &["odd"]));
        assert!(matches!(&checks[1].verdict, Verdict::Fail(w) if w.contains("0000:09:00.0")));
    }

    #[test]
    fn test_no_user_modules_is_a_skip() {
        let dir = tempfile::tempdir().unwrap();
        let checks = run(&ctx_with(dir.path(), &[]));
        assert!(matches!(checks[0].verdict, Verdict::Skip(_)));
    }
}
