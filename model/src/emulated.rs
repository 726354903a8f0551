//! The register contract of gdrvm's emulated devices (`gdrvm-gpu-emu`, `gdrvm-nic-emu`),
//! shared by the emulators and the in-guest agent that drives them.
//!
//! Both devices present the configuration space of their node-file endpoint (IDs, class,
//! BARs, PCIe link, MSI-X, ATS). The MSI-X table and PBA sit at the start of the first BAR
//! large enough for them (the VMM emulates them); the device registers below start at
//! [`REGS`] in BAR 0, a page further, so they never share a page with the table.
//! Registers are little-endian and 32 bits wide unless they say otherwise; a 64-bit
//! register is two 32-bit halves, low first. Reads of undefined offsets return 0, writes
//! to them are ignored.

/// Offset in BAR 0 where the device registers start.
pub const REGS: u64 = 0x1000;
/// Bytes of BAR 0 the registers span.
pub const REGS_LEN: u64 = 0x1000;

/// Identity (read-only): the function's device ID << 16 | vendor ID.
pub const REG_IDENT: u64 = 0x00;
/// What kind of emulated device this is (read-only): [`KIND_GPU`] or [`KIND_NIC`].
pub const REG_KIND: u64 = 0x04;
/// Register layout version (read-only): [`VERSION`].
pub const REG_VERSION: u64 = 0x08;
/// Scratch (read-write): reads back what was last written; 0 after reset.
pub const REG_SCRATCH: u64 = 0x0c;
/// Interrupt doorbell (write-only): writing `n` signals MSI-X vector `n` (when the guest
/// has enabled MSI-X and the vector exists) and counts it in [`REG_IRQ_COUNT`].
pub const REG_IRQ_DOORBELL: u64 = 0x10;
/// Interrupts the device has signalled since reset (read-only).
pub const REG_IRQ_COUNT: u64 = 0x14;

/// [`REG_KIND`] of the GPU.
pub const KIND_GPU: u32 = 0x4750_5530; // "GPU0"
/// [`REG_KIND`] of the NIC.
pub const KIND_NIC: u32 = 0x4e49_4330; // "NIC0"
/// [`REG_VERSION`] of this layout.
pub const VERSION: u32 = 1;

// ---- GPU ----

/// GPU: the BAR index of the aperture (read-only): the largest prefetchable BAR, backed by
/// memory the VMM maps straight into the guest (BAR 1 on NVIDIA data-center GPUs).
pub const GPU_APERTURE_BAR: u64 = 0x40;
/// GPU: the aperture's size in bytes, low half (read-only).
pub const GPU_APERTURE_SIZE_LO: u64 = 0x44;
/// GPU: the aperture's size in bytes, high half (read-only).
pub const GPU_APERTURE_SIZE_HI: u64 = 0x48;

// ---- NIC DMA engine ----
//
// A ring of [`DESC_LEN`]-byte descriptors in guest memory at [`NIC_RING_BASE_LO`]/`_HI`
// ([`NIC_RING_SIZE`] entries, a power of two up to [`NIC_RING_MAX`]). The driver fills
// descriptors and writes the index one past the last one to [`NIC_RING_TAIL`]; the
// device copies each, writes its status back into the descriptor, advances
// [`NIC_RING_HEAD`], and signals MSI-X vector 0 for descriptors that ask for it. Indices
// count modulo 2^32; the slot of index `i` is `i % size`. Bus mastering must be on
// (Command register bit 2), or every descriptor fails with [`STATUS_NO_BUS_MASTER`].

/// NIC: ring base IOVA, low half (read-write; 64-byte aligned).
pub const NIC_RING_BASE_LO: u64 = 0x40;
/// NIC: ring base IOVA, high half (read-write).
pub const NIC_RING_BASE_HI: u64 = 0x44;
/// NIC: ring entries (read-write; a power of two, 1 to [`NIC_RING_MAX`]; 0 stops the
/// engine). Writing it resets head and tail to 0.
pub const NIC_RING_SIZE: u64 = 0x48;
/// NIC: index of the next descriptor the device will process (read-only).
pub const NIC_RING_HEAD: u64 = 0x4c;
/// NIC: doorbell: index one past the last descriptor posted (read-write).
pub const NIC_RING_TAIL: u64 = 0x50;
/// NIC: descriptors completed with [`STATUS_OK`] since reset (read-only).
pub const NIC_COMPLETED: u64 = 0x54;
/// NIC: descriptors failed since reset (read-only).
pub const NIC_FAILED: u64 = 0x58;
/// NIC: the engine's state (read-only): [`ENGINE_IDLE`], [`ENGINE_BUSY`] or [`ENGINE_BROKEN`]
/// (the ring itself could not be read: its base is not mapped; write the ring size to
/// recover).
pub const NIC_ENGINE: u64 = 0x5c;
/// NIC: bytes copied since reset, low half (read-only).
pub const NIC_BYTES_LO: u64 = 0x60;
/// NIC: bytes copied since reset, high half (read-only).
pub const NIC_BYTES_HI: u64 = 0x64;

/// The most ring entries.
pub const NIC_RING_MAX: u32 = 4096;
/// The most bytes one descriptor may copy.
pub const DESC_MAX_LEN: u32 = 64 << 20;
/// Bytes of one descriptor.
pub const DESC_LEN: u64 = 32;
/// Descriptor: source IOVA (u64).
pub const DESC_SRC: u64 = 0;
/// Descriptor: destination IOVA (u64).
pub const DESC_DST: u64 = 8;
/// Descriptor: bytes to copy (u32; 1 to [`DESC_MAX_LEN`]).
pub const DESC_LEN_FIELD: u64 = 16;
/// Descriptor: flags (u32; [`DESC_FLAG_IRQ`]).
pub const DESC_FLAGS: u64 = 20;
/// Descriptor: status the device writes back (u32; the driver writes [`STATUS_PENDING`]).
pub const DESC_STATUS: u64 = 24;
/// Descriptor flag: signal MSI-X vector 0 when this descriptor completes.
pub const DESC_FLAG_IRQ: u32 = 1;

/// Status: not processed yet (what the driver writes).
pub const STATUS_PENDING: u32 = 0;
/// Status: copied.
pub const STATUS_OK: u32 = 1;
/// Status: the source or destination range is not (entirely) mapped for DMA.
pub const STATUS_UNMAPPED: u32 = 2;
/// Status: length 0 or above [`DESC_MAX_LEN`].
pub const STATUS_BAD_LENGTH: u32 = 3;
/// Status: bus mastering is off.
pub const STATUS_NO_BUS_MASTER: u32 = 4;

/// Engine state: nothing to do.
pub const ENGINE_IDLE: u32 = 0;
/// Engine state: processing descriptors.
pub const ENGINE_BUSY: u32 = 1;
/// Engine state: stopped because the ring could not be read or written.
pub const ENGINE_BROKEN: u32 = 2;
