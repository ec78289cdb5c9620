//! The response body handed to the local client: the gateway's frames as they arrive, timed
//! for the latency histograms. A failure after the first byte ends an event stream with a final
//! error event (like the gateway's), and aborts any other body.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tokenway_telemetry::stream_clock::StreamClock;
use tokenway_transport::client::{BoxError, ClientBody};

/// See the module docs.
pub struct EdgeBody {
    inner: ClientBody,
    clock: StreamClock,
    finished: bool,
}

impl EdgeBody {
    /// Wraps `inner`, timed by `clock`.
    pub fn new(inner: ClientBody, clock: StreamClock) -> Self {
        Self {
            inner,
            clock,
            finished: false,
        }
    }

    fn finish(&mut self) {
        self.finished = true;
        self.clock.finish();
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
                    self.clock.observe(&d);
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
                if self.clock.sse() {
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
