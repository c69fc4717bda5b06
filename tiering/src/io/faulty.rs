//! A test engine that wraps a real one and injects latency, errors and corruption.
//!
//! The plan can be changed while I/O is running ([`FaultyEngine::set_plan`]), so a test can fill a
//! disk, make it fail, and heal it again. Latency uses tokio's timer, so it also works under a
//! paused clock.

use std::io;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{IoBuf, IoEngine, IoFailure, IoFuture, IoRequest};

/// What to inject. The default injects nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Added before every read.
    pub read_latency: Duration,
    /// Added before every write.
    pub write_latency: Duration,
    /// Fail every write with this OS error (e.g. `libc::ENOSPC`) without touching the disk.
    pub fail_writes: Option<i32>,
    /// Fail every read with this OS error (e.g. `libc::EIO`).
    pub fail_reads: Option<i32>,
    /// After a successful read, flip the lowest bit of the byte at this offset of the buffer.
    pub corrupt_reads_at: Option<usize>,
}

/// Wraps another engine and applies a [`FaultPlan`].
#[derive(Debug)]
pub struct FaultyEngine {
    inner: Arc<dyn IoEngine>,
    plan: Mutex<FaultPlan>,
    injected: Arc<AtomicU64>,
}

impl FaultyEngine {
    /// Wraps `inner` with `plan`.
    pub fn new(inner: Arc<dyn IoEngine>, plan: FaultPlan) -> Self {
        Self { inner, plan: Mutex::new(plan), injected: Arc::new(AtomicU64::new(0)) }
    }

    /// Replaces the plan; operations already submitted keep the old one.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock().expect("plan lock") = plan;
    }

    /// Faults injected so far (errors and corruptions).
    pub fn injected_total(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        "faulty"
    }

    fn submit(&self, req: IoRequest) -> IoFuture {
        let plan = self.plan.lock().expect("plan lock").clone();
        let injected = self.injected.clone();
        let is_read = req.buf.is_read();
        let (latency, fail) =
            if is_read { (plan.read_latency, plan.fail_reads) } else { (plan.write_latency, plan.fail_writes) };
        if let Some(code) = fail {
            injected.fetch_add(1, Ordering::Relaxed);
            return Box::pin(async move {
                if !latency.is_zero() {
                    tokio::time::sleep(latency).await;
                }
                Err(IoFailure { buf: Some(req.buf), error: io::Error::from_raw_os_error(code) })
            });
        }
        // Submit now so the I/O is really in flight; apply latency to the completion.
        let inner = self.inner.submit(req);
        Box::pin(async move {
            if !latency.is_zero() {
                tokio::time::sleep(latency).await;
            }
            let mut result = inner.await;
            if let (Ok(IoBuf::Read(slot)), Some(at)) = (&mut result, plan.corrupt_reads_at)
                && let Some(byte) = slot.as_mut_slice().get_mut(at)
            {
                *byte ^= 1;
                injected.fetch_add(1, Ordering::Relaxed);
            }
            result
        })
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }
}
