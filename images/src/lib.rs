//! Reproducible gdrvm guest images from pinned Debian packages.
//!
//! A [`Recipe`] pins the kernel and busybox packages by version and sha256; [`build`]
//! downloads them once into a cache, extracts the vmlinux from the kernel's bzImage,
//! collects the modules the recipe names with their dependencies, and writes an
//! uncompressed cpio initramfs with the caller's extra files (the agent as `/init`).
//! A second build with nothing changed does no work.

mod debian;
mod initramfs;
mod kernel;
mod recipe;
mod repin;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use gdrvm_model::{ImageManifest, IMAGE_MANIFEST_PATH};
use sha2::{Digest, Sha256};

pub use debian::{sha256_file, Archive, REPIN_COMMAND};
pub use initramfs::{Initramfs, Source};
pub use kernel::{extract_vmlinux, ModuleIndex, ResolvedModule};
pub use recipe::{KernelPackage, Modules, Package, Recipe};
pub use repin::{repin, Repinned};

/// Bumped when the layout of built images changes, so old cache entries are rebuilt.
const IMAGE_FORMAT: &str = "gdrvm-image-v1";

/// Errors building an image; each names the file or package at fault.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The recipe is unreadable or invalid.
    #[error("recipe {path}: {reason}")]
    Recipe {
        /// The recipe file.
        path: PathBuf,
        /// What is wrong (with the key).
        reason: String,
    },
    /// A package could not be downloaded.
    #[error("cannot download Debian package {package}: {reason} (offline?)")]
    Download {
        /// `name=version`.
        package: String,
        /// apt-get's error lines.
        reason: String,
    },
    /// apt's lists lack a pinned version and this process may not refresh them.
    #[error("apt's package lists do not have Debian package {package}: they may be older than the pin; run `sudo apt-get update` and try again")]
    StaleLists {
        /// `name=version`.
        package: String,
    },
    /// Even freshly refreshed lists lack a pinned version: it left the archive.
    #[error(
        "Debian's archive no longer serves {package} (it has {}): run `{REPIN_COMMAND}` to pin current versions",
        if available.is_empty() { "no version of it".to_owned() } else { available.join(", ") }
    )]
    LeftArchive {
        /// `name=version`.
        package: String,
        /// The versions the archive serves now, newest first.
        available: Vec<String>,
    },
    /// A downloaded package does not match its pinned hash.
    #[error("Debian package {package} has sha256 {actual}, the recipe pins {expected}")]
    Checksum {
        /// `name=version`.
        package: String,
        /// Pinned hash.
        expected: String,
        /// Hash of the file.
        actual: String,
    },
    /// A host tool is missing or failed.
    #[error("{tool}: {reason} (gdrvm images are built on Debian with apt-get and dpkg-deb)")]
    Tool {
        /// The tool.
        tool: &'static str,
        /// What happened.
        reason: String,
    },
    /// The kernel image is unusable.
    #[error("kernel {path}: {reason}")]
    Kernel {
        /// The kernel file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A module is missing or unreadable.
    #[error("kernel module {module}: {reason}")]
    Module {
        /// Module name or file.
        module: String,
        /// What is wrong.
        reason: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Receives one line per step of long work.
pub type Progress = dyn Fn(&str);

/// A file the caller adds to the image.
#[derive(Debug, Clone)]
pub struct ExtraFile {
    /// Path inside the guest.
    pub guest_path: String,
    /// Its bytes.
    pub source: Source,
    /// Permission bits.
    pub mode: u32,
}

/// A built image.
#[derive(Debug, Clone)]
pub struct BuiltImage {
    /// The extracted kernel (ELF with a PVH note).
    pub vmlinux: PathBuf,
    /// The initramfs.
    pub initramfs: PathBuf,
    /// What is in it.
    pub manifest: ImageManifest,
    /// Whether this call built it (false: the cache was current).
    pub rebuilt: bool,
}

/// The image cache's directory layout, and the archive that fills it.
#[derive(Debug)]
pub struct Cache {
    root: PathBuf,
    archive: Archive,
}

impl Cache {
    /// A cache rooted at `root` (`target/gdrvm/cache` by convention), filled through the
    /// host's apt.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Cache { root: root.into(), archive: Archive::system() }
    }

    /// The same cache filled through `archive` (private apt state, in tests).
    pub fn with_archive(self, archive: Archive) -> Self {
        Cache { archive, ..self }
    }

    fn dir(&self, sub: &str) -> Result<PathBuf, ImageError> {
        let d = self.root.join(sub);
        std::fs::create_dir_all(&d).map_err(|e| ImageError::Io { path: d.clone(), source: e })?;
        Ok(d)
    }

    /// Where an image called `name` is written.
    pub fn image_dir(&self, name: &str) -> PathBuf {
        self.root.join("images").join(name)
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io { path: path.to_owned(), source }
}

fn cache_key(recipe: &Recipe, extras: &[ExtraFile]) -> Result<String, ImageError> {
    let mut h = Sha256::new();
    h.update(IMAGE_FORMAT);
    h.update(&recipe.text);
    for extra in extras {
        h.update(&extra.guest_path);
        h.update(extra.mode.to_le_bytes());
        match &extra.source {
            Source::Bytes(b) => h.update(b),
            Source::Host(p) => {
                let meta = std::fs::metadata(p).map_err(io(p))?;
                let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
                h.update(p.to_string_lossy().as_bytes());
                h.update(meta.len().to_le_bytes());
                h.update(mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
            }
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Returns the verified .deb of a pinned package, downloading it into the cache if needed.
pub fn fetch(pin: &Package, cache: &Cache, progress: &Progress) -> Result<PathBuf, ImageError> {
    debian::fetch(pin, &cache.dir("debs")?, &cache.archive, progress)
}

/// Builds (or finds current in the cache) the image `recipe` describes, with `extras`.
pub fn build(
    recipe: &Recipe,
    extras: &[ExtraFile],
    cache: &Cache,
    progress: &Progress,
) -> Result<BuiltImage, ImageError> {
    let out_dir = cache.image_dir(&recipe.name);
    let key = cache_key(recipe, extras)?;
    let initramfs = out_dir.join("initramfs.cpio");
    let manifest_path = out_dir.join("manifest.json");
    let vmlinux = cache.root.join("kernels").join(&recipe.kernel.release).join("vmlinux");
    if std::fs::read_to_string(out_dir.join("key")).is_ok_and(|k| k == key) && initramfs.exists() && vmlinux.exists() {
        let manifest = std::fs::read(&manifest_path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(manifest) = manifest {
            return Ok(BuiltImage { vmlinux, initramfs, manifest, rebuilt: false });
        }
    }

    let kernel_deb = fetch(&recipe.kernel.pin, cache, progress)?;
    let busybox_deb = fetch(&recipe.busybox, cache, progress)?;
    let unpacked = cache.dir("unpacked")?;
    let kernel_tree = unpacked.join(format!("{}_{}", recipe.kernel.pin.package, recipe.kernel.pin.version));
    let busybox_tree = unpacked.join(format!("{}_{}", recipe.busybox.package, recipe.busybox.version));
    debian::unpack(&kernel_deb, &kernel_tree, progress)?;
    debian::unpack(&busybox_deb, &busybox_tree, progress)?;

    if !vmlinux.exists() {
        let bz = kernel_tree.join("boot").join(format!("vmlinuz-{}", recipe.kernel.release));
        progress(&format!("extracting vmlinux from {}", bz.display()));
        let data = std::fs::read(&bz).map_err(io(&bz))?;
        let elf = extract_vmlinux(&data, &bz)?;
        let dir = vmlinux.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let tmp = vmlinux.with_extension("partial");
        std::fs::write(&tmp, elf).map_err(io(&tmp))?;
        std::fs::rename(&tmp, &vmlinux).map_err(io(&vmlinux))?;
    }

    let index = ModuleIndex::new(&kernel_tree.join("lib/modules").join(&recipe.kernel.release))?;
    let required = index.resolve(&recipe.modules.load)?;
    let optional: Vec<_> =
        index.resolve(&recipe.modules.try_load)?.into_iter().filter(|m| !required.contains(m)).collect();

    progress(&format!("writing the {} initramfs", recipe.name));
    let mut fs = Initramfs::new();
    for d in ["proc", "sys", "dev", "tmp", "root", "etc", "gdrvm"] {
        fs.dir(d);
    }
    fs.char_dev("dev/console", 5, 1);
    let busybox = busybox_tree.join("bin/busybox");
    fs.file("bin/busybox", Source::Host(busybox.clone()), 0o755);
    let mut package_files = Vec::new();
    for p in &recipe.package {
        let deb = fetch(&p.pin, cache, progress)?;
        let tree = unpacked.join(format!("{}_{}", p.pin.package, p.pin.version));
        debian::unpack(&deb, &tree, progress)?;
        for f in &p.files {
            add_from_package(&mut fs, &tree, f, &p.pin.package, &mut package_files)?;
        }
    }
    for applet in busybox_applets(&busybox)? {
        // A packaged tool (pciutils' lspci) wins over busybox's applet of the same name.
        if applet != "bin/busybox" && applet != "linuxrc" && !package_files.contains(&applet) {
            fs.symlink(&applet, "/bin/busybox");
        }
    }
    let guest_module = |m: &ResolvedModule| format!("/lib/modules/{}.ko", m.name);
    for m in required.iter().chain(&optional) {
        fs.file(&guest_module(m), Source::Host(m.path.clone()), 0o644);
    }
    let manifest = ImageManifest {
        name: recipe.name.clone(),
        kernel_release: recipe.kernel.release.clone(),
        modules: required.iter().map(guest_module).collect(),
        optional_modules: optional.iter().map(guest_module).collect(),
    };
    let manifest_json = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
    fs.file(IMAGE_MANIFEST_PATH, Source::Bytes(manifest_json.clone()), 0o644);
    for extra in extras {
        fs.file(&extra.guest_path, extra.source.clone(), extra.mode);
    }
    std::fs::create_dir_all(&out_dir).map_err(io(&out_dir))?;
    let tmp = initramfs.with_extension("partial");
    fs.write_to(&tmp).map_err(io(&tmp))?;
    std::fs::rename(&tmp, &initramfs).map_err(io(&initramfs))?;
    std::fs::write(&manifest_path, &manifest_json).map_err(io(&manifest_path))?;
    std::fs::write(out_dir.join("key"), &key).map_err(io(&out_dir))?;
    Ok(BuiltImage { vmlinux, initramfs, manifest, rebuilt: true })
}

/// Adds `path` from an unpacked package `tree`: a file as it is, a symlink as a symlink
/// plus (once) the file it points to inside the same package.
fn add_from_package(
    fs: &mut Initramfs,
    tree: &Path,
    path: &str,
    package: &str,
    added: &mut Vec<String>,
) -> Result<(), ImageError> {
    if added.iter().any(|a| a == path) {
        return Ok(());
    }
    let host = tree.join(path);
    let missing = |reason: String| ImageError::Recipe {
        path: PathBuf::from(format!("package {package}")),
        reason: format!("file {path}: {reason}"),
    };
    let meta = std::fs::symlink_metadata(&host).map_err(|e| missing(e.to_string()))?;
    added.push(path.to_owned());
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(&host).map_err(io(&host))?;
        let target = target.to_string_lossy().into_owned();
        fs.symlink(path, &target);
        let resolved = match target.strip_prefix('/') {
            Some(abs) => abs.to_owned(),
            None => Path::new(path).parent().unwrap_or(Path::new("")).join(&target).to_string_lossy().into_owned(),
        };
        if tree.join(&resolved).exists() {
            add_from_package(fs, tree, &resolved, package, added)?;
        }
        return Ok(());
    }
    let mode = if meta.permissions().mode() & 0o111 != 0 { 0o755 } else { 0o644 };
    fs.file(path, Source::Host(host), mode);
    Ok(())
}

/// The applet paths busybox installs (`busybox --list-full`: `bin/sh`, `sbin/poweroff`...).
fn busybox_applets(busybox: &Path) -> Result<Vec<String>, ImageError> {
    let out = std::process::Command::new(busybox)
        .arg("--list-full")
        .output()
        .map_err(|e| ImageError::Tool { tool: "busybox", reason: format!("cannot run {}: {e}", busybox.display()) })?;
    Ok(String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect())
}

/// The recipes shipped in the repository.
pub fn recipes_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes")
}
