//! Boots the real default guest and checks what Linux reported through the smoke suite.

use gdrvm_e2e::{guests, result, skip};
use gdrvm_harness::ktap::{CaseOutcome, KtapReport};
use gdrvm_harness::{exit, VmOutcome};

fn case<'a>(ktap: &'a KtapReport, suite: &str, name: &str) -> &'a gdrvm_harness::ktap::CaseResult {
    let s = ktap.suites.iter().find(|s| s.name == suite).unwrap_or_else(|| panic!("no suite {suite} in {ktap:?}"));
    s.cases.iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no check {name} in {suite}"))
}

fn dump(r: &gdrvm_harness::VmResult) -> String {
    format!("{:?}: {:?}\n{}", r.outcome, r.problem(), r.tail().join("\n"))
}

#[test]
fn test_smoke_suite_passes_with_two_cpus_and_1g() {
    let r = match result(guests::SMOKE) {
        Ok(r) => r,
        Err(why) => return skip("test_smoke_suite_passes_with_two_cpus_and_1g", &why),
    };
    assert_eq!(r.outcome, VmOutcome::Exited(0), "{}", dump(&r));
    assert!(r.ktap.all_ok(), "{}", dump(&r));
    assert_eq!(r.exit_code(), exit::PASS);
    for check in ["kernel_release", "online_cpus", "memory", "kernel_log_clean", "mp_table", "modules_loaded"] {
        assert_eq!(case(&r.ktap, "smoke", check).outcome, CaseOutcome::Pass, "{check}: {}", dump(&r));
    }
    // What Linux reported, as the agent quotes it.
    assert_eq!(case(&r.ktap, "smoke", "kernel_release").diagnostics, ["release 6.1.0-57-amd64"]);
    assert_eq!(case(&r.ktap, "smoke", "online_cpus").diagnostics, ["2 CPUs online (0-1)"]);
    let mem = &case(&r.ktap, "smoke", "memory").diagnostics[0];
    assert!(mem.ends_with("of 1024 MiB configured (kernel's boot memory line)"), "{mem}");
    let seen: u64 = mem.split_whitespace().next().unwrap().parse().unwrap();
    assert!((973..=1024).contains(&seen), "{mem}");
}

#[test]
fn test_smoke_suite_passes_with_one_cpu_and_512m() {
    let r = match result(guests::SMOKE_SMALL) {
        Ok(r) => r,
        Err(why) => return skip("test_smoke_suite_passes_with_one_cpu_and_512m", &why),
    };
    assert!(r.ktap.all_ok(), "{}", dump(&r));
    assert_eq!(case(&r.ktap, "smoke", "online_cpus").diagnostics, ["1 CPUs online (0)"]);
    assert!(case(&r.ktap, "smoke", "memory").diagnostics[0].contains("of 512 MiB configured"));
}

#[test]
fn test_kernel_panic_is_detected_with_console_tail() {
    let r = match result(guests::NO_INIT) {
        Ok(r) => r,
        Err(why) => return skip("test_kernel_panic_is_detected_with_console_tail", &why),
    };
    assert!(r.panicked, "{}", dump(&r));
    // With panic=-1 the guest resets at once and gdrvm reports a reset without status.
    assert_eq!(r.outcome, VmOutcome::Exited(1), "{}", dump(&r));
    assert_eq!(r.exit_code(), exit::FAIL);
    let problem = r.problem().unwrap_or_default();
    assert!(problem.starts_with("the guest kernel panicked: Kernel panic - not syncing"), "{problem}");
    assert!(r.tail().iter().any(|l| l.contains("Kernel panic - not syncing")), "{}", dump(&r));
    assert!(r.ktap.suites.is_empty());
}
