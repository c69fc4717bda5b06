//! The frontend's errors: one typed enum, rendered in each API's own shape.
//!
//! [`ApiError`] says what went wrong; [`ApiError::kind`] classifies it, and each protocol maps the
//! kind to its status and error type: OpenAI's `{"error": {"message", "type", "param", "code"}}`
//! ([`ApiError::openai_body`], also the default [`IntoResponse`]) and Anthropic's
//! `{"type": "error", "error": {"type", "message"}}` ([`ApiError::anthropic_response`], where a
//! refused admission is 529 `overloaded_error`).

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::generate::GenerateError;

/// What class of failure an [`ApiError`] is: decides its status and error type in every API.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The request is malformed or asks for something impossible (400).
    InvalidRequest,
    /// The request is refused before it is read (403 host, 405, 408, 413, 415, …): the status
    /// is the error's own.
    Refused,
    /// The model, route or object does not exist (404).
    NotFound,
    /// The request uses something this node does not implement (501).
    Unsupported,
    /// The generator refused admission (429; Anthropic 529).
    Overloaded,
    /// The node cannot serve now (503).
    Unavailable,
    /// The request did not finish in time (504).
    Timeout,
    /// A fault of the node (500).
    Internal,
}

/// An API error.
#[derive(Clone, Debug, PartialEq)]
pub enum ApiError {
    /// 400 `invalid_request_error`.
    Invalid {
        /// Human-readable message.
        message: String,
        /// The request field at fault.
        param: Option<String>,
    },
    /// 400 `context_length_exceeded`: the prompt does not fit the context (or
    /// `frontend.max_prompt_tokens`, with `server_limit`).
    ContextLength {
        /// Prompt tokens.
        tokens: usize,
        /// The limit.
        limit: usize,
        /// The field holding the prompt.
        param: String,
        /// The limit is the server's `frontend.max_prompt_tokens`, not the model's context.
        server_limit: bool,
    },
    /// 404 `model_not_found`.
    ModelNotFound(String),
    /// 404 for an unknown route or object (`code`: `unknown_url`, `response_not_found`, …).
    NotFound {
        /// A stable code.
        code: &'static str,
        /// Human-readable message.
        message: String,
        /// The request field naming it.
        param: Option<String>,
    },
    /// A refusal with its own status and a stable code (403, 405, 408, 413, 415, 431, …).
    Refused {
        /// HTTP status.
        status: StatusCode,
        /// A stable code.
        code: &'static str,
        /// Human-readable message.
        message: String,
    },
    /// 501: a field this node does not implement.
    Unsupported {
        /// Human-readable message.
        message: String,
        /// The field.
        param: String,
    },
    /// 429: admission refused; retry after the given time.
    Overloaded {
        /// Human-readable message.
        message: String,
        /// Sent as `Retry-After`.
        retry_after: Duration,
    },
    /// 503 with `Retry-After`.
    Unavailable {
        /// Human-readable message.
        message: String,
        /// Sent as `Retry-After`.
        retry_after: Duration,
    },
    /// 504: `frontend.request_timeout` passed.
    Timeout,
    /// 500.
    Internal(String),
}

impl ApiError {
    /// 400 `invalid_request_error`.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError::Invalid { message: message.into(), param: param.map(str::to_owned) }
    }

    /// A refusal with `status` and a stable `code` (405, 408, 413, 415, 403, …).
    pub fn refused(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::Refused { status, code, message: message.into() }
    }

    /// 503 with `Retry-After`.
    pub fn unavailable(message: impl Into<String>, retry_after: Duration) -> ApiError {
        ApiError::Unavailable { message: message.into(), retry_after }
    }

    /// 404 `model_not_found`.
    pub fn model_not_found(model: &str) -> ApiError {
        ApiError::ModelNotFound(model.to_owned())
    }

    /// 400 `context_length_exceeded` against the model's context.
    pub fn context_length(tokens: usize, limit: usize, param: &str) -> ApiError {
        ApiError::ContextLength { tokens, limit, param: param.to_owned(), server_limit: false }
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::Internal(message.into())
    }

    /// The class of failure.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ApiError::Invalid { .. } | ApiError::ContextLength { .. } => ErrorKind::InvalidRequest,
            ApiError::ModelNotFound(_) | ApiError::NotFound { .. } => ErrorKind::NotFound,
            ApiError::Refused { .. } => ErrorKind::Refused,
            ApiError::Unsupported { .. } => ErrorKind::Unsupported,
            ApiError::Overloaded { .. } => ErrorKind::Overloaded,
            ApiError::Unavailable { .. } => ErrorKind::Unavailable,
            ApiError::Timeout => ErrorKind::Timeout,
            ApiError::Internal(_) => ErrorKind::Internal,
        }
    }

    /// The HTTP status (OpenAI's; [`anthropic_response`](Self::anthropic_response) maps 429 to 529).
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Refused { status, .. } => *status,
            _ => match self.kind() {
                ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
                ErrorKind::NotFound => StatusCode::NOT_FOUND,
                ErrorKind::Unsupported => StatusCode::NOT_IMPLEMENTED,
                ErrorKind::Overloaded => StatusCode::TOO_MANY_REQUESTS,
                ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
                ErrorKind::Internal | ErrorKind::Refused => StatusCode::INTERNAL_SERVER_ERROR,
            },
        }
    }

    /// The human-readable message. The client's own strings in it are shortened ([`clip`]).
    pub fn message(&self) -> String {
        match self {
            ApiError::Invalid { message, .. }
            | ApiError::NotFound { message, .. }
            | ApiError::Refused { message, .. }
            | ApiError::Unsupported { message, .. }
            | ApiError::Overloaded { message, .. }
            | ApiError::Unavailable { message, .. }
            | ApiError::Internal(message) => message.clone(),
            ApiError::ContextLength { tokens, limit, server_limit: false, .. } => format!(
                "This model's maximum context length is {limit} tokens. However, your prompt resulted in {tokens} \
                 tokens, which leaves no room for the completion. Please reduce the length of the prompt."
            ),
            ApiError::ContextLength { tokens, limit, server_limit: true, .. } => format!(
                "This server accepts prompts of at most {limit} tokens. However, your prompt resulted in {tokens} \
                 tokens. Please reduce the length of the prompt."
            ),
            ApiError::ModelNotFound(model) => {
                format!("The model `{}` does not exist or you do not have access to it.", clip(model, 256))
            }
            ApiError::Timeout => "The request did not finish within the server's request timeout.".to_owned(),
        }
    }

    /// The request field at fault.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::Invalid { param, .. } | ApiError::NotFound { param, .. } => param.as_deref(),
            ApiError::ContextLength { param, .. } | ApiError::Unsupported { param, .. } => Some(param),
            ApiError::ModelNotFound(_) => Some("model"),
            _ => None,
        }
    }

    /// A stable machine-readable code.
    pub fn code(&self) -> Option<&'static str> {
        match self {
            ApiError::Invalid { .. } => None,
            ApiError::ContextLength { .. } => Some("context_length_exceeded"),
            ApiError::ModelNotFound(_) => Some("model_not_found"),
            ApiError::NotFound { code, .. } | ApiError::Refused { code, .. } => Some(code),
            ApiError::Unsupported { .. } => Some("not_implemented"),
            ApiError::Overloaded { .. } => Some("overloaded"),
            ApiError::Unavailable { .. } => Some("unavailable"),
            ApiError::Timeout => Some("request_timeout"),
            ApiError::Internal(_) => Some("internal_error"),
        }
    }

    /// When the client may retry (`Retry-After`).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ApiError::Overloaded { retry_after, .. } | ApiError::Unavailable { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// OpenAI's error `type`.
    pub fn openai_type(&self) -> &'static str {
        match self.kind() {
            ErrorKind::InvalidRequest | ErrorKind::NotFound | ErrorKind::Refused => "invalid_request_error",
            ErrorKind::Unsupported => "not_implemented_error",
            ErrorKind::Overloaded => "rate_limit_error",
            ErrorKind::Unavailable => "service_unavailable",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Internal => "server_error",
        }
    }

    /// The OpenAI body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn openai_body(&self) -> Value {
        json!({"error": {"message": self.message(), "type": self.openai_type(), "param": self.param(), "code": self.code()}})
    }

    /// Anthropic's status and error `type` (a refused admission is 529 `overloaded_error`, which
    /// the SDK retries).
    pub fn anthropic_status(&self) -> (StatusCode, &'static str) {
        let status = self.status();
        let kind = match self.kind() {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::Overloaded | ErrorKind::Unavailable => {
                return (StatusCode::from_u16(529).expect("529 is a status"), "overloaded_error");
            }
            ErrorKind::Timeout => "timeout_error",
            ErrorKind::Unsupported | ErrorKind::Internal => "api_error",
            ErrorKind::Refused => match status.as_u16() {
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                408 => "timeout_error",
                413 => "request_too_large",
                _ => "invalid_request_error",
            },
        };
        (status, kind)
    }

    /// The Anthropic body: `{"type": "error", "error": {"type", "message"}}`.
    pub fn anthropic_body(&self) -> Value {
        json!({"type": "error", "error": {"type": self.anthropic_status().1, "message": self.message()}})
    }

    /// The error as an Anthropic response.
    pub fn anthropic_response(&self) -> Response {
        with_retry_after((self.anthropic_status().0, axum::Json(self.anthropic_body())).into_response(), self)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message())
    }
}

impl From<GenerateError> for ApiError {
    fn from(e: GenerateError) -> ApiError {
        match e {
            GenerateError::Overloaded { retry_after } => ApiError::Overloaded { message: e.to_string(), retry_after },
            GenerateError::ModelNotFound(model) => ApiError::ModelNotFound(model),
            GenerateError::PromptTooLong { tokens, limit } => ApiError::context_length(tokens, limit, "messages"),
            GenerateError::Unavailable { retry_after, .. } => ApiError::unavailable(e.to_string(), retry_after),
            GenerateError::Internal(message) => ApiError::Internal(message),
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

/// `response` with the `Retry-After` of `error`, in whole seconds rounded up: a client must
/// not retry before the server said it may.
fn with_retry_after(mut response: Response, error: &ApiError) -> Response {
    if let Some(after) = error.retry_after() {
        let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
    }
    response
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        with_retry_after((self.status(), axum::Json(self.openai_body())).into_response(), &self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_status_and_a_type_in_both_shapes() {
        let errors = [
            ApiError::invalid("bad", Some("messages")),
            ApiError::context_length(10, 5, "messages"),
            ApiError::model_not_found("m"),
            ApiError::refused(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large", "big"),
            ApiError::Unsupported { message: "no".into(), param: "background".into() },
            ApiError::Overloaded { message: "busy".into(), retry_after: Duration::from_millis(1500) },
            ApiError::unavailable("down", Duration::from_secs(1)),
            ApiError::Timeout,
            ApiError::internal("bug"),
        ];
        let statuses: Vec<u16> = errors.iter().map(|e| e.status().as_u16()).collect();
        assert_eq!(statuses, [400, 400, 404, 413, 501, 429, 503, 504, 500]);
        let anthropic: Vec<(u16, &str)> =
            errors.iter().map(|e| (e.anthropic_status().0.as_u16(), e.anthropic_status().1)).collect();
        assert_eq!(
            anthropic,
            [
                (400, "invalid_request_error"),
                (400, "invalid_request_error"),
                (404, "not_found_error"),
                (413, "request_too_large"),
                (501, "api_error"),
                (529, "overloaded_error"),
                (529, "overloaded_error"),
                (504, "timeout_error"),
                (500, "api_error"),
            ]
        );
        let overloaded = errors[5].clone().into_response();
        assert_eq!(overloaded.headers()[header::RETRY_AFTER], "2", "rounded up");
        assert_eq!(errors[5].anthropic_response().headers()[header::RETRY_AFTER], "2");
        assert_eq!(errors[2].openai_body()["error"]["param"], "model");
        assert_eq!(errors[1].openai_body()["error"]["code"], "context_length_exceeded");
    }
}
