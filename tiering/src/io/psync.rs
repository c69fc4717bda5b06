//! The portable engine: `pread`/`pwrite` on a small thread pool, for kernels where io_uring is
//! disabled (or forbidden by a seccomp profile).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;
use tokio::sync::oneshot;

use super::{IoBuf, IoEngine, IoFailure, IoFuture, IoRequest, IoResult, check_request, completion_future, failed};

struct Op {
    req: IoRequest,
    done: oneshot::Sender<IoResult>,
}

/// `pread`/`pwrite` on `threads` threads: at most `threads` operations are in the kernel at once.
#[derive(Debug)]
pub struct PsyncEngine {
    tx: Option<Sender<Op>>,
    threads: Vec<JoinHandle<()>>,
    inflight: Arc<AtomicUsize>,
    files: usize,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.req.fmt(f)
    }
}

impl PsyncEngine {
    /// Starts `threads` I/O threads over `files`.
    pub fn new(files: &[Arc<File>], threads: usize) -> io::Result<Self> {
        let (tx, rx) = crossbeam_channel::unbounded::<Op>();
        let inflight = Arc::new(AtomicUsize::new(0));
        let files: Arc<[Arc<File>]> = files.into();
        let mut handles = Vec::new();
        for t in 0..threads.max(1) {
            let rx = rx.clone();
            let files = files.clone();
            let inflight = inflight.clone();
            handles.push(std::thread::Builder::new().name(format!("g3-psync-{t}")).spawn(move || {
                while let Ok(Op { mut req, done }) = rx.recv() {
                    let file = &files[req.target as usize];
                    let result = match &mut req.buf {
                        IoBuf::Read(slot) => file.read_exact_at(&mut slot.as_mut_slice()[..req.len], req.offset),
                        IoBuf::Write(slot) => file.write_all_at(&slot.as_slice()[..req.len], req.offset),
                    };
                    inflight.fetch_sub(1, Ordering::Relaxed);
                    let outcome = match result {
                        Ok(()) => Ok(req.buf),
                        Err(error) => Err(IoFailure { buf: Some(req.buf), error }),
                    };
                    let _ = done.send(outcome);
                }
            })?);
        }
        Ok(Self { tx: Some(tx), threads: handles, inflight, files: files.len() })
    }
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn submit(&self, req: IoRequest) -> IoFuture {
        if let Err(e) = check_request(&req, self.files) {
            return failed(req.buf, e);
        }
        let (done, rx) = oneshot::channel();
        self.inflight.fetch_add(1, Ordering::Relaxed);
        let tx = self.tx.as_ref().expect("sender lives until drop");
        if let Err(crossbeam_channel::SendError(op)) = tx.send(Op { req, done }) {
            self.inflight.fetch_sub(1, Ordering::Relaxed);
            return failed(op.req.buf, io::Error::other("psync threads have stopped"));
        }
        completion_future(rx)
    }

    fn in_flight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
