//! [`NodeConfig::validate`]: the checks types cannot express, each naming its key path and
//! saying how to fix it.

use std::collections::HashSet;
use std::net::SocketAddr;

use crate::error::{ConfigError, Problem};
use crate::{ByteSize, DeviceKind, MembershipKind, ModelShape, NodeConfig, RegionKind};

/// Shortest API key or bearer token accepted.
const MIN_KEY_BYTES: usize = 16;

/// Tokens no model's context reaches (16M): a token count above it is refused.
const MAX_CONTEXT_TOKENS: usize = 1 << 24;

/// Collects problems.
#[derive(Debug, Default)]
struct Checks {
    problems: Vec<Problem>,
}

impl Checks {
    fn fail(&mut self, key: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem::new(key, message));
    }

    fn at_least_one(&mut self, key: &str, value: usize) {
        if value == 0 {
            self.fail(key, "must be at least 1");
        }
    }

    fn socket_addr(&mut self, key: &str, value: &str) {
        if value.parse::<SocketAddr>().is_err() {
            self.fail(
                key,
                format!("`{value}` is not a socket address; expected `ip:port`, e.g. `127.0.0.1:8000` or `[::1]:8000`"),
            );
        }
    }

    fn watermarks(&mut self, tier: &str, low: f64, high: f64) {
        if !(high > 0.0 && high <= 1.0) {
            self.fail(
                format!("tiers.{tier}.high_watermark"),
                format!("{high} is outside (0, 1]; it is the occupancy fraction at which eviction starts"),
            );
        } else if !(low > 0.0 && low <= high) {
            self.fail(
                format!("tiers.{tier}.low_watermark"),
                format!("{low} must be in (0, high_watermark = {high}]; eviction stops at the low watermark"),
            );
        }
    }

    fn positive_rate(&mut self, key: &str, value: Option<f64>) {
        if let Some(v) = value
            && !(v.is_finite() && v > 0.0)
        {
            self.fail(key, format!("{v} must be a positive number of GB/s (or leave it unset to measure)"));
        }
    }

    /// `capacity` must hold at least one block.
    fn holds_a_block(&mut self, key: &str, capacity: ByteSize, block: Option<BlockSize>) {
        if let Some(b) = block
            && capacity.as_u64() < b.bytes
        {
            self.fail(
                key,
                format!(
                    "{capacity} is smaller than one block ({} tokens × {}/token = {}); raise it to at least {} or lower blocks.block_size",
                    b.tokens,
                    ByteSize(b.per_token),
                    ByteSize(b.bytes),
                    ByteSize(b.bytes),
                ),
            );
        }
    }
}

/// Most workers a node runs (`engine.workers`).
const MAX_WORKERS: usize = 1024;

/// Checks `node.log_level` as `tracing`'s env-filter reads it: comma-separated directives, each
/// a level or `target=level` (a target is a Rust path). Returns the first bad directive.
/// Whether `name` can be a DNS name in a certificate: dot-separated labels of 1 to 63 letters,
/// digits and hyphens, no label starting or ending with a hyphen, 253 bytes at most.
fn is_dns_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

fn check_log_level(value: &str) -> Result<(), &str> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let level_ok = |l: &str| LEVELS.contains(&l.trim().to_ascii_lowercase().as_str());
    let target_ok = |t: &str| {
        !t.is_empty()
            && t.split("::")
                .all(|part| !part.is_empty() && part.chars().all(|ch| ch.is_alphanumeric() || ch == '_' || ch == '-'))
    };
    for directive in value.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let ok = match directive.split_once('=') {
            Some((target, level)) => target_ok(target.trim()) && level_ok(level),
            None => level_ok(directive),
        };
        if !ok {
            return Err(directive);
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug)]
struct BlockSize {
    tokens: usize,
    per_token: u64,
    bytes: u64,
}

impl NodeConfig {
    /// Checks the values that types cannot: ranges, watermarks, addresses, capacities against
    /// the block size. Returns every problem at once as [`ConfigError::Invalid`], each naming its
    /// key path (without a location; [`NodeConfig::parse`] adds those).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let problems = self.problems();
        if problems.is_empty() { Ok(()) } else { Err(ConfigError::Invalid(problems)) }
    }

    fn problems(&self) -> Vec<Problem> {
        let mut c = Checks::default();

        // [node]
        if self.node.name.trim().is_empty() {
            c.fail("node.name", "must not be empty");
        }
        if self.node.log_level.trim().is_empty() {
            c.fail("node.log_level", "must not be empty; e.g. \"info\"");
        } else if let Err(bad) = check_log_level(&self.node.log_level) {
            c.fail(
                "node.log_level",
                format!(
                    "`{bad}` is not a log directive; expected a level (trace, debug, info, warn, error, off) or \
                     `target=level`, comma-separated, e.g. \"info,dynamo_tiering=debug\""
                ),
            );
        }

        // [model]
        if self.model.path.is_none() && ModelShape::named(&self.model.name).is_none() {
            let known: Vec<&str> = ModelShape::ALL.iter().map(|s| s.name).collect();
            c.fail(
                "model.name",
                format!(
                    "unknown model shape `{}`; expected one of {}, or set model.path to a safetensors directory",
                    self.model.name,
                    known.join(", ")
                ),
            );
        }
        if self.model.seed > i64::MAX as u64 {
            c.fail("model.seed", format!("must be at most {} (TOML integers are signed 64-bit)", i64::MAX));
        }

        // [engine]
        c.at_least_one("engine.workers", self.engine.workers);
        if self.engine.workers > MAX_WORKERS {
            c.fail(
                "engine.workers",
                format!(
                    "{} is more than {MAX_WORKERS}; each worker is an engine with its own thread and G1 pool",
                    self.engine.workers
                ),
            );
        }
        c.at_least_one("engine.max_batch_tokens", self.engine.max_batch_tokens);
        c.at_least_one("engine.max_running_requests", self.engine.max_running_requests);
        c.at_least_one("engine.max_queued_requests", self.engine.max_queued_requests);
        if self.engine.kind == crate::EngineKind::Simulated {
            c.fail(
                "engine.kind",
                "\"simulated\" computes no tokens, so a node cannot serve with it: it is `dynamo-node bench replay \
                 --engine simulated`'s; serve with \"reference\" or \"scripted\"",
            );
        }
        if self.engine.kind == crate::EngineKind::Vllm {
            let vllm = &self.engine.vllm;
            let launch = &vllm.launch;
            match (vllm.urls.is_empty(), launch.devices.is_empty()) {
                (true, true) => c.fail(
                    "engine.vllm.urls",
                    "engine.kind = \"vllm\" needs at least one engine: urls = [\"http://host:port\"], or engines \
                     to launch ([engine.vllm.launch] devices = [\"0\"])",
                ),
                (false, false) => c.fail(
                    "engine.vllm.launch.devices",
                    "the node either attaches to engine.vllm.urls or launches engines, not both",
                ),
                _ => {}
            }
            if !launch.devices.is_empty() {
                if launch.command.first().is_none_or(|program| program.is_empty()) {
                    c.fail("engine.vllm.launch.command", "names no program to start an engine with");
                }
                if launch.device_env.is_empty() || launch.device_env.contains('=') {
                    c.fail("engine.vllm.launch.device_env", "must be an environment variable's name");
                }
                let last = launch.port as usize + 2 * launch.devices.len() - 1;
                if launch.port == 0 || last > u16::MAX as usize {
                    c.fail(
                        "engine.vllm.launch.port",
                        format!(
                            "{} engines need ports {}..={last}, which must lie in 1..=65535",
                            launch.devices.len(),
                            launch.port
                        ),
                    );
                }
                if launch.connector && !self.engine_endpoint.enabled {
                    c.fail(
                        "engine.vllm.launch.connector",
                        "the engines' KV connector reaches the node through its engine endpoint: set \
                         [engine_endpoint] enabled = true, or connector = false",
                    );
                }
            }
            for (i, url) in vllm.urls.iter().enumerate() {
                let rest = url.strip_prefix("http://").map(|r| r.trim_end_matches('/'));
                if rest.is_none_or(|r| r.is_empty() || r.contains('/')) {
                    c.fail(format!("engine.vllm.urls[{i}]"), format!("`{url}` is not `http://host:port`"));
                }
            }
            if self.model.path.is_none() {
                c.fail(
                    "model.path",
                    "engine.kind = \"vllm\" needs the checkpoint directory the engines serve (its tokenizer, \
                     chat template and vocabulary)",
                );
            }
            if vllm.request_timeout.as_duration().is_zero() {
                c.fail("engine.vllm.request_timeout", "0 would end every request at once");
            }
        }
        if self.engine.kind == crate::EngineKind::Scripted && self.engine.script.is_none() {
            c.fail("engine.script", "engine.kind = \"scripted\" needs engine.script: a JSON array of answers");
        }

        // [blocks]
        let block_size = self.blocks.block_size;
        if !(1..=4096).contains(&block_size) {
            c.fail("blocks.block_size", format!("{block_size} is outside 1..=4096 tokens"));
        }
        let block = self.model_shape().filter(|_| (1..=4096).contains(&block_size)).map(|shape| {
            let per_token = shape.kv_bytes_per_token(self.model.dtype);
            BlockSize { tokens: block_size, per_token, bytes: per_token * block_size as u64 }
        });

        // [tiers]
        let g1 = &self.tiers.g1;
        if g1.capacity.as_u64() == 0 {
            if self.engine.device == DeviceKind::Cpu {
                c.fail(
                    "tiers.g1.capacity",
                    "0 derives the pool from GPU memory, but engine.device = \"cpu\"; set a size such as \"256MiB\"",
                );
            }
        } else {
            c.holds_a_block("tiers.g1.capacity", g1.capacity, block);
        }
        if !(g1.gpu_memory_fraction > 0.0 && g1.gpu_memory_fraction <= 1.0) {
            c.fail("tiers.g1.gpu_memory_fraction", format!("{} is outside (0, 1]", g1.gpu_memory_fraction));
        }

        let g2 = &self.tiers.g2;
        if g2.enabled {
            c.holds_a_block("tiers.g2.capacity", g2.capacity, block);
        }
        c.watermarks("g2", g2.low_watermark, g2.high_watermark);
        c.at_least_one("tiers.g2.write_batch_blocks", g2.write_batch_blocks);

        let g3 = &self.tiers.g3;
        if g3.enabled && !g2.enabled {
            c.fail(
                "tiers.g2.enabled",
                "G2 is off but G3 is on (tiers.g3.enabled): G3 reads and writes go through G2 slots; \
                 enable G2 or disable G3",
            );
        }
        if g3.enabled {
            c.holds_a_block("tiers.g3.capacity_per_path", g3.capacity_per_path, block);
        }
        let mut seen = HashSet::new();
        for (i, path) in g3.paths.iter().enumerate() {
            if path.as_os_str().is_empty() {
                c.fail(format!("tiers.g3.paths[{i}]"), "must not be empty");
            } else if !seen.insert(path) {
                c.fail(
                    format!("tiers.g3.paths[{i}]"),
                    format!("`{}` is listed twice; each path is its own store", path.display()),
                );
            }
        }
        if !(1..=4096).contains(&g3.queue_depth) {
            c.fail("tiers.g3.queue_depth", format!("{} is outside 1..=4096", g3.queue_depth));
        }
        c.at_least_one("tiers.g3.io_threads", g3.io_threads);
        c.watermarks("g3", g3.low_watermark, g3.high_watermark);
        c.at_least_one("tiers.g3.write_batch_blocks", g3.write_batch_blocks);
        c.positive_rate("tiers.g3.read_gb_s", g3.read_gb_s);
        c.positive_rate("tiers.g3.write_gb_s", g3.write_gb_s);

        let g4 = &self.tiers.g4;
        c.socket_addr("tiers.g4.listen", &g4.listen);
        let host_port =
            |s: &str| s.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        for (i, peer) in g4.peers.iter().enumerate() {
            if !host_port(peer) {
                c.fail(format!("tiers.g4.peers[{i}]"), format!("`{peer}` is not `host:port`, e.g. `10.0.0.2:7100`"));
            }
        }

        // [engine_endpoint]
        let endpoint = &self.engine_endpoint;
        if endpoint.enabled {
            if !self.tiers.g2.enabled {
                c.fail("engine_endpoint.enabled", "external engines store into G2: enable tiers.g2");
            }
            if endpoint.socket.as_os_str().is_empty() {
                c.fail("engine_endpoint.socket", "must name a path for the Unix socket");
            }
            let max = endpoint.max_block_bytes.as_u64();
            if !(4096..=(1 << 30)).contains(&max) {
                c.fail(
                    "engine_endpoint.max_block_bytes",
                    format!("{} is outside 4KiB..=1GiB", endpoint.max_block_bytes),
                );
            }
            c.at_least_one("engine_endpoint.max_engines", endpoint.max_engines);
            let share = endpoint.g2_share;
            if !(share > 0.0 && share < 1.0) {
                c.fail(
                    "engine_endpoint.g2_share",
                    format!("{share} is outside (0, 1): it is the fraction of tiers.g2.capacity engines map, the rest is the node's own"),
                );
            }
        }

        // [cluster]
        let cluster = &self.cluster;
        if cluster.membership == MembershipKind::Etcd {
            if !g4.enabled {
                c.fail("cluster.membership", "\"etcd\" needs tiers.g4.enabled = true (peers share blocks over G4)");
            }
            if cluster.etcd_endpoints.is_empty() {
                c.fail("cluster.etcd_endpoints", "must list at least one etcd client URL");
            }
            let unspecified = g4.listen.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_unspecified());
            if cluster.advertise.is_none() && unspecified {
                c.fail(
                    "cluster.advertise",
                    format!("must be set when tiers.g4.listen (`{}`) listens on every address", g4.listen),
                );
            }
        }
        for (i, url) in cluster.etcd_endpoints.iter().enumerate() {
            let rest = url.strip_prefix("http://").or_else(|| url.strip_prefix("https://"));
            if !rest.is_some_and(host_port) {
                c.fail(format!("cluster.etcd_endpoints[{i}]"), format!("`{url}` is not `http://host:port`"));
            }
        }
        if cluster.etcd_prefix.is_empty() || !cluster.etcd_prefix.starts_with('/') {
            c.fail("cluster.etcd_prefix", "must start with `/`");
        }
        let ttl = cluster.lease_ttl.as_duration();
        if ttl < std::time::Duration::from_secs(2) || ttl.subsec_nanos() != 0 {
            c.fail("cluster.lease_ttl", "must be whole seconds, at least 2s");
        }
        if let Some(advertise) = &cluster.advertise
            && !host_port(advertise)
        {
            c.fail("cluster.advertise", format!("`{advertise}` is not `host:port`"));
        }
        c.at_least_one("tiers.g4.max_inflight", g4.max_inflight);
        if !(1..=64).contains(&g4.lanes) {
            c.fail("tiers.g4.lanes", "must be 1 to 64");
        }
        if g4.heartbeat.as_duration() < std::time::Duration::from_millis(10) {
            c.fail("tiers.g4.heartbeat", "must be at least 10ms");
        }
        if g4.request_timeout.as_duration().is_zero() {
            c.fail("tiers.g4.request_timeout", "must be longer than 0s");
        }
        if g4.min_fetch_budget.as_duration() > g4.request_timeout.as_duration() {
            c.fail("tiers.g4.min_fetch_budget", "must not be longer than tiers.g4.request_timeout");
        }
        let tls = [&g4.tls_cert, &g4.tls_key, &g4.tls_ca];
        if tls.iter().any(|f| f.is_some()) && !tls.iter().all(|f| f.is_some()) {
            let missing = ["tls_cert", "tls_key", "tls_ca"]
                .into_iter()
                .zip(tls)
                .find(|(_, f)| f.is_none())
                .map_or("tls_cert", |(key, _)| key);
            c.fail(format!("tiers.g4.{missing}"), "mutual TLS needs all three of tls_cert, tls_key and tls_ca");
        }
        if g4.tls_cert.is_some() && !is_dns_name(&self.node.name) {
            c.fail(
                "node.name",
                format!(
                    "`{}` is not a DNS name: under mutual TLS (tiers.g4.tls_*) peers check that this node's \
                     certificate names it, so it must be one (letters, digits, `-` and `.`)",
                    self.node.name
                ),
            );
        }
        if g4.cluster.is_empty() || g4.cluster.len() > 255 {
            c.fail("tiers.g4.cluster", "must be 1 to 255 bytes");
        }
        if g4.enabled && g4.secret_file.is_none() {
            c.fail(
                "tiers.g4.secret_file",
                "G4 peers authenticate each other with a shared secret: name a file of 32 random bytes \
                 (`head -c 32 /dev/urandom > g4.secret && chmod 600 g4.secret`), the same on every node",
            );
        }
        if g4.hold_ttl.as_duration().is_zero() {
            c.fail("tiers.g4.hold_ttl", "must be longer than 0s");
        }
        c.at_least_one("tiers.g4.max_holds_per_peer", g4.max_holds_per_peer);

        // [retention]
        for region in RegionKind::ALL {
            let policy = self.retention.policy(region);
            if policy.priority > 100 {
                c.fail(format!("retention.{region}.priority"), format!("{} is outside 0..=100", policy.priority));
            }
        }

        // [router]
        let t = self.router.temperature;
        if !(t.is_finite() && t >= 0.0) {
            c.fail("router.temperature", format!("{t} must be a finite number >= 0"));
        }
        c.at_least_one("router.index_max_blocks", self.router.index_max_blocks);
        let w = self.router.working_set;
        if !(w.is_finite() && w >= 0.0) {
            c.fail("router.working_set", format!("{w} must be a finite number >= 0 (a fraction of the cache; 0: off)"));
        }

        let budget = self.tiers.lease_budget;
        if !(0.0..=1.0).contains(&budget) {
            c.fail("tiers.lease_budget", format!("{budget} is outside [0, 1]; it is a fraction of each tier's blocks"));
        }

        // [frontend]
        c.socket_addr("frontend.http", &self.frontend.http);
        if self.frontend.max_prompt_bytes.as_u64() == 0 {
            c.fail("frontend.max_prompt_bytes", "must be larger than 0B");
        }
        if self.frontend.max_body.as_u64() == 0 {
            c.fail("frontend.max_body", "must be larger than 0B");
        }
        if self.frontend.request_timeout.as_duration().is_zero() {
            c.fail("frontend.request_timeout", "must be longer than 0s");
        }
        c.at_least_one("frontend.default_max_tokens", self.frontend.default_max_tokens);
        // More tokens than any model's context is a typo, not a setting.
        for (key, tokens) in [
            ("frontend.default_max_tokens", self.frontend.default_max_tokens),
            ("frontend.max_prompt_tokens", self.frontend.max_prompt_tokens),
        ] {
            if tokens > MAX_CONTEXT_TOKENS {
                c.fail(key, format!("{tokens} tokens is more than any model's context (at most {MAX_CONTEXT_TOKENS})"));
            }
        }
        c.at_least_one("frontend.max_sessions", self.frontend.max_sessions);
        c.at_least_one("frontend.max_connections", self.frontend.max_connections);
        c.at_least_one("frontend.max_connections_per_client", self.frontend.max_connections_per_client);
        for (key, d) in [
            ("frontend.header_timeout", self.frontend.header_timeout),
            ("frontend.body_timeout", self.frontend.body_timeout),
            ("frontend.write_timeout", self.frontend.write_timeout),
            ("frontend.replay_ttl", self.frontend.replay_ttl),
            ("frontend.responses_ttl", self.frontend.responses_ttl),
        ] {
            if d.as_duration().is_zero() {
                c.fail(key, "must be longer than 0s");
            }
        }

        let mut keys = HashSet::new();
        for (i, k) in self.frontend.auth.keys.iter().enumerate() {
            let at = format!("frontend.auth.keys[{i}]");
            if k.key.len() < MIN_KEY_BYTES {
                c.fail(
                    format!("{at}.key"),
                    format!("must be at least {MIN_KEY_BYTES} bytes long; a short key can be guessed"),
                );
            } else if !k.key.bytes().all(|b| b.is_ascii_graphic()) {
                c.fail(format!("{at}.key"), "must be printable ASCII without spaces (it travels in an HTTP header)");
            }
            if k.tenant.is_empty() {
                c.fail(format!("{at}.tenant"), "must name a tenant");
            }
            if !keys.insert(k.key.as_str()) {
                c.fail(format!("{at}.key"), "is listed twice; a key names exactly one tenant");
            }
        }

        // [metrics]
        c.socket_addr("metrics.listen", &self.metrics.listen);
        if let Some(token) = &self.metrics.bearer_token
            && (token.len() < MIN_KEY_BYTES || !token.bytes().all(|b| b.is_ascii_graphic()))
        {
            c.fail(
                "metrics.bearer_token",
                format!("must be at least {MIN_KEY_BYTES} bytes of printable ASCII without spaces"),
            );
        }
        let buckets = &self.metrics.latency_buckets_seconds;
        if buckets.is_empty() {
            c.fail("metrics.latency_buckets_seconds", "must list at least one bucket");
        }
        if let Some(i) = buckets.iter().position(|b| !(b.is_finite() && *b > 0.0)) {
            c.fail(
                "metrics.latency_buckets_seconds",
                format!("bucket {} (index {i}) must be a positive number of seconds", buckets[i]),
            );
        } else if let Some(i) = buckets.windows(2).position(|w| w[0] >= w[1]) {
            c.fail(
                "metrics.latency_buckets_seconds",
                format!("buckets must be strictly increasing, but {} is followed by {}", buckets[i], buckets[i + 1]),
            );
        }

        // [recording]
        let r = &self.recording;
        c.at_least_one("recording.max_files", r.max_files);
        if r.max_file_size.as_u64() < 4096 {
            c.fail("recording.max_file_size", "must be at least 4KiB (a file holds at least one request)");
        }
        if r.rotate_every.0 < std::time::Duration::from_secs(1) {
            c.fail("recording.rotate_every", "must be at least 1s");
        }
        if r.dir.as_os_str().is_empty() {
            c.fail("recording.dir", "must name a directory");
        }

        c.problems
    }
}
