//! What an image takes from the kernel package: the vmlinux inside its bzImage (so boots
//! skip decompression) and modules with their dependencies.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use object::{Object, ObjectSection};

use crate::ImageError;

const XZ_MAGIC: &[u8] = b"\xfd7zXZ\x00";
const ZSTD_MAGIC: &[u8] = b"\x28\xb5\x2f\xfd";
/// boot_params offsets (Documentation/arch/x86/boot.rst).
const SETUP_SECTS: usize = 0x1f1;
const HEADER_MAGIC: usize = 0x202;
const PAYLOAD_OFFSET: usize = 0x248;
const PAYLOAD_LENGTH: usize = 0x24c;

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(data.get(at..at + 4)?.try_into().ok()?))
}

/// Extracts the ELF vmlinux from a bzImage whose payload is xz- (Debian's 6.1) or
/// zstd-compressed (Debian's 6.12).
pub fn extract_vmlinux(bzimage: &[u8], name: &Path) -> Result<Vec<u8>, ImageError> {
    let bad = |reason: &str| ImageError::Kernel { path: name.to_owned(), reason: reason.to_owned() };
    if bzimage.get(HEADER_MAGIC..HEADER_MAGIC + 4) != Some(b"HdrS") {
        return Err(bad("not a bzImage (no HdrS header)"));
    }
    let setup_sects = match bzimage.get(SETUP_SECTS) {
        Some(0) => 4,
        Some(&n) => usize::from(n),
        None => return Err(bad("truncated header")),
    };
    let offset = u32_at(bzimage, PAYLOAD_OFFSET).ok_or_else(|| bad("truncated header"))? as usize;
    let length = u32_at(bzimage, PAYLOAD_LENGTH).ok_or_else(|| bad("truncated header"))? as usize;
    let start = (setup_sects + 1) * 512 + offset;
    let payload = bzimage.get(start..start + length).ok_or_else(|| bad("payload runs past the end of the file"))?;
    let vmlinux = if payload.starts_with(XZ_MAGIC) {
        xz_single_stream(payload).map_err(|e| bad(&format!("xz payload does not decompress: {e}")))?
    } else if payload.starts_with(ZSTD_MAGIC) {
        zstd_single_frame(payload).map_err(|e| bad(&format!("zstd payload does not decompress: {e}")))?
    } else {
        return Err(bad("payload is neither xz- nor zstd-compressed (the kernels gdrvm reads)"));
    };
    if !vmlinux.starts_with(b"\x7fELF") {
        return Err(bad("decompressed payload is not an ELF vmlinux"));
    }
    Ok(vmlinux)
}

/// Decompresses the first zstd frame of `data`, ignoring what follows (the size the
/// kernel appends).
fn zstd_single_frame(data: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut input = data;
    let mut decoder = ruzstd::decoding::StreamingDecoder::new(&mut input).map_err(std::io::Error::other)?;
    let mut out = Vec::with_capacity(data.len() * 4);
    decoder.read_to_end(&mut out)?;
    Ok(out)
}

/// Decompresses the first xz stream of `data` and ignores what follows it (the kernel
/// appends the uncompressed size, which a multi-stream reader takes for a corrupt stream).
fn xz_single_stream(data: &[u8]) -> Result<Vec<u8>, xz2::stream::Error> {
    let mut stream = xz2::stream::Stream::new_stream_decoder(u64::MAX, 0)?;
    let mut out = Vec::with_capacity(data.len() * 5);
    loop {
        let consumed = stream.total_in() as usize;
        if out.capacity() - out.len() < 1 << 20 {
            out.reserve(16 << 20);
        }
        match stream.process_vec(&data[consumed..], &mut out, xz2::stream::Action::Finish)? {
            xz2::stream::Status::StreamEnd => return Ok(out),
            _ if stream.total_in() as usize == data.len() && out.len() < out.capacity() => {
                return Err(xz2::stream::Error::Data);
            }
            _ => {}
        }
    }
}

/// The modules of one kernel tree, by name (`-` folded to `_`, as the kernel does).
pub struct ModuleIndex {
    root: PathBuf,
    paths: BTreeMap<String, PathBuf>,
    builtin: HashSet<String>,
}

/// A module and where it is, in load order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedModule {
    /// Module name.
    pub name: String,
    /// Its .ko in the unpacked package.
    pub path: PathBuf,
}

/// A module's name from its file: `virtio_net.ko`, or `virtio_net.ko.xz` as Debian's
/// 6.12 packages ship them.
fn module_name(file: &Path) -> Option<String> {
    let file = file.file_name()?.to_str()?;
    let name = file.strip_suffix(".ko").or_else(|| file.strip_suffix(".ko.xz"))?;
    Some(name.replace('-', "_"))
}

/// The bytes of a module file, decompressed when it is a `.ko.xz`: the guest loads plain
/// ELF modules, whatever its kernel's own decompression support.
pub fn module_bytes(ko: &Path) -> Result<Vec<u8>, ImageError> {
    let data = std::fs::read(ko).map_err(|e| ImageError::Io { path: ko.to_owned(), source: e })?;
    if !data.starts_with(XZ_MAGIC) {
        return Ok(data);
    }
    xz_single_stream(&data).map_err(|e| ImageError::Module {
        module: ko.display().to_string(),
        reason: format!("xz-compressed module does not decompress: {e}"),
    })
}

impl ModuleIndex {
    /// Indexes `lib/modules/<release>` of an unpacked kernel package.
    pub fn new(modules_dir: &Path) -> Result<ModuleIndex, ImageError> {
        let mut paths = BTreeMap::new();
        let mut stack = vec![modules_dir.join("kernel")];
        while let Some(dir) = stack.pop() {
            let entries = std::fs::read_dir(&dir).map_err(|e| ImageError::Io { path: dir.clone(), source: e })?;
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                } else if let Some(name) = module_name(&path) {
                    paths.insert(name, path);
                }
            }
        }
        let builtin = std::fs::read_to_string(modules_dir.join("modules.builtin"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| module_name(Path::new(l)))
            .collect();
        Ok(ModuleIndex { root: modules_dir.to_owned(), paths, builtin })
    }

    /// `names` and everything they depend on (from each .ko's `.modinfo` `depends=`),
    /// dependencies first, each once. Built-in modules are left out: nothing to load.
    pub fn resolve(&self, names: &[String]) -> Result<Vec<ResolvedModule>, ImageError> {
        let mut order = Vec::new();
        let mut seen = HashSet::new();
        for name in names {
            self.visit(name, &mut seen, &mut order, &mut Vec::new())?;
        }
        Ok(order)
    }

    fn visit(
        &self,
        name: &str,
        seen: &mut HashSet<String>,
        order: &mut Vec<ResolvedModule>,
        chain: &mut Vec<String>,
    ) -> Result<(), ImageError> {
        // Names in .modinfo keep the file's dashes (vfio-pci-core); the kernel folds them.
        let name = &name.replace('-', "_");
        if seen.contains(name) || self.builtin.contains(name) {
            return Ok(());
        }
        let path = self.paths.get(name).ok_or_else(|| ImageError::Module {
            module: name.to_owned(),
            reason: format!(
                "no {name}.ko under {}{}",
                self.root.display(),
                chain.last().map(|p| format!(" (needed by {p})")).unwrap_or_default()
            ),
        })?;
        if chain.iter().any(|c| c == name) {
            return Err(ImageError::Module {
                module: name.to_owned(),
                reason: format!("dependency cycle: {}", chain.join(" -> ")),
            });
        }
        chain.push(name.to_owned());
        for dep in depends(path)? {
            self.visit(&dep, seen, order, chain)?;
        }
        chain.pop();
        seen.insert(name.to_owned());
        order.push(ResolvedModule { name: name.to_owned(), path: path.clone() });
        Ok(())
    }
}

/// The `depends=` list in a module's `.modinfo` section.
pub fn depends(ko: &Path) -> Result<Vec<String>, ImageError> {
    let bad = |reason: String| ImageError::Module { module: ko.display().to_string(), reason };
    let data = module_bytes(ko)?;
    let file = object::File::parse(&*data).map_err(|e| bad(format!("not an ELF module: {e}")))?;
    let section = file.section_by_name(".modinfo").ok_or_else(|| bad("no .modinfo section".into()))?;
    let info = section.data().map_err(|e| bad(e.to_string()))?;
    Ok(info
        .split(|b| *b == 0)
        .filter_map(|kv| kv.strip_prefix(b"depends="))
        .flat_map(|list| {
            String::from_utf8_lossy(list).split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect::<Vec<_>>()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// A fake bzImage: header fields pointing at an xz stream of a tiny "ELF", followed by
    /// the 4-byte size the kernel build appends.
    fn fake_bzimage(payload_body: &[u8]) -> Vec<u8> {
        let mut enc = xz2::write::XzEncoder::new(Vec::new(), 6);
        enc.write_all(payload_body).unwrap();
        bzimage_around(enc.finish().unwrap(), payload_body.len())
    }

    /// The same with a zstd payload, as Debian's 6.12 kernels have.
    fn fake_zstd_bzimage(payload_body: &[u8]) -> Vec<u8> {
        let zst = ruzstd::encoding::compress_to_vec(payload_body, ruzstd::encoding::CompressionLevel::Fastest);
        bzimage_around(zst, payload_body.len())
    }

    fn bzimage_around(mut xz: Vec<u8>, size: usize) -> Vec<u8> {
        xz.extend_from_slice(&(size as u32).to_le_bytes());
        let mut img = vec![0u8; 2 * 512];
        img[SETUP_SECTS] = 1;
        img[HEADER_MAGIC..HEADER_MAGIC + 4].copy_from_slice(b"HdrS");
        img[PAYLOAD_OFFSET..PAYLOAD_OFFSET + 4].copy_from_slice(&16u32.to_le_bytes());
        img[PAYLOAD_LENGTH..PAYLOAD_LENGTH + 4].copy_from_slice(&(xz.len() as u32).to_le_bytes());
        img.extend_from_slice(&[0u8; 16]);
        img.extend_from_slice(&xz);
        img
    }

    #[test]
    fn test_extracts_xz_payload_ignoring_trailer() {
        let body = [b"\x7fELF".as_slice(), &vec![0x90; 100_000]].concat();
        let out = extract_vmlinux(&fake_bzimage(&body), Path::new("vmlinuz")).unwrap();
        assert_eq!(out, body);
    }

    #[test]
    fn test_extracts_zstd_payload_ignoring_trailer() {
        let body = [b"\x7fELF".as_slice(), &vec![0x90; 100_000]].concat();
        let out = extract_vmlinux(&fake_zstd_bzimage(&body), Path::new("vmlinuz")).unwrap();
        assert_eq!(out, body);
    }

    #[test]
    fn test_xz_modules_are_named_and_decompressed() {
        let dir = tempfile::tempdir().unwrap();
        let ko = dir.path().join("virtio-net.ko.xz");
        let mut enc = xz2::write::XzEncoder::new(Vec::new(), 6);
        enc.write_all(b"\x7fELF module").unwrap();
        std::fs::write(&ko, enc.finish().unwrap()).unwrap();
        assert_eq!(module_name(&ko).as_deref(), Some("virtio_net"));
        assert_eq!(module_bytes(&ko).unwrap(), b"\x7fELF module");
        let plain = dir.path().join("plain.ko");
        std::fs::write(&plain, b"\x7fELF plain").unwrap();
        assert_eq!(module_bytes(&plain).unwrap(), b"\x7fELF plain");
    }

    #[test]
    fn test_rejects_non_kernels() {
        let e = extract_vmlinux(b"not a kernel", Path::new("k")).unwrap_err().to_string();
        assert!(e.contains("no HdrS"), "{e}");
        let mut img = fake_bzimage(b"\x7fELF");
        let start = 2 * 512 + 16;
        img[start] = 0; // break the xz magic
        let e = extract_vmlinux(&img, Path::new("k")).unwrap_err().to_string();
        assert!(e.contains("neither xz- nor zstd"), "{e}");
        let e = extract_vmlinux(&fake_bzimage(b"MZ not elf"), Path::new("k")).unwrap_err().to_string();
        assert!(e.contains("not an ELF"), "{e}");
    }
}
