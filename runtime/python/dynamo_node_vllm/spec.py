"""``DynamoNodeSpec``: the OffloadingSpec vLLM's OffloadingConnector loads.

vLLM creates one spec per process from ``kv_connector_extra_config``
(``spec_name: DynamoNodeSpec``, ``spec_module_path: dynamo_node_vllm``). The
scheduler process calls :meth:`get_manager`, every worker process
:meth:`get_worker`. Both register with the node under the same description, so
the node salts their blocks the same way.

Extra config keys read here: ``socket`` (required), ``engine_id``,
``kv_events``, ``region`` (the retention region of this engine's blocks:
``system``, ``tools``, ``conversation``, ``tool_result``, ``reasoning``, ``generated``; the node's
``engine_endpoint.region`` when unset), ``timeout_s``; vLLM itself reads ``block_size`` /
``blocks_per_chunk`` and ``offload_prompt_only``.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingSpec
from vllm.v1.kv_offload.config import OffloadingConfig

from .client import EngineDescription, NodeClient, Role
from .manager import DynamoNodeManager
from .worker import DynamoNodeWorker

LAYOUT_VERSION = "dynamo_node_vllm/1"


def layout_descriptor(config: OffloadingConfig) -> str:
    """Everything besides model, dtype, block_tokens, world_size and
    block_bytes that decides the bytes of an offloaded block.

    The per-rank byte layout itself is named by ``LAYOUT_VERSION``
    (see worker.py). Page sizes are only known to workers, so the scheduler
    and workers describe the same thing through what both can see: the groups
    (tokens per block x layers), the chunking and how the model is split.
    """
    p = config.parallel
    groups = "+".join(f"{g.tokens_per_block}x{len(g.layer_names)}" for g in config.groups)
    return ";".join(
        (
            LAYOUT_VERSION,
            f"kv_cache_layout={config.kv_cache_layout or 'default'}",
            f"canonical={int(config.canonical_layout)}",
            f"groups={groups}",
            f"blocks_per_chunk={config.cache.blocks_per_chunk}",
            f"split=tp{p.tp_size}.pp{p.pp_size}.pcp{p.pcp_size}.dcp{p.dcp_size}",
        )
    )


class DynamoNodeSpec(OffloadingSpec):
    """Offloads vLLM's KV blocks into dynamo-node's shared G2."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.socket_path = self.extra_config.get("socket")
        if not self.socket_path:
            raise ValueError("DynamoNodeSpec needs kv_connector_extra_config['socket']")
        if config.canonical_layout:
            raise ValueError("DynamoNodeSpec stores the direct layout; unset canonical_layout")
        if config.worker_kv_bytes_per_block <= 0:
            raise ValueError("vLLM reports no KV bytes per block; nothing to offload")
        self.timeout_s = float(self.extra_config.get("timeout_s", 2.0))
        # Every rank stores its own share of a block (no single-copy MLA layout).
        self.replicated_layout = False
        self._manager: DynamoNodeManager | None = None
        self._worker: DynamoNodeWorker | None = None

    @property
    def block_bytes(self) -> int:
        """One offloaded block over all ranks.

        ``worker_kv_bytes_per_block`` is what one worker's KV cache spends on
        one vLLM (GPU) block over all its offloaded layers, page padding
        included: the shared allocation's size divided by its block count
        (vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py).
        An offloaded block is ``blocks_per_chunk`` such blocks, on every rank.
        """
        return (
            self.config.worker_kv_bytes_per_block
            * self.blocks_per_chunk
            * self.config.parallel.world_size
        )

    def description(self, rank: int) -> EngineDescription:
        """REGISTER's fields for this engine as seen by ``rank``."""
        config = self.config
        return EngineDescription(
            engine_id=str(self.extra_config.get("engine_id") or config.engine_id),
            model=config.model.name,
            dtype=config.model.dtype,
            layout=layout_descriptor(config),
            block_tokens=config.groups[0].tokens_per_block * self.blocks_per_chunk,
            world_size=config.parallel.world_size,
            rank=rank,
            block_bytes=self.block_bytes,
            kv_events=str(self.extra_config.get("kv_events", "")),
            region=str(self.extra_config.get("region", "")),
        )

    def _client(self, role: Role, rank: int) -> NodeClient:
        return NodeClient(
            self.socket_path,
            role,
            self.description(rank),
            map_region=role is Role.WORKER,
            timeout_s=self.timeout_s,
        )

    def get_manager(self) -> DynamoNodeManager:
        if self._manager is None:
            self._manager = DynamoNodeManager(
                self._client(Role.MANAGER, 0),
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> DynamoNodeWorker:
        if self._worker is None:
            rank = self.config.parallel.rank
            self._worker = DynamoNodeWorker(
                self._client(Role.WORKER, rank),
                kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                rank=rank,
                world_size=self.config.parallel.world_size,
                block_bytes=self.block_bytes,
            )
        return self._worker
