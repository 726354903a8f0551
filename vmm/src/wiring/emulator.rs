//! Device emulators the VMM starts itself, for endpoints whose backing is `emulated-gpu` or
//! `emulated-nic`: `gdrvm-gpu-emu` or `gdrvm-nic-emu` from gdrvm's own directory, each
//! endpoint handed one end of a socket pair (no socket file to leak or to wait for) and the
//! node it reads the endpoint from. One process serves every endpoint of a kind (a thread
//! each): starting a process is what costs, most of all nested, where ten of them took
//! 0.4 s of vela's setup. An endpoint with emulator arguments of its own (an injected
//! fault) gets a process of its own, so that its fault stays its own.
//!
//! The child dies with the VMM: its connections close, and it asks for `PR_SET_PDEATHSIG`
//! itself (`--die-with-parent`). Dropping an [`Emulator`] closes its
//! endpoint's connection; once every endpoint of a process has been dropped, a healthy
//! emulator has exited, and one that does not within [`STOP_GRACE`] is killed.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use gdrvm_model::node::{Backing, Node};

/// How long a stopped emulator gets to exit after its sockets closed.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// The lowest descriptor number the child's sockets are copied to (above the standard
/// streams); each is passed by its number (`--fd`).
const CHILD_FD: i32 = 3;
/// Held from making a child's inheritable socket copies until it is spawned: backings
/// open on threads of their own, and a process spawned meanwhile would inherit another
/// emulator's sockets and hold its connections open after that emulator died.
static SPAWNING: Mutex<()> = Mutex::new(());
/// Where to look for the emulators instead of gdrvm's own directory.
pub const EMU_DIR_ENV: &str = "GDRVM_EMU_DIR";

/// One endpoint's share of a running emulator process.
pub struct Emulator {
    /// Held for its drop: the last share stops the process.
    _process: Arc<Process>,
    /// The VMM's end of the endpoint's connection (a second handle), shut down on drop so
    /// that the emulator sees the VMM leave whoever still holds the device.
    socket: UnixStream,
}

/// An emulator process, stopped when the last endpoint it serves is dropped.
struct Process {
    child: Child,
    name: String,
}

/// The emulator binary for `backing`, if it names one.
pub fn program(backing: &Backing) -> Option<&'static str> {
    match backing {
        Backing::EmulatedGpu => Some("gdrvm-gpu-emu"),
        Backing::EmulatedNic => Some("gdrvm-nic-emu"),
        _ => None,
    }
}

/// The emulator processes `node` needs, as groups of function indices (in the node's
/// order): one per program for the endpoints without emulator arguments, and one for
/// each endpoint with them.
pub fn processes(node: &Node) -> Vec<Vec<usize>> {
    let mut shared: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut alone = Vec::new();
    for (i, f) in node.functions.iter().enumerate() {
        match program(&f.backing) {
            Some(p) if f.emulator_args.is_empty() => shared.entry(p).or_default().push(i),
            Some(_) => alone.push(vec![i]),
            None => {}
        }
    }
    shared.into_values().chain(alone).collect()
}

/// Where the emulator binaries are: `$GDRVM_EMU_DIR`, or the directory gdrvm runs from.
fn emulator_dir() -> Option<PathBuf> {
    std::env::var_os(EMU_DIR_ENV)
        .map(PathBuf::from)
        .or_else(|| std::env::current_exe().ok().and_then(|exe| exe.parent().map(PathBuf::from)))
}

impl Emulator {
    /// Starts one emulator process for functions `group` of `node` (one of
    /// `processes`' groups, or a single endpoint) and returns each function's share of
    /// it with the VMM's end of its vfio-user connection, in `group`'s order.
    pub fn start(node: &Node, group: &[usize]) -> Result<Vec<(Emulator, UnixStream)>, String> {
        let dir = emulator_dir().ok_or("cannot tell where gdrvm runs from to find its emulators")?;
        Emulator::start_in(&dir, node, group)
    }

    /// As [`Emulator::start`], with the emulator binaries in `dir`.
    fn start_in(dir: &Path, node: &Node, group: &[usize]) -> Result<Vec<(Emulator, UnixStream)>, String> {
        let Some(&first) = group.first() else { return Ok(Vec::new()) };
        let f = &node.functions[first];
        let program = program(&f.backing).ok_or_else(|| format!("backing {} has no emulator", f.backing))?;
        if let Some(other) =
            group.iter().map(|&i| &node.functions[i]).find(|g| self::program(&g.backing) != Some(program))
        {
            return Err(format!("{} is not served by {program} (a wiring bug)", other.key));
        }
        let path = dir.join(program);
        if !path.is_file() {
            return Err(format!(
                "{} does not exist: build the emulators (cargo build -p gdrvm-devices) or point {EMU_DIR_ENV} at them",
                path.display()
            ));
        }
        let spawning = SPAWNING.lock().unwrap_or_else(PoisonError::into_inner);
        let mut ours = Vec::with_capacity(group.len());
        let mut theirs = Vec::with_capacity(group.len());
        for _ in group {
            let (mine, child) = UnixStream::pair().map_err(|e| format!("socket pair for {program}: {e}"))?;
            // A copy the child inherits (not close-on-exec), held only until it is
            // spawned; the child finds it at the same number.
            // SAFETY: F_DUPFD on a descriptor we own returns a new one or -1.
            let inherited = unsafe { libc::fcntl(child.as_raw_fd(), libc::F_DUPFD, CHILD_FD) };
            if inherited < 0 {
                return Err(format!("socket pair for {program}: {}", std::io::Error::last_os_error()));
            }
            // SAFETY: `inherited` is a fresh descriptor nothing else owns.
            theirs.push(unsafe { OwnedFd::from_raw_fd(inherited) });
            ours.push(mine);
        }
        let mut command = Command::new(&path);
        for (fd, &i) in theirs.iter().zip(group) {
            command.args(["--fd", &fd.as_raw_fd().to_string(), "--function", &node.functions[i].name]);
        }
        command.args(["--node", &node.source, "--die-with-parent"]);
        if let [only] = group {
            command.args(&node.functions[*only].emulator_args);
        }
        // Its own process group: Ctrl-C (SIGINT to the terminal's foreground group) and
        // group kills (`timeout`, a CI runner) reach the VMM alone, which stops the guest,
        // tears the devices down through their connections, then closes them, and the
        // emulator exits. In the VMM's group it died with it and the teardown failed (DMA
        // unmaps, resets) with errors. It still dies with the VMM: its connections close
        // (and `--die-with-parent`).
        command.process_group(0);
        command.stdin(std::process::Stdio::null());
        // Nothing runs in the child between fork and exec (the emulator sets itself up),
        // so std starts it with posix_spawn, which does not copy the VMM's page tables:
        // nested, a fork and exec of each emulator cost 20-40 ms of setup.
        let child = command.spawn().map_err(|e| format!("cannot start {}: {e}", path.display()))?;
        drop(theirs);
        drop(spawning);
        let keys: Vec<&str> = group.iter().map(|&i| node.functions[i].key.as_str()).collect();
        tracing::debug!(functions = ?keys, pid = child.id(), "started {program}");
        let process = Arc::new(Process { child, name: format!("{program} for {}", keys.join(", ")) });
        ours.into_iter()
            .map(|stream| {
                let socket = stream.try_clone().map_err(|e| format!("socket pair for {program}: {e}"))?;
                Ok((Emulator { _process: process.clone(), socket }, stream))
            })
            .collect()
    }
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let child = &mut self.child;
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            match child.try_wait() {
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
        tracing::warn!("{} did not exit within {STOP_GRACE:?} of its sockets closing: killed", self.name);
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use gdrvm_devices::vfio_user::UserConnection;

    use super::*;

    /// Where the emulators are built next to the tests, if they are.
    fn built_emulators() -> Option<PathBuf> {
        // The test binary lives in target/<profile>/deps; the emulators one level up.
        let dir = std::env::current_exe().ok().and_then(|exe| exe.parent()?.parent().map(PathBuf::from));
        let dir = dir.filter(|d| d.join("gdrvm-gpu-emu").is_file() && d.join("gdrvm-nic-emu").is_file());
        if dir.is_none() {
            eprintln!("SKIP: the emulators are not built next to the tests (cargo build -p gdrvm-devices)");
        }
        dir
    }

    fn named(node: &Node, names: &[&str]) -> Vec<usize> {
        names.iter().map(|n| node.functions.iter().position(|f| f.name == *n).unwrap()).collect()
    }

    #[test]
    fn test_one_process_per_kind_and_one_per_endpoint_with_arguments() {
        let mut node = Node::preset("vela-a100").unwrap().unwrap();
        let gpus = named(&node, &["gpu0", "gpu1", "gpu2", "gpu3", "gpu4", "gpu5", "gpu6", "gpu7"]);
        let nics = named(&node, &["nic0", "nic1"]);
        assert_eq!(processes(&node), vec![gpus.clone(), nics.clone()]);
        node.functions[nics[1]].emulator_args = vec!["--fault".into(), "exit@3".into()];
        assert_eq!(processes(&node), vec![gpus, vec![nics[0]], vec![nics[1]]]);
        assert!(processes(&Node::preset("flat").unwrap().unwrap()).iter().all(|g| !g.is_empty()));
    }

    #[test]
    fn test_one_process_serves_each_endpoint_on_its_own_connection() {
        let Some(dir) = built_emulators() else { return };
        let node = Node::preset("vela-a100").unwrap().unwrap();
        let group = named(&node, &["gpu0", "gpu1", "gpu2"]);
        let started = Emulator::start_in(&dir, &node, &group).unwrap();
        assert_eq!(started.len(), 3);
        let pid = started[0].0._process.child.id();
        assert!(started.iter().all(|(e, _)| e._process.child.id() == pid), "one process");
        let (emulators, streams): (Vec<_>, Vec<_>) = started.into_iter().unzip();
        // Every endpoint answers the handshake on its own connection, in any order.
        let conns: Vec<_> = streams
            .into_iter()
            .rev()
            .map(|s| UserConnection::new("test", s, Duration::from_secs(10)).unwrap())
            .collect();
        // Dropping the shares stops the process: it exits once the last connection closes.
        drop(conns);
        drop(emulators);
        // SAFETY: kill with signal 0 only checks that the process exists.
        let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
        assert!(!alive, "the emulator was reaped when its last endpoint was dropped");
    }

    #[test]
    fn test_a_group_of_mixed_kinds_is_refused() {
        let node = Node::preset("vela-a100").unwrap().unwrap();
        let err = Emulator::start_in(Path::new("/nonexistent"), &node, &named(&node, &["gpu0", "nic0"])).err();
        assert!(err.is_some_and(|e| e.contains("not served by gdrvm-gpu-emu")));
    }

    #[test]
    fn test_an_emulator_runs_in_its_own_process_group() {
        let Some(dir) = built_emulators() else { return };
        let node = Node::preset("minimal").unwrap().unwrap();
        let Some(gpu) = node.functions.iter().position(|f| f.backing == Backing::EmulatedGpu) else {
            panic!("minimal has an emulated GPU");
        };
        let started = Emulator::start_in(&dir, &node, &[gpu]).unwrap();
        let pid = started[0].0._process.child.id() as libc::pid_t;
        // SAFETY: getpgid reads the process table; no memory is passed.
        let (theirs, ours) = unsafe { (libc::getpgid(pid), libc::getpgid(0)) };
        assert_eq!(theirs, pid, "the emulator leads a process group of its own");
        assert_ne!(theirs, ours);
    }
}
