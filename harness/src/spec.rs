//! What to run: one VM's description, and the command line that boots it with gdrvm or
//! with QEMU (the reference in benchmarks).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::artifacts::BootImage;

/// Which VMM boots a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vmm {
    /// gdrvm.
    Gdrvm,
    /// QEMU with KVM, the reference in benchmarks.
    Qemu(QemuMachine),
}

/// QEMU machine types compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QemuMachine {
    /// `-M pc` (i440FX, SeaBIOS).
    Pc,
    /// `-M microvm` (qboot, minimal devices).
    Microvm,
}

/// Where QEMU is, on the host and inside L1.
pub(crate) const QEMU_PATH: &str = "/usr/bin/qemu-system-x86_64";
/// QEMU firmware a direct kernel boot can load (`-M pc` and `-M microvm`); Debian keeps
/// SeaBIOS in its own directory, which its QEMU also searches.
pub(crate) const QEMU_FIRMWARE: &[&str] = &[
    "/usr/share/seabios/bios-256k.bin",
    "/usr/share/seabios/bios.bin",
    "/usr/share/qemu/bios-microvm.bin",
    "/usr/share/qemu/qboot.rom",
    "/usr/share/qemu/pvh.bin",
    "/usr/share/qemu/linuxboot.bin",
    "/usr/share/qemu/linuxboot_dma.bin",
    "/usr/share/qemu/kvmvapic.bin",
];

/// One VM to run.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Name for reports.
    pub name: String,
    /// The VMM that boots it.
    pub vmm: Vmm,
    /// What to boot.
    pub image: BootImage,
    /// Node description for gdrvm's `--node`: a preset name or a node file.
    pub node: Option<String>,
    /// A cluster instead of one node: `gdrvm cluster up` boots its nodes, each with this
    /// spec's image, command line and size, and reports one KTAP subtest per node.
    pub cluster: Option<ClusterSpec>,
    /// Kernel command line.
    pub cmdline: String,
    /// vCPUs.
    pub cpus: u32,
    /// Guest RAM, as gdrvm takes it (`1G`).
    pub memory: String,
    /// Longest the guest may run.
    pub timeout: Duration,
}

/// A cluster run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// A cluster preset or a cluster file (whose node files are presets or absolute paths).
    pub cluster: String,
    /// `NODE:TEXT`: kill that node's VMM when its console shows TEXT.
    pub kill: Option<String>,
    /// Run the nodes with QEMU (`gdrvm cluster up --qemu`), the benchmarks' reference.
    pub qemu: bool,
}

/// Kernel parameters the harness puts before every guest's own. A guest that wants a
/// kernel's own behaviour back appends the parameter with its default value, which,
/// coming later, wins.
/// - `cryptomgr.notests`: Debian's kernels test each crypto algorithm as it registers,
///   0.3-0.5 s of a nested boot (`crypto_algapi_init` alone 0.32-0.55 s), and test
///   nothing gdrvm is for.
/// - `workqueue.disable_numa=1` (Linux up to 6.4) and
///   `workqueue.default_affinity_scope=system` (6.5 on; each kernel ignores the other's,
///   as it does any dotted parameter it does not know): unbound kernel work may run on
///   any vCPU, not only on the NUMA node that queued it. A test guest has few vCPUs per
///   node (the benches' 2 over vela-a100's two nodes give one each), so the boot's
///   asynchronous work (tracing's event map update, the initramfs unpack) otherwise
///   queues behind the boot on vCPU 0 while the other node idles. No table and no sysfs
///   file a suite reads changes: only where the kernel runs its own work.
pub(crate) const HARNESS_CMDLINE: &str =
    "cryptomgr.notests workqueue.disable_numa=1 workqueue.default_affinity_scope=system";

impl VmSpec {
    /// The command line the guest boots with: [`HARNESS_CMDLINE`], then its own.
    pub(crate) fn kernel_cmdline(&self) -> String {
        format!("{HARNESS_CMDLINE} {}", self.cmdline)
    }

    /// The program and arguments that boot this VM; `gdrvm` is where gdrvm is.
    /// `node` is where the node description (or, for a cluster, the cluster description)
    /// is for the VMM (a preset name, or the file's path as the VMM sees it).
    pub(crate) fn command_line(
        &self,
        gdrvm: &Path,
        (kernel, initrd, node): (&Path, &Path, Option<&str>),
        interactive: bool,
    ) -> (PathBuf, Vec<String>) {
        match self.vmm {
            Vmm::Gdrvm if self.cluster.is_some() => {
                let cluster = self.cluster.as_ref().map(|c| (c.cluster.clone(), c.kill.clone())).unwrap_or_default();
                let mut args = vec!["cluster".to_owned(), "up".into(), node.unwrap_or(&cluster.0).to_owned()];
                args.extend(self.gdrvm_args(kernel, initrd));
                if let Some(kill) = cluster.1 {
                    args.extend(["--kill".to_owned(), kill]);
                }
                if self.uses_qemu() {
                    args.extend(["--qemu".to_owned(), QEMU_PATH.to_owned()]);
                }
                (gdrvm.to_owned(), args)
            }
            Vmm::Gdrvm => {
                let mut args = vec!["run".to_owned()];
                args.extend(self.gdrvm_args(kernel, initrd));
                if let Some(node) = node {
                    args.extend(["--node".to_owned(), node.to_owned()]);
                }
                args.push(if interactive { "--interactive" } else { "--stats" }.into());
                (gdrvm.to_owned(), args)
            }
            Vmm::Qemu(machine) => (PathBuf::from(QEMU_PATH), self.qemu_args(machine, kernel, initrd)),
        }
    }

    fn qemu_args(&self, machine: QemuMachine, kernel: &Path, initrd: &Path) -> Vec<String> {
        let machine = match machine {
            QemuMachine::Pc => "pc",
            QemuMachine::Microvm => "microvm",
        };
        [
            "-accel",
            "kvm",
            "-cpu",
            "host",
            "-M",
            machine,
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-vga",
            "none",
            "-serial",
            "stdio",
        ]
        .into_iter()
        .map(str::to_owned)
        .chain([
            "-smp".into(),
            self.cpus.to_string(),
            "-m".into(),
            format!("{}M", self.memory_mib()),
            "-kernel".into(),
            kernel.display().to_string(),
            "-initrd".into(),
            initrd.display().to_string(),
            "-append".into(),
            self.kernel_cmdline(),
        ])
        .collect()
    }

    fn gdrvm_args(&self, kernel: &Path, initrd: &Path) -> Vec<String> {
        vec![
            "--kernel".into(),
            kernel.display().to_string(),
            "--initrd".into(),
            initrd.display().to_string(),
            "--cmdline".into(),
            self.kernel_cmdline(),
            "--cpus".into(),
            self.cpus.to_string(),
            "--memory".into(),
            self.memory.clone(),
        ]
    }

    /// Checks what gdrvm would reject as a usage error, before anything is built or booted.
    pub fn validate(&self) -> Result<(), String> {
        let bytes = gdrvm_model::parse_size(&self.memory)
            .ok_or_else(|| format!("memory '{}' is not a size (e.g. 512M, 2G)", self.memory))?;
        if !(gdrvm_model::MIN_GUEST_MEMORY..=gdrvm_model::MAX_GUEST_MEMORY).contains(&bytes) {
            return Err(format!("memory {} is out of range: a guest needs at least 64M and at most 1T", self.memory));
        }
        if self.cpus == 0 || self.cpus > gdrvm_model::MAX_GUEST_CPUS {
            return Err(format!("cpus {} is out of range: 1 to {}", self.cpus, gdrvm_model::MAX_GUEST_CPUS));
        }
        Ok(())
    }

    /// Whether QEMU runs this spec's guests (the VMM, or a cluster's nodes).
    pub(crate) fn uses_qemu(&self) -> bool {
        matches!(self.vmm, Vmm::Qemu(_)) || self.cluster.as_ref().is_some_and(|c| c.qemu)
    }

    /// Guest RAM of all the VMs this spec runs at once (every node of a cluster).
    pub(crate) fn guest_memory_mib(&self) -> u64 {
        let guests = self
            .cluster
            .as_ref()
            .map_or(1, |c| gdrvm_model::cluster::Cluster::resolve(&c.cluster).map_or(2, |c| c.nodes.len() as u64));
        self.memory_mib() * guests
    }

    pub(crate) fn memory_mib(&self) -> u64 {
        gdrvm_model::parse_size(&self.memory).map_or(1024, |b| b >> 20)
    }
}
