//! Child processes of the harness (VMMs, QEMU for L1): spawned so that they die with the
//! harness on every path (dropped, interrupted, or the harness SIGKILLed), their output
//! read line by line, stopped politely and then not.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::result::{exit, VmOutcome};
use crate::runner::HarnessError;

/// Spawns `cmd`, killed when its handle drops and (PR_SET_PDEATHSIG) when the harness
/// dies without dropping it, as under SIGKILL. `inherit` are fds the child keeps at
/// their numbers (an L1 initramfs that exists only as an open file).
pub(crate) fn spawn(cmd: &mut Command, program: &Path, inherit: &[BorrowedFd<'_>]) -> Result<Child, HarnessError> {
    let fds: Vec<i32> = inherit.iter().map(AsRawFd::as_raw_fd).collect();
    // SAFETY: the closure runs in the forked child before exec and calls only prctl,
    // getppid, fcntl and kill, which are async-signal-safe, on values copied in.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl: then nobody will signal.
            if libc::getppid() == 1 {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            for &fd in &fds {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    cmd.kill_on_drop(true).spawn().map_err(|e| HarnessError::Spawn {
        program: program.display().to_string(),
        reason: if program.ends_with("qemu-system-x86_64") && e.kind() == std::io::ErrorKind::NotFound {
            "not installed (Debian: apt-get install qemu-system-x86)".into()
        } else {
            e.to_string()
        },
    })
}

/// Sends each line of `stream` (without a trailing CR) to `tx` until either ends.
pub(crate) fn forward_lines<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    stream: Option<R>,
    tx: tokio::sync::mpsc::UnboundedSender<String>,
) {
    if let Some(stream) = stream {
        tokio::spawn(async move {
            let mut lines = BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(line.trim_end_matches('\r').to_owned()).is_err() {
                    break;
                }
            }
        });
    }
}

/// How a VMM child ended.
pub(crate) async fn exited(child: &mut Child) -> VmOutcome {
    match child.wait().await {
        Ok(status) => VmOutcome::Exited(status.code().unwrap_or(exit::FAIL)),
        Err(e) => VmOutcome::CannotRun(format!("lost the gdrvm process: {e}")),
    }
}

/// SIGTERM (gdrvm and QEMU stop cleanly on it), then SIGKILL after two seconds.
pub(crate) async fn stop(child: &mut Child) {
    if let Some(pid) = child.id() {
        // SAFETY: signals a child we own and have not reaped.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        if tokio::time::timeout(Duration::from_secs(2), child.wait()).await.is_ok() {
            return;
        }
    }
    let _ = child.kill().await;
}
