//! Bad input gives one clear error and a `git bisect run` status (2 usage, 125 cannot
//! test), never a panic or a hang. These run the real gdrvm binary and image builder; none
//! needs a working KVM, since every input is checked before KVM is touched.

use std::process::Command;
use std::time::{Duration, Instant};

use gdrvm_e2e::{artifacts, skip};
use gdrvm_images::{Cache, ImageError, Package};

fn gdrvm(args: &[&str]) -> Option<(i32, String)> {
    let a = match artifacts() {
        Ok(a) => a,
        Err(why) => {
            skip("bad_input", &why);
            return None;
        }
    };
    let started = Instant::now();
    let out = Command::new(&a.gdrvm).arg("run").args(args).output().expect("gdrvm runs");
    assert!(started.elapsed() < Duration::from_secs(20), "gdrvm took {:?} to reject bad input", started.elapsed());
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    Some((out.status.code().unwrap_or(-1), stderr))
}

fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.contains("error")).collect()
}

#[test]
fn test_wrong_kernel_path() {
    let Some((code, err)) = gdrvm(&["--kernel", "/no/such/vmlinux"]) else { return };
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        error_lines(&err),
        ["gdrvm: error: kernel '/no/such/vmlinux' cannot be read: No such file or directory (os error 2)"]
    );
}

#[test]
fn test_memory_too_small() {
    let Ok(a) = artifacts() else { return skip("test_memory_too_small", "no artifacts") };
    let kernel = a.guest.kernel.display().to_string();
    let Some((code, err)) = gdrvm(&["--kernel", &kernel, "--memory", "1M"]) else { return };
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        error_lines(&err),
        ["gdrvm: error: memory 1048576 bytes is out of range: a guest needs at least 64 MiB and at most 1 TiB"]
    );
    let Some((code, err)) = gdrvm(&["--kernel", &kernel, "--memory", "lots"]) else { return };
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("invalid size 'lots'"), "{err}");
}

#[test]
fn test_corrupt_initramfs() {
    let Ok(a) = artifacts() else { return skip("test_corrupt_initramfs", "no artifacts") };
    let dir = tempfile::tempdir().unwrap();
    let good = std::fs::read(&a.guest.initrd).unwrap();
    let cut = dir.path().join("cut.cpio");
    std::fs::write(&cut, &good[..good.len() / 3]).unwrap();
    let junk = dir.path().join("junk.img");
    std::fs::write(&junk, b"\x00\x01\x02 definitely not cpio").unwrap();
    let kernel = a.guest.kernel.display().to_string();
    for (path, says) in [(&cut, "is a corrupt cpio archive"), (&junk, "is not a cpio archive or a compressed one")] {
        let Some((code, err)) = gdrvm(&["--kernel", &kernel, "--initrd", &path.display().to_string()]) else { return };
        assert_eq!(code, 125, "{err}");
        let lines = error_lines(&err);
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].contains(says) && lines[0].contains(&path.display().to_string()), "{err}");
    }
}

#[test]
fn test_garbage_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let k = dir.path().join("vmlinux");
    std::fs::write(&k, vec![0x90u8; 4096]).unwrap();
    let Some((code, err)) = gdrvm(&["--kernel", &k.display().to_string()]) else { return };
    // Rejected by the loader after KVM is opened: 125, or 125 for a host without KVM.
    assert_eq!(code, 125, "{err}");
    assert_eq!(error_lines(&err).len(), 1, "{err}");
}

#[test]
fn test_bad_sha256_names_the_package() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(dir.path());
    let pin =
        Package { package: "busybox-static".into(), version: "1:1.35.0-4+deb12u1+b1".into(), sha256: "0".repeat(64) };
    match gdrvm_images::fetch(&pin, &cache, &|_| {}) {
        Err(ImageError::Checksum { package, expected, actual }) => {
            assert_eq!(package, "busybox-static=1:1.35.0-4+deb12u1+b1");
            assert_eq!(expected, "0".repeat(64));
            assert_eq!(actual, "3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744");
        }
        Err(ImageError::Download { package, .. }) => {
            skip(
                "test_bad_sha256_names_the_package",
                &format!("cannot download {package} (offline): the checksum path was not reached"),
            );
        }
        other => panic!("expected a checksum error, got {other:?}"),
    }
    // Nothing unverified is left in the cache.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("debs")).unwrap().collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn test_bad_node_file_names_file_key_and_reason() {
    let dir = tempfile::tempdir().expect("temp dir");
    let minimal = include_str!("../../../model/presets/minimal.toml");
    let cases = [
        ("syntax.toml", minimal.replacen("ports = 2", "ports = = 2", 1), "TOML: "),
        ("width.toml", minimal.replacen("link = \"16GT/s x16\"\nats", "link = \"16GT/s x3\"\nats", 1), "x3 is not"),
        ("numa.toml", minimal.replacen("numa = 0", "numa = 3", 1), "key host_bridge[0] (pxb0).numa: NUMA node 3"),
        (
            "bar.toml",
            minimal.replacen("{ size = \"16M\", bits = 32 }", "{ size = \"1G\", bits = 32 }", 1),
            "key endpoint[0] (gpu0).bars[0]: a BAR of 1G fits no window",
        ),
    ];
    for (name, text, want) in cases {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write node file");
        let node = path.to_string_lossy().into_owned();
        let Some((code, err)) = gdrvm(&["--kernel", "/no/such/vmlinux", "--node", &node]) else { return };
        assert_eq!(code, 2, "{name}: {err}");
        let lines = error_lines(&err);
        assert_eq!(lines.len(), 1, "{name}: {err}");
        assert!(lines[0].starts_with(&format!("gdrvm: error: {node}: ")) && lines[0].contains(want), "{name}: {err}");
    }
}
