//! The kernels gdrvm tests: `images/kernels.lock` pins each Debian 12 kernel package
//! (`linux-image-<name>-amd64`: 6.1.0-N and 6.12.N+deb12) by version and sha256, so
//! `--kernel debian:<name>` builds the same image everywhere. `cargo xtask kernels update`
//! rewrites it from what the archive serves ([`update`]).

use std::cmp::Ordering;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::recipe::{KernelPackage, Package};
use crate::{Archive, ImageError, Progress};

/// The prefix of a kernel named by its Debian package (`debian:6.1.0-47`).
pub const DEBIAN_PREFIX: &str = "debian:";

/// One pinned kernel.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LockedKernel {
    /// The package name between `linux-image-` and `-amd64` (`6.1.0-47`, `6.12.117+deb12`).
    pub name: String,
    /// Exact version of the package.
    pub version: String,
    /// sha256 of the .deb.
    pub sha256: String,
}

impl LockedKernel {
    /// `linux-image-<name>-amd64`.
    pub fn package(&self) -> String {
        format!("linux-image-{}-amd64", self.name)
    }

    /// `debian:<name>`, as `--kernel` takes it.
    pub fn id(&self) -> String {
        format!("{DEBIAN_PREFIX}{}", self.name)
    }

    /// The pinned package as an image recipe's kernel (its release is `<name>-amd64`).
    pub fn kernel_package(&self) -> KernelPackage {
        KernelPackage {
            pin: Package { package: self.package(), version: self.version.clone(), sha256: self.sha256.clone() },
            release: format!("{}-amd64", self.name),
        }
    }
}

/// The lock file: every kernel the project tests, in version order.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KernelLock {
    /// The kernels, oldest first.
    #[serde(default, rename = "kernel")]
    pub kernels: Vec<LockedKernel>,
}

/// The lock file shipped in the repository.
pub fn lock_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels.lock")
}

const LOCK_HEADER: &str = "\
# Every Debian 12 kernel gdrvm tests, pinned: `--kernel debian:<name>` (on `cargo xtask boot`,
# `test --matrix`, `bisect`) builds an image with linux-image-<name>-amd64 at this version.
# Written by `cargo xtask kernels update` from what Debian's archive serves; oldest first.

";

impl KernelLock {
    /// Reads the lock file at `path`.
    pub fn load(path: &Path) -> Result<KernelLock, ImageError> {
        let bad = |reason: String| ImageError::Recipe { path: path.to_owned(), reason };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let lock: KernelLock = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        for k in &lock.kernels {
            if parse_name(&k.name).is_none() {
                return Err(bad(format!(
                    "kernel.name '{}' is not a Debian 12 kernel (6.1.0-N or 6.12.N+deb12)",
                    k.name
                )));
            }
        }
        Ok(lock)
    }

    /// The lock file's text.
    pub fn render(&self) -> String {
        LOCK_HEADER.to_owned() + &toml::to_string(self).unwrap_or_default()
    }

    /// The kernel `id` names: `debian:<name>` or the bare name.
    pub fn find(&self, id: &str) -> Result<&LockedKernel, ImageError> {
        let name = id.strip_prefix(DEBIAN_PREFIX).unwrap_or(id);
        self.kernels.iter().find(|k| k.name == name).ok_or_else(|| ImageError::UnknownKernel {
            kernel: id.to_owned(),
            known: self.kernels.iter().map(LockedKernel::id).collect(),
        })
    }
}

/// The numbers of a kernel name (`6.12.117+deb12` -> [6, 12, 117, 12]); `None` unless it
/// is a Debian 12 amd64 kernel flavour gdrvm boots (`6.1.0-N`, `6.12.N+deb12`).
fn parse_name(name: &str) -> Option<Vec<u64>> {
    let plain = name.strip_prefix("6.1.0-").is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    let bpo = name
        .strip_prefix("6.12.")
        .and_then(|n| n.strip_suffix("+deb12"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    if !plain && !bpo {
        return None;
    }
    name.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty()).map(|p| p.parse().ok()).collect()
}

/// Version order of kernel names (with or without `debian:`): 6.1.0-47 < 6.1.0-57 <
/// 6.12.100+deb12 < 6.12.117+deb12, numbers compared as numbers. Names that are not
/// Debian kernels sort after them, by text.
pub fn kernel_order(a: &str, b: &str) -> Ordering {
    let key = |s: &str| parse_name(s.strip_prefix(DEBIAN_PREFIX).unwrap_or(s));
    match (key(a), key(b)) {
        (Some(x), Some(y)) => x.cmp(&y),
        (Some(_), None) => Ordering::Less,
        (None, Some(_)) => Ordering::Greater,
        (None, None) => a.cmp(b),
    }
}

/// What [`update`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct LockChanges {
    /// Kernels new in the archive.
    pub added: Vec<String>,
    /// Kernels the archive no longer serves.
    pub removed: Vec<String>,
    /// Kernels whose version moved (`name: from -> to`).
    pub moved: Vec<String>,
}

/// Rewrites the lock file at `path` from the archive (its lists refreshed first, when this
/// process may): every `linux-image-<name>-amd64` it serves for Debian 12, at its newest
/// version, with the sha256 from the archive's index (nothing is downloaded).
pub fn update(path: &Path, archive: &Archive, progress: &Progress) -> Result<LockChanges, ImageError> {
    let old = if path.exists() { KernelLock::load(path)? } else { KernelLock::default() };
    if let Err(e) = archive.refresh(progress) {
        progress(&format!("using apt's lists as they are: {e}"));
    }
    let mut lock = KernelLock::default();
    for package in archive.package_names("linux-image-")? {
        let Some(name) = package.strip_prefix("linux-image-").and_then(|p| p.strip_suffix("-amd64")) else {
            continue;
        };
        if parse_name(name).is_none() {
            continue;
        }
        let Some(version) = archive.versions(&package)?.into_iter().next() else { continue };
        let Some(sha256) = archive.indexed_sha256(&package, &version)? else {
            progress(&format!("{package}={version}: no sha256 in apt's index; left out"));
            continue;
        };
        progress(&format!("{package}={version}"));
        lock.kernels.push(LockedKernel { name: name.to_owned(), version, sha256 });
    }
    if lock.kernels.is_empty() {
        return Err(ImageError::Tool {
            tool: "apt-cache",
            reason:
                "apt's lists have no Debian 12 kernel package (linux-image-6.1.0-N-amd64): run `sudo apt-get update`"
                    .into(),
        });
    }
    lock.kernels.sort_by(|a, b| kernel_order(&a.name, &b.name));
    let changes = changes(&old, &lock);
    std::fs::write(path, lock.render()).map_err(|e| ImageError::Io { path: path.to_owned(), source: e })?;
    Ok(changes)
}

fn changes(old: &KernelLock, new: &KernelLock) -> LockChanges {
    let mut c = LockChanges::default();
    for k in &new.kernels {
        match old.kernels.iter().find(|o| o.name == k.name) {
            None => c.added.push(k.id()),
            Some(o) if o.version != k.version => c.moved.push(format!("{}: {} -> {}", k.id(), o.version, k.version)),
            Some(_) => {}
        }
    }
    for o in &old.kernels {
        if !new.kernels.iter().any(|k| k.name == o.name) {
            c.removed.push(o.id());
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(name: &str, version: &str) -> LockedKernel {
        LockedKernel { name: name.into(), version: version.into(), sha256: "00".repeat(32) }
    }

    #[test]
    fn test_kernel_order_is_version_order() {
        let mut names: Vec<String> =
            ["6.12.117+deb12", "6.1.0-57", "6.12.100+deb12", "6.1.0-47", "6.1.0-9", "6.12.101+deb12"]
                .iter()
                .map(|n| format!("debian:{n}"))
                .collect();
        names.sort_by(|a, b| kernel_order(a, b));
        let want = ["6.1.0-9", "6.1.0-47", "6.1.0-57", "6.12.100+deb12", "6.12.101+deb12", "6.12.117+deb12"];
        assert_eq!(names, want.map(|n| format!("debian:{n}")));
        assert_eq!(kernel_order("6.1.0-47", "debian:6.1.0-47"), Ordering::Equal);
        assert_eq!(kernel_order("debian:6.1.0-57", "/boot/vmlinuz"), Ordering::Less);
    }

    #[test]
    fn test_only_debian12_amd64_kernels_are_names() {
        for good in ["6.1.0-47", "6.12.117+deb12"] {
            assert!(parse_name(good).is_some(), "{good}");
        }
        for bad in ["6.1.0-47-rt", "6.1.0-", "6.12.117", "6.12.x+deb12", "5.10.0-30", "6.1.0-47-cloud", ""] {
            assert!(parse_name(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn test_lock_round_trip_find_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kernels.lock");
        let lock = KernelLock { kernels: vec![k("6.1.0-47", "6.1.170-3"), k("6.12.117+deb12", "6.12.117-1~deb12u1")] };
        std::fs::write(&path, lock.render()).unwrap();
        let back = KernelLock::load(&path).unwrap();
        assert_eq!(back, lock);
        let found = back.find("debian:6.12.117+deb12").unwrap().kernel_package();
        assert_eq!(found.pin.package, "linux-image-6.12.117+deb12-amd64");
        assert_eq!(found.release, "6.12.117+deb12-amd64");
        assert_eq!(back.find("6.1.0-47").unwrap().version, "6.1.170-3");
        let err = back.find("debian:6.1.0-12").unwrap_err().to_string();
        assert!(err.contains("debian:6.1.0-12") && err.contains("debian:6.1.0-47"), "{err}");

        std::fs::write(&path, "[[kernel]]\nname = \"5.10.0-1\"\nversion = \"1\"\nsha256 = \"x\"\n").unwrap();
        let err = KernelLock::load(&path).unwrap_err().to_string();
        assert!(err.contains("kernels.lock") && err.contains("5.10.0-1"), "{err}");
        std::fs::write(&path, "[[kernel]]\nname = \"6.1.0-1\"\nversion = \"1\"\n").unwrap();
        let err = KernelLock::load(&path).unwrap_err().to_string();
        assert!(err.contains("sha256"), "{err}");
    }

    #[test]
    fn test_changes_name_added_removed_and_moved() {
        let old = KernelLock { kernels: vec![k("6.1.0-46", "1"), k("6.1.0-47", "1")] };
        let new = KernelLock { kernels: vec![k("6.1.0-47", "2"), k("6.1.0-48", "1")] };
        let c = changes(&old, &new);
        assert_eq!(c.added, ["debian:6.1.0-48"]);
        assert_eq!(c.removed, ["debian:6.1.0-46"]);
        assert_eq!(c.moved, ["debian:6.1.0-47: 1 -> 2"]);
    }

    /// The shipped lock file reads, is in version order, and pins the default recipe's kernel.
    #[test]
    fn test_shipped_lock_is_ordered_and_has_the_default_kernel() {
        let lock = KernelLock::load(&lock_path()).unwrap();
        assert!(lock.kernels.windows(2).all(|w| kernel_order(&w[0].name, &w[1].name) == Ordering::Less));
        let recipe = crate::Recipe::load(&crate::recipes_dir().join("default.toml")).unwrap();
        let name = recipe.kernel.release.strip_suffix("-amd64").unwrap();
        let locked = lock.find(name).unwrap();
        assert_eq!(locked.kernel_package(), recipe.kernel);
    }
}
