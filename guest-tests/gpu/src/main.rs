//! `gdrvm-gpu`: the CUDA half of the agent's `gpu` suite, apart from the static agent
//! because it loads libcuda with dlopen (through cudarc). It prints one JSON document on
//! stdout ([`report::GpuReport`]): `{"available": false, "reason": ..}` when libcuda cannot
//! be loaded, `cuInit` fails or there is no device; otherwise every device's name, PCI bus
//! ID, memory and pinned host copy bandwidth, the peer-access matrix with peer copy
//! bandwidth, and GPUDirect RDMA readiness (`nvidia_peermem`, dma-buf export, and that
//! dma-buf registered with an RDMA device through `gdrvm-verbs reg-dmabuf`).
//! Exit status 0 whenever the document was printed.

mod cuda;
mod rdma;
mod report;

use std::process::ExitCode;

use clap::Parser;

use crate::cuda::{Device, Driver};
use crate::rdma::Registrar;
use crate::report::{DeviceReport, GdrReport, GpuReport, Outcome, PeerReport};

/// Bytes per timed copy.
const COPY_BYTES: usize = 64 << 20;
/// Timed copies per measurement (after one untimed).
const COPIES: u32 = 4;

#[derive(Parser)]
#[command(
    name = "gdrvm-gpu",
    version,
    about = "CUDA devices, bandwidth, peer access and GPUDirect RDMA readiness (JSON)"
)]
struct Cli {
    /// Skip the bandwidth measurements (host and peer copies).
    #[arg(long)]
    quick: bool,
    /// RDMA device to register exported GPU memory with (ibv_reg_dmabuf_mr); default the
    /// first in /sys/class/infiniband.
    #[arg(long, value_name = "NAME")]
    rdma_dev: Option<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let modules = std::fs::read_to_string("/proc/modules").unwrap_or_default();
    let registrar = Registrar::on_this_machine(cli.rdma_dev.as_deref());
    let mut gdr = GdrReport {
        nvidia_peermem: peermem_loaded(&modules),
        rdma_device: registrar.as_ref().ok().map(|r| r.device.clone()),
        dmabuf_mr: None,
        dmabuf_mr_reason: registrar.as_ref().err().cloned(),
    };
    let report = match Driver::load() {
        Err(reason) => unavailable(reason, std::mem::take(&mut gdr)),
        Ok(driver) => probe(&driver, !cli.quick, registrar.ok().as_ref(), gdr),
    };
    match serde_json::to_string(&report) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gdrvm-gpu: cannot write the report: {e}");
            ExitCode::FAILURE
        }
    }
}

fn unavailable(reason: String, gdr: GdrReport) -> GpuReport {
    GpuReport { available: false, reason: Some(reason), gdr, ..GpuReport::default() }
}

/// Whether `/proc/modules` text lists `nvidia_peermem`.
fn peermem_loaded(modules: &str) -> bool {
    modules.lines().any(|l| l.split_whitespace().next() == Some("nvidia_peermem"))
}

/// Everything about every device.
fn probe(driver: &Driver, bandwidth: bool, registrar: Option<&Registrar>, mut gdr: GdrReport) -> GpuReport {
    let count = match driver.count() {
        Ok(0) => return unavailable("CUDA sees no device".into(), gdr),
        Ok(n) => n,
        Err(e) => return unavailable(e.to_string(), gdr),
    };
    let mut devices = Vec::new();
    let mut reports = Vec::new();
    for ordinal in 0..count {
        match driver.device(ordinal).and_then(|d| describe(driver, &d, bandwidth, registrar).map(|r| (d, r))) {
            Ok((d, r)) => {
                devices.push(d);
                reports.push(r);
            }
            Err(e) => return unavailable(format!("device {ordinal}: {e}"), gdr),
        }
    }
    if registrar.is_some() {
        let tried: Vec<&Outcome> = reports.iter().filter_map(|r| r.dmabuf_mr.as_ref()).collect();
        gdr.dmabuf_mr = (!tried.is_empty()).then(|| tried.iter().all(|o| o.ok));
        gdr.dmabuf_mr_reason = match tried.iter().find(|o| !o.ok) {
            Some(o) => o.error.clone(),
            None if tried.is_empty() => Some("not tried: no GPU memory exported as a dma-buf".into()),
            None => None,
        };
    }
    let mut peers = Vec::new();
    for a in &devices {
        for b in devices.iter().filter(|b| b.ordinal != a.ordinal) {
            peers.push(peer(driver, a, b, bandwidth));
        }
    }
    GpuReport {
        available: true,
        reason: None,
        driver_version: driver.version().ok(),
        bandwidth_measured: bandwidth,
        devices: reports,
        peers,
        gdr,
    }
}

fn describe(
    driver: &Driver,
    d: &Device,
    bandwidth: bool,
    registrar: Option<&Registrar>,
) -> Result<DeviceReport, cuda::CudaError> {
    // The exported dma-buf, registered with the RDMA device while it is alive.
    let (dmabuf_export, dmabuf_mr) = match d.dmabuf_export(driver, |fd, len| registrar.map(|r| r.register(fd, len))) {
        Ok(mr) => (Outcome { ok: true, error: None }, mr),
        Err(e) => (Outcome { ok: false, error: Some(e) }, None),
    };
    let mut r = DeviceReport {
        ordinal: d.ordinal,
        name: d.name()?,
        bus_id: d.bus_id()?,
        total_memory: d.total_memory()?,
        dmabuf_export,
        dmabuf_mr,
        ..DeviceReport::default()
    };
    if bandwidth {
        match d.host_bandwidth(COPY_BYTES, COPIES) {
            Ok((h2d, d2h)) => (r.h2d_gbps, r.d2h_gbps) = (Some(h2d), Some(d2h)),
            Err(e) => r.bandwidth_error = Some(e.to_string()),
        }
    }
    Ok(r)
}

fn peer(driver: &Driver, a: &Device, b: &Device, bandwidth: bool) -> PeerReport {
    let mut r = PeerReport { a: a.ordinal, b: b.ordinal, ..PeerReport::default() };
    match driver.peer(a, b) {
        Ok((can, atomics)) => (r.can_access, r.native_atomics) = (can, atomics),
        Err(e) => r.copy_error = Some(e.to_string()),
    }
    if bandwidth && r.can_access {
        match a.peer_bandwidth(b, COPY_BYTES, COPIES) {
            Ok(g) => r.copy_gbps = Some(g),
            Err(e) => r.copy_error = Some(e.to_string()),
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_peermem_from_proc_modules() {
        let text = "nvidia_uvm 1 0 - Live 0x0\nnvidia_peermem 16384 0 - Live 0x0 (OE)\nnvidia 1 2 - Live 0x0\n";
        assert!(peermem_loaded(text));
        assert!(!peermem_loaded("nvidia_peermemx 1 0 - Live 0x0\nib_core 1 0 - Live 0x0\n"));
        assert!(!peermem_loaded(""));
    }

    #[test]
    fn test_without_libcuda_the_report_says_why() {
        // This machine has no NVIDIA driver; on one that has, the load succeeds instead.
        if let Err(reason) = Driver::load() {
            let r = unavailable(reason.clone(), GdrReport::default());
            assert!(!r.available);
            assert_eq!(r.reason, Some(reason));
            assert!(r.devices.is_empty());
        }
    }
}
