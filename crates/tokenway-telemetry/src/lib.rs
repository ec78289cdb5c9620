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
    counter::Counter, family::Family, gauge::Gauge, histogram::Histogram,
};
pub use prometheus_client::registry::Registry;
pub use tracing_setup::init_tracing;

/// The content type of the Prometheus text exposition format.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Encodes every series of `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::with_capacity(16 * 1024);
    // Encoding into a String cannot fail: `fmt::Write` for String is infallible.
    prometheus_client::encoding::text::encode(&mut out, registry)
        .expect("writing metrics into a String is infallible");
    out
}

/// A fresh registry with the `tokenway` prefix on every series.
pub fn new_registry() -> Registry {
    Registry::with_prefix("tokenway")
}
