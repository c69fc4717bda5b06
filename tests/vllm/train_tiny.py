"""Train the tiny model of make_tiny.py, for about a minute on two cores, to end its turns.

    python train_tiny.py DIR [--answer "Done."] [--steps 150]

Random weights never sample the end-of-turn token, so an agent CLI (which takes a ``max_tokens``
stop as an error) or an SDK session could never finish a turn against them. This trains the model
in DIR, in place, to answer every chat (rendered with the tiny chat template the tests write,
``<s><|role|>text</s>…<|assistant|>``, one turn or several, short or up to about 1,500 tokens)
with ``--answer`` and ``</s>``, then checks greedy decoding does that on chats it never saw.
Deterministic (seeded), CPU only, no network. Writes ``chat_template.jinja`` too.
"""

import argparse
import random
from pathlib import Path

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = ("read write file src test main config parse error token cache block route node engine session tool "
         "call result diff patch build run check lint format module import return value match loop").split()


def chat(rng: random.Random, answer: str) -> list[dict]:
    """A chat of one to four user turns (earlier ones answered with `answer`), of 1 to 300 words each."""
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 60)))})
    for turn in range(rng.randint(1, 4)):
        if turn:
            messages.append({"role": "assistant", "content": answer})
        words = rng.choices(WORDS, k=rng.choice([rng.randint(1, 12), rng.randint(12, 300)]))
        messages.append({"role": "user", "content": " ".join(words)})
    return messages


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--answer", default="Done.")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    (args.dir / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    tokenizer.chat_template = TEMPLATE
    model = LlamaForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
    answer = tokenizer.encode(args.answer, add_special_tokens=False) + [tokenizer.eos_token_id]

    def example(r: random.Random) -> tuple[list[int], int]:
        prompt = tokenizer.apply_chat_template(chat(r, args.answer), add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)[-1500:]
        return ids + answer, len(ids)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(args.steps):
        batch = [example(rng) for _ in range(8)]
        width = max(len(ids) for ids, _ in batch)
        inputs = torch.full((len(batch), width), tokenizer.eos_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, start) in enumerate(batch):
            inputs[row, : len(ids)] = torch.tensor(ids)
            labels[row, start : len(ids)] = torch.tensor(ids[start:])
            mask[row, : len(ids)] = 1
        loss = model(input_ids=inputs, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    check = random.Random(args.seed + 1)
    with torch.no_grad():
        for _ in range(8):
            ids, start = example(check)
            prompt = torch.tensor([ids[:start]])
            out = model.generate(prompt, max_new_tokens=len(answer) + 4, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            got = out[0, start:].tolist()
            if got != answer:
                raise SystemExit(f"after {args.steps} steps (loss {loss.item():.4f}) a chat got {got}, not {answer}")
    model.to(torch.bfloat16).save_pretrained(args.dir)
    print(f"trained {args.dir} to answer {args.answer!r} and end its turn (loss {loss.item():.4f})")


if __name__ == "__main__":
    main()
