"""An agent loop through the official Anthropic Python SDK against a dynamo-node whose engine is
scripted (the real model computes every token; the answer of turn N is the script's).

Usage: anthropic_agent_loop.py BASE_URL TURNS. Each turn the "model" thinks, says a line and calls
Read; the client sends the tool result back with a reminder, as Claude Code does. From turn 2 on,
the prompt must be read from the cache up to the previous prompt and its answer (less one block:
the answer's tokens are replayed, so only the tool result and the reminder are new). Prints one
line per turn and the mean share read from cache, then "ok".
"""

import sys

import anthropic


def main() -> None:
    base, turns = sys.argv[1], int(sys.argv[2])
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=00000;"},
        # About 7K tokens, as Claude Code's system prompt and tools are about 11K.
        {"type": "text", "text": "You are a coding agent. Read files before you edit them. " * 600},
    ]
    tools = [{"name": "Read", "description": "Read a file.", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    messages = [{"role": "user", "content": "Find the bug in the parser."}]
    previous_prompt, previous_output = None, 0
    shares = []
    for turn in range(turns):
        system[0]["text"] = f"x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={turn:05x};"
        message = client.messages.create(
            model="tiny", max_tokens=200, system=system, tools=tools, messages=messages,
            metadata={"user_id": "agent-loop-session"},
        )
        usage = message.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)
        share = usage.cache_read_input_tokens / prompt
        print(f"turn {turn}: {prompt} prompt tokens, {usage.cache_read_input_tokens} read from cache ({share:.1%}), stop {message.stop_reason}", file=sys.stderr)
        calls = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and len(calls) == 1, message
        assert calls[0].input == {"path": f"src/file_{turn}.rs"}, calls[0]
        if previous_prompt is not None:
            shares.append(share)
            assert usage.cache_read_input_tokens >= previous_prompt + previous_output - 32, (turn, usage, previous_prompt)
        previous_prompt, previous_output = prompt, usage.output_tokens
        messages = messages + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": f"fn parse_{turn}() {{ /* {turn} */ }}"},
                {"type": "text", "text": "<system-reminder>Keep going.</system-reminder>"},
            ]},
        ]
    print(f"turns 2..{turns}: mean share of the prompt read from cache {sum(shares) / len(shares):.1%}", file=sys.stderr)
    print("ok")


if __name__ == "__main__":
    main()
