//! The tunnel client's configuration: token, trust, gateways, QUIC and fallback settings.
//!
//! The edge reads these keys at the top of its file (flattened into its own configuration); a
//! gateway reads them as its `[overflow]` table (docs/edge.md lists every key).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::trust::{parse_pin, Trust};
use crate::{DatagramSettings, QuicSettings, TransportError};

/// What a tunnel client needs to reach its gateways.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TunnelClientConfig {
    /// The shared tunnel token, sent as `tw-auth` on every tunnel request.
    pub token: String,
    /// Which gateway certificates are trusted.
    pub trust: TrustConfig,
    /// The gateways, in no particular order (the lowest smoothed RTT is used).
    pub gateways: Vec<GatewayEntry>,
    /// QUIC settings of the tunnel connections.
    #[serde(default)]
    pub quic: QuicSettings,
    /// How long QUIC runs alone before the TCP fallback joins the race, milliseconds.
    #[serde(default = "default_head_start")]
    pub fallback_head_start_ms: u64,
    /// How often the choice of gateway is re-evaluated, milliseconds.
    #[serde(default = "default_reevaluate")]
    pub reevaluate_ms: u64,
    /// Longest wait for one connection attempt, milliseconds.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// While on the TCP fallback, how often QUIC is tried again, milliseconds.
    #[serde(default = "default_quic_retry")]
    pub quic_retry_ms: u64,
    /// `[datagram]`: the datagram layer under the tunnel's QUIC (FEC, obfuscation) and the
    /// tunnel's congestion control (docs/datagram-layer.md); absent means plain QUIC. `fec`
    /// (off or not) and `obfs.psk` must match the gateway's `[tunnel.datagram]`.
    #[serde(default)]
    pub datagram: Option<DatagramSettings>,
}

/// `[trust]`: exactly one of `ca_file` or `pin_sha256`.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrustConfig {
    /// PEM file of CA certificates.
    pub ca_file: Option<PathBuf>,
    /// `sha256:<hex>` fingerprints of accepted (self-signed) gateway certificates.
    #[serde(default)]
    pub pin_sha256: Vec<String>,
}

/// `[[gateways]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayEntry {
    /// Name, for logs and metric labels.
    pub name: String,
    /// The gateway's tunnel port, UDP, `host:port`.
    pub quic: String,
    /// The gateway's TLS TCP port for the fallback, `host:port`.
    pub tcp: Option<String>,
    /// TLS server name (SNI).
    #[serde(default = "default_server_name")]
    pub server_name: String,
}

fn default_head_start() -> u64 {
    250
}
fn default_reevaluate() -> u64 {
    10_000
}
fn default_connect_timeout() -> u64 {
    3_000
}
fn default_quic_retry() -> u64 {
    3_000
}
fn default_server_name() -> String {
    "localhost".into()
}

/// The shortest tunnel token the gateway accepts (its `tunnel.tokens` rule).
pub const MIN_TOKEN_LEN: usize = 16;

/// Whether `s` is `host:port` with a non-empty host and a port above 0.
pub fn is_host_port(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

impl TunnelClientConfig {
    /// Checks every key; the error names the bad key and the allowed values.
    pub fn validate(&self) -> Result<(), TransportError> {
        let bad = |m: String| Err(TransportError::Config(m));
        if self.token.trim().is_empty() {
            return bad("token must not be empty (the gateway's [tunnel] tokens entry)".into());
        }
        // The gateway accepts no shorter token (its `tunnel.tokens`): a shorter one would only
        // ever see the gateway's masquerade site.
        if self.token.len() < MIN_TOKEN_LEN {
            return bad(format!(
                "token must be at least {MIN_TOKEN_LEN} characters, as the gateway's [tunnel] \
                 tokens require (got {})",
                self.token.len()
            ));
        }
        if http::HeaderValue::from_str(&self.token).is_err() {
            return bad("token must be printable ASCII (it travels as the tw-auth header)".into());
        }
        self.trust()?;
        if self.gateways.is_empty() {
            return bad("gateways must list at least one [[gateways]] entry".into());
        }
        for (i, g) in self.gateways.iter().enumerate() {
            if g.name.trim().is_empty() {
                return bad(format!("gateways[{i}].name must not be empty"));
            }
            if let Some(why) = tokenway_telemetry::label_value_problem(&g.name) {
                return bad(format!(
                    "gateways[{i}].name {:?} must not contain {why} (it labels metrics)",
                    g.name
                ));
            }
            if self.gateways[..i].iter().any(|o| o.name == g.name) {
                return bad(format!("gateways[{i}].name {:?} is used twice", g.name));
            }
            if !is_host_port(&g.quic) {
                return bad(format!(
                    "gateways[{i}].quic must be host:port (got {:?})",
                    g.quic
                ));
            }
            if let Some(t) = &g.tcp {
                if !is_host_port(t) {
                    return bad(format!("gateways[{i}].tcp must be host:port (got {t:?})"));
                }
            }
            if g.server_name.trim().is_empty() {
                return bad(format!("gateways[{i}].server_name must not be empty"));
            }
            if rustls::pki_types::ServerName::try_from(g.server_name.as_str()).is_err() {
                return bad(format!(
                    "gateways[{i}].server_name must be a DNS name or an IP address (got {:?})",
                    g.server_name
                ));
            }
        }
        self.quic.validate("quic")?;
        if let Some(d) = &self.datagram {
            d.validate("datagram")?;
        }
        if self.fallback_head_start_ms > 10_000 {
            return bad(format!(
                "fallback_head_start_ms must be in 0..=10000 (got {})",
                self.fallback_head_start_ms
            ));
        }
        if !(100..=3_600_000).contains(&self.reevaluate_ms) {
            return bad(format!(
                "reevaluate_ms must be in 100..=3600000 (got {})",
                self.reevaluate_ms
            ));
        }
        if !(100..=60_000).contains(&self.connect_timeout_ms) {
            return bad(format!(
                "connect_timeout_ms must be in 100..=60000 (got {})",
                self.connect_timeout_ms
            ));
        }
        if !(100..=600_000).contains(&self.quic_retry_ms) {
            return bad(format!(
                "quic_retry_ms must be in 100..=600000 (got {})",
                self.quic_retry_ms
            ));
        }
        Ok(())
    }

    /// The QUIC settings of tunnel connections: `[quic]` with the `[datagram]` layer.
    pub fn tunnel_quic(&self) -> QuicSettings {
        let mut q = self.quic.clone();
        q.datagram = self.datagram.clone();
        q
    }

    /// The trust setting.
    pub fn trust(&self) -> Result<Trust, TransportError> {
        match (&self.trust.ca_file, self.trust.pin_sha256.is_empty()) {
            (Some(_), false) => Err(TransportError::Config(
                "trust: set either ca_file or pin_sha256, not both".into(),
            )),
            (None, true) => Err(TransportError::Config(
                "trust: set ca_file (PEM roots) or pin_sha256 (gateway certificate fingerprints)"
                    .into(),
            )),
            (Some(f), true) => Ok(Trust::CaFile(f.clone())),
            (None, false) => {
                for p in &self.trust.pin_sha256 {
                    parse_pin(p)?;
                }
                Ok(Trust::Pinned(self.trust.pin_sha256.clone()))
            }
        }
    }

    /// `fallback_head_start_ms` as a duration.
    pub fn head_start(&self) -> Duration {
        Duration::from_millis(self.fallback_head_start_ms)
    }

    /// `reevaluate_ms` as a duration.
    pub fn reevaluate(&self) -> Duration {
        Duration::from_millis(self.reevaluate_ms)
    }

    /// `connect_timeout_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// `quic_retry_ms` as a duration.
    pub fn quic_retry(&self) -> Duration {
        Duration::from_millis(self.quic_retry_ms)
    }
}
