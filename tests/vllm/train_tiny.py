"""Train the tiny model of make_tiny.py, for about two minutes on two cores, to end its turns and call a tool.

    python train_tiny.py DIR [--answer "Done."] [--steps 240] [--long-check 16384]

Random weights never sample the end-of-turn token, so an agent CLI (which takes a ``max_tokens``
stop as an error) or an SDK session could never finish a turn against them, nor call a tool. This
trains the model in DIR, in place, on chats rendered with the tiny chat template the tests write
(``<s>[<|tools|>names</s>]<|role|>text</s>…<|assistant|>[<|call|>]``, one turn or several):
- a chat that offers the tool ``run_tests`` and ends with a user turn is answered with a Hermes
  tool call, ``<tool_call>{"name": "run_tests", "arguments": {"path": "tests"}}</tool_call>``,
  then ``</s>``;
- any other chat (no tools, other tools only, as an agent CLI offers, or one that ends with the
  tool's result) with ``--answer`` and ``</s>``.
The template itself marks the turns that call (``<|call|>``: ``run_tests`` offered, a user spoke last), so
that so small a model learns it in seconds. Two of every three steps train on a batch of short
chats (up to about 1,500 tokens, half of them skipping ahead in their positions, up to
``--positions``), the third on one agent-sized chat: a system prompt of up to ``--long-check``
tokens before the turns, as an agent CLI's prompt has. Then it checks greedy decoding does all
that on chats it never saw, agent-sized ones included. Deterministic (seeded), CPU only, no
network. Writes ``chat_template.jinja`` too.
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
    "{% if add_generation_prompt %}<|assistant|>{% set ns = namespace(call=false) %}"
    "{% for t in tools or [] %}{% if t['function']['name'] == 'run_tests' %}{% set ns.call = true %}{% endif %}{% endfor %}"
    "{% if ns.call and messages[-1]['role'] == 'user' %}<|call|>{% endif %}{% endif %}"
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
    """A chat of one to four user turns of 1 to 300 words each, with tools offered half the time
    (`run_tests` among them in most), and what the model is to answer. Earlier turns were answered
    with `answer`, or (with `run_tests`) by its call and its result; with `run_tests`, a quarter of
    the chats end with the tool's result."""
    tools = [tool(t) for t in rng.sample(TOOLS, rng.randint(1, 4))] if rng.random() < 0.5 else None
    calls = tools is not None and rng.random() < 0.7
    if tools and calls and all(t["function"]["name"] != "run_tests" for t in tools):
        tools.append(tool("run_tests"))
    if tools and not calls:
        tools = [t for t in tools if t["function"]["name"] != "run_tests"] or [tool("grep")]
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}]}
    messages = []
    if rng.random() < 0.5:
        # Responses clients (Codex) send their instructions as a developer's.
        role = "developer" if rng.random() < 0.3 else "system"
        messages.append({"role": role, "content": words(rng, rng.randint(1, 60))})
    for turn in range(rng.randint(1, 4)):
        if turn:
            if calls:
                messages += [called, {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
                             {"role": "assistant", "content": answer}]
            else:
                messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": words(rng, rng.choice([rng.randint(1, 12), rng.randint(12, 300)]))})
    if calls and rng.random() < 0.25:
        result = words(rng, rng.randint(1, 40))
        messages += [called, {"role": "tool", "tool_call_id": "call_0", "content": result}]
        return messages, tools, answer
    return messages, tools, TOOL_CALL if calls else answer


def main() -> None:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--answer", default="Done.")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--positions", type=int, default=32768,
                        help="the context it must answer in (at most the model's max_position_embeddings)")
    parser.add_argument("--long-check", type=int, default=16384,
                        help="tokens of the agent-sized chats it is checked on (0: none)")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    (args.dir / "chat_template.jinja").write_text(TEMPLATE)
    tokenizer = AutoTokenizer.from_pretrained(args.dir)
    tokenizer.chat_template = TEMPLATE
    model = LlamaForCausalLM.from_pretrained(args.dir, dtype=torch.float32)
    def example(r: random.Random) -> tuple[list[int], int, list[int]]:
        """A chat's token ids with its answer, where the answer starts, and each token's position."""
        messages, tools, reply = chat(r, args.answer)
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        positions = list(range(len(ids) + len(answer)))
        # Long chats lose their middle, never their start (where the tools are) or their end; the
        # end keeps the positions it had.
        if len(ids) > 1500:
            cut = len(ids) - 1500
            ids = ids[:100] + ids[-1400:]
            positions = positions[:100] + positions[100 + cut :]
        # Half the chats skip ahead by up to --positions at a random point: an agent's prompt (tens
        # of thousands of tokens of system prompt and tools) puts its last turns that far from its
        # start, and the model must answer there as it does here.
        if r.random() < 0.5 and len(ids) > 2:
            skip = r.randint(1, max(1, args.positions - len(positions) - 1))
            at = r.randint(1, len(ids) - 1)
            positions = positions[:at] + [p + skip for p in positions[at:]]
        return ids + answer, len(ids), positions

    def agent_example(r: random.Random) -> tuple[list[int], int, list[int]]:
        """An agent's chat: a system prompt of 1,000 to --long-check tokens before the turns (what an
        agent CLI sends), so that the model answers as well with that many tokens before it."""
        messages, tools, reply = chat(r, args.answer)
        if messages[0]["role"] not in ("system", "developer"):
            messages.insert(0, {"role": "system", "content": ""})
        target, text = r.randint(1000, max(1000, args.long_check)), []
        while target > 0:
            chunk = words(r, 200)
            text.append(chunk)
            target -= len(chunk)  # about a token per character
        messages[0]["content"] = " ".join(text)
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        return ids + answer, len(ids), list(range(len(ids) + len(answer)))

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(args.steps):
        if step % 3 == 2 and args.long_check:
            # One long chat alone: no padding, so attention needs no mask and runs in linear memory.
            ids, start, _ = agent_example(rng)
            labels = torch.full((1, len(ids)), -100)
            labels[0, start:] = torch.tensor(ids[start:])
            loss = model(input_ids=torch.tensor([ids]), labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            continue
        batch = [example(rng) for _ in range(8)]
        width = max(len(ids) for ids, _, _ in batch)
        inputs = torch.full((len(batch), width), tokenizer.eos_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        position_ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, start, positions) in enumerate(batch):
            inputs[row, : len(ids)] = torch.tensor(ids)
            labels[row, start : len(ids)] = torch.tensor(ids[start:])
            mask[row, : len(ids)] = 1
            position_ids[row, : len(ids)] = torch.tensor(positions)
        loss = model(input_ids=inputs, attention_mask=mask, position_ids=position_ids, labels=labels).loss
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
            ids, start, _ = example(check)
            answer = ids[start:]
            prompt = torch.tensor([ids[:start]])
            out = model.generate(prompt, max_new_tokens=len(answer) + 4, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            got = out[0, start:].tolist()
            if got != answer:
                wrong.append(f"{start} tokens: {tokenizer.decode(got)!r}, not {tokenizer.decode(answer)!r}")
        # An agent's turns: a long system prompt, tools, a user's ask (a call), then the tool's result
        # (the answer), as long as --long-check tokens.
        for tools, tail, reply in () if not args.long_check else (([tool(t) for t in TOOLS], [], TOOL_CALL),
                                   ([tool(t) for t in TOOLS], [{"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c", "type": "function",
                                        "function": {"name": "run_tests", "arguments": "{}"}}]},
                                       {"role": "tool", "tool_call_id": "c", "content": "No such tool."}], args.answer),
                                   ([tool(t) for t in TOOLS if t != "run_tests"], [], args.answer)):
            messages = [{"role": "system", "content": ""}, {"role": "user", "content": words(check, 12)}] + tail
            filler = len(tokenizer.encode(tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False), add_special_tokens=False))
            system = []
            while filler < args.long_check:
                chunk = words(check, 200)
                system.append(chunk)
                filler += len(tokenizer.encode(" " + chunk, add_special_tokens=False))
            messages[0]["content"] = " ".join(system)
            prompt = tokenizer.encode(tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
            answer = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(answer) + 4, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
            got = out[0, len(prompt):].tolist()
            if got != answer:
                wrong.append(f"{len(prompt)} tokens: {tokenizer.decode(got)!r}, not {tokenizer.decode(answer)!r}")
    if wrong:
        raise SystemExit(f"after {args.steps} steps (loss {loss.item():.4f}), {len(wrong)} of 19 chats got\n"
                         + "\n".join(wrong))
    model.save_pretrained(args.dir)
    print(f"trained {args.dir} to answer {args.answer!r} or call a tool, and end its turn "
          f"(loss {loss.item():.4f})")


if __name__ == "__main__":
    main()
