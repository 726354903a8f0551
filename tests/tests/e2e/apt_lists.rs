//! The image step on a machine whose apt lists predate the pins: gdrvm refreshes them once
//! and goes on, and a version the archive no longer serves is named with the repin command.
//! apt runs with private state (`-o Dir::State::Lists=...`), so the host's lists are not
//! touched and the test behaves the same on a fresh machine and a warm one.

use gdrvm_e2e::skip_unsupported;
use gdrvm_images::{Archive, Cache, ImageError, Package, Recipe, REPIN_COMMAND};

/// The default recipe's busybox pin: small, and in the archive while the recipe is current.
fn busybox_pin() -> Package {
    let path = gdrvm_images::recipes_dir().join("default.toml");
    Recipe::load(&path).expect("default recipe").busybox
}

/// A cache whose apt lists are empty: as stale as lists can be.
fn stale() -> (tempfile::TempDir, Cache) {
    let dir = tempfile::tempdir().expect("temp dir");
    let archive = Archive::private(&dir.path().join("apt")).expect("private apt state");
    let cache = Cache::new(dir.path().join("cache")).with_archive(archive);
    (dir, cache)
}

fn have_apt() -> bool {
    std::process::Command::new("apt-get").arg("--version").output().is_ok_and(|o| o.status.success())
}

#[test]
fn test_stale_lists_are_refreshed_once_and_the_pin_downloads() {
    if !have_apt() {
        return skip_unsupported(
            "test_stale_lists_are_refreshed_once_and_the_pin_downloads",
            "apt-get is not installed",
        );
    }
    let (_dir, cache) = stale();
    let pin = busybox_pin();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = lines.clone();
    let progress = move |l: &str| seen.lock().unwrap().push(l.to_owned());
    let deb = gdrvm_images::fetch(&pin, &cache, &progress).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(gdrvm_images::sha256_file(&deb).unwrap(), pin.sha256);
    let lines = lines.lock().unwrap().clone();
    assert_eq!(lines.iter().filter(|l| l.contains("refreshing them (apt-get update)")).count(), 1, "{lines:?}");
}

#[test]
fn test_a_version_that_left_the_archive_names_the_repin_command() {
    if !have_apt() {
        return skip_unsupported(
            "test_a_version_that_left_the_archive_names_the_repin_command",
            "apt-get is not installed",
        );
    }
    let (_dir, cache) = stale();
    let pin = Package { version: "1:1.0-1".into(), ..busybox_pin() };
    match gdrvm_images::fetch(&pin, &cache, &|_| {}) {
        Err(e @ ImageError::LeftArchive { .. }) => {
            let text = e.to_string();
            assert!(text.contains("busybox-static=1:1.0-1") && text.contains(REPIN_COMMAND), "{text}");
            // The refreshed lists know the package, so the versions it has are named.
            let ImageError::LeftArchive { available, .. } = e else { unreachable!() };
            assert!(available.contains(&busybox_pin().version), "{available:?}");
        }
        other => panic!("expected LeftArchive, got {other:?}"),
    }
}
