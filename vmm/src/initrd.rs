//! The initramfs handed to the guest: the user's archive, checked, with the VMM's
//! expectations appended as a second cpio archive (Linux unpacks concatenated archives).

use std::fs::File;
use std::io::{Cursor, Read, Seek, SeekFrom};
use std::path::Path;

use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use gdrvm_model::{Expectations, EXPECT_PATH};

/// Errors reading or extending the initramfs.
#[derive(Debug, thiserror::Error)]
pub enum InitrdError {
    /// The file could not be read.
    #[error("cannot read initrd '{path}'")]
    Read {
        /// The initrd path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not an archive Linux can unpack.
    #[error("initrd '{path}' is not a cpio archive or a compressed one (starts with {magic})")]
    UnknownFormat {
        /// The initrd path.
        path: String,
        /// Its first bytes, in hex.
        magic: String,
    },
    /// An uncompressed archive is cut short or has a broken header.
    #[error("initrd '{path}' is a corrupt cpio archive: {reason}")]
    Corrupt {
        /// The initrd path.
        path: String,
        /// What is wrong.
        reason: String,
    },
}

/// Magic numbers of the compressors Linux can unpack an initramfs from.
const COMPRESSED_MAGICS: &[(&[u8], &str)] = &[
    (b"\x1f\x8b", "gzip"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
    (b"\x02\x21\x4c\x18", "lz4"),
    (b"BZh", "bzip2"),
    (b"\x5d\x00\x00", "lzma"),
    (b"\x89LZO", "lzo"),
];

/// The initramfs as the guest gets it: the user's archive, then (from a 4-byte boundary)
/// the expectations archive. The user's archive goes from its file straight into guest
/// memory, never through a buffer of the VMM's: a 13 MB image would otherwise stay in the
/// VMM's resident memory for the whole run.
pub struct Initrd {
    path: String,
    file: File,
    /// Bytes of the user's archive.
    file_len: u64,
    /// Whether it is an uncompressed newc archive (its headers are checked once loaded).
    newc: bool,
    /// Padding to a 4-byte boundary, then the expectations archive.
    tail: Vec<u8>,
}

/// Something boot can place in guest memory as the initrd.
pub trait InitrdSource: Sync {
    /// Bytes the initrd takes in guest memory.
    fn size(&self) -> usize;
    /// Writes the initrd at `addr` (with [`InitrdSource::size`] bytes of guest RAM there).
    fn load(&self, mem: &GuestMemoryMmap, addr: GuestAddress) -> Result<(), InitrdError>;
}

impl Initrd {
    /// Opens `path` and checks by its first bytes that Linux can unpack it; the
    /// expectations archive is built here. An uncompressed archive's headers are walked
    /// when it is loaded, before any vCPU runs.
    pub fn open(path: &Path, expect: &Expectations) -> Result<Initrd, InitrdError> {
        let name = path.display().to_string();
        let read_err = |source| InitrdError::Read { path: name.clone(), source };
        let mut file = File::open(path).map_err(read_err)?;
        let file_len = file.metadata().map_err(read_err)?.len();
        let mut head = Vec::with_capacity(8);
        (&mut file).take(8).read_to_end(&mut head).map_err(read_err)?;
        let newc = match check_magic(&head) {
            Some(newc) => newc,
            None => return Err(InitrdError::UnknownFormat { path: name, magic: hex(&head) }),
        };
        // Concatenated archives must each start on a 4-byte boundary.
        let mut tail = vec![0u8; (file_len.next_multiple_of(4) - file_len) as usize];
        tail.extend_from_slice(&expectations_archive(expect));
        Ok(Initrd { path: name, file, file_len, newc, tail })
    }
}

impl InitrdSource for Initrd {
    fn size(&self) -> usize {
        self.file_len as usize + self.tail.len()
    }

    fn load(&self, mem: &GuestMemoryMmap, addr: GuestAddress) -> Result<(), InitrdError> {
        let path = || self.path.clone();
        let read_err = |source| InitrdError::Read { path: path(), source };
        let guest_err = |e: vm_memory::GuestMemoryError| read_err(std::io::Error::other(e.to_string()));
        (&self.file).seek(SeekFrom::Start(0)).map_err(read_err)?;
        mem.read_exact_volatile_from(addr, &mut &self.file, self.file_len as usize).map_err(guest_err)?;
        if self.newc {
            let slice = mem.get_slice(addr, self.file_len as usize).map_err(guest_err)?;
            let guard = slice.ptr_guard();
            // SAFETY: get_slice checked that the range lies in one mapped region of guest
            // memory, which outlives this borrow; no vCPU runs yet and no device touches
            // guest memory before the guest drives it, so nothing writes these bytes while
            // they are read through this view.
            let archive = unsafe { std::slice::from_raw_parts(guard.as_ptr(), self.file_len as usize) };
            walk_cpio(archive).map_err(|reason| InitrdError::Corrupt { path: path(), reason })?;
        }
        let tail_at = addr
            .checked_add(self.file_len)
            .ok_or_else(|| guest_err(vm_memory::GuestMemoryError::InvalidGuestAddress(addr)))?;
        mem.write_slice(&self.tail, tail_at).map_err(guest_err)
    }
}

/// Whether Linux can unpack an archive starting with `head`: Some(true) for an uncompressed
/// newc archive, Some(false) for a compressed one (the kernel checks those at unpack time,
/// and a bad one panics it, which the harness reports from the console), None otherwise.
fn check_magic(head: &[u8]) -> Option<bool> {
    if head.starts_with(b"070701") || head.starts_with(b"070702") {
        return Some(true);
    }
    COMPRESSED_MAGICS.iter().any(|(magic, _)| head.starts_with(magic)).then_some(false)
}

/// Walks every header of an uncompressed newc archive up to its trailer.
fn walk_cpio(data: &[u8]) -> Result<(), String> {
    let mut cursor = Cursor::new(data);
    loop {
        let offset = cursor.position();
        let mut reader =
            cpio::newc::Reader::new(&mut cursor).map_err(|e| format!("bad header at byte {offset}: {e}"))?;
        if reader.entry().is_trailer() {
            return Ok(());
        }
        let name = reader.entry().name().to_owned();
        let size = u64::from(reader.entry().file_size());
        let start = reader.offset().map_err(|e| e.to_string())?;
        if start + size > data.len() as u64 {
            return Err(format!("entry '{name}' runs past the end of the file"));
        }
        reader.skip().map_err(|e| format!("entry '{name}': {e}"))?;
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

/// A newc archive holding `/gdrvm/expect.json`.
pub fn expectations_archive(expect: &Expectations) -> Vec<u8> {
    let json = expect.to_json().into_bytes();
    let dir = EXPECT_PATH.trim_start_matches('/').rsplit_once('/').map(|(d, _)| d).unwrap_or("gdrvm");
    let entries = vec![
        (cpio::newc::Builder::new(dir).mode(0o040755).nlink(2), Cursor::new(Vec::new())),
        (cpio::newc::Builder::new(EXPECT_PATH.trim_start_matches('/')).mode(0o100644).nlink(1), Cursor::new(json)),
    ];
    // Writing into a Vec cannot fail.
    cpio::write_cpio(entries.into_iter(), Vec::new()).unwrap_or_default()
}

/// Reads every file of a newc archive (for tests and for checking archives the VMM wrote).
pub fn read_files(data: &[u8]) -> std::io::Result<Vec<(String, Vec<u8>)>> {
    let mut cursor = Cursor::new(data);
    let mut files = Vec::new();
    loop {
        let mut reader = cpio::newc::Reader::new(&mut cursor)?;
        if reader.entry().is_trailer() {
            return Ok(files);
        }
        let name = reader.entry().name().to_owned();
        let mut content = Vec::new();
        reader.read_to_end(&mut content)?;
        reader.finish()?;
        files.push((name, content));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect() -> Expectations {
        Expectations { cpus: 2, memory_bytes: 1 << 30, numa: vec![], pci: vec![], paths: vec![], host: false }
    }

    /// Loads `path` at 1 MiB of a fresh 16 MiB guest memory and returns what the guest gets.
    fn load(path: &Path) -> Result<Vec<u8>, InitrdError> {
        let initrd = Initrd::open(path, &expect())?;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 << 20)]).unwrap();
        initrd.load(&mem, GuestAddress(1 << 20))?;
        let mut data = vec![0u8; initrd.size()];
        mem.read_slice(&mut data, GuestAddress(1 << 20)).unwrap();
        Ok(data)
    }

    #[test]
    fn test_appends_expectations_after_user_archive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("initrd");
        let user = cpio::write_cpio(
            vec![(cpio::newc::Builder::new("init").mode(0o100755), Cursor::new(b"#!x".to_vec()))].into_iter(),
            Vec::new(),
        )
        .unwrap();
        std::fs::write(&path, &user).unwrap();
        let data = load(&path).unwrap();
        let second = user.len().next_multiple_of(4);
        assert_eq!(&data[..user.len()], &user[..]);
        let files = read_files(&data[second..]).unwrap();
        assert_eq!(files[1].0, "gdrvm/expect.json");
        let parsed: Expectations = serde_json::from_slice(&files[1].1).unwrap();
        assert_eq!(parsed, expect());
    }

    #[test]
    fn test_rejects_garbage_and_truncated_archives() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("initrd");
        std::fs::write(&path, b"this is not an archive").unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains("not a cpio archive") && err.contains("74 68 69 73"), "{err}");

        let archive = expectations_archive(&expect());
        std::fs::write(&path, &archive[..archive.len() / 2]).unwrap();
        let err = load(&path).unwrap_err().to_string();
        assert!(err.contains("corrupt cpio archive"), "{err}");

        let err = load(&dir.path().join("missing")).unwrap_err().to_string();
        assert!(err.contains("cannot read initrd"), "{err}");
    }

    #[test]
    fn test_compressed_archives_accepted_by_magic() {
        assert_eq!(check_magic(b"\x1f\x8b\x08\x00rest"), Some(false));
        assert_eq!(check_magic(b"\xfd7zXZ\x00rest"), Some(false));
        assert_eq!(check_magic(b"070701"), Some(true));
        assert_eq!(check_magic(b"MZ"), None);
    }
}
