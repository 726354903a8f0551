//! vfio-user: a PCI device emulated in another process, reached over a Unix socket.
//!
//! Both sides are here. The client ([`connect`], [`UserConnection`], [`UserDeviceOps`],
//! [`UserDmaTarget`]) plugs a remote device into the VFIO passthrough layer, so it gets the
//! same configuration firewall, MSI/MSI-X emulation and BAR mapping (from the region fds
//! the server sends) as a host device, and the DMA space maps guest memory into the server
//! by fd. The server ([`serve`], [`UserDevice`], [`DmaMemory`], [`Interrupts`]) is what the
//! emulator binaries build on.
//!
//! The protocol (libvfio-user `include/vfio-user.h`, QEMU `docs/devel/vfio-user.rst`,
//! version 0.1) is written by hand in [`protocol`] (pure encoders and decoders, fuzzed)
//! and [`transport`] (one message with its fds, within a deadline): the `vfio_user` 0.1.7
//! crate's client blocks forever when a server answers with an error, and a bad device
//! must never hang the VMM. Every client request has a deadline; a device that times out,
//! hangs up or breaks the framing is marked failed and reads all-ones from then on.
//! Messages are bounded ([`protocol::MAX_MSG_SIZE`], [`protocol::MAX_FDS`]), and nothing a
//! peer sends panics either side.

mod client;
mod dma_memory;
mod interrupts;
pub mod protocol;
mod server;
pub mod transport;

pub use client::{connect, open_user_device, UserConnection, UserDeviceOps, UserDmaTarget, UserError, DEFAULT_TIMEOUT};
pub use dma_memory::{DmaFault, DmaMemory, MAX_DMA_MAPPINGS};
pub use interrupts::{Interrupts, MAX_VECTORS};
pub use server::{serve, ServerError, ServerRegion, UserDevice};

/// An error and its sources, `: `-separated, for one log line.
struct Chain<'a>(&'a dyn std::error::Error);

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            write!(f, ": {e}")?;
            source = e.source();
        }
        Ok(())
    }
}

/// Helpers shared by the tests of this module: random bytes, memfds, a small device.
#[cfg(test)]
pub(crate) mod test_util {
    use std::ffi::CString;
    use std::fs::File;
    use std::io;
    use std::os::fd::FromRawFd;
    use std::os::unix::fs::FileExt;
    use std::sync::{Arc, Mutex};

    use super::{ServerRegion, UserDevice};
    use crate::lock;

    /// A small xorshift generator: reproducible pseudo-random bytes without a dependency.
    pub struct Rng(pub u64);

    impl Rng {
        /// The next 64 random bits.
        pub fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// Up to `max` random bytes.
        pub fn bytes(&mut self, max: usize) -> Vec<u8> {
            let len = (self.next() % (max as u64 + 1)) as usize;
            (0..len).map(|_| self.next() as u8).collect()
        }
    }

    /// A memfd of `size` zero bytes.
    pub fn memfd(name: &str, size: u64) -> File {
        let name = CString::new(name).unwrap();
        // SAFETY: `name` is a NUL-terminated string that outlives the call.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", io::Error::last_os_error());
        // SAFETY: `fd` was just created and is owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).unwrap();
        file
    }

    /// Bytes of the test device's BAR0 (mmappable, a memfd).
    pub const BAR0_SIZE: u64 = 0x2000;
    /// Bytes of the test device's BAR2 (trapped).
    pub const BAR2_SIZE: u64 = 0x100;

    /// State of [`TestDevice`] the tests look at.
    pub struct TestState {
        pub bar2: Vec<u8>,
        pub config: Vec<u8>,
        pub resets: u32,
    }

    /// A PCI device: BAR0 8 KiB memory over a memfd (mmappable), BAR2 256 bytes trapped,
    /// 256 bytes of configuration space (vendor 0x1af4, device 0x10f0); 4 MSI-X vectors,
    /// 1 MSI, no INTx.
    #[derive(Clone)]
    pub struct TestDevice {
        pub bar0: Arc<File>,
        pub state: Arc<Mutex<TestState>>,
    }

    impl TestDevice {
        pub fn new() -> Self {
            let mut config = vec![0; 256];
            config[0..4].copy_from_slice(&0x10f0_1af4u32.to_le_bytes());
            config[0x10..0x14].copy_from_slice(&0xfe00_0000u32.to_le_bytes());
            config[0x18..0x1c].copy_from_slice(&0xfe10_0000u32.to_le_bytes());
            let state = TestState { bar2: vec![0; BAR2_SIZE as usize], config, resets: 0 };
            TestDevice { bar0: Arc::new(memfd("bar0", BAR0_SIZE)), state: Arc::new(Mutex::new(state)) }
        }
    }

    impl UserDevice for TestDevice {
        fn region(&self, index: u32) -> Option<ServerRegion> {
            let plain = |size| ServerRegion { size, readable: true, writable: true, mmap: None };
            match index {
                0 => Some(ServerRegion { mmap: Some((self.bar0.clone(), 0)), ..plain(BAR0_SIZE) }),
                2 => Some(plain(BAR2_SIZE)),
                7 => Some(plain(256)),
                _ => None,
            }
        }

        fn irq_count(&self, index: u32) -> u32 {
            match index {
                1 => 1,
                2 => 4,
                _ => 0,
            }
        }

        fn read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
            let state = lock(&self.state);
            let at = offset as usize;
            match index {
                0 => return self.bar0.read_exact_at(data, offset),
                2 => data.copy_from_slice(&state.bar2[at..at + data.len()]),
                7 => data.copy_from_slice(&state.config[at..at + data.len()]),
                _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
            }
            Ok(())
        }

        fn write(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
            let mut state = lock(&self.state);
            let at = offset as usize;
            match index {
                0 => return self.bar0.write_all_at(data, offset),
                2 if at == 0xfc => return Err(io::Error::from_raw_os_error(libc::EIO)),
                2 => state.bar2[at..at + data.len()].copy_from_slice(data),
                7 => state.config[at..at + data.len()].copy_from_slice(data),
                _ => return Err(io::Error::from_raw_os_error(libc::EINVAL)),
            }
            Ok(())
        }

        fn reset(&mut self) {
            lock(&self.state).resets += 1;
        }
    }
}
