//! The RDMA transport of G4 (feature `rdma`; libibverbs through `rdma-sys`).
//!
//! [`RdmaNode`] opens a device once, registers this node's whole G2 pool as one memory region
//! (readable by peers, so they read held images from it; writable locally, so reads land in it)
//! and polls one completion queue on a thread of its own. An RDMA lane is an authenticated TCP
//! connection, which carries holds and releases, plus a reliable-connected queue pair. The two
//! queue pairs' endpoints and the serving side's remote key travel only on that connection,
//! after the handshake. A hold on such a lane is answered with where each held image lies
//! ([`super::wire::Message::HoldAt`]); the lane posts one RDMA read per image, straight into a
//! fresh local G2 slot, and verifies what landed before anyone sees it.
//!
//! - **Memory safety.** The slot a read lands in belongs to the completion table until the NIC
//!   reports the read done or flushed. A fetch cancelled at its deadline therefore never returns
//!   a slot to the pool while a read may still write into it. A queue pair that closes with reads
//!   in flight is moved to the error state and destroyed only once they are flushed; a read the
//!   NIC never reports leaks its slot rather than risk it.
//! - **Data safety.** A serving node may reuse a slot after its hold ran out. An image read from
//!   it then fails verification and is dropped, like any corrupt image.
//! - **Exposure.** The remote key lets the peer's queue pair read any byte of the serving node's
//!   G2 while the connection lasts, not only the held slots. (Memory windows bound to each hold
//!   would narrow that on NICs that have them.) Readers verify every image, but the serving side
//!   trusts the fabric: RDMA is for trusted fabrics, as `integrity = "checksum"` is.

use std::collections::HashMap;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use rdma_sys as ib;
use tokio::sync::oneshot;

use super::auth::PeerIdentity;
use super::tcp::{FetchedSlot, Held, PeerClient, PeerError};
use super::transport::{Accepted, Lane, OnFetched, RdmaOptions, RdmaUnavailable, RemoteAccess, SlotAlloc, Transport};
use super::wire::{HeldBlock, RdmaEndpoint};
use crate::block::{BlockHash, ImageError, verify_image};
use crate::g2::{HostPool, SlotMut};

/// The port every queue pair uses.
const PORT: u8 = 1;
/// Reads a lane posts before it waits for them; also the depth of each queue pair's send queue.
const WINDOW: usize = 64;
/// Entries of the node's completion queue: many lanes' windows.
const CQ_DEPTH: i32 = 8192;
/// How long a closing queue pair waits for its reads to be flushed.
const FLUSH_WAIT: Duration = Duration::from_secs(2);

/// The outcome of one read: the slot back, or the NIC's reason.
type ReadDone = Result<SlotMut, String>;

/// A read the NIC has not reported yet, and the slot it lands in (owned here until it has).
struct InFlight {
    qp_num: u32,
    slot: SlotMut,
    done: oneshot::Sender<ReadDone>,
}

/// The verbs objects of a node, freed in reverse order of creation.
struct Verbs {
    ctx: *mut ib::ibv_context,
    pd: *mut ib::ibv_pd,
    mr: *mut ib::ibv_mr,
    cq: *mut ib::ibv_cq,
}

// SAFETY: libibverbs objects may be used from any thread; every verb this module calls on them
// is thread-safe (rdma-core's documented guarantee), and the pointers are freed only in `drop`.
unsafe impl Send for Verbs {}
// SAFETY: as above.
unsafe impl Sync for Verbs {}

impl Drop for Verbs {
    fn drop(&mut self) {
        // Each pointer is either null or a live object this struct created; each is freed once, in
        // the reverse order of creation, after every queue pair and the poller are gone (they hold
        // the node, which owns this).
        if !self.cq.is_null() {
            // SAFETY: see above.
            unsafe { ib::ibv_destroy_cq(self.cq) };
        }
        if !self.mr.is_null() {
            // SAFETY: see above.
            unsafe { ib::ibv_dereg_mr(self.mr) };
        }
        if !self.pd.is_null() {
            // SAFETY: see above.
            unsafe { ib::ibv_dealloc_pd(self.pd) };
        }
        if !self.ctx.is_null() {
            // SAFETY: see above.
            unsafe { ib::ibv_close_device(self.ctx) };
        }
    }
}

/// A completion queue pointer the poller thread may hold.
struct CqPtr(*mut ib::ibv_cq);
// SAFETY: polling a CQ from one thread while others post to queue pairs is what verbs allow.
unsafe impl Send for CqPtr {}

/// A node's RDMA: its device, its registered G2 and its completion queue.
pub struct RdmaNode {
    verbs: Verbs,
    /// Itself, for the queue pairs it hands out.
    me: Weak<RdmaNode>,
    device: String,
    gid_index: u8,
    lid: u16,
    gid: [u8; 16],
    mtu: ib::ibv_mtu::Type,
    /// Reads in flight per queue pair, each way (bounded by the device).
    rd_atomic: u8,
    /// The registered region: G2's base address and length.
    region: (usize, usize),
    /// Keeps the registered mapping alive until the region is deregistered (`verbs` drops first).
    _pool: HostPool,
    in_flight: Arc<Mutex<HashMap<u64, InFlight>>>,
    next_wr: AtomicU64,
    stop: Arc<AtomicBool>,
    poller: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for RdmaNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaNode").field("device", &self.device).field("region_bytes", &self.region.1).finish()
    }
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl RdmaNode {
    /// Opens the device `options` names (the first one by default), registers `pool` (this
    /// node's G2, kept mapped as long as the node lives) and starts polling. A machine without
    /// RDMA devices gets [`RdmaUnavailable::NoDevice`]: its links use TCP.
    pub fn open(pool: &HostPool, options: &RdmaOptions) -> Result<Arc<Self>, RdmaUnavailable> {
        let region = pool.region();
        let mut verbs = Verbs {
            ctx: std::ptr::null_mut(),
            pd: std::ptr::null_mut(),
            mr: std::ptr::null_mut(),
            cq: std::ptr::null_mut(),
        };
        let mut count = 0;
        // SAFETY: `count` is a valid out-pointer; the list is freed below, after the device is opened.
        let list = unsafe { ib::ibv_get_device_list(&mut count) };
        if list.is_null() || count <= 0 {
            if !list.is_null() {
                // SAFETY: a list ibv_get_device_list returned, freed once.
                unsafe { ib::ibv_free_device_list(list) };
            }
            return Err(RdmaUnavailable::NoDevice(String::new()));
        }
        // SAFETY: the list holds `count` valid device pointers until it is freed.
        let devices = unsafe { std::slice::from_raw_parts(list, count as usize) };
        let name_of = |d: *mut ib::ibv_device| {
            // SAFETY: `d` is a device of the live list.
            let name = unsafe { ib::ibv_get_device_name(d) };
            // SAFETY: a device's name is a NUL-terminated string it owns while the list lives.
            unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
        };
        let picked = devices.iter().copied().find(|&d| options.device.as_deref().is_none_or(|want| name_of(d) == want));
        let device = picked.map(name_of);
        if let Some(d) = picked {
            // SAFETY: a device of the live list; the context it returns outlives the list.
            verbs.ctx = unsafe { ib::ibv_open_device(d) };
        }
        // SAFETY: the list ibv_get_device_list returned, freed once; opened contexts stay valid.
        unsafe { ib::ibv_free_device_list(list) };
        let Some(device) = device else {
            return Err(RdmaUnavailable::NoDevice(format!(" named {:?}", options.device.as_deref().unwrap_or(""))));
        };
        if verbs.ctx.is_null() {
            return Err(RdmaUnavailable::Setup(os_error(&format!("opening {device}"))));
        }

        // SAFETY: zeroed attribute structs are valid inputs (plain integers); the context is live.
        let mut port: ib::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `port` is a valid out-pointer of the size the call expects.
        if unsafe { ib::___ibv_query_port(verbs.ctx, PORT, &mut port) } != 0 {
            return Err(RdmaUnavailable::Setup(os_error(&format!("querying {device} port {PORT}"))));
        }
        if port.state != ib::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaUnavailable::Setup(format!("{device} port {PORT} is not active")));
        }
        // SAFETY: a zeroed union of bytes is valid; the context is live and `gid` a valid out-pointer.
        let mut gid: ib::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { ib::ibv_query_gid(verbs.ctx, PORT, options.gid_index.into(), &mut gid) } != 0 {
            return Err(RdmaUnavailable::Setup(os_error(&format!("querying {device} GID {}", options.gid_index))));
        }
        // SAFETY: as for the port.
        let mut device_attr: ib::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is live and `device_attr` a valid out-pointer.
        if unsafe { ib::ibv_query_device(verbs.ctx, &mut device_attr) } != 0 {
            return Err(RdmaUnavailable::Setup(os_error(&format!("querying {device}"))));
        }
        let rd_atomic = device_attr.max_qp_rd_atom.min(device_attr.max_qp_init_rd_atom).clamp(1, 16) as u8;

        // SAFETY: the context is live.
        verbs.pd = unsafe { ib::ibv_alloc_pd(verbs.ctx) };
        if verbs.pd.is_null() {
            return Err(RdmaUnavailable::Setup(os_error("allocating a protection domain")));
        }
        let access = ib::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | ib::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
        // SAFETY: the region is the pool's mapping, which the node keeps alive (it holds the pool)
        // until after the region is deregistered; registering it pins its pages.
        verbs.mr = unsafe { ib::ibv_reg_mr(verbs.pd, region.0.cast(), region.1, access as i32) };
        if verbs.mr.is_null() {
            return Err(RdmaUnavailable::Setup(os_error(&format!("registering {} bytes of G2", region.1))));
        }
        // SAFETY: the context is live; no completion channel (the queue is polled).
        verbs.cq = unsafe { ib::ibv_create_cq(verbs.ctx, CQ_DEPTH, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if verbs.cq.is_null() {
            return Err(RdmaUnavailable::Setup(os_error("creating a completion queue")));
        }

        let in_flight = Arc::new(Mutex::new(HashMap::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let poller = {
            let (cq, in_flight, stop) = (CqPtr(verbs.cq), in_flight.clone(), stop.clone());
            std::thread::Builder::new()
                .name("g4-rdma-cq".into())
                .spawn(move || poll_completions(cq, &in_flight, &stop))
                .map_err(|e| RdmaUnavailable::Setup(format!("starting the completion poller: {e}")))?
        };
        // SAFETY: reading the raw bytes of a union whose every bit pattern is valid.
        let gid = unsafe { gid.raw };
        tracing::info!(device, lid = port.lid, "G4 RDMA ready on {device}: {} bytes of G2 registered", region.1);
        Ok(Arc::new_cyclic(|me| RdmaNode {
            verbs,
            me: me.clone(),
            device,
            gid_index: options.gid_index,
            lid: port.lid,
            gid,
            mtu: port.active_mtu,
            rd_atomic,
            region: (region.0 as usize, region.1),
            _pool: pool.clone(),
            in_flight,
            next_wr: AtomicU64::new(1),
            stop,
            poller: Mutex::new(Some(poller)),
        }))
    }

    /// The device's name.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Turns an authenticated connection into an RDMA lane if the peer accepts; otherwise (or if
    /// this side's queue pair cannot be set up) the connection stays a TCP lane.
    pub async fn connect_lane(self: &Arc<Self>, mut client: PeerClient) -> Result<Box<dyn Lane>, PeerError> {
        let qp = match QueuePair::create(self, false) {
            Ok(qp) => qp,
            Err(e) => {
                tracing::warn!("G4 RDMA: {e}; this lane uses TCP");
                return Ok(Box::new(client));
            }
        };
        match client.rdma_connect(qp.endpoint()).await? {
            Ok((remote, rkey)) => match qp.connect(&remote) {
                Ok(()) => Ok(Box::new(RdmaLane { control: client, qp, rkey, holds: HashMap::new() })),
                Err(e) => {
                    tracing::warn!("G4 RDMA: connecting to {}: {e}; this lane uses TCP", client.peer().node);
                    Ok(Box::new(client))
                }
            },
            Err(text) => {
                tracing::debug!("G4 RDMA: {} declined ({text}); this lane uses TCP", client.peer().node);
                Ok(Box::new(client))
            }
        }
    }

    fn cq(&self) -> *mut ib::ibv_cq {
        self.verbs.cq
    }

    fn key(&self) -> (u32, u32) {
        // SAFETY: the region is registered for the node's lifetime.
        let mr = unsafe { &*self.verbs.mr };
        (mr.lkey, mr.rkey)
    }
}

impl Drop for RdmaNode {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(poller) = self.poller.lock().take() {
            let _ = poller.join();
        }
        // Anything still in the table was never reported: its slots are leaked, not reused.
        for (_, read) in self.in_flight.lock().drain() {
            std::mem::forget(read.slot);
        }
    }
}

impl RemoteAccess for RdmaNode {
    fn accept(&self, peer: &RdmaEndpoint) -> Result<Accepted, String> {
        let me = self.me.upgrade().ok_or("the node is closing")?;
        let qp = QueuePair::create(&me, true)?;
        qp.connect(peer)?;
        Ok(Accepted { endpoint: qp.endpoint(), rkey: self.key().1, keep: Box::new(qp) })
    }

    fn place(&self, image: &[u8]) -> Option<u64> {
        let (base, len) = self.region;
        let start = image.as_ptr() as usize;
        (start >= base && start + image.len() <= base + len).then_some(start as u64)
    }
}

/// Reports each completion to the read that waits for it, until told to stop.
fn poll_completions(cq: CqPtr, in_flight: &Mutex<HashMap<u64, InFlight>>, stop: &AtomicBool) {
    // SAFETY: a zeroed work completion is valid (integers and a union of integers).
    let mut wcs: Vec<ib::ibv_wc> = (0..64).map(|_| unsafe { std::mem::zeroed() }).collect();
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: the queue lives until the node's drop, which joins this thread first; `wcs` has
        // room for as many completions as asked.
        let n = unsafe { ib::ibv_poll_cq(cq.0, wcs.len() as i32, wcs.as_mut_ptr()) };
        if n <= 0 {
            if n < 0 {
                tracing::error!("G4 RDMA: polling the completion queue failed ({n})");
            }
            idle = idle.saturating_add(1);
            if idle < 256 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
            continue;
        }
        idle = 0;
        let mut table = in_flight.lock();
        for wc in &wcs[..n as usize] {
            let Some(read) = table.remove(&wc.wr_id) else { continue };
            let outcome = if wc.status == ib::ibv_wc_status::IBV_WC_SUCCESS {
                Ok(read.slot)
            } else {
                // SAFETY: defined for any status value.
                let why = unsafe { ib::ibv_wc_status_str(wc.status) };
                // SAFETY: it returns a static NUL-terminated string.
                let why = unsafe { CStr::from_ptr(why) };
                Err(why.to_string_lossy().into_owned())
            };
            // A fetch that was cancelled dropped its receiver: the slot goes back to the pool
            // here, now that the NIC is done with it.
            let _ = read.done.send(outcome);
        }
    }
}

/// A reliable-connected queue pair on the node's device.
struct QueuePair {
    node: Arc<RdmaNode>,
    qp: *mut ib::ibv_qp,
    psn: u32,
}

// SAFETY: see `Verbs`; posting to one queue pair is serialized by `&mut` on its lane.
unsafe impl Send for QueuePair {}
// SAFETY: as above; shared references only read the queue pair's number.
unsafe impl Sync for QueuePair {}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair").field("qpn", &self.qpn()).finish()
    }
}

impl QueuePair {
    /// A queue pair in the INIT state; `remote_read` lets its peer read the registered region
    /// (the serving side's), otherwise the peer may do nothing to this node's memory.
    fn create(node: &Arc<RdmaNode>, remote_read: bool) -> Result<Self, String> {
        // SAFETY: a zeroed init struct is valid (null pointers, zero counts) before it is filled.
        let mut init: ib::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = node.cq();
        init.recv_cq = node.cq();
        init.qp_type = ib::ibv_qp_type::IBV_QPT_RC;
        init.cap = ib::ibv_qp_cap {
            max_send_wr: WINDOW as u32,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut psn = [0u8; 4];
        getrandom::fill(&mut psn).map_err(|e| format!("drawing a packet sequence number: {e}"))?;
        // SAFETY: the protection domain is live; `init` is fully initialized.
        let qp = unsafe { ib::ibv_create_qp(node.verbs.pd, &mut init) };
        if qp.is_null() {
            return Err(os_error("creating a queue pair"));
        }
        let this = QueuePair { node: node.clone(), qp, psn: u32::from_le_bytes(psn) & 0x00ff_ffff };
        // SAFETY: a zeroed attribute struct is valid; only the masked fields are read.
        let mut attr: ib::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ib::ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = PORT;
        attr.qp_access_flags = if remote_read { ib::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 } else { 0 };
        use ib::ibv_qp_attr_mask as m;
        this.modify(
            &mut attr,
            m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0,
            "INIT",
        )?;
        Ok(this)
    }

    fn qpn(&self) -> u32 {
        // SAFETY: the queue pair is live until drop.
        unsafe { (*self.qp).qp_num }
    }

    fn endpoint(&self) -> RdmaEndpoint {
        RdmaEndpoint {
            lid: self.node.lid,
            gid: self.node.gid,
            qpn: self.qpn(),
            psn: self.psn,
            mtu: self.node.mtu as u8,
            rd_atomic: self.node.rd_atomic,
        }
    }

    fn modify(&self, attr: &mut ib::ibv_qp_attr, mask: u32, state: &str) -> Result<(), String> {
        // SAFETY: the queue pair is live; `attr` is initialized for every field in `mask`.
        let rc = unsafe { ib::ibv_modify_qp(self.qp, attr, mask as i32) };
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("moving a queue pair to {state}: {}", std::io::Error::from_raw_os_error(rc)))
        }
    }

    /// Connects to the peer's queue pair: ready to receive, then ready to send.
    fn connect(&self, remote: &RdmaEndpoint) -> Result<(), String> {
        use ib::ibv_qp_attr_mask as m;
        // SAFETY: as in `create`.
        let mut attr: ib::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ib::ibv_qp_state::IBV_QPS_RTR;
        // Both ends must agree: the smaller MTU, and no more reads in flight than either allows.
        attr.path_mtu = self.node.mtu.min(remote.mtu.clamp(1, 5).into());
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = self.node.rd_atomic.min(remote.rd_atomic).max(1);
        attr.min_rnr_timer = 12;
        attr.ah_attr.is_global = 1;
        attr.ah_attr.grh.dgid = ib::ibv_gid { raw: remote.gid };
        attr.ah_attr.grh.sgid_index = self.node.gid_index;
        attr.ah_attr.grh.hop_limit = 64;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = PORT;
        self.modify(
            &mut attr,
            m::IBV_QP_STATE.0
                | m::IBV_QP_AV.0
                | m::IBV_QP_PATH_MTU.0
                | m::IBV_QP_DEST_QPN.0
                | m::IBV_QP_RQ_PSN.0
                | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | m::IBV_QP_MIN_RNR_TIMER.0,
            "RTR",
        )?;
        // SAFETY: as in `create`.
        let mut attr: ib::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ib::ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = self.node.rd_atomic.min(remote.rd_atomic).max(1);
        self.modify(
            &mut attr,
            m::IBV_QP_STATE.0
                | m::IBV_QP_TIMEOUT.0
                | m::IBV_QP_RETRY_CNT.0
                | m::IBV_QP_RNR_RETRY.0
                | m::IBV_QP_SQ_PSN.0
                | m::IBV_QP_MAX_QP_RD_ATOMIC.0,
            "RTS",
        )
    }

    /// Posts a read of `len` bytes at the peer's `remote_addr` into `slot`; the slot comes back
    /// through the receiver once the NIC has finished with it.
    fn post_read(
        &mut self,
        mut slot: SlotMut,
        remote_addr: u64,
        rkey: u32,
        len: u32,
    ) -> Result<oneshot::Receiver<ReadDone>, String> {
        let local = slot.as_mut_ptr() as u64;
        // The landing bytes must lie inside the slot and the registered region: a longer read
        // would write over the next slot.
        let (base, region_len) = self.node.region;
        if len as usize > slot.as_mut_slice().len()
            || (local as usize) < base
            || local as usize + len as usize > base + region_len
        {
            return Err(format!("an image of {len} bytes does not fit its landing slot"));
        }
        let wr_id = self.node.next_wr.fetch_add(1, Ordering::Relaxed);
        let (done, rx) = oneshot::channel();
        {
            // Into the table before the post: the completion may come before the post returns.
            // The table holds every read not yet reported, across all queue pairs (closing ones
            // included): one more than the completion queue holds would overrun it.
            let mut table = self.node.in_flight.lock();
            if table.len() >= CQ_DEPTH as usize {
                return Err(format!("{CQ_DEPTH} RDMA reads in flight: the completion queue is full"));
            }
            table.insert(wr_id, InFlight { qp_num: self.qpn(), slot, done });
        }
        let mut sge = ib::ibv_sge { addr: local, length: len, lkey: self.node.key().0 };
        // SAFETY: a zeroed work request is valid (null pointers, zero counts) before it is filled.
        let mut wr: ib::ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ib::ibv_wr_opcode::IBV_WR_RDMA_READ;
        wr.send_flags = ib::ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.rdma = ib::rdma_t { remote_addr, rkey };
        let mut bad: *mut ib::ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the queue pair is live and in RTS; `wr` and `sge` outlive the call (the provider
        // copies them into its send queue); the landing bytes were checked above to lie inside a
        // slot of the registered region, and the slot stays owned by the completion table until
        // the NIC reports this read.
        let post = {
            // SAFETY: the queue pair is live until drop.
            let context = unsafe { (*self.qp).context };
            // SAFETY: so is its device context.
            unsafe { (*context).ops.post_send }
        };
        let Some(post) = post else {
            self.node.in_flight.lock().remove(&wr_id);
            return Err("the RDMA provider cannot post sends".into());
        };
        // SAFETY: see above.
        let rc = unsafe { post(self.qp, &mut wr, &mut bad) };
        if rc != 0 {
            // Not posted: the slot is free to go.
            self.node.in_flight.lock().remove(&wr_id);
            return Err(format!("posting an RDMA read: {}", std::io::Error::from_raw_os_error(rc)));
        }
        Ok(rx)
    }
}

/// A queue pair pointer the closing thread may hold.
struct QpPtr(*mut ib::ibv_qp);
// SAFETY: destroying a queue pair from another thread is allowed once nothing posts to it.
unsafe impl Send for QpPtr {}

impl Drop for QueuePair {
    fn drop(&mut self) {
        use ib::ibv_qp_attr_mask as m;
        // The error state flushes every read still queued; each is then reported as flushed.
        // SAFETY: as in `create`.
        let mut attr: ib::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ib::ibv_qp_state::IBV_QPS_ERR;
        let _ = self.modify(&mut attr, m::IBV_QP_STATE.0, "ERR");
        let (qp, qpn, node) = (QpPtr(self.qp), self.qpn(), self.node.clone());
        let close = move || {
            let qp = qp;
            let started = Instant::now();
            while node.in_flight.lock().values().any(|r| r.qp_num == qpn) && started.elapsed() < FLUSH_WAIT {
                std::thread::sleep(Duration::from_millis(1));
            }
            let mut table = node.in_flight.lock();
            let unreported: Vec<u64> = table.iter().filter(|(_, r)| r.qp_num == qpn).map(|(&id, _)| id).collect();
            if !unreported.is_empty() {
                tracing::error!(qpn, reads = unreported.len(), "G4 RDMA: reads never reported; their slots are leaked");
            }
            for id in unreported {
                if let Some(read) = table.remove(&id) {
                    std::mem::forget(read.slot);
                }
            }
            drop(table);
            // SAFETY: nothing posts to it any more and its reads are reported or leaked.
            unsafe { ib::ibv_destroy_qp(qp.0) };
        };
        if self.node.in_flight.lock().values().any(|r| r.qp_num == qpn) {
            // Reads in flight: wait for their flush off the caller's thread.
            // If no thread can be had, wait here: a queue pair must not outlive its node's verbs.
            let close = std::sync::Arc::new(parking_lot::Mutex::new(Some(close)));
            let on_thread = close.clone();
            let spawned = std::thread::Builder::new()
                .name("g4-rdma-close".into())
                .spawn(move || on_thread.lock().take().map_or((), |close| close()));
            if spawned.is_err()
                && let Some(close) = close.lock().take()
            {
                close();
            }
        } else {
            close();
        }
    }
}

/// A lane whose images come by RDMA reads; holds and releases go on its TCP connection.
#[derive(Debug)]
struct RdmaLane {
    control: PeerClient,
    qp: QueuePair,
    rkey: u32,
    /// Where each open hold's images lie.
    holds: HashMap<u64, HashMap<BlockHash, (u64, u32)>>,
}

/// One block of a window of reads.
enum Posted {
    Reading(oneshot::Receiver<ReadDone>, u32),
    Missing,
    NoRoom,
    TooLong,
}

impl Lane for RdmaLane {
    fn transport(&self) -> Transport {
        Transport::Rdma
    }

    fn peer(&self) -> &PeerIdentity {
        self.control.peer()
    }

    fn hold<'a>(&'a mut self, hashes: &'a [BlockHash], ttl: Duration) -> BoxFuture<'a, Result<Held, PeerError>> {
        Box::pin(async move {
            let (hold_id, ttl, places) = self.control.hold_at(hashes, ttl).await?;
            let blocks =
                places.iter().map(|p| HeldBlock { hash: p.hash, image_len: p.place.map(|(_, len)| len) }).collect();
            self.holds.insert(hold_id, places.iter().filter_map(|p| p.place.map(|place| (p.hash, place))).collect());
            Ok(Held { hold_id, ttl, blocks })
        })
    }

    fn fetch_into<'a>(
        &'a mut self,
        hold_id: u64,
        hashes: &'a [BlockHash],
        alloc: SlotAlloc<'a>,
        each: OnFetched<'a>,
    ) -> BoxFuture<'a, Result<(), PeerError>> {
        Box::pin(async move {
            let places = self.holds.get(&hold_id).ok_or(PeerError::Unexpected("a fetch of an unknown hold"))?;
            for window in hashes.chunks(WINDOW) {
                let mut posted = Vec::with_capacity(window.len());
                for &hash in window {
                    let Some(&(addr, len)) = places.get(&hash) else {
                        posted.push((hash, Posted::Missing));
                        continue;
                    };
                    let Some(mut slot) = alloc() else {
                        posted.push((hash, Posted::NoRoom));
                        continue;
                    };
                    if len as usize > slot.as_mut_slice().len() {
                        // Never read past the slot: an image this size is not one of this layout's.
                        posted.push((hash, Posted::TooLong));
                        continue;
                    }
                    let rx = self.qp.post_read(slot, addr, self.rkey, len).map_err(PeerError::Rdma)?;
                    posted.push((hash, Posted::Reading(rx, len)));
                }
                for (hash, p) in posted {
                    let fetched = match p {
                        Posted::Missing => FetchedSlot::Missing,
                        Posted::NoRoom => FetchedSlot::NoRoom,
                        Posted::TooLong => FetchedSlot::Rejected(ImageError::Malformed("image longer than a slot")),
                        Posted::Reading(rx, len) => {
                            let slot = rx
                                .await
                                .map_err(|_| PeerError::Rdma("the completion poller stopped".into()))?
                                .map_err(PeerError::Rdma)?;
                            let len = len as usize;
                            match verify_image(&slot.as_slice()[..len], hash) {
                                Ok(_) => FetchedSlot::Verified { slot, len },
                                Err(e) => FetchedSlot::Rejected(e),
                            }
                        }
                    };
                    each(hash, fetched);
                }
            }
            Ok(())
        })
    }

    fn release(&mut self, hold_id: u64) -> BoxFuture<'_, Result<(), PeerError>> {
        self.holds.remove(&hold_id);
        Box::pin(self.control.release(hold_id))
    }
}
