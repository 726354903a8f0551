//! Building what runs need: static gdrvm and agent binaries, the guest and L1 images, and
//! the artifact index the harness and end-to-end tests read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use gdrvm_harness::{gdrvm_dir, Artifacts, BootImage, LayeredImage};
use gdrvm_images::{Cache, Customization, ExtraFile, Layers, Recipe, Source};

/// The workspace root.
pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).to_owned()
}

const TARGET: &str = "x86_64-unknown-linux-gnu";

/// Builds gdrvm, its device emulators and the agent as static executables: the agent runs
/// as PID 1 in an initramfs with no libc, and gdrvm runs inside L1, which has none either.
/// The emulators land next to gdrvm, where it looks for them.
fn static_binaries() -> Result<(PathBuf, PathBuf)> {
    println!("xtask: building static gdrvm, its emulators and gdrvm-agent (release)");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(workspace())
        .args(["build", "--release", "--target", TARGET, "-p", "gdrvm", "-p", "gdrvm-devices", "-p", "gdrvm-agent"])
        .env("CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS", "-C target-feature=+crt-static")
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build of the static binaries failed");
    }
    let dir = target_dir().join(TARGET).join("release");
    Ok((dir.join("gdrvm"), dir.join("gdrvm-agent")))
}

/// Debian packages the `ibverbs` crate builds with (it compiles rdma-core's headers and
/// links libibverbs).
const VERBS_BUILD_PACKAGES: &[&str] =
    &["cmake", "pkg-config", "libnl-3-dev", "libnl-route-3-dev", "libclang-dev", "libibverbs-dev"];

/// Builds the agent's dynamically linked helpers: `gdrvm-verbs` for the `rdma` suite
/// (against libibverbs, whose providers are loaded at run time; the image carries Debian's
/// libibverbs and rxe provider) and `gdrvm-gpu` for the `gpu` suite (it opens the NVIDIA
/// driver's libcuda at run time and says so where there is none). Returns their paths.
fn dynamic_helpers() -> Result<(PathBuf, PathBuf)> {
    crate::host::require_packages(VERBS_BUILD_PACKAGES)?;
    println!("xtask: building gdrvm-verbs and gdrvm-gpu (release, dynamic: libibverbs, libcuda at run time)");
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .current_dir(workspace())
        .args(["build", "--release", "-p", "gdrvm-verbs", "-p", "gdrvm-gpu"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build of gdrvm-verbs and gdrvm-gpu failed");
    }
    let release = target_dir().join("release");
    Ok((release.join("gdrvm-verbs"), release.join("gdrvm-gpu")))
}

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace().join("target"))
}

/// The files the guest image adds to its recipe: the agent as /init, its verbs helper (in
/// the `rdma` layer) and its CUDA helper (in the `gpu` layer).
fn guest_extras(agent: PathBuf, verbs: PathBuf, gpu: PathBuf) -> [ExtraFile; 3] {
    let file = |guest_path: &str, host: PathBuf, layers: &[&str]| ExtraFile {
        guest_path: guest_path.into(),
        source: Source::Host(host),
        mode: 0o755,
        layers: layers.iter().map(|l| l.to_string()).collect(),
    };
    [
        file("/init", agent, &[]),
        file("/usr/bin/gdrvm-verbs", verbs, &["rdma"]),
        file("/usr/bin/gdrvm-gpu", gpu, &["gpu"]),
    ]
}

/// The guest image with another kernel or an out-of-tree module (see [`crate::kernel`]),
/// after [`artifacts`] built the binaries it carries, with the layers a run with kernel
/// command line `cmdline` needs.
pub fn custom_guest(opts: &crate::kernel::KernelOpts, cmdline: &str) -> Result<BootImage> {
    let agent = target_dir().join(TARGET).join("release").join("gdrvm-agent");
    let release = target_dir().join("release");
    let extras = guest_extras(agent, release.join("gdrvm-verbs"), release.join("gdrvm-gpu"));
    crate::kernel::guest_image(opts, &extras, cmdline)
}

/// Builds (or finds current) the image `recipe` describes with `extras` and `layers`.
fn image(recipe: &Recipe, extras: &[ExtraFile], layers: Layers, cache: &Cache) -> Result<BootImage> {
    let progress = |line: &str| println!("xtask: image: {line}");
    let name = layers.image_name(&recipe.name);
    let custom = Customization { extras: extras.to_vec(), layers, ..Customization::default() };
    let built = gdrvm_images::build_custom(recipe, &custom, &name, cache, &progress)?;
    let size = std::fs::metadata(&built.initramfs).map_or(0, |m| m.len());
    println!(
        "xtask: image {name}: {} ({:.1} MB, {})",
        built.initramfs.display(),
        size as f64 / 1e6,
        if built.rebuilt { "built" } else { "up to date" }
    );
    Ok(BootImage { kernel: built.vmlinux, initrd: built.initramfs })
}

/// Builds everything and writes the artifact index: the guest image with all its layers,
/// with none and with each alone; the L1 image.
pub fn artifacts() -> Result<Artifacts> {
    crate::host::require_commands(&[("apt-get", "apt"), ("dpkg-deb", "dpkg")])?;
    let (gdrvm, agent) = static_binaries()?;
    let cache = Cache::new(gdrvm_dir().join("cache"));
    let (verbs, gpu) = dynamic_helpers()?;
    let extras = guest_extras(agent, verbs, gpu);
    let recipe = Recipe::load(&gdrvm_images::recipes_dir().join("default.toml"))?;
    let guest = image(&recipe, &extras, Layers::All, &cache)?;
    let mut guest_layered = Vec::new();
    for layers in std::iter::once(Vec::new()).chain(recipe.layer.keys().map(|l| vec![l.clone()])) {
        let image = image(&recipe, &extras, Layers::Only(layers.clone()), &cache)?;
        guest_layered.push(LayeredImage { layers, image });
    }
    let mut suite_layers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, layer) in &recipe.layer {
        for suite in &layer.suites {
            suite_layers.entry(suite.clone()).or_default().push(name.clone());
        }
    }
    // L1 only runs VMMs: the agent is all it adds.
    let l1_recipe = Recipe::load(&gdrvm_images::recipes_dir().join("l1.toml"))?;
    let [init, ..] = extras;
    let l1 = image(&l1_recipe, &[init], Layers::All, &cache)?;
    let artifacts = Artifacts { gdrvm, guest, guest_layered, suite_layers, l1 };
    artifacts.save().context("writing the artifact index")?;
    Ok(artifacts)
}
