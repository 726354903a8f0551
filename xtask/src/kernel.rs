//! Which kernel a guest boots and which out-of-tree modules it loads: `--kernel
//! debian:<name>` (pinned in images/kernels.lock), `--kernel PATH --modules DIR` (a kernel
//! built from a tree), `--module-src DIR` (a Kbuild module built against that kernel's
//! headers). Anything that makes a candidate untestable (a kernel not pinned, a module
//! that does not build) is an error, which `cargo xtask` reports as 125.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use gdrvm_harness::{gdrvm_dir, BootImage};
use gdrvm_images::{Cache, Customization, KernelLock, KernelSource, Recipe, DEBIAN_PREFIX};
use sha2::{Digest, Sha256};

/// The kernel options `boot`, `test --matrix` and `bisect` share.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct KernelOpts {
    /// The guest's kernel: `debian:6.1.0-47`, `debian:6.12.117+deb12` (pinned in
    /// images/kernels.lock), or a bzImage/vmlinux built from a tree (with --modules).
    #[arg(long)]
    pub kernel: Option<String>,
    /// With --kernel PATH: the INSTALL_MOD_PATH of `make modules_install` (or its
    /// lib/modules/<release>).
    #[arg(long, requires = "kernel")]
    pub modules: Option<PathBuf>,
    /// An out-of-tree kernel module's source (a Kbuild directory): built against the
    /// kernel's headers, put in the image and loaded before the suites.
    #[arg(long)]
    pub module_src: Option<PathBuf>,
}

impl KernelOpts {
    /// Whether anything differs from the default image.
    pub fn is_default(&self) -> bool {
        self.kernel.as_deref().is_none_or(|k| k == "default") && self.module_src.is_none()
    }
}

/// The kernel `opts` name, as an image source, with its release and where its headers
/// (Kbuild tree) are once installed; `None` for the recipe's own kernel.
fn kernel_source(opts: &KernelOpts, recipe: &Recipe) -> Result<(Option<KernelSource>, String, String)> {
    match opts.kernel.as_deref() {
        None | Some("default") => Ok((None, recipe.kernel.release.clone(), recipe.kernel.release.clone())),
        Some(k) if k.starts_with(DEBIAN_PREFIX) => {
            let lock = KernelLock::load(&gdrvm_images::lock_path())?;
            let locked = lock.find(k)?;
            let package = locked.kernel_package();
            let release = package.release.clone();
            Ok((Some(KernelSource::Package(package)), release, locked.name.clone()))
        }
        Some(path) => {
            let image = PathBuf::from(path);
            if !image.is_file() {
                bail!("--kernel {path}: no such file (a kernel is debian:<name> or a bzImage/vmlinux path)");
            }
            let Some(modules) = &opts.modules else {
                bail!(
                    "--kernel {path} needs --modules DIR (where `make modules_install INSTALL_MOD_PATH=DIR` put them)"
                )
            };
            let data = std::fs::read(&image).with_context(|| format!("reading {path}"))?;
            let digest: String = Sha256::digest(&data).iter().take(6).map(|b| format!("{b:02x}")).collect();
            let source = KernelSource::Built { image, modules: modules.clone() };
            Ok((Some(source), String::new(), format!("built-{digest}")))
        }
    }
}

/// Builds the guest image `opts` asks for (the default recipe with that kernel and module),
/// the agent and its helpers added as in the default image, with the layers a run with
/// kernel command line `cmdline` needs.
pub fn guest_image(opts: &KernelOpts, extras: &[gdrvm_images::ExtraFile], cmdline: &str) -> Result<BootImage> {
    let recipe = Recipe::load(&gdrvm_images::recipes_dir().join("default.toml"))?;
    let (kernel, release, label) = kernel_source(opts, &recipe)?;
    let cache_root = gdrvm_dir().join("cache");
    // One custom image build at a time over the whole cache: a matrix's lanes (threads)
    // and other xtask processes share module build directories and image names.
    let _lock = BuildLock::take(&cache_root)?;
    sweep_vanished_module_sources(&cache_root);
    let cache = Cache::new(&cache_root);
    let progress = |line: &str| println!("xtask: image: {line}");
    let layers = gdrvm_images::Layers::for_cmdline(&recipe, cmdline);
    // The module source's label stays last: the sweep below finds its images by it.
    let mut name = layers.image_name(&format!("default@{label}"));
    let mut custom = Customization { kernel, user_modules: Vec::new(), extras: extras.to_vec(), layers };
    if let Some(src) = &opts.module_src {
        let source = record_module_source(&cache_root, src)?;
        let headers = headers_dir(opts, &release, &custom)?;
        custom.user_modules = build_module(src, &headers, &cache_root, &format!("{source}@{label}"))?;
        name.push_str(&format!("+{source}"));
    }
    let built = gdrvm_images::build_custom(&recipe, &custom, &name, &cache, &progress)?;
    println!(
        "xtask: image {name}: kernel {}, {} ({})",
        built.manifest.kernel_release,
        built.initramfs.display(),
        if built.rebuilt { "built" } else { "up to date" }
    );
    Ok(BootImage { kernel: built.vmlinux, initrd: built.initramfs })
}

/// An exclusive `flock` on the cache's `.build.lock`, held while a custom image is
/// built; released when dropped (the file closes). Written by hand: std's `File::lock` is
/// newer than this workspace's minimum Rust.
struct BuildLock {
    /// Holds the lock while open.
    _file: std::fs::File,
}

impl BuildLock {
    fn take(cache_root: &Path) -> Result<BuildLock> {
        use std::os::fd::AsRawFd;
        std::fs::create_dir_all(cache_root).with_context(|| format!("creating {}", cache_root.display()))?;
        let path = cache_root.join(".build.lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        let fd = file.as_raw_fd();
        // SAFETY: flock takes an open descriptor (`file` outlives the calls) and an
        // operation flag; it touches no memory of ours.
        if unsafe { libc::flock(fd, libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            println!("xtask: image: waiting for another image build ({})", path.display());
            // SAFETY: as above.
            while unsafe { libc::flock(fd, libc::LOCK_EX) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e).with_context(|| format!("locking {}", path.display()));
                }
            }
        }
        Ok(BuildLock { _file: file })
    }
}

/// Notes in the cache which directory module source `src` is (`module-src/<label>.source`,
/// written whole by a rename, and before anything is built under the label) and returns
/// its label.
fn record_module_source(cache_root: &Path, src: &Path) -> Result<String> {
    let abs = std::fs::canonicalize(src).with_context(|| format!("--module-src {}", src.display()))?;
    let label = dir_label(&abs);
    let builds = cache_root.join("module-src");
    std::fs::create_dir_all(&builds).with_context(|| format!("creating {}", builds.display()))?;
    let record = builds.join(format!("{label}.source"));
    let text = abs.to_string_lossy();
    if std::fs::read_to_string(&record).is_ok_and(|r| r == text) {
        return Ok(label);
    }
    // Whole or not at all: a sweep that reads it half-written would take the source for gone.
    let mut tmp =
        tempfile::NamedTempFile::new_in(&builds).with_context(|| format!("creating a file in {}", builds.display()))?;
    std::io::Write::write_all(&mut tmp, text.as_bytes()).with_context(|| format!("writing {}", record.display()))?;
    tmp.persist(&record).with_context(|| format!("writing {}", record.display()))?;
    Ok(label)
}

/// Whether module source `label`'s directory still exists, as its record says now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// It does.
    Live,
    /// It does not, or nothing records it (a build from before records were kept).
    Gone,
    /// The record cannot be read: its entries are left alone.
    Unknown,
}

fn source_of(builds: &Path, label: &str) -> Source {
    match std::fs::read_to_string(builds.join(format!("{label}.source"))) {
        Ok(path) if path.is_empty() => Source::Unknown,
        Ok(path) if Path::new(&path).is_dir() => Source::Live,
        Ok(_) => Source::Gone,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Source::Gone,
        Err(_) => Source::Unknown,
    }
}

/// Removes the module builds (`module-src/<label>@<kernel>`) and guest images
/// (`images/default@<kernel>[.base+<layers>]+<label>`) of module sources whose directory is gone, such as
/// a test's or a bisection's temporary checkout: each would otherwise keep a 25 MB image
/// in the cache for good. A build without a record (from before records were kept) counts
/// as gone; a cache entry costs only its rebuild. Each label is judged by its record as
/// it reads at that moment (a label's record is written before its builds and images, so
/// a lane building it meanwhile keeps it), and its record goes last. Failures are logged
/// and skipped.
fn sweep_vanished_module_sources(cache_root: &Path) {
    let builds = cache_root.join("module-src");
    let Ok(entries) = std::fs::read_dir(&builds) else { return };
    let mut labels = std::collections::BTreeSet::new();
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(label) = name.strip_suffix(".source").or_else(|| name.split_once('@').map(|(label, _)| label)) {
            labels.insert(label.to_owned());
        }
    }
    let gone: Vec<String> = labels.into_iter().filter(|l| source_of(&builds, l) == Source::Gone).collect();
    if gone.is_empty() {
        return;
    }
    let images: Vec<PathBuf> = std::fs::read_dir(cache_root.join("images"))
        .map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect())
        .unwrap_or_default();
    for label in gone {
        // A label has no '+' (see `dir_label`); a kernel's name may (6.12.117+deb12).
        let of_label = |p: &&PathBuf| {
            p.file_name().and_then(|n| n.to_str()).and_then(|n| n.rsplit_once('+')).is_some_and(|(_, l)| l == label)
        };
        for image in images.iter().filter(of_label) {
            remove_cache_entry(image);
        }
        let prefix = format!("{label}@");
        let dirs = std::fs::read_dir(&builds).map(|d| d.filter_map(Result::ok).map(|e| e.path()).collect::<Vec<_>>());
        for dir in dirs.unwrap_or_default() {
            if dir.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix)) {
                remove_cache_entry(&dir);
            }
        }
        let record = builds.join(format!("{label}.source"));
        if record.exists() {
            remove_cache_entry(&record);
        }
    }
}

/// Removes a file or directory of the cache, saying so; a failure is only logged.
fn remove_cache_entry(path: &Path) {
    let removed = if path.is_dir() { std::fs::remove_dir_all(path) } else { std::fs::remove_file(path) };
    match removed {
        Ok(()) => println!("xtask: cache: removed {} (its module source is gone)", path.display()),
        Err(e) => println!("xtask: cache: could not remove {}: {e}", path.display()),
    }
}

/// A short, file-name-safe label for a source directory (`abs`, canonical): its name and
/// a hash of its path. Only ASCII letters, digits, '_' and '-': never '@' or '+'.
fn dir_label(abs: &Path) -> String {
    let name: String = abs
        .file_name()
        .map(|n| n.to_string_lossy().chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect())
        .unwrap_or_default();
    let digest: String =
        Sha256::digest(abs.to_string_lossy().as_bytes()).iter().take(4).map(|b| format!("{b:02x}")).collect();
    format!("{name}-{digest}")
}

/// Where the kernel's Kbuild tree is: Debian's `linux-headers-<release>` (installed when
/// missing, with gcc and make), or a built kernel's `lib/modules/<release>/build`.
fn headers_dir(opts: &KernelOpts, release: &str, custom: &Customization) -> Result<PathBuf> {
    crate::host::require_commands(&[("make", "make"), ("gcc", "gcc")])?;
    if let Some(KernelSource::Built { modules, .. }) = &custom.kernel {
        let build = find_build_link(modules).with_context(|| {
            format!("--modules {}: no lib/modules/<release>/build link to the kernel tree", modules.display())
        })?;
        return Ok(build);
    }
    let package = format!("linux-headers-{release}");
    crate::host::require_packages(&[&package]).with_context(|| {
        format!("the headers of kernel {} ({package})", opts.kernel.as_deref().unwrap_or("default"))
    })?;
    let dir = PathBuf::from(format!("/usr/src/{package}"));
    if !dir.join("Makefile").is_file() {
        bail!("{package} is installed but {} has no Makefile", dir.display());
    }
    Ok(dir)
}

/// `lib/modules/<release>/build` under a modules_install directory (or that directory).
fn find_build_link(modules: &Path) -> Option<PathBuf> {
    let direct = modules.join("build");
    if direct.join("Makefile").is_file() {
        return Some(direct);
    }
    std::fs::read_dir(modules.join("lib/modules"))
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path().join("build"))
        .find(|b| b.join("Makefile").is_file())
}

/// Builds the Kbuild module in `src` against `headers` in a copy of the source (the user's
/// tree is left as it was) named `work` (one per source and kernel: lanes that share one
/// build it in turn, under the [`BuildLock`]), returns the .ko files. A module that does not build is an error
/// carrying the compiler's words.
fn build_module(src: &Path, headers: &Path, cache_root: &Path, work: &str) -> Result<Vec<PathBuf>> {
    if !src.join("Kbuild").is_file() && !src.join("Makefile").is_file() {
        bail!("--module-src {}: no Kbuild or Makefile there", src.display());
    }
    let work = cache_root.join("module-src").join(work);
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clearing {}", work.display()))?;
    }
    copy_tree(src, &work).with_context(|| format!("copying {} to {}", src.display(), work.display()))?;
    println!("xtask: module-src: building {} against {}", src.display(), headers.display());
    let out = Command::new("make")
        .arg("-C")
        .arg(headers)
        .arg(format!("M={}", work.display()))
        .arg("modules")
        .output()
        .context("running make")?;
    if !out.status.success() {
        let text = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let errors: Vec<&str> = lines.iter().copied().filter(|l| l.contains("error")).take(10).collect();
        let words = if errors.is_empty() { lines[lines.len().saturating_sub(10)..].to_vec() } else { errors };
        bail!("module in {} does not build against {}:\n{}", src.display(), headers.display(), words.join("\n"));
    }
    let mut kos: Vec<PathBuf> = std::fs::read_dir(&work)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "ko"))
        .collect();
    kos.sort();
    if kos.is_empty() {
        bail!("module in {} built no .ko (is obj-m set in its Kbuild?)", src.display());
    }
    Ok(kos)
}

/// Copies regular files and directories of `from` into `to`, leaving out `.git` and build
/// products of earlier in-tree builds.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        let n = name.to_string_lossy();
        if n == ".git" || [".o", ".ko", ".cmd", ".mod", ".mod.c", ".order", ".symvers"].iter().any(|x| n.ends_with(x)) {
            continue;
        }
        // Symlinks are followed: a Kbuild tree may link shared sources in.
        let kind = std::fs::metadata(entry.path())?.file_type();
        if kind.is_dir() {
            copy_tree(&entry.path(), &to.join(&name))?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), to.join(&name))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_sweep_removes_only_the_builds_and_images_of_vanished_sources() {
        let cache = tempfile::tempdir().unwrap();
        let root = cache.path();
        let kept_src = tempfile::tempdir().unwrap();
        let gone_src = tempfile::tempdir().unwrap();
        let kept = record_module_source(root, kept_src.path()).unwrap();
        let gone = record_module_source(root, gone_src.path()).unwrap();
        drop(gone_src);
        let legacy = "drv-0a1b2c3d";
        let images = root.join("images");
        let builds = root.join("module-src");
        let dirs = [
            images.join("default"),
            images.join("default@6.12.117+deb12"),
            images.join(format!("default@6.1.0-57-amd64+{kept}")),
            images.join(format!("default@6.12.117+deb12+{gone}")),
            images.join(format!("default@6.1.0-57-amd64+{legacy}")),
            images.join(format!("default@6.12.117+deb12.base+lspci+{gone}")),
            images.join(format!("default@6.1.0-57-amd64.base+{kept}")),
            builds.join(format!("{kept}@6.1.0-57-amd64")),
            builds.join(format!("{gone}@6.12.117+deb12")),
            builds.join(format!("{legacy}@6.1.0-57-amd64")),
        ];
        for d in &dirs {
            std::fs::create_dir_all(d).unwrap();
            std::fs::write(d.join("initramfs.cpio"), b"x").unwrap();
        }

        // A record that reads empty (written by something else than a rename) is not
        // taken for a vanished source.
        let unknown = "drv-99887766";
        std::fs::write(builds.join(format!("{unknown}.source")), "").unwrap();
        std::fs::create_dir_all(builds.join(format!("{unknown}@6.1.0-57-amd64"))).unwrap();

        sweep_vanished_module_sources(root);

        let exists: Vec<bool> = dirs.iter().map(|d| d.exists()).collect();
        assert_eq!(exists, [true, true, true, false, false, false, true, true, false, false]);
        assert!(builds.join(format!("{unknown}@6.1.0-57-amd64")).is_dir());
        assert!(builds.join(format!("{kept}.source")).is_file());
        assert!(!builds.join(format!("{gone}.source")).exists());
        // A second sweep finds nothing more to remove.
        sweep_vanished_module_sources(root);
        assert_eq!(dirs.iter().map(|d| d.exists()).collect::<Vec<_>>(), exists);
    }

    #[test]
    fn test_image_builds_take_the_cache_in_turn() {
        let cache = tempfile::tempdir().unwrap();
        let first = BuildLock::take(cache.path()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let root = cache.path().to_owned();
        let second = std::thread::spawn(move || {
            let lock = BuildLock::take(&root).unwrap();
            tx.send(()).unwrap();
            drop(lock);
        });
        assert!(rx.recv_timeout(std::time::Duration::from_millis(300)).is_err(), "both held the lock");
        drop(first);
        rx.recv().unwrap();
        second.join().unwrap();
    }

    #[test]
    fn test_a_source_label_has_neither_at_nor_plus() {
        let label = dir_label(Path::new("/tmp/my drv+v2@x"));
        assert!(label.starts_with("my_drv_v2_x-"), "{label}");
        assert!(!label.contains(['@', '+']), "{label}");
    }
}
