#!/usr/bin/env python3
"""TTFT of a long prompt, uncached vs cached, through a running dynamo-node's OpenAI API.

Usage: python3 benches/scripts/ttft_openai.py [--base-url http://127.0.0.1:8000/v1] [--words 2500] [--runs 3]

Each run sends a fresh long conversation (its prefix cached nowhere: uncached TTFT), then the same
conversation plus one more user turn (the prefix is in some tier now: cached TTFT), both streamed
with the official OpenAI SDK; TTFT is the time to the first content chunk. Prints the medians, the
ratio, and the `cached_tokens` the server reported.
"""
import argparse
import random
import statistics
import time

import openai


def ttft(client, model, messages):
    start = time.perf_counter()
    first = None
    cached = None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first if first is not None else time.perf_counter() - start, cached


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--words", type=int, default=2500)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused")
    model = client.models.list().data[0].id
    rng = random.Random(7)
    vocab = ["tool", "result", "file", "diff", "patch", "error", "line", "function", "test", "build"]
    cold, warm, cached_seen = [], [], []
    for run in range(args.runs):
        history = " ".join(f"{rng.choice(vocab)}{rng.randrange(10_000)}" for _ in range(args.words))
        messages = [
            {"role": "system", "content": f"You are a coding agent. Session {run}-{rng.random()}."},
            {"role": "user", "content": history},
        ]
        t, _ = ttft(client, model, messages)
        cold.append(t)
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next step?"}]
        t, cached = ttft(client, model, messages)
        warm.append(t)
        cached_seen.append(cached)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"uncached TTFT {c * 1e3:.1f} ms, cached TTFT {w * 1e3:.1f} ms, ratio {c / w:.2f}x "
          f"(median of {args.runs}; cached_tokens {cached_seen})")


if __name__ == "__main__":
    main()
