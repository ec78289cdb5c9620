//! HTTP/1.1 to backends, built for streaming: every read takes all the bytes the socket holds
//! and hands on everything they complete as one frame.
//!
//! Why not hyper's client here: its connection task decodes one chunk per hand-over to the body
//! channel, so a burst of SSE events that arrived in one TCP read still crosses the task boundary
//! one event at a time, and the client side then writes each event with its own syscall
//! (measured: ~20 `writev` per 16-token response against nginx's ~5.5, the gateway's main CPU
//! cost under load). Parsing stays with `httparse`; this module adds the framing (chunked,
//! content-length, until-close), keep-alive pooling, and nothing else. Health probes and the
//! masquerade proxy keep using hyper.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue};
use http::request::Parts;
use http::{Method, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

#[cfg(test)]
use crate::h1_head::INLINE_SPANS;
use crate::h1_head::{
    is_hop_by_hop, lists_token, named_by_connection, names_headers, parse_digits, HeaderSpans,
    MAX_HEADERS,
};

/// Largest response head accepted.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Largest chunk-size or trailer line.
const MAX_LINE_BYTES: usize = 4 * 1024;
/// Read buffer growth step: 8 KiB hold a burst of token events or a short JSON answer, head
/// included, in one read (with 4 KiB, a 16-token answer took two); large bodies simply take
/// more reads. Kept small because every open stream and idle connection holds one.
const READ_BYTES: usize = 8 * 1024;
/// An idle connection keeps its read buffer for the next request up to this size; one grown
/// larger by a big answer is freed.
const KEEP_READ_BYTES: usize = 32 * 1024;
/// Below this much free space the read buffer grows by [`READ_BYTES`] before a read.
const MIN_READ_BYTES: usize = 1024;
/// Idle connections kept per backend.
const MAX_IDLE_PER_BACKEND: usize = 512;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often connections idle past [`IDLE_TIMEOUT`] are looked for when no check-in does it.
const IDLE_SWEEP: Duration = Duration::from_secs(15);
/// How soon after a request was written on a pooled connection its close must come to be taken
/// for the backend's idle close racing the reuse (the request never read), and the request
/// sent again on a new connection. That close comes within a round trip; one that comes later
/// (a backend that read the request, worked on it, and died) is that attempt's failure, seen
/// by the proxy's retries and health accounting, not a hidden second generation.
const STALE_WINDOW: Duration = Duration::from_secs(1);

/// Why a request to a backend failed.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// No TCP connection could be made: refused, unreachable.
    #[error("connect: {0}")]
    Connect(String),
    /// The connection was not set up within the connect timeout: the backend may just be
    /// busy (its accept queue full), so this counts as a passive failure, not as down.
    #[error("connect: {0}")]
    ConnectTimeout(String),
    /// This host could not open a connection (out of file descriptors, ephemeral ports or
    /// buffers): the gateway's trouble, not the backend's.
    #[error("this gateway cannot open a connection: {0}")]
    Local(String),
    /// The connection failed or closed early.
    #[error("{0}")]
    Io(String),
    /// The backend sent something that is not HTTP/1.1.
    #[error("malformed response: {0}")]
    Protocol(String),
}

/// Whether a failed connect is this host's own trouble (EMFILE, ENFILE, ENOBUFS, ENOMEM,
/// EADDRNOTAVAIL: out of descriptors, memory or ephemeral ports), which says nothing about the
/// backend: counted against it, a burst would eject every backend at once.
pub fn is_local_failure(e: &std::io::Error) -> bool {
    use nix::errno::Errno;
    e.raw_os_error().is_some_and(|code| {
        matches!(
            Errno::from_raw(code),
            Errno::EMFILE | Errno::ENFILE | Errno::ENOBUFS | Errno::ENOMEM | Errno::EADDRNOTAVAIL
        )
    })
}

thread_local! {
    /// Which front thread runs here (0: the main runtime's threads). A connection belongs to
    /// the event loop it was opened on, so each front thread keeps its own idle connections.
    static FRONT_THREAD: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Marks the calling thread as front thread `index` (see [`H1Pool`]).
pub fn set_front_thread(index: usize) {
    FRONT_THREAD.with(|t| t.set(index));
}

/// Idle connections of one front thread, per backend authority.
/// (Fx hashing: the authorities are the configured backends', and SipHash cost ~250
/// instructions at every checkout and check-in.)
type IdleMap = rustc_hash::FxHashMap<String, Vec<Idle>>;

/// A pooled connection with its read buffer: the next request on it reads into the same memory
/// (an 8 KiB allocation and free per request were the costliest ones of the allocator under
/// load, large enough to miss its per-thread cache and make it merge free chunks).
struct Idle {
    stream: TcpStream,
    buf: BytesMut,
    since: Instant,
}

/// Idle keep-alive connections per front thread and backend authority: a request reuses only
/// connections opened on its own thread's event loop, so no I/O readiness crosses threads.
pub struct H1Pool {
    idle: Vec<Mutex<IdleMap>>,
    connect_timeout: Duration,
}

impl H1Pool {
    /// An empty pool for `threads` front threads.
    pub fn new(connect_timeout: Duration, threads: usize) -> Arc<Self> {
        Arc::new(Self {
            idle: (0..threads.max(1))
                .map(|_| Mutex::new(IdleMap::default()))
                .collect(),
            connect_timeout,
        })
    }

    /// This thread's idle connections.
    fn idle(&self) -> std::sync::MutexGuard<'_, IdleMap> {
        let i = FRONT_THREAD.with(std::cell::Cell::get) % self.idle.len();
        self.idle[i].lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A live idle connection to `authority` and its read buffer, if one is pooled.
    fn checkout(&self, authority: &str) -> Option<(TcpStream, BytesMut)> {
        let mut idle = self.idle();
        let list = idle.get_mut(authority)?;
        while let Some(Idle { stream, buf, since }) = list.pop() {
            if since.elapsed() > IDLE_TIMEOUT {
                continue;
            }
            // A closed or chatty idle connection is not reusable: it reads EOF or data. The
            // event loop's record says whether anything arrived since the last read drained
            // the socket, without a system call on the request's way; only when it says so
            // (or that last read filled its buffer) does a read tell.
            let mut cx = Context::from_waker(std::task::Waker::noop());
            if stream.poll_read_ready(&mut cx).is_pending() {
                return Some((stream, buf));
            }
            let mut probe = [0u8; 1];
            match stream.try_read(&mut probe) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some((stream, buf)),
                _ => continue,
            }
        }
        None
    }

    /// Pools `stream`, idle with nothing unread, and its emptied read buffer.
    fn checkin(&self, authority: &str, stream: TcpStream, buf: BytesMut) {
        let now = Instant::now();
        let mut idle = self.idle();
        // Look up before inserting: the key is allocated once per backend, not per request.
        let list = match idle.get_mut(authority) {
            Some(list) => list,
            None => idle.entry(authority.to_string()).or_default(),
        };
        let expired = take_expired(list, now);
        if list.len() < MAX_IDLE_PER_BACKEND {
            list.push(Idle {
                stream,
                buf,
                since: now,
            });
        }
        // Closed after the lock is let go: closing sockets is system calls.
        drop(idle);
        drop(expired);
    }

    /// Closes every pooled connection that has been idle longer than [`IDLE_TIMEOUT`] at `now`,
    /// on all front threads, with its read buffer; returns how many.
    pub fn close_idle(&self, now: Instant) -> usize {
        let mut closed = 0;
        for idle in &self.idle {
            let expired: Vec<Vec<Idle>> = {
                let mut idle = idle.lock().unwrap_or_else(|p| p.into_inner());
                idle.values_mut()
                    .map(|list| take_expired(list, now))
                    .collect()
            };
            closed += expired.iter().map(Vec::len).sum::<usize>();
        }
        closed
    }

    /// Pooled connections on all front threads.
    #[cfg(test)]
    fn idle_connections(&self) -> usize {
        self.idle
            .iter()
            .map(|idle| {
                let idle = idle.lock().unwrap_or_else(|p| p.into_inner());
                idle.values().map(Vec::len).sum::<usize>()
            })
            .sum()
    }

    async fn connect(&self, authority: &str) -> Result<TcpStream, H1Error> {
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(authority))
            .await
            .map_err(|_| H1Error::ConnectTimeout(format!("{authority}: timed out")))?
            .map_err(|e| {
                if is_local_failure(&e) {
                    H1Error::Local(format!("{authority}: {e}"))
                } else {
                    H1Error::Connect(format!("{authority}: {e}"))
                }
            })?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }

    /// Writes a request (its `head` from [`encode_head`], then `body`) to `authority`; the
    /// answer is read by [`Sent::response`]. The two steps are apart so that the caller can do
    /// its own bookkeeping while the backend works on the request, not after its answer came.
    pub async fn send<'r>(
        self: &Arc<Self>,
        authority: &'r Arc<str>,
        parts: &'r Parts,
        head: &'r [u8],
        body: &'r Bytes,
    ) -> Result<Sent<'r>, H1Error> {
        let sent = |stream, buf, pooled| Sent {
            pool: self.clone(),
            stream,
            buf,
            pooled,
            written: Instant::now(),
            authority,
            parts,
            head,
            body,
        };
        if let Some((mut stream, buf)) = self.checkout(authority) {
            // A pooled connection the backend has closed may still take the write; the read
            // tells (see `Sent::response`).
            if write_request(&mut stream, head, body).await.is_ok() {
                return Ok(sent(stream, buf, true));
            }
        }
        let stream = self.fresh(authority, head, body).await?;
        Ok(sent(stream, BytesMut::new(), false))
    }

    /// A new connection to `authority` with the request written on it.
    async fn fresh(
        &self,
        authority: &str,
        head: &[u8],
        body: &Bytes,
    ) -> Result<TcpStream, H1Error> {
        let mut stream = self.connect(authority).await?;
        write_request(&mut stream, head, body)
            .await
            .map_err(|e| H1Error::Io(format!("cannot send the request: {e}")))?;
        Ok(stream)
    }

    /// Reads the response head off `stream`, after the request was written on it, into `buf`
    /// (empty: a new one, or the pooled connection's own).
    async fn read_head(
        self: &Arc<Self>,
        mut stream: TcpStream,
        mut buf: BytesMut,
        authority: &Arc<str>,
        parts: &Parts,
    ) -> Result<(ResponseHead, H1Body), Exchange> {
        // Room for a whole answer: a pooled buffer whose previous answer the client side has let
        // go of is rewound in place; one still shared is read on after the old bytes when 8 KiB
        // are left in its allocation, and replaced when not (the old bytes are never touched).
        buf.reserve(READ_BYTES);
        let mut largest = buf.capacity();
        // An interim (1xx) answer came: the backend has the request, so a close after it is
        // this attempt's failure, never a stale pooled connection to send it again on.
        let mut interim = false;
        loop {
            largest = largest.max(reserve_read_space(&mut buf));
            let n = tokio::io::AsyncReadExt::read_buf(&mut stream, &mut buf)
                .await
                .map_err(|e| {
                    if buf.is_empty() && !interim {
                        Exchange::Stale
                    } else {
                        Exchange::Failed(H1Error::Io(e.to_string()))
                    }
                })?;
            if n == 0 {
                return Err(if buf.is_empty() && !interim {
                    Exchange::Stale
                } else {
                    Exchange::Failed(H1Error::Io(
                        "connection closed inside the response head".to_string(),
                    ))
                });
            }
            // A 1xx informational answer precedes the real one, which may have come in the same
            // read: what is buffered is parsed again before the socket is read again.
            let head = loop {
                match parse_head(&mut buf).map_err(Exchange::Failed)? {
                    None if buf.len() > MAX_HEAD_BYTES => {
                        return Err(Exchange::Failed(H1Error::Protocol(
                            "response head too large".to_string(),
                        )))
                    }
                    None => break None,
                    Some(head) if head.parts.status.is_informational() => {
                        interim = true;
                        continue;
                    }
                    Some(head) => break Some(head),
                }
            };
            match head {
                None => continue,
                Some(head) => {
                    let framing = framing(parts, &head);
                    let reusable = head.parts.version == Version::HTTP_11 && !head.close;
                    let body = H1Body {
                        stream: Some(stream),
                        buf,
                        framing,
                        pool: self.clone(),
                        authority: authority.clone(),
                        reusable,
                        finished: false,
                        largest,
                    };
                    return Ok((head, body));
                }
            }
        }
    }
}

/// Takes out the connections at the bottom of `list` that are idle past [`IDLE_TIMEOUT`] at
/// `now`, for the caller to close. A checkout takes the newest, so the list is ordered by idle
/// time and, after a burst, the connections under the few a steady load reuses would otherwise
/// keep their sockets and buffers until another burst dug down to them.
fn take_expired(list: &mut Vec<Idle>, now: Instant) -> Vec<Idle> {
    let expired = list
        .iter()
        .take_while(|i| now.saturating_duration_since(i.since) > IDLE_TIMEOUT)
        .count();
    list.drain(..expired).collect()
}

/// Every [`IDLE_SWEEP`], closes the pool's connections idle past [`IDLE_TIMEOUT`] (when no
/// request comes, no check-in does it), until `stop` turns true.
pub async fn sweep_idle(pool: Arc<H1Pool>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(IDLE_SWEEP);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let closed = pool.close_idle(Instant::now());
                if closed > 0 {
                    tracing::debug!(closed, "idle upstream connections closed");
                }
            }
            _ = stop.changed() => return,
        }
    }
}

/// A request written to a backend, its answer not yet read ([`H1Pool::send`]).
pub struct Sent<'r> {
    pool: Arc<H1Pool>,
    stream: TcpStream,
    /// The connection's read buffer (see [`Idle`]).
    buf: BytesMut,
    /// The connection came from the pool: if it turns out closed within [`STALE_WINDOW`] of
    /// `written`, the request is sent again, once, on a new connection.
    pooled: bool,
    /// When the request was written.
    written: Instant,
    authority: &'r Arc<str>,
    parts: &'r Parts,
    head: &'r [u8],
    body: &'r Bytes,
}

impl Sent<'_> {
    /// Reads the response head; the body streams from the returned [`H1Body`].
    pub async fn response(self) -> Result<(ResponseHead, H1Body), H1Error> {
        let Sent {
            pool,
            stream,
            buf,
            pooled,
            written,
            authority,
            parts,
            head,
            body,
        } = self;
        let stale = || H1Error::Io("connection closed before the response".to_string());
        match pool.read_head(stream, buf, authority, parts).await {
            Ok(answer) => return Ok(answer),
            Err(Exchange::Failed(e)) => return Err(e),
            Err(Exchange::Stale) if pooled && written.elapsed() < STALE_WINDOW => {}
            Err(Exchange::Stale) => return Err(stale()),
        }
        let stream = pool.fresh(authority, head, body).await?;
        match pool
            .read_head(stream, BytesMut::new(), authority, parts)
            .await
        {
            Ok(answer) => Ok(answer),
            Err(Exchange::Stale) => Err(stale()),
            Err(Exchange::Failed(e)) => Err(e),
        }
    }
}

/// Writes head and body in one vectored write: one syscall, and the backend finds the whole
/// request in its first read.
async fn write_request(stream: &mut TcpStream, head: &[u8], body: &Bytes) -> std::io::Result<()> {
    let mut request = bytes::Buf::chain(head, &body[..]);
    stream.write_all_buf(&mut request).await
}

/// Makes room for the next read: only when little is left, so that a buffer whose front was split
/// off (and is still referenced) is not reallocated on every read. Returns the capacity after:
/// right after a growth, the size of the buffer's allocation.
fn reserve_read_space(buf: &mut BytesMut) -> usize {
    if buf.capacity() - buf.len() < MIN_READ_BYTES {
        buf.reserve(READ_BYTES);
    }
    buf.capacity()
}

enum Exchange {
    /// Nothing came back on a connection that may have been closed while idle.
    Stale,
    Failed(H1Error),
}

/// The request head sent to a backend: method and path from `parts`, `host: host`, the
/// given headers, and the body's length.
pub fn encode_head<'h>(
    host: &str,
    path_prefix: &str,
    parts: &Parts,
    headers: impl Iterator<Item = (&'h HeaderName, &'h HeaderValue)>,
    body_len: usize,
) -> Vec<u8> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = Vec::with_capacity(256 + parts.headers.len() * 48);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_prefix.as_bytes());
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    if body_len > 0 || parts.method == Method::POST || parts.method == Method::PUT {
        out.extend_from_slice(b"content-length: ");
        out.extend_from_slice(itoa::Buffer::new().format(body_len).as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    out
}

/// A backend's response head, and what the gateway needs to know of it.
pub struct ResponseHead {
    /// Status, version and the end-to-end headers: hop-by-hop ones (RFC 9110 §7.6.1) are left
    /// out as the head is parsed; what they say about this connection is kept below.
    pub parts: http::response::Parts,
    /// The `content-type` is `text/event-stream`, and the body is not encoded (gzip...): its
    /// bytes are events the gateway can read.
    pub event_stream: bool,
    /// `transfer-encoding` lists `chunked`.
    chunked: bool,
    /// The `content-length`, if one was sent and is a number.
    content_length: Option<u64>,
    /// `connection` lists `close`.
    close: bool,
}

/// Parses a complete response head off the front of `buf`, or `None` when more bytes are needed.
/// Header values share the head's bytes instead of being copied one by one. One pass over the
/// parsed headers finds what the gateway acts on and leaves the hop-by-hop ones out of the map,
/// instead of looking each up (and removing some) in the map afterwards.
fn parse_head(buf: &mut BytesMut) -> Result<Option<ResponseHead>, H1Error> {
    // Uninitialised header slots and a small span array: a response head has a handful of
    // headers, and initialising room for MAX_HEADERS of each cost more than parsing them.
    let mut headers =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut []);
    let consumed = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut resp,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(H1Error::Protocol(e.to_string())),
    };
    let status = resp
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| H1Error::Protocol("bad status code".to_string()))?;
    let version = if resp.version == Some(0) {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    if consumed > MAX_HEAD_BYTES {
        return Err(H1Error::Protocol("response head too large".to_string()));
    }
    let (mut chunked, mut close, mut named) = (false, false, false);
    let (mut content_length, mut content_type) = (None, None);
    let mut encoded = false;
    // More than one `content-length` field, or one with a list of values.
    let mut length_fields = 0;
    // Transfer codings listed, all fields together: only a lone `chunked` is relayed.
    let mut codings = 0;
    for h in resp.headers.iter() {
        let name = h.name;
        if name.eq_ignore_ascii_case("transfer-encoding") {
            for coding in h.value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
                if coding.is_empty() {
                    continue;
                }
                codings += 1;
                chunked |= coding.eq_ignore_ascii_case(b"chunked");
            }
        } else if name.eq_ignore_ascii_case("connection") {
            close |= lists_token(h.value, "close");
            named |= names_headers(h.value);
        } else if name.eq_ignore_ascii_case("content-length") {
            length_fields += 1;
            content_length = Some(merge_content_length(content_length, h.value)?);
            if h.value.contains(&b',') {
                length_fields += 1;
            }
        } else if name.eq_ignore_ascii_case("content-type") {
            content_type.get_or_insert(h.value);
        } else if name.eq_ignore_ascii_case("content-encoding") {
            encoded |= !h.value.trim_ascii().eq_ignore_ascii_case(b"identity");
        }
    }
    // Any transfer coding but a lone `chunked` (`gzip, chunked`, or `chunked, gzip`, whose body
    // runs to the close): the gateway would strip the field, hop-by-hop, and hand on bytes
    // still coded as plain ones. No inference server sends one.
    if codings > 0 && !(codings == 1 && chunked) {
        return Err(H1Error::Protocol(
            "transfer coding other than chunked".to_string(),
        ));
    }
    // A compressed event stream (a backend behind a compressing proxy) is relayed as opaque
    // bytes: no events are scanned or held back, and a failure ends it as a broken body.
    let event_stream = !encoded
        && content_type.is_some_and(|v| v.trim_ascii_start().starts_with(b"text/event-stream"));
    // The client's side frames the answer by the `content-length` it is given: one that chunked
    // framing overrides (RFC 9112 §6.3) or that came as a list is not passed on as it was. Nor
    // is an event stream's: framed by it, a stream cut short could not end with the gateway's
    // error event (its bytes would pass the length), only be aborted.
    let drop_length = chunked || length_fields > 1 || event_stream;
    let connection = || {
        resp.headers
            .iter()
            .filter(|h| h.name.eq_ignore_ascii_case("connection"))
            .map(|h| h.value)
    };
    let spans = HeaderSpans::new_kept(buf.as_ptr(), resp.headers, |h| {
        !(is_hop_by_hop(h.name)
            || (drop_length && h.name.eq_ignore_ascii_case("content-length"))
            || (named && named_by_connection(connection(), h.name)))
    });
    let head = buf.split_to(consumed).freeze();
    // Room for what the gateway adds to an answer (`x-tokenway-backend`, `server-timing`,
    // `alt-svc`): a map sized for the backend's headers alone grew, and rehashed, as they were
    // added.
    let mut map = spans.into_map(&head, 3).map_err(H1Error::Protocol)?;
    let content_length = if chunked { None } else { content_length };
    if drop_length && !event_stream {
        if let Some(n) = content_length {
            map.insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(n));
        }
    }
    let mut out = http::Response::new(());
    *out.status_mut() = status;
    *out.version_mut() = version;
    *out.headers_mut() = map;
    Ok(Some(ResponseHead {
        parts: out.into_parts().0,
        event_stream,
        chunked,
        content_length,
        close,
    }))
}

/// The length `value` (a `content-length` field: one number or a list of them) gives, merged
/// with what earlier fields gave. Digits only; differing values are an error the backend made
/// (RFC 9112 §6.3: a proxy must not pass such an answer on).
fn merge_content_length(mut known: Option<u64>, value: &[u8]) -> Result<u64, H1Error> {
    for item in value.split(|&b| b == b',').map(<[u8]>::trim_ascii) {
        let n = parse_digits(item).ok_or_else(|| {
            H1Error::Protocol(format!(
                "invalid content-length {:?}",
                String::from_utf8_lossy(value)
            ))
        })?;
        if known.is_some_and(|k| k != n) {
            return Err(H1Error::Protocol(
                "conflicting content-length values".to_string(),
            ));
        }
        known = Some(n);
    }
    known.ok_or_else(|| H1Error::Protocol("empty content-length".to_string()))
}

/// How the end of a response body is found (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked(Chunk),
    UntilClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    Size,
    Data(u64),
    DataEnd,
    Trailers,
}

fn framing(req: &Parts, head: &ResponseHead) -> Framing {
    let status = head.parts.status;
    if req.method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Framing::Empty;
    }
    if head.chunked {
        return Framing::Chunked(Chunk::Size);
    }
    match head.content_length {
        Some(0) => Framing::Empty,
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    }
}

/// A backend's response body, read straight off its connection.
pub struct H1Body {
    stream: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    pool: Arc<H1Pool>,
    authority: Arc<str>,
    reusable: bool,
    finished: bool,
    /// The largest capacity the read buffer had: the size it grew to. (Its capacity at the end
    /// is only what is left behind the data split off, however large the allocation.)
    largest: usize,
}

/// What decoding the buffered bytes gave.
enum Decoded {
    /// Body bytes (possibly several chunks, moved together).
    Data(Bytes),
    /// The body is complete.
    End,
    /// More bytes are needed.
    More,
}

impl H1Body {
    /// A chunked body whose first bytes, `buffered`, were read with the head, and whose rest
    /// comes from `stream` (tests of the layers above).
    #[cfg(test)]
    pub(crate) fn chunked_for_test(stream: TcpStream, buffered: &[u8]) -> Self {
        H1Body {
            stream: Some(stream),
            buf: BytesMut::from(buffered),
            framing: Framing::Chunked(Chunk::Size),
            pool: H1Pool::new(Duration::from_secs(1), 1),
            authority: "x:1".into(),
            reusable: false,
            finished: false,
            largest: 0,
        }
    }

    /// Bytes read from the backend and not yet handed out (body data and its framing): an upper
    /// bound on what the next polls return without reading the socket again.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// Decodes the next piece of body data off the buffer. Framing after it (the chunk's CRLF,
    /// the next size line, the last chunk and trailers) is consumed too when already buffered,
    /// so the end of the body is known with its last data.
    fn decode(&mut self) -> Result<Decoded, H1Error> {
        let piece = match self.framing {
            Framing::Empty => return Ok(Decoded::End),
            Framing::Chunked(_) => return self.decode_chunked(),
            Framing::UntilClose => {
                (!self.buf.is_empty()).then(|| self.buf.split_to(self.buf.len()).freeze())
            }
            Framing::Length(rem) => {
                if self.buf.is_empty() {
                    None
                } else {
                    let n = (rem.min(usize::MAX as u64) as usize).min(self.buf.len());
                    let rem = rem - n as u64;
                    self.framing = if rem == 0 {
                        Framing::Empty
                    } else {
                        Framing::Length(rem)
                    };
                    Some(self.buf.split_to(n).freeze())
                }
            }
        };
        Ok(piece.map_or(Decoded::More, Decoded::Data))
    }

    /// A chunked body: the data of every chunk already buffered comes out as one piece, a view
    /// of the read buffer. The chunks' data is moved together in place, over the size lines and
    /// CRLFs between them: one chunk costs no copy, several cost one `memmove` of their data
    /// (instead of one frame per chunk that the relay then copied into one write). A model that
    /// streams sends a chunk per token, so this is one chunk at a time, except when the
    /// backend is faster than the gateway and several wait in the socket.
    fn decode_chunked(&mut self) -> Result<Decoded, H1Error> {
        let mut read = 0usize;
        // Where the piece's first data byte sits, and how many data bytes follow it.
        let mut start: Option<usize> = None;
        let mut len = 0usize;
        let outcome = loop {
            let Framing::Chunked(state) = self.framing else {
                break Ok(());
            };
            let unread = &self.buf[read..];
            match state {
                // httparse takes a line with no digits (`\r\n`, `;x\r\n`) for size 0, the
                // last chunk: a body cut so would end as if whole. A size line starts with a
                // hex digit (RFC 9112 §7.1).
                Chunk::Size if unread.first().is_some_and(|b| !b.is_ascii_hexdigit()) => {
                    break Err(H1Error::Protocol(
                        "chunk size line without a size".to_string(),
                    ))
                }
                Chunk::Size => match httparse::parse_chunk_size(unread) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        read += used;
                        self.framing = Framing::Chunked(if size == 0 {
                            Chunk::Trailers
                        } else {
                            Chunk::Data(size)
                        });
                    }
                    Ok(httparse::Status::Partial) if unread.len() > MAX_LINE_BYTES => {
                        break Err(H1Error::Protocol("chunk size line too long".to_string()))
                    }
                    Ok(httparse::Status::Partial) => break Ok(()),
                    Err(_) => break Err(H1Error::Protocol("bad chunk size".to_string())),
                },
                Chunk::Data(rem) => {
                    if unread.is_empty() {
                        break Ok(());
                    }
                    let n = (rem.min(usize::MAX as u64) as usize).min(unread.len());
                    let to = *start.get_or_insert(read) + len;
                    if to != read {
                        self.buf.copy_within(read..read + n, to);
                    }
                    len += n;
                    read += n;
                    let rem = rem - n as u64;
                    self.framing = Framing::Chunked(if rem == 0 {
                        Chunk::DataEnd
                    } else {
                        Chunk::Data(rem)
                    });
                }
                Chunk::DataEnd => {
                    if unread.len() < 2 {
                        break Ok(());
                    }
                    if &unread[..2] != b"\r\n" {
                        break Err(H1Error::Protocol("chunk not followed by CRLF".to_string()));
                    }
                    read += 2;
                    self.framing = Framing::Chunked(Chunk::Size);
                }
                Chunk::Trailers => {
                    // Trailer fields are read and dropped; an empty line ends the body.
                    match unread.windows(2).position(|w| w == b"\r\n") {
                        Some(0) => {
                            read += 2;
                            self.framing = Framing::Empty;
                        }
                        Some(i) => read += i + 2,
                        None if unread.len() > MAX_LINE_BYTES => {
                            break Err(H1Error::Protocol("trailer line too long".to_string()))
                        }
                        None => break Ok(()),
                    }
                }
            }
        };
        // Data decoded before a malformed part of the same read goes out first: the error
        // comes again at the next call, from the same bytes (framing and buffer stand at it).
        if let Err(e) = outcome {
            if start.is_none() {
                return Err(e);
            }
        }
        let piece = start.map(|at| {
            self.buf.advance(at);
            let piece = self.buf.split_to(len).freeze();
            read -= at + len;
            piece
        });
        self.buf.advance(read);
        Ok(match piece {
            Some(data) => Decoded::Data(data),
            None if self.framing == Framing::Empty => Decoded::End,
            None => Decoded::More,
        })
    }

    /// Marks the body complete. Its connection goes back to the pool when the body is dropped:
    /// after its last data went to the client, not between that data's read and its write.
    fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for H1Body {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take() {
            if self.finished && self.reusable && self.buf.is_empty() {
                // A buffer grown by a large answer is freed, not kept by an idle connection.
                let buf = if self.largest > KEEP_READ_BYTES {
                    BytesMut::new()
                } else {
                    std::mem::take(&mut self.buf)
                };
                self.pool.checkin(&self.authority, stream, buf);
            }
        }
    }
}

impl Body for H1Body {
    type Data = Bytes;
    type Error = H1Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, H1Error>>> {
        let this = &mut *self;
        if this.finished {
            return Poll::Ready(None);
        }
        loop {
            match this.decode() {
                Err(e) => {
                    this.finished = true;
                    this.stream = None;
                    return Poll::Ready(Some(Err(e)));
                }
                Ok(Decoded::Data(data)) => {
                    if this.framing == Framing::Empty {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Ok(Decoded::End) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(Decoded::More) => {}
            }
            let Some(stream) = this.stream.as_mut() else {
                return Poll::Ready(None);
            };
            this.largest = this.largest.max(reserve_read_space(&mut this.buf));
            match tokio_util::io::poll_read_buf(Pin::new(stream), cx, &mut this.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    this.finished = true;
                    this.stream = None;
                    return Poll::Ready(Some(Err(H1Error::Io(e.to_string()))));
                }
                Poll::Ready(Ok(0)) => {
                    this.stream = None;
                    this.finished = true;
                    return if this.framing == Framing::UntilClose {
                        Poll::Ready(None)
                    } else {
                        Poll::Ready(Some(Err(H1Error::Io(
                            "connection closed before the end of the response body".to_string(),
                        ))))
                    };
                }
                Poll::Ready(Ok(_)) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Empty => SizeHint::with_exact(0),
            Framing::Length(n) => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_or_ports_is_this_hosts_failure_a_refusal_the_backends() {
        let os = std::io::Error::from_raw_os_error;
        for local in [
            nix::errno::Errno::EMFILE,
            nix::errno::Errno::ENFILE,
            nix::errno::Errno::EADDRNOTAVAIL,
        ] {
            assert!(is_local_failure(&os(local as i32)), "{local}");
        }
        for theirs in [
            nix::errno::Errno::ECONNREFUSED,
            nix::errno::Errno::EHOSTUNREACH,
            nix::errno::Errno::ETIMEDOUT,
        ] {
            assert!(!is_local_failure(&os(theirs as i32)), "{theirs}");
        }
        assert!(!is_local_failure(&std::io::Error::other("no errno")));
    }

    fn body_with(bytes: &[u8], framing: Framing) -> H1Body {
        H1Body {
            stream: None,
            buf: BytesMut::from(bytes),
            framing,
            pool: H1Pool::new(Duration::from_secs(1), 1),
            authority: "x:1".into(),
            reusable: false,
            finished: false,
            largest: 0,
        }
    }

    #[test]
    fn complete_chunks_come_out_as_one_piece_in_place_and_the_end_comes_with_the_last() {
        let wire = b"5\r\nhello\r\n6\r\n world\r\n3;ext=1\r\n!!!\r\n0\r\nx-trailer: 1\r\n\r\n";
        let mut b = body_with(wire, Framing::Chunked(Chunk::Size));
        let start = b.buf.as_ptr() as usize;
        let end = start + wire.len();
        match b.decode().expect("valid") {
            Decoded::Data(d) => {
                assert_eq!(&d[..], b"hello world!!!");
                // The data was moved together inside the read buffer, not copied out of it.
                assert!((start..end).contains(&(d.as_ptr() as usize)));
            }
            _ => panic!("expected data"),
        }
        // The terminator and trailers were consumed along with the last piece.
        assert_eq!(b.framing, Framing::Empty);
        assert!(b.buf.is_empty());
        assert!(matches!(b.decode().expect("valid"), Decoded::End));
    }

    #[test]
    fn one_buffered_chunk_is_a_view_of_the_read_buffer() {
        let wire = b"5\r\nhello\r\n6\r\n wor";
        let mut b = body_with(wire, Framing::Chunked(Chunk::Size));
        let at = b.buf.as_ptr() as usize + 3;
        match b.decode().expect("valid") {
            Decoded::Data(d) => {
                assert_eq!(&d[..], b"hello wor");
                assert_eq!(d.as_ptr() as usize, at, "no byte of the first chunk moved");
            }
            _ => panic!("expected data"),
        }
        assert_eq!(b.framing, Framing::Chunked(Chunk::Data(2)));
        assert!(matches!(b.decode().expect("valid"), Decoded::More));
        b.buf.extend_from_slice(b"ld\r\n");
        match b.decode().expect("valid") {
            Decoded::Data(d) => assert_eq!(&d[..], b"ld"),
            _ => panic!("expected data"),
        }
        assert_eq!(b.framing, Framing::Chunked(Chunk::Size));
    }

    #[test]
    fn chunked_bodies_decode_the_same_whatever_the_read_boundaries() {
        let chunks: Vec<Vec<u8>> = (0..40u8)
            .map(|i| {
                (0..(i as usize * 7 % 23 + 1))
                    .map(|j| b'a' + (i + j as u8) % 26)
                    .collect()
            })
            .collect();
        let mut wire = Vec::new();
        for c in &chunks {
            wire.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            wire.extend_from_slice(c);
            wire.extend_from_slice(b"\r\n");
        }
        wire.extend_from_slice(b"0\r\n\r\n");
        let expected: Vec<u8> = chunks.concat();
        for step in [1usize, 2, 3, 5, 8, 13, 64, 1000, wire.len()] {
            let mut b = body_with(b"", Framing::Chunked(Chunk::Size));
            let mut got = Vec::new();
            let mut fed = 0;
            loop {
                match b.decode().expect("valid") {
                    Decoded::Data(d) => got.extend_from_slice(&d),
                    Decoded::End => break,
                    Decoded::More => {
                        assert!(fed < wire.len(), "step {step}: ran out before the end");
                        let n = step.min(wire.len() - fed);
                        b.buf.extend_from_slice(&wire[fed..fed + n]);
                        fed += n;
                    }
                }
            }
            assert_eq!(got, expected, "step {step}");
            assert!(b.buf.is_empty(), "step {step}");
        }
    }

    #[test]
    fn a_chunk_split_across_reads_is_reassembled() {
        let mut b = body_with(b"a\r\n01234", Framing::Chunked(Chunk::Size));
        match b.decode().expect("valid") {
            Decoded::Data(d) => assert_eq!(&d[..], b"01234"),
            _ => panic!("expected data"),
        }
        assert!(matches!(b.decode().expect("valid"), Decoded::More));
        b.buf.extend_from_slice(b"56789\r\n0\r\n\r\n");
        match b.decode().expect("valid") {
            Decoded::Data(d) => assert_eq!(&d[..], b"56789"),
            _ => panic!("expected data"),
        }
        assert_eq!(b.framing, Framing::Empty);
    }

    #[test]
    fn malformed_chunking_is_an_error_not_a_panic() {
        // The last: an empty size line, which httparse reads as the last chunk's.
        for bad in [
            &b"zz\r\n"[..],
            b"3\r\nabcX\r\n",
            &[b'1'; 5000][..],
            b"5\r\nhello\r\n\r\n5\r\nworld\r\n0\r\n\r\n",
            b";x\r\n",
        ] {
            let mut b = body_with(bad, Framing::Chunked(Chunk::Size));
            let mut r = b.decode();
            while let Ok(Decoded::Data(_)) = r {
                r = b.decode();
            }
            assert!(r.is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
        // Data already decoded in the same read goes out before the error.
        let mut b = body_with(
            b"5\r\nhello\r\n6\r\n world\r\nzz\r\n",
            Framing::Chunked(Chunk::Size),
        );
        match b.decode() {
            Ok(Decoded::Data(d)) => assert_eq!(&d[..], b"hello world"),
            other => panic!("expected the data first, got an error: {}", other.is_err()),
        }
        assert!(b.decode().is_err(), "then the error");
        assert!(b.decode().is_err(), "and again");
    }

    #[test]
    fn content_length_bodies_end_exactly() {
        let mut b = body_with(b"abcdefEXTRA", Framing::Length(6));
        match b.decode().expect("valid") {
            Decoded::Data(d) => assert_eq!(&d[..], b"abcdef"),
            _ => panic!("expected data"),
        }
        assert_eq!(b.framing, Framing::Empty);
        assert_eq!(&b.buf[..], b"EXTRA");
    }

    #[test]
    fn response_heads_parse_and_frame() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello"[..],
        );
        let head = parse_head(&mut buf).expect("valid").expect("complete");
        assert_eq!(head.parts.status, 200);
        let req = http::Request::post("/v1/chat/completions")
            .body(())
            .expect("req")
            .into_parts()
            .0;
        assert_eq!(framing(&req, &head), Framing::Chunked(Chunk::Size));
        assert_eq!(&buf[..], b"5\r\nhello");
        let mut partial = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-le"[..]);
        assert!(parse_head(&mut partial).expect("valid so far").is_none());
        let mut garbage = BytesMut::from(&b"SSH-2.0-OpenSSH\r\n\r\n"[..]);
        assert!(parse_head(&mut garbage).is_err());
    }

    /// A listener on a free loopback port, and its address.
    async fn loopback_listener() -> (tokio::net::TcpListener, std::net::SocketAddr) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        (listener, addr)
    }

    /// The parts, head and body of `POST /v1/completions` with the body `{}` to `authority`.
    fn post_request(authority: &str) -> (Parts, Vec<u8>, Bytes) {
        let parts = http::Request::post("/v1/completions")
            .body(())
            .expect("req")
            .into_parts()
            .0;
        let body = Bytes::from_static(b"{}");
        let head = encode_head(authority, "", &parts, std::iter::empty(), body.len());
        (parts, head, body)
    }

    /// A backend that answers the first request on a connection and closes the connection on
    /// the second without answering (an idle timeout racing the reuse).
    async fn one_answer_per_connection() -> (std::net::SocketAddr, tokio::task::JoinHandle<usize>) {
        use tokio::io::AsyncReadExt;
        let (listener, addr) = loopback_listener().await;
        let server = tokio::spawn(async move {
            let mut connections = 0;
            while let Ok((mut s, _)) = listener.accept().await {
                connections += 1;
                let mut buf = vec![0u8; 4096];
                let mut answered = false;
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(_) if answered => break,
                        Ok(_) => {
                            answered = true;
                            let _ = s
                                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                                .await;
                        }
                    }
                }
                if connections == 2 {
                    break;
                }
            }
            connections
        });
        (addr, server)
    }

    /// POSTs `{}` to `authority` through `pool`, checks the answer (200, `ok`), and says whether
    /// the request went out on a pooled connection. The body is dropped after its end, which
    /// returns the connection to the pool.
    /// Whether the request went out on a pooled connection, and the answer's data.
    async fn post_once(pool: &Arc<H1Pool>, authority: &Arc<str>) -> (bool, Bytes) {
        let (parts, head, body) = post_request(authority);
        let sent = pool
            .send(authority, &parts, &head, &body)
            .await
            .expect("written");
        let pooled = sent.pooled;
        let (resp, mut answer) = sent.response().await.expect("answered");
        assert_eq!(resp.parts.status, StatusCode::OK);
        let frame = std::future::poll_fn(|cx| Pin::new(&mut answer).poll_frame(cx))
            .await
            .expect("a frame")
            .expect("data");
        let data = frame.into_data().expect("data");
        assert_eq!(data, "ok");
        // The body ended with its data: the connection goes back to the pool.
        assert!(answer.is_end_stream());
        (pooled, data)
    }

    /// A backend that answers `answers` requests on each of `connections` connections, then
    /// closes the connection.
    async fn backend(
        connections: usize,
        answers: usize,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        use tokio::io::AsyncReadExt;
        let (listener, addr) = loopback_listener().await;
        let server = tokio::spawn(async move {
            for _ in 0..connections {
                let (mut s, _) = listener.accept().await.expect("accept");
                let mut buf = vec![0u8; 4096];
                for _ in 0..answers {
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                }
            }
        });
        (addr, server)
    }

    #[tokio::test]
    async fn a_pooled_connection_closed_under_a_request_is_replaced_once() {
        let (addr, server) = one_answer_per_connection().await;
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        assert!(!post_once(&pool, &authority).await.0);
        // Round 1 reuses round 0's connection, finds it closed, and sends again on a new one;
        // dropping the pool closes that one, which ends the server.
        assert!(post_once(&pool, &authority).await.0);
        drop(pool);
        assert_eq!(server.await.expect("server"), 2);
    }

    /// A backend that answers its first request, reads the second and then hands its
    /// connection to `second` (which drops it). The second request, on the pooled connection,
    /// fails as the attempt's own failure and is not sent again on a new connection.
    async fn the_second_request_fails_and_is_not_resent<F, Fut>(second: F)
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        use tokio::io::AsyncReadExt;
        let (listener, addr) = loopback_listener().await;
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await;
            let _ = s.read(&mut buf).await;
            second(s).await;
            // A resend would come as a second connection.
            tokio::time::timeout(Duration::from_millis(500), listener.accept())
                .await
                .is_ok()
        });
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        assert!(!post_once(&pool, &authority).await.0);
        let (parts, head, body) = post_request(&authority);
        let sent = pool
            .send(&authority, &parts, &head, &body)
            .await
            .expect("written");
        assert!(sent.pooled);
        assert!(matches!(sent.response().await, Err(H1Error::Io(_))));
        assert!(!server.await.expect("server"), "the request was sent again");
    }

    /// The backend works on the second request past the stale window and dies unanswered.
    #[tokio::test]
    async fn a_pooled_connection_closed_long_after_its_request_is_a_failure_not_a_resend() {
        the_second_request_fails_and_is_not_resent(|s| async move {
            tokio::time::sleep(STALE_WINDOW + Duration::from_millis(200)).await;
            drop(s);
        })
        .await;
    }

    /// A backend that sent an interim answer (103 Early Hints) has the request: if it dies
    /// then, within the stale window of a pooled connection, the request is not sent again
    /// (it was, as if the connection had been stale).
    #[tokio::test]
    async fn a_close_after_an_interim_answer_is_a_failure_not_a_resend() {
        the_second_request_fails_and_is_not_resent(|mut s| async move {
            let _ = s.write_all(b"HTTP/1.1 103 Early Hints\r\n\r\n").await;
        })
        .await;
    }

    #[tokio::test]
    async fn an_idle_connection_the_backend_closed_is_not_reused() {
        let (addr, server) = backend(2, 1).await;
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        for round in 0..2 {
            // Round 1 finds round 0's connection closed by the backend before writing on it.
            assert!(!post_once(&pool, &authority).await.0, "round {round}");
            // The backend's close reaches the event loop while the connection idles.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server.await.expect("server");
    }

    #[tokio::test]
    async fn connections_idle_past_the_timeout_are_closed_with_their_buffers() {
        use tokio::io::AsyncReadExt;
        // Answers one request per connection, then waits for the client to close it.
        let (listener, addr) = loopback_listener().await;
        let server = tokio::spawn(async move {
            let mut open = Vec::new();
            for _ in 0..3 {
                let (mut s, _) = listener.accept().await.expect("accept");
                open.push(tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let _ = s.read(&mut buf).await;
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                    while s.read(&mut buf).await.is_ok_and(|n| n > 0) {}
                }));
            }
            for c in open {
                c.await.expect("connection");
            }
        });
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        // Three requests at once: three connections, all pooled afterwards.
        let (a, b, c) = tokio::join!(
            post_once(&pool, &authority),
            post_once(&pool, &authority),
            post_once(&pool, &authority)
        );
        assert!(!a.0 && !b.0 && !c.0, "three new connections");
        drop((a, b, c));
        assert_eq!(pool.idle_connections(), 3);
        let now = Instant::now();
        assert_eq!(pool.close_idle(now), 0, "none is idle that long yet");
        assert_eq!(
            pool.close_idle(now + IDLE_TIMEOUT + Duration::from_secs(1)),
            3
        );
        assert_eq!(pool.idle_connections(), 0);
        // Closed, not leaked: the backend sees every connection end.
        server.await.expect("server");
    }

    #[test]
    fn a_check_in_closes_the_expired_connections_under_it_and_keeps_the_rest() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (_listener, addr) = loopback_listener().await;
            let mut list = Vec::new();
            let start = Instant::now();
            for age in [90, 70, 30, 5] {
                let stream = TcpStream::connect(addr).await.expect("connect");
                list.push(Idle {
                    stream,
                    buf: BytesMut::with_capacity(READ_BYTES),
                    since: start - Duration::from_secs(age),
                });
            }
            assert_eq!(take_expired(&mut list, start).len(), 2);
            let left: Vec<u64> = list
                .iter()
                .map(|i| start.duration_since(i.since).as_secs())
                .collect();
            assert_eq!(left, [30, 5]);
        });
    }

    #[tokio::test]
    async fn an_idle_connection_is_reused() {
        let (addr, server) = backend(1, 3).await;
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        for round in 0..3 {
            assert_eq!(
                post_once(&pool, &authority).await.0,
                round > 0,
                "round {round}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        server.await.expect("server");
    }

    #[tokio::test]
    async fn a_read_buffer_grown_by_a_large_head_is_not_kept() {
        use tokio::io::AsyncReadExt;
        let (listener, addr) = loopback_listener().await;
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            // A body streams through buffers of the usual size; a head must be read whole.
            let mut answer = b"HTTP/1.1 200 OK\r\nx-large: ".to_vec();
            answer.resize(answer.len() + 40_000, b'x');
            answer.extend_from_slice(b"\r\ncontent-length: 100000\r\n\r\n");
            answer.resize(answer.len() + 100_000, b'y');
            let _ = s.write_all(&answer).await;
            // Hold the connection open until the client side is done.
            let _ = s.read(&mut buf).await;
        });
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        let parts = http::Request::post("/v1/embeddings")
            .body(())
            .expect("req")
            .into_parts()
            .0;
        let body = Bytes::from_static(b"{}");
        let head = encode_head(&authority, "", &parts, std::iter::empty(), body.len());
        let sent = pool
            .send(&authority, &parts, &head, &body)
            .await
            .expect("written");
        let (_, mut answer) = sent.response().await.expect("answered");
        let mut got = 0;
        while let Some(frame) =
            std::future::poll_fn(|cx| Pin::new(&mut answer).poll_frame(cx)).await
        {
            got += frame.expect("data").into_data().expect("data").len();
        }
        assert_eq!(got, 100_000);
        drop(answer);
        {
            let idle = pool.idle();
            let pooled = &idle[&*authority];
            assert_eq!(pooled.len(), 1, "the connection itself is pooled");
            assert_eq!(pooled[0].buf.capacity(), 0, "its grown buffer is not");
        }
        drop(pool);
        server.await.expect("server");
    }

    #[tokio::test]
    async fn an_idle_connection_keeps_its_read_buffer_unless_an_answer_still_holds_it() {
        let (addr, server) = backend(1, 3).await;
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        let (_, first) = post_once(&pool, &authority).await;
        let at = first.as_ptr();
        drop(first);
        // The first answer is gone: the second is read into the same memory, from its start.
        let (pooled, second) = post_once(&pool, &authority).await;
        assert!(pooled);
        assert_eq!(
            second.as_ptr(),
            at,
            "the pooled buffer was rewound and reused"
        );
        // The second answer is still held: the third gets a buffer of its own and the second's
        // bytes stay as they were.
        let (pooled, third) = post_once(&pool, &authority).await;
        assert!(pooled);
        assert_ne!(third.as_ptr(), second.as_ptr());
        assert_eq!((&second[..], &third[..]), (&b"ok"[..], &b"ok"[..]));
        server.await.expect("server");
    }

    #[test]
    fn hop_by_hop_headers_are_left_out_and_read_and_the_rest_kept_in_order() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n\
               Transfer-Encoding: Chunked\r\nConnection: keep-alive, Close\r\n\
               keep-alive: timeout=5\r\nx-request-id: a\r\nx-request-id: b\r\n\
               proxy-connection: close\r\nTE: trailers\r\nupgrade: h2c\r\n\
               trailer: x\r\ncontent-length: 12\r\n\r\n"[..],
        );
        let head = parse_head(&mut buf).expect("valid").expect("complete");
        let left: Vec<(&str, &str)> = head
            .parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().expect("ascii")))
            .collect();
        assert_eq!(
            left,
            [
                ("content-type", "text/event-stream; charset=utf-8"),
                ("x-request-id", "a"),
                ("x-request-id", "b"),
            ]
        );
        assert!(head.event_stream && head.chunked && head.close);
        // Chunked framing overrides the length, which is not passed on (RFC 9112 §6.3).
        assert_eq!(head.content_length, None);
        let mut plain = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n"[..],
        );
        let head = parse_head(&mut plain).expect("valid").expect("complete");
        assert!(!head.event_stream && !head.chunked && !head.close);
        assert_eq!(head.content_length, Some(7));
        assert_eq!(head.parts.headers[http::header::CONTENT_LENGTH], "7");
        // A compressed event stream is opaque bytes to the gateway.
        let mut gzipped = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: gzip\r\n\
               transfer-encoding: chunked\r\n\r\n"[..],
        );
        let head = parse_head(&mut gzipped).expect("valid").expect("complete");
        assert!(!head.event_stream);
        // An event stream's length frames the backend's body but is not passed on: the client
        // side frames it itself, so that a cut can still end with an error event.
        let mut sized = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 500\r\n\r\n"[..],
        );
        let head = parse_head(&mut sized).expect("valid").expect("complete");
        assert_eq!(head.content_length, Some(500));
        assert!(!head
            .parts
            .headers
            .contains_key(http::header::CONTENT_LENGTH));
        // Transfer codings but a lone `chunked` are refused, not relayed as if plain.
        for coding in ["gzip, chunked", "chunked, gzip", "gzip", "chunked, chunked"] {
            let mut coded = BytesMut::from(
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                     transfer-encoding: {coding}\r\n\r\n"
                )
                .as_str(),
            );
            assert!(parse_head(&mut coded).is_err(), "{coding}");
        }
        let mut two_fields = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n"[..],
        );
        assert!(parse_head(&mut two_fields).is_err());
    }

    #[test]
    fn a_broken_or_conflicting_content_length_is_the_backends_error() {
        for bad in ["x", "+5", "-1", "5, 6", "", "99999999999999999999"] {
            let mut buf = BytesMut::from(
                format!("HTTP/1.1 200 OK\r\ncontent-length: {bad}\r\n\r\nhello").as_str(),
            );
            assert!(parse_head(&mut buf).is_err(), "content-length {bad:?}");
        }
        let mut two = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 5\r\n\r\nhello"[..],
        );
        assert!(parse_head(&mut two).is_err());
        // A list of one value, or the same value twice, is that value, passed on once.
        let mut list = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\ncontent-length: 5\r\n\r\nhello"[..],
        );
        let head = parse_head(&mut list).expect("valid").expect("complete");
        assert_eq!(head.content_length, Some(5));
        let lengths: Vec<_> = head
            .parts
            .headers
            .get_all(http::header::CONTENT_LENGTH)
            .iter()
            .collect();
        assert_eq!(lengths, ["5"]);
    }

    #[test]
    fn headers_that_connection_names_are_left_out() {
        let mut buf = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nconnection: X-Secret, keep-alive\r\nx-secret: leak\r\n\
               x-kept: yes\r\ncontent-length: 0\r\n\r\n"[..],
        );
        let head = parse_head(&mut buf).expect("valid").expect("complete");
        assert!(!head.parts.headers.contains_key("x-secret"));
        assert_eq!(head.parts.headers["x-kept"], "yes");
    }

    /// A backend that writes an interim answer and its final answer in one write, then keeps
    /// the connection open: the final answer must not wait for more bytes.
    #[tokio::test]
    async fn an_answer_read_with_an_interim_one_is_not_kept_waiting() {
        use tokio::io::AsyncReadExt;
        let (listener, addr) = loopback_listener().await;
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(
                    b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n\
                      HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                )
                .await;
            // Held open until the test ends.
            let _ = s.read(&mut buf).await;
        });
        let pool = H1Pool::new(Duration::from_secs(1), 1);
        let authority: Arc<str> = addr.to_string().into();
        let answered = tokio::time::timeout(Duration::from_secs(10), post_once(&pool, &authority));
        answered
            .await
            .expect("the final answer came out of the bytes already read");
        drop(pool);
        server.abort();
    }

    #[test]
    fn heads_with_more_headers_than_the_inline_spans_keep_every_one() {
        let mut raw = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..INLINE_SPANS + 10 {
            raw.push_str(&format!("x-h{i}: v{i}\r\n"));
        }
        raw.push_str("connection: close\r\ncontent-length: 0\r\n\r\n");
        let mut buf = BytesMut::from(raw.as_bytes());
        let head = parse_head(&mut buf).expect("valid").expect("complete");
        let headers = &head.parts.headers;
        assert_eq!(headers.len(), INLINE_SPANS + 11);
        assert_eq!(headers["x-h0"], "v0");
        let last = format!("x-h{}", INLINE_SPANS + 9);
        assert_eq!(
            headers[last.as_str()],
            format!("v{}", INLINE_SPANS + 9).as_str()
        );
        assert!(
            head.close,
            "the hop-by-hop header among them was read, and left out"
        );
        let mut too_many = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..MAX_HEADERS + 1 {
            too_many.push_str(&format!("x-h{i}: v\r\n"));
        }
        too_many.push_str("\r\n");
        assert!(parse_head(&mut BytesMut::from(too_many.as_bytes())).is_err());
    }
}
