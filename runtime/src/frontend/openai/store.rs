//! The Responses API's stored responses: what `previous_response_id`, `GET /v1/responses/{id}`
//! and `/input_items` read. Bounded by count (`frontend.responses_store`, the oldest goes first)
//! and by age (`frontend.responses_ttl`).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::Value;

use crate::frontend::Tenant;
use crate::frontend::ir::Turn;

/// One stored response.
#[derive(Debug)]
pub(crate) struct Stored {
    /// The response object, as it was answered.
    pub(crate) response: Value,
    /// The request's input items, with ids.
    pub(crate) input_items: Vec<Value>,
    /// The whole conversation through this response's output, for a request that continues it.
    pub(crate) turns: Vec<Turn>,
    /// The session it belongs to.
    pub(crate) session: Option<String>,
    /// Whose it is: no other tenant can read, continue or delete it.
    pub(crate) tenant: Tenant,
}

/// Stored responses by id.
#[derive(Debug)]
pub(crate) struct ResponseStore {
    inner: Mutex<Entries>,
    max: usize,
    ttl: Duration,
}

#[derive(Debug, Default)]
struct Entries {
    /// Each response with the number of its insertion.
    by_id: HashMap<String, (Arc<Stored>, u64)>,
    /// Insertions, oldest first, with their time.
    order: VecDeque<(String, u64, Instant)>,
    inserted: u64,
}

impl ResponseStore {
    /// A store of at most `max` responses, each kept for `ttl`.
    pub(crate) fn new(max: usize, ttl: Duration) -> ResponseStore {
        ResponseStore { inner: Mutex::new(Entries::default()), max, ttl }
    }

    /// Whether responses are stored at all.
    pub(crate) fn enabled(&self) -> bool {
        self.max > 0
    }

    /// Stores `stored` as `id`.
    pub(crate) fn insert(&self, id: String, stored: Stored) {
        if self.max == 0 {
            return;
        }
        let now = Instant::now();
        let mut entries = self.inner.lock();
        entries.inserted += 1;
        let n = entries.inserted;
        entries.by_id.insert(id.clone(), (Arc::new(stored), n));
        entries.order.push_back((id, n, now));
        entries.evict(self.max, self.ttl, now);
    }

    /// `tenant`'s response `id`, unless it expired (another tenant's is not found).
    pub(crate) fn get(&self, tenant: &Tenant, id: &str) -> Option<Arc<Stored>> {
        let now = Instant::now();
        let mut entries = self.inner.lock();
        entries.evict(self.max, self.ttl, now);
        entries.by_id.get(id).filter(|(stored, _)| stored.tenant == *tenant).map(|(stored, _)| stored.clone())
    }

    /// Forgets `tenant`'s response `id`; whether it was stored.
    pub(crate) fn remove(&self, tenant: &Tenant, id: &str) -> bool {
        let mut entries = self.inner.lock();
        if entries.by_id.get(id).is_some_and(|(stored, _)| stored.tenant == *tenant) {
            entries.by_id.remove(id);
            return true;
        }
        false
    }
}

impl Entries {
    fn evict(&mut self, max: usize, ttl: Duration, now: Instant) {
        while let Some((id, n, at)) = self.order.front() {
            let live = self.by_id.get(id).is_some_and(|(_, latest)| latest == n);
            if live && self.by_id.len() <= max && now.duration_since(*at) < ttl {
                break;
            }
            let (id, n, _) = self.order.pop_front().expect("a front entry");
            if self.by_id.get(&id).is_some_and(|(_, latest)| *latest == n) {
                self.by_id.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(n: u64) -> Stored {
        Stored {
            response: Value::from(n),
            input_items: Vec::new(),
            turns: Vec::new(),
            session: None,
            tenant: Tenant::default(),
        }
    }

    #[test]
    fn bounded_by_count_and_age() {
        let shared = Tenant::default();
        let store = ResponseStore::new(2, Duration::from_secs(60));
        store.insert("a".into(), stored(1));
        store.insert("b".into(), stored(2));
        store.insert("c".into(), stored(3));
        assert!(store.get(&shared, "a").is_none(), "the oldest went first");
        assert_eq!(store.get(&shared, "c").unwrap().response, 3);
        assert!(store.remove(&shared, "b"));
        assert!(!store.remove(&shared, "b"));
        store.insert("d".into(), stored(4));
        assert!(store.get(&shared, "c").is_some() && store.get(&shared, "d").is_some());

        let short = ResponseStore::new(8, Duration::from_millis(20));
        short.insert("a".into(), stored(1));
        assert!(short.get(&shared, "a").is_some());
        std::thread::sleep(Duration::from_millis(30));
        assert!(short.get(&shared, "a").is_none());

        let off = ResponseStore::new(0, Duration::from_secs(60));
        off.insert("a".into(), stored(1));
        assert!(!off.enabled() && off.get(&shared, "a").is_none());
    }

    #[test]
    fn a_tenant_sees_only_its_own_responses() {
        let store = ResponseStore::new(8, Duration::from_secs(60));
        let (a, b) = (Tenant::named("a"), Tenant::named("b"));
        store.insert("r".into(), Stored { tenant: a.clone(), ..stored(1) });
        assert!(store.get(&b, "r").is_none(), "another tenant's response is not found");
        assert!(!store.remove(&b, "r"), "nor deleted");
        assert!(store.get(&Tenant::default(), "r").is_none());
        assert_eq!(store.get(&a, "r").unwrap().response, 1);
        assert!(store.remove(&a, "r"));
    }
}
