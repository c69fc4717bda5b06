//! Working-set admission: what the KV-aware router does when more sessions arrive at once than
//! the cache can hold the contexts of.
//!
//! An agent's session comes back every few seconds with its whole conversation; its next turn is
//! cheap only if that conversation is still cached when it does. Serve more sessions at once than
//! the cache holds and every turn evicts another session's context before its next turn: each
//! comes back to a miss and recomputes its context, which keeps the workers busy recomputing,
//! which keeps every session waiting — the thrashing of a virtual memory past its working set
//! (Denning, 1968), with the same cure: load control.
//!
//! The router keeps the sessions it has seen in a *line*, each with its context's tokens of its
//! own (not those its first turn found cached: a system prompt and tools other sessions share).
//! A session's turn is routed when the sessions ahead of it in the line and its own context fit
//! in the line's share of the cache (the workers' G1 together and the node's G2), or when none
//! is ahead; otherwise it waits at the router. New sessions join the back of the line (by priority,
//! then arrival). A turn that has waited `router.admission_max_wait` is routed anyway and its
//! session moves to the front: the sessions served longest are then the ones at the back, and
//! the next to wait — the cache rotates among more sessions than it holds instead of thrashing
//! among all of them. A session leaves the line `router.session_gap` after its last turn (unless
//! a turn of it is waiting or routed later).
//!
//! Under a burst the sessions in the cache run at cache speed and finish sooner, and those that
//! waited start into a cache that holds them; below the cache's size nothing ever waits.
//!
//! How much of the cache the line may fill is measured, not guessed: sessions' contexts share
//! blocks, G2 holds copies of some of what G1 holds and not of the rest, and a session between
//! turns may stay out longer than its neighbours. So the line's share starts at
//! `router.working_set` and is steered by the thrashing it causes — Denning's page-fault
//! frequency: each turn of an admitted session that did not wait is a sample of how much of its
//! session's previous prompt it finds still cached. Past [`FAULT_HIGH`] of those tokens lost
//! over a window of turns, the share shrinks by a fifth; below [`FAULT_LOW`] it grows back, to
//! `router.working_set` at most (additive increase, multiplicative decrease).
//!
//! This module is the bookkeeping, free of actors: the scheduler owns one [`WorkingSet`] and the
//! queue of waiting requests.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::time::Duration;

use tokio::time::Instant;

/// Of the previous prompts' tokens of admitted sessions' turns, the share found evicted past
/// which the line's share of the cache shrinks.
pub const FAULT_HIGH: f64 = 0.05;
/// ... and below which it grows back.
pub const FAULT_LOW: f64 = 0.02;
/// Turns per measurement of the fault rate.
const WINDOW_TURNS: u32 = 32;
/// The least share of its most the line may shrink to.
const FLOOR: f64 = 0.1;

/// A place in the line: higher priority first, then the most recently moved to the front
/// (negative), then arrival (positive).
type Place = (Reverse<i32>, i64);

/// The sessions the router has seen recently, in line.
#[derive(Debug)]
pub struct WorkingSet<K> {
    gap: Duration,
    members: HashMap<K, Member>,
    /// Every member by place, with its tokens.
    line: BTreeMap<Place, (K, usize)>,
    /// Members with no turn waiting, by their last turn (`(when, tiebreak)`), oldest first.
    idle: BTreeMap<(Instant, u64), K>,
    tokens: usize,
    arrivals: i64,
    promotions: i64,
    touches: u64,
    /// The line's share of the cache now, in `[FLOOR, 1]` of its most.
    share: f64,
    /// This window's turns, their previous prompts' tokens, and those found evicted.
    window: (u32, u64, u64),
}

#[derive(Clone, Copy, Debug)]
struct Member {
    place: Place,
    /// Prompt tokens its first turn found cached, not counted as its own (`None` until a turn
    /// was looked up).
    shared: Option<usize>,
    /// Its turns waiting (or being routed).
    waiting: usize,
    /// Its key in `idle` while no turn waits.
    idle: Option<(Instant, u64)>,
    /// The prompt tokens of its last routed turn.
    last_prompt: usize,
}

impl<K: Clone + Eq + Hash> WorkingSet<K> {
    /// An empty line whose members leave `gap` after their last turn.
    pub fn new(gap: Duration) -> Self {
        Self {
            gap,
            members: HashMap::new(),
            line: BTreeMap::new(),
            idle: BTreeMap::new(),
            tokens: 0,
            arrivals: 0,
            promotions: 0,
            touches: 0,
            share: 1.0,
            window: (0, 0, 0),
        }
    }

    /// Drops the members with no turn waiting whose last turn was `gap` or longer before `now`.
    pub fn expire(&mut self, now: Instant) {
        while let Some(entry) = self.idle.first_entry() {
            if entry.key().0 + self.gap > now {
                break;
            }
            let key = entry.remove();
            if let Some(m) = self.members.remove(&key)
                && let Some((_, tokens)) = self.line.remove(&m.place)
            {
                self.tokens -= tokens;
            }
        }
    }

    /// A turn of `key` arrived: a new session joins the back of the line at `priority`.
    pub fn arrive(&mut self, key: K, priority: i32) {
        let member = match self.members.get_mut(&key) {
            Some(m) => m,
            None => {
                self.arrivals += 1;
                let place = (Reverse(priority), self.arrivals);
                self.line.insert(place, (key.clone(), 0));
                self.members.entry(key).or_insert(Member {
                    place,
                    shared: None,
                    waiting: 0,
                    idle: None,
                    last_prompt: 0,
                })
            }
        };
        member.waiting += 1;
        if let Some(at) = member.idle.take() {
            self.idle.remove(&at);
        }
    }

    /// Sets the context of `key`'s waiting turn (`context` prompt tokens, of which `shared` were
    /// found cached: counted as shared on its first lookup) and answers whether it fits: the
    /// tokens of the sessions ahead of it and its own within `capacity`, or none ahead.
    /// A key not in the line (it never arrived) always fits.
    pub fn fits(&mut self, key: &K, context: usize, shared: usize, capacity: usize) -> bool {
        let Some(member) = self.members.get_mut(key) else { return true };
        let own = context.saturating_sub(*member.shared.get_or_insert(shared));
        let place = member.place;
        if let Some((_, tokens)) = self.line.get_mut(&place) {
            self.tokens = self.tokens - *tokens + own;
            *tokens = own;
        }
        let ahead: usize = self.line.range(..place).map(|(_, (_, t))| *t).sum();
        ahead == 0 || ahead.saturating_add(own) <= capacity
    }

    /// The members with a waiting turn that fit now, front first, on their tokens as last set.
    pub fn admissible(&self, capacity: usize) -> Vec<K> {
        let mut ahead = 0usize;
        let mut fit = Vec::new();
        for (key, tokens) in self.line.values() {
            if self.members.get(key).is_some_and(|m| m.waiting > 0)
                && (ahead == 0 || ahead.saturating_add(*tokens) <= capacity)
            {
                fit.push(key.clone());
            }
            ahead = ahead.saturating_add(*tokens);
        }
        fit
    }

    /// A turn of `key` with `prompt` tokens, `cached` of them found cached (the most any worker
    /// would load rather than recompute), is being routed; `waited` whether it waited for room.
    /// A turn that did not wait samples the thrashing: its session's previous prompt, less what
    /// it finds cached, was evicted between its turns. Each window of samples moves the line's
    /// share of the cache.
    pub fn observe(&mut self, key: &K, prompt: usize, cached: usize, waited: bool) {
        let Some(member) = self.members.get_mut(key) else { return };
        let previous = std::mem::replace(&mut member.last_prompt, prompt);
        if waited || previous == 0 {
            return;
        }
        let (turns, expected, lost) = &mut self.window;
        *turns += 1;
        *expected += previous as u64;
        *lost += previous.saturating_sub(cached) as u64;
        if *turns < WINDOW_TURNS {
            return;
        }
        let fault = *lost as f64 / (*expected).max(1) as f64;
        if fault > FAULT_HIGH {
            self.share = (self.share * 0.8).max(FLOOR);
        } else if fault < FAULT_LOW {
            self.share = (self.share + 0.05).min(1.0);
        }
        self.window = (0, 0, 0);
    }

    /// The line's share of the cache now, of its most (`router.working_set`): 1 until turns of
    /// admitted sessions find their previous context evicted.
    pub fn share(&self) -> f64 {
        self.share
    }

    /// Moves `key` to the front of its priority: its turn waited its longest.
    pub fn promote(&mut self, key: &K) {
        let Some(member) = self.members.get_mut(key) else { return };
        let Some(entry) = self.line.remove(&member.place) else { return };
        self.promotions += 1;
        member.place = (member.place.0, -self.promotions);
        self.line.insert(member.place, entry);
    }

    /// A waiting turn of `key` was routed, refused or abandoned at `now`.
    pub fn done(&mut self, key: &K, now: Instant) {
        let Some(member) = self.members.get_mut(key) else { return };
        member.waiting = member.waiting.saturating_sub(1);
        if member.waiting == 0 {
            self.touches += 1;
            let at = (now, self.touches);
            if let Some(old) = member.idle.replace(at) {
                self.idle.remove(&old);
            }
            self.idle.insert(at, key.clone());
        }
    }

    /// When the member idle longest leaves, if one is idle.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.idle.first_key_value().map(|((at, _), _)| *at + self.gap)
    }

    /// Whether `key` is in the line.
    pub fn contains(&self, key: &K) -> bool {
        self.members.contains_key(key)
    }

    /// Members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Their tokens of their own, all together.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(set: &mut WorkingSet<u32>, key: u32, context: usize, shared: usize, capacity: usize, now: Instant) -> bool {
        set.arrive(key, 0);
        let fits = set.fits(&key, context, shared, capacity);
        if fits {
            set.done(&key, now);
        }
        fits
    }

    #[tokio::test(start_paused = true)]
    async fn members_count_their_own_tokens_and_leave_after_the_gap() {
        let mut set = WorkingSet::new(Duration::from_secs(10));
        let t0 = Instant::now();
        // Two sessions over a shared 1000-token system prompt: each counts only its own part.
        assert!(turn(&mut set, 1, 1500, 1000, 10_000, t0));
        assert!(turn(&mut set, 2, 1200, 1000, 10_000, t0 + Duration::from_secs(4)));
        assert_eq!((set.len(), set.tokens()), (2, 700));
        // Session 1 comes back with a longer context; its shared part stays the first turn's.
        assert!(turn(&mut set, 1, 3000, 2900, 10_000, t0 + Duration::from_secs(8)));
        assert_eq!(set.tokens(), 2000 + 200);
        assert_eq!(set.next_expiry(), Some(t0 + Duration::from_secs(14)));
        set.expire(t0 + Duration::from_secs(13));
        assert!(set.contains(&2));
        set.expire(t0 + Duration::from_secs(14));
        assert!(!set.contains(&2) && set.contains(&1));
        assert_eq!(set.tokens(), 2000);
        set.expire(t0 + Duration::from_secs(18));
        assert!(set.is_empty());
        assert_eq!((set.tokens(), set.next_expiry()), (0, None));
    }

    #[tokio::test(start_paused = true)]
    async fn a_turn_fits_behind_the_sessions_ahead_of_it() {
        let mut set = WorkingSet::new(Duration::from_secs(10));
        let now = Instant::now();
        // The first in line always fits, even past the capacity.
        assert!(turn(&mut set, 1, 5000, 0, 1000, now));
        assert!(!turn(&mut set, 2, 10, 0, 1000, now));
        // Session 1's next turn counts a smaller context of its own (its first turn's shared
        // part was unknown to it); session 2, waiting behind it, fits now.
        assert!(turn(&mut set, 1, 600, 0, 1000, now));
        assert_eq!(set.admissible(1000), vec![2]);
        set.done(&2, now);
        // Session 1 grows past what leaves room for 2: 1 still fits (first), 2 no longer.
        assert!(turn(&mut set, 1, 990, 0, 1000, now));
        assert!(!turn(&mut set, 2, 20, 0, 1000, now));
        assert!(set.admissible(1000).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_member_does_not_leave_and_a_promoted_one_goes_first() {
        let mut set = WorkingSet::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(turn(&mut set, 1, 800, 0, 1000, t0));
        assert!(!turn(&mut set, 2, 800, 0, 1000, t0));
        // 2 waits far past the gap and stays in line; 1, idle, leaves.
        set.expire(t0 + Duration::from_secs(60));
        assert!(set.contains(&2) && !set.contains(&1));
        assert_eq!(set.admissible(1000), vec![2]);
        set.done(&2, t0 + Duration::from_secs(60));
        // 3 arrives behind 2; it waits its longest and moves to the front, ahead of 2.
        assert!(!turn(&mut set, 3, 800, 0, 1000, t0 + Duration::from_secs(61)));
        set.promote(&3);
        assert_eq!(set.admissible(1000), vec![3]);
        set.done(&3, t0 + Duration::from_secs(61));
        assert!(!turn(&mut set, 2, 800, 0, 1000, t0 + Duration::from_secs(62)));
    }

    #[test]
    fn the_share_shrinks_while_admitted_sessions_lose_their_context_and_grows_back() {
        let mut set = WorkingSet::new(Duration::from_secs(10));
        for key in 0..WINDOW_TURNS {
            set.arrive(key, 0);
            // A first turn samples nothing: there is no previous prompt.
            set.observe(&key, 1000, 0, false);
        }
        assert_eq!(set.share(), 1.0);
        // A window whose turns find 90% of their previous prompts: 10% lost, past FAULT_HIGH.
        for key in 0..WINDOW_TURNS {
            set.observe(&key, 1000, 900, false);
        }
        assert!((set.share() - 0.8).abs() < 1e-9, "{}", set.share());
        // Turns that waited for room lost their context waiting, not to thrashing: not sampled.
        for key in 0..WINDOW_TURNS {
            set.observe(&key, 1000, 0, true);
        }
        assert!((set.share() - 0.8).abs() < 1e-9);
        // Between the marks nothing moves; below FAULT_LOW the share grows back, to 1 at most.
        for key in 0..WINDOW_TURNS {
            set.observe(&key, 1000, 970, false);
        }
        assert!((set.share() - 0.8).abs() < 1e-9);
        for _ in 0..10 {
            for key in 0..WINDOW_TURNS {
                set.observe(&key, 1000, 1000, false);
            }
        }
        assert_eq!(set.share(), 1.0);
        // Thrashing without end stops at the floor.
        for _ in 0..100 {
            for key in 0..WINDOW_TURNS {
                set.observe(&key, 1000, 0, false);
            }
        }
        assert!((set.share() - FLOOR).abs() < 1e-9);
    }
}
