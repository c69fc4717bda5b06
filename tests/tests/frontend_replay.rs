//! Token identity across turns through every API, over real HTTP: turn N's prompt plus the
//! tokens generated for it is a token prefix of turn N+1's prompt when the client echoes the
//! answer the way that API's clients do (reasoning and all, or without it, or only as a handle),
//! followed by tool results with a reminder beside them. With replay off, the built-in template's
//! re-rendering of the same answer is not the generated tokens, and the prefix breaks at that
//! turn: the test shows both.

#[path = "support/frontend.rs"]
mod support;

use dynamo_config::FrontendSection;
use dynamo_node::tokenizer::Tokenizer;
use serde_json::{Value, json};
use support::{AGENT_ANSWER, Server};

fn config(replay: bool) -> FrontendSection {
    FrontendSection {
        reasoning_parser: Some("qwen3".into()),
        tool_call_parser: Some("hermes".into()),
        replay_tokens: if replay { 1 << 20 } else { 0 },
        ..FrontendSection::default()
    }
}

async fn post(server: &Server, path: &str, body: &Value) -> Value {
    let response = reqwest::Client::new()
        .post(server.url(path))
        .header("x-session-id", "replay-test")
        .json(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let value: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{value}");
    value
}

/// Whether `after` starts with `before` followed by the agent's generated tokens.
fn continues(before: &[u32], after: &[u32]) -> bool {
    let mut expected = before.to_vec();
    expected.extend(Tokenizer::builtin().encode(AGENT_ANSWER).unwrap());
    after.len() > expected.len() && after[..expected.len()] == expected[..]
}

const TOOLS: &str = r#"[{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]"#;

/// Chat Completions: the assistant message echoed with `reasoning_content`, and without it (what
/// most clients send back); then tool messages and a user reminder.
async fn chat(replay: bool, echo_reasoning: bool) -> bool {
    let server = Server::start(config(replay)).await;
    let tools: Value = serde_json::from_str(TOOLS).unwrap();
    let mut messages =
        vec![json!({"role": "system", "content": "Be brief."}), json!({"role": "user", "content": "Look."})];
    let first =
        post(&server, "/v1/chat/completions", &json!({"model": "agent", "messages": messages, "tools": tools})).await;
    let before = server.fake.last().prompt;
    let mut message = first["choices"][0]["message"].clone();
    if !echo_reasoning {
        message.as_object_mut().unwrap().remove("reasoning_content");
    }
    for call in message["tool_calls"].as_array().unwrap().clone() {
        messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "a.rs"}));
    }
    messages.insert(2, message);
    post(&server, "/v1/chat/completions", &json!({"model": "agent", "messages": messages, "tools": tools})).await;
    continues(&before, &server.fake.last().prompt)
}

/// Anthropic Messages: the content blocks echoed (thinking with its signature, or with the text
/// omitted as `display: "omitted"` leaves it), then tool results with a `<system-reminder>`.
async fn messages(replay: bool, omit_thinking: bool) -> bool {
    let server = Server::start(config(replay)).await;
    let tools = json!([{"name": "ls", "input_schema": {"type": "object"}}]);
    let mut body = json!({"model": "agent", "max_tokens": 100, "system": "Be brief.", "tools": tools,
                          "messages": [{"role": "user", "content": "Look."}]});
    if omit_thinking {
        body["thinking"] = json!({"type": "adaptive", "display": "omitted"});
    }
    let first = post(&server, "/v1/messages", &body).await;
    let before = server.fake.last().prompt;
    let content = first["content"].clone();
    if omit_thinking {
        assert_eq!(content[0]["thinking"], "", "display: omitted sends no reasoning text");
        assert!(content[0]["signature"].as_str().unwrap().starts_with("dn1."));
    }
    let mut results: Vec<Value> = content
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .map(|b| json!({"type": "tool_result", "tool_use_id": b["id"], "content": "a.rs"}))
        .collect();
    results.push(json!({"type": "text", "text": "<system-reminder>Stay on task.</system-reminder>"}));
    let messages = body["messages"].as_array_mut().unwrap();
    messages.push(json!({"role": "assistant", "content": content}));
    messages.push(json!({"role": "user", "content": results}));
    post(&server, "/v1/messages", &body).await;
    continues(&before, &server.fake.last().prompt)
}

/// OpenAI Responses, stateless as Codex is: the output items echoed with their
/// `encrypted_content` (and no reasoning text), then the function call outputs.
async fn responses(replay: bool) -> bool {
    let server = Server::start(config(replay)).await;
    let tools = json!([{"type": "function", "name": "ls", "parameters": {"type": "object"}}]);
    let mut input =
        vec![json!({"role": "developer", "content": "Be brief."}), json!({"role": "user", "content": "Look."})];
    let body = |input: &[Value]| {
        json!({"model": "agent", "input": input, "tools": tools, "store": false,
               "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1"})
    };
    let first = post(&server, "/v1/responses", &body(&input)).await;
    let before = server.fake.last().prompt;
    for item in first["output"].as_array().unwrap() {
        let mut item = item.clone();
        if item["type"] == "reasoning" {
            item["content"] = json!([]);
        }
        input.push(item);
    }
    for item in first["output"].as_array().unwrap().iter().filter(|i| i["type"] == "function_call") {
        input.push(json!({"type": "function_call_output", "call_id": item["call_id"], "output": "a.rs"}));
    }
    post(&server, "/v1/responses", &body(&input)).await;
    continues(&before, &server.fake.last().prompt)
}

#[tokio::test]
async fn chat_completions_turns_continue_token_for_token() {
    assert!(chat(true, true).await, "reasoning echoed");
    assert!(chat(true, false).await, "reasoning dropped by the client: restored from the kept turn");
    assert!(!chat(false, true).await, "without replay the re-rendered turn differs from the generated tokens");
}

#[tokio::test]
async fn messages_turns_continue_token_for_token() {
    assert!(messages(true, false).await, "thinking echoed with its signature");
    assert!(messages(true, true).await, "display: omitted, only the signature comes back");
    assert!(!messages(false, false).await, "without replay the re-rendered turn differs");
}

#[tokio::test]
async fn stateless_responses_turns_continue_token_for_token() {
    assert!(responses(true).await, "reasoning items come back as encrypted_content only");
    assert!(!responses(false).await, "without replay the re-rendered turn differs");
}

/// Turns are kept per session: another session's identical answer is not replayed into this one,
/// and a reasoning text the client changed is not the kept turn.
#[tokio::test]
async fn replay_needs_the_same_session_and_the_same_reasoning() {
    let server = Server::start(config(true)).await;
    let tools: Value = serde_json::from_str(TOOLS).unwrap();
    let mut messages = vec![json!({"role": "user", "content": "Look."})];
    let first =
        post(&server, "/v1/chat/completions", &json!({"model": "agent", "messages": messages, "tools": tools})).await;
    let before = server.fake.last().prompt;
    let mut message = first["choices"][0]["message"].clone();
    messages.push(message.clone());
    messages.push(json!({"role": "tool", "tool_call_id": "x", "content": "a.rs"}));
    let body = json!({"model": "agent", "messages": messages, "tools": tools});
    let other = reqwest::Client::new()
        .post(server.url("/v1/chat/completions"))
        .header("x-session-id", "someone-else")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 200);
    assert!(!continues(&before, &server.fake.last().prompt), "another session's turn is not spliced");
    message["reasoning_content"] = json!("A different plan.");
    messages[1] = message;
    post(&server, "/v1/chat/completions", &json!({"model": "agent", "messages": messages, "tools": tools})).await;
    assert!(!continues(&before, &server.fake.last().prompt), "a changed reasoning is not the kept turn");
}

/// Without a session, turns are matched by content alone, so a kept turn's reasoning is restored
/// only for a client that sent it back (its text or its handle): one that dropped it gets the
/// template's rendering.
#[tokio::test]
async fn without_a_session_reasoning_is_restored_only_when_echoed() {
    let server = Server::start(config(true)).await;
    let tools: Value = serde_json::from_str(TOOLS).unwrap();
    let send = |body: Value| {
        let url = server.url("/v1/chat/completions");
        async move {
            let response = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
            assert_eq!(response.status(), 200);
            response.json::<Value>().await.unwrap()
        }
    };
    let mut messages = vec![json!({"role": "user", "content": "Look."})];
    let first = send(json!({"model": "agent", "messages": messages, "tools": tools})).await;
    let before = server.fake.last().prompt;
    let message = first["choices"][0]["message"].clone();
    let mut dropped = message.clone();
    dropped.as_object_mut().unwrap().remove("reasoning_content");
    messages.push(dropped);
    messages.push(json!({"role": "tool", "tool_call_id": "x", "content": "a.rs"}));
    send(json!({"model": "agent", "messages": messages, "tools": tools})).await;
    assert!(!continues(&before, &server.fake.last().prompt), "another client's reasoning is not restored");
    messages[1] = message;
    send(json!({"model": "agent", "messages": messages, "tools": tools})).await;
    assert!(continues(&before, &server.fake.last().prompt), "echoed with its reasoning, the turn is replayed");
}
