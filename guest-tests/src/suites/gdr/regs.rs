//! The registers every emulated device answers ([`gdrvm_model::emulated`]): identity, kind,
//! version, scratch and the interrupt doorbell; and the GPU's aperture.

use gdrvm_model::emulated::{
    GPU_APERTURE_BAR, GPU_APERTURE_SIZE_HI, GPU_APERTURE_SIZE_LO, KIND_GPU, KIND_NIC, REGS, REG_IDENT, REG_IRQ_COUNT,
    REG_IRQ_DOORBELL, REG_KIND, REG_SCRATCH, REG_VERSION, VERSION,
};

use crate::pcidev::Mmio;

/// What a look at registers found: diagnostics and problems.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Findings {
    /// Diagnostic lines.
    pub notes: Vec<String>,
    /// What is wrong; empty when all held.
    pub problems: Vec<String>,
}

fn read<R: Mmio>(regs: &mut R, reg: u64) -> u32 {
    regs.read32((REGS + reg) as usize)
}

fn write<R: Mmio>(regs: &mut R, reg: u64, value: u32) {
    regs.write32((REGS + reg) as usize, value);
}

/// A [`REG_KIND`] value by name: its four ASCII letters, or hex.
pub fn kind_name(kind: u32) -> String {
    let bytes = kind.to_be_bytes();
    if bytes.iter().all(|b| b.is_ascii_alphanumeric()) {
        bytes.iter().map(|&b| char::from(b)).collect()
    } else {
        format!("{kind:#010x}")
    }
}

/// Checks the registers every emulated device has: [`REG_IDENT`] is `device << 16 | vendor`
/// of `ids` (as sysfs reads them), [`REG_KIND`] is `kind`, [`REG_VERSION`] is [`VERSION`],
/// and [`REG_SCRATCH`] keeps `probe` and its complement (it is put back as found).
pub fn common<R: Mmio>(regs: &mut R, ids: (u16, u16), kind: u32, probe: u32) -> Findings {
    let mut f = Findings::default();
    let (ident, got_kind, version) = (read(regs, REG_IDENT), read(regs, REG_KIND), read(regs, REG_VERSION));
    f.notes.push(format!("ident {ident:#010x}, kind {}, version {version}", kind_name(got_kind)));
    if [ident, got_kind, version].iter().all(|&r| r == u32::MAX) {
        f.problems.push("the registers read all-ones: memory decode is off, or no device answers".into());
        return f;
    }
    let want = u32::from(ids.1) << 16 | u32::from(ids.0);
    if ident != want {
        f.problems.push(format!("ident reads {ident:#010x}, sysfs IDs {:04x}:{:04x} make {want:#010x}", ids.0, ids.1));
    }
    if got_kind != kind {
        let want = kind_name(kind);
        f.problems.push(format!("kind reads {} ({got_kind:#010x}), expected {want}", kind_name(got_kind)));
    }
    if version != VERSION {
        f.problems.push(format!("version reads {version}, this agent knows {VERSION}"));
    }
    let old = read(regs, REG_SCRATCH);
    for value in [probe, !probe] {
        write(regs, REG_SCRATCH, value);
        let back = read(regs, REG_SCRATCH);
        if back != value {
            f.problems.push(format!("scratch reads {back:#010x} after writing {value:#010x}"));
            break;
        }
    }
    write(regs, REG_SCRATCH, old);
    if f.problems.is_empty() {
        f.notes.push(format!("scratch keeps {probe:#010x} and {:#010x}", !probe));
    }
    f
}

/// Rings the interrupt doorbell (vector 0) and reads the interrupt count around it. Without a
/// driver MSI-X is off, so the count need not move: only reads that fail are a problem.
pub fn doorbell<R: Mmio>(regs: &mut R) -> Findings {
    let mut f = Findings::default();
    let before = read(regs, REG_IRQ_COUNT);
    write(regs, REG_IRQ_DOORBELL, 0);
    let after = read(regs, REG_IRQ_COUNT);
    f.notes.push(format!("irq doorbell 0: count {before} -> {after} (MSI-X off without a driver)"));
    if before == u32::MAX || after == u32::MAX {
        f.problems.push("the interrupt count reads all-ones".into());
    }
    f
}

/// The GPU's aperture as its registers say: BAR index and size.
pub fn aperture<R: Mmio>(regs: &mut R) -> (u32, u64) {
    let size = u64::from(read(regs, GPU_APERTURE_SIZE_LO)) | u64::from(read(regs, GPU_APERTURE_SIZE_HI)) << 32;
    (read(regs, GPU_APERTURE_BAR), size)
}

/// [`KIND_GPU`] or [`KIND_NIC`].
pub fn kind_of(gpu: bool) -> u32 {
    if gpu {
        KIND_GPU
    } else {
        KIND_NIC
    }
}

#[cfg(test)]
mod tests {
    use super::super::fake::FakeDevice;
    use super::*;

    #[test]
    fn test_common_registers_of_a_good_device() {
        let mut gpu = FakeDevice::gpu(0x10de, 0x2330, 1, 64 << 20);
        let f = common(&mut gpu, (0x10de, 0x2330), KIND_GPU, 0x1234_5678);
        assert_eq!(f.problems, Vec::<String>::new());
        assert_eq!(f.notes[0], "ident 0x233010de, kind GPU0, version 1");
        assert_eq!(gpu.scratch, 0, "scratch put back");
        assert_eq!(aperture(&mut gpu), (1, 64 << 20));
        let d = doorbell(&mut gpu);
        assert!(d.problems.is_empty());
        assert_eq!(d.notes, ["irq doorbell 0: count 0 -> 0 (MSI-X off without a driver)"]);
    }

    #[test]
    fn test_common_registers_name_what_is_wrong() {
        let mut nic = FakeDevice::nic(0x15b3, 0x101b);
        let f = common(&mut nic, (0x15b3, 0x1021), KIND_GPU, 1);
        assert_eq!(
            f.problems,
            [
                "ident reads 0x101b15b3, sysfs IDs 15b3:1021 make 0x102115b3",
                "kind reads NIC0 (0x4e494330), expected GPU0"
            ]
        );
        nic.scratch_broken = true;
        let f = common(&mut nic, (0x15b3, 0x101b), KIND_NIC, 1);
        assert_eq!(f.problems, ["scratch reads 0x00000000 after writing 0x00000001"]);
        nic.gone = true;
        let f = common(&mut nic, (0x15b3, 0x101b), KIND_NIC, 1);
        assert!(f.problems[0].contains("all-ones"), "{f:?}");
        assert_eq!(doorbell(&mut nic).problems, ["the interrupt count reads all-ones"]);
    }
}
