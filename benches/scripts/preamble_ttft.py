"""Claude-Code-shaped sessions against a dynamo-node, with and without --strip-anthropic-preamble.

Claude Code puts `x-anthropic-billing-header: ... cch=XXXXX;` first in `system`, and `cch` changes
on every request: unless the node drops it, no request shares a single block with the one before,
and every turn recomputes its whole system + tools prefix (~20K tokens in Claude Code; 6,000 by
default here, ~8K prompt tokens in all, since the CPU engine prefills about 1,000 tokens/s). This runs the same sessions
(the official `anthropic` SDK, streaming, a new `cch` per request) against a node with
`frontend.strip_anthropic_preamble = true` and one with `false`, and prints the time to first
token of every turn and the ratio of the two, next to NVIDIA Dynamo's reported 912 -> 169 ms
(5.4x) for the same fix.

Usage: benches/scripts/preamble_ttft.py PATH/TO/dynamo-node [--prefix-tokens 6000] [--sessions 2] [--turns 3]
(a release build: `cargo build --release -p dynamo-node`; the SDK: `pip install anthropic`).
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import anthropic


def start_node(binary: str, data_dir: str, strip: bool) -> tuple[subprocess.Popen, str]:
    config = os.path.join(data_dir, "node.toml")
    with open(config, "w") as f:
        f.write(f"[frontend]\nstrip_anthropic_preamble = {'true' if strip else 'false'}\n")
    node = subprocess.Popen(
        [binary, "serve", "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--data-dir", data_dir, "--config", config],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    base = None
    for line in node.stdout:
        if line.startswith("serving the OpenAI API on "):
            base = line.split()[-1].removesuffix("/v1")
        if line.startswith("ready"):
            break
    if base is None:
        raise SystemExit("the node did not start")
    return node, base


def system_blocks(prefix_tokens: int) -> list[dict]:
    # About 14 o200k tokens a rule.
    rules = "".join(f"Rule {i}: when you edit src/module_{i}.rs keep its public API stable. " for i in range(prefix_tokens // 14))
    return [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={random.randrange(16**5):05x};"},
        {"type": "text", "text": "You are Claude Code, a coding agent. " + rules, "cache_control": {"type": "ephemeral"}},
    ]


TOOLS = [
    {"name": name, "description": f"{name} a path in the repository.", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
    for name in ["Read", "Write", "Edit", "Glob", "Grep", "Bash", "LS", "TodoWrite"]
]


def run_sessions(base: str, args) -> list[list[tuple[float, float]]]:
    """Per session, per turn: (TTFT in seconds, share of the prompt read from cache)."""
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=600)
    sessions = []
    for s in range(args.sessions):
        messages = [{"role": "user", "content": f"Session {s}: fix the failing test in crate {s}."}]
        turns = []
        for t in range(args.turns):
            started = time.perf_counter()
            first = None
            with client.messages.stream(
                model="tiny",
                max_tokens=8,
                system=system_blocks(args.prefix_tokens),
                tools=TOOLS,
                messages=messages,
                extra_body={"temperature": 0},
            ) as stream:
                for event in stream:
                    if first is None and event.type == "content_block_delta":
                        first = time.perf_counter() - started
                final = stream.get_final_message()
            u = final.usage
            total = u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0)
            turns.append((first if first is not None else time.perf_counter() - started, u.cache_read_input_tokens / total))
            print(f"session {s} turn {t}: TTFT {turns[-1][0] * 1e3:.0f} ms, {total} prompt tokens, {turns[-1][1]:.1%} read from cache", file=sys.stderr, flush=True)
            text = "".join(b.text for b in final.content if b.type == "text") or "ok"
            messages = messages + [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Turn {t + 1}: now run the tests of crate {s}."},
            ]
        sessions.append(turns)
    return sessions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("--prefix-tokens", type=int, default=6000)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    random.seed(7)
    results = {}
    for strip in (True, False):
        print(f"preamble {'stripped' if strip else 'kept'}:", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as data_dir:
            node, base = start_node(args.binary, data_dir, strip)
            try:
                results[strip] = run_sessions(base, args)
            finally:
                node.terminate()
                node.wait()

    print(f"## Claude-Code-shaped sessions: {args.sessions} x {args.turns} turns, ~{args.prefix_tokens}-token system + tools prefix\n")
    print("| preamble | turn 1 TTFT, mean (session 1 is cold) | turns 2+ TTFT, mean | turns 2+ prompt read from cache |")
    print("|---|---|---|---|")
    later = {}
    for strip in (True, False):
        first = [s[0][0] for s in results[strip]]
        rest = [t for s in results[strip] for t in s[1:]]
        later[strip] = statistics.mean(t[0] for t in rest)
        share = statistics.mean(t[1] for t in rest)
        name = "stripped (default)" if strip else "kept"
        print(f"| {name} | {statistics.mean(first) * 1e3:.0f} ms | {later[strip] * 1e3:.0f} ms | {share:.1%} |")
    ratio = later[False] / later[True]
    print(f"\nTTFT of turns 2+, kept / stripped: {ratio:.1f}x (NVIDIA Dynamo reports 912 -> 169 ms, 5.4x)")


if __name__ == "__main__":
    main()
