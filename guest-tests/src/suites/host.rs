//! `host`: what a bare-metal host kernel must get right before it lends its GPUs and NICs to
//! guests (Vela's checks), read from sysfs alone: each device's IOMMU group and its mode
//! (identity or translated), ATS enabled on the VFs that drivers hold (the upstream "allow ATS
//! to work on VFs when the PF uses IDENTITY" change exists because it was not), ACS control on
//! the root and switch downstream ports, and each GPU's and NIC's trained link against its
//! capability.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::context::Context;
use crate::ktap::{Check, Verdict};
use crate::pcidev::{
    self, ext_capability_control, find_capability, find_ext_capability, is_bdf, CONFIG_HEADER_LEN, SYSFS_PCI,
};

/// Where sysfs lists IOMMU groups.
const IOMMU_GROUPS: &str = "/sys/kernel/iommu_groups";
/// PCI Express capability ID, its flags register (port type in bits 7:4).
const CAP_ID_EXP: u8 = 0x10;
const EXP_FLAGS: usize = 2;
/// Port types in the PCIe capability's flags.
const PORT_TYPE_ROOT: u8 = 4;
const PORT_TYPE_DOWNSTREAM: u8 = 6;
const EXT_CAP_ID_ACS: u16 = 0x000d;
const EXT_CAP_ID_ATS: u16 = 0x000f;
/// ATS Control: Enable.
const ATS_ENABLE: u16 = 1 << 15;
/// ACS Control bits, lowest first.
const ACS_BITS: [&str; 7] = ["SV", "TB", "RR", "CR", "UF", "EC", "DT"];

/// Runs the host checks.
pub fn run(ctx: &Context) -> Vec<Check> {
    let functions = read_functions(ctx);
    vec![
        iommu_groups(ctx, &functions),
        ats_on_vfs(ctx, &functions),
        acs_switch_ports(ctx, &functions),
        links(&functions),
    ]
}

/// A PCI function as these checks read it.
#[derive(Debug)]
struct Function {
    bdf: String,
    dir: PathBuf,
    class: u32,
    /// The PF's BDF, for a VF (its `physfn` link).
    physfn: Option<String>,
    /// The bound driver (its `driver` link).
    driver: Option<String>,
    /// The IOMMU group number (its `iommu_group` link).
    group: Option<String>,
}

impl Function {
    fn is_gpu(&self) -> bool {
        self.class >> 16 == 0x03
    }

    fn is_nic(&self) -> bool {
        self.class >> 16 == 0x02
    }

    fn is_bridge(&self) -> bool {
        self.class >> 8 == 0x0604
    }

    /// `gpu`, `nic`, `function`, with ` vf` for a VF.
    fn kind(&self) -> String {
        let base = if self.is_gpu() {
            "gpu"
        } else if self.is_nic() {
            "nic"
        } else {
            "function"
        };
        if self.physfn.is_some() {
            format!("{base} vf")
        } else {
            base.to_owned()
        }
    }

    /// The whole of sysfs `config` (empty when unreadable).
    fn config(&self) -> Vec<u8> {
        std::fs::read(self.dir.join("config")).unwrap_or_default()
    }
}

/// The last component of the link `dir/name` points to.
fn link_name(dir: &Path, name: &str) -> Option<String> {
    let target = std::fs::read_link(dir.join(name)).ok()?;
    target.file_name().map(|n| n.to_string_lossy().into_owned())
}

fn read_text(dir: &Path, file: &str) -> Option<String> {
    std::fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_owned())
}

/// Every function in sysfs whose class reads, by BDF.
fn read_functions(ctx: &Context) -> Vec<Function> {
    let Ok(entries) = std::fs::read_dir(ctx.path(SYSFS_PCI)) else { return Vec::new() };
    let mut names: Vec<String> =
        entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| is_bdf(n)).collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|bdf| {
            let dir = pcidev::function_dir(&ctx.root, &bdf);
            let class = u32::from_str_radix(read_text(&dir, "class")?.trim_start_matches("0x"), 16).ok()?;
            Some(Function {
                physfn: link_name(&dir, "physfn"),
                driver: pcidev::driver(&dir),
                group: link_name(&dir, "iommu_group"),
                bdf,
                dir,
                class,
            })
        })
        .collect()
}

/// The `type` of IOMMU group `group`: identity, DMA, DMA-FQ, blocked, unmanaged.
fn group_type(ctx: &Context, group: &str) -> Result<String, String> {
    let path = ctx.path(&format!("{IOMMU_GROUPS}/{group}/type"));
    std::fs::read_to_string(&path).map(|t| t.trim().to_owned()).map_err(|e| format!("{}: {e}", path.display()))
}

/// What a group type means for DMA from the device.
fn group_mode(kind: &str) -> &'static str {
    match kind {
        "identity" => "identity: DMA untranslated",
        "DMA" | "DMA-FQ" => "translated",
        "unmanaged" => "unmanaged: owned by userspace (vfio)",
        "blocked" => "blocked",
        _ => "unknown mode",
    }
}

/// Whether the machine has any IOMMU group.
fn has_iommu_groups(ctx: &Context) -> bool {
    std::fs::read_dir(ctx.path(IOMMU_GROUPS)).is_ok_and(|mut d| d.next().is_some())
}

/// Every GPU, NIC and VF: its IOMMU group and the group's type. Only a type that cannot be
/// read fails; what the types are is for whoever reads the report.
fn iommu_groups(ctx: &Context, functions: &[Function]) -> Check {
    const NAME: &str = "iommu_groups";
    if !has_iommu_groups(ctx) {
        return Check::new(
            NAME,
            Verdict::Skip(format!("no IOMMU groups in {IOMMU_GROUPS}: the IOMMU is off or absent")),
        );
    }
    let mut notes = Vec::new();
    let mut unreadable = Vec::new();
    let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
    for f in functions.iter().filter(|f| f.is_gpu() || f.is_nic() || f.physfn.is_some()) {
        let driver = f.driver.as_deref().unwrap_or("none");
        let Some(group) = &f.group else {
            notes.push(format!("iommu {} {} no IOMMU group, driver {driver}", f.bdf, f.kind()));
            continue;
        };
        match group_type(ctx, group) {
            Ok(kind) => {
                notes.push(format!(
                    "iommu {} {} group {group} {kind} ({}), driver {driver}",
                    f.bdf,
                    f.kind(),
                    group_mode(&kind)
                ));
                *by_type.entry(kind).or_default() += 1;
            }
            Err(e) => {
                notes.push(format!("iommu {} {} group {group} type unreadable, driver {driver}", f.bdf, f.kind()));
                unreadable.push(format!("{}: group {group}: {e}", f.bdf));
            }
        }
    }
    let counts: Vec<String> = by_type.iter().map(|(k, n)| format!("{n} {k}")).collect();
    notes.push(format!(
        "{} GPU/NIC/VF function(s) in groups: {}",
        by_type.values().sum::<usize>(),
        if counts.is_empty() { "none".to_owned() } else { counts.join(", ") }
    ));
    let verdict = if unreadable.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(format!("IOMMU group type unreadable: {}", unreadable.join("; ")))
    };
    notes.into_iter().fold(Check::new(NAME, verdict), Check::note)
}

fn short_config(f: &Function, config: &[u8]) -> Verdict {
    Verdict::Skip(format!(
        "{}'s config space reads {} bytes: capabilities past the {CONFIG_HEADER_LEN}-byte header need root",
        f.bdf,
        config.len()
    ))
}

/// Every VF whose PF has ATS: the VF has ATS too, and a VF a driver holds has it enabled.
/// ATS off on a held VF whose PF sits in an identity group fails (the upstream bug); anywhere
/// else it is noted.
fn ats_on_vfs(ctx: &Context, functions: &[Function]) -> Check {
    const NAME: &str = "ats_on_vfs";
    let by_bdf: BTreeMap<&str, &Function> = functions.iter().map(|f| (f.bdf.as_str(), f)).collect();
    let vfs: Vec<(&Function, &str)> = functions.iter().filter_map(|f| Some((f, f.physfn.as_deref()?))).collect();
    if vfs.is_empty() {
        return Check::new(NAME, Verdict::Skip("no SR-IOV VFs (no function has a physfn link)".into()));
    }
    let mut notes = Vec::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (vf, pf_bdf) in vfs {
        let Some(pf) = by_bdf.get(pf_bdf) else {
            notes.push(format!("ats {}: its PF {pf_bdf} is not in sysfs", vf.bdf));
            continue;
        };
        let (pf_config, vf_config) = (pf.config(), vf.config());
        for (f, config) in [(*pf, &pf_config), (vf, &vf_config)] {
            if config.len() <= CONFIG_HEADER_LEN {
                return Check::new(NAME, short_config(f, config));
            }
        }
        if find_ext_capability(&pf_config, EXT_CAP_ID_ATS).is_none() {
            notes.push(format!("ats {}: PF {pf_bdf} has no ATS", vf.bdf));
            continue;
        }
        checked += 1;
        let pf_group = match &pf.group {
            Some(g) => group_type(ctx, g).unwrap_or_else(|_| "unreadable".into()),
            None => "none".into(),
        };
        let driver = vf.driver.as_deref();
        let Some(control) = ext_capability_control(&vf_config, EXT_CAP_ID_ATS) else {
            failures.push(format!("VF {} has no ATS capability though its PF {pf_bdf} has", vf.bdf));
            continue;
        };
        let enabled = control & ATS_ENABLE != 0;
        notes.push(format!(
            "ats {} VF of {pf_bdf} (PF group {pf_group}) driver {} ATS {}",
            vf.bdf,
            driver.unwrap_or("none"),
            if enabled { "enabled" } else { "disabled" }
        ));
        if driver.is_some() && !enabled && pf_group == "identity" {
            failures.push(format!(
                "VF {} has a driver ({}) but ATS disabled while its PF {pf_bdf}'s IOMMU group is {pf_group}",
                vf.bdf,
                driver.unwrap_or_default()
            ));
        }
    }
    let verdict = if !failures.is_empty() {
        Verdict::Fail(failures.join("; "))
    } else if checked == 0 {
        Verdict::Skip("no VF's PF has ATS".into())
    } else {
        Verdict::Pass
    };
    notes.into_iter().fold(Check::new(NAME, verdict), Check::note)
}

/// `SV+ TB- RR+ ...` for an ACS Control register.
fn acs_flags(control: u16) -> String {
    let flag = |i: usize| if control & (1 << i) != 0 { '+' } else { '-' };
    ACS_BITS.iter().enumerate().map(|(i, name)| format!("{name}{}", flag(i))).collect::<Vec<_>>().join(" ")
}

fn show_acs(control: Option<u16>) -> String {
    control.map_or("no ACS capability".into(), |c| format!("{} ({c:#06x})", acs_flags(c)))
}

/// Every root port and switch downstream port: its ACS Control, against the node file's
/// `acs_control` where the node file names the port (by BDF) with ACS; report only otherwise.
fn acs_switch_ports(ctx: &Context, functions: &[Function]) -> Check {
    const NAME: &str = "acs_switch_ports";
    let expect: BTreeMap<&str, &gdrvm_model::PciExpectation> =
        ctx.expect.iter().flat_map(|e| e.pci.iter()).filter(|p| p.acs).map(|p| (p.bdf.as_str(), p)).collect();
    let mut notes = Vec::new();
    let mut failures = Vec::new();
    for f in functions.iter().filter(|f| f.is_bridge()) {
        let config = f.config();
        if config.len() <= CONFIG_HEADER_LEN {
            return Check::new(NAME, short_config(f, &config));
        }
        let Some(exp) = find_capability(&config, CAP_ID_EXP) else { continue };
        let port = match config.get(exp + EXP_FLAGS).map(|flags| (flags >> 4) & 0xf) {
            Some(PORT_TYPE_ROOT) => "root",
            Some(PORT_TYPE_DOWNSTREAM) => "downstream",
            _ => continue,
        };
        let control = ext_capability_control(&config, EXT_CAP_ID_ACS);
        notes.push(format!("acs {} {port} {}", f.bdf, show_acs(control)));
        if let Some(want) = expect.get(f.bdf.as_str()) {
            if control != Some(want.acs_control) {
                failures.push(format!(
                    "{port} port {} ({}): ACS control {}, expected {}",
                    f.bdf,
                    want.name,
                    show_acs(control),
                    show_acs(Some(want.acs_control))
                ));
            }
        }
    }
    let verdict = if notes.is_empty() {
        Verdict::Skip("no root ports or switch downstream ports".into())
    } else if failures.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(failures.join("; "))
    };
    notes.into_iter().fold(Check::new(NAME, verdict), Check::note)
}

/// A trained or maximum link from sysfs: (speed as written, GT/s, width); `None` without
/// link files or with an unknown speed or a zero width (VFs, links down).
fn read_link(dir: &Path, speed: &str, width: &str) -> Option<(String, f64, u8)> {
    let text = read_text(dir, speed)?;
    let gts: f64 = text.split_whitespace().next()?.parse().ok()?;
    let width: u8 = read_text(dir, width)?.parse().ok()?;
    (width > 0).then_some((text, gts, width))
}

/// Every GPU's and NIC's trained link against its maximum: narrower fails; slower fails
/// except for a GPU, which slows its link down when idle.
fn links(functions: &[Function]) -> Check {
    const NAME: &str = "links";
    let mut notes = Vec::new();
    let mut failures = Vec::new();
    for f in functions.iter().filter(|f| f.is_gpu() || f.is_nic()) {
        let (Some(cur), Some(max)) = (
            read_link(&f.dir, "current_link_speed", "current_link_width"),
            read_link(&f.dir, "max_link_speed", "max_link_width"),
        ) else {
            continue;
        };
        let line = format!("{} {} link {} x{} of {} x{}", f.kind(), f.bdf, cur.0, cur.2, max.0, max.2);
        if cur.2 < max.2 {
            failures.push(format!("{} {}: link x{} of x{} (degraded width)", f.kind(), f.bdf, cur.2, max.2));
        }
        if cur.1 < max.1 {
            if f.is_gpu() {
                notes.push(format!("{line}: slower than its maximum, may be idle"));
                continue;
            }
            failures.push(format!("{} {}: link {} of {} (degraded speed)", f.kind(), f.bdf, cur.0, max.0));
        }
        notes.push(line);
    }
    let verdict = if notes.is_empty() {
        Verdict::Skip("no GPU or NIC with link files".into())
    } else if failures.is_empty() {
        Verdict::Pass
    } else {
        Verdict::Fail(failures.join("; "))
    };
    notes.into_iter().fold(Check::new(NAME, verdict), Check::note)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pcidev::{CAP_POINTER, EXT_CAP_START, STATUS_CAP_LIST, STATUS_LOW};

    /// A fake sysfs: functions under `/sys/devices/pci0000:00`, linked from
    /// `/sys/bus/pci/devices`, IOMMU groups, drivers.
    struct Fake(tempfile::TempDir);

    impl Fake {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir_all(dir.path().join("sys/bus/pci/devices")).unwrap();
            Fake(dir)
        }

        fn root(&self) -> &Path {
            self.0.path()
        }

        /// Function `bdf` of `class` with a full (4 KiB) config space holding `config`'s bytes.
        fn function(&self, bdf: &str, class: u32, config: Vec<u8>) -> PathBuf {
            let dir = self.root().join("sys/devices/pci0000:00").join(bdf);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("class"), format!("{class:#08x}\n")).unwrap();
            std::fs::write(dir.join("config"), config).unwrap();
            std::os::unix::fs::symlink(&dir, self.root().join("sys/bus/pci/devices").join(bdf)).unwrap();
            dir
        }

        fn dir(&self, bdf: &str) -> PathBuf {
            self.root().join("sys/devices/pci0000:00").join(bdf)
        }

        /// IOMMU group `n` of `kind` holding `members`.
        fn group(&self, n: u32, kind: &str, members: &[&str]) {
            let group = self.root().join(format!("sys/kernel/iommu_groups/{n}"));
            std::fs::create_dir_all(&group).unwrap();
            if !kind.is_empty() {
                std::fs::write(group.join("type"), format!("{kind}\n")).unwrap();
            }
            for bdf in members {
                std::os::unix::fs::symlink(&group, self.dir(bdf).join("iommu_group")).unwrap();
            }
        }

        fn driver(&self, bdf: &str, name: &str) {
            let driver = self.root().join("sys/bus/pci/drivers").join(name);
            std::fs::create_dir_all(&driver).unwrap();
            std::os::unix::fs::symlink(&driver, self.dir(bdf).join("driver")).unwrap();
        }

        fn vf(&self, vf: &str, pf: &str) {
            std::os::unix::fs::symlink(self.dir(pf), self.dir(vf).join("physfn")).unwrap();
        }

        fn link(&self, bdf: &str, current: (&str, u8), max: (&str, u8)) {
            let dir = self.dir(bdf);
            for (file, text) in [
                ("current_link_speed", current.0.to_owned()),
                ("current_link_width", current.1.to_string()),
                ("max_link_speed", max.0.to_owned()),
                ("max_link_width", max.1.to_string()),
            ] {
                std::fs::write(dir.join(file), format!("{text}\n")).unwrap();
            }
        }

        fn context(&self, expect: Option<gdrvm_model::Expectations>) -> Context {
            Context {
                expect,
                image: None,
                root: self.root().to_owned(),
                kernel_log: Ok(String::new()),
                module_errors: vec![],
                modules_left_out: vec![],
            }
        }

        fn checks(&self) -> Vec<Check> {
            run(&self.context(None))
        }
    }

    /// 4 KiB of config space: a PCIe capability of `port` type at 0x40, then the extended
    /// capabilities `ext` (ID, control) chained from 0x100 every 0x40.
    fn config(port: u8, ext: &[(u16, u16)]) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        c[STATUS_LOW] = STATUS_CAP_LIST;
        c[CAP_POINTER] = 0x40;
        c[0x40] = CAP_ID_EXP;
        c[0x42] = (port << 4) | 2;
        for (i, (id, control)) in ext.iter().enumerate() {
            let at = EXT_CAP_START + 0x40 * i;
            let next = if i + 1 < ext.len() { (at + 0x40) as u32 } else { 0 };
            c[at..at + 4].copy_from_slice(&(u32::from(*id) | (1 << 16) | (next << 20)).to_le_bytes());
            c[at + 6..at + 8].copy_from_slice(&control.to_le_bytes());
        }
        c
    }

    fn check<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap()
    }

    fn is_skip(c: &Check, why: &str) -> bool {
        matches!(&c.verdict, Verdict::Skip(r) if r.contains(why))
    }

    fn is_fail(c: &Check, why: &str) -> bool {
        matches!(&c.verdict, Verdict::Fail(r) if r.contains(why))
    }

    const GPU: u32 = 0x03_02_00;
    const NIC: u32 = 0x02_00_00;
    const BRIDGE: u32 = 0x06_04_00;
    const ENDPOINT: u8 = 0;

    #[test]
    fn test_capability_walks() {
        let c = config(PORT_TYPE_DOWNSTREAM, &[(EXT_CAP_ID_ATS, ATS_ENABLE), (EXT_CAP_ID_ACS, 0x1d)]);
        assert_eq!(find_capability(&c, CAP_ID_EXP), Some(0x40));
        assert_eq!(ext_capability_control(&c, EXT_CAP_ID_ATS), Some(ATS_ENABLE));
        assert_eq!(ext_capability_control(&c, EXT_CAP_ID_ACS), Some(0x1d));
        assert_eq!(ext_capability_control(&c[..256], EXT_CAP_ID_ACS), None);
        assert_eq!(find_capability(&c[..64], CAP_ID_EXP), None);
        assert_eq!(find_capability(&[], CAP_ID_EXP), None);
        assert_eq!(acs_flags(0x1d), "SV+ TB- RR+ CR+ UF+ EC- DT-");
    }

    #[test]
    fn test_iommu_groups_report_each_mode_and_fail_only_on_an_unreadable_type() {
        let fake = Fake::new();
        fake.function("0000:03:00.0", GPU, config(ENDPOINT, &[]));
        fake.function("0000:04:00.0", NIC, config(ENDPOINT, &[]));
        fake.function("0000:04:00.1", NIC, config(ENDPOINT, &[]));
        fake.vf("0000:04:00.1", "0000:04:00.0");
        fake.function("0000:00:1f.0", 0x06_01_00, vec![]);
        fake.group(3, "identity", &["0000:03:00.0"]);
        fake.group(4, "DMA-FQ", &["0000:04:00.0"]);
        fake.group(5, "unmanaged", &["0000:04:00.1"]);
        fake.driver("0000:04:00.1", "vfio-pci");
        let checks = fake.checks();
        let c = check(&checks, "iommu_groups");
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.diagnostics,
            [
                "iommu 0000:03:00.0 gpu group 3 identity (identity: DMA untranslated), driver none",
                "iommu 0000:04:00.0 nic group 4 DMA-FQ (translated), driver none",
                "iommu 0000:04:00.1 nic vf group 5 unmanaged (unmanaged: owned by userspace (vfio)), driver vfio-pci",
                "3 GPU/NIC/VF function(s) in groups: 1 DMA-FQ, 1 identity, 1 unmanaged",
            ]
        );
        // A group without `type`: fail, naming the function and the group.
        fake.group(6, "", &[]);
        std::fs::remove_file(fake.dir("0000:03:00.0").join("iommu_group")).unwrap();
        std::os::unix::fs::symlink(
            fake.root().join("sys/kernel/iommu_groups/6"),
            fake.dir("0000:03:00.0").join("iommu_group"),
        )
        .unwrap();
        let checks = fake.checks();
        assert!(is_fail(check(&checks, "iommu_groups"), "0000:03:00.0: group 6"), "{checks:?}");
    }

    #[test]
    fn test_iommu_groups_skip_without_an_iommu() {
        let fake = Fake::new();
        fake.function("0000:03:00.0", GPU, config(ENDPOINT, &[]));
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "iommu_groups"), "no IOMMU groups"), "{checks:?}");
    }

    /// A PF with ATS and its VF, in IOMMU groups of `pf_group` type; the VF's ATS control.
    fn sriov(pf_group: &str, vf_ats: Option<u16>, vf_driver: Option<&str>) -> Fake {
        let fake = Fake::new();
        fake.function("0000:04:00.0", NIC, config(ENDPOINT, &[(EXT_CAP_ID_ATS, ATS_ENABLE)]));
        let vf_ext: Vec<(u16, u16)> = vf_ats.map(|c| (EXT_CAP_ID_ATS, c)).into_iter().collect();
        fake.function("0000:04:00.2", NIC, config(ENDPOINT, &vf_ext));
        fake.vf("0000:04:00.2", "0000:04:00.0");
        fake.group(4, pf_group, &["0000:04:00.0"]);
        fake.group(5, "DMA", &["0000:04:00.2"]);
        if let Some(d) = vf_driver {
            fake.driver("0000:04:00.2", d);
        }
        fake
    }

    #[test]
    fn test_ats_on_vfs_passes_when_held_vfs_have_it_enabled() {
        let checks = sriov("identity", Some(ATS_ENABLE), Some("mlx5_core")).checks();
        let c = check(&checks, "ats_on_vfs");
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.diagnostics,
            ["ats 0000:04:00.2 VF of 0000:04:00.0 (PF group identity) driver mlx5_core ATS enabled"]
        );
        // Without a driver, ATS off is only noted.
        let checks = sriov("identity", Some(0), None).checks();
        assert_eq!(check(&checks, "ats_on_vfs").verdict, Verdict::Pass);
        // With a translated PF, too.
        let checks = sriov("DMA", Some(0), Some("vfio-pci")).checks();
        assert_eq!(check(&checks, "ats_on_vfs").verdict, Verdict::Pass);
    }

    #[test]
    fn test_ats_off_on_a_held_vf_of_an_identity_pf_fails() {
        let checks = sriov("identity", Some(0), Some("vfio-pci")).checks();
        let c = check(&checks, "ats_on_vfs");
        assert!(
            is_fail(
                c,
                "VF 0000:04:00.2 has a driver (vfio-pci) but ATS disabled while its PF 0000:04:00.0's IOMMU group \
                 is identity"
            ),
            "{c:?}"
        );
        let checks = sriov("DMA", None, None).checks();
        assert!(is_fail(check(&checks, "ats_on_vfs"), "VF 0000:04:00.2 has no ATS capability"), "{checks:?}");
    }

    #[test]
    fn test_ats_on_vfs_skips_without_vfs_ats_or_root() {
        let fake = Fake::new();
        fake.function("0000:04:00.0", NIC, config(ENDPOINT, &[(EXT_CAP_ID_ATS, 0)]));
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "ats_on_vfs"), "no SR-IOV VFs"), "{checks:?}");
        // A PF without ATS.
        let fake = Fake::new();
        fake.function("0000:04:00.0", NIC, config(ENDPOINT, &[]));
        fake.function("0000:04:00.2", NIC, config(ENDPOINT, &[]));
        fake.vf("0000:04:00.2", "0000:04:00.0");
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "ats_on_vfs"), "no VF's PF has ATS"), "{checks:?}");
        // Not root: 64 bytes of config space.
        let fake = Fake::new();
        fake.function("0000:04:00.0", NIC, config(ENDPOINT, &[])[..64].to_vec());
        fake.function("0000:04:00.2", NIC, config(ENDPOINT, &[])[..64].to_vec());
        fake.vf("0000:04:00.2", "0000:04:00.0");
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "ats_on_vfs"), "0000:04:00.0's config space reads 64 bytes"), "{checks:?}");
    }

    /// A root port at 00:01.0 without ACS and a downstream port at 02:00.0 with ACS `control`,
    /// an upstream port and an endpoint beside them.
    fn ports(control: u16) -> Fake {
        let fake = Fake::new();
        fake.function("0000:00:01.0", BRIDGE, config(PORT_TYPE_ROOT, &[]));
        fake.function("0000:01:00.0", BRIDGE, config(5, &[(EXT_CAP_ID_ACS, 0x1d)]));
        fake.function("0000:02:00.0", BRIDGE, config(PORT_TYPE_DOWNSTREAM, &[(EXT_CAP_ID_ACS, control)]));
        fake.function("0000:03:00.0", GPU, config(ENDPOINT, &[(EXT_CAP_ID_ACS, 0x1d)]));
        fake
    }

    fn port_expectation(acs_control: u16) -> gdrvm_model::Expectations {
        let mut want = crate::context::expected_function("sw0_dp0", "switch_downstream", "0000:02:00.0", (0, 0));
        want.acs = true;
        want.acs_control = acs_control;
        crate::context::test_context(Path::new("/"), vec![want]).expect.unwrap()
    }

    #[test]
    fn test_acs_switch_ports_are_reported_and_checked_against_the_node_file() {
        let fake = ports(0x1d);
        let checks = fake.checks();
        let c = check(&checks, "acs_switch_ports");
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.diagnostics,
            [
                "acs 0000:00:01.0 root no ACS capability",
                "acs 0000:02:00.0 downstream SV+ TB- RR+ CR+ UF+ EC- DT- (0x001d)"
            ]
        );
        let checks = run(&fake.context(Some(port_expectation(0x1d))));
        assert_eq!(check(&checks, "acs_switch_ports").verdict, Verdict::Pass);
        let checks = run(&fake.context(Some(port_expectation(0x5f))));
        assert!(
            is_fail(
                check(&checks, "acs_switch_ports"),
                "downstream port 0000:02:00.0 (sw0_dp0): ACS control SV+ TB- RR+ CR+ UF+ EC- DT- (0x001d), expected \
                 SV+ TB+ RR+ CR+ UF+ EC- DT+ (0x005f)"
            ),
            "{checks:?}"
        );
    }

    #[test]
    fn test_acs_switch_ports_skip_without_ports_or_root() {
        let fake = Fake::new();
        fake.function("0000:03:00.0", GPU, config(ENDPOINT, &[]));
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "acs_switch_ports"), "no root ports"), "{checks:?}");
        let fake = Fake::new();
        fake.function("0000:00:01.0", BRIDGE, config(PORT_TYPE_ROOT, &[])[..64].to_vec());
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "acs_switch_ports"), "need root"), "{checks:?}");
    }

    #[test]
    fn test_links_at_their_maximum_pass_and_an_idle_gpu_is_noted() {
        let fake = Fake::new();
        fake.function("0000:03:00.0", GPU, vec![]);
        fake.function("0000:04:00.0", NIC, vec![]);
        fake.function("0000:04:00.2", NIC, vec![]);
        fake.function("0000:05:00.0", NIC, vec![]);
        fake.link("0000:03:00.0", ("2.5 GT/s PCIe", 16), ("16.0 GT/s PCIe", 16));
        fake.link("0000:04:00.0", ("16.0 GT/s PCIe", 16), ("16.0 GT/s PCIe", 16));
        // A VF: sysfs shows no trained link.
        fake.link("0000:04:00.2", ("Unknown", 0), ("Unknown", 0));
        let checks = fake.checks();
        let c = check(&checks, "links");
        assert_eq!(c.verdict, Verdict::Pass);
        assert_eq!(
            c.diagnostics,
            [
                "gpu 0000:03:00.0 link 2.5 GT/s PCIe x16 of 16.0 GT/s PCIe x16: slower than its maximum, may be idle",
                "nic 0000:04:00.0 link 16.0 GT/s PCIe x16 of 16.0 GT/s PCIe x16",
            ]
        );
    }

    #[test]
    fn test_a_narrow_link_or_a_slow_nic_fails() {
        let fake = Fake::new();
        fake.function("0000:03:00.0", GPU, vec![]);
        fake.function("0000:04:00.0", NIC, vec![]);
        fake.link("0000:03:00.0", ("16.0 GT/s PCIe", 8), ("16.0 GT/s PCIe", 16));
        fake.link("0000:04:00.0", ("8.0 GT/s PCIe", 16), ("16.0 GT/s PCIe", 16));
        let checks = fake.checks();
        let c = check(&checks, "links");
        assert_eq!(
            c.verdict,
            Verdict::Fail(
                "gpu 0000:03:00.0: link x8 of x16 (degraded width); nic 0000:04:00.0: link 8.0 GT/s PCIe of 16.0 \
                 GT/s PCIe (degraded speed)"
                    .into()
            )
        );
    }

    #[test]
    fn test_links_skip_without_link_files() {
        let fake = Fake::new();
        fake.function("0000:03:00.0", GPU, vec![]);
        let checks = fake.checks();
        assert!(is_skip(check(&checks, "links"), "no GPU or NIC with link files"), "{checks:?}");
    }
}
