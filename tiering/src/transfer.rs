//! Copy engines: how block images move between memory tiers (G1 ↔ G2).
//!
//! Like [`crate::io::IoEngine`] for disks, a [`CopyEngine`] hides how bytes move so the transfer
//! pipeline above it is the same on a CPU-only node, a GPU node (CUDA streams — the GPU issue adds
//! that engine), and in simulation. A batch is the unit: engines amortise launches and
//! synchronisation over many blocks.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::g2::{SlotMut, SlotRef};

/// The link a copy crosses; it decides the bandwidth.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Link {
    /// Host (pinned) to device.
    HostToDevice,
    /// Device to host (pinned).
    DeviceToHost,
    /// Device to device.
    DeviceToDevice,
    /// Host to host (CPU engines, where G1 is host memory).
    HostToHost,
}

/// One block image to copy: the whole source slot prefix of `len` bytes into the destination.
#[derive(Debug)]
pub struct HostCopy {
    /// Source image.
    pub src: SlotRef,
    /// Destination slot.
    pub dst: SlotMut,
    /// Bytes to copy.
    pub len: usize,
}

/// The future of a copy batch: the batch back, with destinations filled.
pub type CopyFuture = Pin<Box<dyn Future<Output = Vec<HostCopy>> + Send + 'static>>;

/// Moves batches of block images across a link.
///
/// Contract: the future completes when every destination in the batch holds its source's bytes
/// (or, for simulated engines, when the calibrated time for those bytes has passed).
pub trait CopyEngine: Send + Sync + fmt::Debug + 'static {
    /// A short name for logs and metrics.
    fn name(&self) -> &'static str;

    /// Copies a batch across `link`.
    fn copy(&self, link: Link, batch: Vec<HostCopy>) -> CopyFuture;
}

/// Copies with the CPU (`memcpy`), in the caller's task.
#[derive(Debug, Default)]
pub struct HostCopyEngine;

impl CopyEngine for HostCopyEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    fn copy(&self, _link: Link, mut batch: Vec<HostCopy>) -> CopyFuture {
        for c in &mut batch {
            c.dst.as_mut_slice()[..c.len].copy_from_slice(&c.src.as_slice()[..c.len]);
        }
        Box::pin(std::future::ready(batch))
    }
}

/// Link bandwidths for the simulated copy engine, GB/s.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkBandwidths {
    /// Host to device.
    pub h2d_gb_s: f64,
    /// Device to host.
    pub d2h_gb_s: f64,
    /// Device to device.
    pub d2d_gb_s: f64,
    /// Host to host.
    pub h2h_gb_s: f64,
}

impl LinkBandwidths {
    /// The link numbers of a calibration file (`[link]`); host-to-host is taken as the pinned
    /// host-to-device figure, the slower of the two on any machine we calibrate.
    pub fn from_calibration(link: &dynamo_config::LinkCalibration) -> Self {
        Self {
            h2d_gb_s: link.h2d_pinned_gb_s,
            d2h_gb_s: link.d2h_pinned_gb_s,
            d2d_gb_s: link.d2d_copy_gb_s,
            h2h_gb_s: link.h2d_pinned_gb_s,
        }
    }

    fn of(&self, link: Link) -> f64 {
        match link {
            Link::HostToDevice => self.h2d_gb_s,
            Link::DeviceToHost => self.d2h_gb_s,
            Link::DeviceToDevice => self.d2d_gb_s,
            Link::HostToHost => self.h2h_gb_s,
        }
    }
}

/// Moves no bytes; a batch takes `bytes / bandwidth` of its link, batches on one link queue
/// behind each other. Uses tokio's clock (virtual under a paused clock).
#[derive(Debug)]
pub struct SimulatedCopy {
    bandwidths: LinkBandwidths,
    busy_until: Mutex<Vec<(Link, Instant)>>,
}

impl SimulatedCopy {
    /// A simulated copy engine with these link bandwidths.
    pub fn new(bandwidths: LinkBandwidths) -> Self {
        Self { bandwidths, busy_until: Mutex::new(Vec::new()) }
    }

    /// Time a transfer of `bytes` takes on `link`, ignoring queueing.
    pub fn transfer_time(&self, link: Link, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / (self.bandwidths.of(link) * 1e9))
    }

    /// Queues `bytes` on `link` now and answers when they are across: what [`CopyEngine::copy`]'s
    /// future waits for, for a caller that moves no buffer (the simulated engine, whose tiers are
    /// bookkeeping only).
    pub fn reserve(&self, link: Link, bytes: u64) -> Instant {
        let now = Instant::now();
        let mut lanes = self.busy_until.lock().expect("lanes lock");
        let lane = match lanes.iter_mut().position(|(l, _)| *l == link) {
            Some(i) => &mut lanes[i].1,
            None => {
                lanes.push((link, now));
                &mut lanes.last_mut().expect("just pushed").1
            }
        };
        *lane = (*lane).max(now) + self.transfer_time(link, bytes);
        *lane
    }
}

impl CopyEngine for SimulatedCopy {
    fn name(&self) -> &'static str {
        "simulated"
    }

    /// Must be called inside a tokio runtime with the time driver enabled.
    fn copy(&self, link: Link, batch: Vec<HostCopy>) -> CopyFuture {
        let bytes: u64 = batch.iter().map(|c| c.len as u64).sum();
        let done_at = self.reserve(link, bytes);
        Box::pin(async move {
            tokio::time::sleep_until(done_at).await;
            batch
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::{BlockHash, HEADER_LEN};
    use crate::test_utils::{image, pool_for};

    fn batch(pool: &crate::g2::HostPool, n: u64, payload: usize) -> Vec<HostCopy> {
        (0..n)
            .map(|i| HostCopy {
                src: image(pool, BlockHash(i as u128), None, payload),
                dst: pool.try_alloc().expect("slot"),
                len: HEADER_LEN + payload,
            })
            .collect()
    }

    #[tokio::test]
    async fn host_copy_moves_the_bytes() {
        let pool = pool_for(4096 - HEADER_LEN, 8);
        let done = HostCopyEngine.copy(Link::HostToHost, batch(&pool, 4, 4096 - HEADER_LEN)).await;
        for c in done {
            assert_eq!(c.src.as_slice()[..c.len], c.dst.as_slice()[..c.len]);
        }
    }

    /// A 4 GiB batch over the calibrated 55.5 GB/s host link takes ~77 ms of virtual time, and a
    /// second batch on the same link queues behind it while another link runs in parallel.
    #[tokio::test(start_paused = true)]
    async fn simulated_copy_takes_link_time() {
        let cal = dynamo_config::Calibration::h200();
        let engine = SimulatedCopy::new(LinkBandwidths::from_calibration(&cal.link));
        let payload = (1 << 20) - HEADER_LEN;
        let pool = pool_for(payload, 16);
        let start = Instant::now();
        // Report 4 GiB worth of bytes with 4 real slots: the simulator counts `len`, not memory.
        let mut big = batch(&pool, 4, payload);
        for c in &mut big {
            c.len = 1 << 30;
        }
        let h2d = engine.copy(Link::HostToDevice, big);
        let mut second = batch(&pool, 1, payload);
        second[0].len = 1 << 30;
        let h2d2 = engine.copy(Link::HostToDevice, second);
        let d2h = engine.copy(Link::DeviceToHost, batch(&pool, 1, payload));
        d2h.await;
        // tokio timers tick in milliseconds.
        assert!(start.elapsed() <= Duration::from_millis(1), "other links do not queue");
        h2d.await;
        let first = start.elapsed().as_secs_f64();
        assert!((first - 4.0 * (1u64 << 30) as f64 / 55.5e9).abs() < 1e-3, "{first}");
        h2d2.await;
        let second = start.elapsed().as_secs_f64();
        assert!((second - 5.0 * (1u64 << 30) as f64 / 55.5e9).abs() < 1e-3, "same link queues: {second}");
    }
}
