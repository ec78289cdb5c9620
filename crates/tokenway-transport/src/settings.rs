//! QUIC settings shared by both ends: congestion controller, keep-alive, idle timeout, buffers.
//!
//! Tuned for latency: stream priority classes (control > interactive > bulk, see
//! `h3_quinn_prio`) decide what goes out first, so a small message is never queued behind a big
//! one on another stream; keep-alives well inside NAT binding lifetimes; large socket buffers so
//! bursts of tokens are not dropped by the kernel.

use std::sync::Arc;
use std::time::Duration;

use quinn::congestion::{BbrConfig, CubicConfig, NewRenoConfig};
use quinn::{IdleTimeout, TransportConfig, VarInt};
use serde::Deserialize;

use crate::error::TransportError;

/// Which congestion controller drives a connection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CongestionControl {
    /// CUBIC (RFC 9438); the default.
    #[default]
    Cubic,
    /// BBR (quinn's experimental BBRv1).
    Bbr,
    /// NewReno (RFC 9002 §7), for comparison.
    NewReno,
}

impl std::str::FromStr for CongestionControl {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self, TransportError> {
        match s {
            "cubic" => Ok(Self::Cubic),
            "bbr" => Ok(Self::Bbr),
            "new_reno" => Ok(Self::NewReno),
            other => Err(TransportError::Config(format!(
                "cc must be one of cubic, bbr, new_reno (got {other:?})"
            ))),
        }
    }
}

/// QUIC settings (`[quic]` in the gateway and edge configs).
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuicSettings {
    /// Congestion controller: `cubic`, `bbr`, `new_reno`.
    pub cc: CongestionControl,
    /// Keep-alive (PING) interval, milliseconds; 0 disables.
    pub keep_alive_ms: u64,
    /// Idle timeout, milliseconds.
    pub idle_timeout_ms: u64,
    /// RTT assumed before the first sample, milliseconds (clients seed it from the last
    /// measurement to the same server).
    pub initial_rtt_ms: u64,
    /// Most concurrent bidirectional streams the peer may open.
    pub max_concurrent_streams: u32,
    /// Kernel send and receive buffer of the UDP socket, bytes.
    pub socket_buffer_bytes: usize,
    /// Accept (server) or send (client) 0-RTT early data on resumed connections.
    pub zero_rtt: bool,
}

impl Default for QuicSettings {
    fn default() -> Self {
        Self {
            cc: CongestionControl::Cubic,
            keep_alive_ms: 5_000,
            idle_timeout_ms: 30_000,
            initial_rtt_ms: 100,
            max_concurrent_streams: 1_024,
            socket_buffer_bytes: 4 << 20,
            zero_rtt: true,
        }
    }
}

impl QuicSettings {
    /// Checks ranges; the error names the key (prefixed with `section`, e.g. `quic`).
    pub fn validate(&self, section: &str) -> Result<(), TransportError> {
        let bad = |key: &str, rule: &str, got: &dyn std::fmt::Display| {
            TransportError::Config(format!("{section}.{key} must be {rule} (got {got})"))
        };
        if self.idle_timeout_ms == 0 || self.idle_timeout_ms > 600_000 {
            return Err(bad(
                "idle_timeout_ms",
                "in 1..=600000",
                &self.idle_timeout_ms,
            ));
        }
        if self.keep_alive_ms >= self.idle_timeout_ms {
            return Err(bad(
                "keep_alive_ms",
                "below idle_timeout_ms (or 0 to disable)",
                &self.keep_alive_ms,
            ));
        }
        if self.initial_rtt_ms == 0 || self.initial_rtt_ms > 10_000 {
            return Err(bad("initial_rtt_ms", "in 1..=10000", &self.initial_rtt_ms));
        }
        if self.max_concurrent_streams == 0 || self.max_concurrent_streams > 100_000 {
            return Err(bad(
                "max_concurrent_streams",
                "in 1..=100000",
                &self.max_concurrent_streams,
            ));
        }
        if self.socket_buffer_bytes < 65_536 || self.socket_buffer_bytes > 1 << 30 {
            return Err(bad(
                "socket_buffer_bytes",
                "in 65536..=1073741824",
                &self.socket_buffer_bytes,
            ));
        }
        Ok(())
    }

    /// The quinn transport configuration; `initial_rtt` overrides the configured one (a client
    /// passes its last measurement to this server).
    pub fn transport_config(&self, initial_rtt: Option<Duration>) -> TransportConfig {
        let mut t = TransportConfig::default();
        // Fairness on: quinn then sends strictly by priority class and round-robins within a
        // class. With fairness off quinn keeps writing a started stream until its buffer is empty,
        // whatever the priorities, so a bulk upload would hold back a small interactive request
        // (measured in tests/transport.rs `report_priority_races`).
        t.send_fairness(true);
        if self.keep_alive_ms > 0 {
            t.keep_alive_interval(Some(Duration::from_millis(self.keep_alive_ms)));
        }
        // validate() bounds the timeout far below IdleTimeout's 2^62 ms limit.
        let idle = IdleTimeout::from(VarInt::from_u32(
            u32::try_from(self.idle_timeout_ms).unwrap_or(u32::MAX),
        ));
        t.max_idle_timeout(Some(idle));
        t.initial_rtt(initial_rtt.unwrap_or(Duration::from_millis(self.initial_rtt_ms)));
        t.max_concurrent_bidi_streams(VarInt::from_u32(self.max_concurrent_streams));
        // Flow-control windows sized for a long-prompt upload over a few hundred ms of RTT.
        t.stream_receive_window(VarInt::from_u32(8 << 20));
        t.receive_window(VarInt::from_u32(32 << 20));
        t.send_window(32 << 20);
        match self.cc {
            CongestionControl::Cubic => {
                t.congestion_controller_factory(Arc::new(CubicConfig::default()));
            }
            CongestionControl::Bbr => {
                t.congestion_controller_factory(Arc::new(BbrConfig::default()));
            }
            CongestionControl::NewReno => {
                t.congestion_controller_factory(Arc::new(NewRenoConfig::default()));
            }
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_bad_values_name_the_key() {
        QuicSettings::default()
            .validate("quic")
            .expect("defaults valid");
        let s = QuicSettings {
            keep_alive_ms: 40_000,
            ..QuicSettings::default()
        };
        let e = s.validate("quic").unwrap_err().to_string();
        assert!(e.contains("quic.keep_alive_ms"), "{e}");
        assert!("vegas".parse::<CongestionControl>().is_err());
        assert_eq!(
            "bbr".parse::<CongestionControl>().ok(),
            Some(CongestionControl::Bbr)
        );
    }
}
