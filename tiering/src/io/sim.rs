//! A simulated disk: no bytes move, and each I/O takes the time a calibrated device would.
//!
//! The device is modelled as one server per direction with the calibrated bandwidth: an I/O
//! completes at `max(now, busy_until) + len / bandwidth + latency`. Timing uses tokio's clock, so
//! under a paused clock (`tokio::time::pause`, or `#[tokio::test(start_paused = true)]`) hours of
//! traffic replay in moments with the tiers' real bookkeeping on top.
//!
//! Because nothing is read, a slot "read" from this engine holds whatever it held before; callers
//! that verify images (every real store does) will reject it. It is meant for bookkeeping-only
//! tiers in virtual time, not for serving data.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{IoEngine, IoFuture, IoRequest};

/// Timing of a simulated disk.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimDisk {
    /// Sequential read bandwidth, GB/s (10^9 bytes per second).
    pub read_gb_s: f64,
    /// Sequential write bandwidth, GB/s.
    pub write_gb_s: f64,
    /// Fixed latency added to every I/O (not serialised).
    pub latency: Duration,
}

impl SimDisk {
    /// The disk of a calibration file (`[disk]` section).
    pub fn from_calibration(disk: &dynamo_config::DiskCalibration) -> Self {
        Self { read_gb_s: disk.seq_read_gb_s, write_gb_s: disk.seq_write_gb_s, latency: Duration::from_micros(80) }
    }

    /// Time to move `bytes` at `gb_s`.
    pub fn transfer_time(bytes: usize, gb_s: f64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / (gb_s * 1e9))
    }
}

#[derive(Debug)]
struct Lanes {
    read_busy_until: Instant,
    write_busy_until: Instant,
}

/// The direction of a disk transfer (each has its own lane).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Disk to memory.
    Read,
    /// Memory to disk.
    Write,
}

/// The simulated engine.
#[derive(Debug)]
pub struct SimulatedIo {
    disk: SimDisk,
    lanes: Mutex<Option<Lanes>>,
    inflight: Arc<AtomicUsize>,
}

impl SimulatedIo {
    /// A simulated disk with the given timing.
    pub fn new(disk: SimDisk) -> Self {
        Self { disk, lanes: Mutex::new(None), inflight: Arc::new(AtomicUsize::new(0)) }
    }

    /// Queues a transfer of `len` bytes in `direction` now and answers when it completes: what
    /// [`IoEngine::submit`]'s future waits for, for a caller that moves no buffer (tiers kept as
    /// bookkeeping only, as the simulated engine keeps them).
    pub fn reserve(&self, direction: Direction, len: usize) -> Instant {
        let now = Instant::now();
        let mut lanes = self.lanes.lock().expect("lanes lock");
        let lanes = lanes.get_or_insert(Lanes { read_busy_until: now, write_busy_until: now });
        let (busy, gb_s) = match direction {
            Direction::Read => (&mut lanes.read_busy_until, self.disk.read_gb_s),
            Direction::Write => (&mut lanes.write_busy_until, self.disk.write_gb_s),
        };
        let start = (*busy).max(now);
        *busy = start + SimDisk::transfer_time(len, gb_s);
        *busy + self.disk.latency
    }

    /// How long the work queued in `direction` still takes.
    pub fn backlog(&self, direction: Direction) -> Duration {
        let lanes = self.lanes.lock().expect("lanes lock");
        let busy = lanes.as_ref().map(|l| match direction {
            Direction::Read => l.read_busy_until,
            Direction::Write => l.write_busy_until,
        });
        busy.map_or(Duration::ZERO, |busy| busy.saturating_duration_since(Instant::now()))
    }
}

impl IoEngine for SimulatedIo {
    fn name(&self) -> &'static str {
        "simulated"
    }

    /// Must be called inside a tokio runtime with the time driver enabled.
    fn submit(&self, req: IoRequest) -> IoFuture {
        let direction = if req.buf.is_read() { Direction::Read } else { Direction::Write };
        let done_at = self.reserve(direction, req.len);
        self.inflight.fetch_add(1, Ordering::Relaxed);
        let inflight = self.inflight.clone();
        Box::pin(async move {
            tokio::time::sleep_until(done_at).await;
            inflight.fetch_sub(1, Ordering::Relaxed);
            Ok(req.buf)
        })
    }

    fn in_flight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::BlockHash;
    use crate::io::{IoBuf, IoRequest};
    use crate::test_utils::{image, pool_for};

    /// 100 writes of 1 MiB at 1.4 GB/s take 100 × 2^20 / 1.4e9 s of *virtual* time, queued behind
    /// each other, while reads run on their own lane.
    #[tokio::test(start_paused = true)]
    async fn io_takes_calibrated_virtual_time() {
        let engine = SimulatedIo::new(SimDisk { read_gb_s: 1.6, write_gb_s: 1.4, latency: Duration::ZERO });
        let pool = pool_for((1 << 20) - crate::block::HEADER_LEN, 101);
        let start = Instant::now();
        let writes: Vec<_> = (0..100)
            .map(|i| {
                let buf = IoBuf::Write(image(&pool, BlockHash(i), None, (1 << 20) - crate::block::HEADER_LEN));
                engine.submit(IoRequest { target: 0, offset: 0, len: 1 << 20, buf })
            })
            .collect();
        let read = engine.submit(IoRequest {
            target: 0,
            offset: 0,
            len: 1 << 20,
            buf: IoBuf::Read(pool.try_alloc().expect("slot")),
        });
        assert_eq!(engine.in_flight(), 101);
        read.await.expect("read");
        let read_time = start.elapsed();
        for w in futures::future::join_all(writes).await {
            w.expect("write");
        }
        let write_time = start.elapsed();
        let expect_write = 100.0 * (1u64 << 20) as f64 / 1.4e9;
        let expect_read = (1u64 << 20) as f64 / 1.6e9;
        assert!((write_time.as_secs_f64() - expect_write).abs() < 1e-3, "{write_time:?} vs {expect_write}");
        assert!((read_time.as_secs_f64() - expect_read).abs() < 1e-3, "reads do not queue behind writes");
        assert_eq!(engine.in_flight(), 0);
    }

    #[test]
    fn calibration_disk_maps_to_bandwidths() {
        let cal = dynamo_config::Calibration::h200();
        let disk = SimDisk::from_calibration(&cal.disk);
        assert_eq!(disk.read_gb_s, 1.62);
        assert_eq!(disk.write_gb_s, 1.40);
    }
}
