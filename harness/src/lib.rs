//! The host side of gdrvm runs, shared by `cargo xtask` and the end-to-end tests: where
//! the artifacts are, whether this host's KVM can boot a stock kernel (else run one level
//! down, under QEMU TCG), running VMs with console streaming and timeouts, and reading
//! their KTAP into results, JUnit XML and `git bisect run` exit codes.

mod artifacts;
pub mod junit;
pub mod ktap;
mod l1;
mod probe;
mod runner;

pub use artifacts::{gdrvm_dir, Artifacts, ArtifactsError, BootImage};
pub use probe::{choose, RunnerChoice};
pub use runner::{
    exit, GdrvmStats, HarnessError, QemuMachine, Runner, RunnerKind, VmOutcome, VmResult, VmSpec, Vmm, TAIL_LINES,
};
