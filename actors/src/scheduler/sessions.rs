//! Sessions and leases on the scheduler's side: a session's actor (created on its first turn,
//! ended when idle or when the node tracks too many), and the `cache_control` prefixes a request
//! leases to its session, granted as it is routed.

use super::*;
use crate::worker::PromptHashes;

impl SchedulerState {
    /// The chains `req`'s leases cover (complete blocks, with their regions), and the hashes
    /// of its prompt (computed once here if routing did not). Empty without leases, or without
    /// the node's tiers to lease in. A hit of a leased prefix also refreshes its leases here.
    pub(super) fn lease_plan(&self, req: &mut GenRequest) -> Vec<(Vec<(BlockHash, RegionKind)>, Duration)> {
        let Some(kv) = &self.args.kv else { return Vec::new() };
        let Some(tiers) = &kv.leases else { return Vec::new() };
        // Nothing asked and nothing leased anywhere (the common case): no hashing, no lock.
        if req.leases.is_empty() && tiers.book().is_empty() {
            return Vec::new();
        }
        let b = kv.block_tokens.max(1);
        let salt = req.salt(kv.salt);
        let hashes = req.block_hashes(salt, b);
        if req.hashes.is_none() {
            req.hashes = Some(Arc::new(PromptHashes { salt, block_tokens: b, hashes: hashes.clone().into() }));
        }
        let region = |i: usize| region_of(&req.regions, i * b);
        let with_regions =
            |n: usize| -> Vec<(BlockHash, RegionKind)> { (0..n).map(|i| (hashes[i], region(i))).collect() };
        tiers.refresh(&hashes, &region, tiers.now());
        req.leases
            .iter()
            .take(MAX_LEASES_PER_REQUEST)
            .map(|l| (with_regions((l.tokens / b).min(hashes.len())), l.ttl))
            .filter(|(chain, _)| !chain.is_empty())
            .collect()
    }

    /// Leases `plan` to `lessee` in the node's tiers; the tokens newly leased by TTL and the chains.
    pub(super) fn grant(
        &self,
        lessee: Lessee,
        plan: Vec<(Vec<(BlockHash, RegionKind)>, Duration)>,
    ) -> (LeasedTokens, Vec<LeasedChain>) {
        let mut tokens = LeasedTokens::default();
        let Some((kv, tiers)) = self.args.kv.as_ref().and_then(|kv| Some((kv, kv.leases.as_ref()?))) else {
            return (tokens, Vec::new());
        };
        let now = tiers.now();
        let mut chains = Vec::with_capacity(plan.len());
        for (blocks, ttl) in plan {
            let new = tiers.lease(lessee, &blocks, ttl.as_millis() as u64, now) * kv.block_tokens;
            if ttl >= Duration::from_secs(3600) {
                tokens.long += new;
            } else {
                tokens.short += new;
            }
            chains.push(LeasedChain { blocks });
        }
        (tokens, chains)
    }

    /// Forgets `actor`, a session that is ending (its termination may still be on its way).
    pub(super) fn forget_session(&mut self, actor: &SessionRef) {
        if let Some(id) = self.session_of.remove(&actor.get_id())
            && self.sessions.get(&id).is_some_and(|e| e.actor.get_id() == actor.get_id())
        {
            self.sessions.remove(&id);
        }
    }

    /// The actor of session `id`, started (supervised by the scheduler) if it has none; at the
    /// cap a conversation of the tenant holding the most sessions ends first, its idlest (its
    /// leases end with it): one tenant opening sessions ends its own, not another's.
    pub(super) async fn session_actor(&mut self, myself: &SchedulerRef, id: String, tenant: u64) -> Option<SessionRef> {
        if let Some(entry) = self.sessions.get_mut(&id) {
            entry.last_request = Instant::now();
            return Some(entry.actor.clone());
        }
        while self.sessions.len() >= self.args.max_sessions.max(1) {
            let mut held: HashMap<u64, usize> = HashMap::new();
            for e in self.sessions.values() {
                *held.entry(e.tenant).or_default() += 1;
            }
            // The tenant holding the most (the newcomer's own on a tie).
            let most = held.values().copied().max().unwrap_or(0);
            let heaviest = if held.get(&tenant) == Some(&most) {
                tenant
            } else {
                held.iter().find(|(_, n)| **n == most).map_or(tenant, |(t, _)| *t)
            };
            let Some(idlest) = self
                .sessions
                .iter()
                .filter(|(_, e)| e.tenant == heaviest)
                .min_by_key(|(_, e)| e.last_request)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            if let Some(entry) = self.sessions.remove(&idlest) {
                self.session_of.remove(&entry.actor.get_id());
                // Drained, not stopped: what is already in its mailbox is still handled.
                let _ = entry.actor.drain();
            }
        }
        let args = SessionArgs {
            id: id.clone(),
            idle_timeout: self.args.session_idle_timeout,
            scheduler: myself.clone(),
            leasing: self.args.kv.as_ref().and_then(|kv| kv.leases.clone()),
            tenant,
        };
        let (actor, _) = match Actor::spawn_linked(None, SessionActor, args, myself.get_cell()).await {
            Ok(spawned) => spawned,
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "could not start a session actor");
                return None;
            }
        };
        self.session_of.insert(actor.get_id(), id.clone());
        self.sessions.insert(id, SessionEntry { actor: actor.clone(), last_request: Instant::now(), tenant });
        Some(actor)
    }
}
