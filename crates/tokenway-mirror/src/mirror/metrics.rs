//! The mirror's Prometheus series (served at `/metrics`, prefix `tokenway_`).
//!
//! Counters get the `_total` suffix in the text format, e.g.
//! `tokenway_mirror_bytes_from_origin_total`.

use tokenway_telemetry::{new_registry, render, Counter, Gauge, Registry};

/// Every series of one mirror.
#[derive(Clone, Default)]
pub struct MirrorMetrics {
    /// Verified piece bytes fetched from the origin.
    pub bytes_from_origin: Counter,
    /// Piece bytes read from the disk cache to answer requests.
    pub bytes_from_cache: Counter,
    /// Bytes pullers report they got from peers instead of this mirror.
    pub bytes_from_peers: Counter,
    /// Body bytes sent to clients (blob ranges).
    pub bytes_served: Counter,
    /// Outboard bytes sent to clients.
    pub outboard_bytes_served: Counter,
    /// Verified outboard bytes fetched from the origin.
    pub outboard_bytes_from_origin: Counter,
    /// Piece requests answered from the cache.
    pub cache_hits: Counter,
    /// Piece requests not in the cache (joined or started an origin fetch).
    pub cache_misses: Counter,
    /// Pieces evicted from the cache.
    pub cache_evictions: Counter,
    /// Requests that waited on another request's origin fetch (single flight).
    pub single_flight_joins: Counter,
    /// Ranged GETs sent to the origin.
    pub origin_fetches: Counter,
    /// Origin requests that failed (unreachable, error status).
    pub origin_errors: Counter,
    /// Origin pieces that failed verification.
    pub origin_corrupt: Counter,
    /// Cached pieces that failed verification when read (dropped and fetched again).
    pub cache_corrupt: Counter,
    /// Pieces served with a deliberate fault (test flag).
    pub faults_injected: Counter,
    /// Bytes in the cache (including writes in progress).
    pub cache_bytes: Gauge,
    /// The cache bound.
    pub cache_max_bytes: Gauge,
    /// Peers registered and not expired.
    pub peers: Gauge,
    /// Piece bytes held in memory for responses (bounded, see `serve_budget`).
    pub serving_bytes: Gauge,
}

impl MirrorMetrics {
    /// Registers every series in a fresh registry.
    pub fn register() -> (Self, Registry) {
        let m = Self::default();
        let mut r = new_registry();
        let counters: [(&str, &str, &Counter); 15] = [
            (
                "mirror_bytes_from_origin",
                "Verified piece bytes fetched from the origin",
                &m.bytes_from_origin,
            ),
            (
                "mirror_bytes_from_cache",
                "Piece bytes read from the disk cache to answer requests",
                &m.bytes_from_cache,
            ),
            (
                "mirror_bytes_from_peers",
                "Bytes pullers report they got from peers",
                &m.bytes_from_peers,
            ),
            (
                "mirror_bytes_served",
                "Blob body bytes sent to clients",
                &m.bytes_served,
            ),
            (
                "mirror_outboard_bytes_served",
                "Outboard bytes sent to clients",
                &m.outboard_bytes_served,
            ),
            (
                "mirror_outboard_bytes_from_origin",
                "Verified outboard bytes fetched from the origin",
                &m.outboard_bytes_from_origin,
            ),
            (
                "mirror_cache_hits",
                "Piece requests answered from the cache",
                &m.cache_hits,
            ),
            (
                "mirror_cache_misses",
                "Piece requests not in the cache",
                &m.cache_misses,
            ),
            (
                "mirror_cache_evictions",
                "Pieces evicted from the cache",
                &m.cache_evictions,
            ),
            (
                "mirror_single_flight_joins",
                "Requests that waited on another request's origin fetch",
                &m.single_flight_joins,
            ),
            (
                "mirror_origin_fetches",
                "Ranged GETs sent to the origin",
                &m.origin_fetches,
            ),
            (
                "mirror_origin_errors",
                "Origin requests that failed",
                &m.origin_errors,
            ),
            (
                "mirror_origin_corrupt",
                "Origin pieces that failed verification",
                &m.origin_corrupt,
            ),
            (
                "mirror_cache_corrupt",
                "Cached pieces that failed verification when read, dropped and fetched again",
                &m.cache_corrupt,
            ),
            (
                "mirror_faults_injected",
                "Pieces served corrupted on purpose (test flag)",
                &m.faults_injected,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "mirror_cache_bytes",
            "Bytes in the disk cache",
            m.cache_bytes.clone(),
        );
        r.register(
            "mirror_cache_max_bytes",
            "Bound of the disk cache",
            m.cache_max_bytes.clone(),
        );
        r.register("mirror_peers", "Peers registered", m.peers.clone());
        r.register(
            "mirror_serving_bytes",
            "Piece bytes held in memory for responses (bounded)",
            m.serving_bytes.clone(),
        );
        (m, r)
    }

    /// The Prometheus text.
    pub fn render(registry: &Registry) -> String {
        render(registry)
    }
}
