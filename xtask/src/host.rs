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

/// Set to 1 to let apt remove installed packages to make room for what gdrvm needs (CI's
/// throwaway machines set it).
const MAY_REMOVE: &str = "GDRVM_APT_MAY_REMOVE";

fn install_missing(missing: Vec<&str>) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("missing Debian packages {}: run `sudo apt-get install {}`", missing.join(", "), missing.join(" "));
    }
    // apt may remove installed packages to satisfy dependencies (bookworm's
    // qemu-system-x86 takes out a backported qemu-utils). It says so in one line among
    // many, so gdrvm asks first and removes nothing unless told it may.
    let may_remove = std::env::var(MAY_REMOVE).is_ok_and(|v| v == "1");
    let removals = match apt_removals(&missing) {
        Some(r) => r,
        None => {
            let _ = Command::new("apt-get").args(["update", "-q"]).status();
            apt_removals(&missing).unwrap_or_default()
        }
    };
    if !removals.is_empty() {
        if !may_remove {
            bail!(
                "installing Debian packages {} would make apt remove {}: run `sudo apt-get install {}` yourself if that is fine, or set {MAY_REMOVE}=1",
                missing.join(", "),
                removals.join(", "),
                missing.join(" ")
            );
        }
        println!("xtask: apt removes {} to install {} ({MAY_REMOVE}=1)", removals.join(", "), missing.join(", "));
    }
    println!("xtask: installing Debian packages: {}", missing.join(" "));
    let install = |pkgs: &[&str]| {
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args((!may_remove).then_some("--no-remove"))
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

/// The installed packages apt would remove to install `packages` (a simulated install),
/// or `None` when apt cannot plan it (lists too old to know a package).
fn apt_removals(packages: &[&str]) -> Option<Vec<String>> {
    let out = Command::new("apt-get")
        .args(["install", "-s", "-q", "--no-install-recommends"])
        .args(packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .ok()?;
    out.status.success().then(|| removed_by(&String::from_utf8_lossy(&out.stdout)))
}

/// The packages a simulated apt run removes (its `Remv NAME [VERSION]` lines).
fn removed_by(simulation: &str) -> Vec<String> {
    simulation
        .lines()
        .filter_map(|l| l.strip_prefix("Remv "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_removed_by_reads_apt_simulation() {
        let sim = "NOTE: This is only a simulation!\nRemv qemu-utils [1:10.0.2+ds-1~bpo12+1]\n\
                   Inst qemu-system-x86 (1:7.2+dfsg-7+deb12u18+b3 Debian:12.15/oldstable [amd64])\n\
                   Conf qemu-system-x86 (1:7.2+dfsg-7+deb12u18+b3 Debian:12.15/oldstable [amd64])\n";
        assert_eq!(removed_by(sim), ["qemu-utils"]);
        assert!(removed_by("Inst qemu-utils (1:7.2 Debian [amd64])\n").is_empty());
    }
}
