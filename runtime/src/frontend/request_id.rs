//! The request id: one per HTTP request, assigned here before anything else looks at it, and
//! carried through the session, the scheduler and the worker so that every log line a request
//! causes names it.
//!
//! A client that sends `x-request-id` (or `x-client-request-id`, which the OpenAI SDKs let callers
//! set) keeps its own id, when it is 1 to [`MAX_LEN`] visible ASCII characters; otherwise the node
//! makes one (`req_` and 24 hex digits, the shape OpenAI's and Anthropic's ids have). The id comes
//! back in the response's `x-request-id` header (what the OpenAI SDKs read) and `request-id` (what
//! the Anthropic SDKs read), on errors too. The request runs inside a `request` span with the id,
//! the method and the path, so with `node.log_format = "json"` each line carries them in its
//! `span` and `spans` fields.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use tracing::Instrument;

/// The longest client id kept; a longer one is replaced by the node's own.
pub const MAX_LEN: usize = 128;

/// The headers a client's own id is taken from, in order.
const CLIENT_HEADERS: [&str; 2] = ["x-request-id", "x-client-request-id"];

/// The id of one request, in its extensions for the handlers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestId(pub Arc<str>);

/// The client's own id, when it sent a usable one.
fn from_client(headers: &HeaderMap) -> Option<Arc<str>> {
    CLIENT_HEADERS.iter().find_map(|name| {
        let value = headers.get(*name)?.as_bytes();
        let usable = !value.is_empty() && value.len() <= MAX_LEN && value.iter().all(|b| b.is_ascii_graphic());
        // Visible ASCII is UTF-8.
        std::str::from_utf8(value).ok().filter(|_| usable).map(Arc::from)
    })
}

/// A fresh id: `req_`, the time in nanoseconds and a counter, so ids are unique in a process and
/// sort by arrival.
pub fn fresh() -> Arc<str> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    Arc::from(format!("req_{nanos:016x}{:08x}", NEXT.fetch_add(1, Ordering::Relaxed) as u32))
}

/// The middleware (outermost, so refusals have an id too).
pub(super) async fn assign(mut request: Request, next: Next) -> Response {
    let id = from_client(request.headers()).unwrap_or_else(fresh);
    let span =
        tracing::info_span!("request", request_id = %id, method = %request.method(), path = request.uri().path());
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).instrument(span.clone()).await;
    let status = response.status();
    span.in_scope(|| {
        if status.is_client_error() || status.is_server_error() {
            tracing::info!(status = status.as_u16(), "request refused");
        } else {
            tracing::debug!(status = status.as_u16(), "response started");
        }
    });
    if let Ok(value) = HeaderValue::from_str(&id) {
        let headers = response.headers_mut();
        headers.insert(HeaderName::from_static("x-request-id"), value.clone());
        headers.insert(HeaderName::from_static("request-id"), value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    #[test]
    fn a_clients_visible_id_is_kept_and_anything_else_replaced() {
        assert_eq!(from_client(&headers(&[("x-request-id", b"abc-123")])).as_deref(), Some("abc-123"));
        assert_eq!(
            from_client(&headers(&[("x-client-request-id", b"c1"), ("x-request-id", b"r1")])).as_deref(),
            Some("r1"),
            "x-request-id comes first"
        );
        assert_eq!(
            from_client(&headers(&[("x-request-id", b"has space"), ("x-client-request-id", b"c1")])).as_deref(),
            Some("c1")
        );
        for bad in [&b""[..], b"tab\there", "é".as_bytes(), &[b'a'; MAX_LEN + 1]] {
            assert_eq!(from_client(&headers(&[("x-request-id", bad)])), None, "{bad:?}");
        }
        assert!(from_client(&headers(&[("x-request-id", &[b'a'; MAX_LEN])])).is_some());
    }

    #[test]
    fn fresh_ids_are_unique_and_shaped_like_the_apis_ids() {
        let (a, b) = (fresh(), fresh());
        assert_ne!(a, b);
        assert!(a.starts_with("req_") && a.len() == 28 && a[4..].bytes().all(|c| c.is_ascii_hexdigit()), "{a}");
    }
}
