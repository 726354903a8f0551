//! Reproducible gdrvm guest images from pinned Debian packages.
//!
//! A [`Recipe`] pins the kernel and busybox packages by version and sha256; [`build`]
//! downloads them once into a cache, extracts the vmlinux from the kernel's bzImage,
//! collects the modules the recipe names with their dependencies, and writes an
//! uncompressed cpio initramfs with the caller's extra files (the agent as `/init`).
//! A second build with nothing changed does no work.

mod boot_elf;
mod debian;
mod initramfs;
mod kernel;
mod kernels;
mod recipe;
mod repin;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use gdrvm_model::{ImageManifest, IMAGE_MANIFEST_PATH};
use sha2::{Digest, Sha256};

pub use debian::{sha256_file, Archive, REPIN_COMMAND};
pub use initramfs::{Initramfs, Source};
pub use kernel::{extract_vmlinux, module_bytes, ModuleIndex, ResolvedModule};
pub use kernels::{
    kernel_order, lock_path, update as update_kernel_lock, KernelLock, LockChanges, LockedKernel, DEBIAN_PREFIX,
};
pub use recipe::{FilesPackage, KernelPackage, Layer, Modules, Package, Recipe};

pub use repin::{repin, Repinned};

/// Bumped when the layout of built images changes, so old cache entries are rebuilt.
const IMAGE_FORMAT: &str = "gdrvm-image-v2";

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
    /// A kernel that the lock file does not pin (or the archive no longer serves).
    #[error(
        "kernel {kernel}: {} does not pin it (it pins {}); `cargo xtask kernels update` refreshes it from Debian's archive",
        lock_path().display(),
        if known.is_empty() { "none".to_owned() } else { known.join(", ") }
    )]
    UnknownKernel {
        /// The kernel asked for.
        kernel: String,
        /// The kernels pinned.
        known: Vec<String>,
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
    /// The recipe's layers it belongs to (as [`FilesPackage::layers`]); none: every image.
    pub layers: Vec<String>,
}

/// Where an image's kernel and its modules come from, when not the recipe's package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelSource {
    /// A pinned Debian package (from the kernels lock).
    Package(KernelPackage),
    /// A kernel built from a tree: its image (`arch/x86/boot/bzImage`, or an ELF vmlinux
    /// with a PVH note) and where `make modules_install INSTALL_MOD_PATH=DIR` put its
    /// modules (DIR, or `DIR/lib/modules/<release>`).
    Built {
        /// bzImage or vmlinux.
        image: PathBuf,
        /// INSTALL_MOD_PATH, or the `lib/modules/<release>` under it.
        modules: PathBuf,
    },
}

/// What a build changes from its recipe.
#[derive(Debug, Clone, Default)]
pub struct Customization {
    /// Another kernel than the recipe's (`None`: the recipe's).
    pub kernel: Option<KernelSource>,
    /// Out-of-tree modules (.ko built against that kernel), loaded after the recipe's
    /// required ones, their in-tree dependencies first; one that fails to load makes the
    /// guest report "cannot test".
    pub user_modules: Vec<PathBuf>,
    /// Files the caller adds.
    pub extras: Vec<ExtraFile>,
    /// The recipe's layers the image has.
    pub layers: Layers,
}

/// Which of its recipe's layers an image has.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub enum Layers {
    /// Every layer.
    #[default]
    All,
    /// These layers only (none: the base alone).
    Only(Vec<String>),
}

impl Layers {
    /// Whether files of `layers` (none: every image's) go into an image with these layers.
    fn admit(&self, layers: &[String]) -> bool {
        match self {
            Layers::All => true,
            Layers::Only(have) => layers.is_empty() || layers.iter().any(|l| have.contains(l)),
        }
    }

    /// The layers of `recipe` that a run with kernel command line `cmdline` needs: those
    /// of the agent's suites there ([`gdrvm_model::cmdline_suites`]), or all for a shell.
    pub fn for_cmdline(recipe: &Recipe, cmdline: &str) -> Layers {
        if gdrvm_model::cmdline_shell(cmdline) {
            return Layers::All;
        }
        let suites = gdrvm_model::cmdline_suites(cmdline);
        let needed = recipe.layer.iter().filter(|(_, l)| l.suites.iter().any(|s| suites.contains(s)));
        Layers::Only(needed.map(|(name, _)| name.clone()).collect())
    }

    /// The image name for recipe `name` with these layers: `default` with every layer,
    /// `default.base` with none, `default.base+lspci` with lspci only.
    pub fn image_name(&self, name: &str) -> String {
        match self {
            Layers::All => name.to_owned(),
            Layers::Only(layers) => {
                std::iter::once(format!("{name}.base")).chain(layers.iter().cloned()).collect::<Vec<_>>().join("+")
            }
        }
    }
}

/// A built image.
#[derive(Debug, Clone)]
pub struct BuiltImage {
    /// The kernel to boot: an ELF vmlinux with a PVH note (for a tree-built kernel whose
    /// payload cannot be extracted, its bzImage).
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

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hashes a host file by name, size and modification time (cheap; changes when rebuilt).
fn hash_file_stamp(h: &mut Sha256, p: &Path) -> Result<(), ImageError> {
    let meta = std::fs::metadata(p).map_err(io(p))?;
    let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
    h.update(p.to_string_lossy().as_bytes());
    h.update(meta.len().to_le_bytes());
    h.update(mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
    Ok(())
}

fn cache_key(recipe: &Recipe, custom: &Customization, kernel: &ResolvedKernel) -> Result<String, ImageError> {
    let mut h = Sha256::new();
    h.update(IMAGE_FORMAT);
    h.update(&recipe.text);
    h.update(kernel.vmlinux.to_string_lossy().as_bytes());
    h.update(kernel.modules_dir.to_string_lossy().as_bytes());
    for m in &custom.user_modules {
        // By content: a bisection rebuilds the module at the same path within a second.
        let data = std::fs::read(m).map_err(io(m))?;
        h.update(m.to_string_lossy().as_bytes());
        h.update(Sha256::digest(&data));
    }
    h.update(format!("{:?}", custom.layers));
    for extra in &custom.extras {
        h.update(&extra.guest_path);
        h.update(extra.layers.join(","));
        h.update(extra.mode.to_le_bytes());
        match &extra.source {
            Source::Bytes(b) => h.update(b),
            Source::Host(p) => hash_file_stamp(&mut h, p)?,
        }
    }
    Ok(hex(&h.finalize()))
}

/// The cached kernel's file name: a compacted vmlinux (a cache from before compaction,
/// named `vmlinux`, is left alone and no longer used).
const BOOT_VMLINUX: &str = "vmlinux.boot";

/// The kernel an image boots, ready: its vmlinux in the cache and its modules' directory.
struct ResolvedKernel {
    vmlinux: PathBuf,
    modules_dir: PathBuf,
    release: String,
}

/// Writes the kernel of `image` to `vmlinux` if missing: its ELF vmlinux (an ELF already, or
/// extracted from an xz or zstd bzImage, so boots skip the decompressor), compacted (see
/// [`boot_elf`]: its zero runs left out of the file, so boots copy half as much). With
/// `keep_bzimage`, a bzImage whose payload cannot be extracted (gzip, lz4: a tree's
/// default) is kept as it is; the VMM boots bzImages too, only slower.
fn place_vmlinux(image: &Path, vmlinux: &Path, keep_bzimage: bool, progress: &Progress) -> Result<(), ImageError> {
    if vmlinux.exists() {
        return Ok(());
    }
    progress(&format!("extracting vmlinux from {}", image.display()));
    let data = std::fs::read(image).map_err(io(image))?;
    let elf = if data.starts_with(b"\x7fELF") {
        data
    } else {
        match extract_vmlinux(&data, image) {
            Ok(elf) => elf,
            Err(e) if keep_bzimage && data.get(0x202..0x206) == Some(b"HdrS") => {
                progress(&format!("booting the bzImage as it is ({e})"));
                data
            }
            Err(e) => return Err(e),
        }
    };
    let elf = if elf.starts_with(b"\x7fELF") {
        match boot_elf::compact(&elf) {
            Ok(small) => {
                progress(&format!(
                    "vmlinux compacted: {} MB of {} MB kept in the file, the rest zeros",
                    small.len() >> 20,
                    elf.len() >> 20
                ));
                small
            }
            Err(e) => {
                progress(&format!("booting the vmlinux uncompacted ({e})"));
                elf
            }
        }
    } else {
        elf
    };
    let dir = vmlinux.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = vmlinux.with_extension("partial");
    std::fs::write(&tmp, elf).map_err(io(&tmp))?;
    std::fs::rename(&tmp, vmlinux).map_err(io(vmlinux))
}

/// Fetches and unpacks a kernel package, or finds a built kernel's files.
fn resolve_kernel(source: &KernelSource, cache: &Cache, progress: &Progress) -> Result<ResolvedKernel, ImageError> {
    match source {
        KernelSource::Package(kernel) => {
            let deb = fetch(&kernel.pin, cache, progress)?;
            let tree = cache.dir("unpacked")?.join(format!("{}_{}", kernel.pin.package, kernel.pin.version));
            debian::unpack(&deb, &tree, progress)?;
            let vmlinux = cache.root.join("kernels").join(&kernel.release).join(BOOT_VMLINUX);
            place_vmlinux(&tree.join("boot").join(format!("vmlinuz-{}", kernel.release)), &vmlinux, false, progress)?;
            Ok(ResolvedKernel {
                vmlinux,
                modules_dir: tree.join("lib/modules").join(&kernel.release),
                release: kernel.release.clone(),
            })
        }
        KernelSource::Built { image, modules } => {
            let bad = |path: &Path, reason: String| ImageError::Kernel { path: path.to_owned(), reason };
            let modules_dir = built_modules_dir(modules).map_err(|r| bad(modules, r))?;
            let release = modules_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            // By content: a kernel tree rebuilds the same release with other code.
            let data = std::fs::read(image).map_err(io(image))?;
            let digest = hex(&Sha256::digest(&data));
            let vmlinux = cache.root.join("kernels").join(format!("built-{}", &digest[..16])).join(BOOT_VMLINUX);
            place_vmlinux(image, &vmlinux, true, progress)?;
            Ok(ResolvedKernel { vmlinux, modules_dir, release })
        }
    }
}

/// The `lib/modules/<release>` directory of a `modules_install` under `dir` (or `dir`
/// itself when it is one).
fn built_modules_dir(dir: &Path) -> Result<PathBuf, String> {
    if dir.join("kernel").is_dir() && dir.join("modules.builtin").is_file() {
        return Ok(dir.to_owned());
    }
    let root = dir.join("lib/modules");
    let releases: Vec<PathBuf> = std::fs::read_dir(&root)
        .map_err(|e| format!("no lib/modules/<release> from `make modules_install INSTALL_MOD_PATH=...` here: {e}"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("kernel").is_dir())
        .collect();
    match releases.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err("lib/modules has no <release>/kernel directory".into()),
        many => Err(format!(
            "lib/modules has {} releases ({}); name one: --modules {}/lib/modules/<release>",
            many.len(),
            many.iter().filter_map(|p| p.file_name()).map(|n| n.to_string_lossy()).collect::<Vec<_>>().join(", "),
            dir.display()
        )),
    }
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
    let custom = Customization { extras: extras.to_vec(), ..Customization::default() };
    build_custom(recipe, &custom, &recipe.name, cache, progress)
}

/// Builds (or finds current in the cache) the image `recipe` describes as `custom` changes
/// it, under the image name `name` (one cache entry per name: a matrix's cells with
/// different kernels each keep theirs).
pub fn build_custom(
    recipe: &Recipe,
    custom: &Customization,
    name: &str,
    cache: &Cache,
    progress: &Progress,
) -> Result<BuiltImage, ImageError> {
    let out_dir = cache.image_dir(name);
    let kernel_source = custom.kernel.clone().unwrap_or_else(|| KernelSource::Package(recipe.kernel.clone()));
    let kernel = resolve_kernel(&kernel_source, cache, progress)?;
    let key = cache_key(recipe, custom, &kernel)?;
    let initramfs = out_dir.join("initramfs.cpio");
    let manifest_path = out_dir.join("manifest.json");
    let vmlinux = kernel.vmlinux.clone();
    if std::fs::read_to_string(out_dir.join("key")).is_ok_and(|k| k == key) && initramfs.exists() {
        let manifest = std::fs::read(&manifest_path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        if let Some(manifest) = manifest {
            return Ok(BuiltImage { vmlinux, initramfs, manifest, rebuilt: false });
        }
    }

    check_layers(recipe, custom)?;
    let busybox_deb = fetch(&recipe.busybox, cache, progress)?;
    let unpacked = cache.dir("unpacked")?;
    let busybox_tree = unpacked.join(format!("{}_{}", recipe.busybox.package, recipe.busybox.version));
    debian::unpack(&busybox_deb, &busybox_tree, progress)?;

    let index = ModuleIndex::new(&kernel.modules_dir)?;
    let required = index.resolve(&recipe.modules.load)?;
    let optional: Vec<_> =
        index.resolve(&recipe.modules.try_load)?.into_iter().filter(|m| !required.contains(m)).collect();
    let mut on_demand_names = recipe.modules.on_demand.clone();
    for (name, layer) in &recipe.layer {
        if custom.layers.admit(std::slice::from_ref(name)) {
            on_demand_names.extend(layer.on_demand.iter().cloned());
        }
    }
    let on_demand: Vec<_> = index
        .resolve(&on_demand_names)?
        .into_iter()
        .filter(|m| !required.contains(m) && !optional.contains(m))
        .collect();
    // Out-of-tree modules: their in-tree dependencies join the required ones.
    let mut user = Vec::new();
    for ko in &custom.user_modules {
        let bad = |reason: String| ImageError::Module { module: ko.display().to_string(), reason };
        let name = ko
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".ko"))
            .ok_or_else(|| bad("not a .ko file".into()))?
            .replace('-', "_");
        user.push(ResolvedModule { name, path: ko.clone() });
    }
    let mut required = required;
    for m in &user {
        let deps: Vec<String> = kernel::depends(&m.path)?;
        for d in index.resolve(&deps)? {
            if !required.contains(&d) {
                required.push(d);
            }
        }
    }

    progress(&format!("writing the {name} initramfs"));
    let mut fs = Initramfs::new();
    for d in ["proc", "sys", "dev", "tmp", "root", "etc", "gdrvm"] {
        fs.dir(d);
    }
    fs.char_dev("dev/console", 5, 1);
    let busybox = busybox_tree.join("bin/busybox");
    fs.file("bin/busybox", Source::Host(busybox.clone()), 0o755);
    let mut package_files = Vec::new();
    for p in recipe.package.iter().filter(|p| custom.layers.admit(&p.layers)) {
        let deb = fetch(&p.pin, cache, progress)?;
        let tree = unpacked.join(format!("{}_{}", p.pin.package, p.pin.version));
        debian::unpack(&deb, &tree, progress)?;
        for f in &p.files {
            add_from_package(&mut fs, &tree, f, &p.pin.package, &mut package_files)?;
        }
    }
    for applet in busybox_applets(&busybox)? {
        // A packaged tool (pciutils' lspci) wins over busybox's applet of the same name.
        // No modprobe where the kernel runs it ([`KERNEL_MODPROBE`]).
        if applet != "bin/busybox"
            && applet != "linuxrc"
            && applet != KERNEL_MODPROBE
            && !package_files.contains(&applet)
        {
            fs.symlink(&applet, "/bin/busybox");
        }
    }
    let guest_module = |m: &ResolvedModule| format!("/lib/modules/{}.ko", m.name);
    for m in required.iter().chain(&optional).chain(&on_demand).chain(&user) {
        let source = if m.path.extension().is_some_and(|x| x == "xz") {
            Source::Bytes(module_bytes(&m.path)?)
        } else {
            Source::Host(m.path.clone())
        };
        fs.file(&guest_module(m), source, 0o644);
    }
    let manifest = ImageManifest {
        name: name.to_owned(),
        kernel_release: kernel.release.clone(),
        user_modules: user.iter().map(guest_module).collect(),
        modules: required.iter().map(guest_module).collect(),
        optional_modules: optional.iter().map(guest_module).collect(),
        on_demand_modules: on_demand.iter().map(guest_module).collect(),
        left_out_layers: recipe
            .layer
            .iter()
            .filter(|(name, _)| !custom.layers.admit(std::slice::from_ref(*name)))
            .map(|(name, layer)| (name.clone(), layer.suites.clone()))
            .collect(),
    };
    let manifest_json = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
    fs.file(IMAGE_MANIFEST_PATH, Source::Bytes(manifest_json.clone()), 0o644);
    for extra in custom.extras.iter().filter(|e| custom.layers.admit(&e.layers)) {
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

/// Checks that every layer `custom` names (its choice, its extra files') is one of
/// `recipe`'s.
fn check_layers(recipe: &Recipe, custom: &Customization) -> Result<(), ImageError> {
    let chosen = match &custom.layers {
        Layers::All => &[][..],
        Layers::Only(layers) => layers.as_slice(),
    };
    let named = chosen
        .iter()
        .map(|l| (l, "the image's layers".to_owned()))
        .chain(custom.extras.iter().flat_map(|e| e.layers.iter().map(|l| (l, format!("extra file {}", e.guest_path)))));
    for (layer, whose) in named {
        if !recipe.layer.contains_key(layer) {
            return Err(ImageError::Recipe {
                path: recipe.path.clone(),
                reason: format!(
                    "{whose}: '{layer}' is not a layer of this recipe (it has {})",
                    recipe.layer.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            });
        }
    }
    Ok(())
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

/// Where the kernel starts modprobe for its own module requests (Debian's
/// `CONFIG_MODPROBE_PATH`). The image leaves it out: busybox's modprobe cannot load this
/// image's modules (they sit flat in `/lib/modules`, with no `modules.dep`), and the agent
/// loads every module itself, dependencies and run-time requests included. With it, each
/// request still started a process that failed: the crypto self-tests ask for about six at
/// boot, and each costs tens of milliseconds, and hundreds of exits, when nested. Without
/// it, a request fails at once.
const KERNEL_MODPROBE: &str = "sbin/modprobe";

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

#[cfg(test)]
mod tests {
    use super::*;

    fn release_tree(root: &Path, release: &str) -> PathBuf {
        let dir = root.join("lib/modules").join(release);
        std::fs::create_dir_all(dir.join("kernel")).unwrap();
        std::fs::write(dir.join("modules.builtin"), "").unwrap();
        dir
    }

    #[test]
    fn test_layers_admit_and_name_images() {
        let some = Layers::Only(vec!["lspci".into()]);
        let base = Layers::Only(vec![]);
        assert!(some.admit(&[]) && base.admit(&[]) && Layers::All.admit(&["rdma".into()]));
        assert!(some.admit(&["lspci".into(), "rdma".into()]));
        assert!(!some.admit(&["rdma".into()]) && !base.admit(&["lspci".into()]));
        assert_eq!(Layers::All.image_name("default"), "default");
        let recipe = Recipe::load(&recipes_dir().join("default.toml")).unwrap();
        assert_eq!(Layers::for_cmdline(&recipe, "quiet gdrvm.suites=smoke,topology"), some);
        assert_eq!(Layers::for_cmdline(&recipe, "quiet"), base);
        assert_eq!(
            Layers::for_cmdline(&recipe, "gdrvm.suites=gpu,rdma"),
            Layers::Only(vec!["gpu".into(), "rdma".into()])
        );
        assert_eq!(Layers::for_cmdline(&recipe, "gdrvm.shell"), Layers::All);
        assert_eq!(base.image_name("default"), "default.base");
        assert_eq!(Layers::Only(vec!["lspci".into(), "rdma".into()]).image_name("default"), "default.base+lspci+rdma");
    }

    #[test]
    fn test_unknown_layers_are_refused_naming_whose() {
        let recipe = Recipe::load(&recipes_dir().join("default.toml")).unwrap();
        let extra = |layers: &[&str]| ExtraFile {
            guest_path: "/usr/bin/x".into(),
            source: Source::Bytes(vec![]),
            mode: 0o755,
            layers: layers.iter().map(|l| l.to_string()).collect(),
        };
        let custom =
            |layers: Layers, extras: Vec<ExtraFile>| Customization { layers, extras, ..Customization::default() };
        assert!(check_layers(&recipe, &custom(Layers::Only(vec!["gpu".into()]), vec![extra(&["rdma"])])).is_ok());
        let e = check_layers(&recipe, &custom(Layers::Only(vec!["cuda".into()]), vec![])).unwrap_err().to_string();
        assert!(e.contains("default.toml") && e.contains("'cuda'") && e.contains("gpu, lspci, rdma"), "{e}");
        let e = check_layers(&recipe, &custom(Layers::All, vec![extra(&["verbs"])])).unwrap_err().to_string();
        assert!(e.contains("extra file /usr/bin/x") && e.contains("'verbs'"), "{e}");
    }

    #[test]
    fn test_built_modules_dir_finds_the_release_under_install_mod_path() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = release_tree(tmp.path(), "6.13.0-rc1+");
        assert_eq!(built_modules_dir(tmp.path()).unwrap(), dir);
        assert_eq!(built_modules_dir(&dir).unwrap(), dir, "the release directory itself");
        release_tree(tmp.path(), "6.12.0");
        let e = built_modules_dir(tmp.path()).unwrap_err();
        assert!(e.contains("2 releases") && e.contains("6.12.0") && e.contains("6.13.0-rc1+"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = built_modules_dir(empty.path()).unwrap_err();
        assert!(e.contains("modules_install"), "{e}");
    }
}
