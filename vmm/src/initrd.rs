//! The initramfs handed to the guest: the user's archive, checked, with the VMM's
//! expectations appended as a second cpio archive (Linux unpacks concatenated archives).

use std::io::{Cursor, Read};
use std::path::Path;

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

/// Reads `path`, checks that Linux can unpack it, and appends the expectations archive.
pub fn build(path: &Path, expect: &Expectations) -> Result<Vec<u8>, InitrdError> {
    let name = path.display().to_string();
    let mut data = std::fs::read(path).map_err(|source| InitrdError::Read { path: name.clone(), source })?;
    check(&data).map_err(|e| match e {
        Check::Unknown => InitrdError::UnknownFormat { path: name.clone(), magic: hex(&data[..data.len().min(8)]) },
        Check::Corrupt(reason) => InitrdError::Corrupt { path: name.clone(), reason },
    })?;
    // Concatenated archives must each start on a 4-byte boundary.
    data.resize(data.len().next_multiple_of(4), 0);
    data.extend_from_slice(&expectations_archive(expect));
    Ok(data)
}

enum Check {
    Unknown,
    Corrupt(String),
}

fn check(data: &[u8]) -> Result<(), Check> {
    if data.starts_with(b"070701") || data.starts_with(b"070702") {
        return walk_cpio(data).map_err(Check::Corrupt);
    }
    if COMPRESSED_MAGICS.iter().any(|(magic, _)| data.starts_with(magic)) {
        // Compressed archives are checked by the kernel; a bad one panics it at unpack time,
        // which the harness reports from the console.
        return Ok(());
    }
    Err(Check::Unknown)
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
        let data = build(&path, &expect()).unwrap();
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
        let err = build(&path, &expect()).unwrap_err().to_string();
        assert!(err.contains("not a cpio archive") && err.contains("74 68 69 73"), "{err}");

        let archive = expectations_archive(&expect());
        std::fs::write(&path, &archive[..archive.len() / 2]).unwrap();
        let err = build(&path, &expect()).unwrap_err().to_string();
        assert!(err.contains("corrupt cpio archive"), "{err}");

        let err = build(&dir.path().join("missing"), &expect()).unwrap_err().to_string();
        assert!(err.contains("cannot read initrd"), "{err}");
    }

    #[test]
    fn test_compressed_archives_accepted_by_magic() {
        assert!(check(b"\x1f\x8b\x08\x00rest").is_ok());
        assert!(check(b"\xfd7zXZ\x00rest").is_ok());
    }
}
