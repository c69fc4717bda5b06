"""The reference engine on a real-shape checkpoint against `transformers` on the same CPU.

    python benches/scripts/checkpoint_speed.py --node target/release/dynamo-node [--prompt 512]

Run with the vLLM environment's Python (``~/.cache/dynamo-node/vllm-venv/bin/python``: it has
torch and transformers). It saves a random Llama with llama-1b's shape (16 layers, hidden 2048,
32 heads, 8 KV heads of 64, FFN 8192, vocabulary 128256, tied embeddings; bf16 safetensors on
disk) with `transformers`, then measures, in the same run and on the same cores:

- **transformers**: the model loaded in float32 (what the node computes in on the CPU), torch on
  the machine's cores; prefill = a forward over a ``--prompt``-token prompt, decode = greedy
  `generate` of 33 tokens minus of 1, over 32.
- **dynamo-node**: ``serve`` with ``model.path`` at the checkpoint and one CPU worker (all cores),
  Completions with token-id prompts; prefill = a request for 1 token, decode = a request for 33
  tokens minus one for 1 (each on a fresh prompt, so nothing is served from the cache), over 32.

Each number is the best of ``--runs``; it prints tokens/s of both and the node's ratio over
transformers (above 1: the node is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def save_checkpoint(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500000.0,
                         tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=0, eos_token_id=1)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def transformers_speed(path: Path, prompts: list[list[int]], runs: int) -> tuple[float, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(ids: list[int], n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    prefill = min(generate(prompts[i], 1) for i in range(runs))
    decode = min(generate(prompts[runs + i], 33) for i in range(runs)) - prefill
    return len(prompts[0]) / prefill, 32 / decode


def node_speed(node: str, path: Path, prompts: list[list[int]], runs: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as data:
        config = Path(data) / "node.toml"
        config.write_text(f'[model]\nname = "bench"\npath = "{path}"\n[engine]\nworkers = 1\ndevice = "cpu"\n'
                          )
        proc = subprocess.Popen([node, "serve", "--http", "127.0.0.1:18431", "--metrics", "127.0.0.1:0",
                                 "--data-dir", data, "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("ready"):
                    break
            else:
                raise SystemExit("the node did not start")

            def complete(ids: list[int], n: int) -> float:
                body = json.dumps({"model": "bench", "prompt": ids, "max_tokens": n, "temperature": 0}).encode()
                request = urllib.request.Request("http://127.0.0.1:18431/v1/completions", body,
                                                 {"content-type": "application/json"})
                start = time.perf_counter()
                with urllib.request.urlopen(request, timeout=600) as response:
                    answer = json.load(response)
                elapsed = time.perf_counter() - start
                assert answer["usage"]["completion_tokens"] >= 1, answer
                return elapsed

            offset = 2 * runs
            prefill = min(complete(prompts[offset + i], 1) for i in range(runs))
            decode = min(complete(prompts[offset + runs + i], 33) for i in range(runs)) - prefill
            return len(prompts[0]) / prefill, 32 / decode
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(2, 128000) for _ in range(args.prompt)] for _ in range(4 * args.runs)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llama-1b-bf16"
        save_checkpoint(path)
        hf_prefill, hf_decode = transformers_speed(path, prompts, args.runs)
        node_prefill, node_decode = node_speed(args.node, path, prompts, args.runs)
    print(f"prefill ({args.prompt} tokens): transformers {hf_prefill:.1f} tok/s, dynamo-node {node_prefill:.1f} tok/s, "
          f"ratio {node_prefill / hf_prefill:.2f}x")
    print(f"decode (batch 1, 32 tokens): transformers {hf_decode:.2f} tok/s, dynamo-node {node_decode:.2f} tok/s, "
          f"ratio {node_decode / hf_decode:.2f}x")


if __name__ == "__main__":
    main()
