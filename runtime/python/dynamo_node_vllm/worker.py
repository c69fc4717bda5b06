"""The worker-side OffloadingWorker: copies KV pages to and from G2 slots.

Per-rank slot layout. Rank ``r`` of ``world_size`` owns
``share = block_bytes / world_size`` bytes of every slot's payload, starting at
``slot * slot_bytes + payload_offset + r * share``. Within its share a rank
writes, for each canonical KV tensor in vLLM's order, ``blocks_per_chunk``
consecutive pages of that tensor's page size (padding included)::

    | tensor 0: page 0 .. page bpc-1 | tensor 1: page 0 .. page bpc-1 | ...

Each (GPU block, layer reference) is one row of the tensor's
``(num_blocks, page_size_bytes)`` int8 view and one slice of a tensor over the
mapped region; a run of blocks with consecutive ids in consecutive slots is
copied as one strided copy per layer. No gather temporaries. Copies are synchronous, so a job is
finished when ``submit_*`` returns.

Failures. vLLM 0.32's OffloadingConnector asserts that every transfer
succeeds (offloading/worker.py) and has no way to report a failed load, so:

* A load the worker cannot serve (its region is gone, or a slot is missing)
  is reported as a failed TransferResult; vLLM stops on its assertion rather
  than computing on KV that was never loaded. The worker keeps its mapping of
  a region after the node goes away, so a load prepared before the node died
  is still served from it.
* A store the worker cannot perform is skipped and reported done. When its
  region is gone (the node restarted) nothing unwritten is sealed: the
  manager completes stores only on the connection that prepared them. The
  node being up with that region yet refusing this worker's registration (or
  the mapping failing) is the one case where an unwritten slot could be
  sealed; the node can rule it out by handing out store slots only while all
  of an engine's ranks are registered.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from .client import NodeClient, NodeError, Region
from .manager import NodeSlotsSpec

# Under "vllm." so that, inside vLLM, its handlers and levels apply.
logger = logging.getLogger(f"vllm.{__name__}")

# Least time between two registration attempts for the same unknown region.
REREGISTER_INTERVAL_S = 1.0


@dataclass(frozen=True)
class PageCopy:
    """One layer reference of a KV group: where its page lives on each side."""

    tensor: torch.Tensor  # (num_blocks, page_size_bytes) int8 view of the KV cache
    share_offset: int  # where this tensor's pages start in the rank's share
    page_stride: int  # bytes between consecutive pages of a chunk in the share
    length: int  # bytes copied per page (the layer's unpadded page size)


def plan_pages(
    kv_caches: CanonicalKVCaches, blocks_per_chunk: int
) -> tuple[list[list[PageCopy]], int]:
    """Per KV group, the page copies of one block; and the bytes one rank's
    share of an offloaded block needs."""
    tensors = []
    offsets = []
    share_bytes = 0
    for entry in kv_caches.tensors:
        page = entry.page_size_bytes
        tensors.append(entry.tensor.view(torch.int8).view((-1, page)))
        offsets.append(share_bytes)
        share_bytes += page * blocks_per_chunk
    groups = [
        [
            PageCopy(
                tensor=tensors[ref.tensor_idx],
                share_offset=offsets[ref.tensor_idx],
                page_stride=kv_caches.tensors[ref.tensor_idx].page_size_bytes,
                length=ref.page_size_bytes,
            )
            for ref in refs
        ]
        for refs in kv_caches.group_data_refs
    ]
    return groups, share_bytes


def chunk_positions(
    gpu_spec: GPULoadStoreSpec, blocks_per_chunk: int, num_chunks: int
) -> list[tuple[int, int, int, int]]:
    """(group, chunk index, page within the chunk, GPU block id) for every GPU
    block of a job, paired as vLLM's CPU worker pairs them: each group's
    blocks fill its own chunks in order, its first chunk skipping
    ``block_indices[g] % blocks_per_chunk`` pages when the group starts
    mid-chunk. Raises ValueError when the job's chunks are not ``num_chunks``.
    """
    block_ids = gpu_spec.block_ids.tolist()
    positions = []
    block_offset = 0
    chunk_offset = 0
    for group, (size, first_index) in enumerate(
        zip(gpu_spec.group_sizes, gpu_spec.block_indices)
    ):
        if size == 0:
            continue
        skip = first_index % blocks_per_chunk
        for i, block_id in enumerate(block_ids[block_offset : block_offset + size], skip):
            chunk, page = divmod(i, blocks_per_chunk)
            positions.append((group, chunk_offset + chunk, page, block_id))
        block_offset += size
        chunk_offset += -(-(size + skip) // blocks_per_chunk)
    if block_offset != len(block_ids) or chunk_offset != num_chunks:
        raise ValueError(
            f"job pairs {len(block_ids)} GPU blocks with {num_chunks} slots, "
            f"but its groups cover {block_offset} blocks and {chunk_offset} chunks"
        )
    return positions


def runs(
    positions: list[tuple[int, int, int, int]], slots: list[int], blocks_per_chunk: int
) -> list[tuple[int, int, int, int, int]]:
    """``positions`` (from :func:`chunk_positions`) merged into runs
    ``(group, chunk, page, first GPU block id, count)`` of blocks whose ids and
    slots both follow on: each run is one copy per layer. Only whole-chunk
    blocks (``blocks_per_chunk == 1``) merge; otherwise every run is one block."""
    merged: list[tuple[int, int, int, int, int]] = []
    for group, chunk, page, block_id in positions:
        if merged and blocks_per_chunk == 1:
            g, c, p, b, n = merged[-1]
            if g == group and block_id == b + n and slots[chunk] == slots[c] + n and chunk == c + n:
                merged[-1] = (g, c, p, b, n + 1)
                continue
        merged.append((group, chunk, page, block_id, 1))
    return merged


class DynamoNodeWorker(OffloadingWorker):
    """OffloadingWorker copying between vLLM's KV cache and the node's G2."""

    def __init__(
        self,
        client: NodeClient,
        kv_caches: CanonicalKVCaches,
        *,
        blocks_per_chunk: int,
        rank: int,
        world_size: int,
        block_bytes: int,
    ):
        self._client = client
        self._blocks_per_chunk = blocks_per_chunk
        self._groups, share_bytes = plan_pages(kv_caches, blocks_per_chunk)
        self._share = block_bytes // world_size
        if share_bytes > self._share:
            raise ValueError(
                f"rank {rank}'s KV pages need {share_bytes} bytes per offloaded block, "
                f"more than its {self._share}-byte share of block_bytes={block_bytes}"
            )
        self._share_start = rank * self._share
        self._finished: list[TransferResult] = []
        # A view of the mapped region, and the Region it views.
        self._view: torch.Tensor | None = None
        self._view_region: Region | None = None
        # Unknown region id -> earliest time to try registering for it again.
        self._next_register: dict[int, float] = {}
        try:
            client.connect()
        except NodeError:
            pass  # logged by the client; retried when a job names a region

    # -- OffloadingWorker ------------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Copy GPU pages into the job's slots (GPU -> G2)."""
        assert isinstance(dst_spec, NodeSlotsSpec)
        result = self._transfer(job_id, src_spec, dst_spec, to_node=True)
        if result is None:
            logger.warning(
                "dynamo-node: store job %d not written: region %#x is gone",
                job_id,
                dst_spec.region_id,
            )
            result = TransferResult(job_id, True, 0, 0.0)
        self._finished.append(result)
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        """Copy the job's slots into GPU pages (G2 -> GPU)."""
        assert isinstance(src_spec, NodeSlotsSpec)
        result = self._transfer(job_id, dst_spec, src_spec, to_node=False)
        if result is None:
            logger.error(
                "dynamo-node: load job %d cannot be served (region %#x, slots %s); "
                "reporting it failed rather than leaving unloaded KV in use",
                job_id,
                src_spec.region_id,
                src_spec.slots.tolist(),
            )
            result = TransferResult(job_id, False)
        self._finished.append(result)
        return True

    def get_finished(self) -> list[TransferResult]:
        self._keep_registered()
        finished, self._finished = self._finished, []
        return finished

    def _keep_registered(self) -> None:
        """Register again (at most once a second) when the node has closed this
        worker's connection: the node hands out store slots only while every
        rank's worker is registered, so a worker must come back on its own
        after the node restarts. The old region stays mapped until a new one
        replaces it, so a load already planned in it is still served."""
        if self._client.alive():
            return
        self._client.close()
        try:
            self._client.ensure_connected()
        except NodeError:
            pass  # logged once per outage by the client

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every copy finished inside submit_*."""

    def shutdown(self) -> None:
        self._view = None
        self._view_region = None
        self._client.shutdown()

    # -- copying ---------------------------------------------------------------

    def _transfer(
        self, job_id: int, gpu_spec: GPULoadStoreSpec, node_spec: NodeSlotsSpec, to_node: bool
    ) -> TransferResult | None:
        """Copy one job; None when its slots are not in a region this worker
        can map. A job whose blocks and slots do not pair up raises."""
        started = time.perf_counter()
        slots = node_spec.slots.tolist()
        if min(slots, default=0) < 0:
            return None
        region = self._region(node_spec.region_id)
        if region is None or max(slots, default=0) >= region.registration.slots:
            return None
        view = self._view_of(region)
        slot_bytes = region.registration.slot_bytes
        share_base = region.registration.payload_offset + self._share_start
        copied = 0
        positions = chunk_positions(gpu_spec, self._blocks_per_chunk, len(slots))
        for group, chunk, page, block_id, count in runs(positions, slots, self._blocks_per_chunk):
            base = slots[chunk] * slot_bytes + share_base
            for copy in self._groups[group]:
                start = base + copy.share_offset + page * copy.page_stride
                # `count` blocks with consecutive ids in consecutive slots: one strided copy
                # (a slot apart in the region, a row apart in the KV tensor) per layer.
                node_bytes = view.as_strided((count, copy.length), (slot_bytes, 1), start)
                gpu_bytes = copy.tensor[block_id : block_id + count, : copy.length]
                if to_node:
                    node_bytes.copy_(gpu_bytes)
                else:
                    gpu_bytes.copy_(node_bytes)
                copied += count * copy.length
        return TransferResult(job_id, True, copied, time.perf_counter() - started)

    def _region(self, region_id: int) -> Region | None:
        """The mapped region ``region_id``, registering again if the node has
        a new one (the old mapping stays until the new one replaces it)."""
        region = self._client.region
        if region is not None and region.registration.region_id == region_id:
            return region
        now = time.monotonic()
        if now < self._next_register.get(region_id, 0.0):
            return None
        self._next_register = {region_id: now + REREGISTER_INTERVAL_S}
        self._view = None  # let the client unmap the old region
        self._view_region = None
        try:
            self._client.connect()
        except NodeError:
            return None
        region = self._client.region
        if region is None or region.registration.region_id != region_id:
            return None
        return region

    def _view_of(self, region: Region) -> torch.Tensor:
        """An int8 tensor over the whole mapped region (no copy)."""
        if self._view_region is not region:
            self._view = torch.frombuffer(region.mm, dtype=torch.int8)
            self._view_region = region
        return self._view
