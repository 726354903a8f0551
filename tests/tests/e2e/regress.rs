//! Regression hunting end to end, through `cargo xtask` as a user runs it: `git bisect run`
//! over an out-of-tree driver's history, `cargo xtask bisect` over Debian kernels, and a
//! matrix of kernels and presets with JUnit a schema validator accepts. Each boots real
//! guests (nested here, in L1s of their own).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use gdrvm_e2e::{artifacts, skip};

/// The workspace root.
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_owned()
}

/// `cargo run -p xtask -- ...` as a command from anywhere: the `xtask` alias lives in the
/// workspace's .cargo/config.toml, which cargo reads only from inside the workspace.
fn xtask_command() -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let manifest = workspace().join("Cargo.toml");
    [cargo.as_str(), "run", "--quiet", "--manifest-path", &manifest.display().to_string(), "-p", "xtask", "--"]
        .map(String::from)
        .to_vec()
}

/// Runs `program args` in `dir`; returns its exit code and stdout+stderr, echoed.
fn run(dir: &Path, program: &str, args: &[String]) -> (i32, String) {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    eprintln!("{text}");
    (out.status.code().unwrap_or(-1), text)
}

fn xtask(dir: &Path, args: &[&str]) -> (i32, String) {
    let mut cmd = xtask_command();
    let program = cmd.remove(0);
    cmd.extend(args.iter().map(|a| a.to_string()));
    run(dir, &program, &cmd)
}

fn git(dir: &Path, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let (code, text) = run(dir, "git", &args);
    assert_eq!(code, 0, "git {args:?} failed: {text}");
    text
}

/// Whether what these tests run is here (the artifacts; git, make and a compiler, which
/// `cargo xtask test` installs); otherwise SKIP with the reason (a failure under
/// `cargo xtask test`).
fn ready(test: &str, tools: &[&str]) -> bool {
    if let Err(e) = artifacts() {
        skip(test, &e);
        return false;
    }
    for tool in tools {
        let found = Command::new("sh").args(["-c", &format!("command -v {tool}")]).output();
        if !found.is_ok_and(|o| o.status.success()) {
            skip(test, &format!("{tool} is not installed"));
            return false;
        }
    }
    true
}

/// These tests start L1s of their own through xtask. Under `cargo xtask test` they wait for
/// the shared batch of guests to finish and then run one at a time: on two cores, more
/// nested guests at once only make each slower and its timing-sensitive checks flakier.
fn exclusive() -> MutexGuard<'static, ()> {
    if std::env::var_os(gdrvm_e2e::REQUIRED_ENV).is_some() {
        // Its outcome is the batch's tests' business; only its end matters here.
        let _ = gdrvm_e2e::results();
    }
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The test driver: a PCI driver for minimal's gpu0 (10de:20b2) that says what it found.
/// `PROBE_BODY` is where the commits differ.
const DRIVER: &str = r#"// SPDX-License-Identifier: GPL-2.0
#include <linux/module.h>
#include <linux/pci.h>

static int attempt = -1;
module_param(attempt, int, 0444);
MODULE_PARM_DESC(attempt, "which boot of a repeated test this is");

static const struct pci_device_id ids[] = {
	{ PCI_DEVICE(0x10de, DEVICE_ID) },
	{ }
};
MODULE_DEVICE_TABLE(pci, ids);

static int probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	int err = pcim_enable_device(pdev);

	if (err)
		return err;
PROBE_BODY
	dev_info(&pdev->dev, "bar0 %llu bytes VERSION\n", (unsigned long long)pci_resource_len(pdev, 0));
	return 0;
}

static struct pci_driver drv = { .name = "gdrvm_drv", .id_table = ids, .probe = probe };
module_pci_driver(drv);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("gdrvm bisection test driver");
"#;

/// The probe's flake from commit 2 on: the first boot of a repeated test fails to probe
/// (the guest is told which boot it is), the others do not.
const FLAKE: &str = "\tif (attempt == 0) {\n\t\tdev_warn(&pdev->dev, \"flaky probe\\n\");\n\t\treturn -EAGAIN;\n\t}";

/// The eight commits: (message, device ID, probe body, compiles).
fn history() -> Vec<(&'static str, &'static str, &'static str, bool)> {
    vec![
        ("driver for gpu0", "0x20b2", "", true),
        ("probe is flaky on a first boot", "0x20b2", FLAKE, true),
        ("log wording", "0x20b2", FLAKE, true),
        ("comment", "0x20b2", FLAKE, true),
        ("the bug: a wrong device ID, the driver stops probing", "0x20b3", FLAKE, true),
        ("half-written change that does not compile", "0x20b3", FLAKE, false),
        ("finish the change", "0x20b3", FLAKE, true),
        ("version 1.1", "0x20b3", FLAKE, true),
    ]
}

/// Writes a git repository of the driver with [`history`]; returns the commit hashes.
fn driver_repo(dir: &Path) -> Vec<String> {
    git(dir, &["init", "-q", "-b", "main"]);
    git(dir, &["config", "user.email", "e2e@gdrvm.invalid"]);
    git(dir, &["config", "user.name", "gdrvm e2e"]);
    std::fs::write(dir.join("Kbuild"), "obj-m := gdrvm_drv.o\n").expect("Kbuild");
    let mut hashes = Vec::new();
    for (i, (message, device, body, compiles)) in history().into_iter().enumerate() {
        let mut source = DRIVER.replace("DEVICE_ID", device).replace("PROBE_BODY", body);
        source = source.replace("VERSION", &format!("(commit {})", i + 1));
        if !compiles {
            source = source.replace("return 0;\n}", "return 0\n}");
        }
        std::fs::write(dir.join("gdrvm_drv.c"), source).expect("driver source");
        git(dir, &["add", "-A"]);
        git(dir, &["commit", "-q", "-m", message]);
        hashes.push(git(dir, &["rev-parse", "HEAD"]).trim().to_owned());
    }
    hashes
}

/// `git bisect run` through gdrvm over eight commits of a driver: the fifth stops it
/// probing. The sixth does not compile (125: skipped; git's search reaches it after the
/// fourth proved good), and from the second on the driver fails its first boot, which
/// `--repeat 3` outvotes.
#[test]
fn test_git_bisect_run_names_the_commit_that_stops_the_driver_probing() {
    let test = "test_git_bisect_run_names_the_commit_that_stops_the_driver_probing";
    let _serial = exclusive();
    if !ready(test, &["git", "make", "gcc"]) {
        return;
    }
    let repo = tempfile::tempdir().expect("temp dir");
    let hashes = driver_repo(repo.path());
    git(repo.path(), &["bisect", "start", &hashes[7], &hashes[0]]);
    let mut args: Vec<String> = vec!["bisect".into(), "run".into()];
    args.extend(xtask_command());
    args.extend(
        ["boot", "--node", "minimal", "--module-src", ".", "--suite", "drivers", "--repeat", "3"].map(String::from),
    );
    args.extend(["--append".into(), "gdrvm_drv.attempt={attempt}".into()]);
    let (code, out) = run(repo.path(), "git", &args);
    let log = git(repo.path(), &["bisect", "log"]);
    git(repo.path(), &["bisect", "reset"]);
    assert_eq!(code, 0, "git bisect run failed");
    assert!(out.contains(&format!("{} is the first bad commit", hashes[4])), "not the fifth commit:\n{out}");
    assert!(log.contains(&format!("git bisect skip {}", hashes[5])), "the sixth commit was not skipped:\n{log}");
    assert!(out.contains("does not build against"), "no compiler's words for the third commit");
    assert!(
        out.contains("3 attempt(s): bad, good, good; the majority: good"),
        "no flaky first boot outvoted at a good commit:\n{out}"
    );
}

/// `cargo xtask bisect` over eight Debian kernels where a knob the topology suite detects
/// (`numa=off` on vela-a100: one NUMA node where the node file has two) turns on at the
/// sixth: it names the sixth in at most ceil(log2(8)) + 1 = 4 boots.
#[test]
fn test_bisect_over_kernels_finds_the_planted_knob_within_the_bound() {
    let test = "test_bisect_over_kernels_finds_the_planted_knob_within_the_bound";
    let _serial = exclusive();
    if !ready(test, &[]) {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let kernels: Vec<String> = (50..=57).map(|n| format!("debian:6.1.0-{n}")).collect();
    let mut file = String::from("# The kernels 6.1.0-50..57; from 6.1.0-55 on the guest boots with numa=off.\n");
    for (i, k) in kernels.iter().enumerate() {
        let append = if i >= 5 { "numa=off" } else { "" };
        file.push_str(&format!("[[candidate]]\nname = \"{k}\"\nkernel = \"{k}\"\nappend = \"{append}\"\n\n"));
    }
    let candidates = dir.path().join("candidates.toml");
    std::fs::write(&candidates, file).expect("candidates");
    let (code, out) = xtask(
        dir.path(),
        &[
            "bisect",
            "--candidates",
            &candidates.display().to_string(),
            "--good",
            &kernels[0],
            "--bad",
            &kernels[7],
            "--node",
            "vela-a100",
            "--suite",
            "topology",
            "--test",
            "topology.numa_nodes",
        ],
    );
    assert_eq!(code, 0, "bisect did not name a first bad candidate");
    assert!(out.contains("first bad: debian:6.1.0-55"), "not the sixth candidate:\n{out}");
    let boots = out
        .lines()
        .find_map(|l| l.strip_suffix(" boots)")?.rsplit(' ').next()?.parse::<usize>().ok())
        .expect("a boot count");
    assert!(boots <= 4, "{boots} boots for 8 candidates");
}

/// A matrix of two kernels (6.1, 6.12) x two presets, plus one deliberately broken cell
/// (vela-a100 with numa=off under topology): that cell fails alone, the summary says so,
/// and the JUnit validates against Jenkins' schema.
#[test]
fn test_matrix_of_two_kernels_and_two_presets_with_one_broken_cell() {
    let test = "test_matrix_of_two_kernels_and_two_presets_with_one_broken_cell";
    let _serial = exclusive();
    if !ready(test, &["xmllint"]) {
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let matrix = dir.path().join("m.toml");
    std::fs::write(
        &matrix,
        "name = \"e2e\"\n[axes]\nkernels = [\"debian:6.1.0-57\", \"debian:6.12.117+deb12\"]\n\
         nodes = [\"minimal\", \"vela-a100\"]\nsuites = [\"smoke\"]\n\n\
         [[include]]\nkernel = \"debian:6.1.0-57\"\nnode = \"vela-a100\"\nappend = \"numa=off\"\nsuites = \"topology\"\n",
    )
    .expect("matrix");
    let junit = dir.path().join("junit.xml");
    let (code, out) = xtask(
        dir.path(),
        &["test", "--matrix", &matrix.display().to_string(), "--junit", &junit.display().to_string()],
    );
    assert_eq!(code, 1, "a failing cell makes the matrix fail");
    let verdicts: Vec<&str> =
        out.lines().filter(|l| l.contains("xtask: matrix: cell ") && !l.ends_with("starting")).collect();
    assert_eq!(verdicts.len(), 5, "{out}");
    let failed: Vec<&&str> = verdicts.iter().filter(|l| !l.contains(": PASS (")).collect();
    assert_eq!(failed.len(), 1, "one cell fails, alone: {verdicts:#?}");
    assert!(failed[0].contains("vela-a100/topology+numa=off: FAIL"), "{}", failed[0]);
    for kernel in ["6.1.0-57", "6.12.117+deb12"] {
        for node in ["minimal", "vela-a100"] {
            assert!(verdicts.iter().any(|l| l.contains(&format!("{kernel}/{node}/smoke: PASS"))), "{kernel} {node}");
        }
    }
    let schema = workspace().join("tests/fixtures/jenkins-junit.xsd");
    let (valid, why) = run(
        dir.path(),
        "xmllint",
        &["--noout".into(), "--schema".into(), schema.display().to_string(), junit.display().to_string()],
    );
    assert_eq!(valid, 0, "the JUnit does not validate: {why}");
    let xml = std::fs::read_to_string(&junit).expect("junit");
    assert_eq!(xml.matches("<testsuite ").count(), 5, "one testsuite per cell");
    assert!(xml.contains("failures=\"") && xml.contains("numa_nodes"), "{xml}");
}
