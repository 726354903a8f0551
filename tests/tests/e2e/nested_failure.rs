//! A nested runner whose L1 cannot work reports the job as not run, with the reason, and
//! never as passed: L1 booted with an initramfs that is not one panics at once, is
//! restarted once, and the job ends "cannot test" carrying both failures.

use std::time::Duration;

use gdrvm_e2e::{artifacts, skip};
use gdrvm_harness::{exit, L1Failure, Runner, RunnerKind, VmOutcome, VmSpec, Vmm};

#[test]
fn test_broken_l1_image_ends_cannot_test_with_the_reason() {
    let test = "test_broken_l1_image_ends_cannot_test_with_the_reason";
    let mut a = match artifacts() {
        Ok(a) => a,
        Err(why) => return skip(test, &why),
    };
    if !std::path::Path::new("/usr/bin/qemu-system-x86_64").exists() {
        return skip(test, "qemu-system-x86_64 is not installed (Debian: qemu-system-x86)");
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let junk = dir.path().join("l1-junk.cpio");
    std::fs::write(&junk, vec![0x5a; 4096]).expect("write junk initramfs");
    a.l1.initrd = junk;
    let spec = VmSpec {
        name: "smoke-on-broken-l1".into(),
        vmm: Vmm::Gdrvm,
        image: a.guest_for("gdrvm.suites=smoke"),
        node: None,
        cluster: None,
        cmdline: "console=ttyS0 quiet panic=-1 gdrvm.suites=smoke".into(),
        cpus: 1,
        memory: "512M".into(),
        timeout: Duration::from_secs(60),
    };
    let runner = Runner::new(RunnerKind::Nested, a);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio");
    let results = rt.block_on(runner.run(std::slice::from_ref(&spec))).expect("the runner returns results");
    let r = &results[0];
    let dump = format!("{:?}\n{}", r.outcome, r.console.join("\n"));
    assert!(
        matches!(&r.outcome, VmOutcome::CannotRun(why) if why.contains("L1 did not get ready twice in a row")),
        "{dump}"
    );
    assert_eq!(r.exit_code(), exit::CANNOT_TEST, "{dump}");
    // Both boots are on record, each a kernel panic with the kernel's own words.
    assert_eq!(r.l1_incidents.len(), 2, "{dump}");
    for incident in &r.l1_incidents {
        assert_eq!(incident.failure, L1Failure::Panic, "{dump}");
        let oops = incident.oops.as_ref().expect("the panic's signature");
        assert!(oops.headline.starts_with("Kernel panic - not syncing"), "{oops:?}");
    }
}
