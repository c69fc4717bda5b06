//! Simulated copy links: how long block images take to cross the host link (G1 ↔ G2) when no
//! bytes move. The simulated engine books its loads here; the real engines copy with their
//! backends (`memcpy` on the CPU, CUDA streams on a GPU) and measure instead.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

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

    /// Queues `bytes` on `link` now and answers when they are across: for a caller
    /// that moves no buffer (the simulated engine, whose tiers are bookkeeping only).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4 GiB booking over a 55.5 GB/s host link ends ~77 ms of virtual time later, a second one
    /// on the same link queues behind it, and another link runs in parallel.
    #[tokio::test(start_paused = true)]
    async fn simulated_links_book_link_time_and_queue_per_link() {
        let engine =
            SimulatedCopy::new(LinkBandwidths { h2d_gb_s: 55.5, d2h_gb_s: 55.5, d2d_gb_s: 1000.0, h2h_gb_s: 55.5 });
        let start = Instant::now();
        let gib = 1u64 << 30;
        let first = engine.reserve(Link::HostToDevice, 4 * gib) - start;
        let second = engine.reserve(Link::HostToDevice, gib) - start;
        let other = engine.reserve(Link::DeviceToHost, 1 << 20) - start;
        assert!((first.as_secs_f64() - 4.0 * gib as f64 / 55.5e9).abs() < 1e-6, "{first:?}");
        assert!((second.as_secs_f64() - 5.0 * gib as f64 / 55.5e9).abs() < 1e-6, "same link queues: {second:?}");
        assert!(other < Duration::from_millis(1), "other links do not queue: {other:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let later = engine.reserve(Link::HostToDevice, 0) - Instant::now();
        assert_eq!(later, Duration::ZERO, "an idle link starts a booking now");
    }
}
