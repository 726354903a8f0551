//! Debian packages: download a pinned version with `apt-get download` (no root needed),
//! verify its sha256, unpack it with `dpkg-deb`. Everything lands in the cache once.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::recipe::Package;
use crate::{ImageError, Progress};

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
pub fn fetch(pin: &Package, debs: &Path, progress: &Progress) -> Result<PathBuf, ImageError> {
    let target = debs.join(deb_name(pin));
    let io = |e: std::io::Error| ImageError::Io { path: target.clone(), source: e };
    if target.exists() {
        let actual = sha256_file(&target).map_err(io)?;
        if actual == pin.sha256 {
            return Ok(target);
        }
        progress(&format!("{}: cached file has the wrong sha256, downloading again", pin.package));
        std::fs::remove_file(&target).map_err(io)?;
    }
    let staging = debs.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&staging).map_err(io)?;
    let result = download(pin, &staging, progress).and_then(|deb| {
        let actual = sha256_file(&deb).map_err(io)?;
        if actual != pin.sha256 {
            return Err(ImageError::Checksum {
                package: format!("{}={}", pin.package, pin.version),
                expected: pin.sha256.clone(),
                actual,
            });
        }
        std::fs::rename(&deb, &target).map_err(io)
    });
    let _ = std::fs::remove_dir_all(&staging);
    result.map(|()| target)
}

fn download(pin: &Package, dir: &Path, progress: &Progress) -> Result<PathBuf, ImageError> {
    let spec = format!("{}={}", pin.package, pin.version);
    progress(&format!("downloading {spec} (apt-get download)"));
    let out = Command::new("apt-get")
        .args(["download", "-q", &spec])
        .current_dir(dir)
        .output()
        .map_err(|e| ImageError::Tool { tool: "apt-get", reason: e.to_string() })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let reason = stderr.lines().filter(|l| l.starts_with("E:")).collect::<Vec<_>>().join("; ");
        return Err(ImageError::Download {
            package: spec,
            reason: if reason.is_empty() { stderr.trim().to_owned() } else { reason },
        });
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
        let err = fetch(&pin, dir.path(), &|_| {}).unwrap_err().to_string();
        assert!(err.contains("gdrvm-no-such-package=1.0"), "{err}");
        assert!(!dir.path().join(deb_name(&pin)).exists());
    }
}
