//! The edge's metrics: request counters and latency histograms (`transport` label `tunnel` or
//! `tunnel-tcp`), and the QUIC and fallback series. Served at `/metrics` on the local endpoint.

use prometheus_client::encoding::EncodeLabelSet;
use tokenway_telemetry::quic::QuicMetrics;
use tokenway_telemetry::{Counter, Family, Registry, RequestMetrics};

/// Every series the edge exports.
pub struct EdgeMetrics {
    /// The registry rendered at `/metrics`.
    pub registry: Registry,
    /// Requests and their latencies.
    pub requests: RequestMetrics,
    /// QUIC connection statistics, 0-RTT and fallback counters.
    pub quic: QuicMetrics,
    /// `tokenway_edge_rebinds_total{reason}`: QUIC endpoint moves to a fresh socket, because
    /// the local address towards a gateway changed (`address_change`) or on `/admin/rebind`
    /// (`admin`).
    pub rebinds: Family<ReasonLabels, Counter>,
}

/// The `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Why it happened.
    pub reason: &'static str,
}

impl EdgeMetrics {
    /// The rebind counter for `reason`.
    pub fn rebinds(&self, reason: &'static str) -> Counter {
        self.rebinds.get_or_create(&ReasonLabels { reason }).clone()
    }
}

impl EdgeMetrics {
    /// Registers every family.
    pub fn new() -> Self {
        let mut registry = tokenway_telemetry::new_registry();
        let requests = RequestMetrics::register(&mut registry);
        let quic = QuicMetrics::register(&mut registry);
        let rebinds = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "edge_rebinds",
            "QUIC endpoint rebinds (connections migrate), by reason",
            rebinds.clone(),
        );
        Self {
            registry,
            requests,
            quic,
            rebinds,
        }
    }
}

impl Default for EdgeMetrics {
    fn default() -> Self {
        Self::new()
    }
}
