//! Test suites the agent runs, by name.

mod barbench;
mod chaos;
mod gdr;
mod lspci;
mod pci;
mod smoke;
mod topology;
mod vfio;

use crate::context::Context;
use crate::ktap::{Check, SuiteReport, Verdict};

/// Names of every suite, in the order `all` runs them.
pub const SUITES: &[&str] = &["smoke", "topology", "vfio", "barbench", "gdr", "chaos"];

/// What `run all` runs: the suites that only read. `vfio` drives devices (brings NICs up,
/// sends frames, starts DMA) and runs only when named, on a node made for it; so does `gdr`,
/// which drives the emulated GPUs and NICs (bus mastering, DMA into their BARs).
/// `chaos` scribbles over every PCI function on purpose and runs only when named, last.
pub const ALL: &[&str] = &["smoke", "topology"];

/// Runs the suite called `name`.
pub fn run(name: &str, ctx: &Context) -> SuiteReport {
    let checks = match name {
        "smoke" => smoke::run(ctx),
        "topology" => topology::run(ctx),
        "vfio" => vfio::run(ctx),
        "barbench" => barbench::run(ctx),
        "gdr" => gdr::run(ctx),
        "chaos" => chaos::run(ctx),
        other => vec![Check::new(
            "suite_exists",
            Verdict::Fail(format!("no suite named '{other}' (known: {})", SUITES.join(", "))),
        )],
    };
    SuiteReport { name: name.to_owned(), checks }
}
