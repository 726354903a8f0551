//! `reg-dmabuf`: registering a dma-buf with an RDMA device, as NCCL does with GPU memory
//! when `nvidia_peermem` is not loaded. The exporter (gdrvm-gpu, which holds the CUDA
//! allocation) passes the fd down to this process, so libibverbs stays in this one binary.

use crate::ib::Context;
use crate::report::TestResult;

/// The result's name.
pub const TEST: &str = "reg_dmabuf";

/// Registers `length` bytes of dma-buf `fd` with device `device` (and deregisters them).
pub fn register(device: &str, fd: i32, length: usize) -> TestResult {
    let mut diag = vec![format!("device {device}, dma-buf fd {fd}, {length} bytes")];
    let outcome = Context::open(device).and_then(|ctx| {
        let pd = ctx.alloc_pd()?;
        pd.register_dmabuf(fd, length)
    });
    match outcome {
        Ok(keys) => {
            diag.push(format!("registered: lkey {:#x}, rkey {:#x}", keys.lkey, keys.rkey));
            TestResult::pass(TEST, diag)
        }
        Err(e) => TestResult::fail(TEST, diag, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_device_that_is_not_there_fails_with_the_reason() {
        // This host has no RDMA device by that name (nor, usually, any): the result names
        // the device and says why, as the last line.
        let r = register("gdrvm_no_such_device", 0, 4096);
        assert_eq!(r.test, TEST);
        assert!(!r.ok, "{r:?}");
        assert_eq!(r.diag[0], "device gdrvm_no_such_device, dma-buf fd 0, 4096 bytes");
        let reason = r.diag.last().unwrap();
        assert!(reason.contains("gdrvm_no_such_device") || reason.contains("ibv_get_device_list"), "{reason}");
    }
}
