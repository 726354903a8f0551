//! The files a run needs, as `cargo xtask` builds them under `target/gdrvm/`.

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
    /// The default guest image (the agent as /init).
    pub guest: BootImage,
    /// The L1 image for nested runs (kvm modules, the agent as /init, gdrvm).
    pub l1: BootImage,
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
        for f in [&a.gdrvm, &a.guest.kernel, &a.guest.initrd, &a.l1.kernel, &a.l1.initrd] {
            if !f.exists() {
                return Err(ArtifactsError::Corrupt {
                    path: path.clone(),
                    reason: format!("{} is missing; rebuild", f.display()),
                });
            }
        }
        Ok(a)
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
