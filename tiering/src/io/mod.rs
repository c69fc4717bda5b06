//! I/O engines: how block images move between G2 slots and G3 files.
//!
//! One small trait, [`IoEngine`], whose futures own their buffer while the kernel uses it and hand
//! it back with the result — exactly what io_uring needs, and what makes cancellation safe: dropping
//! the future parks the buffer in the engine until the kernel is done with it.
//!
//! Engines:
//! - [`uring::UringEngine`] — the hot path: io_uring on dedicated threads, files and the G2 pool
//!   registered (fixed files, fixed buffers), a configurable queue depth;
//! - [`psync::PsyncEngine`] — portable `pread`/`pwrite` on a thread pool, for kernels where
//!   io_uring is disabled;
//! - [`faulty::FaultyEngine`] — wraps another engine and injects latency, errors and corruption;
//! - [`sim::SimulatedIo`] — moves no bytes and takes the time a calibrated disk would, for running
//!   the tiers' real bookkeeping in virtual time.

pub mod aligned;
pub mod faulty;
pub mod psync;
pub mod sim;
pub mod uring;

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;

use crate::g2::{SlotMut, SlotRef};

/// The buffer of an I/O: a writable G2 slot to read into, or a shared one to write from.
#[derive(Debug)]
pub enum IoBuf {
    /// Destination of a read.
    Read(SlotMut),
    /// Source of a write.
    Write(SlotRef),
}

impl IoBuf {
    /// Whether this is a read.
    pub fn is_read(&self) -> bool {
        matches!(self, IoBuf::Read(_))
    }

    /// The pool base address and the slot's offset in it.
    pub fn pool_offset(&self) -> (usize, usize) {
        match self {
            IoBuf::Read(s) => s.pool_offset(),
            IoBuf::Write(s) => s.pool_offset(),
        }
    }

    /// The read destination, when this is a read.
    pub fn into_read(self) -> Option<SlotMut> {
        match self {
            IoBuf::Read(s) => Some(s),
            IoBuf::Write(_) => None,
        }
    }

    pub(crate) fn raw(&mut self) -> *mut u8 {
        match self {
            IoBuf::Read(s) => s.as_mut_ptr(),
            // Only ever handed to write syscalls, which do not write through it.
            IoBuf::Write(s) => s.as_ptr().cast_mut(),
        }
    }
}

/// One transfer of `len` bytes between a buffer and file `target` at `offset`.
/// `len` and `offset` are multiples of 4096 (O_DIRECT).
#[derive(Debug)]
pub struct IoRequest {
    /// Index of the file in the engine's file table.
    pub target: u32,
    /// Byte offset in that file.
    pub offset: u64,
    /// Bytes to transfer (≤ the slot size).
    pub len: usize,
    /// The buffer, owned by the operation until it completes.
    pub buf: IoBuf,
}

/// A failed I/O: the error, and the buffer back unless the engine itself died.
#[derive(Debug)]
pub struct IoFailure {
    /// The buffer, returned to the caller.
    pub buf: Option<IoBuf>,
    /// What went wrong.
    pub error: io::Error,
}

/// The outcome of an I/O: the buffer back on success, or the failure.
pub type IoResult = Result<IoBuf, IoFailure>;

/// The future of one submitted I/O.
pub type IoFuture = Pin<Box<dyn Future<Output = IoResult> + Send + 'static>>;

/// Moves bytes between G2 slots and G3 files.
///
/// Contract: `submit` never blocks on the device; the returned future completes once the whole
/// transfer is done or has failed (a short transfer is a failure). The engine owns the buffer in
/// between; if the future is dropped early, the engine keeps the buffer until the kernel has
/// finished with it and then releases it.
pub trait IoEngine: Send + Sync + fmt::Debug + 'static {
    /// A short name for logs and metrics ("uring", "psync", …).
    fn name(&self) -> &'static str;

    /// Starts one I/O.
    fn submit(&self, req: IoRequest) -> IoFuture;

    /// Operations submitted and not yet completed.
    fn in_flight(&self) -> usize;
}

/// Checks a request against the alignment O_DIRECT needs and the engine's file table.
pub(crate) fn check_request(req: &IoRequest, files: usize) -> io::Result<()> {
    if req.len == 0 || !req.len.is_multiple_of(4096) || !req.offset.is_multiple_of(4096) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unaligned I/O: offset {} len {} (both must be multiples of 4096)", req.offset, req.len),
        ));
    }
    if req.target as usize >= files {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("no file {} in the io engine", req.target)));
    }
    Ok(())
}

/// Wraps a completion channel into an [`IoFuture`].
pub(crate) fn completion_future(rx: tokio::sync::oneshot::Receiver<IoResult>) -> IoFuture {
    Box::pin(async move {
        rx.await.unwrap_or_else(|_| {
            Err(IoFailure {
                buf: None,
                error: io::Error::other("io engine thread stopped before completing the request"),
            })
        })
    })
}

/// Completes a request immediately with an error.
pub(crate) fn failed(buf: IoBuf, error: io::Error) -> IoFuture {
    Box::pin(std::future::ready(Err(IoFailure { buf: Some(buf), error })))
}
