//! The response body handed to the local client: the gateway's frames as they arrive, timed
//! for the latency histograms. A failure after the first byte ends an event stream with a final
//! error event (like the gateway's), and aborts any other body.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokenway_telemetry::Histogram;
use tokenway_transport::client::{BoxError, ClientBody};
use tokenway_wire::sse::SseScanner;

/// Histograms one response is timed into.
pub struct Timing {
    /// Time to first token.
    pub ttft: Histogram,
    /// Gap between token events.
    pub gap: Histogram,
    /// Whole duration.
    pub duration: Histogram,
    /// When the local request arrived.
    pub start: Instant,
}

/// See the module docs.
pub struct EdgeBody {
    inner: ClientBody,
    scanner: Option<SseScanner>,
    timing: Timing,
    last_event: Option<Instant>,
    finished: bool,
}

impl EdgeBody {
    /// Wraps `inner`; `sse` when the response is an event stream.
    pub fn new(inner: ClientBody, sse: bool, timing: Timing) -> Self {
        Self {
            inner,
            scanner: sse.then(SseScanner::new),
            timing,
            last_event: None,
            finished: false,
        }
    }

    fn observe(&mut self, data: &Bytes) {
        if data.is_empty() {
            return;
        }
        let tokens = match self.scanner.as_mut() {
            Some(s) => {
                let r = s.feed(data);
                r.events.saturating_sub(u32::from(r.done))
            }
            None => u32::from(self.last_event.is_none()),
        };
        if tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_event {
            None => self
                .timing
                .ttft
                .observe((now - self.timing.start).as_secs_f64()),
            Some(prev) => self.timing.gap.observe((now - prev).as_secs_f64()),
        }
        self.last_event = Some(now);
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.timing
                .duration
                .observe(self.timing.start.elapsed().as_secs_f64());
        }
    }
}

impl Body for EdgeBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    let d = d.clone();
                    self.observe(&d);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                self.finish();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                self.finish();
                tracing::warn!(error = %e, "tunnel stream failed after the first byte");
                if self.scanner.is_some() {
                    let event = tokenway_wire::sse::error_event(
                        &format!(
                            "the tunnel to the gateway failed in the middle of the response: {e}"
                        ),
                        "tunnel_error",
                    );
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
                } else {
                    Poll::Ready(Some(Err(e)))
                }
            }
        }
    }
}
