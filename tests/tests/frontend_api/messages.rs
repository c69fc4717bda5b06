//! Anthropic Messages over the same server (Claude Code's requests, the billing header, streaming
//! grammar, tool use, cache breakpoints as leases), the Responses store's bounds, and tool-call
//! parsing at its edges.

use super::*;

fn agent_server_config(strip: bool) -> FrontendSection {
    FrontendSection {
        reasoning_parser: Some("qwen3".into()),
        tool_call_parser: Some("hermes".into()),
        strip_anthropic_preamble: strip,
        ..FrontendSection::default()
    }
}

/// A Claude-Code-shaped Messages request: the billing header as its own system block.
fn claude_request(cch: &str, stream: bool) -> Value {
    json!({
        "model": "agent",
        "max_tokens": 200,
        "stream": stream,
        "system": [
            {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch={cch};")},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "List the repository."}]}],
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}, {"name": "cat", "input_schema": {"type": "object"}}],
    })
}

/// Anthropic Messages: blocks in generation order (thinking with a signature, text, tool uses
/// with parsed input), `stop_reason: tool_use`, the model echoed, usage split as Anthropic does,
/// and `count_tokens` giving the same total.
#[tokio::test]
async fn anthropic_messages_answer_in_its_shape() {
    let server = Server::start(agent_server_config(true)).await;
    let (status, headers, value) = post(&server, "/v1/messages?beta=true", &claude_request("fa690", false)).await;
    assert_eq!(status, 200, "{value}");
    assert_eq!(headers["content-type"], "application/json");
    assert_eq!(value["type"], "message");
    assert_eq!(value["role"], "assistant");
    assert_eq!(value["model"], "agent");
    assert!(value["id"].as_str().unwrap().starts_with("msg_"), "{value}");
    assert_eq!(value["stop_reason"], "tool_use");
    let content = value["content"].as_array().expect("content");
    let kinds: Vec<&str> = content.iter().map(|b| b["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["thinking", "text", "tool_use", "tool_use"], "{value}");
    assert_eq!(content[0]["thinking"], "\nList the files first.\n");
    assert!(!content[0]["signature"].as_str().unwrap().is_empty(), "a thinking block always has a signature");
    // The text block starts at its first visible character (not at the `\n\n` after `</think>`).
    assert_eq!(content[1]["text"], "Let me look.");
    assert_eq!(content[2]["name"], "ls");
    assert_eq!(content[2]["input"], json!({"path": "."}));
    assert!(content[2]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(content[3]["input"], json!({"file": "a.rs", "lines": [1, 20]}));

    let usage = &value["usage"];
    let prompt = server.fake.last().prompt.len() as u64;
    let read = usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(read, prompt / 2, "the fake reports half the prompt cached");
    assert_eq!(usage["input_tokens"].as_u64().unwrap() + read, prompt, "input_tokens excludes what was read");
    assert_eq!(usage["cache_creation_input_tokens"], 0);
    assert!(usage["output_tokens"].as_u64().unwrap() > 0);

    let mut count = claude_request("fa690", false);
    count.as_object_mut().unwrap().remove("max_tokens");
    let (status, _, counted) = post(&server, "/v1/messages/count_tokens", &count).await;
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted["input_tokens"].as_u64(), Some(prompt), "count_tokens is the real count");
}

/// The billing header, different on every Claude Code request, is stripped before rendering:
/// two requests differing only in it give identical prompt tokens (and counted in a metric).
/// With `frontend.strip_anthropic_preamble = false` they differ.
#[tokio::test]
async fn the_billing_header_does_not_change_the_prompt() {
    let server = Server::start(agent_server_config(true)).await;
    post(&server, "/v1/messages", &claude_request("fa690", false)).await;
    let first = server.fake.last().prompt;
    post(&server, "/v1/messages", &claude_request("0b1c2", false)).await;
    assert_eq!(server.fake.last().prompt, first, "identical prompt tokens");
    let text = Tokenizer::builtin().decode(&first).unwrap();
    assert!(!text.contains("billing"), "{text}");
    assert!(text.contains("You are a coding agent."), "{text}");

    let keeping = Server::start(agent_server_config(false)).await;
    post(&keeping, "/v1/messages", &claude_request("fa690", false)).await;
    let a = keeping.fake.last().prompt;
    post(&keeping, "/v1/messages", &claude_request("0b1c2", false)).await;
    assert_ne!(keeping.fake.last().prompt, a);
}

/// Only the billing header's line goes, in every shape a client puts it: sharing one text block
/// with the system prompt (Claude Code's own shape), as the first line of a `system` string, in an
/// inline system turn, and in Chat Completions' and Responses' system and developer text. The
/// system prompt after it is kept whole, and two requests differing only in the header render
/// the same prompt tokens.
#[tokio::test]
async fn the_billing_header_line_goes_and_the_system_prompt_after_it_stays() {
    let server = Server::start(agent_server_config(true)).await;
    let header =
        |cch: &str| format!("x-anthropic-billing-header: cc_version=2.1.332.1c9; cc_entrypoint=cli; cch={cch};");
    let system = "You are a coding agent.\nRead before you edit.";
    type Shape<'a> = Box<dyn Fn(&str) -> Value + 'a>;
    let shapes: Vec<(&str, Shape<'_>)> = vec![
        (
            "/v1/messages",
            Box::new(|cch| {
                json!({"model": "agent", "max_tokens": 8, "system": [{"type": "text", "text": format!("{}\n{system}", header(cch))}],
                    "messages": [{"role": "user", "content": "hi"}]})
            }),
        ),
        (
            "/v1/messages",
            Box::new(|cch| {
                json!({"model": "agent", "max_tokens": 8, "system": format!("{}\n{system}", header(cch)),
                    "messages": [{"role": "user", "content": "hi"}]})
            }),
        ),
        (
            "/v1/messages",
            Box::new(|cch| {
                json!({"model": "agent", "max_tokens": 8, "messages": [
                    {"role": "system", "content": [{"type": "text", "text": format!("{}\n{system}", header(cch))}]},
                    {"role": "user", "content": "hi"}]})
            }),
        ),
        (
            "/v1/chat/completions",
            Box::new(|cch| {
                json!({"model": "agent", "max_tokens": 8, "messages": [
                    {"role": "system", "content": [{"type": "text", "text": format!("{}\n{system}", header(cch))}]},
                    {"role": "user", "content": "hi"}]})
            }),
        ),
        (
            "/v1/chat/completions",
            Box::new(|cch| {
                json!({"model": "agent", "max_tokens": 8, "messages": [
                    {"role": "developer", "content": format!("{}\n{system}", header(cch))},
                    {"role": "user", "content": "hi"}]})
            }),
        ),
        (
            "/v1/responses",
            Box::new(|cch| {
                json!({"model": "agent", "max_output_tokens": 8, "store": false,
                    "instructions": format!("{}\n{system}", header(cch)), "input": "hi"})
            }),
        ),
        (
            "/v1/responses",
            Box::new(|cch| {
                json!({"model": "agent", "max_output_tokens": 8, "store": false, "input": [
                    {"role": "system", "content": format!("{}\n{system}", header(cch))},
                    {"role": "user", "content": "hi"}]})
            }),
        ),
    ];
    for (i, (route, request)) in shapes.iter().enumerate() {
        let (status, _, value) = post(&server, route, &request("fa690")).await;
        assert_eq!(status, 200, "shape {i}: {value}");
        let first = server.fake.last().prompt;
        let text = Tokenizer::builtin().decode(&first).unwrap();
        assert!(!text.contains("billing"), "shape {i}: {text}");
        assert!(text.contains(system), "shape {i}: the system prompt after the header is kept: {text}");
        post(&server, route, &request("0b1c2")).await;
        assert_eq!(server.fake.last().prompt, first, "shape {i}: identical prompt tokens");
    }
}

/// The SSE grammar the SDK enforces: `message_start` first with exact usage, a `ping`, blocks started in
/// index order and each stopped before the next, a thinking block's `signature_delta` before its
/// stop, tool input as `input_json_delta`, then `message_delta` and `message_stop`; the blocks
/// add up to the non-streamed message.
#[tokio::test]
async fn anthropic_streaming_follows_the_event_grammar() {
    let server = Server::start(agent_server_config(true)).await;
    let (_, _, whole) = post(&server, "/v1/messages", &claude_request("fa690", false)).await;
    let response = reqwest::Client::new()
        .post(server.url("/v1/messages"))
        .json(&claude_request("fa690", true))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let body = response.text().await.unwrap();
    let events: Vec<(String, Value)> = body
        .split_terminator("\n\n")
        .map(|frame| {
            let (name, data) = frame.split_once('\n').expect("event and data lines");
            let name = name.strip_prefix("event: ").expect("event line").to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("data line")).unwrap();
            assert_eq!(data["type"], name.as_str(), "the data's type is the event's name");
            (name, data)
        })
        .collect();
    assert_eq!(events[0].0, "message_start");
    assert_eq!(events[0].1["message"]["usage"]["cache_read_input_tokens"], whole["usage"]["cache_read_input_tokens"]);
    assert_eq!(events[1].0, "ping", "a ping follows message_start, as Anthropic's API sends it");
    let events: Vec<(String, Value)> = events.into_iter().filter(|(name, _)| name != "ping").collect();
    assert_eq!(events[events.len() - 2].0, "message_delta");
    assert_eq!(events[events.len() - 2].1["delta"]["stop_reason"], "tool_use");
    let final_usage = &events[events.len() - 2].1["usage"];
    for field in ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens"] {
        assert_eq!(final_usage[field], whole["usage"][field], "message_delta's usage is the whole answer's: {field}");
    }
    assert_eq!(events.last().unwrap().0, "message_stop");
    let mut blocks: Vec<Value> = Vec::new();
    let mut open: Option<usize> = None;
    for (name, data) in &events[1..events.len() - 2] {
        let index = data["index"].as_u64().expect("index") as usize;
        match name.as_str() {
            "content_block_start" => {
                assert!(open.is_none(), "one block open at a time");
                assert_eq!(index, blocks.len(), "blocks start in index order");
                blocks.push(data["content_block"].clone());
                open = Some(index);
            }
            "content_block_delta" => {
                assert_eq!(open, Some(index));
                let block = &mut blocks[index];
                let delta = &data["delta"];
                match delta["type"].as_str().unwrap() {
                    "thinking_delta" => {
                        block["thinking"] = json!(format!(
                            "{}{}",
                            block["thinking"].as_str().unwrap(),
                            delta["thinking"].as_str().unwrap()
                        ))
                    }
                    "signature_delta" => block["signature"] = delta["signature"].clone(),
                    "text_delta" => {
                        block["text"] =
                            json!(format!("{}{}", block["text"].as_str().unwrap(), delta["text"].as_str().unwrap()))
                    }
                    // The input arrives as pieces of JSON text, whole only at the block's stop.
                    "input_json_delta" => {
                        let so_far = block["partial"].as_str().unwrap_or("").to_owned();
                        block["partial"] = json!(so_far + delta["partial_json"].as_str().unwrap());
                    }
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(open.take(), Some(index));
                let block = &mut blocks[index];
                if let Some(partial) = block.as_object_mut().unwrap().remove("partial") {
                    block["input"] = serde_json::from_str(partial.as_str().unwrap()).unwrap();
                }
            }
            other => panic!("unexpected event {other}"),
        }
    }
    for (streamed, whole) in blocks.iter().zip(whole["content"].as_array().unwrap()) {
        let mut streamed = streamed.clone();
        let mut whole = whole.clone();
        for b in [&mut streamed, &mut whole] {
            b.as_object_mut().unwrap().remove("id");
        }
        assert_eq!(streamed, whole);
    }
    assert_eq!(blocks.len(), whole["content"].as_array().unwrap().len());
}

/// A tool loop's next turn lowers to template messages: the assistant's thinking and tool use,
/// then the tool results, with the text beside them folded into the last tool message (not a
/// new user turn); an inline `system` message is accepted.
#[tokio::test]
async fn anthropic_tool_results_and_reminders_lower_to_tool_messages() {
    let server = Server::start(agent_server_config(true)).await;
    let body = json!({
        "model": "agent",
        "max_tokens": 50,
        "messages": [
            {"role": "user", "content": "List the repository."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "List the files first.", "signature": "dn1.x"},
                {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "."}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.rs b.rs"}]},
                {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                {"type": "server_tool_use", "id": "x", "name": "web_search", "input": {}},
            ]},
            {"role": "system", "content": "Inline system note."},
        ],
    });
    let (status, _, value) = post(&server, "/v1/messages", &body).await;
    assert_eq!(status, 200, "{value}");
    let text = Tokenizer::builtin().decode(&server.fake.last().prompt).unwrap();
    let tool = text.find("tool<|end_header_id|>").expect("a tool message");
    let reminder = text.find("be brief").expect("the reminder");
    assert!(reminder > tool, "{text}");
    assert_eq!(text.matches("user<|end_header_id|>").count(), 1, "the reminder is not a new user turn: {text}");
    assert!(text.contains("a.rs b.rs") && text.contains("Inline system note.") && text.contains("\"ls\""), "{text}");
}

/// Errors in Anthropic's shape with its statuses: 404 not_found_error, 400 invalid_request_error,
/// 529 overloaded_error with retry-after; `/v1/models` answers in Anthropic's shape when asked.
#[tokio::test]
async fn anthropic_errors_and_models() {
    let server = server().await;
    let ask = |model: &str| json!({"model": model, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]});
    for (body, status, kind) in [
        (ask("nope"), 404, "not_found_error"),
        (json!({"model": "fake", "messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error"),
        (json!({"model": "fake", "max_tokens": 5, "messages": []}), 400, "invalid_request_error"),
        (ask("overloaded"), 529, "overloaded_error"),
        (
            json!({"model": "fake", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
            400,
            "invalid_request_error",
        ),
    ] {
        let (got, headers, value) = post(&server, "/v1/messages", &body).await;
        assert_eq!(got, status, "{body} → {value}");
        assert_eq!(value["type"], "error", "{value}");
        assert_eq!(value["error"]["type"], kind, "{value}");
        assert!(!value["error"]["message"].as_str().unwrap().is_empty());
        if status == 529 {
            assert!(headers.contains_key("retry-after"));
        }
    }
    let models: Value = reqwest::Client::new()
        .get(server.url("/v1/models"))
        .header("anthropic-version", "2023-06-01")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["has_more"], false);
    assert_eq!(models["data"][0]["type"], "model");
    assert_eq!(models["first_id"], models["data"][0]["id"]);
}

/// One call allowed (`parallel_tool_calls: false`; Anthropic's `disable_parallel_tool_use`):
/// the answer ends where its second call would begin, streamed or not.
#[tokio::test]
async fn a_single_call_answer_ends_before_the_second_call() {
    let config = FrontendSection {
        reasoning_parser: Some("qwen3".into()),
        tool_call_parser: Some("hermes".into()),
        ..FrontendSection::default()
    };
    let server = Server::start(config).await;
    let mut body = agent_chat();
    body["parallel_tool_calls"] = json!(false);
    let (status, _, value) = post(&server, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{value}");
    let calls = value["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{value}");
    assert_eq!(calls[0]["function"]["name"], "ls");
    assert_eq!(value["choices"][0]["finish_reason"], "tool_calls");
    body["stream"] = json!(true);
    let events = post_stream(&server, "/v1/chat/completions", &body).await;
    let started = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default())
        .filter(|call| call.get("id").is_some())
        .count();
    assert_eq!(started, 1, "{events:?}");

    let mut messages = claude_request("fa690", false);
    messages["tools"] = json!([{"name": "ls", "input_schema": {"type": "object"}}, {"name": "cat", "input_schema": {"type": "object"}}]);
    messages["tool_choice"] = json!({"type": "auto", "disable_parallel_tool_use": true});
    let (status, _, value) = post(&server, "/v1/messages", &messages).await;
    assert_eq!(status, 200, "{value}");
    let uses: Vec<&Value> = value["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{value}");
    assert_eq!(value["stop_reason"], "tool_use");
}

/// Clients that send every field send the ones they did not set as `null`: every API takes
/// them as unset.
#[tokio::test]
async fn null_fields_are_unset_fields() {
    let server = server().await;
    let chat = json!({"model": "fake", "messages": [{"role": "user", "content": "hi", "name": null, "tool_calls": null}],
        "stream": null, "stream_options": null, "tools": null, "tool_choice": null, "parallel_tool_calls": null,
        "max_tokens": null, "max_completion_tokens": null, "stop": null, "n": null, "temperature": null, "seed": null,
        "user": null, "nvext": null, "chat_template_kwargs": null, "reasoning_effort": null});
    let (status, _, value) = post(&server, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{value}");
    let completion = json!({"model": "fake", "prompt": "hi", "stream": null, "max_tokens": null, "stop": null});
    let (status, _, value) = post(&server, "/v1/completions", &completion).await;
    assert_eq!(status, 200, "{value}");
    let responses = json!({"model": "fake", "input": "hi", "stream": null, "instructions": null, "tools": null,
        "tool_choice": null, "max_output_tokens": null, "temperature": null, "top_p": null, "store": null,
        "previous_response_id": null, "include": null, "reasoning": null, "metadata": null, "text": null,
        "truncation": null, "user": null, "prompt_cache_key": null, "parallel_tool_calls": null});
    let (status, _, value) = post(&server, "/v1/responses", &responses).await;
    assert_eq!(status, 200, "{value}");
    let messages = json!({"model": "fake", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "stream": null, "system": null, "tools": null, "tool_choice": null, "thinking": null,
        "stop_sequences": null, "temperature": null, "metadata": null});
    let (status, _, value) = post(&server, "/v1/messages", &messages).await;
    assert_eq!(status, 200, "{value}");
}

/// `cache_control` breakpoints become lease requests at the end of their messages (the strongest
/// TTL where two meet), the top-level mark covers the whole conversation, short prefixes are
/// ignored, and more than four marked blocks is Anthropic's 400; OpenAI's
/// `prompt_cache_retention: "24h"` leases the whole prompt for a day.
#[tokio::test]
async fn cache_breakpoints_become_leases_at_message_ends() {
    let server = Server::start(FrontendSection { cache_min_tokens: 8, ..FrontendSection::default() }).await;
    let long = |tag: &str| (0..40).map(|i| format!("{tag}{i} ")).collect::<String>();
    let marked = |text: String, ttl: Option<&str>| {
        let mut control = json!({"type": "ephemeral"});
        if let Some(ttl) = ttl {
            control["ttl"] = json!(ttl);
        }
        json!({"type": "text", "text": text, "cache_control": control})
    };
    let body = json!({
        "model": "fake", "max_tokens": 4,
        "system": [marked(long("sys"), Some("1h"))],
        "messages": [
            {"role": "user", "content": [marked(long("u"), None)]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "next"}, marked("tiny".into(), None)]},
        ],
    });
    let (status, _, answer) = post(&server, "/v1/messages", &body).await;
    assert_eq!(status, 200, "{answer}");
    let req = server.fake.last();
    let leases: Vec<(usize, u64)> = req.cache_leases.iter().map(|(t, ttl)| (*t, ttl.as_secs())).collect();
    assert_eq!(leases.len(), 3, "{leases:?}");
    assert_eq!(leases.iter().map(|l| l.1).collect::<Vec<_>>(), [3600, 300, 300]);
    assert!(leases.windows(2).all(|w| w[0].0 < w[1].0), "in prompt order: {leases:?}");
    let system_end = req.regions.iter().find(|(_, r)| *r == RegionKind::System).map(|(r, _)| r.end).expect("system");
    assert!(leases[0].0 >= system_end - 8 && leases[0].0 <= system_end + 8, "at the system message's end: {leases:?}");
    assert!(leases[2].0 < req.prompt.len(), "the last breakpoint ends before the generation prompt");

    // The top-level mark: the whole conversation, as a short-lived lease.
    let mut whole = body.clone();
    whole["system"] = json!(long("sys"));
    whole["messages"] = json!([{"role": "user", "content": long("q")}]);
    whole["cache_control"] = json!({"type": "ephemeral"});
    let (status, _, _) = post(&server, "/v1/messages", &whole).await;
    assert_eq!(status, 200);
    assert_eq!(server.fake.last().cache_leases.len(), 1);

    // Five marked blocks: refused in Anthropic's shape.
    let mut five = body.clone();
    five["messages"][0]["content"] =
        json!([marked(long("a"), None), marked(long("b"), None), marked(long("c"), None), marked(long("d"), None)]);
    let (status, _, err) = post(&server, "/v1/messages", &five).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    assert!(err["error"]["message"].as_str().unwrap().contains("maximum of 4"), "{err}");

    // OpenAI's 24h retention, and a value it does not define.
    let mut retained = chat("fake");
    retained["messages"][0]["content"] = json!(long("sys"));
    retained["prompt_cache_retention"] = json!("24h");
    let (status, _, _) = post(&server, "/v1/chat/completions", &retained).await;
    assert_eq!(status, 200);
    let day: Vec<u64> = server.fake.last().cache_leases.iter().map(|(_, ttl)| ttl.as_secs()).collect();
    assert_eq!(day, [86_400]);
    let whole_prompt = server.fake.last().cache_leases[0].0;
    retained["prompt_cache_retention"] = json!("forever");
    let (status, _, err) = post(&server, "/v1/chat/completions", &retained).await;
    assert_error(status, &err, 400, "invalid_request_error", None);
    retained["prompt_cache_retention"] = json!("in_memory");
    post(&server, "/v1/chat/completions", &retained).await;
    assert!(server.fake.last().cache_leases.is_empty(), "in_memory is plain retention");

    // An agent hint leases the whole prompt on APIs without breakpoints; a TTL it does not
    // define is a 400.
    let mut hinted = chat("fake");
    hinted["messages"][0]["content"] = json!(long("sys"));
    hinted["nvext"] = json!({"cache_control": {"type": "ephemeral", "ttl": "1h"}});
    let (status, _, _) = post(&server, "/v1/chat/completions", &hinted).await;
    assert_eq!(status, 200);
    let leases = server.fake.last().cache_leases;
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].0, whole_prompt, "the whole prompt, up to its last message's end");
    assert_eq!(leases[0].1.as_secs(), 3600);
    hinted["nvext"] = json!({"cache_control": {"type": "ephemeral"}});
    post(&server, "/v1/chat/completions", &hinted).await;
    assert_eq!(server.fake.last().cache_leases[0].1.as_secs(), 300, "5m by default");
    hinted["nvext"] = json!({"cache_control": {"type": "ephemeral", "ttl": "2h"}});
    let (status, _, err) = post(&server, "/v1/chat/completions", &hinted).await;
    assert_error(status, &err, 400, "invalid_request_error", None);

    // Below frontend.cache_min_tokens a breakpoint is ignored.
    let small = Server::start(FrontendSection::default()).await;
    post(&small, "/v1/messages", &body).await;
    assert!(small.fake.last().cache_leases.is_empty(), "the default minimum is 1024 tokens");
}

/// What Anthropic and OpenAI refuse is refused here too, in the API's shape, never silently
/// changed: `cache_control` TTLs other than `5m`/`1h` (or another `type`) anywhere in a Messages
/// request, a `thinking.type` Anthropic does not define, Responses input items that are not
/// objects (this was a panic); and `/v1/completions` honours `prompt_cache_retention` as the chat
/// routes do.
#[tokio::test]
async fn what_the_reference_apis_refuse_is_refused_and_completions_lease_for_a_day() {
    let server = Server::start(FrontendSection { cache_min_tokens: 8, ..FrontendSection::default() }).await;
    let anthropic_400 = |status: u16, body: &Value| {
        assert_eq!(status, 400, "{body}");
        assert_eq!(
            (&body["type"], &body["error"]["type"]),
            (&json!("error"), &json!("invalid_request_error")),
            "{body}"
        );
    };
    let messages = |system: Value, content: Value| json!({"model": "fake", "max_tokens": 4, "system": system, "messages": [{"role": "user", "content": content}]});
    let text = |control: Value| json!([{"type": "text", "text": "hello", "cache_control": control}]);
    for bad in [
        json!({"type": "ephemeral", "ttl": "24h"}),
        json!({"type": "ephemeral", "ttl": "10m"}),
        json!({"type": "ephemeral", "ttl": 300}),
        json!({"type": "ephemeral", "ttl": "-5m"}),
        json!({"type": "persistent"}),
        json!("ephemeral"),
    ] {
        for body in [messages(text(bad.clone()), json!("hi")), messages(json!("sys"), text(bad.clone()))] {
            let (status, _, err) = post(&server, "/v1/messages", &body).await;
            anthropic_400(status, &err);
            assert!(err["error"]["message"].as_str().unwrap().contains("cache_control"), "{bad}: {err}");
        }
        let mut top = messages(json!("sys"), json!("hi"));
        top["cache_control"] = bad.clone();
        let (status, _, err) = post(&server, "/v1/messages", &top).await;
        anthropic_400(status, &err);
    }
    for good in [
        json!({"type": "ephemeral"}),
        json!({"type": "ephemeral", "ttl": "5m"}),
        json!({"type": "ephemeral", "ttl": "1h"}),
    ] {
        let (status, _, value) = post(&server, "/v1/messages", &messages(text(good), json!("hi"))).await;
        assert_eq!(status, 200, "{value}");
    }
    for (thinking, ok) in [
        (json!({"type": "sometimes"}), false),
        (json!({}), false),
        (json!({"type": "enabled"}), false),
        (json!({"type": "enabled", "budget_tokens": "lots"}), false),
        (json!({"type": "enabled", "budget_tokens": 2048}), true),
        (json!({"type": "disabled"}), true),
        (json!({"type": "adaptive"}), true),
    ] {
        let mut body = messages(json!("sys"), json!("hi"));
        body["thinking"] = thinking.clone();
        let (status, _, value) = post(&server, "/v1/messages", &body).await;
        if ok {
            assert_eq!(status, 200, "{thinking}: {value}");
        } else {
            anthropic_400(status, &value);
        }
    }

    for input in [json!([5]), json!(["text"]), json!([{"role": "user", "content": "hi"}, null]), json!([[1]])] {
        let (status, _, err) = post(&server, "/v1/responses", &json!({"model": "fake", "input": input})).await;
        assert_error(status, &err, 400, "invalid_request_error", None);
        assert!(err["error"]["param"].as_str().unwrap().starts_with("input["), "{err}");
    }

    let long: String = (0..40).map(|i| format!("word{i} ")).collect();
    let mut completion = json!({"model": "fake", "prompt": long, "max_tokens": 2, "prompt_cache_retention": "24h"});
    let (status, _, value) = post(&server, "/v1/completions", &completion).await;
    assert_eq!(status, 200, "{value}");
    let req = server.fake.last();
    let leases: Vec<(usize, u64)> = req.cache_leases.iter().map(|(t, ttl)| (*t, ttl.as_secs())).collect();
    assert_eq!(leases, [(req.prompt.len(), 86_400)], "the whole prompt, for a day");
    completion["prompt_cache_retention"] = json!("forever");
    let (status, _, err) = post(&server, "/v1/completions", &completion).await;
    assert_error(status, &err, 400, "invalid_request_error", None);
}

/// A Messages request to the `parrot` model, whose answer is `said`, offering `tools`.
fn parrot_messages(said: &str, stream: bool, tools: Value) -> Value {
    json!({"model": "parrot", "max_tokens": 900, "stream": stream, "tools": tools,
           "messages": [{"role": "user", "content": format!("<<say>>{said}<</say>>")}]})
}

/// One tool, `ls`, in Anthropic's shape.
fn ls_tool() -> Value {
    json!([{"name": "ls", "input_schema": {"type": "object"}}])
}

/// The tool input a streamed Messages answer sent: its `input_json_delta`s, joined.
fn streamed_tool_input(events: &[(String, Value)]) -> String {
    events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap())
        .collect()
}

/// The events of a streamed Messages answer, as (name, data).
async fn anthropic_events(server: &Server, body: &Value) -> Vec<(String, Value)> {
    let response = reqwest::Client::new().post(server.url("/v1/messages")).json(body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    text.split_terminator("\n\n")
        .map(|frame| {
            let (name, data) = frame.split_once('\n').expect("event and data lines");
            (
                name.trim_start_matches("event: ").to_owned(),
                serde_json::from_str(data.trim_start_matches("data: ")).expect("JSON data"),
            )
        })
        .collect()
}

/// A tool call whose arguments are not JSON — `{bad json}`, a raw NUL, nesting deeper than 128
/// levels — streams as the very object the non-streamed answer gives (`{}`), as JSON an SDK's
/// `messages.stream()` parses; a call with good arguments streams them whole.
#[tokio::test]
async fn anthropic_streamed_tool_input_is_the_object_the_answer_gives() {
    let server = Server::start(agent_server_config(true)).await;
    let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
    let cases = [
        ("{bad json}".to_owned(), json!({})),
        ("{\"a\": \"x\u{0}y\"}".to_owned(), json!({})),
        (format!("{{\"a\": {deep}}}"), json!({})),
        ("{\"path\": \"src\", \"depth\": 2}".to_owned(), json!({"path": "src", "depth": 2})),
    ];
    for (arguments, want) in cases {
        let said = format!("<tool_call>\n{{\"name\": \"ls\", \"arguments\": {arguments}}}\n</tool_call>");
        let body = |stream: bool| parrot_messages(&said, stream, ls_tool());
        let (status, _, whole) = post(&server, "/v1/messages", &body(false)).await;
        assert_eq!(status, 200, "{whole}");
        let call = whole["content"].as_array().unwrap().iter().find(|b| b["type"] == "tool_use").expect("a call");
        assert_eq!(call["input"], want, "{arguments}: {whole}");
        let events = anthropic_events(&server, &body(true)).await;
        let partial = streamed_tool_input(&events);
        let streamed: Value =
            serde_json::from_str(&partial).unwrap_or_else(|e| panic!("{arguments}: {partial:?}: {e}"));
        assert_eq!(streamed, call["input"], "{arguments}: streamed as answered");
    }
}

/// What the Responses store would keep without bound is refused: ids over 512 characters,
/// `metadata` past OpenAI's limits, a megabyte of items this node does not serve.
#[tokio::test]
async fn responses_refuse_what_the_store_would_keep_without_bound() {
    let server = server().await;
    let long = "c".repeat(4 << 20);
    let bodies = [
        json!({"model": "fake", "input": [{"type": "function_call_output", "call_id": long, "output": "ok"}]}),
        json!({"model": "fake", "input": [{"type": "function_call", "call_id": "x".repeat(513), "name": "f", "arguments": "{}"}]}),
        json!({"model": "fake", "input": "hi", "previous_response_id": "resp_".repeat(200)}),
        json!({"model": "fake", "input": "hi", "metadata": {"k": "v".repeat(513)}}),
        json!({"model": "fake", "input": "hi", "metadata": (0..17).map(|i| (format!("k{i}"), json!("v"))).collect::<serde_json::Map<_, _>>()}),
        json!({"model": "fake", "input": "hi", "metadata": {"k": {"nested": true}}}),
        json!({"model": "fake", "input": [{"type": "web_search_call", "payload": "w".repeat(2 << 20)}, {"role": "user", "content": "hi"}]}),
    ];
    for body in bodies {
        let (status, _, err) = post(&server, "/v1/responses", &body).await;
        assert_error(status, &err, 400, "invalid_request_error", None);
    }
    let ok = json!({"model": "fake", "input": "hi", "metadata": {"run": "42", "owner": "me"}});
    let (status, _, value) = post(&server, "/v1/responses", &ok).await;
    assert_eq!(status, 200, "{value}");
    assert_eq!(value["metadata"], json!({"run": "42", "owner": "me"}));
}

/// A prompt over `frontend.max_prompt_bytes` is refused from its size; a long one under it is
/// counted in chunks and refused as soon as it is sure to be too long: the count in the error is
/// where counting stopped (about one 64 KiB chunk), not the whole text's (a 30 MiB message once
/// cost 20 s of CPU before its 400).
#[tokio::test]
async fn long_prompts_are_refused_from_their_size_or_a_chunk_past_the_limit() {
    let server = Server::start(FrontendSection {
        max_prompt_bytes: dynamo_config::ByteSize::kib(512),
        ..FrontendSection::default()
    })
    .await;
    let big = "word ".repeat(120 << 10);
    let (status, _, err) = post(
        &server,
        "/v1/chat/completions",
        &json!({"model": "fake", "messages": [{"role": "user", "content": big}]}),
    )
    .await;
    assert_error(status, &err, 400, "invalid_request_error", None);
    assert!(err["error"]["message"].as_str().unwrap().contains("max_prompt_bytes"), "{err}");

    // ~126 KiB of two-token words: about 86K tokens, 84 times the fake's context of 1024 (and
    // short enough in bytes to pass the size pre-check); counting stops after the first chunk.
    let long: String = (0..43_000).map(|i| format!("w{} ", i % 10)).collect();
    let whole = Tokenizer::builtin().encode(&long).unwrap().len();
    for (route, body) in [
        ("/v1/chat/completions", json!({"model": "fake", "messages": [{"role": "user", "content": long}]})),
        ("/v1/completions", json!({"model": "fake", "prompt": long})),
    ] {
        let (status, _, err) = post(&server, route, &body).await;
        assert_error(status, &err, 400, "invalid_request_error", Some("context_length_exceeded"));
        let message = err["error"]["message"].as_str().unwrap();
        let counted: usize = message
            .split(|c: char| !c.is_ascii_digit())
            .filter_map(|n| n.parse().ok())
            .filter(|&n| n > 1024)
            .max()
            .unwrap_or_else(|| panic!("{route}: no count in {message}"));
        assert!(counted < whole * 3 / 5, "{route}: counted {counted} of {whole} tokens before refusing: {message}");
    }
}

/// Only calls to tools the request offered are tool calls: a call to a tool never offered, or
/// one whose name holds an escape or a bidirectional override, stays in the answer as the text
/// of its JSON (control characters escaped), streamed and not; with no tools offered there are
/// no calls at all.
#[tokio::test]
async fn calls_to_tools_not_offered_stay_text() {
    let server = Server::start(agent_server_config(true)).await;
    let call = |name: &str| format!("<tool_call>\n{}\n</tool_call>", json!({"name": name, "arguments": {"path": "."}}));
    let said = format!("{}{}{}{}", call("ls"), call("rm"), call("l\u{1b}[2Js"), call("ls\u{202e}"));
    let body = |stream: bool, tools: Value| parrot_messages(&said, stream, tools);
    let offered = ls_tool();
    let (status, _, whole) = post(&server, "/v1/messages", &body(false, offered.clone())).await;
    assert_eq!(status, 200, "{whole}");
    let content = whole["content"].as_array().unwrap();
    let uses: Vec<&Value> = content.iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{whole}");
    assert_eq!(uses[0]["name"], "ls");
    let text: String = content.iter().filter(|b| b["type"] == "text").map(|b| b["text"].as_str().unwrap()).collect();
    assert!(text.contains("\"name\":\"rm\""), "{text:?}");
    // As text, a name is the model's words like any other: its escape is JSON-escaped, and no
    // client shows it as a tool's name.
    assert!(!text.contains('\u{1b}'), "control characters escaped: {text:?}");
    assert!(text.contains("ls\u{202e}"), "{text:?}");
    assert!(text.contains("\\u001b"), "{text:?}");

    let events = anthropic_events(&server, &body(true, offered)).await;
    let starts: Vec<&Value> = events
        .iter()
        .filter(|(n, d)| n == "content_block_start" && d["content_block"]["type"] == "tool_use")
        .map(|(_, d)| &d["content_block"])
        .collect();
    assert_eq!(starts.len(), 1, "{events:?}");
    assert_eq!(starts[0]["name"], "ls");

    let (status, _, none) = post(&server, "/v1/messages", &body(false, json!([]))).await;
    assert_eq!(status, 200, "{none}");
    assert!(none["content"].as_array().unwrap().iter().all(|b| b["type"] != "tool_use"), "{none}");
}

/// An argument that mentions `</tool_call>` does not cut its Hermes call short: the call ends at
/// the tag after its JSON, streamed and not.
#[tokio::test]
async fn a_closing_tag_inside_an_argument_does_not_end_the_call() {
    let server = Server::start(agent_server_config(true)).await;
    let arguments = json!({"note": "a \"quoted\" </tool_call> and \\ more", "path": "."});
    let said = format!("<tool_call>\n{}\n</tool_call>done", json!({"name": "ls", "arguments": arguments}));
    let body = |stream: bool| parrot_messages(&said, stream, ls_tool());
    let (status, _, whole) = post(&server, "/v1/messages", &body(false)).await;
    assert_eq!(status, 200, "{whole}");
    let content = whole["content"].as_array().unwrap();
    let uses: Vec<&Value> = content.iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{whole}");
    assert_eq!(uses[0]["input"], arguments, "{whole}");
    let events = anthropic_events(&server, &body(true)).await;
    let partial = streamed_tool_input(&events);
    assert_eq!(serde_json::from_str::<Value>(&partial).unwrap(), arguments);
}
