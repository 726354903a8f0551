//! Image recipes: TOML files naming pinned Debian packages and the modules to load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::ImageError;

/// A pinned Debian package.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Package {
    /// Package name.
    pub package: String,
    /// Exact version (with epoch, as `apt-cache policy` prints it).
    pub version: String,
    /// sha256 of the .deb.
    pub sha256: String,
}

/// The kernel package and the release it installs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelPackage {
    /// The package.
    #[serde(flatten)]
    pub pin: Package,
    /// `uname -r` of the kernel (the directory under /lib/modules).
    pub release: String,
}

/// Modules to put in the image.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Modules {
    /// Must load at boot.
    #[serde(default)]
    pub load: Vec<String>,
    /// Loaded if they can be (hardware-specific).
    #[serde(default, rename = "try")]
    pub try_load: Vec<String>,
    /// In the image but loaded only by the suites that need them (soft-RoCE: `rdma_rxe`),
    /// so that other boots do not pay for them.
    #[serde(default)]
    pub on_demand: Vec<String>,
}

/// A package some of whose files go into the image at the same paths (symlinks kept, their
/// targets added too).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilesPackage {
    /// The package.
    #[serde(flatten)]
    pub pin: Package,
    /// Paths inside the package, without a leading `/`.
    pub files: Vec<String>,
    /// The layers ([`Layer`]) these files belong to: they are in an image that has any of
    /// them. None: in every image.
    #[serde(default)]
    pub layers: Vec<String>,
}

/// A part of the image that only some suites need (lspci and its libraries for
/// `topology`, rdma-core for `rdma`). An image is built with all its recipe's layers or
/// with some; a run boots the smallest image with the layers its suites need, so a boot
/// that needs none (the benchmarks, `smoke`) does not copy and unpack the others.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    /// The agent's suites that need this layer.
    pub suites: Vec<String>,
    /// Modules of this layer that suites load when they need them (as
    /// [`Modules::on_demand`]).
    #[serde(default)]
    pub on_demand: Vec<String>,
}

/// A whole recipe.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Image name (the output directory's name).
    pub name: String,
    /// One line saying what the image is for.
    pub description: String,
    /// The kernel.
    pub kernel: KernelPackage,
    /// busybox-static, for the shell and the L1 userland.
    pub busybox: Package,
    /// Kernel modules.
    #[serde(default)]
    pub modules: Modules,
    /// Userland tools from Debian packages (e.g. pciutils and its libraries).
    #[serde(default)]
    pub package: Vec<FilesPackage>,
    /// The image's layers, by name.
    #[serde(default)]
    pub layer: BTreeMap<String, Layer>,
    /// Where the recipe was read from.
    #[serde(skip)]
    pub path: PathBuf,
    /// The recipe's text (part of the image's cache key).
    #[serde(skip)]
    pub text: String,
}

impl Recipe {
    /// Reads and checks a recipe file; errors name the file, the key and the reason.
    pub fn load(path: &Path) -> Result<Recipe, ImageError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ImageError::Recipe { path: path.to_owned(), reason: e.to_string() })?;
        Recipe::parse(path, &text)
    }

    /// Parses recipe text read from `path`.
    pub fn parse(path: &Path, text: &str) -> Result<Recipe, ImageError> {
        let bad = |reason: String| ImageError::Recipe { path: path.to_owned(), reason };
        let mut recipe: Recipe = toml::from_str(text).map_err(|e| bad(e.to_string().trim().replace('\n', " ")))?;
        recipe.path = path.to_owned();
        recipe.text = text.to_owned();
        let mut pins = vec![("kernel".to_owned(), &recipe.kernel.pin), ("busybox".to_owned(), &recipe.busybox)];
        pins.extend(recipe.package.iter().enumerate().map(|(i, p)| (format!("package[{i}]"), &p.pin)));
        for (key, pin) in pins {
            if pin.sha256.len() != 64 || !pin.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad(format!("key {key}.sha256: expected 64 hex digits, got '{}'", pin.sha256)));
            }
        }
        for (i, p) in recipe.package.iter().enumerate() {
            if let Some(f) = p.files.iter().find(|f| f.starts_with('/') || f.split('/').any(|c| c == "..")) {
                return Err(bad(format!("key package[{i}].files: '{f}' must be a relative path inside the package")));
            }
        }
        if let Some(name) = recipe.layer.keys().find(|n| !is_layer_name(n)) {
            return Err(bad(format!("key layer.{name}: a layer's name is lowercase letters, digits and '_'")));
        }
        for (i, p) in recipe.package.iter().enumerate() {
            if let Some(l) = p.layers.iter().find(|l| !recipe.layer.contains_key(*l)) {
                return Err(bad(format!("key package[{i}].layers: '{l}' is not a layer of this recipe ([layer.{l}])")));
            }
        }
        if recipe.name.is_empty() || recipe.name.contains('/') {
            return Err(bad(format!("key name: '{}' is not a usable directory name", recipe.name)));
        }
        Ok(recipe)
    }
}

/// Whether `name` can name a layer (it becomes part of an image's directory name).
fn is_layer_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_shipped_recipes_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes");
        let r = Recipe::load(&dir.join("default.toml")).unwrap();
        assert_eq!(r.kernel.release, "6.1.0-57-amd64");
        assert!(r.modules.load.contains(&"virtio_net".to_string()));
        assert_eq!(r.modules.try_load, vec!["e1000e"]);
        assert_eq!(r.layer.keys().collect::<Vec<_>>(), ["gpu", "lspci", "rdma"]);
        assert_eq!(r.layer["rdma"].on_demand, ["crc32_generic", "rdma_rxe", "ib_uverbs", "rdma_ucm"]);
        assert_eq!(r.layer["lspci"].suites, ["topology"]);
        let layers_of = |p: &str| r.package.iter().find(|x| x.pin.package == p).unwrap().layers.clone();
        assert_eq!(layers_of("pciutils"), ["lspci"]);
        assert_eq!(layers_of("libc6"), ["lspci", "rdma", "gpu"]);
        let l1 = Recipe::load(&dir.join("l1.toml")).unwrap();
        assert!(l1.layer.is_empty());
        assert_eq!(l1.modules.try_load, vec!["kvm_amd", "kvm_intel", "vfio-pci", "vfio_iommu_type1"]);
    }

    #[test]
    fn test_errors_name_file_key_reason() {
        let p = Path::new("images/recipes/bad.toml");
        let base = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("recipes/default.toml")).unwrap();
        let e = Recipe::parse(p, &base.replace("sha256 = \"14d2", "sha256 = \"zz")).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("kernel.sha256"), "{e}");
        let e = Recipe::parse(p, &base.replace("release = ", "relase = ")).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("[kernel]") && e.contains("`release`"), "{e}");
        let e =
            Recipe::parse(p, &base.replace("layers = [\"lspci\"]", "layers = [\"lspcii\"]")).unwrap_err().to_string();
        assert!(e.contains("bad.toml") && e.contains("package[0].layers") && e.contains("'lspcii'"), "{e}");
        let e = Recipe::parse(p, &base.replace("[layer.gpu]", "[layer.GPU]")).unwrap_err().to_string();
        assert!(e.contains("key layer.GPU"), "{e}");
        let e = Recipe::parse(p, "name = ").unwrap_err().to_string();
        assert!(e.contains("bad.toml"), "{e}");
    }
}
