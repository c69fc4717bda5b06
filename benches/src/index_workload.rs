//! A fixed, deterministic stream of prefix-index operations replayed from a Mooncake-style trace.
//!
//! The trace has one JSON object per line with `hash_ids`: one id per prompt block, where equal ids
//! mean equal block content *and* equal prefix. [`Workload::from_trace`] turns it into what a global
//! prefix index sees in service, for a given number of workers:
//!
//! - each request first **looks up** its whole prompt ([`Op::Lookup`]);
//! - a built-in reference index then routes it to a worker: the one with the lowest
//!   `uncached blocks + active blocks` (blocks of that worker's requests among the last `workers`
//!   requests — a stand-in for its queue), ties broken round-robin from a cursor that advances per
//!   request, so the choice is fixed for a given trace and worker count;
//! - that worker first **evicts** ([`Op::Removed`]) what its LRU capacity model needs to make room,
//!   then **stores** ([`Op::Stored`]) the blocks of the prompt it did not hold yet, chained to the
//!   last block it did hold.
//!
//! The capacity model is a per-worker LRU over blocks: every block of a routed request is touched
//! with the request's tick, and the victim is the least recently used block, the deepest first among
//! equals. A block is touched whenever any of its descendants is, so a child is always evicted before
//! its parent: each worker's cache stays prefix-closed, removals come leaves first, and the blocks a
//! worker lacks for a prompt are always a suffix of it. The capacity per worker is
//! `capacity_fraction × unique blocks / workers`, raised to the longest prompt if that is smaller.
//!
//! Blocks live in an arena of `(local, seq)` hash pairs ([`Workload::local_hashes`],
//! [`Workload::seq_hashes`]) that operations index by range. `local` is a per-block content hash
//! derived from the hash id (Dynamo's `LocalBlockHash`); `seq` chains the prefix
//! (`seq[0] = local[0]`, `seq[i] = chain(seq[i-1], local[i])`, Dynamo's
//! `ExternalSequenceBlockHash`). The chaining function is a parameter so that a peer whose index
//! recomputes it (Dynamo's `PositionalIndexer`) can be fed its own.
//!
//! [`Workload::reference_answers`] replays the stream by brute force and gives the exact
//! longest-prefix answer of every lookup, to check an index against.
//!
//! This file uses only `std` and `serde_json`, so another workspace can include it with `#[path]`.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::fmt;
use std::ops::Range;
use std::path::Path;

/// One operation of the stream. Block ranges index [`Workload::local_hashes`] and
/// [`Workload::seq_hashes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Find, for every worker, how many leading blocks of this prompt it holds.
    Lookup {
        /// The prompt's blocks, in order.
        blocks: Range<u32>,
    },
    /// `worker` now holds `blocks`, a chain continuing the block whose sequence hash is `parent`
    /// (`None`: the chain starts at the first block of a prompt).
    Stored {
        /// The worker that stored the blocks.
        worker: u32,
        /// Sequence hash of the block the new chain continues, which the worker holds.
        parent: Option<u64>,
        /// The stored blocks, parent first.
        blocks: Range<u32>,
    },
    /// `worker` evicted `blocks`, each after its descendants.
    Removed {
        /// The worker that evicted the blocks.
        worker: u32,
        /// The evicted blocks, leaves before parents.
        blocks: Range<u32>,
    },
}

/// How to build a [`Workload`].
#[derive(Debug, Clone, Copy)]
pub struct WorkloadConfig {
    /// Number of workers the requests are routed over.
    pub workers: u32,
    /// Total cache capacity of all workers together, as a fraction of the trace's unique blocks.
    pub capacity_fraction: f64,
    /// Per-block content hash from a trace hash id.
    pub local_hash: fn(u64) -> u64,
    /// Chained hash: `chain(parent_seq, local)`.
    pub chain: fn(u64, u64) -> u64,
}

impl WorkloadConfig {
    /// `workers` workers, 40 % of the unique blocks cached in all, and the std-only default hashes
    /// ([`default_local_hash`], [`default_chain`]).
    pub fn new(workers: u32) -> Self {
        Self { workers, capacity_fraction: 0.4, local_hash: default_local_hash, chain: default_chain }
    }
}

/// SplitMix64 finaliser of the hash id: distinct ids give distinct local hashes.
pub fn default_local_hash(hash_id: u64) -> u64 {
    splitmix64(hash_id ^ 0x6b76_5f72_6f75_7465)
}

/// A std-only chaining function (not Dynamo's): a SplitMix64 mix of parent and local hash.
pub fn default_chain(parent: u64, local: u64) -> u64 {
    splitmix64(parent.rotate_left(29) ^ local.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Why a trace could not be turned into a workload.
#[derive(Debug)]
pub enum WorkloadError {
    /// The trace file could not be read.
    Io(std::io::Error),
    /// A line is not a JSON object with an array of integer `hash_ids`.
    Parse {
        /// 1-based line number.
        line: usize,
        /// What was wrong.
        reason: String,
    },
    /// A hash id appears with two different prefixes, which the trace format rules out.
    InconsistentPrefix {
        /// 1-based line number of the second occurrence.
        line: usize,
        /// The hash id.
        hash_id: u64,
    },
    /// Two different blocks got the same sequence hash (the chaining function collided).
    HashCollision {
        /// The colliding sequence hash.
        seq: u64,
    },
    /// The configuration cannot produce a stream (no workers, or an empty trace).
    Config(String),
}

impl fmt::Display for WorkloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io(e) => write!(f, "reading the trace: {e}"),
            Self::Parse { line, reason } => write!(f, "trace line {line}: {reason}"),
            Self::InconsistentPrefix { line, hash_id } => {
                write!(f, "trace line {line}: hash id {hash_id} appears under two different prefixes")
            }
            Self::HashCollision { seq } => write!(f, "two blocks share the sequence hash {seq:#x}"),
            Self::Config(reason) => write!(f, "workload configuration: {reason}"),
        }
    }
}

impl std::error::Error for WorkloadError {}

/// A replayable stream of index operations; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Per-block content hash of each arena entry.
    pub local_hashes: Vec<u64>,
    /// Chained sequence hash of each arena entry.
    pub seq_hashes: Vec<u64>,
    /// The stream, in order: per request a `Lookup`, then at most one `Removed` and one `Stored`
    /// for the worker it was routed to.
    pub ops: Vec<Op>,
    /// Σ lookup blocks + Σ stored blocks + Σ removed blocks.
    pub block_ops: u64,
    /// Number of requests (= number of lookups).
    pub requests: u64,
    /// Number of workers.
    pub workers: u32,
    /// Per-worker capacity in blocks.
    pub capacity: u32,
    /// Distinct blocks in the trace.
    pub unique_blocks: u64,
    /// Σ blocks of all lookups.
    pub lookup_blocks: u64,
    /// Σ blocks of all `Stored` ops.
    pub stored_blocks: u64,
    /// Σ blocks of all `Removed` ops.
    pub removed_blocks: u64,
    /// For each request, the index of its `Lookup` in `ops`; its events follow up to the next one.
    pub request_starts: Vec<u32>,
    /// For each request, the worker it was routed to.
    pub routed: Vec<u32>,
}

/// One worker's LRU: keyed by (last use tick, deepest first, block).
#[derive(Default)]
struct Lru {
    order: BTreeSet<(u32, Reverse<u32>, u32)>,
    entry: HashMap<u32, (u32, u32)>,
}

impl Lru {
    fn touch(&mut self, block: u32, depth: u32, tick: u32) {
        if let Some((old_tick, old_depth)) = self.entry.insert(block, (tick, depth)) {
            self.order.remove(&(old_tick, Reverse(old_depth), block));
        }
        self.order.insert((tick, Reverse(depth), block));
    }

    fn evict(&mut self) -> Option<u32> {
        let (_, _, block) = self.order.pop_first()?;
        self.entry.remove(&block);
        Some(block)
    }

    fn len(&self) -> usize {
        self.entry.len()
    }
}

/// Reads the `hash_ids` of every line of a JSONL trace.
pub fn read_trace(path: &Path) -> Result<Vec<Vec<u64>>, WorkloadError> {
    let text = std::fs::read_to_string(path).map_err(WorkloadError::Io)?;
    parse_trace(&text)
}

/// Parses the `hash_ids` of every non-empty line of a JSONL trace.
pub fn parse_trace(text: &str) -> Result<Vec<Vec<u64>>, WorkloadError> {
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parse_err = |reason: String| WorkloadError::Parse { line: i + 1, reason };
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| parse_err(e.to_string()))?;
        let ids = value
            .get("hash_ids")
            .and_then(serde_json::Value::as_array)
            .ok_or_else(|| parse_err("no `hash_ids` array".into()))?;
        let ids = ids
            .iter()
            .map(|v| v.as_u64().ok_or_else(|| parse_err(format!("hash id {v} is not a u64"))))
            .collect::<Result<Vec<_>, _>>()?;
        prompts.push(ids);
    }
    Ok(prompts)
}

impl Workload {
    /// Reads a trace file and builds the stream for `config`.
    pub fn from_trace(path: &Path, config: WorkloadConfig) -> Result<Self, WorkloadError> {
        Self::from_prompts(&read_trace(path)?, config)
    }

    /// Builds the stream from the prompts' hash ids (one `Vec` per request, in trace order).
    pub fn from_prompts(prompts: &[Vec<u64>], config: WorkloadConfig) -> Result<Self, WorkloadError> {
        let workers = config.workers as usize;
        if workers == 0 || prompts.iter().all(Vec::is_empty) {
            return Err(WorkloadError::Config("need at least one worker and one block".into()));
        }

        // Dense block ids with their hashes; check that every id always has the same parent.
        let mut dense: HashMap<u64, u32> = HashMap::new();
        let mut parent_of: Vec<Option<u32>> = Vec::new();
        let mut block_local: Vec<u64> = Vec::new();
        let mut block_seq: Vec<u64> = Vec::new();
        let mut seen_seq: HashSet<u64> = HashSet::new();
        let mut prompt_blocks: Vec<Vec<u32>> = Vec::with_capacity(prompts.len());
        for (line, ids) in prompts.iter().enumerate() {
            let mut blocks = Vec::with_capacity(ids.len());
            let mut parent: Option<u32> = None;
            for &id in ids {
                let b = match dense.get(&id) {
                    Some(&b) => {
                        if parent_of[b as usize] != parent {
                            return Err(WorkloadError::InconsistentPrefix { line: line + 1, hash_id: id });
                        }
                        b
                    }
                    None => {
                        let b = block_local.len() as u32;
                        let local = (config.local_hash)(id);
                        let seq = match parent {
                            None => local,
                            Some(p) => (config.chain)(block_seq[p as usize], local),
                        };
                        if !seen_seq.insert(seq) {
                            return Err(WorkloadError::HashCollision { seq });
                        }
                        dense.insert(id, b);
                        parent_of.push(parent);
                        block_local.push(local);
                        block_seq.push(seq);
                        b
                    }
                };
                blocks.push(b);
                parent = Some(b);
            }
            prompt_blocks.push(blocks);
        }
        let unique = block_local.len();
        let longest = prompt_blocks.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = ((config.capacity_fraction * unique as f64 / workers as f64).ceil() as usize).max(longest);

        // Routing state: which workers hold each block (a bitset per block), LRUs, recent load.
        let words = workers.div_ceil(64);
        let mut holders = vec![0u64; unique * words];
        let mut lrus: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
        let mut active = vec![0u64; workers];
        let mut window: VecDeque<(usize, u64)> = VecDeque::with_capacity(workers + 1);

        let mut w = Workload {
            local_hashes: Vec::new(),
            seq_hashes: Vec::new(),
            ops: Vec::new(),
            block_ops: 0,
            requests: 0,
            workers: config.workers,
            capacity: capacity as u32,
            unique_blocks: unique as u64,
            lookup_blocks: 0,
            stored_blocks: 0,
            removed_blocks: 0,
            request_starts: Vec::with_capacity(prompts.len()),
            routed: Vec::with_capacity(prompts.len()),
        };
        let mut prefix = vec![0usize; workers];
        let mut cand = vec![0u64; words];
        for (tick, blocks) in prompt_blocks.iter().enumerate() {
            let tick = tick as u32;
            let n = blocks.len();
            let start = w.local_hashes.len() as u32;
            for &b in blocks {
                w.local_hashes.push(block_local[b as usize]);
                w.seq_hashes.push(block_seq[b as usize]);
            }
            w.request_starts.push(w.ops.len() as u32);
            w.ops.push(Op::Lookup { blocks: start..start + n as u32 });
            w.requests += 1;
            w.lookup_blocks += n as u64;

            // Longest cached prefix per worker: narrow the candidate set block by block.
            prefix.fill(0);
            if let Some(&first) = blocks.first() {
                cand.copy_from_slice(&holders[first as usize * words..][..words]);
            } else {
                cand.fill(0);
            }
            for (i, &b) in blocks.iter().enumerate().skip(1) {
                let row = &holders[b as usize * words..][..words];
                for (k, c) in cand.iter_mut().enumerate() {
                    let mut dropped = *c & !row[k];
                    while dropped != 0 {
                        prefix[k * 64 + dropped.trailing_zeros() as usize] = i;
                        dropped &= dropped - 1;
                    }
                    *c &= row[k];
                }
            }
            if n > 0 {
                for (k, &c) in cand.iter().enumerate() {
                    let mut left = c;
                    while left != 0 {
                        prefix[k * 64 + left.trailing_zeros() as usize] = n;
                        left &= left - 1;
                    }
                }
            }

            // Route: fewest uncached + active blocks, ties round-robin from a per-request cursor.
            let cursor = tick as usize % workers;
            let chosen = (0..workers)
                .map(|k| (cursor + k) % workers)
                .min_by_key(|&x| (n - prefix[x]) as u64 + active[x])
                .unwrap_or(0);
            w.routed.push(chosen as u32);
            let have = prefix[chosen];
            let need = n - have;

            let lru = &mut lrus[chosen];
            for (depth, &b) in blocks.iter().enumerate().take(have) {
                lru.touch(b, depth as u32, tick);
            }
            // Evict to make room; the touched prefix is the most recent, so it survives.
            let removed_start = w.local_hashes.len() as u32;
            while lru.len() + need > capacity {
                let Some(victim) = lru.evict() else { break };
                holders[victim as usize * words + chosen / 64] &= !(1u64 << (chosen % 64));
                w.local_hashes.push(block_local[victim as usize]);
                w.seq_hashes.push(block_seq[victim as usize]);
            }
            let removed_end = w.local_hashes.len() as u32;
            if removed_end > removed_start {
                w.ops.push(Op::Removed { worker: chosen as u32, blocks: removed_start..removed_end });
                w.removed_blocks += u64::from(removed_end - removed_start);
            }
            if need > 0 {
                for (depth, &b) in blocks.iter().enumerate().skip(have) {
                    lru.touch(b, depth as u32, tick);
                    holders[b as usize * words + chosen / 64] |= 1u64 << (chosen % 64);
                }
                let parent = (have > 0).then(|| block_seq[blocks[have - 1] as usize]);
                w.ops.push(Op::Stored { worker: chosen as u32, parent, blocks: start + have as u32..start + n as u32 });
                w.stored_blocks += need as u64;
            }

            // Recent load: the blocks of the last `workers` requests, per worker.
            active[chosen] += n as u64;
            window.push_back((chosen, n as u64));
            if window.len() > workers
                && let Some((old, len)) = window.pop_front()
            {
                active[old] -= len;
            }
        }
        w.block_ops = w.lookup_blocks + w.stored_blocks + w.removed_blocks;
        Ok(w)
    }

    /// The operations of request `r`: its `Lookup` followed by its events.
    pub fn request_ops(&self, r: usize) -> &[Op] {
        let start = self.request_starts[r] as usize;
        let end = self.request_starts.get(r + 1).map_or(self.ops.len(), |&e| e as usize);
        &self.ops[start..end]
    }

    /// Block operations of request `r` (lookup blocks + stored + removed).
    pub fn request_block_ops(&self, r: usize) -> u64 {
        self.request_ops(r).iter().map(|op| op.blocks().len() as u64).sum()
    }

    /// Splits the requests over `lanes` threads: a request goes, lookup and events, to the lane of
    /// the worker it was routed to (`worker % lanes`), so every worker's events stay in order on one
    /// thread, and each lane keeps the trace order of its requests.
    pub fn lanes(&self, lanes: usize) -> Vec<Vec<u32>> {
        let mut out = vec![Vec::new(); lanes.max(1)];
        for (r, &worker) in self.routed.iter().enumerate() {
            out[worker as usize % lanes.max(1)].push(r as u32);
        }
        out
    }

    /// The exact answer of every lookup, in stream order: `(worker, leading blocks held)` for each
    /// worker holding at least the first block, sorted by worker. Computed by brute force (a set of
    /// sequence hashes per worker, walked per worker), independently of the routing index above.
    pub fn reference_answers(&self) -> Vec<Vec<(u32, u32)>> {
        let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); self.workers as usize];
        let mut answers = Vec::with_capacity(self.requests as usize);
        for op in &self.ops {
            match op {
                Op::Lookup { blocks } => {
                    let seq = &self.seq_hashes[range(blocks)];
                    let mut answer = Vec::new();
                    for (worker, set) in held.iter().enumerate() {
                        let len = seq.iter().take_while(|h| set.contains(h)).count();
                        if len > 0 {
                            answer.push((worker as u32, len as u32));
                        }
                    }
                    answers.push(answer);
                }
                Op::Stored { worker, blocks, .. } => {
                    held[*worker as usize].extend(&self.seq_hashes[range(blocks)]);
                }
                Op::Removed { worker, blocks } => {
                    for h in &self.seq_hashes[range(blocks)] {
                        held[*worker as usize].remove(h);
                    }
                }
            }
        }
        answers
    }
}

impl Op {
    /// The op's block range.
    pub fn blocks(&self) -> Range<u32> {
        match self {
            Op::Lookup { blocks } | Op::Stored { blocks, .. } | Op::Removed { blocks, .. } => blocks.clone(),
        }
    }
}

/// A `Range<u32>` as a `Range<usize>` for slicing the arena.
pub fn range(blocks: &Range<u32>) -> Range<usize> {
    blocks.start as usize..blocks.end as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Vec<Vec<u64>> {
        vec![vec![0, 1, 2], vec![0, 1, 3], vec![0, 4], vec![0, 1, 2, 5], vec![6, 7], vec![0, 1, 3, 8]]
    }

    #[test]
    fn stream_is_consistent_and_counted() {
        let mut config = WorkloadConfig::new(2);
        config.capacity_fraction = 0.3;
        let w = Workload::from_prompts(&tiny(), config).unwrap();
        assert_eq!(w.requests, 6);
        assert_eq!(w.lookup_blocks, 18);
        assert_eq!(w.block_ops, w.lookup_blocks + w.stored_blocks + w.removed_blocks);
        assert!(w.removed_blocks > 0, "capacity {} must force evictions", w.capacity);

        // Replay: a Stored parent is held, stored blocks are new, removed blocks were held and
        // have no held child left behind (prefix-closed per worker).
        let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); 2];
        for op in &w.ops {
            match op {
                Op::Lookup { .. } => {}
                Op::Stored { worker, parent, blocks } => {
                    let set = &mut held[*worker as usize];
                    if let Some(p) = parent {
                        assert!(set.contains(p));
                    }
                    for h in &w.seq_hashes[range(blocks)] {
                        assert!(set.insert(*h));
                    }
                    assert!(set.len() <= w.capacity as usize);
                }
                Op::Removed { worker, blocks } => {
                    for h in &w.seq_hashes[range(blocks)] {
                        assert!(held[*worker as usize].remove(h));
                    }
                }
            }
        }
        // The reference answer of the last request: worker it went to holds 0,1,3 (request 2).
        assert_eq!(w.reference_answers().len(), 6);
    }

    #[test]
    fn chains_and_lanes() {
        let w = Workload::from_prompts(&tiny(), WorkloadConfig::new(3)).unwrap();
        // Same hash id, same (local, seq) wherever it appears.
        assert_eq!(w.seq_hashes[0], w.local_hashes[0]);
        assert_eq!(w.seq_hashes[1], default_chain(w.seq_hashes[0], w.local_hashes[1]));
        let lanes = w.lanes(2);
        assert_eq!(lanes.iter().map(Vec::len).sum::<usize>(), 6);
        for (k, lane) in lanes.iter().enumerate() {
            assert!(lane.windows(2).all(|p| p[0] < p[1]));
            assert!(lane.iter().all(|&r| w.routed[r as usize] as usize % 2 == k));
        }
    }

    #[test]
    fn rejects_inconsistent_prefixes() {
        let bad = vec![vec![0, 1], vec![2, 1]];
        assert!(matches!(
            Workload::from_prompts(&bad, WorkloadConfig::new(1)),
            Err(WorkloadError::InconsistentPrefix { line: 2, hash_id: 1 })
        ));
    }
}
