//! `capture`: `gdrvm topology capture` run on the machine the agent is on (a guest, or bare
//! metal). The node file it writes is printed line by line as diagnostics (`capture| `
//! prefixed), so that whoever booted the guest can compare it with the node it booted on
//! (the round-trip e2e test), and its notes (what node files cannot say) are listed.
//! With `gdrvm.record_sysfs` on the kernel command line it also prints the sysfs files it
//! read as a recording (`cargo xtask record-sysfs` turns that into a fixture).

use std::path::Path;

use gdrvm_model::capture::{capture, record, CaptureOptions};

use crate::context::Context;
use crate::ktap::{Check, Verdict};

/// Prefix of the diagnostic lines that carry the captured node file.
pub const LINE_PREFIX: &str = "capture| ";

pub fn run(ctx: &Context) -> Vec<Check> {
    let cmdline = std::fs::read_to_string(ctx.path("/proc/cmdline")).unwrap_or_default();
    let mut checks = vec![capture_loads(&ctx.root)];
    if cmdline.split_whitespace().any(|w| w == record::CMDLINE_FLAG) {
        checks.push(recording(&ctx.root));
    }
    checks
}

/// The sysfs files capture reads, one diagnostic line each.
fn recording(root: &Path) -> Check {
    match record::record(root) {
        Ok(entries) => entries
            .iter()
            .map(|r| format!("{}{}", record::LINE_PREFIX, r.line()))
            .fold(Check::new("sysfs_recorded", Verdict::Pass), Check::note),
        Err(e) => Check::new("sysfs_recorded", Verdict::Fail(format!("cannot record sysfs: {e}"))),
    }
}

/// Captures the tree under `root` and checks that the node loader takes the result.
fn capture_loads(root: &Path) -> Check {
    match capture(root, &CaptureOptions::default()) {
        Ok(c) => {
            let summary = format!(
                "{} NUMA node(s), {} PCI function(s), {} note(s)",
                c.node.numa.len(),
                c.node.functions.len(),
                c.notes.len()
            );
            let lines = c.toml.lines().map(|l| format!("{LINE_PREFIX}{l}"));
            std::iter::once(summary).chain(lines).fold(Check::new("capture_loads", Verdict::Pass), Check::note)
        }
        Err(e) => Check::new("capture_loads", Verdict::Fail(format!("capture failed: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_capture_of_an_empty_root_fails_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let check = capture_loads(dir.path());
        assert!(
            matches!(&check.verdict, Verdict::Fail(w) if w.contains(&dir.path().display().to_string())),
            "{check:?}"
        );
    }
}
