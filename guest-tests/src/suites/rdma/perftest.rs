//! perftest (`ib_write_bw`, `ib_read_lat`) between two nodes: the command lines (soft-RoCE
//! under emulation needs `-F`, and the RoCE v2 GID index with `-x`) and the figures from
//! their result tables.

use std::net::Ipv4Addr;

/// Iterations per run: enough for a figure, few enough for an emulated link.
pub const ITERATIONS: u32 = 200;
/// Message size of the bandwidth run.
pub const BW_SIZE: u64 = 64 << 10;

/// Which perftest program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// RDMA WRITE bandwidth.
    WriteBw,
    /// RDMA READ latency.
    ReadLat,
}

impl Tool {
    /// The program's name.
    pub fn name(self) -> &'static str {
        match self {
            Tool::WriteBw => "ib_write_bw",
            Tool::ReadLat => "ib_read_lat",
        }
    }

    /// Where Debian's perftest installs it.
    pub fn path(self) -> String {
        format!("/usr/bin/{}", self.name())
    }
}

/// Arguments of `tool` on device `dev` with GID index `gid`, on TCP `port`; the client
/// names the server's address, the server none.
pub fn args(tool: Tool, dev: &str, gid: u32, port: u16, server: Option<Ipv4Addr>) -> Vec<String> {
    let mut a: Vec<String> =
        ["-d", dev, "-x", &gid.to_string(), "-F", "-n", &ITERATIONS.to_string(), "-p", &port.to_string()]
            .iter()
            .map(|s| s.to_string())
            .collect();
    if tool == Tool::WriteBw {
        a.extend(["-s".to_owned(), BW_SIZE.to_string(), "--report_gbits".to_owned()]);
    }
    a.extend(server.map(|s| s.to_string()));
    a
}

/// Whether a failed client run means the server was not listening yet (worth retrying).
pub fn server_not_ready(output: &str) -> bool {
    output.contains("Couldn't connect to") || output.contains("Unable to init the socket connection")
}

/// A bandwidth result line.
#[derive(Debug, Clone, PartialEq)]
pub struct Bandwidth {
    /// Message size.
    pub bytes: u64,
    /// Iterations.
    pub iterations: u64,
    /// Peak bandwidth.
    pub peak: f64,
    /// Average bandwidth.
    pub average: f64,
    /// `Gb/s` or `MB/s` (what the header says).
    pub unit: String,
    /// Messages per second, millions.
    pub mpps: f64,
}

/// A latency result line (microseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct Latency {
    /// Message size.
    pub bytes: u64,
    /// Iterations.
    pub iterations: u64,
    /// Smallest.
    pub min: f64,
    /// Largest.
    pub max: f64,
    /// Median.
    pub typical: f64,
    /// Mean.
    pub avg: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// The numbers of the first result line after the header line containing `header`.
fn table_row(text: &str, header: &str, min_fields: usize) -> Option<(String, Vec<f64>)> {
    let mut lines = text.lines();
    let head = lines.find(|l| l.contains("#bytes") && l.contains(header))?.to_owned();
    lines
        .find_map(|l| {
            let nums: Vec<f64> = l.split_whitespace().map_while(|w| w.parse::<f64>().ok()).collect();
            (nums.len() >= min_fields && l.split_whitespace().next()?.parse::<u64>().is_ok()).then_some(nums)
        })
        .map(|n| (head, n))
}

/// The result of an `ib_*_bw` run (either side prints it).
pub fn parse_bw(text: &str) -> Option<Bandwidth> {
    let (head, n) = table_row(text, "BW average", 5)?;
    let unit = if head.contains("[Gb/sec]") { "Gb/s" } else { "MB/s" };
    Some(Bandwidth {
        bytes: n[0] as u64,
        iterations: n[1] as u64,
        peak: n[2],
        average: n[3],
        unit: unit.to_owned(),
        mpps: n[4],
    })
}

/// The result of an `ib_*_lat` run (the client prints it).
pub fn parse_lat(text: &str) -> Option<Latency> {
    let (_, n) = table_row(text, "t_typical", 8)?;
    Some(Latency {
        bytes: n[0] as u64,
        iterations: n[1] as u64,
        min: n[2],
        max: n[3],
        typical: n[4],
        avg: n[5],
        p99: n[7],
    })
}

impl std::fmt::Display for Bandwidth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} B: {} {} (peak {} {}, {} iterations, {} Mpps)",
            self.bytes, self.average, self.unit, self.peak, self.unit, self.iterations, self.mpps
        )
    }
}

impl std::fmt::Display for Latency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} B: {:.2} us typical, {:.2} us average (min {:.2}, max {:.2}, 99% {:.2}), {} iterations",
            self.bytes, self.typical, self.avg, self.min, self.max, self.p99, self.iterations
        )
    }
}

/// The figure a run printed, as one line, if it printed one.
pub fn figure(tool: Tool, text: &str) -> Option<String> {
    match tool {
        Tool::WriteBw => parse_bw(text).map(|b| b.to_string()),
        Tool::ReadLat => parse_lat(text).map(|l| l.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ib_write_bw 4.5-0.17 client output with --report_gbits (REPORT_FMT).
    const WRITE_BW: &str = "\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : rxe_nic0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 128
 CQ Moderation   : 100
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 3
 Max inline data : 0[B]
 rdma_cm QPs\t : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0011 PSN 0x4e1fb0 RKey 0x0005d4 VAddr 0x007f0e9f1cd000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:02
 remote address: LID 0000 QPN 0x0012 PSN 0x2c2cf9 RKey 0x0006c0 VAddr 0x007fb7e2a5c000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:10:77:00:01
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      200              0.45               0.42   \t\t     0.000801
---------------------------------------------------------------------------------------
";

    /// Below 0.1 Gb/s perftest switches to REPORT_FMT_EXT (six decimals).
    const WRITE_BW_SLOW: &str = "\
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      200           0.091234            0.087712            0.000167
---------------------------------------------------------------------------------------
";

    /// ib_read_lat 4.5-0.17 client output (REPORT_FMT_LAT).
    const READ_LAT: &str = "\
---------------------------------------------------------------------------------------
                    RDMA_Read Latency Test
 Dual-port       : OFF\t\tDevice         : rxe_nic0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 Mtu             : 1024[B]
 Link type       : Ethernet
 GID index       : 3
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 2       200          31.02          412.87       40.11    \t       45.30     \t28.94\t\t120.55 \t\t412.87 \t
---------------------------------------------------------------------------------------
";

    #[test]
    fn test_bandwidth_table() {
        let bw = parse_bw(WRITE_BW).unwrap();
        assert_eq!(
            bw,
            Bandwidth { bytes: 65536, iterations: 200, peak: 0.45, average: 0.42, unit: "Gb/s".into(), mpps: 0.000801 }
        );
        assert_eq!(bw.to_string(), "65536 B: 0.42 Gb/s (peak 0.45 Gb/s, 200 iterations, 0.000801 Mpps)");
        let slow = parse_bw(WRITE_BW_SLOW).unwrap();
        assert_eq!(slow.average, 0.087712);
        let mb = WRITE_BW.replace("[Gb/sec]", "[MB/sec]");
        assert_eq!(parse_bw(&mb).unwrap().unit, "MB/s");
    }

    #[test]
    fn test_latency_table() {
        let lat = parse_lat(READ_LAT).unwrap();
        assert_eq!(
            lat,
            Latency { bytes: 2, iterations: 200, min: 31.02, max: 412.87, typical: 40.11, avg: 45.30, p99: 120.55 }
        );
        assert_eq!(
            figure(Tool::ReadLat, READ_LAT).unwrap(),
            "2 B: 40.11 us typical, 45.30 us average (min 31.02, max 412.87, 99% 120.55), 200 iterations"
        );
    }

    #[test]
    fn test_no_figure_without_a_table() {
        let server_lat = "\n************************************\n* Waiting for client to connect... *\n************************************\n";
        assert_eq!(parse_lat(server_lat), None);
        assert_eq!(
            parse_bw(" Couldn't connect to 10.77.0.1:18502\nUnable to open file descriptor for socket connection"),
            None
        );
        assert_eq!(figure(Tool::WriteBw, READ_LAT), None, "a latency table is no bandwidth figure");
        assert!(server_not_ready(" Couldn't connect to 10.77.0.1:18502\n"));
        assert!(!server_not_ready(" Couldn't get context for the device\n"));
    }

    #[test]
    fn test_command_lines() {
        assert_eq!(
            args(Tool::WriteBw, "rxe_nic0", 3, 18502, None).join(" "),
            "-d rxe_nic0 -x 3 -F -n 200 -p 18502 -s 65536 --report_gbits"
        );
        assert_eq!(
            args(Tool::ReadLat, "rxe_nic0", 3, 18503, Some(Ipv4Addr::new(10, 77, 0, 1))).join(" "),
            "-d rxe_nic0 -x 3 -F -n 200 -p 18503 10.77.0.1"
        );
        assert_eq!(Tool::ReadLat.path(), "/usr/bin/ib_read_lat");
    }
}
