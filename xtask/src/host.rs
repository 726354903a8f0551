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
