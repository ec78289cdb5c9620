//! QUIC connection metrics and tunnel dialing counters.
//!
//! The values come from `quinn::Connection::stats()`, sampled periodically by
//! `tokenway_transport::stats`; this module only defines the series so their names stay the same
//! in every role. Per-connection gauges are labelled by the peer (the gateway's configured name),
//! so a reconnect overwrites the same series instead of growing the label set; they are set on
//! the edge only. A gateway's front labels every connection with the front's name (`h3`,
//! `tunnel`), so there only the RTT histogram and the packet counters are written: a gauge
//! shared by many connections would show whichever was sampled last.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::LatencyHistogram;

/// A gauge holding seconds (or any fractional value).
pub type FloatGauge = Gauge<f64, AtomicU64>;

/// Labels of the per-peer series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabels {
    /// The peer's configured name (a gateway name on the edge).
    pub peer: String,
}

/// Labels of `tokenway_quic_0rtt_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ZeroRttLabels {
    /// `accepted` or `rejected`.
    pub result: String,
}

/// Labels of `tokenway_tunnel_connections_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectLabels {
    /// The peer's configured name.
    pub peer: String,
    /// `quic` or `tcp`.
    pub transport: String,
}

/// QUIC and dialing metrics.
#[derive(Clone)]
pub struct QuicMetrics {
    /// `tokenway_quic_rtt_seconds{peer}`: smoothed RTT.
    pub rtt: Family<PeerLabels, FloatGauge>,
    /// `tokenway_quic_min_rtt_seconds{peer}`: minimum RTT seen on the path.
    pub min_rtt: Family<PeerLabels, FloatGauge>,
    /// `tokenway_quic_rtt_variance_seconds{peer}`: mean deviation of the sampled RTT.
    pub rtt_var: Family<PeerLabels, FloatGauge>,
    /// `tokenway_quic_path_mtu_bytes{peer}`: current path MTU.
    pub path_mtu: Family<PeerLabels, Gauge>,
    /// `tokenway_quic_cwnd_bytes{peer}`: congestion window.
    pub cwnd: Family<PeerLabels, Gauge>,
    /// `tokenway_quic_brutal_rate_bytes_per_second{peer}`: the rate brutal gives QUIC on a
    /// tunnel connection (after the repair reserve, and after the peer's advertised receive
    /// rate capped it); 0 while the base controller (cubic, bbr, new_reno) drives it.
    pub brutal_rate: Family<PeerLabels, Gauge>,
    /// `tokenway_quic_sent_packets_total{peer}`: with the lost packets, QUIC's loss rate.
    pub sent_packets: Family<PeerLabels, Counter>,
    /// `tokenway_quic_lost_packets_total{peer}`.
    pub lost_packets: Family<PeerLabels, Counter>,
    /// `tokenway_quic_congestion_events_total{peer}`.
    pub congestion_events: Family<PeerLabels, Counter>,
    /// `tokenway_quic_rtt_samples_seconds{peer}`: distribution of sampled smoothed RTTs (for
    /// percentiles across many connections, e.g. all clients of a gateway front).
    pub rtt_samples: Family<PeerLabels, Histogram, LatencyHistogram>,
    /// `tokenway_quic_0rtt_total{result}`: resumed connections that sent early data, by outcome.
    pub zero_rtt: Family<ZeroRttLabels, Counter>,
    /// `tokenway_tcp_fallback_total{peer}`: dials won by the TCP fallback.
    pub tcp_fallback: Family<PeerLabels, Counter>,
    /// `tokenway_tunnel_dead_paths_total{peer}`: QUIC connections closed because their path
    /// went silent (sent datagrams unanswered), long before the idle timeout would have.
    pub dead_paths: Family<PeerLabels, Counter>,
    /// `tokenway_tunnel_connections_total{peer,transport}`: connections established.
    pub connections: Family<ConnectLabels, Counter>,
    /// The tunnel's datagram layer (FEC, obfuscation), registered with the QUIC series so
    /// that every role exporting QUIC metrics exports these too.
    pub datagram: crate::datagram::DatagramMetrics,
}

impl QuicMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            rtt: Family::default(),
            min_rtt: Family::default(),
            rtt_var: Family::default(),
            rtt_samples: Family::new_with_constructor(LatencyHistogram),
            path_mtu: Family::default(),
            cwnd: Family::default(),
            brutal_rate: Family::default(),
            sent_packets: Family::default(),
            lost_packets: Family::default(),
            congestion_events: Family::default(),
            zero_rtt: Family::default(),
            tcp_fallback: Family::default(),
            dead_paths: Family::default(),
            connections: Family::default(),
            datagram: crate::datagram::DatagramMetrics::register(registry),
        };
        registry.register("quic_rtt_seconds", "Smoothed QUIC RTT", m.rtt.clone());
        registry.register(
            "quic_min_rtt_seconds",
            "Minimum QUIC RTT seen on the path",
            m.min_rtt.clone(),
        );
        registry.register(
            "quic_rtt_variance_seconds",
            "Mean deviation of the sampled QUIC RTT",
            m.rtt_var.clone(),
        );
        registry.register(
            "quic_rtt_samples_seconds",
            "Sampled smoothed QUIC RTTs, one per connection per sampling interval",
            m.rtt_samples.clone(),
        );
        registry.register(
            "quic_path_mtu_bytes",
            "Current QUIC path MTU",
            m.path_mtu.clone(),
        );
        registry.register("quic_cwnd_bytes", "QUIC congestion window", m.cwnd.clone());
        registry.register(
            "quic_brutal_rate_bytes_per_second",
            "Rate brutal gives QUIC on a tunnel connection (0: the base controller drives it)",
            m.brutal_rate.clone(),
        );
        registry.register(
            "quic_sent_packets",
            "QUIC packets sent",
            m.sent_packets.clone(),
        );
        registry.register(
            "quic_lost_packets",
            "QUIC packets declared lost",
            m.lost_packets.clone(),
        );
        registry.register(
            "quic_congestion_events",
            "QUIC congestion events",
            m.congestion_events.clone(),
        );
        registry.register(
            "quic_0rtt",
            "Resumed QUIC connections that sent 0-RTT early data, by whether the server accepted it",
            m.zero_rtt.clone(),
        );
        registry.register(
            "tcp_fallback",
            "Dials where HTTP/2 over TCP won the race against QUIC",
            m.tcp_fallback.clone(),
        );
        registry.register(
            "tunnel_dead_paths",
            "QUIC connections closed because their path went silent",
            m.dead_paths.clone(),
        );
        registry.register(
            "tunnel_connections",
            "Tunnel connections established, by transport",
            m.connections.clone(),
        );
        m
    }

    /// Counts one 0-RTT outcome.
    pub fn zero_rtt_result(&self, accepted: bool) {
        let result = if accepted { "accepted" } else { "rejected" };
        self.zero_rtt
            .get_or_create(&ZeroRttLabels {
                result: result.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_and_zero_rtt_counters_render_with_their_names() {
        let mut reg = crate::new_registry();
        let m = QuicMetrics::register(&mut reg);
        m.tcp_fallback
            .get_or_create(&PeerLabels { peer: "gw".into() })
            .inc();
        m.zero_rtt_result(true);
        m.rtt
            .get_or_create(&PeerLabels { peer: "gw".into() })
            .set(0.012);
        let text = crate::render(&reg);
        assert!(
            text.contains("tokenway_tcp_fallback_total{peer=\"gw\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tokenway_quic_0rtt_total{result=\"accepted\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("tokenway_quic_rtt_seconds{peer=\"gw\"} 0.012"),
            "{text}"
        );
    }
}
