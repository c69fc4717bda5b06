//! Real checkpoint formats served as `transformers` serves them. For each architecture the
//! reference engine computes (Llama with Llama 3.1's scaled RoPE, Qwen2 with its q/k/v biases and
//! tied embeddings, Qwen3 with its per-head norms and explicit head size, Mistral with its
//! SentencePiece-style tokenizer), `tests/checkpoints/make_checkpoint.py` saves a tiny random
//! model exactly as `transformers` 5 does (bf16 safetensors, `config.json`,
//! `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`, the family's own
//! `chat_template.jinja`) and records what `transformers` makes of it: `apply_chat_template`'s
//! prompt ids for conversations with a system message, tools, tool calls and results, reasoning
//! and several turns; `generate`'s greedy continuation (it stops at the model's end of turn);
//! the last position's logits. The node is pointed at the directory and must agree:
//!
//! - in process: the weights loaded by the engine give the same last-position logits (within
//!   1e-3 of their scale: the node computes in f32 from the bf16 file, as `transformers` does
//!   with `dtype=float32`) and the same greedy tokens;
//! - over HTTP, Chat Completions: the same prompt ids (vLLM's `return_token_ids`), the same
//!   answer ids and finish reason, the same text (`skip_special_tokens`), no special token in it;
//! - Anthropic Messages and Responses: the same text and input token counts (`count_tokens`
//!   too) for the conversations those APIs can carry.
//!
//! `transformers` and `torch` come from the vLLM environment `.ci/run` builds
//! (`$DYNAMO_VLLM_PYTHON`, else `~/.cache/dynamo-node/vllm-venv/bin/python`); the tests are
//! ignored by default and run by `.ci/run` with `--run-ignored only`. Without that Python they
//! fail: they never pass silently.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use dynamo_kernels::cpu::CpuBackend;
use dynamo_kernels::model::llama::Llama;
use dynamo_kernels::model::weights::HostWeights;
use dynamo_kernels::sampling::{Sampling, SeededRng, sample_in};
use dynamo_tests::Node;
// transformers and torch come with vLLM's environment.
use dynamo_tests::vllm::{python, repo};
use serde_json::{Value, json};

/// A tiny `arch` checkpoint in `dir/arch`, and `transformers`' reference for it.
fn checkpoint(dir: &Path, arch: &str) -> (PathBuf, Value) {
    let model = dir.join(arch);
    let output = Command::new(python())
        .arg(repo().join("tests/checkpoints/make_checkpoint.py"))
        .arg(arch)
        .arg(&model)
        .output()
        .expect("run make_checkpoint.py");
    assert!(
        output.status.success(),
        "make_checkpoint.py {arch} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    for file in
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    {
        assert!(model.join(file).is_file(), "transformers 5 writes {file}");
    }
    let reference = std::fs::read_to_string(model.join("reference.json")).expect("reference.json");
    (model, serde_json::from_str(&reference).expect("reference JSON"))
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().expect("a list of ids").iter().map(|v| v.as_u64().expect("an id") as u32).collect()
}

/// The output ids without the end-of-turn token `generate` ends with.
fn answer_ids(case: &Value) -> Vec<u32> {
    let mut out = ids(&case["output_ids"]);
    if case["finish_reason"] == "stop" {
        out.pop();
    }
    out
}

/// The engine, in process: last-position logits and greedy tokens of every case.
fn check_engine(model: &Path, reference: &Value) {
    let weights = HostWeights::load(model).expect("load the checkpoint");
    let llama = Llama::new(CpuBackend::new(2), &weights).expect("model");
    let generation: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("generation_config.json")).unwrap()).unwrap();
    let eos: Vec<u32> = match &generation["eos_token_id"] {
        Value::Array(_) => ids(&generation["eos_token_id"]),
        id => vec![id.as_u64().expect("an eos id") as u32],
    };
    // `generate(do_sample=False)` applies the model's repetition penalty, as the node does.
    let how = Sampling {
        repetition_penalty: generation["repetition_penalty"].as_f64().unwrap_or(1.0) as f32,
        ..Sampling::GREEDY
    };
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        let block = 32;
        let blocks = (prompt.len() + 40).div_ceil(block);
        let mut kv = llama.kv_pool(block, blocks).expect("pool");
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut logits = llama.forward(&mut kv, &prompt, 0, &table, block).expect("forward");
        let want: Vec<f32> =
            case["last_logits"].as_array().expect("logits").iter().map(|v| v.as_f64().unwrap() as f32).collect();
        assert_eq!(logits.len(), want.len(), "{name}: vocabulary");
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = logits.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= 1e-3 * scale.max(1.0), "{name}: last-position logits differ by {err} (scale {scale})");
        let mut tokens = Vec::new();
        let want_ids = ids(&case["output_ids"]);
        for step in 0..want_ids.len() {
            let sequence: Vec<u32> = prompt.iter().chain(&tokens).copied().collect();
            let next = sample_in(&logits, None, how, &sequence, &mut SeededRng::new(0));
            tokens.push(next);
            if eos.contains(&next) || step + 1 == want_ids.len() {
                break;
            }
            logits = llama.forward(&mut kv, &[next], prompt.len() + step, &table, block).expect("decode");
        }
        assert_eq!(tokens, want_ids, "{name}: greedy tokens");
    }
}

fn config(model: &Path) -> String {
    format!("[model]\nname = \"ckpt\"\npath = \"{}\"\n[engine]\nworkers = 1\ndevice = \"cpu\"\n", model.display())
}

async fn post(node: &Node, path: &str, body: Value) -> Value {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", node.api))
        .header("x-api-key", "test")
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .expect("request");
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.expect("JSON");
    assert_eq!(status, 200, "{path}: {body}");
    body
}

/// Every special token's text, from the tokenizer the checkpoint ships.
fn special_texts(model: &Path) -> Vec<String> {
    let tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("tokenizer.json")).unwrap()).unwrap();
    tokenizer["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["special"] == true)
        .map(|t| t["content"].as_str().unwrap().to_owned())
        .collect()
}

/// The node over HTTP: the three APIs against the reference.
async fn check_node(model: &Path, reference: &Value) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let node = Node::start_in(dir, &config(model));
    assert!(
        node.announced.iter().any(|l| l.starts_with("chat template: ") && l.contains("chat_template.jinja")),
        "the node names the template it uses: {:?}",
        node.announced
    );
    let specials = special_texts(model);
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["name"].as_str().unwrap();
        let mut body = json!({
            "model": "ckpt", "messages": case["messages"], "temperature": 0, "max_tokens": 32,
            "return_token_ids": true,
        });
        if !case["tools"].is_null() {
            body["tools"] = case["tools"].clone();
        }
        if !case["chat_template_kwargs"].is_null() {
            body["chat_template_kwargs"] = case["chat_template_kwargs"].clone();
        }
        let chat = post(&node, "/chat/completions", body).await;
        assert_eq!(ids(&chat["prompt_token_ids"]), ids(&case["prompt_ids"]), "{name}: prompt ids");
        let mut got = ids(&chat["choices"][0]["token_ids"]);
        if case["finish_reason"] == "stop" {
            assert_eq!(got.last(), ids(&case["output_ids"]).last(), "{name}: ends on the end-of-turn token");
            got.pop();
        }
        assert_eq!(got, answer_ids(case), "{name}: answer ids");
        assert_eq!(chat["choices"][0]["finish_reason"], case["finish_reason"], "{name}");
        let message = &chat["choices"][0]["message"];
        let text = message["content"].as_str().unwrap_or_default();
        let want_text = case["text"].as_str().unwrap();
        // A random model writes invalid UTF-8 byte tokens; `tokenizers`' byte fallback turns a
        // whole invalid run into U+FFFD when decoding all at once, while a stream has already
        // sent the valid bytes before it. The ids above are compared either way.
        if !want_text.contains('\u{FFFD}') {
            assert_eq!(text, want_text, "{name}: text");
        }
        for special in &specials {
            assert!(!text.contains(special.as_str()), "{name}: {special} in the answer's text");
        }
        assert_eq!(chat["usage"]["prompt_tokens"], case["prompt_ids"].as_array().unwrap().len(), "{name}");
    }

    // The same conversations through the Anthropic and Responses APIs, where they carry them:
    // a system prompt and plain turns.
    for case in reference["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        if !case["tools"].is_null() || !case["chat_template_kwargs"].is_null() {
            continue;
        }
        let messages = case["messages"].as_array().unwrap();
        if messages.iter().any(|m| m.get("reasoning_content").is_some() || m.get("tool_calls").is_some()) {
            continue;
        }
        let system: Vec<&Value> = messages.iter().filter(|m| m["role"] == "system").map(|m| &m["content"]).collect();
        let turns: Vec<Value> = messages
            .iter()
            .filter(|m| m["role"] != "system")
            .map(|m| json!({"role": m["role"], "content": m["content"]}))
            .collect();
        let prompt_tokens = case["prompt_ids"].as_array().unwrap().len();
        let want_text = case["text"].as_str().unwrap();

        let mut body = json!({"model": "ckpt", "messages": turns, "max_tokens": 32, "temperature": 0});
        if let Some(system) = system.first() {
            body["system"] = (*system).clone();
        }
        let counted = post(&node, "/messages/count_tokens", body.clone()).await;
        assert_eq!(counted["input_tokens"], prompt_tokens, "{name}: count_tokens");
        let message = post(&node, "/messages", body).await;
        // Anthropic counts the prompt's cached part apart from `input_tokens`.
        let usage = &message["usage"];
        let input = ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"]
            .iter()
            .map(|k| usage[*k].as_u64().unwrap_or(0))
            .sum::<u64>();
        assert_eq!(input, prompt_tokens as u64, "{name}: Messages input tokens ({usage})");
        let text: String = message["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "text")
            .map(|b| b["text"].as_str().unwrap())
            .collect();
        if !want_text.contains('\u{FFFD}') {
            assert_eq!(text, want_text, "{name}: Messages text");
        }
        let stop = if case["finish_reason"] == "stop" { "end_turn" } else { "max_tokens" };
        assert_eq!(message["stop_reason"], stop, "{name}");

        let mut body = json!({"model": "ckpt", "input": turns, "max_output_tokens": 32, "temperature": 0});
        if let Some(system) = system.first() {
            body["instructions"] = (*system).clone();
        }
        let response = post(&node, "/responses", body).await;
        assert_eq!(response["usage"]["input_tokens"], prompt_tokens, "{name}: Responses input tokens");
        let text: String = response["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|item| item["type"] == "message")
            .flat_map(|item| item["content"].as_array().unwrap().iter())
            .filter_map(|part| part["text"].as_str())
            .collect();
        if !want_text.contains('\u{FFFD}') {
            assert_eq!(text, want_text, "{name}: Responses text");
        }
    }
}

fn serves_like_transformers(arch: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (model, reference) = checkpoint(dir.path(), arch);
    assert_eq!(reference["arch"], arch);
    assert!(reference["cases"].as_array().is_some_and(|c| c.len() >= 4), "cases of {arch}");
    assert!(
        reference["cases"].as_array().unwrap().iter().any(|c| c["finish_reason"] == "stop"),
        "{arch}: some answer ends on the model's end of turn"
    );
    check_engine(&model, &reference);
    tokio::runtime::Runtime::new().unwrap().block_on(check_node(&model, &reference));
}

#[test]
#[ignore = "needs transformers and torch: .ci/run installs them"]
fn llama_with_llama3_rope_serves_like_transformers() {
    serves_like_transformers("llama");
}

#[test]
#[ignore = "needs transformers and torch: .ci/run installs them"]
fn qwen2_with_biases_and_tied_embeddings_serves_like_transformers() {
    serves_like_transformers("qwen2");
}

#[test]
#[ignore = "needs transformers and torch: .ci/run installs them"]
fn qwen3_with_head_norms_serves_like_transformers() {
    serves_like_transformers("qwen3");
}

#[test]
#[ignore = "needs transformers and torch: .ci/run installs them"]
fn mistral_serves_like_transformers() {
    serves_like_transformers("mistral");
}

/// A checkpoint the engine cannot compute, or with a broken file, stops the node at start with
/// a message that names the file and the reason.
#[test]
fn unservable_checkpoints_fail_at_start_naming_the_file() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let model = dir.path().join("moe");
    std::fs::create_dir(&model).unwrap();
    let start = |model: &Path| {
        let output = Node::command(&dir, &config(model)).output().expect("run the node");
        assert!(!output.status.success(), "the node refuses {}", model.display());
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let base = json!({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "intermediate_size": 128, "vocab_size": 300});
    let mut moe = base.clone();
    moe["architectures"] = json!(["Qwen3MoeForCausalLM"]);
    moe["num_experts"] = json!(8);
    std::fs::write(model.join("config.json"), moe.to_string()).unwrap();
    let err = start(&model);
    assert!(err.contains("Qwen3MoeForCausalLM") && err.contains("config.json") && err.contains("vLLM"), "{err}");

    std::fs::write(model.join("config.json"), "{\n  \"hidden_size\": 64,\n  oops\n}").unwrap();
    let err = start(&model);
    assert!(err.contains("config.json") && err.contains("line 3"), "{err}");

    let mut llama = base.clone();
    llama["architectures"] = json!(["LlamaForCausalLM"]);
    std::fs::write(model.join("config.json"), llama.to_string()).unwrap();
    let err = start(&model);
    assert!(err.contains("safetensors"), "no weights: {err}");

    HostWeights::random(
        dynamo_config::ModelShape {
            name: "x",
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 300,
        },
        1,
    )
    .save_safetensors(&model, dynamo_config::Dtype::Bf16)
    .unwrap();
    std::fs::write(model.join("generation_config.json"), "{\"eos_token_id\": \"</s>\"}").unwrap();
    let err = start(&model);
    assert!(err.contains("generation_config.json") && err.contains("eos_token_id"), "{err}");
}
