//! Choosing native or nested: a real boot of the default guest on this host's KVM, with a
//! deadline, remembered for the rest of the host's uptime. (kvm_pvm, for one, opens and
//! creates VMs fine, then spins or fails emulating a stock kernel: only a boot tells.)

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::artifacts::{gdrvm_dir, Artifacts};
use crate::result::VmOutcome;
use crate::runner::{Runner, RunnerKind};
use crate::spec::{VmSpec, Vmm};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunnerChoice {
    /// Probe this host.
    Auto,
    /// Force one kind.
    Force(RunnerKind),
}

/// How long a stock kernel may take to reach the agent on a usable KVM (it takes 1-3 s).
const PROBE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Serialize, Deserialize)]
struct ProbeRecord {
    boot_id: String,
    native_ok: bool,
    detail: String,
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default().trim().to_owned()
}

fn kvm_usable() -> Result<(), String> {
    std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").map(drop).map_err(|e| format!("/dev/kvm: {e}"))
}

/// Picks the runner; the string says why, for the log.
pub async fn choose(choice: RunnerChoice, artifacts: &Artifacts) -> (RunnerKind, String) {
    if let RunnerChoice::Force(kind) = choice {
        return (kind, "chosen with --runner".into());
    }
    if let Err(e) = kvm_usable() {
        return (RunnerKind::Nested, format!("no usable KVM ({e}): running nested under QEMU TCG"));
    }
    let path = gdrvm_dir().join("kvm-probe.json");
    let id = boot_id();
    if let Some(rec) = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<ProbeRecord>(&b).ok()) {
        if rec.boot_id == id {
            return (kind_of(rec.native_ok), format!("{} (probed earlier this boot)", rec.detail));
        }
    }
    let (native_ok, detail) = probe(artifacts).await;
    let rec = ProbeRecord { boot_id: id, native_ok, detail: detail.clone() };
    if let Ok(bytes) = serde_json::to_vec(&rec) {
        let _ = std::fs::write(&path, bytes);
    }
    (kind_of(native_ok), detail)
}

fn kind_of(native_ok: bool) -> RunnerKind {
    if native_ok {
        RunnerKind::Native
    } else {
        RunnerKind::Nested
    }
}

async fn probe(artifacts: &Artifacts) -> (bool, String) {
    let runner = Runner::new(RunnerKind::Native, artifacts.clone());
    let cmdline = "console=ttyS0 quiet panic=-1 gdrvm.suites=";
    let spec = VmSpec {
        name: "kvm-probe".into(),
        vmm: Vmm::Gdrvm,
        image: artifacts.guest_for(cmdline),
        node: None,
        cluster: None,
        cmdline: cmdline.into(),
        cpus: 1,
        memory: "256M".into(),
        timeout: PROBE_TIMEOUT,
    };
    match runner.run(std::slice::from_ref(&spec)).await {
        Ok(results) => match results.first() {
            Some(r) if r.outcome == VmOutcome::Exited(0) && r.ktap.complete() => {
                (true, format!("this host's KVM booted a stock kernel in {:.1?}: running natively", r.elapsed))
            }
            Some(r) => (
                false,
                format!(
                    "this host's KVM cannot boot a stock kernel ({}): running nested under QEMU TCG",
                    r.problem().unwrap_or_default()
                ),
            ),
            None => (false, "the KVM probe produced nothing: running nested".into()),
        },
        Err(e) => (false, format!("the KVM probe could not run ({e}): running nested")),
    }
}
