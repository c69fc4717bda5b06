//! What every route shares: reading and parsing the body off the async threads, session and
//! request ids, the event-stream response, and the routes that are not an API's own.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};

use super::FrontendState;
use super::auth::Caller;
use super::error::ApiError;

pub(super) async fn health() -> impl IntoResponse {
    axum::Json(json!({"status": "ok"}))
}

pub(super) async fn not_found() -> ApiError {
    ApiError::NotFound {
        code: "unknown_url",
        message: "Unknown request URL; see /v1/models, /v1/chat/completions, /v1/completions, /v1/responses, \
                  /v1/messages."
            .into(),
        param: None,
    }
}

pub(super) async fn method_not_allowed() -> ApiError {
    ApiError::refused(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "This route does not take that method: generation routes take POST, /v1/models and /health GET.",
    )
}

/// `GET /v1/models`: OpenAI's list, or Anthropic's when `anthropic-version` is sent.
pub(super) async fn models(State(state): State<FrontendState>, headers: HeaderMap) -> Response {
    super::Route::Models.count(200);
    if headers.contains_key("anthropic-version") {
        return super::anthropic::models(&state);
    }
    let data: Vec<Value> = state
        .inner
        .generator
        .models()
        .into_iter()
        .map(|id| json!({"id": id, "object": "model", "created": 0, "owned_by": "dynamo-node"}))
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// Counts an answered request by API and HTTP status (a stream counts once its headers go out).
pub(super) fn counted(route: super::Route, response: Response) -> Response {
    route.count(response.status().as_u16());
    response
}

/// Reads the body (JSON only, within `frontend.body_timeout` and `frontend.max_body`), then
/// parses it as `T` and turns it into a generation with `prepare` on the blocking pool, a few
/// at a time: rendering and tokenizing a long conversation never holds an async thread.
pub(super) async fn prepare_off_thread<T, P, F>(
    state: &FrontendState,
    caller: Caller,
    body: Body,
    prepare: F,
) -> Result<P, ApiError>
where
    T: serde::de::DeserializeOwned + Send + 'static,
    P: Send + 'static,
    F: FnOnce(&FrontendState, &Caller, T) -> Result<P, ApiError> + Send + 'static,
{
    let bytes = read_body(state, &caller.headers, body).await?;
    // A client's share of the preparers first, so one client's huge prompts cannot hold them all.
    let _mine = state.inner.preparing_by_client.acquire(caller.client).await;
    let _permit = state.inner.preparing.clone().acquire_owned().await.map_err(|_| ApiError::internal("closed"))?;
    let state = state.clone();
    let span = tracing::Span::current();
    // Set when this future is dropped (the client went away): tokenizing stops at its next chunk.
    let gone = Arc::new(AtomicBool::new(false));
    let _gone_on_drop = SetOnDrop(gone.clone());
    tokio::task::spawn_blocking(move || {
        CLIENT_GONE.with(|flag| *flag.borrow_mut() = Some(gone));
        let prepared = span.in_scope(|| parse::<T>(&bytes).and_then(|req| prepare(&state, &caller, req)));
        CLIENT_GONE.with(|flag| *flag.borrow_mut() = None);
        prepared
    })
    .await
    .map_err(|e| ApiError::internal(format!("preparing the request failed: {e}")))?
}

thread_local! {
    /// The flag of the request this blocking thread prepares, set once its client is gone.
    static CLIENT_GONE: std::cell::RefCell<Option<Arc<AtomicBool>>> = const { std::cell::RefCell::new(None) };
}

/// Whether the client of the request being prepared on this thread has gone away.
pub(super) fn client_gone() -> bool {
    CLIENT_GONE.with(|flag| flag.borrow().as_ref().is_some_and(|gone| gone.load(Ordering::Relaxed)))
}

struct SetOnDrop(Arc<AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Each client's share of the preparers: at most `per_client` of its requests are rendered and
/// tokenized at once (a client is its address; requests without one share a share).
#[derive(Debug)]
pub(crate) struct ClientPermits {
    per_client: usize,
    clients: parking_lot::Mutex<std::collections::HashMap<Option<IpAddr>, Arc<tokio::sync::Semaphore>>>,
}

impl ClientPermits {
    pub(crate) fn new(per_client: usize) -> Self {
        Self { per_client: per_client.max(1), clients: Default::default() }
    }

    /// Waits for one of `client`'s permits.
    pub(crate) async fn acquire(&self, client: Option<IpAddr>) -> ClientPermit<'_> {
        let semaphore = {
            let mut clients = self.clients.lock();
            clients.entry(client).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.per_client))).clone()
        };
        let permit = semaphore.clone().acquire_owned().await.ok();
        ClientPermit { owner: self, client, permit, semaphore }
    }
}

/// One of a client's permits; the client's entry goes with its last one.
pub(crate) struct ClientPermit<'a> {
    owner: &'a ClientPermits,
    client: Option<IpAddr>,
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    semaphore: Arc<tokio::sync::Semaphore>,
}

impl Drop for ClientPermit<'_> {
    fn drop(&mut self) {
        self.permit.take();
        let mut clients = self.owner.clients.lock();
        // Only the map and this guard hold it, and nobody waits: forget the client.
        if Arc::strong_count(&self.semaphore) == 2 && self.semaphore.available_permits() == self.owner.per_client {
            clients.remove(&self.client);
        }
    }
}

/// The body of a JSON request: 415 unless `Content-Type` is JSON, 413 over `frontend.max_body`,
/// 408 when it does not arrive within `frontend.body_timeout`.
async fn read_body(state: &FrontendState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let inner = &state.inner;
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    if essence != "application/json" && !(essence.starts_with("application/") && essence.ends_with("+json")) {
        return Err(ApiError::refused(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            format!(
                "The request body must be JSON, sent with `Content-Type: application/json` (got `{}`).",
                super::error::clip(content_type, 64)
            ),
        ));
    }
    let too_large = || {
        ApiError::refused(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("The request body is too large: this server accepts at most {} bytes.", inner.max_body),
        )
    };
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > inner.max_body as u64) {
        return Err(too_large());
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(inner.max_body as u64) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::invalid(format!("Could not read the request body: {e}"), None))?;
            if buf.len() + chunk.len() > inner.max_body {
                return Err(too_large());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    tokio::time::timeout(inner.body_timeout, read).await.unwrap_or_else(|_| {
        Err(ApiError::refused(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!("The request body did not arrive within {:?}.", inner.body_timeout),
        ))
    })
}

/// A field's value, its default when it is `null`: clients that send every field send the
/// ones they did not set as `null` (`"stream": null`).
pub(crate) fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + serde::Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// The body as `T`: 400 for anything that is not a valid `T`.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let kind = match e.classify() {
            serde_json::error::Category::Data => "The request body does not match the API",
            _ => "The request body is not valid JSON",
        };
        // A mistyped field's message quotes its value, which may be megabytes long.
        ApiError::invalid(super::error::clip(&format!("{kind}: {e}"), 1024), None)
    })
}

/// The headers that name a request's conversation, in the order they are looked at: Claude Code's,
/// Codex's, the generic one, and NVIDIA Dynamo's.
const SESSION_HEADERS: [&str; 4] = ["x-claude-code-session-id", "session-id", "x-session-id", "x-dynamo-session-id"];

/// What a request's body says about its conversation, looked at after [`SESSION_HEADERS`].
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct SessionFields<'a> {
    /// Anthropic's `metadata.user_id`: Claude Code puts its session id in it
    /// ([`claude_code_session`]).
    pub(super) metadata_user_id: Option<&'a str>,
    /// OpenAI's `prompt_cache_key` (Codex sends its thread id).
    pub(super) prompt_cache_key: Option<&'a str>,
    /// OpenAI's `user`.
    pub(super) user: Option<&'a str>,
}

/// The conversation of a request, as its tenant's [`session_key`]: the first of
/// [`SESSION_HEADERS`] it sends, else `metadata.user_id`, else `prompt_cache_key`, else `user`.
pub(super) fn session_id<'a>(caller: &Caller, fields: SessionFields<'a>) -> Option<String> {
    let header = SESSION_HEADERS
        .iter()
        .find_map(|name| caller.headers.get(*name).map(|v| v.as_bytes()).filter(|v| !v.is_empty()));
    let raw: std::borrow::Cow<'_, [u8]> = match header {
        Some(h) => h.into(),
        None => {
            let nonempty = |f: Option<&'a str>| f.filter(|v| !v.is_empty());
            match nonempty(fields.metadata_user_id) {
                Some(user_id) => claude_code_session(user_id).into_bytes().into(),
                None => nonempty(fields.prompt_cache_key).or(nonempty(fields.user))?.as_bytes().into(),
            }
        }
    };
    Some(caller.tenant.session_key(&raw))
}

/// The session part of Claude Code's `metadata.user_id`: the `session_id` of its JSON form
/// (`{"device_id":…,"account_uuid":…,"session_id":…}`), or what follows `_session_` in the older
/// `user_…_account_…_session_…` form; any other id is the session as it is.
pub(super) fn claude_code_session(user_id: &str) -> String {
    if user_id.starts_with('{')
        && let Ok(Value::Object(o)) = serde_json::from_str::<Value>(user_id)
        && let Some(Value::String(id)) = o.get("session_id")
        && !id.is_empty()
    {
        return id.clone();
    }
    match user_id.rsplit_once("_session_") {
        Some((_, id)) if !id.is_empty() => id.to_owned(),
        _ => user_id.to_owned(),
    }
}

/// The key a client's session id is kept under: a fixed-size digest (32 hex digits of xxh3-128),
/// since the id is the client's choice and may be megabytes long. (A named tenant's sessions are
/// keyed by [`Tenant::session_key`](super::Tenant::session_key), which folds the tenant in.)
pub fn session_key(raw: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(raw))
}

pub(super) fn object_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("{prefix}-{nanos:016x}{:06x}", NEXT.fetch_add(1, Ordering::Relaxed) & 0xff_ffff)
}

/// One named server-sent event: `event: NAME` and its JSON data (Anthropic's and the Responses
/// API's framing).
pub(super) fn named_event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

/// The sending end of an [`event_stream`].
pub(super) type Frames = futures::channel::mpsc::Sender<Result<Bytes, std::convert::Infallible>>;

/// Sends `frames` in order; `false` once the client has gone (the caller then returns, which
/// drops the generation and so cancels it).
pub(super) async fn send_all(tx: &mut Frames, frames: Vec<Bytes>) -> bool {
    use futures::SinkExt;
    for frame in frames {
        if tx.send(Ok(frame)).await.is_err() {
            return false;
        }
    }
    true
}

/// A server-sent-event response whose frames come from `rx`.
pub(super) fn event_stream(rx: futures::channel::mpsc::Receiver<Result<Bytes, std::convert::Infallible>>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(rx),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;
    use crate::frontend::Tenant;

    fn caller(headers: &[(&'static str, &str)], tenant: Tenant) -> Caller {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        Caller { headers: map, tenant, request_id: "test".into(), client: None }
    }

    #[test]
    fn the_session_is_the_first_header_then_the_body_fields_in_order() {
        let shared = Tenant::default();
        let key = |raw: &str| Some(session_key(raw.as_bytes()));
        let fields = SessionFields { metadata_user_id: Some("m"), prompt_cache_key: Some("p"), user: Some("u") };
        let all = [
            ("x-claude-code-session-id", "cc"),
            ("session-id", "codex"),
            ("x-session-id", "generic"),
            ("x-dynamo-session-id", "dynamo"),
        ];
        for skip in 0..all.len() {
            let c = caller(&all[skip..], shared.clone());
            assert_eq!(session_id(&c, fields), key(all[skip].1), "{:?} comes first", all[skip].0);
        }
        let none = caller(&[("x-session-id", "")], shared.clone());
        assert_eq!(session_id(&none, fields), key("m"), "an empty header names nothing");
        assert_eq!(session_id(&none, SessionFields { metadata_user_id: None, ..fields }), key("p"));
        assert_eq!(session_id(&none, SessionFields { user: Some("u"), ..Default::default() }), key("u"));
        assert_eq!(session_id(&none, SessionFields::default()), None);

        let named = caller(&[("x-session-id", "generic")], Tenant::named("a"));
        let other = caller(&[("x-session-id", "generic")], Tenant::named("b"));
        assert_ne!(session_id(&named, fields), session_id(&other, fields), "tenants never share a session");
        assert_ne!(session_id(&named, fields), key("generic"));
    }

    #[test]
    fn claude_codes_user_id_names_its_session_in_both_forms() {
        let json = r#"{"device_id":"d1","account_uuid":"","session_id":"5f0c-uuid"}"#;
        assert_eq!(claude_code_session(json), "5f0c-uuid");
        let old = "user_abc123_account_acc-uuid_session_9d2e-uuid";
        assert_eq!(claude_code_session(old), "9d2e-uuid");
        assert_eq!(claude_code_session("plain-user"), "plain-user");
        assert_eq!(
            claude_code_session(r#"{"device_id":"d1"}"#),
            r#"{"device_id":"d1"}"#,
            "no session_id: the whole id"
        );
    }
}
