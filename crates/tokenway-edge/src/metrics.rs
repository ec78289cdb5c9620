//! The edge's metrics: request counters and latency histograms (`transport` label `tunnel` or
//! `tunnel-tcp`), and the QUIC and fallback series. Served at `/metrics` on the local endpoint.

use tokenway_telemetry::quic::QuicMetrics;
use tokenway_telemetry::{Registry, RequestMetrics};

/// Every series the edge exports.
pub struct EdgeMetrics {
    /// The registry rendered at `/metrics`.
    pub registry: Registry,
    /// Requests and their latencies.
    pub requests: RequestMetrics,
    /// QUIC connection statistics, 0-RTT and fallback counters.
    pub quic: QuicMetrics,
}

impl EdgeMetrics {
    /// Registers every family.
    pub fn new() -> Self {
        let mut registry = tokenway_telemetry::new_registry();
        let requests = RequestMetrics::register(&mut registry);
        let quic = QuicMetrics::register(&mut registry);
        Self {
            registry,
            requests,
            quic,
        }
    }
}

impl Default for EdgeMetrics {
    fn default() -> Self {
        Self::new()
    }
}
