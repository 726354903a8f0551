//! The host side of gdrvm runs, shared by `cargo xtask` and the end-to-end tests: where
//! the artifacts are, whether this host's KVM can boot a stock kernel (else run one level
//! down, under QEMU TCG), running VMs with console streaming and timeouts, and reading
//! their KTAP into results, JUnit XML and `git bisect run` exit codes.

mod artifacts;
pub mod junit;
pub mod ktap;
mod l1;
mod nested;
pub mod oops;
mod probe;
mod process;
mod result;
mod runner;
mod spec;
mod steal;

pub use artifacts::{gdrvm_dir, Artifacts, ArtifactsError, BootImage, LayeredImage};
pub use nested::{L1Config, TcgThreads, L1_CPU};
pub use probe::{choose, RunnerChoice};
pub use result::{exit, GdrvmStats, L1Failure, L1Incident, VmOutcome, VmResult, TAIL_LINES};
pub use runner::{HarnessError, Runner, RunnerKind};
pub use spec::{ClusterSpec, QemuMachine, VmSpec, Vmm};
pub use steal::host_cpus;
