//! The VMM's vfio-user client: a server that answers with any bytes. The handshake, the
//! region table and a read and write of every region must end in an error or a result,
//! within the client's bounded wait, never a panic or a hang.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use gdrvm_devices::vfio_user::{UserConnection, UserDeviceOps};
use gdrvm_devices::VfioDeviceOps;
use libfuzzer_sys::fuzz_target;

/// libFuzzer's own main leaves SIGPIPE fatal, unlike a Rust program's: a write to a peer
/// that hung up must be an error here, as in gdrvm and its emulators.
fn ignore_sigpipe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: setting SIGPIPE's disposition to ignore touches no memory of ours.
    ONCE.call_once(|| unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    });
}

fuzz_target!(|data: &[u8]| {
    ignore_sigpipe();
    let Ok((client, mut server)) = UnixStream::pair() else { return };
    let reply = data.to_vec();
    let answering = std::thread::spawn(move || {
        let _ = server.write_all(&reply);
        // Keep reading requests until the client gives up, so it sees silence, not EOF.
        let mut sink = [0u8; 4096];
        while matches!(server.read(&mut sink), Ok(n) if n > 0) {}
    });
    if let Ok(conn) = UserConnection::new("fuzz", client, Duration::from_millis(20)) {
        if let Ok(ops) = UserDeviceOps::new(conn.clone()) {
            for index in 0..9 {
                let mut buf = [0u8; 8];
                let _ = ops.read(index, 0, &mut buf);
                let _ = ops.write(index, 0, &buf);
            }
            let _ = ops.reset();
        }
        drop(conn);
    }
    let _ = answering.join();
});
