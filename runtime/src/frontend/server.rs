//! The HTTP/1 server under the API's routes: its own accept loop over hyper, so that a
//! connection cannot hold the node without limit.
//!
//! - A connection must send a complete request head within `frontend.header_timeout` of opening,
//!   and of the end of its previous response (so an idle keep-alive connection closes too).
//! - At most `frontend.max_connections` are open at once (never more than the process's
//!   open-file limit leaves room for, [`connection_limit`]), and at most
//!   `frontend.max_connections_per_client` from one client address. At either cap a newcomer is
//!   not refused while an idle connection (no request in flight) can make room: one of the same
//!   client's at its own cap, else one of the client holding the most — one that never sent a
//!   request first, then the oldest — is closed (`reason="idle_closed"`). Only when none is idle
//!   is the newcomer answered 503 in the API's shape and closed. So one client re-opening idle
//!   sockets cannot hold every slot. Refusals and accept errors are logged (at most once a
//!   second) and counted in `dynamo_node_http_connections_refused_total`;
//!   `dynamo_node_http_connections` is the number open.
//! - A response write that makes no progress for `frontend.write_timeout` (a client that stopped
//!   reading, its socket buffers full) fails, and the connection closes: its request is cancelled
//!   and what the response held is freed (`reason="write_timeout"`).
//! - Shutdown: [`serve`] stops accepting when its `shutdown` future completes and returns once
//!   every connection has finished its requests (streams included). Dropping the future instead
//!   closes every connection at once, which drops their streams and so cancels their requests.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinSet};

use crate::metrics;

/// File descriptors kept for everything but client connections (G3 files, the metrics
/// listener, the tokenizer, logs, io_uring, …).
const RESERVED_FDS: u64 = 64;

/// The connection limits of [`serve`].
#[derive(Clone, Copy, Debug)]
pub struct ServerLimits {
    /// A request head must be complete within this long (see the module doc).
    pub header_timeout: Duration,
    /// A write that makes no progress for this long fails, closing the connection.
    pub write_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections one client address holds at once.
    pub max_per_client: usize,
}

/// What the accept loop knows of one open connection.
#[derive(Debug)]
struct Open {
    peer: IpAddr,
    opened: Instant,
    state: Arc<ConnState>,
    abort: AbortHandle,
}

/// A connection's requests, as its service sees them.
#[derive(Debug, Default)]
struct ConnState {
    /// Requests in flight: from the head being read to the response body's end.
    in_flight: AtomicUsize,
    /// It has sent a request.
    sent: AtomicBool,
}

/// The open connections, by task, and how many each client address holds.
#[derive(Debug, Default)]
struct Table {
    open: HashMap<tokio::task::Id, Open>,
    per_peer: HashMap<IpAddr, usize>,
}

impl Table {
    fn insert(&mut self, id: tokio::task::Id, open: Open) {
        *self.per_peer.entry(open.peer).or_default() += 1;
        self.open.insert(id, open);
    }

    fn remove(&mut self, id: tokio::task::Id) {
        if let Some(open) = self.open.remove(&id)
            && let Some(n) = self.per_peer.get_mut(&open.peer)
        {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&open.peer);
            }
        }
    }

    fn held_by(&self, peer: IpAddr) -> usize {
        self.per_peer.get(&peer).copied().unwrap_or(0)
    }

    /// Closes an idle connection of `peer` (or, `None`, of the client holding the most): one that
    /// never sent a request first, then the oldest. Whether one was closed.
    fn close_idle(&mut self, peer: Option<IpAddr>) -> bool {
        let victim = self
            .open
            .iter()
            .filter(|(_, o)| peer.is_none_or(|p| o.peer == p) && o.state.in_flight.load(Ordering::Acquire) == 0)
            .max_by_key(|(_, o)| {
                (self.held_by(o.peer), !o.state.sent.load(Ordering::Relaxed), std::cmp::Reverse(o.opened))
            })
            .map(|(id, _)| *id);
        let Some(id) = victim else { return false };
        if let Some(open) = self.open.get(&id) {
            open.abort.abort();
        }
        self.remove(id);
        metrics::record_connection_refused("idle_closed");
        true
    }
}

/// The router's service with its connection's requests counted in flight, each request told
/// its client's address.
#[derive(Clone, Debug)]
struct Counted<S> {
    inner: S,
    state: Arc<ConnState>,
    client: IpAddr,
}

/// Decrements its connection's requests in flight when dropped.
#[derive(Debug)]
struct InFlight(Arc<ConnState>);

impl InFlight {
    fn new(state: Arc<ConnState>) -> Self {
        state.sent.store(true, Ordering::Relaxed);
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        Self(state)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request in flight until it is done with (sent or dropped).
#[derive(Debug)]
struct Tracked<B> {
    body: B,
    _in_flight: InFlight,
}

impl<B: http_body::Body + Unpin> http_body::Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl<S, R, B> hyper::service::Service<axum::http::Request<R>> for Counted<S>
where
    S: hyper::service::Service<axum::http::Request<R>, Response = axum::http::Response<B>>,
    S::Future: Send + 'static,
    B: http_body::Body + Unpin,
{
    type Response = axum::http::Response<Tracked<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn call(&self, mut req: axum::http::Request<R>) -> Self::Future {
        req.extensions_mut().insert(super::auth::ClientAddr(self.client));
        let in_flight = InFlight::new(self.state.clone());
        let response = self.inner.call(req);
        Box::pin(async move { Ok(response.await?.map(|body| Tracked { body, _in_flight: in_flight })) })
    }
}

/// `wanted` connections, lowered to what the process's open-file limit leaves after
/// the descriptors kept for the rest of the node. The soft limit is first raised to the hard one, as servers do.
pub fn connection_limit(wanted: usize) -> usize {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit through a pointer to a live local.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return wanted;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
        // SAFETY: setrlimit reads one rlimit through a pointer to a live local.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        }
    }
    let room = limit.rlim_cur.saturating_sub(RESERVED_FDS).max(1);
    let allowed = usize::try_from(room).unwrap_or(usize::MAX).min(wanted);
    if allowed < wanted {
        tracing::warn!(
            wanted,
            allowed,
            open_file_limit = limit.rlim_cur,
            "frontend.max_connections is above what the open-file limit allows; using the lower number"
        );
    }
    allowed
}

/// Serves `router` on `listener` within `limits` until `shutdown` completes, then stops
/// accepting and returns once the connections' requests have finished.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (max, per_client) = (limits.max_connections.max(1), limits.max_per_client.max(1));
    let mut table = Table::default();
    let graceful = GracefulShutdown::new();
    // Owned here: dropping `serve` aborts every connection.
    let mut connections = JoinSet::new();
    let warn = RateLimited::default();
    let mut builder = http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => break,
            Some(ended) = connections.join_next_with_id() => {
                table.remove(ended.map_or_else(|e| e.id(), |(id, ())| id));
                metrics::set_http_connections(table.open.len());
                continue;
            }
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors or memory: the listener is fine; retry shortly.
                metrics::record_connection_refused("accept_error");
                warn.warn(|n| tracing::warn!(error = %e, refused_since_last = n, "cannot accept an HTTP connection"));
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let client = peer.ip();
        let room = (table.held_by(client) < per_client || table.close_idle(Some(client)))
            && (table.open.len() < max || table.close_idle(None));
        if !room {
            let (reason, what) = if table.held_by(client) >= per_client {
                ("client_limit", "frontend.max_connections_per_client of this client are busy")
            } else {
                ("limit", "frontend.max_connections are busy")
            };
            metrics::record_connection_refused(reason);
            warn.warn(|n| tracing::warn!(%peer, refused_since_last = n, "HTTP connection refused: {what}"));
            connections.spawn(refuse(stream));
            continue;
        }
        let _ = stream.set_nodelay(true);
        let state = Arc::new(ConnState::default());
        let service = Counted { inner: TowerToHyperService::new(router.clone()), state: state.clone(), client };
        let io = TokioIo::new(ErrorBodies::new(WriteDeadline::new(stream, limits.write_timeout)));
        let connection = graceful.watch(builder.serve_connection(io, service));
        let abort = connections.spawn(async move {
            if let Err(e) = connection.await
                && e.is_timeout()
            {
                metrics::record_connection_refused("header_timeout");
                tracing::debug!(%peer, "closed a connection that sent no complete request head in time");
            }
        });
        table.insert(abort.id(), Open { peer: client, opened: Instant::now(), state, abort });
        metrics::set_http_connections(table.open.len());
    }
    drop(listener);
    // Every connection finishes the request it serves and closes (hyper's graceful shutdown).
    graceful.shutdown().await;
    while connections.join_next().await.is_some() {}
    metrics::set_http_connections(0);
    Ok(())
}

/// Answers a connection over the limit with a 503 in the API's shape and closes it.
async fn refuse(mut stream: TcpStream) {
    let body = super::error::ApiError::unavailable(
        "The server has too many open connections; retry shortly.",
        Duration::from_secs(1),
    )
    .openai_body()
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// A warning logged at most once a second, with the count of those it stood for.
#[derive(Debug, Default)]
struct RateLimited {
    /// When the last one was logged, in ms since `start`.
    last_ms: AtomicU64,
    suppressed: AtomicU64,
    start: std::sync::OnceLock<Instant>,
}

impl RateLimited {
    fn warn(&self, log: impl FnOnce(u64)) {
        let start = *self.start.get_or_init(Instant::now);
        let now = start.elapsed().as_millis() as u64 + 1_000;
        let last = self.last_ms.load(Ordering::Relaxed);
        if now >= last + 1_000 && self.last_ms.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            log(self.suppressed.swap(0, Ordering::Relaxed) + 1);
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A connection that gives hyper's own error answers a body in the API's shape.
///
/// hyper answers a request it cannot parse by itself — 400 for a malformed request line or
/// header, 431 for headers over its limit, 414 for an over-long URL — with an empty body, and
/// then closes the connection. Those answers are the only ones without a `content-type` (every
/// answer of the routes has one), so the first write of such a head is replaced by the same
/// status with a JSON error body.
#[derive(Debug)]
struct ErrorBodies<S> {
    inner: S,
    /// A replacement answer still to write, and how much of it is written.
    pending: Option<(Vec<u8>, usize)>,
}

impl<S> ErrorBodies<S> {
    fn new(inner: S) -> Self {
        Self { inner, pending: None }
    }
}

/// The JSON answer that replaces hyper's empty `head`, if `head` is one of hyper's own.
fn replacement(head: &[u8]) -> Option<Vec<u8>> {
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let text = std::str::from_utf8(&head[..end]).ok()?;
    let lower = text.to_ascii_lowercase();
    if !lower.contains("\r\ncontent-length: 0\r\n") || lower.contains("\r\ncontent-type:") {
        return None;
    }
    let status = text.strip_prefix("HTTP/1.1 ").or_else(|| text.strip_prefix("HTTP/1.0 "))?;
    let (code, message): (&str, &str) = match status.get(..3)? {
        "400" => ("bad_request", "The request is not valid HTTP/1.1: its request line or a header is malformed."),
        "431" => ("headers_too_large", "The request's headers are too large."),
        "414" => ("uri_too_long", "The request's URL is too long."),
        _ => return None,
    };
    let line = &text[..text.find("\r\n")?];
    let status = axum::http::StatusCode::from_u16(status[..3].parse().ok()?).ok()?;
    let body = super::error::ApiError::refused(status, code, message).openai_body().to_string();
    Some(
        format!(
            "{line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

impl<S: tokio::io::AsyncWrite + Unpin> ErrorBodies<S> {
    /// Writes what is left of a replacement answer.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while let Some((bytes, written)) = &mut self.pending {
            if *written == bytes.len() {
                self.pending = None;
                break;
            }
            match Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *written += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

/// Reads through a wrapper that only changes writes, to its `inner` stream.
macro_rules! read_through {
    ($wrapper:ident) => {
        impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for $wrapper<S> {
            fn poll_read(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut tokio::io::ReadBuf<'_>,
            ) -> Poll<std::io::Result<()>> {
                Pin::new(&mut self.inner).poll_read(cx, buf)
            }
        }
    };
}

read_through!(ErrorBodies);

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for ErrorBodies<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        if buf.starts_with(b"HTTP/1.")
            && let Some(answer) = replacement(buf)
        {
            // hyper's bytes count as written; ours go now or at the next write, flush or shutdown.
            self.pending = Some((answer, 0));
            if let Poll::Ready(Err(e)) = self.poll_pending(cx) {
                return Poll::Ready(Err(e));
            }
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        ready!(self.poll_pending(cx))?;
        match bufs.iter().find(|b| !b.is_empty()) {
            Some(first) if first.starts_with(b"HTTP/1.") && replacement(first).is_some() => {
                let first: &[u8] = first;
                self.poll_write(cx, first)
            }
            _ => Pin::new(&mut self.inner).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A stream whose writes fail once one has made no progress for its timeout.
#[derive(Debug)]
struct WriteDeadline<S> {
    inner: S,
    timeout: Duration,
    /// Running while a write waits for room.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<S> WriteDeadline<S> {
    fn new(inner: S, timeout: Duration) -> Self {
        Self { inner, timeout, stalled: None }
    }

    /// `poll` of a write: progress clears the deadline; waiting starts it, and past it is an error.
    fn deadline<T>(&mut self, cx: &mut Context<'_>, poll: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if poll.is_ready() {
            self.stalled = None;
            return poll;
        }
        let timeout = self.timeout;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if stalled.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            metrics::record_connection_refused("write_timeout");
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the client read nothing of the response for frontend.write_timeout",
            )));
        }
        Poll::Pending
    }
}

read_through!(WriteDeadline);

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteDeadline<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.deadline(cx, poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.deadline(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_flush(cx);
        self.deadline(cx, poll)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let poll = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.deadline(cx, poll)
    }
}

/// Whether `addr` is a loopback address (the Host/Origin check applies there).
pub fn is_loopback(addr: SocketAddr) -> bool {
    addr.ip().is_loopback()
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::*;

    /// A write to a peer that reads nothing fails once it has waited the timeout; a peer that
    /// reads, however slowly, keeps it going.
    #[tokio::test]
    async fn a_write_that_makes_no_progress_fails_at_the_timeout() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut stalled = WriteDeadline::new(near, Duration::from_millis(100));
        let started = Instant::now();
        let err = stalled.write_all(&[7u8; 64 << 10]).await.expect_err("nobody reads");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(100), "{:?}", started.elapsed());

        let (near, mut reader) = tokio::io::duplex(1024);
        let mut slow = WriteDeadline::new(near, Duration::from_millis(100));
        let reading = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let mut total = 0;
            while total < (16 << 10) {
                tokio::time::sleep(Duration::from_millis(5)).await;
                total += tokio::io::AsyncReadExt::read(&mut reader, &mut buf).await.unwrap();
            }
            total
        });
        slow.write_all(&[7u8; 16 << 10]).await.expect("a reader that keeps reading");
        assert_eq!(reading.await.unwrap(), 16 << 10);
        drop(far.shutdown().await);
    }
}
