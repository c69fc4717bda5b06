//! The io_uring engine: one ring per dedicated thread, fixed files, and the G2 pool registered as
//! fixed buffers so that reads land in (and writes leave from) G2 slots with no copy and no per-I/O
//! page pinning.
//!
//! Submitters push requests on a channel and wake the ring thread through an eventfd only when it
//! is parked in the kernel (a Dekker-style flag keeps that to one syscall per sleep, not per I/O).
//! The ring thread keeps up to `queue_depth` operations in flight; each operation owns its buffer
//! in a slab until its completion arrives, so a caller that drops its future early can never free
//! memory the kernel is still writing.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{IoUring, opcode, squeue, types};
use tokio::sync::oneshot;

use super::{IoEngine, IoFailure, IoFuture, IoRequest, IoResult, check_request, completion_future, failed};
use crate::g2::HostPool;

/// How the io_uring engine is set up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringOptions {
    /// Operations in flight per ring thread.
    pub queue_depth: u32,
    /// Ring threads; requests are spread over them round-robin.
    pub threads: usize,
    /// Register the G2 pool as fixed buffers (falls back to plain reads/writes if the kernel refuses).
    pub register_buffers: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        Self { queue_depth: 32, threads: 1, register_buffers: true }
    }
}

struct Op {
    req: IoRequest,
    done: oneshot::Sender<IoResult>,
}

struct Wake {
    parked: AtomicBool,
    efd: OwnedFd,
}

impl Wake {
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.parked.swap(false, Ordering::SeqCst) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writing 8 bytes from a live stack buffer to an eventfd we own.
            let _ = unsafe { libc::write(self.efd.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }
}

struct Worker {
    tx: Option<Sender<Op>>,
    wake: Arc<Wake>,
    thread: Option<JoinHandle<()>>,
}

/// Where the registered pool lies, to turn a slot address into a fixed-buffer index.
#[derive(Clone, Copy, Debug)]
struct FixedBuffers {
    base: usize,
    chunk: usize,
}

/// The io_uring engine. Dropping it completes everything already submitted, then stops the threads.
#[derive(Debug)]
pub struct UringEngine {
    workers: Vec<Worker>,
    next: AtomicUsize,
    inflight: Arc<AtomicUsize>,
    files: usize,
    fixed_buffers: bool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").finish_non_exhaustive()
    }
}

/// Largest fixed buffer the kernel accepts.
const MAX_FIXED_BUFFER: usize = 1 << 30;
const WAKE_TOKEN: u64 = u64::MAX;

impl UringEngine {
    /// Starts the ring threads over `files`, registering `pool` as fixed buffers when asked.
    /// Fails if io_uring is unavailable (disabled by sysctl, seccomp, or an old kernel) — the
    /// caller then falls back to [`super::psync::PsyncEngine`].
    pub fn new(files: &[Arc<File>], pool: Option<&HostPool>, options: UringOptions) -> io::Result<Self> {
        let qd = options.queue_depth.clamp(1, 4096);
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        let mut workers = Vec::new();
        let inflight = Arc::new(AtomicUsize::new(0));
        let mut all_fixed = options.register_buffers && pool.is_some();
        for t in 0..options.threads.max(1) {
            let ring: IoUring = IoUring::builder().build((qd + 1).next_power_of_two())?;
            if !fds.is_empty() {
                ring.submitter().register_files(&fds)?;
            }
            let fixed = match pool.filter(|_| options.register_buffers) {
                Some(pool) => register_pool(&ring, pool),
                None => None,
            };
            all_fixed &= fixed.is_some();
            // SAFETY: eventfd with valid flags has no preconditions; the result is checked.
            let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
            if efd < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `efd` is a fresh descriptor that nothing else owns.
            let efd = unsafe { OwnedFd::from_raw_fd(efd) };
            let wake = Arc::new(Wake { parked: AtomicBool::new(false), efd });
            let (tx, rx) = crossbeam_channel::unbounded();
            let thread = {
                let wake = wake.clone();
                let inflight = inflight.clone();
                std::thread::Builder::new()
                    .name(format!("g3-uring-{t}"))
                    .spawn(move || RingLoop::new(ring, rx, wake, fixed, qd as usize, inflight).run())?
            };
            workers.push(Worker { tx: Some(tx), wake, thread: Some(thread) });
        }
        Ok(Self { workers, next: AtomicUsize::new(0), inflight, files: files.len(), fixed_buffers: all_fixed })
    }

    /// Whether every ring has the G2 pool registered as fixed buffers.
    pub fn uses_fixed_buffers(&self) -> bool {
        self.fixed_buffers
    }
}

fn register_pool(ring: &IoUring, pool: &HostPool) -> Option<FixedBuffers> {
    let (base, len) = pool.region();
    let slot = pool.slot_bytes();
    if slot > MAX_FIXED_BUFFER {
        return None;
    }
    let chunk = (MAX_FIXED_BUFFER / slot) * slot;
    let iovecs: Vec<libc::iovec> = (0..len.div_ceil(chunk))
        .map(|i| libc::iovec {
            // SAFETY: i * chunk < len, so the pointer stays inside the pool mapping.
            iov_base: unsafe { base.add(i * chunk) }.cast(),
            iov_len: chunk.min(len - i * chunk),
        })
        .collect();
    // SAFETY: every iovec describes memory of the pool mapping, which outlives the ring: the engine
    // is built from a `HostPool` handle and the store that owns both drops the engine first; slot
    // handles in flight keep the mapping alive too.
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => Some(FixedBuffers { base: base as usize, chunk }),
        Err(e) => {
            tracing::warn!(error = %e, bytes = len, "io_uring refused to register the G2 pool as fixed buffers; using plain reads and writes (raise the memlock limit to fix)");
            None
        }
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, req: IoRequest) -> IoFuture {
        if let Err(e) = check_request(&req, self.files) {
            return failed(req.buf, e);
        }
        let (done, rx) = oneshot::channel();
        let worker = &self.workers[self.next.fetch_add(1, Ordering::Relaxed) % self.workers.len()];
        self.inflight.fetch_add(1, Ordering::Relaxed);
        let tx = worker.tx.as_ref().expect("sender lives until drop");
        if let Err(crossbeam_channel::SendError(op)) = tx.send(Op { req, done }) {
            self.inflight.fetch_sub(1, Ordering::Relaxed);
            return failed(op.req.buf, io::Error::other("io_uring thread has stopped"));
        }
        worker.wake.notify();
        completion_future(rx)
    }

    fn in_flight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.tx.take();
            // Wake the thread so it sees the disconnect.
            w.wake.parked.store(true, Ordering::SeqCst);
            w.wake.notify();
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

struct RingLoop {
    ring: IoUring,
    rx: Receiver<Op>,
    wake: Arc<Wake>,
    fixed: Option<FixedBuffers>,
    qd: usize,
    inflight: Arc<AtomicUsize>,
    slab: Vec<Option<Op>>,
    free: Vec<usize>,
    pending: usize,
    efd_buf: Box<[u8; 8]>,
}

impl RingLoop {
    fn new(
        ring: IoUring,
        rx: Receiver<Op>,
        wake: Arc<Wake>,
        fixed: Option<FixedBuffers>,
        qd: usize,
        inflight: Arc<AtomicUsize>,
    ) -> Self {
        Self {
            ring,
            rx,
            wake,
            fixed,
            qd,
            inflight,
            slab: (0..qd).map(|_| None).collect(),
            free: (0..qd).rev().collect(),
            pending: 0,
            efd_buf: Box::new([0u8; 8]),
        }
    }

    fn arm_wake(&mut self) {
        let entry = opcode::Read::new(types::Fd(self.wake.efd.as_raw_fd()), self.efd_buf.as_mut_ptr(), 8)
            .build()
            .user_data(WAKE_TOKEN);
        self.push(entry);
    }

    fn push(&mut self, entry: squeue::Entry) {
        loop {
            // SAFETY: every buffer named by an entry is owned by `self` (the eventfd buffer) or by
            // an `Op` parked in `self.slab` until its completion is reaped, so it outlives the I/O.
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                return;
            }
            // The submission queue is full (it holds qd + 1 entries at most, so this is rare).
            let _ = self.ring.submit();
        }
    }

    fn run(mut self) {
        self.arm_wake();
        let mut closed = false;
        loop {
            while !closed && self.pending < self.qd {
                match self.rx.try_recv() {
                    Ok(op) => self.start(op),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => closed = true,
                }
            }
            if closed && self.pending == 0 {
                return;
            }
            if !closed && self.pending < self.qd {
                self.wake.parked.store(true, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                if !self.rx.is_empty() {
                    self.wake.parked.store(false, Ordering::SeqCst);
                    let _ = self.ring.submit();
                    continue;
                }
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
                Err(e) => {
                    tracing::error!(error = %e, "io_uring submit failed; retrying");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            self.wake.parked.store(false, Ordering::SeqCst);
            let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (token, result) in done {
                if token == WAKE_TOKEN {
                    self.arm_wake();
                } else {
                    self.finish(token as usize, result);
                }
            }
        }
    }

    fn start(&mut self, mut op: Op) {
        let idx = self.free.pop().expect("pending < qd leaves a free slot");
        let fd = types::Fixed(op.req.target);
        let len = op.req.len as u32;
        let ptr = op.req.buf.raw();
        let (base, offset) = op.req.buf.pool_offset();
        let fixed_index = self.fixed.filter(|f| f.base == base).map(|f| (offset / f.chunk) as u16);
        let entry = match (op.req.buf.is_read(), fixed_index) {
            (true, Some(i)) => opcode::ReadFixed::new(fd, ptr, len, i).offset(op.req.offset).build(),
            (true, None) => opcode::Read::new(fd, ptr, len).offset(op.req.offset).build(),
            (false, Some(i)) => opcode::WriteFixed::new(fd, ptr, len, i).offset(op.req.offset).build(),
            (false, None) => opcode::Write::new(fd, ptr, len).offset(op.req.offset).build(),
        }
        .user_data(idx as u64);
        self.slab[idx] = Some(op);
        self.pending += 1;
        self.push(entry);
    }

    fn finish(&mut self, idx: usize, result: i32) {
        let op = self.slab[idx].take().expect("completion for a live operation");
        self.free.push(idx);
        self.pending -= 1;
        self.inflight.fetch_sub(1, Ordering::Relaxed);
        let Op { req, done } = op;
        let outcome = if result < 0 {
            Err(IoFailure { buf: Some(req.buf), error: io::Error::from_raw_os_error(-result) })
        } else if result as usize != req.len {
            let kind = if req.buf.is_read() { io::ErrorKind::UnexpectedEof } else { io::ErrorKind::WriteZero };
            let error = io::Error::new(kind, format!("short transfer: {result} of {} bytes", req.len));
            Err(IoFailure { buf: Some(req.buf), error })
        } else {
            Ok(req.buf)
        };
        // A dropped receiver means the caller gave up: the buffer is released here, after the kernel.
        let _ = done.send(outcome);
    }
}
