//! The files a run needs, as `cargo xtask` builds them under `target/gdrvm/`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// A kernel and its initramfs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootImage {
    /// vmlinux (PVH) or bzImage.
    pub kernel: PathBuf,
    /// cpio initramfs.
    pub initrd: PathBuf,
}

/// Everything built for runs on this checkout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Artifacts {
    /// The gdrvm binary (static, so it also runs inside L1).
    pub gdrvm: PathBuf,
    /// The default guest image (the agent as /init), with every layer of its recipe.
    pub guest: BootImage,
    /// The same image with some layers only (none, or one), for runs whose suites need
    /// no more ([`Artifacts::guest_for`]).
    #[serde(default)]
    pub guest_layered: Vec<LayeredImage>,
    /// For each suite that needs layers of the guest image's recipe, those layers.
    #[serde(default)]
    pub suite_layers: BTreeMap<String, Vec<String>>,
    /// The L1 image for nested runs (kvm modules, the agent as /init, gdrvm).
    pub l1: BootImage,
}

/// The guest image built with some of its recipe's layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayeredImage {
    /// The layers it has.
    pub layers: Vec<String>,
    /// The image.
    pub image: BootImage,
}

/// Errors finding artifacts.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactsError {
    /// Nothing was built yet.
    #[error("no gdrvm artifacts at {0}: run `cargo xtask image` (or `cargo xtask boot`/`test`, which build them)")]
    Missing(PathBuf),
    /// The index is unreadable.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The index file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// `target/gdrvm` of the workspace this crate is part of (or `$CARGO_TARGET_DIR/gdrvm`).
pub fn gdrvm_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".")).join("target"));
    target.join("gdrvm")
}

impl Artifacts {
    /// The index file's path.
    pub fn index_path() -> PathBuf {
        gdrvm_dir().join("artifacts.json")
    }

    /// Reads the index written by `cargo xtask`, checking that every file exists.
    pub fn locate() -> Result<Artifacts, ArtifactsError> {
        let path = Self::index_path();
        let bytes = std::fs::read(&path).map_err(|_| ArtifactsError::Missing(path.clone()))?;
        let a: Artifacts = serde_json::from_slice(&bytes)
            .map_err(|e| ArtifactsError::Corrupt { path: path.clone(), reason: e.to_string() })?;
        let layered = a.guest_layered.iter().map(|l| &l.image.initrd);
        for f in [&a.gdrvm, &a.guest.kernel, &a.guest.initrd, &a.l1.kernel, &a.l1.initrd].into_iter().chain(layered) {
            if !f.exists() {
                return Err(ArtifactsError::Corrupt {
                    path: path.clone(),
                    reason: format!("{} is missing; rebuild", f.display()),
                });
            }
        }
        Ok(a)
    }

    /// The guest image for a run with kernel command line `cmdline`: the one with the
    /// fewest layers that has every layer the agent's suites there need
    /// ([`gdrvm_model::cmdline_suites`]), else the one with all. A shell gets all: its
    /// user may want any tool.
    pub fn guest_for(&self, cmdline: &str) -> BootImage {
        if gdrvm_model::cmdline_shell(cmdline) {
            return self.guest.clone();
        }
        let suites = gdrvm_model::cmdline_suites(cmdline);
        let needed: Vec<&String> = suites.iter().filter_map(|s| self.suite_layers.get(s)).flatten().collect();
        self.guest_layered
            .iter()
            .filter(|l| needed.iter().all(|n| l.layers.contains(n)))
            .min_by_key(|l| l.layers.len())
            .map_or_else(|| self.guest.clone(), |l| l.image.clone())
    }

    /// Writes the index.
    pub fn save(&self) -> std::io::Result<()> {
        let path = Self::index_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(name: &str) -> BootImage {
        BootImage { kernel: PathBuf::from("/k"), initrd: PathBuf::from(name) }
    }

    #[test]
    fn test_guest_for_picks_the_smallest_image_with_the_suites_layers() {
        let layered = |layers: &[&str], name: &str| LayeredImage {
            layers: layers.iter().map(|l| l.to_string()).collect(),
            image: image(name),
        };
        let a = Artifacts {
            gdrvm: PathBuf::from("/gdrvm"),
            guest: image("all"),
            guest_layered: vec![layered(&["lspci"], "lspci"), layered(&[], "base"), layered(&["rdma"], "rdma")],
            suite_layers: [("topology", "lspci"), ("rdma", "rdma"), ("gpu", "gpu")]
                .iter()
                .map(|(s, l)| (s.to_string(), vec![l.to_string()]))
                .collect(),
            l1: image("l1"),
        };
        let initrd = |cmdline: &str| a.guest_for(cmdline).initrd.display().to_string();
        assert_eq!(initrd("quiet gdrvm.suites="), "base");
        assert_eq!(initrd("quiet"), "base", "no list: the agent's default, smoke");
        assert_eq!(initrd("gdrvm.suites=smoke,profile"), "base");
        assert_eq!(initrd("gdrvm.suites=smoke,topology"), "lspci");
        assert_eq!(initrd("gdrvm.suites=rdma"), "rdma");
        assert_eq!(initrd("gdrvm.suites=topology,rdma"), "all", "no image has both layers alone");
        assert_eq!(initrd("gdrvm.suites=gpu"), "all", "no image has that layer alone");
        assert_eq!(initrd("gdrvm.shell"), "all");
        let old = Artifacts { guest_layered: vec![], suite_layers: BTreeMap::new(), ..a.clone() };
        assert_eq!(old.guest_for("gdrvm.suites=").initrd, PathBuf::from("all"), "an index without layered images");
    }
}
