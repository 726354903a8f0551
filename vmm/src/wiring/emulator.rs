//! Device emulators the VMM starts itself, for endpoints whose backing is `emulated-gpu` or
//! `emulated-nic`: `gdrvm-gpu-emu` or `gdrvm-nic-emu` from gdrvm's own directory, handed
//! one end of a socket pair (no socket file to leak or to wait for) and the node it reads
//! the endpoint from. The child dies with the VMM (`PR_SET_PDEATHSIG`); dropping an
//! [`Emulator`] closes its socket, which ends a healthy emulator, and kills one that does
//! not exit within [`STOP_GRACE`].

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gdrvm_model::node::{Backing, Node};

/// How long a stopped emulator gets to exit after its socket closed.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// The descriptor number the child finds its end of the socket pair at.
const CHILD_FD: i32 = 3;
/// Where to look for the emulators instead of gdrvm's own directory.
pub const EMU_DIR_ENV: &str = "GDRVM_EMU_DIR";

/// A running emulator process.
pub struct Emulator {
    child: Child,
    name: String,
    /// The VMM's end of the connection (a second handle), shut down on drop so that the
    /// emulator sees the VMM leave whoever still holds the device.
    socket: UnixStream,
}

/// The emulator binary for `backing`, if it names one.
pub fn program(backing: &Backing) -> Option<&'static str> {
    match backing {
        Backing::EmulatedGpu => Some("gdrvm-gpu-emu"),
        Backing::EmulatedNic => Some("gdrvm-nic-emu"),
        _ => None,
    }
}

/// Where the emulator binaries are: `$GDRVM_EMU_DIR`, or the directory gdrvm runs from.
fn emulator_dir() -> Option<PathBuf> {
    std::env::var_os(EMU_DIR_ENV)
        .map(PathBuf::from)
        .or_else(|| std::env::current_exe().ok().and_then(|exe| exe.parent().map(PathBuf::from)))
}

impl Emulator {
    /// Starts the emulator of function `i` of `node` and returns it with the VMM's end of
    /// its vfio-user connection.
    pub fn start(node: &Node, i: usize) -> Result<(Emulator, UnixStream), String> {
        let dir = emulator_dir().ok_or("cannot tell where gdrvm runs from to find its emulators")?;
        Emulator::start_in(&dir, node, i)
    }

    /// As [`Emulator::start`], with the emulator binaries in `dir`.
    fn start_in(dir: &std::path::Path, node: &Node, i: usize) -> Result<(Emulator, UnixStream), String> {
        let f = &node.functions[i];
        let program = program(&f.backing).ok_or_else(|| format!("backing {} has no emulator", f.backing))?;
        let path = dir.join(program);
        if !path.is_file() {
            return Err(format!(
                "{} does not exist: build the emulators (cargo build -p gdrvm-devices) or point {EMU_DIR_ENV} at them",
                path.display()
            ));
        }
        let (ours, theirs) = UnixStream::pair().map_err(|e| format!("socket pair for {program}: {e}"))?;
        let theirs = OwnedFd::from(theirs);
        let raw = theirs.as_raw_fd();
        let vmm = std::process::id() as libc::pid_t;
        let mut command = Command::new(&path);
        command.args(["--fd", &CHILD_FD.to_string(), "--node", &node.source, "--function", &f.name]);
        command.args(&f.emulator_args);
        // Its own process group: Ctrl-C (SIGINT to the terminal's foreground group) and
        // group kills (`timeout`, a CI runner) reach the VMM alone, which stops the guest,
        // tears the device down through this connection, then closes it, and the emulator
        // exits. In the VMM's group it died with it and the teardown failed (DMA unmaps,
        // resets) with errors. It still dies with the VMM (`PR_SET_PDEATHSIG` below).
        command.process_group(0);
        command.stdin(std::process::Stdio::null());
        // SAFETY: the closure runs in the child between fork and exec and calls only
        // async-signal-safe functions (dup2, fcntl, signal, prctl, getppid) on descriptors the
        // parent keeps open until `spawn` returns.
        unsafe {
            command.pre_exec(move || {
                if libc::dup2(raw, CHILD_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // dup2 onto the same number keeps close-on-exec: clear it.
                if raw == CHILD_FD && libc::fcntl(CHILD_FD, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // Out of the terminal's foreground group, a write to a `stty tostop`
                // terminal would stop the emulator: let it write.
                if libc::signal(libc::SIGTTOU, libc::SIG_IGN) == libc::SIG_ERR {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The VMM may have died before the death signal was armed.
                if libc::getppid() != vmm {
                    return Err(std::io::Error::other("the VMM exited"));
                }
                Ok(())
            });
        }
        let child = command.spawn().map_err(|e| format!("cannot start {}: {e}", path.display()))?;
        drop(theirs);
        tracing::debug!(function = f.key, pid = child.id(), "started {program}");
        let socket = ours.try_clone().map_err(|e| format!("socket pair for {program}: {e}"))?;
        Ok((Emulator { child, name: format!("{program} for {}", f.key), socket }, ours))
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        tracing::warn!("{} exited: {status}", self.name);
                    }
                    return;
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => break,
            }
        }
        tracing::warn!("{} did not exit within {STOP_GRACE:?} of its socket closing: killed", self.name);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_an_emulator_runs_in_its_own_process_group() {
        let node = Node::preset("minimal").unwrap().unwrap();
        let Some(gpu) = node.functions.iter().position(|f| f.backing == Backing::EmulatedGpu) else {
            panic!("minimal has an emulated GPU");
        };
        // The test binary lives in target/<profile>/deps; the emulators one level up.
        let dir = std::env::current_exe().ok().and_then(|exe| exe.parent()?.parent().map(PathBuf::from));
        let Some(dir) = dir.filter(|d| d.join("gdrvm-gpu-emu").is_file()) else {
            eprintln!("SKIP: gdrvm-gpu-emu is not built next to the tests (cargo build -p gdrvm-devices)");
            return;
        };
        let (emulator, _socket) = Emulator::start_in(&dir, &node, gpu).unwrap();
        let pid = emulator.child.id() as libc::pid_t;
        // SAFETY: getpgid reads the process table; no memory is passed.
        let (theirs, ours) = unsafe { (libc::getpgid(pid), libc::getpgid(0)) };
        assert_eq!(theirs, pid, "the emulator leads a process group of its own");
        assert_ne!(theirs, ours);
    }
}
