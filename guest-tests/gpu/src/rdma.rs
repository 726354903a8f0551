//! Registering exported GPU memory with an RDMA device (`ibv_reg_dmabuf_mr`), the path
//! NCCL takes for GPUDirect RDMA when `nvidia_peermem` is not loaded. libibverbs lives in
//! gdrvm-verbs alone, so the dma-buf fd is handed down to `gdrvm-verbs reg-dmabuf`, which
//! inherits it while this process keeps the CUDA allocation alive.

use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::report::Outcome;

/// Where RDMA devices are listed.
const INFINIBAND: &str = "/sys/class/infiniband";
/// Where the image puts gdrvm-verbs.
const VERBS: &str = "/usr/bin/gdrvm-verbs";

/// An RDMA device and the gdrvm-verbs that registers memory with it.
#[derive(Debug, Clone)]
pub struct Registrar {
    /// The device's name.
    pub device: String,
    verbs: PathBuf,
}

impl Registrar {
    /// The device named `device`, else the first in `sysfs_class` (sorted), and the
    /// gdrvm-verbs binary; or why registration cannot be tried here.
    pub fn find(device: Option<&str>, sysfs_class: &Path) -> Result<Registrar, String> {
        let device = match device {
            Some(d) => d.to_owned(),
            None => {
                let mut names: Vec<String> = std::fs::read_dir(sysfs_class)
                    .into_iter()
                    .flatten()
                    .filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect();
                names.sort();
                names
                    .into_iter()
                    .next()
                    .ok_or_else(|| format!("not tried: no RDMA device in {}", sysfs_class.display()))?
            }
        };
        let beside = std::env::current_exe().ok().and_then(|e| Some(e.parent()?.join("gdrvm-verbs")));
        let verbs =
            beside.into_iter().chain([PathBuf::from(VERBS)]).find(|p| p.is_file()).ok_or_else(|| {
                format!("not tried: no gdrvm-verbs beside gdrvm-gpu or at {VERBS} (it links libibverbs)")
            })?;
        Ok(Registrar { device, verbs })
    }

    /// [`Registrar::find`] on this machine's sysfs.
    pub fn on_this_machine(device: Option<&str>) -> Result<Registrar, String> {
        Registrar::find(device, Path::new(INFINIBAND))
    }

    /// Registers `length` bytes of dma-buf `fd` with the device, in gdrvm-verbs.
    pub fn register(&self, fd: RawFd, length: usize) -> Outcome {
        // The child inherits the fd: clear close-on-exec for the spawn, then set it again.
        let inherit = |on: bool| {
            let flags = if on { 0 } else { libc::FD_CLOEXEC };
            // SAFETY: F_SETFD on an fd this process owns changes only its flags.
            unsafe { libc::fcntl(fd, libc::F_SETFD, flags) }
        };
        if inherit(true) < 0 {
            return failed(format!("cannot pass fd {fd} on: {}", std::io::Error::last_os_error()));
        }
        let output = Command::new(&self.verbs)
            .args(["reg-dmabuf", "--device", &self.device, "--fd", &fd.to_string(), "--length", &length.to_string()])
            .output();
        inherit(false);
        match output {
            Err(e) => failed(format!("cannot run {}: {e}", self.verbs.display())),
            Ok(o) => parse(&String::from_utf8_lossy(&o.stdout), o.status),
        }
    }
}

fn failed(why: String) -> Outcome {
    Outcome { ok: false, error: Some(why) }
}

/// gdrvm-verbs' one JSON result line (`{"test":"reg_dmabuf","ok":..,"diag":[..]}`, the
/// reason of a failure its last `diag` line) as an outcome.
fn parse(stdout: &str, status: std::process::ExitStatus) -> Outcome {
    let line = stdout.lines().find(|l| l.contains("\"reg_dmabuf\""));
    let Some(value) = line.and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok()) else {
        return failed(format!("gdrvm-verbs reg-dmabuf gave no result ({status})"));
    };
    let last = value["diag"].as_array().and_then(|d| d.last()).and_then(|d| d.as_str()).unwrap_or("no reason given");
    if value["ok"].as_bool() == Some(true) {
        Outcome { ok: true, error: None }
    } else {
        failed(last.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    #[test]
    fn test_the_first_device_by_name_unless_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let none = Registrar::find(None, dir.path()).unwrap_err();
        assert!(none.starts_with("not tried: no RDMA device in"), "{none}");
        for d in ["mlx5_1", "mlx5_0"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        // Whether gdrvm-verbs is found depends on the build; the device choice does not.
        match Registrar::find(None, dir.path()) {
            Ok(r) => assert_eq!(r.device, "mlx5_0"),
            Err(e) => assert!(e.contains("no gdrvm-verbs"), "{e}"),
        }
        if let Ok(r) = Registrar::find(Some("rxe_nic0"), dir.path()) {
            assert_eq!(r.device, "rxe_nic0");
        }
    }

    #[test]
    fn test_gdrvm_verbs_results_become_outcomes() {
        let ok = ExitStatus::from_raw(0);
        let pass = r#"{"test":"reg_dmabuf","ok":true,"diag":["device mlx5_0, dma-buf fd 5, 2097152 bytes","registered: lkey 0x1, rkey 0x2"]}"#;
        assert_eq!(parse(pass, ok), Outcome { ok: true, error: None });
        let fail = r#"{"test":"reg_dmabuf","ok":false,"diag":["device rxe0, dma-buf fd 5, 2097152 bytes","ibv_reg_dmabuf_mr(fd 5, 2097152 bytes): Operation not supported (os error 95)"]}"#;
        assert_eq!(
            parse(fail, ok).error.as_deref(),
            Some("ibv_reg_dmabuf_mr(fd 5, 2097152 bytes): Operation not supported (os error 95)")
        );
        let nothing = parse("", ExitStatus::from_raw(2 << 8));
        assert!(nothing.error.unwrap().starts_with("gdrvm-verbs reg-dmabuf gave no result"));
    }

    #[test]
    fn test_an_fd_is_passed_to_the_child_and_kept_close_on_exec_after() {
        // Any fd stands in for the dma-buf: the child (a shell here, as gdrvm-verbs would)
        // sees it open; afterwards the fd is close-on-exec again.
        let file = tempfile::tempfile().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        // SAFETY: F_SETFD on our own fd.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
        let script = tempfile::NamedTempFile::new().unwrap();
        let path = script.path().to_owned();
        std::fs::write(
            &path,
            "#!/bin/sh\n# reg-dmabuf --device D --fd N --length L\nif [ -e /proc/self/fd/$5 ]; then ok=true; else ok=false; fi\n\
             echo \"{\\\"test\\\":\\\"reg_dmabuf\\\",\\\"ok\\\":$ok,\\\"diag\\\":[\\\"fd $5\\\"]}\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let script = script.into_temp_path();
        let r = Registrar { device: "d".into(), verbs: script.to_path_buf() };
        assert_eq!(r.register(fd, 4096), Outcome { ok: true, error: None });
        // SAFETY: F_GETFD on our own fd.
        assert_eq!(unsafe { libc::fcntl(fd, libc::F_GETFD) } & libc::FD_CLOEXEC, libc::FD_CLOEXEC);
    }
}
