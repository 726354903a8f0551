//! Virtio devices in the VMM: the NIC stand-in for CI ([`VirtioNet`], virtio-net over the
//! modern PCI transport), placed where a RoCE VF sits so the guest's soft-RoCE runs on it.
//!
//! [`transport`] is the virtio 1.x PCI transport (capabilities, common configuration,
//! feature negotiation, ISR, doorbells, interrupts); [`net`] the device on top of it, with
//! a worker thread per device moving frames between its queues (rust-vmm's
//! `virtio-queue` over `vm-memory`) and a [`crate::net::FramePort`]; [`offload`] what its
//! offloads mean at each end of a wire, with [`csum`] the Internet checksum and [`gso`]
//! the TCP segmentation behind them.
//!
//! The doorbells are [`crate::IoEvent`]s the VMM registers with KVM; interrupts go out
//! through the MSI-X eventfds the VMM connects ([`crate::PciDevice::connect_msix`]), the
//! table itself emulated by the VMM.

pub mod csum;
pub mod gso;
pub mod net;
pub mod offload;
pub mod transport;

pub use net::{NetStats, VirtioError, VirtioNet, MAX_FRAME, NET_HDR_LEN, RX_QUEUE, TX_QUEUE};
