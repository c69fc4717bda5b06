//! The `Host` / `Origin` check of a node that listens on loopback.
//!
//! A node on `127.0.0.1` trusts whoever can reach it, but a web page in the user's browser can
//! reach it too: by DNS rebinding (its own name resolving to 127.0.0.1, so `Host` names the page's
//! site) or by a cross-site request (`Origin` names the page). So on loopback a request's `Host`
//! must be a loopback name (`localhost`, `*.localhost`, a loopback IP) or one of
//! `frontend.allowed_hosts`, and its `Origin`, when it has one, too; anything else is 403 in the
//! API's shape. Programs (SDKs, curl) send `Host: 127.0.0.1:PORT` and no `Origin`.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::{ApiError, clip};

/// What a request's `Host` and `Origin` may name.
#[derive(Debug)]
pub(super) struct HostGuard {
    /// Off on a non-loopback address.
    enabled: bool,
    /// `frontend.allowed_hosts`, lowercased.
    allowed: Vec<String>,
}

impl HostGuard {
    pub(super) fn new(enabled: bool, allowed: &[String]) -> Self {
        Self { enabled, allowed: allowed.iter().map(|h| h.to_ascii_lowercase()).collect() }
    }

    fn allows_name(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        host == "localhost"
            || host.ends_with(".localhost")
            || bare.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
            || self.allowed.contains(&host)
    }

    fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        // RFC 9112 §3.2: a request with more than one Host is answered 400, wherever the node
        // listens (checking only the first would let a second name pass unseen).
        for name in [header::HOST, header::ORIGIN] {
            if headers.get_all(&name).iter().nth(1).is_some() {
                return Err(ApiError::refused(
                    StatusCode::BAD_REQUEST,
                    "bad_request",
                    format!("The request has more than one {name} header."),
                ));
            }
        }
        if !self.enabled {
            return Ok(());
        }
        let forbidden = |what: &str, value: &str| {
            ApiError::refused(
                StatusCode::FORBIDDEN,
                "forbidden_host",
                format!(
                    "This node listens on a loopback address and does not answer requests whose {what} is `{}`; \
                     add the name to frontend.allowed_hosts to allow it.",
                    clip(value, 128)
                ),
            )
        };
        if let Some(host) = headers.get(header::HOST) {
            let value = host.to_str().map_err(|_| forbidden("Host", "(not text)"))?;
            if !self.allows_name(host_name(value)) {
                return Err(forbidden("Host", value));
            }
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let value = origin.to_str().map_err(|_| forbidden("Origin", "(not text)"))?;
            let name = value.split_once("://").map(|(_, rest)| host_name(rest.trim_end_matches('/')));
            if !name.is_some_and(|n| self.allows_name(n)) {
                return Err(forbidden("Origin", value));
            }
        }
        Ok(())
    }
}

/// The name of `host[:port]` (an IPv6 address keeps its brackets).
fn host_name(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |end| &authority[..=end]);
    }
    match authority.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => authority,
    }
}

/// The middleware: 403 unless [`HostGuard`] allows the request.
pub(super) async fn check_host(State(guard): State<Arc<HostGuard>>, request: Request, next: Next) -> Response {
    match guard.check(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn check(guard: &HostGuard, host: Option<&str>, origin: Option<&str>) -> bool {
        let mut headers = HeaderMap::new();
        if let Some(h) = host {
            headers.insert(header::HOST, HeaderValue::from_str(h).unwrap());
        }
        if let Some(o) = origin {
            headers.insert(header::ORIGIN, HeaderValue::from_str(o).unwrap());
        }
        guard.check(&headers).is_ok()
    }

    #[test]
    fn loopback_names_pass_and_foreign_hosts_and_origins_do_not() {
        let guard = HostGuard::new(true, &["Node.Internal".to_owned()]);
        for host in
            ["127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "127.3.4.5", "a.localhost:9", "node.internal"]
        {
            assert!(check(&guard, Some(host), None), "{host}");
        }
        assert!(check(&guard, None, None), "HTTP/1.0 without Host");
        for host in ["evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example", "[::2]:80", "10.0.0.1"] {
            assert!(!check(&guard, Some(host), None), "{host}");
        }
        assert!(check(&guard, Some("127.0.0.1:8000"), Some("http://localhost:3000")));
        for origin in ["https://evil.example", "null", "http://127.0.0.1.evil.example:8000", "file://"] {
            assert!(!check(&guard, Some("127.0.0.1:8000"), Some(origin)), "{origin}");
        }
        let open = HostGuard::new(false, &[]);
        assert!(check(&open, Some("evil.example"), Some("https://evil.example")));
    }

    /// Two `Host` (or `Origin`) headers are a 400 whatever they name, on any address: only the
    /// first used to be checked.
    #[test]
    fn a_second_host_or_origin_is_refused() {
        for guard in [HostGuard::new(true, &[]), HostGuard::new(false, &[])] {
            for name in [header::HOST, header::ORIGIN] {
                let mut headers = HeaderMap::new();
                headers.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8000"));
                headers.insert(name.clone(), HeaderValue::from_static("http://localhost"));
                headers.append(name.clone(), HeaderValue::from_static("evil.example"));
                let err = guard.check(&headers).expect_err("two of them");
                assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{name}");
            }
        }
    }
}
