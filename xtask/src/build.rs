//! Building what runs need: static gdrvm and agent binaries, the guest and L1 images, and
//! the artifact index the harness and end-to-end tests read.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use gdrvm_harness::{gdrvm_dir, Artifacts, BootImage};
use gdrvm_images::{Cache, ExtraFile, Recipe, Source};

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

fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace().join("target"))
}

/// Builds everything and writes the artifact index.
pub fn artifacts() -> Result<Artifacts> {
    crate::host::require_commands(&[("apt-get", "apt"), ("dpkg-deb", "dpkg")])?;
    let (gdrvm, agent) = static_binaries()?;
    let cache = Cache::new(gdrvm_dir().join("cache"));
    let progress = |line: &str| println!("xtask: image: {line}");
    let init = ExtraFile { guest_path: "/init".into(), source: Source::Host(agent), mode: 0o755 };
    let mut images = Vec::new();
    for name in ["default", "l1"] {
        let path = gdrvm_images::recipes_dir().join(format!("{name}.toml"));
        let recipe = Recipe::load(&path)?;
        let built = gdrvm_images::build(&recipe, std::slice::from_ref(&init), &cache, &progress)?;
        println!(
            "xtask: image {name}: {} ({})",
            built.initramfs.display(),
            if built.rebuilt { "built" } else { "up to date" }
        );
        images.push(BootImage { kernel: built.vmlinux, initrd: built.initramfs });
    }
    let l1 = images.pop().context("no L1 image")?;
    let guest = images.pop().context("no guest image")?;
    let artifacts = Artifacts { gdrvm, guest, l1 };
    artifacts.save().context("writing the artifact index")?;
    Ok(artifacts)
}
