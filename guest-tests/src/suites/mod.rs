//! Test suites the agent runs, by name.

mod barbench;
mod capture;
mod chaos;
mod drivers;
mod gdr;
mod gpu;
mod host;
mod lspci;
mod pci;
mod profile;
pub(crate) mod rdma;
mod smoke;
mod topology;
mod vfio;
mod virtio;

use crate::context::Context;
use crate::ktap::{Check, SuiteReport, Verdict};

/// Names of every suite, in the order `all` runs them.
pub const SUITES: &[&str] = &[
    "smoke", "topology", "capture", "drivers", "vfio", "barbench", "gdr", "rdma", "gpu", "host", "chaos", "virtio",
    "profile",
];

/// What `run all` runs: the suites that only read. `vfio` drives devices (brings NICs up,
/// sends frames, starts DMA) and runs only when named, on a node made for it; so does `gdr`,
/// which drives the emulated GPUs and NICs (bus mastering, DMA into their BARs).
/// `rdma` configures the NICs, creates soft-RoCE devices and talks to the other nodes of a
/// cluster; it runs only when named.
/// `gpu` copies between host and GPUs and between GPUs (through `gdrvm-gpu`, which loads
/// libcuda) and runs when named.
/// `chaos` scribbles over every PCI function on purpose and runs only when named, last;
/// `virtio` takes each virtio-net NIC from the kernel and feeds it malformed descriptors.
/// `drivers` checks the user's out-of-tree modules and runs when named; so does `capture`,
/// which prints the node file `gdrvm topology capture` makes of the machine.
/// `host` checks a bare-metal host's IOMMU groups, ATS on VFs, port ACS and links; runs when named.
/// `profile` prints where the boot went (kernel log milestones, initcalls, silences) for
/// `cargo xtask bench boot --profile`; runs when named.
pub const ALL: &[&str] = &["smoke", "topology"];

/// Runs the suite called `name`.
pub fn run(name: &str, ctx: &Context) -> SuiteReport {
    let checks = match name {
        "smoke" => smoke::run(ctx),
        "topology" => topology::run(ctx),
        "drivers" => drivers::run(ctx),
        "capture" => capture::run(ctx),
        "vfio" => vfio::run(ctx),
        "barbench" => barbench::run(ctx),
        "gdr" => gdr::run(ctx),
        "rdma" => rdma::run(ctx),
        "gpu" => gpu::run(ctx),
        "host" => host::run(ctx),
        "chaos" => chaos::run(ctx),
        "virtio" => virtio::run(ctx),
        "profile" => profile::run(ctx),
        other => vec![Check::new(
            "suite_exists",
            Verdict::Fail(format!("no suite named '{other}' (known: {})", SUITES.join(", "))),
        )],
    };
    SuiteReport { name: name.to_owned(), checks }
}
