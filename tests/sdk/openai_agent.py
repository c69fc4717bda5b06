"""Drives a dynamo-node frontend's agent paths with the official OpenAI Python SDK: Responses
(create, stream, stored responses, previous_response_id, function calls, errors) and Chat
Completions with tool calls.

Usage: openai_agent.py BASE_URL. The server is the fake generator of
tests/tests/support/frontend.rs with the qwen3 reasoning parser and the hermes tool-call parser:
model `agent` answers reasoning, "Let me look." and two tool calls (ls, cat); model `fake`
answers ANSWER. Exits non-zero on the first failed check; prints "ok" at the end.
"""

import json
import sys

import openai

ANSWER = "Hello, world! \U0001F980 done."
TOOLS = [
    {"type": "function", "name": "ls", "description": "List files", "parameters": {"type": "object"}},
    {"type": "function", "name": "cat", "description": "Show a file", "parameters": {"type": "object"}},
]


def responses(client: openai.OpenAI) -> None:
    # A plain answer, stored by default.
    plain = client.responses.create(model="fake", input="Say hello.", max_output_tokens=64)
    assert plain.status == "completed", plain
    assert plain.output_text == ANSWER, plain
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0, plain.usage
    assert plain.usage.input_tokens_details.cached_tokens == plain.usage.input_tokens // 2, plain.usage
    assert client.responses.retrieve(plain.id).output_text == ANSWER
    items = client.responses.input_items.list(plain.id)
    assert [i.type for i in items.data] == ["message"], items
    assert items.data[0].content[0].text == "Say hello.", items

    # Streamed: the SDK assembles the same response from the events.
    with client.responses.stream(model="fake", input="Say hello.", max_output_tokens=64) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == ANSWER, deltas
    assert final.output_text == ANSWER and final.status == "completed", final
    assert [o.type for o in final.output] == [o.type for o in plain.output], final

    # A length stop is incomplete.
    cut = client.responses.create(model="fake", input="Say hello.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut

    # An agent turn: reasoning, a message, two function calls; then the tool outputs through
    # previous_response_id.
    first = client.responses.create(model="agent", instructions="You are a coding agent.", input="Look.", tools=TOOLS)
    types = [o.type for o in first.output]
    assert types == ["reasoning", "message", "function_call", "function_call"], types
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls[0].name == "ls" and json.loads(calls[0].arguments) == {"path": "."}, calls
    assert calls[1].name == "cat" and json.loads(calls[1].arguments) == {"file": "a.rs", "lines": [1, 20]}, calls
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "a.rs"} for c in calls]
    second = client.responses.create(model="agent", previous_response_id=first.id, input=outputs, tools=TOOLS)
    assert second.previous_response_id == first.id, second
    assert second.usage.input_tokens > first.usage.input_tokens, (first.usage, second.usage)

    # Streamed function calls carry their arguments.
    with client.responses.stream(model="agent", input="Look.", tools=TOOLS, store=False) as stream:
        arguments = [e.arguments for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert [json.loads(a) for a in arguments] == [{"path": "."}, {"file": "a.rs", "lines": [1, 20]}], arguments
    assert [o.type for o in final.output][-2:] == ["function_call", "function_call"], final

    # Deleting, and the errors.
    client.responses.delete(first.id)
    try:
        client.responses.retrieve(first.id)
        raise AssertionError("a deleted response was found")
    except openai.NotFoundError as e:
        assert e.status_code == 404, e
    try:
        client.responses.create(model="agent", previous_response_id="resp_missing", input="x")
        raise AssertionError("an unknown previous response was accepted")
    except openai.NotFoundError as e:
        assert e.code == "previous_response_not_found", e
    try:
        client.responses.create(model="agent", previous_response_id=second.id, input="x", store=False)
        raise AssertionError("store: false with previous_response_id was accepted")
    except openai.BadRequestError as e:
        assert e.param == "previous_response_id", e
    try:
        client.responses.create(model="no-such-model", input="x")
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e


def chat_tools(client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    messages = [{"role": "user", "content": "Look."}]
    chat = client.chat.completions.create(model="agent", messages=messages, tools=tools)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["ls", "cat"], calls
    assert json.loads(calls[1].function.arguments) == {"file": "a.rs", "lines": [1, 20]}, calls
    assert choice.message.content == "Let me look.", choice.message

    stream = client.chat.completions.create(model="agent", messages=messages, tools=tools, stream=True)
    streamed = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for call in c.delta.tool_calls or []:
                entry = streamed.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert finish == "tool_calls", finish
    assert [streamed[i]["name"] for i in sorted(streamed)] == ["ls", "cat"], streamed
    assert streamed[1]["arguments"] == calls[1].function.arguments, streamed

    # tool_choice "none" offers no tools; a named tool that does not exist is a 400.
    client.chat.completions.create(model="agent", messages=messages, tools=tools, tool_choice="none")
    try:
        client.chat.completions.create(
            model="agent", messages=messages, tools=tools, tool_choice={"type": "function", "function": {"name": "rm"}}
        )
        raise AssertionError("an unknown named tool was accepted")
    except openai.BadRequestError as e:
        assert e.param == "tool_choice", e


def main() -> None:
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=30)
    responses(client)
    chat_tools(client)
    print("ok")


if __name__ == "__main__":
    main()
