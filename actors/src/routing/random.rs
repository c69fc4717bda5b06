//! `random`: a worker uniformly at random.

use super::{Candidates, Choice, Policy, Rng, rotated, unestimated};
use crate::scheduler::KvRouting;
use crate::worker::GenRequest;

/// A worker uniformly at random first, then the others in turn after it.
#[derive(Debug)]
pub struct Random {
    rng: Rng,
}

impl Random {
    /// Choices seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: Rng::new(seed) }
    }
}

impl Policy for Random {
    fn rank(&mut self, candidates: Candidates<'_>, _: Option<&KvRouting>, _: &mut GenRequest) -> Vec<Choice> {
        let up = candidates.up();
        if up.is_empty() {
            return Vec::new();
        }
        let start = (self.rng.next() >> 33) as usize % up.len();
        unestimated(rotated(&up, start))
    }
}
