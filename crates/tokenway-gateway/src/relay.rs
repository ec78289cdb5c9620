//! Streams a backend's response body to the client, frame by frame, as it arrives.
//!
//! [`RelayBody`] wraps the upstream body: the client connection polls it directly, so a frame
//! goes from the backend's socket to the client's without a task hop. Frames that have already
//! arrived together are merged into one (up to [`COALESCE_BYTES`]): one chunk, one HTTP/2 or
//! HTTP/3 DATA frame, one SSE scan and one clock reading instead of one per upstream chunk. Under
//! load that copy is far cheaper than the per-frame work it saves in the client connection
//! (measured with callgrind on `bench gateway`'s workload: 19 % fewer instructions per request on
//! the HTTP/1.1 front). Nothing ever waits for more bytes, so the first token leaves the moment it
//! arrives. On the way the relay measures SSE events: time to first token and inter-token gaps.
//! That bookkeeping (the SSE scan, the router's first-token report) is done for a frame after
//! it has been handed to the client connection, at the next poll or at the drop: the connection
//! writes a frame before it polls again, so the token goes first and the clocks keep the time
//! it came. The last frame is no exception: the body says it has ended as it hands the frame
//! out, and the response's end (its duration, the router's end of the attempt) is
//! reported with that frame's bookkeeping, once the client connection is done with it. A whole
//! short answer often arrives in one read, so this keeps the scan of all its events and the
//! router's lock out of the first token's way (`bench gateway`, docs/benchmarks.md). The HTTP/1.1
//! front drops the body before it reads the connection's next request, so a client that sends
//! requests one after another on a connection never finds the previous one still in flight; on
//! another connection, `/metrics` may lag the last byte of an answer by that bookkeeping.
//!
//! A silent backend (no bytes for `stream_idle`) ends the stream. A client that stops reading is
//! handled below this layer, by the connection's write-stall guard (`tokenway_transport::stall_io`).
//!
//! After the first byte has reached the client nothing can be retried. An upstream failure in an
//! event stream then becomes a final SSE error event and a clean end; in any other body it becomes
//! a body error so that the client sees a truncated response, never a silently short one.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use tokenway_router::Outcome;
use tokenway_telemetry::stream_clock::StreamClock;
use tokenway_wire::sse::{ErrorEventStyle, StreamErrorCause};
use tokenway_wire::sse_hold::EventHoldBack;
use tokio::time::Sleep;

use crate::error::BoxError;
use crate::state::Attempt;
use crate::upstream_h1::H1Body;

/// Most bytes merged from frames that arrived together.
pub const COALESCE_BYTES: usize = 16 * 1024;

/// What the relay does after the upstream body ended or failed.
enum Tail {
    /// Still streaming.
    Open,
    /// Upstream ended or failed while frames were being merged: finish at the next poll.
    Pending(Option<Result<Frame<Bytes>, String>>),
    /// Done: only `None` from now on.
    Closed,
}

/// The client-facing body of a proxied response.
pub struct RelayBody {
    upstream: H1Body,
    first: Option<Frame<Bytes>>,
    attempt: Attempt,
    clock: StreamClock,
    idle: Pin<Box<Sleep>>,
    idle_timeout: Duration,
    last_activity: tokio::time::Instant,
    tail: Tail,
    /// The last frame handed out and when, not yet scanned by the clock.
    unobserved: Option<(Bytes, std::time::Instant)>,
    /// The upstream body ended with the last frame handed out; the response's end is reported
    /// with that frame's bookkeeping.
    end_unreported: bool,
    /// Of an event stream, the start of an event whose end has not arrived yet: held back, so
    /// that an upstream failure's error event never lands inside it (the client would read
    /// the two as one event of broken JSON, not as an error).
    held: EventHoldBack,
    /// The backend sent an error event (`data: {"error": ...}`, how vLLM and SGLang report a
    /// generation that failed after the 200; llama.cpp's `error: {...}`): relayed as it is; one
    /// the backend calls its own
    /// fault makes the answer a failure of the backend.
    backend_error: Option<StreamErrorCause>,
    /// The shape of the gateway's own error event (the route's API).
    error_style: ErrorEventStyle,
}

/// What one poll of the relay's body gives.
type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

impl RelayBody {
    /// Relays `upstream`, whose first frame (already read while the attempt could still be
    /// retried) is `first`.
    pub fn new(
        first: Option<Frame<Bytes>>,
        upstream: H1Body,
        attempt: Attempt,
        clock: StreamClock,
        stream_idle: Duration,
    ) -> Self {
        let now = tokio::time::Instant::now();
        Self {
            upstream,
            first,
            attempt,
            clock,
            idle: Box::pin(tokio::time::sleep_until(now + stream_idle)),
            idle_timeout: stream_idle,
            last_activity: now,
            tail: Tail::Open,
            unobserved: None,
            end_unreported: false,
            held: EventHoldBack::default(),
            backend_error: None,
            error_style: ErrorEventStyle::OpenAi,
        }
    }

    /// Shapes the gateway's own error event as the route's API does.
    pub fn with_error_style(mut self, style: ErrorEventStyle) -> Self {
        self.error_style = style;
        self
    }

    /// How the upstream's clean end counts: a failure if the backend reported one of its own
    /// in-stream (one it says the request caused, a 4xx, is no sign of a bad backend: a client
    /// that could provoke it must not be able to eject backends).
    fn end_outcome(&mut self) -> Outcome {
        let Some(cause) = self.backend_error else {
            return Outcome::Success;
        };
        let backend = self.attempt.backend_name();
        tracing::warn!(%backend, ?cause, "the backend reported an error inside its event stream");
        match cause {
            StreamErrorCause::Server => {
                self.attempt.count_stream_error("backend_error_event");
                Outcome::ServerError
            }
            StreamErrorCause::Client => {
                self.attempt.count_stream_error("backend_rejected");
                Outcome::Rejected
            }
        }
    }

    /// Does the bookkeeping of the frame handed out last (see the module docs); before the
    /// first frame is out there is none, and the attempt's first-token report waits for it.
    fn settle(&mut self) {
        if self.first.is_some() {
            return;
        }
        self.attempt.settle();
        if let Some((data, at)) = self.unobserved.take() {
            if self.clock.sse() && self.backend_error.is_none() {
                self.backend_error = tokenway_wire::sse::find_error_event(&data);
            }
            self.clock.observe_at(&data, at);
        }
        if std::mem::take(&mut self.end_unreported) {
            let outcome = self.end_outcome();
            self.attempt.finish(outcome);
            self.clock.finish();
        }
    }

    /// Ends the relay after an upstream failure or stall.
    fn fail(&mut self, stalled: bool, why: &str) -> Polled {
        self.tail = Tail::Closed;
        // The unfinished event will never be finished: the error event takes its place.
        let lead = self.held.discard();
        let backend = self.attempt.backend_name();
        let (outcome, message) = if stalled {
            (
                Outcome::Timeout,
                format!("backend {backend} stopped sending in the middle of the response"),
            )
        } else {
            (
                Outcome::ServerError,
                format!("backend {backend} failed in the middle of the response: {why}"),
            )
        };
        tracing::warn!(%backend, %message, "upstream failure after the first byte");
        if stalled {
            self.attempt.stalled();
        }
        self.attempt.count_stream_error(if stalled {
            "upstream_stalled"
        } else {
            "upstream_failed"
        });
        self.attempt.finish(outcome);
        self.clock.finish();
        if self.clock.sse() {
            let event = self.error_style.event(&message, "upstream_error");
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(
                [lead.as_bytes(), &event].concat(),
            )))))
        } else {
            Poll::Ready(Some(Err(message.into())))
        }
    }

    fn complete(&mut self) -> Polled {
        if let Some(rest) = self.held.take() {
            // The backend ended inside an event: pass it on as it is, and end after it.
            self.tail = Tail::Pending(None);
            return self.pass(rest);
        }
        self.tail = Tail::Closed;
        let outcome = self.end_outcome();
        self.attempt.finish(outcome);
        self.clock.finish();
        Poll::Ready(None)
    }

    /// Passes on a data frame, whose bookkeeping waits for the next poll or the drop. If the
    /// upstream body has ended with it, the body says so now (`is_end_stream`): a body of known
    /// length is not polled again once its last byte is out (the client connection knows the
    /// length), so its end is reported with the frame's bookkeeping, at the drop.
    ///
    /// `None` when all of it was held back (the start of an event still arriving): the caller
    /// polls the upstream again.
    fn data(&mut self, data: Bytes) -> Option<Polled> {
        let ended = self.upstream_ended();
        let data = if self.clock.sse() && !ended {
            self.held.whole_events(data)?
        } else {
            self.held.all(data)
        };
        Some(self.pass(data))
    }

    /// Whether the upstream body ended cleanly with what was read so far. A failure or
    /// trailers that [`Self::coalesce`] read behind the data (`Tail::Pending`) are still to
    /// come, whatever the body says of itself: an upstream body that failed says it has ended
    /// too, and taking that for the end turned a backend's crash right behind its last bytes
    /// into a clean, successful, silently short answer.
    fn upstream_ended(&self) -> bool {
        match self.tail {
            Tail::Pending(None) => true,
            Tail::Open => self.upstream.is_end_stream(),
            Tail::Pending(Some(_)) | Tail::Closed => false,
        }
    }

    /// Hands out a data frame (see [`Self::data`]).
    fn pass(&mut self, data: Bytes) -> Polled {
        if self.upstream_ended() {
            self.tail = Tail::Closed;
            self.end_unreported = true;
        }
        self.unobserved = Some((data.clone(), std::time::Instant::now()));
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    /// Merges data frames that are ready right now onto `first`, up to [`COALESCE_BYTES`].
    fn coalesce(&mut self, cx: &mut Context<'_>, first: Bytes) -> Bytes {
        let mut merged: Option<BytesMut> = None;
        loop {
            let len = merged.as_ref().map_or(first.len(), BytesMut::len);
            if len >= COALESCE_BYTES {
                break;
            }
            match Pin::new(&mut self.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let buffered = self.upstream.buffered();
                        let buf = merged.get_or_insert_with(|| {
                            // Room for what is already buffered upstream, not the most ever
                            // merged: with a few hundred streams answering at once, 16 KiB each
                            // was megabytes of peak RSS for 4 KiB answers.
                            let want = first.len() + data.len() + buffered;
                            let mut b = BytesMut::with_capacity(want.min(COALESCE_BYTES));
                            b.extend_from_slice(&first);
                            b
                        });
                        buf.extend_from_slice(&data);
                    }
                    Err(trailers) => {
                        self.tail = Tail::Pending(Some(Ok(trailers)));
                        break;
                    }
                },
                Poll::Ready(Some(Err(e))) => {
                    self.tail = Tail::Pending(Some(Err(e.to_string())));
                    break;
                }
                Poll::Ready(None) => {
                    self.tail = Tail::Pending(None);
                    break;
                }
                Poll::Pending => break,
            }
        }
        merged.map_or(first, BytesMut::freeze)
    }
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled {
        let this = &mut *self;
        this.settle();
        if let Some(frame) = this.first.take() {
            match frame.into_data() {
                Ok(data) => {
                    // What arrived behind the first frame leaves with it (and the head).
                    let data = this.coalesce(cx, data);
                    if let Some(ready) = this.data(data) {
                        return ready;
                    }
                }
                Err(frame) => return Poll::Ready(Some(Ok(frame))),
            }
        }
        loop {
            if let Some(ready) = this.poll_upstream(cx) {
                return ready;
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.tail, Tail::Closed)
    }

    fn size_hint(&self) -> SizeHint {
        // An event stream may end with an error event the upstream never sent.
        if self.clock.sse() {
            return SizeHint::default();
        }
        let upstream = self.upstream.size_hint();
        let n = self
            .first
            .as_ref()
            .and_then(|f| f.data_ref())
            .map_or(0, |d| d.len() as u64);
        let mut hint = SizeHint::new();
        if let Some(upper) = upstream.upper() {
            hint.set_upper(upper + n);
        }
        hint.set_lower(upstream.lower() + n);
        hint
    }
}

impl RelayBody {
    /// One step of [`Body::poll_frame`] past the first frame: `None` when a frame was read but
    /// all of it held back (poll again).
    fn poll_upstream(&mut self, cx: &mut Context<'_>) -> Option<Polled> {
        match std::mem::replace(&mut self.tail, Tail::Open) {
            Tail::Open => {}
            Tail::Closed => {
                self.tail = Tail::Closed;
                return Some(Poll::Ready(None));
            }
            Tail::Pending(None) => return Some(self.complete()),
            Tail::Pending(Some(Ok(trailers))) => {
                if let Some(rest) = self.held.take() {
                    // Data never follows trailers: what was held back goes first.
                    self.tail = Tail::Pending(Some(Ok(trailers)));
                    return Some(Poll::Ready(Some(Ok(Frame::data(rest)))));
                }
                self.tail = Tail::Pending(None);
                return Some(Poll::Ready(Some(Ok(trailers))));
            }
            Tail::Pending(Some(Err(why))) => return Some(self.fail(false, &why)),
        }
        Some(match Pin::new(&mut self.upstream).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                self.last_activity = tokio::time::Instant::now();
                match frame.into_data() {
                    Ok(data) => {
                        let data = self.coalesce(cx, data);
                        return self.data(data);
                    }
                    Err(trailers) => match self.held.take() {
                        Some(rest) => {
                            self.tail = Tail::Pending(Some(Ok(trailers)));
                            Poll::Ready(Some(Ok(Frame::data(rest))))
                        }
                        None => Poll::Ready(Some(Ok(trailers))),
                    },
                }
            }
            Poll::Ready(Some(Err(e))) => self.fail(false, &e.to_string()),
            Poll::Ready(None) => self.complete(),
            Poll::Pending => {
                let deadline = self.last_activity + self.idle_timeout;
                if self.idle.deadline() != deadline {
                    self.idle.as_mut().reset(deadline);
                }
                match self.idle.as_mut().poll(cx) {
                    Poll::Ready(()) => self.fail(true, ""),
                    Poll::Pending => Poll::Pending,
                }
            }
        })
    }
}

impl Drop for RelayBody {
    /// A client that leaves drops the body mid-stream; the frame it was handed is still
    /// counted.
    fn drop(&mut self) {
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;
    use std::sync::Arc;

    use tokenway_router::{BackendId, RouteRequest};
    use tokio::io::AsyncWriteExt;

    use super::*;
    use crate::state::Shared;

    fn count(shared: &Shared, series: &str) -> f64 {
        tokenway_telemetry::render(&shared.registry)
            .lines()
            .filter(|l| l.starts_with(series))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// The relay of an event stream whose first event came with the head and whose rest comes
    /// from `backend`.
    async fn relay() -> (Arc<Shared>, RelayBody, tokio::net::TcpStream) {
        let config = crate::config::GatewayConfig::from_toml_str(
            "[[backends]]\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
        )
        .expect("valid config");
        let shared = Shared::new(config).expect("gateway state");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let near = tokio::net::TcpStream::connect(listener.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (backend, _) = listener.accept().await.expect("accept");
        let id = BackendId(0);
        let mut attempt = Attempt::start(shared.clone(), id, Arc::new(RouteRequest::new("m")));
        attempt.first_byte(Duration::from_millis(1));
        let [ttft, gap, duration] =
            shared.stream_histograms(id, "/v1/chat/completions", "h1", "local");
        let clock = StreamClock::new(
            tokenway_telemetry::stream_clock::StreamHistograms {
                ttft,
                gap,
                duration,
            },
            std::time::Instant::now(),
            true,
        );
        let body = H1Body::chunked_for_test(near, b"");
        let first = Frame::data(Bytes::from_static(b"data: {\"n\":1}\n\n"));
        let relay = RelayBody::new(Some(first), body, attempt, clock, Duration::from_secs(5));
        (shared, relay, backend)
    }

    async fn next(relay: &mut RelayBody) -> Bytes {
        let frame = poll_fn(|cx| Pin::new(&mut *relay).poll_frame(cx)).await;
        frame
            .expect("a frame")
            .expect("no error")
            .into_data()
            .expect("data")
    }

    #[tokio::test]
    async fn a_frame_is_handed_out_before_it_is_counted_and_the_end_is_counted_at_the_drop() {
        let (shared, mut relay, mut backend) = relay().await;
        let ttft = "tokenway_ttft_seconds_count";
        let duration = "tokenway_request_duration_seconds_count";
        assert_eq!(&next(&mut relay).await[..], b"data: {\"n\":1}\n\n");
        // The first token is out; its scan and the router's report wait for the next poll.
        assert_eq!(count(&shared, ttft), 0.0);
        backend
            .write_all(b"f\r\ndata: {\"n\":2}\n\n\r\n")
            .await
            .expect("write");
        assert_eq!(&next(&mut relay).await[..], b"data: {\"n\":2}\n\n");
        assert_eq!(count(&shared, ttft), 1.0);
        assert_eq!(count(&shared, "tokenway_inter_token_seconds_count"), 0.0);
        // The last frame: the body says it has ended, and the response is reported (timed,
        // its backend slot freed) once the client connection is done with it.
        backend
            .write_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            .await
            .expect("write");
        assert_eq!(&next(&mut relay).await[..], b"data: [DONE]\n\n");
        assert!(relay.is_end_stream());
        assert_eq!(count(&shared, duration), 0.0);
        drop(relay);
        assert_eq!(count(&shared, duration), 1.0);
        assert_eq!(count(&shared, "tokenway_inter_token_seconds_count"), 1.0);
        assert_eq!(count(&shared, "tokenway_backend_inflight"), 0.0);
    }

    #[tokio::test]
    async fn a_body_polled_after_its_last_frame_reports_the_end_then() {
        let (shared, mut relay, mut backend) = relay().await;
        next(&mut relay).await;
        backend
            .write_all(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            .await
            .expect("write");
        next(&mut relay).await;
        assert_eq!(
            count(&shared, "tokenway_request_duration_seconds_count"),
            0.0
        );
        let end = poll_fn(|cx| Pin::new(&mut relay).poll_frame(cx)).await;
        assert!(end.is_none());
        assert_eq!(
            count(&shared, "tokenway_request_duration_seconds_count"),
            1.0
        );
        assert_eq!(count(&shared, "tokenway_backend_inflight"), 0.0);
    }

    #[tokio::test]
    async fn a_frame_handed_out_to_a_client_that_leaves_is_still_counted() {
        let (shared, mut relay, _backend) = relay().await;
        next(&mut relay).await;
        drop(relay);
        assert_eq!(count(&shared, "tokenway_ttft_seconds_count"), 1.0);
        assert_eq!(
            count(&shared, "tokenway_request_duration_seconds_count"),
            0.0
        );
    }

    #[tokio::test]
    async fn an_event_cut_by_an_upstream_failure_is_replaced_by_the_error_event() {
        let (_shared, mut relay, mut backend) = relay().await;
        next(&mut relay).await;
        // An event that arrives in two pieces leaves whole.
        backend
            .write_all(b"a\r\ndata: {\"n\"\r\n")
            .await
            .expect("write");
        backend.write_all(b"5\r\n:2}\n\n\r\n").await.expect("write");
        assert_eq!(&next(&mut relay).await[..], b"data: {\"n\":2}\n\n");
        // An event and the start of another, then the backend's connection breaks: the whole
        // event goes out, the piece never does, and the error event starts a line of its own.
        backend
            .write_all(b"1a\r\ndata: {\"n\":3}\n\ndata: {\"n\r\n")
            .await
            .expect("write");
        assert_eq!(&next(&mut relay).await[..], b"data: {\"n\":3}\n\n");
        drop(backend);
        let error = next(&mut relay).await;
        assert!(error.starts_with(b"data: {\"error\""), "{error:?}");
        assert!(error.ends_with(b"\n\n"));
        let end = poll_fn(|cx| Pin::new(&mut relay).poll_frame(cx)).await;
        assert!(end.is_none());
    }

    #[tokio::test]
    async fn a_failure_read_together_with_the_last_bytes_is_an_error_not_a_clean_end() {
        let (shared, mut relay, mut backend) = relay().await;
        next(&mut relay).await;
        // An event, the start of another and the connection's end reach the gateway before
        // the relay reads again: one read holds all three.
        backend
            .write_all(b"1a\r\ndata: {\"n\":3}\n\ndata: {\"n\r\n")
            .await
            .expect("write");
        drop(backend);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(&next(&mut relay).await[..], b"data: {\"n\":3}\n\n");
        assert!(!relay.is_end_stream(), "the failure is still to be told");
        let error = next(&mut relay).await;
        assert!(error.starts_with(b"data: {\"error\""), "{error:?}");
        let end = poll_fn(|cx| Pin::new(&mut relay).poll_frame(cx)).await;
        assert!(end.is_none());
        drop(relay);
        assert_eq!(count(&shared, "tokenway_stream_errors_total"), 1.0);
    }

    #[tokio::test]
    async fn on_the_messages_api_the_cut_ends_with_an_event_named_error() {
        let (_shared, relay, backend) = relay().await;
        let mut relay = relay.with_error_style(ErrorEventStyle::Anthropic);
        next(&mut relay).await;
        drop(backend);
        let error = next(&mut relay).await;
        assert!(
            error.starts_with(b"event: error\ndata: {\"type\":\"error\""),
            "{error:?}"
        );
    }
}
