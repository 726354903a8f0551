//! Moving a recipe's pins to what Debian's archive serves now (`cargo xtask repin`):
//! each pinned package gets the archive's newest version and that .deb's sha256; the
//! recipe's text, comments included, is otherwise kept (toml_edit).

use std::path::Path;

use toml_edit::{DocumentMut, Item, Table};

use crate::recipe::Package;
use crate::{Cache, ImageError, Progress};

/// One pin that moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repinned {
    /// The package.
    pub package: String,
    /// The version pinned before.
    pub from: String,
    /// The version pinned now.
    pub to: String,
}

/// Repins every package of the recipe at `path` to the newest version the archive
/// serves (refreshing apt's lists first), downloading each new .deb into `cache` to
/// hash it. Writes the recipe back when anything moved; returns what moved.
pub fn repin(path: &Path, cache: &Cache, progress: &Progress) -> Result<Vec<Repinned>, ImageError> {
    let bad = |reason: String| ImageError::Recipe { path: path.to_owned(), reason };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| bad(e.to_string()))?;
    cache.archive.refresh(progress)?;
    let mut moved = Vec::new();
    let mut tables: Vec<&mut Table> = Vec::new();
    let root = doc.as_table_mut();
    let mut packages = None;
    for (key, item) in root.iter_mut() {
        match (key.get(), item) {
            ("kernel" | "busybox", Item::Table(t)) => tables.push(t),
            ("package", Item::ArrayOfTables(a)) => packages = Some(a),
            _ => {}
        }
    }
    if let Some(a) = packages {
        tables.extend(a.iter_mut());
    }
    for table in tables {
        let field = |t: &Table, k: &str| t.get(k).and_then(Item::as_str).map(str::to_owned);
        let (Some(package), Some(version)) = (field(table, "package"), field(table, "version")) else {
            return Err(bad("a pinned package lacks `package` or `version`".into()));
        };
        let newest = cache.archive.versions(&package)?.into_iter().next().ok_or_else(|| ImageError::LeftArchive {
            package: format!("{package}={version}"),
            available: Vec::new(),
        })?;
        if newest == version {
            continue;
        }
        progress(&format!("{package}: {version} -> {newest}"));
        let pin = Package { package: package.clone(), version: newest.clone(), sha256: String::new() };
        let (_, sha) = crate::debian::fetch_unpinned(&pin, &cache.dir("debs")?, &cache.archive, progress)?;
        table["version"] = toml_edit::value(newest.clone());
        table["sha256"] = toml_edit::value(sha);
        moved.push(Repinned { package, from: version, to: newest });
    }
    if !moved.is_empty() {
        std::fs::write(path, doc.to_string()).map_err(|e| ImageError::Io { path: path.to_owned(), source: e })?;
    }
    Ok(moved)
}
