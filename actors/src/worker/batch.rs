//! The batch policy of every engine, the reference worker's and the simulated one's alike: which
//! running requests a step computes and how many tokens of each, who yields its G1 pages when
//! they run out, when a preempted request comes back and when a new one may join.
//!
//! It does no I/O and holds no memory: the engine core (`super::engine_core`) describes the
//! running requests as [`Member`]s and answers for their G1 pages through [`Pages`] (its driver's
//! pages), and the engine carries out the [`StepPlan`] it gets back (a forward pass on the
//! reference worker, calibrated time on the simulated one).

use dynamo_tiering::block::BlockHash;
use dynamo_tiering::registry::TierRegistry;
use std::cmp::Reverse;

use super::{Finish, WorkerError};

/// What a step's plan needs to know of a running request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// Tokens waiting for their KV (1 while decoding).
    pub pending: usize,
    /// Tokens whose KV is in G1 already.
    pub computed: usize,
    /// Agent-hint priority: higher goes first and yields last.
    pub priority: i32,
    /// Admission order: among equal priorities the earliest goes first and the latest yields.
    pub order: u64,
    /// Nobody waits for its answer any more: it ends instead of computing.
    pub closed: bool,
}

/// The G1 pages of the requests in a step, as their engine keeps them.
pub trait Pages {
    /// Gives request `i` pages until it holds `blocks`; false if G1 ran out of pages first
    /// (the pages it got stay with it).
    fn grow(&mut self, i: usize, blocks: usize) -> bool;
    /// Request `i` yields: its blocks are written through and its pages freed; it resumes later.
    fn preempt(&mut self, i: usize);
}

/// Why a request leaves the batch without computing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Leave {
    /// Its caller went away.
    Closed,
    /// It needs a G1 page and nothing else is left to yield one.
    Overloaded,
}

impl Leave {
    /// How the request ends.
    pub fn end(self) -> Result<Finish, WorkerError> {
        match self {
            Leave::Closed => Ok(Finish::Stop),
            Leave::Overloaded => Err(WorkerError::Overloaded),
        }
    }
}

/// Where a request of a step goes once the step ran.
#[derive(Debug)]
pub enum Fate {
    /// It stays in the batch.
    Stays,
    /// It yielded its pages and waits to resume.
    Waits,
    /// It leaves, ending so.
    Leaves(Result<Finish, WorkerError>),
}

/// The fate of each of a step's `n` requests: those in `ended` leave (the first end recorded for
/// one counts), those in `yielded` and not ended wait, the rest stay.
pub fn fates(n: usize, ended: Vec<(usize, Result<Finish, WorkerError>)>, yielded: &[usize]) -> Vec<Fate> {
    let mut fates: Vec<Fate> = (0..n).map(|_| Fate::Stays).collect();
    for (i, end) in ended {
        if matches!(fates[i], Fate::Stays) {
            fates[i] = Fate::Leaves(end);
        }
    }
    for &i in yielded {
        if matches!(fates[i], Fate::Stays) {
            fates[i] = Fate::Waits;
        }
    }
    fates
}

/// What one step does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// `(request, tokens)` computed this step: decode tokens first, then prefill chunks.
    pub chunks: Vec<(usize, usize)>,
    /// Requests that yielded their pages this step, to resume later.
    pub yielded: Vec<usize>,
    /// Requests that leave now, and why.
    pub leaving: Vec<(usize, Leave)>,
}

impl StepPlan {
    /// Whether every chunk is one token of a request that is decoding already.
    pub fn decodes_only(&self, members: &[Member]) -> bool {
        self.chunks.iter().all(|&(i, take)| take == 1 && members[i].pending == 1)
    }
}

/// Plans one step over `members`: the pending decode token of every one, then prefill chunks in
/// priority, then admission order, within `budget` tokens (`engine.max_batch_tokens`). A request
/// that needs a G1 page when none is free makes the lowest-priority request not yet planned
/// yield; if there is none, it yields itself, unless it would be alone in the step: then it
/// cannot be served and leaves overloaded.
pub fn plan_step(members: &[Member], budget: usize, block_tokens: usize, pages: &mut impl Pages) -> StepPlan {
    let mut plan = StepPlan::default();
    for (i, m) in members.iter().enumerate() {
        if m.closed {
            plan.leaving.push((i, Leave::Closed));
        }
    }
    let mut order: Vec<usize> = (0..members.len()).filter(|&i| !members[i].closed).collect();
    order.sort_by_key(|&i| {
        let m = &members[i];
        (m.pending > 1, Reverse(m.priority), m.order)
    });
    let mut budget = budget;
    for (at, &i) in order.iter().enumerate() {
        if plan.yielded.contains(&i) {
            continue;
        }
        let take = members[i].pending.min(budget);
        if take == 0 {
            continue;
        }
        let need = (members[i].computed + take).div_ceil(block_tokens);
        let mut fits = true;
        while !pages.grow(i, need) {
            let victim = order[at + 1..].iter().rev().copied().find(|v| !plan.yielded.contains(v));
            match victim {
                Some(v) => {
                    pages.preempt(v);
                    plan.yielded.push(v);
                }
                None if !plan.chunks.is_empty() => {
                    pages.preempt(i);
                    plan.yielded.push(i);
                    fits = false;
                    break;
                }
                None => {
                    plan.leaving.push((i, Leave::Overloaded));
                    fits = false;
                    break;
                }
            }
        }
        if fits {
            plan.chunks.push((i, take));
            budget -= take;
        }
    }
    plan
}

/// Whether a waiting request of `tokens` tokens (preempted, or admitted with no room yet) may
/// come in now: always when nothing runs; otherwise when the `available` G1 pages (free, or
/// holding a block nobody references, interior blocks of cached chains included: they are freed
/// tail first) take the pages it needs — its blocks, less the `shared` leading ones it finds in G1
/// under another request's reference — and one more page per running request to grow by.
pub fn may_resume(tokens: usize, shared: usize, running: usize, available: usize, block_tokens: usize) -> bool {
    running == 0 || (tokens + 1).div_ceil(block_tokens).saturating_sub(shared) + running <= available
}

/// The leading blocks of `chain` resident in a G1 `registry` and referenced by a running
/// request: a newcomer shares their pages instead of taking its own.
pub fn shared_prefix(registry: &TierRegistry, chain: &[BlockHash]) -> usize {
    chain.iter().take_while(|&&h| registry.meta(h).is_some_and(|m| m.refs > 0)).count()
}

/// Whether a new request may join: below `max_running`, and nobody waits to resume.
pub fn has_room(running: usize, preempted: usize, max_running: usize) -> bool {
    preempted == 0 && running < max_running
}

/// The order preempted requests resume in: highest priority, then earliest admission first.
pub fn resume_key(priority: i32, order: u64) -> (Reverse<i32>, u64) {
    (Reverse(priority), order)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages as counts: `free` left in G1, `held[i]` per request.
    struct Counted {
        free: usize,
        held: Vec<usize>,
        preempted: Vec<usize>,
    }

    impl Pages for Counted {
        fn grow(&mut self, i: usize, blocks: usize) -> bool {
            while self.held[i] < blocks {
                if self.free == 0 {
                    return false;
                }
                self.free -= 1;
                self.held[i] += 1;
            }
            true
        }

        fn preempt(&mut self, i: usize) {
            self.free += std::mem::take(&mut self.held[i]);
            self.preempted.push(i);
        }
    }

    fn member(pending: usize, computed: usize, priority: i32, order: u64) -> Member {
        Member { pending, computed, priority, order, closed: false }
    }

    #[test]
    fn decodes_go_first_then_prefill_chunks_within_the_budget() {
        let members = [member(100, 0, 0, 1), member(1, 40, 0, 2), member(50, 0, 5, 3)];
        let mut pages = Counted { free: 100, held: vec![0, 3, 0], preempted: vec![] };
        let plan = plan_step(&members, 120, 16, &mut pages);
        assert_eq!(plan.chunks, vec![(1, 1), (2, 50), (0, 69)], "decode, higher priority, then the rest");
        assert!(plan.yielded.is_empty() && plan.leaving.is_empty());
        assert_eq!(pages.held, vec![5, 3, 4]);
        assert!(!plan.decodes_only(&members));
    }

    #[test]
    fn the_lowest_priority_latest_request_yields_when_g1_is_out_of_pages() {
        // Three decoders each about to need a fifth page; G1 has one free.
        let members = [member(1, 64, 1, 1), member(1, 64, 0, 2), member(1, 64, 0, 3)];
        let mut pages = Counted { free: 1, held: vec![4, 4, 4], preempted: vec![] };
        let plan = plan_step(&members, 100, 16, &mut pages);
        assert_eq!(plan.chunks, vec![(0, 1), (1, 1)]);
        assert_eq!(plan.yielded, vec![2], "the latest of the lowest priority yields");
        assert!(plan.decodes_only(&members));
        assert_eq!(pages.preempted, vec![2]);
    }

    #[test]
    fn a_request_that_cannot_fit_alone_leaves_overloaded_and_closed_ones_leave() {
        let mut members = [member(100, 0, 0, 1), member(1, 8, 0, 2)];
        members[1].closed = true;
        let mut pages = Counted { free: 3, held: vec![0, 1], preempted: vec![] };
        let plan = plan_step(&members, 1000, 16, &mut pages);
        assert!(plan.chunks.is_empty());
        assert_eq!(plan.leaving, vec![(1, Leave::Closed), (0, Leave::Overloaded)]);
    }

    #[test]
    fn resumption_waits_for_room_unless_nothing_runs() {
        assert!(may_resume(10_000, 0, 0, 0, 16), "alone it always comes back");
        assert!(may_resume(63, 0, 2, 6, 16), "4 blocks + 2 to grow fit 6 available pages");
        assert!(!may_resume(64, 0, 2, 6, 16));
        assert!(may_resume(64, 1, 2, 6, 16), "a block shared with a running request takes no page");
        assert!(has_room(3, 0, 4) && !has_room(4, 0, 4) && !has_room(0, 1, 4));
        assert!(resume_key(2, 9) < resume_key(1, 1) && resume_key(1, 1) < resume_key(1, 2));
    }
}
