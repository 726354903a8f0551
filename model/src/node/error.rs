//! Errors in node files: the file, the key and the reason, kept apart until displayed.

/// A node file that cannot be used: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{origin}: {}{reason}", key.as_ref().map(|k| format!("key {k}: ")).unwrap_or_default())]
pub struct NodeError {
    /// The file (or preset) it came from.
    pub origin: String,
    /// The key at fault, e.g. `endpoint[3] (gpu3).link`; `None` for whole-file errors.
    pub key: Option<String>,
    /// What is wrong.
    pub reason: String,
}

impl NodeError {
    /// An error in the file as a whole (it cannot be read, or is not TOML).
    pub(super) fn whole_file(origin: &str, reason: impl Into<String>) -> Self {
        NodeError { origin: origin.to_owned(), key: None, reason: reason.into() }
    }
}

/// What is wrong at one key, found while checking a node before knowing which file it
/// came from; [`KeyError::in_file`] names the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct KeyError {
    key: String,
    reason: String,
}

impl KeyError {
    pub(super) fn new(key: impl Into<String>, reason: impl Into<String>) -> Self {
        KeyError { key: key.into(), reason: reason.into() }
    }

    /// The error in `origin`.
    pub(super) fn in_file(self, origin: &str) -> NodeError {
        NodeError { origin: origin.to_owned(), key: Some(self.key), reason: self.reason }
    }
}
