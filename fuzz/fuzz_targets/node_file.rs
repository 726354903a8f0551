//! Node files: any bytes through the TOML parser, the checker, scaling, address assignment
//! and every export. A bad file must be an error, never a panic or a hang.
#![no_main]

use gdrvm_model::node::Node;
use gdrvm_model::Expectations;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(node) = Node::parse("fuzz.toml", text) else {
        return;
    };
    // The last bytes pick a scaling, as users do with --cpus/--memory.
    let cpus = data.last().map(|b| u32::from(*b % 8) + 1);
    let memory = data.first().map(|b| (u64::from(*b % 16) + 1) << 28);
    for n in [Some(node.clone()), node.scaled(cpus, memory).ok()].into_iter().flatten() {
        let _ = n.render_tree();
        let _ = n.nccl_topology_xml();
        let _ = n.qemu_args();
        let _ = Expectations::new(n.cpus(), n.memory(), &n).to_json();
        assert!(n.highest_mmio() < gdrvm_model::layout::MMIO64_END);
    }
});
