//! Timing of one streamed response as its bytes pass a proxy: time to first token, inter-token
//! gaps and total duration, recorded into the request histograms.
//!
//! In an event stream a token is an SSE data event other than `[DONE]`; otherwise the first
//! byte stands for the first token. Events that arrive in one chunk arrived together: they give
//! one gap, not several zero gaps.

use std::time::Instant;

use prometheus_client::metrics::histogram::Histogram;
use tokenway_wire::sse::SseScanner;

/// The three histograms one response feeds.
#[derive(Clone)]
pub struct StreamHistograms {
    /// `tokenway_ttft_seconds` of this response's labels.
    pub ttft: Histogram,
    /// `tokenway_inter_token_seconds`.
    pub gap: Histogram,
    /// `tokenway_request_duration_seconds`.
    pub duration: Histogram,
}

/// See the module docs.
pub struct StreamClock {
    histograms: StreamHistograms,
    start: Instant,
    scanner: Option<SseScanner>,
    last_event: Option<Instant>,
    finished: bool,
    /// False for an error answer: it has no tokens, only a duration.
    tokens: bool,
}

impl StreamClock {
    /// Starts timing a response to a request that arrived at `start`; `sse` when the response
    /// is an event stream.
    pub fn new(histograms: StreamHistograms, start: Instant, sse: bool) -> Self {
        Self {
            histograms,
            start,
            scanner: sse.then(SseScanner::new),
            last_event: None,
            finished: false,
            tokens: true,
        }
    }

    /// Times an error answer (a 4xx or 5xx from the backend): its bytes are not tokens, so
    /// they feed neither the time-to-first-token nor the gap histogram; the duration still
    /// counts.
    pub fn error_answer(mut self) -> Self {
        self.tokens = false;
        self
    }

    /// Whether the response is an event stream.
    pub fn sse(&self) -> bool {
        self.scanner.is_some()
    }

    /// Notes body bytes as they are passed on.
    pub fn observe(&mut self, data: &[u8]) {
        self.observe_at(data, Instant::now());
    }

    /// Notes body bytes that were passed on at `now` (a proxy may scan them after sending).
    pub fn observe_at(&mut self, data: &[u8], now: Instant) {
        if data.is_empty() || !self.tokens {
            return;
        }
        let tokens = match self.scanner.as_mut() {
            Some(scanner) => scanner.feed_tokens(data),
            None => self.last_event.is_none(),
        };
        if !tokens {
            return;
        }
        match self.last_event {
            None => self
                .histograms
                .ttft
                .observe((now - self.start).as_secs_f64()),
            Some(prev) => self.histograms.gap.observe((now - prev).as_secs_f64()),
        }
        self.last_event = Some(now);
    }

    /// Records the duration (once).
    pub fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.histograms
                .duration
                .observe(self.start.elapsed().as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histograms() -> StreamHistograms {
        let h = || Histogram::new(crate::latency_buckets());
        StreamHistograms {
            ttft: h(),
            gap: h(),
            duration: h(),
        }
    }

    fn count(h: &Histogram) -> u64 {
        let mut text = String::new();
        let mut reg = prometheus_client::registry::Registry::default();
        reg.register("h", "h", h.clone());
        prometheus_client::encoding::text::encode(&mut text, &reg).expect("encode");
        text.lines()
            .find_map(|l| l.strip_prefix("h_count "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    #[test]
    fn events_in_one_chunk_give_one_gap_and_done_is_not_a_token() {
        let h = histograms();
        let mut clock = StreamClock::new(h.clone(), Instant::now(), true);
        clock.observe(b"data: {\"a\":1}\n\n");
        clock.observe(b"data: {\"a\":2}\n\ndata: {\"a\":3}\n\n");
        clock.observe(b"data: [DONE]\n\n");
        clock.finish();
        clock.finish();
        assert_eq!(count(&h.ttft), 1);
        assert_eq!(count(&h.gap), 1);
        assert_eq!(count(&h.duration), 1);
    }

    #[test]
    fn an_error_answer_has_a_duration_but_no_tokens() {
        let h = histograms();
        let mut clock = StreamClock::new(h.clone(), Instant::now(), false).error_answer();
        clock.observe(br#"{"error":{"message":"max_tokens must be at least 1"}}"#);
        clock.finish();
        assert_eq!(count(&h.ttft), 0);
        assert_eq!(count(&h.gap), 0);
        assert_eq!(count(&h.duration), 1);
    }
}
