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
    if let Some(layer) = left_out_layer(name, ctx) {
        let image = ctx.image.as_ref().map_or("", |i| i.name.as_str());
        let reason = format!(
            "image '{image}' was built without its recipe's layer '{layer}', which this suite needs \
             (`cargo xtask` boots each run with the layers its suites need)"
        );
        return SuiteReport { name: name.to_owned(), checks: vec![Check::new("image_layers", Verdict::Fail(reason))] };
    }
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

/// The layer of the image's recipe that suite `name` needs and the image was built
/// without, if any.
fn left_out_layer<'a>(name: &str, ctx: &'a Context) -> Option<&'a str> {
    let image = ctx.image.as_ref()?;
    image.left_out_layers.iter().find(|(_, suites)| suites.iter().any(|s| s == name)).map(|(l, _)| l.as_str())
}

#[cfg(test)]
mod tests {
    use gdrvm_model::ImageManifest;

    use super::*;

    fn ctx(left_out: &[(&str, &[&str])]) -> Context {
        Context {
            expect: None,
            image: Some(ImageManifest {
                name: "default.base".into(),
                kernel_release: "6.1.0-57-amd64".into(),
                modules: vec![],
                optional_modules: vec![],
                on_demand_modules: vec![],
                user_modules: vec![],
                left_out_layers: left_out
                    .iter()
                    .map(|(l, suites)| (l.to_string(), suites.iter().map(|s| s.to_string()).collect()))
                    .collect(),
            }),
            root: std::path::PathBuf::from("/nonexistent"),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        }
    }

    #[test]
    fn test_a_suite_whose_layer_the_image_lacks_fails_naming_it() {
        let c = ctx(&[("lspci", &["topology"]), ("rdma", &["rdma"])]);
        let report = run("topology", &c);
        assert_eq!(report.checks.len(), 1);
        let Verdict::Fail(why) = &report.checks[0].verdict else { panic!("{:?}", report.checks[0].verdict) };
        assert!(why.contains("'default.base'") && why.contains("layer 'lspci'"), "{why}");
        // A suite no left-out layer names goes on as usual.
        assert_eq!(run("no_such_suite", &c).checks[0].name, "suite_exists");
        assert_eq!(left_out_layer("rdma", &c), Some("rdma"));
        assert_eq!(left_out_layer("topology", &ctx(&[])), None);
    }
}
