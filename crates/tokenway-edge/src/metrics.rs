//! The edge's metrics: request counters and latency histograms (`transport` label `tunnel` or
//! `tunnel-tcp`), and the QUIC and fallback series. Served at `/metrics` on the local endpoint.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use tokenway_telemetry::quic::QuicMetrics;
use tokenway_telemetry::stream_clock::StreamHistograms;
use tokenway_telemetry::{Counter, Family, Registry, RequestLabels, RequestMetrics, StreamLabels};

/// Route, gateway and transport of a request's latency histograms.
type StreamKey = (&'static str, Arc<str>, &'static str);
/// Route, gateway and status of a request counter.
type CounterKey = (&'static str, Arc<str>, u16);

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
    /// The histograms of each (route, gateway, transport) seen, so that a request finds its
    /// three series without building five label strings and hashing them three times. Bounded:
    /// routes are a fixed list, gateways and transports come from the configuration.
    stream: Mutex<HashMap<StreamKey, StreamHistograms>>,
    /// The request counter of each (route, gateway, status) seen; bounded like `stream` (status
    /// codes are three digits).
    counters: Mutex<HashMap<CounterKey, Counter>>,
}

/// The `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Why it happened.
    pub reason: &'static str,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl EdgeMetrics {
    /// The latency histograms of requests on `route` answered by `gateway` over `transport`.
    pub fn stream_histograms(
        &self,
        route: &'static str,
        gateway: &Arc<str>,
        transport: &'static str,
    ) -> StreamHistograms {
        let key = (route, gateway.clone(), transport);
        if let Some(h) = lock(&self.stream).get(&key) {
            return h.clone();
        }
        let labels = StreamLabels {
            route: route.to_string(),
            backend: gateway.to_string(),
            transport: transport.to_string(),
            client_region: "local".to_string(),
            backend_region: "local".to_string(),
        };
        let m = &self.requests;
        let h = StreamHistograms {
            ttft: m.ttft.get_or_create(&labels).clone(),
            gap: m.inter_token.get_or_create(&labels).clone(),
            duration: m.duration.get_or_create(&labels).clone(),
        };
        lock(&self.stream).insert(key, h.clone());
        h
    }

    /// The request counter of `route`, `gateway` (`none` before any) and `status`.
    pub fn requests_counter(
        &self,
        route: &'static str,
        gateway: &Arc<str>,
        status: u16,
    ) -> Counter {
        let key = (route, gateway.clone(), status);
        if let Some(c) = lock(&self.counters).get(&key) {
            return c.clone();
        }
        let c = self
            .requests
            .requests
            .get_or_create(&RequestLabels {
                route: route.to_string(),
                backend: gateway.to_string(),
                status,
            })
            .clone();
        lock(&self.counters).insert(key, c.clone());
        c
    }

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
            stream: Mutex::default(),
            counters: Mutex::default(),
        }
    }
}

impl Default for EdgeMetrics {
    fn default() -> Self {
        Self::new()
    }
}
