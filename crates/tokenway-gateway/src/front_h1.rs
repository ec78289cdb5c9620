//! HTTP/1.1 from clients, built for streaming: one loop per connection that reads a request,
//! hands it to the request-handling core (`service::handle`), and writes the answer's frames as
//! they come, each with one write.
//!
//! Why not hyper's server here: every request crossed hyper's general machinery (a body channel
//! between the connection and the service, the dispatcher's state machine, an encoder queue),
//! and on a single stream that was most of what the gateway did beyond nginx (user time per
//! request twice nginx's, docs/benchmarks.md). Parsing stays with `httparse`; this module adds
//! the framing of RFC 9112 (content-length and chunked request bodies, `Expect: 100-continue`,
//! keep-alive, pipelining) and the timeouts of the gateway, and nothing else. HTTP/2 stays with
//! hyper (`server.rs` tells the two apart by the connection preface or ALPN).
//!
//! What it must never do: buffer a streamed answer (a frame leaves as soon as it is polled),
//! read an unbounded amount (head, body and pipelined bytes all have limits), or keep serving a
//! client that went away: while a request is handled and while its answer streams, the socket is
//! watched, and a client that closes it cancels the request (and with it the backend's work).
//! A request body is read whole before the core sees it, under the body limit and the client
//! read timeout, as the core would read it anyway to route it.

use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderMap};
use http::{Method, Request, Response, StatusCode, Version};
use http_body::Body;
use http_body_util::Full;
use tokenway_transport::body_budget::Held;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::time::{Instant, Sleep};

use crate::drain::Graceful;
use crate::error::{ApiError, ResponseBody};
use crate::forward_tcp::SpliceSlot;
use crate::h1_head::{has_token, parse_digits, HeaderSpans, MAX_HEADERS};
use crate::service::{self, BeforeBody, TcpFront};
use crate::state::Shared;

/// Largest request head accepted (431 beyond).
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Read buffer growth step: a request head with a chat body fits in one read.
const READ_BYTES: usize = 8 * 1024;
/// Below this much free space the read buffer grows by [`READ_BYTES`] before a read.
const MIN_READ_BYTES: usize = 1024;
/// Most bytes of following (pipelined) requests read while one is handled; beyond, the socket is
/// not read until the answer is out.
const MAX_PIPELINED_BYTES: usize = 64 * 1024;
/// Longest chunk-size or trailer line of a chunked request body.
const MAX_LINE_BYTES: usize = 4 * 1024;
/// Buffers grown past this (a large body or answer) are given back between requests: every idle
/// keep-alive connection keeps its buffers.
const KEEP_BUFFER_BYTES: usize = 32 * 1024;
/// After an error answer that leaves part of a request unread, how long, with what silence, and
/// how much of it is read and dropped before closing (closing with unread bytes resets the
/// connection, and the client may then never see the answer). Clients that write a whole body
/// before reading (httpx, so the `openai` SDK: no `Expect`) uploading more than the first
/// 500 ms and 1 MiB let through got a reset for their 401 or 413 (`APIConnectionError`, and
/// the SDK's retries uploaded it again). Read and dropped, the bytes cost no memory; nginx
/// lingers 30 s with 5 s of silence.
const LINGER: std::time::Duration = std::time::Duration::from_secs(10);
const LINGER_SILENCE: std::time::Duration = std::time::Duration::from_secs(2);
const LINGER_BYTES: usize = 64 * 1024 * 1024;

/// One client connection's HTTP/1.1 exchanges, as a future a [`crate::drain::Drain`] can close
/// gracefully: an idle connection closes at once, one with a request in flight after its answer.
pub struct H1Connection {
    serving: Pin<Box<dyn Future<Output = ()> + Send>>,
    closing: Arc<AtomicBool>,
}

impl H1Connection {
    /// Serves `io`, whose first bytes (already read to tell HTTP/1.1 from HTTP/2) are `read`.
    pub fn new<S>(
        io: S,
        read: BytesMut,
        peer: SocketAddr,
        front: TcpFront,
        shared: Arc<Shared>,
    ) -> Self
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let closing = Arc::new(AtomicBool::new(false));
        let conn = Conn {
            io,
            buf: read,
            out: BytesMut::new(),
            data: Bytes::new(),
            after: BytesMut::new(),
            timer: Box::pin(tokio::time::sleep_until(Instant::now())),
            peer,
            front,
            shared,
            closing: closing.clone(),
            overflow: false,
        };
        Self {
            serving: Box::pin(conn.run()),
            closing,
        }
    }
}

impl Future for H1Connection {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.serving.as_mut().poll(cx)
    }
}

impl Graceful for H1Connection {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        // Seen by the connection at its next poll, which the drain makes right after this.
        self.closing.store(true, Ordering::Release);
    }
}

/// How a request's body is delimited (RFC 9112 §6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RequestBody {
    Empty,
    Length(u64),
    Chunked,
}

/// A parsed request head.
struct Head {
    parts: http::request::Parts,
    body: RequestBody,
    keep_alive: bool,
    expect_continue: bool,
}

/// How an answer's body is delimited on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AnswerBody {
    None,
    Length(u64),
    Chunked,
    /// An HTTP/1.0 client without a known length: the body ends with the connection.
    UntilClose,
}

/// What a read from the client came to.
enum Read {
    /// Bytes were added to the buffer.
    Data,
    /// The client closed its side (or the connection failed).
    Closed,
    /// The deadline passed first.
    TimedOut,
    /// The gateway is draining and the connection is between requests.
    Draining,
}

/// Why a connection ends early.
enum End {
    /// The client went away, or writing to it failed: nothing more can be said.
    Gone,
    /// The request cannot be served; the error answer is the last thing sent.
    Reject(ApiError),
}

struct Conn<S> {
    io: S,
    /// Bytes read from the client and not yet consumed.
    buf: BytesMut,
    /// The next write: a head, a chunk, or both. A large data frame is not copied in: it waits
    /// in `data` and leaves in the same vectored write, between `out` and `after`.
    out: BytesMut,
    /// A data frame of [`COPY_BELOW`] bytes or more, written after `out`.
    data: Bytes,
    /// What is written after `data` (its framing, the end of the body).
    after: BytesMut,
    /// Deadline of the read in progress, one timer per connection.
    timer: Pin<Box<Sleep>>,
    peer: SocketAddr,
    /// The listener the connection came in on.
    front: TcpFront,
    shared: Arc<Shared>,
    closing: Arc<AtomicBool>,
    /// The client sent more than [`MAX_PIPELINED_BYTES`] ahead of its answer: the excess was
    /// read and dropped (to see the client go), so the connection closes after the answer.
    overflow: bool,
}

impl<S> Conn<S>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    async fn run(mut self) {
        loop {
            let head = match self.read_head().await {
                Ok(Some(head)) => head,
                Ok(None) => return,
                Err(end) => return self.end(end, Version::HTTP_11, None).await,
            };
            let version = head.parts.version;
            let keep_alive = head.keep_alive;
            let method = head.parts.method.clone();
            match service::before_body(&self.shared, &head.parts, self.front) {
                BeforeBody::Read => {}
                BeforeBody::Refuse(resp) => return self.close_with(resp, &method, version).await,
                // A probe with a body on the tunnel's TCP port: the masquerade site answers
                // without it (the body is neither read nor held) and the connection closes.
                BeforeBody::Masquerade if head.body != RequestBody::Empty => {
                    let req = Request::from_parts(head.parts, Full::new(Bytes::new()));
                    // Boxed for the reason below: inline, its states would enlarge every
                    // connection's future by kilobytes.
                    let handling = Box::pin(service::handle(
                        self.shared.clone(),
                        req,
                        self.peer,
                        self.front,
                    ));
                    let Ok(resp) = handling.await;
                    return self.close_with(resp, &method, version).await;
                }
                BeforeBody::Masquerade => {}
            }
            let (body, held) = match self.read_body(&head).await {
                Ok(body) => body,
                Err(end) => {
                    // Counted as every answer is (413, 408, a 503 for the body budget...).
                    if let End::Reject(e) = &end {
                        let route = service::route_label(head.parts.uri.path());
                        self.shared.count_request(route, None, e.status.as_u16());
                    }
                    return self.end(end, version, Some(&head.parts.headers)).await;
                }
            };
            let mut req = Request::from_parts(head.parts, Full::new(body));
            req.extensions_mut().insert(service::BodyHeld);
            let splice = (method == Method::CONNECT).then(|| {
                let slot = SpliceSlot::default();
                req.extensions_mut().insert(slot.clone());
                slot
            });
            // Boxed: the request's future is several KiB (every state of the proxy, inline), and
            // unboxed it was copied whole at each move into its caller's state.
            let handling = Box::pin(service::handle(
                self.shared.clone(),
                req,
                self.peer,
                self.front,
            ));
            let Some(Ok(resp)) = self.while_client_stays(handling).await else {
                return;
            };
            // The answer's head is in (or the request failed): no retry will send the body again.
            drop(held);
            let tunnel = splice.and_then(|s| s.take());
            let connect_ok = tunnel.is_some() && resp.status().is_success();
            match self.respond(resp, &method, version, keep_alive).await {
                // Bytes meant for the tunnel were dropped: it cannot be spliced whole.
                Ok(_) if connect_ok && self.overflow => return,
                Ok(_) if connect_ok => {
                    if let Some(tcp) = tunnel {
                        self.splice(tcp).await;
                    }
                    return;
                }
                Ok(true) if !self.overflow => {}
                // The last answer (the client or the gateway said `close`; or a next request
                // whose bytes were partly dropped is not read, RFC 9112 section 9.3.2 lets a
                // client retry it) is complete: a graceful close, not a reset.
                Ok(_) => return self.close().await,
                // A cut-off answer: the connection just ends.
                Err(()) => return,
            }
            if self.out.capacity() > KEEP_BUFFER_BYTES {
                self.out = BytesMut::new();
            }
            if self.buf.is_empty() && self.buf.capacity() > KEEP_BUFFER_BYTES {
                self.buf = BytesMut::new();
            }
        }
    }

    /// Reads the next request head: `None` when the connection ends between requests (the
    /// client closed it, stayed idle past `timeouts.client_read_ms`, or the gateway drains).
    async fn read_head(&mut self) -> Result<Option<Head>, End> {
        let deadline = Instant::now() + self.shared.config.timeouts.client_read();
        // Bytes already parsed as an incomplete head: a head sent a byte at a time is parsed
        // again only once an empty line may have ended it, not once per read (which made the
        // parsing quadratic in the head's length).
        let mut parsed: usize = 0;
        loop {
            // Empty lines before a request line are ignored (RFC 9112 §2.2: some clients send
            // a CRLF after a POST body). Dropped here, not only skipped by the parser: with
            // them buffered the connection did not count as idle, so it got a 408 for a
            // request never sent (which a client reusing it could take for its next
            // request's answer), and a shutdown's drain waited for it.
            let blank = self
                .buf
                .iter()
                .take_while(|&&b| b == b'\r' || b == b'\n')
                .count();
            if blank > 0 {
                let _ = self.buf.split_to(blank);
                parsed = parsed.saturating_sub(blank);
            }
            if !self.buf.is_empty() && (parsed == 0 || may_end_head(&self.buf, parsed)) {
                if let Some(head) = parse_request(&mut self.buf)? {
                    return Ok(Some(head));
                }
                parsed = self.buf.len();
            }
            if self.buf.len() > MAX_HEAD_BYTES {
                return Err(head_too_large());
            }
            let idle = self.buf.is_empty();
            match self.read(deadline, idle).await {
                Read::Data => {}
                Read::Closed | Read::Draining => return Ok(None),
                Read::TimedOut if idle => return Ok(None),
                Read::TimedOut => {
                    return Err(End::Reject(ApiError::new(
                        StatusCode::REQUEST_TIMEOUT,
                        "invalid_request_error",
                        "request_timeout",
                        "the request head did not arrive in time",
                    )))
                }
            }
        }
    }

    /// Reads the request's body whole, under `max_body_bytes` and within the gateway's budget
    /// of bodies held (`max_held_body_bytes`: a declared length must fit the room left before
    /// `100 Continue` and any of it is read, and takes its bytes as they arrive; a chunked
    /// body as it is decoded), whose bytes the returned [`Held`] keeps. The client read timeout bounds each silence, not the whole upload (nginx's
    /// `client_body_timeout`): a large body on a slow link that keeps coming is read to its end.
    async fn read_body(&mut self, head: &Head) -> Result<(Bytes, Held), End> {
        let limit = self.shared.config.max_body_bytes;
        let silence = self.shared.config.timeouts.client_read();
        let mut held = self.shared.bodies.hold();
        let no_room = || Err(End::Reject(ApiError::bodies_held()));
        match head.body {
            RequestBody::Empty => Ok((Bytes::new(), held)),
            RequestBody::Length(n) => {
                if n > limit as u64 {
                    return Err(End::Reject(ApiError::body_too_large(limit)));
                }
                let n = n as usize;
                if !held.has_room_for(n) {
                    return no_room();
                }
                if head.expect_continue && self.buf.len() < n {
                    self.continue_().await?;
                }
                loop {
                    // What arrived of this body (the buffer may hold the next request too).
                    if !held.grow(self.buf.len().min(n).saturating_sub(held.bytes())) {
                        return no_room();
                    }
                    if self.buf.len() >= n {
                        return Ok((self.buf.split_to(n).freeze(), held));
                    }
                    self.body_read(Instant::now() + silence, n - self.buf.len())
                        .await?;
                }
            }
            RequestBody::Chunked => {
                if head.expect_continue {
                    // Invited only while some room is left (a full budget answers now, not
                    // after the client started sending).
                    if !held.has_room_for(1) {
                        return no_room();
                    }
                    self.continue_().await?;
                }
                let mut chunked = ChunkedBody::default();
                loop {
                    let decoded = chunked.decode(&mut self.buf, limit);
                    if !held.grow(chunked.body.len().saturating_sub(held.bytes())) {
                        return no_room();
                    }
                    match decoded {
                        Ok(true) => return Ok((chunked.body.freeze(), held)),
                        Ok(false) => self.body_read(Instant::now() + silence, READ_BYTES).await?,
                        Err(ChunkError::TooLarge) => {
                            return Err(End::Reject(ApiError::body_too_large(limit)))
                        }
                        Err(ChunkError::Malformed(why)) => {
                            return Err(End::Reject(ApiError::new(
                                StatusCode::BAD_REQUEST,
                                "invalid_request_error",
                                "malformed_request",
                                format!("malformed chunked request body: {why}"),
                            )))
                        }
                    }
                }
            }
        }
    }

    /// Tells a client that waits for it to send its body (`Expect: 100-continue`).
    async fn continue_(&mut self) -> Result<(), End> {
        self.io
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .map_err(|_| End::Gone)?;
        self.io.flush().await.map_err(|_| End::Gone)
    }

    /// One read for a body still `missing` bytes short.
    async fn body_read(&mut self, deadline: Instant, missing: usize) -> Result<(), End> {
        self.buf.reserve(missing.min(READ_BYTES));
        match self.read(deadline, false).await {
            Read::Data => Ok(()),
            Read::Closed | Read::Draining => Err(End::Gone),
            Read::TimedOut => Err(End::Reject(ApiError::request_timeout())),
        }
    }

    /// Reads what the socket holds into the buffer, by `deadline`. A connection between requests
    /// (`idle`) also gives way to the drain.
    async fn read(&mut self, deadline: Instant, idle: bool) -> Read {
        if self.timer.deadline() != deadline {
            self.timer.as_mut().reset(deadline);
        }
        poll_fn(|cx| {
            if idle && self.closing.load(Ordering::Acquire) {
                return Poll::Ready(Read::Draining);
            }
            reserve_read_space(&mut self.buf);
            match tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(Read::Closed),
                Poll::Ready(Ok(_)) => return Poll::Ready(Read::Data),
                Poll::Pending => {}
            }
            match self.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Read::TimedOut),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// Runs `work` while watching the socket: `None` if the client closes it first (dropping
    /// `work`, and with it the request upstream). Bytes of a next request are kept, up to
    /// [`MAX_PIPELINED_BYTES`].
    async fn while_client_stays<F: Future>(&mut self, work: F) -> Option<F::Output> {
        let mut work = pin!(work);
        poll_fn(|cx| {
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            match self.poll_client(cx) {
                Poll::Ready(()) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await
    }

    /// Ready when the client has closed the connection (or it failed); keeps what it sends
    /// meanwhile, up to [`MAX_PIPELINED_BYTES`], and reads and drops the rest (setting
    /// `overflow`): a socket no longer read would not tell that its client left, and the
    /// backend would work on for no one.
    fn poll_client(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            let read = if self.buf.len() < MAX_PIPELINED_BYTES {
                reserve_read_space(&mut self.buf);
                tokio_util::io::poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
            } else {
                let mut scratch = [0u8; 4096];
                let mut rb = tokio::io::ReadBuf::new(&mut scratch);
                match Pin::new(&mut self.io).poll_read(cx, &mut rb) {
                    Poll::Ready(Ok(())) if !rb.filled().is_empty() => {
                        self.overflow = true;
                        Poll::Ready(Ok(rb.filled().len()))
                    }
                    Poll::Ready(Ok(())) => Poll::Ready(Ok(0)),
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    Poll::Pending => Poll::Pending,
                }
            };
            match read {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Ready(Ok(_)) => {}
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// Writes `resp`, its frames as they come. `Ok(true)` when the connection can carry another
    /// request; `Err` when the answer could not be completed (the connection must close).
    async fn respond(
        &mut self,
        resp: Response<ResponseBody>,
        method: &Method,
        version: Version,
        keep_alive: bool,
    ) -> Result<bool, ()> {
        let (parts, mut body) = resp.into_parts();
        let status = parts.status;
        let bodiless = *method == Method::HEAD
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
            || (*method == Method::CONNECT && status.is_success());
        let declared = content_length(&parts.headers);
        let framing = if bodiless {
            AnswerBody::None
        } else if let Some(n) = declared.or_else(|| body.size_hint().exact()) {
            AnswerBody::Length(n)
        } else if version == Version::HTTP_11 {
            AnswerBody::Chunked
        } else {
            AnswerBody::UntilClose
        };
        let keep_alive = keep_alive
            && !self.overflow
            && framing != AnswerBody::UntilClose
            && !has_token(&parts.headers, header::CONNECTION, "close")
            && !self.closing.load(Ordering::Acquire);
        self.out.clear();
        encode_head(
            &mut self.out,
            &parts,
            framing,
            declared,
            version,
            keep_alive,
        );
        if framing == AnswerBody::None {
            return self.flush().await.map(|()| keep_alive);
        }
        let mut sent = 0u64;
        // Whatever the body has ready now leaves with the head (for a relayed stream: the first
        // token, read before the head was released).
        let mut next = poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await;
        loop {
            let frame = match next {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    self.flush().await?;
                    let polled = poll_fn(|cx| {
                        if let Poll::Ready(f) = Pin::new(&mut body).poll_frame(cx) {
                            return Poll::Ready(Some(f));
                        }
                        self.poll_client(cx).map(|()| None)
                    })
                    .await;
                    match polled {
                        Some(frame) => frame,
                        None => return Err(()),
                    }
                }
            };
            match frame {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        sent += data.len() as u64;
                        if matches!(framing, AnswerBody::Length(n) if sent > n) {
                            tracing::warn!("an answer is longer than its content-length; cut");
                            return Err(());
                        }
                        self.push_data(data, framing);
                    }
                    if !body.is_end_stream() {
                        next = Poll::Pending;
                        continue;
                    }
                }
                Some(Err(e)) => {
                    // The client must see a truncated answer, never a short one that looks whole:
                    // what was encoded goes out, the end marker does not.
                    tracing::debug!(error = %e, "answer body failed; closing the connection");
                    let _ = self.flush().await;
                    return Err(());
                }
                None => {}
            }
            // The body has ended.
            if matches!(framing, AnswerBody::Length(n) if sent != n) {
                let _ = self.flush().await;
                return Err(());
            }
            if framing == AnswerBody::Chunked {
                self.tail().extend_from_slice(b"0\r\n\r\n");
            }
            self.flush().await?;
            return Ok(keep_alive);
        }
    }

    /// Queues one data frame of the answer, framed. A small frame is copied after what is
    /// queued; a large one (the first of a write) stays where the backend's bytes were read, and
    /// the kernel copies it from there.
    fn push_data(&mut self, data: Bytes, framing: AnswerBody) {
        if data.len() < COPY_BELOW || !self.data.is_empty() {
            let out = if self.data.is_empty() {
                &mut self.out
            } else {
                &mut self.after
            };
            return encode_data(out, &data, framing);
        }
        if framing == AnswerBody::Chunked {
            chunk_size_line(&mut self.out, data.len());
            self.after.extend_from_slice(b"\r\n");
        }
        self.data = data;
    }

    /// Where bytes queued now go: after a data frame waiting in `data`, if there is one.
    fn tail(&mut self) -> &mut BytesMut {
        if self.data.is_empty() {
            &mut self.out
        } else {
            &mut self.after
        }
    }

    async fn flush(&mut self) -> Result<(), ()> {
        let r = if self.data.is_empty() {
            if self.out.is_empty() {
                return Ok(());
            }
            self.io.write_all(&self.out).await
        } else {
            // One `writev` where the stream supports it.
            let mut queued = (&self.out[..]).chain(&self.data[..]).chain(&self.after[..]);
            self.io.write_all_buf(&mut queued).await
        };
        self.out.clear();
        self.data = Bytes::new();
        self.after.clear();
        r.map_err(|_| ())?;
        // A TLS stream takes plaintext as written once its library holds it; the records may still
        // wait there for socket space, and a read never sends them. Without this a large answer's
        // end stayed behind until the idle timeout closed the connection. On TCP it is a no-op.
        self.io.flush().await.map_err(|_| ())
    }

    /// Sends the error answer of `end` (if any) and closes, draining what the client still
    /// sends for a moment (see [`LINGER`]). With the request's head at hand (`headers`), the
    /// answer carries CORS headers for a listed origin as every other answer does: a browser
    /// client otherwise sees an opaque failure instead of the 413 or 408.
    async fn end(&mut self, end: End, version: Version, headers: Option<&http::HeaderMap>) {
        let End::Reject(e) = end else {
            return;
        };
        let mut resp = e.into_response();
        if let (Some(cors), Some(headers)) = (&self.shared.cors, headers) {
            cors.mark_for(headers, &mut resp);
        }
        self.close_with(resp, &Method::GET, version).await;
    }

    /// Sends `resp` as the connection's last answer and closes, lingering as [`Self::end`] does.
    async fn close_with(
        &mut self,
        resp: Response<ResponseBody>,
        method: &Method,
        version: Version,
    ) {
        if self.respond(resp, method, version, false).await.is_ok() {
            self.close().await;
        }
    }

    /// Closes after a complete last answer: FIN (TLS: `close_notify`) first, then what the
    /// client still sends is read and dropped for a moment (see [`LINGER`]), so that unread
    /// bytes (a pipelined request, the rest of a refused body) do not make the kernel reset the
    /// connection and destroy the answer before the client has read it.
    async fn close(&mut self) {
        if self.io.shutdown().await.is_err() {
            return;
        }
        let end = Instant::now() + LINGER;
        let mut drained = 0;
        while drained < LINGER_BYTES {
            self.buf.clear();
            let deadline = end.min(Instant::now() + LINGER_SILENCE);
            match self.read(deadline, false).await {
                Read::Data => drained += self.buf.len(),
                _ => return,
            }
        }
    }

    /// Joins the client connection with the target of an accepted CONNECT until either closes.
    async fn splice(mut self, mut tcp: tokio::net::TcpStream) {
        if !self.buf.is_empty() && tcp.write_all(&self.buf).await.is_err() {
            return;
        }
        self.buf = BytesMut::new();
        if let Err(e) = tokio::io::copy_bidirectional(&mut self.io, &mut tcp).await {
            tracing::debug!(error = %e, "forwarded connection ended with an error");
        }
    }
}

/// Makes room for the next read: only when little is left, so that a buffer whose front was split
/// off (and is still referenced) is not reallocated on every read.
fn reserve_read_space(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < MIN_READ_BYTES {
        buf.reserve(READ_BYTES);
    }
}

/// Whether a line feed at `from` or later ends an empty line (`\n\n` or `\n\r\n`), which a
/// head ends with.
fn may_end_head(buf: &[u8], from: usize) -> bool {
    (from.max(1)..buf.len()).any(|at| {
        buf[at] == b'\n'
            && (buf[at - 1] == b'\n' || (at >= 2 && buf[at - 1] == b'\r' && buf[at - 2] == b'\n'))
    })
}

fn head_too_large() -> End {
    End::Reject(ApiError::new(
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        "invalid_request_error",
        "request_head_too_large",
        format!("the request head exceeds {MAX_HEAD_BYTES} bytes"),
    ))
}

fn bad_request(message: String) -> End {
    End::Reject(ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        "malformed_request",
        message,
    ))
}

/// Parses a complete request head off the front of `buf`, or `None` when more bytes are needed.
fn parse_request(buf: &mut BytesMut) -> Result<Option<Head>, End> {
    let mut headers =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let consumed = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(End::Reject(ApiError::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "invalid_request_error",
                "too_many_headers",
                format!("the request has more than {MAX_HEADERS} headers"),
            )))
        }
        Err(e) => return Err(bad_request(format!("malformed request head: {e}"))),
    };
    // A complete head has all three; httparse guarantees it.
    let (Some(method), Some(path), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(bad_request("incomplete request line".to_string()));
    };
    let method = Method::from_bytes(method.as_bytes())
        .map_err(|_| bad_request(format!("bad method {method:?}")))?;
    let version = if minor == 0 {
        Version::HTTP_10
    } else {
        Version::HTTP_11
    };
    if consumed > MAX_HEAD_BYTES {
        return Err(head_too_large());
    }
    let path_at = path.as_ptr() as usize - buf.as_ptr() as usize;
    let path_len = path.len();
    let spans = HeaderSpans::new(buf.as_ptr(), req.headers);
    let head = buf.split_to(consumed).freeze();
    let uri = http::Uri::from_maybe_shared(head.slice(path_at..path_at + path_len))
        .map_err(|e| bad_request(format!("bad request target: {e}")))?;
    let headers = spans.into_map(&head, 0).map_err(bad_request)?;
    let body = request_body(&headers, version)?;
    let keep_alive = if version == Version::HTTP_10 {
        has_token(&headers, header::CONNECTION, "keep-alive")
    } else {
        !has_token(&headers, header::CONNECTION, "close")
    };
    let expect_continue = version == Version::HTTP_11
        && headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let mut parts = Request::new(()).into_parts().0;
    parts.method = method;
    parts.uri = uri;
    parts.version = version;
    parts.headers = headers;
    Ok(Some(Head {
        parts,
        body,
        keep_alive,
        expect_continue,
    }))
}

/// The request body's framing: chunked, a single content-length, or none. Anything ambiguous
/// (both, or differing lengths: the stuff of request smuggling) is refused.
fn request_body(headers: &HeaderMap, version: Version) -> Result<RequestBody, End> {
    if let Some(te) = headers.get(header::TRANSFER_ENCODING) {
        if headers.contains_key(header::CONTENT_LENGTH) {
            return Err(bad_request(
                "both transfer-encoding and content-length".to_string(),
            ));
        }
        let chunked = headers.get_all(header::TRANSFER_ENCODING).iter().count() == 1
            && te.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked");
        if !chunked || version == Version::HTTP_10 {
            return Err(End::Reject(ApiError::new(
                StatusCode::NOT_IMPLEMENTED,
                "invalid_request_error",
                "unsupported_transfer_encoding",
                "only `transfer-encoding: chunked` request bodies are supported",
            )));
        }
        return Ok(RequestBody::Chunked);
    }
    let mut length = None;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        let n = parse_digits(v.as_bytes().trim_ascii())
            .ok_or_else(|| bad_request("bad content-length".to_string()))?;
        if length.is_some_and(|l| l != n) {
            return Err(bad_request("conflicting content-length values".to_string()));
        }
        length = Some(n);
    }
    Ok(match length {
        None | Some(0) => RequestBody::Empty,
        Some(n) => RequestBody::Length(n),
    })
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| std::str::from_utf8(v.as_bytes()).ok())
        .and_then(|s| s.trim().parse().ok())
}

/// The answer's status line and headers. Framing headers are the connection's to set.
fn encode_head(
    out: &mut BytesMut,
    parts: &http::response::Parts,
    framing: AnswerBody,
    declared: Option<u64>,
    version: Version,
    keep_alive: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.put_u8(b' ');
    out.extend_from_slice(
        parts
            .status
            .canonical_reason()
            .unwrap_or("Unknown")
            .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        if name == header::CONNECTION
            || name == header::TRANSFER_ENCODING
            || name == header::CONTENT_LENGTH
            || name == "keep-alive"
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        AnswerBody::Length(n) => content_length_line(out, n),
        // A HEAD answer says the length the body would have had.
        AnswerBody::None => {
            if let Some(n) = declared {
                content_length_line(out, n);
            }
        }
        AnswerBody::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        AnswerBody::UntilClose => {}
    }
    if !parts.headers.contains_key(header::DATE) {
        out.extend_from_slice(b"date: ");
        http_date(out);
        out.extend_from_slice(b"\r\n");
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    } else if version == Version::HTTP_10 {
        out.extend_from_slice(b"connection: keep-alive\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Data frames at least this long are written from where they lie, not copied into the write
/// buffer (`Conn::push_data`): below it, a copy costs less than one more piece of a vectored
/// write.
const COPY_BELOW: usize = 1024;

/// One data frame of the answer, framed.
fn encode_data(out: &mut BytesMut, data: &[u8], framing: AnswerBody) {
    if data.is_empty() {
        return;
    }
    if framing == AnswerBody::Chunked {
        chunk_size_line(out, data.len());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    } else {
        out.extend_from_slice(data);
    }
}

/// Appends `content-length: n` and its CRLF. Numbers are written with `itoa` and by hand, not
/// through `fmt`: its machinery was the only use of that code on an answer's way out, code a
/// gateway woken for one request has to fetch from memory first.
fn content_length_line(out: &mut BytesMut, n: u64) {
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Appends a chunk's size line: `len` in lowercase hexadecimal and CRLF.
fn chunk_size_line(out: &mut BytesMut, len: usize) {
    let mut digits = [0u8; 2 * std::mem::size_of::<usize>()];
    let mut at = digits.len();
    let mut rest = len;
    loop {
        at -= 1;
        digits[at] = b"0123456789abcdef"[rest & 0xf];
        rest >>= 4;
        if rest == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
    out.extend_from_slice(b"\r\n");
}

thread_local! {
    /// The `date` header's value, formatted once per second per thread.
    static DATE: std::cell::RefCell<(u64, [u8; 29])> = const { std::cell::RefCell::new((0, [0; 29])) };
}

/// Appends the current time as an HTTP date (RFC 9110 §5.6.7).
fn http_date(out: &mut BytesMut) {
    let now = SystemTime::now();
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    DATE.with(|d| {
        let mut d = d.borrow_mut();
        if d.0 != secs {
            let text = httpdate::fmt_http_date(now);
            if text.len() == 29 {
                d.1.copy_from_slice(text.as_bytes());
                d.0 = secs;
            } else {
                out.extend_from_slice(text.as_bytes());
                return;
            }
        }
        out.extend_from_slice(&d.1);
    });
}

/// Why a chunked body could not be decoded.
#[derive(Debug, PartialEq, Eq)]
enum ChunkError {
    TooLarge,
    Malformed(&'static str),
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum ChunkState {
    /// Expecting a chunk-size line.
    #[default]
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(usize),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
    Done,
}

/// A chunked request body decoded incrementally (RFC 9112 §7.1); trailers are read and dropped,
/// at most [`MAX_HEAD_BYTES`] of them (a client sending trailer lines without end would keep
/// its connection and the gateway's reading forever).
#[derive(Default)]
struct ChunkedBody {
    state: ChunkState,
    body: BytesMut,
    trailer_bytes: usize,
}

impl ChunkedBody {
    /// Consumes what `buf` holds of the body; `Ok(true)` once it is complete.
    fn decode(&mut self, buf: &mut BytesMut, limit: usize) -> Result<bool, ChunkError> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(true),
                ChunkState::Size | ChunkState::Trailers => {
                    let Some(end) = buf.iter().position(|&b| b == b'\n') else {
                        if buf.len() > MAX_LINE_BYTES {
                            return Err(ChunkError::Malformed("line too long"));
                        }
                        return Ok(false);
                    };
                    if end > MAX_LINE_BYTES {
                        return Err(ChunkError::Malformed("line too long"));
                    }
                    let line = buf.split_to(end + 1);
                    // CRLF only, and no control bytes (an extension's value is a token or a
                    // quoted string): a front proxy that reads these lines otherwise (a bare
                    // LF, a CR inside an extension) must not see a different body than we do.
                    let Some(line) = line[..end].strip_suffix(b"\r") else {
                        return Err(ChunkError::Malformed("chunk line not ended by CRLF"));
                    };
                    if line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f) {
                        return Err(ChunkError::Malformed("control byte in a chunk line"));
                    }
                    if self.state == ChunkState::Trailers {
                        self.trailer_bytes += end + 1;
                        if line.is_empty() {
                            self.state = ChunkState::Done;
                        } else if self.trailer_bytes > MAX_HEAD_BYTES {
                            return Err(ChunkError::Malformed("trailer section too large"));
                        }
                        continue;
                    }
                    let size = line.split(|&b| b == b';').next().unwrap_or_default();
                    // Hex digits only (RFC 9112 §7.1: `1*HEXDIG`), then optional whitespace
                    // before an extension; a sign or leading space is not a size.
                    let size = size.trim_ascii_end();
                    let size = std::str::from_utf8(size)
                        .ok()
                        .filter(|s| {
                            !s.is_empty()
                                && s.len() <= 15
                                && s.bytes().all(|b| b.is_ascii_hexdigit())
                        })
                        .and_then(|s| usize::from_str_radix(s, 16).ok())
                        .ok_or(ChunkError::Malformed("bad chunk size"))?;
                    if size == 0 {
                        self.state = ChunkState::Trailers;
                    } else if self.body.len().saturating_add(size) > limit {
                        return Err(ChunkError::TooLarge);
                    } else {
                        // No reservation for the announced size: a client could announce a
                        // chunk of the whole body limit and send nothing.
                        self.state = ChunkState::Data(size);
                    }
                }
                ChunkState::Data(left) => {
                    if buf.is_empty() {
                        return Ok(false);
                    }
                    let take = left.min(buf.len());
                    self.body.extend_from_slice(&buf.split_to(take));
                    self.state = if take == left {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left - take)
                    };
                }
                ChunkState::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(false);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(ChunkError::Malformed("chunk data not followed by CRLF"));
                    }
                    let _ = buf.split_to(2);
                    self.state = ChunkState::Size;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode_in_steps(wire: &[u8], step: usize, limit: usize) -> Result<Vec<u8>, ChunkError> {
        let mut decoder = ChunkedBody::default();
        let mut buf = BytesMut::new();
        for piece in wire.chunks(step) {
            buf.extend_from_slice(piece);
            if decoder.decode(&mut buf, limit)? {
                assert!(buf.is_empty(), "bytes after the body stay in the buffer");
                return Ok(decoder.body.to_vec());
            }
        }
        Err(ChunkError::Malformed("incomplete"))
    }

    #[test]
    fn size_lines_read_as_formatted_numbers() {
        for n in [0usize, 1, 9, 10, 15, 16, 255, 4_404, 65_536, usize::MAX] {
            let mut out = BytesMut::new();
            chunk_size_line(&mut out, n);
            assert_eq!(&out[..], format!("{n:x}\r\n").as_bytes());
            let mut out = BytesMut::new();
            content_length_line(&mut out, n as u64);
            assert_eq!(&out[..], format!("content-length: {n}\r\n").as_bytes());
        }
    }

    #[test]
    fn chunked_bodies_decode_the_same_whatever_the_read_boundaries() {
        let wire = b"5\r\nhello\r\n1;ext=1\r\n \r\n6\r\nworld!\r\n0\r\ntrailer: x\r\n\r\n";
        for step in [1, 2, 3, 5, 8, 13, 64, 1000] {
            assert_eq!(
                decode_in_steps(wire, step, 1024).expect("valid body"),
                b"hello world!",
                "step {step}"
            );
        }
    }

    #[test]
    fn a_chunked_body_over_the_limit_or_malformed_is_an_error() {
        assert_eq!(
            decode_in_steps(b"10\r\n0123456789abcdef\r\n0\r\n\r\n", 64, 8),
            Err(ChunkError::TooLarge)
        );
        assert_eq!(
            decode_in_steps(b"zz\r\n", 64, 8),
            Err(ChunkError::Malformed("bad chunk size"))
        );
        assert_eq!(
            decode_in_steps(b"2\r\nabXY", 64, 8),
            Err(ChunkError::Malformed("chunk data not followed by CRLF"))
        );
        assert_eq!(
            decode_in_steps(b"ffffffffffffffffff\r\n", 64, 8),
            Err(ChunkError::Malformed("bad chunk size"))
        );
        // Trailers without end: refused past a head's size, each line short as it may be.
        let mut endless = b"1\r\nx\r\n0\r\n".to_vec();
        let field = format!("x-t: {}\r\n", "v".repeat(1000));
        let fitting = MAX_HEAD_BYTES / field.len();
        for _ in 0..fitting {
            endless.extend_from_slice(field.as_bytes());
        }
        let mut fits = endless.clone();
        fits.extend_from_slice(b"\r\n");
        assert_eq!(decode_in_steps(&fits, 4096, 8).expect("fits"), b"x");
        endless.extend_from_slice(field.as_bytes());
        assert_eq!(
            decode_in_steps(&endless, 4096, 8),
            Err(ChunkError::Malformed("trailer section too large"))
        );
    }

    proptest::proptest! {
        /// Any body, cut into any chunks and delivered in any read sizes, decodes to itself;
        /// any bytes at all decode to a body, an error or "more needed", never a panic.
        #[test]
        fn chunked_bodies_round_trip_and_garbage_never_panics(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..600),
            cuts in proptest::collection::vec(1usize..64, 1..20),
            step in 1usize..50,
            garbage in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
        ) {
            let mut wire = Vec::new();
            let mut rest = &body[..];
            for cut in cuts.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (chunk, tail) = rest.split_at((*cut).min(rest.len()));
                wire.extend_from_slice(format!("{:X}\r\n", chunk.len()).as_bytes());
                wire.extend_from_slice(chunk);
                wire.extend_from_slice(b"\r\n");
                rest = tail;
            }
            wire.extend_from_slice(b"0\r\n\r\n");
            proptest::prop_assert_eq!(decode_in_steps(&wire, step, 1024), Ok(body));
            let mut decoder = ChunkedBody::default();
            let _ = decoder.decode(&mut BytesMut::from(&garbage[..]), 1024);
            let _ = parse_request(&mut BytesMut::from(&garbage[..]));
        }
    }

    #[test]
    fn request_heads_parse_with_their_framing_and_keep_alive() {
        let mut buf = BytesMut::from(
            &b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 7\r\nExpect: 100-continue\r\n\r\n{\"a\":1}GET"[..],
        );
        let Ok(Some(head)) = parse_request(&mut buf) else {
            panic!("a complete head parses");
        };
        assert_eq!(head.parts.method, Method::POST);
        assert_eq!(head.parts.uri.path(), "/v1/chat/completions");
        assert_eq!(head.parts.headers["host"], "a");
        assert_eq!(head.body, RequestBody::Length(7));
        assert!(head.keep_alive && head.expect_continue);
        assert_eq!(&buf[..], b"{\"a\":1}GET", "the body and what follows stay");

        let mut partial = BytesMut::from(&b"GET /health HTTP/1.1\r\nhost: a\r\n"[..]);
        assert!(matches!(parse_request(&mut partial), Ok(None)));

        let mut old = BytesMut::from(&b"GET / HTTP/1.0\r\n\r\n"[..]);
        let Ok(Some(head)) = parse_request(&mut old) else {
            panic!("an HTTP/1.0 head parses");
        };
        assert!(
            !head.keep_alive,
            "HTTP/1.0 closes unless asked to keep alive"
        );
    }

    #[test]
    fn ambiguous_or_unsupported_framing_is_refused() {
        let status = |head: &[u8]| match parse_request(&mut BytesMut::from(head)) {
            Err(End::Reject(e)) => e.status.as_u16(),
            Err(End::Gone) => 0,
            Ok(_) => 200,
        };
        assert_eq!(
            status(b"POST / HTTP/1.1\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"),
            400
        );
        assert_eq!(
            status(b"POST / HTTP/1.1\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n"),
            400
        );
        assert_eq!(
            status(b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n"),
            501
        );
        assert_eq!(status(b"POST / HTTP/1.1\r\ncontent-length: x\r\n\r\n"), 400);
        // `1*DIGIT`: a sign is not a length (a proxy in front may read it otherwise).
        assert_eq!(
            status(b"POST / HTTP/1.1\r\ncontent-length: +3\r\n\r\n"),
            400
        );
        // A head over the limit is refused even when it arrived whole in one read.
        let big = format!(
            "GET / HTTP/1.1\r\nx: {}\r\n\r\n",
            "a".repeat(MAX_HEAD_BYTES)
        );
        assert_eq!(status(big.as_bytes()), 431);
        assert_eq!(status(b"\x16\x03\x01\x00\xffGARBAGE\r\n\r\n"), 400);
        let many: String = (0..200).map(|i| format!("h{i}: v\r\n")).collect();
        assert_eq!(
            status(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()),
            431
        );
    }

    /// A gateway state with one (unreached) backend, and an HTTP/1.1 front connection on one
    /// end of an in-memory pipe, watched by `drain`.
    fn serve(
        drain: &Arc<crate::drain::Drain>,
    ) -> (tokio::task::JoinHandle<()>, tokio::io::DuplexStream) {
        let config = crate::config::GatewayConfig::from_toml_str(
            "[[backends]]\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .expect("valid config");
        let shared = Shared::new(config).expect("gateway state");
        let (client, server) = tokio::io::duplex(64 * 1024);
        let peer = SocketAddr::from(([127, 0, 0, 1], 40000));
        let conn = drain.watch(H1Connection::new(
            server,
            BytesMut::new(),
            peer,
            TcpFront::Api,
            shared,
        ));
        (tokio::spawn(conn), client)
    }

    /// A connection's state on `io`, for tests of its parts.
    fn conn_on(
        io: tokio::io::DuplexStream,
        config: crate::config::GatewayConfig,
    ) -> Conn<tokio::io::DuplexStream> {
        Conn {
            io,
            buf: BytesMut::new(),
            out: BytesMut::new(),
            data: Bytes::new(),
            after: BytesMut::new(),
            timer: Box::pin(tokio::time::sleep_until(Instant::now())),
            peer: SocketAddr::from(([127, 0, 0, 1], 40000)),
            front: TcpFront::Api,
            shared: Shared::new(config).expect("gateway state"),
            closing: Arc::new(AtomicBool::new(false)),
            overflow: false,
        }
    }

    /// A client that pipelines more than is kept and then leaves is still seen leaving (the
    /// request it was waiting for is dropped, and with it the backend's work), and one that
    /// stays gets its answer and then the connection closes.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_pipelines_past_the_bound_is_still_watched() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A connection whose client has sent 10 KB more than is kept.
        let pipelined = || async {
            let config = crate::config::GatewayConfig::from_toml_str(
                "[[backends]]\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
            )
            .expect("valid config");
            let (mut client, server) = tokio::io::duplex(256 * 1024);
            client
                .write_all(&vec![b'x'; MAX_PIPELINED_BYTES + 10_000])
                .await
                .expect("pipelined");
            (client, conn_on(server, config))
        };
        let (client, mut conn) = pipelined().await;
        drop(client);
        // The work never ends: only the client's going can end the wait (before, nothing did:
        // the socket was no longer read once 64 KiB were kept).
        let gone = tokio::time::timeout(
            std::time::Duration::from_secs(3600),
            conn.while_client_stays(std::future::pending::<()>()),
        )
        .await;
        assert_eq!(gone, Ok(None), "the client's close is seen");
        assert!(conn.overflow);
        assert!(conn.buf.len() <= MAX_PIPELINED_BYTES + 64 * 1024);

        let (mut client, mut conn) = pipelined().await;
        let work = tokio::time::sleep(std::time::Duration::from_secs(1));
        assert_eq!(conn.while_client_stays(work).await, Some(()));
        let body = http_body_util::BodyExt::map_err(
            http_body_util::Full::new(Bytes::from_static(b"ok")),
            |e: std::convert::Infallible| -> crate::error::BoxError { match e {} },
        );
        let resp = Response::new(http_body_util::BodyExt::boxed(body));
        let keep = conn
            .respond(resp, &Method::GET, Version::HTTP_11, true)
            .await
            .expect("written");
        assert!(!keep, "the connection closes after the answer");
        drop(conn);
        let mut wire = Vec::new();
        client.read_to_end(&mut wire).await.expect("read");
        let text = String::from_utf8(wire).expect("ascii");
        assert!(text.contains("connection: close"), "{text}");
        assert!(text.ends_with("ok"), "{text}");
    }

    /// An answer whose frames are small, large (written from where it lies, in a vectored
    /// write) and small again arrives whole and in order, chunked.
    #[tokio::test]
    async fn large_frames_leave_uncopied_between_their_framing() {
        use tokio::io::AsyncReadExt;
        let config = crate::config::GatewayConfig::from_toml_str(
            "[[backends]]\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .expect("valid config");
        let (mut client, server) = tokio::io::duplex(256 * 1024);
        let mut conn = conn_on(server, config);
        let large = "x".repeat(3 * COPY_BELOW);
        let pieces = [
            "data: a\n\n".to_string(),
            large.clone(),
            "data: b\n\n".to_string(),
        ];
        let frames = pieces
            .clone()
            .into_iter()
            .map(|p| Ok::<_, crate::error::BoxError>(http_body::Frame::data(Bytes::from(p))));
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let resp = Response::new(http_body_util::BodyExt::boxed(body));
        let keep = conn
            .respond(resp, &Method::GET, Version::HTTP_11, true)
            .await
            .expect("written");
        assert!(keep);
        drop(conn);
        let mut wire = Vec::new();
        client.read_to_end(&mut wire).await.expect("read");
        let text = String::from_utf8(wire).expect("ascii");
        let body = &text[text.find("\r\n\r\n").expect("head") + 4..];
        let want = format!(
            "9\r\ndata: a\n\n\r\n{:x}\r\n{large}\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n",
            large.len()
        );
        assert_eq!(body, want);
    }

    /// Size and trailer lines end with CRLF and hold no control bytes: a bare LF, or a CR
    /// inside an extension, is a line boundary some front proxy reads otherwise.
    #[test]
    fn chunk_lines_end_with_crlf_and_hold_no_control_bytes() {
        for bad in [
            &b"2;x\nab\r\n0\r\n\r\n"[..],
            b"2;a\rb\r\nab\r\n0\r\n\r\n",
            b"2\r\nab\r\n0\n\r\n",
            b"2\r\nab\r\n0\r\nx-t: 1\n\r\n",
            b"2;\x01\r\nab\r\n0\r\n\r\n",
        ] {
            for step in [1, 64] {
                assert!(
                    decode_in_steps(bad, step, 1024).is_err(),
                    "{:?}",
                    String::from_utf8_lossy(bad)
                );
            }
        }
        assert_eq!(
            decode_in_steps(b"2;a=\"x\ty\"\r\nab\r\n0\r\nx-t: 1\r\n\r\n", 1, 1024),
            Ok(b"ab".to_vec())
        );
    }

    #[test]
    fn a_signed_chunk_size_is_malformed() {
        assert!(decode_in_steps(b"+5\r\nhello\r\n0\r\n\r\n", 64, 1024).is_err());
        assert!(decode_in_steps(b" 5\r\nhello\r\n0\r\n\r\n", 64, 1024).is_err());
        assert_eq!(
            decode_in_steps(b"5 ;ext=1\r\nhello\r\n0\r\n\r\n", 64, 1024),
            Ok(b"hello".to_vec())
        );
    }

    #[test]
    fn a_head_may_end_only_where_an_empty_line_does() {
        let head = b"GET / HTTP/1.1\r\nhost: a\r\n\r\n";
        for end in 0..head.len() {
            let complete = end == head.len() - 1 || end == head.len();
            assert_eq!(may_end_head(&head[..=end], 0), complete, "{end}");
        }
        assert!(may_end_head(b"GET / HTTP/1.1\nhost: a\n\n", 10));
        assert!(!may_end_head(b"GET / HTTP/1.1\r\nhost: a\r\n\r\n", 29));
    }

    /// A client without an API key gets its 401 from the head: no `100 Continue` invites its
    /// body, and the body is not read.
    #[tokio::test]
    async fn a_request_without_its_key_is_refused_before_its_body() {
        use tokio::io::AsyncReadExt;
        let config = crate::config::GatewayConfig::from_toml_str(
            "api_keys = [\"k1\"]\n[[backends]]\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .expect("valid config");
        let shared = Shared::new(config).expect("gateway state");
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let peer = SocketAddr::from(([127, 0, 0, 1], 40000));
        let task = tokio::spawn(H1Connection::new(
            server,
            BytesMut::new(),
            peer,
            TcpFront::Api,
            shared,
        ));
        client
            .write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n\
                  content-length: 30000000\r\n\r\n",
            )
            .await
            .expect("write");
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), client.read(&mut buf))
            .await
            .expect("answered without the body")
            .expect("read");
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(text.starts_with("HTTP/1.1 401 "), "{text}");
        assert!(
            text.contains("invalid_api_key") || text.contains("missing_api_key"),
            "{text}"
        );
        task.abort();
    }

    /// A stream that, like a TLS stream, takes written bytes at once but sends them only when
    /// flushed.
    struct SendsOnFlush {
        inner: tokio::io::DuplexStream,
        held: Vec<u8>,
    }

    impl AsyncRead for SendsOnFlush {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for SendsOnFlush {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.held.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            let this = &mut *self;
            while !this.held.is_empty() {
                match Pin::new(&mut this.inner).poll_write(cx, &this.held) {
                    Poll::Ready(Ok(n)) => drop(this.held.drain(..n)),
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            Pin::new(&mut this.inner).poll_flush(cx)
        }

        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_shutdown(cx)
        }
    }

    /// Over TLS the answer's bytes wait in the TLS library until flushed; a keep-alive
    /// connection that went back to reading after an answer once left its end there.
    #[tokio::test]
    async fn an_answer_is_flushed_through_a_stream_that_holds_writes() {
        use tokio::io::AsyncReadExt;
        let config = crate::config::GatewayConfig::from_toml_str(
            "[[backends]]\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .expect("valid config");
        let shared = Shared::new(config).expect("gateway state");
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let io = SendsOnFlush {
            inner: server,
            held: Vec::new(),
        };
        let peer = SocketAddr::from(([127, 0, 0, 1], 40000));
        let task = tokio::spawn(H1Connection::new(
            io,
            BytesMut::new(),
            peer,
            TcpFront::Api,
            shared,
        ));
        client
            .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), client.read(&mut buf))
            .await
            .expect("the answer was flushed while the connection waits for the next request")
            .expect("read");
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(text.ends_with("\r\n\r\nok\n"), "{text}");
        task.abort();
    }

    /// Load balancers' health checks often use HEAD.
    #[tokio::test]
    async fn a_head_request_for_health_is_answered_without_a_body() {
        use tokio::io::AsyncReadExt;
        let drain = Arc::new(crate::drain::Drain::default());
        let (task, mut client) = serve(&drain);
        client
            .write_all(
                b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\nGET /health HTTP/1.1\r\nhost: x\r\n\r\n",
            )
            .await
            .expect("write");
        let mut wire = Vec::new();
        while wire.windows(3).filter(|w| w == b"ok\n").count() < 1 {
            let mut buf = vec![0u8; 4096];
            let n = client.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&wire));
            wire.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&wire).into_owned();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        // The HEAD answer has no body: the next bytes are the GET's status line.
        let second = text[4..].find("HTTP/1.1 200 OK\r\n").expect("two answers") + 4;
        assert!(text[..second].ends_with("\r\n\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nok\n"), "{text}");
        task.abort();
    }

    #[tokio::test]
    async fn a_drain_closes_an_idle_keep_alive_connection_after_its_answer() {
        use tokio::io::AsyncReadExt;
        let drain = Arc::new(crate::drain::Drain::default());
        let (task, mut client) = serve(&drain);
        client
            .write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = vec![0u8; 4096];
        let n = client.read(&mut buf).await.expect("read");
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nok\n"), "{text}");
        let shutdown = tokio::time::timeout(std::time::Duration::from_secs(5), drain.shutdown());
        shutdown.await.expect("the drain finished");
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("the connection ended")
            .expect("no panic");
        assert_eq!(client.read(&mut buf).await.expect("read"), 0, "closed");
    }

    #[test]
    fn answers_are_framed_by_length_chunks_or_close() {
        let mut parts = Response::new(()).into_parts().0;
        parts.headers.insert(
            header::CONTENT_TYPE,
            "text/event-stream".parse().expect("valid"),
        );
        let mut out = BytesMut::new();
        encode_head(
            &mut out,
            &parts,
            AnswerBody::Chunked,
            None,
            Version::HTTP_11,
            true,
        );
        encode_data(&mut out, b"data: x\n\n", AnswerBody::Chunked);
        let text = String::from_utf8(out.to_vec()).expect("ascii");
        assert!(text.starts_with("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"));
        assert!(text.contains("transfer-encoding: chunked\r\n"));
        assert!(text.contains("\r\ndate: "));
        assert!(!text.contains("connection:"));
        assert!(text.ends_with("\r\n\r\n9\r\ndata: x\n\n\r\n"), "{text:?}");

        let mut out = BytesMut::new();
        encode_head(
            &mut out,
            &parts,
            AnswerBody::Length(2),
            None,
            Version::HTTP_10,
            false,
        );
        let text = String::from_utf8(out.to_vec()).expect("ascii");
        assert!(text.contains("content-length: 2\r\n"));
        assert!(text.ends_with("connection: close\r\n\r\n"));
    }
}
