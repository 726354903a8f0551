//! Debian packages: download a pinned version with `apt-get download` (no root needed),
//! verify its sha256, unpack it with `dpkg-deb`. Everything lands in the cache once.
//!
//! A fresh machine's apt lists can predate the pins: when apt does not know a pinned
//! version, [`Archive`] refreshes the lists once (`apt-get update`, where it may write
//! them) and tries again; a version the refreshed lists still lack has left the archive,
//! and the error names the versions the archive has and the command that repins.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};

use sha2::{Digest, Sha256};

use crate::recipe::Package;
use crate::{ImageError, Progress};

/// The command that moves the recipes' pins to what the archive serves now.
pub const REPIN_COMMAND: &str = "cargo xtask repin";

/// How gdrvm reaches Debian's archive: apt as configured on this host, or with private
/// state (`-o Dir::State::Lists=...`) so that lists can be refreshed without root.
#[derive(Debug, Default)]
pub struct Archive {
    /// Extra `-o` options for apt-get and apt-cache.
    options: Vec<String>,
    /// Whether this process already refreshed the lists (once is enough).
    refreshed: AtomicBool,
}

impl Archive {
    /// apt as this host configures it.
    pub fn system() -> Self {
        Archive::default()
    }

    /// apt with its package lists and caches under `state` (created if missing).
    pub fn private(state: &Path) -> Result<Self, ImageError> {
        let lists = state.join("lists");
        let cache = state.join("cache");
        for d in [lists.join("partial"), cache.join("archives/partial")] {
            std::fs::create_dir_all(&d).map_err(|e| ImageError::Io { path: d.clone(), source: e })?;
        }
        Ok(Archive {
            options: vec![format!("Dir::State::Lists={}", lists.display()), format!("Dir::Cache={}", cache.display())],
            refreshed: AtomicBool::new(false),
        })
    }

    fn apt(&self, tool: &str) -> Command {
        let mut cmd = Command::new(tool);
        for o in &self.options {
            cmd.args(["-o", o]);
        }
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    fn run(&self, tool: &'static str, args: &[&str], dir: Option<&Path>) -> Result<Output, ImageError> {
        let mut cmd = self.apt(tool);
        cmd.args(args);
        if let Some(dir) = dir {
            cmd.current_dir(dir);
        }
        cmd.output().map_err(|e| ImageError::Tool { tool, reason: e.to_string() })
    }

    /// The directory apt keeps its package lists in.
    fn lists_dir(&self) -> PathBuf {
        let out = self.run("apt-config", &["shell", "D", "Dir::State::Lists/d"], None);
        let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
        // "D='/var/lib/apt/lists/'"
        let dir = text.trim().strip_prefix("D='").and_then(|s| s.strip_suffix('\'')).unwrap_or("/var/lib/apt/lists");
        PathBuf::from(dir)
    }

    /// Refreshes apt's lists (once per process), or says which command would.
    pub fn refresh(&self, progress: &Progress) -> Result<(), ImageError> {
        if self.refresh_once(progress)? {
            Ok(())
        } else {
            Err(ImageError::Tool {
                tool: "apt-get",
                reason: "cannot refresh apt's lists: run `sudo apt-get update`".into(),
            })
        }
    }

    /// Runs `apt-get update` once per process, if this process may write apt's lists.
    /// Returns false when it may not (the caller names the command to run).
    fn refresh_once(&self, progress: &Progress) -> Result<bool, ImageError> {
        if self.refreshed.load(Ordering::SeqCst) {
            return Ok(true);
        }
        if !writable(&self.lists_dir()) {
            return Ok(false);
        }
        progress("apt's package lists lack a pinned version; refreshing them (apt-get update)");
        let out = self.run("apt-get", &["update", "-q"], None)?;
        self.refreshed.store(true, Ordering::SeqCst);
        if !out.status.success() {
            return Err(ImageError::Tool {
                tool: "apt-get",
                reason: format!("apt-get update failed (offline?): {}", error_lines(&out)),
            });
        }
        Ok(true)
    }

    /// The versions of `package` the archive serves, newest first (`apt-cache madison`).
    pub fn versions(&self, package: &str) -> Result<Vec<String>, ImageError> {
        let out = self.run("apt-cache", &["madison", package], None)?;
        // "busybox-static | 1:1.35.0-4+deb12u1+b1 | http://... Packages"
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split('|').nth(1).map(|v| v.trim().to_owned()))
            .filter(|v| !v.is_empty())
            .collect())
    }

    /// The names of the packages the archive knows that start with `prefix`
    /// (`apt-cache pkgnames`), sorted.
    pub fn package_names(&self, prefix: &str) -> Result<Vec<String>, ImageError> {
        let out = self.run("apt-cache", &["pkgnames", prefix], None)?;
        let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect();
        names.sort();
        Ok(names)
    }

    /// The sha256 of `package` at `version` as the archive's index records it (`apt-cache
    /// show`), without downloading the .deb; `None` when the lists do not have it.
    pub fn indexed_sha256(&self, package: &str, version: &str) -> Result<Option<String>, ImageError> {
        self.indexed_field(package, version, "SHA256")
    }

    /// A field (`SHA256`, `Size`) of `package` at `version` in apt's index.
    fn indexed_field(&self, package: &str, version: &str, field: &str) -> Result<Option<String>, ImageError> {
        let out = self.run("apt-cache", &["show", &format!("{package}={version}")], None)?;
        let prefix = format!("{field}: ");
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .map(|s| s.trim().to_owned()))
    }

    /// Downloads `pin` into `dir` with `apt-get download`, refreshing stale lists once.
    fn download(&self, pin: &Package, dir: &Path, progress: &Progress) -> Result<PathBuf, ImageError> {
        let spec = format!("{}={}", pin.package, pin.version);
        let size = self.indexed_field(&pin.package, &pin.version, "Size")?.and_then(|s| s.parse::<u64>().ok());
        let size = size.map(|b| format!(", {:.1} MB", b as f64 / 1e6)).unwrap_or_default();
        progress(&format!("downloading {spec} (apt-get download{size})"));
        let mut out = self.run("apt-get", &["download", "-q", &spec], Some(dir))?;
        if !out.status.success() && not_in_lists(&out) {
            if !self.refresh_once(progress)? {
                return Err(ImageError::StaleLists { package: spec });
            }
            out = self.run("apt-get", &["download", "-q", &spec], Some(dir))?;
            if !out.status.success() && not_in_lists(&out) {
                return Err(ImageError::LeftArchive { package: spec, available: self.versions(&pin.package)? });
            }
        }
        if !out.status.success() {
            return Err(ImageError::Download { package: spec, reason: error_lines(&out) });
        }
        std::fs::read_dir(dir)
            .map_err(|e| ImageError::Io { path: dir.to_owned(), source: e })?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .ok_or_else(|| ImageError::Download {
                package: spec,
                reason: "apt-get reported success but wrote no .deb".into(),
            })
    }
}

/// apt's answer when its lists do not have a package or version.
fn not_in_lists(out: &Output) -> bool {
    let stderr = String::from_utf8_lossy(&out.stderr);
    ["Unable to locate package", "was not found", "Can't find a source to download"].iter().any(|m| stderr.contains(m))
}

/// apt's `E:` lines, or all of stderr when it printed none.
fn error_lines(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors = stderr.lines().filter(|l| l.starts_with("E:")).collect::<Vec<_>>().join("; ");
    if errors.is_empty() {
        stderr.trim().to_owned()
    } else {
        errors
    }
}

/// Whether this process may create files in `dir`.
fn writable(dir: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: `c` is a NUL-terminated path that lives across the call; access only reads it.
    unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
}

/// sha256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn deb_name(pin: &Package) -> String {
    format!("{}_{}.deb", pin.package, pin.version.replace(':', "%3a"))
}

/// Returns the verified .deb for `pin`, downloading it into `debs` when missing.
pub fn fetch(pin: &Package, debs: &Path, archive: &Archive, progress: &Progress) -> Result<PathBuf, ImageError> {
    fetch_checked(pin, debs, archive, progress, Some(&pin.sha256)).map(|(path, _)| path)
}

/// Downloads the .deb of `pin` whatever its hash (apt itself checks it against the
/// archive's signed index) and returns it with its sha256: for pinning a new version.
pub fn fetch_unpinned(
    pin: &Package,
    debs: &Path,
    archive: &Archive,
    progress: &Progress,
) -> Result<(PathBuf, String), ImageError> {
    fetch_checked(pin, debs, archive, progress, None)
}

fn fetch_checked(
    pin: &Package,
    debs: &Path,
    archive: &Archive,
    progress: &Progress,
    expected: Option<&str>,
) -> Result<(PathBuf, String), ImageError> {
    let target = debs.join(deb_name(pin));
    let io = |e: std::io::Error| ImageError::Io { path: target.clone(), source: e };
    if target.exists() {
        let actual = sha256_file(&target).map_err(io)?;
        if expected.is_none_or(|e| e == actual) {
            return Ok((target, actual));
        }
        progress(&format!("{}: cached file has the wrong sha256, downloading again", pin.package));
        std::fs::remove_file(&target).map_err(io)?;
    }
    let staging = debs.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&staging).map_err(io)?;
    let result = archive.download(pin, &staging, progress).and_then(|deb| {
        let actual = sha256_file(&deb).map_err(io)?;
        if let Some(expected) = expected.filter(|e| *e != actual) {
            return Err(ImageError::Checksum {
                package: format!("{}={}", pin.package, pin.version),
                expected: expected.to_owned(),
                actual,
            });
        }
        std::fs::rename(&deb, &target).map_err(io)?;
        Ok(actual)
    });
    let _ = std::fs::remove_dir_all(&staging);
    result.map(|sha| (target, sha))
}

/// Unpacks `deb` into `dir` once (`dpkg-deb -x`); later calls find it there.
pub fn unpack(deb: &Path, dir: &Path, progress: &Progress) -> Result<(), ImageError> {
    if dir.join(".unpacked").exists() {
        return Ok(());
    }
    let io = |e: std::io::Error| ImageError::Io { path: dir.to_owned(), source: e };
    let staging = dir.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(io)?;
    progress(&format!("unpacking {}", deb.file_name().unwrap_or_default().to_string_lossy()));
    let status = Command::new("dpkg-deb")
        .arg("-x")
        .arg(deb)
        .arg(&staging)
        .status()
        .map_err(|e| ImageError::Tool { tool: "dpkg-deb", reason: e.to_string() })?;
    if !status.success() {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(ImageError::Tool {
            tool: "dpkg-deb",
            reason: format!("unpacking {} failed ({status})", deb.display()),
        });
    }
    std::fs::write(staging.join(".unpacked"), b"").map_err(io)?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&staging, dir).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_sha256_and_deb_names() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(sha256_file(&p).unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        let pin = Package { package: "busybox-static".into(), version: "1:1.35.0-4".into(), sha256: String::new() };
        assert_eq!(deb_name(&pin), "busybox-static_1%3a1.35.0-4.deb");
    }

    #[test]
    fn test_cached_deb_with_bad_sha_is_not_trusted() {
        // A cached file whose hash does not match is removed and downloaded again; with a
        // package name apt cannot know the download fails with an error naming it.
        let dir = tempfile::tempdir().unwrap();
        let pin = Package { package: "gdrvm-no-such-package".into(), version: "1.0".into(), sha256: "0".repeat(64) };
        std::fs::write(dir.path().join(deb_name(&pin)), b"stale").unwrap();
        // Lists that count as already refreshed: no apt-get update, no network.
        let archive = Archive::private(dir.path()).unwrap();
        archive.refreshed.store(true, Ordering::SeqCst);
        let err = fetch(&pin, dir.path(), &archive, &|_| {}).unwrap_err().to_string();
        assert!(err.contains(REPIN_COMMAND), "{err}");
        assert!(err.contains("gdrvm-no-such-package=1.0"), "{err}");
        assert!(!dir.path().join(deb_name(&pin)).exists());
    }
}
