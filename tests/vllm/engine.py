"""Run one vLLM instance on one prompt, optionally with dynamo-node as its KV tier.

    python engine.py --model DIR --prompt-file F --max-tokens N
                     [--socket PATH] [--kv-events tcp://127.0.0.1:PORT]
                     [--engine-id NAME] [--locate]
                     [--blocks-per-chunk N] [--warm-prefix N]

The prompt file holds a JSON list of token ids, or text (tokenized with the
model's tokenizer); it is passed as token ids so every instance sees the same
tokens. Generation is greedy. At the end one JSON line goes to stdout (vLLM's
logs go to stderr):

    {"tokens": [...], "cached_tokens": N, "ttft_s": S,
     "gpu_hashes": [[group, hash], ...], "locate": [[kind, id, blocks], ...]}

``cached_tokens`` is the request's ``num_cached_tokens`` (local prefix cache
plus what the connector loaded); ``ttft_s`` is vLLM's first-token latency of
the request. With ``--socket`` vLLM loads the ``dynamo_node_vllm`` plug-in
(runtime/python) through its OffloadingConnector. With ``--kv-events``, vLLM
publishes its KV events on that port (bound on all interfaces), the plug-in
passes the address to the node, and ``gpu_hashes`` lists the GPU
``BlockStored`` hashes seen on the stream. ``--locate`` asks the node where
that chain of hashes lives, polling up to 5 s for this engine's G1 to show it
all. The node names event hashes under the engine's identity, so LOCATE goes
over a connection registered exactly as the plug-in's rank-0 worker is (a
worker extension fetches that description from the worker process).
"""

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path

PLUGIN_PATH = Path(__file__).resolve().parents[2] / "runtime" / "python"
LOCATE_WAIT_S = 5.0
EVENTS_QUIET_S = 0.5
EVENTS_WAIT_S = 3.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-file", required=True, type=Path)
    parser.add_argument("--max-tokens", required=True, type=int)
    parser.add_argument("--socket", help="dynamo-node's engine socket; omit for no connector")
    parser.add_argument("--kv-events", help="tcp://HOST:PORT vLLM publishes KV events on")
    parser.add_argument("--engine-id", help="engine id the plug-in registers with")
    parser.add_argument("--locate", action="store_true", help="LOCATE the GPU hashes")
    parser.add_argument(
        "--blocks-per-chunk", type=int, help="vLLM blocks per offloaded block (the connector's blocks_per_chunk)"
    )
    parser.add_argument(
        "--warm-prefix",
        type=int,
        default=0,
        help="first generate on the prompt's first N tokens, so the prompt's own request finds "
        "that prefix in vLLM's local cache and loads the rest (from the middle of a chunk)",
    )
    args = parser.parse_args()
    if args.locate and not (args.socket and args.kv_events):
        parser.error("--locate needs --socket and --kv-events")
    return args


def read_prompt(path: Path, model: str) -> list[int]:
    """Token ids from a JSON list, or the tokenized text."""
    text = path.read_text()
    try:
        ids = json.loads(text)
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return ids
    except json.JSONDecodeError:
        pass
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).encode(text, add_special_tokens=False)


class GpuBlockEvents(threading.Thread):
    """Subscribes to vLLM's KV event stream and records, in order, the
    (group, 64-bit hash) of every block stored on medium GPU."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        import zmq

        self._zmq = zmq
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._done = threading.Event()
        self.hashes: list[list[int]] = []
        self.last_event = time.monotonic()

    def run(self) -> None:
        import msgspec

        poller = self._zmq.Poller()
        poller.register(self._sub, self._zmq.POLLIN)
        while not self._done.is_set():
            if not poller.poll(100):
                continue
            _topic, _seq, payload = self._sub.recv_multipart()
            _ts, events, *_ = msgspec.msgpack.decode(payload)
            for event in events:
                if event.get("type") == "BlockStored" and event.get("medium") == "GPU":
                    group = event.get("group_idx") or 0
                    self.hashes += [[group, as_u64(h)] for h in event["block_hashes"]]
                    self.last_event = time.monotonic()

    def settle(self) -> list[list[int]]:
        """Wait until the stream has been quiet a while; return the hashes."""
        deadline = time.monotonic() + EVENTS_WAIT_S
        while time.monotonic() < deadline and (
            not self.hashes or time.monotonic() - self.last_event < EVENTS_QUIET_S
        ):
            time.sleep(0.05)
        self._done.set()
        self.join()
        self._sub.close()
        return list(self.hashes)


def as_u64(block_hash) -> int:
    """vLLM publishes the low 64 bits of a block hash, or the raw bytes."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def bind_endpoint(endpoint: str) -> str:
    """tcp://HOST:PORT -> tcp://*:PORT, so vLLM's publisher binds."""
    return "tcp://*:" + endpoint.rsplit(":", 1)[1]


def llm_kwargs(args: argparse.Namespace) -> dict:
    kwargs = dict(
        model=args.model,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,  # RequestOutput.metrics carries the TTFT
    )
    if args.socket:
        extra = {
            "spec_name": "DynamoNodeSpec",
            "spec_module_path": "dynamo_node_vllm",
            "socket": args.socket,
            "kv_events": args.kv_events or "",
        }
        if args.engine_id:
            extra["engine_id"] = args.engine_id
        if args.blocks_per_chunk:
            extra["blocks_per_chunk"] = args.blocks_per_chunk
        kwargs["kv_transfer_config"] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    if args.locate:
        kwargs["worker_extension_cls"] = f"{Path(__file__).stem}.KvTierDescription"
    if args.kv_events:
        kwargs["kv_events_config"] = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": bind_endpoint(args.kv_events),
            "topic": "",
        }
    return kwargs


class KvTierDescription:
    """vLLM worker extension (``worker_extension_cls``): runs in the worker."""

    def dynamo_node_description(self) -> dict:
        """The REGISTER description of this worker's DynamoNodeSpec."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        spec = get_kv_transfer_group().connector_worker.spec
        return dataclasses.asdict(spec.description(spec.config.parallel.rank))


def locate(args: argparse.Namespace, description: dict, chain: list[list[int]]) -> list[list[int]]:
    """The node's LOCATE answer for the chain, once this engine's G1 holds
    all of it or LOCATE_WAIT_S has passed."""
    from dynamo_node_vllm.client import EngineDescription, Location, NodeClient, Role

    client = NodeClient(args.socket, Role.WORKER, EngineDescription(**description))
    deadline = time.monotonic() + LOCATE_WAIT_S
    while True:
        found = client.locate(chain)
        in_g1 = any(kind == Location.ENGINE_G1 and n == len(chain) for kind, _, n in found)
        if in_g1 or time.monotonic() > deadline:
            client.shutdown()
            return [list(entry) for entry in found]
        time.sleep(0.2)


def main() -> None:
    args = parse_args()
    prompt = read_prompt(args.prompt_file, args.model)
    events = GpuBlockEvents(args.kv_events) if args.kv_events else None
    if events:
        events.start()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**llm_kwargs(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    if args.warm_prefix:
        warm = TokensPrompt(prompt_token_ids=prompt[: args.warm_prefix])
        llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    metrics = output.metrics
    result = {
        "tokens": list(output.outputs[0].token_ids),
        "cached_tokens": output.num_cached_tokens or 0,
        "ttft_s": getattr(metrics, "first_token_latency", None),
        "gpu_hashes": events.settle() if events else [],
        "locate": [],
    }
    if args.locate:
        (description, *_) = llm.collective_rpc("dynamo_node_description")
        result["locate"] = locate(args, description, result["gpu_hashes"])
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(PLUGIN_PATH), os.environ.get("PYTHONPATH")) if p
    )
    sys.path.insert(0, str(PLUGIN_PATH))
    main()
