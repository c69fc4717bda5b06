//! OpenAI Responses over real HTTP against the fake generator of `support/frontend.rs`: the
//! response object and its output items in generation order, the exact event sequence of a
//! stream, `incomplete` on a length stop, stored responses (`GET`, `DELETE`, `input_items`),
//! `previous_response_id`, and the errors.

#[path = "support/frontend.rs"]
mod support;

use dynamo_config::FrontendSection;
use serde_json::{Value, json};
use support::Server;

fn parsers() -> FrontendSection {
    FrontendSection {
        reasoning_parser: Some("qwen3".into()),
        tool_call_parser: Some("hermes".into()),
        ..FrontendSection::default()
    }
}

async fn send(method: reqwest::Method, server: &Server, path: &str, body: Option<&Value>) -> (u16, Value) {
    let mut request = reqwest::Client::new().request(method, server.url(path));
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

async fn post(server: &Server, body: &Value) -> (u16, Value) {
    send(reqwest::Method::POST, server, "/v1/responses", Some(body)).await
}

fn request(model: &str) -> Value {
    json!({
        "model": model,
        "instructions": "You are a coding agent.",
        "input": "List the repository.",
        "tools": [
            {"type": "function", "name": "ls", "description": "List files", "parameters": {"type": "object"}},
            {"type": "function", "name": "cat", "description": "Show a file", "parameters": {"type": "object"}},
            {"type": "web_search"},
        ],
    })
}

/// Reasoning, a message and two function calls, in the order the model wrote them; usage; the
/// request's fields echoed; the response stored and readable, its input items listed, deletable.
#[tokio::test]
async fn a_response_has_its_items_in_generation_order_and_is_stored() {
    let server = Server::start(parsers()).await;
    let mut body = request("agent");
    body["include"] = json!(["reasoning.encrypted_content"]);
    let (status, value) = post(&server, &body).await;
    assert_eq!(status, 200, "{value}");
    assert_eq!(value["object"], "response");
    assert_eq!(value["status"], "completed");
    assert_eq!(value["model"], "agent");
    assert_eq!(value["instructions"], "You are a coding agent.");
    let id = value["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("resp_"), "{id}");
    let output = value["output"].as_array().unwrap();
    let kinds: Vec<&str> = output.iter().map(|i| i["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call", "function_call"], "{value}");
    assert_eq!(output[0]["content"][0]["text"], "\nList the files first.\n");
    assert!(output[0]["encrypted_content"].as_str().unwrap().starts_with("dn1."), "the replay handle");
    assert_eq!(output[1]["content"][0]["type"], "output_text");
    assert_eq!(output[1]["content"][0]["text"], "Let me look.");
    assert_eq!(output[2]["name"], "ls");
    assert_eq!(output[2]["arguments"], "{\"path\": \".\"}");
    assert!(output[2]["call_id"].as_str().unwrap().starts_with("call_"));
    assert_ne!(output[2]["id"], output[3]["id"]);
    let prompt = server.fake.last().prompt.len() as u64;
    let usage = &value["usage"];
    assert_eq!(usage["input_tokens"].as_u64(), Some(prompt), "input_tokens includes the cached ones");
    assert_eq!(usage["input_tokens_details"]["cached_tokens"].as_u64(), Some(prompt / 2));
    let reasoning = usage["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
    assert!(reasoning > 0 && reasoning < usage["output_tokens"].as_u64().unwrap(), "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap())
    );
    // The hosted tool is left out of the prompt, not refused.
    let text = dynamo_node::tokenizer::Tokenizer::builtin().decode(&server.fake.last().prompt).unwrap();
    assert!(text.contains("List files") && !text.contains("web_search"), "{text}");

    let (status, stored) = send(reqwest::Method::GET, &server, &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, 200);
    assert_eq!(stored, value, "GET returns the response as answered");
    let (status, items) = send(reqwest::Method::GET, &server, &format!("/v1/responses/{id}/input_items"), None).await;
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["object"], "list");
    assert_eq!(items["data"][0]["role"], "user");
    assert_eq!(items["data"][0]["content"][0]["text"], "List the repository.");
    assert!(items["data"][0]["id"].as_str().is_some());
    let (status, deleted) = send(reqwest::Method::DELETE, &server, &format!("/v1/responses/{id}"), None).await;
    assert_eq!((status, &deleted["deleted"]), (200, &json!(true)), "{deleted}");
    let (status, gone) = send(reqwest::Method::GET, &server, &format!("/v1/responses/{id}"), None).await;
    assert_eq!(status, 404, "{gone}");
    assert_eq!(gone["error"]["code"], "response_not_found");

    // store: false keeps nothing.
    body["store"] = json!(false);
    let (_, value) = post(&server, &body).await;
    let (status, _) =
        send(reqwest::Method::GET, &server, &format!("/v1/responses/{}", value["id"].as_str().unwrap()), None).await;
    assert_eq!(status, 404);
    assert_eq!(value["store"], false);
}

/// The events of a stream in their exact order, numbered from 0 without gaps; the items
/// assembled from the deltas are those of the final response.
#[tokio::test]
async fn a_stream_has_the_exact_event_sequence() {
    let server = Server::start(parsers()).await;
    let mut body = request("agent");
    body["stream"] = json!(true);
    let response = reqwest::Client::new().post(server.url("/v1/responses")).json(&body).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = response.text().await.unwrap();
    let events: Vec<(String, Value)> = text
        .split_terminator("\n\n")
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap();
            let name = event.strip_prefix("event: ").unwrap().to_owned();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect();
    for (i, (_, data)) in events.iter().enumerate() {
        assert_eq!(data["sequence_number"].as_u64(), Some(i as u64));
    }
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let mut want = vec!["response.created", "response.in_progress"];
    want.extend(["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta"]);
    let deltas = |names: &[&str], from: usize, name: &str| names[from..].iter().take_while(|n| **n == name).count();
    let reasoning_deltas = deltas(&names, 4, "response.reasoning_text.delta");
    assert!(reasoning_deltas >= 1);
    want.extend(std::iter::repeat_n("response.reasoning_text.delta", reasoning_deltas - 1));
    want.extend([
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]);
    let text_deltas = deltas(&names, want.len(), "response.output_text.delta");
    assert!(text_deltas >= 1);
    want.extend(std::iter::repeat_n("response.output_text.delta", text_deltas));
    want.extend(["response.output_text.done", "response.content_part.done", "response.output_item.done"]);
    // Each call's arguments stream in pieces.
    for _ in 0..2 {
        want.push("response.output_item.added");
        let argument_deltas = deltas(&names, want.len(), "response.function_call_arguments.delta");
        assert!(argument_deltas >= 1);
        want.extend(std::iter::repeat_n("response.function_call_arguments.delta", argument_deltas));
        want.extend(["response.function_call_arguments.done", "response.output_item.done"]);
    }
    want.push("response.completed");
    assert_eq!(names, want);
    assert_eq!(events[0].1["response"]["status"], "in_progress");

    let completed = &events.last().unwrap().1["response"];
    assert_eq!(completed["status"], "completed");
    let done: Vec<&Value> =
        events.iter().filter(|(n, _)| n == "response.output_item.done").map(|(_, d)| &d["item"]).collect();
    assert_eq!(completed["output"].as_array().unwrap().iter().collect::<Vec<_>>(), done);
    let streamed: String = events
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, completed["output"][1]["content"][0]["text"].as_str().unwrap());
    let arguments: String = events
        .iter()
        .filter(|(n, d)| n == "response.function_call_arguments.delta" && d["output_index"] == 3)
        .map(|(_, d)| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(arguments, completed["output"][3]["arguments"].as_str().unwrap(), "the pieces add up to the arguments");
    // Every item's events carry its index and id.
    for (name, data) in &events {
        if name.contains("output_item") {
            let index = data["output_index"].as_u64().unwrap() as usize;
            assert_eq!(data["item"]["id"], completed["output"][index]["id"], "{name}");
        }
    }
}

/// A length stop is `incomplete`, with the reason, in the body and as the stream's last event.
#[tokio::test]
async fn a_length_stop_is_incomplete() {
    let server = Server::start(FrontendSection::default()).await;
    let mut body = request("fake");
    body["max_output_tokens"] = json!(3);
    let (status, value) = post(&server, &body).await;
    assert_eq!(status, 200, "{value}");
    assert_eq!(value["status"], "incomplete");
    assert_eq!(value["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(value["usage"]["output_tokens"], 3);
    body["stream"] = json!(true);
    let text = reqwest::Client::new().post(server.url("/v1/responses")).json(&body).send().await.unwrap();
    let text = text.text().await.unwrap();
    let last = text.split_terminator("\n\n").last().unwrap();
    assert!(last.starts_with("event: response.incomplete\n"), "{last}");
}

/// `previous_response_id` continues a stored response: its conversation, this response's
/// output included, comes before the new input, and the prompt is the previous one plus the
/// generated tokens (spliced) plus the new turn.
#[tokio::test]
async fn previous_response_id_continues_the_conversation() {
    let server = Server::start(parsers()).await;
    let (_, first) = post(&server, &request("agent")).await;
    let before = server.fake.last().prompt;
    let generated = dynamo_node::tokenizer::Tokenizer::builtin().encode(support::AGENT_ANSWER).unwrap();
    let outputs: Vec<Value> = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .map(|c| json!({"type": "function_call_output", "call_id": c["call_id"], "output": "a.rs b.rs"}))
        .collect();
    let next = json!({
        "model": "agent", "instructions": "You are a coding agent.", "previous_response_id": first["id"], "input": outputs,
        "tools": request("agent")["tools"],
    });
    let (status, second) = post(&server, &next).await;
    assert_eq!(status, 200, "{second}");
    assert_eq!(second["previous_response_id"], first["id"]);
    let after = server.fake.last().prompt;
    let mut expected = before.clone();
    expected.extend(&generated);
    assert!(after.len() > expected.len(), "the new turn follows");
    assert_eq!(after[..expected.len()], expected[..], "the previous prompt and its generated tokens, unchanged");
    let text = dynamo_node::tokenizer::Tokenizer::builtin().decode(&after[expected.len()..]).unwrap();
    assert!(text.contains("a.rs b.rs"), "{text}");

    // Unknown ids are 404; store: false with a previous id is 400.
    let mut unknown = next.clone();
    unknown["previous_response_id"] = json!("resp_missing");
    let (status, value) = post(&server, &unknown).await;
    assert_eq!(status, 404, "{value}");
    assert_eq!(value["error"]["code"], "previous_response_not_found");
    assert_eq!(value["error"]["param"], "previous_response_id");
    let mut stateless = next.clone();
    stateless["store"] = json!(false);
    let (status, value) = post(&server, &stateless).await;
    assert_eq!(status, 400, "{value}");
    assert_eq!(value["error"]["param"], "previous_response_id");
}

/// Errors in the OpenAI shape: unknown model 404, a bad role 400, background 501, an empty
/// input 400, admission refused 429 with Retry-After.
#[tokio::test]
async fn errors_have_the_openai_shape() {
    let server = Server::start(FrontendSection::default()).await;
    let (status, value) = post(&server, &request("nope")).await;
    assert_eq!((status, value["error"]["code"].as_str()), (404, Some("model_not_found")), "{value}");
    let (status, value) = post(&server, &json!({"model": "fake", "input": [{"role": "robot", "content": "hi"}]})).await;
    assert_eq!((status, value["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{value}");
    let (status, value) = post(&server, &json!({"model": "fake", "input": "hi", "background": true})).await;
    assert_eq!((status, value["error"]["param"].as_str()), (501, Some("background")), "{value}");
    let (status, value) = post(&server, &json!({"model": "fake", "input": []})).await;
    assert_eq!(status, 400, "{value}");
    let (status, value) =
        post(&server, &json!({"model": "fake", "input": "hi", "tool_choice": {"type": "function", "name": "nope"}}))
            .await;
    assert_eq!((status, value["error"]["param"].as_str()), (400, Some("tool_choice")), "{value}");
    let response = reqwest::Client::new()
        .post(server.url("/v1/responses"))
        .json(&json!({"model": "overloaded", "input": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "3");
}
