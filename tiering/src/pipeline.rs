//! The tier pipeline's policy, without I/O: what a worker does with a request's blocks at each
//! point of its life, decided from the request's block hashes and regions, what the tiers hold
//! and the node's one cost model, and handed back as plain values that an executor carries out.
//!
//! Two executors drive it: the real worker (backend copies into G1 pages, G2 host-pool slots, the
//! G3 store on disk) and the simulated one (registries only, time from a calibration). Neither
//! decides anything this module decides, so a replay of the simulated engine measures the
//! product's policy, not a twin of it.
//!
//! - [`Pipeline::admit`]: whether a request can be served by a G1 of so many blocks at all.
//! - [`Pipeline::plan_prefix`]: per block of the prompt's cached prefix, where it comes from —
//!   reused in G1, or loaded from G2, G3 or a peer (G4) — while loading beats recomputing it; the
//!   rest is recomputed. At least the last token is always computed.
//! - [`Pipeline::write_targets`]: which tiers a block goes to once its KV is in G1 (computed, or
//!   loaded from below), as far down as its region's retention allows.
//! - [`Pipeline::turn_end`]: at a turn's end, each block's new priority (a turn's answer becomes
//!   conversation context: the next turn resends it) and how long it is held.

use dynamo_config::{RegionKind, RetentionSection, TierName};

use crate::block::BlockHash;
use crate::cost::CostModel;
use crate::registry::{BlockMeta, Millis};

/// How far write-through takes completed blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WriteThrough {
    /// Blocks stay in the G1 of the worker that computed them.
    Off,
    /// Down to G2.
    G2,
    /// Down to G2 and G3 (each region's `lowest_tier` still applies): what the node does.
    #[default]
    G2G3,
}

/// What an executor answers about the tiers while a prefix is planned. Each question is asked in
/// prefix order and only while the prefix goes on; an executor may count an answer as an access.
pub trait TierLookup {
    /// Whether the worker's own G1 holds `hash` (a real executor also takes a reference to it).
    fn in_g1(&mut self, hash: BlockHash) -> bool;
    /// Whether the node's G2 holds `hash`.
    fn in_g2(&mut self, hash: BlockHash) -> bool;
    /// Whether the node's G3 holds `hash` and may be read now.
    fn in_g3(&mut self, hash: BlockHash) -> bool;
    /// Whether another node holds `hash` (false on a node without peers).
    fn in_g4(&mut self, _hash: BlockHash) -> bool {
        false
    }
}

/// Why a request cannot be served at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The prompt is empty.
    EmptyPrompt,
    /// Prompt plus answer need more blocks than G1 has.
    TooLong {
        /// Blocks needed.
        needed: usize,
    },
}

/// Where a block whose KV just landed in G1 goes next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Targets {
    /// Into G2.
    pub g2: bool,
    /// Into G3.
    pub g3: bool,
}

/// How a block's KV came into G1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landed {
    /// Computed by this worker.
    Computed,
    /// Found in this worker's G1.
    Reused,
    /// Loaded from a tier below.
    Loaded(TierName),
}

/// What the tiers below hold of a block, for [`Pipeline::write_targets`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Presence {
    /// G2 exists and holds it.
    pub g2: bool,
    /// G3 exists, is usable and holds it.
    pub g3: bool,
}

/// A block's fate at its turn's end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnEnd {
    /// Its new priority, when it changes (a generated block becomes conversation context).
    pub priority: Option<u8>,
    /// Held until then (no eviction before), when its region holds blocks.
    pub hold_until: Option<Millis>,
}

/// The pipeline's policy for one node: block geometry, retention per region, how far blocks are
/// written. It borrows the node's retention, so a worker makes one wherever it decides.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pipeline<'a> {
    /// Tokens per block.
    pub block_tokens: usize,
    /// Retention per region.
    pub retention: &'a RetentionSection,
    /// How far completed blocks are written.
    pub write_through: WriteThrough,
}

/// The region of prompt token `token` among `regions` (token ranges): the range that holds it,
/// else conversation.
pub fn region_of(regions: &[(std::ops::Range<usize>, RegionKind)], token: usize) -> RegionKind {
    regions.iter().find(|(r, _)| r.contains(&token)).map(|(_, k)| *k).unwrap_or(RegionKind::Conversation)
}

impl Pipeline<'_> {
    /// Registry metadata of a block of `region` whose parent is `parent`.
    pub fn meta(&self, parent: Option<BlockHash>, region: RegionKind) -> BlockMeta {
        BlockMeta { parent, region, priority: self.retention.policy(region).priority, retain_until: 0 }
    }

    /// Whether blocks of `region` may be written down to `tier`.
    pub fn reaches(&self, region: RegionKind, tier: TierName) -> bool {
        tier <= self.retention.policy(region).lowest_tier
    }

    /// Whether a request of `prompt` tokens that may generate `max_tokens` can be served by a G1
    /// of `g1_blocks` blocks.
    pub fn admit(&self, prompt: usize, max_tokens: usize, g1_blocks: usize) -> Result<(), Refusal> {
        if prompt == 0 {
            return Err(Refusal::EmptyPrompt);
        }
        let needed = (prompt + max_tokens).div_ceil(self.block_tokens);
        if needed > g1_blocks {
            return Err(Refusal::TooLong { needed });
        }
        Ok(())
    }

    /// The cached prefix of a sequence of `tokens` tokens whose complete blocks are `hashes`:
    /// the source of each of its first blocks, in order, while each is found — G1 first, then
    /// G2, G3 and G4, each only while `cost` says loading the block beats recomputing it. The
    /// last token is always left to compute.
    pub fn plan_prefix(
        &self,
        hashes: &[BlockHash],
        tokens: usize,
        cost: &CostModel,
        tiers: &mut impl TierLookup,
    ) -> Vec<TierName> {
        let b = self.block_tokens;
        let cap = (tokens.saturating_sub(1) / b).min(hashes.len());
        let mut plan = Vec::with_capacity(cap);
        for (i, &hash) in hashes.iter().enumerate().take(cap) {
            let end = (i + 1) * b;
            let source = if tiers.in_g1(hash) {
                TierName::G1
            } else if cost.worth_loading(TierName::G2, end) && tiers.in_g2(hash) {
                TierName::G2
            } else if cost.worth_loading(TierName::G3, end) && tiers.in_g3(hash) {
                TierName::G3
            } else if cost.worth_loading(TierName::G4, end) && tiers.in_g4(hash) {
                TierName::G4
            } else {
                break;
            };
            plan.push(source);
        }
        plan
    }

    /// Where a block of `region` goes once its KV is in G1: a computed block to G2 and to G3; one
    /// loaded from G3 or a peer to G2 (G2 keeps what was just read); one loaded from G2 to G3; one
    /// reused in G1 to whichever lacks it (G2 is inclusive of G1: a copy G2 dropped while G1 kept
    /// the block comes back) — each tier only if write-through and the region's retention reach
    /// it and it lacks the block.
    pub fn write_targets(&self, region: RegionKind, landed: Landed, present: Presence) -> Targets {
        let to_g2 = self.write_through != WriteThrough::Off && self.reaches(region, TierName::G2) && !present.g2;
        let to_g3 = self.write_through == WriteThrough::G2G3 && self.reaches(region, TierName::G3) && !present.g3;
        match landed {
            Landed::Computed => Targets { g2: to_g2, g3: to_g3 },
            Landed::Loaded(TierName::G3 | TierName::G4) => Targets { g2: to_g2, g3: false },
            Landed::Loaded(TierName::G2) => Targets { g2: false, g3: to_g3 && present.g2 },
            // G2 is inclusive of G1: a block reused in place that G2 has lost goes back to it.
            Landed::Reused | Landed::Loaded(TierName::G1) => Targets { g2: to_g2, g3: to_g3 && (present.g2 || to_g2) },
        }
    }

    /// The fate at its turn's end (at `now`) of a block of `region`; `generated` for a block of the
    /// turn's answer, which becomes conversation context.
    pub fn turn_end(&self, region: RegionKind, generated: bool, now: Millis) -> TurnEnd {
        let (region, priority) = if generated {
            (RegionKind::Conversation, Some(self.retention.policy(RegionKind::Conversation).priority))
        } else {
            (region, None)
        };
        let hold = self.retention.policy(region).hold.as_duration().as_millis() as Millis;
        TurnEnd { priority, hold_until: (hold > 0).then_some(now + hold) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{BytesPerSec, Prefill};

    fn pipeline() -> Pipeline<'static> {
        static RETENTION: std::sync::OnceLock<RetentionSection> = std::sync::OnceLock::new();
        let retention = RETENTION.get_or_init(RetentionSection::default);
        Pipeline { block_tokens: 4, retention, write_through: WriteThrough::G2G3 }
    }

    /// Tiers that hold blocks `0..g1` in G1, `..g2` in G2, `..g3` in G3 and `..g4` at a peer
    /// (hashes are their indexes), and record the questions asked.
    struct Held {
        g1: u128,
        g2: u128,
        g3: u128,
        g4: u128,
        asked: Vec<(char, u128)>,
    }

    impl TierLookup for Held {
        fn in_g1(&mut self, h: BlockHash) -> bool {
            self.asked.push(('1', h.0));
            h.0 < self.g1
        }
        fn in_g2(&mut self, h: BlockHash) -> bool {
            self.asked.push(('2', h.0));
            h.0 < self.g2
        }
        fn in_g3(&mut self, h: BlockHash) -> bool {
            self.asked.push(('3', h.0));
            h.0 < self.g3
        }
        fn in_g4(&mut self, h: BlockHash) -> bool {
            self.asked.push(('4', h.0));
            h.0 < self.g4
        }
    }

    fn hashes(n: u128) -> Vec<BlockHash> {
        (0..n).map(BlockHash).collect()
    }

    #[test]
    fn the_prefix_takes_the_nearest_tier_and_stops_at_the_first_miss() {
        let p = pipeline();
        let cost = CostModel::unknown(4, 1024);
        let mut held = Held { g1: 2, g2: 3, g3: 5, g4: 6, asked: vec![] };
        // 8 blocks, 33 tokens: 8 complete blocks, the last token computed.
        let plan = p.plan_prefix(&hashes(8), 33, &cost, &mut held);
        use TierName::*;
        assert_eq!(plan, [G1, G1, G2, G3, G3, G4]);
        assert_eq!(held.asked.last(), Some(&('4', 6)), "asked no further than the first miss");
        // The last token is always computed: 32 tokens make 7 cached blocks at most.
        let mut all = Held { g1: 99, g2: 0, g3: 0, g4: 0, asked: vec![] };
        assert_eq!(p.plan_prefix(&hashes(8), 32, &cost, &mut all).len(), 7);
    }

    #[test]
    fn a_tier_slower_than_recompute_is_skipped() {
        let p = pipeline();
        // 1 KiB per block at 1 MB/s ≈ 1 ms; recomputing 4 tokens at 1M tokens/s: 4 µs.
        let cost = CostModel {
            prefill: Prefill::rate(1e6),
            g2_read: BytesPerSec::new(1e12),
            g3_read: BytesPerSec::new(1e6),
            ..CostModel::unknown(4, 1024)
        };
        let mut held = Held { g1: 0, g2: 1, g3: 9, g4: 0, asked: vec![] };
        assert_eq!(p.plan_prefix(&hashes(8), 33, &cost, &mut held), [TierName::G2]);
        assert!(!held.asked.iter().any(|(t, _)| *t == '3'), "G3 is never asked: it does not pay");
    }

    #[test]
    fn write_through_follows_the_block_and_its_region() {
        let p = pipeline();
        let none = Presence::default();
        assert_eq!(p.write_targets(RegionKind::System, Landed::Computed, none), Targets { g2: true, g3: true });
        assert_eq!(
            p.write_targets(RegionKind::System, Landed::Computed, Presence { g2: true, g3: false }),
            Targets { g2: false, g3: true },
            "G2 has it already"
        );
        let g2_only = Presence { g2: true, g3: false };
        assert_eq!(
            p.write_targets(RegionKind::System, Landed::Loaded(TierName::G3), none),
            Targets { g2: true, g3: false }
        );
        assert_eq!(
            p.write_targets(RegionKind::System, Landed::Loaded(TierName::G2), g2_only),
            Targets { g2: false, g3: true }
        );
        assert_eq!(
            p.write_targets(RegionKind::System, Landed::Reused, none),
            Targets { g2: true, g3: true },
            "G2 lost it while G1 kept it: back to G2, and on to G3"
        );
        let both = Presence { g2: true, g3: true };
        assert_eq!(p.write_targets(RegionKind::System, Landed::Reused, both), Targets::default(), "nothing to write");
        assert_eq!(p.write_targets(RegionKind::System, Landed::Reused, g2_only), Targets { g2: false, g3: true });
        // Reasoning tokens stay in G1 by default.
        let lowest = RetentionSection::default().policy(RegionKind::Reasoning).lowest_tier;
        let reasoning = p.write_targets(RegionKind::Reasoning, Landed::Computed, none);
        assert_eq!(reasoning.g2, TierName::G2 <= lowest);
        assert_eq!(reasoning.g3, TierName::G3 <= lowest);
        let off = Pipeline { write_through: WriteThrough::Off, ..pipeline() };
        assert_eq!(off.write_targets(RegionKind::System, Landed::Computed, none), Targets::default());
        let g2 = Pipeline { write_through: WriteThrough::G2, ..pipeline() };
        assert_eq!(g2.write_targets(RegionKind::System, Landed::Computed, none), Targets { g2: true, g3: false });
    }

    #[test]
    fn an_answer_becomes_conversation_context_at_its_turn_end() {
        let p = pipeline();
        let conversation = p.retention.policy(RegionKind::Conversation);
        let end = p.turn_end(RegionKind::Generated, true, 1000);
        assert_eq!(end.priority, Some(conversation.priority));
        let hold = conversation.hold.as_duration().as_millis() as Millis;
        assert_eq!(end.hold_until, (hold > 0).then_some(1000 + hold));
        assert_eq!(p.turn_end(RegionKind::System, false, 1000).priority, None);
        assert_eq!(p.admit(0, 4, 10), Err(Refusal::EmptyPrompt));
        assert_eq!(p.admit(30, 11, 10), Err(Refusal::TooLong { needed: 11 }));
        assert_eq!(p.admit(30, 10, 10), Ok(()));
    }
}
