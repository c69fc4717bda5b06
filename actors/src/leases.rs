//! Leases: block chains that clients asked to keep (`cache_control` breakpoints,
//! `prompt_cache_retention`), each held by its session until it expires or the session ends.
//!
//! The [`LeaseBook`] is the node's record of who leases which block until when. The tiers
//! consult it as blocks arrive (a block written through to G2 or G3 after its lease was granted
//! is leased there on arrival), and every grant or release is applied at once to the blocks
//! already resident. In the lowest tier that keeps a block (G3, or G2 for a node without G3 or a
//! region that stops at G2) a lease is a registry lease: the block is never evicted while it
//! lives. In the tiers above it is a hold: under pressure the block is demoted to the tier below
//! instead of dropped, and loaded back from there on the next hit.
//!
//! Several sessions may lease one block (a shared system prompt): it stays leased until the last
//! of their leases ends.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dynamo_config::{RegionKind, TierName};
use dynamo_tiering::block::{BlockHash, BlockMap};
use dynamo_tiering::registry::{Millis, TierRegistry};

/// Who holds a lease: a session (its key's digest), or 0 for a request without one.
pub type LeaseOwner = u64;

/// Whose lease it is: the session that holds it (0: none) and its tenant (a digest of the
/// tenant's name; 0 for the shared tenant).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Lessee {
    /// The session holding the lease; 0 for a request without one.
    pub owner: LeaseOwner,
    /// The tenant whose budget share it counts against.
    pub tenant: u64,
}

/// The longest a lease holds a block in G1 past a turn that used it (see [`LeaseBook::g1_hold`]).
pub const G1_LEASE_HOLD: Millis = 60_000;

/// The node's leases, by block.
///
/// The book may hold at most its budget of blocks (the lease budget of the lowest tier,
/// `tiers.lease_budget` of it). Past it, leases give way before anything else is taken, and
/// they give way from the tenant holding the most: one tenant's day-long leases take its own
/// share, never another tenant's. Within that tenant, a lease no session holds (it lives by its
/// TTL alone) goes before a session's, and the one that ends soonest first.
#[derive(Debug)]
pub struct LeaseBook {
    inner: Mutex<Book>,
    /// Blocks the book may hold.
    budget: usize,
    /// Leases that gave way to the budget so far.
    degraded: AtomicU64,
    /// Blocks in the book (live or not yet swept), so that a node nobody leases on answers
    /// without taking the lock.
    blocks: AtomicUsize,
    /// Held across a change of the book and its application to the registries
    /// ([`LeasedTiers`]), so that two of them (a release and a write-through arrival of one
    /// block) never interleave into a registry lease the book no longer has. Taken before any
    /// registry lock, never while one is held.
    applying: Mutex<()>,
    /// Grants, refreshes and releases so far.
    changes: AtomicU64,
}

impl Default for LeaseBook {
    fn default() -> Self {
        Self::with_budget(usize::MAX)
    }
}

/// A lease as saved across a restart: the block, its deadline (Unix milliseconds) and its TTL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SavedLease {
    /// The leased block.
    pub hash: BlockHash,
    /// When it ends unless a hit runs its TTL again.
    pub until: Millis,
    /// How long each hit extends it.
    pub ttl: Millis,
}

/// Why a saved lease file was not used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LeaseFileError {
    /// Not a lease file of this format.
    #[error("not a dynamo-node lease file (bad magic or version)")]
    Format,
    /// Shorter or longer than its header says.
    #[error("truncated: {len} bytes for {count} leases")]
    Length {
        /// Bytes read.
        len: usize,
        /// Leases the header announces.
        count: u64,
    },
    /// Its checksum does not match its contents.
    #[error("checksum mismatch")]
    Checksum,
}

const LEASE_FILE_MAGIC: &[u8; 8] = b"DNLEASE1";
const LEASE_RECORD: usize = 16 + 8 + 8;

/// The longest lease any API can ask for (OpenAI's `prompt_cache_retention: "24h"`).
pub const MAX_LEASE_TTL: Millis = 24 * 3600 * 1000;

/// The largest lease file of a store of `slots` G3 blocks (one lease per block at most).
pub fn file_bytes(slots: u64) -> u64 {
    24 + LEASE_RECORD as u64 * slots
}

/// `saved` as a restart may honour it: no TTL over [`MAX_LEASE_TTL`], no deadline further than
/// that from `now` (a damaged or forged file cannot make a lease that never ends).
pub fn clamp(mut saved: Vec<SavedLease>, now: Millis) -> Vec<SavedLease> {
    for l in &mut saved {
        l.ttl = l.ttl.min(MAX_LEASE_TTL);
        l.until = l.until.min(now.saturating_add(MAX_LEASE_TTL));
    }
    saved
}

/// The bytes of a lease file: magic, count, records (hash, deadline, TTL; little-endian), and
/// an xxh3 checksum of everything before it.
pub fn encode(leases: &[SavedLease]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + leases.len() * LEASE_RECORD + 8);
    out.extend_from_slice(LEASE_FILE_MAGIC);
    out.extend_from_slice(&(leases.len() as u64).to_le_bytes());
    for l in leases {
        out.extend_from_slice(&l.hash.0.to_le_bytes());
        out.extend_from_slice(&l.until.to_le_bytes());
        out.extend_from_slice(&l.ttl.to_le_bytes());
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// The leases of a file [`encode`] wrote; anything else is refused whole (its length is checked
/// against its header before anything is allocated, its checksum before anything is read).
pub fn decode(bytes: &[u8]) -> Result<Vec<SavedLease>, LeaseFileError> {
    if bytes.len() < 24 || &bytes[..8] != LEASE_FILE_MAGIC {
        return Err(LeaseFileError::Format);
    }
    let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let count = word(8);
    let expected = (count as usize).checked_mul(LEASE_RECORD).and_then(|n| n.checked_add(24));
    if expected != Some(bytes.len()) {
        return Err(LeaseFileError::Length { len: bytes.len(), count });
    }
    let body = bytes.len() - 8;
    if xxhash_rust::xxh3::xxh3_64(&bytes[..body]) != word(body) {
        return Err(LeaseFileError::Checksum);
    }
    Ok(bytes[16..body]
        .chunks_exact(LEASE_RECORD)
        .map(|r| SavedLease {
            hash: BlockHash(u128::from_le_bytes(r[..16].try_into().expect("16 bytes"))),
            until: u64::from_le_bytes(r[16..24].try_into().expect("8 bytes")),
            ttl: u64::from_le_bytes(r[24..32].try_into().expect("8 bytes")),
        })
        .collect())
}

#[derive(Clone, Copy, Debug)]
struct Holder {
    who: Lessee,
    until: Millis,
    ttl: Millis,
}

/// A leased block: its region (what its leases mean in G2) and its holders.
#[derive(Debug)]
struct Leased {
    region: RegionKind,
    holders: Vec<Holder>,
}

impl Leased {
    /// The deadline of its latest lease (0 for none).
    fn until(&self) -> Millis {
        self.holders.iter().map(|l| l.until).max().unwrap_or(0)
    }
}

/// A lease whose deadline fell (it gave way to the budget): what the tiers must undo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fell {
    /// The block.
    pub hash: BlockHash,
    /// Its region.
    pub region: RegionKind,
    /// Its deadline before.
    pub was: Millis,
    /// Its deadline now (the leases left on it; 0 for none).
    pub left: Millis,
}

/// What a grant did: blocks newly leased, and leases that gave way to the budget.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Granted {
    /// Blocks of the chain that had no live lease before.
    pub new: usize,
    /// Blocks whose deadline fell because the book was past its budget.
    pub fell: Vec<Fell>,
}

#[derive(Debug, Default)]
struct Book {
    /// Each leased block's holders.
    by_block: BlockMap<Leased>,
    /// Every holder by deadline: expired leases leave from the front.
    deadlines: BTreeSet<(Millis, BlockHash, Lessee)>,
    /// Every holder by tenant, in the order they give way to the budget: no session first, then
    /// soonest ending.
    by_tenant: HashMap<u64, BTreeSet<(bool, Millis, BlockHash, LeaseOwner)>>,
}

impl Book {
    fn index(&mut self, hash: BlockHash, l: Holder) {
        self.deadlines.insert((l.until, hash, l.who));
        self.by_tenant.entry(l.who.tenant).or_default().insert((l.who.owner != 0, l.until, hash, l.who.owner));
    }

    fn unindex(&mut self, hash: BlockHash, l: Holder) {
        self.deadlines.remove(&(l.until, hash, l.who));
        if let Some(set) = self.by_tenant.get_mut(&l.who.tenant) {
            set.remove(&(l.who.owner != 0, l.until, hash, l.who.owner));
            if set.is_empty() {
                self.by_tenant.remove(&l.who.tenant);
            }
        }
    }

    /// Adds `new` to `hash`'s holders (a block of `region`); a later deadline or longer TTL of
    /// the same lessee extends its lease.
    fn hold(&mut self, hash: BlockHash, region: RegionKind, new: Holder) {
        let leased = self.by_block.entry(hash).or_insert_with(|| Leased { region, holders: Vec::new() });
        let old = match leased.holders.iter_mut().find(|l| l.who == new.who) {
            Some(l) => {
                let old = *l;
                l.until = l.until.max(new.until);
                l.ttl = l.ttl.max(new.ttl);
                Some((old, *l))
            }
            None => {
                leased.holders.push(new);
                None
            }
        };
        match old {
            Some((old, now)) => {
                self.unindex(hash, old);
                self.index(hash, now);
            }
            None => self.index(hash, new),
        }
    }

    /// Ends `who`'s lease on `hash`, if it has one.
    fn drop_holder(&mut self, hash: BlockHash, who: Lessee) {
        let Some(leased) = self.by_block.get_mut(&hash) else { return };
        let Some(i) = leased.holders.iter().position(|l| l.who == who) else { return };
        let l = leased.holders.swap_remove(i);
        if leased.holders.is_empty() {
            self.by_block.remove(&hash);
        }
        self.unindex(hash, l);
    }

    /// Sets the deadline of every lease on `hash` to at least `now + its TTL`; the block's new
    /// deadline.
    fn extend(&mut self, hash: BlockHash, now: Millis) -> Millis {
        let Some(leased) = self.by_block.get_mut(&hash) else { return 0 };
        let before = leased.holders.clone();
        for l in &mut leased.holders {
            l.until = l.until.max(now.saturating_add(l.ttl));
        }
        let after = leased.holders.clone();
        let until = leased.until();
        for (old, new) in before.into_iter().zip(after) {
            if old.until != new.until {
                self.unindex(hash, old);
                self.index(hash, new);
            }
        }
        until
    }

    /// Drops every lease over at `now`.
    fn sweep(&mut self, now: Millis) {
        while let Some(&(until, hash, who)) = self.deadlines.first()
            && until <= now
        {
            self.drop_holder(hash, who);
        }
    }

    /// While more than `budget` blocks are leased, the tenant holding the most (`prefer` on a
    /// tie) gives up its first lease in give-way order; returns the blocks whose deadline fell.
    fn fit(&mut self, budget: usize, prefer: u64) -> Vec<Fell> {
        let mut fell: Vec<Fell> = Vec::new();
        while self.by_block.len() > budget {
            let most = self.by_tenant.values().map(BTreeSet::len).max().unwrap_or(0);
            let tenant = if self.by_tenant.get(&prefer).map(BTreeSet::len) == Some(most) {
                prefer
            } else {
                match self.by_tenant.iter().find(|(_, set)| set.len() == most) {
                    Some((&t, _)) => t,
                    None => break,
                }
            };
            let Some(&(_, _, hash, owner)) = self.by_tenant.get(&tenant).and_then(BTreeSet::first) else { break };
            let Some(leased) = self.by_block.get(&hash) else { break };
            let (region, was) = (leased.region, leased.until());
            self.drop_holder(hash, Lessee { owner, tenant });
            let left = self.by_block.get(&hash).map_or(0, Leased::until);
            match fell.iter_mut().find(|f| f.hash == hash) {
                Some(f) => f.left = left,
                None => fell.push(Fell { hash, region, was, left }),
            }
        }
        fell
    }
}

impl LeaseBook {
    /// A book that holds at most `budget` blocks (see [`LeaseBook`]).
    pub fn with_budget(budget: usize) -> Self {
        Self {
            inner: Mutex::default(),
            budget,
            degraded: AtomicU64::new(0),
            blocks: AtomicUsize::new(0),
            applying: Mutex::default(),
            changes: AtomicU64::new(0),
        }
    }

    /// Blocks the book may hold.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Leases that gave way to the budget so far.
    pub fn degraded(&self) -> u64 {
        self.degraded.load(Ordering::Relaxed)
    }

    /// Leases `chain` (blocks with their regions) to `who` for `ttl` from `now` (a later
    /// deadline of the same lessee extends it). Returns how many of its blocks had no live lease
    /// before (the tokens newly cached, as Anthropic's `cache_creation_input_tokens` counts
    /// them), and the leases that gave way to the budget.
    pub fn grant(&self, who: Lessee, chain: &[(BlockHash, RegionKind)], ttl: Millis, now: Millis) -> Granted {
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        book.sweep(now);
        let until = now.saturating_add(ttl);
        let mut new = 0;
        for &(h, region) in chain {
            if !book.by_block.contains_key(&h) {
                new += 1;
            }
            book.hold(h, region, Holder { who, until, ttl });
        }
        let fell = book.fit(self.budget, who.tenant);
        self.degraded.fetch_add(fell.len() as u64, Ordering::Relaxed);
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
        Granted { new, fell }
    }

    /// A request hit `chain`: every live lease on its leading leased blocks runs its TTL again
    /// from `now`. Returns the new deadline of each refreshed block (leases are prefixes, so the
    /// walk stops at the first block without one).
    pub fn refresh(&self, chain: &[BlockHash], now: Millis) -> Vec<Millis> {
        if self.is_empty() {
            return Vec::new();
        }
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        book.sweep(now);
        let mut out = Vec::new();
        for &h in chain {
            if !book.by_block.contains_key(&h) {
                break;
            }
            out.push(book.extend(h, now));
        }
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
        out
    }

    /// Ends `who`'s leases on `chain`; returns, for each block, the deadline of the leases that
    /// remain on it (0 for none).
    pub fn release(&self, who: Lessee, chain: &[BlockHash], now: Millis) -> Vec<Millis> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        book.sweep(now);
        let left = chain
            .iter()
            .map(|&h| {
                book.drop_holder(h, who);
                book.by_block.get(&h).map_or(0, Leased::until)
            })
            .collect();
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
        left
    }

    /// Leases `h` (a block G3 recovered) to no session of the shared tenant until `until`, each
    /// hit extending it by `ttl` (a lease saved before a restart). False when the book is at
    /// its budget (a restart never pushes out what it restored first).
    fn restore(&self, h: BlockHash, until: Millis, ttl: Millis, now: Millis) -> bool {
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        book.sweep(now);
        if book.by_block.len() >= self.budget && !book.by_block.contains_key(&h) {
            return false;
        }
        // Its region is unknown: System stands for it (in G3, the only tier it is in, every
        // region's lease is a pin).
        book.hold(h, RegionKind::System, Holder { who: Lessee::default(), until, ttl });
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
        true
    }

    /// Whether the book holds no block (then nothing is leased).
    pub fn is_empty(&self) -> bool {
        self.blocks.load(Ordering::Relaxed) == 0
    }

    /// The deadline of `h`'s live leases, if it has any.
    pub fn until(&self, h: BlockHash, now: Millis) -> Option<Millis> {
        if self.is_empty() {
            return None;
        }
        self.lock().by_block.get(&h)?.holders.iter().map(|l| l.until).filter(|&d| d > now).max()
    }

    /// How long G1 holds `h` after a turn that used it: while its lease lives, but at most
    /// [`G1_LEASE_HOLD`] (a session's next turn usually comes sooner and holds it again; a
    /// released lease leaves G1 at most that late, since G1 is the workers' and the book cannot
    /// end its holds).
    pub fn g1_hold(&self, h: BlockHash, now: Millis) -> Option<Millis> {
        Some(self.until(h, now)?.min(now.saturating_add(G1_LEASE_HOLD)))
    }

    /// Every live lease, one per block (its latest deadline, and the TTL of the lease that ends
    /// then), for [`encode`].
    pub fn snapshot(&self, now: Millis) -> Vec<SavedLease> {
        let book = self.lock();
        let mut out: Vec<SavedLease> = book
            .by_block
            .iter()
            .filter_map(|(&hash, leased)| {
                let last = leased.holders.iter().filter(|l| l.until > now).max_by_key(|l| l.until)?;
                Some(SavedLease { hash, until: last.until, ttl: last.ttl })
            })
            .collect();
        out.sort_by_key(|l| l.hash.0);
        out
    }

    /// Book changes so far (grants, refreshes, releases): a saver writes only when it moved.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    /// Blocks with a live lease.
    pub fn live(&self, now: Millis) -> usize {
        self.lock().by_block.values().filter(|leased| leased.holders.iter().any(|l| l.until > now)).count()
    }

    /// Serialises a book change with its application to the tiers (see `applying`).
    fn applying(&self) -> std::sync::MutexGuard<'_, ()> {
        self.applying.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Where leases take effect: a [`LeaseBook`], the clock its deadlines run on, and the registries
/// below G1 that pin or hold the leased blocks. The node's tiers and a simulated node implement
/// it, and both get the rules below from it, once: the lowest tier that keeps a block pins it
/// (G3; G2 without G3, or for a region that stops at G2), the tiers above only hold it, so under
/// pressure it is demoted instead of dropped.
pub trait LeasedTiers: Send + Sync + std::fmt::Debug {
    /// Who leases which blocks until when.
    fn book(&self) -> &LeaseBook;

    /// Now on the clock of the registries' deadlines (Unix milliseconds on a real node, virtual
    /// milliseconds in a simulation).
    fn now(&self) -> Millis;

    /// Runs `f` on each registry of `tier` (G2 or G3) these leases cover: the node's own, or
    /// every node's of a simulated cluster that shares one book.
    fn each_registry(&self, tier: TierName, f: &mut dyn FnMut(&mut TierRegistry));

    /// Runs `f` on each copy of block `hash` in `tier` (G2 or G3) that the tiers keep under
    /// another name, with that name: a block a vLLM engine stored through the engine endpoint
    /// under its own key ([`crate::engine_names`]). None by default.
    fn each_copy(&self, _tier: TierName, _hash: BlockHash, _f: &mut dyn FnMut(&mut TierRegistry, BlockHash)) {}

    /// Whether the node has `tier` at all.
    fn has_tier(&self, tier: TierName) -> bool;

    /// The lowest tier that keeps blocks of `region` (its retention's `lowest_tier`).
    fn lowest_tier(&self, region: RegionKind) -> TierName;

    /// Whether G2 is the lowest tier that keeps blocks of `region`, so it pins their leases.
    fn g2_pins(&self, region: RegionKind) -> bool {
        !self.has_tier(TierName::G3) || self.lowest_tier(region) <= TierName::G2
    }

    /// Leases `chain` (its blocks with their regions, in prefix order) to `who` for `ttl`, in
    /// the book and in every tier below G1 that holds its blocks now; returns how many blocks
    /// were newly leased. Blocks that arrive later are leased on arrival ([`Self::arrived`]).
    /// Leases that gave way to the book's budget (the tenant holding the most gives first) fall
    /// back to plain retention here too.
    fn lease(&self, who: Lessee, chain: &[(BlockHash, RegionKind)], ttl: Millis, now: Millis) -> usize {
        let _applying = self.book().applying();
        let granted = self.book().grant(who, chain, ttl, now);
        // What gave way first, so that no tier is past its budget even for a moment.
        for fell in &granted.fell {
            self.fall(fell.hash, fell.region, fell.was, fell.left);
        }
        for &(h, region) in chain {
            self.apply(h, region, self.book().until(h, now).unwrap_or(0));
        }
        granted.new
    }

    /// Ends `who`'s leases on `chain`: blocks nobody else leases fall back to plain retention.
    fn unlease(&self, who: Lessee, chain: &[(BlockHash, RegionKind)], now: Millis) {
        let hashes: Vec<BlockHash> = chain.iter().map(|&(h, _)| h).collect();
        let _applying = self.book().applying();
        let before: Vec<Millis> = hashes.iter().map(|&h| self.book().until(h, now).unwrap_or(0)).collect();
        let left = self.book().release(who, &hashes, now);
        for ((&(h, region), left), was) in chain.iter().zip(left).zip(before) {
            self.fall(h, region, was, left);
        }
    }

    /// `hash`'s deadline went from `was` down to `left` (0: no lease is left on it).
    fn fall(&self, hash: BlockHash, region: RegionKind, was: Millis, left: Millis) {
        if !self.g2_pins(region) && left < was {
            // G2 only held it: that hold ends with the lease (down to what other leases need).
            self.each_registry(TierName::G2, &mut |r| drop(r.end_hold(hash, was)));
            self.each_copy(TierName::G2, hash, &mut |r, copy| drop(r.end_hold(copy, was)));
        }
        self.apply(hash, region, left);
    }

    /// A request hit `chain` (block `i` of region `region(i)`): the leases on its leased prefix
    /// run their TTL again, in the book and in the tiers.
    fn refresh(&self, chain: &[BlockHash], region: &dyn Fn(usize) -> RegionKind, now: Millis) {
        if self.book().is_empty() {
            return;
        }
        let _applying = self.book().applying();
        for (i, until) in self.book().refresh(chain, now).into_iter().enumerate() {
            self.apply(chain[i], region(i), until);
        }
    }

    /// A block of `region` arrived in `tier` (G2 or G3): it is leased there if the book says so.
    fn arrived(&self, tier: TierName, hash: BlockHash, region: RegionKind, now: Millis) {
        if self.book().until(hash, now).is_none() {
            return;
        }
        // Read again once no grant or release is being applied: a release that ran between the
        // first look and now has ended it in the book, and it must not be leased here after.
        let _applying = self.book().applying();
        let Some(until) = self.book().until(hash, now) else { return };
        let pin = tier == TierName::G3 || self.g2_pins(region);
        self.each_registry(tier, &mut |r| lease_in(r, hash, until, pin));
    }

    /// Restores `saved` leases (from before a restart) on the blocks G3 recovered, to no session:
    /// each ends at its deadline unless hits run it again. Leases already over, and blocks G3 no
    /// longer has, are skipped. Returns how many were restored.
    fn restore(&self, saved: &[SavedLease], now: Millis) -> usize {
        let _applying = self.book().applying();
        let mut restored = 0;
        for l in saved.iter().filter(|l| l.until > now) {
            let mut present = false;
            self.each_registry(TierName::G3, &mut |r| present |= r.contains(l.hash));
            if !present {
                continue;
            }
            if !self.book().restore(l.hash, l.until, l.ttl, now) {
                break;
            }
            self.each_registry(TierName::G3, &mut |r| lease_in(r, l.hash, l.until, true));
            restored += 1;
        }
        restored
    }

    /// Sets `hash`'s lease to `until` (0 ends it) in every tier below G1, on its copies under
    /// other names too.
    fn apply(&self, hash: BlockHash, region: RegionKind, until: Millis) {
        let pin = self.g2_pins(region);
        self.each_registry(TierName::G2, &mut |r| lease_in(r, hash, until, pin));
        self.each_registry(TierName::G3, &mut |r| lease_in(r, hash, until, true));
        self.each_copy(TierName::G2, hash, &mut |r, copy| lease_in(r, copy, until, pin));
        self.each_copy(TierName::G3, hash, &mut |r, copy| lease_in(r, copy, until, true));
    }
}

/// Sets `hash`'s lease in `registry` to `until` (0 ends it), as a lease or, without `pin`, a hold.
fn lease_in(registry: &mut TierRegistry, hash: BlockHash, until: Millis, pin: bool) {
    if !pin {
        let _ = registry.hold(hash, until);
        return;
    }
    let _ = registry.unlease(hash);
    if until > 0 {
        let _ = registry.lease(hash, until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u128) -> Vec<BlockHash> {
        (1..=n).map(BlockHash).collect()
    }

    fn who(owner: LeaseOwner) -> Lessee {
        Lessee { owner, tenant: 0 }
    }

    fn sys(chain: &[BlockHash]) -> Vec<(BlockHash, RegionKind)> {
        chain.iter().map(|&h| (h, RegionKind::System)).collect()
    }

    #[test]
    fn a_block_stays_leased_until_its_last_holder_lets_go() {
        let book = LeaseBook::default();
        assert_eq!(book.grant(who(1), &sys(&chain(3)), 1000, 0).new, 3, "all new");
        assert_eq!(book.grant(who(2), &sys(&chain(4)), 1990, 10).new, 1, "only the fourth block is new");
        assert_eq!(book.grant(who(1), &sys(&chain(3)), 1480, 20).new, 0, "a refresh creates nothing");
        assert_eq!(book.until(BlockHash(1), 30), Some(2000));
        assert_eq!(book.release(who(2), &chain(4), 40), vec![1500, 1500, 1500, 0], "owner 1 still leases three");
        assert_eq!(book.until(BlockHash(4), 40), None);
        // A hit runs the TTL again, on the leased prefix only.
        assert_eq!(book.refresh(&chain(4), 900), vec![2380, 2380, 2380], "900 + its longest TTL, 1480");
        assert_eq!(book.release(who(1), &chain(3), 950), vec![0, 0, 0]);
        assert_eq!(book.live(950), 0);
        assert!(book.is_empty(), "released blocks leave the book");
        // An expired lease is no lease: granting again creates the blocks anew.
        book.grant(who(3), &sys(&chain(2)), 40, 960);
        assert_eq!(book.until(BlockHash(1), 1000), None, "expired at its deadline");
        assert_eq!(book.refresh(&chain(2), 1000), Vec::<Millis>::new());
        assert_eq!(book.grant(who(3), &sys(&chain(2)), 300, 1000).new, 2);
        assert!(book.lock().deadlines.len() == 2 && book.lock().by_tenant[&0].len() == 2, "expired entries left");
    }

    /// One tenant's day-long leases past the budget take its own share, not another tenant's
    /// five-minute lease (the lowest tier's budget once gave way from the lease ending soonest,
    /// whoever held it); within the tenant, leases no session holds go first.
    #[test]
    fn past_the_budget_the_tenant_holding_the_most_gives_way() {
        use dynamo_tiering::registry::{BlockMeta, PolicyKind};
        const DAY: Millis = MAX_LEASE_TTL;
        let meta = BlockMeta { parent: None, region: RegionKind::System, priority: 90, retain_until: 0 };
        let g3 = Mutex::new(TierRegistry::new(32, PolicyKind::Lru).with_lease_budget(8));
        for h in 1..=32 {
            g3.lock().unwrap().insert(BlockHash(h), meta, 1).unwrap();
        }
        let tiers = OneTier {
            book: LeaseBook::with_budget(8),
            g2: Mutex::new(TierRegistry::new(8, PolicyKind::Lru)),
            g3: Some(g3),
        };
        let (a, b) = (Lessee { owner: 7, tenant: 0xa }, Lessee { owner: 9, tenant: 0xb });
        let b_chain = sys(&[BlockHash(1), BlockHash(2), BlockHash(3)]);
        assert_eq!(tiers.lease(b, &b_chain, 300_000, 1), 3);
        // Tenant a: a sessionless day-long lease of two blocks, then its session leases twelve.
        let a_free = Lessee { owner: 0, tenant: 0xa };
        tiers.lease(a_free, &sys(&[BlockHash(10), BlockHash(11)]), DAY, 1);
        for h in 12..24 {
            tiers.lease(a, &sys(&[BlockHash(h)]), DAY - 1_000 + h as u64, 1);
        }
        let g3_leases = tiers.g3.as_ref().unwrap().lock().unwrap().stats().leases;
        assert_eq!(g3_leases.live, 8, "the budget holds");
        assert_eq!(g3_leases.degradations_total, 0, "the book gave way before the tier had to");
        for (h, _) in &b_chain {
            assert_eq!(tiers.book.until(*h, 2), Some(300_001), "tenant b's lease lives on");
        }
        assert_eq!(tiers.book.until(BlockHash(10), 2), None, "a's sessionless leases went first");
        assert_eq!(tiers.book.until(BlockHash(11), 2), None);
        let kept: Vec<u128> = (12..24).filter(|&h| tiers.book.until(BlockHash(h), 2).is_some()).collect();
        assert_eq!(kept, [19, 20, 21, 22, 23], "then a's session leases that end soonest");
        assert_eq!(tiers.book.degraded(), 9);
        // Tenant b growing past its share now takes from a, still the tenant holding the most.
        tiers.lease(b, &sys(&[BlockHash(4)]), 300_000, 2);
        assert_eq!(tiers.book.until(BlockHash(19), 3), None);
        assert_eq!(tiers.book.until(BlockHash(4), 3), Some(300_002));
        // Past its share, b gives way from its own.
        tiers.lease(b, &sys(&[BlockHash(5)]), 300_000, 3);
        assert_eq!(tiers.book.live(4), 8);
        assert_eq!(tiers.book.until(BlockHash(5), 4), Some(300_003));
        assert_eq!(tiers.book.until(BlockHash(1), 4), None, "b's soonest ending went");
        assert_eq!(tiers.g3.as_ref().unwrap().lock().unwrap().stats().leases.live, 8);
    }

    /// A G2 registry and maybe a G3 one (without it G2 pins).
    #[derive(Debug)]
    struct OneTier {
        book: LeaseBook,
        g2: Mutex<TierRegistry>,
        g3: Option<Mutex<TierRegistry>>,
    }

    impl LeasedTiers for OneTier {
        fn book(&self) -> &LeaseBook {
            &self.book
        }
        fn now(&self) -> Millis {
            1
        }
        fn each_registry(&self, tier: TierName, f: &mut dyn FnMut(&mut TierRegistry)) {
            if tier == TierName::G2 {
                // Widen the window between reading the book and writing the registry.
                std::thread::yield_now();
                f(&mut self.g2.lock().unwrap());
            }
            if let (TierName::G3, Some(g3)) = (tier, &self.g3) {
                f(&mut g3.lock().unwrap());
            }
        }
        fn has_tier(&self, tier: TierName) -> bool {
            tier == TierName::G2 || (tier == TierName::G3 && self.g3.is_some())
        }
        fn lowest_tier(&self, _: RegionKind) -> TierName {
            TierName::G3
        }
    }

    #[test]
    fn a_release_racing_an_arrival_never_leaves_a_lease_the_book_has_not() {
        use dynamo_tiering::registry::{BlockMeta, PolicyKind};
        let tiers = std::sync::Arc::new(OneTier {
            book: LeaseBook::default(),
            g2: Mutex::new(TierRegistry::new(8, PolicyKind::Lru)),
            g3: None,
        });
        let h = BlockHash(7);
        let chain = [(h, RegionKind::System)];
        let meta = BlockMeta { parent: None, region: RegionKind::System, priority: 90, retain_until: 0 };
        for round in 0..5 {
            let leasing = {
                let tiers = tiers.clone();
                std::thread::spawn(move || {
                    for _ in 0..500 {
                        tiers.lease(who(1), &chain, 1_000_000, 1);
                        tiers.unlease(who(1), &chain, 1);
                    }
                })
            };
            while !leasing.is_finished() {
                // The block leaves G2 and is written through again, as G2 eviction and a later
                // write-through do.
                let _ = tiers.g2.lock().unwrap().remove(h);
                let _ = tiers.g2.lock().unwrap().insert(h, meta, 1);
                tiers.arrived(TierName::G2, h, RegionKind::System, 1);
            }
            leasing.join().unwrap();
            assert!(tiers.book.until(h, 1).is_none(), "the last word was a release");
            assert_eq!(tiers.g2.lock().unwrap().stats().leases.live, 0, "round {round}: a stale lease in G2");
        }
    }

    /// One tier set whose G2 and G3 also keep a copy of block 7 under the name 107 (as an
    /// engine stores what the node calls 7).
    #[derive(Debug)]
    struct WithCopy(OneTier);

    impl LeasedTiers for WithCopy {
        fn book(&self) -> &LeaseBook {
            &self.0.book
        }
        fn now(&self) -> Millis {
            1
        }
        fn each_registry(&self, tier: TierName, f: &mut dyn FnMut(&mut TierRegistry)) {
            self.0.each_registry(tier, f);
        }
        fn each_copy(&self, tier: TierName, hash: BlockHash, f: &mut dyn FnMut(&mut TierRegistry, BlockHash)) {
            if hash == BlockHash(7) {
                self.0.each_registry(tier, &mut |r| f(r, BlockHash(107)));
            }
        }
        fn has_tier(&self, tier: TierName) -> bool {
            self.0.has_tier(tier)
        }
        fn lowest_tier(&self, region: RegionKind) -> TierName {
            self.0.lowest_tier(region)
        }
    }

    #[test]
    fn a_lease_holds_an_engines_copy_of_its_block_as_it_is_granted_refreshed_and_released() {
        use dynamo_tiering::registry::{BlockMeta, PolicyKind};
        let meta = BlockMeta { parent: None, region: RegionKind::Conversation, priority: 50, retain_until: 0 };
        let registry = || {
            let mut r = TierRegistry::new(8, PolicyKind::Lru);
            r.insert(BlockHash(107), meta, 1).unwrap();
            Mutex::new(r)
        };
        let tiers = WithCopy(OneTier { book: LeaseBook::default(), g2: registry(), g3: Some(registry()) });
        let copy = |tier: TierName| {
            let mut view = None;
            tiers.0.each_registry(tier, &mut |r| view = r.meta(BlockHash(107)));
            let view = view.expect("the copy stays");
            (view.retain_until, view.lease_until)
        };
        let chain = [(BlockHash(7), RegionKind::Conversation)];
        tiers.lease(who(1), &chain, 1000, 10);
        assert_eq!(copy(TierName::G2), (1010, 0), "G2 holds it (G3 is the lowest tier)");
        assert_eq!(copy(TierName::G3), (0, 1010), "G3 pins it");
        tiers.refresh(&[BlockHash(7)], &|_| RegionKind::Conversation, 500);
        assert_eq!(copy(TierName::G2), (1500, 0), "a hit runs it again");
        assert_eq!(copy(TierName::G3), (0, 1500));
        tiers.unlease(who(1), &chain, 600);
        assert_eq!(copy(TierName::G2), (0, 0), "released: plain retention");
        assert_eq!(copy(TierName::G3), (0, 0));
    }

    /// Restored leases never outlive what an API can ask for: `u64::MAX` deadlines and TTLs (a
    /// forged file with a valid checksum) become a day from now.
    #[test]
    fn restored_deadlines_and_ttls_are_clamped_to_a_day() {
        let now = 1_000_000;
        let saved = vec![
            SavedLease { hash: BlockHash(1), until: u64::MAX, ttl: u64::MAX },
            SavedLease { hash: BlockHash(2), until: now + 5_000, ttl: 300_000 },
        ];
        let decoded = decode(&encode(&saved)).expect("a valid file");
        let clamped = clamp(decoded, now);
        assert_eq!((clamped[0].until, clamped[0].ttl), (now + MAX_LEASE_TTL, MAX_LEASE_TTL));
        assert_eq!((clamped[1].until, clamped[1].ttl), (now + 5_000, 300_000), "a sane lease is unchanged");
        assert_eq!(file_bytes(2), encode(&saved).len() as u64, "the bound fits a full store's file exactly");
    }

    #[test]
    fn saved_leases_come_back_on_the_blocks_g3_recovered_and_a_damaged_file_is_refused() {
        use dynamo_tiering::registry::{BlockMeta, PolicyKind};
        let meta = BlockMeta { parent: None, region: RegionKind::System, priority: 90, retain_until: 0 };
        let node = |resident: &[u128]| {
            let g3 = Mutex::new(TierRegistry::new(8, PolicyKind::Lru));
            for &h in resident {
                g3.lock().unwrap().insert(BlockHash(h), meta, 1).unwrap();
            }
            OneTier { book: LeaseBook::default(), g2: Mutex::new(TierRegistry::new(8, PolicyKind::Lru)), g3: Some(g3) }
        };
        let before = node(&[1, 2, 3]);
        let chain: Vec<(BlockHash, RegionKind)> = (1..=3).map(|h| (BlockHash(h), RegionKind::System)).collect();
        before.lease(who(5), &chain[..2], 1000, 10);
        before.lease(who(6), &chain, 300, 20);
        let changes = before.book.changes();
        let saved = before.book.snapshot(30);
        assert_eq!(
            saved,
            [
                SavedLease { hash: BlockHash(1), until: 1010, ttl: 1000 },
                SavedLease { hash: BlockHash(2), until: 1010, ttl: 1000 },
                SavedLease { hash: BlockHash(3), until: 320, ttl: 300 },
            ]
        );
        assert_eq!(before.book.changes(), changes, "a snapshot changes nothing");
        let bytes = encode(&saved);
        assert_eq!(decode(&bytes), Ok(saved.clone()));

        // After a restart G3 recovered blocks 1 and 3 only; at 400 block 3's lease is over.
        let after = node(&[1, 3]);
        assert_eq!(after.restore(&decode(&bytes).unwrap(), 400), 1);
        assert_eq!(after.book.until(BlockHash(1), 400), Some(1010));
        assert_eq!(after.book.until(BlockHash(2), 400), None, "not recovered: not leased");
        assert_eq!(after.g3.as_ref().unwrap().lock().unwrap().stats().leases.live, 1, "pinned in G3");
        // A hit runs a restored lease again by its own TTL.
        assert_eq!(after.book.refresh(&[BlockHash(1)], 900), vec![1900]);

        // Damage of any kind refuses the whole file.
        let mut flipped = bytes.clone();
        flipped[20] ^= 1;
        assert_eq!(decode(&flipped), Err(LeaseFileError::Checksum));
        assert_eq!(decode(&bytes[..bytes.len() - 1]), Err(LeaseFileError::Length { len: bytes.len() - 1, count: 3 }));
        let mut huge = bytes.clone();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&huge), Err(LeaseFileError::Length { .. })), "checked before allocating");
        assert_eq!(decode(b"not a lease file at all!"), Err(LeaseFileError::Format));
        assert_eq!(decode(&encode(&[])), Ok(Vec::new()));
    }
}
