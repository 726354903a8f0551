//! vfio-user servers: any bytes from a client, as a stream of messages, into the emulated
//! NIC's server loop (the GPU's shares it), with file descriptors never attached. A
//! malformed message must get an error reply or end the connection, never a panic or a
//! hang; the NIC's DMA engine must survive whatever registers the messages write.
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, OnceLock};

use gdrvm_devices::emu::EmulatedNic;
use gdrvm_devices::vfio_user::{serve, DmaMemory, Interrupts};
use gdrvm_model::node::Node;
use libfuzzer_sys::fuzz_target;

fn node() -> &'static (Node, usize) {
    static NODE: OnceLock<(Node, usize)> = OnceLock::new();
    NODE.get_or_init(|| {
        let node = Node::preset("minimal").expect("preset minimal").expect("preset minimal parses");
        let nic = node.functions.iter().position(|f| f.name == "nic0").expect("minimal has nic0");
        (node, nic)
    })
}

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
    let (node, i) = node();
    let dma = Arc::new(DmaMemory::new());
    let irqs = Arc::new(Interrupts::new());
    let Ok(mut nic) = EmulatedNic::new("preset minimal", node, *i, dma.clone(), irqs.clone()) else { return };
    let Ok((mut client, server)) = UnixStream::pair() else { return };
    let serving = std::thread::spawn(move || {
        let _ = serve(server, &mut nic, &dma, &irqs);
    });
    // Replies are drained on this side so the server never blocks on a full socket.
    let Ok(mut reader) = client.try_clone() else { return };
    let draining = std::thread::spawn(move || {
        let mut sink = [0u8; 4096];
        while matches!(reader.read(&mut sink), Ok(n) if n > 0) {}
    });
    let _ = client.write_all(data);
    let _ = client.shutdown(std::net::Shutdown::Write);
    let _ = serving.join();
    let _ = client.shutdown(std::net::Shutdown::Both);
    let _ = draining.join();
});
