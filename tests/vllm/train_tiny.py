"""Train the tiny model of make_tiny.py, for about two minutes on two cores, to end its turns and call a tool.

    python train_tiny.py DIR [--answer "Done."] [--steps 240]

Random weights never sample the end-of-turn token, so an agent CLI (which takes a ``max_tokens``
stop as an error) or an SDK session could never finish a turn against them, nor call a tool. This
trains the model in DIR, in place, on chats rendered with the tiny chat template the tests write
(``<s>[<|tools|>names</s>]<|role|>text</s>…<|assistant|>[<|call|>]``, one turn or several, short
or up to about 1,500 tokens):
- a chat that offers tools and ends with a user turn is answered with a Hermes tool call,
  ``<tool_call>{"name": "run_tests", "arguments": {"path": "tests"}}</tool_call>``, then ``</s>``;
- any other chat (no tools, or one that ends with the tool's result) with ``--answer`` and ``</s>``.
The template itself marks the turns that call (``<|call|>``: tools offered, a user spoke last), so
that so small a model learns it in seconds. Then it checks greedy decoding does that on chats it
never saw. Deterministic (seeded), CPU only,
no network. Writes ``chat_template.jinja`` too.
"""

import argparse
import random
import string
from pathlib import Path

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
    "{{ eos_token }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if tools and messages[-1]['role'] == 'user' %}<|call|>{% endif %}"
    "{% endif %}"
)
# The tool call the model makes whenever tools are offered and a user spoke last (Hermes format).
TOOL_CALL = '<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests"}}\n</tool_call>'
TOOLS = ("run_tests", "read_file", "write_file", "list_dir", "grep", "format")
WORDS = ("read write file src test main config parse error token cache block route node engine session tool "
         "call result diff patch build run check lint format module import return value match loop").split()


def words(rng: random.Random, k: int) -> str:
    """`k` words: mostly from WORDS, some capitalized or numbered, some of random printable characters,
    so that what a real client sends (paths, rules, numbers, punctuation) is not new to the model."""
    out = []
    for _ in range(k):
        roll = rng.random()
        if roll < 0.7:
            word = rng.choice(WORDS)
        elif roll < 0.8:
            word = rng.choice(WORDS).capitalize() + rng.choice(["", ".", ",", ":", "?", "!"])
        elif roll < 0.9:
            word = str(rng.randint(0, 999)) + rng.choice(["", ".", ":", ")"])
        else:
            word = "".join(rng.choices(string.ascii_letters + string.digits + string.punctuation, k=rng.randint(1, 8)))
        out.append(word)
    return " ".join(out)


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def chat(rng: random.Random, answer: str) -> tuple[list[dict], list[dict] | None, str]:
    """A chat of one to four user turns of 1 to 300 words each, with tools offered half the time, and
    what the model is to answer. Earlier turns were answered with `answer`, or (with tools) by the
    tool call and its result; with tools, a quarter of the chats end with the tool's result."""
    tools = [tool(t) for t in rng.sample(TOOLS, rng.randint(1, 4))] if rng.random() < 0.5 else None
    if tools and all(t["function"]["name"] != "run_tests" for t in tools):
        tools.append(tool("run_tests"))
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]}
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": words(rng, rng.randint(1, 60))})
    for turn in range(rng.randint(1, 4)):
        if turn:
            if tools:
                messages += [called, {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
                             {"role": "assistant", "content": answer}]
            else:
                messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": words(rng, rng.choice([rng.randint(1, 12), rng.randint(12, 300)]))})
    if tools and rng.random() < 0.25:
        result = words(rng, rng.randint(1, 40))
        messages += [called, {"role": "tool", "tool_call_id": "call_0", "content": result}]
        return messages, tools, answer
    return messages, tools, TOOL_CALL if tools else answer


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--answer", default="Done.")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    (args.dir / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    tokenizer.chat_template = TEMPLATE
    model = LlamaForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
    def example(r: random.Random) -> tuple[list[int], int]:
        messages, tools, reply = chat(r, args.answer)
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        # Long chats lose their middle, never their start (where the tools are) or their end.
        if len(ids) > 1500:
            ids = ids[:100] + ids[-1400:]
        answer = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
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
    # Checked as it is saved and served: in bf16.
    model.eval()
    model.to(torch.bfloat16)

    check = random.Random(args.seed + 1)
    wrong = []
    with torch.no_grad():
        for _ in range(16):
            ids, start = example(check)
            answer = ids[start:]
            prompt = torch.tensor([ids[:start]])
            out = model.generate(prompt, max_new_tokens=len(answer) + 4, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            got = out[0, start:].tolist()
            if got != answer:
                wrong.append(f"{start} tokens: {tokenizer.decode(got)!r}, not {tokenizer.decode(answer)!r}")
    if wrong:
        raise SystemExit(f"after {args.steps} steps (loss {loss.item():.4f}), {len(wrong)} of 16 chats got\n"
                         + "\n".join(wrong))
    model.save_pretrained(args.dir)
    print(f"trained {args.dir} to answer {args.answer!r} or call a tool, and end its turn "
          f"(loss {loss.item():.4f})")


if __name__ == "__main__":
    main()
