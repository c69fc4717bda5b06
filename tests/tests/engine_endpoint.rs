//! The engine endpoint through the real binary, driven by a client written from its protocol
//! (`runtime/python/README.md`), as the vLLM plug-in drives it: register and map the shared G2,
//! store, look up, load, events; a second engine of the same description shares the blocks,
//! another description does not; G2 too small → blocks come back from G3, verified; a restart →
//! G3's blocks are found again; a corrupted G3 slot is never handed out; bad input gets the
//! protocol's error and the node goes on; an engine that rewrites everything it maps changes
//! nothing the node computed.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_actors::endpoint::recvmsg_with_fd;
use dynamo_tests::Node;
use dynamo_tiering::foreign::{ErrorCode, Found, PROTOCOL_VERSION, Registration, Reply, Request, Role};

/// Bytes of one test block: what a tiny vLLM model's 128-token block takes.
const BLOCK: u64 = 65536;

/// The endpoint on, the engines' G2 2 MiB (half of G2: the other half is the node's own).
fn config() -> String {
    format!(
        r#"
[tiers.g2]
capacity = "4MiB"
mlock = "off"

[tiers.g3]
capacity_per_path = "24MiB"

[engine_endpoint]
enabled = true
max_block_bytes = "{BLOCK}B"
"#
    )
}

/// A registered connection with the region mapped.
struct Client {
    stream: UnixStream,
    map: *mut u8,
    map_len: usize,
    slot_bytes: usize,
    payload_offset: usize,
    region_id: u64,
    _fd: OwnedFd,
}

impl Drop for Client {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping made in `connect`.
        unsafe { libc::munmap(self.map.cast(), self.map_len) };
    }
}

fn registration(engine: &str, role: Role) -> Registration {
    Registration {
        version: PROTOCOL_VERSION,
        role,
        engine_id: engine.into(),
        model: "tiny-llama".into(),
        dtype: "bfloat16".into(),
        layout: "test".into(),
        block_tokens: 128,
        world_size: 1,
        rank: 0,
        block_bytes: BLOCK,
        kv_events: String::new(),
        region: String::new(),
    }
}

fn read_reply(stream: &mut UnixStream, mut have: Vec<u8>) -> Reply {
    while have.len() < 4 {
        let mut b = [0u8; 4096];
        let n = stream.read(&mut b).expect("read");
        assert!(n > 0, "the node closed the connection");
        have.extend_from_slice(&b[..n]);
    }
    let len = u32::from_le_bytes(have[..4].try_into().unwrap()) as usize;
    let mut frame = have[4..].to_vec();
    let missing = (len).saturating_sub(frame.len());
    let mut rest = vec![0; missing];
    stream.read_exact(&mut rest).expect("read frame");
    frame.extend_from_slice(&rest);
    Reply::decode(&frame).expect("a reply decodes")
}

fn call_on(stream: &mut UnixStream, request: &Request) -> Reply {
    stream.write_all(&request.encode()).expect("send");
    read_reply(stream, Vec::new())
}

fn register(socket: &Path, r: Registration) -> Result<Client, (ErrorCode, String)> {
    let mut stream = UnixStream::connect(socket).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    stream.write_all(&Request::Register(r).encode()).expect("send");
    let mut buf = vec![0u8; 4096];
    let (n, fd) = recvmsg_with_fd(stream.as_raw_fd(), &mut buf).expect("recvmsg");
    buf.truncate(n);
    match read_reply(&mut stream, buf) {
        Reply::Registered { region_id, region_bytes, slot_bytes, payload_offset, .. } => {
            let fd = fd.expect("the region's fd rides on REGISTERED");
            // SAFETY: mapping the node's memfd, `region_bytes` long, shared; unmapped in Drop.
            let map = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    region_bytes as usize,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(map, libc::MAP_FAILED);
            Ok(Client {
                stream,
                map: map.cast(),
                map_len: region_bytes as usize,
                slot_bytes: slot_bytes as usize,
                payload_offset: payload_offset as usize,
                region_id,
                _fd: fd,
            })
        }
        Reply::Error { code, message } => Err((code, message)),
        other => panic!("unexpected reply {other:?}"),
    }
}

impl Client {
    fn call(&mut self, request: Request) -> Reply {
        call_on(&mut self.stream, &request)
    }

    fn payload(&mut self, slot: i32) -> &mut [u8] {
        assert!(slot >= 0);
        let at = slot as usize * self.slot_bytes + self.payload_offset;
        assert!(at + BLOCK as usize <= self.map_len);
        let start = self.map.wrapping_add(at);
        // SAFETY: `start..start + BLOCK` lies inside the mapping (checked above), and the node handed
        // this slot to us (store) or pinned it (load), so nothing else writes it meanwhile.
        unsafe { std::slice::from_raw_parts_mut(start, BLOCK as usize) }
    }

    fn lookup(&mut self, keys: &[Vec<u8>]) -> Vec<Found> {
        match self.call(Request::Lookup(keys.to_vec())) {
            Reply::Looked(found) => {
                for (f, slot) in &found {
                    assert_eq!(*f == Found::Hit, *slot >= 0, "a hit, and only a hit, names its slot: {found:?}");
                }
                found.into_iter().map(|(f, _)| f).collect()
            }
            other => panic!("lookup: {other:?}"),
        }
    }

    /// Stores `keys` with payloads from `fill`; returns how many the node took.
    fn store(&mut self, keys: &[Vec<u8>], fill: impl Fn(&[u8]) -> Vec<u8>) -> u32 {
        let Reply::StoreSlots(slots) = self.call(Request::PrepareStore(keys.to_vec())) else { panic!("prepare_store") };
        let mut taken = Vec::new();
        for (key, &slot) in keys.iter().zip(&slots) {
            if slot >= 0 {
                self.payload(slot).copy_from_slice(&fill(key));
                taken.push(key.clone());
            }
        }
        match self.call(Request::CompleteStore { success: true, keys: taken }) {
            Reply::Stored(n) => n,
            other => panic!("complete_store: {other:?}"),
        }
    }

    /// Stores all of `keys`, waiting out "no room" answers (G2 slots still held by write-through
    /// to G3 free up as the writes land) for `limit` at most; returns how many the node took.
    fn store_all(&mut self, keys: &[Vec<u8>], fill: impl Fn(&[u8]) -> Vec<u8>, limit: Duration) -> u32 {
        let started = Instant::now();
        let mut stored = 0;
        let mut left = keys.to_vec();
        while !left.is_empty() {
            let Reply::StoreSlots(slots) = self.call(Request::PrepareStore(left.clone())) else {
                panic!("prepare_store")
            };
            let mut taken = Vec::new();
            let mut refused = Vec::new();
            for (key, &slot) in left.iter().zip(&slots) {
                match slot {
                    0.. => {
                        self.payload(slot).copy_from_slice(&fill(key));
                        taken.push(key.clone());
                    }
                    -2 => refused.push(key.clone()),
                    _ => {}
                }
            }
            match self.call(Request::CompleteStore { success: true, keys: taken }) {
                Reply::Stored(n) => stored += n,
                other => panic!("complete_store: {other:?}"),
            }
            if !refused.is_empty() {
                assert!(started.elapsed() < limit, "G2 had no room for {} blocks for {limit:?}", refused.len());
                std::thread::sleep(Duration::from_millis(20));
            }
            left = refused;
        }
        stored
    }

    /// Loads `keys`: their payloads, `None` where the node had none.
    fn load(&mut self, keys: &[Vec<u8>]) -> Vec<Option<Vec<u8>>> {
        let Reply::LoadSlots(slots) = self.call(Request::PrepareLoad(keys.to_vec())) else { panic!("prepare_load") };
        let out = slots.iter().map(|&s| (s >= 0).then(|| self.payload(s).to_vec())).collect();
        let pinned: Vec<Vec<u8>> = keys.iter().zip(&slots).filter(|(_, s)| **s >= 0).map(|(k, _)| k.clone()).collect();
        let n = pinned.len() as u32;
        assert_eq!(self.call(Request::CompleteLoad(pinned)), Reply::Released(n));
        out
    }

    /// Looks `keys` up until none is pending (G3 reads finish), for `limit` at most.
    fn settle(&mut self, keys: &[Vec<u8>], limit: Duration) -> Vec<Found> {
        let started = Instant::now();
        loop {
            let found = self.lookup(keys);
            if !found.contains(&Found::Pending) || started.elapsed() > limit {
                return found;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// vLLM-style keys: a 32-byte hash then the KV group, 4 bytes big-endian.
fn key(tag: &str, i: usize) -> Vec<u8> {
    let mut k = format!("{tag}-{i:04}").into_bytes();
    k.resize(32, b'.');
    k.extend_from_slice(&0u32.to_be_bytes());
    k
}

/// A payload that depends on every byte of the key.
fn payload(key: &[u8]) -> Vec<u8> {
    let seed = key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
    let mut x = seed;
    (0..BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn socket(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("engines.sock")
}

#[test]
fn engines_store_look_up_and_load_through_the_shared_g2() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let node = Node::start_in(dir.clone(), &config());
    assert!(node.announced.iter().any(|l| l.starts_with("engine endpoint on ")), "{:?}", node.announced);
    let sock = socket(&dir);
    let mut a = register(&sock, registration("vllm-a", Role::Manager)).expect("register");
    let keys: Vec<Vec<u8>> = (0..6).map(|i| key("a", i)).collect();

    assert_eq!(a.lookup(&keys), vec![Found::Miss; 6], "an empty node holds nothing");
    // No worker to write the payloads yet: no slots, so nothing unwritten is ever sealed.
    let Reply::StoreSlots(refused) = a.call(Request::PrepareStore(keys.clone())) else { panic!() };
    assert_eq!(refused, vec![-2; 6]);
    // A worker maps the region but does not manage blocks.
    let mut w = register(&sock, registration("vllm-a", Role::Worker)).unwrap();
    assert!(matches!(w.call(Request::Lookup(keys.clone())), Reply::Error { code: ErrorCode::Refused, .. }));
    assert_eq!(a.store(&keys, payload), 6);
    let Reply::StoreSlots(again) = a.call(Request::PrepareStore(keys[..2].to_vec())) else { panic!() };
    assert_eq!(again, vec![-1, -1], "stored blocks are not stored twice");
    let Reply::Events(events) = a.call(Request::TakeEvents) else { panic!() };
    assert_eq!(events, keys.iter().map(|k| (false, k.clone())).collect::<Vec<_>>(), "one stored event per block");

    assert_eq!(a.lookup(&keys), vec![Found::Hit; 6]);
    for (k, loaded) in keys.iter().zip(a.load(&keys)) {
        assert_eq!(loaded.as_deref(), Some(&payload(k)[..]), "a load returns what was stored");
    }

    // Another instance of the same model and layout (a fresh vLLM process) finds them.
    let mut b = register(&sock, registration("vllm-b", Role::Manager)).expect("register b");
    assert_eq!(b.region_id, a.region_id, "one region per node run");
    assert_eq!(b.lookup(&keys), vec![Found::Hit; 6]);
    assert_eq!(b.load(&keys[..1])[0].as_deref(), Some(&payload(&keys[0])[..]));
    // Another layout never matches.
    let mut c =
        register(&sock, Registration { layout: "other".into(), ..registration("vllm-c", Role::Manager) }).unwrap();
    assert_eq!(c.lookup(&keys), vec![Found::Miss; 6]);

    // Refusals, in the protocol's own shape, and the node goes on.
    let too_big = register(&sock, Registration { block_bytes: 4 * BLOCK, ..registration("big", Role::Manager) });
    let (code, message) = too_big.err().expect("a block larger than the slots is refused");
    assert_eq!(code, ErrorCode::Refused);
    assert!(message.contains("engine_endpoint.max_block_bytes"), "{message}");
    let old = register(&sock, Registration { version: 99, ..registration("old", Role::Manager) });
    assert_eq!(old.err().map(|e| e.0), Some(ErrorCode::Version));
    let mut raw = UnixStream::connect(&sock).unwrap();
    assert!(matches!(call_on(&mut raw, &Request::TakeEvents), Reply::Error { code: ErrorCode::NotRegistered, .. }));
    raw.write_all(&[3, 0, 0, 0, 0x42, 0, 0]).unwrap();
    assert!(matches!(read_reply(&mut raw, Vec::new()), Reply::Error { code: ErrorCode::Malformed, .. }));
    let mut rest = Vec::new();
    assert_eq!(raw.read_to_end(&mut rest).unwrap(), 0, "a malformed frame closes the connection");
    assert_eq!(a.lookup(&keys[..1]), vec![Found::Hit], "the node goes on serving");

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // Retention per engine: an engine whose blocks are "reasoning" keeps them out of G3 (that
    // region's deepest tier is G2), while the default region's reached G3.
    let g3 = "dynamo_node_kv_blocks{tier=\"g3\"}";
    assert_eq!(rt.block_on(node.wait_for_metric(g3, Duration::from_secs(10), |v| v >= 6.0)), 6.0);
    let reasoning = || Registration { region: "reasoning".into(), ..registration("vllm-r", Role::Manager) };
    let mut r = register(&sock, reasoning()).unwrap();
    let _r_worker = register(&sock, Registration { role: Role::Worker, ..reasoning() }).unwrap();
    let thoughts: Vec<Vec<u8>> = (0..3).map(|i| key("thought", i)).collect();
    assert_eq!(r.store(&thoughts, payload), 3);
    assert_eq!(r.lookup(&thoughts), vec![Found::Hit; 3]);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(rt.block_on(node.metric(g3)), 6.0, "reasoning blocks never reach G3");
    let unknown = register(&sock, Registration { region: "nonsense".into(), ..registration("vllm-x", Role::Manager) });
    let (code, message) = unknown.err().expect("an unknown region is refused");
    assert_eq!(code, ErrorCode::Refused);
    assert!(message.contains("region"), "{message}");
    rt.block_on(async {
        assert_eq!(node.metric("dynamo_node_engine_blocks_total{engine=\"0\",op=\"stored\"}").await, 6.0);
        assert_eq!(node.metric("dynamo_node_engine_lookups_total{engine=\"0\",result=\"hit\"}").await, 7.0);
        assert_eq!(node.metric("dynamo_node_engines_registered").await, 4.0, "vllm-a, -b, -c and -r");
    });
    drop((a, b, c, w, r));
    assert_eq!(node.stop(), 0);
    assert!(!sock.exists(), "the socket file goes with the node");
}

#[test]
fn blocks_come_back_from_g3_verified_and_outlive_a_restart_but_a_corrupt_one_is_never_served() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let node = Node::start_in(dir.clone(), &config());
    let sock = socket(&dir);
    let mut a = register(&sock, registration("vllm-a", Role::Manager)).expect("register");
    let _worker = register(&sock, registration("vllm-a", Role::Worker)).expect("register a worker");
    // Three times what G2 holds (30 slots of 68 KiB): the first ones leave G2 for G3 only. A slot
    // whose write to G3 is still in flight cannot be reused yet: on a loaded machine a store can
    // meet "no room" until the writes land. An engine takes that as "not cached"; the test waits.
    let keys: Vec<Vec<u8>> = (0..90).map(|i| key("g3", i)).collect();
    for chunk in keys.chunks(5) {
        assert_eq!(a.store_all(chunk, payload, Duration::from_secs(20)), 5);
    }
    // One engine holds at most half of G2 (at least 16 slots; of 30 here) for stores in flight:
    // never more, and exactly that once the slots still held by G3 writes in flight are free.
    let many: Vec<Vec<u8>> = (0..20).map(|i| key("cap", i)).collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let Reply::StoreSlots(slots) = a.call(Request::PrepareStore(many.clone())) else { panic!() };
        let granted = slots.iter().filter(|s| **s >= 0).count();
        assert!(granted <= 16, "{slots:?}");
        assert_eq!(a.call(Request::CompleteStore { success: false, keys: many.clone() }), Reply::Stored(0));
        if granted == 16 {
            assert_eq!(&slots[16..], &[-2; 4], "the rest: no room");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the cap was never reached: {slots:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(node.wait_for_metric("dynamo_node_kv_blocks{tier=\"g3\"}", Duration::from_secs(20), |v| v >= 90.0));
    let first = &keys[..5];
    let found = a.lookup(first);
    assert!(found.iter().all(|f| *f == Found::Pending), "evicted from G2, in G3: pending, {found:?}");
    assert_eq!(a.settle(first, Duration::from_secs(20)), vec![Found::Hit; 5], "read back into G2");
    for (k, loaded) in first.iter().zip(a.load(first)) {
        assert_eq!(loaded.as_deref(), Some(&payload(k)[..]), "a block back from G3 holds its bytes");
    }
    let Reply::Events(events) = a.call(Request::TakeEvents) else { panic!() };
    assert!(events.iter().any(|(removed, _)| *removed), "G2's evictions are reported as removals");
    drop(a);
    assert_eq!(node.stop(), 0);

    // Flip one payload byte of a block in the G3 file, then restart on the same data directory.
    let victim = &keys[40];
    let g3_file = dir.path().join("g3").join("store.0");
    let mut bytes = std::fs::read(&g3_file).expect("read G3");
    let needle = &payload(victim)[..64];
    let at = bytes.windows(64).position(|w| w == needle).expect("the block is in the G3 file");
    bytes[at + 100] ^= 0x40;
    std::fs::write(&g3_file, &bytes).expect("write G3");
    drop(bytes);

    let node = Node::start_in(dir.clone(), &config());
    let mut b = register(&sock, registration("vllm-b", Role::Manager)).expect("register after restart");
    let intact = [keys[0].clone(), keys[41].clone()];
    assert_eq!(b.settle(&intact, Duration::from_secs(20)), vec![Found::Hit; 2], "G3 recovered them");
    for (k, loaded) in intact.iter().zip(b.load(&intact)) {
        assert_eq!(loaded.as_deref(), Some(&payload(k)[..]));
    }
    let corrupt = std::slice::from_ref(victim);
    let found = b.settle(corrupt, Duration::from_secs(20));
    assert_eq!(found, vec![Found::Miss], "a block that fails verification is dropped, never a hit");
    assert_eq!(b.load(corrupt), vec![None], "and never loadable");
    rt.block_on(async {
        assert_eq!(node.metric("dynamo_node_engine_blocks_total{engine=\"0\",op=\"corrupt\"}").await, 1.0);
    });
    drop(b);
    assert_eq!(node.stop(), 0);
}

/// vLLM's KV events, as its ZMQ publisher sends them, reach the global prefix index: LOCATE (the
/// index's view) says the engine holds the chain in its G1, and loses it when the engine's
/// connection goes.
#[test]
fn an_engines_kv_events_feed_the_index() {
    use rmpv::Value;
    use zeromq::{Socket, SocketSend};

    let dir = Arc::new(tempfile::tempdir().unwrap());
    let node = Node::start_in(dir.clone(), &config());
    let sock = socket(&dir);
    // Multi-threaded: the publisher's sockets are served between the calls below.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let port = dynamo_tests::free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let _in_runtime = rt.enter();
    let mut publisher = zeromq::PubSocket::new();
    rt.block_on(publisher.bind(&endpoint)).expect("bind the publisher");
    let mut a =
        register(&sock, Registration { kv_events: endpoint.clone(), ..registration("vllm-a", Role::Manager) }).unwrap();

    let chain: Vec<(u32, u64)> = (1..=4u64).map(|h| (0, h * 1_000_003)).collect();
    let stored = |hashes: &[(u32, u64)], parent: Option<u64>| {
        let mut event = vec![
            ("type", Value::from("BlockStored")),
            ("block_hashes", Value::Array(hashes.iter().map(|&(_, h)| Value::from(h)).collect())),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            ("token_ids", Value::Array(vec![])),
            ("block_size", Value::from(128)),
            ("lora_id", Value::Nil),
            ("medium", Value::from("GPU")),
            ("lora_name", Value::Nil),
        ];
        event.push(("group_idx", Value::from(0)));
        Value::Map(event.into_iter().map(|(k, v)| (Value::from(k), v)).collect())
    };
    let batch = |events: Vec<Value>| {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &Value::Array(vec![Value::F64(0.0), Value::Array(events)])).unwrap();
        out
    };
    let locate = |a: &mut Client| match a.call(Request::Locate(chain.clone())) {
        Reply::Located(found) => found,
        other => panic!("locate: {other:?}"),
    };
    // The subscriber connects in the background: publish (as vLLM does, every step) until seen.
    let started = Instant::now();
    let mut seq = 0u64;
    loop {
        seq += 1;
        let payload = batch(vec![stored(&chain[..2], None), stored(&chain[2..], Some(chain[1].1))]);
        let message: zeromq::ZmqMessage =
            vec![bytes::Bytes::new(), bytes::Bytes::copy_from_slice(&seq.to_be_bytes()), payload.into()]
                .try_into()
                .unwrap();
        rt.block_on(publisher.send(message)).expect("publish");
        let found = locate(&mut a);
        if let Some(g1) = found.iter().find(|l| l.kind == 0) {
            assert_eq!((g1.id, g1.blocks), (0, 4), "engine 0's G1 holds the whole chain: {found:?}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "the events never reached the index: {found:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    rt.block_on(async {
        assert!(node.metric("dynamo_node_engine_g1_blocks{engine=\"0\"}").await >= 4.0);
        assert!(node.metric("dynamo_node_engine_kv_events_total{engine=\"0\",kind=\"stored\"}").await >= 2.0);
    });
    // The engine goes: its G1 leaves the index.
    drop(a);
    let mut b = register(&sock, registration("vllm-b", Role::Manager)).unwrap();
    let started = Instant::now();
    while locate(&mut b).iter().any(|l| l.kind == 0) {
        assert!(started.elapsed() < Duration::from_secs(10), "a gone engine's G1 stays in the index");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(b);
    assert_eq!(node.stop(), 0);
}

/// Two nodes sharing KV over G4: an engine on node B finds the blocks an engine on node A stored
/// (A's feed tells B's index), answers pending while B fetches them from A (verified as they land
/// in B's G2), then hits and loads A's bytes.
#[test]
fn an_engine_loads_what_an_engine_on_a_peer_node_stored() {
    use std::os::unix::fs::PermissionsExt;

    let g4 = |dir: &tempfile::TempDir, peers: &[String]| {
        let secret = dir.path().join("g4.secret");
        std::fs::write(&secret, [0x42u8; 32]).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        let peers: Vec<String> = peers.iter().map(|p| format!("{p:?}")).collect();
        format!(
            "{}\n[tiers.g4]\nenabled = true\nlisten = \"127.0.0.1:0\"\ncluster = \"test\"\nsecret_file = \"{}\"\n\
             heartbeat = \"200ms\"\npeers = [{}]\n",
            config(),
            secret.display(),
            peers.join(", ")
        )
    };
    let (dir_a, dir_b) = (Arc::new(tempfile::tempdir().unwrap()), Arc::new(tempfile::tempdir().unwrap()));
    let node_a = Node::start_in(dir_a.clone(), &g4(&dir_a, &[]));
    let a_g4 = node_a
        .announced
        .iter()
        .find_map(|l| l.strip_prefix("G4 block server on "))
        .and_then(|l| l.split_whitespace().next())
        .expect("A's G4 address")
        .to_owned();
    let node_b = Node::start_logging(dir_b.clone(), &g4(&dir_b, &[a_g4]), "node.log");

    let mut a = register(&socket(&dir_a), registration("vllm-a", Role::Manager)).unwrap();
    let _a_worker = register(&socket(&dir_a), registration("vllm-a", Role::Worker)).unwrap();
    let keys: Vec<Vec<u8>> = (0..4).map(|i| key("peer", i)).collect();
    assert_eq!(a.store(&keys, payload), 4);

    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // B's index learns A's blocks from A's feed.
    rt.block_on(async {
        let started = Instant::now();
        while node_b.metric_sum("dynamo_node_peer_index_blocks{", "peer=").await < 4.0 {
            assert!(started.elapsed() < Duration::from_secs(20), "B's index never learned A's blocks");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let mut b = register(&socket(&dir_b), registration("vllm-b", Role::Manager)).unwrap();
    let found = b.lookup(&keys);
    let log = std::fs::read_to_string(dir_b.path().join("node.log")).unwrap();
    assert!(found.iter().all(|f| *f == Found::Pending), "held by the peer: pending, {found:?} {log}");
    assert_eq!(b.settle(&keys, Duration::from_secs(20)), vec![Found::Hit; 4], "fetched into B's G2");
    for (k, loaded) in keys.iter().zip(b.load(&keys)) {
        assert_eq!(loaded.as_deref(), Some(&payload(k)[..]), "B loads the bytes A's engine stored");
    }
    rt.block_on(async {
        assert_eq!(node_b.metric("dynamo_node_engine_blocks_total{engine=\"0\",op=\"fetched\"}").await, 4.0);
    });
    drop((a, b));
    assert_eq!(node_b.stop(), 0);
    assert_eq!(node_a.stop(), 0);
}

/// Slots granted by a PREPARE_STORE.
fn granted(client: &mut Client, keys: &[Vec<u8>]) -> usize {
    let Reply::StoreSlots(slots) = client.call(Request::PrepareStore(keys.to_vec())) else { panic!("prepare_store") };
    slots.iter().filter(|&&s| s >= 0).count()
}

/// What one engine, or all of them, may hold of the engines' G2 is bounded however many
/// connections they open: slots held for stores not yet completed are capped per engine (all its
/// connections together; two connections of one engine once took 126 of 127 slots) at half of it,
/// and for every engine together at three quarters, so reads back from G3 keep their room. A
/// request of more than 65,536 keys is the protocol's error, not a 42 MB reply; an engine that
/// does not read its replies is disconnected.
#[test]
fn engines_hold_a_bounded_share_of_g2_and_requests_are_bounded() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let config = config().replace("capacity = \"4MiB\"", "capacity = \"16MiB\"");
    let node = Node::start_in(dir.clone(), &config);
    let sock = socket(&dir);
    let mut a1 = register(&sock, registration("vllm-a", Role::Manager)).expect("register");
    let _wa = register(&sock, registration("vllm-a", Role::Worker)).expect("worker");
    let mut a2 = register(&sock, registration("vllm-a", Role::Manager)).expect("a second connection of a");
    let slots = a1.map_len / a1.slot_bytes;
    assert!(slots >= 100, "{slots} slots");
    let keys: Vec<Vec<u8>> = (0..slots).map(|i| key("a", i)).collect();
    let (half, three_quarters) = ((slots / 2).max(16), (slots * 3 / 4).max(16));
    let first = granted(&mut a1, &keys[..slots / 2]);
    let second = granted(&mut a2, &keys[slots / 2..]);
    assert_eq!(first + second, half, "one engine holds half of G2 at most, over all its connections");
    let mut b = register(&sock, registration("vllm-b", Role::Manager)).expect("register b");
    let _wb = register(&sock, registration("vllm-b", Role::Worker)).expect("worker b");
    let other: Vec<Vec<u8>> = (0..slots).map(|i| key("b", i)).collect();
    assert_eq!(granted(&mut b, &other), three_quarters - half, "engines together hold three quarters at most");
    // A connection that closes gives its slots back.
    drop(a2);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut more = 0;
    while more == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
        more = granted(&mut b, &other[slots / 2..]);
    }
    assert_eq!(more, second, "the closed connection's slots went back");

    // Too many keys in one request: the protocol's error, the connection closed, the node fine.
    let many: Vec<Vec<u8>> = (0..65_537).map(|i| key("m", i)).collect();
    match b.call(Request::Lookup(many)) {
        Reply::Error { code, message } => {
            assert_eq!(code, ErrorCode::Malformed);
            assert!(message.contains("65536"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    let mut c = register(&sock, registration("vllm-c", Role::Manager)).expect("the node goes on");
    assert_eq!(c.lookup(&keys[..3]), vec![Found::Miss; 3]);

    // An engine that sends lookups and never reads the replies is cut off (10 s of no progress).
    let mut silent = register(&sock, registration("vllm-d", Role::Manager)).expect("register d");
    let lookup = Request::Lookup((0..65_536).map(|i| key("s", i)).collect()).encode();
    silent.stream.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
    let started = Instant::now();
    let mut cut = false;
    for _ in 0..64 {
        if silent.stream.write_all(&lookup).is_err() {
            cut = true;
            break;
        }
    }
    assert!(cut, "a connection that reads nothing is closed ({:?})", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(25), "{:?}", started.elapsed());
    assert_eq!(node.stop(), 0);
}

/// Engines map only the engines' G2. One that rewrites every byte it can map — as a hostile or
/// broken engine could, checksums and all — leaves the node's own blocks alone: they live in the
/// node's G2, which no engine maps, and come back from there whole: the same greedy answer, its
/// prefix loaded from G2, nothing found corrupt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_rewrites_all_it_maps_cannot_touch_the_nodes_own_blocks() {
    // One worker with a G1 of 64 blocks, so that a flood pushes the first prompt out of it; a G2
    // of 32 MiB for the node (~480 slots: it keeps every prompt) and as much for the engines.
    let config = format!(
        "[engine]\nworkers = 1\n\n[tiers.g1]\ncapacity = \"2MiB\"\n\n[tiers.g2]\ncapacity = \"64MiB\"\n\
         mlock = \"off\"\n\n[tiers.g3]\nenabled = false\n\n[engine_endpoint]\nenabled = true\n\
         max_block_bytes = \"{BLOCK}B\"\n"
    );
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let node = Node::start_in(dir.clone(), &config);
    let (answer, _, _) = node.greedy_topic("kept").await;
    for k in 0..6 {
        node.greedy_topic(&format!("flood {k}")).await;
    }

    // (A blocking registration: the node is another process, and this test has two threads.)
    let engine = register(&socket(&dir), registration("hostile", Role::Manager)).expect("register");
    assert!(engine.map_len <= 32 << 20, "engines map their share of G2 only: {} bytes", engine.map_len);
    // SAFETY: the whole mapping, which `engine` holds until it drops.
    unsafe { std::ptr::write_bytes(engine.map, 0x5a, engine.map_len) };

    const G2_HITS: &str = "dynamo_node_kv_hit_tokens_total{tier=\"g2\"}";
    const G2_CORRUPT: &str = "dynamo_node_kv_corrupt_blocks_total{tier=\"g2\"}";
    let hits = node.metric(G2_HITS).await;
    let (again, blocks, cached) = node.greedy_topic("kept").await;
    assert_eq!(again, answer, "the node's answer is its own");
    assert!(cached as f64 >= 0.9 * blocks * 32.0, "its prefix is cached: {cached} of {blocks} blocks");
    let loaded = node.metric(G2_HITS).await - hits;
    assert!(loaded >= 0.9 * blocks * 32.0, "and loaded from the node's G2: {loaded} tokens");
    assert_eq!(node.metric(G2_CORRUPT).await, 0.0, "no block of the node's was touched");
    drop(engine);
}
