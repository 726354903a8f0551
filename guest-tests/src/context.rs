//! What a suite knows about where it runs: the VMM's expectations and the image manifest
//! (both absent on bare metal), the kernel log, and problems met while setting up.

use std::path::{Path, PathBuf};

use gdrvm_model::{Expectations, ImageManifest, EXPECT_PATH, IMAGE_MANIFEST_PATH};

/// Inputs shared by every suite.
pub struct Context {
    /// What the VMM promised, when running in a gdrvm guest.
    pub expect: Option<Expectations>,
    /// What the image builder put in, when running from a gdrvm image.
    pub image: Option<ImageManifest>,
    /// Root of the filesystem to read sysfs and procfs under (`/` except in tests).
    pub root: PathBuf,
    /// The kernel log, or why it could not be read.
    pub kernel_log: Result<String, String>,
    /// Modules that failed to load during init, with the error.
    pub module_errors: Vec<String>,
}

impl Context {
    /// Reads the expectations and manifest from `root`, noting files that exist but do
    /// not parse as errors rather than silently ignoring them.
    pub fn load(
        root: &Path,
        kernel_log: Result<String, String>,
        module_errors: Vec<String>,
    ) -> Result<Context, String> {
        Ok(Context {
            expect: read_json(&root.join(EXPECT_PATH.trim_start_matches('/')))?,
            image: read_json(&root.join(IMAGE_MANIFEST_PATH.trim_start_matches('/')))?,
            root: root.to_owned(),
            kernel_log,
            module_errors,
        })
    }

    /// A path under the root.
    pub fn path(&self, p: &str) -> PathBuf {
        self.root.join(p.trim_start_matches('/'))
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}
