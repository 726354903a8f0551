use gdrvm_devices::pci_regs::*;
use gdrvm_model::layout::ECAM_SIZE;
use gdrvm_model::node::{FunctionKind, Node};

use super::*;

fn minimal() -> Node {
    Node::preset("minimal").unwrap().unwrap()
}

fn segment() -> Arc<PciSegment> {
    Arc::new(PciSegment::new(&minimal()))
}

/// ECAM offset of bus/device/function/register.
fn ecam(bus: u8, dev: u8, func: u8, reg: usize) -> u64 {
    (u64::from(bus) << 20) | (u64::from(dev) << 15) | (u64::from(func) << 12) | reg as u64
}

fn read32(e: &mut Ecam, off: u64) -> u32 {
    let mut b = [0u8; 4];
    e.read(off, &mut b);
    u32::from_le_bytes(b)
}

fn read16(e: &mut Ecam, off: u64) -> u16 {
    let mut b = [0u8; 2];
    e.read(off, &mut b);
    u16::from_le_bytes(b)
}

#[test]
fn test_ecam_ids_and_absent_functions() {
    let mut e = Ecam(segment());
    // 00:00.0 host bridge function, 00:01.0 root port, 03:00.0 the GPU.
    assert_eq!(read32(&mut e, ecam(0, 0, 0, 0)), 0x0008_1b36);
    assert_eq!(read32(&mut e, ecam(0, 1, 0, 0)), 0x000c_1b36);
    assert_eq!(read32(&mut e, ecam(3, 0, 0, 0)), 0x20b2_10de);
    assert_eq!(read32(&mut e, ecam(3, 0, 0, 0x08)) >> 8, 0x03_02_00);
    assert_eq!(read32(&mut e, ecam(3, 0, 0, 0x2c)), 0x147f_10de);
    // Nothing at 00:02.0 or 03:00.1: all-ones, writes dropped.
    assert_eq!(read32(&mut e, ecam(0, 2, 0, 0)), u32::MAX);
    e.write(ecam(0, 2, 0, 0x04), &[0xff; 4]);
    assert_eq!(read32(&mut e, ecam(3, 0, 1, 0)), u32::MAX);
    // An access straddling the end of a function's space reads all-ones.
    let mut b = [0u8; 4];
    e.read(ecam(3, 0, 0, 0xffe), &mut b);
    assert_eq!(b, [0xff; 4]);
}

#[test]
fn test_bar_sizing_and_relocation() {
    let mut e = Ecam(segment());
    let gpu = |reg| ecam(3, 0, 0, reg);
    // BAR0: 16 MiB, 32-bit, non-prefetchable.
    let bar0 = read32(&mut e, gpu(0x10));
    assert_eq!(bar0 & 0xf, 0);
    e.write(gpu(0x10), &u32::MAX.to_le_bytes());
    assert_eq!(read32(&mut e, gpu(0x10)), 0xff00_0000);
    e.write(gpu(0x10), &bar0.to_le_bytes());
    assert_eq!(read32(&mut e, gpu(0x10)), bar0);
    // BAR1/2: 128 GiB, 64-bit prefetchable: the low dword sizes to 0, the high to ~(128G-1)>>32.
    assert_eq!(read32(&mut e, gpu(0x14)) & 0xf, 0xc);
    e.write(gpu(0x14), &u32::MAX.to_le_bytes());
    e.write(gpu(0x18), &u32::MAX.to_le_bytes());
    assert_eq!(read32(&mut e, gpu(0x14)), 0x0000_000c);
    assert_eq!(read32(&mut e, gpu(0x18)), 0xffff_ffe0);
    // Linux moving the BAR: the new address reads back.
    e.write(gpu(0x14), &0u32.to_le_bytes());
    e.write(gpu(0x18), &0x40u32.to_le_bytes());
    assert_eq!((read32(&mut e, gpu(0x14)), read32(&mut e, gpu(0x18))), (0xc, 0x40));
    // Read-only fields stay: vendor ID, class.
    e.write(gpu(0x00), &[0; 4]);
    assert_eq!(read32(&mut e, gpu(0)), 0x20b2_10de);
}

#[test]
fn test_bridge_buses_and_windows() {
    let node = minimal();
    let mut e = Ecam(Arc::new(PciSegment::new(&node)));
    let rp = |reg| ecam(0, 1, 0, reg);
    assert_eq!(read32(&mut e, rp(0x0c)) >> 16 & 0x7f, 1, "type 1 header");
    assert_eq!(read32(&mut e, rp(0x18)) & 0xff_ffff, 0x04_01_00, "primary 0, secondary 1, subordinate 4");
    let f = node.functions.iter().find(|f| f.name == "rp0").unwrap();
    let w = f.windows.unwrap();
    let mem = read32(&mut e, rp(0x20));
    assert_eq!(u64::from(mem & 0xfff0) << 16, w.mem.unwrap().base);
    assert_eq!((u64::from(mem >> 16) << 16) | 0xf_ffff, w.mem.unwrap().last());
    let pref = read32(&mut e, rp(0x24));
    assert_eq!(pref & 0xf, 1, "64-bit prefetchable window");
    let base = (u64::from(read32(&mut e, rp(0x28))) << 32) | (u64::from(pref & 0xfff0) << 16);
    assert_eq!(base, w.pref.unwrap().base);
    // No I/O window: base and limit read 0 and ignore writes.
    e.write(rp(0x1c), &[0xf0, 0xf0]);
    assert_eq!(read16(&mut e, rp(0x1c)), 0);
    // The empty downstream port's windows are closed (base above limit).
    let down1 = node.functions.iter().position(|f| f.name == "sw0.down1").unwrap();
    assert_eq!(node.functions[down1].kind, FunctionKind::SwitchDownstream);
    let mem = read32(&mut e, ecam(2, 1, 0, 0x20));
    assert!(mem & 0xfff0 > mem >> 16, "closed memory window: {mem:#x}");
}

#[test]
fn test_a_closed_prefetchable_window_reads_closed_to_linux() {
    // vela-a100's empty switch ports have nothing prefetchable below them. Linux ignores
    // the upper halves when the base's is above the limit's, so the window must be closed
    // in the low halves, with the upper halves equal.
    let node = Node::preset("vela-a100").unwrap().unwrap();
    let mut e = Ecam(Arc::new(PciSegment::new(&node)));
    let empty = node.functions.iter().find(|f| f.windows.is_some_and(|w| w.pref.is_none())).unwrap();
    let at = |reg| ecam(empty.bdf.bus, empty.bdf.device, empty.bdf.function, reg);
    let pref = read32(&mut e, at(0x24));
    let (base_hi, limit_hi) = (read32(&mut e, at(0x28)), read32(&mut e, at(0x2c)));
    assert_eq!((pref & 0xf, base_hi, limit_hi), (1, 0, 0), "64-bit, upper halves 0: {pref:#x}");
    assert!(pref & 0xfff0 > pref >> 16 & 0xfff0, "closed prefetchable window: {pref:#x}");
}

/// (capability id, offset) pairs of the standard list, then of the extended list.
type CapabilityLists = (Vec<(u8, usize)>, Vec<(u16, usize)>);

/// Follows the capability list and the extended list.
fn capabilities(e: &mut Ecam, bus: u8, dev: u8) -> CapabilityLists {
    let mut caps = Vec::new();
    let mut at = (read32(e, ecam(bus, dev, 0, PCI_CAPABILITY_LIST)) & 0xfc) as usize;
    while at != 0 {
        let h = read32(e, ecam(bus, dev, 0, at));
        caps.push((h as u8, at));
        at = ((h >> 8) & 0xfc) as usize;
    }
    let mut ext = Vec::new();
    let mut at = PCI_CFG_SPACE_SIZE;
    while at != 0 {
        let h = read32(e, ecam(bus, dev, 0, at));
        if h == 0 {
            break;
        }
        ext.push((h as u16, at));
        at = (h >> 20) as usize;
    }
    (caps, ext)
}

/// Where capability `id` of bus:dev.0 is, found as the guest finds it.
fn find_capability(e: &mut Ecam, bus: u8, dev: u8, id: u8) -> usize {
    let (caps, _) = capabilities(e, bus, dev);
    caps.iter().find(|(c, _)| *c == id).map(|(_, at)| *at).expect("capability present")
}

/// Where extended capability `id` of bus:dev.0 is.
fn find_ext_capability(e: &mut Ecam, bus: u8, dev: u8, id: u16) -> usize {
    let (_, ext) = capabilities(e, bus, dev);
    ext.iter().find(|(c, _)| *c == id).map(|(_, at)| *at).expect("extended capability present")
}

#[test]
fn test_capabilities_tell_port_type_link_acs_ats() {
    let mut e = Ecam(segment());
    // Switch downstream port 02:00.0: PCIe (type 6), ACS.
    let (caps, ext) = capabilities(&mut e, 2, 0);
    assert_eq!(caps, [(0x10, 0x40)]);
    assert_eq!(ext, [(0x000d, 0x100)]);
    let (exp, acs) = (caps[0].1, ext[0].1);
    assert_eq!(read16(&mut e, ecam(2, 0, 0, exp + PCI_EXP_FLAGS)) >> 4 & 0xf, 6);
    assert_eq!(read16(&mut e, ecam(2, 0, 0, acs + PCI_ACS_CAP)), ACS_CAPABILITIES);
    // Link capabilities: 16 GT/s (4), x16; link status the same, link active.
    let lnkcap = read32(&mut e, ecam(2, 0, 0, exp + PCI_EXP_LNKCAP));
    assert_eq!((lnkcap & 0xf, lnkcap >> 4 & 0x3f), (4, 16));
    let lnksta = read16(&mut e, ecam(2, 0, 0, exp + PCI_EXP_LNKSTA));
    assert_eq!((lnksta & 0xf, lnksta >> 4 & 0x3f, lnksta >> 13 & 1), (4, 16, 1));
    assert_eq!(read32(&mut e, ecam(2, 0, 0, exp + PCI_EXP_LNKCAP2)), 0b11110, "link capabilities 2: 2.5 to 16 GT/s");
    // Root port: type 4. Upstream port: type 5, no ACS.
    let exp = find_capability(&mut e, 0, 1, PCI_CAP_ID_EXP);
    assert_eq!(read16(&mut e, ecam(0, 1, 0, exp + PCI_EXP_FLAGS)) >> 4 & 0xf, 4);
    let exp = find_capability(&mut e, 1, 0, PCI_CAP_ID_EXP);
    assert_eq!(read16(&mut e, ecam(1, 0, 0, exp + PCI_EXP_FLAGS)) >> 4 & 0xf, 5);
    assert_eq!(capabilities(&mut e, 1, 0).1, []);
    // The GPU: endpoint, MSI-X in BAR0, ATS.
    let (caps, ext) = capabilities(&mut e, 3, 0);
    assert_eq!(caps, [(0x10, 0x40), (0x11, 0x80)]);
    assert_eq!(ext, [(0x000f, 0x100)]);
    let msix = caps[1].1;
    assert_eq!(read16(&mut e, ecam(3, 0, 0, msix + PCI_MSIX_FLAGS)) & 0x7ff, 15, "16 vectors");
    assert_eq!(read32(&mut e, ecam(3, 0, 0, msix + PCI_MSIX_TABLE)), 0, "table in BAR0 at 0");
    // The host bridge function has no capabilities.
    assert_eq!(capabilities(&mut e, 0, 0), (vec![], vec![]));
}

/// Every function's configuration space as ECAM reads it, dword by dword.
fn read_all(e: &mut Ecam, node: &Node, i: usize) -> Vec<u8> {
    let bdf = node.functions[i].bdf;
    (0..CONFIG_SPACE_SIZE / 4)
        .flat_map(|n| read32(e, ecam(bdf.bus, bdf.device, bdf.function, n * 4)).to_le_bytes())
        .collect()
}

#[test]
fn test_images_are_what_ecam_reads_after_any_writes() {
    let node = minimal();
    let pci = segment();
    let mut e = Ecam(pci.clone());
    // Nothing stands behind any function here: every one is imaged, in its own page.
    let pages = pci.images().pages();
    assert_eq!(pages.len(), node.functions.len());
    for (i, f) in node.functions.iter().enumerate() {
        let offset = (u64::from(f.bdf.bus) << 20) | (u64::from(f.bdf.device) << 15) | (u64::from(f.bdf.function) << 12);
        assert!(pages.iter().any(|p| p.ecam_offset == offset), "{} not imaged", f.key);
        assert_eq!(
            pci.images().contents(i, 0..CONFIG_SPACE_SIZE).unwrap(),
            read_all(&mut e, &node, i),
            "{} before any write",
            f.key
        );
    }
    // BAR sizing, bus numbers, windows, command, and garbage everywhere.
    let gpu = |reg| ecam(3, 0, 0, reg);
    e.write(gpu(0x10), &u32::MAX.to_le_bytes());
    e.write(ecam(0, 1, 0, 0x18), &0x00ff_0100u32.to_le_bytes());
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..20_000 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let f = &node.functions[(x >> 33) as usize % node.functions.len()];
        let reg = (x >> 40) as usize % CONFIG_SPACE_SIZE;
        let len = [1, 2, 4, 8][(x >> 60) as usize % 4];
        e.write(ecam(f.bdf.bus, f.bdf.device, f.bdf.function, reg), &x.to_le_bytes()[..len]);
    }
    for (i, f) in node.functions.iter().enumerate() {
        assert_eq!(
            pci.images().contents(i, 0..CONFIG_SPACE_SIZE).unwrap(),
            read_all(&mut e, &node, i),
            "{} after writes",
            f.key
        );
    }
}

#[test]
fn test_guest_garbage_never_panics() {
    // A guest may write anything anywhere; a cheap LCG sweeps offsets, sizes and values.
    let mut e = Ecam(segment());
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for _ in 0..200_000 {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let off = (x >> 8) % ECAM_SIZE;
        let len = [1, 2, 4, 8, 3, 16][(x >> 60) as usize % 6];
        let data = x.to_le_bytes().repeat(2);
        if x & 1 == 0 {
            e.write(off, &data[..len]);
        } else {
            let mut buf = vec![0u8; len];
            e.read(off, &mut buf);
        }
    }
    // IDs survive.
    assert_eq!(read32(&mut e, ecam(3, 0, 0, 0)), 0x20b2_10de);
}

#[test]
fn test_acs_control_as_the_node_sets_it() {
    let vela = Node::preset("vela-a100").unwrap().unwrap();
    let mut e = Ecam(Arc::new(PciSegment::new(&vela)));
    // sw0.down0 at 02:00.0: request and completion redirect, upstream forwarding.
    let ctrl = find_ext_capability(&mut e, 2, 0, PCI_EXT_CAP_ID_ACS) + PCI_ACS_CTRL;
    assert_eq!(read16(&mut e, ecam(2, 0, 0, ctrl)), 0x001c);
    // Writable within the offered controls, the rest stays 0.
    e.write(ecam(2, 0, 0, ctrl), &0xffffu16.to_le_bytes());
    assert_eq!(read16(&mut e, ecam(2, 0, 0, ctrl)), ACS_CAPABILITIES);
    // rp0 at 00:01.0 has ACS with nothing enabled.
    let ctrl = find_ext_capability(&mut e, 0, 1, PCI_EXT_CAP_ID_ACS) + PCI_ACS_CTRL;
    assert_eq!(read16(&mut e, ecam(0, 1, 0, ctrl)), 0);
}

#[test]
fn test_absent_ranges_cover_the_empty_slots_a_full_scan_reads_and_nothing_present() {
    for (preset, want_slots) in [("minimal", 2), ("vela-a100", 9)] {
        let node = Node::preset(preset).unwrap().unwrap();
        let pci = PciSegment::new(&node);
        let ranges = pci.absent_ranges();
        let page_of = |f: &gdrvm_model::node::Function| ecam(f.bdf.bus, f.bdf.device, f.bdf.function, 0);
        // Buses a guest scans in full: the host bridges' and the switches' internal ones.
        let mut full: Vec<u8> = node.host_bridges.iter().map(|h| h.first_bus).collect();
        full.extend(
            node.functions
                .iter()
                .filter(|f| f.kind == FunctionKind::SwitchUpstream)
                .filter_map(|f| f.buses)
                .map(|b| b.0),
        );
        for r in ranges {
            assert!(r.start < r.end && r.start % 4096 == 0 && r.end % 4096 == 0, "{preset}: {r:x?}");
            assert_eq!(r.start >> 20, (r.end - 1) >> 20, "{preset}: {r:x?} crosses a bus");
            assert!(full.contains(&((r.start >> 20) as u8)), "{preset}: {r:x?} is not on a fully scanned bus");
            assert!(r.end <= ECAM_SIZE);
            assert!(node.functions.iter().all(|f| !r.contains(&page_of(f))), "{preset}: {r:x?} covers a function");
        }
        assert_eq!(ranges.len(), want_slots, "{preset}: {ranges:x?}");
        // The reads Linux makes there, function 0 of each empty device slot: the covered
        // ones are all but those in short runs (a run must save MIN_ABSENT_SLOTS reads).
        let empty_slots: Vec<u64> = full
            .iter()
            .flat_map(|&bus| (0..32u8).map(move |dev| ecam(bus, dev, 0, 0)))
            .filter(|&at| node.functions.iter().all(|f| page_of(f) >> 15 != at >> 15))
            .collect();
        let covered = empty_slots.iter().filter(|at| ranges.iter().any(|r| r.contains(at))).count();
        // Runs of consecutive empty slots on a bus; those long enough are covered whole.
        let mut runs = vec![0usize];
        for pair in empty_slots.windows(2) {
            if pair[1] == pair[0] + (1 << 15) && pair[1] >> 20 == pair[0] >> 20 {
                *runs.last_mut().unwrap() += 1;
            } else {
                runs.push(0);
            }
        }
        let long: usize = runs.iter().map(|n| n + 1).filter(|&n| n >= MIN_ABSENT_SLOTS).sum();
        assert_eq!(covered, long, "{preset}: {} empty slots", empty_slots.len());
        // The enumeration's first absent read on minimal: 00:02.0, on its root bus.
        assert!(preset != "minimal" || ranges.iter().any(|r| r.contains(&ecam(0, 2, 0, 0))));
    }
}
