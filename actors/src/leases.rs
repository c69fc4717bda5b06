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

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use dynamo_config::{RegionKind, TierName};
use dynamo_tiering::block::{BlockHash, BlockMap};
use dynamo_tiering::registry::{Millis, TierRegistry};

/// Who holds a lease: a session (its key's digest), or 0 for a request without one.
pub type LeaseOwner = u64;

/// The longest a lease holds a block in G1 past a turn that used it (see [`LeaseBook::g1_hold`]).
pub const G1_LEASE_HOLD: Millis = 60_000;

/// The node's leases, by block.
#[derive(Debug, Default)]
pub struct LeaseBook {
    inner: Mutex<Book>,
    /// Blocks in the book (live or not yet swept), so that a node nobody leases on answers
    /// without taking the lock.
    blocks: AtomicUsize,
    /// Held across a change of the book and its application to the registries
    /// ([`LeasedTiers`]), so that two of them (a release and a write-through arrival of one
    /// block) never interleave into a registry lease the book no longer has. Taken before any
    /// registry lock, never while one is held.
    applying: Mutex<()>,
    /// Grants, refreshes and releases so far.
    changes: std::sync::atomic::AtomicU64,
}

/// Adds `new` to a block's holders; a later deadline or longer TTL of the same owner extends its
/// lease.
fn hold(holders: &mut Vec<Holder>, new: Holder) {
    match holders.iter_mut().find(|l| l.owner == new.owner) {
        Some(l) => {
            l.until = l.until.max(new.until);
            l.ttl = l.ttl.max(new.ttl);
        }
        None => holders.push(new),
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
    owner: LeaseOwner,
    until: Millis,
    ttl: Millis,
}

#[derive(Debug, Default)]
struct Book {
    /// Each leased block's holders.
    by_block: BlockMap<Vec<Holder>>,
    /// Blocks at the last sweep of expired leases: the next one runs when twice as many are kept.
    swept_at: usize,
}

impl LeaseBook {
    /// Leases `chain` to `owner` for `ttl` from `now` (a later deadline of the same owner's
    /// extends it). Returns how many of its blocks had no live lease before: the tokens newly
    /// cached, as Anthropic's `cache_creation_input_tokens` counts them.
    pub fn grant(&self, owner: LeaseOwner, chain: &[BlockHash], ttl: Millis, now: Millis) -> usize {
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        let until = now.saturating_add(ttl);
        let mut new = 0;
        for &h in chain {
            let holders = book.by_block.entry(h).or_default();
            holders.retain(|l| l.until > now);
            if holders.is_empty() {
                new += 1;
            }
            hold(holders, Holder { owner, until, ttl });
        }
        if book.by_block.len() > 2 * book.swept_at.max(1024) {
            book.by_block.retain(|_, holders| {
                holders.retain(|l| l.until > now);
                !holders.is_empty()
            });
            book.swept_at = book.by_block.len();
        }
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
        new
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
        let mut out = Vec::new();
        for h in chain {
            let Some(holders) = book.by_block.get_mut(h) else { break };
            holders.retain(|l| l.until > now);
            if holders.is_empty() {
                break;
            }
            for l in holders.iter_mut() {
                l.until = l.until.max(now.saturating_add(l.ttl));
            }
            out.push(holders.iter().map(|l| l.until).max().unwrap_or(0));
        }
        out
    }

    /// Ends `owner`'s leases on `chain`; returns, for each block, the deadline of the leases
    /// that remain on it (0 for none).
    pub fn release(&self, owner: LeaseOwner, chain: &[BlockHash], now: Millis) -> Vec<Millis> {
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        let left = chain
            .iter()
            .map(|h| {
                let Some(holders) = book.by_block.get_mut(h) else { return 0 };
                holders.retain(|l| l.owner != owner && l.until > now);
                let left = holders.iter().map(|l| l.until).max().unwrap_or(0);
                if holders.is_empty() {
                    book.by_block.remove(h);
                }
                left
            })
            .collect();
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
        left
    }

    /// Leases `h` to `owner` until `until`, each hit extending it by `ttl` (a lease saved before
    /// a restart).
    fn restore(&self, owner: LeaseOwner, h: BlockHash, until: Millis, ttl: Millis) {
        self.changes.fetch_add(1, Ordering::Relaxed);
        let mut book = self.lock();
        hold(book.by_block.entry(h).or_default(), Holder { owner, until, ttl });
        self.blocks.store(book.by_block.len(), Ordering::Relaxed);
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
        self.lock().by_block.get(&h)?.iter().map(|l| l.until).filter(|&d| d > now).max()
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
            .filter_map(|(&hash, holders)| {
                let last = holders.iter().filter(|l| l.until > now).max_by_key(|l| l.until)?;
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
        self.lock().by_block.values().filter(|holders| holders.iter().any(|l| l.until > now)).count()
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

    /// Whether the node has `tier` at all.
    fn has_tier(&self, tier: TierName) -> bool;

    /// The lowest tier that keeps blocks of `region` (its retention's `lowest_tier`).
    fn lowest_tier(&self, region: RegionKind) -> TierName;

    /// Whether G2 is the lowest tier that keeps blocks of `region`, so it pins their leases.
    fn g2_pins(&self, region: RegionKind) -> bool {
        !self.has_tier(TierName::G3) || self.lowest_tier(region) <= TierName::G2
    }

    /// Leases `chain` (its blocks with their regions, in prefix order) to `owner` for `ttl`, in
    /// the book and in every tier below G1 that holds its blocks now; returns how many blocks
    /// were newly leased. Blocks that arrive later are leased on arrival ([`Self::arrived`]).
    fn lease(&self, owner: LeaseOwner, chain: &[(BlockHash, RegionKind)], ttl: Millis, now: Millis) -> usize {
        let hashes: Vec<BlockHash> = chain.iter().map(|&(h, _)| h).collect();
        let _applying = self.book().applying();
        let new = self.book().grant(owner, &hashes, ttl, now);
        for &(h, region) in chain {
            self.apply(h, region, self.book().until(h, now).unwrap_or(0));
        }
        new
    }

    /// Ends `owner`'s leases on `chain`: blocks nobody else leases fall back to plain retention.
    fn unlease(&self, owner: LeaseOwner, chain: &[(BlockHash, RegionKind)], now: Millis) {
        let hashes: Vec<BlockHash> = chain.iter().map(|&(h, _)| h).collect();
        let _applying = self.book().applying();
        let before: Vec<Millis> = hashes.iter().map(|&h| self.book().until(h, now).unwrap_or(0)).collect();
        let left = self.book().release(owner, &hashes, now);
        for ((&(h, region), until), was) in chain.iter().zip(left).zip(before) {
            if !self.g2_pins(region) && until < was {
                // G2 only held it: that hold ends with the lease (down to what other leases need).
                self.each_registry(TierName::G2, &mut |r| drop(r.end_hold(h, was)));
            }
            self.apply(h, region, until);
        }
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
            self.book().restore(0, l.hash, l.until, l.ttl);
            self.each_registry(TierName::G3, &mut |r| lease_in(r, l.hash, l.until, true));
            restored += 1;
        }
        restored
    }

    /// Sets `hash`'s lease to `until` (0 ends it) in every tier below G1.
    fn apply(&self, hash: BlockHash, region: RegionKind, until: Millis) {
        let pin = self.g2_pins(region);
        self.each_registry(TierName::G2, &mut |r| lease_in(r, hash, until, pin));
        self.each_registry(TierName::G3, &mut |r| lease_in(r, hash, until, true));
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

    #[test]
    fn a_block_stays_leased_until_its_last_holder_lets_go() {
        let book = LeaseBook::default();
        assert_eq!(book.grant(1, &chain(3), 1000, 0), 3, "all new");
        assert_eq!(book.grant(2, &chain(4), 1990, 10), 1, "only the fourth block is new");
        assert_eq!(book.grant(1, &chain(3), 1480, 20), 0, "a refresh creates nothing");
        assert_eq!(book.until(BlockHash(1), 30), Some(2000));
        assert_eq!(book.release(2, &chain(4), 40), vec![1500, 1500, 1500, 0], "owner 1 still leases three");
        assert_eq!(book.until(BlockHash(4), 40), None);
        // A hit runs the TTL again, on the leased prefix only.
        assert_eq!(book.refresh(&chain(4), 900), vec![2380, 2380, 2380], "900 + its longest TTL, 1480");
        assert_eq!(book.release(1, &chain(3), 950), vec![0, 0, 0]);
        assert_eq!(book.live(950), 0);
        assert!(book.is_empty(), "released blocks leave the book");
        // An expired lease is no lease: granting again creates the blocks anew.
        book.grant(3, &chain(2), 40, 960);
        assert_eq!(book.until(BlockHash(1), 1000), None, "expired at its deadline");
        assert_eq!(book.refresh(&chain(2), 1000), Vec::<Millis>::new());
        assert_eq!(book.grant(3, &chain(2), 300, 1000), 2);
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
                        tiers.lease(1, &chain, 1_000_000, 1);
                        tiers.unlease(1, &chain, 1);
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
        before.lease(5, &chain[..2], 1000, 10);
        before.lease(6, &chain, 300, 20);
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
