//! Fault injection for the emulators (`--fault KIND@N`): after the guest's `N`th write to
//! the register BAR the device dies (`exit`: the process kills itself with SIGKILL, as an
//! OOM kill or a crash would), answers every request with an error (`error`), or stops
//! answering while keeping its socket open (`hang`). This is how the end-to-end tests check
//! that a device dying under a running suite fails the suite, not the VMM.

use std::io;
use std::str::FromStr;

use crate::vfio_user::{ServerRegion, UserDevice};

/// What happens when the fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The process dies with SIGKILL.
    Exit,
    /// Every region access fails (the client gets an error reply).
    Error,
    /// Region accesses never return.
    Hang,
}

/// A fault: its kind and the register-BAR write it strikes at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// What happens.
    pub kind: FaultKind,
    /// The guest's register-BAR write (counting from 1) that triggers it.
    pub after_writes: u64,
}

impl FromStr for Fault {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let usage = || format!("'{s}' is not a fault: KIND@N with KIND exit, error or hang and N a write count");
        let (kind, n) = s.split_once('@').ok_or_else(usage)?;
        let kind = match kind {
            "exit" => FaultKind::Exit,
            "error" => FaultKind::Error,
            "hang" => FaultKind::Hang,
            _ => return Err(usage()),
        };
        let after_writes = n.parse().ok().filter(|n| *n > 0).ok_or_else(usage)?;
        Ok(Fault { kind, after_writes })
    }
}

/// A device with a fault armed.
pub struct Faulty {
    device: Box<dyn UserDevice>,
    fault: Fault,
    writes: u64,
    struck: bool,
}

impl Faulty {
    /// `device`, failing as `fault` says.
    pub fn new(device: Box<dyn UserDevice>, fault: Fault) -> Self {
        Faulty { device, fault, writes: 0, struck: false }
    }

    /// Fails the access if the fault has struck.
    fn check(&mut self) -> io::Result<()> {
        if !self.struck {
            return Ok(());
        }
        match self.fault.kind {
            FaultKind::Exit => {
                tracing::warn!("fault: exiting as killed");
                // SAFETY: kill touches no memory; the process ends here.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                Err(io::Error::other("killed"))
            }
            FaultKind::Error => Err(io::Error::from_raw_os_error(libc::EIO)),
            FaultKind::Hang => loop {
                std::thread::park();
            },
        }
    }
}

impl UserDevice for Faulty {
    fn region(&self, index: u32) -> Option<ServerRegion> {
        self.device.region(index)
    }

    fn irq_count(&self, index: u32) -> u32 {
        self.device.irq_count(index)
    }

    fn read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        self.check()?;
        self.device.read(index, offset, data)
    }

    fn write(&mut self, index: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check()?;
        if index == u32::from(super::REGISTER_BAR) {
            self.writes += 1;
            if self.writes >= self.fault.after_writes {
                tracing::warn!(writes = self.writes, "fault {:?} strikes", self.fault.kind);
                self.struck = true;
            }
        }
        self.device.write(index, offset, data)
    }

    fn reset(&mut self) {
        self.device.reset()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Plain;

    impl UserDevice for Plain {
        fn region(&self, _: u32) -> Option<ServerRegion> {
            None
        }
        fn irq_count(&self, _: u32) -> u32 {
            0
        }
        fn read(&mut self, _: u32, _: u64, data: &mut [u8]) -> io::Result<()> {
            data.fill(7);
            Ok(())
        }
        fn write(&mut self, _: u32, _: u64, _: &[u8]) -> io::Result<()> {
            Ok(())
        }
        fn reset(&mut self) {}
    }

    #[test]
    fn test_parse() {
        assert_eq!("exit@3".parse(), Ok(Fault { kind: FaultKind::Exit, after_writes: 3 }));
        assert_eq!("hang@1".parse::<Fault>().map(|f| f.kind), Ok(FaultKind::Hang));
        for bad in ["exit", "boom@3", "error@0", "error@x", ""] {
            assert!(bad.parse::<Fault>().is_err(), "{bad}");
        }
    }

    #[test]
    fn test_error_strikes_after_the_nth_register_write() {
        let mut d = Faulty::new(Box::new(Plain), "error@2".parse().unwrap());
        let mut b = [0; 4];
        d.write(0, 0x1000, &[1, 0, 0, 0]).unwrap();
        // Writes to other regions (configuration space) do not count.
        d.write(7, 4, &[6, 0]).unwrap();
        d.read(0, 0x1000, &mut b).unwrap();
        assert_eq!(b, [7; 4]);
        // The second register write itself still lands; everything after fails.
        d.write(0, 0x1000, &[1, 0, 0, 0]).unwrap();
        assert_eq!(d.read(0, 0x1000, &mut b).unwrap_err().raw_os_error(), Some(libc::EIO));
        assert!(d.write(7, 4, &[6, 0]).is_err());
    }
}
