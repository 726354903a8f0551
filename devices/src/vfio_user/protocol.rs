//! The vfio-user wire format (libvfio-user `include/vfio-user.h`, QEMU
//! `docs/devel/vfio-user.rst`): the message header and the payloads gdrvm uses, as pure
//! encoders and decoders over byte slices. Every decoder takes any bytes a peer may send
//! and returns an error rather than panicking (they are fuzzed).
//!
//! Everything is little-endian and packed. Structures that start with `argsz` (the ones
//! shared with VFIO's ioctls) must say at least their own size; bytes past a structure
//! (a capability chain a newer peer appends) are ignored.

use std::fmt;

/// Bytes of the message header.
pub const HEADER_SIZE: usize = 16;
/// The most region data one message carries (and the `max_data_xfer_size` gdrvm offers).
pub const MAX_DATA_XFER: usize = 1 << 20;
/// The largest message gdrvm sends or accepts: a region access of [`MAX_DATA_XFER`] bytes.
pub const MAX_MSG_SIZE: usize = HEADER_SIZE + RegionAccess::SIZE + MAX_DATA_XFER;
/// The most file descriptors one message carries.
pub const MAX_FDS: usize = 8;
/// The protocol version gdrvm speaks.
pub const VERSION_MAJOR: u16 = 0;
/// The minor protocol version gdrvm speaks.
pub const VERSION_MINOR: u16 = 1;
/// `max_msg_fds` when a peer does not say (the protocol's default).
pub const DEFAULT_MAX_MSG_FDS: u32 = 1;
/// `max_data_xfer_size` when a peer does not say (the protocol's default).
pub const DEFAULT_MAX_DATA_XFER: u32 = 1 << 20;

/// Header flags: the message type (bits 0-3).
pub const FLAG_TYPE_MASK: u32 = 0xf;
/// Message type: a command.
pub const TYPE_COMMAND: u32 = 0;
/// Message type: a reply.
pub const TYPE_REPLY: u32 = 1;
/// Header flag: the sender wants no reply.
pub const FLAG_NO_REPLY: u32 = 1 << 4;
/// Header flag: the reply is an error, `error_no` says which.
pub const FLAG_ERROR: u32 = 1 << 5;

/// DMA_MAP flag: the device may read the range.
pub const DMA_READ: u32 = 1;
/// DMA_MAP flag: the device may write the range.
pub const DMA_WRITE: u32 = 1 << 1;
/// DMA_MAP flag: the range comes with an fd the server may mmap.
pub const DMA_MAPPABLE: u32 = 1 << 2;

/// Device info flag: DEVICE_RESET is offered.
pub const DEVICE_FLAGS_RESET: u32 = 1;
/// Device info flag: a PCI device.
pub const DEVICE_FLAGS_PCI: u32 = 1 << 1;
/// Regions of a PCI device: BAR0-5, ROM, config, VGA.
pub const PCI_NUM_REGIONS: u32 = 9;
/// IRQ indexes of a PCI device: INTx, MSI, MSI-X, ERR, REQ.
pub const PCI_NUM_IRQS: u32 = 5;

/// Region flag: readable.
pub const REGION_READ: u32 = 1;
/// Region flag: writable.
pub const REGION_WRITE: u32 = 1 << 1;
/// Region flag: mmappable from the fd that comes with the reply.
pub const REGION_MMAP: u32 = 1 << 2;

/// IRQ info flag: signalled through eventfds.
pub const IRQ_INFO_EVENTFD: u32 = 1;

/// SET_IRQS data: none.
pub const IRQ_SET_DATA_NONE: u32 = 1;
/// SET_IRQS data: one byte per vector.
pub const IRQ_SET_DATA_BOOL: u32 = 1 << 1;
/// SET_IRQS data: one eventfd per vector (SCM_RIGHTS).
pub const IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
/// SET_IRQS action: mask.
pub const IRQ_SET_ACTION_MASK: u32 = 1 << 3;
/// SET_IRQS action: unmask.
pub const IRQ_SET_ACTION_UNMASK: u32 = 1 << 4;
/// SET_IRQS action: trigger (signal, or set the eventfds that signal).
pub const IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;
/// The data-type bits of SET_IRQS flags.
pub const IRQ_SET_DATA_MASK: u32 = IRQ_SET_DATA_NONE | IRQ_SET_DATA_BOOL | IRQ_SET_DATA_EVENTFD;
/// The action bits of SET_IRQS flags.
pub const IRQ_SET_ACTION_MASK_ALL: u32 = IRQ_SET_ACTION_MASK | IRQ_SET_ACTION_UNMASK | IRQ_SET_ACTION_TRIGGER;

/// Why bytes are not a valid message or payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Fewer bytes than the structure needs.
    #[error("{what} needs {need} bytes, {got} were sent")]
    Short {
        /// The structure.
        what: &'static str,
        /// Bytes it needs.
        need: usize,
        /// Bytes there were.
        got: usize,
    },
    /// `msg_size` is smaller than the header.
    #[error("message size {0} is smaller than the {HEADER_SIZE}-byte header")]
    SizeTooSmall(u32),
    /// `msg_size` is larger than gdrvm accepts.
    #[error("message size {0} exceeds the limit of {MAX_MSG_SIZE} bytes")]
    SizeTooLarge(u32),
    /// The type bits are neither command nor reply.
    #[error("message type {0} is neither a command nor a reply")]
    BadType(u32),
    /// `argsz` is smaller than the structure.
    #[error("{what} says argsz {argsz}, smaller than its {need} bytes")]
    Argsz {
        /// The structure.
        what: &'static str,
        /// What it said.
        argsz: u32,
        /// Its size.
        need: usize,
    },
    /// A region access carries a different number of data bytes than its count.
    #[error("{what} carries {got} data bytes for a count of {count}")]
    DataLength {
        /// The structure.
        what: &'static str,
        /// Its count.
        count: u32,
        /// Data bytes there were.
        got: usize,
    },
    /// The VERSION capabilities are not a JSON object gdrvm understands.
    #[error("the version capabilities are malformed: {0}")]
    Capabilities(String),
}

/// The commands gdrvm knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    /// Version and capability negotiation.
    Version = 1,
    /// Maps a range of the client's memory for DMA.
    DmaMap = 2,
    /// Unmaps a DMA range.
    DmaUnmap = 3,
    /// Device flags, region and IRQ counts.
    DeviceGetInfo = 4,
    /// One region's size, flags and mmap fd.
    DeviceGetRegionInfo = 5,
    /// One IRQ index's vectors.
    DeviceGetIrqInfo = 7,
    /// Sets, clears or fires interrupt vectors.
    DeviceSetIrqs = 8,
    /// Reads a region.
    RegionRead = 9,
    /// Writes a region.
    RegionWrite = 10,
    /// Resets the device.
    DeviceReset = 13,
}

impl Command {
    /// The command numbered `n`, if gdrvm knows it.
    pub fn from_u16(n: u16) -> Option<Self> {
        Some(match n {
            1 => Command::Version,
            2 => Command::DmaMap,
            3 => Command::DmaUnmap,
            4 => Command::DeviceGetInfo,
            5 => Command::DeviceGetRegionInfo,
            7 => Command::DeviceGetIrqInfo,
            8 => Command::DeviceSetIrqs,
            9 => Command::RegionRead,
            10 => Command::RegionWrite,
            13 => Command::DeviceReset,
            _ => return None,
        })
    }

    /// The protocol's name of the command.
    pub fn name(self) -> &'static str {
        match self {
            Command::Version => "VERSION",
            Command::DmaMap => "DMA_MAP",
            Command::DmaUnmap => "DMA_UNMAP",
            Command::DeviceGetInfo => "DEVICE_GET_INFO",
            Command::DeviceGetRegionInfo => "DEVICE_GET_REGION_INFO",
            Command::DeviceGetIrqInfo => "DEVICE_GET_IRQ_INFO",
            Command::DeviceSetIrqs => "DEVICE_SET_IRQS",
            Command::RegionRead => "REGION_READ",
            Command::RegionWrite => "REGION_WRITE",
            Command::DeviceReset => "DEVICE_RESET",
        }
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reads little-endian fields from a payload, failing rather than running past its end.
struct Reader<'a> {
    what: &'static str,
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// A reader of `bytes`, which must hold at least `need` bytes.
    fn new(what: &'static str, bytes: &'a [u8], need: usize) -> Result<Self, ProtocolError> {
        if bytes.len() < need {
            return Err(ProtocolError::Short { what, need, got: bytes.len() });
        }
        Ok(Reader { what, bytes, at: 0 })
    }

    fn take<const N: usize>(&mut self) -> Result<[u8; N], ProtocolError> {
        let end = self.at.saturating_add(N);
        let field = self.bytes.get(self.at..end).and_then(|s| <[u8; N]>::try_from(s).ok());
        let field = field.ok_or(ProtocolError::Short { what: self.what, need: end, got: self.bytes.len() })?;
        self.at = end;
        Ok(field)
    }

    fn u16(&mut self) -> Result<u16, ProtocolError> {
        self.take().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, ProtocolError> {
        self.take().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, ProtocolError> {
        self.take().map(u64::from_le_bytes)
    }

    /// Reads `argsz` and checks it covers a structure of `need` bytes.
    fn argsz(&mut self, need: usize) -> Result<u32, ProtocolError> {
        let argsz = self.u32()?;
        if (argsz as usize) < need {
            return Err(ProtocolError::Argsz { what: self.what, argsz, need });
        }
        Ok(argsz)
    }

    /// The bytes after those read.
    fn rest(&self) -> &'a [u8] {
        self.bytes.get(self.at..).unwrap_or_default()
    }
}

/// Appends little-endian fields.
trait Put {
    fn put(&mut self, bytes: &[u8]) -> &mut Self;
}

impl Put for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) -> &mut Self {
        self.extend_from_slice(bytes);
        self
    }
}

/// The 16-byte header of every message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Matches a reply to its command.
    pub msg_id: u16,
    /// The command (the replied-to command in a reply).
    pub command: u16,
    /// Bytes of the whole message, header included.
    pub msg_size: u32,
    /// Type, no-reply and error flags.
    pub flags: u32,
    /// In an error reply, an errno.
    pub error_no: u32,
}

impl Header {
    /// Decodes and checks a header: `msg_size` between [`HEADER_SIZE`] and
    /// [`MAX_MSG_SIZE`], the type a command or a reply.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("the message header", bytes, HEADER_SIZE)?;
        let header =
            Header { msg_id: r.u16()?, command: r.u16()?, msg_size: r.u32()?, flags: r.u32()?, error_no: r.u32()? };
        if (header.msg_size as usize) < HEADER_SIZE {
            return Err(ProtocolError::SizeTooSmall(header.msg_size));
        }
        if header.msg_size as usize > MAX_MSG_SIZE {
            return Err(ProtocolError::SizeTooLarge(header.msg_size));
        }
        let kind = header.flags & FLAG_TYPE_MASK;
        if kind != TYPE_COMMAND && kind != TYPE_REPLY {
            return Err(ProtocolError::BadType(kind));
        }
        Ok(header)
    }

    /// The header's 16 bytes.
    pub fn encode(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0; HEADER_SIZE];
        b[0..2].copy_from_slice(&self.msg_id.to_le_bytes());
        b[2..4].copy_from_slice(&self.command.to_le_bytes());
        b[4..8].copy_from_slice(&self.msg_size.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.error_no.to_le_bytes());
        b
    }

    /// The header of command `command` with `payload_len` bytes of payload.
    pub fn command(msg_id: u16, command: Command, payload_len: usize) -> Self {
        Header { msg_id, command: command as u16, msg_size: size(payload_len), flags: TYPE_COMMAND, error_no: 0 }
    }

    /// The header of a successful reply to this command, with `payload_len` bytes.
    pub fn reply(&self, payload_len: usize) -> Self {
        Header {
            msg_id: self.msg_id,
            command: self.command,
            msg_size: size(payload_len),
            flags: TYPE_REPLY,
            error_no: 0,
        }
    }

    /// The header of an error reply to this command.
    pub fn error_reply(&self, errno: i32) -> Self {
        Header {
            msg_id: self.msg_id,
            command: self.command,
            msg_size: size(0),
            flags: TYPE_REPLY | FLAG_ERROR,
            error_no: errno.unsigned_abs(),
        }
    }

    /// Whether this is a reply.
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_TYPE_MASK == TYPE_REPLY
    }

    /// Whether the sender wants no reply.
    pub fn no_reply(&self) -> bool {
        self.flags & FLAG_NO_REPLY != 0
    }

    /// Whether this is an error reply.
    pub fn is_error(&self) -> bool {
        self.flags & FLAG_ERROR != 0
    }

    /// Bytes of payload after the header.
    pub fn payload_len(&self) -> usize {
        (self.msg_size as usize).saturating_sub(HEADER_SIZE)
    }
}

/// `msg_size` of a message with `payload_len` bytes of payload; saturates, so that a
/// message too large for the field is also too large to send.
fn size(payload_len: usize) -> u32 {
    u32::try_from(payload_len.saturating_add(HEADER_SIZE)).unwrap_or(u32::MAX)
}

/// VERSION, both ways: the protocol version and the sender's capabilities.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
    /// The most fds the sender accepts in one message.
    pub max_msg_fds: u32,
    /// The most region data the sender accepts in one message.
    pub max_data_xfer_size: u32,
}

impl Default for Version {
    /// gdrvm's version and capabilities.
    fn default() -> Self {
        Version {
            major: VERSION_MAJOR,
            minor: VERSION_MINOR,
            max_msg_fds: MAX_FDS as u32,
            max_data_xfer_size: MAX_DATA_XFER as u32,
        }
    }
}

impl Version {
    /// Decodes a VERSION payload: the version, then an optional NUL-terminated JSON object
    /// (`{"capabilities":{"max_msg_fds":..,"max_data_xfer_size":..}}`); what it leaves out
    /// takes the protocol's defaults, keys gdrvm does not know are ignored.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("VERSION", bytes, 4)?;
        let (major, minor) = (r.u16()?, r.u16()?);
        let mut version =
            Version { major, minor, max_msg_fds: DEFAULT_MAX_MSG_FDS, max_data_xfer_size: DEFAULT_MAX_DATA_XFER };
        let text = r.rest();
        let text = text.iter().position(|&b| b == 0).map_or(text, |nul| &text[..nul]);
        if text.iter().all(u8::is_ascii_whitespace) {
            return Ok(version);
        }
        let bad = |e: &dyn fmt::Display| ProtocolError::Capabilities(e.to_string());
        let json: serde_json::Value = serde_json::from_slice(text).map_err(|e| bad(&e))?;
        let Some(object) = json.as_object() else {
            return Err(bad(&"not a JSON object"));
        };
        let Some(caps) = object.get("capabilities") else {
            return Ok(version);
        };
        let Some(caps) = caps.as_object() else {
            return Err(bad(&"\"capabilities\" is not an object"));
        };
        let number = |key: &str| -> Result<Option<u32>, ProtocolError> {
            match caps.get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(u32::try_from(n).unwrap_or(u32::MAX)))
                    .ok_or_else(|| bad(&format_args!("{key} is not a non-negative integer"))),
            }
        };
        if let Some(n) = number("max_msg_fds")? {
            version.max_msg_fds = n;
        }
        if let Some(n) = number("max_data_xfer_size")? {
            version.max_data_xfer_size = n;
        }
        Ok(version)
    }

    /// The payload: version, JSON capabilities, NUL.
    pub fn encode(&self) -> Vec<u8> {
        let json = format!(
            "{{\"capabilities\":{{\"max_msg_fds\":{},\"max_data_xfer_size\":{}}}}}",
            self.max_msg_fds, self.max_data_xfer_size
        );
        let mut b = Vec::with_capacity(5 + json.len());
        b.put(&self.major.to_le_bytes()).put(&self.minor.to_le_bytes()).put(json.as_bytes()).put(&[0]);
        b
    }
}

/// DMA_MAP: map `size` bytes of the fd sent with it, from `offset`, at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaMap {
    /// [`DMA_READ`], [`DMA_WRITE`], [`DMA_MAPPABLE`].
    pub flags: u32,
    /// Offset of the range in the fd.
    pub offset: u64,
    /// The range's I/O virtual address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
}

impl DmaMap {
    /// Bytes on the wire.
    pub const SIZE: usize = 32;

    /// Decodes a DMA_MAP payload.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("DMA_MAP", bytes, Self::SIZE)?;
        r.argsz(Self::SIZE)?;
        Ok(DmaMap { flags: r.u32()?, offset: r.u64()?, addr: r.u64()?, size: r.u64()? })
    }

    /// The payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.put(&(Self::SIZE as u32).to_le_bytes())
            .put(&self.flags.to_le_bytes())
            .put(&self.offset.to_le_bytes())
            .put(&self.addr.to_le_bytes())
            .put(&self.size.to_le_bytes());
        b
    }
}

/// DMA_UNMAP: remove the mappings of `size` bytes at `addr` (the reply repeats it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaUnmap {
    /// Flags (none used).
    pub flags: u32,
    /// The range's I/O virtual address.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
}

impl DmaUnmap {
    /// Bytes on the wire.
    pub const SIZE: usize = 24;

    /// Decodes a DMA_UNMAP payload.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("DMA_UNMAP", bytes, Self::SIZE)?;
        r.argsz(Self::SIZE)?;
        Ok(DmaUnmap { flags: r.u32()?, addr: r.u64()?, size: r.u64()? })
    }

    /// The payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.put(&(Self::SIZE as u32).to_le_bytes())
            .put(&self.flags.to_le_bytes())
            .put(&self.addr.to_le_bytes())
            .put(&self.size.to_le_bytes());
        b
    }
}

/// DEVICE_GET_INFO (`struct vfio_device_info`); the command sends it zeroed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VfioDeviceInfo {
    /// [`DEVICE_FLAGS_RESET`], [`DEVICE_FLAGS_PCI`].
    pub flags: u32,
    /// Regions (indexes `0..num_regions`).
    pub num_regions: u32,
    /// IRQ indexes (`0..num_irqs`).
    pub num_irqs: u32,
}

impl VfioDeviceInfo {
    /// Bytes on the wire.
    pub const SIZE: usize = 16;

    /// Decodes a DEVICE_GET_INFO payload.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("DEVICE_GET_INFO", bytes, Self::SIZE)?;
        r.argsz(Self::SIZE)?;
        Ok(VfioDeviceInfo { flags: r.u32()?, num_regions: r.u32()?, num_irqs: r.u32()? })
    }

    /// The payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.put(&(Self::SIZE as u32).to_le_bytes())
            .put(&self.flags.to_le_bytes())
            .put(&self.num_regions.to_le_bytes())
            .put(&self.num_irqs.to_le_bytes());
        b
    }
}

/// DEVICE_GET_REGION_INFO (`struct vfio_region_info`); the command sets `index` only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VfioRegionInfo {
    /// [`REGION_READ`], [`REGION_WRITE`], [`REGION_MMAP`].
    pub flags: u32,
    /// The region.
    pub index: u32,
    /// Offset of a capability chain (gdrvm sends none and reads none).
    pub cap_offset: u32,
    /// Bytes; 0 when the device has no such region.
    pub size: u64,
    /// With [`REGION_MMAP`], the region's offset in the fd sent with the reply.
    pub offset: u64,
}

impl VfioRegionInfo {
    /// Bytes on the wire.
    pub const SIZE: usize = 32;

    /// Decodes a DEVICE_GET_REGION_INFO payload.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("DEVICE_GET_REGION_INFO", bytes, Self::SIZE)?;
        r.argsz(Self::SIZE)?;
        Ok(VfioRegionInfo { flags: r.u32()?, index: r.u32()?, cap_offset: r.u32()?, size: r.u64()?, offset: r.u64()? })
    }

    /// The payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.put(&(Self::SIZE as u32).to_le_bytes())
            .put(&self.flags.to_le_bytes())
            .put(&self.index.to_le_bytes())
            .put(&self.cap_offset.to_le_bytes())
            .put(&self.size.to_le_bytes())
            .put(&self.offset.to_le_bytes());
        b
    }
}

/// DEVICE_GET_IRQ_INFO (`struct vfio_irq_info`); the command sets `index` only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VfioIrqInfo {
    /// [`IRQ_INFO_EVENTFD`] and VFIO's other IRQ info flags.
    pub flags: u32,
    /// The IRQ index.
    pub index: u32,
    /// Vectors offered.
    pub count: u32,
}

impl VfioIrqInfo {
    /// Bytes on the wire.
    pub const SIZE: usize = 16;

    /// Decodes a DEVICE_GET_IRQ_INFO payload.
    pub fn decode(bytes: &[u8]) -> Result<Self, ProtocolError> {
        let mut r = Reader::new("DEVICE_GET_IRQ_INFO", bytes, Self::SIZE)?;
        r.argsz(Self::SIZE)?;
        Ok(VfioIrqInfo { flags: r.u32()?, index: r.u32()?, count: r.u32()? })
    }

    /// The payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.put(&(Self::SIZE as u32).to_le_bytes())
            .put(&self.flags.to_le_bytes())
            .put(&self.index.to_le_bytes())
            .put(&self.count.to_le_bytes());
        b
    }
}

/// DEVICE_SET_IRQS (`struct vfio_irq_set`), followed by one byte per vector with
/// [`IRQ_SET_DATA_BOOL`]; eventfds travel as SCM_RIGHTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VfioIrqSet {
    /// One `IRQ_SET_DATA_*` and one `IRQ_SET_ACTION_*` flag.
    pub flags: u32,
    /// The IRQ index.
    pub index: u32,
    /// The first vector.
    pub start: u32,
    /// Vectors.
    pub count: u32,
}

impl VfioIrqSet {
    /// Bytes on the wire, before the data.
    pub const SIZE: usize = 20;

    /// Decodes a DEVICE_SET_IRQS payload, returning the data bytes after the structure.
    pub fn decode(bytes: &[u8]) -> Result<(Self, &[u8]), ProtocolError> {
        let mut r = Reader::new("DEVICE_SET_IRQS", bytes, Self::SIZE)?;
        r.argsz(Self::SIZE)?;
        let set = VfioIrqSet { flags: r.u32()?, index: r.u32()?, start: r.u32()?, count: r.u32()? };
        Ok((set, r.rest()))
    }

    /// The payload, followed by `data`.
    pub fn encode(&self, data: &[u8]) -> Vec<u8> {
        let argsz = u32::try_from(Self::SIZE + data.len()).unwrap_or(u32::MAX);
        let mut b = Vec::with_capacity(Self::SIZE + data.len());
        b.put(&argsz.to_le_bytes())
            .put(&self.flags.to_le_bytes())
            .put(&self.index.to_le_bytes())
            .put(&self.start.to_le_bytes())
            .put(&self.count.to_le_bytes())
            .put(data);
        b
    }
}

/// REGION_READ and REGION_WRITE: `count` bytes of region `region` at `offset`. The write
/// command and the read reply carry the data after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RegionAccess {
    /// Offset in the region.
    pub offset: u64,
    /// The region.
    pub region: u32,
    /// Bytes.
    pub count: u32,
}

impl RegionAccess {
    /// Bytes on the wire, before the data.
    pub const SIZE: usize = 16;

    /// Decodes a REGION_READ or REGION_WRITE payload, returning the data after it.
    pub fn decode(bytes: &[u8]) -> Result<(Self, &[u8]), ProtocolError> {
        let mut r = Reader::new("a region access", bytes, Self::SIZE)?;
        let access = RegionAccess { offset: r.u64()?, region: r.u32()?, count: r.u32()? };
        Ok((access, r.rest()))
    }

    /// Decodes a payload that must carry exactly `count` data bytes (a REGION_WRITE
    /// command, a REGION_READ reply).
    pub fn decode_with_data(bytes: &[u8]) -> Result<(Self, &[u8]), ProtocolError> {
        let (access, data) = Self::decode(bytes)?;
        if data.len() != access.count as usize {
            return Err(ProtocolError::DataLength { what: "a region access", count: access.count, got: data.len() });
        }
        Ok((access, data))
    }

    /// The payload, followed by `data`.
    pub fn encode(&self, data: &[u8]) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE + data.len());
        b.put(&self.offset.to_le_bytes()).put(&self.region.to_le_bytes()).put(&self.count.to_le_bytes()).put(data);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vfio_user::test_util::Rng;

    #[test]
    fn test_header_round_trip_and_checks() {
        let h = Header::command(7, Command::RegionRead, 16);
        let bytes = h.encode();
        assert_eq!(bytes, [7, 0, 9, 0, 32, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Header::decode(&bytes).unwrap(), h);
        let e = h.error_reply(libc::EINVAL);
        assert!(e.is_reply() && e.is_error() && !e.no_reply());
        assert_eq!((e.msg_id, e.error_no, e.payload_len()), (7, libc::EINVAL as u32, 0));

        assert!(matches!(Header::decode(&bytes[..15]), Err(ProtocolError::Short { need: 16, got: 15, .. })));
        let mut small = h;
        small.msg_size = 15;
        assert_eq!(Header::decode(&small.encode()), Err(ProtocolError::SizeTooSmall(15)));
        let mut huge = h;
        huge.msg_size = u32::MAX;
        assert_eq!(Header::decode(&huge.encode()), Err(ProtocolError::SizeTooLarge(u32::MAX)));
        let mut odd = h;
        odd.flags = 2;
        assert_eq!(Header::decode(&odd.encode()), Err(ProtocolError::BadType(2)));
    }

    #[test]
    fn test_version_capabilities() {
        let ours = Version::default().encode();
        assert!(ours.ends_with(b"{\"capabilities\":{\"max_msg_fds\":8,\"max_data_xfer_size\":1048576}}\0"));
        assert_eq!(Version::decode(&ours).unwrap(), Version::default());
        // Bare version: the protocol's defaults; unknown keys are ignored.
        let bare = Version::decode(&[0, 0, 1, 0]).unwrap();
        assert_eq!((bare.major, bare.minor, bare.max_msg_fds), (0, 1, 1));
        let other = b"\0\0\x01\0{\"capabilities\":{\"max_msg_fds\":2,\"migration\":{\"pgsize\":4096}},\"x\":1}\0";
        let v = Version::decode(other).unwrap();
        assert_eq!((v.max_msg_fds, v.max_data_xfer_size), (2, DEFAULT_MAX_DATA_XFER));
        for bad in [&b"\0\0\x01\0{"[..], b"\0\0\x01\0[1]", b"\0\0\x01\0{\"capabilities\":{\"max_msg_fds\":-1}}"] {
            assert!(matches!(Version::decode(bad), Err(ProtocolError::Capabilities(_))), "{bad:?}");
        }
        assert!(Version::decode(&[0, 0, 1]).is_err());
    }

    #[test]
    fn test_payload_round_trips() {
        let map = DmaMap { flags: DMA_READ | DMA_WRITE, offset: 0x1000, addr: 0x8000_0000, size: 1 << 30 };
        assert_eq!(DmaMap::decode(&map.encode()).unwrap(), map);
        let unmap = DmaUnmap { flags: 0, addr: 1, size: 2 };
        assert_eq!(DmaUnmap::decode(&unmap.encode()).unwrap(), unmap);
        let info = VfioDeviceInfo { flags: 3, num_regions: 9, num_irqs: 5 };
        assert_eq!(VfioDeviceInfo::decode(&info.encode()).unwrap(), info);
        let region = VfioRegionInfo { flags: 7, index: 2, cap_offset: 0, size: 1 << 24, offset: 4096 };
        assert_eq!(VfioRegionInfo::decode(&region.encode()).unwrap(), region);
        let irq = VfioIrqInfo { flags: 1, index: 2, count: 64 };
        assert_eq!(VfioIrqInfo::decode(&irq.encode()).unwrap(), irq);
        let set = VfioIrqSet { flags: IRQ_SET_DATA_BOOL | IRQ_SET_ACTION_TRIGGER, index: 2, start: 1, count: 2 };
        assert_eq!(VfioIrqSet::decode(&set.encode(&[1, 0])).unwrap(), (set, &[1, 0][..]));
        let access = RegionAccess { offset: 8, region: 7, count: 3 };
        assert_eq!(RegionAccess::decode_with_data(&access.encode(&[1, 2, 3])).unwrap(), (access, &[1, 2, 3][..]));
        assert!(matches!(
            RegionAccess::decode_with_data(&access.encode(&[1])),
            Err(ProtocolError::DataLength { count: 3, got: 1, .. })
        ));
        // argsz smaller than the structure.
        let mut short = map.encode();
        short[0] = 8;
        assert!(matches!(DmaMap::decode(&short), Err(ProtocolError::Argsz { argsz: 8, .. })));
        assert!(matches!(DmaMap::decode(&short[..31]), Err(ProtocolError::Short { need: 32, .. })));
    }

    #[test]
    fn test_decoders_never_panic_on_random_bytes() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..20_000 {
            let b = rng.bytes(64);
            let _ = Header::decode(&b);
            let _ = Version::decode(&b);
            let _ = DmaMap::decode(&b);
            let _ = DmaUnmap::decode(&b);
            let _ = VfioDeviceInfo::decode(&b);
            let _ = VfioRegionInfo::decode(&b);
            let _ = VfioIrqInfo::decode(&b);
            let _ = VfioIrqSet::decode(&b);
            let _ = RegionAccess::decode(&b);
            let _ = RegionAccess::decode_with_data(&b);
            let _ = Command::from_u16(rng.next() as u16);
        }
        // JSON-looking capabilities.
        for _ in 0..2_000 {
            let mut b = vec![0, 0, 1, 0];
            const CHARS: &[u8] = b"{}[]\":,0123456789capbilt_x -";
            b.extend(rng.bytes(40).into_iter().map(|x| CHARS[x as usize % CHARS.len()]));
            let _ = Version::decode(&b);
        }
    }
}
