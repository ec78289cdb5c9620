//! Metric definitions, latency histograms, the Prometheus text endpoint body, and tracing setup
//! shared by every tokenway role.
//!
//! Every role owns one [`Registry`] built at start-up; the series it exports are defined here so
//! that names and labels stay the same across roles ("names may grow, not drift"). Percentiles
//! come from histograms, never from averages. This crate does no I/O of its own: a role serves
//! [`render`] at `/metrics` over whatever HTTP front it already has.

pub mod datagram;
mod families;
pub mod quic;
pub mod stream_clock;
mod tracing_setup;

pub use families::{
    latency_buckets, BackendLabels, BackendMetrics, LatencyHistogram, RequestLabels,
    RequestMetrics, StreamErrorLabels, StreamLabels,
};
pub use prometheus_client::metrics::{
    counter::Counter,
    family::{Family, MetricConstructor},
    gauge::Gauge,
    histogram::Histogram,
};
pub use prometheus_client::registry::Registry;
pub use tracing_setup::init_tracing;

/// The content type of what [`render`] writes: OpenMetrics text, which is what
/// prometheus-client encodes (counter families declared without `_total`, samples with it, a
/// closing `# EOF`) and what Prometheus asks for first. Served as Prometheus text 0.0.4, the
/// same bytes made 0.0.4 parsers (promtool, Telegraf) see every counter as untyped.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Encodes every series of `registry` in the OpenMetrics text format, ending with `# EOF`.
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // Encoding into a String cannot fail: `fmt::Write` for String is infallible.
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("writing metrics into a String is infallible");
    out
}

/// Why `s` cannot be a metric label value, if it cannot. The encoder writes label values as
/// they are (prometheus-client does not escape them), so a `"`, a `\\` or a line break in
/// one (a backend or model name from a config file) broke the whole `/metrics` page for
/// every scraper. Configs refuse such names instead.
pub fn label_value_problem(s: &str) -> Option<&'static str> {
    if s.contains('"') {
        Some("a double quote")
    } else if s.contains('\\') {
        Some("a backslash")
    } else if s.chars().any(char::is_control) {
        Some("a control character (a line break, a tab)")
    } else {
        None
    }
}

/// A fresh registry with the `tokenway` prefix on every series.
pub fn new_registry() -> Registry {
    Registry::with_prefix("tokenway")
}

#[cfg(test)]
mod label_tests {
    use super::*;

    #[test]
    fn names_that_would_break_the_exposition_are_named() {
        assert_eq!(label_value_problem("gpu-1.eu:8000"), None);
        assert_eq!(label_value_problem("org/model v2"), None);
        assert!(label_value_problem("org/model \"v2\"").is_some());
        assert!(label_value_problem("a\\b").is_some());
        assert!(label_value_problem("a\nb").is_some());
    }
}
