//! Nested runs: what the host asks of the agent running as L1's init, and the marker
//! lines the agent prints on the L1 console in reply.

use serde::{Deserialize, Serialize};

/// Where the L1 agent reads its jobs.
pub const JOBS_PATH: &str = "/l1/jobs.json";
/// Where the gdrvm binary sits in L1.
pub const GDRVM_PATH: &str = "/l1/gdrvm";
/// The directory of [`GDRVM_PATH`], where the device emulators sit beside it.
pub const L1_DIR: &str = "/l1";
/// The device emulators gdrvm starts for emulated endpoints, found next to gdrvm.
pub const EMULATORS: [&str; 2] = ["gdrvm-gpu-emu", "gdrvm-nic-emu"];
/// What L1's agent prints in a job's output for each process the job left running after
/// it ended (a device emulator that outlived its VMM), before killing it.
pub const LEFT_BEHIND: &str = "gdrvm-l1: left behind by the job:";
/// What L1's agent prints when processes it killed were still there seconds later: they
/// are stuck in L1's kernel (a vCPU thread in KVM_RUN on an L1 CPU that no longer comes
/// back from its guest), which no userspace bug causes; the job is lost to the emulator.
pub const SURVIVED_SIGKILL: &str = "gdrvm-l1: survived SIGKILL (stuck in L1's kernel):";
/// Prefix of every marker line.
pub const MARKER: &str = "@@gdrvm-l1 ";
/// Set in the environment of L1's jobs: a node with a `[nested]` table names L1's lab
/// devices by address, and only in that L1 are they what the node means.
pub const IN_L1_ENV: &str = "GDRVM_IN_L1";

/// One VM for L1 to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct L1Job {
    /// The VMM to start, as a path inside L1 ([`GDRVM_PATH`], or QEMU for comparisons).
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Seconds before L1 kills the job.
    pub timeout_secs: u64,
    /// Its guest boots L1's own kernel at its ELF entry, so it runs at L1's addresses:
    /// L1 names the guest's exit sites from its own `/proc/kallsyms`.
    #[serde(default)]
    pub guest_runs_l1_kernel: bool,
}

/// Everything L1 is asked to do in one boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct L1Jobs {
    /// Run one job with the console attached (a person at a shell).
    pub interactive: bool,
    /// L1's PCI functions to bind to vfio-pci before the jobs run.
    #[serde(default)]
    pub vfio_bind: Vec<String>,
    /// Jobs, run one after another.
    pub jobs: Vec<L1Job>,
}

/// A node's `[nested]` table: the machine L1 must be for the node's passed-through devices
/// to exist in it. With it, L1 is a q35 machine with a virtual IOMMU (QEMU's intel-iommu,
/// and L1's kernel booted with `intel_iommu=on`), the QEMU arguments given here add the
/// emulated devices, and L1 binds the listed functions to vfio-pci, so that gdrvm in L1
/// passes them to its guest with real VFIO. Which devices is data: any device QEMU emulates
/// can be passed through the same way.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct L1Lab {
    /// QEMU arguments for L1 (`-device`, `-netdev`, `-object` ...), in order.
    #[serde(default)]
    pub qemu_args: Vec<String>,
    /// L1's PCI addresses (as L1 numbers them) to bind to vfio-pci.
    #[serde(default)]
    pub vfio_bind: Vec<String>,
    /// Extra MiB of L1 RAM the devices need (memory backends of ivshmem and the like).
    #[serde(default)]
    pub extra_memory_mib: u64,
}

impl L1Lab {
    /// The `[nested]` table of node-file `text`, read without checking the rest of the
    /// node (the host running the harness does not have the devices the node names).
    pub fn of_node_text(text: &str) -> Result<Option<L1Lab>, String> {
        #[derive(Deserialize)]
        struct Only {
            nested: Option<L1Lab>,
        }
        toml::from_str::<Only>(text)
            .map(|o| o.nested)
            .map_err(|e| e.to_string().split_whitespace().collect::<Vec<_>>().join(" "))
    }
}

/// Prefix of a job's output line: `@@<n>|`.
pub fn job_output_prefix(job: usize) -> String {
    format!("@@{job}|")
}
