"""Drives a dynamo-node frontend with the official Anthropic Python SDK.

Usage: anthropic_client.py BASE_URL (e.g. http://127.0.0.1:8000, without /v1). The server is the
fake generator of tests/tests/support/frontend.rs with the qwen3 reasoning and hermes tool-call
parsers: the `agent` model thinks, says a sentence and calls two tools; it reports half of the
prompt as cached. Exits non-zero (with a traceback) on the first failed check; prints "ok" at
the end.
"""

import sys

import anthropic

SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"},
    {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
]
# Small: the fake's context is 256 tokens.
TOOLS = [
    {"name": "ls", "input_schema": {"type": "object"}},
    {"name": "cat", "input_schema": {"type": "object"}},
]


def main() -> None:
    client = anthropic.Anthropic(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "List the repository."}]

    # Non-streaming: thinking, text, two tool uses, in that order.
    message = client.messages.create(model="agent", max_tokens=300, system=SYSTEM, tools=TOOLS, messages=messages)
    assert message.model == "agent", message
    assert message.stop_reason == "tool_use", message
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"], kinds
    assert message.content[0].thinking.strip() == "List the files first.", message.content[0]
    assert message.content[0].signature, "a thinking block has a signature"
    assert message.content[2].name == "ls" and message.content[2].input == {"path": "."}, message.content[2]
    usage = message.usage
    total = usage.input_tokens + usage.cache_read_input_tokens + (usage.cache_creation_input_tokens or 0)
    assert usage.cache_read_input_tokens == total // 2, usage
    assert usage.output_tokens > 0, usage

    # count_tokens is the same lowering: the same total.
    counted = client.messages.count_tokens(model="agent", system=SYSTEM, tools=TOOLS, messages=messages)
    assert counted.input_tokens == total, (counted, usage)

    # Streaming: the SDK's own accumulator checks the event grammar; the final message is the
    # non-streamed one.
    with client.messages.stream(model="agent", max_tokens=300, system=SYSTEM, tools=TOOLS, messages=messages) as stream:
        texts = [event.text for event in stream if event.type == "text"]
        final = stream.get_final_message()
    assert "".join(texts) == message.content[1].text, texts
    def without_ids(blocks):
        return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]

    assert without_ids(final.content) == without_ids(message.content), final
    assert final.stop_reason == "tool_use", final
    assert final.usage.cache_read_input_tokens == usage.cache_read_input_tokens, final.usage

    # The tool loop's next turn: the assistant turn echoed back, tool results with a reminder.
    follow_up = messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": message.content[2].id, "content": "a.rs b.rs"},
                {"type": "tool_result", "tool_use_id": message.content[3].id, "content": [{"type": "text", "text": "fn main() {}"}]},
                {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
            ],
        },
    ]
    # (Without the tool definitions: the fake's context is 256 tokens.)
    second = client.messages.create(model="agent", max_tokens=20, system=SYSTEM, messages=follow_up, extra_body={"temperature": 0})
    assert second.stop_reason == "max_tokens", second
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens > total, second.usage

    # Errors in Anthropic's shape, as the SDK's own exception types.
    try:
        client.messages.create(model="no-such-model", max_tokens=10, messages=messages)
        raise AssertionError("an unknown model was accepted")
    except anthropic.NotFoundError as e:
        assert e.status_code == 404 and e.body["error"]["type"] == "not_found_error", e.body
    try:
        client.messages.create(model="overloaded", max_tokens=10, messages=messages)
        raise AssertionError("an overloaded model was accepted")
    except anthropic.APIStatusError as e:
        assert e.status_code == 529 and e.body["error"]["type"] == "overloaded_error", e.body

    print("ok")


if __name__ == "__main__":
    main()
