//! Guest-physical addresses of the PCI tree: each host bridge gets a 32-bit and a 64-bit
//! window, each bridge the windows its subtree needs, each BAR an address inside them.
//! Linux may keep these (it claims what firmware assigned) or reassign them.
//!
//! Non-prefetchable BARs and 32-bit BARs go to the 32-bit window below 4 GiB (a bridge's
//! non-prefetchable window is 32-bit only); prefetchable 64-bit BARs go to the 64-bit
//! window above RAM. Items on one bus are packed largest alignment first.
//!
//! Written by hand: rust-vmm's `vm-allocator` hands out ranges from one flat pool, while a
//! PCI tree needs nested windows, each sized from what sits below it before any is placed.

use super::error::KeyError;
use super::{Bar, FunctionKind, Node};
use crate::layout::{mmio64_base, MMIO32_BASE, MMIO32_END, MMIO64_END};

/// Bridge windows are 1 MiB granular.
const BRIDGE_GRANULE: u64 = 1 << 20;

/// A guest-physical address range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// First address.
    pub base: u64,
    /// Length in bytes.
    pub size: u64,
}

impl Window {
    /// Last address (inclusive), as ACPI and bridge registers write it.
    pub fn last(&self) -> u64 {
        self.base + self.size - 1
    }
}

/// A bridge's forwarding windows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BridgeWindows {
    /// Non-prefetchable memory, below 4 GiB.
    pub mem: Option<Window>,
    /// Prefetchable 64-bit memory.
    pub pref: Option<Window>,
}

/// Which window a BAR lives in.
fn is_pref(bar: &Bar) -> bool {
    bar.prefetchable && bar.is_64bit
}

/// Something to place on a bus: a BAR or a bridge window.
#[derive(Clone, Copy)]
struct Item {
    size: u64,
    align: u64,
    what: Slot,
}

#[derive(Clone, Copy)]
enum Slot {
    Bar { function: usize, bar: usize },
    Window { function: usize },
}

/// Space one bus needs in one kind of window: items packed largest alignment first.
#[derive(Clone, Copy, Default)]
struct Need {
    size: u64,
    align: u64,
}

fn pack(items: &mut [Item]) -> Need {
    items.sort_by_key(|i| std::cmp::Reverse(i.align));
    // Saturating: an absurd node (two 8 EiB BARs) must end as "fits no window", not overflow.
    let mut size = 0u64;
    for i in items.iter() {
        size = size.checked_next_multiple_of(i.align).and_then(|s| s.checked_add(i.size)).unwrap_or(u64::MAX);
    }
    Need { size, align: items.first().map_or(1, |i| i.align) }
}

struct Assigner<'a> {
    node: &'a mut Node,
    /// Per function: (32-bit need, 64-bit need) of what sits below it (bridges only).
    needs: Vec<(Need, Need)>,
}

impl Assigner<'_> {
    fn items(&self, children: &[usize], pref: bool) -> Vec<Item> {
        let mut items = Vec::new();
        for &c in children {
            let f = &self.node.functions[c];
            if f.kind.is_bridge() {
                let need = if pref { self.needs[c].1 } else { self.needs[c].0 };
                if need.size > 0 {
                    let size = need.size.checked_next_multiple_of(BRIDGE_GRANULE).unwrap_or(u64::MAX);
                    items.push(Item {
                        size,
                        align: need.align.max(BRIDGE_GRANULE),
                        what: Slot::Window { function: c },
                    });
                }
            } else {
                for (b, bar) in f.bars.iter().enumerate().filter(|(_, bar)| is_pref(bar) == pref) {
                    items.push(Item { size: bar.size, align: bar.size, what: Slot::Bar { function: c, bar: b } });
                }
            }
        }
        items
    }

    fn children(&self, parent: Option<usize>, host_bridge: usize) -> Vec<usize> {
        (0..self.node.functions.len())
            .filter(|&i| self.node.functions[i].parent == parent && self.node.functions[i].host_bridge == host_bridge)
            .collect()
    }

    /// Places `items` from `base` (already aligned), and recursively what is below bridges.
    fn place(&mut self, items: &mut [Item], base: u64, pref: bool) {
        items.sort_by_key(|i| std::cmp::Reverse(i.align));
        let mut at = base;
        for item in items.iter() {
            at = at.next_multiple_of(item.align);
            match item.what {
                Slot::Bar { function, bar } => self.node.functions[function].bars[bar].address = at,
                Slot::Window { function } => {
                    let window = Some(Window { base: at, size: item.size });
                    let windows = self.node.functions[function].windows.get_or_insert_with(Default::default);
                    if pref {
                        windows.pref = window;
                    } else {
                        windows.mem = window;
                    }
                    let h = self.node.functions[function].host_bridge;
                    let children = self.children(Some(function), h);
                    let mut below = self.items(&children, pref);
                    self.place(&mut below, at, pref);
                }
            }
            at += item.size;
        }
    }
}

/// Gives every host bridge its windows, every bridge its windows and every BAR its
/// address, for a guest with the node's RAM. Fails when a BAR fits no window.
pub(super) fn assign(node: &mut Node) -> Result<(), KeyError> {
    for f in &mut node.functions {
        f.windows = f.kind.is_bridge().then(BridgeWindows::default);
    }
    let memory = node.memory();
    let mut a = Assigner { needs: vec![(Need::default(), Need::default()); node.functions.len()], node };
    // Children follow their parents in `functions`: walk backwards to size bridges bottom-up.
    for i in (0..a.node.functions.len()).rev() {
        if a.node.functions[i].kind.is_bridge() {
            let children = a.children(Some(i), a.node.functions[i].host_bridge);
            let mem = pack(&mut a.items(&children, false));
            let pref = pack(&mut a.items(&children, true));
            a.needs[i] = (mem, pref);
        }
    }
    let mut next32 = MMIO32_BASE;
    let mut next64 = mmio64_base(memory);
    for h in 0..a.node.host_bridges.len() {
        let roots = a.children(None, h);
        for pref in [false, true] {
            let mut items = a.items(&roots, pref);
            let need = pack(&mut items);
            if need.size == 0 {
                continue;
            }
            let (next, end, what) =
                if pref { (&mut next64, MMIO64_END, "64-bit") } else { (&mut next32, MMIO32_END, "32-bit") };
            let base = next.next_multiple_of(need.align.max(BRIDGE_GRANULE));
            let size = need.size.checked_next_multiple_of(BRIDGE_GRANULE).unwrap_or(u64::MAX);
            if base.checked_add(size).is_none_or(|e| e > end) {
                return Err(no_window(a.node, h, pref, size, what, end.saturating_sub(*next)));
            }
            let window = Some(Window { base, size });
            let hb = &mut a.node.host_bridges[h];
            if pref {
                hb.mem64 = window;
            } else {
                hb.mem32 = window;
            }
            a.place(&mut items, base, pref);
            *next = base + size;
        }
    }
    Ok(())
}

/// The error for a host bridge whose BARs do not fit: names the largest BAR below it (or
/// the host bridge, should nothing below it have a BAR of that kind).
fn no_window(node: &Node, h: usize, pref: bool, need: u64, what: &str, left: u64) -> KeyError {
    let hb = &node.host_bridges[h].name;
    let largest = node
        .functions
        .iter()
        .filter(|f| f.host_bridge == h && f.kind != FunctionKind::HostBridge)
        .flat_map(|f| f.bars.iter().enumerate().map(move |(b, bar)| (f, b, bar)))
        .filter(|(_, _, bar)| is_pref(bar) == pref)
        .max_by_key(|(_, _, bar)| bar.size);
    let key = largest.map_or_else(|| format!("host_bridge[{h}] ({hb})"), |(f, b, _)| format!("{}.bars[{b}]", f.key));
    let size = largest.map_or(0, |(_, _, bar)| bar.size);
    KeyError::new(
        key,
        format!(
            "a BAR of {} fits no window: host bridge '{hb}' needs {} of {what} MMIO and only {} is left",
            super::tree::size(size),
            super::tree::size(need),
            super::tree::size(left),
        ),
    )
}
