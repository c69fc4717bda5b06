//! `[retention.<region>]`: how long and how far the blocks of each region are kept.
//!
//! Each region has its own defaults, so a table that sets only some keys (say
//! `[retention.reasoning]` with `priority = 5`) must keep *that region's* defaults for the rest,
//! not [`RegionPolicy::default`]. Each field is therefore read as a patch of optional keys applied
//! over [`RegionPolicy::default_for`] its region.

use serde::{Deserialize, Deserializer, Serialize};

use crate::{HumanDuration, RegionKind, TierName};

/// Retention of one region's blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RegionPolicy {
    /// Eviction priority `0..=100`; higher is evicted later.
    pub priority: u8,
    /// How long blocks stay pinned after the turn that used them ends (survives tool-call gaps).
    /// `"0s"` = no hold.
    pub hold: HumanDuration,
    /// The slowest tier write-through takes these blocks to: `"g1"` … `"g4"` (`"g2"` keeps them
    /// off NVMe; `"g4"` also offers them to peers).
    pub lowest_tier: TierName,
}

impl RegionPolicy {
    /// The documented default of `region`.
    pub fn default_for(region: RegionKind) -> RegionPolicy {
        let (priority, hold, lowest_tier) = match region {
            RegionKind::System => (90, HumanDuration::secs(0), TierName::G3),
            RegionKind::Tools => (90, HumanDuration::secs(0), TierName::G3),
            RegionKind::Conversation => (60, HumanDuration::secs(30), TierName::G3),
            RegionKind::ToolResult => (50, HumanDuration::secs(0), TierName::G3),
            RegionKind::Reasoning => (10, HumanDuration::secs(0), TierName::G2),
            RegionKind::Generated => (20, HumanDuration::secs(0), TierName::G3),
        };
        RegionPolicy { priority, hold, lowest_tier }
    }
}

/// A neutral policy (priority 50, no hold, down to G3), equal to the `tool_result` default.
/// Region tables in a file default to [`RegionPolicy::default_for`] their region instead.
impl Default for RegionPolicy {
    fn default() -> Self {
        RegionPolicy { priority: 50, hold: HumanDuration::secs(0), lowest_tier: TierName::G3 }
    }
}

/// The keys of a region table, each optional, applied over the region's defaults.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RegionPolicyPatch {
    priority: Option<u8>,
    hold: Option<HumanDuration>,
    lowest_tier: Option<TierName>,
}

fn patch_region<'de, D: Deserializer<'de>>(deserializer: D, region: RegionKind) -> Result<RegionPolicy, D::Error> {
    let patch = RegionPolicyPatch::deserialize(deserializer)?;
    let base = RegionPolicy::default_for(region);
    Ok(RegionPolicy {
        priority: patch.priority.unwrap_or(base.priority),
        hold: patch.hold.unwrap_or(base.hold),
        lowest_tier: patch.lowest_tier.unwrap_or(base.lowest_tier),
    })
}

macro_rules! region_deserializers {
    ($($fn_name:ident => $region:expr),+ $(,)?) => {
        $(
            fn $fn_name<'de, D: Deserializer<'de>>(d: D) -> Result<RegionPolicy, D::Error> {
                patch_region(d, $region)
            }
        )+
    };
}

region_deserializers! {
    de_system => RegionKind::System,
    de_tools => RegionKind::Tools,
    de_conversation => RegionKind::Conversation,
    de_tool_result => RegionKind::ToolResult,
    de_reasoning => RegionKind::Reasoning,
    de_generated => RegionKind::Generated,
}

/// `[retention]`: one table per region.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionSection {
    /// `[retention.system]`: the system prompt. Default priority 90, hold `"0s"`, down to g3.
    #[serde(deserialize_with = "de_system")]
    pub system: RegionPolicy,
    /// `[retention.tools]`: tool definitions. Default priority 90, hold `"0s"`, down to g3.
    #[serde(deserialize_with = "de_tools")]
    pub tools: RegionPolicy,
    /// `[retention.conversation]`: earlier turns. Default priority 60, hold `"30s"`, down to g3.
    #[serde(deserialize_with = "de_conversation")]
    pub conversation: RegionPolicy,
    /// `[retention.tool_result]`: tool outputs. Default priority 50, hold `"0s"`, down to g3.
    #[serde(deserialize_with = "de_tool_result")]
    pub tool_result: RegionPolicy,
    /// `[retention.reasoning]`: thinking tokens. Default priority 10, hold `"0s"`, down to g2
    /// only (never NVMe).
    #[serde(deserialize_with = "de_reasoning")]
    pub reasoning: RegionPolicy,
    /// `[retention.generated]`: tokens of the running turn. Default priority 20, hold `"0s"`,
    /// down to g3.
    #[serde(deserialize_with = "de_generated")]
    pub generated: RegionPolicy,
}

impl RetentionSection {
    /// The policy of `region`.
    pub fn policy(&self, region: RegionKind) -> &RegionPolicy {
        match region {
            RegionKind::System => &self.system,
            RegionKind::Tools => &self.tools,
            RegionKind::Conversation => &self.conversation,
            RegionKind::ToolResult => &self.tool_result,
            RegionKind::Reasoning => &self.reasoning,
            RegionKind::Generated => &self.generated,
        }
    }
}

impl Default for RetentionSection {
    fn default() -> Self {
        RetentionSection {
            system: RegionPolicy::default_for(RegionKind::System),
            tools: RegionPolicy::default_for(RegionKind::Tools),
            conversation: RegionPolicy::default_for(RegionKind::Conversation),
            tool_result: RegionPolicy::default_for(RegionKind::ToolResult),
            reasoning: RegionPolicy::default_for(RegionKind::Reasoning),
            generated: RegionPolicy::default_for(RegionKind::Generated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_matches_fields() {
        let r = RetentionSection::default();
        for region in RegionKind::ALL {
            assert_eq!(r.policy(region), &RegionPolicy::default_for(region));
        }
        assert_eq!(r.reasoning.lowest_tier, TierName::G2);
        assert_eq!(r.conversation.hold, HumanDuration::secs(30));
    }

    #[test]
    fn partial_region_table_keeps_that_regions_defaults() {
        let r: RetentionSection = toml::from_str("[reasoning]\npriority = 5\n").unwrap();
        assert_eq!(r.reasoning, RegionPolicy { priority: 5, ..RegionPolicy::default_for(RegionKind::Reasoning) });
        let r: RetentionSection = toml::from_str("[conversation]\nlowest_tier = \"g2\"\n").unwrap();
        assert_eq!(r.conversation.hold, HumanDuration::secs(30));
        assert_eq!(r.conversation.priority, 60);
        assert_eq!(r.system, RegionPolicy::default_for(RegionKind::System));
    }

    #[test]
    fn region_tables_reject_unknown_keys() {
        assert!(toml::from_str::<RetentionSection>("[tools]\npriorty = 5\n").is_err());
    }
}
