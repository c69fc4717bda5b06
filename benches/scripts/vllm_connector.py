"""vLLM with dynamo-node as its KV tier, measured against its peers on this machine.

    python benches/scripts/vllm_connector.py --node target/release/dynamo-node [--blocks 64]

Run with vLLM's Python (``~/.cache/dynamo-node/vllm-venv/bin/python``). It starts
the node (engine endpoint on, G2 1 GiB, G3 in a temporary directory) and
prints two ratios, each against a peer measured in the same run:

1. **TTFT.** A random Llama large enough for prefill to dominate (8 layers,
   hidden 512, 8 KV heads of 64; 2 MiB per 128-token block) answers a
   1,920-token prompt in three fresh vLLM processes: C without the connector
   (recomputes the prompt), A with it (computes and stores), B with it (loads
   what A stored). The ratio is B's TTFT over C's.
2. **Copy rate.** The plug-in's own worker copies ``--blocks`` blocks of that
   model's KV pages into G2 slots and back, through a registered connection to
   the node; the peer is one plain ``memcpy`` (a contiguous tensor copy) of
   the same bytes. Each side is the fastest of three runs; the ratios are each
   direction's GB/s over memcpy's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "runtime" / "python"))
sys.path.insert(0, str(REPO / "tests" / "vllm"))

LAYERS, HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE = 8, 512, 8, 64, 1408
BLOCK_TOKENS = 128
PAGE_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # K and V of one layer, bf16
BLOCK_BYTES = LAYERS * PAGE_BYTES
PROMPT_TOKENS = 1920


def make_model(directory: Path) -> None:
    """The bench model: make_tiny's tokenizer, a larger random Llama."""
    import random

    import torch
    from make_tiny import make_tokenizer, synthetic_lines
    from transformers import LlamaConfig, LlamaForCausalLM

    rng = random.Random(0)
    tokenizer = make_tokenizer(synthetic_lines(rng, 500))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    model.save_pretrained(directory)


def start_node(binary: Path, data: Path) -> tuple[subprocess.Popen, Path]:
    data.mkdir(parents=True, exist_ok=True)
    config = data / "node.toml"
    config.write_text(
        f"""
[tiers.g2]
capacity = "1GiB"
mlock = "try"

[tiers.g3]
capacity_per_path = "1GiB"

[engine_endpoint]
enabled = true
max_block_bytes = "{BLOCK_BYTES}B"
"""
    )
    node = subprocess.Popen(
        [str(binary), "serve", "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
         "--data-dir", str(data), "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    for line in node.stdout:
        if line.startswith("serving the OpenAI API"):
            break
    else:
        raise SystemExit("the node did not start")
    return node, data / "engines.sock"


def engine(model: Path, prompt: Path, socket: Path | None, engine_id: str) -> dict:
    cmd = [sys.executable, str(REPO / "tests" / "vllm" / "engine.py"), "--model", str(model),
           "--prompt-file", str(prompt), "--max-tokens", "4", "--engine-id", engine_id]
    if socket is not None:
        cmd += ["--socket", str(socket)]
    env = dict(os.environ, PYTHONPATH=str(REPO / "runtime" / "python"), HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="2")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"vLLM failed:\n{out.stderr[-4000:]}")
    return json.loads([l for l in out.stdout.splitlines() if l.startswith("{")][-1])


def copy_rates(socket: Path, blocks: int) -> tuple[float, float, float]:
    """GB/s of the plug-in worker's store and load of ``blocks`` blocks, and of
    a plain memcpy of the same bytes."""
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec)

    from dynamo_node_vllm.client import EngineDescription, NodeClient, Role
    from dynamo_node_vllm.manager import NodeSlotsSpec
    from dynamo_node_vllm.worker import DynamoNodeWorker

    description = EngineDescription(
        engine_id="bench", model="bench", dtype="bfloat16", layout="bench",
        block_tokens=BLOCK_TOKENS, world_size=1, rank=0, block_bytes=BLOCK_BYTES)
    manager = NodeClient(str(socket), Role.MANAGER, description)
    manager.connect()
    # The KV cache: one (num_blocks, page) tensor per layer, as vLLM's CPU backend has it.
    tensors = [torch.randint(-128, 127, (blocks, PAGE_BYTES), dtype=torch.int8) for _ in range(LAYERS)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE_BYTES) for t in tensors],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE_BYTES) for i in range(LAYERS)]],
    )
    worker = DynamoNodeWorker(
        NodeClient(str(socket), Role.WORKER, description, map_region=True), caches,
        blocks_per_chunk=1, rank=0, world_size=1, block_bytes=BLOCK_BYTES)
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(blocks)]
    slots = manager.prepare_store(keys)
    assert all(s >= 0 for s in slots), f"G2 gave no room: {slots}"
    region = manager.registration.region_id
    gpu = GPULoadStoreSpec(list(range(blocks)), group_sizes=[blocks], block_indices=[0])
    total = blocks * BLOCK_BYTES

    def best(copy) -> float:
        """The fastest of three runs of ``copy``, in seconds (the same for every side)."""
        times = []
        for _ in range(3):
            started = time.perf_counter()
            copy()
            times.append(time.perf_counter() - started)
        return min(times)

    jobs = iter(range(1, 1000))
    store_s = best(lambda: worker.submit_store(next(jobs), gpu, NodeSlotsSpec(region, slots)))
    manager.complete_store(keys, True)
    for t in tensors:
        t.zero_()
    load_slots = manager.prepare_load(keys)
    load_s = best(lambda: worker.submit_load(next(jobs), NodeSlotsSpec(region, load_slots), gpu))
    manager.complete_load(keys)
    assert all(r.success for r in worker.get_finished())

    src = torch.randint(-128, 127, (total,), dtype=torch.int8)
    dst = torch.empty_like(src)
    memcpy_s = best(lambda: dst.copy_(src))
    worker.shutdown()
    manager.shutdown()
    return total / store_s / 1e9, total / load_s / 1e9, total / memcpy_s / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", type=Path, required=True, help="the dynamo-node binary (release)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per copy (2 MiB each)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        make_model(model)
        prompt = tmp / "prompt.json"
        prompt.write_text(json.dumps([3 + (i * 7919 + i // 13) % 500 for i in range(PROMPT_TOKENS)]))
        node, socket = start_node(args.node.resolve(), tmp / "data")
        try:
            c = engine(model, prompt, None, "bench-c")
            a = engine(model, prompt, socket, "bench-a")
            b = engine(model, prompt, socket, "bench-b")
            assert b["tokens"] == c["tokens"] == a["tokens"], "greedy output differs"
            store, load, memcpy = copy_rates(socket, args.blocks)
        finally:
            node.terminate()
            node.wait(timeout=30)
    print(f"TTFT, {PROMPT_TOKENS}-token prompt, fresh vLLM (block {BLOCK_BYTES >> 20} MiB):")
    print(f"  recompute (no connector)   {c['ttft_s'] * 1e3:9.1f} ms")
    print(f"  load from dynamo-node      {b['ttft_s'] * 1e3:9.1f} ms   ({b['cached_tokens']} tokens loaded)")
    print(f"  ratio load/recompute       {b['ttft_s'] / c['ttft_s']:9.3f}   ({c['ttft_s'] / b['ttft_s']:.1f}x faster)")
    print(f"copy into and out of the shared G2, {args.blocks} blocks ({args.blocks * BLOCK_BYTES >> 20} MiB), plug-in worker vs memcpy:")
    print(f"  memcpy (one contiguous copy) {memcpy:6.2f} GB/s")
    print(f"  store GPU->G2                {store:6.2f} GB/s   ratio {store / memcpy:.3f}")
    print(f"  load  G2->GPU                {load:6.2f} GB/s   ratio {load / memcpy:.3f}")


if __name__ == "__main__":
    main()
