//! Running VMs: natively (gdrvm on this host's KVM) or nested (gdrvm inside an L1 Linux that
//! QEMU TCG boots, on L1's KVM; see [`crate::nested`]). Both stream the guest console,
//! enforce timeouts and turn what happened into a [`VmResult`].

use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use gdrvm_model::kvm_exits::{KvmExits, DEBUGFS_KVM};
use tokio::process::Command;

use crate::artifacts::Artifacts;
use crate::nested::L1Config;
use crate::process::{exited, forward_lines, spawn, stop};
use crate::result::{exit, VmOutcome, VmResult};
use crate::spec::VmSpec;
use crate::steal::StealClock;

/// Errors that keep a run from producing results at all.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A program the run needs is missing.
    #[error("cannot start {program}: {reason}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        reason: String,
    },
    /// Preparing a nested run failed.
    #[error("cannot prepare the nested run: {0}")]
    Prepare(String),
}

/// How VMs are run on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum RunnerKind {
    /// gdrvm on this host's `/dev/kvm`.
    Native,
    /// gdrvm inside L1 (QEMU TCG, `-cpu max`, kvm_amd), on L1's `/dev/kvm`.
    Nested,
}

/// Runs VMs one way or the other.
pub struct Runner {
    /// Native or nested.
    pub kind: RunnerKind,
    /// What to run with.
    pub artifacts: Artifacts,
    /// Print console lines as they arrive.
    pub echo: bool,
    /// How L1 is made, for nested runs.
    pub l1: L1Config,
}

impl Runner {
    /// A runner of `kind` with `artifacts`, quiet, with the default L1.
    pub fn new(kind: RunnerKind, artifacts: Artifacts) -> Self {
        Runner { kind, artifacts, echo: false, l1: L1Config::default() }
    }

    /// Runs `specs` one after another (nested: in one L1 boot) and returns their results.
    pub async fn run(&self, specs: &[VmSpec]) -> Result<Vec<VmResult>, HarnessError> {
        match self.kind {
            RunnerKind::Native => {
                let mut results = Vec::new();
                for spec in specs {
                    results.push(self.run_native(spec).await?);
                }
                Ok(results)
            }
            RunnerKind::Nested => self.run_nested(specs).await,
        }
    }

    /// Runs one VM with this terminal attached to its console; returns gdrvm's status.
    pub async fn run_interactive(&self, spec: &VmSpec) -> Result<i32, HarnessError> {
        let status = match self.kind {
            RunnerKind::Native => {
                let files = (spec.image.kernel.as_path(), spec.image.initrd.as_path(), spec.node.as_deref());
                let (program, args) = spec.command_line(&self.artifacts.gdrvm, files, true);
                spawn(Command::new(&program).args(args), &program, &[])?.wait().await
            }
            RunnerKind::Nested => return self.run_interactive_nested(spec).await,
        };
        Ok(status.map(|s| s.code().unwrap_or(exit::FAIL)).unwrap_or(exit::CANNOT_TEST))
    }

    async fn run_native(&self, spec: &VmSpec) -> Result<VmResult, HarnessError> {
        let started = Instant::now();
        let steal = StealClock::now();
        let mut host_steal = None;
        let node = spec.cluster.as_ref().map(|c| c.cluster.as_str()).or(spec.node.as_deref());
        let files = (spec.image.kernel.as_path(), spec.image.initrd.as_path(), node);
        let (program, args) = spec.command_line(&self.artifacts.gdrvm, files, false);
        let mut cmd = Command::new(&program);
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn(&mut cmd, &program, &[])?;
        let mut time_to_ktap = None;
        let mut kvm_exits = None;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        forward_lines(child.stdout.take(), tx.clone());
        forward_lines(child.stderr.take(), tx);
        let mut console = Vec::new();
        let deadline = tokio::time::sleep(spec.timeout);
        tokio::pin!(deadline);
        let outcome = loop {
            tokio::select! {
                line = rx.recv() => match line {
                    Some(line) => {
                        if line == "KTAP version 1" && time_to_ktap.is_none() {
                            time_to_ktap = Some(started.elapsed());
                            host_steal = steal.and_then(|s| s.elapsed());
                            kvm_exits = child.id().and_then(|pid| {
                                KvmExits::read(Path::new(DEBUGFS_KVM), pid)
                                    .map_err(|e| tracing::debug!("{}: no exit counts: {e}", spec.name))
                                    .ok()
                            });
                        }
                        self.take_line(&mut console, line);
                    }
                    None => break exited(&mut child).await,
                },
                _ = &mut deadline => {
                    stop(&mut child).await;
                    break VmOutcome::TimedOut;
                }
            }
        };
        let mut result = VmResult::new(&spec.name, outcome, console, started.elapsed());
        result.time_to_ktap = time_to_ktap;
        result.host_steal = host_steal;
        result.kvm_exits = kvm_exits;
        Ok(result)
    }

    pub(crate) fn take_line(&self, console: &mut Vec<String>, line: String) {
        if self.echo {
            println!("{line}");
        }
        console.push(line);
    }
}
