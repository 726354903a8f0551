//! What the suite does, from the expectations alone: which functions are emulated GPUs and
//! NICs, each GPU's aperture, the transfers each NIC makes and at which sizes, and whether
//! each must copy or be refused (the peer-to-peer rule).

use std::time::Duration;

use gdrvm_model::emulated::STATUS_UNMAPPED;
use gdrvm_model::{BarExpectation, Expectations, PathExpectation, PciExpectation};

use super::ring::{status_name, Outcome};

/// `backing` of an emulated GPU.
pub const BACKING_GPU: &str = "emulated-gpu";
/// `backing` of an emulated NIC.
pub const BACKING_NIC: &str = "emulated-nic";
/// Transfer sizes of a NIC's sweep.
pub const SIZES: [u64; 5] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];
/// The part of a GPU's aperture the suite maps and copies into: the largest transfer.
pub const APERTURE_WINDOW: u64 = 64 << 20;
/// The size of each GPU x NIC pair's transfer in the matrix.
pub const MATRIX_SIZE: u64 = 16 << 20;

/// The emulated functions in the expectations, in their order.
#[derive(Debug, Default)]
pub struct Emulated<'a> {
    /// Backed by `emulated-gpu`.
    pub gpus: Vec<&'a PciExpectation>,
    /// Backed by `emulated-nic`.
    pub nics: Vec<&'a PciExpectation>,
}

/// The functions backed by the emulated GPU and NIC.
pub fn emulated(expect: &Expectations) -> Emulated<'_> {
    let of = |backing: &str| expect.pci.iter().filter(|f| f.backing == backing).collect();
    Emulated { gpus: of(BACKING_GPU), nics: of(BACKING_NIC) }
}

/// The GPU's aperture as the expectation describes it: its largest BAR but BAR 0 (which
/// holds the registers), the first of equals. (The expectations do not say which BARs are
/// prefetchable; the suite checks that in sysfs.)
pub fn aperture_bar(gpu: &PciExpectation) -> Option<&BarExpectation> {
    gpu.bars.iter().filter(|b| b.index != 0).max_by_key(|b| (b.size, std::cmp::Reverse(b.index)))
}

/// `expect` with its NCCL paths naming functions by name, as the suite does, instead of by
/// BDF, as the expectations do.
pub fn paths_by_name(expect: &Expectations) -> Expectations {
    let name = |bdf: &str| expect.pci.iter().find(|f| f.bdf == bdf).map_or_else(|| bdf.to_owned(), |f| f.name.clone());
    let mut named = expect.clone();
    for p in &mut named.paths {
        (p.a, p.b) = (name(&p.a), name(&p.b));
    }
    named
}

/// NCCL's path between `gpu` and `nic`, by name (either way round).
pub fn path<'a>(paths: &'a [PathExpectation], gpu: &str, nic: &str) -> Option<&'a PathExpectation> {
    paths.iter().find(|p| (p.a == gpu && p.b == nic) || (p.a == nic && p.b == gpu))
}

/// `path PIX gdr yes`, or question marks where the expectations say nothing.
pub fn describe_path(path: Option<&PathExpectation>) -> String {
    let kind = path.map_or("?".to_owned(), |p| p.path.to_string());
    let gdr = match path.and_then(|p| p.gdr) {
        Some(true) => "yes",
        Some(false) => "no",
        None => "?",
    };
    format!("path {kind} gdr {gdr}")
}

/// The GPU a NIC sweeps with: the one NCCL puts nearest (the best path type), the first of
/// equals; the first GPU when no path is known.
pub fn nearest_gpu(paths: &[PathExpectation], gpus: &[&str], nic: &str) -> Option<usize> {
    let known = (0..gpus.len()).filter_map(|i| path(paths, gpus[i], nic).map(|p| (p.path, i))).min();
    known.map(|(_, i)| i).or((!gpus.is_empty()).then_some(0))
}

/// One side of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The pinned host buffer, at this offset.
    Host(u64),
    /// The aperture of opened GPU `n`, from its start.
    Gpu(usize),
}

/// A copy the NIC makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// Source.
    pub src: End,
    /// Destination.
    pub dst: End,
    /// Bytes.
    pub len: u64,
}

impl Transfer {
    /// The GPUs it touches.
    pub fn gpus(&self) -> impl Iterator<Item = usize> {
        [self.src, self.dst].into_iter().filter_map(|e| match e {
            End::Gpu(n) => Some(n),
            End::Host(_) => None,
        })
    }
}

/// What a transfer must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// Copy every byte, every descriptor [`STATUS_OK`](gdrvm_model::emulated::STATUS_OK).
    Copied,
    /// Be refused: the first descriptor fails with [`STATUS_UNMAPPED`], nothing lands.
    Refused,
}

/// The peer-to-peer rule: a transfer that touches a BAR copies only when the NIC and every
/// GPU it touches take part in peer-to-peer DMA; RAM to RAM always copies.
pub fn expected(nic_p2p: bool, gpus_p2p: &[bool]) -> Expected {
    if gpus_p2p.is_empty() || (nic_p2p && gpus_p2p.iter().all(|&p| p)) {
        Expected::Copied
    } else {
        Expected::Refused
    }
}

/// Whether `outcome` is what `expected` asks; the reason when not. What the destination must
/// then hold is the caller's to check.
pub fn judge(expected: Expected, outcome: &Outcome, descriptors: usize) -> Result<(), String> {
    match (expected, outcome.failure) {
        (Expected::Copied, None) => Ok(()),
        (Expected::Copied, Some((i, status))) => {
            Err(format!("descriptor {i} of {descriptors} failed: {}", status_name(status)))
        }
        (Expected::Refused, Some((0, STATUS_UNMAPPED))) => Ok(()),
        (Expected::Refused, Some((i, status))) => Err(format!(
            "p2p is off, so descriptor 0 should fail unmapped; descriptor {i} of {descriptors} failed: {}",
            status_name(status)
        )),
        (Expected::Refused, None) => Err(format!("p2p is off, yet all {descriptors} descriptors completed")),
    }
}

/// The sweep's sizes that fit in `limit` bytes.
pub fn sizes(limit: u64) -> Vec<u64> {
    SIZES.into_iter().filter(|&s| s <= limit).collect()
}

/// The matrix's size for a GPU whose aperture and the host buffer allow `limit` bytes: the
/// largest sweep size up to [`MATRIX_SIZE`] that fits.
pub fn matrix_size(limit: u64) -> Option<u64> {
    sizes(limit.min(MATRIX_SIZE)).last().copied()
}

/// How long a transfer of `len` bytes may take: generous, for nested virtualization.
pub fn timeout_for(len: u64) -> Duration {
    Duration::from_secs(5 + 3 * len.div_ceil(1 << 20))
}

/// `4 KiB`, `64 MiB`.
pub fn size_name(len: u64) -> String {
    match len {
        l if l >= 1 << 30 && l % (1 << 30) == 0 => format!("{} GiB", l >> 30),
        l if l >= 1 << 20 && l % (1 << 20) == 0 => format!("{} MiB", l >> 20),
        l if l >= 1 << 10 && l % (1 << 10) == 0 => format!("{} KiB", l >> 10),
        l => format!("{l} bytes"),
    }
}

/// `1.23 GB/s` (decimal gigabytes).
pub fn rate(len: u64, elapsed: Duration) -> String {
    format!("{:.2} GB/s", len as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9)
}

#[cfg(test)]
pub(super) mod tests {
    #[test]
    fn test_paths_by_name() {
        use gdrvm_model::node::Node;
        let node = Node::preset("minimal").unwrap().unwrap();
        let (pci, paths) = node.pci_expectations();
        let expect = Expectations { cpus: 1, memory_bytes: 1 << 30, numa: vec![], pci, paths, host: false };
        let named = super::paths_by_name(&expect);
        let p = super::path(&named.paths, "gpu0", "nic0").unwrap();
        assert_eq!((p.path.to_string(), p.gdr), ("PIX".to_string(), Some(true)));
    }

    use gdrvm_model::emulated::{STATUS_BAD_LENGTH, STATUS_OK};
    use gdrvm_model::nccl::PathType;

    use super::*;
    use crate::context::expected_function;

    /// An expected function named `name` of `kind` behind `backing`, with memory BARs
    /// `bars` (index, size); the rest an A100's.
    pub(in crate::suites::gdr) fn function(
        name: &str,
        kind: &str,
        backing: &str,
        bars: &[(u8, u64)],
    ) -> PciExpectation {
        PciExpectation {
            class: 0x03_02_00,
            bars: bars.iter().map(|&(index, size)| BarExpectation { index, size, address: 0 }).collect(),
            backing: backing.into(),
            ..expected_function(name, kind, "0000:00:00.0", (0x10de, 0x2330))
        }
    }

    fn path_of(a: &str, b: &str, path: PathType) -> PathExpectation {
        PathExpectation { a: a.into(), b: b.into(), path, gdr: Some(path.gdr()) }
    }

    #[test]
    fn test_emulated_functions_by_backing() {
        let expect = Expectations {
            cpus: 1,
            memory_bytes: 1 << 30,
            numa: vec![],
            pci: vec![
                function("rp0", "root_port", "none", &[]),
                function("gpu0", "gpu", "emulated-gpu", &[]),
                function("gpu1", "gpu", "vfio:0000:41:00.0", &[]),
                function("nic0", "nic", "emulated-nic", &[]),
                function("gpu2", "gpu", "emulated-gpu", &[]),
                function("nic1", "nic", "vfio-user:/tmp/nic.sock", &[]),
            ],
            paths: vec![],
            host: false,
        };
        let found = emulated(&expect);
        let names = |v: &[&PciExpectation]| v.iter().map(|f| f.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&found.gpus), ["gpu0", "gpu2"]);
        assert_eq!(names(&found.nics), ["nic0"]);
        assert!(emulated(&Expectations { pci: vec![], ..expect }).gpus.is_empty());
    }

    #[test]
    fn test_aperture_is_the_largest_bar() {
        let gpu = function("gpu0", "gpu", "emulated-gpu", &[(0, 16 << 20), (1, 256 << 20), (3, 32 << 20)]);
        assert_eq!(aperture_bar(&gpu).map(|b| b.index), Some(1));
        let tie = function("gpu0", "gpu", "emulated-gpu", &[(0, 16 << 20), (2, 64 << 20), (4, 64 << 20)]);
        assert_eq!(aperture_bar(&tie).map(|b| b.index), Some(2));
        assert_eq!(aperture_bar(&function("gpu0", "gpu", "emulated-gpu", &[])), None);
        let only_regs = function("gpu0", "gpu", "emulated-gpu", &[(0, 16 << 20)]);
        assert_eq!(aperture_bar(&only_regs), None);
        let big_regs = function("gpu0", "gpu", "emulated-gpu", &[(0, 1 << 30), (2, 32 << 20)]);
        assert_eq!(aperture_bar(&big_regs).map(|b| b.index), Some(2));
    }

    #[test]
    fn test_paths_and_the_nearest_gpu() {
        let paths = vec![
            path_of("gpu0", "nic1", PathType::Sys),
            path_of("gpu1", "nic1", PathType::Pix),
            path_of("gpu2", "nic1", PathType::Pix),
            path_of("gpu0", "gpu1", PathType::Phb),
        ];
        assert_eq!(describe_path(path(&paths, "gpu1", "nic1")), "path PIX gdr yes");
        assert_eq!(describe_path(path(&paths, "nic1", "gpu0")), "path SYS gdr no");
        assert_eq!(describe_path(path(&paths, "gpu9", "nic1")), "path ? gdr ?");
        assert_eq!(nearest_gpu(&paths, &["gpu0", "gpu1", "gpu2"], "nic1"), Some(1));
        assert_eq!(nearest_gpu(&paths, &["gpu0", "gpu1"], "nic7"), Some(0));
        assert_eq!(nearest_gpu(&paths, &["gpu9", "gpu0"], "nic1"), Some(1));
        assert_eq!(nearest_gpu(&paths, &[], "nic1"), None);
    }

    #[test]
    fn test_p2p_rule() {
        assert_eq!(expected(false, &[]), Expected::Copied, "RAM to RAM copies whatever p2p says");
        assert_eq!(expected(true, &[true]), Expected::Copied);
        assert_eq!(expected(true, &[true, true]), Expected::Copied);
        assert_eq!(expected(false, &[true]), Expected::Refused);
        assert_eq!(expected(true, &[false]), Expected::Refused);
        assert_eq!(expected(true, &[true, false]), Expected::Refused);
        let t = Transfer { src: End::Gpu(1), dst: End::Host(0), len: 4096 };
        assert_eq!(t.gpus().collect::<Vec<_>>(), [1]);
        let t = Transfer { src: End::Host(0), dst: End::Host(4096), len: 4096 };
        assert_eq!(t.gpus().count(), 0);
    }

    #[test]
    fn test_judge_outcomes() {
        let out = |failure| Outcome { elapsed: Duration::from_millis(1), posted: 4, failure };
        assert_eq!(judge(Expected::Copied, &out(None), 4), Ok(()));
        assert_eq!(
            judge(Expected::Copied, &out(Some((2, STATUS_UNMAPPED))), 4),
            Err("descriptor 2 of 4 failed: unmapped".into())
        );
        assert_eq!(judge(Expected::Refused, &out(Some((0, STATUS_UNMAPPED))), 4), Ok(()));
        assert!(judge(Expected::Refused, &out(Some((0, STATUS_BAD_LENGTH))), 4).unwrap_err().ends_with("bad length"));
        assert!(judge(Expected::Refused, &out(Some((1, STATUS_UNMAPPED))), 4).unwrap_err().contains("descriptor 1"));
        assert_eq!(judge(Expected::Refused, &out(None), 4), Err("p2p is off, yet all 4 descriptors completed".into()));
        assert_eq!(status_name(STATUS_OK), "ok");
    }

    #[test]
    fn test_sizes_and_names() {
        assert_eq!(sizes(64 << 20), SIZES);
        assert_eq!(sizes(32 << 20), [4 << 10, 64 << 10, 1 << 20, 16 << 20]);
        assert_eq!(sizes(4095), Vec::<u64>::new());
        assert_eq!(matrix_size(256 << 20), Some(16 << 20));
        assert_eq!(matrix_size(8 << 20), Some(1 << 20));
        assert_eq!(matrix_size(1024), None);
        assert_eq!(size_name(4096), "4 KiB");
        assert_eq!(size_name(64 << 20), "64 MiB");
        assert_eq!(size_name(3 << 30), "3 GiB");
        assert_eq!(size_name(100), "100 bytes");
        assert_eq!(rate(1_230_000_000, Duration::from_secs(1)), "1.23 GB/s");
        assert_eq!(timeout_for(4096), Duration::from_secs(8));
        assert_eq!(timeout_for(64 << 20), Duration::from_secs(197));
    }
}
