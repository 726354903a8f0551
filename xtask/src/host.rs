//! What the host needs installed, installed when possible (Debian packages, as root) and
//! otherwise named in one clear line.

use std::process::Command;

use anyhow::{bail, Result};

fn have(cmd: &str) -> bool {
    Command::new("sh").args(["-c", &format!("command -v {cmd} >/dev/null 2>&1")]).status().is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Makes sure each `(command, debian package)` is there, installing missing packages with
/// apt-get when running as root.
pub fn require_commands(needs: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&str> = needs.iter().filter(|(cmd, _)| !have(cmd)).map(|(_, pkg)| *pkg).collect();
    install_missing(missing)
}

/// Installs the Debian packages of `packages` that are not installed (build dependencies
/// with no command to look for: -dev packages), or says how to.
pub fn require_packages(packages: &[&str]) -> Result<()> {
    let installed = |pkg: &str| {
        Command::new("dpkg-query")
            .args(["-W", "-f=${Status}", pkg])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).ends_with("install ok installed"))
    };
    install_missing(packages.iter().copied().filter(|p| !installed(p)).collect())
}

fn install_missing(missing: Vec<&str>) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("missing Debian packages {}: run `sudo apt-get install {}`", missing.join(", "), missing.join(" "));
    }
    println!("xtask: installing Debian packages: {}", missing.join(" "));
    let install = |pkgs: &[&str]| {
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(pkgs)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|s| s.success())
    };
    if !install(&missing) {
        let _ = Command::new("apt-get").args(["update", "-q"]).status();
        if !install(&missing) {
            bail!("cannot install Debian packages {} (apt-get failed; offline?)", missing.join(", "));
        }
    }
    Ok(())
}
