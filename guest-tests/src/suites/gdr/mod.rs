//! `gdr`: the GPUDirect RDMA path through gdrvm's emulated devices (vfio-user servers
//! following [`gdrvm_model::emulated`]). Every emulated GPU and NIC the expectations list
//! answers on its registers; each NIC, driven from userspace (sysfs `resource0`, bus
//! mastering, a descriptor ring in pinned RAM), copies host RAM -> GPU aperture, aperture
//! -> RAM, aperture -> another GPU's aperture and RAM -> RAM at sizes from 4 KiB to 64 MiB,
//! checked through the BAR mappings, with the bandwidth of each; where the NIC or GPU does
//! not take part in peer-to-peer DMA, copies touching a BAR must be refused instead. Then
//! every GPU x NIC pair copies 16 MiB next to NCCL's path and GDR decision for it, and the
//! first NIC goes through a Function Level Reset as Linux makes one ([`reset`]). The
//! guest has no IOMMU: IOVAs are guest-physical addresses, a BAR's is its sysfs `resource`
//! start. Devices are left as found: ring size 0, `enable` and Command as they were.

mod data;
mod devices;
#[cfg(test)]
mod fake;
mod plan;
mod regs;
mod reset;
mod ring;
mod transfer;

use std::collections::BTreeMap;

use gdrvm_model::emulated::{DESC_LEN, NIC_RING_SIZE, REGS};
use gdrvm_model::{Expectations, PathExpectation, PciExpectation};

use self::devices::{open_gpu, open_nic, Gpu, Nic};
use self::plan::{End, Expected, Transfer};
use self::ring::{Ring, RingError};
use self::transfer::{Failed, Layout, Space, Spaces};
use crate::context::Context;
use crate::dma::{runs, PinnedBuffer, PAGE_SIZE};
use crate::ktap::{Check, Verdict};
use crate::pcidev::Mmio;
use crate::sys;

/// Descriptors in a NIC's ring: one page of them.
const RING_ENTRIES: u32 = (PAGE_SIZE as u64 / DESC_LEN) as u32;
/// The most host memory the suite pins (host -> host copies use half each way).
const HOST_BUFFER: u64 = 64 << 20;
/// The smallest host buffer worth testing with.
const HOST_BUFFER_MIN: u64 = 8 << 10;

/// Runs the suite.
pub fn run(ctx: &Context) -> Vec<Check> {
    const NAME: &str = "emulated_devices";
    let Some(expect) = ctx.expect.as_ref() else {
        return vec![Check::new(NAME, Verdict::Skip("no expectations: not a gdrvm guest".into()))];
    };
    let expect = &plan::paths_by_name(expect);
    let found = plan::emulated(expect);
    if found.gpus.is_empty() && found.nics.is_empty() {
        let reason = "no PCI function is backed by emulated-gpu or emulated-nic";
        return vec![Check::new(NAME, Verdict::Skip(reason.into()))];
    }
    let mut seeds = Seeds { token: sys::random_u64(), n: 0 };
    let mut checks = Vec::new();
    let mut gpus = Vec::new();
    for exp in &found.gpus {
        let (check, gpu) = open_gpu(ctx, exp, seeds.next() as u32);
        checks.push(check);
        gpus.extend(gpu);
    }
    let mut nics = Vec::new();
    for exp in &found.nics {
        let (check, nic) = open_nic(ctx, exp, seeds.next() as u32);
        checks.push(check);
        nics.extend(nic);
    }
    let mut host = None;
    if !nics.is_empty() {
        let (check, buffer) = host_buffer(ctx);
        checks.push(check);
        host = buffer;
    }
    let mut matrix = BTreeMap::new();
    for (i, nic) in nics.iter_mut().enumerate() {
        checks.extend(nic_transfers(expect, (i, nic), &mut gpus, host.as_mut(), &mut seeds, &mut matrix));
        for (j, gpu) in gpus.iter().enumerate() {
            let (gpu, nic) = (&gpu.exp.name, &nic.exp.name);
            matrix.entry((j, i)).or_insert_with(|| (format!("gdr: {gpu} {nic}: not run (see {nic}_ring)"), None));
        }
    }
    checks.push(matrix_check(&found, &gpus, &nics, matrix));
    if let Some(nic) = nics.first_mut() {
        checks.push(reset_check(nic, seeds.next() as u32));
    }
    checks.push(leave_as_found(gpus, nics, host));
    checks
}

/// Fresh patterns: one seed per use.
struct Seeds {
    token: u64,
    n: u64,
}

impl Seeds {
    fn next(&mut self) -> u64 {
        self.n += 1;
        data::word(self.token, self.n)
    }
}

fn check(name: &str, notes: Vec<String>, problems: &[String]) -> Check {
    let verdict = if problems.is_empty() { Verdict::Pass } else { Verdict::Fail(problems.join("; ")) };
    Check { diagnostics: notes, ..Check::new(name, verdict) }
}

/// Pinned host memory and where its pages are.
struct Host {
    buf: PinnedBuffer,
    pages: Vec<u64>,
}

/// Bytes of RAM the kernel could give (MemAvailable), if it says.
fn mem_available(ctx: &Context) -> Option<u64> {
    let text = std::fs::read_to_string(ctx.path("/proc/meminfo")).ok()?;
    let line = text.lines().find_map(|l| l.strip_prefix("MemAvailable:"))?;
    line.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?.checked_mul(1024)
}

/// How much host memory to pin: [`HOST_BUFFER`], or less, a power of two, when a quarter
/// of the available RAM is less.
fn host_size(available: Option<u64>) -> u64 {
    let quarter = available.map_or(HOST_BUFFER, |a| a / 4);
    let size = if quarter >= HOST_BUFFER { HOST_BUFFER } else { 1 << quarter.max(1).ilog2() };
    size.min(HOST_BUFFER)
}

fn host_buffer(ctx: &Context) -> (Check, Option<Host>) {
    const NAME: &str = "host_buffer";
    let available = mem_available(ctx);
    let size = host_size(available);
    let mut notes = vec![format!(
        "MemAvailable {}, pinning {}",
        available.map_or("unknown".into(), |a| format!("{} MiB", a >> 20)),
        plan::size_name(size)
    )];
    if size < HOST_BUFFER_MIN {
        return (check(NAME, notes, &[format!("too little memory to pin {}", plan::size_name(HOST_BUFFER_MIN))]), None);
    }
    let pinned = usize::try_from(size)
        .map_err(|e| e.to_string())
        .and_then(PinnedBuffer::new)
        .and_then(|buf| Ok((buf.physical_pages()?, buf)));
    match pinned {
        Ok((pages, buf)) => {
            let all = runs(&pages, 0, size).unwrap_or_default();
            let largest = all.iter().map(|r| r.len).max().unwrap_or(0);
            notes.push(format!(
                "{} pages in {} physically contiguous runs, the largest {}",
                pages.len(),
                all.len(),
                plan::size_name(largest)
            ));
            (check(NAME, notes, &[]), Some(Host { buf, pages }))
        }
        Err(e) => (check(NAME, notes, &[format!("cannot pin host memory: {e}")]), None),
    }
}

/// One direction of a NIC's sweep: its check, label and ends, and the sizes that fit.
struct Direction {
    check: String,
    label: String,
    src: End,
    dst: End,
    sizes: Vec<u64>,
    /// The most bytes the memories on both ends allow.
    limit: u64,
}

/// The directions a NIC sweeps: RAM -> RAM, and with its nearest GPU (and another), RAM ->
/// GPU, GPU -> RAM and GPU -> GPU, each at the sizes that fit; `gpus` are the opened GPUs'
/// names and aperture sizes, `host` the host buffer's size. Checks that cannot run come back
/// as skips.
fn directions(
    paths: &[PathExpectation],
    nic: &str,
    gpus: &[(&str, u64)],
    host: Option<u64>,
) -> (Vec<Direction>, Vec<Check>) {
    let (mut dirs, mut skips) = (Vec::new(), Vec::new());
    let names: Vec<&str> = gpus.iter().map(|g| g.0).collect();
    let host_len = host.unwrap_or(0);
    let mut add = |src: (End, &str), dst: (End, &str), limit: u64| {
        let check = format!("{nic}_{}_to_{}", src.1, dst.1);
        let label = format!("{}->{}", src.1, dst.1);
        dirs.push(Direction { check, label, src: src.0, dst: dst.0, sizes: plan::sizes(limit), limit });
    };
    add((End::Host(0), "host"), (End::Host(host_len / 2), "host"), host_len / 2);
    let Some(near) = plan::nearest_gpu(paths, &names, nic) else {
        skips.push(Check::new(&format!("{nic}_gpu_transfers"), Verdict::Skip("no emulated GPU answered".into())));
        return (dirs, skips);
    };
    let (g, size) = ((End::Gpu(near), names[near]), gpus[near].1);
    add((End::Host(0), "host"), g, host_len.min(size));
    add(g, (End::Host(0), "host"), host_len.min(size));
    match (0..gpus.len()).find(|&i| i != near) {
        Some(o) => add(g, (End::Gpu(o), names[o]), size.min(gpus[o].1)),
        None => skips.push(Check::new(
            &format!("{nic}_gpu_to_gpu"),
            Verdict::Skip("one emulated GPU answered; GPU -> GPU needs two".into()),
        )),
    }
    (dirs, skips)
}

/// Whether `t` must copy or be refused, by the p2p flags of the NIC and the GPUs it touches.
fn expectation(nic: &PciExpectation, gpus: &[Gpu], t: &Transfer) -> Expected {
    let p2p: Vec<bool> = t.gpus().filter_map(|i| gpus.get(i)).map(|g| g.exp.p2p).collect();
    plan::expected(nic.p2p, &p2p)
}

/// The matrix: for each (GPU, NIC), its diagnostic line and its problem, if any.
type Matrix = BTreeMap<(usize, usize), (String, Option<String>)>;

/// A NIC ready to copy: its ring, the memories, fresh patterns, and the ring's failure once
/// it has failed (nothing more runs then).
struct Session<'r, 's, R: Mmio, M: Mmio> {
    ring: Ring<'r, R, M>,
    spaces: Spaces<'s>,
    seeds: &'r mut Seeds,
    dead: Option<RingError>,
}

impl<R: Mmio, M: Mmio> Session<'_, '_, R, M> {
    /// Runs `t`: the report, or why it did not run to its end.
    fn run(&mut self, t: &Transfer, expected: Expected) -> Result<transfer::Report, String> {
        if let Some(e) = &self.dead {
            return Err(format!("not run, the ring failed before: {e}"));
        }
        transfer::execute(&mut self.ring, &mut self.spaces, t, self.seeds.next(), expected).map_err(|e| {
            if let Failed::Ring(e) = &e {
                self.dead = Some(e.clone());
            }
            e.to_string()
        })
    }
}

/// NIC number `n`'s sweep, and its column of the matrix.
fn nic_transfers(
    expect: &Expectations,
    (n, nic): (usize, &mut Nic),
    gpus: &mut [Gpu],
    host: Option<&mut Host>,
    seeds: &mut Seeds,
    matrix: &mut Matrix,
) -> Vec<Check> {
    let name = nic.exp.name.clone();
    let ring_check = format!("{name}_ring");
    let mut ring_page = match PinnedBuffer::new(PAGE_SIZE).and_then(|p| Ok((p.physical_pages()?, p))) {
        Ok((pages, page)) if !pages.is_empty() => (pages[0], page),
        Ok(_) => return vec![check(&ring_check, vec![], &["no page for the ring".into()])],
        Err(e) => return vec![check(&ring_check, vec![], &[format!("no page for the ring: {e}")])],
    };
    let base = ring_page.0;
    let ring = match Ring::attach(&mut nic.regs, &mut ring_page.1, base, RING_ENTRIES) {
        Ok(ring) => ring,
        Err(e) => return vec![check(&ring_check, vec![], &[format!("cannot attach a ring at {base:#x}: {e}")])],
    };
    let mut checks = vec![check(&ring_check, vec![format!("ring of {RING_ENTRIES} descriptors at {base:#x}")], &[])];
    let host_len = host.as_ref().map(|h| h.buf.len() as u64);
    let sizes: Vec<(&str, u64)> = gpus.iter().map(|g| (g.exp.name.as_str(), g.size)).collect();
    let (dirs, skips) = directions(&expect.paths, &name, &sizes, host_len);
    let expectations: Vec<Vec<Expected>> = dirs
        .iter()
        .map(|d| {
            d.sizes.iter().map(|&len| expectation(nic.exp, gpus, &Transfer { src: d.src, dst: d.dst, len })).collect()
        })
        .collect();
    let row: Vec<(String, u64, Expected)> =
        gpus.iter().map(|g| (g.exp.name.clone(), g.size, plan::expected(nic.exp.p2p, &[g.exp.p2p]))).collect();
    let spaces = Spaces {
        host: host.map(|h| Space { mem: &mut h.buf, layout: Layout::Pages(h.pages.clone()) }),
        gpus: gpus
            .iter_mut()
            .map(|g| Space { mem: &mut g.aperture, layout: Layout::Contiguous { base: g.iova, len: g.size } })
            .collect(),
    };
    let mut session = Session { ring, spaces, seeds, dead: None };
    for (d, expected) in dirs.iter().zip(&expectations) {
        checks.push(sweep(&mut session, &name, d, expected, host_len.is_some()));
    }
    checks.extend(skips);
    for (j, (gpu, size, expected)) in row.iter().enumerate() {
        let path = plan::describe_path(plan::path(&expect.paths, gpu, &name));
        let limit = host_len.unwrap_or(0).min(*size);
        matrix.insert((j, n), matrix_entry(&mut session, (j, gpu), &name, &path, limit, *expected));
    }
    checks
}

/// One direction of a NIC's sweep, every size, as a check with a bandwidth line for each.
fn sweep<R: Mmio, M: Mmio>(
    session: &mut Session<R, M>,
    nic: &str,
    d: &Direction,
    expected: &[Expected],
    have_host: bool,
) -> Check {
    if d.sizes.is_empty() {
        let reason =
            if have_host { "no transfer size fits the memories" } else { "no pinned host buffer (see host_buffer)" };
        return Check::new(&d.check, Verdict::Skip(reason.into()));
    }
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    for (&len, &expected) in d.sizes.iter().zip(expected) {
        let what = format!("{} {}", d.label, plan::size_name(len));
        match session.run(&Transfer { src: d.src, dst: d.dst, len }, expected) {
            Ok(r) => {
                let n = r.descriptors;
                notes.push(match expected {
                    Expected::Copied => format!(
                        "gdr: {nic} {what}: {} ({n} descriptor{})",
                        plan::rate(len, r.outcome.elapsed),
                        if n == 1 { "" } else { "s" }
                    ),
                    Expected::Refused => format!("gdr: {nic} p2p off: {what} refused (unmapped)"),
                });
                problems.extend(r.problems.into_iter().map(|p| format!("{what}: {p}")));
            }
            Err(e) => problems.push(format!("{what}: {e}")),
        }
    }
    if let Some(&over) = plan::SIZES.iter().find(|&&s| s > d.limit) {
        let (over, limit) = (plan::size_name(over), plan::size_name(d.limit));
        notes.push(format!("gdr: {nic} {}: {over} and up not run, the memories hold {limit}", d.label));
    }
    check(&d.check, notes, &problems)
}

/// The matrix entry of GPU `j` and the NIC: RAM -> the GPU at the matrix size (or the
/// largest that fits in `limit`), its line and its problem.
fn matrix_entry<R: Mmio, M: Mmio>(
    session: &mut Session<R, M>,
    (j, gpu): (usize, &str),
    nic: &str,
    path: &str,
    limit: u64,
    expected: Expected,
) -> (String, Option<String>) {
    let head = format!("gdr: {gpu} {nic} {path}");
    let Some(len) = plan::matrix_size(limit) else {
        return (format!("{head}: not run, no size fits"), None);
    };
    let sized = if len == plan::MATRIX_SIZE { String::new() } else { format!(" ({})", plan::size_name(len)) };
    match (session.run(&Transfer { src: End::Host(0), dst: End::Gpu(j), len }, expected), expected) {
        (Ok(r), Expected::Copied) if r.problems.is_empty() => {
            (format!("{head} {}{sized}", plan::rate(len, r.outcome.elapsed)), None)
        }
        (Ok(r), Expected::Refused) if r.problems.is_empty() => (format!("{head}: refused (p2p off)"), None),
        (Ok(r), _) => (format!("{head}: failed"), Some(format!("{gpu} {nic}: {}", r.problems.join("; ")))),
        (Err(e), _) => (format!("{head}: failed"), Some(format!("{gpu} {nic}: {e}"))),
    }
}

fn matrix_check(found: &plan::Emulated, gpus: &[Gpu], nics: &[Nic], matrix: Matrix) -> Check {
    const NAME: &str = "gdr_matrix";
    if found.gpus.is_empty() || found.nics.is_empty() {
        return Check::new(NAME, Verdict::Skip("needs emulated GPUs and NICs both".into()));
    }
    if gpus.is_empty() || nics.is_empty() {
        return Check::new(NAME, Verdict::Skip("no emulated GPU or no emulated NIC answered (see *_registers)".into()));
    }
    let mut notes = vec![format!(
        "{} GPUs x {} NICs, {} host -> GPU each",
        gpus.len(),
        nics.len(),
        plan::size_name(plan::MATRIX_SIZE)
    )];
    let mut problems = Vec::new();
    for (line, problem) in matrix.into_values() {
        notes.push(line);
        problems.extend(problem);
    }
    check(NAME, notes, &problems)
}

/// `<nic>_function_level_reset`: the NIC reset through sysfs (see [`reset`]).
fn reset_check(nic: &mut Nic, probe: u32) -> Check {
    let dir = nic.claim.dir().to_owned();
    let ids = (nic.exp.vendor, nic.exp.device);
    let f = reset::function_level_reset(&dir, &mut nic.regs, ids, probe, |_| crate::pcidev::reset(&dir));
    check(&format!("{}_function_level_reset", nic.exp.name), f.notes, &f.problems)
}

/// Stops every ring, puts `enable` and Command back, and checks the host buffer stayed put.
fn leave_as_found(gpus: Vec<Gpu>, nics: Vec<Nic>, host: Option<Host>) -> Check {
    let (mut notes, mut problems) = (Vec::new(), Vec::new());
    for mut nic in nics {
        let size = nic.regs.read32((REGS + NIC_RING_SIZE) as usize);
        if size != 0 {
            problems.push(format!("{}: ring size reads {size}, not 0", nic.exp.name));
        }
        drop(nic.regs);
        match nic.claim.release() {
            Ok(line) => notes.push(format!("{}: ring size {size}, {line}", nic.exp.name)),
            Err(e) => problems.push(format!("{}: {e}", nic.exp.name)),
        }
    }
    for gpu in gpus {
        drop(gpu.aperture);
        match gpu.claim.release() {
            Ok(line) => notes.push(format!("{}: {line}", gpu.exp.name)),
            Err(e) => problems.push(format!("{}: {e}", gpu.exp.name)),
        }
    }
    if let Some(host) = host {
        match host.buf.physical_pages() {
            Ok(pages) if pages == host.pages => notes.push("the host buffer's pages stayed put".into()),
            Ok(_) => problems.push("the host buffer's pages moved during the suite: copies may have missed".into()),
            Err(e) => problems.push(format!("cannot read the host buffer's pages again: {e}")),
        }
    }
    check("left_as_found", notes, &problems)
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use gdrvm_model::nccl::PathType;
    use gdrvm_model::BarExpectation;

    use super::*;
    use crate::pcidev;

    fn function(name: &str, kind: &str, bdf: &str, backing: &str) -> PciExpectation {
        PciExpectation { bdf: bdf.into(), ..plan::tests::function(name, kind, backing, &[(1, 64 << 20)]) }
    }

    fn ctx(root: &Path, pci: Vec<PciExpectation>) -> Context {
        crate::context::test_context(root, pci)
    }

    fn verdicts(checks: &[Check]) -> Vec<(&str, &Verdict)> {
        checks.iter().map(|c| (c.name.as_str(), &c.verdict)).collect()
    }

    #[test]
    fn test_skips_without_emulated_devices() {
        let root = tempfile::tempdir().unwrap();
        let no_expect = Context { expect: None, ..ctx(root.path(), vec![]) };
        let skip = |why: &str| Verdict::Skip(why.into());
        assert_eq!(verdicts(&run(&no_expect)), [("emulated_devices", &skip("no expectations: not a gdrvm guest"))]);
        let passthrough = ctx(root.path(), vec![function("gpu0", "gpu", "0000:03:00.0", "vfio:0000:41:00.0")]);
        assert_eq!(
            verdicts(&run(&passthrough)),
            [("emulated_devices", &skip("no PCI function is backed by emulated-gpu or emulated-nic"))]
        );
    }

    #[test]
    fn test_missing_functions_fail_as_not_found() {
        let root = tempfile::tempdir().unwrap();
        let c = ctx(
            root.path(),
            vec![
                function("gpu0", "gpu", "0000:03:00.0", "emulated-gpu"),
                function("nic0", "nic", "0000:04:00.0", "emulated-nic"),
            ],
        );
        let checks = run(&c);
        let names: Vec<&str> = checks.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["gpu0_registers", "nic0_registers", "gdr_matrix", "left_as_found"]);
        assert_eq!(checks[0].verdict, Verdict::Fail("not found: 0000:03:00.0 (gpu0) is not in sysfs".into()));
        assert!(matches!(&checks[2].verdict, Verdict::Skip(_)));
        assert_eq!(checks[3].verdict, Verdict::Pass);
    }

    #[test]
    fn test_a_function_that_does_not_answer_is_left_as_found() {
        let root = tempfile::tempdir().unwrap();
        let dir = pcidev::function_dir(root.path(), "0000:04:00.0");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vendor"), "0x15b3\n").unwrap();
        std::fs::write(dir.join("device"), "0x101b\n").unwrap();
        std::fs::write(dir.join("enable"), "0\n").unwrap();
        std::fs::write(dir.join("config"), [0u8; 64]).unwrap();
        // BAR 0 of zeros: no device behind it.
        std::fs::write(dir.join("resource0"), vec![0u8; 0x2000]).unwrap();
        let nic = PciExpectation {
            vendor: 0x15b3,
            device: 0x101b,
            ..function("nic0", "nic", "0000:04:00.0", "emulated-nic")
        };
        let checks = run(&ctx(root.path(), vec![nic]));
        let Verdict::Fail(why) = &checks[0].verdict else { panic!("{checks:?}") };
        assert!(
            why.starts_with("ident reads 0x00000000, sysfs IDs 15b3:101b make 0x101b15b3; kind reads 0x00000000"),
            "{why}"
        );
        assert!(checks[0].diagnostics.contains(&"enable was 0, Command 0x0000 -> 0x0006".to_owned()), "{checks:?}");
        // Not used, and put back: Command as found, enable 0.
        assert_eq!(checks.len(), 3);
        assert_eq!(std::fs::read(dir.join("config")).unwrap()[4], 0);
        assert_eq!(std::fs::read_to_string(dir.join("enable")).unwrap(), "0");
        // Bound to a driver: not touched.
        std::os::unix::fs::symlink("/sys/bus/pci/drivers/mlx5_core", dir.join("driver")).unwrap();
        let nic = PciExpectation {
            vendor: 0x15b3,
            device: 0x101b,
            ..function("nic0", "nic", "0000:04:00.0", "emulated-nic")
        };
        let checks = run(&ctx(root.path(), vec![nic]));
        assert_eq!(
            checks[0].verdict,
            Verdict::Fail("0000:04:00.0 is bound to mlx5_core; the suite drives unbound functions only".into())
        );
    }

    /// A GPU in a fake sysfs whose `resource0` file holds what the registers read, and whose
    /// aperture (BAR 1, 64 KiB) is a file too.
    fn fake_gpu(root: &Path, bdf: &str) -> PathBuf {
        use gdrvm_model::emulated::{
            GPU_APERTURE_BAR, GPU_APERTURE_SIZE_LO, KIND_GPU, REG_IDENT, REG_KIND, REG_VERSION,
        };
        let dir = pcidev::function_dir(root, bdf);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("vendor"), "0x10de\n").unwrap();
        std::fs::write(dir.join("device"), "0x2330\n").unwrap();
        std::fs::write(dir.join("enable"), "1\n").unwrap();
        let mut config = [0u8; 64];
        config[4] = 0x02;
        std::fs::write(dir.join("config"), config).unwrap();
        let mut bar0 = vec![0u8; 0x2000];
        for (reg, value) in [
            (REG_IDENT, 0x2330_10de),
            (REG_KIND, KIND_GPU),
            (REG_VERSION, 1),
            (GPU_APERTURE_BAR, 1),
            (GPU_APERTURE_SIZE_LO, 0x10000),
        ] {
            let at = (REGS + reg) as usize;
            bar0[at..at + 4].copy_from_slice(&u32::to_le_bytes(value));
        }
        std::fs::write(dir.join("resource0"), bar0).unwrap();
        std::fs::write(dir.join("resource1"), vec![0u8; 0x10000]).unwrap();
        let resource = "0x00000000fd000000 0x00000000fd001fff 0x0000000000040200\n\
                        0x0000004000000000 0x000000400000ffff 0x000000000014220c\n";
        std::fs::write(dir.join("resource"), resource).unwrap();
        dir
    }

    #[test]
    fn test_a_gpu_answering_from_files_opens_and_is_left_as_found() {
        let root = tempfile::tempdir().unwrap();
        let dir = fake_gpu(root.path(), "0000:03:00.0");
        let gpu = PciExpectation {
            bars: vec![
                BarExpectation { index: 0, size: 0x2000, address: 0 },
                BarExpectation { index: 1, size: 0x10000, address: 0 },
            ],
            ..function("gpu0", "gpu", "0000:03:00.0", "emulated-gpu")
        };
        let checks = run(&ctx(root.path(), vec![gpu.clone()]));
        assert_eq!(
            verdicts(&checks),
            [
                ("gpu0_registers", &Verdict::Pass),
                ("gdr_matrix", &Verdict::Skip("needs emulated GPUs and NICs both".into())),
                ("left_as_found", &Verdict::Pass)
            ]
        );
        let notes = &checks[0].diagnostics;
        assert_eq!(notes[0], "gpu0 0000:03:00.0: 10de:2330, backing emulated-gpu, p2p true");
        assert!(notes.contains(&"aperture: BAR 1, 64 KiB".to_owned()), "{notes:?}");
        assert!(notes.contains(&"aperture at bus address 0x4000000000".to_owned()), "{notes:?}");
        assert_eq!(checks[2].diagnostics, ["gpu0: Command 0x0002 -> 0x0002"]);
        assert_eq!(std::fs::read_to_string(dir.join("enable")).unwrap(), "1\n");

        // The expectation names another aperture: the GPU is not used.
        let wrong = PciExpectation { bars: vec![BarExpectation { index: 2, size: 0x10000, address: 0 }], ..gpu };
        let checks = run(&ctx(root.path(), vec![wrong]));
        assert_eq!(
            checks[0].verdict,
            Verdict::Fail(
                "the aperture registers say BAR 1, 65536 bytes; the largest expected BAR is 2, 65536 bytes".into()
            )
        );
    }

    #[test]
    fn test_directions_of_a_nic() {
        let paths = vec![
            PathExpectation { a: "gpu0".into(), b: "nic0".into(), path: PathType::Phb, gdr: Some(false) },
            PathExpectation { a: "gpu1".into(), b: "nic0".into(), path: PathType::Pix, gdr: Some(true) },
        ];
        let gpus = [("gpu0", 256 << 20), ("gpu1", 32 << 20)];
        let (dirs, skips) = directions(&paths, "nic0", &gpus, Some(64 << 20));
        assert!(skips.is_empty());
        let summary: Vec<(&str, &str, End, End, usize)> =
            dirs.iter().map(|d| (d.check.as_str(), d.label.as_str(), d.src, d.dst, d.sizes.len())).collect();
        assert_eq!(
            summary,
            [
                ("nic0_host_to_host", "host->host", End::Host(0), End::Host(32 << 20), 4),
                ("nic0_host_to_gpu1", "host->gpu1", End::Host(0), End::Gpu(1), 4),
                ("nic0_gpu1_to_host", "gpu1->host", End::Gpu(1), End::Host(0), 4),
                ("nic0_gpu1_to_gpu0", "gpu1->gpu0", End::Gpu(1), End::Gpu(0), 4),
            ]
        );
        let (dirs, skips) = directions(&[], "nic0", &gpus[..1], None);
        assert_eq!(dirs.iter().map(|d| d.sizes.len()).collect::<Vec<_>>(), [0, 0, 0]);
        assert_eq!(skips.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["nic0_gpu_to_gpu"]);
        let (dirs, skips) = directions(&[], "nic0", &[], Some(64 << 20));
        assert_eq!((dirs.len(), skips[0].name.as_str()), (1, "nic0_gpu_transfers"));
    }

    #[test]
    fn test_host_buffer_size_follows_available_memory() {
        assert_eq!(host_size(None), 64 << 20);
        assert_eq!(host_size(Some(4 << 30)), 64 << 20);
        assert_eq!(host_size(Some(200 << 20)), 32 << 20);
        assert_eq!(host_size(Some(0)), 1);
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("proc")).unwrap();
        std::fs::write(root.path().join("proc/meminfo"), "MemTotal:  1000 kB\nMemAvailable:    524288 kB\n").unwrap();
        assert_eq!(mem_available(&ctx(root.path(), vec![])), Some(512 << 20));
    }
}
