//! ECAM access dispatch: one guest config read or write from the MMIO bus down to the
//! function's config space (what a vCPU thread does after a KVM MMIO exit; the exit itself
//! is excluded). Run with `cargo xtask bench ecam`.

use std::hint::black_box;
use std::sync::{Arc, Mutex};

use criterion::{criterion_group, criterion_main, Criterion};
use gdrvm::pci::{Ecam, PciSegment};
use gdrvm_devices::{lock, Bus};
use gdrvm_model::layout::{ECAM_BASE, ECAM_SIZE};
use gdrvm_model::node::Node;

fn ecam_dispatch(c: &mut Criterion) {
    let node = Node::preset("vela-a100").and_then(Result::ok).expect("the vela-a100 preset is valid");
    let segment = Arc::new(PciSegment::new(&node));
    let bus = Bus::new("mmio");
    bus.insert(Arc::new(Mutex::new(Ecam(segment))), ECAM_BASE, ECAM_SIZE).expect("ECAM fits an empty bus");
    // gpu7 at 19:00.0: its link status register, and its BAR1 (sizing writes).
    let gpu = ECAM_BASE + (0x19 << 20);
    c.bench_function("ecam_read32", |b| {
        let mut data = [0u8; 4];
        b.iter(|| bus.read(black_box(gpu + 0x50), &mut data));
    });
    c.bench_function("ecam_write32", |b| {
        b.iter(|| bus.write(black_box(gpu + 0x14), &u32::MAX.to_le_bytes()));
    });
    // Reference in the same process: an uncontended lock and a 4-byte copy, the floor of
    // any dispatch that takes a device lock.
    let reference = Mutex::new([0u8; 4096]);
    c.bench_function("reference_lock_copy4", |b| {
        let mut data = [0u8; 4];
        b.iter(|| {
            let g = lock(&reference);
            data.copy_from_slice(&g[black_box(0x50)..0x54]);
        });
    });
    c.bench_function("ecam_read_absent_function", |b| {
        let mut data = [0u8; 4];
        b.iter(|| bus.read(black_box(ECAM_BASE + (0x19 << 20) + (5 << 15)), &mut data));
    });
}

criterion_group!(benches, ecam_dispatch);
criterion_main!(benches);
