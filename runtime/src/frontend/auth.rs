//! API keys and tenants (`[frontend.auth]`).
//!
//! Every request to an API route is authenticated by a middleware before any handler reads it:
//! the key comes from `Authorization: Bearer KEY` (the OpenAI SDK, the Codex CLI) or `x-api-key`
//! (the Anthropic SDK, Claude Code). With no keys configured every request is served as the shared
//! tenant. With keys, a missing or unknown key is 401 in the API's own shape (Anthropic's for
//! `/v1/messages` and for any request that sends `anthropic-version`, OpenAI's otherwise), and an
//! accepted key's [`Tenant`] rides with the request as an extension.
//!
//! The tenant scopes everything a request can observe of others: its blocks hash under the
//! tenant's own salt (so `cached_tokens` and timing reveal nothing across tenants), its session
//! keys and replay handles are the tenant's, and stored Responses answer only their tenant.
//!
//! Keys are compared in constant time: every configured key is compared in full, whatever the
//! presented key is, so the time taken says nothing about how much of a key was right.

use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use dynamo_config::AuthSection;

use super::error::ApiError;
use super::http::session_key;

/// Whose request this is: the tenant its API key names, or the shared tenant when the node has
/// no keys. Two tenants never share cached blocks, sessions, replay handles or stored responses.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Tenant(Option<Arc<str>>);

impl Tenant {
    /// The tenant named `name`.
    pub fn named(name: &str) -> Tenant {
        Tenant(Some(name.into()))
    }

    /// The tenant's name; `None` for the shared tenant.
    pub fn name(&self) -> Option<&str> {
        self.0.as_deref()
    }

    /// The key of the tenant's session `raw` (the shared tenant's is [`session_key`] itself): no
    /// two tenants' sessions share a key, whatever ids their clients send.
    pub fn session_key(&self, raw: &[u8]) -> String {
        match self.name() {
            None => session_key(raw),
            Some(name) => {
                let mut scoped = Vec::with_capacity(16 + name.len() + raw.len());
                scoped.extend_from_slice(b"tenant\0");
                scoped.extend_from_slice(&(name.len() as u64).to_le_bytes());
                scoped.extend_from_slice(name.as_bytes());
                scoped.extend_from_slice(raw);
                session_key(&scoped)
            }
        }
    }

    /// What a request without a session shares its kept turns under: the tenant's own key, so
    /// replay handles never cross tenants.
    pub fn unnamed_session(&self) -> String {
        match self.name() {
            None => String::new(),
            Some(_) => self.session_key(b""),
        }
    }
}

/// The configured keys.
#[derive(Debug, Default)]
pub(super) struct Keys {
    keys: Vec<(Box<[u8]>, Tenant)>,
}

impl Keys {
    pub(super) fn new(cfg: &AuthSection) -> Keys {
        Keys { keys: cfg.keys.iter().map(|k| (k.key.as_bytes().into(), Tenant::named(&k.tenant))).collect() }
    }

    /// Whether requests need a key.
    pub(super) fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The tenant of a request with these headers, or why it is refused.
    fn authenticate(&self, headers: &HeaderMap) -> Result<Tenant, ApiError> {
        if !self.enabled() {
            return Ok(Tenant::default());
        }
        let presented = presented_key(headers).ok_or_else(|| {
            unauthorized("No API key was sent; send it as `Authorization: Bearer KEY` or `x-api-key: KEY`.")
        })?;
        // Every key is compared in full; the match is picked without branching on the bytes.
        let mut found: Option<&Tenant> = None;
        for (key, tenant) in &self.keys {
            if constant_time_eq(key, presented) {
                found = Some(tenant);
            }
        }
        found.cloned().ok_or_else(|| unauthorized("The API key is not valid."))
    }
}

/// The key a request presents: `x-api-key`, else the `Authorization: Bearer` credentials.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(key) = headers.get("x-api-key").map(|v| v.as_bytes()).filter(|v| !v.is_empty()) {
        return Some(key);
    }
    let auth = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, credentials) = auth.split_at_checked(7)?;
    (scheme.eq_ignore_ascii_case(b"bearer ") && !credentials.is_empty()).then_some(credentials)
}

/// Whether `a == b`, taking time that depends on their lengths only.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len().max(b.len());
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..n {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    std::hint::black_box(diff) == 0
}

fn unauthorized(message: &str) -> ApiError {
    ApiError::refused(StatusCode::UNAUTHORIZED, "invalid_api_key", message)
}

/// Whether a request speaks Anthropic's API (its errors take Anthropic's shape).
pub(super) fn is_anthropic(request: &Request) -> bool {
    request.uri().path().starts_with("/v1/messages") || request.headers().contains_key("anthropic-version")
}

/// The middleware: routes other than `/health` need a valid key when keys are configured; the
/// request's [`Tenant`] goes on as an extension.
pub(super) async fn check_key(State(keys): State<Arc<Keys>>, mut request: Request, next: Next) -> Response {
    let tenant =
        if request.uri().path() == "/health" { Ok(Tenant::default()) } else { keys.authenticate(request.headers()) };
    match tenant {
        Ok(tenant) => {
            request.extensions_mut().insert(tenant);
            next.run(request).await
        }
        Err(e) => {
            let anthropic = is_anthropic(&request);
            crate::metrics::record_auth_failure("api");
            let mut response = if anthropic { e.anthropic_response() } else { e.into_response() };
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            response
        }
    }
}

/// What a handler knows of its caller: the request's headers and its authenticated tenant.
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    /// The request's headers.
    pub(crate) headers: HeaderMap,
    /// Its tenant.
    pub(crate) tenant: Tenant,
    /// Its id ([`request_id`](super::request_id)).
    pub(crate) request_id: std::sync::Arc<str>,
    /// The client's address, where the server knows it.
    pub(crate) client: Option<std::net::IpAddr>,
}

/// The address of the client a request came from (set by the server on every request).
#[derive(Clone, Copy, Debug)]
pub struct ClientAddr(pub std::net::IpAddr);

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        // The middlewares always set the tenant and the id; a router without them (a test's) gets
        // the shared tenant and a fresh id.
        let tenant = parts.extensions.get::<Tenant>().cloned().unwrap_or_default();
        let request_id = match parts.extensions.get::<super::request_id::RequestId>() {
            Some(id) => id.0.clone(),
            None => super::request_id::fresh(),
        };
        let client = parts.extensions.get::<ClientAddr>().map(|c| c.0);
        Ok(Caller { headers: parts.headers.clone(), tenant, request_id, client })
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use dynamo_config::ApiKey;

    use super::*;

    fn keys() -> Keys {
        Keys::new(&AuthSection {
            keys: vec![
                ApiKey { key: "sk-aaaaaaaaaaaaaaaa".into(), tenant: "a".into() },
                ApiKey { key: "sk-bbbbbbbbbbbbbbbb".into(), tenant: "b".into() },
            ],
        })
    }

    fn with(name: &'static str, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn keys_name_their_tenants_and_anything_else_is_refused() {
        let keys = keys();
        assert_eq!(keys.authenticate(&with("x-api-key", "sk-aaaaaaaaaaaaaaaa")), Ok(Tenant::named("a")));
        assert_eq!(keys.authenticate(&with("authorization", "Bearer sk-bbbbbbbbbbbbbbbb")), Ok(Tenant::named("b")));
        assert_eq!(keys.authenticate(&with("authorization", "bearer sk-bbbbbbbbbbbbbbbb")), Ok(Tenant::named("b")));
        for (name, value) in [
            ("x-api-key", "sk-aaaaaaaaaaaaaaab"),
            ("x-api-key", "sk-aaaaaaaaaaaaaaaa "),
            ("x-api-key", "sk-aaaaaaaaaaaaaaa"),
            ("authorization", "Basic sk-aaaaaaaaaaaaaaaa"),
            ("authorization", "Bearer "),
            ("x-other", "sk-aaaaaaaaaaaaaaaa"),
        ] {
            let refused = keys.authenticate(&with(name, value)).unwrap_err();
            assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "{name}: {value}");
        }
        let open = Keys::default();
        assert_eq!(open.authenticate(&HeaderMap::new()), Ok(Tenant::default()), "no keys: the shared tenant");
    }

    #[test]
    fn constant_time_comparison_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab\0", b"ab"), "a zero byte is not the end of a key");
    }
}
