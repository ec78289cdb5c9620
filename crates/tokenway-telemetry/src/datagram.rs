//! Metrics of the tunnel's datagram layer (FEC and obfuscation below QUIC).
//!
//! The socket adapter in `tokenway_transport::datagram` keeps cumulative counters per peer;
//! once a second it adds what changed to these families. Series are labelled by `side`
//! (`server` on the gateway's tunnel port, `client` on the edge), never by peer address, so the
//! label set stays bounded however many edges connect.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of the per-side series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SideLabels {
    /// `server` (gateway tunnel port) or `client` (edge).
    pub side: String,
}

/// Labels of `tokenway_datagram_dropped_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabels {
    /// `server` or `client`.
    pub side: String,
    /// Why: `truncated`, `unknown_version`, `unknown_type`, `malformed`, `duplicate`,
    /// `late_repair`, `stale`, `stranger` (from an address with no QUIC connection and not a
    /// valid layer packet: a prober without the key), `send_failed`.
    pub reason: String,
}

/// Upper bounds of the loss-burst buckets (packets), as the wire crate counts them.
pub const BURST_BUCKETS: [f64; 7] = [1.0, 2.0, 3.0, 4.0, 8.0, 16.0, 32.0];

/// Constructs loss-burst histograms.
#[derive(Clone, Copy, Debug, Default)]
pub struct BurstHistogram;

impl MetricConstructor<Histogram> for BurstHistogram {
    fn new_metric(&self) -> Histogram {
        Histogram::new(BURST_BUCKETS)
    }
}

/// The datagram layer's series.
#[derive(Clone)]
pub struct DatagramMetrics {
    /// `tokenway_datagram_source_packets_total{side}`: QUIC datagrams sent as FEC source packets.
    pub source_packets: Family<SideLabels, Counter>,
    /// `tokenway_datagram_plain_packets_total{side}`: QUIC datagrams sent outside FEC.
    pub plain_packets: Family<SideLabels, Counter>,
    /// `tokenway_datagram_repair_packets_total{side}`: FEC repair packets sent.
    pub repair_packets: Family<SideLabels, Counter>,
    /// `tokenway_datagram_repair_bytes_total{side}`: FEC repair bytes sent (UDP payload).
    pub repair_bytes: Family<SideLabels, Counter>,
    /// `tokenway_datagram_source_bytes_total{side}`: source bytes sent (UDP payload).
    pub source_bytes: Family<SideLabels, Counter>,
    /// `tokenway_datagram_recovered_packets_total{side}`: lost packets restored by FEC.
    pub recovered: Family<SideLabels, Counter>,
    /// `tokenway_datagram_lost_packets_total{side}`: losses seen by the receiver, before FEC.
    pub lost: Family<SideLabels, Counter>,
    /// `tokenway_datagram_residual_loss_total{side}`: losses FEC could not restore.
    pub residual: Family<SideLabels, Counter>,
    /// `tokenway_datagram_decodes_refused_total{side}`: Reed-Solomon decodes a peer had not
    /// earned with source packets (forged repair packets).
    pub decodes_refused: Family<SideLabels, Counter>,
    /// `tokenway_datagram_blocks_missing_total{side}`: whole FEC blocks that never arrived
    /// (their packets are in neither the lost nor the residual count).
    pub blocks_missing: Family<SideLabels, Counter>,
    /// `tokenway_datagram_loss_burst_packets{side}`: loss bursts by length (bucketed as the
    /// receiver counts them; a burst in the 5–8 bucket is observed as 8, and so on).
    pub bursts: Family<SideLabels, Histogram, BurstHistogram>,
    /// `tokenway_datagram_dropped_total{side,reason}`: datagrams dropped by the layer.
    pub dropped: Family<DropLabels, Counter>,
    /// `tokenway_datagram_peers{side}`: peers with layer state.
    pub peers: Family<SideLabels, Gauge>,
}

impl Default for DatagramMetrics {
    /// Unregistered families (see [`DatagramMetrics::register_into`]).
    fn default() -> Self {
        Self {
            source_packets: Family::default(),
            plain_packets: Family::default(),
            repair_packets: Family::default(),
            repair_bytes: Family::default(),
            source_bytes: Family::default(),
            recovered: Family::default(),
            lost: Family::default(),
            residual: Family::default(),
            decodes_refused: Family::default(),
            blocks_missing: Family::default(),
            bursts: Family::new_with_constructor(BurstHistogram),
            dropped: Family::default(),
            peers: Family::default(),
        }
    }
}

impl std::fmt::Debug for DatagramMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DatagramMetrics")
    }
}

impl DatagramMetrics {
    /// Creates the families and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        m.register_into(registry);
        m
    }

    /// Registers these families (clones share the values) in `registry`.
    pub fn register_into(&self, registry: &mut Registry) {
        let r = registry;
        r.register(
            "datagram_source_packets",
            "QUIC datagrams sent as FEC source packets",
            self.source_packets.clone(),
        );
        r.register(
            "datagram_plain_packets",
            "QUIC datagrams sent outside FEC by the datagram layer",
            self.plain_packets.clone(),
        );
        r.register(
            "datagram_source_bytes",
            "UDP payload bytes of FEC source packets sent",
            self.source_bytes.clone(),
        );
        r.register(
            "datagram_repair_packets",
            "FEC repair packets sent",
            self.repair_packets.clone(),
        );
        r.register(
            "datagram_repair_bytes",
            "UDP payload bytes of FEC repair packets sent",
            self.repair_bytes.clone(),
        );
        r.register(
            "datagram_recovered_packets",
            "Lost packets restored by FEC and handed to QUIC",
            self.recovered.clone(),
        );
        r.register(
            "datagram_lost_packets",
            "Source packets the FEC receiver saw missing, before recovery",
            self.lost.clone(),
        );
        r.register(
            "datagram_residual_loss",
            "Missing source packets FEC could not restore",
            self.residual.clone(),
        );
        r.register(
            "datagram_decodes_refused",
            "Reed-Solomon decodes not done: the peer had not earned them with source packets",
            self.decodes_refused.clone(),
        );
        r.register(
            "datagram_blocks_missing",
            "Whole FEC blocks that never arrived (sources and repairs all lost); not in the lost or residual counts",
            self.blocks_missing.clone(),
        );
        r.register(
            "datagram_loss_burst_packets",
            "Loss bursts inside FEC blocks, by length in packets",
            self.bursts.clone(),
        );
        r.register(
            "datagram_dropped",
            "Datagrams dropped by the datagram layer, by reason",
            self.dropped.clone(),
        );
        r.register(
            "datagram_peers",
            "Peers with datagram-layer state",
            self.peers.clone(),
        );
    }

    /// Adds `n` drops of `reason` on `side`.
    pub fn add_dropped(&self, side: &str, reason: &str, n: u64) {
        if n > 0 {
            self.dropped
                .get_or_create(&DropLabels {
                    side: side.to_string(),
                    reason: reason.to_string(),
                })
                .inc_by(n);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagram_series_render_with_their_names() {
        let mut reg = crate::new_registry();
        let m = DatagramMetrics::register(&mut reg);
        let side = SideLabels {
            side: "server".into(),
        };
        m.recovered.get_or_create(&side).inc_by(3);
        m.bursts.get_or_create(&side).observe(2.0);
        m.add_dropped("server", "stranger", 5);
        let text = crate::render(&reg);
        for want in [
            "tokenway_datagram_recovered_packets_total{side=\"server\"} 3",
            "tokenway_datagram_dropped_total{side=\"server\",reason=\"stranger\"} 5",
            "tokenway_datagram_loss_burst_packets_bucket{le=\"2.0\",side=\"server\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing in {text}");
        }
    }
}
