//! Owners of the libibverbs objects the pair test needs, over `ibverbs::ffi`. The `ibverbs`
//! crate keeps its raw pointers private and posts only SEND work requests, so a queue pair
//! that also does RDMA WRITE and READ (and the port, device and GID queries around it) has to
//! be built from the C API; these types give each object one owner that frees it, and borrow
//! what it was made from so Rust drops them in the right order.

use std::ffi::CStr;
use std::io;
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::os::raw::c_int;
use std::ptr;
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

/// The port every test uses (soft-RoCE devices have one).
pub const PORT: u8 = 1;

/// Why `ibv_get_device_list` failed, with what ENOSYS means (no kernel RDMA support).
pub fn device_list_error(e: &io::Error) -> String {
    if e.kind() == io::ErrorKind::Unsupported {
        format!("ibv_get_device_list failed: {e}: the kernel offers no verbs (is ib_uverbs loaded?)")
    } else {
        format!("ibv_get_device_list failed: {e}")
    }
}

/// `errno` from a call that returns it, as text.
fn errno_text(rc: c_int) -> String {
    io::Error::from_raw_os_error(rc.abs()).to_string()
}

fn device_name(dev: *mut ffi::ibv_device) -> String {
    if dev.is_null() {
        return String::new();
    }
    // SAFETY: `dev` is a live entry of a device list; the name is NUL-terminated.
    let name = unsafe { ffi::ibv_get_device_name(dev) };
    if name.is_null() {
        return String::new();
    }
    // SAFETY: checked non-null; libibverbs returns a NUL-terminated string.
    unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
}

/// An open device.
pub struct Context {
    ctx: *mut ffi::ibv_context,
    /// The device's name.
    pub name: String,
}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Context, String> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out pointer; the list is freed below.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            return Err(device_list_error(&io::Error::last_os_error()));
        }
        let mut names = Vec::new();
        let mut ctx: *mut ffi::ibv_context = ptr::null_mut();
        let mut open_error = None;
        for i in 0..usize::try_from(n).unwrap_or(0) {
            // SAFETY: the list holds `n` device pointers.
            let dev = unsafe { *list.add(i) };
            let dev_name = device_name(dev);
            if dev_name == name && ctx.is_null() {
                // SAFETY: `dev` is live until the list is freed; an opened context outlives it.
                ctx = unsafe { ffi::ibv_open_device(dev) };
                if ctx.is_null() {
                    open_error = Some(io::Error::last_os_error());
                }
            }
            names.push(dev_name);
        }
        // SAFETY: `list` came from ibv_get_device_list and is freed once, after opening.
        unsafe { ffi::ibv_free_device_list(list) };
        if let Some(e) = open_error {
            return Err(format!("cannot open RDMA device {name}: {e}"));
        }
        if ctx.is_null() {
            let seen = if names.is_empty() { "none".to_owned() } else { names.join(", ") };
            return Err(format!("no RDMA device named {name} (libibverbs sees: {seen})"));
        }
        Ok(Context { ctx, name: name.to_owned() })
    }

    /// Device attributes (`ibv_query_device`).
    pub fn query_device(&self) -> Result<ffi::ibv_device_attr, String> {
        let mut attr = ffi::ibv_device_attr::default();
        // SAFETY: the context is open and `attr` is a writable ibv_device_attr.
        let rc = unsafe { ffi::ibv_query_device(self.ctx, &mut attr) };
        if rc != 0 {
            return Err(format!("ibv_query_device({}): {}", self.name, errno_text(rc)));
        }
        Ok(attr)
    }

    /// Attributes of `port` (`ibv_query_port`).
    pub fn query_port(&self, port: u8) -> Result<ffi::ibv_port_attr, String> {
        let mut attr = ffi::ibv_port_attr::default();
        // SAFETY: the context is open; the provider fills a whole (current) ibv_port_attr,
        // which `attr` is, through the compat prototype's pointer.
        let rc = unsafe { ffi::ibv_query_port(self.ctx, port, (&mut attr as *mut ffi::ibv_port_attr).cast()) };
        if rc != 0 {
            return Err(format!("ibv_query_port({}, {port}): {}", self.name, errno_text(rc)));
        }
        Ok(attr)
    }

    /// GID `index` of `port`.
    pub fn query_gid(&self, port: u8, index: u32) -> Result<[u8; 16], String> {
        let mut gid = ffi::ibv_gid::default();
        let idx = c_int::try_from(index).map_err(|_| format!("GID index {index} out of range"))?;
        // SAFETY: the context is open and `gid` is a writable ibv_gid.
        let rc = unsafe { ffi::ibv_query_gid(self.ctx, port, idx, &mut gid) };
        if rc != 0 {
            return Err(format!("ibv_query_gid({}, port {port}, index {index}): {}", self.name, errno_text(rc)));
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        Ok(unsafe { gid.raw })
    }

    /// A protection domain.
    pub fn alloc_pd(&self) -> Result<Pd<'_>, String> {
        // SAFETY: the context is open.
        let pd = unsafe { ffi::ibv_alloc_pd(self.ctx) };
        if pd.is_null() {
            return Err(format!("ibv_alloc_pd({}): {}", self.name, io::Error::last_os_error()));
        }
        Ok(Pd { pd, _ctx: PhantomData })
    }

    /// A completion queue of at least `entries` entries.
    pub fn create_cq(&self, entries: i32) -> Result<Cq<'_>, String> {
        // SAFETY: the context is open; no completion channel, vector 0.
        let cq = unsafe { ffi::ibv_create_cq(self.ctx, entries, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(format!("ibv_create_cq({}, {entries}): {}", self.name, io::Error::last_os_error()));
        }
        Ok(Cq { cq, _ctx: PhantomData })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device; everything made from it borrows it, so is gone.
        let rc = unsafe { ffi::ibv_close_device(self.ctx) };
        if rc != 0 {
            eprintln!("gdrvm-verbs: ibv_close_device({}): {}", self.name, errno_text(rc));
        }
    }
}

/// A protection domain.
pub struct Pd<'c> {
    pd: *mut ffi::ibv_pd,
    _ctx: PhantomData<&'c Context>,
}

impl Pd<'_> {
    /// Registers a zeroed buffer of `len` bytes for local write and remote read and write.
    pub fn register(&self, len: usize) -> Result<Mr<'_>, String> {
        let mut buf = vec![0u8; len.max(1)];
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        // SAFETY: the PD is live; `buf` is `len` writable bytes that the Mr owns (and never
        // reallocates) until after ibv_dereg_mr.
        let mr = unsafe { ffi::ibv_reg_mr(self.pd, buf.as_mut_ptr().cast(), buf.len(), access.0 as c_int) };
        if mr.is_null() {
            return Err(format!("ibv_reg_mr({len} bytes): {}", io::Error::last_os_error()));
        }
        Ok(Mr { mr, buf, _pd: PhantomData })
    }

    /// Registers `length` bytes of the dma-buf `fd` from its start (GPU memory exported
    /// with `cuMemGetHandleForAddressRange`) for local write and remote read and write,
    /// then deregisters it: whether the device can take peer memory this way. The caller
    /// keeps `fd` and what it exports alive across the call.
    pub fn register_dmabuf(&self, fd: RawFd, length: usize) -> Result<DmabufRegistration, String> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        // SAFETY: the PD is live; libibverbs only passes `fd` to the kernel, which checks it
        // is a dma-buf of at least `length` bytes; nothing of ours is written.
        let mr = unsafe { ffi::ibv_reg_dmabuf_mr(self.pd, 0, length, 0, fd, access.0 as c_int) };
        if mr.is_null() {
            return Err(format!("ibv_reg_dmabuf_mr(fd {fd}, {length} bytes): {}", io::Error::last_os_error()));
        }
        // SAFETY: `mr` is the live region just registered.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        // SAFETY: registered above, deregistered once; nothing else holds it.
        let rc = unsafe { ffi::ibv_dereg_mr(mr) };
        if rc != 0 {
            return Err(format!("ibv_dereg_mr of the dma-buf region: {}", errno_text(rc)));
        }
        Ok(DmabufRegistration { lkey, rkey })
    }

    /// An RC queue pair on `cq` (send and receive), in state RESET.
    pub fn create_rc_qp<'a>(&'a self, cq: &'a Cq<'_>, depth: u32) -> Result<Qp<'a>, String> {
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: cq.cq,
            recv_cq: cq.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: depth,
                max_recv_wr: depth,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: the PD and CQ are live and outlive the QP (borrowed for 'a).
        let qp = unsafe { ffi::ibv_create_qp(self.pd, &mut init) };
        if qp.is_null() {
            return Err(format!("ibv_create_qp(RC): {}", io::Error::last_os_error()));
        }
        Ok(Qp { qp, _res: PhantomData })
    }
}

impl Drop for Pd<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_pd; MRs and QPs borrow it, so are gone.
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            eprintln!("gdrvm-verbs: ibv_dealloc_pd: {}", errno_text(rc));
        }
    }
}

/// The keys a dma-buf registration got (it is deregistered at once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmabufRegistration {
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// A completion queue.
pub struct Cq<'c> {
    cq: *mut ffi::ibv_cq,
    _ctx: PhantomData<&'c Context>,
}

/// The outcome of a work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The request's id.
    pub wr_id: u64,
    /// `IBV_WC_SUCCESS` (0) or the error status.
    pub status: u32,
    /// Bytes moved (receives and READs).
    pub len: usize,
}

/// Text of a work completion status (`ibv_wc_status_str`) and what it usually means here.
pub fn status_text(status: u32) -> String {
    // SAFETY: ibv_wc_status_str returns a static string for any value ("unknown" otherwise).
    let text = unsafe { ffi::ibv_wc_status_str(status) };
    let name = if text.is_null() {
        "unknown".to_owned()
    } else {
        // SAFETY: a non-null, NUL-terminated static string.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    };
    let hint = match status {
        ffi::ibv_wc_status::IBV_WC_RETRY_EXC_ERR => {
            ": the peer's RDMA device stopped answering (peer gone or unreachable)"
        }
        ffi::ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => ": the peer had no receive posted",
        ffi::ibv_wc_status::IBV_WC_REM_ACCESS_ERR => ": the peer refused the access (address or rkey)",
        ffi::ibv_wc_status::IBV_WC_WR_FLUSH_ERR => ": the queue pair was already in the error state",
        _ => "",
    };
    format!("{name} (status {status}){hint}")
}

impl Cq<'_> {
    /// Waits for the completions of `wr_ids` (in any order) until `deadline`; completions of
    /// other requests are dropped. Spins briefly, then sleeps in growing steps (the guest
    /// has few CPUs and soft-RoCE needs them).
    pub fn wait(&self, wr_ids: &[u64], deadline: Instant) -> Result<Vec<Completion>, String> {
        let mut got: Vec<Completion> = Vec::new();
        let mut wc = [ffi::ibv_wc::default(); 8];
        let start = Instant::now();
        let mut nap = Duration::from_micros(10);
        while got.len() < wr_ids.len() {
            let n = self.poll(&mut wc)?;
            for c in &wc[..n] {
                if wr_ids.contains(&c.wr_id()) && !got.iter().any(|g| g.wr_id == c.wr_id()) {
                    let status = c.error().map_or(ffi::ibv_wc_status::IBV_WC_SUCCESS, |(s, _)| s);
                    got.push(Completion { wr_id: c.wr_id(), status, len: c.len() });
                }
            }
            if n > 0 {
                continue;
            }
            let now = Instant::now();
            if now >= deadline {
                let waited = now.duration_since(start);
                return Err(format!("no completion within {:.1} s", waited.as_secs_f64()));
            }
            if now.duration_since(start) < Duration::from_micros(200) {
                std::thread::yield_now();
            } else {
                std::thread::sleep(nap.min(deadline.saturating_duration_since(now)));
                nap = (nap * 2).min(Duration::from_micros(500));
            }
        }
        Ok(got)
    }

    fn poll(&self, wc: &mut [ffi::ibv_wc]) -> Result<usize, String> {
        // SAFETY: the CQ is live, so is its context.
        let ctx = unsafe { (*self.cq).context };
        // SAFETY: `ctx` is the CQ's open context; `ops` is filled in by the provider.
        let poll = unsafe { (*ctx).ops.poll_cq }.ok_or("the provider has no poll_cq")?;
        // SAFETY: `wc` has room for the number of entries passed.
        let n = unsafe { poll(self.cq, wc.len() as c_int, wc.as_mut_ptr()) };
        usize::try_from(n).map_err(|_| format!("ibv_poll_cq failed ({n})"))
    }
}

impl Drop for Cq<'_> {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_cq; QPs using it borrow it, so are gone.
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            eprintln!("gdrvm-verbs: ibv_destroy_cq: {}", errno_text(rc));
        }
    }
}

/// A registered buffer.
pub struct Mr<'p> {
    mr: *mut ffi::ibv_mr,
    buf: Vec<u8>,
    _pd: PhantomData<&'p Pd<'p>>,
}

impl Mr<'_> {
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.buf
    }

    /// The bytes, to fill. Only while no work request uses them.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf
    }

    /// Its address (what the peer puts in `remote_addr`).
    pub fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }

    /// Its local key.
    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { (*self.mr).lkey }
    }

    /// Its remote key.
    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop.
        unsafe { (*self.mr).rkey }
    }

    fn sge(&self, len: usize) -> ffi::ibv_sge {
        ffi::ibv_sge { addr: self.addr(), length: len.min(self.buf.len()) as u32, lkey: self.lkey() }
    }
}

impl Drop for Mr<'_> {
    fn drop(&mut self) {
        // SAFETY: registered by ibv_reg_mr; `buf` is freed only after this.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            eprintln!("gdrvm-verbs: ibv_dereg_mr: {}", errno_text(rc));
        }
    }
}

/// What the RTR transition needs of the peer.
#[derive(Debug, Clone, Copy)]
pub struct Remote {
    /// Its QP number.
    pub qpn: u32,
    /// The first PSN it sends.
    pub psn: u32,
    /// Its GID.
    pub gid: [u8; 16],
    /// Its LID (0 on RoCE).
    pub lid: u16,
}

/// A one-sided operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rdma {
    /// Local buffer → remote memory.
    Write,
    /// Remote memory → local buffer.
    Read,
}

/// An RC queue pair.
pub struct Qp<'r> {
    qp: *mut ffi::ibv_qp,
    _res: PhantomData<&'r ()>,
}

impl Qp<'_> {
    /// Its number.
    pub fn qpn(&self) -> u32 {
        // SAFETY: the QP is live until drop.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&mut self, attr: &mut ffi::ibv_qp_attr, mask: ffi::ibv_qp_attr_mask, what: &str) -> Result<(), String> {
        // SAFETY: the QP is live; `attr` is a valid attribute block for `mask`.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, attr, mask.0 as c_int) };
        if rc != 0 {
            return Err(format!("ibv_modify_qp to {what}: {}", errno_text(rc)));
        }
        Ok(())
    }

    /// RESET → INIT on [`PORT`], allowing the peer to write and read our buffers.
    pub fn init(&mut self) -> Result<(), String> {
        let access = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: access.0,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, mask, "INIT")
    }

    /// INIT → RTR → RTS towards `remote`, routed globally (RoCE needs the GRH) from our GID
    /// `gid_index`, with `path_mtu` (an `ibv_mtu`) and `sq_psn` as our first PSN.
    pub fn connect(&mut self, remote: &Remote, gid_index: u8, path_mtu: u32, sq_psn: u32) -> Result<(), String> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ah_attr: ffi::ibv_ah_attr {
                grh: ffi::ibv_global_route {
                    dgid: ffi::ibv_gid { raw: remote.gid },
                    flow_label: 0,
                    sgid_index: gid_index,
                    hop_limit: 64,
                    traffic_class: 0,
                },
                dlid: remote.lid,
                sl: 0,
                src_path_bits: 0,
                static_rate: 0,
                is_global: 1,
                port_num: PORT,
            },
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_AV
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, mask, "RTR")?;
        // Timeout 14: 4.096 µs * 2^14 = 67 ms per try, 7 tries: a peer that vanishes shows
        // as RETRY_EXC within about half a second, and emulated links have time to answer.
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            sq_psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 6,
            max_rd_atomic: 1,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask, "RTS")
    }

    /// Posts a receive of up to `len` bytes into `mr`.
    ///
    /// # Safety
    /// `mr` must not be touched nor dropped until this request's completion was polled.
    pub unsafe fn post_recv(&mut self, mr: &Mr<'_>, len: usize, wr_id: u64) -> Result<(), String> {
        let mut sge = mr.sge(len);
        let mut wr = ffi::ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
        // SAFETY: the QP is live, so is its context.
        let ctx = unsafe { (*self.qp).context };
        // SAFETY: the provider filled `ops` when the context opened.
        let post = unsafe { (*ctx).ops.post_recv }.ok_or("the provider has no post_recv")?;
        // SAFETY: `wr` and `sge` live across the call (the provider copies them); the buffer
        // stays registered and untouched as the caller promised.
        let rc = unsafe { post(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(format!("ibv_post_recv: {}", errno_text(rc)));
        }
        Ok(())
    }

    /// Posts a signaled SEND of the first `len` bytes of `mr`.
    ///
    /// # Safety
    /// As [`Qp::post_recv`].
    pub unsafe fn post_send(&mut self, mr: &Mr<'_>, len: usize, wr_id: u64) -> Result<(), String> {
        // SAFETY: forwarded from the caller.
        unsafe { self.post(mr, len, wr_id, ffi::ibv_wr_opcode::IBV_WR_SEND, None) }
    }

    /// Posts a signaled RDMA WRITE or READ of `len` bytes between `mr` and the peer's
    /// memory at `remote_addr` under `rkey`.
    ///
    /// # Safety
    /// As [`Qp::post_recv`].
    pub unsafe fn post_rdma(
        &mut self,
        op: Rdma,
        mr: &Mr<'_>,
        len: usize,
        remote_addr: u64,
        rkey: u32,
        wr_id: u64,
    ) -> Result<(), String> {
        let opcode = match op {
            Rdma::Write => ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            Rdma::Read => ffi::ibv_wr_opcode::IBV_WR_RDMA_READ,
        };
        // SAFETY: forwarded from the caller.
        unsafe { self.post(mr, len, wr_id, opcode, Some((remote_addr, rkey))) }
    }

    /// # Safety
    /// As [`Qp::post_recv`].
    unsafe fn post(
        &mut self,
        mr: &Mr<'_>,
        len: usize,
        wr_id: u64,
        opcode: ffi::ibv_wr_opcode::Type,
        remote: Option<(u64, u32)>,
    ) -> Result<(), String> {
        let mut sge = mr.sge(len);
        let mut wr = ffi::ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            __bindgen_anon_1: Default::default(),
            wr: Default::default(),
            qp_type: Default::default(),
            __bindgen_anon_2: Default::default(),
        };
        if let Some((remote_addr, rkey)) = remote {
            wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 { remote_addr, rkey };
        }
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live, so is its context.
        let ctx = unsafe { (*self.qp).context };
        // SAFETY: the provider filled `ops` when the context opened.
        let post = unsafe { (*ctx).ops.post_send }.ok_or("the provider has no post_send")?;
        // SAFETY: `wr` and `sge` live across the call (the provider copies them); the buffer
        // stays registered and untouched as the caller promised.
        let rc = unsafe { post(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            return Err(format!("ibv_post_send: {}", errno_text(rc)));
        }
        Ok(())
    }
}

impl Drop for Qp<'_> {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_qp and destroyed once.
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            eprintln!("gdrvm-verbs: ibv_destroy_qp: {}", errno_text(rc));
        }
    }
}

/// `enum ibv_mtu` → bytes.
pub fn mtu_bytes(mtu: u32) -> u32 {
    if (1..=5).contains(&mtu) {
        128 << mtu
    } else {
        0
    }
}

/// `enum ibv_port_state` by its enumerator's name (`PORT_ACTIVE` ...): libibverbs'
/// `ibv_port_state_str` says "active", so the names are spelled out here.
pub fn port_state_text(state: u32) -> String {
    match state {
        0 => "PORT_NOP".into(),
        1 => "PORT_DOWN".into(),
        2 => "PORT_INIT".into(),
        3 => "PORT_ARMED".into(),
        4 => "PORT_ACTIVE".into(),
        5 => "PORT_ACTIVE_DEFER".into(),
        other => format!("port state {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_mtu_codes() {
        assert_eq!(mtu_bytes(ffi::IBV_MTU_1024), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        assert_eq!(mtu_bytes(0), 0);
    }
}
