//! What a checkpoint directory says about generation, read as `transformers` and vLLM read it:
//! the ids that end a turn (`eos_token_id` of `config.json` and `generation_config.json`, an int
//! or a list) and the sampling defaults of `generation_config.json` (temperature, top-p, top-k,
//! repetition penalty), which vLLM applies to requests that set none.
//!
//! The weights and the architecture are read by `dynamo_kernels::model::weights`, the tokenizer
//! and template by [`crate::tokenizer`] and [`crate::frontend::ChatTemplate`].

use std::path::{Path, PathBuf};

use crate::frontend::ir::SamplingRequest;

/// Why a checkpoint's generation files could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The file exists but could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid JSON (the message names the line and column), or a key has the
    /// wrong type.
    #[error("{}: {message}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The generation settings of a checkpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generation {
    /// Every `eos_token_id` of `config.json` and `generation_config.json`, in that order, once.
    pub eos_token_ids: Vec<u32>,
    /// `generation_config.json`'s sampling values (unset where it has none).
    pub sampling: SamplingRequest,
}

/// Reads `dir/config.json` and `dir/generation_config.json` (either may be absent).
pub fn read_generation(dir: &Path) -> Result<Generation, CheckpointError> {
    let mut generation = Generation { eos_token_ids: Vec::new(), sampling: SamplingRequest::unset(1.0) };
    for file in ["config.json", "generation_config.json"] {
        let path = dir.join(file);
        let Some(json) = read_json(&path)? else { continue };
        let invalid = |message: String| CheckpointError::Invalid { path: path.clone(), message };
        let ids = match json.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Vec::new(),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .map(token_id)
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| invalid("`eos_token_id` must be a token id or a list of token ids".into()))?,
            Some(id) => vec![token_id(id).ok_or_else(|| invalid("`eos_token_id` must be a token id".into()))?],
        };
        for id in ids {
            if !generation.eos_token_ids.contains(&id) {
                generation.eos_token_ids.push(id);
            }
        }
        if file == "generation_config.json" {
            let number = |key: &str| -> Result<Option<f64>, CheckpointError> {
                match json.get(key) {
                    None | Some(serde_json::Value::Null) => Ok(None),
                    Some(v) => v.as_f64().map(Some).ok_or_else(|| invalid(format!("`{key}` must be a number"))),
                }
            };
            let s = &mut generation.sampling;
            s.temperature = number("temperature")?.map(|t| t as f32);
            s.top_p = number("top_p")?.map(|p| p as f32);
            s.top_k = number("top_k")?.map(|k| k.max(0.0) as u32);
            s.repetition_penalty = number("repetition_penalty")?.map(|r| r as f32);
            if s.top_p.is_some_and(|p| !(p > 0.0 && p <= 1.0)) {
                return Err(invalid("`top_p` must be in (0, 1]".into()));
            }
            if s.temperature.is_some_and(|t| !(t >= 0.0 && t.is_finite())) {
                return Err(invalid("`temperature` must be 0 or more".into()));
            }
            if s.repetition_penalty.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
                return Err(invalid("`repetition_penalty` must be above 0".into()));
            }
        }
    }
    Ok(generation)
}

fn token_id(value: &serde_json::Value) -> Option<u32> {
    value.as_u64().and_then(|id| u32::try_from(id).ok())
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, CheckpointError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(CheckpointError::Io { path: path.to_owned(), source }),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| CheckpointError::Invalid { path: path.to_owned(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_eos_ids_and_sampling_defaults_as_transformers_writes_them() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            read_generation(dir.path()).unwrap(),
            Generation { sampling: SamplingRequest::unset(1.0), ..Default::default() }
        );
        std::fs::write(dir.path().join("config.json"), r#"{"eos_token_id": 7, "hidden_size": 8}"#).unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [9, 7, 8], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                "repetition_penalty": 1.05, "do_sample": true, "transformers_version": "5.19.0"}"#,
        )
        .unwrap();
        let g = read_generation(dir.path()).unwrap();
        assert_eq!(g.eos_token_ids, [7, 9, 8]);
        assert_eq!(
            (g.sampling.temperature, g.sampling.top_p, g.sampling.top_k, g.sampling.repetition_penalty),
            (Some(0.6), Some(0.9), Some(20), Some(1.05))
        );
        // A request's own value wins; what it leaves unset is the model's.
        let request = SamplingRequest { temperature: Some(0.0), ..SamplingRequest::unset(1.0) };
        let resolved = request.resolve(&g.sampling);
        assert_eq!((resolved.temperature, resolved.top_k), (0.0, 20));

        std::fs::write(dir.path().join("generation_config.json"), "{\n  \"eos_token_id\": \"x\"\n}").unwrap();
        let err = read_generation(dir.path()).unwrap_err().to_string();
        assert!(err.contains("generation_config.json") && err.contains("eos_token_id"), "{err}");
        std::fs::write(dir.path().join("generation_config.json"), "{\n  \"top_p\": 1.5,\n}").unwrap();
        let err = read_generation(dir.path()).unwrap_err().to_string();
        assert!(err.contains("line 3"), "names the line: {err}");
    }
}
