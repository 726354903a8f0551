//! COM1: a 16550A UART (vm-superio) with its interrupt delivered through an eventfd.

use std::io::Write;

use vm_superio::serial::SerialEvents;
use vm_superio::Trigger;
use vmm_sys_util::eventfd::EventFd;

use crate::BusDevice;

/// I/O port base of COM1.
pub const COM1_PORT: u16 = 0x3f8;
/// I/O ports a 16550A decodes, from [`COM1_PORT`].
pub const COM1_LEN: u8 = 8;
/// ISA interrupt line of COM1.
pub const COM1_IRQ: u32 = 4;

/// Raises the UART's interrupt by writing an eventfd registered with KVM as an irqfd.
pub struct IrqEventFd(EventFd);

impl Trigger for IrqEventFd {
    type E = std::io::Error;

    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Tells the input pump when the guest has drained the receive FIFO, so that it can feed
/// more bytes without polling.
pub struct InputDrained(EventFd);

impl SerialEvents for InputDrained {
    fn buffer_read(&self) {}
    fn out_byte(&self) {}
    fn tx_lost_byte(&self) {
        tracing::warn!("serial output lost a byte");
    }
    fn in_buffer_empty(&self) {
        if let Err(e) = self.0.write(1) {
            tracing::warn!("cannot signal serial input room: {e}");
        }
    }
}

/// Host side of the UART's receive path.
pub trait SerialInput {
    /// Queues as many of `bytes` as the receive FIFO takes; returns how many it took.
    fn enqueue(&mut self, bytes: &[u8]) -> usize;
    /// Free room in the receive FIFO.
    fn room(&self) -> usize;
}

/// The UART: output goes to `out` (the console), input comes from [`SerialInput::enqueue`].
pub struct Serial {
    uart: vm_superio::Serial<IrqEventFd, InputDrained, Box<dyn Write + Send>>,
}

impl Serial {
    /// A UART that raises `irq` and writes the guest's output to `out`. `drained` is
    /// signalled whenever the guest empties the receive FIFO.
    pub fn new(irq: EventFd, drained: EventFd, out: Box<dyn Write + Send>) -> Self {
        Serial { uart: vm_superio::Serial::with_events(IrqEventFd(irq), InputDrained(drained), out) }
    }
}

impl SerialInput for Serial {
    fn enqueue(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(self.uart.fifo_capacity());
        if n == 0 {
            return 0;
        }
        match self.uart.enqueue_raw_bytes(&bytes[..n]) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("serial input dropped: {e:?}");
                0
            }
        }
    }

    fn room(&self) -> usize {
        self.uart.fifo_capacity()
    }
}

impl BusDevice for Serial {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // The UART has 8 one-byte registers; a wider access reads the first and pads.
        data.fill(0);
        if let (Some(first), Ok(reg)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.uart.read(reg);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(&value), Ok(reg)) = (data.first(), u8::try_from(offset)) {
            if let Err(e) = self.uart.write(reg, value) {
                tracing::warn!("serial write failed: {e:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Sink(Arc<Mutex<Vec<u8>>>);
    impl Write for Sink {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    const THR: u64 = 0;
    const IER: u64 = 1;
    const LSR: u64 = 5;

    fn serial() -> (Serial, Sink, EventFd, EventFd) {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let drained = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let sink = Sink::default();
        let s = Serial::new(irq.try_clone().unwrap(), drained.try_clone().unwrap(), Box::new(sink.clone()));
        (s, sink, irq, drained)
    }

    #[test]
    fn test_output_reaches_console() {
        let (mut s, sink, _, _) = serial();
        for b in b"ok 1 smoke\n" {
            s.write(THR, &[*b]);
        }
        assert_eq!(&sink.0.lock().unwrap()[..], b"ok 1 smoke\n");
    }

    #[test]
    fn test_input_raises_irq_and_signals_drained() {
        let (mut s, _, irq, drained) = serial();
        // Enable the received-data interrupt, as Linux's 8250 driver does.
        s.write(IER, &[0x01]);
        let room = s.room();
        assert!(room >= 16);
        assert_eq!(s.enqueue(b"ls\n"), 3);
        assert_eq!(irq.read().unwrap(), 1);
        let mut b = [0u8];
        s.read(THR, &mut b);
        assert_eq!(b, [b'l']);
        s.read(THR, &mut b);
        s.read(THR, &mut b);
        assert_eq!(b, [b'\n']);
        assert_eq!(drained.read().unwrap(), 1);
        // Line status: no data ready now.
        s.read(LSR, &mut b);
        assert_eq!(b[0] & 1, 0);
    }

    #[test]
    fn test_fifo_full_takes_what_fits() {
        let (mut s, _, _, _) = serial();
        let big = vec![b'x'; 1000];
        let took = s.enqueue(&big);
        assert!(took < 1000 && took > 0);
        assert_eq!(s.room(), 0);
        assert_eq!(s.enqueue(b"y"), 0);
    }

    #[test]
    fn test_garbage_offsets_do_not_panic() {
        let (mut s, _, _, _) = serial();
        let mut b = [0u8; 4];
        s.read(u64::MAX, &mut b);
        s.write(u64::MAX, &[1]);
        s.write(3, &[]);
        s.read(7, &mut []);
    }
}
