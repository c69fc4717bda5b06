//! Onboarding: a request's cached prefix found in G1, G2, G3 or a peer (G4), loaded into its
//! pages, verified on the way; what is not found or not worth loading is recomputed.

use super::*;

/// Where a block of the cached prefix comes from.
pub(super) enum Source {
    /// Resident in this worker's G1, in this page (already acquired).
    Page(u32),
    /// An image in a G2 slot: found in G2, or just brought there from a tier below (`from`).
    Image { image: SlotRef, from: TierName },
    /// In a tier below G2 (G3; G4: on the peer the lookup found), to be brought into G2.
    Below(TierName),
}

/// How long a fetch of the blocks covering tokens `[from, to)` may take before it is cancelled
/// and they are recomputed: twice what recomputing them would take by the cost model, at least
/// `floor` (`tiers.g4.min_fetch_budget`), at most `ceiling` (`tiers.g4.request_timeout`).
pub(super) fn fetch_budget(
    cost: &dynamo_tiering::cost::CostModel,
    from: usize,
    to: usize,
    floor: Duration,
    ceiling: Duration,
) -> Duration {
    let recompute = cost.prefill.as_ref().map(|p| Duration::from_secs_f64(2.0 * p.seconds(from, to)));
    recompute.unwrap_or(ceiling).clamp(floor.min(ceiling), ceiling)
}

/// Whether a verified image of `bytes` from a peer, in `slot`, is of this node's layout: a peer of
/// the same model with another KV dtype or block geometry names its blocks the same (the hash
/// covers the model and the tokens), and its images are not this node's to load.
/// It must also be the block asked for in its place.
pub(super) fn of_this_layout(tiers: &NodeTiers, slot: &SlotRef, bytes: usize, hash: BlockHash) -> bool {
    bytes == tiers.layout.image_bytes()
        && ImageHeader::decode_header_only(slot.as_slice())
            .is_ok_and(|header| header.layout == tiers.layout && header.hash == hash)
}

/// The real executor's answers while the pipeline plans a prefix: a G1 block found is acquired
/// (its page kept), a G2 image found is taken (so it cannot go before it is loaded).
pub(super) struct Lookup<'w, B: Backend> {
    pub(super) worker: &'w mut Worker<B>,
    pub(super) now: Millis,
    pub(super) pages: Vec<u32>,
    pub(super) images: Vec<SlotRef>,
    /// The blocks of the prefix the best peer holds (empty without one).
    pub(super) remote: &'w [BlockHash],
    /// Blocks asked about so far (each block's first question is `in_g1`).
    pub(super) asked: usize,
}

impl<B: Backend> pipeline::TierLookup for Lookup<'_, B> {
    fn in_g1(&mut self, hash: BlockHash) -> bool {
        self.asked += 1;
        let Some(&page) = self.worker.by_hash.get(&hash) else { return false };
        self.worker.registry.acquire(hash, self.now).expect("resident");
        self.pages.push(page);
        true
    }

    fn in_g2(&mut self, hash: BlockHash) -> bool {
        let Some(image) = self.worker.tiers.g2.as_ref().and_then(|g2| g2.get(hash, self.now)) else { return false };
        self.images.push(image);
        true
    }

    fn in_g3(&mut self, hash: BlockHash) -> bool {
        let tiers = &self.worker.tiers;
        tiers.g2.is_some() && tiers.contains(TierName::G3, hash)
    }

    fn in_g4(&mut self, hash: BlockHash) -> bool {
        // The prefix is asked in order, block by block, from its start: the block asked about is
        // the `asked`-th, and the peer holds it if its prefix reaches that far.
        let at = self.asked.wrapping_sub(1);
        self.worker.tiers.g2.is_some() && self.remote.get(at) == Some(&hash)
    }
}

impl<B: Backend> Worker<B> {
    /// Finds the cached prefix of `seq`'s tokens and brings it into G1: blocks in this worker's
    /// G1 are reused in place; the rest comes from G2, or from G3 (all of the run's reads in
    /// flight together, each verified) into G2 slots, and then into G1 pages in one batched
    /// scatter, which the next step waits for. A tier is used only while loading from it beats
    /// recomputing; a G3 block that fails ends the prefix there. At least the last token is left
    /// to compute, so the step has its logits. `first`: the request's admission (its hits are
    /// what it reports), not a resume after preemption.
    pub(super) async fn onboard(&mut self, seq: &mut Seq, first: bool) -> Result<(), WorkerError> {
        let now = unix_millis();
        let b = self.tiers.block_tokens;
        let hashes = seq.run.chain.clone();
        let hashes = hashes.as_slice();
        let mut hits = PerTier::<usize>::default();
        let tiers = self.tiers.clone();

        // The plan (the pipeline's): where each block of the prefix comes from. G1 blocks are
        // acquired and G2 images taken as the plan finds them.
        // The peer whose G2 holds the longest prefix (from the index its feed keeps), if any.
        let remote = tiers.g4.as_ref().and_then(|g4| g4.remote.locate(hashes));
        let remote_prefix = remote.as_ref().map_or(&[][..], |(_, blocks)| &hashes[..(*blocks).min(hashes.len())]);
        let mut lookup =
            Lookup { worker: self, now, pages: Vec::new(), images: Vec::new(), remote: remote_prefix, asked: 0 };
        // A load from the peer is priced at that link's own measured rate, where it has one.
        let mut cost = tiers.cost_now();
        if let Some((link, _)) = &remote {
            link.price(&mut cost);
        }
        let sources = tiers.pipeline().plan_prefix(hashes, seq.run.tokens.len(), &cost, &mut lookup);
        let Lookup { mut pages, mut images, .. } = lookup;
        let mut plan: Vec<Source> = Vec::with_capacity(sources.len());
        let (mut pages, mut images) = (pages.drain(..), images.drain(..));
        for source in sources {
            plan.push(match source {
                TierName::G1 => Source::Page(pages.next().expect("a page per G1 block")),
                TierName::G2 => {
                    Source::Image { image: images.next().expect("an image per G2 block"), from: TierName::G2 }
                }
                below => Source::Below(below),
            });
        }

        // G3 reads, all in flight together.
        let g3_blocks: Vec<usize> =
            (0..plan.len()).filter(|&i| matches!(plan[i], Source::Below(TierName::G3))).collect();
        if !g3_blocks.is_empty() {
            let wanted: Vec<BlockHash> = g3_blocks.iter().map(|&i| hashes[i]).collect();
            let results = tiers.read_into_g2(&wanted, now).await;
            let mut end = plan.len();
            for (&i, result) in g3_blocks.iter().zip(results) {
                match result {
                    Ok(image) if i < end => plan[i] = Source::Image { image, from: TierName::G3 },
                    Ok(_) => {}
                    Err(miss) => {
                        if miss.is_corrupt() {
                            seq.run.outcome.corrupt_blocks += 1;
                        }
                        end = end.min(i);
                    }
                }
            }
            // Blocks past a failure are not part of the prefix: G1 references go back, images drop.
            for (source, &hash) in plan.drain(end..).zip(&hashes[end..]) {
                if let Source::Page(_) = source {
                    let _ = self.registry.release(hash);
                }
            }
        }

        // Peer fetches: one hold-fetch-release on the link, within the cost model's budget.
        let g4_blocks: Vec<usize> =
            (0..plan.len()).filter(|&i| matches!(plan[i], Source::Below(TierName::G4))).collect();
        if let (Some(&first), Some((link, _)), true) = (g4_blocks.first(), remote.as_ref(), tiers.g2.is_some()) {
            let wanted: Vec<BlockHash> = g4_blocks.iter().map(|&i| hashes[i]).collect();
            let started = Instant::now();
            let last = g4_blocks.last().copied().unwrap_or(first);
            let deadline = started
                + fetch_budget(
                    &tiers.cost_now(),
                    first * b,
                    (last + 1) * b,
                    link.min_fetch_budget(),
                    link.request_timeout(),
                );
            let mut end = plan.len();
            let mut fetched_bytes = 0;
            let landing = tiers.clone();
            let land: Land = Box::new(move || landing.g2.as_ref()?.alloc(now));
            match link.fetch(wanted, deadline, land).await {
                Ok(blocks) => {
                    for (&i, (_, arrival)) in g4_blocks.iter().zip(blocks) {
                        let landed = match arrival {
                            Arrival::Landed { slot, bytes, .. } if of_this_layout(&tiers, &slot, bytes, hashes[i]) => {
                                fetched_bytes += bytes;
                                Some(slot)
                            }
                            Arrival::Landed { .. } => None,
                            Arrival::NoRoom | Arrival::Missing | Arrival::Skipped => None,
                            Arrival::Rejected(e) => {
                                // Verified and dropped: never handed to the engine.
                                seq.run.outcome.corrupt_blocks += 1;
                                record_corrupt_block(TierName::G4);
                                record_tier_error(TierName::G4, e.kind());
                                None
                            }
                        };
                        match landed {
                            Some(image) if i < end => plan[i] = Source::Image { image, from: TierName::G4 },
                            Some(_) => {}
                            None => end = end.min(i),
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(peer = link.addr(), error = %e, "G4 fetch failed; the prefix is recomputed from there");
                    record_tier_error(TierName::G4, e.kind());
                    if matches!(e, FetchError::Deadline) {
                        // The link moved less than this in the time: its rate is at most that, and
                        // the cost model recomputes rather than wait on it again.
                        let wanted = g4_blocks.len() * tiers.layout.image_bytes();
                        tiers.measured.g4_read.cap(wanted, started.elapsed());
                        link.measured().cap(wanted, started.elapsed());
                    }
                    end = first;
                }
            }
            let elapsed = started.elapsed();
            if fetched_bytes > 0 {
                record_transfer(TierName::G4, TierName::G2, fetched_bytes as u64, elapsed);
                // A fetch cut short moved bytes it did not land: its rate says little.
                if end == plan.len() {
                    tiers.measured.g4_read.observe(fetched_bytes, elapsed);
                    link.measured().observe(fetched_bytes, elapsed);
                }
            }
            for (source, &hash) in plan.drain(end..).zip(&hashes[end..]) {
                if let Source::Page(_) = source {
                    let _ = self.registry.release(hash);
                }
            }
        }

        // Into G1: resident blocks in place, loaded images in one scatter.
        let mut loads: Vec<(u32, SlotRef)> = Vec::new();
        let mut loaded: Vec<usize> = Vec::new();
        let reused: Vec<BlockHash> =
            plan.iter().zip(hashes).filter(|(s, _)| matches!(s, Source::Page(_))).map(|(_, h)| *h).collect();
        self.tiers.reused(&reused, now);
        let mut plan = plan.into_iter().enumerate();
        while let Some((i, source)) = plan.next() {
            match source {
                Source::Page(page) => {
                    seq.blocks.push(SeqBlock { page, registered: Some(hashes[i]) });
                    hits.g1 += b;
                    self.write_reused(i, hashes, page, seq.run.region(i, b), now);
                }
                Source::Image { image, from } => {
                    let page = match self.alloc_page(now) {
                        Ok(page) => page,
                        Err(e) => {
                            self.forget_loaded(&mut seq.blocks, &loaded);
                            self.release(seq);
                            // The rest of the plan's G1 blocks were acquired by the lookup.
                            for (j, rest) in plan {
                                if let Source::Page(_) = rest {
                                    let _ = self.registry.release(hashes[j]);
                                }
                            }
                            return Err(e);
                        }
                    };
                    seq.blocks.push(SeqBlock { page, registered: None });
                    hits[from] += b;
                    let region = seq.run.region(i, b);
                    self.register(i, &mut seq.blocks, hashes, region, now, false);
                    self.write_loaded(i, hashes, region, image.clone(), from, now);
                    loads.push((page, image));
                    loaded.push(i);
                }
                Source::Below(_) => unreachable!("every G3 and G4 block was read or cut off"),
            }
        }
        if !loads.is_empty() {
            let payload = tiers.layout.payload_bytes();
            let pages: Vec<u32> = loads.iter().map(|(p, _)| *p).collect();
            let payloads: Vec<&[u8]> =
                loads.iter().map(|(_, img)| &img.as_slice()[HEADER_LEN..HEADER_LEN + payload]).collect();
            // SAFETY: the payloads lie in the images, which `self.loading` keeps (immutable, and
            // referenced so their slots are not reused) until the copies are finished or dropped.
            let started = unsafe { self.model.backend().kv_scatter_start(&mut self.kv, &pages, &payloads) };
            drop(payloads);
            let copies = match started {
                Ok(copies) => copies,
                Err(e) => {
                    self.forget_loaded(&mut seq.blocks, &loaded);
                    return Err(ModelError::from(e).into());
                }
            };
            let images = loads.into_iter().map(|(_, image)| image).collect();
            let loading = Loading { copies, images, order: seq.run.order, blocks: loaded };
            // Until the link is measured, a load runs alone and is timed.
            if tiers.g2.is_some() && tiers.measured.wants_load_sample() {
                if let Err(e) = self.finish_load(loading, &mut seq.blocks, true) {
                    return Err(WorkerError::Step(e));
                }
            } else {
                self.loading.push(loading);
            }
        }
        seq.run.computed = seq.blocks.len() * b;
        if first {
            seq.run.count_hits(hits);
        }
        Ok(())
    }

    /// Waits for one prefix's scatter (after the next step has queued its compute behind it, or
    /// alone when `sample`: then its time measures the G2 → G1 link) and releases its images.
    /// Blocks whose load failed leave G1; the error says why.
    pub(super) fn finish_load(
        &mut self,
        loading: Loading<B>,
        seq: &mut [SeqBlock],
        sample: bool,
    ) -> Result<(), String> {
        let Loading { copies, images, blocks, .. } = loading;
        let elapsed = match self.model.backend().copies_wait(copies) {
            Ok(elapsed) => elapsed,
            Err(e) => {
                self.forget_loaded(seq, &blocks);
                return Err(e.to_string());
            }
        };
        let bytes = self.tiers.layout.payload_bytes() * images.len();
        record_transfer(TierName::G2, TierName::G1, bytes as u64, elapsed);
        if sample {
            self.tiers.measured.observe_load(bytes, elapsed);
        }
        Ok(())
    }

    /// Waits for every scatter in flight (once a step has queued its compute behind them);
    /// answers the requests whose load failed, by order, and why.
    pub(super) fn finish_loads(&mut self, running: &mut [Seq]) -> Vec<(u64, String)> {
        let mut failed = Vec::new();
        for loading in std::mem::take(&mut self.loading) {
            let order = loading.order;
            let Some(seq) = running.iter_mut().find(|s| s.run.order == order) else { continue };
            if let Err(e) = self.finish_load(loading, &mut seq.blocks, false) {
                failed.push((order, e));
            }
        }
        failed
    }

    /// Takes the loaded blocks at `blocks` of the sequence out of G1: their load failed, so their
    /// pages hold no KV. The pages become the request's private ones (freed at its end).
    pub(super) fn forget_loaded(&mut self, seq: &mut [SeqBlock], blocks: &[usize]) {
        let mut gone = Vec::with_capacity(blocks.len());
        for &i in blocks {
            if let Some(hash) = seq[i].registered.take() {
                let _ = self.registry.release(hash);
                let _ = self.registry.remove(hash);
                self.by_hash.remove(&hash);
                gone.push(hash);
            }
        }
        if !gone.is_empty() {
            self.tiers.observer.removed(self.site(), &gone);
        }
    }
}
