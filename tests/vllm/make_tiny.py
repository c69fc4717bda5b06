"""Generate a tiny random Llama for vLLM tests, locally and deterministically.

    python make_tiny.py DIR [--seed 0]

Writes to DIR: a byte-level BPE tokenizer trained on synthetic text
(``PreTrainedTokenizerFast``; the chat markers ``<|role|>`` are special tokens,
the Hermes tags ``<tool_call>`` and ``</tool_call>`` plain added ones), a
random bf16 ``LlamaForCausalLM`` (vocabulary 512, hidden 64, 2 layers, 2 heads
of 32: vLLM's CPU attention needs a head size of at least 32; 32,768
positions, for an agent CLI's prompt), and ``prompt.json``, a 600-token prompt
(several of the CPU backend's 128-token blocks) as a JSON list of token ids.
No network.
"""

import argparse
import json
import random
from pathlib import Path

VOCAB_SIZE = 512
# The chat template's markers (train_tiny.py's, and the tests' plain one): one special token each,
# as a real model's `<|im_start|>` is, so that the model reads a turn's role from one token.
MARKERS = ["<|system|>", "<|developer|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|tools|>", "<|call|>"]
# Hermes tool-call tags: one token each but not special, as in Qwen's vocabulary, so that an
# answer's text keeps them.
TOOL_TAGS = ["<tool_call>", "</tool_call>"]
# The call train_tiny.py teaches, among the tokenizer's training text: its pieces get merges.
TOOL_CALL_JSON = '{"name": "run_tests", "arguments": {"path": "tests"}}'
PROMPT_TOKENS = 600
SYLLABLES = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "ve", "do", "za", "qu", "ish", "orn"]


def synthetic_lines(rng: random.Random, count: int) -> list[str]:
    """Sentences of made-up words, enough for the BPE to learn merges."""
    words = ["".join(rng.choices(SYLLABLES, k=rng.randint(1, 4))) for _ in range(300)]
    return [
        " ".join(rng.choices(words, k=rng.randint(6, 20))).capitalize() + "."
        for _ in range(count)
    ]


def make_tokenizer(lines: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TAGS),
        special_tokens=["<s>", "</s>", "<unk>", *MARKERS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines + [TOOL_CALL_JSON] * 200, trainer=trainer)
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in TOOL_TAGS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=MARKERS,
    )


def make_model(seed: int, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def make_prompt(rng: random.Random, tokenizer) -> list[int]:
    """PROMPT_TOKENS token ids of fresh synthetic text."""
    ids: list[int] = []
    while len(ids) < PROMPT_TOKENS:
        ids += tokenizer.encode(" ".join(synthetic_lines(rng, 20)), add_special_tokens=False)
    return ids[:PROMPT_TOKENS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    tokenizer = make_tokenizer(synthetic_lines(rng, 500))
    model = make_model(args.seed, tokenizer)
    args.dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.dir)
    model.save_pretrained(args.dir)
    (args.dir / "prompt.json").write_text(json.dumps(make_prompt(rng, tokenizer)))
    print(f"wrote {args.dir}: {sum(p.numel() for p in model.parameters())} parameters")


if __name__ == "__main__":
    main()
