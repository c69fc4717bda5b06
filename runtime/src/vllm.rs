//! Attaching to vLLM engines (`engine.kind = "vllm"`, `[engine.vllm] urls`): before the node
//! serves, each engine must be up and serve the checkpoint the node reads (`model.path`): the same
//! tokenizer, the same vocabulary. What the node learns here (each engine's context length)
//! bounds its prompts.

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
}

/// Checks every engine of `vllm`: up within `start_timeout`, serving one model whose
/// tokenizer agrees with `tokenizer` (where the engine can tokenize: one started with
/// `--tokens-only` cannot, and then only the vocabulary bound guards its ids).
pub async fn attach(vllm: &VllmSection, tokenizer: &Tokenizer) -> anyhow::Result<Vec<Attached>> {
    let client = reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).build()?;
    let mut attached = Vec::with_capacity(vllm.urls.len());
    for url in &vllm.urls {
        let url = url.trim_end_matches('/').to_owned();
        let found = attach_one(&client, vllm, &url, tokenizer)
            .await
            .with_context(|| format!("engine {url} (engine.vllm.urls)"))?;
        tracing::info!(url, model = found.model, max_model_len = found.max_model_len, "attached to a vLLM engine");
        attached.push(found);
    }
    Ok(attached)
}

async fn attach_one(
    client: &reqwest::Client,
    vllm: &VllmSection,
    url: &str,
    tokenizer: &Tokenizer,
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
    Ok(Attached { url: url.to_owned(), model, max_model_len })
}
