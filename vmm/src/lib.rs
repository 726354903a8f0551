//! gdrvm: a minimal VMM on the rust-vmm crates that boots a Linux guest straight from its
//! kernel, with the firmware tables and devices a GPU training node's guest needs.

pub mod acpi;
pub mod bios;
pub mod boot;
pub mod cluster;
pub mod config;
mod console;
pub mod cpu_topology;
pub mod host_numa;
pub mod initrd;
pub mod irq;
pub mod machine;
pub mod memory;
pub mod mptable;
pub mod pci;
pub mod prefault;
pub mod signals;
pub mod stats;
pub mod vcpu;
pub mod wiring;

pub use config::{parse_size, ConfigError, VmConfig};
pub use machine::{run, ConsoleOptions, Outcome, RunReport, VmmError};
