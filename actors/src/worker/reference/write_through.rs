//! Write-through: every block a request completes is registered in G1, gathered into a sealed
//! image in a G2 slot, and written to G3 in batches, as far as its region's retention allows.

use super::*;

/// A completed block whose KV is still only in its G1 page.
pub(super) struct PendingGather {
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
    pub(super) page: u32,
    pub(super) region: RegionKind,
    pub(super) completed: Instant,
}

/// A block image in G2 on its way to G3.
pub(super) struct PendingWrite {
    pub(super) hash: BlockHash,
    pub(super) parent: Option<BlockHash>,
    pub(super) image: SlotRef,
    pub(super) completed: Instant,
    /// Its place in G3's write backlog, until the write is done.
    pub(super) backlog: WriteTicket,
}

impl<B: Backend> Worker<B> {
    /// Registers complete block `i` of the sequence in G1 (referenced by this request); a
    /// `computed` block is queued for its gather to G2 (a loaded one has its image already:
    /// [`Self::write_loaded`] handles those).
    pub(super) fn register(
        &mut self,
        i: usize,
        seq: &mut [SeqBlock],
        hashes: &[BlockHash],
        region: RegionKind,
        now: Millis,
        computed: bool,
    ) {
        let hash = hashes[i];
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        let meta = self.tiers.meta(parent, region);
        match self.registry.insert(hash, meta, now) {
            Ok(Admission::Inserted { evicted }) => {
                let mut gone = Vec::with_capacity(evicted.len());
                for victim in evicted {
                    if let Some(page) = self.by_hash.remove(&victim.hash) {
                        self.free_page(page);
                        gone.push(victim.hash);
                    }
                }
                if !gone.is_empty() {
                    self.tiers.observer.removed(self.site(), &gone);
                }
                self.by_hash.insert(hash, seq[i].page);
                self.registry.acquire(hash, now).expect("just inserted");
                seq[i].registered = Some(hash);
                self.tiers.observer.stored(self.site(), parent, &[hash]);
            }
            // Present already (another sequence computed it meanwhile) or G1 refused: the page stays
            // private to this request.
            Ok(Admission::AlreadyPresent) | Err(_) => {}
        }
        if !computed || self.tiers.g2.is_none() {
            return;
        }
        if self.tiers.write_targets(hash, region, Landed::Computed).g2 {
            self.gathers.push(PendingGather { hash, parent, page: seq[i].page, region, completed: Instant::now() });
        }
    }

    /// A block reused in place from G1 (in `page`). G2 is inclusive of G1: if G2 lost its copy
    /// while G1 kept the block, it is gathered back as a computed block is (and goes on to G3
    /// from there). If its image is still in G2 and G3 lacks it (its write was skipped while the
    /// disk was behind), it goes to G3 now.
    pub(super) fn write_reused(&mut self, i: usize, hashes: &[BlockHash], page: u32, region: RegionKind, now: Millis) {
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref() else { return };
        let targets = tiers.write_targets(hashes[i], region, Landed::Reused);
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        if targets.g2 {
            self.gathers.push(PendingGather { hash: hashes[i], parent, page, region, completed: Instant::now() });
            return;
        }
        if !targets.g3 || tiers.g3.is_none() {
            return;
        }
        if let Some(image) = g2.peek(hashes[i]) {
            self.queue_g3(hashes[i], parent, region, image, Instant::now(), now);
        }
    }

    /// A block just loaded from below: G2 keeps the image it came in (a block read from G3 is
    /// admitted to G2), and a block that came from G2 goes on to G3 if G3 lacks it.
    pub(super) fn write_loaded(
        &mut self,
        i: usize,
        hashes: &[BlockHash],
        region: RegionKind,
        image: SlotRef,
        from: TierName,
        now: Millis,
    ) {
        let tiers = self.tiers.clone();
        let parent = i.checked_sub(1).map(|p| hashes[p]);
        let targets = tiers.write_targets(hashes[i], region, Landed::Loaded(from));
        if let Some(g2) = tiers.g2.as_ref().filter(|_| targets.g2)
            && g2.admit(hashes[i], tiers.meta(parent, region), image.clone(), now)
        {
            tiers.arrived(TierName::G2, hashes[i], region, now);
        }
        if targets.g3 {
            self.queue_g3(hashes[i], parent, region, image, Instant::now(), now);
        }
    }

    /// Starts gathering every pending block from G1 into G2 slots, in one batched copy on the copy
    /// engine; [`Self::finish_gathers`] seals the images, admits them to G2 and queues them for G3.
    pub(super) fn gather_pending(&mut self) {
        self.finish_gathers(false);
        if self.gathers.is_empty() {
            return;
        }
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref() else {
            self.gathers.clear();
            return;
        };
        let now = unix_millis();
        let pending = std::mem::take(&mut self.gathers);
        let mut blocks = Vec::with_capacity(pending.len());
        let mut slots = Vec::with_capacity(pending.len());
        // G2 cannot take more once an allocation fails: the rest stays in G1 only, counted.
        let mut skipped = 0;
        for p in pending {
            if g2.contains(p.hash) {
                continue;
            }
            if skipped == 0
                && let Some(slot) = g2.alloc(now)
            {
                slots.push(slot);
                blocks.push(p);
                continue;
            }
            skipped += 1;
        }
        if skipped > 0 {
            record_writes_skipped(TierName::G2, skipped as u64);
        }
        if blocks.is_empty() {
            return;
        }
        let pages: Vec<u32> = blocks.iter().map(|p| p.page).collect();
        let mut payloads: Vec<&mut [u8]> =
            slots.iter_mut().map(|s| payload_mut(s.as_mut_slice(), &tiers.layout)).collect();
        // SAFETY: the slots go into `self.copying` with the copies and nobody else holds them; the
        // pages are marked in `self.gathering`, which keeps them from being freed or reused (and so
        // written) until the copies are finished.
        let started = unsafe { self.model.backend().kv_gather_start(&self.kv, &pages, &mut payloads) };
        drop(payloads);
        match started {
            Ok(copies) => {
                for &page in &pages {
                    self.gathering[page as usize] = true;
                }
                self.copying.push(Copying { copies, blocks, slots });
                // Without a copy engine they are done already.
                self.finish_gathers(false);
            }
            Err(e) => {
                tracing::warn!(error = %e, blocks = blocks.len(), "G1 → G2 gather failed; the blocks stay in G1 only")
            }
        }
    }

    /// Finishes the gathers in flight, oldest first: every one when `wait`, otherwise those done.
    /// Each finished block's image is sealed, admitted to G2 and queued for G3.
    pub(super) fn finish_gathers(&mut self, wait: bool) {
        while let Some(first) = self.copying.first() {
            if !wait && !self.model.backend().copies_done(&first.copies).unwrap_or(true) {
                return;
            }
            let Copying { copies, blocks, slots } = self.copying.remove(0);
            let waited = self.model.backend().copies_wait(copies);
            for p in &blocks {
                self.gathering[p.page as usize] = false;
            }
            match waited {
                Ok(elapsed) => self.admit_gathered(blocks, slots, elapsed),
                Err(e) => {
                    tracing::warn!(error = %e, blocks = blocks.len(), "G1 → G2 gather failed; the blocks stay in G1 only")
                }
            }
        }
    }

    /// Seals gathered images, admits them to G2 and queues them for G3.
    pub(super) fn admit_gathered(&mut self, blocks: Vec<PendingGather>, slots: Vec<SlotMut>, elapsed: Duration) {
        let tiers = self.tiers.clone();
        let Some(g2) = tiers.g2.as_ref() else {
            return;
        };
        let now = unix_millis();
        record_transfer(TierName::G1, TierName::G2, (tiers.layout.payload_bytes() * blocks.len()) as u64, elapsed);
        for (p, mut slot) in blocks.into_iter().zip(slots) {
            let policy = tiers.retention.policy(p.region);
            let spec = ImageSpec {
                hash: p.hash,
                parent: p.parent,
                salt: tiers.salt,
                layout: tiers.layout,
                token_count: tiers.block_tokens as u16,
                retention: RetentionMeta {
                    region: p.region,
                    priority: policy.priority,
                    retain_until_ms: 0,
                    last_access_ms: now,
                    access_count: 1,
                },
            };
            seal(slot.as_mut_slice(), &spec);
            let image = slot.freeze();
            if g2.admit(p.hash, tiers.meta(p.parent, p.region), image.clone(), now) {
                tiers.arrived(TierName::G2, p.hash, p.region, now);
            }
            record_write_lag(TierName::G2, p.completed.elapsed());
            self.queue_g3(p.hash, p.parent, p.region, image, p.completed, now);
        }
    }

    /// Queues a sealed image for G3 if its region goes that far and G3 lacks it.
    pub(super) fn queue_g3(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        region: RegionKind,
        image: SlotRef,
        completed: Instant,
        now: Millis,
    ) {
        let tiers = self.tiers.clone();
        // Whether the block goes to G3 at all is the pipeline's call (the write-through of a
        // computed block decides it here, once its image is sealed in G2).
        if !tiers.write_targets(hash, region, Landed::Computed).g3 {
            return;
        }
        // A disk slower than the write stream must not build an unbounded backlog (the node's
        // one rule: `TierStore::begin_g3_write`).
        while self.writes.try_join_next().is_some() {}
        let Some(backlog) = tiers.g3_write(hash, now) else { return };
        let Some(g3) = tiers.g3.as_ref() else { return };
        if !g3.reserve(hash, tiers.meta(parent, region), now) {
            return;
        }
        tiers.arrived(TierName::G3, hash, region, now);
        self.g3_batch.push(PendingWrite { hash, parent, image, completed, backlog });
        if self.g3_batch.len() >= tiers.write_batch.g3_blocks {
            self.send_g3_batch();
        }
    }

    /// Flushes a batch whose oldest block waited past its bound.
    pub(super) fn maybe_flush_batches(&mut self) {
        self.finish_gathers(false);
        let batch = self.tiers.write_batch;
        if self.gathers.len() >= batch.g2_blocks
            || self.gathers.first().is_some_and(|p| p.completed.elapsed() >= batch.g2_delay)
        {
            self.gather_pending();
        }
        if self.g3_batch.first().is_some_and(|p| p.completed.elapsed() >= batch.g3_delay) {
            self.send_g3_batch();
        }
    }

    /// Writes the pending G3 batch in the background, all of it in flight together; each block is
    /// acknowledged (a KV event) as its write completes.
    pub(super) fn send_g3_batch(&mut self) {
        if self.g3_batch.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.g3_batch);
        let tiers = self.tiers.clone();
        self.writes.spawn(async move {
            let g3 = tiers.g3.as_ref().expect("a G3 batch needs G3");
            let started = Instant::now();
            let writes = batch.into_iter().map(|w| async move {
                // The whole write moves in, its place in the backlog too: it leaves the backlog
                // when the write is done, not when the future is made.
                let PendingWrite { hash, parent, image, completed, backlog } = w;
                let written = g3.write(hash, parent, image).await;
                drop(backlog);
                if written {
                    record_write_lag(TierName::G3, completed.elapsed());
                }
                written
            });
            let written = futures::future::join_all(writes).await.into_iter().filter(|&w| w).count();
            let bytes = written * g3.store.slot_bytes();
            if bytes > 0 {
                let elapsed = started.elapsed();
                record_transfer(TierName::G2, TierName::G3, bytes as u64, elapsed);
                tiers.measured.g3_write.observe(bytes, elapsed);
            }
        });
        // Reap finished writes so the set does not grow with the node's uptime.
        while self.writes.try_join_next().is_some() {}
    }
}
