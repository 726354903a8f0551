//! `smoke`: the guest booted as configured: kernel release, CPUs, memory, a clean kernel
//! log, and the image's modules loaded.

use crate::context::Context;
use crate::ktap::{Check, Verdict};

/// Lines in the kernel log that fail the smoke suite. A kernel `WARN()` prints
/// `WARNING: CPU: n PID: n at file:line`; matching that form keeps advisories that merely
/// contain the word (the SRSO mitigation notice) from failing the check.
const BAD_LOG_MARKERS: &[&str] =
    &["ACPI Error", "ACPI BIOS Error", "BUG:", "WARNING: CPU:", "[Firmware Bug]", "[Firmware Warn]", "PCI: Fatal"];
/// What x86 Linux logs at `pci_arch_init` on a machine with ECAM as its only configuration
/// mechanism (gdrvm, QEMU's `microvm` with PCIe): no type-1 ports, and no early ECAM
/// (6.1's early check needs type 1; gdrvm passes `pci=noearly`). Harmless when ECAM is
/// taken from MCFG once ACPI is up ([`ecam_taken`]), as nothing reads configuration space
/// before `acpi_init`; without that, PCI really has no access.
const NO_EARLY_ACCESS: &str = "PCI: Fatal: No config space access function found";
/// How far the kernel's view of RAM may be from what the VMM gave it.
const MEMORY_TOLERANCE: f64 = 0.05;

pub fn run(ctx: &Context) -> Vec<Check> {
    vec![kernel_release(ctx), online_cpus(ctx), memory(ctx), kernel_log_clean(ctx), mp_table(ctx), modules_loaded(ctx)]
}

fn not_in_vm() -> Verdict {
    Verdict::Skip("no VMM expectations (not in a gdrvm guest)".into())
}

fn kernel_release(ctx: &Context) -> Check {
    let release = match std::fs::read_to_string(ctx.path("/proc/sys/kernel/osrelease")) {
        Ok(r) => r.trim().to_owned(),
        Err(e) => return Check::new("kernel_release", Verdict::Fail(format!("cannot read the release: {e}"))),
    };
    let verdict = match &ctx.image {
        Some(image) if image.kernel_release != release => {
            Verdict::Fail(format!("running {release}, the image was built for {}", image.kernel_release))
        }
        _ => Verdict::Pass,
    };
    Check::new("kernel_release", verdict).note(format!("release {release}"))
}

/// Counts CPUs in a sysfs list such as `0-3,5,7-8`.
pub(crate) fn count_cpu_list(list: &str) -> Option<u32> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.parse::<u32>().ok()?.checked_sub(a.parse::<u32>().ok()?)? + 1,
            None => {
                part.parse::<u32>().ok()?;
                1
            }
        };
    }
    Some(n)
}

fn online_cpus(ctx: &Context) -> Check {
    let list = match std::fs::read_to_string(ctx.path("/sys/devices/system/cpu/online")) {
        Ok(l) => l,
        Err(e) => return Check::new("online_cpus", Verdict::Fail(format!("cannot read the online CPUs: {e}"))),
    };
    let Some(online) = count_cpu_list(&list) else {
        return Check::new("online_cpus", Verdict::Fail(format!("unparsable CPU list '{}'", list.trim())));
    };
    let verdict = match &ctx.expect {
        None => not_in_vm(),
        Some(e) if e.cpus == online => Verdict::Pass,
        Some(e) => Verdict::Fail(format!("{online} online, {} configured", e.cpus)),
    };
    Check::new("online_cpus", verdict).note(format!("{online} CPUs online ({})", list.trim()))
}

/// The kernel's total of RAM pages from its boot line `Memory: 982148K/1048040K available`.
pub fn kernel_ram_kib(log: &str) -> Option<u64> {
    log.lines().find_map(|line| {
        let rest = &line[line.find("Memory: ")? + 8..];
        let total = rest.split_once('/')?.1;
        total.split_once('K')?.0.parse().ok()
    })
}

fn memory(ctx: &Context) -> Check {
    let Some(expect) = &ctx.expect else { return Check::new("memory", not_in_vm()) };
    let from_log = ctx.kernel_log.as_ref().ok().and_then(|log| kernel_ram_kib(log));
    let (kib, source) = match from_log {
        Some(k) => (k, "kernel's boot memory line"),
        None => match meminfo_total_kib(ctx) {
            Some(k) => (k, "MemTotal"),
            None => {
                return Check::new(
                    "memory",
                    Verdict::Fail("neither the kernel log nor /proc/meminfo give the RAM size".into()),
                )
            }
        },
    };
    let seen = kib * 1024;
    let configured = expect.memory_bytes;
    let off = (seen as f64 - configured as f64).abs() / configured as f64;
    let verdict = if off <= MEMORY_TOLERANCE {
        Verdict::Pass
    } else {
        Verdict::Fail(format!(
            "the kernel sees {} MiB, {} MiB configured ({:.1}% off)",
            seen >> 20,
            configured >> 20,
            off * 100.0
        ))
    };
    Check::new("memory", verdict).note(format!("{} MiB of {} MiB configured ({source})", seen >> 20, configured >> 20))
}

fn meminfo_total_kib(ctx: &Context) -> Option<u64> {
    let text = std::fs::read_to_string(ctx.path("/proc/meminfo")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn kernel_log_clean(ctx: &Context) -> Check {
    let log = match &ctx.kernel_log {
        Ok(log) => log,
        Err(e) => return Check::new("kernel_log_clean", Verdict::Skip(format!("cannot read the kernel log: {e}"))),
    };
    let ecam_taken = log.lines().any(ecam_taken);
    let bad: Vec<&str> = log
        .lines()
        .filter(|l| BAD_LOG_MARKERS.iter().any(|m| l.contains(m)))
        .filter(|l| !(ecam_taken && l.contains(NO_EARLY_ACCESS)))
        .collect();
    if bad.is_empty() {
        return Check::new("kernel_log_clean", Verdict::Pass);
    }
    let mut check =
        Check::new("kernel_log_clean", Verdict::Fail(format!("{} bad line(s) in the kernel log", bad.len())));
    for line in bad.iter().take(10) {
        check = check.note(line.trim());
    }
    check
}

/// What Linux logs when its early scan finds gdrvm's MP floating pointer, at the start of
/// the EBDA.
const MP_TABLE_FOUND: &str = "found SMP MP-table at [mem 0x0009fc00-0x0009fc0f]";

/// In a gdrvm guest, Linux found the MP floating pointer where the VMM put it, so its
/// 16-byte scan of low memory stopped there instead of remapping 4,200 places.
fn mp_table(ctx: &Context) -> Check {
    if ctx.expect.as_ref().is_none_or(|e| e.host) {
        return Check::new("mp_table", not_in_vm());
    }
    let log = match &ctx.kernel_log {
        Ok(log) => log,
        Err(e) => return Check::new("mp_table", Verdict::Skip(format!("cannot read the kernel log: {e}"))),
    };
    match log.lines().find(|l| l.contains("SMP MP-table") || l.contains("MPTABLE")) {
        Some(line) if line.contains(MP_TABLE_FOUND) => Check::new("mp_table", Verdict::Pass),
        Some(line) => Check::new("mp_table", Verdict::Fail(format!("unexpected: {}", line.trim()))),
        None => {
            Check::new("mp_table", Verdict::Fail("no MP floating pointer found: the scan ran its full length".into()))
        }
    }
}

/// Whether `line` is Linux accepting ECAM because ACPI reserves it (`pci_mmcfg_late_init`):
/// "PCI: MMCONFIG at [mem ..] reserved in ACPI motherboard resources" (6.1), "..reserved
/// as ACPI motherboard resource" (6.2 on), with ECAM for MMCONFIG in later kernels; not
/// "[Firmware Info]: .. not reserved in ACPI motherboard resources", the refusal.
fn ecam_taken(line: &str) -> bool {
    (line.contains("MMCONFIG") || line.contains("ECAM"))
        && line.contains(" reserved ")
        && line.contains("ACPI motherboard resource")
        && !line.contains("not reserved")
}

fn modules_loaded(ctx: &Context) -> Check {
    let Some(image) = &ctx.image else {
        return Check::new("modules_loaded", Verdict::Skip("no image manifest (not a gdrvm image)".into()));
    };
    let missing: Vec<String> = image
        .modules
        .iter()
        .filter_map(|path| {
            let name = crate::modalias::module_name(std::path::Path::new(path).file_stem()?.to_str()?);
            let absent = !ctx.path(&format!("/sys/module/{name}")).exists();
            (absent && !ctx.modules_left_out.contains(&name)).then_some(name)
        })
        .collect();
    let mut check = if missing.is_empty() && ctx.module_errors.is_empty() {
        Check::new("modules_loaded", Verdict::Pass)
    } else {
        Check::new("modules_loaded", Verdict::Fail(format!("not loaded: {}", missing.join(", "))))
    };
    for e in &ctx.module_errors {
        check = check.note(e.clone());
    }
    if !ctx.modules_left_out.is_empty() {
        check = check.note(format!("left out, no device here that they drive: {}", ctx.modules_left_out.join(", ")));
    }
    check.note(format!("{} module(s) from the image", image.modules.len()))
}

#[cfg(test)]
mod tests {
    use gdrvm_model::{Expectations, ImageManifest};

    use super::*;

    fn fake_root(cpus: &str, release: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path();
        std::fs::create_dir_all(p.join("proc/sys/kernel")).unwrap();
        std::fs::create_dir_all(p.join("sys/devices/system/cpu")).unwrap();
        std::fs::create_dir_all(p.join("sys/module/virtio_net")).unwrap();
        std::fs::write(p.join("proc/sys/kernel/osrelease"), release).unwrap();
        std::fs::write(p.join("sys/devices/system/cpu/online"), cpus).unwrap();
        std::fs::write(p.join("proc/meminfo"), "MemTotal:         983624 kB\n").unwrap();
        dir
    }

    fn ctx(root: &std::path::Path, log: &str) -> Context {
        Context {
            expect: Some(Expectations {
                cpus: 2,
                memory_bytes: 1 << 30,
                numa: vec![],
                pci: vec![],
                paths: vec![],
                host: false,
            }),
            image: Some(ImageManifest {
                name: "default".into(),
                kernel_release: "6.1.0-57-amd64".into(),
                modules: vec!["/lib/modules/virtio_net.ko".into()],
                optional_modules: vec![],
                on_demand_modules: vec![],
                left_out_layers: Default::default(),
                user_modules: vec![],
            }),
            root: root.to_owned(),
            kernel_log: Ok(log.to_owned()),
            module_errors: vec![],
            modules_left_out: vec![],
        }
    }

    const GOOD_LOG: &str = "[    0.0] found SMP MP-table at [mem 0x0009fc00-0x0009fc0f]\n[    0.1] Memory: 982148K/1048040K available (14343K kernel code)\n";

    #[test]
    fn test_all_pass_on_a_good_guest() {
        let root = fake_root("0-1\n", "6.1.0-57-amd64\n");
        let checks = run(&ctx(root.path(), GOOD_LOG));
        for c in &checks {
            assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
        }
    }

    #[test]
    fn test_failures_are_named() {
        let root = fake_root("0\n", "6.1.0-99-amd64\n");
        let log = "[ 1.0] Memory: 400000K/500000K available\n[ 0.3] Speculative Return Stack Overflow: WARNING: See srso.html\n[ 4.7] WARNING: CPU: 0 PID: 0 at xstate.c:606\n";
        let checks = run(&ctx(root.path(), log));
        let verdict = |name: &str| checks.iter().find(|c| c.name == name).unwrap().verdict.clone();
        assert!(matches!(verdict("kernel_release"), Verdict::Fail(m) if m.contains("6.1.0-99-amd64")));
        assert!(matches!(verdict("online_cpus"), Verdict::Fail(m) if m == "1 online, 2 configured"));
        assert!(matches!(verdict("memory"), Verdict::Fail(m) if m.contains("488 MiB")));
        assert!(matches!(verdict("kernel_log_clean"), Verdict::Fail(_)));
        let log_check = checks.iter().find(|c| c.name == "kernel_log_clean").unwrap();
        assert_eq!(log_check.diagnostics.len(), 1);
        assert!(log_check.diagnostics[0].contains("xstate.c:606"));
    }

    #[test]
    fn test_a_module_left_out_for_want_of_its_device_is_not_missing() {
        let root = tempfile::tempdir().unwrap();
        let mut c = ctx(root.path(), GOOD_LOG);
        assert!(matches!(modules_loaded(&c).verdict, Verdict::Fail(m) if m == "not loaded: virtio_net"));
        c.modules_left_out = vec!["virtio_net".into()];
        let check = modules_loaded(&c);
        assert_eq!(check.verdict, Verdict::Pass);
        assert!(check.diagnostics.iter().any(|d| d.contains("left out") && d.contains("virtio_net")), "{check:?}");
    }

    #[test]
    fn test_no_early_pci_access_is_clean_only_when_ecam_follows() {
        let root = fake_root("0-1\n", "6.1.0-57-amd64\n");
        let fatal = "[    0.55] PCI: Fatal: No config space access function found\n";
        let ecam = "[    0.60] PCI: MMCONFIG at [mem 0xe0000000-0xe00fffff] reserved in ACPI motherboard resources\n";
        let check = |log: &str| run(&ctx(root.path(), log)).into_iter().find(|c| c.name == "kernel_log_clean").unwrap();
        assert_eq!(check(&format!("{GOOD_LOG}{fatal}{ecam}")).verdict, Verdict::Pass);
        assert!(matches!(check(&format!("{GOOD_LOG}{fatal}")).verdict, Verdict::Fail(_)), "no ECAM after it");
        // Later kernels' wording is accepted; the refusal is not.
        for taken in [
            "[    0.60] PCI: MMCONFIG at [mem 0xe0000000-0xe00fffff] reserved as ACPI motherboard resource\n",
            "[    0.60] PCI: ECAM [mem 0xe0000000-0xe00fffff] reserved as ACPI motherboard resource\n",
        ] {
            assert_eq!(check(&format!("{GOOD_LOG}{fatal}{taken}")).verdict, Verdict::Pass, "{taken}");
        }
        let refused = "[    0.60] [Firmware Info]: PCI: MMCONFIG at [mem 0xe0000000-0xe00fffff] not reserved in ACPI motherboard resources\n";
        assert!(matches!(check(&format!("{GOOD_LOG}{fatal}{refused}")).verdict, Verdict::Fail(_)), "ECAM refused");
    }

    #[test]
    fn test_mp_table_must_be_found_in_the_ebda() {
        let root = fake_root("0-1\n", "6.1.0-57-amd64\n");
        let verdict = |log: &str| mp_table(&ctx(root.path(), log)).verdict;
        assert_eq!(verdict(GOOD_LOG), Verdict::Pass);
        let memory_only = "[    0.1] Memory: 982148K/1048040K available\n";
        assert!(matches!(verdict(memory_only), Verdict::Fail(m) if m.contains("full length")));
        let elsewhere = "[    0.0] found SMP MP-table at [mem 0x000f5b90-0x000f5b9f]\n";
        assert!(matches!(verdict(elsewhere), Verdict::Fail(m) if m.contains("0x000f5b90")));
    }

    #[test]
    fn test_bare_metal_skips_vm_checks() {
        let root = fake_root("0-63\n", "6.8.0\n");
        let mut c = ctx(root.path(), GOOD_LOG);
        c.expect = None;
        c.image = None;
        let checks = run(&c);
        assert!(checks.iter().all(|c| !matches!(c.verdict, Verdict::Fail(_))), "{checks:?}");
        assert!(matches!(checks[1].verdict, Verdict::Skip(_)));
    }

    #[test]
    fn test_parsers() {
        assert_eq!(count_cpu_list("0-3,5,7-8\n"), Some(7));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("x"), None);
        assert_eq!(kernel_ram_kib(GOOD_LOG), Some(1048040));
        assert_eq!(kernel_ram_kib("nothing here"), None);
    }
}
