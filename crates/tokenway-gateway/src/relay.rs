//! Streams a backend's response body to the client, frame by frame, as it arrives.
//!
//! A pump task owns the upstream body and a bounded channel to the client's body. Every frame is
//! handed on the moment it arrives (no coalescing, no buffering beyond the channel's few slots),
//! and the pump measures SSE events on the way: time to first token and inter-token gaps. The task
//! exists, rather than a body adapter, because it must keep watching when the client stops
//! reading: a stalled client (its window or socket full for `client_write` time) or a stalled
//! backend (silent for `stream_idle` time) ends the stream instead of pinning a backend slot.
//!
//! After the first byte has reached the client nothing can be retried. An upstream failure in an
//! event stream then becomes a final SSE error event and a clean end; in any other body it becomes
//! a body error so that the client sees a truncated response, never a silently short one.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokenway_router::Outcome;
use tokenway_telemetry::{Histogram, StreamLabels};
use tokenway_wire::sse::SseScanner;
use tokio::sync::mpsc;

use crate::error::BoxError;
use crate::state::Attempt;

/// Frames queued between the pump and the client connection.
const CHANNEL_FRAMES: usize = 16;

/// How a relay ends when things go wrong.
pub struct RelayLimits {
    /// Longest upstream silence inside a response.
    pub stream_idle: Duration,
    /// Longest time the client may leave a frame unread.
    pub client_write: Duration,
}

/// What the pump measures.
pub struct Meter {
    /// Labels of the latency histograms.
    pub labels: StreamLabels,
    /// When the client's request arrived.
    pub start: Instant,
    /// Whether the body is an event stream.
    pub sse: bool,
}

/// The client-facing half: a body fed by the pump.
pub struct RelayBody {
    rx: mpsc::Receiver<Frame<Bytes>>,
    aborted: Arc<AtomicBool>,
}

impl Body for RelayBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(frame)) => Poll::Ready(Some(Ok(frame))),
            Poll::Ready(None) if self.aborted.load(Ordering::Acquire) => Poll::Ready(Some(Err(
                "upstream response failed after the first byte".into(),
            ))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

/// Starts relaying `upstream` (whose first frame, already read while the attempt could still be
/// retried, is `first`) and returns the client's body.
pub fn start(
    first: Option<Frame<Bytes>>,
    upstream: Incoming,
    attempt: Attempt,
    meter: Meter,
    limits: RelayLimits,
) -> RelayBody {
    let (tx, rx) = mpsc::channel(CHANNEL_FRAMES);
    let aborted = Arc::new(AtomicBool::new(false));
    tokio::spawn(pump(
        first,
        upstream,
        attempt,
        meter,
        limits,
        tx,
        aborted.clone(),
    ));
    RelayBody { rx, aborted }
}

enum End {
    Complete,
    UpstreamFailed(String),
    UpstreamStalled,
    ClientGone,
    ClientStalled,
}

async fn pump(
    first: Option<Frame<Bytes>>,
    mut upstream: Incoming,
    mut attempt: Attempt,
    meter: Meter,
    limits: RelayLimits,
    tx: mpsc::Sender<Frame<Bytes>>,
    aborted: Arc<AtomicBool>,
) {
    let mut events = EventClock::new(&meter, &attempt);
    let mut pending = first;
    let end = loop {
        let frame = match pending.take() {
            Some(f) => f,
            None => {
                let next = tokio::select! {
                    biased;
                    _ = tx.closed() => break End::ClientGone,
                    r = tokio::time::timeout(limits.stream_idle, upstream.frame()) => r,
                };
                match next {
                    Err(_) => break End::UpstreamStalled,
                    Ok(None) => break End::Complete,
                    Ok(Some(Err(e))) => break End::UpstreamFailed(e.to_string()),
                    Ok(Some(Ok(f))) => f,
                }
            }
        };
        if let Some(data) = frame.data_ref() {
            events.observe(data);
        }
        match tx.send_timeout(frame, limits.client_write).await {
            Ok(()) => {}
            Err(mpsc::error::SendTimeoutError::Closed(_)) => break End::ClientGone,
            Err(mpsc::error::SendTimeoutError::Timeout(_)) => break End::ClientStalled,
        }
    };
    let backend = attempt.shared().upstream(attempt.backend()).name.clone();
    match end {
        End::Complete => attempt.finish(Outcome::Success),
        End::ClientGone => attempt.finish(Outcome::ClientCancelled),
        End::ClientStalled => {
            tracing::info!(%backend, "client stopped reading; stream closed");
            attempt.finish(Outcome::ClientCancelled);
            aborted.store(true, Ordering::Release);
        }
        End::UpstreamFailed(_) | End::UpstreamStalled if meter.sse => {
            let (outcome, message) = describe(&end, &backend);
            tracing::warn!(%backend, %message, "stream ended by an upstream failure after the first byte");
            attempt.finish(outcome);
            let event = tokenway_wire::sse::error_event(&message, "upstream_error");
            // The client is still reading; if it is not, nothing is lost by dropping the event.
            let _ = tx
                .send_timeout(Frame::data(Bytes::from(event)), limits.client_write)
                .await;
        }
        End::UpstreamFailed(_) | End::UpstreamStalled => {
            let (outcome, message) = describe(&end, &backend);
            tracing::warn!(%backend, %message, "response truncated by an upstream failure after the first byte");
            attempt.finish(outcome);
            aborted.store(true, Ordering::Release);
        }
    }
    events.finish();
}

fn describe(end: &End, backend: &str) -> (Outcome, String) {
    match end {
        End::UpstreamStalled => (
            Outcome::Timeout,
            format!("backend {backend} stopped sending in the middle of the response"),
        ),
        End::UpstreamFailed(why) => (
            Outcome::ServerError,
            format!("backend {backend} failed in the middle of the response: {why}"),
        ),
        _ => (Outcome::ClientCancelled, String::new()),
    }
}

/// Event timing of one response, recorded into the latency histograms as frames pass.
struct EventClock {
    scanner: Option<SseScanner>,
    start: Instant,
    last_event: Option<Instant>,
    ttft: Histogram,
    gap: Histogram,
    duration: Histogram,
}

impl EventClock {
    fn new(meter: &Meter, attempt: &Attempt) -> Self {
        let m = &attempt.shared().metrics;
        Self {
            scanner: meter.sse.then(SseScanner::new),
            start: meter.start,
            last_event: None,
            ttft: m.ttft.get_or_create(&meter.labels).clone(),
            gap: m.inter_token.get_or_create(&meter.labels).clone(),
            duration: m.duration.get_or_create(&meter.labels).clone(),
        }
    }

    /// Notes a data frame. In an event stream a token is a data event other than `[DONE]`;
    /// otherwise the first byte stands for the first token.
    fn observe(&mut self, data: &Bytes) {
        if data.is_empty() {
            return;
        }
        let now = Instant::now();
        let tokens = match self.scanner.as_mut() {
            Some(scanner) => {
                let r = scanner.feed(data);
                r.events.saturating_sub(u32::from(r.done))
            }
            None => u32::from(self.last_event.is_none()),
        };
        if tokens == 0 {
            return;
        }
        match self.last_event {
            None => self.ttft.observe((now - self.start).as_secs_f64()),
            // Events that arrive in one chunk arrived together: one gap per chunk.
            Some(prev) => self.gap.observe((now - prev).as_secs_f64()),
        }
        self.last_event = Some(now);
    }

    fn finish(self) {
        self.duration.observe(self.start.elapsed().as_secs_f64());
    }
}
