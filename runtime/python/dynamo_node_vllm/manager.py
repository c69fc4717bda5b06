"""The scheduler-side OffloadingManager: lookups, slots and events from the node.

Lookups are batched per scheduler step. ``lookup`` never blocks: it answers
from what the previous step's LOOKUP returned and queues any key it has not
seen, answering RETRY (vLLM then asks again next step, and keeps stepping
while :meth:`has_pending_work` is True). ``on_schedule_end``, called once per
step, sends one LOOKUP for every queued key.

Whenever the node is away or answers with an error, lookups miss, stores are
declined and nothing is raised into vLLM; the client logs one warning per
outage and reconnects at most once a second.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence

import numpy as np
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

from .client import SLOT_NO_ROOM, SLOT_NOT_AVAILABLE, LookupAnswer, NodeClient, NodeError

# Under "vllm." so that, inside vLLM, its handlers and levels apply.
logger = logging.getLogger(f"vllm.{__name__}")

# The node pins a hit for 10 s on the connection that looked it up; a cached
# hit is trusted for half of that.
HIT_TTL_S = 5.0


class NodeSlotsSpec(LoadStoreSpec):
    """Where a job's blocks live in the node's G2: one slot per offloaded
    block, in the job's key order, in the region ``region_id`` (a slot below
    zero means the block is not available)."""

    def __init__(self, region_id: int, slots: Sequence[int]):
        self.region_id = region_id
        self.slots = np.asarray(slots, dtype=np.int64)

    def __repr__(self) -> str:
        return f"NodeSlotsSpec(region={self.region_id:#x}, slots={self.slots.tolist()})"


class Outstanding:
    """Keys prepared (PREPARE_STORE / PREPARE_LOAD) and not yet completed,
    with the connection generation each was prepared on. Completing on a
    later connection would name slots that connection never handed out."""

    def __init__(self) -> None:
        self._generations: dict[OffloadKey, list[int]] = {}

    def add(self, keys: Iterable[OffloadKey], generation: int) -> None:
        for key in keys:
            self._generations.setdefault(key, []).append(generation)

    def take(self, keys: Iterable[OffloadKey], generation: int) -> list[OffloadKey]:
        """Forget the keys; return those prepared on ``generation``."""
        live = []
        for key in keys:
            pending = self._generations.get(key)
            if not pending:
                continue
            if pending.pop(0) == generation:
                live.append(key)
            if not pending:
                del self._generations[key]
        return live

    def clear(self) -> None:
        self._generations.clear()


class DynamoNodeManager(OffloadingManager):
    """OffloadingManager backed by the node (one connection, role manager)."""

    def __init__(self, client: NodeClient, *, enable_events: bool):
        self._client = client
        self._enable_events = enable_events
        # Keys to ask about at the end of this step (an ordered set).
        self._queued: dict[OffloadKey, None] = {}
        # MISS or RETRY answers from the last LOOKUP, valid for this step only.
        self._answers: dict[OffloadKey, LookupResult] = {}
        # HIT answers: key -> (monotonic time the hit stops being trusted, region, pinned slot).
        self._hits: dict[OffloadKey, tuple[float, int, int]] = {}
        # The client generation the cached answers were given on.
        self._generation = client.generation
        self._stores = Outstanding()
        self._loads = Outstanding()
        try:
            client.ensure_connected()
        except NodeError:
            pass  # logged by the client; retried on the next call

    # -- lookups ------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._drop_answers_of_old_connection()
        hit = self._hits.get(key)
        if hit is not None:
            if time.monotonic() < hit[0]:
                return LookupResult.HIT
            del self._hits[key]
        answer = self._answers.get(key)
        if answer is not None:
            return answer
        self._queued[key] = None
        return LookupResult.RETRY

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Drop this step's answers and ask about every queued key at once."""
        self._answers.clear()
        if not self._queued:
            return
        keys = list(self._queued)
        self._queued.clear()
        try:
            answers = self._client.lookup(keys)
            region_id = self._client.registration.region_id
        except NodeError:
            answers, region_id = [(LookupAnswer.MISS, -1)] * len(keys), 0
        self._drop_answers_of_old_connection()
        expiry = time.monotonic() + HIT_TTL_S
        for key, (answer, slot) in zip(keys, answers):
            if answer == LookupAnswer.HIT:
                self._hits[key] = (expiry, region_id, slot)
            elif answer == LookupAnswer.PENDING:
                self._answers[key] = LookupResult.RETRY
                self._queued[key] = None
            else:
                self._answers[key] = LookupResult.MISS

    def has_pending_work(self) -> bool:
        return bool(self._queued)

    def _drop_answers_of_old_connection(self) -> None:
        """Hits are pinned per connection: a new connection invalidates them."""
        if self._client.generation != self._generation:
            self._generation = self._client.generation
            self._hits.clear()
            self._answers.clear()

    # -- loads --------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> NodeSlotsSpec:
        """PREPARE_LOAD (pins the blocks). vLLM has already committed to the
        load, so a failure here cannot be declined: the spec then carries
        slot -1 and the worker fails the job (see worker.py)."""
        keys = list(keys)
        hits = [self._hits.pop(key, None) for key in keys]
        try:
            slots = self._client.prepare_load(keys)
            region_id = self._client.registration.region_id
        except NodeError as e:
            # The node went away after the lookup. The slots it pinned for the lookup still hold
            # the blocks in the region the workers map (a dead node reuses no slot): load them.
            regions = {hit[1] for hit in hits if hit is not None}
            if all(hit is not None and hit[2] >= 0 for hit in hits) and len(regions) == 1:
                logger.warning(
                    "dynamo-node went away before %d looked-up blocks were pinned for loading; "
                    "loading them from the slots pinned at lookup: %s", len(keys), e)
                return NodeSlotsSpec(regions.pop(), [hit[2] for hit in hits])
            logger.error("dynamo-node: cannot pin %d blocks vLLM will load: %s", len(keys), e)
            return NodeSlotsSpec(0, [SLOT_NOT_AVAILABLE] * len(keys))
        if min(slots, default=0) < 0:
            logger.error(
                "dynamo-node: %d of %d blocks looked up as hits are no longer available",
                sum(slot < 0 for slot in slots),
                len(keys),
            )
        self._loads.add(keys, self._client.generation)
        return NodeSlotsSpec(region_id, slots)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext):
        live = self._loads.take(keys, self._client.generation)
        if live and self._client.connected:
            try:
                self._client.complete_load(live)
            except NodeError:
                pass

    # -- stores -------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """PREPARE_STORE. Keys with a slot are stored; keys already stored
        are skipped; None (vLLM retries next step) when the node has no room
        for any, or not every rank's worker is registered yet; nothing stored
        when the node is away."""
        keys = list(keys)
        try:
            slots = self._client.prepare_store(keys)
            region_id = self._client.registration.region_id
        except NodeError:
            # The node is away: these blocks are not offloaded (an empty store, not None, which
            # vLLM would retry, with a warning, every step of the outage).
            return PrepareStoreOutput(keys_to_store=[], store_spec=NodeSlotsSpec(0, []), evicted_keys=[])
        granted = [(key, slot) for key, slot in zip(keys, slots) if slot >= 0]
        if not granted and SLOT_NO_ROOM in slots:
            return None
        self._stores.add((key for key, _ in granted), self._client.generation)
        return PrepareStoreOutput(
            keys_to_store=[key for key, _ in granted],
            store_spec=NodeSlotsSpec(region_id, [slot for _, slot in granted]),
            evicted_keys=[],
        )

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        req_context: ReqContext,
        success: bool = True,
    ):
        live = self._stores.take(keys, self._client.generation)
        if live and self._client.connected:
            try:
                self._client.complete_store(live, success)
            except NodeError:
                pass

    # -- the rest -------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """TAKE_EVENTS, as runs of stored or removed keys in the node's order."""
        if not self._enable_events:
            return ()
        try:
            events = self._client.take_events()
        except NodeError:
            return ()
        runs: list[OffloadingEvent] = []
        for event in events:
            if runs and runs[-1].removed == event.removed:
                runs[-1].keys.append(OffloadKey(event.key))
            else:
                runs.append(OffloadingEvent([OffloadKey(event.key)], Medium.CPU, event.removed))
        return runs

    def reset_cache(self) -> None:
        """Forget cached answers and outstanding jobs (vLLM drops the jobs).
        Their slots stay with the node until this connection closes: giving
        them back now could hand a slot a worker is still writing to another
        block."""
        self._queued.clear()
        self._answers.clear()
        self._hits.clear()
        self._stores.clear()
        self._loads.clear()

    def shutdown(self) -> None:
        self._client.shutdown()
