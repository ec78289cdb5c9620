//! The response body handed to the local client: the gateway's frames as they arrive, timed
//! for the latency histograms. A failure after the first byte ends an event stream with a final
//! error event (like the gateway's), and aborts any other body.
//!
//! The gateway sends whole events, but QUIC and HTTP/2 deliver a DATA frame in pieces as they
//! arrive, so the last piece passed on before a failure can end inside an event: an error
//! event appended there would join it, and the client would read one event of broken JSON
//! instead of an error. So in an event stream the start of an event whose end (a blank line)
//! has not arrived is held back (up to [`MAX_PARTIAL_EVENT`]); the client could not use it
//! before its end anyway.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};
use tokenway_telemetry::stream_clock::StreamClock;
use tokenway_transport::client::{BoxError, ClientBody};
use tokenway_wire::sse::ErrorEventStyle;
use tokenway_wire::sse_hold::EventHoldBack;

/// See the module docs.
pub struct EdgeBody {
    inner: ClientBody,
    clock: StreamClock,
    finished: bool,
    /// Of an event stream, the start of an event whose end has not arrived yet.
    held: EventHoldBack,
    /// The shape of the edge's own error event (the route's API).
    error_style: ErrorEventStyle,
}

impl EdgeBody {
    /// Wraps `inner`, timed by `clock`.
    pub fn new(inner: ClientBody, clock: StreamClock) -> Self {
        Self {
            inner,
            clock,
            finished: false,
            held: EventHoldBack::default(),
            error_style: ErrorEventStyle::OpenAi,
        }
    }

    /// Shapes the edge's own error event as the route's API does.
    pub fn with_error_style(mut self, style: ErrorEventStyle) -> Self {
        self.error_style = style;
        self
    }

    fn finish(&mut self) {
        self.finished = true;
        self.clock.finish();
    }
}

impl Drop for EdgeBody {
    /// A client that leaves mid-answer still counts in the duration histogram (it recorded
    /// only answers read to their end), as the gateway's bodies do.
    fn drop(&mut self) {
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
        loop {
            return match Pin::new(&mut self.inner).poll_frame(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(d) if self.clock.sse() => match self.held.whole_events(d) {
                            Some(d) => Frame::data(d),
                            None => continue,
                        },
                        Ok(d) => Frame::data(d),
                        Err(other) => other,
                    };
                    if let Some(d) = frame.data_ref() {
                        let d = d.clone();
                        self.clock.observe(&d);
                    }
                    Poll::Ready(Some(Ok(frame)))
                }
                Poll::Ready(None) => {
                    self.finish();
                    // The stream ended inside an event: passed on as it is.
                    match self.held.take() {
                        Some(rest) => Poll::Ready(Some(Ok(Frame::data(rest)))),
                        None => Poll::Ready(None),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    self.finish();
                    // The unfinished event will never be finished: the error event takes its
                    // place.
                    let lead = self.held.discard();
                    tracing::warn!(error = %e, "tunnel stream failed after the first byte");
                    if self.clock.sse() {
                        let event = self.error_style.event(
                            &format!(
                                "the tunnel to the gateway failed in the middle of the response: {e}"
                            ),
                            "tunnel_error",
                        );
                        let event = [lead.as_bytes(), &event].concat();
                        Poll::Ready(Some(Ok(Frame::data(Bytes::from(event)))))
                    } else {
                        Poll::Ready(Some(Err(e)))
                    }
                }
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    fn body_of(pieces: Vec<Result<&'static str, &'static str>>, sse: bool) -> EdgeBody {
        let frames = pieces.into_iter().map(|p| match p {
            Ok(s) => Ok(Frame::data(Bytes::from_static(s.as_bytes()))),
            Err(e) => Err(BoxError::from(e)),
        });
        let inner = StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync();
        let metrics = crate::metrics::EdgeMetrics::new();
        let histograms =
            metrics.stream_histograms("/v1/chat/completions", &Arc::from("gw"), "tunnel");
        EdgeBody::new(
            inner,
            StreamClock::new(histograms, std::time::Instant::now(), sse),
        )
    }

    /// Every frame the body gives, as text, and whether it ended with an error.
    async fn drain(mut b: EdgeBody) -> (Vec<String>, bool) {
        let mut out = Vec::new();
        while let Some(f) = b.frame().await {
            match f {
                Ok(f) => out.push(String::from_utf8_lossy(f.data_ref().expect("data")).into()),
                Err(_) => return (out, true),
            }
        }
        (out, false)
    }

    #[tokio::test]
    async fn a_failure_inside_an_event_ends_with_an_error_event_of_its_own() {
        let (frames, errored) = drain(body_of(
            vec![
                Ok("data: {\"a\":1}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"He"),
                Err("connection lost"),
            ],
            true,
        ))
        .await;
        assert!(!errored);
        // The whole event went out at once; the half event never did.
        assert_eq!(frames[0], "data: {\"a\":1}\n\n");
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert!(frames[1].starts_with("data: {\"error\""), "{frames:?}");
        let all: String = frames.concat();
        assert!(!all.contains("\"He"), "{all}");
    }

    #[tokio::test]
    async fn an_event_split_across_frames_is_passed_on_whole_and_a_tail_at_the_end_as_it_is() {
        let (frames, errored) = drain(body_of(
            vec![
                Ok("data: {\"x\""),
                Ok(":2}\n"),
                Ok("\ndata: [DONE]\n\n"),
                Ok("data: tail"),
            ],
            true,
        ))
        .await;
        assert!(!errored);
        // The event's end arrived with the next one: both go out together.
        assert_eq!(
            frames,
            ["data: {\"x\":2}\n\ndata: [DONE]\n\n", "data: tail"]
        );
        // Not an event stream: frames as they come, and a failure is the body's error.
        let (frames, errored) = drain(body_of(vec![Ok("{\"a\""), Err("lost")], false)).await;
        assert_eq!(frames, ["{\"a\""]);
        assert!(errored);
    }

    #[tokio::test]
    async fn an_answer_its_client_leaves_still_counts_in_the_durations() {
        let metrics = crate::metrics::EdgeMetrics::new();
        let histograms =
            metrics.stream_histograms("/v1/chat/completions", &Arc::from("gw"), "tunnel");
        let frames = [Ok::<_, BoxError>(Frame::data(Bytes::from_static(
            b"data: 1\n\n",
        )))];
        let inner = StreamBody::new(futures_util::StreamExt::chain(
            futures_util::stream::iter(frames),
            futures_util::stream::pending(),
        ))
        .boxed_unsync();
        let mut b = EdgeBody::new(
            inner,
            StreamClock::new(histograms, std::time::Instant::now(), true),
        );
        b.frame().await.expect("a frame").expect("data");
        drop(b);
        let text = tokenway_telemetry::render(&metrics.registry);
        let count = text
            .lines()
            .find(|l| l.starts_with("tokenway_request_duration_seconds_count"))
            .unwrap_or_default()
            .to_string();
        assert!(count.ends_with(" 1"), "{count}\n{text}");
    }
}
