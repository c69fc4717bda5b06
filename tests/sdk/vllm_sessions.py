"""Multi-turn sessions through the node in front of vLLM, with the official OpenAI and Anthropic SDKs.

Usage: vllm_sessions.py NODE_URL ENGINE_URL API_KEY ANSWER (URLs as http://HOST:PORT). The node
serves the tiny model trained by tests/vllm/train_tiny.py to answer ANSWER and end its turn, on
vLLM engines; ENGINE_URL is one of them, asked directly for the greedy reference. Checks that
every turn ends by itself (finish "stop", "end_turn", "completed") with ANSWER, that from the
second turn on each turn reads its prefix from cache (as each API reports it), and that greedy
output equals the engine's for the same chat. With a tool offered, the streamed Chat Completion
is a tool call (the model is trained to make one), and the turn after its result ends with ANSWER.
Exits non-zero on the first failed check; prints "ok" at the end.
"""

import json
import sys

import anthropic
import openai


def main() -> None:
    node, engine, key, answer = sys.argv[1:5]
    client = openai.OpenAI(base_url=f"{node}/v1", api_key=key, max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=f"{engine}/v1", api_key="unused", max_retries=0, timeout=120)
    system = "You are a coding agent. Answer briefly. " + " ".join(f"Rule {i}: keep files tidy." for i in range(12))

    # Chat Completions, streamed, three turns of one session.
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Read src/main.rs."}]
    for turn in range(3):
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=32, temperature=0, stream=True,
            stream_options={"include_usage": True}, user="sdk-chat")
        text, finish, usage = "", None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert (text, finish) == (answer, "stop"), (turn, text, finish)
        assert usage is not None and usage.completion_tokens >= 1, usage
        if turn:
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached >= 32, f"turn {turn} read {cached} of {usage.prompt_tokens} prompt tokens from cache"
        # Greedy output equals what the engine gives for the same chat, asked directly.
        reference = direct.chat.completions.create(model="tiny", messages=messages, max_tokens=32, temperature=0)
        assert reference.choices[0].message.content == text, (reference, text)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"Now run the tests, step {turn}."}]

    # Chat Completions with a tool, streamed: the model calls it (the node parses the Hermes call out
    # of the engine's tokens and streams it as tool-call deltas), then answers once it has the result.
    tools = [{"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Run the tests."}]
    stream = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=128, temperature=0, stream=True, user="sdk-tools")
    calls, text, finish = {}, "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls", (finish, text, calls)
    assert text.strip() == "", f"the call is not shown as text: {text!r}"
    assert list(calls) == [0] and calls[0]["name"] == "run_tests" and calls[0]["id"], calls
    assert json.loads(calls[0]["arguments"]) == {"path": "tests"}, calls
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": calls[0]["id"], "type": "function",
            "function": {"name": "run_tests", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12 passed"},
    ]
    done = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=32, temperature=0, user="sdk-tools")
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == (answer, "stop"), done
    assert done.usage.prompt_tokens_details.cached_tokens >= 32, done.usage

    # Responses, a second turn on previous_response_id (which does not carry instructions).
    first = client.responses.create(model="tiny", input="List the files in src.", instructions=system,
                                    max_output_tokens=32, temperature=0)
    assert first.status == "completed" and first.output_text == answer, first
    second = client.responses.create(model="tiny", input="And in tests?", previous_response_id=first.id,
                                     instructions=system, max_output_tokens=32, temperature=0)
    assert second.status == "completed" and second.output_text == answer, second
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 32, f"the second response read {cached} of {second.usage.input_tokens} tokens from cache"

    # Anthropic Messages, two turns (the SDK sends no sampling parameters of its own).
    claude = anthropic.Anthropic(base_url=node, api_key=key, max_retries=0, timeout=120)
    history = [{"role": "user", "content": "Fix the failing test."}]
    for turn in range(2):
        message = claude.messages.create(model="tiny", system=system, messages=history, max_tokens=32,
                                         extra_body={"temperature": 0})
        assert message.stop_reason == "end_turn", message
        assert [block.text for block in message.content if block.type == "text"] == [answer], message
        if turn:
            read = message.usage.cache_read_input_tokens or 0
            assert read >= 32, f"turn {turn} read {read} tokens from cache: {message.usage}"
        history += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Run it again."}]

    print("ok")


if __name__ == "__main__":
    main()
