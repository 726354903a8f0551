//! Writing an initramfs: a cpio newc archive (uncompressed, so the guest kernel unpacks it
//! without a decompressor).

use std::collections::BTreeSet;
use std::io::{BufWriter, Cursor, Write};
use std::path::{Path, PathBuf};

/// What one archive entry holds.
#[derive(Debug, Clone)]
enum Content {
    Dir,
    File { data: Source, mode: u32 },
    Symlink(String),
    CharDev { major: u32, minor: u32 },
}

/// Where a file's bytes come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A file on the host, read when the archive is written.
    Host(PathBuf),
    /// Bytes in memory.
    Bytes(Vec<u8>),
}

/// An initramfs being assembled. Parent directories are added automatically.
#[derive(Debug, Default)]
pub struct Initramfs {
    entries: Vec<(String, Content)>,
    dirs: BTreeSet<String>,
}

impl Initramfs {
    /// An empty archive.
    pub fn new() -> Self {
        Self::default()
    }

    fn parents(&mut self, path: &str) {
        let mut prefix = String::new();
        let parts: Vec<&str> = path.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            if self.dirs.insert(prefix.clone()) {
                self.entries.push((prefix.clone(), Content::Dir));
            }
        }
    }

    fn push(&mut self, path: &str, content: Content) {
        let path = path.trim_start_matches('/').to_owned();
        self.parents(&path);
        if matches!(content, Content::Dir) && !self.dirs.insert(path.clone()) {
            return;
        }
        self.entries.push((path, content));
    }

    /// Adds an empty directory.
    pub fn dir(&mut self, path: &str) {
        self.push(path, Content::Dir);
    }

    /// Adds a file with permission bits `mode` (e.g. 0o755).
    pub fn file(&mut self, path: &str, data: Source, mode: u32) {
        self.push(path, Content::File { data, mode });
    }

    /// Adds a symbolic link to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) {
        self.push(path, Content::Symlink(target.to_owned()));
    }

    /// Adds a character device node.
    pub fn char_dev(&mut self, path: &str, major: u32, minor: u32) {
        self.push(path, Content::CharDev { major, minor });
    }

    /// Writes the archive to the file `out`.
    pub fn write_to(&self, out: &Path) -> std::io::Result<()> {
        self.write(std::fs::File::create(out)?)
    }

    /// Writes the archive to `out`.
    pub fn write(&self, out: impl Write) -> std::io::Result<()> {
        let mut w = BufWriter::new(out);
        for (ino, (path, content)) in (1u32..).zip(&self.entries) {
            let b = cpio::newc::Builder::new(path).ino(ino).uid(0).gid(0);
            let (b, data) = match content {
                Content::Dir => (b.mode(0o040755).nlink(2), Vec::new()),
                Content::File { data, mode } => {
                    let bytes = match data {
                        Source::Host(p) => std::fs::read(p)
                            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))?,
                        Source::Bytes(b) => b.clone(),
                    };
                    (b.mode(0o100000 | mode).nlink(1), bytes)
                }
                Content::Symlink(target) => (b.mode(0o120777).nlink(1), target.as_bytes().to_vec()),
                Content::CharDev { major, minor } => {
                    (b.mode(0o020600).nlink(1).rdev_major(*major).rdev_minor(*minor), Vec::new())
                }
            };
            let size = u32::try_from(data.len())
                .map_err(|_| std::io::Error::other(format!("{path} is over 4 GiB, too big for cpio newc")))?;
            let mut writer = b.write(&mut w, size);
            std::io::copy(&mut Cursor::new(data), &mut writer)?;
            writer.finish()?;
        }
        cpio::newc::trailer(&mut w)?;
        w.flush()
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    #[test]
    fn test_archive_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut fs = Initramfs::new();
        fs.file("/init", Source::Bytes(b"#!agent".to_vec()), 0o755);
        fs.file("lib/modules/virtio_net.ko", Source::Bytes(vec![1, 2, 3]), 0o644);
        fs.symlink("bin/sh", "busybox");
        fs.char_dev("dev/console", 5, 1);
        fs.dir("proc");
        fs.dir("lib");
        let out = dir.path().join("initramfs.cpio");
        fs.write_to(&out).unwrap();

        let data = std::fs::read(&out).unwrap();
        let mut cursor = Cursor::new(&data[..]);
        let mut seen = Vec::new();
        loop {
            let mut r = cpio::newc::Reader::new(&mut cursor).unwrap();
            if r.entry().is_trailer() {
                break;
            }
            let (name, mode, rdev) = (r.entry().name().to_owned(), r.entry().mode(), r.entry().rdev_major());
            let mut body = Vec::new();
            r.read_to_end(&mut body).unwrap();
            r.finish().unwrap();
            seen.push((name, mode, rdev, body));
        }
        let names: Vec<&str> = seen.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(
            names,
            ["init", "lib", "lib/modules", "lib/modules/virtio_net.ko", "bin", "bin/sh", "dev", "dev/console", "proc"]
        );
        assert_eq!(seen[0].1, 0o100755);
        assert_eq!(seen[5].3, b"busybox");
        assert_eq!((seen[7].1, seen[7].2), (0o020600, 5));
    }
}
