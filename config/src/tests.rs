//! Whole-file tests: the embedded files, round trips, and error locations.

use std::path::{Path, PathBuf};

use proptest::prelude::*;

use super::*;

fn parse(src: &str) -> Result<NodeConfig, ConfigError> {
    NodeConfig::parse(src, "cfg.toml")
}

/// Every dotted key path of the leaves (scalars and arrays) of `table`.
fn leaf_keys(table: &toml::Table, prefix: &str, out: &mut Vec<String>) {
    for (key, value) in table {
        let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
        match value {
            toml::Value::Table(t) => leaf_keys(t, &path, out),
            _ => out.push(path),
        }
    }
}

fn lookup<'a>(table: &'a toml::Table, path: &str) -> Option<&'a toml::Value> {
    let mut segs = path.split('.');
    let mut value = table.get(segs.next()?)?;
    for seg in segs {
        value = value.as_table()?.get(seg)?;
    }
    Some(value)
}

#[test]
fn embedded_files_parse_and_validate() {
    let default = parse(DEFAULT_TOML).unwrap();
    let example = NodeConfig::parse(EXAMPLE_TOML, "example.toml").unwrap();
    assert_eq!(example, NodeConfig::default());
    assert_eq!(default, NodeConfig::default());
    assert_eq!(NodeConfig::embedded_default(), default);
    NodeConfig::default().validate().unwrap();
}

#[test]
fn default_round_trips_through_toml() {
    let config = NodeConfig::default();
    let text = config.to_toml_string();
    assert_eq!(parse(&text).unwrap(), config, "{text}");
    assert!(text.contains("capacity = \"256MiB\""), "{text}");
}

#[test]
fn non_default_values_round_trip() {
    let mut config = NodeConfig::default();
    config.model.path = Some(PathBuf::from("/models/llama"));
    config.model.name = "my-llama".into();
    config.model.lora = Some("adapter".into());
    config.engine.calibration = Some(PathBuf::from("cal.toml"));
    config.tiers.g3.paths = vec!["/nvme0/store".into(), "/nvme1/store".into()];
    config.tiers.g3.read_gb_s = Some(6.5);
    config.tiers.g4.peers = vec!["10.0.0.2:7100".into()];
    config.retention.reasoning.priority = 5;
    config.router.temperature = 0.5;
    let text = config.to_toml_string();
    assert_eq!(parse(&text).unwrap(), config, "{text}");
}

#[test]
fn example_documents_every_key() {
    let example: toml::Table = toml::from_str(EXAMPLE_TOML).unwrap();
    let default: toml::Table = toml::from_str(&NodeConfig::default().to_toml_string()).unwrap();
    let mut keys = Vec::new();
    leaf_keys(&default, "", &mut keys);
    assert!(keys.len() >= 80, "walked only {} keys", keys.len());
    for key in &keys {
        assert!(lookup(&example, key).is_some(), "example.toml does not set `{key}`");
    }
    // Optional keys (absent by default) appear commented out.
    for key in ["path", "tokenizer", "chat_template", "lora", "calibration", "read_gb_s", "write_gb_s"] {
        assert!(EXAMPLE_TOML.contains(&format!("\n# {key} = ")), "example.toml does not mention optional `{key}`");
    }
}

/// Keys read through a binding named other than their section: the text that reads each.
/// Every region's policy is read through `RetentionSection::policy(region)`.
const READ_THROUGH: &[(&str, &str)] = &[
    ("tiers.g3.io_engine", "c.io_engine"),
    ("tiers.g3.queue_depth", "c.queue_depth"),
    ("tiers.g3.io_threads", "c.io_threads"),
    ("tiers.g3.register_buffers", "c.register_buffers"),
    ("tiers.g3.eviction", "c.eviction"),
    ("frontend.responses_store", "config.responses_store"),
    ("frontend.responses_ttl", "config.responses_ttl"),
    ("cluster.etcd_prefix", "section.etcd_prefix"),
    ("retention.*.priority", "policy(region).priority"),
    ("retention.*.hold", "policy(region).hold"),
    ("retention.*.lowest_tier", "policy(region).lowest_tier"),
];

/// The product's sources outside this crate, each cut at its unit tests (`#[cfg(test)]` modules
/// sit at the end of a file, by this workspace's convention).
fn product_sources() -> String {
    fn walk(dir: &std::path::Path, out: &mut String) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if name != "tests" {
                    walk(&path, out);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" {
                let text = std::fs::read_to_string(&path).unwrap();
                out.push_str(text.split("#[cfg(test)]\nmod ").next().unwrap());
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut out = String::new();
    for krate in ["actors", "runtime", "tiering", "kernels"] {
        walk(&root.join(krate).join("src"), &mut out);
    }
    out
}

/// `text` occurs in `src` as a field read: not as a prefix of a longer name, not as a call.
fn reads(src: &str, text: &str) -> bool {
    src.match_indices(text).any(|(at, _)| {
        let after = src[at + text.len()..].trim_start();
        let before = src[..at].chars().next_back();
        !after.starts_with(|c: char| c.is_alphanumeric() || c == '_' || c == '(')
            && !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
    })
}

/// Every key example.toml shows (the optional ones commented out, too) is read by the node: a
/// key nothing reads would do nothing. Read means `<section>.<key>` appears outside this crate
/// and outside tests, or the text [`READ_THROUGH`] names for it.
#[test]
fn every_example_key_is_read_by_the_node() {
    let src = product_sources();
    assert!(src.len() > 500_000, "read only {} bytes of sources", src.len());
    let mut section = String::new();
    let mut keys = Vec::new();
    for line in EXAMPLE_TOML.lines() {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim_matches(['[', ']']).to_string();
            continue;
        }
        let Some((key, value)) = line.trim_start_matches("# ").split_once(" = ") else { continue };
        if !key.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
            continue;
        }
        // A commented line is a key if the schema takes it (it refuses unknown ones).
        let alone = format!("[{section}]\n{key} = {}", if value.ends_with('[') { "[]" } else { value });
        if line.starts_with('#') && toml::from_str::<NodeConfig>(&alone).is_err() {
            continue;
        }
        keys.push(format!("{section}.{key}"));
    }
    assert!(keys.len() >= 120, "found only {} keys", keys.len());
    for want in ["engine.calibration", "tiers.g3.write_gb_s", "model.path"] {
        assert!(keys.iter().any(|k| k == want), "{want} was not found in example.toml");
    }
    let unread: Vec<&String> = keys
        .iter()
        .filter(|key| {
            let (parent, leaf) = key.rsplit_once('.').unwrap();
            let parent = parent.rsplit('.').next().unwrap();
            let through = READ_THROUGH.iter().filter(|(k, _)| {
                *k == key.as_str()
                    || k.strip_prefix("retention.*.").is_some_and(|l| key.starts_with("retention.") && l == leaf)
            });
            !reads(&src, &format!("{parent}.{leaf}")) && !through.clone().any(|(_, text)| reads(&src, text))
        })
        .collect();
    assert!(unread.is_empty(), "keys of example.toml that nothing outside the config crate reads: {unread:?}");
}

#[test]
fn example_comments_every_key() {
    let lines: Vec<&str> = EXAMPLE_TOML.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let is_key = !line.starts_with('#') && !line.starts_with('[') && line.contains(" = ");
        if is_key {
            assert!(
                i > 0 && lines[i - 1].starts_with('#'),
                "example.toml line {}: `{line}` has no comment above it",
                i + 1
            );
        }
    }
}

#[test]
fn derived_values() {
    let config = NodeConfig::default();
    // tiny, f32: 2 layers × 2 × 2 kv heads × 32 × 4 bytes = 1KiB/token; 32 tokens.
    assert_eq!(config.kv_bytes_per_block(), Some(32 * 1024));
    assert_eq!(config.g3_paths(), vec![Path::new("dynamo-data").join("g3").join("store.0")]);
    let mut from_path = config.clone();
    from_path.model.path = Some("/models/x".into());
    assert_eq!(from_path.kv_bytes_per_block(), None);
    assert_eq!(config.calibration().unwrap(), Calibration::h200());
}

#[test]
fn unknown_key_is_located_and_named() {
    let src = "[node]\nname = \"a\"\n\n[tiers.g2]\nenabled = true\ncapcity = \"1GiB\"\n";
    let err = parse(src).unwrap_err();
    assert_eq!(err.kind(), "unknown_key");
    assert_eq!(err.key(), Some("tiers.g2.capcity"));
    assert_eq!((err.line(), err.column()), (Some(6), Some(1)));
    let text = err.to_string();
    assert!(
        text.starts_with("cfg.toml:6:1: `tiers.g2.capcity`: unknown key; expected one of enabled, capacity, mlock"),
        "{text}"
    );
}

#[test]
fn unknown_section_and_dotted_key() {
    let err = parse("[tierz]\nx = 1\n").unwrap_err();
    assert_eq!(err.key(), Some("tierz"));
    assert_eq!((err.line(), err.column()), (Some(1), Some(2)));

    let err = parse("[tiers]\ng2.capacity = \"1GiB\"\ng2.bogus = 1\n").unwrap_err();
    assert_eq!(err.key(), Some("tiers.g2.bogus"));
    assert_eq!((err.line(), err.column()), (Some(3), Some(4)));
}

#[test]
fn wrong_type_points_at_the_value() {
    let err = parse("[engine]\nworkers = \"two\"\n").unwrap_err();
    assert_eq!(err.kind(), "invalid_value");
    assert_eq!(err.key(), Some("engine.workers"));
    assert_eq!((err.line(), err.column()), (Some(2), Some(11)));
    assert!(err.to_string().starts_with("cfg.toml:2:11: `engine.workers`: invalid type"), "{err}");

    let err = parse("tiers = 5\n").unwrap_err();
    assert_eq!(err.key(), Some("tiers"));
    assert!(err.to_string().contains("expected a table"), "{err}");
}

#[test]
fn invalid_size_points_at_the_value() {
    let err = parse("[tiers.g2]\n  capacity = \"12XB\"\n").unwrap_err();
    assert_eq!(err.kind(), "invalid_value");
    assert_eq!(err.key(), Some("tiers.g2.capacity"));
    assert_eq!((err.line(), err.column()), (Some(2), Some(14)));
    assert_eq!(
        err.to_string(),
        "cfg.toml:2:14: `tiers.g2.capacity`: invalid size `12XB`: expected a number followed by B, KiB, MiB, GiB, TiB, KB, MB, GB, TB"
    );
}

#[test]
fn unknown_enum_value_lists_choices() {
    let err = parse("[tiers.g3]\neviction = \"fifo\"\n").unwrap_err();
    assert_eq!(err.key(), Some("tiers.g3.eviction"));
    assert_eq!(err.to_string(), "cfg.toml:2:12: `tiers.g3.eviction`: unknown value `fifo`; expected lru or lfu");
}

#[test]
fn syntax_error_is_located() {
    let err = parse("[node]\nname = \"a\"\nlog_level = \n").unwrap_err();
    assert_eq!(err.kind(), "syntax");
    assert_eq!(err.line(), Some(3));
    assert!(err.to_string().starts_with("cfg.toml:3:"), "{err}");
}

#[test]
fn g2_smaller_than_a_block() {
    let src = "[model]\nname = \"llama-1b\"\ndtype = \"bf16\"\n\n[tiers.g2]\ncapacity = \"16KiB\"\n";
    let err = parse(src).unwrap_err();
    assert_eq!(err.kind(), "invalid");
    assert_eq!(err.key(), Some("tiers.g2.capacity"));
    assert_eq!((err.line(), err.column()), (Some(6), Some(1)));
    assert_eq!(
        err.to_string(),
        "cfg.toml:6:1: `tiers.g2.capacity`: 16KiB is smaller than one block (32 tokens × 32KiB/token = 1MiB); raise it to at least 1MiB or lower blocks.block_size"
    );
}

#[test]
fn defaulted_key_is_reported_at_1_1() {
    // A bigger block makes the default G1/G2 capacities too small for llama-8b f32.
    let src = "[model]\nname = \"llama-8b\"\n\n[blocks]\nblock_size = 4096\n";
    let err = parse(src).unwrap_err();
    let problems = err.problems();
    assert!(problems.len() >= 2, "{err}");
    assert_eq!(err.key(), Some("tiers.g1.capacity"));
    assert_eq!((err.line(), err.column()), (Some(1), Some(1)));
    assert!(err.to_string().contains("(default"), "{err}");
    assert!(problems.iter().any(|p| p.key.as_deref() == Some("tiers.g2.capacity")));
}

#[test]
fn watermarks_must_be_ordered() {
    let src = "[tiers.g3]\nhigh_watermark = 0.8\nlow_watermark = 0.9\n";
    let err = parse(src).unwrap_err();
    assert_eq!(err.kind(), "invalid");
    assert_eq!(err.key(), Some("tiers.g3.low_watermark"));
    assert_eq!((err.line(), err.column()), (Some(3), Some(1)));
    let err = parse("[tiers.g2]\nhigh_watermark = 1.5\n").unwrap_err();
    assert_eq!(err.key(), Some("tiers.g2.high_watermark"));
}

#[test]
fn partial_retention_region_keeps_its_defaults() {
    let config = parse("[retention.reasoning]\npriority = 5\n").unwrap();
    assert_eq!(config.retention.reasoning.priority, 5);
    assert_eq!(config.retention.reasoning.lowest_tier, TierName::G2);
    assert_eq!(config.retention.reasoning.hold, HumanDuration::secs(0));
    let config = parse("[retention.conversation]\npriority = 70\n").unwrap();
    assert_eq!(config.retention.conversation.hold, HumanDuration::secs(30));
    assert_eq!(config.retention.policy(RegionKind::System), &RegionPolicy::default_for(RegionKind::System));

    let err = parse("[retention.reasoning]\npriority = 101\n").unwrap_err();
    assert_eq!(err.key(), Some("retention.reasoning.priority"));
    assert_eq!(err.line(), Some(2));
    let err = parse("[retention.tools]\nhodl = \"1s\"\n").unwrap_err();
    assert_eq!(err.kind(), "unknown_key");
    assert_eq!(err.key(), Some("retention.tools.hodl"));
}

#[test]
fn other_validation_rules() {
    let cases: &[(&str, &str)] = &[
        ("[blocks]\nblock_size = 0\n", "blocks.block_size"),
        ("[blocks]\nblock_size = 8192\n", "blocks.block_size"),
        ("[model]\nname = \"gpt-9\"\n", "model.name"),
        ("[engine]\nworkers = 0\n", "engine.workers"),
        ("[engine]\nkind = \"simulated\"\n", "engine.kind"),
        ("[tiers.g3]\nqueue_depth = 0\n", "tiers.g3.queue_depth"),
        ("[tiers.g3]\nqueue_depth = 8192\n", "tiers.g3.queue_depth"),
        ("[tiers.g3]\nio_threads = 0\n", "tiers.g3.io_threads"),
        ("[tiers.g3]\ncapacity_per_path = \"4KiB\"\n", "tiers.g3.capacity_per_path"),
        ("[tiers.g3]\npaths = [\"a\", \"a\"]\n", "tiers.g3.paths[1]"),
        ("[tiers.g1]\ncapacity = \"1KiB\"\n", "tiers.g1.capacity"),
        ("[engine]\ndevice = \"cpu\"\n[tiers.g1]\ncapacity = 0\n", "tiers.g1.capacity"),
        ("[tiers.g1]\ngpu_memory_fraction = 0.0\n", "tiers.g1.gpu_memory_fraction"),
        ("[frontend]\nhttp = \"localhost\"\n", "frontend.http"),
        ("[metrics]\nlisten = \"1.2.3.4\"\n", "metrics.listen"),
        ("[tiers.g4]\nlisten = \"x:1\"\n", "tiers.g4.listen"),
        ("[tiers.g4]\npeers = [\"nohost\"]\n", "tiers.g4.peers[0]"),
        ("[tiers.g4]\nenabled = true\n", "tiers.g4.secret_file"),
        ("[tiers.g4]\ncluster = \"\"\n", "tiers.g4.cluster"),
        ("[tiers.g4]\nhold_ttl = \"0s\"\n", "tiers.g4.hold_ttl"),
        ("[tiers.g4]\nmax_holds_per_peer = 0\n", "tiers.g4.max_holds_per_peer"),
        ("[tiers.g4]\nlanes = 0\n", "tiers.g4.lanes"),
        ("[tiers.g4]\nheartbeat = \"1ms\"\n", "tiers.g4.heartbeat"),
        ("[tiers.g4]\ntls_cert = \"n.pem\"\ntls_ca = \"ca.pem\"\n", "tiers.g4.tls_key"),
        ("[tiers.g4]\ntls_key = \"n.key\"\n", "tiers.g4.tls_cert"),
        (
            "[node]\nname = \"gpu box 1\"\n[tiers.g4]\ntls_cert = \"n.pem\"\ntls_key = \"n.key\"\ntls_ca = \"ca.pem\"\n",
            "node.name",
        ),
        ("[cluster]\nmembership = \"etcd\"\n", "cluster.membership"),
        (
            "[tiers.g4]\nenabled = true\nsecret_file = \"s\"\nlisten = \"0.0.0.0:7100\"\n[cluster]\nmembership = \"etcd\"\n",
            "cluster.advertise",
        ),
        ("[cluster]\netcd_endpoints = [\"127.0.0.1:2379\"]\n", "cluster.etcd_endpoints[0]"),
        ("[cluster]\netcd_prefix = \"dynamo\"\n", "cluster.etcd_prefix"),
        ("[cluster]\nlease_ttl = \"1s\"\n", "cluster.lease_ttl"),
        ("[cluster]\nlease_ttl = \"2500ms\"\n", "cluster.lease_ttl"),
        ("[cluster]\nadvertise = \"nohost\"\n", "cluster.advertise"),
        ("[metrics]\nlatency_buckets_seconds = [1.0, 0.5]\n", "metrics.latency_buckets_seconds"),
        ("[metrics]\nlatency_buckets_seconds = [0.0, 1.0]\n", "metrics.latency_buckets_seconds"),
        ("[router]\ntemperature = -1.0\n", "router.temperature"),
        ("[engine_endpoint]\nenabled = true\ng2_share = 1.0\n", "engine_endpoint.g2_share"),
        ("[engine_endpoint]\nenabled = true\ng2_share = 0.0\n", "engine_endpoint.g2_share"),
    ];
    for &(src, key) in cases {
        let err = parse(src).expect_err(src);
        assert_eq!(err.kind(), "invalid", "{src}: {err}");
        assert_eq!(err.key(), Some(key), "{src}: {err}");
    }
    let err = parse("[model]\nname = \"gpt-9\"\n").unwrap_err();
    assert!(err.to_string().contains("tiny, llama-1b, llama-8b"), "{err}");
    assert_eq!(parse("[tiers.g3]\npaths = [\"a\", \"a\"]\n").unwrap_err().line(), Some(2));

    // Allowed: a model from a path with any name, G1 = 0 on auto, RDMA transport, hostname peers.
    parse("[model]\nname = \"mine\"\npath = \"/m\"\n[tiers.g1]\ncapacity = 0\n").unwrap();
    parse("[tiers.g4]\nenabled = true\ntransport = \"rdma\"\npeers = [\"node-1:7100\"]\nsecret_file = \"s\"\n")
        .unwrap();
    parse("[tiers.g2]\nenabled = false\ncapacity = 0\n[tiers.g3]\nenabled = false\n").unwrap();
    // etcd membership on every address, advertising one.
    parse(
        "[tiers.g4]\nenabled = true\nsecret_file = \"s\"\nlisten = \"0.0.0.0:7100\"\n[cluster]\nmembership = \"etcd\"\n\
         advertise = \"node-1:7100\"\netcd_endpoints = [\"http://etcd-0:2379\", \"https://10.0.0.9:2379\"]\n",
    )
    .unwrap();
}

#[test]
fn in_memory_validation_has_no_location() {
    let mut config = NodeConfig::default();
    config.engine.workers = 0;
    let err = config.validate().unwrap_err();
    assert_eq!(err.line(), None);
    assert_eq!(err.to_string(), "`engine.workers`: must be at least 1");
}

#[test]
fn duplicate_key_is_named() {
    let err = parse("[tiers.g3]\nqueue_depth = 8\nqueue_depth = 16\n").unwrap_err();
    assert_eq!(err.kind(), "syntax");
    assert_eq!(err.key(), Some("tiers.g3.queue_depth"), "{err}");
    assert_eq!((err.line(), err.column()), (Some(3), Some(1)));
}

#[test]
fn io_error_is_its_own_kind() {
    let err = NodeConfig::load(Path::new("/nonexistent/dynamo.toml")).unwrap_err();
    assert_eq!(err.kind(), "io");
    assert!(matches!(err, ConfigError::Io { .. }));
    assert!(err.to_string().starts_with("/nonexistent/dynamo.toml: cannot read"), "{err}");
}

fn arb_size() -> impl Strategy<Value = ByteSize> {
    (1u64..1 << 16, 20u32..34).prop_map(|(n, shift)| ByteSize(n << shift))
}

proptest! {
    #[test]
    fn configs_round_trip_through_toml(
        g1 in arb_size(),
        g2 in arb_size(),
        g3 in arb_size(),
        delay_us in 0u64..10_000_000,
        priority in 0u8..=100,
        workers in 1usize..64,
        block_shift in 0u32..8,
        eviction in prop::sample::select(EvictionPolicyKind::ALL),
        tier in prop::sample::select(TierName::ALL),
    ) {
        let mut config = NodeConfig::default();
        config.tiers.g1.capacity = g1;
        config.tiers.g2.capacity = g2;
        config.tiers.g3.capacity_per_path = g3;
        config.tiers.g3.eviction = eviction;
        config.tiers.g2.write_batch_delay = HumanDuration(std::time::Duration::from_micros(delay_us));
        config.retention.tools.priority = priority;
        config.retention.tools.lowest_tier = tier;
        config.engine.workers = workers;
        config.blocks.block_size = 1 << block_shift;
        let text = config.to_toml_string();
        prop_assert_eq!(parse(&text).unwrap(), config);
    }
}

/// What `serve` refuses or ignores, `config check` refuses too, at the key's line.
#[test]
fn what_serve_would_refuse_is_refused_with_its_line() {
    let err = parse("[node]\nlog_level = \"verbose\"\n").unwrap_err();
    assert_eq!(err.key(), Some("node.log_level"));
    assert_eq!(err.line(), Some(2));
    assert!(err.to_string().contains("`verbose` is not a log directive"), "{err}");
    let err = parse("[node]\nlog_level = \"info,dynamo_tiering=loud\"\n").unwrap_err();
    assert!(err.to_string().contains("`dynamo_tiering=loud`"), "{err}");
    for ok in ["info", "WARN", "info,dynamo_tiering=debug", "off", "dynamo_node::frontend=trace, warn"] {
        parse(&format!("[node]\nlog_level = \"{ok}\"\n")).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }

    let err = parse("[tiers.g2]\nenabled = false\n").unwrap_err();
    assert_eq!(err.key(), Some("tiers.g2.enabled"));
    assert_eq!(err.line(), Some(2));
    assert!(err.to_string().contains("go through G2"), "{err}");
    parse("[tiers.g2]\nenabled = false\n\n[tiers.g3]\nenabled = false\n").unwrap();

    let err = parse("[engine]\nworkers = 100000\n").unwrap_err();
    assert_eq!(err.key(), Some("engine.workers"));
    assert_eq!(err.line(), Some(2));

    for key in ["header_timeout", "body_timeout"] {
        let err = parse(&format!("[frontend]\n{key} = \"0s\"\n")).unwrap_err();
        assert_eq!(err.key(), Some(format!("frontend.{key}").as_str()));
    }
    let err = parse("[frontend]\nmax_connections = 0\n").unwrap_err();
    assert_eq!(err.key(), Some("frontend.max_connections"));
    let err = parse("[frontend]\nmax_connections_per_client = 0\n").unwrap_err();
    assert_eq!(err.key(), Some("frontend.max_connections_per_client"));
    for key in ["default_max_tokens", "max_prompt_tokens"] {
        let err = parse(&format!("[frontend]\n{key} = 1000000000000\n")).unwrap_err();
        assert_eq!(err.key(), Some(format!("frontend.{key}").as_str()), "{err}");
        assert_eq!(err.line(), Some(2));
    }
    parse("[frontend]\ndefault_max_tokens = 131072\n").unwrap();
    let err = parse("[engine]\nkind = \"scripted\"\n").unwrap_err();
    assert_eq!(err.key(), Some("engine.script"));
    parse("[engine]\nkind = \"scripted\"\nscript = \"answers.json\"\n").unwrap();

    let err = parse("[tiers.g4]\nrequest_timeout = \"1s\"\nmin_fetch_budget = \"2s\"\n").unwrap_err();
    assert_eq!(err.key(), Some("tiers.g4.min_fetch_budget"), "{err}");
    assert_eq!(err.line(), Some(3));
    parse("[tiers.g4]\nrequest_timeout = \"2s\"\nmin_fetch_budget = \"2s\"\n").unwrap();
}

#[test]
fn every_transfer_path_passes_through_staging_both_ways() {
    let paths: Vec<(TierName, TierName)> = TierName::transfer_paths().collect();
    let expected = [
        (TierName::G1, TierName::G2),
        (TierName::G2, TierName::G1),
        (TierName::G3, TierName::G2),
        (TierName::G2, TierName::G3),
        (TierName::G4, TierName::G2),
        (TierName::G2, TierName::G4),
    ];
    assert_eq!(paths, expected);
}

#[test]
fn vllm_engines_need_http_urls_and_the_checkpoint_they_serve() {
    let err = parse("[engine]\nkind = \"vllm\"\n").unwrap_err().to_string();
    assert!(err.contains("engine.vllm.urls") && err.contains("model.path"), "{err}");
    let vllm =
        |urls: &str| format!("[model]\npath = \"/m\"\n[engine]\nkind = \"vllm\"\n[engine.vllm]\nurls = {urls}\n");
    let err = parse(&vllm("[\"localhost:8000\", \"http://h:1/v1\"]")).unwrap_err().to_string();
    assert!(err.contains("engine.vllm.urls[0]") && err.contains("engine.vllm.urls[1]"), "{err}");
    assert!(err.contains("http://host:port"), "{err}");
    let cfg = parse(&vllm("[\"http://127.0.0.1:8000\", \"http://10.0.0.2:8000/\"]")).unwrap();
    assert_eq!(cfg.engine.kind, EngineKind::Vllm);
    assert_eq!(cfg.engine.vllm.request_timeout.as_duration(), std::time::Duration::from_secs(600));
}

#[test]
fn launched_vllm_engines_are_checked_with_the_key_at_fault() {
    let launch = |rest: &str| {
        format!(
            "[model]\npath = \"/m\"\n[engine]\nkind = \"vllm\"\n[engine.vllm.launch]\ndevices = [\"0\", \"1\"]\n{rest}"
        )
    };
    let err = parse(&launch("")).unwrap_err().to_string();
    assert!(err.contains("engine.vllm.launch.connector") && err.contains("engine_endpoint"), "{err}");
    let err = parse(&launch("connector = false\nport = 65534\ncommand = []\n")).unwrap_err().to_string();
    assert!(err.contains("engine.vllm.launch.port") && err.contains("engine.vllm.launch.command"), "{err}");
    let both = format!("{}[engine.vllm]\nurls = [\"http://h:1\"]\n", "");
    let text = format!(
        "[model]\npath = \"/m\"\n[engine]\nkind = \"vllm\"\n{both}[engine.vllm.launch]\ndevices = [\"0\"]\nconnector = false\n"
    );
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("engine.vllm.launch.devices") && err.contains("not both"), "{err}");
    let cfg = parse(&launch("connector = false\nport = 9000\n")).unwrap();
    assert!(cfg.engine.vllm.launches());
    assert_eq!(cfg.engine.vllm.engine_urls(), ["http://127.0.0.1:9000", "http://127.0.0.1:9002"]);
}
