//! The engine core: the one state machine every batching engine runs its requests with, the
//! reference worker and the simulated engine alike. It owns the requests in the batch (running)
//! and those waiting for room in G1 (preempted, or admitted before there was room), and decides
//! admission, who comes back when, who computes how much in a step, who yields, who leaves and
//! what a turn's end leaves held. It does no I/O, keeps no clock and touches no memory: an engine
//! (its driver) tells it what happened and carries out what it answers, in the way of raft-rs's
//! `Ready` and quinn-proto's connection state.
//!
//! Events in, actions out:
//! - [`EngineCore::admit`]: a ticket arrives. A refused one is answered here; an admitted one
//!   comes back as a [`Run`] for the driver to wrap with its G1 pages.
//! - [`EngineCore::may_enter`] / [`EngineCore::next_to_resume`]: whether a new or waiting request
//!   may come into G1 now. The driver then onboards its cached prefix (its I/O) and reports how
//!   that went ([`EngineCore::entered`]), which answers [`Entry`]: it runs, it waits (the driver
//!   frees its pages first), or it fails.
//! - [`EngineCore::begin_step`], [`Step::plan`]: the running requests and what the batch policy
//!   plans for them ([`batch::plan_step`], with the driver's pages); the driver computes the plan (a forward
//!   pass, or calibrated time), advances each request ([`Step::ended`] on the way) and hands the
//!   step back ([`EngineCore::end_step`]), which keeps those that stay, queues those that yielded
//!   and gives back those that leave, for the driver to end.
//! - [`EngineCore::cancel_last`], [`EngineCore::drain`]: a caller that stopped listening; a reset.
//! - [`turn_end`]: what the end of a turn leaves of each block: its priority, its hold, the hold a
//!   lease asks of G1.
//!
//! An engine is a [`Driver`]: it keeps its requests' G1 pages (grow, preempt, release) and ends a
//! request its own way; the driver's provided methods carry out the core's answers (enter, wait
//! for room, cancel) the same way for every engine.
//!
//! The write-backlog decision is [`dynamo_tiering::cost::write_admitted`], one rule for every
//! engine and every tier owner.

use dynamo_tiering::block::{BlockHash, Salt};
use dynamo_tiering::pipeline::{Pipeline, Refusal};
use dynamo_tiering::registry::{Millis, TierRegistry};
use tokio::time::Instant;

use super::batch::{self, Fate, Member, StepPlan};
use super::run::Run;
use super::{DEFAULT_MAX_RUNNING, Finish, Ticket, WorkerError};
use crate::tier_store::TierStore;

/// A request as an engine keeps it: its [`Run`] and whatever the engine holds beside it.
pub(super) trait Sequence {
    /// Its run through the batch.
    fn run(&self) -> &Run;
}

/// An engine driving the core: it keeps its requests' G1 pages and ends them its own way. What
/// the core answers is carried out by the provided methods, the same way for every engine.
pub(super) trait Driver<S: Sequence> {
    /// The core it drives.
    fn core(&mut self) -> &mut EngineCore<S>;
    /// Gives `seq` pages until it holds `blocks`; false if G1 ran out first (the pages it got stay
    /// with it).
    fn grow(&mut self, seq: &mut S, blocks: usize) -> bool;
    /// `seq` yields: its blocks are written through and its pages freed; it comes back later.
    fn preempt(&mut self, seq: &mut S);
    /// Gives back `seq`'s G1 references and frees its private pages: it holds none after.
    fn release(&mut self, seq: &mut S);
    /// Ends `seq` (its turn's end: what its blocks keep) and answers its caller.
    fn end(&mut self, seq: S, end: Result<Finish, WorkerError>);

    /// Puts `seq` among the requests waiting for room in G1, holding no page.
    fn wait_for_room(&mut self, mut seq: S) {
        self.release(&mut seq);
        self.core().wait(seq);
    }

    /// Carries out where the core sends `seq` once its onboarding is done (`loaded`): into the
    /// batch, back to wait for room, or to its end. False when it waits.
    fn entered(&mut self, seq: S, loaded: Result<(), WorkerError>) -> bool {
        match self.core().entered(seq, loaded) {
            Entry::Runs => true,
            Entry::Waits(seq) => {
                self.wait_for_room(seq);
                false
            }
            Entry::Fails(mut seq, e) => {
                self.release(&mut seq);
                self.end(seq, Err(e));
                true
            }
        }
    }

    /// Ends the request admitted last at once: its caller stopped listening.
    fn cancel_last(&mut self) {
        if let Some(seq) = self.core().cancel_last() {
            self.end(seq, Ok(Finish::Stop));
        }
    }
}

/// A driver's pages over the requests of one step, as [`batch::plan_step`] numbers them.
struct On<'a, P, S> {
    pages: &'a mut P,
    running: &'a mut [S],
}

impl<P: Driver<S>, S: Sequence> batch::Pages for On<'_, P, S> {
    fn grow(&mut self, i: usize, blocks: usize) -> bool {
        self.pages.grow(&mut self.running[i], blocks)
    }

    fn preempt(&mut self, i: usize) {
        self.pages.preempt(&mut self.running[i]);
    }
}

/// Where a request goes once its onboarding is done.
pub(super) enum Entry<S> {
    /// It is in the batch.
    Runs,
    /// G1 ran out of pages meanwhile and others run: it waits for room (the driver frees what it
    /// holds, then [`EngineCore::wait`]).
    Waits(S),
    /// It cannot be served (the driver frees what it holds, then ends it so).
    Fails(S, WorkerError),
}

/// The running requests of one step and its plan, between [`EngineCore::begin_step`] and
/// [`EngineCore::end_step`].
pub(super) struct Step<S> {
    /// The requests in the batch, as the plan numbers them.
    pub(super) running: Vec<S>,
    /// What the plan saw of each.
    pub(super) members: Vec<Member>,
    /// `(request, tokens)` the step computes.
    pub(super) chunks: Vec<(usize, usize)>,
    yielded: Vec<usize>,
    ended: Vec<(usize, Result<Finish, WorkerError>)>,
    budget: usize,
    block_tokens: usize,
}

impl<S> Step<S> {
    /// Plans the step: the pending decode token of every request, then prefill chunks by
    /// priority and arrival within the budget, the requests' pages grown (or yielded) by the
    /// driver's `pages` ([`batch::plan_step`]).
    pub(super) fn plan(&mut self, pages: &mut impl Driver<S>)
    where
        S: Sequence,
    {
        let mut on = On { pages, running: &mut self.running };
        let StepPlan { chunks, yielded, leaving } =
            batch::plan_step(&self.members, self.budget, self.block_tokens, &mut on);
        self.chunks = chunks;
        self.yielded = yielded;
        self.ended.extend(leaving.iter().map(|&(i, why)| (i, why.end())));
    }

    /// Request `i` ends so (the first end recorded for a request counts).
    pub(super) fn ended(&mut self, i: usize, end: Result<Finish, WorkerError>) {
        self.ended.push((i, end));
    }
}

/// The batch of one engine: its running and waiting requests and the limits it runs them within.
#[derive(Debug)]
pub(super) struct EngineCore<S> {
    block_tokens: usize,
    /// Most tokens one step computes (`engine.max_batch_tokens`).
    budget: usize,
    /// Most requests in the batch (`engine.max_running_requests`).
    max_running: usize,
    /// The requests in the batch, in admission order.
    running: Vec<S>,
    /// Requests waiting for room in G1, highest priority then earliest first: preempted ones, and
    /// admitted ones whose prompt did not fit beside the batch yet. They come back before any new
    /// request is admitted.
    waiting: Vec<S>,
    /// Admissions so far: each request's order.
    admitted: u64,
}

impl<S: Sequence> EngineCore<S> {
    /// A batch of blocks of `block_tokens` tokens; steps take everything pending and up to
    /// [`DEFAULT_MAX_RUNNING`] requests run at once.
    pub(super) fn new(block_tokens: usize) -> Self {
        Self {
            block_tokens,
            budget: usize::MAX,
            max_running: DEFAULT_MAX_RUNNING,
            running: Vec::new(),
            waiting: Vec::new(),
            admitted: 0,
        }
    }

    /// Computes at most `tokens` tokens per step.
    pub(super) fn set_budget(&mut self, tokens: usize) {
        self.budget = tokens.max(1);
    }

    /// Runs at most `requests` requests at once.
    pub(super) fn set_max_running(&mut self, requests: usize) {
        self.max_running = requests.max(1);
    }

    /// Requests admitted and not finished (running or waiting).
    pub(super) fn len(&self) -> usize {
        self.running.len() + self.waiting.len()
    }

    /// Whether another request may join the batch now: below the limit, and nobody waits to
    /// come back.
    pub(super) fn has_room(&self) -> bool {
        batch::has_room(self.running.len(), self.waiting.len(), self.max_running)
    }

    /// Event: `ticket` arrives at an engine whose G1 holds `capacity` blocks. A request that
    /// cannot be served there (empty, or longer than G1 with its answer) is answered at once;
    /// one that can becomes a run, admitted next in order, hashed under `salt` (within its
    /// namespace), its time to first token counted from `start`.
    pub(super) fn admit(
        &mut self,
        ticket: Ticket,
        pipeline: &Pipeline<'_>,
        capacity: usize,
        salt: Salt,
        start: Instant,
    ) -> Option<Run> {
        let (prompt, max_tokens) = (ticket.req.prompt.len(), ticket.req.max_tokens);
        match pipeline.admit(prompt, max_tokens, capacity) {
            Ok(()) => {}
            Err(Refusal::EmptyPrompt) => {
                ticket.finish(Err(WorkerError::EmptyPrompt));
                return None;
            }
            Err(Refusal::TooLong { needed }) => {
                ticket.finish(Err(WorkerError::TooLong { prompt, max_tokens, needed, capacity }));
                return None;
            }
        }
        self.admitted += 1;
        Some(Run::new(ticket, self.admitted, salt, self.block_tokens, start))
    }

    /// Whether `run`, holding no page, may come into G1 now: always when nothing runs, otherwise
    /// when the `available` pages take its blocks (less the `shared` leading ones another running
    /// request holds) and a page per running request to grow by ([`batch::may_resume`]).
    pub(super) fn may_enter(&self, run: &Run, shared: usize, available: usize) -> bool {
        batch::may_resume(run.tokens.len(), shared, self.running.len(), available, self.block_tokens)
    }

    /// The first waiting request, taken out to be onboarded, if G1 has room for it now:
    /// `shared` answers how many of a chain's leading blocks a running request holds, and
    /// `available` is how many pages a newcomer may take.
    pub(super) fn next_to_resume(&mut self, shared: impl FnOnce(&[BlockHash]) -> usize, available: usize) -> Option<S> {
        let first = self.waiting.first()?;
        let shared = shared(&first.run().chain);
        self.may_enter(first.run(), shared, available).then(|| self.waiting.remove(0))
    }

    /// Event: `seq`'s cached prefix was brought into G1 (`Ok`), or not. Answers where it goes.
    pub(super) fn entered(&mut self, seq: S, loaded: Result<(), WorkerError>) -> Entry<S> {
        match loaded {
            Ok(()) => {
                self.running.push(seq);
                Entry::Runs
            }
            // The batch took the pages meanwhile: wait for some to come back.
            Err(WorkerError::Overloaded) if !self.running.is_empty() => Entry::Waits(seq),
            Err(e) => Entry::Fails(seq, e),
        }
    }

    /// Puts `seq`, which holds no page, among the requests waiting for room, in resume order.
    pub(super) fn wait(&mut self, seq: S) {
        self.waiting.push(seq);
        self.sort_waiting();
    }

    /// A request found in the batch after a panic: the restart that follows fails it.
    pub(super) fn keep_for_restart(&mut self, seq: S) {
        self.running.push(seq);
    }

    /// The running requests, taken out for one step, which [`Step::plan`] plans.
    pub(super) fn begin_step(&mut self) -> Step<S> {
        let running = std::mem::take(&mut self.running);
        let members: Vec<Member> = running.iter().map(|s| s.run().member()).collect();
        let (budget, block_tokens) = (self.budget, self.block_tokens);
        Step { running, members, chunks: Vec::new(), yielded: Vec::new(), ended: Vec::new(), budget, block_tokens }
    }

    /// Event: the step ran. Those that did not end stay (or, having yielded, wait to come back);
    /// those that ended are handed back with how they end, for the driver to end.
    pub(super) fn end_step(&mut self, step: Step<S>) -> Vec<(S, Result<Finish, WorkerError>)> {
        let Step { running, members, yielded, ended, .. } = step;
        let mut leaving = Vec::new();
        for (seq, fate) in running.into_iter().zip(batch::fates(members.len(), ended, &yielded)) {
            match fate {
                Fate::Stays => self.running.push(seq),
                Fate::Waits => self.waiting.push(seq),
                Fate::Leaves(end) => leaving.push((seq, end)),
            }
        }
        self.sort_waiting();
        leaving
    }

    /// Event: the caller of the request admitted last stopped listening. It is handed back, to be
    /// ended at once.
    pub(super) fn cancel_last(&mut self) -> Option<S> {
        let last = self.admitted;
        if let Some(i) = self.running.iter().position(|s| s.run().order == last) {
            return Some(self.running.remove(i));
        }
        self.waiting.iter().position(|s| s.run().order == last).map(|i| self.waiting.remove(i))
    }

    /// Every request, running and waiting, taken out (the engine resets).
    pub(super) fn drain(&mut self) -> impl Iterator<Item = S> + '_ {
        self.running.drain(..).chain(self.waiting.drain(..))
    }

    fn sort_waiting(&mut self) {
        self.waiting.sort_by_key(|s| batch::resume_key(s.run().ticket.priority, s.run().order));
    }
}

/// Lets go of block `i` (`hash`) of `run` at the end of its turn, in the engine's G1 registry
/// `g1` and in `store` below it. The turn's answer becomes conversation context for the next turn
/// (an agent resends it), so its blocks are promoted and held as the retention of their region
/// says, in G1 and G2; a leased block is held in G1 too (soft there: under pressure it goes down
/// to G2, where the lease pins it).
pub(super) fn end_block<S: TierStore + ?Sized>(
    store: &S,
    g1: &mut TierRegistry,
    run: &Run,
    i: usize,
    hash: BlockHash,
    now: Millis,
) {
    let _ = g1.release(hash);
    let pipeline = store.pipeline();
    let fate = pipeline.turn_end(run.region(i, pipeline.block_tokens), i >= run.prompt_blocks, now);
    if let Some(priority) = fate.priority {
        let _ = g1.set_priority(hash, priority);
        store.promote(hash, priority);
    }
    if let Some(until) = fate.hold_until {
        let _ = g1.hold(hash, until);
        store.hold(hash, until);
    }
    if let Some(until) = store.book().g1_hold(hash, now) {
        let _ = g1.hold(hash, until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::{GenRequest, JobEvent};
    use dynamo_config::RetentionSection;
    use dynamo_tiering::pipeline::WriteThrough;
    use tokio::sync::mpsc;

    struct Seq(Run);

    impl Sequence for Seq {
        fn run(&self) -> &Run {
            &self.0
        }
    }

    /// Pages as counts: `free` left, `held[order]` per request.
    struct Counted {
        core: EngineCore<Seq>,
        free: usize,
        held: Vec<usize>,
    }

    impl Driver<Seq> for Counted {
        fn core(&mut self) -> &mut EngineCore<Seq> {
            &mut self.core
        }

        fn release(&mut self, seq: &mut Seq) {
            self.free += std::mem::take(&mut self.held[seq.0.order as usize - 1]);
        }

        fn end(&mut self, seq: Seq, end: Result<Finish, WorkerError>) {
            seq.0.finish(end);
        }

        fn grow(&mut self, seq: &mut Seq, blocks: usize) -> bool {
            let held = &mut self.held[seq.0.order as usize - 1];
            while *held < blocks {
                if self.free == 0 {
                    return false;
                }
                self.free -= 1;
                *held += 1;
            }
            true
        }

        fn preempt(&mut self, seq: &mut Seq) {
            self.free += std::mem::take(&mut self.held[seq.0.order as usize - 1]);
            seq.0.computed = 0;
        }
    }

    fn ticket(prompt: usize, max_tokens: usize, priority: i32) -> (Ticket, mpsc::UnboundedReceiver<JobEvent>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut ticket = Ticket::local(GenRequest::greedy((0..prompt as u32).collect(), max_tokens), tx);
        ticket.priority = priority;
        (ticket, rx)
    }

    fn admit(core: &mut EngineCore<Seq>, ticket: Ticket, capacity: usize) -> Option<Seq> {
        let retention = RetentionSection::default();
        let pipeline = Pipeline { block_tokens: 16, retention: &retention, write_through: WriteThrough::G2G3 };
        core.admit(ticket, &pipeline, capacity, Salt(1), Instant::now()).map(Seq)
    }

    fn failed(rx: &mut mpsc::UnboundedReceiver<JobEvent>) -> Option<WorkerError> {
        match rx.try_recv() {
            Ok(JobEvent::Failed(e)) => Some(e),
            _ => None,
        }
    }

    #[tokio::test]
    async fn refusals_are_answered_at_admission_and_admissions_are_numbered() {
        let mut core = EngineCore::new(16);
        let (empty, mut rx) = ticket(0, 4, 0);
        assert!(admit(&mut core, empty, 10).is_none());
        assert!(matches!(failed(&mut rx), Some(WorkerError::EmptyPrompt)));
        let (long, mut rx) = ticket(200, 100, 0);
        assert!(admit(&mut core, long, 10).is_none(), "19 blocks do not fit 10");
        assert!(matches!(failed(&mut rx), Some(WorkerError::TooLong { needed: 19, capacity: 10, .. })));
        let (a, _rx) = ticket(20, 4, 0);
        let (b, _rx2) = ticket(20, 4, 0);
        let (a, b) = (admit(&mut core, a, 10).expect("fits"), admit(&mut core, b, 10).expect("fits"));
        assert_eq!((a.0.order, b.0.order), (1, 2));
        assert_eq!(a.0.chain.len(), 1, "one complete block of 16 hashed");
        assert_eq!(core.len(), 0, "admitted is not yet entered");
    }

    #[tokio::test]
    async fn an_overloaded_onboarding_waits_only_beside_a_batch_and_waiters_resume_by_priority() {
        let mut core = EngineCore::new(16);
        let take = |core: &mut EngineCore<Seq>, priority| {
            let (t, rx) = ticket(40, 4, priority);
            std::mem::forget(rx);
            admit(core, t, 100).expect("admitted")
        };
        let first = take(&mut core, 0);
        assert!(core.may_enter(&first.0, 0, 0), "alone it always comes in");
        assert!(matches!(core.entered(first, Err(WorkerError::Overloaded)), Entry::Fails(_, WorkerError::Overloaded)));
        let first = take(&mut core, 0);
        assert!(matches!(core.entered(first, Ok(())), Entry::Runs));
        let (low, high) = (take(&mut core, 0), take(&mut core, 5));
        assert!(!core.may_enter(&low.0, 0, 3), "3 blocks and a page for the running one need 4");
        assert!(core.may_enter(&low.0, 1, 3), "one block shared with the batch takes no page");
        let Entry::Waits(low) = core.entered(low, Err(WorkerError::Overloaded)) else { panic!("waits") };
        core.wait(low);
        core.wait(high);
        assert!(!core.has_room(), "nobody new while some wait");
        assert_eq!(core.len(), 3);
        assert!(core.next_to_resume(|_| 0, 3).is_none(), "no room yet");
        let back = core.next_to_resume(|_| 0, 4).expect("room");
        assert_eq!((back.0.ticket.priority, back.0.order), (5, 4), "the higher priority first");
        assert_eq!(core.len(), 2, "taken out while it is onboarded");
        assert!(matches!(core.entered(back, Ok(())), Entry::Runs));
        let cancelled = core.cancel_last().expect("the last admitted is in the batch");
        assert_eq!(cancelled.0.order, 4);
        assert_eq!(core.len(), 2);
        assert_eq!(core.drain().count(), 2);
        assert_eq!(core.len(), 0);
    }

    #[tokio::test]
    async fn a_step_keeps_those_that_stay_queues_those_that_yielded_and_hands_back_those_that_end() {
        let mut pages = Counted { core: EngineCore::new(16), free: 1, held: vec![4, 4, 4] };
        for priority in [1, 0, 0] {
            let (t, rx) = ticket(64, 4, priority);
            std::mem::forget(rx);
            let mut seq = admit(&mut pages.core, t, 100).expect("admitted");
            seq.0.computed = 64;
            seq.0.tokens.push(7);
            assert!(pages.entered(seq, Ok(())));
        }
        // Each decoder needs a fifth page; one is free.
        let mut step = pages.core.begin_step();
        step.plan(&mut pages);
        assert_eq!(pages.held, vec![5, 5, 0]);
        assert_eq!(step.chunks, vec![(0, 1), (1, 1)], "the latest of the lowest priority yields");
        step.ended(1, Ok(Finish::Length));
        let core = &mut pages.core;
        let leaving = core.end_step(step);
        assert_eq!(leaving.len(), 1);
        assert_eq!(leaving[0].0.0.order, 2);
        assert_eq!(core.len(), 2, "one stays, one waits");
        assert!(!core.has_room(), "nobody new while one waits");
        let back = core.next_to_resume(|_| 0, 100).expect("room");
        assert_eq!(back.0.order, 3, "the one that yielded comes back");
        assert_eq!(back.0.computed, 0, "its pages went");
        assert_eq!(core.len(), 1, "the one that stayed runs");
    }

    #[tokio::test]
    async fn a_driver_frees_what_a_waiting_or_failed_request_holds_and_ends_the_cancelled_one() {
        let mut pages = Counted { core: EngineCore::new(16), free: 0, held: vec![0; 4] };
        let take = |pages: &mut Counted| {
            let (t, rx) = ticket(40, 4, 0);
            (admit(&mut pages.core, t, 100).expect("admitted"), rx)
        };
        let (first, mut first_rx) = take(&mut pages);
        assert!(pages.entered(first, Ok(())));
        // The second got 2 pages, then G1 ran out: it waits, holding none.
        let (second, _rx) = take(&mut pages);
        pages.held[1] = 2;
        assert!(!pages.entered(second, Err(WorkerError::Overloaded)), "it waits");
        assert_eq!((pages.held[1], pages.free), (0, 2), "its pages went back");
        // The third failed for another reason: it ends so, its pages back too.
        let (third, mut third_rx) = take(&mut pages);
        pages.held[2] = 1;
        assert!(pages.entered(third, Err(WorkerError::EmptyPrompt)));
        assert!(matches!(failed(&mut third_rx), Some(WorkerError::EmptyPrompt)));
        assert_eq!((pages.held[2], pages.free), (0, 3));
        // The last admitted (the third) is gone: cancelling ends nothing else.
        pages.cancel_last();
        assert_eq!(pages.core.len(), 2);
        // A fourth runs; its caller goes away: it ends at once, stopped.
        let (fourth, mut fourth_rx) = take(&mut pages);
        assert!(pages.entered(fourth, Ok(())));
        pages.cancel_last();
        assert!(matches!(fourth_rx.try_recv(), Ok(JobEvent::Done(o)) if matches!(o.finish, Finish::Stop)));
        assert_eq!(pages.core.len(), 2);
        assert!(first_rx.try_recv().is_err(), "the first still runs");
    }
}
