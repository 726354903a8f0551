//! The guest's place in a cluster, as the kernel command line gives it (the fabric
//! contract): `gdrvm.node=NAME`, `gdrvm.net=FUNC:IP/PREFIX[,...]` and
//! `gdrvm.peers=NAME:IP[,...]`; and configuring it: each NIC function's interface, found by
//! the function's BDF in the expectations, gets its IPv4 address and comes up, and the
//! agent waits (bounded) for its carrier.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::context::Context;
use crate::{packet, pcidev};

/// An address for one NIC function (`nic0:10.77.0.1/24`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetAddr {
    /// The endpoint's name in the node file.
    pub func: String,
    /// Its IPv4 address.
    pub addr: Ipv4Addr,
    /// Prefix length (0..=32).
    pub prefix: u8,
}

impl NetAddr {
    /// The netmask of the prefix.
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0))
    }

    /// Whether `ip` is on this address's subnet.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = u32::from(self.netmask());
        u32::from(ip) & mask == u32::from(self.addr) & mask
    }
}

impl std::fmt::Display for NetAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}/{}", self.func, self.addr, self.prefix)
    }
}

/// Another node of the cluster and one of its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its node name.
    pub name: String,
    /// An address it answers on.
    pub addr: Ipv4Addr,
}

/// What the kernel command line says of the cluster; malformed entries are left out and
/// named in `errors`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cluster {
    /// This node's name (`gdrvm.node`).
    pub node: Option<String>,
    /// Addresses of this node's NIC functions (`gdrvm.net`), in order.
    pub nets: Vec<NetAddr>,
    /// The other nodes (`gdrvm.peers`), sorted by name.
    pub peers: Vec<Peer>,
    /// Entries that could not be read, with why.
    pub errors: Vec<String>,
}

fn parse_net(entry: &str) -> Result<NetAddr, String> {
    let (func, cidr) =
        entry.split_once(':').ok_or_else(|| format!("gdrvm.net entry '{entry}' is not FUNC:IP/PREFIX"))?;
    let (ip, prefix) = cidr.split_once('/').ok_or_else(|| format!("gdrvm.net entry '{entry}' lacks /PREFIX"))?;
    if func.is_empty() {
        return Err(format!("gdrvm.net entry '{entry}' has no function name"));
    }
    let addr =
        ip.parse::<Ipv4Addr>().map_err(|_| format!("gdrvm.net entry '{entry}': '{ip}' is not an IPv4 address"))?;
    let prefix = prefix
        .parse::<u8>()
        .ok()
        .filter(|p| *p <= 32)
        .ok_or_else(|| format!("gdrvm.net entry '{entry}': prefix '{prefix}' is not 0..32"))?;
    Ok(NetAddr { func: func.to_owned(), addr, prefix })
}

fn parse_peer(entry: &str) -> Result<Peer, String> {
    let (name, ip) = entry.split_once(':').ok_or_else(|| format!("gdrvm.peers entry '{entry}' is not NAME:IP"))?;
    if name.is_empty() {
        return Err(format!("gdrvm.peers entry '{entry}' has no node name"));
    }
    let addr =
        ip.parse::<Ipv4Addr>().map_err(|_| format!("gdrvm.peers entry '{entry}': '{ip}' is not an IPv4 address"))?;
    Ok(Peer { name: name.to_owned(), addr })
}

impl Cluster {
    /// Reads `gdrvm.node`, `gdrvm.net` and `gdrvm.peers` from a kernel command line (the
    /// last word of each kind wins, as for kernel parameters).
    pub fn from_cmdline(cmdline: &str) -> Cluster {
        let mut c = Cluster::default();
        for word in cmdline.split_whitespace() {
            if let Some(name) = word.strip_prefix("gdrvm.node=") {
                c.node = Some(name.to_owned()).filter(|n| !n.is_empty());
            } else if let Some(list) = word.strip_prefix("gdrvm.net=") {
                c.nets.clear();
                for entry in list.split(',').filter(|e| !e.is_empty()) {
                    match parse_net(entry) {
                        Ok(n) if c.nets.iter().any(|m| m.func == n.func) => {
                            c.errors.push(format!("gdrvm.net names {} twice", n.func))
                        }
                        Ok(n) => c.nets.push(n),
                        Err(e) => c.errors.push(e),
                    }
                }
            } else if let Some(list) = word.strip_prefix("gdrvm.peers=") {
                c.peers.clear();
                for entry in list.split(',').filter(|e| !e.is_empty()) {
                    match parse_peer(entry) {
                        Ok(p) if c.peers.iter().any(|q| q.name == p.name) => {
                            c.errors.push(format!("gdrvm.peers names {} twice", p.name))
                        }
                        Ok(p) => c.peers.push(p),
                        Err(e) => c.errors.push(e),
                    }
                }
            }
        }
        c.peers.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(node) = &c.node {
            if c.peers.iter().any(|p| &p.name == node) {
                c.errors.push(format!("gdrvm.peers lists this node ({node}) itself"));
                c.peers.retain(|p| &p.name != node);
            }
        }
        c
    }

    /// Whether this node is the server of its pairwise handshake with `peer`: the lower
    /// name serves. `None` without `gdrvm.node`.
    pub fn serves(&self, peer: &str) -> Option<bool> {
        self.node.as_deref().map(|me| me < peer)
    }

    /// `name`'s position among all nodes of the cluster sorted by name.
    pub fn rank(&self, name: &str) -> Option<usize> {
        let mut all: Vec<&str> = self.peers.iter().map(|p| p.name.as_str()).collect();
        all.extend(self.node.as_deref());
        all.sort_unstable();
        all.iter().position(|n| *n == name)
    }

    /// The NIC to reach `peer` from: the first on its subnet, else the first.
    pub fn nic_for(&self, peer: Ipv4Addr) -> Option<&NetAddr> {
        self.nets.iter().find(|n| n.contains(peer)).or(self.nets.first())
    }
}

/// The network interface of the PCI function in `dir`: `net/<name>` of the function, or
/// of a virtio device under it (`virtio<N>/net/<name>`).
pub fn netdev_of(dir: &Path) -> Option<String> {
    let first_in = |d: &Path| -> Option<String> {
        let mut names: Vec<String> = std::fs::read_dir(d)
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        names.sort();
        names.into_iter().next()
    };
    if let Some(n) = first_in(&dir.join("net")) {
        return Some(n);
    }
    let mut virtio: Vec<_> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        .map(|e| e.path())
        .collect();
    virtio.sort();
    virtio.iter().find_map(|v| first_in(&v.join("net")))
}

/// A NIC function configured for the cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Configured {
    /// Its address.
    pub net: NetAddr,
    /// The function's BDF.
    pub bdf: String,
    /// Its interface.
    pub ifname: String,
}

/// Calls `f` until it gives a value or `timeout` passes (at least once).
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() >= timeout {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The BDF and interface of function `func`, waiting up to `wait` for the interface (the
/// driver may still be probing).
pub fn find_interface(ctx: &Context, func: &str, wait: Duration) -> Result<(String, String), String> {
    let Some(expect) = ctx.expect.as_ref() else {
        // A guest of another VMM (the net benchmark's QEMU reference): no node file says
        // where `func` is, so the first interface on a PCI device stands for it.
        return wait_for(wait, || first_pci_interface(&ctx.root)).ok_or_else(|| {
            format!("no expectations to tell which PCI function is {func}, and no interface on a PCI device")
        });
    };
    let Some(f) = expect.pci.iter().find(|p| p.name == func) else {
        let names: Vec<&str> = expect.pci.iter().filter(|p| p.kind == "nic").map(|p| p.name.as_str()).collect();
        return Err(format!("no PCI function named {func} in the expectations (NICs: {})", names.join(", ")));
    };
    let dir = pcidev::function_dir(&ctx.root, &f.bdf);
    match wait_for(wait, || netdev_of(&dir)) {
        Some(ifname) => Ok((f.bdf.clone(), ifname)),
        None if !dir.exists() => Err(format!("{func} ({}) is not in sysfs", f.bdf)),
        None => Err(format!(
            "{func} ({}) has no network interface after {} s (driver {})",
            f.bdf,
            wait.as_secs(),
            pcidev::driver(&dir).unwrap_or_else(|| "none".into())
        )),
    }
}

/// The first interface (by name) whose device is a PCI function, with that function's
/// address.
fn first_pci_interface(root: &Path) -> Option<(String, String)> {
    let mut names: Vec<String> = std::fs::read_dir(root.join("sys/class/net"))
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    names.into_iter().find_map(|name| {
        let (bdf, _) = pcidev::pci_function_of(root, &root.join(format!("sys/class/net/{name}/device")))?;
        Some((bdf, name))
    })
}

/// `carrier` and `operstate` of interface `name` ("?" where unreadable: carrier reads
/// EINVAL while the interface is down).
pub fn link_state(root: &Path, name: &str) -> (String, String) {
    let read = |file: &str| {
        std::fs::read_to_string(root.join(format!("sys/class/net/{name}/{file}")))
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "?".into())
    };
    (read("carrier"), read("operstate"))
}

/// Configures `net`: finds the function's interface, sets the address and netmask, brings
/// it up and waits up to `carrier_wait` for carrier. Returns what was done as notes.
pub fn configure(ctx: &Context, net: &NetAddr, carrier_wait: Duration) -> (Result<Configured, String>, Vec<String>) {
    let mut notes = Vec::new();
    let (bdf, ifname) = match find_interface(ctx, &net.func, Duration::from_secs(5)) {
        Ok(x) => x,
        Err(e) => return (Err(e), notes),
    };
    notes.push(format!("{} is {bdf}, interface {ifname}", net.func));
    match ipv4_address(&ifname) {
        Ok(Some(a)) if a == net.addr => notes.push(format!("{ifname} already has {}", net.addr)),
        current => {
            if let Ok(Some(a)) = current {
                notes.push(format!("{ifname} had {a}, now {}", net.addr));
            }
            if let Err(e) = set_ipv4(&ifname, net.addr, net.netmask()) {
                return (Err(format!("cannot set {}/{} on {ifname}: {e}", net.addr, net.prefix)), notes);
            }
            notes.push(format!("{ifname}: {}/{} (SIOCSIFADDR, SIOCSIFNETMASK)", net.addr, net.prefix));
        }
    }
    match packet::set_up(&ifname) {
        Ok(true) => notes.push(format!("{ifname} was already up")),
        Ok(false) => notes.push(format!("{ifname} set up")),
        Err(e) => return (Err(format!("cannot bring {ifname} up: {e}")), notes),
    }
    let start = Instant::now();
    let carrier = wait_for(carrier_wait, || (link_state(&ctx.root, &ifname).0 == "1").then_some(()));
    let (c, op) = link_state(&ctx.root, &ifname);
    if carrier.is_none() {
        let reason = format!(
            "{ifname} has no carrier after {} s (carrier {c}, operstate {op}): is its wire attached?",
            carrier_wait.as_secs()
        );
        return (Err(reason), notes);
    }
    notes.push(format!("{ifname} carrier after {} ms, operstate {op}", start.elapsed().as_millis()));
    (Ok(Configured { net: net.clone(), bdf, ifname }), notes)
}

/// `struct ifreq` with a `sockaddr_in` in its union (40 bytes on x86-64).
#[repr(C)]
struct IfreqAddr {
    name: [libc::c_char; libc::IFNAMSIZ],
    addr: libc::sockaddr_in,
    _rest: [u8; 8],
}

fn ifreq(name: &str, addr: Ipv4Addr) -> io::Result<IfreqAddr> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad interface name '{name}'")));
    }
    let mut req = IfreqAddr {
        name: [0; libc::IFNAMSIZ],
        addr: libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr { s_addr: u32::from(addr).to_be() },
            sin_zero: [0; 8],
        },
        _rest: [0; 8],
    };
    for (d, s) in req.name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(req)
}

fn inet_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The IPv4 address of interface `name`, `None` when it has none.
pub fn ipv4_address(name: &str) -> io::Result<Option<Ipv4Addr>> {
    let sock = inet_socket()?;
    let mut req = ifreq(name, Ipv4Addr::UNSPECIFIED)?;
    // SAFETY: `req` is a valid ifreq the kernel fills in.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFADDR, &mut req as *mut IfreqAddr) } < 0 {
        let e = io::Error::last_os_error();
        // EADDRNOTAVAIL: no address yet.
        return if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) { Ok(None) } else { Err(e) };
    }
    Ok(Some(Ipv4Addr::from(u32::from_be(req.addr.sin_addr.s_addr))))
}

/// Sets the IPv4 address and netmask of interface `name`.
pub fn set_ipv4(name: &str, addr: Ipv4Addr, mask: Ipv4Addr) -> io::Result<()> {
    let sock = inet_socket()?;
    for (request, value) in [(libc::SIOCSIFADDR, addr), (libc::SIOCSIFNETMASK, mask)] {
        let req = ifreq(name, value)?;
        // SAFETY: `req` is a valid ifreq with an AF_INET address; the kernel only reads it.
        if unsafe { libc::ioctl(sock.as_raw_fd(), request, &req as *const IfreqAddr) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use gdrvm_model::{Expectations, PciExpectation};

    use super::*;
    use crate::context::expected_function;

    #[test]
    fn test_cmdline_cluster() {
        let c = Cluster::from_cmdline(
            "console=ttyS0 quiet gdrvm.node=node1 gdrvm.net=nic0:10.77.0.2/24,nic1:10.78.0.2/16 \
             gdrvm.peers=node2:10.77.0.3,node0:10.77.0.1 gdrvm.suites=rdma",
        );
        assert_eq!(c.node.as_deref(), Some("node1"));
        assert_eq!(
            c.nets,
            [
                NetAddr { func: "nic0".into(), addr: Ipv4Addr::new(10, 77, 0, 2), prefix: 24 },
                NetAddr { func: "nic1".into(), addr: Ipv4Addr::new(10, 78, 0, 2), prefix: 16 },
            ]
        );
        let names: Vec<&str> = c.peers.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["node0", "node2"], "peers sorted by name");
        assert!(c.errors.is_empty(), "{:?}", c.errors);
        assert_eq!(c.serves("node0"), Some(false));
        assert_eq!(c.serves("node2"), Some(true));
        assert_eq!(c.rank("node0"), Some(0));
        assert_eq!(c.rank("node1"), Some(1));
        assert_eq!(c.rank("node2"), Some(2));
        assert_eq!(c.nic_for(Ipv4Addr::new(10, 78, 9, 9)).map(|n| n.func.as_str()), Some("nic1"));
        assert_eq!(c.nic_for(Ipv4Addr::new(192, 168, 0, 1)).map(|n| n.func.as_str()), Some("nic0"));
        assert_eq!(c.nets[0].to_string(), "nic0:10.77.0.2/24");
    }

    #[test]
    fn test_cmdline_without_cluster() {
        let c = Cluster::from_cmdline("console=ttyS0 gdrvm.suites=smoke");
        assert_eq!(c, Cluster::default());
        assert_eq!(c.serves("node0"), None);
        assert_eq!(c.nic_for(Ipv4Addr::LOCALHOST), None);
    }

    #[test]
    fn test_cmdline_errors_are_named() {
        let c = Cluster::from_cmdline(
            "gdrvm.node=a gdrvm.net=nic0:10.0.0.1,nic1:fe80::1/64,nic2:10.0.0.2/33,nic3:10.0.0.3/8,nic3:10.0.0.4/8 \
             gdrvm.peers=b,c:10.0.0.300,a:10.0.0.9,d:10.0.0.4",
        );
        assert_eq!(c.nets.len(), 1);
        assert_eq!(c.peers, [Peer { name: "d".into(), addr: Ipv4Addr::new(10, 0, 0, 4) }]);
        assert_eq!(
            c.errors,
            [
                "gdrvm.net entry 'nic0:10.0.0.1' lacks /PREFIX",
                "gdrvm.net entry 'nic1:fe80::1/64': 'fe80::1' is not an IPv4 address",
                "gdrvm.net entry 'nic2:10.0.0.2/33': prefix '33' is not 0..32",
                "gdrvm.net names nic3 twice",
                "gdrvm.peers entry 'b' is not NAME:IP",
                "gdrvm.peers entry 'c:10.0.0.300': '10.0.0.300' is not an IPv4 address",
                "gdrvm.peers lists this node (a) itself",
            ]
        );
    }

    #[test]
    fn test_netmask_and_subnet() {
        let n = |prefix| NetAddr { func: "nic0".into(), addr: Ipv4Addr::new(10, 77, 0, 2), prefix };
        assert_eq!(n(24).netmask(), Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(n(32).netmask(), Ipv4Addr::new(255, 255, 255, 255));
        assert_eq!(n(0).netmask(), Ipv4Addr::UNSPECIFIED);
        assert!(n(24).contains(Ipv4Addr::new(10, 77, 0, 200)));
        assert!(!n(24).contains(Ipv4Addr::new(10, 77, 1, 2)));
        assert!(n(0).contains(Ipv4Addr::new(1, 2, 3, 4)));
    }

    fn nic(name: &str, bdf: &str) -> PciExpectation {
        PciExpectation { backing: "virtio-net".into(), ..expected_function(name, "nic", bdf, (0x1af4, 0x1041)) }
    }

    #[test]
    fn test_interface_of_a_virtio_function() {
        let root = tempfile::tempdir().unwrap();
        let pci = root.path().join("sys/bus/pci/devices");
        std::fs::create_dir_all(pci.join("0000:03:00.0/virtio1/net/eth1")).unwrap();
        std::fs::create_dir_all(pci.join("0000:04:00.0/net/enp4s0")).unwrap();
        std::fs::create_dir_all(pci.join("0000:05:00.0")).unwrap();
        assert_eq!(netdev_of(&pci.join("0000:03:00.0")).as_deref(), Some("eth1"));
        assert_eq!(netdev_of(&pci.join("0000:04:00.0")).as_deref(), Some("enp4s0"));
        assert_eq!(netdev_of(&pci.join("0000:05:00.0")), None);
        let ctx = Context {
            expect: Some(Expectations {
                cpus: 1,
                memory_bytes: 1 << 30,
                numa: vec![],
                pci: vec![nic("nic0", "0000:03:00.0"), nic("nic1", "0000:05:00.0")],
                paths: vec![],
                host: false,
            }),
            image: None,
            root: root.path().to_owned(),
            kernel_log: Ok(String::new()),
            module_errors: vec![],
            modules_left_out: vec![],
        };
        assert_eq!(find_interface(&ctx, "nic0", Duration::ZERO), Ok(("0000:03:00.0".into(), "eth1".into())));
        assert_eq!(
            find_interface(&ctx, "nic1", Duration::ZERO),
            Err("nic1 (0000:05:00.0) has no network interface after 0 s (driver none)".into())
        );
        assert_eq!(
            find_interface(&ctx, "nic9", Duration::ZERO),
            Err("no PCI function named nic9 in the expectations (NICs: nic0, nic1)".into())
        );
        let bare = Context { expect: None, ..ctx };
        assert!(find_interface(&bare, "nic0", Duration::ZERO).unwrap_err().starts_with("no expectations"));
    }

    #[test]
    fn test_ifreq_layout() {
        assert_eq!(std::mem::size_of::<IfreqAddr>(), 40);
        let r = ifreq("eth0", Ipv4Addr::new(10, 77, 0, 1)).unwrap();
        assert_eq!(u32::from_be(r.addr.sin_addr.s_addr), 0x0a4d_0001);
        assert!(ifreq("a-name-longer-than-15", Ipv4Addr::LOCALHOST).is_err());
    }
}
