//! `round_robin`: each worker in turn, whatever it holds.

use super::{Candidates, Choice, Policy, rotated, unestimated};
use crate::scheduler::KvRouting;
use crate::worker::GenRequest;

/// Each worker in turn: every request starts the rotation one worker further.
#[derive(Debug)]
pub struct RoundRobin {
    next: usize,
}

impl Default for RoundRobin {
    fn default() -> Self {
        // The first request goes to the first worker.
        Self { next: usize::MAX }
    }
}

impl Policy for RoundRobin {
    fn rank(&mut self, candidates: Candidates<'_>, _: Option<&KvRouting>, _: &mut GenRequest) -> Vec<Choice> {
        let up = candidates.up();
        if up.is_empty() {
            return Vec::new();
        }
        self.next = self.next.wrapping_add(1);
        unestimated(rotated(&up, self.next % up.len()))
    }
}
