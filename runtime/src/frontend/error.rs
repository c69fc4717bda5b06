//! Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the status
//! the OpenAI API uses for the same condition.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::generate::GenerateError;

/// An API error, answered as `{"error": {...}}` with its HTTP status.
#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// `type`: `invalid_request_error`, `not_found_error`, `rate_limit_error` or `server_error`.
    pub kind: &'static str,
    /// `param`: the request field at fault, when there is one.
    pub param: Option<String>,
    /// `code`: a stable machine-readable code, when there is one.
    pub code: Option<&'static str>,
    /// Sent as `Retry-After` (whole seconds, at least 1).
    pub retry_after: Option<Duration>,
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            retry_after: None,
        }
    }

    /// An `invalid_request_error` with another status than 400 (405, 408, 413, 415, 403, …) and
    /// a stable `code`.
    pub fn status(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code: Some(code), ..ApiError::invalid(message, None) }
    }

    /// 503 `unavailable` with `Retry-After`.
    pub fn unavailable(message: impl Into<String>, retry_after: Duration) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "service_unavailable",
            param: None,
            code: Some("unavailable"),
            retry_after: Some(retry_after),
        }
    }

    /// 404 `model_not_found`. A long name is shortened in the message (it is the client's own).
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{}` does not exist or you do not have access to it.", clip(model, 256)),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// 400 `context_length_exceeded`.
    pub fn context_length(tokens: usize, limit: usize, param: &str) -> ApiError {
        ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::invalid(
                format!(
                    "This model's maximum context length is {limit} tokens. However, your prompt resulted in \
                     {tokens} tokens, which leaves no room for the completion. Please reduce the length of the prompt."
                ),
                Some(param),
            )
        }
    }

    /// 500 `server_error`.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("internal_error"),
            retry_after: None,
        }
    }

    /// The `{"error": {...}}` body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<GenerateError> for ApiError {
    fn from(e: GenerateError) -> ApiError {
        match e {
            GenerateError::Overloaded { retry_after } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: e.to_string(),
                kind: "rate_limit_error",
                param: None,
                code: Some("overloaded"),
                retry_after: Some(retry_after),
            },
            GenerateError::ModelNotFound(model) => ApiError::model_not_found(&model),
            GenerateError::PromptTooLong { tokens, limit } => ApiError::context_length(tokens, limit, "messages"),
            GenerateError::Unavailable { retry_after, .. } => ApiError::unavailable(e.to_string(), retry_after),
            GenerateError::Internal(message) => ApiError::internal(message),
        }
    }
}

/// `text` cut to at most `max` bytes (on a character boundary), with `…` when cut.
pub fn clip(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len()).into()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(after) = self.retry_after {
            // Round up: a client must not retry before the server said it may.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response
    }
}
