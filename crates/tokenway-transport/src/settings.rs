//! QUIC settings shared by both ends: congestion controller, keep-alive, idle timeout, buffers.
//!
//! Tuned for latency: stream priority classes (control > interactive > bulk, see
//! `h3_quinn_prio`) decide what goes out first, so a small message is never queued behind a big
//! one on another stream; keep-alives well inside NAT binding lifetimes; large socket buffers so
//! bursts of tokens are not dropped by the kernel.

use std::sync::Arc;
use std::time::Duration;

use quinn::congestion::{BbrConfig, ControllerFactory, CubicConfig, NewRenoConfig};
use quinn::{IdleTimeout, TransportConfig, VarInt};
use serde::Deserialize;
use tokenway_wire::fec::{FecConfig, FecMode, FecScope};

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
    /// Brutal: a fixed target rate, loss-compensated (see [`crate::brutal`]). Only for tunnel
    /// connections with a known link capacity (`bandwidth.up` in the datagram settings).
    Brutal,
}

impl std::str::FromStr for CongestionControl {
    type Err = TransportError;
    fn from_str(s: &str) -> Result<Self, TransportError> {
        match s {
            "cubic" => Ok(Self::Cubic),
            "bbr" => Ok(Self::Bbr),
            "new_reno" => Ok(Self::NewReno),
            "brutal" => Ok(Self::Brutal),
            other => Err(TransportError::Config(format!(
                "cc must be one of cubic, bbr, new_reno, brutal (got {other:?})"
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
    /// The datagram layer (FEC, obfuscation, tunnel congestion control) under this endpoint.
    /// Not a `[quic]` key: a role copies it from its tunnel section (`[tunnel.datagram]` on the
    /// gateway, `[datagram]` on the edge). `None` (the default) keeps plain QUIC over UDP.
    #[serde(skip)]
    pub datagram: Option<DatagramSettings>,
    /// Where the datagram layer's counters go (set by the role together with `datagram`).
    #[serde(skip)]
    pub datagram_metrics: Option<tokenway_telemetry::datagram::DatagramMetrics>,
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
            datagram: None,
            datagram_metrics: None,
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
        if self.cc == CongestionControl::Brutal {
            return Err(bad(
                "cc",
                "cubic, bbr or new_reno (brutal is a tunnel setting: `cc` and `bandwidth.up` \
                 in the datagram section)",
                &"brutal",
            ));
        }
        if let Some(d) = &self.datagram {
            d.validate("datagram")?;
        }
        Ok(())
    }

    /// The quinn transport configuration; `initial_rtt` overrides the configured one (a client
    /// passes its last measurement to this server).
    ///
    /// This is the client side's configuration: with a datagram layer whose `cc` is `brutal`,
    /// the connection starts at the brutal rate. [`Self::server_transport_config`] is the
    /// server's.
    pub fn transport_config(&self, initial_rtt: Option<Duration>) -> TransportConfig {
        self.build_transport_config(initial_rtt, true)
    }

    /// The server side's quinn transport configuration. With a datagram layer, connections
    /// start on the base controller and switch to brutal only when the peer advertises its
    /// receive rate (see [`crate::cc`]).
    pub fn server_transport_config(&self) -> TransportConfig {
        self.build_transport_config(None, false)
    }

    fn build_transport_config(
        &self,
        initial_rtt: Option<Duration>,
        client: bool,
    ) -> TransportConfig {
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
        if let Some(d) = &self.datagram {
            // The layer adds up to `overhead` bytes to every QUIC datagram. quinn never goes
            // below 1200 bytes (RFC 9000 §14: Initials are padded to 1200), so the floor stays;
            // 1200 + 18 still fits any path that carries IPv6's 1280. The ceiling of MTU
            // discovery (quinn's default 1452, i.e. a 1500-byte IPv6 path) is lowered by the
            // overhead, so that a full-size QUIC packet plus its layer header, and every repair
            // packet, still fits that path. Probes above a smaller real path MTU are lost and
            // discovery settles below; the layer sends each probe padded to the size of its
            // repairs (`FecSender::set_quic_mtu`), so the size it settles on carries them too.
            let overhead = u16::try_from(d.overhead()).unwrap_or(u16::MAX);
            let mut mtu = quinn::MtuDiscoveryConfig::default();
            mtu.upper_bound(DEFAULT_MTU_UPPER_BOUND.saturating_sub(overhead).max(1200));
            t.mtu_discovery_config(Some(mtu));
            let base = match d.cc {
                Some(cc) if cc != CongestionControl::Brutal => cc,
                _ => self.cc,
            };
            if d.fec.0 != FecMode::Off {
                // Give FEC the time to repair before QUIC declares a loss. With the default
                // reordering threshold of 3 packets, a lost packet in a block is declared lost
                // (and sent again) as soon as 3 later packets are acknowledged, often before
                // the block's repair arrives; measured on `lossy`: QUIC declared 33-58 losses
                // while the layer left 2 unrepaired. Past a whole block, loss detection falls
                // to the time threshold (9/8 RTT) or to this packet count. A block is `k` long
                // in `fixed:K:R`, `fec_k_max` in `auto`.
                let block = match d.fec.0 {
                    FecMode::Fixed { k, .. } => k,
                    _ => d.fec_k_max,
                };
                t.packet_threshold(u32::from(block) + 3);
            }
            let factory = crate::cc::SwitchableConfig::new(base, d.brutal_plan(client));
            t.congestion_controller_factory(Arc::new(factory));
            return t;
        }
        t.congestion_controller_factory(base_factory(self.cc));
        t
    }
}

/// quinn's default ceiling of MTU discovery (a 1500-byte IPv6 path: 1500 − 40 − 8).
pub const DEFAULT_MTU_UPPER_BOUND: u16 = 1452;

/// The factory of a non-switchable controller (`brutal` falls back to cubic: it needs a rate,
/// which only the datagram settings carry).
pub(crate) fn base_factory(cc: CongestionControl) -> Arc<dyn ControllerFactory + Send + Sync> {
    match cc {
        CongestionControl::Cubic | CongestionControl::Brutal => Arc::new(CubicConfig::default()),
        CongestionControl::Bbr => Arc::new(BbrConfig::default()),
        CongestionControl::NewReno => Arc::new(NewRenoConfig::default()),
    }
}

/// A rate in bytes per second, written in config files as a number with a bit-rate unit:
/// `"20 mbps"`, `"500kbps"`, `"1.5 gbps"`, `"64000 bps"` (SI: 1 mbps = 10^6 bit/s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
#[serde(try_from = "String")]
pub struct Bandwidth(pub u64);

impl Bandwidth {
    /// Bytes per second.
    pub fn bytes_per_sec(self) -> u64 {
        self.0
    }
}

impl TryFrom<String> for Bandwidth {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl std::str::FromStr for Bandwidth {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim().to_ascii_lowercase();
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let scale = match unit.trim() {
            "bps" => 1.0,
            "kbps" => 1e3,
            "mbps" => 1e6,
            "gbps" => 1e9,
            _ => {
                return Err(format!(
                    "bandwidth {s:?}: write a number and a unit, bps, kbps, mbps or gbps (e.g. \"20 mbps\")"
                ))
            }
        };
        let n: f64 = num
            .parse()
            .map_err(|_| format!("bandwidth {s:?}: {num:?} is not a number"))?;
        let bytes = n * scale / 8.0;
        if !(bytes.is_finite() && (1.0..=1e12).contains(&bytes)) {
            return Err(format!("bandwidth {s:?} must be between 8 bps and 8 tbps"));
        }
        Ok(Self(bytes as u64))
    }
}

impl std::fmt::Display for Bandwidth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} mbps", self.0 as f64 * 8.0 / 1e6)
    }
}

/// FEC mode in config files: `"off"`, `"auto"` or `"fixed:K:R"` (blocks of K packets, R repair
/// packets each, both 1..=64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct FecSetting(pub FecMode);

impl TryFrom<String> for FecSetting {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let bad = || format!("fec must be \"off\", \"auto\" or \"fixed:K:R\" (got {s:?})");
        match s.trim() {
            "off" => Ok(Self(FecMode::Off)),
            "auto" => Ok(Self(FecMode::Auto)),
            other => {
                let mut it = other.strip_prefix("fixed:").ok_or_else(bad)?.split(':');
                let (Some(k), Some(r), None) = (it.next(), it.next(), it.next()) else {
                    return Err(bad());
                };
                let k = k.trim().parse().map_err(|_| bad())?;
                let r = r.trim().parse().map_err(|_| bad())?;
                Ok(Self(FecMode::Fixed { k, r }))
            }
        }
    }
}

/// Which packets FEC covers, in config files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FecScopeSetting {
    /// Only while the connection sends below `fec_bulk_above` (token streams, short
    /// requests); bulk transfers go out plain. The default.
    #[default]
    Interactive,
    /// Every packet.
    All,
}

/// `obfs` in the datagram settings.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObfsSettings {
    /// The pre-shared key (at least 16 bytes); both ends must hold the same one.
    pub psk: String,
}

impl std::fmt::Debug for ObfsSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ObfsSettings { psk: <redacted> }")
    }
}

/// `bandwidth` in the datagram settings.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BandwidthSettings {
    /// What this end may send: the brutal rate, and the cap on the rate the peer advertises.
    pub up: Option<Bandwidth>,
    /// What this end can receive, advertised to the peer (`tw-rx-rate`): the edge's on every
    /// tunnel request, the gateway's on every answer to one.
    pub down: Option<Bandwidth>,
}

/// The tunnel's datagram layer: FEC, obfuscation and the tunnel's congestion control
/// (`[tunnel.datagram]` on the gateway, `[datagram]` on the edge; docs/datagram-layer.md).
/// Both ends must agree on `fec` being off or not and on `obfs`, or no connection is made.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatagramSettings {
    /// `off`, `auto` (default) or `fixed:K:R`.
    pub fec: FecSetting,
    /// `interactive` (default) or `all`.
    pub fec_scope: FecScopeSetting,
    /// Most source packets per block in `auto` mode (1..=64).
    pub fec_k_max: u8,
    /// Cap on repair bytes per source byte in `auto` mode (0.0..=4.0).
    pub fec_max_overhead: f64,
    /// With scope `interactive`: above this send rate (per peer, over 100 ms) the connection
    /// counts as bulk and goes out plain.
    pub fec_bulk_above: Bandwidth,
    /// Obfuscation; absent means none.
    pub obfs: Option<ObfsSettings>,
    /// Congestion control of tunnel connections; absent means `[quic] cc`. `brutal` needs
    /// `bandwidth.up`.
    pub cc: Option<CongestionControl>,
    /// Link capacities for brutal and its negotiation.
    pub bandwidth: BandwidthSettings,
    /// Not a config key: where the layer built from these settings is, so that connections can
    /// feed it their RTT ([`crate::datagram::LayerSlot::follow_rtt`]). Clones share it.
    #[serde(skip)]
    pub layer: crate::datagram::LayerSlot,
}

impl Default for DatagramSettings {
    fn default() -> Self {
        Self {
            fec: FecSetting(FecMode::Auto),
            fec_scope: FecScopeSetting::Interactive,
            fec_k_max: 16,
            fec_max_overhead: 0.5,
            fec_bulk_above: Bandwidth(1_000_000),
            obfs: None,
            cc: None,
            bandwidth: BandwidthSettings::default(),
            layer: crate::datagram::LayerSlot::default(),
        }
    }
}

impl DatagramSettings {
    /// Checks every key; the error names it as `<section>.<key>` (`section` is where the
    /// table sits: `tunnel.datagram` on the gateway, `datagram` on the edge).
    pub fn validate(&self, section: &str) -> Result<(), TransportError> {
        let bad = |key: &str, rule: &str| {
            Err(TransportError::Config(format!(
                "{section}.{key} must be {rule}"
            )))
        };
        if !(1..=64).contains(&self.fec_k_max) {
            return bad("fec_k_max", &format!("in 1..=64 (got {})", self.fec_k_max));
        }
        if !(0.0..=4.0).contains(&self.fec_max_overhead) {
            return bad(
                "fec_max_overhead",
                &format!("in 0.0..=4.0 (got {})", self.fec_max_overhead),
            );
        }
        if let FecMode::Fixed { k, r } = self.fec.0 {
            if !(1..=64).contains(&k) || !(1..=64).contains(&r) {
                return bad(
                    "fec",
                    &format!("fixed:K:R with K and R in 1..=64 (got fixed:{k}:{r})"),
                );
            }
        }
        if let Err(e) = self.fec_config().validate() {
            return bad("fec", &e.to_string());
        }
        if let Some(o) = &self.obfs {
            if o.psk.len() < 16 {
                return bad("obfs.psk", "at least 16 characters");
            }
        }
        // A link's rates no lower than a peer's advertisement may set (`cc::MIN_PEER_RATE`):
        // below it an edge's `down` would be ignored without a word.
        for (key, rate) in [
            ("bandwidth.up", self.bandwidth.up),
            ("bandwidth.down", self.bandwidth.down),
        ] {
            if rate.is_some_and(|r| r.bytes_per_sec() < crate::cc::MIN_PEER_RATE) {
                return bad(key, "at least \"8 kbps\"");
            }
        }
        if self.cc == Some(CongestionControl::Brutal) && self.bandwidth.up.is_none() {
            return bad(
                "bandwidth.up",
                "set when cc = \"brutal\" (the link's send capacity, e.g. \"20 mbps\")",
            );
        }
        Ok(())
    }

    /// The wire crate's FEC sender configuration.
    pub fn fec_config(&self) -> FecConfig {
        FecConfig {
            mode: self.fec.0,
            scope: match self.fec_scope {
                FecScopeSetting::Interactive => FecScope::Interactive,
                FecScopeSetting::All => FecScope::All,
            },
            k_max: self.fec_k_max,
            max_overhead: self.fec_max_overhead,
            ..FecConfig::default()
        }
    }

    /// Bytes the layer adds at most to a QUIC datagram.
    pub fn overhead(&self) -> usize {
        tokenway_wire::fec::datagram_overhead(self.fec.0 != FecMode::Off, self.obfs.is_some())
    }

    /// The largest repair rate (bytes/s) the FEC sender can add on top of QUIC's `rate`:
    /// `auto` pays repairs from a budget of `fec_max_overhead` × source bytes, `fixed:K:R` adds
    /// R/K, and with scope `interactive` FEC runs only below `fec_bulk_above`.
    pub fn repair_reserve(&self, rate: u64) -> u64 {
        let ratio = match self.fec.0 {
            FecMode::Off => return 0,
            FecMode::Auto => self.fec_max_overhead,
            FecMode::Fixed { k, r } => f64::from(r) / f64::from(k.max(1)),
        };
        // Repairs ≤ ratio × the covered part of QUIC's rate q; the wire budget is
        // W = q + ratio · covered(q). Solve for the reserve W − q.
        let w = rate as f64;
        let bulk = self.fec_bulk_above.0 as f64;
        let reserve = match self.fec_scope {
            FecScopeSetting::Interactive if bulk * (1.0 + ratio) < w => ratio * bulk,
            _ => w * ratio / (1.0 + ratio),
        };
        reserve as u64
    }

    /// What the controller of a new connection does about brutal.
    pub(crate) fn brutal_plan(&self, client: bool) -> crate::cc::BrutalPlan {
        let up = self.bandwidth.up.map(Bandwidth::bytes_per_sec);
        let brutal = self.cc == Some(CongestionControl::Brutal);
        crate::cc::BrutalPlan {
            // The edge starts at its own `up` at once; the gateway waits for the edge's rate.
            initial: if brutal && client {
                up.map(|u| u.saturating_sub(self.repair_reserve(u)))
            } else {
                None
            },
            // Both ends cap a rate the peer advertises by their own `up`: the gateway switches
            // to brutal on the edge's, the edge lowers its own rate to the gateway's.
            cap: if brutal { up } else { None },
            settings: Arc::new(self.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quics_reordering_threshold_spans_a_whole_fec_block() {
        let threshold = |fec: FecMode| {
            let s = QuicSettings {
                datagram: Some(DatagramSettings {
                    fec: FecSetting(fec),
                    ..DatagramSettings::default()
                }),
                ..QuicSettings::default()
            };
            format!("{:?}", s.transport_config(None))
        };
        let auto = threshold(FecMode::Auto);
        assert!(auto.contains("packet_threshold: 19"), "{auto}");
        let fixed = threshold(FecMode::Fixed { k: 32, r: 4 });
        assert!(fixed.contains("packet_threshold: 35"), "{fixed}");
    }

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
        // Bandwidths: SI bit rates in bytes per second; a link's no lower than a peer's
        // advertisement may set (`fec_bulk_above` may be lower).
        assert_eq!("20 mbps".parse::<Bandwidth>(), Ok(Bandwidth(2_500_000)));
        assert_eq!("8kbps".parse::<Bandwidth>(), Ok(Bandwidth(1_000)));
        for bad in ["0 mbps", "4 bps", "9 tbps", "20", "20 mibps"] {
            assert!(bad.parse::<Bandwidth>().is_err(), "{bad} was taken");
        }
        let slow = DatagramSettings {
            bandwidth: BandwidthSettings {
                up: None,
                down: Some("4 kbps".parse().expect("a bandwidth")),
            },
            fec_bulk_above: "1 kbps".parse().expect("a bandwidth"),
            ..DatagramSettings::default()
        };
        let e = slow.validate("tunnel.datagram").unwrap_err().to_string();
        assert!(e.contains("tunnel.datagram.bandwidth.down"), "{e}");
        assert_eq!(
            "bbr".parse::<CongestionControl>().ok(),
            Some(CongestionControl::Bbr)
        );
    }
}
