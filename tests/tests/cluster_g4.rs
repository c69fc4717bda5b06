//! Two real nodes share KV over G4: node B loads the prefix node A computed instead of computing it.
//!
//! B follows A's feed (what A's G2 can serve), so B's index knows A's blocks; a request on B whose
//! prompt A has served is onboarded from A over the authenticated block protocol, and B's answer
//! is the one A gave (greedy decoding of the same seeded model: loading must not change a token).
//! The hits show as G4 in B's `cached_tokens` and metrics. Then A is killed with SIGKILL: B drops
//! A's blocks and recomputes, with the same answers and no error.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::Duration;

use dynamo_tests::{Node, long_prompt};

/// How long a test waits for a metric to show what it expects.
const LIMIT: Duration = Duration::from_secs(10);

fn secret_file(dir: &tempfile::TempDir, secret: [u8; 32]) -> std::path::PathBuf {
    let path = dir.path().join("g4.secret");
    std::fs::write(&path, secret).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn g4_config(secret: &std::path::Path, peers: &[String]) -> String {
    g4_config_with(secret, peers, "200ms")
}

fn g4_config_with(secret: &std::path::Path, peers: &[String], heartbeat: &str) -> String {
    g4_config_on(secret, peers, heartbeat, "127.0.0.1:0")
}

fn g4_config_on(secret: &std::path::Path, peers: &[String], heartbeat: &str, listen: &str) -> String {
    let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
    format!(
        "[tiers.g3]\ncapacity_per_path = \"64MiB\"\n\n[tiers.g4]\nenabled = true\nlisten = \"{listen}\"\n\
         cluster = \"test\"\nsecret_file = \"{}\"\nheartbeat = \"{heartbeat}\"\nhistory = true\npeers = [{}]\n",
        secret.display(),
        peers.join(", ")
    )
}

fn g4_addr(node: &Node) -> String {
    node.announced
        .iter()
        .find_map(|l| l.strip_prefix("G4 block server on "))
        .and_then(|l| l.split_whitespace().next())
        .expect("the G4 address is printed")
        .to_owned()
}

#[tokio::test]
async fn a_node_loads_the_prefix_its_peer_computed_and_recomputes_when_the_peer_dies() {
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let secret = [0x42; 32];
    let a = Node::start_in(dir_a.clone(), &g4_config(&secret_file(&dir_a, secret), &[]));
    let b = Node::start_in(dir_b.clone(), &g4_config(&secret_file(&dir_b, secret), &[g4_addr(&a)]));
    assert!(b.announced.iter().any(|l| l.starts_with("G4 peers: ")), "{:?}", b.announced);

    // A computes two prompts; B's index learns A's blocks from A's feed.
    let (first, second) = (long_prompt("alpha"), long_prompt("beta"));
    let (a_first, prompt_tokens, a_cached) = a.greedy(&first).await;
    assert_eq!(a_cached, 0, "nothing was cached anywhere yet");
    let (a_second, _, _) = a.greedy(&second).await;
    let blocks = (prompt_tokens / 32) as f64;
    let known = b.wait_for_metric("dynamo_node_index_blocks", LIMIT, |v| v >= 2.0 * blocks).await;
    assert!(known >= 2.0 * blocks, "B's index knows A's blocks: {known} of {}", 2.0 * blocks);
    // Not just as many: the very set A's feed offers (the digests of the two sets agree).
    let truth = a.metric("dynamo_node_peer_servable_digest").await;
    assert!(truth != 0.0, "A offers blocks");
    let digest = b.wait_for_sum("dynamo_node_peer_index_digest{", "peer=", LIMIT, |v| v == truth).await;
    assert_eq!(digest, truth, "B's index of A holds the blocks A offers");

    // B loads the first prompt's prefix from A: the same answer, the hits counted as G4.
    let (b_first, _, b_cached) = b.greedy(&first).await;
    assert_eq!(b_first, a_first, "loading from a peer must not change a token");
    assert!(b_cached as f64 >= (blocks - 1.0) * 32.0, "cached {b_cached} of {prompt_tokens} prompt tokens");
    let g4_hits = b.metric("dynamo_node_kv_hit_tokens_total{tier=\"g4\"}").await;
    assert_eq!(g4_hits, b_cached as f64, "every cached token came from the peer");
    let verified = b.metric_sum("dynamo_node_peer_fetched_blocks_total{", "outcome=\"verified\"").await;
    let fetched = (b_cached / 32) as f64;
    assert!(verified >= fetched, "verified blocks {verified}, cached blocks {fetched}");
    let served = a.metric("dynamo_node_peer_served_bytes_total").await;
    assert!(served > 0.0, "A served its images");
    let history = check_history(&dir_b, &dir_a).await;
    let loaded = history.iter().filter(|e| e["outcome"] == "verified").count();
    assert_eq!(loaded as f64, fetched, "one verified line per block loaded");

    // A dies without a word. B recomputes the second prompt: the same answer, no error.
    let mut a = a;
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let (b_second, _, b_cached) = b.greedy(&second).await;
    assert_eq!(b_second, a_second, "a dead peer costs a recompute, never a token");
    assert_eq!(b_cached, 0, "nothing of the second prompt is cached on B");
    let g4_after = b.metric("dynamo_node_kv_hit_tokens_total{tier=\"g4\"}").await;
    assert_eq!(g4_after, g4_hits, "no hit from a dead peer");
    // B noticed: the feed ended (and A's blocks left its index with it).
    let ended = b.wait_for_metric("dynamo_node_peer_feed_ended_total", LIMIT, |v| v >= 1.0).await;
    assert!(ended >= 1.0, "B noticed the feed end");
    assert_eq!(b.stop(), 0);
}

#[tokio::test]
async fn images_that_fail_verification_are_dropped_and_recomputed() {
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let secret = [0x43; 32];
    // A serves every image with one payload byte flipped, under valid MACs: a peer whose memory
    // went bad, which only the reader's verification can catch.
    let mut cmd = Node::command(&dir_a, &g4_config(&secret_file(&dir_a, secret), &[]));
    cmd.env("FAILPOINTS", "g4-serve-corrupt=return");
    let a = Node::start_command(cmd, dir_a.clone());
    let b = Node::start_in(dir_b.clone(), &g4_config(&secret_file(&dir_b, secret), &[g4_addr(&a)]));

    let alpha = long_prompt("alpha");
    let (a_alpha, prompt_tokens, _) = a.greedy(&alpha).await;
    let blocks = (prompt_tokens / 32) as f64;
    b.wait_for_metric("dynamo_node_index_blocks", LIMIT, |v| v >= blocks).await;
    let (b_alpha, _, cached) = b.greedy(&alpha).await;
    assert_eq!(b_alpha, a_alpha, "recomputed, the same tokens");
    assert_eq!(cached, 0, "no corrupt block was used");
    assert_eq!(b.metric("dynamo_node_kv_hit_tokens_total{tier=\"g4\"}").await, 0.0);
    let rejected = b.metric_sum("dynamo_node_peer_fetched_blocks_total{", "outcome=\"rejected\"").await;
    assert!(rejected >= 1.0, "the corrupt images were rejected: {rejected}");
    let verified = b.metric_sum("dynamo_node_peer_fetched_blocks_total{", "outcome=\"verified\"").await;
    assert_eq!(verified, 0.0);
    let corrupt = b.metric_sum("dynamo_node_kv_corrupt_blocks_total{", "tier=\"g4\"").await;
    assert_eq!(corrupt, rejected, "each counted as a corrupt G4 block");
    let history = check_history(&dir_b, &dir_a).await;
    assert!(history.iter().all(|e| e["outcome"] == "rejected" || e["outcome"] == "skipped"), "{history:?}");
    assert!(history.iter().any(|e| e["outcome"] == "rejected"));
    assert_eq!(b.stop(), 0);
}

#[tokio::test]
async fn a_link_too_slow_for_its_budget_is_recomputed_and_then_not_tried() {
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let secret = [0x44; 32];
    let a = Node::start_in(dir_a.clone(), &g4_config(&secret_file(&dir_a, secret), &[]));
    // Every answer from A reaches B 300 ms late; a fetch's budget is far shorter.
    let slow = delaying_forwarder(g4_addr(&a), Duration::from_millis(300)).await;
    let b = Node::start_in(dir_b.clone(), &g4_config_with(&secret_file(&dir_b, secret), &[slow], "1s"));

    let (alpha, beta) = (long_prompt("alpha"), long_prompt("beta"));
    let (a_alpha, prompt_tokens, _) = a.greedy(&alpha).await;
    let (a_beta, _, _) = a.greedy(&beta).await;
    let blocks = (prompt_tokens / 32) as f64;
    let known = b.wait_for_metric("dynamo_node_index_blocks", LIMIT, |v| v >= 2.0 * blocks).await;
    assert!(known >= 2.0 * blocks, "B knows A's blocks through the slow link: {known}");

    // The first fetch runs past its budget: cancelled, recomputed, the same tokens.
    let started = std::time::Instant::now();
    let (b_alpha, _, cached) = b.greedy(&alpha).await;
    assert_eq!(b_alpha, a_alpha);
    assert_eq!(cached, 0);
    assert!(started.elapsed() < Duration::from_secs(3), "not held up by the link: {:?}", started.elapsed());
    let deadline = b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"deadline\"").await;
    assert_eq!(deadline, 1.0, "one fetch ran out of budget");
    let history = check_history(&dir_b, &dir_a).await;
    assert!(!history.is_empty() && history.iter().all(|e| e["outcome"] == "deadline"), "{history:?}");

    // Having seen the link's rate, the cost model recomputes without trying it again.
    let (b_beta, _, cached) = b.greedy(&beta).await;
    assert_eq!(b_beta, a_beta);
    assert_eq!(cached, 0);
    let fetches = b.metric_sum("dynamo_node_peer_fetches_total{", "").await;
    assert_eq!(fetches, 1.0, "no second fetch over a link slower than recomputing");
    assert_eq!(b.stop(), 0);
}

#[tokio::test]
async fn a_bit_flipped_on_the_wire_fails_the_frame_mac_and_is_recomputed() {
    let (b, history) = bit_flipped_on_the_wire("mac", 0x46).await;
    // The MAC over the damaged frame fails: the lane drops its connection and the whole fetch
    // with it, the two sound images before the damage included.
    assert_eq!(b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"bad_mac\"").await, 1.0);
    assert_eq!(b.metric_sum("dynamo_node_tier_errors_total{", "kind=\"bad_mac\"").await, 1.0);
    assert_eq!(b.metric(G4_HITS).await, 0.0, "nothing of a fetch that failed its MAC is used");
    assert_eq!(b.metric_sum("dynamo_node_peer_fetched_blocks_total{", "outcome=\"verified\"").await, 0.0);
    assert!(!history.is_empty() && history.iter().all(|e| e["outcome"] == "bad_mac"), "{history:?}");
    assert_eq!(b.stop(), 0);
}

#[tokio::test]
async fn a_bit_flipped_on_the_wire_is_caught_by_the_image_checksum() {
    let (b, history) = bit_flipped_on_the_wire("checksum", 0x47).await;
    // No MAC covers images: the image's own checksum catches the damage. The two images before
    // it are used, the damaged one is dropped as corrupt and the prefix ends there.
    assert_eq!(b.metric(G4_HITS).await, 64.0, "the two sound blocks before the damage were loaded");
    assert_eq!(b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"ok\"").await, 1.0);
    let rejected = b.metric_sum("dynamo_node_peer_fetched_blocks_total{", "outcome=\"rejected\"").await;
    assert_eq!(rejected, 1.0, "the damaged image was rejected");
    assert_eq!(b.metric_sum("dynamo_node_kv_corrupt_blocks_total{", "tier=\"g4\"").await, 1.0);
    let outcomes: Vec<&str> = history.iter().map(|e| e["outcome"].as_str().unwrap()).collect();
    assert_eq!(outcomes[..3], ["verified", "verified", "rejected"], "{history:?}");
    assert!(outcomes[3..].iter().all(|&o| o == "skipped"), "{history:?}");
    assert_eq!(b.stop(), 0);
}

const G4_HITS: &str = "dynamo_node_kv_hit_tokens_total{tier=\"g4\"}";

/// B reaches A through [`corrupting_forwarder`], which damages the third image of each
/// connection, both nodes protecting images by `integrity`. A computes a prompt and B asks for
/// it: B's answer is A's (greedy, so a wrongly loaded block would show), and its history holds
/// no loaded block that is not A's. The feed carries no image and is untouched. B and its
/// history, for the checks of the mode.
async fn bit_flipped_on_the_wire(integrity: &str, key: u8) -> (Node, Vec<serde_json::Value>) {
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    // The fetch is given all the time it needs (under a debug build on two busy cores it can
    // take longer than recomputing): what is checked is what arrives, not when.
    let config = |dir: &tempfile::TempDir, peers: &[String]| {
        format!(
            "{}integrity = \"{integrity}\"\nrequest_timeout = \"10s\"\nmin_fetch_budget = \"10s\"\n",
            g4_config(&secret_file(dir, [key; 32]), peers)
        )
    };
    let a = Node::start_in(dir_a.clone(), &config(&dir_a, &[]));
    let damaged = corrupting_forwarder(g4_addr(&a), 2).await;
    let b = Node::start_in(dir_b.clone(), &config(&dir_b, &[damaged]));

    let alpha = long_prompt("alpha");
    let (a_alpha, prompt_tokens, _) = a.greedy(&alpha).await;
    let blocks = (prompt_tokens / 32) as f64;
    let known = b.wait_for_metric("dynamo_node_index_blocks", LIMIT, |v| v >= blocks).await;
    assert!(known >= blocks, "B knows A's blocks through the forwarder: {known}");
    let (b_alpha, _, cached) = b.greedy(&alpha).await;
    assert_eq!(b_alpha, a_alpha, "a damaged stream costs a recompute, never a token");
    assert_eq!(b.metric(G4_HITS).await, cached as f64, "B's cached tokens are its G4 hits");
    assert_eq!(b.metric_sum("dynamo_node_peer_feed_ended_total{", "").await, 0.0, "the feed is undamaged");
    let history = check_history(&dir_b, &dir_a).await;
    assert!(history.len() >= 3, "one line per block asked: {history:?}");
    drop(a);
    (b, history)
}

/// `tiers.g4.tls_*` lines for `node`'s test certificate (`tests/fixtures/g4-tls`), trusting `ca`.
fn tls_config(node: &str, ca: &str) -> String {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/g4-tls");
    let file = |name: String| format!("{:?}", dir.join(name).display().to_string());
    format!(
        "tls_cert = {}\ntls_key = {}\ntls_ca = {}\n",
        file(format!("{node}.pem")),
        file(format!("{node}.key")),
        file(ca.to_owned())
    )
}

#[tokio::test]
async fn nodes_share_kv_over_mutual_tls_and_a_node_of_another_ca_gets_nothing() {
    let dirs: Vec<_> = (0..3).map(|_| Arc::new(tempfile::tempdir().unwrap())).collect();
    let secret = [0x48; 32];
    // Each node is named as its certificate names it: a peer checks the two agree.
    let config = |i: usize, peers: &[String], node: &str| {
        let g4 = g4_config(&secret_file(&dirs[i], secret), peers);
        format!("[node]\nname = \"{node}\"\n\n{g4}{}", tls_config(node, "ca.pem"))
    };
    let a = Node::start_in(dirs[0].clone(), &config(0, &[], "node-a"));
    let b = Node::start_in(dirs[1].clone(), &config(1, &[g4_addr(&a)], "node-b"));
    // C holds the secret but its certificate is another cluster CA's: A refuses it in TLS.
    let c = Node::start_in(dirs[2].clone(), &config(2, &[g4_addr(&a)], "rogue"));

    let alpha = long_prompt("alpha");
    let (a_alpha, prompt_tokens, _) = a.greedy(&alpha).await;
    let blocks = (prompt_tokens / 32) as f64;
    let known = b.wait_for_metric("dynamo_node_index_blocks", LIMIT, |v| v >= blocks).await;
    assert!(known >= blocks, "B follows A's feed over TLS: {known}");
    let (b_alpha, _, b_cached) = b.greedy(&alpha).await;
    assert_eq!(b_alpha, a_alpha);
    assert!(b_cached as f64 >= (blocks - 1.0) * 32.0, "cached {b_cached} of {prompt_tokens}");
    assert_eq!(b.metric(G4_HITS).await, b_cached as f64, "loaded from A over TLS");

    let refused = a.wait_for_metric("dynamo_node_peer_connections_total{outcome=\"tls\"}", LIMIT, |v| v >= 1.0).await;
    assert!(refused >= 1.0, "A counts C's refused TLS handshakes");
    let (c_alpha, _, c_cached) = c.greedy(&alpha).await;
    assert_eq!(c_alpha, a_alpha);
    assert_eq!((c_cached, c.metric(G4_HITS).await), (0, 0.0), "C loads nothing from A");
    check_history(&dirs[1], &dirs[0]).await;
    assert_eq!(b.stop(), 0);
    assert_eq!(c.stop(), 0);
}

/// A TCP forwarder to `to`. Each connection's answers (server to client) pass, read by read,
/// through a fresh filter from `filter`, which may change the bytes and says how long to hold
/// them and how many of them go on: fewer than were read cuts the connection after them.
async fn forwarder<F>(to: String, filter: impl Fn() -> F + Send + 'static) -> String
where
    F: FnMut(&mut [u8]) -> (Duration, usize) + Send + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&to).await else { continue };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let mut filter = filter();
            tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = sr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let (hold, keep) = filter(&mut buf[..n]);
                    if !hold.is_zero() {
                        tokio::time::sleep(hold).await;
                    }
                    if cw.write_all(&buf[..keep.min(n)]).await.is_err() || keep < n {
                        break;
                    }
                }
            });
        }
    });
    addr
}

/// A TCP forwarder to `to` whose answers (server to client) are each held for `delay`: the
/// latency of a far or congested link, made in user space (this kernel has no netem).
async fn delaying_forwarder(to: String, delay: Duration) -> String {
    forwarder(to, move || move |buf: &mut [u8]| (delay, buf.len())).await
}

/// Finds block images in a byte stream fed in reads of any size: by their header (magic and
/// header checksum), so nothing else in the stream (the handshake, control frames, the feed)
/// is taken for one.
#[derive(Default)]
struct ImageSpotter {
    /// The stream's last HEADER_LEN - 1 bytes, so that a header split across two reads is found
    /// (once: in the read that completes it).
    window: Vec<u8>,
    /// Bytes of the stream before the current read.
    passed: usize,
}

impl ImageSpotter {
    /// The images whose header ends in `read`: each one's offset in the stream and length.
    fn spot(&mut self, read: &[u8]) -> Vec<(usize, usize)> {
        use dynamo_tiering::block::image::MAGIC;
        use dynamo_tiering::block::{HEADER_LEN, ImageHeader};
        self.window.extend_from_slice(read);
        let window_at = self.passed + read.len() - self.window.len();
        let mut found = Vec::new();
        for i in 0..self.window.len().saturating_sub(HEADER_LEN - 1) {
            if self.window[i..].starts_with(&MAGIC)
                && let Ok(header) = ImageHeader::decode_header_only(&self.window[i..])
            {
                found.push((window_at + i, header.image_bytes()));
            }
        }
        self.window.drain(..self.window.len().saturating_sub(HEADER_LEN - 1));
        self.passed += read.len();
        found
    }
}

/// A TCP forwarder to `to` that flips one bit halfway into the `nth` block image (from 0) that
/// each connection carries from the server: a NIC, switch or middlebox that damages a stream
/// and gets past TCP's 16-bit checksum. The flip lands in an image's payload, never in the
/// handshake, a control frame or the feed, whatever the frames around it weigh.
async fn corrupting_forwarder(to: String, nth: usize) -> String {
    forwarder(to, move || {
        let mut spotter = ImageSpotter::default();
        let (mut images, mut flip_at) = (0usize, None);
        move |buf: &mut [u8]| {
            let passed = spotter.passed;
            for (at, len) in spotter.spot(buf) {
                if images == nth {
                    flip_at = Some(at + len / 2);
                }
                images += 1;
            }
            if let Some(at) = flip_at
                && (passed..passed + buf.len()).contains(&at)
            {
                buf[at - passed] ^= 0x10;
                flip_at = None;
            }
            (Duration::ZERO, buf.len())
        }
    })
    .await
}

/// A TCP forwarder to `to` that, the first time an image comes through, says so on the channel,
/// holds that read for `hold`, passes it on only up to the middle of the image and cuts the
/// connection there: the server dying halfway through sending a block.
async fn cutting_forwarder(to: String, hold: Duration) -> (String, tokio::sync::oneshot::Receiver<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Arc::new(std::sync::Mutex::new(Some(tx)));
    let addr = forwarder(to, move || {
        let (mut spotter, tx, mut cut_at) = (ImageSpotter::default(), tx.clone(), None);
        move |buf: &mut [u8]| {
            let passed = spotter.passed;
            let spotted = spotter.spot(buf);
            if cut_at.is_none()
                && let Some(&(at, len)) = spotted.first()
                && let Some(tx) = tx.lock().unwrap().take()
            {
                let _ = tx.send(());
                cut_at = Some(at + len / 2);
            }
            match cut_at {
                Some(cut) if cut < passed + buf.len() => (hold, cut.saturating_sub(passed)),
                _ => (Duration::ZERO, buf.len()),
            }
        }
    })
    .await;
    (addr, rx)
}

#[tokio::test]
async fn a_peer_killed_mid_transfer_costs_a_recompute_and_no_wrong_block() {
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let secret = [0x49; 32];
    let a = Node::start_in(dir_a.clone(), &g4_config(&secret_file(&dir_a, secret), &[]));
    let (via, in_flight) = cutting_forwarder(g4_addr(&a), Duration::from_millis(20)).await;
    let b = Node::start_in(dir_b.clone(), &g4_config(&secret_file(&dir_b, secret), &[via]));

    let alpha = long_prompt("alpha");
    let (a_alpha, prompt_tokens, _) = a.greedy(&alpha).await;
    let blocks = (prompt_tokens / 32) as f64;
    let known = b.wait_for_metric("dynamo_node_index_blocks", LIMIT, |v| v >= blocks).await;
    assert!(known >= blocks, "B knows A's blocks: {known}");
    // B asks; the moment A's first image is on the wire to B, A dies (and B's stream ends
    // halfway through that image).
    let asking = tokio::spawn(async move {
        let answer = b.greedy(&alpha).await;
        (b, answer)
    });
    tokio::time::timeout(LIMIT, in_flight).await.expect("B fetched from A").unwrap();
    let mut a = a;
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    let (b, (b_alpha, _, cached)) = asking.await.unwrap();
    assert_eq!(b_alpha, a_alpha, "a peer dead mid-transfer costs a recompute, never a token");
    assert_eq!(b.metric(G4_HITS).await, cached as f64);
    assert_eq!(b.metric_sum("dynamo_node_peer_fetches_total{", "outcome=\"ok\"").await, 0.0, "the fetch failed");
    let history = check_history(&dir_b, &dir_a).await;
    assert!(history.iter().all(|e| e["outcome"] != "verified"), "nothing of the cut fetch was used: {history:?}");
    assert_eq!(b.stop(), 0);
}

/// The Jepsen-style check of `reader`'s G4 history (`tiers.g4.history`) against the truth, the
/// images `server` holds in its G3 store (the same sealed images its G2 serves): no block was
/// loaded whose digest is not the server's for that hash, and no fetch outlived its budget (plus
/// 100 ms of scheduling slack). The history's entries.
async fn check_history(reader: &tempfile::TempDir, server: &tempfile::TempDir) -> Vec<serde_json::Value> {
    let path = reader.path().join("g4-history.jsonl");
    let mut entries: Vec<serde_json::Value> = Vec::new();
    let mut truth = HashMap::new();
    for _ in 0..100 {
        // The history's writer and the server's G3 write-through both run behind the requests.
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        entries = text.lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
        truth = images_on_disk(&server.path().join("g3").join("store.0"));
        let loaded = |e: &&serde_json::Value| e["outcome"] == "verified";
        if !entries.is_empty() && entries.iter().filter(loaded).all(|e| truth.contains_key(e["hash"].as_str().unwrap()))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for e in &entries {
        let took = e["t1_ms"].as_u64().unwrap() - e["t0_ms"].as_u64().unwrap();
        assert!(took <= e["budget_ms"].as_u64().unwrap() + 100, "a fetch outlived its budget: {e}");
        if e["outcome"] == "verified" {
            let hash = e["hash"].as_str().unwrap();
            let digest = format!("{:016x}", truth.get(hash).unwrap_or_else(|| panic!("{hash} is not the server's")));
            assert_eq!(e["digest"].as_str(), Some(digest.as_str()), "a loaded image is not the server's: {e}");
        }
    }
    entries
}

/// Every sealed image in a G3 store file: hash (32 hex digits) → the image's xxh3-64.
fn images_on_disk(path: &std::path::Path) -> HashMap<String, u64> {
    use dynamo_tiering::block::ImageHeader;
    use dynamo_tiering::block::image::MAGIC;
    let data = std::fs::read(path).unwrap_or_default();
    let mut out = HashMap::new();
    for at in (0..data.len()).step_by(4096) {
        if data[at..].starts_with(&MAGIC)
            && let Ok(header) = ImageHeader::decode_header_only(&data[at..])
            && at + header.image_bytes() <= data.len()
        {
            let image = &data[at..at + header.image_bytes()];
            out.insert(header.hash.to_string(), xxhash_rust::xxh3::xxh3_64(image));
        }
    }
    out
}

#[tokio::test]
async fn a_restarted_peer_serves_what_its_g3_recovered() {
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let secret = [0x45; 32];
    // A fixed address, so that B finds A again after its restart.
    let listen = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().to_string()
    };
    let a_config = g4_config_on(&secret_file(&dir_a, secret), &[], "200ms", &listen);
    let a = Node::start_in(dir_a.clone(), &a_config);
    // B waits for A's fetches as long as they take: the restarted A reads each block from its
    // disk before it serves it, and on a loaded machine that can take longer than recomputing.
    // What this test asks is whether A serves what it recovered, not how soon.
    let b_config = format!(
        "{}request_timeout = \"60s\"\nmin_fetch_budget = \"60s\"\n",
        g4_config(&secret_file(&dir_b, secret), std::slice::from_ref(&listen))
    );
    let b = Node::start_in(dir_b.clone(), &b_config);

    // A computes, writes through to G3 and stops; its G2 is gone with the process.
    let alpha = long_prompt("alpha");
    let (a_alpha, prompt_tokens, _) = a.greedy(&alpha).await;
    let blocks = (prompt_tokens / 32) as usize;
    assert_eq!(a.stop(), 0);
    let on_disk = images_on_disk(&dir_a.path().join("g3").join("store.0")).len();
    assert!(on_disk >= blocks, "A's G3 holds the prompt: {on_disk} of {blocks} blocks");

    // Restarted, A recovers its G3 and advertises it; B loads from it (A reads each held block
    // from disk into G2 first) with the answer A gave before.
    let a = Node::start_in(dir_a.clone(), &a_config);
    assert!(a.announced.iter().any(|l| l.contains("recovered")), "{:?}", a.announced);
    // B's index of A is emptied when A's first feed ends, so blocks it knows after that came
    // from the restarted A's feed (not a stale view of the A that stopped).
    let ended = b.wait_for_sum("dynamo_node_peer_feed_ended_total{", "peer=", LIMIT, |v| v >= 1.0).await;
    assert!(ended >= 1.0, "B saw A's first feed end");
    // (B retries the feed with a backoff of up to 5 s while A is down.)
    let known = b.wait_for_metric("dynamo_node_index_blocks", 3 * LIMIT, |v| v >= blocks as f64).await;
    assert!(known >= blocks as f64, "B knows what A recovered: {known}");
    let (b_alpha, _, cached) = b.greedy(&alpha).await;
    assert_eq!(b_alpha, a_alpha, "the same tokens from a recovered block");
    assert!(cached as usize >= (blocks - 1) * 32, "cached {cached} of {prompt_tokens}");
    assert_eq!(b.metric("dynamo_node_kv_hit_tokens_total{tier=\"g4\"}").await, cached as f64);
    let history = check_history(&dir_b, &dir_a).await;
    assert!(history.iter().any(|e| e["outcome"] == "verified"));
    assert_eq!(b.stop(), 0);
    assert_eq!(a.stop(), 0);
}
