//! The JSON document gdrvm-gpu prints, one definition for both sides: gdrvm-gpu writes it,
//! and the agent's `gpu` suite includes this file (`#[path]`) to read it. Only serde here,
//! so the static agent never links CUDA.

use serde::{Deserialize, Serialize};

/// Everything gdrvm-gpu found. When `available` is false only `reason` (and whatever was
/// learnt before the failure, such as `nvidia_peermem`) is filled in.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GpuReport {
    /// Whether libcuda loaded, `cuInit` succeeded and at least one device exists.
    pub available: bool,
    /// Why CUDA is not available (no libcuda, `cuInit` failed, no device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `cuDriverGetVersion`, e.g. 12040 for CUDA 12.4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_version: Option<i32>,
    /// Whether bandwidth was measured (false with `--quick`).
    #[serde(default)]
    pub bandwidth_measured: bool,
    /// Every CUDA device, by ordinal.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceReport>,
    /// Every ordered pair of distinct devices.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerReport>,
    /// GPUDirect RDMA readiness.
    #[serde(default)]
    pub gdr: GdrReport,
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct DeviceReport {
    /// CUDA ordinal.
    pub ordinal: i32,
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceGetPCIBusId`, lower case: `0000:3b:00.0`.
    pub bus_id: String,
    /// `cuDeviceTotalMem`, bytes.
    pub total_memory: u64,
    /// Host to device copy bandwidth from pinned memory, GB/s (10^9 bytes per second).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub h2d_gbps: Option<f64>,
    /// Device to host copy bandwidth into pinned memory, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d2h_gbps: Option<f64>,
    /// Why bandwidth could not be measured, when it was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_error: Option<String>,
    /// Whether GPU memory of this device exports as a dma-buf
    /// (`cuMemGetHandleForAddressRange`, `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`).
    #[serde(default)]
    pub dmabuf_export: Outcome,
    /// Registering that dma-buf with [`GdrReport::rdma_device`]; none when not tried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dmabuf_mr: Option<Outcome>,
}

/// What one ordered pair of devices can do.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct PeerReport {
    /// Ordinal of the device whose context accesses (and the copy source).
    pub a: i32,
    /// Ordinal of the peer (the copy destination).
    pub b: i32,
    /// `cuDeviceCanAccessPeer(a, b)`.
    pub can_access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`: true over NVLink, false over PCIe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub native_atomics: Option<bool>,
    /// `cuMemcpyPeer` bandwidth from `a` to `b` with peer access enabled, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_gbps: Option<f64>,
    /// Why the peer copy failed, when it was tried.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_error: Option<String>,
}

/// A step that worked or failed with the CUDA error.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Outcome {
    /// Whether it worked.
    pub ok: bool,
    /// The error (`CUDA_ERROR_NOT_SUPPORTED: operation not supported`), when it did not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// GPUDirect RDMA readiness of the machine.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct GdrReport {
    /// `nvidia_peermem` is listed in /proc/modules.
    pub nvidia_peermem: bool,
    /// The RDMA device exported GPU memory was registered with (`ibv_reg_dmabuf_mr`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_device: Option<String>,
    /// Whether every GPU's exported memory registered with it; null when not tried.
    #[serde(default)]
    pub dmabuf_mr: Option<bool>,
    /// Why `dmabuf_mr` is null, or the first registration's failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dmabuf_mr_reason: Option<String>,
}

/// A PCI bus ID as sysfs names the function: lower case, a four-digit domain
/// (`00000000:3B:00.0` from NVML-style spellings becomes `0000:3b:00.0`).
pub fn normalize_bus_id(id: &str) -> String {
    let id = id.trim().to_ascii_lowercase();
    match id.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => match u32::from_str_radix(domain, 16) {
            Ok(d) if d <= 0xffff => format!("{d:04x}:{rest}"),
            _ => id,
        },
        _ => id,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_unavailable_is_minimal_and_round_trips() {
        let r = GpuReport { reason: Some("libcuda.so not found".into()), ..GpuReport::default() };
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            json,
            r#"{"available":false,"reason":"libcuda.so not found","bandwidth_measured":false,"gdr":{"nvidia_peermem":false,"dmabuf_mr":null}}"#
        );
        assert_eq!(serde_json::from_str::<GpuReport>(&json).unwrap(), r);
        let bare: GpuReport = serde_json::from_str(r#"{"available": false, "reason": "no device"}"#).unwrap();
        assert_eq!(bare.reason.as_deref(), Some("no device"));
    }

    #[test]
    fn test_bus_ids_as_sysfs_names_them() {
        assert_eq!(normalize_bus_id("0000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("00000000:3B:00.0\n"), "0000:3b:00.0");
        assert_eq!(normalize_bus_id("0001:c1:00.0"), "0001:c1:00.0");
        assert_eq!(normalize_bus_id("garbage"), "garbage");
    }
}
