//! The metric families of the request path and of backends.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Bucket upper bounds (seconds) for latency histograms: 0.25 ms to ~65 s, doubling, so that
/// sub-millisecond proxy overheads and multi-second cold prefills both get resolution.
pub fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.000_25, 2.0, 19)
}

/// Builds histograms with [`latency_buckets`].
#[derive(Clone, Copy, Debug, Default)]
pub struct LatencyHistogram;

impl MetricConstructor<Histogram> for LatencyHistogram {
    fn new_metric(&self) -> Histogram {
        Histogram::new(latency_buckets())
    }
}

/// Labels of `tokenway_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// API route, e.g. `/v1/chat/completions`.
    pub route: String,
    /// Backend name, or `none` when no backend was chosen (rejected before routing).
    pub backend: String,
    /// HTTP status code sent to the client.
    pub status: u16,
}

/// Labels of the latency histograms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamLabels {
    /// API route.
    pub route: String,
    /// Backend name (`self` on a backend measuring itself).
    pub backend: String,
    /// Client-side transport: `h1`, `h2`, `h3`, `tunnel`, `tunnel-tcp`.
    pub transport: String,
    /// The client's region (from a request header, bounded to known regions, else `other`).
    pub client_region: String,
    /// The backend's region.
    pub backend_region: String,
}

/// Labels of the per-backend gauges.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    /// Backend name.
    pub backend: String,
    /// Backend region.
    pub region: String,
}

/// Labels of `tokenway_stream_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StreamErrorLabels {
    /// Backend name.
    pub backend: String,
    /// Backend region.
    pub region: String,
    /// What broke the stream: `backend_error_event` (the backend sent an error event, as vLLM
    /// and SGLang do when generation fails after the 200), `backend_rejected` (such an event
    /// naming the request's fault, a 4xx), `upstream_failed` (its connection failed) or
    /// `upstream_stalled` (it went silent).
    pub cause: &'static str,
}

/// Request counters and latency histograms (every role that serves or proxies requests).
#[derive(Clone)]
pub struct RequestMetrics {
    /// `tokenway_requests_total{route,backend,status}`.
    pub requests: Family<RequestLabels, Counter>,
    /// `tokenway_ttft_seconds`: request start to the first token event.
    pub ttft: Family<StreamLabels, Histogram, LatencyHistogram>,
    /// `tokenway_inter_token_seconds`: gap between consecutive token events of one stream.
    pub inter_token: Family<StreamLabels, Histogram, LatencyHistogram>,
    /// `tokenway_request_duration_seconds`: request start to the last byte.
    pub duration: Family<StreamLabels, Histogram, LatencyHistogram>,
}

impl RequestMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            requests: Family::default(),
            ttft: Family::new_with_constructor(LatencyHistogram),
            inter_token: Family::new_with_constructor(LatencyHistogram),
            duration: Family::new_with_constructor(LatencyHistogram),
        };
        registry.register(
            "requests",
            "Requests answered, by route, backend and status",
            m.requests.clone(),
        );
        registry.register(
            "ttft_seconds",
            "Time from request start to the first token event",
            m.ttft.clone(),
        );
        registry.register(
            "inter_token_seconds",
            "Gap between consecutive token events of a stream",
            m.inter_token.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from request start to the end of the response",
            m.duration.clone(),
        );
        m
    }
}

/// Per-backend gauges.
#[derive(Clone, Default)]
pub struct BackendMetrics {
    /// `tokenway_backend_inflight{backend,region}`.
    pub inflight: Family<BackendLabels, Gauge>,
    /// `tokenway_backend_healthy{backend,region}`: 1 healthy, 0 ejected.
    pub healthy: Family<BackendLabels, Gauge>,
    /// `tokenway_stream_errors_total{backend,region,cause}`: answers that failed after their
    /// first byte had gone to the client (their status was already sent as 200).
    pub stream_errors: Family<StreamErrorLabels, Counter>,
}

impl BackendMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "backend_inflight",
            "Requests in flight to a backend",
            m.inflight.clone(),
        );
        registry.register(
            "backend_healthy",
            "Whether a backend is admitted (1) or ejected (0)",
            m.healthy.clone(),
        );
        registry.register(
            "stream_errors",
            "Answers that failed after their first byte reached the client",
            m.stream_errors.clone(),
        );
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_counter_renders_with_total_suffix_and_labels() {
        let mut reg = crate::new_registry();
        let m = RequestMetrics::register(&mut reg);
        m.requests
            .get_or_create(&RequestLabels {
                route: "/v1/chat/completions".into(),
                backend: "b1".into(),
                status: 200,
            })
            .inc();
        let text = crate::render(&reg);
        assert!(
            text.contains(
                "tokenway_requests_total{route=\"/v1/chat/completions\",backend=\"b1\",status=\"200\"} 1"
            ),
            "{text}"
        );
    }

    #[test]
    fn ttft_histogram_has_sub_millisecond_buckets() {
        let mut reg = crate::new_registry();
        let m = RequestMetrics::register(&mut reg);
        let labels = StreamLabels {
            route: "/v1/completions".into(),
            backend: "b".into(),
            transport: "h1".into(),
            client_region: "eu".into(),
            backend_region: "us".into(),
        };
        m.ttft.get_or_create(&labels).observe(0.0003);
        let text = crate::render(&reg);
        assert!(text.contains("tokenway_ttft_seconds_bucket"), "{text}");
        assert!(text.contains("le=\"0.0005\""), "{text}");
        assert!(text.contains("tokenway_ttft_seconds_count{route=\"/v1/completions\",backend=\"b\",transport=\"h1\",client_region=\"eu\",backend_region=\"us\"} 1"), "{text}");
    }
}
