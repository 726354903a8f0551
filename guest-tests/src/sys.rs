//! The few system calls the agent makes as PID 1, each wrapped with its error.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// mount(2) with no data.
pub fn mount(source: &str, target: &str, fstype: &str) -> io::Result<()> {
    let (source, target, fstype) = (cstr(source)?, cstr(target)?, cstr(fstype)?);
    // SAFETY: all pointers are valid NUL-terminated strings for the duration of the call.
    let rc = unsafe { libc::mount(source.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Loads a kernel module file with finit_module(2), with `params` (`name=value ...`).
pub fn load_module(path: &Path, params: &str) -> io::Result<()> {
    let file = File::open(path)?;
    let params = cstr(params)?;
    // SAFETY: the fd is open for the call and `params` is a valid C string.
    let rc = unsafe { libc::syscall(libc::SYS_finit_module, file.as_raw_fd(), params.as_ptr(), 0) };
    match rc {
        0 => Ok(()),
        _ => {
            let err = io::Error::last_os_error();
            // Already loaded (or built in) is success.
            if err.raw_os_error() == Some(libc::EEXIST) {
                Ok(())
            } else {
                Err(err)
            }
        }
    }
}

/// Writes `text` into the kernel log at KERN_INFO (below `quiet`'s console level, so it
/// costs no console output), with the log's timestamp; a log that cannot be written to
/// is no error of the agent's.
pub fn mark(text: &str) {
    use std::io::Write;
    if let Ok(mut kmsg) = std::fs::OpenOptions::new().write(true).open("/dev/kmsg") {
        let _ = kmsg.write_all(format!("<6>{text}\n").as_bytes());
    }
}

/// The whole kernel log ring buffer (syslog(2) READ_ALL).
pub fn kernel_log() -> io::Result<String> {
    const SYSLOG_ACTION_READ_ALL: libc::c_int = 3;
    const SYSLOG_ACTION_SIZE_BUFFER: libc::c_int = 10;
    // SAFETY: SIZE_BUFFER takes no buffer.
    let size = unsafe { libc::klogctl(SYSLOG_ACTION_SIZE_BUFFER, std::ptr::null_mut(), 0) };
    if size < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = vec![0u8; size.max(4096) as usize];
    // SAFETY: the buffer is writable for its full length, which is passed.
    let n = unsafe { libc::klogctl(SYSLOG_ACTION_READ_ALL, buf.as_mut_ptr().cast(), buf.len() as libc::c_int) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Writes `status` to an I/O port (the VMM's debug-exit port).
pub fn write_port(port: u16, status: u8) -> io::Result<()> {
    // SAFETY: ioperm only changes this process's I/O permission bitmap.
    if unsafe { libc::ioperm(libc::c_ulong::from(port), 1, 1) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ioperm granted access to exactly this port; `out` has no memory effects.
    unsafe { std::arch::asm!("out dx, al", in("dx") port, in("al") status, options(nomem, nostack, preserves_flags)) };
    Ok(())
}

/// Syncs and powers the machine off. Returns only if the kernel refused.
pub fn power_off() -> io::Error {
    // SAFETY: sync has no arguments.
    unsafe { libc::sync() };
    // SAFETY: reboot with POWER_OFF takes no pointer; as PID 1 we may call it.
    unsafe { libc::reboot(libc::RB_POWER_OFF) };
    io::Error::last_os_error()
}

/// 64 random bits that never block (GRND_INSECURE: PID 1 runs before the CRNG is seeded);
/// the time and PID when getrandom(2) fails. For test tokens, not for secrets.
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // SAFETY: the buffer is writable for the 8 bytes passed.
    let n = unsafe { libc::getrandom(bytes.as_mut_ptr().cast(), bytes.len(), libc::GRND_INSECURE) };
    if n == 8 {
        return u64::from_ne_bytes(bytes);
    }
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    nanos ^ (u64::from(std::process::id()) << 32)
}
