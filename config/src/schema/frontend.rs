//! `[frontend]`: the HTTP API.

use serde::{Deserialize, Serialize};

use crate::{ByteSize, HumanDuration};

/// `[frontend]`: the HTTP API (OpenAI chat and Responses, Anthropic Messages).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FrontendSection {
    /// Listen address, `ip:port`. Default `"127.0.0.1:8000"`.
    pub http: String,
    /// Largest request body accepted. Default `"32MiB"`.
    pub max_body: ByteSize,
    /// A request that has not finished by then is cancelled. Default `"600s"`.
    pub request_timeout: HumanDuration,
    /// A session without requests for this long ends and releases its holds. Default `"10m"`.
    pub session_idle_timeout: HumanDuration,
    /// `max_tokens` of a request that does not set one. Default `512`.
    pub default_max_tokens: usize,
}

impl Default for FrontendSection {
    fn default() -> Self {
        FrontendSection {
            http: "127.0.0.1:8000".to_owned(),
            max_body: ByteSize::mib(32),
            request_timeout: HumanDuration::secs(600),
            session_idle_timeout: HumanDuration::mins(10),
            default_max_tokens: 512,
        }
    }
}
