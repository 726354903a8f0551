//! Nested runs: what the host asks of the agent running as L1's init, and the marker
//! lines the agent prints on the L1 console in reply.

use serde::{Deserialize, Serialize};

/// Where the L1 agent reads its jobs.
pub const JOBS_PATH: &str = "/l1/jobs.json";
/// Where the gdrvm binary sits in L1.
pub const GDRVM_PATH: &str = "/l1/gdrvm";
/// Prefix of every marker line.
pub const MARKER: &str = "@@gdrvm-l1 ";

/// One VM for L1 to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct L1Job {
    /// The VMM to start, as a path inside L1 ([`GDRVM_PATH`], or QEMU for comparisons).
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Seconds before L1 kills the job.
    pub timeout_secs: u64,
}

/// Everything L1 is asked to do in one boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct L1Jobs {
    /// Run one job with the console attached (a person at a shell).
    pub interactive: bool,
    /// Jobs, run one after another.
    pub jobs: Vec<L1Job>,
}

/// Prefix of a job's output line: `@@<n>|`.
pub fn job_output_prefix(job: usize) -> String {
    format!("@@{job}|")
}
