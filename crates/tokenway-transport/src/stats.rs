//! Periodic sampling of a QUIC connection's statistics into the QUIC metric families.
//!
//! quinn keeps cumulative per-connection counters; the sampler turns them into per-peer counter
//! increments (so a reconnect does not make a counter go backwards) and sets the RTT and MTU
//! gauges. RTT variance is the mean deviation of the sampled smoothed RTT (RFC 6298 §2 style,
//! β = 1/4), since quinn does not expose its own `rttvar`.

use std::time::Duration;

use tokenway_telemetry::quic::{PeerLabels, QuicMetrics};

/// RTT statistics derived from successive samples.
#[derive(Debug, Default, Clone, Copy)]
pub struct RttTracker {
    srtt: Option<Duration>,
    var: Duration,
}

impl RttTracker {
    /// Feeds one RTT sample; returns the updated mean deviation.
    pub fn sample(&mut self, rtt: Duration) -> Duration {
        match self.srtt {
            None => {
                self.srtt = Some(rtt);
                self.var = rtt / 2;
            }
            Some(s) => {
                let dev = s.abs_diff(rtt);
                self.var = (self.var * 3 + dev) / 4;
                self.srtt = Some((s * 7 + rtt) / 8);
            }
        }
        self.var
    }
}

/// Which of the QUIC metric families a sampler writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sampled {
    /// Everything: the label names one connection at a time (an edge's gateway).
    Connection,
    /// The RTT histogram and the packet counters only: the label is shared by many connections
    /// (a server front), where a gauge would hold whichever connection was sampled last and
    /// keep it after every connection had closed.
    Shared,
}

/// Samples `conn` every `every` until it closes, writing into `metrics` under `peer`; the
/// counters get one last sample at the close, so a connection's last second (and the whole of
/// a connection shorter than `every`) is counted.
pub async fn sample_connection(
    conn: quinn::Connection,
    peer: String,
    metrics: QuicMetrics,
    every: Duration,
    sampled: Sampled,
) {
    let labels = PeerLabels { peer };
    let mut last_sent = 0u64;
    let mut last_lost = 0u64;
    let mut last_cong = 0u64;
    let mut tracker = RttTracker::default();
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let closed = tokio::select! {
            _ = conn.closed() => true,
            _ = tick.tick() => false,
        };
        let s = conn.stats();
        if !closed {
            let var = tracker.sample(s.path.rtt);
            metrics
                .rtt_samples
                .get_or_create(&labels)
                .observe(s.path.rtt.as_secs_f64());
            if sampled == Sampled::Connection {
                metrics
                    .rtt
                    .get_or_create(&labels)
                    .set(s.path.rtt.as_secs_f64());
                metrics
                    .min_rtt
                    .get_or_create(&labels)
                    .set(s.path.min_rtt.as_secs_f64());
                metrics
                    .rtt_var
                    .get_or_create(&labels)
                    .set(var.as_secs_f64());
                metrics
                    .path_mtu
                    .get_or_create(&labels)
                    .set(i64::from(s.path.current_mtu));
                metrics
                    .cwnd
                    .get_or_create(&labels)
                    .set(i64::try_from(s.path.cwnd).unwrap_or(i64::MAX));
                if let Some(rate) = crate::cc::rate_handle(&conn) {
                    metrics
                        .brutal_rate
                        .get_or_create(&labels)
                        .set(i64::try_from(rate.rate().unwrap_or(0)).unwrap_or(i64::MAX));
                }
            }
        }
        metrics
            .sent_packets
            .get_or_create(&labels)
            .inc_by(s.path.sent_packets.saturating_sub(last_sent));
        metrics
            .lost_packets
            .get_or_create(&labels)
            .inc_by(s.path.lost_packets.saturating_sub(last_lost));
        metrics
            .congestion_events
            .get_or_create(&labels)
            .inc_by(s.path.congestion_events.saturating_sub(last_cong));
        last_sent = s.path.sent_packets;
        last_lost = s.path.lost_packets;
        last_cong = s.path.congestion_events;
        if closed {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtt_variance_shrinks_on_steady_samples_and_grows_on_jitter() {
        let mut t = RttTracker::default();
        let ms = Duration::from_millis;
        assert_eq!(t.sample(ms(20)), ms(10));
        for _ in 0..20 {
            t.sample(ms(20));
        }
        let steady = t.sample(ms(20));
        assert!(steady < ms(1), "{steady:?}");
        let jittery = t.sample(ms(60));
        assert!(jittery > ms(5), "{jittery:?}");
    }
}
