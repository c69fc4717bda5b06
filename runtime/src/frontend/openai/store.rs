//! The Responses API's stored responses: what `previous_response_id`, `GET /v1/responses/{id}`
//! and `/input_items` read.
//!
//! Bounded by bytes as well as count and age: every byte a stored response keeps — its response
//! object, its input items, the turns of its conversation — is charged to its tenant while it
//! lives, and the store keeps the total within `frontend.responses_store_bytes` and each
//! tenant's within its share (the budget and the count divided among the tenants the keys name),
//! so one tenant's responses never evict another's. A response that continues another shares its
//! conversation instead of copying it: it keeps only the turns it added and a pointer to the
//! history before them, so a chain of N responses costs its turns once, not N times.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

use crate::frontend::Tenant;
use crate::frontend::ir::{Block, Turn};

/// Bytes charged for each block and turn besides their text (their allocations and fields).
const BLOCK_OVERHEAD: usize = 64;

/// What the store's entries hold, by tenant and in all (charged while it lives, released on drop).
#[derive(Debug, Default)]
struct Usage {
    total: usize,
    by_tenant: HashMap<Tenant, usize>,
}

/// Bytes charged to a tenant for as long as the value holding it lives.
#[derive(Debug)]
struct Charge {
    usage: Arc<Mutex<Usage>>,
    tenant: Tenant,
    bytes: usize,
}

impl Charge {
    fn new(usage: &Arc<Mutex<Usage>>, tenant: &Tenant, bytes: usize) -> Charge {
        let mut u = usage.lock();
        u.total += bytes;
        *u.by_tenant.entry(tenant.clone()).or_default() += bytes;
        Charge { usage: usage.clone(), tenant: tenant.clone(), bytes }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut u = self.usage.lock();
        u.total -= self.bytes;
        if let Some(n) = u.by_tenant.get_mut(&self.tenant) {
            *n -= self.bytes;
            if *n == 0 {
                u.by_tenant.remove(&self.tenant);
            }
        }
    }
}

/// A conversation as stored: the turns one response added, after the history it continued.
#[derive(Debug)]
pub(crate) struct History {
    parent: Option<Arc<History>>,
    turns: Vec<Turn>,
    _charge: Charge,
}

impl History {
    /// Every turn, oldest first (copied: for rendering a request that continues it).
    pub(crate) fn turns(&self) -> Vec<Turn> {
        let mut chain = vec![self];
        while let Some(parent) = chain.last().and_then(|h| h.parent.as_deref()) {
            chain.push(parent);
        }
        chain.iter().rev().flat_map(|h| h.turns.iter().cloned()).collect()
    }
}

/// One stored response.
#[derive(Debug)]
pub(crate) struct Stored {
    /// The response object, as it was answered.
    pub(crate) response: Value,
    /// The request's input items, with ids.
    pub(crate) input_items: Vec<Value>,
    /// The whole conversation through this response's output, for a request that continues it.
    pub(crate) history: Arc<History>,
    /// The session it belongs to.
    pub(crate) session: Option<String>,
    /// Whose it is: no other tenant can read, continue or delete it.
    pub(crate) tenant: Tenant,
    _charge: Charge,
}

/// Stored responses by id.
#[derive(Debug)]
pub(crate) struct ResponseStore {
    inner: Mutex<Entries>,
    usage: Arc<Mutex<Usage>>,
    max: usize,
    max_bytes: usize,
    /// Each tenant's share of `max` and `max_bytes`.
    tenant_max: usize,
    tenant_bytes: usize,
    ttl: Duration,
}

#[derive(Debug, Default)]
struct Entries {
    /// Each response with the number of its insertion.
    by_id: HashMap<String, (Arc<Stored>, u64)>,
    /// Insertions, oldest first, with their time.
    order: VecDeque<(String, u64, Instant)>,
    /// Each tenant's insertions, oldest first, and how many of them are live.
    by_tenant: HashMap<Tenant, (VecDeque<(String, u64)>, usize)>,
    inserted: u64,
}

impl ResponseStore {
    /// A store of at most `max` responses and `max_bytes` bytes, each kept for `ttl`, shared by
    /// `tenants` tenants (each gets its share of both).
    pub(crate) fn new(max: usize, max_bytes: usize, tenants: usize, ttl: Duration) -> ResponseStore {
        let tenants = tenants.max(1);
        ResponseStore {
            inner: Mutex::new(Entries::default()),
            usage: Arc::default(),
            max,
            max_bytes,
            tenant_max: (max / tenants).max(1),
            tenant_bytes: max_bytes / tenants,
            ttl,
        }
    }

    /// Whether responses are stored at all.
    pub(crate) fn enabled(&self) -> bool {
        self.max > 0 && self.max_bytes > 0
    }

    /// The turns a response added after `parent`, as history charged to `tenant`.
    pub(crate) fn history(&self, tenant: &Tenant, parent: Option<Arc<History>>, turns: Vec<Turn>) -> Arc<History> {
        let bytes = turns.iter().map(turn_bytes).sum::<usize>() + BLOCK_OVERHEAD;
        Arc::new(History { parent, turns, _charge: Charge::new(&self.usage, tenant, bytes) })
    }

    /// Stores a response as `id`; the oldest of its tenant's go past the tenant's share, then the
    /// oldest of all past the whole store's bounds.
    pub(crate) fn insert(
        &self,
        id: String,
        response: Value,
        input_items: Vec<Value>,
        history: Arc<History>,
        session: Option<String>,
        tenant: Tenant,
    ) {
        if !self.enabled() {
            return;
        }
        let bytes = json_bytes(&response)
            + input_items.iter().map(json_bytes).sum::<usize>()
            + id.len()
            + session.as_ref().map_or(0, String::len)
            + BLOCK_OVERHEAD;
        let charge = Charge::new(&self.usage, &tenant, bytes);
        let stored = Stored { response, input_items, history, session, tenant: tenant.clone(), _charge: charge };
        let now = Instant::now();
        let mut entries = self.inner.lock();
        entries.inserted += 1;
        let n = entries.inserted;
        if let Some((old, _)) = entries.by_id.insert(id.clone(), (Arc::new(stored), n)) {
            entries.forget(&old.tenant);
        }
        entries.order.push_back((id.clone(), n, now));
        let mine = entries.by_tenant.entry(tenant.clone()).or_default();
        mine.0.push_back((id, n));
        mine.1 += 1;
        entries.expire(self.ttl, now);
        // The tenant's share first: its own oldest go.
        while entries.live(&tenant) > 0
            && (entries.live(&tenant) > self.tenant_max || self.bytes_of(&tenant) > self.tenant_bytes)
        {
            entries.evict_oldest_of(&tenant);
        }
        // Then the whole store (tenants' shares add up to it; the default tenant shares it).
        while !entries.by_id.is_empty() && (entries.by_id.len() > self.max || self.usage.lock().total > self.max_bytes)
        {
            entries.evict_oldest();
        }
    }

    fn bytes_of(&self, tenant: &Tenant) -> usize {
        self.usage.lock().by_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Bytes charged now (stored responses and the history they hold), in all.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.usage.lock().total
    }

    /// `tenant`'s response `id`, unless it expired (another tenant's is not found).
    pub(crate) fn get(&self, tenant: &Tenant, id: &str) -> Option<Arc<Stored>> {
        let mut entries = self.inner.lock();
        entries.expire(self.ttl, Instant::now());
        entries.by_id.get(id).filter(|(stored, _)| stored.tenant == *tenant).map(|(stored, _)| stored.clone())
    }

    /// Forgets `tenant`'s response `id`; whether it was stored.
    pub(crate) fn remove(&self, tenant: &Tenant, id: &str) -> bool {
        let mut entries = self.inner.lock();
        if entries.by_id.get(id).is_some_and(|(stored, _)| stored.tenant == *tenant) {
            entries.by_id.remove(id);
            entries.forget(tenant);
            return true;
        }
        false
    }
}

impl Entries {
    fn live(&self, tenant: &Tenant) -> usize {
        self.by_tenant.get(tenant).map_or(0, |(_, live)| *live)
    }

    /// One of `tenant`'s entries left the map.
    fn forget(&mut self, tenant: &Tenant) {
        if let Some((queue, live)) = self.by_tenant.get_mut(tenant) {
            *live -= 1;
            if *live == 0 {
                queue.clear();
                self.by_tenant.remove(tenant);
            }
        }
    }

    /// Removes `id` if insertion `n` is still what it maps to.
    fn remove_if_current(&mut self, id: &str, n: u64) {
        if self.by_id.get(id).is_some_and(|(_, latest)| *latest == n)
            && let Some((stored, _)) = self.by_id.remove(id)
        {
            self.forget(&stored.tenant);
        }
    }

    fn evict_oldest_of(&mut self, tenant: &Tenant) {
        while let Some((id, n)) = self.by_tenant.get_mut(tenant).and_then(|(queue, _)| queue.pop_front()) {
            if self.by_id.get(&id).is_some_and(|(_, latest)| *latest == n) {
                self.remove_if_current(&id, n);
                return;
            }
        }
    }

    fn evict_oldest(&mut self) {
        while let Some((id, n, _)) = self.order.pop_front() {
            if self.by_id.get(&id).is_some_and(|(_, latest)| *latest == n) {
                self.remove_if_current(&id, n);
                return;
            }
        }
    }

    fn expire(&mut self, ttl: Duration, now: Instant) {
        while let Some((id, n, at)) = self.order.front() {
            let live = self.by_id.get(id).is_some_and(|(_, latest)| latest == n);
            if live && now.duration_since(*at) < ttl {
                break;
            }
            let (id, n, _) = self.order.pop_front().expect("a front entry");
            self.remove_if_current(&id, n);
        }
    }
}

/// Bytes a turn keeps: its text, ids and arguments, and a fixed overhead per block.
fn turn_bytes(turn: &Turn) -> usize {
    let blocks: usize = turn
        .blocks
        .iter()
        .map(|b| {
            BLOCK_OVERHEAD
                + match b {
                    Block::Text { text, .. } => text.len(),
                    Block::Image => 0,
                    Block::Thinking { text, handle } => text.len() + handle.as_ref().map_or(0, String::len),
                    Block::ToolUse { id, name, arguments } => id.len() + name.len() + json_bytes(arguments),
                    Block::ToolResult { call_id, content, .. } => call_id.len() + content.len(),
                }
        })
        .sum();
    BLOCK_OVERHEAD + blocks + turn.name.as_ref().map_or(0, String::len)
}

/// Bytes a JSON value keeps, about: its strings and keys, and a fixed size per value.
pub(crate) fn json_bytes(value: &Value) -> usize {
    const NODE: usize = 32;
    NODE + match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
        Value::String(s) => s.len(),
        Value::Array(items) => items.iter().map(json_bytes).sum(),
        Value::Object(fields) => fields.iter().map(|(k, v)| k.len() + NODE + json_bytes(v)).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frontend::ir::Role;

    fn put(store: &ResponseStore, id: &str, tenant: &Tenant, n: u64) {
        let history = store.history(tenant, None, Vec::new());
        store.insert(id.into(), Value::from(n), Vec::new(), history, None, tenant.clone());
    }

    #[test]
    fn bounded_by_count_and_age() {
        let shared = Tenant::default();
        let store = ResponseStore::new(2, 1 << 30, 1, Duration::from_secs(60));
        put(&store, "a", &shared, 1);
        put(&store, "b", &shared, 2);
        put(&store, "c", &shared, 3);
        assert!(store.get(&shared, "a").is_none(), "the oldest went first");
        assert_eq!(store.get(&shared, "c").unwrap().response, 3);
        assert!(store.remove(&shared, "b"));
        assert!(!store.remove(&shared, "b"));
        put(&store, "d", &shared, 4);
        assert!(store.get(&shared, "c").is_some() && store.get(&shared, "d").is_some());

        let short = ResponseStore::new(8, 1 << 30, 1, Duration::from_millis(20));
        put(&short, "a", &shared, 1);
        assert!(short.get(&shared, "a").is_some());
        std::thread::sleep(Duration::from_millis(30));
        assert!(short.get(&shared, "a").is_none());

        let off = ResponseStore::new(0, 1 << 30, 1, Duration::from_secs(60));
        put(&off, "a", &shared, 1);
        assert!(!off.enabled() && off.get(&shared, "a").is_none());
    }

    #[test]
    fn a_tenant_sees_only_its_own_responses() {
        let store = ResponseStore::new(8, 1 << 30, 2, Duration::from_secs(60));
        let (a, b) = (Tenant::named("a"), Tenant::named("b"));
        put(&store, "r", &a, 1);
        assert!(store.get(&b, "r").is_none(), "another tenant's response is not found");
        assert!(!store.remove(&b, "r"), "nor deleted");
        assert!(store.get(&Tenant::default(), "r").is_none());
        assert_eq!(store.get(&a, "r").unwrap().response, 1);
        assert!(store.remove(&a, "r"));
    }

    /// One tenant storing past its share evicts its own oldest, never another tenant's (1,030
    /// responses of one tenant once evicted another's).
    #[test]
    fn one_tenant_past_its_share_evicts_only_its_own() {
        let store = ResponseStore::new(8, 1 << 30, 2, Duration::from_secs(60));
        let (a, b) = (Tenant::named("a"), Tenant::named("b"));
        for i in 0..3 {
            put(&store, &format!("b{i}"), &b, i);
        }
        for i in 0..1030 {
            put(&store, &format!("a{i}"), &a, i);
        }
        for i in 0..3 {
            assert!(store.get(&b, &format!("b{i}")).is_some(), "b{i} kept");
        }
        assert!(store.get(&a, "a1029").is_some() && store.get(&a, "a1026").is_some());
        assert!(store.get(&a, "a1025").is_none(), "a keeps its share of 4");
    }

    /// Bytes are bounded, whatever the count: big responses push out the oldest, every byte of
    /// them charged (response, items, history), and released when they go.
    #[test]
    fn bounded_by_bytes_and_released_when_evicted() {
        let t = Tenant::default();
        let store = ResponseStore::new(1024, 1 << 20, 1, Duration::from_secs(60));
        let big = "x".repeat(300 << 10);
        for i in 0..10 {
            let history = store.history(&t, None, vec![Turn::new(Role::User, vec![Block::text(big.clone())])]);
            store.insert(format!("r{i}"), Value::from(big.clone()), Vec::new(), history, None, t.clone());
            assert!(store.bytes() <= 1 << 20, "{} bytes after {i}", store.bytes());
        }
        assert!(store.get(&t, "r9").is_some() && store.get(&t, "r0").is_none());
        for i in 0..10 {
            store.remove(&t, &format!("r{i}"));
        }
        assert_eq!(store.bytes(), 0, "every charge released");
    }

    /// A chain of responses shares its history: N responses of one turn each cost N turns, not
    /// N²/2, and a continuation reads the whole conversation back in order.
    #[test]
    fn a_chain_shares_its_history() {
        let t = Tenant::default();
        let store = ResponseStore::new(1024, 1 << 30, 1, Duration::from_secs(60));
        let turn = |i: usize| Turn::new(Role::User, vec![Block::text(format!("{i}:{}", "y".repeat(10_000)))]);
        let mut parent = None;
        for i in 0..100 {
            let history = store.history(&t, parent.take(), vec![turn(i)]);
            store.insert(format!("r{i}"), Value::Null, Vec::new(), history.clone(), None, t.clone());
            parent = Some(history);
        }
        let one = turn_bytes(&turn(0));
        assert!(store.bytes() < 100 * (one + 1024), "{} bytes for 100 turns of {one}", store.bytes());
        let turns = store.get(&t, "r99").unwrap().history.turns();
        assert_eq!(turns.len(), 100);
        assert!(turns.iter().enumerate().all(|(i, t)| t.blocks[0] == turn(i).blocks[0]), "in order");
    }
}
