"""Drives a dynamo-node frontend with the official OpenAI Python SDK.

Usage: openai_client.py BASE_URL (e.g. http://127.0.0.1:8000/v1). The server is the fake generator
of tests/tests/support/frontend.rs: it answers ANSWER and reports half of the prompt as cached.
Exits non-zero (with a traceback) on the first failed check; prints "ok" at the end.
"""

import sys

import openai

ANSWER = "Hello, world! \U0001F980 done."


def main() -> None:
    client = openai.OpenAI(base_url=sys.argv[1], api_key="unused", max_retries=0, timeout=30)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]

    # Non-streaming chat.
    chat = client.chat.completions.create(model="fake", messages=messages, max_tokens=64, temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant", chat
    assert chat.choices[0].message.content == ANSWER, chat
    assert chat.choices[0].finish_reason == "stop", chat
    usage = chat.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 2, usage

    # Streaming chat with usage.
    stream = client.chat.completions.create(
        model="fake",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"nvext": {"priority": 1}},
        extra_headers={"x-session-id": "sdk-session"},
    )
    text, finish, stream_usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            stream_usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == ANSWER, text
    assert finish == "stop", finish
    assert stream_usage is not None, "no usage chunk"
    assert stream_usage.prompt_tokens == usage.prompt_tokens, stream_usage
    assert stream_usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 2, stream_usage

    # Legacy completion, cut by max_tokens.
    completion = client.completions.create(model="fake", prompt="Once upon a time", max_tokens=2)
    assert completion.choices[0].finish_reason == "length", completion
    assert completion.usage.completion_tokens == 2, completion
    assert ANSWER.startswith(completion.choices[0].text), completion

    # Models.
    ids = [m.id for m in client.models.list()]
    assert "fake" in ids, ids

    # Errors.
    try:
        client.chat.completions.create(model="fake", messages=[])
        raise AssertionError("empty messages were accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and "at least one message" in str(e), e
    try:
        client.chat.completions.create(model="no-such-model", messages=messages)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.code == "model_not_found", e
    try:
        client.chat.completions.create(model="overloaded", messages=messages)
        raise AssertionError("an overloaded server answered")
    except openai.RateLimitError as e:
        assert e.response.headers["retry-after"] == "3", e.response.headers

    print("ok")


if __name__ == "__main__":
    main()
