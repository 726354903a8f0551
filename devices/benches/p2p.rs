//! Peer-to-peer DMA through the emulated devices, and what a trapped BAR access costs.
//!
//! `p2p_dma`: the emulated NIC's DMA engine copying guest RAM into the emulated GPU's
//! aperture (BAR 1), end to end minus the guest: the GPU and NIC of preset `minimal`, each
//! served by `serve` on its own thread over a socket pair, guest RAM a memfd in this
//! process mapped into the NIC at IOVA 0 and the GPU's aperture mapped into the NIC where
//! the VMM would put it, both by fd as the VMM's DMA space does. One iteration posts one
//! descriptor in the ring (in guest RAM), rings the doorbell (a trapped BAR 0 write) and
//! waits for the status the engine writes back into the descriptor, as a driver does.
//! Compared against a plain host `copy_from_slice` of the same size between two mmapped,
//! already-touched memfds in this process: the floor any emulated copy can reach.
//!
//! `trapped_read`: one 4-byte BAR 0 register read through the vfio-user socket to the GPU
//! server's thread and back (what every trapped MMIO access of the guest pays on top of the
//! KVM exit), against the same read answered inside the VMM from a function's configuration
//! space (what a hollow function costs).
//!
//! Run with `cargo bench -p gdrvm-devices --bench p2p`.

use std::ffi::CString;
use std::fs::File;
use std::hint::black_box;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use gdrvm_devices::emu::{EmulatedGpu, EmulatedNic, CONFIG_REGION};
use gdrvm_devices::pci_regs::{PCI_COMMAND, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY};
use gdrvm_devices::vfio_user::{
    serve, DmaMemory, Interrupts, ServerError, UserConnection, UserDeviceOps, UserDmaTarget, DEFAULT_TIMEOUT,
};
use gdrvm_devices::{ConfigSpace, DeviceId, DmaRegion, DmaTarget, VfioDeviceOps};
use gdrvm_model::emulated::*;
use gdrvm_model::node::Node;

/// Guest RAM: a memfd of this size at IOVA 0.
const RAM_SIZE: u64 = 160 << 20;
/// The ring, in guest RAM (64-byte aligned).
const RING: u64 = 0x10_0000;
/// Ring entries.
const RING_ENTRIES: u32 = 64;
/// Where the copies come from, in guest RAM.
const SRC: u64 = 16 << 20;
/// Where the VMM puts the GPU's aperture (128 GiB, naturally aligned).
const GPU_APERTURE_IOVA: u64 = 0x20_0000_0000;
/// The GPU's aperture region (BAR 1 of preset `minimal`'s gpu0).
const GPU_APERTURE_REGION: u32 = 1;
/// Bytes per copy.
const SIZES: [(u64, &str); 2] = [(4 << 20, "4MiB"), (64 << 20, "64MiB")];
/// The largest copy.
const MAX_COPY: u64 = 64 << 20;
/// How long one copy may take before the bench gives up on the engine.
const STUCK: Duration = Duration::from_secs(10);

/// Function `name` of preset `minimal`: the node and its index.
fn minimal(name: &str) -> (Node, usize) {
    let node = Node::preset("minimal").and_then(Result::ok).expect("the minimal preset is valid");
    let i = node.functions.iter().position(|f| f.name == name).expect("preset minimal has the function");
    (node, i)
}

/// A memfd of `size` zero bytes (sparse until written).
fn memfd(name: &str, size: u64) -> File {
    let name = CString::new(name).expect("memfd names have no NUL");
    // SAFETY: `name` is NUL-terminated and outlives the call, which only reads it; the
    // descriptor is checked before use.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and nothing else owns it; the File closes it.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size).expect("memfd can be sized");
    file
}

/// A memfd mapped shared and read-write into this process, every page touched.
struct Buffer {
    ptr: *mut u8,
    len: usize,
    _file: File,
}

impl Buffer {
    fn new(name: &str, len: usize, fill: u8) -> Self {
        let file = memfd(name, len as u64);
        // SAFETY: a fresh shared mapping of `len` bytes of a file that long; the kernel
        // picks the address, so nothing of ours is replaced. Checked against MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert!(ptr != libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
        let mut buffer = Buffer { ptr: ptr.cast(), len, _file: file };
        // Touch every page so the timed copies fault nothing in.
        buffer.as_mut_slice().fill(fill);
        buffer
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives; only this
        // process maps the memfd, and writes go through `&mut self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes for as long as `self` lives; `&mut self`
        // makes this the only reference into them.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` is the mapping made in `new`; no slice of it outlives `self`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// A device served by `serve` on its own thread, and the client's side of it.
struct Served {
    ops: UserDeviceOps,
    conn: Arc<UserConnection>,
    server: JoinHandle<Result<(), ServerError>>,
}

impl Served {
    /// Serves `device` (which signals through `irqs` and DMAs through `dma`) on a thread and
    /// connects to it as the VMM would.
    fn start<D>(name: &str, device: D, dma: Arc<DmaMemory>, irqs: Arc<Interrupts>) -> Self
    where
        D: gdrvm_devices::vfio_user::UserDevice + 'static,
    {
        let (client, server) = UnixStream::pair().expect("a socket pair");
        let server = std::thread::Builder::new()
            .name(format!("{name}-server"))
            .spawn(move || {
                let mut device = device;
                serve(server, &mut device, &dma, &irqs)
            })
            .expect("the server thread starts");
        let conn = UserConnection::new(name, client, DEFAULT_TIMEOUT).expect("the vfio-user handshake succeeds");
        let ops = UserDeviceOps::new(conn.clone()).expect("the device's regions can be read");
        Served { ops, conn, server }
    }

    fn read32(&self, index: u32, offset: u64) -> u32 {
        let mut b = [0; 4];
        self.ops.read(index, offset, &mut b).expect("a region read succeeds");
        u32::from_le_bytes(b)
    }

    fn write32(&self, index: u32, offset: u64, value: u32) {
        self.ops.write(index, offset, &value.to_le_bytes()).expect("a region write succeeds");
    }

    /// Disconnects and waits for the server to finish.
    fn stop(self) {
        let Served { ops, conn, server } = self;
        drop(ops);
        drop(conn);
        server.join().expect("the server thread does not panic").expect("the server ends cleanly");
    }
}

/// The GPU of preset `minimal`, served.
fn gpu() -> Served {
    let (node, i) = minimal("gpu0");
    let irqs = Arc::new(Interrupts::new());
    let device = EmulatedGpu::new("preset minimal", &node, i, irqs.clone()).expect("gpu0 can be emulated");
    Served::start("gpu0", device, Arc::new(DmaMemory::new()), irqs)
}

/// The GPU and the NIC of preset `minimal`, served, with guest RAM and the GPU's aperture
/// in the NIC's DMA space, bus mastering on and the ring programmed.
struct P2p {
    gpu: Served,
    nic: Served,
    /// The NIC's DMA target, which made the mappings.
    nic_dma: UserDmaTarget,
    ram: Arc<File>,
    aperture: Arc<File>,
    aperture_offset: u64,
    tail: u32,
}

impl P2p {
    fn new() -> Self {
        let gpu = gpu();
        let (node, i) = minimal("nic0");
        let (dma, irqs) = (Arc::new(DmaMemory::new()), Arc::new(Interrupts::new()));
        let device =
            EmulatedNic::new("preset minimal", &node, i, dma.clone(), irqs.clone()).expect("nic0 can be emulated");
        let nic = Served::start("nic0", device, dma, irqs);

        // Guest RAM: the source pattern written (so its pages exist), mapped at IOVA 0.
        let ram = Arc::new(memfd("guest-ram", RAM_SIZE));
        let pattern: Vec<u8> = (0..MAX_COPY).map(|k| (k * 7 + k / 4093) as u8).collect();
        ram.write_all_at(&pattern, SRC).expect("guest RAM can be written");
        let mut nic_dma = UserDmaTarget::new(nic.conn.clone());
        // `host_addr` is where the VMM maps a region itself; a vfio-user target maps by fd.
        let region = DmaRegion { iova: 0, size: RAM_SIZE, host_addr: 0, fd: Some((ram.clone(), 0)), owner: None };
        nic_dma.map(&region).expect("the NIC maps guest RAM");

        // The GPU's aperture, by the fd its server sent, where the VMM would place BAR 1.
        let info = gpu.ops.region(GPU_APERTURE_REGION).expect("the GPU has an aperture");
        let aperture = info.mmap_fd.clone().expect("the aperture is mappable");
        let region = DmaRegion {
            iova: GPU_APERTURE_IOVA,
            size: info.size,
            host_addr: 0,
            fd: Some((aperture.clone(), info.offset)),
            owner: Some(DeviceId(0)),
        };
        nic_dma.map(&region).expect("the NIC maps the GPU's aperture");

        // Bus mastering (and memory decode) on, as the guest driver does.
        let mut command = [0; 2];
        nic.ops.read(CONFIG_REGION, PCI_COMMAND as u64, &mut command).expect("the Command register reads");
        let command = u16::from_le_bytes(command) | PCI_COMMAND_MASTER | PCI_COMMAND_MEMORY;
        nic.ops.write(CONFIG_REGION, PCI_COMMAND as u64, &command.to_le_bytes()).expect("the Command register writes");

        nic.write32(0, REGS + NIC_RING_BASE_LO, RING as u32);
        nic.write32(0, REGS + NIC_RING_BASE_HI, (RING >> 32) as u32);
        nic.write32(0, REGS + NIC_RING_SIZE, RING_ENTRIES);

        let mut p2p = P2p { gpu, nic, nic_dma, ram, aperture, aperture_offset: info.offset, tail: 0 };
        // One copy of the largest size before anything is timed: the aperture's pages exist
        // and both mappings in the NIC are faulted in. It must have landed.
        p2p.copy(MAX_COPY);
        let mut got = vec![0; MAX_COPY as usize];
        p2p.aperture.read_exact_at(&mut got, p2p.aperture_offset).expect("the aperture can be read");
        assert!(got == pattern, "the NIC's copy into the GPU's aperture differs from guest RAM");
        eprintln!(
            "p2p: gpu0 aperture {} GiB at IOVA {GPU_APERTURE_IOVA:#x}, guest RAM {} MiB at IOVA 0, \
             ring of {RING_ENTRIES} at {RING:#x}; checked one {} MiB copy",
            info.size >> 30,
            RAM_SIZE >> 20,
            MAX_COPY >> 20
        );
        p2p
    }

    /// Copies `len` bytes from guest RAM to the start of the GPU's aperture through the
    /// NIC: posts one descriptor, rings the doorbell, waits for its status and checks it.
    fn copy(&mut self, len: u64) {
        let slot = RING + u64::from(self.tail % RING_ENTRIES) * DESC_LEN;
        let mut desc = [0u8; DESC_LEN as usize];
        desc[DESC_SRC as usize..][..8].copy_from_slice(&SRC.to_le_bytes());
        desc[DESC_DST as usize..][..8].copy_from_slice(&GPU_APERTURE_IOVA.to_le_bytes());
        desc[DESC_LEN_FIELD as usize..][..4].copy_from_slice(&(len as u32).to_le_bytes());
        desc[DESC_FLAGS as usize..][..4].copy_from_slice(&0u32.to_le_bytes());
        desc[DESC_STATUS as usize..][..4].copy_from_slice(&STATUS_PENDING.to_le_bytes());
        self.ram.write_all_at(&desc, slot).expect("the ring can be written");
        self.tail = self.tail.wrapping_add(1);
        self.nic.write32(0, REGS + NIC_RING_TAIL, self.tail);
        // A driver waits for the completion the device writes back into the descriptor in
        // its own memory, not by reading the device's registers (each a socket round trip
        // that would also take CPU from the engine).
        let deadline = Instant::now() + STUCK;
        let mut status = [0; 4];
        let status = loop {
            self.ram.read_exact_at(&mut status, slot + DESC_STATUS).expect("the ring can be read");
            match u32::from_le_bytes(status) {
                STATUS_PENDING if Instant::now() > deadline => {
                    let engine = self.nic.read32(0, REGS + NIC_ENGINE);
                    panic!("the NIC's engine did not finish a {len}-byte copy within {STUCK:?} (state {engine})");
                }
                STATUS_PENDING => std::hint::spin_loop(),
                done => break done,
            }
        };
        assert!(status == STATUS_OK, "the descriptor completed with status {status}, not STATUS_OK");
    }

    fn stop(self) {
        let P2p { gpu, nic, nic_dma, .. } = self;
        drop(nic_dma);
        nic.stop();
        gpu.stop();
    }
}

fn p2p_dma(c: &mut Criterion) {
    let mut p2p = P2p::new();
    let mut from = Buffer::new("memcpy-src", MAX_COPY as usize, 0x5a);
    let mut to = Buffer::new("memcpy-dst", MAX_COPY as usize, 0xa5);
    from.as_mut_slice().iter_mut().enumerate().for_each(|(k, b)| *b = (k * 7) as u8);

    let mut group = c.benchmark_group("p2p_dma");
    group.sample_size(10);
    for (len, label) in SIZES {
        group.throughput(Throughput::Bytes(len));
        group.bench_function(BenchmarkId::new("nic_ram_to_gpu_bar", label), |b| {
            b.iter(|| p2p.copy(black_box(len)));
        });
        // Reference in the same process: a host memcpy between two touched shared
        // mappings of memfds, the same kind of memory the NIC copies between.
        let n = len as usize;
        group.bench_function(BenchmarkId::new("host_memcpy", label), |b| {
            b.iter(|| {
                to.as_mut_slice()[..n].copy_from_slice(&from.as_slice()[..n]);
                black_box(to.as_slice()[n - 1]);
            });
        });
    }
    group.finish();
    p2p.stop();
}

fn trapped_read(c: &mut Criterion) {
    let gpu = gpu();
    gpu.write32(0, REGS + REG_SCRATCH, 0x5ca7_c400);
    assert_eq!(gpu.read32(0, REGS + REG_SCRATCH), 0x5ca7_c400, "the GPU's scratch register reads back");
    let (node, i) = minimal("gpu0");
    let config = ConfigSpace::for_function(&node, i);

    let mut group = c.benchmark_group("trapped_read");
    group.bench_function("emulator_bar0_scratch", |b| {
        let mut data = [0u8; 4];
        b.iter(|| gpu.ops.read(0, black_box(REGS + REG_SCRATCH), &mut data).expect("a region read succeeds"));
    });
    // Reference: the same 4-byte read answered by the VMM from a configuration space it
    // holds, as for a hollow function.
    group.bench_function("vmm_config_space", |b| {
        let mut data = [0u8; 4];
        b.iter(|| config.read(black_box(0), &mut data));
    });
    group.finish();
    gpu.stop();
}

criterion_group! {
    name = benches;
    config = Criterion::default().warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    targets = p2p_dma, trapped_read
}
criterion_main!(benches);
