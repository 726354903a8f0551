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
    /// The image's modules init left out: they drive devices none of which is here, or
    /// only such modules need them.
    pub modules_left_out: Vec<String>,
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
            modules_left_out: Vec::new(),
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

/// Test fixture: the expectation of endpoint `name` of `kind` ("gpu", "nic") at `bdf` with
/// vendor and device `ids`: class by kind, MSI-X, no BARs, link or backing; tests set the
/// rest with struct update syntax.
#[cfg(test)]
pub fn expected_function(name: &str, kind: &str, bdf: &str, ids: (u16, u16)) -> gdrvm_model::PciExpectation {
    gdrvm_model::PciExpectation {
        name: name.into(),
        kind: kind.into(),
        bdf: bdf.into(),
        parents: vec![],
        vendor: ids.0,
        device: ids.1,
        class: if kind == "nic" { 0x02_00_00 } else { 0x03_02_00 },
        subsystem: None,
        numa_node: 0,
        link: None,
        acs: false,
        acs_control: 0,
        ats: false,
        msix: true,
        bars: vec![],
        backing: "none".into(),
        p2p: true,
    }
}

/// Test fixture: a context reading sysfs under `root`, whose VMM expects 1 vCPU, 1 GiB and
/// the functions `pci`; no image manifest, an empty kernel log.
#[cfg(test)]
pub fn test_context(root: &Path, pci: Vec<gdrvm_model::PciExpectation>) -> Context {
    Context {
        expect: Some(Expectations { cpus: 1, memory_bytes: 1 << 30, numa: vec![], pci, paths: vec![], host: false }),
        image: None,
        root: root.to_owned(),
        kernel_log: Ok(String::new()),
        module_errors: vec![],
        modules_left_out: vec![],
    }
}
