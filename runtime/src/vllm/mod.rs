//! Attaching to vLLM engines (`engine.kind = "vllm"`, `[engine.vllm] urls`): before the node
//! serves, each engine must be up and serve the checkpoint the node reads (`model.path`): the same
//! tokenizer, the same vocabulary. What the node learns here (each engine's context length)
//! bounds its prompts.

pub mod guard;
pub mod launch;

use std::time::Duration;

use anyhow::{Context, bail};
use dynamo_config::VllmSection;
use serde_json::{Value, json};

use crate::tokenizer::Tokenizer;

/// Text the node and each engine tokenize at start: if they disagree, the engine serves another
/// model (or another revision of it).
const PROBE: &str = "Tool call 42: read_file(\"src/main.rs\") -> héllo wörld, ¿qué? 日本語 <|end|>";

/// One engine, as found at start.
#[derive(Clone, Debug)]
pub struct Attached {
    /// Its URL.
    pub url: String,
    /// The model name it serves.
    pub model: String,
    /// Its context length in tokens (`max_model_len`).
    pub max_model_len: usize,
    /// Its prefill rate, timed at start on a prompt its cache cannot hold (tokens per second).
    pub prefill_tokens_per_s: f64,
    /// Its time per generated token, timed at start.
    pub decode_step: Duration,
    /// Where its KV events can be followed, when it publishes them to a subscriber that connects
    /// (`--kv-events-config` with an endpoint such as `tcp://*:5557`).
    pub kv_events: Option<String>,
}

/// Checks every engine of `vllm`: up within `start_timeout`, serving one model whose
/// tokenizer agrees with `tokenizer` (where the engine can tokenize: one started with
/// `--tokens-only` cannot, and then only the vocabulary bound guards its ids).
/// Each engine's KV events are followed only when its blocks are `block_tokens` long, the node's
/// (`blocks.block_size`): the router names a prompt's blocks at that size.
pub async fn attach(vllm: &VllmSection, tokenizer: &Tokenizer, block_tokens: usize) -> anyhow::Result<Vec<Attached>> {
    let client = reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).build()?;
    let urls = vllm.engine_urls();
    let mut attached = Vec::with_capacity(urls.len());
    for (i, url) in urls.into_iter().enumerate() {
        let found = attach_one(&client, vllm, &url, tokenizer, block_tokens).await.with_context(|| {
            if vllm.launches() {
                format!(
                    "engine {i} at {url}, launched by the node (engine.vllm.launch; its output is in the node's log)"
                )
            } else {
                format!("engine {url} (engine.vllm.urls)")
            }
        })?;
        tracing::info!(
            url,
            model = found.model,
            max_model_len = found.max_model_len,
            prefill_tokens_per_s = found.prefill_tokens_per_s.round(),
            decode_ms = found.decode_step.as_secs_f64() * 1e3,
            kv_events = found.kv_events.as_deref().unwrap_or("none"),
            "attached to a vLLM engine"
        );
        attached.push(found);
    }
    Ok(attached)
}

async fn attach_one(
    client: &reqwest::Client,
    vllm: &VllmSection,
    url: &str,
    tokenizer: &Tokenizer,
    block_tokens: usize,
) -> anyhow::Result<Attached> {
    let get = |path: &str| {
        let request = client.get(format!("{url}{path}")).timeout(Duration::from_secs(10));
        match &vllm.api_key {
            Some(key) => request.bearer_auth(key),
            None => request,
        }
    };
    let deadline = tokio::time::Instant::now() + vllm.start_timeout.as_duration();
    loop {
        match get("/health").send().await {
            Ok(response) if response.status().is_success() => break,
            outcome if tokio::time::Instant::now() >= deadline => {
                let why = match outcome {
                    Ok(response) => format!("/health answered {}", response.status()),
                    Err(e) => e.to_string(),
                };
                bail!("not healthy within engine.vllm.start_timeout ({:?}): {why}", vllm.start_timeout.as_duration());
            }
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    let models: Value = get("/v1/models").send().await?.error_for_status()?.json().await?;
    let first = models.pointer("/data/0").context("/v1/models lists no model")?;
    let model = first.get("id").and_then(Value::as_str).unwrap_or_default().to_owned();
    let max_model_len =
        first.get("max_model_len").and_then(Value::as_u64).context("/v1/models gives no max_model_len")? as usize;
    let mut tokenize = client.post(format!("{url}/tokenize")).timeout(Duration::from_secs(10));
    if let Some(key) = &vllm.api_key {
        tokenize = tokenize.bearer_auth(key);
    }
    let response = tokenize.json(&json!({"model": model, "prompt": PROBE, "add_special_tokens": false})).send().await?;
    if response.status().is_success() {
        let theirs: Value = response.json().await?;
        let theirs: Vec<u32> = serde_json::from_value(theirs.get("tokens").cloned().unwrap_or_default())
            .context("/tokenize gave no token ids")?;
        let ours = tokenizer.encode(PROBE)?;
        if theirs != ours {
            bail!(
                "it serves `{model}`, whose tokenizer is not model.path's ({} tokenizes a probe as {:?}, the engine as \
                 {:?}): point both at the same checkpoint",
                tokenizer.name(),
                &ours[..ours.len().min(12)],
                &theirs[..theirs.len().min(12)]
            );
        }
    } else {
        tracing::warn!(url, status = %response.status(), "the engine cannot tokenize (--tokens-only?): its tokenizer is not checked");
    }
    let kv_events = match get("/kv_event_sources").send().await {
        Ok(response) if response.status().is_success() => kv_events(url, &response.json().await?),
        _ => None,
    };
    if kv_events.is_some() {
        let metrics = get("/metrics").send().await?.error_for_status()?.text().await?;
        let theirs = dynamo_actors::vllm_metrics::label_of(&metrics, "vllm:cache_config_info{", "block_size")
            .and_then(|b| b.parse::<usize>().ok());
        if theirs.is_some_and(|theirs| theirs != block_tokens) {
            bail!(
                "its KV blocks are {} tokens and the node's {block_tokens} (blocks.block_size): the router could not \
                 name what the engine caches; set blocks.block_size = {} (or start it with --block-size {block_tokens})",
                theirs.unwrap_or_default(),
                theirs.unwrap_or_default()
            );
        }
    } else {
        tracing::warn!(
            url,
            "the engine publishes no KV events the node can follow (--kv-events-config with an endpoint such as \
             tcp://*:5557): routing does not see its cache"
        );
    }
    let vocab = tokenizer.vocab_size();
    let (prefill_tokens_per_s, decode_step) = time_engine(client, vllm, url, vocab, max_model_len).await?;
    Ok(Attached { url: url.to_owned(), model, max_model_len, prefill_tokens_per_s, decode_step, kv_events })
}

/// Times the engine at `url` as the router prices it: a prefill of [`TIMED_PROMPT`] tokens (under
/// a fresh cache salt, so nothing of it is cached) that generates one token, then a short prompt
/// that generates [`TIMED_DECODE`]. The best of two tries each, so a cold first request does not
/// stand for the engine.
async fn time_engine(
    client: &reqwest::Client,
    vllm: &VllmSection,
    url: &str,
    vocab: usize,
    max_model_len: usize,
) -> anyhow::Result<(f64, Duration)> {
    let prompt_len = TIMED_PROMPT.min(max_model_len.saturating_sub(TIMED_DECODE + 1)).max(1);
    let mut best = (0.0f64, Duration::MAX);
    for attempt in 0..2u64 {
        let salt = format!("dynamo-node-timing-{}-{attempt}", dynamo_actors::worker::unix_millis());
        // Ids spread over the vocabulary, past the first few (often special tokens).
        let ids = |n: usize, seed: u64| -> Vec<u64> {
            let span = vocab.saturating_sub(8).max(1) as u64;
            (0..n as u64).map(|i| 8 + (i * 7919 + seed * 31) % span).collect()
        };
        let run = |token_ids: Vec<u64>, max_tokens: usize| {
            let mut post =
                client.post(format!("{url}/inference/v1/generate")).timeout(Duration::from_secs(120)).json(&json!({
                    "token_ids": token_ids,
                    "cache_salt": salt,
                    "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "min_tokens": max_tokens,
                                        "detokenize": false},
                }));
            if let Some(key) = &vllm.api_key {
                post = post.bearer_auth(key);
            }
            async move {
                let started = std::time::Instant::now();
                post.send().await?.error_for_status()?.bytes().await?;
                anyhow::Ok(started.elapsed())
            }
        };
        let prefill = run(ids(prompt_len, attempt), 1).await.context("timing a prefill")?;
        let short = run(ids(4, attempt + 100), 1).await.context("timing a short request")?;
        let decode = run(ids(4, attempt + 200), TIMED_DECODE).await.context("timing decode")?;
        let rate = prompt_len as f64 / prefill.saturating_sub(short).max(Duration::from_micros(100)).as_secs_f64();
        let step = decode.saturating_sub(short) / (TIMED_DECODE as u32 - 1);
        best = (best.0.max(rate), best.1.min(step));
    }
    Ok(best)
}

/// Prompt tokens of the timed prefill.
const TIMED_PROMPT: usize = 512;
/// Tokens the timed decode generates.
const TIMED_DECODE: usize = 16;

/// The endpoint the node subscribes to for the engine at `url`, from its `/kv_event_sources`
/// (`{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}}`):
/// a publisher that binds all interfaces is reached at the engine's host. One that connects out
/// to a subscriber (an endpoint without `*`) would need the node to bind; it is not followed.
fn kv_events(url: &str, sources: &Value) -> Option<String> {
    let source = sources.get("0")?;
    if source.get("enable_kv_cache_events").and_then(Value::as_bool) != Some(true)
        || source.get("publisher").and_then(Value::as_str) != Some("zmq")
    {
        return None;
    }
    let endpoint = source.get("endpoint").and_then(Value::as_str)?;
    let host = url.trim_start_matches("http://").rsplit_once(':').map_or("127.0.0.1", |(host, _)| host);
    if let Some(rest) = endpoint.strip_prefix("tcp://*:") {
        return Some(format!("tcp://{host}:{rest}"));
    }
    endpoint.starts_with("ipc://").then(|| endpoint.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_publishing_on_all_interfaces_is_followed_at_its_host() {
        let sources = json!({"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}});
        assert_eq!(kv_events("http://10.0.0.7:8000", &sources).as_deref(), Some("tcp://10.0.0.7:5557"));
        let ipc = json!({"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "ipc:///run/kv.sock"}});
        assert_eq!(kv_events("http://127.0.0.1:8000", &ipc).as_deref(), Some("ipc:///run/kv.sock"));
        let connects =
            json!({"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://10.0.0.1:5557"}});
        assert_eq!(kv_events("http://10.0.0.7:8000", &connects), None, "it connects out: the node would have to bind");
        let off = json!({"0": {"enable_kv_cache_events": false, "publisher": "null"}});
        assert_eq!(kv_events("http://10.0.0.7:8000", &off), None);
    }
}
